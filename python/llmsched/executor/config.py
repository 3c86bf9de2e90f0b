"""Configuration of the reference executor: the model shape and the engine's limits.

Every default of the executor lives here. The presets name the sizes used by the tests on CPU
(``small``) and by ``llmsched calibrate`` on a GPU (``large``).

>>> cfg = ModelConfig.preset("small")
>>> cfg.num_heads % cfg.num_kv_heads
0
>>> EngineConfig().block_size
16
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmsched.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_SIZE", "EngineConfig", "ModelConfig", "check_memory"]

DEFAULT_BLOCK_SIZE = 16
"""KV block size in tokens: the default of ``llmsched.hashing.block_hashes`` and of the prefix
index, so the engine's block hashes and the index's agree without conversion."""

_DTYPES = ("float32", "float64", "bfloat16", "float16")
_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}

# What one torch tensor costs beyond its data (the tensor and storage objects, allocator
# rounding), so that millions of tiny tensors (num_layers=10**9) are refused as well.
_TENSOR_OVERHEAD_BYTES = 512
# What one KV block costs the engine's bookkeeping in Python (ref count and hash lists, its
# entry in the free queue, the int object).
_BLOCK_BOOKKEEPING_BYTES = 200
# router_skew beyond this gives bias values that overflow float16 (max 65504) at a few sigma;
# long before it the bias alone decides the routing.
_MAX_ROUTER_SKEW = 1000.0


def _real(name: str, value: object) -> float:
    """``value`` as a finite float, or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past float range (10**400)
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return number


def _human(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024 or unit == "EiB":
            return f"{size:,.0f} {unit}" if unit == "bytes" else f"{size:,.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def check_memory(what: str, parts: Mapping[str, int], limit_bytes: int, where: str) -> None:
    """Refuse, with a ConfigError naming the largest part, what would not fit in ``limit_bytes``.

    ``parts`` maps a description naming the config keys of each part to its bytes (as
    :meth:`ModelConfig.estimate_bytes` and :meth:`EngineConfig.estimate_bytes` return them).
    Checked before anything is allocated, so a typo such as ``vocab_size=2**40`` is an error
    rather than a torch allocation of 2 PiB or a machine slowly running out of memory.

    >>> check_memory("model", {"vocab_size x hidden_size (embedding)": 2**40}, 2**30, "cpu")
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: model would allocate about 1,099,511,627,776 bytes (1.0 TiB), \
more than the 1.0 GiB of memory on cpu; the largest part is vocab_size x hidden_size \
(embedding): 1,099,511,627,776 bytes
    """
    total = sum(parts.values())
    if total <= limit_bytes:
        return
    largest, size = max(parts.items(), key=lambda item: item[1])
    raise ConfigError(
        f"{what} would allocate about {total:,} bytes ({_human(total)}), more than the "
        f"{_human(limit_bytes)} of memory on {where}; the largest part is {largest}: "
        f"{size:,} bytes"
    )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the decoder-only MoE transformer.

    ``router_skew`` is the standard deviation of a fixed, seeded per-expert router bias: trained
    MoE models route unevenly, and the skew gives the expert load balancer something to balance.

    >>> ModelConfig(num_heads=4, num_kv_heads=3)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: num_heads (4) must be a multiple of num_kv_heads (3)
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_size: int = 64
    shared_expert_hidden_size: int = 64
    router_skew: float = 1.0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_position: int = 8192
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "expert_hidden_size",
            "max_position",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        shared = self.shared_expert_hidden_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ConfigError(
                f"shared_expert_hidden_size must be an int >= 0 (0 disables it), got {shared!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {_DTYPES}")
        # Out-of-range floats give NaN or inf activations, hence silent garbage tokens.
        if not 0 <= _real("router_skew", self.router_skew) <= _MAX_ROUTER_SKEW:
            raise ConfigError(
                f"router_skew must be in 0..{_MAX_ROUTER_SKEW:g}, got {self.router_skew!r}"
            )
        if not 0 < _real("rms_eps", self.rms_eps) <= 1:
            raise ConfigError(f"rms_eps must be in (0, 1], got {self.rms_eps!r}")
        if not _real("rope_theta", self.rope_theta) > 1:
            raise ConfigError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if not 0 <= self.seed < 2**64:
            # xxh3 takes the seed modulo 2**64: -1 would silently be 2**64 - 1.
            raise ConfigError(f"seed must be in 0..2**64-1, got {self.seed}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named size: ``small`` (CPU tests) or ``large`` (a GPU run of the same code).

        >>> ModelConfig.preset("large").num_experts
        64
        """
        try:
            base = _PRESETS[name]
        except KeyError:
            raise ConfigError(
                f"unknown model preset {name!r}; expected one of {sorted(_PRESETS)}"
            ) from None
        return dataclasses.replace(base, **overrides)

    def expert_bytes(self, slots: int) -> int:
        """Bytes of ``slots`` routed-expert slots over all layers (SwiGLU gate, up, down).

        >>> ModelConfig().expert_bytes(8)
        1182720
        """
        per_slot = 3 * self.hidden_size * self.expert_hidden_size * _DTYPE_BYTES[self.dtype]
        # One layer's experts are materialised one by one and then concatenated (one extra copy).
        return (
            self.num_layers + 1
        ) * slots * per_slot + 3 * self.num_layers * _TENSOR_OVERHEAD_BYTES

    def estimate_bytes(self, expert_slots: int | None = None) -> dict[str, int]:
        """Bytes the model would allocate, by part, each part named by its config keys.

        ``expert_slots`` is how many routed-expert slots this process holds (default: one per
        expert; 0 when they are built elsewhere). The seeded weights are drawn in float32
        before conversion, so the largest tensor counts once more at 4 bytes a value.

        >>> sum(ModelConfig().estimate_bytes().values()) < 2**22
        True
        """
        b = _DTYPE_BYTES[self.dtype]
        h, layers, experts = self.hidden_size, self.num_layers, self.num_experts
        slots = experts if expert_slots is None else expert_slots
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        fs = self.shared_expert_hidden_size
        per_layer = (
            2 * h * q_dim + 2 * h * kv_dim + h * experts + experts + 3 * h * fs + 2 * h
        ) * b
        largest = max(self.vocab_size * h, h * q_dim, h * experts, h * fs)
        if slots:
            largest = max(largest, h * self.expert_hidden_size)
        half = self.head_dim // 2
        return {
            "vocab_size x hidden_size (embedding and lm_head)": 2 * self.vocab_size * h * b,
            "num_layers x hidden_size (attention, router and shared-expert weights)": layers
            * (per_layer + 11 * _TENSOR_OVERHEAD_BYTES),
            "num_layers x num_experts x hidden_size x expert_hidden_size (routed experts)": (
                self.expert_bytes(slots)
            ),
            # Placement maps and load counters: numpy and torch copies, int64.
            "num_layers x num_experts (expert placement and load tables)": layers
            * (experts + slots)
            * 8
            * 6,
            # cos and sin at the model dtype, built from float64 positions x frequencies.
            "max_position x head_dim (rotary tables)": self.max_position * half * (2 * b + 24),
            "float32 draw of the largest weight": largest * 4,
        }

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain dict (for YAML profiles).

        >>> ModelConfig().to_dict()["top_k"]
        2
        """
        return dataclasses.asdict(self)


_PRESETS: dict[str, ModelConfig] = {
    "small": ModelConfig(),
    "large": ModelConfig(
        vocab_size=32768,
        hidden_size=2048,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        num_experts=64,
        top_k=6,
        expert_hidden_size=1024,
        shared_expert_hidden_size=2048,
        dtype="bfloat16",
    ),
}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's limits, named as vLLM names them.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes and prefill
    chunks; with ``enable_chunked_prefill`` off a prompt is only scheduled whole.

    >>> EngineConfig(num_blocks=0)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: num_blocks must be a positive int, got 0
    """

    num_blocks: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    hash_seed: int = 0
    dp_rank: int = 0
    medium: str = "GPU"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            # The string "no" is truthy: it turned the feature on.
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.medium not in ("GPU", "CPU", "STORAGE"):
            raise ConfigError(f"medium must be GPU, CPU or STORAGE, got {self.medium!r}")
        # Both reach the hashing and the event encoder mid-step; refuse them here instead.
        for name, limit, text in (("hash_seed", 2**64, "2**64-1"), ("dp_rank", 2**31, "2**31-1")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
                raise ConfigError(f"{name} must be an int in 0..{text}, got {value!r}")

    def estimate_bytes(self, model: ModelConfig) -> dict[str, int]:
        """Bytes the engine would allocate for ``model``'s KV cache and its block bookkeeping.

        >>> EngineConfig(num_blocks=4).estimate_bytes(ModelConfig())[
        ...     "num_blocks x block_size x num_layers x num_kv_heads x head_dim (KV cache)"]
        32768
        """
        kv = 2 * model.num_layers * self.num_blocks * self.block_size * model.num_kv_heads
        kv *= model.head_dim * _DTYPE_BYTES[model.dtype]
        return {
            "num_blocks x block_size x num_layers x num_kv_heads x head_dim (KV cache)": kv,
            "num_blocks (block bookkeeping)": self.num_blocks * _BLOCK_BOOKKEEPING_BYTES,
        }
