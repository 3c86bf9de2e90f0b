"""The reference engine: the discrete-event simulation in pure Python, the oracle the Rust
engine (:mod:`llmsched.sim.fast`) is tested against request by request.

It covers everything the simulator models; :class:`llmsched.sim.Simulation` runs it only for
what the Rust engine does not cover yet (saying so) or when asked (``engine="python"``).

Events live in one heap ordered by (time, sequence): request arrivals (open-loop ones are
pulled from the workload one at a time), the end of each replica's step or decode run, KV
transfers between prefill and decode replicas, and delayed KV-event batches. Each routing
decision is made by the policy on what a gateway would see at that moment: engine metrics as
published ``metrics_delay_s`` ago and the prefix index as fed by the engines' KV events.

>>> from llmsched.sim.config import ScenarioConfig
>>> cfg = ScenarioConfig.from_dict({"replicas": 2, "workload": {"kind": "long_short",
...     "num_requests": 50, "arrival": {"rate": 5.0}}})
>>> result = ReferenceSimulation(cfg, "round-robin").run()
>>> result.summary()["completed"], result.engine_name
(50, 'python')
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from llmsched.errors import ConfigError, UnknownBlockError, UnknownRequestError
from llmsched.prefix_index import PrefixIndex
from llmsched.reference.sim.gate import FlowGate
from llmsched.reference.sim.replica import Replica
from llmsched.reference.sim.router import make_policy
from llmsched.sim.config import ScenarioConfig
from llmsched.sim.kv import KVCacheEvent, make_kv_cache
from llmsched.sim.policies import PolicyLike
from llmsched.sim.request import DONE, WAITING, Request
from llmsched.sim.results import RECORD_FIELDS, KvEnd, ReplicaEnd, RunRecord, SimResult, collect
from llmsched.sim.stepmodel import StepModel, build_step_model
from llmsched.sim.workloads import make_workload
from llmsched.slices import SliceTracker, WaitingRequest

__all__ = ["ReferenceSimulation", "ideal_time"]

STREAM_ARRIVAL, ARRIVAL, STEP, TRANSFER, KV_FEED = 0, 1, 2, 3, 4
_KIND_NAMES = ("StreamArrival", "Arrival", "Step", "Transfer", "KvFeed")  # the Rust engine's


class ReferenceSimulation:
    """One scenario under one routing policy, in pure Python.

    Args:
        config: the scenario.
        policy: a policy name (see :func:`llmsched.sim.policies.policy_names`), a routing
            config dict, or a :class:`~llmsched.sim.policies.Policy` object.
        progress: called with the number of finished requests every ``progress_every``.
        native_kv: use the Rust KV cache (False: its pure-Python twin, for benchmarks).
        model: the step model (built from ``config.step_model`` when None).
    """

    def __init__(
        self,
        config: ScenarioConfig,
        policy: PolicyLike,
        *,
        progress: Callable[[int], None] | None = None,
        progress_every: int = 500,
        native_kv: bool = True,
        model: StepModel | None = None,
    ) -> None:
        self.config = config
        self.model = model if model is not None else build_step_model(config.step_model)
        engine_cfg = config.engine
        engine_cfg.validate()
        if config.router_replicas > 1:
            raise ConfigError("router_replicas is simulated by the Rust engine only")
        kv_tokens = engine_cfg.kv_tokens or self.model.kv_capacity_tokens()
        if kv_tokens is None:
            raise ConfigError("engine.kv_tokens is needed: the step model gives no KV capacity")
        self.kv_blocks = kv_tokens // engine_cfg.block_size
        self.done: list[Request] = []
        """Finished (and refused) requests, in the order they left."""
        self.progress = progress
        self.progress_every = progress_every
        self.now = 0.0
        self.decision_s = 0.0
        self.feed_s = 0.0
        self.feed_skipped = 0
        self.slice_switches = 0
        self.arrived = 0
        """Requests that arrived (session turns included)."""
        self.kv_bytes_per_token = config.pd.kv_bytes(self.model)
        index = PrefixIndex(block_size=engine_cfg.block_size, seed=config.seed)
        self.index = index
        self.workload = make_workload(
            config.workload,
            seed=config.seed,
            block_size=engine_cfg.block_size,
            chain_seed=index.seed,
        )
        roles = config.roles()
        self.replicas = [
            Replica(
                i,
                role,
                engine_cfg,
                self.model,
                make_kv_cache(self.kv_blocks, engine_cfg.block_size, native=native_kv),
                self,
            )
            for i, role in enumerate(roles)
        ]
        self.policy = make_policy(policy, roles=roles, index=index, seed=config.seed)
        self.name = self.policy.name
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self.now = 0.0
        self._arrivals = iter(self.workload.arrivals())
        self._pending_metrics: list[deque[tuple[float, int, int, float]]] = [
            deque() for _ in self.replicas
        ]
        self.kv_trace: list[list[tuple[float, float]]] = [[] for _ in self.replicas]
        self._next_kv_sample = [0.0] * len(self.replicas)
        self._published = [0.0] * len(self.replicas)  # the KV use each replica published last
        self.slices = self._slice_tracker()
        self.gate = (
            FlowGate(
                config.flow.controller_config(),
                clock=lambda: self.now,
                replicas=len(self.replicas),
                slo=config.slo,
            )
            if config.flow.enabled
            else None
        )

    def _slice_tracker(self) -> SliceTracker | None:
        cfg = self.config.slices
        if not cfg.policy:
            return None
        cost = cfg.cost_model(self.model, self.kv_blocks * self.config.engine.block_size)
        endpoints = [str(r.id) for r in self.replicas]
        return SliceTracker(cfg.policy, cfg.params, cost_model=cost, endpoints=endpoints)

    # -- scheduling helpers used by the replicas ---------------------------------------------

    def at(self, when: float, replica: Replica) -> None:
        """Wake ``replica`` at ``when`` (its current step's end)."""
        self._seq += 1
        heapq.heappush(self.heap, (when, self._seq, STEP, replica, replica.version))

    def _push(self, when: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (when, self._seq, kind, obj, 0))

    def publish(self, replica: Replica, now: float) -> None:
        """The replica's metrics changed; the gateway sees them ``metrics_delay_s`` later."""
        replica.kv_observe(now)
        waiting, running, usage = len(replica.waiting), len(replica.running), replica.kv.usage()
        self._publish(replica.id, waiting, running, usage, now, pump=True)

    def _publish(
        self, rid: int, waiting: int, running: int, usage: float, now: float, *, pump: bool
    ) -> None:
        self._published[rid] = usage
        if now >= self._next_kv_sample[rid]:
            self.kv_trace[rid].append((now, usage))
            self._next_kv_sample[rid] = now + self.config.kv_sample_s
        if self.config.metrics_delay_s > 0:
            self._pending_metrics[rid].append((now, waiting, running, usage))
        else:
            self._metrics_seen(rid, waiting, running, usage, now, pump=pump)

    def _scrape_runs(self, now: float) -> None:
        """Before a routing decision: a replica in a decode run republishes its KV use as of
        ``now`` (the run's growth so far, as vLLM's gauge would read at a scrape), when it
        changed. It does not wake flow control (the decision under way goes first)."""
        for rep in self.replicas:
            if not rep.in_run(now):
                continue
            kv = rep.kv
            usage = 1.0 - (kv.free_blocks - rep.kv_grown(now)) / kv.num_blocks
            if usage != self._published[rep.id]:
                self._publish(rep.id, len(rep.waiting), len(rep.running), usage, now, pump=False)

    def _metrics_seen(
        self, rid: int, waiting: int, running: int, usage: float, now: float, *, pump: bool = True
    ) -> None:
        t = time.perf_counter()
        self.policy.update_metrics(rid, waiting, running, usage, now)
        if self.gate is not None:
            self.gate.endpoint(rid, waiting, running, usage, now)
        self.feed_s += time.perf_counter() - t
        if pump and self.gate is not None and self.gate.queued:
            self._pump(self.now)

    def _deliver_metrics(self, now: float) -> None:
        horizon = now - self.config.metrics_delay_s
        for rid, pending in enumerate(self._pending_metrics):
            last = None
            while pending and pending[0][0] <= horizon:
                last = pending.popleft()
            if last is not None:
                self._metrics_seen(rid, last[1], last[2], last[3], last[0])

    def kv_events(self, replica: Replica, now: float) -> None:
        """Forward the replica's KV events to the prefix index (after ``kv_events_delay_s``)."""
        events = replica.kv.take_events()
        if not events:
            return
        if self.config.kv_events_delay_s > 0:
            self._push(now + self.config.kv_events_delay_s, KV_FEED, (replica.id, events))
        else:
            self._apply_kv_events(replica.id, events)

    def _apply_kv_events(self, rid: int, events: list[KVCacheEvent]) -> None:
        t = time.perf_counter()
        index = self.index
        assert index is not None, "the Python engine always has its index"
        for event in events:
            try:
                if event[0] == "stored":
                    index.store(rid, event[2], parent=event[1])
                else:
                    index.remove(rid, event[1])
            except UnknownBlockError:
                # Only when a delayed batch lands after its parent was dropped; counted.
                self.feed_skipped += 1
        self.feed_s += time.perf_counter() - t

    # -- request life cycle ------------------------------------------------------------------

    def _arrive(self, req: Request, now: float) -> None:
        self.arrived += 1
        if self.gate is None:
            self._dispatch(req, now)
            return
        if self.config.metrics_delay_s > 0:
            self._deliver_metrics(now)
        if not self.gate.offer(req, now):
            self._reject(req, now)
        self._pump(now)

    def _pump(self, now: float) -> None:
        """Dispatch what flow control lets through; reject what it dropped."""
        assert self.gate is not None
        for req in self.gate.expired(now):
            self._reject(req, now)
        for req in self.gate.ready(now):
            self._dispatch(req, now)

    def _reject(self, req: Request, now: float) -> None:
        req.rejected = True
        req.phase = DONE
        req.finish_time = now
        self.done.append(req)
        follow = self.workload.on_finish(req, now)
        if follow is not None:
            self._push(follow.arrival, ARRIVAL, follow)

    def _dispatch(self, req: Request, now: float) -> None:
        self._scrape_runs(now)
        if self.config.metrics_delay_s > 0:
            self._deliver_metrics(now)
        t = time.perf_counter()
        target, prefill = self.policy.pick(req, now)
        self.decision_s += time.perf_counter() - t
        req.dispatched = now
        req.tokens = None  # only the router reads them; let the memory go
        if self.slices is not None:
            start = self.slices.admit(
                req.id,
                prompt_tokens=req.prompt_len,
                max_tokens=req.output_len,
                endpoint=str(target),
                priority=req.priority,
            )
            req.call_end = min(req.output_len, start.slice_tokens)
        if prefill is not None and prefill != target:
            req.prefill_replica = self.replicas[prefill]
            req.decode_replica = self.replicas[target]
            self.replicas[prefill].enqueue(req, now)
        else:
            self.replicas[target].enqueue(req, now)

    def prefill_done(self, req: Request, now: float) -> None:
        """A prefill replica finished ``req``'s prompt: transfer the KV to its decode replica."""
        decode: Replica = req.decode_replica
        whole = req.prompt_len // decode.bs
        uncached = whole - decode.kv.lookup(req.hashes, whole)
        nbytes = float(uncached * decode.bs) * float(self.kv_bytes_per_token)  # as Rust does
        pd = self.config.pd
        req.kv_ready = True
        req.computed = 0
        req.phase = WAITING
        self._push(now + pd.transfer_latency_s + nbytes / pd.transfer_bw, TRANSFER, (decode, req))

    def slice_continues(self, req: Request, now: float) -> bool:
        """A slice of ``req`` ended (``generated == call_end``): ask the slice tracker. True:
        the next slice runs on in the batch (``call_end`` moved). False: the request leaves the
        batch and :meth:`finished` requeues it where ``req.slice_endpoint`` says."""
        tracker = self.slices
        assert tracker is not None
        replica = req.replica
        t = time.perf_counter()
        tracker.record_tokens(req.id, req.generated - req.slice_start)
        waiting = [
            WaitingRequest(
                w.priority,
                self._slice_level(w),
                w.prompt_len + w.generated,
                w.output_len - w.generated,
            )
            for w in list(replica.waiting)[:8]
        ]
        tracker.set_endpoint(
            str(replica.id),
            kv_cache_usage=min(replica.kv.usage(), 1.0),
            waiting=len(replica.waiting),
        )
        decision = tracker.decide(req.id, finished=False, waiting=waiting, now=now)
        self.decision_s += time.perf_counter() - t
        req.slice_start = req.generated
        if decision.action == "continue":
            req.call_end = min(req.output_len, req.generated + decision.next_slice_tokens)
            return True
        req.slice_endpoint = int(decision.endpoint) if decision.endpoint is not None else replica.id
        return False

    def _slice_level(self, req: Request) -> int:
        """The slice level of waiting ``req`` as the tracker holds it: its entry level (mlfq
        skip-join) until its first slice ends, then the level it was demoted or promoted to."""
        assert self.slices is not None
        state = self.slices.state(req.id)
        if state is None:  # every dispatched request was admitted
            raise UnknownRequestError(f"request {req.id} waits without a slice state")
        return state.level

    def first_token(self, req: Request, now: float) -> None:
        """``req`` produced its first token."""
        req.first_token_time = now
        t = time.perf_counter()
        self.policy.on_first_token(req, now)
        self.decision_s += time.perf_counter() - t

    def finished(self, req: Request, now: float) -> None:
        """``req`` finished (or ended a token slice, or was refused)."""
        if not req.rejected and req.generated < req.output_len:
            # A token slice yielded or migrated: its continuation is a new call for the rest
            # (prompt plus output so far), queued where the tracker sent it.
            assert self.slices is not None
            replica = self.replicas[req.slice_endpoint]
            start = self.slices.resume(req.id, endpoint=str(replica.id))
            req.high_water = max(req.high_water, req.computed)
            req.computed = 0
            req.target = req.prompt_len + req.generated
            req.call_end = min(req.output_len, req.generated + start.slice_tokens)
            req.phase = WAITING
            self.slice_switches += 1
            self._push(now, TRANSFER, (replica, req))  # after the replica's step is applied
            return
        if self.slices is not None:
            self.slices.remove(req.id)
        req.finish_time = now
        req.phase = DONE
        self.done.append(req)
        if req.rejected:
            # Refused by its engine (larger than the KV cache): it never got a first token.
            self.policy.on_finished(req, now)
        else:
            t = time.perf_counter()
            self.policy.on_finished(req, now)
            self.decision_s += time.perf_counter() - t
        if self.gate is not None:
            self.gate.complete(req, now)
            self._pump(now)
        follow = self.workload.on_finish(req, now)
        if follow is not None:
            self._push(follow.arrival, ARRIVAL, follow)
        if self.progress is not None and len(self.done) % self.progress_every == 0:
            self.progress(len(self.done))

    # -- main loop ---------------------------------------------------------------------------

    def _next_arrival(self) -> None:
        req = next(self._arrivals, None)
        if req is not None:
            self._push(req.arrival, STREAM_ARRIVAL, req)

    def run(self) -> SimResult:
        """Run to completion (or ``max_time_s``) and return the result."""
        wall = time.perf_counter()
        heap = self.heap
        self._next_arrival()
        limit = self.config.max_time_s
        pop = heapq.heappop
        while heap:
            when, _, kind, obj, version = pop(heap)
            if limit is not None and when > limit:
                break
            if not math.isfinite(when):
                raise ConfigError(
                    f"simulated time left the finite range: a {_KIND_NAMES[kind]} event at "
                    f"{when} s (a step, a KV transfer or a think time too long: see the step "
                    f"model, pd.transfer_bw and the workload's times)"
                )
            self.now = when
            if kind == STEP:
                if version == obj.version:
                    obj.on_step_end(when)
            elif kind == STREAM_ARRIVAL:
                self._next_arrival()
                self._arrive(obj, when)
            elif kind == ARRIVAL:
                self._arrive(obj, when)
            elif kind == TRANSFER:
                decode, req = obj
                decode.enqueue(req, when)
            else:
                self._apply_kv_events(*obj)
        if self.progress is not None:
            self.progress(len(self.done))
        return collect(
            self.record(),
            policy=self.name,
            scenario=self.config.name,
            slo=self.config.slo,
            router_replicas=1,
            wall_s=time.perf_counter() - wall,
            engine_name="python",
            prefill_replicas=self.config.pd.prefill_replicas,
        )

    def _kv_figures(self, rep: Replica) -> tuple[float, float]:
        """A replica's peak KV use and its mean over the run's time (``[0, now]``)."""
        peak, area = rep.kv_totals(self.now)
        blocks = rep.kv.num_blocks
        return peak / blocks, area / (blocks * self.now) if self.now > 0 else 0.0

    def record(self) -> RunRecord:
        """The run's record: the same arrays and counters the Rust engine returns."""
        model, budget = self.model, self.config.engine.max_num_batched_tokens
        ideal: dict[tuple[int, int], float] = {}
        for r in self.done:
            key = (r.prompt_len, r.output_len)
            if not r.rejected and key not in ideal:
                ideal[key] = ideal_time(model, budget, *key)
        rows: dict[str, list[float]] = {name: [] for name in RECORD_FIELDS}
        for r in self.done:
            session = r.session if isinstance(r.session, int) else -1
            for name, value in (
                ("id", r.id),
                ("arrival", r.arrival),
                ("dispatched", r.dispatched),
                ("first_token", r.first_token_time),
                ("finish", r.finish_time),
                ("prompt", r.prompt_len),
                ("output", r.output_len),
                ("generated", r.generated),
                ("cached", r.cached_tokens),
                ("prefilled", r.prefilled_tokens),
                ("recomputed", r.recomputed_tokens),
                ("preemptions", r.preemptions),
                ("tenant", r.tenant),
                ("priority", r.priority),
                ("session", session),
                ("turn", r.turn),
                ("rejected", r.rejected),
                ("ideal", 0.0 if r.rejected else ideal[(r.prompt_len, r.output_len)]),
            ):
                rows[name].append(value)
        floats = {"arrival", "dispatched", "first_token", "finish", "ideal"}
        requests = {
            name: np.asarray(
                values,
                dtype=np.float64 if name in floats else bool if name == "rejected" else np.int64,
            )
            for name, values in rows.items()
        }
        replicas = [
            ReplicaEnd(
                rep.id,
                rep.prefill_tokens,
                rep.recomputed_tokens,
                rep.hit_tokens,
                rep.query_tokens,
                rep.preemptions,
                rep.steps,
                running=len(rep.running),
                waiting=len(rep.waiting),
                decode_n=rep.decode_n,
                decode_ctx=rep.decode_ctx,
                kv=KvEnd(rep.kv.requests(), rep.kv.usage(), *self._kv_figures(rep)),
            )
            for rep in self.replicas
        ]
        return RunRecord(
            requests=requests,
            replicas=replicas,
            kv_trace=self.kv_trace,
            now=self.now,
            feed_skipped=self.feed_skipped,
            decision_s=self.decision_s,
            feed_s=self.feed_s,
            slice_switches=self.slice_switches,
            arrived=self.arrived,
        )


def ideal_time(model: StepModel, budget: int, prompt: int, output: int) -> float:
    """A request's time alone on an idle replica: its prefill in chunks of ``budget`` tokens,
    then ``output - 1`` decode steps (the fairness figures' reference; the first chunk starts on
    the idle replica)."""
    t, left, ctx = 0.0, prompt, 0
    while left > 0:
        chunk = min(left, budget)
        t += model.step_time(chunk, chunk * chunk, chunk * ctx, 0, 0, ctx, 1, ctx == 0)
        left -= chunk
        ctx += chunk
    return t + model.decode_run(1, prompt).time(output - 1)
