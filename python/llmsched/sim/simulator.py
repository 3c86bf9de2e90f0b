"""The simulation of one scenario under one routing policy, on the Rust engine.

:class:`Simulation` runs the Rust engine (:mod:`llmsched.sim.fast`): events in one heap ordered
by (time, sequence), vLLM-like replicas, routing decisions made by the routing core on what a
gateway would see (engine metrics ``metrics_delay_s`` late, the prefix index fed by the
engines' KV events). A scenario the Rust engine does not cover yet runs on the reference engine
(:class:`llmsched.reference.sim.ReferenceSimulation`), never silently: the first time each
reason occurs it is logged as a warning (logger ``llmsched``), every occurrence is counted
(:func:`fallback_counts`), and the reason is in :attr:`Simulation.fallback_reason` and in the
result (``summary()["engine_fallback"]``).

>>> from llmsched.sim.config import ScenarioConfig
>>> cfg = ScenarioConfig.from_dict({"replicas": 2, "workload": {"kind": "long_short",
...     "num_requests": 50, "arrival": {"rate": 5.0}}})
>>> result = Simulation(cfg, "round-robin").run()
>>> result.summary()["completed"], result.engine_name
(50, 'rust')
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from llmsched.errors import ConfigError
from llmsched.routing import ConfigLike
from llmsched.sim import fast
from llmsched.sim.config import ScenarioConfig
from llmsched.sim.policies import Policy, PolicyLike, is_policy_object, resolve_policy
from llmsched.sim.request import Request
from llmsched.sim.results import ReplicaEnd, RunRecord, SimResult, collect
from llmsched.sim.stepmodel import build_step_model

if TYPE_CHECKING:
    from llmsched.reference.sim import ReferenceSimulation

__all__ = ["ENGINES", "Simulation", "fallback_counts"]

ENGINES = ("auto", "rust", "python")
# The most KV blocks a simulated replica may have (crates/llmsched-sim/src/kv_cache.rs).
MAX_KV_BLOCKS = 1 << 24
"""``engine`` values: ``auto`` (Rust, or the reference engine with a warning for what Rust
does not cover), ``rust`` (ConfigError for what it does not cover), ``python`` (the reference
engine, the oracle)."""

logger = logging.getLogger("llmsched")

_fallbacks: dict[str, int] = {}
_fallbacks_lock = threading.Lock()


def fallback_counts() -> dict[str, int]:
    """How many simulations ran on the reference engine because the Rust engine does not
    cover their scenario, by reason (since the process started).

    >>> isinstance(fallback_counts(), dict)
    True
    """
    with _fallbacks_lock:
        return dict(_fallbacks)


def _note_fallback(reason: str) -> None:
    with _fallbacks_lock:
        first = reason not in _fallbacks
        _fallbacks[reason] = _fallbacks.get(reason, 0) + 1
    if first:
        logger.warning(
            "the Rust simulator engine does not cover %s: running the (10-50x slower) "
            "reference engine; counted in llmsched.sim.fallback_counts()",
            reason,
        )


class Simulation:
    """One scenario under one routing policy.

    Args:
        config: the scenario.
        policy: a policy name (see :func:`llmsched.sim.policies.policy_names`), a routing
            config dict, or a :class:`~llmsched.sim.policies.Policy` object.
        progress: called with the number of finished requests (every ``progress_every`` on
            the reference engine, once at the end on the Rust engine).
        native_kv: False runs the reference engine on the pure-Python KV cache twin (for
            benchmarks).
        engine: see :data:`ENGINES`.
    """

    def __init__(
        self,
        config: ScenarioConfig,
        policy: PolicyLike,
        *,
        progress: Callable[[int], None] | None = None,
        progress_every: int = 500,
        native_kv: bool = True,
        engine: str = "auto",
    ) -> None:
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
        config.validate()  # a scenario changed after loading is checked again
        self.config = config
        self.model = build_step_model(config.step_model)
        kv_tokens = config.engine.kv_tokens or self.model.kv_capacity_tokens()
        if kv_tokens is None:
            raise ConfigError("engine.kv_tokens is needed: the step model gives no KV capacity")
        self.kv_blocks = kv_tokens // config.engine.block_size
        if not 1 <= self.kv_blocks <= MAX_KV_BLOCKS:
            # A profile's kv_tokens from an engine that lied about its cache reached the Rust
            # engine as "invalid value: integer `62500000000`, expected u32".
            source = "engine.kv_tokens" if config.engine.kv_tokens else "the step model's kv_tokens"
            raise ConfigError(
                f"{source} = {kv_tokens} is {self.kv_blocks} blocks of "
                f"{config.engine.block_size} tokens; a replica holds 1 to {MAX_KV_BLOCKS}"
            )
        self.router_config: ConfigLike | None = None
        """The router configuration the Rust engine runs (None for a Policy object)."""
        name = ""
        if isinstance(policy, (str, Mapping)):
            name, self.router_config = resolve_policy(policy)
        elif is_policy_object(policy):
            name = policy.name
        reason = None
        if engine != "python":
            reason = fast.unsupported(config, policy, native_kv, self.model)
        if engine == "rust" and reason is not None:
            raise ConfigError(f"the Rust engine does not cover {reason}; use engine='auto'")
        if not isinstance(policy, (str, Mapping)) and config.router_replicas > 1:
            raise ConfigError(
                "router_replicas needs a router configuration (each router replica its own), "
                "not a Policy object"
            )
        if reason is not None and config.router_replicas > 1:
            raise ConfigError(
                f"router_replicas is simulated by the Rust engine only, which does not cover "
                f"{reason}"
            )
        if engine == "python" and config.router_replicas > 1:
            raise ConfigError(
                "router_replicas is simulated by the Rust engine only, not engine='python'"
            )
        self.engine = "rust" if engine != "python" and reason is None else "python"
        self.fallback_reason = reason
        """Why the Rust engine did not run this scenario (None: it did, or the reference
        engine was asked for)."""
        self.policy = policy
        self.progress = progress
        self.progress_every = progress_every
        self.native_kv = native_kv
        self.record: RunRecord | None = None
        """The finished run's record (None before :meth:`run`)."""
        self.reference: ReferenceSimulation | None = None
        if self.engine == "python":
            from llmsched.reference.sim import ReferenceSimulation

            self.reference = ReferenceSimulation(
                config,
                policy,
                progress=progress,
                progress_every=progress_every,
                native_kv=native_kv,
                model=self.model,
            )
        self.name = name
        self._done: list[Request] | None = None

    def run(self) -> SimResult:
        """Run to completion (or ``max_time_s``) and return the result."""
        if self.fallback_reason is not None:
            _note_fallback(self.fallback_reason)
        if self.reference is not None:
            result = self.reference.run()
            self.record = self.reference.record()
            result.fallback_reason = self.fallback_reason
            return result
        wall = time.perf_counter()
        policy: Policy | None = None
        if self.router_config is None:
            assert not isinstance(self.policy, (str, Mapping))
            policy = self.policy
        record = fast.run(self.config, self.model, self.kv_blocks, self.router_config, policy)
        wall_s = time.perf_counter() - wall
        self.record = record
        self._done = None
        if self.progress is not None:
            self.progress(len(record.requests["id"]))
        return collect(
            record,
            policy=self.name,
            scenario=self.config.name,
            slo=self.config.slo,
            router_replicas=self.config.router_replicas,
            wall_s=wall_s,
            engine_name="rust",
            prefill_replicas=self.config.pd.prefill_replicas,
        )

    def _finished_record(self) -> RunRecord:
        if self.record is None:
            raise ConfigError("the simulation has not run yet: call run() first")
        return self.record

    @property
    def done(self) -> list[Request]:
        """Finished (and refused) requests, in the order they left (the reference engine's
        own objects; decoded from the record after a Rust run, without hashes)."""
        if self.reference is not None:
            return self.reference.done
        if self._done is None:
            self._done = fast.done_requests(self._finished_record())
        return self._done

    @property
    def replicas(self) -> Sequence[ReplicaEnd]:
        """Each replica's counters and state at the end of the run."""
        return self._finished_record().replicas

    @property
    def now(self) -> float:
        """The simulated time the run ended at."""
        return self._finished_record().now

    @property
    def feed_skipped(self) -> int:
        """KV-event batches the prefix index could not apply (their parent had gone)."""
        return self._finished_record().feed_skipped

    @property
    def slice_switches(self) -> int:
        """Token slices that yielded or migrated."""
        return self._finished_record().slice_switches

    @property
    def kv_trace(self) -> list[list[tuple[float, float]]]:
        """Per replica: (time, KV use) samples."""
        return self._finished_record().kv_trace
