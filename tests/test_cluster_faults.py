"""Replica sync under faults, against a real NATS server (Debian's ``nats-server``).

What a production cluster of router replicas meets: two replicas given the same name, a burst
larger than the bus takes in one message, a bus that stops answering while a replica stops, a
peer slow to answer a catch-up, a piece of a catch-up answer lost on the way, one replica cut
off from the bus while the others carry on, a replica that restarts, a replica that leaves, a
peer of another protocol version. Every wait is bounded, so a hang
fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest

pytest.importorskip("nats", reason="the cluster extra brings nats-py")

import nats
from _nats import (  # noqa: F401 (the bus fixture)
    NatsServer,
    bus_fixture,
    cluster_router,
    free_port,
)

from llmsched import Router
from llmsched.cluster import ClusterSync

if TYPE_CHECKING:
    from nats.aio.msg import Msg


def _prompt(i: int, length: int = 256) -> np.ndarray:
    return np.arange(i * 1_000_000, i * 1_000_000 + length, dtype=np.uint32)


def _remote(router: Router) -> int:
    return sum(e["remote_in_flight_requests"] for e in router.pool.endpoints())


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _synced(
    *members: tuple[Router, str, str], **options: object
) -> AsyncIterator[list[ClusterSync]]:
    """ClusterSyncs for (router, server URL, replica name), started and connected."""
    syncs = [
        ClusterSync(router, servers=url, cluster="f", replica=name, **options)  # type: ignore[arg-type]
        for router, url, name in members
    ]
    for sync in syncs:
        await sync.start()
    try:
        await _until(lambda: all(s.stats()["connected"] for s in syncs), "connections")
        yield syncs
    finally:
        for sync in syncs:
            await asyncio.wait_for(sync.stop(), 15)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 90))


def test_two_replicas_with_one_name_are_flagged_and_both_still_count(
    bus: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas configured with the same name ("gw-0", say a name copied into every pod's
    config): they synced silently, each listing the other under its own name, and a third
    replica kept one of their counts at a time (it saw 2 or 3 requests in flight, never 5)."""

    async def body() -> None:
        a, b, c = cluster_router(0), cluster_router(1), cluster_router(2)
        async with _synced((a, bus.url, "gw-0"), (b, bus.url, "gw-0"), (c, bus.url, "gw-2")) as (
            sa,
            sb,
            sc,
        ):
            held = []
            for i in range(2):
                d = a.pick(tokens=_prompt(i))
                d.started()
                held.append(d)
            for i in range(3):
                d = b.pick(tokens=_prompt(10 + i))
                d.started()
                held.append(d)
            await _until(lambda: _remote(c) == 5, "both replicas' counts at the third")
            # Their batches keep coming (every change, every heartbeat): the sum holds.
            for _ in range(3):
                d = a.pick(tokens=_prompt(50))
                d.started()
                d.finished()
                await _until(lambda: _remote(c) == 5, "the sum to hold")
            await _until(lambda: sa.stats()["identity_conflicts"] >= 1, "the conflict at gw-0")
            # The older of the two is taken for the other's previous life until it speaks
            # again after the newer one did: then it is alive, everywhere.
            for sync in (sa, sb, sc):
                await _until(lambda s=sync: s.stats()["shared_names"] == ["gw-0"], "the name")
            assert sc.stats()["identity_conflicts"] >= 1
            note = a.pick(tokens=_prompt(99)).explain().notes
            assert any("uses this replica's name 'gw-0'" in n for n in note), note
            assert not any("gw-2" in n for n in c.pick(tokens=_prompt(99)).explain().notes)
            for d in held:
                d.finished()
        warned = [r for r in caplog.records if "more than one live replica" in r.getMessage()]
        # Once per replica that saw it (each of the three), never once per batch.
        assert 1 <= len(warned) <= 3, [r.getMessage() for r in warned]

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body)


def test_two_live_replicas_with_one_name_are_found_out_before_load_ttl(
    bus: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """With load_ttl_s at 30 s, two live replicas named gw-0 were flagged by the newer one and
    the third replica only after 30 s: until then the older one's batches were dropped as a
    previous life's, and its requests in flight were not counted. Now the older one speaking
    again after the newer one did (their heartbeats interleave) shows both alive at once."""

    async def body() -> None:
        a, b, c = cluster_router(0), cluster_router(1), cluster_router(2)
        members = ((a, bus.url, "gw-0"), (b, bus.url, "gw-0"), (c, bus.url, "gw-2"))
        async with _synced(*members, load_ttl_s=30.0) as syncs:
            held = []
            for router, n in ((a, 2), (b, 3)):
                for i in range(n):
                    d = router.pick(tokens=_prompt(10 * n + i))
                    d.started()
                    held.append(d)
            for sync in syncs:
                await _until(lambda s=sync: s.stats()["shared_names"] == ["gw-0"], "the name")
            await _until(lambda: _remote(c) == 5, "both replicas' counts at the third")
            assert all(s.stats()["identity_conflicts"] >= 1 for s in syncs)
            note = b.pick(tokens=_prompt(99)).explain().notes
            assert any("uses this replica's name 'gw-0'" in n for n in note), note
            for d in held:
                d.finished()
        warned = [r for r in caplog.records if "more than one live replica" in r.getMessage()]
        assert len(warned) == 3, [r.getMessage() for r in warned]

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body)


def test_a_replica_that_restarts_under_its_name_replaces_its_old_life(bus: NatsServer) -> None:
    """A restart (same name, new incarnation) is not a second replica: the peers drop the old
    incarnation's counts at once, not after load_ttl_s, and flag nothing."""

    async def body() -> None:
        a, b = cluster_router(0), cluster_router(1)
        async with _synced((b, bus.url, "gw-b"), load_ttl_s=30.0) as (sb,):
            old = ClusterSync(a, servers=bus.url, cluster="f", replica="gw-a", load_ttl_s=30.0)
            await old.start()
            await _until(lambda: old.stats()["connected"], "the first life's connection")
            lost = [a.pick(tokens=_prompt(i)) for i in range(3)]
            for d in lost:
                d.started()
            await _until(lambda: _remote(b) == 3, "the first life's count")
            # It dies without a word (its loops stop, its connection goes with the process).
            for task in old._tasks:  # the test kills the replica abruptly
                task.cancel()
            assert old._nc is not None
            await old._nc.close()
            fresh = cluster_router(3)
            async with _synced((fresh, bus.url, "gw-a"), load_ttl_s=30.0):
                d = fresh.pick(tokens=_prompt(7))
                d.started()
                await _until(lambda: _remote(b) == 1, "the new life's count alone")
                assert sb.stats()["peers"] == ["gw-a"]
                assert sb.stats()["shared_names"] == []
                assert sb.stats()["identity_conflicts"] == 0
                d.finished()

    run(body)


def test_a_late_batch_of_a_restarted_replicas_previous_life_is_dropped_not_flagged(
    bus: NatsServer,
) -> None:
    """A batch of replica gw-a's previous life, held up and delivered after its new life's
    first batch, was taken for a second live replica named gw-a: the name was flagged shared
    (for load_ttl_s) and the old life's 3 requests in flight were added to the new life's 1.
    Incarnations now grow with the start time, and the late batch is dropped and counted."""

    async def body() -> None:
        now = time.monotonic()
        held = []

        def life(name: str, incarnation: int, in_flight: int) -> bytes:
            router = cluster_router(incarnation % 7)
            native = router.replica_sync(
                name, incarnation=incarnation, journal_limit=100, load_ttl_s=30.0, history_limit=9
            )
            for i in range(in_flight):
                d = router.pick(tokens=_prompt(i))
                d.started()
                held.append(d)
            (batch,) = native.outgoing(now, False, 1 << 20)
            return batch

        old_life, new_life = life("gw-a", 5 << 40, 3), life("gw-a", 6 << 40, 1)
        router = cluster_router(0)
        async with _synced((router, bus.url, "r"), load_ttl_s=30.0) as (sync,):
            # Its own previous life (an incarnation older than any made now) is late too.
            own_old_life = life("r", 1, 2)
            nc = await nats.connect(bus.url)
            try:
                await nc.publish("llmsched.f.sync", new_life)
                await nc.flush()
                await _until(lambda: _remote(router) == 1, "the new life's count")
                for late in (old_life, own_old_life):
                    await nc.publish("llmsched.f.sync", late)
                await nc.flush()
                await _until(lambda: sync.stats()["batches_in"] >= 3, "the late batches")
            finally:
                await nc.close()
            stats = sync.stats()
            assert _remote(router) == 1, "the previous lives' requests are not counted"
            assert stats["shared_names"] == [] and stats["identity_conflicts"] == 0
            assert stats["peers"] == ["gw-a"]
            assert stats["stale_in"] == 2

    run(body)


def test_a_short_blip_costs_what_was_routed_during_it_not_every_peers_history(
    bus: NatsServer,
) -> None:
    """Four replicas, each with 12 records of 4,096 tokens (2 kB each) and 12 sessions. One
    loses the bus for a moment while it and another each route one prompt. When it was back,
    every peer answered its catch-up with all its records and every session it knew, and it
    announced all of its own: about 100 kB on the bus for 2 prompts. Now each peer sends only
    what the other side misses, and every replica still ends with every record and session."""

    async def body() -> None:
        cable = _Cable(bus.port)
        await cable.mend()
        routers = [cluster_router(i) for i in range(4)]
        members = [(r, bus.url if i < 3 else cable.url, f"r{i}") for i, r in enumerate(routers)]
        routed: dict[int, str] = {}
        chats: dict[str, str] = {}

        def route(i: int, p: int) -> None:
            d = routers[i].pick(tokens=_prompt(p, 4096), session_id=f"chat-{p}")
            d.started()
            d.finished()
            routed[p] = chats[f"chat-{p}"] = d.endpoint

        def converged() -> bool:
            for router in routers:
                for p, endpoint in routed.items():
                    d = router.pick(tokens=_prompt(p, 4096))
                    if d.endpoint != endpoint or d.cached != 4096:
                        return False
                for chat, endpoint in chats.items():
                    if router.pick(tokens=_prompt(999), session_id=chat).endpoint != endpoint:
                        return False
            return True

        async with _synced(*members) as syncs:
            for i in range(4):
                for j in range(12):
                    route(i, 100 * i + j)
            await _until(converged, "the history everywhere")
            history = 48 * 4096 // 16 * 8
            spy = await nats.connect(bus.url)
            traffic: list[int] = []

            async def count(msg: Msg) -> None:
                traffic.append(len(msg.data))

            for subject in ("_INBOX.>", "llmsched.f.catchup", "llmsched.f.announce"):
                await spy.subscribe(subject, cb=count)
            await spy.flush()
            # What the peers served before the blip (their first starts' catch-ups, asked again
            # when a peer still starting answered late) is not the blip's cost.
            served_before = sum(s.stats()["catch_up_bytes_out"] for s in syncs)
            await cable.cut()
            await _until(lambda: not syncs[3].stats()["connected"], "r3 to lose the bus")
            route(0, 900)
            route(3, 901)
            await asyncio.sleep(0.1)  # both flushed while apart
            await cable.mend()
            await _until(lambda: syncs[3].stats()["connected"], "r3 to reconnect", 20)
            await _until(converged, "both prompts and chats everywhere")
            await asyncio.sleep(0.5)  # the last answers in
            await spy.close()
            assert sum(traffic) < history // 4, (sum(traffic), len(traffic), history)
            assert len(traffic) < 40, len(traffic)
            served = sum(s.stats()["catch_up_bytes_out"] for s in syncs) - served_before
            assert served < history // 4, served
        await cable.cut()

    run(body)


def test_a_new_replica_gets_each_session_once_those_of_a_replica_gone_included(
    bus: NatsServer,
) -> None:
    """Four replicas bind 60 sessions each (one-block prompts), and every replica holds all 240.
    One stops; then a new replica starts. A replica that knew no peer got every peer's whole
    session table: each session once per peer, 720 session entries for 240 sessions (18 kB of
    catch-up answers on the bus, now 10 kB). Now each peer sends the sessions it owns
    (bound last) and one peer, asked after, those whose owner did not answer (the stopped
    one's): each session once, and the new replica still holds all 240 bindings. The stopped
    replica's 60 prefix records reached no new replica, though the engines it routed to (every
    replica's) still hold them: that peer hands them on too."""

    async def body() -> None:
        routers = [cluster_router(i) for i in range(4)]
        chats: dict[str, str] = {}

        def route(i: int, p: int) -> None:
            d = routers[i].pick(tokens=_prompt(p, 16), session_id=f"chat-{p}")
            d.started()
            d.finished()
            chats[f"chat-{p}"] = d.endpoint

        def holds_every_chat(router: Router) -> bool:
            return all(
                router.pick(tokens=_prompt(999), session_id=chat).endpoint == endpoint
                for chat, endpoint in chats.items()
            )

        def holds_every_prompt(router: Router) -> bool:
            return all(
                router.pick(tokens=_prompt(int(chat[5:]), 16)).cached == 16 for chat in chats
            )

        members = [(r, bus.url, f"r{i}") for i, r in enumerate(routers)]
        async with _synced(*members) as syncs:
            # Their own first catch-ups done (a request for the sessions no answering peer
            # owns, sent after routing began, would add to what they served).
            connecting = [s._tasks[0] for s in syncs]  # the test reads the connect tasks
            await _until(lambda: all(t.done() for t in connecting), "the first catch-ups")
            for i in range(4):
                for j in range(60):
                    route(i, 100 * i + j)
            await _until(lambda: all(map(holds_every_chat, routers)), "every chat everywhere")
            await asyncio.wait_for(syncs[3].stop(), 15)  # r3 leaves; its sessions live on
            spy = await nats.connect(bus.url)
            traffic: list[int] = []

            async def count(msg: Msg) -> None:
                traffic.append(len(msg.data))

            await spy.subscribe("_INBOX.>", cb=count)
            await spy.flush()
            new = cluster_router(9)
            async with _synced((new, bus.url, "new"), catch_up_timeout_s=1.0) as (sync,):
                await _until(lambda: holds_every_chat(new), "every chat on the new replica")
                await _until(lambda: holds_every_prompt(new), "every prompt on the new replica")
                await asyncio.sleep(0.3)  # any later answer in
                stats = sync.stats()
            await spy.close()
            served = [s.stats()["catch_up_entries_out"] for s in syncs[:3]]
            # 240 records and 240 sessions, each once (r3's from the peer asked last).
            assert stats["sessions_applied"] == 240, (stats["sessions_applied"], served)
            assert stats["records_applied"] == 240, stats["records_applied"]
            assert sum(served) == 240 + 240, served
            assert stats["tables_asked"] == 1
            assert sum(traffic) < 12_000, (sum(traffic), len(traffic))

    run(body)


def _lossy(sync: ClusterSync, drop: Callable[[bytes], bool]) -> Callable[[], None]:
    """Fault injection: `sync`'s catch-up answers (messages to an inbox) for which `drop` says
    so are lost on the way, as NATS may lose any message. Returns the repair."""
    nc = sync._nc  # the test cuts into the replica's connection
    assert nc is not None
    real = nc.publish

    async def publish(
        subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if subject.startswith("_INBOX.") and drop(payload):
            return
        await real(subject, payload, reply=reply, headers=headers)

    nc.publish = publish  # type: ignore[method-assign]

    def mend() -> None:
        nc.publish = real  # type: ignore[method-assign]

    return mend


def test_a_lost_piece_of_a_long_catch_up_answer_is_asked_for_again(bus: NatsServer) -> None:
    """A peer's catch-up answer to a new replica is several messages (100 prompts of 16,384
    tokens: 800 kB of records, 256 kB a message), and the bus lost the first. The new replica
    applied the rest, the last of which moved its cursor past everything: the lost records
    never came. Now the pieces are numbered, the last is held back while one is missing, and
    the peer is asked again."""

    async def body() -> None:
        a, new = cluster_router(0), cluster_router(1)
        async with _synced((a, bus.url, "a")) as (sa,):
            for i in range(100):
                d = a.pick(tokens=_prompt(i, 16384))
                d.started()
                d.finished()
            await _until(lambda: sa.stats()["entries_out"] >= 100, "a's records journaled")
            lost: list[int] = []

            def first_piece(payload: bytes) -> bool:
                if payload and not lost:
                    lost.append(len(payload))
                    return True
                return False

            _lossy(sa, first_piece)
            # A long first round: an answer later than it is no loss here, only noise.
            async with _synced((new, bus.url, "new"), catch_up_timeout_s=3.0) as (sync,):

                def every_prompt() -> bool:
                    return all(
                        new.pick(tokens=_prompt(i, 16384)).cached == 16384 for i in range(100)
                    )

                await _until(every_prompt, "every record on the new replica")
                stats = sync.stats()
            assert lost and sa.stats()["catch_up_batches_out"] >= 3 + 4
            assert stats["catch_up_pieces_lost"] == 1, stats
            assert stats["catch_up_re_asks"] == 1 and stats["catch_ups_incomplete"] == 0

    run(body)


def _drop_answers(sync: ClusterSync, answers: int) -> Callable[[], None]:
    """Fault injection: `sync`'s next `answers` catch-up answers are lost whole (every piece
    and the end marker). Returns the repair."""
    left = [answers]

    def whole(payload: bytes) -> bool:
        if left[0] <= 0:
            return False
        if not payload:  # the end marker: that answer is all gone
            left[0] -= 1
        return True

    return _lossy(sync, whole)


def _drop_next_batch(sync: ClusterSync) -> None:
    """Fault injection: `sync`'s next batch on the sync subject is lost on the way."""
    nc = sync._nc  # the test cuts into the replica's connection
    assert nc is not None
    real = nc.publish

    async def publish(
        subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if subject == sync.subject:
            nc.publish = real  # type: ignore[method-assign]
            return
        await real(subject, payload, reply=reply, headers=headers)

    nc.publish = publish  # type: ignore[method-assign]


def _route(router: Router, i: int) -> None:
    d = router.pick(tokens=_prompt(i))
    d.started()
    d.finished()


# A peer that stays quiet: no heartbeat within a test, so only the catch-up can bring what
# was missed.
_QUIET = {"heartbeat_s": 30.0, "load_ttl_s": 60.0}


async def _first_catch_ups(syncs: list[ClusterSync]) -> None:
    """Until each replica's own first catch-up is done (its requests would mix with the
    test's faults)."""
    connecting = [s._tasks[0] for s in syncs]  # the test reads the connect tasks
    await _until(lambda: all(t.done() for t in connecting), "the first catch-ups")


def test_a_catch_up_answer_lost_whole_is_asked_for_again(bus: NatsServer) -> None:
    """Probe 75: b reconnects after a cut, during which a routed a prompt; a's whole answer to
    b's catch-up is lost. Nothing showed it (only a missing piece did): b lacked the record
    until a's next batch showed the gap (a heartbeat, 30 s here). An answer that does not
    come from a peer heard lately is now asked for again, from that peer alone."""

    async def body() -> None:
        cable = _Cable(bus.port)
        await cable.mend()
        a, b = cluster_router(0), cluster_router(1)
        async with _synced((a, bus.url, "a"), (b, cable.url, "b"), **_QUIET) as (sa, sb):
            await _first_catch_ups([sa, sb])
            _route(a, 1)
            await _until(lambda: sb.stats()["peers"] == ["a"], "b to hear a")
            await cable.cut()
            await _until(lambda: not sb.stats()["connected"], "b to lose the bus")
            _route(a, 2)
            await _until(lambda: sa.stats()["entries_out"] >= 2, "a's batch, lost to b")
            _drop_answers(sa, 1)
            await cable.mend()
            await _until(lambda: b.pick(tokens=_prompt(2)).cached == 256, "a's record at b", 8)
            stats = sb.stats()
            assert stats["catch_ups_unanswered"] == 1, stats
            assert stats["catch_up_re_asks"] == 1 and stats["catch_ups_incomplete"] == 0
        await cable.cut()

    run(body)


@pytest.mark.parametrize("lost", [1, 3], ids=["re-asked", "given-up"])
def test_a_repair_whose_answer_is_lost_is_asked_again(bus: NatsServer, lost: int) -> None:
    """Probe 75: a's batch with prompt 2 is lost to b; the next shows b the gap and b asks a
    for it alone, but the answer is lost whole. The peer stayed marked as asked: no later
    batch asked again, and the record never came. Now the repair is asked again (twice at
    most); still unanswered, it is given up, and the next batch that shows the gap asks
    again."""

    async def body() -> None:
        a, b = cluster_router(0), cluster_router(1)
        async with _synced((a, bus.url, "a"), (b, bus.url, "b"), **_QUIET) as (sa, sb):
            await _first_catch_ups([sa, sb])
            _route(a, 1)
            await _until(lambda: b.pick(tokens=_prompt(1)).cached == 256, "a's first record")
            _drop_next_batch(sa)
            _route(a, 2)
            await _until(lambda: sa.stats()["entries_out"] >= 2, "a's lost batch")
            mend = _drop_answers(sa, lost)
            _route(a, 3)
            await _until(lambda: sb.stats()["repairs_asked"] == 1, "b's repair")
            if lost == 1:
                await _until(lambda: b.pick(tokens=_prompt(2)).cached == 256, "the re-asked", 8)
                stats = sb.stats()
                assert stats["repairs_unanswered"] == 0, stats
            else:
                await _until(lambda: sb.stats()["repairs_unanswered"] == 1, "the repair given up")
                assert b.pick(tokens=_prompt(2)).cached == 0
                mend()
                _route(a, 4)  # its batch shows b the gap again
                await _until(lambda: b.pick(tokens=_prompt(2)).cached == 256, "the re-asked", 8)
                stats = sb.stats()
                assert stats["repairs_asked"] == 2, stats
            assert stats["catch_ups_unanswered"] == lost, stats
            assert stats["catch_up_re_asks"] == min(lost, 2), stats

    run(body)


def test_a_new_replica_gets_a_departed_owners_sessions_once_whoever_answered_before(
    bus: NatsServer,
) -> None:
    """r3 leaves; r0's answers to the next new replica, z1, are lost, so r1 answers its request
    for the sessions no answering peer owns, and r1 took r3's sessions over in its own view
    only. The next new replica, z2, then got them from r1 (as its own) and from r0 (asked for
    those no answering peer owns, it still named r3): 300 session entries for 240 sessions."""

    async def body() -> None:
        routers = [cluster_router(i) for i in range(4)]
        chats: dict[str, str] = {}

        def holds_every_chat(router: Router) -> bool:
            return all(
                router.pick(tokens=_prompt(999), session_id=chat).endpoint == endpoint
                for chat, endpoint in chats.items()
            )

        members = [(r, bus.url, f"r{i}") for i, r in enumerate(routers)]
        async with _synced(*members) as syncs:
            connecting = [s._tasks[0] for s in syncs]  # the test reads the connect tasks
            await _until(lambda: all(t.done() for t in connecting), "the first catch-ups")
            for i, router in enumerate(routers):
                for j in range(60):
                    d = router.pick(tokens=_prompt(100 * i + j, 16), session_id=f"chat-{i}-{j}")
                    d.started()
                    d.finished()
                    chats[f"chat-{i}-{j}"] = d.endpoint
            await _until(lambda: all(map(holds_every_chat, routers)), "every chat everywhere")
            await asyncio.wait_for(syncs[3].stop(), 15)
            for sync in syncs[:3]:  # r3 gone from every view (after load_ttl_s)
                await _until(lambda s=sync: "r3" not in s.stats()["peers"], "r3 to expire")
            mend = _lossy(syncs[0], lambda payload: True)
            z1, z2 = cluster_router(8), cluster_router(9)
            async with _synced((z1, bus.url, "z1"), catch_up_timeout_s=3.0):
                await _until(lambda: holds_every_chat(z1), "every chat on z1")
                mend()
                # A long first round: a peer that answers later than it has its sessions sent
                # by the peer asked last too, a duplicate this test would count.
                async with _synced((z2, bus.url, "z2"), catch_up_timeout_s=3.0) as (sync,):
                    await _until(lambda: holds_every_chat(z2), "every chat on z2")
                    await _until(lambda: sync.stats()["tables_asked"] == 1, "z2's last request")
                    await asyncio.sleep(0.5)  # its answer in
                    stats = sync.stats()
            # r1 answered z1's request for the sessions of r0 and r3 (and each first round).
            assert syncs[1].stats()["catch_up_entries_out"] >= 4 * 60 + 120, "r1 asked by z1"
            assert stats["sessions_applied"] == 240, stats["sessions_applied"]

    run(body)


def test_a_burst_over_the_bus_message_limit_still_reaches_the_peers(bus: NatsServer) -> None:
    """40 requests of 65,536 tokens between two flushes (a burst, or an event loop held up)
    journal 1.3 MB, over the server's 1 MiB message limit: the one batch was refused whole, so
    the peers never got those records, nor the 40 requests in flight (until a heartbeat), and
    only ``publish_failures`` said so."""

    async def body() -> None:
        a, b = cluster_router(0), cluster_router(1)
        async with _synced((a, bus.url, "a"), (b, bus.url, "b")) as (sa, sb):
            held = []
            for i in range(40):
                d = a.pick(tokens=_prompt(i, 65_536))
                d.started()
                held.append(d)
            await _until(lambda: sb.stats()["records_applied"] >= 40, "the 40 records")
            assert _remote(b) == 40
            assert sa.stats()["publish_failures"] == 0
            assert b.pick(tokens=_prompt(7, 65_536)).cached == 65_536
            for d in held:
                d.finished()

    run(body)


def test_stop_is_bounded_when_the_bus_stops_answering(bus: NatsServer) -> None:
    """A server that stops answering (frozen, or a half-open connection) held stop() 20 s."""

    async def body() -> None:
        sync = ClusterSync(cluster_router(), servers=bus.url, cluster="f", replica="x")
        await sync.start()
        await _until(lambda: sync.stats()["connected"], "the connection")
        assert bus.proc is not None
        os.kill(bus.proc.pid, signal.SIGSTOP)
        try:
            # Not asyncio.wait_for(sync.stop(), ...): nats-py's drain swallowed its
            # cancellation, so the wait ended when stop() did, however late.
            stopping = asyncio.create_task(sync.stop())
            await asyncio.wait({stopping}, timeout=8)
            assert stopping.done(), "stop() still running 8 s after a frozen bus"
        finally:
            os.kill(bus.proc.pid, signal.SIGCONT)
            await stopping

    run(body)


def test_a_late_replica_takes_every_peers_answer_not_only_the_first(bus: NatsServer) -> None:
    """Each peer answers a catch-up with its own records only. The late replica stopped
    listening at the first peer's end marker, so a peer that answered later (a busy one, or one
    with more to send) was lost: here one peer answers at once with nothing, another 0.3 s later
    with a record."""

    async def body() -> None:
        source = cluster_router(5)
        native = source.replica_sync(
            "slow", incarnation=1, journal_limit=100, load_ttl_s=3.0, history_limit=100
        )
        d = source.pick(tokens=_prompt(3), session_id="chat-3")
        d.started()
        d.finished()
        native.outgoing(time.monotonic(), False, 1 << 20)  # into its history
        answer = native.catch_up(time.monotonic(), 1 << 20)
        assert answer

        # Two peers, each on its own connection: one with nothing to send answers at once,
        # the other 0.3 s later with its record and session.
        quick, slow = await nats.connect(bus.url), await nats.connect(bus.url)

        async def quick_peer(msg: Msg) -> None:
            await quick.publish(msg.reply, b"")

        async def slow_peer(msg: Msg) -> None:
            await asyncio.sleep(0.3)
            for batch in answer:
                await slow.publish(msg.reply, batch)
            await slow.publish(msg.reply, b"")

        await quick.subscribe("llmsched.f.catchup", cb=quick_peer)
        await slow.subscribe("llmsched.f.catchup", cb=slow_peer)
        try:
            late = cluster_router(9)
            async with _synced((late, bus.url, "late"), catch_up_timeout_s=5.0) as (sync,):
                await _until(lambda: sync.stats()["records_applied"] >= 1, "the slow answer")
                assert late.pick(tokens=_prompt(3)).endpoint == d.endpoint
                assert late.pick(tokens=_prompt(4), session_id="chat-3").endpoint == d.endpoint
        finally:
            await quick.close()
            await slow.close()

    run(body)


class _Cable:
    """A TCP relay between one replica and the NATS server that the test can cut and mend:
    that replica loses the bus while the others keep it (a partition)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def mend(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_what_a_cut_off_replica_routed_reaches_the_peers_when_the_partition_heals(
    bus: NatsServer,
) -> None:
    """Replica x loses the bus while a keeps it. x routes a prompt and binds a session alone;
    a routes another. Once x is back, both know both: x asked for a's records (as before), and
    x's records and sessions, which x could not publish and a never asked for, reached a (they
    never did: a routed x's chat blind until the record TTL ran out)."""

    async def body() -> None:
        cable = _Cable(bus.port)
        await cable.mend()
        a, x = cluster_router(0), cluster_router(1)
        async with _synced((a, bus.url, "a"), (x, cable.url, "x")) as (_sa, sx):
            await cable.cut()
            await _until(lambda: not sx.stats()["connected"], "x to lose the bus")
            dx = x.pick(tokens=_prompt(1), session_id="chat-x")
            dx.started()
            dx.finished()
            da = a.pick(tokens=_prompt(2))
            da.started()
            da.finished()
            await asyncio.sleep(0.1)  # both flushed while apart
            assert a.pick(tokens=_prompt(1)).cached == 0
            await cable.mend()
            await _until(lambda: sx.stats()["connected"], "x to reconnect", 20)
            await _until(lambda: x.pick(tokens=_prompt(2)).cached == 256, "a's record at x")
            await _until(lambda: a.pick(tokens=_prompt(1)).cached == 256, "x's record at a")
            assert a.pick(tokens=_prompt(1)).endpoint == dx.endpoint
            assert a.pick(tokens=_prompt(3), session_id="chat-x").endpoint == dx.endpoint
            assert sx.stats()["reconnects"] >= 1 and sx.stats()["disconnects"] >= 1
        await cable.cut()

    run(body)


def test_a_peer_of_another_protocol_version_is_counted_and_changes_nothing(
    bus: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica of a later release (version byte 3), and a batch cut short, are refused,
    counted and warned about once; routing state is unchanged."""

    async def body() -> None:
        source = cluster_router(5)
        native = source.replica_sync(
            "new", incarnation=1, journal_limit=100, load_ttl_s=3.0, history_limit=100
        )
        d = source.pick(tokens=_prompt(3))
        d.started()
        (good,) = native.outgoing(time.monotonic(), False, 1 << 20)
        d.finished()
        newer = good[:4] + bytes([3]) + good[5:]
        router = cluster_router(0)
        async with _synced((router, bus.url, "r")) as (sync,):
            nc = await nats.connect(bus.url)
            for payload in (newer, good[: len(good) // 2]):
                await nc.publish("llmsched.f.sync", payload)
            await nc.flush()
            await _until(lambda: sync.stats()["malformed_in"] == 2, "the refusals")
            await nc.close()
            assert sync.stats()["records_applied"] == 0 and sync.stats()["peers"] == []
            assert _remote(router) == 0 and router.pick(tokens=_prompt(3)).cached == 0
        warned = [r.getMessage() for r in caplog.records if "malformed batch" in r.getMessage()]
        assert len(warned) == 1 and "unknown version 3" in warned[0], warned

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body)
