//! Data plugins and the data layer: what llm-d runs beside scheduling rather than in a profile.
//!
//! - `token-producer` (earlier `tokenizer`): tokenizes the prompt with `modelName`'s tokenizer
//!   before the filters and scorers run, so the precise prefix scorer hashes real token ids.
//!   Here the caller tokenizes (the gateway with its `tokenizer`, looked up from `modelName`
//!   when not set); the router reads the model name, never calls vLLM's render endpoint.
//! - `endpoint-notification-source`: delivers endpoint add / remove events to its extractors.
//!   Here endpoints enter and leave through the pool: the gateway removes a departed engine
//!   from the pool, the index and the KV-event subscription, and subscribes to a new one.
//! - `metrics-data-source` with `core-metrics-extractor`: poll each endpoint's Prometheus
//!   metrics and read the waiting and running requests, KV-cache use and LoRA adapters from
//!   them. Here that is the gateway's scraper (`scrape`), which maps vLLM's and SGLang's metric
//!   names itself; the source's `path` becomes the engines' metrics path.
//! - the `dataLayer` section (the Inference Extension calls it `data`): sources, each with
//!   extractors, and an optional discovery plugin. A source must name a data-source plugin,
//!   each extractor a plugin that extracts what that source delivers (the precise prefix
//!   scorer extracts endpoint events, `core-metrics-extractor` metrics); `injectDefaults`
//!   adds the metrics source, which here is the gateway's scraper.
//!
//! A data plugin listed in a scheduling profile takes no slot there (as in the Extension,
//! where a profile only assigns filters, scorers and pickers) and takes no weight.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::registry::{decode, defaults_of, ParamDoc, ParamError, Plugin, PluginDoc};

/// A data plugin as configured.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSpec {
    /// The prompt is tokenized with this model's tokenizer; `notes` are parameters read
    /// without effect (path under `parameters`, why).
    Tokenizer { model: String, notes: Vec<(String, String)> },
    /// Endpoint add / remove events.
    EndpointNotifications,
    /// Each endpoint's Prometheus metrics, polled at `path`; `notes` as above.
    MetricsSource { path: String, notes: Vec<(String, String)> },
    /// Queue, running requests, KV-cache use and adapters read from those metrics.
    MetricsExtractor { notes: Vec<(String, String)> },
}

/// What a data-layer source delivers, and so which extractors it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    Endpoints,
    Metrics,
}

impl Feed {
    fn name(self) -> &'static str {
        match self {
            Feed::Endpoints => "endpoint events",
            Feed::Metrics => "metrics",
        }
    }
}

impl DataSpec {
    /// What the plugin delivers, when it is a data-layer source.
    pub fn source_feed(&self) -> Option<Feed> {
        match self {
            DataSpec::EndpointNotifications => Some(Feed::Endpoints),
            DataSpec::MetricsSource { .. } => Some(Feed::Metrics),
            _ => None,
        }
    }

    /// Whether the plugin is a data-layer source.
    pub fn is_source(&self) -> bool {
        self.source_feed().is_some()
    }

    /// Parameters read without effect (path under `parameters`, why).
    pub fn notes(&self) -> &[(String, String)] {
        match self {
            DataSpec::Tokenizer { notes, .. }
            | DataSpec::MetricsSource { notes, .. }
            | DataSpec::MetricsExtractor { notes } => notes,
            DataSpec::EndpointNotifications => &[],
        }
    }
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct TokenizerParams {
    model_name: String,
    vllm: Option<VllmRender>,
    uds_tokenizer_config: Option<Map<String, Value>>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct VllmRender {
    http: Option<String>,
    timeout: Option<String>,
    mm_timeout: Option<String>,
}

/// `token-producer` / `tokenizer`: `modelName` (required), `vllm.http` / `timeout` /
/// `mmTimeout` or `udsTokenizerConfig` (where llm-d tokenizes; accepted without effect).
pub fn tokenizer_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: TokenizerParams = decode(params)?;
    if p.model_name.is_empty() {
        return Err(ParamError::new("modelName", "is required (the model whose tokenizer to use)"));
    }
    if p.vllm.is_some() && p.uds_tokenizer_config.is_some() {
        return Err(ParamError::new("vllm", "give either vllm or udsTokenizerConfig, not both"));
    }
    let mut notes = Vec::new();
    if let Some(v) = &p.vllm {
        for (field, set) in [
            ("http", v.http.is_some()),
            ("timeout", v.timeout.is_some()),
            ("mmTimeout", v.mm_timeout.is_some()),
        ] {
            if set {
                notes.push((
                    format!("vllm.{field}"),
                    "has no effect: the router does not call vLLM's render endpoint; the \
                     caller tokenizes (the gateway with its `tokenizer`)"
                        .to_string(),
                ));
            }
        }
    }
    if p.uds_tokenizer_config.is_some() {
        notes.push((
            "udsTokenizerConfig".to_string(),
            "has no effect: the caller tokenizes (the gateway with its `tokenizer`)".to_string(),
        ));
    }
    Ok(Plugin::Data(DataSpec::Tokenizer { model: p.model_name, notes }))
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

/// `endpoint-notification-source`: no parameters.
pub fn endpoint_notifications_factory(params: &Value) -> Result<Plugin, ParamError> {
    let _: NoParams = decode(params)?;
    Ok(Plugin::Data(DataSpec::EndpointNotifications))
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct MetricsSourceParams {
    scheme: String,
    path: String,
    insecure_skip_verify: Option<bool>,
}

impl Default for MetricsSourceParams {
    fn default() -> Self {
        MetricsSourceParams {
            scheme: "http".into(),
            path: "/metrics".into(),
            insecure_skip_verify: None,
        }
    }
}

/// `metrics-data-source`: `scheme` ("http"; the gateway's scraper speaks http), `path`
/// ("/metrics"), `insecureSkipVerify` (only meaningful for https; accepted without effect).
pub fn metrics_source_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: MetricsSourceParams = decode(params)?;
    if p.scheme != "http" {
        return Err(ParamError::new(
            "scheme",
            format!(
                "{:?} is not supported: the gateway's scraper reads metrics over http",
                p.scheme
            ),
        ));
    }
    if !p.path.starts_with('/') {
        return Err(ParamError::new("path", "must start with '/'"));
    }
    let mut notes = Vec::new();
    if p.insecure_skip_verify.is_some() {
        notes.push((
            "insecureSkipVerify".to_string(),
            "has no effect: metrics are read over http, without TLS".to_string(),
        ));
    }
    Ok(Plugin::Data(DataSpec::MetricsSource { path: p.path, notes }))
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct MetricsExtractorParams {
    engine_label_key: Option<String>,
    default_engine: Option<String>,
    engine_configs: Option<Value>,
}

/// `core-metrics-extractor`: `defaultEngine` ("vllm" or "sglang"; both are recognised from
/// their metric names), `engineLabelKey` (accepted without effect), `engineConfigs` (custom
/// metric names: refused).
pub fn metrics_extractor_factory(params: &Value) -> Result<Plugin, ParamError> {
    let p: MetricsExtractorParams = decode(params)?;
    if p.engine_configs.is_some() {
        return Err(ParamError::new(
            "engineConfigs",
            "custom metric names are not supported: the gateway's scraper reads vLLM's and \
             SGLang's metric names",
        ));
    }
    if let Some(engine) = &p.default_engine {
        if engine != "vllm" && engine != "sglang" {
            return Err(ParamError::new(
                "defaultEngine",
                format!("{engine:?} is not supported: the scraper reads vllm and sglang metrics"),
            ));
        }
    }
    let mut notes = Vec::new();
    for (field, set) in [
        ("engineLabelKey", p.engine_label_key.is_some()),
        ("defaultEngine", p.default_engine.is_some()),
    ] {
        if set {
            notes.push((
                field.to_string(),
                "has no effect: the scraper recognises the engine from its metric names"
                    .to_string(),
            ));
        }
    }
    Ok(Plugin::Data(DataSpec::MetricsExtractor { notes }))
}

const TOKENIZER_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("modelName", "the model whose tokenizer tokenizes the prompt").required(),
    ParamDoc::string("vllm.http", "vLLM's render endpoint: accepted without effect"),
    ParamDoc::string("vllm.timeout", "accepted without effect"),
    ParamDoc::string("vllm.mmTimeout", "accepted without effect"),
    ParamDoc::mapping("udsTokenizerConfig", "a tokenizer sidecar: accepted without effect"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn tokenizer_doc() -> PluginDoc {
    PluginDoc::new(
        "data producer",
        "the prompt is tokenized with `modelName`'s tokenizer (by the caller; the gateway's)",
        TOKENIZER_PARAMS,
        defaults_of::<TokenizerParams>(),
    )
}

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn endpoint_notifications_doc() -> PluginDoc {
    PluginDoc::new(
        "data source",
        "endpoint add / remove events (the pool's engine changes)",
        &[],
        defaults_of::<NoParams>(),
    )
}

const METRICS_SOURCE_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("scheme", "how metrics are read").choices(&["http"]),
    ParamDoc::string("path", "the engines' metrics path (starts with '/')"),
    ParamDoc::boolean("insecureSkipVerify", "TLS only: accepted without effect"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn metrics_source_doc() -> PluginDoc {
    PluginDoc::new(
        "data source",
        "each engine's Prometheus metrics, read by the gateway's scraper",
        METRICS_SOURCE_PARAMS,
        defaults_of::<MetricsSourceParams>(),
    )
}

const METRICS_EXTRACTOR_PARAMS: &[ParamDoc] = &[
    ParamDoc::string("engineLabelKey", "accepted without effect"),
    ParamDoc::string("defaultEngine", "accepted without effect (recognised from the names)")
        .choices(&["vllm", "sglang"]),
    ParamDoc::list("engineConfigs", "custom metric names: refused"),
];

/// The catalogue entry (see [`crate::routing::registry::PluginDoc`]).
pub fn metrics_extractor_doc() -> PluginDoc {
    PluginDoc::new(
        "data producer",
        "queue, running requests, KV-cache use and adapters from vLLM's or SGLang's metrics",
        METRICS_EXTRACTOR_PARAMS,
        defaults_of::<MetricsExtractorParams>(),
    )
}

/// One data-layer source and the plugins extracting from it, by name.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSource {
    pub source: String,
    pub extractors: Vec<String>,
}

/// The `dataLayer` (or `data`) section.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataLayer {
    pub sources: Vec<DataSource>,
    /// `injectDefaults` (default true): the metrics source the gateway's scraper provides.
    pub inject_defaults: bool,
}

/// What a data-layer reference may name, for the checks of [`parse_data_layer`].
#[derive(Debug, Clone, Copy)]
pub enum RefKind<'a> {
    Missing,
    Source(Feed),
    /// A plugin that extracts what a source of this feed delivers (the precise prefix scorer
    /// extracts endpoint events, `core-metrics-extractor` metrics).
    Extractor(Feed),
    Other(&'a str),
}

/// Reads the data-layer section at `at`; `lookup` says what a plugin name refers to.
pub fn parse_data_layer(
    v: &Value,
    at: &str,
    lookup: &dyn Fn(&str) -> RefKind<'static>,
) -> Result<DataLayer, (String, String)> {
    let map = v.as_object().ok_or_else(|| (at.to_string(), "must be a mapping".to_string()))?;
    let allowed = ["sources", "injectDefaults", "discovery"];
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err((format!("{at}.{k}"), format!("unknown key (expected one of {allowed:?})")));
    }
    if map.contains_key("discovery") {
        return Err((
            format!("{at}.discovery"),
            "an endpoint discovery plugin is not supported: the gateway's engines come from \
             `engines` or its discovery file (`discovery.file`)"
                .to_string(),
        ));
    }
    let inject_defaults = match map.get("injectDefaults") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err((format!("{at}.injectDefaults"), "must be a bool".to_string())),
    };
    let mut layer = DataLayer { sources: Vec::new(), inject_defaults };
    let sources = match map.get("sources") {
        None => return Ok(layer),
        Some(Value::Array(a)) => a,
        Some(_) => return Err((format!("{at}.sources"), "must be a list".to_string())),
    };
    for (i, sv) in sources.iter().enumerate() {
        let sat = format!("{at}.sources[{i}]");
        let smap = sv.as_object().ok_or_else(|| (sat.clone(), "must be a mapping".to_string()))?;
        if let Some(k) = smap.keys().find(|k| *k != "pluginRef" && *k != "extractors") {
            return Err((
                format!("{sat}.{k}"),
                "unknown key (expected one of [\"pluginRef\", \"extractors\"])".to_string(),
            ));
        }
        let source = reference(smap.get("pluginRef"), &format!("{sat}.pluginRef"))?;
        let feed = match lookup(&source) {
            RefKind::Source(feed) => feed,
            RefKind::Missing => {
                return Err((format!("{sat}.pluginRef"), format!("no plugin named {source:?}")))
            }
            RefKind::Extractor(_) | RefKind::Other(_) => {
                return Err((
                    format!("{sat}.pluginRef"),
                    format!(
                        "{source:?} is not a data source (known sources: \
                         endpoint-notification-source, metrics-data-source)"
                    ),
                ))
            }
        };
        if layer.sources.iter().any(|s| s.source == source) {
            return Err((format!("{sat}.pluginRef"), format!("{source:?} is listed twice")));
        }
        let mut extractors = Vec::new();
        let list = match smap.get("extractors") {
            Some(Value::Array(a)) => a.as_slice(),
            None => &[],
            Some(_) => return Err((format!("{sat}.extractors"), "must be a list".to_string())),
        };
        for (j, ev) in list.iter().enumerate() {
            let eat = format!("{sat}.extractors[{j}]");
            let emap =
                ev.as_object().ok_or_else(|| (eat.clone(), "must be a mapping".to_string()))?;
            if let Some(k) = emap.keys().find(|k| *k != "pluginRef") {
                return Err((
                    format!("{eat}.{k}"),
                    "unknown key (expected one of [\"pluginRef\"])".to_string(),
                ));
            }
            let name = reference(emap.get("pluginRef"), &format!("{eat}.pluginRef"))?;
            match lookup(&name) {
                RefKind::Extractor(f) if f == feed => extractors.push(name),
                RefKind::Missing => {
                    return Err((format!("{eat}.pluginRef"), format!("no plugin named {name:?}")))
                }
                RefKind::Source(_) => {
                    return Err((
                        format!("{eat}.pluginRef"),
                        format!("{name:?} is a data source, not an extractor"),
                    ))
                }
                RefKind::Extractor(_) | RefKind::Other(_) => {
                    return Err((
                        format!("{eat}.pluginRef"),
                        format!(
                            "{name:?} extracts nothing from {} ({})",
                            feed.name(),
                            match feed {
                                Feed::Endpoints => "the precise prefix scorer does",
                                Feed::Metrics => "core-metrics-extractor does",
                            }
                        ),
                    ))
                }
            }
        }
        layer.sources.push(DataSource { source, extractors });
    }
    Ok(layer)
}

fn reference(v: Option<&Value>, key: &str) -> Result<String, (String, String)> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        None => Err((key.to_string(), "is required".to_string())),
        Some(_) => Err((key.to_string(), "must be a non-empty string".to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lookup(name: &str) -> RefKind<'static> {
        match name {
            "notify" => RefKind::Source(Feed::Endpoints),
            "precise" => RefKind::Extractor(Feed::Endpoints),
            "scrape" => RefKind::Source(Feed::Metrics),
            "core" => RefKind::Extractor(Feed::Metrics),
            "queue" => RefKind::Other("scorer"),
            _ => RefKind::Missing,
        }
    }

    #[test]
    fn data_layer_sources_and_their_errors() {
        let ok =
            json!({"sources": [{"pluginRef": "notify", "extractors": [{"pluginRef": "precise"}]}]});
        let layer = parse_data_layer(&ok, "dataLayer", &lookup).unwrap();
        assert_eq!(layer.sources[0].extractors, ["precise"]);
        assert!(layer.inject_defaults);
        let cases = [
            (json!([]), "dataLayer"),
            (json!({"injectDefaults": 1}), "dataLayer.injectDefaults"),
            (json!({"discovery": {"pluginRef": "x"}}), "dataLayer.discovery"),
            (json!({"sources": [{"pluginRef": "nope"}]}), "dataLayer.sources[0].pluginRef"),
            (json!({"sources": [{"pluginRef": "queue"}]}), "dataLayer.sources[0].pluginRef"),
            (
                json!({"sources": [{"pluginRef": "notify", "extractors": [{"pluginRef": "queue"}]}]}),
                "dataLayer.sources[0].extractors[0].pluginRef",
            ),
            (
                json!({"sources": [{"pluginRef": "notify"}, {"pluginRef": "notify"}]}),
                "dataLayer.sources[1].pluginRef",
            ),
            (json!({"sources": [{"pluginRef": "notify", "x": 1}]}), "dataLayer.sources[0].x"),
            (
                json!({"sources": [{"pluginRef": "scrape", "extractors": [{"pluginRef": "precise"}]}]}),
                "dataLayer.sources[0].extractors[0].pluginRef",
            ),
        ];
        let both = json!({"sources": [
            {"pluginRef": "scrape", "extractors": [{"pluginRef": "core"}]},
            {"pluginRef": "notify", "extractors": [{"pluginRef": "precise"}]}]});
        assert_eq!(parse_data_layer(&both, "data", &lookup).unwrap().sources.len(), 2);
        for (v, key) in cases {
            let (k, _) = parse_data_layer(&v, "dataLayer", &lookup).unwrap_err();
            assert_eq!(k, key, "{v}");
        }
    }

    #[test]
    fn metrics_source_and_extractor_parameters() {
        let Plugin::Data(DataSpec::MetricsSource { path, notes }) =
            metrics_source_factory(&json!({"path": "/m", "insecureSkipVerify": true})).unwrap()
        else {
            panic!("not a metrics source")
        };
        assert_eq!((path.as_str(), notes[0].0.as_str()), ("/m", "insecureSkipVerify"));
        for (params, field) in [
            (json!({"scheme": "https"}), "scheme"),
            (json!({"path": "m"}), "path"),
            (json!({"port": 1}), "port"),
        ] {
            let Err(e) = metrics_source_factory(&params) else { panic!("accepted {params}") };
            assert_eq!(e.path, field);
        }
        assert!(metrics_extractor_factory(&json!({"defaultEngine": "sglang"})).is_ok());
        for (params, field) in [
            (json!({"defaultEngine": "triton-tensorrt-llm"}), "defaultEngine"),
            (json!({"engineConfigs": []}), "engineConfigs"),
        ] {
            let Err(e) = metrics_extractor_factory(&params) else { panic!("accepted {params}") };
            assert_eq!(e.path, field);
        }
    }

    #[test]
    fn tokenizer_parameters() {
        let Plugin::Data(DataSpec::Tokenizer { model, notes }) =
            tokenizer_factory(&json!({"modelName": "m", "vllm": {"http": "http://x:8000"}}))
                .unwrap()
        else {
            panic!("not a tokenizer")
        };
        assert_eq!(model, "m");
        assert_eq!(notes[0].0, "vllm.http");
        for (params, path) in [
            (json!({}), "modelName"),
            (json!({"modelName": "m", "vllm": {}, "udsTokenizerConfig": {}}), "vllm"),
            (json!({"modelName": "m", "vllm": {"grpc": 1}}), "vllm.grpc"),
        ] {
            let Err(e) = tokenizer_factory(&params) else { panic!("accepted {params}") };
            assert_eq!(e.path, path, "{params}");
        }
    }
}
