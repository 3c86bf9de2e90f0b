"""Slice-boundary decision through the Python API, beside the pure-Python twin (``_twin``)."""

from __future__ import annotations

from typing import Any

import pytest

from llmsched.reference.slices import SliceTracker as TwinTracker
from llmsched.slices import SliceTracker, SwitchCostModel, WaitingRequest

SLICE = 64
ENDPOINTS = [f"gpu-{i}" for i in range(16)]
SHORT = [WaitingRequest(0, 0, 500 + i, 4) for i in range(8)]
LONG = [WaitingRequest(0, 0, 500 + i, 100_000) for i in range(8)]


def _tracker(cls: Any) -> Any:
    t = cls("fixed", {"slice_tokens": SLICE}, cost_model=SwitchCostModel(), endpoints=ENDPOINTS)
    for i, name in enumerate(ENDPOINTS):
        t.set_endpoint(name, kv_cache_usage=0.5, waiting=int(i > 0))
    for rid in range(1, 1000):
        t.admit(rid, prompt_tokens=1000, max_tokens=2**32 - 1, endpoint="gpu-0")
    t.admit(0, prompt_tokens=2000, max_tokens=2**32 - 1, endpoint="gpu-0")
    return t


def _boundary(t: Any, waiting: list[WaitingRequest]) -> str:
    t.record_tokens(0, SLICE)
    action: str = t.decide(0, waiting=waiting, now=1.0).action
    if action != "continue":
        t.resume(0, endpoint="gpu-0")
    return action


SCENARIOS = {
    "nobody-waiting": ([], "continue"),
    "8-long": (LONG, "continue"),
    "8-short": (SHORT, "yield"),
}


def _bench(benchmark: Any, cls: Any, scenario: str) -> None:
    waiting, want = SCENARIOS[scenario]
    t = _tracker(cls)
    assert _boundary(t, waiting) == want
    benchmark.group = f"slices-decide-{scenario}"
    result = benchmark(_boundary, t, waiting)
    assert result == want


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_decide(benchmark: Any, scenario: str) -> None:
    _bench(benchmark, SliceTracker, scenario)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_decide_twin(benchmark: Any, scenario: str) -> None:
    _bench(benchmark, TwinTracker, scenario)
