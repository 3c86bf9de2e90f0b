"""KVEventSubscriber and NativeKVEventSubscriber against fake engines: real ZMQ on loopback,
scripted batches. Every test runs over both subscribers (the ``feed`` fixture) unless it is
marked ``python_feed_only`` (it reads the Python subscriber's own internals)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _data import load_vector
from test_integrations_kv_zmtp import GREETING, TERABYTE, HostileListener

from llmsched import PrefixIndex
from llmsched.errors import ConfigError
from llmsched.integrations import EngineSpec, KVEventSubscriber, NativeKVEventSubscriber
from llmsched.testing import (
    FakeKVPublisher,
    cleared_event,
    event_batch,
    removed_event,
    stored_event,
)

BLOCK = 16
FEEDS = {"python": KVEventSubscriber, "native": NativeKVEventSubscriber}
# The subscriber class of the running test (set by the ``feed`` fixture).
_feed: list[Any] = [KVEventSubscriber]


@pytest.fixture(autouse=True, params=list(FEEDS))
def feed(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs each test over both subscribers."""
    marker = request.node.get_closest_marker("python_feed_only")
    if request.param == "native" and marker is not None:
        pytest.skip(f"native feed: {marker.args[0]}")
    _feed[0] = FEEDS[request.param]
    try:
        yield request.param
    finally:
        _feed[0] = KVEventSubscriber


def Subscriber(*args: Any, **kwargs: Any) -> Any:
    """The subscriber of the running test."""
    return _feed[0](*args, **kwargs)


FAST = {"backoff_s": (0.01, 0.05), "replay_timeout_s": 2.0}
WAIT_S = 10.0


def script(n: int, seed: int = 0, *, clears: bool = True) -> list[bytes]:
    """``n`` batches of an engine's life: chains grown from roots or from held blocks, tail
    removals, now and then a full clear. Engine block hashes are opaque ints."""
    rng = random.Random(seed)
    held: dict[int, int | None] = {}  # engine hash -> parent
    children: dict[int, int] = {}
    next_hash = 1 + seed * 1_000_000
    out = []
    for _ in range(n):
        events: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.08 and held and clears:
                events.append(cleared_event())
                held.clear()
                children.clear()
            elif roll < 0.3 and held:
                leaves = [h for h in held if children.get(h, 0) == 0]
                victim = rng.choice(leaves)
                parent = held.pop(victim)
                if parent is not None:
                    children[parent] -= 1
                events.append(removed_event([victim]))
            else:
                parent = rng.choice([None, *held]) if held else None
                blocks = rng.randint(1, 3)
                hashes = list(range(next_hash, next_hash + blocks))
                next_hash += blocks
                tokens = [rng.randrange(50_000) for _ in range(blocks * BLOCK)]
                events.append(stored_event(hashes, parent, tokens, BLOCK))
                prev = parent
                for h in hashes:
                    held[h] = prev
                    if prev is not None:
                        children[prev] = children.get(prev, 0) + 1
                    prev = h
        out.append(event_batch(*events, ts=float(len(out))))
    return out


def direct(payloads: list[bytes], worker: str) -> PrefixIndex:
    """The oracle: the same payloads applied straight to a fresh index."""
    index = PrefixIndex(block_size=BLOCK)
    for p in payloads:
        index.apply_vllm_events(worker, p)
    return index


def holdings(index: PrefixIndex, worker: str) -> dict[int, Any]:
    return index.holdings(worker) if worker in index.workers() else {}


def wait(sub: Any, cond: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    # The whole counter dict on failure: pytest's assertion rewriting truncates a long one.
    assert sub.wait_for(cond, WAIT_S), repr(sub.counters())
    return sub.counters()


@pytest.fixture
def fake() -> Iterator[FakeKVPublisher]:
    with FakeKVPublisher(topic="kv@a") as engine:
        yield engine


def spec_of(engine: FakeKVPublisher, port: int = 8000, **kw: Any) -> EngineSpec:
    return EngineSpec("127.0.0.1", port, **{**engine.spec_kwargs(), **kw})


def test_normal_flow_matches_direct_apply(fake: FakeKVPublisher) -> None:
    payloads = script(60)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        for p in payloads:
            fake.publish(p)
        c = wait(sub, lambda c: c["batches"] >= 60)
        assert sub.last_seq(spec.worker_id) == 59
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )
    assert c["gaps"] == c["replays"] == c["resyncs"] == c["decode_errors"] == 0
    assert c["blocks_stored"] > 0 and c["blocks_removed"] > 0
    assert c["connects"] == 1
    assert sub.worker_counters(spec.worker_id)["batches"] == 60
    # The index knows it is fed by engines (the router's routing note reads this), whichever
    # feed applied the batches.
    assert index.fed_by_engine_events and index.stats()["event_batches"] == 60


def test_bind_mode_engine_connects() -> None:
    payloads = script(30, seed=1)
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec(
        "127.0.0.1", 8000, kv_events="tcp://127.0.0.1:*", kv_events_bind=True, topic="kv@b"
    )
    with Subscriber(index, [spec], **FAST) as sub:
        endpoint = sub.bound_endpoint(spec.worker_id)
        assert endpoint is not None and endpoint.startswith("tcp://127.0.0.1:")
        with FakeKVPublisher(topic="kv@b", endpoint=endpoint, connect=True, replay=False) as eng:
            assert eng.wait_subscribed()
            for p in payloads:
                eng.publish(p)
            wait(sub, lambda c: c["batches"] >= 30)
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_late_joiner_recovered_via_replay(fake: FakeKVPublisher) -> None:
    payloads = script(20, seed=2)
    for p in payloads[:8]:
        fake.publish(p, deliver=False)  # published before the subscriber existed
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        for p in payloads[8:]:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 19)
    assert fake.replay_requests == [0]
    assert c["gaps"] == 1 and c["replays"] == 1 and c["resyncs"] == 0
    assert c["replayed_batches"] >= 8
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


@pytest.mark.parametrize("with_topic", [False, True], ids=["seq-payload", "topic-seq-payload"])
def test_gap_in_the_middle_recovered_via_replay(with_topic: bool) -> None:
    payloads = script(30, seed=3)
    index = PrefixIndex(block_size=BLOCK)
    with FakeKVPublisher(topic="kv@a", replay_with_topic=with_topic) as fake:
        spec = spec_of(fake)
        with Subscriber(index, [spec], **FAST) as sub:
            assert fake.wait_subscribed()
            for i, p in enumerate(payloads):
                fake.publish(p, deliver=not 10 <= i < 15)
            # Every one of the 25 live batches is either applied or dropped as a duplicate.
            c = wait(sub, lambda c: c["batches"] - c["replayed_batches"] + c["duplicates"] == 25)
            assert sub.last_seq(spec.worker_id) == 29
        assert fake.replay_requests == [10]
    assert c["gaps"] == 1 and c["missed_batches"] == 5 and c["resyncs"] == 0
    assert c["replayed_batches"] >= 5
    # Live batches the replay had already delivered are dropped, never applied twice.
    assert c["batches"] == 30
    assert c["duplicates"] == c["replayed_batches"] - 5
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def _marker() -> bytes:
    """A batch storing a root block that nothing later touches."""
    return event_batch(stored_event([999_999], None, [7] * BLOCK, BLOCK))


@pytest.mark.parametrize("how", ["buffer-gone", "no-replay-socket", "replay-timeout"])
def test_uncoverable_gap_clears_worker_and_resyncs(how: str) -> None:
    payloads = [_marker(), *script(20, seed=4, clears=False)]
    index = PrefixIndex(block_size=BLOCK)
    with FakeKVPublisher(topic="kv@a", replay=how != "no-replay-socket") as fake:
        spec = spec_of(fake)
        opts = {**FAST, "replay_timeout_s": 0.3}
        with Subscriber(index, [spec], **opts) as sub:
            assert fake.wait_subscribed()
            for p in payloads[:6]:
                fake.publish(p)
            wait(sub, lambda c: c["batches"] >= 6)
            assert index.match_tokens([7] * BLOCK).as_dict() == {spec.worker_id: 1}
            for p in payloads[6:10]:
                fake.publish(p, deliver=False)
            if how == "buffer-gone":
                fake.forget(before_seq=10)  # the engine's buffer no longer holds 6..9
            fake.replay_answers = how != "replay-timeout"
            for p in payloads[10:]:
                fake.publish(p)
            c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 20)
    assert c["gaps"] == 1 and c["resyncs"] == 1
    assert c["replays"] == (0 if how == "no-replay-socket" else 1)
    assert c["replay_timeouts"] == (1 if how == "replay-timeout" else 0)
    # The worker was cleared (the marker block is gone) and rebuilt from seq 10 on.
    assert index.match_tokens([7] * BLOCK).as_dict() == {}
    expected = direct(payloads[10:], spec.worker_id)
    assert holdings(index, spec.worker_id) == holdings(expected, spec.worker_id)


def test_seq_going_backwards_is_a_restart(fake: FakeKVPublisher) -> None:
    before, after = [_marker(), *script(5, seed=5, clears=False)], script(7, seed=6)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        for p in before:
            fake.publish(p)
        wait(sub, lambda c: c["batches"] >= len(before))
        fake.restart()
        for p in after:
            fake.publish(p)
        c = wait(sub, lambda c: c["batches"] >= len(before) + len(after))
        assert sub.last_seq(spec.worker_id) == len(after) - 1
    assert c["restarts"] == 1 and c["gaps"] == 0
    assert holdings(index, spec.worker_id) == holdings(
        direct(after, spec.worker_id), spec.worker_id
    )


def test_foreign_topic_is_refused_even_when_zmq_prefix_matches(fake: FakeKVPublisher) -> None:
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    evil = event_batch(stored_event([1], None, list(range(BLOCK)), BLOCK))
    good = event_batch(stored_event([2], None, list(range(100, 100 + BLOCK)), BLOCK))
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        # "kv@a-evil" passes the SUB socket's prefix filter for "kv@a"; it must still be refused.
        fake.send_frames([b"kv@a-evil", (0).to_bytes(8, "big"), evil])
        fake.send_frames([b"kv@a\x00", (0).to_bytes(8, "big"), evil])
        fake.publish(good)
        c = wait(sub, lambda c: c["batches"] >= 1 and c["topic_rejected"] >= 2)
    assert c["topic_rejected"] == 2
    assert index.match_tokens(list(range(BLOCK))).as_dict() == {}
    assert index.match_tokens(list(range(100, 100 + BLOCK))).as_dict() == {spec.worker_id: 1}


def test_an_engine_publishing_another_topic_is_counted_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Probe 81: an engine whose --kv-events-config topic is not its spec's (``kv@b`` against
    ``kv@a``, no prefix of it) sent nothing the subscriber's socket let through: no counter
    moved, nothing was logged, and the engine's cache never reached the index. Its own socket
    now takes every topic and refuses the others: counted, the first one logged."""
    index = PrefixIndex(block_size=BLOCK)
    batch = event_batch(stored_event([1], None, list(range(BLOCK)), BLOCK))
    with (
        FakeKVPublisher(topic="kv@b") as engine,
        caplog.at_level("WARNING", logger="llmsched"),
    ):
        spec = spec_of(engine, topic="kv@a")
        with Subscriber(index, [spec], **FAST) as sub:
            assert engine.wait_subscribed()
            for _ in range(3):
                engine.publish(batch)
            c = wait(sub, lambda c: c["topic_rejected"] >= 3)
    assert c["batches"] == 0 and index.stats()["event_batches"] == 0
    warned = [r.getMessage() for r in caplog.records if "topic_rejected" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "topic 'kv@b' arrived" in warned[0].replace('"', "'"), warned
    assert "topic is 'kv@a'" in warned[0].replace('"', "'") and spec.worker_id in warned[0]


def test_malformed_messages_are_counted_and_change_nothing(fake: FakeKVPublisher) -> None:
    """Messages that are not ``[topic, seq, payload]`` take no number and change nothing."""
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    first, last = script(2, seed=7)
    topic = b"kv@a"
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        fake.publish(first)
        wait(sub, lambda c: c["batches"] >= 1)
        before = holdings(index, spec.worker_id)
        fake.send_frames([topic, (1).to_bytes(8, "big")])  # two frames
        fake.send_frames([topic, (1).to_bytes(4, "big"), last])  # a 4-byte seq
        fake.send_frames([topic, (1).to_bytes(8, "big"), last, b"extra"])  # four frames
        c = wait(sub, lambda c: c["decode_errors"] >= 3)
        assert holdings(index, spec.worker_id) == before
        fake.publish(last)  # seq 1: nothing took its number
        c = wait(sub, lambda c: c["batches"] >= 2)
    assert c["decode_errors"] == 3 and c["gaps"] == 0 and c["resyncs"] == 0
    assert holdings(index, spec.worker_id) == holdings(
        direct([first, last], spec.worker_id), spec.worker_id
    )


def test_a_malformed_batch_is_lost_the_worker_resynced_and_logged_once(
    fake: FakeKVPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """Probe 57 F1: a batch whose payload does not decode took its number and left the worker
    as it was, though its events (removals among them) were lost, and nothing was logged. It
    is not waited for (a replay sends the same bytes), but it is a batch lost for good: the
    worker is resynchronised (cleared), counted in ``resyncs``, and the first one logged."""
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    first = event_batch(stored_event([1], None, list(range(BLOCK)), BLOCK))
    # The removal of block 1 is in a batch whose second event is broken: nothing of it applies.
    broken = event_batch(removed_event([1]), {"type": "BlockStored"})
    last = event_batch(stored_event([2], None, list(range(100, 100 + BLOCK)), BLOCK))
    with caplog.at_level("WARNING", logger="llmsched"), Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        fake.publish(first)
        wait(sub, lambda c: c["batches"] >= 1)
        fake.publish(b"\xc1 not msgpack")
        fake.publish(broken)
        fake.publish(last)  # seq 3: the malformed batches 1 and 2 are not waited for
        c = wait(sub, lambda c: c["batches"] >= 2)
        assert sub.last_seq(spec.worker_id) == 3
    assert c["decode_errors"] == 2 and c["resyncs"] == 2 and c["gaps"] == 0, c
    assert c["replays"] == 0 and fake.replay_requests == []
    # Block 1 may be gone from the engine: the index no longer claims it.
    assert index.match_tokens(list(range(BLOCK))).as_dict() == {}
    assert index.match_tokens(list(range(100, 100 + BLOCK))).as_dict() == {spec.worker_id: 1}
    logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(logged) == 1, logged
    assert spec.worker_id in logged[0] and "batch 1 is malformed" in logged[0], logged


def test_a_hash_stored_again_with_other_content_is_warned_once(
    fake: FakeKVPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """Probe 75: the native feed counted engine hashes stored again with other content
    (``stats()['replaced_engine_blocks']``) but logged nothing, where the Python feed warns
    once (through ``PrefixIndex.apply_vllm_events``). Both now warn once."""
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    first, second = list(range(BLOCK)), list(range(100, 100 + BLOCK))
    with caplog.at_level("WARNING", logger="llmsched"), Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        for n, tokens in enumerate([first, second, first], 1):
            fake.publish(event_batch(stored_event([7], None, tokens, BLOCK)))
            wait(sub, lambda c, n=n: c["batches"] >= n)
    assert index.stats()["replaced_engine_blocks"] == 2
    assert index.match_tokens(first).as_dict() == {spec.worker_id: 1}
    warned = [r.getMessage() for r in caplog.records if "again with other" in r.getMessage()]
    assert len(warned) == 1, warned
    assert repr(spec.worker_id) in warned[0], warned


def test_reconnects_when_the_publisher_comes_back() -> None:
    index = PrefixIndex(block_size=BLOCK)
    first, second = script(4, seed=8), script(3, seed=9)
    engine = FakeKVPublisher(topic="kv@a", replay=False)
    spec = spec_of(engine)
    with Subscriber(index, [spec], **FAST) as sub:
        assert engine.wait_subscribed()
        for p in first:
            engine.publish(p)
        wait(sub, lambda c: c["batches"] >= 4)
        engine.close()
        wait(sub, lambda c: c["disconnects"] >= 1)
        # The engine comes back on the same port with a fresh sequence.
        with FakeKVPublisher(topic="kv@a", endpoint=engine.endpoint, replay=False) as again:
            assert again.wait_subscribed()
            for p in second:
                again.publish(p)
            c = wait(sub, lambda c: c["batches"] >= 7)
    assert c["connects"] == 2 and c["reconnects"] == 1 and c["restarts"] == 1
    assert holdings(index, spec.worker_id) == holdings(
        direct(second, spec.worker_id), spec.worker_id
    )


@pytest.mark.python_feed_only("reads the Python subscriber's ZMQ context")
def test_thread_stops_promptly_and_closes_everything(fake: FakeKVPublisher) -> None:
    # Threads of earlier tests may end meanwhile: only the ones started here must be gone.
    threads_before = set(threading.enumerate())
    sub = Subscriber(PrefixIndex(block_size=BLOCK), [spec_of(fake)], **FAST)
    sub.start()
    assert fake.wait_subscribed()
    with pytest.raises(RuntimeError, match="already running"):
        sub.start()
    started = time.monotonic()
    sub.stop()
    elapsed = time.monotonic() - started
    assert not set(threading.enumerate()) - threads_before
    assert sub._ctx is None  # every socket closed, the context terminated
    assert elapsed < 2.0, elapsed  # a hang, not a timing measurement
    sub.start()  # and it can run again
    sub.stop()


@pytest.mark.python_feed_only("the native feed has no asyncio run(): it always has its thread")
def test_asyncio_run_and_cancel(fake: FakeKVPublisher) -> None:
    payloads = script(25, seed=10)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    sub = Subscriber(index, [spec], **FAST)

    async def main() -> dict[str, int]:
        task = asyncio.create_task(sub.run())
        await asyncio.to_thread(fake.wait_subscribed)
        for i, p in enumerate(payloads):
            fake.publish(p, deliver=i != 12)  # one gap, replayed on the event loop
        while sub.last_seq(spec.worker_id) != 24:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sub.counters()

    c = asyncio.run(main())
    assert c["gaps"] == 1 and c["replays"] == 1 and c["resyncs"] == 0
    assert sub._ctx is None
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_many_engines_and_data_parallel_ranks() -> None:
    index = PrefixIndex(block_size=BLOCK)
    fakes, specs, scripts = [], [], {}
    try:
        for e in range(3):
            for rank in range(2):
                topic = f"kv@10.0.0.{e}:8000@tiny"
                if e == 2:  # this engine connects to endpoints the subscriber binds
                    spec = EngineSpec(
                        "10.0.0.2",
                        8000,
                        dp_rank=rank,
                        topic=topic,
                        kv_events="tcp://127.0.0.1:*",
                        kv_events_bind=True,
                    )
                else:
                    fake = FakeKVPublisher(topic=topic)
                    fakes.append(fake)
                    spec = EngineSpec(f"10.0.0.{e}", 8000, dp_rank=rank, **fake.spec_kwargs())
                specs.append(spec)
                scripts[spec.worker_id] = script(15, seed=20 + 2 * e + rank)
        with Subscriber(index, specs, **FAST) as sub:
            for spec in specs[4:]:
                fakes.append(
                    FakeKVPublisher(
                        topic=spec.topic,
                        endpoint=sub.bound_endpoint(spec.worker_id),
                        connect=True,
                    )
                )
            assert [f.wait_subscribed() for f in fakes] == [True] * 6
            for _ in range(15):  # interleaved, as engines publish
                for fake, spec in zip(fakes, specs, strict=True):
                    fake.publish(scripts[spec.worker_id][fake.next_seq])
            c = wait(sub, lambda c: c["batches"] >= 90)
            assert all(sub.last_seq(s.worker_id) == 14 for s in specs)
    finally:
        for fake in fakes:
            fake.close()
    assert c["gaps"] == 0
    assert sorted(index.workers()) == sorted(scripts)
    assert {s.worker_id for s in specs} >= {"10.0.0.0:8000", "10.0.0.0:8000/dp1"}
    for worker, payloads in scripts.items():
        assert holdings(index, worker) == holdings(direct(payloads, worker), worker)


def test_shared_vector_batch(fake: FakeKVPublisher) -> None:
    vec = load_vector("vllm_kv_events.json")
    payload = bytes.fromhex(vec["payload_hex"])
    index = PrefixIndex(block_size=16)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        fake.publish(payload)
        c = wait(sub, lambda c: c["batches"] >= 1)
    assert (c["events"], c["blocks_stored"], c["blocks_removed"], c["all_cleared"]) == (3, 2, 1, 1)


def test_real_engine_capture_joined_late() -> None:
    """A real vLLM engine's frames starting at seq 2: the replay no longer holds 0 and 1, so the
    subscriber resyncs from the first batch it has and agrees with the engine's prompts."""
    cap = load_vector("vllm_real_capture_gap.json")
    topic = bytes.fromhex(cap["frames"][0][0]).decode()
    index = PrefixIndex(block_size=cap["block_size"])
    with FakeKVPublisher(topic=topic) as fake:
        spec = spec_of(fake)
        first_seq = int(cap["frames"][0][1], 16)
        fake.skip_to(first_seq)
        with Subscriber(index, [spec], **FAST) as sub:
            assert fake.wait_subscribed()
            for _topic, seq, payload in cap["frames"]:
                assert fake.publish(bytes.fromhex(payload)) == int(seq, 16)
            last = int(cap["frames"][-1][1], 16)
            c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == last)
    assert fake.replay_requests == [0]
    assert c["gaps"] == 1 and c["resyncs"] == 1
    for request, expected in zip(cap["requests"], cap["expected_prompt_blocks"], strict=True):
        prompt = np.array(request["prompt"], dtype=np.uint32)
        assert index.match_tokens(prompt).as_dict().get(spec.worker_id, 0) == expected


def test_configuration_errors() -> None:
    index = PrefixIndex(block_size=BLOCK)
    a = EngineSpec("h", 1, kv_events="tcp://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="listed twice"):
        Subscriber(index, [a, a])
    b = EngineSpec("h", 2, kv_events="tcp://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="share the KV-event endpoint"):
        Subscriber(index, [a, b])
    with pytest.raises(ConfigError, match="backoff_s"):
        Subscriber(index, [a], backoff_s=(2.0, 1.0))
    with pytest.raises(ConfigError, match="replay_timeout_s"):
        Subscriber(index, [a], replay_timeout_s=0)
    with pytest.raises(TypeError, match="PrefixIndex"):
        Subscriber(object(), [a])  # type: ignore[arg-type]
    sub = Subscriber(index, [a, EngineSpec("h", 3)])  # no kv_events: not subscribed
    assert sub.workers() == ["h:1"]
    with pytest.raises(KeyError, match="h:3"):
        sub.counters() and sub.worker_counters("h:3")


def test_bind_failure_is_retried_with_backoff() -> None:
    """The endpoint to bind is taken: the subscriber counts socket errors and retries (backing
    off) until the port is free, then takes events as usual."""
    import zmq

    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PULL)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec("127.0.0.1", 8000, kv_events=endpoint, kv_events_bind=True, topic="kv@a")
    try:
        with Subscriber(index, [spec], **FAST) as sub:
            wait(sub, lambda c: c["socket_errors"] >= 3)
            assert sub.bound_endpoint(spec.worker_id) is None
            squatter.close(linger=0)
            # Connect only once the subscriber holds the port (not the squatter's closing one).
            deadline = time.monotonic() + WAIT_S
            while sub.bound_endpoint(spec.worker_id) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            with FakeKVPublisher(topic="kv@a", endpoint=endpoint, connect=True) as fake:
                assert fake.wait_subscribed()
                payloads = script(5, seed=30)
                for p in payloads:
                    fake.publish(p)
                wait(sub, lambda c: c["batches"] >= 5)
            assert sub.bound_endpoint(spec.worker_id) == endpoint
    finally:
        squatter.close(linger=0)
        ctx.term()
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_catch_up_on_connect_fetches_what_was_sent_before(fake: FakeKVPublisher) -> None:
    """With ``catch_up``, batches an engine sent before the subscriber existed arrive through
    its replay socket at once, though no live batch follows to reveal the gap."""
    payloads = script(12, seed=21)
    for p in payloads[:8]:
        fake.publish(p, deliver=False)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], catch_up=True, **FAST) as sub:
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 7)
        assert c["catch_ups"] == 1 and c["replayed_batches"] == 8, (c, fake.replay_requests)
        assert holdings(index, spec.worker_id) == holdings(
            direct(payloads[:8], spec.worker_id), spec.worker_id
        )
        assert fake.wait_subscribed()
        for p in payloads[8:]:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 11)
    assert fake.replay_requests == [0], (c, fake.replay_requests)
    assert c["gaps"] == 0 and c["replays"] == 0 and c["resyncs"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_live_copy_of_a_batch_the_catch_up_applied_first_is_a_duplicate(
    fake: FakeKVPublisher,
) -> None:
    """Batch 0 published as the subscriber connects can reach it twice: through the catch-up
    replay and then live. The live copy is a duplicate, not an engine restarting at 0: the
    worker keeps its blocks and the batch counts once."""
    payloads = script(3, seed=23, clears=False)
    fake.publish(payloads[0], deliver=False)  # sent before the subscription: replayable only
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], catch_up=True, **FAST) as sub:
        wait(sub, lambda c: sub.last_seq(spec.worker_id) == 0)
        assert fake.wait_subscribed()
        fake.resend(0)  # its live copy, late
        for p in payloads[1:]:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 2)
    assert c["duplicates"] == 1 and c["restarts"] == 0 and c["batches"] == 3, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def restart_across_an_outage(
    fake: FakeKVPublisher,
    sub: Any,
    worker: str,
    payloads: list[bytes],
    before_stop: Callable[[], None],
) -> dict[str, int]:
    """Starts ``sub``, delivers the first five of ten payloads, runs ``before_stop``, stops it,
    publishes the other five while nobody listens, starts it again and waits until it has taken
    the tenth; returns its counters."""
    sub.start()
    try:
        assert fake.wait_subscribed()
        for p in payloads[:5]:
            fake.publish(p)
        wait(sub, lambda c: sub.last_seq(worker) == 4)
        before_stop()
        sub.stop()
        for p in payloads[5:]:
            fake.publish(p, deliver=False)  # nobody listens while it is stopped
        sub.start()
        return wait(sub, lambda c: sub.last_seq(worker) == 9)
    finally:
        sub.stop()


def test_catch_up_after_a_restart_fills_the_outage(fake: FakeKVPublisher) -> None:
    """A subscriber stopped and started again asks for the batches after the last it applied."""
    payloads = script(10, seed=22)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    # A loaded machine may take a while to connect the replay socket: no timeout meanwhile.
    sub = Subscriber(index, [spec], catch_up=True, **{**FAST, "replay_timeout_s": WAIT_S})

    def before_stop() -> None:
        # The first run's catch-up answered (one still in flight: the next test).
        wait(sub, lambda c: not sub.worker_state(spec.worker_id)["replaying"])

    c = restart_across_an_outage(fake, sub, spec.worker_id, payloads, before_stop)
    # The second catch-up starts at the last batch taken (4): it comes back the same, so the
    # publisher continues its sequence.
    assert fake.replay_requests == [0, 4], (c, fake.replay_requests)
    assert c["catch_ups"] == 2 and c["gaps"] == 0 and c["resyncs"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_a_replay_in_flight_at_stop_does_not_hold_up_the_catch_up_after_start(
    fake: FakeKVPublisher,
) -> None:
    """A catch-up still unanswered when the subscriber stops dies with its sockets: the next
    start asks afresh at once, not after that replay's timeout and the replay backoff."""
    payloads = script(10, seed=25)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    fake.replay_answers = False  # the first run's catch-up stays in flight
    opts = {**FAST, "replay_timeout_s": 60.0, "replay_backoff_s": (60.0, 60.0)}
    sub = Subscriber(index, [spec], catch_up=True, **opts)

    def before_stop() -> None:
        assert sub.worker_state(spec.worker_id)["replaying"]
        # The request sent is not yet read when the subscriber says it is replaying: flipping
        # the switch before the fake has read (and ignored) it would answer it after all.
        wait(sub, lambda c: fake.replay_ignored == [0])
        fake.replay_answers = True  # for the next start's catch-up

    c = restart_across_an_outage(fake, sub, spec.worker_id, payloads, before_stop)
    # From the last batch taken (4), which shows the publisher continues its sequence.
    assert fake.replay_requests == [4], (c, fake.replay_requests)
    assert c["catch_ups"] == 2 and c["replay_timeouts"] == 0 and c["resyncs"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_a_catch_up_that_times_out_is_asked_again_after_the_backoff(
    fake: FakeKVPublisher,
) -> None:
    """A catch-up whose replay goes unanswered is asked again once the replay socket's backoff
    has passed, though the idle publisher sends nothing that would reveal the hole."""
    payloads = script(6, seed=24)
    for p in payloads:
        fake.publish(p, deliver=False)
    fake.replay_answers = False
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    opts = {**FAST, "replay_timeout_s": 0.3, "replay_backoff_s": (0.5, 0.5)}
    with Subscriber(index, [spec], catch_up=True, **opts) as sub:
        wait(sub, lambda c: c["replay_timeouts"] >= 1)
        fake.replay_answers = True
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 5)
    assert c["catch_ups"] >= 2 and c["replayed_batches"] == 6, (c, fake.replay_requests)
    assert set(fake.replay_requests) == {0}, fake.replay_requests
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_catch_up_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="catch_up"):
        Subscriber(PrefixIndex(block_size=BLOCK), [], catch_up="yes")  # type: ignore[arg-type]


# -- duplicates, reordering, restarts ---------------------------------------------------------

# Holes are decided by the reorder window alone: a loaded machine may take long between two
# publishes, which must not turn a reordering into a gap.
PATIENT = {**FAST, "reorder_wait_s": 60.0}


def test_duplicates_are_dropped_and_counted(fake: FakeKVPublisher) -> None:
    payloads = [_marker(), *script(14, seed=40)]
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **PATIENT) as sub:
        assert fake.wait_subscribed()
        for p in payloads[:10]:
            fake.publish(p)
        fake.resend(3)  # each arrives after its first copy: duplicates on the wire
        fake.resend(9)
        wait(sub, lambda c: c["duplicates"] >= 2)
        fake.resend(4)
        for p in payloads[10:]:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 14)
        assert sub.counters()["duplicates"] == 3
        # Batch 0 again, once the stream has moved past it: a restart (a documented signal;
        # a fresh publisher always begins at 0).
        fake.resend(0)
        c = wait(sub, lambda c: c["restarts"] >= 1 and sub.last_seq(spec.worker_id) == 0)
    assert c["duplicates"] == 3 and c["restarts"] == 1, c
    assert c["gaps"] == c["replays"] == c["resyncs"] == c["reordered"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[:1], spec.worker_id), spec.worker_id
    )


def test_duplicates_only_keep_every_block(fake: FakeKVPublisher) -> None:
    """Duplicates never clear the worker (they used to be taken for an engine restart)."""
    payloads = [_marker(), *script(11, seed=41, clears=False)]
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], **PATIENT) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads):
            fake.publish(p)
            if i >= 3:
                fake.resend(i - 2)  # every batch but 0 twice, the copy two batches late
        c = wait(sub, lambda c: c["duplicates"] >= len(payloads) - 3)
        assert sub.last_seq(spec.worker_id) == len(payloads) - 1
    assert c["duplicates"] == len(payloads) - 3 and c["batches"] == len(payloads), c
    assert c["restarts"] == c["resyncs"] == c["gaps"] == 0, c
    assert index.match_tokens([7] * BLOCK).as_dict() == {spec.worker_id: 1}
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


@pytest.mark.parametrize("replay", [True, False], ids=["replay-socket", "no-replay-socket"])
def test_reordering_within_the_window_is_tolerated(replay: bool) -> None:
    payloads = [_marker(), *script(15, seed=42, clears=False)]
    index = PrefixIndex(block_size=BLOCK)
    with FakeKVPublisher(topic="kv@a", replay=replay) as fake:
        spec = spec_of(fake)
        with Subscriber(index, [spec], reorder_window=8, **PATIENT) as sub:
            assert fake.wait_subscribed()
            late = {5, 11}
            for i, p in enumerate(payloads):
                fake.publish(p, deliver=i not in late)
                if i == 8:
                    fake.resend(5)  # 5 arrives after 6, 7 and 8
                if i == 12:
                    fake.resend(11)  # 11 after 12
            c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == len(payloads) - 1)
            state = sub.worker_state(spec.worker_id)
        assert fake.replay_requests == []
    assert c["reordered"] == 2 and c["held_batches"] == 4, c
    assert c["gaps"] == c["replays"] == c["resyncs"] == c["restarts"] == c["duplicates"] == 0, c
    assert state["held"] == 0 and state["held_peak"] == 3, state
    assert index.match_tokens([7] * BLOCK).as_dict() == {spec.worker_id: 1}
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_hole_past_the_reorder_window_is_a_gap(fake: FakeKVPublisher) -> None:
    payloads = script(14, seed=43)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], reorder_window=4, **PATIENT) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads):
            fake.publish(p, deliver=i != 5)  # 6..10 held: the fifth is one too many
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 13)
    assert fake.replay_requests == [5]
    assert c["gaps"] == 1 and c["missed_batches"] == 1 and c["replays"] == 1, c
    assert c["reordered"] == c["resyncs"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_sequence_far_below_the_window_is_a_restart(fake: FakeKVPublisher) -> None:
    """The engine restarted and the subscriber missed its first batches: the sequence goes
    back by more than the reorder window (not to 0), which only a restart explains."""
    before = [_marker(), *script(39, seed=44, clears=False)]
    after = script(10, seed=45)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    with Subscriber(index, [spec], reorder_window=16, **FAST) as sub:
        assert fake.wait_subscribed()
        for p in before:
            fake.publish(p)
        wait(sub, lambda c: sub.last_seq(spec.worker_id) == 39)
        fake.restart()
        fake.skip_to(3)  # 0..2 went out before anyone listened to the new engine
        for p in after:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 12)
    assert c["restarts"] == 1, c
    # Then a late join: the new engine's replay no longer holds 0..2, so it resyncs at 3.
    assert fake.replay_requests == [0] and c["resyncs"] == 1 and c["duplicates"] == 0, c
    assert index.match_tokens([7] * BLOCK).as_dict() == {}
    assert holdings(index, spec.worker_id) == holdings(
        direct(after, spec.worker_id), spec.worker_id
    )


def test_new_publisher_identity_is_a_restart() -> None:
    """A new connection whose first batch does not move past the last one seen is another
    process on the same address, even though its sequence (3) is within the window."""
    before, after = [_marker(), *script(5, seed=46, clears=False)], script(5, seed=47)
    index = PrefixIndex(block_size=BLOCK)
    first = FakeKVPublisher(topic="kv@a", replay=False)
    spec = spec_of(first)
    with Subscriber(index, [spec], **FAST) as sub:
        assert first.wait_subscribed()
        for p in before:
            first.publish(p)
        wait(sub, lambda c: sub.last_seq(spec.worker_id) == 5)
        first.close()
        wait(sub, lambda c: c["disconnects"] >= 1)
        with FakeKVPublisher(topic="kv@a", endpoint=first.endpoint, replay=False) as again:
            again.skip_to(3)
            assert again.wait_subscribed()
            for p in after:
                again.publish(p)
            c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 7)
    assert c["reconnects"] == 1 and c["restarts"] == 1 and c["duplicates"] == 0, c
    # Without a replay socket the late join at 3 resyncs once the hole's wait is up.
    assert index.match_tokens([7] * BLOCK).as_dict() == {}
    assert holdings(index, spec.worker_id) == holdings(
        direct(after, spec.worker_id), spec.worker_id
    )


@pytest.mark.parametrize("catch_up", [False, True])
def test_an_engine_restarted_past_the_last_batch_seen_is_a_restart(catch_up: bool) -> None:
    """Probe 57 F2: an engine that restarted while the subscriber was away, and whose new run
    had passed the old run's last number by the time it reconnected, was taken for the same
    run: the gap was replayed from the new run onto the old run's blocks, which stayed. The
    first replay after a new connection now starts at the last batch taken, which must come
    back byte for byte; another batch there is a restart, and the new run is replayed from 0."""
    old_run = [_marker(), *script(4, seed=60, clears=False)]
    new_run = script(9, seed=61)
    index = PrefixIndex(block_size=BLOCK)
    with FakeKVPublisher(topic="kv@a") as fake:
        spec = spec_of(fake)
        sub = Subscriber(index, [spec], catch_up=catch_up, **{**FAST, "replay_timeout_s": WAIT_S})
        sub.start()
        try:
            assert fake.wait_subscribed()
            for p in old_run:
                fake.publish(p)
            wait(sub, lambda c: sub.last_seq(spec.worker_id) == 4 and not _replaying(sub, spec))
            sub.stop()
            fake.restart()  # the engine restarts and runs on while nobody listens
            for p in new_run[:8]:
                fake.publish(p, deliver=False)
            sub.start()
            assert fake.wait_subscribed(count=2)
            fake.publish(new_run[8])
            c = wait(sub, lambda c: c["restarts"] >= 1 and sub.last_seq(spec.worker_id) == 8)
        finally:
            sub.stop()
    assert c["restarts"] == 1, c
    assert index.match_tokens([7] * BLOCK).as_dict() == {}, "the old run's blocks are gone"
    assert holdings(index, spec.worker_id) == holdings(
        direct(new_run, spec.worker_id), spec.worker_id
    )
    assert fake.replay_requests[-2:] == [4, 0], fake.replay_requests


def _replaying(sub: Any, spec: EngineSpec) -> bool:
    state: dict[str, Any] = sub.worker_state(spec.worker_id)
    return bool(state["replaying"])


@pytest.mark.parametrize("replay", [True, False])
def test_an_engine_restarted_on_a_shared_socket_is_a_restart(replay: bool) -> None:
    """Probe 57 F2: engines publishing to one bound endpoint cannot be told apart by
    connection, so a restarted engine whose batch 0 was lost (sent before its subscription
    arrived) sent numbers below the last one taken: every one dropped as a duplicate, the old
    blocks kept. After a connection a stream going back is checked against the replay socket
    (or, without one, taken for a restart)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shared = f"tcp://127.0.0.1:{port}"
    old_run = [_marker(), *script(5, seed=62, clears=False)]
    new_run = script(4, seed=63)
    index = PrefixIndex(block_size=BLOCK)
    a = FakeKVPublisher(topic="kv@a", endpoint=shared, connect=True, replay=replay)
    b = FakeKVPublisher(topic="kv@b", endpoint=shared, connect=True, replay=replay)
    specs = [
        EngineSpec(
            "127.0.0.1",
            8000 + i,
            topic=f.topic.decode(),
            kv_events=shared,
            kv_events_bind=True,
            replay=f.replay_endpoint,
        )
        for i, f in enumerate((a, b))
    ]
    late: FakeKVPublisher | None = None
    try:
        with Subscriber(index, specs, **{**FAST, "replay_timeout_s": WAIT_S}) as sub:
            assert a.wait_subscribed() and b.wait_subscribed()
            for p in old_run:
                a.publish(p)
            b.publish(old_run[0])
            wait(sub, lambda c: sub.last_seq(specs[0].worker_id) == 5 and c["batches"] == 7)
            a.restart()
            a.publish(new_run[0], deliver=False)  # before the new process's subscription
            connects = sub.counters()["connects"]
            late = FakeKVPublisher(topic="kv@c", endpoint=shared, connect=True, replay=False)
            wait(sub, lambda c: c["connects"] > connects)  # a connection: whose is not known
            for p in new_run[1:]:
                a.publish(p)
            b.publish(old_run[1])  # the other engine goes on, untouched
            c = wait(sub, lambda c: c["restarts"] >= 1 and sub.last_seq(specs[0].worker_id) == 3)
            wait(sub, lambda c: sub.last_seq(specs[1].worker_id) == 1)
    finally:
        for f in (a, b, late):
            if f is not None:
                f.close()
    assert c["restarts"] == 1 and sub.worker_counters(specs[1].worker_id)["restarts"] == 0, c
    assert index.match_tokens([7] * BLOCK).as_dict() == {specs[1].worker_id: 1}
    # With a replay socket the whole new run comes back; without one, its lost batch 0 stays
    # lost (a resync at 1).
    expected = new_run if replay else new_run[1:]
    assert holdings(index, specs[0].worker_id) == holdings(
        direct(expected, specs[0].worker_id), specs[0].worker_id
    )


def test_reconnect_to_the_same_publisher_keeps_the_worker(fake: FakeKVPublisher) -> None:
    """A subscriber that stops and starts again sees a new connection, but the sequence moves
    forward: the same publisher, no restart, the outage filled from the replay socket."""
    payloads = [_marker(), *script(9, seed=48, clears=False)]
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    sub = Subscriber(index, [spec], **FAST)
    sub.start()
    try:
        assert fake.wait_subscribed()
        for p in payloads[:5]:
            fake.publish(p)
        wait(sub, lambda c: sub.last_seq(spec.worker_id) == 4)
        sub.stop()
        fake.publish(payloads[5], deliver=False)
        sub.start()
        assert fake.wait_subscribed(count=2)
        for p in payloads[6:]:
            fake.publish(p)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 9)
    finally:
        sub.stop()
    assert c["restarts"] == 0 and c["resyncs"] == 0, c
    assert index.match_tokens([7] * BLOCK).as_dict() == {spec.worker_id: 1}


# -- replays that answer late or never ----------------------------------------------------------


def test_late_replay_falls_back_to_a_resync_and_the_socket_backs_off(
    fake: FakeKVPublisher,
) -> None:
    payloads = [_marker(), *script(30, seed=50, clears=False)]
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    fake.replay_delay_s = 1.0  # answers, but long after the subscriber gave up
    opts = {**FAST, "replay_timeout_s": 0.2, "replay_backoff_s": (600.0, 600.0)}
    with Subscriber(index, [spec], reorder_window=2, **opts) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads[:15]):
            fake.publish(p, deliver=i != 5)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 14)
        assert c["replays"] == 1 and c["replay_timeouts"] == 1 and c["resyncs"] == 1, c
        assert sub.worker_state(spec.worker_id)["replay_backoff_s"] > 0
        # The next gap does not wait on the socket that failed: it resyncs at once.
        for i, p in enumerate(payloads[15:], start=15):
            fake.publish(p, deliver=i != 20)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 30)
        time.sleep(1.5)  # the late answer arrives meanwhile, on a socket already replaced
        c = sub.counters()
    assert fake.replay_requests == [5], fake.replay_requests
    assert c["gaps"] == 2 and c["replays"] == 1 and c["replays_skipped"] == 1, c
    assert c["resyncs"] == 2 and c["replayed_batches"] == 0, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[21:], spec.worker_id), spec.worker_id
    )


def test_a_replay_answering_only_what_was_applied_is_given_up_at_its_deadline(
    fake: FakeKVPublisher,
) -> None:
    """Probe 48 F3: every reply pushed the replay's deadline back, so a replay socket
    answering stale batches forever held the live stream until the buffer caps."""
    payloads = script(12, seed=52)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    fake.replay_stale_s = 0.05
    opts = {**FAST, "replay_timeout_s": 0.5, "replay_backoff_s": (600.0, 600.0)}
    with Subscriber(index, [spec], reorder_window=2, **opts) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads):
            fake.publish(p, deliver=i != 3)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 11)
    assert c["replays"] == 1 and c["replay_timeouts"] == 1 and c["resyncs"] == 1, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[4:], spec.worker_id), spec.worker_id
    )


def test_a_sequence_number_past_int64_is_malformed(fake: FakeKVPublisher) -> None:
    """Probe 48 F1: vLLM numbers batches as an int64; u64::MAX made the native feed's next
    number wrap to 0, and a repeat of it was applied again after clearing the worker."""
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    first, last = script(2, seed=9)
    with Subscriber(index, [spec], **FAST) as sub:
        assert fake.wait_subscribed()
        fake.publish(first)
        wait(sub, lambda c: c["batches"] >= 1)
        for seq in (2**64 - 1, 2**64 - 1, 2**63):
            fake.send_frames([b"kv@a", seq.to_bytes(8, "big"), last])
        c = wait(sub, lambda c: c["decode_errors"] >= 3)
        assert sub.last_seq(spec.worker_id) == 0
    assert c["resyncs"] == 0 and c["restarts"] == 0 and c["batches"] == 1, c
    assert holdings(index, spec.worker_id) == holdings(
        direct([first], spec.worker_id), spec.worker_id
    )


def test_buffer_cap_ends_a_replay_that_does_not_answer(fake: FakeKVPublisher) -> None:
    """The live stream keeps flowing behind a silent replay socket: at most ``buffer_cap``
    batches are held, then the replay is given up and the worker resyncs."""
    payloads = script(200, seed=51)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    fake.replay_answers = False
    opts = {**FAST, "replay_timeout_s": 600.0}
    with Subscriber(index, [spec], reorder_window=4, buffer_cap=50, **opts) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads):
            fake.publish(p, deliver=i != 10)
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 199)
        state = sub.worker_state(spec.worker_id)
    assert c["buffer_overflows"] == 1 and c["replay_timeouts"] == 0, c
    assert c["replays"] == 1 and c["resyncs"] == 1, c
    assert state["held_peak"] == 50 and state["held"] == 0 and not state["replaying"], state
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[11:], spec.worker_id), spec.worker_id
    )


def test_replay_socket_whose_peer_broke_the_handshake_does_not_hold_the_feed() -> None:
    """The replay socket's only peer broke the ZMTP handshake (a frame declaring 1 TiB), so
    the socket has no connection to send on. Asking it to fill a gap must not block: the
    Python subscriber's libzmq DEALER blocked its thread on the send until a peer came back,
    so live batches stopped being applied and ``stop()`` timed out. The replay times out, the
    stream resyncs and goes on, and the subscriber stops at once."""
    hostile = HostileListener(GREETING + TERABYTE)
    payloads = script(12, seed=71, clears=False)
    index = PrefixIndex(block_size=BLOCK)
    try:
        with FakeKVPublisher(topic="kv@a", replay=False) as fake:
            spec = spec_of(fake, replay=hostile.endpoint)
            opts = {**FAST, "replay_timeout_s": 0.3}
            sub = Subscriber(index, [spec], **opts)
            sub.start()
            try:
                assert fake.wait_subscribed()
                for i in range(6):
                    fake.publish(payloads[i])
                wait(sub, lambda c: c["batches"] >= 6)
                # The handshake failed and libzmq dropped the connection (it is slow to dial
                # again after a protocol error): the socket now has no peer.
                deadline = time.monotonic() + WAIT_S
                while hostile.served < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)
                fake.publish(payloads[6], deliver=False)
                for i in range(7, 12):
                    fake.publish(payloads[i])
                c = wait(sub, lambda c: c["resyncs"] >= 1 and c["batches"] >= 11)
            finally:
                sub.stop()  # raises TimeoutError if the thread is held
    finally:
        hostile.close()
    assert hostile.served >= 1
    assert c["replays"] == 1 and c["replay_timeouts"] == 1 and c["gaps"] == 1, c
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[7:], spec.worker_id), spec.worker_id
    )


def _ready_command(socket_type: bytes) -> bytes:
    """A ZMTP 3.0 READY command frame carrying ``Socket-Type``."""
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def test_a_frame_over_the_message_cap_drops_the_connection_at_its_header() -> None:
    """A publisher declaring a 100 MiB frame (over the 64 MiB cap) is dropped as soon as the
    header arrives, without allocating it: before, the Python subscriber's libzmq had no cap,
    allocated any size that memory allowed and waited for the body (the peer here never closes
    a connection, so only the subscriber can end it)."""
    # The handshake as a PUB, then a frame header declaring 100 MiB and no body.
    peer = HostileListener(
        GREETING + _ready_command(b"PUB") + b"\x02" + (100 << 20).to_bytes(8, "big")
    )
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec("127.0.0.1", 8000, kv_events=peer.endpoint, topic="kv@a")
    try:
        with Subscriber(index, [spec], **FAST) as sub:
            if _feed[0] is NativeKVEventSubscriber:
                c = wait(sub, lambda c: c["decode_errors"] >= 1)
            else:  # libzmq drops the peer silently; its monitor reports the disconnect
                c = wait(sub, lambda c: c["connects"] >= 1 and c["disconnects"] >= 1)
    finally:
        peer.close()
    assert c["batches"] == 0, c


def test_silent_replay_socket_under_heavy_loss_keeps_the_stream_flowing() -> None:
    """Thousands of batches, one in 50 lost, a replay socket that never answers: the first gap
    waits for the replay (bounded by the buffer cap), every later one resyncs at once. Held
    batches never pass the cap (memory bounded) and every batch is taken."""
    n, every = 6_000, 50
    payloads = script(n, seed=52)
    lost = set(range(every - 1, n - 1, every))
    index = PrefixIndex(block_size=BLOCK)
    peaks: list[int] = []
    with FakeKVPublisher(topic="kv@a") as fake:
        fake.replay_answers = False
        spec = spec_of(fake)
        opts = {**FAST, "replay_timeout_s": 600.0, "replay_backoff_s": (600.0, 600.0)}
        with Subscriber(index, [spec], reorder_window=8, buffer_cap=200, **opts) as sub:
            assert fake.wait_subscribed()
            for i, p in enumerate(payloads):
                fake.publish(p, deliver=i not in lost)
                if i % 500 == 0:
                    peaks.append(sub.worker_state(spec.worker_id)["held"])
            c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == n - 1)
            state = sub.worker_state(spec.worker_id)
    # Every hole is lost for good (one resync each); the ones the first replay's buffer held
    # are resolved together when the cap gives it up, the others each count as a gap.
    assert c["resyncs"] == len(lost) and c["gaps"] <= len(lost), c
    assert c["replays"] == 1 and c["buffer_overflows"] == 1 and c["replay_timeouts"] == 0, c
    assert c["replays_skipped"] == c["gaps"] - 1, c
    assert c["batches"] == n - len(lost) and c["duplicates"] == 0 and c["restarts"] == 0, c
    assert state["held_peak"] == 200 and max(peaks) <= 200, (state, peaks)
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads[max(lost) + 1 :], spec.worker_id), spec.worker_id
    )


def test_replay_runs_beside_a_live_stream(fake: FakeKVPublisher) -> None:
    """A replay that answers late but within its deadline: live batches are read and held
    meanwhile (the SUB socket never fills up), and applied once the replay closes the hole."""
    payloads = script(120, seed=53)
    index = PrefixIndex(block_size=BLOCK)
    spec = spec_of(fake)
    fake.replay_delay_s = 0.5
    with Subscriber(index, [spec], reorder_window=2, **FAST) as sub:
        assert fake.wait_subscribed()
        for i, p in enumerate(payloads[:10]):
            fake.publish(p, deliver=i != 4)
        wait(sub, lambda c: c["replays"] >= 1)
        for p in payloads[10:]:
            fake.publish(p)  # while the replay is outstanding
        c = wait(sub, lambda c: sub.last_seq(spec.worker_id) == 119)
        state = sub.worker_state(spec.worker_id)
    assert fake.replay_requests == [4]
    assert c["replay_timeouts"] == 0 and c["resyncs"] == 0 and c["replayed_batches"] >= 1, c
    assert state["held_peak"] > 2, state  # live batches piled up beside the replay, not in ZMQ
    assert holdings(index, spec.worker_id) == holdings(
        direct(payloads, spec.worker_id), spec.worker_id
    )


def test_counters_are_complete_and_documented(fake: FakeKVPublisher) -> None:
    from llmsched.integrations.kv_events import COUNTER_HELP, COUNTERS

    sub = Subscriber(PrefixIndex(block_size=BLOCK), [spec_of(fake)])
    assert tuple(sub.counters()) == COUNTERS == tuple(COUNTER_HELP)
    assert tuple(sub.worker_counters(sub.workers()[0])) == COUNTERS
    assert all(COUNTER_HELP.values())
    doc = KVEventSubscriber.counters.__doc__ or ""
    assert [name for name in COUNTERS if f"``{name}``" not in doc] == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"reorder_window": -1}, "reorder_window"),
        ({"reorder_window": 1.5}, "reorder_window"),
        ({"reorder_wait_s": 0}, "reorder_wait_s"),
        ({"reorder_wait_s": float("nan")}, "reorder_wait_s"),
        ({"replay_timeout_s": float("inf")}, "replay_timeout_s"),
        ({"buffer_cap": 0}, "buffer_cap"),
        ({"buffer_cap": True}, "buffer_cap"),
        ({"buffer_cap_bytes": 0}, "buffer_cap_bytes"),
        ({"buffer_cap": 8, "reorder_window": 8}, "larger than reorder_window"),
        ({"replay_backoff_s": (1.0, 0.5)}, "replay_backoff_s"),
        ({"replay_backoff_s": (1.0, float("inf"))}, "replay_backoff_s"),
    ],
)
def test_sequencing_options_are_validated(kwargs: dict[str, Any], field: str) -> None:
    a = EngineSpec("h", 1, kv_events="tcp://127.0.0.1:5557")
    with pytest.raises(ConfigError, match=field):
        Subscriber(PrefixIndex(block_size=BLOCK), [a], **kwargs)
