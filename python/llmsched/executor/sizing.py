"""Wide-EP sizing and the dual-batch-overlap cost term (no torch needed).

KV space per rank. A rank's HBM (times ``memory_utilization``) holds its weights, an activation
reserve and KV. Attention weights and other dense parameters are split over the ``tp`` ranks of
a tensor-parallel group; routed experts are split over ``ep`` ranks when ``ep > 1`` and over
the ``tp`` ranks otherwise. A token's KV splits over tensor-parallel ranks only as far as there
are KV heads: with ``kv_heads < tp`` each rank keeps whole heads, so KV is duplicated (a
latent-attention cache, one "head", is duplicated on every TP rank). Data-parallel attention
(``dp`` groups) duplicates nothing, so the KV tokens a layout holds are
``dp * kv_tokens_per_rank`` -- which is why KV space grows as EP widens and TP shrinks.

Facts used by the preset (DeepSeek-V3 model card and config): 61 layers, 58 of them MoE with 256
routed experts of hidden size 2048 over model width 7168, 671B parameters, MLA cache of
512 + 64 values per token per layer.

>>> v3 = MoEModelSpec.deepseek_v3()
>>> tp8 = kv_tokens_per_rank(v3, ParallelLayout(tp=8), hbm_bytes=141e9)
>>> ep8 = kv_tokens_per_rank(v3, ParallelLayout(dp=8, ep=8), hbm_bytes=141e9)
>>> ep8.total_kv_tokens > 2 * tp8.total_kv_tokens
True
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from llmsched.errors import ConfigError


def _finite(value: object) -> float | None:
    """``value`` as a float if it is a finite real number (numpy ones too, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_size(name: str, value: object, *, positive: bool) -> None:
    """A finite number > 0 (``positive``) or >= 0, else a ConfigError naming ``name``."""
    number = _finite(value)
    if number is None or not (number > 0 if positive else number >= 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


__all__ = [
    "KVSizing",
    "MoEModelSpec",
    "ParallelLayout",
    "dbo_step_time",
    "kv_tokens_per_rank",
]


@dataclass(frozen=True)
class MoEModelSpec:
    """What sizing needs to know about a model.

    ``dense_params`` are parameters every expert-parallel rank keeps (embeddings, attention,
    dense layers, shared experts); ``expert_params`` all routed experts together;
    ``kv_bytes_per_token`` one copy of one token's KV over all layers.
    """

    name: str
    dense_params: float
    expert_params: float
    kv_bytes_per_token: float
    kv_heads: int
    weight_bytes: float = 1.0

    def __post_init__(self) -> None:
        # No KV heads or bytes divided by zero; negative weights gave more KV than HBM.
        _check_size("dense_params", self.dense_params, positive=False)
        _check_size("expert_params", self.expert_params, positive=False)
        _check_size("kv_bytes_per_token", self.kv_bytes_per_token, positive=True)
        _check_size("weight_bytes", self.weight_bytes, positive=True)
        heads = self.kv_heads
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ConfigError(f"kv_heads must be a positive int, got {heads!r}")

    @classmethod
    def deepseek_v3(cls, weight_bytes: float = 1.0, kv_bytes: float = 2.0) -> MoEModelSpec:
        """DeepSeek-V3 (fp8 weights, bf16 MLA cache by default).

        >>> round(MoEModelSpec.deepseek_v3().expert_params / 1e9)
        654
        """
        expert_params = 58 * 256 * 3 * 7168 * 2048
        return cls(
            name="deepseek-v3",
            dense_params=671e9 - expert_params,
            expert_params=float(expert_params),
            kv_bytes_per_token=61 * (512 + 64) * kv_bytes,
            kv_heads=1,
            weight_bytes=weight_bytes,
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-parallel degree, data-parallel attention groups and expert-parallel degree.

    The layout spans ``tp * dp`` ranks; ``ep`` must divide that.

    >>> ParallelLayout(tp=2, dp=2, ep=3)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: ep (3) must divide the 4 ranks of the layout
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.ranks % self.ep:
            raise ConfigError(f"ep ({self.ep}) must divide the {self.ranks} ranks of the layout")

    @property
    def ranks(self) -> int:
        """Ranks (GPUs) in the layout."""
        return self.tp * self.dp


@dataclass(frozen=True)
class KVSizing:
    """The result of :func:`kv_tokens_per_rank`."""

    weight_bytes_per_rank: float
    kv_bytes_per_rank: float
    kv_bytes_per_token_per_rank: float
    kv_tokens_per_rank: float
    total_kv_tokens: float


def kv_tokens_per_rank(
    model: MoEModelSpec,
    layout: ParallelLayout,
    hbm_bytes: float,
    *,
    memory_utilization: float = 0.9,
    activation_reserve_bytes: float = 0.0,
) -> KVSizing:
    """KV tokens each rank can hold, and distinct KV tokens the whole layout holds.

    Raises ConfigError when the weights alone do not fit.

    >>> s = kv_tokens_per_rank(MoEModelSpec.deepseek_v3(), ParallelLayout(tp=8), 141e9)
    >>> round(s.kv_tokens_per_rank / 1e3)  # llm-d quotes 598K per 8-GPU node at TP8
    612
    """
    if not 0 < memory_utilization <= 1:
        raise ConfigError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    # NaN or inf came back as NaN or inf token counts.
    _check_size("hbm_bytes", hbm_bytes, positive=True)
    _check_size("activation_reserve_bytes", activation_reserve_bytes, positive=False)
    expert_split = layout.ep if layout.ep > 1 else layout.tp
    weights = model.weight_bytes * (
        model.dense_params / layout.tp + model.expert_params / expert_split
    )
    kv_bytes = hbm_bytes * memory_utilization - weights - activation_reserve_bytes
    if kv_bytes <= 0:
        raise ConfigError(
            f"{model.name}: {weights / 1e9:.1f} GB of weights per rank leave no KV space "
            f"in {hbm_bytes / 1e9:.1f} GB"
        )
    heads_per_rank = -(-model.kv_heads // layout.tp)
    per_token = model.kv_bytes_per_token * heads_per_rank / model.kv_heads
    tokens = kv_bytes / per_token
    return KVSizing(weights, kv_bytes, per_token, tokens, tokens * layout.dp)


def dbo_step_time(
    compute_s: float, comm_s: float, micro_batches: int = 2, overhead_s: float = 0.0
) -> float:
    """Step time when the batch is split into micro-batches whose communication overlaps.

    Without overlap a step costs ``compute + comm``. Split into ``n`` micro-batches pipelined
    so one's all-to-all runs under another's compute, the longer of the two runs back to back
    and only one micro-batch's share of the shorter stays exposed:
    ``max(c, m) + min(c, m) / n + overhead``. The gain is largest when communication is as
    slow as compute (2x -> 1.5x at n = 2) and vanishes as communication gets fast.

    >>> dbo_step_time(1.0, 1.0), dbo_step_time(1.0, 0.0)
    (1.5, 1.0)
    """
    finite = [_finite(t) for t in (compute_s, comm_s, overhead_s)]
    if any(t is None or t < 0 for t in finite):
        raise ConfigError(
            f"times must be finite numbers >= 0, got {compute_s!r}, {comm_s!r}, {overhead_s!r}"
        )
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}")
    if micro_batches == 1:
        return compute_s + comm_s + overhead_s
    longer, shorter = max(compute_s, comm_s), min(compute_s, comm_s)
    return longer + shorter / micro_batches + overhead_s
