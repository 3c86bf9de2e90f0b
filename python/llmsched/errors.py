"""The llmsched exception hierarchy.

Every error that llmsched raises for bad input subclasses both :class:`LlmschedError` and the
built-in exception it resembles, so ``except ValueError`` keeps working: a value out of range
is a ``ValueError`` (:class:`InvalidValueError`, ...), an argument of the wrong type a
``TypeError`` (:class:`InvalidTypeError`).

>>> from llmsched.errors import InvalidTokenError, InvalidTypeError
>>> issubclass(InvalidTokenError, ValueError)
True
>>> issubclass(InvalidTypeError, TypeError)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmsched._llmsched import Outcome

__all__ = [
    "ConfigError",
    "DuplicateRequestError",
    "EventLoopError",
    "FlowRejected",
    "GatewayStoppedError",
    "HashChainError",
    "InternalError",
    "InvalidRequestError",
    "InvalidTokenError",
    "InvalidTypeError",
    "InvalidValueError",
    "LlmschedError",
    "MalformedEventError",
    "MalformedSyncBatchError",
    "NoEndpointError",
    "NotPicklableError",
    "PlacementError",
    "PolicyError",
    "SliceStateError",
    "SnapshotError",
    "UnknownBlockError",
    "UnknownEndpointError",
    "UnknownRequestError",
    "UnknownWorkerError",
]


class LlmschedError(Exception):
    """Base class of every exception raised by llmsched."""


class InvalidTokenError(LlmschedError, ValueError):
    """A token id is negative or above 2**32 - 1."""


class ConfigError(LlmschedError, ValueError):
    """A configuration is impossible or names something unknown."""


class MalformedEventError(LlmschedError, ValueError):
    """A vLLM KV-event payload could not be decoded; nothing was applied."""


class MalformedSyncBatchError(LlmschedError, ValueError):
    """A replica-sync batch from the message bus could not be decoded; nothing was applied."""


class UnknownWorkerError(LlmschedError, KeyError):
    """A worker name is not known to the structure."""


class UnknownBlockError(LlmschedError, KeyError):
    """A block hash (or a parent) is not held where the operation needs it."""


class HashChainError(LlmschedError, ValueError):
    """Block hashes are not a chain consistent with the index (a hash sits elsewhere already)."""


class SnapshotError(LlmschedError, ValueError):
    """A serialised index is corrupt or of an unknown format; nothing was loaded."""


class UnknownRequestError(LlmschedError, KeyError):
    """A request id is not tracked (never admitted, or already finished or removed)."""


class SliceStateError(LlmschedError, ValueError):
    """A slice operation does not fit the request's state (e.g. a decision mid-slice)."""


class NoEndpointError(LlmschedError, LookupError):
    """No endpoint can serve a request: none serves its model, or the filters removed them all."""


class PlacementError(LlmschedError, RuntimeError):
    """A :class:`llmsched.Placement` or :class:`llmsched.Decision` was used in a way its state
    does not allow (a retry after it ended, its endpoint after a retry found none, a decision
    started twice or after it finished, a first token before it started); nothing was
    changed."""


class UnknownEndpointError(LlmschedError, KeyError):
    """An endpoint id is not in the pool (or was not considered by the decision)."""


class DuplicateRequestError(LlmschedError, ValueError):
    """A request id is already in use where a new one is needed: flow control's ``enqueue``
    and ``admit`` (an id queued or running), the executor's ``Engine.add_request`` (an id in
    the engine), the simulator's KV cache; nothing was changed."""


class InvalidRequestError(LlmschedError, ValueError):
    """A request carries a value no policy can act on (a negative size, a priority that does
    not fit in 32 bits, ...); nothing was changed."""


class InternalError(LlmschedError, RuntimeError):
    """A bug in llmsched's native core, caught at the Python boundary (no input should cause
    one: please report it with the message)."""


class PolicyError(LlmschedError, RuntimeError):
    """A simulator :class:`~llmsched.sim.policies.Policy` object raised, or answered ``pick``
    with something that is not a replica, while the Rust engine ran it: the message names the
    policy, the call and the request; the policy's own exception is the ``__cause__``. The run
    stopped and left no result."""


class GatewayStoppedError(LlmschedError, RuntimeError):
    """A call on a native gateway that is not serving (stopped, or never started)."""


class EventLoopError(LlmschedError, RuntimeError):
    """A blocking ``*_sync`` call (:meth:`Scheduler.admit_sync <llmsched.Scheduler.admit_sync>`,
    ``schedule_sync``, ``start_sync``) on a thread whose asyncio event loop is running: it would
    block the loop, or need a second one. The message names the form to ``await`` instead;
    nothing was changed. Subclasses ``RuntimeError`` (what it was before)."""


class InvalidValueError(LlmschedError, ValueError):
    """An argument is out of the range :mod:`llmsched.validation` allows (a negative or
    non-finite ``now``, a probability above 1, ...); nothing was changed."""


class InvalidTypeError(LlmschedError, TypeError):
    """An argument is of the wrong type (a str where token ids belong, None where a number
    does, ...); nothing was changed. Subclasses ``TypeError``, so ``except TypeError`` keeps
    working."""


class NotPicklableError(LlmschedError, TypeError):
    """``pickle``, ``copy.copy`` or ``copy.deepcopy`` of an object that holds live native
    state (a router, a flow controller, a slice tracker, a gateway, ...): the message names its
    class and what to use instead (build one per process from its configuration, or keep a
    snapshot such as ``PrefixIndex.dumps()``). Values (decisions, outcomes, configurations,
    requests, cost models) pickle and copy. Subclasses ``TypeError``, what CPython raised
    before (``cannot pickle 'builtins.X' object``)."""


class FlowRejected(LlmschedError):
    """A request was not dispatched: refused at the door or evicted from the queue.

    Carries the terminal ``outcome`` (an :class:`llmsched.flow.Outcome`), the HTTP status and
    the dropped-reason header value a gateway answers with, and ``retry_after_s``: the seconds
    a client should wait before trying again (a ``Retry-After`` header), when the raiser knows
    one (:class:`llmsched.Scheduler` sets it), else None.

    >>> from llmsched.flow import Outcome
    >>> err = FlowRejected(7, Outcome.EVICTED_TTL, retry_after_s=2)
    >>> err.http_status, err.reason, err.retry_after_s
    (429, 'ttl-expired', 2)
    """

    def __init__(
        self, request_id: int, outcome: Outcome, *, retry_after_s: float | None = None
    ) -> None:
        self.request_id = request_id
        self.outcome = outcome
        self.http_status: int = outcome.http_status
        self.reason: str = outcome.reason
        self.retry_after_s = retry_after_s
        super().__init__(
            f"request {request_id} not dispatched: {outcome.key} "
            f"(HTTP {outcome.http_status}, {outcome.reason})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt from its fields, as ``pickle`` and ``copy`` do (its ``args`` hold the
        message only), with any attribute set since.

        >>> import pickle
        >>> from llmsched.flow import Outcome
        >>> pickle.loads(pickle.dumps(FlowRejected(7, Outcome.REJECTED_SHED))).reason
        'load-shed'
        """
        return (type(self), (self.request_id, self.outcome), self.__dict__)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line: a PyYAML error as its problem and position (line
    and column, from 1), anything else with its line breaks folded.

    >>> import yaml
    >>> try:
    ...     yaml.safe_load("a: [1")
    ... except yaml.YAMLError as exc:
    ...     print(one_line(exc))
    expected ',' or ']', but got '<stream end>' at line 1, column 6
    """
    problem = getattr(exc, "problem", None)
    if isinstance(problem, str):
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        return f"{problem}{where}"
    return " ".join(str(exc).split())
