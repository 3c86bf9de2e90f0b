"""Behaviour of llmsched.PrefixIndex: API contract, errors leaving state unchanged, bounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import llmsched
from llmsched import PrefixIndex
from llmsched.reference.prefix_index import ReferencePrefixIndex


def chain(index: PrefixIndex, start: int, blocks: int) -> np.ndarray:
    return index.hash_tokens(np.arange(start, start + blocks * index.block_size, dtype=np.uint32))


def snapshot(index: PrefixIndex) -> tuple[object, ...]:
    return (
        index.stats(),
        {w: index.holdings(w) for w in index.workers()},
    )


def test_match_counts_leading_blocks_per_worker_and_tier() -> None:
    index = PrefixIndex(block_size=4)
    h = chain(index, 0, 10)
    assert index.store("a", h) == 10
    assert index.store("b", h[:6], tier="cpu") == 6
    assert index.store("b", h[6:8], parent=int(h[5])) == 2
    m = index.match(h)
    assert m.as_dict() == {"a": 10, "b": 8}
    assert m.tiers() == {
        "a": {"gpu": 10, "cpu": 0, "storage": 0},
        "b": {"gpu": 0, "cpu": 6, "storage": 0},
    }
    assert m.longest == 10 and m.query_blocks == 10 and m.tree_blocks == 10
    assert list(m.workers) == ["a", "b"]
    assert m.blocks.dtype == np.uint32


def test_match_tokens_equals_hash_then_match() -> None:
    index = PrefixIndex(block_size=16, model="m")
    tokens = np.arange(1000, dtype=np.int64)
    index.store(7, index.hash_tokens(tokens[:640]))
    assert index.match_tokens(tokens).as_dict() == {7: 40}
    assert index.match_tokens(tokens.tolist()).as_dict() == {7: 40}
    assert index.match_tokens(tokens, lora="adapter").as_dict() == {}
    assert index.match_tokens(tokens, cache_salt="tenant").as_dict() == {}


def test_int64_hashes_match_as_uint64_and_negative_ones_are_refused() -> None:
    """Hashes kept as int64 (numpy's and pandas' default) are read natively, every length."""
    index = PrefixIndex(block_size=4)
    hashes = index.hash_tokens(np.arange(4 * 800, dtype=np.int64))
    index.store("a", hashes[:600])
    signed = (hashes >> np.uint64(1)).astype(np.int64)  # non-negative int64 values
    index.store("b", signed[:10])
    for n in (5, 800):
        unsigned = signed[:n].astype(np.uint64)
        assert index.match(signed[:n]).as_dict() == index.match(unsigned).as_dict()
    assert index.match(signed[:20]).as_dict() == {"b": 10}
    bad = signed[:50].copy()
    bad[30] = -1
    with pytest.raises(ValueError, match="non-negative"):
        index.match(bad)
    before = index.stats()
    with pytest.raises(ValueError, match="non-negative"):
        index.store("c", bad)
    assert index.stats() == before


def test_namespaces_never_share_entries() -> None:
    a = PrefixIndex(block_size=4, model="llama")
    b = PrefixIndex(block_size=4, model="qwen")
    tokens = list(range(16))
    assert not set(a.hash_tokens(tokens)) & set(b.hash_tokens(tokens))
    assert not set(a.hash_tokens(tokens, lora="x")) & set(a.hash_tokens(tokens, lora="y"))


def test_compressed_edges_keep_nodes_few() -> None:
    index = PrefixIndex(block_size=16)
    system = np.arange(2000, dtype=np.uint32)
    for w in range(64):
        index.store(w, index.hash_tokens(system))
    for turn in range(8):
        tokens = np.concatenate([system, np.arange(5000 + turn * 500, 5000 + turn * 500 + 480)])
        index.store(turn, index.hash_tokens(tokens))
    stats = index.stats()
    assert stats["blocks"] == 125 + 8 * 30
    assert stats["nodes"] == 9


def test_record_expires_unless_confirmed() -> None:
    index = PrefixIndex(block_size=2)
    h = chain(index, 0, 4)
    index.record("a", h, ttl_s=10, now=0)
    index.record("b", h, ttl_s=10, now=0)
    index.store("b", h[:2])
    assert index.match(h, now=5).as_dict() == {"a": 4, "b": 4}
    assert index.match(h, now=11).as_dict() == {"b": 2}
    assert index.expire(now=11) == 4 + 2
    assert index.holdings("b") == {int(x): (["gpu"], True) for x in h[:2]}
    with pytest.raises(ValueError, match="ttl"):
        index.record("a", h, ttl_s=0)


def test_remove_by_tier_then_cascade() -> None:
    index = PrefixIndex(block_size=2)
    h = chain(index, 0, 5)
    index.store("a", h)
    index.store("a", h, tier="cpu")
    assert index.remove("a", h[2:3], tier="gpu") == 0
    assert index.match(h).tiers()["a"] == {"gpu": 2, "cpu": 5, "storage": 0}
    assert index.remove("a", h[1:2]) == 4
    assert index.match(h).as_dict() == {"a": 1}


def test_bad_input_raises_and_changes_nothing() -> None:
    index = PrefixIndex(block_size=2)
    h = chain(index, 0, 4)
    other = chain(index, 100, 2)
    index.store("a", h[:2])
    before = snapshot(index)
    cases = [
        (llmsched.UnknownBlockError, lambda: index.store("a", h[3:], parent=int(h[2]))),
        (llmsched.UnknownBlockError, lambda: index.store("b", h[2:], parent=int(h[1]))),
        (llmsched.HashChainError, lambda: index.store("a", [int(other[0]), int(h[0])])),
        (llmsched.HashChainError, lambda: index.store("a", [int(other[0]), int(other[0])])),
        (llmsched.UnknownBlockError, lambda: index.remove("a", [int(h[0]), int(h[3])])),
        (llmsched.UnknownWorkerError, lambda: index.remove("nobody", h[:1])),
        (llmsched.UnknownWorkerError, lambda: index.clear("nobody")),
        (llmsched.InvalidValueError, lambda: index.store("a", [-1])),
        (llmsched.InvalidValueError, lambda: index.store("a", [2**64])),
        (llmsched.InvalidValueError, lambda: index.store("a", np.array([5, -1], np.int64))),
        (llmsched.InvalidValueError, lambda: index.store("a", np.zeros((2, 2), np.uint64))),
        (llmsched.InvalidValueError, lambda: index.store("a", h[2:], parent=-1)),
        (llmsched.InvalidValueError, lambda: index.store("a", h[2:], parent=2**64)),
        (llmsched.InvalidValueError, lambda: index.store(2**64, h)),
        (llmsched.InvalidValueError, lambda: index.store("\ud800", h)),
        (TypeError, lambda: index.store("a", [1.5])),
        (TypeError, lambda: index.store("a", np.array([1.0]))),
        (TypeError, lambda: index.store(1.5, h)),  # type: ignore[arg-type]
        (TypeError, lambda: index.store(True, h)),
        (llmsched.InvalidValueError, lambda: index.store("a", h, tier="ssd")),  # type: ignore[arg-type]
        (llmsched.InvalidTokenError, lambda: index.match_tokens([1, 2, -3, 4])),
        (llmsched.InvalidTokenError, lambda: index.match_tokens(np.array([2**32], np.int64))),
        (TypeError, lambda: index.match_tokens(np.array([1.0, 2.0]))),
        (llmsched.InvalidValueError, lambda: index.match_tokens(np.zeros((2, 2), np.int32))),
        (llmsched.InvalidValueError, lambda: index.set_capacity("a", 0)),
        (llmsched.InvalidValueError, lambda: index.set_capacity("a", 2**64)),
        (llmsched.InvalidValueError, lambda: PrefixIndex(block_size=2, max_bytes=0)),
        (llmsched.InvalidValueError, lambda: PrefixIndex(block_size=2, worker_capacity=2**64)),
        (llmsched.SnapshotError, lambda: PrefixIndex.loads(b"\x93\x01\x02")),
        (TypeError, lambda: index.apply_vllm_events("a", "text")),  # type: ignore[arg-type]
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
        assert snapshot(index) == before, call
    with pytest.raises(KeyError):
        index.remove("nobody", h[:1])


@pytest.mark.parametrize(
    "kwargs",
    [{"block_size": 0}, {"block_size": -1}, {"worker_capacity": 0}, {"max_bytes": 0}, {"seed": -1}],
)
def test_impossible_config_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(**kwargs)


def test_worker_capacity_evicts_least_recently_used_tail_first() -> None:
    index = PrefixIndex(block_size=2, worker_capacity=6)
    old, new = chain(index, 0, 4), chain(index, 100, 4)
    index.store("a", old)
    index.store("a", new)
    # 8 blocks held, capacity 6: the tail of the older chain goes first.
    assert index.match(old).as_dict() == {"a": 2}
    assert index.match(new).as_dict() == {"a": 4}
    index.record("a", old[:2], ttl_s=60)  # touching a prefix protects it
    index.store("a", chain(index, 200, 2))
    assert index.match(old).as_dict() == {"a": 2}
    assert index.match(new).as_dict() == {"a": 2}
    assert index.stats()["worker_blocks"] == {"a": 6}


def test_max_bytes_bounds_the_estimate() -> None:
    index = PrefixIndex(block_size=2, max_bytes=20_000)
    for i in range(50):
        index.store(i % 4, chain(index, i * 1000, 20))
        assert index.stats()["bytes"] <= 20_000
    assert index.stats()["blocks"] > 0


def test_max_bytes_never_empties_the_index() -> None:
    """A hash table that doubles past the cap cannot be brought under it by evicting blocks:
    the index used to evict every block (and still not meet the cap). It now evicts until
    what is left fits with its tables rebuilt for it, keeping at least half its blocks."""
    index = PrefixIndex(block_size=4, max_bytes=1 << 20)
    peak = 0
    for k in range(60):
        index.store(k % 2, chain(index, 10_000 * k, 2000))
        stats = index.stats()
        assert stats["bytes"] <= 1 << 20
        peak = max(peak, stats["blocks"])
        assert stats["blocks"] >= peak // 2, (k, stats["blocks"], peak)
    assert stats["evicted_blocks"] > 0


def test_snapshot_round_trip_keeps_everything() -> None:
    index = PrefixIndex(block_size=2, seed=9, model="m", worker_capacity=50)
    h = chain(index, 0, 6)
    index.store(1, h)
    index.store("two", h[:3], tier="storage")
    index.record(3, h[:4], ttl_s=100)
    copy = PrefixIndex.loads(index.dumps())
    assert (copy.block_size, copy.seed, copy.model) == (2, 9, "m")
    assert copy.match(h).tiers() == index.match(h).tiers()
    assert snapshot(copy) == snapshot(index)
    data = index.dumps()
    for cut in range(0, len(data) - 1, max(1, len(data) // 50)):
        with pytest.raises(llmsched.SnapshotError):
            PrefixIndex.loads(data[:cut])
    # Any changed bit is refused (probe 48 F7: most loaded as another index).
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 1 << (i % 8)
        with pytest.raises(llmsched.SnapshotError):
            PrefixIndex.loads(bytes(damaged))


def test_match_many_equals_single_matches() -> None:
    index = PrefixIndex(block_size=4)
    chains = [chain(index, i * 100, 5) for i in range(5)]
    for i, c in enumerate(chains[:3]):
        index.store(i, c[: i + 2])
    many = index.match_many(chains)
    assert [m.as_dict() for m in many] == [index.match(c).as_dict() for c in chains]


def test_threads_hammering_one_index_agree_with_the_twin() -> None:
    """Writers on disjoint workers and readers run at once; the end state equals the twin's."""
    index = PrefixIndex(block_size=4, worker_capacity=40)
    twin = ReferencePrefixIndex(block_size=4, worker_capacity=40)
    system = list(range(64))
    rng = np.random.default_rng(7)
    plans = []
    for w in range(4):
        ops = []
        for i in range(300):
            tail = [10_000 + w * 1000 + int(x) for x in rng.integers(0, 50, size=8)]
            ops.append(("store", index.hash_tokens(system + tail)))
            if i % 7 == 0:
                ops.append(("remove", None))
        plans.append(ops)
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(w: int) -> None:
        try:
            for op, hashes in plans[w]:
                if op == "store":
                    index.store(w, hashes)
                else:
                    index.clear(w)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def read() -> None:
        query = index.hash_tokens(system + [10_000] * 8)
        try:
            while not stop.is_set():
                m = index.match(query)
                assert all(0 < b <= len(query) for b in m.blocks)
                assert m.longest <= m.tree_blocks
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=30)
    assert not errors, errors
    for w in range(4):
        for op, hashes in plans[w]:
            if op == "store":
                twin.store(w, [int(x) for x in hashes])
            else:
                twin.clear(w)
    for w in range(4):
        assert index.holdings(w) == twin.holdings(w)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_now_is_refused_everywhere_and_changes_nothing(bad: float) -> None:
    """Every clock-taking method refuses a NaN or infinite ``now`` as Router.pick does."""
    from llmsched.errors import InvalidValueError

    index = PrefixIndex(block_size=4)
    hashes = index.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8])
    index.record("a", hashes, ttl_s=5.0, now=0.0)
    before = index.holdings("a")
    calls = {
        "record": lambda: index.record("b", hashes, ttl_s=5.0, now=bad),
        "match": lambda: index.match(hashes, now=bad),
        "match_tokens": lambda: index.match_tokens([1, 2, 3, 4], now=bad),
        "match_many": lambda: index.match_many([hashes], now=bad),
        "match_tokens_many": lambda: index.match_tokens_many([[1, 2, 3, 4]], now=bad),
        "expire": lambda: index.expire(now=bad),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidValueError, match="now must be a finite"):
            call()
        assert index.workers() == ["a"] and index.holdings("a") == before, name
    assert index.match_tokens(list(range(1, 9)), now=4.0).as_dict() == {"a": 2}


@pytest.mark.parametrize("now", [4, np.float64(4.0), 4.0])
def test_match_takes_now_as_any_real_number_of_seconds(now: object) -> None:
    """``match`` and ``match_tokens`` check ``now`` inline (their per-call path): an int or a
    numpy number is taken as seconds as a float is, a negative one refused, changing nothing."""
    from llmsched.errors import InvalidValueError

    index = PrefixIndex(block_size=2)
    hashes = index.hash_tokens([1, 2, 3, 4])
    index.record("a", hashes, ttl_s=5.0, now=0.0)
    for tokens in ([1, 2, 3, 4], (1, 2, 3, 4), np.array([1, 2, 3, 4], dtype=np.uint32)):
        assert index.match_tokens(tokens, now=now).as_dict() == {"a": 2}
        assert index.match_tokens(tokens, now=6.0).as_dict() == {}
    assert index.match(hashes, now=now).as_dict() == {"a": 2}
    assert index.match(hashes.tolist(), now=6).as_dict() == {}
    assert index.match(hashes).longest == 0  # `now` from the clock: long after 0.0 + 5 s
    before = index.holdings("a")
    for call in (index.match, index.match_tokens):
        with pytest.raises(InvalidValueError, match="now must be a finite"):
            call([1, 2, 3, 4], now=-now)  # type: ignore[operator]
        with pytest.raises(TypeError):
            call([1, 2, 3, 4], now="4")
    assert index.holdings("a") == before


def test_threads_matching_every_input_form_agree_with_the_twin() -> None:
    """Many workers share a prefix (nodes matched through bitsets); threads match it in every
    input form while writers add other workers; every answer equals the twin's for the workers
    that were there from the start."""
    index = PrefixIndex(block_size=4)
    twin = ReferencePrefixIndex(block_size=4)
    rng = np.random.default_rng(11)
    system = rng.integers(0, 50_000, size=200).tolist()
    for w in range(150):
        tail = rng.integers(0, 50_000, size=int(rng.integers(0, 80))).tolist()
        prompt = system[: int(rng.integers(20, 201))] + tail
        hashes = index.hash_tokens(prompt)
        index.store(w, hashes, tier="cpu" if w % 3 else "gpu")
        twin.store(w, hashes.tolist(), tier="cpu" if w % 3 else "gpu")
    # 300 ids: longer than the stretch a token list's reader fetches ahead (256 items).
    queries = [system + rng.integers(0, 50_000, size=100).tolist() for _ in range(20)]
    want = [{w: v[0] for w, v in twin.match(twin.hash_tokens(q)).items()} for q in queries]
    want_tiers = [
        {
            w: {"gpu": v[1], "cpu": v[2], "storage": v[3]}
            for w, v in twin.match(twin.hash_tokens(q)).items()
        }
        for q in queries
    ]
    assert max(len(x) for x in want) > 100
    failures: list[object] = []

    def only_original(m: llmsched.PrefixMatch) -> dict[object, int]:
        return {w: b for w, b in m.as_dict().items() if isinstance(w, int) and w < 150}

    def read(form: int) -> None:
        try:
            for _ in range(15):
                for q, expect, tiers in zip(queries, want, want_tiers, strict=True):
                    hashes = index.hash_tokens(q)
                    if form == 0:
                        m = index.match(hashes)
                    elif form == 1:
                        m = index.match(hashes.tolist())
                    elif form == 2:
                        m = index.match_tokens(q)
                    else:
                        m = index.match_tokens(np.asarray(q, dtype=np.uint32))
                    if only_original(m) != expect:
                        failures.append((form, "depths"))
                    got_tiers = {w: t for w, t in m.tiers().items() if isinstance(w, int)}
                    if {w: t for w, t in got_tiers.items() if w < 150} != tiers:
                        failures.append((form, "tiers"))
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    def write(name: str) -> None:
        try:
            for i in range(100):
                index.store(name, index.hash_tokens(system[: 40 + i]))
                if i % 10 == 9:
                    index.clear(name)
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=read, args=(f,)) for f in range(4)]
    threads += [threading.Thread(target=write, args=(f"writer-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:5]


def test_match_result_reads_like_a_mapping() -> None:
    index = PrefixIndex(block_size=2)
    h = chain(index, 0, 10)
    index.store("a", h)
    index.store(5, h[:3])
    index.store("c", h[:10], tier="cpu")
    m = index.match(h)
    assert dict(m) == m.as_dict() == {"a": 10, 5: 3, "c": 10}
    assert list(m) == m.keys() == m.workers == ["a", 5, "c"]
    assert m.values() == [10, 3, 10] and m.items() == [("a", 10), (5, 3), ("c", 10)]
    assert m["a"] == 10 and m.get(5) == 3 and m.get("zz") == 0 and m.get("zz", -1) == -1
    assert "a" in m and "zz" not in m and 6 not in m
    with pytest.raises(KeyError):
        m["zz"]
    assert m.best == ["a", "c"] and m.top(2) == [("a", 10), ("c", 10)]
    assert m.top(0) == [] and m.top(10)[-1] == (5, 3)
    assert m.worker_ids.dtype == np.uint32 and len(m.worker_ids) == len(m.blocks) == 3
    assert m.cpu_blocks.tolist() == [0, 0, 10]
    # The result keeps its names after the worker is gone from the index.
    index.remove_worker("a")
    assert m.workers == ["a", 5, "c"]
    assert index.match(h).best == ["c"]
    empty = index.match(chain(index, 500, 3))
    assert empty.best == [] and empty.top(3) == [] and len(empty) == 0 and dict(empty) == {}


def test_chunked_extensions_into_long_shared_edges_agree_with_the_twin() -> None:
    """Workers extending their holds chunk by chunk into long edges others hold (each chunk
    splits an edge and merges the last split back, moving the shorter side), with removals
    and capacity evictions between them: every match, holding and snapshot equals the twin's."""
    rng = np.random.default_rng(11)
    index = PrefixIndex(block_size=2)
    twin = ReferencePrefixIndex(block_size=2)
    chain = [int(h) for h in index.hash_tokens(np.arange(2 * 1500, dtype=np.uint32))]
    branch = [int(h) for h in index.hash_tokens(np.arange(2 * 1500, dtype=np.uint32) % 1400)]
    for target in (index, twin):
        target.store("a", chain, None, "gpu")
    extents = {"b": 0, "c": 0, "d": 0}
    for step in range(300):
        worker = str(rng.choice(list(extents)))
        start = extents[worker]
        if start < len(chain) and rng.random() < 0.85:
            end = min(len(chain), start + int(rng.integers(1, 60)))
            parent = chain[start - 1] if start else None
            for target in (index, twin):
                target.store(worker, chain[start:end], parent, "cpu" if worker == "d" else "gpu")
            extents[worker] = end
        elif start > 0:
            # The engine evicts from somewhere in the worker's hold to its end.
            cut = int(rng.integers(0, start))
            for target in (index, twin):
                target.remove(worker, [chain[cut]])
            extents[worker] = cut
        if step % 50 == 49:
            # Another worker on the shared head and a branch off it, then its capacity trims
            # its oldest leaves.
            cap = int(rng.integers(100, 600))
            for target in (index, twin):
                target.store("e", branch[:760], None, "gpu")
                target.set_capacity("e", cap)
        if step % 10 == 0:
            got = {str(w): b for w, b in index.match(chain).as_dict().items()}
            want = {str(w): b for w, b in twin.match(chain, 0.0).items()}
            assert got == {w: d[0] for w, d in want.items()}, step
    for w in twin.workers():
        assert index.holdings(w) == twin.holdings(w), w
    restored = PrefixIndex.loads(index.dumps())
    assert restored.match(chain).as_dict() == index.match(chain).as_dict()
    assert restored.match(branch).as_dict() == index.match(branch).as_dict()


def test_a_cap_below_one_block_is_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    """Probe: with max_bytes=1 every store reported blocks newly held that were evicted at
    once, counted only in evicted_blocks. stats()['max_bytes_emptied'] now counts it, and the
    first time is warned of."""
    import logging

    caplog.set_level(logging.WARNING, logger="llmsched")
    index = PrefixIndex(block_size=2, max_bytes=1)
    for k in range(3):
        index.store("w", chain(index, 100 * k, 2))
    index.record("w", chain(index, 1000, 2), 5.0, now=0.0)
    stats = index.stats()
    assert (stats["blocks"], stats["evicted_blocks"], stats["max_bytes_emptied"]) == (0, 8, 4)
    warned = [r.getMessage() for r in caplog.records if "max_bytes=1 " in r.getMessage()]
    assert len(warned) == 1
    roomy = PrefixIndex(block_size=2, max_bytes=1 << 20)
    roomy.store("w", chain(roomy, 0, 2))
    assert roomy.stats()["max_bytes_emptied"] == 0
