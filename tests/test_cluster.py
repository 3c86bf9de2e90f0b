"""Router replicas synced over a real NATS server (Debian's ``nats-server``, started per test).

Each replica is a Router with its own pool and index over the same endpoints, as separate
gateway processes would have; requests are spread over the replicas in turn. The tests check
what sync promises: a prefix routed by one replica is found by the others, sessions follow,
in-flight counts keep replicas from herding, a late replica catches up, and a lost bus or a
dead replica costs no decision.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import numpy as np
import pytest

pytest.importorskip("nats", reason="the cluster extra brings nats-py")

from _nats import (  # noqa: F401 (the bus fixture)
    CONFIG,
    ENDPOINTS,
    NatsServer,
    bus_fixture,
    cluster_router,
    free_port,
)

from llmsched import EndpointPool, PrefixIndex, Router
from llmsched.cluster import ClusterSync
from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError


def _prompt(i: int, length: int = 256) -> np.ndarray:
    return np.arange(i * 100_000, i * 100_000 + length, dtype=np.uint32)


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def _replicas(
    url: str, n: int, **options: object
) -> AsyncIterator[list[tuple[Router, ClusterSync]]]:
    members = []
    for i in range(n):
        router = cluster_router(seed=i)
        sync = ClusterSync(router, servers=url, cluster="t", replica=f"gw-{i}", **options)  # type: ignore[arg-type]
        await sync.start()
        members.append((router, sync))
    try:
        await _until(lambda: all(s.stats()["connected"] for _, s in members), "connections")
        yield members
    finally:
        for _, sync in members:
            await sync.stop()


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_prefix_routed_by_one_replica_is_found_by_the_others(bus: NatsServer) -> None:
    async def body() -> None:
        async with _replicas(bus.url, 3) as replicas:
            (r0, s0), (r1, s1), (r2, s2) = replicas
            prompt = _prompt(1)
            first = r0.pick(tokens=prompt, session_id="chat-1")
            first.started()
            first.finished()
            await _until(
                lambda: s1.stats()["records_applied"] >= 1 and s2.stats()["records_applied"] >= 1,
                "the record to reach both peers",
            )
            for router in (r1, r2):
                again = router.pick(tokens=prompt)
                assert again.endpoint == first.endpoint
                assert again.cached == len(prompt)
            # The session binding came along: a different prompt of the session lands there.
            follow = r2.pick(tokens=_prompt(2), session_id="chat-1")
            assert follow.endpoint == first.endpoint
            assert s1.stats()["sessions_applied"] >= 1  # twice when a catch-up overlaps
            # gw-1 has sent nothing to gw-0 but heartbeats, which a loaded machine can delay.
            await _until(
                lambda: sorted(s0.stats()["peers"]) == ["gw-1", "gw-2"], "gw-0 to hear both peers"
            )

    run(body)


async def _herd(
    replicas: list[tuple[Router, ClusterSync | None]], rounds: int, settle: bool
) -> list[int]:
    """Rounds of one cold request per replica, held until the round ends; returns the most
    requests one endpoint had in each round. With `settle`, each replica first waits for the
    others' counts (a request rate below one per flush interval per replica)."""

    def remote(router: Router) -> int:
        return sum(e["remote_in_flight_requests"] for e in router.pool.endpoints())

    worst = []
    for r in range(rounds):
        placed: Counter[object] = Counter()
        decisions = []
        for k, (router, _sync) in enumerate(replicas):
            if settle:
                await _until(lambda r=router, k=k: remote(r) == k, "the peers' counts")
            d = router.pick(tokens=_prompt(1000 * r + k))
            d.started()
            decisions.append(d)
            placed[d.endpoint] += 1
        worst.append(max(placed.values()))
        for d in decisions:
            d.finished()
        if settle:
            for router, _sync in replicas:
                await _until(lambda r=router: remote(r) == 0, "the counts to drain")
    return worst


def test_shared_counts_stop_replicas_herding(bus: NatsServer) -> None:
    """Rounds of 3 cold requests, one per replica, over 4 endpoints. Synced, no endpoint ever
    has two (max/mean 1.0); unsynced, each replica sees 4 idle endpoints and their blind picks
    collide (max 2 or 3) in most rounds."""

    async def body() -> None:
        async with _replicas(bus.url, 3) as replicas:
            synced = await _herd(replicas, 10, settle=True)
        assert synced == [1] * 10, synced
        alone: list[tuple[Router, ClusterSync | None]] = [
            (cluster_router(k), None) for k in range(3)
        ]
        unsynced = await _herd(alone, 10, settle=False)
        assert sum(w > 1 for w in unsynced) >= 3, unsynced
        print(f"max requests on one endpoint per round: synced {synced}, unsynced {unsynced}")

    run(body)


def test_counts_of_a_dead_replica_expire(bus: NatsServer) -> None:
    async def body() -> None:
        async with _replicas(bus.url, 2, heartbeat_s=0.1, load_ttl_s=0.5) as replicas:
            (r0, s0), (r1, s1) = replicas
            d = r0.pick(tokens=_prompt(7))
            d.started()

            def remote() -> int:
                return sum(e["remote_in_flight_requests"] for e in r1.pool.endpoints())

            await _until(lambda: remote() == 1, "the count to arrive")
            # Replica 0 dies without a word (its tasks stop, its request never finishes).
            for task in s0._tasks:  # the test kills the replica abruptly
                task.cancel()
            await _until(lambda: remote() == 0, "the dead replica's count to expire", 5)
            assert s1.stats()["replicas_expired"] == 1
            d.finished()

    run(body)


def test_a_late_replica_catches_up(bus: NatsServer) -> None:
    async def body() -> None:
        async with _replicas(bus.url, 1) as replicas:
            (r0, _s0) = replicas[0]
            for i in range(20):
                d = r0.pick(tokens=_prompt(i), session_id=f"s{i}")
                d.started()
                d.finished()
            await asyncio.sleep(0.1)  # flushed into the history
            late = cluster_router(seed=9)
            started = time.monotonic()
            sync = ClusterSync(late, servers=bus.url, cluster="t", replica="late")
            await sync.start()
            try:
                await _until(lambda: sync.stats()["sessions_applied"] >= 20, "the catch-up")
                took = time.monotonic() - started
                assert sync.stats()["records_applied"] == 20
                for i in range(20):
                    assert late.pick(tokens=_prompt(i)).cached == 256
                assert late.pick(tokens=_prompt(99), session_id="s3").endpoint == (
                    r0.pick(tokens=_prompt(3)).endpoint
                )
                print(f"late replica caught up in {took * 1000:.0f} ms")
            finally:
                await sync.stop()

    run(body)


def test_losing_the_bus_degrades_to_local_routing_and_recovers(bus: NatsServer) -> None:
    async def body() -> None:
        async with _replicas(bus.url, 2) as replicas:
            (r0, s0), (r1, s1) = replicas
            bus.stop()
            await _until(lambda: not s0.stats()["connected"], "the disconnect")
            # Routing goes on, on local state only, with no error.
            for i in range(50):
                d = r0.pick(tokens=_prompt(i))
                d.started()
                d.finished()
            await asyncio.sleep(0.1)
            stats = s0.stats()
            assert stats["disconnects"] >= 1 and stats["publish_failures"] >= 1
            bus.start()
            await _until(
                lambda: s0.stats()["connected"] and s1.stats()["connected"], "reconnects", 20
            )
            d = r0.pick(tokens=_prompt(500))
            d.started()
            d.finished()
            await _until(lambda: r1.pick(tokens=_prompt(500)).cached == 256, "sync again")
            assert s0.stats()["reconnects"] >= 1

    run(body)


def test_a_replica_started_without_a_bus_routes_alone() -> None:
    async def body() -> None:
        router = cluster_router(0)
        sync = ClusterSync(router, servers=f"nats://127.0.0.1:{free_port()}", replica="x")
        await sync.start()
        for i in range(10):
            d = router.pick(tokens=_prompt(i))
            d.started()
            d.finished()
        await asyncio.sleep(0.1)
        assert not sync.stats()["connected"]
        assert sync.stats()["publish_failures"] >= 1
        await sync.stop()

    run(body)


def test_hostile_bytes_on_the_subject_are_counted_not_applied(bus: NatsServer) -> None:
    import nats

    async def body() -> None:
        async with _replicas(bus.url, 1) as replicas:
            router, sync = replicas[0]
            nc = await nats.connect(bus.url)
            for payload in [b"", b"LSYN", b"LSYN\x01" + os.urandom(64), os.urandom(300)]:
                await nc.publish("llmsched.t.sync", payload)
            await nc.flush()
            await _until(lambda: sync.stats()["malformed_in"] == 4, "the malformed batches")
            await nc.close()
            assert sync.stats()["records_applied"] == 0
            assert router.pick(tokens=_prompt(1)).cached == 0

    run(body)


def test_a_replica_that_hashes_otherwise_is_warned_about_and_its_records_skipped(
    bus: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Probe 48 F5: a replica with another block size synced silently, its records counted as
    applied though they could never match."""

    async def body() -> None:
        odd = Router(
            EndpointPool(ENDPOINTS, stale_policy="ignore"), PrefixIndex(block_size=32), CONFIG
        )
        async with _replicas(bus.url, 1) as replicas:
            router, sync = replicas[0]
            other = ClusterSync(odd, servers=bus.url, cluster="t", replica="odd")
            await other.start()
            try:
                # Records made before the connection are drained into nothing, by design.
                await _until(lambda: other.stats()["connected"], "the odd replica's connection")
                prompt = _prompt(1)
                d = odd.pick(tokens=prompt, session_id="chat-9")
                d.started()
                d.finished()
                await _until(lambda: sync.stats()["records_mismatched"] >= 1, "the skip")
                stats = sync.stats()
                assert stats["mismatched_in"] >= 1 and stats["records_applied"] == 0, stats
                assert router.pick(tokens=prompt).cached == 0
                # Its session binding still applies: sessions do not depend on hashing.
                assert router.pick(tokens=_prompt(2), session_id="chat-9").endpoint == d.endpoint
            finally:
                await other.stop()
        warned = [r for r in caplog.records if "hashes prompts otherwise" in r.getMessage()]
        assert len(warned) == 1

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body)


def test_replica_sync_arguments_are_checked() -> None:
    router = cluster_router(0)
    good = {"incarnation": 1, "journal_limit": 10, "load_ttl_s": 3.0, "history_limit": 10}
    for bad, name in (
        ({"incarnation": -1}, "incarnation"),
        ({"incarnation": 2**64}, "incarnation"),
        ({"journal_limit": -1}, "journal_limit"),
        ({"history_limit": -5}, "history_limit"),
        ({"load_ttl_s": float("nan")}, "load_ttl_s"),
        ({"load_ttl_s": -1.0}, "load_ttl_s"),
    ):
        with pytest.raises((InvalidValueError, InvalidTypeError), match=name):
            router.replica_sync("r", **{**good, **bad})  # type: ignore[arg-type]
    for name in ("", "x" * 70_000):
        with pytest.raises(InvalidValueError, match="replica"):
            router.replica_sync(name, **good)  # type: ignore[arg-type]


def test_settings_are_checked() -> None:
    router = cluster_router(0)
    with pytest.raises(ConfigError, match="load_ttl_s"):
        ClusterSync(router, heartbeat_s=2.0, load_ttl_s=1.0)
    with pytest.raises(ConfigError, match="cluster"):
        ClusterSync(router, cluster="a.b")
    with pytest.raises(TypeError):
        ClusterSync("router")  # type: ignore[arg-type]


def test_tenant_fairness_holds_across_replicas(bus: NatsServer) -> None:
    """VTC on two replicas: replica 0 serves tenant "heavy" a lot; replica 1, with one queued
    request of each tenant (heavy first), then serves "light" first, once the usage arrives.
    Unsynced, it serves in arrival order."""
    from llmsched import FlowController, FlowRequest
    from llmsched.cluster import Usage

    config = {
        "saturation": {"type": "concurrency", "max_requests": 1000},
        "default_band": {"fairness": {"type": "vtc"}},
    }

    def link(sync: ClusterSync, flow: FlowController) -> None:
        def collect() -> Usage:
            return {"keys": {}, "tenants": flow.drain_service()}

        def apply(usage: Usage) -> None:
            for tenant, priority, prompt, output in usage["tenants"]:
                flow.charge_remote(tenant, priority, prompt_tokens=prompt, output_tokens=output)

        sync.share_usage(collect, apply)

    async def order(synced: bool) -> list[int]:
        flows = [FlowController(config), FlowController(config)]
        syncs = []
        for i, flow in enumerate(flows):
            sync = ClusterSync(cluster_router(i), servers=bus.url, cluster="f", replica=f"r{i}")
            if synced:
                link(sync, flow)
                await sync.start()
            syncs.append(sync)
        try:
            if synced:
                await _until(lambda: all(s.stats()["connected"] for s in syncs), "connections")
            busy, fair = flows
            fair.enqueue(FlowRequest(1, tenant="heavy", prompt_tokens=100))
            fair.enqueue(FlowRequest(2, tenant="light", prompt_tokens=100))
            for i in range(10):
                busy.enqueue(FlowRequest(100 + i, tenant="heavy", prompt_tokens=5_000))
                busy.dispatch()
            if synced:
                await _until(lambda: syncs[1].stats()["usage_in"] >= 1, "the usage")
            got = []
            while (decision := fair.dispatch()) is not None:
                got.append(decision.id)
            return got
        finally:
            for sync in syncs:
                await sync.stop()

    async def body() -> None:
        assert await order(synced=False) == [1, 2]
        assert await order(synced=True) == [2, 1]

    run(body)
