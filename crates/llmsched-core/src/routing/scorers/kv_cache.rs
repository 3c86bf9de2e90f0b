//! `kv-cache-utilization-scorer`: `1 - kv_cache_usage`. No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = 1.0 - c.metrics.kv_cache_usage;
        }
        Ok(())
    }

    fn reads_metrics(&self) -> bool {
        true
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::scorer(KvCacheScorer))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("scorer", "`1 - kv_cache_usage`", &[], defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let cases: &[(&[f64], &[f64])] =
            &[(&[0.2, 0.5, 0.9], &[0.8, 0.5, 0.1]), (&[0.0, 1.0], &[1.0, 0.0])];
        for (kv, want) in cases {
            let f = Fixture::new(kv.len()).kv(kv);
            assert!(close(&f.score(&KvCacheScorer), want), "{kv:?}");
        }
    }
}
