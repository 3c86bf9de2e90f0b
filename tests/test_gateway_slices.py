"""Token slices through the gateway: continuation calls per slice, stitched into one answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    Rig,
    plane,
    read_cut_off,
    rig,
    run,
    until,
)

from llmsched.slices import SliceAssembler
from llmsched.testing.openai_engine import OUTPUT_ID_BASE, FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")

SLICES = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 4}}


def test_a_non_streaming_completion_is_decoded_in_slices_and_stitched() -> None:
    async def body() -> None:
        async with rig(engines=2, answer_tokens=100, slices=SLICES) as r:
            prompt = list(range(1, 40))
            response = await r.complete(prompt, max_tokens=10)
            assert response.status == 200
            answer = json.loads(await response.read())
            assert answer["choices"][0]["text"] == "".join(f" t{i}" for i in range(10))
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 10
            assert answer["usage"]["slice_details"]["slices"] == 3
            calls = sorted((q.received_at, q.body) for e in r.engines for q in e.received)
            bodies = [b for _, b in calls]
            assert [b["max_tokens"] for b in bodies] == [4, 4, 2]
            # Each continuation re-sends the prompt plus the ids generated so far.
            assert bodies[1]["prompt"] == prompt + [OUTPUT_ID_BASE + i for i in range(4)]
            assert bodies[2]["prompt"] == prompt + [OUTPUT_ID_BASE + i for i in range(8)]
            # The router sends every continuation where the conversation's prefix is.
            assert len({id(e) for e in r.engines if e.received}) == 1
            assert r.metric("llmsched_gateway_slices_total") == 3

    run(body())


def test_a_streaming_chat_is_decoded_in_slices_as_one_stream() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            request = {
                "model": MODEL,
                "stream": True,
                "max_tokens": 9,
                "messages": [{"role": "user", "content": "Tell me a story"}],
            }
            async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                raw = await response.read()
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert text == "".join(f" t{i}" for i in range(9))
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert len({c["id"] for c in chunks}) == 1  # one response id across slices
            bodies = [q.body for q in r.engines[0].received]
            assert [b["max_tokens"] for b in bodies] == [4, 4, 1]
            assert bodies[1]["continue_final_message"] is True
            assert bodies[1]["messages"][-1] == {"role": "assistant", "content": " t0 t1 t2 t3"}

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_sliced_request_is_counted_in_requests_total(stream: bool) -> None:
    """Probe 74: the Python plane left sliced answers out of ``requests_total`` (the native
    plane counts them): the same traffic now gives the same metrics."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            for i in range(2):
                response = await r.complete([1, 2, 3, i], max_tokens=10, stream=stream)
                assert response.status == 200
            ok = {"route": "completions", "status": "200"}
            await until(lambda: r.metric("llmsched_gateway_requests_total", **ok) == 2)
            assert r.metric("llmsched_gateway_slices_total") == 6

    run(body())


@pytest.mark.parametrize("line_end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_slices_read_engine_events_with_any_sse_line_end(line_end: bytes, stream: bool) -> None:
    """Probe 74: the slices split the engine's events at LF LF only; an engine (or a proxy
    before it) that ends its lines with CRLF or a lone CR, as the SSE spec allows, broke every
    sliced request. Both planes now read all three."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            r.engines[0].sse_line_end = line_end
            response = await r.complete(list(range(1, 40)), max_tokens=10, stream=stream)
            assert response.status == 200, await response.read()
            data = await response.read()
            if stream:
                events = [e for e in data.decode().split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
                text = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                answer = json.loads(data)
                assert answer["usage"]["completion_tokens"] == 10
                text = answer["choices"][0]["text"]
            assert text == "".join(f" t{i}" for i in range(10))
            bodies = [q.body for q in r.engines[0].received]
            assert [b["max_tokens"] for b in bodies] == [4, 4, 2]
            assert r.metric("llmsched_gateway_slices_total") == 3

    run(body())


def test_requests_that_cannot_be_sliced_are_proxied_whole() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=6, slices=SLICES) as r:
            response = await r.complete("hello", n=2)
            assert response.status == 200
            (received,) = r.engines[0].received
            assert received.body["n"] == 2 and "stream_options" not in received.body

    run(body())


@pytest.mark.usefixtures("plane")
def test_requests_whose_output_slicing_would_change_are_proxied_whole() -> None:
    """Truncation (a continuation would cut the kept prompt away), structured output and
    tool calling (their grammar and parser start again on each slice) go unsliced."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=6, slices=SLICES) as r:
            for fields in [
                {"truncate_prompt_tokens": 2},
                {"response_format": {"type": "json_object"}},
                {"guided_choice": ["a", "b"]},
            ]:
                response = await r.complete("hello there", max_tokens=6, **fields)
                assert response.status == 200, fields
            chat = {
                "model": MODEL,
                "max_tokens": 6,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            }
            async with r.client.post(r.url("/v1/chat/completions"), json=chat) as response:
                assert response.status == 200
            bodies = [q.body for q in r.engines[0].received]
            assert len(bodies) == 4
            assert all(b["max_tokens"] == 6 for b in bodies), bodies

    run(body())


def test_a_failing_slice_ends_the_request_with_502() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            r.engines[0].mode = "error500"
            response = await r.complete([1, 2, 3], max_tokens=10)
            assert response.status == 502
            assert r.gateway.slice_tracker is not None and len(r.gateway.slice_tracker) == 0

    run(body())


def test_a_slice_boundary_yields_to_a_waiting_higher_priority_request() -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 1}}
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=flow) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.05
            long = asyncio.ensure_future(r.complete([1, 2, 3], max_tokens=12, stream=True))
            while not engine.received:
                await asyncio.sleep(0.005)
            urgent = {"x-llmsched-priority": "5"}
            short = await r.complete([7, 8, 9], max_tokens=2, headers=urgent)
            assert short.status == 200
            assert (await long).status == 200
            order = [
                q.body["prompt"][0] for q in sorted(engine.received, key=lambda q: q.received_at)
            ]
            # The waiting request ran between two slices of the long one (the long one gave
            # its flow-control slot back at a boundary instead of holding it to the end).
            assert order[0] == 1 and 7 in order and order.index(7) < len(order) - 1, order

    run(body())


@pytest.mark.parametrize("out", ["removed", "drained"])
def test_an_engine_out_of_routing_is_no_migration_target(out: str) -> None:
    """Probe 78: an engine that left the set (or routing) kept the idle load it last reported
    in the slice tracker, the cheapest migration target: the boundary "migrated" there instead
    of yielding, kept its flow-control slot, and the waiting request ran only after the whole
    long one (the yield above, with a second engine that is gone)."""

    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 1}}
        token = "admin-token-0123456789"
        admin = {"token": token}
        async with rig(engines=2, answer_tokens=100, slices=SLICES, flow=flow, admin=admin) as r:
            first, second = r.gateway.config.engines
            if out == "removed":
                await r.gateway.set_engines([first])
            else:
                drain = r.url(f"/admin/engines/{second.worker_id}/drain")
                auth = {"Authorization": f"Bearer {token}"}
                async with r.client.post(drain, headers=auth) as response:
                    assert response.status == 200
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.05
            long = asyncio.ensure_future(r.complete([1, 2, 3], max_tokens=12, stream=True))
            while not engine.received:
                await asyncio.sleep(0.005)
            urgent = {"x-llmsched-priority": "5"}
            short = await r.complete([7, 8, 9], max_tokens=2, headers=urgent)
            assert short.status == 200
            assert (await long).status == 200
            order = [
                q.body["prompt"][0] for q in sorted(engine.received, key=lambda q: q.received_at)
            ]
            assert not r.engines[1].received
            assert order[0] == 1 and 7 in order and order.index(7) < len(order) - 1, order

    run(body())


def test_a_key_is_charged_every_output_token_of_a_sliced_request_that_yielded() -> None:
    """Flow control is charged at each yield; the key's token bucket once, with every output
    token: 3 prompt + 12 output of a 17-token bucket leave 2, short of the next 3-token
    prompt (charging only the tokens after the yield would leave enough)."""

    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 1}}
        long_key, urgent_key = "sk-long-000000001", "sk-urgent-0000001"
        keys = {
            long_key: {"tenant": "a", "tokens_per_s": 0.001, "burst_tokens": 17},
            urgent_key: {"tenant": "b", "priority": 5},
        }
        auth = {"api_keys": keys}
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=flow, auth=auth) as r:
            engine, _ = _slow(r, token_delay_s=0.05)
            as_long = {"Authorization": f"Bearer {long_key}"}
            long = asyncio.ensure_future(
                r.complete([1, 2, 3], max_tokens=12, stream=True, headers=as_long)
            )
            while not engine.received:
                await asyncio.sleep(0.005)
            as_urgent = {"Authorization": f"Bearer {urgent_key}"}
            assert (await r.complete([7, 8, 9], max_tokens=2, headers=as_urgent)).status == 200
            assert (await long).status == 200
            order = [q.body["prompt"][0] for q in engine.received]
            assert order.index(7) < len(order) - 1, order  # it yielded
            again = await r.complete([4, 5, 6], max_tokens=1, headers=as_long)
            assert again.status == 429
            assert again.headers["x-llmsched-dropped-reason"] == "rate-limited"

    run(body())


def test_a_slice_failing_after_the_stream_started_ends_it_without_done() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            engine, request = _slow(r, token_delay_s=0.01)
            data = b""
            async with r.client.post(r.url("/v1/completions"), json=request) as response:
                assert response.status == 200
                while not engine.received:
                    await asyncio.sleep(0.005)
                engine.mode = "error500"  # the first slice runs on; the second fails
                try:
                    async for piece in response.content.iter_any():
                        data += piece
                except aiohttp.ClientPayloadError:
                    pass  # the stream is closed without its last chunk
            text = data.decode()
            assert '"text": " t0"' in text.replace('":"', '": "')
            assert "upstream_error" in text and "[DONE]" not in text
            assert len(engine.received) == 2
            assert r.gateway.slice_tracker is not None and len(r.gateway.slice_tracker) == 0
            assert r.metric("llmsched_gateway_truncated_answers_total", **_sse_error(r)) == 1
            # Counted as aborted on both planes (probe 74: the Python plane counted nothing).
            aborted = {"route": "completions", "status": "aborted"}
            await until(lambda: r.metric("llmsched_gateway_requests_total", **aborted) == 1)

    run(body())


def test_a_client_leaving_mid_slice_cancels_the_engine_call() -> None:
    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            engine, request = _slow(r, token_delay_s=0.1)
            async with r.client.post(r.url("/v1/completions"), json=request) as response:
                assert await response.content.readany()
            # Left with the answer unread: the connection is closed.
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            assert r.gateway.slice_tracker is not None
            while len(r.gateway.slice_tracker):
                await asyncio.sleep(0.01)
            assert len(engine.received) < 3

    run(body())


@pytest.mark.parametrize("stop", [None, ["zz"]], ids=["no_stop", "stop"])
def test_a_sliced_stream_sends_each_chunk_before_its_slice_ends(stop: list[str] | None) -> None:
    """The first slice's engine call sends its first token and then goes silent (mode
    ``"hang"``): the client gets that token's text while the call is still open (the Python
    plane wrote a slice's chunks only once its call ended: none would come). With stop
    strings the assembler holds back only the text's last (longest stop - 1) characters, one
    for ``"zz"``. Then the client leaves: the call is dropped, no further slice is called, the
    request counts as client_gone once."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            engine = r.engines[0]
            engine.mode = "hang"
            request: dict[str, Any] = {
                "model": MODEL,
                "prompt": [1, 2, 3],
                "max_tokens": 12,
                "stream": True,
            }
            if stop is not None:
                request["stop"] = stop
            response = await r.client.post(r.url("/v1/completions"), json=request)
            assert response.status == 200
            data = b""
            while b"\n\n" not in data:
                piece = await asyncio.wait_for(response.content.readany(), 10)
                assert piece, data  # the stream must not end
                data += piece
            event = data.decode().split("\n\n")[0]
            chunk = json.loads(event.removeprefix("data: "))
            assert chunk["choices"][0]["text"] == (" t0" if stop is None else " t")
            assert chunk["choices"][0]["finish_reason"] is None
            # The first slice's call is still in flight: its engine sent one event of four
            # and holds the connection open.
            assert len(engine.received) == 1 and not engine.disconnected.is_set()
            assert b"[DONE]" not in engine.sent[0]
            response.close()
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            tracker = r.gateway.slice_tracker
            assert tracker is not None
            await until(lambda: len(tracker) == 0)
            gone = {"route": "completions", "status": "client_gone"}
            await until(lambda: r.metric("llmsched_gateway_requests_total", **gone) == 1)
            assert len(engine.received) == 1

    run(body())


def _slow(r: Rig, *, token_delay_s: float) -> tuple[FakeOpenAIEngine, dict[str, Any]]:
    """The rig's engine streaming a token every ``token_delay_s``, and a streamed request of
    three slices."""
    engine = r.engines[0]
    engine.mode = "slow"
    engine.token_delay_s = token_delay_s
    return engine, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 12, "stream": True}


def _sse_error(r: Rig) -> dict[str, str]:
    return {"endpoint": r.gateway.config.engines[0].worker_id, "outcome": "sse_error"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_engines_refusal_of_the_first_slice_is_the_clients_answer(stream: bool) -> None:
    # A request the engine refuses (a prompt past its context, a field it does not take) is
    # the client's mistake: unsliced, the client gets the engine's 4xx; sliced, it got the
    # gateway's 502 "a slice failed: engine answered 400", without the engine's reason.
    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            r.engines[0].mode = "error400"
            request = {"model": MODEL, "prompt": "hi", "max_tokens": 9, "stream": stream}
            async with r.client.post(r.url("/v1/completions"), json=request) as response:
                assert response.status == 400, await response.text()
                assert response.headers["Content-Type"].startswith("application/json")
                error = (await response.json())["error"]
            assert error["type"] == "BadRequestError", error
            assert len(r.engines[0].received) == 1
            assert r.metric("llmsched_gateway_requests_total", route="completions", status="400")

    run(body())


def _assembler_seeds(request: dict[str, Any], slice_tokens: int) -> list[object]:
    """The seeds :class:`SliceAssembler` sends with each slice of ``request`` when the engine
    answers as the fake does (output token ``k`` has id ``OUTPUT_ID_BASE + k``)."""
    asm = SliceAssembler(request)
    seeds, done = [], 0
    while not asm.done:
        call = asm.next_request(slice_tokens)
        seeds.append(call.get("seed"))
        n = call["max_tokens"]
        ids = [OUTPUT_ID_BASE + done + i for i in range(n)]
        text = "".join(f" t{done + i}" for i in range(n))
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "length"}
        asm.feed({"id": "e", "created": 1, "choices": [choice]})
        asm.feed({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
        asm.end_slice()
        done += n
    return seeds


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_seeded_sampled_request_sends_each_continuation_a_seed_of_its_own(stream: bool) -> None:
    """Probe 77's fix through the gateways (it was checked on the assembler alone): the first
    slice carries the client's seed, each continuation one derived from it and the tokens
    generated so far (the user's seed on every slice replayed the first slice's draws)."""
    request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 10}
    request |= {"temperature": 1.0, "seed": 1234}

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            for _ in range(2):
                response = await r.complete(
                    request["prompt"], **{k: v for k, v in request.items() if k != "prompt"},
                    stream=stream,
                )  # fmt: skip
                assert response.status == 200, await response.read()
            bodies = [q.body for q in sorted(r.engines[0].received, key=lambda q: q.received_at)]
            assert [b["max_tokens"] for b in bodies] == [4, 4, 2] * 2
            seeds = [b.get("seed") for b in bodies]
            assert seeds[:3] == seeds[3:]  # reproducible for the same slicing
            assert seeds[0] == 1234  # the first slice is the unsliced request's own start
            assert len(set(seeds[:3])) == 3
            assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)  # vLLM's range
            assert seeds[:3] == _assembler_seeds(request, 4)

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_an_answer_a_stop_token_ended_gives_its_id_as_stop_reason(api: str, stream: bool) -> None:
    """Probe 77's fix through the gateways: the sliced answer said ``stop_reason`` null where
    vLLM's unsliced answer gives the stop token id (an int), in the last streamed chunk and in
    the whole answer."""
    stop_id = OUTPUT_ID_BASE + 6  # the 7th output token, in the second slice of 4
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "stop_token_ids": [stop_id]}
    request["stream"] = stream
    if api == "chat":
        request["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        request["prompt"] = list(range(1, 40))
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"

    async def answer(sliced: bool) -> tuple[str, object, object]:
        overrides: dict[str, Any] = {"slices": SLICES} if sliced else {}
        async with rig(engines=1, answer_tokens=100, **overrides) as r:
            async with r.client.post(r.url(path), json=request) as response:
                assert response.status == 200
                raw = await response.read()
            bodies = [q.body for q in r.engines[0].received]
            assert [b["max_tokens"] for b in bodies] == ([4, 4] if sliced else [10])
        if stream:
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            choices = [json.loads(e.removeprefix("data: "))["choices"] for e in events[:-1]]
            choices = [c[0] for c in choices if c]
            key = "delta" if api == "chat" else None
            text = "".join((c[key].get("content") or "") if key else c["text"] for c in choices)
            (last,) = [c for c in choices if c.get("finish_reason")]
        else:
            last = json.loads(raw)["choices"][0]
            text = last["message"]["content"] if api == "chat" else last["text"]
        return text, last["finish_reason"], last.get("stop_reason")

    async def body() -> None:
        want = ("".join(f" t{i}" for i in range(6)), "stop", stop_id)
        assert await answer(sliced=False) == want  # the engine's own, relayed whole
        assert await answer(sliced=True) == want

    run(body())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("failing", [0, 1], ids=["first-slice", "continuation"])
def test_a_python_plugin_failing_a_slices_decision_is_a_routing_failure(
    failing: int, stream: bool
) -> None:
    """Probe 100: a router plugin that failed a slice's decision ended the request as a failed
    slice, a 502 ``upstream_error`` counted in ``upstream_errors{kind="slice"}`` against an
    engine that did nothing wrong. Now it is what an unsliced request gets: a 500
    ``internal_error`` "routing failed: ..." with ``x-llmsched-dropped-reason:
    routing_failed``, counted in ``rejections_total{reason="routing_failed"}``; once the
    stream started, its error event says so and the stream is cut (no ``[DONE]``), counted as
    the routing failure and the cut, not as an engine's error."""
    decisions: list[int] = []

    def scorer(request: dict[str, object], endpoints: list[dict[str, object]]) -> list[float]:
        decisions.append(len(decisions))
        if len(decisions) == failing + 1:
            raise ValueError("my plugin is broken")
        return [0.5] * len(endpoints)

    router = {
        "plugins": [{"type": "python-scorer", "name": "mine", "parameters": {"function": scorer}}],
        "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "mine"}]}],
    }

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES, router=router) as r:
            request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 10, "stream": stream}
            async with r.client.post(r.url("/v1/completions"), json=request) as response:
                if stream and failing > 0:
                    assert response.status == 200
                    text = (await read_cut_off(response)).decode()
                    assert '"text": " t0"' in text.replace('":"', '": "')
                    assert "[DONE]" not in text
                    event = json.loads(
                        text.rstrip("\n").rsplit("\n\n", 1)[-1].removeprefix("data: ")
                    )
                    error = event["error"]
                else:
                    assert response.status == 500, await response.text()
                    assert response.headers["x-llmsched-dropped-reason"] == "routing_failed"
                    error = json.loads(await response.read())["error"]
            assert error["type"] == "internal_error" and error["code"] == 500
            assert error["message"].startswith("routing failed: ")
            assert "ValueError: my plugin is broken" in error["message"]
            assert len(r.engines[0].received) == failing
            assert r.gateway.slice_tracker is not None and len(r.gateway.slice_tracker) == 0
            assert r.metric("llmsched_gateway_rejections_total", reason="routing_failed") == 1
            worker = r.gateway.config.engines[0].worker_id
            slice_error = {"endpoint": worker, "kind": "slice"}
            assert r.metric("llmsched_gateway_upstream_errors_total", **slice_error) == 0
            cut = 1 if stream and failing > 0 else 0
            assert r.metric("llmsched_gateway_truncated_answers_total", **_sse_error(r)) == cut
            # Nothing stays taken: the next request is served.
            assert (await r.complete([4, 5, 6], max_tokens=4)).status == 200

    run(body())
