"""Subscribe to vLLM engines' KV-cache events and keep a :class:`~llmsched.PrefixIndex` current.

One SUB socket per engine (one per data-parallel rank), each message three frames
``[topic, seq (8-byte big-endian), payload]``; each payload goes straight to
:meth:`PrefixIndex.apply_vllm_events` (decoded and applied in Rust, no per-event Python objects).

Algorithm (per publisher; ``next`` = the sequence number expected next):

- ``seq == next``: apply. ``seq < next`` (and after the last live seq): a batch a replay already
  delivered, dropped. ``seq`` not after the last live seq: the engine restarted; its worker is
  cleared and the stream starts over.
- ``seq > next`` (a gap; also a first message with ``seq > 0``, a late joiner): the engine's replay
  socket is asked for ``next`` onwards; live messages are buffered meanwhile. Replayed batches are
  applied in order, then the buffered live ones that the replay did not already cover.
- When the replay cannot cover the gap (no replay endpoint, no answer within
  ``replay_timeout_s``, or the first replayed seq is past ``next``) the worker is cleared and the
  stream resynchronises from the first batch it has.

Sockets are polled together by one thread (:meth:`KVEventSubscriber.start`) or one asyncio task
(:meth:`KVEventSubscriber.run`). ZMQ reconnects dropped TCP connections on its own with
exponential backoff (``backoff_s``); a socket that fails is rebuilt with the same backoff.

>>> import msgpack
>>> import zmq
>>> from llmsched import PrefixIndex
>>> from llmsched.integrations import EngineSpec, KVEventSubscriber
>>> index = PrefixIndex(block_size=4)
>>> spec = EngineSpec("127.0.0.1", 8000, kv_events="tcp://127.0.0.1:*", kv_events_bind=True)
>>> with KVEventSubscriber(index, [spec]) as sub:
...     pub = zmq.Context.instance().socket(zmq.PUB)
...     _ = pub.connect(sub.bound_endpoint(spec.worker_id))
...     event = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
...              "token_ids": [1, 2, 3, 4], "block_size": 4}
...     payload = msgpack.packb([0.0, [event], None])
...     for _ in range(200):  # until the subscription has reached the publisher
...         pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
...         if sub.wait_for(lambda c: c["batches"] >= 1, timeout=0.05):
...             break
...     pub.close(linger=0)
>>> index.match_tokens([1, 2, 3, 4]).as_dict()
{'127.0.0.1:8000': 1}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmsched.errors import ConfigError, MalformedEventError, UnknownWorkerError
from llmsched.integrations.identity import EngineSpec
from llmsched.prefix_index import PrefixIndex
from llmsched.types import ApplyReport, ReportKey

__all__ = ["COUNTERS", "DEFAULT_BACKOFF_S", "DEFAULT_REPLAY_TIMEOUT_S", "KVEventSubscriber"]

DEFAULT_BACKOFF_S = (0.05, 2.0)
"""First and largest delay (seconds) between reconnection attempts."""

DEFAULT_REPLAY_TIMEOUT_S = 2.0
"""How long a replay may take to end before the gap counts as not covered."""

POLL_INTERVAL_S = 0.02
"""Longest wait between checks of the stop flag, replay deadlines and socket rebuilds."""

RCVHWM = 10_000
"""Messages a SUB socket queues before dropping (vLLM's replay buffer holds 10,000 batches)."""

_END_SEQ = -1  # the replay socket's end marker, a signed 8-byte big-endian -1

COUNTERS = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "all_cleared",
    "unknown_parent",
    "unknown_removed",
    "gaps",
    "missed_batches",
    "replays",
    "catch_ups",
    "replayed_batches",
    "replay_timeouts",
    "resyncs",
    "restarts",
    "duplicates",
    "decode_errors",
    "topic_rejected",
    "connects",
    "disconnects",
    "reconnects",
    "socket_errors",
)
"""The counters kept per worker and in total (see :meth:`KVEventSubscriber.counters`)."""

# Keys of PrefixIndex.apply_vllm_events' report summed into the counters.
_REPORT_KEYS: tuple[tuple[ReportKey, str], ...] = (
    ("events", "events"),
    ("blocks_stored", "blocks_stored"),
    ("blocks_removed", "blocks_removed"),
    ("cleared", "all_cleared"),
    ("unknown_parent", "unknown_parent"),
    ("unknown_removed", "unknown_removed"),
)

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


@dataclasses.dataclass
class _Replay:
    """A replay in progress: what it must cover and the live batches held back meanwhile."""

    start: int
    deadline: float
    buffered: list[tuple[int, bytes]]
    received: int = 0


class _Publisher:
    """One engine's stream: its sockets and the sequence state machine."""

    def __init__(self, owner: KVEventSubscriber, spec: EngineSpec) -> None:
        self.owner = owner
        self.spec = spec
        self.worker = spec.worker_id
        self.topic = spec.topic.encode()
        self.sub: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.bound: str | None = None
        self.retry_at = 0.0
        self.failures = 0
        self.next_seq: int | None = None
        self.last_live: int | None = None
        self.replay: _Replay | None = None
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- sockets ------------------------------------------------------------------------------

    def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Create and connect (or bind) the sockets; on failure count it and retry later."""
        endpoint = self.spec.kv_events
        assert endpoint is not None
        backoff_first, backoff_max = self.owner.backoff_s
        sub = ctx.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.RECONNECT_IVL, max(1, round(backoff_first * 1000)))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, round(backoff_max * 1000)))
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
            if self.spec.kv_events_bind:
                sub.bind(endpoint)
                self.bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(endpoint)
        except zmq.ZMQError:
            if monitor is not None:
                monitor.close(linger=0)
            sub.close(linger=0)
            self._failed()
            return
        self.sub, self.monitor = sub, monitor
        self.failures = 0
        if self.spec.replay is not None:
            self.dealer = self._new_dealer(ctx)

    def _new_dealer(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert self.spec.replay is not None
        dealer.connect(self.spec.replay)
        return dealer

    def close(self) -> None:
        for sock in (self.monitor, self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.monitor = self.dealer = None

    def _failed(self) -> None:
        self.owner._bump(self, "socket_errors")
        backoff_first, backoff_max = self.owner.backoff_s
        delay = min(backoff_max, backoff_first * 2**self.failures)
        self.failures += 1
        self.retry_at = time.monotonic() + delay

    def fail(self) -> None:
        """A socket raised: drop everything and rebuild after a backoff delay."""
        self.close()
        self.replay = None
        self._failed()

    # -- receiving ----------------------------------------------------------------------------

    def drain_sub(self) -> None:
        assert self.sub is not None
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_live(frames)

    def drain_monitor(self) -> None:
        assert self.monitor is not None
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.owner._bump(self, "connects")
                if self.counts["connects"] > 1:
                    self.owner._bump(self, "reconnects")
                if self.owner.catch_up:
                    self.request_catch_up()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.owner._bump(self, "disconnects")

    def drain_dealer(self) -> None:
        assert self.dealer is not None
        while self.dealer is not None:
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_replay_reply(frames)

    def on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.owner._bump(self, "decode_errors")
            return
        topic, seq_bytes, payload = frames
        if topic != self.topic:
            self.owner._bump(self, "topic_rejected")
            return
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_live is not None and seq <= self.last_live:
            self.restart()
        self.last_live = seq
        if self.replay is not None:
            self.replay.buffered.append((seq, payload))
        else:
            self.sequence(seq, payload)

    def restart(self) -> None:
        """The engine started its sequence over: forget it and whatever replay was running."""
        self.owner._bump(self, "restarts")
        if self.replay is not None:
            self.replay = None
            self._reset_dealer()
        self.clear_worker()
        self.next_seq = None

    def sequence(self, seq: int, payload: bytes) -> None:
        """One live batch in the order received, with no replay running."""
        expected = 0 if self.next_seq is None else self.next_seq
        if seq == expected:
            self.apply(seq, payload)
        elif seq < expected:
            self.owner._bump(self, "duplicates")
        else:
            self.gap(expected, seq, payload)

    def request_catch_up(self) -> None:
        """A publisher (re)connected: ask its replay socket for every batch after the last one
        applied, so what it sent while nobody listened arrives now rather than when its next
        live batch reveals the gap (an idle engine may not send one for a long time)."""
        if self.dealer is None or self.replay is not None:
            return
        self.owner._bump(self, "catch_ups")
        self.ask_replay(0 if self.next_seq is None else self.next_seq, [])

    def gap(self, start: int, seq: int, payload: bytes) -> None:
        self.owner._bump(self, "gaps")
        self.owner._bump(self, "missed_batches", seq - start)
        if self.dealer is None:
            self.resync(seq)
            self.apply(seq, payload)
            return
        self.owner._bump(self, "replays")
        self.ask_replay(start, [(seq, payload)])

    def ask_replay(self, start: int, held_back: list[tuple[int, bytes]]) -> None:
        """Ask the replay socket for every batch from ``start``; live batches wait meanwhile."""
        assert self.dealer is not None
        self.replay = _Replay(start, time.monotonic() + self.owner.replay_timeout_s, held_back)
        self.next_seq = start
        # The ROUTER expects [identity, empty delimiter, start seq]; the DEALER adds the identity.
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])

    def on_replay_reply(self, frames: list[bytes]) -> None:
        """One reply frame set: ``[b"", seq, payload]`` (the reference layout and SGLang's) or
        ``[b"", topic, seq, payload]`` (newer vLLM); ``seq == -1`` ends the replay."""
        if self.replay is None:
            return  # a straggler from a replay given up on
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            topic, seq_bytes, payload = frames
            if topic and topic != self.topic:
                self.owner._bump(self, "topic_rejected")
                return
        elif len(frames) == 2:
            seq_bytes, payload = frames
        else:
            self.owner._bump(self, "decode_errors")
            return
        if len(seq_bytes) != 8:
            self.owner._bump(self, "decode_errors")
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == _END_SEQ:
            self.finish_replay()
            return
        replay = self.replay
        replay.received += 1
        expected = replay.start if self.next_seq is None else self.next_seq
        if seq < expected:
            return
        if seq > expected:
            self.resync(seq)  # the engine no longer holds what we missed
        self.apply(seq, payload, replayed=True)

    def finish_replay(self) -> None:
        replay = self.replay
        assert replay is not None
        self.replay = None
        self.release(replay.buffered)

    def check_deadline(self, now: float) -> None:
        if self.replay is not None and now >= self.replay.deadline:
            self.owner._bump(self, "replay_timeouts")
            replay = self.replay
            self.replay = None
            self._reset_dealer()
            self.release(replay.buffered)

    def release(self, buffered: list[tuple[int, bytes]]) -> None:
        """Sequence the live batches held back during a replay (a later gap may start another
        replay, which then holds back the rest)."""
        expected = 0 if self.next_seq is None else self.next_seq
        if buffered and buffered[0][0] > expected:
            # The replay did not reach the first held-back batch: start over from it.
            self.resync(buffered[0][0])
        for i, (seq, payload) in enumerate(buffered):
            if self.replay is not None:
                self.replay.buffered.extend(buffered[i:])
                return
            self.sequence(seq, payload)

    def resync(self, seq: int) -> None:
        """Batches before ``seq`` are lost for good: clear the worker, continue at ``seq``."""
        self.owner._bump(self, "resyncs")
        self.clear_worker()
        self.next_seq = seq

    def _reset_dealer(self) -> None:
        # Replies to an abandoned request may still arrive; a fresh socket never sees them.
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = self._new_dealer(self.owner._ctx_for_dealers())

    def clear_worker(self) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.owner.index.clear(self.worker)

    def apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        try:
            report = self.owner.index.apply_vllm_events(self.worker, payload)
        except MalformedEventError:
            self.next_seq = seq + 1  # skipped, not waited for
            self.owner._bump(self, "decode_errors")
            return
        # The sequence number moves with the counters, after the index: whoever sees
        # `last_seq` reach a batch also sees its blocks and its counts.
        self.owner._count_batch(self, seq, report, replayed)


class KVEventSubscriber:
    """Keeps ``index`` current from the KV events of ``engines``.

    Args:
        index: the prefix index to feed (worker names are the engines' worker ids).
        engines: the engines; those without ``kv_events`` are skipped.
        backoff_s: first and largest delay between reconnection attempts (exponential).
        replay_timeout_s: how long a replay may take before the gap counts as not covered.
        catch_up: when a publisher connects (or reconnects), ask its replay socket at once for
            the batches after the last one applied (counted in ``catch_ups``), instead of
            waiting for its next live batch to show the gap. Off by default: then the only
            replays are the ones gaps ask for.

    Runs on its own daemon thread (:meth:`start` / :meth:`stop`, or ``with``) or as an asyncio
    task (``await run()``; cancelling the task stops it). Counters may be read from any thread.
    """

    def __init__(
        self,
        index: PrefixIndex,
        engines: Iterable[EngineSpec],
        *,
        backoff_s: tuple[float, float] = DEFAULT_BACKOFF_S,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        catch_up: bool = False,
    ) -> None:
        if not isinstance(index, PrefixIndex):
            raise TypeError(f"index must be a PrefixIndex, got {type(index).__name__}")
        first, largest = _check_backoff(backoff_s)
        if isinstance(replay_timeout_s, bool) or not (
            isinstance(replay_timeout_s, (int, float)) and replay_timeout_s > 0
        ):
            raise ConfigError(f"replay_timeout_s must be a number > 0, got {replay_timeout_s!r}")
        if not isinstance(catch_up, bool):
            raise ConfigError(f"catch_up must be a bool, got {catch_up!r}")
        self.index = index
        self.backoff_s = (first, largest)
        self.catch_up = catch_up
        self.replay_timeout_s = float(replay_timeout_s)
        self._publishers: dict[str, _Publisher] = {}
        seen_endpoints: dict[str, str] = {}
        for spec in engines:
            if not isinstance(spec, EngineSpec):
                raise TypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
            if spec.kv_events is None:
                continue
            if spec.worker_id in self._publishers:
                raise ConfigError(f"engine {spec.worker_id} is listed twice")
            if spec.kv_events in seen_endpoints and "*" not in spec.kv_events:
                raise ConfigError(
                    f"engines {seen_endpoints[spec.kv_events]} and {spec.worker_id} share the "
                    f"KV-event endpoint {spec.kv_events}; each publisher needs its own"
                )
            seen_endpoints[spec.kv_events] = spec.worker_id
            self._publishers[spec.worker_id] = _Publisher(self, spec)
        # Reentrant: a wait_for condition may itself read counters or last_seq.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running = False

    # -- counters -----------------------------------------------------------------------------

    def _bump(self, pub: _Publisher, key: str, n: int = 1) -> None:
        with self._lock:
            pub.counts[key] += n
            self._totals[key] += n
            self._changed.notify_all()

    def _count_batch(self, pub: _Publisher, seq: int, report: ApplyReport, replayed: bool) -> None:
        with self._lock:
            pub.next_seq = seq + 1
            for counts in (pub.counts, self._totals):
                counts["batches"] += 1
                if replayed:
                    counts["replayed_batches"] += 1
                for src, dst in _REPORT_KEYS:
                    counts[dst] += report[src]
            self._changed.notify_all()

    def counters(self) -> dict[str, int]:
        """Totals over every engine (names in :data:`COUNTERS`): batches applied (live and
        replayed), events, blocks stored and removed, gaps, replays, replayed batches, replay
        timeouts, resyncs, restarts, duplicates dropped, decode errors, topic rejections,
        connections, reconnections and socket errors. A consistent copy."""
        with self._lock:
            return dict(self._totals)

    def worker_counters(self, worker: str) -> dict[str, int]:
        """:meth:`counters` for one engine; KeyError for an unknown worker."""
        pub = self._publisher(worker)
        with self._lock:
            return dict(pub.counts)

    def last_seq(self, worker: str) -> int | None:
        """The sequence number of the last batch taken from ``worker`` (None before any)."""
        pub = self._publisher(worker)
        with self._lock:
            return None if pub.next_seq is None else pub.next_seq - 1

    def bound_endpoint(self, worker: str) -> str | None:
        """The endpoint actually bound for ``worker`` (a ``*`` port resolved), once started;
        None for an engine the subscriber connects to."""
        return self._publisher(worker).bound

    def workers(self) -> list[str]:
        """The worker ids subscribed to."""
        return list(self._publishers)

    def wait_for(
        self, condition: Callable[[dict[str, int]], bool], timeout: float | None = None
    ) -> bool:
        """Block until ``condition(counters())`` holds (True) or ``timeout`` passes (False).

        Handy in tests and at start-up: ``sub.wait_for(lambda c: c["connects"] >= 2, 5.0)``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not condition(dict(self._totals)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def _publisher(self, worker: str) -> _Publisher:
        try:
            return self._publishers[worker]
        except KeyError:
            raise KeyError(f"no engine with worker id {worker!r} is subscribed") from None

    # -- thread -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start the daemon thread that polls them."""
        if self._running:
            raise RuntimeError("the subscriber is already running")
        self._running = True
        self._stop.clear()
        self._open_all()
        self._thread = threading.Thread(
            target=self._thread_main, name="llmsched-kv-events", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread (within about :data:`POLL_INTERVAL_S`) and close every socket."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the subscriber thread did not stop within {timeout} s")
        self._thread = None

    def __enter__(self) -> KVEventSubscriber:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            poller = zmq.Poller()
            registered: list[zmq.Socket[bytes]] = []
            while not self._stop.is_set():
                sockets = self._maintain()
                if sockets != registered:
                    poller = zmq.Poller()
                    for sock in sockets:
                        poller.register(sock, zmq.POLLIN)
                    registered = sockets
                ready = dict(poller.poll(round(POLL_INTERVAL_S * 1000))) if sockets else {}
                if not sockets:
                    self._stop.wait(POLL_INTERVAL_S)
                self._dispatch(ready)
        finally:
            self._close_all()

    # -- asyncio ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll the sockets on the running event loop until cancelled (then close them).

        Batches are applied on the loop's thread; the index releases the GIL while it works.
        """
        if self._running:
            raise RuntimeError("the subscriber is already running")
        self._running = True
        self._open_all()
        try:
            registered: list[zmq.Socket[bytes]] = []
            poller = zmq.asyncio.Poller()
            shadows: dict[Any, zmq.Socket[bytes]] = {}
            while True:
                sockets = self._maintain()
                if sockets != registered:
                    poller = zmq.asyncio.Poller()
                    shadows = {}
                    for sock in sockets:
                        shadow = zmq.asyncio.Socket.from_socket(sock)
                        shadows[shadow] = sock
                        poller.register(shadow, zmq.POLLIN)
                    registered = sockets
                if sockets:
                    events = await poller.poll(round(POLL_INTERVAL_S * 1000))
                    ready = {shadows[s]: e for s, e in events}
                else:
                    await asyncio.sleep(POLL_INTERVAL_S)
                    ready = {}
                self._dispatch(ready)
        finally:
            self._close_all()

    # -- shared loop body ---------------------------------------------------------------------

    def _ctx_for_dealers(self) -> zmq.Context[zmq.Socket[bytes]]:
        assert self._ctx is not None
        return self._ctx

    def _open_all(self) -> None:
        self._ctx = zmq.Context()
        for pub in self._publishers.values():
            pub.open(self._ctx)

    def _close_all(self) -> None:
        for pub in self._publishers.values():
            pub.close()
            pub.replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._running = False

    def _maintain(self) -> list[zmq.Socket[bytes]]:
        """Rebuild failed sockets whose backoff has passed, give up overdue replays, and return
        the sockets to poll."""
        now = time.monotonic()
        sockets: list[zmq.Socket[bytes]] = []
        for pub in self._publishers.values():
            if pub.sub is None and now >= pub.retry_at:
                pub.open(self._ctx_for_dealers())
            pub.check_deadline(now)
            sockets.extend(s for s in (pub.sub, pub.monitor, pub.dealer) if s is not None)
        return sockets

    def _dispatch(self, ready: dict[Any, int]) -> None:
        if not ready:
            return
        for pub in self._publishers.values():
            try:
                if pub.monitor is not None and pub.monitor in ready:
                    pub.drain_monitor()
                # Replies first: a replay in progress decides how the live batches are taken.
                if pub.dealer is not None and pub.dealer in ready:
                    pub.drain_dealer()
                if pub.sub is not None and pub.sub in ready:
                    pub.drain_sub()
            except zmq.ZMQError:
                pub.fail()

    def __repr__(self) -> str:
        c = self.counters()
        return (
            f"KVEventSubscriber({len(self._publishers)} engines, batches={c['batches']}, "
            f"gaps={c['gaps']}, resyncs={c['resyncs']})"
        )


def _check_backoff(backoff_s: object) -> tuple[float, float]:
    ok = (
        isinstance(backoff_s, tuple)
        and len(backoff_s) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in backoff_s)
        and 0 < backoff_s[0] <= backoff_s[1]
    )
    if not ok:
        raise ConfigError(
            f"backoff_s must be (first, largest) with 0 < first <= largest, got {backoff_s!r}"
        )
    assert isinstance(backoff_s, tuple)
    return float(backoff_s[0]), float(backoff_s[1])
