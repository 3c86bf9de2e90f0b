//! `power-of-two-picker`: draws two distinct candidates at random and takes the one with the
//! higher total score (a random one on a tie); the other is the first fallback, then the rest
//! by descending score. With load scorers this is the classic "power of two choices".
//! Parameter `maxNumOfEndpoints`.

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

pub struct PowerOfTwoPicker {
    limit: usize,
}

impl Picker for PowerOfTwoPicker {
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
        let n = cands.len();
        if n < 2 {
            order.extend(0..n);
            return Ok(());
        }
        let a = rng.below(n);
        let b = (a + 1 + rng.below(n - 1)) % n;
        let a_wins = match totals[a].total_cmp(&totals[b]) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Equal => rng.next_u64() & 1 == 0,
        };
        let (first, second) = if a_wins { (a, b) } else { (b, a) };
        order.push(first);
        if self.limit > 1 {
            order.push(second);
        }
        if self.limit > 2 {
            let tie: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
            let mut rest = Vec::new();
            top_k(n, self.limit, |&x, &y| desc_then_tie(totals, &tie, x, y), &mut rest);
            order.extend(
                rest.into_iter().filter(|&i| i != first && i != second).take(self.limit - 2),
            );
        }
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    Ok(Plugin::picker(PowerOfTwoPicker { limit: p.max_num_of_endpoints.check()? }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("picker", "the better of two random candidates", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn better_of_two() {
        let f = Fixture::new(3);
        let totals = [0.0, 1.0, 2.0];
        let mut counts = [0u32; 3];
        for seed in 0..3000 {
            let mut order = Vec::new();
            PowerOfTwoPicker { limit: 3 }
                .pick(&f.ctx(), &f.candidates, &totals, &mut DecisionRng::new(seed, 0), &mut order)
                .unwrap();
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2]);
            counts[order[0]] += 1;
        }
        // The worst never wins; the best wins the 2 of 3 pairs it is in.
        assert_eq!(counts[0], 0);
        assert!((1900..2100).contains(&counts[2]), "{counts:?}");
    }
}
