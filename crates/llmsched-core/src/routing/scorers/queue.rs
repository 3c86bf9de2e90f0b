//! `queue-scorer`: endpoints with fewer waiting requests score higher, min-max normalised over
//! the candidates: `(maxQ - q) / (maxQ - minQ)`, and 1 for all when every queue is equal.
//! No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        super::lower_is_better(cands.iter().map(|c| f64::from(c.metrics.waiting)), out);
        Ok(())
    }

    fn reads_metrics(&self) -> bool {
        true
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::scorer(QueueScorer))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "fewer waiting requests score higher, min-max normalised over the candidates",
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
            (&[0, 4, 8], &[1.0, 0.5, 0.0]),
            (&[3, 3, 3], &[1.0, 1.0, 1.0]),
            (&[5], &[1.0]),
            (&[10, 0], &[0.0, 1.0]),
            (&[2, 4, 10], &[1.0, 0.75, 0.0]),
        ];
        for (queues, want) in cases {
            let f = Fixture::new(queues.len()).waiting(queues);
            assert!(close(&f.score(&QueueScorer), want), "{queues:?}");
        }
    }
}
