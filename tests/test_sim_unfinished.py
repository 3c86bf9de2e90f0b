"""Probe 58: a run that ``max_time_s`` cuts off accounts for every request that arrived: each
finished, was refused, or is counted ``unfinished`` (the requests still queued or running
vanished from every count, so completed + rejected fell short of the arrivals unseen)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.fast import build_plan
from llmsched.sim.runner import format_table

OVERLOADED: dict[str, Any] = {
    "replicas": 1,
    "policies": ["round-robin"],
    "workload": {"kind": "long_short", "num_requests": 400, "arrival": {"rate": 40.0}},
}


def _arrivals_by(config: ScenarioConfig, limit: float) -> int:
    plan = build_plan(config.workload, config.seed, config.engine.block_size, config.seed)
    return int((plan["arrival"] <= limit).sum())


@pytest.mark.parametrize("engine", ["rust", "python"])
@pytest.mark.parametrize("flow", [False, True])
def test_a_cut_off_run_counts_its_unfinished_requests(engine: str, flow: bool) -> None:
    cfg = ScenarioConfig.from_dict({**OVERLOADED, "max_time_s": 4.0, "flow": {"enabled": flow}})
    sim = Simulation(cfg, "round-robin", engine=engine)
    summary = sim.run().summary()
    arrived = _arrivals_by(cfg, 4.0)
    assert 0 < summary["completed"] < arrived
    assert summary["unfinished"] > 0
    assert summary["completed"] + summary["rejected"] + summary["unfinished"] == arrived
    assert sim.record is not None and sim.record.arrived == arrived


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_run_to_the_end_has_none_unfinished(engine: str) -> None:
    cfg = ScenarioConfig.from_dict(OVERLOADED)
    summary = Simulation(cfg, "round-robin", engine=engine).run().summary()
    assert summary["completed"] == 400 and summary["unfinished"] == 0


def test_agentic_turns_count_as_they_arrive() -> None:
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 1,
            "max_time_s": 30.0,
            "workload": {"kind": "agentic", "sessions": 20, "arrival": {"concurrency": 8}},
        }
    )
    rust = Simulation(cfg, "round-robin", engine="rust")
    python = Simulation(cfg, "round-robin", engine="python")
    a, b = rust.run().summary(), python.run().summary()
    assert a["unfinished"] == b["unfinished"] > 0
    assert rust.record is not None and python.record is not None
    assert rust.record.arrived == python.record.arrived


def test_the_table_names_the_unfinished_requests() -> None:
    cfg = ScenarioConfig.from_dict({**OVERLOADED, "max_time_s": 4.0})
    result = Simulation(cfg, "round-robin").run()
    unfinished = result.summary()["unfinished"]
    assert f"{unfinished} requests unfinished at max_time_s" in format_table([result])


def test_the_table_names_each_policys_unfinished_requests() -> None:
    """Probe 76: the footer gave one total over every policy, so a comparison did not say
    which policy left its requests queued at the cut (and read better for it)."""
    cfg = ScenarioConfig.from_dict({**OVERLOADED, "replicas": 2, "max_time_s": 4.0})
    results = [Simulation(cfg, p).run() for p in ("round-robin", "prefix-only")]
    counts = [r.summary()["unfinished"] for r in results]
    assert all(counts)
    table = format_table(results)
    assert f"({counts[0]} under round-robin, {counts[1]} under prefix-only:" in table
