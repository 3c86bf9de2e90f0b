"""How long one engine step takes: a roofline model of model plus GPU, or a fitted linear model.

A step processes a batch: ``prefill_requests`` prefill chunks (``prefill_tokens`` in all,
``prefill_sq`` the sum of squared chunk lengths, ``prefill_ctx`` the sum over chunks of chunk
length times the context already cached before it, ``prefill_read`` the sum of those contexts:
the KV each chunk reads) and ``decode_tokens`` decoding requests whose KV lengths sum to
``decode_ctx``. ``prefill_requests`` left out (``None``) counts one chunk when the step has
prefill tokens. ``after_idle``: the step starts on a replica that had no step in flight (an
engine waking from idle pays for it: the linear model's ``b6``).

Roofline (peaks from the vendors' datasheets, achieved fractions from measurements: :data:`GPUS`)::

    T = P + D;  R = D + (1 if P else 0)          # tokens; rows that need logits
    flops = 2 * body_params * T + 2 * vocab * hidden * R
            + 4 * layers * q_dim * (prefill_ctx + prefill_sq / 2 + decode_ctx)
    bytes = weights_read(T) + kv_bytes_per_token * (T + prefill_read + decode_ctx)
    t_c = flops / (tp * peak_flops * mfu);  t_m = bytes / (tp * hbm_bw * mbu)
    t = max(t_c, t_m, overlap * (t_c + t_m))
        + elementwise_bytes * layers * hidden * T / (tp * hbm_bw)
        + request_overhead_s * R + prefill_request_s * N + idle_start_s * I
        + step_overhead + tensor-parallel all-reduce time   # N = prefill_requests, I = after_idle

``body_params`` are the parameters a token multiplies through except the embedding table (a
lookup, no FLOPs) and the LM head, which runs only for the rows that need logits: every decode
token and the last token of a prefill chunk (one per step with prefill: the step's work does not
say how many chunks it holds; a missed row costs ``2 * vocab * hidden`` FLOPs, about 1 GFLOP for
Llama-3.1-8B against 16 GFLOPs per prefill token). ``weights_read`` is every weight but an untied
embedding table (only its looked-up rows are read) for a dense model and, for a MoE model, the
shared weights plus the experts that ``T`` tokens touch in expectation (``E * (1 - (1 - k/E)^T)``
of ``E``). ``mfu`` is the large-batch matmul efficiency and ``mbu`` the small-batch bandwidth
efficiency; between the two regimes (decode at batch 32-256, short prefill chunks) neither bound
is reached, which the third term, ``overlap * (t_c + t_m)``, models. The element-wise layers
(norms, rotary embedding, activation, residual adds) move ``elementwise_bytes`` per hidden unit,
token and layer at full bandwidth, after the matmuls. The constants of each GPU and where they
were measured are in :data:`GPUS` and the simulator docs.

Linear (BLIS plus Vidur attention terms, the file ``llmsched calibrate`` writes)::

    t = b0 + b1 * P + b2 * D + b3 * prefill_sq + b4 * decode_ctx + b5 * N + b6 * I

``b5`` is a fixed cost per prefill chunk in the step (the sampler, attention metadata and
scheduling of one more sequence); ``b2`` is already one per decoding request. ``b6`` is paid
by a step that starts on an idle replica (``I`` is 1): an engine that waited for work wakes
its busy loop and workers first.

A run of decode-only steps with a constant batch is summed in closed form (:class:`DecodeRun`), so
the simulator pays per event, not per token.

>>> model = RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"])
>>> round(model.step_time(prefill_tokens=10_000, prefill_sq=10_000**2), 2)
0.26
>>> round(model.step_time(decode_tokens=1, decode_ctx=1000) * 1e3, 1)
7.2
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypedDict

from llmsched.config_loader import read_config
from llmsched.errors import ConfigError

__all__ = [
    "GPUS",
    "MODELS",
    "DecodeRun",
    "GpuSpec",
    "LinearStepModel",
    "ModelSpec",
    "RooflineStepModel",
    "StepModel",
    "check_plausible",
    "implausible_profiles",
    "load_step_model",
]

GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """Peak dense bf16 FLOP/s, HBM bandwidth (bytes/s) and memory (bytes) of one GPU, and the
    fractions of them a transformer's layers reach (see the module docs for the formula).

    ``mfu``: matmul FLOP/s over the peak for large token counts; ``mbu``: weight-read bandwidth
    over the peak for small ones; ``overlap``: the transition between them; ``elementwise_bytes``:
    bytes the element-wise layers move per hidden unit, token and layer.
    """

    name: str
    flops: float
    hbm_bw: float
    memory: float
    link_bw: float = 450e9  # NVLink bytes/s per direction, for tensor-parallel all-reduce
    mfu: float = 0.6
    mbu: float = 0.8
    overlap: float = 0.0
    elementwise_bytes: float = 0.0


# Peaks: the vendors' datasheets (dense bf16, HBM bandwidth, memory). Efficiencies: fitted to
# Vidur's published per-operator profiles of vLLM's layers (github.com/microsoft/vidur,
# data/profiling/compute/<gpu>/meta-llama/<model>/mlp.csv: the median time of each linear and
# element-wise layer of one transformer layer at 1 to 32k tokens): A100 from Meta-Llama-3-8B,
# H100 from Llama-2-7b-hf. The H200 is the H100's GH100 die with faster HBM3e; it takes the
# H100's fractions (no published profile). The figures they reproduce, and the tolerance, are
# in tests/test_sim_stepmodel.py.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec(
        "H100", 989e12, 3.35e12, 80e9, mfu=0.74, mbu=0.67, overlap=0.75, elementwise_bytes=77.0
    ),
    "H200": GpuSpec(
        "H200", 989e12, 4.8e12, 141e9, mfu=0.74, mbu=0.67, overlap=0.75, elementwise_bytes=77.0
    ),
    "A100": GpuSpec(
        "A100",
        312e12,
        2.0e12,
        80e9,
        link_bw=300e9,
        mfu=0.74,
        mbu=0.71,
        overlap=0.75,
        elementwise_bytes=86.0,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a transformer, enough for FLOPs, bytes and KV size.

    ``params`` counts every weight; ``active_params`` those one token uses (equal for dense
    models). For MoE models ``expert_params`` is the part of ``params`` held in routed experts.
    ``vocab`` sizes the embedding table and the LM head (``vocab * hidden`` each, one matrix when
    ``tied_embeddings``); 0 counts them as ordinary weights.
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    active_params: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    bytes_per_param: int = 2
    kv_bytes_per_elem: int = 2
    default_tp: int = 1
    vocab: int = 0
    tied_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 * layers * kv_heads * head_dim * bytes`` (K and V, every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def active(self) -> float:
        """Parameters one token multiplies through."""
        return self.active_params or self.params

    @property
    def lm_head_params(self) -> float:
        """Parameters of the LM head (``vocab * hidden``)."""
        return float(self.vocab * self.hidden)

    @property
    def body_params(self) -> float:
        """Active parameters a token multiplies through, without the embedding table (a lookup)
        and the LM head (run only for the rows that need logits)."""
        tables = 1 if self.tied_embeddings else 2
        return self.active - tables * self.lm_head_params

    @property
    def read_params(self) -> float:
        """Parameters a step reads in full: all but an untied embedding table."""
        return self.params - (0.0 if self.tied_embeddings else self.lm_head_params)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one step reads when it processes ``tokens`` tokens."""
        if not self.experts or tokens <= 0:
            return self.read_params * self.bytes_per_param
        shared = self.read_params - self.expert_params
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens
        return (shared + self.expert_params * touched) * self.bytes_per_param


# Public model cards (Hugging Face config.json of each model).
MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b",
        params=8.03e9,
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
    ),
    "qwen2.5-32b": ModelSpec(
        "qwen2.5-32b",
        params=32.8e9,
        layers=64,
        hidden=5120,
        heads=40,
        kv_heads=8,
        head_dim=128,
        default_tp=2,
        vocab=152064,
    ),
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b",
        params=30.5e9,
        active_params=3.3e9,
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        experts_per_token=8,
        expert_params=29.0e9,
        vocab=151936,
    ),
}


class StepModel(Protocol):
    """What the simulator needs from a step-time model."""

    def step_time(
        self,
        prefill_tokens: int = 0,
        prefill_sq: float = 0.0,
        prefill_ctx: float = 0.0,
        decode_tokens: int = 0,
        decode_ctx: float = 0.0,
        prefill_read: float = 0.0,
        prefill_requests: int | None = None,
        after_idle: bool = False,
    ) -> float:
        """Seconds for one step of this batch."""
        ...

    def decode_run(self, batch: int, ctx: float) -> DecodeRun:
        """The decode-only steps of ``batch`` requests whose KV lengths sum to ``ctx``."""
        ...

    def kv_capacity_tokens(self) -> int | None:
        """KV-cache tokens one replica holds, or None when the model does not say."""
        ...


@dataclass(frozen=True)
class DecodeRun:
    """Step ``j`` (from 0) of a decode-only run takes
    ``max(a1 + g1*j, a2 + g2*j, a3 + g3*j) + c`` seconds.

    Algorithm: each piece is affine in ``j`` (the KV read grows by one token per request per
    step), so their maximum is convex and piecewise affine: the sum of ``k`` steps splits at the
    crossovers into at most three arithmetic series, O(1). From the piece that is largest at
    ``j = 0`` (the steeper on a tie) the run moves, at each crossover, to the piece that
    overtakes it first; slopes only grow, so it moves at most twice. :meth:`steps_within`
    inverts it by bisection over ``k``: O(log k).

    >>> run = DecodeRun(1.0, 0.0, 0.0, 1.0, 0.0)   # max(1, j)
    >>> [run.time(k) for k in range(5)]
    [0.0, 1.0, 2.0, 4.0, 7.0]
    >>> run.steps_within(4.5, 10)
    3
    """

    a1: float
    g1: float
    a2: float
    g2: float
    c: float
    a3: float = 0.0
    g3: float = 0.0

    def time(self, k: int) -> float:
        """Seconds for the first ``k`` steps."""
        if k <= 0:
            return 0.0
        pieces = ((self.a1, self.g1), (self.a2, self.g2), (self.a3, self.g3))
        cur = 0
        for i in (1, 2):
            a, g = pieces[i]
            if a > pieces[cur][0] or (a == pieces[cur][0] and g > pieces[cur][1]):
                cur = i
        total, start = 0.0, 0
        while start < k:
            a, g = pieces[cur]
            # The piece that overtakes this one first (the steeper of two at the same point).
            first, nxt = float(k), cur
            for i in (0, 1, 2):
                other_a, other_g = pieces[i]
                if other_g > g:
                    crossover = (a - other_a) / (other_g - g)
                    if crossover < first or (
                        crossover == first and nxt != cur and other_g > pieces[nxt][1]
                    ):
                        first, nxt = crossover, i
            if nxt == cur:
                total += _series(a, g, start, k)
                break
            split = max(start, math.ceil(first))
            total += _series(a, g, start, split)
            start, cur = split, nxt
        return total + self.c * k

    def steps_within(self, seconds: float, limit: int) -> int:
        """The most steps (at most ``limit``) that complete within ``seconds``."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _series(a: float, g: float, start: int, stop: int) -> float:
    """Sum of ``a + g*j`` for ``start <= j < stop``."""
    n = stop - start
    if n <= 0:
        return 0.0
    return a * n + g * (start + stop - 1) * n / 2


class RooflineConstants(TypedDict):
    """The constants :class:`RooflineStepModel` derives once; every step time is computed from
    them, the model's dimensions and the batch (see :meth:`RooflineStepModel.constants`)."""

    flop_rate: float
    """Achieved matmul FLOP/s over the tensor-parallel group (large batches)."""
    byte_rate: float
    """Achieved HBM bytes/s over the tensor-parallel group (small batches)."""
    attn: float
    """Attention FLOPs per (query token, key token) pair over all layers."""
    kvb: float
    """KV-cache bytes per token."""
    body2: float
    """Two FLOPs per active parameter but the embedding table and the LM head, per token."""
    lm2: float
    """LM-head FLOPs per row that needs logits."""
    dense_bytes: float
    """Weight bytes read per step for a dense model (0 for a mixture of experts)."""
    read_params: float
    """Parameters a step reads in full (all but an untied embedding table)."""
    overlap: float
    """Weight of ``t_c + t_m`` in the transition between the two bounds."""
    token_s: float
    """Seconds of element-wise layers per token."""
    request_s: float
    """Seconds per row that needs logits (attention setup)."""
    prefill_request_s: float
    """Seconds per prefill chunk in the step."""
    idle_start_s: float
    """Seconds a step that starts on an idle replica adds."""


@dataclass(frozen=True)
class RooflineStepModel:
    """Step time from peak FLOP/s and HBM bandwidth with measured efficiencies (module docs).

    Args:
        model, gpu: the presets in :data:`MODELS` and :data:`GPUS` (or your own specs).
        tp: tensor-parallel degree (GPUs per replica); ``None`` takes the model's default.
        compute_eff: matmul efficiency for large batches (MFU); ``None``: the GPU's ``mfu``.
        memory_eff: bandwidth efficiency for small batches (MBU); ``None``: the GPU's ``mbu``.
        overlap: the transition term's weight; ``None``: the GPU's.
        elementwise_bytes: element-wise bytes per hidden unit, token and layer; ``None``: the
            GPU's.
        request_overhead_s: fixed cost per row that needs logits in a step (every decode
            request and one per step with prefill); 0 by default: no published measurement
            separates it.
        prefill_request_s: fixed cost per prefill chunk in a step (attention metadata, sampler
            and scheduling of one more sequence: the linear model's ``b5``); 0 by default: no
            published GPU measurement separates it (``llmsched calibrate`` fits it on a real
            engine).
        idle_start_s: extra cost of a step that starts on an idle replica (the linear model's
            ``b6``); 0 by default, like ``prefill_request_s``.
        step_overhead_s: fixed CPU/launch cost per step.
        allreduce_latency_s: per all-reduce (two per layer) when ``tp > 1``.
        gpu_memory_utilization: vLLM's fraction of GPU memory it may use.
        activation_reserve: bytes per GPU kept for activations and CUDA graphs.

    >>> RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"]).kv_capacity_tokens()
    410404
    """

    model: ModelSpec
    gpu: GpuSpec
    tp: int | None = None
    compute_eff: float | None = None
    memory_eff: float | None = None
    overlap: float | None = None
    elementwise_bytes: float | None = None
    request_overhead_s: float = 0.0
    prefill_request_s: float = 0.0
    idle_start_s: float = 0.0
    step_overhead_s: float = 0.5e-3
    allreduce_latency_s: float = 8e-6
    gpu_memory_utilization: float = 0.9
    activation_reserve: float = 2 * GIB
    # Derived in __post_init__ (see _derive).
    _flop_rate: float = field(init=False, repr=False, compare=False, default=0.0)
    _byte_rate: float = field(init=False, repr=False, compare=False, default=0.0)
    _attn: float = field(init=False, repr=False, compare=False, default=0.0)
    _kvb: float = field(init=False, repr=False, compare=False, default=0.0)
    _body2: float = field(init=False, repr=False, compare=False, default=0.0)
    _lm2: float = field(init=False, repr=False, compare=False, default=0.0)
    _dense_bytes: float = field(init=False, repr=False, compare=False, default=0.0)
    _token_s: float = field(init=False, repr=False, compare=False, default=0.0)

    def __post_init__(self) -> None:
        if self.tp is None:
            object.__setattr__(self, "tp", self.model.default_tp)
        defaults = {
            "compute_eff": self.gpu.mfu,
            "memory_eff": self.gpu.mbu,
            "overlap": self.gpu.overlap,
            "elementwise_bytes": self.gpu.elementwise_bytes,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("compute_eff", "memory_eff", "gpu_memory_utilization"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        overlap = self.overlap
        if not (isinstance(overlap, (int, float)) and 0 <= overlap <= 1):
            raise ConfigError(f"overlap must be in [0, 1], got {overlap!r}")
        for name in (
            "elementwise_bytes",
            "request_overhead_s",
            "prefill_request_s",
            "idle_start_s",
            "step_overhead_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp must be a positive int, got {self.tp!r}")
        if self.model.body_params <= 0:
            raise ConfigError(
                f"{self.model.name}: the embedding and LM head ({self.model.vocab} x "
                f"{self.model.hidden}) leave no active parameters"
            )
        self._derive()
        if self.kv_capacity_tokens() < 1:
            raise ConfigError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}: no room for KV"
            )

    def _derive(self) -> None:
        """Constants every step uses, computed once (the model is immutable)."""
        tp = self.tp
        assert tp is not None and self.compute_eff is not None and self.memory_eff is not None
        assert self.elementwise_bytes is not None
        m = self.model
        derived = {
            "_flop_rate": tp * self.gpu.flops * self.compute_eff,
            "_byte_rate": tp * self.gpu.hbm_bw * self.memory_eff,
            # QK^T and AV, 2 FLOPs per multiply-add, per (query token, key token) pair.
            "_attn": 4.0 * m.layers * m.heads * m.head_dim,
            "_kvb": m.kv_bytes_per_token,
            "_body2": 2.0 * m.body_params,
            "_lm2": 2.0 * m.lm_head_params,
            "_dense_bytes": m.read_params * m.bytes_per_param if not m.experts else 0.0,
            "_token_s": self.elementwise_bytes * m.layers * m.hidden / (tp * self.gpu.hbm_bw),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def constants(self) -> RooflineConstants:
        """The derived per-step constants, for an engine that evaluates the same formula
        elsewhere (the simulator's native engine).

        >>> RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"]).constants()["attn"]
        524288.0
        """
        assert self.overlap is not None
        return {
            "flop_rate": self._flop_rate,
            "byte_rate": self._byte_rate,
            "attn": self._attn,
            "kvb": float(self._kvb),
            "body2": self._body2,
            "lm2": self._lm2,
            "dense_bytes": float(self._dense_bytes),
            "read_params": float(self.model.read_params),
            "overlap": float(self.overlap),
            "token_s": self._token_s,
            "request_s": float(self.request_overhead_s),
            "prefill_request_s": float(self.prefill_request_s),
            "idle_start_s": float(self.idle_start_s),
        }

    def _fixed(self, tokens: int) -> float:
        tp = self.tp
        assert tp is not None
        if tp == 1 or tokens <= 0:
            return self.step_overhead_s
        per_reduce = tokens * self.model.hidden * 2 * 2 * (tp - 1) / tp
        comm = 2 * self.model.layers * (self.allreduce_latency_s + per_reduce / self.gpu.link_bw)
        return self.step_overhead_s + comm

    def _weights(self, tokens: int) -> float:
        return self._dense_bytes or self.model.weight_bytes_read(tokens)

    def step_time(
        self,
        prefill_tokens: int = 0,
        prefill_sq: float = 0.0,
        prefill_ctx: float = 0.0,
        decode_tokens: int = 0,
        decode_ctx: float = 0.0,
        prefill_read: float = 0.0,
        prefill_requests: int | None = None,
        after_idle: bool = False,
    ) -> float:
        """Seconds for one step (see the module docs)."""
        tokens = prefill_tokens + decode_tokens
        if tokens <= 0:
            return 0.0
        chunks = _chunks(prefill_tokens, prefill_requests)
        rows = decode_tokens + (1 if prefill_tokens > 0 else 0)
        flops = (
            self._body2 * tokens
            + self._lm2 * rows
            + self._attn * (prefill_ctx + prefill_sq / 2 + decode_ctx)
        )
        moved = self._weights(tokens) + self._kvb * (tokens + prefill_read + decode_ctx)
        t_c = flops / self._flop_rate
        t_m = moved / self._byte_rate
        assert self.overlap is not None
        bound = max(t_c, t_m, self.overlap * (t_c + t_m))
        per_item = (
            self._token_s * tokens
            + self.request_overhead_s * rows
            + self.prefill_request_s * chunks
            + self.idle_start_s * after_idle
        )
        return bound + per_item + self._fixed(tokens)

    def decode_run(self, batch: int, ctx: float) -> DecodeRun:
        """Closed-form decode run (``ctx`` grows by ``batch`` per step)."""
        kvb, attn, flop_rate, byte_rate = self._kvb, self._attn, self._flop_rate, self._byte_rate
        assert self.overlap is not None
        a1 = (self._body2 * batch + self._lm2 * batch + attn * ctx) / flop_rate
        g1 = attn * batch / flop_rate
        a2 = (self._weights(batch) + kvb * (batch + ctx)) / byte_rate
        g2 = kvb * batch / byte_rate
        a3 = self.overlap * (a1 + a2)
        g3 = self.overlap * (g1 + g2)
        per_item = self._token_s * batch + self.request_overhead_s * batch
        return DecodeRun(a1, g1, a2, g2, per_item + self._fixed(batch), a3, g3)

    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit beside the weights (vLLM's sizing, simplified)."""
        assert self.tp is not None
        usable = self.tp * (self.gpu.memory * self.gpu_memory_utilization - self.activation_reserve)
        free = usable - self.model.params * self.model.bytes_per_param
        return max(0, int(free // self.model.kv_bytes_per_token))


def _chunks(prefill_tokens: int, prefill_requests: int | None) -> int:
    """Prefill chunks in a step: as given, or one when the step has prefill tokens."""
    if prefill_requests is None:
        return 1 if prefill_tokens > 0 else 0
    return prefill_requests


LINEAR_TERMS = ("b0", "b1", "b2", "b3", "b4", "b5", "b6")


def coefficient_seconds(name: str, value: object) -> float:
    """A step-model coefficient read from a file: a number (or its text: YAML reads ``4e-3``
    as a string) that is finite and >= 0; ConfigError naming ``name`` otherwise. A bool is
    refused: YAML reads ``yes`` and ``on`` as true, which was taken as 1 second.

    >>> coefficient_seconds("b0", "4e-3")
    0.004
    >>> coefficient_seconds("b1", True)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: coefficient b1 must be a finite number >= 0, got True
    """
    number: float | None = None
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number < 0:
        raise ConfigError(f"coefficient {name} must be a finite number >= 0, got {value!r}")
    return number


PLAUSIBLE_STEP_S = 1.0
"""The longest plausible step of one decoding request (``b0 + b2``), in seconds: vLLM takes
about 5-50 ms on a GPU and well under a second on a CPU. A profile past it (or past
:data:`PLAUSIBLE_PREFILL_TOKEN_S` a prefill token) most likely gives milliseconds where seconds
are expected, a model 1000x too slow: it is logged once per profile and counted
(:func:`implausible_profiles`)."""
PLAUSIBLE_PREFILL_TOKEN_S = 0.01
"""The longest plausible prefill time per token (``b1``), in seconds (GPUs: about 1e-5)."""
IMPOSSIBLE_STEP_S = 3600.0
"""A one-request decode step of an hour or more is refused (ConfigError): milliseconds of
over 3.6 s a step are no engine either."""

logger = logging.getLogger("llmsched")
_implausible: dict[str, int] = {}
_implausible_lock = threading.Lock()


def implausible_profiles() -> dict[str, int]:
    """How many times each step-time profile (by where it is described: a file, or
    ``<mapping>``) was loaded with coefficients implausibly large for seconds, since the
    process started (see :data:`PLAUSIBLE_STEP_S`).

    >>> isinstance(implausible_profiles(), dict)
    True
    """
    with _implausible_lock:
        return dict(_implausible)


def check_plausible(where: str, b0: float, b1: float, b2: float) -> None:
    """Warn once per ``where`` (logger ``llmsched``) and count a step-time profile whose
    coefficients, read as seconds, make a one-request decode step longer than
    :data:`PLAUSIBLE_STEP_S` or a prefill token longer than :data:`PLAUSIBLE_PREFILL_TOKEN_S`
    (milliseconds written where seconds are expected); ConfigError from
    :data:`IMPOSSIBLE_STEP_S` on.

    >>> check_plausible("profile.yaml", 0.004, 3e-5, 1e-4)  # 4.1 ms a decode step: seconds
    >>> check_plausible("profile.yaml", 4000.0, 0.0, 0.0)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: profile.yaml: a step of one decoding request takes 4000 s (b0 + b2), more than an hour: step-time coefficients are seconds, not milliseconds
    """  # noqa: E501
    step = b0 + b2
    if step >= IMPOSSIBLE_STEP_S:
        raise ConfigError(
            f"{where}: a step of one decoding request takes {step:g} s (b0 + b2), more than an "
            "hour: step-time coefficients are seconds, not milliseconds"
        )
    if step <= PLAUSIBLE_STEP_S and b1 <= PLAUSIBLE_PREFILL_TOKEN_S:
        return
    with _implausible_lock:
        first = where not in _implausible
        _implausible[where] = _implausible.get(where, 0) + 1
    if first:
        logger.warning(
            "%s: step-time coefficients implausible as seconds: a step of one decoding request "
            "takes %g s (b0 + b2) and a prefill token %g s (b1), where vLLM takes 5-50 ms a step "
            "on a GPU; milliseconds given where seconds are expected make the model 1000x too "
            "slow (coefficients are seconds); counted in "
            "llmsched.sim.stepmodel.implausible_profiles()",
            where,
            step,
            b1,
        )


def kv_capacity(value: object) -> int | None:
    """A KV capacity read from a file: None, or an int >= 1 (not a bool, a float or text);
    ConfigError otherwise.

    >>> kv_capacity(1.5)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: kv_tokens must be a positive int, got 1.5
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"kv_tokens must be a positive int, got {value!r}")
    return value


# The names ``llmsched calibrate`` writes (llmsched.executor.step_time), in the same order.
CALIBRATE_TERMS = (
    "b0",
    "prefill_tokens",
    "decode_tokens",
    "prefill_tokens_sq",
    "decode_context_tokens",
    "prefill_requests",
    "after_idle",
)


@dataclass(frozen=True)
class LinearStepModel:
    """``t = b0 + b1*P + b2*D + b3*sum(chunk^2) + b4*sum(decode KV lengths) + b5*chunks
    + b6*after_idle`` in seconds (``chunks``: the prefill chunks in the step; ``after_idle``: 1
    for a step that starts on an idle replica).

    ``kv_tokens`` optionally fixes the KV capacity of a replica (tokens).

    >>> LinearStepModel(b0=1e-3, b1=2e-5, b2=1e-4).step_time(prefill_tokens=100, decode_tokens=10)
    0.004
    """

    b0: float
    b1: float
    b2: float
    b3: float = 0.0
    b4: float = 0.0
    b5: float = 0.0
    b6: float = 0.0
    kv_tokens: int | None = None
    model: str = "fitted"

    def __post_init__(self) -> None:
        for name in LINEAR_TERMS:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigError(f"coefficient {name} must be a finite number >= 0, got {value!r}")
        if self.b0 + self.b1 + self.b2 <= 0:
            raise ConfigError("a step must take time: b0, b1 and b2 are all zero")
        kv_capacity(self.kv_tokens)

    def step_time(
        self,
        prefill_tokens: int = 0,
        prefill_sq: float = 0.0,
        prefill_ctx: float = 0.0,
        decode_tokens: int = 0,
        decode_ctx: float = 0.0,
        prefill_read: float = 0.0,
        prefill_requests: int | None = None,
        after_idle: bool = False,
    ) -> float:
        """Seconds for one step; ``prefill_ctx`` and ``prefill_read`` are not terms of it."""
        if prefill_tokens + decode_tokens <= 0:
            return 0.0
        return (
            self.b0
            + self.b1 * prefill_tokens
            + self.b2 * decode_tokens
            + self.b3 * prefill_sq
            + self.b4 * decode_ctx
            + self.b5 * _chunks(prefill_tokens, prefill_requests)
            + self.b6 * after_idle
        )

    def decode_run(self, batch: int, ctx: float) -> DecodeRun:
        """One affine piece: ``b0 + b2*batch + b4*(ctx + batch*j)``."""
        a = self.b0 + self.b2 * batch + self.b4 * ctx
        g = self.b4 * batch
        return DecodeRun(a, g, a, g, 0.0)

    def kv_capacity_tokens(self) -> int | None:
        """The configured capacity, if any."""
        return self.kv_tokens


@dataclass
class StepModelConfig:
    """Which step model a scenario uses: a preset roofline (``model``, ``gpu``, ``tp`` and
    ``roofline`` overrides of :class:`RooflineStepModel`'s efficiencies), a linear profile file
    (``profile``), or linear coefficients given inline (``linear: {b0: ..., b1: ...}``)."""

    model: str = "llama-3.1-8b"
    gpu: str = "H100"
    tp: int | None = None
    profile: str | None = None
    linear: dict[str, float] | None = None
    roofline: dict[str, float] = field(default_factory=dict)


def build_step_model(config: StepModelConfig) -> StepModel:
    """The step model ``config`` names; ConfigError for unknown presets or bad parameters."""
    if config.profile is not None and config.linear is not None:
        raise ConfigError("step_model: give a profile file or inline linear coefficients, not both")
    if config.profile is not None:
        return load_step_model(config.profile)
    if config.linear is not None:
        return load_step_model({"coefficients": config.linear}, what="step_model.linear")
    if config.model not in MODELS:
        raise ConfigError(f"unknown model {config.model!r}; presets: {sorted(MODELS)}")
    if config.gpu not in GPUS:
        raise ConfigError(f"unknown gpu {config.gpu!r}; presets: {sorted(GPUS)}")
    allowed = {f.name for f in fields(RooflineStepModel)} - {"model", "gpu", "tp"}
    unknown = sorted(set(config.roofline) - allowed)
    if unknown:
        raise ConfigError(f"unknown roofline parameter(s) {unknown}; known: {sorted(allowed)}")
    return RooflineStepModel(
        MODELS[config.model], GPUS[config.gpu], tp=config.tp, **config.roofline
    )


def load_step_model(
    source: str | Path | Mapping[str, Any], *, what: str = "step model"
) -> LinearStepModel:
    """A :class:`LinearStepModel` from a YAML / JSON file, text or mapping
    (read by :mod:`llmsched.config_loader`; ``what`` names a mapping in messages).

    Schema (both spellings of the coefficients are accepted; absent attention, per-chunk and
    idle terms are 0)::

        model: llama-3.1-8b-h100        # free text, optional
        kv_tokens: 400000               # KV capacity per replica, optional
        coefficients: {b0: 0.004, b1: 3.1e-5, b2: 1.2e-4, b3: 0.0, b4: 0.0}

    or the file ``llmsched calibrate`` writes (``kind: llmsched.step_time_profile``, coefficients
    named ``b0, prefill_tokens, decode_tokens, prefill_tokens_sq, decode_context_tokens,
    prefill_requests, after_idle``; a profile from before these two terms has neither).
    Each coefficient is a finite number of seconds >= 0 (its text too: YAML reads ``4e-3`` as
    text; a bool, such as YAML's ``yes``, is refused), ``kv_tokens`` a positive int. Seconds,
    not milliseconds: coefficients implausible as seconds (:func:`check_plausible`) are logged
    once per profile and counted, and a one-request step of an hour or more is refused.

    >>> load_step_model({"coefficients": {"b0": 0.001, "b1": 1e-5, "b2": 5e-5}}).b1
    1e-05
    """
    doc = read_config(source, what=what)
    where, data = doc.where(), doc.data
    if not isinstance(data.get("coefficients"), dict):
        raise ConfigError(f"{where}: needs a 'coefficients' mapping")
    coefficients = dict(data["coefficients"])
    spelled = {t: t for t in coefficients}  # the name the file gave each coefficient
    for short, long in zip(LINEAR_TERMS, CALIBRATE_TERMS, strict=True):
        if long != short and long in coefficients:
            if short in coefficients:
                raise ConfigError(f"{where}: both {short!r} and {long!r} given")
            coefficients[short] = coefficients.pop(long)
            spelled[short] = long
    unknown = sorted(set(coefficients) - set(LINEAR_TERMS))
    if unknown:
        raise ConfigError(f"{where}: unknown coefficient(s) {unknown}")
    missing = [t for t in ("b0", "b1", "b2") if t not in coefficients]
    if missing:
        raise ConfigError(f"{where}: missing coefficient(s) {missing}")
    meta: dict[str, Any] = data["meta"] if isinstance(data.get("meta"), dict) else {}
    model = data.get("model", meta.get("model", "fitted"))
    kv_tokens = data.get("kv_tokens")
    try:
        loaded = LinearStepModel(
            **{t: coefficient_seconds(spelled[t], v) for t, v in coefficients.items()},
            kv_tokens=kv_tokens,
            model=str(model),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    # Keyed by the file, as StepTimeProfile.load keys it (a mapping or text: ``what``).
    key = str(doc.path) if doc.path is not None else where
    check_plausible(key, loaded.b0, loaded.b1, loaded.b2)
    return loaded
