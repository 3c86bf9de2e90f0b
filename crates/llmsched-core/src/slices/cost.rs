//! The switch-cost model: what ending a slice costs the yielded request, from model and GPU
//! numbers.
//!
//! Formulas:
//! - prefill (recompute) FLOPs ≈ `2 * params * context`, so an endpoint prefills
//!   `prefill_tokens_per_s = gpu_flops * compute_efficiency / (2 * params)` tokens a second
//!   (Llama-3-8B on an H100 at 50% efficiency: about 32 us per token of context);
//! - KV bytes per token = `2 * layers * kv_heads * head_dim * dtype_bytes` (K and V, every layer;
//!   Llama-3-8B in bf16: 128 KiB);
//! - KV capacity in tokens = `(gpu_memory_bytes * memory_fraction - params * dtype_bytes) /
//!   kv_bytes_per_token` (the memory left once the weights are loaded);
//! - a decode step is memory bound: `decode_step_s ≈ params * dtype_bytes /
//!   (hbm_bytes_per_s * bandwidth_efficiency)` (weights read once per step; KV reads ignored).
//!
//! The cost of a switch for a request with `context` tokens of KV on an endpoint is
//! `switch_s = recompute_tokens / prefill_tokens_per_s + requeue_delay_s` with
//! `recompute_tokens = min(context, max(p_evict * context, tail))`, where `p_evict`, the
//! expected share of the context evicted before the request resumes, comes from the endpoint's
//! free KV and the KV demand of the work admitted in the meantime (see [`evict_probability`]),
//! and `tail = context - floor((context - 1) / block_size) * block_size` (1 to `block_size`
//! tokens) is what a continuation recomputes with nothing evicted: only full blocks are cached,
//! and a prefix-cache hit always leaves the last token to compute (its logits are needed), so
//! the last block is recomputed, partial or full (vLLM's `get_computed_blocks`; the reference
//! executor's `KVCacheManager.lookup`). Eviction takes a request's tail blocks first, so the
//! evicted tokens and the tail overlap: the recompute is the larger of the two. All counts are
//! tokens; `switch_s` is seconds.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::SliceError;
use crate::hashing::MAX_BLOCK_SIZE;

/// The KV block size, in tokens, that engines use by default (vLLM's on CUDA; the simulator's
/// and the reference executor's default): what [`SwitchCostModel::block_size`] defaults to.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Model dimensions that set compute and KV size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelDims {
    /// Parameter count.
    pub params: f64,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per weight and per KV element (2 for bf16).
    pub dtype_bytes: u32,
}

impl ModelDims {
    /// Llama-3-8B (8.03 B parameters, 32 layers, 8 KV heads of 128, bf16).
    pub const LLAMA3_8B: ModelDims =
        ModelDims { params: 8.03e9, layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };

    /// `2 * layers * kv_heads * head_dim * dtype_bytes`.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * f64::from(self.dtype_bytes)
    }

    /// `2 * params` FLOPs per token of prefill.
    pub fn prefill_flops_per_token(&self) -> f64 {
        2.0 * self.params
    }

    pub fn weight_bytes(&self) -> f64 {
        self.params * f64::from(self.dtype_bytes)
    }
}

impl Default for ModelDims {
    fn default() -> Self {
        Self::LLAMA3_8B
    }
}

/// Peak numbers of one GPU (vendor datasheets).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuSpec {
    /// Dense bf16 FLOP/s.
    pub flops: f64,
    pub hbm_bytes_per_s: f64,
    pub memory_bytes: f64,
}

impl GpuSpec {
    /// H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB.
    pub const H100_SXM: GpuSpec =
        GpuSpec { flops: 989e12, hbm_bytes_per_s: 3.35e12, memory_bytes: 80e9 };
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self::H100_SXM
    }
}

/// How to derive a cost model from a model and a GPU (the decoded form of
/// `SwitchCostModel.from_model(...)`). Every field has a default.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModelDims {
    pub model: ModelDims,
    pub gpu: GpuSpec,
    /// Achieved share of peak FLOP/s in prefill.
    pub compute_efficiency: f64,
    /// Achieved share of peak HBM bandwidth in decode.
    pub bandwidth_efficiency: f64,
    /// Share of GPU memory the engine may use (vLLM `gpu_memory_utilization`).
    pub memory_fraction: f64,
    pub requeue_delay_s: f64,
    pub priority_base: f64,
    /// The engine's KV block size, in tokens.
    pub block_size: u32,
}

impl Default for CostModelDims {
    fn default() -> Self {
        Self {
            model: ModelDims::default(),
            gpu: GpuSpec::default(),
            compute_efficiency: 0.5,
            bandwidth_efficiency: 0.7,
            memory_fraction: 0.9,
            requeue_delay_s: 0.005,
            priority_base: 2.0,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }
}

/// The switch-cost model's parameters. Defaults: Llama-3-8B on one H100 SXM
/// (`CostModelDims::default()`); this is the one place they are set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwitchCostModel {
    /// Prompt tokens an endpoint prefills per second (recompute rate).
    pub prefill_tokens_per_s: f64,
    /// Seconds per decode step (one token for every running request).
    pub decode_step_s: f64,
    /// KV cache size of an endpoint, in tokens.
    pub kv_capacity_tokens: f64,
    /// Fixed cost of ending a slice and sending the next one (HTTP round trip, scheduling).
    pub requeue_delay_s: f64,
    /// A request of priority `p` weighs `priority_base ** p`.
    pub priority_base: f64,
    /// The endpoint's KV block size, in tokens (1 to 65,536; [`DEFAULT_BLOCK_SIZE`] by
    /// default): a continuation recomputes its last block even when nothing was evicted.
    pub block_size: u32,
}

impl Default for SwitchCostModel {
    fn default() -> Self {
        Self::from_dims(&CostModelDims::default())
    }
}

impl SwitchCostModel {
    /// Derives the parameters from model dimensions and GPU numbers (formulas in the module docs).
    /// Does not validate; [`SwitchCostModel::validated`] does.
    pub fn from_dims(dims: &CostModelDims) -> Self {
        let usable = dims.gpu.memory_bytes * dims.memory_fraction - dims.model.weight_bytes();
        Self {
            prefill_tokens_per_s: dims.gpu.flops * dims.compute_efficiency
                / dims.model.prefill_flops_per_token(),
            decode_step_s: dims.model.weight_bytes()
                / (dims.gpu.hbm_bytes_per_s * dims.bandwidth_efficiency),
            kv_capacity_tokens: (usable / dims.model.kv_bytes_per_token()).max(0.0),
            requeue_delay_s: dims.requeue_delay_s,
            priority_base: dims.priority_base,
            block_size: dims.block_size,
        }
    }

    /// Decodes parameters given as an object over the defaults; unknown names are rejected.
    pub fn from_params(params: &Value) -> Result<Self, SliceError> {
        decode_params::<Self>("cost model", params)?.validated()
    }

    /// Decodes `CostModelDims` given as an object over the defaults, then derives the model.
    pub fn from_dims_params(dims: &Value) -> Result<Self, SliceError> {
        let dims = decode_params::<CostModelDims>("cost model dims", dims)?;
        for (name, value) in [
            ("compute_efficiency", dims.compute_efficiency),
            ("bandwidth_efficiency", dims.bandwidth_efficiency),
            ("memory_fraction", dims.memory_fraction),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(bad_param("cost model dims", name, "must be in (0, 1]"));
            }
        }
        let model = Self::from_dims(&dims);
        if model.kv_capacity_tokens < 1.0 {
            return Err(bad_param(
                "cost model dims",
                "gpu.memory_bytes",
                "leaves no room for KV after the weights",
            ));
        }
        model.validated()
    }

    /// Checks every parameter is finite and in range.
    pub fn validated(self) -> Result<Self, SliceError> {
        for (name, value) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("decode_step_s", self.decode_step_s),
            ("kv_capacity_tokens", self.kv_capacity_tokens),
            ("priority_base", self.priority_base),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(bad_param("cost model", name, "must be a positive finite number"));
            }
        }
        if !(self.requeue_delay_s.is_finite() && self.requeue_delay_s >= 0.0) {
            return Err(bad_param("cost model", "requeue_delay_s", "must be finite and >= 0"));
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&(self.block_size as usize)) {
            return Err(bad_param("cost model", "block_size", "must be an int in 1..=65536"));
        }
        Ok(self)
    }

    /// The weight of a request of priority `priority`: `priority_base ** priority`.
    #[inline]
    pub fn weight(&self, priority: i32) -> f64 {
        self.priority_base.powf(f64::from(priority))
    }

    /// Seconds to recompute `context` tokens at `prefill_tokens_per_s`.
    #[inline]
    pub fn recompute_s(context: f64, prefill_tokens_per_s: f64) -> f64 {
        context / prefill_tokens_per_s
    }

    /// Tokens a continuation of a request with `context` tokens recomputes when a share
    /// `p_evict` of them was evicted: `min(context, max(p_evict * context, tail))`, where
    /// `tail = context - floor((context - 1) / block_size) * block_size` is the last block, which
    /// a prefix-cache hit never covers (module docs). 0 for no context.
    #[inline]
    pub fn recompute_tokens(&self, p_evict: f64, context: f64) -> f64 {
        if context <= 0.0 {
            return 0.0;
        }
        let block = f64::from(self.block_size.max(1));
        let tail = context - ((context - 1.0) / block).floor() * block;
        (p_evict * context).max(tail).min(context)
    }

    /// `recompute_tokens(p_evict, context) / prefill_tokens_per_s + requeue_delay_s`.
    #[inline]
    pub fn switch_s(&self, p_evict: f64, context: f64, prefill_tokens_per_s: f64) -> f64 {
        Self::recompute_s(self.recompute_tokens(p_evict, context), prefill_tokens_per_s)
            + self.requeue_delay_s
    }
}

/// Expected share of a paused request's `context` tokens evicted before it resumes.
///
/// vLLM keeps a finished (here: paused) request's blocks as evictable cache and evicts free
/// blocks least recently used first, and a request's tail blocks before its head. The blocks of
/// the paused request are the newest, so they go only once the endpoint's other free KV
/// (`free_tokens`) is used up by the work admitted meanwhile (`demand_tokens`):
/// `p_evict = clamp((demand_tokens - free_tokens) / context, 0, 1)`.
/// Growth of the other running requests' KV during the pause is ignored.
#[inline]
pub fn evict_probability(context: f64, demand_tokens: f64, free_tokens: f64) -> f64 {
    if context <= 0.0 {
        return 0.0;
    }
    ((demand_tokens - free_tokens) / context).clamp(0.0, 1.0)
}

/// Decodes a JSON object over `T`'s defaults, naming `what` in errors.
pub(crate) fn decode_params<T: for<'de> Deserialize<'de>>(
    what: &str,
    params: &Value,
) -> Result<T, SliceError> {
    let bad = |reason: String| SliceError::BadParams { what: what.to_string(), reason };
    match params {
        // No parameters at all: every default.
        Value::Null => serde_json::from_value(Value::Object(Default::default())),
        Value::Object(_) => serde_json::from_value(params.clone()),
        _ => return Err(bad("expected an object of named parameters".to_string())),
    }
    .map_err(|e| bad(e.to_string()))
}

pub(crate) fn bad_param(what: &str, name: &str, reason: &str) -> SliceError {
    SliceError::BadParams { what: what.to_string(), reason: format!("{name} {reason}") }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn llama3_8b_on_h100_matches_reference_figures() {
        let dims = ModelDims::LLAMA3_8B;
        assert_eq!(dims.kv_bytes_per_token(), 131_072.0); // 128 KiB
        let model = SwitchCostModel::default();
        let us_per_token = 1e6 / model.prefill_tokens_per_s;
        assert!((us_per_token - 32.5).abs() < 0.5, "{us_per_token}");
        // (72 GB - 16.06 GB) / 128 KiB
        assert!((model.kv_capacity_tokens - 426_788.0).abs() < 1.0, "{}", model.kv_capacity_tokens);
        assert!((model.decode_step_s - 0.006_848).abs() < 1e-5, "{}", model.decode_step_s);
    }

    #[test]
    fn eviction_table() {
        // (context, demand, free, expected)
        let cases = [
            (1000.0, 0.0, 0.0, 0.0),
            (1000.0, 500.0, 1000.0, 0.0),
            (1000.0, 1500.0, 1000.0, 0.5),
            (1000.0, 5000.0, 1000.0, 1.0),
            (0.0, 5000.0, 0.0, 0.0),
        ];
        for (context, demand, free, want) in cases {
            assert_eq!(evict_probability(context, demand, free), want, "{context} {demand} {free}");
        }
    }

    #[test]
    fn switch_cost_adds_recompute_and_requeue() {
        let model = SwitchCostModel { requeue_delay_s: 0.01, ..SwitchCostModel::default() };
        let cost = model.switch_s(0.5, 2000.0, 10_000.0);
        assert!((cost - (0.1 + 0.01)).abs() < 1e-12);
        // Nothing evicted: the last block (16 tokens of 2000) is still recomputed.
        let cost = model.switch_s(0.0, 2000.0, 10_000.0);
        assert!((cost - (16.0 / 10_000.0 + 0.01)).abs() < 1e-12, "{cost}");
        assert_eq!(model.weight(0), 1.0);
        assert_eq!(model.weight(2), 4.0);
        assert_eq!(model.weight(-1), 0.5);
    }

    #[test]
    fn a_continuation_recomputes_its_last_block() {
        let model = SwitchCostModel::default();
        assert_eq!(model.block_size, 16);
        // (context, p_evict, tokens recomputed)
        let cases = [
            (48.0, 0.0, 16.0),
            (64.0, 0.0, 16.0),
            (80.0, 0.0, 16.0),
            (49.0, 0.0, 1.0),
            (50.0, 0.0, 2.0),
            (63.0, 0.0, 15.0),
            (1.0, 0.0, 1.0),
            (0.0, 0.0, 0.0),
            (0.0, 1.0, 0.0),
            (1000.0, 0.5, 500.0),
            (1000.0, 0.001, 8.0), // 1 token evicted from the tail: the last 8 recomputed
            (1000.0, 1.0, 1000.0),
        ];
        for (context, p, want) in cases {
            assert_eq!(model.recompute_tokens(p, context), want, "{context} {p}");
        }
        let model = SwitchCostModel { block_size: 1, ..SwitchCostModel::default() };
        assert_eq!(model.recompute_tokens(0.0, 48.0), 1.0);
        let dims = json!({"block_size": 32});
        assert_eq!(SwitchCostModel::from_dims_params(&dims).unwrap().block_size, 32);
        let err = SwitchCostModel::from_params(&json!({"block_size": 0})).unwrap_err();
        assert!(err.to_string().contains("block_size must be an int in 1..=65536"), "{err}");
        let err = SwitchCostModel::from_params(&json!({"block_size": 65_537})).unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        assert!(SwitchCostModel::from_params(&json!({"block_size": 65_536})).is_ok());
        let err = SwitchCostModel::from_dims_params(&json!({"block_size": 0})).unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        assert!(SwitchCostModel::from_params(&json!({"block_size": 2.5})).is_err());
        assert!(SwitchCostModel::from_params(&json!({"block_size": -1})).is_err());
    }

    #[test]
    fn rejects_unknown_and_bad_params() {
        let err = SwitchCostModel::from_params(&json!({"prefil_tokens_per_s": 3})).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
        let err = SwitchCostModel::from_params(&json!({"decode_step_s": -1})).unwrap_err();
        assert!(err.to_string().contains("decode_step_s"), "{err}");
        let ok = SwitchCostModel::from_params(&json!({"decode_step_s": 0.02})).unwrap();
        assert_eq!(ok.decode_step_s, 0.02);
        assert_eq!(ok.prefill_tokens_per_s, SwitchCostModel::default().prefill_tokens_per_s);
        let err =
            SwitchCostModel::from_dims_params(&json!({"gpu": {"memory_bytes": 1e9}})).unwrap_err();
        assert!(err.to_string().contains("no room"), "{err}");
        let err = SwitchCostModel::from_dims_params(&json!({"model": {"layerz": 3}})).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}
