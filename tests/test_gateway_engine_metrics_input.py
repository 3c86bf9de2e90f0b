"""What engines can do to the gateway, answered alike on both data planes:
odd ``/metrics`` values (infinities, counts past 32 bits) that ended the Python plane's
scraping, a ``/metrics`` body longer than one read or endless, and the first requests after
start refused before the first scrape."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import struct

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    current_plane,
    plane,
    raw_request,
    read_cut_off,
    rig,
    run,
    until,
)

from llmsched.gateway import make_gateway
from llmsched.integrations.metrics import parse_engine_metrics

SCRAPE = {"enabled": True, "interval_s": 0.05, "timeout_s": 1.0}
FLOW = {"bands": [{"priority": 0}], "saturation": {"type": "concurrency", "max_requests": 4}}

GZIPPED = gzip.compress(b'{"choices": []}')

ODD_VALUES = {
    "waiting-inf": 'vllm:num_requests_waiting{model_name="x"} +Inf\n',
    "running-huge": 'vllm:num_requests_running{model_name="x"} 1e400\n',
    "waiting-2^32": 'vllm:num_requests_waiting{model_name="x"} 4294967296\n',
    "kv-nan": 'vllm:kv_cache_usage_perc{model_name="x"} NaN\n',
    "kv-minus-inf": 'vllm:kv_cache_usage_perc{model_name="x"} -Inf\n',
    "max-lora-2^32": (
        'vllm:lora_requests_info{max_lora="4294967296",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 1.0\n'
    ),
    "block-size-huge": 'vllm:cache_config_info{block_size="99999999999999999999"} 1.0\n',
    "latin-1-label": 'vllm:num_requests_waiting{model_name="caf\xe9"} 0\n',
}


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("extra", ODD_VALUES.values(), ids=ODD_VALUES)
def test_odd_metric_values_keep_scraping_and_serving(extra: str) -> None:
    async def main() -> None:
        async with rig(engines=1, scrape=SCRAPE, flow=FLOW, timeouts={"total_s": 5}) as r:
            engine = r.engines[0]
            engine.metrics_extra = extra
            for i in range(3):  # across several scrapes of the odd text
                await asyncio.sleep(0.1)
                response = await r.complete(f"odd {i}")
                assert response.status == 200, await response.text()
            engine.metrics_extra = ""
            engine.waiting = 7  # scraping goes on and reads new values
            await until(lambda: r.gateway.pool.endpoints()[0]["waiting"] == 7)

    run(main())


@pytest.mark.usefixtures("plane")
def test_the_load_figures_after_a_long_metrics_text_are_read() -> None:
    """A vLLM with eight data-parallel ranks writes about 270 KB of metrics; the Python plane
    read only the first chunk of it."""

    async def main() -> None:
        async with rig(engines=1, scrape=SCRAPE) as r:
            engine = r.engines[0]
            engine.metrics_prefix = "".join(
                f'vllm:prompt_tokens_total{{engine="{i}",model_name="{MODEL}"}} {i}.0\n'
                for i in range(6000)
            )
            engine.waiting, engine.running = 5, 3
            await until(lambda: r.gateway.pool.endpoints()[0]["waiting"] == 5)
            assert r.gateway.pool.endpoints()[0]["running"] == 3

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_endless_metrics_body_is_a_failed_scrape() -> None:
    async def main() -> None:
        async with rig(engines=1, scrape=SCRAPE) as r:
            worker = r.gateway.config.engines[0].worker_id
            r.engines[0].metrics_prefix = "# " + "x" * (9 << 20) + "\n"  # past the 8 MiB bound
            await until(
                lambda: (
                    r.metric(
                        "llmsched_gateway_scrape_failures_total", endpoint=worker, kind="failed"
                    )
                    > 0
                )
            )

    run(main())


@pytest.mark.usefixtures("plane")
def test_the_first_request_after_start_is_served_with_flow_control() -> None:
    """With flow control, an engine without metrics counts as saturated: the native plane's
    first scrape waited one interval, and requests until then were refused."""

    async def main() -> None:
        scrape = {**SCRAPE, "interval_s": 2.0}
        async with rig(engines=1, scrape=scrape, flow=FLOW, timeouts={"total_s": 1}) as r:
            response = await r.complete("at once")
            assert response.status == 200, await response.text()

    run(main())


def test_parse_skips_what_is_no_load_reading() -> None:
    values = parse_engine_metrics(
        "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 4294967296\n"
        "vllm:kv_cache_usage_perc NaN\n"
    )
    assert values == {"running": 2**32 - 1}


@pytest.mark.usefixtures("plane")
def test_a_stream_cut_inside_an_event_ends_with_an_error_event_of_its_own() -> None:
    """The engine's connection breaks in the middle of an event: the gateway's error event
    followed the half-sent one on the same line, and the client could parse neither."""

    async def main() -> None:
        async with rig(engines=1, answer_tokens=4) as r:
            body = {"model": MODEL, "prompt": "cut", "stream": True}
            body["x_fake_mode"] = "cut_mid_event"
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                assert response.status == 200
                received = await read_cut_off(response)
            events = [e for e in received.decode().split("\n\n") if e.strip()]
            first = json.loads(events[0].removeprefix("data: "))
            assert first["choices"][0]["text"] == " t0"
            assert events[-1].startswith("data: ")
            last = json.loads(events[-1].removeprefix("data: "))
            assert last["error"]["type"] == "upstream_error"
            assert len(events) == 3  # the whole event, the half one, the error event

    run(main())


def test_a_client_resetting_while_sending_its_body_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Python plane: aiohttp logged two tracebacks at ERROR for each such client (log noise any
    client can make)."""

    async def main() -> None:
        async with rig(engines=1, data_plane="python") as r:
            for _ in range(3):
                _reader, writer = await asyncio.open_connection("127.0.0.1", r.gateway.port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
                )
                await writer.drain()
                await asyncio.sleep(0.05)
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()
            await asyncio.sleep(0.2)
            assert (await r.complete("still served")).status == 200

    caplog.set_level(logging.DEBUG, logger="aiohttp")
    run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n"
        b"Content-Length: 0\r\n\r\n",
        b"HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n" % len(GZIPPED)
        + GZIPPED
        + b"\r\n0\r\n\r\n",
    ],
    ids=["101", "999", "gzip-chunked"],
)
def test_an_engine_answering_nothing_a_client_can_read_is_a_502(answer: bytes) -> None:
    """The Python plane relayed an engine's 101 to the client, the native plane its 999, and
    both a body in a gzip transfer coding as undecodable JSON."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                await reader.read()  # until the gateway closes the connection
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = {
            "engines": [{"host": "127.0.0.1", "port": port}],
            "models": [MODEL],
            "listen": {"port": 0},
            "scrape": {"enabled": False},
            "health": {"interval_s": None},
            "timeouts": {"read_s": 1},
        }
        gateway = make_gateway(config, data_plane=current_plane())
        await gateway.start()
        try:
            status, text = await raw_request(
                gateway.port, json.dumps({"model": MODEL, "prompt": "hi"}).encode()
            )
            assert status == 502, text
            assert json.loads(text)["error"]["type"] == "upstream_error"
        finally:
            await gateway.stop()
            server.close()
            await server.wait_closed()

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_stream_ending_cleanly_without_its_done_is_cut() -> None:
    """vLLM ends every stream with ``data: [DONE]``, an error event's too: one that ends without
    it was passed on as complete when its chunked body ended cleanly."""

    async def main() -> None:
        async with rig(engines=1, answer_tokens=3) as r:
            body = {"model": MODEL, "prompt": "no done", "stream": True, "x_fake_mode": "no_done"}
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                assert response.status == 200
                received = await read_cut_off(response)
            events = [e for e in received.decode().split("\n\n") if e.strip()]
            assert len(events) == 4  # three tokens, then the gateway's error event
            assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == 502
            worker = r.gateway.config.engines[0].worker_id
            labels = {"endpoint": worker, "outcome": "sse_error"}
            assert r.metric("llmsched_gateway_truncated_answers_total", **labels) == 1
            # A whole stream still ends as one.
            del body["x_fake_mode"]
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                text = await response.text()
            assert text.endswith("data: [DONE]\n\n")

    run(main())
