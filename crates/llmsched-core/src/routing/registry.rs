//! The plugin registry: type name (llm-d's spellings) -> factory.
//!
//! A factory decodes the plugin's own parameter struct over its defaults (`#[serde(default)]`
//! on a struct whose `Default` holds the defaults: the one place they live) and rejects unknown
//! parameters. Adding a plugin is one file and one line in [`Registry::builtin`].
//!
//! Names that llm-d or the Gateway API Inference Extension used in earlier releases, or that
//! one of them uses for a plugin the other names differently, are aliases: they build the
//! plugin under its current name, and the configuration notes which name is current.

use std::sync::Arc;

use hashbrown::HashMap;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::data::DataSpec;
use super::handler::{DeciderSpec, HandlerSpec, HeadersSpec};
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
    /// A decision-tree filter whose references are resolved once every plugin is built.
    Tree(Arc<filters::decision_tree::TreeSpec>),
    /// A data producer or data-layer source ([`super::data`]).
    Data(DataSpec),
    /// The prefill-header pre-request plugin.
    Headers(HeadersSpec),
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

    /// What the plugin delivers, when it is a data-layer source.
    pub fn data_feed(&self) -> Option<super::data::Feed> {
        match self {
            Plugin::Data(d) => d.source_feed(),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Plugin::Filter(_) | Plugin::Tree(_) => "filter",
            Plugin::Scorer(_) => "scorer",
            Plugin::Picker(_) => "picker",
            Plugin::Handler(_) => "profile handler",
            Plugin::Decider(_) => "decider",
            Plugin::Data(d) if d.is_source() => "data source",
            Plugin::Data(_) => "data producer",
            Plugin::Headers(_) => "pre-request plugin",
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
    /// Alias -> current name.
    aliases: HashMap<String, String>,
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
        r.add("low-queue-filter", filters::low_queue::factory);
        r.add("least-queue-filter", filters::least_queue::factory);
        r.add("least-kv-cache-filter", filters::least_kv_cache::factory);
        r.add("lora-affinity-filter", filters::lora_affinity::factory);
        r.add("decision-tree-filter", filters::decision_tree::factory);
        // Scorers.
        r.add("queue-scorer", scorers::queue::factory);
        r.add("running-requests-scorer", scorers::running::factory);
        r.add("running-requests-size-scorer", scorers::running::factory);
        r.add("kv-cache-utilization-scorer", scorers::kv_cache::factory);
        r.add("load-aware-scorer", scorers::load_aware::factory);
        r.add("active-request-scorer", scorers::active_request::factory);
        r.add("token-load-scorer", scorers::token_load::factory);
        r.add("prefix-cache-scorer", scorers::prefix_cache::factory);
        r.add("precise-prefix-cache-scorer", scorers::precise_prefix::factory);
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
        r.add("always-disagg-pd-decider", super::handler::always_decider_factory);
        r.add("disagg-profile-handler", super::handler::disagg_factory);
        r.add("disagg-headers-handler", super::handler::headers_factory);
        // Data producers and data-layer sources.
        r.add("token-producer", super::data::tokenizer_factory);
        r.add("endpoint-notification-source", super::data::endpoint_notifications_factory);
        r.add("metrics-data-source", super::data::metrics_source_factory);
        r.add("core-metrics-extractor", super::data::metrics_extractor_factory);
        // Other and earlier names.
        r.alias("kv-cache-scorer", "kv-cache-utilization-scorer");
        r.alias("prefix-cache", "prefix-cache-scorer");
        r.alias("max-score", "max-score-picker");
        r.alias("random", "random-picker");
        r.alias("single-profile", "single-profile-handler");
        r.alias("low-queue", "low-queue-filter");
        r.alias("least-queue", "least-queue-filter");
        r.alias("least-kv-cache", "least-kv-cache-filter");
        r.alias("lora-affinity", "lora-affinity-filter");
        r.alias("decision-tree", "decision-tree-filter");
        r.alias("tokenizer", "token-producer");
        r.alias("prefill-header-handler", "disagg-headers-handler");
        r
    }

    /// Makes `alias` build what `current` builds.
    pub fn alias(&mut self, alias: &str, current: &str) {
        self.aliases.insert(alias.to_string(), current.to_string());
    }

    /// The factory for `type_name` and, when it is an alias, the current name.
    pub fn resolve(&self, type_name: &str) -> Option<(&Factory, Option<&str>)> {
        match self.aliases.get(type_name) {
            Some(current) => self.factories.get(current).map(|f| (f, Some(current.as_str()))),
            None => self.factories.get(type_name).map(|f| (f, None)),
        }
    }

    /// Registers (or replaces) a factory.
    pub fn add<F>(&mut self, type_name: &str, factory: F)
    where
        F: Fn(&Value) -> Result<Plugin, ParamError> + Send + Sync + 'static,
    {
        self.factories.insert(type_name.to_string(), Arc::new(factory));
    }

    pub fn get(&self, type_name: &str) -> Option<&Factory> {
        self.resolve(type_name).map(|(f, _)| f)
    }

    /// Registered type names and aliases, sorted.
    pub fn type_names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.factories.keys().chain(self.aliases.keys()).cloned().collect();
        names.sort();
        names
    }
}
