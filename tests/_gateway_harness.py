"""Shared set-up of the gateway tests: fake engines on loopback and a gateway in front."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from llmsched.gateway import Gateway
from llmsched.testing.openai_engine import FakeOpenAIEngine

T = TypeVar("T")
MODEL = "tiny"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs one test coroutine on a fresh event loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


@dataclass
class Rig:
    gateway: Gateway
    engines: list[FakeOpenAIEngine]
    client: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return self.gateway.url + path

    async def complete(
        self, prompt: Any, *, headers: dict[str, str] | None = None, **fields: Any
    ) -> aiohttp.ClientResponse:
        """POSTs a completion; the response is read (``await r.read()`` returns it)."""
        body = {"model": MODEL, "prompt": prompt, **fields}
        response = await self.client.post(self.url("/v1/completions"), json=body, headers=headers)
        await response.read()
        return response

    def engine_of_request(self, index: int = -1) -> FakeOpenAIEngine:
        """The engine that received the request ``index`` counted over all engines, in
        arrival order."""
        received = sorted(
            ((r.received_at, e) for e in self.engines for r in e.received), key=lambda x: x[0]
        )
        return received[index][1]

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the gateway's metrics (0 when absent)."""
        text = self.gateway.metrics.render().decode()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:]+)(?:\{(.*)\})? (\S+)$", line)
            if (
                m
                and m.group(1) == name
                and ",".join(sorted((m.group(2) or "").split(","))) == (wanted)
            ):
                return float(m.group(3))
        return 0.0


@contextlib.asynccontextmanager
async def rig(
    engines: int = 2,
    *,
    answer_tokens: int = 4,
    engine_fields: list[dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """``engines`` fake engines and a gateway in front (scraping off unless overridden).
    ``engine_fields``: extra keys of each engine's config entry (e.g. its role)."""
    fakes = [FakeOpenAIEngine(model=MODEL, answer_tokens=answer_tokens) for _ in range(engines)]
    for fake in fakes:
        await fake.start()
    config: dict[str, Any] = {
        "engines": [
            {**f.spec(), **(engine_fields[i] if engine_fields else {})} for i, f in enumerate(fakes)
        ],
        "models": [MODEL],
        "block_size": 4,
        "listen": {"port": 0},
        "scrape": {"enabled": False},
    }
    config.update(overrides)
    gateway = Gateway(config)
    await gateway.start()
    client = aiohttp.ClientSession()
    try:
        yield Rig(gateway, fakes, client)
    finally:
        await client.close()
        await gateway.stop()
        for fake in fakes:
            await fake.stop()
