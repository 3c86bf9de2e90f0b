"""The TypedDicts of llmsched.types describe what the native code really returns: every key,
no more and no fewer, checked on live results (a key added or dropped in Rust fails here)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from _data import vector_path

from llmsched import EndpointPool, PrefixIndex, Router, decode_vllm_events
from llmsched.flow import FlowController, FlowRequest, default_config
from llmsched.routing import Endpoint
from llmsched.types import (
    AllBlocksClearedDict,
    ApplyReport,
    BandMetrics,
    BlockRemovedDict,
    BlockStoredDict,
    CandidateInfo,
    EndpointInfo,
    EngineMetricValues,
    EventBatchDict,
    FlowConfig,
    FlowMetrics,
    FlowStats,
    IndexStats,
    MetricsRead,
    PdNote,
    ProfileData,
    ProfileRow,
    RequestInfo,
    ResolvedBand,
    WaitHistogram,
)


def assert_shape(value: Any, shape: Any) -> None:
    assert isinstance(value, dict)
    keys = set(value)
    assert shape.__required_keys__ <= keys, shape.__required_keys__ - keys
    assert keys <= shape.__required_keys__ | shape.__optional_keys__, keys - set(
        shape.__annotations__
    )


def test_prefix_index_results() -> None:
    index = PrefixIndex(block_size=2)
    index.record("w", [1, 2], now=0.0)
    assert_shape(index.stats(), IndexStats)
    event = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [5, 6],
        "block_size": 2,
    }
    payload = msgpack.packb([0.0, [event, {"type": "BlockRemoved", "block_hashes": [7]}], None])
    assert_shape(index.apply_vllm_events("w", payload), ApplyReport)


def test_decoded_events() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5, 6],
        "block_size": 2,
    }
    events = [stored, {"type": "BlockRemoved", "block_hashes": [1]}, {"type": "AllBlocksCleared"}]
    batch = decode_vllm_events(msgpack.packb([0.0, events, None]))
    assert_shape(batch, EventBatchDict)
    for got, shape in zip(
        batch["events"], [BlockStoredDict, BlockRemovedDict, AllBlocksClearedDict], strict=True
    ):
        assert_shape(got, shape)


def test_pool_results() -> None:
    pool = EndpointPool(["a"])
    assert_shape(pool.endpoints()[0], EndpointInfo)
    text = 'vllm:num_requests_waiting{engine="0"} 3.0\n'
    read = pool.update_from_metrics_text("a", text, now=0.0)
    assert_shape(read, MetricsRead)
    assert read["waiting"] == 3 and read["running"] is None
    lora = text + 'vllm:lora_requests_info{running_lora_adapters="x",waiting_lora_adapters="",'
    lora += 'max_lora="2"} 1.0\n'
    assert_shape(pool.update_from_metrics_text("a", lora, now=0.0), MetricsRead)
    assert "active_loras" in pool.update_from_metrics_text("a", lora, now=0.0)


def test_scraped_engine_metrics() -> None:
    from llmsched.integrations.metrics import parse_engine_metrics

    values = parse_engine_metrics(vector_path("vllm_metrics_under_load.txt").read_text())
    assert_shape(values, EngineMetricValues)
    assert {"waiting", "running", "kv_cache_usage"} <= set(values)


def test_plugin_arguments_and_explanations() -> None:
    seen: list[tuple[Any, Any]] = []

    def scorer(request: RequestInfo, candidates: list[CandidateInfo]) -> list[float]:
        seen.append((request, candidates))
        return [0.5] * len(candidates)

    pool = EndpointPool([Endpoint("p", role="prefill"), Endpoint("d", role="decode")])
    config = {
        "plugins": [{"type": "python-scorer", "name": "s", "parameters": {"function": scorer}}],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "s"}]}],
    }
    decision = Router(pool, config=config).pick(tokens=list(range(64)), now=0.0)
    request, candidates = seen[0]
    assert_shape(request, RequestInfo)
    assert_shape(candidates[0], CandidateInfo)
    profile = decision._native.explain_data()[0]
    assert_shape(profile, ProfileData)
    assert_shape(profile["rows"][0], ProfileRow)
    pd_pool = EndpointPool([Endpoint("p", role="prefill"), Endpoint("d", role="decode")])
    pd = Router(pd_pool, config="llm-d-pd").pick(tokens=list(range(4096)), now=0.0).pd()
    assert pd is not None
    assert_shape(pd, PdNote)


def test_flow_results() -> None:
    config = default_config()
    assert_shape(config, FlowConfig)
    ctrl = FlowController({"bands": [{"priority": 1}]})
    assert_shape(ctrl.config["bands"][0], ResolvedBand)
    ctrl.update_endpoint("e", waiting=0, kv_cache_usage=0.1, timestamp=0.5)
    ctrl.enqueue(FlowRequest(1, tenant="t"), now=1.0)
    metrics = ctrl.metrics(now=1.0)
    assert_shape(metrics, FlowMetrics)
    assert_shape(metrics["bands"][0], BandMetrics)
    assert_shape(metrics["bands"][0]["wait_s"], WaitHistogram)
    assert_shape(metrics["flows"][0], FlowStats)


@pytest.mark.parametrize("shape", [IndexStats, FlowMetrics, EndpointInfo])
def test_the_check_fails_on_a_missing_key(shape: Any) -> None:
    value = dict.fromkeys(shape.__required_keys__)
    value.pop(next(iter(shape.__required_keys__)))
    with pytest.raises(AssertionError):
        assert_shape(value, shape)
