//! Flow-control configuration: plain data (JSON/YAML-shaped), defaults in one place (the
//! `Default` impls here and in each policy's parameter struct), resolved once against the
//! [`PolicyRegistry`] so every later step can trust it.
//!
//! ```text
//! default_band:   {max_requests: 5000, max_bytes: 1e9, ttl_s: 60, ceiling: null,
//!                  fairness: {type: round-robin}, ordering: {type: fcfs}}
//! bands:          [{priority: 10, ...any default_band field}]   # per-priority overrides
//! global:         {max_requests: null, max_bytes: null}         # null = unlimited
//! saturation:     {type: utilization, ...}   ceilings: {type: static, ceiling: 1.0}
//! shedding:       {type: probabilistic, power: 5, scale: 300, seed: 0}
//! preemption:     {evict_queued: true, max_victims: 2, pacing_s: 0.5}
//! wait_buckets_s: [0.005, ..., 60]
//! flow_idle_s:    300                          # null = flows are never reclaimed
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::registry::PolicyRegistry;
use super::request::FlowError;

/// `{type: name, ...params}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySpec {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub params: Map<String, Value>,
}

impl PolicySpec {
    /// A spec with default parameters.
    pub fn named(kind: &str) -> Self {
        PolicySpec { kind: kind.to_owned(), params: Map::new() }
    }
}

/// Request and byte limits; `None` = unlimited.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    pub max_requests: Option<u64>,
    pub max_bytes: Option<u64>,
}

/// The settings of one priority band.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandConfig {
    pub max_requests: Option<u64>,
    pub max_bytes: Option<u64>,
    /// Queued requests expire this many seconds after arrival; `None` = never.
    pub ttl_s: Option<f64>,
    /// Overrides the ceiling policy for this band.
    pub ceiling: Option<f64>,
    pub fairness: PolicySpec,
    pub ordering: PolicySpec,
}

impl Default for BandConfig {
    fn default() -> Self {
        // llm-d: 5,000 requests and 1 GB per band, 60 s TTL.
        BandConfig {
            max_requests: Some(5_000),
            max_bytes: Some(1_000_000_000),
            ttl_s: Some(60.0),
            ceiling: None,
            fairness: PolicySpec::named("round-robin"),
            ordering: PolicySpec::named("fcfs"),
        }
    }
}

/// Preemption of queued and running requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreemptionConfig {
    /// A higher-priority arrival that does not fit the global limits evicts lower-priority
    /// queued requests.
    pub evict_queued: bool,
    /// At most this many running victims per `preemption_victims` decision (0 disables).
    pub max_victims: u32,
    /// The next decision waits until every victim has completed plus this many seconds.
    pub pacing_s: f64,
}

impl Default for PreemptionConfig {
    fn default() -> Self {
        // llm-d in-flight eviction: at most 2 per decision, 500 ms after revocations end.
        PreemptionConfig { evict_queued: true, max_victims: 2, pacing_s: 0.5 }
    }
}

/// The whole flow-control configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    pub default_band: BandConfig,
    /// Per-priority overrides: `{priority: int, ...fields of BandConfig}`.
    pub bands: Vec<Map<String, Value>>,
    pub global: Limits,
    pub saturation: PolicySpec,
    pub ceilings: PolicySpec,
    pub shedding: PolicySpec,
    pub preemption: PreemptionConfig,
    /// Upper bounds of the wait-time histogram buckets, seconds.
    pub wait_buckets_s: Vec<f64>,
    /// A flow with no queued and no running request for this many seconds is reclaimed (its
    /// tenant's service history in that band is forgotten); `None` keeps every flow forever.
    pub flow_idle_s: Option<f64>,
}

/// llm-d's flow registry collects a flow after 5 minutes idle (`flowGCTimeout`).
pub const DEFAULT_FLOW_IDLE_S: f64 = 300.0;

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            default_band: BandConfig::default(),
            bands: Vec::new(),
            global: Limits::default(),
            saturation: PolicySpec::named("utilization"),
            ceilings: PolicySpec::named("static"),
            shedding: PolicySpec::named("probabilistic"),
            preemption: PreemptionConfig::default(),
            wait_buckets_s: vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ],
            flow_idle_s: Some(DEFAULT_FLOW_IDLE_S),
        }
    }
}

/// A configuration checked against a registry, with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedConfig {
    pub default_band: BandConfig,
    pub bands: BTreeMap<i32, BandConfig>,
    pub global: Limits,
    pub saturation: PolicySpec,
    pub ceilings: PolicySpec,
    pub shedding: PolicySpec,
    pub preemption: PreemptionConfig,
    pub wait_buckets_s: Vec<f64>,
    pub flow_idle_s: Option<f64>,
}

fn config_error(message: String) -> FlowError {
    FlowError::Config(message)
}

fn check_limit(what: &str, value: Option<u64>) -> Result<(), FlowError> {
    match value {
        Some(0) => Err(config_error(format!("{what} must be >= 1 or null, got 0"))),
        _ => Ok(()),
    }
}

fn check_positive(what: &str, value: f64) -> Result<(), FlowError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(config_error(format!("{what} must be a finite number > 0, got {value}")))
    }
}

impl FlowConfig {
    /// Parses a JSON object; absent keys take their defaults, unknown keys are errors.
    pub fn from_json(text: &str) -> Result<Self, FlowError> {
        serde_json::from_str(text).map_err(|e| config_error(format!("flow config: {e}")))
    }

    /// Decodes an object (e.g. converted from Python), with the rules of [`Self::from_json`].
    pub fn from_value(value: Value) -> Result<Self, FlowError> {
        serde_json::from_value(value).map_err(|e| config_error(format!("flow config: {e}")))
    }

    /// Checks everything and fills in defaults, including every policy's parameters.
    pub fn resolve(&self, registry: &PolicyRegistry) -> Result<ResolvedConfig, FlowError> {
        let default_band = resolve_band("default_band", &self.default_band, registry)?;
        let mut bands = BTreeMap::new();
        for (i, raw) in self.bands.iter().enumerate() {
            let (priority, band) = resolve_override(i, raw, &default_band, registry)?;
            if bands.insert(priority, band).is_some() {
                return Err(config_error(format!("bands: priority {priority} appears twice")));
            }
        }
        check_limit("global.max_requests", self.global.max_requests)?;
        check_limit("global.max_bytes", self.global.max_bytes)?;
        let preemption = &self.preemption;
        if !(preemption.pacing_s.is_finite() && preemption.pacing_s >= 0.0) {
            return Err(config_error(format!(
                "preemption.pacing_s must be a finite number >= 0, got {}",
                preemption.pacing_s
            )));
        }
        check_buckets(&self.wait_buckets_s)?;
        if let Some(idle) = self.flow_idle_s {
            if !(idle.is_finite() && idle >= 0.0) {
                return Err(config_error(format!(
                    "flow_idle_s must be a finite number >= 0 or null, got {idle}"
                )));
            }
        }
        Ok(ResolvedConfig {
            default_band,
            bands,
            global: self.global.clone(),
            saturation: resolved_spec(
                &self.saturation,
                registry.saturation(&self.saturation)?.params,
            ),
            ceilings: resolved_spec(&self.ceilings, registry.ceilings(&self.ceilings)?.params),
            shedding: resolved_spec(&self.shedding, registry.shedding(&self.shedding)?.params),
            preemption: preemption.clone(),
            wait_buckets_s: self.wait_buckets_s.clone(),
            flow_idle_s: self.flow_idle_s,
        })
    }
}

fn resolved_spec(spec: &PolicySpec, params: Map<String, Value>) -> PolicySpec {
    PolicySpec { kind: spec.kind.clone(), params }
}

fn check_buckets(buckets: &[f64]) -> Result<(), FlowError> {
    if buckets.is_empty() {
        return Err(config_error("wait_buckets_s must not be empty".into()));
    }
    for (i, &bound) in buckets.iter().enumerate() {
        check_positive("wait_buckets_s entries", bound)?;
        if i > 0 && bound <= buckets[i - 1] {
            return Err(config_error(format!(
                "wait_buckets_s must increase strictly, got {} after {}",
                bound,
                buckets[i - 1]
            )));
        }
    }
    Ok(())
}

fn resolve_band(
    at: &str,
    band: &BandConfig,
    registry: &PolicyRegistry,
) -> Result<BandConfig, FlowError> {
    let prefix = |e: FlowError| config_error(format!("{at}: {e}"));
    check_limit("max_requests", band.max_requests).map_err(prefix)?;
    check_limit("max_bytes", band.max_bytes).map_err(prefix)?;
    if let Some(ttl) = band.ttl_s {
        check_positive("ttl_s", ttl).map_err(prefix)?;
    }
    if let Some(ceiling) = band.ceiling {
        check_positive("ceiling", ceiling).map_err(prefix)?;
    }
    let fairness = registry.fairness(&band.fairness).map_err(prefix)?.params;
    let ordering = registry.ordering(&band.ordering).map_err(prefix)?.params;
    Ok(BandConfig {
        fairness: resolved_spec(&band.fairness, fairness),
        ordering: resolved_spec(&band.ordering, ordering),
        ..band.clone()
    })
}

/// A band override is merged key by key over the resolved default band.
fn resolve_override(
    index: usize,
    raw: &Map<String, Value>,
    default_band: &BandConfig,
    registry: &PolicyRegistry,
) -> Result<(i32, BandConfig), FlowError> {
    let at = format!("bands[{index}]");
    let priority = raw
        .get("priority")
        .and_then(Value::as_i64)
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| config_error(format!("{at}: needs an integer 'priority' (32-bit)")))?;
    let mut merged = match serde_json::to_value(default_band) {
        Ok(Value::Object(map)) => map,
        _ => return Err(config_error(format!("{at}: default band did not serialise"))),
    };
    for (key, value) in raw.iter().filter(|(key, _)| key.as_str() != "priority") {
        merged.insert(key.clone(), value.clone());
    }
    let band: BandConfig = serde_json::from_value(Value::Object(merged))
        .map_err(|e| config_error(format!("{at}: {e}")))?;
    Ok((priority, resolve_band(&at, &band, registry)?))
}

impl ResolvedConfig {
    /// The settings of the band for `priority`.
    pub fn band(&self, priority: i32) -> &BandConfig {
        self.bands.get(&priority).unwrap_or(&self.default_band)
    }

    /// The resolved configuration as JSON, in the input format (re-reads to itself).
    pub fn to_json(&self) -> String {
        self.to_value().to_string()
    }

    /// The resolved configuration as an object, in the input format.
    pub fn to_value(&self) -> Value {
        let bands: Vec<Value> = self
            .bands
            .iter()
            .map(|(priority, band)| {
                let mut map = match serde_json::to_value(band) {
                    Ok(Value::Object(map)) => map,
                    _ => Map::new(),
                };
                map.insert("priority".into(), Value::from(*priority));
                Value::Object(map)
            })
            .collect();
        let config = serde_json::json!({
            "default_band": self.default_band,
            "bands": bands,
            "global": self.global,
            "saturation": self.saturation,
            "ceilings": self.ceilings,
            "shedding": self.shedding,
            "preemption": self.preemption,
            "wait_buckets_s": self.wait_buckets_s,
            "flow_idle_s": self.flow_idle_s,
        });
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(text: &str) -> Result<ResolvedConfig, FlowError> {
        FlowConfig::from_json(text)?.resolve(&PolicyRegistry::builtin())
    }

    #[test]
    fn defaults_round_trip() {
        let resolved = resolve("{}").unwrap();
        assert_eq!(resolved.default_band.max_requests, Some(5000));
        let again = resolve(&resolved.to_json()).unwrap();
        assert_eq!(again, resolved);
    }

    #[test]
    fn band_override_merges_over_default() {
        let text = r#"{"default_band": {"ttl_s": 30}, "bands": [{"priority": -1, "max_requests": null,
            "fairness": {"type": "vtc", "w_q": 4}}]}"#;
        let resolved = resolve(text).unwrap();
        let band = resolved.band(-1);
        assert_eq!(band.max_requests, None);
        assert_eq!(band.ttl_s, Some(30.0));
        assert_eq!(band.fairness.params["w_q"], 4.0);
        assert_eq!(resolved.band(7).max_requests, Some(5000));
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let cases = [
            (r#"{"bandz": []}"#, "unknown field `bandz`"),
            (r#"{"default_band": {"ttl_s": -1}}"#, "default_band: ttl_s"),
            (r#"{"bands": [{"max_requests": 3}]}"#, "bands[0]: needs an integer 'priority'"),
            (r#"{"bands": [{"priority": 1, "colour": 3}]}"#, "unknown field `colour`"),
            (r#"{"bands": [{"priority": 1}, {"priority": 1}]}"#, "priority 1 appears twice"),
            (
                r#"{"bands": [{"priority": 1, "fairness": {"type": "x"}}]}"#,
                "bands[0]: unknown fairness",
            ),
            (r#"{"global": {"max_bytes": 0}}"#, "global.max_bytes"),
            (r#"{"wait_buckets_s": [1, 1]}"#, "increase strictly"),
            (r#"{"saturation": {"type": "utilization", "kv_threshold": 0}}"#, "kv_threshold"),
            (r#"{"preemption": {"pacing_s": -1}}"#, "pacing_s"),
            (r#"{"ceilings": {"type": "holdback", "floor": 2}}"#, "floor"),
        ];
        for (text, needle) in cases {
            let err = resolve(text).expect_err(text).to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
