"""The prefill/decode scenario the simulator's P/D tests share (``tests/test_sim_hit_counting.py``
and ``tests/test_sim_pd_preemption.py``)."""

from __future__ import annotations

from typing import Any

from llmsched.sim import ScenarioConfig


def pd_scenario(workload: dict[str, Any], kv_tokens: int) -> ScenarioConfig:
    """One prefill and one decode replica of ``kv_tokens`` KV tokens and four sequences each,
    ``workload``'s requests arriving at once (1,000 a second). With a ``kv_tokens`` that holds
    fewer answers than arrive, decoding requests are preempted on the decode replica and
    readmitted there."""
    return ScenarioConfig.from_dict(
        {
            "replicas": 2,
            "metrics_delay_s": 0.0,
            "engine": {"kv_tokens": kv_tokens, "max_num_seqs": 4},
            "pd": {"prefill_replicas": 1, "transfer_bw": 1e9, "transfer_latency_s": 0.01},
            "workload": {**workload, "arrival": {"process": "constant", "rate": 1000.0}},
        }
    )
