"""The native router against its pure-Python twin: same per-scorer scores, same totals and a
choice the twin allows, for random pools, metrics, cache contents and configurations with
deterministic pickers."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
from llmsched.reference.routing import ReferenceEndpoint, decide
from llmsched.routing import load_config

BLOCK = 16
SCORERS = [
    ("queue-scorer", {}),
    ("running-requests-scorer", {}),
    ("kv-cache-utilization-scorer", {}),
    ("load-aware-scorer", {"threshold": 8}),
    ("active-request-scorer", {}),
    ("token-load-scorer", {"queueThresholdTokens": 500}),
    ("prefix-cache-scorer", {}),
    ("prefix-cache-scorer", {"maxPrefixBlocksToMatch": 3}),
]
FILTERS = [
    ("decode-filter", {}),
    ("utilization-filter", {"queueDepthThreshold": 4, "kvCacheUtilThreshold": 0.7}),
    (
        "utilization-detector",
        {"queueDepthThreshold": 3, "kvCacheUtilThreshold": 0.6, "headroom": 0.5},
    ),
    # Its own staleness, shorter than the pool's 0.2 s and read under either pool policy.
    (
        "utilization-detector",
        {"queueDepthThreshold": 6, "metricsStalenessThreshold": "50ms"},
    ),
    ("by-label", {"label": "zone", "validValues": ["a"], "allowsNoLabel": True}),
]

endpoint = st.fixed_dictionaries(
    {
        "role": st.sampled_from([None, "decode", "prefill", "both"]),
        "zone": st.sampled_from([None, "a", "b"]),
        "waiting": st.integers(0, 12),
        "running": st.integers(0, 12),
        "kv": st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 1.0]),
        "age": st.sampled_from([0.0, 0.1, 0.5, None]),
        "cached": st.integers(0, 12),
        "in_flight": st.integers(0, 3),
    }
)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    scorers = draw(
        st.lists(st.sampled_from(range(len(SCORERS))), min_size=1, max_size=4, unique=True)
    )
    filters = draw(st.lists(st.sampled_from(range(len(FILTERS))), max_size=2, unique=True))
    picker = draw(st.sampled_from(["max-score-picker", "softmax-cost-picker"]))
    plugins: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    for i in filters:
        kind, params = FILTERS[i]
        plugins.append({"type": kind, "name": f"f{i}", "parameters": params})
        refs.append({"pluginRef": f"f{i}"})
    for i in scorers:
        kind, params = SCORERS[i]
        plugins.append({"type": kind, "name": f"s{i}", "parameters": params})
        weight = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]))
        refs.append({"pluginRef": f"s{i}", "weight": weight})
    plugins.append({"type": picker, "name": "picker"})
    refs.append({"pluginRef": "picker"})
    return {"plugins": plugins, "schedulingProfiles": [{"name": "p", "plugins": refs}]}


NOW = 10.0


def _cluster(
    specs: list[dict[str, Any]], prompt_len: int, policy: str
) -> tuple[
    EndpointPool, PrefixIndex, np.ndarray, list[ReferenceEndpoint], dict[Any, int], list[Any]
]:
    """A pool and index from the specs, their twins, the prompt's cached blocks per endpoint,
    and the in-flight decisions to finish at the end."""
    now = NOW
    pool = EndpointPool(stale_after_s=0.2, stale_policy=policy)  # type: ignore[arg-type]
    index = PrefixIndex(block_size=BLOCK)
    prompt = np.arange(1000, 1000 + prompt_len, dtype=np.uint32)
    hashes = index.hash_tokens(prompt)
    twins = []
    for i, s in enumerate(specs):
        name = f"e{i}"
        labels = {} if s["zone"] is None else {"zone": s["zone"]}
        pool.add(Endpoint(name, role=s["role"], labels=labels))
        if s["age"] is not None:
            pool.update(
                name,
                waiting=s["waiting"],
                running=s["running"],
                kv_cache_usage=s["kv"],
                now=now - s["age"],
            )
        if s["cached"] and len(hashes):
            index.store(name, hashes[: s["cached"]])
        saturated = policy == "saturated" and (s["age"] is None or s["age"] > 0.2)
        fresh = s["age"] is not None
        twins.append(
            ReferenceEndpoint(
                name,
                role=s["role"],
                labels=labels,
                waiting=s["waiting"] if fresh else 0,
                running=s["running"] if fresh else 0,
                kv_cache_usage=s["kv"] if fresh else 0.0,
                saturated=saturated,
                metrics_age_s=s["age"],
            )
        )
    # In-flight load: requests sent earlier, still prefilling (different prompts).
    warm_up = Router(pool, index, config="round-robin")
    keep = []
    for i, s in enumerate(specs):
        for j in range(s["in_flight"]):
            d = warm_up.pick(tokens=np.arange(j * 7 + i * 100, j * 7 + i * 100 + 30), now=now)
            d.started(f"e{i}", now=now)
            keep.append(d)
    rows = {e["id"]: e for e in pool.endpoints()}
    for t in twins:
        t.in_flight_requests = rows[t.id]["in_flight_requests"]
        t.in_flight_prefill_tokens = rows[t.id]["in_flight_prefill_tokens"]
        t.in_flight_tokens = rows[t.id]["in_flight_tokens"]
        t.in_flight_prefill_requests = rows[t.id]["in_flight_requests"]  # none past prefill
    cached = index.match(hashes, now=now).as_dict()
    return pool, index, prompt, twins, cached, keep


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(endpoint, min_size=1, max_size=9),
    config=configs(),
    prompt_len=st.integers(0, 200),
    policy=st.sampled_from(["saturated", "ignore"]),
)
def test_native_matches_the_twin(
    specs: list[dict[str, Any]], config: dict[str, Any], prompt_len: int, policy: str
) -> None:
    now = NOW
    pool, index, prompt, twins, cached, keep = _cluster(specs, prompt_len, policy)
    want = decide(config, twins, cached, prompt_len, BLOCK)

    router = Router(pool, index, config=config, seed=1)
    if not want.best:
        with pytest.raises(LookupError):
            router.pick(tokens=prompt, now=now)
        return
    d = router.pick(tokens=prompt, now=now)
    assert d.endpoint in want.best
    got = d.explain()["p"]
    kept = [r.endpoint for r in got.rows if r.removed_by is None]
    assert kept == want.runs[0].kept
    for r in got.rows:
        if r.removed_by is None:
            assert r.scores == pytest.approx(want.runs[0].scores[r.endpoint], abs=1e-12)
            assert r.total == pytest.approx(want.runs[0].totals[r.endpoint], abs=1e-9)
    for d in keep:
        d.finished()


DECIDER_TOKENS = [0, 16, 64, 150, 256]
HANDLERS = [
    "pd-plugin",
    "pd-threshold",
    "pd-default-named",
    "pd-default-none",
    "disagg-nested",
    "disagg-flat",
    "disagg-no-decider",
    "disagg-no-prefill-profile",
]


@st.composite
def _profile(draw: st.DrawFn, prefix: str, role_filter: str) -> tuple[list[Any], list[Any]]:
    """One profile's plugins (named ``prefix``-...) and refs: its role filter or not, other
    filters, scorers and a deterministic picker."""
    plugins: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        plugins.append({"type": role_filter, "name": f"{prefix}-role"})
        refs.append({"pluginRef": f"{prefix}-role"})
    others = [i for i, (kind, _) in enumerate(FILTERS) if kind != "decode-filter"]
    for i in draw(st.lists(st.sampled_from(others), max_size=1, unique=True)):
        kind, params = FILTERS[i]
        plugins.append({"type": kind, "name": f"{prefix}-f{i}", "parameters": params})
        refs.append({"pluginRef": f"{prefix}-f{i}"})
    for i in draw(
        st.lists(st.sampled_from(range(len(SCORERS))), min_size=1, max_size=3, unique=True)
    ):
        kind, params = SCORERS[i]
        plugins.append({"type": kind, "name": f"{prefix}-s{i}", "parameters": params})
        weight = draw(st.sampled_from([0.0, 1.0, 2.0, 3.0]))
        refs.append({"pluginRef": f"{prefix}-s{i}", "weight": weight})
    picker = draw(st.sampled_from(["max-score-picker", "softmax-cost-picker"]))
    plugins.append({"type": picker, "name": f"{prefix}-picker"})
    refs.append({"pluginRef": f"{prefix}-picker"})
    return plugins, refs


@st.composite
def pd_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A P/D configuration: ``pd-profile-handler`` or ``disagg-profile-handler`` in each way of
    naming the profiles and the decider, with a prefix-based, load-aware or always decider."""
    decode_name, prefill_name = draw(st.sampled_from([("decode", "prefill"), ("dec", "pre")]))
    decode_plugins, decode_refs = draw(_profile("d", "decode-filter"))
    prefill_plugins, prefill_refs = draw(_profile("p", "prefill-filter"))
    tokens = draw(st.sampled_from(DECIDER_TOKENS))
    decider: dict[str, Any] = draw(
        st.sampled_from(
            [
                {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": tokens}},
                {
                    "type": "load-aware-pd-decider",
                    "parameters": {
                        "nonCachedTokens": tokens,
                        "queueMargin": draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
                    },
                },
                {"type": "always-disagg-pd-decider"},
            ]
        )
    )
    kind = draw(st.sampled_from(HANDLERS))
    names = {"decodeProfile": decode_name, "prefillProfile": prefill_name}
    nested = {"decode": decode_name, "prefill": prefill_name}
    handler: dict[str, Any]
    if kind == "pd-plugin":
        handler = {"type": "pd-profile-handler", "parameters": {**names, "deciderPluginName": "x"}}
        decider["name"] = "x"
    elif kind == "pd-threshold":
        handler = {"type": "pd-profile-handler", "parameters": {**names, "threshold": tokens}}
        decider = {}
    elif kind == "pd-default-named":
        handler = {"type": "pd-profile-handler", "parameters": names}
        decider["name"] = "prefix-based-pd-decider"
    elif kind == "pd-default-none":
        handler = {"type": "pd-profile-handler", "parameters": names}
        decider = {}
    elif kind == "disagg-flat":
        flat = {**names, "prefillDeciderPluginName": "x"}
        handler = {"type": "disagg-profile-handler", "parameters": flat}
        decider["name"] = "x"
    elif kind == "disagg-no-decider":
        handler = {"type": "disagg-profile-handler", "parameters": {"profiles": nested}}
        decider = {}
    else:
        if kind == "disagg-no-prefill-profile":
            nested = {**nested, "prefill": "elsewhere"}
        params = {"profiles": nested, "deciders": {"prefill": "x"}}
        handler = {"type": "disagg-profile-handler", "parameters": params}
        decider["name"] = "x"
    plugins = decode_plugins + prefill_plugins + ([decider] if decider else []) + [handler]
    profiles = [
        {"name": decode_name, "plugins": decode_refs},
        {"name": prefill_name, "plugins": prefill_refs},
    ]
    return {"plugins": plugins, "schedulingProfiles": draw(st.permutations(profiles))}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(endpoint, min_size=1, max_size=7),
    config=pd_configs(),
    prompt_len=st.integers(0, 300),
    policy=st.sampled_from(["saturated", "ignore"]),
)
def test_native_pd_decision_matches_the_twin(
    specs: list[dict[str, Any]], config: dict[str, Any], prompt_len: int, policy: str
) -> None:
    """The P/D step on random clusters: the same uncached tokens, whether a prefill endpoint
    is wanted, a (prefill endpoint, reason) the twin allows, and the same scores in both
    profiles."""
    now = NOW
    pool, index, prompt, twins, cached, keep = _cluster(specs, prompt_len, policy)
    router = Router(pool, index, config=config, seed=3)
    first = decide(config, twins, cached, prompt_len, BLOCK)
    if not first.best:
        with pytest.raises(LookupError):
            router.pick(tokens=prompt, now=now)
        return
    d = router.pick(tokens=prompt, now=now)
    assert d.endpoint in first.best
    # The P/D step follows the decode endpoint the native picker chose among ties.
    want = decide(config, twins, cached, prompt_len, BLOCK, decode_endpoint=d.endpoint)
    note = d.pd()
    event(f"reason: {None if note is None else note['reason']}")
    if want.pd is None:
        assert note is None
        assert d.prefill_endpoint is None
    else:
        assert note is not None
        assert note["uncached_tokens"] == want.pd.uncached_tokens
        assert note["wanted"] == want.pd.wanted
        assert (d.prefill_endpoint, note["reason"]) in want.pd.choices
        assert note["disaggregated"] == (note["reason"] == "split")
    got = d.explain()
    assert [p.profile for p in got.profiles] == [run.profile for run in want.runs]
    for run in want.runs:
        rows = got[run.profile].rows
        assert [r.endpoint for r in rows if r.removed_by is None] == run.kept
        for r in rows:
            if r.removed_by is None:
                assert r.scores == pytest.approx(run.scores[r.endpoint], abs=1e-12)
                assert r.total == pytest.approx(run.totals[r.endpoint], abs=1e-9)
    for k in keep:
        k.finished()


def _pd_config(decider: dict[str, Any], handler_params: dict[str, Any]) -> dict[str, Any]:
    config = load_config("llm-d-pd")
    plugins = [p for p in config["plugins"] if not p["type"].endswith(("-decider", "-handler"))]
    handler = {"type": "pd-profile-handler", "parameters": handler_params}
    config["plugins"] = plugins + ([decider] if decider else []) + [handler]
    return config


LOAD_AWARE = {
    "type": "load-aware-pd-decider",
    "name": "x",
    "parameters": {"nonCachedTokens": 0, "queueMargin": 1.0},
}


SPLIT = ("p", "split")
Role = Literal["prefill", "decode", "both"]


@pytest.mark.parametrize(
    ("config", "roles", "waiting", "expected"),
    [
        # A prefill pick that is the decode endpoint itself (role both) is no split.
        (load_config("llm-d-pd"), ["both"], [0], (None, "same-endpoint")),
        # The load-aware decider keeps the decode endpoint when the prefill queue is longer.
        (
            _pd_config(LOAD_AWARE, {"deciderPluginName": "x"}),
            ["decode", "prefill"],
            [0, 2],
            (None, "prefill-queue-longer"),
        ),
        (_pd_config(LOAD_AWARE, {"deciderPluginName": "x"}), ["decode", "prefill"], [0, 1], SPLIT),
        # The handler's own threshold, and no decider at all (nonCachedTokens 0).
        (
            _pd_config({}, {"threshold": 300}),
            ["decode", "prefill"],
            [0, 0],
            (None, "below-threshold"),
        ),
        (_pd_config({}, {"threshold": 200}), ["decode", "prefill"], [0, 0], SPLIT),
        (_pd_config({}, {}), ["decode", "prefill"], [0, 0], SPLIT),
    ],
)
def test_twin_pd_cases(
    config: dict[str, Any], roles: list[Role], waiting: list[int], expected: tuple[Any, str]
) -> None:
    """Cases the twin got wrong before it modelled the native P/D step (it split onto the
    decode endpoint itself, ignored the load-aware decider and failed on an inline threshold):
    the native decision is ``expected`` (prefill endpoint, reason), the twin's only choice."""
    names = ["b"] if roles == ["both"] else ["d", "p"]
    pool = EndpointPool([Endpoint(n, role=r) for n, r in zip(names, roles, strict=True)])
    for n, w in zip(names, waiting, strict=True):
        pool.update(n, waiting=w, running=0, kv_cache_usage=0.0, now=NOW)
    twins = [
        ReferenceEndpoint(n, role=r, waiting=w)
        for n, r, w in zip(names, roles, waiting, strict=True)
    ]
    d = Router(pool, config=config).pick(tokens=list(range(256)), now=NOW)
    note = d.pd()
    assert note is not None
    assert (d.prefill_endpoint, note["reason"]) == expected
    want = decide(config, twins, {}, 256, 16)
    assert want.pd is not None
    assert want.pd.choices == [expected]
