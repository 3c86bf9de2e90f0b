"""Concurrency claims checked with threads against an oracle.

Each test joins its threads with a timeout, so a deadlock fails rather than hangs the suite.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from llmsched import PrefixIndex, Scheduler, ScheduleRequest
from llmsched.errors import PlacementError


def _in_flight(s: Scheduler) -> dict[Any, int]:
    return {e["id"]: e["in_flight_requests"] for e in s.pool.endpoints()}


def _on_thread(fn: Any) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "a thread hung"


@pytest.mark.timeout(30)
def test_a_placement_ended_on_another_thread_while_it_retries_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """F2: `retry` installed the attempt it started after releasing its lock, so a `cancel`
    (or `complete`, `fail`) on another thread in between ended the placement with no attempt
    and the new one was never finished: its endpoint kept a request in flight for good."""
    s = Scheduler(["a", "b", "c"], router="least-load")
    placement = s.place(ScheduleRequest(tokens=list(range(64))))
    start_attempt = s._start_attempt

    def ended_meanwhile(first: Any, endpoint: Any) -> Any:
        attempt = start_attempt(first, endpoint)
        _on_thread(placement.cancel)  # the client went away while the attempt started
        return attempt

    monkeypatch.setattr(s, "_start_attempt", ended_meanwhile)
    with pytest.raises(PlacementError, match="ended"):
        placement.retry()
    assert placement.outcome == "cancelled"
    assert not placement.cancel() and not placement.complete()
    assert _in_flight(s) == {"a": 0, "b": 0, "c": 0}
    assert s.stats()["in_flight"] == 0 and s.stats()["cancelled"] == 1


@pytest.mark.timeout(60)
def test_placements_retried_and_ended_from_two_threads_hold_nothing() -> None:
    """F2 under real threads: one thread retries every placement while another ends them;
    afterwards no endpoint holds a request and every placement ended once."""
    s = Scheduler([f"e{i}" for i in range(6)], router="least-load")
    placements = [
        s.place(ScheduleRequest(tokens=list(range(i % 40, i % 40 + 64)))) for i in range(1500)
    ]
    failures: list[BaseException] = []
    barrier = threading.Barrier(2, timeout=10)

    def retry_all() -> None:
        try:
            barrier.wait()
            for p in placements:
                with contextlib.suppress(PlacementError):  # ended first: nothing to retry
                    p.retry()
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    def end_all() -> None:
        try:
            barrier.wait()
            for i, p in enumerate(placements):
                (p.cancel, p.complete, p.fail)[i % 3]()
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=retry_all), threading.Thread(target=end_all)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not failures, failures[:3]
    assert all(p.outcome is not None for p in placements)
    assert all(n == 0 for n in _in_flight(s).values()), _in_flight(s)
    stats = s.stats()
    assert stats["in_flight"] == 0
    assert stats["completed"] + stats["failed"] + stats["cancelled"] == len(placements)


@pytest.mark.timeout(60)
def test_a_large_clear_returns_every_block_while_another_thread_snapshots() -> None:
    """F1: a clear of more than 4,096 blocks goes in steps with the lock released between
    them, and a `dumps` on another thread finishes a clear under way; the clear then returned
    only the blocks of its own steps (11,808 of 20,000, or 0), not every block it dropped."""
    index = PrefixIndex(block_size=1)
    index.store("other", list(range(10**9, 10**9 + 5)))
    stop = threading.Event()
    failures: list[BaseException] = []

    def snapshot() -> None:
        try:
            while not stop.is_set():
                PrefixIndex.loads(index.dumps())
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    thread = threading.Thread(target=snapshot)
    thread.start()
    returned = []
    try:
        for r in range(12):
            first = 1 + r * 100_000
            index.store("w", list(range(first, first + 20_000)))
            returned.append(index.remove_worker("w") if r % 2 else index.clear("w"))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive(), "a thread hung"
    assert not failures, failures
    assert returned == [20_000] * 12
    stats = index.stats()
    assert (stats["blocks"], stats["worker_blocks"]) == (5, {"other": 5})
