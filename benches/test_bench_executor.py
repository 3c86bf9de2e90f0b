"""Executor benchmarks: EPLB against its pure-Python twin, and the serving stall of a rebalance.

``eplb``: ``rebalance_experts`` (numpy) beside ``reference.eplb`` (plain lists) on a
DeepSeek-like shape (58 MoE layers, 256 experts, 288 slots, 8 groups, 4 nodes, 32 GPUs).

``expert-move``: a serving run of a mid-size model (8 MoE layers of 32 experts in 40 slots)
during which the experts are rebalanced, once layer by layer in the background and once
stop-the-world.
The interesting figure is the longest stall of serving, recorded in ``extra_info``
(``stall_ms``), next to the mean step time (``step_ms``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from llmsched.executor.eplb import rebalance_experts
from llmsched.reference import eplb as ref

EPLB_SHAPE = dict(num_replicas=288, num_groups=8, num_nodes=4, num_gpus=32)


def deepseek_like_load() -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(0)
    return rng.zipf(1.6, size=(58, 256)).clip(max=10_000).astype(np.float64)


def test_eplb_numpy(benchmark: Any) -> None:
    load = deepseek_like_load()
    expected = ref.rebalance_experts(load.tolist(), *EPLB_SHAPE.values())
    assert rebalance_experts(load, *EPLB_SHAPE.values())[0].tolist() == expected[0]
    benchmark.group = "eplb"
    benchmark.extra_info.update(layers=58, experts=256)
    benchmark(rebalance_experts, load, *EPLB_SHAPE.values())


def test_eplb_twin(benchmark: Any) -> None:
    load = deepseek_like_load().tolist()
    benchmark.group = "eplb"
    benchmark.extra_info.update(layers=58, experts=256)
    benchmark.pedantic(ref.rebalance_experts, args=(load, *EPLB_SHAPE.values()), rounds=3)


def serve_with_rebalance(stop_the_world: bool) -> dict[str, float]:
    import torch

    from llmsched.executor.config import EngineConfig, ModelConfig
    from llmsched.executor.engine import Engine, SamplingParams
    from llmsched.executor.eplb import ExpertPlacement
    from llmsched.executor.model import LocalExperts, MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    torch.set_num_threads(1)
    config = ModelConfig(
        num_layers=8,
        num_experts=32,
        hidden_size=128,
        expert_hidden_size=256,
        head_dim=32,
        num_heads=4,
        num_kv_heads=2,
        shared_expert_hidden_size=128,
    )
    placement = ExpertPlacement.contiguous(8, 32, 40)
    model = MoETransformer(config, LocalExperts.build(config, placement))
    engine = Engine(model, EngineConfig(num_blocks=128))
    rebalancer = ExpertRebalancer(model, num_gpus=8)
    engine.step_hooks.append(rebalancer)
    rng = np.random.default_rng(1)
    for i in range(4):
        engine.add_request(str(i), rng.integers(0, 512, 32).tolist(), SamplingParams(max_tokens=16))
    step_times, stall = [], 0.0
    step = 0
    while engine.has_unfinished():
        if step == 2:
            if stop_the_world:
                start = time.perf_counter()
                rebalancer.rebalance_now()
                stall = time.perf_counter() - start
            else:
                rebalancer.trigger()
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        step += 1
    (stats,) = rebalancer.history
    assert stats.layers_moved == 8
    if not stop_the_world:
        stall = max(stats.step_stalls_s)
    return {"stall_ms": stall * 1e3, "step_ms": float(np.median(step_times)) * 1e3}


@pytest.mark.parametrize("mode", ["layer_by_layer", "stop_the_world"])
def test_expert_move_stall(benchmark: Any, mode: str) -> None:
    benchmark.group = "expert-move"
    result = benchmark.pedantic(serve_with_rebalance, args=(mode == "stop_the_world",), rounds=2)
    benchmark.extra_info.update(result)
