//! `session-affinity-filter`: keeps only the endpoint the request's session is bound to, when
//! that endpoint is a candidate; otherwise keeps all (fails open). No parameters. The session's
//! endpoint is as the `session-affinity-scorer` reads it (a live `session_id` binding, else the
//! request's `session_endpoint`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct SessionFilter;

impl Filter for SessionFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn reads_session(&self) -> bool {
        true
    }

    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        if let Some(bound) = ctx.session_slot {
            if cands.iter().any(|c| c.slot == bound) {
                for (k, c) in keep.iter_mut().zip(cands) {
                    *k = c.slot == bound;
                }
            }
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailOpen
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::filter(SessionFilter))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("filter", "keeps only the endpoint the request's session is bound to, when it is a candidate; fails open", &[], defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let mut f = Fixture::new(3);
        assert_eq!(f.filter(&SessionFilter), vec![0, 1, 2]);
        f.session_slot = Some(2);
        assert_eq!(f.filter(&SessionFilter), vec![2]);
        f.session_slot = Some(7);
        assert_eq!(f.filter(&SessionFilter), vec![0, 1, 2]);
    }
}
