"""Odd client input answered alike on both data planes, never with a 5xx: tool-call
arguments that do not decode, request bodies with a Content-Encoding, malformed admin entries,
unknown paths and methods, priorities that are not ASCII integers, and NaN / Infinity."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest
from _gateway_harness import MODEL, plane, raw_request, rig, run  # noqa: F401

from llmsched import _llmsched
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptError, PromptTokenizer

ADMIN_TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# A template that prints each call's arguments as Qwen 2.5's does (``| tojson``).
ARGUMENTS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% endfor %}<|assistant|>"
)

# Arguments texts the native plane reads as ``{}`` (serde_json cannot decode them).
UNDECODABLE_ARGUMENTS = {
    "nested-5000": "[" * 5000 + "]" * 5000,
    "lone-surrogate-value": '{"a": "\\ud800"}',
    "lone-low-surrogate": '{"a": "\\udc00x"}',
    "lone-surrogate-key": '{"\\ud800": 1}',
    "nan": '{"a": NaN}',
    "infinity": '{"a": -Infinity}',
    "float-out-of-range": '{"a": 1e400}',
    "nested-128": '{"a": ' + "[" * 127 + "]" * 127 + "}",
}


def _chat(arguments: str) -> dict[str, Any]:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ],
    }


@pytest.fixture(scope="module")
def arguments_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory whose chat template prints tool-call arguments."""
    return write_tokenizer(tmp_path_factory.mktemp("tok"), chat_template=ARGUMENTS_TEMPLATE)


@pytest.mark.parametrize("arguments", UNDECODABLE_ARGUMENTS.values(), ids=UNDECODABLE_ARGUMENTS)
def test_undecodable_tool_call_arguments_give_the_native_planes_ids(
    arguments_tokenizer: Path, arguments: str
) -> None:
    body = _chat(arguments)
    python = PromptTokenizer(arguments_tokenizer)
    native = _llmsched.NativePromptTokenizer(str(arguments_tokenizer))
    ids = python.chat_request_tokens(body)
    assert native.chat_tokens(json.dumps(body)) == ids
    assert python.render_chat_request(body).endswith("[f {}]<|assistant|>")


def test_tool_call_arguments_that_decode_are_still_read(arguments_tokenizer: Path) -> None:
    body = _chat('{"a": "\\ud83d\\ude00", "b": ' + "[" * 120 + "]" * 120 + "}")
    python = PromptTokenizer(arguments_tokenizer)
    native = _llmsched.NativePromptTokenizer(str(arguments_tokenizer))
    assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body)
    assert '"a": "\U0001f600"' in python.render_chat_request(body)


def test_a_prompt_the_tokenizer_cannot_take_is_a_prompt_error(tmp_path: Path) -> None:
    python = PromptTokenizer(write_tokenizer(tmp_path / "tok"))
    with pytest.raises(PromptError, match="lone surrogate"):
        python.completion_tokens("a\ud800b")


@pytest.mark.usefixtures("plane")
def test_undecodable_tool_call_arguments_are_served(arguments_tokenizer: Path) -> None:
    async def body() -> None:
        async with rig(engines=1, tokenizer=str(arguments_tokenizer)) as r:
            for name in ("nested-5000", "lone-surrogate-value"):
                data = json.dumps(_chat(UNDECODABLE_ARGUMENTS[name])).encode()
                status, text = await raw_request(r, data, path="/v1/chat/completions")
                assert status == 200, (name, text)

    run(body())


@pytest.mark.usefixtures("plane")
def test_content_encoding_is_refused_with_415() -> None:
    plain = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    refused = [
        ("gzip", plain),
        ("gzip", gzip.compress(plain)),
        ("GZIP", gzip.compress(plain)),
        ("deflate", plain),
        ("br", plain),
        ("zstd", plain),
    ]

    async def body() -> None:
        async with rig(engines=1) as r:
            for path in ("/v1/completions", "/v1/chat/completions"):
                for encoding, data in refused:
                    extra = f"Content-Encoding: {encoding}\r\n".encode()
                    status, text = await raw_request(r, data, extra=extra, path=path)
                    assert status == 415, (encoding, text)
                    assert json.loads(text) == {
                        "error": {
                            "message": f"Content-Encoding '{encoding}' is not supported: "
                            "send the body uncompressed",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": 415,
                        }
                    }
            for encoding in ("identity", "Identity"):
                extra = f"Content-Encoding: {encoding}\r\n".encode()
                status, text = await raw_request(r, plain, extra=extra)
                assert status == 200, (encoding, text)

    run(body())


@pytest.mark.usefixtures("plane")
def test_an_answer_cut_before_its_first_byte_is_a_502_not_a_200() -> None:
    """An engine that sends its answer's head (as vLLM does for a stream before prefill) and
    then stays silent past the read timeout: the client gets a 502 with a JSON body, its
    status held back until the engine's first body byte, never a 200 cut short."""

    async def body() -> None:
        async with rig(engines=1, timeouts={"read_s": 0.5}) as r:
            for stream in (False, True):
                request = {"model": MODEL, "prompt": "hi", "stream": stream}
                request["x_fake_mode"] = "headers"
                async with r.client.post(r.url("/v1/completions"), json=request) as response:
                    text = await response.text()
                    assert response.status == 502, (stream, text)
                    error = json.loads(text)["error"]
                    assert error["message"].startswith("the engine's answer was cut off"), error
            # Answers that do come are passed on whole, streamed or not.
            for stream in (False, True):
                request = {"model": MODEL, "prompt": "hi", "stream": stream}
                async with r.client.post(r.url("/v1/completions"), json=request) as response:
                    text = await response.text()
                    assert response.status == 200, text
                    assert ("[DONE]" in text) == stream, text

    run(body())


@pytest.mark.usefixtures("plane")
def test_malformed_admin_entries_are_400_and_change_nothing() -> None:
    cases = [
        (b'{"host": ' + b"[" * 5000 + b"]" * 5000 + b', "port": 1}', "not an engine entry: "),
        (
            json.dumps({"host": "\u00e9\u00e9", "port": 1}, ensure_ascii=False).encode(),
            'not an engine entry: engines: "http://\u00e9\u00e9:1" is not an http:// URL',
        ),
        (
            json.dumps({"host": "a b", "port": 1}).encode(),
            'not an engine entry: engines: "http://a b:1" is not an http:// URL',
        ),
        (
            json.dumps({"host": "a\\b", "port": 1}).encode(),
            'not an engine entry: engines: "http://a\\\\b:1" is not an http:// URL',
        ),
        (
            json.dumps({"host": "a%41", "port": 1}).encode(),
            'not an engine entry: engines: "http://a%41:1" is not an http:// URL',
        ),
        # A lone surrogate escape in a text the engine set keeps: a 500 on both planes (the
        # pool's InvalidValueError once the engine set was changing), or a 201 for a topic.
        *(
            (
                b'{"host": "127.0.0.1", "port": 1, ' + field + b"}",
                f"not an engine entry: {key} holds a lone surrogate escape",
            )
            for field, key in [
                (b'"name": "\\ud800"', "name"),
                (b'"model": "\\ud800"', "model"),
                (b'"topic": "\\udc00x"', "topic"),
                (b'"metrics_path": "/\\ud800"', "metrics_path"),
                (b'"labels": {"a": "\\ud800"}', "labels['a']"),
            ]
        ),
    ]

    async def body() -> None:
        async with rig(engines=1, admin={"token": ADMIN_TOKEN}) as r:
            first = r.gateway.config.engines[0].worker_id
            for data, message in cases:
                async with r.client.post(
                    r.url("/admin/engines"), data=data, headers=ADMIN
                ) as response:
                    assert response.status == 400, await response.text()
                    error = (await response.json())["error"]
                    assert error["message"].startswith(message), error
                    assert error["type"] == "invalid_request_error"
            async with r.client.get(r.url("/admin/engines"), headers=ADMIN) as response:
                listed = [e["worker_id"] for e in (await response.json())["engines"]]
            assert listed == [first]
            assert (await r.complete("hi")).status == 200

    run(body())


@pytest.mark.usefixtures("plane")
def test_unknown_paths_and_methods_are_json_errors() -> None:
    async def body() -> None:
        async with rig(engines=1, admin={"token": ADMIN_TOKEN}) as r:
            for method, path in [
                ("GET", "/nope"),
                ("POST", "/v1/embeddings"),
                ("POST", "/v1/completions/"),
                ("GET", "/v1/models/tiny"),
                ("PUT", "/admin/engines"),
                ("GET", "/admin/engines/x"),
            ]:
                async with r.client.request(method, r.url(path), headers=ADMIN) as response:
                    assert response.status == 404, (method, path)
                    assert await response.json() == {
                        "error": {
                            "message": "not found",
                            "type": "not_found",
                            "param": None,
                            "code": 404,
                        }
                    }
            for method, path, allowed in [
                ("GET", "/v1/completions", "POST"),
                ("PUT", "/v1/chat/completions", "POST"),
                ("POST", "/v1/models", "GET"),
                ("POST", "/ready", "GET"),
                ("DELETE", "/metrics", "GET"),
                ("PATCH", "/health", "GET"),
            ]:
                async with r.client.request(method, r.url(path)) as response:
                    assert response.status == 405, (method, path)
                    assert response.headers["Allow"] == allowed
                    assert await response.json() == {
                        "error": {
                            "message": f"this path takes {allowed} only",
                            "type": "method_not_allowed",
                            "param": None,
                            "code": 405,
                        }
                    }

    run(body())


@pytest.mark.usefixtures("plane")
def test_percent_encoded_paths_are_served_as_decoded() -> None:
    """As the Python plane (aiohttp) routes them; the native plane answered 404. An escaped
    ``/`` stays part of its segment on both."""

    async def body() -> None:
        async with rig(engines=1) as r:
            completion = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            for path in ("/v1/%63ompletions", "/%76%31/completions"):
                status, text = await raw_request(r, completion, path=path)
                assert status == 200, (path, text)
                assert json.loads(text)["choices"]
            async with r.client.get(r.url("/%68ealth")) as response:
                assert response.status == 200
            for path in (
                "/v1/%ZZcompletions",
                "/v1/%+fcompletions",
                "/v1/%ffcompletions",
                "/v1%2Fcompletions",
                "/v1/chat/../completions",
            ):
                status, _ = await raw_request(r, completion, path=path)
                assert status == 404, path
            assert len(r.engines[0].received) == 2

    run(body())


@pytest.mark.usefixtures("plane")
def test_priority_header_takes_ascii_integers_only() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            for good in ("5", "+5", "-3", "007"):
                response = await r.complete("hi", headers={"x-llmsched-priority": good})
                assert response.status == 200, good
            for bad in ("5_0", "\u0665", "1\u0660", "5.0", "0x5"):
                response = await r.complete("hi", headers={"x-llmsched-priority": bad})
                assert response.status == 400, bad
                error = (await response.json())["error"]
                assert error["param"] == "x-llmsched-priority"

    run(body())


@pytest.mark.usefixtures("plane")
def test_nan_and_infinity_are_not_json() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            for literal in ("NaN", "Infinity", "-Infinity"):
                data = f'{{"model": "{MODEL}", "prompt": "hi", "temperature": {literal}}}'
                status, text = await raw_request(r, data.encode())
                assert status == 400, (literal, text)
                assert json.loads(text)["error"]["message"] == "the body is not valid JSON"

    run(body())


MALFORMED_MESSAGES = {
    "content 5": ([{"role": "user", "content": 5}], "messages[0].content must be a string or"),
    "no role": ([{"content": "hi"}], "messages[0] must be an object with a string role"),
    "text part 5": (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}],
        "messages[0]['content'][1]['text'] must be a str",
    ),
}


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("case", MALFORMED_MESSAGES)
def test_malformed_messages_are_400_on_both_planes_without_a_tokenizer(case: str) -> None:
    """Probe 60: without a tokenizer the native plane forwarded these (200) where the Python
    plane answered 400, the text part's with Python's bare "sequence item 0: expected str
    instance, int found"."""
    messages, problem = MALFORMED_MESSAGES[case]

    async def body() -> None:
        async with rig(engines=1) as r:
            data = json.dumps({"model": MODEL, "messages": messages}).encode()
            status, text = await raw_request(r, data, path="/v1/chat/completions")
            assert status == 400, text
            assert json.loads(text)["error"]["message"].startswith(problem)
            assert r.engines[0].received == []

    run(body())


@pytest.mark.usefixtures("plane")
def test_a_long_prompt_being_tokenized_holds_no_other_request(tmp_path: Path) -> None:
    """A prompt of megabytes takes the tokenizer a second or so: it is tokenized off the
    thread (or event loop) serving the others, so a short request sent meanwhile is answered
    first (it waited for the long one's tokenizing before)."""
    directory = write_tokenizer(tmp_path / "tok")

    async def body() -> None:
        async with rig(
            engines=1, tokenizer=str(directory), limits={"max_body_bytes": 8 << 20}
        ) as r:
            finished: list[str] = []

            async def send(name: str, prompt: str) -> None:
                request = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                data = io.BytesIO(json.dumps(request).encode())
                headers = {"Content-Type": "application/json"}
                url = r.url("/v1/completions")
                async with r.client.post(url, data=data, headers=headers) as response:
                    assert response.status == 200, await response.text()
                finished.append(name)

            long = asyncio.ensure_future(send("long", "a" * 3_000_000))
            await asyncio.sleep(0.1)
            await send("short", "hello")
            await long
            assert finished == ["short", "long"]

    run(body())


@pytest.mark.usefixtures("plane")
def test_head_reads_what_get_reads_without_a_body() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            for path in ("/health", "/ready", "/v1/models", "/metrics"):
                async with r.client.head(r.url(path)) as response:
                    assert response.status == 200, path
                    assert await response.read() == b""
                async with r.client.get(r.url(path)) as response:
                    assert response.status == 200 and await response.read(), path

    run(body())


@pytest.mark.usefixtures("plane")
def test_a_request_the_engine_refuses_leaves_no_prefix_record() -> None:
    """An engine's 4xx (a request too long for its context, say) caches nothing: the blocks the
    gateway recorded for the request on that engine go, so the next request sharing the
    prefix is not drawn to a cache that does not exist."""
    tokens = list(range(100, 116))  # four blocks of 4

    async def body() -> None:
        async with rig(engines=2) as r:
            index = r.gateway.index
            response = await r.complete(tokens, max_tokens=1, x_fake_mode="error400")
            assert response.status == 400
            assert index.match_tokens(tokens).as_dict() == {}
            response = await r.complete(tokens, max_tokens=1)
            assert response.status == 200
            assert max(index.match_tokens(tokens).as_dict().values()) == 4

    run(body())


@pytest.mark.usefixtures("plane")
def test_lora_routing_reads_the_adapters_engines_report() -> None:
    """The adapters each engine runs (``vllm:lora_requests_info``, scraped) reach the LoRA
    scorer on both planes: a request for an adapter goes to the engine running it. (The
    native plane parsed them and left them unused, so its LoRA plugins saw none.)"""
    router = {
        "plugins": [{"type": "lora-affinity-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "lora-affinity-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }

    async def body() -> None:
        async with rig(
            engines=3,
            router=router,
            lora_adapters={"sql": MODEL},
            scrape={"enabled": True, "interval_s": 0.05},
        ) as r:
            for engine in r.engines:
                engine.loras = ([], [], 1)
            r.engines[2].loras = (["sql"], [], 1)
            await asyncio.sleep(0.5)
            for _ in range(4):
                response = await r.complete("hello", max_tokens=1, model="sql")
                assert response.status == 200
            assert len(r.engines[2].received) == 4, [len(e.received) for e in r.engines]

    run(body())


@pytest.mark.usefixtures("plane")
def test_an_engine_set_with_a_url_the_native_plane_refuses_changes_nothing() -> None:
    """What discovery calls: on the native plane the shared pool took the set before the
    Rust upstream set refused the URL, which left the two apart and every later change
    failing."""
    from llmsched.errors import ConfigError
    from llmsched.integrations import EngineSpec

    async def body() -> None:
        async with rig(engines=2) as r:
            good = [EngineSpec(**e.spec()) for e in r.engines]
            with pytest.raises(ConfigError, match="is not an http:// URL"):
                await r.gateway.set_engines([*good, EngineSpec(host="\u00e9\u00e9", port=1)])
            present = sorted(str(e["id"]) for e in r.gateway.pool.endpoints())
            assert present == sorted(s.worker_id for s in good)
            added, removed = await r.gateway.set_engines(good[:1])
            assert (added, removed) == ([], [good[1].worker_id])
            response = await r.complete("hello", max_tokens=1)
            assert response.status == 200

    run(body())
