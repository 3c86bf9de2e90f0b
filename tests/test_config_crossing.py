"""Configuration reaches the native core one way: plain Python data converted by the binding
layer (pythonize) and decoded by the core's own types. What cannot be represented is refused with
a ConfigError naming where it is, before anything is built."""

from __future__ import annotations

import math
from typing import Any

import pytest

from llmsched import EndpointPool, FlowController, Router, SliceTracker
from llmsched.errors import ConfigError
from llmsched.flow import resolve_config

ROUTER = {
    "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {"name": "default", "plugins": [{"pluginRef": "queue-scorer", "weight": 1.0}]}
    ],
}


def _router_with_weight(weight: Any) -> dict[str, Any]:
    profile = {"name": "default", "plugins": [{"pluginRef": "queue-scorer", "weight": weight}]}
    return {**ROUTER, "schedulingProfiles": [profile]}


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf])
def test_a_non_finite_float_is_named_with_its_path(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins\[0\]\.weight"):
        Router(EndpointPool(["a"]), config=_router_with_weight(weight))


def test_a_value_that_is_not_plain_data_is_named() -> None:
    with pytest.raises(ConfigError, match=r"default_band\.ttl_s.* is a set"):
        FlowController({"default_band": {"ttl_s": {1}}})


def test_deep_nesting_is_refused_before_conversion() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ConfigError, match="nested more than"):
        SliceTracker("fixed", {"slice_tokens": deep}, endpoints=["a"])


def test_results_come_back_as_plain_data() -> None:
    resolved = resolve_config({"default_band": {"ttl_s": 30}})
    assert resolved["default_band"]["ttl_s"] == 30
    assert FlowController({"default_band": {"ttl_s": 30}}).config == resolved
    tracker = SliceTracker("mlfq", {"levels": 3}, endpoints=["a"])
    assert tracker.params["levels"] == 3


def test_a_good_config_still_routes() -> None:
    router = Router(EndpointPool(["a", "b"]), config=_router_with_weight(2))
    assert router.pick(tokens=list(range(64)), now=0.0).endpoint in {"a", "b"}
