"""Router configurations that would route badly without saying so: each is refused with a
ConfigError naming the key, or noted (logged once through the ``llmsched`` logger, listed in
``Router.warnings`` and ``config_info()["notes"]``, counted in ``Router.stats()``). Also what a
failed pick says."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from llmsched import ConfigError, Endpoint, EndpointPool, NoEndpointError, PrefixIndex, Router
from llmsched.routing import config_info


def profile(*entries: dict[str, Any], name: str = "default") -> dict[str, Any]:
    return {"name": name, "plugins": list(entries)}


def note_keys(config: dict[str, Any]) -> list[str]:
    return [n["key"] for n in config_info(config)["notes"]]


def test_a_scorer_of_weight_0_beside_weighted_ones_is_noted_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = {
        "plugins": [{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}],
        "schedulingProfiles": [
            profile(
                {"pluginRef": "queue-scorer", "weight": 0},
                {"pluginRef": "prefix-cache-scorer", "weight": 2},
            )
        ],
    }
    caplog.set_level(logging.WARNING, logger="llmsched")
    router = Router(EndpointPool(["a", "b"]), config=config)
    assert note_keys(config) == ["schedulingProfiles[0].plugins[0].weight"]
    (warning,) = router.warnings
    assert "queue-scorer" in warning and "weight 0" in warning
    assert router.stats()["config_warnings"] == 1
    assert sum("weight 0" in r.getMessage() for r in caplog.records) == 1


def test_a_declared_plugin_no_profile_lists_is_noted() -> None:
    # A prefix scorer declared and never listed: the router silently ignored prefix affinity.
    config = {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "decode-filter"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [profile({"pluginRef": "queue-scorer"})],
    }
    notes = config_info(config)["notes"]
    unused = {n["key"]: n["message"] for n in notes if "no scheduling profile" in n["message"]}
    assert list(unused) == ["plugins[1]", "plugins[2]"]
    assert "scores nothing" in unused["plugins[1]"]
    assert "filters nothing" in unused["plugins[2]"]
    assert len(Router(EndpointPool(["a"]), config=config).warnings) == len(notes)


def test_the_published_configs_declare_nothing_unused() -> None:
    # Filters that only a decision tree refers to, and a picker a profile takes as its own,
    # are used.
    for preset in Router.presets():
        assert not [
            n for n in Router(EndpointPool(["a"]), config=preset).warnings if "no scheduling" in n
        ], preset


def test_a_profile_the_pd_handler_never_runs_is_noted() -> None:
    config = {
        "plugins": [
            {"type": "pd-profile-handler"},
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "queue-scorer"},
        ],
        "schedulingProfiles": [
            profile({"pluginRef": "decode-filter"}, {"pluginRef": "queue-scorer"}, name="decode"),
            profile({"pluginRef": "prefill-filter"}, name="prefill"),
            profile({"pluginRef": "queue-scorer"}, name="canary"),
        ],
    }
    notes = config_info(config)["notes"]
    assert [n["key"] for n in notes] == ["schedulingProfiles[2]"]
    assert "canary" in notes[0]["message"] and "never runs" in notes[0]["message"]


def test_lru_capacity_the_given_index_overrides_is_noted() -> None:
    config = {
        "plugins": [{"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": 10}}]
    }
    own = Router(EndpointPool(["a"]), config=config)
    assert own.index.worker_capacity == 10
    assert not [w for w in own.warnings if "lruCapacityPerServer" in w]
    shared = Router(EndpointPool(["a"]), PrefixIndex(16), config=config)
    (note,) = [w for w in shared.warnings if "lruCapacityPerServer" in w]
    assert "no effect" in note and "unbounded" in note
    agreeing = Router(EndpointPool(["a"]), PrefixIndex(16, worker_capacity=10), config=config)
    assert not [w for w in agreeing.warnings if "lruCapacityPerServer" in w]


def test_two_prefix_scorers_with_different_lru_capacities_are_refused() -> None:
    config = {
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": 10}},
            {
                "type": "prefix-cache-scorer",
                "name": "p2",
                "parameters": {"lruCapacityPerServer": 20},
            },
        ]
    }
    with pytest.raises(ConfigError, match=r"plugins\[1\]\.parameters\.lruCapacityPerServer"):
        Router(EndpointPool(["a"]), config=config)


def test_a_token_cap_below_one_block_is_refused() -> None:
    # maxPrefixTokensToMatch / blockSize = 0 blocks: the scorer gave every endpoint 0.
    config = {
        "plugins": [{"type": "prefix-cache-scorer", "parameters": {"maxPrefixTokensToMatch": 10}}]
    }
    with pytest.raises(ConfigError, match=r"maxPrefixTokensToMatch: is 10, less than one block"):
        Router(EndpointPool(["a"]), PrefixIndex(16), config=config)
    pool = EndpointPool(["a", "b"])
    router = Router(pool, PrefixIndex(4), config=config)
    with router.pick(tokens=list(range(64)), now=0.0):
        pass
    # With a cap of 2 blocks the scorer reads the first 2 of the prompt's 16 blocks.
    row = router.pick(tokens=list(range(64)), now=0.0).explain()["default"].row("a")
    assert row.scores["prefix-cache-scorer"] == 1.0


def test_a_failed_pick_names_an_empty_pool_and_the_model_no_endpoint_serves() -> None:
    pool = EndpointPool()
    router = Router(pool, config="round-robin")
    with pytest.raises(NoEndpointError, match="the pool has no endpoints"):
        router.pick(tokens=[1, 2])
    pool.add(Endpoint("a", model="m1"))
    with pytest.raises(NoEndpointError, match='none of the pool\'s 1 endpoints serves model "m2"'):
        router.pick(tokens=[1, 2], model="m2")


@pytest.mark.parametrize(
    "picker", ["random-picker", "round-robin-picker", "softmax-cost-picker", "cache-aware-picker"]
)
def test_scorers_under_a_picker_that_reads_no_scores_are_noted(picker: str) -> None:
    # The scorers run on every pick and the picker never reads them: a prefix scorer listed
    # beside a random-picker gave no prefix affinity at all.
    config = {
        "plugins": [{"type": "prefix-cache-scorer"}, {"type": picker}],
        "schedulingProfiles": [
            profile({"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": picker})
        ],
    }
    (note,) = config_info(config)["notes"]
    assert note["key"] == "schedulingProfiles[0].plugins"
    assert picker in note["message"] and "prefix-cache-scorer" in note["message"]
    assert "without reading scores" in note["message"]
    assert Router(EndpointPool(["a"]), config=config).stats()["config_warnings"] == 1
