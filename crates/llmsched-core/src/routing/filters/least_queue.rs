//! `least-queue-filter` (the Inference Extension's; older name `least-queue`): keeps the
//! endpoints whose waiting queue lies in the lowest band, `[min, min + (max - min) / n]` with
//! `n` candidates and integer division, as there: several nearly-idle endpoints stay, so the
//! filters after it still have a choice. Never empties a non-empty set. No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct LeastQueueFilter;

impl Filter for LeastQueueFilter {
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
        let Some(min) = cands.iter().map(|c| c.metrics.waiting).min() else { return Ok(()) };
        let max = cands.iter().map(|c| c.metrics.waiting).max().unwrap_or(min);
        let top = min + (max - min) / cands.len() as u32;
        for (k, c) in keep.iter_mut().zip(cands) {
            *k = c.metrics.waiting <= top;
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::filter(LeastQueueFilter))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints whose queue lies in the lowest band `[min, min + (max - min) / n]`",
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
        // min 0, max 10, 4 endpoints: band [0, 0 + 10 / 4 = 2].
        let cases: &[(&[u32], &[usize])] = &[
            (&[0, 2, 3, 10], &[0, 1]),
            (&[5, 5, 5], &[0, 1, 2]),
            (&[7], &[0]),
            // min 1, max 9, 2 endpoints: band [1, 5].
            (&[1, 9], &[0]),
            // min 1, max 9, 4 endpoints: band [1, 3].
            (&[4, 1, 5, 9], &[1]),
        ];
        for (queues, want) in cases {
            let f = Fixture::new(queues.len()).waiting(queues);
            assert_eq!(f.filter(&LeastQueueFilter), want.to_vec(), "{queues:?}");
        }
    }
}
