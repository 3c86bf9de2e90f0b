"""The native router against its pure-Python twin: same per-scorer scores, same totals and a
choice the twin allows, for random pools, metrics, cache contents and configurations with
deterministic pickers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
from llmsched.reference.routing import ReferenceEndpoint, decide

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
    now = 10.0
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
    cached = index.match(hashes, now=now).as_dict()
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
