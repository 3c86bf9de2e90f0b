"""Guards against clients that hold resources: bodies that never end, too many connections,
declared bodies over the limit, oversized discovery files; and the same classes of fault against
the real ``llmsched serve`` process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    current_plane,
    plane,
    read_cut_off,
    rig,
    run,
    serve_process,
)

import llmsched.scheduler
from llmsched.errors import ConfigError
from llmsched.gateway.config import read_engines_file
from llmsched.testing.openai_engine import FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


def _head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_body_that_never_ends_gets_408_and_the_connection_closes() -> None:
    async def body() -> None:
        async with rig(engines=1, limits={"body_timeout_s": 0.3}) as r:
            reader, writer = await _connect(r.gateway.port)
            writer.write(_head(100) + b'{"model": ')
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=10)  # read to EOF: closed
            await _close(writer)
            assert answer.startswith(b"HTTP/1.1 408")
            assert b"request_timeout" in answer
            assert r.metric("llmsched_gateway_rejections_total", reason="request_timeout") == 1
            assert not r.engines[0].received

    run(body())


def test_headers_that_never_end_and_idle_connections_are_closed() -> None:
    async def body() -> None:
        async with rig(engines=1, limits={"idle_timeout_s": 0.3}) as r:
            partial = await _connect(r.gateway.port)
            partial[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\n")
            idle = await _connect(r.gateway.port)
            for reader, writer in (partial, idle):
                assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed
                await _close(writer)
            assert not r.engines[0].received

    run(body())


def test_a_declared_body_over_the_limit_is_refused_before_it_arrives() -> None:
    async def body() -> None:
        async with rig(engines=1, limits={"max_body_bytes": 4096}) as r:
            reader, writer = await _connect(r.gateway.port)
            writer.write(_head(10 * 2**30))  # 10 GiB announced, none sent
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=10)
            await _close(writer)
            assert answer.startswith(b"HTTP/1.1 413")
            assert b"request_too_large" in answer
            assert r.metric("llmsched_gateway_rejections_total", reason="request_too_large") == 1

    run(body())


def test_connections_over_the_cap_get_503_and_are_closed() -> None:
    async def body() -> None:
        async with rig(engines=1, limits={"max_connections": 3}) as r:
            idle = [await _connect(r.gateway.port) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert r.metric("llmsched_gateway_connections") == 3
            reader, writer = await _connect(r.gateway.port)
            answer = await asyncio.wait_for(reader.read(), timeout=10)
            await _close(writer)
            assert answer.startswith(b"HTTP/1.1 503")
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == 503
            assert r.metric("llmsched_gateway_connections_refused_total") == 1
            for _, w in idle:
                await _close(w)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while r.metric("llmsched_gateway_connections") > 0 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert (await r.complete("hello")).status == 200

    run(body())


def test_a_discovery_file_over_the_size_cap_is_refused_unparsed(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text("- {host: 127.0.0.1, port: 8001}\n" + "#" * 5000 + "\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="max_bytes"):
        read_engines_file(path, max_bytes=4096)
    assert time.perf_counter() - started < 5  # bounded work; no timing claim beyond that
    assert len(read_engines_file(path, max_bytes=8192)) == 1


def test_guard_settings_are_checked() -> None:
    from llmsched.gateway.config import load_config

    base: dict[str, Any] = {"engines": [{"host": "127.0.0.1", "port": 1}], "models": ["m"]}
    for section, key, value in (
        ("limits", "body_timeout_s", 0),
        ("limits", "max_connections", 0),
        ("timeouts", "total_s", -1),
        ("discovery", "max_bytes", 10),
        ("health", "interval_s", 0),
        ("health", "unhealthy_threshold", 0),
        ("health", "breaker_failure_rate", 1.5),
        ("health", "path", "health"),
        ("health", "no_such_key", 1),
    ):
        with pytest.raises(ConfigError, match=f"{section}.{key}"):
            load_config({**base, section: {key: value}})
    config = load_config(base)
    assert config.limits.max_connections == 4096 and config.timeouts.total_s == 1800
    assert config.health.interval_s == 5 and config.health.breaker_failure_rate == 0.5


# -- against the real `llmsched serve` process ----------------------------------------------


def test_the_serve_process_aborts_cut_answers_refuses_bad_input_and_fails_fast(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with (
            FakeOpenAIEngine(model=MODEL, answer_tokens=4) as a,
            FakeOpenAIEngine(model=MODEL, answer_tokens=4) as b,
        ):
            config = {
                "engines": [a.spec(), b.spec()],
                "models": [MODEL],
                "scrape": {"enabled": False},
                "flow": {"saturation": {"type": "concurrency", "max_requests": 8}},
                "limits": {"max_body_bytes": 65536},
                "health": {"interval_s": 0.05},
                "retries": {"eject_s": 60},
                "slices": {"enabled": False},
            }
            async with serve_process(config, tmp_path) as url, aiohttp.ClientSession() as client:
                completions = url + "/v1/completions"
                ok = {"model": MODEL, "prompt": "hello"}
                async with client.post(completions, json=ok) as response:
                    assert response.status == 200
                # A stream cut off: an error event, no [DONE], and the client library raises.
                a.mode = b.mode = "cut"
                stream = {**ok, "stream": True}
                async with client.post(completions, json=stream) as response:
                    assert response.status == 200
                    got = await read_cut_off(response)
                assert b'"error"' in got and b"[DONE]" not in got
                # A JSON answer cut off: 502, sent to one engine only.
                before = len(a.received) + len(b.received)
                async with client.post(completions, json=ok) as response:
                    assert response.status == 502
                assert len(a.received) + len(b.received) == before + 1
                a.mode = b.mode = "ok"
                # Client input: 4xx naming the field, never 5xx.
                bad = json.dumps({**ok, "prompt": "\ud800", "max_tokens": 2**64}).encode()
                async with client.post(completions, data=bad) as response:
                    assert response.status == 400
                    error = (await response.json())["error"]
                    # Named alike on both planes.
                    assert error["param"] == "prompt"
                async with client.post(completions, json={**ok, "max_tokens": -1}) as response:
                    assert (await response.json())["error"]["param"] == "max_tokens"
                # A declared body over the limit: 413 before it arrives.
                host, port = url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(_head(2**40))
                answer = await asyncio.wait_for(reader.read(), timeout=10)
                await _close(writer)
                assert answer.startswith(b"HTTP/1.1 413")
                # Every engine down: ready 503 without scraping, requests 503 at once.
                await a.stop()
                await b.stop()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while True:
                    async with client.get(url + "/ready") as response:
                        if response.status == 503:
                            break
                    assert loop.time() < deadline, "ready never turned 503"
                    await asyncio.sleep(0.05)
                async with client.post(completions, json=ok) as response:
                    assert response.status == 503
                    assert response.headers["Retry-After"] == "1"
                async with client.get(url + "/metrics") as response:
                    text = await response.text()
                for name in (
                    "llmsched_gateway_truncated_answers_total",
                    "llmsched_gateway_ejections_total",
                    "llmsched_gateway_endpoint_up",
                    "llmsched_gateway_connections ",
                    "llmsched_gateway_health_probes_total",
                ):
                    assert name in text, name

    run(body())


def test_tenant_names_from_headers_are_bounded() -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 8}}
        async with rig(engines=1, flow=flow, limits={"max_tenants": 3}) as r:
            for i in range(8):
                response = await r.complete("x", headers={"x-llmsched-tenant": f"t{i}"})
                assert response.status == 200
            assert r.gateway.flow is not None
            tenants = {f["tenant"] for f in r.gateway.flow.metrics()["flows"]}
            assert tenants == {"t0", "t1", "t2", "~overflow"}
            assert r.metric("llmsched_gateway_tenants") == 3
            assert r.metric("llmsched_gateway_tenants_folded_total") == 5
            # A tenant seen before the cap keeps its own flow.
            assert (await r.complete("x", headers={"x-llmsched-tenant": "t1"})).status == 200
            assert r.metric("llmsched_gateway_tenants_folded_total") == 5

    run(body())


def test_flow_by_utilization_without_scraping_is_warned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Utilization saturation with nothing scraped refuses every request (no-endpoints): the
    native plane, whose flow control the scheduler does not see, said nothing (probe 47)."""
    monkeypatch.setattr(llmsched.scheduler, "_WARNED", [])

    async def body() -> None:
        with caplog.at_level(logging.WARNING, logger="llmsched"):
            async with rig(engines=1, flow={}) as r:
                response = await r.complete("x")
                assert response.status == 503
                assert response.headers["x-llmsched-dropped-reason"] == "no-endpoints"
        notes = [
            rec.getMessage() for rec in caplog.records if "scraping is off" in rec.getMessage()
        ]
        assert len(notes) == 1, notes

    run(body())


def test_client_priorities_past_the_band_cap_are_folded() -> None:
    """Each new x-llmsched-priority made a band for good (memory and /metrics grew without
    bound, probe 47): past 256 bands besides the configured ones, a new priority queues in
    the nearest band below it, counted."""

    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 8}}
        async with rig(engines=1, flow=flow) as r:
            statuses = []
            for priority in range(300):
                headers = {"x-llmsched-priority": str(1_000 * priority - 150_000)}
                statuses.append((await r.complete("x", headers=headers)).status)
            assert statuses == [200] * 300
            text = r.gateway.metrics.render().decode()
            lengths = [
                line
                for line in text.splitlines()
                if line.startswith("llmsched_gateway_queue_length{")
            ]
            assert len(lengths) == 256  # none configured
            assert r.metric("llmsched_gateway_priorities_folded_total") == 300 - 256
            assert r.gateway.flow is not None
            assert r.gateway.flow.metrics()["priorities_folded"] == 300 - 256

    run(body())


def test_idle_tenants_give_their_place_and_flow_back() -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 8}, "flow_idle_s": 0.2}
        limits = {"max_tenants": 2, "tenant_idle_s": 0.2}
        async with rig(engines=1, flow=flow, limits=limits) as r:
            for name in ("t0", "t1"):
                headers = {"x-llmsched-tenant": name}
                assert (await r.complete("x", headers=headers)).status == 200
            await asyncio.sleep(0.3)
            # Both names went idle: two new names get their own flows, none is folded.
            for name in ("t2", "t3"):
                headers = {"x-llmsched-tenant": name}
                assert (await r.complete("x", headers=headers)).status == 200
            assert r.metric("llmsched_gateway_tenants_folded_total") == 0
            assert r.metric("llmsched_gateway_tenants") == 2
            assert r.gateway.flow is not None
            metrics = r.gateway.flow.metrics()
            assert {f["tenant"] for f in metrics["flows"]} == {"t2", "t3"}
            assert metrics["flows_reclaimed"] == 2
            assert r.metric("llmsched_gateway_flow_tenants") == 2
            assert r.metric("llmsched_gateway_flows_reclaimed_total") == 2

    run(body())


# -- per-key limits ----------------------------------------------------------------------


def test_a_key_over_its_request_rate_gets_429_with_retry_after() -> None:
    async def body() -> None:
        keys = {
            "sk-limited-000001": {"tenant": "a", "requests_per_s": 0.01, "burst_requests": 2},
            "sk-free-000000001": {"tenant": "b"},
        }
        async with rig(engines=1, auth={"api_keys": keys}) as r:
            limited = {"Authorization": "Bearer sk-limited-000001"}
            assert (await r.complete("x", headers=limited)).status == 200
            assert (await r.complete("x", headers=limited)).status == 200
            response = await r.complete("x", headers=limited)
            assert response.status == 429
            assert response.headers["x-llmsched-dropped-reason"] == "rate-limited"
            assert int(response.headers["Retry-After"]) >= 1
            assert json.loads(await response.read())["error"]["type"] == "rate_limit_exceeded"
            # Another key is not affected.
            free = {"Authorization": "Bearer sk-free-000000001"}
            assert (await r.complete("x", headers=free)).status == 200
            assert len(r.engines[0].received) == 3
            assert r.metric("llmsched_gateway_rejections_total", reason="rate-limited") == 1

    run(body())


def test_a_key_over_its_token_rate_or_concurrency_gets_429() -> None:
    async def body() -> None:
        keys = {
            "sk-tokens-0000001": {"tenant": "a", "tokens_per_s": 0.01, "burst_tokens": 100},
            "sk-one-at-a-time": {"tenant": "b", "max_concurrent": 1},
        }
        async with rig(engines=1, answer_tokens=10, auth={"api_keys": keys}) as r:
            tokens = {"Authorization": "Bearer sk-tokens-0000001"}
            # 40 pseudo-tokens of prompt and 10 of output per request: the bucket of 100 is
            # spent after two requests.
            prompt = "y" * 160
            assert (await r.complete(prompt, headers=tokens)).status == 200
            assert (await r.complete(prompt, headers=tokens)).status == 200
            assert (await r.complete(prompt, headers=tokens)).status == 429
            one = {"Authorization": "Bearer sk-one-at-a-time"}
            r.engines[0].mode = "slow"
            r.engines[0].token_delay_s = 0.05
            first = asyncio.ensure_future(r.complete("z", headers=one, stream=True))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while r.engines[0].running == 0 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            second = await r.complete("z", headers=one)
            assert second.status == 429
            assert second.headers["x-llmsched-dropped-reason"] == "concurrency-limited"
            assert (await first).status == 200
            assert (await r.complete("z", headers=one)).status == 200  # released

    run(body())


def test_key_limits_are_checked() -> None:
    from llmsched.gateway.config import load_config

    base: dict[str, Any] = {"engines": [{"host": "127.0.0.1", "port": 1}], "models": ["m"]}
    for entry, match in (
        ({"tenant": "a", "requests_per_s": 0}, "requests_per_s"),
        ({"tenant": "a", "tokens_per_s": "fast"}, "tokens_per_s"),
        ({"tenant": "a", "max_concurrent": 0}, "max_concurrent"),
        ({"tenant": "a", "rps": 1}, "rps: unknown key"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config({**base, "auth": {"api_keys": {"sk-0000000001": entry}}})
