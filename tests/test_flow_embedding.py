"""Flow control and the scheduler embedded in an asyncio gateway (probe 87): every way an
admit's wait can end gives its request back, a thread pool on the synchronous API beside the
event loop keeps capacity and the counters right, numpy integers are taken as ints, and the
refusal a gateway answers with survives ``pickle`` and ``copy``."""

from __future__ import annotations

import asyncio
import copy
import pickle
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from llmsched import Scheduler, ScheduleRequest
from llmsched.errors import FlowRejected, InvalidRequestError, InvalidTypeError, InvalidValueError
from llmsched.flow import FlowController, FlowDecision, FlowRequest, Outcome

ONE_SLOT = {"saturation": {"type": "concurrency", "max_requests": 1}}


def _left_nothing(ctrl: FlowController) -> None:
    assert len(ctrl) == 0, "a request stayed queued"
    assert ctrl.running_count() == 0, "a request stayed running"
    assert ctrl.pump() == 0 and ctrl.dispatch() is None


def _blocked(ctrl: FlowController) -> None:
    """Fills the one slot, so the next admit waits."""
    assert ctrl.enqueue(FlowRequest(100)) is None
    decision = ctrl.dispatch()
    assert decision is not None and decision.id == 100


@pytest.mark.timeout(30)
def test_an_admit_whose_coroutine_is_closed_while_queued_cancels_its_request() -> None:
    """A coroutine closed at its await (a task garbage-collected unfinished, a framework
    closing it) gets GeneratorExit, not CancelledError: the request stayed queued, and once a
    slot freed it was dispatched to a future nobody awaited and ran for ever."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)

    async def main() -> None:
        coro = ctrl.admit(FlowRequest(1, tenant="gone"))
        coro.send(None)  # runs to its wait
        assert ctrl.is_queued(1)
        coro.close()
        assert not ctrl.is_queued(1)
        ctrl.complete(100)

    asyncio.run(main())
    _left_nothing(ctrl)
    outcomes = ctrl.metrics()["outcomes"]
    assert outcomes["evicted_cancelled"] == 1 and outcomes["dispatched"] == 1


@pytest.mark.timeout(30)
def test_an_admit_closed_once_dispatched_releases_its_request() -> None:
    """The decision reached the admit's future, and its coroutine was closed before it ran
    on: the slot is given back at once (nobody will hold it)."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)

    async def main() -> None:
        coro = ctrl.admit(FlowRequest(1))
        coro.send(None)
        ctrl.complete(100)  # dispatches request 1 to the waiting admit
        assert ctrl.is_running(1)
        coro.close()
        await asyncio.sleep(0)  # the release runs on the loop, as for a cancelled task
        assert not ctrl.is_running(1)

    asyncio.run(main())
    _left_nothing(ctrl)
    assert ctrl.metrics()["outcomes"]["dispatched"] == 2


@pytest.mark.timeout(30)
def test_an_admit_dispatched_then_closed_after_its_loop_closed_releases_its_request() -> None:
    """The decision reached the admit, then its loop closed before the task ran on (a task
    collected unfinished): closing the coroutine then releases the request at once, since no
    callback can run on a closed loop."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)

    async def main() -> Coroutine[Any, Any, FlowDecision]:
        coro = ctrl.admit(FlowRequest(1))
        coro.send(None)
        ctrl.complete(100)  # request 1's decision is set on the admit's future
        return coro

    coro = asyncio.run(main())  # the loop is closed on return
    assert ctrl.is_running(1)
    coro.close()
    _left_nothing(ctrl)


class _FlakyClock:
    """A monotonic clock that raises once, when told to."""

    def __init__(self) -> None:
        self.fail_next = False

    def __call__(self) -> float:
        if self.fail_next:
            self.fail_next = False
            raise OSError("the clock failed")
        return time.monotonic()


@pytest.mark.timeout(30)
def test_an_admit_whose_clock_fails_while_it_waits_cancels_its_request() -> None:
    """An exception other than a cancellation out of the wait (here the controller's clock,
    read when the admit polls) left the request queued for nobody."""
    clock = _FlakyClock()
    ctrl = FlowController(ONE_SLOT, clock=clock, poll_interval_s=0.005)
    _blocked(ctrl)

    async def main() -> None:
        task = asyncio.create_task(ctrl.admit(FlowRequest(1)))
        await asyncio.sleep(0.001)
        assert ctrl.is_queued(1)
        clock.fail_next = True
        with pytest.raises(OSError, match="the clock failed"):
            await task
        assert not ctrl.is_queued(1)
        ctrl.complete(100)  # the controller goes on: the slot is not given to request 1

    asyncio.run(main())
    _left_nothing(ctrl)
    assert ctrl.metrics()["outcomes"]["evicted_cancelled"] == 1


@pytest.mark.timeout(30)
def test_a_dispatch_for_an_admit_whose_loop_closed_gives_the_slot_back() -> None:
    """A loop closed with an admit still waiting (never cancelled): the dispatch meant for it
    finds the loop closed and is completed, so the slot is not lost."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)
    loop = asyncio.new_event_loop()
    task = loop.create_task(ctrl.admit(FlowRequest(1)))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert ctrl.is_queued(1)
    loop.close()
    ctrl.complete(100)
    assert not ctrl.is_running(1)
    assert ctrl.enqueue(FlowRequest(2)) is None
    decision = ctrl.dispatch()
    assert decision is not None and decision.id == 2
    ctrl.complete(2)
    del task  # its coroutine is closed: nothing is left to cancel
    _left_nothing(ctrl)


@pytest.mark.timeout(30)
def test_an_admit_dispatched_to_a_stopped_loop_then_collected_gives_the_slot_back() -> None:
    """A loop stopped, never closed, with an admit waiting: the dispatch meant for it is
    queued to the loop (``call_soon_threadsafe`` takes it: the loop is not closed) and never
    runs; when the admit's coroutine is then closed (its task collected with the loop
    dropped), the release it arranged was a callback on that loop too, so the request ran
    for nobody and the slot was lost. It is given back then, as when the loop closed."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)
    loop = asyncio.new_event_loop()
    try:
        coro = ctrl.admit(FlowRequest(1))
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0.01))  # runs to its wait; the loop stops
        assert ctrl.is_queued(1) and not loop.is_running() and not loop.is_closed()
        ctrl.complete(100)  # dispatches request 1; its decision is queued to the loop
        assert ctrl.is_running(1) and not task.done()
        coro.close()  # what collecting the task does
        assert not ctrl.is_running(1)
        _left_nothing(ctrl)
        assert ctrl.metrics()["outcomes"]["dispatched"] == 2
    finally:
        loop.close()


@pytest.mark.timeout(30)
def test_an_admit_on_a_stopped_loop_run_again_gets_its_dispatch() -> None:
    """The other way a stopped loop goes on: run again, the admit waiting on it gets the
    dispatch queued meanwhile, and holds its slot until it completes."""
    ctrl = FlowController(ONE_SLOT)
    _blocked(ctrl)
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(ctrl.admit(FlowRequest(1)))
        loop.run_until_complete(asyncio.sleep(0.01))
        ctrl.complete(100)
        decision = loop.run_until_complete(task)
        assert decision.id == 1 and ctrl.is_running(1)
        ctrl.complete(1)
        _left_nothing(ctrl)
    finally:
        loop.close()


@pytest.mark.timeout(60)
def test_admits_go_by_band_then_arrival() -> None:
    """One slot, one tenant, 300 admits of random priorities queued behind it: each is
    dispatched highest band first, in arrival order inside a band (a sort of the arrivals)."""
    rng = random.Random(87)
    ctrl = FlowController(
        {
            **ONE_SLOT,
            "shedding": {"type": "none"},
            "default_band": {"ttl_s": None},
            "preemption": {"evict_queued": False},
        }
    )
    _blocked(ctrl)
    arrivals: list[tuple[int, int]] = []
    served: list[tuple[int, int]] = []

    async def one(request: FlowRequest) -> None:
        decision = await ctrl.admit(request)
        served.append((request.priority, request.id))
        await asyncio.sleep(0)
        ctrl.complete(decision.id, ticket=decision.ticket)

    async def main() -> None:
        tasks = []
        for i in range(300):
            request = FlowRequest(1000 + i, priority=rng.choice([-3, -1, 0, 2, 7]), tenant="solo")
            arrivals.append((request.priority, request.id))
            tasks.append(asyncio.create_task(one(request)))
            await asyncio.sleep(0)  # each enqueues before the next is made
        assert len(ctrl) == 300
        ctrl.complete(100)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert served == sorted(arrivals, key=lambda a: (-a[0], a[1]))
    _left_nothing(ctrl)


CAPACITY = 3


@pytest.mark.timeout(120)
def test_a_thread_pool_and_an_event_loop_share_one_scheduler() -> None:
    """Six threads run ``schedule_sync`` while the event loop runs ``schedule`` with random
    cancellations, a TaskGroup aborted by one failing task (Python 3.11+) and
    ``asyncio.wait_for`` / ``asyncio.timeout`` around whole requests: no more than the flow
    controller's capacity is ever inside a placement, and once all ended nothing is queued,
    running or in flight and the scheduler's counters agree with the flow controller's
    outcomes and with what the callers saw."""
    s = Scheduler(
        ["a", "b"],
        router="least-load",
        flow={
            "saturation": {"type": "concurrency", "max_requests": CAPACITY},
            "default_band": {"ttl_s": 30, "max_requests": 200},
            "shedding": {"type": "none"},
        },
    )
    assert s.flow is not None
    flow = s.flow
    lock = threading.Lock()
    inside = [0]
    over: list[int] = []
    seen: Counter[str] = Counter()

    def enter() -> None:
        with lock:
            inside[0] += 1
            if inside[0] > CAPACITY or flow.running_count() > CAPACITY:
                over.append(inside[0])

    def leave() -> None:
        with lock:
            inside[0] -= 1

    def sync_worker(k: int) -> None:
        rng = random.Random(k)
        for _ in range(60):
            request = ScheduleRequest(
                tokens=[1, 2, 3], tenant=f"t{rng.randrange(3)}", priority=rng.choice([-1, 0, 5])
            )
            try:
                with s.schedule_sync(request):
                    enter()
                    try:
                        time.sleep(rng.random() * 0.001)
                    finally:
                        leave()
            except FlowRejected:
                with lock:
                    seen["rejected"] += 1
                continue
            with lock:
                seen["completed"] += 1

    async def one(i: int, rng: random.Random) -> None:
        request = ScheduleRequest(
            tokens=[1, 2], tenant=f"t{i % 4}", priority=rng.choice([-1, 0, 5])
        )
        try:
            async with s.schedule(request):
                enter()
                try:
                    await asyncio.sleep(rng.random() * 0.002)
                finally:
                    leave()
        except FlowRejected:
            seen["rejected"] += 1
            return
        seen["completed"] += 1

    async def boom() -> None:
        await asyncio.sleep(0.005)
        raise ValueError("one task of the group failed")

    async def group(rng: random.Random) -> None:
        if sys.version_info < (3, 11):  # no TaskGroup: gather cancels nothing on a failure
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                for i in range(50):
                    tasks.create_task(one(10_000 + i, rng))
                tasks.create_task(boom())
        except Exception as failed:  # the group's ExceptionGroup of the one failure
            assert [type(e) for e in getattr(failed, "exceptions", [])] == [ValueError]

    async def timed(rng: random.Random) -> None:
        for i in range(50):
            limit = rng.random() * 0.003
            try:
                if i % 2 and sys.version_info >= (3, 11):
                    async with asyncio.timeout(limit):
                        await one(20_000 + i, rng)
                else:
                    await asyncio.wait_for(one(20_000 + i, rng), limit)
            except asyncio.TimeoutError:  # the builtin one from 3.11 on
                pass

    async def loop_side() -> None:
        rng = random.Random(99)
        tasks = [asyncio.create_task(one(i, rng)) for i in range(600)]
        await asyncio.sleep(0.01)
        for task in rng.sample(tasks, 150):
            await asyncio.sleep(rng.random() * 0.001)
            task.cancel()
        await asyncio.gather(*tasks, group(rng), timed(rng), return_exceptions=True)

    with ThreadPoolExecutor(6) as pool:
        workers = [pool.submit(sync_worker, k) for k in range(6)]
        asyncio.run(loop_side())
        for worker in workers:
            worker.result()

    assert not over, f"more than {CAPACITY} held a slot at once: {over[:5]}"
    assert inside == [0]
    stats = s.stats()
    metrics = flow.metrics()
    outcomes = metrics["outcomes"]
    assert len(flow) == 0 and flow.running_count() == 0
    assert metrics["running"] == metrics["running_tokens"] == metrics["queued_bytes"] == 0
    assert all(band["queued"] == 0 for band in metrics["bands"])
    assert all(entry["queued"] == 0 for entry in metrics["flows"])
    assert sum(band["dispatched"] for band in metrics["bands"]) == outcomes["dispatched"]
    assert stats["in_flight"] == 0 and stats["queued"] == 0
    assert stats["completed"] == seen["completed"] >= 360  # every thread's request and more
    assert stats["rejected"] == seen["rejected"] == outcomes["rejected_capacity"]
    admitted = stats["completed"] + stats["cancelled"] + stats["failed"]
    assert stats["admitted"] == admitted
    # A dispatch beyond the admitted ones went to an admit cancelled in that instant and was
    # released on its behalf.
    assert outcomes["dispatched"] >= admitted
    assert outcomes["evicted_ttl"] == outcomes["evicted_preempted"] == 0


def test_numpy_integers_are_ints_in_flow_and_schedule_requests() -> None:
    """``FlowRequest`` and ``ScheduleRequest`` refused numpy integers ("must be an int, got
    int64") where ``complete`` and ``record_output`` took them; a count summed with numpy
    (``prompt_tokens=arr.sum()``) is one. So did ``update_endpoint``'s counts (which
    ``EndpointPool.update`` takes), ``charge_remote``'s priority and a ``ticket``. Bools stay
    refused."""
    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
    request = FlowRequest(
        np.int64(1), priority=np.int32(3), prompt_tokens=np.int64(40), size_bytes=np.uint64(9)
    )
    assert ctrl.enqueue(request) is None
    decision = ctrl.dispatch()
    assert decision is not None and (decision.id, decision.priority) == (1, 3)
    assert ctrl.metrics()["running_tokens"] == 40
    ctrl.complete(np.int64(1))
    # The controller's other int arguments, as EndpointPool.update takes its counts.
    ctrl.update_endpoint("pod-a", waiting=np.int64(2), running=np.uint32(1), kv_cache_usage=0.5)
    assert ctrl.charge_remote("t", np.int16(0), prompt_tokens=np.int64(3)) is False
    assert ctrl.enqueue(FlowRequest(3)) is None
    decision = ctrl.dispatch()
    assert decision is not None
    ctrl.record_output(3, np.int64(5), ticket=np.uint64(2**64 - 1))  # another's: stale
    ctrl.complete(3, ticket=np.uint64(2**64 - 1))
    assert ctrl.is_running(3)
    ctrl.complete(3)
    with pytest.raises(InvalidTypeError, match="waiting must be an int, got bool"):
        ctrl.update_endpoint("pod-a", waiting=np.True_)
    for name, value in (("id", np.True_), ("priority", True), ("prompt_tokens", 4.0)):
        bad = FlowRequest(2)
        setattr(bad, name, value)
        with pytest.raises(InvalidTypeError, match=f"FlowRequest.{name} must be an int"):
            ctrl.enqueue(bad)
    assert len(ctrl) == 0

    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 4}})
    scheduled = ScheduleRequest(
        tokens=[1, 2], priority=np.int64(-1), prompt_tokens=np.int32(7), size_bytes=np.uint8(3)
    )
    assert (scheduled.priority, scheduled.prompt_tokens, scheduled.size_bytes) == (-1, 7, 3)
    assert type(scheduled.priority) is int and type(scheduled.prompt_tokens) is int
    with s.schedule_sync(scheduled):
        assert s.flow is not None and s.flow.metrics()["running_tokens"] == 7
    for field, value in (("priority", np.True_), ("prompt_tokens", 7.0), ("size_bytes", -1)):
        with pytest.raises(InvalidRequestError, match=field):
            ScheduleRequest(tokens=[1], **{field: value})
    with pytest.raises(InvalidRequestError, match="priority"):
        ScheduleRequest(tokens=[1], priority=np.int64(2**31))


def test_a_refusal_and_its_outcome_survive_pickle_and_copy() -> None:
    """``FlowRejected`` could not be pickled (its ``Outcome`` had no reduction) nor copied
    (rebuilt from its message alone): a gateway handing it across processes (a process pool,
    a queue) got a TypeError in its place."""
    for outcome in (Outcome.DISPATCHED, Outcome.REJECTED_SHED, Outcome.EVICTED_CANCELLED):
        for again in (pickle.loads(pickle.dumps(outcome)), copy.copy(outcome)):
            assert again == outcome and again.key == outcome.key
    rejected = FlowRejected(7, Outcome.EVICTED_TTL, retry_after_s=2.5)
    for again in (
        pickle.loads(pickle.dumps(rejected)),
        copy.copy(rejected),
        copy.deepcopy(rejected),
    ):
        assert type(again) is FlowRejected and str(again) == str(rejected)
        assert (again.request_id, again.outcome, again.retry_after_s) == (
            7,
            Outcome.EVICTED_TTL,
            2.5,
        )
        assert (again.http_status, again.reason) == (rejected.http_status, rejected.reason)


@pytest.mark.parametrize("ends", ["complete", "cancel", "context"])
def test_output_streamed_through_a_placements_admission_is_charged_once(ends: str) -> None:
    """A ``schedule()`` placement owns its admission: output charged while it streams
    (``placement.admission.record_output``, VTC's per-token rule) was charged again when the
    placement ended with its count (``add_output_tokens``), doubling the tenant's service."""
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    assert s.flow is not None

    def service() -> int:
        assert s.flow is not None
        return sum(f["service_tokens"] for f in s.flow.metrics()["flows"] if f["tenant"] == "t")

    with s.schedule_sync(ScheduleRequest(tokens=[1, 2, 3], tenant="t")) as placement:
        admission = placement.admission
        assert admission is not None
        for chunk in (4, 3, 5):
            placement.add_output_tokens(chunk)
            admission.record_output(chunk)
        assert service() == 3 + 12
        if ends == "complete":
            placement.complete(20)  # the whole answer: 8 more than streamed
        elif ends == "cancel":
            placement.cancel()
    assert service() == 3 + (20 if ends == "complete" else 12)
    assert s.flow.running_count() == 0 and not admission.holds_slot


ONE_SLOT_SCHEDULER = {"saturation": {"type": "concurrency", "max_requests": 1}}


def _scheduler_at_rest(s: Scheduler) -> None:
    assert s.flow is not None and s.flow.running_count() == 0
    assert s.stats()["in_flight"] == 0
    with s.schedule_sync(ScheduleRequest(tokens=[9])):  # the one slot is free again
        pass


@pytest.mark.timeout(30)
def test_a_client_leaving_with_a_count_that_cannot_be_charged_still_frees_the_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``output_tokens`` set to an estimate (a float) in a ``schedule()`` block: when the
    client left, the exit refused the count and kept the placement open, so the slot and the
    in-flight count were held for good (a one-slot scheduler stalled), and the task ended
    with InvalidTypeError instead of its cancellation (a TaskGroup or timeout saw a failure).
    The exit now always ends it, charging no output; the count's error is logged."""
    s = Scheduler(["a"], flow=ONE_SLOT_SCHEDULER)

    async def handler() -> None:
        async with s.schedule(ScheduleRequest(tokens=[1, 2, 3], tenant="t")) as placement:
            placement.output_tokens = 10 / 4  # type: ignore[assignment]
            await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait((task,))
        assert task.cancelled(), "the cancellation became another exception"

    with caplog.at_level("WARNING", logger="llmsched"):
        asyncio.run(main())
    assert "output count was not charged: output_tokens must be an int, got float" in caplog.text
    assert s.stats()["cancelled"] == 1
    _scheduler_at_rest(s)


@pytest.mark.parametrize("body", ["returns", "raises"])
def test_a_block_ending_with_a_count_that_cannot_be_charged_ends_its_placement(
    body: str,
) -> None:
    """Leaving the block normally raises the count's error once the placement has ended
    (completed, no output charged); leaving it with an exception lets that exception through
    (the count's error is logged). Either way nothing stays held. ``complete()`` called
    directly still refuses the count and leaves the placement open (probe 49 F14)."""
    s = Scheduler(["a"], flow=ONE_SLOT_SCHEDULER)
    raised: type[BaseException] = InvalidValueError if body == "returns" else OSError
    request = ScheduleRequest(tokens=[1, 2], tenant="t")
    with pytest.raises(raised), s.schedule_sync(request) as placement:
        placement.output_tokens = -1
        with pytest.raises(InvalidValueError):
            placement.complete()
        assert placement.outcome is None
        if body == "raises":
            raise OSError("the engine went away")
    assert placement.outcome == ("completed" if body == "returns" else "failed")
    _scheduler_at_rest(s)
