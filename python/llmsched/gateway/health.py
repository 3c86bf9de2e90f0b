"""Engine health in the gateway: which engines requests go to, judged from engine behaviour.

Model (each engine is in one state):

- **up**: routed to.
- **down**: health probes confirmed it does not answer. Left out of routing, probed again every
  ``retries.eject_s``; back after ``healthy_threshold`` good probes in a row.
- **open** (circuit breaker): its requests failed too often. Over the last ``breaker_window_s``
  seconds, at least ``breaker_min_requests`` attempts ended and at least ``breaker_failure_rate``
  of them failed. Left out for ``breaker_open_s``; then a half-open probe closes the breaker
  (up, window cleared) or opens it again. It never opens on the last engine up: confirming
  probes are asked instead.
- **draining**: an operator drained it (admin API): no new requests, no probes, until resumed.

Signals:

- A *probe* is ``GET <engine><path>`` answered 200 within ``timeout_s``.
- Request outcomes are passive signals and never take an engine out on their own: a refused or
  timed-out connection starts confirming probes at once, and ``failures_to_probe`` failed
  attempts in a row (5xx, answers cut off) start them too. ``unhealthy_threshold`` failed
  probes in a row take the engine down; one good probe ends the confirmation and the engine
  stays up. An answer cut off after its status line is a failed attempt on both planes, in the
  breaker's window and towards ``failures_to_probe``: only an answer that ends whole ends the
  run (the native plane counts the attempt in the breaker's window when its status line comes,
  and turns it into a failure if the answer is then cut). An answer cut by the request's own
  deadline (``timeouts.total_s``), or left by its client, counts neither way.
- Active checks (``interval_s``, null: off) probe every up engine on a timer, so an engine that
  dies between requests is found before a request pays for it.

What one client request can provoke (an engine dropping that request's connection, a 5xx for a
malformed body) counts as one failed attempt: it cannot take an engine down (that needs failed
probes) nor open its breaker (that needs ``breaker_min_requests`` attempts in the window). A
request that fails so on two or more engines and is answered by none counts against none of
them (the gateway's ``poisoned_requests`` metric): it asks for their probes instead
(:meth:`EngineHealth.ask_probes`), so a burst of inputs every engine answers with a 5xx does
not open every breaker, and engines failing together are still found by their probes.

Complexity: O(1) per recorded outcome (amortised; the window is a deque trimmed by age); the
background loop wakes at the earliest probe due, at most every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from llmsched.gateway.config import HealthConfig
from llmsched.gateway.metrics import GatewayMetrics
from llmsched.gateway.wake import wait_woken

__all__ = ["FAILURE_KINDS", "EngineHealth"]

log = logging.getLogger("llmsched.gateway")

FAILURE_KINDS = ("connect", "timeout", "status_5xx", "broken", "truncated")
"""Attempt outcomes that count as engine failures (anything else with a status is a success)."""

# Kinds after which the engine is probed at once: the connection itself failed.
_CONFIRM_AT_ONCE = frozenset({"connect", "timeout"})


@dataclass
class _Engine:
    status: str = "up"  # up | down | open | draining
    consecutive: int = 0
    window: deque[tuple[float, bool]] = field(default_factory=deque)
    failures_in_window: int = 0
    probing: bool = False
    next_probe: float = 0.0
    good_probes: int = 0
    bad_probes: int = 0


class EngineHealth:
    """The health state of every engine (see the module docstring).

    Args:
        config: the ``health`` section.
        recheck_s: how often a down engine is probed (``retries.eject_s``).
        probe: ``await probe(worker)`` is True when the engine answered its health probe.
        on_change: called with ``(worker, routable)`` when an engine leaves or rejoins routing.
        metrics: the gateway's metrics (probes, ejections, breaker opens, engine states).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: HealthConfig,
        *,
        recheck_s: float,
        probe: Callable[[str], Awaitable[bool]],
        on_change: Callable[[str, bool], None],
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.recheck_s = recheck_s
        self._probe = probe
        self._on_change = on_change
        self._metrics = metrics
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    # -- engines -----------------------------------------------------------------------------

    def set_engines(self, workers: Iterable[str], *, reset: Iterable[str] = ()) -> None:
        """Tracks exactly ``workers`` (new ones start up); ``reset`` ones start over as up."""
        wanted = list(workers)
        for worker in list(self._engines):
            if worker not in wanted:
                del self._engines[worker]
                self._metrics.engine_up.remove(worker)
        now = self._clock()
        for worker in [*wanted, *reset]:
            if worker in wanted and (worker not in self._engines or worker in set(reset)):
                self._engines[worker] = _Engine(next_probe=now + self._interval())
                self._metrics.engine_up.labels(worker).set(1)
        self._wake.set()

    def state(self, worker: str) -> str | None:
        """``"up"``, ``"down"``, ``"open"``, ``"draining"``, or None for an engine not
        tracked."""
        engine = self._engines.get(worker)
        return None if engine is None else engine.status

    def routable(self, worker: str) -> bool:
        """Whether requests may go to ``worker`` now."""
        engine = self._engines.get(worker)
        return engine is not None and engine.status == "up"

    def states(self) -> dict[str, str]:
        """The state of every tracked engine."""
        return {worker: engine.status for worker, engine in self._engines.items()}

    def drain(self, worker: str) -> None:
        """Takes ``worker`` out of routing until :meth:`resume` (requests in flight finish)."""
        engine = self._engines.get(worker)
        if engine is None or engine.status == "draining":
            return
        was_up = engine.status == "up"
        engine.status = "draining"
        if was_up:
            self._left_out(worker)

    def resume(self, worker: str) -> bool:
        """Brings a drained engine back; False when it was not draining."""
        engine = self._engines.get(worker)
        if engine is None or engine.status != "draining":
            return False
        self._up(worker, engine)
        return True

    # -- passive signals -----------------------------------------------------------------------

    def record(self, worker: str, failure: str | None) -> None:
        """One finished attempt on ``worker``: ``failure`` is None for a success, else one of
        :data:`FAILURE_KINDS`."""
        engine = self._engines.get(worker)
        if engine is None or engine.status != "up":
            return
        now = self._clock()
        failed = failure is not None
        engine.window.append((now, failed))
        engine.failures_in_window += failed
        self._trim(engine, now)
        if not failed:
            engine.consecutive = 0
            return
        engine.consecutive += 1
        if self._breaker_trips(engine):
            if self._others_up(worker):
                self._open(worker, engine, now)
                return
            # Never on the last engine in routing: nowhere better to send, and a failure rate
            # that requests provoke would shut every client out. Probes decide instead (a dead
            # engine still goes down by them).
            self._start_probing(worker, engine, confirm=True)
            return
        if failure in _CONFIRM_AT_ONCE or engine.consecutive >= self.config.failures_to_probe:
            self._start_probing(worker, engine, confirm=True)

    def ask_probes(self, worker: str) -> None:
        """Something other than an attempt of its own says ``worker`` may be unwell, and only
        probes can tell (it stays in routing meanwhile): a request failed on it and on every
        other engine it was tried on (the request, or the engines together, may be at fault).
        An engine not in routing keeps its schedule."""
        engine = self._engines.get(worker)
        if engine is not None and engine.status == "up":
            self._start_probing(worker, engine, confirm=True)

    def _others_up(self, worker: str) -> bool:
        return any(w != worker and e.status == "up" for w, e in self._engines.items())

    def _trim(self, engine: _Engine, now: float) -> None:
        horizon = now - self.config.breaker_window_s
        window = engine.window
        while window and window[0][0] < horizon:
            engine.failures_in_window -= window.popleft()[1]

    def _breaker_trips(self, engine: _Engine) -> bool:
        rate = self.config.breaker_failure_rate
        attempts = len(engine.window)
        return (
            rate is not None
            and attempts >= self.config.breaker_min_requests
            and engine.failures_in_window >= rate * attempts
        )

    # -- transitions ---------------------------------------------------------------------------

    def _open(self, worker: str, engine: _Engine, now: float) -> None:
        engine.status = "open"
        engine.next_probe = now + self.config.breaker_open_s
        self._metrics.breaker_opens.labels(worker).inc()
        self._left_out(worker)
        log.warning(
            "engine %s: %d of its last %d attempts failed; circuit open for %.1f s",
            worker,
            engine.failures_in_window,
            len(engine.window),
            self.config.breaker_open_s,
        )
        self._wake.set()

    def _down(self, worker: str, engine: _Engine) -> None:
        engine.status = "down"
        engine.good_probes = 0
        engine.bad_probes = 0
        engine.next_probe = self._clock() + self.recheck_s
        self._metrics.ejections.labels(worker).inc()
        self._left_out(worker)
        log.warning("engine %s failed its health probes; left out of routing", worker)
        self._wake.set()

    def _left_out(self, worker: str) -> None:
        self._metrics.engine_up.labels(worker).set(0)
        self._on_change(worker, False)

    def _up(self, worker: str, engine: _Engine) -> None:
        was = engine.status
        engine.status = "up"
        engine.consecutive = 0
        engine.window.clear()
        engine.failures_in_window = 0
        engine.good_probes = 0
        engine.bad_probes = 0
        engine.next_probe = self._clock() + self._interval()
        if was != "up":
            self._metrics.engine_up.labels(worker).set(1)
            self._on_change(worker, True)
            log.info("engine %s is back in routing (was %s)", worker, was)

    # -- probes --------------------------------------------------------------------------------

    def _interval(self) -> float:
        return self.config.interval_s if self.config.interval_s is not None else float("inf")

    def _start_probing(self, worker: str, engine: _Engine, *, confirm: bool) -> None:
        if engine.probing:
            return
        engine.probing = True
        task = asyncio.get_running_loop().create_task(self._probe_run(worker, engine, confirm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe_run(self, worker: str, engine: _Engine, confirm: bool) -> None:
        """Up engine: probes until one answers (it stays up) or ``unhealthy_threshold`` fail in
        a row (down); ``confirm`` runs them back to back, an active check runs one per timer.
        Down or open engine: one probe."""
        try:
            rounds = self.config.unhealthy_threshold if confirm else 1
            for _ in range(rounds):
                ok = await self._probe_once(worker)
                if self._engines.get(worker) is not engine:
                    return  # removed (or reset) meanwhile
                if engine.status == "up":
                    if ok:
                        engine.consecutive = 0
                        engine.bad_probes = 0
                        return
                    engine.bad_probes += 1
                    if engine.bad_probes >= self.config.unhealthy_threshold:
                        self._down(worker, engine)
                        return
                elif engine.status == "draining":
                    return
                elif engine.status == "open":
                    if ok:
                        self._up(worker, engine)
                    else:
                        engine.next_probe = self._clock() + self.config.breaker_open_s
                    return
                else:  # down
                    engine.good_probes = engine.good_probes + 1 if ok else 0
                    if engine.good_probes >= self.config.healthy_threshold:
                        self._up(worker, engine)
                    else:
                        engine.next_probe = self._clock() + (
                            min(self.recheck_s, self._interval()) if ok else self.recheck_s
                        )
                    return
        finally:
            engine.probing = False
            self._wake.set()

    async def _probe_once(self, worker: str) -> bool:
        try:
            ok = await self._probe(worker)
        except Exception:  # a probe that fails in any way is a failed probe
            log.debug("health probe of %s raised", worker, exc_info=True)
            ok = False
        self._metrics.probes.labels(worker, "ok" if ok else "failed").inc()
        return ok

    async def run(self) -> None:
        """Runs due probes until cancelled: active checks of up engines, rechecks of down
        ones, half-open probes of open breakers."""
        self._wake = asyncio.Event()  # bound to this loop (a gateway may restart on another)
        try:
            while True:
                now = self._clock()
                earliest = now + 1.0
                for worker, engine in list(self._engines.items()):
                    if engine.probing or engine.status == "draining":
                        continue
                    if engine.next_probe <= now:
                        if engine.status == "up":
                            engine.next_probe = now + self._interval()
                        self._start_probing(worker, engine, confirm=False)
                    else:
                        earliest = min(earliest, engine.next_probe)
                self._wake.clear()
                await wait_woken(self._wake, max(earliest - now, 0.001))
        finally:
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
