//! The router's decision for a request, on the runtime or on tokio's blocking pool (a Python
//! scorer or filter), the session's engine, routing failures logged once each, and a
//! decision's records dropped when its request is not sent.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hyper::HeaderMap;
use llmsched_core::prefix_index::WorkerKey;
use llmsched_core::routing::{Decision, PluginError, RequestMeta, Router, RoutingError};

use crate::refusal::Refusal;
use crate::request_fields::{RequestFields, SESSION_TOKEN_HEADER_NAME};
use crate::Gateway;

/// How many distinct routing failures [`Gateway::routing_failed`] logs.
const LOGGED_ROUTING_FAILURES: usize = 64;

impl Gateway {
    /// Decides for a prompt of `tokens`. A router that reads nothing of the prefix index
    /// decides on no block hashes (unless `record_unread_prefixes`): hashing, matching and
    /// recording them would change no decision of its, only the index's approximate records.
    /// `ids`: how many the prompt has (`tokens.len()`, unless the ids were not packed for a
    /// router that hashes none).
    fn decide(
        &self,
        tokens: &[u32],
        ids: usize,
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        let router = self.router();
        if self.hashes_prompts {
            router.decide(tokens, meta, now)
        } else {
            router.decide_hashes(Vec::new(), ids as u64, meta, now)
        }
    }

    /// [`Gateway::decide`] where it cannot stall the runtime: a router with a plugin that may
    /// block (a Python scorer or filter, which takes the GIL and has no timeout) decides on
    /// tokio's blocking pool, so that a slow one delays its own request only, not every
    /// connection of the runtime's threads (`native_threads`) and `/health`; any other
    /// decides in place (no copy, no thread hop).
    pub(crate) async fn decide_off_runtime(
        self: &Arc<Self>,
        tokens: &[u32],
        ids: usize,
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        if !self.decisions_block {
            return self.decide(tokens, ids, meta, now);
        }
        let (gateway, tokens, meta) = (self.clone(), tokens.to_vec(), meta.clone());
        let decided =
            tokio::task::spawn_blocking(move || gateway.decide(&tokens, ids, &meta, now)).await;
        decided.unwrap_or_else(|err| {
            Err(RoutingError::Plugin(PluginError {
                plugin: "router".into(),
                source: format!("the decision did not finish: {err}").into(),
            }))
        })
    }

    /// The answer to a decision a router plugin failed (a Python scorer or filter raised, or
    /// returned what it must not): a 500 that says why, counted in
    /// `rejections_total{reason="routing_failed"}`, the error logged on stderr once per
    /// distinct message (the first [`LOGGED_ROUTING_FAILURES`]). Nothing was taken for it.
    pub(crate) fn routing_failed(&self, err: &RoutingError) -> Refusal {
        let message = format!("routing failed: {err}");
        let mut logged = self.routing_failures.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() < LOGGED_ROUTING_FAILURES && logged.insert(message.clone()) {
            eprintln!("llmsched-gateway: {message} (answered 500)");
        }
        drop(logged);
        let mut refusal = Refusal::new(500, "internal_error", message);
        refusal.reason = Some("routing_failed");
        refusal
    }

    /// The engine a request's `x-session-token` names, when it is one of the gateway's; any
    /// other token is ignored (and counted), as llm-d ignores it.
    pub(crate) fn session_endpoint(
        &self,
        headers: &HeaderMap,
        fields: &RequestFields,
    ) -> Option<WorkerKey> {
        let token = RequestFields::get(fields.token, headers, &SESSION_TOKEN_HEADER_NAME)?;
        let key = self.session_tokens.endpoint(token.as_bytes()).map(WorkerKey::Str);
        let known = key.filter(|key| self.upstreams().by_key.contains_key(key));
        if known.is_none() {
            self.counters.session_tokens_ignored.fetch_add(1, Ordering::Relaxed);
        }
        known
    }

    /// A JSON answer read whole before anything is sent (up to 8 MiB; a larger one streams):
    /// cut off or silent for `read_timeout_s`, it is a 502 (counted as truncated), never a
    /// partial body.
    /// An attempt on `key` failed (the engine did not run the request): drops the
    /// approximate prefix blocks committing it recorded there (and on its prefill engine),
    /// the ones beyond what the endpoint held when the decision was made, unless an engine's
    /// KV events confirmed them since. As the Python plane's `Placement` does.
    pub(crate) fn drop_record(&self, router: &Router, decision: &Decision, key: &WorkerKey) {
        if decision.hashes.is_empty() {
            return;
        }
        let held = |id: &WorkerKey| {
            decision.base.iter().find(|c| &decision.endpoint(c).id == id).map(|c| c.cached_blocks)
        };
        let mut used = vec![(key.clone(), held(key))];
        if let Some(prefill) = decision.prefill() {
            let id = decision.endpoint(prefill).id.clone();
            used.push((id, Some(prefill.cached_blocks)));
        }
        let index = router.index();
        let mut removed = 0;
        for (worker, held) in used {
            let start = (held.unwrap_or(0) as usize).min(decision.hashes.len());
            let Ok(holdings) = index.holdings(&worker) else { continue };
            let ours: Vec<u64> = decision.hashes[start..]
                .iter()
                .rev()
                .copied()
                .filter(|h| {
                    holdings
                        .binary_search_by_key(h, |(hash, _, _)| *hash)
                        .is_ok_and(|i| !holdings[i].2)
                })
                .collect();
            if !ours.is_empty() {
                // Changed since read (an event, an expiry): left as it is.
                removed += index.remove(&worker, &ours, None).unwrap_or(0);
            }
        }
        if removed > 0 {
            self.counters.records_removed.fetch_add(removed, Ordering::Relaxed);
        }
    }
}
