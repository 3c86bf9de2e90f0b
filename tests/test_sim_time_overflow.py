"""Probe 58: simulated time that leaves the finite range stops the run with a ConfigError, on
both engines, instead of finishing requests at ``inf`` (a step of 1e308 s, a KV transfer at
1e-300 bytes/s: makespan ``inf``, throughput 0, every latency ``inf``); and the Rust engine's
KV transfer size no longer wraps around 2**64 (``pd.kv_bytes_per_token: 2**63`` moved the KV
almost at once there and took 3e8 s on the reference engine)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation

BASE: dict[str, Any] = {
    "replicas": 2,
    "engine": {"kv_tokens": 100_000},
    "workload": {"kind": "long_short", "num_requests": 6, "arrival": {"rate": 5.0}},
}


@pytest.mark.parametrize("engine", ["rust", "python"])
@pytest.mark.parametrize(
    "over",
    [
        # (b0 + b2 of an hour or more is refused as it loads: test_step_time_profile_files)
        {"step_model": {"linear": {"b0": 0.001, "b1": 1e308, "b2": 0.0}}},
        {"pd": {"prefill_replicas": 1, "transfer_bw": 1e-300}},
        {
            "workload": {
                "kind": "agentic",
                "sessions": 1,
                "followup_turns": 3,
                "first_input": 300,
                "system_prompt_len": 50,
                "think_time_s": 1e308,
            }
        },
    ],
)
def test_time_past_the_finite_range_is_refused(engine: str, over: dict[str, Any]) -> None:
    cfg = ScenarioConfig.from_dict({**BASE, **over})
    policy = "llm-d-pd" if "pd" in over else "round-robin"
    with pytest.raises(ConfigError, match="simulated time"):
        Simulation(cfg, policy, engine=engine).run()


def test_a_huge_kv_transfer_takes_as_long_on_both_engines() -> None:
    # Two 1024-token prompts of 2**55 bytes a token: 2**65 bytes a transfer, which wrapped to 0
    # as a u64. (2**63 bytes a token ran to 5e12 s, past the 2**32 s a run may reach.)
    workload = {
        "kind": "long_short",
        "num_requests": 2,
        "long_fraction": 0.0,
        "short_input": 1024,
        "length_cv": 0.0,
        "arrival": {"rate": 5.0},
    }
    cfg = ScenarioConfig.from_dict(
        {
            **BASE,
            "workload": workload,
            "pd": {"prefill_replicas": 1, "kv_bytes_per_token": 2**55},
        }
    )
    done = {}
    for engine in ("rust", "python"):
        sim = Simulation(cfg, "llm-d-pd", engine=engine)
        done[engine] = sim.run().summary()["e2e_s"]["p50"]
    assert done["rust"] == pytest.approx(done["python"], rel=1e-9)
    assert done["rust"] > 1e9  # 2**65 bytes at 25 GB/s
