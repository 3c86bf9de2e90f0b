"""Expert placements and the rebalancer under tables and arguments they cannot use: each is a
ConfigError naming the problem, never a placement that routes tokens to the wrong expert."""

import numpy as np
import pytest

from llmsched.errors import ConfigError
from llmsched.executor.eplb import ExpertPlacement, gpu_loads, imbalance


def _swapped_log2phy() -> ExpertPlacement:
    good = ExpertPlacement.contiguous(1, 4)
    log2phy = good.log2phy.copy()
    log2phy[0, [0, 1]] = log2phy[0, [1, 0]]  # expert 0 listed at expert 1's slot, and back
    return ExpertPlacement(good.phy2log, log2phy, good.logcnt)


def test_a_log2phy_that_disagrees_with_phy2log_is_refused() -> None:
    # It was taken, and the executor sent expert 0's tokens to the slot holding expert 1.
    with pytest.raises(ConfigError, match="log2phy does not list the slots phy2log gives"):
        _swapped_log2phy()


@pytest.mark.parametrize(
    ("log2phy", "match"),
    [
        ([[[0, 0], [1, -1]]], "log2phy does not list"),  # one slot twice, slot 2 missing
        ([[[0, 2], [1, 5]]], "-1 past each expert's replica count"),
        ([[[0, 7], [1, -1]]], "log2phy does not list"),  # a slot past the table
        ([[[0], [1]]], "room for 1 replicas"),
    ],
)
def test_log2phy_must_list_each_experts_slots_once(log2phy: list[object], match: str) -> None:
    phy2log, logcnt = np.array([[0, 1, 0]]), np.array([[2, 1]])
    with pytest.raises(ConfigError, match=match):
        ExpertPlacement(phy2log, np.array(log2phy), logcnt)
    # The placement from_phy2log builds for the same table passes.
    assert ExpertPlacement.from_phy2log(phy2log, 2).log2phy.tolist() == [[[0, 2], [1, -1]]]


@pytest.mark.parametrize(
    ("phy2log", "match"),
    [
        (np.array([[-1, 0]]), "phy2log names experts outside 0..1"),  # bincount's ValueError
        (np.array([[0.0, 1.5]]), "phy2log must hold whole numbers"),  # a bare TypeError
        (np.array([0, 1]), "phy2log must be a 2-D array"),
        (np.array([["a", "b"]]), "phy2log must be an array of ints"),
    ],
)
def test_constructor_tables_of_the_wrong_kind(phy2log: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ExpertPlacement(phy2log, np.array([[[0], [1]]]), np.array([[1, 1]]))  # type: ignore[arg-type]


def test_constructor_takes_lists_and_whole_floats_as_int64_tables() -> None:
    p = ExpertPlacement([[0.0, 1.0]], [[[0], [1]]], [[1, 1]])  # type: ignore[arg-type]
    assert p.phy2log.dtype == np.int64 and p.log2phy.dtype == np.int64
    assert gpu_loads([[3, 1]], p, 2).tolist() == [[3.0, 1.0]]


@pytest.mark.parametrize("layer", [2, -1, 1.0, True])
def test_layer_index_out_of_range_is_refused(layer: object) -> None:
    p = ExpertPlacement.contiguous(2, 4)
    other = ExpertPlacement.from_phy2log([[3, 2, 1, 0]], 4)
    # layer(-1) and layer(2) were bare ValueErrors; with_layer(-1) replaced the last layer.
    with pytest.raises(ConfigError, match=r"layer must be an int in 0\.\.1"):
        p.layer(layer)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"layer must be an int in 0\.\.1"):
        p.with_layer(layer, other)  # type: ignore[arg-type]
    assert p.phy2log.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_with_layer_refuses_a_placement_of_other_experts() -> None:
    p = ExpertPlacement.contiguous(2, 4)
    with pytest.raises(ConfigError, match="placement of 2 experts, this one has 4"):
        p.with_layer(0, ExpertPlacement.from_phy2log([[0, 1, 0, 1]], 2))


@pytest.mark.parametrize("num_gpus", [0, -2, 2.0, True, None])
def test_gpu_count_must_be_a_positive_int(num_gpus: object) -> None:
    p = ExpertPlacement.contiguous(1, 4)
    # 0 was a ZeroDivisionError, -2 a numpy reshape error, 2.0 and True TypeErrors.
    with pytest.raises(ConfigError, match="num_gpus must be a positive int"):
        gpu_loads([[1, 2, 3, 4]], p, num_gpus)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_gpus must be a positive int"):
        imbalance([[1, 2, 3, 4]], p, num_gpus)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, 4, 4.5), "num_slots must be a positive int, got 4.5"),  # ran as 5 slots
        ((-1, 4), "num_layers must be a positive int"),
        ((1, 0, 4), "num_experts must be a positive int"),
    ],
)
def test_contiguous_sizes_are_checked(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ExpertPlacement.contiguous(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("table", [[[0.5, 1]], [[float("nan"), 1]]])
def test_from_phy2log_refuses_fractions(table: list[list[float]]) -> None:
    # 0.5 was truncated to expert 0; NaN a bare ValueError.
    with pytest.raises(ConfigError, match="phy2log must hold whole numbers"):
        ExpertPlacement.from_phy2log(table, 2)


@pytest.mark.parametrize("layers_per_step", [1.5, "2", 0])
def test_rebalancer_layers_per_step_is_an_int(layers_per_step: object) -> None:
    pytest.importorskip("torch")
    from llmsched.executor.config import ModelConfig
    from llmsched.executor.model import MoETransformer
    from llmsched.executor.rebalance import ExpertRebalancer

    model = MoETransformer(ModelConfig(num_layers=1, num_experts=2, top_k=1))
    # 1.5 was taken and failed at the first move (range() of a float); "2" a bare TypeError.
    with pytest.raises(ConfigError, match="layers_per_step must be an int >= 1"):
        ExpertRebalancer(model, layers_per_step=layers_per_step)  # type: ignore[arg-type]
