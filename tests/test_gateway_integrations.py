"""The gateway with its feeds: engines' KV events (fake ZMQ publishers) steer routing, and
scraped ``/metrics`` steer routing, flow control and readiness."""

from __future__ import annotations

import asyncio
import time

import pytest
from _gateway_harness import current_plane, plane, rig, run, until  # noqa: F401 (the fixture)
from test_integrations_kv_zmtp import GREETING, TERABYTE, HostileListener

from llmsched.testing import FakeKVPublisher, event_batch, stored_event

pytestmark = pytest.mark.usefixtures("plane")

BLOCK = 4


def test_kv_events_from_an_engine_draw_its_prefix_there() -> None:
    tokens = list(range(100, 132))  # 8 blocks of 4

    async def body() -> None:
        publishers = [FakeKVPublisher(topic=f"kv@e{i}") for i in range(2)]
        fields = [p.spec_kwargs() for p in publishers]
        try:
            async with rig(engines=2, engine_fields=fields, block_size=BLOCK) as r:
                for p in publishers:
                    assert await asyncio.to_thread(p.wait_subscribed, 5.0)
                # Engine 1 reports holding the whole prompt; engine 0 nothing.
                hashes = list(range(1, 9))
                stored = stored_event(hashes, None, tokens, block_size=BLOCK)
                publishers[1].publish(event_batch(stored))
                worker = r.gateway.config.engines[1].worker_id
                await until(lambda: r.gateway.index.match_tokens(tokens).as_dict().get(worker) == 8)
                for extra in range(4):
                    response = await r.complete([*tokens, 500 + extra])
                    assert response.status == 200
                assert len(r.engines[1].received) == 4 and not r.engines[0].received
                assert r.metric("llmsched_gateway_kv_events_total", counter="batches") == 1
                assert r.metric("llmsched_gateway_kv_events_total", counter="blocks_stored") == 8
        finally:
            for p in publishers:
                p.close()

    run(body())


def test_kv_feed_survives_a_terabyte_frame_from_publisher_and_replay_socket() -> None:
    """Probe 48 F2 through the gateway: engine 0's publisher and engine 1's replay socket each
    answer with a frame header declaring 1 TiB. The gateway serves on; engine 1's live events
    still steer routing; on the native plane the drops are counted (the Python plane's libzmq
    drops them silently)."""
    tokens = list(range(100, 132))

    async def body() -> None:
        hostile_pub, hostile_replay = (
            HostileListener(GREETING + TERABYTE),
            HostileListener(GREETING + TERABYTE),
        )
        good = FakeKVPublisher(topic="kv@e1", replay=False)
        fields = [
            {"kv_events": hostile_pub.endpoint, "topic": "kv@e0"},
            {**good.spec_kwargs(), "replay": hostile_replay.endpoint},
        ]
        try:
            async with rig(engines=2, engine_fields=fields, block_size=BLOCK) as r:
                assert await asyncio.to_thread(good.wait_subscribed, 5.0)
                stored = stored_event(list(range(1, 9)), None, tokens, block_size=BLOCK)
                good.publish(event_batch(stored))
                worker = r.gateway.config.engines[1].worker_id
                await until(lambda: r.gateway.index.match_tokens(tokens).as_dict().get(worker) == 8)
                response = await r.complete([*tokens, 500])
                assert response.status == 200 and len(r.engines[1].received) == 1
                if current_plane() == "native":
                    await until(
                        lambda: (
                            r.metric("llmsched_gateway_kv_events_total", counter="decode_errors")
                            >= 2
                        )
                    )
        finally:
            good.close()
            hostile_pub.close()
            hostile_replay.close()

    run(body())


def test_scraped_load_steers_routing_and_admission() -> None:
    async def body() -> None:
        scrape = {"enabled": True, "interval_s": 0.05, "timeout_s": 0.5}
        async with rig(engines=2, scrape=scrape, flow={}) as r:
            busy, idle = r.engines
            busy.waiting, busy.kv_cache_usage = 3, 0.5
            worker = r.gateway.config.engines[0].worker_id
            await until(
                lambda: any(
                    e["id"] == worker and e["waiting"] == 3 for e in r.gateway.pool.endpoints()
                )
            )
            # Utilization saturation (llm-d's default) now has reports and admits requests;
            # the queue and KV scorers send them to the idle engine.
            for i in range(4):
                assert (await r.complete(f"request {i}")).status == 200
            assert len(idle.received) == 4 and not busy.received
            assert r.gateway.flow is not None and r.gateway.flow.saturation() < 1.0

    run(body())


def test_metrics_stay_fresh_through_an_idle_spell() -> None:
    """The idle scrape backs off, but never past the pool's staleness limit (1 s): a request
    arriving after an idle spell is routed on the metrics already there, and stale ones would
    count every engine saturated."""

    async def body() -> None:
        scrape = {"enabled": True, "interval_s": 0.05, "timeout_s": 0.5}
        async with rig(engines=2, scrape=scrape, flow={}) as r:
            await until(lambda: all(e["timestamp"] for e in r.gateway.pool.endpoints()))
            oldest = 0.0
            for _ in range(80):  # 4 s without a request: long enough to back off fully
                await asyncio.sleep(0.05)
                now = time.monotonic()
                ages = [now - e["timestamp"] for e in r.gateway.pool.endpoints()]
                oldest = max(oldest, *ages)
            assert oldest < 1.0, f"metrics {oldest:.2f} s old after an idle spell"

    run(body())


def test_engines_failing_their_scrapes_leave_readiness() -> None:
    async def body() -> None:
        scrape = {"enabled": True, "interval_s": 0.05, "timeout_s": 0.5}
        async with rig(engines=2, scrape=scrape) as r:
            if current_plane() == "python":
                scraper = r.gateway.scheduler.scraper
                assert scraper is not None
                await until(lambda: all(s["ok"] for s in scraper.snapshot().values()))
            else:  # the native plane scrapes itself
                await until(lambda: len(r.gateway.routable_endpoints()) == 2)
            r.engines[0].metrics_status = 503
            alive = r.gateway.config.engines[1].worker_id
            await until(lambda: r.gateway.routable_endpoints() == [alive])
            async with r.client.get(r.url("/ready")) as response:
                assert await response.json() == {"ready": True, "endpoints": 1}
            r.engines[1].metrics_status = 500
            await until(lambda: r.gateway.routable_endpoints() == [])
            async with r.client.get(r.url("/ready")) as response:
                assert response.status == 503
            r.engines[0].metrics_status = 200
            await until(
                lambda: r.gateway.routable_endpoints() == [r.gateway.config.engines[0].worker_id]
            )

    run(body())
