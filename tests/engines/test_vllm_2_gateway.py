"""`llmsched serve`'s gateway in front of two real vLLM engines."""

from __future__ import annotations

import http.client
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmsched.gateway.responses import chat_request_of

from .gateway_thread import GatewayThread, gateway_config
from .vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, scaled

WORDS = ("the", "cache", "prefix", "token", "route", "engine", "queue", "batch", "memory", "block")


@pytest.fixture(scope="module")
def gateway(engines: list[VllmEngine], tiny_model: Path) -> Iterator[GatewayThread]:
    runner = GatewayThread(gateway_config(engines, str(tiny_model)))
    try:
        yield runner
    finally:
        runner.stop()


def queries(engines: list[VllmEngine]) -> list[float]:
    return [e.metric("vllm:prefix_cache_queries_total") for e in engines]


def hits(engines: list[VllmEngine]) -> list[float]:
    return [e.metric("vllm:prefix_cache_hits_total") for e in engines]


def served_by(before: list[float], after: list[float]) -> int:
    """Which engine took the (only) request sent between two readings."""
    grew = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    assert len(grew) == 1, f"expected one engine to serve the request, saw {grew}"
    return grew[0]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_started_gateway_learns_the_engines_caches(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """The engines served requests before this gateway existed (the index tests); without a
    single request through it, its subscriber catches up from their replay sockets."""
    index = gateway.gateway.index
    workers = [spec.worker_id for spec in gateway.gateway.config.engines]

    def known() -> bool:
        held = index.workers()
        return all(w in held and index.holdings(w) for w in workers)

    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and not known():
        time.sleep(0.1)
    subscriber = gateway.gateway.scheduler.subscriber
    assert known(), f"the gateway's index knows {index.workers()}; its subscriber: " + (
        "none" if subscriber is None else str(subscriber.counters())
    )
    conn = gateway.connection()
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    catch_ups = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("llmsched_gateway_kv_events") and 'counter="catch_ups"' in line
    ]
    assert catch_ups and catch_ups[0] >= len(workers), catch_ups


def test_gateway_tokens_equal_the_engine_tokens(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """Routing is only as good as the tokens it hashes: the gateway's must be the engine's."""
    rng = random.Random(3)
    for _ in range(5):
        messages = [
            {"role": "system", "content": sentence(rng, 12)},
            {"role": "user", "content": sentence(rng, 30)},
        ]
        engine_side = engines[0].post("/tokenize", {"model": MODEL_NAME, "messages": messages})
        assert gateway.chat_tokens(messages) == engine_side["tokens"]
        prompt = sentence(rng, 40)
        engine_side = engines[0].post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})
        assert gateway.completion_tokens(prompt) == engine_side["tokens"]
        body = {"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": False}
        engine_side = engines[0].post("/tokenize", body)
        assert gateway.completion_request_tokens(body) == engine_side["tokens"]
    # List contents as vLLM joins them: text-like parts, empty ones skipped, a null content.
    messages = [
        {"role": "system", "content": [{"type": "text", "text": sentence(rng, 12)}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": sentence(rng, 8)},
                {"type": "text", "text": ""},
                {"type": "input_text", "text": sentence(rng, 8)},
            ],
        },
        {"role": "assistant", "content": [{"type": "refusal", "refusal": sentence(rng, 4)}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": sentence(rng, 6)},
    ]
    engine_side = engines[0].post("/tokenize", {"model": MODEL_NAME, "messages": messages})
    assert gateway.chat_tokens(messages) == engine_side["tokens"]
    # What vLLM builds of the messages: a developer message (the template never names that
    # role) merged into the system message, Claude Code's billing line dropped, fields
    # vLLM does not pass on left out.
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\n" + sentence(rng, 8)},
        {"role": "user", "content": sentence(rng, 8), "metadata": {"a": 1}},
        {"role": "developer", "content": sentence(rng, 6)},
        {"role": "assistant", "content": sentence(rng, 4), "reasoning": sentence(rng, 3)},
        {"role": "user", "content": sentence(rng, 6), "name": "ann"},
    ]
    engine_side = engines[0].post("/tokenize", {"model": MODEL_NAME, "messages": messages})
    assert gateway.chat_tokens(messages) == engine_side["tokens"]
    # The request's own fields: no generation prompt, the final message continued, the
    # tokenizer's special tokens added, a kwarg that the request's own field overrides.
    messages = [
        {"role": "user", "content": sentence(rng, 8)},
        {"role": "assistant", "content": sentence(rng, 5) + "  "},
    ]
    for fields in (
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"add_generation_prompt": False}},
    ):
        body = {"model": MODEL_NAME, "messages": messages, **fields}
        engine_side = engines[0].post("/tokenize", body)
        assert gateway.chat_request_tokens(body) == engine_side["tokens"], fields


def test_gateway_tokens_are_truncated_as_the_engine_truncates_them(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """``truncate_prompt_tokens`` makes the engine keep part of the prompt (the last ids,
    unless ``truncation_side`` is ``right``), and it caches the blocks of what it kept: the
    gateway routes on the same ids. The engine's own prompt ids (``return_token_ids``) are the
    oracle, for text prompts with and without special tokens (the tokenizer keeps its BOS when
    no side is named), prompts of ids, and chats."""
    rng = random.Random(11)
    prompt = sentence(rng, 60)
    whole = gateway.completion_tokens(prompt)
    cases: list[dict[str, Any]] = []
    for keep in (1, 2, 17, len(whole) - 1, len(whole), len(whole) + 4, -1):
        for side in (None, "left", "right"):
            for add in (True, False):
                cases.append(
                    {"prompt": prompt, "add_special_tokens": add, "keep": keep, "side": side}
                )
    cases.append({"prompt": whole[1:], "keep": 20, "side": None})
    cases.append({"prompt": whole[1:], "keep": 20, "side": "right"})
    for case in cases:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "prompt": case["prompt"],
            "max_tokens": 1,
            "return_token_ids": True,
            "truncate_prompt_tokens": case["keep"],
        }
        if "add_special_tokens" in case:
            body["add_special_tokens"] = case["add_special_tokens"]
        if case["side"] is not None:
            body["truncation_side"] = case["side"]
        engine_side = engines[0].post("/v1/completions", body)["choices"][0]["prompt_token_ids"]
        assert gateway.completion_request_tokens(body) == engine_side, case
    messages = [
        {"role": "system", "content": sentence(rng, 30)},
        {"role": "user", "content": sentence(rng, 20)},
    ]
    for fields in (
        {"truncate_prompt_tokens": 25},
        {"truncate_prompt_tokens": 25, "truncation_side": "right"},
        {"truncate_prompt_tokens": 25, "add_special_tokens": True},
    ):
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 1,
            "return_token_ids": True,
            **fields,
        }
        engine_side = engines[0].post("/v1/chat/completions", body)["prompt_token_ids"]
        assert gateway.chat_request_tokens(body) == engine_side, fields


def test_minus_one_truncation_keeps_what_the_engine_keeps_past_its_context(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """``truncate_prompt_tokens: -1`` on a prompt longer than the engine's context: vLLM keeps
    ``max_model_len - 1`` ids; the gateway learns the context from the engine's
    ``/v1/models`` and routes on the same ids."""
    check = gateway.gateway.model_check
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and check.context_length() is None:
        time.sleep(0.05)
    context = engines[0].max_model_len
    assert check.context_length() == context
    rng = random.Random(13)
    prompt = sentence(rng, context + 200)
    assert len(gateway.completion_tokens(prompt)) > context
    for side in (None, "left", "right"):
        for add in (True, False):
            body: dict[str, Any] = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 1,
                "return_token_ids": True,
                "truncate_prompt_tokens": -1,
                "add_special_tokens": add,
            }
            if side is not None:
                body["truncation_side"] = side
            answer = engines[0].post("/v1/completions", body)
            engine_side = answer["choices"][0]["prompt_token_ids"]
            assert len(engine_side) == context - 1, (side, add)
            assert gateway.completion_request_tokens(body) == engine_side, (side, add)


def test_conversations_return_to_the_engine_holding_their_prefix(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """Multi-turn chats through the gateway: every later turn lands on the engine that served
    the first, and before each turn the gateway's index predicts exactly the prompt tokens that
    engine then reports as prefix-cache hits."""
    index = gateway.gateway.index
    rng = random.Random(5)
    homes: dict[int, int] = {}
    turns_checked = 0
    conversations: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"conversation {c}: " + sentence(rng, 40)}] for c in range(6)
    ]
    for turn in range(3):
        for c, messages in enumerate(conversations):
            messages.append({"role": "user", "content": sentence(rng, 25)})
            tokens = gateway.chat_tokens(messages)
            cached = index.match_tokens(np.asarray(tokens, dtype=np.uint32)).as_dict()
            before_q, before_h = queries(engines), hits(engines)
            status, _, body = gateway.post(
                "/v1/chat/completions",
                {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0},
            )
            assert status == 200, body
            served = served_by(before_q, queries(engines))
            hit = hits(engines)[served] - before_h[served]
            worker = gateway.gateway.config.engines[served].worker_id
            predicted = min(cached.get(worker, 0), (len(tokens) - 1) // BLOCK_SIZE) * BLOCK_SIZE
            assert hit == predicted, (
                f"conversation {c} turn {turn}: hit {hit}, index said {predicted}"
            )
            if turn == 0:
                homes[c] = served
            else:
                assert served == homes[c], f"conversation {c} moved at turn {turn}"
                assert hit > 0
                turns_checked += 1
            answer = json.loads(body)["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            time.sleep(0.3)  # let the engine's KV events for this turn reach the index
    assert turns_checked == 12


def test_responses_conversations_stay_on_the_engine_holding_them(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """The Responses API through the gateway. A new conversation routes by the chat prompt
    vLLM makes of it: the engine's prompt is as long as the gateway's, and it lands on the
    engine holding its prefix with the prefix-cache hits the index predicted. Each later turn
    (``previous_response_id``) goes to the engine that stored the previous response (any other
    answers 404), as does a GET of it."""
    index = gateway.gateway.index
    rng = random.Random(11)
    for c in range(5):
        system, first = f"responses {c}: " + sentence(rng, 40), sentence(rng, 20)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        status, _, body = gateway.post(
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0},
        )
        assert status == 200, body
        answer = json.loads(body)["choices"][0]["message"]["content"]
        time.sleep(0.3)  # the engine's KV events reach the index
        request = {
            "model": MODEL_NAME,
            "instructions": system,
            "input": [
                {"type": "message", "role": "user", "content": first},
                {"type": "message", "role": "assistant", "content": answer},
                {"role": "user", "content": [{"type": "input_text", "text": sentence(rng, 9)}]},
            ],
            "max_output_tokens": 4,
            "temperature": 0,
        }
        chat = chat_request_of(request)
        assert chat is not None
        tokens = gateway.chat_request_tokens(chat)
        cached = index.match_tokens(np.asarray(tokens, dtype=np.uint32)).as_dict()
        home = max(cached, key=lambda w: cached[w])
        before_q, before_h = queries(engines), hits(engines)
        status, _, body = gateway.post("/v1/responses", request)
        assert status == 200, body
        made = json.loads(body)
        assert made["usage"]["input_tokens"] == len(tokens)
        served = served_by(before_q, queries(engines))
        assert gateway.gateway.config.engines[served].worker_id == home, f"conversation {c}"
        predicted = min(cached[home], (len(tokens) - 1) // BLOCK_SIZE) * BLOCK_SIZE
        assert hits(engines)[served] - before_h[served] == predicted
        for turn in range(2):
            before_q = queries(engines)
            status, _, body = gateway.post(
                "/v1/responses",
                {
                    "model": MODEL_NAME,
                    "input": sentence(rng, 8),
                    "previous_response_id": made["id"],
                    "max_output_tokens": 4,
                    "stream": turn == 1,
                },
            )
            assert status == 200, body
            assert served_by(before_q, queries(engines)) == served, f"{c}: turn {turn} moved"
            if turn == 0:
                made = json.loads(body)
        conn = gateway.connection()
        try:
            conn.request("GET", f"/v1/responses/{made['id']}")
            reply = conn.getresponse()
            assert (reply.status, json.loads(reply.read())["id"]) == (200, made["id"])
        finally:
            conn.close()


LONG_TOKENS = 1900  # about 4 s of generation for the tiny model on two cores


def running(engines: list[VllmEngine]) -> float:
    return sum(e.metric("vllm:num_requests_running") for e in engines)


def finished_whole(engines: list[VllmEngine]) -> float:
    """Requests the engines ran to their token limit (none of them aborted)."""
    return sum(e.metric("vllm:request_success_total", finished_reason="length") for e in engines)


def engine_lines(engines: list[VllmEngine], request_id: str) -> list[str]:
    """The engines' log lines naming ``request_id``."""
    return [
        line
        for engine in engines
        for line in engine.log_path.read_text(errors="replace").splitlines()
        if request_id in line
    ]


def gone_counts(gateway: GatewayThread) -> list[str]:
    """The gateway's ``/metrics`` lines counting requests whose client left."""
    conn = gateway.connection()
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [line for line in text.splitlines() if "client_gone" in line or "disconnect" in line]


def hang_up_after_first_chunk(gateway: GatewayThread) -> str:
    """Streams a long completion through the gateway, reads its first chunk and hangs up;
    returns the request id the engine gave it."""
    conn = gateway.connection()
    body = {
        "model": MODEL_NAME,
        "prompt": "the cache prefix token",
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200
    first = reply.readline()
    assert first.startswith(b"data: "), first
    request_id: str = json.loads(first[len(b"data: ") :])["id"]
    conn.close()
    return request_id


def test_cancelled_client_request_is_cancelled_upstream(
    engines: list[VllmEngine], gateway: GatewayThread
) -> None:
    """A streaming client that hangs up after the first chunk makes the engine abort the
    request (its log names the aborted id) and go idle.

    On two busy cores a vLLM API server sometimes hands out its first chunk only after the
    engine core finished, and then streams the whole answer into the sockets' buffers before
    the client hangs up: the engine counts that request as run to its limit, so nothing was
    left to abort, and the attempt proves nothing. Such an attempt is made again (at most
    three); a request that neither finished nor was aborted fails the test."""
    for attempt in range(3):
        whole_before = finished_whole(engines)
        request_id = hang_up_after_first_chunk(gateway)

        def aborted(request_id: str = request_id) -> bool:
            return any("Aborted request" in line for line in engine_lines(engines, request_id))

        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline and not aborted():
            if finished_whole(engines) > whole_before and running(engines) == 0:
                break
            time.sleep(0.2)
        if aborted():
            break
        assert finished_whole(engines) > whole_before, (
            f"no engine logged the abort of {request_id}, nor finished it: "
            f"{engine_lines(engines, request_id)[-5:]}; the gateway: {gone_counts(gateway)}"
        )
        print(f"attempt {attempt}: {request_id} ran to its limit before the client hung up")
    else:
        raise AssertionError("three attempts ran to their limit before the client hung up")
    while time.monotonic() < deadline and running(engines) > 0:
        time.sleep(0.1)
    assert running(engines) == 0


def test_scraper_reads_the_engines_load(engines: list[VllmEngine], gateway: GatewayThread) -> None:
    """The gateway's metrics scraper turns a real engine's `/metrics` into pool metrics: a
    request running on engine 0 shows up as running there, with KV cache in use.

    On two busy cores a vLLM API server sometimes sends its first chunk only after the engine
    finished, and a request can end between two scrapes; an attempt whose request the engine
    itself no longer reports running, before the pool saw it, is tried again (3 at most)."""
    pool = gateway.gateway.pool
    worker = gateway.gateway.config.engines[0].worker_id

    def row() -> dict[str, Any]:
        return next(e for e in pool.endpoints() if e["id"] == worker)

    busy: dict[str, Any] = {}
    for attempt in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", engines[0].port, timeout=scaled(60))
        body = {
            "model": MODEL_NAME,
            "prompt": f"the memory block replica {attempt}",
            "max_tokens": LONG_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        reply = conn.getresponse()
        assert reply.status == 200
        assert reply.readline().startswith(b"data: ")
        deadline = time.monotonic() + scaled(20)
        engine_ran = False
        while time.monotonic() < deadline and not busy:
            seen = row()
            if seen["running"] == 1 and seen["kv_cache_usage"] > 0:
                busy = seen
            elif engines[0].metric("vllm:num_requests_running") > 0:
                engine_ran = True
            elif engine_ran:
                break  # it ran and ended on the engine between two scrapes: try again
            time.sleep(0.05)
        conn.close()
        if busy:
            break
        while running(engines) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert busy, f"the scraper never showed a request running: {row()}"
    assert busy["waiting"] == 0
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and row()["running"] != 0:
        time.sleep(0.1)
    assert row()["running"] == 0
