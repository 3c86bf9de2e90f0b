"""The real ``llmsched serve`` process in front of the native fake engines
(``llmsched-fake-engine``), on both data planes, through a stall: every engine's process
stopped (SIGSTOP) for longer than the scrape timeout, then resumed. A stall is no outage: the
gateway keeps answering (the requests wait, as through a plain proxy) instead of refusing
every request with 503 until the next scrape gets through; an engine that is really gone
still gets a 503 with its reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from _gateway_harness import MODEL, plane, run, serve_process  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("plane")


@pytest.fixture(scope="module")
def fake_engine_bin() -> Path:
    """The native fake engine, built (release, as the benchmarks use it) when missing."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    binary = target / "release" / "llmsched-fake-engine"
    if not binary.exists():
        cargo = shutil.which("cargo")
        if cargo is None:
            pytest.skip("cargo is not installed: llmsched-fake-engine cannot be built")
        subprocess.run(
            [cargo, "build", "--release", "-p", "llmsched-bench", "--bin", "llmsched-fake-engine"],
            cwd=ROOT,
            check=True,
        )
    return binary


@contextlib.contextmanager
def _engines(binary: Path, count: int) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``count`` fake engines in one process: the process and their base URLs."""
    child = subprocess.Popen(
        [str(binary), "--engines", str(count), "--model", MODEL, "--answer-tokens", "4"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())["ports"]
        yield child, [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples carrying ``labels`` in a ``/metrics`` text."""
    total = 0.0
    for line in text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _steady_load(
    client: aiohttp.ClientSession, url: str, rate: float, seconds: float
) -> Counter[int]:
    """Completions sent ``rate`` a second for ``seconds`` without waiting for the answers
    (open loop, as a real client population); the count of each status."""

    async def one() -> int:
        body = {"model": MODEL, "prompt": "a stalled engine is no dead engine", "max_tokens": 4}
        async with client.post(url + "/v1/completions", json=body) as response:
            await response.read()
            return response.status

    tasks = []
    for _ in range(int(rate * seconds)):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1 / rate)
    return Counter(await asyncio.gather(*tasks))


def test_a_stall_of_every_engine_is_waited_out_and_a_dead_engine_still_gets_503(
    fake_engine_bin: Path, tmp_path: Path
) -> None:
    async def body() -> None:
        with _engines(fake_engine_bin, 2) as (engines, urls):
            config = {
                "engines": [{"host": "127.0.0.1", "port": int(u.rsplit(":", 1)[1])} for u in urls],
                "models": [MODEL],
                # Scrapes time out well within the stall below.
                "scrape": {"enabled": True, "interval_s": 0.05, "timeout_s": 0.2},
                "flow": {"saturation": {"type": "concurrency", "max_requests": 4096}},
            }
            connector = aiohttp.TCPConnector(limit=0)
            async with (
                serve_process(config, tmp_path) as url,
                aiohttp.ClientSession(connector=connector) as client,
            ):
                async with client.get(url + "/ready") as response:
                    assert response.status == 200

                async def stall() -> None:
                    await asyncio.sleep(0.3)
                    engines.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(1.0)
                    engines.send_signal(signal.SIGCONT)

                statuses, _ = await asyncio.gather(_steady_load(client, url, 100, 2.0), stall())
                async with client.get(url + "/metrics") as response:
                    text = await response.text()
                # The stall was seen (scrapes timed out), and waited out: before, every
                # engine left routing at its first timed-out scrape and the requests of the
                # rest of the stall got 503 (68 of these 200 in a run on the Python plane).
                assert statuses[503] == 0, statuses
                assert statuses == Counter({200: 200}), statuses
                assert _sample(text, "llmsched_gateway_scrape_failures_total", kind="timeout") > 0
                assert _sample(text, "llmsched_gateway_rejections_total") == 0
                assert _sample(text, "llmsched_gateway_ejections_total") == 0

                # Gone for good: refused scrapes and failed probes take both engines out;
                # requests get 503 with the reason, counted.
                engines.kill()
                engines.wait(timeout=10)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 15
                while True:
                    async with client.get(url + "/ready") as response:
                        if response.status == 503:
                            break
                    assert loop.time() < deadline, "ready never turned 503"
                    await asyncio.sleep(0.05)
                # (The Python plane notices within its routability check's period; until
                # then a request finds the engines refusing: 502.)
                prompt = {"model": MODEL, "prompt": "anyone?"}
                while True:
                    async with client.post(url + "/v1/completions", json=prompt) as response:
                        assert response.status in (502, 503)
                        if response.status == 503:
                            reason = response.headers["x-llmsched-dropped-reason"]
                            assert reason == "no-endpoints"
                            break
                    assert loop.time() < deadline, "requests never got 503"
                    await asyncio.sleep(0.05)
                async with client.get(url + "/metrics") as response:
                    text = await response.text()
                refused = _sample(text, "llmsched_gateway_rejections_total", reason="no-endpoints")
                assert refused >= 1

    run(body())
