"""Probe 76: the prefix-cache hit rate counts what vLLM's ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` count: one lookup per request, at its admission. Both engines
counted every lookup, those whose blocks then did not fit (looked up again at the next step)
and each readmission after a preemption (which finds its own blocks cached): 24 requests
sharing no content, preempted 78 times on one small replica, read a 30% hit rate over 134,318
tokens queried, for 7,200 prompt tokens.

The shared-prefix P/D case's hits are checked in ``tests/test_sim_pd_preemption.py``, on the
run that checks its recompute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _sim_pd import pd_scenario

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


def _sliced_with_preemption(tmp_path: Path) -> ScenarioConfig:
    # One replica with two sequence slots and 384 KV tokens, mlfq slices (16, 32, 64 tokens):
    # four 200-token answers do not fit together, so requests are preempted, and at slice
    # boundaries running requests yield to those waiting.
    rows = [(0.0, 64, 200), (0.01, 16, 200), (0.02, 64, 200), (0.03, 16, 200)]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": prompt, "output_length": output}) + "\n"
            for t, prompt, output in rows
        )
    )
    return ScenarioConfig.from_dict(
        {
            "replicas": 1,
            "engine": {"kv_tokens": 384, "max_num_seqs": 2},
            "step_model": {"linear": {"b0": 0.02, "b1": 1e-4, "b2": 0.0}, "profile": None},
            "slices": {
                "policy": "mlfq",
                "params": {"base_quantum": 16, "levels": 3, "join_ratio": 1.0},
            },
            "workload": {
                "kind": "trace",
                "path": str(path),
                "timestamp_unit": "s",
                "hash_block": 16,
            },
        }
    )


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_slice_continuation_is_counted_after_an_earlier_preemption(
    tmp_path: Path, engine: str
) -> None:
    """Probe 84: a yielded slice's continuation is a new call to the engine (prompt plus the
    output so far), counted at its admission like any request, even when the request was
    preempted in an earlier slice. Both engines left out every admission of a request once
    preempted (the check was its preemption count), so here they read 128 hit tokens over 320
    queried instead of 304 over 512."""
    sim = Simulation(_sliced_with_preemption(tmp_path), "round-robin", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 4 and summary["preemptions"] == 2
    assert sim.slice_switches == 3
    assert sim.record is not None
    requests = sim.record.requests
    assert [int(n) for n in requests["preemptions"][np.argsort(requests["id"])]] == [0, 1, 1, 0]
    # Counted: the four prompts (64 + 16 + 64 + 16 tokens, nothing cached) and the three
    # continuations. Request 3 yields after 16 tokens (32 queried, its 16-token prompt block
    # cached) and request 2 after 64 (128 queried, 112 cached). Request 1, preempted in its
    # first slice (its readmission left out), yields after 176 tokens: 192 queried, 176 of
    # them its own blocks still cached.
    assert _counts(sim) == (16 + 112 + 176, 64 + 16 + 64 + 16 + 32 + 128 + 192)
    assert summary["prefix_hit_rate"] == pytest.approx(304 / 512)


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_pd_requests_preempted_on_their_decode_replica_are_counted_once_there(
    engine: str,
) -> None:
    """P/D: a split request is looked up once on its prefill replica (where it is admitted) and
    once on its decode replica (admitted there with its KV transferred, as a vLLM decode
    instance counts it); its readmissions after a preemption on the decode replica find its
    own blocks cached and are left out. With no content shared, nothing is a hit, and each
    replica's queries are the prompts admitted there once, whatever the preemptions."""
    workload = {
        "kind": "long_short",
        "num_requests": 12,
        "long_fraction": 0.0,
        "short_input": 1024,
        "short_output": 600,
        "length_cv": 0.0,
    }
    sim = Simulation(pd_scenario(workload, 2600), "llm-d-pd", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 12 and summary["preemptions"] > 0
    assert sim.record is not None
    prompts = int(sim.record.requests["prompt"].sum())
    prefill, decode = sim.replicas
    assert prefill.prefill_tokens == prompts  # every request split
    assert (prefill.hit_tokens, prefill.query_tokens) == (0, prompts)
    assert (decode.hit_tokens, decode.query_tokens) == (0, prompts)
    assert summary["prefix_hit_rate"] == 0.0
