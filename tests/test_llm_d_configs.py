"""Configs published by llm-d and the Gateway API Inference Extension load, and decide as they do
there (tests/data/llm-d-configs/README.md says where each file comes from)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml

from llmsched import EndpointPool, PrefixIndex, Router
from llmsched.errors import ConfigError
from llmsched.hashing import block_hashes
from llmsched.routing import config_info

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "llm-d-configs"
LOADING = [
    "gie-default-plugins.yaml",
    "gie-plugins-v2.yaml",
    "gie-config-text.yaml",
    "gie-earlier-names.yaml",
    "llmd-prefix-cache-tracking.yaml",
    "llmd-precise-kv-events.yaml",
    "gie-saturation-flow-control.yaml",
]
REFUSED = {
    "llmd-precise-data-layer.yaml": ("dataLayer", "scrape"),
    "llmd-pd-disagg.yaml": ("plugins[0].type", "pd.header"),
}


def corpus(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CORPUS / name).read_text())
    return loaded


def test_the_corpus_is_listed_with_its_sources() -> None:
    files = sorted(p.name for p in CORPUS.glob("*.yaml"))
    assert files == sorted([*LOADING, *REFUSED])
    readme = (CORPUS / "README.md").read_text()
    for name in files:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("name", LOADING)
def test_published_configs_load(name: str) -> None:
    router = Router(EndpointPool(["a", "b"]), PrefixIndex(_block_size(name)), CORPUS / name)
    assert router.profiles == ["default"]
    assert router.pick(tokens=list(range(200)), now=0.0).endpoint in ("a", "b")


@pytest.mark.parametrize(("name", "key_and_word"), sorted(REFUSED.items()))
def test_configs_without_a_counterpart_are_refused_by_name(
    name: str, key_and_word: tuple[str, str]
) -> None:
    key, word = key_and_word
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")) as err:
        Router(EndpointPool(["a"]), config=CORPUS / name)
    assert word in str(err.value)


def _block_size(name: str) -> int:
    size = config_info(CORPUS / name)["block_size"]
    return 16 if size is None else size


def _pool(n: int = 3) -> EndpointPool:
    return EndpointPool([f"e{i}" for i in range(n)], stale_policy="ignore")


def test_decision_tree_takes_the_extensions_branches() -> None:
    cfg = CORPUS / "gie-default-plugins.yaml"
    # Success: low-queue keeps e0 and e2 (<= 128 waiting); lora-affinity finds no adapter and
    # no room (fails), so its input {e0, e2} goes on; least-queue keeps e2 (band [0, 2]).
    pool = _pool()
    for i, (waiting, kv) in enumerate([(5, 0.1), (200, 0.0), (0, 0.9)]):
        pool.update(f"e{i}", waiting=waiting, kv_cache_usage=kv, now=0.0)
    router = Router(pool, config=cfg, seed=3)
    assert [router.pick(tokens=[1, 2, 3], now=0.0).endpoint for _ in range(20)] == ["e2"] * 20
    # Failure: every queue is over 128, so nextOnFailure runs on all three: least-queue keeps
    # e0 and e2 (band [130, 186]), least-kv-cache keeps e2 (band [0.1, 0.35]).
    for i, (waiting, kv) in enumerate([(130, 0.6), (300, 0.0), (140, 0.1)]):
        pool.update(f"e{i}", waiting=waiting, kv_cache_usage=kv, now=0.0)
    decision = router.pick(tokens=[1, 2, 3], now=0.0)
    assert decision.endpoint == "e2" and decision.fallbacks == []
    # LoRA affinity: e1 has the adapter, e0 has room; with threshold 0.999 the affinity group
    # wins almost always, the room group now and then.
    for i in range(3):
        pool.update(f"e{i}", waiting=0, kv_cache_usage=0.0, now=0.0)
    pool.set_loras("e1", active=["sql"], max_loras=1)
    pool.set_loras("e0", max_loras=4)
    picks = [
        Router(pool, config=cfg, seed=s).pick(tokens=[1], lora="sql", now=0.0) for s in range(300)
    ]
    chosen = [d.endpoint for d in picks]
    assert chosen.count("e1") >= 295 and set(chosen) <= {"e0", "e1"}


def test_scorer_profile_with_an_earlier_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    info = config_info(CORPUS / "gie-plugins-v2.yaml")
    assert info["block_size"] == 64 and info["worker_capacity"] == 31250
    assert [n["key"] for n in info["notes"]] == ["plugins[1].type"]
    assert "kv-cache-utilization-scorer" in info["notes"][0]["message"]
    pool = _pool(2)
    pool.update("e0", waiting=10, kv_cache_usage=0.5, now=0.0)
    pool.update("e1", waiting=0, kv_cache_usage=0.1, now=0.0)
    router = Router(pool, config=CORPUS / "gie-plugins-v2.yaml")
    assert router.index.block_size == 64
    decision = router.pick(tokens=list(range(100)), now=0.0)
    assert decision.endpoint == "e1" and decision.fallbacks == []  # maxNumOfEndpoints: 1
    assert any("kv-cache-scorer" in w for w in router.warnings)


def test_prefix_scorer_of_the_configuration_guide() -> None:
    router = Router(_pool(2), config=CORPUS / "gie-config-text.yaml")
    assert router.index.block_size == 5
    tokens = list(range(40))
    router.index.store("e1", router.index.hash_tokens(tokens))
    assert router.pick(tokens=tokens, now=0.0).endpoint == "e1"


def test_earlier_names_are_noted_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmsched.routing

    monkeypatch.setattr(llmsched.routing, "_LOGGED", set())  # as in a fresh process
    caplog.set_level(logging.WARNING, logger="llmsched")
    cfg = corpus("gie-earlier-names.yaml")
    cfg["plugins"][0]["parameters"]["threshold"] = 9
    pool = _pool(2)
    pool.update("e0", waiting=10, now=0.0)
    pool.update("e1", waiting=3, now=0.0)
    for _ in range(2):
        router = Router(pool, config=cfg)
    notes = [r.getMessage() for r in caplog.records if "current name" in r.getMessage()]
    for old in ("low-queue", "prefix-cache", "max-score", "single-profile"):
        assert sum(f'"{old}" is read as' in n for n in notes) == 1, (old, notes)
    # The low-queue filter drops e0 (10 > 9) even though it holds the whole prompt.
    tokens = list(range(64))
    router.index.store("e0", router.index.hash_tokens(tokens))
    assert router.pick(tokens=tokens, now=0.0).endpoint == "e1"


def _vllm_vector() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA / "vllm_block_hashes.json").read_text())
    return loaded


@pytest.mark.parametrize(
    ("name", "seed"),
    [("llmd-prefix-cache-tracking.yaml", "0"), ("llmd-precise-kv-events.yaml", None)],
)
def test_precise_wiring_hashes_as_vllm(name: str, seed: str | None) -> None:
    vector = _vllm_vector()
    cfg = corpus(name)
    scorer = next(p for p in cfg["plugins"] if "prefix-cache" in p["type"])
    params = scorer["parameters"]
    processor = params.get("indexerConfig", {}).get("tokenProcessorConfig")
    if processor is None:
        processor = params["tokenProcessorConfig"]
    # The published block size and seed, set to those the reference hashes were computed with.
    processor["blockSize"] = vector["block_size"]
    if seed is None:
        processor.pop("hashSeed", None)
    else:
        processor["hashSeed"] = seed
    wiring = config_info(cfg)["precise"]
    assert wiring is not None and wiring["block_size"] == vector["block_size"]
    case = next(c for c in vector["cases"] if c["seed"] == wiring["vllm_seed"])
    got = block_hashes(
        vector["tokens"], wiring["block_size"], seed=wiring["vllm_seed"], algo="vllm_sha256_cbor"
    )
    assert [int(h) for h in got] == case["event_uint64"]


def test_cache_tracking_mode_reads_the_config_and_kv_events() -> None:
    info = config_info(CORPUS / "llmd-prefix-cache-tracking.yaml")
    wiring = info["precise"]
    assert wiring is not None
    assert (wiring["block_size"], wiring["hash_seed"], wiring["vllm_seed"]) == (64, "42", "42")
    assert {n["key"] for n in info["notes"]} == {
        "plugins[2].parameters.indexerConfig.kvBlockIndexConfig",
        "plugins[3].type",
    }
    # Engines publish blocks with vLLM's hashes; the index applies them and the pick follows.
    index = PrefixIndex(64)
    router = Router(_pool(2), index, CORPUS / "llmd-prefix-cache-tracking.yaml")
    tokens = list(range(256))
    hashes = block_hashes(tokens, 64, seed=wiring["vllm_seed"], algo="vllm_sha256_cbor")
    event = {
        "type": "BlockStored",
        "block_hashes": [int(h) for h in hashes],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 64,
    }
    index.apply_vllm_events("e1", msgpack.packb([0.0, [event], None]))
    decision = router.pick(tokens=tokens, now=0.0)
    assert decision.endpoint == "e1" and decision.cached_tokens()["e1"] == 256
    scores = decision.explain()["default"].row("e1")
    assert scores.scores["prefix-cache-scorer"] == 1.0
    assert decision.explain()["default"].row("e0").scores["prefix-cache-scorer"] == 0.0


def test_precise_scorer_without_events_warns_what_to_wire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    info = config_info(CORPUS / "llmd-precise-kv-events.yaml")
    wiring = info["precise"]
    assert wiring is not None
    assert (wiring["zmq_endpoint"], wiring["topic_filter"]) == ("tcp://*:5557", "kv@")
    assert (wiring["block_size"], wiring["vllm_seed"], wiring["discover_pods"]) == (
        64,
        "vllm-none-hash",
        False,
    )
    bare = Router(_pool(2), config=CORPUS / "llmd-precise-kv-events.yaml")
    wired = [w for w in bare.warnings if "KVEventSubscriber" in w]
    assert len(wired) == 1 and "PYTHONHASHSEED='vllm-none-hash'" in wired[0]
    assert "--block-size 64" in wired[0]
    shared = Router(_pool(2), PrefixIndex(64), CORPUS / "llmd-precise-kv-events.yaml")
    assert not any("KVEventSubscriber" in w for w in shared.warnings)
    assert any("tokenizersPoolConfig" in w for w in shared.warnings)


def test_saturation_detector_and_feature_gates() -> None:
    info = config_info(CORPUS / "gie-saturation-flow-control.yaml")
    assert info["flow_control"] is True
    assert info["saturation"] == {
        "queue_depth_threshold": 8,
        "kv_cache_util_threshold": 0.9,
        "metrics_staleness_s": 0.5,
    }
    bare = Router(_pool(2), config=CORPUS / "gie-saturation-flow-control.yaml")
    assert sum("a Router alone" in w for w in bare.warnings) == 2


def test_the_gateway_wires_flow_control_and_block_size(tmp_path: Path) -> None:
    from llmsched.gateway import Gateway
    from llmsched.gateway.config import load_config

    engines = [{"host": "127.0.0.1", "port": 8001}, {"host": "127.0.0.1", "port": 8002}]
    (tmp_path / "epp.yaml").write_text((CORPUS / "gie-saturation-flow-control.yaml").read_text())
    (tmp_path / "gateway.yaml").write_text(
        yaml.safe_dump({"engines": engines, "models": ["tiny"], "router": "epp.yaml"})
    )
    gateway = Gateway(tmp_path / "gateway.yaml")
    assert gateway.flow is not None
    saturation = gateway.flow.config["saturation"]
    assert (saturation["queue_threshold"], saturation["kv_threshold"]) == (8, 0.9)
    assert saturation["staleness_s"] == 0.5
    # The precise config's block size becomes the index's; a different one is refused.
    precise = load_config(
        {
            "engines": engines,
            "models": ["tiny"],
            "router": str(CORPUS / "llmd-precise-kv-events.yaml"),
        }
    )
    assert precise.block_size == 64 and precise.flow is None
    with pytest.raises(ConfigError, match="block_size: is 16 but the router config asks"):
        load_config(
            {
                "engines": engines,
                "models": ["tiny"],
                "block_size": 16,
                "router": str(CORPUS / "llmd-precise-kv-events.yaml"),
            }
        )
    # A flow section that sets a threshold differently from saturationDetector is refused.
    with pytest.raises(ConfigError, match=r"flow.saturation.queue_threshold"):
        load_config(
            {
                "engines": engines,
                "models": ["tiny"],
                "router": str(CORPUS / "gie-saturation-flow-control.yaml"),
                "flow": {"saturation": {"type": "utilization", "queue_threshold": 3}},
            }
        )


def test_llm_d_plugin_types_without_a_counterpart_name_what_to_use() -> None:
    cfg = corpus("llmd-precise-data-layer.yaml")
    del cfg["dataLayer"]
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.type") as err:
        Router(EndpointPool(["a"]), config=cfg)
    assert "tokenizer" in str(err.value) and "Router.pick" in str(err.value)


def test_the_gateway_warns_for_engines_without_kv_events(caplog: pytest.LogCaptureFixture) -> None:
    from llmsched.gateway.config import load_config

    caplog.set_level(logging.WARNING, logger="llmsched")
    engines = [
        {"host": "127.0.0.1", "port": 8001, "kv_events": "tcp://127.0.0.1:5557", "topic": "kv@a"},
        {"host": "127.0.0.1", "port": 8002},
    ]
    router = str(CORPUS / "llmd-precise-kv-events.yaml")
    load_config({"engines": engines, "models": ["tiny"], "router": router})
    messages = [r.getMessage() for r in caplog.records]
    assert any("127.0.0.1:8002" in m and "kv_events" in m for m in messages), messages
    assert not any("127.0.0.1:8001" in m for m in messages), messages
