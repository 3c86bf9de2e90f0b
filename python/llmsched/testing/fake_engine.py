"""Fake engines on loopback: real ZMQ and real HTTP, scripted content.

A :class:`FakeKVPublisher` publishes vLLM ``EventBatch`` payloads the way vLLM's
``ZmqEventPublisher`` does (three frames, per-publisher sequence numbers, a replay ROUTER answering
``[seq, payload]`` replies and a ``-1`` end marker). Tests script it: publish, lose batches on the
wire (still replayable), send a batch again (a duplicate, or a lost one late: reordering),
forget the replay buffer, restart the sequence, answer replays late or never, send raw frames.

A :class:`FakeHTTPEngine` is an aiohttp server on its own thread serving ``/metrics`` from
attributes a test changes at will (``metrics_text``, ``status``, ``delay_s``); ``setup`` adds
more routes (e.g. an OpenAI-compatible ``/v1/completions``) before it starts.

>>> from llmsched.testing import FakeKVPublisher, event_batch, stored_event
>>> with FakeKVPublisher(topic="kv@a") as engine:
...     engine.publish(event_batch(stored_event([1], None, list(range(16)))), deliver=False)
...     engine.spec_kwargs()["topic"]
0
'kv@a'
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import msgpack
import zmq
from aiohttp import web

from llmsched.integrations.identity import EngineSpec

__all__ = [
    "FakeHTTPEngine",
    "FakeKVPublisher",
    "cleared_event",
    "event_batch",
    "removed_event",
    "stored_event",
]

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored_event(
    block_hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int = 16,
    *,
    medium: str = "GPU",
    **extra: Any,
) -> dict[str, Any]:
    """A map-encoded (vLLM >= 0.24) ``BlockStored`` event.

    >>> stored_event([5], None, [1, 2], block_size=2)["type"]
    'BlockStored'
    """
    return {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        **extra,
    }


def removed_event(block_hashes: Sequence[int], medium: str = "GPU") -> dict[str, Any]:
    """A map-encoded ``BlockRemoved`` event."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def cleared_event() -> dict[str, Any]:
    """An ``AllBlocksCleared`` event."""
    return {"type": "AllBlocksCleared"}


def event_batch(*events: Any, ts: float = 0.0, dp_rank: int | None = None) -> bytes:
    """A msgpack ``EventBatch`` payload ``[ts, events, dp_rank]``.

    >>> len(event_batch(cleared_event())) > 0
    True
    """
    packed: bytes = msgpack.packb([ts, list(events), dp_rank])
    return packed


class FakeKVPublisher:
    """A KV-event publisher on loopback, scripted by the test.

    Args:
        topic: the topic frame of every message.
        endpoint: where the PUB socket binds (default: a free loopback port), or, with
            ``connect=True``, the subscriber's bound endpoint to connect to.
        connect: connect instead of binding (vLLM's behaviour for an endpoint without ``*``).
        replay: serve a replay ROUTER socket on a free loopback port.
        replay_buffer: batches the replay buffer holds (vLLM's default: 10,000).
        replay_with_topic: reply ``[topic, seq, payload]`` (newer vLLM) instead of
            ``[seq, payload]``.

    The PUB side is an XPUB socket so that :meth:`wait_subscribed` can tell when a subscription
    has arrived; subscribers see an ordinary publisher. Set ``replay_answers = False`` to make
    the replay socket ignore requests (a replay that times out; ``replay_ignored`` lists their
    starts, ``replay_requests`` those answered), or ``replay_delay_s`` to answer
    each request that many seconds late (the live stream keeps flowing meanwhile), or
    ``replay_stale_s`` to answer each request with the first batch it holds again and again,
    that many seconds apart, never ending (a replay socket stuck on what was applied).
    """

    def __init__(
        self,
        *,
        topic: str = "",
        endpoint: str | None = None,
        connect: bool = False,
        replay: bool = True,
        replay_buffer: int = 10_000,
        replay_with_topic: bool = False,
    ) -> None:
        self.topic = topic.encode()
        self.replay_with_topic = replay_with_topic
        self.replay_answers = True
        self.replay_delay_s = 0.0
        self.replay_stale_s: float | None = None
        self.replay_requests: list[int] = []
        # Requests read while ``replay_answers`` was False (left unanswered), by start.
        self.replay_ignored: list[int] = []
        self._due_replays: list[tuple[float, bytes, int]] = []  # (when, client, start)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        # Every subscription is reported, not only the first per topic: a subscriber that comes
        # back is seen too (wait_subscribed's count).
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if connect:
            if endpoint is None:
                raise ValueError("connect=True needs the subscriber's endpoint")
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        elif endpoint is None:
            port = self._pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            port = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self._lock = threading.Lock()
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_buffer)
        self._outbox: queue.Queue[list[bytes]] = queue.Queue()
        self._flush_marks: collections.deque[threading.Event] = collections.deque()
        self._subscriptions = 0
        self._subscribed = threading.Condition()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-kv-publisher", daemon=True)
        self._thread.start()

    # -- scripting ----------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence number the next :meth:`publish` uses."""
        with self._lock:
            return self._seq

    def publish(self, payload: bytes, *, deliver: bool = True) -> int:
        """Publish ``payload`` with the next sequence number (kept for replay); with
        ``deliver=False`` the batch is lost on the wire but stays replayable. Returns its seq."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        if deliver:
            self._outbox.put([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def resend(self, seq: int) -> None:
        """Send the published batch ``seq`` (still in the replay buffer) on the wire again: a
        duplicate if it was delivered, a late arrival (reordering) if it was published with
        ``deliver=False``."""
        with self._lock:
            payload = next((p for s, p in self._buffer if s == seq), None)
        if payload is None:
            raise ValueError(f"batch {seq} is not in the replay buffer")
        self._outbox.put([self.topic, seq.to_bytes(8, "big"), payload])

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send raw frames as they are (malformed messages, foreign topics)."""
        self._outbox.put(list(frames))

    def forget(self, before_seq: int) -> None:
        """Drop replay-buffer batches with seq < ``before_seq`` (as a full buffer would)."""
        with self._lock:
            while self._buffer and self._buffer[0][0] < before_seq:
                self._buffer.popleft()

    def skip_to(self, seq: int) -> None:
        """Continue the sequence at ``seq``: the batches before it were published before this
        fake existed and are in no buffer (a subscriber joining a running engine)."""
        with self._lock:
            if seq < self._seq:
                raise ValueError(f"seq {seq} is behind the next seq {self._seq}")
            self._seq = seq

    def restart(self) -> None:
        """Start the sequence over at 0 with an empty replay buffer (an engine restart)."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()

    def wait_subscribed(self, timeout: float = 5.0, *, count: int = 1) -> bool:
        """Wait until ``count`` subscriptions in all (a subscriber that reconnects subscribes
        again) have reached this publisher."""
        with self._subscribed:
            return self._subscribed.wait_for(lambda: self._subscriptions >= count, timeout)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything published so far has been handed to ZMQ."""
        done = threading.Event()
        self._outbox.put([])  # a marker: the server thread sets `done` when it reaches it
        self._flush_marks.append(done)
        if not done.wait(timeout):
            raise TimeoutError("the fake publisher did not flush")

    def spec_kwargs(self) -> dict[str, Any]:
        """``kv_events``, ``replay`` and ``topic`` for an :class:`EngineSpec` of this publisher
        (a subscriber connecting to it)."""
        return {
            "kv_events": self.endpoint,
            "replay": self.replay_endpoint,
            "topic": self.topic.decode(),
        }

    def close(self) -> None:
        """Stop serving and close the sockets (the port is free again)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join(5.0)

    def __enter__(self) -> FakeKVPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- server thread ------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                ready = dict(poller.poll(2))
                if self._pub in ready:
                    self._read_subscriptions()
                if self._router is not None and self._router in ready:
                    self._read_replay_requests(self._router)
                if self._router is not None and self._due_replays:
                    self._answer_due(self._router)
                self._send_outbox()
        finally:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            self._ctx.term()

    def _read_subscriptions(self) -> None:
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                with self._subscribed:
                    self._subscriptions += 1
                    self._subscribed.notify_all()

    def _send_outbox(self) -> None:
        while True:
            try:
                frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            if not frames:
                self._flush_marks.popleft().set()
                continue
            self._pub.send_multipart(frames)

    def _read_replay_requests(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            if not self.replay_answers:
                self.replay_ignored.append(start)
                continue
            self.replay_requests.append(start)
            due = time.monotonic() + self.replay_delay_s
            self._due_replays.append((due, client, start))

    def _answer_due(self, router: zmq.Socket[bytes]) -> None:
        now = time.monotonic()
        waiting = []
        for due, client, start in self._due_replays:
            if due > now:
                waiting.append((due, client, start))
                continue
            head = [client, b""] + ([self.topic] if self.replay_with_topic else [])
            if self.replay_stale_s is not None:
                with self._lock:
                    first = self._buffer[0] if self._buffer else None
                if first is not None:
                    router.send_multipart([*head, first[0].to_bytes(8, "big"), first[1]])
                waiting.append((now + self.replay_stale_s, client, start))
                continue
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end_topic = [b""] if self.replay_with_topic else []
            router.send_multipart([client, b"", *end_topic, _END_SEQ, b""])
        self._due_replays = waiting


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeHTTPEngine:
    """An HTTP engine on loopback (aiohttp, on its own thread and event loop).

    ``GET metrics_path`` answers ``metrics_text`` with ``status`` after ``delay_s`` seconds;
    change them at any time. ``setup(app)`` may add routes before the server starts.

    >>> with FakeHTTPEngine(metrics_text="vllm:num_requests_waiting 2\\n") as engine:
    ...     engine.spec().base_url.startswith("http://127.0.0.1:")
    True
    """

    def __init__(
        self,
        *,
        metrics_text: str = "",
        status: int = 200,
        delay_s: float = 0.0,
        metrics_path: str = "/metrics",
        setup: Callable[[web.Application], None] | None = None,
    ) -> None:
        self.metrics_text = metrics_text
        self.status = status
        self.delay_s = delay_s
        self.metrics_path = metrics_path
        self.metrics_requests = 0
        self.app = web.Application()
        self.app.router.add_get(metrics_path, self._metrics)
        if setup is not None:
            setup(self.app)
        self._loop = asyncio.new_event_loop()
        # Closing does not wait for handlers still delaying (a test's slow scrape).
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=0.1)
        ready: queue.Queue[BaseException | int] = queue.Queue()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="fake-http-engine", daemon=True
        )
        self._thread.start()
        result = ready.get(timeout=10.0)
        if isinstance(result, BaseException):
            raise result
        self.host = "127.0.0.1"
        self.port: int = result

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self.host}:{self.port}"

    def spec(self, **kwargs: Any) -> EngineSpec:
        """An :class:`EngineSpec` of this engine (extra fields from ``kwargs``)."""
        return EngineSpec(self.host, self.port, metrics_path=self.metrics_path, **kwargs)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_requests += 1
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return web.Response(text=self.metrics_text, status=self.status, content_type="text/plain")

    def _serve(self, ready: queue.Queue[BaseException | int]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            address: Mapping[int, Any] | Any = self._runner.addresses[0]
            ready.put(int(address[1]))
        except BaseException as err:  # handed to the constructor, which raises it
            ready.put(err)
            return
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        """Stop the server and its thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)

    def __enter__(self) -> FakeHTTPEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
