//! Configuration in the shape of llm-d's `EndpointPickerConfig`:
//!
//! ```yaml
//! plugins:                       # plugin instances
//! - type: prefix-cache-scorer    # a registered type name
//!   name: prefix                 # optional, defaults to the type
//!   parameters: {}               # optional, decoded over the plugin's defaults
//! schedulingProfiles:
//! - name: default
//!   plugins:
//!   - pluginRef: prefix          # filters, scorers (with a weight, default 1) and one picker
//!     weight: 3
//! ```
//!
//! A profile handler is one of the plugins; without one, a single profile runs. A profile with
//! no picker gets the first declared picker (llm-d: any declared one), else a
//! `max-score-picker`. Without `schedulingProfiles` (or with an empty
//! list) the Inference Extension's default applies: one profile, `default`, running every
//! filter, scorer (weight 1) and picker in the order the plugins are declared. Every error
//! names the offending key (`plugins[2].parameters.threshold`).
//!
//! Sections of the file that configure other components are read for the caller, which wires
//! them ([`RouterConfig::saturation`], [`RouterConfig::flow_control`]); sections llmsched has no
//! counterpart for are refused by name, with what to use instead. Names of earlier releases and
//! settings accepted without effect are listed in [`RouterConfig::notes`], which the caller
//! shows once (Python logs them through the `llmsched` logger).

use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use serde_json::{Map, Value};
use thiserror::Error;

use super::data::{parse_data_layer, DataLayer, DataSpec, Feed, RefKind};
use super::filters::decision_tree::{DecisionTreeFilter, TreeSpec};
use super::handler::{DeciderRef, DeciderSpec, Handler, HandlerSpec, PREFILL_HEADER};
use super::plugin::{Filter, IndexHints, Scorer};
use super::profile::{NamedFilter, Profile, WeightedScorer};
use super::registry::ParamError;
use super::registry::{Plugin, Registry};
use super::scorers::precise_prefix::PreciseSpec;

/// A configuration problem, naming the key where it is.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { key: key.into(), message: message.into() }
    }
}

/// Something accepted that the user should know about: an older name, a setting without effect.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigNote {
    pub key: String,
    pub message: String,
}

/// The Inference Extension's `saturationDetector` thresholds, for flow control. Unset fields
/// keep flow control's own defaults (the Extension's: 5 waiting requests, 0.8 KV-cache use,
/// 200 ms).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SaturationSpec {
    pub queue_depth_threshold: Option<u64>,
    pub kv_cache_util_threshold: Option<f64>,
    pub metrics_staleness_s: Option<f64>,
}

/// Feature gates llmsched knows: (name, what it does here, whether it has an effect).
pub const FEATURE_GATES: &[(&str, &str, bool)] = &[
    ("flowControl", "turns flow control on (llm-d's defaults, with saturationDetector)", true),
    (
        "prepareDataPlugins",
        "has no effect: the router prepares what its plugins read (tokens, prefix match, \
         metrics) for every request",
        false,
    ),
    (
        "dataLayer",
        "has no effect: endpoint metrics come from the gateway's scraper or EndpointPool.update",
        false,
    ),
    (
        "enableLegacyMetrics",
        "has no effect: endpoint metrics come from the gateway's scraper or EndpointPool.update \
         (llm-d's legacy polling path and its data layer read the same engine metrics)",
        false,
    ),
];

/// The `apiVersion` values llm-d's loader registers for `EndpointPickerConfig`: its own, and
/// the Inference Extension's (deprecated there, still read).
pub const API_VERSIONS: &[&str] = &["llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"];

/// The request parser llm-d's `parser` section may name: the gateway parses OpenAI completions
/// and chat completions itself, as this plugin does.
const OPENAI_PARSER: &str = "openai-parser";

/// The `openai-parser` plugins declared: name and key (`plugins[i]`), kept out of the plugin
/// instances (no decision reads them).
type Parsers = Vec<(String, String)>;

/// What `plugins` declares: each instance's index by name, the instances, the parsers.
type ParsedPlugins = (HashMap<String, usize>, Vec<Instance>, Parsers);

/// A parsed configuration, ready for a router.
pub struct RouterConfig {
    pub profiles: Vec<Profile>,
    pub handler: Handler,
    /// Every scorer instance once, for commit hooks.
    pub scorers: Vec<Arc<dyn Scorer>>,
    /// What the scorers ask of the prefix index, with the key that asked for a block size.
    pub index_hints: IndexHints,
    pub block_size_key: Option<String>,
    /// Each `maxPrefixTokensToMatch` with its key: a cap below one block of the index would
    /// make its scorer give every endpoint 0 ([`Router::new`](super::Router::new) refuses it).
    pub token_caps: Vec<(String, u64)>,
    /// Older names read under their current ones, settings accepted without effect.
    pub notes: Vec<ConfigNote>,
    /// The precise prefix scorer's wiring, with the key of the plugin that asked for it.
    pub precise: Option<(String, PreciseSpec)>,
    /// `saturationDetector`, for flow control.
    pub saturation: Option<SaturationSpec>,
    /// `featureGates: [flowControl]`.
    pub flow_control: bool,
    /// A `token-producer` (or `tokenizer`) plugin: its key and the model whose tokenizer it names.
    pub tokenizer: Option<(String, String)>,
    /// The `dataLayer` (or `data`) section.
    pub data_layer: Option<DataLayer>,
    /// The prefill header llm-d sets (`disagg-headers-handler`, or `disagg-profile-handler`
    /// with a prefill decider), with the key of the plugin that asks for it.
    pub prefill_header: Option<(String, &'static str)>,
    /// Whether the profiles came from the Inference Extension's implicit default.
    pub default_profile: bool,
    /// A `metrics-data-source`: its key and the metrics path it polls.
    pub metrics_source: Option<(String, String)>,
}

impl RouterConfig {
    pub fn profile_index(&self, name: &str) -> Option<usize> {
        self.profiles.iter().position(|p| p.name == name)
    }

    /// Whether a decision reads the endpoints' tree sizes in the prefix index (some picker's
    /// [`Picker::reads_tree_size`](super::plugin::Picker::reads_tree_size)), not only matches.
    pub fn reads_tree_size(&self) -> bool {
        self.profiles.iter().any(|p| p.picker.reads_tree_size())
    }

    /// Whether a profile's filter or scorer reads the session's endpoint
    /// (`session-affinity-scorer`, `session-affinity-filter`): llm-d then answers each request
    /// with the serving endpoint's session token (`x-session-token`), and so does the gateway.
    pub fn reads_session(&self) -> bool {
        self.profiles.iter().any(|p| {
            p.filters.iter().any(|f| f.filter.reads_session())
                || p.scorers.iter().any(|s| s.scorer.reads_session())
        })
    }

    /// Whether a decision may take long or wait on a lock: some profile's filter or scorer
    /// [`may_block`](super::plugin::Filter::may_block) (a Python callable). A server decides
    /// for such a router off the threads that serve its connections.
    pub fn may_block(&self) -> bool {
        self.scorers.iter().any(|s| s.may_block())
            || self.profiles.iter().any(|p| {
                p.filters.iter().any(|f| f.filter.may_block())
                    || p.scorers.iter().any(|s| s.scorer.may_block())
            })
    }

    /// Whether a decision reads what the prefix index says of the prompt: a P/D handler (its
    /// decider weighs the uncached tokens) or any filter, scorer or picker of a profile
    /// ([`Scorer::reads_prefix_match`]). When none does (round-robin, random, least-load), the
    /// prompt's block hashes change no decision.
    pub fn reads_prefix_match(&self) -> bool {
        matches!(self.handler, Handler::Pd { .. })
            || self.scorers.iter().any(|s| s.reads_prefix_match())
            || self.profiles.iter().any(|p| {
                p.picker.reads_prefix_match()
                    || p.filters.iter().any(|f| f.filter.reads_prefix_match())
                    || p.scorers.iter().any(|s| s.scorer.reads_prefix_match())
            })
    }
}

const TOP_LEVEL: &[&str] = &[
    "apiVersion",
    "kind",
    "plugins",
    "schedulingProfiles",
    "featureGates",
    "saturationDetector",
    "dataLayer",
    "data",
    "parser",
];

/// Sections of the peers' file with no counterpart here, and what to use instead.
const REFUSED: &[(&str, &str)] = &[(
    "flowControl",
    "is not read here: configure flow control in the gateway's `flow` section (or \
         FlowController); `featureGates: [flowControl]` turns it on with llm-d's defaults",
)];

/// Plugin types of llm-d or the Inference Extension with no counterpart here, and why.
const REFUSED_TYPES: &[(&str, &str)] = &[
    (
        "k8s-notification-source",
        "is not supported: the router watches no Kubernetes objects; engines come from the \
         gateway's `engines`, its discovery file or its `discovery.kubernetes` section (the \
         Ready pods of a label selector)",
    ),
    (
        "encode-filter",
        "is not supported: encode disaggregation (multimodal encoder endpoints) is not; the \
         decode and prefill stages are (decode-filter, prefill-filter)",
    ),
    (
        "always-disagg-multimodal-decider",
        "is not supported: encode disaggregation (multimodal encoder endpoints) is not; the \
         decode and prefill stages are",
    ),
    (
        "probabilistic-admitter",
        "is not supported: admission is the gateway's flow control (its `flow` section, or \
         `featureGates: [flowControl]` with the saturation thresholds)",
    ),
    (
        "concurrency-detector",
        "is not supported: the saturation detector is a utilization-detector (waiting requests \
         and KV-cache use)",
    ),
    (
        "passthrough-parser",
        "is not supported: the gateway parses OpenAI completions and chat completions \
         (llm-d's openai-parser)",
    ),
    (
        "vllmgrpc-parser",
        "is not supported: the gateway speaks OpenAI's HTTP API to the engines, not vLLM's gRPC",
    ),
    (
        "data-parallel-profile-handler",
        "is not supported: a data-parallel engine is one endpoint per rank here (list each \
         rank's port as an engine) with the single-profile-handler",
    ),
    (
        "request-attribute-reporter",
        "is not supported: it sets Envoy dynamic metadata from the response, and the gateway \
         is no Envoy external processor (it counts the response's tokens itself, in flow \
         control and its metrics)",
    ),
    (
        "latency-scorer",
        "is not supported: latency prediction (llm-d's latency-predictor sidecar) is not; \
         score load with queue-scorer, kv-cache-utilization-scorer or load-aware-scorer",
    ),
    (
        "predicted-latency-producer",
        "is not supported: latency prediction (llm-d's latency-predictor sidecar) is not; \
         score load with queue-scorer, kv-cache-utilization-scorer or load-aware-scorer",
    ),
    (
        "slo-headroom-tier-filter",
        "is not supported: latency prediction (llm-d's latency-predictor sidecar) is not; \
         requests with deadlines are ordered by flow control's `edf` or `slo-deadline` \
         ordering policy",
    ),
    (
        "latency-slo-admitter",
        "is not supported: latency prediction (llm-d's latency-predictor sidecar) is not; \
         admission is the gateway's flow control (its `flow` section)",
    ),
    (
        "vertexai-parser",
        "is not supported: the gateway parses OpenAI completions and chat completions \
         (llm-d's openai-parser)",
    ),
];

/// The decider `pd-profile-handler` uses without `deciderPluginName` or `threshold`, when a
/// plugin of that name is declared (llm-d's default `deciderPluginName`).
const DEFAULT_DECIDER: &str = "prefix-based-pd-decider";

/// Parameters a plugin accepts without effect, and what is used instead.
const NO_EFFECT_PARAMS: &[(&str, &str, &str)] = &[
    (
        "pd-profile-handler",
        "hashBlockSize",
        "has no effect: the decider counts uncached tokens with the prefix index's block size",
    ),
    (
        "pd-profile-handler",
        "primaryPort",
        "has no effect: the gateway sends the request to the decode endpoint's own port",
    ),
    (
        "pd-profile-handler",
        "prefixPluginType",
        "has no effect: the decider reads the router's prefix match, whatever scorer is named",
    ),
    (
        "pd-profile-handler",
        "prefixPluginName",
        "has no effect: the decider reads the router's prefix match, whatever scorer is named",
    ),
    (
        "prefix-cache-scorer",
        "autoTune",
        "has no effect: the prefix index's block size holds (llm-d takes the engines' reported \
         block size when true)",
    ),
];

struct Instance {
    key: String,
    name: String,
    /// The registered type (the current name when an older one was written).
    type_name: String,
    /// The parameters as written, to name the key a user wrote in later errors.
    params: Value,
    plugin: Plugin,
}

/// Parses a configuration value with the plugins of `registry`.
pub fn parse(value: &Value, registry: &Registry) -> Result<RouterConfig, ConfigError> {
    let top = object(value, "config")?;
    check_type_meta(top)?;
    for key in top.keys() {
        if let Some((_, why)) = REFUSED.iter().find(|(k, _)| k == key) {
            return Err(ConfigError::new(key.clone(), *why));
        }
        if !TOP_LEVEL.contains(&key.as_str()) {
            return Err(ConfigError::new(
                key.clone(),
                format!("unknown key (expected one of {TOP_LEVEL:?})"),
            ));
        }
    }
    let mut notes = Vec::new();
    let flow_control = parse_gates(top.get("featureGates"), &mut notes)?;
    let (names, mut instances, parsers) = parse_plugins(top.get("plugins"), registry, &mut notes)?;
    parse_parser(top, &names, &parsers, &mut notes)?;
    let (saturation, detector) =
        parse_saturation(top.get("saturationDetector"), &names, &instances)?;
    let tree_refs = resolve_trees(&mut instances, &names)?;
    let data_layer = parse_data_section(top, &names, &instances, &mut notes)?;
    let given = top.get("schedulingProfiles").filter(|v| !v.as_array().is_some_and(Vec::is_empty));
    let default_profile = given.is_none();
    let implicit;
    let profile_values = match given {
        Some(v) => array(Some(v), "schedulingProfiles")?,
        None => {
            implicit = self::default_profile(&instances, &mut notes)?;
            std::slice::from_ref(&implicit)
        }
    };
    let mut profiles = Vec::new();
    for (i, pv) in profile_values.iter().enumerate() {
        let at = format!("schedulingProfiles[{i}]");
        let profile = parse_profile(pv, &at, &names, &instances, &parsers, &mut notes)?;
        if profiles.iter().any(|p: &Profile| p.name == profile.name) {
            return Err(ConfigError::new(
                format!("schedulingProfiles[{i}].name"),
                "duplicate profile name",
            ));
        }
        profiles.push(profile);
    }
    let handler = resolve_handler(&instances, &names, &profiles, &mut notes)?;
    note_unused(&instances, &profiles, &tree_refs, detector, &mut notes);
    let prefill_header = prefill_header(&instances, &profiles, &handler, &mut notes);
    let tokenizer = instances.iter().find_map(|inst| match &inst.plugin {
        Plugin::Data(DataSpec::Tokenizer { model, .. }) => Some((inst.key.clone(), model.clone())),
        _ => None,
    });
    let metrics_source = instances.iter().find_map(|inst| match &inst.plugin {
        Plugin::Data(DataSpec::MetricsSource { path, .. }) => {
            Some((inst.key.clone(), path.clone()))
        }
        _ => None,
    });
    let mut scorers: Vec<Arc<dyn Scorer>> = Vec::new();
    let mut index_hints = IndexHints::default();
    let mut block_size_key = None;
    let mut token_caps = Vec::new();
    let mut precise: Option<(String, PreciseSpec)> = None;
    for inst in &instances {
        if let Plugin::Scorer(s) = &inst.plugin {
            if let Some(spec) = s.precise() {
                if let Some((key, other)) = &precise {
                    if other.block_size != spec.block_size
                        || other.vllm_seed != spec.vllm_seed
                        || other.kv_events != spec.kv_events
                    {
                        return Err(ConfigError::new(
                            format!("{}.parameters", inst.key),
                            format!("differs from the precise prefix settings of {key}; one index serves both"),
                        ));
                    }
                }
                for (path, message) in &spec.notes {
                    notes.push(ConfigNote {
                        key: format!("{}.parameters.{path}", inst.key),
                        message: message.clone(),
                    });
                }
                precise = precise.or(Some((inst.key.clone(), spec.clone())));
            }
            let hints = s.index_hints();
            if let Some(bs) = hints.block_size {
                if index_hints.block_size.is_some_and(|b| b != bs) {
                    return Err(ConfigError::new(
                        format!("{}.parameters.blockSize", inst.key),
                        "differs from another plugin's block size",
                    ));
                }
                index_hints.block_size = Some(bs);
                block_size_key = Some(format!("{}.parameters.blockSize", inst.key));
            }
            if let Some(capacity) = hints.worker_capacity {
                // One index serves every scorer: a second capacity would be dropped unsaid.
                if index_hints.worker_capacity.is_some_and(|c| c != capacity) {
                    return Err(ConfigError::new(
                        format!("{}.parameters.lruCapacityPerServer", inst.key),
                        "differs from another plugin's lruCapacityPerServer; one index serves both",
                    ));
                }
                index_hints.worker_capacity = Some(capacity);
            }
            if let Some(tokens) = hints.max_tokens {
                token_caps
                    .push((format!("{}.parameters.maxPrefixTokensToMatch", inst.key), tokens));
            }
            scorers.push(s.clone());
        }
    }
    Ok(RouterConfig {
        profiles,
        handler,
        scorers,
        index_hints,
        block_size_key,
        token_caps,
        notes,
        precise,
        saturation,
        flow_control,
        tokenizer,
        data_layer,
        prefill_header,
        default_profile,
        metrics_source,
    })
}

/// The `dataLayer` section (or the Extension's `data`), checked against the plugins.
fn parse_data_section(
    top: &Map<String, Value>,
    names: &HashMap<String, usize>,
    instances: &[Instance],
    notes: &mut Vec<ConfigNote>,
) -> Result<Option<DataLayer>, ConfigError> {
    let at = match (top.contains_key("dataLayer"), top.contains_key("data")) {
        (false, false) => return Ok(None),
        (true, true) => {
            return Err(ConfigError::new("data", "give either dataLayer or data, not both"));
        }
        (true, false) => "dataLayer",
        (false, true) => "data",
    };
    let kinds: Vec<RefKind<'static>> = instances
        .iter()
        .map(|inst| match (&inst.plugin, inst.plugin.data_feed()) {
            (_, Some(feed)) => RefKind::Source(feed),
            (Plugin::Data(DataSpec::MetricsExtractor { .. }), _) => {
                RefKind::Extractor(Feed::Metrics)
            }
            (Plugin::Scorer(s), _) if s.precise().is_some() => RefKind::Extractor(Feed::Endpoints),
            (other, _) => RefKind::Other(other.kind()),
        })
        .collect();
    let lookup = |name: &str| names.get(name).map_or(RefKind::Missing, |&i| kinds[i]);
    let layer = parse_data_layer(&top[at], at, &lookup).map_err(|(k, m)| ConfigError::new(k, m))?;
    if !layer.inject_defaults {
        notes.push(ConfigNote {
            key: format!("{at}.injectDefaults"),
            message: "has no effect: endpoint metrics come from the gateway's scraper \
                      (`scrape.enabled`) or EndpointPool.update"
                .to_string(),
        });
    }
    Ok(Some(layer))
}

/// The Inference Extension's implicit profile: every filter, scorer and picker, in the order
/// the plugins are declared (scorers at weight 1; a second picker is refused as in any profile).
fn default_profile(
    instances: &[Instance],
    notes: &mut Vec<ConfigNote>,
) -> Result<Value, ConfigError> {
    let mut pickers = instances.iter().filter(|i| matches!(i.plugin, Plugin::Picker(_)));
    if let (Some(first), Some(second)) = (pickers.next(), pickers.next()) {
        return Err(ConfigError::new(
            second.key.clone(),
            format!(
                "a second picker: without schedulingProfiles the default profile takes every \
                 picker declared, and a profile takes one ({:?} is the first)",
                first.name
            ),
        ));
    }
    let refs: Vec<Value> = instances
        .iter()
        .filter(|inst| {
            matches!(inst.plugin, Plugin::Filter(_) | Plugin::Scorer(_) | Plugin::Picker(_))
        })
        .map(|inst| serde_json::json!({"pluginRef": inst.name}))
        .collect();
    let listed: Vec<&str> = refs.iter().filter_map(|r| r["pluginRef"].as_str()).collect();
    notes.push(ConfigNote {
        key: "schedulingProfiles".to_string(),
        message: format!(
            "not given: the Inference Extension's default profile \"default\" runs every \
             filter, scorer (weight 1) and picker declared: {}",
            if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
        ),
    });
    Ok(serde_json::json!({"name": "default", "plugins": refs}))
}

/// Notes what a configuration declares but never runs: a filter, scorer or picker that no
/// profile lists (nor a decision tree refers to), and a profile the profile handler never
/// runs. llm-d builds both and uses neither, silently; here each is a note.
fn note_unused(
    instances: &[Instance],
    profiles: &[Profile],
    tree_refs: &HashSet<usize>,
    detector: Option<usize>,
    notes: &mut Vec<ConfigNote>,
) {
    let mut used: HashSet<&str> = HashSet::new();
    for p in profiles {
        used.extend(p.filters.iter().map(|f| f.name.as_str()));
        used.extend(p.scorers.iter().map(|s| s.name.as_str()));
        used.insert(p.picker_name.as_str());
    }
    for (i, inst) in instances.iter().enumerate() {
        let what = match inst.plugin {
            Plugin::Filter(_) => "filters nothing",
            Plugin::Scorer(_) => "scores nothing",
            Plugin::Picker(_) => "picks nothing",
            _ => continue,
        };
        if used.contains(inst.name.as_str()) || tree_refs.contains(&i) || detector == Some(i) {
            continue;
        }
        notes.push(ConfigNote {
            key: inst.key.clone(),
            message: format!(
                "{:?} is declared but no scheduling profile lists it (nor a decision tree): it \
                 {what}; list it in a profile (with a weight, for a scorer) or remove it",
                inst.name
            ),
        });
    }
    // The profiles a handler knows: the ones it runs, and a prefill profile it is noted not to
    // run (a disaggregation handler without a decider).
    let known: Vec<&str> = instances
        .iter()
        .find_map(|inst| match &inst.plugin {
            Plugin::Handler(
                HandlerSpec::Pd { decode_profile, prefill_profile, .. }
                | HandlerSpec::Disagg { decode_profile, prefill_profile, .. },
            ) => Some(vec![decode_profile.as_str(), prefill_profile.as_str()]),
            _ => None,
        })
        .unwrap_or_default();
    if known.is_empty() {
        return; // a single profile handler: exactly one profile, which it runs
    }
    let handler = instances
        .iter()
        .find(|inst| matches!(inst.plugin, Plugin::Handler(_)))
        .map_or("the profile handler", |inst| inst.name.as_str());
    for (i, p) in profiles.iter().enumerate() {
        if !known.contains(&p.name.as_str()) {
            notes.push(ConfigNote {
                key: format!("schedulingProfiles[{i}]"),
                message: format!(
                    "profile {:?} never runs: {handler:?} runs only its decode profile {:?} and \
                     its prefill profile {:?}",
                    p.name, known[0], known[1]
                ),
            });
        }
    }
}

/// The prefill header llm-d would set, and notes for a headers plugin that never sets it.
fn prefill_header(
    instances: &[Instance],
    profiles: &[Profile],
    handler: &Handler,
    notes: &mut Vec<ConfigNote>,
) -> Option<(String, &'static str)> {
    let prefill = match handler {
        Handler::Pd { prefill, .. } => Some(*prefill),
        Handler::Single { .. } => None,
    };
    let mut header = None;
    for inst in instances {
        match &inst.plugin {
            Plugin::Headers(h) => {
                if prefill.is_some_and(|p| profiles[p].name == h.prefill_profile) {
                    header = header.or(Some((inst.key.clone(), PREFILL_HEADER)));
                } else {
                    notes.push(ConfigNote {
                        key: inst.key.clone(),
                        message: format!(
                            "has no effect: the profile handler never runs a prefill profile \
                             named {:?}, so there is no prefill endpoint for {PREFILL_HEADER}",
                            h.prefill_profile
                        ),
                    });
                }
            }
            Plugin::Handler(HandlerSpec::Disagg { .. }) if prefill.is_some() => {
                header = header.or(Some((inst.key.clone(), PREFILL_HEADER)));
            }
            _ => {}
        }
    }
    header
}

/// `apiVersion` and `kind`: absent, or those of llm-d's `EndpointPickerConfig`. A Kubernetes
/// ConfigMap (what llm-d's Helm charts render the file into) is refused with the keys of its
/// `data` that hold the configuration.
fn check_type_meta(top: &Map<String, Value>) -> Result<(), ConfigError> {
    if let Some(kind) = top.get("kind") {
        if kind == "ConfigMap" {
            let keys = top
                .get("data")
                .and_then(Value::as_object)
                .map(|d| d.keys().map(|k| format!("data.{k:?}")).collect::<Vec<_>>().join(", "))
                .filter(|k| !k.is_empty())
                .unwrap_or_else(|| "its `data`".into());
            return Err(ConfigError::new(
                "kind",
                format!(
                    "is ConfigMap: this is the Kubernetes object that holds the configuration; \
                     give the EndpointPickerConfig it holds ({keys}) as the file, as llm-d's \
                     endpoint picker reads it mounted from the ConfigMap"
                ),
            ));
        }
        if kind != "EndpointPickerConfig" {
            return Err(ConfigError::new(
                "kind",
                format!("must be EndpointPickerConfig, got {kind}"),
            ));
        }
    }
    if let Some(version) = top.get("apiVersion") {
        if !version.as_str().is_some_and(|v| API_VERSIONS.contains(&v)) {
            return Err(ConfigError::new(
                "apiVersion",
                format!("must be {} (or left out), got {version}", API_VERSIONS.join(" or ")),
            ));
        }
    }
    Ok(())
}

/// llm-d's `parser` section and its `openai-parser` plugins (`parsers`: name and key, kept
/// out of the plugin instances): noted without effect (the gateway parses OpenAI requests
/// itself); `parser.pluginRef` must name one of them.
fn parse_parser(
    top: &Map<String, Value>,
    names: &HashMap<String, usize>,
    parsers: &[(String, String)],
    notes: &mut Vec<ConfigNote>,
) -> Result<(), ConfigError> {
    if let Some(v) = top.get("parser") {
        let map = object(v, "parser")?;
        check_keys(map, &["pluginRef"], "parser")?;
        let at = "parser.pluginRef";
        let name =
            string(map.get("pluginRef"), at)?.ok_or_else(|| ConfigError::new(at, "is required"))?;
        if !parsers.iter().any(|(n, _)| n == name) {
            let why = if names.contains_key(name) {
                format!("{name:?} is not an {OPENAI_PARSER} plugin")
            } else {
                format!("no plugin is named {name:?}")
            };
            return Err(ConfigError::new(
                at,
                format!("{why}; declare one of type {OPENAI_PARSER}"),
            ));
        }
        notes.push(ConfigNote {
            key: "parser".into(),
            message: format!(
                "has no effect: the gateway parses OpenAI completions and chat completions \
                 itself, as llm-d's {OPENAI_PARSER}"
            ),
        });
    } else if let Some((_, key)) = parsers.first() {
        notes.push(ConfigNote {
            key: format!("{key}.type"),
            message: format!(
                "{OPENAI_PARSER} has no effect: the gateway parses OpenAI completions and chat \
                 completions itself"
            ),
        });
    }
    Ok(())
}

fn parse_gates(v: Option<&Value>, notes: &mut Vec<ConfigNote>) -> Result<bool, ConfigError> {
    let Some(v) = v else { return Ok(false) };
    let gates = v.as_array().ok_or_else(|| ConfigError::new("featureGates", "must be a list"))?;
    let mut flow_control = false;
    for (i, g) in gates.iter().enumerate() {
        let key = format!("featureGates[{i}]");
        let name = g.as_str().ok_or_else(|| ConfigError::new(&key, "must be a string"))?;
        let Some((_, what, effect)) = FEATURE_GATES.iter().find(|(n, _, _)| *n == name) else {
            let known: Vec<&str> = FEATURE_GATES.iter().map(|(n, _, _)| *n).collect();
            return Err(ConfigError::new(
                key,
                format!("unknown feature gate {name:?} (known: {})", known.join(", ")),
            ));
        };
        if name == "flowControl" {
            flow_control = true;
        }
        if !effect {
            notes.push(ConfigNote { key, message: format!("{name} {what}") });
        }
    }
    Ok(flow_control)
}

/// llm-d's saturation detector plugin, which `saturationDetector.pluginRef` names (by default
/// the plugin named `utilization-detector`).
const DETECTOR: &str = "utilization-detector";

/// The flow-control thresholds: `saturationDetector`'s own (the Extension's earlier form), or
/// those of the `utilization-detector` plugin its `pluginRef` names (llm-d's current form;
/// without a section or a `pluginRef`, the plugin named `utilization-detector`, as llm-d's
/// default). Returns the index of that plugin too.
fn parse_saturation(
    v: Option<&Value>,
    names: &HashMap<String, usize>,
    instances: &[Instance],
) -> Result<(Option<SaturationSpec>, Option<usize>), ConfigError> {
    let at = "saturationDetector";
    let map = v.map(|v| object(v, at)).transpose()?;
    let mut reference = None;
    if let Some(r) = map.and_then(|m| m.get("pluginRef")) {
        let key = format!("{at}.pluginRef");
        if let Some(other) = map.into_iter().flat_map(|m| m.keys()).find(|k| *k != "pluginRef") {
            return Err(ConfigError::new(
                format!("{at}.{other}"),
                format!(
                    "cannot be given with pluginRef: set the thresholds in the parameters of \
                     the {DETECTOR} plugin it names"
                ),
            ));
        }
        let name = string(Some(r), &key)?.unwrap_or_default();
        // llm-d reads an empty reference as the default one.
        if !name.is_empty() {
            let i = *names.get(name).ok_or_else(|| {
                ConfigError::new(
                    &key,
                    format!("no plugin is named {name:?}; declare a plugin of type {DETECTOR}"),
                )
            })?;
            if instances[i].type_name != DETECTOR {
                return Err(ConfigError::new(
                    &key,
                    format!(
                        "{name:?} is a {}, not a saturation detector; name a plugin of type \
                         {DETECTOR}",
                        instances[i].type_name
                    ),
                ));
            }
            reference = Some(i);
        }
    } else if let Some(map) = map {
        check_keys(
            map,
            &["queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold"],
            at,
        )?;
        return Ok((Some(thresholds(map, at)?), None));
    }
    let detector = reference
        .or_else(|| names.get(DETECTOR).copied().filter(|&i| instances[i].type_name == DETECTOR));
    let Some(i) = detector else { return Ok((None, None)) };
    let inst = &instances[i];
    let empty = Map::new();
    let params = inst.params.as_object().unwrap_or(&empty);
    let spec = thresholds(params, &format!("{}.parameters", inst.key))?;
    Ok((Some(spec), Some(i)))
}

/// `queueDepthThreshold`, `kvCacheUtilThreshold` and `metricsStalenessThreshold` of `map`.
fn thresholds(map: &Map<String, Value>, at: &str) -> Result<SaturationSpec, ConfigError> {
    let mut spec = SaturationSpec::default();
    if let Some(q) = map.get("queueDepthThreshold") {
        spec.queue_depth_threshold = Some(q.as_u64().filter(|&q| q > 0).ok_or_else(|| {
            ConfigError::new(format!("{at}.queueDepthThreshold"), "must be an integer >= 1")
        })?);
    }
    if let Some(kv) = map.get("kvCacheUtilThreshold") {
        spec.kv_cache_util_threshold =
            Some(kv.as_f64().filter(|&k| k > 0.0 && k <= 1.0).ok_or_else(|| {
                ConfigError::new(format!("{at}.kvCacheUtilThreshold"), "must be a number in (0, 1]")
            })?);
    }
    if let Some(d) = map.get("metricsStalenessThreshold") {
        let key = format!("{at}.metricsStalenessThreshold");
        let text = d.as_str().ok_or_else(|| {
            ConfigError::new(&key, "must be a duration such as \"200ms\" or \"2s\"")
        })?;
        let secs = parse_duration(text).map_err(|m| ConfigError::new(&key, m))?;
        if secs <= 0.0 {
            return Err(ConfigError::new(key, "must be positive"));
        }
        spec.metrics_staleness_s = Some(secs);
    }
    Ok(spec)
}

/// A Go duration ("200ms", "1m30s", "1.5h") in seconds.
pub fn parse_duration(text: &str) -> Result<f64, String> {
    let bad = || format!("{text:?} is not a duration (like \"200ms\", \"2s\", \"1m0s\")");
    let mut rest = text.trim();
    if rest == "0" {
        return Ok(0.0);
    }
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
        let value: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Builds every decision tree, following references to filters and to other trees.
/// Returns the indices of the plugins a tree refers to.
fn resolve_trees(
    instances: &mut [Instance],
    names: &HashMap<String, usize>,
) -> Result<HashSet<usize>, ConfigError> {
    let mut built: Vec<Option<Arc<dyn Filter>>> = vec![None; instances.len()];
    let mut referenced = HashSet::new();
    for i in 0..instances.len() {
        if matches!(instances[i].plugin, Plugin::Tree(_)) {
            build_tree(i, instances, names, &mut built, &mut Vec::new(), &mut referenced)?;
        }
    }
    for (inst, b) in instances.iter_mut().zip(built) {
        if let Some(f) = b {
            inst.plugin = Plugin::Filter(f);
        }
    }
    Ok(referenced)
}

fn build_tree(
    i: usize,
    instances: &[Instance],
    names: &HashMap<String, usize>,
    built: &mut Vec<Option<Arc<dyn Filter>>>,
    stack: &mut Vec<usize>,
    referenced: &mut HashSet<usize>,
) -> Result<Arc<dyn Filter>, ConfigError> {
    if let Some(f) = &built[i] {
        return Ok(f.clone());
    }
    let Plugin::Tree(spec) = &instances[i].plugin else { unreachable!("called on trees") };
    let spec: Arc<TreeSpec> = spec.clone();
    stack.push(i);
    let key = instances[i].key.clone();
    let mut inner_err: Option<ConfigError> = None;
    let result = DecisionTreeFilter::build(&spec, &mut |name, path| {
        let Some(&j) = names.get(name) else {
            return Err(ParamError::new(path, format!("no plugin named {name:?}")));
        };
        referenced.insert(j);
        match &instances[j].plugin {
            Plugin::Filter(f) => Ok(f.clone()),
            Plugin::Tree(_) if stack.contains(&j) => {
                Err(ParamError::new(path, format!("{name:?} refers back to this tree (a cycle)")))
            }
            Plugin::Tree(_) => match build_tree(j, instances, names, built, stack, referenced) {
                Ok(f) => Ok(f),
                Err(e) => {
                    inner_err = Some(e);
                    Err(ParamError::new(path, "invalid"))
                }
            },
            other => {
                Err(ParamError::new(path, format!("{name:?} is a {}, not a filter", other.kind())))
            }
        }
    });
    stack.pop();
    match result {
        Ok(tree) => {
            let f: Arc<dyn Filter> = Arc::new(tree);
            built[i] = Some(f.clone());
            Ok(f)
        }
        Err(e) => Err(inner_err.unwrap_or_else(|| {
            ConfigError::new(format!("{key}.parameters.{}", e.path), e.message)
        })),
    }
}

fn object<'a>(v: &'a Value, key: &str) -> Result<&'a Map<String, Value>, ConfigError> {
    v.as_object().ok_or_else(|| ConfigError::new(key, "must be a mapping"))
}

fn array<'a>(v: Option<&'a Value>, key: &str) -> Result<&'a [Value], ConfigError> {
    match v {
        None => Err(ConfigError::new(key, "is required")),
        Some(v) => v
            .as_array()
            .map(|a| a.as_slice())
            .ok_or_else(|| ConfigError::new(key, "must be a list")),
    }
}

fn string<'a>(v: Option<&'a Value>, key: &str) -> Result<Option<&'a str>, ConfigError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
        Some(_) => Err(ConfigError::new(key, "must be a non-empty string")),
    }
}

fn check_keys(map: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), ConfigError> {
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ConfigError::new(
            format!("{at}.{k}"),
            format!("unknown key (expected one of {allowed:?})"),
        )),
        None => Ok(()),
    }
}

fn parse_plugins(
    v: Option<&Value>,
    registry: &Registry,
    notes: &mut Vec<ConfigNote>,
) -> Result<ParsedPlugins, ConfigError> {
    let mut names = HashMap::new();
    let mut instances = Vec::new();
    let mut parsers: Parsers = Vec::new();
    for (i, pv) in array(v, "plugins")?.iter().enumerate() {
        let at = format!("plugins[{i}]");
        let map = object(pv, &at)?;
        check_keys(map, &["type", "name", "parameters"], &at)?;
        let type_key = format!("{at}.type");
        let type_name = string(map.get("type"), &type_key)?
            .ok_or_else(|| ConfigError::new(&type_key, "is required"))?;
        let name = string(map.get("name"), &format!("{at}.name"))?.unwrap_or(type_name).to_string();
        if let Some((_, why)) = REFUSED_TYPES.iter().find(|(t, _)| *t == type_name) {
            return Err(ConfigError::new(&type_key, format!("{type_name:?} {why}")));
        }
        if names.contains_key(&name) || parsers.iter().any(|(n, _)| *n == name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("duplicate plugin name {name:?}"),
            ));
        }
        if type_name == OPENAI_PARSER {
            // llm-d's factory takes no parameters; the parser section reads it (parse_parser).
            if map
                .get("parameters")
                .is_some_and(|p| !p.is_null() && p != &Value::Object(Map::new()))
            {
                return Err(ConfigError::new(
                    format!("{at}.parameters"),
                    format!("{OPENAI_PARSER} takes no parameters"),
                ));
            }
            parsers.push((name, at));
            continue;
        }
        let (factory, current) = registry.resolve(type_name).ok_or_else(|| {
            ConfigError::new(
                &type_key,
                format!(
                    "unknown plugin type {type_name:?}; known types: {}",
                    registry.type_names().join(", ")
                ),
            )
        })?;
        if let Some(current) = current {
            notes.push(ConfigNote {
                key: type_key.clone(),
                message: format!("{type_name:?} is read as {current:?}, its current name"),
            });
        }
        let params = map.get("parameters").unwrap_or(&Value::Null);
        let current_type = current.unwrap_or(type_name);
        for (t, param, why) in NO_EFFECT_PARAMS {
            if *t == current_type && params.get(*param).is_some() {
                notes.push(ConfigNote {
                    key: format!("{at}.parameters.{param}"),
                    message: (*why).to_string(),
                });
            }
        }
        let plugin = factory(params).map_err(|e| {
            let key = if e.path.is_empty() {
                format!("{at}.parameters")
            } else {
                format!("{at}.parameters.{}", e.path)
            };
            ConfigError::new(key, e.message)
        })?;
        let spec_notes = match &plugin {
            Plugin::Data(d) => d.notes(),
            Plugin::Handler(HandlerSpec::Disagg { notes, .. })
            | Plugin::Headers(super::handler::HeadersSpec { notes, .. }) => notes.as_slice(),
            _ => &[],
        };
        for (path, message) in spec_notes {
            notes.push(ConfigNote {
                key: format!("{at}.parameters.{path}"),
                message: message.clone(),
            });
        }
        names.insert(name.clone(), instances.len());
        let type_name = current_type.to_string();
        instances.push(Instance { key: at, name, type_name, params: params.clone(), plugin });
    }
    Ok((names, instances, parsers))
}

fn parse_profile(
    v: &Value,
    at: &str,
    names: &HashMap<String, usize>,
    instances: &[Instance],
    parsers: &[(String, String)],
    notes: &mut Vec<ConfigNote>,
) -> Result<Profile, ConfigError> {
    let map = object(v, at)?;
    check_keys(map, &["name", "plugins"], at)?;
    let name_key = format!("{at}.name");
    let name = string(map.get("name"), &name_key)?
        .ok_or_else(|| ConfigError::new(&name_key, "is required"))?;
    let mut profile = Profile {
        name: name.to_string(),
        filters: Vec::new(),
        scorers: Vec::new(),
        picker_name: String::new(),
        picker: Arc::new(super::pickers::max_score::MaxScorePicker {
            limit: super::pickers::DEFAULT_MAX_ENDPOINTS,
        }),
    };
    let mut has_picker = false;
    // Each pluginRef's first entry, to note one listed twice.
    let mut listed: HashMap<&str, usize> = HashMap::new();
    for (j, rv) in array(map.get("plugins"), &format!("{at}.plugins"))?.iter().enumerate() {
        let rat = format!("{at}.plugins[{j}]");
        let rmap = object(rv, &rat)?;
        check_keys(rmap, &["pluginRef", "weight"], &rat)?;
        let ref_key = format!("{rat}.pluginRef");
        let plugin_ref = string(rmap.get("pluginRef"), &ref_key)?
            .ok_or_else(|| ConfigError::new(&ref_key, "is required"))?;
        if parsers.iter().any(|(n, _)| n == plugin_ref) {
            // llm-d's own configs list the parser in a profile, which assigns it no slot.
            if rmap.contains_key("weight") {
                return Err(ConfigError::new(
                    format!("{rat}.weight"),
                    format!("only scorers take a weight; {plugin_ref:?} is a parser"),
                ));
            }
            continue;
        }
        let &idx = names
            .get(plugin_ref)
            .ok_or_else(|| ConfigError::new(&ref_key, format!("no plugin named {plugin_ref:?}")))?;
        let weight_key = format!("{rat}.weight");
        let weight = match rmap.get("weight") {
            None => None,
            Some(w) => match w.as_f64() {
                Some(w) if w.is_finite() && w >= 0.0 => Some(w),
                _ => return Err(ConfigError::new(weight_key, "must be a finite number >= 0")),
            },
        };
        let plugin = &instances[idx].plugin;
        if weight.is_some() && !matches!(plugin, Plugin::Scorer(_)) {
            return Err(ConfigError::new(
                weight_key,
                format!("only scorers take a weight; {plugin_ref:?} is a {}", plugin.kind()),
            ));
        }
        let first = *listed.entry(plugin_ref).or_insert(j);
        match plugin {
            Plugin::Filter(f) => {
                if first != j {
                    notes.push(ConfigNote {
                        key: ref_key.clone(),
                        message: format!(
                            "filter {plugin_ref:?} is listed twice in profile {name:?} (first \
                             at plugins[{first}]): it runs twice, as in llm-d"
                        ),
                    });
                }
                profile
                    .filters
                    .push(NamedFilter { name: plugin_ref.to_string(), filter: f.clone() });
            }
            // llm-d runs a scorer listed twice twice and adds both weighted scores: the same
            // as one entry with the summed weight, which is what the profile keeps (one score
            // per scorer name, as explain() shows them).
            Plugin::Scorer(s) => {
                let weight = weight.unwrap_or(1.0);
                if let Some(kept) = profile.scorers.iter_mut().find(|w| w.name == plugin_ref) {
                    let before = kept.weight;
                    kept.weight += weight;
                    notes.push(ConfigNote {
                        key: ref_key.clone(),
                        message: format!(
                            "scorer {plugin_ref:?} is listed twice in profile {name:?} (first \
                             at plugins[{first}]): its weights add up to {} ({before} + \
                             {weight}), as in llm-d; give it one entry",
                            kept.weight
                        ),
                    });
                } else {
                    profile.scorers.push(WeightedScorer {
                        name: plugin_ref.to_string(),
                        scorer: s.clone(),
                        weight,
                    });
                }
            }
            Plugin::Picker(p) => {
                if has_picker {
                    return Err(ConfigError::new(ref_key, "a profile takes one picker"));
                }
                has_picker = true;
                profile.picker = p.clone();
                profile.picker_name = plugin_ref.to_string();
            }
            Plugin::Tree(_) => unreachable!("trees are built before profiles"),
            // As in the Extension, a profile assigns only filters, scorers and a picker; a
            // data producer listed there (llm-d's samples list the tokenizer) takes no slot.
            Plugin::Data(_) => {}
            Plugin::Handler(_) | Plugin::Decider(_) | Plugin::Headers(_) => {
                return Err(ConfigError::new(
                    ref_key,
                    format!("a {} belongs in plugins, not in a profile", plugin.kind()),
                ));
            }
        }
    }
    if !has_picker {
        // As in the Extension and llm-d (config/loader/defaults.go): a profile without a
        // picker gets a declared picker when there is one (there, any of them; here the
        // first declared), else a max-score-picker.
        let declared: Vec<&Instance> =
            instances.iter().filter(|i| matches!(i.plugin, Plugin::Picker(_))).collect();
        match declared.first() {
            Some(Instance { name: picker_name, plugin: Plugin::Picker(p), .. }) => {
                profile.picker = p.clone();
                profile.picker_name = picker_name.clone();
                notes.push(ConfigNote {
                    key: format!("{at}.plugins"),
                    message: format!(
                        "profile {name:?} lists no picker: it takes the declared picker \
                         {picker_name:?}, as in llm-d{}",
                        if declared.len() > 1 {
                            " (which picks one of the declared pickers at random: list one)"
                        } else {
                            ""
                        }
                    ),
                });
            }
            _ => profile.picker_name = "max-score-picker".into(),
        }
    }
    // Totals are sums of clamped scores times weights: a weight sum that overflows makes
    // totals infinite, and infinite totals tie or dominate whatever the scores say.
    let sum: f64 = profile.scorers.iter().map(|s| s.weight).sum();
    if !sum.is_finite() {
        return Err(ConfigError::new(
            format!("{at}.plugins"),
            format!("the scorer weights of profile {name:?} add up past the largest number"),
        ));
    }
    if !profile.picker.reads_scores() && !profile.scorers.is_empty() {
        let listed: Vec<&str> = profile.scorers.iter().map(|s| s.name.as_str()).collect();
        notes.push(ConfigNote {
            key: format!("{at}.plugins"),
            message: format!(
                "the picker {:?} of profile {name:?} orders endpoints without reading scores: \
                 its scorers ({}) never change a decision; use a max-score-picker, \
                 weighted-random-picker or power-of-two-picker, or remove them",
                profile.picker_name,
                listed.join(", ")
            ),
        });
    } else if sum > 0.0 {
        for s in profile.scorers.iter().filter(|s| s.weight == 0.0) {
            let first = listed.get(s.name.as_str()).copied().unwrap_or_default();
            notes.push(ConfigNote {
                key: format!("{at}.plugins[{first}].weight"),
                message: format!(
                    "scorer {:?} has weight 0 in profile {name:?}: it never changes a decision \
                     (0 times its score adds nothing to any total); give it a weight or remove it",
                    s.name
                ),
            });
        }
    }
    if sum == 0.0 && !profile.scorers.is_empty() && profile.picker.reads_scores() {
        notes.push(ConfigNote {
            key: format!("{at}.plugins"),
            message: format!(
                "every scorer weight of profile {name:?} is 0: all endpoints tie, so the \
                 picker chooses among all of them as if there were no scorers"
            ),
        });
    }
    Ok(profile)
}

fn resolve_decider(
    instances: &[Instance],
    names: &HashMap<String, usize>,
    name: &str,
    key: String,
) -> Result<DeciderSpec, ConfigError> {
    match names.get(name).map(|&i| &instances[i].plugin) {
        Some(Plugin::Decider(spec)) => Ok(*spec),
        Some(other) => {
            Err(ConfigError::new(key, format!("{name:?} is a {}, not a decider", other.kind())))
        }
        None => Err(ConfigError::new(key, format!("no plugin named {name:?}"))),
    }
}

/// The raw `parameters` of the plugin at `key`, to name the key a user wrote.
fn params_object<'a>(instances: &'a [Instance], key: &str) -> Option<&'a Map<String, Value>> {
    instances.iter().find(|i| i.key == key).and_then(|i| i.params.as_object())
}

fn resolve_handler(
    instances: &[Instance],
    names: &HashMap<String, usize>,
    profiles: &[Profile],
    notes: &mut Vec<ConfigNote>,
) -> Result<Handler, ConfigError> {
    let handlers: Vec<&Instance> =
        instances.iter().filter(|i| matches!(i.plugin, Plugin::Handler(_))).collect();
    if handlers.len() > 1 {
        return Err(ConfigError::new(
            handlers[1].key.clone(),
            "only one profile handler may be configured",
        ));
    }
    let profile = |name: &str, key: String| {
        profiles
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ConfigError::new(key, format!("no scheduling profile named {name:?}")))
    };
    match handlers.first() {
        None | Some(Instance { plugin: Plugin::Handler(HandlerSpec::Single), .. }) => {
            if profiles.len() != 1 {
                let key =
                    handlers.first().map_or("schedulingProfiles".to_string(), |h| h.key.clone());
                return Err(ConfigError::new(key, format!("{} profiles need a pd-profile-handler; a single profile handler runs exactly one", profiles.len())));
            }
            Ok(Handler::Single { profile: 0 })
        }
        Some(Instance {
            key,
            plugin: Plugin::Handler(HandlerSpec::Pd { decode_profile, prefill_profile, decider }),
            ..
        }) => {
            let decode = profile(decode_profile, format!("{key}.parameters.decodeProfile"))?;
            let prefill = profile(prefill_profile, format!("{key}.parameters.prefillProfile"))?;
            let decider = match decider {
                DeciderRef::Inline(spec) => *spec,
                // llm-d's default deciderPluginName is "prefix-based-pd-decider".
                DeciderRef::Default => match names.get(DEFAULT_DECIDER) {
                    Some(_) => resolve_decider(
                        instances,
                        names,
                        DEFAULT_DECIDER,
                        format!("{key}.parameters.deciderPluginName"),
                    )?,
                    None => DeciderSpec::PrefixBased { non_cached_tokens: 0 },
                },
                DeciderRef::Plugin(name) => resolve_decider(
                    instances,
                    names,
                    name,
                    format!("{key}.parameters.deciderPluginName"),
                )?,
            };
            Ok(Handler::Pd { decode, prefill, decider })
        }
        Some(Instance {
            key,
            plugin:
                Plugin::Handler(HandlerSpec::Disagg {
                    decode_profile, prefill_profile, decider, ..
                }),
            ..
        }) => {
            let params = params_object(instances, key);
            let at = |nested: &str, flat: &str| {
                let flat_given = params.is_some_and(|p| p.contains_key(flat));
                format!("{key}.parameters.{}", if flat_given { flat } else { nested })
            };
            let decode = profile(decode_profile, at("profiles.decode", "decodeProfile"))?;
            let prefill_at = profiles.iter().position(|p| &p.name == prefill_profile);
            let Some(name) = decider else {
                if let Some(p) = prefill_at {
                    notes.push(ConfigNote {
                        key: format!("{key}.parameters"),
                        message: format!(
                            "has no prefill decider (deciders.prefill): the profile {:?} never \
                             runs and every request is served by the decode profile alone",
                            profiles[p].name
                        ),
                    });
                }
                return Ok(Handler::Single { profile: decode });
            };
            let dkey = if params.is_some_and(|p| p.contains_key("deciders")) {
                format!("{key}.parameters.deciders.prefill")
            } else if params.is_some_and(|p| p.contains_key("prefillDeciderPluginName")) {
                format!("{key}.parameters.prefillDeciderPluginName")
            } else {
                format!("{key}.parameters.deciderPluginName")
            };
            let spec = resolve_decider(instances, names, name, dkey)?;
            match prefill_at {
                Some(prefill) => Ok(Handler::Pd { decode, prefill, decider: spec }),
                None => {
                    notes.push(ConfigNote {
                        key: at("profiles.prefill", "prefillProfile"),
                        message: format!(
                            "names no scheduling profile ({prefill_profile:?}): the prefill \
                             stage never runs and every request is served by the decode profile \
                             alone"
                        ),
                    });
                    Ok(Handler::Single { profile: decode })
                }
            }
        }
        Some(_) => unreachable!("filtered to handlers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> ConfigError {
        match parse(&v, &Registry::builtin()) {
            Err(e) => e,
            Ok(_) => panic!("accepted {v}"),
        }
    }

    fn llm_d() -> Value {
        json!({
            "plugins": [
                {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}
            ],
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "max-score-picker"}
            ]}]
        })
    }

    #[test]
    fn parses_llm_d_shape() {
        let c = parse(&llm_d(), &Registry::builtin()).unwrap();
        assert_eq!(c.profiles.len(), 1);
        let weights: Vec<f64> = c.profiles[0].scorers.iter().map(|s| s.weight).collect();
        assert_eq!(weights, vec![2.0, 2.0, 3.0]);
        assert_eq!(c.handler, Handler::Single { profile: 0 });
    }

    #[test]
    fn errors_name_the_key() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([]), "config"),
            (json!({"plugins": [], "schedulingProfiles": [], "extra": 1}), "extra"),
            (
                json!({"plugins": [{"type": "nope-scorer"}], "schedulingProfiles": []}),
                "plugins[0].type",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer", "parameters": {"x": 1}}], "schedulingProfiles": []}),
                "plugins[0].parameters.x",
            ),
            (
                json!({"plugins": [{"type": "load-aware-scorer", "parameters": {"threshold": "a"}}], "schedulingProfiles": []}),
                "plugins[0].parameters.threshold",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer", "nmae": "q"}], "schedulingProfiles": []}),
                "plugins[0].nmae",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}], "schedulingProfiles": []}),
                "plugins[1].name",
            ),
            (
                json!({"plugins": [{"type": "random-picker"}, {"type": "max-score-picker"}]}),
                "plugins[1]",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "missing"}]}]}),
                "schedulingProfiles[0].plugins[0].pluginRef",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "queue-scorer", "weight": -1}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "queue-scorer", "weight": "2"}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "decode-filter"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "decode-filter", "weight": 1}]}]}),
                "schedulingProfiles[0].plugins[0].weight",
            ),
            (
                json!({"plugins": [{"type": "random-picker"}, {"type": "max-score-picker"}], "schedulingProfiles": [{"name": "a", "plugins": [{"pluginRef": "random-picker"}, {"pluginRef": "max-score-picker"}]}]}),
                "schedulingProfiles[0].plugins[1].pluginRef",
            ),
            (
                json!({"plugins": [], "schedulingProfiles": [{"name": "a", "plugins": []}, {"name": "b", "plugins": []}]}),
                "schedulingProfiles",
            ),
            (
                json!({"plugins": [], "schedulingProfiles": [{"name": "a", "plugins": []}, {"name": "a", "plugins": []}]}),
                "schedulingProfiles[1].name",
            ),
            (
                json!({"plugins": [{"type": "pd-profile-handler"}], "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefil", "plugins": []}]}),
                "plugins[0].parameters.prefillProfile",
            ),
            (
                json!({"plugins": [{"type": "pd-profile-handler", "parameters": {"deciderPluginName": "d"}}], "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]}),
                "plugins[0].parameters.deciderPluginName",
            ),
            (
                json!({"plugins": [{"type": "prefix-cache-scorer", "name": "a", "parameters": {"blockSize": 16}}, {"type": "prefix-cache-scorer", "name": "b", "parameters": {"blockSize": 64}}], "schedulingProfiles": [{"name": "x", "plugins": []}]}),
                "plugins[1].parameters.blockSize",
            ),
            (json!({"kind": "Other", "plugins": [], "schedulingProfiles": []}), "kind"),
        ];
        for (v, key) in cases {
            let e = err(v.clone());
            assert_eq!(e.key, key, "{v} -> {e}");
        }
    }

    #[test]
    fn pd_handler_resolves_profiles_and_decider() {
        let v = json!({
            "plugins": [
                {"type": "prefill-filter"}, {"type": "decode-filter"},
                {"type": "load-aware-pd-decider", "name": "d", "parameters": {"nonCachedTokens": 32, "queueMargin": 2}},
                {"type": "pd-profile-handler", "parameters": {"deciderPluginName": "d"}}
            ],
            "schedulingProfiles": [
                {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
                {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]}
            ]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(
            c.handler,
            Handler::Pd {
                decode: 1,
                prefill: 0,
                decider: DeciderSpec::LoadAware { non_cached_tokens: 32, queue_margin: 2.0 }
            }
        );
    }

    fn single(plugins: Value, refs: Value) -> Value {
        json!({"plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]})
    }

    #[test]
    fn a_plugin_listed_twice_in_a_profile_is_noted_and_a_scorer_keeps_one_summed_weight() {
        let v = single(
            json!([{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}, {"type": "decode-filter"}]),
            json!([
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "decode-filter"},
                {"pluginRef": "kv-cache-utilization-scorer"},
                {"pluginRef": "queue-scorer", "weight": 5},
                {"pluginRef": "decode-filter"}
            ]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        let scorers: Vec<(&str, f64)> =
            c.profiles[0].scorers.iter().map(|s| (s.name.as_str(), s.weight)).collect();
        assert_eq!(scorers, [("queue-scorer", 6.0), ("kv-cache-utilization-scorer", 1.0)]);
        assert_eq!(c.profiles[0].filters.len(), 2, "a filter listed twice runs twice, as in llm-d");
        let keys: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "schedulingProfiles[0].plugins[3].pluginRef",
                "schedulingProfiles[0].plugins[4].pluginRef"
            ]
        );
        assert!(c.notes[0].message.contains("\"default\""), "{:?}", c.notes[0]);
        assert!(c.notes[0].message.contains("add up to 6 (1 + 5)"), "{:?}", c.notes[0]);
    }

    #[test]
    fn scorer_weights_that_cannot_sum_finitely_are_refused_and_all_zero_is_noted() {
        let plugins = json!([{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}]);
        let huge = single(
            plugins.clone(),
            json!([{"pluginRef": "queue-scorer", "weight": 1e308}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 1e308}]),
        );
        let Err(e) = parse(&huge, &Registry::builtin()) else { panic!("1e308 twice accepted") };
        assert_eq!(e.key, "schedulingProfiles[0].plugins");
        let zero = single(
            plugins,
            json!([{"pluginRef": "queue-scorer", "weight": 0}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 0}]),
        );
        let c = parse(&zero, &Registry::builtin()).unwrap();
        assert_eq!(c.notes.len(), 1);
        assert_eq!(c.notes[0].key, "schedulingProfiles[0].plugins");
    }

    #[test]
    fn aliases_build_the_current_plugin_and_note_it() {
        let v = single(
            json!([{"type": "kv-cache-scorer"}, {"type": "prefix-cache", "parameters": {"hashBlockSize": 32}},
                   {"type": "max-score"}, {"type": "single-profile"}]),
            json!([{"pluginRef": "kv-cache-scorer"}, {"pluginRef": "prefix-cache", "weight": 50}, {"pluginRef": "max-score"}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        let keys: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
        assert_eq!(
            keys,
            ["plugins[0].type", "plugins[1].type", "plugins[2].type", "plugins[3].type"]
        );
        assert!(c.notes[0].message.contains("\"kv-cache-utilization-scorer\""), "{:?}", c.notes[0]);
        assert_eq!(c.index_hints.block_size, Some(32));
        assert_eq!(c.profiles[0].scorers.len(), 2);
        let v = json!({
            "plugins": [{"type": "pd-profile-handler", "parameters": {"hashBlockSize": 64}}],
            "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.notes[0].key, "plugins[0].parameters.hashBlockSize");
    }

    #[test]
    fn llm_d_current_pd_profile_handler() {
        // llm-d's pd_profile_handler.go: deciderPluginName defaults to the plugin named
        // "prefix-based-pd-decider"; primaryPort / prefixPluginType / prefixPluginName are its
        // parameters too (they were refused as unknown fields: probe 54 F4).
        let v = json!({
            "plugins": [
                {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 16}},
                {"type": "pd-profile-handler", "parameters": {"primaryPort": 8000,
                    "prefixPluginType": "prefix-cache-scorer", "prefixPluginName": "p"}}],
            "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        let Handler::Pd { decider, .. } = c.handler else { panic!() };
        assert_eq!(decider, DeciderSpec::PrefixBased { non_cached_tokens: 16 });
        let keys: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
        for k in ["primaryPort", "prefixPluginType", "prefixPluginName"] {
            assert!(keys.contains(&format!("plugins[1].parameters.{k}").as_str()), "{keys:?}");
        }
        // Without a plugin of that name, the inline decider with 0 (as before).
        let v = json!({
            "plugins": [{"type": "pd-profile-handler"}],
            "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]
        });
        let Handler::Pd { decider, .. } = parse(&v, &Registry::builtin()).unwrap().handler else {
            panic!()
        };
        assert_eq!(decider, DeciderSpec::PrefixBased { non_cached_tokens: 0 });
    }

    #[test]
    fn llm_ds_label_selector_filter_and_encode_filter() {
        // llm-d registers label-selector-filter, with by-label-selector as its deprecated
        // name, and encode-filter (filter/bylabel/selector.go, roles.go; probe 54 F12).
        let v = single(
            json!([{"type": "label-selector-filter", "parameters": {"matchLabels": {"a": "b"}}},
                   {"type": "by-label-selector", "name": "old"}]),
            json!([{"pluginRef": "label-selector-filter"}, {"pluginRef": "old"}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.profiles[0].filters.len(), 2);
        assert_eq!(c.notes.len(), 1, "{:?}", c.notes);
        assert!(c.notes[0].message.contains("\"label-selector-filter\""));
        let e = parse(&json!({"plugins": [{"type": "encode-filter"}]}), &Registry::builtin());
        assert!(e.err().unwrap().message.contains("encode disaggregation"));
    }

    #[test]
    fn a_profile_without_a_picker_takes_the_declared_one() {
        // config/loader/defaults.go (llm-d, and the Extension since 1.0): a profile listing no
        // picker gets a declared picker, a new max-score-picker only when none is declared
        // (probe 54 F3).
        let v = json!({
            "plugins": [{"type": "queue-scorer"}, {"type": "random-picker", "name": "rp"}],
            "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "queue-scorer"}]}]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.profiles[0].picker_name, "rp");
        assert_eq!(c.notes[0].key, "schedulingProfiles[0].plugins");
        let v = json!({
            "plugins": [{"type": "queue-scorer"}],
            "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "queue-scorer"}]}]
        });
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.profiles[0].picker_name, "max-score-picker");
        assert!(c.notes.is_empty());
    }

    #[test]
    fn trees_resolve_forward_and_nested_references() {
        let v = single(
            json!([
                {"type": "decision-tree-filter", "name": "outer", "parameters": {
                    "current": {"pluginRef": "inner"},
                    "nextOnFailure": {"pluginRef": "least-queue-filter"}}},
                {"type": "decision-tree-filter", "name": "inner", "parameters": {
                    "current": {"pluginRef": "low-queue-filter"}}},
                {"type": "low-queue-filter", "parameters": {"threshold": 2}},
                {"type": "least-queue-filter"}, {"type": "random-picker"}
            ]),
            json!([{"pluginRef": "outer"}, {"pluginRef": "random-picker"}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.profiles[0].filters.len(), 1);
        let cases = [
            (json!({"current": {"pluginRef": "nope"}}), "plugins[0].parameters.current.pluginRef"),
            (
                json!({"current": {"pluginRef": "random-picker"}}),
                "plugins[0].parameters.current.pluginRef",
            ),
            (json!({"current": {"pluginRef": "t"}}), "plugins[0].parameters.current.pluginRef"),
        ];
        for (params, key) in cases {
            let v = single(
                json!([{"type": "decision-tree-filter", "name": "t", "parameters": params},
                       {"type": "random-picker"}]),
                json!([{"pluginRef": "t"}]),
            );
            assert_eq!(err(v).key, key);
        }
    }

    #[test]
    fn sections_are_read_or_refused_by_name() {
        let base =
            single(json!([{"type": "queue-scorer"}]), json!([{"pluginRef": "queue-scorer"}]));
        let with = |k: &str, v: Value| {
            let mut c = base.clone();
            c.as_object_mut().unwrap().insert(k.into(), v);
            c
        };
        let c = parse(
            &with("saturationDetector", json!({"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9, "metricsStalenessThreshold": "1m0.5s"})),
            &Registry::builtin(),
        )
        .unwrap();
        assert_eq!(
            c.saturation,
            Some(SaturationSpec {
                queue_depth_threshold: Some(8),
                kv_cache_util_threshold: Some(0.9),
                metrics_staleness_s: Some(60.5)
            })
        );
        assert!(!c.flow_control);
        let c = parse(
            &with("featureGates", json!(["flowControl", "prepareDataPlugins"])),
            &Registry::builtin(),
        )
        .unwrap();
        assert!(c.flow_control);
        assert_eq!(c.notes.len(), 1);
        assert_eq!(c.notes[0].key, "featureGates[1]");
        let refused = [
            (with("featureGates", json!(["flowControl", "magic"])), "featureGates[1]"),
            (with("saturationDetector", json!({"pluginRef": "d"})), "saturationDetector.pluginRef"),
            (
                with("saturationDetector", json!({"queueDepthThreshold": 0})),
                "saturationDetector.queueDepthThreshold",
            ),
            (
                with("saturationDetector", json!({"kvCacheUtilThreshold": 1.5})),
                "saturationDetector.kvCacheUtilThreshold",
            ),
            (
                with("saturationDetector", json!({"metricsStalenessThreshold": "soon"})),
                "saturationDetector.metricsStalenessThreshold",
            ),
            (
                with("saturationDetector", json!({"metricsStalenessThreshold": 200})),
                "saturationDetector.metricsStalenessThreshold",
            ),
            (with("saturationDetector", json!({"queueDepth": 1})), "saturationDetector.queueDepth"),
            (with("flowControl", json!({})), "flowControl"),
            (with("parser", json!({})), "parser.pluginRef"),
            (with("parser", json!({"pluginRef": "queue-scorer"})), "parser.pluginRef"),
            (with("apiVersion", json!("example.com/v9")), "apiVersion"),
            (with("kind", json!("ConfigMap")), "kind"),
            (with("dataLayer", json!({"discovery": {"pluginRef": "x"}})), "dataLayer.discovery"),
        ];
        for (v, key) in refused {
            assert_eq!(err(v).key, key);
        }
        let mut both = with("data", json!({}));
        both.as_object_mut().unwrap().insert("dataLayer".into(), json!({}));
        assert_eq!(err(both).key, "data");
        assert!(err(with("flowControl", json!({}))).message.contains("`flow`"));
        let c =
            parse(&with("data", json!({"injectDefaults": false})), &Registry::builtin()).unwrap();
        assert_eq!(c.data_layer, Some(DataLayer { sources: vec![], inject_defaults: false }));
        assert_eq!(c.notes[0].key, "data.injectDefaults");
    }

    #[test]
    fn durations() {
        for (text, secs) in [
            ("200ms", 0.2),
            ("2s", 2.0),
            ("1m0s", 60.0),
            ("1h", 3600.0),
            ("1.5s", 1.5),
            ("100us", 1e-4),
            ("0", 0.0),
        ] {
            assert!((parse_duration(text).unwrap() - secs).abs() < 1e-12, "{text}");
        }
        for text in ["", "5", "ms", "1x", "1..2s"] {
            assert!(parse_duration(text).is_err(), "{text}");
        }
    }

    #[test]
    fn precise_spec_and_notes_reach_the_config() {
        let v = single(
            json!([{"type": "precise-prefix-cache-scorer", "parameters": {
                        "tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"},
                        "indexerConfig": {"tokenizersPoolConfig": {"modelName": "m"}},
                        "kvEventsConfig": {"zmqEndpoint": "tcp://*:5557", "topicFilter": "kv@"}}}]),
            json!([{"pluginRef": "precise-prefix-cache-scorer", "weight": 2}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        let (key, spec) = c.precise.unwrap();
        assert_eq!(key, "plugins[0]");
        assert_eq!((spec.block_size, spec.vllm_seed.as_str()), (64, "42"));
        assert_eq!(c.index_hints.block_size, Some(64));
        assert_eq!(c.notes[0].key, "plugins[0].parameters.indexerConfig.tokenizersPoolConfig");
    }

    #[test]
    fn implicit_default_profile_takes_every_filter_scorer_and_picker() {
        let v = json!({"plugins": [
            {"type": "queue-scorer"}, {"type": "decode-filter"}, {"type": "single-profile-handler"},
            {"type": "token-producer", "parameters": {"modelName": "m"}},
            {"type": "kv-cache-utilization-scorer"}, {"type": "random-picker"}
        ]});
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert!(c.default_profile);
        let p = &c.profiles[0];
        assert_eq!(p.name, "default");
        assert_eq!(
            p.filters.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            ["decode-filter"]
        );
        let scorers: Vec<(&str, f64)> =
            p.scorers.iter().map(|s| (s.name.as_str(), s.weight)).collect();
        assert_eq!(scorers, [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0)]);
        assert_eq!(p.picker_name, "random-picker");
        assert_eq!(c.tokenizer, Some(("plugins[3]".to_string(), "m".to_string())));
        assert!(c.notes.iter().any(|n| n.key == "schedulingProfiles"));
        // An empty list is the same as none; no picker gets max-score-picker.
        let v = json!({"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": []});
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!(c.profiles[0].picker_name, "max-score-picker");
    }

    fn disagg(params: Value, profiles: &[&str]) -> Result<RouterConfig, ConfigError> {
        let profiles: Vec<Value> =
            profiles.iter().map(|n| json!({"name": n, "plugins": []})).collect();
        parse(
            &json!({"plugins": [
                {"type": "prefix-based-pd-decider", "name": "d", "parameters": {"nonCachedTokens": 16}},
                {"type": "disagg-headers-handler"},
                {"type": "disagg-profile-handler", "parameters": params}],
                "schedulingProfiles": profiles}),
            &Registry::builtin(),
        )
    }

    #[test]
    fn disagg_handler_resolves_like_llm_d() {
        let pd = |decode, prefill| Handler::Pd {
            decode,
            prefill,
            decider: DeciderSpec::PrefixBased { non_cached_tokens: 16 },
        };
        let c = disagg(json!({"deciders": {"prefill": "d"}}), &["prefill", "decode"]).unwrap();
        assert_eq!(c.handler, pd(1, 0));
        assert_eq!(c.prefill_header, Some(("plugins[1]".to_string(), "x-prefiller-host-port")));
        // Without a prefill decider only the decode profile runs (noted); no header is set.
        let c = disagg(Value::Null, &["prefill", "decode"]).unwrap();
        assert_eq!(c.handler, Handler::Single { profile: 1 });
        assert!(c.notes.iter().any(|n| n.key == "plugins[2].parameters"));
        assert!(c.notes.iter().any(|n| n.key == "plugins[1]"));
        assert_eq!(c.prefill_header, None);
        // Earlier flat names, read with a note each; custom profile names.
        let c = disagg(
            json!({"decodeProfile": "d1", "prefillProfile": "p1", "deciderPluginName": "d"}),
            &["p1", "d1"],
        )
        .unwrap();
        assert_eq!(c.handler, pd(1, 0));
        let keys: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
        assert!(keys.contains(&"plugins[2].parameters.deciderPluginName"), "{keys:?}");
        // Earlier names of the headers handler and llm-d's always-split decider.
        let c = parse(
            &json!({"plugins": [
                {"type": "always-disagg-pd-decider", "name": "d"},
                {"type": "prefill-header-handler"},
                {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "d"}}}],
                "schedulingProfiles": [{"name": "decode", "plugins": []}, {"name": "prefill", "plugins": []}]}),
            &Registry::builtin(),
        )
        .unwrap();
        assert_eq!(
            c.handler,
            Handler::Pd {
                decode: 0,
                prefill: 1,
                decider: DeciderSpec::PrefixBased { non_cached_tokens: 0 }
            }
        );
        assert_eq!(c.notes[0].key, "plugins[1].type");
        // A data producer in a profile takes no slot and no weight.
        let v = single(
            json!([{"type": "token-producer", "parameters": {"modelName": "m"}}, {"type": "queue-scorer"}]),
            json!([{"pluginRef": "token-producer"}, {"pluginRef": "queue-scorer"}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        assert_eq!((c.profiles[0].filters.len(), c.profiles[0].scorers.len()), (0, 1));
        let v = single(
            json!([{"type": "token-producer", "parameters": {"modelName": "m"}}]),
            json!([{"pluginRef": "token-producer", "weight": 2}]),
        );
        assert_eq!(err(v).key, "schedulingProfiles[0].plugins[0].weight");
        // No prefill profile: decode alone, noted at the profile name.
        let c = disagg(json!({"deciders": {"prefill": "d"}}), &["decode"]).unwrap();
        assert_eq!(c.handler, Handler::Single { profile: 0 });
        assert!(c.notes.iter().any(|n| n.key == "plugins[2].parameters.profiles.prefill"));
        for (params, profiles, key) in [
            (
                json!({"deciders": {"prefill": "d"}, "decodeProfile": "x"}),
                &["decode"][..],
                "plugins[2].parameters.decodeProfile",
            ),
            (
                json!({"deciders": {"encode": "d"}}),
                &["decode"],
                "plugins[2].parameters.deciders.encode",
            ),
            (
                json!({"deciders": {"prefill": "nope"}}),
                &["decode", "prefill"],
                "plugins[2].parameters.deciders.prefill",
            ),
            (
                json!({"prefillDeciderPluginName": "plugins"}),
                &["decode", "prefill"],
                "plugins[2].parameters.prefillDeciderPluginName",
            ),
            (
                json!({"profiles": {"decode": "x"}}),
                &["decode"],
                "plugins[2].parameters.profiles.decode",
            ),
            (
                json!({"profiles": {"decode": "a", "prefill": "a"}}),
                &["a"],
                "plugins[2].parameters.profiles.prefill",
            ),
        ] {
            let e = match disagg(params.clone(), profiles) {
                Err(e) => e,
                Ok(_) => panic!("accepted {params}"),
            };
            assert_eq!(e.key, key, "{params} -> {e}");
        }
    }

    fn note_keys(v: &Value) -> Vec<String> {
        parse(v, &Registry::builtin()).unwrap().notes.into_iter().map(|n| n.key).collect()
    }

    #[test]
    fn a_scorer_of_weight_0_beside_weighted_ones_is_noted() {
        let v = single(
            json!([{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}]),
            json!([{"pluginRef": "queue-scorer", "weight": 0}, {"pluginRef": "prefix-cache-scorer", "weight": 2}]),
        );
        assert_eq!(note_keys(&v), ["schedulingProfiles[0].plugins[0].weight"]);
        let weighted = single(
            json!([{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}]),
            json!([{"pluginRef": "queue-scorer", "weight": 0.5}, {"pluginRef": "prefix-cache-scorer"}]),
        );
        assert!(note_keys(&weighted).is_empty());
    }

    #[test]
    fn a_plugin_no_profile_lists_is_noted_unless_a_tree_refers_to_it() {
        let v = single(
            json!([
                {"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}, {"type": "decode-filter"},
                {"type": "low-queue-filter"}, {"type": "random-picker"},
                {"type": "decision-tree-filter", "name": "t", "parameters": {"current": {"pluginRef": "low-queue-filter"}}}
            ]),
            json!([{"pluginRef": "queue-scorer"}, {"pluginRef": "t"}]),
        );
        let c = parse(&v, &Registry::builtin()).unwrap();
        let unused: Vec<&str> = c
            .notes
            .iter()
            .filter(|n| n.message.contains("no scheduling profile lists it"))
            .map(|n| n.key.as_str())
            .collect();
        // The picker is the profile's (taken as its declared picker): not unused.
        assert_eq!(unused, ["plugins[1]", "plugins[2]"]);
        assert!(c.notes.iter().any(|n| n.message.contains("scores nothing")));
    }

    #[test]
    fn a_profile_the_handler_never_runs_is_noted() {
        let v = json!({
            "plugins": [{"type": "pd-profile-handler"}, {"type": "queue-scorer"}],
            "schedulingProfiles": [
                {"name": "decode", "plugins": [{"pluginRef": "queue-scorer"}]},
                {"name": "prefill", "plugins": [{"pluginRef": "queue-scorer"}]},
                {"name": "spare", "plugins": [{"pluginRef": "queue-scorer"}]}
            ]
        });
        assert_eq!(note_keys(&v), ["schedulingProfiles[2]"]);
    }

    #[test]
    fn two_different_lru_capacities_are_refused() {
        let v = single(
            json!([
                {"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": 10}},
                {"type": "prefix-cache-scorer", "name": "p2", "parameters": {"lruCapacityPerServer": 20}}
            ]),
            json!([{"pluginRef": "prefix-cache-scorer"}, {"pluginRef": "p2"}]),
        );
        let err = parse(&v, &Registry::builtin()).err().unwrap();
        assert_eq!(err.key, "plugins[1].parameters.lruCapacityPerServer");
        let same = single(
            json!([
                {"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": 10}},
                {"type": "prefix-cache-scorer", "name": "p2", "parameters": {"lruCapacityPerServer": 10}}
            ]),
            json!([{"pluginRef": "prefix-cache-scorer"}, {"pluginRef": "p2"}]),
        );
        assert_eq!(
            parse(&same, &Registry::builtin()).unwrap().index_hints.worker_capacity,
            Some(10)
        );
    }

    #[test]
    fn scorers_under_a_picker_that_reads_no_scores_are_noted() {
        for picker in
            ["random-picker", "round-robin-picker", "softmax-cost-picker", "cache-aware-picker"]
        {
            let v = single(
                json!([{"type": "queue-scorer"}, {"type": picker}]),
                json!([{"pluginRef": "queue-scorer", "weight": 0}, {"pluginRef": picker}]),
            );
            let c = parse(&v, &Registry::builtin()).unwrap();
            let keys: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
            assert_eq!(keys, ["schedulingProfiles[0].plugins"], "{picker}");
            assert!(c.notes[0].message.contains("without reading scores"), "{picker}");
        }
        for picker in ["max-score-picker", "weighted-random-picker", "power-of-two-picker"] {
            let v = single(
                json!([{"type": "queue-scorer"}, {"type": picker}]),
                json!([{"pluginRef": "queue-scorer"}, {"pluginRef": picker}]),
            );
            assert!(note_keys(&v).is_empty(), "{picker}");
        }
    }
}
