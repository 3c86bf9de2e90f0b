"""The step-time model the simulator uses, its least-squares fit and its YAML profile.

Model (BLIS's linear terms plus Vidur's attention terms, a fixed cost per prefill chunk and
one for a step that starts on an idle engine)::

    t = b0 + b1 * prefill_tokens + b2 * decode_tokens
           + b3 * sum(prefill_chunk ** 2) + b4 * sum(decode_context_lengths)
           + b5 * prefill_requests + b6 * after_idle

``prefill_requests`` counts the sequences the step prefills (a chunk each); ``b2`` already is a
cost per decoding sequence. ``b5`` is identifiable only from steps that prefill several
sequences at once beside steps that prefill one of the same total length; without them it is
the extra fixed cost of a step with prefill over a decode step. ``after_idle`` is 1 for a
step the engine started after waiting for work (it wakes its loop and workers first); ``b6``
is identifiable from the same prompt timed on an idle engine and beside a running request.

fitted by least squares on relative error (each sample's row divided by its measured time, so a
1 ms decode step counts as much as a 100 ms prefill), with no coefficient below zero (the
simulator refuses negative step costs): a term whose least-squares coefficient is negative is
fixed at 0 and the rest refitted, the most negative first, until none is. Fit error is the
relative error of the fitted model on the samples (median, mean, max), reported beside the
error of the three-term linear model fitted the same way.

The samples must determine the three terms every step uses (``b0``, ``prefill_tokens``,
``decode_tokens``): each must vary independently of the other terms over the samples, else the
least-squares split between them is arbitrary (ten decode steps of one batch size fitted
to 2% gave a batch of 64 sixteen times the measured step, and a prefill nearly free) and the
fit raises ConfigError naming them. The other four may be left undetermined (e.g. no step on
an idle engine was timed): their least-squares split is kept as it comes.

>>> samples = [StepSample(p, d, p * p, d * (p + 9), 1e-3 + 2e-6 * p + 5e-6 * d)
...            for p, d in [(0, 1), (0, 8), (16, 0), (64, 0), (256, 0), (0, 32), (32, 4)]]
>>> profile = StepTimeProfile.fit(samples)
>>> round(profile.predict(128, 0) * 1e3, 3)
1.256
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from llmsched.config_loader import load_mapping
from llmsched.errors import ConfigError
from llmsched.sim.stepmodel import (
    CALIBRATE_TERMS,
    check_plausible,
    coefficient_seconds,
    kv_capacity,
)
from llmsched.validation import is_finite_number

__all__ = ["FitError", "StepSample", "StepTimeProfile"]

PROFILE_KIND = "llmsched.step_time_profile"
PROFILE_VERSION = 1
# The coefficient names, in regressor order: the simulator's step model reads the same file.
TERMS = CALIBRATE_TERMS
# A profile written before the per-chunk and idle terms names the first five.
_TERMS_V1 = TERMS[:5]


_COUNTS = ("prefill_tokens", "decode_tokens", "prefill_tokens_sq", "decode_context_tokens")


def _index(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy ones too) and not a bool, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _count(name: str, value: object) -> int:
    """``value`` as an int >= 0, or a ConfigError naming ``name``."""
    number = _index(value)
    if number is None or number < 0:
        raise ConfigError(f"a sample's {name} must be an int >= 0, got {value!r}")
    return number


@dataclass(frozen=True)
class StepSample:
    """One measured step: its batch composition and wall time in seconds.

    ``prefill_requests`` is how many sequences it prefills; ``None`` (the default) reads as one
    when it has prefill tokens and none otherwise. ``after_idle``: the engine had no step in
    flight when this one started.

    >>> StepSample(64, 0, 2 * 32**2, 0, 0.01, prefill_requests=2).features()
    [1.0, 64.0, 0.0, 2048.0, 0.0, 2.0, 0.0]
    """

    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_sq: int
    decode_context_tokens: int
    seconds: float
    prefill_requests: int | None = None
    after_idle: bool = False

    def __post_init__(self) -> None:
        for name in _COUNTS:
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        seconds = self.seconds
        # numpy's floats (what np.median of a timing array gives): a float32 was refused as
        # "not a finite positive time", a float64 fitted and then failed to save as YAML.
        if isinstance(seconds, (np.floating, np.integer)):
            object.__setattr__(self, "seconds", float(seconds))
        idle = self.after_idle
        # "yes" or None failed only when fitted; 2 was fitted as two idle starts.
        if not isinstance(idle, (bool, np.bool_)) and _index(idle) not in (0, 1):
            raise ConfigError(f"a sample's after_idle must be a bool, got {idle!r}")
        object.__setattr__(self, "after_idle", bool(idle))
        if self.prefill_requests is None:
            object.__setattr__(self, "prefill_requests", 1 if self.prefill_tokens > 0 else 0)
            return
        # "2" was a bare TypeError, 1.5 a fractional sequence count in the fit.
        object.__setattr__(
            self, "prefill_requests", _count("prefill_requests", self.prefill_requests)
        )
        if (self.prefill_requests == 0) != (self.prefill_tokens == 0):
            raise ConfigError(
                f"a sample with {self.prefill_tokens} prefill tokens cannot prefill "
                f"{self.prefill_requests} sequences"
            )

    def features(self) -> list[float]:
        """The regressors in :data:`TERMS` order."""
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.decode_tokens),
            float(self.prefill_tokens_sq),
            float(self.decode_context_tokens),
            float(self.prefill_requests or 0),
            float(self.after_idle),
        ]


@dataclass(frozen=True)
class FitError:
    """Relative error of a fitted model over the samples."""

    median: float
    mean: float
    max: float

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> FitError:
        """Relative errors ``|predicted - measured| / measured``."""
        rel = np.abs(predicted - measured) / measured
        return cls(float(np.median(rel)), float(rel.mean()), float(rel.max()))


# Terms the samples must determine: every step's time uses them.
_REQUIRED = TERMS[:3]


def _undetermined(x: np.ndarray) -> list[str]:
    """The terms whose coefficient the rows of ``x`` leave free: those with a component in the
    null space of the design matrix, its columns scaled to a largest entry of 1 (dividing each
    row by its time, as the fit does, changes neither)."""
    scale = np.abs(x).max(axis=0)
    used = scale > 0
    free = {i for i in range(x.shape[1]) if not used[i]}
    cols = np.flatnonzero(used)
    if len(cols):
        _, sv, vt = np.linalg.svd(x[:, cols] / scale[cols], full_matrices=True)
        rank = int(np.sum(sv > sv[0] * 1e-9))
        null = vt[rank:]
        if len(null):
            free |= {int(cols[j]) for j in np.flatnonzero(np.abs(null).max(axis=0) > 1e-6)}
    return [TERMS[i] for i in sorted(free)]


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error, ``min sum(((x @ c) - y) / y)^2`` with ``c >= 0``: a
    negative coefficient is fixed at 0 (the most negative first) and the rest refitted."""
    scaled = x / y[:, None]
    ones = np.ones_like(y)
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sub, *_ = np.linalg.lstsq(scaled[:, free], ones, rcond=None)
        if (sub >= 0).all():
            coef[free] = sub
            break
        free.pop(int(np.argmin(sub)))
    return coef


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays (at any depth of dicts, lists and tuples) turned
    into the Python values they hold."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class StepTimeProfile:
    """Fitted coefficients (seconds per term), fit errors and the context they came from."""

    coefficients: dict[str, float]
    error: FitError
    linear_error: FitError
    samples: list[StepSample] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    kv_tokens: int | None = None
    """KV capacity of the engine measured (tokens), when known; the simulator uses it."""

    @classmethod
    def fit(
        cls, samples: Sequence[StepSample], meta: Mapping[str, Any] | None = None
    ) -> StepTimeProfile:
        """Relative-error least-squares fit of the seven-term model (and the three-term one)."""
        if len(samples) < len(TERMS):
            raise ConfigError(f"need at least {len(TERMS)} samples to fit, got {len(samples)}")
        for i, sample in enumerate(samples):
            # NaN (a Prometheus /metrics may report it) made lstsq fail to converge; an
            # infinity gave a fit whose errors were NaN.
            if not is_finite_number(sample.seconds) or not sample.seconds > 0:
                raise ConfigError(
                    f"sample {i} ({sample.prefill_tokens} prefill, {sample.decode_tokens} "
                    f"decode tokens) needs a finite positive time, got {sample.seconds!r}"
                )
        x = np.array([s.features() for s in samples])
        y = np.array([float(s.seconds) for s in samples])
        missing = [t for t in _undetermined(x) if t in _REQUIRED]
        if missing:
            shapes = len({tuple(s.features()) for s in samples})
            raise ConfigError(
                f"the {len(samples)} samples ({shapes} distinct step shapes) do not determine "
                f"{', '.join(missing)}: a fit would split their cost arbitrarily and extrapolate "
                "wildly; time decode steps of two or more batch sizes and contexts, and prefill "
                "steps of three or more lengths (and steps without prefill beside steps with it)"
            )
        coef = _nonnegative_fit(x, y)
        linear = _nonnegative_fit(x[:, :3], y)
        return cls(
            coefficients={t: float(c) for t, c in zip(TERMS, coef, strict=True)},
            error=FitError.of(x @ coef, y),
            linear_error=FitError.of(x[:, :3] @ linear, y),
            samples=list(samples),
            meta=dict(meta or {}),
        )

    def predict(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        prefill_tokens_sq: int | None = None,
        decode_context_tokens: int = 0,
        prefill_requests: int | None = None,
        after_idle: bool = False,
    ) -> float:
        """Predicted step seconds; ``prefill_tokens_sq`` defaults to one chunk's square and
        ``prefill_requests`` to one chunk."""
        if prefill_tokens_sq is None:
            prefill_tokens_sq = prefill_tokens * prefill_tokens
        features = StepSample(
            prefill_tokens,
            decode_tokens,
            prefill_tokens_sq,
            decode_context_tokens,
            1.0,
            prefill_requests,
            after_idle,
        ).features()
        return float(sum(self.coefficients[t] * f for t, f in zip(TERMS, features, strict=True)))

    def to_dict(self) -> dict[str, Any]:
        """The YAML document as plain data (numpy values in ``meta`` as the numbers, strings
        and lists they hold)."""
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            **({"kv_tokens": self.kv_tokens} if self.kv_tokens is not None else {}),
            "meta": _plain(self.meta),
            "terms": list(TERMS),
            "coefficients": self.coefficients,
            "fit_error": asdict(self.error),
            "linear_fit_error": asdict(self.linear_error),
            "samples": [asdict(s) for s in self.samples],
        }

    def save(self, path: str | Path) -> None:
        """Write the profile as YAML; ConfigError when ``meta`` holds what YAML cannot write."""
        try:
            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"{path}: the profile's meta cannot be written as YAML: {exc}"
            ) from None
        Path(path).write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> StepTimeProfile:
        """Read a profile written by :meth:`save`; raises ConfigError naming what is wrong
        (coefficients must be finite numbers >= 0, as :meth:`fit` writes them, and
        ``kv_tokens`` a positive int)."""
        data = load_mapping(Path(path), what="step-time profile")
        if data.get("kind") != PROFILE_KIND:
            raise ConfigError(f"{path}: not a {PROFILE_KIND} document")
        if data.get("version") != PROFILE_VERSION:
            raise ConfigError(f"{path}: unsupported profile version {data.get('version')!r}")
        coefficients = data.get("coefficients")
        if not isinstance(coefficients, dict) or set(coefficients) not in (
            set(TERMS),
            set(_TERMS_V1),
        ):
            raise ConfigError(f"{path}: coefficients must name exactly {list(TERMS)}")
        try:
            values = {t: coefficient_seconds(t, coefficients.get(t, 0.0)) for t in TERMS}
            kv_tokens = kv_capacity(data.get("kv_tokens"))
            meta = data.get("meta") or {}
            if not isinstance(meta, dict):
                raise ConfigError(f"meta must be a mapping, got {meta!r:.100}")
            samples = [StepSample(**s) for s in data.get("samples", [])]
            for i, sample in enumerate(samples):
                if not is_finite_number(sample.seconds) or not sample.seconds > 0:
                    raise ConfigError(f"sample {i} has seconds {sample.seconds!r}")
            profile = cls(
                coefficients=values,
                error=FitError(**data["fit_error"]),
                linear_error=FitError(**data["linear_fit_error"]),
                samples=samples,
                meta=dict(meta),
                kv_tokens=kv_tokens,
            )
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: malformed profile: {exc}") from None
        check_plausible(str(path), values["b0"], values["prefill_tokens"], values["decode_tokens"])
        return profile
