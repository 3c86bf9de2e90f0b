"""A trace line with ``output_length: 0`` runs as a request of one output token on both
engines (docs/simulator.md): the token its prefill step produces, as an engine's
``max_tokens`` is at least 1. Its figures are those of a one-token line, never a request that
ends at arrival or is dropped from the counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmsched.sim import ScenarioConfig, Simulation

# One replica; a step costs 10 ms plus 0.1 ms a prompt token.
BASE: dict[str, Any] = {
    "replicas": 1,
    "step_model": {"linear": {"b0": 0.01, "b1": 1e-4, "b2": 0.0}, "profile": None},
    "engine": {"kv_tokens": 4096},
    "policies": ["round-robin"],
}


def _summary(tmp_path: Path, output_length: int, engine: str) -> dict[str, Any]:
    path = tmp_path / f"trace-{output_length}.jsonl"
    rows = [{"timestamp": 0, "input_length": 100, "output_length": output_length}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workload = {"kind": "trace", "path": str(path), "timestamp_unit": "s", "hash_block": 16}
    config = ScenarioConfig.from_dict({**BASE, "workload": workload})
    return dict(Simulation(config, "round-robin", engine=engine).run().summary())


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_line_asking_no_output_runs_as_one_token(tmp_path: Path, engine: str) -> None:
    s = _summary(tmp_path, 0, engine)
    assert s["completed"] == 1 and s["rejected"] == 0 and s["unfinished"] == 0
    # The prefill step, 10 ms + 100 x 0.1 ms, produces the one token and ends the request.
    assert s["ttft_s"]["p50"] == pytest.approx(0.02)
    assert s["e2e_s"]["p50"] == pytest.approx(0.02)
    assert s["output_tok_s"] == pytest.approx(1 / 0.02)
    one = _summary(tmp_path, 1, engine)
    for key in ("ttft_s", "e2e_s", "output_tok_s", "prefill_tokens", "completed"):
        assert s[key] == one[key], key
