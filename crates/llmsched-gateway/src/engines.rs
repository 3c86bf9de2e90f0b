//! The gateway's engine set: its upstreams as configured or replaced (the admin API, the
//! embedder), which of them are in routing, and the engines' context length.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use llmsched_core::routing::{Endpoint, Router};

use crate::config::{upstream, ConfigProblem, EngineEntry};
use crate::{health, Gateway, Upstream, Upstreams};

/// How [`Gateway::replace_engines`] counts its changes in `engine_changes`.
#[derive(Clone, Copy)]
pub(crate) enum ChangeCount {
    /// Not at all (the configured set the gateway starts with).
    Uncounted,
    /// Each engine added, removed or moved to another URL, once.
    Own,
    /// As many as the embedder says: it also sees changes that reach no upstream (an
    /// engine's role, model or labels), which the Python plane counts alike.
    Given(u64),
}

/// Whether `upstream` takes requests: in the pool, its last scrape answered, healthy.
pub(crate) fn in_routing(
    upstream: &Upstream,
    pool: &llmsched_core::routing::pool::Members,
) -> bool {
    pool.get(&upstream.key).is_some()
        && !upstream.scrape_failed.load(Ordering::Relaxed)
        && upstream.health.lock().unwrap_or_else(|e| e.into_inner()).state == health::State::Up
}

impl Gateway {
    pub(crate) fn router(&self) -> &Router {
        self.source.router()
    }

    pub(crate) fn upstreams(&self) -> Arc<Upstreams> {
        self.upstreams.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.replace_engines(engines, ChangeCount::Own)
    }

    /// [`Gateway::set_engines`]; `count`: how the changes go to `engine_changes`.
    pub(crate) fn replace_engines(
        &self,
        engines: &[EngineEntry],
        count: ChangeCount,
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        let current = self.upstreams();
        let mut next = Upstreams::default();
        let mut added = Vec::new();
        for entry in engines {
            let mut fresh = upstream(entry, &self.config)?;
            let base = fresh.completions.to_string();
            let base = base.trim_end_matches("/v1/completions");
            if next.by_key.contains_key(&fresh.key) {
                return Err(ConfigProblem(format!("engines: {} is listed twice", fresh.id)));
            }
            let probe = format!("{}{}", base.trim_end_matches('/'), self.config.health.path);
            fresh.probe = probe
                .parse()
                .map_err(|_| ConfigProblem(format!("health.path: {probe:?} is not a URL")))?;
            let kept =
                current.by_key.get(&fresh.key).filter(|u| u.completions == fresh.completions);
            let entry = match kept {
                Some(kept) => kept.clone(),
                None => {
                    added.push(fresh.id.clone());
                    Arc::new(fresh)
                }
            };
            next.by_key.insert(entry.key.clone(), entry.clone());
            next.list.push(entry);
        }
        let removed: Vec<String> = current
            .list
            .iter()
            .filter(|u| !next.by_key.get(&u.key).is_some_and(|n| Arc::ptr_eq(n, u)))
            .map(|u| u.id.clone())
            .collect();
        if self.owns_pool {
            let pool = self.router().pool();
            for gone in current.list.iter().filter(|u| removed.contains(&u.id)) {
                let _ = pool.remove(&gone.key);
            }
            // One step for the batch: a discovery file of thousands of engines is linear.
            pool.upsert_many(next.list.iter().filter(|u| added.contains(&u.id)).map(|new| {
                let address = new.models.authority().map(|a| a.to_string()).unwrap_or_default();
                Endpoint { address, ..Endpoint::new(new.key.clone()) }
            }));
        }
        if let Some(flow) = &self.flow {
            for gone in &removed {
                flow.remove_endpoint(gone);
            }
        }
        if let Some(slicing) = &self.slicing {
            // One that left is no migration target; one under another URL starts afresh.
            slicing.remove_endpoints(&removed);
            slicing.add_endpoints(&added);
        }
        // One re-added under another URL is another engine (or this one restarted): it holds
        // none of its stored responses. One that left may come back: see `Owners`.
        for gone in &removed {
            if added.contains(gone) {
                self.owners.forget_engine(gone);
            } else {
                self.owners.engine_left(gone);
            }
        }
        for new in &added {
            self.owners.engine_joined(new);
        }
        // An engine moved to another URL is one change (it is both added and removed).
        let moved = removed.iter().filter(|gone| added.contains(gone)).count();
        let changes = match count {
            ChangeCount::Uncounted => 0,
            ChangeCount::Own => (added.len() + removed.len() - moved) as u64,
            ChangeCount::Given(changes) => changes,
        };
        *self.upstreams.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
        self.counters.engine_changes.fetch_add(changes, Ordering::Relaxed);
        // An engine both removed and re-added (a changed URL) is reported once each way.
        Ok((added, removed))
    }

    /// Whether an engine other than `upstream` is in routing, read from the pool alone (an
    /// engine down, open or drained has left it): no other engine's health lock is taken, as
    /// the caller holds `upstream`'s.
    pub(crate) fn others_in_routing(&self, upstream: &Upstream) -> bool {
        let snapshot = self.router().pool().snapshot();
        self.upstreams().list.iter().any(|other| {
            other.key != upstream.key
                && snapshot.get(&other.key).is_some()
                && !other.scrape_failed.load(Ordering::Relaxed)
        })
    }

    /// See [`Running::set_max_model_len`].
    pub(crate) fn set_max_model_len(&self, context: Option<usize>) {
        self.context_len.store(context.unwrap_or(0), Ordering::Relaxed);
        if let Some(tokenizer) = &self.tokenizer {
            tokenizer.set_context_len(context);
        }
    }

    /// The engines' context length, where known.
    pub(crate) fn context_len(&self) -> Option<usize> {
        Some(self.context_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    pub(crate) fn routable(&self) -> Vec<String> {
        let snapshot = self.router().pool().snapshot();
        self.upstreams()
            .list
            .iter()
            .filter(|u| in_routing(u, &snapshot))
            .map(|u| u.id.clone())
            .collect()
    }

    /// Whether any engine is routable (what each request asks: no list is built).
    pub(crate) fn any_routable(&self) -> bool {
        let snapshot = self.router().pool().snapshot();
        self.upstreams().list.iter().any(|u| in_routing(u, &snapshot))
    }
}
