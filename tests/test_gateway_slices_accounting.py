"""Token slices through the gateway, on both data planes: what a client leaving a sliced
answer is charged, and ``min_tokens`` with ``stop`` (probe 61 found both wrong).

- A client leaving a sliced stream mid-answer: the native plane aborted the slices' task and
  dropped the request's flow-control slot and API-key guard without charging them the tokens
  generated (the Python plane charged them): the tenant's fair share and the key's token
  bucket saw none of the answer's output.
- ``min_tokens`` with ``stop``: the slice assembler ended the answer at a stop string within
  the first ``min_tokens`` tokens, where vLLM does not check stop strings yet; a
  ``min_tokens`` the engine would refuse was changed or hidden by the continuations.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from _gateway_harness import MODEL, Rig, plane, rig, run, until  # noqa: F401 (the fixture)

from llmsched.gateway import NativeGateway

pytestmark = pytest.mark.usefixtures("plane")

SLICES = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 4}}
ONE_SLOT = {"saturation": {"type": "concurrency", "max_requests": 1}}


def _in_flight(r: Rig) -> int:
    gateway = r.gateway
    endpoints = (
        gateway.endpoints() if isinstance(gateway, NativeGateway) else gateway.pool.endpoints()
    )
    return sum(int(e["in_flight_requests"]) for e in endpoints)


async def _leave_at_call(r: Rig, response: aiohttp.ClientResponse, calls: int) -> None:
    """Reads ``response`` until the engine got its ``calls``-th call, then leaves (closes the
    connection)."""

    async def read() -> None:
        while await response.content.readany():
            pass

    reader = asyncio.ensure_future(read())
    await until(lambda: len(r.engines[0].received) >= calls)
    reader.cancel()
    response.close()


async def _third_slice_in_mode(r: Rig, mode: str) -> None:
    """Slices 1 and 2 run as the engine's mode says; the third call runs in ``mode``
    (``"hang"``: one token, then nothing; ``"stall"``: nothing)."""
    engine = r.engines[0]
    await until(lambda: len(engine.received) >= 2)
    engine.mode = mode


def _service(r: Rig, tenant: str) -> int:
    assert r.gateway.flow is not None
    flows = r.gateway.flow.metrics()["flows"]
    return sum(int(f["service_tokens"]) for f in flows if f["tenant"] == tenant)


def test_a_client_leaving_a_sliced_stream_is_charged_and_counted_once() -> None:
    """Two slices of 4 tokens ended when the client leaves in the third: flow control charges
    the tenant its 3 prompt tokens and the 8 output tokens, the slot and the engine's
    in-flight count go back, the request counts as client_gone once."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=ONE_SLOT) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.2
            request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}
            tenant = {"x-llmsched-tenant": "leaver"}
            url = r.url("/v1/completions")
            # The third call answers nothing: the client leaves a slice that produced none.
            third = asyncio.ensure_future(_third_slice_in_mode(r, "stall"))
            response = await r.client.post(url, json=request, headers=tenant)
            assert response.status == 200
            # Left at the third slice's call: two slices (8 tokens) have ended.
            await _leave_at_call(r, response, 3)
            await third
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            flow, tracker = r.gateway.flow, r.gateway.slice_tracker
            assert flow is not None and tracker is not None
            await until(lambda: flow.running_count() == 0 and not len(tracker))
            assert _service(r, "leaver") == 3 + 8
            await until(lambda: _in_flight(r) == 0)
            gone = {"route": "completions", "status": "client_gone"}
            await until(lambda: r.metric("llmsched_gateway_requests_total", **gone) == 1)
            assert len(engine.received) == 3  # no slice after the client left
            # The slot is free: the next request is served at once.
            engine.mode = "normal"
            assert (await r.complete([4, 5, 6], max_tokens=2)).status == 200
            assert r.metric("llmsched_gateway_requests_total", **gone) == 1

    run(body())


def test_a_key_is_charged_the_output_of_a_sliced_stream_its_client_left() -> None:
    """A 12-token bucket: 3 prompt tokens, then 8 output tokens of the two slices ended before
    the client left leave 1, short of the next 3-token prompt (uncharged, 9 would be left;
    the probe would be served)."""

    async def body() -> None:
        key = "sk-leaver-0000001"
        limits = {"tenant": "a", "tokens_per_s": 0.001, "burst_tokens": 12, "max_concurrent": 1}
        auth = {"api_keys": {key: limits}}
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=ONE_SLOT, auth=auth) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.2
            request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}
            as_key = {"Authorization": f"Bearer {key}"}
            response = await r.client.post(r.url("/v1/completions"), json=request, headers=as_key)
            assert response.status == 200
            await _leave_at_call(r, response, 3)
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            # Refused for concurrency while the left request still holds the key; then for
            # its tokens (its output charged before its concurrency goes back).
            while True:
                again = await r.complete([4, 5, 6], max_tokens=1, headers=as_key)
                assert again.status == 429
                reason = again.headers["x-llmsched-dropped-reason"]
                if reason != "concurrency-limited":
                    break
                await asyncio.sleep(0.02)
            assert reason == "rate-limited"

    run(body())


def _min_tokens_request(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [1, 2, 3],
        "max_tokens": 16,
        "min_tokens": 6,
        "stop": ["t1"],
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_sliced_answer_does_not_stop_within_min_tokens(stream: bool) -> None:
    """The fake's output reads " t0 t1 t2 ...": "t1" in the second token is within the first
    6 (vLLM checks stop strings only after min_tokens), "t1" of " t10" ends the answer."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            url = r.url("/v1/completions")
            async with r.client.post(url, json=_min_tokens_request(stream)) as response:
                assert response.status == 200
                raw = await response.read()
            if stream:
                events = [e for e in raw.decode().split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
                choices = [c["choices"][0] for c in chunks if c["choices"]]
                text = "".join(c["text"] for c in choices)
                finish = choices[-1]["finish_reason"]
            else:
                choice = json.loads(raw)["choices"][0]
                text, finish = choice["text"], choice["finish_reason"]
            assert text == "".join(f" t{i}" for i in range(10)) + " "
            assert finish == "stop"
            bodies = [q.body for q in r.engines[0].received]
            # The second slice's call is cut short where min_tokens is reached; the rest of
            # that slice follows (the tracker's slices stay 4 tokens).
            assert [b["max_tokens"] for b in bodies] == [4, 2, 2, 4]
            assert [b["min_tokens"] for b in bodies] == [4, 2, 0, 0]

    run(body())


def test_a_min_tokens_the_engine_would_refuse_goes_unsliced() -> None:
    """A negative ``min_tokens`` was hidden from the engine (every slice got 0); one above
    ``max_tokens`` never reached it either. Unsliced, the engine judges the request itself."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES) as r:
            for min_tokens in (-1, 17):
                response = await r.complete([1, 2, 3], max_tokens=16, min_tokens=min_tokens)
                assert response.status == 200  # the fake engine accepts anything
                received = r.engines[0].received[-1].body
                assert received["min_tokens"] == min_tokens and received["max_tokens"] == 16
            assert len(r.engines[0].received) == 2

    run(body())


async def _leave_after_chunks(r: Rig, response: aiohttp.ClientResponse, chunks: int) -> None:
    """Reads ``response`` until ``chunks`` answer chunks came, then leaves."""
    got = 0
    while got < chunks:
        line = await response.content.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            got += 1
    response.close()


def test_a_client_leaving_mid_slice_is_charged_the_tokens_of_that_slice() -> None:
    """Probe 66: the client leaves after the 9th token, the first of the third slice: flow
    control charges its 3 prompt tokens and all 9 (before: 3 + 8, the slices that ended;
    the unsliced path charges every token streamed)."""

    async def body() -> None:
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=ONE_SLOT) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.05
            request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}
            tenant = {"x-llmsched-tenant": "leaver"}
            hang = asyncio.ensure_future(_third_slice_in_mode(r, "hang"))
            response = await r.client.post(r.url("/v1/completions"), json=request, headers=tenant)
            assert response.status == 200
            await _leave_after_chunks(r, response, 9)
            await hang
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            flow, tracker = r.gateway.flow, r.gateway.slice_tracker
            assert flow is not None and tracker is not None
            await until(lambda: flow.running_count() == 0 and not len(tracker))
            assert len(engine.received) == 3
            assert _service(r, "leaver") == 3 + 9

    run(body())


def test_a_key_is_charged_the_tokens_of_the_slice_its_client_left() -> None:
    """A 14-token bucket: 3 prompt tokens and the 9 output tokens sent leave 2, short of the
    next 3-token prompt (charged only the 8 of the ended slices, 3 were left: served)."""

    async def body() -> None:
        key = "sk-leaver-0000002"
        limits = {"tenant": "a", "tokens_per_s": 0.001, "burst_tokens": 14, "max_concurrent": 1}
        auth = {"api_keys": {key: limits}}
        async with rig(engines=1, answer_tokens=100, slices=SLICES, flow=ONE_SLOT, auth=auth) as r:
            engine = r.engines[0]
            engine.mode = "slow"
            engine.token_delay_s = 0.05
            request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}
            as_key = {"Authorization": f"Bearer {key}"}
            hang = asyncio.ensure_future(_third_slice_in_mode(r, "hang"))
            response = await r.client.post(r.url("/v1/completions"), json=request, headers=as_key)
            assert response.status == 200
            await _leave_after_chunks(r, response, 9)
            await hang
            await asyncio.wait_for(engine.disconnected.wait(), 5)
            engine.mode = "ok"
            while True:
                again = await r.complete([4, 5, 6], max_tokens=1, headers=as_key)
                assert again.status == 429
                reason = again.headers["x-llmsched-dropped-reason"]
                if reason != "concurrency-limited":
                    break
                await asyncio.sleep(0.02)
            assert reason == "rate-limited"

    run(body())
