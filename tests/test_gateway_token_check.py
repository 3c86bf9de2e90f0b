"""Both data planes check the prompts they route on against the engines' KV events.

The Python plane routes with ``Router.pick``, which samples its token prompts (one a second, of
512 tokens or more) and looks for each one's first block among the blocks the engines reported
5 to 60 s later, and counts (and warns of) text hashed as pseudo-tokens while engine events
feed the index. The native plane tokenizes and decides natively, outside ``pick``: it ran
neither check (``token_prompts_*`` and ``pseudo_token_picks`` stayed 0 however it routed). It
now runs both, counted in the same ``Router.stats()`` and warned once through logging as the
router warns.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from _gateway_harness import MODEL, plane, rig, run, until  # noqa: F401 (the fixture)

from llmsched.routing import PSEUDO_TOKEN_NOTE, TOKEN_CHECK_AFTER_S, TOKEN_CHECK_MIN_TOKENS
from llmsched.testing import event_batch, stored_event

pytestmark = pytest.mark.usefixtures("plane")

BLOCK = 4  # the rig's block_size


def test_token_prompts_are_checked_and_text_prompts_counted_on_both_planes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")

    def pseudo_warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == f"router: {PSEUDO_TOKEN_NOTE}"]

    async def body() -> None:
        async with rig(engines=1) as r:
            worker = r.gateway.config.engines[0].worker_id
            ids = [(i * 7919) % 30_000 + 2 for i in range(TOKEN_CHECK_MIN_TOKENS + 88)]
            stats = r.gateway.router.stats()
            assert stats["token_prompts_confirmed"] == stats["pseudo_token_picks"] == 0
            # The engine reports the prompt's first block, as its KV events would.
            stored = stored_event([11], None, ids[:BLOCK], BLOCK)
            r.gateway.index.apply_vllm_events(worker, event_batch(stored))
            for i in range(3):
                assert (await r.complete(f"a text prompt {i}")).status == 200
            assert (await r.complete(ids)).status == 200
            # Judged from 5 s after its pick, at the next token pick.
            await asyncio.sleep(TOKEN_CHECK_AFTER_S + 0.5)
            assert (await r.complete(ids)).status == 200
            stats = r.gateway.router.stats()
            assert stats["pseudo_token_picks"] == 3
            assert stats["token_prompts_confirmed"] == 1
            assert stats["token_prompts_unconfirmed"] == 0
            assert r.gateway.router.token_warning is None
            await until(lambda: len(pseudo_warnings()) == 1)
            assert pseudo_warnings()[0].name == "llmsched"
            # Listed with the other notes, and counted in the gateway's metric.
            assert r.gateway.router.pseudo_token_warning == PSEUDO_TOKEN_NOTE
            assert PSEUDO_TOKEN_NOTE in r.gateway.scheduler.warnings
            warnings = len(r.gateway.scheduler.warnings)
            assert r.metric("llmsched_gateway_config_warnings") == warnings > 0

    run(body())


def test_every_slice_of_a_sliced_request_is_checked_on_both_planes() -> None:
    """Each engine call of a sliced request is a pick, and the Python plane's ``Router.pick``
    checks each one: the first slice and every continuation. The native plane ran neither
    check on a sliced request (it decides each slice outside the path that checks an
    unsliced one): a chat without a tokenizer counted 3 pseudo-token picks on one plane and
    0 on the other, and a sliced token prompt was never sampled there. Both now check every
    call, as one rule: a slice's call counts as any pick."""

    async def body() -> None:
        slices = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 4}}
        async with rig(engines=1, answer_tokens=100, slices=slices) as r:
            worker = r.gateway.config.engines[0].worker_id
            ids = [(i * 7919) % 30_000 + 2 for i in range(TOKEN_CHECK_MIN_TOKENS + 88)]
            stored = stored_event([11], None, ids[:BLOCK], BLOCK)
            r.gateway.index.apply_vllm_events(worker, event_batch(stored))
            chat = {
                "model": MODEL,
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "Tell me a story"}],
            }
            async with r.client.post(r.url("/v1/chat/completions"), json=chat) as response:
                assert response.status == 200, await response.read()
            assert [q.body["max_tokens"] for q in r.engines[0].received] == [4, 4, 2]
            # Three calls hashed as pseudo-tokens: three picks counted.
            assert r.gateway.router.stats()["pseudo_token_picks"] == 3
            # A token prompt in slices: its first call is sampled, and judged at a pick 5 s
            # later (the next sliced request's first call).
            assert (await r.complete(ids, max_tokens=10)).status == 200
            await asyncio.sleep(TOKEN_CHECK_AFTER_S + 0.5)
            assert (await r.complete(ids, max_tokens=10)).status == 200
            stats = r.gateway.router.stats()
            assert stats["token_prompts_confirmed"] == 1
            assert stats["token_prompts_unconfirmed"] == 0
            assert r.metric("llmsched_gateway_slices_total") == 9

    run(body())
