"""Integrations: KV-event subscriber throughput over loopback ZMQ, and metrics scrape parsing.

Subscriber workload: rounds of 100 batches published on a real PUB socket (loopback TCP), each
batch 4 BlockStored events of 4 blocks x 16 tokens (16 blocks, 256 tokens; 150k vocabulary);
the first batch of a round clears the worker. The subscriber hands each payload to the Rust
index in one call; ``NativeKVEventSubscriber`` reads (llmsched's own ZMTP), decodes and applies
in Rust; the twin receives on the same kind of socket, decodes into Python objects
(``llmsched.reference.vllm_events``) and applies them to the pure-Python reference index.

Scrape workload: the real vLLM CPU engine's ``/metrics`` capture (581 lines, mostly histograms),
parsed with ``prometheus_client`` and applied to an EndpointPool. The twin parses the whole text;
the scraper hands the parser only the lines of the families it reads.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from llmsched import EndpointPool, PrefixIndex
from llmsched.integrations import EngineSpec, KVEventSubscriber, NativeKVEventSubscriber
from llmsched.integrations.metrics import parse_engine_metrics
from llmsched.reference.integrations import ReferenceEventApplier
from llmsched.reference.prefix_index import ReferencePrefixIndex
from llmsched.testing import cleared_event, event_batch, stored_event

BLOCK, BATCHES, EVENTS, BLOCKS_PER_EVENT = 16, 100, 4, 4
BLOCKS_PER_ROUND = BATCHES * EVENTS * BLOCKS_PER_EVENT
WORKER = "127.0.0.1:8000"


def _payloads() -> list[bytes]:
    rng = random.Random(7)
    next_hash = 1
    out = []
    for b in range(BATCHES):
        events: list[Any] = [cleared_event()] if b == 0 else []
        for _ in range(EVENTS):
            hashes = list(range(next_hash, next_hash + BLOCKS_PER_EVENT))
            next_hash += BLOCKS_PER_EVENT
            tokens = [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * BLOCK)]
            events.append(stored_event(hashes, None, tokens, BLOCK))
        out.append(event_batch(*events, ts=float(b)))
    return out


PAYLOADS = _payloads()


class _Publisher:
    """An XPUB on loopback that publishes rounds with a continuing sequence."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def wait_subscribed(self) -> None:
        assert self.sock.poll(10_000), "no subscriber"
        self.sock.recv()

    def publish_round(self) -> None:
        for payload in PAYLOADS:
            self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class _NaiveSubscriber:
    """The twin: a blocking SUB loop decoding into Python objects for the reference index."""

    def __init__(self, endpoint: str) -> None:
        self.applier = ReferenceEventApplier(ReferencePrefixIndex(block_size=BLOCK))
        self.batches = 0
        self.changed = threading.Condition()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            _topic, _seq, payload = self.sock.recv_multipart()
            self.applier.apply(WORKER, payload)
            with self.changed:
                self.batches += 1
                self.changed.notify_all()

    def wait_batches(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.batches >= n, 60.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publisher() -> Iterator[_Publisher]:
    pub = _Publisher()
    yield pub
    pub.close()


def _run_rounds(
    benchmark: Any, publisher: _Publisher, wait: Callable[[int], None], done: Callable[[], int]
) -> None:
    def one_round() -> None:
        target = done() + BATCHES
        publisher.publish_round()
        wait(target)

    one_round()  # warm-up, and the result checked by the caller
    benchmark.group = "KV-event subscriber over loopback ZMQ (100 batches x 16 blocks)"
    benchmark.pedantic(one_round, rounds=5, warmup_rounds=1)
    benchmark.extra_info["items"] = BATCHES
    benchmark.extra_info["unit"] = "batches"
    if benchmark.stats is not None:  # None when timing is disabled
        median = benchmark.stats.stats.median
        benchmark.extra_info["blocks_per_s"] = round(BLOCKS_PER_ROUND / median)


def _subscriber_throughput(
    benchmark: Any,
    publisher: _Publisher,
    subscriber: type[KVEventSubscriber] | type[NativeKVEventSubscriber],
) -> None:
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec("127.0.0.1", 8000, kv_events=publisher.endpoint)
    with subscriber(index, [spec]) as sub:
        publisher.wait_subscribed()

        def wait(n: int) -> None:
            assert sub.wait_for(lambda c: c["batches"] >= n, 60.0), sub.counters()

        _run_rounds(benchmark, publisher, wait, lambda: sub.counters()["batches"])
        c = sub.counters()
    assert c["gaps"] == 0 and c["decode_errors"] == 0
    assert index.stats()["worker_blocks"][WORKER] == BLOCKS_PER_ROUND


def test_subscriber_throughput(benchmark: Any, publisher: _Publisher) -> None:
    _subscriber_throughput(benchmark, publisher, KVEventSubscriber)


def test_native_subscriber_throughput(benchmark: Any, publisher: _Publisher) -> None:
    """The native feed (llmsched's own ZMTP on tokio, decode and apply in Rust)."""
    _subscriber_throughput(benchmark, publisher, NativeKVEventSubscriber)


def test_subscriber_throughput_twin(benchmark: Any, publisher: _Publisher) -> None:
    naive = _NaiveSubscriber(publisher.endpoint)
    try:
        publisher.wait_subscribed()
        _run_rounds(benchmark, publisher, naive.wait_batches, lambda: naive.batches)
    finally:
        naive.close()
    held = naive.applier.index.held[WORKER]
    assert len(held) == BLOCKS_PER_ROUND
    # The twin and the native index agree on what the worker holds after a round.
    native = PrefixIndex(block_size=BLOCK)
    for payload in PAYLOADS:
        native.apply_vllm_events(WORKER, payload)
    assert set(native.holdings(WORKER)) == set(held)


VECTORS = Path(__file__).resolve().parent.parent / "tests" / "data"
UNDER_LOAD = (VECTORS / "vllm_metrics_under_load.txt").read_text()


@pytest.mark.parametrize("prefilter", [True, False], ids=["native", "twin"])
def test_scrape_parse_and_apply(benchmark: Any, prefilter: bool) -> None:
    """``native`` is the scraper's path (prefiltered); ``twin`` parses the whole text."""
    pool = EndpointPool(["e"])

    def parse_and_apply() -> dict[str, Any]:
        values = parse_engine_metrics(UNDER_LOAD, prefilter=prefilter)
        pool.update(
            "e",
            waiting=values["waiting"],
            running=values["running"],
            kv_cache_usage=values["kv_cache_usage"],
        )
        return values

    values = parse_and_apply()
    assert (values["running"], values["waiting"]) == (3, 7)
    assert values == parse_engine_metrics(UNDER_LOAD, prefilter=not prefilter)
    benchmark.group = "metrics scrape parse + apply (real vLLM capture, 581 lines)"
    benchmark(parse_and_apply)
    benchmark.extra_info["items"] = 1
    benchmark.extra_info["unit"] = "scrapes"


def test_scrape_rust_parser_for_comparison(benchmark: Any) -> None:
    """The pool's own Rust parser (``update_from_metrics_text``), for scale."""
    pool = EndpointPool(["e"])
    assert pool.update_from_metrics_text("e", UNDER_LOAD)["waiting"] == 7
    benchmark.group = "metrics scrape parse + apply (real vLLM capture, 581 lines)"
    benchmark(pool.update_from_metrics_text, "e", UNDER_LOAD)
