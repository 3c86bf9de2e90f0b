"""Probe 58: a scenario's values of the wrong type, NaN or out of range are a ConfigError naming
the key, before anything is simulated (they were bare TypeErrors and ValueErrors from numpy or
comparisons, or ran: a string as a mean length, a negative think time, flow ``enabled: "yes"``,
an SLO target ``"a"``, ``policies: llm-d`` read letter by letter)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from llmsched.cli import main
from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.fast import build_plan

NAN = math.nan
TINY: dict[str, Any] = {
    "replicas": 1,
    "workload": {"kind": "long_short", "num_requests": 3},
    "policies": ["round-robin"],
}


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"replicas": "8"}, "replicas"),
        ({"replicas": 1.5}, "replicas"),
        ({"replicas": True}, "replicas"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"name": 5}, "name"),
        ({"metrics_delay_s": NAN}, "metrics_delay_s"),
        ({"kv_events_delay_s": "1"}, "kv_events_delay_s"),
        ({"kv_sample_s": NAN}, "kv_sample_s"),
        ({"policies": "llm-d"}, "policies"),
        ({"workload": "agentic"}, "workload"),
        ({"engine": {"block_size": "16"}}, "engine.block_size"),
        ({"engine": {"block_size": 1.5}}, "engine.block_size"),
        ({"engine": {"kv_tokens": NAN}}, "engine.kv_tokens"),
        ({"engine": {"max_num_seqs": None}}, "engine.max_num_seqs"),
        ({"engine": {"scheduling": 1}}, "engine.scheduling"),
        ({"engine": {"max_num_seqs": 10**30}}, "engine.max_num_seqs"),
        ({"engine": {"max_num_batched_tokens": 2**64}}, "engine.max_num_batched_tokens"),
        ({"pd": {"kv_bytes_per_token": 2**64}}, "pd.kv_bytes_per_token"),
        ({"pd": {"prefill_replicas": "1"}}, "pd.prefill_replicas"),
        ({"pd": {"transfer_bw": NAN}}, "pd.transfer_bw"),
        ({"pd": {"transfer_latency_s": NAN}}, "pd.transfer_latency_s"),
        ({"pd": {"kv_bytes_per_token": -5}}, "pd.kv_bytes_per_token"),
        ({"pd": {"kv_bytes_per_token": 0}}, "pd.kv_bytes_per_token"),
        ({"flow": {"enabled": "yes"}}, "flow.enabled"),
        ({"flow": {"enabled": True, "config": 5}}, "flow.config"),
        ({"slices": {"policy": "fixed", "params": 5}}, "slices.params"),
        ({"step_model": {"model": 5}}, "step_model.model"),
        ({"step_model": {"linear": 5}}, "step_model.linear"),
        ({"slo": {1: {"ttft_s": "a"}}}, "slo"),
        ({"slo": {1: {"ttft_s": NAN}}}, "slo"),
        ({"slo": {1: {"tpot_s": -1}}}, "slo"),
        ({"variants": {"name": "a"}}, "variants"),
    ],
)
def test_scenario_values_are_checked(over: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ScenarioConfig.from_dict({**TINY, **over})


WORKLOADS = {
    "agentic": {"sessions": 2, "followup_turns": 1, "first_input": 300, "system_prompt_len": 50},
    "shared_prefix": {"num_requests": 3, "num_groups": 1, "system_prompt_len": 32},
    "long_short": {"num_requests": 3},
    "priority": {"num_requests": 3},
}


@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("agentic", "first_input", "10"),
        ("agentic", "first_output", "10"),
        ("agentic", "first_output", 2.5),
        ("agentic", "think_time_s", -5),
        ("agentic", "think_time_s", "2"),
        ("agentic", "length_cv", -1.0),
        ("agentic", "system_prompt_len", -5),
        ("agentic", "system_prompt_len", NAN),
        ("agentic", "followup_turns", -1),
        ("shared_prefix", "system_prompt_len", -32),
        ("shared_prefix", "question_len", 2.5),
        ("shared_prefix", "output_len", NAN),
        ("shared_prefix", "output_len", 10**30),
        ("shared_prefix", "num_prompts_per_group", True),
        ("long_short", "num_requests", -5),
        ("long_short", "long_fraction", "0.5"),
        ("long_short", "short_input", None),
        ("long_short", "length_cv", "1"),
        ("priority", "batch_fraction", None),
        ("priority", "batch_output", "10"),
    ],
)
def test_workload_values_are_checked(build: str, kind: str, key: str, value: object) -> None:
    spec = {"kind": kind, **WORKLOADS[kind], key: value}
    with pytest.raises(ConfigError, match=rf"workload \({kind}\)\.{key}"):
        build_plan(spec, 0, 16, 0, native=build == "native")


def test_arrival_values_are_checked() -> None:
    spec = {"kind": "long_short", "num_requests": 3, "arrival": {"concurrency": "4"}}
    with pytest.raises(ConfigError, match=r"arrival\.concurrency"):
        build_plan(spec, 0, 16, 0)


def test_simulation_checks_a_scenario_changed_after_loading() -> None:
    cfg = ScenarioConfig.from_dict(TINY)
    cfg.seed = -1
    with pytest.raises(ConfigError, match="seed"):
        Simulation(cfg, "round-robin")


@pytest.mark.parametrize("command", ["sim", "demo"])
@pytest.mark.parametrize("seed", ["-1", str(2**70)])
def test_cli_seed_out_of_range_is_refused(command: str, seed: str, tmp_path, capsys) -> None:
    args = [command, "--seed", seed, "--quiet"]
    if command == "sim":
        path = tmp_path / "s.json"
        path.write_text('{"replicas": 1, "workload": {"kind": "long_short", "num_requests": 3}}')
        args += ["--config", str(path), "--policies", "random"]
    else:
        args += ["--sessions", "1", "--turns", "1"]
    assert main(args) == 2
    assert "seed" in capsys.readouterr().err


def test_good_values_still_load() -> None:
    cfg = ScenarioConfig.from_dict(
        {
            **TINY,
            "seed": 2**64 - 1,
            "metrics_delay_s": 0,
            "max_time_s": 5,
            "pd": {"transfer_bw": 10**10, "kv_bytes_per_token": None},
            "slo": {"1": {"ttft_s": 1, "tpot_s": 0.5}},
            "engine": {"kv_tokens": 4096},
        }
    )
    assert Simulation(cfg, "round-robin").run().summary()["completed"] == 3


@pytest.mark.parametrize("enabled", [False, True])
def test_a_flow_config_is_checked_when_the_scenario_loads(enabled: bool) -> None:
    """Probe 76: the flow config was read only when a run began: a typo in a later variant's
    stopped a comparison after the earlier variants had run, one in a disabled section was
    never seen."""
    flow = {"enabled": enabled, "config": {"default_bnad": {"ttl_s": 5}}}
    with pytest.raises(ConfigError, match=r"flow\.config: unknown field `default_bnad`"):
        ScenarioConfig.from_dict({"flow": flow})
    variants = [{"name": "off"}, {"name": "on", "flow": flow}]
    with pytest.raises(ConfigError, match=r"flow\.config: unknown field"):
        ScenarioConfig.from_dict({"base": "priority", "variants": variants}).expand()
    good = {"enabled": enabled, "config": {"default_band": {"ttl_s": 5}}}
    assert ScenarioConfig.from_dict({"flow": good}).flow.config == good["config"]
