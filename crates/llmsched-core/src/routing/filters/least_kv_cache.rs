//! `least-kv-cache-filter` (the Inference Extension's; older name `least-kv-cache`): keeps the
//! endpoints whose KV-cache use lies in the lowest band, `[min, min + (max - min) / n]` with `n`
//! candidates, as there. Never empties a non-empty set. No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct LeastKvCacheFilter;

impl Filter for LeastKvCacheFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn filter(
        &self,
        _: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        if cands.is_empty() {
            return Ok(());
        }
        let (min, max) = cands.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.metrics.kv_cache_usage), hi.max(c.metrics.kv_cache_usage))
        });
        let top = min + (max - min) / cands.len() as f64;
        for (k, c) in keep.iter_mut().zip(cands) {
            *k = c.metrics.kv_cache_usage <= top;
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::filter(LeastKvCacheFilter))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints whose KV-cache use lies in the lowest band `[min, min + (max - min) / n]`",
        &[],
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let cases: &[(&[f64], &[usize])] = &[
            // min 0.1, max 0.9, 4 endpoints: band [0.1, 0.3].
            (&[0.1, 0.3, 0.31, 0.9], &[0, 1]),
            (&[0.5, 0.5], &[0, 1]),
            (&[0.2], &[0]),
            // min 0, max 1, 3 endpoints: band [0, 1/3].
            (&[1.0, 0.5, 0.0], &[2]),
        ];
        for (kv, want) in cases {
            let f = Fixture::new(kv.len()).kv(kv);
            assert_eq!(f.filter(&LeastKvCacheFilter), want.to_vec(), "{kv:?}");
        }
    }
}
