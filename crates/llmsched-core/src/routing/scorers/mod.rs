//! Scorers: one file each, with its formula, parameters and a table-driven test.

pub mod active_request;
pub mod kv_cache;
pub mod load_aware;
pub mod lora_affinity;
pub mod no_hit_lru;
pub mod precise_prefix;
pub mod prefix_cache;
pub mod queue;
pub mod running;
pub mod session_affinity;
pub mod token_load;

/// Min-max normalisation, lower is better: `(max - v) / (max - min)`; all equal -> 1.
pub(crate) fn lower_is_better(values: impl Iterator<Item = f64> + Clone, out: &mut [f64]) {
    let (lo, hi) = values
        .clone()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    for (o, v) in out.iter_mut().zip(values) {
        *o = if hi > lo { (hi - v) / (hi - lo) } else { 1.0 };
    }
}
