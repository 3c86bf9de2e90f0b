"""Router replicas that act as one, over NATS.

Several router replicas in front of the same engines each see only their own requests. Left
alone they herd (between two scrapes each sends its next requests to the engine that looks idle
to it) and a prompt one replica routed is unknown to the others until the engine's KV events
arrive. :class:`ClusterSync` shares, over a NATS subject, what a replica learns that the others
need:

* the approximate prefix record of every request it sends (the others record it too, with the
  same TTL, so a follow-up turn that reaches another replica finds the engine that has it);
* session bindings (``session_id`` affinity holds whichever replica a turn reaches);
* its in-flight requests and tokens per engine, which the others add to their own counts.

Precise prefix state is not shared: every replica subscribes to every engine's KV events.

Why NATS: fan-out publish/subscribe with no broker-side state to manage, sub-millisecond
delivery on a LAN, a request/reply primitive for catch-up, and it is the bus NVIDIA Dynamo's KV
router uses to keep its replicas in step. What travels is idempotent (a record or a session
applied twice changes nothing) and counts are absolute per replica, so at-most-once delivery is
enough: a lost batch is healed by the next, and a replica that dies stops counting once its
counts expire (``load_ttl_s``). Nothing needs persistence, so no JetStream.

Batching: commits are journaled in the native core; every ``flush_s`` (5 ms) one batch carries
the journal and the replica's counts, and nothing is sent while nothing changed, except a
heartbeat every ``heartbeat_s``; a journal larger than the server's message limit goes out as
several batches. A replica that connects asks its peers for a catch-up on
``<subject>.catchup``, saying how far it has each peer's batches: each answers only its own
records and sessions past that (all of them, younger than their TTL, to a replica it is new
to), so a short blip costs what was routed during it, not the peers' whole history. A
replica that knew no peer then asks one peer for the sessions and records no answering peer
owns (a departed replica's): each arrives once. A gap in a peer's batches asks that peer alone
for the rest. The pieces of an answer are numbered (message headers): an answer missing one
is not taken (its last piece, which moves the cursor, is held back) and that peer is asked
again, twice at most (``catch_up_re_asks``); so is a peer whose answer did not come at all (a
catch-up answer or a repair's lost whole, ``catch_ups_unanswered``), and a repair still
unanswered is given up (``repairs_unanswered``) so that the next batch showing the gap asks
again. While the bus is unreachable the replica routes on its own, exactly as without sync:
batches are dropped and counted, peers' counts expire, and nothing raises; when the bus
returns its peers see the gap in its batches and ask it for what it routed meanwhile. Replica
names must be unique: two live replicas with one name are counted (``identity_conflicts``),
listed (``shared_names``) and warned about once, as soon as the older one speaks again after
the newer one did; a late batch of a restarted replica's previous life is dropped
(``stale_in``).

>>> from llmsched import EndpointPool, PrefixIndex, Router
>>> router = Router(EndpointPool(["a", "b"]), PrefixIndex(block_size=16), config="llm-d")
>>> sync = ClusterSync(router, servers="nats://127.0.0.1:4222", replica="gw-0")
>>> sync.stats()["connected"]
False

Run it with ``await sync.start()`` beside the router (it connects in the background and keeps
reconnecting), and ``await sync.stop()`` at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import quote, unquote

from llmsched._aio import settled
from llmsched._extras import require
from llmsched.errors import ConfigError, InvalidTypeError, MalformedSyncBatchError
from llmsched.routing import Router
from llmsched.types import SyncCounters
from llmsched.validation import check_int, check_positive_seconds

require("cluster", "nats", feature="llmsched.cluster")

import nats  # noqa: E402
from nats.errors import Error as NatsError  # noqa: E402

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

__all__ = ["ClusterStats", "ClusterSync", "ConnectionCounters", "Usage"]

log = logging.getLogger("llmsched")


class ConnectionCounters(TypedDict):
    """The bus connection's counters of a :class:`ClusterSync`."""

    disconnects: int
    reconnects: int
    publish_failures: int
    """Batches that could not be published (bus down): their entries are lost, counts heal."""
    catch_ups: int
    """Catch-up batches applied (a late start or a reconnect)."""
    catch_ups_served: int
    catch_up_pieces_lost: int
    """Pieces of peers' catch-up answers that never arrived (the numbering showed the hole)."""
    catch_up_re_asks: int
    """Requests sent again to one peer because its answer was not whole."""
    catch_ups_incomplete: int
    """Answers still not whole after the re-asks: what they missed stays missing."""
    catch_ups_unanswered: int
    """Answers that did not come at all within ``catch_up_timeout_s`` (a peer's whole answer
    to a catch-up, or the answer to a repair, lost on the way): that peer is asked again
    alone, twice at most (counted in ``catch_up_re_asks``)."""
    usage_out: int
    """Usage messages published (rate-limit and fairness counters)."""
    usage_in: int
    usage_malformed: int


class ClusterStats(SyncCounters, ConnectionCounters):
    """:meth:`ClusterSync.stats`: the native counters plus the bus connection's."""

    replica: str
    connected: bool
    peers: list[str]
    """Replicas heard from within ``load_ttl_s``."""
    shared_names: list[str]
    """Names that more than one live replica uses (this replica's own included): each replica
    needs a name of its own (see ``identity_conflicts``)."""


class Usage(TypedDict):
    """What a replica consumed since its last flush, for the others to charge (see
    :meth:`ClusterSync.share_usage`)."""

    keys: dict[str, tuple[float, float]]
    """Per rate-limited key (an id all replicas share, never the key itself): requests and
    tokens taken from its buckets."""
    tenants: list[tuple[str, int, int, int]]
    """Per flow: tenant, priority, prompt tokens and output tokens served."""


_MAX_USAGE_ITEMS = 10_000
"""Most keys and tenants one usage message carries (the rest wait for the next flush)."""

_DEFAULT_MAX_PAYLOAD = 1 << 20
"""The largest message a NATS server takes by default, used until the server says its own."""

_PIECE = "Llmsched-Piece"
"""Header of each message of a catch-up answer: ``i/n`` for piece ``i`` of ``n``, ``end/n``
for the empty message that ends it."""

_FROM = "Llmsched-From"
"""Header naming the answering replica: its incarnation, a space, its URL-quoted name."""

_RE_ASKS = 2
"""How often a peer whose catch-up answer came without some of its pieces is asked again."""

_STOP_TIMEOUT_S = 2
"""Seconds :meth:`ClusterSync.stop` waits for the bus to take the last batch before it closes
the connection anyway (a server that stopped answering held it 20 s)."""


async def _close_bounded(nc: Client) -> None:
    """Closes ``nc``, waiting :data:`_STOP_TIMEOUT_S` at most; a cancellation of the caller
    goes through at once. The close runs as a task of its own and is waited for through
    ``asyncio.wait``: nats-py's close swallows a cancellation (while it waits for its
    reconnect loop) and goes on with its cleanup, so ``asyncio.wait_for`` around it, which
    waits for what it cancelled to end, held the stop past the bound and kept it from being
    cancelled. A close still running at the end is cancelled and left to end by itself (its
    failure retrieved, not logged)."""
    closing = asyncio.ensure_future(nc.close())
    closing.add_done_callback(_retrieved)
    try:
        await asyncio.wait((closing,), timeout=_STOP_TIMEOUT_S)
    finally:
        closing.cancel()


def _retrieved(task: asyncio.Future[None]) -> None:
    """A done callback: the task's failure retrieved (a close that failed is not news)."""
    if not task.cancelled():
        task.exception()


def _usage_from_json(data: bytes) -> Usage:
    """A peer's usage message, checked item by item; ValueError names what is wrong."""
    raw = json.loads(data)
    if not isinstance(raw, dict) or not isinstance(raw.get("replica"), str):
        raise ValueError("not a usage message")
    keys_raw = raw.get("keys", {})
    tenants_raw = raw.get("tenants", [])
    if not isinstance(keys_raw, dict) or not isinstance(tenants_raw, list):
        raise ValueError("keys must be a mapping and tenants a list")
    if len(keys_raw) > _MAX_USAGE_ITEMS or len(tenants_raw) > _MAX_USAGE_ITEMS:
        raise ValueError("too many items")

    def amount(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1e15):
            raise ValueError(f"bad amount {v!r}")
        return float(v)

    keys: dict[str, tuple[float, float]] = {}
    for key, pair in keys_raw.items():
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"key {key!r}: [requests, tokens] expected")
        keys[key] = (amount(pair[0]), amount(pair[1]))
    tenants: list[tuple[str, int, int, int]] = []
    for item in tenants_raw:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
            raise ValueError("tenant entries are [tenant, priority, prompt, output]")
        priority = item[1]
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**31:
            raise ValueError(f"bad priority {priority!r}")
        tenants.append((item[0], priority, int(amount(item[2])), int(amount(item[3]))))
    return Usage(keys=keys, tenants=tenants)


_PeerId = tuple[str, int]


class _Round:
    """What came of one catch-up request."""

    def __init__(self) -> None:
        self.numbered: dict[_PeerId, _Answer] = {}
        """The numbered answers, by peer (whole or not)."""
        self.unnumbered = 0
        """Messages of answers without numbering (peers of a release before, not named)."""
        self.ended = 0
        """Answers that ended: whole numbered ones, and end markers."""

    @property
    def broken(self) -> dict[_PeerId, _Answer]:
        """The numbered answers that are not whole."""
        return {peer: a for peer, a in self.numbered.items() if not a.whole}

    @property
    def silent(self) -> bool:
        """Whether nothing at all came."""
        return not self.numbered and not self.unnumbered


class _Answer:
    """What arrived of one peer's numbered catch-up answer."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.got: set[int] = set()
        self.last: bytes | None = None
        """The last piece (it moves the cursor), held back while pieces are missing."""

    @property
    def whole(self) -> bool:
        return len(self.got) >= self.total


def _piece(msg: Msg) -> tuple[_PeerId, int | None, int] | None:
    """A catch-up answer's message: who sent it, its piece number (None: the end) and the
    number of pieces. None for a message without (valid) numbering (a replica of a release
    before, which is taken as it comes)."""
    headers = msg.headers
    if not headers or _PIECE not in headers or _FROM not in headers:
        return None
    index, _, total = headers[_PIECE].partition("/")
    incarnation, _, name = headers[_FROM].partition(" ")
    try:
        peer = (unquote(name, errors="strict"), int(incarnation))
        n = int(total)
        i = None if index == "end" else int(index)
    except (ValueError, UnicodeDecodeError):
        return None
    if not name or n < 1 or (i is not None and not 1 <= i <= n):
        return None
    return peer, i, n


def _default_replica() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _new_incarnation() -> int:
    """A replica's incarnation: milliseconds since the epoch and 16 random bits, so that a
    restart's is larger than the life before it (peers drop a late batch of an older one)."""
    return ((time.time_ns() // 1_000_000) << 16 | secrets.randbits(16)) & (2**64 - 1)


class ClusterSync:
    """One router replica's membership of a cluster of replicas synced over NATS.

    :param router: the replica's router; sync is turned on for it (see module docs).
    :param servers: NATS server URL(s).
    :param cluster: the cluster's name: replicas with the same name share state (subject
        ``llmsched.<cluster>.sync``).
    :param replica: this replica's name, unique in the cluster (default host name and pid).
    :param flush_s: how often the journal and counts are published.
    :param heartbeat_s: the longest silence; peers forget a replica after ``load_ttl_s``.
    :param load_ttl_s: how long a peer's counts count without news from it (> ``heartbeat_s``).
    :param journal_limit: most entries journaled between two flushes (the rest are counted).
    :param history_limit: most of this replica's records kept to serve late replicas (none
        older than the record TTL).
    :param catch_up_timeout_s: how long a starting replica waits for a peer's catch-up (and
        a repair, or a re-ask, for its answer).
    :param clock: the router's clock (``time.monotonic`` unless the router is driven by another).
    """

    def __init__(
        self,
        router: Router,
        *,
        servers: str | Sequence[str] = "nats://127.0.0.1:4222",
        cluster: str = "llmsched",
        replica: str | None = None,
        flush_s: float = 0.005,
        heartbeat_s: float = 1.0,
        load_ttl_s: float = 3.0,
        journal_limit: int = 65_536,
        history_limit: int = 200_000,
        catch_up_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a Router, got {type(router).__name__}")
        if not cluster or not all(c.isalnum() or c in "-_" for c in cluster):
            raise ConfigError(f"cluster must be letters, digits, '-' or '_', got {cluster!r}")
        name = replica if replica is not None else _default_replica()
        if not isinstance(name, str) or not name or len(name.encode()) > 65_535:
            raise ConfigError(f"replica must be a non-empty name, got {replica!r}")
        self.flush_s = check_positive_seconds("flush_s", flush_s)
        self.heartbeat_s = check_positive_seconds("heartbeat_s", heartbeat_s)
        self.load_ttl_s = check_positive_seconds("load_ttl_s", load_ttl_s)
        if self.load_ttl_s <= self.heartbeat_s:
            raise ConfigError(
                f"load_ttl_s ({load_ttl_s}) must exceed heartbeat_s ({heartbeat_s}), or peers "
                "would forget a live replica between two heartbeats"
            )
        self.catch_up_timeout_s = check_positive_seconds("catch_up_timeout_s", catch_up_timeout_s)
        journal_limit = check_int("journal_limit", journal_limit, minimum=1)
        history_limit = check_int("history_limit", history_limit, minimum=0)
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.subject = f"llmsched.{cluster}.sync"
        self.catch_up_subject = f"llmsched.{cluster}.catchup"
        self.announce_subject = f"llmsched.{cluster}.announce"
        self._clock = clock
        self._incarnation = _new_incarnation()
        self._native = router.replica_sync(
            name,
            incarnation=self._incarnation,
            journal_limit=journal_limit,
            load_ttl_s=self.load_ttl_s,
            history_limit=history_limit,
        )
        self._nc: Client | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._catching_up = 0
        self._beat_now = False
        self._counters: ConnectionCounters = {
            "disconnects": 0,
            "reconnects": 0,
            "publish_failures": 0,
            "catch_ups": 0,
            "catch_ups_served": 0,
            "catch_up_pieces_lost": 0,
            "catch_up_re_asks": 0,
            "catch_ups_incomplete": 0,
            "catch_ups_unanswered": 0,
            "usage_out": 0,
            "usage_in": 0,
            "usage_malformed": 0,
        }
        self.usage_subject = f"llmsched.{cluster}.usage"
        self._collect_usage: Callable[[], Usage] | None = None
        self._apply_usage: Callable[[Usage], None] | None = None
        self._warned_malformed = False
        self._warned_hashing = False
        self._warned_identity = False
        self._stopping = False

    @property
    def replica(self) -> str:
        """This replica's name."""
        return self._native.replica

    def stats(self) -> ClusterStats:
        """Counters of the sync and of the bus connection."""
        native = self._native.counters()
        return ClusterStats(
            **native,
            **self._counters,
            replica=self.replica,
            connected=self._nc is not None and self._nc.is_connected,
            peers=self._native.peers(),
            shared_names=self._native.shared_names(),
        )

    def share_usage(self, collect: Callable[[], Usage], apply: Callable[[Usage], None]) -> None:
        """Shares counters that must hold across replicas: every flush, ``collect()`` says what
        this replica consumed since the last call (rate-limited keys, tenants' service) and
        each peer's ``apply`` charges it (``KeyLimiter.charge_remote``,
        :meth:`llmsched.FlowController.charge_remote`). These are deltas: a message lost with
        the bus is not replayed, so limits fail open for that interval. Call before
        :meth:`start`."""
        self._collect_usage = collect
        self._apply_usage = apply

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects (in the background if the bus is down) and starts publishing."""
        self._tasks.append(asyncio.create_task(self._connect(), name="llmsched-cluster-connect"))
        self._tasks.append(asyncio.create_task(self._flush_loop(), name="llmsched-cluster-flush"))

    async def stop(self) -> None:
        """Publishes what is left, then closes the connection. Bounded: a bus that stops
        answering holds it about 2 s at most, then the connection is closed anyway."""
        self._stopping = True
        for task in [*self._tasks, *self._side_tasks]:
            task.cancel()
        for task in [*self._tasks, *self._side_tasks]:
            # A failed loop must not stop stop() (nor hide the stop's own cancellation).
            await settled(task)
        self._tasks.clear()
        self._side_tasks.clear()
        nc, self._nc = self._nc, None
        if nc is None:
            return
        try:
            if nc.is_connected:
                await self._publish(nc, heartbeat=True)
                # Not nc.drain(): it waits up to 30 s for a server that stopped answering, then
                # 10 s more, and swallows the cancellation that would cut it short.
                await nc.flush(timeout=_STOP_TIMEOUT_S)
        except (NatsError, OSError, asyncio.TimeoutError):
            pass
        finally:
            # Also stops the client's own reconnect loop when the bus is down.
            await _close_bounded(nc)

    async def __aenter__(self) -> ClusterSync:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the bus -----------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> None:
        """Runs `work` beside the loops (stop() cancels it)."""
        task = asyncio.create_task(work, name=name)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _connect(self) -> None:
        async def disconnected() -> None:
            if self._stopping:
                return
            self._counters["disconnects"] += 1
            log.warning("llmsched cluster %s: lost the bus; routing on local state", self.replica)

        async def reconnected() -> None:
            self._counters["reconnects"] += 1
            log.info("llmsched cluster %s: bus back", self.replica)
            if self._nc is not None and not self._stopping:
                # Not awaited here: the client's reconnect waits for this callback.
                self._spawn(self._exchange(self._nc), "llmsched-cluster-catch-up")

        async def error(exc: Exception) -> None:
            log.debug("llmsched cluster %s: bus error %s", self.replica, exc)

        delay = 0.1
        while True:
            try:
                nc = await nats.connect(
                    servers=self.servers,
                    name=f"llmsched-{self.replica}",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    no_echo=True,  # this replica's own batches are not sent back to it
                    # Nothing is buffered while the bus is down: stale batches are worthless.
                    pending_size=0,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                    error_cb=error,
                )
                break
            except (NatsError, OSError, asyncio.TimeoutError) as exc:
                log.debug("llmsched cluster %s: cannot reach the bus (%s)", self.replica, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        await nc.subscribe(self.subject, cb=self._on_batch)
        await nc.subscribe(self.catch_up_subject, cb=self._on_catch_up_request)
        await nc.subscribe(self.announce_subject, cb=self._on_announce)
        if self._apply_usage is not None:
            await nc.subscribe(self.usage_subject, cb=self._on_usage)
        self._nc = nc
        await self._exchange(nc)

    def _max_bytes(self, nc: Client) -> int:
        """The largest message the server takes (its INFO says; 1 MiB before it has)."""
        return max(1024, nc.max_payload or _DEFAULT_MAX_PAYLOAD)

    async def _on_batch(self, msg: Msg) -> None:
        try:
            report = self._native.incoming(msg.data, self._clock())
        except MalformedSyncBatchError as exc:
            if not self._warned_malformed:
                self._warned_malformed = True
                log.warning("llmsched cluster %s: dropped a malformed batch: %s", self.replica, exc)
            return
        if report["records_mismatched"] and not self._warned_hashing:
            self._warned_hashing = True
            log.warning(
                "llmsched cluster %s: another replica hashes prompts otherwise (another "
                "block_size, hashing seed or model): its prefix records can never match "
                "here and are skipped (counted in mismatched_in); give every replica the "
                "same index settings",
                self.replica,
            )
        if report["behind"]:
            self._on_behind()
        if report["identity_conflict"] and not self._warned_identity:
            self._warned_identity = True
            names = ", ".join(repr(n) for n in self._native.shared_names())
            log.warning(
                "llmsched cluster %s: more than one live replica uses the name %s (counted in "
                "identity_conflicts, listed in stats()['shared_names']): give each replica its "
                "own name (cluster.replica; the default is host name and pid); their counts "
                "still add up",
                self.replica,
                names,
            )

    async def _on_usage(self, msg: Msg) -> None:
        if self._apply_usage is None:
            return
        try:
            usage = _usage_from_json(msg.data)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self._counters["usage_malformed"] += 1
            log.debug("llmsched cluster %s: dropped a usage message: %s", self.replica, exc)
            return
        self._counters["usage_in"] += 1
        self._apply_usage(usage)

    async def _publish_usage(self, nc: Client) -> None:
        if self._collect_usage is None:
            return
        usage = self._collect_usage()
        if not usage["keys"] and not usage["tenants"]:
            return
        message = {
            "replica": self.replica,
            "keys": {k: list(v) for k, v in list(usage["keys"].items())[:_MAX_USAGE_ITEMS]},
            "tenants": [list(t) for t in usage["tenants"][:_MAX_USAGE_ITEMS]],
        }
        if not nc.is_connected:
            self._counters["publish_failures"] += 1
            return
        try:
            await nc.publish(self.usage_subject, json.dumps(message).encode())
            self._counters["usage_out"] += 1
        except (NatsError, OSError):
            self._counters["publish_failures"] += 1

    async def _on_catch_up_request(self, msg: Msg) -> None:
        if not msg.reply or self._nc is None:
            return
        # One reply per batch, numbered, so that the asker sees a lost one; an empty marker
        # ends the series. The server counts the headers in its message limit.
        origin = f"{self._incarnation} {quote(self.replica, safe='')}"
        headers_size = len(origin) + 128
        # Only what the asker misses of this replica's own journal; nothing for a request of
        # this replica's own, one aimed at another peer, or a malformed one.
        max_bytes = max(1024, min(256 * 1024, self._max_bytes(self._nc) - headers_size))
        batches = self._native.catch_up(self._clock(), max_bytes, msg.data)
        if not batches:
            return
        self._counters["catch_ups_served"] += 1
        n = len(batches)
        try:
            for i, batch in enumerate(batches, 1):
                await self._nc.publish(
                    msg.reply, batch, headers={_PIECE: f"{i}/{n}", _FROM: origin}
                )
            await self._nc.publish(msg.reply, b"", headers={_PIECE: f"end/{n}", _FROM: origin})
        except (NatsError, OSError):
            self._counters["publish_failures"] += 1

    def _apply_catch_up(self, data: bytes, what: str) -> None:
        try:
            self._native.apply_catch_up(data, self._clock())
            self._counters["catch_ups"] += 1
        except MalformedSyncBatchError as exc:
            log.warning("llmsched cluster %s: dropped a malformed %s: %s", self.replica, what, exc)

    async def _on_announce(self, msg: Msg) -> None:
        # Replicas of the release before announced their history on every (re)connect.
        self._apply_catch_up(msg.data, "announcement")

    def _on_behind(self) -> None:
        """A peer's batches are missing here: ask it (after the connect's catch-up, which
        may bring them)."""
        if self._nc is not None and not self._catching_up and not self._stopping:
            self._spawn(self._repair(self._nc), "llmsched-cluster-repair")

    async def _repair(self, nc: Client) -> None:
        """Asks each peer with batches missing here for them alone (each once: a repair that
        got no answer at all is given up after the re-asks, and asked again when a later batch
        of that peer shows the gap)."""
        for name, incarnation, request in self._native.repair_requests():
            await self._ask(nc, request, expected=1, target=(name, incarnation))

    async def _exchange(self, nc: Client) -> None:
        """On every (re)connect: a heartbeat at once, so that the peers see the gap in this
        replica's batches and ask for what it routed while it could not publish, then a
        catch-up request to every peer, then a repair for any peer still behind (after a first
        start, with the request for the sessions whose owner did not answer)."""
        self._beat_now = True
        self._catching_up += 1
        try:
            request = self._native.catch_up_request()
            await self._ask(nc, request, len(self._native.peers()), target=None)
        finally:
            self._catching_up -= 1
        await self._repair(nc)

    async def _ask(
        self, nc: Client, request: bytes, expected: int, *, target: _PeerId | None
    ) -> None:
        """A catch-up `request` (see :meth:`_catch_up`), to every peer or to `target` alone,
        then each peer whose answer came without some of its pieces, or did not come at all
        within the timeout, asked again alone, :data:`_RE_ASKS` times at most (a targeted
        request is sent again as it was: the cursors it carries did not move). A request to
        every peer misses a peer's answer when fewer than `expected` ended: the peers heard
        lately that sent nothing numbered are asked. Still not whole after that, an answer's
        last piece is applied: what it missed stays missing, as when nothing showed the loss,
        and a later gap of that peer is asked for again; a repair still unanswered is given
        up, so that a later batch of that peer showing the gap asks again."""
        first = await self._catch_up(nc, request, expected)
        broken = first.broken
        silent: set[_PeerId] = set()
        if target is not None:
            if first.silent:
                silent.add(target)
        elif first.ended < expected:
            silent = {(name, inc) for name, inc in self._native.peer_ids()} - set(first.numbered)
        self._counters["catch_ups_unanswered"] += len(silent)
        for _ in range(_RE_ASKS):
            if not broken and not silent:
                break
            peers = sorted({*broken, *silent})
            self._counters["catch_up_re_asks"] += len(peers)
            # At once: a peer gone silent costs one timeout a round, not one per peer.
            asks = [request if target else self._native.request_to(*p) for p in peers]
            rounds = await asyncio.gather(*(self._catch_up(nc, ask, 1) for ask in asks))
            broken = {k: a for r in rounds for k, a in r.broken.items()}
            silent = {p for p, r in zip(peers, rounds, strict=True) if r.silent}
            self._counters["catch_ups_unanswered"] += len(silent)
        for answer in broken.values():
            self._counters["catch_ups_incomplete"] += 1
            if answer.last is not None:
                self._apply_catch_up(answer.last, "catch-up")
        if target is not None and silent:
            self._native.repair_unanswered(*target)

    async def _catch_up(self, nc: Client, request: bytes, expected: int) -> _Round:
        """Sends a catch-up `request`; applies what comes within the timeout. Each peer holds
        only its own records, so it listens until the `expected` peers have answered (an empty
        marker ends each answer), or for the whole timeout when it expects none (it knows of
        none yet). Returns what came: the numbered answers that are not whole hold back their
        last piece, which moves the asker's cursor past everything the answer carries."""
        inbox = nc.new_inbox()
        done = asyncio.Event()
        got = _Round()
        numbered = got.numbered
        ended: set[_PeerId] = set()

        def answered() -> None:
            got.ended += 1
            if expected and got.ended >= expected:
                done.set()

        async def on_reply(msg: Msg) -> None:
            piece = _piece(msg)
            if piece is None:  # a peer of a release before: taken as it comes
                got.unnumbered += 1
                if msg.data:
                    self._apply_catch_up(msg.data, "catch-up")
                else:
                    answered()
                return
            peer, index, total = piece
            answer = numbered.setdefault(peer, _Answer(total))
            if index is not None and index not in answer.got and total == answer.total:
                answer.got.add(index)
                if index < total:
                    self._apply_catch_up(msg.data, "catch-up")
                else:
                    answer.last = msg.data
                if answer.whole and answer.last is not None:
                    self._apply_catch_up(answer.last, "catch-up")
                    answer.last = None
            if (index is None or answer.whole) and peer not in ended:
                ended.add(peer)
                answered()

        try:
            sub = await nc.subscribe(inbox, cb=on_reply)
            await nc.publish(self.catch_up_subject, request, reply=inbox)
            # No answer in time: no peer yet, the first replica of a cluster starts empty.
            # (On CPython 3.10-3.11 ``wait_for`` loses a cancellation that meets the last
            # reply; harmless here: nothing is left to do after it, and no loop runs on.)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.catch_up_timeout_s)
            await sub.unsubscribe()
        except (NatsError, OSError):
            self._counters["publish_failures"] += 1
        for answer in got.broken.values():
            self._counters["catch_up_pieces_lost"] += answer.total - len(answer.got)
        return got

    async def _publish(self, nc: Client, *, heartbeat: bool) -> None:
        batches = self._native.outgoing(self._clock(), heartbeat, self._max_bytes(nc))
        if not batches:
            return
        if not nc.is_connected:
            self._counters["publish_failures"] += 1
            return
        try:
            for batch in batches:
                await nc.publish(self.subject, batch)
        except (NatsError, OSError):
            self._counters["publish_failures"] += 1

    async def _flush_loop(self) -> None:
        last_beat = 0.0
        while True:
            await asyncio.sleep(self.flush_s)
            now = self._clock()
            self._native.expire(now)
            nc = self._nc
            beat = now - last_beat >= self.heartbeat_s or self._beat_now
            if nc is None:
                # Not connected yet: keep the journal bounded by draining it into nothing (the
                # records stay in the history, announced once connected).
                if self._native.outgoing(now, False, _DEFAULT_MAX_PAYLOAD):
                    self._counters["publish_failures"] += 1
                if self._collect_usage is not None:
                    self._collect_usage()  # dropped: limits hold per replica meanwhile
                continue
            await self._publish(nc, heartbeat=beat)
            await self._publish_usage(nc)
            if beat:
                last_beat = now
                self._beat_now = False
