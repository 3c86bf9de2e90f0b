//! The plugin registry: type name (llm-d's spellings) -> factory.
//!
//! A factory decodes the plugin's own parameter struct over its defaults (`#[serde(default)]`
//! on a struct whose `Default` holds the defaults: the one place they live) and rejects unknown
//! parameters. Adding a plugin is one file and one line in [`Registry::builtin`].
//!
//! Names that llm-d or the Gateway API Inference Extension used in earlier releases, or that
//! one of them uses for a plugin the other names differently, are aliases: they build the
//! plugin under its current name, and the configuration notes which name is current.
//!
//! Every type also carries a [`PluginDoc`] (what it is, its parameters with their defaults and
//! ranges), kept in the plugin's own file beside its parameter struct; the defaults are that
//! struct's `Default`, serialized, so they are never written twice. [`Registry::catalogue`]
//! lists them all (the documentation's plugin catalogue is generated from it), and the tests
//! below check each entry against what the factory accepts and refuses.

use std::sync::Arc;

use hashbrown::HashMap;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

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

/// The kind of value a parameter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    Integer,
    Number,
    String,
    Boolean,
    Mapping,
    List,
    /// A Python callable (the bindings' `python-scorer` / `python-filter`).
    Callable,
}

impl ParamKind {
    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Integer => "integer",
            ParamKind::Number => "number",
            ParamKind::String => "string",
            ParamKind::Boolean => "boolean",
            ParamKind::Mapping => "mapping",
            ParamKind::List => "list",
            ParamKind::Callable => "callable",
        }
    }
}

/// One parameter of a plugin, as the catalogue shows it. `name` may be a dotted path into a
/// nested mapping (`tokenProcessorConfig.blockSize`). `min` / `max` are the inclusive bounds the
/// factory enforces (an integer is at least 0 unless `min` says more); `choices` the accepted
/// strings, when the set is closed.
#[derive(Debug, Clone, Copy)]
pub struct ParamDoc {
    pub name: &'static str,
    pub kind: ParamKind,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub choices: &'static [&'static str],
    pub required: bool,
    pub doc: &'static str,
}

impl ParamDoc {
    pub const fn new(name: &'static str, kind: ParamKind, doc: &'static str) -> Self {
        ParamDoc { name, kind, min: None, max: None, choices: &[], required: false, doc }
    }

    /// A non-negative integer.
    pub const fn int(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::Integer, doc).min(0.0)
    }

    pub const fn number(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::Number, doc)
    }

    pub const fn string(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::String, doc)
    }

    pub const fn boolean(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::Boolean, doc)
    }

    pub const fn mapping(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::Mapping, doc)
    }

    pub const fn list(name: &'static str, doc: &'static str) -> Self {
        ParamDoc::new(name, ParamKind::List, doc)
    }

    pub const fn min(mut self, value: f64) -> Self {
        self.min = Some(value);
        self
    }

    pub const fn max(mut self, value: f64) -> Self {
        self.max = Some(value);
        self
    }

    pub const fn choices(mut self, values: &'static [&'static str]) -> Self {
        self.choices = values;
        self
    }

    pub const fn required(mut self) -> Self {
        self.required = true;
        self
    }
}

/// What a plugin type is, for the catalogue: its kind (`filter`, `scorer`, `picker`,
/// `profile handler`, `decider`), one line on what it does, its parameters and their defaults
/// (the parameter struct's `Default`, serialized; `null` where absence has the meaning the
/// parameter's doc gives).
#[derive(Debug, Clone)]
pub struct PluginDoc {
    pub kind: &'static str,
    pub summary: &'static str,
    pub params: &'static [ParamDoc],
    pub defaults: Value,
}

impl PluginDoc {
    pub fn new(
        kind: &'static str,
        summary: &'static str,
        params: &'static [ParamDoc],
        defaults: Value,
    ) -> PluginDoc {
        PluginDoc { kind, summary, params, defaults }
    }

    /// The default of a (possibly dotted) parameter; `null` when it has none.
    pub fn default_of(&self, name: &str) -> Value {
        let mut v = &self.defaults;
        for part in name.split('.') {
            match v.get(part) {
                Some(next) => v = next,
                None => return Value::Null,
            }
        }
        v.clone()
    }
}

/// `P::default()` as plain data: the defaults a factory decodes parameters over.
pub fn defaults_of<P: Serialize + Default>() -> Value {
    serde_json::to_value(P::default()).unwrap_or(Value::Null)
}

/// Builds a plugin's doc: `fn doc() -> PluginDoc`, kept in the plugin's file.
pub type DocFn = fn() -> PluginDoc;

pub type Factory = Arc<dyn Fn(&Value) -> Result<Plugin, ParamError> + Send + Sync>;

/// Type names to factories.
#[derive(Clone, Default)]
pub struct Registry {
    factories: HashMap<String, Factory>,
    /// Alias -> current name.
    aliases: HashMap<String, String>,
    /// Type name -> its catalogue entry.
    docs: HashMap<String, DocFn>,
}

impl Registry {
    /// Every built-in plugin, under llm-d's type names (and a few older aliases).
    pub fn builtin() -> Registry {
        let mut r = Registry::default();
        // Filters.
        r.add_documented("decode-filter", filters::role::decode_factory, filters::role::decode_doc);
        r.add_documented(
            "prefill-filter",
            filters::role::prefill_factory,
            filters::role::prefill_doc,
        );
        r.add_documented(
            "by-label",
            filters::label::by_label_factory,
            filters::label::by_label_doc,
        );
        r.add_documented(
            "label-selector-filter",
            filters::label::selector_factory,
            filters::label::selector_doc,
        );
        r.add_documented(
            "utilization-filter",
            filters::utilization::factory,
            filters::utilization::doc,
        );
        r.add_documented(
            "utilization-detector",
            filters::utilization::detector_factory,
            filters::utilization::detector_doc,
        );
        r.add_documented(
            "prefix-cache-affinity-filter",
            filters::prefix_affinity::factory,
            filters::prefix_affinity::doc,
        );
        r.add_documented(
            "session-affinity-filter",
            filters::session::factory,
            filters::session::doc,
        );
        r.add_documented("lora-availability-filter", filters::lora::factory, filters::lora::doc);
        r.add_documented("low-queue-filter", filters::low_queue::factory, filters::low_queue::doc);
        r.add_documented(
            "least-queue-filter",
            filters::least_queue::factory,
            filters::least_queue::doc,
        );
        r.add_documented(
            "least-kv-cache-filter",
            filters::least_kv_cache::factory,
            filters::least_kv_cache::doc,
        );
        r.add_documented(
            "lora-affinity-filter",
            filters::lora_affinity::factory,
            filters::lora_affinity::doc,
        );
        r.add_documented(
            "decision-tree-filter",
            filters::decision_tree::factory,
            filters::decision_tree::doc,
        );
        // Scorers.
        r.add_documented("queue-scorer", scorers::queue::factory, scorers::queue::doc);
        r.add_documented(
            "running-requests-scorer",
            scorers::running::factory,
            scorers::running::doc,
        );
        r.add_documented(
            "running-requests-size-scorer",
            scorers::running::factory,
            scorers::running::doc,
        );
        r.add_documented(
            "kv-cache-utilization-scorer",
            scorers::kv_cache::factory,
            scorers::kv_cache::doc,
        );
        r.add_documented(
            "load-aware-scorer",
            scorers::load_aware::factory,
            scorers::load_aware::doc,
        );
        r.add_documented(
            "active-request-scorer",
            scorers::active_request::factory,
            scorers::active_request::doc,
        );
        r.add_documented(
            "token-load-scorer",
            scorers::token_load::factory,
            scorers::token_load::doc,
        );
        r.add_documented(
            "prefix-cache-scorer",
            scorers::prefix_cache::factory,
            scorers::prefix_cache::doc,
        );
        r.add_documented(
            "precise-prefix-cache-scorer",
            scorers::precise_prefix::factory,
            scorers::precise_prefix::doc,
        );
        r.add_documented(
            "no-hit-lru-scorer",
            scorers::no_hit_lru::factory,
            scorers::no_hit_lru::doc,
        );
        r.add_documented(
            "session-affinity-scorer",
            scorers::session_affinity::factory,
            scorers::session_affinity::doc,
        );
        r.add_documented(
            "lora-affinity-scorer",
            scorers::lora_affinity::factory,
            scorers::lora_affinity::doc,
        );
        // Pickers.
        r.add_documented("max-score-picker", pickers::max_score::factory, pickers::max_score::doc);
        r.add_documented("random-picker", pickers::random::factory, pickers::random::doc);
        r.add_documented(
            "weighted-random-picker",
            pickers::weighted_random::factory,
            pickers::weighted_random::doc,
        );
        r.add_documented(
            "softmax-cost-picker",
            pickers::softmax_cost::factory,
            pickers::softmax_cost::doc,
        );
        r.add_documented(
            "power-of-two-picker",
            pickers::power_of_two::factory,
            pickers::power_of_two::doc,
        );
        r.add_documented(
            "round-robin-picker",
            pickers::round_robin::factory,
            pickers::round_robin::doc,
        );
        r.add_documented(
            "cache-aware-picker",
            pickers::cache_aware::factory,
            pickers::cache_aware::doc,
        );
        // Profile handlers and P/D deciders.
        r.add_documented(
            "single-profile-handler",
            super::handler::single_factory,
            super::handler::single_doc,
        );
        r.add_documented("pd-profile-handler", super::handler::pd_factory, super::handler::pd_doc);
        r.add_documented(
            "prefix-based-pd-decider",
            super::handler::prefix_decider_factory,
            super::handler::prefix_decider_doc,
        );
        r.add_documented(
            "load-aware-pd-decider",
            super::handler::load_aware_decider_factory,
            super::handler::load_aware_decider_doc,
        );
        r.add_documented(
            "always-disagg-pd-decider",
            super::handler::always_decider_factory,
            super::handler::always_decider_doc,
        );
        r.add_documented(
            "disagg-profile-handler",
            super::handler::disagg_factory,
            super::handler::disagg_doc,
        );
        r.add_documented(
            "disagg-headers-handler",
            super::handler::headers_factory,
            super::handler::headers_doc,
        );
        // Data producers and data-layer sources.
        r.add_documented(
            "token-producer",
            super::data::tokenizer_factory,
            super::data::tokenizer_doc,
        );
        r.add_documented(
            "endpoint-notification-source",
            super::data::endpoint_notifications_factory,
            super::data::endpoint_notifications_doc,
        );
        r.add_documented(
            "metrics-data-source",
            super::data::metrics_source_factory,
            super::data::metrics_source_doc,
        );
        r.add_documented(
            "core-metrics-extractor",
            super::data::metrics_extractor_factory,
            super::data::metrics_extractor_doc,
        );
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
        // llm-d's earlier name of its label-selector-filter (filter/bylabel/selector.go).
        r.alias("by-label-selector", "label-selector-filter");
        r
    }

    /// Attaches the catalogue entry of `type_name`.
    pub fn document(&mut self, type_name: &str, doc: DocFn) {
        self.docs.insert(type_name.to_string(), doc);
    }

    /// The catalogue entry of a type or alias.
    pub fn doc(&self, type_name: &str) -> Option<PluginDoc> {
        let name = self.aliases.get(type_name).map_or(type_name, String::as_str);
        self.docs.get(name).map(|doc| doc())
    }

    /// Every registered type and alias, sorted by name, as plain data: `type`, `kind`,
    /// `alias_of` (the current name, or null), `summary` and `params` (each `name`, `type`,
    /// `default`, `min`, `max`, `choices`, `required`, `doc`). A type registered without a
    /// doc is listed with kind `"undocumented"` (a test keeps the built-in ones documented).
    pub fn catalogue(&self) -> Value {
        let entries: Vec<Value> = self
            .type_names()
            .iter()
            .map(|name| {
                let alias_of = self.aliases.get(name);
                let Some(doc) = self.doc(name) else {
                    return json!({"type": name, "kind": "undocumented", "alias_of": alias_of,
                                  "summary": "", "params": []});
                };
                let params: Vec<Value> = doc
                    .params
                    .iter()
                    .map(|p| {
                        json!({
                            "name": p.name,
                            "type": p.kind.name(),
                            "default": if p.required { Value::Null } else { doc.default_of(p.name) },
                            "min": p.min,
                            "max": p.max,
                            "choices": p.choices,
                            "required": p.required,
                            "doc": p.doc,
                        })
                    })
                    .collect();
                json!({"type": name, "kind": doc.kind, "alias_of": alias_of,
                       "summary": doc.summary, "params": params})
            })
            .collect();
        Value::Array(entries)
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

    /// Registers (or replaces) a factory and its catalogue entry.
    pub fn add_documented<F>(&mut self, type_name: &str, factory: F, doc: DocFn)
    where
        F: Fn(&Value) -> Result<Plugin, ParamError> + Send + Sync + 'static,
    {
        self.add(type_name, factory);
        self.document(type_name, doc);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid value for a required parameter.
    fn sample(p: &ParamDoc) -> Value {
        match p.kind {
            ParamKind::Mapping => json!({"pluginRef": "some-filter"}),
            ParamKind::List => json!([]),
            ParamKind::Integer => json!(1),
            ParamKind::Number => json!(0.5),
            ParamKind::Boolean => json!(true),
            ParamKind::String | ParamKind::Callable => json!("x"),
        }
    }

    /// `base` with `value` at the (possibly dotted) `name`.
    fn with(base: &Value, name: &str, value: Value) -> Value {
        let mut out = base.clone();
        let mut slot = &mut out;
        for part in name.split('.') {
            if !slot.is_object() {
                *slot = json!({});
            }
            slot = slot.as_object_mut().unwrap().entry(part.to_string()).or_insert(Value::Null);
        }
        *slot = value;
        out
    }

    /// The field names an unknown-field error says are accepted (serde's message, or the
    /// decision tree's own).
    fn accepted(err: &ParamError) -> Vec<String> {
        if err.message.contains("there are no fields") {
            return vec![];
        }
        let tail = err.message.split_once("expected").map_or("", |(_, t)| t);
        let quote = if tail.contains('`') { '`' } else { '"' };
        let mut names: Vec<String> =
            tail.split(quote).skip(1).step_by(2).map(String::from).collect();
        names.sort();
        names
    }

    fn documented_fields(doc: &PluginDoc, parent: Option<&str>) -> Vec<String> {
        let mut names: Vec<String> = doc
            .params
            .iter()
            .filter_map(|p| match (parent, p.name.split_once('.')) {
                (None, None) => Some(p.name.to_string()),
                (None, Some((head, _))) => Some(head.to_string()),
                (Some(want), Some((head, rest))) if head == want => Some(rest.to_string()),
                _ => None,
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    #[test]
    fn every_type_is_documented_and_every_doc_registered() {
        let r = Registry::builtin();
        for name in r.factories.keys() {
            assert!(r.docs.contains_key(name), "{name}: registered without a PluginDoc");
        }
        for name in r.docs.keys() {
            assert!(r.factories.contains_key(name), "{name}: documented but not registered");
        }
        let catalogue = r.catalogue();
        let entries = catalogue.as_array().unwrap();
        assert_eq!(entries.len(), r.type_names().len());
        for e in entries {
            assert_ne!(e["kind"], "undocumented", "{e}");
            assert!(!e["summary"].as_str().unwrap().is_empty(), "{e}");
        }
        let alias = entries.iter().find(|e| e["type"] == "kv-cache-scorer").unwrap();
        assert_eq!(alias["alias_of"], "kv-cache-utilization-scorer");
        assert_eq!(alias["kind"], "scorer");
    }

    #[test]
    fn docs_match_what_each_factory_accepts_and_refuses() {
        let r = Registry::builtin();
        let mut names: Vec<&String> = r.factories.keys().collect();
        names.sort();
        for name in names {
            let factory = r.get(name).unwrap();
            let doc = r.doc(name).unwrap();
            let mut base = json!({});
            for p in doc.params.iter().filter(|p| p.required) {
                base = with(&base, p.name, sample(p));
            }
            let built = factory(&base).unwrap_or_else(|e| panic!("{name} {base}: {e:?}"));
            assert_eq!(built.kind(), doc.kind, "{name}");
            if !doc.params.iter().any(|p| p.required) {
                assert!(factory(&Value::Null).is_ok(), "{name}: refuses no parameters");
            }

            // The documented names are exactly the accepted ones, nested mappings included.
            let err = factory(&with(&base, "zzUnknown", json!(1))).err();
            let err = err.unwrap_or_else(|| panic!("{name}: accepts an unknown parameter"));
            assert_eq!(accepted(&err), documented_fields(&doc, None), "{name}: {err:?}");
            let mut parents: Vec<&str> =
                doc.params.iter().filter_map(|p| p.name.split_once('.').map(|x| x.0)).collect();
            parents.dedup();
            for parent in parents {
                let err = factory(&with(&base, &format!("{parent}.zzUnknown"), json!(1))).err();
                let err = err.unwrap_or_else(|| panic!("{name}.{parent}: accepts an unknown key"));
                assert_eq!(accepted(&err), documented_fields(&doc, Some(parent)), "{name}");
            }

            for p in doc.params {
                let at = |v: Value| factory(&with(&base, p.name, v));
                let default = doc.default_of(p.name);
                if !default.is_null() && !p.required {
                    assert!(at(default.clone()).is_ok(), "{name}.{}: default {default}", p.name);
                }
                let refused = |v: Value, what: &str| {
                    let e = at(v.clone()).err();
                    let e = e.unwrap_or_else(|| panic!("{name}.{}: {what} {v} accepted", p.name));
                    assert!(e.path.starts_with(p.name), "{name}.{}: {e:?}", p.name);
                };
                let int = p.kind == ParamKind::Integer;
                let num = |x: f64| if int { json!(x as i64) } else { json!(x) };
                let step = if int { 1.0 } else { 1e-3 };
                if let Some(lo) = p.min {
                    assert!(at(num(lo)).is_ok(), "{name}.{}: minimum {lo} refused", p.name);
                    refused(num(lo - step), "below the minimum:");
                }
                if let Some(hi) = p.max {
                    assert!(at(num(hi)).is_ok(), "{name}.{}: maximum {hi} refused", p.name);
                    refused(num(hi + step), "above the maximum:");
                }
                for choice in p.choices {
                    assert!(at(json!(choice)).is_ok(), "{name}.{}: {choice} refused", p.name);
                }
                if !p.choices.is_empty() {
                    refused(json!("zz-not-a-choice"), "a value outside the choices:");
                }
                match p.kind {
                    ParamKind::Integer | ParamKind::Number | ParamKind::Boolean => {
                        refused(json!("text"), "a string for a non-string:");
                    }
                    _ => {}
                }
            }
        }
    }
}
