"""A stopped engine is routed around (runs last: it stops one of the session's engines)."""

from __future__ import annotations

import json
from pathlib import Path

from .gateway_thread import GatewayThread, gateway_config
from .vllm_engine import MODEL_NAME, VllmEngine


def test_stopped_engine_is_routed_around(engines: list[VllmEngine], tiny_model: Path) -> None:
    runner = GatewayThread(gateway_config(engines, str(tiny_model)))
    try:
        engines[1].stop()
        served = 0
        for i in range(8):
            status, _, body = runner.post(
                "/v1/completions",
                {"model": MODEL_NAME, "prompt": f"request {i} the cache", "max_tokens": 4},
            )
            assert status == 200, body
            assert json.loads(body)["choices"][0]["text"] is not None
            served += 1
        assert served == 8
    finally:
        runner.stop()
