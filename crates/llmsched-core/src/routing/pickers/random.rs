//! `random-picker`: a uniformly random order (seeded). Parameter `maxNumOfEndpoints`.

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

pub struct RandomPicker {
    limit: usize,
}

impl Picker for RandomPicker {
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
        rng: &mut DecisionRng,
        order: &mut Vec<usize>,
    ) -> PluginResult {
        // A partial Fisher-Yates shuffle: the first `limit` places only.
        let mut idx: Vec<usize> = (0..cands.len()).collect();
        let k = self.limit.min(idx.len());
        for i in 0..k {
            let j = i + rng.below(idx.len() - i);
            idx.swap(i, j);
        }
        order.extend_from_slice(&idx[..k]);
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::picker(RandomPicker { limit: p.max_num_of_endpoints.check()? }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("picker", "a uniformly random order", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn uniform_and_seeded() {
        let f = Fixture::new(4);
        let mut counts = [0u32; 4];
        for seed in 0..4000 {
            let run = |seed| {
                let mut order = Vec::new();
                let mut rng = DecisionRng::new(seed, 1);
                RandomPicker { limit: 4 }
                    .pick(&f.ctx(), &f.candidates, &[0.0; 4], &mut rng, &mut order)
                    .unwrap();
                order
            };
            let order = run(seed);
            assert_eq!(order, run(seed));
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2, 3]);
            counts[order[0]] += 1;
        }
        assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "{counts:?}");
    }
}
