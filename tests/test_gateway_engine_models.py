"""The engines' ``/v1/models`` checked against the config's model names, on both data planes:
an adapter listed as a model (its requests would never match the engine's adapter-keyed
blocks), a model listed as an adapter, an adapter on another base model and an engine that
serves none of the configured models are each warned once, counted in ``/metrics`` and kept
in ``model_check.findings()``; engines that do not list models are left alone."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from _gateway_harness import MODEL, plane, rig, run, until  # noqa: F401

from llmsched.gateway.engine_models import EngineModelCheck, ModelFinding
from llmsched.integrations import EngineSpec
from llmsched.testing.openai_engine import FakeOpenAIEngine

MISMATCHES = "llmsched_gateway_engine_model_mismatches"
LOGGER = "llmsched.gateway.engine_models"


def listing(*cards: tuple[str, str | None]) -> dict[str, object]:
    return {"object": "list", "data": [{"id": i, "parent": p} for i, p in cards]}


def kinds(found: list[ModelFinding]) -> list[tuple[str, str]]:
    return [(f.kind, f.name) for f in found]


def test_each_kind_is_found_from_a_listing() -> None:
    check = EngineModelCheck(["base", "helper"], {"tenant-a": "base", "tenant-b": "base"})
    found = check.check(
        "e0",
        frozenset(["base", "helper"]),
        listing(("base", None), ("helper", "base"), ("tenant-a", "other"), ("tenant-b", None)),
    )
    assert kinds(found) == [
        ("adapter_listed_as_model", "helper"),
        ("base_model_differs", "tenant-a"),
        ("model_listed_as_adapter", "tenant-b"),
    ]
    assert "lora_adapters (helper: base)" in found[0].detail
    assert all(f.engine == "e0" for f in found)


def test_a_consistent_listing_finds_nothing() -> None:
    check = EngineModelCheck(["base"], {"tenant-a": "base"})
    served = listing(("base", None), ("tenant-a", "base"), ("unconfigured", "base"))
    assert check.check("e0", frozenset(["base"]), served) == []


def test_an_engine_serving_none_of_the_expected_models_is_found() -> None:
    check = EngineModelCheck(["a", "b"], {})
    found = check.check("e0", frozenset(["a", "b"]), listing(("c", None)))
    assert kinds(found) == [("model_not_served", "a, b")]
    assert "['c']" in found[0].detail
    # One of them served is enough; no expectation, no check.
    assert check.check("e0", frozenset(["a", "b"]), listing(("b", None))) == []
    assert check.check("e0", frozenset(), listing(("c", None))) == []


@pytest.mark.parametrize(
    "answer", [[], {"data": "x"}, {"object": "list"}, "models", None], ids=repr
)
def test_an_answer_that_is_not_a_model_list_is_refused(answer: object) -> None:
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        EngineModelCheck(["m"], {}).check("e0", frozenset(["m"]), answer)


def test_cards_without_a_string_id_and_empty_parents_are_read_as_vllm_lists_them() -> None:
    check = EngineModelCheck(["base"], {"x": "base"})
    served = {"data": [{"id": 3}, "junk", {"id": "base", "parent": ""}, {"id": "x", "parent": 7}]}
    # An empty or non-string parent is no parent: "x" is then served as a base model.
    assert kinds(check.check("e0", frozenset(["base"]), served)) == [
        ("model_listed_as_adapter", "x")
    ]


def _lists_helper(engine: FakeOpenAIEngine) -> None:
    engine.adapters["helper"] = MODEL


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


@pytest.mark.usefixtures("plane")
def test_an_adapter_listed_as_a_model_is_warned_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        async with rig(setup=_lists_helper, models=[MODEL, "helper"]) as r:
            await until(lambda: len(r.gateway.model_check.findings()) == 2)
            found = r.gateway.model_check.findings()
            assert {f.kind for f in found} == {"adapter_listed_as_model"}
            assert sorted(f.engine for f in found) == sorted(
                str(e.worker_id) for e in r.gateway.config.engines
            )
            for spec in r.gateway.config.engines:
                labels = {"engine": spec.worker_id, "kind": "adapter_listed_as_model"}
                assert r.metric(MISMATCHES, **labels) == 1.0
            # Two engines alike: one warning, naming the fix.
            warned = _warnings(caplog)
            assert len(warned) == 1 and "lora_adapters (helper: tiny)" in warned[0]

    run(main())


@pytest.mark.usefixtures("plane")
def test_a_correct_config_finds_nothing_and_is_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        async with rig(setup=_lists_helper, lora_adapters={"helper": MODEL}) as r:
            check = r.gateway.model_check
            workers = [spec.worker_id for spec in r.gateway.config.engines]
            await until(lambda: all(check.served(w) is not None for w in workers))
            for worker in workers:
                assert check.served(worker) == {MODEL: None, "helper": MODEL}
            assert check.findings() == []
            assert _warnings(caplog) == []

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_engine_added_later_is_checked_and_a_removed_one_forgotten() -> None:
    async def main() -> None:
        async with rig(engines=1) as r, FakeOpenAIEngine(model="other") as stranger:
            await until(lambda: r.engines[0].models_requests == 1)
            assert r.gateway.model_check.findings() == []
            specs = [*r.gateway.config.engines, EngineSpec(stranger.host, stranger.port)]
            await r.gateway.set_engines(specs)
            await until(lambda: len(r.gateway.model_check.findings()) == 1)
            (finding,) = r.gateway.model_check.findings()
            assert (finding.kind, finding.name) == ("model_not_served", MODEL)
            assert finding.engine == specs[1].worker_id
            labels = {"engine": specs[1].worker_id, "kind": "model_not_served"}
            assert r.metric(MISMATCHES, **labels) == 1.0
            await r.gateway.set_engines(specs[:1])
            assert r.gateway.model_check.findings() == []
            assert r.metric(MISMATCHES, **labels) == 0.0

    run(main())


@pytest.mark.usefixtures("plane")
def test_an_engine_without_a_models_listing_is_asked_once() -> None:
    async def main() -> None:
        async with rig(engines=1, setup=lambda e: setattr(e, "models_status", 404)) as r:
            engine = r.engines[0]
            await until(lambda: engine.models_requests == 1)
            await asyncio.sleep(1.5)  # past the first retry an unreachable engine gets
            assert engine.models_requests == 1
            assert r.gateway.model_check.findings() == []

    run(main())


def test_an_unreachable_engine_is_tried_again_until_it_answers() -> None:
    async def main() -> None:
        engine = FakeOpenAIEngine(model="served", port=0)
        await engine.start()
        port = engine.port
        await engine.stop()
        check = EngineModelCheck(["wanted"], {}, timeout_s=1.0)
        check.set_engines([EngineSpec(engine.host, port)])
        task = asyncio.create_task(check.run())
        try:
            await asyncio.sleep(0.3)  # the first try failed: connection refused
            assert check.findings() == []
            await engine.start()  # the same port
            await until(lambda: check.findings() != [], timeout=5.0)
            assert kinds(check.findings()) == [("model_not_served", "wanted")]
        finally:
            task.cancel()
            await engine.stop()

    run(main())


def test_an_adapter_loaded_later_is_found_at_the_next_check() -> None:
    async def main() -> None:
        async with FakeOpenAIEngine(model="base") as engine:
            check = EngineModelCheck(["base", "late"], {}, recheck_s=0.2)
            check.set_engines([EngineSpec(engine.host, engine.port, model="base")])
            task = asyncio.create_task(check.run())
            try:
                await until(lambda: engine.models_requests == 1)
                assert check.findings() == []
                engine.adapters["late"] = "base"
                await until(lambda: check.findings() != [])
                assert kinds(check.findings()) == [("adapter_listed_as_model", "late")]
                del engine.adapters["late"]
                await until(lambda: check.findings() == [])
            finally:
                task.cancel()

    run(main())


def test_the_context_length_is_learned_where_the_engines_agree() -> None:
    async def main() -> None:
        async with FakeOpenAIEngine(model="m") as a, FakeOpenAIEngine(model="m") as b:
            a.max_model_len = b.max_model_len = 2048
            told: list[int | None] = []
            check = EngineModelCheck(["m"], {}, recheck_s=0.1, on_context=told.append)
            check.set_engines([EngineSpec(a.host, a.port), EngineSpec(b.host, b.port)])
            task = asyncio.create_task(check.run())
            try:
                await until(lambda: check.context_length() == 2048)
                assert told == [2048] and check.findings() == []
                # One engine restarted with another context: unknown, and found out.
                b.max_model_len = 4096
                await until(lambda: check.context_length() is None)
                assert told == [2048, None]
                # A tie: the smaller context is the reference.
                await until(lambda: len(check.findings()) == 1)
                (finding,) = check.findings()
                assert (finding.kind, finding.name) == ("max_model_len_differs", "4096")
                assert finding.engine == EngineSpec(b.host, b.port).worker_id
                b.max_model_len = 2048
                await until(lambda: check.context_length() == 2048)
                assert told == [2048, None, 2048]
                await until(lambda: check.findings() == [])
            finally:
                task.cancel()

    run(main())


def test_a_configured_context_length_stands_and_engines_that_differ_are_found() -> None:
    async def main() -> None:
        async with FakeOpenAIEngine(model="m") as a, FakeOpenAIEngine(model="m") as b:
            a.max_model_len, b.max_model_len = 1024, 2048
            told: list[int | None] = []
            check = EngineModelCheck(["m"], {}, max_model_len=1024, on_context=told.append)
            assert check.context_length() == 1024
            spec_b = EngineSpec(b.host, b.port)
            check.set_engines([EngineSpec(a.host, a.port), spec_b])
            task = asyncio.create_task(check.run())
            try:
                await until(lambda: a.models_requests == 1 and b.models_requests == 1)
                await until(lambda: check.findings() != [])
                (finding,) = check.findings()
                assert (finding.kind, finding.engine, finding.name) == (
                    "max_model_len_differs",
                    spec_b.worker_id,
                    "2048",
                )
                assert "the config's max_model_len 1024" in finding.detail
                assert check.context_length() == 1024 and told == []
            finally:
                task.cancel()

    run(main())


@pytest.mark.usefixtures("plane")
def test_minus_one_truncation_routes_on_what_the_engine_keeps() -> None:
    """A prompt of ids longer than the engines' context with ``truncate_prompt_tokens: -1``:
    vLLM keeps its last ``max_model_len - 1`` ids and caches their blocks; the gateway learns
    the context from the engines' ``/v1/models`` and records those blocks, not the whole
    prompt's (whose every block differs)."""

    async def main() -> None:
        async with rig(setup=lambda e: setattr(e, "max_model_len", 21)) as r:
            await until(lambda: r.gateway.model_check.context_length() == 21)
            ids = list(range(100, 160))
            body = {"model": MODEL, "prompt": ids, "truncate_prompt_tokens": -1}
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                assert response.status == 200
            kept = np.asarray(ids[-20:], dtype=np.uint32)
            held = r.gateway.index.match_tokens(kept).as_dict()
            assert sorted(held.values()) == [5]  # 20 ids, blocks of 4, on the one engine
            assert r.gateway.index.match_tokens(np.asarray(ids, dtype=np.uint32)).as_dict() == {}

    run(main())


def test_a_listing_of_any_size_or_shape_never_stops_the_checks() -> None:
    """A listing in many pieces is read whole; one nested too deeply, not JSON or too large
    is left unchecked, and the other engines are still checked (a context length past 2^31
    is no context length)."""

    async def main() -> None:
        engines = [FakeOpenAIEngine(model="m") for _ in range(5)]
        large, deep, junk, huge, odd = engines
        large.adapters = {f"adapter-{i:05d}-" + "x" * 80: "m" for i in range(3000)}
        large.adapters["helper"] = "m"
        deep.models_body = b"[" * 100_000 + b"]" * 100_000
        junk.models_body = b"{not json"
        huge.models_body = b'{"data": [' + b'{"id": "m"},' * 500_000 + b'{"id": "m"}]}'
        odd.max_model_len = 10**30
        for engine in engines:
            await engine.start()
        try:
            check = EngineModelCheck(["m", "helper"], {}, timeout_s=10.0)
            check.set_engines(EngineSpec(e.host, e.port) for e in engines)
            task = asyncio.create_task(check.run())
            try:
                await until(lambda: all(e.models_requests == 1 for e in engines))
                spec = EngineSpec(large.host, large.port)
                await until(lambda: check.served(spec.worker_id) is not None)
                served = check.served(spec.worker_id)
                assert served is not None and len(served) == 3002
                assert kinds(check.findings()) == [("adapter_listed_as_model", "helper")]
                odd_spec = EngineSpec(odd.host, odd.port)
                await until(lambda: check.served(odd_spec.worker_id) is not None)
                assert check.context_length() is None
                for engine in (deep, junk, huge):
                    assert check.served(EngineSpec(engine.host, engine.port).worker_id) is None
                assert not task.done()
            finally:
                task.cancel()
        finally:
            for engine in engines:
                await engine.stop()

    run(main())
