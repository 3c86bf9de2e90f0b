"""The gateway's observability surface (``/metrics`` and the admin
API), on both data planes: every scrape parsed by ``prometheus_client``'s own parser."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import pytest
from _gateway_harness import (  # noqa: F401 (the fixture)
    MODEL,
    Rig,
    plane,
    rig,
    run,
    until,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from llmsched.integrations import EngineSpec
from llmsched.testing import FakeKVPublisher, event_batch, stored_event
from llmsched.testing.openai_engine import FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")

TOKEN = "probe59-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# A label value of every kind the exposition format escapes, and one it does not.
HOSTILE = 'engine "a"\\b\nc é'
# The bounds of llmsched_gateway_decision_seconds (both planes).
DECISION_BOUNDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


async def _scrape(r: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one ``GET /metrics``, parsed (a ValueError on an invalid body)."""
    response = await r.client.get(r.url("/metrics"))
    assert response.status == 200
    text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _sample(r: Rig, name: str, **labels: str) -> float:
    return (await _scrape(r)).get((name, tuple(sorted(labels.items()))), 0.0)


def test_engine_names_with_quotes_backslashes_and_newlines_are_escaped_in_metrics() -> None:
    # The native plane escaped a label value's backslashes and quotes but not its newlines:
    # an engine named with one (in the config or through the admin API) broke every scrape
    # of /metrics (a sample split over two lines, which no Prometheus parser reads).
    async def go() -> None:
        extra = FakeOpenAIEngine(model=MODEL)
        await extra.start()
        try:
            async with rig(1, engine_fields=[{"name": HOSTILE}], admin={"token": TOKEN}) as r:
                assert (await r.complete("hello")).status == 200
                added = {**extra.spec(), "name": HOSTILE + "\n2"}
                response = await r.client.post(r.url("/admin/engines"), json=added, headers=ADMIN)
                assert response.status == 201, await response.text()
                samples = await _scrape(r)
                up = "llmsched_gateway_endpoint_up"
                assert samples[(up, (("endpoint", HOSTILE),))] == 1.0
                assert samples[(up, (("endpoint", HOSTILE + "\n2"),))] == 1.0
                routed = ("llmsched_gateway_routed_total", (("endpoint", HOSTILE),))
                assert samples[routed] == 1.0
        finally:
            await extra.stop()

    run(go())


def test_histogram_bucket_bounds_are_spelled_as_on_the_python_plane() -> None:
    # The native plane wrote its bucket bounds with Rust's float formatting (le="1e-5"), the
    # Python plane with Go's (le="1e-05", prometheus_client's): the same bucket was two
    # series, so a dashboard summing a histogram over replicas of both planes split it.
    async def go() -> None:
        async with rig(1) as r:
            assert (await r.complete("hello")).status == 200
            samples = await _scrape(r)
            bounds = {
                dict(labels)["le"]
                for name, labels in samples
                if name == "llmsched_gateway_decision_seconds_bucket"
            }
            assert bounds == {floatToGoString(b) for b in DECISION_BOUNDS} | {"+Inf"}
            bounds = {
                dict(labels)["le"]
                for name, labels in samples
                if name == "llmsched_gateway_admission_wait_seconds_bucket"
            }
            assert "5e-05" in bounds and "60.0" in bounds and "+Inf" in bounds

    run(go())


async def _client_leaves(r: Rig, body: dict[str, Any], *, after_first_chunk: bool) -> None:
    """Sends ``body`` and leaves: after the answer's first chunk, or before any answer."""
    url = r.url("/v1/completions")
    if after_first_chunk:
        response = await r.client.post(url, json=body)
        assert response.status == 200
        await response.content.readany()
        response.close()
        return
    with pytest.raises(asyncio.TimeoutError):
        await r.client.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.5))


def test_a_client_that_leaves_mid_stream_is_counted() -> None:
    # A client leaving a stream was counted nowhere in llmsched_gateway_requests_total: the
    # Python plane's handler is cancelled (its client_gone count sat on a ConnectionError
    # that cancellation never raises), the native plane counted only ended answers.
    async def go() -> None:
        def slow(engine: FakeOpenAIEngine) -> None:
            engine.mode = "slow"
            engine.token_delay_s = 0.2

        async with rig(1, answer_tokens=50, setup=slow) as r:
            body = {"model": MODEL, "prompt": "hello", "stream": True}
            await _client_leaves(r, body, after_first_chunk=True)
            await until(lambda: r.engines[0].disconnects == 1)
            name = "llmsched_gateway_requests_total"
            for _ in range(100):
                if await _sample(r, name, route="completions", status="client_gone") == 1.0:
                    break
                await asyncio.sleep(0.05)
            samples = await _scrape(r)
            statuses = {
                dict(labels)["status"]: value
                for (n, labels), value in samples.items()
                if n == name and dict(labels)["route"] == "completions"
            }
            assert statuses == {"client_gone": 1.0}

    run(go())


def test_a_client_that_leaves_before_the_answer_is_counted() -> None:
    # The same for a client that leaves while the engine has not answered yet.
    async def go() -> None:
        def stall(engine: FakeOpenAIEngine) -> None:
            engine.mode = "stall"

        async with rig(1, setup=stall) as r:
            body = {"model": MODEL, "prompt": "hello"}
            await _client_leaves(r, body, after_first_chunk=False)
            name = "llmsched_gateway_requests_total"
            for _ in range(100):
                if await _sample(r, name, route="completions", status="client_gone") == 1.0:
                    break
                await asyncio.sleep(0.05)
            assert await _sample(r, name, route="completions", status="client_gone") == 1.0

    run(go())


def test_head_of_the_engine_list_answers_as_get_without_a_body() -> None:
    # HEAD is GET without the body on every other GET path of both planes, and on the Python
    # plane's GET /admin/engines (aiohttp routes HEAD with GET); the native plane answered 404.
    async def go() -> None:
        async with rig(1, admin={"token": TOKEN}) as r:
            response = await r.client.head(r.url("/admin/engines"), headers=ADMIN)
            assert response.status == 200
            assert await response.read() == b""
            response = await r.client.head(r.url("/admin/engines"))
            assert response.status == 401
            listed = await _sample(
                r, "llmsched_gateway_admin_requests_total", action="list", status="200"
            )
            assert listed == 1.0

    run(go())


def test_routed_counts_the_attempt_whose_status_line_came_without_a_5xx_on_both_planes() -> None:
    # llmsched_gateway_routed_total disagreed between the planes for the same traffic: the
    # Python plane counted a relayed 5xx (no successful attempt) and left out an answer cut
    # after its status line; the native plane counts the attempt once its status line came
    # without a 5xx, whatever becomes of its body.
    async def go() -> None:
        async with rig(1, retries={"on_5xx": False}) as r:
            expected = {
                "ok": (200, 1.0),
                "error500": (500, 0.0),
                "error400": (400, 1.0),
                "cut": (502, 1.0),
            }
            total = 0.0
            for mode, (status, routed) in expected.items():
                response = await r.complete("hello", x_fake_mode=mode)
                assert response.status == status, mode
                total += routed
                endpoint = str(r.gateway.config.engines[0].worker_id)
                counted = await _sample(r, "llmsched_gateway_routed_total", endpoint=endpoint)
                assert counted == total, mode

    run(go())


async def _kv_counters(r: Rig) -> dict[str, float]:
    return {
        dict(labels)["counter"]: value
        for (name, labels), value in (await _scrape(r)).items()
        if name == "llmsched_gateway_kv_events_total"
    }


def test_kv_event_counters_go_on_across_an_engine_change() -> None:
    # An engine change (admin API, discovery) restarts the KV-event feed with a new
    # subscriber, and llmsched_gateway_kv_events_total started again from 0 on both planes:
    # a counter that went down without a restart of the gateway.
    async def go() -> None:
        publisher = FakeKVPublisher(topic="kv@e0")
        extra = FakeOpenAIEngine(model=MODEL)
        await extra.start()
        try:
            fields = [publisher.spec_kwargs()]
            async with rig(1, engine_fields=fields, admin={"token": TOKEN}) as r:
                assert await asyncio.to_thread(publisher.wait_subscribed, 5.0)
                publisher.publish(
                    event_batch(stored_event([1, 2], None, list(range(8)), block_size=4))
                )
                name = "llmsched_gateway_kv_events_total"
                for _ in range(200):
                    if await _sample(r, name, counter="batches") == 1.0:
                        break
                    await asyncio.sleep(0.05)
                assert await _sample(r, name, counter="batches") == 1.0
                before = await _kv_counters(r)
                response = await r.client.post(
                    r.url("/admin/engines"), json=extra.spec(), headers=ADMIN
                )
                assert response.status == 201, await response.text()
                await r.gateway.scheduler.feeds_settled()
                # The new subscriber connects again: counted on top of the first connect.
                for _ in range(200):
                    if await _sample(r, name, counter="connects") >= 2.0:
                        break
                    await asyncio.sleep(0.05)
                after = await _kv_counters(r)
                assert after["connects"] >= 2.0
                assert all(after[counter] >= value for counter, value in before.items()), (
                    before,
                    after,
                )
        finally:
            publisher.close()
            await extra.stop()

    run(go())


def test_scrape_failure_counters_go_on_across_an_engine_change() -> None:
    # The Python plane read llmsched_gateway_scrape_failures_total from the running scraper,
    # which an engine change replaces: an engine's failed scrapes fell back to 0 (the native
    # plane keeps its own counts).
    async def go() -> None:
        def failing(engine: FakeOpenAIEngine) -> None:
            engine.metrics_status = 500

        extra = FakeOpenAIEngine(model=MODEL)
        await extra.start()
        scrape = {"enabled": True, "interval_s": 0.05, "timeout_s": 0.5}
        try:
            async with rig(2, setup=failing, scrape=scrape, admin={"token": TOKEN}) as r:
                worker = str(r.gateway.config.engines[0].worker_id)
                name = "llmsched_gateway_scrape_failures_total"
                for _ in range(200):
                    if await _sample(r, name, endpoint=worker, kind="failed") >= 2.0:
                        break
                    await asyncio.sleep(0.05)
                before = await _sample(r, name, endpoint=worker, kind="failed")
                assert before >= 2.0
                response = await r.client.post(
                    r.url("/admin/engines"), json=extra.spec(), headers=ADMIN
                )
                assert response.status == 201, await response.text()
                await r.gateway.scheduler.feeds_settled()
                assert await _sample(r, name, endpoint=worker, kind="failed") >= before
        finally:
            await extra.stop()

    run(go())


def test_engine_changes_are_counted_alike_on_both_planes() -> None:
    """Probe 78: ``llmsched_gateway_engine_changes_total`` ("engines added, removed or
    changed") counted an engine moved to another URL twice on the native plane (added and
    removed) and one whose labels, role or model changed not at all; the Python plane counts
    each once."""

    async def body() -> None:
        async with (
            FakeOpenAIEngine(model=MODEL) as other,
            rig(1, engine_fields=[{"name": "e"}]) as r,
        ):
            first = r.gateway.config.engines[0]
            relabelled = dataclasses.replace(first, labels={"zone": "b"})
            moved = dataclasses.replace(relabelled, port=other.port)
            extra = EngineSpec("127.0.0.1", other.port, name="extra", model=MODEL)
            counted = []
            for engines in ([relabelled], [moved], [moved, extra], [extra]):
                await r.gateway.set_engines(engines)
                counted.append(await _sample(r, "llmsched_gateway_engine_changes_total"))
            assert counted == [1.0, 2.0, 3.0, 4.0]

    run(body())
