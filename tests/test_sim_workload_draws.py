"""Workload settings the generators cannot draw from are a ConfigError naming the key, on both
simulator engines (they were a ZeroDivisionError, an OverflowError, or a length silently
raised to one token)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation


@pytest.mark.parametrize("engine", ["rust", "python"])
@pytest.mark.parametrize(
    ("workload", "match"),
    [
        # An OverflowError on the reference engine, a plan error naming no key on Rust.
        (
            {"kind": "shared_prefix", "num_requests": 2, "num_groups": 1},
            r"system_prompt_len \+ question_len must be >= 1",
        ),
        # Ran as one-token answers.
        ({"kind": "long_short", "short_output": 0, "length_cv": 0.0}, r"\.short_output: a mean"),
        # ZeroDivisionErrors: a gamma shape or scale of 0.
        ({"kind": "long_short", "length_cv": 1e200}, r"\.length_cv: 1e\+200 is outside"),
        ({"kind": "agentic", "sessions": 2, "length_cv": 1e200}, r"\.length_cv: 1e\+200"),
        (
            {"kind": "long_short", "arrival": {"process": "gamma", "cv": 1e-200, "rate": 1.0}},
            r"\.arrival\.cv: 1e-200 is outside",
        ),
    ],
)
def test_workloads_that_cannot_be_drawn(engine: str, workload: dict[str, Any], match: str) -> None:
    if workload["kind"] == "shared_prefix":
        workload = {**workload, "system_prompt_len": 0, "question_len": 0}
    elif workload["kind"] == "long_short":
        workload = {"num_requests": 3, "long_fraction": 0.0, **workload}
    cfg = ScenarioConfig.from_dict({"replicas": 1, "workload": workload})
    with pytest.raises(ConfigError, match=match):
        Simulation(cfg, "round-robin", engine=engine).run()


def test_a_wide_but_drawable_spread_still_runs() -> None:
    workload = {"kind": "long_short", "num_requests": 3, "length_cv": 1e10, "long_fraction": 0.0}
    cfg = ScenarioConfig.from_dict({"replicas": 1, "workload": workload})
    assert Simulation(cfg, "round-robin").run().summary()["completed"] == 3
