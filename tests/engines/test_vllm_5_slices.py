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


@pytest.fixture(scope="module", params=["native", "python"])
def sliced(
    request: pytest.FixtureRequest, engines: list[VllmEngine], tiny_model: Path
) -> Iterator[GatewayThread]:
    """The gateway slicing every answer, on each data plane."""
    config = gateway_config(engines, str(tiny_model), slices=SLICES, data_plane=request.param)
    runner = GatewayThread(config)
    try:
        yield runner
    finally:
        runner.stop()


def _streamed(gateway: GatewayThread, body: dict[str, Any]) -> tuple[str, str]:
    """The text and finish reason of a streamed completion through ``gateway``, which must end
    with ``data: [DONE]``."""
    conn = gateway.connection()
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"content-type": "application/json"},
        )
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        events = [
            line[len(b"data: ") :].strip()
            for line in reply.read().splitlines()
            if line.startswith(b"data: ")
        ]
    finally:
        conn.close()
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    finished = [r for r in reasons if r is not None]
    assert len(finished) == 1, reasons
    return text, finished[0]


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


def test_a_streamed_sliced_answer_is_the_engine_s_unsliced_answer(
    engines: list[VllmEngine], sliced: GatewayThread
) -> None:
    """Streamed in slices of 4 tokens over both engines, the answer's text and finish reason
    are the engine's unsliced ones (greedy decoding), with and without a stop string that
    falls past the first slices, and the stream ends with one finish reason and ``[DONE]``."""
    prompt = engines[0].post("/tokenize", {"model": MODEL_NAME, "prompt": "the cache prefix"})
    base = {
        "model": MODEL_NAME,
        "prompt": prompt["tokens"],
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    free = _answer(engines[0].post("/v1/completions", base))
    assert _streamed(sliced, base) == free
    # A stop string from the answer's second half: the sliced stream stops where vLLM does.
    text = free[0]
    stop = text[len(text) // 2 :][:3]
    body = {**base, "stop": [stop]}
    assert _streamed(sliced, body) == _answer(engines[0].post("/v1/completions", body)), stop
