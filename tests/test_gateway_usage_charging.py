"""An engine's ``usage.completion_tokens`` is charged to
flow control when the answer ends. A count beyond 64 bits signed was refused by the flow
controller after the Python plane had marked the slot released, so each such answer leaked a
flow-control slot for good (with ``max_requests: 1``, the next request waited forever); the
native plane charged it and wrapped the tenant's service counter. A count no answer can hold is
now charged as none, on both planes."""

from __future__ import annotations

import json

import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    in_front_of_raw,
    plane,
    raw_request,
    run,
)

pytestmark = pytest.mark.usefixtures("plane")


@pytest.mark.parametrize("count", [2**63, 2**64 - 1, 10**400], ids=["2^63", "2^64-1", "10^400"])
def test_a_huge_usage_count_from_the_engine_leaks_no_flow_slot(count: int) -> None:
    usage = b'{"choices":[{"text":"hi"}],"usage":{"completion_tokens":%d}}' % count
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    # One slot, queued requests waiting a minute: a leaked slot would hold every later
    # request in the queue (run()'s 30 s limit ends the test first).
    flow = {"saturation": {"type": "concurrency", "max_requests": 1}}

    async def body_() -> None:
        async with in_front_of_raw(answer + usage, flow) as gateway:
            assert gateway.flow is not None
            for _ in range(3):
                status, text = await raw_request(gateway.port, body)
                assert status == 200, text
                assert gateway.flow.running_count() == 0
            service = [f["service_tokens"] for f in gateway.flow.metrics()["flows"]]
            # At most the prompt's tokens: the engine's count was not believed.
            assert service and all(s < 2**32 for s in service), service

    run(body_())
