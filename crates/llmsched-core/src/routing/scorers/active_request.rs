//! `active-request-scorer`: scores by the router's own in-flight request count `n` per endpoint
//! (fresh, unlike scraped metrics). `n <= idleThreshold` scores 1; otherwise
//! `(maxCount - n) / maxCount * maxBusyScore` with `maxCount` the largest count among
//! candidates. Parameters: `idleThreshold` (default 0), `maxBusyScore` (in `[0, 1]`, default 1,
//! as llm-d documents it: llm-d's factory leaves an omitted one at 0, a bug this does not
//! copy); `requestTimeout` is accepted for llm-d configs but unused: in-flight requests end
//! with their ticket, never by timeout.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    idle_threshold: u64,
    max_busy_score: f64,
    request_timeout: Option<String>,
}

impl Default for Params {
    fn default() -> Self {
        Params { idle_threshold: 0, max_busy_score: 1.0, request_timeout: None }
    }
}

pub struct ActiveRequestScorer {
    idle_threshold: u64,
    /// The score of a busy endpoint with no requests (the scale of `(max - n) / max`).
    max_busy_score: f64,
}

impl Scorer for ActiveRequestScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(&self, _: &RequestContext<'_>, cands: &[Candidate], out: &mut [f64]) -> PluginResult {
        let max = cands.iter().map(|c| c.inflight.requests).max().unwrap_or(0);
        for (o, c) in out.iter_mut().zip(cands) {
            let n = c.inflight.requests;
            *o = if n <= self.idle_threshold || max == 0 {
                1.0
            } else {
                (max - n) as f64 / max as f64 * self.max_busy_score
            };
        }
        Ok(())
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    let _ = p.request_timeout;
    if !(0.0..=1.0).contains(&p.max_busy_score) {
        return Err(ParamError::new("maxBusyScore", "must be between 0 and 1"));
    }
    Ok(Plugin::scorer(ActiveRequestScorer {
        idle_threshold: p.idle_threshold,
        max_busy_score: p.max_busy_score,
    }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int("idleThreshold", "in-flight requests that still score 1"),
    ParamDoc::number("maxBusyScore", "the scale of a busy endpoint's score").min(0.0).max(1.0),
    ParamDoc::string(
        "requestTimeout",
        "accepted for llm-d configs; no effect (requests end with their ticket)",
    ),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("scorer", "the router's own in-flight requests: 1 at or below `idleThreshold`, else `(max - n) / max`", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let cases: &[(u64, &[u64], &[f64])] = &[
            (0, &[0, 2, 4], &[1.0, 0.5, 0.0]),
            (0, &[0, 0], &[1.0, 1.0]),
            (2, &[1, 2, 8], &[1.0, 1.0, 0.0]),
            (0, &[3, 3], &[0.0, 0.0]),
        ];
        for (idle, counts, want) in cases {
            let f = Fixture::new(counts.len()).inflight(counts, &vec![0; counts.len()]);
            let got = f.score(&ActiveRequestScorer { idle_threshold: *idle, max_busy_score: 1.0 });
            assert!(close(&got, want), "{idle} {counts:?} -> {got:?}");
        }
    }

    #[test]
    fn max_busy_score_scales_busy_endpoints_and_is_checked() {
        // llm-d's documented formula: (max - n) / max * maxBusyScore (probe 54 F13).
        let f = Fixture::new(3).inflight(&[0, 2, 4], &[0, 0, 0]);
        let Plugin::Scorer(scorer) = factory(&serde_json::json!({"maxBusyScore": 0.5})).unwrap()
        else {
            panic!("not a scorer")
        };
        assert!(close(&f.score(scorer.as_ref()), &[1.0, 0.25, 0.0]));
        for bad in [-0.1, 1.5] {
            let e = factory(&serde_json::json!({"maxBusyScore": bad})).err().unwrap();
            assert_eq!(e.path, "maxBusyScore");
        }
    }
}
