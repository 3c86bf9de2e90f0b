"""Probe 47 F15: the request bodies being received share one budget,
``limits.max_body_bytes_in_flight`` (per-connection limits alone let slow uploads hold
``max_connections`` x ``max_body_bytes``). A body takes its declared length at once (or its
chunks as they arrive) and gives it back on every way out: read whole, refused, timed out,
its client gone. Past the budget: 503 ``body-capacity`` with ``Retry-After``. Both planes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from _gateway_harness import MODEL, Rig, plane, rig, run  # noqa: F401 (the fixture)

from llmsched.errors import ConfigError
from llmsched.gateway import load_config
from llmsched.gateway.config import LimitsConfig

pytestmark = pytest.mark.usefixtures("plane")

LIMITS = {"max_body_bytes": 2048, "max_body_bytes_in_flight": 3072, "body_timeout_s": 3.0}
GAUGE = "llmsched_gateway_body_bytes_in_flight"


def test_the_budget_is_at_least_one_body_of_the_largest_size() -> None:
    base = {"engines": [{"host": "h", "port": 1}], "models": [MODEL]}
    assert load_config(base).limits.max_body_bytes_in_flight == 256 << 20
    assert LimitsConfig().max_body_bytes_in_flight >= LimitsConfig().max_body_bytes
    with pytest.raises(ConfigError) as refused:
        load_config({**base, "limits": {"max_body_bytes": 4096, "max_body_bytes_in_flight": 4095}})
    assert str(refused.value).startswith(
        "limits.max_body_bytes_in_flight: must be at least limits.max_body_bytes (4096), got 4095:"
    )
    with pytest.raises(ConfigError, match=r"got 268435456 \(the default\)"):
        load_config({**base, "limits": {"max_body_bytes": 512 << 20}})


async def _head(port: int, headers: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
        f"{headers}\r\n".encode()
    )
    await writer.drain()
    return reader, writer


@contextlib.asynccontextmanager
async def _partial(port: int, declared: int, sent: int) -> AsyncIterator[asyncio.StreamReader]:
    """A body declared ``declared`` bytes long of which ``sent`` are sent, until closed."""
    reader, writer = await _head(port, f"Content-Length: {declared}\r\n")
    writer.write(b" " * sent)
    await writer.drain()
    try:
        yield reader
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, str]:
    """The status and the head and body (lowercased) of an answer read to its close."""
    data = await asyncio.wait_for(reader.read(), 10)
    return int(data.split(b" ", 2)[1]), data.decode(errors="replace").lower()


async def _whole(port: int, length: int) -> tuple[int, str]:
    """A completion whose ``length``-byte body is sent whole before anything is read (as
    Python's urllib sends): the client must read its answer, not a reset."""
    body = json.dumps({"model": MODEL, "prompt": "x" * length}).encode()[:length]
    reader, writer = await _head(port, f"Content-Length: {length}\r\nConnection: close\r\n")
    writer.write(body)
    await writer.drain()
    try:
        return await _answer(reader)
    finally:
        writer.close()


async def _reaches(r: Rig, want: float) -> None:
    """Waits until the gauge reads ``want`` (never below zero meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (seen := r.metric(GAUGE)) != want:
        assert seen >= 0
        assert loop.time() < deadline, f"{GAUGE} is {seen}, not {want}"
        await asyncio.sleep(0.02)


def _budget_test(test: Callable[[Rig], Awaitable[None]]) -> None:
    async def body() -> None:
        async with rig(engines=1, limits=LIMITS) as r:
            await test(r)
            await _reaches(r, 0)

    run(body())


def test_a_declared_body_past_the_budget_gets_503_at_once() -> None:
    async def test(r: Rig) -> None:
        port = r.gateway.port
        async with _partial(port, 2048, 100):
            await _reaches(r, 2048)  # a declared length counts whole from the start
            status, answer = await _whole(port, 2000)  # 1,024 left
            assert status == 503, answer
            assert "x-llmsched-dropped-reason: body-capacity" in answer
            assert "retry-after: 1" in answer
            assert '"type": "service_unavailable"' in answer.replace('":"', '": "')
            assert "max_body_bytes_in_flight" in answer
            # A body that fits is served; its bytes go back once it is read.
            assert (await r.complete("hi")).status == 200
            assert r.metric(GAUGE) == 2048
        assert r.metric("llmsched_gateway_rejections_total", reason="body-capacity") == 1
        assert len(r.engines[0].received) == 1

    _budget_test(test)


def test_a_chunked_body_is_refused_when_it_passes_the_budget() -> None:
    async def test(r: Rig) -> None:
        port = r.gateway.port
        async with _partial(port, 2048, 10):
            await _reaches(r, 2048)
            reader, writer = await _head(port, "Transfer-Encoding: chunked\r\n")
            chunk = b"200\r\n" + b" " * 0x200 + b"\r\n"
            writer.write(chunk)  # 512 of the 1,024 left
            await writer.drain()
            await _reaches(r, 2048 + 512)
            writer.write(chunk * 2)  # past the budget
            status, answer = await _answer(reader)
            writer.close()
            assert status == 503, answer
            assert "body-capacity" in answer
            await _reaches(r, 2048)  # the refused body gave its bytes back
        assert r.metric("llmsched_gateway_rejections_total", reason="body-capacity") == 1

    _budget_test(test)


def test_every_way_out_gives_the_bytes_back() -> None:
    async def test(r: Rig) -> None:
        port = r.gateway.port
        # The client leaves mid-body.
        async with _partial(port, 2048, 100):
            await _reaches(r, 2048)
        await _reaches(r, 0)
        # The body times out: 408.
        async with _partial(port, 1000, 10) as reader:
            await _reaches(r, 1000)
            status, _ = await _answer(reader)
            assert status == 408
        await _reaches(r, 0)
        # Too large, declared (nothing taken) and found while reading (what was taken).
        status, answer = await _whole(port, 4000)
        assert status == 413, answer
        reader, writer = await _head(port, "Transfer-Encoding: chunked\r\n")
        writer.write((b"400\r\n" + b" " * 0x400 + b"\r\n") * 3)
        status, answer = await _answer(reader)
        writer.close()
        assert status == 413, answer
        await _reaches(r, 0)
        assert r.metric("llmsched_gateway_rejections_total", reason="request_timeout") == 1
        assert r.metric("llmsched_gateway_rejections_total", reason="request_too_large") == 2
        assert not r.engines[0].received

    _budget_test(test)


def test_a_request_in_flight_holds_no_body_bytes() -> None:
    """The budget bounds bodies being read, not requests in flight (flow control does)."""

    async def test(r: Rig) -> None:
        r.engines[0].mode = "stall"
        sent = asyncio.create_task(r.complete("x" * 1500))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not r.engines[0].received:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        assert r.metric(GAUGE) == 0
        # Two more bodies of the largest size fit meanwhile (3 KiB budget, 2 KiB each, one
        # at a time): the stalled request holds none of it.
        async with _partial(r.gateway.port, 2048, 1):
            await _reaches(r, 2048)
        sent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sent

    _budget_test(test)
