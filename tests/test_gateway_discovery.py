"""The gateway follows a discovery file: engines added, removed and badly listed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from _gateway_harness import MODEL, current_plane, plane, run  # noqa: F401 (the fixture)

from llmsched.errors import ConfigError
from llmsched.gateway import Gateway, NativeGateway, make_gateway
from llmsched.gateway.config import load_config, read_engines_file
from llmsched.integrations import EngineSpec
from llmsched.testing.openai_engine import FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")

INTERVAL_S = 0.05


def write_engines(path: Path, engines: list[FakeOpenAIEngine]) -> None:
    # A new file replaces the old in one step, the way a ConfigMap update lands.
    staged = path.with_suffix(".tmp")
    staged.write_text(yaml.safe_dump([e.spec() for e in engines]))
    staged.replace(path)


async def wait_engines(gateway: Gateway | NativeGateway, engines: list[FakeOpenAIEngine]) -> None:
    wanted = sorted(EngineSpec.from_dict(e.spec()).worker_id for e in engines)
    for _ in range(200):
        if sorted(s.worker_id for s in gateway.engines) == wanted:
            return
        await asyncio.sleep(INTERVAL_S)
    raise AssertionError(f"gateway engines {gateway.engines}, wanted {wanted}")


@contextlib.asynccontextmanager
async def fakes(n: int) -> AsyncIterator[list[FakeOpenAIEngine]]:
    engines = [FakeOpenAIEngine(model=MODEL) for _ in range(n)]
    for engine in engines:
        await engine.start()
    try:
        yield engines
    finally:
        for engine in engines:
            await engine.stop()


def config(path: Path) -> dict[str, Any]:
    return {
        "models": [MODEL],
        "listen": {"port": 0},
        "scrape": {"enabled": False},
        "discovery": {"file": str(path), "interval_s": INTERVAL_S},
    }


def discovery_errors(gateway: Gateway | NativeGateway) -> float:
    found = re.search(rb"(?m)^\w+_discovery_errors_total (\S+)$", gateway.metrics.render())
    return float(found.group(1)) if found else 0.0


async def complete(
    client: aiohttp.ClientSession, gateway: Gateway | NativeGateway, prompt: str
) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with client.post(gateway.url + "/v1/completions", json=body) as response:
        await response.read()
        return response.status


def test_engines_follow_the_discovery_file(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"

    async def body() -> None:
        async with fakes(3) as (a, b, c), aiohttp.ClientSession() as client:
            write_engines(path, [a])
            async with make_gateway(config(path), data_plane=current_plane()) as gateway:
                assert await complete(client, gateway, "first") == 200
                assert len(a.received) == 1

                write_engines(path, [a, b, c])
                await wait_engines(gateway, [a, b, c])
                # Distinct prompts spread over the three engines (the index knows nothing).
                for i in range(30):
                    assert await complete(client, gateway, f"prompt number {i}") == 200
                assert b.received and c.received

                write_engines(path, [b])
                await wait_engines(gateway, [b])
                before = (len(a.received), len(c.received))
                for i in range(10):
                    assert await complete(client, gateway, f"after removal {i}") == 200
                assert (len(a.received), len(c.received)) == before
                removed = EngineSpec.from_dict(a.spec()).worker_id
                assert removed not in [e["id"] for e in gateway.pool.endpoints()]
                assert gateway.metrics.render().count(b"engine_changes_total 4.0") == 1

    run(body())


def test_a_bad_discovery_file_keeps_the_current_engines(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"

    async def body() -> None:
        async with fakes(1) as (a,), aiohttp.ClientSession() as client:
            write_engines(path, [a])
            async with make_gateway(config(path), data_plane=current_plane()) as gateway:
                for bad in ("[]", "not: [a list", "- {host: 127.0.0.1, port: 0}"):
                    errors = discovery_errors(gateway)
                    path.write_text(bad)
                    for _ in range(200):
                        if discovery_errors(gateway) > errors:
                            break
                        await asyncio.sleep(INTERVAL_S)
                    else:
                        raise AssertionError(f"{bad!r} was not refused")
                    assert [s.worker_id for s in gateway.engines] == [
                        EngineSpec.from_dict(a.spec()).worker_id
                    ]
                    assert await complete(client, gateway, "still served") == 200

    run(body())


def test_discovery_config_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"discovery\.file.*cannot read"):
        load_config(config(missing))
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump([{"host": "127.0.0.1", "port": 8001}]))
    both = {**config(path), "engines": [{"host": "127.0.0.1", "port": 8002}]}
    with pytest.raises(ConfigError, match=r"either engines or discovery\.file"):
        load_config(both)
    with pytest.raises(ConfigError, match=r"discovery\.interval_s"):
        load_config({**config(path), "discovery": {"file": str(path), "interval_s": 0}})
    with pytest.raises(ConfigError, match=r"discovery\.every"):
        load_config({**config(path), "discovery": {"file": str(path), "every": 1}})
    assert [s.port for s in load_config(config(path)).engines] == [8001]


def test_set_engines_refuses_an_empty_or_repeated_set(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump([{"host": "127.0.0.1", "port": 8001}]))
    gateway = make_gateway(config(path), data_plane=current_plane())
    spec = EngineSpec("127.0.0.1", 8002)
    with pytest.raises(ConfigError, match="at least one"):
        run(gateway.set_engines([]))
    with pytest.raises(ConfigError, match="listed twice"):
        run(gateway.set_engines([spec, spec]))
    assert [s.port for s in gateway.engines] == [8001]
    assert run(gateway.set_engines([spec])) == (["127.0.0.1:8002"], ["127.0.0.1:8001"])
    assert [e["id"] for e in gateway.pool.endpoints()] == ["127.0.0.1:8002"]


# 5,000 levels in 10 KB (far under discovery.max_bytes): the YAML parser runs out of stack.
DEEP = "- " + "[" * 5000 + "]" * 5000


def test_read_engines_file_refuses_absurd_nesting(tmp_path: Path) -> None:
    """A deeply nested, self-referencing or alias-bomb file is a ConfigError naming the file,
    not a RecursionError (which no caller expects)."""
    path = tmp_path / "engines.yaml"
    for text, problem in (
        (DEEP, "nested more than 32 levels"),
        ("- &x [*x]", "a YAML alias refers to a node that contains it"),
        (
            "\n".join(
                ["x:", "  - &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
                + [
                    f"  - &{c} [{', '.join([f'*{p}'] * 10)}]"
                    for p, c in zip("abcdef", "bcdefg", strict=True)
                ]
            ),
            "YAML aliases repeat more than 1,000,000 values",
        ),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            read_engines_file(path)
        assert str(info.value) == (
            f"discovery.file: cannot read {str(path)!r}: not valid YAML / JSON ({problem})"
        )


async def wait_errors(gateway: Gateway | NativeGateway, above: float) -> None:
    for _ in range(200):
        if discovery_errors(gateway) > above:
            return
        await asyncio.sleep(INTERVAL_S)
    raise AssertionError(f"discovery errors stayed at {discovery_errors(gateway)}")


def test_a_deeply_nested_discovery_file_keeps_the_watcher_alive(tmp_path: Path) -> None:
    """F8: a deeply nested file is counted and keeps the current engines; the watcher lives
    on, so a later bad file is counted too and a later good file applied."""
    path = tmp_path / "engines.yaml"

    async def body() -> None:
        async with fakes(2) as (a, b), aiohttp.ClientSession() as client:
            write_engines(path, [a])
            async with make_gateway(config(path), data_plane=current_plane()) as gateway:
                for bad in (DEEP, "not: [a list", "- {host: 2020-13-01, port: 1}", DEEP):
                    errors = discovery_errors(gateway)
                    path.write_text(bad)
                    await wait_errors(gateway, errors)
                    assert [s.worker_id for s in gateway.engines] == [
                        EngineSpec.from_dict(a.spec()).worker_id
                    ]
                    assert await complete(client, gateway, "still served") == 200
                write_engines(path, [b])
                await wait_engines(gateway, [b])
                assert discovery_errors(gateway) == 4

    run(body())


def test_the_discovery_watcher_survives_an_unexpected_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever reading a file raises (a bug, not only a ConfigError) is counted and keeps
    the current engines; the next file is read as usual. The native plane logs the same
    error once (with its traceback), however often it repeats."""
    import llmsched.gateway.app
    import llmsched.gateway.native

    path = tmp_path / "engines.yaml"
    failures = [RuntimeError("boom"), RuntimeError("boom")]

    def flaky(path: Path, *, max_bytes: int) -> tuple[EngineSpec, ...]:
        if failures:
            raise failures.pop()
        return read_engines_file(path, max_bytes=max_bytes)

    async def body() -> None:
        async with fakes(3) as (a, b, c):
            write_engines(path, [a])
            async with make_gateway(config(path), data_plane=current_plane()) as gateway:
                # The first pass re-reads the file: let it settle before the faults start.
                await asyncio.sleep(10 * INTERVAL_S)
                module = (
                    llmsched.gateway.native if current_plane() == "native" else llmsched.gateway.app
                )
                monkeypatch.setattr(module, "read_engines_file", flaky)
                write_engines(path, [b])
                await wait_errors(gateway, 0)
                write_engines(path, [a, b])
                await wait_errors(gateway, 1)
                assert [s.worker_id for s in gateway.engines] == [
                    EngineSpec.from_dict(a.spec()).worker_id
                ]
                write_engines(path, [c])
                await wait_engines(gateway, [c])
                assert discovery_errors(gateway) == 2

    with caplog.at_level(logging.INFO, logger="llmsched"):
        run(body())
    if current_plane() == "native":
        logged = [r for r in caplog.records if "boom" in r.getMessage()]
        assert len(logged) == 1 and logged[0].levelno == logging.ERROR
        assert logged[0].exc_info is not None


def test_serve_follows_a_good_file_after_a_deeply_nested_one(tmp_path: Path) -> None:
    """The real ``llmsched serve``: after a deeply nested discovery file, a good one is applied
    (requests reach the new engine), the error is counted on /metrics, and SIGTERM still ends
    it with status 0 (the watcher did not die with an exception)."""
    from _gateway_harness import serve_process

    path = tmp_path / "engines.yaml"
    metric = re.compile(rb"(?m)^\w+_discovery_errors_total (\S+)$")

    async def follow(url: str, b: FakeOpenAIEngine) -> None:
        # Its own session, closed before the gateway is stopped: this test is about the
        # watcher, not about shutting down with clients' idle connections open.
        async with aiohttp.ClientSession() as client:
            path.write_text(DEEP)
            for _ in range(200):
                async with client.get(url + "/metrics") as response:
                    found = metric.search(await response.read())
                if found and float(found.group(1)) >= 1:
                    break
                await asyncio.sleep(INTERVAL_S)
            else:
                raise AssertionError("the deep file was not counted")
            write_engines(path, [b])
            body = {"model": MODEL, "prompt": "to b", "max_tokens": 2}
            for _ in range(200):
                async with client.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                if b.received:
                    break
                await asyncio.sleep(INTERVAL_S)
            else:
                raise AssertionError("the good file was not applied")

    async def body() -> None:
        async with fakes(2) as (a, b):
            write_engines(path, [a])
            async with serve_process(config(path), tmp_path) as url:
                await follow(url, b)

    run(body())


def test_a_file_replaced_by_one_of_the_same_size_and_time_is_a_new_version(
    tmp_path: Path,
) -> None:
    # An agent that renames a new list over the old one within one tick of the file system's
    # clock, with the same size (one engine's port for another's), went unseen for good.
    from llmsched.gateway.config import file_version

    path = tmp_path / "engines.yaml"
    path.write_text("- {host: 127.0.0.1, port: 8001}\n")
    before = file_version(path)
    stat = path.stat()
    staged = tmp_path / "engines.tmp"
    staged.write_text("- {host: 127.0.0.1, port: 8002}\n")
    os.utime(staged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    staged.replace(path)
    assert path.stat().st_size == stat.st_size
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert file_version(path) != before
