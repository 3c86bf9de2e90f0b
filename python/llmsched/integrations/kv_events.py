"""Subscribe to vLLM engines' KV-cache events and keep a :class:`~llmsched.PrefixIndex` current.

One SUB socket per engine (one per data-parallel rank), each message three frames
``[topic, seq (8-byte big-endian), payload]``; each payload goes straight to
:meth:`PrefixIndex.apply_vllm_events` (decoded and applied in Rust, no per-event Python objects).

Engines that bind the same endpoint (a fixed port, as llm-d's ``kvEventsConfig.zmqEndpoint``
``tcp://*:5557``, which every vLLM pod connects to) share one SUB socket: each message goes to
the engine whose topic it carries (llm-d's engines publish as ``kv@<pod-ip>@<model>``), so
every engine keeps its own sequence, replay socket and index worker. Such engines need
distinct, non-empty topics; a message with a topic no engine has is counted in
``topic_rejected``. On a shared socket a connection cannot be told apart by engine: its
``connects`` and ``disconnects`` count in the totals only, a new connection asks every member's
replay socket to catch up (with ``catch_up``), and an engine restart is recognised by its
sequence alone (batch 0 again, or a fall of more than ``reorder_window``).

Algorithm (per publisher; ``next`` = the sequence number expected next, ``highest`` = the
highest live sequence number seen since the last restart):

- **In order** (``seq == next``): applied, then every held batch that now follows on.
- **Duplicate** (``seq < next``, or a batch already held): dropped, counted in ``duplicates``.
- **Out of order** (``seq > next``): held in a bounded buffer (``reorder_window`` batches, or
  ``buffer_cap`` while a replay runs). A batch that arrives after a later one is counted in
  ``reordered`` and fills its hole, so reordering within the window costs nothing.
- **Gap**: the hole is still open once more than ``reorder_window`` later batches are held or
  the first of them has waited ``reorder_wait_s``. The engine's replay socket is then asked for
  ``next`` onwards. The replay runs beside the live stream: live batches keep being read (the
  SUB socket is never left to fill up), held in the buffer, and applied as soon as the replay
  closes the hole. A replay that ends short of the hole, stays silent for ``replay_timeout_s``
  (a late or absent answer), or would need more than ``buffer_cap`` held batches
  (or ``buffer_cap_bytes``) is given up: that worker alone is **resynchronised** (its blocks
  cleared, its replay socket replaced, the stream continued from the first batch held). A
  replay socket that failed is not asked again for ``replay_backoff_s`` (doubling up to the
  second value): meanwhile gaps resync at once (``replays_skipped``) instead of holding the
  live stream back behind a socket that does not answer. Without a replay socket a gap always
  resyncs.
- **Restart** (the worker is cleared and the sequence starts over), on any of three signals:
  batch 0 arrives again after the live stream had moved past it (a fresh publisher always
  begins at 0; a batch 0 that only the catch-up replay delivered before may still arrive live,
  and is then a duplicate); the sequence goes back by more than ``reorder_window`` below
  ``highest``; or the first batch after a new connection (a new publisher identity, as ZMQ's
  socket monitor reports it) does not move past ``highest``. A new connection also has to show
  that it continues the sequence: the next replay (a catch-up, or the one a gap asks for)
  starts at the last batch taken, which must come back byte for byte; another batch there, or
  none from there on, is a restart (the new run is then asked for from 0), and a publisher
  that no longer holds it resyncs. On a shared socket any connection puts every member to this
  check, and a member's live stream going back after one asks for it (without a replay
  socket: a restart).
- **Malformed batch** (its payload does not decode): not waited for (a replay sends the same
  bytes), but its events are lost, so the worker is resynchronised as after a gap; counted in
  ``decode_errors`` and ``resyncs``, the first per engine logged (WARNING).

Sockets are polled together by one thread (:meth:`KVEventSubscriber.start`) or one asyncio task
(:meth:`KVEventSubscriber.run`), reading at most :data:`DRAIN_BATCH` messages from a socket
before the others (and the deadlines) get their turn. ZMQ reconnects dropped TCP connections on
its own with exponential backoff (``backoff_s``); a socket that fails is rebuilt with the same
backoff. A bind or connect that fails (the port taken, an address that is not the host's) is
counted in ``socket_errors``, listed by :meth:`KVEventSubscriber.failing_sockets` until it
succeeds, and logged once per endpoint and error (logger ``llmsched``, WARNING: the engines,
the endpoint, the OS error); an endpoint that can never work (a malformed host or port) is
refused by :class:`~llmsched.integrations.EngineSpec` up front.

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
import errno
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmsched import _llmsched
from llmsched._copying import refuse
from llmsched.errors import (
    ConfigError,
    InvalidTypeError,
    MalformedEventError,
    UnknownWorkerError,
)
from llmsched.integrations.identity import EngineSpec, resolve_engines
from llmsched.prefix_index import PrefixIndex
from llmsched.routing import EndpointPool
from llmsched.types import ApplyReport, ReportKey

log = logging.getLogger("llmsched")

__all__ = [
    "COUNTERS",
    "COUNTER_HELP",
    "DEFAULT_BACKOFF_S",
    "DEFAULT_BUFFER_CAP",
    "DEFAULT_BUFFER_CAP_BYTES",
    "DEFAULT_REORDER_WAIT_S",
    "DEFAULT_REORDER_WINDOW",
    "DEFAULT_REPLAY_BACKOFF_S",
    "DEFAULT_REPLAY_TIMEOUT_S",
    "KVEventSubscriber",
    "NativeKVEventSubscriber",
]

DEFAULT_BACKOFF_S = (0.05, 2.0)
"""First and largest delay (seconds) between reconnection attempts."""

DEFAULT_REPLAY_TIMEOUT_S = 2.0
"""How long a replay may stay silent (before its first reply, or between two) before it is
given up and the gap counts as not covered."""

DEFAULT_REPLAY_BACKOFF_S = (10.0, 300.0)
"""First and largest pause (seconds) before a replay socket that failed is asked again."""

DEFAULT_REORDER_WINDOW = 64
"""Later batches held while a hole in the sequence waits to be filled by a late arrival."""

DEFAULT_REORDER_WAIT_S = 0.05
"""How long the first batch after a hole waits for a late arrival before the hole is a gap."""

DEFAULT_BUFFER_CAP = 10_000
"""Live batches held back per engine while a replay runs (vLLM's replay buffer holds 10,000)."""

DEFAULT_BUFFER_CAP_BYTES = 64 * 1024 * 1024
"""Payload bytes held back per engine while a replay runs."""

POLL_INTERVAL_S = 0.02
"""Longest wait between checks of the stop flag, replay deadlines and socket rebuilds."""

DRAIN_BATCH = 1_000
"""Messages read from one socket before the other sockets and the deadlines get their turn."""

RCVHWM = 10_000
"""Messages a SUB socket queues before dropping (vLLM's replay buffer holds 10,000 batches)."""

MAX_MESSAGE_FLOOR = 64 * 1024 * 1024
"""A peer's frame declaring more than the larger of this and ``buffer_cap_bytes`` (a batch the
feed could hold) drops the connection at its header, before anything is allocated (libzmq's
``ZMQ_MAXMSGSIZE``; the native feed's own cap is the same)."""

_END_SEQ = -1  # the replay socket's end marker, a signed 8-byte big-endian -1

MAX_GAP_COUNTED = 1 << 20
"""Most batches one hole adds to ``missed_batches``: a sequence number far ahead (a publisher's
bug) is not a measure of what was lost."""

COUNTER_HELP: dict[str, str] = {
    "batches": "batches applied to the index (live and replayed)",
    "events": "events in the batches applied",
    "blocks_stored": "blocks stored by those events",
    "blocks_removed": "blocks removed by those events",
    "all_cleared": "AllBlocksCleared events applied",
    "unknown_parent": "stored chains whose parent block the index did not know",
    "unknown_removed": "removed blocks the index did not know",
    "gaps": "holes in the sequence not filled within the reorder window",
    "missed_batches": "batches those holes spanned (at most 1,048,576 a hole)",
    "reordered": "live batches that arrived after a later one and filled their hole",
    "duplicates": "live batches dropped because their sequence number was already taken",
    "held_batches": "live batches held back (out of order, or during a replay) before applying",
    "buffer_overflows": "replays given up because the held batches reached the buffer cap",
    "replays": "replays asked for because of a gap",
    "catch_ups": "replays asked for because a publisher (re)connected",
    "replayed_batches": "batches applied from a replay socket's answer",
    "replay_timeouts": "replays given up because they stayed silent for replay_timeout_s",
    "replays_skipped": "gaps resynchronised at once because the replay socket was backing off",
    "resyncs": "times a worker was cleared because batches were lost for good",
    "restarts": "times a publisher started its sequence over (the worker is cleared)",
    "decode_errors": "malformed messages or payloads (skipped); on the native feed also peers "
    "dropped for breaking ZMTP or declaring a message over the cap",
    "topic_rejected": "messages with a foreign topic (refused)",
    "connects": "connections made to (or accepted from) a publisher",
    "disconnects": "connections lost",
    "reconnects": "connections after the first (a new publisher identity)",
    "socket_errors": "socket failures (the socket is rebuilt after a backoff delay); on the "
    "native feed also peers dropped for a handshake not finished in time, or too many peers",
}
"""What each counter counts (see :meth:`KVEventSubscriber.counters`)."""

COUNTERS = tuple(COUNTER_HELP)
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


def _zmq_error_text(exc: zmq.ZMQError) -> str:
    """What a failed bind or connect says, in the native feed's form for an OS error
    (``Address already in use (os error 98)``)."""
    code = exc.errno
    if code is not None and code in errno.errorcode:  # not one of ZMQ's own codes
        return f"{os.strerror(code)} (os error {code})"
    return str(exc.strerror)


class _SocketLog:
    """What both subscribers say about their sockets: a bind or connect that fails is logged
    (logger ``llmsched``, WARNING) once per endpoint and error, naming the engines, the
    endpoint and the OS error, and an endpoint that opens after failing is logged once (INFO).
    The feed retries with its backoff either way; the failures are counted in
    ``socket_errors`` and listed by ``failing_sockets()``. The native feed also reports the
    first peer connection each endpoint drops (``drop``: a protocol violation, a handshake
    that did not finish; counted in ``decode_errors`` or ``socket_errors``), logged as a
    WARNING once per endpoint; the socket is not failing for it. Both report an engine's
    first malformed batch (``malformed``: skipped, the worker resynchronised), and the first
    message on an engine's own socket whose topic is not the engine's (``topic``: refused,
    counted in ``topic_rejected``), each a WARNING."""

    MAX_REMEMBERED = 256
    """Distinct failures remembered as logged (then the memory starts over)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()
        self._recovered: set[str] = set()

    def report(self, workers: list[str], endpoint: str, action: str, error: str | None) -> None:
        """One attempt to open ``endpoint``'s socket (``action``: ``bind`` or ``connect``)
        failed with ``error``, or (None) succeeded after failing; or (``drop``) the socket
        dropped a peer's connection, for the reason ``error``."""
        engines = f"engine{'s' if len(workers) > 1 else ''} {', '.join(workers)}"
        if action in ("malformed", "topic"):
            log.warning("KV events of %s: %s", engines, error)
            return
        if action == "drop":
            log.warning("KV events of %s on %s: %s", engines, endpoint, error)
            return
        with self._lock:
            if error is None:
                first = endpoint not in self._recovered
                self._recovered.add(endpoint)
            else:
                first = (endpoint, error) not in self._logged
                if first and len(self._logged) >= self.MAX_REMEMBERED:
                    self._logged.clear()
                self._logged.add((endpoint, error))
        if error is None:
            if first:
                log.info("KV events of %s: %s %s now succeeds", engines, action, endpoint)
            return
        if first:
            log.warning(
                "KV events of %s: cannot %s %s: %s; retried with backoff (until then the "
                "prefix index knows their cached blocks only from the requests routed there)",
                engines,
                action,
                endpoint,
                error,
            )
        else:
            log.debug("KV events of %s: cannot %s %s: %s", engines, action, endpoint, error)


@dataclasses.dataclass
class _Replay:
    """A replay in progress: where it starts and when it is given up."""

    start: int
    deadline: float
    received: int = 0
    catch_up: bool = False  # asked because the publisher (re)connected, not for a hole
    # The last batch taken, asked for again (``start`` is its number) to show that the
    # publisher behind a new connection continues the sequence: it must come back byte for
    # byte. None once decided.
    verify: tuple[int, bytes] | None = None


class _Publisher:
    """One engine's stream: its sockets and the sequence state machine.

    Every method runs on the subscriber's polling thread (or task); the counters and the
    snapshot read by :meth:`KVEventSubscriber.worker_state` change under the owner's lock.
    """

    def __init__(
        self, owner: KVEventSubscriber, spec: EngineSpec, group: _SharedSocket | None = None
    ) -> None:
        self.owner = owner
        self.spec = spec
        # The shared socket this engine's live stream arrives on (None: its own socket).
        self.group = group
        self.worker = spec.worker_id
        self.topic = spec.topic.encode()
        self.sub: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.bound: str | None = None
        self.retry_at = 0.0
        self.failures = 0
        # Why the last attempt to open the socket failed, while it has not opened since.
        self.failure: str | None = None
        self.next_seq: int | None = None
        self.highest: int | None = None
        self.new_peer = False
        self.peer_highest: int | None = None
        # Whether the live stream delivered a batch since the last restart: until it has, a live
        # batch 0 may be the live copy of one the catch-up replay applied first, not a restart.
        self.live_seen = False
        # Batches after a hole, by seq, waiting for it to be filled (bounded).
        self.held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.held_peak = 0
        self.held_since: float | None = None  # when the current hole was first seen
        self.replay: _Replay | None = None
        self.replay_failures = 0
        self.replay_retry_at = 0.0
        # A catch-up whose replay timed out, asked again once the replay socket's backoff has
        # passed: an idle publisher sends nothing that would show the hole.
        self.catch_up_due = False
        # The payload of the last batch taken (None before any, and after a resync or restart).
        self.last_payload: bytes | None = None
        # A connection was made since the last batch taken in order from the live stream: the
        # next replay starts at the last batch taken, to show the publisher did not start over.
        self.verify = False
        self.malformed_reported = False  # the first malformed batch is logged, not the others
        self.foreign_reported = False  # so is the first message of another topic
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- sockets ------------------------------------------------------------------------------

    def needs_open(self) -> bool:
        """Whether :meth:`open` has sockets to (re)build."""
        if self.group is None:
            return self.sub is None
        return self.dealer is None and self.spec.replay is not None

    def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Create and connect (or bind) the sockets; on failure count it and retry later."""
        if self.group is not None:  # the live stream is the shared socket's
            if self.spec.replay is not None:
                self.dealer = self._new_dealer(ctx)
            return
        endpoint = self.spec.kv_events
        assert endpoint is not None
        sub = ctx.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            _configure_sub(sub, self.owner)
            # Every topic, the others refused below (counted, the first logged): subscribed to
            # the engine's topic alone, a topic set otherwise on the engine left nothing
            # arriving, and nothing said. A vLLM publisher sends one topic, so this costs nothing.
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
            if self.spec.kv_events_bind:
                sub.bind(endpoint)
                self.bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(endpoint)
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(linger=0)
            sub.close(linger=0)
            self.failure = _zmq_error_text(exc)
            self._failed()
            self._report(self.failure)
            return
        self.sub, self.monitor = sub, monitor
        self.failures = 0
        if self.failure is not None:
            self.failure = None
            self._report(None)
        if self.spec.replay is not None:
            self.dealer = self._new_dealer(ctx)

    def _new_dealer(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _max_message(self.owner))
        assert self.spec.replay is not None
        dealer.connect(self.spec.replay)
        return dealer

    def close(self) -> None:
        for sock in (self.monitor, self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.monitor = self.dealer = None
        self.replay = None

    def _report(self, error: str | None) -> None:
        action = "bind" if self.spec.kv_events_bind else "connect"
        assert self.spec.kv_events is not None
        self.owner._socket_log.report([self.worker], self.spec.kv_events, action, error)

    def _failed(self) -> None:
        self.owner._bump(self, "socket_errors")
        backoff_first, backoff_max = self.owner.backoff_s
        delay = min(backoff_max, backoff_first * 2**self.failures)
        self.failures += 1
        self.retry_at = time.monotonic() + delay

    def fail(self) -> None:
        """A socket raised: drop everything and rebuild after a backoff delay."""
        self.close()
        self._failed()

    # -- receiving ----------------------------------------------------------------------------

    def drain_sub(self) -> None:
        assert self.sub is not None
        for _ in range(DRAIN_BATCH):
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
                    # Possibly another process on the same address: its first batch decides.
                    self.new_peer = True
                    self.peer_highest = self.highest
                    self.must_verify()
                # A new connection is a new chance for the replay socket too.
                self.replay_failures = 0
                self.replay_retry_at = 0.0
                self.catch_up_due = False
                if self.owner.catch_up:
                    self.request_catch_up()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.owner._bump(self, "disconnects")

    def drain_dealer(self) -> None:
        for _ in range(DRAIN_BATCH):
            if self.dealer is None:
                return
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
            if not self.foreign_reported:
                self.foreign_reported = True
                shown = topic[:200].decode("utf-8", "replace")
                self.owner._socket_log.report(
                    [self.worker],
                    self.spec.kv_events or "",
                    "topic",
                    f"a message with topic {shown!r} arrived where the engine's topic is "
                    f"{self.spec.topic!r}: refused (counted in topic_rejected; later ones are not "
                    "logged); give the engine spec the topic of the engine's --kv-events-config",
                )
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:  # vLLM numbers batches from 0 as an int64; -1 only ends a replay
            self.owner._bump(self, "decode_errors")
            return
        if self.is_restart(seq):
            self.restart()
        elif self.verify and seq < self.expected() and self.replay is None:
            # A live stream going back after a new connection: a duplicate only if the
            # publisher is the one whose batches were taken, which the replay shows; without
            # one, another process started over.
            if self.dealer is None:
                self.restart()
            elif time.monotonic() >= self.replay_retry_at:
                self.owner._bump(self, "catch_ups")
                self.ask_replay(self.expected())
        self.new_peer = False
        self.live_seen = True
        expected = self.expected()
        if seq < expected or seq in self.held:
            self.owner._bump(self, "duplicates")
            return
        if self.highest is not None and seq < self.highest:
            self.owner._bump(self, "reordered")
        if self.highest is None or seq > self.highest:
            self.highest = seq
        if seq == expected:
            self.verify = False  # the live stream continues where it was
            self.apply(seq, payload)
            self.drain_held()
        else:
            self.hold(seq, payload)

    def expected(self) -> int:
        return 0 if self.next_seq is None else self.next_seq

    def is_restart(self, seq: int) -> bool:
        """The documented restart signals (see the module docstring)."""
        if self.highest is None:
            return False
        if self.new_peer and self.peer_highest is not None and seq <= self.peer_highest:
            return True
        if seq == 0 and self.live_seen and self.next_seq is not None and self.next_seq > 0:
            return True
        return seq < self.highest - self.owner.reorder_window

    def restart(self) -> None:
        """The engine started its sequence over: forget it and whatever replay was running."""
        self.owner._bump(self, "restarts")
        self.catch_up_due = False  # the new run's batches arrive live
        if self.replay is not None:
            self.replay = None
            self._reset_dealer()
        self.drop_held()
        self.clear_worker()
        with self.owner._lock:
            self.next_seq = None
        self.highest = None
        self.live_seen = False
        self.last_payload = None
        self.verify = False

    def must_verify(self) -> None:
        """A new connection: whoever is behind it must show it continues the sequence."""
        self.verify = self.next_seq is not None and self.last_payload is not None

    def started_over(self) -> None:
        """The publisher behind a new connection is not the one whose batches were taken (the
        replay showed another batch where the last one taken was, or none from there on): a
        restart, and its batches are asked for from its start."""
        self.restart()
        if self.dealer is not None:
            self.owner._bump(self, "catch_ups")
            self.ask_replay(0, catch_up=True)

    # -- holding ------------------------------------------------------------------------------

    def hold(self, seq: int, payload: bytes) -> None:
        """Keep a batch that arrived after a hole until the hole is filled, within the caps.

        A batch that would pass a cap ends the wait: the replay (if any) is given up and every
        held batch is applied, each remaining hole resynchronised."""
        owner = self.owner
        over = len(self.held) >= owner.buffer_cap or (
            self.held_bytes + len(payload) > owner.buffer_cap_bytes
        )
        if over:
            owner._bump(self, "buffer_overflows")
            self.give_up_replay()
            while self.held:
                self.resync_to_held()
            if seq < self.expected():
                owner._bump(self, "duplicates")  # its hole was given up on
                return
            if seq == self.expected() or len(payload) > owner.buffer_cap_bytes:
                if seq > self.expected():
                    self.resync(seq)
                self.apply(seq, payload)
                return
        self.held[seq] = payload
        self.held_bytes += len(payload)
        with owner._lock:
            self.counts["held_batches"] += 1
            owner._totals["held_batches"] += 1
            self.held_peak = max(self.held_peak, len(self.held))
        if self.held_since is None:
            self.held_since = time.monotonic()
        if self.replay is None and len(self.held) > owner.reorder_window:
            self.gap()

    def drop_held(self) -> None:
        self.held.clear()
        self.held_bytes = 0
        self.held_since = None

    def drain_held(self) -> None:
        """Apply the held batches that now follow on; a hole that stays starts a new wait."""
        progressed = False
        while self.held and self.expected() in self.held:
            seq = self.expected()
            payload = self.held.pop(seq)
            self.held_bytes -= len(payload)
            self.apply(seq, payload)
            progressed = True
        if not self.held:
            self.held_since = None
        elif progressed or self.held_since is None:
            self.held_since = time.monotonic()

    def lose_before(self, target: int) -> None:
        """Batches before ``target`` that are neither applied nor held are lost for good:
        resynchronise at each such hole and apply what is held up to ``target``."""
        while self.expected() < target:
            below = [s for s in self.held if s < target]
            first = min(below) if below else target
            if first > self.expected() or self.next_seq is None:
                self.resync(first)
            self.drain_held()
            if not below:
                return

    def resync_to_held(self) -> None:
        """The hole before the first held batch is lost for good: resync and go on from it."""
        if self.held:
            self.lose_before(min(self.held))

    # -- gaps and replays ---------------------------------------------------------------------

    def check_timers(self, now: float) -> None:
        """Give up an overdue replay; ask again for a catch-up that timed out once its backoff
        has passed; declare a hole that waited too long a gap."""
        if self.replay is not None:
            if now >= self.replay.deadline:
                catch_up = self.replay.catch_up
                self.owner._bump(self, "replay_timeouts")
                self.give_up_replay()
                self.resync_to_held()
                self.catch_up_due = catch_up
        elif self.catch_up_due and now >= self.replay_retry_at:
            self.catch_up_due = False
            self.request_catch_up()
        elif self.held_since is not None and now - self.held_since >= self.owner.reorder_wait_s:
            self.gap()

    def gap(self) -> None:
        """The hole before the first held batch will not be filled by a late arrival."""
        expected = self.expected()
        self.owner._bump(self, "gaps")
        self.owner._bump(self, "missed_batches", min(min(self.held) - expected, MAX_GAP_COUNTED))
        if self.dealer is None:
            self.resync_to_held()
        elif time.monotonic() < self.replay_retry_at:
            self.owner._bump(self, "replays_skipped")
            self.resync_to_held()
        else:
            self.owner._bump(self, "replays")
            self.ask_replay(expected)

    def request_catch_up(self) -> None:
        """A publisher (re)connected: ask its replay socket for every batch after the last one
        applied, so what it sent while nobody listened arrives now rather than when its next
        live batch reveals the gap (an idle engine may not send one for a long time)."""
        if self.dealer is None or self.replay is not None:
            return
        self.owner._bump(self, "catch_ups")
        self.ask_replay(self.expected(), catch_up=True)

    def ask_replay(self, start: int, *, catch_up: bool = False) -> None:
        """Ask the replay socket for every batch from ``start`` (``catch_up``: because the
        publisher connected, not for a hole); live batches are held meanwhile. While a new
        connection's continuity is still to be shown (``verify``), from the last batch taken."""
        assert self.dealer is not None
        deadline = time.monotonic() + self.owner.replay_timeout_s
        verify: tuple[int, bytes] | None = None
        if (
            self.verify
            and self.last_payload is not None
            and self.next_seq is not None
            and self.next_seq > 0
            and start == self.next_seq
        ):
            start -= 1
            verify = (start, self.last_payload)
        self.replay = _Replay(start, deadline, catch_up=catch_up, verify=verify)
        # The ROUTER expects [identity, empty delimiter, start seq]; the DEALER adds the identity.
        # Never blocking: a DEALER with no peer to take the request would hold this thread
        # (and its stop) until one connects. A request not taken goes unanswered and the
        # replay times out, as on the native feed, whose request waits for the connection.
        with contextlib.suppress(zmq.Again):
            self.dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)

    def give_up_replay(self) -> None:
        """Abandon the replay in progress (if any); the replay socket backs off."""
        if self.replay is None:
            return
        self.replay = None
        self._reset_dealer()
        first, largest = self.owner.replay_backoff_s
        delay = min(largest, first * 2 ** min(self.replay_failures, 32))
        self.replay_failures += 1
        self.replay_retry_at = time.monotonic() + delay

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
        self.replay.received += 1
        if self.replay.verify is not None:
            verify_seq, taken = self.replay.verify
            if seq == verify_seq:
                self.replay.verify = None
                self.replay.deadline = time.monotonic() + self.owner.replay_timeout_s
                if payload == taken:
                    self.verify = False  # the same publisher: its sequence goes on
                else:
                    self.started_over()
                return
            if seq > verify_seq:
                # The publisher no longer holds the last batch taken: whether it started over
                # cannot be shown, so what the worker holds is not trusted.
                self.replay.verify = None
                self.verify = False
                if seq == self.expected():
                    self.resync(seq)  # (further on, lose_before resyncs)
        if seq < self.expected():
            # Applied already (from the live stream or this replay), or not a batch number
            # (counted): no progress, so it does not keep the replay alive (one answering only
            # such replies would hold the live stream until the buffer caps).
            if seq < 0:
                self.owner._bump(self, "decode_errors")
            return
        # A replay that keeps answering is not late: its deadline runs from its last useful
        # reply.
        self.replay.deadline = time.monotonic() + self.owner.replay_timeout_s
        if seq > self.expected():
            self.lose_before(seq)  # the engine no longer holds what lies before it
            if seq < self.expected():
                return  # its live copy was held and is applied now
        self.apply(seq, payload, replayed=True)
        self.drain_held()

    def finish_replay(self) -> None:
        """The replay ended and so answered: the socket is trusted again. A hole it left
        where it started is lost for good (resync); a later one waits as any new hole."""
        replay = self.replay
        assert replay is not None
        self.replay = None
        self.replay_failures = 0
        if replay.verify is not None:
            # Nothing from the last batch taken on: the publisher's sequence is behind it.
            self.started_over()
            return
        if self.held and self.expected() <= replay.start:
            self.resync_to_held()

    def resync(self, seq: int) -> None:
        """Batches before ``seq`` are lost for good: clear the worker, continue at ``seq``."""
        self.owner._bump(self, "resyncs")
        self.clear_worker()
        with self.owner._lock:
            self.next_seq = seq
        self.last_payload = None
        self.verify = False

    def _reset_dealer(self) -> None:
        # Replies to an abandoned request may still arrive; a fresh socket never sees them.
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = self._new_dealer(self.owner._ctx_for_dealers())

    def clear_worker(self) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.owner.index.clear(self.worker)

    def apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        if self.highest is None or seq > self.highest:
            self.highest = seq
        try:
            report = self.owner.index.apply_vllm_events(self.worker, payload)
        except MalformedEventError as exc:
            # Not waited for (a replay sends the same bytes), but its events are lost: the
            # worker is resynchronised as after any batch lost for good.
            self.owner._bump(self, "decode_errors")
            if not self.malformed_reported:
                self.malformed_reported = True
                self.owner._socket_log.report(
                    [self.worker],
                    self.spec.kv_events or "",
                    "malformed",
                    f"batch {seq} is malformed and skipped ({exc}); the worker is "
                    "resynchronised (counted in decode_errors and resyncs; later ones are not "
                    "logged)",
                )
            self.resync(seq + 1)
            self.last_payload = payload
            return
        self.last_payload = payload
        # The sequence number moves with the counters, after the index: whoever sees
        # `last_seq` reach a batch also sees its blocks and its counts.
        self.owner._count_batch(self, seq, report, replayed)


def _max_message(owner: KVEventSubscriber) -> int:
    return max(MAX_MESSAGE_FLOOR, owner.buffer_cap_bytes)


def _configure_sub(sub: zmq.Socket[bytes], owner: KVEventSubscriber) -> None:
    """The options every SUB socket of ``owner`` gets (before it connects or binds)."""
    backoff_first, backoff_max = owner.backoff_s
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, RCVHWM)
    sub.setsockopt(zmq.MAXMSGSIZE, _max_message(owner))
    sub.setsockopt(zmq.RECONNECT_IVL, max(1, round(backoff_first * 1000)))
    sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, round(backoff_max * 1000)))


class _SharedSocket:
    """One bound SUB socket several engines publish to, split by topic."""

    def __init__(self, owner: KVEventSubscriber, endpoint: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.members: dict[bytes, _Publisher] = {}
        self.sub: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.bound: str | None = None
        self.retry_at = 0.0
        self.failures = 0
        self.failure: str | None = None  # as _Publisher.failure

    def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        sub = ctx.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            _configure_sub(sub, self.owner)
            for topic in self.members:
                sub.setsockopt(zmq.SUBSCRIBE, topic)
            monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
            sub.bind(self.endpoint)
            self.bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(linger=0)
            sub.close(linger=0)
            self.failure = _zmq_error_text(exc)
            self._failed()
            self._report(self.failure)
            return
        self.sub, self.monitor = sub, monitor
        self.failures = 0
        if self.failure is not None:
            self.failure = None
            self._report(None)

    def _report(self, error: str | None) -> None:
        workers = [member.worker for member in self.members.values()]
        self.owner._socket_log.report(workers, self.endpoint, "bind", error)

    def close(self) -> None:
        for sock in (self.monitor, self.sub):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.monitor = None

    def _failed(self) -> None:
        self.owner._bump_total("socket_errors")
        backoff_first, backoff_max = self.owner.backoff_s
        delay = min(backoff_max, backoff_first * 2**self.failures)
        self.failures += 1
        self.retry_at = time.monotonic() + delay

    def fail(self) -> None:
        self.close()
        self._failed()

    def drain_sub(self) -> None:
        assert self.sub is not None
        for _ in range(DRAIN_BATCH):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            member = self.members.get(frames[0]) if frames else None
            if member is None:
                if len(frames) == 3 and len(frames[1]) == 8:
                    self.owner._bump_total("topic_rejected")
                else:
                    self.owner._bump_total("decode_errors")
                continue
            member.on_live(frames)

    def drain_monitor(self) -> None:
        assert self.monitor is not None
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.owner._bump_total("connects")
                for member in self.members.values():
                    member.must_verify()  # the connection may be any member's
                    member.replay_failures = 0
                    member.replay_retry_at = 0.0
                    member.catch_up_due = False
                    if self.owner.catch_up:
                        member.request_catch_up()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.owner._bump_total("disconnects")


class KVEventSubscriber:
    """Keeps ``index`` current from the KV events of ``engines``.

    Args:
        index: the prefix index to feed (worker names are the engines' worker ids).
        engines: the engines; those without ``kv_events`` are skipped.
        pool: the router's endpoint pool, if any: an unnamed engine at the address of one of
            its endpoints feeds that endpoint's worker
            (:func:`~llmsched.integrations.resolve_engines`), as the metrics scraper does.
        backoff_s: first and largest delay between reconnection attempts (exponential).
        replay_timeout_s: how long a replay may stay silent (before its first reply or between
            two) before it is given up and the worker resynchronised.
        replay_backoff_s: first and largest pause before a replay socket that timed out (or
            was overtaken by the buffer cap) is asked again (doubling; an answered replay or a
            new connection resets it). Gaps meanwhile resync at once.
        reorder_window: later batches held while a hole waits for a late arrival; a batch more
            than this far below the highest one seen is an engine restart. 0 turns reordering
            tolerance off (every hole is a gap at once).
        reorder_wait_s: how long a hole waits for a late arrival before it is a gap.
        buffer_cap: most batches held per engine (during a replay, or a reorder wait); one more
            gives the replay up (``buffer_overflows``) and resyncs the worker.
        buffer_cap_bytes: the same cap in payload bytes. A peer's frame declaring more than
            the larger of this and 64 MiB (:data:`MAX_MESSAGE_FLOOR`) drops its connection at
            the frame's header, before anything is allocated (counted in ``disconnects``).
        catch_up: when a publisher connects (or reconnects), ask its replay socket at once for
            the batches after the last one applied (counted in ``catch_ups``), instead of
            waiting for its next live batch to show the gap; a catch-up that times out is asked
            again once the replay socket's backoff has passed. Off by default: then the only
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
        replay_backoff_s: tuple[float, float] = DEFAULT_REPLAY_BACKOFF_S,
        reorder_window: int = DEFAULT_REORDER_WINDOW,
        reorder_wait_s: float = DEFAULT_REORDER_WAIT_S,
        buffer_cap: int = DEFAULT_BUFFER_CAP,
        buffer_cap_bytes: int = DEFAULT_BUFFER_CAP_BYTES,
        catch_up: bool = False,
        pool: EndpointPool | None = None,
    ) -> None:
        if pool is not None:
            engines = resolve_engines(engines, pool)
        if not isinstance(index, PrefixIndex):
            raise InvalidTypeError(f"index must be a PrefixIndex, got {type(index).__name__}")
        options = _checked_options(
            backoff_s,
            replay_timeout_s,
            replay_backoff_s,
            reorder_window,
            reorder_wait_s,
            buffer_cap,
            buffer_cap_bytes,
            catch_up,
        )
        self.replay_timeout_s: float = options["replay_timeout_s"]
        self.reorder_wait_s: float = options["reorder_wait_s"]
        self.reorder_window: int = options["reorder_window"]
        self.buffer_cap: int = options["buffer_cap"]
        self.buffer_cap_bytes: int = options["buffer_cap_bytes"]
        self.index = index
        self.backoff_s: tuple[float, float] = options["backoff_s"]
        self.replay_backoff_s: tuple[float, float] = options["replay_backoff_s"]
        self.catch_up: bool = options["catch_up"]
        self._publishers: dict[str, _Publisher] = {}
        self._shared: dict[str, _SharedSocket] = {}
        self._socket_log = _SocketLog()
        seen_endpoints: dict[str, str] = {}
        listed = list(engines)
        for spec in listed:
            if not isinstance(spec, EngineSpec):
                raise InvalidTypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
        # Engines binding the same fixed endpoint share one socket, split by topic.
        binds: dict[str, list[EngineSpec]] = {}
        for spec in listed:
            if spec.kv_events is not None and spec.kv_events_bind and _fixed_port(spec.kv_events):
                binds.setdefault(spec.kv_events, []).append(spec)
        for endpoint, members in binds.items():
            if len(members) > 1:
                self._shared[endpoint] = _SharedSocket(self, endpoint)
        for spec in listed:
            if spec.kv_events is None:
                continue
            if spec.worker_id in self._publishers:
                raise ConfigError(f"engine {spec.worker_id} is listed twice")
            group = self._shared.get(spec.kv_events) if spec.kv_events_bind else None
            if group is not None:
                topic = spec.topic.encode()
                if not topic:
                    raise ConfigError(
                        f"engine {spec.worker_id} binds the shared KV-event endpoint "
                        f"{spec.kv_events} without a topic; engines sharing an endpoint are "
                        "told apart by topic (vLLM's --kv-events-config topic, llm-d's "
                        "kv@<pod-ip>@<model>)"
                    )
                if topic in group.members:
                    raise ConfigError(
                        f"engines {group.members[topic].worker} and {spec.worker_id} bind the "
                        f"KV-event endpoint {spec.kv_events} with the same topic {spec.topic!r}; "
                        "each needs its own"
                    )
                publisher = _Publisher(self, spec, group)
                group.members[topic] = publisher
                self._publishers[spec.worker_id] = publisher
                continue
            if spec.kv_events in seen_endpoints and "*" not in spec.kv_events:
                raise ConfigError(
                    f"engines {seen_endpoints[spec.kv_events]} and {spec.worker_id} share the "
                    f"KV-event endpoint {spec.kv_events}; each publisher needs its own (or the "
                    "subscriber binds it: kv_events_bind, with a topic for each)"
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

    def _bump_total(self, key: str, n: int = 1) -> None:
        """A count no single engine owns (a shared socket's connections, foreign topics)."""
        with self._lock:
            self._totals[key] += n
            self._changed.notify_all()

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
        """Totals over every engine, a consistent copy; every key of :data:`COUNTERS` is there
        and only goes up. :data:`COUNTER_HELP` says what each one counts:

        - applied: ``batches``, ``replayed_batches`` (of those, from a replay), ``events``,
          ``blocks_stored``, ``blocks_removed``, ``all_cleared``, ``unknown_parent``,
          ``unknown_removed``;
        - sequence: ``gaps`` and ``missed_batches``, ``reordered``, ``duplicates``,
          ``held_batches``, ``buffer_overflows``, ``restarts``;
        - replay: ``replays``, ``catch_ups``, ``replay_timeouts``, ``replays_skipped``,
          ``resyncs``;
        - wire: ``decode_errors``, ``topic_rejected``, ``connects``, ``disconnects``,
          ``reconnects``, ``socket_errors``.
        """
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

    def worker_state(self, worker: str) -> dict[str, Any]:
        """Where ``worker``'s stream stands: ``next_seq`` (expected next; None before any),
        ``highest_seq`` (highest seen since the last restart), ``held`` and ``held_bytes``
        (batches held back now), ``held_peak`` (the most ever held at once, never above
        ``buffer_cap``), ``replaying`` (a replay is in progress) and ``replay_backoff_s``
        (seconds before a failed replay socket is asked again; 0 when it may be asked)."""
        pub = self._publisher(worker)
        with self._lock:
            return {
                "next_seq": pub.next_seq,
                "highest_seq": pub.highest,
                "held": len(pub.held),
                "held_bytes": pub.held_bytes,
                "held_peak": pub.held_peak,
                "replaying": pub.replay is not None,
                "replay_backoff_s": max(0.0, pub.replay_retry_at - time.monotonic()),
            }

    def bound_endpoint(self, worker: str) -> str | None:
        """The endpoint actually bound for ``worker`` (a ``*`` port resolved; the shared
        socket's for an engine on one), once started; None for an engine the subscriber
        connects to."""
        pub = self._publisher(worker)
        return pub.bound if pub.group is None else pub.group.bound

    def failing_sockets(self) -> dict[str, str]:
        """The sockets whose last bind or connect failed and that have not opened since, by
        endpoint (as configured): what the OS or ZMQ said. They are retried with the backoff
        (``backoff_s``); each failure counts in ``socket_errors`` and is logged once per
        endpoint and error (logger ``llmsched``, WARNING)."""
        failing: dict[str, str] = {}
        for group in self._shared.values():
            if group.failure is not None:
                failing[group.endpoint] = group.failure
        for pub in self._publishers.values():
            if pub.group is None and pub.failure is not None and pub.spec.kv_events is not None:
                failing[pub.spec.kv_events] = pub.failure
        return failing

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
        for group in self._shared.values():
            group.open(self._ctx)
        for pub in self._publishers.values():
            pub.open(self._ctx)

    def _close_all(self) -> None:
        for group in self._shared.values():
            group.close()
            group.failure = None
        for pub in self._publishers.values():
            pub.close()
            pub.failure = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._running = False

    def _maintain(self) -> list[zmq.Socket[bytes]]:
        """Rebuild failed sockets whose backoff has passed, give up overdue replays, turn holes
        that waited too long into gaps, and return the sockets to poll."""
        now = time.monotonic()
        sockets: list[zmq.Socket[bytes]] = []
        for group in self._shared.values():
            if group.sub is None and now >= group.retry_at:
                group.open(self._ctx_for_dealers())
            sockets.extend(s for s in (group.sub, group.monitor) if s is not None)
        for pub in self._publishers.values():
            if pub.needs_open() and now >= pub.retry_at:
                pub.open(self._ctx_for_dealers())
            pub.check_timers(now)
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
        for group in self._shared.values():
            try:
                if group.monitor is not None and group.monitor in ready:
                    group.drain_monitor()
                if group.sub is not None and group.sub in ready:
                    group.drain_sub()
            except zmq.ZMQError:
                group.fail()

    def __repr__(self) -> str:
        c = self.counters()
        return (
            f"KVEventSubscriber({len(self._publishers)} engines, batches={c['batches']}, "
            f"gaps={c['gaps']}, resyncs={c['resyncs']})"
        )


class _SkippedEvents:
    """What the native feed calls for a batch with skipped stored events, or engine hashes
    stored again with other content: the index's counts (and warnings) by cause, as
    :meth:`PrefixIndex.apply_vllm_events` keeps them."""

    __slots__ = ("_index",)

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def note(
        self,
        worker: str,
        block_size_mismatch: int,
        extra_keys: int,
        multimodal: int,
        replaced: int = 0,
    ) -> None:
        if replaced:  # counted by the index as it applied the batch: the warning alone
            self._index.note_replaced_engine_blocks(worker, replaced)
        if block_size_mismatch:
            self._index.note_block_size_mismatch(worker, block_size_mismatch)
        if extra_keys:
            self._index.note_extra_keys(worker, extra_keys)
        if multimodal:
            self._index.note_multimodal(worker, multimodal)


class NativeKVEventSubscriber:
    """:class:`KVEventSubscriber` in Rust: the same engines, options, counters and rules (the
    module docstring's algorithm), with no Python per batch. The sockets are llmsched's own
    ZMTP 3.x (TCP, NULL mechanism), on a tokio runtime on a thread of the feed's own: a peer
    declaring a message over the larger of 64 MiB and ``buffer_cap_bytes``, sending a bad
    greeting or not finishing its handshake within 2 s is dropped and counted
    (``decode_errors`` / ``socket_errors``), the others unaffected; each batch is
    decoded and applied to ``index`` in Rust (``llmsched_gateway::kv_events``). ``llmsched
    serve`` runs it on the native data plane.

    What differs: there is no :meth:`KVEventSubscriber.run` (the feed always has its thread);
    a connecting socket probes its endpoint over TCP with the ``backoff_s`` backoff before it
    connects (libzmq connects lazily), and a lost connection is re-made with ``backoff_s``
    too; a peer that breaks ZMTP, or does not finish its handshake within 2 s once the
    endpoint answers, is dropped and counted (a decode or socket error) where libzmq drops it
    unnoticed. A batch whose stored events were skipped for their block size reaches
    :meth:`~llmsched.PrefixIndex.note_block_size_mismatch`, one whose events were skipped for
    their extra keys :meth:`~llmsched.PrefixIndex.note_extra_keys` or
    :meth:`~llmsched.PrefixIndex.note_multimodal` (counted, and the first two warned once,
    as with :meth:`~llmsched.PrefixIndex.apply_vllm_events`), one that stored engine hashes
    again with other content :meth:`~llmsched.PrefixIndex.note_replaced_engine_blocks`
    (counted by the index, warned once), a failure to open a socket reaches
    the log as :meth:`KVEventSubscriber.failing_sockets` says, and so does an engine's first
    malformed batch; those are the only calls into Python, and only under such a fault.

    >>> import msgpack
    >>> import zmq
    >>> from llmsched import PrefixIndex
    >>> from llmsched.integrations import EngineSpec
    >>> index = PrefixIndex(block_size=4)
    >>> spec = EngineSpec("127.0.0.1", 8000, kv_events="tcp://127.0.0.1:*", kv_events_bind=True)
    >>> with NativeKVEventSubscriber(index, [spec]) as sub:
    ...     while sub.bound_endpoint(spec.worker_id) is None:
    ...         time.sleep(0.01)
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

    def __init__(
        self,
        index: PrefixIndex,
        engines: Iterable[EngineSpec],
        *,
        backoff_s: tuple[float, float] = DEFAULT_BACKOFF_S,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_backoff_s: tuple[float, float] = DEFAULT_REPLAY_BACKOFF_S,
        reorder_window: int = DEFAULT_REORDER_WINDOW,
        reorder_wait_s: float = DEFAULT_REORDER_WAIT_S,
        buffer_cap: int = DEFAULT_BUFFER_CAP,
        buffer_cap_bytes: int = DEFAULT_BUFFER_CAP_BYTES,
        catch_up: bool = False,
        pool: EndpointPool | None = None,
    ) -> None:
        if pool is not None:
            engines = resolve_engines(engines, pool)
        if not isinstance(index, PrefixIndex):
            raise InvalidTypeError(f"index must be a PrefixIndex, got {type(index).__name__}")
        options = _checked_options(
            backoff_s,
            replay_timeout_s,
            replay_backoff_s,
            reorder_window,
            reorder_wait_s,
            buffer_cap,
            buffer_cap_bytes,
            catch_up,
        )
        listed = list(engines)
        for spec in listed:
            if not isinstance(spec, EngineSpec):
                raise InvalidTypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
        subscribed = [
            (spec.worker_id, spec.kv_events, spec.kv_events_bind, spec.replay, spec.topic)
            for spec in listed
            if spec.kv_events is not None
        ]
        self.index = index
        self._socket_log = _SocketLog()
        # Checked (the engine set, the endpoints, the caps against the window) by the native
        # side too.
        self._native = _llmsched.NativeKVEventSubscriber(
            index.native,
            subscribed,
            json.dumps(options),
            _SkippedEvents(index).note,
            self._socket_log.report,
        )

    def start(self) -> None:
        """Starts the feed's thread (RuntimeError when it runs already)."""
        self._native.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stops the thread and closes every socket (``timeout`` is accepted for
        :meth:`KVEventSubscriber.stop`'s signature; the native thread stops within a few
        milliseconds)."""
        self._native.stop()

    @property
    def running(self) -> bool:
        """Whether the feed's thread runs."""
        return self._native.running

    def __enter__(self) -> NativeKVEventSubscriber:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def counters(self) -> dict[str, int]:
        """Totals over every engine (:meth:`KVEventSubscriber.counters`' keys)."""
        return self._native.counters()

    def worker_counters(self, worker: str) -> dict[str, int]:
        """:meth:`counters` for one engine; KeyError for an unknown worker."""
        return self._native.worker_counters(worker)

    def last_seq(self, worker: str) -> int | None:
        """The sequence number of the last batch taken from ``worker`` (None before any)."""
        return self._native.last_seq(worker)

    def worker_state(self, worker: str) -> dict[str, Any]:
        """Where ``worker``'s stream stands (:meth:`KVEventSubscriber.worker_state`'s keys)."""
        return self._native.worker_state(worker)

    def bound_endpoint(self, worker: str) -> str | None:
        """The endpoint bound for ``worker`` once bound (a ``*`` port resolved); None for an
        engine the feed connects to, or before its socket is bound."""
        return self._native.bound_endpoint(worker)

    def failing_sockets(self) -> dict[str, str]:
        """:meth:`KVEventSubscriber.failing_sockets`: the sockets whose last bind or connect
        failed, by endpoint, with what the OS or ZMQ said (logged as there); a connecting
        socket whose peer answers TCP but fails the ZMTP handshake (an engine's HTTP port, say)
        is failing too, until a handshake succeeds."""
        return dict(self._native.failing_sockets())

    def workers(self) -> list[str]:
        """The worker ids subscribed to."""
        return self._native.workers()

    def wait_for(
        self, condition: Callable[[dict[str, int]], bool], timeout: float | None = None
    ) -> bool:
        """Blocks until ``condition(counters())`` holds (True) or ``timeout`` passes (False);
        the GIL is released while waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        while not condition(self.counters()):
            left = POLL_INTERVAL_S * 50 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            seen = self._native.wait_changed(seen, left)
        return True

    def __repr__(self) -> str:
        c = self.counters()
        return (
            f"NativeKVEventSubscriber({len(self.workers())} engines, batches={c['batches']}, "
            f"gaps={c['gaps']}, resyncs={c['resyncs']})"
        )


def _checked_options(
    backoff_s: object,
    replay_timeout_s: object,
    replay_backoff_s: object,
    reorder_window: object,
    reorder_wait_s: object,
    buffer_cap: object,
    buffer_cap_bytes: object,
    catch_up: object,
) -> dict[str, Any]:
    """Both subscribers' options, checked (ConfigError naming the option), by name."""
    options: dict[str, Any] = {
        "backoff_s": _check_backoff("backoff_s", backoff_s),
        "replay_timeout_s": _positive_float("replay_timeout_s", replay_timeout_s),
        "replay_backoff_s": _check_backoff("replay_backoff_s", replay_backoff_s),
        "reorder_window": _int_at_least("reorder_window", reorder_window, 0),
        "reorder_wait_s": _positive_float("reorder_wait_s", reorder_wait_s),
        "buffer_cap": _int_at_least("buffer_cap", buffer_cap, 1),
        "buffer_cap_bytes": _int_at_least("buffer_cap_bytes", buffer_cap_bytes, 1),
        "catch_up": catch_up,
    }
    if options["buffer_cap"] <= options["reorder_window"]:
        raise ConfigError(
            f"buffer_cap ({options['buffer_cap']}) must be larger than reorder_window "
            f"({options['reorder_window']}): the reorder wait holds that many batches"
        )
    if not isinstance(catch_up, bool):
        raise ConfigError(f"catch_up must be a bool, got {catch_up!r}")
    return options


def _fixed_port(endpoint: str) -> bool:
    """Whether a bound endpoint names its port (``tcp://*:5557``), not ``*`` (any free port,
    one socket per engine) or a non-TCP transport with its own path."""
    return not endpoint.endswith(":*")


def _check_backoff(name: str, backoff_s: object) -> tuple[float, float]:
    ok = (
        isinstance(backoff_s, tuple)
        and len(backoff_s) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in backoff_s)
        and 0 < backoff_s[0] <= backoff_s[1]
        and math.isfinite(backoff_s[1])
    )
    if not ok:
        raise ConfigError(
            f"{name} must be (first, largest) with 0 < first <= largest, got {backoff_s!r}"
        )
    assert isinstance(backoff_s, tuple)
    return float(backoff_s[0]), float(backoff_s[1])


def _positive_float(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value > 0 and math.isfinite(value))
    ):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _int_at_least(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
    return value


refuse(
    KVEventSubscriber,
    "start one subscriber per process, on its own index",
    name="llmsched.integrations.KVEventSubscriber",
)
refuse(
    NativeKVEventSubscriber,
    "start one subscriber per process, on its own index",
    name="llmsched.integrations.NativeKVEventSubscriber",
)
