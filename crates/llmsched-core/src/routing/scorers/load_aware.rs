//! `load-aware-scorer`: an empty queue scores 0.5; a queue of `q` scores `0.5 * (1 - q/T)`,
//! reaching 0 at `q >= T`. Parameter `threshold` (T, default 128, must be positive).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    threshold: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params { threshold: 128 }
    }
}

pub struct LoadAwareScorer {
    threshold: f64,
}

impl Scorer for LoadAwareScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        for (o, c) in out.iter_mut().zip(cands) {
            let q = f64::from(c.metrics.waiting).min(self.threshold);
            *o = if q == 0.0 { 0.5 } else { 0.5 * (1.0 - q / self.threshold) };
        }
        Ok(())
    }

    fn reads_metrics(&self) -> bool {
        true
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    if p.threshold == 0 {
        return Err(ParamError::new("threshold", "must be positive"));
    }
    Ok(Plugin::scorer(LoadAwareScorer { threshold: p.threshold as f64 }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("threshold", "waiting requests at which the score reaches 0").min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "`0.5 * (1 - waiting / threshold)`, 0 from `threshold` waiting requests on",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let s = LoadAwareScorer { threshold: 128.0 };
        let cases: &[(&[u32], &[f64])] = &[
            (&[0, 64, 128, 500], &[0.5, 0.25, 0.0, 0.0]),
            (&[1, 32, 96], &[0.5 * (1.0 - 1.0 / 128.0), 0.375, 0.125]),
        ];
        for (queues, want) in cases {
            let f = Fixture::new(queues.len()).waiting(queues);
            assert!(close(&f.score(&s), want), "{queues:?}");
        }
        assert!(factory(&serde_json::json!({"threshold": 0})).is_err());
    }
}
