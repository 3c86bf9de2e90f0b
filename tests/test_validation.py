"""llmsched.validation: one rule per kind of value, applied the same way by every component."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from llmsched import EndpointPool, PrefixIndex, Router
from llmsched.errors import InvalidValueError
from llmsched.flow import FlowController, FlowRequest
from llmsched.slices import SliceTracker
from llmsched.validation import (
    check_block_size,
    check_id,
    check_int,
    check_now,
    check_positive_seconds,
    check_probability,
    check_seed,
)


@pytest.mark.parametrize("now", [0, 0.0, 1.5, 10**6, np.float64(2.0)])
def test_check_now_accepts_finite_non_negative_seconds(now: object) -> None:
    assert check_now(now) == float(now)  # type: ignore[arg-type]
    assert type(check_now(now)) is float


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, -1, -1e-9])
def test_check_now_refuses_out_of_range(now: float) -> None:
    with pytest.raises(InvalidValueError, match="now must be a finite number of seconds >= 0"):
        check_now(now)


@pytest.mark.parametrize("now", [True, "1.0", b"1", [1.0]])
def test_check_now_refuses_non_numbers(now: object) -> None:
    with pytest.raises(TypeError, match="now must be a number of seconds"):
        check_now(now)


def test_check_now_reads_the_clock_for_none() -> None:
    assert check_now(None, clock=lambda: 7) == 7.0


def test_ints_sizes_seeds() -> None:
    assert check_int("n", 3, minimum=1, maximum=3) == 3
    with pytest.raises(InvalidValueError, match="n must be at least 1, got 0"):
        check_int("n", 0, minimum=1)
    with pytest.raises(InvalidValueError, match="n must be at most 3, got 4"):
        check_int("n", 4, maximum=3)
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        check_int("n", True)
    with pytest.raises(TypeError, match="n must be an int, got float"):
        check_int("n", 1.0)
    assert check_block_size(1) == 1
    with pytest.raises(InvalidValueError, match="block_size must be at least 1"):
        check_block_size(0)
    assert check_seed(2**64 - 1) == 2**64 - 1
    with pytest.raises(InvalidValueError, match=r"seed must be in 0\.\.2\*\*64-1"):
        check_seed(2**64)
    with pytest.raises(TypeError, match="seed must be an int"):
        check_seed("1")


def test_probabilities_durations_ids() -> None:
    assert check_probability("p", 0) == 0.0
    assert check_probability("p", 1) == 1.0
    for bad in (-0.1, 1.01, math.nan, math.inf):
        with pytest.raises(InvalidValueError, match=r"p must be in \[0, 1\]"):
            check_probability("p", bad)
    with pytest.raises(TypeError, match="p must be a number"):
        check_probability("p", None)
    assert check_positive_seconds("t", 2) == 2.0
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(InvalidValueError, match="t must be a finite number of seconds > 0"):
            check_positive_seconds("t", bad)
    assert check_id("worker", "w") == "w"
    assert check_id("worker", -(2**63)) == -(2**63)
    with pytest.raises(InvalidValueError, match="64 bits"):
        check_id("worker", 2**63)
    with pytest.raises(TypeError, match="worker must be an int or a str, got bool"):
        check_id("worker", False)


def _components() -> dict[str, Callable[[Any], object]]:
    index = PrefixIndex(block_size=2)
    pool = EndpointPool(["a"])
    router = Router(pool, config="prefix-only")
    flow = FlowController()
    tracker = SliceTracker("fixed", {"slice_tokens": 4})
    return {
        "PrefixIndex.record": lambda now: index.record("w", [1, 2], now=now),
        "PrefixIndex.match_tokens": lambda now: index.match_tokens([1, 2], now=now),
        "PrefixIndex.expire": lambda now: index.expire(now=now),
        "EndpointPool.update": lambda now: pool.update("a", waiting=1, now=now),
        "Router.pick": lambda now: router.pick(tokens=[1, 2], now=now),
        "FlowController.enqueue": lambda now: flow.enqueue(FlowRequest(1), now=now),
        "FlowController.saturation": lambda now: flow.saturation(now=now),
        "SliceTracker.promote": lambda now: tracker.promote(now=now),
    }


@pytest.mark.parametrize("call", sorted(_components()))
@pytest.mark.parametrize("now", [math.nan, math.inf, -1.0])
def test_every_component_refuses_the_same_bad_clocks(call: str, now: float) -> None:
    with pytest.raises(InvalidValueError, match="now must be a finite number of seconds >= 0"):
        _components()[call](now)


@pytest.mark.parametrize("call", sorted(_components()))
def test_every_component_accepts_a_good_clock(call: str) -> None:
    _components()[call](5.0)


def test_a_refused_clock_changes_nothing() -> None:
    index = PrefixIndex(block_size=2)
    with pytest.raises(InvalidValueError):
        index.record("w", [1, 2], now=math.nan)
    assert index.stats()["blocks"] == 0


@pytest.mark.parametrize(
    ("field", "value", "error", "needle"),
    [
        ("kv", 1.5, InvalidValueError, r"kv_(cache_)?usage must be in \[0, 1\]"),
        ("kv", math.nan, InvalidValueError, r"kv_(cache_)?usage must be in \[0, 1\]"),
        ("waiting", -1, InvalidValueError, "waiting must be at least 0"),
        ("waiting", 2.0, TypeError, "waiting must be an int"),
    ],
)
def test_pool_and_flow_read_load_reports_alike(
    field: str, value: object, error: type[Exception], needle: str
) -> None:
    pool = EndpointPool(["a"])
    flow = FlowController()
    if field == "kv":
        calls = [
            lambda: pool.update("a", kv_cache_usage=value, now=0.0),  # type: ignore[arg-type]
            lambda: flow.update_endpoint("a", kv_cache_usage=value, timestamp=0.0),  # type: ignore[arg-type]
        ]
    else:
        calls = [
            lambda: pool.update("a", waiting=value, now=0.0),  # type: ignore[arg-type]
            lambda: flow.update_endpoint("a", waiting=value, timestamp=0.0),  # type: ignore[arg-type]
        ]
    for call in calls:
        with pytest.raises(error, match=needle):
            call()
