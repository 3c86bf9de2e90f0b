"""The simulator's slice tracker weighs a switch with the simulated replica's own numbers: its
KV capacity, and a linear step model's prefill rate and decode step (it used the cost model's
defaults, an 8B model on an H100: 426,788 KV tokens at 30,790 prompt tokens/s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmsched.sim import LinearStepModel, ScenarioConfig, Simulation


def test_the_cost_model_is_the_replicas() -> None:
    model = LinearStepModel(b0=0.02, b1=1e-3, b2=0.0)
    cost = ScenarioConfig.from_dict({}).slices.cost_model(model, 4096)
    assert cost.kv_capacity_tokens == 4096
    assert cost.decode_step_s == pytest.approx(0.02)
    assert cost.prefill_tokens_per_s == pytest.approx(1000.0)


def test_the_cost_model_has_the_replicas_block_size() -> None:
    """A continuation recomputes its last KV block: the tracker prices it with the simulated
    engine's block size (a size past the cost model's 65,536 is priced as 65,536)."""
    slices = ScenarioConfig.from_dict({"engine": {"block_size": 32}}).slices
    model = LinearStepModel(b0=0.02, b1=1e-3, b2=0.0)
    cost = slices.cost_model(model, 4096, 32)
    assert cost.block_size == 32 and cost.recompute_tokens(48) == 16
    assert slices.cost_model(None, None, 2**20).block_size == 2**16
    assert slices.cost_model(model).block_size == 16


def _scenario(tmp_path: Path) -> dict[str, Any]:
    # One replica, one sequence slot, 4096 KV tokens, 1000 prompt tokens/s, 20 ms a step. A
    # 3000-token request is 128 tokens into its answer when a 3900-token one waits: yielding
    # lets the short one in, which evicts ~95% of the long one's 3128 tokens, 3.1 s to redo.
    rows = [
        {"timestamp": 0, "input_length": 3000, "output_length": 600},
        {"timestamp": 1.0, "input_length": 3900, "output_length": 20},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "replicas": 1,
        "engine": {"kv_tokens": 4096, "max_num_seqs": 1},
        "step_model": {"linear": {"b0": 0.02, "b1": 1e-3, "b2": 0.0}, "profile": None},
        "slices": {"policy": "fixed", "params": {"slice_tokens": 128}},
        "workload": {"kind": "trace", "path": str(path), "timestamp_unit": "s", "hash_block": 16},
    }


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_yield_that_would_be_evicted_is_weighed_as_such(tmp_path: Path, engine: str) -> None:
    cfg = ScenarioConfig.from_dict(_scenario(tmp_path))
    sim = Simulation(cfg, "round-robin", engine=engine)
    summary = sim.run().summary()
    # The switch costs 3.1 s of recompute for 2.56 s gained: the tracker continues. It yielded,
    # seeing 426,788 KV tokens with ~100,000 free, and 2,951 tokens were then recomputed.
    assert sim.slice_switches == 0
    assert summary["recomputed_tokens"] == 0 and summary["completed"] == 2
