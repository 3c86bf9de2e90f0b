"""A configuration that will route badly warns once through ``logging``, is counted, and shows
in ``Scheduler.warnings`` / ``stats()`` and, in ``llmsched serve``, in ``/metrics``
on both data planes (``llmsched_gateway_config_warnings``,
``llmsched_gateway_index_block_size_mismatch_total``,
``llmsched_gateway_engine_model_mismatches``). Configurations that are fine say nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest
from _gateway_harness import MODEL, Rig, plane, rig, run, until  # noqa: F401

from llmsched import Scheduler
from llmsched.gateway.config import load_config
from llmsched.integrations import EngineSpec
from llmsched.testing import FakeKVPublisher, event_batch, stored_event
from llmsched.testing.openai_engine import FakeOpenAIEngine

CONFIG_WARNINGS = "llmsched_gateway_config_warnings"
MISMATCH = "llmsched_gateway_index_block_size_mismatch_total"
MODEL_FINDINGS = "llmsched_gateway_engine_model_mismatches"
EXTRA_KEYS = "llmsched_gateway_index_extra_keys_total"
ENGINE_BLOCK_SIZE = "llmsched_gateway_engine_block_size_mismatch"


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and needle in r.getMessage()
    ]


def _stored(block_size: int, first_hash: int) -> bytes:
    """One batch storing one engine block of ``block_size`` tokens (a root block)."""
    tokens = list(range(first_hash * 100, first_hash * 100 + block_size))
    return event_batch(stored_event([first_hash], None, tokens, block_size=block_size))


SATURATION_ROUTER = {
    "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "d",
            "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
    "saturationDetector": {"queueDepthThreshold": 5},
}


# -- the library ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_feed", ["python", "native"])
@pytest.mark.parametrize(("engine_block", "bad"), [(6, True), (8, False)], ids=["6", "8"])
def test_scheduler_lists_and_counts_an_engine_block_size_the_index_cannot_split(
    caplog: pytest.LogCaptureFixture, kv_feed: Any, engine_block: int, bad: bool
) -> None:
    # Engine blocks of 6 tokens on an index of 4: every stored event is skipped, so the
    # engine's cache is never matched. Before: logged by the index and counted in
    # index.stats() only; Scheduler.warnings and stats()["config_warnings"] said nothing.
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        with FakeKVPublisher() as publisher:
            spec = EngineSpec("127.0.0.1", 9, **publisher.spec_kwargs())
            scheduler = Scheduler([spec], router="round-robin", block_size=4, kv_feed=kv_feed)
            async with scheduler:
                assert await asyncio.to_thread(publisher.wait_subscribed, 5.0)
                publisher.publish(_stored(engine_block, 1))
                publisher.publish(_stored(engine_block, 2))
                counters = scheduler.kv_event_counters
                await until(lambda: counters().get("batches", 0) == 2)
            skipped = scheduler.index.block_size_mismatch()
            if not bad:
                assert skipped == {}
                assert scheduler.warnings == []
                assert scheduler.stats()["config_warnings"] == 0
                assert _warnings(caplog, "block size") == []
                return
            assert skipped == {spec.worker_id: 2}
            [note] = scheduler.warnings
            assert f"engine {spec.worker_id!r}: 2 stored KV events skipped" in note
            assert "--block-size a multiple of 4" in note
            assert scheduler.stats()["config_warnings"] == 1
            # Warned once, for the first batch, not per batch.
            assert len(_warnings(caplog, "block size")) == 1

    run(go())


def _keyed(first_hash: int, kind: str) -> bytes:
    """One batch storing a root block of 4 tokens whose extra keys the index cannot use:
    ``numbered`` (a LoRA adapter named only by its number, vLLM before 0.20), ``image``
    (a multimodal input's key)."""
    tokens = list(range(first_hash * 100, first_hash * 100 + 4))
    extra: dict[str, Any] = (
        {"lora_id": 3} if kind == "numbered" else {"extra_keys": [[["image-hash", 0]]]}
    )
    return event_batch(stored_event([first_hash], None, tokens, block_size=4, **extra))


@pytest.mark.parametrize("kv_feed", ["python", "native"])
def test_scheduler_lists_and_counts_events_skipped_for_extra_keys(
    caplog: pytest.LogCaptureFixture, kv_feed: Any
) -> None:
    # Probe 66: events skipped for extra keys the index cannot name were counted with
    # multimodal ones (one count, in each batch's report only) and said nothing anywhere.
    # Now: counted apart in index.stats(), the extra-keys ones warned once and listed.
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        with FakeKVPublisher() as publisher:
            spec = EngineSpec("127.0.0.1", 9, **publisher.spec_kwargs())
            scheduler = Scheduler([spec], router="round-robin", block_size=4, kv_feed=kv_feed)
            async with scheduler:
                assert await asyncio.to_thread(publisher.wait_subscribed, 5.0)
                publisher.publish(_keyed(1, "image"))
                counters = scheduler.kv_event_counters
                await until(lambda: counters().get("batches", 0) == 1)
                # Multimodal blocks: counted, not a configuration to warn of.
                assert scheduler.index.stats()["multimodal"] == {spec.worker_id: 1}
                assert scheduler.warnings == [] and _warnings(caplog, "extra keys") == []
                publisher.publish(_keyed(2, "numbered"))
                publisher.publish(_keyed(3, "numbered"))
                await until(lambda: counters().get("batches", 0) == 3)
            assert scheduler.index.extra_keys() == {spec.worker_id: 2}
            assert scheduler.index.stats()["multimodal"] == {spec.worker_id: 1}
            [note] = scheduler.warnings
            assert f"engine {spec.worker_id!r}: 2 stored KV events skipped for extra keys" in note
            assert scheduler.stats()["config_warnings"] == 1
            assert len(_warnings(caplog, "extra keys")) == 1

    run(go())


def test_a_removed_engine_takes_its_block_size_note_with_it() -> None:
    scheduler = Scheduler(["a", "b"], router="round-robin", block_size=4)
    scheduler.index.note_block_size_mismatch("a", 1)
    assert len(scheduler.warnings) == 1
    scheduler.remove_engine("a")
    assert scheduler.warnings == []
    assert scheduler.index.block_size_mismatch() == {"a": 1}  # the count stays


def test_an_engine_removed_or_moved_takes_its_scraped_block_size_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The block size an engine's ``/metrics`` gave is the process's there: an engine removed
    forgets it (it stayed for good, one entry per pod name discovery ever saw), and one back
    at another address (a StatefulSet pod rescheduled under its name: another process) starts
    without it, warned afresh if it gives the same size. Before, the old process's size stayed
    listed, noted and exported as the engine's until the new one's /metrics gave another (never,
    where it gives none)."""
    caplog.set_level(logging.WARNING)
    a = EngineSpec("10.0.0.7", 8000, name="a", kv_events="tcp://10.0.0.7:5557")
    b = EngineSpec("10.0.0.8", 8000, name="b", kv_events="tcp://10.0.0.8:5557")
    scheduler = Scheduler([a, b], router="round-robin", block_size=4)
    scheduler.note_engine_block_size("a", 6)
    scheduler.note_engine_block_size("b", 6)
    assert scheduler.engine_block_size_mismatch() == {"a": 6, "b": 6}
    assert scheduler.stats()["config_warnings"] == 2
    moved = EngineSpec("10.0.0.9", 8000, name="a", kv_events="tcp://10.0.0.9:5557")
    relabelled = EngineSpec("10.0.0.8", 8000, name="b", kv_events=b.kv_events, labels={"x": "y"})
    scheduler.set_engines([moved, relabelled])
    # The moved engine is another process; the relabelled one is the same process.
    assert scheduler.engine_block_sizes() == {"b": 6}
    assert scheduler.engine_block_size_mismatch() == {"b": 6}
    assert scheduler.stats()["config_warnings"] == 1
    scheduler.note_engine_block_size("a", 6)
    assert len(_warnings(caplog, "'a': its /metrics gives a KV block size")) == 2
    scheduler.set_engines([moved])
    assert scheduler.engine_block_sizes() == {"a": 6}
    scheduler.remove_engine("a")
    assert scheduler.engine_block_sizes() == {}
    scheduler.note_engine_block_size("a", 6)  # a scrape that ended after "a" left
    assert scheduler.engine_block_sizes() == {}


def test_the_callers_notes_are_listed_and_counted() -> None:
    scheduler = Scheduler(["a"], router="round-robin", notes=["gateway: something"])
    assert scheduler.warnings == ["gateway: something"]
    assert scheduler.stats()["config_warnings"] == 1


def test_router_notes_flow_sections_unless_the_caller_wires_them() -> None:
    from llmsched import EndpointPool, Router
    from llmsched.errors import InvalidTypeError

    bare = Router(EndpointPool(["a"]), config=SATURATION_ROUTER)
    assert any("a Router alone does not run" in w for w in bare.warnings)
    wired = Router(EndpointPool(["a"]), config=SATURATION_ROUTER, wires_flow=True)
    assert wired.warnings == []
    with pytest.raises(InvalidTypeError, match="wires_flow"):
        Router(EndpointPool(["a"]), wires_flow=1)  # type: ignore[arg-type]


# -- the gateway, both planes --------------------------------------------------------------


async def _metric(r: Rig, name: str, **labels: str) -> float:
    """A sample of ``GET /metrics`` (both planes serve it)."""
    response = await r.client.get(r.url("/metrics"))
    text = await response.text()
    wanted = name + (
        "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    )
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize(("engine_block", "bad"), [(6, True), (8, False)], ids=["6", "8"])
def test_gateway_exports_an_engine_block_size_mismatch(
    caplog: pytest.LogCaptureFixture, engine_block: int, bad: bool
) -> None:
    # Before: neither plane's /metrics said anything of skipped events (the known gap).
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        with FakeKVPublisher(topic="kv@e0") as publisher:
            async with rig(1, engine_fields=[publisher.spec_kwargs()]) as r:
                worker = r.gateway.config.engines[0].worker_id
                assert await asyncio.to_thread(publisher.wait_subscribed, 5.0)
                publisher.publish(_stored(engine_block, 1))
                publisher.publish(_stored(engine_block, 2))
                counters = r.gateway.scheduler.kv_event_counters
                await until(lambda: counters().get("batches", 0) == 2)
                mismatch = await _metric(r, MISMATCH, engine=worker)
                warnings = await _metric(r, CONFIG_WARNINGS)
                if bad:
                    assert (mismatch, warnings) == (2.0, 1.0)
                    assert len(_warnings(caplog, "block size")) == 1
                else:
                    assert (mismatch, warnings) == (0.0, 0.0)
                    assert _warnings(caplog, "block size") == []
                # The family is there either way, with its type.
                text = await (await r.client.get(r.url("/metrics"))).text()
                assert f"# TYPE {MISMATCH} counter" in text

    run(go())


@pytest.mark.usefixtures("plane")
def test_gateway_exports_events_skipped_for_extra_keys(caplog: pytest.LogCaptureFixture) -> None:
    # Before: neither plane said anything of them (counted with multimodal events in each
    # batch's report only).
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        with FakeKVPublisher(topic="kv@e0") as publisher:
            async with rig(1, engine_fields=[publisher.spec_kwargs()]) as r:
                worker = r.gateway.config.engines[0].worker_id
                assert await asyncio.to_thread(publisher.wait_subscribed, 5.0)
                publisher.publish(_keyed(1, "numbered"))
                publisher.publish(_keyed(2, "image"))
                publisher.publish(_keyed(3, "numbered"))
                counters = r.gateway.scheduler.kv_event_counters
                await until(lambda: counters().get("batches", 0) == 3)
                assert await _metric(r, EXTRA_KEYS, engine=worker) == 2.0
                assert await _metric(r, CONFIG_WARNINGS) == 1.0
                assert len(_warnings(caplog, "extra keys")) == 1
                assert r.gateway.index.stats()["multimodal"] == {worker: 1}

    run(go())


def _block_size_info(size: int) -> Any:
    """A fake engine setup whose ``/metrics`` gives a KV block size of ``size`` tokens."""

    def setup(engine: Any) -> None:
        engine.metrics_extra = f'vllm:cache_config_info{{block_size="{size}"}} 1\n'

    return setup


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize(
    ("engine_block", "kv_events", "bad"),
    [(6, True, True), (8, True, False), (6, False, False)],
    ids=["6-events", "8-events", "6-no-events"],
)
def test_gateway_compares_a_scraped_engine_block_size_where_it_matters(
    caplog: pytest.LogCaptureFixture, engine_block: int, kv_events: bool, bad: bool
) -> None:
    # Probe 66: the block size an engine's /metrics gives (vllm:cache_config_info) was never
    # compared with the gateway's. It matters only where the engine's KV events feed the
    # index: blocks of 6 tokens cannot be split into the index's blocks of 4, so every
    # stored event will be skipped. Without KV events the index holds the router's own
    # decisions at its own block size: nothing to say.
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        with FakeKVPublisher(topic="kv@e0") as publisher:
            fields = [publisher.spec_kwargs() if kv_events else {}]
            scrape = {"enabled": True, "interval_s": 0.05}
            setup = _block_size_info(engine_block)
            async with rig(1, engine_fields=fields, setup=setup, scrape=scrape) as r:
                worker = r.gateway.config.engines[0].worker_id
                scheduler = r.gateway.scheduler
                await until(lambda: worker in scheduler.engine_block_sizes())
                assert scheduler.engine_block_sizes() == {worker: engine_block}
                await asyncio.sleep(0.2)  # more scrapes: still one warning
                gauge = await _metric(r, ENGINE_BLOCK_SIZE, engine=worker)
                warned = _warnings(caplog, "KV block size")
                if bad:
                    assert gauge == float(engine_block)
                    assert await _metric(r, CONFIG_WARNINGS) == 1.0
                    [note] = scheduler.warnings
                    assert "--block-size a multiple of 4" in note
                    assert len(warned) == 1
                else:
                    assert gauge == 0.0 and await _metric(r, CONFIG_WARNINGS) == 0.0
                    assert scheduler.warnings == [] and warned == []

    run(go())


@pytest.mark.usefixtures("plane")
def test_an_engine_back_at_another_address_drops_the_old_process_s_block_size() -> None:
    # Probe 78: the engine named "e" moves (a StatefulSet pod rescheduled under its name);
    # the new process's /metrics gives no block size. The old process's 6 stayed exported,
    # noted and counted as "e"'s for good.
    async def go() -> None:
        with FakeKVPublisher(topic="kv@e0") as publisher:
            fields = [{**publisher.spec_kwargs(), "name": "e"}]
            scrape = {"enabled": True, "interval_s": 0.05}
            setup = _block_size_info(6)
            async with (
                FakeOpenAIEngine(model=MODEL) as moved,
                rig(1, engine_fields=fields, setup=setup, scrape=scrape) as r,
            ):
                scheduler = r.gateway.scheduler
                await until(lambda: scheduler.engine_block_sizes() == {"e": 6})
                assert await _metric(r, ENGINE_BLOCK_SIZE, engine="e") == 6.0
                old = r.gateway.config.engines[0]
                spec = dataclasses.replace(old, port=moved.port)
                await r.gateway.set_engines([spec])

                async def scraped() -> None:
                    before = r.gateway.pool.endpoints()[0]["timestamp"]
                    await until(lambda: r.gateway.pool.endpoints()[0]["timestamp"] != before)

                await scraped()  # the moved engine scraped twice since
                await scraped()
                assert scheduler.engine_block_sizes() == {}
                assert await _metric(r, ENGINE_BLOCK_SIZE, engine="e") == 0.0
                assert await _metric(r, CONFIG_WARNINGS) == 0.0

    run(go())


ALL_ZERO = {
    "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 0},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"router": ALL_ZERO}, "every scorer weight"),
        # Flow control by utilization with nothing scraped refuses every request. Before:
        # the native plane logged it but its scheduler never listed or counted it.
        ({"flow": {}}, "utilization"),
        ({}, None),
        # The gateway applies saturationDetector to its flow control. Before: the Router's
        # note that "a Router alone does not run" it was logged and counted anyway.
        ({"router": SATURATION_ROUTER, "flow": {}, "scrape": {"enabled": True}}, None),
    ],
    ids=["zero-weights", "flow-without-load", "fine", "saturation-wired"],
)
def test_gateway_counts_its_config_warnings_alike_on_both_planes(
    overrides: dict[str, Any], needle: str | None
) -> None:
    async def go() -> None:
        async with rig(1, **overrides) as r:
            warnings = r.gateway.scheduler.warnings
            if needle is None:
                assert warnings == []
                assert await _metric(r, CONFIG_WARNINGS) == 0.0
            else:
                assert len(warnings) == 1 and needle in warnings[0], warnings
                assert await _metric(r, CONFIG_WARNINGS) == 1.0
                assert r.gateway.scheduler.stats()["config_warnings"] == 1

    run(go())


def test_loader_notes_are_kept_in_the_config(caplog: pytest.LogCaptureFixture) -> None:
    # Before: a saturationDetector without flow control was logged while loading and then
    # lost: no count, nothing in the scheduler's warnings or /metrics.
    caplog.set_level(logging.WARNING)
    router = {
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {
                "name": "d",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "saturationDetector": {"queueDepthThreshold": 5},
    }
    base = {"engines": [{"host": "127.0.0.1", "port": 8001}], "models": ["m"]}
    config = load_config({**base, "router": router})
    [note] = config.notes
    assert "saturationDetector has no effect" in note
    assert len(_warnings(caplog, "saturationDetector has no effect")) == 1
    assert load_config(base).notes == ()


@pytest.mark.usefixtures("plane")
def test_saturation_detector_without_flow_is_counted_by_the_gateway() -> None:
    router = {
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {
                "name": "d",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "saturationDetector": {"queueDepthThreshold": 5},
    }

    async def go() -> None:
        async with rig(1, router=router) as r:
            assert await _metric(r, CONFIG_WARNINGS) == 1.0
            assert "saturationDetector" in r.gateway.scheduler.warnings[0]

    run(go())


@pytest.mark.usefixtures("plane")
def test_an_engine_whose_model_is_not_configured_is_warned_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An engine entry with `model: other` when `models` is [tiny]: no request may name
    # "other", so the engine never gets one. Before: silent (its /v1/models, had it served
    # "other", matched its own model and the check found nothing).
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        fields = [{"model": "other"}, {"model": "other"}, {}]
        async with rig(3, engine_fields=fields) as r:
            workers = [spec.worker_id for spec in r.gateway.config.engines]
            found = [
                (f.kind, f.engine, f.name)
                for f in r.gateway.model_check.findings()
                if f.kind == "model_not_configured"
            ]
            assert found == sorted(
                [("model_not_configured", w, "other") for w in workers[:2]], key=lambda x: x[1]
            )
            for worker in workers[:2]:
                labels = {"engine": worker, "kind": "model_not_configured"}
                assert await _metric(r, MODEL_FINDINGS, **labels) == 1.0
            labels = {"engine": workers[2], "kind": "model_not_configured"}
            assert await _metric(r, MODEL_FINDINGS, **labels) == 0.0
            # Two engines alike: one warning, naming the fix.
            warned = _warnings(caplog, "model_not_configured")
            assert len(warned) == 1 and "add 'other' to models" in warned[0]

    run(go())


def test_an_engine_serving_a_configured_model_or_adapter_is_fine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from llmsched.gateway.engine_models import EngineModelCheck

    caplog.set_level(logging.WARNING)
    check = EngineModelCheck(["base"], {"tenant-a": "base"})
    check.set_engines([EngineSpec("h", 1, model="base"), EngineSpec("h", 2, model="tenant-a")])
    check.set_engines([EngineSpec("h", 3)])
    assert check.findings() == []
    assert caplog.records == []
