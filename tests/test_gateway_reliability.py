"""The gateway under faulty engines: answers cut off or timed out never pass for complete ones,
a request whose status line came back is never re-sent, engine health follows the engines'
behaviour (probes, failure rates) and not single requests, and no engine left means a 503 at
once."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    Rig,
    in_front_of_raw,
    plane,
    raw_request,
    read_cut_off,
    rig,
    run,
    until,
)

pytestmark = pytest.mark.usefixtures("plane")


SYSTEM = "You are a helpful assistant that answers in full sentences. " * 4
# Probes fast enough for a test, thresholds as in production.
FAST_HEALTH = {"interval_s": 0.05, "timeout_s": 1.0}


async def _warm(r: Rig, prompt: str) -> int:
    response = await r.complete(prompt)
    assert response.status == 200
    return r.engines.index(r.engine_of_request(-1))


def _worker(r: Rig, index: int) -> str:
    return r.gateway.config.engines[index].worker_id


def _truncated(r: Rig, worker: str, outcome: str) -> float:
    return r.metric("llmsched_gateway_truncated_answers_total", endpoint=worker, outcome=outcome)


# -- answers cut off -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cut", "hang"])
def test_a_json_answer_cut_off_is_a_502_and_is_not_sent_again(mode: str) -> None:
    async def body() -> None:
        async with rig(engines=2, timeouts={"read_s": 0.3}) as r:
            home = await _warm(r, SYSTEM + mode)
            r.engines[home].mode = mode
            response = await r.complete(SYSTEM + mode + " again")
            assert response.status == 502
            error = json.loads(await response.read())["error"]
            assert error["type"] == "upstream_error" and "cut off" in error["message"]
            # The engine answered (status line): the request ran there and is not re-sent.
            assert len(r.engines[home].received) == 2
            assert not r.engines[1 - home].received
            assert r.metric("llmsched_gateway_retries_total") == 0
            worker = _worker(r, home)
            assert _truncated(r, worker, "error") == 1
            assert r.gateway.pool.endpoints()[0]["in_flight_requests"] == 0

    run(body())


@pytest.mark.parametrize("mode", ["cut", "hang"])
def test_a_stream_cut_off_ends_with_an_error_event_and_no_done(mode: str) -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=6, timeouts={"read_s": 0.3}) as r:
            r.engines[0].mode = mode
            request = {"model": MODEL, "prompt": "x", "stream": True}
            async with r.client.post(r.url("/v1/completions"), json=request) as response:
                assert response.status == 200
                received = await read_cut_off(response)
            events = [e for e in received.split(b"\n\n") if e]
            assert events[0].startswith(b"data: {") and b'"text": " t0"' in events[0]
            assert json.loads(events[-1][len(b"data: ") :])["error"]["type"] == "upstream_error"
            assert b"[DONE]" not in received
            worker = _worker(r, 0)
            assert _truncated(r, worker, "sse_error") == 1
            assert r.metric(
                "llmsched_gateway_requests_total", route="completions", status="aborted"
            )
            assert len(r.engines[0].received) == 1

    run(body())


def test_a_chunked_json_answer_cut_off_resets_the_client_connection() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            engine = r.engines[0]
            engine.mode = "cut"
            engine.chunked_json = True
            body = {"model": MODEL, "prompt": "x"}
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                assert response.status == 200
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
                    await response.read()
            assert _truncated(r, _worker(r, 0), "reset") == 1
            # The gateway keeps serving.
            engine.mode = "ok"
            assert (await r.complete("y")).status == 200

    run(body())


_CLOSE_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
_CLOSE_SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
_EVENT = b'data: {"choices":[{"index":0,"text":" t0","finish_reason":null}]}\n\n'


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_answer_ended_by_the_engine_closing_passes_only_whole(stream: bool) -> None:
    # No Content-Length and not chunked: the body ends where the engine closes, so a cut
    # looks like an end. The JSON must parse, or the client gets a 502.
    body = json.dumps({"model": MODEL, "prompt": "x", "stream": stream}).encode()

    async def cut() -> None:
        async with in_front_of_raw(_CLOSE_JSON + b'{"choices":[{"text":"hel') as gateway:
            status, text = await raw_request(gateway.port, body)
            assert status == 502, text
            assert "cut off" in json.loads(text)["error"]["message"]
            async with aiohttp.ClientSession() as client:
                worker = gateway.config.engines[0].worker_id
                assert _truncated(Rig(gateway, [], client), worker, "error") == 1

    async def whole() -> None:
        answer = _CLOSE_JSON + b'{"choices":[{"text":"hello"}],"usage":{"completion_tokens":1}}'
        async with in_front_of_raw(answer) as gateway:
            status, text = await raw_request(gateway.port, body)
            assert status == 200, text
            assert json.loads(text)["choices"][0]["text"] == "hello"

    run(cut())
    run(whole())


def test_an_event_stream_ended_by_the_engine_closing_needs_its_done() -> None:
    request = {"model": MODEL, "prompt": "x", "stream": True}

    async def cut() -> None:
        async with (
            in_front_of_raw(_CLOSE_SSE + _EVENT + _EVENT) as gateway,
            aiohttp.ClientSession() as client,
        ):
            url = gateway.url + "/v1/completions"
            async with client.post(url, json=request) as response:
                assert response.status == 200
                received = await read_cut_off(response)
            events = [e for e in received.split(b"\n\n") if e]
            assert len(events) == 3, events
            assert json.loads(events[-1][len(b"data: ") :])["error"]["type"] == "upstream_error"
            assert b"[DONE]" not in received

    async def whole() -> None:
        answer = _CLOSE_SSE + _EVENT + _EVENT + b"data: [DONE]\n\n"
        async with in_front_of_raw(answer) as gateway, aiohttp.ClientSession() as client:
            async with client.post(gateway.url + "/v1/completions", json=request) as response:
                assert response.status == 200
                received = await response.read()  # complete: no payload error
            assert received.endswith(b"data: [DONE]\n\n")

    run(cut())
    run(whole())


_TEXT_EVENT = b'data: {"choices":[{"index":0,"text":"data: [DONE]","finish_reason":null}]}\n\n'


@pytest.mark.parametrize(
    ("events", "whole"),
    [
        (_EVENT + b"data:[DONE]\n\n", True),  # SSE's space after the colon is optional
        ((_EVENT + b"data: [DONE]\n\n").replace(b"\n", b"\r\n"), True),
        ((_EVENT + b"data:[DONE]\n\n").replace(b"\n", b"\r"), True),
        (_EVENT + _TEXT_EVENT, False),  # the bytes in a token's text
        (_EVENT + b": data: [DONE]\n\n", False),  # in a comment line
    ],
    ids=["unspaced", "crlf", "cr", "in-text", "in-comment"],
)
def test_only_a_done_line_makes_a_stream_whole(events: bytes, whole: bool) -> None:
    """Probe 51 F3: the check was a search for the bytes ``data: [DONE]`` anywhere, so a cut
    stream whose token text held them passed as whole, and an engine's valid ``data:[DONE]``
    got the client an error event after a complete stream."""
    request = {"model": MODEL, "prompt": "x", "stream": True}

    async def body() -> None:
        async with (
            in_front_of_raw(_CLOSE_SSE + events) as gateway,
            aiohttp.ClientSession() as client,
            client.post(gateway.url + "/v1/completions", json=request) as response,
        ):
            assert response.status == 200
            if whole:
                received = await response.read()  # complete: no payload error
                assert b"upstream_error" not in received
            else:
                received = await read_cut_off(response)
                assert b"upstream_error" in received

    run(body())


@pytest.mark.parametrize("done", [True, False])
def test_an_event_stream_framed_by_its_length_must_show_its_done(done: bool) -> None:
    """Probe 51 F10: an event stream with a Content-Length and no ``[DONE]`` reached the
    client as a complete 200 (the gateway counted it as cut, but had passed the length on).
    Now it is read whole and checked first: without its end it is a 502."""
    events = _EVENT + _EVENT + (b"data: [DONE]\n\n" if done else b"")
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
    request = json.dumps({"model": MODEL, "prompt": "x", "stream": True}).encode()

    async def body() -> None:
        async with in_front_of_raw(head % len(events) + events) as gateway:
            status, text = await raw_request(gateway.port, request)
            if done:
                assert status == 200, text
                assert text.endswith("data: [DONE]\n\n")
            else:
                assert status == 502, text
                assert "without its end event" in json.loads(text)["error"]["message"]
                async with aiohttp.ClientSession() as client:
                    worker = gateway.config.engines[0].worker_id
                    assert _truncated(Rig(gateway, [], client), worker, "error") == 1

    run(body())


def test_no_status_line_within_the_read_timeout_is_a_504_and_is_not_sent_again() -> None:
    async def body() -> None:
        async with rig(engines=2, timeouts={"read_s": 0.3}) as r:
            home = await _warm(r, SYSTEM + " silent")
            r.engines[home].mode = "stall"  # takes the request, never answers
            response = await r.complete(SYSTEM + " silent again")
            assert response.status == 504
            assert len(r.engines[home].received) == 2
            assert not r.engines[1 - home].received
            worker = _worker(r, home)
            errors = "llmsched_gateway_upstream_errors_total"
            assert r.metric(errors, endpoint=worker, kind="timeout") == 1

    run(body())


def test_with_on_5xx_off_a_5xx_is_relayed_and_not_sent_again() -> None:
    async def body() -> None:
        async with rig(engines=2, retries={"on_5xx": False}) as r:
            home = await _warm(r, SYSTEM + " 5xx")
            r.engines[home].mode = "error500"
            response = await r.complete(SYSTEM + " 5xx again")
            assert response.status == 500
            assert len(r.engines[home].received) == 2
            assert not r.engines[1 - home].received
            worker = _worker(r, home)
            errors = "llmsched_gateway_upstream_errors_total"
            assert r.metric(errors, endpoint=worker, kind="status_5xx") == 1

    run(body())


def test_a_request_whose_deadline_passes_gets_504() -> None:
    async def body() -> None:
        async with rig(engines=1, timeouts={"total_s": 0.3}) as r:
            r.engines[0].mode = "stall"
            response = await r.complete("x")
            assert response.status == 504
            assert json.loads(await response.read())["error"]["type"] == "timeout"
            # The deadline is the request's, not the engine's fault.
            assert r.gateway.health.state(_worker(r, 0)) == "up"

    run(body())


# -- engine health -------------------------------------------------------------------------


def test_dropped_connections_from_client_requests_do_not_eject_a_healthy_engine() -> None:
    async def body() -> None:
        async with rig(engines=2, health={"interval_s": None}) as r:  # probes on demand only
            home = await _warm(r, SYSTEM + " drops")
            engine = r.engines[home]
            # Fewer attempts than breaker_min_requests (20): the breaker is not in play; each
            # drop alone must not take the engine out.
            for i in range(6):
                engine.mode = "drop"  # this request makes the engine drop the connection
                response = await r.complete(SYSTEM + f" drops {i}")
                assert response.status == 200  # retried elsewhere: no status line came
                engine.mode = "ok"
                assert (await r.complete(SYSTEM + f" fine {i}")).status == 200
            worker = _worker(r, home)
            # failures_to_probe (5) drops in a row: probes check the engine, which answers them.
            ok_probes = r.metric(
                "llmsched_gateway_health_probes_total", endpoint=worker, result="ok"
            )
            for i in range(5):  # every engine drops these: 502s, and 5 failures in a row each
                await r.complete(f"{i} drop in a row", x_fake_mode="drop")
            await until(
                lambda: (
                    r.metric("llmsched_gateway_health_probes_total", endpoint=worker, result="ok")
                    > ok_probes
                )
            )
            assert r.metric("llmsched_gateway_ejections_total", endpoint=worker) == 0
            assert r.metric("llmsched_gateway_breaker_opens_total", endpoint=worker) == 0
            assert r.gateway.health.state(worker) == "up"
            assert len(r.gateway.routable_endpoints()) == 2

    run(body())


def test_a_refused_connection_is_confirmed_by_probes_before_ejection() -> None:
    async def body() -> None:
        async with rig(engines=2, retries={"eject_s": 60}) as r:
            home = await _warm(r, SYSTEM + " refused")
            await r.engines[home].stop()
            for i in range(5):
                assert (await r.complete(SYSTEM + f" refused {i}")).status == 200
            worker = _worker(r, home)
            # The state turns before the ejection is counted and the engine leaves routing.
            await until(
                lambda: (
                    r.gateway.health.state(worker) == "down"
                    and r.metric("llmsched_gateway_ejections_total", endpoint=worker) == 1
                    and r.gateway.routable_endpoints() == [_worker(r, 1 - home)]
                )
            )
            # Confirmed by failed probes (unhealthy_threshold), not by the request alone.
            failed = r.metric(
                "llmsched_gateway_health_probes_total", endpoint=worker, result="failed"
            )
            assert failed >= 3
            assert r.metric("llmsched_gateway_endpoint_up", endpoint=worker) == 0
            assert r.gateway.routable_endpoints() == [_worker(r, 1 - home)]

    run(body())


def test_active_checks_take_an_engine_down_and_bring_it_back() -> None:
    async def body() -> None:
        async with rig(engines=2, health=FAST_HEALTH, retries={"eject_s": 0.05}) as r:
            worker = _worker(r, 0)
            r.engines[0].health_status = 503
            await until(lambda: r.gateway.health.state(worker) == "down")
            for i in range(4):
                assert (await r.complete(f"while down {i}")).status == 200
            assert not r.engines[0].received
            r.engines[0].health_status = 200
            # The state turns before the engine is back in routing.
            await until(
                lambda: (
                    r.gateway.health.state(worker) == "up"
                    and sorted(r.gateway.routable_endpoints()) == sorted([worker, _worker(r, 1)])
                )
            )
            assert r.metric("llmsched_gateway_endpoint_up", endpoint=worker) == 1

    run(body())


def test_the_circuit_breaker_opens_on_a_failure_rate_and_closes_after_a_probe() -> None:
    async def body() -> None:
        health = {
            "interval_s": None,
            "breaker_min_requests": 6,
            "breaker_failure_rate": 0.5,
            "breaker_open_s": 0.2,
            "failures_to_probe": 1000,
        }
        async with rig(engines=2, health=health) as r:
            home = await _warm(r, SYSTEM + " breaker")
            worker = _worker(r, home)
            r.engines[home].mode = "error500"
            for i in range(60):  # cold prompts: about half are picked for the failing engine
                assert (await r.complete(f"{i} breaker")).status == 200
                if r.gateway.health.state(worker) == "open":
                    break
            assert r.gateway.health.state(worker) == "open"
            assert r.metric("llmsched_gateway_breaker_opens_total", endpoint=worker) == 1
            assert r.gateway.routable_endpoints() == [_worker(r, 1 - home)]
            r.engines[home].mode = "ok"  # the half-open probe finds it well again
            await until(lambda: r.gateway.health.state(worker) == "up")
            assert r.metric("llmsched_gateway_ejections_total", endpoint=worker) == 0

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_answers_cut_after_their_head_open_the_circuit_breaker(stream: bool) -> None:
    """An engine that sends its answers' heads and then cuts them (a JSON answer short of its
    length, a stream after its first event) fails every request it gets. The native plane
    counted each as a success once the head came, so its breaker never opened; the Python
    plane counts the cut."""

    async def body() -> None:
        health = {
            "interval_s": None,
            "breaker_min_requests": 6,
            "breaker_failure_rate": 0.5,
            "breaker_open_s": 30,
            "failures_to_probe": 1000,
        }
        async with rig(engines=2, health=health, retries={"max_attempts": 1}) as r:
            home = await _warm(r, SYSTEM + " cut")
            worker = _worker(r, home)
            r.engines[home].mode = "cut"
            for i in range(60):  # cold prompts: about half are picked for the cutting engine
                await raw_request(
                    r,
                    json.dumps({"model": MODEL, "prompt": f"{i} cut", "stream": stream}).encode(),
                )
                if r.gateway.health.state(worker) == "open":
                    break
            await until(lambda: r.gateway.health.state(worker) == "open")
            assert r.metric("llmsched_gateway_breaker_opens_total", endpoint=worker) == 1
            assert r.gateway.routable_endpoints() == [_worker(r, 1 - home)]

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_answers_cut_after_their_head_add_up_to_confirming_probes(stream: bool) -> None:
    """Probe 74: an engine that sends its answers' heads and then cuts them fails every
    request. The native plane counted each head as a success, which ended the run of failed
    attempts, so ``failures_to_probe`` cuts in a row never asked for probes (the Python plane
    counts a success at the answer's end). Now a cut adds to the run on both planes."""

    async def body() -> None:
        # No breaker, no active checks: only the run of failures asks for probes.
        health = {"interval_s": None, "failures_to_probe": 3, "breaker_failure_rate": None}
        async with rig(engines=1, health=health) as r:
            worker = _worker(r, 0)
            r.engines[0].mode = "cut"
            probes = "llmsched_gateway_health_probes_total"
            for i in range(3):
                request = {"model": MODEL, "prompt": f"{i} cut", "stream": stream}
                await raw_request(r, json.dumps(request).encode())
            await until(lambda: r.metric(probes, endpoint=worker, result="ok") > 0)
            # The engine answers its probe: it stays in routing.
            assert r.gateway.health.state(worker) == "up"
            assert r.metric("llmsched_gateway_ejections_total", endpoint=worker) == 0

    run(body())


@pytest.mark.parametrize("mode", ["error500", "drop"])
def test_requests_failing_on_every_engine_open_no_breaker(mode: str) -> None:
    """Probe 44's finding 14: inputs every engine answers with a 5xx (or drops), each retried
    on every engine, opened every breaker and shut every client out. Now each such request
    is poisoned: counted against no engine, and the engines are probed instead."""

    async def body() -> None:
        health = {"interval_s": None, "breaker_min_requests": 4, "breaker_open_s": 30}
        async with rig(engines=2, health=health, retries={"max_attempts": 2}) as r:
            for i in range(12):
                response = await r.complete(f"{i} poisoned", x_fake_mode=mode)
                assert response.status == 502
            assert r.metric("llmsched_gateway_poisoned_requests_total") == 12
            workers = [_worker(r, index) for index in range(2)]
            for worker in workers:
                assert r.metric("llmsched_gateway_breaker_opens_total", endpoint=worker) == 0
                assert r.gateway.health.state(worker) == "up"
            # The engines were asked to prove themselves, and did.
            await until(
                lambda: all(
                    r.metric("llmsched_gateway_health_probes_total", endpoint=w, result="ok") > 0
                    for w in workers
                )
            )
            assert (await r.complete("a good request")).status == 200

    run(body())


def test_the_breaker_never_opens_on_the_last_engine_in_routing() -> None:
    """Probe 45: with one engine, inputs it answers with a 5xx opened its breaker, and every
    client got 503s for breaker_open_s. The last engine up stays in routing; probes, asked
    instead, decide whether it is well."""

    async def body() -> None:
        health = {"interval_s": None, "breaker_min_requests": 4, "breaker_open_s": 30}
        async with rig(engines=1, health=health) as r:
            worker = _worker(r, 0)
            for i in range(12):
                response = await r.complete(f"{i} alone", x_fake_mode="error500")
                assert response.status == 502
            assert r.metric("llmsched_gateway_breaker_opens_total", endpoint=worker) == 0
            assert r.gateway.health.state(worker) == "up"
            await until(
                lambda: (
                    r.metric("llmsched_gateway_health_probes_total", endpoint=worker, result="ok")
                    > 0
                )
            )
            assert (await r.complete("a good request")).status == 200
            # A dead engine still goes down by its probes.
            r.engines[0].health_status = 503
            for i in range(4):
                await r.complete(f"{i} alone again", x_fake_mode="error500")
            await until(lambda: r.gateway.health.state(worker) == "down")

    run(body())


def test_a_retry_does_not_move_the_round_robin_cursor() -> None:
    """A retry goes to the decision's next fallback without a new pick: with round-robin, an
    engine answering 5xx gets the first attempt of every other request, as its healthy peer
    does. The Python plane picked again for each retry, which moved the cursor once more, so
    the failing engine got almost every first attempt (5 of 6)."""

    async def body() -> None:
        health = {
            "interval_s": None,
            "breaker_min_requests": 1000,
            "failures_to_probe": 1000,
        }
        async with rig(engines=2, router="round-robin", health=health) as r:
            r.engines[0].mode = "error500"
            for i in range(6):
                assert (await r.complete(f"{i} round and round")).status == 200
            # The healthy engine answered all six; the failing one saw only first attempts.
            assert len(r.engines[1].received) == 6
            assert len(r.engines[0].received) == 3
            assert r.metric("llmsched_gateway_retries_total") == 3

    run(body())


def test_a_request_failing_on_one_engine_counts_against_it() -> None:
    """With one attempt a request's 5xx cannot be told from the engine's: it counts, and
    enough of them open the breaker, as before."""

    async def body() -> None:
        health = {"interval_s": None, "breaker_min_requests": 4, "breaker_open_s": 30}
        async with rig(engines=2, health=health, retries={"max_attempts": 1}) as r:
            for i in range(12):
                await r.complete(f"{i} one attempt", x_fake_mode="error500")
            assert r.metric("llmsched_gateway_poisoned_requests_total") == 0
            opened = [
                r.metric("llmsched_gateway_breaker_opens_total", endpoint=_worker(r, i))
                for i in range(2)
            ]
            assert sum(opened) >= 1

    run(body())


def test_a_request_answered_after_a_5xx_counts_the_5xx_against_its_engine() -> None:
    """A 5xx where another engine then answered says the first engine is at fault: held
    until the request ends, then counted (the breaker opens as before)."""

    async def body() -> None:
        health = {
            "interval_s": None,
            "breaker_min_requests": 4,
            "breaker_open_s": 30,
            "failures_to_probe": 1000,
        }
        async with rig(engines=2, health=health) as r:
            r.engines[0].mode = "error500"
            worker = _worker(r, 0)
            for i in range(40):
                assert (await r.complete(f"{i} answered elsewhere")).status == 200
                if r.gateway.health.state(worker) == "open":
                    break
            assert r.gateway.health.state(worker) == "open"
            assert r.metric("llmsched_gateway_poisoned_requests_total") == 0

    run(body())


def test_a_5xx_counts_once_another_engine_answers_not_when_its_stream_ends() -> None:
    """The failure held while the request was retried counts when the next engine answers:
    an engine answering 5xx is taken out while the stream it was retried to still runs."""

    async def body() -> None:
        health = {"interval_s": None, "breaker_min_requests": 1, "breaker_open_s": 30}
        async with rig(engines=2, health=health) as r:
            home = await _warm(r, SYSTEM + " held")
            worker = _worker(r, home)
            r.engines[home].mode = "error500"
            other = r.engines[1 - home]
            other.mode, other.answer_tokens, other.token_delay_s = "slow", 40, 0.05
            streaming = asyncio.ensure_future(r.complete(SYSTEM + " held on", stream=True))
            await until(lambda: other.running == 1)
            await until(lambda: r.gateway.health.state(worker) == "open")
            assert not streaming.done()  # the stream still runs
            assert (await streaming).status == 200

    run(body())


def test_ready_is_503_with_every_engine_down_even_without_scraping() -> None:
    async def body() -> None:
        async with rig(engines=2, health=FAST_HEALTH, retries={"eject_s": 60}) as r:
            async with r.client.get(r.url("/ready")) as response:
                assert response.status == 200
            for engine in r.engines:
                await engine.stop()
            await until(lambda: not r.gateway.routable_endpoints())
            async with r.client.get(r.url("/ready")) as response:
                assert response.status == 503
                assert await response.json() == {"ready": False, "endpoints": 0}

    run(body())


# -- nothing can serve ---------------------------------------------------------------------


def test_with_every_engine_down_flow_control_answers_503_at_once() -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 1}}
        async with rig(engines=1, flow=flow, health=FAST_HEALTH, retries={"eject_s": 60}) as r:
            engine = r.engines[0]
            engine.mode = "hang"  # holds the only slot: one event, then silence
            busy = asyncio.ensure_future(r.complete("busy", stream=True))
            await until(lambda: engine.running == 1)
            queued = asyncio.ensure_future(r.complete("queued"))
            await until(lambda: r.gateway.flow is not None and len(r.gateway.flow) == 1)
            engine.health_status = 503  # the engine's probes fail: it goes down
            response = await asyncio.wait_for(queued, timeout=10)  # the band TTL is 60 s
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert response.headers["x-llmsched-dropped-reason"] == "no-endpoints"
            # New requests are refused before admission, at once.
            response = await r.complete("later")
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            busy.cancel()  # the client of the hung stream leaves
            with contextlib.suppress(asyncio.CancelledError):
                await busy
            await until(lambda: r.gateway.flow is not None and r.gateway.flow.running_count() == 0)
            assert r.gateway.flow is not None and len(r.gateway.flow) == 0

    run(body())
