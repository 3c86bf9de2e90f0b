"""`llmsched serve` in front of a real vLLM engine started with options that change which
blocks its cache holds: a LoRA adapter (vLLM keys the adapter's blocks by its name and says
so in its KV events), `--chat-template` and `--default-chat-template-kwargs` (they change
every chat's token ids). The gateway, told the same (`lora_adapters`, `chat_template`,
`default_chat_template_kwargs`), routes on the ids and blocks the engine computes."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _chat_kwargs import KWARGS_CASES, KWARGS_DEFAULTS, KWARGS_TEMPLATE

from .gateway_thread import GatewayThread, gateway_config
from .vllm_engine import (
    BLOCK_SIZE,
    MODEL_NAME,
    TINY_MODEL_SCRIPT,
    VllmEngine,
    scaled,
    start_engines,
)
from .vllm_interpreter import VllmInterpreter

ADAPTER = "sql"
VOCAB = 512


@pytest.fixture(scope="module")
def lora_engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, vllm_interpreter: VllmInterpreter
) -> Iterator[VllmEngine]:
    """One engine serving the tiny model and a random LoRA adapter of it, with its own chat
    template and default template kwargs."""
    adapter = tmp_path_factory.mktemp("lora-adapter")
    vllm_interpreter.run_script(TINY_MODEL_SCRIPT, [str(adapter), "--lora-of", str(tiny_model)])
    logs = tmp_path_factory.mktemp("lora-engine-logs")
    template = logs / "template.jinja"
    template.write_text(KWARGS_TEMPLATE)
    engine = VllmEngine(
        tiny_model,
        "lora",
        logs / "lora.log",
        extra_args=(
            "--enable-lora",
            "--lora-modules",
            f"{ADAPTER}={adapter}",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "1",
            "--chat-template",
            str(template),
            "--default-chat-template-kwargs",
            json.dumps(KWARGS_DEFAULTS),
            # A tool choice of "auto" renders the tools; "none" leaves them out.
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
            "--exclude-tools-when-tool-choice-none",
        ),
    )
    start_engines([engine])
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def gateway(lora_engine: VllmEngine, tiny_model: Path) -> Iterator[GatewayThread]:
    config = gateway_config(
        [lora_engine],
        str(tiny_model),
        lora_adapters={ADAPTER: MODEL_NAME},
        chat_template=KWARGS_TEMPLATE,
        default_chat_template_kwargs=KWARGS_DEFAULTS,
        exclude_tools_when_tool_choice_none=True,
    )
    runner = GatewayThread(config)
    try:
        yield runner
    finally:
        runner.stop()


def held(gateway: GatewayThread, prompt: list[int], lora: str | None) -> int:
    """Blocks of ``prompt`` the gateway's index says the engine holds, under ``lora``."""
    index = gateway.gateway.index
    worker = gateway.gateway.config.engines[0].worker_id
    matched = index.match_tokens(np.asarray(prompt, dtype=np.uint32), lora=lora).as_dict()
    return int(matched.get(worker, 0))


def test_adapter_requests_route_on_the_blocks_vllm_keys_by_the_adapter(
    lora_engine: VllmEngine, gateway: GatewayThread
) -> None:
    rng = random.Random(21)
    prompt = [rng.randrange(5, VOCAB) for _ in range(4 * BLOCK_SIZE + 7)]
    full = len(prompt) // BLOCK_SIZE

    def send(model: str, tokens: list[int]) -> float:
        """Sends a completion through the gateway; the engine's prefix-cache hits (tokens)."""
        before = lora_engine.metric("vllm:prefix_cache_hits_total")
        body = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0}
        status, _, answer = gateway.post("/v1/completions", body)
        assert status == 200, answer
        return lora_engine.metric("vllm:prefix_cache_hits_total") - before

    assert send(ADAPTER, prompt) == 0
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and held(gateway, prompt, ADAPTER) < full:
        time.sleep(0.05)
    assert held(gateway, prompt, ADAPTER) == full
    # Neither the gateway's record nor the engine's events put the adapter's blocks under
    # the base model.
    time.sleep(0.5)
    assert held(gateway, prompt, None) == 0
    counters = gateway.gateway.index.stats()
    assert counters["blocks"] >= full, counters
    # The engine's hits are what the index predicted, under each name.
    longer = prompt[: 3 * BLOCK_SIZE] + [rng.randrange(5, VOCAB) for _ in range(BLOCK_SIZE)]
    predicted = min(held(gateway, longer, ADAPTER), (len(longer) - 1) // BLOCK_SIZE)
    assert predicted == 3
    assert send(ADAPTER, longer) == predicted * BLOCK_SIZE
    assert held(gateway, prompt, None) == 0
    assert send(MODEL_NAME, prompt) == 0  # the base model shares none of the adapter's blocks
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and held(gateway, prompt, None) < full:
        time.sleep(0.05)
    assert send(MODEL_NAME, prompt) == min(full, (len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE


def test_chats_route_on_the_engine_s_template_and_default_kwargs(
    lora_engine: VllmEngine, gateway: GatewayThread
) -> None:
    """The engine's own prompt ids (``return_token_ids``) for chats whose kwargs, fields and
    the engine's defaults meet in every way ``_chat_kwargs.KWARGS_CASES`` lists, against the
    ids the gateway routes on."""
    messages = [{"role": "user", "content": "hello there, how is the cache"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools: list[dict[str, Any]] = [
        {"tools": [tool]},
        {"tools": [tool], "tool_choice": "auto", "chat_template_kwargs": {"mode": "auto"}},
        {"tools": [tool], "tool_choice": "none"},
    ]
    for fields in [case for case, _ in KWARGS_CASES] + with_tools:
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 1,
            "return_token_ids": True,
            **fields,
        }
        engine_side = lora_engine.post("/v1/chat/completions", body)["prompt_token_ids"]
        assert gateway.chat_request_tokens(body) == engine_side, fields


def test_salted_blocks_from_the_engine_s_events_match_salted_requests(
    lora_engine: VllmEngine, gateway: GatewayThread
) -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block and says so in its KV
    events (the block's extra keys, beside the adapter's name): the index keeps such chains
    under the salt, so a request with that salt (and adapter) matches them and no other
    does. The requests go to the engine directly: only its events fill the gateway's index."""
    rng = random.Random(33)
    index = gateway.gateway.index
    worker = gateway.gateway.config.engines[0].worker_id

    def blocks(prompt: list[int], **namespace: str) -> int:
        found = index.match_tokens(np.asarray(prompt, dtype=np.uint32), **namespace).as_dict()
        return int(found.get(worker, 0))

    for model, lora in ((MODEL_NAME, None), (ADAPTER, ADAPTER)):
        prompt = [rng.randrange(5, VOCAB) for _ in range(3 * BLOCK_SIZE + 5)]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
        lora_engine.post("/v1/completions", body)
        salted = {"cache_salt": "tenant-a", **({"lora": lora} if lora else {})}
        deadline = time.monotonic() + scaled(20)
        while time.monotonic() < deadline and blocks(prompt, **salted) < 3:
            time.sleep(0.05)
        assert blocks(prompt, **salted) == 3, (model, index.stats())
        assert blocks(prompt) == 0 and blocks(prompt, cache_salt="tenant-b") == 0
        if lora:
            assert blocks(prompt, lora=lora) == 0
        # The engine hits what the index predicts for the salted request, through the gateway.
        before = lora_engine.metric("vllm:prefix_cache_hits_total")
        status, _, answer = gateway.post("/v1/completions", {**body, "temperature": 0})
        assert status == 200, answer
        assert lora_engine.metric("vllm:prefix_cache_hits_total") - before == 3 * BLOCK_SIZE


def test_the_model_check_reads_the_engine_s_adapter_listing(
    lora_engine: VllmEngine, gateway: GatewayThread
) -> None:
    """The gateway's model check reads the engine's ``/v1/models`` (the adapter listed with
    its base model as ``parent``): the gateway told the truth finds nothing; a config that
    lists the adapter under ``models`` is found out from the same listing."""
    from llmsched.gateway.engine_models import EngineModelCheck

    check = gateway.gateway.model_check
    worker = gateway.gateway.config.engines[0].worker_id
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline and check.served(worker) is None:
        time.sleep(0.05)
    assert check.served(worker) == {MODEL_NAME: None, ADAPTER: MODEL_NAME}
    assert check.findings() == []
    with urllib.request.urlopen(lora_engine.base_url + "/v1/models", timeout=10) as reply:
        listing = json.loads(reply.read())
    wrong = EngineModelCheck([MODEL_NAME, ADAPTER], {})
    (finding,) = wrong.check(worker, frozenset([MODEL_NAME]), listing)
    assert (finding.kind, finding.name) == ("adapter_listed_as_model", ADAPTER)
