"""Thread stress: the subscriber (the Python one and the native one) applies batches while other
threads match, pick with a router over the index, and read counters.

Every batch removes the chain's tail block and stores three blocks from there (cycles start with
a full clear), so after batch k of a cycle the prompt matches 3 + 2k blocks. Batches apply
atomically, so a matcher may only ever see 0 or one of those lengths: an even length (the tail
removed, the stores not yet in) or a partial store would be a torn batch. Counters are read as
consistent snapshots: every batch has 2 events and stores 3 blocks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from llmsched import EndpointPool, PrefixIndex, Router
from llmsched.integrations import EngineSpec, KVEventSubscriber, NativeKVEventSubscriber
from llmsched.testing import (
    FakeKVPublisher,
    cleared_event,
    event_batch,
    removed_event,
    stored_event,
)

BLOCK = 16
STEPS = 17  # batches per cycle: the chain grows to 3 + 2 * 16 = 35 blocks
CYCLES = 12
PROMPT = np.arange(1, 1 + 40 * BLOCK, dtype=np.uint32)


def engine_hash(i: int) -> int:
    return 7_000 + i


def tokens(first: int, count: int) -> list[int]:
    return [int(t) for t in PROMPT[first * BLOCK : (first + count) * BLOCK]]


def cycle() -> list[bytes]:
    out = [
        event_batch(
            cleared_event(),
            stored_event([engine_hash(i) for i in range(3)], None, tokens(0, 3), BLOCK),
        )
    ]
    for k in range(1, STEPS):
        tail = 2 * k
        out.append(
            event_batch(
                removed_event([engine_hash(tail)]),
                stored_event(
                    [engine_hash(tail + j) for j in range(3)],
                    engine_hash(tail - 1),
                    tokens(tail, 3),
                    BLOCK,
                ),
            )
        )
    return out


@pytest.mark.parametrize(
    "feed", [KVEventSubscriber, NativeKVEventSubscriber], ids=["python", "native"]
)
def test_subscriber_applies_atomically_while_threads_match(feed: Any) -> None:
    payloads = cycle() * CYCLES
    allowed = {0} | {3 + 2 * k for k in range(STEPS)}
    oracle = PrefixIndex(block_size=BLOCK)
    seen_by_oracle = {0}
    for p in payloads:
        oracle.apply_vllm_events("w", p)
        seen_by_oracle.add(oracle.match_tokens(PROMPT).as_dict().get("w", 0))
    assert seen_by_oracle == allowed  # the oracle walks through exactly the allowed states

    index = PrefixIndex(block_size=BLOCK)
    done = threading.Event()
    observed: list[set[int]] = [set(), set(), set()]
    torn_counters: list[dict[str, int]] = []

    with FakeKVPublisher(topic="kv@stress") as fake:
        spec = EngineSpec("127.0.0.1", 8000, **fake.spec_kwargs())

        def matcher(slot: int) -> None:
            while not done.is_set():
                observed[slot].add(index.match_tokens(PROMPT).as_dict().get(spec.worker_id, 0))

        router = Router(EndpointPool([spec.worker_id, "idle"]), index, config="prefix-only")

        def picker(slot: int) -> None:
            # A pick's cached tokens come from the same whole-batch states as a match.
            while not done.is_set():
                cached = router.pick(tokens=PROMPT, now=0.0).cached_tokens()
                observed[slot].add(cached.get(spec.worker_id, 0) // BLOCK)
                time.sleep(0.0002)  # a pick is heavier than a match: leave the feed its core

        def counter_reader(sub: KVEventSubscriber | NativeKVEventSubscriber) -> None:
            while not done.is_set():
                c = sub.counters()
                if c["events"] != 2 * c["batches"] or c["blocks_stored"] != 3 * c["batches"]:
                    torn_counters.append(c)

        with feed(index, [spec], backoff_s=(0.01, 0.05)) as sub:
            threads = [threading.Thread(target=matcher, args=(i,)) for i in range(2)]
            threads.append(threading.Thread(target=picker, args=(2,)))
            threads.append(threading.Thread(target=counter_reader, args=(sub,)))
            for t in threads:
                t.start()
            try:
                assert fake.wait_subscribed()
                for p in payloads:
                    fake.publish(p)
                    time.sleep(0.0005)  # paced like an engine, so matches interleave with applies
                assert sub.wait_for(lambda c: c["batches"] >= len(payloads), 30.0), sub.counters()
            finally:
                done.set()
                for t in threads:
                    t.join()
            c = sub.counters()

    assert c["gaps"] == 0 and c["decode_errors"] == 0
    assert torn_counters == []
    # The picker shares the machine's cores with the matchers: the overlap is judged on all.
    assert observed[2], "the picker made no pick"
    assert len(set().union(*observed)) > 5, "the readers barely overlapped the subscriber"
    for values in observed:
        assert values <= allowed, sorted(values - allowed)
    assert index.holdings(spec.worker_id) == oracle.holdings("w")
