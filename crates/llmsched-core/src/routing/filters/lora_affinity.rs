//! `lora-affinity-filter` (the Inference Extension's; older name `lora-affinity`): splits the
//! endpoints into those that have the request's adapter (active or waiting) and those with room
//! to load another adapter. When both groups exist, the affinity group is kept with probability
//! `threshold` (default 0.999) and the room group otherwise, so a popular adapter spreads to new
//! endpoints now and then; when one group is empty the other is kept. The adapter is the
//! request's LoRA name, else its model name (the Extension matches the target model against the
//! loaded adapters). Endpoints in neither group are dropped; an empty result fails closed.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{
    check_range, decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc,
};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct Params {
    threshold: f64,
}

impl Default for Params {
    fn default() -> Self {
        Params { threshold: 0.999 }
    }
}

pub struct LoraAffinityFilter {
    threshold: f64,
}

impl Filter for LoraAffinityFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        rng: &mut DecisionRng,
    ) -> PluginResult {
        let target = ctx.meta.lora.as_deref().or(ctx.meta.model.as_deref());
        let mut affinity = vec![false; cands.len()];
        let mut room = vec![false; cands.len()];
        for (i, c) in cands.iter().enumerate() {
            let state = ctx.loras(c);
            if target.is_some_and(|t| state.is_active(t) || state.is_waiting(t)) {
                affinity[i] = true;
            } else if state.has_room() {
                room[i] = true;
            }
        }
        let (has_affinity, has_room) = (affinity.contains(&true), room.contains(&true));
        let chosen = if has_affinity && has_room {
            if rng.unit() < self.threshold {
                affinity
            } else {
                room
            }
        } else if has_affinity {
            affinity
        } else {
            room
        };
        keep.copy_from_slice(&chosen);
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailClosed
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    check_range("threshold", p.threshold, 0.0, 1.0)?;
    Ok(Plugin::filter(LoraAffinityFilter { threshold: p.threshold }))
}

const PARAMS: &[ParamDoc] =
    &[ParamDoc::number("threshold", "probability of keeping the affinity group").min(0.0).max(1.0)];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new("filter", "keeps endpoints holding the adapter with probability `threshold`, else those with room for it; fails closed", PARAMS, defaults_of::<Params>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::endpoint::LoraState;
    use crate::routing::testing::Fixture;
    use std::sync::Arc;

    fn fixture() -> Fixture {
        let f = Fixture::new(3);
        let states = [
            LoraState { active: vec!["a".into()], waiting: vec![], max_loras: 1 },
            LoraState { active: vec![], waiting: vec![], max_loras: 2 },
            LoraState { active: vec!["x".into()], waiting: vec![], max_loras: 1 },
        ];
        for (m, s) in f.members.list.iter().zip(states) {
            *m.loras_mut() = Arc::new(s);
        }
        f
    }

    fn run(f: &Fixture, filter: &LoraAffinityFilter, seed: u64) -> Vec<usize> {
        let mut keep = vec![true; f.candidates.len()];
        let mut rng = DecisionRng::new(seed, 0);
        filter.filter(&f.ctx(), &f.candidates, &mut keep, &mut rng).unwrap();
        (0..keep.len()).filter(|&i| keep[i]).collect()
    }

    #[test]
    fn groups_and_threshold() {
        let mut f = fixture();
        f.meta.lora = Some("a".into());
        assert_eq!(run(&f, &LoraAffinityFilter { threshold: 1.0 }, 0), vec![0]);
        assert_eq!(run(&f, &LoraAffinityFilter { threshold: 0.0 }, 0), vec![1]);
        // About half the draws keep the room group at threshold 0.5.
        let half = LoraAffinityFilter { threshold: 0.5 };
        let affinity = (0..2000).filter(|&s| run(&f, &half, s) == vec![0]).count();
        assert!((850..1150).contains(&affinity), "{affinity}");
        // No endpoint has "b": the one with room.
        f.meta.lora = Some("b".into());
        assert_eq!(run(&f, &LoraAffinityFilter { threshold: 1.0 }, 0), vec![1]);
        // The model name stands for the adapter when no LoRA is named.
        f.meta.lora = None;
        f.meta.model = Some("x".into());
        assert_eq!(run(&f, &LoraAffinityFilter { threshold: 1.0 }, 0), vec![2]);
    }

    #[test]
    fn params() {
        assert_eq!(
            factory(&serde_json::json!({"threshold": 1.5})).err().unwrap().path,
            "threshold"
        );
        assert!(factory(&serde_json::json!({"threshold": 0.9})).is_ok());
    }
}
