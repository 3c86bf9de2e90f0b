"""The asyncio facade: thousands of concurrent admits with random cancellations, TTL expiry,
rejections, and two event loops in two threads sharing one controller."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from llmsched.errors import (
    DuplicateRequestError,
    FlowRejected,
    InvalidTypeError,
    InvalidValueError,
    UnknownRequestError,
)
from llmsched.flow import FlowController, FlowDecision, FlowRequest, Outcome


async def _client(ctrl: FlowController, rid: int, rng: random.Random) -> FlowDecision:
    request = FlowRequest(
        rid,
        priority=rng.choice([-1, 0, 0, 3]),
        tenant=f"tenant-{rng.randrange(7)}",
        prompt_tokens=rng.randrange(1, 400),
    )
    decision = await ctrl.admit(request)
    try:
        await asyncio.sleep(rng.random() * 0.004)  # the request runs on an endpoint
    finally:
        ctrl.complete(rid, output_tokens=rng.randrange(50))
    return decision


async def _swarm(ctrl: FlowController, ids: range, seed: int) -> tuple[Counter[str], int, int]:
    rng = random.Random(seed)
    tasks = [asyncio.create_task(_client(ctrl, rid, rng)) for rid in ids]
    await asyncio.sleep(0)
    cancelled = 0
    for task in rng.sample(tasks, len(tasks) // 5):
        await asyncio.sleep(rng.random() * 0.002)
        cancelled += task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    seen: Counter[str] = Counter()
    for result in results:
        if isinstance(result, FlowDecision):
            seen["dispatched"] += 1
        elif isinstance(result, FlowRejected):
            seen[result.outcome.key] += 1
        elif isinstance(result, asyncio.CancelledError):
            seen["task_cancelled"] += 1
        else:
            raise AssertionError(f"unexpected {result!r}")
    return seen, cancelled, len(tasks)


def _check(ctrl: FlowController, seen: Counter[str], total: int) -> None:
    counts = ctrl.metrics()["outcomes"]
    assert sum(counts.values()) == total, "every request ends in exactly one outcome"
    assert len(ctrl) == 0 and ctrl.running_count() == 0, "nothing left queued or running"
    for key in ("rejected_capacity", "rejected_shed", "evicted_ttl", "evicted_preempted"):
        assert counts[key] == seen[key], key
    # A cancelled task either cancelled its queued request or released its dispatched one.
    released = counts["dispatched"] - seen["dispatched"]
    assert released >= 0
    assert counts["evicted_cancelled"] + released == seen["task_cancelled"]


CONFIG = {
    "saturation": {"type": "concurrency", "max_requests": 24},
    "default_band": {"max_requests": 1500, "fairness": {"type": "vtc"}},
    "global": {"max_requests": 3000},
    "shedding": {"type": "threshold", "threshold": 0.99},
}


@pytest.mark.timeout(120)
def test_thousands_of_admits_with_random_cancellations() -> None:
    ctrl = FlowController(CONFIG, poll_interval_s=0.05)
    seen, cancelled, total = asyncio.run(_swarm(ctrl, range(4000), seed=1))
    assert total == 4000 and cancelled > 0
    assert seen["dispatched"] > 1000
    _check(ctrl, seen, total)


@pytest.mark.timeout(120)
def test_two_event_loops_in_two_threads_share_one_controller() -> None:
    ctrl = FlowController(CONFIG, poll_interval_s=0.05)
    outcomes: list[tuple[Counter[str], int, int]] = []

    def run(ids: range, seed: int) -> None:
        outcomes.append(asyncio.run(_swarm(ctrl, ids, seed)))

    threads = [
        threading.Thread(target=run, args=(range(k * 10_000, k * 10_000 + 1500), k))
        for k in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seen = outcomes[0][0] + outcomes[1][0]
    _check(ctrl, seen, outcomes[0][2] + outcomes[1][2])


@pytest.mark.timeout(30)
def test_admit_raises_with_outcome_http_status_and_reason() -> None:
    async def scenario() -> None:
        ctrl = FlowController(
            {
                "saturation": {"type": "concurrency", "max_requests": 1},
                "default_band": {"max_requests": 1, "ttl_s": 0.2},
            },
            poll_interval_s=0.05,
        )
        first = await ctrl.admit(FlowRequest(1))  # holds the only slot, never completes
        assert first.outcome == Outcome.DISPATCHED
        waiting = asyncio.create_task(ctrl.admit(FlowRequest(2)))
        await asyncio.sleep(0.01)
        with pytest.raises(FlowRejected) as full:
            await ctrl.admit(FlowRequest(3))
        assert (full.value.outcome, full.value.http_status) == (Outcome.REJECTED_CAPACITY, 429)
        with pytest.raises(DuplicateRequestError):
            await ctrl.admit(FlowRequest(2))
        with pytest.raises(FlowRejected) as expired:
            await waiting
        assert (expired.value.outcome, expired.value.reason) == (Outcome.EVICTED_TTL, "ttl-expired")
        ctrl.complete(1)
        assert (await ctrl.admit(FlowRequest(4))).id == 4

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_sync_cancel_wakes_admit_and_waiters_wake_on_complete() -> None:
    async def scenario() -> None:
        ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
        await ctrl.admit(FlowRequest(1))
        second = asyncio.create_task(ctrl.admit(FlowRequest(2)))
        third = asyncio.create_task(ctrl.admit(FlowRequest(3)))
        await asyncio.sleep(0.01)
        cancelled = ctrl.cancel(3)
        assert cancelled is not None and cancelled.outcome == Outcome.EVICTED_CANCELLED
        with pytest.raises(FlowRejected, match="cancelled"):
            await third
        ctrl.complete(1)  # frees the slot: 2 is dispatched without any polling
        assert (await asyncio.wait_for(second, 0.5)).id == 2

    asyncio.run(scenario())


# -- a request id used again (a client retry, or two callers with one id) -----------------


@pytest.mark.timeout(30)
def test_a_cancelled_admit_never_cancels_a_later_request_with_its_id() -> None:
    """A's request was cancelled (its decision already handed over) and B queued under the
    same id before A's task saw its cancellation: A's clean-up must not cancel B's request, nor
    take B's waiter, or B waits forever."""

    async def scenario() -> None:
        ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
        await ctrl.admit(FlowRequest(100))  # holds the only slot
        first = asyncio.create_task(ctrl.admit(FlowRequest(7)))
        await asyncio.sleep(0.01)
        assert ctrl.is_queued(7)
        ctrl.cancel(7)  # A's decision is set; A has not resumed yet
        retry = asyncio.create_task(ctrl.admit(FlowRequest(7)))
        await asyncio.sleep(0)  # the retry queues under the same id
        assert ctrl.is_queued(7)
        first.cancel()
        (result,) = await asyncio.gather(first, return_exceptions=True)
        assert isinstance(result, (asyncio.CancelledError, FlowRejected))
        assert ctrl.is_queued(7), "the retry's request is still queued"
        ctrl.complete(100)
        decision = await asyncio.wait_for(retry, 5)
        assert (decision.id, decision.outcome) == (7, Outcome.DISPATCHED)
        ctrl.complete(7)
        outcomes = ctrl.metrics()["outcomes"]
        assert (outcomes["dispatched"], outcomes["evicted_cancelled"]) == (2, 1)
        assert len(ctrl) == 0 and ctrl.running_count() == 0

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_refused_duplicate_admit_never_takes_the_other_requests_decision() -> None:
    """Request 7 was enqueued through the synchronous API; an admit() of id 7 is refused as a
    duplicate. If the other request is dispatched while that admit is on its way in (another
    thread, here the clock standing in for it), the dispatch still goes to its owner."""
    hook: list[Callable[[], None]] = []

    def clock() -> float:
        while hook:
            hook.pop()()
        return 0.0

    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}}, clock=clock)
    assert ctrl.enqueue(FlowRequest(7, payload="sync")) is None
    handed: list[FlowDecision | None] = []
    hook.append(lambda: handed.append(ctrl.dispatch()))

    async def duplicate() -> None:
        with pytest.raises(DuplicateRequestError):
            await ctrl.admit(FlowRequest(7, payload="admit"))

    asyncio.run(duplicate())
    decision = handed[0] if handed and handed[0] is not None else ctrl.dispatch()
    assert decision is not None and decision.payload == "sync", "the owner gets its dispatch"
    ctrl.complete(7)
    assert ctrl.running_count() == 0 and len(ctrl) == 0


@pytest.mark.timeout(120)
def test_threads_reusing_ids_with_admit_and_the_sync_api_leak_nothing() -> None:
    """A thread enqueues, dispatches and completes ids 0..6 through the synchronous API while
    an event loop admits the same ids: every dispatch reaches its owner (nothing is left
    running once both drained), each admit either succeeds or is refused as a duplicate."""
    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1000}})
    stop = threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the windows are a few bytecodes wide

    def sync_side() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            with contextlib.suppress(DuplicateRequestError):
                if ctrl.enqueue(FlowRequest(i % 7, payload="sync")) is not None:
                    continue
            decision = ctrl.dispatch()
            if decision is not None:
                ctrl.complete(decision.id)

    async def admit_side() -> Counter[str]:
        seen: Counter[str] = Counter()
        for i in range(30_000):
            try:
                decision = await ctrl.admit(FlowRequest(i % 7, payload="admit"))
            except DuplicateRequestError:
                seen["duplicate"] += 1
                continue
            assert decision.payload == "admit", "an admit got another request's dispatch"
            ctrl.complete(decision.id)
            seen["dispatched"] += 1
        return seen

    thread = threading.Thread(target=sync_side)
    thread.start()
    try:
        seen = asyncio.run(admit_side())
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert seen["dispatched"] + seen["duplicate"] == 30_000
    while (decision := ctrl.dispatch()) is not None:  # what the sync side left behind
        ctrl.complete(decision.id)
    assert len(ctrl) == 0 and ctrl.running_count() == 0, "a dispatch reached nobody"


@pytest.mark.timeout(30)
def test_a_cancelled_admits_late_release_never_completes_a_later_request_with_its_id() -> None:
    """A's request 7 was dispatched as A's task was cancelled, so A releases it on its way
    out. Before that release runs (another thread, here the clock standing in for it), A's
    request is revoked at the endpoint and an admit B of id 7 is dispatched: A's release must
    leave B's running request alone (it completed B's before: a slot freed that B holds)."""
    hook: list[Callable[[], None]] = []

    def clock() -> float:
        while hook:
            hook.pop()()
        return 0.0

    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}}, clock=clock)
    second: list[FlowDecision] = []

    def revoke_and_admit_again() -> None:
        ctrl.complete(7)  # A's request revoked (preempted) at the endpoint
        other = threading.Thread(
            target=lambda: second.append(asyncio.run(ctrl.admit(FlowRequest(7, payload="B"))))
        )
        other.start()
        other.join()

    async def scenario() -> None:
        await ctrl.admit(FlowRequest(100))  # holds the only slot
        first = asyncio.create_task(ctrl.admit(FlowRequest(7, payload="A")))
        await asyncio.sleep(0.01)
        assert ctrl.is_queued(7)
        ctrl.complete(100)  # A's request dispatched; A has not resumed yet
        assert ctrl.is_running(7)
        hook.append(revoke_and_admit_again)
        first.cancel()
        (result,) = await asyncio.gather(first, return_exceptions=True)
        assert isinstance(result, asyncio.CancelledError)
        await asyncio.sleep(0.01)  # A's release has run
        assert not hook, "the other thread's turn came"
        assert [d.payload for d in second] == ["B"]
        assert ctrl.is_running(7) and ctrl.running_count() == 1, "B's request still runs"
        ctrl.complete(7, ticket=second[0].ticket)
        assert ctrl.running_count() == 0 and len(ctrl) == 0

    asyncio.run(scenario())


def test_complete_with_an_admits_ticket_releases_only_that_admits_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``complete(id, ticket=decision.ticket)``: a stale ticket (its request ended, the id
    dispatched again for another admit, or for a plain enqueue) changes nothing and is logged
    at debug level; the current one completes the request."""
    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
    first = asyncio.run(ctrl.admit(FlowRequest(7, payload="A")))
    ctrl.complete(7)  # revoked, by id
    second = asyncio.run(ctrl.admit(FlowRequest(7, payload="B")))
    assert first.ticket is not None and second.ticket not in (None, first.ticket)
    with caplog.at_level("DEBUG", logger="llmsched.flow"):
        ctrl.complete(7, 3, ticket=first.ticket)
    assert ctrl.is_running(7) and ctrl.running_count() == 1
    assert "stale release of request 7" in caplog.text
    ctrl.complete(7, 3, ticket=second.ticket)
    assert ctrl.running_count() == 0
    with pytest.raises(UnknownRequestError):
        ctrl.complete(7, ticket=second.ticket)
    assert ctrl.enqueue(FlowRequest(8)) is None and ctrl.dispatch() is not None
    ctrl.complete(8, ticket=second.ticket)  # enqueued without a ticket: by id only
    assert ctrl.is_running(8)
    with pytest.raises(InvalidValueError):
        ctrl.complete(8, ticket=-1)
    with pytest.raises(InvalidTypeError):
        ctrl.complete(8, ticket="1")  # type: ignore[arg-type]
    ctrl.complete(8)
    assert ctrl.running_count() == 0


def test_record_output_with_an_admits_ticket_charges_only_that_admits_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Probe 62: ``record_output`` charged by id only, so a stale handle (its request revoked,
    the id dispatched again for another admit) charged the other admit's tenant. With
    ``ticket=`` a stale charge changes nothing and is logged at debug level."""
    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
    first = asyncio.run(ctrl.admit(FlowRequest(7, tenant="a")))
    ctrl.complete(7)  # revoked, by id
    second = asyncio.run(ctrl.admit(FlowRequest(7, tenant="b")))
    ctrl.drain_service()
    with caplog.at_level("DEBUG", logger="llmsched.flow"):
        ctrl.record_output(7, 40, ticket=first.ticket)
    assert "stale output of request 7" in caplog.text
    assert ctrl.drain_service() == [], "a stale handle charged the new request"
    ctrl.record_output(7, 5, ticket=second.ticket)
    assert ctrl.drain_service() == [("b", 0, 0, 5)] and ctrl.is_running(7)
    with pytest.raises(InvalidValueError):
        ctrl.record_output(7, 1, ticket=2**64)
    with pytest.raises(InvalidTypeError):
        ctrl.record_output(7, 1, ticket=1.0)  # type: ignore[arg-type]
    ctrl.complete(7, ticket=second.ticket)
    with pytest.raises(UnknownRequestError):
        ctrl.record_output(7, 1, ticket=second.ticket)
    assert ctrl.running_count() == 0 and ctrl.drain_service() == []
