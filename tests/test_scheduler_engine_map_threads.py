"""The scheduler's engine map read while other threads change it (the native gateway reads
``warnings`` on its ``/metrics`` thread while discovery or the admin API change the engines on
the event loop): each read sees one whole engine set, never half of a change, and never
"dictionary changed size during iteration"."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable

from llmsched import Scheduler

LIMIT_S = 60.0
WORKERS = [f"w{i}" for i in range(40)]
# Two engine sets with nothing in common: every change removes one whole set and adds the other.
FIRST, SECOND = WORKERS[:20], WORKERS[20:]


def extra_keys_note_workers(s: Scheduler) -> list[str]:
    """The workers :attr:`Scheduler.warnings` names for skipped extra keys."""
    return sorted(
        w.split("'")[1] for w in s.warnings if "skipped for extra keys the index cannot" in w
    )


def test_engine_reads_during_engine_changes_see_whole_sets() -> None:
    s = Scheduler(FIRST, router="round-robin")
    for worker in WORKERS:  # events of every engine skipped: each has its note while there
        s.index.note_extra_keys(worker, 1)
    wanted = [sorted(FIRST), sorted(SECOND)]
    assert extra_keys_note_workers(s) == sorted(FIRST)
    failures: list[BaseException] = []
    seen: list[list[str]] = []
    stop = threading.Event()
    readers_ready = threading.Barrier(5)

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # reported below, with the others
                failures.append(exc)
                stop.set()

        return run

    def change() -> None:
        readers_ready.wait(LIMIT_S)
        rng = random.Random(0)
        for i in range(400):
            if stop.is_set():
                return
            engines = list(SECOND if i % 2 == 0 else FIRST)
            rng.shuffle(engines)
            s.set_engines(engines)
        stop.set()

    def read(what: Callable[[], list[str]]) -> Callable[[], None]:
        def run() -> None:
            readers_ready.wait(LIMIT_S)
            while not stop.is_set():
                got = what()
                if got not in wanted:
                    seen.append(got)
                    stop.set()

        return run

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [
            threading.Thread(target=guarded(body), daemon=True)
            for body in (
                change,
                read(lambda: extra_keys_note_workers(s)),
                read(lambda: sorted(map(str, s.engines))),
                read(lambda: sorted(map(str, s.engines)) + sorted(map(str, s.draining))),
                read(lambda: wanted[0] if s.stats()["engines"] == 20 else [str(s.stats())]),
            )
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(LIMIT_S)
            assert not thread.is_alive(), "a call hung"
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures
    assert not seen, f"half of an engine change seen: {seen[0]}"
    assert extra_keys_note_workers(s) == sorted(FIRST)  # 400 changes: back to the first set
    assert sorted(map(str, s.engines)) == sorted(FIRST)
