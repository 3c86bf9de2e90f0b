"""Probe 58: fitting the step-time model on bad samples raises a ConfigError that names the
sample, instead of numpy's LinAlgError (a NaN time, which a Prometheus ``/metrics`` may
report), a fit whose errors are NaN (an infinite time) or a fit of negative token counts; and
samples that do not determine the step terms every prediction uses are refused."""

from __future__ import annotations

import math

import pytest

from llmsched.errors import ConfigError
from llmsched.executor.step_time import StepSample, StepTimeProfile

SHAPES = [(0, 1), (0, 8), (16, 0), (64, 0), (256, 0), (0, 32), (32, 4)]


def _samples(bad_seconds: float | None = None) -> list[StepSample]:
    out = []
    for i, (p, d) in enumerate(SHAPES):
        seconds = 1e-3 + 2e-6 * p + 5e-6 * d
        if i == 2 and bad_seconds is not None:
            seconds = bad_seconds
        out.append(StepSample(p, d, p * p, d * (p + 9), seconds))
    return out


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -1.0, 0.0])
def test_a_time_that_is_not_finite_and_positive_is_named(seconds: float) -> None:
    with pytest.raises(ConfigError, match=r"sample 2 .*positive"):
        StepTimeProfile.fit(_samples(seconds))


def test_a_time_that_is_not_a_number_is_named() -> None:
    samples = _samples()
    samples[3] = StepSample(64, 0, 64 * 64, 0, "0.01")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sample 3"):
        StepTimeProfile.fit(samples)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-16, 0, 256, 0), "prefill_tokens"),
        ((16, -1, 256, 0), "decode_tokens"),
        ((16, 0, -256, 0), "prefill_tokens_sq"),
        ((0, 4, 0, -9), "decode_context_tokens"),
        ((math.nan, 0, 0, 0), "prefill_tokens"),
        ((16.5, 0, 0, 0), "prefill_tokens"),
        ((True, 0, 0, 0), "prefill_tokens"),
    ],
)
def test_token_counts_must_be_counts(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        StepSample(*args, 0.01)  # type: ignore[arg-type]


def test_good_samples_still_fit() -> None:
    import numpy as np

    samples = _samples()
    samples.append(StepSample(np.int64(8), 0, 64, 0, 1e-3 + 2e-6 * 8))  # type: ignore[arg-type]
    profile = StepTimeProfile.fit(samples)
    assert profile.predict(128, 0) == pytest.approx(1.256e-3, rel=1e-6)
    assert all(math.isfinite(c) for c in profile.coefficients.values())


def _decode(batch: int, context: int, seconds: float) -> StepSample:
    return StepSample(0, batch, 0, batch * context, seconds)


@pytest.mark.parametrize(
    ("samples", "undetermined"),
    [
        # Ten decode steps of one batch and context: fitted to 2%, the fit then predicted a
        # batch of 64 at 17x the measured step and a 1000-token prefill at 65 ns.
        (
            [_decode(4, 100, 0.01 + 1e-4 * i) for i in range(10)],
            "b0, prefill_tokens, decode_tokens",
        ),
        # Prefill only: decoding came out free.
        (
            [
                StepSample(n, 0, n * n, 0, 1e-3 + 1e-5 * n)
                for n in (16, 32, 64, 128, 256, 512, 1024)
            ],
            "b0, decode_tokens",
        ),
        # Decode only, several batches and contexts: prefill came out free.
        (
            [_decode(b, n, 1e-3 + 1e-4 * b + 1e-7 * b * n) for b in (1, 2, 4) for n in (16, 256)]
            + [_decode(8, 64, 3e-3)],
            "prefill_tokens",
        ),
        # The same sample seven times.
        ([StepSample(16, 0, 256, 0, 0.01)] * 7, "b0, prefill_tokens, decode_tokens"),
        # One batch size beside prefill steps: the cost per decoding sequence and per step
        # cannot be told apart (what ``llmsched calibrate --engine --batch-sizes 1`` times).
        (
            [StepSample(n, 0, n * n, 0, 1e-3 + 1e-5 * n, after_idle=True) for n in (32, 128, 512)]
            + [StepSample(n, 1, n * n, 40, 2e-3 + 1e-5 * n) for n in (32, 128, 512)]
            + [_decode(1, n, 1e-3 + 1e-7 * n) for n in (32, 256, 512)],
            "b0, decode_tokens",
        ),
    ],
)
def test_samples_that_do_not_determine_the_step_terms_are_refused(
    samples: list[StepSample], undetermined: str
) -> None:
    with pytest.raises(ConfigError, match=f"do not determine {undetermined}:"):
        StepTimeProfile.fit(samples)


def test_undetermined_optional_terms_still_fit() -> None:
    """No step on an idle engine and one prefill per step: ``after_idle`` and
    ``prefill_requests`` are not determined, the three step terms are; the fit goes on."""
    samples = _samples()
    profile = StepTimeProfile.fit(samples)
    assert profile.coefficients["after_idle"] == 0.0
    assert profile.error.max < 1e-9
