"""Expert rebalancing off the critical path.

:class:`ExpertRebalancer` is an engine step hook. :meth:`~ExpertRebalancer.trigger` snapshots the
router's recorded load (summed over ranks under expert parallelism) and computes the new EPLB
placement on a background thread while the engine keeps serving. Once the placement is ready on
every rank, each following step moves ``layers_per_step`` layers' experts and then returns, so
serving stalls for one layer's move at a time instead of for the whole rebalance. A layer's
tokens always use a placement that layer's weights match: the old one before its move, the new
one after.

:meth:`~ExpertRebalancer.rebalance_now` is the stop-the-world alternative (compute, then move all
layers before the next step), kept for comparison.

>>> from llmsched.executor.config import ModelConfig
>>> from llmsched.executor.model import MoETransformer
>>> model = MoETransformer(ModelConfig())
>>> _ = model.forward_dense(list(range(64)))
>>> rebalancer = ExpertRebalancer(model, num_gpus=4)
>>> stats = rebalancer.rebalance_now()
>>> model.backend.placement.num_slots, stats.layers_moved
(8, 2)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from llmsched._extras import require

require("executor", "torch", feature="llmsched.executor")

import torch
import torch.distributed as dist

from llmsched.errors import ConfigError
from llmsched.executor.engine import Engine
from llmsched.executor.eplb import ExpertPlacement, check_layout
from llmsched.executor.model import MoETransformer

__all__ = ["ExpertRebalancer", "RebalanceStats"]


@dataclass
class RebalanceStats:
    """What one rebalance cost the serving loop.

    ``step_stalls_s`` holds the time each step spent moving experts (one entry per step that
    moved a layer); ``compute_s`` the time to compute the placement (in the background unless
    stop-the-world); ``stall_s`` the longest time serving was held up in one go.
    """

    compute_s: float = 0.0
    step_stalls_s: list[float] = field(default_factory=list)
    layers_moved: int = 0
    stop_the_world: bool = False

    @property
    def stall_s(self) -> float:
        """Longest single interruption of serving."""
        longest = max(self.step_stalls_s, default=0.0)
        return self.compute_s + longest if self.stop_the_world else longest

    @property
    def total_move_s(self) -> float:
        """Time spent moving experts, over all steps."""
        return float(sum(self.step_stalls_s))


class ExpertRebalancer:
    """Recompute the expert placement in the background, move experts layer by layer.

    ``num_replicas``, ``num_groups``, ``num_nodes`` and ``num_gpus`` are the arguments of
    :func:`~llmsched.executor.eplb.rebalance_experts`; ``num_replicas`` is the model's slot
    count (build the model with ``ExpertPlacement.contiguous(L, E, num_slots)`` to have room for
    replicas), and under expert parallelism ``num_gpus`` is the world size (rank ``g`` holds GPU
    ``g``'s slots).
    """

    def __init__(
        self,
        model: MoETransformer,
        *,
        num_groups: int = 1,
        num_nodes: int = 1,
        num_gpus: int = 1,
        layers_per_step: int = 1,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.num_replicas = model.backend.placement.num_slots
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.num_gpus = num_gpus
        if (
            isinstance(layers_per_step, bool)
            or not isinstance(layers_per_step, int)
            or layers_per_step < 1
        ):
            # 1.5 was taken and failed at the first move (range() of a float), "2" was a bare
            # TypeError.
            raise ConfigError(f"layers_per_step must be an int >= 1, got {layers_per_step!r}")
        self.layers_per_step = layers_per_step
        # Here rather than on the background thread, where a bad layout surfaced steps later.
        check_layout(
            model.backend.placement.num_experts, self.num_replicas, num_groups, num_nodes, num_gpus
        )
        if self.num_replicas % num_gpus:
            raise ConfigError(f"{self.num_replicas} slots do not split over {num_gpus} GPUs")
        self.distributed = model.backend.requires_lockstep
        self.group = group
        self.history: list[RebalanceStats] = []
        self._thread: threading.Thread | None = None
        self._target: ExpertPlacement | None = None
        self._error: BaseException | None = None
        self._next_layer = 0
        self._stats: RebalanceStats | None = None
        self._taken_load: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        """True from :meth:`trigger` until the last layer has moved."""
        return self._stats is not None

    def _global_load(self) -> np.ndarray:
        self._taken_load = self.model.expert_load.clone()
        load = self._taken_load.clone()
        if self.distributed:
            dist.all_reduce(load, group=self.group)
        self.model.reset_load()
        return load.cpu().numpy().astype(np.float64)

    def _compute(self, load: np.ndarray) -> ExpertPlacement:
        return ExpertPlacement.rebalanced(
            load, self.num_replicas, self.num_groups, self.num_nodes, self.num_gpus
        )

    def trigger(self) -> None:
        """Snapshot the load and start computing the new placement in the background.

        Under expert parallelism every rank must call it at the same step.
        """
        if self.pending:
            raise ConfigError("a rebalance is already in progress")
        load = self._global_load()
        self._stats = RebalanceStats()
        self._target = None
        self._error = None
        self._next_layer = 0
        self._thread = threading.Thread(target=self._background, args=(load,), daemon=True)
        self._thread.start()

    def _background(self, load: np.ndarray) -> None:
        start = time.perf_counter()
        try:
            self._target = self._compute(load)
        except BaseException as exc:  # re-raised on the serving thread
            self._error = exc
        if self._stats is not None:
            self._stats.compute_s = time.perf_counter() - start

    def _ready_everywhere(self) -> bool:
        assert self._thread is not None
        ready = not self._thread.is_alive()
        if self.distributed:
            flag = torch.tensor([int(ready)], device=self.model.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            ready = bool(flag.item())
        if ready and self._error is not None:
            # Raised once: the rebalance is over (it left every pass on the old placement),
            # the load it took is counted again, and trigger() may try again.
            error, self._error = self._error, None
            if self._taken_load is not None:
                self.model.expert_load += self._taken_load
            self._stats = self._thread = self._target = self._taken_load = None
            raise error
        return ready

    def __call__(self, engine: Engine) -> None:
        """Step hook: move the next layers once the new placement is ready on every rank."""
        if not self.pending or not self._ready_everywhere():
            return
        assert self._target is not None and self._stats is not None
        start = time.perf_counter()
        last = min(self._next_layer + self.layers_per_step, self._target.num_layers)
        for layer in range(self._next_layer, last):
            self._move(layer, self._target)
        self._stats.step_stalls_s.append(time.perf_counter() - start)
        self._next_layer = last
        if last == self._target.num_layers:
            self._finish()

    def _move(self, layer: int, target: ExpertPlacement) -> None:
        self.model.backend.move_layer(layer, target.layer(layer))
        assert self._stats is not None
        self._stats.layers_moved += 1

    def _finish(self) -> None:
        assert self._stats is not None
        self.model.slot_load.zero_()  # slots now hold other experts
        self.history.append(self._stats)
        self._stats = None
        self._thread = None
        self._taken_load = None

    def wait(self) -> None:
        """Block until the background placement is computed (tests and benchmarks)."""
        if self._thread is not None:
            self._thread.join()

    def rebalance_now(self) -> RebalanceStats:
        """Stop-the-world: compute the placement and move every layer before returning."""
        if self.pending:
            raise ConfigError("a rebalance is already in progress")
        stats = RebalanceStats(stop_the_world=True)
        start = time.perf_counter()
        load = self._global_load()
        try:
            target = self._compute(load)
        except BaseException:
            if self._taken_load is not None:
                self.model.expert_load += self._taken_load
            self._taken_load = None
            raise
        stats.compute_s = time.perf_counter() - start
        self._stats = stats
        start = time.perf_counter()
        for layer in range(target.num_layers):
            self._move(layer, target)
        stats.step_stalls_s.append(time.perf_counter() - start)
        self._finish()
        return stats
