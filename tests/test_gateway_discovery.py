"""The gateway follows a discovery file: engines added, removed and badly listed."""

from __future__ import annotations

import asyncio
import contextlib
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
from llmsched.gateway.config import load_config
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
