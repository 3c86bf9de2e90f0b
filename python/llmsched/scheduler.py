"""The request pipeline: admission, the pick, the in-flight ticket, retries and accounting.

A :class:`Scheduler` owns one :class:`~llmsched.EndpointPool`, one
:class:`~llmsched.PrefixIndex`, one :class:`~llmsched.Router`, an optional
:class:`~llmsched.FlowController` and the optional feeds (a
:class:`~llmsched.integrations.KVEventSubscriber` keeping the index current from the engines'
KV events, a :class:`~llmsched.integrations.MetricsScraper` feeding the pool and the flow
controller), and keeps them in step: adding, draining or removing an engine is one call.

Per request (a :class:`ScheduleRequest`): flow control admits it (priority, tenant; a refusal
or eviction raises :class:`~llmsched.errors.FlowRejected` carrying the outcome, the HTTP
status, the reason and a retry-after), the router picks an endpoint and the request's ticket
goes in flight there (a :class:`Placement`: endpoint, address, fallbacks). The caller sends the
request, marks the first token, and on an attempt that failed moves to the next fallback with
:meth:`Placement.retry`. Leaving ``async with scheduler.schedule(request) as placement:``
(or ``with scheduler.schedule_sync(request)``) settles the accounting: a normal exit
completes the request; an exception fails it, which also drops the approximate prefix record
the pick left for the failed endpoint (blocks no engine confirmed); a cancellation
(:class:`asyncio.CancelledError`) cancels it. Either way the in-flight counts and the flow
controller's slot are given back exactly once.

>>> import asyncio
>>> from llmsched import ScheduleRequest, Scheduler
>>> scheduler = Scheduler(["a", "b"], router="least-load")
>>> async def one() -> str:
...     async with scheduler.schedule(ScheduleRequest(tokens=range(64))) as placement:
...         placement.first_token()
...         return str(placement.endpoint)
>>> asyncio.run(one()) in ("a", "b")
True
>>> scheduler.stats()["completed"], scheduler.stats()["in_flight"]
(1, 0)

Decisions beyond what llm-d specifies: a retry picks afresh (the new decision carries the
in-flight accounting) but goes to the next endpoint of the first pick's order (chosen,
fallbacks, then the other endpoints considered), skipping any that left the pool; a failure's
record removal drops only blocks the worker holds unconfirmed and did not hold before the
pick, so what an engine reported, or another request recorded earlier, stays. Cost: admission
is the flow controller's, the pick the router's; a failure reads the worker's holdings once
(O(blocks the worker holds)).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, SupportsIndex

import numpy as np
import numpy.typing as npt

from llmsched._aio import cancel_and_wait, settled
from llmsched._copying import by_default, refuse
from llmsched._tokens import MAX_TOKEN_ID, TokensLike, as_token_array, raise_out_of_range
from llmsched.config_loader import ConfigSource, load_mapping
from llmsched.errors import (
    ConfigError,
    EventLoopError,
    FlowRejected,
    InvalidRequestError,
    InvalidTypeError,
    InvalidValueError,
    LlmschedError,
    NoEndpointError,
    PlacementError,
    UnknownBlockError,
    UnknownEndpointError,
    UnknownRequestError,
    UnknownWorkerError,
)
from llmsched.flow import FlowController, FlowRequest
from llmsched.prefix_index import PrefixIndex
from llmsched.routing import (
    EXPLAIN_ROWS,
    ConfigLike,
    Decision,
    Endpoint,
    EndpointId,
    EndpointPool,
    EndpointScores,
    Explanation,
    ProfileExplanation,
    Router,
    StalePolicy,
    config_info,
    render_messages,
)
from llmsched.types import SchedulerStats
from llmsched.validation import (
    check_id,
    check_no_empty_names,
    check_optional_str,
    check_utf8,
    describe_int,
    is_bool,
    is_finite_number,
    normal_address,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    from llmsched.integrations import (
        EngineSpec,
        KVEventSubscriber,
        MetricsScraper,
        NativeKVEventSubscriber,
    )

    EngineLike: TypeAlias = "Endpoint | EngineSpec | EndpointId"
    """What :class:`Scheduler` takes as an engine: an
    :class:`~llmsched.integrations.EngineSpec` (its ``kv_events`` and metrics feed the index
    and the pool), an :class:`~llmsched.Endpoint`, or a bare endpoint id."""

__all__ = [
    "Admission",
    "Placement",
    "PlacementOutcome",
    "ScheduleRequest",
    "Scheduler",
    "warn_flow_without_load",
]

log = logging.getLogger("llmsched")


PlacementOutcome = Literal["completed", "failed", "cancelled"]
"""How a :class:`Placement` ended."""

_WARNED: list[str] = []
"""Notes already logged (each once per process)."""
_I32 = 2**31
_NARROW = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
_FLOW_SATURATION_NOTE = (
    "scheduler: flow control measures saturation by utilization (engine metrics), but metrics "
    "scraping is off and no engine reports load: every request will be refused with "
    "no-endpoints; turn scrape on, feed FlowController.update_endpoint yourself, or configure "
    "saturation {type: concurrency}"
)


def warn_flow_without_load(saturation: Mapping[str, Any], *, scrape: bool) -> str | None:
    """The note for flow control that measures saturation by utilization (the engines'
    metrics) while nothing scrapes them, so that every request is refused with
    ``no-endpoints``; logged once per process (logger ``llmsched``). None when the
    configuration does not have that problem. ``saturation``: the flow config's
    ``saturation`` section. The gateway's native plane, whose flow control runs in Rust,
    logs it through here too."""
    if scrape or saturation.get("type", "utilization") != "utilization":
        return None
    if _FLOW_SATURATION_NOTE not in _WARNED:
        _WARNED.append(_FLOW_SATURATION_NOTE)
        log.warning(_FLOW_SATURATION_NOTE)
    return _FLOW_SATURATION_NOTE


def _engine_spec_type() -> type | None:
    """:class:`~llmsched.integrations.EngineSpec` when the integrations extra is installed."""
    try:
        from llmsched.integrations.identity import EngineSpec
    except ImportError:
        return None
    return EngineSpec


@dataclass(frozen=True, eq=False)
class ScheduleRequest:
    """One request to schedule. Give exactly one prompt form: ``tokens`` (token ids: a numpy
    array or a sequence), ``text`` (a raw prompt, hashed as pseudo-tokens) or ``messages``
    (chat messages, rendered by :func:`~llmsched.routing.render_messages`).

    ``tenant`` and ``priority`` place it in flow control (higher first; negative is
    sheddable); ``model``, ``lora``, ``session_id``, ``session_endpoint``, ``cache_salt`` and
    ``headers`` reach the router as :meth:`Router.pick <llmsched.Router.pick>` takes them (an
    empty ``model``, ``lora`` or ``cache_salt`` is refused, as there).
    ``prompt_tokens`` is its size for flow control (default: the token count, or a quarter of
    the text's characters); ``size_bytes`` counts against byte limits; ``deadline``
    (absolute, on the flow controller's clock) and ``ttft_target_s`` feed the ``edf`` and
    ``slo-deadline`` orderings. The int fields take an int or a numpy integer (kept as an int).

    Every field is checked when the request is built: a bad one raises
    :class:`~llmsched.errors.InvalidRequestError` (or InvalidTokenError) naming it.

    >>> ScheduleRequest(text="Hello there", tenant="acme", priority=2).prompt_size
    2
    >>> ScheduleRequest(tokens=[1, 2], text="x")
    Traceback (most recent call last):
    ...
    llmsched.errors.InvalidRequestError: give exactly one of tokens=, text= or messages=
    """

    tokens: TokensLike | None = None
    text: str | None = None
    messages: Sequence[Mapping[str, object]] | None = None
    model: str | None = None
    tenant: str = "default"
    priority: int = 0
    session_id: str | None = None
    session_endpoint: str | int | None = None
    lora: str | None = None
    cache_salt: str | None = None
    headers: Mapping[str, str] | None = None
    prompt_tokens: int | None = None
    size_bytes: int = 0
    deadline: float | None = None
    ttft_target_s: float | None = None

    def __post_init__(self) -> None:
        forms = sum(x is not None for x in (self.tokens, self.text, self.messages))
        if forms != 1:
            raise InvalidRequestError("give exactly one of tokens=, text= or messages=")
        rendered: str | None = None
        if self.tokens is not None:
            try:
                array = as_token_array(self.tokens)
            except (TypeError, ValueError) as exc:
                if isinstance(exc, LlmschedError) and not isinstance(exc, InvalidTypeError):
                    raise  # InvalidTokenError, ...
                raise InvalidRequestError(str(exc)) from None
            if (
                array.size
                and array.dtype not in _NARROW
                and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID)
            ):
                raise_out_of_range(array, "tokens")
            object.__setattr__(self, "tokens", array)
        elif self.text is not None:
            if not isinstance(self.text, str):
                raise InvalidRequestError(f"text must be a str, got {type(self.text).__name__}")
            check_utf8("text", self.text, error=InvalidRequestError)
        else:
            try:
                rendered = render_messages(self.messages)  # type: ignore[arg-type]
            except TypeError as exc:
                raise InvalidRequestError(str(exc)) from None
            check_utf8("messages", rendered, error=InvalidRequestError)
        object.__setattr__(self, "_rendered", rendered)
        # Every str reaches the native side, which takes only UTF-8: checked here, not in
        # schedule_sync after admission.
        for name in ("model", "session_id", "lora", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"{name} must be a str or None, got {value!r}")
            if value is not None:
                check_utf8(name, value, error=InvalidRequestError)
        check_no_empty_names(
            InvalidRequestError, model=self.model, lora=self.lora, cache_salt=self.cache_salt
        )
        endpoint = self.session_endpoint
        if isinstance(endpoint, str):
            check_utf8("session_endpoint", endpoint, error=InvalidRequestError)
        elif endpoint is not None and (
            isinstance(endpoint, bool)
            or not isinstance(endpoint, int)
            or not -(2**63) <= endpoint < 2**63
        ):
            raise InvalidRequestError(
                f"session_endpoint must be a str, a 64-bit int or None, got {endpoint!r}"
            )
        if not isinstance(self.tenant, str) or not self.tenant:
            raise InvalidRequestError(f"tenant must be a non-empty str, got {self.tenant!r}")
        check_utf8("tenant", self.tenant, error=InvalidRequestError)
        # Kept as ints (a numpy integer is taken, as flow control takes it).
        object.__setattr__(self, "priority", _check_int("priority", self.priority, -_I32, _I32 - 1))
        if self.prompt_tokens is not None:
            size = _check_int("prompt_tokens", self.prompt_tokens, 0, 2**63 - 1)
            object.__setattr__(self, "prompt_tokens", size)
        object.__setattr__(
            self, "size_bytes", _check_int("size_bytes", self.size_bytes, 0, 2**63 - 1)
        )
        for name in ("deadline", "ttft_target_s"):
            value = getattr(self, name)
            if value is not None and (not is_finite_number(value) or value < 0):
                raise InvalidRequestError(f"{name} must be a finite number >= 0 or None")
        headers = self.headers
        if headers is not None and not (
            isinstance(headers, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise InvalidRequestError("headers must map str to str")
        for key, value in (headers or {}).items():
            check_utf8(f"a key of headers ({key!r})", key, error=InvalidRequestError)
            check_utf8(f"headers[{key!r}]", value, error=InvalidRequestError)

    @property
    def prompt_size(self) -> int:
        """The prompt's size for flow control: ``prompt_tokens`` when given, else the token
        count, or a quarter of the (rendered) text's characters."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self.tokens is not None:
            return len(self.tokens)  # type: ignore[arg-type]
        text = self.text if self.text is not None else self._rendered_text()
        return len(text) // 4

    def _rendered_text(self) -> str:
        rendered: str = object.__getattribute__(self, "_rendered")
        return rendered

    def pick_arguments(self) -> dict[str, object]:
        """The :meth:`Router.pick <llmsched.Router.pick>` keywords of this request (chat
        messages as their rendered text: the same hashes, rendered once).

        >>> sorted(ScheduleRequest(tokens=[1, 2, 3], model="m").pick_arguments())
        ['model', 'priority', 'tokens']
        """
        args: dict[str, object] = {"priority": self.priority}
        if self.tokens is not None:
            args["tokens"] = self.tokens
        else:
            args["text"] = self.text if self.text is not None else self._rendered_text()
        for name in ("model", "lora", "session_id", "session_endpoint", "cache_salt", "headers"):
            value = getattr(self, name)
            if value is not None:
                args[name] = value
        return args

    def block_hashes(self, index: PrefixIndex) -> npt.NDArray[np.uint64]:
        """The prompt's block hashes in ``index``'s namespace: what a pick matches and what
        :meth:`Decision.started <llmsched.Decision.started>` records."""
        if self.tokens is not None:
            return index.hash_tokens(self.tokens, lora=self.lora, cache_salt=self.cache_salt)
        text = self.text if self.text is not None else self._rendered_text()
        return index.hash_text(text, lora=self.lora, cache_salt=self.cache_salt)


def _check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an ``int`` in ``low..high``: an int or a numpy integer (not a bool, nor a
    numpy bool), else :class:`~llmsched.errors.InvalidRequestError`."""
    if is_bool(value) or not isinstance(value, SupportsIndex):
        raise InvalidRequestError(f"{name} must be an int in {low}..{high}, got {value!r}")
    number = operator.index(value)
    if not low <= number <= high:
        raise InvalidRequestError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return number


_MAX_OUTPUT_TOKENS = 2**63 - 1
"""The most output tokens flow control charges in one call (the native core's signed range)."""


def _check_output_tokens(name: str, value: object) -> int:
    """``value`` as an output-token count flow control can charge: an int (or numpy integer) in
    ``0..2**63-1``, else :class:`~llmsched.errors.InvalidTypeError` /
    :class:`~llmsched.errors.InvalidValueError`. Checked before anything is marked ended, so a
    refused count leaves the slot held and releasable."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    count = operator.index(value)
    if not 0 <= count <= _MAX_OUTPUT_TOKENS:
        raise InvalidValueError(
            f"{name} must be in 0..{_MAX_OUTPUT_TOKENS}, got {describe_int(count)}"
        )
    return count


class Admission:
    """A request's place in flow control, once dispatched: its ``id``, the seconds it queued,
    and the slot to give back (:meth:`release`, once). Without flow control it holds nothing.

    It acts on its own request only: an admission whose request was revoked meanwhile
    (completed by id through :attr:`Scheduler.flow`, as for a preemption victim) and whose id
    was admitted again for another caller neither charges nor releases that other request
    (it carries the ``ticket`` of its admit, :attr:`FlowDecision.ticket
    <llmsched.flow.FlowDecision.ticket>`; built with ``ticket=None`` it acts by id).

    An admission collected while it still holds its slot gives it back then, as a dropped
    :class:`~llmsched.Decision` finishes itself (waiters in the queue are woken at flow
    control's next pump or poll), and ``on_drop(what, id)`` is called (a scheduler's
    admissions count in ``Scheduler.stats()["dropped"]`` and warn once): release it.

    >>> Scheduler(["a"]).admit_sync(ScheduleRequest(tokens=[1])).holds_slot
    False
    """

    __slots__ = (
        "_flow",
        "_lock",
        "_on_drop",
        "_open",
        "_owned",
        "_recorded",
        "_ticket",
        "id",
        "queued_s",
    )

    def __init__(
        self,
        flow: FlowController | None,
        request_id: int,
        queued_s: float,
        *,
        ticket: int | None = None,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self._flow = flow
        self._lock = threading.Lock()
        self._open = flow is not None
        self._ticket = ticket
        self._on_drop = on_drop
        # Owned by a placement, which releases it when it ends (or is collected unended).
        self._owned = False
        # Output tokens record_output charged (a placement that owns this admission charges
        # only the rest of its count when it ends).
        self._recorded = 0
        self.id = request_id
        """The request id (unique within its scheduler)."""
        self.queued_s = queued_s
        """Seconds the request waited in flow control."""

    @property
    def holds_slot(self) -> bool:
        """Whether a flow-control slot is held (and not yet released)."""
        return self._open

    def record_output(self, output_tokens: int) -> None:
        """Charges streamed output tokens to the tenant now (VTC's per-token rule); nothing
        once released, without flow control, or when the request was revoked meanwhile. A
        count that is not an int in ``0..2**63-1`` raises
        :class:`~llmsched.errors.InvalidValueError` (or InvalidTypeError), charging
        nothing."""
        tokens = _check_output_tokens("output_tokens", output_tokens)
        if self._flow is not None and self._open:
            with contextlib.suppress(UnknownRequestError):  # revoked meanwhile
                self._flow.record_output(self.id, tokens, ticket=self._ticket)
                with self._lock:
                    self._recorded += tokens

    def release(self, output_tokens: int = 0) -> bool:
        """Gives the flow-control slot back, charging ``output_tokens``; False when nothing
        was held (or it was already released). A count that is not an int in ``0..2**63-1``
        raises :class:`~llmsched.errors.InvalidValueError` (or InvalidTypeError) and the slot
        stays held. When the request was revoked meanwhile there is nothing to give back (and
        another request now running under the same id is left alone)."""
        # Checked before the slot counts as released: a refused count must leave it held, or
        # nothing could ever give it back.
        tokens = _check_output_tokens("output_tokens", output_tokens)
        with self._lock:
            if not self._open:
                return False
            self._open = False
        assert self._flow is not None
        try:
            self._flow.complete(self.id, tokens, ticket=self._ticket)
        except UnknownRequestError:  # revoked meanwhile
            pass
        except Exception:
            with self._lock:  # the core refused it and holds the slot still: releasable again
                self._open = True
            raise
        return True

    def __repr__(self) -> str:
        return f"Admission(id={self.id}, queued_s={self.queued_s:.3g}, holds={self._open})"

    def __del__(self) -> None:
        # Collected still holding its slot: give it back, as a dropped Decision does. Not
        # through complete()'s pump, which a collection may interrupt under its lock. An
        # admission its placement owns is the placement's to release (both are collected
        # together; in a cycle, in either order).
        if getattr(self, "_open", False) and not self._owned:
            self._release_collected(0, self._on_drop)

    def _release_collected(
        self, output_tokens: int, on_drop: Callable[[str, int], None] | None
    ) -> None:
        """Gives the slot back for a finalizer (charging ``output_tokens``), then calls
        ``on_drop``; never raises."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        try:
            assert self._flow is not None
            with contextlib.suppress(UnknownRequestError):  # revoked meanwhile
                self._flow.complete(self.id, output_tokens, ticket=self._ticket, wake=False)
            if on_drop is not None:
                on_drop("an Admission", self.id)
        except Exception:  # a finalizer raises to nobody: say it
            log.exception("releasing a collected Admission of request %s failed", self.id)


@dataclass(frozen=True)
class _Attempt:
    """One attempt's endpoints and what each held of the prompt before the pick (blocks)."""

    decision: Decision
    endpoint: EndpointId
    held_before: tuple[tuple[EndpointId, int], ...]


class Placement:
    """Where a scheduled request runs now: :attr:`endpoint` and :attr:`address`, the
    :attr:`fallbacks` left for a retry, the prefill endpoint when the request is split, and the
    in-flight ticket (:attr:`decision`) behind them.

    Call :meth:`first_token` when the first token arrives, :meth:`add_output_tokens` as output
    streams, :meth:`retry` when an attempt failed before the engine ran it, and end it with
    :meth:`complete`, :meth:`fail` or :meth:`cancel` (the ``schedule`` context managers do it
    on exit). Ending it twice is a no-op returning False. A placement collected unended is
    cancelled then (its in-flight counts and the slot of an admission it owns go back, as a
    dropped :class:`~llmsched.Decision` finishes itself), warned of once through logging and
    counted in ``Scheduler.stats()["dropped"]``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        request: ScheduleRequest,
        admission: Admission | None,
        attempt: _Attempt,
        order: list[EndpointId],
        *,
        owns_admission: bool,
        more: Callable[[], list[EndpointId]] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._request = request
        self._admission = admission
        self._owns = owns_admission
        if owns_admission and admission is not None:
            admission._owned = True
        self._attempt: _Attempt | None = attempt
        # The pick: a retry starts it again on a fallback (no new pick, see ``retry``).
        self._first = attempt.decision
        self._order = order
        # The other endpoints considered, appended to the order when first needed (reading
        # the decision's explanation costs more than most requests ever need).
        self._more = more
        self._next = 1
        self._attempts = 1
        self._lock = threading.Lock()
        self._outcome: PlacementOutcome | None = None
        self.output_tokens = 0
        """Output tokens counted so far (charged to the tenant at the end, less those its
        admission's :meth:`~Admission.record_output` charged meanwhile)."""

    # -- where ---------------------------------------------------------------------------

    @property
    def request(self) -> ScheduleRequest:
        """The request placed."""
        return self._request

    @property
    def admission(self) -> Admission | None:
        """Its flow-control admission (None when placed without one)."""
        return self._admission

    @property
    def decision(self) -> Decision:
        """The current attempt's routing decision (PlacementError after a failed retry)."""
        if self._attempt is None:
            raise PlacementError("no attempt is in flight: the last retry found no endpoint")
        return self._attempt.decision

    @property
    def endpoint(self) -> EndpointId:
        """The endpoint of the current attempt."""
        if self._attempt is None:
            raise PlacementError("no attempt is in flight: the last retry found no endpoint")
        return self._attempt.endpoint

    @property
    def address(self) -> str:
        """The current endpoint's address (``host:port``; empty when the engine has none)."""
        return self._scheduler.address_of(self.endpoint)

    @property
    def fallbacks(self) -> list[EndpointId]:
        """Endpoints a :meth:`retry` may go to, in order."""
        self._take_more()
        return list(self._order[self._next :])

    def _take_more(self) -> None:
        with self._lock:
            more, self._more = self._more, None
            if more is not None:
                self._order += [e for e in more() if e not in self._order]

    @property
    def prefill_endpoint(self) -> EndpointId | None:
        """The endpoint that prefills the prompt when the request is split, else None."""
        return self.decision.prefill_endpoint

    @property
    def prefill_address(self) -> str | None:
        """The prefill endpoint's address, else None."""
        return self.decision.prefill_address

    @property
    def cached(self) -> int:
        """Prompt tokens cached on the current endpoint when it was picked."""
        return int(self.decision.cached_tokens().get(self.endpoint, 0))

    @property
    def disaggregated(self) -> bool:
        """Whether prefill runs on a separate endpoint."""
        return self._attempt is not None and self._attempt.decision.disaggregated

    @property
    def attempts(self) -> int:
        """Attempts started (1 + the retries that found an endpoint)."""
        return self._attempts

    @property
    def outcome(self) -> PlacementOutcome | None:
        """How it ended, or None while it is open."""
        return self._outcome

    def explain(self, limit: int | None = EXPLAIN_ROWS) -> Explanation:
        """The current decision's per-endpoint, per-scorer breakdown (``limit``: see
        :meth:`Decision.explain`)."""
        return self.decision.explain(limit)

    # -- progress ------------------------------------------------------------------------

    def first_token(self) -> bool:
        """The first token arrived (the prefill work is done); False if already noted or the
        placement has ended."""
        attempt = self._attempt
        if attempt is None or self._outcome is not None:
            return False
        return attempt.decision.first_token()

    def add_output_tokens(self, tokens: int) -> None:
        """Counts ``tokens`` more output tokens (charged to the tenant at the end). A count
        that is not an int (or numpy integer) is an :class:`~llmsched.errors.InvalidTypeError`;
        a negative one, or one that would take the total past ``2**63-1``, an
        :class:`~llmsched.errors.InvalidValueError`; either counts nothing."""
        tokens = _check_output_tokens("tokens", tokens)
        total = self.output_tokens + tokens
        if total > _MAX_OUTPUT_TOKENS:
            raise InvalidValueError(
                f"output tokens would total more than {_MAX_OUTPUT_TOKENS} "
                f"({self.output_tokens} counted so far)"
            )
        self.output_tokens = total

    def retry(self) -> EndpointId:
        """The current attempt failed before the engine ran the request: fails it (its
        in-flight counts go back, its approximate prefix record is dropped) and starts the
        next attempt on the next fallback still in the pool. Returns that endpoint; raises
        NoEndpointError when none is left (the placement stays open with no attempt: end it).

        Safe against the placement being ended on another thread meanwhile: the attempt it
        started is then ended too, and PlacementError raised.
        """
        with self._lock:
            if self._outcome is not None:
                raise PlacementError(f"the placement has ended ({self._outcome})")
            failed, self._attempt = self._attempt, None
        if failed is not None:
            self._scheduler._end_attempt(failed, self._request, failed=True)
        self._scheduler._count("retries")
        self._take_more()
        while True:
            with self._lock:
                if self._outcome is not None:
                    raise PlacementError(f"the placement has ended ({self._outcome})")
                if self._next >= len(self._order):
                    break
                endpoint = self._order[self._next]
                self._next += 1
            attempt = self._scheduler._start_attempt(self._first, endpoint)
            if attempt is None:
                continue
            with self._lock:
                # Installed under the lock: an end on another thread either took it (and
                # ends it) or came first, and then this attempt is ended here.
                ended, current = self._outcome, self._attempt
                if ended is None and current is None:
                    self._attempt = attempt
                    self._attempts += 1
                    return endpoint
            self._scheduler._end_attempt(attempt, self._request, failed=ended == "failed")
            if ended is not None:
                raise PlacementError(f"the placement has ended ({ended})")
            # Another thread's retry installed its attempt first: that one stands.
            assert current is not None
            return current.endpoint
        raise NoEndpointError(
            f"no fallback is left after {self._attempts} attempt(s) "
            f"(tried {', '.join(map(str, self._order))})"
        )

    # -- the end -------------------------------------------------------------------------

    def complete(self, output_tokens: int | None = None) -> bool:
        """The request succeeded. ``output_tokens`` (default: those counted) is charged to
        the tenant. False if it had already ended. A count that is not an int (or numpy
        integer) raises :class:`~llmsched.errors.InvalidTypeError`, one outside
        ``0..2**63-1`` :class:`~llmsched.errors.InvalidValueError`; either leaves the
        placement open."""
        if output_tokens is not None:
            self.output_tokens = _check_output_tokens("output_tokens", output_tokens)
        return self._end("completed")

    def fail(self) -> bool:
        """The request failed: like :meth:`complete`, and the approximate prefix record of the
        current endpoint is dropped. False if it had already ended."""
        return self._end("failed")

    def cancel(self) -> bool:
        """The request was cancelled (the client went away): its counts go back, its prefix
        record stays (the engine may have run the prefill). False if it had already ended."""
        return self._end("cancelled")

    def _end(self, outcome: PlacementOutcome, output_tokens: int | None = None) -> bool:
        """Ends it as ``outcome``, charging ``output_tokens`` (default: its count, checked
        first: ``output_tokens`` is a public attribute, and a count its admission cannot be
        charged is refused before anything ends, so the caller can end it again)."""
        if output_tokens is None:
            output_tokens = self.output_tokens
            if self._owns and self._admission is not None:
                output_tokens = _check_output_tokens("output_tokens", output_tokens)
        with self._lock:
            if self._outcome is not None:
                return False
            self._outcome = outcome
            attempt, self._attempt = self._attempt, None
        try:
            if attempt is not None:
                self._scheduler._end_attempt(attempt, self._request, failed=outcome == "failed")
        finally:
            try:
                if self._owns and self._admission is not None:
                    # What its admission's record_output charged while it streamed is not
                    # charged again.
                    charged = self._admission._recorded
                    self._admission.release(max(output_tokens - charged, 0))
            finally:
                self._scheduler._placement_ended(outcome)
        return True

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.end_for(exc_type)

    def __del__(self) -> None:
        # Collected unended: cancelled, as a dropped Decision finishes itself (the admission
        # it owns released without complete()'s pump, which a collection may interrupt).
        if getattr(self, "_outcome", "never built") is not None:
            return
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = "cancelled"
            attempt, self._attempt = self._attempt, None
        try:
            try:
                if attempt is not None:
                    self._scheduler._end_attempt(attempt, self._request, failed=False)
            finally:
                admission = self._admission
                if self._owns and admission is not None:
                    try:  # what its admission's record_output charged is not charged again
                        tokens = _check_output_tokens("output_tokens", self.output_tokens)
                    except LlmschedError:
                        tokens = 0
                    # Counted here, with its placement, not as an admission of its own.
                    admission._release_collected(max(tokens - admission._recorded, 0), None)
                self._scheduler._placement_ended("cancelled")
                request_id = None if admission is None else admission.id
                self._scheduler._collected_unended("a Placement", request_id)
        except Exception:  # a finalizer raises to nobody: say it
            log.exception("cancelling a collected Placement failed")

    async def __aenter__(self) -> NoReturn:
        # ``async with`` where a plain ``with`` belongs: Python's own error named neither form,
        # and the placement, made before the statement could fail, stayed open. Cancelled as
        # a cancelled block's exit would (it ends whatever its output count holds).
        self.end_for(asyncio.CancelledError)
        raise InvalidTypeError(
            "a Placement (from Scheduler.schedule_sync() or place()) is entered with a plain "
            "`with`; async code uses `async with scheduler.schedule(request) as placement:` "
            "(this placement was cancelled: its slot and in-flight counts are given back)"
        )

    async def __aexit__(self, *exc_info: object) -> None:
        """Never reached: :meth:`__aenter__` raises."""

    def end_for(self, exc_type: type[BaseException] | None) -> bool:
        """Ends the placement as a context manager's exit does: no exception completes it, a
        cancellation (:class:`asyncio.CancelledError`, KeyboardInterrupt) cancels it, any
        other exception fails it. It always ends: an ``output_tokens`` its admission cannot
        be charged is charged as none, and its error raised once the placement has ended,
        unless ``exc_type`` is on its way out (a cancellation stays one): then it is logged.
        """
        if exc_type is None:
            outcome: PlacementOutcome = "completed"
        elif issubclass(exc_type, (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)):
            outcome = "cancelled"
        else:
            outcome = "failed"
        if not (self._owns and self._admission is not None):  # it charges nothing
            return self._end(outcome)
        # The exit is the last chance to end it: a count that cannot be charged is not
        # allowed to keep the slot and the in-flight counts for good.
        try:
            output_tokens = _check_output_tokens("output_tokens", self.output_tokens)
        except LlmschedError as bad:
            ended = self._end(outcome, 0)
            if ended and exc_type is None:
                raise
            if ended:
                log.warning("a %s placement's output count was not charged: %s", outcome, bad)
            return ended
        return self._end(outcome, output_tokens)

    def __repr__(self) -> str:
        where = "none" if self._attempt is None else repr(self._attempt.endpoint)
        return (
            f"Placement(endpoint={where}, fallbacks={self.fallbacks!r}, "
            f"attempts={self._attempts}, outcome={self._outcome!r})"
        )


@dataclass
class _Engine:
    endpoint: Endpoint
    spec: EngineSpec | None


class Scheduler:
    """The public request pipeline (see the module docstring).

    Args:
        engines: the engines: :class:`~llmsched.integrations.EngineSpec` (its ``kv_events``
            and metrics feed the index and the pool), :class:`~llmsched.Endpoint` or ids
            (int or str); ids must be unique.
        router: the router config: a preset name, a YAML / JSON path or text, or a mapping in
            llm-d's ``EndpointPickerConfig`` shape.
        flow: a flow-control config (mapping, YAML / JSON text or path; ``{}`` for the
            defaults), or None for no flow control (every request is admitted at once).
        index: a prefix index to share; None builds one with ``block_size`` (default: the
            prefix scorer's ``blockSize``, else the index default) and the config's
            per-worker capacity.
        kv_events: subscribe to the KV events of engines with ``kv_events`` while started.
        kv_feed: who reads them: ``"python"`` (:class:`~llmsched.integrations.KVEventSubscriber`,
            pyzmq on a thread) or ``"native"``
            (:class:`~llmsched.integrations.NativeKVEventSubscriber`: the same rules in Rust,
            with no Python per batch).
        scrape: scrape the engines' ``/metrics`` while started (every ``scrape_interval_s``,
            each within ``scrape_timeout_s``): feeds the pool and the flow controller.
        stale_after_s, stale_policy: the pool's staleness (defaults: three scrape intervals
            plus the timeout, ``"saturated"`` when scraping, else ``"ignore"``).
        seed, record_ttl_s, allow_pseudo_tokens, wires_flow: passed to the
            :class:`~llmsched.Router`.
        retry_after_s: the retry-after a :class:`~llmsched.errors.FlowRejected` carries.
        notes: notes about the configuration found by the caller (a gateway's own checks of
            its config), already logged by it: listed in :attr:`warnings` and counted with
            the scheduler's own.

    Feeds need the ``integrations`` extra and :class:`~llmsched.integrations.EngineSpec`
    engines; they run between :meth:`start` and :meth:`stop` (``async with scheduler:``), or
    on threads between :meth:`start_sync` and :meth:`stop_sync`. A configuration that will
    route badly (flow control by utilization with nothing reporting load, one engine under
    several ids, an engine whose KV events use a block size the index cannot split) logs one
    warning on logger ``llmsched``, is listed in :attr:`warnings` and counted in :meth:`stats`.

    >>> s = Scheduler(["a"], router="round-robin")
    >>> with s.schedule_sync(ScheduleRequest(tokens=[1, 2, 3])) as placement:
    ...     placement.endpoint
    'a'
    """

    def __init__(
        self,
        engines: Iterable[EngineLike] = (),
        *,
        router: ConfigLike = "llm-d",
        flow: ConfigSource | None = None,
        index: PrefixIndex | None = None,
        block_size: int | None = None,
        kv_events: bool = True,
        kv_feed: Literal["python", "native"] = "python",
        scrape: bool = False,
        scrape_interval_s: float = 0.2,
        scrape_timeout_s: float = 1.0,
        stale_after_s: float | None = None,
        stale_policy: StalePolicy | None = None,
        seed: int | None = None,
        record_ttl_s: float | None = None,
        allow_pseudo_tokens: bool = False,
        retry_after_s: float = 1.0,
        notes: Iterable[str] = (),
        wires_flow: bool = False,
    ) -> None:
        given_notes = list(notes)
        if not all(isinstance(note, str) for note in given_notes):
            raise ConfigError("notes must be strings")
        for name, flag in (("kv_events", kv_events), ("scrape", scrape)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be a bool, got {flag!r}")
        if kv_feed not in ("python", "native"):
            raise ConfigError(f"kv_feed must be 'python' or 'native', got {kv_feed!r}")
        for name, value in (
            ("scrape_interval_s", scrape_interval_s),
            ("scrape_timeout_s", scrape_timeout_s),
            ("retry_after_s", retry_after_s),
        ):
            if not (is_finite_number(value) and value > 0):
                raise ConfigError(f"{name} must be a number > 0, got {describe_int(value)}")
        info = config_info(router)
        self._info = info
        listed = self._checked_engines(engines)
        if index is None:
            size = block_size if block_size is not None else info["block_size"]
            capacity = info["worker_capacity"]
            index = (
                PrefixIndex(worker_capacity=capacity)
                if size is None
                else PrefixIndex(size, worker_capacity=capacity)
            )
        elif not isinstance(index, PrefixIndex):
            raise ConfigError(f"index must be a PrefixIndex or None, got {type(index).__name__}")
        elif block_size is not None and block_size != index.block_size:
            raise ConfigError(
                f"block_size {block_size} differs from the given index's {index.block_size}"
            )
        stale_after = (
            stale_after_s if stale_after_s is not None else 3 * scrape_interval_s + scrape_timeout_s
        )
        check_optional_str("stale_policy", stale_policy)
        policy: StalePolicy = stale_policy or ("saturated" if scrape else "ignore")
        self.index = index
        """The prefix index every pick matches."""
        self.pool = EndpointPool(stale_after_s=stale_after, stale_policy=policy)
        """The endpoints requests may go to (drained engines are out of it)."""
        self.router = Router(
            self.pool,
            index,
            router,
            seed=seed,
            record_ttl_s=record_ttl_s,
            allow_pseudo_tokens=allow_pseudo_tokens,
            wires_flow=wires_flow,
        )
        """The router."""
        self.flow: FlowController | None = (
            None if flow is None else FlowController(_flow_config(flow, stale_after))
        )
        """The flow controller (None without flow control)."""
        self._kv_events = kv_events
        self._kv_feed = kv_feed
        self._scrape = scrape
        self._scrape_interval_s = float(scrape_interval_s)
        self._scrape_timeout_s = float(scrape_timeout_s)
        self._retry_after_s = retry_after_s
        self._engines: dict[EndpointId, _Engine] = {}
        self._drained: set[EndpointId] = set()
        # Held while the engine map (``_engines``, ``_drained``, the places below, the address
        # notes and ``_dropped``) is changed, and while it is read as a whole: a reader on
        # another thread (the native gateway's ``/metrics``, a discovery change on the event
        # loop) sees one whole engine set, never half of a change. Never held while feeds
        # start or stop (``_feeds_changed`` runs once it is released); ``_lifecycle`` may be
        # taken before it, and ``_lock`` after it, never the other way round.
        self._engines_lock = threading.RLock()
        # The KV block size each engine's /metrics gave, and the (engine, size) pairs warned of.
        self._engine_block_sizes: dict[EndpointId, int] = {}
        self._block_sizes_warned: set[tuple[EndpointId, int]] = set()
        # Engines by (address, rank), kept as they change, so that a note on one address
        # under several ids costs each change O(1), not a pass over every engine.
        self._engine_place: dict[EndpointId, tuple[str, int]] = {}
        self._at_place: dict[tuple[str, int], dict[EndpointId, None]] = {}
        self._shared_places: set[tuple[str, int]] = set()
        for engine in listed:
            self._engines[engine.endpoint.id] = engine
            self._enter_place(engine.endpoint.id)
        self.pool.add_many(engine.endpoint for engine in listed)
        self._ids = itertools.count(1)
        # Reentrant: a placement or an admission collected unended counts itself under it
        # (``_collected_unended``), and a collection may run on a thread that holds it.
        self._lock = threading.RLock()
        self._drop_warned = False
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "dropped",
                "admitted",
                "rejected",
                "no_endpoint",
                "completed",
                "failed",
                "cancelled",
                "retries",
                "records_removed",
                "in_flight",
            ),
            0,
        )
        self._warnings = [*self.router.warnings, *given_notes]
        if self.flow is not None:
            note = warn_flow_without_load(self.flow.config["saturation"], scrape=scrape)
            if note is not None:
                self._warnings.append(note)
        self._config_notes = list(self._warnings)
        self._address_notes: list[str] = []
        self._role_notes: list[str] = []
        self._note_engine_set()
        self._subscriber: KVEventSubscriber | NativeKVEventSubscriber | None = None
        # The counts of the subscribers stopped so far (an engine change restarts the feed),
        # under ``_feed_lock`` with ``_subscriber``: ``kv_event_counters`` never goes down.
        self._feed_lock = threading.Lock()
        self._retired_kv_counts: dict[str, int] = {}
        # The same for the metrics scrapers' counts, by worker (under ``_feed_lock`` with
        # ``_scraper``).
        self._retired_scrape_counts: dict[str, dict[str, int]] = {}
        self._scraper: MetricsScraper | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self._mode: Literal["async", "threads"] | None = None
        # Held while the mode is read and changed together with the feeds it stands for
        # (start_sync / stop_sync / an engine change on threads; the async pair around their
        # synchronous steps): concurrent calls see one mode and the feeds it started.
        self._lifecycle = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart: asyncio.Task[None] | None = None
        # Workers whose index entries were dropped (an engine removed, or moved to another
        # address) while a feed ran: dropped again once that feed has stopped, since a batch
        # it applied meanwhile brings the old process's blocks back.
        self._dropped: set[EndpointId] = set()

    @classmethod
    def from_config(cls, config: ConfigSource) -> Scheduler:
        """A scheduler from a :class:`~llmsched.types.SchedulerConfig` (a mapping, YAML /
        JSON text or a file path). Unknown keys raise ConfigError naming them.

        >>> s = Scheduler.from_config({"engines": ["a", "b"], "router": "least-load"})
        >>> sorted(s.engines)
        ['a', 'b']
        """
        raw = dict(config) if isinstance(config, Mapping) else load_mapping(config, what="config")
        known = {
            "engines",
            "router",
            "flow",
            "block_size",
            "seed",
            "record_ttl_s",
            "allow_pseudo_tokens",
            "kv_events",
            "scrape",
            "retry_after_s",
        }
        unknown = sorted(set(raw) - known, key=str)
        if unknown:
            raise ConfigError(f"scheduler config: unknown key(s) {', '.join(map(str, unknown))}")
        engines: list[EngineLike] = []
        listed = raw.get("engines", [])
        if not isinstance(listed, list):
            raise ConfigError("engines: must be a list")
        for i, entry in enumerate(listed):
            if isinstance(entry, Mapping):
                from llmsched.integrations import EngineSpec

                try:
                    engines.append(EngineSpec.from_dict(entry))
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"engines[{i}]: {exc}") from None
            else:
                engines.append(entry)
        scrape = raw.get("scrape", {})
        if not isinstance(scrape, Mapping) or set(scrape) - {"enabled", "interval_s", "timeout_s"}:
            raise ConfigError("scrape: must be a mapping of enabled, interval_s, timeout_s")
        return cls(
            engines,
            router=raw.get("router", "llm-d"),
            flow=raw.get("flow"),
            block_size=raw.get("block_size"),
            seed=raw.get("seed"),
            record_ttl_s=raw.get("record_ttl_s"),
            allow_pseudo_tokens=raw.get("allow_pseudo_tokens", False),
            kv_events=raw.get("kv_events", True),
            scrape=scrape.get("enabled", False),
            scrape_interval_s=scrape.get("interval_s", 0.2),
            scrape_timeout_s=scrape.get("timeout_s", 1.0),
            retry_after_s=raw.get("retry_after_s", 1.0),
        )

    # -- engines -------------------------------------------------------------------------

    def _checked_engines(self, engines: Iterable[EngineLike]) -> list[_Engine]:
        if isinstance(engines, (str, bytes, Mapping)):
            raise ConfigError("engines must be an iterable of engines, not a single value")
        if not isinstance(engines, Iterable):
            raise InvalidTypeError(
                f"engines must be an iterable of engines, got {type(engines).__name__}"
            )
        out: list[_Engine] = []
        seen: set[EndpointId] = set()
        for i, engine in enumerate(engines):
            checked = self._as_engine(engine, f"engines[{i}]")
            if checked.endpoint.id in seen:
                raise ConfigError(f"engines[{i}]: {checked.endpoint.id!r} is listed twice")
            seen.add(checked.endpoint.id)
            out.append(checked)
        return out

    def _as_engine(self, engine: object, where: str = "engine") -> _Engine:
        if isinstance(engine, Endpoint):
            return _Engine(engine, None)
        if isinstance(engine, (str, int)) and not isinstance(engine, bool):
            if isinstance(engine, int) and not -(2**63) <= engine < 2**63:
                raise ConfigError(f"{where}: an int id must fit in 64 bits, got {engine}")
            return _Engine(Endpoint(engine), None)
        spec_type = _engine_spec_type()
        if spec_type is not None and isinstance(engine, spec_type):
            from llmsched.integrations.identity import wire_for_router

            # As the router config asks (llm-d's precise scorer: the shared KV-event socket).
            spec: EngineSpec = wire_for_router((engine,), self._info)[0]  # type: ignore[arg-type]
            endpoint = Endpoint(
                spec.worker_id,
                address=f"{spec.host}:{spec.port}",
                role=spec.role,  # type: ignore[arg-type]
                labels=dict(spec.labels),
                model=spec.model,
            )
            return _Engine(endpoint, spec)
        raise ConfigError(
            f"{where}: must be an EngineSpec, an Endpoint or an id (int or str), "
            f"got {type(engine).__name__}"
        )

    @property
    def engines(self) -> dict[EndpointId, Endpoint]:
        """Every engine (drained ones too), by id."""
        with self._engines_lock:
            return {key: e.endpoint for key, e in self._engines.items()}

    @property
    def specs(self) -> list[EngineSpec]:
        """The engines given as :class:`~llmsched.integrations.EngineSpec`."""
        with self._engines_lock:
            return [e.spec for e in self._engines.values() if e.spec is not None]

    @property
    def draining(self) -> list[EndpointId]:
        """Engines out of routing (:meth:`drain`)."""
        with self._engines_lock:
            return [key for key in self._engines if key in self._drained]

    def address_of(self, endpoint: EndpointId) -> str:
        """An engine's address (UnknownEndpointError for an unknown id)."""
        engine = self._engines.get(check_id("endpoint", endpoint))
        if engine is None:
            raise UnknownEndpointError(f"endpoint {endpoint!r} is not scheduled")
        return engine.endpoint.address

    def add_engine(self, engine: EngineLike) -> EndpointId:
        """Adds an engine to the pool (and to the feeds, when started); returns its id.
        ConfigError when one with its id is already there (nothing changes)."""
        checked = self._as_engine(engine)
        key = checked.endpoint.id
        with self._engines_lock:
            if key in self._engines:
                raise ConfigError(f"engine {key!r} is already scheduled")
            self._engines[key] = checked
            self._enter_place(key)
            self.pool.add(checked.endpoint)
            self._note_engine_set()
        self._feeds_changed()
        return key

    def remove_engine(self, endpoint: EndpointId) -> None:
        """Removes an engine from the pool, the flow controller's load reports, the index and
        the feeds. Requests in flight there keep their accounting until they end.
        UnknownEndpointError when it is not scheduled (nothing changes)."""
        check_id("endpoint", endpoint)
        with self._engines_lock:
            if endpoint not in self._engines:
                raise UnknownEndpointError(f"endpoint {endpoint!r} is not scheduled")
            self._forget(endpoint)
            self._note_engine_set()
        self._feeds_changed()

    def _forget(self, endpoint: EndpointId) -> None:
        self._leave_place(endpoint)
        del self._engines[endpoint]
        self._drained.discard(endpoint)
        with contextlib.suppress(UnknownEndpointError):
            self.pool.remove(endpoint)
        if self.flow is not None:
            self.flow.remove_endpoint(str(endpoint))
        self._drop_worker(endpoint)
        self._forget_block_size(endpoint)

    def _forget_block_size(self, key: EndpointId) -> None:
        """Forgets the KV block size ``key``'s ``/metrics`` gave and that it was warned of: it
        was the process's that left (one coming back at another address is another)."""
        with self._lock:
            if self._engine_block_sizes.pop(key, None) is not None:
                warned = self._block_sizes_warned
                self._block_sizes_warned = {w for w in warned if w[0] != key}

    def _drop_worker(self, key: EndpointId) -> None:
        """Drops ``key``'s index entries, and again once the running feed has stopped."""
        with contextlib.suppress(UnknownWorkerError):
            self.index.remove_worker(key)
        if self._mode is not None:
            self._dropped.add(key)

    def _drop_again(self) -> None:
        """The feed that ran while workers were dropped has stopped: what it applied for them
        after their drop goes too."""
        with self._engines_lock:
            dropped, self._dropped = self._dropped, set()
        for key in dropped:
            with contextlib.suppress(UnknownWorkerError):
                self.index.remove_worker(key)

    def set_engines(
        self, engines: Iterable[EngineLike]
    ) -> tuple[list[EndpointId], list[EndpointId], list[EndpointId]]:
        """Replaces the whole set of engines; returns the ids added, removed and changed.
        Engines kept keep their metrics, in-flight counts and index entries; a changed one
        takes its new description and comes back into routing (one now at another address
        is another process, e.g. a StatefulSet pod rescheduled under its name, so its index
        entries go: it holds none of that cache); removed ones leave every registry. A
        repeated id raises ConfigError and changes nothing."""
        listed = self._checked_engines(engines)
        with self._engines_lock:
            new = {e.endpoint.id: e for e in listed}
            added = [k for k in new if k not in self._engines]
            removed = [k for k in self._engines if k not in new]
            changed = [
                k
                for k in new
                if k in self._engines
                and (new[k].endpoint, new[k].spec)
                != (self._engines[k].endpoint, self._engines[k].spec)
            ]
            for key in removed:
                self._forget(key)
            for key in changed:
                if new[key].endpoint.address != self._engines[key].endpoint.address:
                    # Routing by the old entries sent its prefixes to a cache that is gone.
                    self._drop_worker(key)
                    self._forget_block_size(key)
            for key in added + changed:
                self._leave_place(key)
                self._engines[key] = new[key]
                self._enter_place(key)
                self._drained.discard(key)
                self.pool.add(new[key].endpoint)
            if added or removed or changed:
                self._note_engine_set()
        if added or removed or changed:
            self._feeds_changed()
        return added, removed, changed

    def _enter_place(self, key: EndpointId) -> None:
        """Files engine ``key`` under its (address, rank)."""
        engine = self._engines[key]
        if not engine.endpoint.address:
            return
        rank = 0 if engine.spec is None else engine.spec.dp_rank
        place = (normal_address(engine.endpoint.address), rank)
        self._engine_place[key] = place
        there = self._at_place.setdefault(place, {})
        there[key] = None
        if len(there) > 1:
            self._shared_places.add(place)

    def _leave_place(self, key: EndpointId) -> None:
        """Takes engine ``key`` out of its (address, rank), if filed."""
        place = self._engine_place.pop(key, None)
        if place is None:
            return
        there = self._at_place[place]
        del there[key]
        if len(there) < 2:
            self._shared_places.discard(place)
        if not there:
            del self._at_place[place]

    def _note_engine_set(self) -> None:
        """Notes what in the engine set will route badly (each note logged once while it
        holds, in :attr:`warnings` and ``stats()["config_warnings"]``): engines under several
        ids at one address and rank (one engine counted as several, its load and cache split
        between ids: one address listed under two names, perhaps once per model it serves),
        and engines of role ``prefill`` under a router config that reads no role
        (:attr:`Router.reads_roles <llmsched.Router.reads_roles>`: they are sent whole
        requests, decode included, like any engine)."""
        notes = [
            f"engines {', '.join(map(repr, self._at_place[place]))} are all at {place[0]} "
            f"(rank {place[1]}): one engine under several ids has its load and cache counted "
            "apart; list it once"
            for place in sorted(self._shared_places)
        ]
        for note in notes:
            if note not in self._address_notes:
                log.warning("%s", note)
        self._address_notes = notes
        prefill = [k for k, e in self._engines.items() if e.endpoint.role == "prefill"]
        roles = []
        if prefill and not self.router.reads_roles:
            shown = ", ".join(map(repr, prefill[:5])) + (", ..." if len(prefill) > 5 else "")
            roles.append(
                f"{len(prefill)} engine(s) of role prefill ({shown}), but the router config "
                "reads no role (no prefill-filter / decode-filter or P/D profile handler): "
                "they are sent whole requests, decode included, like any engine; route with a "
                "P/D config (the llm-d-pd preset, say) or give them no role"
            )
        if roles and not self._role_notes:  # once while it holds, whichever engines
            log.warning("%s", roles[0])
        self._role_notes = roles
        self._warnings = [*self._config_notes, *self._address_notes, *self._role_notes]

    def drain(self, endpoint: EndpointId) -> bool:
        """Takes an engine out of routing: no new request goes there, requests in flight
        finish, its index entries and spec stay. False when it was already drained.
        UnknownEndpointError when it is not scheduled."""
        check_id("endpoint", endpoint)
        with self._engines_lock:
            if endpoint not in self._engines:
                raise UnknownEndpointError(f"endpoint {endpoint!r} is not scheduled")
            if endpoint in self._drained:
                return False
            self._drained.add(endpoint)
            with contextlib.suppress(UnknownEndpointError):
                self.pool.remove(endpoint)
            return True

    def resume(self, endpoint: EndpointId) -> bool:
        """Brings a drained engine back into routing; False when it was not drained.
        UnknownEndpointError when it is not scheduled."""
        check_id("endpoint", endpoint)
        with self._engines_lock:
            engine = self._engines.get(endpoint)
            if engine is None:
                raise UnknownEndpointError(f"endpoint {endpoint!r} is not scheduled")
            was = endpoint in self._drained
            self._drained.discard(endpoint)
            self.pool.add(engine.endpoint)
            return was

    # -- feeds ---------------------------------------------------------------------------

    @property
    def subscriber(self) -> KVEventSubscriber | NativeKVEventSubscriber | None:
        """The running KV-event subscriber, if any."""
        return self._subscriber

    def kv_event_counters(self) -> dict[str, int]:
        """The KV-event subscriber's counters (:meth:`KVEventSubscriber.counters
        <llmsched.integrations.KVEventSubscriber.counters>`), summed over every subscriber
        this scheduler has run: an engine change restarts the feed with a new subscriber, and
        the totals go on from where they were (they only go up). Empty before any ran.

        >>> Scheduler(["a"]).kv_event_counters()
        {}
        """
        with self._feed_lock:
            totals = dict(self._retired_kv_counts)
            current = {} if self._subscriber is None else self._subscriber.counters()
        for key, value in current.items():
            totals[key] = totals.get(key, 0) + value
        return totals

    def scrape_counters(self) -> dict[str, dict[str, int]]:
        """The metrics scraper's counts by worker (``scrapes``, ``failures`` and, of those,
        ``timeouts``: :meth:`MetricsScraper.snapshot
        <llmsched.integrations.MetricsScraper.snapshot>`), summed over every scraper this
        scheduler has run, as :meth:`kv_event_counters` (they only go up; a removed engine's
        stay). Empty before any ran.

        >>> Scheduler(["a"]).scrape_counters()
        {}
        """
        with self._feed_lock:
            totals = {w: dict(counts) for w, counts in self._retired_scrape_counts.items()}
            current = {} if self._scraper is None else self._scraper.snapshot()
        for worker, snapshot in current.items():
            counts = totals.setdefault(worker, dict.fromkeys(_SCRAPE_COUNTS, 0))
            for key in _SCRAPE_COUNTS:
                counts[key] += int(snapshot[key])
        return totals

    def _retire_scraper(self) -> None:
        """Takes the (stopped) scraper out, its counts kept in :meth:`scrape_counters`."""
        with self._feed_lock:
            scraper, self._scraper = self._scraper, None
            if scraper is None:
                return
            for worker, snapshot in scraper.snapshot().items():
                counts = self._retired_scrape_counts.setdefault(
                    worker, dict.fromkeys(_SCRAPE_COUNTS, 0)
                )
                for key in _SCRAPE_COUNTS:
                    counts[key] += int(snapshot[key])

    def _retire_subscriber(
        self,
    ) -> tuple[KVEventSubscriber | NativeKVEventSubscriber | None, dict[str, int]]:
        """Takes the running subscriber out, its counts kept in the totals at once (a scrape
        meanwhile sees no dip); returns it and the counts kept, for :meth:`_retired`."""
        with self._feed_lock:
            subscriber, self._subscriber = self._subscriber, None
            if subscriber is None:
                return None, {}
            seen = subscriber.counters()
            self._add_retired(seen, {})
        return subscriber, seen

    def _retired(
        self, subscriber: KVEventSubscriber | NativeKVEventSubscriber, seen: dict[str, int]
    ) -> None:
        """Adds what ``subscriber`` counted after :meth:`_retire_subscriber` (it is stopped)."""
        counts = subscriber.counters()
        with self._feed_lock:
            self._add_retired(counts, seen)

    def _add_retired(self, counts: dict[str, int], seen: dict[str, int]) -> None:
        for key, value in counts.items():
            kept = self._retired_kv_counts.get(key, 0)
            self._retired_kv_counts[key] = kept + value - seen.get(key, 0)

    @property
    def scraper(self) -> MetricsScraper | None:
        """The running metrics scraper, if any."""
        return self._scraper

    @property
    def started(self) -> bool:
        """Whether the feeds run (between :meth:`start` and :meth:`stop`, or the sync pair)."""
        return self._mode is not None

    async def start(self) -> None:
        """Starts the feeds on the running event loop (the scraper as a task, the subscriber
        on its thread). A no-op when started."""
        with self._lifecycle:
            if self._mode is not None:
                return
            self._mode = "async"
            self._loop = asyncio.get_running_loop()
            try:
                self._start_feeds()
            except BaseException:
                self._mode = self._loop = None
                raise

    async def stop(self) -> None:
        """Stops the feeds, started by :meth:`start` or :meth:`start_sync` (a no-op when not
        started). The scheduler goes on admitting and placing requests without feeds."""
        with self._lifecycle:
            mode = self._mode
        if mode != "async":
            if mode == "threads":
                self.stop_sync()
            return
        if self._restart is not None:
            # Its own failure is not the stop's; the stop's cancellation goes through.
            await settled(self._restart)
            self._restart = None
        await self._stop_feeds_async()
        with self._lifecycle:
            self._drop_again()
            self._mode = None
            self._loop = None

    def start_sync(self) -> None:
        """Starts the feeds on threads of their own (for code without an event loop). A no-op
        when started; safe to call from several threads at once (one start wins, and a
        :meth:`stop_sync` meanwhile waits for it and then stops what it started). On a thread
        whose event loop is running it raises :class:`~llmsched.errors.EventLoopError` (a
        RuntimeError) naming ``await scheduler.start()`` and starts nothing: there the feeds
        belong on that loop (an engine change would restart threads' feeds on the loop's
        thread, blocking it)."""
        _refuse_in_a_running_loop("start_sync", "await scheduler.start()")
        with self._lifecycle:
            if self._mode is not None:
                return
            self._mode = "threads"
            try:
                self._start_feeds()
            except BaseException:
                self._mode = None
                raise

    def stop_sync(self) -> None:
        """Stops feeds started by :meth:`start_sync`; a no-op otherwise (feeds started by
        :meth:`start` run on its event loop: ``await stop()``). The scheduler goes on
        admitting and placing requests without feeds."""
        with self._lifecycle:
            if self._mode != "threads":
                return
            self._stop_feeds_threads()
            self._drop_again()
            self._mode = None

    async def feeds_settled(self) -> None:
        """Waits until the feeds follow the current engines (after an engine change)."""
        while self._restart is not None and not self._restart.done():
            await asyncio.shield(self._restart)

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _start_feeds(self) -> None:
        """Starts the feeds for the current engines; on a failure, none is left running."""
        try:
            self._open_feeds()
        except BaseException:
            self._stop_feeds_threads()
            raise

    def _open_feeds(self) -> None:
        specs = self.specs
        if not specs:
            return
        with_events = [s for s in specs if s.kv_events] if self._kv_events else []
        if with_events:
            from llmsched.integrations import KVEventSubscriber, NativeKVEventSubscriber

            # A (re)started scheduler learns what the engines already cache from their replay
            # sockets right away, not only when an engine next stores or evicts a block.
            feed = NativeKVEventSubscriber if self._kv_feed == "native" else KVEventSubscriber
            subscriber = feed(self.index, with_events, catch_up=True)
            with self._feed_lock:
                self._subscriber = subscriber
            subscriber.start()
        if self._scrape:
            from llmsched.integrations import MetricsScraper

            scraper = MetricsScraper(
                specs,
                pool=self.pool,
                flow=self.flow,
                interval_s=self._scrape_interval_s,
                timeout_s=self._scrape_timeout_s,
                on_block_size=self.note_engine_block_size,
            )
            with self._feed_lock:
                self._scraper = scraper
            # The scraper adds the pool endpoints it lacks: drained engines stay out.
            with self._engines_lock:
                for key in self._drained:
                    with contextlib.suppress(UnknownEndpointError):
                        self.pool.remove(key)
            if self._mode == "threads":
                self._scraper.start()
            else:
                assert self._loop is not None
                self._scrape_task = self._loop.create_task(self._scraper.run())

    async def _stop_feeds_async(self) -> None:
        if self._scrape_task is not None:
            await cancel_and_wait(self._scrape_task)
            self._scrape_task = None
        self._retire_scraper()
        subscriber, seen = self._retire_subscriber()
        if subscriber is not None:
            await asyncio.get_running_loop().run_in_executor(None, subscriber.stop)
            self._retired(subscriber, seen)

    def _stop_feeds_threads(self) -> None:
        if self._scrape_task is not None:  # started on a loop that failed to start the rest
            self._scrape_task.cancel()
            self._scrape_task = None
        elif self._scraper is not None:
            self._scraper.stop()
        self._retire_scraper()
        subscriber, seen = self._retire_subscriber()
        if subscriber is not None:
            subscriber.stop()
            self._retired(subscriber, seen)

    def _feeds_changed(self) -> None:
        """The engines changed: running feeds restart on the new set."""
        with self._lifecycle:
            if self._mode == "threads":
                self._stop_feeds_threads()
                self._drop_again()
                self._start_feeds()
            elif self._mode == "async":
                assert self._loop is not None
                previous = self._restart

                async def restart() -> None:
                    if previous is not None:
                        # Whatever it ended with; a cancellation of this one goes through
                        # (suppressed with the previous one's, it went on to start feeds).
                        await settled(previous)
                    await self._stop_feeds_async()
                    with self._lifecycle:
                        self._drop_again()
                        if self._mode == "async":
                            self._start_feeds()

                self._restart = self._loop.create_task(restart())

    # -- the pipeline --------------------------------------------------------------------

    def next_request_id(self) -> int:
        """A fresh request id (the ids flow control and placements use)."""
        return next(self._ids)

    def _count(self, key: str, n: int = 1) -> None:
        """Adds ``n`` to one of :meth:`stats`'s counters."""
        with self._lock:
            self._counts[key] += n

    def _collected_unended(self, what: str, request_id: int | None) -> None:
        """Counts an admission or a placement collected unended (``stats()["dropped"]``);
        the first is warned of. (for their finalizers)"""
        with self._lock:
            self._counts["dropped"] += 1
            first, self._drop_warned = not self._drop_warned, True
        if first:
            of = "" if request_id is None else f" of request {request_id}"
            log.warning(
                "%s%s was garbage-collected without being ended: its slot was given back "
                "then (end it: complete(), fail() or cancel(), or its with block; release() "
                "for an admission); further ones are counted in Scheduler.stats()['dropped']",
                what,
                of,
            )

    def _flow_request(self, request: ScheduleRequest, request_id: int) -> FlowRequest:
        return FlowRequest(
            request_id,
            priority=request.priority,
            tenant=request.tenant,
            prompt_tokens=request.prompt_size,
            size_bytes=request.size_bytes,
            deadline=None if request.deadline is None else float(request.deadline),
            ttft_target=None if request.ttft_target_s is None else float(request.ttft_target_s),
        )

    async def admit(self, request: ScheduleRequest) -> Admission:
        """Waits for flow control to dispatch ``request`` (at once without flow control).
        Raises :class:`~llmsched.errors.FlowRejected` (outcome, status, reason,
        ``retry_after_s``) when it is refused or evicted; cancelling the awaiting task takes
        it out of the queue."""
        if not isinstance(request, ScheduleRequest):
            raise InvalidRequestError(
                f"request must be a ScheduleRequest, got {type(request).__name__}"
            )
        request_id = self.next_request_id()
        if self.flow is None:
            self._count("admitted")
            return Admission(None, request_id, 0.0)
        before = time.perf_counter()
        try:
            decision = await self.flow.admit(self._flow_request(request, request_id))
        except FlowRejected as rejected:
            self._count("rejected")
            raise FlowRejected(
                rejected.request_id, rejected.outcome, retry_after_s=self._retry_after_s
            ) from None
        self._count("admitted")
        queued_s = time.perf_counter() - before
        return Admission(
            self.flow, request_id, queued_s, ticket=decision.ticket, on_drop=self._collected_unended
        )

    def admit_sync(self, request: ScheduleRequest) -> Admission:
        """:meth:`admit` for code without a running event loop (it blocks the calling thread
        until the request is dispatched). With flow control, inside a running loop it raises
        :class:`~llmsched.errors.EventLoopError` (a RuntimeError) naming ``await
        scheduler.admit(request)``; without flow control nothing waits, and it admits."""
        if self.flow is None:
            if not isinstance(request, ScheduleRequest):
                raise InvalidRequestError(
                    f"request must be a ScheduleRequest, got {type(request).__name__}"
                )
            self._count("admitted")
            return Admission(None, self.next_request_id(), 0.0)
        _refuse_in_a_running_loop("admit_sync", "admission = await scheduler.admit(request)")
        return asyncio.run(self.admit(request))

    def place(
        self,
        request: ScheduleRequest,
        admission: Admission | None = None,
        *,
        first: EndpointId | None = None,
    ) -> Placement:
        """Picks an endpoint for an admitted ``request`` and puts it in flight there. The
        placement releases ``admission`` when it ends only if it was made by
        :meth:`schedule`; here the caller keeps it. NoEndpointError when no endpoint can serve
        the request (nothing is held then).

        ``first``: an endpoint to run it on whatever the decision ranks first, as when only
        that engine holds the state the request continues (a Responses API conversation);
        the decision's order follows it for retries. NoEndpointError when ``first`` is not in
        routing."""
        if not isinstance(request, ScheduleRequest):
            raise InvalidRequestError(
                f"request must be a ScheduleRequest, got {type(request).__name__}"
            )
        if admission is not None and not isinstance(admission, Admission):
            raise InvalidRequestError(
                f"admission must be an Admission or None, got {type(admission).__name__}"
            )
        if first is not None and (isinstance(first, bool) or not isinstance(first, (int, str))):
            raise InvalidRequestError(f"first must be an endpoint id, got {first!r}")
        return self._place(request, admission, owns_admission=False, first=first)

    def _place(
        self,
        request: ScheduleRequest,
        admission: Admission | None,
        *,
        owns_admission: bool,
        first: EndpointId | None = None,
    ) -> Placement:
        try:
            decision = self.router.pick(**request.pick_arguments())  # type: ignore[arg-type]
        except NoEndpointError:
            self._count("no_endpoint")
            raise
        cached = decision.cached_tokens()
        chosen = decision.endpoint if first is None else first
        order = [chosen, *(e for e in [decision.endpoint, *decision.fallbacks] if e != chosen)]
        more = None
        if any(e not in order for e in cached):
            more = functools.partial(_also_eligible, decision, list(cached))
        try:
            attempt = self._started(decision, chosen, cached)
        except UnknownEndpointError:  # ``first`` is out of routing (or was removed)
            decision.finished()
            self._count("no_endpoint")
            raise NoEndpointError(f"endpoint {first!r} is not in routing") from None
        self._count("in_flight")
        return Placement(
            self, request, admission, attempt, order, owns_admission=owns_admission, more=more
        )

    def _started(
        self, decision: Decision, endpoint: EndpointId, cached: Mapping[EndpointId, int]
    ) -> _Attempt:
        size = self.index.block_size
        used = [endpoint]
        if decision.prefill_endpoint is not None:
            used.append(decision.prefill_endpoint)
        held = tuple((e, cached.get(e, 0) // size) for e in used)
        decision.started(endpoint)
        return _Attempt(decision, endpoint, held)

    def _start_attempt(self, first: Decision, endpoint: EndpointId) -> _Attempt | None:
        """The placement's ``first`` decision started again on ``endpoint`` (a retry); None
        when the endpoint has left routing since (removed or drained). No new pick is made:
        a stateful picker does not move (with round-robin, a retry taking the next request's
        turn gave a failing engine almost every first attempt), and the retry goes where the
        pick ranked it, as on the native data plane. (for :meth:`Placement.retry`)"""
        with self._engines_lock:
            if endpoint not in self._engines or endpoint in self._drained:
                return None
        decision = first.again()
        try:
            return self._started(decision, endpoint, decision.cached_tokens())
        except UnknownEndpointError:  # not among the endpoints the pick considered
            decision.finished()
            return None

    def _end_attempt(self, attempt: _Attempt, request: ScheduleRequest, *, failed: bool) -> None:
        """Gives an attempt's in-flight counts back; when it ``failed``, drops the
        approximate prefix blocks it recorded. (for :class:`Placement`)"""
        attempt.decision.finished()
        if failed:
            removed = 0
            hashes: npt.NDArray[np.uint64] | None = None
            for worker, held in attempt.held_before:
                if hashes is None:
                    hashes = request.block_hashes(self.index)
                removed += self._drop_record(worker, hashes[held:])
            if removed:
                self._count("records_removed", removed)

    def _drop_record(self, worker: EndpointId, hashes: npt.NDArray[np.uint64]) -> int:
        """Drops ``worker``'s unconfirmed holdings among ``hashes`` (deepest first)."""
        if not len(hashes):
            return 0
        try:
            holdings = self.index.holdings(worker)
        except UnknownWorkerError:
            return 0
        ours = [int(h) for h in hashes if (held := holdings.get(int(h))) and not held[1]]
        if not ours:
            return 0
        try:
            return self.index.remove(worker, ours[::-1])
        except (UnknownBlockError, UnknownWorkerError):  # changed since read: leave it
            return 0

    def _placement_ended(self, outcome: PlacementOutcome) -> None:
        """Counts an ended placement. (for :class:`Placement`)"""
        with self._lock:
            self._counts["in_flight"] -= 1
            self._counts[outcome] += 1

    def schedule(self, request: ScheduleRequest) -> AbstractAsyncContextManager[Placement]:
        """Admits, picks and puts ``request`` in flight; yields its :class:`Placement` and
        settles the accounting on exit (see the module docstring). Raises FlowRejected or
        NoEndpointError before yielding (nothing is held then).

        >>> import asyncio
        >>> s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 1}})
        >>> async def run():
        ...     async with s.schedule(ScheduleRequest(tokens=[1, 2], tenant="t")) as p:
        ...         inside = s.flow.running_count()
        ...     return inside, s.flow.running_count()
        >>> asyncio.run(run())
        (1, 0)
        """
        return _Scheduling(self, request)

    def schedule_sync(self, request: ScheduleRequest) -> Placement:
        """:meth:`schedule` for code without an event loop (admission blocks the thread):
        the :class:`Placement` returned is the context manager (``with
        scheduler.schedule_sync(request) as placement:``). With flow control, inside a running
        event loop it raises :class:`~llmsched.errors.EventLoopError` (a RuntimeError) naming
        ``async with scheduler.schedule(request) as placement:``, and admits nothing."""
        if self.flow is not None:
            _refuse_in_a_running_loop(
                "schedule_sync", "async with scheduler.schedule(request) as placement:"
            )
        return self._placed(request, self.admit_sync(request))

    def _placed(self, request: ScheduleRequest, admission: Admission) -> Placement:
        """A placement that releases ``admission`` when it ends (released now on failure)."""
        try:
            return self._place(request, admission, owns_admission=True)
        except BaseException:
            admission.release()
            raise

    # -- introspection -------------------------------------------------------------------

    @property
    def warnings(self) -> list[str]:
        """The configuration's notes (the router's, the caller's ``notes`` and the
        scheduler's own), one for each scheduled engine whose KV events the index skipped
        because their block size is not a multiple of the index's (``index.stats()
        ["block_size_mismatch"]``; the index logs that once per engine), and the router's
        :attr:`~llmsched.Router.pseudo_token_warning` and
        :attr:`~llmsched.Router.token_warning` once given (text prompts hashed as
        pseudo-tokens on an index fed by engine events; token ids the picks were given that
        never matched a block the engines reported).

        >>> s = Scheduler(["a"], router="round-robin", block_size=16)
        >>> s.warnings
        []
        >>> s.index.note_block_size_mismatch("a", 3)
        >>> [w[:49] for w in s.warnings]
        ["engine 'a': 3 stored KV events skipped: its block"]
        >>> s.stats()["config_warnings"]
        1
        """
        given = (self.router.pseudo_token_warning, self.router.token_warning)
        with self._engines_lock:  # the notes of one engine set
            return [
                *self._warnings,
                *self._block_size_notes(),
                *self._engine_block_size_notes(),
                *self._extra_keys_notes(),
                *(note for note in given if note is not None),
            ]

    def note_engine_block_size(self, worker: EndpointId, block_size: int) -> None:
        """Takes the KV block size ``worker``'s ``/metrics`` gives (vLLM's
        ``vllm:cache_config_info``; the metrics scraper, or the native data plane's, calls it).
        Where the engine's KV events feed the index and ``block_size`` is not a multiple of the
        index's, every block it stores will be skipped (the index can split an engine block
        only into whole blocks of its own) and its cache never matched: that is warned once
        per engine and size through logging and listed in :attr:`warnings` (before the first
        event shows it). An engine removed, or back at another address (another process),
        forgets its size and the warning; a size for an engine not scheduled (a scrape that
        ended after it left) is ignored. Without KV events the index holds the router's own
        decisions, hashed at its own block size, and the engine's size does not matter:
        nothing is said.

        >>> from llmsched.integrations import EngineSpec
        >>> spec = EngineSpec("h", 1, kv_events="tcp://h:5557")
        >>> s = Scheduler([spec], router="round-robin", block_size=16)
        >>> s.note_engine_block_size(spec.worker_id, 32)
        >>> s.warnings
        []
        >>> s.note_engine_block_size(spec.worker_id, 24)
        >>> [w[:46] for w in s.warnings]
        ["engine 'h:1': its /metrics gives a KV block si"]
        """
        check_id("worker", worker)
        _check_int("block_size", block_size, 1, 2**32 - 1)
        with self._engines_lock, self._lock:
            if worker not in self._engines:
                return
            self._engine_block_sizes[worker] = block_size
            bad = self._block_size_unmatched(worker, block_size)
            first = bad and (worker, block_size) not in self._block_sizes_warned
            if first:
                self._block_sizes_warned.add((worker, block_size))
        if first:
            log.warning("%s", self._engine_block_size_note(worker, block_size))

    def _block_size_unmatched(self, worker: EndpointId, block_size: int) -> bool:
        """Whether an engine's block size makes its KV events unusable by the index: its
        events feed the index and the index cannot split its blocks into whole ones."""
        engine = self._engines.get(worker)
        if engine is None or engine.spec is None or not engine.spec.kv_events:
            return False
        return self._kv_events and block_size % self.index.block_size != 0

    def _engine_block_size_note(self, worker: EndpointId, block_size: int) -> str:
        size = self.index.block_size
        return (
            f"engine {worker!r}: its /metrics gives a KV block size of {block_size} tokens, not a "
            f"multiple of the index's {size}: every block its KV events store is skipped, so "
            f"its cache is never matched; start the engine with vLLM's --block-size a multiple "
            f"of {size} (or give the index a block size that divides {block_size})"
        )

    def _engine_block_size_notes(self) -> list[str]:
        """One note per engine whose scraped block size the index cannot split, unless its
        skipped events already say so (:meth:`_block_size_notes`)."""
        skipped = self.index.block_size_mismatch()
        with self._engines_lock, self._lock:
            sizes = sorted(self._engine_block_sizes.items(), key=lambda item: str(item[0]))
            return [
                self._engine_block_size_note(worker, size)
                for worker, size in sizes
                if worker not in skipped and self._block_size_unmatched(worker, size)
            ]

    def _extra_keys_notes(self) -> list[str]:
        """One note per engine whose KV events the index skipped for their extra keys."""
        skipped = self.index.extra_keys()
        with self._engines_lock:
            return [
                f"engine {worker!r}: {count} stored KV events skipped for extra keys the index "
                "cannot name (a LoRA adapter named only by its number, or keys beside the LoRA "
                "name and a prompt's cache salt), so those blocks are never matched; send the "
                "adapter's name (vLLM 0.20 or later) and no other keys"
                for worker, count in sorted(skipped.items(), key=lambda item: str(item[0]))
                if worker in self._engines
            ]

    def engine_block_sizes(self) -> dict[EndpointId, int]:
        """The KV block size each engine's ``/metrics`` gave (see
        :meth:`note_engine_block_size`).

        >>> Scheduler(["a"], router="round-robin").engine_block_sizes()
        {}
        """
        with self._lock:
            return dict(self._engine_block_sizes)

    def engine_block_size_mismatch(self) -> dict[EndpointId, int]:
        """The engines whose scraped KV block size makes their KV events unusable by the index
        (their events feed it and the index cannot split their blocks), with that size.

        >>> Scheduler(["a"], router="round-robin").engine_block_size_mismatch()
        {}
        """
        with self._engines_lock, self._lock:
            return {
                worker: size
                for worker, size in self._engine_block_sizes.items()
                if self._block_size_unmatched(worker, size)
            }

    def _block_size_notes(self) -> list[str]:
        """One note per engine whose KV events were skipped for their block size."""
        skipped = self.index.block_size_mismatch()
        size = self.index.block_size
        with self._engines_lock:
            return [
                f"engine {worker!r}: {count} stored KV events skipped: its block size is not a "
                f"multiple of the index's {size} tokens, so its cache is never matched; start "
                f"the engine with vLLM's --block-size a multiple of {size} (or give the index a "
                "block size that divides the engine's)"
                for worker, count in sorted(skipped.items(), key=lambda item: str(item[0]))
                if worker in self._engines
            ]

    def stats(self) -> SchedulerStats:
        """Counters since the scheduler was built and what it holds now.

        >>> Scheduler(["a"]).stats()["engines"]
        1
        """
        with self._lock:
            counts = dict(self._counts)
        with self._engines_lock:
            engines, draining = len(self._engines), len(self._drained)
        return SchedulerStats(
            admitted=counts["admitted"],
            rejected=counts["rejected"],
            no_endpoint=counts["no_endpoint"],
            completed=counts["completed"],
            failed=counts["failed"],
            cancelled=counts["cancelled"],
            retries=counts["retries"],
            records_removed=counts["records_removed"],
            in_flight=counts["in_flight"],
            queued=0 if self.flow is None else len(self.flow),
            engines=engines,
            draining=draining,
            config_warnings=len(self.warnings),
            dropped=counts["dropped"],
        )

    def __repr__(self) -> str:
        flow = "on" if self.flow is not None else "off"
        return f"Scheduler({len(self._engines)} engines, flow {flow}, router {self.router!r})"


# The counts of MetricsScraper.snapshot that Scheduler.scrape_counters sums.
_SCRAPE_COUNTS = ("scrapes", "failures", "timeouts")


class _Scheduling:
    """What :meth:`Scheduler.schedule` returns: admits and places on entry, ends the placement
    on exit."""

    __slots__ = ("_placement", "_request", "_scheduler")

    def __init__(self, scheduler: Scheduler, request: ScheduleRequest) -> None:
        self._scheduler = scheduler
        self._request = request
        self._placement: Placement | None = None

    async def __aenter__(self) -> Placement:
        if self._placement is not None:
            raise PlacementError("a schedule() context is entered once")
        admission = await self._scheduler.admit(self._request)
        self._placement = self._scheduler._placed(self._request, admission)
        return self._placement

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if self._placement is not None:
            self._placement.end_for(exc_type)

    def __enter__(self) -> NoReturn:
        # ``with`` where ``async with`` belongs: Python 3.10 said only "AttributeError: __enter__".
        raise InvalidTypeError(
            "Scheduler.schedule() is entered with `async with scheduler.schedule(request) as "
            "placement:`; code without an event loop uses `with "
            "scheduler.schedule_sync(request) as placement:`"
        )

    def __exit__(self, *exc_info: object) -> None:
        """Never reached: :meth:`__enter__` raises."""


def _refuse_in_a_running_loop(call: str, instead: str) -> None:
    """:class:`~llmsched.errors.EventLoopError` when this thread runs an event loop: the
    blocking ``Scheduler.<call>()`` would stall it (or need a second loop); ``instead`` is the
    form to use there.

    >>> _refuse_in_a_running_loop("admit_sync", "await scheduler.admit(request)")  # no loop
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return
    raise EventLoopError(
        f"Scheduler.{call}() blocks its thread, and this thread has a running event loop: "
        f"use `{instead}` there"
    )


def _also_eligible(decision: Decision, considered: list[EndpointId]) -> list[EndpointId]:
    """The endpoints ``considered`` that the profile which chose ``decision.endpoint`` kept:
    none of its filters removed them. A retry never goes where the router's filters said the
    request must not (a prefill-only engine for a decode request, an endpoint another filter
    set aside); another profile's candidates (a P/D decision's prefill profile) do not count."""
    chosen = decision.endpoint

    def row(profile: ProfileExplanation, endpoint: EndpointId) -> EndpointScores | None:
        try:
            return profile.row(endpoint)
        except KeyError:
            return None

    kept: set[EndpointId] | None = None
    # No table: the rows of the endpoints asked about, built on demand (a large pool's full
    # explanation took seconds).
    for profile in decision.explain(limit=0).profiles:
        mine = row(profile, chosen)
        if mine is None or mine.rank != 0:
            continue
        ok = {e for e in considered if (r := row(profile, e)) is not None and r.removed_by is None}
        kept = ok if kept is None else kept & ok
    if kept is None:  # no profile ranked it first (a pinned endpoint): no more than before
        return []
    return [e for e in considered if e in kept]


def _flow_config(flow: ConfigSource, stale_after_s: float) -> dict[str, object]:
    """The flow config with the saturation staleness matched to the scrape interval unless
    it sets it (llm-d's 200 ms default would read every scrape as stale)."""
    raw = flow if isinstance(flow, Mapping) else load_mapping(flow, what="flow config")
    config = copy.deepcopy(dict(raw))
    saturation = config.setdefault("saturation", {"type": "utilization"})
    if isinstance(saturation, dict) and saturation.get("type", "utilization") == "utilization":
        saturation.setdefault("staleness_s", stale_after_s)
    return config


by_default(ScheduleRequest)
refuse(
    Scheduler,
    "build a Scheduler per process from its config",
    name="llmsched.Scheduler",
)
refuse(
    Admission,
    "an admission belongs to the scheduler that made it; keep its fields",
    name="llmsched.Admission",
)
refuse(
    Placement,
    "a placement belongs to the scheduler that made it; keep its endpoint",
    name="llmsched.Placement",
)
