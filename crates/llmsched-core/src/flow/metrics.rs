//! Metrics: wait-time histograms, per-band and per-flow gauges, outcome counts and Jain's
//! fairness index. Snapshots serialise to plain JSON-shaped data.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

/// Counts of values per bucket: `counts[i]` holds values in `(bounds[i-1], bounds[i]]`, the last
/// entry those above every bound.
#[derive(Debug, Clone, Serialize)]
pub struct Histogram {
    #[serde(serialize_with = "serialize_bounds")]
    pub bounds: Arc<[f64]>,
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

fn serialize_bounds<S: serde::Serializer>(bounds: &Arc<[f64]>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(bounds.iter())
}

impl Histogram {
    pub fn new(bounds: Arc<[f64]>) -> Self {
        let counts = vec![0; bounds.len() + 1];
        Histogram { bounds, counts, sum: 0.0, count: 0 }
    }

    pub fn record(&mut self, value: f64) {
        let bucket = self.bounds.partition_point(|&bound| bound < value);
        self.counts[bucket] += 1;
        self.sum += value;
        self.count += 1;
    }
}

/// Jain's fairness index `(sum x)^2 / (n * sum x^2)`: 1 when every flow got the same service,
/// 1/n when one flow got everything. 1 for no flows or no service at all.
pub fn jain_index(values: impl IntoIterator<Item = f64>) -> f64 {
    let (mut n, mut sum, mut sum_sq) = (0u64, 0.0, 0.0);
    for x in values {
        n += 1;
        sum += x;
        sum_sq += x * x;
    }
    if n == 0 || sum_sq == 0.0 {
        1.0
    } else {
        sum * sum / (n as f64 * sum_sq)
    }
}

/// One priority band.
#[derive(Debug, Clone, Serialize)]
pub struct BandMetrics {
    pub priority: i32,
    pub ceiling: f64,
    pub queued: u64,
    pub queued_bytes: u64,
    pub flows: usize,
    pub dispatched: u64,
    /// Seconds from enqueue to dispatch.
    pub wait_s: Histogram,
}

/// One flow, `(tenant, priority)`.
#[derive(Debug, Clone, Serialize)]
pub struct FlowMetrics {
    pub tenant: String,
    pub priority: i32,
    pub queued: u64,
    pub queued_bytes: u64,
    pub dispatched: u64,
    /// Prompt tokens dispatched plus output tokens reported.
    pub service_tokens: u64,
    /// The fairness policy's number for the flow (VTC counter, LAS decayed attained service);
    /// `None` for policies without one.
    pub fairness_counter: Option<f64>,
}

/// A snapshot of the whole controller.
#[derive(Debug, Clone, Serialize)]
pub struct ControllerMetrics {
    /// The saturation gauge (for autoscalers and admission layers).
    pub saturation: f64,
    pub no_endpoints: bool,
    pub queued: u64,
    pub queued_bytes: u64,
    pub running: u64,
    pub running_tokens: u64,
    /// Terminal outcomes so far, by outcome name.
    pub outcomes: BTreeMap<&'static str, u64>,
    /// Bands from the highest priority down.
    pub bands: Vec<BandMetrics>,
    pub flows: Vec<FlowMetrics>,
    /// Jain's index over tenants' service tokens (all bands).
    pub jain_index: f64,
    /// Tenants with at least one flow now.
    pub tenants: usize,
    /// Flows reclaimed after `flow_idle_s` idle, so far.
    pub flows_reclaimed: u64,
    /// Requests queued in the band of another priority than theirs, so far: their priority had
    /// no band, and [`MAX_BANDS`](super::MAX_BANDS) bands besides the configured ones existed.
    pub priorities_folded: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let mut h = Histogram::new(Arc::from(vec![0.1, 1.0]));
        for v in [0.0, 0.1, 0.5, 1.0, 7.0] {
            h.record(v);
        }
        assert_eq!(h.counts, vec![2, 2, 1]);
        assert_eq!(h.count, 5);
    }

    #[test]
    fn jain_table() {
        assert_eq!(jain_index([]), 1.0);
        assert_eq!(jain_index([0.0, 0.0]), 1.0);
        assert_eq!(jain_index([5.0, 5.0, 5.0]), 1.0);
        assert_eq!(jain_index([1.0, 0.0, 0.0, 0.0]), 0.25);
        assert!((jain_index([1.0, 2.0]) - 0.9).abs() < 1e-12);
    }
}
