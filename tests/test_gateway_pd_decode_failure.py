"""P/D disaggregation on the gateway: a failing decode engine never sends the request to a
prefill-only engine, on both data planes."""

from __future__ import annotations

from typing import Any

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    current_plane,
    plane,
    rig,
    run,
)

pytestmark = pytest.mark.usefixtures("plane")

SPLIT_ALWAYS: dict[str, Any] = {
    "plugins": [
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "max-score-picker"},
        {"type": "always-disagg-pd-decider"},
        {
            "type": "pd-profile-handler",
            "parameters": {"deciderPluginName": "always-disagg-pd-decider"},
        },
    ],
    "schedulingProfiles": [
        {
            "name": "prefill",
            "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "max-score-picker"}],
        },
        {
            "name": "decode",
            "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "max-score-picker"}],
        },
    ],
}


def test_failed_decode_engines_never_fall_back_to_the_prefill_engine() -> None:
    """F1: with every decode engine answering 5xx, the Python plane retried on the prefill-only
    engine (an endpoint the decode profile's filter removed) and answered 200 from there,
    naming that engine as its own prefiller; the native plane tried the decode engines only."""

    async def body() -> None:
        roles = [{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}]
        async with rig(
            engines=3, engine_fields=roles, router=SPLIT_ALWAYS, pd={"enabled": True}
        ) as r:
            prefill, *decode = r.engines
            for engine in decode:
                engine.mode = "error500"
            response = await r.complete("hello there")
            assert response.status == 502, current_plane()
            assert not prefill.received
            assert all(len(e.received) == 1 for e in decode)
            for engine in decode:
                (received,) = engine.received
                assert received.headers["x-prefiller-host-port"] == f"127.0.0.1:{prefill.port}"

    run(body())


def test_a_both_engine_picked_for_prefill_and_decode_gets_no_prefill_header() -> None:
    """The prefill profile picking the decode engine itself (role both) was a split onto one
    engine: the gateway named that engine as its own prefiller, a needless P/D hand-off."""

    async def body() -> None:
        async with rig(
            engines=1, engine_fields=[{"role": "both"}], router=SPLIT_ALWAYS, pd={"enabled": True}
        ) as r:
            (engine,) = r.engines
            response = await r.complete("hello there")
            assert response.status == 200, current_plane()
            (received,) = engine.received
            assert "x-prefiller-host-port" not in received.headers, current_plane()

    run(body())
