"""The gateway's HTTP/1.1 handling (client and engine legs), on both
data planes."""

from __future__ import annotations

import asyncio
import contextlib
import json

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


@pytest.mark.parametrize(
    ("framing", "sent"),
    [
        ("Content-Length: 100\r\n", BODY[:10]),
        ("Content-Length: 100\r\n", ""),
        ("Transfer-Encoding: chunked\r\n", _chunked(BODY)[:20]),
    ],
    ids=["length", "head_only", "chunked"],
)
def test_a_client_half_closing_mid_body_gets_a_400_naming_the_body(framing: str, sent: str) -> None:
    """Probe 74: a client that shuts its write side down in the middle of its request's body
    got nothing from the Python plane (aiohttp closes the connection at the end of input); the
    native plane answered 400. Both answer it now, on the half left open."""

    async def go() -> None:
        async with rig(1) as r:
            data = await _exchange_half_closed(
                r.gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    f"Content-Type: application/json\r\n{framing}\r\n{sent}"
                ).encode(),
            )
            head, _, payload = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), data[:200]
            error = json.loads(payload)["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == "the body did not arrive"
            assert not r.engines[0].received

    run(go())


def test_a_client_half_closing_after_its_request_is_taken_for_gone() -> None:
    """A client's close of its write side after a whole request is how a client that leaves
    looks too: both planes end the connection (and the request) rather than answer it."""

    async def go() -> None:
        async with rig(1) as r:
            data = await _exchange_half_closed(
                r.gateway.port,
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: g\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
                    f"\r\n{BODY}"
                ).encode(),
            )
            assert data == b""

    run(go())


async def _exchange_half_closed(port: int, data: bytes) -> bytes:
    """Sends ``data``, shuts the write side down and reads until the gateway closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


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


async def _exchange_until_cut(port: int, data: bytes) -> bytes:
    """As :func:`_exchange`, and a reset ends the answer too (what was read before it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            with contextlib.suppress(ConnectionResetError):
                while chunk := await reader.read(1 << 16):
                    received += chunk
        return received
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


_STREAM_BODY = f'{{"model":"{MODEL}","prompt":"hello","stream":true}}'
_STREAM_REQUEST = (
    "POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
    f"Connection: close\r\nContent-Length: {len(_STREAM_BODY)}\r\n\r\n{_STREAM_BODY}"
).encode()


@pytest.mark.parametrize("status", [b"200 OK", b"400 Bad Request"])
def test_a_json_answer_to_a_stream_request_cut_within_its_length_is_a_502(
    status: bytes,
) -> None:
    # An engine answers a stream request with JSON (its refusal, or no stream) framed by a
    # length, and closes 40 bytes short. The native plane relayed it as a stream: the head
    # and the bytes it had, then its SSE error event, which filled the 40 bytes left, so the
    # client read a whole answer of the engine's length (JSON with an event glued on).
    payload = b'{"error":{"message":"bad field","type":"BadRequestError","code":400}}'
    answer = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (len(payload) + 40) + payload
    )

    async def go() -> None:
        async with in_front_of_raw(answer) as gateway:
            data = await _exchange(gateway.port, _STREAM_REQUEST)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 502"), data[:300]
            assert json.loads(body)["error"]["message"].startswith(
                "the engine's answer was cut off"
            )

    run(go())


def test_a_long_json_answer_to_a_stream_request_cut_short_stays_short() -> None:
    # Past the 8 MiB read whole, a JSON answer is relayed as it comes, under the engine's
    # length: cut, the client must get fewer bytes than that length, never an error event
    # that makes up the difference.
    size = 9 << 20
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % (size + 50)
        + b'{"choices":[{"text":"'
        + b"x" * (size - 21)
    )

    async def go() -> None:
        async with in_front_of_raw(answer) as gateway:
            data = await _exchange_until_cut(gateway.port, _STREAM_REQUEST)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), data[:300]
            declared = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert declared == size + 50
            assert len(body) < declared
            assert b"data: " not in body[-200:]

    run(go())


@pytest.mark.parametrize(
    ("key", "path"), [("wrong-key-0123", "/v1/completions"), ("good-key-0123", "/v1/nowhere")]
)
def test_a_request_refused_before_its_awaited_body_leaves_no_body_to_read(
    key: str, path: str
) -> None:
    # A client sending `Expect: 100-continue` waits for the go-ahead before its body; refused
    # first (an API key the gateway does not know), it sends no body, and may send its next
    # request on the connection. The native plane read on for the refused body: the next
    # request's first bytes were taken for it and the rest answered with a bare 400.
    async def go() -> None:
        keys = {"good-key-0123": {"tenant": "t"}}
        async with rig(1, auth={"api_keys": keys}) as r:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.gateway.port)
            try:
                writer.write(
                    (
                        f"POST {path} HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {key}\r\n"
                        "Content-Type: application/json\r\nExpect: 100-continue\r\n"
                        f"Content-Length: {len(BODY)}\r\n\r\n"
                    ).encode()
                )
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
                if head.startswith(b"HTTP/1.1 100"):
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
                assert head.split(b" ", 2)[1] in (b"401", b"404"), head
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                rest = b""
                with contextlib.suppress(ConnectionError):
                    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: g\r\n")
                    writer.write(f"Authorization: Bearer {key}\r\n\r\n".encode())
                    await writer.drain()
                    rest = await asyncio.wait_for(reader.read(200), timeout=10)
                # The connection closed, or the next request answered as sent.
                assert not rest or rest.split(b" ", 2)[1] in (b"200", b"401"), rest
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            assert not r.engines[0].received

    run(go())
