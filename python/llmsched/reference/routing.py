"""Pure-Python twin of the routing decision, written for obviousness.

It is the oracle of the property tests (same scores and choice as the native router for
deterministic pickers) and the baseline of the benchmarks. It reads a configuration in the same
llm-d shape (a single profile, or ``pd-profile-handler`` / ``disagg-profile-handler`` with a
prefix-based, load-aware or always-disagg decider), endpoints as plain dataclasses, and the
cached blocks per endpoint from a prefix match.

The P/D step mirrors the native ``run_handler``: the decode profile runs; the decider wants a
prefill endpoint when the prompt tokens not cached on the decode endpoint are at least its
``nonCachedTokens``; the prefill profile then runs, and its pick splits the request unless it
found none (``no-prefill-endpoint``), it is the decode endpoint itself (``same-endpoint``), or
a load-aware decider finds its queue (waiting plus in-flight requests still prefilling,
infinite when saturated) longer than the decode endpoint's plus ``queueMargin``
(``prefill-queue-longer``). :class:`ReferencePd` lists every (prefill endpoint, reason) the
native decision may give when pickers tie.

>>> from llmsched.reference.routing import ReferenceEndpoint, decide
>>> config = {"plugins": [{"type": "queue-scorer"}],
...           "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "queue-scorer"}]}]}
>>> eps = [ReferenceEndpoint("a", waiting=3), ReferenceEndpoint("b", waiting=1)]
>>> decide(config, eps, cached={}, prompt_tokens=16, block_size=16).best
['b']
>>> import llmsched.routing
>>> pd = llmsched.routing.load_config("llm-d-pd")
>>> eps = [ReferenceEndpoint("d", role="decode"), ReferenceEndpoint("p", role="prefill")]
>>> decide(pd, eps, cached={}, prompt_tokens=512, block_size=16).pd
ReferencePd(uncached_tokens=512, wanted=True, choices=[('p', 'split')])
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmsched.reference.prefix_index import ReferencePrefixIndex

__all__ = ["ReferenceDecision", "ReferenceEndpoint", "ReferencePd", "decide", "decide_tokens"]


@dataclass
class ReferenceEndpoint:
    """An endpoint with its metrics and the router's in-flight counts."""

    id: Any
    role: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    saturated: bool = False
    metrics_age_s: float | None = 0.0
    """Seconds since its metrics were taken (None: never reported); only a
    ``utilization-detector`` with its own ``metricsStalenessThreshold`` reads it, the rest read
    ``saturated`` (the pool's staleness)."""
    in_flight_requests: int = 0
    in_flight_prefill_requests: int = 0
    in_flight_prefill_tokens: int = 0
    in_flight_tokens: int = 0


@dataclass
class ReferenceProfileRun:
    profile: str
    kept: list[Any]
    scores: dict[Any, dict[str, float]]
    totals: dict[Any, float]


@dataclass
class ReferencePd:
    """The P/D decision for one decode endpoint (the native ``Decision.pd()``)."""

    uncached_tokens: int
    """Prompt tokens not cached on the decode endpoint."""
    wanted: bool
    """Whether the decider asked for a prefill endpoint."""
    choices: list[tuple[Any, str]]
    """Every (prefill endpoint, reason) the native router may give: one per prefill pick the
    picker could make, the endpoint None unless the reason is ``"split"``."""


@dataclass
class ReferenceDecision:
    runs: list[ReferenceProfileRun]
    best: list[Any]
    """Every endpoint the picker could choose (several when tied)."""
    prefill_best: list[Any] | None = None
    """Every endpoint the prefill profile could choose, when it ran."""
    pd: ReferencePd | None = None
    """The P/D decision for ``decode_endpoint`` (default ``best[0]``), with a P/D handler
    whose prefill stage can run."""


@dataclass(frozen=True)
class _Decider:
    non_cached_tokens: int
    queue_margin: float | None
    """None: prefix-based (keeps every prefill pick); else load-aware."""

    def keeps(self, decode: ReferenceEndpoint, prefill: ReferenceEndpoint) -> bool:
        return self.queue_margin is None or _queue(prefill) <= _queue(decode) + self.queue_margin


def _queue(e: ReferenceEndpoint) -> float:
    return math.inf if e.saturated else float(e.waiting + e.in_flight_prefill_requests)


def _lower_is_better(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [(hi - v) / (hi - lo) if hi > lo else 1.0 for v in values]


Context = dict[str, Any]
Picker = tuple[str, Mapping[str, Any]]


def _score(
    kind: str, p: Mapping[str, Any], eps: list[ReferenceEndpoint], ctx: Context
) -> list[float]:
    cached = ctx["cached"]
    full = ctx["prompt_tokens"] // ctx["block_size"]
    if kind == "queue-scorer":
        return _lower_is_better([e.waiting for e in eps])
    if kind in ("running-requests-scorer", "running-requests-size-scorer"):
        return _lower_is_better([e.running for e in eps])
    if kind == "kv-cache-utilization-scorer":
        return [1.0 - e.kv_cache_usage for e in eps]
    if kind == "load-aware-scorer":
        t = p.get("threshold", 128)
        return [0.5 if e.waiting == 0 else 0.5 * (1 - min(e.waiting, t) / t) for e in eps]
    if kind == "active-request-scorer":
        idle = p.get("idleThreshold", 0)
        top = max(e.in_flight_requests for e in eps)
        return [
            1.0 if e.in_flight_requests <= idle or top == 0 else (top - e.in_flight_requests) / top
            for e in eps
        ]
    if kind == "token-load-scorer":
        t = p.get("queueThresholdTokens", 4_194_304)
        return [1 - min(1.0, e.in_flight_prefill_tokens / t) for e in eps]
    if kind == "prefix-cache-scorer":
        cap = p.get("maxPrefixBlocksToMatch", math.inf)
        total = min(full, cap)
        return [0.0 if total == 0 else min(cached.get(e.id, 0), cap) / total for e in eps]
    if kind == "session-affinity-scorer":
        return [1.0 if e.id == ctx.get("session_endpoint") else 0.0 for e in eps]
    raise NotImplementedError(kind)


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration_s(text: str) -> float:
    """A Go duration (``"200ms"``, ``"1m30s"``) in seconds.

    >>> _go_duration_s("1m30s"), _go_duration_s("50ms")
    (90.0, 0.05)
    """
    parts = re.findall(r"([0-9.]+)([a-z]+)", text)
    return sum(float(number) * _GO_UNITS[unit] for number, unit in parts)


def _filter(
    kind: str, p: Mapping[str, Any], eps: list[ReferenceEndpoint], ctx: Context
) -> tuple[list[bool], bool]:
    """Returns (keep flags, fail_open)."""
    if kind == "decode-filter":
        return [e.role != "prefill" for e in eps], False
    if kind == "prefill-filter":
        return [e.role in ("prefill", "both") for e in eps], False
    if kind == "utilization-filter":
        q = p.get("queueDepthThreshold", 5)
        kv = p.get("kvCacheUtilThreshold", 0.8)
        return [not e.saturated and e.waiting < q and e.kv_cache_usage < kv for e in eps], True
    if kind == "utilization-detector":
        # llm-d's detector as a filter: limits relaxed by headroom, compared as floats; stale
        # by its own threshold when given, else by the pool's.
        scale = 1.0 + p.get("headroom", 0.0)
        q_limit = p.get("queueDepthThreshold", 5) * scale
        kv_limit = p.get("kvCacheUtilThreshold", 0.8) * scale
        threshold = p.get("metricsStalenessThreshold")
        limit = None if threshold is None else _go_duration_s(threshold)
        return [
            not (
                e.saturated if limit is None else e.metrics_age_s is None or e.metrics_age_s > limit
            )
            and e.waiting < q_limit
            and e.kv_cache_usage < kv_limit
            for e in eps
        ], True
    if kind == "by-label":
        return [
            e.labels[p["label"]] in p.get("validValues", [])
            if p["label"] in e.labels
            else p.get("allowsNoLabel", False)
            for e in eps
        ], False
    raise NotImplementedError(kind)


def _run_profile(
    profile: Mapping[str, Any],
    plugins: dict[str, Any],
    eps: list[ReferenceEndpoint],
    ctx: Context,
) -> tuple[ReferenceProfileRun, list[Any]]:
    current = list(eps)
    scorers: list[tuple[str, str, Mapping[str, Any], float]] = []
    picker: Picker = ("max-score-picker", {})
    for ref in profile["plugins"]:
        plugin = plugins[ref["pluginRef"]]
        kind, params = plugin["type"], plugin.get("parameters") or {}
        if kind.endswith("-filter") or kind in ("by-label", "utilization-detector"):
            if not current:
                continue
            keep, fail_open = _filter(kind, params, current, ctx)
            if not any(keep) and fail_open:
                continue
            current = [e for e, k in zip(current, keep, strict=True) if k]
        elif kind.endswith("-picker"):
            picker = (kind, params)
        else:
            scorers.append((ref["pluginRef"], kind, params, ref.get("weight", 1.0)))
    scores: dict[Any, dict[str, float]] = {e.id: {} for e in current}
    totals = {e.id: 0.0 for e in current}
    for name, kind, params, weight in scorers:
        fresh = [e for e in current if not e.saturated] if _reads_metrics(kind) else current
        values = _score(kind, params, fresh, ctx) if fresh else []
        raw = dict(zip([e.id for e in fresh], values, strict=True))
        for e in current:
            s = raw.get(e.id, 0.0)
            s = 0.0 if math.isnan(s) else min(1.0, max(0.0, s))
            scores[e.id][name] = s
            totals[e.id] += s * weight
    run = ReferenceProfileRun(profile["name"], [e.id for e in current], scores, totals)
    return run, _best(picker, current, totals, ctx)


def _reads_metrics(kind: str) -> bool:
    return kind in (
        "queue-scorer",
        "running-requests-scorer",
        "running-requests-size-scorer",
        "kv-cache-utilization-scorer",
        "load-aware-scorer",
    )


def _best(
    picker: Picker, eps: list[ReferenceEndpoint], totals: dict[Any, float], ctx: Context
) -> list[Any]:
    if not eps:
        return []
    kind, params = picker
    if kind == "max-score-picker":
        top = max(totals.values())
        return [e.id for e in eps if totals[e.id] == top]
    if kind == "softmax-cost-picker" and params.get("temperature", 0.0) == 0.0:
        bs: int = ctx["block_size"]
        scale = float(params.get("prefillLoadScale", 1.0))

        def cost(e: ReferenceEndpoint) -> float:
            prompt: float = ctx["prompt_tokens"] / bs
            cached: int = ctx["cached"].get(e.id, 0)
            prefill = max(0.0, prompt - cached + e.in_flight_prefill_tokens / bs)
            return scale * prefill + e.in_flight_tokens / bs

        low = min(cost(e) for e in eps)
        return [e.id for e in eps if cost(e) == low]
    raise NotImplementedError(kind)


def decide(
    config: Mapping[str, Any],
    endpoints: Sequence[ReferenceEndpoint],
    cached: Mapping[Any, int],
    prompt_tokens: int,
    block_size: int,
    session_endpoint: Any = None,
    decode_endpoint: Any = None,
) -> ReferenceDecision:
    """The decision for a prompt of ``prompt_tokens`` tokens, ``cached[id]`` leading blocks of
    which endpoint ``id`` holds. With a P/D handler the P/D step follows ``decode_endpoint``,
    one of the tied decode picks (default the first), as the native router follows its own."""
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    profiles = {p["name"]: p for p in config["schedulingProfiles"]}
    ctx = {
        "cached": dict(cached),
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "session_endpoint": session_endpoint,
    }
    handler = next((p for p in config["plugins"] if p["type"] in _PD_HANDLERS), None)
    if handler is None:
        run, best = _run_profile(next(iter(profiles.values())), plugins, list(endpoints), ctx)
        return ReferenceDecision([run], best)
    decode, prefill, decider = _pd_stages(handler, plugins, profiles)
    decode_run, best = _run_profile(profiles[decode], plugins, list(endpoints), ctx)
    if prefill is None or decider is None or not best:
        return ReferenceDecision([decode_run], best)
    chosen = best[0] if decode_endpoint is None else decode_endpoint
    if chosen not in best:
        raise ValueError(f"decode_endpoint {chosen!r} is not among the decode picks {best}")
    uncached = prompt_tokens - min(prompt_tokens, ctx["cached"].get(chosen, 0) * block_size)
    if uncached < decider.non_cached_tokens:
        pd = ReferencePd(uncached, False, [(None, "below-threshold")])
        return ReferenceDecision([decode_run], best, pd=pd)
    prefill_run, prefill_best = _run_profile(profiles[prefill], plugins, list(endpoints), ctx)
    by_id = {e.id: e for e in endpoints}
    choices: list[tuple[Any, str]] = [] if prefill_best else [(None, "no-prefill-endpoint")]
    for p in prefill_best:
        if p == chosen:
            choice: tuple[Any, str] = (None, "same-endpoint")
        elif not decider.keeps(by_id[chosen], by_id[p]):
            choice = (None, "prefill-queue-longer")
        else:
            choice = (p, "split")
        if choice not in choices:
            choices.append(choice)
    pd = ReferencePd(uncached, True, choices)
    return ReferenceDecision([decode_run, prefill_run], best, prefill_best, pd)


_PD_HANDLERS = ("pd-profile-handler", "disagg-profile-handler")


def _pd_stages(
    handler: Mapping[str, Any], plugins: dict[str, Any], profiles: dict[str, Any]
) -> tuple[str, str | None, _Decider | None]:
    """The decode profile, the prefill profile and the decider, as the native config resolves
    them; no prefill profile or decider when only the decode profile can run."""
    params = handler.get("parameters") or {}
    if handler["type"] == "pd-profile-handler":
        decode = params.get("decodeProfile", "decode")
        prefill = params.get("prefillProfile", "prefill")
        if params.get("threshold") is not None:
            return decode, prefill, _Decider(params["threshold"], None)
        name = params.get("deciderPluginName")
        if name is None:
            # llm-d's default deciderPluginName, when such a plugin is declared.
            if "prefix-based-pd-decider" not in plugins:
                return decode, prefill, _Decider(0, None)
            name = "prefix-based-pd-decider"
        return decode, prefill, _decider(plugins[name])
    nested = params.get("profiles") or {}
    deciders = params.get("deciders") or {}

    def first(*values: Any) -> Any:
        return next((v for v in values if v is not None), None)

    decode = first(nested.get("decode"), params.get("decodeProfile"), "decode")
    prefill = first(nested.get("prefill"), params.get("prefillProfile"), "prefill")
    name = first(
        deciders.get("prefill"),
        params.get("prefillDeciderPluginName"),
        params.get("deciderPluginName"),
    )
    if name is None or prefill not in profiles:
        return decode, None, None
    return decode, prefill, _decider(plugins[name])


def _decider(plugin: Mapping[str, Any]) -> _Decider:
    kind, params = plugin["type"], plugin.get("parameters") or {}
    if kind == "always-disagg-pd-decider":
        return _Decider(0, None)
    if kind == "prefix-based-pd-decider":
        return _Decider(params.get("nonCachedTokens", 0), None)
    if kind == "load-aware-pd-decider":
        return _Decider(params.get("nonCachedTokens", 0), float(params.get("queueMargin", 0.0)))
    raise NotImplementedError(kind)


def decide_tokens(
    config: Mapping[str, Any],
    endpoints: Sequence[ReferenceEndpoint],
    index: ReferencePrefixIndex,
    tokens: Sequence[int],
    now: float = 0.0,
) -> ReferenceDecision:
    """The whole decision from token ids: hash, match, decide (the benchmark baseline)."""
    hashes = index.hash_tokens(tokens)
    matched = {w: v[0] for w, v in index.match(hashes, now).items()}
    return decide(config, endpoints, matched, len(tokens), index.block_size)
