"""How llmsched's objects take ``pickle``, ``copy.copy`` and ``copy.deepcopy``: one decision
per class, made here or by the module that defines the class, through one of three functions.

- :func:`by_value`: the state is plain (a value, a decision, a configuration, a snapshot), so
  the object is rebuilt from it: a copy, or another process's equal object.
- :func:`by_default`: a pure-Python value (a dataclass, a ``NamedTuple``) that Python's own
  reduction already rebuilds; recorded so that every public class has a decision.
- :func:`refuse`: the object holds live native state (a router, a controller, a tracker, a
  server) that a copy would share half of or lose, so ``pickle`` and both copies raise
  :class:`~llmsched.errors.NotPicklableError` (a ``TypeError``) naming the class and what to
  use instead. Without it a native object raised CPython's bare ``TypeError: cannot pickle
  'builtins.X' object``, and ``copy.copy`` of a wrapper shared its native half.

:func:`by_value` and :func:`refuse` go through :mod:`copyreg`'s dispatch table, which
``pickle``, ``copy.copy`` and ``copy.deepcopy`` all consult before an object's own reduction,
so a native class (whose type takes no new attributes) and a Python one are treated alike.

>>> import copy, pickle
>>> from llmsched.flow import Outcome
>>> pickle.loads(pickle.dumps(Outcome.EVICTED_TTL)) == Outcome.EVICTED_TTL
True
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any, TypeVar

from llmsched import _llmsched
from llmsched.errors import FlowRejected, NotPicklableError

__all__ = ["DECISIONS", "by_default", "by_fields", "by_value", "refuse"]

T = TypeVar("T")

# copyreg's own signature (typeshed) takes any callable and arguments: a narrower type is refused.
Reduction = tuple[Callable[..., Any], tuple[Any, ...]]
"""What a reducer returns: a callable and the arguments that rebuild the object."""

DECISIONS: dict[type, str] = {}
"""Every class with a decision: ``"value"``, ``"default"`` or ``"refused"``."""


def by_value(cls: type[T], reduce: Callable[[T], Reduction]) -> None:
    """``pickle`` and both copies rebuild a ``cls`` as ``reduce`` says."""
    copyreg.pickle(cls, reduce)
    DECISIONS[cls] = "value"


def by_fields(cls: type[T], *fields: str) -> None:
    """``pickle`` and both copies rebuild a ``cls`` as ``cls(*fields)``, its attributes of
    those names in that order (the constructor's parameters)."""

    def reduce(obj: T) -> Reduction:
        return cls, tuple(getattr(obj, name) for name in fields)

    by_value(cls, reduce)


def by_default(*classes: type) -> None:
    """Records pure-Python values that Python's own reduction rebuilds."""
    for cls in classes:
        DECISIONS[cls] = "default"


def refuse(cls: type, instead: str, *, name: str | None = None) -> None:
    """``pickle``, ``copy.copy`` and ``copy.deepcopy`` of a ``cls`` raise
    :class:`~llmsched.errors.NotPicklableError` naming it (``name``, else its module and
    name) and saying ``instead``: what to use."""
    shown = name or f"{cls.__module__}.{cls.__qualname__}"

    def reduce(obj: object) -> Reduction:
        raise NotPicklableError(
            f"{shown} holds live native state and cannot be pickled or copied: {instead}"
        )

    copyreg.pickle(cls, reduce)
    DECISIONS[cls] = "refused"


def _outcome(outcome: _llmsched.Outcome) -> Reduction:
    """An :class:`~llmsched.flow.Outcome`: the member of that name (the native enum has no
    reduction of its own)."""
    return getattr, (_llmsched.Outcome, outcome.key.upper())


def _cost_model(model: _llmsched.SwitchCostModel) -> Reduction:
    return _llmsched.SwitchCostModel, (model.params(),)


def _native_values() -> None:
    """The native module's values: rebuilt from their fields by their constructors."""
    by_value(_llmsched.Outcome, _outcome)
    by_value(_llmsched.SwitchCostModel, _cost_model)
    by_fields(
        _llmsched.FlowDecision,
        *("id", "outcome", "priority", "tenant", "prompt_tokens", "size_bytes", "wait_s"),
        *("payload", "ticket"),
    )
    by_fields(
        _llmsched.SliceDecision,
        *("action", "level", "priority", "endpoint", "next_slice_tokens", "context_tokens"),
        *("generated_tokens", "slices", "benefit_s", "yield_cost_s", "migrate_cost_s"),
        "evict_probability",
    )
    by_fields(
        _llmsched.SliceState,
        *("priority", "level", "prompt_tokens", "max_tokens", "generated_tokens"),
        *("slice_generated", "slice_tokens", "slices", "context_tokens", "endpoint"),
        *("route_to", "paused_since"),
    )
    by_fields(
        _llmsched.EndpointLoad,
        *("kv_capacity_tokens", "kv_cache_usage", "waiting", "prefill_tokens_per_s"),
        "decode_step_s",
    )


_NATIVE_HANDLES = {
    "PrefixIndex": "pickle a llmsched.PrefixIndex (its snapshot), or use its dumps()/loads()",
    "PrefixMatch": "keep its as_dict() (worker -> matched blocks)",
    "EndpointPool": "build a llmsched.EndpointPool per process from its endpoints",
    "Router": "build a llmsched.Router per process from its pool and config",
    "Decision": "keep the fields it reports (endpoint_id, explain()); a decision belongs to "
    "the router that made it",
    "ReplicaSync": "build one per process (llmsched.cluster)",
    "FlowCore": "build a llmsched.FlowController per process from its config",
    "SliceTracker": "build a llmsched.SliceTracker per process from its policy and params",
    "SliceAssembler": "assemble each response in the process that serves it",
    "KvCache": "build one per simulation run",
    "PlanContents": "build one per simulation run",
    "NativeKVEventSubscriber": "start one subscriber per process",
    "NativeGateway": "start one gateway per process from its config",
    "NativePromptTokenizer": "load the tokenizer in each process (llmsched.tokenize)",
}
"""The native module's classes that hold live state, and what to use instead of a copy."""


def _native_handles() -> None:
    for name, instead in _NATIVE_HANDLES.items():
        refuse(getattr(_llmsched, name), instead)


_native_values()
_native_handles()
by_default(FlowRejected)  # its own __reduce__: rebuilt from its fields
