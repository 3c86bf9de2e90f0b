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
