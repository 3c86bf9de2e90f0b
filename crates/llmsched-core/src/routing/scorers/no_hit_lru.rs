//! `no-hit-lru-scorer`: spreads cold requests (no endpoint holds any part of the prompt) over
//! the endpoints that least recently received one, so new cache content spreads evenly.
//!
//! A warm request scores 0.5 everywhere. A cold one ranks candidates: first those that never got
//! a cold request (in pool order), then the others from least to most recently used; rank `r` of
//! `n` candidates scores `max(0, 1 - r/(n-1))` (1 when `n` is 1), where a used endpoint's rank is
//! the never-used count plus its position in the whole LRU list, as llm-d does. On commit of a
//! cold request the chosen endpoints (decode, and prefill when split) become most recent.
//! Parameter `lruSize` (default 1024): endpoints remembered.

use std::collections::VecDeque;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::prefix_index::WorkerKey;
use crate::routing::plugin::{Candidate, Commit, PluginResult, RequestContext, Scorer};
use crate::routing::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    lru_size: usize,
    prefix_plugin_name: Option<String>,
    prefix_plugin_type: Option<String>,
    prefill_profile: Option<String>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            lru_size: 1024,
            prefix_plugin_name: None,
            prefix_plugin_type: None,
            prefill_profile: None,
        }
    }
}

pub struct NoHitLruScorer {
    capacity: usize,
    // Oldest first.
    lru: Mutex<VecDeque<WorkerKey>>,
}

impl NoHitLruScorer {
    fn touch(&self, id: &WorkerKey) {
        let mut lru = self.lru.lock();
        if let Some(pos) = lru.iter().position(|k| k == id) {
            lru.remove(pos);
        }
        lru.push_back(id.clone());
        while lru.len() > self.capacity {
            lru.pop_front();
        }
    }
}

impl Scorer for NoHitLruScorer {
    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        if ctx.any_hit {
            out.fill(0.5);
            return Ok(());
        }
        let n = cands.len();
        if n == 1 {
            out[0] = 1.0;
            return Ok(());
        }
        let lru = self.lru.lock();
        let positions: Vec<Option<usize>> =
            cands.iter().map(|c| lru.iter().position(|k| k == ctx.id(c))).collect();
        drop(lru);
        let never_used = positions.iter().filter(|p| p.is_none()).count();
        let mut next_fresh = 0;
        for (o, pos) in out.iter_mut().zip(&positions) {
            let rank = match pos {
                None => {
                    next_fresh += 1;
                    next_fresh - 1
                }
                Some(p) => never_used + p,
            };
            *o = (1.0 - rank as f64 / (n - 1) as f64).max(0.0);
        }
        Ok(())
    }

    fn on_commit(&self, commit: &Commit<'_>) {
        if commit.cold {
            self.touch(commit.decode);
            if let Some(p) = commit.prefill {
                self.touch(p);
            }
        }
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    if p.lru_size == 0 {
        return Err(ParamError::new("lruSize", "must be positive"));
    }
    let _ = (p.prefix_plugin_name, p.prefix_plugin_type, p.prefill_profile);
    Ok(Plugin::scorer(NoHitLruScorer { capacity: p.lru_size, lru: Mutex::new(VecDeque::new()) }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int("lruSize", "endpoints remembered").min(1.0),
    ParamDoc::string("prefixPluginName", "accepted for llm-d configs; no effect"),
    ParamDoc::string("prefixPluginType", "accepted for llm-d configs; no effect"),
    ParamDoc::string("prefillProfile", "accepted for llm-d configs; no effect"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "spreads cold requests (no cached prefix anywhere) over the least recently used endpoints",
        PARAMS,
        defaults_of::<Params>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::{close, Fixture};

    fn scorer(capacity: usize) -> NoHitLruScorer {
        NoHitLruScorer { capacity, lru: Mutex::new(VecDeque::new()) }
    }

    fn commit(s: &NoHitLruScorer, name: &str) {
        let key = WorkerKey::Str(name.into());
        s.on_commit(&Commit { decode: &key, prefill: None, cold: true, now: 0.0 });
    }

    #[test]
    fn table() {
        let s = scorer(1024);
        let f = Fixture::new(3);
        assert!(close(&f.score(&s), &[1.0, 0.5, 0.0]));
        commit(&s, "e0");
        assert!(close(&f.score(&s), &[0.0, 1.0, 0.5]));
        commit(&s, "e1");
        // Never used e2 first, then e0 (older), then e1.
        assert!(close(&f.score(&s), &[0.5, 0.0, 1.0]));
        let warm = Fixture::new(3).cached(&[0, 1, 0]);
        assert!(close(&warm.score(&s), &[0.5, 0.5, 0.5]));
        // A warm commit does not touch the LRU.
        let key = WorkerKey::Str("e2".into());
        s.on_commit(&Commit { decode: &key, prefill: None, cold: false, now: 0.0 });
        assert!(close(&f.score(&s), &[0.5, 0.0, 1.0]));
        assert!(close(&Fixture::new(1).score(&s), &[1.0]));
    }

    #[test]
    fn capacity_forgets_the_oldest() {
        let s = scorer(1);
        commit(&s, "e0");
        commit(&s, "e1");
        assert!(close(&Fixture::new(2).score(&s), &[1.0, 0.0]));
    }
}
