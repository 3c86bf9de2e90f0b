//! The gateway's own `/metrics` page: its counters, the pool's and flow control's state, the
//! tokenizer cache's figures and the embedder's extra text, in the Python plane's metric names.

use crate::{health, metrics, monotonic, tokcache, Gateway};

/// The tokenizer's piece cache in `/metrics`: hits, misses, evictions and whole-prompt
/// fallbacks as counters; entries, bytes and capacity as gauges; `tokenizer_cache_enabled`
/// 1 or 0, with the reason it is off as a label.
fn tokenizer_cache_metrics(out: &mut String, stats: &tokcache::CacheStats) {
    use metrics::{gauge, help};
    use std::fmt::Write as _;
    const P: &str = "llmsched_gateway";
    for (name, value) in [
        ("tokenizer_cache_hits", stats.hits),
        ("tokenizer_cache_misses", stats.misses),
        ("tokenizer_cache_evictions", stats.evictions),
        ("tokenizer_cache_fallbacks", stats.fallbacks),
    ] {
        let _ = writeln!(
            out,
            "# HELP {P}_{name}_total {}\n# TYPE {P}_{name}_total counter\n\
             {P}_{name}_total {value}.0",
            help(name)
        );
    }
    for (name, value) in [
        ("tokenizer_cache_entries", stats.entries),
        ("tokenizer_cache_bytes", stats.bytes),
        ("tokenizer_cache_capacity_bytes", stats.capacity_bytes),
    ] {
        gauge(out, name, &[], value as f64);
    }
    let reason = stats.disabled_reason.as_deref().unwrap_or("");
    let enabled = if stats.enabled { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_enabled", &[("reason", reason)], enabled);
    let reason = stats.chunks_disabled_reason.as_deref().unwrap_or("");
    let chunks = if stats.chunks { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_chunks_enabled", &[("reason", reason)], chunks);
    let completions = if stats.completions { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_completions_enabled", &[], completions);
}

impl Gateway {
    pub(crate) fn metrics_text(&self) -> String {
        use metrics::{gauge, help};
        let mut out = String::with_capacity(4096);
        self.counters.render(&mut out);
        gauge(&mut out, "body_bytes_in_flight", &[], self.bodies.held() as f64);
        let snapshot = self.router().pool().snapshot();
        for upstream in &self.upstreams().list {
            let state = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).state;
            let up = state == health::State::Up && snapshot.get(&upstream.key).is_some();
            let value = if up { 1.0 } else { 0.0 };
            gauge(&mut out, "endpoint_up", &[("endpoint", &upstream.id)], value);
        }
        for upstream in &self.upstreams().list {
            if let Some(member) = snapshot.get(&upstream.key) {
                let load = member.inflight.local();
                let labels = [("endpoint", upstream.id.as_str())];
                gauge(&mut out, "endpoint_in_flight", &labels, load.requests as f64);
            }
        }
        let stats = self.router().index().stats();
        for (key, value) in [
            ("index_blocks", stats.blocks as f64),
            ("index_workers", stats.workers as f64),
            ("index_bytes", stats.bytes as f64),
        ] {
            gauge(&mut out, key, &[], value);
        }
        let counter = |out: &mut String, name: &str, value: u64| {
            out.push_str(&format!(
                "# HELP llmsched_gateway_{name}_total {}\n\
                 # TYPE llmsched_gateway_{name}_total counter\n\
                 llmsched_gateway_{name}_total {value}.0\n",
                help(name)
            ));
        };
        counter(&mut out, "index_evicted_blocks", stats.evicted_blocks);
        if let Some(tokenizer) = &self.tokenizer {
            tokenizer_cache_metrics(&mut out, &tokenizer.cache_stats());
        }
        if let Some(extra) = &self.extra_metrics {
            out.push_str(&extra());
        }
        gauge(&mut out, "response_owners", &[], self.owners.len() as f64);
        gauge(&mut out, "tenants", &[], self.tenants.len() as f64);
        if let Some(metrics) = self.flow.as_ref().and_then(|f| f.metrics(monotonic())) {
            gauge(&mut out, "saturation", &[], metrics.saturation);
            for band in &metrics.bands {
                let priority = band.priority.to_string();
                gauge(&mut out, "queue_length", &[("priority", &priority)], band.queued as f64);
            }
            gauge(&mut out, "running", &[], metrics.running as f64);
            gauge(&mut out, "flow_tenants", &[], metrics.tenants as f64);
            counter(&mut out, "flows_reclaimed", metrics.flows_reclaimed);
            counter(&mut out, "priorities_folded", metrics.priorities_folded);
            out.push_str(&format!(
                "# HELP llmsched_gateway_flow_outcomes_total {}\n\
                 # TYPE llmsched_gateway_flow_outcomes_total counter\n",
                help("flow_outcomes")
            ));
            for (outcome, count) in &metrics.outcomes {
                out.push_str(&format!(
                    "llmsched_gateway_flow_outcomes_total{{outcome=\"{outcome}\"}} {count}.0\n"
                ));
            }
        }
        out
    }
}
