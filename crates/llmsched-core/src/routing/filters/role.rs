//! `decode-filter` keeps endpoints with role decode, both, or no role; `prefill-filter` keeps
//! role prefill or both. Both fail closed: with no endpoint of the role the profile finds none
//! (for a prefill profile that means no disaggregation). No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::endpoint::Role;
use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct RoleFilter {
    prefill: bool,
}

impl RoleFilter {
    fn admits(&self, role: Option<Role>) -> bool {
        match (self.prefill, role) {
            (true, r) => matches!(r, Some(Role::Prefill | Role::Both)),
            (false, r) => !matches!(r, Some(Role::Prefill)),
        }
    }
}

impl Filter for RoleFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        for (k, c) in keep.iter_mut().zip(cands) {
            *k = self.admits(ctx.endpoint(c).role);
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn decode_factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::filter(RoleFilter { prefill: false }))
}

pub fn prefill_factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::filter(RoleFilter { prefill: true }))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn decode_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints whose role is decode, both or unset; fails closed",
        &[],
        defaults_of::<Params>(),
    )
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn prefill_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints whose role is prefill or both; fails closed",
        &[],
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::endpoint::Endpoint;
    use crate::routing::pool::{Member, Members};
    use crate::routing::testing::Fixture;
    use std::sync::Arc;

    #[test]
    fn table() {
        let roles = [None, Some(Role::Prefill), Some(Role::Decode), Some(Role::Both)];
        let mut f = Fixture::new(4);
        let list = f
            .members
            .list
            .iter()
            .zip(roles)
            .map(|(m, role)| Arc::new(Member::new(Endpoint { role, ..m.endpoint.clone() })))
            .collect();
        f.members = Members::build(list);
        assert_eq!(f.filter(&RoleFilter { prefill: false }), vec![0, 2, 3]);
        assert_eq!(f.filter(&RoleFilter { prefill: true }), vec![1, 3]);
    }
}
