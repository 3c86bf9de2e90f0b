//! `low-queue-filter` (the Inference Extension's; older name `low-queue`): keeps endpoints with
//! at most `threshold` waiting requests (default 128, the Extension's `queueingThresholdLoRA`).
//! Fails closed, as there: when no endpoint qualifies the set is empty, which a
//! `decision-tree-filter` reads as failure and a profile as no endpoint.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    threshold: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params { threshold: 128 }
    }
}

pub struct LowQueueFilter {
    threshold: u32,
}

impl Filter for LowQueueFilter {
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
        for (k, c) in keep.iter_mut().zip(cands) {
            *k = c.metrics.waiting <= self.threshold;
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::filter(LowQueueFilter { threshold: p.threshold }))
}

const PARAMS: &[ParamDoc] = &[ParamDoc::int("threshold", "waiting requests an endpoint may have")];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints with at most `threshold` waiting requests; fails closed",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let f = LowQueueFilter { threshold: 128 };
        assert_eq!(Fixture::new(4).waiting(&[0, 128, 129, 500]).filter(&f), vec![0, 1]);
        assert_eq!(Fixture::new(2).waiting(&[200, 300]).filter(&f), Vec::<usize>::new());
        assert_eq!(f.on_empty(), OnEmpty::FailClosed);
    }

    #[test]
    fn params() {
        let Plugin::Filter(f) = factory(&serde_json::json!({"threshold": 3})).unwrap() else {
            panic!()
        };
        assert_eq!(Fixture::new(3).waiting(&[2, 3, 4]).filter(f.as_ref()), vec![0, 1]);
        assert_eq!(factory(&serde_json::json!({"threshold": -1})).err().unwrap().path, "threshold");
        assert_eq!(factory(&serde_json::json!({"treshold": 1})).err().unwrap().path, "treshold");
    }
}
