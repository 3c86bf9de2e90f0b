"""A discrete-event simulator of LLM serving replicas, driving llmsched's real decision objects.

:class:`Simulation` runs the Rust engine; the pure-Python reference engine, its oracle, is
:mod:`llmsched.reference.sim`.

>>> from llmsched.sim import ScenarioConfig, Simulation
>>> cfg = ScenarioConfig.from_dict({"replicas": 2, "workload": {"kind": "shared_prefix",
...     "num_requests": 40, "num_groups": 4, "system_prompt_len": 512, "question_len": 64,
...     "output_len": 32}})
>>> Simulation(cfg, "prefix-only").run().summary()["completed"]
40
"""

from __future__ import annotations

from llmsched.sim.config import SCENARIOS, ScenarioConfig, load_scenario
from llmsched.sim.request import Request
from llmsched.sim.results import SimResult, jain
from llmsched.sim.simulator import Simulation, fallback_counts
from llmsched.sim.stepmodel import (
    GPUS,
    MODELS,
    LinearStepModel,
    RooflineStepModel,
    load_step_model,
)
from llmsched.sim.workloads import make_workload, native_plan

__all__ = [
    "GPUS",
    "MODELS",
    "SCENARIOS",
    "LinearStepModel",
    "Request",
    "RooflineStepModel",
    "ScenarioConfig",
    "SimResult",
    "Simulation",
    "fallback_counts",
    "jain",
    "load_scenario",
    "load_step_model",
    "make_workload",
    "native_plan",
]
