"""``llmsched demo``: the simulator's default scenario, what ``make demo`` runs.

Agentic multi-turn sessions over shared system prompts on a fleet of simulated vLLM-like
replicas, routed by every named policy (random, round-robin, least-load, prefix-only, llm-d,
sglang-cache-aware, dynamo-kv) on the Rust engine; the table shows what cache- and load-aware
routing buys. ``llmsched demo`` is ``llmsched sim`` on that scenario, with the demo's knobs
(replicas, sessions, turns per session, seed) as overrides: without them both run the same
thing.

>>> cfg = demo_config(replicas=2, sessions=4, turns=2, seed=3)
>>> cfg.name, cfg.replicas, cfg.workload["sessions"], cfg.workload["followup_turns"], cfg.seed
('agentic', 2, 4, 1, 3)
"""

from __future__ import annotations

from typing import Any

from llmsched.errors import ConfigError
from llmsched.sim.config import ScenarioConfig

__all__ = ["DEMO_SCENARIO", "demo_config"]

DEMO_SCENARIO = "agentic"
"""The named scenario the demo runs (``llmsched sim``'s default)."""


def demo_config(
    replicas: int | None = None,
    sessions: int | None = None,
    turns: int | None = None,
    seed: int | None = None,
) -> ScenarioConfig:
    """The demo scenario with the given overrides (None keeps the scenario's own value);
    ``turns`` counts every turn of a session, the first included."""
    for name, value in (("replicas", replicas), ("sessions", sessions), ("turns", turns)):
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1")
    data: dict[str, Any] = {"base": DEMO_SCENARIO}
    workload: dict[str, Any] = {}
    if replicas is not None:
        data["replicas"] = replicas
    if seed is not None:
        data["seed"] = seed
    if sessions is not None:
        workload["sessions"] = sessions
    if turns is not None:
        workload["followup_turns"] = turns - 1
    if workload:
        data["workload"] = {"kind": "agentic", **workload}
    given = [
        f"{name} {value}"
        for name, value in (("replicas", replicas), ("sessions", sessions), ("turns", turns))
        if value is not None
    ]
    config = ScenarioConfig.from_dict(data)
    if given:
        config.description += f" (demo: {', '.join(given)})"
    return config
