"""Probe 76: engine limits past 2**63 - 1 (``engine.max_num_seqs`` and
``engine.max_num_batched_tokens`` take 1..2**64-1) wrapped to a negative budget in the Rust
engine, which then refused every request as one that would never fit; the reference engine
served them all."""

from __future__ import annotations

import pytest

from llmsched.sim import ScenarioConfig, Simulation

WORKLOAD = {"kind": "long_short", "num_requests": 20, "arrival": {"rate": 5.0}}


@pytest.mark.parametrize("key", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_limits_past_i64_serve_as_unlimited_on_both_engines(key: str, value: int) -> None:
    cfg = ScenarioConfig.from_dict({"replicas": 1, "engine": {key: value}, "workload": WORKLOAD})
    rust = Simulation(cfg, "round-robin", engine="rust").run()
    python = Simulation(cfg, "round-robin", engine="python").run()
    assert rust.summary()["completed"] == 20 and rust.rejected == 0
    assert rust.summary()["ttft_s"] == python.summary()["ttft_s"]
    # As good as any limit the workload never reaches.
    bounded = ScenarioConfig.from_dict(
        {"replicas": 1, "engine": {key: 2**40}, "workload": WORKLOAD}
    )
    reference = Simulation(bounded, "round-robin", engine="rust").run()
    assert rust.summary()["e2e_s"] == reference.summary()["e2e_s"]
