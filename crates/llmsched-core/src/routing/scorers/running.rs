//! `running-requests-scorer` (also `running-requests-size-scorer`): endpoints running fewer
//! requests score higher, min-max normalised like the queue scorer:
//! `(maxR - r) / (maxR - minR)`, 1 for all when equal. No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct RunningRequestsScorer;

impl Scorer for RunningRequestsScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        super::lower_is_better(cands.iter().map(|c| f64::from(c.metrics.running)), out);
        Ok(())
    }

    fn reads_metrics(&self) -> bool {
        true
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::scorer(RunningRequestsScorer))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "fewer running requests score higher, min-max normalised over the candidates",
        &[],
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let cases: &[(&[u32], &[f64])] = &[
            (&[0, 5, 10], &[1.0, 0.5, 0.0]),
            (&[7, 7], &[1.0, 1.0]),
            (&[1, 3, 2, 5], &[1.0, 0.5, 0.75, 0.0]),
        ];
        for (running, want) in cases {
            let f = Fixture::new(running.len()).running(running);
            assert!(close(&f.score(&RunningRequestsScorer), want), "{running:?}");
        }
    }
}
