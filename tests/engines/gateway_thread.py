"""Run ``llmsched serve``'s gateway (the config's data plane: native by default) on its own event
loop thread, for synchronous tests."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

# Imported here, on the main thread: the gateway would otherwise import the integrations from
# its loop thread while pytest compiles test modules, which trips a CPython 3.11 AST race.
import llmsched.integrations  # noqa: F401
from llmsched import _llmsched
from llmsched.gateway import Gateway, NativeGateway, make_gateway

from .vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, scaled

T = TypeVar("T")


def engine_entry(engine: VllmEngine) -> dict[str, Any]:
    """The gateway config entry of a real engine (the subscriber binds; the engine connects)."""
    return {
        "host": "127.0.0.1",
        "port": engine.port,
        "model": MODEL_NAME,
        "kv_events": engine.kv_events_endpoint,
        "kv_events_bind": True,
        "replay": engine.replay_endpoint,
        "topic": engine.topic,
    }


def gateway_config(engines: list[VllmEngine], tokenizer: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [MODEL_NAME],
        "block_size": BLOCK_SIZE,
        "tokenizer": tokenizer,
        "engines": [engine_entry(e) for e in engines],
        "router": "llm-d",
    }
    config.update(extra)
    return config


class GatewayThread:
    """A started gateway whose loop runs on a daemon thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway: Gateway | NativeGateway = self.call(self._make(config))
        self.call(self.gateway.start())
        tokenizer = self.gateway.config.tokenizer
        # The ids the native plane routes on come from its own tokenizer.
        config = self.gateway.config
        defaults = config.default_chat_template_kwargs
        self._native_tokenizers: dict[int | None, _llmsched.NativePromptTokenizer] = {}
        self._native_options: dict[str, Any] | None = (
            {
                "directory": str(tokenizer),
                "chat_template": config.chat_template,
                "default_chat_template_kwargs": json.dumps(defaults) if defaults else None,
                "exclude_tools_when_tool_choice_none": config.exclude_tools_when_tool_choice_none,
            }
            if isinstance(self.gateway, NativeGateway) and tokenizer is not None
            else None
        )

    @property
    def _native_tokenizer(self) -> _llmsched.NativePromptTokenizer | None:
        """The native plane's tokenizer as the gateway has it now (the engines' context length
        it learned included)."""
        if self._native_options is None:
            return None
        context = self.gateway.model_check.context_length()
        if context not in self._native_tokenizers:
            self._native_tokenizers[context] = _llmsched.NativePromptTokenizer(
                **self._native_options, max_model_len=context
            )
        return self._native_tokenizers[context]

    @staticmethod
    async def _make(config: dict[str, Any]) -> Gateway | NativeGateway:
        return make_gateway(config)  # built inside the loop: aiohttp objects bind to it

    def chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids the gateway routes a chat on."""
        if self._native_tokenizer is not None:
            return self._native_tokenizer.chat_tokens(json.dumps({"messages": messages}))
        assert isinstance(self.gateway, Gateway) and self.gateway.tokenizer is not None
        return self.gateway.tokenizer.chat_tokens(messages)

    def chat_request_tokens(self, body: dict[str, Any]) -> list[int]:
        """The token ids the gateway routes a chat request body on."""
        if self._native_tokenizer is not None:
            return self._native_tokenizer.chat_tokens(json.dumps(body))
        assert isinstance(self.gateway, Gateway) and self.gateway.tokenizer is not None
        return self.gateway.tokenizer.chat_request_tokens(body)

    def completion_request_tokens(self, body: dict[str, Any]) -> list[int]:
        """The token ids the gateway routes a completions request body on."""
        if self._native_tokenizer is not None:
            return self._native_tokenizer.completion_tokens(json.dumps(body))
        assert isinstance(self.gateway, Gateway) and self.gateway.tokenizer is not None
        add = body.get("add_special_tokens")
        return self.gateway.tokenizer.completion_tokens(
            body["prompt"],
            add is not False,
            body.get("truncate_prompt_tokens"),
            body.get("truncation_side"),
        )

    def completion_tokens(self, prompt: str) -> list[int]:
        """The token ids the gateway routes a completion prompt on."""
        if self._native_tokenizer is not None:
            return self._native_tokenizer.completion_tokens(json.dumps({"prompt": prompt}))
        assert isinstance(self.gateway, Gateway) and self.gateway.tokenizer is not None
        return self.gateway.tokenizer.completion_tokens(prompt)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(scaled(timeout_s))

    def stop(self) -> None:
        self.call(self.gateway.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def connection(self, timeout_s: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=scaled(timeout_s))

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        conn = self.connection()
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            reply = conn.getresponse()
            return reply.status, dict(reply.getheaders()), reply.read()
        finally:
            conn.close()
