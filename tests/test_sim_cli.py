"""Scenario configuration, the comparison runner and the ``llmsched sim`` command."""

from __future__ import annotations

import json

import pytest
import yaml

from llmsched.cli import main
from llmsched.errors import ConfigError
from llmsched.sim.config import SCENARIOS, ScenarioConfig, load_scenario
from llmsched.sim.results import jain
from llmsched.sim.runner import compare, format_table

TINY = {
    "replicas": 2,
    "policies": ["random", "round-robin"],
    "workload": {"kind": "long_short", "num_requests": 60, "arrival": {"rate": 20.0}},
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_named_scenarios_load(name: str) -> None:
    cfg = load_scenario(name)
    assert cfg.name == name and cfg.description


def test_base_scenario_and_merging(tmp_path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "shared-prefix", "workload": {"num_requests": 10}}))
    cfg = load_scenario(path=path)
    assert cfg.workload["kind"] == "shared_prefix" and cfg.workload["num_requests"] == 10
    variants = load_scenario("pd", None).expand()
    assert [label for label, _ in variants] == ["8 mixed", "2P+6D", "3P+5D"]
    assert variants[1][1].pd.prefill_replicas == 2 and variants[1][1].policies == ["llm-d-pd"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"replica": 3}, r"unknown key\(s\) \['replica'\]"),
        ({"base": "nope"}, "unknown base scenario"),
        ({"replicas": 0}, "replicas"),
        ({"pd": {"prefill_replicas": 8}}, "prefill_replicas"),
        ({"engine": {"block_size": 0}}, "block_size"),
        ({"engine": {"scheduling": "lifo"}}, "scheduling"),
        ({"engine": {"tokens": 3}}, "engine"),
        ({"slo": {"1": {"ttft": 1}}}, "slo"),
        ({"policies": []}, "policies"),
        ({"metrics_delay_s": -1}, "metrics_delay_s"),
    ],
)
def test_config_errors(data, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ScenarioConfig.from_dict(data)


def test_unknown_policy_is_named() -> None:
    from llmsched.sim import Simulation

    with pytest.raises(ConfigError, match="unknown policy 'fastest'"):
        Simulation(ScenarioConfig.from_dict(TINY), "fastest")


def test_jain_index() -> None:
    assert jain([2.0, 2.0]) == 1.0
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    assert jain([]) == 1.0


def test_compare_in_processes_matches_in_process() -> None:
    cfg = ScenarioConfig.from_dict(TINY)
    serial = compare(cfg, jobs=1, progress=False)
    parallel = compare(cfg, jobs=2, progress=False)
    assert [r.policy for r in parallel] == ["random", "round-robin"]
    for a, b in zip(serial, parallel, strict=True):
        assert a.summary()["ttft_s"] == b.summary()["ttft_s"]
    table = format_table(serial, 1.0)
    assert "round-robin" in table and "requests/s" in table


def test_cli_runs_a_scenario_file(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the sim extra (matplotlib)")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(TINY))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["sim", "--config", str(path), "--json", str(out_json), "--plot", str(out_png)]
    assert main([*args, "--jobs", "1", "--seed", "4", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "random" in printed
    doc = json.loads(out_json.read_text())
    assert doc["scenario"]["seed"] == 4
    assert [r["policy"] for r in doc["results"]] == ["random", "round-robin"]
    first = doc["results"][0]
    for key in ("ttft_s", "tpot_s", "e2e_s", "output_tok_s", "prefix_hit_rate", "kv_use_series"):
        assert key in first
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_policies_flag_and_errors(tmp_path, capsys) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(TINY))
    assert main(["sim", "--config", str(path), "--policies", "round-robin", "--quiet"]) == 0
    assert "random " not in capsys.readouterr().out
    assert main(["sim", "--scenario", "nope", "--quiet"]) == 2
    assert "unknown base scenario" in capsys.readouterr().err
    assert main(["sim", "--list"]) == 0
    assert "agentic" in capsys.readouterr().out


def test_the_progress_bar_counts_a_traces_lines_without_reading_it_in_python(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar's total is the trace's non-blank lines (at most ``limit``), counted without the
    Python reader: it parsed and checked every line (and kept them all) just to count."""
    import io

    from llmsched.sim import workloads

    lines = [json.dumps({"timestamp": t, "input_length": 32, "output_length": 2}) for t in range(7)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines[:3]) + "\n\n   \n" + "\n".join(lines[3:]) + "\n")

    def refuse(*_: object) -> None:
        raise AssertionError("the Python trace reader ran")

    monkeypatch.setattr(workloads, "_read_trace", refuse)
    for limit, total in ((None, 7), (5, 5), (50, 7)):
        workload = {"kind": "trace", "path": str(path), "timestamp_unit": "s", "limit": limit}
        cfg = ScenarioConfig.from_dict({**TINY, "policies": ["random"], "workload": workload})
        out = io.StringIO()
        (result,) = compare(cfg, jobs=1, progress=True, out=out, engine="rust")
        assert result.summary()["completed"] == total
        assert f"/{total} " in out.getvalue() or f"/{total}[" in out.getvalue()
