//! `token-load-scorer`: `1 - min(1, t / queueThresholdTokens)` where `t` is the uncached prompt
//! tokens the router has sent to the endpoint that are not yet prefilled (no first token).
//! Parameter `queueThresholdTokens` (default 4,194,304 = 128 requests of 32K, as llm-d).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    queue_threshold_tokens: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params { queue_threshold_tokens: 4_194_304 }
    }
}

pub struct TokenLoadScorer {
    threshold: f64,
}

impl Scorer for TokenLoadScorer {
    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = 1.0 - (c.inflight.prefill_tokens as f64 / self.threshold).min(1.0);
        }
        Ok(())
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    if p.queue_threshold_tokens == 0 {
        return Err(ParamError::new("queueThresholdTokens", "must be positive"));
    }
    Ok(Plugin::scorer(TokenLoadScorer { threshold: p.queue_threshold_tokens as f64 }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::int("queueThresholdTokens", "pending prefill tokens at which the score reaches 0")
        .min(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("scorer", "`1 - min(1, t / queueThresholdTokens)` over the uncached prompt tokens sent and not yet prefilled", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let s = TokenLoadScorer { threshold: 4_194_304.0 };
        let tokens = [0, 1_048_576, 4_194_304, 9_000_000];
        let f = Fixture::new(4).inflight(&[0, 1, 2, 3], &tokens);
        assert!(close(&f.score(&s), &[1.0, 0.75, 0.0, 0.0]));
        let small = TokenLoadScorer { threshold: 1000.0 };
        let f = Fixture::new(2).inflight(&[1, 1], &[250, 999]);
        assert!(close(&f.score(&small), &[0.75, 0.001]));
    }
}
