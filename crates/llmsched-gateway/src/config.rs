//! The gateway's configuration ([`GatewayConfig`], its engines as [`EngineEntry`]), the checks
//! that refuse a bad one ([`ConfigProblem`]), and the building of a gateway from it: its
//! upstreams, router, guards and hooks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use hyper::header::HeaderName;
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, WorkerKey};
use llmsched_core::routing::{
    parse_config, presets, EndpointPool, Router, RouterOptions, StalePolicy,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::by_id::Locating;
use crate::engines::ChangeCount;
use crate::guards::ApiKeyConfig;
use crate::health::HealthConfig;
use crate::metrics::Counters;
use crate::probes::CutReports;
use crate::{
    admin, conversation, flow, guards, health, monotonic, pool, responses, session_token, slicing,
    tokcache, tokenize, Gateway, Hooks, RouterSource, Upstream, Upstreams,
};

/// The most worker threads a gateway runs on (`threads`, `--threads`; the Python
/// configuration's `native_threads` has the same bound).
pub const MAX_THREADS: usize = 64;

/// What a gateway serves and how. Deserializes from JSON with these field names (what
/// `llmsched serve` passes); fields left out keep their defaults.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// The engines: base URLs (`http://127.0.0.1:8000`, id `127.0.0.1:8000`) or
    /// `{"id": ..., "url": ...}`.
    pub engines: Vec<EngineEntry>,
    /// Models served (`model` of a request must be one; empty: any, and `/v1/models` is the
    /// first engine's answer).
    pub models: Vec<String>,
    /// LoRA adapters served, each with its base model (one of `models`): a request naming
    /// an adapter goes to the engines of its base model, and its prompt is hashed, matched
    /// and recorded under the adapter, as vLLM keys the adapter's cache blocks by its name.
    pub lora_adapters: HashMap<String, String>,
    /// The router configuration: a preset name (`llm-d`, `round-robin`, ...) or llm-d's
    /// `EndpointPickerConfig` shape as JSON. Unused when a router is given.
    pub router: Value,
    /// Tokens per block of the prefix index. Unused when a router is given.
    pub block_size: usize,
    /// The largest request body accepted (413 beyond it).
    pub max_body: usize,
    /// The bytes of all the request bodies being received at once (at least `max_body`;
    /// [`guards::BodyBudget`]): a body that would pass it is refused with a 503
    /// `body-capacity`.
    pub max_body_in_flight: usize,
    /// Further endpoints tried when one refuses the connection (or answers 5xx) before the
    /// first byte.
    pub retries: usize,
    /// Whether a 5xx answer is retried (false: relayed at once).
    pub retry_on_5xx: bool,
    /// Base interval of the metrics scrape; `None` disables it.
    pub scrape_interval_s: Option<f64>,
    /// A scrape's timeout.
    pub scrape_timeout_s: f64,
    /// Seed of the router's random choices. Unused when a router is given.
    pub seed: u64,
    /// Flow control (the input format of `llmsched.FlowController`); `None`: off.
    pub flow: Option<Value>,
    /// API keys (empty: no authentication; tenant and priority from the headers).
    pub api_keys: Vec<ApiKeyConfig>,
    /// `Retry-After` of flow-control refusals and 503s.
    pub retry_after_s: u64,
    /// Bound on reading a request body (408 after it).
    pub body_timeout_s: f64,
    /// A client connection idle this long between requests (or whose headers do not all
    /// arrive) is closed.
    pub idle_timeout_s: f64,
    /// Upstream connect timeout (None: none).
    pub connect_timeout_s: Option<f64>,
    /// Longest upstream silence: before the status line (504) and between frames (cut).
    pub read_timeout_s: Option<f64>,
    /// A request's deadline from arrival, queueing and streaming included.
    pub total_timeout_s: Option<f64>,
    /// Client connections open at once (one more gets a 503 and is closed); also the listen
    /// backlog ([`listen_backlog`](crate::listen_backlog)).
    pub max_connections: usize,
    /// Request headers at most (more: 431).
    pub max_headers: usize,
    /// Bytes of one header (name and value) at most (more: 431).
    pub max_field_size: usize,
    /// Bytes of the request target at most (more: 414).
    pub max_line_size: usize,
    /// Distinct tenant names taken from headers (later ones share `~overflow`).
    pub max_tenants: usize,
    /// How long a header tenant name holds its place unseen.
    pub tenant_idle_s: f64,
    /// How long the stored responses of an engine that left are kept for its return
    /// ([`responses::Owners`]); `None`: forgotten at once.
    pub left_grace_s: Option<f64>,
    /// Engine health (probes, circuit breaker).
    pub health: HealthConfig,
    /// The header naming the prefill endpoint of a disaggregated request (None: off).
    pub pd_header: Option<String>,
    /// Tokio worker threads of an in-process gateway (1: everything on one thread; at most
    /// [`MAX_THREADS`]).
    pub threads: usize,
    /// A `save_pretrained` tokenizer directory: prompts are routed on the token ids an
    /// engine loading it computes ([`tokenize::PromptTokenizer`]); `None`: token ids as
    /// given, text hashed as pseudo-tokens.
    pub tokenizer: Option<String>,
    /// Bytes of the tokenizer's piece cache ([`tokcache`]: chat prompts' text between added
    /// tokens and its ids, least recently used evicted); 0: no cache.
    pub tokenizer_cache_bytes: usize,
    /// How the chat template takes list contents, as the engines were told with vLLM's
    /// `--chat-template-content-format` (`"string"` or `"openai"`); `None` (`"auto"`): detected
    /// from the template as vLLM detects it.
    #[serde(deserialize_with = "content_format")]
    pub chat_template_content_format: Option<conversation::ContentFormat>,
    /// The chat template's text in place of the tokenizer directory's own (the engines'
    /// `--chat-template`).
    pub chat_template: Option<String>,
    /// Template variables under every request's `chat_template_kwargs` (a JSON object, the
    /// engines' `--default-chat-template-kwargs`).
    pub default_chat_template_kwargs: Option<Box<serde_json::value::RawValue>>,
    /// Whether a request's `tool_choice` of `"none"` leaves its tools out of the template (the
    /// engines' `--exclude-tools-when-tool-choice-none`).
    pub exclude_tools_when_tool_choice_none: bool,
    /// Whether a request's own `chat_template` is rendered (the engines'
    /// `--trust-request-chat-template`); without, such a request is a 400, as the engines
    /// answer it.
    pub trust_request_chat_template: bool,
    /// Token slices ([`slicing`]); `None`: off.
    pub slices: Option<slicing::SlicesConfig>,
    /// The admin API ([`admin`]); `None`: its routes do not exist.
    pub admin: Option<admin::AdminConfig>,
    /// Whether a router that reads nothing of the prefix index (round-robin, random,
    /// least-load: [`RouterConfig::reads_prefix_match`]) still hashes each prompt, matches it
    /// and records its blocks there for the engine it is sent to. Off (the default), such a
    /// router decides on no hashes and the index holds only what engines' KV events report.
    ///
    /// [`RouterConfig::reads_prefix_match`]: llmsched_core::routing::RouterConfig::reads_prefix_match
    pub record_unread_prefixes: bool,
    /// The engines' context length (vLLM's `--max-model-len`), what a request's
    /// `truncate_prompt_tokens` of -1 keeps less one ([`truncation`](crate::truncation)); `None`: unknown until
    /// [`Running::set_max_model_len`](crate::Running::set_max_model_len) says (Python sets it from the engines'
    /// `/v1/models`), and such a prompt is hashed whole meanwhile.
    pub max_model_len: Option<usize>,
    /// The Kubernetes namespace of the engines when they come from Kubernetes discovery
    /// (their ids are their pods' names): an engine's session token (`x-session-token`) is
    /// then that of `<namespace>/<id>`, its pod's namespaced name, as llm-d mints it
    /// ([`session_token`]); `None`: the token of its id.
    pub session_token_namespace: Option<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            engines: Vec::new(),
            models: Vec::new(),
            lora_adapters: HashMap::new(),
            router: json!("llm-d"),
            block_size: 16,
            max_body: 16 << 20,
            max_body_in_flight: 256 << 20,
            retries: 2,
            retry_on_5xx: true,
            scrape_interval_s: Some(0.2),
            scrape_timeout_s: 1.0,
            seed: 0,
            flow: None,
            api_keys: Vec::new(),
            retry_after_s: 1,
            body_timeout_s: 30.0,
            idle_timeout_s: 60.0,
            connect_timeout_s: Some(2.0),
            read_timeout_s: Some(600.0),
            total_timeout_s: Some(1800.0),
            max_connections: 4096,
            max_headers: 64,
            max_field_size: 8190,
            max_line_size: 8190,
            max_tenants: 10_000,
            tenant_idle_s: 300.0,
            left_grace_s: Some(responses::OWNER_GRACE.as_secs_f64()),
            health: HealthConfig { interval_s: None, ..HealthConfig::default() },
            pd_header: None,
            threads: 1,
            tokenizer: None,
            tokenizer_cache_bytes: tokcache::DEFAULT_CAPACITY,
            chat_template_content_format: None,
            chat_template: None,
            default_chat_template_kwargs: None,
            exclude_tools_when_tool_choice_none: false,
            trust_request_chat_template: false,
            slices: None,
            admin: None,
            record_unread_prefixes: false,
            max_model_len: None,
            session_token_namespace: None,
        }
    }
}

/// `chat_template_content_format`: `"auto"` (or absent) is `None`.
fn content_format<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<conversation::ContentFormat>, D::Error> {
    let name = String::deserialize(deserializer)?;
    match name.as_str() {
        "auto" => Ok(None),
        "string" => Ok(Some(conversation::ContentFormat::String)),
        "openai" => Ok(Some(conversation::ContentFormat::OpenAi)),
        other => Err(serde::de::Error::custom(format!(
            "chat_template_content_format: {other:?} is not one of auto, string, openai"
        ))),
    }
}

/// One engine: its base URL, with the id it has in the router's pool (default: the URL's
/// `host:port`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum EngineEntry {
    /// A base URL.
    Url(String),
    /// An id and a base URL.
    Named {
        /// The id in the pool.
        id: String,
        /// The base URL.
        url: String,
    },
}

impl From<String> for EngineEntry {
    fn from(url: String) -> Self {
        EngineEntry::Url(url)
    }
}

/// A configuration the gateway cannot start with.
#[derive(Debug)]
pub struct ConfigProblem(pub String);

impl std::fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigProblem {}

/// Seconds an idle upstream connection is kept open.
const POOL_IDLE_S: u64 = 60;

fn router_config(value: &Value) -> Result<Value, ConfigProblem> {
    match value {
        Value::String(name) => presets::preset(name).ok_or_else(|| {
            ConfigProblem(format!(
                "router: {name:?} is not a preset (one of {})",
                presets::NAMES.join(", ")
            ))
        }),
        Value::Object(_) => Ok(value.clone()),
        _ => Err(ConfigProblem("router: must be a preset name or a JSON object".into())),
    }
}

pub(crate) fn upstream(
    entry: &EngineEntry,
    config: &GatewayConfig,
) -> Result<Upstream, ConfigProblem> {
    let (named, base) = match entry {
        EngineEntry::Url(url) => (None, url.as_str()),
        EngineEntry::Named { id, url } => (Some(id.clone()), url.as_str()),
    };
    let base = base.trim_end_matches('/');
    let not_http = || ConfigProblem(format!("engines: {base:?} is not an http:// URL"));
    let uri = base
        .parse::<Uri>()
        .ok()
        .filter(|u| u.scheme_str() == Some("http") && u.authority().is_some())
        .ok_or_else(not_http)?;
    let id = match named {
        Some(id) => id,
        None => uri.authority().map(|a| a.to_string()).ok_or_else(not_http)?,
    };
    let at = |path: &str| format!("{base}{path}").parse::<Uri>().map_err(|_| not_http());
    let prefix = uri.path().trim_end_matches('/');
    let path = |path: &str| format!("{prefix}{path}").parse::<Uri>().map_err(|_| not_http());
    let connections = pool::Connections::new(
        &uri,
        config.connect_timeout_s.map(Duration::from_secs_f64),
        Duration::from_secs(POOL_IDLE_S),
    )
    .map_err(|e| ConfigProblem(format!("engines: {e}")))?;
    Ok(Upstream {
        key: WorkerKey::Str(id.clone()),
        label: Arc::from(id.as_str()),
        id,
        completions: at("/v1/completions")?,
        completions_path: path("/v1/completions")?,
        chat_path: path("/v1/chat/completions")?,
        responses_path: path("/v1/responses")?,
        prefix: prefix.to_owned(),
        connections,
        metrics: at("/metrics")?,
        models: at("/v1/models")?,
        probe: Uri::default(),
        health: Mutex::new(health::Health::default()),
        parked: Mutex::new(None),
        scrape_failed: std::sync::atomic::AtomicBool::new(false),
        block_size: std::sync::atomic::AtomicU32::new(0),
    })
}

/// Bytes the prefix index of a gateway that makes its own may use.
pub const DEFAULT_INDEX_MAX_BYTES: u64 = 1 << 30;

fn owned_router(config: &GatewayConfig) -> Result<Router, ConfigProblem> {
    let parsed = parse_config(&router_config(&config.router)?)
        .map_err(|e| ConfigProblem(format!("router: {e}")))?;
    // Bounded as `llmsched serve` bounds it (its `index` section's defaults).
    let index = PrefixIndex::new(IndexConfig {
        block_size: config.block_size,
        worker_capacity: parsed.index_hints.worker_capacity,
        max_bytes: Some(DEFAULT_INDEX_MAX_BYTES),
        ..Default::default()
    })
    .map_err(|e| ConfigProblem(format!("block_size: {e}")))?;
    let pool = EndpointPool::new(StalePolicy::default())
        .map_err(|e| ConfigProblem(format!("pool: {e}")))?;
    let options = RouterOptions { seed: config.seed, ..RouterOptions::default() };
    Router::new(Arc::new(pool), Arc::new(index), parsed, options)
        .map_err(|e| ConfigProblem(format!("router: {e}")))
}

fn check(config: &GatewayConfig) -> Result<(), ConfigProblem> {
    let positive = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(ConfigProblem(format!("{name}: must be a number of seconds > 0, got {v}")))
        }
    };
    positive("body_timeout_s", config.body_timeout_s)?;
    positive("idle_timeout_s", config.idle_timeout_s)?;
    positive("scrape_timeout_s", config.scrape_timeout_s)?;
    positive("tenant_idle_s", config.tenant_idle_s)?;
    positive("health.timeout_s", config.health.timeout_s)?;
    positive("health.eject_s", config.health.eject_s)?;
    positive("health.breaker_window_s", config.health.breaker_window_s)?;
    positive("health.breaker_open_s", config.health.breaker_open_s)?;
    for (name, value) in [
        ("connect_timeout_s", config.connect_timeout_s),
        ("read_timeout_s", config.read_timeout_s),
        ("total_timeout_s", config.total_timeout_s),
        ("scrape_interval_s", config.scrape_interval_s),
        ("health.interval_s", config.health.interval_s),
        ("left_grace_s", config.left_grace_s),
    ] {
        if let Some(v) = value {
            positive(name, v)?;
        }
    }
    if config.max_connections == 0 || config.max_tenants == 0 || config.threads == 0 {
        return Err(ConfigProblem(
            "max_connections, max_tenants and threads: must be at least 1".into(),
        ));
    }
    if config.max_body_in_flight < config.max_body {
        return Err(ConfigProblem(format!(
            "max_body_in_flight: must be at least max_body ({}), got {}",
            config.max_body, config.max_body_in_flight
        )));
    }
    if config.threads > MAX_THREADS {
        return Err(ConfigProblem(format!("threads: must be at most {MAX_THREADS}")));
    }
    if !config.health.path.starts_with('/') {
        return Err(ConfigProblem("health.path: must be a URL path starting with /".into()));
    }
    check_lora_adapters(&config.lora_adapters, &config.models)
}

/// Each adapter's base model is served, and no adapter shares a model's name (a request
/// naming it would be ambiguous).
fn check_lora_adapters(
    adapters: &HashMap<String, String>,
    models: &[String],
) -> Result<(), ConfigProblem> {
    let mut names: Vec<&String> = adapters.keys().collect();
    names.sort();
    for adapter in names {
        let base = &adapters[adapter];
        if adapter.is_empty() {
            return Err(ConfigProblem("lora_adapters: an adapter name is empty".into()));
        }
        if models.contains(adapter) {
            return Err(ConfigProblem(format!(
                "lora_adapters: {adapter:?} is also a model in models"
            )));
        }
        if !models.contains(base) {
            return Err(ConfigProblem(format!(
                "lora_adapters: {adapter:?}'s base model {base:?} is not in models"
            )));
        }
    }
    Ok(())
}

pub(crate) fn build(
    config: GatewayConfig,
    source: Option<Arc<dyn RouterSource>>,
    hooks: Hooks,
) -> Result<Gateway, ConfigProblem> {
    check(&config)?;
    let owns_pool = source.is_none();
    // A gateway with a router of its own has no discovery to bring engines later; an
    // embedder's (Python's discovery) may start with none and answer 503 until they come.
    if owns_pool && config.engines.is_empty() {
        return Err(ConfigProblem("engines: at least one engine is needed".into()));
    }
    let source: Arc<dyn RouterSource> = match source {
        Some(source) => source,
        None => Arc::new(owned_router(&config)?),
    };
    let now = monotonic();
    let keys = guards::Keys::new(&config.api_keys, now).map_err(ConfigProblem)?;
    let flow = match &config.flow {
        None => None,
        Some(value) => {
            Some(Arc::new(flow::Flow::new(value).map_err(|e| ConfigProblem(format!("flow: {e}")))?))
        }
    };
    let pd_header = match &config.pd_header {
        None => None,
        Some(name) => Some(HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            ConfigProblem(format!("pd.header: {name:?} is not an HTTP header name"))
        })?),
    };
    let tokenizer = match &config.tokenizer {
        None => None,
        Some(directory) => Some(
            tokenize::PromptTokenizer::load_with_template(
                std::path::Path::new(directory),
                config.tokenizer_cache_bytes,
                config.chat_template.as_deref(),
            )
            .map(|tokenizer| {
                tokenizer
                    .with_content_format(config.chat_template_content_format)
                    .with_exclude_tools_when_tool_choice_none(
                        config.exclude_tools_when_tool_choice_none,
                    )
                    .with_trust_request_chat_template(config.trust_request_chat_template)
            })
            .and_then(|tokenizer| match &config.default_chat_template_kwargs {
                Some(kwargs) => tokenizer.with_default_kwargs(kwargs.get()),
                None => Ok(tokenizer),
            })
            .map_err(|e| ConfigProblem(format!("tokenizer: {e}")))?,
        ),
    };
    let slicing = match &config.slices {
        None => None,
        Some(slices) => Some(
            slicing::Slicing::new(slices, &[])
                .map_err(|e| ConfigProblem(format!("slices: {e}")))?,
        ),
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(config.connect_timeout_s.map(Duration::from_secs_f64));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(POOL_IDLE_S))
        .build(connector);
    let gateway = Gateway {
        owns_pool,
        upstreams: RwLock::new(Arc::new(Upstreams::default())),
        client,
        counters: Arc::new(Counters::default()),
        keys,
        tenants: guards::Tenants::new(config.max_tenants, config.tenant_idle_s),
        bodies: guards::BodyBudget::new(config.max_body_in_flight as u64),
        flow,
        models: config.models.iter().cloned().collect(),
        pd_header,
        tokenizer,
        context_len: std::sync::atomic::AtomicUsize::new(0),
        slicing,
        admin: config.admin.as_ref().map(|a| admin::digest(&a.token)),
        extra_metrics: hooks.extra_metrics,
        engines_hook: hooks.engines,
        block_size_hook: hooks.block_size,
        token_warning_hook: hooks.token_warning,
        token_check: Arc::default(),
        routing_changed: tokio::sync::Notify::new(),
        suspect: tokio::sync::Notify::new(),
        cuts: Arc::new(CutReports::default()),
        hashes_prompts: config.record_unread_prefixes
            || source.router().config().reads_prefix_match(),
        session_tokens: session_token::SessionTokens::new(
            config.session_token_namespace.as_deref(),
        ),
        sets_session_tokens: source.router().config().reads_session(),
        owners: Arc::new(responses::Owners::with_grace(
            responses::MAX_OWNERS,
            Duration::try_from_secs_f64(config.left_grace_s.unwrap_or(0.0))
                .unwrap_or(Duration::MAX),
        )),
        locating: Mutex::new(Locating::default()),
        routing_failures: Mutex::new(HashSet::new()),
        decisions_block: source.router().config().may_block(),
        source,
        config,
    };
    gateway.set_max_model_len(gateway.config.max_model_len);
    let engines = gateway.config.engines.clone();
    gateway.replace_engines(&engines, ChangeCount::Uncounted)?;
    Ok(gateway)
}
