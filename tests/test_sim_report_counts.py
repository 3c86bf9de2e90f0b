"""What ``llmsched sim`` reports against what happened, on runs small enough to check by hand:
refused requests are named, ``--policies`` reaches every variant, and a run whose clock went
past where float64 seconds can time a step is refused rather than reported with zero latencies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsched.cli import main
from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.runner import format_table

# One replica of 4096 KV tokens; a step costs 10 ms plus 0.1 ms a prompt token.
BASE: dict[str, Any] = {
    "replicas": 1,
    "step_model": {"linear": {"b0": 0.01, "b1": 1e-4, "b2": 0.0}, "profile": None},
    "engine": {"kv_tokens": 4096},
    "policies": ["round-robin"],
}


def _trace(tmp_path: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workload = {"kind": "trace", "path": str(path), "timestamp_unit": "s", "hash_block": 16}
    return {**BASE, "workload": workload}


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_figures_of_one_request_match_the_step_model(tmp_path: Path, engine: str) -> None:
    data = _trace(tmp_path, [{"timestamp": 0, "input_length": 100, "output_length": 10}])
    s = Simulation(ScenarioConfig.from_dict(data), "round-robin", engine=engine).run().summary()
    # Prefill: 10 ms + 100 x 0.1 ms = 20 ms to the first token, then 9 decode steps of 10 ms.
    assert s["ttft_s"]["p50"] == pytest.approx(0.02)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01)
    assert s["e2e_s"]["p99"] == pytest.approx(0.11)
    assert s["output_tok_s"] == pytest.approx(10 / 0.11)
    assert s["prefill_tokens"] == 100 and s["prefix_hit_rate"] == 0.0


def test_the_table_names_requests_refused(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 5000, "output_length": 10},  # past 4096 KV tokens
        {"timestamp": 0.5, "input_length": 100, "output_length": 10},
    ]
    result = Simulation(ScenarioConfig.from_dict(_trace(tmp_path, rows)), "round-robin").run()
    assert result.summary()["rejected"] == 1 and result.summary()["completed"] == 1
    # The table read like a clean run of one request: the refusal was in no line.
    table = format_table([result], 1.0)
    assert "1 requests refused (1 under round-robin" in table


def test_policies_option_reaches_variants_naming_their_own(tmp_path: Path, capsys: Any) -> None:
    config = {
        **BASE,
        "policies": ["random"],
        "workload": {"kind": "long_short", "num_requests": 4, "short_input": 32},
        "variants": [{"name": "plain"}, {"name": "own", "policies": ["least-load"]}],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out.json"
    argv = ["sim", "--config", str(path), "--policies", "round-robin", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    # The "own" variant ran least-load, which the command line had not asked for.
    policies = [r["policy"] for r in json.loads(out.read_text())["results"]]
    assert policies == ["round-robin [plain]", "round-robin [own]"]
    capsys.readouterr()


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_run_past_float_second_precision_is_refused(engine: str) -> None:
    workload = {
        "kind": "long_short",
        "num_requests": 3,
        "arrival": {"rate": 1e-300},
        "short_input": 50,
        "long_input": 50,
    }
    cfg = ScenarioConfig.from_dict({**BASE, "workload": workload})
    # Arrivals at 1e300 s: every TTFT and latency was reported as 0.0.
    with pytest.raises(ConfigError, match=r"simulated time reached .* past 2\*\*32 s"):
        Simulation(cfg, "round-robin", engine=engine).run()


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_prefill_imbalance_of_a_pd_split_is_over_its_prefill_pool(engine: str) -> None:
    workload = {"kind": "long_short", "num_requests": 40, "arrival": {"rate": 20.0}}
    cfg = ScenarioConfig.from_dict(
        {"replicas": 4, "pd": {"prefill_replicas": 2}, "workload": workload}
    )
    sim = Simulation(cfg, "llm-d-pd", engine=engine)
    summary = sim.run().summary()
    pool = [rep.prefill_tokens for rep in sim.replicas[:2]]
    # The decode replicas' few tokens counted in the mean: twice the pool's imbalance (a
    # 2P+6D split within 10% read 4.4).
    assert summary["prefill_imbalance"] == pytest.approx(max(pool) / (sum(pool) / 2))
    assert summary["prefill_imbalance"] < 1.5


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_kv_series_is_the_mean_over_every_replica(tmp_path: Path, engine: str) -> None:
    data = _trace(tmp_path, [{"timestamp": 0, "input_length": 1000, "output_length": 200}])
    data.update(replicas=4, kv_sample_s=0.1)
    result = Simulation(ScenarioConfig.from_dict(data), "round-robin", engine=engine).run()
    busy = [trace for trace in result.kv_trace if trace]
    assert len(busy) == 1 and len(result.kv_trace) == 4
    # One replica of four held KV: the idle three were left out of the mean, which read 4x.
    series = result.kv_series()["kv_use"]
    assert max(series) == pytest.approx(max(u for _, u in busy[0]) / 4)


def test_kv_series_holds_nothing_before_a_replicas_first_sample(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5},
        {"timestamp": 5, "input_length": 1000, "output_length": 5},  # to the other replica
    ]
    data = _trace(tmp_path, rows)
    data.update(replicas=2, kv_sample_s=0.01)
    result = Simulation(ScenarioConfig.from_dict(data), "round-robin").run()
    series = result.kv_series(points=101)  # every 0.05 s up to the last sample
    between = [u for t, u in zip(series["t"], series["kv_use"], strict=True) if 1.0 < t < 4.9]
    # Both replicas are empty from the first request's end to the second's arrival; the
    # second replica's first sample (at 5 s) was used for every earlier point.
    assert between and max(between) == 0.0
