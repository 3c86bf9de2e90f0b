"""The native prefix index against its pure-Python twin: random operation sequences must agree."""

from __future__ import annotations

import os
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import llmsched
from llmsched.reference.prefix_index import ReferencePrefixIndex

BLOCK = 2
WORKERS = [0, 1, 2, "w3"]
TIERS = ["gpu", "cpu", "storage"]


def _chains() -> list[list[int]]:
    """Token chains sharing prefixes: 2 roots x 3 branches, plus a lone chain."""
    index = llmsched.PrefixIndex(block_size=BLOCK)
    chains = []
    for root in range(2):
        shared = [100 + root * 10 + i for i in range(3 * BLOCK)]
        for branch in range(3):
            tail = [500 + root * 50 + branch * 10 + i for i in range((branch + 1) * BLOCK)]
            chains.append([int(h) for h in index.hash_tokens(shared + tail)])
    chains.append([int(h) for h in index.hash_tokens(list(range(900, 900 + 5 * BLOCK)))])
    return chains


CHAINS = _chains()


def native_match(m: llmsched.PrefixMatch) -> dict[Any, tuple[int, ...]]:
    cols = zip(m.blocks, m.gpu_blocks, m.cpu_blocks, m.storage_blocks, strict=True)
    return {w: tuple(int(c) for c in row) for w, row in zip(m.workers, cols, strict=True)}


def outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args, **kwargs))
    except llmsched.LlmschedError as exc:
        return ("error", type(exc).__name__)
    except ValueError as exc:
        return ("error", type(exc).__name__)


class IndexMachine(RuleBasedStateMachine):
    capacity: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.native = llmsched.PrefixIndex(block_size=BLOCK, worker_capacity=self.capacity)
        self.twin = ReferencePrefixIndex(block_size=BLOCK, worker_capacity=self.capacity)
        self.now = 0.0

    def both(self, name: str, *args: Any, **kwargs: Any) -> None:
        native_kwargs = dict(kwargs)
        if name in ("record", "expire"):
            native_kwargs["now"] = self.now
        got = outcome(getattr(self.native, name), *args, **native_kwargs)
        twin_kwargs = dict(kwargs)
        if name in ("record", "expire"):
            twin_kwargs["now"] = self.now
        want = outcome(getattr(self.twin, name), *args, **twin_kwargs)
        assert got == want, (name, args, kwargs, got, want)

    @rule(
        worker=st.sampled_from(WORKERS),
        chain=st.integers(0, len(CHAINS) - 1),
        bounds=st.tuples(st.integers(0, 12), st.integers(0, 12)),
        tier=st.sampled_from(TIERS),
    )
    def store(self, worker: Any, chain: int, bounds: tuple[int, int], tier: str) -> None:
        hashes = CHAINS[chain]
        a, b = sorted(min(x, len(hashes)) for x in bounds)
        parent = hashes[a - 1] if a > 0 else None
        self.both("store", worker, hashes[a:b], parent, tier)

    @rule(
        worker=st.sampled_from(WORKERS),
        picks=st.lists(st.integers(0, len(CHAINS) * 12), min_size=1, max_size=4),
        parent=st.none() | st.integers(0, len(CHAINS) * 12),
    )
    def store_garbage(self, worker: Any, picks: list[int], parent: int | None) -> None:
        flat = [h for c in CHAINS for h in c] + [7, 8, 9]
        hashes = [flat[p % len(flat)] for p in picks]
        par = None if parent is None else flat[parent % len(flat)]
        self.both("store", worker, hashes, par, "gpu")

    @rule(
        worker=st.sampled_from(WORKERS),
        chain=st.integers(0, len(CHAINS) - 1),
        end=st.integers(1, 12),
        ttl=st.sampled_from([1.0, 5.0, 50.0]),
    )
    def record(self, worker: Any, chain: int, end: int, ttl: float) -> None:
        self.both("record", worker, CHAINS[chain][:end], ttl)

    @rule(
        worker=st.sampled_from(WORKERS),
        chain=st.integers(0, len(CHAINS) - 1),
        positions=st.lists(st.integers(0, 11), min_size=1, max_size=3),
        tier=st.none() | st.sampled_from(TIERS),
    )
    def remove(self, worker: Any, chain: int, positions: list[int], tier: str | None) -> None:
        hashes = CHAINS[chain]
        picked = [hashes[p % len(hashes)] for p in positions]
        self.both("remove", worker, picked, tier)

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: Any) -> None:
        self.both("clear", worker)

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: Any) -> None:
        self.both("remove_worker", worker)

    @rule(worker=st.sampled_from(WORKERS), cap=st.none() | st.integers(1, 14))
    def set_capacity(self, worker: Any, cap: int | None) -> None:
        self.both("set_capacity", worker, cap)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        self.both("expire")

    @invariant()
    def agree(self) -> None:
        for chain in CHAINS:
            got = self.native.match(chain, now=self.now)
            assert native_match(got) == self.twin.match(chain, self.now)
            assert got.tree_blocks == self.twin.tree_blocks(chain)
            assert got.query_blocks == len(chain)
        assert sorted(map(str, self.native.workers())) == sorted(map(str, self.twin.workers()))
        for w in self.twin.workers():
            assert self.native.holdings(w) == self.twin.holdings(w)
        stats = self.native.stats()
        assert stats["blocks"] == len(self.twin.parent_of)
        assert stats["holdings"] <= sum(len(m) for m in self.twin.held.values())


IndexMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LLMSCHED_MODEL_EXAMPLES", "250")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstTwin = IndexMachine.TestCase


class CappedIndexMachine(IndexMachine):
    """Every worker capped at 5 blocks, so most stores evict."""

    capacity = 5


CappedIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestCappedIndexAgainstTwin = CappedIndexMachine.TestCase


def test_chains_share_prefixes() -> None:
    assert CHAINS[0][:3] == CHAINS[1][:3]
    assert CHAINS[0][3] != CHAINS[1][3]
    assert np.unique(np.concatenate([np.array(c, dtype=np.uint64) for c in CHAINS])).size == 23
