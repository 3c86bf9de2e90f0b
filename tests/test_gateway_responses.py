"""OpenAI's Responses API through the gateway, alike on both data planes: a conversation
continued by ``previous_response_id`` and the requests naming a stored response go to the
engine that made it (the only one holding it, as vLLM keeps responses in its memory); ids
never seen here are asked of the engines; streams without their terminal event are cut; a new
conversation is routed by the chat prompt vLLM makes of it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    Rig,
    plane,
    rig,
    run,
    until,
)
from yarl import URL

from llmsched.gateway.responses import (
    ResponseIdScan,
    ResponseOwners,
    TerminalEventScan,
    chat_request_of,
    output_deltas,
)
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptTokenizer

FAST_HEALTH = {"interval_s": 0.05, "timeout_s": 1.0}


async def create(r: Rig, **fields: Any) -> tuple[int, dict[str, Any]]:
    """POSTs a Responses request; (status, the response object or error body). A stream's
    response object is its first event's."""
    body = {"model": MODEL, "input": "hello", **fields}
    async with r.client.post(r.url("/v1/responses"), json=body) as response:
        if not fields.get("stream") or response.status != 200:
            return response.status, json.loads(await response.read())
        text = (await response.read()).decode()
    assert text.rstrip().splitlines()[0] == "event: response.created", text
    first = text.split("\n\n")[0].split("data: ", 1)[1]
    assert "event: response.completed\n" in text, text
    return 200, json.loads(first)["response"]


def holder(r: Rig, response_id: str) -> int:
    """The index of the engine storing ``response_id``."""
    (index,) = [i for i, e in enumerate(r.engines) if response_id in e.responses]
    return index


def lookups(r: Rig, outcome: str) -> float:
    return r.metric("llmsched_gateway_response_lookups_total", outcome=outcome)


@pytest.mark.usefixtures("plane")
def test_a_conversation_continues_on_the_engine_holding_it() -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            for conversation in range(4):
                status, made = await create(r, input=f"conversation {conversation}")
                assert status == 200, made
                home = holder(r, made["id"])
                for turn in range(4):
                    # Any other engine answers 404: a 200 is the owner's answer.
                    status, made = await create(
                        r,
                        input=f"turn {turn}",
                        previous_response_id=made["id"],
                        stream=turn % 2 == 1,
                    )
                    assert status == 200, made
                    assert holder(r, made["id"]) == home
            assert lookups(r, "owner") == 16
            assert r.metric("llmsched_gateway_response_owners") == 20
            assert (
                r.metric("llmsched_gateway_requests_total", route="responses", status="200") == 20
            )

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_stream_whose_first_event_is_long_still_names_its_engine() -> None:
    """``response.created`` echoes the instructions and tools (an agent's run to tens of KB):
    the id is read where vLLM writes it, first, not from the whole event."""

    async def main() -> None:
        async with rig(engines=3) as r:
            status, made = await create(r, instructions="be brief. " * 60_000, stream=True)
            assert status == 200, made
            status, _ = await create(r, previous_response_id=made["id"])
            assert status == 200
            assert (lookups(r, "owner"), lookups(r, "located")) == (1, 0)

    run(main())


@pytest.mark.usefixtures("plane")
def test_get_and_cancel_of_a_stored_response_reach_its_engine() -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            status, made = await create(r, background=True)
            assert (status, made["status"]) == (200, "queued")
            home = r.engines[holder(r, made["id"])]
            async with r.client.get(r.url(f"/v1/responses/{made['id']}")) as got:
                assert (got.status, (await got.json())["id"]) == (200, made["id"])
            cancel = r.url(f"/v1/responses/{made['id']}/cancel")
            async with r.client.post(cancel) as cancelled:
                assert (cancelled.status, (await cancelled.json())["status"]) == (200, "cancelled")
            async with r.client.post(cancel) as again:  # the engine's own 400, relayed
                assert again.status == 400
                assert "Cannot cancel" in (await again.json())["error"]["message"]
            assert [p for p in home.paths() if p != "/v1/responses"] == [
                f"/v1/responses/{made['id']}",
                f"/v1/responses/{made['id']}/cancel",
                f"/v1/responses/{made['id']}/cancel",
            ]
            others = [e for e in r.engines if e is not home]
            assert not any(e.received for e in others)
            assert (
                r.metric("llmsched_gateway_requests_total", route="responses_by_id", status="200")
                == 2
            )

    run(main())


@pytest.mark.usefixtures("plane")
def test_ids_made_elsewhere_are_asked_of_the_engines_once() -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            # Made through another gateway replica (or before this one started).
            async with r.client.post(
                r.engines[2].url + "/v1/responses", json={"model": MODEL, "input": "elsewhere"}
            ) as direct:
                made = await direct.json()
            status, continued = await create(r, previous_response_id=made["id"])
            assert status == 200, continued
            assert holder(r, continued["id"]) == 2
            async with r.client.get(r.url(f"/v1/responses/{made['id']}")) as got:
                assert got.status == 200
            # Asked once (each engine at most once, in turn); known since.
            asked = [p for e in r.engines for p in e.paths() if p == f"/v1/responses/{made['id']}"]
            assert 1 <= len(asked) <= 3 + 1
            assert (lookups(r, "located"), lookups(r, "owner")) == (1, 1)

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_id_no_engine_holds_is_a_404_naming_it() -> None:
    async def main() -> None:
        async with rig(engines=2) as r:
            status, error = await create(r, previous_response_id="resp_gone")
            assert status == 404
            assert error["error"]["message"] == "Response with id 'resp_gone' not found."
            assert error["error"]["type"] == "invalid_request_error"
            assert error["error"]["param"] == "previous_response_id"
            for method, path in (("GET", "resp_gone"), ("POST", "resp_gone/cancel")):
                async with r.client.request(method, r.url(f"/v1/responses/{path}")) as answer:
                    assert answer.status == 404
                    found = (await answer.json())["error"]
                    assert "resp_gone" in found["message"]
                    assert found["param"] == "response_id"
            assert lookups(r, "not_found") == 3
            # Nothing was generated anywhere.
            assert not any(p == "/v1/responses" for e in r.engines for p in e.paths())
            async with r.client.get(r.url("/v1/responses/")) as empty:
                assert empty.status == 404

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_conversation_whose_engine_is_down_gets_a_503_not_another_engine() -> None:
    async def main() -> None:
        async with rig(engines=2, health=FAST_HEALTH, retries={"eject_s": 60}) as r:
            _, made = await create(r)
            home = holder(r, made["id"])
            r.engines[home].health_status = 503
            worker = str(r.gateway.config.engines[home].worker_id)
            await until(lambda: worker not in r.gateway.routable_endpoints())
            before = len(r.engines[1 - home].received)
            async with r.client.post(
                r.url("/v1/responses"),
                json={"model": MODEL, "input": "next", "previous_response_id": made["id"]},
            ) as answer:
                assert answer.status == 503
                assert answer.headers["x-llmsched-dropped-reason"] == "owner-unavailable"
                assert "Retry-After" in answer.headers
                assert made["id"] in (await answer.json())["error"]["message"]
            assert len(r.engines[1 - home].received) == before
            assert lookups(r, "owner_unavailable") == 1
            # Asked about itself, the response's engine still answers out of routing (as a
            # drained one does): the GET reaches it.
            async with r.client.get(r.url(f"/v1/responses/{made['id']}")) as got:
                assert got.status == 200
            # A new conversation is served by the engine left.
            assert (await create(r, input="new"))[0] == 200

    run(main())


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("mode", ["error500", "drop"])
def test_a_conversation_is_not_retried_on_an_engine_without_it(mode: str) -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            _, made = await create(r)
            home = holder(r, made["id"])
            before = [len(e.received) for e in r.engines]
            status, error = await create(r, previous_response_id=made["id"], x_fake_mode=mode)
            # Another engine would answer 404 for a response it never stored.
            assert status == 502, error
            after = [len(e.received) for e in r.engines]
            assert [a - b for a, b in zip(after, before, strict=True)] == [
                int(i == home) for i in range(3)
            ]

    run(main())


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("mode", ["no_done", "cut", "cut_mid_event"])
def test_a_stream_without_its_terminal_event_ends_with_an_error_event(mode: str) -> None:
    async def main() -> None:
        async with rig(engines=1) as r:
            r.engines[0].mode = mode
            body = {"model": MODEL, "input": "hello", "stream": True}
            async with r.client.post(r.url("/v1/responses"), json=body) as answer:
                assert answer.status == 200
                text = b""
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for chunk in answer.content.iter_any():
                        text += chunk
            events = text.decode().split("\n\n")
            assert events[-1] == ""
            name, data = events[-2].split("\n")
            assert name == "event: error"
            error = json.loads(data.removeprefix("data: "))
            assert (error["type"], error["code"]) == ("error", "upstream_error")
            assert "response.completed" not in text.decode()
            assert (
                r.metric(
                    "llmsched_gateway_upstream_errors_total",
                    endpoint=str(r.gateway.config.engines[0].worker_id),
                    kind="truncated",
                )
                == 1
            )

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_stream_the_requests_deadline_cuts_says_so_in_its_error_event() -> None:
    """``timeouts.total_s`` passes after the stream's first event (the engine then goes
    silent): the error event names the request's deadline (code ``timeout``), not the engine
    (``upstream_error``), and the engine is not counted at fault."""

    async def main() -> None:
        async with rig(engines=1, timeouts={"total_s": 0.5}) as r:
            r.engines[0].mode = "hang"
            body = {"model": MODEL, "input": "hello", "stream": True}
            async with r.client.post(r.url("/v1/responses"), json=body) as answer:
                assert answer.status == 200
                text = b""
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for chunk in answer.content.iter_any():
                        text += chunk
            name, data = text.decode().split("\n\n")[-2].split("\n")
            assert name == "event: error"
            error = json.loads(data.removeprefix("data: "))
            assert (error["type"], error["code"]) == ("error", "timeout"), error
            assert "timeouts.total_s" in error["message"]
            worker = str(r.gateway.config.engines[0].worker_id)
            errors = "llmsched_gateway_upstream_errors_total"
            assert r.metric(errors, endpoint=worker, kind="truncated") == 0
            assert r.metric("llmsched_gateway_rejections_total", reason="timeout") == 1

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_input_the_gateway_cannot_render_is_routed_unhashed() -> None:
    async def main() -> None:
        async with rig(engines=2) as r:
            status, made = await create(
                r, input=[{"type": "item_reference", "id": "msg_1"}], tools=[{"type": "x"}]
            )
            assert status == 200, made
            assert r.metric("llmsched_gateway_responses_unhashed_total") == 1

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_engine_out_of_the_set_briefly_keeps_its_conversations() -> None:
    """Discovery can drop an engine for a moment (a readiness probe flapping) while it still
    holds its responses: asking the others would find none, so the requests naming them get
    a retryable 503 and, once it is back, reach it again (probe 47)."""

    async def main() -> None:
        async with rig(engines=2) as r:
            _, made = await create(r)
            home = holder(r, made["id"])
            everyone = list(r.gateway.config.engines)
            await r.gateway.set_engines([everyone[1 - home]])
            assert r.metric("llmsched_gateway_response_owners") == 1
            before = [len(e.received) for e in r.engines]
            for answer in (
                r.client.post(
                    r.url("/v1/responses"),
                    json={"model": MODEL, "input": "next", "previous_response_id": made["id"]},
                ),
                r.client.get(r.url(f"/v1/responses/{made['id']}")),
            ):
                async with answer as refused:
                    assert refused.status == 503
                    assert refused.headers["x-llmsched-dropped-reason"] == "owner-unavailable"
                    assert refused.headers["Retry-After"] == "1"
                    message = (await refused.json())["error"]["message"]
                    assert made["id"] in message and "left the configuration" in message
            assert [len(e.received) for e in r.engines] == before  # no engine asked
            assert lookups(r, "owner_unavailable") == 2
            await r.gateway.set_engines(everyone)
            status, next_turn = await create(r, previous_response_id=made["id"])
            assert status == 200 and holder(r, next_turn["id"]) == home
            assert (lookups(r, "owner"), lookups(r, "located")) == (1, 0)

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_engine_gone_past_the_grace_takes_its_ids_with_it() -> None:
    async def main() -> None:
        grace = {"left_grace_s": 0.3}
        async with rig(engines=2, discovery=grace) as r:
            _, made = await create(r)
            home = holder(r, made["id"])
            everyone = list(r.gateway.config.engines)
            await r.gateway.set_engines([everyone[1 - home]])
            await asyncio.sleep(0.4)
            assert r.metric("llmsched_gateway_response_owners") == 0
            status, error = await create(r, previous_response_id=made["id"])
            assert status == 404, error
            # Back after the grace (a restarted pod at the same address), it is asked.
            await r.gateway.set_engines(everyone)
            status, _ = await create(r, previous_response_id=made["id"])
            assert status == 200 and lookups(r, "located") == 1
        async with rig(engines=2, discovery={"left_grace_s": None}) as r:
            _, made = await create(r)
            await r.gateway.set_engines([r.gateway.config.engines[1 - holder(r, made["id"])]])
            assert r.metric("llmsched_gateway_response_owners") == 0

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_response_answered_after_its_engine_left_is_not_kept_past_the_grace() -> None:
    """A JSON answer names its id only when it ends: one whose engine left meanwhile is kept
    as that engine's for the grace, then forgotten with the others (probe 47 F13: it was kept
    for good, over-counted, and pinned to whatever engine later took that worker id)."""

    async def main() -> None:
        def slow(engine: Any) -> None:
            engine.mode, engine.token_delay_s = "slow", 0.1

        async with rig(engines=2, setup=slow, discovery={"left_grace_s": 1.0}) as r:
            answer = asyncio.ensure_future(create(r))
            await until(lambda: any(e.running for e in r.engines))
            home = [e.running for e in r.engines].index(1)
            await r.gateway.set_engines([r.gateway.config.engines[1 - home]])
            status, made = await answer
            assert holder(r, made["id"]) == home
            assert status == 200, made
            assert r.metric("llmsched_gateway_response_owners") == 1
            await asyncio.sleep(1.1)
            assert r.metric("llmsched_gateway_response_owners") == 0

    run(main())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
        "{% for c in m.get('tool_calls') or [] %}[call {{ c['function']['name'] }}]{% endfor %}"
        "{{ eos_token }}\n{% endfor %}"
        "{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return write_tokenizer(tmp_path_factory.mktemp("tok"), chat_template=template)


@pytest.mark.usefixtures("plane")
def test_a_new_conversation_routes_by_the_chat_prompt_vllm_makes_of_it(
    tokenizer_dir: Path,
) -> None:
    async def main() -> None:
        async with rig(engines=2, tokenizer=str(tokenizer_dir)) as r:
            for c in range(12):
                system = f"you are assistant number {c} " + "tell me a story " * 8
                user = f"hello there how are you today {c} " * 4
                chat = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": user},
                    ],
                }
                async with r.client.post(r.url("/v1/chat/completions"), json=chat) as answer:
                    assert answer.status == 200
                home = r.engine_of_request(-1)
                status, _ = await create(
                    r,
                    instructions=system,
                    input=[{"type": "message", "role": "user", "content": user}],
                )
                assert status == 200
                # Two engines, a random tie-break: 12 chance matches have probability 2**-12.
                assert r.engine_of_request(-1) is home, c
            assert r.metric("llmsched_gateway_responses_unhashed_total") == 0

    run(main())


# -- the conversion and the scanners -----------------------------------------------------


def test_the_conversion_follows_vllm_item_by_item() -> None:
    payload = {
        "model": "m",
        "instructions": "sys",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "a"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "developer", "content": "d"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": "auto",
        "reasoning": {"effort": "low"},
    }
    chat = chat_request_of(payload)
    assert chat is not None
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [
                {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
                {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"},
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "developer", "content": "d"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert (chat["tool_choice"], chat["reasoning_effort"]) == ("auto", "low")
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (True, False)


def test_the_conversion_continues_an_unfinished_last_message_and_keeps_set_kwargs() -> None:
    chat = chat_request_of(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "message", "role": "assistant", "content": "par", "status": "incomplete"},
            ],
            "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"enable_thinking": True},
        }
    )
    assert chat is not None
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    # A tool call after an assistant message joins it; text after a call fills its content.
    chat = chat_request_of(
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
                {"role": "assistant", "content": "then"},
            ]
        }
    )
    assert chat is not None
    assert chat["messages"] == [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "function": {"name": "f", "arguments": ""}, "type": "function"}
            ],
            "content": "then",
        }
    ]


def test_reasoning_items_join_the_assistant_message_as_vllm_reads_them() -> None:
    """Probe 65: a stateless agent loop (``store: false``) sends its reasoning back as items;
    they were routed without prefix hashing (vLLM renders them as the assistant's
    ``reasoning``)."""
    user = {"role": "user", "content": "q"}

    def reasoning(text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": "rs",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    answer = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "a"}],
    }
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    chat = chat_request_of(
        {
            "input": [
                user,
                reasoning("r1"),
                answer,
                reasoning("r2"),
                call,
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                {"type": "reasoning", "summary": []},
            ]
        }
    )
    assert chat is not None
    assert chat["messages"] == [
        user,
        {"role": "assistant", "reasoning": "r1", "content": "a"},
        {
            "role": "assistant",
            "reasoning": "r2",
            "tool_calls": [
                {"id": "c", "function": {"name": "f", "arguments": "{}"}, "type": "function"}
            ],
        },
        {"role": "assistant", "reasoning": "s"},
        {"role": "assistant", "reasoning": ""},
    ]


def test_custom_and_namespaced_tools_and_calls_take_vllms_names_and_shapes() -> None:
    """Probe 65: custom tools (a coding agent's ``apply_patch``), namespaces (an MCP server's
    functions) and the built-in tools vLLM does not show the model made a request unhashed."""

    def call(ident: str, name: str, arguments: str) -> dict[str, Any]:
        return {"id": ident, "function": {"name": name, "arguments": arguments}, "type": "function"}

    chat = chat_request_of(
        {
            "input": [
                {
                    "type": "custom_tool_call",
                    "call_id": "c1",
                    "name": "sh",
                    "input": 'echo "é"\n\x01',
                },
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "namespace": "ns",
                    "name": "f",
                    "arguments": "{}",
                },
                {"type": "custom_tool_call", "call_id": "c3", "name": "sh"},
            ],
            "tools": [
                {"type": "web_search"},
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "d",
                    "tools": [
                        {"type": "function", "name": "f", "parameters": {"type": "object"}},
                        {"type": "custom", "name": "c"},
                    ],
                },
                {"type": "custom", "name": "sh", "format": {"type": "text"}},
            ],
        }
    )
    assert chat is not None
    assert chat["messages"] == [
        {
            "role": "assistant",
            "tool_calls": [call("c1", "sh", '{"input": "echo \\"é\\"\\n\\u0001"}')],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {
            "role": "assistant",
            "tool_calls": [call("c2", "ns__f", "{}"), call("c3", "sh", '{"input": ""}')],
        },
    ]
    namespaced, custom = chat["tools"]
    assert namespaced == {
        "type": "function",
        "function": {"name": "ns__f", "parameters": {"type": "object"}},
    }
    assert custom["function"]["name"] == "sh" and custom["function"]["description"] is None
    assert custom["function"]["parameters"]["required"] == ["input"]
    # Only tools left out: an empty list, as vLLM hands the template.
    only_mcp = chat_request_of({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]})
    assert only_mcp is not None and only_mcp["tools"] == []


@pytest.mark.parametrize(
    "payload",
    [
        {"input": 3},
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]},
        {"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}]},
        {"input": ["text"]},
        {"input": "x", "tools": [{"name": "untyped"}]},
        {"input": "x", "instructions": 5},
        {"input": [{"type": "function_call", "namespace": 3, "name": "f"}]},
        {"input": [{"type": "custom_tool_call", "name": "sh", "input": 5}]},
    ],
)
def test_the_conversion_leaves_what_it_does_not_cover(payload: dict[str, Any]) -> None:
    assert chat_request_of(payload) is None


def test_a_converted_request_tokenizes_as_the_chat_request(tokenizer_dir: Path) -> None:
    tokenizer = PromptTokenizer(str(tokenizer_dir))
    converted = chat_request_of(
        {"model": "m", "instructions": "be brief", "input": "hello there", "tools": []}
    )
    assert converted is not None
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
        ],
    }
    assert tokenizer.chat_request_tokens(converted) == tokenizer.chat_request_tokens(chat)


def test_owners_are_bounded_and_skip_overlong_ids() -> None:
    owners = ResponseOwners(capacity=3)
    owners.engine_joined("e0")
    owners.engine_joined("e1")
    for i in range(5):
        owners.record(f"resp_{i}", f"e{i % 2}")
    assert len(owners) == 3
    assert owners.owner("resp_0") is None and owners.owner("resp_4") == ("e0", False)
    owners.owner("resp_2")  # used: kept over resp_3
    owners.record("resp_5", "e1")
    assert owners.owner("resp_2") == ("e0", False) and owners.owner("resp_3") is None
    owners.record("r" * 257, "e0")
    assert owners.owner("r" * 257) is None
    owners.record("resp_6", "e9")  # an engine not configured
    assert owners.owner("resp_6") is None
    owners.forget_engine("e0")
    assert len(owners) == 1


def test_owners_keep_an_engine_that_left_for_the_grace() -> None:
    owners = ResponseOwners(grace_s=0.2)
    for engine in ("e0", "e1"):
        owners.engine_joined(engine)
    owners.record("a", "e0")
    owners.record("b", "e1")
    owners.engine_left("e0")
    owners.record("c", "e0")  # answered after it left
    assert owners.owner("a") == owners.owner("c") == ("e0", True)
    owners.engine_joined("e0")
    assert owners.owner("a") == ("e0", False) and len(owners) == 3
    owners.engine_left("e0")
    time.sleep(0.25)
    assert (owners.owner("a"), owners.owner("c"), len(owners)) == (None, None, 1)
    owners.record("d", "e0")
    assert owners.owner("d") is None


def test_the_scanners_read_events_split_anywhere() -> None:
    stream = (
        b'event: response.created\ndata: {"response": {"id": "resp_9"}, "type": "x"}\n\n'
        b'event: response.output_text.delta\ndata: {"delta": "a"}\n\n'
        b'event: response.output_text.delta\ndata: {"delta": "event: response.completed"}\n\n'
        b'event: response.completed\ndata: {"type": "response.completed"}\n\n'
    )
    for cut in range(1, len(stream)):
        ids, done = ResponseIdScan(), TerminalEventScan()
        for part in (stream[:cut], stream[cut:]):
            ids.feed(part)
            done.feed(part)
        assert ids.id == "resp_9" and done.seen, cut
    unfinished = stream.rsplit(b"event: response.completed\n", 1)[0]
    done = TerminalEventScan()
    done.feed(unfinished)
    assert not done.seen  # a data field quoting the name is no event
    for cut in range(len(unfinished), len(stream) - 1):
        done = TerminalEventScan()
        done.feed(stream[:cut])
        assert not done.seen, cut  # the terminal event is whole only with its blank line
    assert output_deltas(stream) == 2
    first_without_id = ResponseIdScan()
    first_without_id.feed(b"event: x\ndata: {}\n\n" + stream)
    assert first_without_id.id is None


# -- what probe 46 found -----------------------------------------------------------------

KEY = "sk-responses-0001"


class ScriptedEngine:
    """A raw-socket engine for framings aiohttp's server never writes: each request gets the
    next answer scripted for the first path prefix it starts with (bytes sent as given, then
    the connection closes; None: never answered), else a 404."""

    def __init__(self) -> None:
        self.answers: dict[str, list[bytes | None]] = {}
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()

    def spec(self) -> dict[str, Any]:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return {"host": "127.0.0.1", "port": port, "model": MODEL}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, _ = (await reader.readline()).decode().split(" ", 2)
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.requests.append(f"{method} {path}")
            prefix = next((p for p in self.answers if path.startswith(p)), None)
            if prefix is not None and self.answers[prefix]:
                answer = self.answers[prefix].pop(0)
                if answer is None:
                    await asyncio.sleep(3600)
                    return
            else:
                answer = (
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
                )
            writer.write(answer)
            await writer.drain()
        except (ConnectionError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def json_answer(value: dict[str, Any]) -> bytes:
    body = json.dumps(value).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )


def event_bytes(name: str, value: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(value)}\n\n".encode()


async def read_stream(response: aiohttp.ClientResponse) -> str:
    """A stream's text up to its end, cut or not."""
    text = b""
    try:
        async for chunk in response.content.iter_any():
            text += chunk
    except aiohttp.ClientPayloadError:
        pass
    return text.decode()


def last_event(text: str) -> tuple[str, str | None]:
    """The last event of an event stream as an SSE client parses it: its name, and its data's
    ``code`` when the data is JSON (None when not)."""
    events = [event for event in text.split("\n\n") if event.strip("\n")]
    fields = dict(line.split(": ", 1) for line in events[-1].strip("\n").split("\n"))
    try:
        code = json.loads(fields.get("data", ""))["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return fields.get("event", ""), code


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_a_stream_cut_inside_its_terminal_event_is_cut(framing: str) -> None:
    async def main() -> None:
        created = event_bytes("response.created", {"response": {"id": "resp_t"}})
        completed = event_bytes("response.completed", {"response": {"id": "resp_t"}})
        half = completed[: len(completed) - 12]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        if framing == "chunked":
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (created, half))
            answer = head + b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
        else:
            answer = head + b"Connection: close\r\n\r\n" + created + half
        async with ScriptedEngine() as engine:
            engine.answers["/v1/responses"] = [answer]
            async with rig(engines=0, extra_engines=[engine.spec()]) as r:
                body = {"model": MODEL, "input": "x", "stream": True}
                async with r.client.post(r.url("/v1/responses"), json=body) as response:
                    text = await read_stream(response)
            assert text.startswith(created.decode() + half.decode())
            # The gateway's error event, parsed on its own, ends it.
            assert last_event(text) == ("error", "upstream_error")

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_stored_response_stream_cut_inside_an_event_ends_with_an_error_event_of_its_own() -> None:
    async def main() -> None:
        created = event_bytes("response.created", {"response": {"id": "resp_g"}})
        completed = event_bytes("response.completed", {"response": {"id": "resp_g"}})
        half = completed[: len(completed) - 12]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        async with ScriptedEngine() as engine:
            # The lookup finds it; the relayed GET (a stream) is the answer under test.
            engine.answers["/v1/responses/resp_g"] = [
                json_answer({"id": "resp_g"}),
                head + created + half,
            ]
            async with (
                rig(engines=0, extra_engines=[engine.spec()]) as r,
                r.client.get(r.url("/v1/responses/resp_g?stream=true")) as response,
            ):
                assert response.status == 200
                text = await read_stream(response)
            assert text.startswith(created.decode() + half.decode())
            # The gateway's error event, parsed on its own, ends it.
            assert last_event(text) == ("error", "upstream_error")

    run(main())


CUT_JSON = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    b'{"id": "resp_k", "status": "compl'
)
GZIP_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n"
)


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("answer", [CUT_JSON, GZIP_CHUNKED], ids=["cut-at-close", "gzip"])
def test_a_stored_response_answer_that_is_not_whole_is_a_502(answer: bytes) -> None:
    async def main() -> None:
        async with ScriptedEngine() as engine:
            # The lookup finds it; the relayed GET is the answer under test.
            engine.answers["/v1/responses/resp_k"] = [json_answer({"id": "resp_k"}), answer]
            async with (
                rig(engines=0, extra_engines=[engine.spec()]) as r,
                r.client.get(r.url("/v1/responses/resp_k")) as response,
            ):
                assert response.status == 502, await response.text()

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_head_answer_without_a_length_is_relayed_without_a_body() -> None:
    async def main() -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
        async with ScriptedEngine() as engine:
            engine.answers["/v1/responses/resp_h"] = [json_answer({"id": "resp_h"}), head]
            async with (
                rig(engines=0, extra_engines=[engine.spec()]) as r,
                r.client.head(r.url("/v1/responses/resp_h")) as response,
            ):
                assert response.status == 200
            assert engine.requests[-1] == "HEAD /v1/responses/resp_h"

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_engine_stalling_on_a_lookup_holds_no_request() -> None:
    async def main() -> None:
        async with ScriptedEngine() as stalling:
            stalling.answers["/v1/responses/"] = [None] * 4
            # Listed first: asked one at a time, the lookup would wait out its read timeout.
            async with rig(
                engines=1, extra_engines=[stalling.spec()], timeouts={"read_s": 60}
            ) as r:
                made = await direct_response(r.engines[0])
                status, continued = await create(r, previous_response_id=made)
                assert status == 200, continued
                assert lookups(r, "located") == 1

    run(main())


async def direct_response(engine: Any) -> str:
    """The id of a response made on ``engine`` past the gateway."""
    async with aiohttp.ClientSession() as client:
        body = {"model": MODEL, "input": "elsewhere"}
        async with client.post(engine.url + "/v1/responses", json=body) as answer:
            return str((await answer.json())["id"])


@pytest.mark.usefixtures("plane")
def test_concurrent_requests_for_an_unknown_id_share_one_lookup() -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            made = await direct_response(r.engines[2])
            results = await asyncio.gather(
                *(create(r, previous_response_id=made, input=f"n{i}") for i in range(20))
            )
            assert [status for status, _ in results] == [200] * 20
            asked = [p for e in r.engines for p in e.paths() if p == f"/v1/responses/{made}"]
            assert len(asked) <= 3  # each engine at most once

    run(main())


class _Liar(dict):  # type: ignore[type-arg]
    """An engine's store that claims every id, answering with another."""

    def get(self, key: object, default: object = None) -> object:
        return {"id": "resp_someone_else", "status": "completed"}


@pytest.mark.usefixtures("plane")
def test_an_engine_claiming_every_id_does_not_capture_it() -> None:
    async def main() -> None:
        async with rig(engines=2) as r:
            made = await direct_response(r.engines[1])
            r.engines[0].responses = _Liar()
            status, continued = await create(r, previous_response_id=made)
            assert status == 200, continued
            assert not [e for e in r.engines[0].received if e.path == "/v1/responses"]

    run(main())


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize(
    "path",
    ["resp_x/../../../metrics", "resp_x/%2E%2E/cancel", "../models", "resp_x%2Fcancel"],
)
def test_a_stored_response_path_naming_another_path_reaches_no_engine(path: str) -> None:
    async def main() -> None:
        async with rig(engines=2) as r:
            url = URL(r.url(f"/v1/responses/{path}"), encoded=True)
            async with r.client.get(url) as response:
                assert response.status == 404
            assert not any(e.received for e in r.engines)

    run(main())


@pytest.mark.usefixtures("plane")
def test_requests_about_stored_responses_take_the_keys_request_limits() -> None:
    async def main() -> None:
        keys = {KEY: {"tenant": "t", "requests_per_s": 0.001, "burst_requests": 2}}
        async with rig(engines=2, auth={"api_keys": keys}) as r:
            headers = {"Authorization": f"Bearer {KEY}"}
            statuses = []
            for _ in range(4):
                async with r.client.get(r.url("/v1/responses/resp_q"), headers=headers) as got:
                    statuses.append(got.status)
            assert statuses == [404, 404, 429, 429]
            async with r.client.get(r.url("/v1/responses/resp_q")) as anonymous:
                assert anonymous.status == 401

    run(main())


@pytest.mark.usefixtures("plane")
def test_output_tokens_are_read_from_the_usage_block() -> None:
    async def main() -> None:
        answer = {
            "id": "resp_u",
            "metadata": {"output_tokens": 0},
            "tools": [{"type": "function", "parameters": {"output_tokens": 0}}],
            "usage": {"input_tokens": 1, "output_tokens": 500, "total_tokens": 501},
        }
        async with ScriptedEngine() as engine:
            engine.answers["/v1/responses"] = [json_answer(answer)] * 4
            keys = {KEY: {"tenant": "t", "tokens_per_s": 0.001, "burst_tokens": 100}}
            async with rig(engines=0, extra_engines=[engine.spec()], auth={"api_keys": keys}) as r:
                statuses = []
                for _ in range(4):
                    body = {"model": MODEL, "input": "x", "metadata": {"output_tokens": 0}}
                    headers = {"Authorization": f"Bearer {KEY}"}
                    async with r.client.post(
                        r.url("/v1/responses"), json=body, headers=headers
                    ) as response:
                        statuses.append(response.status)
            # 500 output tokens put the key's 100-token bucket in debt after the first.
            assert statuses == [200, 429, 429, 429]

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_number_past_double_range_keeps_the_conversation_on_its_engine() -> None:
    async def main() -> None:
        async with rig(engines=3) as r:
            _, made = await create(r)
            home = holder(r, made["id"])
            for i in range(6):
                body = (
                    f'{{"model": "{MODEL}", "input": "n{i}", "metadata": {{"n": 1e400}}, '
                    f'"previous_response_id": "{made["id"]}"}}'
                ).encode()
                headers = {"Content-Type": "application/json"}
                async with r.client.post(r.url("/v1/responses"), data=body, headers=headers) as a:
                    assert a.status == 200, await a.text()
            assert lookups(r, "owner") == 6
            assert all(
                i == home or not [q for q in e.received if q.path == "/v1/responses"][1:]
                for i, e in enumerate(r.engines)
            )

    run(main())


@pytest.mark.usefixtures("plane")
def test_requests_the_parser_refuses_log_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Each was a traceback at ERROR on the Python plane: log noise any client can make."""

    async def main() -> None:
        async with rig(engines=1) as r:
            for line in (b"GET /\x01x HTTP/1.1", b"GET /" + b"a" * 20_000 + b" HTTP/1.1"):
                reader, writer = await asyncio.open_connection("127.0.0.1", r.gateway.port)
                writer.write(line + b"\r\nHost: x\r\n\r\n")
                assert (await reader.read(64)).split(b" ")[1] in (b"400", b"414")
                writer.close()

    with caplog.at_level(logging.ERROR):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.usefixtures("plane")
def test_a_stream_framed_by_its_length_without_its_terminal_event_is_a_502() -> None:
    """Probe 51 F10 on the Responses API: a length-framed stream is read whole and checked;
    without its terminal event the client gets a 502, not a complete-looking 200."""

    async def main() -> None:
        events = [
            event_bytes("response.created", {"response": {"id": "resp_t"}}),
            event_bytes("response.output_text.delta", {"delta": "a"}),
        ]
        body = b"".join(events)
        stream = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        async with ScriptedEngine() as engine:
            engine.answers["/v1/responses"] = [stream]
            async with rig(engines=0, extra_engines=[engine.spec()]) as r:
                request = {"model": MODEL, "input": "x", "stream": True}
                async with r.client.post(r.url("/v1/responses"), json=request) as response:
                    assert response.status == 502
                    assert "without its end event" in (await response.json())["error"]["message"]

    run(main())


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("line_end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_a_stream_with_crlf_or_cr_lines_is_whole_and_names_its_engine(line_end: bytes) -> None:
    """Server-sent events may end their lines with CRLF (``sse-starlette`` does) or a lone CR:
    such a stream was always cut."""

    async def main() -> None:
        events = [
            event_bytes("response.created", {"response": {"id": "resp_c"}}),
            event_bytes("response.output_text.delta", {"delta": "a"}),
            event_bytes("response.completed", {"response": {"id": "resp_c"}}),
        ]
        body = b"".join(e.replace(b"\n", line_end) for e in events)
        stream = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        async with ScriptedEngine() as engine:
            engine.answers["/v1/responses"] = [stream, json_answer({"id": "resp_c2"})]
            async with rig(engines=0, extra_engines=[engine.spec()]) as r:
                request = {"model": MODEL, "input": "x", "stream": True}
                async with r.client.post(r.url("/v1/responses"), json=request) as response:
                    assert await read_stream(response) == body.decode()
                status, _ = await create(r, previous_response_id="resp_c")
                assert status == 200
                assert lookups(r, "owner") == 1

    run(main())


# -- what probe 65 found -----------------------------------------------------------------


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("store", [False, None])
def test_a_response_the_engine_does_not_keep_gets_no_owner(store: bool | None) -> None:
    """vLLM keeps nothing of a request with ``store`` false (or null): its id was recorded
    all the same, each filling a place of the 100,000 known ids (pushing out the ones that
    are held) and pinning requests naming it to an engine that never had it."""

    async def main() -> None:
        async with rig(engines=2) as r:
            for stream in (False, True):
                status, made = await create(r, store=store, stream=stream)
                assert status == 200, made
                assert not any(made["id"] in e.responses for e in r.engines)
            assert r.metric("llmsched_gateway_response_owners") == 0
            status, error = await create(r, previous_response_id=made["id"])
            assert status == 404, error
            assert error["error"]["message"] == f"Response with id '{made['id']}' not found."
            assert lookups(r, "not_found") == 1
            # Kept (absent means true): remembered.
            _, kept = await create(r, store=True)
            assert r.metric("llmsched_gateway_response_owners") == 1
            status, _ = await create(r, previous_response_id=kept["id"])
            assert status == 200 and lookups(r, "owner") == 1
            # vLLM's 400 for a background request it would not keep, relayed.
            status, error = await create(r, store=False, background=True)
            assert status == 400 and error["error"]["param"] == "background"

    run(main())


STATELESS_AGENT_TURN: dict[str, Any] = {
    "store": False,
    "instructions": "you are a coding agent",
    "input": [
        {"role": "user", "content": "fix the bug"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look"}]},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** x"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        {
            "type": "function_call",
            "call_id": "c2",
            "namespace": "repo",
            "name": "grep",
            "arguments": '{"q": "bug"}',
        },
        {"type": "function_call_output", "call_id": "c2", "output": "none left"},
    ],
    "tools": [
        {"type": "custom", "name": "apply_patch", "description": "patch files"},
        {
            "type": "namespace",
            "name": "repo",
            "description": "the repository",
            "tools": [{"type": "function", "name": "grep", "parameters": {"type": "object"}}],
        },
        {"type": "web_search"},
    ],
}


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("tokenized", [False, True], ids=["hashed-text", "tokenized"])
def test_a_stateless_agent_turn_is_routed_by_its_prompt(
    tokenized: bool, tokenizer_dir: Path
) -> None:
    async def main() -> None:
        extra = {"tokenizer": str(tokenizer_dir)} if tokenized else {}
        async with rig(engines=2, **extra) as r:
            status, made = await create(r, **STATELESS_AGENT_TURN)
            assert status == 200, made
            assert r.metric("llmsched_gateway_responses_unhashed_total") == 0

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_missing_id_is_named_as_vllm_names_it_on_both_planes() -> None:
    """The Python plane wrote the id as Python's repr (``'it\\'s'``, ``'\\x01'``); an id
    whose escapes are no UTF-8 text was asked of the engines as U+FFFD there (natively: a
    plain 404)."""

    async def main() -> None:
        async with rig(engines=2) as r:
            status, error = await create(r, previous_response_id="it's\x01")
            assert status == 404
            assert error["error"]["message"] == "Response with id 'it's\x01' not found."
            url = URL(r.url("/v1/responses/it%27s%01"), encoded=True)
            async with r.client.get(url) as answer:
                assert answer.status == 404
                message = (await answer.json())["error"]["message"]
                assert message == "Response with id 'it's\x01' not found."
            before = [len(e.received) for e in r.engines]
            async with r.client.get(URL(r.url("/v1/responses/%FF"), encoded=True)) as answer:
                assert answer.status == 404
                assert (await answer.json())["error"]["type"] == "not_found"
            assert [len(e.received) for e in r.engines] == before  # no engine asked

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_id_holding_a_lone_surrogate_is_the_same_400_on_both_planes() -> None:
    """A lone surrogate escape (``"\\ud800"``: JSON, but no UTF-8 text) was named on the
    Python plane and "the body is not valid JSON" natively; now both name the field. A
    surrogate's UTF-8 form (which is no UTF-8) was a 500 on the Python plane (``json`` read
    it as a lone surrogate, and its check looked at escapes only): not JSON on both; a UTF-16
    body is refused naming its encoding (probe 74)."""

    async def main() -> None:
        async with rig(engines=1) as r:
            for fields, param, in_key in [
                ({"previous_response_id": "resp_\ud800"}, "previous_response_id", False),
                ({"input": [{"type": "item_reference", "id": "x\udc00"}]}, "input[0].id", False),
                ({"metadata": {"ok": "\ud83d\ude00", "\ud800": "v"}}, "metadata", True),
                ({"\udbff": "an unknown field"}, "", True),
            ]:
                data = json.dumps({"model": MODEL, "input": "x", **fields}).encode()
                async with r.client.post(r.url("/v1/responses"), data=data) as answer:
                    assert answer.status == 400
                    error = (await answer.json())["error"]
                at = param or "body"
                message = (
                    f"a key in '{at}' holds a lone surrogate escape"
                    if in_key
                    else f"'{at}' holds a lone surrogate escape (not valid UTF-8 text)"
                )
                expected = {"message": message, "type": "invalid_request_error", "code": 400}
                assert error == {**expected, "param": param or None}, fields
            text = json.dumps({"model": MODEL, "input": "x"})
            raw = b'{"model": "tiny", "input": "x", "previous_response_id": "r\xed\xa0\x80"}'
            # A surrogate's UTF-8 form, and UTF-16 (a UTF-8 byte order mark is dropped since
            # probe 74: see test_gateway_input).
            for data, message in [
                (raw, "the body is not valid JSON"),
                (
                    text.encode("utf-16"),
                    "the body is not valid JSON: it is encoded as UTF-16 (send UTF-8)",
                ),
            ]:
                async with r.client.post(r.url("/v1/responses"), data=data) as answer:
                    assert answer.status == 400, data
                    error = (await answer.json())["error"]
                    assert error["message"] == message, data
            assert not r.engines[0].received

    run(main())
