"""The prefix index fed by real vLLM engines' KV events agrees with the engines' own caches."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from llmsched import PrefixIndex
from llmsched.integrations import EngineSpec, KVEventSubscriber

from .vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, scaled

VOCAB = 512


def spec(engine: VllmEngine) -> EngineSpec:
    return EngineSpec(
        host="127.0.0.1",
        port=engine.port,
        model=MODEL_NAME,
        kv_events=engine.kv_events_endpoint,
        kv_events_bind=True,
        replay=engine.replay_endpoint,
        topic=engine.topic,
    )


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def cached_blocks(index: PrefixIndex, worker: str, prompt: list[int]) -> int:
    return index.match_tokens(np.asarray(prompt, dtype=np.uint32)).as_dict().get(worker, 0)


def complete(engine: VllmEngine, prompt: list[int], max_tokens: int = 4) -> dict[str, object]:
    return engine.post(
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def settle(
    index: PrefixIndex, worker: str, prompt: list[int], subscriber: KVEventSubscriber
) -> None:
    """Wait until the request's full prompt blocks are in the index, then a little longer for
    the events of its last steps (eviction of other blocks among them)."""
    full = len(prompt) // BLOCK_SIZE
    assert wait_until(lambda: cached_blocks(index, worker, prompt) >= full), (
        f"prompt blocks of {worker} never reached the index: {subscriber.worker_counters(worker)}"
    )
    time.sleep(0.3)


def wait_connected(subscriber: KVEventSubscriber, engines: list[VllmEngine]) -> None:
    """Wait for every engine to connect to the subscriber's bound sockets, then a little for
    the subscription to reach the engine (a PUB socket drops what it sends before that)."""
    connected = subscriber.wait_for(lambda c: c["connects"] >= len(engines), timeout=scaled(30.0))
    assert connected, (
        "engines never connected: "
        + "; ".join(
            f"{e.name} (kv events {e.kv_events_endpoint}): "
            f"{subscriber.worker_counters(spec(e).worker_id)}"
            for e in engines
        )
        + f"; totals {subscriber.counters()}"
    )
    time.sleep(0.5)


@pytest.fixture(scope="module")
def fed_index(engines: list[VllmEngine]) -> Iterator[tuple[PrefixIndex, KVEventSubscriber]]:
    index = PrefixIndex(block_size=BLOCK_SIZE)
    subscriber = KVEventSubscriber(index, [spec(e) for e in engines])
    subscriber.start()
    try:
        wait_connected(subscriber, engines)
        yield index, subscriber
    finally:
        subscriber.stop()


def test_index_predicts_each_engine_prefix_cache_hit(
    engines: list[VllmEngine], fed_index: tuple[PrefixIndex, KVEventSubscriber]
) -> None:
    """Before each request, the index says how many prompt tokens the engine has cached; the
    engine's own `prefix_cache_hits` counter must grow by exactly that. The workload shares
    prefixes and overflows the engine's 64 blocks (7 bases of 10 blocks), so evictions
    (BlockRemoved) happen too."""
    index, subscriber = fed_index
    engine = engines[0]
    worker = spec(engine).worker_id
    rng = random.Random(7)
    bases = [[rng.randrange(5, VOCAB) for _ in range(320)] for _ in range(7)]
    checked = hits_seen = 0
    for step in range(30):
        base = bases[rng.randrange(len(bases))]
        keep = rng.choice([64, 150, 200, 320])
        prompt = base[:keep] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 40))]
        predicted_blocks = cached_blocks(index, worker, prompt)
        # vLLM always computes at least the prompt's last token, so a hit stops one short.
        predicted = min(predicted_blocks, (len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE
        before = engine.metric("vllm:prefix_cache_hits_total")
        complete(engine, prompt)
        after = engine.metric("vllm:prefix_cache_hits_total")
        assert after - before == predicted, (
            f"step {step}: engine hit {after - before} tokens, index predicted {predicted}"
        )
        hits_seen += predicted > 0
        checked += 1
        settle(index, worker, prompt, subscriber)
    counters = subscriber.counters()
    assert checked == 30 and hits_seen >= 8
    assert counters["blocks_removed"] > 0, "the workload was meant to make the engine evict"
    assert counters["decode_errors"] == 0


def test_killed_subscriber_catches_up_through_replay(
    engines: list[VllmEngine], fed_index: tuple[PrefixIndex, KVEventSubscriber]
) -> None:
    """Events published while no subscriber listens are fetched from the engine's replay socket
    as soon as the next live batch shows the gap."""
    index, subscriber = fed_index
    engine = engines[1]
    worker = spec(engine).worker_id
    rng = random.Random(11)
    warm = [rng.randrange(5, VOCAB) for _ in range(100)]
    complete(engine, warm)
    settle(index, worker, warm, subscriber)

    subscriber.stop()
    missed = [rng.randrange(5, VOCAB) for _ in range(130)]
    complete(engine, missed)
    assert cached_blocks(index, worker, missed) == 0

    revived = KVEventSubscriber(index, [spec(e) for e in engines])
    revived.start()
    try:
        trigger = [rng.randrange(5, VOCAB) for _ in range(70)]
        deadline = time.monotonic() + scaled(20)
        # The engine reconnects to the new socket on its own schedule; nudge until a live batch
        # arrives and reveals the gap.
        while time.monotonic() < deadline and cached_blocks(index, worker, missed) < 4:
            complete(engine, trigger)
            wait_until(lambda: cached_blocks(index, worker, missed) >= 4, timeout_s=2.0)
        assert cached_blocks(index, worker, missed) == 4
        counters = revived.worker_counters(worker)
        assert counters["gaps"] >= 1 and counters["replays"] >= 1
        assert counters["replayed_batches"] >= 1
        assert counters["resyncs"] == 0
    finally:
        revived.stop()
        subscriber.start()
        wait_connected(subscriber, engines)
