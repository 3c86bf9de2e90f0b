"""Shared set-up of the gateway tests: fake engines on loopback and a gateway in front."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import yaml

from llmsched.gateway import Gateway, NativeGateway, make_gateway
from llmsched.testing.openai_engine import FakeOpenAIEngine

T = TypeVar("T")
MODEL = "tiny"
PLANES = ("python", "native")

# The data plane the rigs of the running test use (set by the ``plane`` fixture).
_plane = ["python"]


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per data plane; a test marked ``python_plane_only("why")`` is skipped
    on the native plane with that reason."""
    marker = request.node.get_closest_marker("python_plane_only")
    if request.param == "native" and marker is not None:
        pytest.skip(f"native plane: {marker.args[0]}")
    _plane[0] = request.param
    try:
        yield request.param
    finally:
        _plane[0] = "python"


def current_plane() -> str:
    """The data plane of the running test."""
    return _plane[0]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Waits until ``condition()`` holds (an AssertionError after ``timeout`` seconds)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


RUN_TIMEOUT_S = 30.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs one test coroutine on a fresh event loop, failing it after
    :data:`RUN_TIMEOUT_S` (also when the cancellation at the timeout was swallowed and the
    coroutine returned: that is a hang too)."""
    start = time.monotonic()
    result = asyncio.run(asyncio.wait_for(coro, timeout=RUN_TIMEOUT_S))
    elapsed = time.monotonic() - start
    assert elapsed < RUN_TIMEOUT_S, f"the test hung for {elapsed:.1f} s and then ended"
    return result


@contextlib.asynccontextmanager
async def serve_process(config: dict[str, Any], tmp_path: Path) -> AsyncIterator[str]:
    """The real ``llmsched serve`` process with ``config`` on the running test's data plane;
    its URL. It must exit cleanly (status 0) when terminated."""
    async with serve_processes(config, tmp_path, 1) as (url,):
        yield url


@contextlib.asynccontextmanager
async def serve_processes(
    config: dict[str, Any], tmp_path: Path, count: int
) -> AsyncIterator[list[str]]:
    """``count`` real ``llmsched serve`` processes with ``config`` on the running test's data
    plane, started side by side (a start is mostly imports: two cores run two at once); their
    URLs. Each must exit cleanly (status 0) when terminated."""
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({**config, "data_plane": current_plane()}))
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmsched",
            "serve",
            "--config",
            str(path),
            "--port",
            "0",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        for _ in range(count)
    ]

    async def listening(process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), timeout=60)).decode()
        assert "listening on http://" in line, line
        return line.split("listening on ")[1].split()[0]

    try:
        yield list(await asyncio.gather(*(listening(process) for process in processes)))
    finally:
        for process in processes:
            process.terminate()
        codes = await asyncio.gather(
            *(asyncio.wait_for(process.wait(), timeout=20) for process in processes)
        )
        assert codes == [0] * count, codes


@dataclass
class Rig:
    gateway: Gateway | NativeGateway
    engines: list[FakeOpenAIEngine]
    client: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return self.gateway.url + path

    async def complete(
        self, prompt: Any, *, headers: dict[str, str] | None = None, **fields: Any
    ) -> aiohttp.ClientResponse:
        """POSTs a completion; the response is read (``await r.read()`` returns it)."""
        body = {"model": MODEL, "prompt": prompt, **fields}
        response = await self.client.post(self.url("/v1/completions"), json=body, headers=headers)
        await response.read()
        return response

    def engine_of_request(self, index: int = -1) -> FakeOpenAIEngine:
        """The engine that received the request ``index`` counted over all engines, in
        arrival order."""
        received = sorted(
            ((r.received_at, e) for e in self.engines for r in e.received), key=lambda x: x[0]
        )
        return received[index][1]

    def worker_of_request(self, index: int = -1) -> str:
        """The worker id of the engine that received the request ``index`` (as in
        :meth:`engine_of_request`)."""
        engine = self.engine_of_request(index)
        return str(self.gateway.config.engines[self.engines.index(engine)].worker_id)

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the gateway's metrics (0 when absent)."""
        text = self.gateway.metrics.render().decode()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:]+)(?:\{(.*)\})? (\S+)$", line)
            if (
                m
                and m.group(1) == name
                and ",".join(sorted((m.group(2) or "").split(","))) == (wanted)
            ):
                return float(m.group(3))
        return 0.0


@contextlib.asynccontextmanager
async def rig(
    engines: int = 2,
    *,
    answer_tokens: int = 4,
    engine_fields: list[dict[str, Any]] | None = None,
    setup: Callable[[FakeOpenAIEngine], object] | None = None,
    extra_engines: list[dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """``engines`` fake engines and a gateway in front (scraping off unless overridden).
    ``engine_fields``: extra keys of each engine's config entry (e.g. its role); ``setup``:
    called on each fake engine before it starts; ``extra_engines``: entries of engines the
    test serves itself, listed before the fakes."""
    fakes = [FakeOpenAIEngine(model=MODEL, answer_tokens=answer_tokens) for _ in range(engines)]
    for fake in fakes:
        if setup is not None:
            setup(fake)
        await fake.start()
    config: dict[str, Any] = {
        "engines": [
            *(extra_engines or []),
            *(
                {**f.spec(), **(engine_fields[i] if engine_fields else {})}
                for i, f in enumerate(fakes)
            ),
        ],
        "models": [MODEL],
        "block_size": 4,
        "listen": {"port": 0},
        "scrape": {"enabled": False},
    }
    plane = overrides.pop("data_plane", None) or current_plane()
    config.update(overrides)
    gateway = make_gateway(config, data_plane=plane)
    await gateway.start()
    client = aiohttp.ClientSession()
    try:
        yield Rig(gateway, fakes, client)
    finally:
        await client.close()
        await gateway.stop()
        for fake in fakes:
            await fake.stop()


async def raw_request(
    target: Rig | int, body: bytes, *, extra: bytes = b"", path: str = "/v1/completions"
) -> tuple[int, str]:
    """POSTs ``body`` over a raw socket to a rig's gateway or a port on loopback (``extra``:
    header lines sent as given, bytes that are not UTF-8 included); returns the status and
    the decoded body (``Connection: close``)."""
    port = target if isinstance(target, int) else target.gateway.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode()
            + extra
            + b"\r\n"
            + body
        )
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        payload = _dechunk(payload)
    return status, payload.decode(errors="replace")


async def read_cut_off(response: aiohttp.ClientResponse) -> bytes:
    """The bytes of an answer the gateway cut off, read until the client library raises
    (it must: a cut answer never ends as a complete one)."""
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for chunk in response.content.iter_any():
            received += chunk
    return received


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


@contextlib.asynccontextmanager
async def in_front_of_raw(
    answer: bytes, flow: dict[str, Any] | None = None
) -> AsyncIterator[Gateway | NativeGateway]:
    """A gateway in front of one engine that answers every POST with ``answer`` (raw bytes,
    then it closes the connection) and anything else (a probe) with an empty 200; with flow
    control ``flow`` when given."""

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
    config: dict[str, Any] = {
        "engines": [{"host": "127.0.0.1", "port": port, "model": MODEL}],
        "models": [MODEL],
        "block_size": 4,
        "listen": {"port": 0},
        "scrape": {"enabled": False},
    }
    if flow is not None:
        config["flow"] = flow
    gateway = make_gateway(config, data_plane=current_plane())
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()
        server.close()
        await server.wait_closed()
