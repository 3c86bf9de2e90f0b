//! `softmax-cost-picker`: NVIDIA Dynamo's KV router. Each candidate's cost, in blocks, is
//! `prefillLoadScale * max(0, prompt_blocks - cached_blocks + active_prefill_blocks) +
//! active_decode_blocks`, with the active blocks from the router's in-flight counts (prefill:
//! uncached tokens not yet prefilled; decode: prompt tokens of requests in flight).
//!
//! `temperature` 0 (the default) takes the lowest cost; ties go to the endpoint holding the
//! fewest blocks in the prefix index (Dynamo's "smallest tree"), then at random. Above 0, costs
//! are normalised to logits `-(cost - min) / (max - min)` and sampled by softmax at that
//! temperature (Gumbel-max, which also orders the fallbacks). Parameters: `temperature`,
//! `prefillLoadScale` (default 1), `maxNumOfEndpoints`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{top_k, MaxEndpoints};
use crate::routing::plugin::{Candidate, Picker, PluginResult, RequestContext};
use crate::routing::registry::{
    check_range, decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc,
};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    temperature: f64,
    prefill_load_scale: f64,
    max_num_of_endpoints: MaxEndpoints,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            temperature: 0.0,
            prefill_load_scale: 1.0,
            max_num_of_endpoints: MaxEndpoints::default(),
        }
    }
}

pub struct SoftmaxCostPicker {
    temperature: f64,
    prefill_load_scale: f64,
    limit: usize,
}

impl SoftmaxCostPicker {
    /// Dynamo's cost of sending the request to `c`, in blocks.
    pub fn cost(&self, ctx: &RequestContext<'_>, c: &Candidate) -> f64 {
        let bs = ctx.block_size as f64;
        let prompt_blocks = ctx.prompt_tokens as f64 / bs;
        let prefill_blocks = c.inflight.prefill_tokens as f64 / bs;
        let decode_blocks = c.inflight.tokens as f64 / bs;
        let potential_prefill =
            (prompt_blocks - f64::from(c.cached_blocks) + prefill_blocks).max(0.0);
        self.prefill_load_scale * potential_prefill + decode_blocks
    }
}

impl Picker for SoftmaxCostPicker {
    fn reads_scores(&self) -> bool {
        false
    }

    fn pick(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        _: &[f64],
        rng: &mut DecisionRng,
        order: &mut Vec<usize>,
    ) -> PluginResult {
        let costs: Vec<f64> = cands.iter().map(|c| self.cost(ctx, c)).collect();
        if self.temperature == 0.0 {
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            // Tree sizes only for the tied cheapest: they cost an index lookup each.
            let tree: Vec<u64> = cands
                .iter()
                .zip(&costs)
                .map(|(c, &cost)| if cost == min { ctx.held_blocks(c) } else { u64::MAX })
                .collect();
            let tie: Vec<u64> = (0..cands.len()).map(|_| rng.next_u64()).collect();
            top_k(
                cands.len(),
                self.limit,
                |&a, &b| {
                    costs[a]
                        .total_cmp(&costs[b])
                        .then(tree[a].cmp(&tree[b]))
                        .then(tie[a].cmp(&tie[b]))
                },
                order,
            );
            return Ok(());
        }
        let (lo, hi) = costs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| (lo.min(c), hi.max(c)));
        let keys: Vec<f64> = costs
            .iter()
            .map(|&c| {
                let logit = if hi > lo { -(c - lo) / (hi - lo) } else { 0.0 };
                logit / self.temperature + rng.gumbel()
            })
            .collect();
        top_k(cands.len(), self.limit, |&a, &b| keys[b].total_cmp(&keys[a]), order);
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }

    /// Ties are broken by the endpoints' tree sizes.
    fn reads_tree_size(&self) -> bool {
        true
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    check_range("temperature", p.temperature, 0.0, f64::MAX)?;
    check_range("prefillLoadScale", p.prefill_load_scale, 0.0, f64::MAX)?;
    Ok(Plugin::picker(SoftmaxCostPicker {
        temperature: p.temperature,
        prefill_load_scale: p.prefill_load_scale,
        limit: p.max_num_of_endpoints.check()?,
    }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::number("temperature", "0: lowest cost; above 0: softmax sampling").min(0.0),
    ParamDoc::number("prefillLoadScale", "weight of the prefill blocks in the cost").min(0.0),
    ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("picker", "Dynamo's KV router: lowest prefill-plus-decode block cost, or softmax sampling at `temperature`", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    fn picker(temperature: f64) -> SoftmaxCostPicker {
        SoftmaxCostPicker { temperature, prefill_load_scale: 1.0, limit: 4 }
    }

    #[test]
    fn cost_table() {
        // 160-token prompt = 10 blocks of 16.
        let f = Fixture::new(3).cached(&[0, 10, 4]).inflight(&[0, 2, 1], &[0, 320, 64]);
        let p = picker(0.0);
        let ctx = f.ctx();
        let costs: Vec<f64> = f.candidates.iter().map(|c| p.cost(&ctx, c)).collect();
        // e0: 10 + 0; e1: (10-10+20) + 20; e2: (10-4+4) + 4.
        assert_eq!(costs, vec![10.0, 40.0, 14.0]);
        let mut order = Vec::new();
        p.pick(&ctx, &f.candidates, &[], &mut DecisionRng::new(0, 0), &mut order).unwrap();
        assert_eq!(order, vec![0, 2, 1]);
    }

    #[test]
    fn temperature_spreads_choices_reproducibly() {
        let f = Fixture::new(2).cached(&[0, 10]);
        let mut counts = [0u32; 2];
        for seed in 0..2000 {
            let run = |seed| {
                let mut order = Vec::new();
                picker(1.0)
                    .pick(&f.ctx(), &f.candidates, &[], &mut DecisionRng::new(seed, 0), &mut order)
                    .unwrap();
                order
            };
            assert_eq!(run(seed), run(seed));
            counts[run(seed)[0]] += 1;
        }
        // Logits 0 (cached) and -1: P(cached) = e / (1 + e) = 0.731.
        assert!((1380..1540).contains(&counts[1]), "{counts:?}");
    }
}
