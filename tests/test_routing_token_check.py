"""A router given other token ids than the engines cache says so (probe 81).

An embedder tokenizes prompts itself and passes ``Router.pick(tokens=...)``. When its ids differ
from the engine's (a BOS token added twice, a chat template applied on one side only, another
tokenizer), no prompt ever matches a block the engines report, and routing falls back to the
router's own short-lived records and load, with nothing said. The router samples its token
prompts and looks for each one's first block among the blocks the engines reported: none found
while events flow is warned once, counted in ``stats()`` and noted in ``explain()``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from llmsched import EndpointPool, PrefixIndex, Router, Scheduler
from llmsched.routing import (
    TOKEN_CHECK_GIVE_UP_S,
    TOKEN_CHECK_MIN_TOKENS,
    TOKEN_CHECK_VERDICT,
)
from llmsched.testing import event_batch, stored_event

BOS = 1
BLOCK = 16


def prompts(count: int, length: int = 600) -> list[list[int]]:
    """Distinct prompts as the engine tokenizes them (one BOS, then the text's ids)."""
    rng = np.random.default_rng(81)
    return [[BOS, *rng.integers(2, 30_000, length).tolist()] for _ in range(count)]


def serve(
    router: Router,
    index: PrefixIndex,
    engine_prompts: list[list[int]],
    given: list[list[int]],
    *,
    lora: str | None = None,
    engine_lora: str | None = None,
    events: bool = True,
) -> None:
    """One request a second: picked on ``given``, started, and (with ``events``) reported by
    the engine as its own tokens' blocks (a removal of nothing still makes a batch)."""
    for i, (engine, ids) in enumerate(zip(engine_prompts, given, strict=True)):
        decision = router.pick(tokens=ids, lora=lora, now=float(i))
        decision.started(now=float(i))
        decision.finished()
        full = len(engine) // BLOCK * BLOCK
        hashes = list(range(i * 1_000, i * 1_000 + full // BLOCK))
        extra = {} if engine_lora is None else {"lora_name": engine_lora}
        stored = stored_event(hashes, None, engine[:full], BLOCK, **extra)
        if events or i == 0:
            index.apply_vllm_events(decision.endpoint, event_batch(stored))


def fleet() -> tuple[Router, PrefixIndex]:
    index = PrefixIndex(block_size=BLOCK)
    return Router(EndpointPool(["a", "b"]), index, config="llm-d", seed=0), index


def mismatch_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "ever found in an engine's reported cache" in r.message]


def test_bos_added_twice_is_warned_once_counted_and_explained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    router, index = fleet()
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    serve(router, index, engine, [[BOS, *p] for p in engine])  # the user's tokenizer adds one
    stats = router.stats()
    assert stats["token_prompts_confirmed"] == 0
    assert stats["token_prompts_unconfirmed"] >= TOKEN_CHECK_VERDICT
    warned = mismatch_warnings(caplog)
    assert len(warned) == 1 and warned[0].name == "llmsched"
    assert "BOS token added twice" in warned[0].message
    assert "docs/integrations.md" in warned[0].message
    notes = router.pick(tokens=engine[0], now=1e4).explain().notes
    assert len(notes) == 1 and "0 found" in notes[0]


def test_engine_tokens_confirm_and_stay_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    router, index = fleet()
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    serve(router, index, engine, engine)
    stats = router.stats()
    assert stats["token_prompts_unconfirmed"] == 0
    assert stats["token_prompts_confirmed"] >= TOKEN_CHECK_VERDICT
    assert not mismatch_warnings(caplog)
    assert router.pick(tokens=engine[0], now=1e4).explain().notes == []


def test_an_adapter_named_otherwise_than_the_engines_is_caught(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    router, index = fleet()
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    serve(router, index, engine, engine, lora="math", engine_lora="math-v2")
    assert router.stats()["token_prompts_confirmed"] == 0
    assert len(mismatch_warnings(caplog)) == 1


def test_no_verdict_without_events_after_the_pick_or_on_short_prompts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    count = int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20
    # The feed went quiet after the first batch: prompts are not judged.
    router, index = fleet()
    engine = prompts(count)
    serve(router, index, engine, [[BOS, *p] for p in engine], events=False)
    assert router.stats()["token_prompts_unconfirmed"] == 0
    # Prompts shorter than an engine block may leave nothing cached: not sampled.
    router, index = fleet()
    engine = prompts(count, length=TOKEN_CHECK_MIN_TOKENS - 3)  # 511 ids given
    serve(router, index, engine, [[BOS, *p] for p in engine])
    assert router.stats()["token_prompts_unconfirmed"] == 0
    # A router whose index no engine feeds samples nothing.
    alone = Router(EndpointPool(["a"]), PrefixIndex(block_size=BLOCK), config="llm-d")
    for i, p in enumerate(prompts(count)):
        alone.pick(tokens=p, now=float(i)).started(now=float(i))
    assert alone.stats()["token_prompts_unconfirmed"] == 0
    assert not mismatch_warnings(caplog)


def test_the_warning_is_listed_in_router_warnings_and_counted() -> None:
    router, index = fleet()
    assert router.token_warning is None
    before = router.warnings
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    serve(router, index, engine, [[BOS, *p] for p in engine])
    token = router.token_warning
    assert token is not None and "BOS token added twice" in token
    assert router.warnings == [*before, token]
    assert router.stats()["config_warnings"] == len(before) + 1
    # The text stays as logged (the count then), while later checks go on counting.
    unconfirmed = router.stats()["token_prompts_unconfirmed"]
    serve(router, index, engine[:40], [[BOS, *p] for p in engine[:40]])
    assert router.stats()["token_prompts_unconfirmed"] >= unconfirmed
    assert router.warnings == [*before, token]


def test_a_scheduler_lists_its_routers_token_warning() -> None:
    """Scheduler.warnings (the gateway's llmsched_gateway_config_warnings) shows it too."""
    scheduler = Scheduler(["a", "b"], router="llm-d", block_size=BLOCK, seed=0)
    before = scheduler.warnings
    count = scheduler.stats()["config_warnings"]
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    # The scheduler's own router and index, as its placements use them.
    serve(scheduler.router, scheduler.index, engine, [[BOS, *p] for p in engine])
    token = scheduler.router.token_warning
    assert token is not None
    assert scheduler.warnings == [*before, token]
    assert scheduler.stats()["config_warnings"] == count + 1


def test_a_scheduler_whose_tokens_match_lists_nothing_more() -> None:
    scheduler = Scheduler(["a", "b"], router="llm-d", block_size=BLOCK, seed=0)
    before = scheduler.warnings
    engine = prompts(int(TOKEN_CHECK_GIVE_UP_S) + TOKEN_CHECK_VERDICT + 20)
    serve(scheduler.router, scheduler.index, engine, engine)
    assert scheduler.router.stats()["token_prompts_confirmed"] >= TOKEN_CHECK_VERDICT
    assert scheduler.router.token_warning is None
    assert scheduler.warnings == before
