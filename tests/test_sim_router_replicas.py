"""Several router replicas in the simulator: each with its own pool and index, requests spread
over them in turn, alone or synced by replica sync (the real `ReplicaSync` of the core)."""

from __future__ import annotations

import pytest

from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation


def summary(policy: str, **over: object) -> dict:
    config = {
        "base": "router-replicas",
        "variants": [],
        "workload": {"kind": "agentic", "sessions": 300},
        **over,
    }
    return Simulation(ScenarioConfig.from_dict(config), policy).run().summary()


def test_one_router_is_the_plain_simulation() -> None:
    plain = Simulation(
        ScenarioConfig.from_dict(
            {
                "base": "agentic",
                "kv_events_delay_s": 0.05,
                "workload": {"kind": "agentic", "sessions": 300},
            }
        ),
        "llm-d",
    ).run()
    one = summary("llm-d", router_replicas=1)
    assert one["ttft_s"] == plain.summary()["ttft_s"]
    assert "router_replicas" not in one


def test_unsynced_replicas_lose_what_sync_keeps() -> None:
    """dynamo-kv reads in-flight counts: eight replicas on their own state give a worse TTFT
    tail than one router; synced at once they route exactly like it, and with a 5 ms delay
    (the default flush interval) close to it; a 100 ms delay is worse than no sync (the
    replicas act together on the same stale counts)."""
    one = summary("dynamo-kv")
    alone = summary("dynamo-kv", router_replicas=8)
    synced = summary("dynamo-kv", router_replicas=8, router_sync_delay_s=0.005)
    at_once = summary("dynamo-kv", router_replicas=8, router_sync_delay_s=0.0)
    stale = summary("dynamo-kv", router_replicas=8, router_sync_delay_s=0.1)
    assert alone["ttft_s"]["p99"] > 1.1 * one["ttft_s"]["p99"], (alone, one)
    assert at_once["ttft_s"] == one["ttft_s"]
    assert synced["ttft_s"]["p99"] < alone["ttft_s"]["p99"]
    assert stale["ttft_s"]["p99"] > alone["ttft_s"]["p99"]
    assert alone["sync_bytes_per_request"] == 0
    assert synced["sync_bytes_per_request"] > 0
    assert synced["router_replicas"] == 8
    assert synced["completed"] == alone["completed"] == one["completed"]


def test_llm_d_records_reach_every_replica_when_synced() -> None:
    """With KV events 50 ms late, a replica learns a session's placement from another's record
    only through sync: synced, eight replicas route like one."""
    one = summary("llm-d")
    synced = summary("llm-d", router_replicas=8, router_sync_delay_s=0.0)
    assert synced["prefix_hit_rate"] == pytest.approx(one["prefix_hit_rate"], abs=0.005)


def test_router_replicas_are_checked_and_need_the_rust_engine() -> None:
    with pytest.raises(ConfigError, match="router_replicas"):
        ScenarioConfig.from_dict({"router_replicas": 0}).validate()
    with pytest.raises(ConfigError, match="router_sync_delay_s"):
        ScenarioConfig.from_dict({"router_replicas": 2, "router_sync_delay_s": -1}).validate()
    with pytest.raises(ConfigError, match="Rust engine only"):
        Simulation(ScenarioConfig.from_dict({"router_replicas": 2}), "llm-d", native_kv=False)
    with pytest.raises(ConfigError, match="Rust engine only"):
        Simulation(ScenarioConfig.from_dict({"router_replicas": 2}), "llm-d", engine="python")
