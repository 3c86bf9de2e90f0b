"""A stateful model test of the Scheduler's accounting: placements opened, retried and ended
(completed, failed, cancelled) in any order, interleaved with engines added, removed, drained
and resumed, and with placements' flow requests revoked through ``scheduler.flow`` and their ids
admitted there again (the stale admission must leave the new request alone). After every step
the pool's in-flight counts, the flow controller's running count and the scheduler's counters
agree with a plain model of what is open where."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmsched import Placement, Scheduler, ScheduleRequest
from llmsched.errors import ConfigError, NoEndpointError, UnknownEndpointError
from llmsched.flow import FlowDecision, FlowRequest

NAMES = ["e0", "e1", "e2", "e3"]
PROMPTS = [np.arange(48, dtype=np.uint32) + 1000 * k for k in range(4)]


class SchedulerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(
            NAMES[:2],
            router="llm-d",
            flow={"saturation": {"type": "concurrency", "max_requests": 10_000}},
            block_size=16,
        )
        self.engines = set(NAMES[:2])
        self.drained: set[str] = set()
        # Where each open placement's attempt runs. An endpoint that leaves the pool and comes
        # back counts the requests still running there (probe 49 F4: they started at zero).
        self.open: list[tuple[Placement, str]] = []
        self.ended = {"completed": 0, "failed": 0, "cancelled": 0}
        self.no_endpoint = 0
        # Ids of open placements whose flow request was revoked; requests admitted again
        # under such an id directly through the flow controller (id -> its decision).
        self.revoked: set[int] = set()
        self.again: dict[int, FlowDecision] = {}

    def routable(self) -> set[str]:
        return self.engines - self.drained

    @rule(k=st.integers(0, len(PROMPTS) - 1))
    def open_one(self, k: int) -> None:
        try:
            placement = self.s.schedule_sync(ScheduleRequest(tokens=PROMPTS[k]))
        except NoEndpointError:
            assert not self.routable()
            self.no_endpoint += 1
            return
        name = str(placement.endpoint)
        assert name in self.routable()
        self.open.append((placement, name))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 50))
    def retry(self, i: int) -> None:
        i %= len(self.open)
        placement, _ = self.open[i]
        try:
            name = str(placement.retry())
        except NoEndpointError:
            self.open[i] = (placement, "")  # open, with no attempt in flight
            return
        assert name in self.routable()
        self.open[i] = (placement, name)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 50), how=st.sampled_from(["completed", "failed", "cancelled"]))
    def end(self, i: int, how: str) -> None:
        placement, _ = self.open.pop(i % len(self.open))
        ended = {"completed": placement.complete, "failed": placement.fail}.get(
            how, placement.cancel
        )()
        assert ended and placement.outcome == how and not placement.cancel()
        self.ended[how] += 1
        assert placement.admission is not None
        self.revoked.discard(placement.admission.id)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 50))
    def revoke_and_admit_again(self, i: int) -> None:
        """A preemption victim: its flow request completed by id, and the id admitted again
        through the flow controller (as ``preemption_victims`` allows)."""
        placement, _ = self.open[i % len(self.open)]
        assert placement.admission is not None and self.s.flow is not None
        rid = placement.admission.id
        if rid in self.revoked:
            return
        self.s.flow.complete(rid)
        self.revoked.add(rid)
        self.again[rid] = asyncio.run(self.s.flow.admit(FlowRequest(rid, tenant="again")))

    @precondition(lambda self: self.again)
    @rule(i=st.integers(0, 50))
    def end_admitted_again(self, i: int) -> None:
        assert self.s.flow is not None
        rid = sorted(self.again)[i % len(self.again)]
        decision = self.again.pop(rid)
        self.s.flow.complete(rid, ticket=decision.ticket)
        assert not self.s.flow.is_running(rid)

    @rule(name=st.sampled_from(NAMES))
    def add(self, name: str) -> None:
        if name in self.engines:
            try:
                self.s.add_engine(name)
            except ConfigError:
                return
            raise AssertionError("a duplicate engine was added")
        self.s.add_engine(name)
        self.engines.add(name)

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name: str) -> None:
        if name not in self.engines:
            try:
                self.s.remove_engine(name)
            except UnknownEndpointError:
                return
            raise AssertionError("an unknown engine was removed")
        self.s.remove_engine(name)
        self.engines.discard(name)
        self.drained.discard(name)
        assert name not in self.s.index.workers()

    @rule(name=st.sampled_from(NAMES))
    def drain(self, name: str) -> None:
        if name not in self.engines:
            return
        self.s.drain(name)
        self.drained.add(name)

    @rule(name=st.sampled_from(NAMES))
    def resume(self, name: str) -> None:
        if name in self.engines:
            self.s.resume(name)
            self.drained.discard(name)

    @invariant()
    def accounting_agrees(self) -> None:
        pool = {str(e["id"]): e["in_flight_requests"] for e in self.s.pool.endpoints()}
        assert set(pool) == self.routable()
        expected = dict.fromkeys(pool, 0)
        for _, name in self.open:
            if name in expected:
                expected[name] += 1
        assert pool == expected
        stats = self.s.stats()
        assert stats["in_flight"] == len(self.open)
        running = len(self.open) - len(self.revoked) + len(self.again)
        assert self.s.flow is not None and self.s.flow.running_count() == running
        assert all(self.s.flow.is_running(rid) for rid in self.again)
        assert {k: stats[k] for k in self.ended} == self.ended  # type: ignore[literal-required]
        assert stats["no_endpoint"] == self.no_endpoint
        assert stats["engines"] == len(self.engines) and stats["draining"] == len(self.drained)

    def teardown(self) -> None:
        for placement, _ in self.open:
            placement.complete()
        assert self.s.flow is not None
        for rid, decision in self.again.items():
            assert self.s.flow.is_running(rid), "a stale admission ended it"
            self.s.flow.complete(rid, ticket=decision.ticket)
        assert self.s.stats()["in_flight"] == 0
        assert self.s.flow is not None and self.s.flow.running_count() == 0
        assert all(e["in_flight_requests"] == 0 for e in self.s.pool.endpoints())


SchedulerModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSchedulerModel = SchedulerModel.TestCase
