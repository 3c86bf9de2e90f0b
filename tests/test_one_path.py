"""One hashing path, one endpoint identity, and loud mismatches.

The same text stored and routed through every public path matches; a text pick on an index fed
by engine events warns; a block-size mismatch between engine events and the index warns once
per worker and is counted; a named endpoint scraped and subscribed stays one endpoint; a stale
row is marked in ``explain()``.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import llmsched
from llmsched import Endpoint, EndpointPool, PrefixIndex, Router, Scheduler
from llmsched.errors import ConfigError
from llmsched.integrations import EngineSpec, KVEventSubscriber, MetricsScraper, resolve_engines
from llmsched.routing import PSEUDO_TOKEN_NOTE, render_messages
from llmsched.testing import FakeHTTPEngine, FakeKVPublisher, event_batch, stored_event

TEXT = "You are a terse assistant. Answer in one line. Ünïcödé ✓ " * 12
MESSAGES = [{"role": "system", "content": TEXT}, {"role": "user", "content": "hi"}]


def one_prefix_config(block_size: int | None = None) -> dict[str, object]:
    params = {} if block_size is None else {"blockSize": block_size}
    return {
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": params},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


# --- one hashing path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "seed", "model"), [(None, 0, None), (4, 0, None), (64, 7, "tiny")]
)
def test_text_hashes_agree_across_every_public_path(
    block_size: int | None, seed: int, model: str | None
) -> None:
    index = PrefixIndex() if block_size is None else PrefixIndex(block_size, seed=seed, model=model)
    bs = index.block_size
    via_index = index.hash_text(TEXT)
    via_helper = llmsched.text_block_hashes(TEXT, bs, seed=index.seed, model=index.model)
    via_tokens = index.hash_tokens(llmsched.pack_text(TEXT))
    via_blocks = llmsched.block_hashes(llmsched.pack_text(TEXT), bs, seed=seed, model=model)
    assert len(via_index) == len(TEXT.encode()) // 4 // bs > 0
    for other in (via_helper, via_tokens, via_blocks):
        assert via_index.tolist() == other.tolist()
    if block_size is None:  # the defaults agree with no argument at all
        assert llmsched.text_block_hashes(TEXT).tolist() == via_index.tolist()
    # What the router matches is what the index stored: a full hit on the holder.
    pool = EndpointPool(["a", "b"], stale_policy="ignore")
    router = Router(pool, index, config=one_prefix_config(block_size))
    index.store("a", via_index)
    decision = router.pick(text=TEXT, now=0.0)
    assert decision.endpoint == "a"
    assert decision.cached == len(via_index) * bs
    # A chat prompt hashes as its rendering does.
    index.store("b", index.hash_text(render_messages(MESSAGES)))
    chat = router.pick(messages=MESSAGES, now=0.0)
    assert chat.endpoint == "b" and chat.cached > decision.cached


def test_lora_and_salt_reach_every_path_alike() -> None:
    index = PrefixIndex(8, seed=3, model="m")
    kw = {"lora": "sql", "cache_salt": "tenant-1"}
    a = index.hash_text(TEXT, **kw)
    b = llmsched.text_block_hashes(TEXT, 8, seed=3, model="m", **kw)
    assert a.tolist() == b.tolist()
    assert a.tolist() != index.hash_text(TEXT).tolist()
    pool = EndpointPool(["x", "y"], stale_policy="ignore")
    index.store("y", a)
    router = Router(pool, index, config=one_prefix_config(8))
    assert router.pick(text=TEXT, now=0.0, **kw).endpoint == "y"


# --- text picks on an index fed by engine events --------------------------------------------


def engine_fed_index(block_size: int = 4) -> PrefixIndex:
    index = PrefixIndex(block_size)
    tokens = list(range(1, 1 + block_size * 2))
    index.apply_vllm_events("a", event_batch(stored_event([11, 12], None, tokens, block_size)))
    return index


def test_text_pick_on_engine_fed_index_warns_once_counts_and_explains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = engine_fed_index()
    assert index.fed_by_engine_events and index.stats()["event_batches"] == 1
    router = Router(EndpointPool(["a"]), index, config="prefix-only")
    caplog.set_level(logging.WARNING, logger="llmsched")
    first = router.pick(text=TEXT, now=0.0)
    router.pick(messages=MESSAGES, now=0.0)
    warnings = [r for r in caplog.records if "pseudo-tokens" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].name == "llmsched"
    assert router.stats()["pseudo_token_picks"] == 2
    explained = first.explain()
    assert explained.notes and "pseudo-tokens" in explained.notes[0]
    assert str(explained).startswith("note: prompt given as text")
    # Token picks are not flagged.
    assert router.pick(tokens=[1, 2, 3, 4], now=0.0).explain().notes == []


def test_pseudo_tokens_opt_in_and_router_fed_index_stay_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    opted = Router(EndpointPool(["a"]), engine_fed_index(), allow_pseudo_tokens=True)
    assert opted.pick(text=TEXT, now=0.0).explain().notes == []
    own = Router(EndpointPool(["a"]), PrefixIndex(4), config="prefix-only")
    with own.pick(text=TEXT, now=0.0) as d:  # records approximate entries: not engine events
        assert d.explain().notes == []
    assert not own.index.fed_by_engine_events
    assert own.pick(text=TEXT, now=0.0).explain().notes == []
    assert opted.stats()["pseudo_token_picks"] == own.stats()["pseudo_token_picks"] == 0
    assert not [r for r in caplog.records if r.name == "llmsched"]
    with pytest.raises(TypeError, match="allow_pseudo_tokens"):
        Router(EndpointPool(["a"]), allow_pseudo_tokens=1)  # type: ignore[arg-type]


def test_the_pseudo_token_note_is_listed_with_the_other_notes() -> None:
    """The note was logged, counted in ``pseudo_token_picks`` and put in ``explain()``, but
    listed in no ``warnings`` and counted in no ``config_warnings``: a gateway without a
    tokenizer in front of engines publishing KV events showed
    ``llmsched_gateway_config_warnings 0``."""
    scheduler = Scheduler(["a", "b"], router="prefix-only", block_size=4)
    router = scheduler.router
    tokens = list(range(1, 9))
    scheduler.index.apply_vllm_events("a", event_batch(stored_event([11, 12], None, tokens, 4)))
    before, count = scheduler.warnings, scheduler.stats()["config_warnings"]
    assert router.pseudo_token_warning is None
    assert PSEUDO_TOKEN_NOTE not in router.warnings
    router.pick(tokens=tokens, now=0.0)  # token picks are not flagged
    assert router.pseudo_token_warning is None
    router.pick(text=TEXT, now=0.0)
    router.pick(messages=MESSAGES, now=0.0)
    assert router.pseudo_token_warning == PSEUDO_TOKEN_NOTE
    assert router.warnings.count(PSEUDO_TOKEN_NOTE) == 1
    assert router.stats()["config_warnings"] == len(router.warnings)
    assert scheduler.warnings == [*before, PSEUDO_TOKEN_NOTE]
    assert scheduler.stats()["config_warnings"] == count + 1
    opted = Router(EndpointPool(["a"]), engine_fed_index(), allow_pseudo_tokens=True)
    opted.pick(text=TEXT, now=0.0)
    assert opted.pseudo_token_warning is None and opted.warnings == []


# --- block-size mismatch --------------------------------------------------------------------


def test_block_size_mismatch_warns_once_per_worker_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    index = PrefixIndex(64)  # llm-d's hashBlockSize default, against vLLM's 16-token blocks
    for worker in ("a", "a", "b"):
        for _ in range(2):
            payload = event_batch(stored_event([1, 2], None, list(range(32)), 16))
            report = index.apply_vllm_events(worker, payload)
            assert report["block_size_mismatch"] == 1 and report["blocks_stored"] == 0
    warned = [r.getMessage() for r in caplog.records if "block size" in r.getMessage()]
    assert len(warned) == 2
    assert "'a'" in warned[0] and "'b'" in warned[1] and "64" in warned[0]
    assert index.stats()["block_size_mismatch"] == {"a": 4, "b": 2}
    assert PrefixIndex(16).stats()["block_size_mismatch"] == {}


# --- stale rows in explain() ----------------------------------------------------------------


def test_stale_rows_are_marked_with_the_reason() -> None:
    pool = EndpointPool(["fresh", "silent", "old"], stale_after_s=1.0)
    pool.update("fresh", waiting=0, now=10.0)
    pool.update("old", waiting=0, now=5.0)
    decision = Router(pool, config="least-load").pick(tokens=[1, 2, 3], now=10.5)
    assert decision.endpoint == "fresh"
    profile = decision.explain()["default"]
    assert profile.row("fresh").note is None and not profile.row("fresh").saturated
    assert "no metrics reported" in (profile.row("silent").note or "")
    assert "5.5 s old at the pick" in (profile.row("old").note or "")
    text = str(profile)
    assert "silent *" in text and "old *" in text and "fresh *" not in text
    assert "* old: saturated: metrics 5.5 s old at the pick (stale after 1 s)" in text


def test_default_staleness_is_several_scrape_intervals() -> None:
    from llmsched.integrations.metrics import DEFAULT_INTERVAL_S

    assert EndpointPool().stale_after_s >= 3 * DEFAULT_INTERVAL_S
    flow = llmsched.flow.default_config()["saturation"]["staleness_s"]
    assert flow >= 3 * DEFAULT_INTERVAL_S


# --- one endpoint identity ------------------------------------------------------------------


def test_resolve_engines_names_after_the_pool_and_refuses_conflicts() -> None:
    pool = EndpointPool(
        [Endpoint("engine-a", address="http://10.0.0.7:8000/"), Endpoint("10.0.0.8:8000")]
    )
    a, b, c = resolve_engines(
        [EngineSpec("10.0.0.7", 8000), EngineSpec("10.0.0.8", 8000), EngineSpec("10.0.0.9", 80)],
        pool,
    )
    assert (a.worker_id, b.worker_id, c.worker_id) == ("engine-a", "10.0.0.8:8000", "10.0.0.9:80")
    with pytest.raises(ConfigError, match=r"'engine-a' is at 10\.0\.0\.9:8000"):
        resolve_engines([EngineSpec("10.0.0.9", 8000, name="engine-a")], pool)
    ranks = EndpointPool([Endpoint("r0", address="h:1"), Endpoint("r1", address="h:1")])
    with pytest.raises(ConfigError, match="several pool endpoints"):
        resolve_engines([EngineSpec("h", 1)], ranks)
    named = resolve_engines(
        [EngineSpec("h", 1, name="r0"), EngineSpec("h", 1, dp_rank=1, name="r1")], ranks
    )
    assert [s.worker_id for s in named] == ["r0", "r1"]
    with pytest.raises(ConfigError, match="both resolve to endpoint 'engine-a'"):
        resolve_engines([EngineSpec("10.0.0.7", 8000), EngineSpec("10.0.0.7", 8000, 1)], pool)
    with pytest.raises(ConfigError, match="name must be"):
        EngineSpec("h", 1, name="")


def test_named_endpoint_scraped_and_subscribed_stays_one_endpoint() -> None:
    metrics = "vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n"
    with FakeHTTPEngine(metrics_text=metrics) as http, FakeKVPublisher(topic="kv@a") as kv:
        pool = EndpointPool([Endpoint("engine-a", address=f"127.0.0.1:{http.port}")])
        spec = EngineSpec("127.0.0.1", http.port, **kv.spec_kwargs())  # unnamed, by address
        scraper = MetricsScraper([spec], pool=pool)
        asyncio.run(scraper.scrape_once())
        assert [(e["id"], e["waiting"], e["running"]) for e in pool.endpoints()] == [
            ("engine-a", 3, 2)
        ]
        assert list(scraper.snapshot()) == ["engine-a"]
        index = PrefixIndex(4)
        with KVEventSubscriber(index, [spec], pool=pool, backoff_s=(0.01, 0.05)) as sub:
            assert kv.wait_subscribed()
            kv.publish(event_batch(stored_event([5, 6], None, list(range(8)), 4)))
            assert sub.wait_for(lambda c: c["batches"] >= 1, 10.0), sub.counters()
        assert index.workers() == ["engine-a"]
        router = Router(pool, index, config="prefix-only")
        decision = router.pick(tokens=np.arange(8), now=0.0)
        assert decision.endpoint == "engine-a" and decision.cached == 8
        assert len(pool) == 1


HASH_64 = {
    "plugins": [
        {"type": "prefix-cache-scorer", "parameters": {"hashBlockSize": 64}},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "prefix-cache-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}


def test_a_hash_block_size_the_engines_do_not_use_is_refused_where_it_is_known() -> None:
    """llm-d's default ``hashBlockSize`` (64) against engines with 16-token blocks: every
    stored event would be skipped. Where the engines' block size is given (the gateway's
    ``block_size``, the pipeline's ``block_size``, an index of that size) it is refused,
    naming both."""
    from llmsched import Scheduler

    with pytest.raises(ConfigError, match="64"):
        Scheduler(["a"], router=HASH_64, block_size=16)
    with pytest.raises(ConfigError, match="64"):
        Router(EndpointPool(["a"]), PrefixIndex(16), config=HASH_64)
    pytest.importorskip("aiohttp", reason="the gateway extra")
    from llmsched.gateway.config import load_config

    with pytest.raises(ConfigError, match="block_size: is 16 but the router config asks for"):
        load_config(
            {
                "models": ["m"],
                "engines": [{"host": "127.0.0.1", "port": 8000}],
                "block_size": 16,
                "router": HASH_64,
            }
        )
