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
from dataclasses import dataclass
from typing import Any

from llmsched.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_SIZE", "EngineConfig", "ModelConfig"]

DEFAULT_BLOCK_SIZE = 16
"""KV block size in tokens: the default of ``llmsched.hashing.block_hashes`` and of the prefix
index, so the engine's block hashes and the index's agree without conversion."""

_DTYPES = ("float32", "float64", "bfloat16", "float16")


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
        if self.shared_expert_hidden_size < 0:
            raise ConfigError("shared_expert_hidden_size must be >= 0 (0 disables it)")
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
        if self.router_skew < 0:
            raise ConfigError(f"router_skew must be >= 0, got {self.router_skew}")

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
        if self.medium not in ("GPU", "CPU", "STORAGE"):
            raise ConfigError(f"medium must be GPU, CPU or STORAGE, got {self.medium!r}")
        if not 0 <= self.hash_seed < 2**64:
            raise ConfigError(f"hash_seed must be in 0..2**64-1, got {self.hash_seed}")
