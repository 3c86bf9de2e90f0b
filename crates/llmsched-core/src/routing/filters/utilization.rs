//! `utilization-filter`: keeps endpoints below the saturation thresholds: fewer than
//! `queueDepthThreshold` waiting requests (default 5) and KV-cache use below
//! `kvCacheUtilThreshold` (default 0.8), the defaults of llm-d's saturation detector; optional
//! `maxRunningRequests`. Stale endpoints under the "saturated" policy are dropped. Fails open:
//! when every endpoint is saturated, all stay (better a busy endpoint than none).

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
    queue: u32,
    kv: f64,
    running: u32,
}

impl Filter for UtilizationFilter {
    fn reads_prefix_match(&self) -> bool {
        false
    }

    fn filter(
        &self,
        _: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        for (k, c) in keep.iter_mut().zip(cands) {
            let m = &c.metrics;
            *k = !c.saturated
                && m.waiting < self.queue
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
        queue: p.queue_depth_threshold,
        kv: p.kv_cache_util_threshold,
        running: p.max_running_requests.unwrap_or(u32::MAX),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::testing::Fixture;

    #[test]
    fn table() {
        let f = UtilizationFilter { queue: 5, kv: 0.8, running: u32::MAX };
        let fx = Fixture::new(4).waiting(&[0, 4, 5, 1]).kv(&[0.1, 0.79, 0.2, 0.8]);
        assert_eq!(fx.filter(&f), vec![0, 1]);
        let mut stale = Fixture::new(2);
        stale.candidates[0].saturated = true;
        assert_eq!(stale.filter(&f), vec![1]);
        let capped = UtilizationFilter { queue: 5, kv: 0.8, running: 3 };
        assert_eq!(Fixture::new(2).running(&[2, 3]).filter(&capped), vec![0]);
        assert_eq!(f.on_empty(), OnEmpty::FailOpen);
    }
}
