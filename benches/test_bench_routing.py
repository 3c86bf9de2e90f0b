"""Routing benchmarks: a complete decision (hash a 10,000-token prompt, match it, 1 filter,
3 scorers, max-score) over 64 and 1,024 endpoints, each beside the pure-Python twin doing the
same work; plus the commit path and two-thread scaling. Ratios and scaling go to
``benchmark.extra_info``; timing never fails a test.
"""

from __future__ import annotations

import os
import threading
import time
from functools import cache
from typing import Any

import numpy as np
import pytest
from _workload import BLOCK_SIZE, long_prompt, sessions

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
from llmsched.reference.prefix_index import ReferencePrefixIndex
from llmsched.reference.routing import ReferenceEndpoint, decide_tokens

SEQUENCES = int(os.environ.get("LLMSCHED_BENCH_ROUTING_SEQUENCES", "2000"))

CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "decode-filter"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


@cache
def setup(endpoints: int) -> tuple[Router, np.ndarray, list[ReferenceEndpoint]]:
    """A pool of ``endpoints`` decode endpoints with random load, an index holding a
    multi-turn workload, and a 10,000-token prompt extending a stored conversation."""
    rng = np.random.default_rng(endpoints)
    pool = EndpointPool(stale_policy="ignore")
    twins = []
    for i in range(endpoints):
        role = "decode" if i % 4 else "both"
        waiting, kv = int(rng.integers(0, 20)), float(rng.integers(0, 100)) / 100
        pool.add(Endpoint(i, address=f"10.0.{i // 256}.{i % 256}:8000", role=role))
        pool.update(i, waiting=waiting, kv_cache_usage=kv, now=0.0)
        twins.append(ReferenceEndpoint(i, role=role, waiting=waiting, kv_cache_usage=kv))
    index = PrefixIndex(block_size=BLOCK_SIZE)
    seqs = sessions(endpoints, SEQUENCES)
    for s in seqs:
        index.store(s.worker, index.hash_tokens(s.tokens))
    return Router(pool, index, config=CONFIG, seed=0), long_prompt(seqs), twins


@cache
def twin_index(endpoints: int) -> ReferencePrefixIndex:
    router, _, _ = setup(endpoints)
    ref = ReferencePrefixIndex(block_size=BLOCK_SIZE)
    for s in sessions(endpoints, SEQUENCES):
        ref.store(s.worker, router.index.hash_tokens(s.tokens).tolist())
    return ref


def group(endpoints: int) -> str:
    return f"decision: 10,000 tokens, 1 filter, 3 scorers, {endpoints} endpoints"


@pytest.mark.parametrize("endpoints", [64, 1024])
def test_decision(benchmark, endpoints: int) -> None:
    benchmark.group = group(endpoints)
    router, prompt, _ = setup(endpoints)
    d = router.pick(tokens=prompt, now=0.0)
    assert len(prompt) == 10_000 and d.cached > 1_000
    benchmark(router.pick, tokens=prompt, now=0.0)


@pytest.mark.parametrize("endpoints", [64, 1024])
def test_decision_twin(benchmark, endpoints: int) -> None:
    benchmark.group = group(endpoints)
    router, prompt, twins = setup(endpoints)
    ref = twin_index(endpoints)
    tokens = prompt.tolist()
    want = decide_tokens(CONFIG, twins, ref, tokens)
    assert router.pick(tokens=prompt, now=0.0).endpoint in want.best
    benchmark(decide_tokens, CONFIG, twins, ref, tokens)


def test_pick_started_finished(benchmark) -> None:
    """The whole lifecycle: pick, started (records the prefix, counts in flight), finished."""
    benchmark.group = "lifecycle: pick + started + finished, 64 endpoints"
    router, prompt, _ = setup(64)

    def lifecycle() -> None:
        d = router.pick(tokens=prompt, now=0.0)
        d.started(now=0.0)
        d.finished()

    lifecycle()
    assert all(e["in_flight_requests"] == 0 for e in router.pool.endpoints())
    benchmark(lifecycle)


@pytest.mark.parametrize("endpoints", [64, 1024])
def test_two_threads_deciding(benchmark, endpoints: int) -> None:
    """Throughput of 2 threads deciding at once over 1 thread (extra_info: scaling).

    Wall-clock scaling needs two idle cores; the CPU time each decision costs its thread, with
    one thread and with two, shows whether the threads slow each other down (contention) apart
    from the cores being busy. The load average at the time is recorded beside them."""
    benchmark.group = "two threads deciding (extra_info)"
    router, prompt, _ = setup(endpoints)
    n = 4_000 if endpoints == 64 else 1_000
    cpu: dict[int, list[float]] = {1: [], 2: []}

    def spin(count: int, threads: int) -> None:
        start = time.thread_time()
        for _ in range(count):
            router.pick(tokens=prompt, now=0.0)
        cpu[threads].append((time.thread_time() - start) / count)

    def run(threads: int) -> float:
        workers = [
            threading.Thread(target=spin, args=(n // threads, threads)) for _ in range(threads)
        ]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return n / (time.perf_counter() - t)

    run(1)
    single = max(run(1) for _ in range(3))
    double = max(run(2) for _ in range(3))
    benchmark.extra_info["one_thread_per_s"] = round(single)
    benchmark.extra_info["two_threads_per_s"] = round(double)
    benchmark.extra_info["two_thread_scaling"] = round(double / single, 2)
    benchmark.extra_info["cpu_us_per_decision_one_thread"] = round(min(cpu[1]) * 1e6, 1)
    benchmark.extra_info["cpu_us_per_decision_two_threads"] = round(min(cpu[2]) * 1e6, 1)
    benchmark.extra_info["load_average_1min"] = round(os.getloadavg()[0], 2)
    benchmark.pedantic(run, args=(2,), rounds=1)
