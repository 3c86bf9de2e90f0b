"""Request-pipeline benchmarks: one request through ``Scheduler.schedule_sync`` (pick, ticket,
first token, completion accounting) and through ``async with Scheduler.schedule`` with flow
control, each beside the same steps written by hand on the Router, EndpointPool and
FlowController (the ``_twin``: what a caller wrote before the Scheduler). The ratio printed
(hand-written / Scheduler) is the composition's cost; timing never fails a test.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from llmsched import (
    EndpointPool,
    FlowController,
    FlowRequest,
    PrefixIndex,
    Router,
    Scheduler,
    ScheduleRequest,
)

ENGINES = [f"e{i}" for i in range(8)]
PROMPTS = [np.arange(512, dtype=np.uint32) + 1000 * k for k in range(50)]
FLOW = {"saturation": {"type": "concurrency", "max_requests": 64}}
BATCH = 200


@pytest.mark.benchmark(group="scheduler: one request, sync")
def test_schedule_sync(benchmark) -> None:
    s = Scheduler(ENGINES, router="llm-d", block_size=16)
    requests = itertools.cycle([ScheduleRequest(tokens=p) for p in PROMPTS])

    def one() -> None:
        with s.schedule_sync(next(requests)) as placement:
            placement.first_token()

    one()
    assert s.stats()["completed"] == 1 and s.stats()["in_flight"] == 0
    benchmark(one)


@pytest.mark.benchmark(group="scheduler: one request, sync")
def test_schedule_sync_twin(benchmark) -> None:
    pool = EndpointPool(ENGINES, stale_policy="ignore")
    router = Router(pool, PrefixIndex(16), "llm-d")
    prompts = itertools.cycle(PROMPTS)

    def one() -> None:
        decision = router.pick(tokens=next(prompts))
        decision.started()
        decision.first_token()
        decision.finished()

    one()
    assert all(e["in_flight_requests"] == 0 for e in pool.endpoints())
    benchmark(one)


@pytest.mark.benchmark(group="scheduler: a batch of requests, async with flow control")
def test_schedule_async(benchmark) -> None:
    s = Scheduler(ENGINES, router="llm-d", block_size=16, flow=FLOW)
    requests = [ScheduleRequest(tokens=PROMPTS[k % len(PROMPTS)]) for k in range(BATCH)]

    async def batch() -> None:
        for request in requests:
            async with s.schedule(request) as placement:
                placement.first_token()

    asyncio.run(batch())
    assert s.stats()["completed"] == BATCH and s.flow is not None and s.flow.running_count() == 0
    benchmark.extra_info["items"] = BATCH
    benchmark(lambda: asyncio.run(batch()))
    benchmark.extra_info["unit"] = "requests"


@pytest.mark.benchmark(group="scheduler: a batch of requests, async with flow control")
def test_schedule_async_twin(benchmark) -> None:
    pool = EndpointPool(ENGINES, stale_policy="ignore")
    router = Router(pool, PrefixIndex(16), "llm-d")
    flow = FlowController(FLOW)
    ids = itertools.count(1)

    async def batch() -> None:
        for k in range(BATCH):
            request_id = next(ids)
            prompt = PROMPTS[k % len(PROMPTS)]
            await flow.admit(FlowRequest(request_id, prompt_tokens=len(prompt)))
            try:
                decision = router.pick(tokens=prompt)
                decision.started()
                decision.first_token()
                decision.finished()
            finally:
                flow.complete(request_id)

    asyncio.run(batch())
    assert flow.running_count() == 0
    benchmark.extra_info["items"] = BATCH
    benchmark(lambda: asyncio.run(batch()))
    benchmark.extra_info["unit"] = "requests"
