//! The one policy registry: a type name maps to a factory that decodes the policy's own
//! parameters over its defaults, rejects unknown ones, and returns the policy together with its
//! fully resolved parameters. Adding a policy = one `register_*` line in [`PolicyRegistry::builtin`].

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::config::PolicySpec;
use super::fairness::{
    FairnessPolicy, LasFairness, LasParams, RoundRobinFairness, StrictFairness, VtcFairness,
    VtcParams,
};
use super::ordering::{EarliestDeadline, Fcfs, OrderingPolicy, SloDeadline, SloDeadlineParams};
use super::request::FlowError;
use super::saturation::{
    CeilingPolicy, ConcurrencyDetector, ConcurrencyParams, HoldbackCeiling, HoldbackParams,
    SaturationDetector, StaticCeiling, StaticCeilingParams, UtilizationDetector, UtilizationParams,
};
use super::shedding::{
    NoShedding, ProbabilisticParams, ProbabilisticShedding, SheddingPolicy, ThresholdParams,
    ThresholdShedding,
};

/// Policy parameters as given in the config (everything but `type`).
pub type Params = Map<String, Value>;

/// A policy built from its spec, with the parameters it actually uses (defaults filled in).
pub struct Built<T: ?Sized> {
    pub policy: Box<T>,
    pub params: Params,
}

/// Builds one policy from its parameters; errors are plain messages, prefixed by the registry.
pub type Factory<T> = fn(&Params) -> Result<Built<T>, String>;

/// Decodes `params` over `T::default()`, rejecting unknown keys, and returns `T` with the
/// resolved parameters.
pub fn decode_params<T>(params: &Params) -> Result<(T, Params), String>
where
    T: DeserializeOwned + Serialize,
{
    let value: T =
        serde_json::from_value(Value::Object(params.clone())).map_err(|e| e.to_string())?;
    match serde_json::to_value(&value) {
        Ok(Value::Object(resolved)) => Ok((value, resolved)),
        _ => Err("parameters did not serialise to an object".into()),
    }
}

/// For policies without parameters: any key is unknown.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

fn no_params(params: &Params) -> Result<Params, String> {
    decode_params::<NoParams>(params).map(|(_, resolved)| resolved)
}

/// Every policy type llmsched's flow controller can be configured with.
#[derive(Clone)]
pub struct PolicyRegistry {
    fairness: BTreeMap<String, Factory<dyn FairnessPolicy>>,
    ordering: BTreeMap<String, Factory<dyn OrderingPolicy>>,
    saturation: BTreeMap<String, Factory<dyn SaturationDetector>>,
    ceilings: BTreeMap<String, Factory<dyn CeilingPolicy>>,
    shedding: BTreeMap<String, Factory<dyn SheddingPolicy>>,
}

impl std::fmt::Debug for PolicyRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyRegistry")
            .field("fairness", &self.fairness.keys().collect::<Vec<_>>())
            .field("ordering", &self.ordering.keys().collect::<Vec<_>>())
            .field("saturation", &self.saturation.keys().collect::<Vec<_>>())
            .field("ceilings", &self.ceilings.keys().collect::<Vec<_>>())
            .field("shedding", &self.shedding.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn build<T: ?Sized>(
    table: &BTreeMap<String, Factory<T>>,
    what: &str,
    spec: &PolicySpec,
) -> Result<Built<T>, FlowError> {
    let factory = table.get(spec.kind.as_str()).ok_or_else(|| {
        let known: Vec<&str> = table.keys().map(String::as_str).collect();
        FlowError::Config(format!(
            "unknown {what} type '{}' (known: {})",
            spec.kind,
            known.join(", ")
        ))
    })?;
    factory(&spec.params)
        .map_err(|message| FlowError::Config(format!("{what} '{}': {message}", spec.kind)))
}

impl PolicyRegistry {
    /// A registry with no policies (start here to offer a restricted set).
    pub fn empty() -> Self {
        PolicyRegistry {
            fairness: BTreeMap::new(),
            ordering: BTreeMap::new(),
            saturation: BTreeMap::new(),
            ceilings: BTreeMap::new(),
            shedding: BTreeMap::new(),
        }
    }

    /// Every built-in policy.
    pub fn builtin() -> Self {
        let mut r = Self::empty();
        r.register_fairness("strict", strict);
        r.register_fairness("round-robin", round_robin);
        r.register_fairness("vtc", vtc);
        r.register_fairness("las", las);
        r.register_ordering("fcfs", fcfs);
        r.register_ordering("edf", edf);
        r.register_ordering("slo-deadline", slo_deadline);
        r.register_saturation("utilization", utilization);
        r.register_saturation("concurrency", concurrency);
        r.register_ceilings("static", static_ceiling);
        r.register_ceilings("holdback", holdback);
        r.register_shedding("probabilistic", probabilistic);
        r.register_shedding("threshold", threshold);
        r.register_shedding("none", no_shedding);
        r
    }

    pub fn register_fairness(&mut self, name: &str, factory: Factory<dyn FairnessPolicy>) {
        self.fairness.insert(name.to_owned(), factory);
    }
    pub fn register_ordering(&mut self, name: &str, factory: Factory<dyn OrderingPolicy>) {
        self.ordering.insert(name.to_owned(), factory);
    }
    pub fn register_saturation(&mut self, name: &str, factory: Factory<dyn SaturationDetector>) {
        self.saturation.insert(name.to_owned(), factory);
    }
    pub fn register_ceilings(&mut self, name: &str, factory: Factory<dyn CeilingPolicy>) {
        self.ceilings.insert(name.to_owned(), factory);
    }
    pub fn register_shedding(&mut self, name: &str, factory: Factory<dyn SheddingPolicy>) {
        self.shedding.insert(name.to_owned(), factory);
    }

    pub fn fairness(&self, spec: &PolicySpec) -> Result<Built<dyn FairnessPolicy>, FlowError> {
        build(&self.fairness, "fairness policy", spec)
    }
    pub fn ordering(&self, spec: &PolicySpec) -> Result<Built<dyn OrderingPolicy>, FlowError> {
        build(&self.ordering, "ordering policy", spec)
    }
    pub fn saturation(
        &self,
        spec: &PolicySpec,
    ) -> Result<Built<dyn SaturationDetector>, FlowError> {
        build(&self.saturation, "saturation detector", spec)
    }
    pub fn ceilings(&self, spec: &PolicySpec) -> Result<Built<dyn CeilingPolicy>, FlowError> {
        build(&self.ceilings, "ceiling policy", spec)
    }
    pub fn shedding(&self, spec: &PolicySpec) -> Result<Built<dyn SheddingPolicy>, FlowError> {
        build(&self.shedding, "shedding policy", spec)
    }
}

impl Default for PolicyRegistry {
    fn default() -> Self {
        Self::builtin()
    }
}

fn strict(params: &Params) -> Result<Built<dyn FairnessPolicy>, String> {
    Ok(Built { params: no_params(params)?, policy: Box::new(StrictFairness::default()) })
}

fn round_robin(params: &Params) -> Result<Built<dyn FairnessPolicy>, String> {
    Ok(Built { params: no_params(params)?, policy: Box::new(RoundRobinFairness::default()) })
}

fn vtc(params: &Params) -> Result<Built<dyn FairnessPolicy>, String> {
    let (p, params) = decode_params::<VtcParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(VtcFairness::new(p)) })
}

fn las(params: &Params) -> Result<Built<dyn FairnessPolicy>, String> {
    let (p, params) = decode_params::<LasParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(LasFairness::new(p)) })
}

fn fcfs(params: &Params) -> Result<Built<dyn OrderingPolicy>, String> {
    Ok(Built { params: no_params(params)?, policy: Box::new(Fcfs) })
}

fn edf(params: &Params) -> Result<Built<dyn OrderingPolicy>, String> {
    Ok(Built { params: no_params(params)?, policy: Box::new(EarliestDeadline) })
}

fn slo_deadline(params: &Params) -> Result<Built<dyn OrderingPolicy>, String> {
    let (p, params) = decode_params::<SloDeadlineParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(SloDeadline { params: p }) })
}

fn utilization(params: &Params) -> Result<Built<dyn SaturationDetector>, String> {
    let (p, params) = decode_params::<UtilizationParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(UtilizationDetector::new(p)) })
}

fn concurrency(params: &Params) -> Result<Built<dyn SaturationDetector>, String> {
    let (p, params) = decode_params::<ConcurrencyParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(ConcurrencyDetector { params: p }) })
}

fn static_ceiling(params: &Params) -> Result<Built<dyn CeilingPolicy>, String> {
    let (p, params) = decode_params::<StaticCeilingParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(StaticCeiling { params: p }) })
}

fn holdback(params: &Params) -> Result<Built<dyn CeilingPolicy>, String> {
    let (p, params) = decode_params::<HoldbackParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(HoldbackCeiling { params: p }) })
}

fn probabilistic(params: &Params) -> Result<Built<dyn SheddingPolicy>, String> {
    let (p, params) = decode_params::<ProbabilisticParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(ProbabilisticShedding::new(p)) })
}

fn threshold(params: &Params) -> Result<Built<dyn SheddingPolicy>, String> {
    let (p, params) = decode_params::<ThresholdParams>(params)?;
    p.validate()?;
    Ok(Built { params, policy: Box::new(ThresholdShedding { params: p }) })
}

fn no_shedding(params: &Params) -> Result<Built<dyn SheddingPolicy>, String> {
    Ok(Built { params: no_params(params)?, policy: Box::new(NoShedding) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: Value) -> PolicySpec {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn fills_defaults_and_rejects_unknown() {
        let r = PolicyRegistry::builtin();
        let built = r.fairness(&spec(json!({"type": "vtc", "w_q": 3.0}))).unwrap();
        assert_eq!(Value::Object(built.params), json!({"w_p": 1.0, "w_q": 3.0, "weights": {}}));
        let err = r.fairness(&spec(json!({"type": "vtc", "wq": 3.0}))).err().unwrap();
        assert!(err.to_string().contains("unknown field `wq`"), "{err}");
        let err = r.fairness(&spec(json!({"type": "fair"}))).err().unwrap();
        assert!(err.to_string().contains("unknown fairness policy type 'fair'"), "{err}");
        assert!(err.to_string().contains("round-robin"), "{err}");
        let err = r.ordering(&spec(json!({"type": "fcfs", "x": 1}))).err().unwrap();
        assert!(err.to_string().contains("unknown field `x`"), "{err}");
        let err = r.saturation(&spec(json!({"type": "concurrency"}))).err().unwrap();
        assert!(err.to_string().contains("max_requests or max_tokens"), "{err}");
        let err = r.shedding(&spec(json!({"type": "probabilistic", "power": -1}))).err().unwrap();
        assert!(err.to_string().contains("power"), "{err}");
    }
}
