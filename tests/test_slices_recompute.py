"""The switch-cost model's recompute count against what the reference executor recomputes.

A continuation re-sends the prompt and the tokens generated so far; with nothing evicted the
engine finds every full block of it cached but one: a prefix-cache hit always leaves the last
token to compute (its logits are needed), and the last, partial block was never cached. The
cost model charged no recompute then (probe 77 saw 16 tokens recomputed at contexts of 48, 64
and 80 with blocks of 16).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from llmsched.executor.config import EngineConfig, ModelConfig  # noqa: E402
from llmsched.executor.engine import Engine, SamplingParams  # noqa: E402
from llmsched.executor.model import MoETransformer  # noqa: E402
from llmsched.slices import SwitchCostModel  # noqa: E402

torch.set_num_threads(1)

GENERATED = 5  # tokens the first slice generates; the rest of the context is prompt


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    return MoETransformer(ModelConfig())


def _recomputed(model: MoETransformer, context: int, block_size: int, *, evict: bool) -> int:
    """Tokens the executor computes for a continuation of a request with ``context`` tokens
    (prompt and output), after a first slice ran on the same engine (its cache wiped first
    when ``evict``)."""
    rng = random.Random(context * 1000 + block_size)
    prompt = [rng.randrange(512) for _ in range(context - GENERATED)]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=block_size))
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=GENERATED))
    if evict:
        assert engine.reset_prefix_cache()
    before = engine.metrics()
    engine.generate([prompt + first], SamplingParams(max_tokens=1))
    after = engine.metrics()
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    assert queried == context
    return queried - (after.prefix_cache_hits - before.prefix_cache_hits)


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("context", [48, 49, 50, 63, 64, 80, 97])
def test_the_recompute_count_is_what_the_executor_recomputes(
    model: MoETransformer, context: int, block_size: int
) -> None:
    cost = SwitchCostModel(block_size=block_size)
    executor = _recomputed(model, context, block_size, evict=False)
    assert 1 <= executor <= block_size
    assert cost.recompute_tokens(context) == executor
    # The switch cost charges it even though nothing was evicted.
    seconds = executor / cost.prefill_tokens_per_s + cost.requeue_delay_s
    assert cost.switch_s(context, demand_tokens=0, free_tokens=10**6) == pytest.approx(seconds)


@pytest.mark.parametrize("context", [48, 50])
def test_an_evicted_context_is_recomputed_whole(model: MoETransformer, context: int) -> None:
    executor = _recomputed(model, context, 16, evict=True)
    assert executor == context
    assert SwitchCostModel().recompute_tokens(context, demand_tokens=context) == executor


def test_the_default_block_size_is_the_engines() -> None:
    assert SwitchCostModel().block_size == EngineConfig().block_size == 16
