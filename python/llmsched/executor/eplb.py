"""Expert placement and DeepSeek's expert-parallel load balancer (EPLB).

Algorithm (after DeepSeek's open-source EPLB). Input: ``load[L, E]``, the tokens
routed to each logical expert of each MoE layer. Output, per layer, a map of ``num_replicas``
physical expert slots (GPU ``g`` holds slots ``g*S/G .. (g+1)*S/G - 1``) to logical experts.

Hierarchical policy (used when ``num_groups % num_nodes == 0``):

1. Pack the expert groups onto nodes: groups sorted by total load, heaviest first, each into the
   lightest node that still has room (every node takes ``num_groups / num_nodes`` groups).
2. Within each node replicate: the node's ``num_replicas / num_nodes`` slots start with one
   replica of each of its experts; each extra slot goes to the expert whose load per replica is
   currently the largest.
3. Pack the node's physical replicas onto its GPUs the same way as step 1, a replica weighing
   ``load / replica count`` of its expert.

Otherwise the global policy runs the same three steps with one group and one node, so replicas
may land on any GPU.

Tie-breaking (fixed, so every rank computes the same map from the same load):

- sorting by load is stable, so among equal loads the lower index comes first;
- among packs of equal load the lowest-numbered pack is chosen;
- among experts with equal load per replica the lowest-numbered expert gets the extra replica.

Complexity: ``O(L * (E log E + S log S + (S - E) * E + S * G))``; the Python loops run over item
ranks and extra slots with all layers (and nodes) advanced together as numpy rows. The balancer
runs off the critical path.

Comparison: contiguous placement (expert ``e`` on GPU ``e // (E/G)``, no replicas) is the
baseline; ``gpu_loads`` measures both on the same load.

>>> import numpy as np
>>> load = np.array([[90, 10, 10, 10]])
>>> phy2log, log2phy, logcnt = rebalance_experts(load, 6, 1, 1, 2)
>>> logcnt.tolist()
[[3, 1, 1, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from llmsched.errors import ConfigError

__all__ = ["ExpertPlacement", "check_layout", "gpu_loads", "imbalance", "rebalance_experts"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def rebalance_experts(
    load: npt.ArrayLike,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[IntArray, IntArray, IntArray]:
    """DeepSeek's EPLB: place ``num_replicas`` physical experts per layer on ``num_gpus`` GPUs.

    Returns ``(phy2log[L, S], log2phy[L, E, R], logcnt[L, E])``: the logical expert of each
    physical slot, each logical expert's slots (``-1`` padded to the largest replica count
    ``R``), and each logical expert's replica count. Hierarchical when
    ``num_groups % num_nodes == 0``, global otherwise (module docstring has the details and the
    tie-breaking rules).

    >>> phy2log, log2phy, logcnt = rebalance_experts([[4, 3, 2, 1]], 4, 2, 2, 2)
    >>> phy2log.tolist()  # group {0, 1} carries 7, group {2, 3} carries 3: one per node
    [[0, 1, 2, 3]]
    """
    weights = _check_load(load)
    num_layers, num_experts = weights.shape
    check_layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = _hierarchical(
            weights, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logcnt = _hierarchical(weights, num_replicas, 1, 1, num_gpus)
    max_count = int(logcnt.max())
    log2phy = np.full((num_layers, num_experts, max_count), -1, dtype=np.int64)
    layer_index = np.repeat(np.arange(num_layers), num_replicas)
    log2phy[layer_index, phy2log.ravel(), phy_rank.ravel()] = np.tile(
        np.arange(num_replicas), num_layers
    )
    return phy2log, log2phy, logcnt


def _check_load(load: npt.ArrayLike) -> FloatArray:
    try:
        weights = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"load must be a numeric [layers, experts] array: {exc}") from None
    if weights.ndim != 2 or weights.shape[0] < 1 or weights.shape[1] < 1:
        raise ConfigError(f"load must be a non-empty [layers, experts] array, got {weights.shape}")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ConfigError("load must be finite and non-negative")
    return weights


def check_layout(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise the ConfigError :func:`rebalance_experts` would raise for this layout, if any.

    For callers that take the layout now and place experts later (the rebalancer).

    >>> check_layout(8, 8, 3, 1, 1)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: 8 experts do not split into 3 equal groups
    """
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        _positive_int(name, value)
    if num_experts % num_groups:
        raise ConfigError(f"{num_experts} experts do not split into {num_groups} equal groups")
    if num_replicas < num_experts:
        raise ConfigError(f"num_replicas ({num_replicas}) must be >= experts ({num_experts})")
    if num_replicas % num_gpus:
        raise ConfigError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus")
    if num_gpus % num_nodes:
        raise ConfigError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if num_groups % num_nodes == 0 and num_experts % num_nodes:
        raise ConfigError(f"{num_experts} experts do not split over {num_nodes} nodes")


def _positive_int(name: str, value: object) -> int:
    """``value`` as an int if it is a positive integer (numpy ones too, not bools), else a
    ConfigError naming ``name``.

    >>> _positive_int("num_gpus", 0)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: num_gpus must be a positive int, got 0
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _int_table(name: str, value: object, ndim: int) -> IntArray:
    """``value`` as an int64 array of ``ndim`` dimensions, or a ConfigError naming ``name``:
    whole numbers only (a float array of whole numbers is taken; 0.5 was truncated to 0).

    >>> _int_table("phy2log", [[0, 1.5]], 2)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: phy2log must hold whole numbers, got [[0.  1.5]]
    """
    try:
        table = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise ConfigError(f"{name} must be an array of ints: {exc}") from None
    kind = table.dtype.kind
    if kind not in "iuf":
        raise ConfigError(f"{name} must be an array of ints, got {table.dtype} values")
    if table.ndim != ndim:
        raise ConfigError(f"{name} must be a {ndim}-D array, got shape {table.shape}")
    if kind == "f" and not (np.isfinite(table).all() and (table == np.round(table)).all()):
        raise ConfigError(f"{name} must hold whole numbers, got {table}")
    if kind == "u" and table.size and int(table.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"{name} holds a value past int64: {int(table.max())}")
    return table.astype(np.int64)


def _hierarchical(
    weights: FloatArray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[IntArray, IntArray, IntArray]:
    num_layers, num_experts = weights.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    # Step 1: groups onto nodes. "Node-major" order numbers experts node by node, so each
    # node's experts are one contiguous run of experts_per_node.
    group_load = weights.reshape(num_layers, num_groups, group_size).sum(axis=-1)
    node_of_group, rank_in_node = _balanced_packing(group_load, num_nodes)
    group_start = (node_of_group * groups_per_node + rank_in_node) * group_size
    log2nodemajor = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, -1)
    nodemajor2log = _inverse(log2nodemajor)

    # Step 2: replicas within each node (rows are (layer, node) pairs from here on).
    node_load = np.take_along_axis(weights, nodemajor2log, axis=-1).reshape(-1, experts_per_node)
    slot2local, slot_rank, local_count = _replicate(node_load, slots_per_node)

    # Step 3: a node's physical replicas onto its GPUs.
    replica_load = np.take_along_axis(node_load / local_count, slot2local, axis=-1)
    gpu_of_slot, rank_on_gpu = _balanced_packing(replica_load, num_gpus // num_nodes)
    packed2slot = _inverse(gpu_of_slot * slots_per_gpu + rank_on_gpu)

    packed2local = np.take_along_axis(slot2local, packed2slot, axis=-1)
    node_offset = (np.arange(num_nodes) * experts_per_node)[None, :, None]
    packed2nodemajor = (packed2local.reshape(num_layers, num_nodes, -1) + node_offset).reshape(
        num_layers, -1
    )
    phy2log = np.take_along_axis(nodemajor2log, packed2nodemajor, axis=-1)
    phy_rank = np.take_along_axis(slot_rank, packed2slot, axis=-1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(local_count.reshape(num_layers, -1), log2nodemajor, axis=-1)
    return phy2log, phy_rank, logcnt


def _balanced_packing(weights: FloatArray, num_packs: int) -> tuple[IntArray, IntArray]:
    """Per row, items (heaviest first) into the lightest pack with room; equal-size packs.

    Rows are independent, so the loop runs over item ranks with every row advanced at once.
    """
    num_rows, num_items = weights.shape
    capacity = num_items // num_packs
    rows = np.arange(num_rows)
    order = np.argsort(-weights, axis=-1, kind="stable")
    pack_of = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    pack_load = np.zeros((num_rows, num_packs))
    pack_size = np.zeros((num_rows, num_packs), dtype=np.int64)
    for position in range(num_items):
        item = order[:, position]
        open_load = np.where(pack_size < capacity, pack_load, np.inf)
        pack = np.argmin(open_load, axis=-1)
        pack_of[rows, item] = pack
        rank_in_pack[rows, item] = pack_size[rows, pack]
        pack_load[rows, pack] += weights[rows, item]
        pack_size[rows, pack] += 1
    return pack_of, rank_in_pack


def _replicate(weights: FloatArray, num_slots: int) -> tuple[IntArray, IntArray, IntArray]:
    """One replica per item, then each extra slot to the item with most load per replica."""
    num_rows, num_items = weights.shape
    slot2item = np.tile(np.arange(num_slots, dtype=np.int64), (num_rows, 1))
    slot_rank = np.zeros((num_rows, num_slots), dtype=np.int64)
    count = np.ones((num_rows, num_items), dtype=np.int64)
    rows = np.arange(num_rows)
    for slot in range(num_items, num_slots):
        busiest = np.argmax(weights / count, axis=-1)
        slot2item[:, slot] = busiest
        slot_rank[:, slot] = count[rows, busiest]
        count[rows, busiest] += 1
    return slot2item, slot_rank, count


def _inverse(perm: IntArray) -> IntArray:
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.broadcast_to(np.arange(perm.shape[-1]), perm.shape), -1)
    return inverse


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot of each layer holds.

    ``phy2log[L, S]``, ``log2phy[L, E, R]`` (``-1`` padded) and ``logcnt[L, E]`` are exactly what
    :func:`rebalance_experts` returns. GPU (or rank) ``g`` of ``G`` holds the contiguous slots
    ``g*S/G .. (g+1)*S/G - 1``.

    >>> p = ExpertPlacement.contiguous(num_layers=1, num_experts=4)
    >>> p.phy2log.tolist(), p.num_slots
    ([[0, 1, 2, 3]], 4)
    """

    phy2log: IntArray
    log2phy: IntArray
    logcnt: IntArray

    def __post_init__(self) -> None:
        # Every table is checked whole: a log2phy that disagreed with phy2log sent a logical
        # expert's tokens to a slot holding another expert, silently.
        phy2log = _int_table("phy2log", self.phy2log, 2)
        log2phy = _int_table("log2phy", self.log2phy, 3)
        logcnt = _int_table("logcnt", self.logcnt, 2)
        for name, table in (("phy2log", phy2log), ("log2phy", log2phy), ("logcnt", logcnt)):
            object.__setattr__(self, name, table)
            if 0 in table.shape:
                raise ConfigError(f"{name} must not be empty, got shape {table.shape}")
        num_layers, num_slots = phy2log.shape
        if logcnt.shape[0] != num_layers or log2phy.shape[:2] != logcnt.shape:
            raise ConfigError("phy2log, log2phy and logcnt disagree on layers or experts")
        num_experts = logcnt.shape[1]
        if (phy2log < 0).any() or (phy2log >= num_experts).any():
            raise ConfigError(f"phy2log names experts outside 0..{num_experts - 1}")
        counts = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
        if (counts != logcnt).any():
            raise ConfigError("logcnt does not count the replicas in phy2log")
        if (logcnt < 1).any():
            raise ConfigError("every logical expert needs at least one physical slot")
        if log2phy.shape[2] < int(logcnt.max()):
            raise ConfigError(
                f"log2phy has room for {log2phy.shape[2]} replicas an expert, logcnt needs "
                f"{int(logcnt.max())}"
            )
        listed = np.arange(log2phy.shape[2])[None, None, :] < logcnt[:, :, None]
        if (log2phy[~listed] != -1).any():
            raise ConfigError("log2phy must be -1 past each expert's replica count (logcnt)")
        slots = log2phy[listed]  # in (layer, expert, rank) order
        layer_of = np.broadcast_to(np.arange(num_layers)[:, None, None], log2phy.shape)[listed]
        expert_of = np.broadcast_to(np.arange(num_experts)[None, :, None], log2phy.shape)[listed]
        if (
            (slots < 0).any()
            or (slots >= num_slots).any()
            or (phy2log[layer_of, np.clip(slots, 0, num_slots - 1)] != expert_of).any()
            or np.unique(layer_of * num_slots + slots).size != slots.size
        ):
            raise ConfigError("log2phy does not list the slots phy2log gives each expert")

    @classmethod
    def contiguous(
        cls, num_layers: int, num_experts: int, num_slots: int | None = None
    ) -> ExpertPlacement:
        """Experts in order, one slot each (expert ``e`` on GPU ``e // (E / G)``); any extra
        slots hold a second replica of experts ``0, 1, ...`` in turn.

        >>> ExpertPlacement.contiguous(2, 3).logcnt.tolist()
        [[1, 1, 1], [1, 1, 1]]
        >>> ExpertPlacement.contiguous(1, 3, 4).phy2log.tolist()
        [[0, 1, 2, 0]]
        """
        _positive_int("num_layers", num_layers)
        _positive_int("num_experts", num_experts)
        slots = num_experts if num_slots is None else _positive_int("num_slots", num_slots)
        if slots < num_experts:
            raise ConfigError(f"{slots} slots cannot hold {num_experts} experts")
        row = np.arange(slots, dtype=np.int64) % num_experts
        return cls.from_phy2log(np.tile(row, (num_layers, 1)), num_experts)

    @classmethod
    def from_phy2log(cls, phy2log: npt.ArrayLike, num_experts: int) -> ExpertPlacement:
        """Build the inverse maps of ``phy2log``; replicas are ranked by slot order.

        >>> ExpertPlacement.from_phy2log([[0, 1, 0]], 2).log2phy.tolist()
        [[[0, 2], [1, -1]]]
        """
        num_experts = _positive_int("num_experts", num_experts)
        table = _int_table("phy2log", phy2log, 2)
        if table.size == 0:
            raise ConfigError(f"phy2log must be a non-empty [layers, slots] array: {table.shape}")
        if (table < 0).any() or (table >= num_experts).any():
            raise ConfigError(f"phy2log names experts outside 0..{num_experts - 1}")
        logcnt = np.stack([np.bincount(row, minlength=num_experts) for row in table])
        log2phy = np.full((*logcnt.shape, max(1, int(logcnt.max()))), -1, dtype=np.int64)
        for layer, row in enumerate(table):
            seen = np.zeros(num_experts, dtype=np.int64)
            for slot, expert in enumerate(row):
                log2phy[layer, expert, seen[expert]] = slot
                seen[expert] += 1
        return cls(table, log2phy, logcnt.astype(np.int64))

    @classmethod
    def rebalanced(
        cls,
        load: npt.ArrayLike,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_gpus: int,
    ) -> ExpertPlacement:
        """The placement :func:`rebalance_experts` computes for ``load``.

        >>> ExpertPlacement.rebalanced([[9, 1]], 3, 1, 1, 1).logcnt.tolist()
        [[2, 1]]
        """
        return cls(*rebalance_experts(load, num_replicas, num_groups, num_nodes, num_gpus))

    @property
    def num_layers(self) -> int:
        """Number of MoE layers."""
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        """Physical slots per layer (``num_replicas``)."""
        return int(self.phy2log.shape[1])

    @property
    def num_experts(self) -> int:
        """Logical experts per layer."""
        return int(self.logcnt.shape[1])

    def layer(self, layer: int) -> ExpertPlacement:
        """The one-layer placement of ``layer`` (used when experts move layer by layer).

        >>> ExpertPlacement.contiguous(3, 2).layer(1).num_layers
        1
        """
        layer = self._layer_index(layer)
        return ExpertPlacement(
            self.phy2log[layer : layer + 1],
            self.log2phy[layer : layer + 1],
            self.logcnt[layer : layer + 1],
        )

    def _layer_index(self, layer: object) -> int:
        """``layer`` if it is a layer of this placement (0 to ``num_layers - 1``): a negative
        one counted from the end, and one past the end gave an empty placement (a bare
        ValueError) or a bare IndexError."""
        if (
            isinstance(layer, (bool, np.bool_))
            or not isinstance(layer, (int, np.integer))
            or not 0 <= layer < self.num_layers
        ):
            raise ConfigError(f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")
        return int(layer)

    def with_layer(self, layer: int, other: ExpertPlacement) -> ExpertPlacement:
        """A copy whose ``layer`` comes from the one-layer placement ``other``.

        >>> a = ExpertPlacement.contiguous(2, 2)
        >>> b = ExpertPlacement.from_phy2log([[1, 0]], 2)
        >>> a.with_layer(1, b).phy2log.tolist()
        [[0, 1], [1, 0]]
        """
        layer = self._layer_index(layer)
        if not isinstance(other, ExpertPlacement):
            raise ConfigError(f"with_layer needs an ExpertPlacement, got {type(other).__name__}")
        if other.num_layers != 1 or other.num_slots != self.num_slots:
            raise ConfigError("with_layer needs a one-layer placement with the same slot count")
        if other.num_experts != self.num_experts:
            raise ConfigError(
                f"with_layer got a placement of {other.num_experts} experts, this one has "
                f"{self.num_experts}"
            )
        phy2log = self.phy2log.copy()
        phy2log[layer] = other.phy2log[0]
        return ExpertPlacement.from_phy2log(phy2log, self.num_experts)


def gpu_loads(load: npt.ArrayLike, placement: ExpertPlacement, num_gpus: int) -> FloatArray:
    """Per layer and GPU, the tokens a placement sends there: ``[L, G]``.

    A logical expert's tokens are split evenly over its replicas (the executor picks replicas
    round-robin).

    >>> p = ExpertPlacement.contiguous(1, 4)
    >>> gpu_loads([[4, 2, 1, 1]], p, 2).tolist()
    [[6.0, 2.0]]
    """
    weights = _check_load(load)
    num_gpus = _positive_int("num_gpus", num_gpus)
    if weights.shape != placement.logcnt.shape:
        raise ConfigError(f"load shape {weights.shape} != placement {placement.logcnt.shape}")
    if placement.num_slots % num_gpus:
        raise ConfigError(f"{placement.num_slots} slots do not split over {num_gpus} GPUs")
    per_replica = weights / placement.logcnt
    slot_load = np.take_along_axis(per_replica, placement.phy2log, axis=-1)
    per_gpu: FloatArray = slot_load.reshape(weights.shape[0], num_gpus, -1).sum(axis=-1)
    return per_gpu


def imbalance(load: npt.ArrayLike, placement: ExpertPlacement, num_gpus: int) -> float:
    """Max over mean per-GPU load, averaged over layers (1.0 is perfect balance).

    >>> imbalance([[4, 2, 1, 1]], ExpertPlacement.contiguous(1, 4), 2)
    1.5
    """
    per_gpu = gpu_loads(load, placement, num_gpus)
    mean = per_gpu.mean(axis=-1)
    ratio = np.divide(per_gpu.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)
    return float(ratio.mean())
