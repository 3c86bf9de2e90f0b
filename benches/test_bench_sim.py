"""Simulator benchmarks: the KV cache beside its pure-Python twin; whole simulations on the
Python engine with the native cache and with the twin; and the Rust engine beside the Python
engine (simulated requests per wall second in ``extra_info``).

The comparison tables of ``llmsched sim`` report the same rate for the default scenario; here a
smaller agentic run keeps ``make bench`` short.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmsched import PrefixIndex
from llmsched.reference.sim_kv import ReferenceKvCache
from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.kv import make_kv_cache

BLOCKS = 750  # a 12,000-token agentic context in 16-token blocks


def _chains(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    index = PrefixIndex(block_size=16)
    return [index.hash_tokens(rng.integers(0, 128_000, BLOCKS * 16)) for _ in range(n)]


CHAINS = _chains(64)


def _life_cycles(kv, chains) -> int:
    """Admit, fill, cache and free each chain once (the cache is 20 chains big, so it evicts)."""
    hits = 0
    for rid, chain in enumerate(chains):
        hits += kv.start(rid, chain, BLOCKS - 1)
        assert kv.allocate(rid, BLOCKS * 16)
        kv.commit(rid, chain, BLOCKS)
        kv.free(rid)
        kv.take_events()
    return hits


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_kv_cache_life_cycles(benchmark, native: bool) -> None:
    benchmark.group = f"KV cache: 64 request life cycles of {BLOCKS} blocks"
    twice = CHAINS[:32] + CHAINS[:32]

    def setup():
        return (make_kv_cache(BLOCKS * 20, 16, native=native), twice), {}

    kv, _ = setup()[0]
    assert _life_cycles(kv, twice) == 0  # 32 chains do not fit in 20: every one is evicted
    benchmark.pedantic(_life_cycles, setup=setup, rounds=5 if native else 2)
    benchmark.extra_info["blocks_per_s"] = round(64 * BLOCKS / benchmark.stats.stats.median)


def test_kv_cache_twin_agrees() -> None:
    native, twin = make_kv_cache(BLOCKS * 40, 16), ReferenceKvCache(BLOCKS * 40, 16)
    chains = CHAINS[:16] + CHAINS[:16]
    assert _life_cycles(native, chains) == _life_cycles(twin, chains) == 16 * (BLOCKS - 1)


AGENTIC = ScenarioConfig.from_dict(
    {"base": "agentic", "workload": {"kind": "agentic", "sessions": 100}}
)


@pytest.mark.parametrize("policy", ["random", "llm-d"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_simulate_agentic(benchmark, policy: str, native: bool) -> None:
    benchmark.group = f"Python engine: simulate agentic, 600 requests, {policy}"

    def run():
        return Simulation(AGENTIC, policy, native_kv=native, engine="python").run().summary()

    summary = run()
    assert summary["completed"] == 600
    benchmark.pedantic(run, rounds=3 if native else 1)
    benchmark.extra_info["sim_requests_per_wall_s"] = round(600 / benchmark.stats.stats.median)
    benchmark.extra_info["decision_share"] = round(summary["decision_share"], 3)


@pytest.mark.parametrize("policy", ["random", "llm-d"])
@pytest.mark.parametrize("engine", ["rust", "python"])
def test_engines_simulate_agentic(benchmark, policy: str, engine: str) -> None:
    """The Rust engine beside the Python engine (its twin) on the same scenario: both produce
    the same result, so the ratio of the medians is the engine's speed-up."""
    benchmark.group = f"engines: simulate agentic, 600 requests, {policy}"

    def run():
        return Simulation(AGENTIC, policy, engine=engine).run()

    result = run()
    other = Simulation(AGENTIC, policy, engine="python" if engine == "rust" else "rust").run()
    for key in result.requests:
        assert np.array_equal(result.requests[key], other.requests[key]), key
    summary = result.summary()
    assert summary["completed"] == 600 and summary["engine"] == engine
    benchmark.pedantic(run, rounds=5 if engine == "rust" else 2)
    benchmark.extra_info["sim_requests_per_wall_s"] = round(600 / benchmark.stats.stats.median)
    benchmark.extra_info["decision_share"] = round(summary["decision_share"], 3)
