"""Expert parallelism: attention data-parallel, routed experts partitioned over ranks.

Each rank runs its own engine over its own requests (data-parallel attention, its own KV cache)
and holds the physical expert slots ``rank*S/W .. (rank+1)*S/W - 1`` of every MoE layer. In each
MoE layer a rank sends every (token, choice) row to the rank holding the chosen slot
(*dispatch*), computes the rows it received with its local experts, and sends the results back
(*combine*); both trips are one ``all_to_all_single`` over ``torch.distributed`` (gloo on CPU,
nccl on GPU), preceded by a small exchange of the row counts. The payload collectives are
asynchronous, which is what lets dual-batch overlap hide one micro-batch's trip behind the other
micro-batch's compute.

Every rank must run every forward pass, so an idle rank runs an empty one (as vLLM's data
parallel ranks do); :func:`run_until_done` steps the engines of all ranks in lockstep.

>>> AllToAllExperts.build(ModelConfig())
Traceback (most recent call last):
...
llmsched.errors.ConfigError: expert parallelism needs torch.distributed initialised first
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmsched._extras import require

require("executor", "torch", feature="llmsched.executor")

import torch
import torch.distributed as dist

from llmsched.errors import ConfigError
from llmsched.executor.config import ModelConfig
from llmsched.executor.engine import Engine
from llmsched.executor.eplb import ExpertPlacement
from llmsched.executor.model import Dispatched, ExpertBackend, ExpertStore

__all__ = ["AllToAllExperts", "launch", "run_until_done"]

Tensor = torch.Tensor

_COLLECTIVE_TIMEOUT_S = 300
"""How long a launched rank waits in a collective before giving up (a peer has died)."""


class AllToAllExperts(ExpertBackend):
    """This rank's share of the physical expert slots, reached by all-to-all.

    Built on every rank of ``group`` (the default group when None) with the same config and
    placement; ``placement.num_slots`` must split evenly over the ranks.
    """

    def __init__(
        self,
        store: ExpertStore,
        placement: ExpertPlacement,
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(store, placement)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.slots_per_rank = placement.num_slots // self.world_size

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        placement: ExpertPlacement | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> AllToAllExperts:
        """Materialise only this rank's slots of ``placement`` (default: contiguous)."""
        if not dist.is_initialized():
            raise ConfigError("expert parallelism needs torch.distributed initialised first")
        placement = placement or ExpertPlacement.contiguous(config.num_layers, config.num_experts)
        world_size = dist.get_world_size(group)
        if placement.num_slots % world_size:
            raise ConfigError(
                f"{placement.num_slots} expert slots do not split over {world_size} ranks"
            )
        per_rank = placement.num_slots // world_size
        rank = dist.get_rank(group)
        store = ExpertStore(
            config, placement, range(rank * per_rank, (rank + 1) * per_rank), device
        )
        return cls(store, placement, group)

    @property
    def requires_lockstep(self) -> bool:
        return True

    def _exchange_counts(self, send_counts: Tensor) -> list[int]:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return [int(c) for c in recv_counts.tolist()]

    def dispatch(self, layer: int, rows: Tensor, physical_ids: Tensor) -> Dispatched:
        flat = physical_ids.flatten()
        dest = torch.div(flat, self.slots_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world_size)
        recv_counts = self._exchange_counts(send_counts)
        sent = [int(c) for c in send_counts.tolist()]
        send_rows = rows[order].contiguous()
        send_slots = (flat - dest * self.slots_per_rank)[order].contiguous()
        recv_rows = rows.new_empty((sum(recv_counts), rows.shape[1]))
        recv_slots = send_slots.new_empty((sum(recv_counts),))
        works = [
            dist.all_to_all_single(
                recv_rows, send_rows, recv_counts, sent, group=self.group, async_op=True
            ),
            dist.all_to_all_single(
                recv_slots, send_slots, recv_counts, sent, group=self.group, async_op=True
            ),
        ]
        return Dispatched(
            rows=recv_rows,
            slots=recv_slots,
            num_pairs=int(flat.shape[0]),
            order=order,
            send_counts=sent,
            recv_counts=recv_counts,
            works=list(works),
        )

    def compute(self, layer: int, dispatched: Dispatched) -> Dispatched:
        _wait(dispatched.works)
        results = self.store.run(layer, dispatched.rows, dispatched.slots)
        returned = results.new_empty((dispatched.num_pairs, results.shape[1]))
        work = dist.all_to_all_single(
            returned,
            results,
            dispatched.send_counts,
            dispatched.recv_counts,
            group=self.group,
            async_op=True,
        )
        dispatched.output = returned
        dispatched.works = [work]
        return dispatched

    def combine(self, computed: Dispatched) -> Tensor:
        _wait(computed.works)
        assert computed.output is not None and computed.order is not None
        out = torch.empty_like(computed.output)
        out[computed.order] = computed.output
        return out

    def move_layer(self, layer: int, new_layer_placement: ExpertPlacement) -> None:
        """Move ``layer``'s experts: every rank fetches its new slots' weights by all-to-all.

        A logical expert is copied from its replica on the receiving rank when there is one
        (no traffic), else from its first replica; all ranks compute the same plan.
        """
        new_phy2log = [int(e) for e in new_layer_placement.phy2log[0]]
        per_rank = self.slots_per_rank
        old = self.placement

        def source_slot(expert: int, dest_rank: int) -> int:
            replicas = [int(s) for s in old.log2phy[layer, expert] if s >= 0]
            local = [s for s in replicas if s // per_rank == dest_rank]
            return (local or replicas)[0]

        # What this rank sends to each destination, in the destination's slot order.
        send_local: list[int] = []
        send_counts = []
        for dest in range(self.world_size):
            count = 0
            for slot in range(dest * per_rank, (dest + 1) * per_rank):
                src = source_slot(new_phy2log[slot], dest)
                if src // per_rank == self.rank:
                    send_local.append(src - self.rank * per_rank)
                    count += 1
            send_counts.append(count)
        # What arrives here: grouped by source rank, each group in this rank's slot order.
        mine = range(self.rank * per_rank, (self.rank + 1) * per_rank)
        sources = [source_slot(new_phy2log[s], self.rank) // per_rank for s in mine]
        arrival = sorted(range(per_rank), key=lambda i: (sources[i], i))
        recv_counts = [sources.count(r) for r in range(self.world_size)]

        payload = self.store.slot_weights(layer, send_local)
        received = payload.new_empty((per_rank, payload.shape[1]))
        dist.all_to_all_single(received, payload, recv_counts, send_counts, group=self.group)
        flat = torch.empty_like(received)
        flat[torch.tensor(arrival, dtype=torch.long, device=flat.device)] = received
        self.store.replace_layer(layer, *self.store.unflatten(flat))
        self.placement = self.placement.with_layer(layer, new_layer_placement)
        self._cache_layer_maps(layer)


def _wait(works: Sequence[object]) -> None:
    for work in works:
        work.wait()  # type: ignore[attr-defined]


def run_until_done(engine: Engine, group: dist.ProcessGroup | None = None) -> int:
    """Step this rank's engine until no rank has work left; returns the steps taken.

    Every rank must call it: each step ends with an all-reduce of "still busy".
    """
    steps = 0
    device = engine.model.device
    while True:
        busy = torch.tensor([int(engine.has_unfinished())], device=device)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
        if not int(busy.item()):
            return steps
        engine.step()
        steps += 1


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = fn(rank, world_size, *args)
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException as exc:
        _write_error(result_dir, rank, exc)
        raise
    finally:
        dist.destroy_process_group()


def _write_error(result_dir: str, rank: int, exc: BaseException) -> None:
    """Leave a failed rank's exception (and when it was raised) for :func:`launch` to raise."""
    try:
        payload = pickle.dumps((time.time_ns(), exc))
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        stand_in = RuntimeError(f"{type(exc).__name__}: {exc}")
        payload = pickle.dumps((time.time_ns(), stand_in))
    path = Path(result_dir, f"rank{rank}.err")
    partial = path.with_suffix(".tmp")
    partial.write_bytes(payload)
    os.replace(partial, path)  # never read half written


def _rank_error(result_dir: str, ranks: int) -> tuple[int, BaseException] | None:
    """The failed rank whose exception came first, and that exception (None: none left one).
    The first is the cause: the others typically fail in a collective once it is gone."""
    found: list[tuple[int, int, BaseException]] = []
    for rank in range(ranks):
        path = Path(result_dir, f"rank{rank}.err")
        if path.exists():
            when, exc = pickle.loads(path.read_bytes())
            found.append((when, rank, exc))
    if not found:
        return None
    _, rank, exc = min(found, key=lambda item: (item[0], item[1]))
    return rank, exc


def launch(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes joined by gloo.

    ``fn`` must be importable by name (a module-level function); each rank's return value is
    pickled back, in rank order. For tests and CPU experiments; a GPU deployment starts its
    ranks with ``torchrun`` and the nccl backend instead.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    # A fork server imports torch once; each launch then forks clean ranks from it instead of
    # paying a fresh interpreter and torch import per rank.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", __name__])
    with tempfile.TemporaryDirectory(prefix="llmsched-ep-") as tmp:
        store_path = os.path.join(tmp, "store")
        ranks = [
            context.Process(target=_rank_main, args=(r, world_size, store_path, tmp, fn, args))
            for r in range(world_size)
        ]
        for process in ranks:
            process.start()
        try:
            _join_or_fail(ranks, tmp)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.terminate()
                process.join()
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _join_or_fail(ranks: Sequence[multiprocessing.process.BaseProcess], result_dir: str) -> None:
    """Wait for every rank; as soon as one fails, raise (the caller stops the others, which
    would otherwise wait in a collective for the dead rank): the exception of the rank that
    failed first, itself (a ConfigError stays one), or a RuntimeError naming the rank and its
    exit status when it left none (killed, out of memory)."""
    pending = list(ranks)
    while pending:
        multiprocessing.connection.wait([p.sentinel for p in pending])
        for process in list(pending):
            if process.exitcode is None:
                continue
            pending.remove(process)
            if process.exitcode != 0:
                rank = list(ranks).index(process)
                failed = _rank_error(result_dir, len(ranks))
                if failed is None:
                    raise RuntimeError(
                        f"expert-parallel rank {rank} exited with {process.exitcode}"
                    )
                # It was a RuntimeError naming the exit status only; the exception itself
                # (a ConfigError from AllToAllExperts.build, say) went to the rank's stderr.
                first, exc = failed
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"raised on expert-parallel rank {first}")
                raise exc
