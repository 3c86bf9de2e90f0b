"""The prefix index beside its PyPI peer, NVIDIA Dynamo's radix tree, and its pure-Python twin.

One workload, three indexes, one process. Multi-turn sessions of 1,000 to 10,000 tokens start
from one of 200 shared system prompts; a follow-up turn returns to the session's worker with
probability 0.8, else lands on another worker. A simulated engine per worker reports each stored
prompt's new blocks as one KV event, with its parent when the worker already holds the prefix:

- llmsched gets the engine's own format, a vLLM ``EventBatch`` msgpack payload with the token
  ids (``PrefixIndex.apply_vllm_events``: decoded, hashed and applied in Rust);
- Dynamo (``ai-dynamo-runtime`` 1.6.1, ``dynamo._core.RadixTree``) gets its JSON ``KvCacheEvent``
  with precomputed block hashes (``apply_event``), as its router receives them;
- the twin (``llmsched.reference.prefix_index``) gets the same chains through ``store``.

Queries are 10,000-token prompts extending stored sequences. Every query's per-worker depths are
cross-checked between the three; the run fails (exit 1) on any difference. Figures: ingest
blocks/s, RSS growth per (block, worker) pair and ``stats()["bytes"]`` against it, lookups/s and
p50 for each input form, and two threads against one. Ratios are llmsched over Dynamo.
An engine that decodes reports its blocks as they fill, one per event: the first events are also
cut into events of one block each (chained by their parents) and ingested by both peers as such
("one-block events"), with its own cross-check.

Both peers get each input in the same form and state. Python lists (of token ids, or of block
hashes) are timed two ways: as a caller has them, the list its tokenizer or hasher has just
produced (each query's list is built just before the timed call, outside it, so its objects are
in the cache for either peer: "tokens list", "hashes list"), and cold (lists built in advance
and cycled through, 400 kB of token ids each, read from memory: "... cold"). Dynamo takes block
hashes only as a list: its hash lookups are timed on fresh lists, and on cold ones beside ours.
Each cold form is also timed against its floor, over the same lists in the same order: a native
pass that only checks every item's type and reads its value (``_llmsched._read_list_floor``),
the reads any converter must make; "floor/Dynamo" is then the most any reader of those lists can
reach against Dynamo on the machine at hand.
Dynamo's ``apply_event`` hands each event to the tree's own thread and returns once that thread
has applied it, so its ingest time covers every event; ``find_matches`` is a round trip to that
thread too. Where the tree's thread sleeps on an idle core, waking it can cost more than the
work (on this project's 2-core VM, Dynamo's ingest and lookups ran 2.5-5x slower so), so
Dynamo is timed in two placements, its threads free and bound to one core, and every ratio is
taken against its faster one.

Dynamo is installed with ``pip install --no-deps --target .bench-peers`` (an environment of its
own, only appended to ``sys.path``); where it cannot be installed the run says so and reports
llmsched beside the twin only. ``make bench-peers`` runs both sizes; ``make bench`` runs the small
one through ``test_bench_peers.py``.

    python benches/bench_peers_index.py --size small|large|both [--no-install]

To iterate on some lookup forms, ``--forms "tokens list cold,tokens numpy"`` times only those
(and their Dynamo peers and two-thread figures) after the cross-check, without the memory and
``Router.pick`` figures, and ``--sequences N`` stores fewer sequences at the size's block size
and worker count (the large size needs about 6 GB with its 100,000).

``--only threads`` times two threads against one for every lookup form, ``--repeat`` times,
llmsched alone (Dynamo's wheel does not load on free-threaded CPython): ``make bench-threads``
runs it on the interpreter of ``make build`` and on 3.14t (``make build-freethreaded``).

``--only ingest`` times the ingest alone (``--repeat`` fresh indexes of each, interleaved) and
cross-checks the queries against Dynamo, for iterating on the ingest path; ``--workload DIR``
keeps each size's built workload in DIR and reuses it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Protocol

import msgpack
import numpy as np
import numpy.typing as npt

from llmsched import EndpointPool, PrefixIndex, Router, _llmsched
from llmsched.reference.prefix_index import ReferencePrefixIndex

PEER = "ai-dynamo-runtime==1.6.1"
PEER_DIR = Path(__file__).resolve().parent.parent / ".bench-peers"


@dataclass(frozen=True)
class Size:
    """One workload size."""

    name: str
    block_size: int
    workers: int
    sequences: int
    queries: int
    twin_queries: int
    pick_workers: int = 0  # also Router.pick over this many workers (the same sequences)


SIZES = {
    "small": Size("small", 16, 64, 10_000, 300, 100),
    "large": Size("large", 64, 256, 100_000, 1_000, 100, pick_workers=1_024),
}
# Stored events cut into one-block events for that figure (`run_one_block_events`): about
# 125,000 one-block events at the small size, 300,000 at the large one.
ONE_BLOCK_EVENTS = {"small": 1_000, "large": 10_000}


# ---- the peer -------------------------------------------------------------------------------


def load_dynamo(install: bool) -> tuple[ModuleType | None, str]:
    """``dynamo._core``, installing it into ``.bench-peers`` when allowed; else (None, why)."""
    if PEER_DIR.is_dir() and str(PEER_DIR) not in sys.path:
        sys.path.append(str(PEER_DIR))
    try:
        import dynamo._core as core  # type: ignore[import-not-found]

        return core, "ok"
    except ImportError:
        pass
    if not install:
        return None, f"{PEER} is not installed in {PEER_DIR} (run without --no-install)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PEER_DIR)]
    try:
        subprocess.run([*cmd, PEER], check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return None, f"could not install {PEER}: {exc} {err.decode(errors='replace')[-300:]}"
    if str(PEER_DIR) not in sys.path:
        sys.path.append(str(PEER_DIR))
    try:
        import dynamo._core as core

        return core, "ok"
    except ImportError as exc:
        return None, f"{PEER} installed but does not import here: {exc}"


# ---- the workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Stored sequences as engine events in three formats, and the queries."""

    size: Size
    vllm: list[tuple[int, bytes]] = field(default_factory=list)
    dynamo: list[tuple[int, bytes]] = field(default_factory=list)
    twin: list[tuple[int, list[int], int | None]] = field(default_factory=list)
    blocks: int = 0  # blocks reported by the events (= (block, worker) pairs stored)
    queries: list[npt.NDArray[np.uint32]] = field(default_factory=list)
    dynamo_hashes: list[list[int]] = field(default_factory=list)


def sessions(size: Size, seed: int = 0) -> tuple[list[tuple[int, npt.NDArray[np.uint32]]], list]:
    """(worker, prompt) for every stored turn, and the prompts queries extend."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, 128_000, size=int(rng.integers(500, 2_000)), dtype=np.uint32)
        for _ in range(200)
    ]
    out: list[tuple[int, npt.NDArray[np.uint32]]] = []
    while len(out) < size.sequences:
        prompt = systems[int(rng.integers(0, len(systems)))]
        worker = int(rng.integers(0, size.workers))
        for turn in range(int(rng.integers(1, 8))):
            extra = rng.integers(0, 128_000, size=int(rng.integers(300, 2_000)), dtype=np.uint32)
            prompt = np.concatenate([prompt, extra])
            if len(prompt) > 10_000:
                break
            if turn and rng.random() >= 0.8:
                worker = int(rng.integers(0, size.workers))
            out.append((worker, prompt))
    return out[: size.sequences], systems


def build(size: Size, dynamo: ModuleType | None, seed: int = 0) -> Workload:
    """The events every index ingests, from a simulated engine per worker."""
    seqs, _systems = sessions(size, seed)
    bs = size.block_size
    hasher = PrefixIndex(block_size=bs)
    held: list[set[int]] = [set() for _ in range(size.workers)]
    wl = Workload(size)
    for event_id, (worker, tokens) in enumerate(seqs):
        hashes = hasher.hash_tokens(tokens).tolist()
        mine = held[worker]
        k = 0
        while k < len(hashes) and hashes[k] in mine:
            k += 1
        if k == len(hashes):
            continue
        new = hashes[k:]
        mine.update(new)
        parent = hashes[k - 1] if k else None
        wl.blocks += len(new)
        stored = {
            "type": "BlockStored",
            "block_hashes": new,
            "parent_block_hash": parent,
            "token_ids": tokens[k * bs : len(hashes) * bs].tolist(),
            "block_size": bs,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        wl.vllm.append((worker, msgpack.packb([time.time(), [stored], 0])))
        wl.twin.append((worker, new, parent))
        if dynamo is not None:
            local = dynamo.compute_block_hash_for_seq(tokens[: len(hashes) * bs].tolist(), bs)
            blocks = [
                {"block_hash": h, "tokens_hash": t} for h, t in zip(new, local[k:], strict=True)
            ]
            event = {
                "event_id": event_id,
                "data": {"stored": {"parent_hash": parent, "blocks": blocks}},
            }
            wl.dynamo.append((worker, json.dumps(event).encode()))
    rng = np.random.default_rng(seed + 1)
    long_ones = [t for _, t in seqs if len(t) >= 4_000] or [t for _, t in seqs]
    for _ in range(size.queries):
        base = long_ones[int(rng.integers(0, len(long_ones)))][:10_000]
        tail = rng.integers(0, 128_000, size=10_000 - len(base), dtype=np.uint32)
        wl.queries.append(np.concatenate([base, tail]))
    if dynamo is not None:
        wl.dynamo_hashes = [dynamo.compute_block_hash_for_seq(q.tolist(), bs) for q in wl.queries]
    return wl


# ---- measuring ------------------------------------------------------------------------------


def rss() -> int:
    """Resident bytes of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn: Callable[[object], object], args: Sequence[object]) -> tuple[float, float]:
    """(calls/s, p50 seconds) of ``fn`` over ``args``, best of 3 passes for the rate."""
    rates, lat = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for a in args:
            s = time.perf_counter()
            fn(a)
            lat.append(time.perf_counter() - s)
        rates.append(len(args) / (time.perf_counter() - t0))
    return max(rates), statistics.median(lat)


def timed_fresh(
    fn: Callable[[object], object], make: Callable[[object], object], args: Sequence[object]
) -> tuple[float, float]:
    """(calls/s, p50 seconds) of ``fn(make(a))`` for each of ``args``, timing only ``fn``: its
    input is built just before each call, as a caller hands over what it has just produced. The
    rate is calls over the summed call times, best of 3 passes."""
    rates, lat = [], []
    for _ in range(3):
        total = 0.0
        for a in args:
            x = make(a)
            s = time.perf_counter()
            fn(x)
            d = time.perf_counter() - s
            total += d
            lat.append(d)
        rates.append(len(args) / total)
    return max(rates), statistics.median(lat)


def own_copies(args: Sequence[object]) -> list[object]:
    """``args`` with each distinct input copied once (an input repeated stays one object, in
    the cache)."""
    copies: dict[int, object] = {}
    for a in args:
        if id(a) not in copies:
            copies[id(a)] = a.copy()  # type: ignore[attr-defined]
    return [copies[id(a)] for a in args]


def threaded(
    fn: Callable[[object], object], args: Sequence[object], threads: int
) -> tuple[float, float]:
    """Calls/s of ``threads`` threads each running ``fn`` over all of ``args``, each thread over
    its own copies (a caller's list is its own: on free-threaded CPython, two threads reading
    one list take turns on its lock), best of 3; and the process CPU seconds per call in that
    pass (on a machine other work keeps busy, the rate cannot double, but a per-call CPU that
    stays flat shows that the threads do not slow each other down)."""
    own = [own_copies(args) for _ in range(threads)]

    def spin(mine: list[object]) -> None:
        for _ in range(rounds):
            for a in mine:
                fn(a)

    # Enough passes over the inputs that a thread runs for a quarter of a second or more: one
    # pass of 300 hash lookups is under a millisecond, shorter than starting the threads.
    t0 = time.perf_counter()
    for a in own[0]:
        fn(a)
    rounds = max(1, math.ceil(0.25 / max(time.perf_counter() - t0, 1e-6)))

    best, cpu = 0.0, 0.0
    calls = threads * rounds * len(args)
    for _ in range(3):
        pool = [threading.Thread(target=spin, args=(own[t],)) for t in range(threads)]
        t0, c0 = time.perf_counter(), time.process_time()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        rate = calls / (time.perf_counter() - t0)
        if rate > best:
            best, cpu = rate, (time.process_time() - c0) / calls
    return best, cpu


def dynamo_depths(scores: object) -> dict[int, int]:
    """Dynamo's OverlapScores as {worker: depth} (its keys are (worker, dp_rank) or worker)."""
    out: dict[int, int] = {}
    for key, depth in scores.scores.items():  # type: ignore[attr-defined]
        worker = key[0] if isinstance(key, tuple) else key
        out[int(worker)] = int(depth)
    return out


def cached_build(size: Size, dynamo: ModuleType | None, cache: Path | None) -> Workload:
    """:func:`build`, kept in (and reused from) ``cache`` when one is given."""
    if cache is None:
        return build(size, dynamo)
    peer = "dynamo" if dynamo is not None else "alone"
    path = cache / f"workload-{size.name}-{size.sequences}-{peer}.pickle"
    if path.exists():
        with path.open("rb") as f:
            return pickle.load(f)  # type: ignore[no-any-return]
    wl = build(size, dynamo)
    cache.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(wl, f)
    return wl


def ingest_llmsched(
    wl: Workload, block_size: int, payloads: Sequence[tuple[int, bytes]] | None = None
) -> tuple[PrefixIndex, float, float]:
    """A fresh index fed every vLLM payload of ``wl`` (or ``payloads``); with the wall and this
    thread's CPU seconds it took."""
    index = PrefixIndex(block_size=block_size)
    t, cpu = time.perf_counter(), time.thread_time()
    for worker, payload in wl.vllm if payloads is None else payloads:
        index.apply_vllm_events(worker, payload)
    return index, time.perf_counter() - t, time.thread_time() - cpu


def ingest_llmsched_hashes(
    stores: Sequence[tuple[int, npt.NDArray[np.uint64], int | None]], block_size: int
) -> float:
    """Wall seconds for a fresh index to take every event of a workload as precomputed block
    hashes (``store``, one numpy array per event), the input Dynamo's JSON events carry."""
    index = PrefixIndex(block_size=block_size)
    t = time.perf_counter()
    for worker, hashes, parent in stores:
        index.store(worker, hashes, parent)
    return time.perf_counter() - t


class DynamoTree(Protocol):
    """The two methods of Dynamo's ``RadixTree`` this benchmark calls."""

    def apply_event(self, worker: int, event: bytes) -> None: ...

    def find_matches(self, hashes: object) -> object: ...


def ingest_dynamo(
    dynamo: ModuleType,
    wl: Workload,
    one_core: bool = False,
    events: Sequence[tuple[int, bytes]] | None = None,
) -> tuple[DynamoTree, float]:
    """A fresh Dynamo tree fed every JSON event of ``wl`` (or ``events``), with the wall seconds
    it took.

    The tree applies events on a thread of its own, and ``apply_event`` waits for it, so each
    event wakes that thread. Where it sleeps on an idle core, waking it costs far more on some
    machines than applying the event (on this project's VM the apply then ran 2.5-5x slower), so
    ``one_core`` times it with both threads bound to one CPU, where the hand-over is a switch on
    the same core: the caller's thread is bound before the tree (and its thread, which inherits
    the binding) is made, and unbound after."""
    allowed = os.sched_getaffinity(0)
    if one_core:
        os.sched_setaffinity(0, {max(allowed)})
    try:
        tree = dynamo.RadixTree()
        t = time.perf_counter()
        for worker, event in wl.dynamo if events is None else events:
            tree.apply_event(worker, event)
        tree.find_matches(wl.dynamo_hashes[0])  # the tree applies events on its own thread
        return tree, time.perf_counter() - t
    finally:
        os.sched_setaffinity(0, allowed)


def one_block_events(
    wl: Workload, events: int
) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """The first ``events`` stored events of ``wl`` cut into events of one block each, chained
    by their parents, as an engine reports the blocks decoding fills one at a time: one vLLM
    payload per event, and Dynamo's JSON event for the same block (none without Dynamo)."""
    bs = wl.size.block_size
    ours: list[tuple[int, bytes]] = []
    theirs: list[tuple[int, bytes]] = []
    for k, (worker, payload) in enumerate(wl.vllm[:events]):
        _, (stored,), _ = msgpack.unpackb(payload)
        parent = stored["parent_block_hash"]
        dynamo_event = json.loads(wl.dynamo[k][1])["data"]["stored"] if wl.dynamo else None
        dynamo_parent = dynamo_event["parent_hash"] if dynamo_event else None
        for i, block in enumerate(stored["block_hashes"]):
            tokens = stored["token_ids"][i * bs : (i + 1) * bs]
            one = dict(stored, block_hashes=[block], parent_block_hash=parent, token_ids=tokens)
            ours.append((worker, msgpack.packb([time.time(), [one], 0])))
            parent = block
            if dynamo_event is not None:
                entry = dynamo_event["blocks"][i]
                data = {"stored": {"parent_hash": dynamo_parent, "blocks": [entry]}}
                event = {"event_id": len(theirs), "data": data}
                theirs.append((worker, json.dumps(event).encode()))
                dynamo_parent = entry["block_hash"]
    return ours, theirs


def run_one_block_events(
    wl: Workload, dynamo: ModuleType | None, events: int, repeat: int = 2
) -> dict[str, float]:
    """Ingest of one-block events (see `one_block_events`): llmsched per payload beside Dynamo
    per event on one core, best of ``repeat`` each; then the first 100 queries' per-worker
    depths cross-checked between the two."""
    ours, theirs = one_block_events(wl, events)
    blocks = len(ours)
    best_ours = best_theirs = 0.0
    index = tree = None
    for _ in range(repeat):
        del index
        gc.collect()
        index, seconds, _ = ingest_llmsched(wl, wl.size.block_size, ours)
        best_ours = max(best_ours, blocks / seconds)
        if dynamo is not None:
            del tree
            gc.collect()
            # On one core, its faster placement (see `ingest_dynamo`).
            tree, seconds = ingest_dynamo(dynamo, wl, one_core=True, events=theirs)
            best_theirs = max(best_theirs, blocks / seconds)
    fig = {"ingest_one_block_llmsched": best_ours, "one_block_events": float(blocks)}
    line = (
        f"   one-block events (decode's shape; the first {events:,} events cut into {blocks:,}),"
        f" M blocks/s: llmsched {best_ours / 1e6:.2f} ({1e9 / best_ours:.0f} ns an event)"
    )
    differing = 0
    if tree is not None and index is not None:
        fig["ingest_one_block_dynamo"] = best_theirs
        for i, q in enumerate(wl.queries[:100]):
            got = index.match_tokens(q, now=0.0).as_dict()
            differing += dynamo_depths(tree.find_matches(wl.dynamo_hashes[i])) != got
        line += (
            f", Dynamo on one core {best_theirs / 1e6:.2f} ({1e9 / best_theirs:.0f} ns);"
            f" llmsched/Dynamo {best_ours / best_theirs:.2f}x; {differing} of 100 queries differ"
        )
    fig["differing_one_block"] = differing
    print(line)
    return fig


def run_ingest(
    size: Size, dynamo: ModuleType | None, why: str, repeat: int, cache: Path | None
) -> dict[str, float]:
    """The ingest alone: ``repeat`` fresh indexes of llmsched and of Dynamo, interleaved, best
    rate of each; then every query's per-worker depths cross-checked between the two."""
    print(f"\n== {size.name}: bs{size.block_size}, {size.workers} workers, {size.sequences:,} seqs")
    if dynamo is None:
        print(f"   Dynamo skipped: {why}")
    wl = cached_build(size, dynamo, cache)
    print(f"   workload: {wl.blocks:,} (block, worker) pairs in {len(wl.vllm):,} events")
    gc.collect()
    gc.freeze()
    bs = size.block_size
    ours: list[float] = []
    ours_cpu: list[float] = []  # per CPU second of this thread, which does all of the work
    theirs: list[float] = []  # Dynamo's threads free to run on any core
    theirs_one: list[float] = []  # Dynamo's two threads bound to one core
    # The like-for-like input: the same events as precomputed hashes, as Dynamo gets them.
    stores = [(w, np.array(h, dtype=np.uint64), p) for w, h, p in wl.twin]
    ours_hashes: list[float] = []
    index = tree = None
    for _ in range(repeat):
        del index, tree
        gc.collect()
        index, seconds, cpu = ingest_llmsched(wl, bs)
        ours.append(wl.blocks / seconds)
        ours_cpu.append(wl.blocks / cpu)
        if stores:
            ours_hashes.append(wl.blocks / ingest_llmsched_hashes(stores, bs))
            gc.collect()
        tree = None
        if dynamo is not None:
            tree, seconds = ingest_dynamo(dynamo, wl)
            theirs.append(wl.blocks / seconds)
            del tree
            gc.collect()
            tree, seconds = ingest_dynamo(dynamo, wl, one_core=True)
            theirs_one.append(wl.blocks / seconds)
    fig: dict[str, float] = {"pairs": wl.blocks, "ingest_llmsched": max(ours)}
    differing = 0
    if tree is not None:
        # The ratio is taken against Dynamo's faster placement.
        fig["ingest_dynamo"] = max(theirs + theirs_one)
        fig["ingest_dynamo_free"] = max(theirs)
        fig["ingest_dynamo_one_core"] = max(theirs_one)
        for i, q in enumerate(wl.queries):
            got = index.match_tokens(q, now=0.0).as_dict()  # type: ignore[union-attr]
            differing += dynamo_depths(tree.find_matches(wl.dynamo_hashes[i])) != got
    fig["differing"] = differing
    load = os.getloadavg()[0]
    each = ", ".join(f"{r / 1e6:.2f}" for r in ours)
    line = f"   ingest, M blocks/s: llmsched (vLLM msgpack) {max(ours) / 1e6:.2f} (runs: {each})"
    if theirs:
        peer = ", ".join(f"{r / 1e6:.2f}" for r in theirs)
        one = ", ".join(f"{r / 1e6:.2f}" for r in theirs_one)
        line += f", Dynamo (JSON) {max(theirs) / 1e6:.2f} (runs: {peer}), "
        line += f"its threads on one core {max(theirs_one) / 1e6:.2f} (runs: {one}); "
        line += f"llmsched/Dynamo {max(ours) / fig['ingest_dynamo']:.2f}x (its faster placement)"
    each_cpu = ", ".join(f"{r / 1e6:.2f}" for r in ours_cpu)
    print(line + f"; load {load:.2f}")
    print(f"   llmsched per CPU second, M blocks: {max(ours_cpu) / 1e6:.2f} (runs: {each_cpu})")
    if ours_hashes:
        fig["ingest_llmsched_hashes"] = max(ours_hashes)
        each_h = ", ".join(f"{r / 1e6:.2f}" for r in ours_hashes)
        best = max(ours_hashes) / 1e6
        line = f"   llmsched from precomputed hashes (store), M blocks/s: {best:.2f}"
        line += f" (runs: {each_h})"
        if theirs:
            line += f"; /Dynamo {max(ours_hashes) / fig['ingest_dynamo']:.2f}x"
        print(line)
    if tree is not None:
        print(f"   cross-check with Dynamo: {differing} of {len(wl.queries)} queries differ")
    del index, tree
    fig.update(run_one_block_events(wl, dynamo, ONE_BLOCK_EVENTS[size.name], repeat))
    fig["differing"] += fig["differing_one_block"]
    return fig


def run_threads(size: Size, repeat: int, cache: Path | None) -> dict[str, float]:
    """Two threads against one for every lookup form, ``repeat`` times (llmsched alone: for
    interpreters Dynamo's wheel does not load on, such as free-threaded CPython). The forms'
    answers are cross-checked against each other first."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(
        f"\n== {size.name}: bs{size.block_size}, {size.workers} workers, {size.sequences:,} seqs; "
        f"Python {sys.version.split()[0]}, GIL {'on' if gil else 'off'}"
    )
    wl = cached_build(size, None, cache)
    gc.collect()
    gc.freeze()
    index, _, _ = ingest_llmsched(wl, size.block_size)
    token_lists = [q.tolist() for q in wl.queries]
    hashes_np = [index.hash_tokens(q) for q in wl.queries]
    differing = 0
    for i, q in enumerate(wl.queries):
        got = index.match_tokens(q, now=0.0).as_dict()
        views = [
            index.match(hashes_np[i], now=0.0).as_dict(),
            index.match(hashes_np[i].tolist(), now=0.0).as_dict(),
            index.match_tokens(token_lists[i], now=0.0).as_dict(),
        ]
        differing += any(v != got for v in views)
    print(f"   cross-check between the forms: {differing} of {len(wl.queries)} queries differ")
    forms: dict[str, tuple[Callable[[object], object], Sequence[object]]] = {
        "hashes numpy": (lambda h: index.match(h, now=0.0), hashes_np),
        "hashes list": (lambda h: index.match(h, now=0.0), [h.tolist() for h in hashes_np[:2]]),
        "hashes list cold": (lambda h: index.match(h, now=0.0), [h.tolist() for h in hashes_np]),
        "tokens numpy": (lambda q: index.match_tokens(q, now=0.0), wl.queries),
        "tokens list": (lambda q: index.match_tokens(q, now=0.0), token_lists[:2]),
        "tokens list cold": (lambda q: index.match_tokens(q, now=0.0), token_lists),
    }
    fig: dict[str, float] = {"differing": differing}
    for name in THREAD_FORMS:
        fn, args = forms[name]
        if len(args) == 2:  # in the cache, as a list just made is: cycle through two
            args = list(args) * (len(wl.queries) // 2)
        ratios, cpus, busy = [], [], []
        for _ in range(repeat):
            one, cpu_one = threaded(fn, args, 1)
            two, cpu_two = threaded(fn, args, 2)
            ratios.append(two / one)
            cpus.append(cpu_two / cpu_one)
            busy.append(two * cpu_two)  # CPU seconds per second: at most 1 while a GIL is held
        fig[f"threads {name}"] = statistics.median(ratios)
        print(
            f"   {name:16s}: one thread {one:>9,.0f}/s, two threads / one "
            f"{min(ratios):.2f}-{max(ratios):.2f}x (runs: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f"), CPU per call {min(cpus):.2f}-{max(cpus):.2f}x, two threads keep "
            + f"{min(busy):.2f}-{max(busy):.2f} cores busy; load {os.getloadavg()[0]:.2f}"
        )
    return fig


def run(
    size: Size,
    dynamo: ModuleType | None,
    why: str,
    only: Sequence[str] = (),
    cache: Path | None = None,
) -> dict[str, float]:
    """Builds, ingests, cross-checks and times one size; prints and returns its figures. With
    ``only`` (lookup form names), times those forms alone and skips the memory and pick figures;
    with ``cache``, keeps the built workload there and reuses it."""
    print(f"\n== {size.name}: bs{size.block_size}, {size.workers} workers, {size.sequences:,} seqs")
    if dynamo is None:
        print(f"   Dynamo skipped: {why}")
    t = time.perf_counter()
    wl = cached_build(size, dynamo, cache)
    print(
        f"   workload: {wl.blocks:,} (block, worker) pairs in {len(wl.vllm):,} events, "
        f"{len(wl.queries)} queries of 10,000 tokens (built in {time.perf_counter() - t:.0f} s)"
    )
    fig: dict[str, float] = {"pairs": wl.blocks}
    # A router's heap is long-lived: keep the workload's millions of objects out of the cyclic
    # collector's passes, which would otherwise bill whichever index allocates (llmsched returns
    # a report per batch, Dynamo nothing) for traversing them.
    gc.collect()
    gc.freeze()
    bs = size.block_size

    # Ingest, timed here; memory per pair from a fresh process per index (`memory_of`), where
    # the ingest cannot reuse memory freed while building the workload.
    index, seconds, _ = ingest_llmsched(wl, bs)
    fig["ingest_llmsched"] = wl.blocks / seconds
    tree = None
    if dynamo is not None:
        tree, seconds = ingest_dynamo(dynamo, wl)
        fig["ingest_dynamo_free"] = wl.blocks / seconds
        del tree
        gc.collect()
        tree, seconds = ingest_dynamo(dynamo, wl, one_core=True)
        fig["ingest_dynamo_one_core"] = wl.blocks / seconds
        # The ratio is taken against Dynamo's faster placement (see `ingest_dynamo`).
        fig["ingest_dynamo"] = max(fig["ingest_dynamo_free"], fig["ingest_dynamo_one_core"])
    twin = ReferencePrefixIndex(block_size=bs)
    t = time.perf_counter()
    for worker, hashes, parent in wl.twin:
        twin.store(worker, hashes, parent)
    fig["ingest_twin"] = wl.blocks / (time.perf_counter() - t)
    if not only:
        fig.update(run_one_block_events(wl, dynamo, ONE_BLOCK_EVENTS[size.name]))
        with tempfile.TemporaryDirectory() as tmp:
            events = Path(tmp) / "events.pickle"
            with events.open("wb") as f:
                pickle.dump((bs, wl.blocks, wl.vllm, wl.dynamo, wl.twin), f)
            for who in ("llmsched", "dynamo", "twin"):
                if who == "dynamo" and dynamo is None:
                    continue
                out = subprocess.run(
                    [sys.executable, __file__, "--memory-of", who, str(events)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                got = json.loads(out.strip().splitlines()[-1])
                fig[f"mem_{who}"] = got["bytes_per_pair"]
                if who == "llmsched":
                    fig["stats_bytes_ratio"] = got["stats_over_rss"]

    # Cross-check every query's per-worker depths.
    token_lists = [q.tolist() for q in wl.queries]
    hashes_np = [index.hash_tokens(q) for q in wl.queries]
    hashes_list = [h.tolist() for h in hashes_np]
    differing = 0
    matched = []
    for i, q in enumerate(wl.queries):
        got = index.match_tokens(q, now=0.0).as_dict()
        matched.append(len(got))
        views = [
            index.match(hashes_list[i], now=0.0).as_dict(),
            index.match_tokens(token_lists[i], now=0.0).as_dict(),
        ]
        if tree is not None:
            views.append(dynamo_depths(tree.find_matches(wl.dynamo_hashes[i])))
        if i < size.twin_queries:
            views.append({w: v[0] for w, v in twin.match(hashes_list[i]).items()})
        differing += any(v != got for v in views)
    # The one-block events' cross-check counts too: any difference fails the run.
    fig["differing"] = differing + fig.get("differing_one_block", 0)
    fig["workers_matched"] = statistics.mean(matched)
    print(
        f"   cross-check: {differing} of {len(wl.queries)} queries differ "
        f"({fig['workers_matched']:.0f} workers matched per query on average)"
    )

    forms: dict[str, Form] = {
        "hashes numpy": (lambda h: index.match(h, now=0.0), hashes_np, None),
        "hashes list": (lambda h: index.match(h, now=0.0), hashes_np, to_list),
        "hashes list cold": (lambda h: index.match(h, now=0.0), hashes_list, None),
        "tokens numpy": (lambda q: index.match_tokens(q, now=0.0), wl.queries, None),
        "tokens list": (lambda q: index.match_tokens(q, now=0.0), wl.queries, to_list),
        "tokens list cold": (lambda q: index.match_tokens(q, now=0.0), token_lists, None),
    }
    if tree is not None:

        def dynamo_tokens(q: object) -> object:
            return tree.find_matches(dynamo.compute_block_hash_for_seq(q, bs))

        dynamo_np = [np.array(h, dtype=np.uint64) for h in wl.dynamo_hashes]
        forms["dynamo hashes"] = (tree.find_matches, dynamo_np, to_list)
        forms["dynamo hashes cold"] = (tree.find_matches, wl.dynamo_hashes, None)
        forms["dynamo tokens list"] = (dynamo_tokens, wl.queries, to_list)
        forms["dynamo tokens list cold"] = (dynamo_tokens, token_lists, None)
    # The floor of a cold list: a native pass that only checks each item's type and reads its
    # value, over the same lists in the same order, the faster of without and with the
    # prefetch our readers use (see `floor_of`).
    for name, lists in (("hashes list cold", hashes_list), ("tokens list cold", token_lists)):
        if hasattr(_llmsched, "_read_list_floor"):  # builds before it have no floor
            forms["floor " + name] = (partial(floor_of, lists), [None], None)
    few = token_lists[: size.twin_queries]
    forms["twin tokens list"] = (lambda q: twin.match(twin.hash_tokens(q)), few, None)
    peers = {PEER_OF[name] for name in only} | {"floor " + name for name in only}
    for name, (fn, args, make) in forms.items():
        if only and name not in only and name not in peers and name != "twin tokens list":
            continue
        if name.startswith("floor"):
            rate, p50 = fn(None)  # type: ignore[misc]
        elif name.startswith("dynamo"):
            rate, p50 = on_faster_placement(partial(timed_form, fn, args, make))
        else:
            rate, p50 = timed_form(fn, args, make)
        fig[f"qps {name}"] = rate
        fig[f"p50 {name}"] = p50
    # Two threads against one, each thread over every input; a form whose input is made just
    # before its call cycles through two inputs made in advance (in the cache, as fresh ones are).
    for name in THREAD_FORMS:
        if only and name not in only:
            continue
        fn, args, make = forms[name]
        if make is not None:
            args = [make(a) for a in args[:2]] * (len(args) // 2)
        fig[f"threads {name}"] = threaded(fn, args, 2)[0] / threaded(fn, args, 1)[0]
    if not only:
        pick_figures(fig, index, size.workers, wl.queries)
    if size.pick_workers and not only:
        # The same sequences over more workers, for Router.pick over a larger pool.
        wide = build(replace(size, workers=size.pick_workers), None)
        gc.collect()
        gc.freeze()  # as above: the new workload's objects stay out of the collector's passes
        wide_index = PrefixIndex(block_size=bs)
        for worker, payload in wide.vllm:
            wide_index.apply_vllm_events(worker, payload)
        pick_figures(fig, wide_index, size.pick_workers, wide.queries, suffix=" wide")
        del wide, wide_index
    report(fig, tree is not None, only)
    return fig


def timed_form(
    fn: Callable[[object], object],
    args: Sequence[object],
    make: Callable[[object], object] | None,
) -> tuple[float, float]:
    """Calls per second and p50 seconds of a lookup form."""
    return timed(fn, args) if make is None else timed_fresh(fn, make, args)


def floor_of(lists: Sequence[list[int]], _: object = None) -> tuple[float, float]:
    """Calls per second and p50 seconds of the floor of reading ``lists``, timed as
    :func:`timed` times the lookups over them: ``_read_list_floor`` (every item's type checked
    and value read, as a converter must, nothing else done), the faster of without and with
    prefetching the items ahead."""
    read = _llmsched._read_list_floor
    plain = timed(lambda items: read(items, False), lists)  # as the lookups: through a lambda
    ahead = timed(lambda items: read(items, True), lists)
    return max(plain, ahead)


def on_faster_placement(timing: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """A Dynamo timing taken twice, the caller free to run on any core and then bound to the
    core of the tree's thread (see `ingest_dynamo`: every call is a round trip to that
    thread), keeping the faster: a Dynamo user would place its threads so."""
    allowed = os.sched_getaffinity(0)
    free = timing()
    os.sched_setaffinity(0, {max(allowed)})
    try:
        one_core = timing()
    finally:
        os.sched_setaffinity(0, allowed)
    return max(free, one_core)


# A lookup form: (call, inputs, how each input is made just before its call; None: in advance).
Form = tuple[Callable[[object], object], Sequence[object], Callable[[object], object] | None]


def to_list(tokens: object) -> object:
    """A token array as the Python list a tokenizer returns."""
    return tokens.tolist()  # type: ignore[attr-defined]


# Each llmsched lookup form and the Dynamo form it is compared with.
PEER_OF = {
    "hashes numpy": "dynamo hashes",
    "hashes list": "dynamo hashes",
    "hashes list cold": "dynamo hashes cold",
    "tokens numpy": "dynamo tokens list",
    "tokens list": "dynamo tokens list",
    "tokens list cold": "dynamo tokens list cold",
}

THREAD_FORMS = (
    "hashes numpy",
    "hashes list",
    "hashes list cold",
    "tokens numpy",
    "tokens list",
    "tokens list cold",
)


def pick_figures(
    fig: dict[str, float],
    index: PrefixIndex,
    workers: int,
    queries: list[npt.NDArray[np.uint32]],
    suffix: str = "",
) -> None:
    """``Router.pick`` (llm-d's default config, one endpoint per worker) over the loaded index:
    p50 and p99, and the share of the p50 a bare ``match_tokens`` of the same prompt takes."""
    pool = EndpointPool(list(range(workers)))
    router = Router(pool, index, "llm-d", seed=1)
    picks, matches = [], []
    for q in queries:
        t = time.perf_counter()
        router.pick(tokens=q, now=0.0)
        picks.append(time.perf_counter() - t)
        t = time.perf_counter()
        index.match_tokens(q, now=0.0)
        matches.append(time.perf_counter() - t)
    picks.sort()
    fig["pick endpoints" + suffix] = workers
    fig["pick p50" + suffix] = picks[len(picks) // 2]
    fig["pick p99" + suffix] = picks[min(len(picks) - 1, len(picks) * 99 // 100)]
    fig["pick index share" + suffix] = statistics.median(matches) / fig["pick p50" + suffix]


def report(fig: dict[str, float], peer: bool, only: Sequence[str] = ()) -> None:
    """Prints the figures and the ratios llmsched / Dynamo (and / twin); with ``only``, the
    lookups of those forms alone."""

    def ratio(a: str, b: str) -> str:
        return f"{fig[a] / fig[b]:.2f}x" if peer or "twin" in b else "n/a"

    print(
        f"   ingest, blocks/s: llmsched (vLLM msgpack) {fig['ingest_llmsched']:,.0f}"
        + (
            f", Dynamo (JSON) {fig['ingest_dynamo_free']:,.0f}, its threads on one core"
            f" {fig['ingest_dynamo_one_core']:,.0f}"
            if peer
            else ""
        )
        + f", twin {fig['ingest_twin']:,.0f}; llmsched/Dynamo "
        + (ratio("ingest_llmsched", "ingest_dynamo") if peer else "n/a")
        + f", /twin {ratio('ingest_llmsched', 'ingest_twin')}"
    )
    if "mem_llmsched" in fig:
        print(
            f"   bytes per (block, worker) pair (RSS growth): llmsched {fig['mem_llmsched']:.1f}"
            + (f", Dynamo {fig['mem_dynamo']:.1f}" if peer else "")
            + f", twin {fig['mem_twin']:.1f}; llmsched/Dynamo "
            + (f"{fig['mem_llmsched'] / fig['mem_dynamo']:.2f}x" if peer else "n/a")
            + f"; stats()['bytes'] / RSS growth {fig['stats_bytes_ratio']:.2f}"
        )
    for name, other in PEER_OF.items():
        if only and name not in only:
            continue
        line = (
            f"   lookup from {name:16s}: {fig['qps ' + name]:>9,.0f}/s p50 "
            f"{fig['p50 ' + name] * 1e6:7.1f} us"
        )
        if peer:
            line += (
                f" | Dynamo ({other[7:]:16s}) {fig['qps ' + other]:>8,.0f}/s p50 "
                f"{fig['p50 ' + other] * 1e6:7.1f} us | {ratio('qps ' + name, 'qps ' + other)}"
                f" (p50 {fig['p50 ' + other] / fig['p50 ' + name]:.2f}x)"
            )
        if "qps floor " + name in fig:
            floor = fig["qps floor " + name]
            above = floor / fig["qps " + name] - 1
            line += f" | floor p50 {fig['p50 floor ' + name] * 1e6:.1f} us, ours {above:+.0%}"
            if peer:
                line += f", floor/Dynamo {floor / fig['qps ' + other]:.1f}x"
        line += f" | twin x{fig['qps ' + name] / fig['qps twin tokens list']:.0f}"
        line += f" | 2 threads {fig['threads ' + name]:.2f}x"
        print(line)
    for suffix in ("", " wide"):
        if "pick p50" + suffix not in fig:
            continue
        print(
            f"   Router.pick (llm-d config, {fig['pick endpoints' + suffix]:.0f} endpoints, one "
            f"per worker): p50 {fig['pick p50' + suffix] * 1e6:.1f} us, p99 "
            f"{fig['pick p99' + suffix] * 1e6:.1f} us; a bare match_tokens of the prompt is "
            f"{fig['pick index share' + suffix]:.0%} of the p50"
        )

    def worst(*pairs: tuple[str, str]) -> str:
        got = [
            fig["qps " + n] / fig["qps " + lst]
            for lst, n in pairs
            if "qps " + lst in fig and "qps " + n in fig
        ]
        return f"{max(got):.2f}x" if got else "n/a"

    fresh = worst(("hashes list", "hashes numpy"), ("tokens list", "tokens numpy"))
    cold = worst(("hashes list cold", "hashes numpy"), ("tokens list cold", "tokens numpy"))
    print(f"   list paths at worst {fresh} slower than numpy ({cold} for cold lists)")


def memory_of(who: str, events: Path) -> None:
    """Child process: ingest one index's events, print its RSS growth per pair as JSON."""
    with events.open("rb") as f:
        bs, pairs, vllm, dyn, twin_events = pickle.load(f)
    gc.collect()
    before = rss()
    extra: dict[str, float] = {}
    if who == "llmsched":
        index = PrefixIndex(block_size=bs)
        for worker, payload in vllm:
            index.apply_vllm_events(worker, payload)
        grown = rss() - before
        extra["stats_over_rss"] = index.stats()["bytes"] / max(grown, 1)
    elif who == "dynamo":
        core, why = load_dynamo(install=False)
        if core is None:
            raise SystemExit(why)
        tree = core.RadixTree()
        for worker, event in dyn:
            tree.apply_event(worker, event)
        tree.find_matches([0])
        grown = rss() - before
    else:
        twin = ReferencePrefixIndex(block_size=bs)
        for worker, hashes, parent in twin_events:
            twin.store(worker, hashes, parent)
        grown = rss() - before
    print(json.dumps({"bytes_per_pair": grown / pairs, **extra}))


def main(argv: list[str] | None = None) -> int:
    """Command line: runs the sizes asked for; exit 1 when any query differs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "large", "both"], default="both")
    parser.add_argument("--no-install", action="store_true", help="never pip-install the peer")
    parser.add_argument(
        "--forms",
        default="",
        help="comma-separated lookup forms to time alone (e.g. 'tokens list cold,tokens numpy')",
    )
    parser.add_argument(
        "--sequences", type=int, help="store this many sequences (default: the size's)"
    )
    parser.add_argument(
        "--only",
        choices=["ingest", "threads"],
        help="time the ingest alone (and cross-check with Dynamo), or two threads against one "
        "for every lookup form (llmsched alone)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="with --only ingest: fresh indexes of each, interleaved; with --only threads: "
        "ratios per form",
    )
    parser.add_argument(
        "--workload", type=Path, metavar="DIR", help="keep built workloads in DIR and reuse them"
    )
    parser.add_argument("--memory-of", nargs=2, metavar=("INDEX", "EVENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_of:
        memory_of(args.memory_of[0], Path(args.memory_of[1]))
        return 0
    dynamo, why = (None, "") if args.only == "threads" else load_dynamo(not args.no_install)
    names = ["small", "large"] if args.size == "both" else [args.size]
    only = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = [f for f in only if f not in PEER_OF]
    if unknown:
        parser.error(f"unknown lookup forms {unknown}: expected some of {list(PEER_OF)}")
    bad = 0
    for name in names:
        size = SIZES[name]
        if args.sequences:
            size = replace(size, sequences=args.sequences)
        if args.only == "ingest":
            fig = run_ingest(size, dynamo, why, args.repeat, args.workload)
        elif args.only == "threads":
            fig = run_threads(size, args.repeat, args.workload)
        else:
            fig = run(size, dynamo, why, only, args.workload)
        bad += int(fig["differing"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
