//! `prefix-cache-affinity-filter`: sticks to endpoints holding most of the prompt until they
//! are overloaded.
//!
//! An endpoint is sticky when it holds at least `affinityThreshold` (default 0.8) of the
//! prompt's full blocks. Each endpoint's time to first token is estimated as its in-flight
//! uncached prompt tokens over `peakPrefillThroughput` (tokens/s, default 15,928: llm-d's
//! calibration for Qwen3-32B on H100). Only sticky endpoints stay, unless the best sticky
//! estimate trails the best non-sticky one by more than `maxTTFTPenaltyMs` (default 18,000;
//! 0 disables the escape). With `explorationProbability` (default 0) the filter is skipped at
//! random. With no sticky endpoint it keeps all, so it never empties the set.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{
    check_range, decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc,
};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    affinity_threshold: f64,
    #[serde(rename = "maxTTFTPenaltyMs")]
    max_ttft_penalty_ms: f64,
    peak_prefill_throughput: f64,
    exploration_probability: f64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            affinity_threshold: 0.8,
            max_ttft_penalty_ms: 18_000.0,
            peak_prefill_throughput: 15_928.0,
            exploration_probability: 0.0,
        }
    }
}

pub struct PrefixAffinityFilter {
    p: Params,
}

impl PrefixAffinityFilter {
    fn ttft_ms(&self, c: &Candidate) -> f64 {
        c.inflight.prefill_tokens as f64 / self.p.peak_prefill_throughput * 1000.0
    }
}

impl Filter for PrefixAffinityFilter {
    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        rng: &mut DecisionRng,
    ) -> PluginResult {
        if self.p.exploration_probability > 0.0 && rng.unit() < self.p.exploration_probability {
            return Ok(());
        }
        let full = ctx.query_blocks as f64;
        let sticky = |c: &Candidate| {
            full > 0.0 && f64::from(c.cached_blocks) / full >= self.p.affinity_threshold
        };
        let best = |want: bool| {
            cands
                .iter()
                .filter(|c| sticky(c) == want)
                .map(|c| self.ttft_ms(c))
                .min_by(f64::total_cmp)
        };
        let keep_sticky = match (best(true), best(false)) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(s), Some(o)) => {
                self.p.max_ttft_penalty_ms == 0.0 || s - o <= self.p.max_ttft_penalty_ms
            }
        };
        if keep_sticky {
            for (k, c) in keep.iter_mut().zip(cands) {
                *k = sticky(c);
            }
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailOpen
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    check_range("affinityThreshold", p.affinity_threshold, 0.0, 1.0)?;
    check_range("maxTTFTPenaltyMs", p.max_ttft_penalty_ms, 0.0, f64::MAX)?;
    check_range("explorationProbability", p.exploration_probability, 0.0, 1.0)?;
    if !(p.peak_prefill_throughput.is_finite() && p.peak_prefill_throughput > 0.0) {
        return Err(ParamError::new("peakPrefillThroughput", "must be a positive number"));
    }
    Ok(Plugin::filter(PrefixAffinityFilter { p }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::number(
        "affinityThreshold",
        "share of the prompt's blocks that makes an endpoint sticky",
    )
    .min(0.0)
    .max(1.0),
    ParamDoc::number(
        "maxTTFTPenaltyMs",
        "TTFT penalty (ms) beyond which non-sticky endpoints are kept (0: never)",
    )
    .min(0.0),
    ParamDoc::number(
        "peakPrefillThroughput",
        "prefill tokens/s used to estimate TTFT (greater than 0)",
    ),
    ParamDoc::number("explorationProbability", "probability of skipping the filter")
        .min(0.0)
        .max(1.0),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("filter", "sticks to endpoints holding most of the prompt until their estimated TTFT trails too far; never empties the set", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let f = PrefixAffinityFilter { p: Params::default() };
        // 10 full blocks; e1 holds 9 (sticky) with 10k tokens in flight: 0.63 s behind, kept.
        let fx = Fixture::new(2).cached(&[0, 9]).inflight(&[0, 1], &[0, 10_000]);
        assert_eq!(fx.filter(&f), vec![1]);
        // 300k tokens in flight is 18.8 s: stickiness breaks.
        let fx = Fixture::new(2).cached(&[0, 9]).inflight(&[0, 1], &[0, 300_000]);
        assert_eq!(fx.filter(&f), vec![0, 1]);
        // Nothing sticky: all stay.
        let fx = Fixture::new(3).cached(&[5, 7, 0]);
        assert_eq!(fx.filter(&f), vec![0, 1, 2]);
        // Exactly at the threshold is sticky.
        let fx = Fixture::new(2).cached(&[8, 0]);
        assert_eq!(fx.filter(&f), vec![0]);
        // A zero penalty disables the escape.
        let no_escape =
            PrefixAffinityFilter { p: Params { max_ttft_penalty_ms: 0.0, ..Params::default() } };
        let fx = Fixture::new(2).cached(&[0, 9]).inflight(&[0, 1], &[0, 300_000]);
        assert_eq!(fx.filter(&no_escape), vec![1]);
    }
}
