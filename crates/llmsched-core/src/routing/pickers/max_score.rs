//! `max-score-picker`: the highest total score wins, ties broken at random (seeded); fallbacks
//! follow in descending score. Parameter `maxNumOfEndpoints`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{desc_then_tie, top_k, MaxEndpoints};
use crate::routing::plugin::{Candidate, Picker, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    max_num_of_endpoints: MaxEndpoints,
}

pub struct MaxScorePicker {
    pub limit: usize,
}

impl Picker for MaxScorePicker {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn pick(
        &self,
        _: &RequestContext<'_>,
        cands: &[Candidate],
        totals: &[f64],
        rng: &mut DecisionRng,
        order: &mut Vec<usize>,
    ) -> PluginResult {
        let tie: Vec<u64> = (0..cands.len()).map(|_| rng.next_u64()).collect();
        top_k(cands.len(), self.limit, |&a, &b| desc_then_tie(totals, &tie, a, b), order);
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::picker(MaxScorePicker { limit: p.max_num_of_endpoints.check()? }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "picker",
        "the highest total score wins, ties at random; fallbacks by descending score",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    fn pick(totals: &[f64], limit: usize, seed: u64) -> Vec<usize> {
        let f = Fixture::new(totals.len());
        let mut order = Vec::new();
        let mut rng = DecisionRng::new(seed, 0);
        MaxScorePicker { limit }
            .pick(&f.ctx(), &f.candidates, totals, &mut rng, &mut order)
            .unwrap();
        order
    }

    #[test]
    fn orders_by_score_and_breaks_ties_at_random() {
        assert_eq!(pick(&[3.6, 4.4, 3.2], 4, 0), vec![1, 0, 2]);
        assert_eq!(pick(&[1.0, 5.0, 2.0, 4.0, 3.0], 2, 0), vec![1, 3]);
        let mut firsts = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let order = pick(&[1.0, 2.0, 2.0, 2.0], 4, seed);
            assert_eq!(order[3], 0);
            assert_eq!(order, pick(&[1.0, 2.0, 2.0, 2.0], 4, seed), "seeded");
            firsts.insert(order[0]);
        }
        assert_eq!(firsts.into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
    }
}
