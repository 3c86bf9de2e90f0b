"""The Rust flow controller against its pure-Python twin (hypothesis state machine), with the
controller's invariants checked on every step, and VTC's service-gap bound."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmsched._llmsched import FlowCore, FlowDecision
from llmsched.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    LlmschedError,
    UnknownRequestError,
)
from llmsched.flow import resolve_config
from llmsched.reference.flow import FlowControllerTwin, TwinDecision

TENANTS = ("a", "b", "c")
ENDPOINTS = ("e0", "e1", "e2")

policy = st.fixed_dictionaries


def fairness() -> st.SearchStrategy[dict[str, Any]]:
    weights = st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.5, 1.0, 3.0]))
    return st.one_of(
        policy({"type": st.just("strict")}),
        policy({"type": st.just("round-robin")}),
        policy({"type": st.just("vtc"), "w_q": st.sampled_from([1.0, 2.0]), "weights": weights}),
        policy(
            {"type": st.just("las"), "half_life_s": st.sampled_from([0.5, 3.0]), "weights": weights}
        ),
    )


def ordering() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        policy({"type": st.just("fcfs")}),
        policy({"type": st.just("edf")}),
        policy({"type": st.just("slo-deadline"), "default_ttft_s": st.sampled_from([0.5, 2.0])}),
    )


def band() -> st.SearchStrategy[dict[str, Any]]:
    return policy(
        {
            "max_requests": st.sampled_from([3, 5, None]),
            "max_bytes": st.sampled_from([100, 400, None]),
            "ttl_s": st.sampled_from([2.0, 10.0, None]),
            "fairness": fairness(),
            "ordering": ordering(),
        }
    )


configs = policy(
    {
        "default_band": band(),
        "bands": st.lists(
            st.tuples(st.integers(-2, 2), band(), st.sampled_from([None, 0.5, 1.5])).map(
                lambda t: {"priority": t[0], **t[1], "ceiling": t[2]}
            ),
            max_size=2,
            unique_by=lambda b: b["priority"],
        ),
        "global": policy(
            {
                "max_requests": st.sampled_from([4, 8, None]),
                "max_bytes": st.sampled_from([300, None]),
            }
        ),
        "saturation": st.one_of(
            policy(
                {
                    "type": st.just("concurrency"),
                    "max_requests": st.integers(1, 8),
                    "max_tokens": st.sampled_from([None, 150]),
                }
            ),
            policy(
                {
                    "type": st.just("utilization"),
                    "stale_policy": st.sampled_from(["saturated", "ignore", "last"]),
                    "staleness_s": st.sampled_from([0.2, 1.0]),
                }
            ),
        ),
        "ceilings": st.one_of(
            policy({"type": st.just("static"), "ceiling": st.sampled_from([0.8, 1.0])}),
            policy({"type": st.just("holdback"), "step": st.sampled_from([0.1, 0.3])}),
        ),
        "shedding": st.one_of(
            policy(
                {
                    "type": st.just("probabilistic"),
                    "power": st.sampled_from([1.0, 2.0]),
                    "scale": st.sampled_from([0.5, 3.0]),
                    "seed": st.integers(0, 2**64 - 1),
                }
            ),
            policy({"type": st.just("threshold"), "threshold": st.sampled_from([0.5, 1.0])}),
            policy({"type": st.just("none")}),
        ),
        "preemption": policy(
            {
                "evict_queued": st.booleans(),
                "max_victims": st.integers(0, 3),
                "pacing_s": st.sampled_from([0.0, 0.5]),
            }
        ),
        # Reclaim after no time, within a run, or never.
        "flow_idle_s": st.sampled_from([0.0, 0.3, 2.0, None]),
    }
)


def same(native: FlowDecision | None, twin: TwinDecision | None) -> None:
    if native is None or twin is None:
        assert native is None and twin is None, (native, twin)
        return
    got = (native.id, native.outcome.key, native.priority, native.tenant, native.prompt_tokens)
    assert got == (twin.id, twin.outcome, twin.priority, twin.tenant, twin.tokens)
    assert (native.size_bytes, native.wait_s, native.payload, native.ticket) == (
        twin.size_bytes,
        twin.wait_s,
        twin.payload,
        twin.ticket,
    )


class FlowMachine(RuleBasedStateMachine):
    """Drives FlowCore and the twin with the same calls and compares every answer."""

    @initialize(config=configs)
    def setup(self, config: dict[str, Any]) -> None:
        self.resolved = resolve_config(config)
        self.native = FlowCore(config)
        self.twin = FlowControllerTwin(self.resolved)
        self.now = 0.0
        self.next_id = 0
        # id -> "queued" | "running" | terminal outcome key; a request finishes once.
        self.state: dict[int, str] = {}
        # id -> the ticket of its latest enqueue (ids are used again once their request left).
        self.tickets: dict[int, int] = {}
        self.next_ticket = 0
        for endpoint in ENDPOINTS[:2]:
            self.native.update_endpoint(endpoint, 0, 0, 0.1, 0.0)
            self.twin.update_endpoint(endpoint, 0, 0, 0.1, 0.0)

    # -- helpers -------------------------------------------------------------------------

    def finish(self, decision: TwinDecision) -> None:
        assert self.state.get(decision.id) == "queued", (decision, self.state.get(decision.id))
        self.state[decision.id] = (
            "running" if decision.outcome == "dispatched" else decision.outcome
        )

    def compare_outbox(self) -> None:
        native = self.native.drain_evicted()
        twin = self.twin.drain_evicted()
        assert len(native) == len(twin)
        for n, t in zip(native, twin, strict=True):
            same(n, t)
            self.finish(t)

    def both_raise(self, call: str, *args: Any) -> type[BaseException]:
        errors = []
        for target in (self.native, self.twin):
            with pytest.raises(LlmschedError) as caught:
                getattr(target, call)(*args)
            errors.append(type(caught.value))
        assert errors[0] is errors[1], errors
        return errors[0]

    def ttl(self, priority: int) -> float | None:
        for b in self.resolved["bands"]:
            if b["priority"] == priority:
                return b["ttl_s"]  # type: ignore[no-any-return]
        return self.resolved["default_band"]["ttl_s"]  # type: ignore[no-any-return]

    def live_priorities(self) -> list[int]:
        """Priorities of queued requests that have not expired by now."""
        out = []
        for item in self.twin.queued.values():
            ttl = self.ttl(item.priority)
            if ttl is None or item.arrival + ttl > self.now:
                out.append(item.priority)
        return out

    # -- rules -----------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.05, 0.1, 0.3, 1.5]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        priority=st.integers(-2, 2),
        tenant=st.sampled_from(TENANTS),
        tokens=st.integers(0, 60),
        size=st.integers(0, 30),
        deadline=st.none() | st.floats(0, 5),
        ttft=st.none() | st.sampled_from([0.0, 0.3, 1.0]),
    )
    def enqueue(
        self,
        priority: int,
        tenant: str,
        tokens: int,
        size: int,
        deadline: float | None,
        ttft: float | None,
    ) -> None:
        self.next_id += 1
        self.offer(self.next_id, priority, tenant, tokens, size, deadline, ttft)

    def offer(
        self,
        rid: int,
        priority: int,
        tenant: str,
        tokens: int,
        size: int,
        deadline: float | None,
        ttft: float | None,
    ) -> None:
        self.next_ticket += 1
        ticket = self.next_ticket
        self.tickets[rid] = ticket
        deadline = None if deadline is None else self.now + deadline
        args = (rid, priority, tenant, tokens, size, deadline, ttft, f"p{rid}.{ticket}", self.now)
        native = self.native.enqueue(*args, ticket)
        twin = self.twin.enqueue(*args, ticket)
        assert (native.key if native else None) == twin
        self.state[rid] = "queued"
        self.compare_outbox()
        if twin is not None:
            if twin == "rejected_shed":
                assert priority < 0, "only sheddable requests are shed"
            self.state[rid] = twin

    @rule(
        batch=st.lists(
            st.tuples(st.integers(-1, 1), st.sampled_from(TENANTS), st.integers(0, 60)),
            min_size=2,
            max_size=6,
        )
    )
    def enqueue_batch(self, batch: list[tuple[int, str, int]]) -> None:
        for priority, tenant, tokens in batch:
            self.enqueue(priority, tenant, tokens, 10, None, None)

    @rule(steps=st.integers(1, 6))
    def dispatch_some(self, steps: int) -> None:
        for _ in range(steps):
            self.dispatch()

    @rule()
    def dispatch(self) -> None:
        live = self.live_priorities()
        native = self.native.dispatch(self.now)
        twin = self.twin.dispatch(self.now)
        same(native, twin)
        self.compare_outbox()
        if twin is None:
            if live:  # no inversion: refusing to serve means the top band is blocked
                value, no_endpoints = self.twin.saturation_state(self.now)
                assert no_endpoints or value >= self.twin.ceiling(max(live))
            return
        assert twin.priority == max(live), "strict priority"
        ttl = self.ttl(twin.priority)
        assert ttl is None or twin.wait_s < ttl, "TTL honoured"
        self.finish(twin)

    @precondition(lambda self: bool(self.twin.running))
    @rule(pick=st.integers(0, 1000), output=st.integers(0, 40), partial=st.booleans())
    def complete(self, pick: int, output: int, partial: bool) -> None:
        ids = sorted(self.twin.running)
        rid = ids[pick % len(ids)]
        if partial:
            self.native.record_output(rid, output, self.now)
            self.twin.record_output(rid, output, self.now)
            return
        self.native.complete(rid, output, self.now)
        self.twin.complete(rid, output, self.now)
        self.state[rid] = "completed"

    @precondition(lambda self: bool(self.twin.running))
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=4))
    def complete_some(self, picks: list[int]) -> None:
        for pick in picks:
            if self.twin.running:
                self.complete(pick, 5, partial=False)

    @rule(pick=st.integers(0, 1000), priority=st.integers(-2, 2), tenant=st.sampled_from(TENANTS))
    def enqueue_again(self, pick: int, priority: int, tenant: str) -> None:
        """An id whose request has left is queued again (a client's retry)."""
        done = sorted(rid for rid, s in self.state.items() if s not in ("queued", "running"))
        assume(done)
        self.offer(done[pick % len(done)], priority, tenant, 5, 5, None, None)

    @rule(pick=st.integers(0, 1000), stale=st.booleans())
    def cancel_by_ticket(self, pick: int, stale: bool) -> None:
        """Cancels the request an id's latest enqueue made, or (stale) an earlier one: an
        earlier ticket cancels nothing, whatever its id holds now."""
        assume(self.tickets)
        rid = sorted(self.tickets)[pick % len(self.tickets)]
        ticket = self.tickets[rid] - 1 if stale else self.tickets[rid]
        native = self.native.cancel(rid, self.now, ticket)
        twin = self.twin.cancel(rid, self.now, ticket)
        same(native, twin)
        if stale:
            assert twin is None
        if twin is not None:
            self.finish(twin)

    @precondition(lambda self: bool(self.twin.running))
    @rule(pick=st.integers(0, 1000), output=st.integers(0, 40), stale=st.booleans())
    def complete_by_ticket(self, pick: int, output: int, stale: bool) -> None:
        """Releases a running request by the ticket of its enqueue, or (stale) by an earlier
        ticket: a stale release changes nothing, whatever its id runs now."""
        ids = sorted(self.twin.running)
        rid = ids[pick % len(ids)]
        ticket = self.tickets[rid] - 1 if stale else self.tickets[rid]
        native = self.native.complete(rid, output, self.now, ticket)
        twin = self.twin.complete(rid, output, self.now, ticket)
        assert native == twin == (not stale)
        if twin:
            self.state[rid] = "completed"
        assert self.native.running_count() == len(self.twin.running)

    @precondition(lambda self: bool(self.twin.running))
    @rule(pick=st.integers(0, 1000), output=st.integers(1, 40), stale=st.booleans())
    def record_output_by_ticket(self, pick: int, output: int, stale: bool) -> None:
        """Charges streamed output by the ticket of a running request's enqueue, or (stale) by
        an earlier ticket: a stale handle charges nothing, whatever its id runs now (the
        service compared by the invariants)."""
        ids = sorted(self.twin.running)
        rid = ids[pick % len(ids)]
        ticket = self.tickets[rid] - 1 if stale else self.tickets[rid]
        native = self.native.record_output(rid, output, self.now, ticket)
        twin = self.twin.record_output(rid, output, self.now, ticket)
        assert native == twin == (not stale)
        assert self.native.is_running(rid), "recording output leaves it running"

    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick: int) -> None:
        rid = pick % (self.next_id + 2)
        native = self.native.cancel(rid, self.now)
        twin = self.twin.cancel(rid, self.now)
        same(native, twin)
        if twin is not None:
            self.finish(twin)

    @rule()
    def expire(self) -> None:
        self.compare_outbox()
        native = self.native.expire(self.now)
        twin = self.twin.expire(self.now)
        assert len(native) == len(twin)
        for n, t in zip(native, twin, strict=True):
            same(n, t)
            # Expiry is `arrival + ttl <= now`; `wait_s` is `now - arrival`, which can round
            # a few ulps below the TTL for the same instants (2.05 - 0.05 = 1.9999999999999998).
            assert t.wait_s >= (self.ttl(t.priority) or math.inf) - 1e-9, "expired early"
            self.finish(t)
        assert all(
            (ttl := self.ttl(item.priority)) is None or item.arrival + ttl > self.now
            for item in self.twin.queued.values()
        ), "expired request left behind"

    @rule(
        endpoint=st.sampled_from(ENDPOINTS),
        waiting=st.integers(0, 8),
        kv=st.sampled_from([0.0, 0.2, 0.5, 0.79, 0.8, 1.0]),
        lag=st.sampled_from([0.0, 0.0, 0.1, 0.5, 2.0]),
    )
    def update_endpoint(self, endpoint: str, waiting: int, kv: float, lag: float) -> None:
        args = (endpoint, waiting, 0, kv, self.now - lag)
        self.native.update_endpoint(*args)
        self.twin.update_endpoint(*args)

    @rule(endpoint=st.sampled_from(ENDPOINTS))
    def remove_endpoint(self, endpoint: str) -> None:
        assert self.native.remove_endpoint(endpoint) == self.twin.remove_endpoint(endpoint)

    @rule()
    def preemption_victims(self) -> None:
        native = self.native.preemption_victims(self.now)
        twin = self.twin.preemption_victims(self.now)
        assert native == twin
        self.compare_outbox()
        for rid in twin:
            assert self.twin.running[rid].priority < 0, "only sheddable requests are revoked"

    @rule(
        bad=st.sampled_from(
            [
                "negative_tokens",
                "nan_now",
                "duplicate",
                "unknown_complete",
                "bad_kv",
                "nan_deadline",
            ]
        )
    )
    def bad_input(self, bad: str) -> None:
        if bad == "negative_tokens":
            kind = self.both_raise("enqueue", 10**9, 0, "a", -1, 0, None, None, None, self.now)
        elif bad == "nan_now":
            kind = self.both_raise("dispatch", math.nan)
        elif bad == "nan_deadline":
            args = (10**9, 0, "a", 1, 1, math.nan, None, None, self.now)
            kind = self.both_raise("enqueue", *args)
        elif bad == "duplicate":
            live = [rid for rid, s in self.state.items() if s in ("queued", "running")]
            assume(live)
            kind = self.both_raise("enqueue", live[0], 0, "a", 1, 1, None, None, None, self.now)
            assert kind is DuplicateRequestError
            return
        elif bad == "unknown_complete":
            kind = self.both_raise("complete", 10**9, 1, self.now)
            assert kind is UnknownRequestError
            return
        else:
            kind = self.both_raise("update_endpoint", "e0", 0, 0, 1.5, self.now)
        assert kind is InvalidRequestError

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "twin"):
            return
        assert len(self.native) == len(self.twin)
        assert self.native.running_count() == self.twin.running_count()
        assert self.native.saturation(self.now) == self.twin.saturation(self.now)
        assert self.native.jain_index() == self.twin.jain_index()
        queued = {rid for rid, s in self.state.items() if s == "queued"}
        assert queued == set(self.twin.queued), "no request lost"
        running = {rid for rid, s in self.state.items() if s == "running"}
        assert running == set(self.twin.running)

    @invariant()
    def capacity_never_exceeded(self) -> None:
        if not hasattr(self, "twin"):
            return
        for priority, b in self.twin.bands.items():
            settings = b.settings
            assert settings["max_requests"] is None or len(b.items) <= settings["max_requests"]
            assert settings["max_bytes"] is None or b.bytes() <= settings["max_bytes"], priority
        limits = self.resolved["global"]
        assert limits["max_requests"] is None or len(self.twin.queued) <= limits["max_requests"]
        total = sum(item.size_bytes for item in self.twin.queued.values())
        assert limits["max_bytes"] is None or total <= limits["max_bytes"]

    @invariant()
    def metrics_agree(self) -> None:
        if not hasattr(self, "twin"):
            return
        metrics = self.native.metrics(self.now)
        per_band = {b["priority"]: b["queued"] for b in metrics["bands"]}
        assert per_band == {p: len(b.items) for p, b in self.twin.bands.items()}
        counts = {k: v for k, v in metrics["outcomes"].items() if v}
        assert counts == self.twin.counts
        flows = [
            (
                f["tenant"],
                f["priority"],
                f["queued"],
                f["dispatched"],
                f["service_tokens"],
                f["fairness_counter"],
            )
            for f in metrics["flows"]
        ]
        assert flows == self.twin.flow_metrics(self.now)


FlowMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestFlowAgainstTwin = FlowMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    max_input=st.integers(1, 200),
    max_output=st.integers(1, 60),
    memory=st.integers(400, 2000),
    w_q=st.sampled_from([1.0, 2.0, 4.0]),
)
def test_vtc_service_gap_bound(
    seed: int, max_input: int, max_output: int, memory: int, w_q: float
) -> None:
    """Two continuously backlogged tenants under continuous batching (memory `M` tokens, one
    output token per running request per step): their weighted service over any interval
    differs by at most 2 * max(w_p * L_in, w_q * M) (Sheng et al., OSDI'24)."""
    import random

    w_p = 1.0
    assume(max_input + max_output <= memory)
    rng = random.Random(seed)
    config = {
        "saturation": {"type": "concurrency", "max_requests": 10**6},
        "shedding": {"type": "none"},
        "default_band": {
            "max_requests": None,
            "max_bytes": None,
            "ttl_s": None,
            "fairness": {"type": "vtc", "w_p": w_p, "w_q": w_q},
        },
    }
    core = FlowCore(config)
    service = {"a": 0.0, "b": 0.0}
    backlog = {"a": 0, "b": 0}
    outputs: dict[int, tuple[str, int, int]] = {}  # id -> (tenant, reserved, left)
    used = 0
    next_id = 0
    gaps = []
    t = 0.0

    def refill() -> None:
        nonlocal next_id
        for tenant in ("a", "b"):
            while backlog[tenant] < 3:
                next_id += 1
                size = rng.randint(0, max_input)
                outputs[next_id] = (tenant, size, rng.randint(1, max_output))
                core.enqueue(next_id, 0, tenant, size, 0, None, None, None, t)
                backlog[tenant] += 1

    for _ in range(400):
        refill()
        while used + max_input + max_output <= memory:
            d = core.dispatch(t)
            assert d is not None
            tenant, size, left = outputs[d.id]
            outputs[d.id] = (tenant, size + left, left)
            used += size + left
            backlog[tenant] -= 1
            service[tenant] += w_p * size
            refill()
        for rid in [rid for rid in outputs if core.is_running(rid)]:
            tenant, reserved, left = outputs[rid]
            core.record_output(rid, 1, t)
            service[tenant] += w_q
            if left == 1:
                core.complete(rid, 0, t)
                used -= reserved
                del outputs[rid]
            else:
                outputs[rid] = (tenant, reserved, left - 1)
        gaps.append(service["a"] - service["b"])
        t += 0.01
    bound = 2 * max(w_p * max_input, w_q * memory)
    assert max(gaps) - min(gaps) <= bound, (max(gaps), min(gaps), bound)
