"""Probe 58: what ``llmsched sim`` reports beside the figures: the ``--json`` file is strict
JSON where a figure has no samples, and a priority without SLO targets has no attainment."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from llmsched.cli import main
from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.runner import format_table


def _strict(constant: str) -> Any:
    raise ValueError(f"not JSON: {constant}")


def test_json_output_is_strict_json_when_a_figure_has_no_samples(tmp_path) -> None:
    """Every request decodes one token: no TPOT sample, a NaN percentile, which --json wrote as
    the bare word NaN (Python reads it; JSON, jq and browsers do not)."""
    scenario = {
        "replicas": 2,
        "policies": ["random"],
        "workload": {
            "kind": "shared_prefix",
            "num_requests": 10,
            "num_groups": 2,
            "system_prompt_len": 64,
            "question_len": 16,
            "output_len": 1,
        },
    }
    path, out = tmp_path / "s.yaml", tmp_path / "r.json"
    path.write_text(yaml.safe_dump(scenario))
    assert main(["sim", "--config", str(path), "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text(), parse_constant=_strict)
    result = doc["results"][0]
    assert result["completed"] == 10
    assert result["tpot_s"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert result["ttft_s"]["p50"] > 0


TINY: dict[str, Any] = {
    "replicas": 2,
    "policies": ["random"],
    "workload": {"kind": "long_short", "num_requests": 30, "arrival": {"rate": 20.0}},
}


def test_a_priority_without_targets_has_no_attainment() -> None:
    """With no SLO targets every request "met" them: attainment 100%, where the table's legend
    promises "-" without targets."""
    result = Simulation(ScenarioConfig.from_dict({**TINY, "slo": {}}), "random").run()
    summary = result.summary()
    assert summary["completed"] == 30
    assert summary["slo_attainment"] == {}
    row = format_table([result]).splitlines()[2]
    assert "%" not in row.split()[-2] and row.split()[-2] == "-"


def test_targets_of_other_priorities_leave_this_one_out() -> None:
    cfg = ScenarioConfig.from_dict({**TINY, "slo": {"1": {"ttft_s": 1.0}}})
    summary = Simulation(cfg, "random").run().summary()
    assert summary["slo_attainment"] == {}  # every request has priority 0


@pytest.mark.parametrize("target", [1e-9, 1e9])
def test_a_priority_with_targets_keeps_its_attainment(target: float) -> None:
    cfg = ScenarioConfig.from_dict({**TINY, "slo": {"0": {"ttft_s": target}}})
    summary = Simulation(cfg, "random").run().summary()
    assert summary["slo_attainment"] == {0: 0.0 if target < 1 else 1.0}


def test_the_preempt_column_counts_preemptions_as_its_legend_says() -> None:
    """The column is the engines' preemption count (a request preempted five times counts five);
    the legend called it the requests preempted."""
    from llmsched.sim.runner import TABLE_LEGEND

    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 1,
            "engine": {"kv_tokens": 4096},
            "policies": ["round-robin"],
            "workload": {
                "kind": "long_short",
                "num_requests": 24,
                "long_fraction": 0.0,
                "short_input": 300,
                "short_output": 1500,
                "length_cv": 0.0,
                "arrival": {"process": "constant", "rate": 1000.0},
            },
        }
    )
    sim = Simulation(cfg, "round-robin")
    result = sim.run()
    assert sim.record is not None
    per_request = sim.record.requests["preemptions"]
    events, requests = int(per_request.sum()), int((per_request > 0).sum())
    assert events > requests > 0
    row = format_table([result]).splitlines()[2].split()
    assert int(row[-3]) == events == result.summary()["preemptions"]
    legend = next(line for line in TABLE_LEGEND.splitlines() if line.strip().startswith("preempt"))
    assert "requests preempted" not in legend and "preemptions" in legend


def test_table_cells_stay_apart_for_long_names_and_long_times() -> None:
    """Probe 76: a TTFT of 16402.5 s filled its 8-wide column and ran into the next one
    ("16402.5s29557.0s"), and a variant's policy name past 28 characters pushed its row out of
    line with the header."""
    label = "a variant with a long label"
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 1,
            "engine": {"kv_tokens": 10_000, "max_num_seqs": 1},
            "step_model": {"linear": {"b0": 1.0, "b1": 0.0, "b2": 0.0}, "profile": None},
            "policies": ["round-robin"],
            "variants": [{"name": label}],
            "workload": {
                "kind": "long_short",
                "num_requests": 10,
                "long_fraction": 0.0,
                "short_input": 100,
                "short_output": 2000,
                "length_cv": 0.0,
                "arrival": {"process": "constant", "rate": 1000.0},
            },
        }
    )
    from llmsched.sim.runner import compare

    (result,) = compare(cfg, jobs=1, progress=False)
    assert result.summary()["ttft_s"]["p90"] > 10_000
    header, _, row = format_table([result]).splitlines()[:3]
    assert len(row) == len(header)  # each figure under its column's name
    name = f"round-robin [{label}]"
    assert row.startswith(name + "  ")
    cells = row[len(name) :].split()
    assert len(cells) == 13  # out tok/s ... Jain, none run together
    assert cells[2].endswith("s") and 10_000 < float(cells[3].rstrip("s")) < 10**6
