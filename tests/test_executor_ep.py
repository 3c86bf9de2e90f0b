"""Expert parallelism over 2 and 4 CPU ranks (gloo) equals the single-process model."""

import random

import pytest

torch = pytest.importorskip("torch")

from llmsched.executor.config import EngineConfig, ModelConfig  # noqa: E402
from llmsched.executor.engine import Engine, SamplingParams  # noqa: E402
from llmsched.executor.eplb import ExpertPlacement  # noqa: E402
from llmsched.executor.expert_parallel import AllToAllExperts, launch  # noqa: E402
from llmsched.executor.model import (  # noqa: E402
    ForwardBatch,
    MoETransformer,
    PagedKV,
    SequenceChunk,
)
from llmsched.executor.rebalance import ExpertRebalancer  # noqa: E402

torch.set_num_threads(1)
CONFIG = ModelConfig()
PARAMS = SamplingParams(max_tokens=10)
NUM_PROMPTS = 6
REPLICATED = ExpertPlacement.from_phy2log(
    [[0, 1, 2, 3, 4, 5, 6, 7, 6, 1, 2, 3], [7, 1, 2, 3, 4, 5, 6, 0, 0, 0, 5, 6]], 8
)


def all_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(rng.randrange(4, 60))] for _ in range(NUM_PROMPTS)]


def serve(rank, world, placement, dbo, rebalance_at=None):
    """Serve this rank's share of the prompts in lockstep; returns {prompt index: tokens}."""
    model = MoETransformer(CONFIG, AllToAllExperts.build(CONFIG, placement))
    engine = Engine(
        model, EngineConfig(num_blocks=48, max_num_batched_tokens=40), dual_batch_overlap=dbo
    )
    rebalancer = ExpertRebalancer(model, num_gpus=world)
    engine.step_hooks.append(rebalancer)
    for index, prompt in enumerate(all_prompts()):
        if index % world == rank:
            engine.add_request(str(index), prompt, PARAMS)
    results, step = {}, 0
    while True:
        busy = torch.tensor([int(engine.has_unfinished() or rebalancer.pending)])
        torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
        if not busy.item():
            break
        if step == rebalance_at:
            rebalancer.trigger()
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.output_token_ids
        step += 1
    moved = [(s.layers_moved, len(s.step_stalls_s)) for s in rebalancer.history]
    return results, moved, model.backend.placement.phy2log.tolist()


def prefill_logits(rank, world, placement, dbo):
    """Logits of one prefill step over this rank's prompts."""
    model = MoETransformer(CONFIG, AllToAllExperts.build(CONFIG, placement))
    mine = [p for i, p in enumerate(all_prompts()) if i % world == rank]
    kv = PagedKV(CONFIG, 4 * len(mine), 16)
    chunks = [SequenceChunk(p, 0, list(range(4 * i, 4 * i + 4))) for i, p in enumerate(mine)]
    groups = [chunks[:1], chunks[1:]] if dbo else [chunks]
    return torch.cat(model.forward([ForwardBatch.build(g, 16) for g in groups], kv))


def rank_main(rank, world):
    contiguous = ExpertPlacement.contiguous(CONFIG.num_layers, CONFIG.num_experts)
    return {
        "logits": prefill_logits(rank, world, contiguous, False),
        "logits_dbo": prefill_logits(rank, world, REPLICATED, True),
        "plain": serve(rank, world, contiguous, False),
        "dbo": serve(rank, world, contiguous, True),
        "replicated_dbo": serve(rank, world, REPLICATED, True),
        "rebalanced": serve(rank, world, REPLICATED, False, rebalance_at=4),
    }


@pytest.fixture(scope="module")
def single_process():
    model = MoETransformer(CONFIG)
    tokens = Engine(model, EngineConfig(num_blocks=64)).generate(all_prompts(), PARAMS)
    logits = [model.forward_dense(p)[-1] for p in all_prompts()]
    return tokens, logits


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world, single_process) -> None:
    tokens, logits = single_process
    per_rank = launch(rank_main, world)
    for key in ("plain", "dbo", "replicated_dbo", "rebalanced"):
        merged = {}
        for rank_result in per_rank:
            merged.update(rank_result[key][0])
        assert [merged[i] for i in range(NUM_PROMPTS)] == tokens, key
    for rank, rank_result in enumerate(per_rank):
        expected = torch.stack(logits[rank::world])
        torch.testing.assert_close(rank_result["logits"], expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(rank_result["logits_dbo"], expected, atol=1e-4, rtol=0)
    # The rebalance moved both layers, one per step, while requests were being served, and
    # every rank ended with the same new placement.
    moved = [r["rebalanced"][1] for r in per_rank]
    placements = [r["rebalanced"][2] for r in per_rank]
    assert moved == [[(2, 2)]] * world
    assert all(p == placements[0] for p in placements)
    assert placements[0] != REPLICATED.phy2log.tolist()


def failing_rank(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    torch.distributed.barrier()  # would wait for rank 1 forever


def test_a_failing_rank_is_reported_and_the_others_stopped() -> None:
    # launch() raises instead of hanging, and raises the exception of the rank that failed
    # first (rank 0's barrier fails only once rank 1 is gone): it was a RuntimeError saying
    # "rank 1 exited with 1", the ValueError only on the rank's stderr.
    with pytest.raises(ValueError, match="rank 1 fails on purpose"):
        launch(failing_rank, 2)
