//! The plugin registry: type name (llm-d's spellings) -> factory.
//!
//! A factory decodes the plugin's own parameter struct over its defaults (`#[serde(default)]`
//! on a struct whose `Default` holds the defaults: the one place they live) and rejects unknown
//! parameters. Adding a plugin is one file and one line in [`Registry::builtin`].

use std::sync::Arc;

use hashbrown::HashMap;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::handler::{DeciderSpec, HandlerSpec};
use super::plugin::{Filter, Picker, Scorer};
use super::{filters, pickers, scorers};

/// A built plugin instance.
#[derive(Clone)]
pub enum Plugin {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
    Handler(HandlerSpec),
    Decider(DeciderSpec),
}

impl Plugin {
    pub fn filter(f: impl Filter + 'static) -> Plugin {
        Plugin::Filter(Arc::new(f))
    }

    pub fn scorer(s: impl Scorer + 'static) -> Plugin {
        Plugin::Scorer(Arc::new(s))
    }

    pub fn picker(p: impl Picker + 'static) -> Plugin {
        Plugin::Picker(Arc::new(p))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Plugin::Filter(_) => "filter",
            Plugin::Scorer(_) => "scorer",
            Plugin::Picker(_) => "picker",
            Plugin::Handler(_) => "profile handler",
            Plugin::Decider(_) => "decider",
        }
    }
}

/// A parameter problem: `path` is relative to the plugin's `parameters` ("" for the whole).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamError {
    pub path: String,
    pub message: String,
}

impl ParamError {
    pub fn new(path: &str, message: impl Into<String>) -> Self {
        ParamError { path: path.to_string(), message: message.into() }
    }
}

/// Decodes `params` (null or absent: all defaults) into `P`, naming the offending field.
pub fn decode<P: DeserializeOwned + Default>(params: &Value) -> Result<P, ParamError> {
    if params.is_null() {
        return Ok(P::default());
    }
    serde_path_to_error::deserialize(params).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        ParamError { path, message: e.into_inner().to_string() }
    })
}

/// Checks that a number lies in a range, naming the field.
pub fn check_range(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), ParamError> {
    if value.is_finite() && value >= lo && value <= hi {
        Ok(())
    } else {
        Err(ParamError::new(field, format!("must be between {lo} and {hi}, got {value}")))
    }
}

pub type Factory = Arc<dyn Fn(&Value) -> Result<Plugin, ParamError> + Send + Sync>;

/// Type names to factories.
#[derive(Clone, Default)]
pub struct Registry {
    factories: HashMap<String, Factory>,
}

impl Registry {
    /// Every built-in plugin, under llm-d's type names (and a few older aliases).
    pub fn builtin() -> Registry {
        let mut r = Registry::default();
        // Filters.
        r.add("decode-filter", filters::role::decode_factory);
        r.add("prefill-filter", filters::role::prefill_factory);
        r.add("by-label", filters::label::by_label_factory);
        r.add("by-label-selector", filters::label::selector_factory);
        r.add("utilization-filter", filters::utilization::factory);
        r.add("prefix-cache-affinity-filter", filters::prefix_affinity::factory);
        r.add("session-affinity-filter", filters::session::factory);
        r.add("lora-availability-filter", filters::lora::factory);
        // Scorers.
        r.add("queue-scorer", scorers::queue::factory);
        r.add("running-requests-scorer", scorers::running::factory);
        r.add("running-requests-size-scorer", scorers::running::factory);
        r.add("kv-cache-utilization-scorer", scorers::kv_cache::factory);
        r.add("load-aware-scorer", scorers::load_aware::factory);
        r.add("active-request-scorer", scorers::active_request::factory);
        r.add("token-load-scorer", scorers::token_load::factory);
        r.add("prefix-cache-scorer", scorers::prefix_cache::factory);
        r.add("no-hit-lru-scorer", scorers::no_hit_lru::factory);
        r.add("session-affinity-scorer", scorers::session_affinity::factory);
        r.add("lora-affinity-scorer", scorers::lora_affinity::factory);
        // Pickers.
        r.add("max-score-picker", pickers::max_score::factory);
        r.add("random-picker", pickers::random::factory);
        r.add("weighted-random-picker", pickers::weighted_random::factory);
        r.add("softmax-cost-picker", pickers::softmax_cost::factory);
        r.add("power-of-two-picker", pickers::power_of_two::factory);
        r.add("round-robin-picker", pickers::round_robin::factory);
        r.add("cache-aware-picker", pickers::cache_aware::factory);
        // Profile handlers and P/D deciders.
        r.add("single-profile-handler", super::handler::single_factory);
        r.add("pd-profile-handler", super::handler::pd_factory);
        r.add("prefix-based-pd-decider", super::handler::prefix_decider_factory);
        r.add("load-aware-pd-decider", super::handler::load_aware_decider_factory);
        r
    }

    /// Registers (or replaces) a factory.
    pub fn add<F>(&mut self, type_name: &str, factory: F)
    where
        F: Fn(&Value) -> Result<Plugin, ParamError> + Send + Sync + 'static,
    {
        self.factories.insert(type_name.to_string(), Arc::new(factory));
    }

    pub fn get(&self, type_name: &str) -> Option<&Factory> {
        self.factories.get(type_name)
    }

    /// Registered type names, sorted.
    pub fn type_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.factories.keys().cloned().collect();
        names.sort();
        names
    }
}
