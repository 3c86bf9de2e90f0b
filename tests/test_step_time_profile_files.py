"""A step-time profile read back from its file is what was fitted, or a ConfigError naming what
is wrong: ``StepTimeProfile.load`` took negative, NaN, infinite and boolean coefficients and
turned a ``kv_tokens`` of 1.5, ``"2048"``, ``-5`` or ``true`` into 1, 2048, -5 and 1; both it and
the simulator's ``load_step_model`` read YAML's ``yes`` as a coefficient of 1 second."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from llmsched.errors import ConfigError
from llmsched.executor.step_time import StepSample, StepTimeProfile
from llmsched.sim.stepmodel import LinearStepModel, load_step_model


def _profile() -> StepTimeProfile:
    samples = [StepSample(n, 0, n * n, 0, 1e-3 + 2e-5 * n, after_idle=True) for n in (32, 128, 512)]
    samples += [
        StepSample(0, b, 0, b * n, 1e-3 + 1e-4 * b + 1e-7 * b * n)
        for b in (1, 2, 4)
        for n in (32, 256)
    ]
    profile = StepTimeProfile.fit(samples, {"model": "tiny"})
    profile.kv_tokens = 2048
    return profile


def _write(tmp_path: Path, **changes: Any) -> Path:
    doc = _profile().to_dict()
    for key, value in changes.items():
        if key in doc["coefficients"]:
            doc["coefficients"][key] = value
        else:
            doc[key] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_profile_reads_back_as_saved(tmp_path) -> None:
    profile = _profile()
    path = tmp_path / "profile.yaml"
    profile.save(path)
    loaded = StepTimeProfile.load(path)
    assert loaded.coefficients == profile.coefficients
    assert loaded.samples == profile.samples and loaded.kv_tokens == 2048
    assert loaded.meta == {"model": "tiny"} and loaded.error == profile.error
    model = load_step_model(path)
    assert (model.b0, model.kv_tokens, model.model) == (profile.coefficients["b0"], 2048, "tiny")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"b0": -1.0}, "coefficient b0 must be a finite number >= 0, got -1.0"),
        ({"b0": math.nan}, "coefficient b0 .* got nan"),
        ({"decode_tokens": math.inf}, "coefficient decode_tokens .* got inf"),
        ({"prefill_tokens": True}, "coefficient prefill_tokens .* got True"),
        ({"b0": None}, "coefficient b0 .* got None"),
        ({"b0": [1]}, r"coefficient b0 .* got \[1\]"),
        ({"kv_tokens": 1.5}, "kv_tokens must be a positive int, got 1.5"),
        ({"kv_tokens": "2048"}, "kv_tokens must be a positive int, got '2048'"),
        ({"kv_tokens": -5}, "kv_tokens must be a positive int, got -5"),
        ({"kv_tokens": True}, "kv_tokens must be a positive int, got True"),
        ({"meta": [1]}, r"meta must be a mapping, got \[1\]"),
    ],
)
def test_profile_values_that_are_not_what_fit_writes_are_named(
    tmp_path, change: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path, **change)
    with pytest.raises(ConfigError, match=message):
        StepTimeProfile.load(path)
    if "meta" not in change:
        with pytest.raises(ConfigError, match=message):
            load_step_model(path)


def test_a_sample_without_a_time_is_named(tmp_path) -> None:
    doc = _profile().to_dict()
    doc["samples"][2]["seconds"] = "x"
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="sample 2 has seconds 'x'"):
        StepTimeProfile.load(path)


def test_yaml_yes_is_not_a_coefficient(tmp_path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("coefficients: {b0: 4e-3, b1: yes, b2: 1.0e-4}\n")
    with pytest.raises(ConfigError, match=r"coefficient b1 .* got True"):
        load_step_model(path)
    # YAML reads 4e-3 (no dot) as text: still a number of seconds.
    path.write_text("coefficients: {b0: 4e-3, b1: 2e-5, b2: 1.0e-4}\n")
    assert load_step_model(path).b0 == 4e-3
    with pytest.raises(ConfigError, match="coefficient b2"):
        LinearStepModel(b0=1e-3, b1=0.0, b2=True)
    with pytest.raises(ConfigError, match="kv_tokens"):
        LinearStepModel(b0=1e-3, b1=0.0, b2=1e-4, kv_tokens=True)


@pytest.mark.parametrize(("kv_tokens", "blocks"), [(10**12, 62_500_000_000), (8, 0)])
def test_a_profile_capacity_no_replica_can_hold_is_named(
    tmp_path, capsys, kv_tokens: int, blocks: int
) -> None:
    """An engine that overstates its cache gave a profile whose capacity reached the Rust
    engine as "invalid value: integer `62500000000`, expected u32"."""
    from llmsched import cli

    path = _write(tmp_path, kv_tokens=kv_tokens)
    scenario = tmp_path / "small.yaml"
    scenario.write_text(
        "base: shared-prefix\nreplicas: 2\npolicies: [round-robin]\nworkload: {num_requests: 8}\n"
    )
    argv = ["sim", "--step-model", str(path), "--config", str(scenario), "--quiet"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"the step model's kv_tokens = {kv_tokens} is {blocks} blocks of 16 tokens" in err


def test_numpy_times_and_meta_fit_save_and_read_back(tmp_path) -> None:
    """Times from numpy (``np.median`` of a timing array): a float32 was refused as "not a
    finite positive time", a float64 fitted and then failed to save (yaml's RepresenterError),
    as did numpy values in ``meta``."""
    plain = _profile()
    samples = [
        StepSample(
            s.prefill_tokens,
            s.decode_tokens,
            s.prefill_tokens_sq,
            s.decode_context_tokens,
            np.float32(s.seconds) if i % 2 else np.float64(s.seconds),  # type: ignore[arg-type]
            s.prefill_requests,
            s.after_idle,
        )
        for i, s in enumerate(plain.samples)
    ]
    assert all(type(s.seconds) is float for s in samples)
    meta = {"gpu": np.str_("H100"), "threads": np.int64(4), "lens": np.array([16, 64])}
    profile = StepTimeProfile.fit(samples, meta)
    path = tmp_path / "profile.yaml"
    profile.save(path)
    loaded = StepTimeProfile.load(path)
    assert loaded.samples == profile.samples
    assert loaded.meta == {"gpu": "H100", "threads": 4, "lens": [16, 64]}
    assert loaded.coefficients == profile.coefficients


def test_meta_yaml_cannot_write_is_named(tmp_path) -> None:
    profile = _profile()
    profile.meta["when"] = object()
    with pytest.raises(ConfigError, match="meta cannot be written as YAML"):
        profile.save(tmp_path / "profile.yaml")


def test_sim_says_whose_steps_it_runs(tmp_path, capsys) -> None:
    """The header is the base scenario's description ("8 x Qwen2.5-32B on 2 x H100") whatever
    the profile was fitted to; a line after it names the fitted model and its capacity."""
    from llmsched import cli

    path = _write(tmp_path)
    scenario = tmp_path / "small.yaml"
    scenario.write_text(
        "base: shared-prefix\nreplicas: 2\npolicies: [round-robin]\nworkload: {num_requests: 8}\n"
    )
    argv = ["sim", "--step-model", str(path), "--config", str(scenario), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"step model: linear, fitted to 'tiny' ({path}), 2048 KV tokens per replica" in out


def _milliseconds(tmp_path: Path, name: str, scale: float) -> Path:
    """The fitted profile with every coefficient times ``scale`` (1000: written in ms)."""
    doc = _profile().to_dict()
    doc["coefficients"] = {k: v * scale for k, v in doc["coefficients"].items()}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_coefficients_in_milliseconds_warn_once_per_profile_and_are_counted(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing noticed a profile written in milliseconds (b0 = 1, a 1.1 s decode step): the
    simulator ran a model 1000x too slow. Both readers warn once per profile, naming its
    file, count every load, and still load it (a slow CPU engine may be that slow)."""
    from llmsched.sim.stepmodel import implausible_profiles

    seconds = _milliseconds(tmp_path, "seconds.yaml", 1.0)
    ms = _milliseconds(tmp_path, "ms.yaml", 1000.0)
    with caplog.at_level("WARNING", logger="llmsched"):
        assert load_step_model(seconds).b0 == pytest.approx(1e-3)
        assert StepTimeProfile.load(seconds).coefficients["b0"] == pytest.approx(1e-3)
        assert str(seconds) not in implausible_profiles() and not caplog.records
        assert load_step_model(ms).b0 == pytest.approx(1.0)
        StepTimeProfile.load(ms)
        load_step_model(ms)
    assert implausible_profiles()[str(ms)] == 3
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(f"{ms}: step-time coefficients implausible as seconds")
    assert "takes 1.1 s (b0 + b2)" in message and "implausible_profiles()" in message


def test_inline_coefficients_in_milliseconds_name_the_scenario_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from llmsched.sim.stepmodel import StepModelConfig, build_step_model, implausible_profiles

    before = implausible_profiles().get("step_model.linear", 0)
    with caplog.at_level("WARNING", logger="llmsched"):
        build_step_model(StepModelConfig(linear={"b0": 4.0, "b1": 0.031, "b2": 0.12}))
    assert implausible_profiles()["step_model.linear"] == before + 1
    warned = [r for r in caplog.records if r.getMessage().startswith("step_model.linear: ")]
    assert len(warned) == (0 if before else 1)  # once per process and profile


def test_a_step_of_an_hour_is_refused(tmp_path) -> None:
    path = _milliseconds(tmp_path, "hours.yaml", 4e6)  # b0 of 4000 s
    for load in (load_step_model, StepTimeProfile.load):
        with pytest.raises(ConfigError, match=r"hours\.yaml: a step of one decoding request"):
            load(path)
