"""The programs in examples/ run as their users run them (``python examples/NAME.py ...``, in a
subprocess, through their ``main()``), against llmsched.testing's fake engines over real
loopback HTTP and ZMQ; every wait is bounded."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import aiohttp
import pytest

from llmsched.testing import FakeKVPublisher, event_batch, stored_event
from llmsched.testing.openai_engine import FakeOpenAIEngine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LIMIT_S = 60.0


async def _program(name: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / name),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _finish(proc: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), LIMIT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_the_aiohttp_router_proxies_and_retries_on_the_fallback() -> None:
    assert len((EXAMPLES / "aiohttp_router.py").read_text().splitlines()) < 100

    async def run() -> None:
        engines = [FakeOpenAIEngine(model="m"), FakeOpenAIEngine(model="m")]
        for engine in engines:
            await engine.start()
        args = [a for e in engines for a in ("--engine", f"127.0.0.1:{e.port}")]
        proc = await _program("aiohttp_router.py", *args, "--port", "0")
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), LIMIT_S)).decode()
            assert line.startswith("listening on http://127.0.0.1:"), line
            url = line.split()[-1] + "/v1/completions"
            timeout = aiohttp.ClientTimeout(total=LIMIT_S)
            async with aiohttp.ClientSession(timeout=timeout) as client:
                for i in range(4):
                    body = {"model": "m", "prompt": f"request {i}", "max_tokens": 3}
                    async with client.post(url, json=body, headers={"x-tenant": "t"}) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["choices"][0]["text"] == " t0 t1 t2"
                assert sum(len(e.received) for e in engines) == 4
                await engines[0].stop()  # its requests now go to the fallback
                for i in range(4):
                    body = {"model": "m", "prompt": f"again {i}", "max_tokens": 2}
                    async with client.post(url, json=body) as r:
                        assert r.status == 200, await r.text()
                assert [b.body["prompt"] for b in engines[1].received][-4:] == [
                    f"again {i}" for i in range(4)
                ]
                async with client.post(url, data=b"{not json") as r:
                    assert r.status == 400
                huge = {"x-priority": "9" * 12}
                async with client.post(url, json={"prompt": "x"}, headers=huge) as r:
                    assert r.status == 400 and "priority" in (await r.json())["error"]
                await engines[1].stop()
                async with client.post(url, json={"model": "m", "prompt": "none"}) as r:
                    assert r.status == 503, await r.text()
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), LIMIT_S)
            for engine in engines:
                await engine.stop()

    asyncio.run(run())


def test_the_python_scorer_keeps_requests_in_their_zone() -> None:
    async def run() -> tuple[int, str, str, list[list[str]]]:
        eu, us = FakeOpenAIEngine(model="m"), FakeOpenAIEngine(model="m")
        for engine in (eu, us):
            await engine.start()
        try:
            requests = ["eu:contract one", "us:hello there", "eu:contract two", "us:bonjour"]
            proc = await _program(
                "python_scorer.py",
                "--engine",
                f"127.0.0.1:{eu.port}=eu",
                "--engine",
                f"127.0.0.1:{us.port}=us",
                "--model",
                "m",
                *[a for r in requests for a in ("--request", r)],
            )
            code, out, err = await _finish(proc)
            prompts = [[b.body["prompt"] for b in e.received] for e in (eu, us)]
            return code, out, err, prompts
        finally:
            for engine in (eu, us):
                await engine.stop()

    code, out, err, (eu_prompts, us_prompts) = asyncio.run(run())
    assert code == 0, err
    assert eu_prompts == ["contract one", "contract two"]
    assert us_prompts == ["hello there", "bonjour"]
    assert "zone x3" in out and out.count("-> 127.0.0.1:") == 4


def test_the_kv_events_example_feeds_the_index_from_the_engines_events() -> None:
    async def run(publisher: FakeKVPublisher) -> tuple[int, str, str]:
        proc = await _program(
            "kv_events_index.py",
            "--engine",
            "127.0.0.1:9",
            "--kv-events",
            publisher.endpoint,
            "--replay",
            str(publisher.replay_endpoint),
            "--min-blocks",
            "4",
            "--seconds",
            str(LIMIT_S),
            "--tokens",
            "0-63",
        )
        loop = asyncio.get_running_loop()
        subscribed = await loop.run_in_executor(None, publisher.wait_subscribed, LIMIT_S)
        assert subscribed, "the example never subscribed"
        publisher.publish(event_batch(stored_event([11, 12, 13, 14], None, list(range(64)))))
        return await _finish(proc)

    with FakeKVPublisher() as publisher:
        code, out, err = asyncio.run(run(publisher))
    assert code == 0, err
    # The live batch, and maybe its replay too (the subscriber catches up on connecting).
    assert re.search(r"^index: 4 blocks from [12] event batches$", out, re.M), out
    assert "prompt of 64 tokens -> 127.0.0.1:9, 64 tokens cached there" in out


@pytest.mark.parametrize("name", ["aiohttp_router.py", "python_scorer.py", "kv_events_index.py"])
def test_every_example_has_a_main_and_a_docstring(name: str) -> None:
    source = (EXAMPLES / name).read_text()
    assert source.startswith('"""') and "\ndef main(" in source
    assert 'if __name__ == "__main__":' in source
