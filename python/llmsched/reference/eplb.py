"""Pure-Python twin of :func:`llmsched.executor.eplb.rebalance_experts` (DeepSeek's EPLB).

Written straight from DeepSeek EPLB's three steps, one layer at a time with plain
lists, and the same tie-breaking: equal loads keep index order, equal packs take the lowest
pack, equal load per replica gives the replica to the lowest expert.

>>> phy2log, log2phy, logcnt = rebalance_experts([[90, 10, 10, 10]], 6, 1, 1, 2)
>>> phy2log, logcnt
([[0, 0, 3, 0, 1, 2]], [[3, 1, 1, 1]])
"""

from __future__ import annotations

from collections.abc import Sequence


def _pack(loads: Sequence[float], num_packs: int) -> list[list[int]]:
    """Items (heaviest first) into the lightest pack with room; each pack's items in order."""
    capacity = len(loads) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        open_packs = [p for p in range(num_packs) if len(packs[p]) < capacity]
        best = min(open_packs, key=lambda p: (totals[p], p))
        packs[best].append(item)
        totals[best] += loads[item]
    return packs


def _layer(
    load: Sequence[float], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[int], list[int]]:
    """phy2log and the replica rank of each physical slot, for one layer."""
    num_experts = len(load)
    group_size = num_experts // num_groups
    group_loads = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    phy2log: list[int] = []
    ranks: list[int] = []
    for node_groups in _pack(group_loads, num_nodes):
        experts = [g * group_size + j for g in node_groups for j in range(group_size)]
        slots = list(experts)  # slot -> expert, originals first
        slot_rank = [0] * len(experts)
        count = {e: 1 for e in experts}
        while len(slots) < num_replicas // num_nodes:
            busiest = max(experts, key=lambda e: (load[e] / count[e], -experts.index(e)))
            slots.append(busiest)
            slot_rank.append(count[busiest])
            count[busiest] += 1
        slot_loads = [load[e] / count[e] for e in slots]
        for gpu_slots in _pack(slot_loads, num_gpus // num_nodes):
            phy2log += [slots[s] for s in gpu_slots]
            ranks += [slot_rank[s] for s in gpu_slots]
    return phy2log, ranks


def rebalance_experts(
    load: Sequence[Sequence[float]],
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    """Same contract as the numpy version, as nested lists."""
    if num_groups % num_nodes:
        num_groups = num_nodes = 1
    layers = [
        _layer([float(x) for x in row], num_replicas, num_groups, num_nodes, num_gpus)
        for row in load
    ]
    num_experts = len(load[0])
    all_logcnt = [[phy2log.count(e) for e in range(num_experts)] for phy2log, _ in layers]
    width = max(max(counts) for counts in all_logcnt)  # padded to the largest count overall
    all_log2phy = []
    for phy2log, ranks in layers:
        log2phy = [[-1] * width for _ in range(num_experts)]
        for slot, (expert, rank) in enumerate(zip(phy2log, ranks, strict=True)):
            log2phy[expert][rank] = slot
        all_log2phy.append(log2phy)
    return [phy2log for phy2log, _ in layers], all_log2phy, all_logcnt
