"""Probe 76: the prefix-cache hit rate counts what vLLM's ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` count: one lookup per request, at its admission. Both engines
counted every lookup, those whose blocks then did not fit (looked up again at the next step)
and each readmission after a preemption (which finds its own blocks cached): 24 requests
sharing no content, preempted 78 times on one small replica, read a 30% hit rate over 134,318
tokens queried, for 7,200 prompt tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from llmsched.sim import ScenarioConfig, Simulation

THRASHING: dict[str, Any] = {
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


def _counts(sim: Simulation) -> tuple[int, int]:
    return (
        sum(rep.hit_tokens for rep in sim.replicas),
        sum(rep.query_tokens for rep in sim.replicas),
    )


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_no_shared_content_no_hits_whatever_the_preemptions(engine: str) -> None:
    sim = Simulation(ScenarioConfig.from_dict(THRASHING), "round-robin", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 24 and summary["preemptions"] > 24
    assert summary["prefix_hit_rate"] == 0.0
    assert _counts(sim) == (0, 24 * 300)  # each prompt queried once


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_each_request_is_counted_once_at_admission(engine: str) -> None:
    """Shared prefixes under preemption: the counters are the sums, over requests, of the
    cached tokens found at admission and of the prompt lengths."""
    cfg = ScenarioConfig.from_dict(
        {
            **THRASHING,
            "workload": {
                "kind": "shared_prefix",
                "num_requests": 40,
                "num_groups": 2,
                "system_prompt_len": 256,
                "question_len": 64,
                "output_len": 900,
                "arrival": {"process": "constant", "rate": 1000.0},
            },
        }
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 40 and summary["preemptions"] > 0
    assert sim.record is not None
    requests = sim.record.requests
    hits, queries = _counts(sim)
    assert queries == int(requests["prompt"].sum())
    assert hits == int(np.maximum(requests["cached"], 0).sum()) > 0
    assert 0 < summary["prefix_hit_rate"] < 1
