"""Token slices through `llmsched serve` in front of real vLLM engines: a sliced answer is the
engine's unsliced answer (greedy decoding)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .gateway_thread import GatewayThread, gateway_config
from .vllm_engine import MODEL_NAME, VllmEngine

SLICES = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 4}}


@pytest.fixture(scope="module")
def sliced(engines: list[VllmEngine], tiny_model: Path) -> Iterator[GatewayThread]:
    runner = GatewayThread(gateway_config(engines, str(tiny_model), slices=SLICES))
    try:
        yield runner
    finally:
        runner.stop()


def _answer(body: dict[str, Any]) -> tuple[str, str]:
    choice = body["choices"][0]
    return choice["text"], choice["finish_reason"]


def test_min_tokens_with_stop_matches_the_engine_unsliced(
    engines: list[VllmEngine], sliced: GatewayThread
) -> None:
    """vLLM checks stop strings only once min_tokens are generated: a stop string in the first
    tokens' text does not end the answer, unsliced or sliced (probe 61: the assembler ended
    it there)."""
    prompt = engines[0].post("/tokenize", {"model": MODEL_NAME, "prompt": "the cache prefix"})
    base = {
        "model": MODEL_NAME,
        "prompt": prompt["tokens"],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    free, _ = _answer(engines[0].post("/v1/completions", base))
    # A stop string taken from the start of the free answer: it occurs within min_tokens.
    stop = free.lstrip()[:2]
    assert len(stop) == 2, free
    body = {**base, "min_tokens": 8, "stop": [stop]}
    unsliced = _answer(engines[0].post("/v1/completions", body))
    status, _, raw = sliced.post("/v1/completions", body)
    assert status == 200, raw
    assert _answer(json.loads(raw)) == unsliced, (free, stop)
    # Without min_tokens both stop at its first occurrence.
    body = {**base, "stop": [stop]}
    status, _, raw = sliced.post("/v1/completions", body)
    assert _answer(json.loads(raw)) == _answer(engines[0].post("/v1/completions", body))
