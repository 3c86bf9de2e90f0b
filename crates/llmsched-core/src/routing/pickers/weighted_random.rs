//! `weighted-random-picker`: picks with probability proportional to the total score, by
//! reservoir keys `U^(1/score)` (largest first; Efraimidis-Spirakis), which also orders the
//! fallbacks as weighted sampling without replacement. Zero scores come last in random order;
//! all zero is uniform. Parameter `maxNumOfEndpoints`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{top_k, MaxEndpoints};
use crate::routing::plugin::{Candidate, Picker, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    max_num_of_endpoints: MaxEndpoints,
}

pub struct WeightedRandomPicker {
    limit: usize,
}

impl Picker for WeightedRandomPicker {
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
        // ln(U^(1/w)) = ln(U)/w keeps the order and stays finite for small weights.
        let keys: Vec<(bool, f64)> = totals
            .iter()
            .map(|&w| {
                let u = rng.open_unit();
                if w > 0.0 {
                    (true, u.ln() / w)
                } else {
                    (false, u)
                }
            })
            .collect();
        top_k(
            cands.len(),
            self.limit,
            |&a, &b| keys[b].0.cmp(&keys[a].0).then(keys[b].1.total_cmp(&keys[a].1)),
            order,
        );
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::picker(WeightedRandomPicker { limit: p.max_num_of_endpoints.check()? }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "picker",
        "random with probability proportional to the total score",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    fn firsts(totals: &[f64], runs: u64) -> Vec<u32> {
        let f = Fixture::new(totals.len());
        let mut counts = vec![0u32; totals.len()];
        for seed in 0..runs {
            let mut order = Vec::new();
            let mut rng = DecisionRng::new(seed, 7);
            WeightedRandomPicker { limit: 2 }
                .pick(&f.ctx(), &f.candidates, totals, &mut rng, &mut order)
                .unwrap();
            counts[order[0]] += 1;
        }
        counts
    }

    #[test]
    fn proportional_to_score() {
        let c = firsts(&[1.0, 3.0, 0.0], 8000);
        assert_eq!(c[2], 0);
        assert!((1800..2200).contains(&c[0]), "{c:?}");
        let uniform = firsts(&[0.0, 0.0], 4000);
        assert!((1800..2200).contains(&uniform[0]), "{uniform:?}");
    }
}
