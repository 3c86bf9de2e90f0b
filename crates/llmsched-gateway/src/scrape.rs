//! The scrape of the engines' `/metrics` into the pool and flow control's saturation detector:
//! all engines at once, every `scrape_interval_s`, the interval growing while no request
//! arrives.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use llmsched_core::flow::EndpointMetrics;
use llmsched_core::routing::metrics_text;

use crate::{monotonic, Gateway, Upstream};

/// Scrapes every engine's `/metrics` (concurrently) into the pool and flow control; backs off
/// while no request arrives, but never so far that the metrics go stale (see [`idle_scrape_limit`]).
pub(crate) async fn scrape(gateway: Arc<Gateway>, base: Duration) {
    let mut interval = base;
    let mut seen = u64::MAX;
    let timeout = Duration::from_secs_f64(gateway.config.scrape_timeout_s);
    let limit = idle_scrape_limit(&gateway, base);
    // The first round at once: with flow control on, engines without metrics count as
    // saturated, and the first requests would wait for a round (or be refused).
    let mut first = true;
    loop {
        if !first {
            tokio::time::sleep(interval).await;
        }
        first = false;
        let requests = gateway.counters.received.load(Ordering::Relaxed);
        interval = if requests == seen { (interval * 2).min(limit) } else { base };
        seen = requests;
        let upstreams = gateway.upstreams();
        for upstream in &upstreams.list {
            // Both kinds of every engine scraped, at 0 until one fails, as on the Python
            // plane: `rate()` and `increase()` read a series from its first scrape, where one
            // that appears with its first failure loses that failure.
            gateway.counters.scrape_failures.add(&[&upstream.id, "failed"], 0);
            gateway.counters.scrape_failures.add(&[&upstream.id, "timeout"], 0);
        }
        // All engines at once: their answers come back together, one wake-up of the thread
        // for the lot rather than one per engine (what an idle gateway spends its time on).
        let scrapes = upstreams.list.iter().map(|u| scrape_once(&gateway, u, timeout));
        let scrapes = futures::future::join_all(scrapes).await;
        for (upstream, scraped) in upstreams.list.iter().zip(scrapes) {
            let scraped = match scraped {
                Scraped::Answered(scraped) => {
                    upstream.scrape_failed.store(false, Ordering::Relaxed);
                    scraped
                }
                Scraped::Failed => {
                    gateway.counters.scrape_failures.inc(&[&upstream.id, "failed"]);
                    if !upstream.scrape_failed.swap(true, Ordering::Relaxed) {
                        gateway.routing_changed.notify_waiters();
                    }
                    continue;
                }
                // No answer in time is what a stall looks like (the engine's core or the
                // gateway's taken by something else for a second): the engine keeps its
                // place in routing and its metrics age, and confirming probes decide, so a
                // stall of every engine's core does not turn into a 503 for every request
                // until the next scrape gets through. A dead engine refuses the connection
                // (`Failed` above) and fails its probes within `health.timeout_s`.
                Scraped::TimedOut => {
                    gateway.counters.scrape_failures.inc(&[&upstream.id, "timeout"]);
                    gateway.ask_probes(upstream);
                    continue;
                }
            };
            let now = monotonic();
            let update = scraped.update;
            let _ = gateway.router().pool().update_metrics(&upstream.key, update, now);
            if let Some(size) = scraped.block_size.filter(|&size| size > 0) {
                let before = upstream.block_size.swap(size, Ordering::Relaxed);
                if let Some(hook) = gateway.block_size_hook.clone().filter(|_| before != size) {
                    let worker = upstream.id.clone();
                    tokio::task::spawn_blocking(move || hook(&worker, size));
                }
            }
            if let Some(loras) = scraped.loras {
                // The adapters it runs and waits on (`vllm:lora_requests_info`), what the LoRA
                // filters and scorers read.
                let _ = gateway.router().pool().set_loras(&upstream.key, loras);
            }
            if let Some(flow) = &gateway.flow {
                flow.update_endpoint(
                    &upstream.id,
                    EndpointMetrics {
                        waiting: u64::from(update.waiting.unwrap_or(0)),
                        running: u64::from(update.running.unwrap_or(0)),
                        kv_usage: update.kv_cache_usage.unwrap_or(0.0).clamp(0.0, 1.0),
                        timestamp: now,
                    },
                );
            }
        }
        if let Some(flow) = &gateway.flow {
            flow.pump(monotonic());
        }
    }
}

/// How one engine's scrape ended.
enum Scraped {
    /// Its metrics.
    Answered(metrics_text::Scrape),
    /// Refused, an error status, or text that does not parse: the engine answered (or its
    /// port did) that it cannot serve.
    Failed,
    /// No answer within `scrape_timeout_s`: the engine, or the gateway, may only be stalled.
    TimedOut,
}

/// The largest `/metrics` body read (8 MiB, as on the Python plane; vLLM's with eight
/// data-parallel ranks is about 270 KB).
const MAX_SCRAPE_BYTES: usize = 8 << 20;

/// One engine's scrape. A request that fails before any answer (typically a pooled
/// connection the engine closed meanwhile) is tried once more on a fresh one: one lost race
/// must not take a healthy engine out of routing.
async fn scrape_once(gateway: &Gateway, upstream: &Upstream, timeout: Duration) -> Scraped {
    let fetch = async {
        let answer = match gateway.client.get(upstream.metrics.clone()).await {
            Ok(answer) => answer,
            Err(_) => gateway.client.get(upstream.metrics.clone()).await.ok()?,
        };
        if !answer.status().is_success() {
            return None;
        }
        // Bounded, as the Python plane bounds it: an endless body is a failed scrape, not
        // gigabytes held.
        let body = Limited::new(answer.into_body(), MAX_SCRAPE_BYTES).collect().await.ok()?;
        // A label in another encoding (Latin-1) is not what a load figure needs. (Checked as
        // UTF-8 first: the lossy reading goes a byte at a time even through ASCII.)
        let bytes = body.to_bytes();
        Some(match std::str::from_utf8(&bytes) {
            Ok(text) => text.to_owned(),
            Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
        })
    };
    match tokio::time::timeout(timeout, fetch).await {
        Ok(Some(text)) => metrics_text::parse(&text).map_or(Scraped::Failed, Scraped::Answered),
        Ok(None) => Scraped::Failed,
        Err(_) => Scraped::TimedOut,
    }
}

/// The longest interval the idle scrape backs off to: 25 base intervals, but at most half
/// the shorter of the pool's and flow control's staleness limits (the other half is left
/// for the scrape itself), since a request arriving after an idle spell is routed and
/// admitted on the metrics already there, and stale ones count every engine saturated.
fn idle_scrape_limit(gateway: &Gateway, base: Duration) -> Duration {
    let mut stale = gateway.router().pool().policy().stale_after;
    if let Some(flow_stale) = gateway.flow.as_ref().and_then(|f| f.metrics_staleness_s()) {
        stale = stale.min(flow_stale);
    }
    let fresh = Duration::try_from_secs_f64(stale / 2.0).unwrap_or(Duration::MAX);
    (base * 25).min(fresh).max(base)
}
