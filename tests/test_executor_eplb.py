"""DeepSeek EPLB: hand-checked tables, the pure-Python twin, and balance on recorded routing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsched.errors import ConfigError
from llmsched.executor.eplb import ExpertPlacement, gpu_loads, imbalance, rebalance_experts
from llmsched.reference import eplb as ref


def test_global_policy_replicates_the_hot_expert_and_balances_gpus() -> None:
    # 90/10/10/10 over 6 slots, 2 GPUs: expert 0 gets 3 replicas (30 each). Greedy packing of
    # slot loads 30,30,30,10,10,10 (three per GPU): 30->0, 30->1, 30->0 (tie), 10->1, 10->1,
    # 10->0, so GPU 0 carries 70 and GPU 1 50 (greedy, not optimal: 60/60 exists).
    phy2log, log2phy, logcnt = rebalance_experts([[90, 10, 10, 10]], 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    assert log2phy.tolist() == [[[0, 3, 1], [4, -1, -1], [5, -1, -1], [2, -1, -1]]]
    assert gpu_loads([[90, 10, 10, 10]], ExpertPlacement(phy2log, log2phy, logcnt), 2).tolist() == [
        [70.0, 50.0]
    ]


def test_hierarchical_policy_keeps_groups_on_one_node() -> None:
    # Groups {0,1}=16, {2,3}=2, {4,5}=7, {6,7}=5 onto 2 nodes, heaviest first into the lightest
    # node: g0 -> n0 (16), g2 -> n1 (7), g3 -> n1 (12), g1 -> n0 (18).
    load = [[8, 8, 1, 1, 4, 3, 3, 2]]
    phy2log, _, logcnt = rebalance_experts(load, 8, 4, 2, 4)
    assert set(phy2log[0, :4].tolist()) == {0, 1, 2, 3}
    assert set(phy2log[0, 4:].tolist()) == {4, 5, 6, 7}
    assert logcnt.tolist() == [[1] * 8]
    # Node 0's GPUs (two slots each), loads 8,8,1,1: 8 -> 0, 8 -> 1, 1 -> 0 (tie), 1 -> 1.
    # Node 1 (g2 then g3: loads 4,3,3,2): 4 -> 2, 3 -> 3, 3 -> 3 (lighter), 2 -> 2.
    assert phy2log[0].tolist() == [0, 2, 1, 3, 4, 7, 5, 6]


def test_hierarchical_replicas_stay_within_their_node() -> None:
    load = [[20, 1, 1, 1, 1, 1, 1, 1]]
    phy2log, _, logcnt = rebalance_experts(load, 12, 2, 2, 4)
    assert logcnt[0, 0] == 3  # node 0 has 6 slots for experts 0-3: two extras go to expert 0
    assert set(phy2log[0, :6].tolist()) == {0, 1, 2, 3}
    assert set(phy2log[0, 6:].tolist()) == {4, 5, 6, 7}


def test_falls_back_to_global_when_groups_do_not_divide_nodes() -> None:
    load = [[5, 4, 3, 2, 1, 9]]
    got = rebalance_experts(load, 6, 3, 2, 2)
    expected = rebalance_experts(load, 6, 1, 1, 2)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_ties_break_by_lowest_index() -> None:
    _, _, logcnt = rebalance_experts([[1, 1, 1, 1]], 6, 1, 1, 2)
    assert logcnt.tolist() == [[2, 2, 1, 1]]  # extras to experts 0 then 1
    # All loads equal: items in index order, each into the lowest-numbered open GPU.
    assert rebalance_experts(np.zeros((1, 4)), 4, 1, 1, 2)[0].tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([[1, 2, 3]], 2, 1, 1, 1), "num_replicas"),
        (([[1, 2, 3, 4]], 6, 1, 1, 4), "multiple of num_gpus"),
        (([[1, 2, 3, 4]], 4, 3, 1, 1), "equal groups"),
        (([[1, 2, 3, 4]], 6, 1, 3, 2), "multiple of num_nodes"),
        (([[1, -2, 3, 4]], 4, 1, 1, 1), "non-negative"),
        (([1, 2, 3, 4], 4, 1, 1, 1), "layers, experts"),
        (([[1, 2, 3, 4]], 4, 0, 1, 1), "num_groups"),
    ],
)
def test_impossible_layouts_raise(args, message) -> None:
    with pytest.raises(ConfigError, match=message):
        rebalance_experts(*args)


@st.composite
def eplb_cases(draw):
    num_gpus = draw(st.sampled_from([1, 2, 4]))
    num_nodes = draw(st.sampled_from([n for n in (1, 2, 4) if num_gpus % n == 0]))
    num_groups = draw(st.sampled_from([1, 2, 4, 8]))
    num_experts = num_groups * draw(st.integers(1, 3))
    if num_groups % num_nodes == 0 and num_experts % num_nodes:
        num_experts *= num_nodes
    extra = draw(st.integers(0, 2)) * num_gpus
    num_replicas = -(-num_experts // num_gpus) * num_gpus + extra
    loads = st.integers(0, 50) if draw(st.booleans()) else st.floats(0, 1e3)
    layers = draw(st.integers(1, 3))
    load = draw(
        st.lists(
            st.lists(loads, min_size=num_experts, max_size=num_experts),
            min_size=layers,
            max_size=layers,
        )
    )
    return load, num_replicas, num_groups, num_nodes, num_gpus


@settings(max_examples=150, deadline=None)
@given(eplb_cases())
def test_matches_pure_python_twin(case) -> None:
    load, *layout = case
    phy2log, log2phy, logcnt = rebalance_experts(load, *layout)
    twin = ref.rebalance_experts(load, *layout)
    assert phy2log.tolist() == twin[0]
    assert log2phy.tolist() == twin[1]
    assert logcnt.tolist() == twin[2]
    placement = ExpertPlacement(phy2log, log2phy, logcnt)  # validates the maps agree
    # Every slot is used once, and the result never loses to the contiguous baseline.
    num_replicas, _, _, num_gpus = layout
    assert placement.num_slots == num_replicas
    per_gpu = gpu_loads(load, placement, num_gpus)
    assert np.allclose(per_gpu.sum(axis=1), np.asarray(load, dtype=float).sum(axis=1))


torch = pytest.importorskip("torch")


def test_eplb_lowers_max_over_mean_gpu_load_on_recorded_routing() -> None:
    """Route a workload through the model, rebalance on its recorded load, route it again."""
    from llmsched.executor.config import EngineConfig, ModelConfig
    from llmsched.executor.engine import Engine, SamplingParams
    from llmsched.executor.model import LocalExperts, MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    torch.set_num_threads(1)
    config = ModelConfig(num_experts=16, top_k=2, num_layers=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=int(n)).tolist() for n in rng.integers(20, 80, 12)]
    params = SamplingParams(max_tokens=8)
    gpus = 4

    def serve(placement):
        model = MoETransformer(config, LocalExperts.build(config, placement))
        Engine(model, EngineConfig(num_blocks=96)).generate(prompts, params)
        return model

    contiguous = ExpertPlacement.contiguous(2, 16)
    baseline = serve(contiguous)
    load = baseline.load_snapshot()
    assert imbalance(load, contiguous, gpus) > 1.3  # the skewed router is uneven
    for slots in (16, 24):
        balanced = ExpertPlacement.rebalanced(load, slots, 1, 1, gpus)
        predicted = imbalance(load, balanced, gpus)
        assert predicted < imbalance(load, contiguous, gpus)
        # Executing with the new map: the measured per-GPU token counts agree.
        measured = serve(balanced).slot_load.numpy().reshape(2, gpus, -1).sum(axis=-1)
        measured_ratio = float((measured.max(axis=1) / measured.mean(axis=1)).mean())
        baseline_gpu = baseline.slot_load.numpy().reshape(2, gpus, -1).sum(axis=-1)
        baseline_ratio = float((baseline_gpu.max(axis=1) / baseline_gpu.mean(axis=1)).mean())
        assert measured_ratio < baseline_ratio
        assert measured_ratio == pytest.approx(predicted, abs=0.05), slots

    # Online: record, rebalance in the background, move layer by layer, same tokens throughout.
    model = MoETransformer(
        config, LocalExperts.build(config, ExpertPlacement.contiguous(2, 16, 24))
    )
    engine = Engine(model, EngineConfig(num_blocks=96))
    expected = Engine(MoETransformer(config), EngineConfig(num_blocks=96)).generate(prompts, params)
    rebalancer = ExpertRebalancer(model, num_gpus=gpus)
    engine.step_hooks.append(rebalancer)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            rebalancer.trigger()
            rebalancer.wait()
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.output_token_ids
        steps += 1
    assert [results[i] for i in range(len(prompts))] == expected
    (stats,) = rebalancer.history
    assert stats.layers_moved == 2 and len(stats.step_stalls_s) == 2
    assert model.backend.placement.num_slots == 24
    assert imbalance(load, model.backend.placement, gpus) < imbalance(load, contiguous, gpus)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"num_nodes": 2, "num_gpus": 1}, "multiple of num_nodes"),
        ({"num_groups": 3}, "3 equal groups"),
        ({"num_gpus": 0}, "num_gpus must be a positive int"),
    ],
)
def test_rebalancer_layouts_are_checked_when_built(layout, message) -> None:
    """They failed on the background thread and only surfaced at a later step (probe 60)."""
    from llmsched.executor.config import ModelConfig
    from llmsched.executor.model import MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    with pytest.raises(ConfigError, match=message):
        ExpertRebalancer(MoETransformer(ModelConfig()), **layout)


def test_a_failed_background_rebalance_is_raised_once_and_can_be_retried(monkeypatch) -> None:
    """Every later step raised the same error and trigger() said a rebalance was in progress,
    so the engine could not serve again (probe 60)."""
    from llmsched.executor.config import EngineConfig, ModelConfig
    from llmsched.executor.engine import Engine, SamplingParams
    from llmsched.executor.model import MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    torch.set_num_threads(1)
    model = MoETransformer(ModelConfig())
    engine = Engine(model, EngineConfig(num_blocks=8))
    engine.generate([list(range(40))], SamplingParams(max_tokens=1))
    load = model.load_snapshot()
    rebalancer = ExpertRebalancer(model, num_gpus=2)
    engine.step_hooks.append(rebalancer)

    def fail(*args, **kwargs):
        raise RuntimeError("placement failed")

    monkeypatch.setattr(ExpertPlacement, "rebalanced", fail)
    rebalancer.trigger()
    rebalancer.wait()
    with pytest.raises(RuntimeError, match="placement failed"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert not rebalancer.pending
    # The load it took for the failed placement is counted again, not lost.
    assert (model.load_snapshot() >= load).all()
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    rebalancer.trigger()
    rebalancer.wait()
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert not rebalancer.pending and len(rebalancer.history) == 1


def test_a_failed_stop_the_world_rebalance_keeps_the_load(monkeypatch) -> None:
    from llmsched.executor.config import ModelConfig
    from llmsched.executor.model import MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    torch.set_num_threads(1)
    model = MoETransformer(ModelConfig())
    model.forward_dense(list(range(20)))
    load = model.load_snapshot()
    rebalancer = ExpertRebalancer(model, num_gpus=2)

    def fail(*args, **kwargs):
        raise RuntimeError("placement failed")

    monkeypatch.setattr(ExpertPlacement, "rebalanced", fail)
    with pytest.raises(RuntimeError, match="placement failed"):
        rebalancer.rebalance_now()
    assert (model.load_snapshot() == load).all() and load.sum() > 0
    monkeypatch.undo()
    assert rebalancer.rebalance_now().layers_moved == 2
