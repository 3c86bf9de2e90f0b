//! `lora-affinity-scorer`: for a request naming a LoRA adapter, 1.0 where the adapter is active,
//! else 0.8 where another adapter fits (distinct active or waiting adapters < max), else 0.6
//! where the adapter is waiting, else 0 (the order of the Gateway API Inference Extension).
//! The adapter is the request's LoRA name, else its model name, as in `lora-affinity-filter`:
//! the Extension matches its target model, so a base-model request scores 0.8 where another
//! adapter fits and 0 where none does (it scored 1.0 everywhere before probe 54 F2). No
//! parameters.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamError, Plugin, PluginDoc};

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Params {}

pub struct LoraAffinityScorer;

impl Scorer for LoraAffinityScorer {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        let target = ctx.meta.lora.as_deref().or(ctx.meta.model.as_deref());
        for (o, c) in out.iter_mut().zip(cands) {
            let loras = ctx.loras(c);
            let (active, waiting) = match target {
                Some(t) => (loras.is_active(t), loras.is_waiting(t)),
                None => (false, false),
            };
            *o = if active {
                1.0
            } else if loras.has_room() {
                0.8
            } else if waiting {
                0.6
            } else {
                0.0
            };
        }
        Ok(())
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: Params = decode(params)?;
    Ok(Plugin::scorer(LoraAffinityScorer))
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "1 where the adapter is active, 0.8 where one fits, 0.6 where it waits, else 0",
        &[],
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::endpoint::LoraState;
    use crate::routing::testing::{close, Fixture};

    fn state(active: &[&str], waiting: &[&str], max: u32) -> LoraState {
        LoraState {
            active: active.iter().map(|s| s.to_string()).collect(),
            waiting: waiting.iter().map(|s| s.to_string()).collect(),
            max_loras: max,
        }
    }

    #[test]
    fn table() {
        let mut f = Fixture::new(5);
        let states = [
            state(&["a"], &[], 1),
            state(&["b"], &[], 2),
            state(&["b"], &["a"], 2),
            state(&["b", "c"], &[], 2),
            state(&["b"], &["a"], 0),
        ];
        for (m, s) in f.members.list.iter().zip(states) {
            *m.loras_mut() = std::sync::Arc::new(s);
        }
        // No adapter: the Extension matches the target (model) name against the adapters, so a
        // base-model request scores 0.8 where another adapter fits and 0 elsewhere (probe 54 F2;
        // scorer/loraaffinity/lora_affinity.go:80-98 in llm-d-router).
        assert!(close(&f.score(&LoraAffinityScorer), &[0.0, 0.8, 0.0, 0.0, 0.0]));
        f.meta.model = Some("base".into());
        assert!(close(&f.score(&LoraAffinityScorer), &[0.0, 0.8, 0.0, 0.0, 0.0]));
        f.meta.model = Some("a".into());
        assert!(close(&f.score(&LoraAffinityScorer), &[1.0, 0.8, 0.6, 0.0, 0.6]));
        f.meta.model = None;
        f.meta.lora = Some("a".into());
        assert!(close(&f.score(&LoraAffinityScorer), &[1.0, 0.8, 0.6, 0.0, 0.6]));
    }
}
