"""Token slices: time-sliced decoding with a budget tracker, a switch-cost model and assembly.

A long response is decoded in slices; between two slices the scheduler may let waiting work
through. :class:`SliceTracker` (Rust core) keeps each request's slice budget and decides at every
slice boundary whether to continue, yield, migrate or finish, weighing the switch cost (KV
recompute if evicted, plus requeue delay) against what the waiting work gains.
:class:`SliceAssembler` turns one OpenAI-style request into per-slice continuation requests and
stitches their streams back into one response.

>>> tracker = SliceTracker("fixed", {"slice_tokens": 4}, endpoints=["gpu-0"])
>>> tracker.admit(1, prompt_tokens=10, max_tokens=6, endpoint="gpu-0")
SliceStart(level=0, slice_tokens=4)
>>> tracker.record_tokens(1, 4)
0
>>> tracker.decide(1, now=0.0).action  # nobody waits: continue
'continue'
>>> tracker.record_tokens(1, 2), tracker.decide(1, now=0.1).action
(0, 'finish')
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from llmsched import _llmsched
from llmsched._copying import by_default, by_value, refuse
from llmsched._llmsched import EndpointLoad, SliceDecision, SliceState
from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError
from llmsched.validation import (
    check_block_size,
    check_bool,
    check_int,
    check_int_like,
    check_iterable,
    check_now,
    check_number_like,
    check_str,
    check_utf8,
    is_bool,
)

__all__ = [
    "EndpointLoad",
    "SliceAssembler",
    "SliceDecision",
    "SliceStart",
    "SliceState",
    "SliceTracker",
    "SliceUsage",
    "SwitchCostModel",
    "WaitingRequest",
    "policy_defaults",
    "policy_names",
]

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I32 = 0x7FFFFFFF


def policy_names() -> list[str]:
    """The registered slice policies.

    >>> policy_names()
    ['fixed', 'mlfq']
    """
    return list(_llmsched.slice_policy_names())


def policy_defaults(name: str) -> dict[str, Any]:
    """The default parameters of slice policy ``name`` (the one place they are set: Rust).

    >>> policy_defaults("mlfq")["levels"]
    4
    """
    return dict(_llmsched.slice_policy_defaults(check_str("policy name", name)))


def _params(params: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """Parameters as a plain dict for the native side (which checks values and names unknown
    ones); names must be strings."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{what} must be a mapping of names to values, got {type(params)}")
    for name in params:
        if not isinstance(name, str):
            raise ConfigError(f"{what}: parameter names must be strings, got {name!r}")
    return dict(params)


class SwitchCostModel:
    """What ending a slice costs: ``recompute_tokens / prefill_tokens_per_s + requeue_delay_s``
    seconds, where a continuation of ``context`` tokens recomputes
    ``min(context, max(p_evict * context, tail))`` tokens: the share ``p_evict`` evicted while
    it waited, and at least its last KV block, ``tail = context - floor((context - 1) /
    block_size) * block_size`` (1 to ``block_size`` tokens), which a prefix-cache hit never
    covers (only full blocks are cached, and the last token is always computed for its logits).

    Parameters (defaults: Llama-3-8B on one H100 SXM, derived once in Rust):
    ``prefill_tokens_per_s`` (recompute rate), ``decode_step_s`` (seconds per decode step),
    ``kv_capacity_tokens`` (KV cache size of an endpoint), ``requeue_delay_s`` (fixed cost of
    sending the next slice), ``priority_base`` (a request of priority ``p`` weighs
    ``priority_base ** p``) and ``block_size`` (the endpoint's KV block size in tokens, an int
    from 1 to 65,536; default 16, what vLLM and the simulator use). Unknown names raise
    :class:`~llmsched.errors.ConfigError`.

    >>> model = SwitchCostModel(decode_step_s=0.02)
    >>> model.decode_step_s
    0.02
    >>> round(1e6 / model.prefill_tokens_per_s, 1)  # us per token of context (8B, H100)
    32.5
    """

    __slots__ = ("_native",)

    def __init__(self, **params: float) -> None:
        for name, value in params.items():  # the native side would read a bool as 0 or 1
            if is_bool(value):
                check_number_like(name, value)
        if "block_size" in params:  # serde's "invalid type: floating point" named no argument
            check_block_size(params["block_size"])
        try:
            self._native = _llmsched.SwitchCostModel(_params(params, "cost model"))
        except ConfigError:
            known = _llmsched.SwitchCostModel({}).params()
            for name, value in params.items():  # name a known one that is not a number
                if name in known:
                    check_number_like(name, value)
            raise

    @property
    def native(self) -> _llmsched.SwitchCostModel:
        """The native model (what the simulator's Rust engine takes)."""
        return self._native

    @classmethod
    def from_model(
        cls,
        *,
        params: float,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype_bytes: int = 2,
        gpu_flops: float | None = None,
        gpu_hbm_bytes_per_s: float | None = None,
        gpu_memory_bytes: float | None = None,
        compute_efficiency: float | None = None,
        bandwidth_efficiency: float | None = None,
        memory_fraction: float | None = None,
        requeue_delay_s: float | None = None,
        priority_base: float | None = None,
        block_size: int | None = None,
    ) -> SwitchCostModel:
        """Derive the model from model dimensions and GPU numbers.

        - ``prefill_tokens_per_s = gpu_flops * compute_efficiency / (2 * params)``;
        - KV bytes/token ``= 2 * layers * kv_heads * head_dim * dtype_bytes`` and
          ``kv_capacity_tokens = (gpu_memory_bytes * memory_fraction - params * dtype_bytes)
          / kv_bytes_per_token``;
        - ``decode_step_s = params * dtype_bytes / (gpu_hbm_bytes_per_s * bandwidth_efficiency)``.

        GPU numbers left out are an H100 SXM's; efficiencies 0.5 (compute), 0.7 (bandwidth),
        memory fraction 0.9; ``block_size`` (the engine's KV block size) 16.

        >>> m = SwitchCostModel.from_model(params=70e9, layers=80, kv_heads=8, head_dim=128,
        ...     dtype_bytes=1, gpu_memory_bytes=141e9, gpu_hbm_bytes_per_s=4.8e12)  # fp8, H200
        >>> m.kv_capacity_tokens < SwitchCostModel().kv_capacity_tokens
        True
        """
        model = {
            "params": params,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype_bytes": dtype_bytes,
        }
        gpu = {
            "flops": gpu_flops,
            "hbm_bytes_per_s": gpu_hbm_bytes_per_s,
            "memory_bytes": gpu_memory_bytes,
        }
        dims: dict[str, Any] = {
            "model": model,
            "gpu": {k: v for k, v in gpu.items() if v is not None},
            "compute_efficiency": compute_efficiency,
            "bandwidth_efficiency": bandwidth_efficiency,
            "memory_fraction": memory_fraction,
            "requeue_delay_s": requeue_delay_s,
            "priority_base": priority_base,
            "block_size": None if block_size is None else check_block_size(block_size),
        }
        dims = {k: v for k, v in dims.items() if v is not None}
        for name, number in gpu.items():  # the native side would read a bool as 0 or 1
            check_number_like(f"gpu_{name}", number, optional=True)
        for name, setting in dims.items():
            if name not in ("model", "gpu", "block_size"):
                check_number_like(name, setting)
        for name, value in model.items():
            # A numpy scalar was "must be a positive number, got 32": name what is wrong.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(
                    f"cost model dims: {name} must be a plain int or float (config is plain "
                    f"data), got {type(value).__name__} {value}"
                )
            if not value > 0:
                raise ConfigError(f"cost model dims: {name} must be a positive number, got {value}")
        self = cls.__new__(cls)
        try:
            self._native = _llmsched.SwitchCostModel.from_dims(_params(dims, "cost dims"))
        except ConfigError:  # name an argument of the wrong type (serde's message does not)
            for name in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
                check_int(name, model[name], minimum=1)
            for name, number in gpu.items():
                check_number_like(f"gpu_{name}", number, optional=True)
            for name, setting in dims.items():
                if name not in ("model", "gpu", "block_size"):
                    check_number_like(name, setting)
            raise
        return self

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens an endpoint prefills per second (the recompute rate)."""
        return self._native.prefill_tokens_per_s

    @property
    def decode_step_s(self) -> float:
        """Seconds per decode step."""
        return self._native.decode_step_s

    @property
    def kv_capacity_tokens(self) -> float:
        """KV cache size of an endpoint, in tokens."""
        return self._native.kv_capacity_tokens

    @property
    def requeue_delay_s(self) -> float:
        """Fixed cost of ending a slice and sending the next one."""
        return self._native.requeue_delay_s

    @property
    def priority_base(self) -> float:
        """A request of priority ``p`` weighs ``priority_base ** p``."""
        return self._native.priority_base

    @property
    def block_size(self) -> int:
        """The endpoint's KV block size, in tokens (a continuation recomputes its last block)."""
        return self._native.block_size

    def weight(self, priority: int) -> float:
        """``priority_base ** priority``; ``priority`` is an int in ``-2**31..2**31-1``
        (``InvalidValueError`` outside it).

        >>> SwitchCostModel().weight(2)
        4.0
        """
        check_int_like("priority", priority)
        value = operator.index(priority)
        if not -(2**31) <= value <= _I32:
            # The native i32 conversion gave a bare OverflowError.
            raise InvalidValueError(f"priority must be in -2**31..2**31-1, got {value}")
        return self._native.weight(value)

    def recompute_s(
        self, context_tokens: float, prefill_tokens_per_s: float | None = None
    ) -> float:
        """Seconds to recompute ``context_tokens`` of KV (default rate: this model's).

        ``context_tokens`` must be finite and ``>= 0``, the rate finite and ``> 0``
        (``InvalidValueError`` naming the argument otherwise).

        >>> SwitchCostModel(prefill_tokens_per_s=1000).recompute_s(500)
        0.5
        """
        rate = self.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
        return self._native.recompute_s(
            _amount("context_tokens", context_tokens),
            _amount("prefill_tokens_per_s", rate, positive=True),
        )

    def recompute_tokens(
        self, context_tokens: float, *, demand_tokens: float = 0.0, free_tokens: float = 0.0
    ) -> float:
        """Tokens a continuation of a request with ``context_tokens`` of KV recomputes when the
        work admitted meanwhile needs ``demand_tokens`` and the endpoint has ``free_tokens``:
        ``min(context, max(p_evict * context, tail))``, with ``tail`` its last KV block (1 to
        ``block_size`` tokens), recomputed even when nothing was evicted. The counts must be
        finite and ``>= 0``.

        >>> m = SwitchCostModel()  # block_size 16
        >>> m.recompute_tokens(48), m.recompute_tokens(50)  # nothing evicted: the last block
        (16.0, 2.0)
        >>> m.recompute_tokens(1000, demand_tokens=1500, free_tokens=1000)  # half evicted
        500.0
        """
        p_evict = evict_probability(context_tokens, demand_tokens, free_tokens)
        return self._native.recompute_tokens(p_evict, float(context_tokens))

    def switch_s(
        self,
        context_tokens: float,
        *,
        demand_tokens: float,
        free_tokens: float,
        prefill_tokens_per_s: float | None = None,
    ) -> float:
        """Expected seconds a switch costs a request with ``context_tokens`` of KV when the work
        admitted meanwhile needs ``demand_tokens`` and the endpoint has ``free_tokens``:
        :meth:`recompute_tokens` at the prefill rate, plus ``requeue_delay_s``.
        The token counts must be finite and ``>= 0``, the rate finite and ``> 0``.

        >>> m = SwitchCostModel(prefill_tokens_per_s=1000, requeue_delay_s=0.01)
        >>> m.switch_s(1000, demand_tokens=1500, free_tokens=1000)  # half evicted
        0.51
        >>> round(m.switch_s(1000, demand_tokens=0, free_tokens=1000), 6)  # the last 8 tokens
        0.018
        """
        rate = self.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
        rate = _amount("prefill_tokens_per_s", rate, positive=True)
        p_evict = evict_probability(context_tokens, demand_tokens, free_tokens)
        return self._native.switch_s(p_evict, float(context_tokens), rate)

    def to_dict(self) -> dict[str, float]:
        """The parameters as a plain dict (accepted back by the constructor); ``block_size`` is
        an int, the others floats.

        >>> sorted(SwitchCostModel().to_dict())[:3]
        ['block_size', 'decode_step_s', 'kv_capacity_tokens']
        """
        return dict(self._native.params())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v:g}" for k, v in self.to_dict().items())
        return f"SwitchCostModel({inner})"


def evict_probability(context_tokens: float, demand_tokens: float, free_tokens: float) -> float:
    """Expected share of a paused request's KV evicted before it resumes:
    ``clamp((demand_tokens - free_tokens) / context_tokens, 0, 1)`` (LRU eviction keeps the
    newest blocks, i.e. the paused request's, until the older free KV is used up). Each count
    must be finite and ``>= 0`` (``InvalidValueError`` naming it otherwise).

    >>> evict_probability(1000, 1500, 1000)
    0.5
    """
    return _llmsched.evict_probability(
        _amount("context_tokens", context_tokens),
        _amount("demand_tokens", demand_tokens),
        _amount("free_tokens", free_tokens),
    )


def _amount(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite float ``>= 0`` (``> 0`` when ``positive``), else an error naming
    ``name``: NaN or a negative count gave a NaN or negative cost, a zero rate an infinite one.
    """
    check_number_like(name, value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int past float range
        number = math.inf
    if not (math.isfinite(number) and (number > 0 if positive else number >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise InvalidValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


class WaitingRequest(NamedTuple):
    """A request waiting for a batch slot, as the flow controller sees it.

    ``level`` is its slice level (a new request: :meth:`SliceTracker.entry_level`);
    ``context_tokens`` the KV it needs on admission; ``expected_tokens`` its expected remaining
    output (at least 1).

    >>> WaitingRequest(priority=0, level=0, context_tokens=100, expected_tokens=20)
    WaitingRequest(priority=0, level=0, context_tokens=100, expected_tokens=20)
    """

    priority: int
    level: int
    context_tokens: int
    expected_tokens: int


class SliceStart(NamedTuple):
    """The start of a slice: its level and token budget (``max_tokens`` of the call).

    >>> SliceStart(0, 512).slice_tokens
    512
    """

    level: int
    slice_tokens: int


def _check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an ``int`` in ``low..high``: an ``int`` or a numpy integer (what the native
    layer reads as one, as elsewhere: ``validation.check_index``), not a ``bool``."""
    if type(value) is not int:
        check_int_like(name, value)  # a numpy integer passes; a bool (numpy's too) does not
    number = operator.index(value)  # type: ignore[arg-type]
    if not low <= number <= high:
        raise InvalidValueError(f"{name} must be in {low}..{high}, got {value}")
    return number


def _explain_waiting(waiting: object) -> None:
    if isinstance(waiting, (str, bytes)) or not isinstance(waiting, Sequence):
        raise InvalidTypeError("waiting must be a sequence of WaitingRequest tuples")
    limits = [("priority", -_I32 - 1, _I32), ("level", 0, 255)]
    limits += [("context_tokens", 0, _U32), ("expected_tokens", 0, _U32)]
    for i, item in enumerate(waiting):
        if not isinstance(item, tuple) or len(item) != 4:
            raise InvalidTypeError(
                f"waiting[{i}] must be a WaitingRequest "
                "(priority, level, context_tokens, expected_tokens)"
            )
        for (field, low, high), value in zip(limits, item, strict=True):
            _check_int(f"waiting[{i}].{field}", value, low, high)


class SliceTracker:
    """Per-request slice budgets and the slice-boundary decision (Rust core, one lock; safe to
    share across threads).

    ``policy`` names a registered policy (:func:`policy_names`): ``"fixed"``
    (``slice_tokens``) or ``"mlfq"`` (``base_quantum``, ``levels``, ``join_ratio``,
    ``promote_after_s``): skip-join entry level from the prompt length, quantum doubling per
    level, demotion after a used quantum, promotion of paused requests that waited
    ``promote_after_s``. ``params`` are decoded over the policy's defaults; unknown names raise
    :class:`~llmsched.errors.ConfigError`.

    At each boundary :meth:`decide` returns a :class:`SliceDecision` whose ``action`` is
    ``"continue"``, ``"yield"`` (the continuation re-enters flow control at
    ``(priority, level)`` and is routed with affinity to ``endpoint``, which holds its KV),
    ``"migrate"`` (route the continuation to ``endpoint``, which recomputes) or ``"finish"``.
    With nobody waiting it always continues.

    >>> t = SliceTracker("mlfq", {"base_quantum": 8, "levels": 3}, endpoints=["a"])
    >>> t.admit(7, prompt_tokens=20, max_tokens=100, endpoint="a")
    SliceStart(level=0, slice_tokens=8)
    >>> _ = t.record_tokens(7, 8)
    >>> short = WaitingRequest(priority=0, level=0, context_tokens=30, expected_tokens=2)
    >>> d = t.decide(7, waiting=[short], now=1.0)
    >>> d.action, d.level, d.endpoint, d.next_slice_tokens
    ('yield', 1, 'a', 16)
    >>> t.resume(7, endpoint="a")
    SliceStart(level=1, slice_tokens=16)
    """

    __slots__ = ("_cost_model", "_native")

    def __init__(
        self,
        policy: str = "mlfq",
        params: Mapping[str, Any] | None = None,
        *,
        cost_model: SwitchCostModel | None = None,
        endpoints: Iterable[str] = (),
    ) -> None:
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a name, got {type(policy).__name__}")
        self._cost_model = SwitchCostModel() if cost_model is None else cost_model
        if not isinstance(self._cost_model, SwitchCostModel):
            raise ConfigError("cost_model must be a SwitchCostModel")
        native = _llmsched.SliceTracker(
            policy, _params(params, f"params of policy {policy}"), self._cost_model._native
        )
        names = (
            [endpoints] if isinstance(endpoints, str) else check_iterable("endpoints", endpoints)
        )
        for i, name in enumerate(names):
            native.set_endpoint(_endpoint_name(name, f"endpoints[{i}]"), 0.0, 0)
        self._native = native

    @property
    def policy(self) -> str:
        """The policy's registry name."""
        return self._native.policy_name

    @property
    def params(self) -> dict[str, Any]:
        """The policy parameters in effect (defaults filled in)."""
        return dict(self._native.policy_params())

    @property
    def levels(self) -> int:
        """Number of levels (1 for ``fixed``)."""
        return self._native.levels

    @property
    def cost_model(self) -> SwitchCostModel:
        """The switch-cost model."""
        return self._cost_model

    def quantum(self, level: int) -> int:
        """Slice length (tokens) at ``level``.

        >>> SliceTracker("mlfq", {"base_quantum": 100}).quantum(2)
        400
        """
        _check_int("level", level, 0, 255)
        return self._native.quantum(level)

    def entry_level(self, prompt_tokens: int) -> int:
        """The level a new request enters at (the flow controller's key for it).

        >>> SliceTracker("mlfq", {"base_quantum": 100, "join_ratio": 10}).entry_level(1500)
        1
        """
        _check_int("prompt_tokens", prompt_tokens, 0, _U32)
        return self._native.entry_level(prompt_tokens)

    def set_endpoint(
        self,
        name: str,
        *,
        kv_cache_usage: float = 0.0,
        waiting: int = 0,
        kv_capacity_tokens: float | None = None,
        prefill_tokens_per_s: float | None = None,
        decode_step_s: float | None = None,
    ) -> None:
        """Add endpoint ``name`` or update its load. ``kv_cache_usage`` is the used share of its KV
        cache (vLLM ``vllm:kv_cache_usage_perc``), ``waiting`` its queue length
        (``vllm:num_requests_waiting``). Fields left None keep their previous value (the cost
        model's for a new endpoint).

        >>> t = SliceTracker("fixed")
        >>> t.set_endpoint("a", kv_cache_usage=0.25, kv_capacity_tokens=1000)
        >>> t.endpoint_load("a").kv_free_tokens
        750.0
        """
        _check_int("waiting", waiting, 0, _U32)
        check_number_like("kv_cache_usage", kv_cache_usage)
        for field_name, value in (
            ("kv_capacity_tokens", kv_capacity_tokens),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
            ("decode_step_s", decode_step_s),
        ):
            if is_bool(value):  # the native side would read it as 0.0 or 1.0
                check_number_like(field_name, value)
        try:
            self._native.set_endpoint(
                _endpoint_name(name),
                float(kv_cache_usage),
                waiting,
                kv_capacity_tokens,
                prefill_tokens_per_s,
                decode_step_s,
            )
        except (TypeError, OverflowError):  # OverflowError: an int beyond a float's range
            for field_name, value in (
                ("kv_capacity_tokens", kv_capacity_tokens),
                ("prefill_tokens_per_s", prefill_tokens_per_s),
                ("decode_step_s", decode_step_s),
            ):
                check_number_like(field_name, value, optional=True)
            raise

    def endpoint_load(self, name: str) -> EndpointLoad | None:
        """The last load of endpoint ``name``, or None if unknown."""
        return self._native.endpoint_load(_endpoint_name(name))

    def remove_endpoint(self, name: str) -> bool:
        """Takes endpoint ``name`` out: it left the engine set, or routing (drained, down, its
        breaker open). It is no migration target any more, whatever load it last reported,
        and is not listed in :attr:`endpoints`; requests whose slices ran there keep it.
        :meth:`set_endpoint` brings it back with a fresh load. False when it was unknown or
        already out.

        >>> t = SliceTracker("fixed", endpoints=["a", "b"])
        >>> t.remove_endpoint("b"), t.remove_endpoint("b"), t.endpoints
        (True, False, ['a'])
        >>> t.set_endpoint("b")
        >>> t.endpoints
        ['a', 'b']
        """
        return self._native.remove_endpoint(_endpoint_name(name, "name"))

    @property
    def endpoints(self) -> list[str]:
        """Known endpoint names (those taken out left out), in the order they were first
        reported."""
        return self._native.endpoint_names()

    def admit(
        self,
        request_id: int,
        *,
        prompt_tokens: int,
        max_tokens: int,
        endpoint: str,
        priority: int = 0,
    ) -> SliceStart:
        """Start tracking a request whose first slice runs on ``endpoint``. The counts and ids
        are ints (numpy integers too, as everywhere the tracker takes an int; not bools).

        Raises :class:`~llmsched.errors.SliceStateError` if already tracked and
        :class:`~llmsched.errors.UnknownWorkerError` for an unknown endpoint.
        """
        level, slice_tokens = self._native.admit(
            _check_int("request_id", request_id, 0, _U64),
            _check_int("prompt_tokens", prompt_tokens, 0, _U32),
            _check_int("max_tokens", max_tokens, 1, _U32),
            _check_int("priority", priority, -_I32 - 1, _I32),
            _endpoint_name(endpoint),
        )
        return SliceStart(level, slice_tokens)

    def record_tokens(self, request_id: int, tokens: int) -> int:
        """Count ``tokens`` generated in the current slice; returns the tokens left in it.

        More than are left raises :class:`~llmsched.errors.SliceStateError`.
        """
        if type(request_id) is not int or type(tokens) is not int:  # a bool: 0 or 1 natively
            request_id = _check_int("request_id", request_id, 0, _U64)
            tokens = _check_int("tokens", tokens, 0, _U32)
        try:
            return self._native.record_tokens(request_id, tokens)
        except (OverflowError, TypeError):
            _check_int("request_id", request_id, 0, _U64)
            _check_int("tokens", tokens, 0, _U32)
            raise

    def decide(
        self,
        request_id: int,
        *,
        finished: bool = False,
        waiting: Sequence[WaitingRequest] = (),
        now: float | None = None,
    ) -> SliceDecision:
        """The decision at a slice boundary (the slice's budget used up, or ``finished``: end of
        sequence or a stop string). ``waiting`` lists the requests a yield would let through, in
        dispatch order. ``now`` (seconds; default ``time.monotonic()``) stamps a pause.

        Mid-slice raises :class:`~llmsched.errors.SliceStateError`; nothing changes on error.
        """
        now = check_now(now)
        if is_bool(request_id):  # the native side would decide for request 0 or 1
            _check_int("request_id", request_id, 0, _U64)
        try:
            return self._native.decide(request_id, finished, waiting, now)
        except (OverflowError, TypeError, ValueError):
            # Name the offending argument when extraction failed; else re-raise as is.
            _check_int("request_id", request_id, 0, _U64)
            _explain_waiting(waiting)
            check_bool("finished", finished)
            raise

    def resume(self, request_id: int, *, endpoint: str) -> SliceStart:
        """Start the next slice of a paused request on ``endpoint`` (where it was routed)."""
        _check_int("request_id", request_id, 0, _U64)
        level, slice_tokens = self._native.resume(request_id, _endpoint_name(endpoint))
        return SliceStart(level, slice_tokens)

    def promote(self, now: float | None = None) -> list[tuple[int, int]]:
        """Promote paused requests that waited ``promote_after_s`` (mlfq) to level 0; returns
        ``(request_id, new_level)`` pairs sorted by id so a flow controller can re-key them.
        Call it periodically.

        >>> SliceTracker("mlfq").promote(now=0.0)
        []
        """
        return self._native.promote(check_now(now))

    def remove(self, request_id: int) -> bool:
        """Stop tracking a request (cancelled or failed); returns whether it was tracked."""
        _check_int("request_id", request_id, 0, _U64)
        return self._native.remove(request_id)

    def state(self, request_id: int) -> SliceState | None:
        """A snapshot of a tracked request, or None.

        >>> t = SliceTracker("fixed", endpoints=["a"])
        >>> _ = t.admit(3, prompt_tokens=5, max_tokens=9, endpoint="a")
        >>> s = t.state(3)
        >>> s.phase, s.slice_tokens, s.context_tokens
        ('running', 9, 5)
        """
        _check_int("request_id", request_id, 0, _U64)
        return self._native.state(request_id)

    def __len__(self) -> int:
        return len(self._native)

    def __contains__(self, request_id: object) -> bool:
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            return False
        return 0 <= request_id <= _U64 and request_id in self._native

    def __repr__(self) -> str:
        return f"SliceTracker({self.policy!r}, {self.params!r}, tracked={len(self)})"


def _endpoint_name(name: object, what: str = "endpoint") -> str:
    return check_utf8(what, name)


# --------------------------------------------------------------------------------------------
# Response assembly
# --------------------------------------------------------------------------------------------


class SliceUsage(NamedTuple):
    """Token usage of a sliced response.

    ``prompt_tokens`` is the user's prompt, counted once; ``resent_prompt_tokens`` the prompt
    tokens of continuation slices beyond the user's (prompt + output so far, sent again);
    ``recomputed_prompt_tokens`` those of them the engine had to prefill again (resent minus
    its reported prefix-cache hits; equal to resent when it reports none).

    >>> SliceUsage(10, 5, 15, 2, 5, 0).as_openai()["slice_details"]["slices"]
    2
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    slices: int
    resent_prompt_tokens: int
    recomputed_prompt_tokens: int

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object, with the slice figures under ``slice_details``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "slice_details": {
                "slices": self.slices,
                "resent_prompt_tokens": self.resent_prompt_tokens,
                "recomputed_prompt_tokens": self.recomputed_prompt_tokens,
            },
        }


class SliceAssembler:
    """Cut one OpenAI-style request into slices and stitch their streams back into one.

    ``api="completions"`` takes a ``/v1/completions`` body whose ``prompt`` is a string or a
    list of token ids; ``api="chat"`` a ``/v1/chat/completions`` body. For each slice,
    :meth:`next_request` builds the engine call: the prompt plus everything generated so far,
    ``max_tokens = min(slice_tokens, remaining)``, ``stream=True`` with
    ``stream_options.include_usage`` (the slice's token count comes from its usage). The vLLM
    parameters it relies on:

    - completions with token ids: ``return_token_ids=True`` (the continuation appends the
      generated ids exactly; a text prompt is re-tokenised with its output, which may split
      differently);
    - chat: the output so far becomes a final assistant message, continued with
      ``continue_final_message=True, add_generation_prompt=False``;
    - ``min_tokens`` is reduced by the tokens already generated; ``stop`` is forwarded
      (``forward_stop``) so the engine stops early inside a slice, and the assembler also finds
      stop strings that straddle a boundary: it holds back the last ``max(len(stop)) - 1``
      characters until the next text (or the end) resolves them. A response ends before the
      stop occurrence that ends first (ties: the stop listed first), or after it with
      ``include_stop_str_in_output``. As vLLM checks stop strings only once ``min_tokens``
      are generated, an occurrence counts only where it ends after the text of the first
      ``min_tokens`` tokens; with stop strings, the call reaching ``min_tokens`` is cut short
      there (:attr:`last_slice_tokens` below the slice, :attr:`done` False: call
      :meth:`next_request` for the rest of the tracker's slice, which
      :meth:`SliceTracker.record_tokens` returns, before its boundary decision). A
      ``min_tokens`` that is not an int in ``0..=max_tokens`` is not sliced.

    Feed each engine chunk (decoded JSON) to :meth:`feed` and call :meth:`end_slice` when the
    engine stream ends; both return the user-facing chunks (OpenAI streaming shape, one id,
    index 0). :attr:`done` says whether the response is complete; :attr:`last_slice_tokens`
    is what to pass to :meth:`SliceTracker.record_tokens`. Sampled (non-greedy) slicing is
    equivalent in distribution, not token for token: an int ``seed`` goes to the first slice
    as given and to each continuation as a seed derived from it and the tokens generated so
    far (vLLM seeds a generator per request, so the user's seed on every slice would replay
    the first slice's draws at each slice start); ``n``, ``best_of``, ``echo``,
    ``logprobs``, ``truncate_prompt_tokens``, structured output, tool calling and
    ``continuous_usage_stats`` are not supported across slices (see docs/slices.md). Text
    positions count characters. The assembly runs in Rust
    (``llmsched_core::slices::assembler``), the one implementation the native data plane runs
    too; dicts cross as plain JSON data.

    >>> asm = SliceAssembler({"model": "m", "prompt": [1, 2], "max_tokens": 3}, response_id="r")
    >>> asm.next_request(2)["max_tokens"], asm.next_request(2)["prompt"]
    (2, [1, 2])
    >>> chunk = {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
    ...                       "finish_reason": "length"}]}
    >>> [c["choices"][0]["text"] for c in asm.feed(chunk)]
    ['ab']
    >>> _ = asm.end_slice(); asm.done, asm.next_request(2)["prompt"]
    (False, [1, 2, 5, 6])
    """

    __slots__ = ("_api", "_native")

    def __init__(
        self,
        request: Mapping[str, Any],
        *,
        api: Literal["completions", "chat"] = "completions",
        response_id: str | None = None,
        created: int | None = None,
        default_max_tokens: int | None = None,
        forward_stop: bool = True,
    ) -> None:
        if not isinstance(request, Mapping):
            raise ConfigError(f"request must be a mapping, got {type(request).__name__}")
        if api not in ("completions", "chat"):
            raise ConfigError(f"api must be 'completions' or 'chat', got {api!r}")
        if response_id is not None and not isinstance(response_id, str):
            raise InvalidTypeError(f"response_id must be a str, got {type(response_id).__name__}")
        if created is not None:
            created = _check_int("created", created, -(2**63), 2**63 - 1)
        if default_max_tokens is not None:
            default_max_tokens = _check_int("default_max_tokens", default_max_tokens, 0, _U64)
        self._api: Literal["completions", "chat"] = api
        self._native = _llmsched.SliceAssembler(
            dict(request), api, response_id, created, default_max_tokens, bool(forward_stop)
        )

    @property
    def api(self) -> Literal["completions", "chat"]:
        """Which API the request belongs to."""
        return self._api

    @property
    def done(self) -> bool:
        """Whether the response is complete (no further slice is needed)."""
        return self._native.done

    @property
    def finish_reason(self) -> str | None:
        """``"stop"`` or ``"length"`` (or the engine's other reason) once done."""
        return self._native.finish_reason

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the response, if one did. (A stop token id that ended
        it is the ``stop_reason`` of the final chunk and of :meth:`response`, as vLLM gives
        it, not this.)"""
        return self._native.stop_reason

    @property
    def generated_tokens(self) -> int:
        """Output tokens generated over all slices."""
        return self._native.generated_tokens

    @property
    def produced_tokens(self) -> int:
        """Output tokens the engine produced so far: :attr:`generated_tokens` and what it
        streamed of the slice in progress (its token ids, its usage, else one token per
        streamed choice, as the gateway counts an unsliced stream). What a client leaving
        mid-slice is charged.

        >>> asm = SliceAssembler({"prompt": [1], "max_tokens": 8})
        >>> _ = asm.next_request(4)
        >>> _ = asm.feed({"choices": [{"index": 0, "text": "a", "token_ids": [5]}]})
        >>> asm.generated_tokens, asm.produced_tokens
        (0, 1)
        """
        return self._native.produced_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """Output token ids over all slices, when the engine returned them."""
        return self._native.generated_token_ids

    @property
    def remaining_tokens(self) -> int:
        """Output tokens the user's budget still allows."""
        return self._native.remaining_tokens

    @property
    def text(self) -> str:
        """The response text released to the user so far."""
        return self._native.text

    @property
    def last_slice_tokens(self) -> int:
        """Tokens the engine generated in the slice just ended (for ``record_tokens``)."""
        return self._native.last_slice_tokens

    @property
    def usage(self) -> SliceUsage:
        """Usage so far: the user's prompt once, re-sent and recomputed prompts apart."""
        return SliceUsage(*self._native.usage)

    def next_request(self, slice_tokens: int) -> dict[str, Any]:
        """The engine request for the next slice of at most ``slice_tokens`` tokens.

        Building it twice before feeding gives the same request.
        """
        if not self._native.done:
            slice_tokens = _check_int("slice_tokens", slice_tokens, 1, _U32)
        return self._native.next_request(slice_tokens)

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Take one streamed engine chunk of the current slice; returns user-facing chunks.

        A chunk that is not a mapping raises TypeError; one with a choice index other than 0
        or token ids that are not ids raises ValueError (nothing is taken from it).
        """
        if not isinstance(chunk, Mapping):
            raise InvalidTypeError(f"chunk must be a mapping, got {type(chunk).__name__}")
        return self._native.feed(dict(chunk))

    def end_slice(self) -> list[dict[str, Any]]:
        """Close the current slice when the engine stream ends; returns the final user chunks if
        the response is complete (finish chunk, then a usage chunk if the user asked for
        ``stream_options.include_usage``), else nothing (text near the boundary stays held)."""
        return self._native.end_slice()

    def response(self) -> dict[str, Any]:
        """The complete non-streaming response (OpenAI shape) once :attr:`done`."""
        return self._native.response()

    def __repr__(self) -> str:
        return f"SliceAssembler(generated_tokens={self.generated_tokens}, done={self.done})"


def _cost_model_from(params: dict[str, float]) -> SwitchCostModel:
    """The model of these parameters: what a pickled or copied :class:`SwitchCostModel` is
    rebuilt with (its constructor takes them as keywords, which a reduction cannot pass)."""
    return SwitchCostModel(**params)


def _reduce_cost_model(
    model: SwitchCostModel,
) -> tuple[Callable[[dict[str, float]], SwitchCostModel], tuple[dict[str, float]]]:
    return _cost_model_from, (model.to_dict(),)


by_value(SwitchCostModel, _reduce_cost_model)
by_default(WaitingRequest, SliceStart, SliceUsage)
refuse(
    SliceTracker,
    "build a SliceTracker per process from its policy, params() and cost_model()",
    name="llmsched.SliceTracker",
)
refuse(
    SliceAssembler,
    "assemble each response in the process that serves it",
    name="llmsched.SliceAssembler",
)
