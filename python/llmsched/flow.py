"""Flow control: decides *when* a request may be dispatched.

High-priority traffic stays fast under overload while batch work fills idle capacity. Requests
join the flow ``(tenant, priority)``; :meth:`FlowController.dispatch` serves the highest
non-empty priority band while pool saturation is below that band's ceiling (no lower band
dispatches while a higher one is blocked), a fairness policy picks the flow inside the band
(``strict``, ``round-robin``, ``vtc``, ``las``) and an ordering policy the request (``fcfs``,
``edf``, ``slo-deadline``). Every request ends in exactly one :class:`Outcome`, which carries
the HTTP status and the dropped-reason header value for gateways.

Configuration is a plain dict (or YAML): absent keys take their defaults, unknown keys raise
:class:`~llmsched.errors.ConfigError`. :func:`default_config` shows every default.

Two ways to drive it: the synchronous core (``enqueue``, ``dispatch``, ``complete``, ``cancel``,
``expire``) for a gateway with its own loop, or ``await controller.admit(request)``, which
returns when the request is dispatched and raises :class:`~llmsched.errors.FlowRejected`
otherwise. One controller is safe to share between threads and asyncio tasks.

>>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
>>> ctrl.enqueue(FlowRequest(1, priority=-1, tenant="batch")) is None
True
>>> ctrl.enqueue(FlowRequest(2, priority=10, tenant="chat")) is None
True
>>> ctrl.dispatch().id   # the interactive request goes first
2
>>> ctrl.dispatch() is None   # one request in flight = saturated
True
>>> ctrl.complete(2, output_tokens=20)
>>> ctrl.dispatch().id
1
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import operator
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from llmsched._copying import by_default, refuse
from llmsched._llmsched import FlowCore, FlowDecision, Outcome, flow_resolve_config
from llmsched.config_loader import ConfigSource, load_mapping
from llmsched.errors import (
    ConfigError,
    FlowRejected,
    InvalidRequestError,
    InvalidTypeError,
    UnknownRequestError,
)
from llmsched.types import BandConfig, FlowConfig, FlowMetrics
from llmsched.validation import (
    check_callable,
    check_config_data,
    check_index,
    check_int_like,
    check_now,
    check_number_like,
    check_positive_seconds,
    check_probability,
    check_str,
    check_utf8,
    describe_int,
    is_bool,
    is_finite_number,
)

if TYPE_CHECKING:
    # Imported where used: `import llmsched` stays free of asyncio and PyYAML (about 10 and
    # 20 ms).
    import asyncio

__all__ = [
    "FlowController",
    "FlowDecision",
    "FlowRequest",
    "Outcome",
    "default_config",
    "load_config",
    "resolve_config",
]

ConfigLike = ConfigSource | None
"""A config dict, YAML/JSON text, a path to a YAML/JSON file, or None for the defaults."""


@dataclass(slots=True)
class FlowRequest:
    """A request asking to be dispatched (its fields are read once, at enqueue).

    ``priority``: higher first; negative = sheddable. ``tenant``: the fairness id.
    ``prompt_tokens``: the prompt's token count (fairness cost, in-flight tokens).
    ``size_bytes``: counts against byte limits.
    ``deadline``: absolute time on the controller's clock (``edf``). ``ttft_target``: seconds
    (``slo-deadline``). ``payload``: anything; handed back in the :class:`FlowDecision`.
    The int fields take an int or a numpy integer (not a bool).

    >>> FlowRequest(7, priority=2, tenant="acme", prompt_tokens=512).priority
    2
    """

    id: int
    priority: int = 0
    tenant: str = "default"
    prompt_tokens: int = 0
    size_bytes: int = 0
    deadline: float | None = None
    ttft_target: float | None = None
    payload: Any = None


def load_config(source: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a config from YAML (or JSON) text or a file path into a plain dict
    (:func:`llmsched.config_loader.load_mapping`).

    >>> load_config("default_band: {ttl_s: 30}")
    {'default_band': {'ttl_s': 30}}
    """
    return load_mapping(source, what="flow config")


def _as_dict(config: ConfigLike) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (Mapping, str, os.PathLike)):
        return load_mapping(config, what="flow config")
    raise InvalidTypeError(
        f"config must be a mapping, YAML text or a path, got {type(config).__name__}"
    )


def resolve_config(config: ConfigLike = None) -> FlowConfig:
    """The full configuration: ``config`` merged over every default and checked.

    >>> resolve_config({"default_band": {"fairness": {"type": "vtc"}}})["default_band"]["fairness"]
    {'type': 'vtc', 'w_p': 1.0, 'w_q': 2.0, 'weights': {}}
    """
    return _native_config(flow_resolve_config, _as_dict(config))


_T = TypeVar("_T")


def _native_config(read: Callable[[dict[str, Any]], _T], config: dict[str, Any]) -> _T:
    """``read(config)`` (a native reader of the flow config); a value its conversion refuses
    without naming a key (a lone surrogate, an int beyond 64 bits) is named by its key path."""
    try:
        return read(config)
    except ConfigError:
        check_config_data("flow config", config)
        raise


def default_config() -> FlowConfig:
    """Every default, in config form (defaults live in the Rust core, nowhere else).

    >>> default_config()["default_band"]["max_requests"]
    5000
    """
    return resolve_config(None)


_Waiter = tuple["asyncio.AbstractEventLoop", "asyncio.Future[FlowDecision]"]


def _int64(name: str, value: object) -> object:
    """``value``, refused with :class:`~llmsched.errors.InvalidRequestError` when it is an
    int beyond 64 bits (the native core's range; its own checks name a negative one), and with
    :class:`~llmsched.errors.InvalidTypeError` when the native core could not read it as an int
    at all, or is a bool (a numpy integer passes on, as the core reads it)."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be an int, got bool")
    if type(value) is not int:
        check_int_like(name, value)  # a numpy integer: its range is checked as an int's
    if not -(2**63) <= operator.index(value) < 2**63:  # type: ignore[arg-type]
        raise InvalidRequestError(f"{name} must fit in 64 bits, got {value}")
    return value


def _request_id(value: object) -> None:
    """:func:`_int64`, and a negative id refused as the core refuses it elsewhere (its
    unsigned conversion gave a bare OverflowError)."""
    _int64("request_id", value)
    if operator.index(value) < 0:  # type: ignore[arg-type]
        raise InvalidRequestError(f"request_id must be >= 0, got {value}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    aio = sys.modules.get("asyncio")
    if aio is None:  # never imported: no loop can be running
        return None
    try:
        loop: asyncio.AbstractEventLoop = aio.get_running_loop()
        return loop
    except RuntimeError:
        return None


class FlowController:
    """Priority bands, fairness, capacity, saturation, shedding and preemption for one pool.

    ``clock`` supplies ``now`` (seconds, monotonic) wherever a call does not pass one.
    ``poll_interval_s`` bounds how long an :meth:`admit` sleeps without re-checking TTL expiry
    and saturation on its own (every ``enqueue``, ``complete`` and ``update_endpoint`` already
    wakes waiters that can go).

    >>> ctrl = FlowController()   # llm-d defaults: utilization saturation needs endpoints
    >>> ctrl.enqueue(FlowRequest(1)).key
    'rejected_no_endpoints'
    >>> ctrl.update_endpoint("pod-a", waiting=1, kv_cache_usage=0.2)
    >>> ctrl.enqueue(FlowRequest(2)) is None
    True
    >>> ctrl.dispatch().id
    2
    """

    def __init__(
        self,
        config: ConfigLike = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_interval_s: float = 1.0,
    ) -> None:
        poll_interval_s = check_positive_seconds("poll_interval_s", poll_interval_s)
        check_callable("clock", clock)
        self._core = _native_config(FlowCore, _as_dict(config))
        self._config: FlowConfig = self._core.config()
        self._clock = clock
        self._poll_interval_s = float(poll_interval_s)
        # Keyed by ticket, not by request id: an id may be queued again (a retry, another
        # caller) once its request left, and a decision must reach only the admit() whose
        # enqueue made it (the core hands each decision back with its ticket).
        self._waiters: dict[int, _Waiter] = {}
        self._tickets = itertools.count(1)
        # Dispatched by `pump` with nobody awaiting them: handed out by `dispatch`.
        self._unclaimed: deque[FlowDecision] = deque()
        # Side-effect evictions with nobody awaiting them: handed out by `drain_evicted`.
        self._evicted: deque[FlowDecision] = deque()
        self._pump_lock = threading.Lock()

    @property
    def config(self) -> FlowConfig:
        """The resolved configuration (a copy)."""
        return copy.deepcopy(self._config)

    def _now(self, now: float | None) -> float:
        return check_now(now, self._clock)

    # -- synchronous core ------------------------------------------------------------------

    def enqueue(self, request: FlowRequest, *, now: float | None = None) -> Outcome | None:
        """Offers a request: ``None`` when queued, else the refusal :class:`Outcome`
        (``REJECTED_CAPACITY``, ``REJECTED_SHED`` or ``REJECTED_NO_ENDPOINTS``).

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4},
        ...                        "default_band": {"max_requests": 1}})
        >>> ctrl.enqueue(FlowRequest(1)), ctrl.enqueue(FlowRequest(2))
        (None, Outcome.REJECTED_CAPACITY)
        """
        return self._enqueue(request, now, None)

    def _enqueue(
        self, request: FlowRequest, now: float | None, ticket: int | None
    ) -> Outcome | None:
        """:meth:`enqueue`, the request carrying ``ticket`` (the awaiting :meth:`admit`)."""
        if not isinstance(request, FlowRequest):
            raise InvalidTypeError(f"request must be a FlowRequest, got {type(request).__name__}")
        for name in ("id", "priority", "prompt_tokens", "size_bytes"):
            # An int or a numpy integer, as everywhere else (not a bool, nor a float).
            _int64(f"FlowRequest.{name}", getattr(request, name))
        if isinstance(request.tenant, str):  # a wrong type is named when the native side refuses
            check_utf8("FlowRequest.tenant", request.tenant)
        for name in ("deadline", "ttft_target"):  # the native side would read a bool as 0 or 1
            if is_bool(getattr(request, name)):
                check_number_like(f"FlowRequest.{name}", getattr(request, name))
        t = self._now(now)
        try:
            refused = self._core.enqueue(
                request.id,
                request.priority,
                request.tenant,
                request.prompt_tokens,
                request.size_bytes,
                request.deadline,
                request.ttft_target,
                request.payload,
                t,
                ticket,
            )
        except TypeError:  # name the field the native conversion refused
            check_str("FlowRequest.tenant", request.tenant)
            check_number_like("FlowRequest.deadline", request.deadline, optional=True)
            check_number_like("FlowRequest.ttft_target", request.ttft_target, optional=True)
            raise
        except OverflowError:  # an int beyond a float's range, refused by the conversion
            for name in ("deadline", "ttft_target"):
                value = getattr(request, name)
                if isinstance(value, int) and not is_finite_number(value):
                    raise InvalidRequestError(
                        f"FlowRequest.{name} must be a finite number, got {describe_int(value)}"
                    ) from None
            raise
        if self._core.has_evicted():
            self._route_evictions()
        return refused

    def dispatch(self, *, now: float | None = None) -> FlowDecision | None:
        """The next request to send to an endpoint, or ``None`` (empty, or the highest
        non-empty band is blocked). Requests awaited by :meth:`admit` go to their waiter.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
        >>> _ = ctrl.enqueue(FlowRequest(1, payload="hello"))
        >>> ctrl.dispatch().payload
        'hello'
        """
        if self._unclaimed:
            with contextlib.suppress(IndexError):
                return self._unclaimed.popleft()
        t = self._now(now)
        while True:
            decision = self._core.dispatch(t)
            if self._core.has_evicted():
                self._route_evictions()
            if decision is None or not self._settle_waiter(decision):
                return decision

    def complete(
        self,
        request_id: int,
        output_tokens: int = 0,
        *,
        now: float | None = None,
        ticket: int | None = None,
        wake: bool = True,
    ) -> None:
        """Marks a dispatched request finished (or revoked); charges ``output_tokens`` not yet
        reported to its tenant and frees its in-flight share. Raises
        :class:`~llmsched.errors.UnknownRequestError` when it is not running.

        ``wake=False`` leaves the waiting :meth:`admit` calls to the next :meth:`pump` or
        :meth:`poll` (each polls at least every ``poll_interval_s``) instead of pumping here:
        for a finalizer, which may run inside a pump, under its lock.

        ``ticket`` (an :meth:`admit`'s ``decision.ticket``) completes only the request that
        admit was given: when ``request_id`` runs for another caller (its own request ended
        and the id was dispatched again since), nothing changes, and the stale release is
        logged at debug level.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
        >>> _ = ctrl.enqueue(FlowRequest(1)); _ = ctrl.dispatch()
        >>> ctrl.complete(1, output_tokens=30)
        >>> ctrl.running_count()
        0
        """
        _int64("request_id", request_id)
        _int64("output_tokens", output_tokens)
        if ticket is not None:
            ticket = check_index("ticket", ticket, minimum=0, maximum=2**64 - 1)
        if not self._core.complete(request_id, output_tokens, self._now(now), ticket):
            import logging  # only on this rare path: `import llmsched` stays light

            logging.getLogger(__name__).debug(
                "stale release of request %s (ticket %s): it runs for another", request_id, ticket
            )
            return
        if wake and self._waiters:
            self.pump()

    def record_output(
        self,
        request_id: int,
        output_tokens: int,
        *,
        now: float | None = None,
        ticket: int | None = None,
    ) -> None:
        """Charges output tokens of a running request as they stream (VTC's per-token rule).
        Raises :class:`~llmsched.errors.UnknownRequestError` when it is not running.

        ``ticket`` (an :meth:`admit`'s ``decision.ticket``) charges only the request that
        admit was given: when ``request_id`` runs for another caller (its own request ended
        and the id was dispatched again since), nothing is charged, as for :meth:`complete`.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
        >>> _ = ctrl.enqueue(FlowRequest(1)); _ = ctrl.dispatch()
        >>> ctrl.record_output(1, 8)
        """
        _int64("request_id", request_id)
        _int64("output_tokens", output_tokens)
        if ticket is not None:
            ticket = check_index("ticket", ticket, minimum=0, maximum=2**64 - 1)
        if not self._core.record_output(request_id, output_tokens, self._now(now), ticket):
            import logging  # only on this rare path: `import llmsched` stays light

            logging.getLogger(__name__).debug(
                "stale output of request %s (ticket %s): it runs for another", request_id, ticket
            )

    def charge_remote(
        self,
        tenant: str,
        priority: int = 0,
        *,
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        now: float | None = None,
    ) -> bool:
        """Service another router replica gave ``tenant`` at ``priority`` (replica sync, see
        :mod:`llmsched.cluster`): charged to the fairness policy of the tenant's flow in that
        band, so a tenant heavy elsewhere is not served as new here. Returns False when this
        controller has no such flow (none is created). Local service metrics do not change.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
        >>> ctrl.charge_remote("t", prompt_tokens=10)
        False
        """
        check_str("tenant", tenant)
        priority = check_index("priority", priority, minimum=-(2**31), maximum=2**31 - 1)
        _int64("prompt_tokens", prompt_tokens)
        _int64("output_tokens", output_tokens)
        return self._core.charge_remote(
            tenant, priority, prompt_tokens, output_tokens, self._now(now)
        )

    def drain_service(self) -> list[tuple[str, int, int, int]]:
        """Service this controller gave since the last call, per flow with any: ``(tenant,
        priority, prompt tokens, output tokens)`` (what replica sync hands to the other
        replicas' :meth:`charge_remote`).

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 4}})
        >>> _ = ctrl.enqueue(FlowRequest(1, tenant="t", prompt_tokens=5)); _ = ctrl.dispatch()
        >>> ctrl.drain_service(), ctrl.drain_service()
        ([('t', 0, 5, 0)], [])
        """
        return self._core.drain_service()

    def cancel(self, request_id: int, *, now: float | None = None) -> FlowDecision | None:
        """Removes a queued request (``EVICTED_CANCELLED``); ``None`` when it is not queued.
        A pending :meth:`admit` for it raises :class:`~llmsched.errors.FlowRejected`.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
        >>> _ = ctrl.enqueue(FlowRequest(1))
        >>> ctrl.cancel(1).outcome
        Outcome.EVICTED_CANCELLED
        """
        _int64("request_id", request_id)
        decision = self._core.cancel(request_id, self._now(now))
        if decision is not None:
            self._settle_waiter(decision)
        return decision

    def expire(self, *, now: float | None = None) -> list[FlowDecision]:
        """Evicts queued requests whose TTL ran out (``EVICTED_TTL``) and returns them.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1},
        ...                        "default_band": {"ttl_s": 5}})
        >>> _ = ctrl.enqueue(FlowRequest(1), now=0.0)
        >>> [d.id for d in ctrl.expire(now=5.0)]
        [1]
        """
        expired = self._core.expire(self._now(now))
        for decision in expired:
            self._settle_waiter(decision)
        return expired

    def drain_evicted(self) -> list[FlowDecision]:
        """Evictions that happened as side effects (TTL met during ``dispatch``/``enqueue``,
        queued requests preempted by a higher-priority arrival) and that no :meth:`admit`
        awaited. Synchronous users should drain them to learn every outcome.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1},
        ...                        "global": {"max_requests": 1}})
        >>> _ = ctrl.enqueue(FlowRequest(1, priority=-1)); _ = ctrl.enqueue(FlowRequest(2))
        >>> [(d.id, d.outcome) for d in ctrl.drain_evicted()]
        [(1, Outcome.EVICTED_PREEMPTED)]
        """
        self._route_evictions()
        drained: list[FlowDecision] = []
        with contextlib.suppress(IndexError):
            while True:
                drained.append(self._evicted.popleft())
        return drained

    def preemption_victims(self, *, now: float | None = None) -> list[int]:
        """Running sheddable requests to revoke because a higher band is blocked by saturation
        (lowest priority, then newest dispatch; capped and paced by ``preemption``). Cancel them
        at the endpoint, then call :meth:`complete` (and re-enqueue them if you like).

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
        >>> _ = ctrl.enqueue(FlowRequest(1, priority=-1)); _ = ctrl.dispatch()
        >>> _ = ctrl.enqueue(FlowRequest(2, priority=5))
        >>> ctrl.preemption_victims()
        [1]
        """
        return self._core.preemption_victims(self._now(now))

    def update_endpoint(
        self,
        endpoint: str,
        *,
        waiting: int = 0,
        running: int = 0,
        kv_cache_usage: float = 0.0,
        timestamp: float | None = None,
    ) -> None:
        """Feeds one endpoint's load report to the saturation detector (``utilization``:
        ``max(waiting / queue_threshold, kv_cache_usage / kv_threshold)``, mean over endpoints).
        ``timestamp`` defaults to now; reports older than ``staleness_s`` are stale.

        >>> ctrl = FlowController()
        >>> ctrl.update_endpoint("pod-a", waiting=5, kv_cache_usage=0.4, timestamp=0.0)
        >>> ctrl.saturation(now=0.1)
        1.0
        """
        # The same rules as EndpointPool.update (llmsched.validation), checked before the core.
        waiting = check_index("waiting", waiting)
        running = check_index("running", running)
        kv_cache_usage = check_probability("kv_cache_usage", kv_cache_usage)
        now = check_now(timestamp, self._clock, name="timestamp")
        self._core.update_endpoint(
            check_utf8("endpoint", endpoint), waiting, running, kv_cache_usage, now
        )
        if self._waiters:
            self.pump()

    def remove_endpoint(self, endpoint: str) -> bool:
        """Forgets an endpoint; False when it was unknown.

        >>> FlowController().remove_endpoint("pod-a")
        False
        """
        removed = self._core.remove_endpoint(check_utf8("endpoint", endpoint))
        if self._waiters:
            self.pump()
        return removed

    def saturation(self, *, now: float | None = None) -> float:
        """The saturation gauge (what an autoscaler or admission layer reads).

        >>> FlowController({"saturation": {"type": "concurrency", "max_requests": 2}}).saturation()
        0.0
        """
        return self._core.saturation(self._now(now))

    def metrics(self, *, now: float | None = None) -> FlowMetrics:
        """Queue lengths per band and flow, wait-time histograms, outcome counts, saturation
        and Jain's fairness index, as a plain dict.

        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 2}})
        >>> ctrl.metrics()["queued"]
        0
        """
        metrics: FlowMetrics = self._core.metrics(self._now(now))
        return metrics

    def jain_index(self, priority: int | None = None) -> float:
        """Jain's fairness index over tenants' service tokens (one band, or all bands).

        >>> FlowController().jain_index()
        1.0
        """
        if priority is not None:
            _int64("priority", priority)
        return self._core.jain_index(priority)

    def running_count(self) -> int:
        """Dispatched requests not yet completed.

        >>> FlowController().running_count()
        0
        """
        return self._core.running_count()

    def is_queued(self, request_id: int) -> bool:
        """Whether ``request_id`` is waiting in the queue.

        >>> FlowController().is_queued(3)
        False
        """
        _request_id(request_id)
        return self._core.is_queued(request_id)

    def is_running(self, request_id: int) -> bool:
        """Whether ``request_id`` was dispatched and has not completed.

        >>> FlowController().is_running(3)
        False
        """
        _request_id(request_id)
        return self._core.is_running(request_id)

    def __len__(self) -> int:
        return len(self._core)

    # -- asyncio facade --------------------------------------------------------------------

    def pump(self, *, now: float | None = None) -> int:
        """Dispatches everything that may go now; awaited requests wake their :meth:`admit`,
        the rest wait for :meth:`dispatch`. Returns how many were dispatched.

        >>> FlowController().pump()
        0
        """
        t = self._now(now)
        count = 0
        with self._pump_lock:
            while (decision := self._core.dispatch(t)) is not None:
                count += 1
                if not self._settle_waiter(decision):
                    self._unclaimed.append(decision)
            if self._core.has_evicted():
                self._route_evictions()
        return count

    def poll(self, *, now: float | None = None) -> int:
        """Expires overdue requests, then :meth:`pump`. Call it periodically when nothing else
        drives the controller.

        >>> FlowController().poll()
        0
        """
        t = self._now(now)
        for decision in self._core.expire(t):
            if not self._settle_waiter(decision):
                self._evicted.append(decision)
        return self.pump(now=t)

    async def admit(self, request: FlowRequest) -> FlowDecision:
        """Enqueues ``request`` and returns its :class:`FlowDecision` once dispatched; raises
        :class:`~llmsched.errors.FlowRejected` (with outcome, HTTP status and reason) when it
        is refused or evicted. Cancelling the awaiting task cancels the request (so does any
        other end of the wait: the coroutine closed unfinished, an exception from ``clock``);
        if it was dispatched in the same instant, it is completed on the caller's behalf. An
        id that is queued or running already (whoever enqueued it) raises
        :class:`~llmsched.errors.DuplicateRequestError` and changes nothing; once its request
        has left, the id may be used again, and each call only ever gets, cancels or releases
        its own request (pass ``ticket=decision.ticket`` to :meth:`complete` and
        :meth:`record_output` to do the same).

        >>> import asyncio
        >>> ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 8}})
        >>> asyncio.run(ctrl.admit(FlowRequest(1, tenant="a"))).id
        1
        """
        if not isinstance(request, FlowRequest):
            raise InvalidTypeError(f"request must be a FlowRequest, got {type(request).__name__}")
        import asyncio

        loop = asyncio.get_running_loop()
        future: asyncio.Future[FlowDecision] = loop.create_future()
        # Registered before the enqueue: another thread may dispatch the request at once.
        # A request id already queued or running is refused by the core
        # (DuplicateRequestError), which leaves everything as it was.
        ticket = next(self._tickets)
        self._waiters[ticket] = (loop, future)
        try:
            refused = self._enqueue(request, None, ticket)
        except BaseException:
            self._waiters.pop(ticket, None)
            raise
        if refused is not None:
            self._waiters.pop(ticket, None)
            raise FlowRejected(request.id, refused)
        try:
            self.pump()
            decision = await self._wait(future, self._expiry_of(request))
        except BaseException:
            # Cancelled, or the wait ended another way (the coroutine closed unfinished, a
            # clock that failed): its request must not stay queued, or run, for nobody.
            self._abandon(request.id, ticket, future)
            raise
        if decision.outcome != Outcome.DISPATCHED:
            raise FlowRejected(request.id, decision.outcome)
        return decision

    def _expiry_of(self, request: FlowRequest) -> float:
        ttl = self._band_settings(request.priority).get("ttl_s")
        return math.inf if ttl is None else self._clock() + float(ttl)

    def _band_settings(self, priority: int) -> BandConfig:
        for band in self._config["bands"]:
            if band["priority"] == priority:
                return band
        return self._config["default_band"]

    async def _wait(self, future: asyncio.Future[FlowDecision], expires_at: float) -> FlowDecision:
        import asyncio

        while True:
            timeout = min(self._poll_interval_s, max(expires_at - self._clock(), 0.0) + 1e-3)
            done, _ = await asyncio.wait((future,), timeout=timeout)
            if done:
                return future.result()
            self.poll()

    def _abandon(self, request_id: int, ticket: int, future: asyncio.Future[FlowDecision]) -> None:
        """The awaiting task was cancelled: cancel the request, or, when a decision is already
        on its way, release a dispatched request once it lands. Only this call's own request
        (its ticket): the id may have been queued again since its decision was made."""
        cancelled = self._core.cancel(request_id, self._clock(), ticket)
        if cancelled is not None:
            self._waiters.pop(ticket, None)
            return
        if not future.get_loop().is_running():
            # A task collected unfinished once its loop closed, or stopped (never closed): no
            # callback runs there now, neither a release nor the dispatch queued for this
            # admit (a stopped loop runs it only if run again, and this coroutine, which would
            # use it, is ending). Given back now, by its ticket: the request was dispatched
            # (the decision on the future, or still on its way), or left (then unknown). The
            # core's complete, not complete() (which pumps): a collection may run inside a
            # pump, under its lock.
            if future.done() and (
                future.cancelled() or future.result().outcome != Outcome.DISPATCHED
            ):
                return
            with contextlib.suppress(UnknownRequestError):
                self._core.complete(request_id, 0, self._clock(), ticket)
            return
        future.add_done_callback(lambda f: self._release(request_id, ticket, f))

    def _release(self, request_id: int, ticket: int, future: asyncio.Future[FlowDecision]) -> None:
        """Completes the request the abandoned admit was dispatched, by its ticket: by the
        time this runs it may have been revoked and its id dispatched again for another."""
        if future.cancelled() or future.result().outcome != Outcome.DISPATCHED:
            return
        with contextlib.suppress(UnknownRequestError):
            self.complete(request_id, ticket=ticket)

    def _route_evictions(self) -> None:
        for decision in self._core.drain_evicted():
            if not self._settle_waiter(decision):
                self._evicted.append(decision)

    def _settle_waiter(self, decision: FlowDecision) -> bool:
        """Hands ``decision`` to the :meth:`admit` awaiting it; False when there is none."""
        ticket = decision.ticket
        waiter = None if ticket is None else self._waiters.pop(ticket, None)
        if waiter is None:
            return False
        loop, future = waiter
        if _running_loop() is loop:
            _set_result(future, decision)
            return True
        try:
            loop.call_soon_threadsafe(_set_result, future, decision)
        except RuntimeError:  # the waiter's loop is closed: nobody will use a dispatch
            if decision.outcome == Outcome.DISPATCHED:
                # Under the pump's lock maybe: the core's, not complete() (which pumps).
                with contextlib.suppress(UnknownRequestError):
                    self._core.complete(decision.id, 0, self._clock(), ticket)
        return True


def _set_result(future: asyncio.Future[FlowDecision], decision: FlowDecision) -> None:
    if not future.done():
        future.set_result(decision)


by_default(FlowRequest)
refuse(
    FlowController,
    "build a FlowController per process from its config (controller.config())",
    name="llmsched.FlowController",
)
