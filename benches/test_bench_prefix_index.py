"""Prefix index benchmarks on a realistic workload, each beside its pure-Python twin.

Figures (ratios against the twin, memory per (block, worker) pair, two-thread scaling) are put in
``benchmark.extra_info`` and printed in the summary; timing never fails a test.
"""

from __future__ import annotations

import os
import threading
import time
from functools import cache

import msgpack
import numpy as np
import pytest
from _timing import per_second
from _workload import BLOCK_SIZE, long_prompt, sessions

from llmsched import PrefixIndex
from llmsched.reference.prefix_index import ReferencePrefixIndex

SEQUENCES = int(os.environ.get("LLMSCHED_BENCH_SEQUENCES", "10000"))


@cache
def loaded(workers: int) -> tuple[PrefixIndex, list[np.ndarray], np.ndarray]:
    index = PrefixIndex(block_size=BLOCK_SIZE)
    seqs = sessions(workers, SEQUENCES)
    hashes = [index.hash_tokens(s.tokens) for s in seqs]
    for s, h in zip(seqs, hashes, strict=True):
        index.store(s.worker, h)
    return index, hashes, long_prompt(seqs)


@cache
def loaded_twin(workers: int) -> ReferencePrefixIndex:
    _index, hashes, _ = loaded(workers)
    twin = ReferencePrefixIndex(block_size=BLOCK_SIZE)
    for s, h in zip(sessions(workers, SEQUENCES), hashes, strict=True):
        twin.store(s.worker, h.tolist())
    return twin


@pytest.mark.parametrize("workers", [64, 1024])
def test_match_hashes(benchmark, workers: int) -> None:
    benchmark.group = f"match 625 blocks, {workers} workers"
    index, _, prompt = loaded(workers)
    hashes = index.hash_tokens(prompt)
    assert len(hashes) == 625 and index.match(hashes).longest > 100
    benchmark(index.match, hashes, now=0.0)


@pytest.mark.parametrize("workers", [64, 1024])
def test_match_hashes_twin(benchmark, workers: int) -> None:
    benchmark.group = f"match 625 blocks, {workers} workers"
    index, _, prompt = loaded(workers)
    twin = loaded_twin(workers)
    hashes = index.hash_tokens(prompt).tolist()
    want = {w: v[0] for w, v in twin.match(hashes).items()}
    assert want == index.match(hashes, now=0.0).as_dict()
    benchmark(twin.match, hashes, 0.0)


def test_match_tokens(benchmark) -> None:
    benchmark.group = "match_tokens 10,000 tokens, 64 workers"
    index, _, prompt = loaded(64)
    assert index.match_tokens(prompt).longest > 100
    benchmark(index.match_tokens, prompt, now=0.0)


def test_match_tokens_twin(benchmark) -> None:
    benchmark.group = "match_tokens 10,000 tokens, 64 workers"
    _, _, prompt = loaded(64)
    twin = loaded_twin(64)
    tokens = prompt.tolist()

    def run() -> dict[object, tuple[int, ...]]:
        return twin.match(twin.hash_tokens(tokens))

    assert max(v[0] for v in run().values()) > 100
    benchmark(run)


STORE_BATCH = 100


def _fresh_batch(round_: int) -> list[np.ndarray]:
    _index, hashes, _ = loaded(64)
    start = (round_ * STORE_BATCH) % (len(hashes) - STORE_BATCH)
    return hashes[start : start + STORE_BATCH]


def test_store(benchmark) -> None:
    benchmark.group = "store 100 sequences (blocks/s in extra_info)"
    rounds = iter(range(10**9))

    def setup():
        return (PrefixIndex(block_size=BLOCK_SIZE), _fresh_batch(next(rounds))), {}

    def run(index: PrefixIndex, batch: list[np.ndarray]) -> None:
        for i, h in enumerate(batch):
            index.store(i % 64, h)

    benchmark.pedantic(run, setup=setup, rounds=10)
    blocks = sum(len(h) for h in _fresh_batch(0))
    benchmark.extra_info["blocks_per_round"] = blocks
    per_second(benchmark, "blocks_per_s", blocks)


def test_store_twin(benchmark) -> None:
    benchmark.group = "store 100 sequences (blocks/s in extra_info)"
    rounds = iter(range(10**9))

    def setup():
        batch = [h.tolist() for h in _fresh_batch(next(rounds))]
        return (ReferencePrefixIndex(block_size=BLOCK_SIZE), batch), {}

    def run(twin: ReferencePrefixIndex, batch: list[list[int]]) -> None:
        for i, h in enumerate(batch):
            twin.store(i % 64, h)

    benchmark.pedantic(run, setup=setup, rounds=3)
    blocks = sum(len(h) for h in _fresh_batch(0))
    per_second(benchmark, "blocks_per_s", blocks)


def _payloads(events_per_batch: int = 64, blocks_per_event: int = 16) -> list[bytes]:
    """vLLM 0.33-style map-encoded batches: chains of BlockStored events, 16-token blocks."""
    rng = np.random.default_rng(3)
    out = []
    engine_hash = 1
    for b in range(20):
        events = []
        parent = None
        for e in range(events_per_batch):
            tokens = rng.integers(0, 128_000, size=blocks_per_event * BLOCK_SIZE).tolist()
            hashes = list(range(engine_hash, engine_hash + blocks_per_event))
            engine_hash += blocks_per_event
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent if e % 8 else None,
                    "token_ids": tokens,
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
            parent = hashes[-1]
        out.append(msgpack.packb([1_700_000_000.0 + b, events, 0]))
    return out


def test_apply_vllm_events(benchmark) -> None:
    benchmark.group = "apply vLLM payloads (blocks/s in extra_info)"
    payloads = _payloads()
    report = PrefixIndex(block_size=BLOCK_SIZE).apply_vllm_events("engine", payloads[0])
    assert report["blocks_stored"] == 64 * 16

    def setup():
        return (PrefixIndex(block_size=BLOCK_SIZE),), {}

    def run(index: PrefixIndex) -> None:
        for p in payloads:
            index.apply_vllm_events("engine", p)

    benchmark.pedantic(run, setup=setup, rounds=10)
    blocks = 20 * 64 * 16
    per_second(benchmark, "blocks_per_s", blocks)


@pytest.mark.parametrize("workers", [64])
def test_memory_per_pair(benchmark, workers: int) -> None:
    """Estimated bytes per stored (block, worker) pair, and measured RSS growth."""
    benchmark.group = "memory (extra_info)"
    rss_before = _rss()
    index, _hashes, _prompt = loaded(workers)
    rss_after = _rss()
    stats = index.stats()
    pairs = sum(stats["worker_blocks"].values())
    benchmark.extra_info["pairs"] = pairs
    benchmark.extra_info["estimated_bytes_per_pair"] = round(stats["bytes"] / pairs, 1)
    if rss_after > rss_before:
        benchmark.extra_info["rss_bytes_per_pair_upper_bound"] = round(
            (rss_after - rss_before) / pairs, 1
        )
    benchmark(index.stats)


@pytest.mark.parametrize("form", ["hashes", "tokens"])
def test_two_threads_matching(benchmark, form: str) -> None:
    """Throughput of 2 threads matching at once over 1 thread (extra_info: scaling).

    ``hashes`` matches precomputed hashes (about 2 us of native work per call, so the GIL-held
    Python part of each call limits scaling); ``tokens`` hashes and matches a 10,000-token prompt
    per call, nearly all of it with the GIL released.
    """
    benchmark.group = f"two threads matching from {form} (extra_info)"
    index, _, prompt = loaded(64)
    hashes = index.hash_tokens(prompt)
    n = 20_000 if form == "hashes" else 4_000

    def spin(count: int) -> None:
        for _ in range(count):
            if form == "hashes":
                index.match(hashes, now=0.0)
            else:
                index.match_tokens(prompt, now=0.0)

    def one() -> float:
        t = time.perf_counter()
        spin(n)
        return n / (time.perf_counter() - t)

    def two() -> float:
        threads = [threading.Thread(target=spin, args=(n // 2,)) for _ in range(2)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return n / (time.perf_counter() - t)

    one()
    scaling = max(two() for _ in range(3)) / max(one() for _ in range(3))
    benchmark.extra_info["two_thread_scaling"] = round(scaling, 2)
    benchmark.pedantic(two, rounds=1)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return 0
