//! `active-request-scorer`: scores by the router's own in-flight request count `n` per endpoint
//! (fresh, unlike scraped metrics). `n <= idleThreshold` scores 1; otherwise
//! `(maxCount - n) / maxCount` with `maxCount` the largest count among candidates.
//! Parameters: `idleThreshold` (default 0); `requestTimeout` is accepted for llm-d configs but
//! unused: in-flight requests end with their ticket, never by timeout.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    idle_threshold: u64,
    request_timeout: Option<String>,
}

pub struct ActiveRequestScorer {
    idle_threshold: u64,
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
                (max - n) as f64 / max as f64
            };
        }
        Ok(())
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    let _ = p.request_timeout;
    Ok(Plugin::scorer(ActiveRequestScorer { idle_threshold: p.idle_threshold }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int("idleThreshold", "in-flight requests that still score 1"),
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
            let got = f.score(&ActiveRequestScorer { idle_threshold: *idle });
            assert!(close(&got, want), "{idle} {counts:?} -> {got:?}");
        }
    }
}
