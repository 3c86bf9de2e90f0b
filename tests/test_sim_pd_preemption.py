"""Probe 92: a prefill/decode split request preempted on its decode replica is readmitted as a
local request that recomputes what its prefix cache no longer holds. Both engines kept the
request's ``kv_ready`` flag (its KV arrived from a prefill replica) after the preemption, so it
was readmitted with all but one token computed and never recomputed, even when its blocks had
been evicted: 12 requests preempted 11 times on the decode replica prefilled 23 tokens there,
one per admission. vLLM frees a preempted request's blocks and resets its computed tokens; a
remote prefill's KV is loaded once (the connector clears ``do_remote_prefill``), so the
readmission recomputes the rest as prefill."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from _sim_pd import pd_scenario

from llmsched.sim import ScenarioConfig, Simulation

THRASHING_WORKLOAD: dict[str, Any] = {
    "kind": "long_short",
    "num_requests": 12,
    "long_fraction": 0.0,
    "short_input": 1024,
    "short_output": 600,
    "length_cv": 0.0,
}


class _Admissions:
    """Stands in for a reference replica's KV cache and notes each admission's lookup: the
    request at the head of the queue, its target and what it starts with computed."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.kv = replica.kv
        # (request id, preemptions so far) -> (target, computed at admission, first admission,
        # prompt tokens found cached): a lookup whose blocks did not fit is looked up again,
        # the last one standing.
        self.seen: dict[tuple[int, int], tuple[int, int, bool, int]] = {}

    def start(self, req: int, hashes: npt.NDArray[np.uint64], max_blocks: int) -> int:
        hit = int(self.kv.start(req, hashes, max_blocks))
        head = self.replica.waiting[0]
        assert head.id == req
        bs = self.replica.bs
        computed = max(hit * bs, head.target - 1) if head.kv_ready else hit * bs
        cached_prompt = min(hit * bs, head.prompt_len)
        self.seen[(req, head.preemptions)] = (
            head.target,
            computed,
            head.preemptions == 0,
            cached_prompt,
        )
        return hit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)


def test_a_readmission_on_the_decode_replica_recomputes_its_evicted_prompt() -> None:
    """The reference engine, watched at each admission on the decode replica: a first
    admission starts with all but the last token computed (its KV transferred), a readmission
    with what its prefix cache still holds, and the rest is prefilled there. Some readmissions
    find prompt blocks evicted; those prompt tokens are recomputed (main prefilled 1 token per
    admission, 23 in all, and recomputed nothing)."""
    sim = Simulation(pd_scenario(THRASHING_WORKLOAD, 2600), "llm-d-pd", engine="python")
    assert sim.reference is not None
    decode_replica = sim.reference.replicas[1]
    watch = _Admissions(decode_replica)
    decode_replica.kv = watch
    summary = sim.run().summary()
    assert summary["completed"] == 12 and summary["preemptions"] == 11
    prefill, decode = sim.replicas
    assert prefill.preemptions == 0 and decode.preemptions == 11
    admissions = watch.seen.values()
    assert len(admissions) == 12 + 11
    # A first admission: its KV arrived, one token left to compute.
    assert all(target - computed == 1 for target, computed, first, _ in admissions if first)
    readmissions = [(t, c, cached) for t, c, first, cached in admissions if not first]
    evicted_prompt = sum(1024 - cached for _, _, cached in readmissions)
    assert evicted_prompt > 0  # the case this is about: prompt blocks gone
    assert decode.prefill_tokens == sum(target - computed for target, computed, _, _ in admissions)
    # What a readmission prefills is recomputed but its last token (sampled, never computed):
    # the evicted prompt tokens among it.
    assert decode.recomputed_tokens == sum(t - c - 1 for t, c, _ in readmissions)
    assert decode.recomputed_tokens >= evicted_prompt
    assert decode.prefill_tokens == 12 + 11 + decode.recomputed_tokens


def _snapshot(sim: Simulation) -> tuple[Any, ...]:
    assert sim.record is not None
    requests = sim.record.requests
    columns = {name: np.asarray(requests[name]) for name in requests}
    counters = [
        (
            rep.prefill_tokens,
            rep.recomputed_tokens,
            rep.hit_tokens,
            rep.query_tokens,
            rep.preemptions,
        )
        for rep in sim.replicas
    ]
    return tuple(sorted((k, v.tobytes()) for k, v in columns.items())), tuple(counters)


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_the_recompute_is_counted_once_and_the_engines_agree(engine: str) -> None:
    """Both engines: the readmissions' recompute on the decode replica is prefill work there
    (and recompute); the prefix-cache counters still count each request once per replica (no
    content shared: no hits), and the two engines give the same requests and counters."""
    sim = Simulation(pd_scenario(THRASHING_WORKLOAD, 2600), "llm-d-pd", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 12 and summary["preemptions"] == 11
    assert sim.record is not None
    requests = sim.record.requests
    prompts = int(requests["prompt"].sum())
    prefill, decode = sim.replicas
    assert prefill.prefill_tokens == prompts  # every request split, prefilled once there
    assert decode.recomputed_tokens > 1024  # main: 0
    assert decode.prefill_tokens == 12 + 11 + decode.recomputed_tokens
    assert int(requests["recomputed"].sum()) == decode.recomputed_tokens
    assert int(requests["prefilled"].sum()) == prefill.prefill_tokens + decode.prefill_tokens
    assert (decode.hit_tokens, decode.query_tokens) == (0, prompts)
    assert (prefill.hit_tokens, prefill.query_tokens) == (0, prompts)
    other = Simulation(
        pd_scenario(THRASHING_WORKLOAD, 2600),
        "llm-d-pd",
        engine="python" if engine == "rust" else "rust",
    )
    other.run()
    assert _snapshot(sim) == _snapshot(other)


def test_shared_prefixes_under_preemption_counted_once_and_alike_on_both_engines() -> None:
    """Shared prefixes, P/D, preemptions on the decode replica. Hits (probe 76): every request
    is queried once on the decode replica (prompts split or served whole there), those split
    once more on the prefill replica. Recompute (probe 92): a readmission finds the group's
    prompt blocks cached (they are shared) and recomputes the rest. Both engines give the same
    requests and counters."""
    workload = {
        "kind": "shared_prefix",
        "num_requests": 8,
        "num_groups": 1,
        "system_prompt_len": 512,
        "question_len": 512,
        "output_len": 600,
    }
    snapshots = []
    for engine in ("rust", "python"):
        sim = Simulation(pd_scenario(workload, 2048), "llm-d-pd", engine=engine)
        summary = sim.run().summary()
        assert summary["completed"] == 8 and summary["preemptions"] > 0
        assert sim.record is not None
        prompts = int(sim.record.requests["prompt"].sum())
        prefill, decode = sim.replicas
        assert decode.query_tokens == prompts
        # Some split, each prefilled once there: what was not a hit was computed.
        assert prefill.preemptions == 0
        assert prefill.query_tokens == prefill.prefill_tokens + prefill.hit_tokens < prompts
        assert 0 < decode.hit_tokens < decode.query_tokens
        assert decode.recomputed_tokens > 0
        snapshots.append(_snapshot(sim))
    # The whole runs alike: the requests' columns, and each replica's prefill, recompute, hit
    # and query tokens and preemptions.
    assert snapshots[0] == snapshots[1]


# The timings of a seeded P/D run without KV pressure (no preemption), taken from the engines
# before the fix: the change touches preempted requests only.
_NO_PRESSURE_DIGEST = "3f5a0191bb8b56731afecf1fce3da295569bee5789c90d8a24b345e04d011b20"


@pytest.mark.parametrize("engine", ["rust", "python"])
def test_a_pd_run_without_preemption_is_unchanged(engine: str) -> None:
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 4,
            "seed": 7,
            "pd": {"prefill_replicas": 1, "transfer_bw": 1e9, "transfer_latency_s": 0.01},
            "workload": {
                "kind": "shared_prefix",
                "num_requests": 200,
                "num_groups": 4,
                "system_prompt_len": 512,
                "question_len": 128,
                "output_len": 200,
                "arrival": {"process": "poisson", "rate": 20.0},
            },
        }
    )
    sim = Simulation(cfg, "llm-d-pd", engine=engine)
    summary = sim.run().summary()
    assert summary["completed"] == 200 and summary["preemptions"] == 0
    assert [(rep.prefill_tokens, rep.hit_tokens, rep.query_tokens) for rep in sim.replicas] == [
        (2560, 0, 2560),
        (1265, 31376, 33280),
        (1137, 26384, 28160),
        (3666, 62752, 66560),
    ]
    assert sim.record is not None
    requests = sim.record.requests
    digest = hashlib.sha256()
    for name in ("arrival", "dispatched", "first_token", "finish"):
        digest.update(np.ascontiguousarray(requests[name], dtype=np.float64).tobytes())
    assert digest.hexdigest() == _NO_PRESSURE_DIGEST
