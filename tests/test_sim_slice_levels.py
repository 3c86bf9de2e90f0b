"""The simulator tells the slice tracker each waiting request's real mlfq level: a request that
skip-joined at a lower level or was demoted after a used quantum expects a longer slice than a
new one at level 0, so letting it through costs the running request more. Both engines reported
level 0 for every waiting request, so a running request yielded to work that would hold the
replica for a whole long quantum, as if that work were new and short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmsched.sim import ScenarioConfig, Simulation


def _scenario(tmp_path: Path, rows: list[tuple[float, int, int]]) -> ScenarioConfig:
    # One replica, one sequence slot, room for everything, 20 ms a decode step: with mlfq quanta
    # of 16, 32 and 64 tokens, a yield to a waiting request costs 20 ms for each token it lets
    # through (and 5 ms to requeue) and gains 20 ms for each token of the next slice.
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": prompt, "output_length": output}) + "\n"
            for t, prompt, output in rows
        )
    )
    data: dict[str, Any] = {
        "replicas": 1,
        "engine": {"kv_tokens": 8192, "max_num_seqs": 1},
        "step_model": {"linear": {"b0": 0.02, "b1": 1e-3, "b2": 0.0}, "profile": None},
        "slices": {
            "policy": "mlfq",
            "params": {"base_quantum": 16, "levels": 3, "join_ratio": 1.0},
        },
        "workload": {"kind": "trace", "path": str(path), "timestamp_unit": "s", "hash_block": 16},
    }
    return ScenarioConfig.from_dict(data)


def _finish_order(sim: Simulation) -> list[int]:
    return [r.id for r in sorted(sim.done, key=lambda r: r.finish_time)]


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_skip_joined_request_waits_at_its_level(tmp_path: Path, engine: str) -> None:
    # Request 0 (16-token prompt: level 0) decodes when request 1 (64-token prompt: it joins at
    # level 2, a 64-token quantum) arrives. At its first boundary request 0 would run 32 more
    # tokens (0.64 s); letting request 1 through costs its 64-token slice (1.28 s): continue.
    # Seen at level 0 (a 16-token slice, 0.32 s) request 1 looked worth a yield.
    sim = Simulation(
        _scenario(tmp_path, [(0.0, 16, 100), (0.1, 64, 200)]), "round-robin", engine=engine
    )
    assert sim.run().summary()["completed"] == 2
    assert sim.slice_switches == 0
    assert _finish_order(sim) == [0, 1]


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_demoted_request_does_not_compete_as_new(tmp_path: Path, engine: str) -> None:
    # Request 0 yields its slot to new request 1 after 16 tokens (gain 0.64 s, cost 0.325 s) and
    # waits at level 1. After its own 16 tokens request 1 would run 32 more (0.64 s); letting
    # request 0 through costs its 32-token slice, 0.645 s with the requeue: it continues. Then
    # at level 2 (52 tokens left, 1.04 s) it yields to request 0's 32 tokens, which finishes:
    # two switches. Seen at level 0, request 0 was let back in after 16 tokens, and again later.
    sim = Simulation(
        _scenario(tmp_path, [(0.0, 16, 100), (0.1, 16, 100)]), "round-robin", engine=engine
    )
    assert sim.run().summary()["completed"] == 2
    assert sim.slice_switches == 2
    assert _finish_order(sim) == [0, 1]
