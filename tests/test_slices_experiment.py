"""The in-process token-slice experiment, at small sizes."""

from __future__ import annotations

import pytest

from llmsched.slices_experiment import ExperimentConfig, main, run_experiment

SMALL = ExperimentConfig(
    n_long=2, slots=2, long_prompt=400, long_output=300, n_short=12, short_prompt=200,
    short_output=10, short_gap_s=0.3, kv_capacity_tokens=1400, slice_tokens=32,
)  # fmt: skip


@pytest.mark.parametrize("policy", ["fixed", "mlfq"])
def test_slicing_cuts_short_waits_and_pays_a_counted_overhead(policy: str) -> None:
    base = run_experiment("none", SMALL)
    sliced = run_experiment(policy, SMALL)
    assert sliced.short_wait_mean_s < base.short_wait_mean_s / 2
    assert sliced.switches > 0 and base.switches == 0
    want = sliced.recomputed_tokens / SMALL.prefill_tokens_per_s
    want += sliced.switches * SMALL.requeue_delay_s
    assert sliced.overhead_s == pytest.approx(want)
    assert sliced.long_finish_mean_s >= base.long_finish_mean_s


def test_evictions_force_recompute_under_kv_pressure() -> None:
    sliced = run_experiment("fixed", SMALL)
    assert sliced.recomputed_tokens > 0


@pytest.mark.parametrize("policy", ["fixed", "mlfq"])
def test_nobody_waiting_costs_nothing(policy: str) -> None:
    alone = ExperimentConfig(n_long=2, slots=2, long_output=400, n_short=0)
    base = run_experiment("none", alone)
    sliced = run_experiment(policy, alone)
    assert (sliced.switches, sliced.recomputed_tokens, sliced.overhead_s) == (0, 0, 0.0)
    assert sliced.makespan_s == pytest.approx(base.makespan_s)


def test_main_prints_a_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmsched.slices_experiment as experiment

    monkeypatch.setattr(experiment, "ExperimentConfig", lambda: SMALL)
    main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| policy") and len(lines) == 5


def test_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Token slices", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md#token-slices", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["yield 1 gpu-0 6", "finish 1 None 0"]
    assert lines[2].startswith("'ab\\nab\\nab\\na' length SliceUsage(prompt_tokens=3")
    assert "'ab\\nab\\nab\\na' length" in section  # the README states what it prints
