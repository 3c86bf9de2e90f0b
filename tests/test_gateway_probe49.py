"""Probe 49's finding on the gateway (F14): an engine's ``usage.completion_tokens`` is charged to
flow control when the answer ends. A count beyond 64 bits signed was refused by the flow
controller after the Python plane had marked the slot released, so each such answer leaked a
flow-control slot for good (with ``max_requests: 1``, the next request waited forever); the
native plane charged it and wrapped the tenant's service counter. A count no answer can hold is
now charged as none, on both planes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    current_plane,
    plane,
    raw_request,
    run,
)

from llmsched.gateway import Gateway, NativeGateway, make_gateway

pytestmark = pytest.mark.usefixtures("plane")


@contextlib.asynccontextmanager
async def _in_front_of(
    answer: bytes, flow: Mapping[str, object]
) -> AsyncIterator[Gateway | NativeGateway]:
    """A gateway with flow control ``flow`` in front of one engine that answers every POST
    with ``answer`` (raw bytes, then it closes the connection) and a probe with an empty 200."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            probe = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            writer.write(answer if head.startswith(b"POST") else probe)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = {
        "engines": [{"host": "127.0.0.1", "port": port, "model": MODEL}],
        "models": [MODEL],
        "block_size": 4,
        "listen": {"port": 0},
        "scrape": {"enabled": False},
        "flow": flow,
    }
    gateway = make_gateway(config, data_plane=current_plane())
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("count", [2**63, 2**64 - 1, 10**400], ids=["2^63", "2^64-1", "10^400"])
def test_a_huge_usage_count_from_the_engine_leaks_no_flow_slot(count: int) -> None:
    usage = b'{"choices":[{"text":"hi"}],"usage":{"completion_tokens":%d}}' % count
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    # One slot, queued requests waiting a minute: a leaked slot would hold every later
    # request in the queue (run()'s 30 s limit ends the test first).
    flow = {"saturation": {"type": "concurrency", "max_requests": 1}}

    async def body_() -> None:
        async with _in_front_of(answer + usage, flow) as gateway:
            assert gateway.flow is not None
            for _ in range(3):
                status, text = await raw_request(gateway.port, body)
                assert status == 200, text
                assert gateway.flow.running_count() == 0
            service = [f["service_tokens"] for f in gateway.flow.metrics()["flows"]]
            # At most the prompt's tokens: the engine's count was not believed.
            assert service and all(s < 2**32 for s in service), service

    run(body_())
