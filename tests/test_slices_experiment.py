"""The token-slice experiment, a scenario of the simulator (``slices-small``)."""

from __future__ import annotations

import pytest

from llmsched.sim import ScenarioConfig, Simulation
from llmsched.slices_experiment import SCENARIO, main, run_experiment, short_ttft_p90


def test_slicing_cuts_short_waits_and_counts_its_switches() -> None:
    none, fixed, mlfq = run_experiment()
    assert [r.engine_name for r in (none, fixed, mlfq)] == ["rust"] * 3
    for sliced in (fixed, mlfq):
        assert short_ttft_p90(sliced) < short_ttft_p90(none) / 4
        assert sliced.extra["slice_switches"] > 0
        assert sliced.summary()["completed"] == none.summary()["completed"] == 64
    assert none.extra["slice_switches"] == 0


def test_nobody_waiting_costs_nothing() -> None:
    """One long request alone: slicing never yields and the timings are those without it."""
    base = ScenarioConfig.from_dict({"base": SCENARIO})
    alone = {"kind": "long_short", "num_requests": 1, "long_fraction": 1.0, "length_cv": 0.0}
    runs = []
    for label, variant in base.expand():
        cfg = ScenarioConfig.from_dict({**variant.to_dict(), "workload": alone, "variants": []})
        runs.append(Simulation(cfg, "round-robin").run())
        assert runs[-1].extra["slice_switches"] == 0, label
    for r in runs[1:]:
        assert r.requests["finish"].tolist() == runs[0].requests["finish"].tolist()


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main() == 0
    out = capsys.readouterr().out
    assert "round-robin [mlfq 128]" in out and "engine: rust" in out


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/slices.md's example of the tracker and the assembler (it was the README's) prints
    the decisions it says it prints."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "slices.md").read_text()
    blocks = page.split("```python\n")[1:]
    code = next(b for b in blocks if "SliceAssembler(" in b).split("```", 1)[0]
    exec(compile(code, "docs/slices.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["yield 1 gpu-0 6", "finish 1 None 0"]
