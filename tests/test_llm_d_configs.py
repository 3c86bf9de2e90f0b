"""Configs published by llm-d and the Gateway API Inference Extension load, and decide as they do
there (tests/data/llm-d-configs/README.md says where each file comes from)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
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
    "llmd-precise-data-layer.yaml",
    "llmd-pd-disagg.yaml",
    "llmd-precise-token-producer.yaml",
    "llmd-default-parser.yaml",
    "llmd-sim-epp.yaml",
    "llmd-utilization-detector.yaml",
]


def corpus(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CORPUS / name).read_text())
    return loaded


def test_the_corpus_is_listed_with_its_sources() -> None:
    files = sorted(p.name for p in CORPUS.glob("*.yaml"))
    assert files == sorted(LOADING)
    readme = (CORPUS / "README.md").read_text()
    for name in files:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("name", LOADING)
def test_published_configs_load(name: str) -> None:
    router = Router(EndpointPool(["a", "b"]), PrefixIndex(_block_size(name)), CORPUS / name)
    assert router.profiles == [p["name"] for p in corpus(name)["schedulingProfiles"]]
    assert router.pick(tokens=list(range(200)), now=0.0).endpoint in ("a", "b")


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
    cfg["plugins"][1]["type"] = "k8s-notification-source"
    with pytest.raises(ConfigError, match=r"plugins\[1\]\.type") as err:
        Router(EndpointPool(["a"]), config=cfg)
    assert "discovery file" in str(err.value)
    cfg = corpus("llmd-precise-data-layer.yaml")
    cfg["dataLayer"]["discovery"] = {"pluginRef": "endpoint-notification-source"}
    with pytest.raises(ConfigError, match=r"dataLayer\.discovery"):
        Router(EndpointPool(["a"]), config=cfg)
    cfg = corpus("llmd-precise-data-layer.yaml")
    cfg["dataLayer"]["sources"][0]["extractors"][0]["pluginRef"] = "queue-scorer"
    with pytest.raises(ConfigError, match=r"dataLayer\.sources\[0\]\.extractors\[0\]"):
        Router(EndpointPool(["a"]), config=cfg)


def test_the_gateway_warns_for_engines_without_kv_events(caplog: pytest.LogCaptureFixture) -> None:
    from llmsched.gateway.config import load_config

    caplog.set_level(logging.WARNING, logger="llmsched")
    engines = [
        {"host": "127.0.0.1", "port": 8001, "kv_events": "tcp://127.0.0.1:5557", "topic": "kv@a"},
        {"host": "127.0.0.1", "port": 8002},
    ]
    router = str(CORPUS / "llmd-precise-kv-events.yaml")
    # One model: the engine without kv_events publishes to kvEventsConfig.zmqEndpoint.
    config = load_config({"engines": engines, "models": ["tiny"], "router": router})
    assert (config.engines[1].kv_events, config.engines[1].topic) == (
        "tcp://*:5557",
        "kv@127.0.0.1@tiny",
    )
    assert not [r for r in caplog.records if "8002" in r.getMessage()]
    # Two models and none named on the engine: its topic is unknown, so it is left out.
    load_config({"engines": engines, "models": ["tiny", "big"], "router": router})
    messages = [r.getMessage() for r in caplog.records]
    assert any("127.0.0.1:8002" in m and "kv_events" in m for m in messages), messages
    assert not any("127.0.0.1:8001" in m for m in messages), messages


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_data_layer_sample_feeds_the_index_through_one_shared_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """llm-d's current precise sample: every vLLM pod publishes to the scheduler's one
    ``zmqEndpoint`` as ``kv@<pod-ip>@<model>``; the gateway binds it once and each topic feeds
    its engine's worker in the index, with vLLM's hashes for block size 64 and seed "42"."""
    import zmq

    from llmsched.gateway.config import load_config
    from llmsched.integrations import KVEventSubscriber

    # The token-producer's model is found in the local Hugging Face cache.
    snapshot = tmp_path / "hub" / "models--hf-repo--model-name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = corpus("llmd-precise-data-layer.yaml")
    info = config_info(cfg)
    assert info["tokenizer"] == {"key": "plugins[0]", "model": "hf-repo/model-name"}
    assert info["data_layer"] == {
        "sources": [
            {
                "source": "endpoint-notification-source",
                "extractors": ["precise-prefix-cache-scorer"],
            }
        ],
        "inject_defaults": True,
    }
    assert "plugins[0].type" in [n["key"] for n in info["notes"]]  # tokenizer -> token-producer
    port = _free_port()
    scorer = cfg["plugins"][4]["parameters"]
    scorer["kvEventsConfig"] = {"zmqEndpoint": f"tcp://127.0.0.1:{port}"}
    engines = [{"host": "127.0.0.1", "port": 8001}, {"host": "127.0.0.2", "port": 8002}]
    gateway = load_config({"engines": engines, "models": ["tiny"], "router": cfg})
    assert gateway.tokenizer == snapshot and gateway.block_size == 64
    wired = [(e.kv_events, e.kv_events_bind, e.topic) for e in gateway.engines]
    assert wired == [
        (f"tcp://127.0.0.1:{port}", True, "kv@127.0.0.1@tiny"),
        (f"tcp://127.0.0.1:{port}", True, "kv@127.0.0.2@tiny"),
    ]
    index = PrefixIndex(64)
    tokens = list(range(192))
    hashes = block_hashes(tokens, 64, seed="42", algo="vllm_sha256_cbor")
    stored = {
        "type": "BlockStored",
        "block_hashes": [int(h) for h in hashes],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 64,
    }
    second = gateway.engines[1]
    with KVEventSubscriber(index, gateway.engines) as sub:
        assert sub.bound_endpoint(second.worker_id) == f"tcp://127.0.0.1:{port}"
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        try:
            for _ in range(400):  # until the subscription has reached the publisher
                pub.send_multipart([b"kv@127.0.0.9@tiny", (0).to_bytes(8, "big"), b"x"])
                pub.send_multipart(
                    [
                        b"kv@127.0.0.2@tiny",
                        (0).to_bytes(8, "big"),
                        msgpack.packb([0.0, [stored], None]),
                    ]
                )
                if sub.wait_for(lambda c: c["batches"] >= 1, timeout=0.05):
                    break
            # A topic only sharing a prefix with an engine's is delivered and refused; the next
            # batch, sent after it on the same connection, shows it has been read.
            pub.send_multipart([b"kv@127.0.0.2@tiny-2", (0).to_bytes(8, "big"), b"x"])
            empty = msgpack.packb([0.0, [], None])
            pub.send_multipart([b"kv@127.0.0.2@tiny", (1).to_bytes(8, "big"), empty])
            assert sub.wait_for(lambda c: c["batches"] >= 2, timeout=10.0)
        finally:
            pub.close(linger=0)
        assert sub.counters()["topic_rejected"] >= 1
        assert sub.worker_counters(second.worker_id)["batches"] == 2
        assert sub.worker_counters(gateway.engines[0].worker_id)["batches"] == 0
    pool = EndpointPool([e.worker_id for e in gateway.engines])
    decision = Router(pool, index, cfg).pick(tokens=tokens, now=0.0)
    assert decision.endpoint == second.worker_id
    assert decision.cached_tokens()[second.worker_id] == 192


def test_engines_sharing_a_bound_endpoint_need_distinct_topics() -> None:
    from llmsched.integrations import EngineSpec, KVEventSubscriber

    shared = "tcp://127.0.0.1:5999"
    a = EngineSpec("127.0.0.1", 8001, kv_events=shared, kv_events_bind=True, topic="kv@a@m")
    for b, word in (
        (EngineSpec("127.0.0.2", 8002, kv_events=shared, kv_events_bind=True), "without a topic"),
        (
            EngineSpec("127.0.0.2", 8002, kv_events=shared, kv_events_bind=True, topic="kv@a@m"),
            "same topic",
        ),
    ):
        with pytest.raises(ConfigError, match=word):
            KVEventSubscriber(PrefixIndex(16), [a, b])


def test_pd_sample_splits_as_llm_ds_disagg_handler(tmp_path: Path) -> None:
    """llm-d's current P/D sample: the decode profile runs first; the prefill profile runs when
    the prefix-based decider finds at least 16 prompt tokens not cached on the decode endpoint;
    the prefill endpoint goes to the decode endpoint in ``x-prefiller-host-port``."""
    from llmsched import Endpoint
    from llmsched.gateway.config import load_config

    pool = EndpointPool(
        [Endpoint("P", address="10.0.0.1:8000", role="prefill"), Endpoint("D", role="decode")]
    )
    router = Router(pool, config=CORPUS / "llmd-pd-disagg.yaml")
    block = router.index.block_size
    tokens = list(range(8 * block + 10))  # 8 whole blocks and 10 tokens more
    cold = router.pick(tokens=tokens, now=0.0)
    assert (cold.endpoint, cold.prefill_endpoint, cold.disaggregated) == ("D", "P", True)
    # 7 blocks cached on the decode endpoint: block + 10 >= 16 tokens uncached, it splits.
    router.index.store("D", router.index.hash_tokens(tokens[: 7 * block]))
    warm = router.pick(tokens=tokens, now=0.0)
    assert (warm.endpoint, warm.prefill_endpoint) == ("D", "P")
    # 8 blocks cached: 10 < 16 tokens uncached, the decode endpoint prefills itself.
    router.index.store("D", router.index.hash_tokens(tokens[: 8 * block]))
    hot = router.pick(tokens=tokens, now=0.0)
    assert (hot.endpoint, hot.prefill_endpoint, hot.disaggregated) == ("D", None, False)
    # Without deciders.prefill the handler runs the decode profile alone (and says so).
    cfg = corpus("llmd-pd-disagg.yaml")
    del cfg["plugins"][7]["parameters"]
    alone = Router(pool, config=cfg)
    assert any("never runs" in w for w in alone.warnings)
    assert alone.pick(tokens=list(range(500)), now=0.0).prefill_endpoint is None
    # The gateway sets llm-d's prefill header.
    engines = [{"host": "127.0.0.1", "port": 8001}]
    router_path = str(CORPUS / "llmd-pd-disagg.yaml")
    gateway = load_config({"engines": engines, "models": ["tiny"], "router": router_path})
    assert (gateway.pd.enabled, gateway.pd.header) == (True, "x-prefiller-host-port")
    with pytest.raises(ConfigError, match=r"pd\.enabled"):
        load_config(
            {
                "engines": engines,
                "models": ["tiny"],
                "router": router_path,
                "pd": {"enabled": False},
            }
        )


def test_a_config_without_profiles_gets_the_extensions_default() -> None:
    """The Extension builds one profile, "default", with every filter, scorer (weight 1) and
    picker declared. With the prefix scorer at weight 3 the endpoint holding the prompt wins;
    without profiles the three scorers weigh 1 each, so holding the prompt (prefix 1, queue 0)
    and being idle (prefix 0, queue 1) tie and the lower KV-cache use decides."""
    cfg = corpus("gie-plugins-v2.yaml")
    cfg["schedulingProfiles"][0]["plugins"][2]["weight"] = 3
    pool = _pool(2)
    pool.update("e0", waiting=10, kv_cache_usage=0.2, now=0.0)
    pool.update("e1", waiting=0, kv_cache_usage=0.1, now=0.0)
    tokens = list(range(128))
    weighted = Router(pool, config=cfg)
    weighted.index.store("e0", weighted.index.hash_tokens(tokens))
    assert weighted.pick(tokens=tokens, now=0.0).endpoint == "e0"
    del cfg["schedulingProfiles"]
    info = config_info(cfg)
    assert info["default_profile"] is True
    assert any(n["key"] == "schedulingProfiles" for n in info["notes"])
    router = Router(pool, config=cfg)
    assert router.profiles == ["default"]
    router.index.store("e0", router.index.hash_tokens(tokens))
    decision = router.pick(tokens=tokens, now=0.0)
    assert decision.endpoint == "e1"
    row = decision.explain()["default"].row("e0").scores
    assert set(row) == {"queue-scorer", "kv-cache-scorer", "prefix-cache-scorer"}


def test_engines_added_later_are_wired_like_the_first(tmp_path: Path) -> None:
    """An engine discovery (or the admin API) adds later publishes to the shared endpoint too."""
    import asyncio

    from llmsched.gateway import Gateway
    from llmsched.integrations import EngineSpec

    (tmp_path / "gateway.yaml").write_text(
        yaml.safe_dump(
            {
                "engines": [{"host": "127.0.0.1", "port": 8001}],
                "models": ["tiny"],
                "router": str(CORPUS / "llmd-precise-kv-events.yaml"),
            }
        )
    )
    gateway = Gateway(tmp_path / "gateway.yaml")
    later = EngineSpec("127.0.0.3", 8003)
    added, removed = asyncio.run(gateway.set_engines([*gateway.engines, later]))
    assert (added, removed) == ([later.worker_id], [])
    wired = {e.worker_id: (e.kv_events, e.topic) for e in gateway.engines}
    assert wired[later.worker_id] == ("tcp://*:5557", "kv@127.0.0.3@tiny")


def test_newest_precise_sample_reads_metrics_through_the_scraper() -> None:
    """The newest sample declares the metrics source and extractor: the engines' queues and
    KV-cache use come from their vLLM metrics (here the text a scrape returns), and with the
    same prefix cached on both endpoints the shorter queue wins."""
    from llmsched.gateway.config import load_config

    name = "llmd-precise-token-producer.yaml"
    info = config_info(CORPUS / name)
    assert info["metrics_source"] == {"key": "plugins[2]", "path": "/metrics"}
    assert info["tokenizer"] == {"key": "plugins[0]", "model": "hf-repo/model-name"}
    layer = info["data_layer"]
    assert layer is not None
    assert [s["source"] for s in layer["sources"]] == [
        "metrics-data-source",
        "endpoint-notification-source",
    ]
    assert "plugins[0].parameters.vllm.http" in [n["key"] for n in info["notes"]]
    pool = _pool(2)
    for endpoint, waiting in (("e0", 9), ("e1", 2)):
        text = f'vllm:num_requests_waiting{{engine="0"}} {waiting}\nvllm:kv_cache_usage_perc 0.3\n'
        assert pool.update_from_metrics_text(endpoint, text, now=0.0)["waiting"] == waiting
    index = PrefixIndex(64)
    router = Router(pool, index, CORPUS / name)
    tokens = list(range(128))
    for endpoint in ("e0", "e1"):
        index.store(endpoint, index.hash_tokens(tokens))
    assert router.pick(tokens=tokens, now=0.0).endpoint == "e1"
    # The source's path is the engines' metrics path; turning the scraper off contradicts it.
    cfg = corpus(name)
    cfg["plugins"][2]["parameters"] = {"path": "/engine-metrics"}
    engines = [{"host": "127.0.0.1", "port": 8001}]
    gateway = load_config({"engines": engines, "models": ["tiny"], "router": cfg})
    assert gateway.engines[0].metrics_path == "/engine-metrics"
    with pytest.raises(ConfigError, match=r"scrape\.enabled"):
        load_config(
            {"engines": engines, "models": ["tiny"], "router": cfg, "scrape": {"enabled": False}}
        )
    cfg["plugins"][3]["parameters"] = {"engineConfigs": [{"name": "custom"}]}
    with pytest.raises(ConfigError, match=r"plugins\[3\]\.parameters\.engineConfigs"):
        config_info(cfg)


def _config(plugins: list[Any], profiles: list[Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kind": "EndpointPickerConfig", "plugins": plugins}
    if profiles is not None:
        cfg["schedulingProfiles"] = profiles
    return cfg


def test_llm_ds_current_prefix_scorer_parameters_load() -> None:
    """Probe 54 F1: llm-d's deploy/config/sim-pd-epp-config.yaml names the prefix scorer's
    current parameters (approximateprefix/types.go); they were refused as unknown fields.
    maxPrefixTokensToMatch caps both counts at tokens / blockSizeTokens blocks."""
    cfg = _config(
        [
            {
                "type": "prefix-cache-scorer",
                "parameters": {
                    "blockSizeTokens": 16,
                    "autoTune": False,
                    "maxPrefixBlocksToMatch": 256,
                    "maxPrefixTokensToMatch": 64,
                    "lruCapacityPerServer": 31250,
                },
            },
            {"type": "max-score-picker"},
        ]
    )
    info = config_info(cfg)
    assert info["block_size"] == 16
    assert any(n["key"] == "plugins[0].parameters.autoTune" for n in info["notes"])
    router = Router(_pool(2), config=cfg)
    tokens = list(range(160))  # 10 blocks; the cap is 64 / 16 = 4
    router.index.store("e0", router.index.hash_tokens(tokens[:64]))
    row = router.pick(tokens=tokens, now=0.0).explain()["default"].row("e0").scores
    assert row["prefix-cache-scorer"] == pytest.approx(1.0)


def test_lora_scorer_matches_the_model_name_without_an_adapter() -> None:
    """Probe 54 F2: the Extension's lora-affinity-scorer matches the target model, so a
    base-model request scores 0.8 where another adapter fits and 0 where none does (it scored
    1.0 everywhere)."""
    pool = _pool(2)
    pool.set_loras("e0", ["a1", "a2"], [], max_loras=2)
    pool.set_loras("e1", ["a1"], [], max_loras=2)
    router = Router(pool, config=_config([{"type": "lora-affinity-scorer"}]))
    scores = router.pick(tokens=[1, 2, 3], model="base", now=0.0).explain()["default"]
    assert scores.row("e0").scores["lora-affinity-scorer"] == pytest.approx(0.0)
    assert scores.row("e1").scores["lora-affinity-scorer"] == pytest.approx(0.8)


def test_a_profile_without_a_picker_takes_the_declared_picker() -> None:
    """Probe 54 F3: llm-d's loader (config/loader/defaults.go) gives a profile listing no
    picker a declared picker; llmsched gave it a new max-score-picker."""
    cfg = _config(
        [{"type": "queue-scorer"}, {"type": "random-picker", "name": "rp"}],
        [{"name": "default", "plugins": [{"pluginRef": "queue-scorer"}]}],
    )
    info = config_info(cfg)
    assert any(n["key"] == "schedulingProfiles[0].plugins" for n in info["notes"])
    decision = Router(_pool(3), config=cfg, seed=1).pick(tokens=[1], now=0.0)
    assert "picker rp" in str(decision.explain())


def test_pd_handler_uses_the_declared_prefix_decider_by_default() -> None:
    """Probe 54 F4: llm-d's pd-profile-handler defaults deciderPluginName to the plugin named
    prefix-based-pd-decider, and takes primaryPort / prefixPluginType / prefixPluginName; those
    were refused and the inline decider (0: always split) ran instead."""
    cfg = _config(
        [
            {"type": "decode-filter"},
            {"type": "prefill-filter"},
            {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 1000}},
            {"type": "pd-profile-handler", "parameters": {"primaryPort": 8000}},
        ],
        [
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]},
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
        ],
    )
    info = config_info(cfg)
    assert any(n["key"] == "plugins[3].parameters.primaryPort" for n in info["notes"])
    from llmsched import Endpoint

    pool = EndpointPool([Endpoint("p", role="prefill"), Endpoint("d", role="decode")])
    decision = Router(pool, config=cfg).pick(tokens=list(range(64)), now=0.0)
    assert decision.endpoint == "d" and not decision.disaggregated


def test_llm_ds_label_selector_pd_example_splits() -> None:
    """Probe 54 F1, F12: the P/D example of llm-d's docs/disaggregation.md (its current
    label-selector-filter, a prefix scorer with blockSizeTokens and autoTune) was refused; it
    loads and splits when at least 8 prompt tokens are not cached on the decode endpoint."""
    from llmsched import Endpoint

    def selector(name: str, role: str) -> dict[str, Any]:
        expr = {"key": "role", "operator": "In", "values": [role]}
        return {
            "type": "label-selector-filter",
            "name": name,
            "parameters": {"matchExpressions": [expr]},
        }

    prefix = {
        "type": "prefix-cache-scorer",
        "parameters": {"autoTune": False, "blockSizeTokens": 5, "maxPrefixBlocksToMatch": 256},
    }
    handler = {
        "type": "disagg-profile-handler",
        "parameters": {
            "profiles": {"prefill": "prefill", "decode": "decode"},
            "deciders": {"prefill": "prefix-based-pd-decider"},
        },
    }
    cfg = _config(
        [
            selector("prefill-pods", "prefill"),
            selector("decode-pods", "decode"),
            prefix,
            {"type": "max-score-picker"},
            {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 8}},
            handler,
        ],
        [
            {"name": n, "plugins": [{"pluginRef": f"{n}-pods"}, {"pluginRef": "max-score-picker"}]}
            for n in ("prefill", "decode")
        ],
    )
    assert config_info(cfg)["block_size"] == 5
    pool = EndpointPool(
        [
            Endpoint("P", address="10.0.0.1:8000", labels={"role": "prefill"}),
            Endpoint("D", labels={"role": "decode"}),
        ]
    )
    router = Router(pool, config=cfg)
    decision = router.pick(tokens=list(range(40)), now=0.0)
    assert decision.endpoint == "D" and decision.prefill_endpoint == "P"
    assert not router.pick(tokens=list(range(5)), now=0.0).disaggregated


def test_llm_ds_active_request_and_no_hit_lru_parameters_load() -> None:
    """Probe 54 F13, F14: llm-d's active-request-scorer `maxBusyScore` and no-hit-lru-scorer
    `prefixPluginType` were refused as unknown parameters. Busy endpoints score
    `(max - n) / max * maxBusyScore`; a value outside [0, 1] names the key."""
    cfg = _config(
        [
            {"type": "active-request-scorer", "parameters": {"maxBusyScore": 0.5}},
            {
                "type": "no-hit-lru-scorer",
                "parameters": {"prefixPluginType": "prefix-cache-scorer"},
            },
            {"type": "max-score-picker"},
        ]
    )
    router = Router(_pool(3), config=cfg)
    in_flight = []  # kept: a decision let go gives its in-flight count back
    for endpoint, busy in (("e1", 2), ("e2", 4)):
        for _ in range(busy):
            in_flight.append(router.pick(tokens=[1], now=0.0))
            in_flight[-1].started(endpoint)
    table = router.pick(tokens=[1], now=0.0).explain()["default"]
    scores = [table.row(e).scores["active-request-scorer"] for e in ("e0", "e1", "e2")]
    assert scores == pytest.approx([1.0, 0.25, 0.0])
    bad = _config([{"type": "active-request-scorer", "parameters": {"maxBusyScore": 2}}])
    with pytest.raises(ConfigError, match="maxBusyScore"):
        Router(_pool(1), config=bad)


def test_current_api_version_loads_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    """llm-d reads `llm-d.ai/v1alpha1` and the Extension's deprecated
    `inference.networking.x-k8s.io/v1alpha1`; its loader refuses any other apiVersion, and so
    does llmsched, naming the file and the key. The sample's decode filter and prefix scorer
    (weight 2) decide as in llm-d: the prefill endpoint holding the whole prompt is filtered
    out, and the decode endpoint holding half of it beats the one holding none."""
    pool = EndpointPool(
        [Endpoint("p", role="prefill"), Endpoint("d1", role="decode"), Endpoint("d2")],
        stale_policy="ignore",
    )
    router = Router(pool, config=CORPUS / "llmd-sim-epp.yaml")
    tokens = list(range(128))
    hashes = router.index.hash_tokens(tokens)
    router.index.store("p", hashes)
    router.index.store("d1", hashes[: len(hashes) // 2])
    decision = router.pick(tokens=tokens, now=0.0)
    assert decision.endpoint == "d1" and "p" not in [decision.endpoint, *decision.fallbacks]
    for field, value, expected in [
        ("apiVersion", "example.com/v9", "must be llm-d.ai/v1alpha1 or inference.networking"),
        ("kind", "EndpointPickerConfg", 'got "EndpointPickerConfg"'),
    ]:
        cfg = corpus("llmd-sim-epp.yaml")
        cfg[field] = value
        path = tmp_path / "epp.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with pytest.raises(ConfigError) as info:
            Router(pool, config=path)
        assert str(info.value).startswith(f"router config {str(path)!r}: {field}: ")
        assert expected in str(info.value)


def test_a_configmap_is_refused_naming_the_key_that_holds_the_config(tmp_path: Path) -> None:
    """llm-d's charts render the config into a ConfigMap the endpoint picker mounts as a file;
    given the ConfigMap itself, the error says which `data` key holds the config."""
    text = (CORPUS / "llmd-sim-epp.yaml").read_text()
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "epp-config"},
        "data": {"epp-config.yaml": text},
    }
    path = tmp_path / "configmap.yaml"
    path.write_text(yaml.safe_dump(configmap))
    with pytest.raises(ConfigError, match=r'kind: is ConfigMap.*data\."epp-config\.yaml"'):
        config_info(path)
    assert config_info(yaml.safe_load(configmap["data"]["epp-config.yaml"]))["notes"] == []


def test_errors_about_a_router_file_name_it(tmp_path: Path) -> None:
    """The native parser names the key; a Router, config_info and the gateway name the file."""
    from llmsched.gateway.config import load_config

    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"plugins": [{"type": "data-parallel-profile-handler"}]}))
    for call in (lambda: Router(_pool(2), config=path), lambda: config_info(str(path))):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value).startswith(f"router config {str(path)!r}: plugins[0].type: ")
    engines = [{"host": "127.0.0.1", "port": 8001}]
    with pytest.raises(ConfigError, match=r"router: router config '.*dp\.yaml': plugins\[0\]"):
        load_config({"engines": engines, "models": ["tiny"], "router": str(path)})
    with pytest.raises(ConfigError) as info:  # a mapping names no file
        config_info({"plugins": [{"type": "data-parallel-profile-handler"}]})
    assert str(info.value).startswith("plugins[0].type: ")


def test_llm_ds_default_config_with_its_parser_loads() -> None:
    """llm-d's current default config names its OpenAI parser (`parser`, `openai-parser`) and
    the `enableLegacyMetrics` gate: both are noted without effect. Its four scorers weigh 1
    each: queue min-max (e0 1, e1 0, e2 0.5) plus 1 - KV use (0.1, 1.0, 0.8), no prefix and the
    same LoRA score everywhere, so e2 (1.3) beats e0 (1.1) and e1 (1.0)."""
    info = config_info(CORPUS / "llmd-default-parser.yaml")
    assert [n["key"] for n in info["notes"]] == ["featureGates[0]", "parser"]
    pool = _pool(3)
    for name, waiting, kv in [("e0", 1, 0.9), ("e1", 3, 0.0), ("e2", 2, 0.2)]:
        pool.update(name, waiting=waiting, kv_cache_usage=kv, now=0.0)
    router = Router(pool, config=CORPUS / "llmd-default-parser.yaml")
    assert router.pick(tokens=list(range(64)), now=0.0).endpoint == "e2"
    cfg = corpus("llmd-default-parser.yaml")
    del cfg["parser"]  # llm-d's default parser is the same plugin
    assert [n["key"] for n in config_info(cfg)["notes"]] == ["featureGates[0]", "plugins[4].type"]
    refused = [
        ({"pluginRef": "queue-scorer"}, None, "parser.pluginRef", "not an openai-parser"),
        ({"pluginRef": "other"}, None, "parser.pluginRef", "no plugin is named"),
        (None, {"type": "passthrough-parser"}, "plugins[4].type", "OpenAI"),
        (None, {"type": "openai-parser", "parameters": {"x": 1}}, "plugins[4].parameters", ""),
    ]
    # llm-d's own test configs list the parser in a profile: it takes no slot there.
    cfg = corpus("llmd-default-parser.yaml")
    cfg["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": "openai-parser"})
    assert [n["key"] for n in config_info(cfg)["notes"]] == ["featureGates[0]", "parser"]
    cfg["schedulingProfiles"][0]["plugins"][0]["weight"] = 1
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.weight: only scorers .* parser"):
        config_info(cfg)
    for parser, plugin, key, message in refused:
        cfg = corpus("llmd-default-parser.yaml")
        if parser is not None:
            cfg["parser"] = parser
        if plugin is not None:
            cfg["plugins"][4] = plugin
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}: .*{message}"):
            config_info(cfg)


def test_utilization_detector_gives_flow_control_its_thresholds(tmp_path: Path) -> None:
    """llm-d's current saturation detector is a `utilization-detector` plugin that
    `saturationDetector.pluginRef` names (or that is named `utilization-detector`): its
    thresholds become flow control's, as the flat `saturationDetector` fields of earlier
    releases do. The published sample's admitter plugin is refused by its type."""
    from llmsched.gateway import Gateway

    info = config_info(CORPUS / "llmd-utilization-detector.yaml")
    assert info["saturation"] == {
        "queue_depth_threshold": 999999999,
        "kv_cache_util_threshold": 1.0,
        "metrics_staleness_s": None,
    }
    assert info["notes"] == []  # used by saturationDetector: not "declared but unused"
    cfg = corpus("llmd-utilization-detector.yaml")
    cfg["plugins"].insert(0, {"type": "probabilistic-admitter"})
    with pytest.raises(ConfigError, match=r"^plugins\[0\]\.type: .*admission is the gateway"):
        config_info(cfg)
    cfg["plugins"][0] = {"type": "concurrency-detector"}
    with pytest.raises(ConfigError, match=r"^plugins\[0\]\.type: .*utilization-detector"):
        config_info(cfg)
    # Without the section, the plugin named utilization-detector is llm-d's default detector.
    cfg = corpus("llmd-utilization-detector.yaml")
    del cfg["saturationDetector"]
    cfg["plugins"][1]["parameters"] = {"queueDepthThreshold": 7, "metricsStalenessThreshold": "1s"}
    assert config_info(cfg)["saturation"] == {
        "queue_depth_threshold": 7,
        "kv_cache_util_threshold": None,
        "metrics_staleness_s": 1.0,
    }
    refused = [
        ({"pluginRef": "random-picker"}, "saturationDetector.pluginRef", "not a saturation"),
        ({"pluginRef": "nope"}, "saturationDetector.pluginRef", "no plugin is named"),
        (
            {"pluginRef": "utilization-detector", "queueDepthThreshold": 3},
            "saturationDetector.queueDepthThreshold",
            "cannot be given with pluginRef",
        ),
    ]
    for section, key, message in refused:
        cfg = corpus("llmd-utilization-detector.yaml")
        cfg["saturationDetector"] = section
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}: .*{message}"):
            config_info(cfg)
    engines = [{"host": "127.0.0.1", "port": 8001}, {"host": "127.0.0.1", "port": 8002}]
    cfg = corpus("llmd-utilization-detector.yaml")
    cfg["featureGates"] = ["flowControl"]
    cfg["plugins"][1]["parameters"] = {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9}
    (tmp_path / "epp.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "gateway.yaml").write_text(
        yaml.safe_dump({"engines": engines, "models": ["tiny"], "router": "epp.yaml"})
    )
    gateway = Gateway(tmp_path / "gateway.yaml")
    assert gateway.flow is not None
    saturation = gateway.flow.config["saturation"]
    assert (saturation["queue_threshold"], saturation["kv_threshold"]) == (8, 0.9)


def test_utilization_detector_in_a_profile_filters_with_headroom() -> None:
    """As a filter, llm-d keeps endpoints with waiting < queueDepthThreshold * (1 + headroom)
    and KV use < kvCacheUtilThreshold * (1 + headroom): with 5, 0.8 and headroom 0.2 the
    limits are 6 waiting and 0.96, so e1 (6 waiting) and e2 (0.96) go and e0 stays; when every
    endpoint is over, all stay (llm-d's filter fails open)."""
    cfg = {
        "plugins": [
            {"type": "utilization-detector", "parameters": {"headroom": 0.2}},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "utilization-detector"}, {"pluginRef": "queue-scorer"}],
            }
        ],
    }
    pool = _pool(3)
    for name, waiting, kv in [("e0", 5, 0.95), ("e1", 6, 0.0), ("e2", 0, 0.96)]:
        pool.update(name, waiting=waiting, kv_cache_usage=kv, now=0.0)
    decision = Router(pool, config=cfg).pick(tokens=list(range(64)), now=0.0)
    assert (decision.endpoint, decision.fallbacks) == ("e0", [])
    pool.update("e0", waiting=9, kv_cache_usage=0.0, now=0.0)
    decision = Router(pool, config=cfg).pick(tokens=list(range(64)), now=0.0)
    assert decision.endpoint == "e2"  # all over a limit: all kept, the shortest queue wins


def test_utilization_detector_filter_reads_its_own_staleness_threshold() -> None:
    """llm-d's detector, as a filter, drops endpoints whose metrics are older than its
    ``metricsStalenessThreshold`` (llm-d-router's utilization/detector.go, ``Filter``); the
    filter read the pool's staleness instead, so under an ``ignore`` pool (or a pool
    staleness longer than the threshold) it kept endpoints llm-d drops. Left out, the pool's
    staleness still applies (flow control's default follows the scrape interval too)."""

    def config(params: dict[str, Any]) -> dict[str, Any]:
        return {
            "plugins": [
                {"type": "utilization-detector", "parameters": params},
                {"type": "queue-scorer"},
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "utilization-detector"},
                        {"pluginRef": "queue-scorer"},
                    ],
                }
            ],
        }

    for policy in ("ignore", "saturated"):
        pool = EndpointPool(["e0", "e1", "e2"], stale_after_s=5.0, stale_policy=policy)
        pool.update("e0", waiting=0, now=9.7)  # 0.3 s old at 10.0: the idlest, but stale
        pool.update("e1", waiting=2, now=9.9)  # 0.1 s old
        # e2 never reported
        own = Router(pool, config=config({"metricsStalenessThreshold": "200ms"}))
        decision = own.pick(tokens=list(range(64)), now=10.0)
        rows = {r.endpoint: r.removed_by for r in decision.explain()["default"].rows}
        assert decision.endpoint == "e1", policy
        assert rows["e0"] is not None and rows["e2"] is not None and rows["e1"] is None
        # Left out: the pool's 5 s staleness keeps e0 and e1 (and, under ignore, e2).
        pooled = Router(pool, config=config({})).pick(tokens=list(range(64)), now=10.0)
        kept = {r.endpoint for r in pooled.explain()["default"].rows if r.removed_by is None}
        assert kept == ({"e0", "e1", "e2"} if policy == "ignore" else {"e0", "e1"})
        # Every endpoint stale by the threshold: all stay (fails open, as llm-d's filter).
        tight = Router(pool, config=config({"metricsStalenessThreshold": "10ms"}))
        rows = tight.pick(tokens=list(range(64)), now=10.0).explain()["default"].rows
        assert all(r.removed_by is None for r in rows)


def test_a_detector_staleness_no_longer_than_the_scrape_interval_is_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Now that the detector's ``metricsStalenessThreshold`` decides which endpoints it drops,
    one no longer than the gateway's scrape interval would drop every engine for part of
    every interval. Without ``scrape.interval_s`` the interval becomes a quarter of the
    shortest threshold (llm-d's 200 ms: 0.05 s, llm-d's own scrape; not under 0.01 s), the
    detector plugin's or ``saturationDetector``'s; a threshold still no longer than the
    interval (one given, or the 0.01 s floor) is a configuration note (logged, in ``notes``
    and the scheduler's warnings, counted in ``llmsched_gateway_config_warnings`` on either
    plane)."""
    from llmsched.gateway import Gateway
    from llmsched.gateway import load_config as load_gateway_config

    def gateway(threshold: str, **extra: Any) -> dict[str, Any]:
        router = {
            "plugins": [
                {
                    "type": "utilization-detector",
                    "parameters": {"metricsStalenessThreshold": threshold},
                },
                {"type": "queue-scorer"},
            ],
        }
        engines = [{"host": "127.0.0.1", "port": 8001}]
        return {"engines": engines, "models": ["m"], "router": router, **extra}

    def noted(config: dict[str, Any]) -> list[str]:
        return [n for n in load_gateway_config(config).notes if "StalenessThreshold" in n]

    given = gateway("200ms", scrape={"interval_s": 0.2})
    with caplog.at_level(logging.WARNING, logger="llmsched"):
        said = noted(given)
    assert len(said) == 1 and said[0].startswith(
        "router config plugins[0].parameters.metricsStalenessThreshold: 200ms is no longer "
        "than the scrape interval (scrape.interval_s 0.2 s)"
    )
    assert said[0].endswith("or leave scrape.interval_s out (a quarter of it is used)")
    assert any(said[0] in r.getMessage() for r in caplog.records)
    assert said[0] in Gateway(given).scheduler.warnings
    # Fitted: the interval follows the threshold when the config does not set it.
    for threshold, interval in (("200ms", 0.05), ("100ms", 0.025), ("20ms", 0.01), ("1s", 0.2)):
        assert load_gateway_config(gateway(threshold)).scrape.interval_s == interval, threshold
        assert not noted(gateway(threshold)), threshold
    floor = noted(gateway("5ms"))
    assert len(floor) == 1 and "(scrape.interval_s 0.01 s)" in floor[0]
    assert "leave scrape.interval_s out" not in floor[0]
    for quiet in (
        gateway("200ms", scrape={"interval_s": 0.05}),
        gateway("50ms", scrape={"enabled": False}),
    ):
        assert not noted(quiet), quiet
    assert load_gateway_config(gateway("50ms", scrape={"enabled": False})).scrape.interval_s == 0.2
    # The flat saturationDetector threshold (flow control's staleness) counts the same way.
    flat = {
        "engines": [{"host": "127.0.0.1", "port": 8001}],
        "models": ["m"],
        "router": {
            "featureGates": ["flowControl"],
            "saturationDetector": {"metricsStalenessThreshold": "100ms"},
            "plugins": [{"type": "queue-scorer"}],
        },
    }
    assert load_gateway_config(flat).scrape.interval_s == 0.025 and not noted(flat)
    said = noted({**flat, "scrape": {"interval_s": 0.1}})
    assert len(said) == 1
    assert said[0].startswith("router config saturationDetector.metricsStalenessThreshold: 100ms")


@pytest.mark.parametrize(
    ("plugin", "why"),
    [
        ("data-parallel-profile-handler", "one endpoint per rank"),
        ("request-attribute-reporter", "Envoy dynamic metadata"),
        ("latency-scorer", "latency prediction"),
        ("predicted-latency-producer", "latency prediction"),
        ("slo-headroom-tier-filter", "latency prediction"),
        ("latency-slo-admitter", "latency prediction"),
    ],
)
def test_llm_d_plugins_without_a_counterpart_are_refused_by_name(plugin: str, why: str) -> None:
    """These llm-d plugins were refused only as unknown types ("known types: ..."), saying
    neither that llm-d has them nor what to use; each is now refused by name with the reason,
    as encode-filter and passthrough-parser are."""
    cfg = corpus("llmd-precise-data-layer.yaml")
    cfg["plugins"].append({"type": plugin})
    at = len(cfg["plugins"]) - 1
    with pytest.raises(ConfigError, match=rf"plugins\[{at}\]\.type") as err:
        Router(EndpointPool(["a"]), config=cfg)
    message = str(err.value)
    assert f'"{plugin}" is not supported' in message and why in message
    assert "known types" not in message


def test_a_trailing_empty_document_is_read_as_llm_d_reads_it(tmp_path: Path) -> None:
    """A file ending in an empty ``---`` document (as editors and templating leave one) was
    refused ("expected a single document in the stream"), where llm-d's Go loader reads the
    first document. An empty trailing document is accepted without a note."""
    text = (CORPUS / "llmd-precise-data-layer.yaml").read_text()
    for tail in ("---\n", "---\n# nothing here\n", "---\n---\n", "--- \n...\n"):
        path = tmp_path / "trailing.yaml"
        path.write_text(text.rstrip("\n") + "\n" + tail)
        router = Router(EndpointPool(["a"]), config=path)
        assert router.profiles == [
            p["name"] for p in corpus("llmd-precise-data-layer.yaml")["schedulingProfiles"]
        ], tail
        assert [n for n in config_info(path)["notes"] if n["key"] == "---"] == [], tail


def test_several_documents_read_the_first_as_llm_d_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """llm-d's loader decodes the file with Kubernetes' universal decoder, whose YAML path
    (sigs.k8s.io/yaml over go-yaml v2's ``Unmarshal``) decodes the first document and never
    reads the rest. A file of several documents was refused here; it now loads its first
    document as llm-d does, and says once (a configuration note: logged, in
    ``config_info()["notes"]`` and ``Router.warnings``, counted in stats and the gateway's
    ``llmsched_gateway_config_warnings``) that the rest, from the line named, is ignored,
    even a rest that is not valid YAML, which llm-d never parses either. The gateway's own
    config, not llm-d's, still holds one document."""
    from llmsched.gateway import load_config as load_gateway_config

    text = (CORPUS / "llmd-precise-data-layer.yaml").read_text()
    lines = len(text.splitlines())
    want = [p["name"] for p in corpus("llmd-precise-data-layer.yaml")["schedulingProfiles"]]
    # Each tail, and the line of its first document with content past the first.
    tails = [
        ("---\nplugins: []\n", lines + 1),
        ("---\n---\nschedulingProfiles: [\n", lines + 2),
        ("---\n: : ]\n", lines + 1),
    ]
    for i, (tail, line) in enumerate(tails):
        path = tmp_path / f"several-{i}.yaml"
        path.write_text(text + tail)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llmsched"):
            router = Router(EndpointPool(["a"]), config=path)
        assert router.profiles == want, tail
        message = f"routing config ---: the documents from line {line} on are ignored"
        notes = [n for n in config_info(path)["notes"] if n["key"] == "---"]
        assert len(notes) == 1, tail
        assert f"routing config ---: {notes[0]['message']}".startswith(message), tail
        assert sum(w.startswith(message) for w in router.warnings) == 1, tail
        assert router.stats()["config_warnings"] == len(router.warnings)
        # Logged once a process, as every configuration note: the third tail's note is the
        # first's word for word.
        logged = [r for r in caplog.records if r.getMessage().startswith(message)]
        assert len(logged) == (0 if i == 2 else 1), tail
    engines = [{"host": "127.0.0.1", "port": 8001}]
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(yaml.safe_dump({"engines": engines, "models": ["m"]}) + "---\na: 1\n")
    with pytest.raises(ConfigError, match=r"found another document at line"):
        load_gateway_config(gateway)
