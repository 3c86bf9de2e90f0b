"""The fake engine's Responses API (``llmsched.testing.openai_engine``) where it follows vLLM
0.32's ``serving.py`` beyond the shapes: a stream is stored as it completes (a stream broken
off before then is never stored), ``GET /v1/responses/{id}?stream=true`` replays a background
stream's events after ``starting_after`` and fails after the head for any other response, and
an ``instructions`` that is not a string is a 400. Orderings, not timings: a stream is held
by mode ``"hang"`` (silent after its first event) where a test looks at it half-way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from llmsched.testing.openai_engine import FakeOpenAIEngine

LIMIT_S = 30.0


def run(test: Callable[[FakeOpenAIEngine, aiohttp.ClientSession], Awaitable[None]]) -> None:
    """Runs ``test`` against a started fake engine, failing it if it hangs."""

    async def main() -> None:
        async with (
            FakeOpenAIEngine(model="m", answer_tokens=3) as engine,
            aiohttp.ClientSession() as session,
        ):
            await test(engine, session)

    asyncio.run(asyncio.wait_for(main(), LIMIT_S))


def events(text: str) -> list[dict[str, Any]]:
    """The data of each named event of a Responses stream."""
    return [json.loads(part.split("data: ", 1)[1]) for part in text.split("\n\n") if part]


async def first_event(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """Reads a stream up to the end of its first event."""
    text = b""
    while b"\n\n" not in text:
        text += await response.content.readany()
    return events(text.decode().split("\n\n")[0] + "\n\n")[0]


def test_a_stream_is_stored_as_it_completes_and_never_when_broken_off_before() -> None:
    async def test(engine: FakeOpenAIEngine, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "input": "hi", "stream": True, "x_fake_mode": "hang"}
        async with s.post(engine.url + "/v1/responses", json=body) as held:
            ident = (await first_event(held))["response"]["id"]
            # The stream is silent after its first event: not generated yet, not stored.
            async with s.get(f"{engine.url}/v1/responses/{ident}") as got:
                assert got.status == 404, await got.text()
        body["x_fake_mode"] = "cut"
        async with s.post(engine.url + "/v1/responses", json=body) as cut:
            ident = (await first_event(cut))["response"]["id"]
            with pytest.raises(aiohttp.ClientPayloadError):
                await cut.read()
        assert ident not in engine.responses
        del body["x_fake_mode"]
        async with s.post(engine.url + "/v1/responses", json=body) as whole:
            answer = events((await whole.read()).decode())
        ident = answer[0]["response"]["id"]
        async with s.get(f"{engine.url}/v1/responses/{ident}") as got:
            assert got.status == 200
            assert await got.json() == answer[-1]["response"]
        assert answer[-1]["response"]["status"] == "completed"

    run(test)


def test_a_background_stream_is_replayed_after_starting_after() -> None:
    async def test(engine: FakeOpenAIEngine, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "input": "hi", "stream": True, "background": True}
        body["x_fake_mode"] = "hang"  # its reader hears one event; its generation goes on
        async with s.post(engine.url + "/v1/responses", json=body) as held:
            created = await first_event(held)
            ident = created["response"]["id"]
            url = f"{engine.url}/v1/responses/{ident}?stream=true&starting_after=2"
            async with s.get(url) as replay:
                assert replay.status == 200
                assert replay.content_type == "text/event-stream"
                rest = events((await replay.read()).decode())
        assert [e["sequence_number"] for e in rest] == list(range(3, 3 + len(rest)))
        assert [e["type"] for e in rest] == [
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.completed",
        ]
        async with s.get(f"{engine.url}/v1/responses/{ident}?stream=true") as whole:
            assert events((await whole.read()).decode())[0] == created
        async with s.get(f"{engine.url}/v1/responses/{ident}") as got:
            assert (await got.json())["status"] == "completed"
        async with s.get(f"{engine.url}/v1/responses/{ident}?stream=maybe") as bad:
            assert bad.status == 400

    run(test)


def test_a_stream_of_a_response_not_streamed_in_the_background_fails_after_its_head() -> None:
    """vLLM keeps the events of background streams only: the GET sends a stream's head, then
    its generator raises and the connection closes."""

    async def test(engine: FakeOpenAIEngine, s: aiohttp.ClientSession) -> None:
        for fields in ({}, {"stream": True}, {"background": True}):
            body = {"model": "m", "input": "hi", **fields}
            async with s.post(engine.url + "/v1/responses", json=body) as made:
                ident = (
                    events((await made.read()).decode())[0]["response"]["id"]
                    if (fields.get("stream"))
                    else (await made.json())["id"]
                )
            async with s.get(f"{engine.url}/v1/responses/{ident}?stream=1") as got:
                assert (got.status, got.content_type) == (200, "text/event-stream")
                with pytest.raises(aiohttp.ClientPayloadError):
                    await got.read()
        async with s.get(f"{engine.url}/v1/responses/resp_none?stream=true") as missing:
            assert missing.status == 404

    run(test)


@pytest.mark.parametrize("instructions", [5, ["be brief"], {"text": "be brief"}, True])
def test_instructions_that_are_not_a_string_are_refused(instructions: object) -> None:
    async def test(engine: FakeOpenAIEngine, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "input": "hi", "instructions": instructions}
        async with s.post(engine.url + "/v1/responses", json=body) as refused:
            assert refused.status == 400
            assert (await refused.json())["error"]["param"] == "body.instructions"
        for fine in (None, "be brief"):
            body["instructions"] = fine
            async with s.post(engine.url + "/v1/responses", json=body) as answered:
                assert answered.status == 200
                assert (await answered.json())["instructions"] == fine
        assert len(engine.received) == 2  # a refused body is no request run

    run(test)


def test_stop_ends_a_background_stream_still_being_generated() -> None:
    async def test(engine: FakeOpenAIEngine, s: aiohttp.ClientSession) -> None:
        engine.token_delay_s = 3600.0
        body = {"model": "m", "input": "hi", "stream": True, "background": True}
        body["x_fake_mode"] = "slow"
        async with s.post(engine.url + "/v1/responses", json=body) as held:
            ident = (await first_event(held))["response"]["id"]
            assert engine.responses[ident]["status"] == "queued"
            cancel = f"{engine.url}/v1/responses/{ident}/cancel"
            async with s.post(cancel) as cancelled:
                assert (await cancelled.json())["status"] == "cancelled"
        assert engine.responses[ident]["status"] == "cancelled"
        body["x_fake_mode"] = "slow"
        async with s.post(engine.url + "/v1/responses", json=body) as held:
            await first_event(held)
            await engine.stop()  # ends the generation waiting out its delay

    run(test)
