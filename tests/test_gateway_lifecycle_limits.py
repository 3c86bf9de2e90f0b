"""The gateway's limits and life cycle, each on the planes it concerns: a client that does not
read its answer is cut (F9), a stop never waits for one forever (F10), the request's deadline
passing before the engine's first byte is its 504 (F11), connections over the cap get their
503 (F3), a failed start leaves nothing behind (F7), and the discovery watcher outlives any
error (F8's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import uvloop
import yaml
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    Rig,
    current_plane,
    plane,
    rig,
    run,
)

import llmsched.gateway.app
from llmsched.errors import ConfigError
from llmsched.gateway import Gateway
from llmsched.gateway.config import read_engines_file
from llmsched.integrations import EngineSpec

T = TypeVar("T")
pytestmark = pytest.mark.usefixtures("plane")

# A JSON answer the gateway reads whole (under 8 MiB) and more than loopback's socket buffers
# take (the gateway's send buffer grows to 4 MiB): most of it waits in the gateway.
BIG_JSON = 7 << 20


def run_uv(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a test coroutine on uvloop, the loop ``llmsched serve`` runs the Python plane on
    (some of its behaviour differs from asyncio's)."""
    return uvloop.run(asyncio.wait_for(coro, timeout=30))


class Engine:
    """A raw-socket engine: each request gets ``head`` then ``body`` (bytes), then the
    connection is held open (``hold``) or closed."""

    def __init__(self, head: bytes, body: bytes = b"", *, hold: bool = False) -> None:
        self.head, self.body, self.hold = head, body, hold
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Engine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()

    def spec(self) -> dict[str, Any]:
        assert self._server is not None
        return {"host": "127.0.0.1", "port": self._server.sockets[0].getsockname()[1]}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            length = 0
            await reader.readline()
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(self.head + self.body)
            await writer.drain()
            if self.hold:
                await asyncio.sleep(3600)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()


def json_engine(size: int) -> Engine:
    """An engine answering a JSON body of ``size`` bytes with its Content-Length."""
    body = b'{"choices": [{"text": "' + b"x" * (size - 28) + b'"}]}'
    body += b" " * (size - len(body))
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    return Engine(head, body)


def stream_engine(events: int) -> Engine:
    """An engine answering an event stream of ``events`` events (about 1 KB each) and its
    ``[DONE]``, ended by closing the connection."""
    event = b"data: " + json.dumps({"choices": [{"text": "y" * 1000}]}).encode() + b"\n\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    return Engine(head, event * events + b"data: [DONE]\n\n")


@contextlib.asynccontextmanager
async def gateway_before(engine: Engine, **overrides: Any) -> AsyncIterator[Rig]:
    """A gateway of the running test's plane in front of ``engine`` (and no fake engine)."""
    async with engine, rig(0, extra_engines=[engine.spec()], **overrides) as r:
        yield r


async def unread_request(port: int, stream: bool = False) -> socket.socket:
    """A client that sends a completion and reads nothing (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"model": MODEL, "prompt": "hi", "stream": stream}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    await asyncio.get_running_loop().sock_sendall(sock, head + body)
    return sock


async def read_all(sock: socket.socket, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Everything the connection still delivers, and whether it ended with a reset."""
    loop = asyncio.get_running_loop()
    received = b""
    try:
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), timeout)
            if not chunk:
                return received, False
            received += chunk
    except ConnectionResetError:
        return received, True
    finally:
        sock.close()


def rejections(r: Rig, reason: str) -> float:
    return r.metric("llmsched_gateway_rejections_total", reason=reason)


# -- F9: writes to a client that does not read are bounded --------------------------------


def test_a_json_answer_the_client_does_not_read_is_cut_after_idle_timeout_s() -> None:
    """F9: a client that never reads its (nearly 8 MiB) JSON answer held it in the gateway
    for as long as it kept its connection; now the connection is reset after
    ``limits.idle_timeout_s`` without progress, counted as ``send_timeout``."""

    async def body() -> None:
        async with gateway_before(json_engine(BIG_JSON), limits={"idle_timeout_s": 0.5}) as r:
            sock = await unread_request(r.gateway.port)
            started = time.monotonic()
            while rejections(r, "send_timeout") == 0:
                assert time.monotonic() - started < 5, "the stalled client was never cut"
                await asyncio.sleep(0.05)
            received, _ = await read_all(sock)
            assert len(received) < BIG_JSON
            assert rejections(r, "send_timeout") == 1
            assert rejections(r, "timeout") == 0

    run(body())


def test_an_answer_still_unwritten_at_total_s_is_cut() -> None:
    """F9: the whole-request deadline ``timeouts.total_s`` covers writing the answer too."""

    async def body() -> None:
        async with gateway_before(
            json_engine(BIG_JSON), limits={"idle_timeout_s": 60}, timeouts={"total_s": 1.0}
        ) as r:
            sock = await unread_request(r.gateway.port)
            started = time.monotonic()
            while rejections(r, "timeout") == 0:
                assert time.monotonic() - started < 5, "the deadline did not cut the write"
                await asyncio.sleep(0.05)
            assert time.monotonic() - started >= 0.8
            received, _ = await read_all(sock)
            assert len(received) < BIG_JSON
            assert rejections(r, "send_timeout") == 0

    run(body())


def test_a_stream_to_a_client_that_stopped_reading_is_cut() -> None:
    """F9: a stream gets backpressure; a client that stopped reading is cut after
    ``limits.idle_timeout_s`` all the same (the engine's connection is closed with it)."""

    async def body() -> None:
        async with gateway_before(stream_engine(20_000), limits={"idle_timeout_s": 0.5}) as r:
            sock = await unread_request(r.gateway.port, stream=True)
            started = time.monotonic()
            while rejections(r, "send_timeout") == 0:
                assert time.monotonic() - started < 5, "the stalled stream was never cut"
                await asyncio.sleep(0.05)
            received, _ = await read_all(sock)
            assert b"[DONE]" not in received

    run(body())


def test_a_client_reading_in_bursts_is_not_cut() -> None:
    """A client that reads makes progress: never cut by the stall bound, though its answer
    takes longer than ``limits.idle_timeout_s`` to go out. (Progress is seen in steps the
    kernel sets: a write goes on once a good part of the socket's send buffer, up to 4 MiB
    by default, has been taken.)"""

    async def body() -> None:
        async with gateway_before(json_engine(BIG_JSON), limits={"idle_timeout_s": 1.0}) as r:
            sock = await unread_request(r.gateway.port)
            loop = asyncio.get_running_loop()
            received = b""
            started = time.monotonic()
            await asyncio.sleep(0.6)
            while len(received) < BIG_JSON - (2 << 20):
                burst = len(received) + (2 << 20)
                while len(received) < burst:
                    received += await loop.sock_recv(sock, 1 << 20)
                await asyncio.sleep(0.6)
            assert time.monotonic() - started > 1.5
            rest, reset = await read_all(sock)
            assert not reset
            assert BIG_JSON < len(received + rest) < BIG_JSON + 4096  # the head too
            assert rejections(r, "send_timeout") == 0

    run(body())


# -- F10: a stop is bounded -----------------------------------------------------------------


@pytest.mark.timeout(60)  # the bug it checks was a hang
@pytest.mark.python_plane_only("the native plane cuts every connection at stop")
def test_stop_resets_what_is_left_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """F10: on uvloop (as ``llmsched serve`` runs), a stop waited forever for a client that
    does not read its answer; now what is left after the grace is reset."""
    monkeypatch.setattr(llmsched.gateway.app, "_SHUTDOWN_GRACE_S", 0.5, raising=False)

    async def body() -> None:
        async with json_engine(BIG_JSON) as engine:
            config = {
                "engines": [engine.spec()],
                "models": [MODEL],
                "listen": {"port": 0},
                "scrape": {"enabled": False},
                "limits": {"idle_timeout_s": 60},
            }
            gateway = Gateway(config)
            await gateway.start()
            sock = await unread_request(gateway.port)
            await asyncio.sleep(0.5)  # the answer is waiting in the gateway
            started = time.monotonic()
            await asyncio.wait_for(gateway.stop(), 10)
            assert time.monotonic() - started < 5
            received, _ = await read_all(sock)
            assert len(received) < BIG_JSON

    run_uv(body())


# -- F11: the deadline before the first byte is a 504 ------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_total_s_passing_before_the_first_byte_is_the_requests_504(stream: bool) -> None:
    """F11: the engine sends its status line, then nothing; ``timeouts.total_s`` passes: a
    504 naming total_s, counted as the request's timeout, not as the engine's truncation."""
    if stream:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    else:
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            b"Connection: close\r\n\r\n"
        )

    async def body() -> None:
        async with gateway_before(Engine(head, hold=True), timeouts={"total_s": 0.5}) as r:
            payload = {"model": MODEL, "prompt": "hi", "stream": stream}
            async with r.client.post(r.url("/v1/completions"), json=payload) as response:
                error = (await response.json())["error"]
            assert response.status == 504, error
            assert error["type"] == "timeout"
            assert "timeouts.total_s" in error["message"]
            assert rejections(r, "timeout") == 1
            assert r.metric("llmsched_gateway_rejections_total", reason="upstream_error") == 0
            worker = r.gateway.config.engines[0].worker_id
            truncated = r.metric(
                "llmsched_gateway_upstream_errors_total", endpoint=worker, kind="truncated"
            )
            assert truncated == 0
            cut = r.metric(
                "llmsched_gateway_truncated_answers_total", endpoint=worker, outcome="error"
            )
            assert cut == 0

    run(body())


def test_total_s_passing_before_the_status_line_names_total_s() -> None:
    """F11: no status line before ``timeouts.total_s`` (``read_s`` far longer): the 504 names
    total_s, not read_s."""

    async def body() -> None:
        async with gateway_before(
            Engine(b"", hold=True), timeouts={"total_s": 0.5, "read_s": 60}
        ) as r:
            status, text = await asyncio.wait_for(_post(r), 10)
            assert status == 504
            assert "timeouts.total_s" in text and "read_s" not in text

    run_uv(body()) if current_plane() == "python" else run(body())


async def _post(r: Rig) -> tuple[int, str]:
    payload = {"model": MODEL, "prompt": "hi"}
    async with r.client.post(r.url("/v1/completions"), json=payload) as response:
        return response.status, await response.text()


SLICES = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 4}}


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_total_s_passing_mid_stream_is_told_as_the_requests_timeout(sliced: bool) -> None:
    """The engine sends a stream's first event, then nothing; ``timeouts.total_s`` passes
    with part of the answer sent. The client was told "the engine's answer was cut off"
    (502), blaming the engine for the gateway's own deadline: now the error event is the
    request's timeout (type ``timeout``, code 504, naming total_s), counted as the request's
    ``timeout``, not against the engine."""

    async def body() -> None:
        overrides: dict[str, Any] = {"timeouts": {"total_s": 0.5}}
        if sliced:
            overrides["slices"] = SLICES
        async with rig(engines=1, answer_tokens=100, **overrides) as r:
            r.engines[0].mode = "hang"  # the first event, then silence
            payload = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 12, "stream": True}
            data = b""
            async with r.client.post(r.url("/v1/completions"), json=payload) as response:
                assert response.status == 200
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for piece in response.content.iter_any():
                        data += piece
            events = [e for e in data.decode().split("\n\n") if e.strip()]
            assert "[DONE]" not in data.decode()
            assert len(events) >= 2, events  # part of the answer, then the error event
            error = json.loads(events[-1].removeprefix("data: "))["error"]
            assert error["type"] == "timeout" and error["code"] == 504, error
            assert "timeouts.total_s" in error["message"]
            assert rejections(r, "timeout") == 1
            worker = r.gateway.config.engines[0].worker_id
            errors = "llmsched_gateway_upstream_errors_total"
            assert r.metric(errors, endpoint=worker, kind="truncated") == 0
            assert r.metric(errors, endpoint=worker, kind="slice") == 0
            cut = {"endpoint": worker, "outcome": "sse_error"}
            assert r.metric("llmsched_gateway_truncated_answers_total", **cut) == 1

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_engine_event_past_8_mib_ends_a_sliced_request(stream: bool) -> None:
    """A slice's engine call sends 20 MiB of one event without its blank line and holds the
    connection: the gateway held all of it until the engine closed (here: never). Now an
    event past 8 MiB (the bound of any engine answer read whole) ends the request: a 502
    (nothing went out yet), counted as the engine's error."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    engine = Engine(head, b"data: " + b"x" * (20 << 20), hold=True)

    async def body() -> None:
        async with gateway_before(engine, slices=SLICES) as r:
            payload = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 12, "stream": stream}

            async def ask() -> tuple[int, str]:
                url = r.url("/v1/completions")
                async with r.client.post(url, json=payload) as response:
                    return response.status, await response.text()

            status, text = await asyncio.wait_for(ask(), 15)
            assert status == 502, text
            assert "8 MiB" in json.loads(text)["error"]["message"]
            worker = r.gateway.config.engines[0].worker_id
            errors = "llmsched_gateway_upstream_errors_total"
            assert r.metric(errors, endpoint=worker, kind="slice") == 1

    run(body())


# -- F3: connections over the cap get their 503 -------------------------------------------


@pytest.mark.timeout(60)
def test_connections_over_the_cap_get_a_503_and_close() -> None:
    """F3: on uvloop the Python plane reset connections over ``limits.max_connections``
    without a word; each gets the documented 503 and close, also one whose request (a large
    body) arrived before the refusal was written."""

    async def body() -> None:
        async with rig(1, limits={"max_connections": 2}) as r:
            port = r.gateway.port
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _ in range(100):
                if r.metric("llmsched_gateway_connections") == 2:
                    break
                await asyncio.sleep(0.02)
            big = b"x" * (256 << 10)
            for request in (
                b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n%s"
                % (len(big), big),
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                answer = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
                assert b"too many connections" in answer
            assert r.metric("llmsched_gateway_connections_refused_total") == 2
            for _, writer in held:
                writer.close()

    if current_plane() == "python":
        run_uv(body())
    else:
        run(body())


# -- F7: a failed start ------------------------------------------------------------------


@pytest.mark.python_plane_only("the native plane's start is checked in test_gateway_config")
def test_a_failed_start_closes_the_upstream_session_and_names_listen_host() -> None:
    """F7: a start that cannot listen leaves no upstream session open (asyncio warned
    "Unclosed client session" after the error) and a host that does not resolve is named."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    base: dict[str, Any] = {
        "engines": [{"host": "127.0.0.1", "port": 9}],
        "models": [MODEL],
        "scrape": {"enabled": False},
    }

    async def body() -> None:
        gateway = Gateway({**base, "listen": {"host": "127.0.0.1", "port": port}})
        with pytest.raises(OSError):
            await gateway.start()
        assert gateway._session is None
        gateway = Gateway({**base, "listen": {"host": "no.such.host.invalid", "port": 0}})
        with pytest.raises(ConfigError, match=r"^listen\.host: cannot resolve"):
            await gateway.start()
        assert gateway._session is None

    try:
        run(body())
        gc.collect()
    finally:
        busy.close()


@pytest.mark.python_plane_only("the native plane's start is checked in test_gateway_config")
def test_serve_that_cannot_listen_says_one_line(tmp_path: Path) -> None:
    """F7: ``llmsched serve`` with a host that does not resolve prints one line naming
    listen.host, without asyncio's "Unclosed client session" after it."""
    path = tmp_path / "gateway.yaml"
    config = {
        "engines": [{"host": "127.0.0.1", "port": 9}],
        "models": [MODEL],
        "scrape": {"enabled": False},
        "data_plane": "python",
        "listen": {"host": "no.such.host.invalid", "port": 0},
    }
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 2
    assert output.startswith("llmsched serve: listen.host: cannot resolve"), output
    assert "Unclosed" not in output and len(output.splitlines()) == 1, output


# -- F8: the discovery watcher outlives any error ----------------------------------------


@pytest.mark.python_plane_only("the native plane's watcher is native.py's")
def test_the_discovery_watcher_survives_a_recursion_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RecursionError (or any error) reading the discovery file is counted and keeps the
    current engines; the watcher lives on and applies the next good file."""
    from llmsched.testing.openai_engine import FakeOpenAIEngine

    path = tmp_path / "engines.yaml"
    failures = [RecursionError("maximum recursion depth exceeded")]

    def flaky(path: Path, *, max_bytes: int) -> tuple[EngineSpec, ...]:
        if failures:
            raise failures.pop()
        return read_engines_file(path, max_bytes=max_bytes)

    async def body() -> None:
        a, b = FakeOpenAIEngine(model=MODEL), FakeOpenAIEngine(model=MODEL)
        await a.start()
        await b.start()
        try:
            path.write_text(yaml.safe_dump([a.spec()]))
            config = {
                "models": [MODEL],
                "listen": {"port": 0},
                "scrape": {"enabled": False},
                "discovery": {"file": str(path), "interval_s": 0.05},
            }
            async with Gateway(config) as gateway:
                await asyncio.sleep(0.3)
                monkeypatch.setattr(llmsched.gateway.app, "read_engines_file", flaky)
                path.write_text(yaml.safe_dump([b.spec()]) + "\n")
                errors = "llmsched_gateway_discovery_errors_total 1.0"
                for _ in range(100):
                    if errors in gateway.metrics.render().decode():
                        break
                    await asyncio.sleep(0.05)
                assert errors in gateway.metrics.render().decode()
                assert [s.worker_id for s in gateway.engines] == [
                    EngineSpec.from_dict(a.spec()).worker_id
                ]
                path.write_text(yaml.safe_dump([b.spec()]) + "\n\n")
                wanted = [EngineSpec.from_dict(b.spec()).worker_id]
                for _ in range(100):
                    if [s.worker_id for s in gateway.engines] == wanted:
                        break
                    await asyncio.sleep(0.05)
                assert [s.worker_id for s in gateway.engines] == wanted
        finally:
            await a.stop()
            await b.stop()

    run(body())
