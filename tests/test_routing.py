"""Routing through the Python API: the worked example, configs, staleness, P/D, seeds,
fallbacks, accounting, user plugins and thread safety."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _data import vector_path

from llmsched import (
    ConfigError,
    Endpoint,
    EndpointPool,
    NoEndpointError,
    PrefixIndex,
    Router,
    UnknownEndpointError,
)
from llmsched.errors import InvalidTypeError, InvalidValueError, PlacementError
from llmsched.routing import config_info, load_config, render_messages, text_tokens

PD_YAML = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-filter
- type: decode-filter
- type: queue-scorer
- type: prefix-cache-scorer
  parameters:
    blockSize: 16
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: {threshold}
- type: pd-profile-handler
  parameters:
    deciderPluginName: prefix-based-pd-decider
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: prefix-cache-scorer
    weight: 2
"""


def worked_example() -> tuple[Router, np.ndarray]:
    pool = EndpointPool(["A", "B", "C"])
    for name, queue, kv in [("A", 0, 0.2), ("B", 4, 0.5), ("C", 8, 0.9)]:
        pool.update(name, waiting=queue, kv_cache_usage=kv, now=0.0)
    index = PrefixIndex(block_size=16)
    prompt = np.arange(160, dtype=np.uint32)  # 10 blocks
    index.store("B", index.hash_tokens(prompt[:128]))
    index.store("C", index.hash_tokens(prompt))
    return Router(pool, index, config="llm-d"), prompt


def test_worked_example_b_wins_with_4_4() -> None:
    router, prompt = worked_example()
    d = router.pick(tokens=prompt, now=0.1)
    assert d.endpoint == "B"
    assert d.fallbacks == ["A", "C"]
    profile = d.explain()["default"]
    totals = {r.endpoint: r.total for r in profile.rows}
    assert totals == pytest.approx({"A": 3.6, "B": 4.4, "C": 3.2})
    b = profile.row("B")
    assert b.scores == pytest.approx(
        {"queue-scorer": 0.5, "kv-cache-utilization-scorer": 0.5, "prefix-cache-scorer": 0.8}
    )
    assert b.weighted["prefix-cache-scorer"] == pytest.approx(2.4)
    assert d.cached_tokens() == {"A": 0, "B": 128, "C": 160}
    assert "4.400" in str(d.explain())


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"plugins": [{"type": "nope-scorer"}], "schedulingProfiles": []}, "plugins[0].type"),
        (
            {
                "plugins": [{"type": "queue-scorer", "parameters": {"treshold": 1}}],
                "schedulingProfiles": [],
            },
            "plugins[0].parameters.treshold",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {"name": "p", "plugins": [{"pluginRef": "queue-scorer", "weight": -2}]}
                ],
            },
            "schedulingProfiles[0].plugins[0].weight",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "kv"}]}],
            },
            "schedulingProfiles[0].plugins[0].pluginRef",
        ),
        ({"plugins": [], "schedulingProfile": []}, "schedulingProfile"),
        (
            {
                "plugins": [{"type": "load-aware-scorer", "parameters": {"threshold": 0}}],
                "schedulingProfiles": [],
            },
            "plugins[0].parameters.threshold",
        ),
        (
            {
                "plugins": [{"type": "python-scorer", "parameters": {"function": 3}}],
                "schedulingProfiles": [],
            },
            "plugins[0].parameters.function",
        ),
    ],
)
def test_config_errors_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        Router(EndpointPool(["a"]), config=config)


def test_config_from_yaml_json_and_presets(tmp_path: Path) -> None:
    yaml_path = tmp_path / "epp.yaml"
    yaml_path.write_text(PD_YAML.format(threshold=64))
    router = Router(EndpointPool(["a"]), config=yaml_path)
    assert router.profiles == ["prefill", "decode"]
    assert router.index.block_size == 16
    json_path = tmp_path / "epp.json"
    json_path.write_text(json.dumps(load_config("dynamo-kv")))
    assert Router(EndpointPool(["a"]), config=str(json_path)).profiles == ["default"]
    for name in Router.presets():
        Router(EndpointPool(["a"]), config=name).pick(tokens=[1, 2, 3])
    with pytest.raises(ConfigError, match="neither a preset"):
        Router(EndpointPool(["a"]), config="no-such-preset")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        Router(EndpointPool(["a"]), config=bad)


def test_shared_index_block_size_must_match_the_config() -> None:
    with pytest.raises(ConfigError, match=r"plugins\[3\]\.parameters\.blockSize"):
        Router(EndpointPool(["a"]), PrefixIndex(block_size=64), config=PD_YAML_CONFIG())


def PD_YAML_CONFIG(threshold: int = 64) -> dict:
    import yaml

    loaded: dict = yaml.safe_load(PD_YAML.format(threshold=threshold))
    return loaded


@pytest.mark.parametrize(("policy", "winner"), [("saturated", "B"), ("ignore", "A")])
def test_stale_metrics_policies(policy: str, winner: str) -> None:
    pool = EndpointPool(["A", "B"], stale_after_s=0.2, stale_policy=policy)  # type: ignore[arg-type]
    pool.update("A", waiting=0, kv_cache_usage=0.0, now=0.0)
    pool.update("B", waiting=5, kv_cache_usage=0.5, now=0.9)
    router = Router(pool, config="llm-d")
    d = router.pick(tokens=[1, 2, 3], now=1.0)
    assert d.endpoint == winner
    row = d.explain()["default"].row("A")
    assert row.saturated == (policy == "saturated")
    if policy == "saturated":
        assert row.scores["queue-scorer"] == 0.0
        assert row.scores["kv-cache-utilization-scorer"] == 0.0


@pytest.mark.parametrize(("threshold", "split"), [(95, True), (96, True), (97, False)])
def test_pd_threshold_edges(threshold: int, split: bool) -> None:
    pool = EndpointPool(
        [
            Endpoint("D", address="d:80", role="decode"),
            Endpoint("P", address="p:80", role="prefill"),
        ],
        stale_policy="ignore",
    )
    index = PrefixIndex(block_size=16)
    prompt = np.arange(160, dtype=np.uint32)
    index.store("D", index.hash_tokens(prompt[:64]))  # 96 tokens uncached on D
    router = Router(pool, index, config=PD_YAML_CONFIG(threshold))
    d = router.pick(tokens=prompt, now=0.0)
    assert d.endpoint == "D"
    reason = "split" if split else "below-threshold"
    assert d.pd() == {
        "uncached_tokens": 96,
        "wanted": split,
        "disaggregated": split,
        "reason": reason,
    }
    assert d.disaggregated is split
    assert d.prefill_endpoint == ("P" if split else None)
    assert d.prefill_address == ("p:80" if split else None)
    if split:
        d.started(now=0.0)
        rows = {e["id"]: e for e in pool.endpoints()}
        assert rows["P"]["in_flight_prefill_tokens"] == 160
        assert rows["D"]["in_flight_requests"] == 1
        assert rows["D"]["in_flight_prefill_tokens"] == 0
        d.first_token()
        assert {e["id"]: e["in_flight_requests"] for e in pool.endpoints()} == {"D": 1, "P": 0}
        d.finished()


def test_a_prefill_pick_of_the_decode_endpoint_is_not_split() -> None:
    # A `both` endpoint passes both role filters: alone, each profile picks it.
    pool = EndpointPool([Endpoint("B", address="b:80", role="both")], stale_policy="ignore")
    router = Router(pool, config=PD_YAML_CONFIG(0))
    d = router.pick(tokens=np.arange(64, dtype=np.uint32), now=0.0)
    assert d.endpoint == "B"
    assert d.pd() == {
        "uncached_tokens": 64,
        "wanted": True,
        "disaggregated": False,
        "reason": "same-endpoint",
    }
    assert (d.disaggregated, d.prefill_endpoint, d.prefill_address) == (False, None, None)
    explanation = d.explain()
    assert explanation["prefill"].row("B").rank == 0  # the prefill profile ran and picked B
    assert "picked the decode endpoint itself" in str(explanation)
    d.started(now=0.0)
    (row,) = pool.endpoints()
    assert row["in_flight_requests"] == 1  # counted once, as the decode endpoint
    d.finished()
    # A prefill endpoint beside it takes the prefill: a real split.
    pool.add(Endpoint("P", address="p:80", role="prefill"))
    pool.update("B", waiting=5, now=0.0)
    d = router.pick(tokens=np.arange(64, dtype=np.uint32), now=0.0)
    note = d.pd()
    assert note is not None
    assert (d.endpoint, d.prefill_endpoint, note["reason"]) == ("B", "P", "split")
    assert "split: another endpoint prefills" in str(d.explain())


def test_endpoint_model_must_not_be_empty() -> None:
    pool = EndpointPool()
    with pytest.raises(InvalidValueError, match=r"endpoint 'e': model must be a non-empty str"):
        pool.add(Endpoint("e", model=""))
    assert len(pool) == 0
    with pytest.raises(InvalidValueError, match="model"):
        EndpointPool([Endpoint("a", model="m"), Endpoint("b", model="")])
    # None serves any model; a named model serves only requests naming it.
    pool.add_many([Endpoint("any"), Endpoint("m", model="m")])
    router = Router(pool, config="least-load")
    assert {router.pick(tokens=[1], model="x", now=0.0).endpoint} == {"any"}


def test_seeded_pickers_replay() -> None:
    pool = EndpointPool([f"e{i}" for i in range(12)], stale_policy="ignore")
    prompts = [np.arange(i, i + 50) for i in range(30)]
    for config in ["random", "llm-d", "dynamo-kv", "least-load"]:

        def run(seed: int, config: str = config) -> list[tuple]:
            router = Router(pool, config=config, seed=seed)
            return [
                (d.endpoint, *d.fallbacks)
                for d in (router.pick(tokens=p, now=0.0) for p in prompts)
            ]

        assert run(5) == run(5), config
    assert run(5, "random") != run(6, "random")


def test_fallbacks_follow_the_scores() -> None:
    pool = EndpointPool([f"e{i}" for i in range(10)], stale_policy="ignore")
    for i in range(10):
        pool.update(f"e{i}", waiting=(7 * i) % 10, kv_cache_usage=i / 20, now=0.0)
    d = Router(pool, config="llm-d", seed=3).pick(tokens=list(range(40)), now=0.0)
    profile = d.explain()["default"]
    ranked = [d.endpoint, *d.fallbacks]
    assert len(ranked) == 4
    totals = [profile.row(e).total for e in ranked]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] == max(r.total for r in profile.rows)
    assert [profile.row(e).rank for e in ranked] == [0, 1, 2, 3]


def test_accounting_and_approximate_prefix_records() -> None:
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    router = Router(pool, config="prefix-only", record_ttl_s=30.0)
    prompt = np.arange(64, dtype=np.int64)
    d = router.pick(tokens=prompt, now=0.0)
    assert d.cold and d.stage == "picked"
    with pytest.raises(RuntimeError, match="before started"):
        d.first_token()
    d.started(now=0.0)
    with pytest.raises(RuntimeError, match="already"):
        d.started(now=0.0)
    chosen = d.endpoint
    assert router.index.match_tokens(prompt, now=1.0).as_dict() == {chosen: 4}
    again = router.pick(tokens=prompt, now=1.0)
    assert again.endpoint == chosen and again.cached == 64
    assert router.pick(tokens=prompt, now=31.0).cold  # the approximate entry expired
    counts = {e["id"]: e["in_flight_requests"] for e in pool.endpoints()}
    assert counts[chosen] == 1
    assert d.first_token() and not d.first_token()
    assert d.finished() and not d.finished()
    assert all(e["in_flight_requests"] == 0 for e in pool.endpoints())


def test_started_on_a_fallback_and_unknown_endpoints() -> None:
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")
    router = Router(pool, config="random", seed=0)
    d = router.pick(tokens=[1, 2, 3], now=0.0)
    with pytest.raises(UnknownEndpointError):
        d.started("zzz", now=0.0)
    d.started(d.fallbacks[0], now=0.0)
    counts = {e["id"]: e["in_flight_requests"] for e in pool.endpoints()}
    assert counts[d.fallbacks[0]] == 1 and counts[d.endpoint] == 0
    d.finished()
    with pytest.raises(UnknownEndpointError):
        pool.update("zzz", waiting=1)
    with pytest.raises(KeyError):
        pool.remove("zzz")


def test_dropped_decisions_give_their_counts_back() -> None:
    pool = EndpointPool(["a"], stale_policy="ignore")
    router = Router(pool, config="least-load")
    d = router.pick(tokens=[1, 2, 3], now=0.0)
    d.started(now=0.0)
    assert pool.endpoints()[0]["in_flight_requests"] == 1
    del d
    gc.collect()
    assert pool.endpoints()[0]["in_flight_requests"] == 0


def test_bad_input_changes_nothing() -> None:
    pool = EndpointPool(["a"])
    pool.update("a", waiting=2, now=0.0)
    with pytest.raises(ValueError, match="kv_cache_usage"):
        pool.update("a", waiting=9, kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="waiting"):
        pool.update("a", waiting=-1)
    assert pool.endpoints()[0]["waiting"] == 2
    with pytest.raises(ValueError, match="role"):
        pool.add(Endpoint("x", role="decoder"))  # type: ignore[arg-type]
    assert len(pool) == 1
    router = Router(pool)
    with pytest.raises(TypeError, match="exactly one"):
        router.pick()
    with pytest.raises(TypeError, match="exactly one"):
        router.pick(tokens=[1], text="x")
    with pytest.raises(ValueError, match="out of range"):
        router.pick(tokens=[1, -2])
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(InvalidValueError, match="now must be a finite"):
            router.pick(tokens=[1], now=bad)
    with pytest.raises(InvalidValueError, match="now must be a finite"):
        pool.update("a", waiting=1, now=float("nan"))
    with pytest.raises(TypeError, match="headers"):
        router.pick(tokens=[1], headers={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidValueError, match="stale_policy"):
        EndpointPool(stale_policy="never")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="stale_after_s"):
        EndpointPool(stale_after_s=float("nan"))
    # Bad values are llmsched's errors (ValueErrors too), not bare ValueError or OverflowError.
    with pytest.raises(InvalidValueError, match="priority must fit in 32 bits"):
        router.pick(tokens=[1], priority=2**40)
    with pytest.raises(InvalidValueError, match="one-dimensional"):
        router.pick(tokens=np.zeros((2, 2), np.uint32))
    with pytest.raises(InvalidValueError, match="metrics line 1"):
        pool.update_from_metrics_text("a", "{{{ garbage")
    with pytest.raises(InvalidValueError, match="role"):
        pool.add(Endpoint("x", role="decoder"))  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="64 bits"):
        pool.add(2**64)
    assert len(pool) == 1
    assert pool.endpoints()[0]["waiting"] == 2


def test_no_endpoint() -> None:
    with pytest.raises(NoEndpointError, match="the pool has no endpoints"):
        Router(EndpointPool()).pick(tokens=[1, 2])
    pool = EndpointPool([Endpoint("p", role="prefill")])
    config = {
        "plugins": [{"type": "decode-filter"}],
        "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "decode-filter"}]}],
    }
    with pytest.raises(NoEndpointError, match="filters removed"):
        Router(pool, config=config).pick(tokens=[1, 2])
    models = EndpointPool([Endpoint("x", model="m1"), Endpoint("y", model="m2")])
    assert Router(models, config="random").pick(tokens=[1], model="m2").endpoint == "y"


def test_text_and_messages_share_prefixes() -> None:
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")
    router = Router(pool, config="prefix-only", seed=2)
    system = "You are a careful assistant. " * 40
    d = router.pick(text=system + "First question?", now=0.0)
    d.started(now=0.0)
    d.finished()
    follow = router.pick(text=system + "Another one.", now=1.0)
    assert follow.endpoint == d.endpoint and follow.cached > 0
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    m = router.pick(messages=messages, now=2.0)
    m.started(now=2.0)
    parts = [{"type": "text", "text": system}]
    again = router.pick(
        messages=[{"role": "system", "content": parts}, {"role": "user", "content": "Yo"}],
        now=3.0,
    )
    assert again.endpoint == m.endpoint and again.cached > 0
    assert text_tokens(b"abcde").tolist() == [int.from_bytes(b"abcd", "little"), ord("e")]
    with pytest.raises(TypeError):
        render_messages([{"content": "no role"}])


def test_a_text_part_that_is_not_a_str_is_refused_by_its_place() -> None:
    """Probe 60: ``Router.pick(messages=...)`` with a text part whose text is an int raised a
    bare ``TypeError: sequence item 0: expected str instance, int found`` (on the Python
    plane, a 400 carrying that message)."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]
    router = Router(EndpointPool(["a"]), config="least-load")
    with pytest.raises(InvalidTypeError, match=r"messages\[0\]\['content'\]\[1\]\['text'\]"):
        router.pick(messages=[{"role": "user", "content": parts}])
    assert router.stats()["pseudo_token_picks"] == 0


def test_python_plugins() -> None:
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")
    seen: list[dict] = []

    def prefer_c(request: dict, endpoints: list[dict]) -> list[float]:
        seen.append(request)
        return [1.0 if e["id"] == "c" else 0.0 for e in endpoints]

    def drop_a(request: dict, endpoints: list[dict]) -> list[bool]:
        return [e["id"] != "a" for e in endpoints]

    config = {
        "plugins": [
            {"type": "python-filter", "name": "no-a", "parameters": {"function": drop_a}},
            {"type": "python-scorer", "name": "c", "parameters": {"function": prefer_c}},
        ],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": "no-a"}, {"pluginRef": "c", "weight": 2}]}
        ],
    }
    d = Router(pool, config=config).pick(tokens=list(range(40)), lora="x", now=0.0)
    assert d.endpoint == "c" and d.fallbacks == ["b"]
    assert d.explain()["p"].row("a").removed_by == "no-a"
    assert seen[0]["prompt_tokens"] == 40 and seen[0]["lora"] == "x"

    def broken(request: dict, endpoints: list[dict]) -> list[float]:
        raise ZeroDivisionError("boom")

    config["plugins"][1]["parameters"] = {"function": broken}
    with pytest.raises(ZeroDivisionError, match="boom"):
        Router(pool, config=config).pick(tokens=[1])
    # A wrong count is llmsched's error naming the plugin (and its function), for either kind.
    config["plugins"][1]["parameters"] = {"function": lambda r, e: [0.5]}
    with pytest.raises(InvalidValueError, match=r'plugin "c" \(function <lambda>\) returned 1 '):
        Router(pool, config=config).pick(tokens=[1])
    # Probe 49 F9: NaN was read as 0, hiding the plugin's bug; out-of-range numbers clamp.
    config["plugins"][1]["parameters"] = {"function": lambda r, e: [0.5, float("nan")]}
    with pytest.raises(InvalidValueError, match=r'plugin "c" .* returned NaN for endpoint 1 of 2'):
        Router(pool, config=config).pick(tokens=[1])
    config["plugins"][1]["parameters"] = {"function": lambda r, e: [-3.0, float("inf")]}
    assert Router(pool, config=config).pick(tokens=[1]).endpoint == "c"
    config["plugins"][1]["parameters"] = {"function": prefer_c}
    config["plugins"][0]["parameters"] = {"function": lambda r, e: [True] * 5}
    with pytest.raises(InvalidValueError, match=r'plugin "no-a" .* returned 5 values for 3'):
        Router(pool, config=config).pick(tokens=[1])


def test_a_python_plugin_returning_the_wrong_thing_is_told_what_it_returned() -> None:
    """Probe 99: every wrong return value got the same message; it now names what came back
    (a generator, the first item that is no number or bool), without consuming an iterator."""
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")

    def router(kind: str, fn: Any) -> Router:
        config = {
            "plugins": [{"type": kind, "name": "mine", "parameters": {"function": fn}}],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "mine"}]}],
        }
        return Router(pool, config=config)

    cases = [
        ("python-scorer", lambda r, e: (0.5 for _ in e), r"one number per endpoint: got generator"),
        ("python-scorer", lambda r, e: None, r"got NoneType None"),
        ("python-scorer", lambda r, e: [0.5, None, 0.5], r"item 1 is NoneType None"),
        ("python-scorer", lambda r, e: ["0.1"] * 3, r"item 0 is str '0.1'"),
        ("python-scorer", lambda r, e: "abc", r"got str 'abc'"),
        ("python-filter", lambda r, e: [1, 0, 1], r"one bool per endpoint: item 0 is int 1"),
        (
            "python-filter",
            lambda r, e: np.array([1.0, 0.0, 1.0]),
            r"got ndarray array\(\[1\., 0\., 1\.\]\)",
        ),
    ]
    for kind, fn, message in cases:
        with pytest.raises(InvalidTypeError, match=r'plugin "mine" \(function <lambda>\) must '):
            router(kind, fn).pick(tokens=[1])
        with pytest.raises(InvalidTypeError, match=message):
            router(kind, fn).pick(tokens=[1])
    # What is accepted: any sequence of numbers (numpy included; bools read as 0 and 1) for a
    # scorer, of bools (numpy's too) for a filter.
    assert (
        router("python-scorer", lambda r, e: np.array([0.1, 0.9, 0.2])).pick(tokens=[1]).endpoint
        == "b"
    )
    assert (
        router("python-scorer", lambda r, e: (False, True, False)).pick(tokens=[1]).endpoint == "b"
    )
    assert (
        router("python-filter", lambda r, e: np.array([False, True, False]))
        .pick(tokens=[1])
        .endpoint
        == "b"
    )


def test_a_python_plugin_is_named_by_its_import_path_in_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe 99: a YAML / JSON config (``llmsched serve``'s router section) cannot hold a
    callable, and ``function`` had to be one: a Python plugin could not be configured there
    ("must be a callable"). It now takes ``"module:function"``; a module, attribute or
    object that does not do is a ConfigError naming the key."""
    (tmp_path / "my_plugins_p99.py").write_text(
        "def prefer_b(request, endpoints):\n"
        "    return [1.0 if e['id'] == 'b' else 0.0 for e in endpoints]\n"
        "class Holder:\n"
        "    @staticmethod\n"
        "    def keep_c(request, endpoints):\n"
        "        return [e['id'] == 'c' for e in endpoints]\n"
        "NOT_CALLABLE = 3\n"
    )
    (tmp_path / "broken_plugins_p99.py").write_text("raise ValueError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")

    def config_file(scorer: object, name: str = "c.yaml") -> Path:
        path = tmp_path / name
        path.write_text(
            "plugins:\n"
            f"  - {{type: python-scorer, name: s, parameters: {{function: {scorer}}}}}\n"
            "schedulingProfiles:\n"
            "  - {name: p, plugins: [{pluginRef: s}]}\n"
        )
        return path

    assert (
        Router(pool, config=config_file('"my_plugins_p99:prefer_b"')).pick(tokens=[1]).endpoint
        == "b"
    )
    nested = {
        "plugins": [
            {
                "type": "python-filter",
                "name": "f",
                "parameters": {"function": "my_plugins_p99:Holder.keep_c"},
            }
        ],
        "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "f"}]}],
    }
    assert Router(pool, config=nested).pick(tokens=[1]).endpoint == "c"
    key = r"plugins\[0\]\.parameters\.function: "
    bad = [
        ('"my_plugins_p99.prefer_b"', key + r"must be a callable or its import path "),
        ("3", key + r"must be a callable or its import path .*got int"),
        ('"no_such_module_p99:f"', key + r"cannot import .*No module named 'no_such_module_p99'"),
        ('"my_plugins_p99:nope"', key + r"cannot import .*my_plugins_p99 has no 'nope'"),
        (
            '"my_plugins_p99:Holder.nope"',
            key + r"cannot import .*my_plugins_p99\.Holder has no 'nope'",
        ),
        (
            '"my_plugins_p99:NOT_CALLABLE"',
            key + r"'my_plugins_p99:NOT_CALLABLE' is not callable \(an object of type int\)",
        ),
        ('"broken_plugins_p99:f"', key + r"importing 'broken_plugins_p99' .*ValueError: at import"),
    ]
    for scorer, message in bad:
        path = config_file(scorer)
        with pytest.raises(ConfigError, match=message) as caught:
            Router(pool, config=path)
        assert str(caught.value).startswith(f"router config '{path}': ")


def test_sessions_stick() -> None:
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")
    config = {
        "plugins": [{"type": "session-affinity-scorer"}],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": "session-affinity-scorer"}]}
        ],
    }
    router = Router(pool, config=config, seed=11)
    first = router.pick(tokens=[1, 2], session_id="s", now=0.0)
    with first:
        pass
    for t in range(1, 8):
        assert router.pick(tokens=[9, t], session_id="s", now=float(t)).endpoint == first.endpoint


# Round-robin moves every pick on unless the filter keeps one endpoint; max-score picks the
# scorer's 1 over the others' 0 (ties broken at random).
SESSION_PLUGINS = {
    "session-affinity-filter": "round-robin-picker",
    "session-affinity-scorer": "max-score-picker",
}


@pytest.mark.parametrize("plugin", sorted(SESSION_PLUGINS))
def test_a_named_session_endpoint_holds_until_a_binding_lives(plugin: str) -> None:
    """``session_endpoint`` (the gateway's decoded ``x-session-token``) is the session's
    endpoint while ``session_id`` has no live binding; an id of no endpoint is ignored."""
    pool = EndpointPool(["a", "b", "c", 7], stale_policy="ignore")
    picker = SESSION_PLUGINS[plugin]
    config = {
        "plugins": [{"type": plugin}, {"type": picker}],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": plugin}, {"pluginRef": picker}]}
        ],
    }
    router = Router(pool, config=config, seed=5)
    assert router.config_info["session_affinity"]
    for t in range(5):
        with router.pick(tokens=[t], session_endpoint="b", now=float(t)) as d:
            assert d.endpoint == "b"
        assert router.pick(tokens=[t], session_endpoint=7, now=float(t)).endpoint == 7
    # Ignored, no error: the picker spreads the picks as without it.
    spread = {router.pick(tokens=[1], session_endpoint="zz", now=6.0).endpoint for _ in range(12)}
    assert len(spread) > 1
    # The name pins the first turn, which binds the id; the binding then wins.
    with router.pick(tokens=[1], session_id="s", session_endpoint="c", now=7.0) as d:
        assert d.endpoint == "c"
    for t in range(8, 12):
        d = router.pick(tokens=[t], session_id="s", session_endpoint="a", now=float(t))
        assert d.endpoint == "c"
    assert not config_info("llm-d")["session_affinity"]


def test_python_plugins_see_the_session_endpoint() -> None:
    seen: list[object] = []

    def scorer(request: dict[str, Any], endpoints: list[dict[str, Any]]) -> list[float]:
        seen.append(request["session_endpoint"])
        return [0.0] * len(endpoints)

    config = {
        "plugins": [{"type": "python-scorer", "parameters": {"function": scorer}}],
        "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "python-scorer"}]}],
    }
    router = Router(EndpointPool(["a", 5]), config=config)
    router.pick(tokens=[1], now=0.0)
    router.pick(tokens=[1], session_endpoint="nowhere", now=0.0)
    router.pick(tokens=[1], session_endpoint=5, now=0.0)
    assert seen == [None, "nowhere", 5]


def test_a_session_endpoint_of_the_wrong_type_is_refused() -> None:
    router = Router(EndpointPool(["a"]), config="least-load")
    with pytest.raises(TypeError, match="session_endpoint"):
        router.pick(tokens=[1], session_endpoint=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="session_endpoint"):
        router.pick(tokens=[1], session_endpoint=True)


def test_long_session_ids_stick_and_stay_apart() -> None:
    """Ids past 64 bytes are kept as digests: each still sticks to its own endpoint."""
    pool = EndpointPool(["a", "b", "c", "d"], stale_policy="ignore")
    config = {
        "plugins": [{"type": "session-affinity-scorer"}],
        "schedulingProfiles": [
            {"name": "p", "plugins": [{"pluginRef": "session-affinity-scorer"}]}
        ],
    }
    router = Router(pool, config=config, seed=3)
    ids = ["x" * 8_000 + str(i) for i in range(12)]
    first = {}
    for i, session in enumerate(ids):
        with router.pick(tokens=[i], session_id=session, now=0.0) as decision:
            first[session] = decision.endpoint
    assert len(set(first.values())) > 1  # the random picker spread them
    for t in range(1, 4):
        for session in ids:
            decision = router.pick(tokens=[t], session_id=session, now=float(t))
            assert decision.endpoint == first[session]


def test_metrics_text_from_a_real_vllm() -> None:
    path = vector_path("vllm_metrics_under_load.txt")
    pool = EndpointPool(["vllm"])
    read = pool.update_from_metrics_text("vllm", path.read_text(), now=0.0)
    assert (read["waiting"], read["running"]) == (7, 3)
    assert pool.endpoints()[0]["kv_cache_usage"] == pytest.approx(0.782608695652174)
    with pytest.raises(InvalidValueError, match="no vLLM"):
        pool.update_from_metrics_text("vllm", "up 1\n")


@pytest.mark.timeout(120)
def test_in_flight_counts_return_to_zero_under_threads() -> None:
    pool = EndpointPool([f"e{i}" for i in range(8)], stale_policy="ignore")
    router = Router(pool, config="llm-d", seed=0)
    errors: list[BaseException] = []
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 50_000, size=int(n), dtype=np.uint32) for n in rng.integers(16, 600, 64)
    ]

    def work(t: int) -> None:
        try:
            for i in range(400):
                with router.pick(tokens=prompts[(i * 7 + t) % len(prompts)]) as d:
                    if i % 3:
                        d.first_token()
                pool.update(f"e{(i + t) % 8}", waiting=i % 6, kv_cache_usage=(i % 10) / 10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for e in pool.endpoints():
        assert (e["in_flight_requests"], e["in_flight_prefill_tokens"], e["in_flight_tokens"]) == (
            0,
            0,
            0,
        )
    assert set(router.index.workers()) <= {f"e{i}" for i in range(8)}


def test_an_endpoint_listed_twice_is_refused_and_add_replaces_on_purpose() -> None:
    for listed in (["a", "b", "a"], [1, 1], [Endpoint("x", address="h:1"), "x"]):
        with pytest.raises(InvalidValueError, match="listed twice"):
            EndpointPool(listed)  # type: ignore[arg-type]
    pool = EndpointPool(["a", "b"])
    assert pool.add(Endpoint("a", address="h2:8000")) is False
    assert sorted(e["id"] for e in pool.endpoints()) == ["a", "b"]


def test_a_scorer_listed_twice_in_a_profile_sums_its_weights_warns_and_explains() -> None:
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    pool.update("b", waiting=3)
    config = {
        "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "queue-scorer", "weight": 5},
                ],
            }
        ],
    }
    router = Router(pool, config=config)
    # As llm-d (which runs it twice and adds both): one scorer with the summed weight.
    assert [n["key"] for n in router.config_info["notes"]] == [
        "schedulingProfiles[0].plugins[2].pluginRef"
    ]
    assert any('"queue-scorer" is listed twice in profile "default"' in w for w in router.warnings)
    explained = router.pick(tokens=[1], now=0.0).explain()["default"]
    assert explained.weights == {"queue-scorer": 6.0, "kv-cache-utilization-scorer": 1.0}
    assert explained.row("a").total == 7.0
    assert "queue-scorer x6" in str(explained)


def test_scorer_weights_that_overflow_are_refused_and_all_zero_weights_noted() -> None:
    plugins = [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}]

    def config(weight: float) -> dict:
        refs = [{"pluginRef": p["type"], "weight": weight} for p in plugins]
        return {"plugins": plugins, "schedulingProfiles": [{"name": "p", "plugins": refs}]}

    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins.*add up past"):
        Router(EndpointPool(["a"]), config=config(1e308))
    router = Router(EndpointPool(["a"]), config=config(0))
    assert any("every scorer weight" in w for w in router.warnings)


def test_an_endpoint_removed_and_added_back_keeps_its_requests_in_flight() -> None:
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    router = Router(pool, config="least-load")

    def in_flight(endpoint: object) -> tuple[int, int]:
        row = next(e for e in pool.endpoints() if e["id"] == endpoint)
        return row["in_flight_requests"], row["in_flight_tokens"]

    d = router.pick(tokens=list(range(50)), now=1.0)
    d.started(now=1.0)
    pool.remove(d.endpoint)
    pool.add(d.endpoint)
    assert in_flight(d.endpoint) == (1, 50)
    # Started after the endpoint flapped: counted on the endpoint as it is now.
    late = router.pick(tokens=list(range(10)), now=2.0)
    pool.remove(late.endpoint)
    pool.add_many([late.endpoint])
    late.started(now=2.0)
    assert in_flight(late.endpoint)[0] == (2 if late.endpoint == d.endpoint else 1)
    d.finished()
    late.finished()
    assert in_flight("a") == in_flight("b") == (0, 0)


def test_add_many_adds_in_one_step_and_changes_nothing_on_bad_input() -> None:
    pool = EndpointPool(["a"])
    pool.update("a", waiting=4, now=0.0)
    assert pool.add_many(["b", Endpoint("a", address="h:1"), Endpoint(7, role="decode")]) == 2
    rows = {e["id"]: e for e in pool.endpoints()}
    assert list(rows) == ["a", "b", 7]
    assert rows["a"]["address"] == "h:1" and rows["a"]["waiting"] == 4
    for bad, error in (
        (["c", "c"], InvalidValueError),
        (["c", Endpoint("d", role="decoder")], InvalidValueError),  # type: ignore[arg-type]
        (["c", 1.5], TypeError),
        ("cd", TypeError),
    ):
        with pytest.raises(error):
            pool.add_many(bad)  # type: ignore[arg-type]
        assert len(pool) == 3
    big = EndpointPool([f"e{i}" for i in range(5000)])
    assert len(big) == 5000 and big.endpoints()[-1]["id"] == "e4999"


def test_counts_take_numpy_ints_and_out_of_range_counts_are_invalid_values() -> None:
    pool = EndpointPool(["a"])
    pool.update("a", waiting=np.int64(3), running=np.uint32(2), max_concurrency=np.int8(9))
    row = pool.endpoints()[0]
    assert (row["waiting"], row["running"], row["max_concurrency"]) == (3, 2, 9)
    pool.set_loras("a", ["x"], [], max_loras=np.int64(2))
    for bad in (-1, 2**32, 2**70):
        with pytest.raises(InvalidValueError, match="max_loras must be at"):
            pool.set_loras("a", ["y"], [], max_loras=bad)
        with pytest.raises(InvalidValueError, match="waiting must be at"):
            pool.update("a", waiting=np.int64(bad) if bad < 2**63 else bad)
    for wrong in (True, 1.0, "2", np.bool_(True)):
        with pytest.raises(TypeError, match="max_loras must be an int"):
            pool.set_loras("a", ["y"], [], max_loras=wrong)  # type: ignore[arg-type]
    row = pool.endpoints()[0]
    assert (row["active_loras"], row["max_loras"], row["waiting"]) == (["x"], 2, 3)


def test_explain_keeps_one_column_per_scorer_entry_even_when_names_repeat() -> None:
    from llmsched.routing import ProfileExplanation

    row = {
        "endpoint": "a",
        "address": "",
        "cached_tokens": 0,
        "saturated": False,
        "removed_by": None,
        "scores": [0.5, 1.0],
        "total": 5.5,
        "rank": 0,
    }
    raw = {
        "profile": "p",
        "picker": "max-score-picker",
        "filters": [],
        "skipped_filters": [],
        "scorers": [("q", 1.0), ("q", 5.0)],
        "rows": [row],
    }
    explained = ProfileExplanation._from_raw(raw)  # type: ignore[arg-type]
    assert explained.weights == {"q": 1.0, "q#2": 5.0}
    assert explained.row("a").weighted == {"q": 0.5, "q#2": 5.0}
    assert "q#2 x5" in str(explained)


def test_a_decision_used_out_of_order_raises_placement_error() -> None:
    # Probe 49 F6: a bare RuntimeError, not an llmsched exception.
    pool = EndpointPool(["a"], stale_policy="ignore")
    d = Router(pool, config="least-load").pick(tokens=[1], now=0.0)
    with pytest.raises(PlacementError, match="before started"):
        d.first_token()
    d.started(now=0.0)
    with pytest.raises(PlacementError, match="already"):
        d.started(now=0.0)
    assert d.finished()
    with pytest.raises(PlacementError, match="has finished"):
        d.started(now=0.0)
    assert pool.endpoints()[0]["in_flight_requests"] == 0  # nothing changed
    assert d.first_token() is False


def test_starting_a_decision_finished_unstarted_says_it_finished() -> None:
    # Probe 73: it said "started() was already called", which it never was.
    pool = EndpointPool(["a"], stale_policy="ignore")
    d = Router(pool, config="least-load").pick(tokens=[1], now=0.0)
    assert d.finished()
    with pytest.raises(PlacementError, match=r"has finished .*started\(\) must come before"):
        d.started(now=0.0)
    assert d.stage == "finished" and pool.endpoints()[0]["in_flight_requests"] == 0


def test_a_time_beyond_a_floats_range_is_an_invalid_value() -> None:
    # Probe 49 F7: int(10**400) gave a bare OverflowError from the shared validation.
    with pytest.raises(InvalidValueError, match=r"now .*an int of 1329 bits"):
        Router(EndpointPool(["a"])).pick(tokens=[1], now=10**400)
    with pytest.raises(InvalidValueError, match=r"stale_after_s .*an int of"):
        EndpointPool(["a"], stale_after_s=10**5000)  # past str()'s digit limit too
    assert EndpointPool(["a"], stale_after_s=2**60).stale_after_s == 2.0**60


SURROGATE = "a\ud800"  # a valid Python str and JSON escape, but no UTF-8 text


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("address", lambda p, r: p.add(Endpoint("c", address=SURROGATE))),
        ("model", lambda p, r: p.add(Endpoint("c", model=SURROGATE))),
        (r"labels\['k'\]", lambda p, r: p.add(Endpoint("c", labels={"k": SURROGATE}))),
        ("a key of labels", lambda p, r: p.add(Endpoint("c", labels={SURROGATE: "v"}))),
        ("model", lambda p, r: p.add_many(["d", Endpoint("c", model=SURROGATE)])),
        (r"active\[0\]", lambda p, r: p.set_loras("a", [SURROGATE], [], 1)),
        (r"waiting\[1\]", lambda p, r: p.set_loras("a", [], ["x", SURROGATE], 1)),
        ("text", lambda p, r: p.update_from_metrics_text("a", f"x {SURROGATE}\n")),
        ("session_id", lambda p, r: r.pick(tokens=[1], session_id=SURROGATE)),
        ("session_endpoint", lambda p, r: r.pick(tokens=[1], session_endpoint=SURROGATE)),
        ("model", lambda p, r: r.pick(tokens=[1], model=SURROGATE)),
        ("lora", lambda p, r: r.pick(tokens=[1], lora=SURROGATE)),
        ("cache_salt", lambda p, r: r.pick(tokens=[1], cache_salt=SURROGATE)),
        (r"headers\['x'\]", lambda p, r: r.pick(tokens=[1], headers={"x": SURROGATE})),
        ("a key of headers", lambda p, r: r.pick(tokens=[1], headers={SURROGATE: "x"})),
    ],
)
def test_a_lone_surrogate_is_named_and_changes_nothing(argument: str, call: Any) -> None:
    """Probe 49 F2: these were a bare UnicodeEncodeError from the native conversion."""
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    pool.set_loras("a", ["sql"], [], 2)
    router = Router(pool, config="least-load")
    before = pool.endpoints()
    with pytest.raises(InvalidValueError, match=f"^{argument}.* must be valid UTF-8"):
        call(pool, router)
    assert pool.endpoints() == before


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"plugins": [{"type": "queue-scorer", "name": SURROGATE}]},
            r"text at plugins\[0\]\.name must be valid UTF-8",
        ),
        ({SURROGATE: 1}, r"key 'a\\ud800' at the top level must be valid UTF-8"),
        ({1: 2}, "key 1 at the top level must be a str, got int"),
        (
            {"plugins": [{"type": "low-queue-filter", "parameters": {"threshold": 2**64}}]},
            r"value at plugins\[0\]\.parameters\.threshold must fit in 64 bits",
        ),
        (
            {"plugins": [{"type": "low-queue-filter", "parameters": {"threshold": -(2**63) - 1}}]},
            r"value at plugins\[0\]\.parameters\.threshold must fit in 64 bits",
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": []}]},
            r"plugins\[0\]\.parameters: must be a mapping, got list",
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": [5]}]},
            r"plugins\[0\]\.parameters: must be a mapping, got list",
        ),
        (  # an InvalidValueError from the index's constructor, naming no key
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSize": 2**40}}]},
            r"plugins\[0\]\.parameters\.blockSize: must be at most 65536",
        ),
    ],
)
def test_a_config_value_the_native_side_cannot_take_is_named(
    config: dict[Any, Any], message: str
) -> None:
    """Probe 49 F2/F8: these named no key (``router config: UnicodeEncodeError: ...``), and a
    list of parameters was read as the fields in order (``[]`` as none)."""
    with pytest.raises(ConfigError, match=message):
        Router(EndpointPool(["a"]), config=config)
    with pytest.raises(ConfigError, match=message):
        config_info(config)


def test_set_loras_takes_a_single_name_as_one_adapter() -> None:
    # Probe 73: "sql-adapter" was read letter by letter: 11 one-letter adapters active, so a
    # request for the adapter found it on no endpoint and routed without LoRA affinity.
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    pool.set_loras("b", "sql-adapter", "other", max_loras=4)
    b = next(e for e in pool.endpoints() if e["id"] == "b")
    assert (b["active_loras"], b["waiting_loras"]) == (["sql-adapter"], ["other"])
    router = Router(
        pool,
        config={
            "plugins": [{"type": "lora-affinity-scorer"}, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "lora-affinity-scorer"},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        },
    )
    assert {router.pick(tokens=[1], lora="sql-adapter", now=0.0).endpoint for _ in range(8)} == {
        "b"
    }


def test_a_decision_under_async_with_names_the_plain_with_and_finishes() -> None:
    """``async with router.pick(...)`` got Python's own TypeError (3.10: AttributeError), naming
    neither form, and a decision started before it stayed in flight while referenced. Now an
    InvalidTypeError (a TypeError) names ``with router.pick(...) as decision:``, and the
    decision is finished at once."""
    import asyncio

    from llmsched.errors import InvalidTypeError

    pool = EndpointPool(["a"], stale_policy="ignore")
    router = Router(pool, config="least-load")
    d = router.pick(tokens=[1, 2, 3], now=0.0)
    d.started(now=0.0)

    async def main() -> None:
        async with d:  # type: ignore[attr-defined]
            pass

    with pytest.raises(InvalidTypeError, match=r"`with router\.pick\(\.\.\.\) as decision:`"):
        asyncio.run(main())
    assert d.stage == "finished"
    assert pool.endpoints()[0]["in_flight_requests"] == 0
