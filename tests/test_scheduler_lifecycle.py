"""The scheduler's start and stop. ``start_sync`` / ``stop_sync`` called from several threads
at once: one start wins, a stop waits for a start under way and stops what it started, and no
feed outlives the scheduler's last stop (a scraper left running after ``started`` turned False
was stopped by nothing). ``await stop()`` cancelled while it waits for the feeds to end is
cancelled (it swallowed the cancellation and ran on). Feeds here are metrics scrapers of
engines that are not there (their loop runs all the same)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from llmsched import Scheduler, ScheduleRequest
from llmsched.errors import EventLoopError, InvalidTypeError
from llmsched.integrations import EngineSpec, MetricsScraper

LIMIT_S = 30.0


def scraper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "llmsched-metrics" and t.is_alive()]


def scheduler() -> Scheduler:
    # Port 9 (discard): nothing listens; the scraper thread runs all the same.
    return Scheduler(
        [EngineSpec("127.0.0.1", 9)], scrape=True, kv_events=False, scrape_interval_s=60.0
    )


def in_threads(*targets: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    return threads


def joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(LIMIT_S)
        assert not thread.is_alive(), "a call hung"


@pytest.fixture(autouse=True)
def no_scraper_left() -> Iterator[None]:
    assert not scraper_threads()
    yield
    assert not scraper_threads()


def test_a_stop_during_a_start_stops_what_the_start_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start set its mode, then started its feeds: a stop in between saw the mode, stopped
    nothing and cleared it, and the feeds the start went on to start ran on with ``started``
    False, where no stop reached them."""
    s = scheduler()
    entered, go = threading.Event(), threading.Event()
    start = MetricsScraper.start

    def held_start(self: MetricsScraper) -> None:
        entered.set()
        assert go.wait(LIMIT_S)
        start(self)

    monkeypatch.setattr(MetricsScraper, "start", held_start)
    (starting,) = in_threads(s.start_sync)
    assert entered.wait(LIMIT_S)
    (stopping,) = in_threads(s.stop_sync)
    stopping.join(1.0)  # returns at once without a lock; waits for the start with one
    go.set()
    joined([starting, stopping])
    # Either order is consistent: stopped with nothing running, or started with one feed.
    assert (s.started, len(scraper_threads())) in ((False, 0), (True, 1))
    assert s.started is False  # the stop came after the start here
    s.stop_sync()


def test_threads_hammering_start_and_stop_leave_one_mode_and_its_feeds() -> None:
    s = scheduler()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        barrier = threading.Barrier(6)

        def hammer(seed: int) -> Callable[[], None]:
            def run() -> None:
                rng = random.Random(seed)
                barrier.wait(LIMIT_S)
                for _ in range(15):
                    s.start_sync() if rng.random() < 0.6 else s.stop_sync()

            return run

        joined(in_threads(*(hammer(seed) for seed in range(6))))
        # Whatever the order, the state is one of the two whole ones.
        assert (s.started, len(scraper_threads())) in ((False, 0), (True, 1))
        starters = in_threads(*([s.start_sync] * 6))
        joined(starters)
        assert s.started and len(scraper_threads()) == 1  # one start won
    finally:
        sys.setswitchinterval(interval)
        s.stop_sync()
    assert not s.started


def test_a_stop_cancelled_while_the_feeds_end_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop waited for the feeds' restart (after an engine change), then for the scraper's
    task, with ``CancelledError`` suppressed, its own included: a stop cancelled there
    returned normally (and an ``asyncio.wait_for`` around it never timed out)."""

    async def main() -> None:
        ending, cancelled = asyncio.Event(), asyncio.Event()

        async def slow_to_end(self: MetricsScraper) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
                await ending.wait()  # its cleanup takes until the test lets it end

        monkeypatch.setattr(MetricsScraper, "run", slow_to_end)
        s = scheduler()
        await s.start()
        s.set_engines([EngineSpec("127.0.0.1", 9), EngineSpec("127.0.0.1", 10)])  # a restart
        for waiting_for in ("the feeds' restart", "the scraper's task"):
            ending.clear()
            cancelled.clear()
            stopping = asyncio.ensure_future(s.stop())
            await cancelled.wait()  # the scraper is ending: the stop waits for it
            assert not stopping.done()
            stopping.cancel()
            ending.set()
            with pytest.raises(asyncio.CancelledError):
                await stopping
            assert s.started, waiting_for
            await s.feeds_settled()
        await s.stop()
        assert not s.started

    asyncio.run(asyncio.wait_for(main(), LIMIT_S))


def test_a_feed_restart_cancelled_while_it_waits_for_the_last_one_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine change restarts the feeds in a task that first waits for the restart before
    it. Cancelled meanwhile (a loop shutting down), it suppressed its own cancellation with the
    previous restart's and went on to stop and start the feeds."""

    async def main() -> None:
        s = scheduler()
        await s.start()
        entered, go = asyncio.Event(), asyncio.Event()
        stop_feeds = s._stop_feeds_async
        calls: list[int] = []

        async def held_stop() -> None:
            calls.append(1)
            if len(calls) == 1:  # the first restart, held while it stops the feeds
                entered.set()
                await go.wait()
            await stop_feeds()

        monkeypatch.setattr(s, "_stop_feeds_async", held_stop)
        s.add_engine(EngineSpec("127.0.0.1", 10))
        await entered.wait()
        s.add_engine(EngineSpec("127.0.0.1", 11))  # its restart waits for the first
        second = s._restart
        assert second is not None
        await asyncio.sleep(0)  # it is waiting
        second.cancel()
        go.set()
        await asyncio.wait((second,), timeout=LIMIT_S)
        assert second.cancelled()
        assert calls == [1]  # the cancelled restart stopped (and started) nothing
        await s.feeds_settled()
        await s.stop()

    asyncio.run(asyncio.wait_for(main(), LIMIT_S))


def test_schedule_under_a_plain_with_names_async_with() -> None:
    """``with scheduler.schedule(...)`` (``async with`` meant) was Python's own error: on 3.10
    ``AttributeError: __enter__``, naming neither fix. Now an InvalidTypeError (a TypeError)
    names both forms, and nothing was admitted or placed."""
    scheduler = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 1}})
    fixes = r"`async with scheduler\.schedule\(request\) as placement:`.*schedule_sync\(request\)"
    with (
        pytest.raises(InvalidTypeError, match=fixes),
        scheduler.schedule(ScheduleRequest(tokens=[1, 2])),  # type: ignore[attr-defined]
    ):
        pass
    assert scheduler.stats()["admitted"] == 0
    assert scheduler.flow is not None and scheduler.flow.running_count() == 0
    with scheduler.schedule_sync(ScheduleRequest(tokens=[1, 2])) as placement:
        assert placement.endpoint == "a"


def test_sync_calls_inside_a_running_loop_name_the_form_to_await() -> None:
    """``admit_sync`` / ``schedule_sync`` inside a running event loop raised a builtin
    RuntimeError (not one of ``llmsched.errors``); now an EventLoopError (still a
    RuntimeError) naming the awaitable form, with nothing admitted."""
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 1}})

    async def main() -> None:
        with pytest.raises(EventLoopError, match=r"await scheduler\.admit\(request\)"):
            s.admit_sync(ScheduleRequest(tokens=[1, 2]))
        with pytest.raises(EventLoopError, match=r"async with scheduler\.schedule\(request\)"):
            s.schedule_sync(ScheduleRequest(tokens=[1, 2]))

    asyncio.run(asyncio.wait_for(main(), LIMIT_S))
    assert issubclass(EventLoopError, RuntimeError)
    assert s.stats()["admitted"] == 0
    assert s.flow is not None and s.flow.running_count() == 0


def test_start_sync_inside_a_running_loop_names_await_start() -> None:
    """``start_sync()`` inside a running event loop quietly started the feeds on threads of
    their own, beside the loop that ``await start()`` would have used (an engine change then
    restarted them on the loop's thread, blocking it). It raises EventLoopError naming
    ``await scheduler.start()`` and starts nothing; outside a loop it starts them."""
    s = scheduler()

    async def main() -> None:
        with pytest.raises(EventLoopError, match=r"await scheduler\.start\(\)"):
            s.start_sync()
        assert not s.started and not scraper_threads()

    asyncio.run(asyncio.wait_for(main(), LIMIT_S))
    s.start_sync()
    try:
        assert s.started and len(scraper_threads()) == 1
    finally:
        s.stop_sync()
