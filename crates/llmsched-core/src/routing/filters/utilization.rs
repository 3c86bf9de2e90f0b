//! `utilization-filter`: keeps endpoints below the saturation thresholds: fewer than
//! `queueDepthThreshold` waiting requests (default 5) and KV-cache use below
//! `kvCacheUtilThreshold` (default 0.8), the defaults of llm-d's saturation detector; optional
//! `maxRunningRequests`. Stale endpoints under the "saturated" policy are dropped. Fails open:
//! when every endpoint is saturated, all stay (better a busy endpoint than none).
//!
//! `utilization-detector`: llm-d's current saturation detector, which is also a filter. Its
//! thresholds (`queueDepthThreshold` 5, `kvCacheUtilThreshold` 0.8,
//! `metricsStalenessThreshold`, no default here: see below) are flow control's when `saturationDetector.pluginRef`
//! names it (read by [`crate::routing::config`]); listed in a profile, it keeps endpoints with
//! `waiting < queueDepthThreshold * (1 + headroom)` and `kv < kvCacheUtilThreshold * (1 +
//! headroom)` (llm-d's comparison, in f64), dropping stale ones, and fails open as llm-d's
//! filter does. Stale means metrics older than `metricsStalenessThreshold` when the parameter
//! is given (llm-d's `Filter` drops them whatever its staleness policy), else what the pool
//! marks stale (`EndpointPool(stale_after_s=...)`; the gateway's follows its scrape interval,
//! as flow control's staleness does when the parameter is left out).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::routing::plugin::{Candidate, Filter, OnEmpty, PluginResult, RequestContext};
use crate::routing::registry::{
    check_range, decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc,
};
use crate::routing::rng::DecisionRng;

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct Params {
    queue_depth_threshold: u32,
    kv_cache_util_threshold: f64,
    max_running_requests: Option<u32>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            max_running_requests: None,
        }
    }
}

pub struct UtilizationFilter {
    /// Waiting requests stay below this (a float: the detector's limit scaled by headroom).
    queue: f64,
    kv: f64,
    running: u32,
    /// Metrics older than this many seconds are stale (the detector's explicit
    /// `metricsStalenessThreshold`); None: the pool's staleness (`Candidate::saturated`).
    stale_after: Option<f64>,
}

impl Filter for UtilizationFilter {
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
        for (k, c) in keep.iter_mut().zip(cands) {
            let m = &c.metrics;
            let stale = match self.stale_after {
                // Never reported (timestamp -inf) is stale too, as llm-d's nil metrics.
                Some(limit) => ctx.now - m.timestamp > limit,
                None => c.saturated,
            };
            *k = !stale
                && f64::from(m.waiting) < self.queue
                && m.kv_cache_usage < self.kv
                && m.running < self.running;
        }
        Ok(())
    }

    fn on_empty(&self) -> OnEmpty {
        OnEmpty::FailOpen
    }
}

pub fn factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: Params = decode(params)?;
    check_range("kvCacheUtilThreshold", p.kv_cache_util_threshold, 0.0, 1.0)?;
    Ok(Plugin::filter(UtilizationFilter {
        queue: f64::from(p.queue_depth_threshold),
        kv: p.kv_cache_util_threshold,
        running: p.max_running_requests.unwrap_or(u32::MAX),
        stale_after: None,
    }))
}

const PARAMS: &[ParamDoc] = &[
    ParamDoc::int("queueDepthThreshold", "waiting requests an endpoint must stay below"),
    ParamDoc::number("kvCacheUtilThreshold", "KV-cache use an endpoint must stay below")
        .min(0.0)
        .max(1.0),
    ParamDoc::int(
        "maxRunningRequests",
        "running requests an endpoint must stay below (absent: no limit)",
    ),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "keeps endpoints below the saturation thresholds; fails open",
        PARAMS,
        defaults_of::<Params>(),
    )
}

/// `utilization-detector`'s parameters, llm-d's `apiConfig` with its defaults.
#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct DetectorParams {
    queue_depth_threshold: u32,
    kv_cache_util_threshold: f64,
    /// Absent: the pool's staleness (see the module docs).
    metrics_staleness_threshold: Option<String>,
    headroom: f64,
}

impl Default for DetectorParams {
    fn default() -> Self {
        DetectorParams {
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            metrics_staleness_threshold: None,
            headroom: 0.0,
        }
    }
}

pub fn detector_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: DetectorParams = decode(params)?;
    if p.queue_depth_threshold == 0 {
        return Err(ParamError::new("queueDepthThreshold", "must be at least 1, got 0"));
    }
    if !(p.kv_cache_util_threshold > 0.0 && p.kv_cache_util_threshold <= 1.0) {
        return Err(ParamError::new(
            "kvCacheUtilThreshold",
            format!("must be in (0, 1], got {}", p.kv_cache_util_threshold),
        ));
    }
    let stale_after = match p.metrics_staleness_threshold.as_deref() {
        None => None,
        Some(text) => match crate::routing::config::parse_duration(text) {
            Ok(s) if s > 0.0 => Some(s),
            Ok(_) => return Err(ParamError::new("metricsStalenessThreshold", "must be positive")),
            Err(m) => return Err(ParamError::new("metricsStalenessThreshold", m)),
        },
    };
    check_range("headroom", p.headroom, 0.0, f64::MAX)?;
    Ok(Plugin::filter(UtilizationFilter {
        queue: f64::from(p.queue_depth_threshold) * (1.0 + p.headroom),
        kv: p.kv_cache_util_threshold * (1.0 + p.headroom),
        running: u32::MAX,
        stale_after,
    }))
}

const DETECTOR_PARAMS: &[ParamDoc] = &[
    ParamDoc::int(
        "queueDepthThreshold",
        "waiting requests at which an endpoint is saturated (flow control's queue threshold)",
    )
    .min(1.0),
    ParamDoc::number(
        "kvCacheUtilThreshold",
        "KV-cache use at which an endpoint is saturated (flow control's KV threshold; greater \
         than 0)",
    )
    .max(1.0),
    ParamDoc::string(
        "metricsStalenessThreshold",
        "metrics older than this (a Go duration) are stale: flow control's staleness, and as a \
         filter stale endpoints are dropped (llm-d's default 200ms is not assumed: absent, \
         both follow the pool's staleness, the gateway's scrape interval)",
    ),
    ParamDoc::number(
        "headroom",
        "as a filter, endpoints are kept below each threshold times (1 + headroom)",
    )
    .min(0.0),
];

/// The catalogue entry of `utilization-detector`.
pub fn detector_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "llm-d's saturation detector: flow control's thresholds when `saturationDetector` names \
         it; in a profile, keeps endpoints below the thresholds (times 1 + headroom); fails open",
        DETECTOR_PARAMS,
        defaults_of::<DetectorParams>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let f = UtilizationFilter { queue: 5.0, kv: 0.8, running: u32::MAX, stale_after: None };
        let fx = Fixture::new(4).waiting(&[0, 4, 5, 1]).kv(&[0.1, 0.79, 0.2, 0.8]);
        assert_eq!(fx.filter(&f), vec![0, 1]);
        let mut stale = Fixture::new(2);
        stale.candidates[0].saturated = true;
        assert_eq!(stale.filter(&f), vec![1]);
        let capped = UtilizationFilter { queue: 5.0, kv: 0.8, running: 3, stale_after: None };
        assert_eq!(Fixture::new(2).running(&[2, 3]).filter(&capped), vec![0]);
        assert_eq!(f.on_empty(), OnEmpty::FailOpen);
    }

    #[test]
    fn detector_limits_scale_with_headroom() {
        let Plugin::Filter(d) = detector_factory(&serde_json::json!({"headroom": 0.2})).unwrap()
        else {
            panic!("a filter")
        };
        // 5 * 1.2 = 6 waiting, 0.8 * 1.2 = 0.96 KV use: llm-d keeps waiting < 6, kv < 0.96.
        let fx = Fixture::new(4).waiting(&[5, 6, 0, 0]).kv(&[0.1, 0.1, 0.95, 0.96]);
        assert_eq!(fx.filter(d.as_ref()), vec![0, 2]);
        for (params, field) in [
            (serde_json::json!({"queueDepthThreshold": 0}), "queueDepthThreshold"),
            (serde_json::json!({"kvCacheUtilThreshold": 0.0}), "kvCacheUtilThreshold"),
            (serde_json::json!({"metricsStalenessThreshold": "soon"}), "metricsStalenessThreshold"),
            (serde_json::json!({"headroom": -0.1}), "headroom"),
            (serde_json::json!({"queueDepth": 1}), ""),
        ] {
            let Err(e) = detector_factory(&params) else { panic!("{params} accepted") };
            assert!(e.path == field || e.message.contains("queueDepth"), "{e:?}");
        }
    }

    #[test]
    fn detector_staleness_threshold_is_its_own() {
        let build = |params| {
            let Plugin::Filter(d) = detector_factory(&params).unwrap() else { panic!("a filter") };
            d
        };
        // Metrics 0.1 s old at now 0 (timestamp -0.1), one never reported, one the pool marks
        // stale although 0.01 s old.
        let mut fx = Fixture::new(4);
        fx.candidates[0].metrics.timestamp = -0.1;
        fx.candidates[1].metrics.timestamp = f64::NEG_INFINITY;
        fx.candidates[2].metrics.timestamp = -0.01;
        fx.candidates[2].saturated = true;
        fx.candidates[3].metrics.timestamp = -0.01;
        // The threshold given: it alone judges staleness, not the pool's mark.
        let d = build(serde_json::json!({"metricsStalenessThreshold": "50ms"}));
        assert_eq!(fx.filter(d.as_ref()), vec![2, 3]);
        let d = build(serde_json::json!({"metricsStalenessThreshold": "1s"}));
        assert_eq!(fx.filter(d.as_ref()), vec![0, 2, 3]);
        // Left out: the pool's mark.
        let d = build(serde_json::json!({}));
        assert_eq!(fx.filter(d.as_ref()), vec![0, 1, 3]);
        // Every endpoint stale: fails open (the profile keeps all).
        assert_eq!(d.on_empty(), OnEmpty::FailOpen);
    }
}
