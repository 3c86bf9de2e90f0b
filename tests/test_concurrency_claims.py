"""The concurrency claims of the README, docs and docstrings, each hammered by threads that
start together (a barrier) on one shared object and checked against an oracle computed apart:
the pure-Python twin (`llmsched.reference`) or a sequential replay of the same operations.

Runs on every interpreter; on free-threaded CPython (`make test-freethreaded`, PYTHON_GIL=0)
the threads really run at once. Each test joins its threads with a timeout, so a deadlock fails
rather than hangs the suite.

The claims and the tests behind them (here unless a file is named):
- PrefixIndex shared by many threads, matches in parallel, writes serialised
  (docs/prefix-index.md "Concurrency", `PrefixIndex`'s docstring): test_threads.py
  (store / clear / match / pick; results outliving their index; matches during a large
  clear), test_concurrency_oracle.py (a large clear beside snapshots),
  test_index_events_removes_snapshots_and_stats_beside_matches_and_picks; "writes for the
  worker from other threads wait for the clear":
  test_a_store_during_a_large_clear_lands_whole_before_or_after_it.
- EndpointPool "updated from any thread" / "every method may be called from any thread, also
  while routers decide" (README, routing.py); Router picks on many threads (docs/install.md):
  test_pool_changes_and_decisions_on_many_threads_account_for_every_request,
  test_one_decision_started_and_finished_from_several_threads_counts_once; the router's
  text-pick counter: test_threads.py.
- Replica sync journaling picks made on many threads while ClusterSync ships (cluster.py):
  test_replica_sync_ships_every_journaled_pick_made_on_many_threads,
  test_two_replicas_picking_on_threads_and_syncing_both_ways_agree.
- FlowController "safe to share between threads and asyncio tasks" (flow.py): test_flow.py
  (thread stress), test_flow_async.py (two loops on two threads; ids reused across the sync
  API and admit), test_flow_embedding.py (a thread pool beside an event loop).
- SliceTracker "safe to share across threads" (slices.py): test_slices.py (thread stress).
- Scheduler placements ended on another thread, start_sync / stop_sync from several threads,
  the engine map read during engine changes (scheduler.py): test_concurrency_oracle.py,
  test_scheduler_lifecycle.py, test_scheduler_engine_map_threads.py, test_scheduler.py;
  engines removed and added back while placements on them run ("requests in flight there keep
  their accounting until they end"):
  test_engine_changes_beside_placements_on_many_threads_leave_nothing_held.
- KV-event subscribers applying batches atomically, counters "read from any thread"
  (kv_events.py, docs/integrations.md): test_integrations_kv_stress.py (matches and picks).
- MetricsScraper.snapshot "may be read from any thread" (metrics.py):
  test_scraper_snapshots_read_on_many_threads_are_whole.
- docs/install.md: a list read inside its critical section
  (test_a_list_changed_on_another_thread_is_read_whole); KvCache refusing a second thread
  with "Already borrowed", never racing
  (test_a_kv_cache_used_by_two_threads_refuses_or_serves_never_races); the GIL left off at
  import (test_threads.py).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from llmsched import Endpoint, EndpointPool, PrefixIndex, Router
from llmsched.reference.prefix_index import ReferencePrefixIndex

BLOCK = 4
JOIN_S = 90.0


def _run_together(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run every target on its own thread, released together by a barrier; join with a
    timeout. Returns the exceptions the targets raised (a hang fails the test)."""
    barrier = threading.Barrier(len(targets), timeout=30)
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            barrier.wait()
            target()
        except BaseException as exc:  # reported by the calling thread
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return failures


# --------------------------------------------------------------------------------------------
# PrefixIndex: "One index may be shared by many threads: matches run in parallel, writes are
# serialised" (prefix_index.py, docs/prefix-index.md "Concurrency"). test_threads.py covers
# store / clear / match / pick; this covers engine events, remove, dumps / loads and stats
# beside matches and picks.
# --------------------------------------------------------------------------------------------


def _batch(*events: dict[str, Any]) -> bytes:
    """A vLLM KV-event batch (map-encoded events, as `llmsched.testing.event_batch` makes;
    built here so the test runs where the test helpers' zmq and aiohttp are not installed,
    as in `make test-freethreaded`'s environment)."""
    packed: bytes = msgpack.packb([0.0, list(events), None])
    return packed


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }


def _event_plan(rng: np.random.Generator, n: int) -> list[bytes]:
    """Batches of one engine: chains stored under a shared parent and some removed again."""
    batches: list[bytes] = []
    live: list[int] = []
    next_hash = 1
    for i in range(n):
        k = int(rng.integers(1, 6))
        hashes = list(range(next_hash, next_hash + k))
        next_hash += k
        parent = live[-1] if live and i % 3 else None
        tokens = rng.integers(0, 50_000, size=k * BLOCK).tolist()
        events = [_stored(hashes, parent, tokens)]
        live.extend(hashes)
        if i % 4 == 3 and live:
            gone = live[: int(rng.integers(1, 4))]
            del live[: len(gone)]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        batches.append(_batch(*events))
    return batches


@pytest.mark.timeout(180)
def test_index_events_removes_snapshots_and_stats_beside_matches_and_picks() -> None:
    """Two engines' event feeds, a thread storing and removing, one taking `dumps` / `loads`
    and `stats`, matchers and a router, all at once on one index. Matches, picks' cached
    tokens and every snapshot show the untouched workers exactly as the twin does; afterwards
    each writer's holdings and the index's stats equal a sequential replay of the same
    operations."""
    rng = np.random.default_rng(90)
    system = rng.integers(0, 50_000, size=96).tolist()
    index = PrefixIndex(block_size=BLOCK)
    twin = ReferencePrefixIndex(block_size=BLOCK)
    stable = [f"e{i}" for i in range(6)]
    for i, name in enumerate(stable):
        hashes = index.hash_tokens(system[: 8 + 12 * i])
        index.store(name, hashes)
        twin.store(name, hashes.tolist())
    queries = [
        system[: int(rng.integers(4, 97))] + rng.integers(0, 50_000, size=20).tolist()
        for _ in range(16)
    ]
    want = [{w: v[0] for w, v in twin.match(twin.hash_tokens(q)).items()} for q in queries]
    assert len({tuple(sorted(d.items())) for d in want}) > 3
    want_holdings = {name: twin.holdings(name) for name in stable}
    pool = EndpointPool(stable, stale_policy="ignore")
    router = Router(pool, index, config="prefix-only", seed=1)

    feeds = {f"ev{k}": _event_plan(np.random.default_rng(k), 400) for k in range(2)}
    ops: list[tuple[str, list[int]]] = []
    for i in range(300):
        prompt = system[: int(rng.integers(8, 97))] + rng.integers(0, 50_000, size=12).tolist()
        hashes = index.hash_tokens(prompt).tolist()
        ops.append(("store", hashes))
        if i % 3 == 2:
            ops.append(("remove", hashes[int(rng.integers(0, len(hashes))) :]))
    done = threading.Event()
    bad: list[object] = []
    snapshots = [0]

    def only_stable(d: dict[Any, int]) -> dict[Any, int]:
        return {w: b for w, b in d.items() if w in want_holdings}

    def feed(worker: str) -> Callable[[], None]:
        def run() -> None:
            for payload in feeds[worker]:
                index.apply_vllm_events(worker, payload)

        return run

    def store_remove() -> None:
        for op, hashes in ops:
            if op == "store":
                index.store("sr", hashes)
            else:
                index.remove("sr", np.asarray(hashes, dtype=np.uint64))

    def snapshot() -> None:
        while not done.is_set() or snapshots[0] < 3:
            copy = PrefixIndex.loads(index.dumps())
            for name, held in want_holdings.items():
                if copy.holdings(name) != held:
                    bad.append(("snapshot", name))
            got = copy.match_tokens(queries[snapshots[0] % len(queries)]).as_dict()
            if only_stable(got) != want[snapshots[0] % len(queries)]:
                bad.append(("snapshot match", got))
            stats = index.stats()
            if any(stats["worker_blocks"].get(n) != len(h) for n, h in want_holdings.items()):
                bad.append(("stats", stats["worker_blocks"]))
            snapshots[0] += 1

    def match(form: int) -> Callable[[], None]:
        def run() -> None:
            rounds = 0
            while not done.is_set() or rounds < 3:
                if form == 0:
                    got = [m.as_dict() for m in index.match_tokens_many(queries)]
                else:
                    got = [index.match(index.hash_tokens(q)).as_dict() for q in queries]
                for g, w in zip(got, want, strict=True):
                    if only_stable(g) != w:
                        bad.append(("match", form, g, w))
                rounds += 1

        return run

    def pick() -> None:
        rounds = 0
        while not done.is_set() or rounds < 3:
            for q, w in zip(queries, want, strict=True):
                d = router.pick(tokens=q, now=0.0)
                cached = {e: t for e, t in d.cached_tokens().items() if t}
                if cached != {e: b * BLOCK for e, b in w.items()}:
                    bad.append(("pick", cached, w))
            rounds += 1

    writers = [feed("ev0"), feed("ev1"), store_remove]

    def writers_then_done(run: Callable[[], None]) -> Callable[[], None]:
        def wrapped() -> None:
            try:
                run()
            finally:
                finished.append(1)
                if len(finished) == len(writers):
                    done.set()

        return wrapped

    finished: list[int] = []
    failures = _run_together(
        [writers_then_done(w) for w in writers] + [snapshot, match(0), match(1), pick]
    )
    assert not failures, failures[:3]
    assert not bad, bad[:5]
    assert snapshots[0] >= 3

    replay = PrefixIndex(block_size=BLOCK)
    for name in stable:
        replay.store(name, index.hash_tokens(system[: 8 + 12 * stable.index(name)]))
    for worker, payloads in feeds.items():
        for payload in payloads:
            replay.apply_vllm_events(worker, payload)
    for op, hashes in ops:
        (replay.store if op == "store" else replay.remove)("sr", hashes)
        (twin.store if op == "store" else twin.remove)("sr", hashes)
    for worker in [*stable, *feeds, "sr"]:
        assert index.holdings(worker) == replay.holdings(worker), worker
    assert index.holdings("sr") == twin.holdings("sr")
    keys = ("workers", "blocks", "holdings", "engine_blocks", "worker_blocks", "event_batches")
    got, expect = index.stats(), replay.stats()
    assert {k: got[k] for k in keys} == {k: expect[k] for k in keys}
    assert PrefixIndex.loads(index.dumps()).stats()["worker_blocks"] == expect["worker_blocks"]


# --------------------------------------------------------------------------------------------
# EndpointPool: "Every method may be called from any thread, also while routers decide"
# (routing.py), "updated from any thread" (README). Router decisions (pick / started / again /
# finished) account in the pool's in-flight counts.
# --------------------------------------------------------------------------------------------

STABLE = [f"s{i}" for i in range(6)]
TRANSIENT = [f"t{i}" for i in range(3)]


def _metrics(i: int) -> dict[str, Any]:
    """The i-th snapshot an updater writes: every field derived from i, so a row mixing two
    snapshots is detectable."""
    return {"waiting": i % 50, "running": 2 * (i % 50), "kv_cache_usage": (i % 50) / 100}


@pytest.mark.timeout(180)
def test_pool_changes_and_decisions_on_many_threads_account_for_every_request() -> None:
    """Updaters write metrics snapshots, a churner adds and removes endpoints, readers list
    the pool, and pickers pick, start (some on a fallback, through `again`) and finish
    decisions, all at once. Every row read is one whole snapshot; with the threads paused,
    each endpoint's in-flight requests and tokens equal the decisions started there and not
    finished; afterwards every count is back to 0 and the pool's members and metrics equal a
    sequential replay of the changes."""
    pool = EndpointPool(
        [Endpoint(n, address=f"{n}:8000") for n in STABLE + TRANSIENT], stale_policy="ignore"
    )
    router = Router(pool, config="least-load", seed=5)
    rounds, pickers, per_round = 4, 4, 150
    open_decisions: list[list[Any]] = [[] for _ in range(pickers)]
    bad: list[object] = []
    churn_plan = [(TRANSIENT[i % 3], i % 2 == 0) for i in range(300)]  # remove, then add back
    update_plan = {n: list(range(k, 2000 + k)) for k, n in enumerate(STABLE)}
    phase_done = threading.Barrier(pickers + 4, timeout=60)
    checked = threading.Barrier(pickers + 4, timeout=60)
    stop = threading.Event()
    seen_open: list[int] = []

    def updater(names: list[str]) -> Callable[[], None]:
        def run() -> None:
            for r in range(rounds):
                for step in range(500):
                    for n in names:
                        i = update_plan[n][r * 500 + step]
                        pool.update(n, **_metrics(i), now=float(i))
                phase_done.wait()
                checked.wait()

        return run

    def churner() -> None:
        for _ in range(rounds):
            for endpoint, remove in churn_plan:
                if remove:
                    pool.remove(endpoint)
                else:
                    pool.add(Endpoint(endpoint, address=f"{endpoint}:8000"))
            phase_done.wait()
            checked.wait()

    def reader() -> None:
        while not stop.is_set():
            rows = pool.endpoints()
            ids = [r["id"] for r in rows]
            if len(ids) != len(set(ids)) or not set(STABLE) <= set(ids):
                bad.append(("members", ids))
            for row in rows:
                if row["id"] in update_plan and row["timestamp"] is not None:
                    whole = _metrics(int(row["timestamp"]))
                    if {k: row[k] for k in whole} != whole:
                        bad.append(("torn row", row))
                if row["in_flight_requests"] < 0 or row["in_flight_requests"] > 10**6:
                    bad.append(("count", row))

    def picker(p: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(rounds):
                for j in range(per_round):
                    tokens = list(range(j % 7, j % 7 + 16 + p))
                    d = router.pick(tokens=tokens, now=0.0)
                    if j % 5 == 0 and d.fallbacks:
                        d.started(now=0.0)
                        d.finished()
                        d = d.again()
                        d.started(d.fallbacks[0], now=0.0)
                        target = d.fallbacks[0]
                    else:
                        d.started(now=0.0)
                        target = d.endpoint
                    if j % 3:
                        open_decisions[p].append((d, target, len(tokens)))
                    else:
                        d.finished()
                    if j % 2 and open_decisions[p]:
                        open_decisions[p].pop(0)[0].finished()
                phase_done.wait()
                checked.wait()
            for d, _, _ in open_decisions[p]:
                d.finished()
            open_decisions[p].clear()

        return run

    def checker() -> None:
        # Threads paused: every open decision is counted where it was started, nowhere else.
        for _ in range(rounds):
            phase_done.wait()
            try:
                requests: Counter[str] = Counter()
                tokens: Counter[str] = Counter()
                for mine in open_decisions:
                    for _, target, n in mine:
                        requests[target] += 1
                        tokens[target] += n
                seen_open.append(sum(requests.values()))
                rows = {r["id"]: r for r in pool.endpoints()}
                for name, row in rows.items():
                    if row["in_flight_requests"] != requests[name]:
                        bad.append(("in flight", name, row["in_flight_requests"], requests[name]))
                    if row["in_flight_tokens"] != tokens[name]:
                        bad.append(("tokens", name, row["in_flight_tokens"], tokens[name]))
            finally:
                checked.wait()

    targets = [updater(STABLE[:3]), updater(STABLE[3:]), churner, checker]
    targets += [picker(p) for p in range(pickers)]
    stop_after = _run_together_with_reader(targets, reader, stop)
    assert not stop_after, stop_after[:3]
    assert not bad, bad[:5]
    assert len(seen_open) == rounds and min(seen_open) > 0, seen_open

    rows = {r["id"]: r for r in pool.endpoints()}
    members = set(STABLE + TRANSIENT)
    for _ in range(rounds):
        for endpoint, remove in churn_plan:
            (members.discard if remove else members.add)(endpoint)
    assert set(rows) == members
    assert all(r["in_flight_requests"] == 0 and r["in_flight_tokens"] == 0 for r in rows.values())
    for name, plan in update_plan.items():
        last = plan[rounds * 500 - 1]
        assert {k: rows[name][k] for k in ("waiting", "running", "kv_cache_usage")} == _metrics(
            last
        )
        assert rows[name]["timestamp"] == float(last)


def _run_together_with_reader(
    targets: list[Callable[[], None]], reader: Callable[[], None], stop: threading.Event
) -> list[BaseException]:
    """`_run_together` of `targets` with `reader` running beside them until they end."""
    failures: list[BaseException] = []

    def read() -> None:
        try:
            reader()
        except BaseException as exc:  # reported by the calling thread
            failures.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        failures += _run_together(targets)
    finally:
        stop.set()
        thread.join(timeout=JOIN_S)
    assert not thread.is_alive(), "the reader hung"
    return failures


# --------------------------------------------------------------------------------------------
# ReplicaSync: picks on many threads journal their records, sessions and loads
# (`Decision.started` / `finished`) while the sync's own thread (ClusterSync's event loop)
# takes the journal (`outgoing`) and another replica applies it (`incoming`).
# --------------------------------------------------------------------------------------------

SYNC_ENDPOINTS = ["e0", "e1", "e2", "e3"]
SYNC_CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "active-request-scorer"},
        {"type": "session-affinity-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "active-request-scorer", "weight": 2},
                {"pluginRef": "session-affinity-scorer", "weight": 10},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def _sync_router(name: str) -> tuple[Router, Any]:
    router = Router(
        EndpointPool(SYNC_ENDPOINTS, stale_policy="ignore"),
        PrefixIndex(block_size=16),
        config=SYNC_CONFIG,
        seed=1,
    )
    native = router.replica_sync(
        name, incarnation=1, journal_limit=1 << 20, load_ttl_s=600.0, history_limit=1 << 20
    )
    return router, native


@pytest.mark.timeout(180)
def test_replica_sync_ships_every_journaled_pick_made_on_many_threads() -> None:
    """Pickers on four threads start and finish decisions on replica `a` while a fifth
    thread ships `a`'s journal into replica `b`. With the pickers paused and the journal
    shipped, `b` counts exactly `a`'s requests in flight on each endpoint; afterwards `b`
    holds every prompt's prefix record and every session binding `a` made, and no load."""
    a, sync_a = _sync_router("a")
    b, sync_b = _sync_router("b")
    pickers, rounds, per_round = 4, 3, 120
    opened: list[list[Any]] = [[] for _ in range(pickers)]
    made: list[list[tuple[np.ndarray, str, str]]] = [[] for _ in range(pickers)]
    paused = threading.Barrier(pickers + 1, timeout=60)
    resumed = threading.Barrier(pickers + 1, timeout=60)
    bad: list[object] = []
    ended: list[int] = []

    def ship() -> int:
        batches = sync_a.outgoing(time.monotonic(), False, 1 << 20)
        for batch in batches:
            sync_b.incoming(batch, time.monotonic())
        return len(batches)

    def picker(p: int) -> Callable[[], None]:
        def run() -> None:
            try:
                picks(p)
            except BaseException:
                paused.abort()  # the shipper and the other pickers stop waiting
                resumed.abort()
                raise
            finally:
                ended.append(p)

        return run

    def picks(p: int) -> None:
        for r in range(rounds):
            for j in range(per_round):
                k = (p * rounds + r) * per_round + j
                tokens = np.arange(k * 1000, k * 1000 + 64, dtype=np.uint32)
                session = f"s{k}"
                d = a.pick(tokens=tokens, session_id=session)
                d.started()
                made[p].append((tokens, d.endpoint, session))
                if j % 3:
                    opened[p].append(d)
                else:
                    d.finished()
                if j % 2 and opened[p]:
                    opened[p].pop(0).finished()
            paused.wait()
            resumed.wait()
        for d in opened[p]:
            d.finished()
        opened[p].clear()

    def shipper() -> None:
        for _ in range(rounds):
            while paused.n_waiting < pickers and not paused.broken:
                ship()
            paused.wait()
            try:
                while ship():
                    pass
                local = {e["id"]: e["in_flight_requests"] for e in a.pool.endpoints()}
                remote = {e["id"]: e["remote_in_flight_requests"] for e in b.pool.endpoints()}
                want = Counter(d.endpoint for mine in opened for d in mine)
                if local != {e: want[e] for e in SYNC_ENDPOINTS}:
                    bad.append(("a in flight", local, want))
                if remote != local:
                    bad.append(("b remote", remote, local))
            finally:
                resumed.wait()
        while len(ended) < pickers:  # the pickers' last finishes, shipped as they go
            ship()

    failures = _run_together([picker(p) for p in range(pickers)] + [shipper])
    assert not failures, failures[:3]
    assert not bad, bad[:5]
    while ship():
        pass
    assert all(e["remote_in_flight_requests"] == 0 for e in b.pool.endpoints())
    for mine in made:
        for tokens, endpoint, session in mine:
            assert b.index.match_tokens(tokens).as_dict() == a.index.match_tokens(tokens).as_dict()
            assert a.index.match_tokens(tokens).get(endpoint) == 4
            other = np.arange(10**8, 10**8 + 32, dtype=np.uint32)
            assert b.pick(tokens=other, session_id=session).endpoint == endpoint


# --------------------------------------------------------------------------------------------
# docs/install.md: "A list of token ids or hashes is read inside a critical section on that
# list (it cannot change while read)"; "KvCache [...] two threads using one get
# `RuntimeError: Already borrowed`, never a race".
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_list_changed_on_another_thread_is_read_whole() -> None:
    """One thread swaps a shared list's whole content between two prompts (and their
    hashes) while others hash, match and pick with it: every answer is one prompt's, never a
    mix of both."""
    index = PrefixIndex(block_size=BLOCK)
    first = list(range(1, 4097))
    second = list(range(100_001, 104_097))
    hashes = {tuple(index.hash_tokens(p).tolist()) for p in (first, second)}
    index.store("a", index.hash_tokens(first))
    index.store("b", index.hash_tokens(second))
    wants = ({"a": 1024}, {"b": 1024})
    router = Router(EndpointPool(["a", "b"]), index, config="prefix-only")
    tokens = list(first)
    chain = list(index.hash_tokens(first).tolist())
    chains = [list(index.hash_tokens(p).tolist()) for p in (first, second)]
    done = threading.Event()
    bad: list[object] = []
    reads = [0]

    def swap() -> None:
        for i in range(3000):
            tokens[:] = second if i % 2 == 0 else first
            chain[:] = chains[i % 2 == 0]
        done.set()

    def read(form: int) -> Callable[[], None]:
        def run() -> None:
            while not done.is_set() or reads[0] < 10:
                if form == 0:
                    got: object = tuple(index.hash_tokens(tokens).tolist())
                    ok = got in hashes
                elif form == 1:
                    got = index.match_tokens(tokens).as_dict()
                    ok = got in wants
                elif form == 2:
                    got = index.match(chain).as_dict()
                    ok = got in wants
                else:
                    got = router.pick(tokens=tokens, now=0.0).endpoint
                    ok = got in ("a", "b")
                if not ok:
                    bad.append((form, str(got)[:80]))
                reads[0] += 1

        return run

    failures = _run_together([swap] + [read(f) for f in range(4)])
    assert not failures, failures[:3]
    assert not bad, bad[:5]


@pytest.mark.timeout(120)
def test_a_kv_cache_used_by_two_threads_refuses_or_serves_never_races() -> None:
    """Threads run request life cycles on one simulator KvCache, each on requests and hashes
    of its own, retrying a call refused with "Already borrowed": every other call answers as
    the twin does for that thread's requests alone, and the cache ends as a sequential replay
    leaves it."""
    from llmsched.reference.sim_kv import ReferenceKvCache
    from llmsched.sim.kv import make_kv_cache

    threads_n, per_thread, blocks = 4, 300, 4096
    cache = make_kv_cache(blocks, BLOCK)
    twin = ReferenceKvCache(blocks, BLOCK)
    refused = [0]

    def chain(t: int, i: int) -> np.ndarray:
        start = (t * 10_000 + i % 40) * 100
        return np.arange(start, start + 6, dtype=np.uint64)

    def call(target: Any, method: str, *args: Any) -> Any:
        while True:
            try:
                return getattr(target, method)(*args)
            except RuntimeError as exc:
                if "borrow" not in str(exc).lower():
                    raise
                refused[0] += 1

    def life(target: Any, t: int, i: int) -> tuple[Any, ...]:
        req = t * 1_000_000 + i
        hashes = chain(t, i)
        reused = call(target, "start", req, hashes, 6)
        grown = call(target, "allocate", req, 24)
        call(target, "commit", req, hashes, 6)
        held = call(target, "blocks_of", req)
        call(target, "free", req)
        return (reused, grown, held)

    answers: dict[int, list[tuple[Any, ...]]] = {}

    def worker(t: int) -> Callable[[], None]:
        def run() -> None:
            answers[t] = [life(cache, t, i) for i in range(per_thread)]

        return run

    failures = _run_together([worker(t) for t in range(threads_n)])
    assert not failures, failures[:3]
    for t in range(threads_n):
        assert answers[t] == [life(twin, t, i) for i in range(per_thread)], t
    assert (cache.free_blocks, cache.cached_blocks, cache.requests()) == (
        twin.free_blocks,
        twin.cached_blocks,
        twin.requests(),
    )


# --------------------------------------------------------------------------------------------
# MetricsScraper: ":meth:`snapshot` may be read from any thread" (a consistent copy).
# --------------------------------------------------------------------------------------------

WAITING_7 = "vllm:num_requests_waiting 7\nvllm:num_requests_running 3\n"


@pytest.mark.timeout(120)
def test_scraper_snapshots_read_on_many_threads_are_whole() -> None:
    """The scraper's thread scrapes an engine that fails every other stretch (status 500,
    flipped by another thread) and one that always answers, while readers take snapshots:
    every snapshot is one consistent state (failures within scrapes, the answering engine's
    values whole, `ok` and `failing` the last scrape's) and each reader sees the counts
    only grow."""
    pytest.importorskip("aiohttp")
    from llmsched.integrations import MetricsScraper
    from llmsched.testing import FakeHTTPEngine

    with (
        FakeHTTPEngine(metrics_text=WAITING_7) as flaky,
        FakeHTTPEngine(metrics_text=WAITING_7) as steady,
    ):
        pool = EndpointPool()
        scraper = MetricsScraper([flaky.spec(), steady.spec()], pool=pool, interval_s=0.005)
        fw, sw = flaky.spec().worker_id, steady.spec().worker_id
        done = threading.Event()
        bad: list[object] = []

        def flip() -> None:
            for i in range(40):
                flaky.status = 500 if i % 2 else 200
                time.sleep(0.02)
            flaky.status = 200
            done.set()

        def read() -> None:
            last = {fw: 0, sw: 0}
            while not done.is_set():
                snap = scraper.snapshot()
                for w, s in snap.items():
                    if s["scrapes"] < last[w]:
                        bad.append(("went back", w, s["scrapes"], last[w]))
                    last[w] = s["scrapes"]
                    if not s["consecutive_failures"] <= s["failures"] <= s["scrapes"]:
                        bad.append(("counts", w, s))
                    if s["scrapes"] and s["ok"] != (s["consecutive_failures"] == 0):
                        bad.append(("ok", w, s))
                    if s["scrapes"] and s["failing"] == s["ok"]:
                        bad.append(("failing", w, s))
                    if s["ok"] and (s["values"].get("waiting"), s["values"].get("running")) != (
                        7,
                        3,
                    ):
                        bad.append(("values", w, s["values"]))
                if snap[sw]["failures"]:
                    bad.append(("steady failed", snap[sw]))

        with scraper:
            failures = _run_together([flip] + [read] * 3)
        assert not failures, failures[:3]
        assert not bad, bad[:5]
        final = scraper.snapshot()
        assert final[fw]["failures"] > 0 and final[sw]["scrapes"] > 0
        assert {e["id"]: e["waiting"] for e in pool.endpoints()} == {fw: 7, sw: 7}


@pytest.mark.timeout(120)
def test_one_decision_started_and_finished_from_several_threads_counts_once() -> None:
    """Decisions shared between threads (a request's handler and its cancellation on another
    thread): two threads finish each at once, a third starts it meanwhile. `finished()` is True
    for one of them only, a start after the finish is refused, and every endpoint ends with
    nothing in flight."""
    from llmsched.errors import PlacementError

    pool = EndpointPool([f"e{i}" for i in range(4)], stale_policy="ignore")
    router = Router(pool, config="least-load", seed=2)
    n = 2000
    decisions = [router.pick(tokens=list(range(i % 50, i % 50 + 32)), now=0.0) for i in range(n)]
    for d in decisions[::2]:
        d.started(now=0.0)  # half sent before the race, half started during it
    wins: list[list[bool]] = [[], []]
    starts: list[str] = []

    def finish(slot: int) -> Callable[[], None]:
        def run() -> None:
            wins[slot] = [d.finished() for d in decisions]

        return run

    def start() -> None:
        for d in decisions[1::2]:
            try:
                d.started(now=0.0)
                starts.append("sent")
            except PlacementError:
                starts.append("refused")

    failures = _run_together([finish(0), finish(1), start])
    assert not failures, failures[:3]
    assert [a + b for a, b in zip(wins[0], wins[1], strict=True)] == [1] * n
    assert len(starts) == n // 2
    rows = pool.endpoints()
    assert [(r["in_flight_requests"], r["in_flight_tokens"]) for r in rows] == [(0, 0)] * 4


@pytest.mark.timeout(120)
def test_a_store_during_a_large_clear_lands_whole_before_or_after_it() -> None:
    """docs/prefix-index.md: a clear of more than 4,096 blocks goes in steps, and "writes for
    the worker from other threads wait for the clear". A store started with the clear lands
    either before it (and is cleared with the rest) or after it (and is all the worker
    holds), and one made once matches no longer see the worker lands after it; the clear
    counts exactly the blocks it dropped, and another worker is untouched."""
    index = PrefixIndex(block_size=1)
    index.store("other", list(range(1, 301)))
    old = [[10**6 * (c + 1) + j for j in range(1500)] for c in range(8)]  # 12,000 blocks
    fresh = [10**9 + j for j in range(700)]
    outcomes: Counter[str] = Counter()

    def one_round(round_: int) -> None:
        for chain in old:
            index.store("big", chain)
        cleared: list[int] = []

        def clear() -> None:
            cleared.append(index.clear("big") if round_ % 2 else index.remove_worker("big"))

        def store() -> None:
            if round_ % 4 >= 2:  # once the clear has begun: it hides the worker at once
                while index.match(old[-1]).get("big"):
                    pass
            index.store("big", fresh)

        failures = _run_together([clear, store])
        assert not failures, failures
        held = index.holdings("big") if "big" in index.workers() else {}
        if held:
            assert sorted(held) == fresh and cleared == [12_000], (len(held), cleared)
            outcomes["after"] += 1
        else:
            assert round_ % 4 < 2, "a store made after the clear began was cleared"
            assert cleared == [12_700], cleared
            outcomes["before"] += 1
        index.store("big", [1])  # so that the next round's clear finds it
        index.remove_worker("big")
        assert index.stats()["worker_blocks"] == {"other": 300}

    for round_ in range(30):
        one_round(round_)
    assert sum(outcomes.values()) == 30 and outcomes["after"] >= 14, outcomes


# --------------------------------------------------------------------------------------------
# Scheduler: engines added and removed (a discovery change, the admin API) on one thread while
# others schedule on the synchronous form ("Requests in flight there keep their accounting
# until they end", `Scheduler.remove_engine`).
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_engine_changes_beside_placements_on_many_threads_leave_nothing_held() -> None:
    """Four threads place and end requests through `schedule_sync` (some held open across
    an engine change) while a fifth removes and adds back two of the engines. Every placement
    went to an engine scheduled at some point, the scheduler's counters equal what the
    threads did, and at the end nothing is held: no request in flight on any engine, no
    flow slot taken, nothing queued."""
    from llmsched import Scheduler, ScheduleRequest

    stable, moving = ["a", "b"], ["m0", "m1"]
    s = Scheduler(
        stable + moving,
        router="least-load",
        flow={"saturation": {"type": "concurrency", "max_requests": 64}},
    )
    assert s.flow is not None
    placers, per_thread = 4, 200
    ended: Counter[str] = Counter()
    where: Counter[str] = Counter()
    lock = threading.Lock()

    def place(t: int) -> Callable[[], None]:
        def run() -> None:
            held: list[Any] = []
            for i in range(per_thread):
                tokens = list(range(t * 1000 + i % 30, t * 1000 + i % 30 + 48))
                p = s.schedule_sync(ScheduleRequest(tokens=tokens, tenant=f"t{t}"))
                with lock:
                    where[str(p.endpoint)] += 1
                held.append(p)
                if i % 3 == 0:
                    continue  # held across the next engine changes
                for q in held:
                    (q.complete if i % 2 else q.fail)()
                    with lock:
                        ended["complete" if i % 2 else "fail"] += 1
                held.clear()
            for q in held:
                q.complete()
                with lock:
                    ended["complete"] += 1

        return run

    def churn() -> None:
        for i in range(150):
            name = moving[i % 2]
            s.remove_engine(name)
            s.add_engine(name)

    failures = _run_together([place(t) for t in range(placers)] + [churn])
    assert not failures, failures[:3]
    assert set(where) <= set(stable + moving) and sum(where.values()) == placers * per_thread
    stats = s.stats()
    assert (stats["completed"], stats["failed"]) == (ended["complete"], ended["fail"])
    assert stats["in_flight"] == 0
    assert {e["id"] for e in s.pool.endpoints()} == set(stable + moving)
    for e in s.pool.endpoints():
        assert (e["in_flight_requests"], e["in_flight_tokens"]) == (0, 0), e
    assert s.flow.running_count() == 0 and len(s.flow) == 0


@pytest.mark.timeout(180)
def test_two_replicas_picking_on_threads_and_syncing_both_ways_agree() -> None:
    """Both replicas pick on two threads each while a fifth ships each one's journal to the
    other. Once the pickers end and the journals are shipped, each replica counts as remote
    exactly the other's own requests in flight (its `in_flight_requests` less its
    `remote_in_flight_requests`), both indexes match every prompt alike, both route every
    session to the endpoint it was started on, and after the last finishes no load is left."""
    a, sync_a = _sync_router("a")
    b, sync_b = _sync_router("b")
    made: list[tuple[np.ndarray, str, str]] = []
    opened: list[Any] = []
    lock = threading.Lock()
    ended: list[int] = []

    def ship(source: Any, target: Any) -> int:
        batches = source.outgoing(time.monotonic(), False, 1 << 20)
        for batch in batches:
            target.incoming(batch, time.monotonic())
        return len(batches)

    def ship_both() -> int:
        return ship(sync_a, sync_b) + ship(sync_b, sync_a)

    def picker(router: Router, first: int) -> Callable[[], None]:
        def run() -> None:
            try:
                for j in range(300):
                    k = first + j
                    tokens = np.arange(k * 1000, k * 1000 + 64, dtype=np.uint32)
                    d = router.pick(tokens=tokens, session_id=f"s{k}")
                    d.started()
                    with lock:
                        made.append((tokens, d.endpoint, f"s{k}"))
                        if j % 3:
                            opened.append(d)
                    if j % 3 == 0:
                        d.finished()
            finally:
                ended.append(first)  # the shipper stops once every picker ended

        return run

    def shipper() -> None:
        while len(ended) < 4:
            ship_both()

    pickers = [picker(r, first) for r, first in ((a, 0), (a, 1000), (b, 2000), (b, 3000))]
    failures = _run_together([*pickers, shipper])
    assert not failures, failures[:3]
    while ship_both():
        pass

    def own_and_remote(r: Router) -> tuple[dict[str, int], dict[str, int]]:
        rows = r.pool.endpoints()
        own = {e["id"]: e["in_flight_requests"] - e["remote_in_flight_requests"] for e in rows}
        return own, {e["id"]: e["remote_in_flight_requests"] for e in rows}

    (own_a, remote_a), (own_b, remote_b) = own_and_remote(a), own_and_remote(b)
    assert sum(own_a.values()) + sum(own_b.values()) == len(opened) == 800
    assert (remote_b, remote_a) == (own_a, own_b)
    other = np.arange(10**8, 10**8 + 32, dtype=np.uint32)
    for tokens, endpoint, session in made:
        assert a.index.match_tokens(tokens).as_dict() == b.index.match_tokens(tokens).as_dict()
        assert a.pick(tokens=other, session_id=session).endpoint == endpoint
        assert b.pick(tokens=other, session_id=session).endpoint == endpoint
    for d in opened:
        d.finished()
    while ship_both():
        pass
    rows = a.pool.endpoints() + b.pool.endpoints()
    assert [(e["in_flight_requests"], e["remote_in_flight_requests"]) for e in rows] == [(0, 0)] * 8
