"""Pure-Python twin of :class:`llmsched.slices.SliceTracker` (oracle and benchmark baseline).

Same API as the native tracker's friendly wrapper, written as plainly as possible from the
formulas in ``crates/llmsched-core/src/slices/mod.rs``. Parameter defaults come from the native
module (they live in one place), the algorithm does not.

>>> t = SliceTracker("fixed", {"slice_tokens": 4}, endpoints=["a"])
>>> t.admit(1, prompt_tokens=3, max_tokens=6, endpoint="a")
SliceStart(level=0, slice_tokens=4)
>>> t.record_tokens(1, 4), t.decide(1, now=0.0).action
(0, 'continue')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmsched import _llmsched
from llmsched.errors import ConfigError, SliceStateError, UnknownRequestError, UnknownWorkerError
from llmsched.slices import SliceStart, SwitchCostModel, WaitingRequest


@dataclass(frozen=True)
class SliceDecision:
    """Same fields as the native ``SliceDecision``."""

    action: str
    level: int
    priority: int
    endpoint: str | None
    next_slice_tokens: int
    context_tokens: int
    generated_tokens: int
    slices: int
    benefit_s: float
    yield_cost_s: float
    migrate_cost_s: float | None
    evict_probability: float


@dataclass
class _Request:
    priority: int
    level: int
    prompt_tokens: int
    max_tokens: int
    generated_tokens: int = 0
    slice_generated: int = 0
    slice_tokens: int = 0
    slices: int = 1
    endpoint: str = ""
    route_to: str = ""
    phase: str = "running"
    paused_since: float | None = None

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


@dataclass
class _Endpoint:
    kv_capacity_tokens: float
    kv_usage: float
    waiting: int
    prefill_tokens_per_s: float
    decode_step_s: float

    @property
    def kv_free_tokens(self) -> float:
        return (1.0 - self.kv_usage) * self.kv_capacity_tokens


def _merge(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    merged = dict(_llmsched.slice_policy_defaults(name))
    for key, value in (params or {}).items():
        if key not in merged:
            raise ConfigError(f"bad policy {name} parameters: unknown field `{key}`")
        merged[key] = value
    return merged


class SliceTracker:
    """Naive twin of the native slice tracker (fixed and mlfq policies)."""

    def __init__(
        self,
        policy: str = "mlfq",
        params: Mapping[str, Any] | None = None,
        *,
        cost_model: SwitchCostModel | None = None,
        endpoints: Iterable[str] = (),
    ) -> None:
        if policy not in ("fixed", "mlfq"):
            raise ConfigError(f"unknown slice policy {policy!r}")
        self.policy = policy
        self.params = _merge(policy, params)
        self.cost = (cost_model or SwitchCostModel()).to_dict()
        self.requests: dict[int, _Request] = {}
        self.endpoint_loads: dict[str, _Endpoint] = {}
        for name in endpoints:
            self.set_endpoint(name)

    # -- policy ------------------------------------------------------------------------------

    @property
    def levels(self) -> int:
        return 1 if self.policy == "fixed" else int(self.params["levels"])

    def quantum(self, level: int) -> int:
        if self.policy == "fixed":
            return int(self.params["slice_tokens"])
        return int(self.params["base_quantum"]) << min(level, self.levels - 1)

    def entry_level(self, prompt_tokens: int) -> int:
        if self.policy == "fixed":
            return 0
        for level in range(self.levels):
            if prompt_tokens <= self.params["join_ratio"] * self.quantum(level):
                return level
        return self.levels - 1

    def _demoted(self, level: int) -> int:
        return 0 if self.policy == "fixed" else min(level + 1, self.levels - 1)

    def weight(self, priority: int) -> float:
        return math.pow(self.cost["priority_base"], float(priority))

    # -- endpoints ---------------------------------------------------------------------------

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
        old = self.endpoint_loads.get(name)
        base = old or _Endpoint(
            self.cost["kv_capacity_tokens"],
            0.0,
            0,
            self.cost["prefill_tokens_per_s"],
            self.cost["decode_step_s"],
        )
        new = _Endpoint(
            base.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens,
            kv_cache_usage,
            waiting,
            base.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s,
            base.decode_step_s if decode_step_s is None else decode_step_s,
        )
        if not 0.0 <= new.kv_usage <= 1.0:
            raise ValueError("invalid kv_cache_usage: must be in [0, 1]")
        for value in (new.kv_capacity_tokens, new.prefill_tokens_per_s, new.decode_step_s):
            if not (math.isfinite(value) and value > 0):
                raise ValueError("endpoint load must be positive and finite")
        self.endpoint_loads[name] = new

    @property
    def endpoints(self) -> list[str]:
        return list(self.endpoint_loads)

    # -- requests ----------------------------------------------------------------------------

    def _get(self, request_id: int) -> _Request:
        if request_id not in self.requests:
            raise UnknownRequestError(f"unknown request {request_id}")
        return self.requests[request_id]

    def _running(self, request_id: int) -> _Request:
        request = self._get(request_id)
        if request.phase != "running":
            raise SliceStateError(f"request {request_id} is paused")
        return request

    def admit(
        self,
        request_id: int,
        *,
        prompt_tokens: int,
        max_tokens: int,
        endpoint: str,
        priority: int = 0,
    ) -> SliceStart:
        if request_id in self.requests:
            raise SliceStateError(f"request {request_id} is already tracked")
        if max_tokens < 1:
            raise ValueError("invalid max_tokens")
        if endpoint not in self.endpoint_loads:
            raise UnknownWorkerError(endpoint)
        level = self.entry_level(prompt_tokens)
        budget = min(self.quantum(level), max_tokens)
        self.requests[request_id] = _Request(
            priority, level, prompt_tokens, max_tokens, 0, 0, budget, 1, endpoint, endpoint
        )
        return SliceStart(level, budget)

    def record_tokens(self, request_id: int, tokens: int) -> int:
        request = self._running(request_id)
        left = request.slice_tokens - request.slice_generated
        if tokens > left:
            raise SliceStateError(f"request {request_id}: {tokens} tokens exceed the {left} left")
        request.slice_generated += tokens
        request.generated_tokens += tokens
        return left - tokens

    def decide(
        self,
        request_id: int,
        *,
        finished: bool = False,
        waiting: Sequence[WaitingRequest] = (),
        now: float = 0.0,
    ) -> SliceDecision:
        for w in waiting:
            if w.level >= self.levels or w.expected_tokens < 1:
                raise ValueError("invalid waiting request")
        request = self._running(request_id)
        done = finished or request.generated_tokens >= request.max_tokens
        if not done and request.slice_generated < request.slice_tokens:
            raise SliceStateError(f"request {request_id} is not at a slice boundary")
        if done:
            del self.requests[request_id]
            return SliceDecision(
                "finish", request.level, request.priority, None, 0, request.context_tokens,
                request.generated_tokens, request.slices, 0.0, 0.0, None, 0.0,
            )  # fmt: skip
        level = self._demoted(request.level)
        remaining = request.max_tokens - request.generated_tokens
        next_slice = min(self.quantum(level), remaining)
        action, target, benefit, yield_cost, migrate_cost, p_evict = self._weigh(
            request, next_slice, waiting
        )
        decision = SliceDecision(
            action, level, request.priority, target, next_slice, request.context_tokens,
            request.generated_tokens, request.slices, benefit, yield_cost, migrate_cost, p_evict,
        )  # fmt: skip
        request.level = level
        request.slice_generated = 0
        request.slice_tokens = next_slice
        if action == "continue":
            request.slices += 1
        else:
            request.phase = "paused"
            request.paused_since = now
            request.route_to = target
        return decision

    def _weigh(
        self, request: _Request, next_slice: int, waiting: Sequence[WaitingRequest]
    ) -> tuple[str, str, float, float, float | None, float]:
        here = request.endpoint
        if not waiting:
            return "continue", here, 0.0, 0.0, None, 0.0
        load = self.endpoint_loads[here]
        x_r = float(next_slice)
        let_through, weights, demand = 0.0, 0.0, 0.0
        for i, w in enumerate(waiting):
            x_i = float(min(self.quantum(w.level), w.expected_tokens))
            if i > 0 and let_through + x_i > x_r:
                break
            let_through += x_i
            weights += self.weight(w.priority)
            demand += float(w.context_tokens) + x_i
        step = load.decode_step_s
        benefit = step * x_r * weights
        context = float(request.context_tokens)
        p_evict = (
            0.0 if context <= 0 else min(1.0, max(0.0, (demand - load.kv_free_tokens) / context))
        )
        w_r = self.weight(request.priority)
        # A continuation recomputes at least its last KV block (only full blocks are cached and
        # the last token is always computed); eviction takes the tail blocks first.
        block = float(self.cost["block_size"])
        tail = 0.0 if context <= 0 else context - math.floor((context - 1.0) / block) * block
        recompute = 0.0 if context <= 0 else min(context, max(p_evict * context, tail))
        switch = recompute / load.prefill_tokens_per_s + self.cost["requeue_delay_s"]
        yield_cost = w_r * (step * let_through + switch)
        best: tuple[str, float] | None = None
        for name, other in self.endpoint_loads.items():
            if name == here or other.waiting > 0 or other.kv_free_tokens < context + x_r:
                continue
            cost = w_r * (
                1.0 * (context / other.prefill_tokens_per_s) + self.cost["requeue_delay_s"]
            )
            if best is None or cost < best[1]:
                best = (name, cost)
        action, target, cost = "yield", here, yield_cost
        if best is not None and best[1] < yield_cost:
            action, target, cost = "migrate", best[0], best[1]
        if not benefit > cost:
            action, target = "continue", here
        return action, target, benefit, yield_cost, None if best is None else best[1], p_evict

    def resume(self, request_id: int, *, endpoint: str) -> SliceStart:
        if endpoint not in self.endpoint_loads:
            raise UnknownWorkerError(endpoint)
        request = self._get(request_id)
        if request.phase != "paused":
            raise SliceStateError(f"request {request_id} is running")
        request.phase, request.paused_since = "running", None
        request.endpoint = request.route_to = endpoint
        request.slices += 1
        request.slice_generated = 0
        remaining = request.max_tokens - request.generated_tokens
        request.slice_tokens = min(self.quantum(request.level), remaining)
        return SliceStart(request.level, request.slice_tokens)

    def promote(self, now: float = 0.0) -> list[tuple[int, int]]:
        if self.policy == "fixed":
            return []
        out = []
        for request_id, request in sorted(self.requests.items()):
            since = request.paused_since
            waited_enough = since is not None and now - since >= self.params["promote_after_s"]
            if request.phase == "paused" and request.level > 0 and waited_enough:
                request.level = 0
                remaining = request.max_tokens - request.generated_tokens
                request.slice_tokens = min(self.quantum(0), remaining)
                out.append((request_id, 0))
        return out

    def remove(self, request_id: int) -> bool:
        return self.requests.pop(request_id, None) is not None

    def state(self, request_id: int) -> dict[str, Any] | None:
        """A dict with the same keys as the native ``SliceState``'s attributes."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return {
            "priority": request.priority,
            "level": request.level,
            "prompt_tokens": request.prompt_tokens,
            "max_tokens": request.max_tokens,
            "generated_tokens": request.generated_tokens,
            "slice_generated": request.slice_generated,
            "slice_tokens": request.slice_tokens,
            "slices": request.slices,
            "context_tokens": request.context_tokens,
            "endpoint": request.endpoint,
            "route_to": request.route_to,
            "phase": request.phase,
            "paused_since": request.paused_since,
        }

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests
