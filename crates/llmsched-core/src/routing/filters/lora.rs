//! `lora-availability-filter`: for a request naming a LoRA adapter, keeps the endpoints that
//! have it (active or waiting); if none has it, those with room to load it; if none has room,
//! all (fails open: the adapter will queue somewhere). No parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct LoraFilter;

impl Filter for LoraFilter {
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
        let Some(adapter) = ctx.meta.lora.as_deref() else { return Ok(()) };
        let states: Vec<_> = cands.iter().map(|c| ctx.loras(c)).collect();
        let has: Vec<bool> =
            states.iter().map(|s| s.is_active(adapter) || s.is_waiting(adapter)).collect();
        if has.iter().any(|&h| h) {
            keep.copy_from_slice(&has);
        } else {
            for (k, s) in keep.iter_mut().zip(&states) {
                *k = s.has_room();
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
    Ok(Plugin::filter(LoraFilter))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("filter", "keeps endpoints that have the request's LoRA adapter, else those with room for it; fails open", &[], defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::endpoint::LoraState;
    use crate::routing::testing::Fixture;
    use std::sync::Arc;

    #[test]
    fn table() {
        let mut f = Fixture::new(3);
        let states = [
            LoraState { active: vec!["x".into()], waiting: vec![], max_loras: 1 },
            LoraState { active: vec![], waiting: vec![], max_loras: 2 },
            LoraState { active: vec![], waiting: vec!["a".into()], max_loras: 1 },
        ];
        for (m, s) in f.members.list.iter().zip(states) {
            *m.loras_mut() = Arc::new(s);
        }
        assert_eq!(f.filter(&LoraFilter), vec![0, 1, 2]);
        f.meta.lora = Some("a".into());
        assert_eq!(f.filter(&LoraFilter), vec![2]);
        f.meta.lora = Some("b".into());
        assert_eq!(f.filter(&LoraFilter), vec![1]);
    }
}
