//! Saturation: endpoint metrics (or in-flight work) turned into one number, and the per-band
//! ceilings it is compared with. A band dispatches only while saturation < its ceiling.
//!
//! Detectors (`saturation` config):
//!
//! | type | saturation | params (defaults) |
//! |---|---|---|
//! | `utilization` | mean over endpoints of `max(waiting / queue_threshold, kv_usage / kv_threshold)` | `queue_threshold` 5, `kv_threshold` 0.8, `staleness_s` 1.0, `stale_policy` `saturated` |
//! | `concurrency` | `max(in-flight requests / max_requests, in-flight tokens / max_tokens)` | `max_requests`, `max_tokens` (at least one) |
//!
//! Metrics older than `staleness_s` count as saturation 1 (`saturated`, llm-d's rule), are left
//! out of the mean (`ignore`) or are used as they are (`last`). A `utilization` pool without a
//! usable endpoint reports `no_endpoints`: arrivals are refused and nothing dispatches.
//!
//! Ceilings (`ceilings` config; a band's own `ceiling` overrides): `static` gives every band
//! `ceiling` (1.0); `holdback` gives the band ranked `r` from the top (0 = highest priority)
//! `max(floor, top - step * r)` (1.0, 0.1, 0.1), so lower bands stop earlier and leave headroom.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// One endpoint's load report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointMetrics {
    /// Requests waiting in the engine's queue.
    pub waiting: u64,
    /// Requests running in the engine.
    pub running: u64,
    /// KV-cache usage in [0, 1].
    pub kv_usage: f64,
    /// When the metrics were scraped, on the controller's clock.
    pub timestamp: f64,
}

/// Work dispatched and not yet completed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlight {
    pub requests: u64,
    pub tokens: u64,
}

/// The detector's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saturation {
    pub value: f64,
    /// No endpoint can take work: arrivals are rejected and nothing dispatches.
    pub no_endpoints: bool,
}

/// Turns load signals into a saturation number.
pub trait SaturationDetector: Send + fmt::Debug {
    fn update_endpoint(&mut self, endpoint: &str, metrics: EndpointMetrics);
    /// Forgets an endpoint; false when it was unknown.
    fn remove_endpoint(&mut self, endpoint: &str) -> bool;
    fn saturation(&mut self, now: f64, inflight: InFlight) -> Saturation;
}

/// What stale endpoint metrics count as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StalePolicy {
    Saturated,
    Ignore,
    Last,
}

/// Parameters of `utilization`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UtilizationParams {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    pub staleness_s: f64,
    pub stale_policy: StalePolicy,
}

impl Default for UtilizationParams {
    fn default() -> Self {
        // llm-d flow control defaults.
        UtilizationParams {
            queue_threshold: 5.0,
            kv_threshold: 0.8,
            staleness_s: 1.0,
            stale_policy: StalePolicy::Saturated,
        }
    }
}

fn check_positive(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(format!("{name} must be a finite number > 0, got {value}"))
    }
}

impl UtilizationParams {
    pub fn validate(&self) -> Result<(), String> {
        check_positive("queue_threshold", self.queue_threshold)?;
        check_positive("kv_threshold", self.kv_threshold)?;
        check_positive("staleness_s", self.staleness_s)
    }
}

#[derive(Debug, Clone, Copy)]
struct CachedSaturation {
    saturation: Saturation,
    /// Oldest timestamp among the endpoints counted fresh; the cache holds while it stays fresh.
    oldest_fresh: f64,
}

/// `utilization`: llm-d's queue/KV detector, cached until an update or until a fresh endpoint
/// turns stale.
#[derive(Debug)]
pub struct UtilizationDetector {
    params: UtilizationParams,
    endpoints: BTreeMap<String, EndpointMetrics>,
    cache: Option<CachedSaturation>,
}

impl UtilizationDetector {
    pub fn new(params: UtilizationParams) -> Self {
        UtilizationDetector { params, endpoints: BTreeMap::new(), cache: None }
    }

    fn endpoint_saturation(&self, m: &EndpointMetrics) -> f64 {
        (m.waiting as f64 / self.params.queue_threshold).max(m.kv_usage / self.params.kv_threshold)
    }

    /// Endpoints are summed in id order so the result is reproducible to the last bit.
    fn compute(&self, now: f64) -> CachedSaturation {
        let mut total = 0.0;
        let mut counted = 0u64;
        let mut oldest_fresh = f64::INFINITY;
        for m in self.endpoints.values() {
            let fresh = now - m.timestamp <= self.params.staleness_s;
            let contribution = match (fresh, self.params.stale_policy) {
                (true, _) | (false, StalePolicy::Last) => Some(self.endpoint_saturation(m)),
                (false, StalePolicy::Saturated) => Some(1.0),
                (false, StalePolicy::Ignore) => None,
            };
            if fresh {
                oldest_fresh = oldest_fresh.min(m.timestamp);
            }
            if let Some(value) = contribution {
                total += value;
                counted += 1;
            }
        }
        let saturation = if counted == 0 {
            Saturation { value: 1.0, no_endpoints: true }
        } else {
            Saturation { value: total / counted as f64, no_endpoints: false }
        };
        CachedSaturation { saturation, oldest_fresh }
    }

    fn still_valid(&self, cached: &CachedSaturation, now: f64) -> bool {
        self.params.stale_policy == StalePolicy::Last
            || cached.oldest_fresh == f64::INFINITY
            || now - cached.oldest_fresh <= self.params.staleness_s
    }
}

impl SaturationDetector for UtilizationDetector {
    fn update_endpoint(&mut self, endpoint: &str, metrics: EndpointMetrics) {
        match self.endpoints.get_mut(endpoint) {
            Some(slot) => *slot = metrics,
            None => {
                self.endpoints.insert(endpoint.to_owned(), metrics);
            }
        }
        self.cache = None;
    }

    fn remove_endpoint(&mut self, endpoint: &str) -> bool {
        self.cache = None;
        self.endpoints.remove(endpoint).is_some()
    }

    fn saturation(&mut self, now: f64, _inflight: InFlight) -> Saturation {
        if let Some(cached) = self.cache {
            if self.still_valid(&cached, now) {
                return cached.saturation;
            }
        }
        let fresh = self.compute(now);
        self.cache = Some(fresh);
        fresh.saturation
    }
}

/// Parameters of `concurrency`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConcurrencyParams {
    pub max_requests: Option<u64>,
    pub max_tokens: Option<u64>,
}

impl ConcurrencyParams {
    pub fn validate(&self) -> Result<(), String> {
        match (self.max_requests, self.max_tokens) {
            (None, None) => Err("concurrency needs max_requests or max_tokens".into()),
            (Some(0), _) | (_, Some(0)) => Err("max_requests and max_tokens must be >= 1".into()),
            _ => Ok(()),
        }
    }
}

/// `concurrency`: in-flight work against a fixed capacity; endpoint reports are ignored.
#[derive(Debug)]
pub struct ConcurrencyDetector {
    pub params: ConcurrencyParams,
}

impl SaturationDetector for ConcurrencyDetector {
    fn update_endpoint(&mut self, _endpoint: &str, _metrics: EndpointMetrics) {}

    fn remove_endpoint(&mut self, _endpoint: &str) -> bool {
        false
    }

    fn saturation(&mut self, _now: f64, inflight: InFlight) -> Saturation {
        let by_requests =
            self.params.max_requests.map_or(0.0, |m| inflight.requests as f64 / m as f64);
        let by_tokens = self.params.max_tokens.map_or(0.0, |m| inflight.tokens as f64 / m as f64);
        Saturation { value: by_requests.max(by_tokens), no_endpoints: false }
    }
}

/// Assigns ceilings to bands by rank (0 = highest priority).
pub trait CeilingPolicy: Send + fmt::Debug {
    fn ceiling(&self, rank: usize) -> f64;
}

/// Parameters of `static`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StaticCeilingParams {
    pub ceiling: f64,
}

impl Default for StaticCeilingParams {
    fn default() -> Self {
        StaticCeilingParams { ceiling: 1.0 }
    }
}

impl StaticCeilingParams {
    pub fn validate(&self) -> Result<(), String> {
        check_positive("ceiling", self.ceiling)
    }
}

/// `static`: one ceiling for every band.
#[derive(Debug)]
pub struct StaticCeiling {
    pub params: StaticCeilingParams,
}

impl CeilingPolicy for StaticCeiling {
    fn ceiling(&self, _rank: usize) -> f64 {
        self.params.ceiling
    }
}

/// Parameters of `holdback`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HoldbackParams {
    pub top: f64,
    pub step: f64,
    pub floor: f64,
}

impl Default for HoldbackParams {
    fn default() -> Self {
        HoldbackParams { top: 1.0, step: 0.1, floor: 0.1 }
    }
}

impl HoldbackParams {
    pub fn validate(&self) -> Result<(), String> {
        check_positive("top", self.top)?;
        check_positive("floor", self.floor)?;
        if !(self.step.is_finite() && self.step >= 0.0) {
            return Err(format!("step must be a finite number >= 0, got {}", self.step));
        }
        if self.floor > self.top {
            return Err(format!("floor ({}) must not exceed top ({})", self.floor, self.top));
        }
        Ok(())
    }
}

/// `holdback`: lower bands get lower ceilings.
#[derive(Debug)]
pub struct HoldbackCeiling {
    pub params: HoldbackParams,
}

impl CeilingPolicy for HoldbackCeiling {
    fn ceiling(&self, rank: usize) -> f64 {
        (self.params.top - self.params.step * rank as f64).max(self.params.floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(waiting: u64, kv_usage: f64, timestamp: f64) -> EndpointMetrics {
        EndpointMetrics { waiting, running: 0, kv_usage, timestamp }
    }

    #[test]
    fn utilization_is_mean_of_per_endpoint_max() {
        let mut d = UtilizationDetector::new(UtilizationParams::default());
        assert!(d.saturation(0.0, InFlight::default()).no_endpoints);
        // queue 5/5 = 1.0 beats kv 0.4/0.8 = 0.5; kv 0.4/0.8 = 0.5 beats queue 0.
        d.update_endpoint("a", metrics(5, 0.4, 0.0));
        d.update_endpoint("b", metrics(0, 0.4, 0.0));
        let s = d.saturation(0.1, InFlight::default());
        assert_eq!(s, Saturation { value: 0.75, no_endpoints: false });
    }

    #[test]
    fn stale_policies() {
        let table = [
            (StalePolicy::Saturated, Saturation { value: 0.5, no_endpoints: false }),
            (StalePolicy::Ignore, Saturation { value: 0.0, no_endpoints: false }),
            (StalePolicy::Last, Saturation { value: 0.0, no_endpoints: false }),
        ];
        for (policy, expected) in table {
            let params = UtilizationParams {
                stale_policy: policy,
                staleness_s: 0.2,
                ..UtilizationParams::default()
            };
            let mut d = UtilizationDetector::new(params);
            d.update_endpoint("old", metrics(0, 0.0, 0.0));
            d.update_endpoint("new", metrics(0, 0.0, 1.0));
            // Cached before "old" turns stale, recomputed after.
            assert_eq!(d.saturation(0.1, InFlight::default()).value, 0.0);
            assert_eq!(d.saturation(1.0, InFlight::default()), expected, "{policy:?}");
        }
        let params =
            UtilizationParams { stale_policy: StalePolicy::Ignore, ..UtilizationParams::default() };
        let mut d = UtilizationDetector::new(params);
        d.update_endpoint("a", metrics(0, 0.0, 0.0));
        assert!(d.saturation(5.0, InFlight::default()).no_endpoints);
    }

    #[test]
    fn concurrency_takes_the_larger_ratio() {
        let params = ConcurrencyParams { max_requests: Some(10), max_tokens: Some(1000) };
        let mut d = ConcurrencyDetector { params };
        let s = d.saturation(0.0, InFlight { requests: 2, tokens: 500 });
        assert_eq!(s.value, 0.5);
    }

    #[test]
    fn holdback_ceilings() {
        let h = HoldbackCeiling { params: HoldbackParams { top: 1.0, step: 0.25, floor: 0.3 } };
        assert_eq!([h.ceiling(0), h.ceiling(1), h.ceiling(2), h.ceiling(9)], [1.0, 0.75, 0.5, 0.3]);
    }
}
