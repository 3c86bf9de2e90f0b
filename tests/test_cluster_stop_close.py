"""``ClusterSync.stop()`` when the connection's close swallows a cancellation, as nats-py's does
while it waits for its reconnect loop (the bus is down): the stop stays bounded and a
cancellation of the stop goes through (``asyncio.wait_for`` around the close waited for the
close it had cancelled to end, so the stop hung as long as the close went on)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

pytest.importorskip("nats", reason="the cluster extra brings nats-py")

from llmsched import EndpointPool, PrefixIndex, Router
from llmsched import cluster as cluster_module
from llmsched.cluster import ClusterSync

GUARD_S = 10.0  # a hang, not a time measured


class SwallowingClient:
    """A bus connection that is down and whose ``close()`` swallows the first cancellation
    (as nats-py's does) and then goes on with a cleanup that does not end until released."""

    is_connected = False

    def __init__(self) -> None:
        self.closing = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = asyncio.Event()

    async def close(self) -> None:
        self.closing.set()
        # nats-py: `except (asyncio.CancelledError, asyncio.TimeoutError): pass`
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # its reconnect loop, which never ends
        await self.release.wait()
        self.closed.set()


def sync_with(client: SwallowingClient) -> ClusterSync:
    router = Router(EndpointPool(["a"], stale_policy="ignore"), PrefixIndex(), "round-robin")
    sync = ClusterSync(router, replica="r")
    sync._nc = client  # type: ignore[assignment]  # connected, as far as stop() knows
    return sync


def test_stop_is_bounded_when_the_close_swallows_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster_module, "_STOP_TIMEOUT_S", 0.05)

    async def body() -> None:
        client = SwallowingClient()
        sync = sync_with(client)
        stopping = asyncio.create_task(sync.stop())
        done, _ = await asyncio.wait((stopping,), timeout=GUARD_S)
        assert stopping in done, "stop() waited on a close that went on"
        stopping.result()
        client.release.set()  # the close, left to end by itself, does
        await asyncio.wait_for(client.closed.wait(), GUARD_S)

    asyncio.run(body())


def test_a_stop_cancelled_during_the_close_is_cancelled() -> None:
    async def body() -> None:
        client = SwallowingClient()
        sync = sync_with(client)
        stopping = asyncio.create_task(sync.stop())
        await client.closing.wait()
        stopping.cancel()
        done, _ = await asyncio.wait((stopping,), timeout=GUARD_S)
        assert stopping in done, "the cancelled stop() ran on with the close"
        assert stopping.cancelled()
        client.release.set()

    asyncio.run(body())
