//! `round-robin-picker`: takes candidates in turn (pool order), one step per decision, whatever
//! the scores; fallbacks are the next ones in turn. Parameter `maxNumOfEndpoints`.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::MaxEndpoints;
use crate::routing::plugin::{Candidate, Picker, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    max_num_of_endpoints: MaxEndpoints,
}

pub struct RoundRobinPicker {
    next: AtomicU64,
    limit: usize,
}

impl Picker for RoundRobinPicker {
    fn reads_scores(&self) -> bool {
        false
    }

    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn pick(
        &self,
        _: &RequestContext<'_>,
        cands: &[Candidate],
        _: &[f64],
        _: &mut DecisionRng,
        order: &mut Vec<usize>,
    ) -> PluginResult {
        let n = cands.len();
        if n == 0 {
            return Ok(());
        }
        let start = (self.next.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
        order.extend((0..self.limit.min(n)).map(|i| (start + i) % n));
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::picker(RoundRobinPicker {
        next: AtomicU64::new(0),
        limit: p.max_num_of_endpoints.check()?,
    }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "picker",
        "candidates in turn, whatever the scores",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn rotates() {
        let f = Fixture::new(3);
        let p = RoundRobinPicker { next: AtomicU64::new(0), limit: 2 };
        let firsts: Vec<Vec<usize>> = (0..4)
            .map(|_| {
                let mut order = Vec::new();
                p.pick(&f.ctx(), &f.candidates, &[], &mut DecisionRng::new(0, 0), &mut order)
                    .unwrap();
                order
            })
            .collect();
        assert_eq!(firsts, vec![vec![0, 1], vec![1, 2], vec![2, 0], vec![0, 1]]);
    }
}
