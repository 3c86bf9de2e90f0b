"""Three real ``llmsched serve`` processes synced over a real NATS server.

Four fake engines behind three gateway replicas; a client spreads each chat's turns over the
replicas in turn, as a load balancer without stickiness would. With the ``cluster`` section,
every later turn finds the engine that holds the chat's prefix whichever replica it reaches;
without it, a replica that did not route the first turn picks blind. Killing the bus or a
replica loses no request, and ``/metrics`` shows the state of the sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("nats", reason="the cluster extra brings nats-py")
pytest.importorskip("aiohttp", reason="the gateway extra")

import aiohttp
from _nats import NatsServer, nats_binary

from llmsched.testing.openai_engine import FakeOpenAIEngine

MODEL = "tiny"
ROUTER = {
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "active-request-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "active-request-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


class Replica:
    """One ``llmsched serve`` process."""

    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url

    async def metric(self, client: aiohttp.ClientSession, name: str) -> float:
        async with client.get(self.url + "/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)} (\S+)$", line)
            if m:
                return float(m.group(1))
        return 0.0

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            assert await asyncio.wait_for(self.process.wait(), timeout=20) == 0


@contextlib.asynccontextmanager
async def _replicas(configs: list[dict[str, Any]], tmp_path: Path) -> AsyncIterator[list[Replica]]:
    """One ``llmsched serve`` process per config, started side by side (each start is mostly
    imports, which two cores run two at a time) and stopped side by side; each must exit 0."""
    processes: list[asyncio.subprocess.Process] = []
    started: list[asyncio.subprocess.Process] = []
    try:
        for i, config in enumerate(configs):
            path = tmp_path / f"gateway-{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    *("-m", "llmsched", "serve", "--config", str(path), "--port", "0"),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    env={**os.environ, "PYTHONWARNINGS": "error"},
                )
            )

        async def listening(process: asyncio.subprocess.Process) -> Replica:
            assert process.stdout is not None
            line = (await asyncio.wait_for(process.stdout.readline(), timeout=60)).decode()
            assert "listening on http://" in line, line
            return Replica(process, line.split("listening on ")[1].split()[0])

        replicas = list(await asyncio.gather(*(listening(p) for p in processes)))
        started = [replica.process for replica in replicas]
        yield replicas
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
        await asyncio.gather(*(asyncio.wait_for(p.wait(), timeout=20) for p in processes))
        # A process that never listened has its own error above; each replica exits cleanly.
        assert [p.returncode for p in started] == [0] * len(started)


async def _sync_totals(
    client: aiohttp.ClientSession, replicas: list[Replica]
) -> tuple[float, float, float]:
    """Bytes published, bytes received and batches published by the replicas' sync."""
    sent = received = batches = 0.0
    for replica in replicas:
        counter = 'llmsched_gateway_cluster_total{counter="%s"}'
        sent += await replica.metric(client, counter % "bytes_out")
        received += await replica.metric(client, counter % "bytes_in")
        batches += await replica.metric(client, counter % "batches_out")
    return sent, received, batches


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _config(
    engines: list[FakeOpenAIEngine], bus: NatsServer | None, name: str, plane: str
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "engines": [e.spec() for e in engines],
        "models": [MODEL],
        "router": ROUTER,
        "scrape": {"enabled": False},
        "slices": {"enabled": False},
        "data_plane": plane,
    }
    if bus is not None:
        config["cluster"] = {
            "servers": [bus.url],
            "name": "test",
            "replica": name,
            "heartbeat_s": 0.2,
            "load_ttl_s": 1.0,
        }
    return config


async def _chats(
    client: aiohttp.ClientSession,
    replicas: list[Replica],
    engines: list[FakeOpenAIEngine],
    chats: int,
    turns: int,
) -> tuple[int, int]:
    """Sends turn ``t`` of chat ``c`` through replica ``(c + t) % n``; returns how many later
    turns landed on the engine of the chat's first turn, and how many later turns there were."""
    first: dict[int, int] = {}
    same = later = 0
    for turn in range(turns):
        for chat in range(chats):
            prompt = f"chat {chat} system prompt. " * 40 + "".join(
                f" turn {t}: a question and its answer." * 8 for t in range(turn + 1)
            )
            replica = replicas[(chat + turn) % len(replicas)]
            counts = [len(e.received) for e in engines]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            async with client.post(replica.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            served = next(i for i, e in enumerate(engines) if len(e.received) > counts[i])
            if turn == 0:
                first[chat] = served
            else:
                later += 1
                same += served == first[chat]
        await asyncio.sleep(0.1)  # the turn's records reach the other replicas
    return same, later


@pytest.mark.parametrize("plane", ["python", "native"])
def test_three_serve_replicas_keep_chat_affinity_and_survive_bus_and_replica_loss(
    tmp_path: Path, plane: str
) -> None:
    async def body() -> None:
        bus = NatsServer(nats_binary())
        bus.start()
        engines = [FakeOpenAIEngine(model=MODEL, answer_tokens=2) for _ in range(4)]
        try:
            for engine in engines:
                await engine.start()
            async with aiohttp.ClientSession() as client:
                configs = [_config(engines, bus, f"gw-{i}", plane) for i in range(3)]
                async with _replicas(configs, tmp_path) as replicas:
                    for replica in replicas:
                        await _until(
                            lambda r=replica: _peers(client, r, 2), "every replica to see two peers"
                        )
                    synced = await _chats(client, replicas, engines, chats=12, turns=3)
                    assert synced == (24, 24), synced

                    # The last batches may still be on the bus on a busy machine: wait for them
                    # rather than reading the counters once.
                    async def delivered() -> bool:
                        sent, received, batches = await _sync_totals(client, replicas)
                        print(
                            f"sync for 36 requests: {batches:.0f} batches, {sent / 36:.0f} bytes "
                            f"published and {received / 36:.0f} received per request"
                        )
                        return received >= 2 * sent * 0.9

                    await _until(delivered, "each batch to reach the two peers")
                    # The bus dies: routing goes on from local state, no request fails.
                    bus.stop()
                    await _until(
                        lambda: _metric_is(
                            client, replicas[0], "llmsched_gateway_cluster_connected", 0
                        ),
                        "the replica to notice",
                    )
                    for i in range(30):
                        replica = replicas[i % 3]
                        async with client.post(
                            replica.url + "/v1/completions",
                            json={"model": MODEL, "prompt": f"while the bus is down {i}"},
                        ) as response:
                            assert response.status == 200
                    bus.start()
                    for replica in replicas:
                        await _until(
                            lambda r=replica: _peers(client, r, 2), "sync back after the bus"
                        )
                    # A replica dies: the others forget its counts and keep serving.
                    await replicas[2].stop()
                    await _until(lambda: _peers(client, replicas[0], 1), "the dead replica to go")
                    for i in range(10):
                        async with client.post(
                            replicas[i % 2].url + "/v1/completions",
                            json={"model": MODEL, "prompt": f"after the replica {i}"},
                        ) as response:
                            assert response.status == 200
                    failures = await replicas[0].metric(
                        client, 'llmsched_gateway_cluster_total{counter="malformed_in"}'
                    )
                    assert failures == 0
                # The same chats without sync: later turns on other replicas pick blind.
                alone = [_config(engines, None, f"gw-{i}", plane) for i in range(3)]
                for engine in engines:
                    engine.received.clear()
                async with _replicas(alone, tmp_path) as replicas:
                    unsynced = await _chats(client, replicas, engines, chats=12, turns=3)
                assert unsynced[0] < synced[0], (synced, unsynced)
                print(f"later turns on the first turn's engine: synced {synced}, alone {unsynced}")
        finally:
            for engine in engines:
                await engine.stop()
            bus.stop()

    asyncio.run(asyncio.wait_for(body(), 240))


async def _peers(client: aiohttp.ClientSession, replica: Replica, n: int) -> bool:
    return await replica.metric(client, "llmsched_gateway_cluster_peers") == n


async def _metric_is(
    client: aiohttp.ClientSession, replica: Replica, name: str, value: float
) -> bool:
    return await replica.metric(client, name) == value


@pytest.mark.parametrize("plane", ["python", "native"])
def test_a_key_rate_limit_holds_across_serve_replicas(tmp_path: Path, plane: str) -> None:
    """A key allowed 3 requests (burst, refilled at 0.01/s): synced, the three replicas
    together admit about 3 of 9 requests spread over them; alone, each admits its own 3."""

    async def body() -> None:
        bus = NatsServer(nats_binary())
        bus.start()
        engine = FakeOpenAIEngine(model=MODEL, answer_tokens=2)
        key = "sk-shared-key-0000001"
        auth = {"api_keys": {key: {"tenant": "t", "requests_per_s": 0.01, "burst_requests": 3}}}
        headers = {"Authorization": f"Bearer {key}"}
        try:
            await engine.start()
            async with aiohttp.ClientSession() as client:

                async def admitted(replicas: list[Replica]) -> int:
                    ok = 0
                    for i in range(9):
                        body = {"model": MODEL, "prompt": f"limited {i}", "max_tokens": 1}
                        url = replicas[i % 3].url + "/v1/completions"
                        async with client.post(url, json=body, headers=headers) as response:
                            assert response.status in (200, 429), response.status
                            ok += response.status == 200
                        await asyncio.sleep(0.1)  # one sync interval and more
                    return ok

                synced_configs = [
                    {**_config([engine], bus, f"gw-{i}", plane), "auth": auth} for i in range(3)
                ]
                async with _replicas(synced_configs, tmp_path) as replicas:
                    for replica in replicas:
                        await _until(lambda r=replica: _peers(client, r, 2), "peers")
                    synced = await admitted(replicas)
                    usage_in = await replicas[0].metric(
                        client, 'llmsched_gateway_cluster_total{counter="usage_in"}'
                    )
                alone_configs = [
                    {**_config([engine], None, f"gw-{i}", plane), "auth": auth} for i in range(3)
                ]
                async with _replicas(alone_configs, tmp_path) as replicas:
                    alone = await admitted(replicas)
            assert synced == 3, synced
            assert alone == 9, alone
            assert usage_in >= 1
            print(f"admitted of 9 for a 3-request key: synced {synced}, alone {alone}")
        finally:
            await engine.stop()
            bus.stop()

    asyncio.run(asyncio.wait_for(body(), 180))
