"""The reference gateway against fake engines: routing, passthrough, retries, cancellation,
overload and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading

import pytest
from _gateway_harness import MODEL, Rig, current_plane, plane, rig, run, until  # noqa: F401 (the fixture)

from llmsched.gateway import NativeGateway

pytestmark = pytest.mark.usefixtures("plane")


SYSTEM = "You are a helpful assistant that answers in full sentences. " * 4


def _only_engine_with_requests(r: Rig) -> int:
    used = [i for i, e in enumerate(r.engines) if e.received]
    assert len(used) == 1, [len(e.received) for e in r.engines]
    return used[0]


def test_non_streaming_completion_is_passed_through_byte_for_byte() -> None:
    async def body() -> None:
        async with rig() as r:
            response = await r.complete("Hello there", max_tokens=3)
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("application/json")
            engine = r.engines[_only_engine_with_requests(r)]
            assert await response.read() == engine.sent[0]
            assert json.loads(engine.sent[0])["choices"][0]["text"] == " t0 t1 t2"

    run(body())


def test_streaming_chat_is_passed_through_byte_for_byte() -> None:
    async def body() -> None:
        async with rig(answer_tokens=6) as r:
            request = {
                "model": MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": "Tell me a story"}],
            }
            async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                assert response.status == 200
                assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
                received = await response.read()
            engine = r.engines[_only_engine_with_requests(r)]
            assert engine.received[0].path == "/v1/chat/completions"
            assert received == engine.sent[0]
            assert received.endswith(b"data: [DONE]\n\n")
            assert received.count(b"data: {") == 6

    run(body())


def test_a_chat_with_a_tool_call_only_assistant_message_is_routed() -> None:
    async def body() -> None:
        async with rig() as r:
            request = {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": []},
                    {"role": "user", "content": "And in Rome?"},
                ],
            }
            async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                assert response.status == 200, await response.text()

    run(body())


def test_multi_turn_conversations_return_to_the_engine_holding_their_prefix() -> None:
    async def body() -> None:
        async with rig(engines=2) as r:
            conversations = 16
            homes: dict[int, set[int]] = {c: set() for c in range(conversations)}
            histories = {
                c: f"Conversation {c}: {chr(65 + c) * 40} Please help me with task {c}."
                for c in range(conversations)
            }
            for turn in range(3):
                for c in range(conversations):
                    prompt = histories[c] + f" User turn {turn}."
                    response = await r.complete(prompt)
                    assert response.status == 200
                    text = json.loads(await response.read())["choices"][0]["text"]
                    homes[c].add(r.engines.index(r.engine_of_request(-1)))
                    histories[c] = prompt + text
            assert all(len(h) == 1 for h in homes.values()), homes
            # Cold first turns tie and spread (random tie-break: all 16 on one engine has
            # probability 2**-15); later turns follow their prefix, not a favourite engine.
            assert {next(iter(h)) for h in homes.values()} == {0, 1}
            assert r.metric("llmsched_gateway_decision_seconds_count") == 3 * conversations

    run(body())


async def _warm(r: Rig, prompt: str) -> int:
    """Sends ``prompt`` once; returns the engine that served it."""
    response = await r.complete(prompt)
    assert response.status == 200
    return r.engines.index(r.engine_of_request(-1))


def test_retry_goes_to_another_engine_when_the_first_drops_the_connection() -> None:
    async def body() -> None:
        async with rig(engines=2) as r:
            home = await _warm(r, SYSTEM + " first")
            other = 1 - home
            r.engines[home].mode = "drop"
            response = await r.complete(SYSTEM + " first, again")
            assert response.status == 200
            assert len(r.engines[home].received) == 2  # the warm-up and the failed attempt
            assert len(r.engines[other].received) == 1
            assert await response.read() == r.engines[other].sent[-1]
            assert r.metric("llmsched_gateway_retries_total") == 1
            worker = r.gateway.config.engines[home].worker_id
            # Connected, then closed before any status line: "broken", not "connect".
            assert (
                r.metric("llmsched_gateway_upstream_errors_total", endpoint=worker, kind="broken")
                == 1
            )
            # No in-flight count is left behind on either engine.
            assert all(e["in_flight_requests"] == 0 for e in r.gateway.pool.endpoints())

    run(body())


def test_a_failed_attempt_drops_only_the_prefix_record_its_pick_added() -> None:
    async def body() -> None:
        async with rig(engines=2) as r:
            home = await _warm(r, SYSTEM + " first")
            workers = [spec.worker_id for spec in r.gateway.config.engines]
            prompt = SYSTEM + " first, and then a longer question"
            hashes = r.gateway.index.hash_text(prompt)
            held = r.gateway.index.match(hashes).as_dict().get(workers[home], 0)
            assert 0 < held < len(hashes)
            r.engines[home].mode = "drop"
            response = await r.complete(prompt)
            assert response.status == 200
            matched = r.gateway.index.match(hashes).as_dict()
            # The failed engine keeps what the warm-up recorded, not what this pick added;
            # the engine that served it holds the whole prompt.
            assert matched == {workers[home]: held, workers[1 - home]: len(hashes)}
            if isinstance(r.gateway, NativeGateway):
                counters = r.gateway.native().counters()
                assert counters["records_removed"] == len(hashes) - held
                assert counters["retries"] == 1
                assert all(e["in_flight_requests"] == 0 for e in r.gateway.pool.endpoints())
            else:
                stats = r.gateway.scheduler.stats()
                assert stats["records_removed"] == len(hashes) - held
                assert stats["retries"] == 1 and stats["in_flight"] == 0

    run(body())


def test_retry_after_a_500_before_the_first_byte_keeps_the_engine_in_rotation() -> None:
    async def body() -> None:
        async with rig(engines=2) as r:
            home = await _warm(r, SYSTEM + " second")
            r.engines[home].mode = "error500"
            response = await r.complete(SYSTEM + " second, again", stream=True)
            assert response.status == 200
            assert len(r.engines[1 - home].received) == 1
            worker = r.gateway.config.engines[home].worker_id
            assert (
                r.metric(
                    "llmsched_gateway_upstream_errors_total", endpoint=worker, kind="status_5xx"
                )
                == 1
            )
            assert len(r.gateway.pool) == 2  # a 500 is not a dead engine

    run(body())


def test_a_stopped_engine_is_routed_around() -> None:
    async def body() -> None:
        async with rig(engines=2, retries={"eject_s": 60}) as r:
            home = await _warm(r, SYSTEM + " third")
            await r.engines[home].stop()
            for i in range(5):
                response = await r.complete(SYSTEM + f" third, turn {i}")
                assert response.status == 200
            assert len(r.engines[1 - home].received) == 5
            worker = r.gateway.config.engines[home].worker_id
            # A refused connection, confirmed by failed probes: the engine is left out.
            await until(lambda: r.gateway.health.state(worker) == "down")
            assert (
                r.metric("llmsched_gateway_upstream_errors_total", endpoint=worker, kind="connect")
                >= 1
            )
            assert r.metric("llmsched_gateway_ejections_total", endpoint=worker) == 1
            assert r.gateway.routable_endpoints() == [r.gateway.config.engines[1 - home].worker_id]
            async with r.client.get(r.url("/ready")) as ready:
                assert ready.status == 200

    run(body())


def test_every_engine_failing_gives_502_without_engine_details() -> None:
    async def body() -> None:
        async with rig(engines=2, retries={"max_attempts": 5}) as r:
            for engine in r.engines:
                engine.mode = "error500"
            response = await r.complete("anything")
            assert response.status == 502
            text = (await response.read()).decode()
            assert json.loads(text)["error"]["type"] == "upstream_error"
            for engine in r.engines:
                assert str(engine.port) not in text and "127.0.0.1" not in text
            assert sum(len(e.received) for e in r.engines) == 2  # each engine tried once

    run(body())


def test_retries_are_bounded_by_max_attempts() -> None:
    async def body() -> None:
        async with rig(engines=3, retries={"max_attempts": 2}) as r:
            for engine in r.engines:
                engine.mode = "error500"
            response = await r.complete("anything")
            assert response.status == 502
            assert sum(len(e.received) for e in r.engines) == 2

    run(body())


def test_a_cancelled_client_request_cancels_the_upstream_one() -> None:
    async def body() -> None:
        async with rig(
            engines=1, flow={"saturation": {"type": "concurrency", "max_requests": 4}}
        ) as r:
            engine = r.engines[0]
            engine.mode = "stall"
            request = r.client.post(r.url("/v1/completions"), json={"model": MODEL, "prompt": "x"})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(request, timeout=0.3)
            await asyncio.wait_for(engine.disconnected.wait(), timeout=5)
            assert engine.disconnects == 1
            await until(lambda: r.gateway.flow is not None and r.gateway.flow.running_count() == 0)
            assert r.gateway.pool.endpoints()[0]["in_flight_requests"] == 0

    run(body())


def test_a_client_leaving_a_stream_cancels_the_upstream_stream() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=200) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.02
            request = {"model": MODEL, "prompt": "x", "stream": True}
            response = await r.client.post(r.url("/v1/completions"), json=request)
            assert response.status == 200
            assert (await response.content.readany()).startswith(b"data: {")
            response.close()
            await asyncio.wait_for(engine.disconnected.wait(), timeout=5)
            await until(lambda: r.gateway.pool.endpoints()[0]["in_flight_requests"] == 0)

    run(body())


def test_overload_sheds_sheddable_requests_while_high_priority_ones_pass() -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 1}}
        async with rig(engines=1, answer_tokens=10, flow=flow) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.03
            busy = asyncio.ensure_future(r.complete("busy", stream=True))
            await until(lambda: engine.running == 1)
            shed = await r.complete("batch job", headers={"x-llmsched-priority": "-1"})
            assert shed.status == 429
            assert shed.headers["x-llmsched-dropped-reason"] == "load-shed"
            assert shed.headers["Retry-After"] == "1"
            error = json.loads(await shed.read())["error"]
            assert error["type"] == "rate_limit_exceeded" and error["code"] == 429
            # A high-priority request waits for capacity instead, then passes.
            urgent = await r.complete("interactive", headers={"x-llmsched-priority": "5"})
            assert urgent.status == 200
            assert (await busy).status == 200
            assert len(engine.received) == 2  # the shed request never reached it
            assert r.metric("llmsched_gateway_rejections_total", reason="load-shed") == 1
            assert r.metric("llmsched_gateway_flow_outcomes_total", outcome="rejected_shed") == 1

    run(body())


def test_flow_control_without_engine_metrics_answers_503_no_endpoints() -> None:
    async def body() -> None:
        # Utilization saturation needs scraped metrics; with scraping off there are none.
        async with rig(engines=1, flow={}) as r:
            response = await r.complete("hello")
            assert response.status == 503
            assert response.headers["x-llmsched-dropped-reason"] == "no-endpoints"
            assert not r.engines[0].received

    run(body())


def test_prefill_decode_split_names_the_prefill_engine_in_the_sidecar_header() -> None:
    async def body() -> None:
        router = {
            "plugins": [
                {"type": "prefill-filter"},
                {"type": "decode-filter"},
                {"type": "prefix-cache-scorer"},
                {"type": "max-score-picker"},
                {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 8}},
                {
                    "type": "pd-profile-handler",
                    "parameters": {"deciderPluginName": "prefix-based-pd-decider"},
                },
            ],
            "schedulingProfiles": [
                {
                    "name": "prefill",
                    "plugins": [
                        {"pluginRef": "prefill-filter"},
                        {"pluginRef": "prefix-cache-scorer"},
                        {"pluginRef": "max-score-picker"},
                    ],
                },
                {
                    "name": "decode",
                    "plugins": [
                        {"pluginRef": "decode-filter"},
                        {"pluginRef": "prefix-cache-scorer"},
                        {"pluginRef": "max-score-picker"},
                    ],
                },
            ],
        }
        roles = [{"role": "prefill"}, {"role": "decode"}]
        async with rig(engines=2, engine_fields=roles, router=router, pd={"enabled": True}) as r:
            prefill, decode = r.engines
            response = await r.complete(SYSTEM)  # far more than 8 uncached pseudo-tokens
            assert response.status == 200
            assert not prefill.received
            (received,) = decode.received
            assert received.headers["x-prefiller-host-port"] == f"127.0.0.1:{prefill.port}"

    run(body())


def test_models_health_ready_and_metrics() -> None:
    async def body() -> None:
        async with rig(
            engines=2, flow={"saturation": {"type": "concurrency", "max_requests": 8}}
        ) as r:
            async with r.client.get(r.url("/v1/models")) as response:
                assert response.status == 200
                assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
            async with r.client.get(r.url("/health")) as response:
                assert response.status == 200
            async with r.client.get(r.url("/ready")) as response:
                assert (await response.json()) == {"ready": True, "endpoints": 2}
            assert (await r.complete(SYSTEM)).status == 200
            async with r.client.get(r.url("/metrics")) as response:
                text = await response.text()
            for name in (
                "llmsched_gateway_decision_seconds_bucket",
                "llmsched_gateway_overhead_seconds_count",
                "llmsched_gateway_saturation",
                "llmsched_gateway_index_blocks",
                "llmsched_gateway_retries_total",
                'llmsched_gateway_flow_outcomes_total{outcome="dispatched"} 1.0',
                'llmsched_gateway_requests_total{route="completions",status="200"} 1.0',
            ):
                assert name in text, name
            # The approximate prefix entries recorded at dispatch are in the index.
            assert r.metric("llmsched_gateway_index_blocks") > 0

    run(body())


@pytest.mark.parametrize("record", [None, True])
def test_a_router_that_reads_no_prefix_records_none_unless_asked(record: bool | None) -> None:
    """Round-robin reads nothing of the prefix index: the native plane then neither hashes
    the prompt nor records its blocks (the index holds what KV events report), unless
    ``record_unread_prefixes``; the Python plane always records."""

    async def body() -> None:
        extra = {} if record is None else {"record_unread_prefixes": record}
        async with rig(engines=2, router="round-robin", **extra) as r:
            for _ in range(4):
                assert (await r.complete(SYSTEM)).status == 200
            # Round-robin still alternates.
            assert [len(e.received) for e in r.engines] == [2, 2]
            blocks = r.metric("llmsched_gateway_index_blocks")
            if current_plane() == "native" and record is None:
                assert blocks == 0
                assert r.gateway.index.stats()["blocks"] == 0
            else:
                assert blocks > 0

    run(body())


def test_ready_is_503_when_no_engine_is_routable() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            r.gateway.pool.remove(r.gateway.config.engines[0].worker_id)
            async with r.client.get(r.url("/ready")) as response:
                assert response.status == 503

    run(body())


def test_bad_requests_are_400_in_openai_error_shape() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            cases = [
                b"not json",
                b"[1, 2]",
                json.dumps({"prompt": "no model"}).encode(),
                json.dumps({"model": MODEL, "prompt": 3}).encode(),
                json.dumps({"model": MODEL, "prompt": [1, -2]}).encode(),
            ]
            for data in cases:
                async with r.client.post(r.url("/v1/completions"), data=data) as response:
                    assert response.status == 400, data
                    assert (await response.json())["error"]["type"] == "invalid_request_error"
            bad_chat = {"model": MODEL, "messages": "hi"}
            async with r.client.post(r.url("/v1/chat/completions"), json=bad_chat) as response:
                assert response.status == 400
            bad_priority = {"x-llmsched-priority": "high"}
            assert (await r.complete("x", headers=bad_priority)).status == 400
            assert not r.engines[0].received

    run(body())


# -- helpers ------------------------------------------------------------------------------


def test_the_first_streamed_chunk_arrives_before_the_stream_ends_on_a_reused_connection() -> None:
    """TCP_NODELAY on both sides: the engine sends one event and then holds the stream open, so
    the client can only see that event while the stream is still running; the connections to
    the client and to the engine are both reused from a request before."""

    async def body() -> None:
        import aiohttp

        async with rig(engines=1, answer_tokens=4) as r:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as client:
                url = r.url("/v1/completions")
                warm = {"model": MODEL, "prompt": "warm", "stream": True}
                async with client.post(url, json=warm) as response:
                    assert b"[DONE]" in await response.read()
                r.engines[0].mode = "hang"
                held = {"model": MODEL, "prompt": "held", "stream": True}
                async with client.post(url, json=held) as response:
                    assert response.status == 200
                    # A deadlock guard, not a timing threshold: the engine never ends this
                    # stream, so a chunk held back until the end would never come.
                    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 10)
                    assert b'"text": " t0"' in first
                    assert not response.content.at_eof()
                    assert r.engines[0].running == 1
                    assert r.metric("llmsched_gateway_connections") == 1
            assert len(r.engines[0].received) == 2

    run(body())


def test_a_python_scorer_in_the_router_config_steers_every_request() -> None:
    """A router config's Python scorer runs on either plane (natively the router takes the GIL
    for that call only)."""
    calls: list[int] = []

    def prefer_second(
        request: dict[str, object], endpoints: list[dict[str, object]]
    ) -> list[float]:
        calls.append(len(endpoints))
        return [1.0 if str(e["id"]).endswith(str(second_port)) else 0.0 for e in endpoints]

    second_port = 0

    async def body() -> None:
        nonlocal second_port
        router = {
            "plugins": [
                {
                    "type": "python-scorer",
                    "name": "mine",
                    "parameters": {"function": prefer_second},
                },
            ],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "mine"}]}],
        }
        async with rig(engines=2, router=router) as r:
            second_port = r.engines[1].port
            for i in range(6):
                assert (await r.complete(f"prompt {i}")).status == 200
            assert len(r.engines[1].received) == 6 and not r.engines[0].received
            assert calls == [2] * 6

    run(body())


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_failing_python_plugin_is_a_500_that_says_why_and_the_gateway_goes_on(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Probe 99: a Python scorer that raised (or returned what it must not) was a 400
    ``invalid_request_error`` on the native plane (the client's fault), aiohttp's bare text 500
    on the Python plane, where a KeyboardInterrupt or SystemExit raised by the plugin ended the
    server. Now both planes answer 500 ``internal_error`` saying why, counted as
    ``rejections_total{reason="routing_failed"}``, the error logged once per distinct message;
    nothing stays taken (in-flight counts, flow slots) and the next request is served."""
    failures: list[BaseException | list[float]] = [
        ValueError("my plugin is broken"),
        ValueError("my plugin is broken"),
        KeyboardInterrupt(),
        SystemExit(3),
        _Unprintable(),
        [0.5],
    ]
    failing: list[BaseException | list[float]] = []

    def scorer(request: dict[str, object], endpoints: list[dict[str, object]]) -> list[float]:
        if failing:
            failure = failing.pop()
            if isinstance(failure, BaseException):
                raise failure
            return failure
        return [0.5] * len(endpoints)

    async def body() -> None:
        router = {
            "plugins": [
                {"type": "python-scorer", "name": "mine", "parameters": {"function": scorer}}
            ],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "mine"}]}],
        }
        flow = {"saturation": {"type": "concurrency", "max_requests": 4}}
        async with rig(engines=2, router=router, flow=flow) as r:
            messages = []
            for failure in failures:
                failing.append(failure)
                response = await r.complete("hello")
                assert response.status == 500, await response.text()
                assert response.headers["x-llmsched-dropped-reason"] == "routing_failed"
                error = json.loads(await response.read())["error"]
                assert error["type"] == "internal_error" and error["code"] == 500
                assert error["message"].startswith("routing failed: ")
                messages.append(error["message"])
            assert "ValueError: my plugin is broken" in messages[0]
            assert "KeyboardInterrupt" in messages[2] and "SystemExit: 3" in messages[3]
            assert "_Unprintable" in messages[4]
            assert 'plugin "mine" (function scorer) returned 1 values for 2' in messages[5]
            assert not any(e.received for e in r.engines)
            assert r.metric("llmsched_gateway_rejections_total", reason="routing_failed") == 6
            assert all(e["in_flight_requests"] == 0 for e in r.gateway.pool.endpoints())
            if r.gateway.flow is not None:
                assert r.gateway.flow.running_count() == 0
            assert (await r.complete("hello")).status == 200
            assert all(e["in_flight_requests"] == 0 for e in r.gateway.pool.endpoints())

    with caplog.at_level(logging.ERROR, logger="llmsched.gateway"):
        run(body())
    logged = [m for m in caplog.messages if "routing failed" in m]
    logged += [line for line in capfd.readouterr().err.splitlines() if "routing failed" in line]
    # Once per distinct message: the repeated ValueError is logged once.
    assert len(logged) == 5, logged


def test_a_slow_python_plugin_does_not_stall_the_native_runtime() -> None:
    """Probe 100: on the native plane a Python scorer ran on the runtime's worker thread: with
    ``native_threads: 1`` every other request and ``/health`` waited for as long as it ran.
    A router with a Python plugin now decides on the runtime's blocking pool: ``/health`` and
    another request are answered while the plugin is still deciding the first one (it waits
    until the test lets it go)."""
    if current_plane() == "python":
        pytest.skip("the Python plane runs a plugin on its event loop (docs/routing.md)")
    entered = threading.Event()
    release = threading.Event()

    def scorer(request: dict[str, object], endpoints: list[dict[str, object]]) -> list[float]:
        if request.get("prompt_tokens") == 7:
            entered.set()
            release.wait(timeout=20)
        return [0.5] * len(endpoints)

    async def body() -> None:
        router = {
            "plugins": [
                {"type": "python-scorer", "name": "slow", "parameters": {"function": scorer}}
            ],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "slow"}]}],
        }
        async with rig(engines=1, router=router, native_threads=1) as r:
            slow = asyncio.ensure_future(r.complete(list(range(1, 8))))
            try:
                await until(entered.is_set)
                async with r.client.get(r.url("/health")) as response:
                    assert response.status == 200
                # Another request's decision does not wait for the slow one either.
                assert (await r.complete([1, 2])).status == 200
                assert not release.is_set() and not slow.done()
            finally:
                release.set()
            assert (await slow).status == 200

    run(body())


def test_a_cache_salt_routes_in_its_own_namespace() -> None:
    """vLLM salts a prompt's first block with the request's ``cache_salt``: a salted prompt
    shares no block with the same prompt unsalted or under another salt. The gateway records
    and matches each request under its salt, so a salted request is never sent after the
    unsalted prompt's blocks, and a second request under the same salt finds the first's."""

    async def body() -> None:
        async with rig(engines=2) as r:
            index = r.gateway.index
            tokens = list(range(100, 164))
            response = await r.complete(tokens, max_tokens=1)
            assert response.status == 200
            plain_home = r.worker_of_request()
            assert index.match_tokens(tokens).as_dict() == {plain_home: 16}
            assert index.match_tokens(tokens, cache_salt="tenant-a").as_dict() == {}
            homes = set()
            for _ in range(3):
                response = await r.complete(tokens, max_tokens=1, cache_salt="tenant-a")
                assert response.status == 200
                homes.add(r.worker_of_request())
                assert r.engine_of_request().received[-1].body["cache_salt"] == "tenant-a"
            assert len(homes) == 1, homes
            assert index.match_tokens(tokens, cache_salt="tenant-a").as_dict() == {
                next(iter(homes)): 16
            }
            assert index.match_tokens(tokens).as_dict() == {plain_home: 16}
            assert index.match_tokens(tokens, cache_salt="tenant-b").as_dict() == {}

    run(body())


def test_a_lora_adapter_routes_to_its_base_model_under_its_own_name() -> None:
    """A request naming a configured LoRA adapter is served by its base model's engines,
    forwarded as sent, and its prompt is recorded and matched under the adapter (vLLM keys
    an adapter's cache blocks by its name): the base model's blocks never count for it, nor
    its for the base model. ``/v1/models`` lists it with its base as ``parent``."""

    async def body() -> None:
        async with rig(engines=2, models=[MODEL, "other"], lora_adapters={"sql": MODEL}) as r:
            index = r.gateway.index
            tokens = list(range(300, 364))
            response = await r.complete(tokens, max_tokens=1)
            assert response.status == 200
            base_home = r.worker_of_request()
            homes = set()
            for _ in range(3):
                response = await r.complete(tokens, max_tokens=1, model="sql")
                assert response.status == 200, await response.text()
                assert r.engine_of_request().received[-1].body["model"] == "sql"
                homes.add(r.worker_of_request())
            assert len(homes) == 1, homes
            assert index.match_tokens(tokens, lora="sql").as_dict() == {next(iter(homes)): 16}
            assert index.match_tokens(tokens).as_dict() == {base_home: 16}
            response = await r.complete(tokens, max_tokens=1, model="nosuch")
            assert response.status == 404
            async with r.client.get(r.url("/v1/models")) as listing:
                models = (await listing.json())["data"]
            assert [(m["id"], m.get("parent")) for m in models] == [
                (MODEL, None),
                ("other", None),
                ("sql", MODEL),
            ]

    run(body())


@pytest.mark.parametrize(
    ("adapters", "problem"),
    [
        ({"sql": "nosuch"}, "base model 'nosuch' is not in models"),
        ({MODEL: MODEL}, "is also a model in models"),
        (["sql"], "must map each adapter"),
        ({"sql": 3}, "must map each adapter"),
    ],
)
def test_bad_lora_adapters_are_config_errors(adapters: object, problem: str) -> None:
    from llmsched.errors import ConfigError
    from llmsched.gateway.config import load_config

    base = {"engines": [{"host": "127.0.0.1", "port": 9}], "models": [MODEL]}
    with pytest.raises(ConfigError, match=problem):
        load_config({**base, "lora_adapters": adapters})


def test_a_prompt_given_as_embeddings_is_served_without_prefix_routing() -> None:
    """vLLM's ``--enable-prompt-embeds``: a completions request with ``prompt_embeds`` and no
    ``prompt`` is forwarded as sent and routed on load alone (its blocks are keyed by the
    embeddings); one with neither is still a 400."""

    async def body() -> None:
        async with rig(engines=2) as r:
            for embeds in ("AAAA", ["AAAA", "BBBB"]):
                response = await r.complete(None, max_tokens=1, prompt_embeds=embeds)
                assert response.status == 200, await response.text()
                assert r.engine_of_request().received[-1].body["prompt_embeds"] == embeds
            assert r.gateway.index.stats()["blocks"] == 0
            for bad in ("", [], [1], None):
                response = await r.complete(None, max_tokens=1, prompt_embeds=bad)
                assert response.status == 400, bad

    run(body())


def test_a_gateway_listening_on_an_ipv6_address_gives_a_url_that_parses() -> None:
    """Probe 78: ``gateway.url`` (and so ``llmsched serve``'s "listening on" line) wrote an
    IPv6 listen address bare, ``http://::1:8000``, which no client parses."""

    async def body() -> None:
        async with rig(engines=1, listen={"host": "::1", "port": 0}) as r:
            assert r.gateway.url == f"http://[::1]:{r.gateway.port}"
            async with r.client.get(r.url("/ready")) as response:
                assert response.status == 200
            assert (await r.complete("over IPv6")).status == 200
        async with rig(engines=1, listen={"host": "127.0.0.1", "port": 0}) as r:
            assert r.gateway.url == f"http://127.0.0.1:{r.gateway.port}"

    run(body())
