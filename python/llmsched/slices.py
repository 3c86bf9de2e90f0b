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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from llmsched import _llmsched
from llmsched._llmsched import EndpointLoad, SliceDecision, SliceState
from llmsched.errors import ConfigError, SliceStateError
from llmsched.validation import check_now

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
    return dict(_llmsched.slice_policy_defaults(name))


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
    """What ending a slice costs: ``p_evict * context / prefill_tokens_per_s + requeue_delay_s``.

    Parameters (defaults: Llama-3-8B on one H100 SXM, derived once in Rust):
    ``prefill_tokens_per_s`` (recompute rate), ``decode_step_s`` (seconds per decode step),
    ``kv_capacity_tokens`` (KV cache size of an endpoint), ``requeue_delay_s`` (fixed cost of
    sending the next slice) and ``priority_base`` (a request of priority ``p`` weighs
    ``priority_base ** p``). Unknown names raise :class:`~llmsched.errors.ConfigError`.

    >>> model = SwitchCostModel(decode_step_s=0.02)
    >>> model.decode_step_s
    0.02
    >>> round(1e6 / model.prefill_tokens_per_s, 1)  # us per token of context (8B, H100)
    32.5
    """

    __slots__ = ("_native",)

    def __init__(self, **params: float) -> None:
        self._native = _llmsched.SwitchCostModel(_params(params, "cost model"))

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
    ) -> SwitchCostModel:
        """Derive the model from model dimensions and GPU numbers.

        - ``prefill_tokens_per_s = gpu_flops * compute_efficiency / (2 * params)``;
        - KV bytes/token ``= 2 * layers * kv_heads * head_dim * dtype_bytes`` and
          ``kv_capacity_tokens = (gpu_memory_bytes * memory_fraction - params * dtype_bytes)
          / kv_bytes_per_token``;
        - ``decode_step_s = params * dtype_bytes / (gpu_hbm_bytes_per_s * bandwidth_efficiency)``.

        GPU numbers left out are an H100 SXM's; efficiencies 0.5 (compute), 0.7 (bandwidth),
        memory fraction 0.9.

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
        }
        dims = {k: v for k, v in dims.items() if v is not None}
        for name, value in model.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"cost model dims: {name} must be a positive number, got {value}")
        self = cls.__new__(cls)
        self._native = _llmsched.SwitchCostModel.from_dims(_params(dims, "cost dims"))
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

    def weight(self, priority: int) -> float:
        """``priority_base ** priority``.

        >>> SwitchCostModel().weight(2)
        4.0
        """
        return self._native.weight(priority)

    def recompute_s(
        self, context_tokens: float, prefill_tokens_per_s: float | None = None
    ) -> float:
        """Seconds to recompute ``context_tokens`` of KV (default rate: this model's).

        >>> SwitchCostModel(prefill_tokens_per_s=1000).recompute_s(500)
        0.5
        """
        rate = self.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
        return self._native.recompute_s(context_tokens, rate)

    def switch_s(
        self,
        context_tokens: float,
        *,
        demand_tokens: float,
        free_tokens: float,
        prefill_tokens_per_s: float | None = None,
    ) -> float:
        """Expected seconds a switch costs a request with ``context_tokens`` of KV when the work
        admitted meanwhile needs ``demand_tokens`` and the endpoint has ``free_tokens``.

        >>> m = SwitchCostModel(prefill_tokens_per_s=1000, requeue_delay_s=0.01)
        >>> m.switch_s(1000, demand_tokens=1500, free_tokens=1000)  # half evicted
        0.51
        """
        rate = self.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
        p_evict = evict_probability(context_tokens, demand_tokens, free_tokens)
        return self._native.switch_s(p_evict, context_tokens, rate)

    def to_dict(self) -> dict[str, float]:
        """The parameters as a plain dict (accepted back by the constructor).

        >>> sorted(SwitchCostModel().to_dict())[:2]
        ['decode_step_s', 'kv_capacity_tokens']
        """
        return dict(self._native.params())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v:g}" for k, v in self.to_dict().items())
        return f"SwitchCostModel({inner})"


def evict_probability(context_tokens: float, demand_tokens: float, free_tokens: float) -> float:
    """Expected share of a paused request's KV evicted before it resumes:
    ``clamp((demand_tokens - free_tokens) / context_tokens, 0, 1)`` (LRU eviction keeps the
    newest blocks, i.e. the paused request's, until the older free KV is used up).

    >>> evict_probability(1000, 1500, 1000)
    0.5
    """
    return _llmsched.evict_probability(context_tokens, demand_tokens, free_tokens)


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


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")


def _explain_waiting(waiting: object) -> None:
    if isinstance(waiting, (str, bytes)) or not isinstance(waiting, Sequence):
        raise TypeError("waiting must be a sequence of WaitingRequest tuples")
    limits = [("priority", -_I32 - 1, _I32), ("level", 0, 255)]
    limits += [("context_tokens", 0, _U32), ("expected_tokens", 0, _U32)]
    for i, item in enumerate(waiting):
        if not isinstance(item, tuple) or len(item) != 4:
            raise TypeError(
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
            policy, _params(params, f"policy {policy}"), self._cost_model._native
        )
        for name in [endpoints] if isinstance(endpoints, str) else endpoints:
            native.set_endpoint(_endpoint_name(name), 0.0, 0)
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
        self._native.set_endpoint(
            _endpoint_name(name),
            float(kv_cache_usage),
            waiting,
            kv_capacity_tokens,
            prefill_tokens_per_s,
            decode_step_s,
        )

    def endpoint_load(self, name: str) -> EndpointLoad | None:
        """The last load of endpoint ``name``, or None if unknown."""
        return self._native.endpoint_load(_endpoint_name(name))

    @property
    def endpoints(self) -> list[str]:
        """Known endpoint names, in the order they were first reported."""
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
        """Start tracking a request whose first slice runs on ``endpoint``.

        Raises :class:`~llmsched.errors.SliceStateError` if already tracked and
        :class:`~llmsched.errors.UnknownWorkerError` for an unknown endpoint.
        """
        _check_int("request_id", request_id, 0, _U64)
        _check_int("prompt_tokens", prompt_tokens, 0, _U32)
        _check_int("max_tokens", max_tokens, 1, _U32)
        _check_int("priority", priority, -_I32 - 1, _I32)
        level, slice_tokens = self._native.admit(
            request_id, prompt_tokens, max_tokens, priority, _endpoint_name(endpoint)
        )
        return SliceStart(level, slice_tokens)

    def record_tokens(self, request_id: int, tokens: int) -> int:
        """Count ``tokens`` generated in the current slice; returns the tokens left in it.

        More than are left raises :class:`~llmsched.errors.SliceStateError`.
        """
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
        try:
            return self._native.decide(request_id, finished, waiting, now)
        except (OverflowError, TypeError, ValueError):
            # Name the offending argument when extraction failed; else re-raise as is.
            _check_int("request_id", request_id, 0, _U64)
            _explain_waiting(waiting)
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


def _endpoint_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"endpoint must be a str, got {type(name).__name__}")
    return name


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


_UNSUPPORTED = ("echo", "logprobs", "top_logprobs", "suffix")


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
      ``include_stop_str_in_output``.

    Feed each engine chunk (decoded JSON) to :meth:`feed` and call :meth:`end_slice` when the
    engine stream ends; both return the user-facing chunks (OpenAI streaming shape, one id,
    index 0). :attr:`done` says whether the response is complete; :attr:`last_slice_tokens`
    is what to pass to :meth:`SliceTracker.record_tokens`. Sampled (non-greedy) slicing is
    equivalent in distribution, not token for token; ``n``, ``best_of``, ``echo`` and
    ``logprobs`` are not supported across slices.

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
        self._api = api
        self._request = dict(request)
        self._check_supported()
        self._prompt_ids: list[int] | None = None
        self._prompt_text: str | None = None
        self._messages: list[dict[str, Any]] = []
        if api == "completions":
            self._read_prompt()
        else:
            self._read_messages()
        self._max_tokens = self._read_budget(default_max_tokens)
        self._stops = self._read_stops()
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = bool(self._request.get("include_stop_str_in_output", False))
        self._forward_stop = forward_stop
        self._include_usage = bool((self._request.get("stream_options") or {}).get("include_usage"))
        self._id = response_id
        self._created = created
        self._model = self._request.get("model")
        # Progress.
        self._generated_ids: list[int] = []
        self._text = ""  # everything generated, as the engine produced it
        self._emitted = 0  # characters of _text sent to the user
        self._scanned = 0  # no stop string ends before this index of _text
        self._generated_tokens = 0
        self._slices = 0
        self._user_prompt_tokens: int | None = None
        self._resent = 0
        self._recomputed = 0
        self._finish_reason: str | None = None
        self._stop_reason: str | None = None
        self._sent_role = False
        self._in_slice = False
        self._slice_max = 0
        self._slice_resent = 0
        self._slice_ids: list[int] = []
        self._slice_usage: Mapping[str, Any] | None = None
        self._slice_finish: str | None = None
        self._slice_stop_reason: Any = None
        self.last_slice_tokens = 0
        """Tokens the engine generated in the slice just ended (for ``record_tokens``)."""

    # -- reading the request ---------------------------------------------------------------

    def _check_supported(self) -> None:
        r = self._request
        for name in ("n", "best_of"):
            if r.get(name, 1) not in (None, 1):
                raise ConfigError(f"{name}={r[name]!r} is not supported across slices (use 1)")
        for name in _UNSUPPORTED:
            if r.get(name) not in (None, False):
                raise ConfigError(f"{name} is not supported across slices")

    def _read_prompt(self) -> None:
        prompt = self._request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._prompt_text = prompt
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _U32 for t in prompt
        ):
            self._prompt_ids = list(prompt)
            self._user_prompt_tokens = len(prompt)
        else:
            raise ConfigError(
                "prompt must be one string or one list of token ids (0..2**32-1); "
                "batched prompts are not sliced"
            )

    def _read_messages(self) -> None:
        messages = self._request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ConfigError(f"messages[{i}] must be a mapping with a role")
        last = messages[-1]
        if self._request.get("continue_final_message") and not isinstance(last.get("content"), str):
            raise ConfigError("continue_final_message needs a final message with text content")
        self._messages = [dict(m) for m in messages]

    def _read_budget(self, default: int | None) -> int:
        keys = ("max_completion_tokens", "max_tokens") if self._api == "chat" else ("max_tokens",)
        budget = next((self._request[k] for k in keys if self._request.get(k) is not None), None)
        if budget is None:
            budget = default
        if budget is None:
            raise ConfigError(
                f"the request has no {' or '.join(keys)} and no default_max_tokens was given"
            )
        _check_int("max_tokens", budget, 1, _U32)
        return int(budget)

    def _read_stops(self) -> tuple[str, ...]:
        stop = self._request.get("stop")
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise ConfigError("stop must be a non-empty string or a list of them")
        return stops

    # -- progress ------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the response is complete (no further slice is needed)."""
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        """``"stop"`` or ``"length"`` (or the engine's other reason) once done."""
        return self._finish_reason

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the response, if one did."""
        return self._stop_reason

    @property
    def generated_tokens(self) -> int:
        """Output tokens generated over all slices."""
        return self._generated_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """Output token ids over all slices, when the engine returned them."""
        return list(self._generated_ids)

    @property
    def remaining_tokens(self) -> int:
        """Output tokens the user's budget still allows."""
        return self._max_tokens - self._generated_tokens

    @property
    def text(self) -> str:
        """The response text released to the user so far."""
        return self._text[: self._emitted]

    @property
    def usage(self) -> SliceUsage:
        """Usage so far: the user's prompt once, re-sent and recomputed prompts apart."""
        prompt = self._user_prompt_tokens or 0
        return SliceUsage(
            prompt_tokens=prompt,
            completion_tokens=self._generated_tokens,
            total_tokens=prompt + self._generated_tokens,
            slices=self._slices,
            resent_prompt_tokens=self._resent,
            recomputed_prompt_tokens=self._recomputed,
        )

    # -- building slice requests ------------------------------------------------------------

    def next_request(self, slice_tokens: int) -> dict[str, Any]:
        """The engine request for the next slice of at most ``slice_tokens`` tokens.

        Building it twice before feeding gives the same request.
        """
        if self.done:
            raise SliceStateError("the response is complete; no further slice")
        _check_int("slice_tokens", slice_tokens, 1, _U32)
        body = {k: v for k, v in self._request.items() if k not in ("max_completion_tokens",)}
        body["max_tokens"] = min(slice_tokens, self.remaining_tokens)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if not self._forward_stop:
            body.pop("stop", None)
        min_tokens = self._request.get("min_tokens")
        if min_tokens:
            body["min_tokens"] = min(
                max(0, min_tokens - self._generated_tokens), body["max_tokens"]
            )
        if self._api == "completions":
            if self._prompt_ids is not None:
                body["prompt"] = self._prompt_ids + self._generated_ids
                body["return_token_ids"] = True
            else:
                body["prompt"] = (self._prompt_text or "") + self._text
        elif self._generated_tokens > 0:
            body["messages"] = self._continued_messages()
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        self._slice_max = body["max_tokens"]
        self._slice_resent = len(self._generated_ids)
        self._in_slice = True
        self._slice_ids = []
        self._slice_usage = None
        self._slice_finish = None
        self._slice_stop_reason = None
        return body

    def _continued_messages(self) -> list[dict[str, Any]]:
        messages = [dict(m) for m in self._messages]
        if self._request.get("continue_final_message"):
            messages[-1]["content"] = messages[-1]["content"] + self._text
        else:
            messages.append({"role": "assistant", "content": self._text})
        return messages

    # -- stitching ---------------------------------------------------------------------------

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Take one streamed engine chunk of the current slice; returns user-facing chunks."""
        if not self._in_slice:
            raise SliceStateError("feed() before next_request() or after end_slice()")
        if not isinstance(chunk, Mapping):
            raise TypeError(f"chunk must be a mapping, got {type(chunk).__name__}")
        if self._id is None and isinstance(chunk.get("id"), str):
            self._id = chunk["id"]
        if self._created is None and isinstance(chunk.get("created"), int):
            self._created = chunk["created"]
        if self._model is None and isinstance(chunk.get("model"), str):
            self._model = chunk["model"]
        if chunk.get("usage"):
            self._slice_usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                raise ValueError("engine chunk has a choice index other than 0")
            ids = choice.get("token_ids")
            if ids:
                self._slice_ids.extend(ids)
            if choice.get("finish_reason") is not None:
                self._slice_finish = choice["finish_reason"]
                self._slice_stop_reason = choice.get("stop_reason")
            if self.done:
                continue  # a stop string already ended the response: drop the rest
            piece = self._choice_text(choice)
            if piece:
                self._text += piece
                out.extend(self._release(final=False))
        return out

    def _choice_text(self, choice: Mapping[str, Any]) -> str:
        if self._api == "completions":
            text = choice.get("text")
        else:
            text = (choice.get("delta") or {}).get("content")
        return text if isinstance(text, str) else ""

    def _release(self, *, final: bool) -> list[dict[str, Any]]:
        """Emit what is safe: up to a found stop string, or all but the held-back tail."""
        start = max(0, self._scanned - self._holdback)
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at >= 0 and (best is None or at + len(stop) < best[1]):
                best = (at, at + len(stop), stop)
        if best is not None:
            cut = best[1] if self._include_stop else best[0]
            chunks = self._emit_upto(cut)
            self._finish_reason, self._stop_reason = "stop", best[2]
            return chunks
        self._scanned = len(self._text)
        safe = len(self._text) if final else len(self._text) - self._holdback
        return self._emit_upto(safe)

    def _emit_upto(self, end: int) -> list[dict[str, Any]]:
        if end <= self._emitted:
            return []
        piece = self._text[self._emitted : end]
        self._emitted = end
        return [self._chunk(piece, None)]

    def end_slice(self) -> list[dict[str, Any]]:
        """Close the current slice when the engine stream ends; returns the final user chunks if
        the response is complete (finish chunk, then a usage chunk if the user asked for
        ``stream_options.include_usage``), else nothing (text near the boundary stays held)."""
        if not self._in_slice:
            raise SliceStateError("end_slice() without a slice in progress")
        tokens = self._slice_token_count()
        self._in_slice = False
        self.last_slice_tokens = tokens
        self._generated_tokens += tokens
        self._account_prompt()
        self._slices += 1
        out: list[dict[str, Any]] = []
        if not self.done:
            reason = self._slice_finish
            at_boundary = (
                reason == "length" and tokens == self._slice_max and self.remaining_tokens > 0
            )
            if at_boundary:
                return []
            if reason is None:
                raise SliceStateError("the engine stream ended without a finish_reason")
            out.extend(self._release(final=True))
            if not self.done:
                self._finish_reason = reason
                stop = self._slice_stop_reason
                self._stop_reason = stop if isinstance(stop, str) else None
        out.append(self._chunk("", self._finish_reason))
        if self._include_usage:
            out.append(self._usage_chunk())
        return out

    def _slice_token_count(self) -> int:
        usage = self._slice_usage
        if usage and isinstance(usage.get("completion_tokens"), int):
            count = int(usage["completion_tokens"])
        elif self._slice_ids or self.done:
            # After a stop string the caller may have cut the stream: count what came.
            count = len(self._slice_ids)
        else:
            raise SliceStateError(
                "the engine reported neither usage nor token ids for the slice; "
                "it must honour stream_options.include_usage"
            )
        if not 0 <= count <= self._slice_max:
            raise SliceStateError(
                f"the engine generated {count} tokens in a slice of {self._slice_max}"
            )
        ids_complete = len(self._slice_ids) == count
        if self._prompt_ids is not None and not self.done and not ids_complete:
            raise SliceStateError(
                f"the engine returned {len(self._slice_ids)} token ids for {count} tokens; "
                "token-id continuation needs return_token_ids"
            )
        if ids_complete or self.done:
            self._generated_ids.extend(self._slice_ids)
        return count

    def _account_prompt(self) -> None:
        usage = self._slice_usage or {}
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int):
            if self._prompt_ids is None:
                return
            prompt = len(self._prompt_ids) + self._slice_resent
        if self._user_prompt_tokens is None:
            self._user_prompt_tokens = prompt  # first slice: the user's prompt as tokenised
        resent = max(0, prompt - self._user_prompt_tokens)
        if self._slices == 0 or resent == 0:
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        self._resent += resent
        if isinstance(cached, int):
            self._recomputed += max(0, prompt - max(cached, self._user_prompt_tokens))
        else:
            self._recomputed += resent

    def _chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self._api == "completions":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            if not self._sent_role:
                delta = {"role": "assistant", **delta}
                self._sent_role = True
            choice = {"index": 0, "delta": delta, "logprobs": None}
            obj = "chat.completion.chunk"
        choice["finish_reason"] = finish_reason
        if finish_reason is not None and self._stop_reason is not None:
            choice["stop_reason"] = self._stop_reason
        return {**self._envelope(obj), "choices": [choice]}

    def _usage_chunk(self) -> dict[str, Any]:
        obj = "text_completion" if self._api == "completions" else "chat.completion.chunk"
        return {**self._envelope(obj), "choices": [], "usage": self.usage.as_openai()}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def response(self) -> dict[str, Any]:
        """The complete non-streaming response (OpenAI shape) once :attr:`done`."""
        if not self.done:
            raise SliceStateError("the response is not complete yet")
        if self._api == "completions":
            choice: dict[str, Any] = {"index": 0, "text": self.text, "logprobs": None}
            obj = "text_completion"
        else:
            message = {"role": "assistant", "content": self.text}
            choice, obj = {"index": 0, "message": message, "logprobs": None}, "chat.completion"
        choice["finish_reason"] = self._finish_reason
        choice["stop_reason"] = self._stop_reason
        return {**self._envelope(obj), "choices": [choice], "usage": self.usage.as_openai()}
