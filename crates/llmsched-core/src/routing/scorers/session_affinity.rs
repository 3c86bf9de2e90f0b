//! `session-affinity-scorer`: 1 for the endpoint the request's session is bound to, 0 for the
//! others (and 0 everywhere for a request without a bound session). The router binds a session
//! to the decode endpoint of each committed decision. No parameters.
//!
//! The session's endpoint is the live binding of the request's `session_id`, else the endpoint
//! it names itself (`session_endpoint`): llm-d's scorer reads only the latter, from the
//! `x-session-token` header (the base64 of the pod's `namespace/name`), which the gateway
//! decodes into `session_endpoint` and sets on its answers.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct SessionAffinityScorer;

impl Scorer for SessionAffinityScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn reads_session(&self) -> bool {
        true
    }

    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = if ctx.session_slot == Some(c.slot) { 1.0 } else { 0.0 };
        }
        Ok(())
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::scorer(SessionAffinityScorer))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "1 for the endpoint the request's session is bound to, 0 elsewhere",
        &[],
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    #[test]
    fn table() {
        let mut f = Fixture::new(3);
        assert!(close(&f.score(&SessionAffinityScorer), &[0.0, 0.0, 0.0]));
        f.session_slot = Some(1);
        assert!(close(&f.score(&SessionAffinityScorer), &[0.0, 1.0, 0.0]));
    }
}
