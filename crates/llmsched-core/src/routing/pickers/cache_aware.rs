//! `cache-aware-picker`: SGLang router's cache-aware policy, over the router's own in-flight
//! request counts as the load.
//!
//! The pool is imbalanced when `max_load - min_load > balanceAbsThreshold` and
//! `max_load > min_load * balanceRelThreshold`; then the least loaded endpoint wins. Otherwise
//! the endpoint with the longest cached prefix wins if its match ratio (cached / prompt blocks)
//! exceeds `cacheThreshold`, else the least loaded. Ties at random; fallbacks by ascending load.
//! Defaults are SGLang's CLI defaults: 0.3, 64, 1.5. Parameter `maxNumOfEndpoints` too.

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
    cache_threshold: f64,
    balance_abs_threshold: u64,
    balance_rel_threshold: f64,
    max_num_of_endpoints: MaxEndpoints,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_num_of_endpoints: MaxEndpoints::default(),
        }
    }
}

pub struct CacheAwarePicker {
    p: Params,
    limit: usize,
}

impl Picker for CacheAwarePicker {
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
        let n = cands.len();
        if n == 0 {
            return Ok(());
        }
        let load: Vec<u64> = cands.iter().map(|c| c.inflight.requests).collect();
        let (lo, hi) =
            (load.iter().min().copied().unwrap_or(0), load.iter().max().copied().unwrap_or(0));
        let imbalanced = hi - lo > self.p.balance_abs_threshold
            && hi as f64 > lo as f64 * self.p.balance_rel_threshold;
        let tie: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
        let by_load = |a: &usize, b: &usize| load[*a].cmp(&load[*b]).then(tie[*a].cmp(&tie[*b]));
        if !imbalanced && ctx.query_blocks > 0 {
            let best = (0..n).max_by(|&a, &b| {
                cands[a].cached_blocks.cmp(&cands[b].cached_blocks).then(tie[b].cmp(&tie[a]))
            });
            if let Some(best) = best {
                let ratio = f64::from(cands[best].cached_blocks) / ctx.query_blocks as f64;
                if ratio > self.p.cache_threshold {
                    order.push(best);
                    let mut rest = Vec::new();
                    top_k(n, self.limit, by_load, &mut rest);
                    order.extend(rest.into_iter().filter(|&i| i != best).take(self.limit - 1));
                    return Ok(());
                }
            }
        }
        top_k(n, self.limit, by_load, order);
        Ok(())
    }

    fn limit(&self) -> usize {
        self.limit
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    check_range("cacheThreshold", p.cache_threshold, 0.0, 1.0)?;
    check_range("balanceRelThreshold", p.balance_rel_threshold, 0.0, f64::MAX)?;
    let limit = p.max_num_of_endpoints.check()?;
    Ok(Plugin::picker(CacheAwarePicker { p, limit }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::number("cacheThreshold", "match ratio above which the longest prefix wins")
        .min(0.0)
        .max(1.0),
    ParamDoc::int("balanceAbsThreshold", "load difference that makes the pool imbalanced"),
    ParamDoc::number("balanceRelThreshold", "load ratio that makes the pool imbalanced").min(0.0),
    ParamDoc::int("maxNumOfEndpoints", "endpoints returned: the chosen one and its fallbacks")
        .min(1.0),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "picker",
        "SGLang's cache-aware policy: longest cached prefix unless the load is imbalanced",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    fn first(f: &Fixture) -> usize {
        let p = CacheAwarePicker { p: Params::default(), limit: 4 };
        let mut order = Vec::new();
        p.pick(&f.ctx(), &f.candidates, &[], &mut DecisionRng::new(0, 0), &mut order).unwrap();
        order[0]
    }

    #[test]
    fn table() {
        // Balanced, a 40% match beats the 0.3 threshold: the cached endpoint wins.
        assert_eq!(first(&Fixture::new(2).cached(&[0, 4]).inflight(&[0, 10], &[0, 0])), 1);
        // Balanced, a 30% match does not exceed it: least loaded.
        assert_eq!(first(&Fixture::new(2).cached(&[0, 3]).inflight(&[1, 0], &[0, 0])), 1);
        assert_eq!(first(&Fixture::new(2).cached(&[3, 0]).inflight(&[1, 0], &[0, 0])), 1);
        // Imbalanced (100 - 10 > 64 and 100 > 15): least loaded despite the cache.
        assert_eq!(first(&Fixture::new(2).cached(&[10, 0]).inflight(&[100, 10], &[0, 0])), 1);
        // Large gap but within the relative threshold (100 <= 70 * 1.5): cache wins.
        assert_eq!(first(&Fixture::new(2).cached(&[10, 0]).inflight(&[100, 70], &[0, 0])), 0);
    }
}
