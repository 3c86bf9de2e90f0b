"""``EngineGrid`` (``llmsched calibrate --engine``'s grid) takes counts only: a fractional,
boolean, text or NaN length, batch or repeat count was accepted and failed once timing had
started (``range(16.5)``; an engine refusing ``max_tokens: 4.5``), or was a bare TypeError."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmsched.calibrate import EngineGrid
from llmsched.errors import ConfigError


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prompt_lens", (16.5,), r"prompt_lens must hold ints, got 16\.5"),
        ("prompt_lens", "16", "prompt_lens must be a tuple of ints, got '16'"),
        ("prompt_lens", 16, "prompt_lens must be a tuple of ints, got 16"),
        ("batch_sizes", (1, True), "batch_sizes must hold ints, got True"),
        ("context_lens", (16, "32"), "context_lens must hold ints, got '32'"),
        ("prefill_batches", (2.5,), r"prefill_batches must hold ints, got 2\.5"),
        ("repeats", 1.5, r"repeats must hold ints, got 1\.5"),
        ("decode_tokens", math.nan, "decode_tokens must hold ints, got nan"),
        ("decode_tokens", 4.0, r"decode_tokens must hold ints, got 4\.0"),
    ],
)
def test_a_grid_value_that_is_not_a_count_is_named(field: str, value: object, message) -> None:
    with pytest.raises(ConfigError, match=f"calibration grid: {message}"):
        EngineGrid(**{field: value})  # type: ignore[arg-type]


def test_lists_and_numpy_counts_are_counts() -> None:
    grid = EngineGrid(
        prompt_lens=list(np.array([16, 64])),  # type: ignore[arg-type]
        batch_sizes=[1, 2],  # type: ignore[arg-type]
        context_lens=(np.int64(16),),  # type: ignore[arg-type]
        repeats=np.int32(2),  # type: ignore[arg-type]
        prefill_batches=(),
    )
    assert (grid.prompt_lens, grid.batch_sizes, grid.context_lens) == ((16, 64), (1, 2), (16,))
    assert type(grid.prompt_lens[0]) is int and type(grid.repeats) is int
    assert [p.prompt_len for p in grid.points(None, None)] == [16, 64, 16, 16]
