"""The gateway's HTTP/1.1 handling (client and engine legs), on both
data planes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    in_front_of_raw,
    plane,
    rig,
    run,
)

pytestmark = pytest.mark.usefixtures("plane")


async def _exchange(port: int, data: bytes) -> bytes:
    """Sends ``data`` and reads until the gateway closes the connection (a gateway that
    keeps it open fails the test by its timeout)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def test_a_stream_to_an_http10_keep_alive_client_ends_with_the_connection() -> None:
    # HTTP/1.0 has no chunked coding: a stream ends where its connection closes. The Python
    # plane kept a keep-alive client's connection open, the client waiting for the end.
    async def go() -> None:
        async with rig(1) as r:
            body = f'{{"model":"{MODEL}","prompt":"hello","max_tokens":2,"stream":true}}'
            data = await _exchange(
                r.gateway.port,
                (
                    "POST /v1/completions HTTP/1.0\r\nHost: g\r\n"
                    "Content-Type: application/json\r\nConnection: keep-alive\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode(),
            )
            head, _, payload = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200"), head
            assert b"transfer-encoding" not in head.lower()
            assert payload.rstrip().endswith(b"data: [DONE]")

    run(go())


BODY = f'{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}'


def _chunked(body: str) -> str:
    return f"{len(body):x}\r\n{body}\r\n0\r\n\r\n"


@pytest.mark.parametrize("codings", ["gzip, chunked", "deflate,chunked"])
def test_a_body_in_a_transfer_coding_besides_chunked_is_a_501(codings: str) -> None:
    # Only the chunking was removed: the body went on to be read as JSON still "coded"
    # (a plain one labelled gzip was served, a gzipped one read as not JSON).
    async def go() -> None:
        async with rig(1) as r:
            data = await _exchange(
                r.gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    f"Content-Type: application/json\r\nTransfer-Encoding: {codings}\r\n"
                    f"Connection: close\r\n\r\n{_chunked(BODY)}"
                ).encode(),
            )
            assert data.startswith(b"HTTP/1.1 501"), data[:200]
            assert codings.encode() in data
            assert not r.engines[0].received

    run(go())


def test_a_chunked_body_is_still_served() -> None:
    async def go() -> None:
        async with rig(1) as r:
            data = await _exchange(
                r.gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                    f"Connection: close\r\n\r\n{_chunked(BODY)}"
                ).encode(),
            )
            assert data.startswith(b"HTTP/1.1 200"), data[:200]

    run(go())


@pytest.mark.parametrize(
    ("version", "hosts"),
    [
        ("HTTP/1.1", ""),
        ("HTTP/1.1", "Host: a\r\nHost: b\r\n"),
        ("HTTP/1.0", "Host: a\r\nHost: a\r\n"),
    ],
)
def test_a_request_without_its_one_host_header_is_a_400(version: str, hosts: str) -> None:
    # RFC 9112 3.2; the native plane served them (the Python plane's parser refuses them).
    async def go() -> None:
        async with rig(1) as r:
            data = await _exchange(
                r.gateway.port,
                (
                    f"POST /v1/completions {version}\r\n{hosts}"
                    "Content-Type: application/json\r\nConnection: close\r\n"
                    f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
                ).encode(),
            )
            assert data.split(b" ", 2)[1] == b"400", data[:200]
            assert not r.engines[0].received

    run(go())


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
def test_an_engine_answering_a_generation_with_no_body_status_is_a_502(status: bytes) -> None:
    # A 204 or 304 has no body: no answer a client could use. The native plane passed the
    # status on, an empty "success"; the Python plane read it as an answer cut short.
    answer = b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}"

    async def go() -> None:
        async with in_front_of_raw(answer) as gateway:
            data = await _exchange(
                gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    "Content-Type: application/json\r\nConnection: close\r\n"
                    f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
                ).encode(),
            )
            assert data.startswith(b"HTTP/1.1 502"), data[:200]

    run(go())


def test_the_headers_an_engines_connection_header_names_are_not_relayed() -> None:
    # RFC 9110 7.6.1: they are the engine's hop's only. The native plane passed them on.
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Connection: close, X-Hop\r\nX-Hop: engine-only\r\nX-Kept: yes\r\n\r\n"
        b'data: {"choices":[{"index":0,"text":"hi"}]}\n\ndata: [DONE]\n\n'
    )

    async def go() -> None:
        async with in_front_of_raw(answer) as gateway:
            body = f'{{"model":"{MODEL}","prompt":"hello","stream":true}}'
            data = await _exchange(
                gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    "Content-Type: application/json\r\nConnection: close\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode(),
            )
            head = data.partition(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 200"), head
            assert b"x-hop" not in head
            assert b"data: [done]" in data.lower()

    run(go())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_only_the_bodys_type_coding_and_caching_headers_are_relayed(stream: bool) -> None:
    # Probe 55's open difference: the native plane passed on every engine header (Server,
    # Set-Cookie, an engine-sent x-llmsched-dropped-reason that would pass for the gateway's
    # own); the Python plane passes Content-Type, Content-Encoding and Cache-Control only.
    payload = (
        b'data: {"choices":[{"index":0,"text":"hi"}]}\n\ndata: [DONE]\n\n'
        if stream
        else b'{"choices":[{"index":0,"text":"hi"}],"usage":{"completion_tokens":1}}'
    )
    kind = b"text/event-stream" if stream else b"application/json"
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nCache-Control: no-store\r\n"
        b"Server: engine\r\nSet-Cookie: s=1\r\nX-Llmsched-Dropped-Reason: spoof\r\n"
        b"Content-Length: %d\r\n\r\n" % len(payload) + payload
    )

    async def go() -> None:
        async with in_front_of_raw(answer) as gateway:
            body = f'{{"model":"{MODEL}","prompt":"hello","stream":{str(stream).lower()}}}'
            data = await _exchange(
                gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    "Content-Type: application/json\r\nConnection: close\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode(),
            )
            head = data.partition(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 200"), head
            assert b"cache-control: no-store" in head
            assert b"content-type: " + kind in head
            for header in (b"server: engine", b"set-cookie", b"spoof"):
                assert header not in head, head

    run(go())
