//! A native data plane for OpenAI-compatible engines: HTTP/1.1 on tokio and hyper, routing with
//! `llmsched-core`'s [`Router`] and no Python on the request path. `llmsched serve` runs it
//! in-process (`data_plane: native`) through the `llmsched._llmsched.NativeGateway` binding,
//! sharing the router, pool and prefix index Python built from the YAML config; the
//! `llmsched-gateway` binary runs it alone.
//!
//! Per request (`POST /v1/completions`, `POST /v1/chat/completions`): authenticate (API keys
//! give the tenant and priority; without keys the `x-llmsched-tenant` / `x-llmsched-priority`
//! headers do, tenant names bounded by [`GatewayConfig::max_tenants`]), read the body up to
//! [`GatewayConfig::max_body`] within [`GatewayConfig::body_timeout_s`] (413 / 408; the bodies
//! being read share [`GatewayConfig::max_body_in_flight`], 503 past it), parse it
//! as JSON (400), check the model (404), hash the prompt as pseudo-tokens of 4 UTF-8 bytes
//! (llm-d's approximate prefix mode; a chat's messages rendered as `role\ncontent\n` each; a
//! token-id prompt as given), take the key's rate and concurrency limits (429), wait in flow
//! control when it is on (429 / 503 with `x-llmsched-dropped-reason`, 504 at the deadline),
//! decide with the router (`model` restricts the endpoints; `x-session-id` binds a session,
//! and llm-d's `x-session-token` names its endpoint ([`session_token`]); a prefill/decode
//! split names the prefill endpoint in [`GatewayConfig::pd_header`]), then
//! send the body unchanged to the chosen endpoint. Before the first byte of an answer has been
//! passed on, a refused connection or (with [`GatewayConfig::retry_on_5xx`]) a 5xx answer
//! moves the request to the next endpoint in the decision's ranking, at most
//! [`GatewayConfig::retries`] times; no status line within `read_timeout_s` is a 504 (not
//! retried: the engine may be running it). The answer streams through frame by frame (status
//! and headers as the engine sent them, hop-by-hop headers dropped; an SSE stream's last
//! events go out in one write with the body's end, see [`Relay`]); a silence of
//! `read_timeout_s` between frames or the deadline `total_timeout_s` cuts it. An answer cut
//! upstream is never passed off as complete: an SSE stream gets an error event and is closed
//! without its last chunk, any other body is closed mid-chunk; both are counted in
//! `llmsched_gateway_truncated_answers_total`. An answer the engine ends by closing its
//! connection (no Content-Length, not chunked), where a cut looks like the end, passes only
//! as whole JSON (read whole first, up to 8 MiB) or as an event stream that showed its
//! `data: [DONE]`. The router's in-flight ticket is committed
//! when the request is sent, marks the first token with the first body frame and finishes at
//! the end of the answer; a client that leaves drops the answer, which closes the upstream
//! connection (the engine sees the disconnect) and finishes the ticket. Both sides set
//! `TCP_NODELAY`.
//!
//! Transport: the body's fields are read once, borrowed from its bytes ([`payload`]), and
//! completion requests go out on keep-alive connections of the gateway's own ([`pool`]).
//!
//! Background work: the engines' `/metrics` are scraped (all at once) every
//! `scrape_interval_s` into the pool and flow control's saturation detector (vLLM or SGLang
//! names, through `routing::metrics_text`); while no request arrives the interval doubles up
//! to 25 times its base, or half the metrics' staleness limit if that is shorter. Health
//! probes and the circuit breaker follow [`health`]. `GET /health`, `GET /ready`
//! (503 while no engine is routable), `GET /metrics` (the Python plane's metric names) and
//! `GET /v1/models` (the configured models) are served natively.
//!
//! `POST /v1/responses` (OpenAI's Responses API) is served as a generation request, routed on
//! the chat request vLLM makes of it; a conversation continued by `previous_response_id`, and
//! every request under `/v1/responses/{id}`, goes to the engine holding that response, which
//! alone can answer it ([`responses`]).
//!
//! With a tokenizer the prompt is the engine's token ids ([`tokenize`], with the piece cache
//! of [`tokcache`]). Token slices ([`slicing`]), the admin API ([`admin`]), the usage that
//! replica sync shares ([`usage`]) and the engines' KV-event feed ([`kv_events`]) are modules
//! of their own. A Python scorer or filter of the router runs through the GIL (the router
//! calls it as configured); nothing else on the request path is Python.

pub mod admin;
pub mod chat_values;
pub mod client_io;
pub mod conversation;
pub mod flow;
pub mod guards;
pub mod health;
mod json_scan;
pub mod kv_events;
pub mod metrics;
pub mod payload;
pub mod pool;
pub mod pyvalues;
pub mod responses;
pub mod session_token;
pub mod slicing;
mod sse_scan;
pub mod templates;
pub mod tokcache;
pub mod token_check;
pub mod tokenize;
pub mod truncation;
pub mod usage;
mod waits;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use llmsched_core::flow::EndpointMetrics;
use llmsched_core::hashing::text::{pack_text, packed_len};
use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, WorkerKey};
use llmsched_core::routing::{
    metrics_text, parse_config, presets, Decision, Endpoint, EndpointPool, PluginError,
    RequestMeta, Router, RouterOptions, RoutingError, StalePolicy, Ticket,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use guards::ApiKeyConfig;
pub use health::HealthConfig;
pub use metrics::Counters;
use payload::Payload;
use truncation::Truncation;
use waits::AttemptTimer;

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
    /// backlog ([`listen_backlog`]).
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
    /// `truncate_prompt_tokens` of -1 keeps less one ([`truncation`]); `None`: unknown until
    /// [`Running::set_max_model_len`] says (Python sets it from the engines'
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

/// Seconds on `CLOCK_MONOTONIC`: the clock of Python's `time.monotonic()`, so that a router
/// shared with Python sees one time line.
pub fn monotonic() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Where the gateway's router lives: owned (the binary, the tests) or shared with Python.
pub trait RouterSource: Send + Sync + 'static {
    /// The router.
    fn router(&self) -> &Router;
}

impl RouterSource for Router {
    fn router(&self) -> &Router {
        self
    }
}

struct Upstream {
    key: WorkerKey,
    id: String,
    /// `id` shared with the answers relayed from this engine (their metric labels).
    label: Arc<str>,
    completions: Uri,
    /// The origin-form targets of completion requests (what the request line carries).
    completions_path: Uri,
    chat_path: Uri,
    /// The origin-form target of `POST /v1/responses`.
    responses_path: Uri,
    /// The base URL's path (empty, or `/prefix` without a trailing `/`): by-id requests go to
    /// it followed by their own path and query.
    prefix: String,
    /// Keep-alive connections for completion requests.
    connections: pool::Connections,
    metrics: Uri,
    models: Uri,
    probe: Uri,
    health: Mutex<health::Health>,
    /// The pool entry while the engine is out of routing.
    parked: Mutex<Option<Endpoint>>,
    /// Whether its last metrics scrape failed (such an engine is not routable).
    scrape_failed: std::sync::atomic::AtomicBool,
    /// The KV block size its `/metrics` last gave (`vllm:cache_config_info`; 0: none yet).
    block_size: std::sync::atomic::AtomicU32,
}

#[derive(Default)]
struct Upstreams {
    list: Vec<Arc<Upstream>>,
    /// Looked up on every attempt: hashbrown's foldhash, not std's SipHash (the keys are the
    /// configured or discovered engines').
    by_key: hashbrown::HashMap<WorkerKey, Arc<Upstream>>,
}

struct Gateway {
    source: Arc<dyn RouterSource>,
    owns_pool: bool,
    upstreams: RwLock<Arc<Upstreams>>,
    client: Client<HttpConnector, Full<Bytes>>,
    config: GatewayConfig,
    counters: Arc<Counters>,
    keys: guards::Keys,
    tenants: guards::Tenants,
    /// The bytes of request bodies being received ([`GatewayConfig::max_body_in_flight`]).
    bodies: guards::BodyBudget,
    flow: Option<Arc<flow::Flow>>,
    models: HashSet<String>,
    pd_header: Option<HeaderName>,
    tokenizer: Option<tokenize::PromptTokenizer>,
    /// The engines' context length (0: unknown), for token-id prompts; the tokenizer holds
    /// the same for the prompts it encodes ([`Gateway::set_max_model_len`] sets both).
    context_len: std::sync::atomic::AtomicUsize,
    slicing: Option<slicing::Slicing>,
    /// The admin token's SHA-256 (None: no admin API).
    admin: Option<[u8; 32]>,
    extra_metrics: Option<ExtraMetrics>,
    engines_hook: Option<admin::EnginesHook>,
    block_size_hook: Option<BlockSizeHook>,
    token_warning_hook: Option<TokenWarningHook>,
    /// Whether the token ids it routes on reach the engines' KV events ([`token_check`]).
    token_check: Arc<token_check::TokenCheck>,
    /// Woken when an engine leaves routing or its scrape fails (queued requests then check
    /// whether any engine is left).
    routing_changed: tokio::sync::Notify,
    /// Woken when failed attempts ask for confirming probes or take an engine out.
    suspect: tokio::sync::Notify,
    /// Answers cut after their head, for the probe loop to charge to their engines.
    cuts: Arc<CutReports>,
    /// Whether decisions hash the prompt (the router reads the prefix match, or
    /// `record_unread_prefixes` asks for its records anyway).
    hashes_prompts: bool,
    /// Reads requests' `x-session-token`.
    session_tokens: session_token::SessionTokens,
    /// Whether answers carry the serving engine's `x-session-token` (a profile's filter or
    /// scorer reads the session, as llm-d's session-affinity scorer sets it).
    sets_session_tokens: bool,
    /// Which engine holds each stored response ([`responses`]).
    owners: Arc<responses::Owners>,
    /// Lookups of unknown response ids in progress ([`Gateway::locate`]), shared by the
    /// requests naming one.
    locating: Mutex<Locating>,
    /// The messages of the routing failures logged so far ([`Gateway::routing_failed`]).
    routing_failures: Mutex<HashSet<String>>,
    /// Whether a decision may block ([`RouterConfig::may_block`]: a Python scorer or filter),
    /// and so runs on tokio's blocking pool ([`Gateway::decide_off_runtime`]).
    ///
    /// [`RouterConfig::may_block`]: llmsched_core::routing::RouterConfig::may_block
    decisions_block: bool,
}

/// Answers cut after their head (their attempt counted as a success then), reported by their
/// relays, which hold no gateway: the probe loop charges each to its engine's health
/// ([`Gateway::charge_cut`]) as soon as it is woken.
#[derive(Default)]
struct CutReports {
    cut: Mutex<Vec<Arc<Upstream>>>,
    wake: tokio::sync::Notify,
}

impl CutReports {
    fn report(&self, upstream: Arc<Upstream>) {
        self.cut.lock().unwrap_or_else(|e| e.into_inner()).push(upstream);
        self.wake.notify_one();
    }

    fn take(&self) -> Vec<Arc<Upstream>> {
        std::mem::take(&mut *self.cut.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Where an answer cut after its head is charged: its engine, through the gateway's
/// [`CutReports`]; an answer that ends whole ends its engine's run of failed attempts
/// ([`Charge::whole`]).
struct Charge {
    reports: Arc<CutReports>,
    upstream: Arc<Upstream>,
}

impl Charge {
    /// The answer ended whole ([`health::Health::whole`]).
    fn whole(self) {
        self.upstream.health.lock().unwrap_or_else(|e| e.into_inner()).whole();
    }
}

/// The work of a lookup of a stored response's engine ([`Gateway::locate`]).
type LookupWork = futures::future::BoxFuture<'static, Option<Arc<Upstream>>>;

/// A lookup, shared by its waiters.
type Lookup = futures::future::Shared<LookupWork>;

/// The lookups in progress: id -> (its stamp, the lookup while any request waits for it).
#[derive(Default)]
struct Locating {
    map: HashMap<String, (u64, futures::future::WeakShared<LookupWork>)>,
    next: u64,
}

/// How long an engine is waited for at most when asked whether it holds a response (a
/// lookup in its memory): one that stalls holds no lookup longer.
const LOCATE_TIMEOUT_S: f64 = 2.0;

/// More exposition text for `/metrics`, from the embedding program (the Python side's
/// KV-event counters); called on each scrape of `/metrics` only.
pub type ExtraMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// Called with an engine's worker id and the KV block size its `/metrics` gives
/// (`vllm:cache_config_info`), on the first scrape that gives one and whenever it changes, on
/// a blocking thread: the embedder compares it with the index's where that matters (an
/// engine whose KV events feed the index).
pub type BlockSizeHook = Arc<dyn Fn(&str, u32) + Send + Sync>;

/// Called, on a blocking thread, once with each warning of [`token_check`] (the first prompt
/// hashed as pseudo-tokens while engine events feed the index; the ids the gateway routes on
/// never found in the engines' reported cache): the embedder gives the warning.
pub type TokenWarningHook = Arc<dyn Fn(token_check::TokenNote) + Send + Sync>;

/// What an embedding program (`llmsched serve`) lends the gateway: none is on the request
/// path.
#[derive(Clone, Default)]
pub struct Hooks {
    /// More `/metrics` text.
    pub extra_metrics: Option<ExtraMetrics>,
    /// The engines' KV block sizes, as scraped.
    pub block_size: Option<BlockSizeHook>,
    /// Adds and removes engines for the admin API (the embedder owns the engine set).
    pub engines: Option<admin::EnginesHook>,
    /// Gives the warning of [`token_check`] (without it, the gateway prints it on stderr).
    pub token_warning: Option<TokenWarningHook>,
}

/// A listening gateway on the caller's runtime.
pub struct GatewayHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counters.
    pub counters: Arc<Counters>,
    gateway: Arc<Gateway>,
}

impl GatewayHandle {
    /// See [`Running::set_engines`].
    pub fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.set_engines(engines)
    }
}

/// How [`Gateway::replace_engines`] counts its changes in `engine_changes`.
#[derive(Clone, Copy)]
enum ChangeCount {
    /// Not at all (the configured set the gateway starts with).
    Uncounted,
    /// Each engine added, removed or moved to another URL, once.
    Own,
    /// As many as the embedder says: it also sees changes that reach no upstream (an
    /// engine's role, model or labels), which the Python plane counts alike.
    Given(u64),
}

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

fn upstream(entry: &EngineEntry, config: &GatewayConfig) -> Result<Upstream, ConfigProblem> {
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

fn build(
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

/// The tokenizer's piece cache in `/metrics`: hits, misses, evictions and whole-prompt
/// fallbacks as counters; entries, bytes and capacity as gauges; `tokenizer_cache_enabled`
/// 1 or 0, with the reason it is off as a label.
fn tokenizer_cache_metrics(out: &mut String, stats: &tokcache::CacheStats) {
    use metrics::{gauge, help};
    use std::fmt::Write as _;
    const P: &str = "llmsched_gateway";
    for (name, value) in [
        ("tokenizer_cache_hits", stats.hits),
        ("tokenizer_cache_misses", stats.misses),
        ("tokenizer_cache_evictions", stats.evictions),
        ("tokenizer_cache_fallbacks", stats.fallbacks),
    ] {
        let _ = writeln!(
            out,
            "# HELP {P}_{name}_total {}\n# TYPE {P}_{name}_total counter\n\
             {P}_{name}_total {value}.0",
            help(name)
        );
    }
    for (name, value) in [
        ("tokenizer_cache_entries", stats.entries),
        ("tokenizer_cache_bytes", stats.bytes),
        ("tokenizer_cache_capacity_bytes", stats.capacity_bytes),
    ] {
        gauge(out, name, &[], value as f64);
    }
    let reason = stats.disabled_reason.as_deref().unwrap_or("");
    let enabled = if stats.enabled { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_enabled", &[("reason", reason)], enabled);
    let reason = stats.chunks_disabled_reason.as_deref().unwrap_or("");
    let chunks = if stats.chunks { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_chunks_enabled", &[("reason", reason)], chunks);
    let completions = if stats.completions { 1.0 } else { 0.0 };
    gauge(out, "tokenizer_cache_completions_enabled", &[], completions);
}

/// Checks `config`, binds `addr` and serves from tasks on the current tokio runtime (the
/// metrics scrape, health probes and flow control's timer included) until the runtime stops.
pub async fn start(
    addr: SocketAddr,
    config: GatewayConfig,
) -> Result<GatewayHandle, ConfigProblem> {
    let backlog = listen_backlog(config.max_connections);
    let gateway = Arc::new(build(config, None, Hooks::default())?);
    let listener = TcpListener::from_std(bind(addr, backlog)?)
        .map_err(|e| ConfigProblem(format!("cannot listen on {addr}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| ConfigProblem(e.to_string()))?;
    let counters = gateway.counters.clone();
    // No stop signal: it serves until the runtime stops.
    let (_, stop) = watch::channel(false);
    tokio::spawn(serve(gateway.clone(), listener, stop));
    Ok(GatewayHandle { addr, counters, gateway })
}

/// The listen backlog of a gateway taking `max_connections` client connections: room for
/// all of them to arrive at once, never less than tokio's default of 1,024 (the kernel caps it
/// at `net.core.somaxconn`). Under a burst of new connections a short queue overflows and
/// the kernel drops the clients' SYNs (they retry after a second) before the gateway could
/// answer them, or refuse the ones over the cap with a 503.
pub fn listen_backlog(max_connections: usize) -> i32 {
    i32::try_from(max_connections.max(1024)).unwrap_or(i32::MAX)
}

/// A non-blocking listening socket on `addr` with `backlog` (`SO_REUSEADDR` set, as std's
/// `TcpListener::bind` does).
fn bind(addr: SocketAddr, backlog: i32) -> Result<std::net::TcpListener, ConfigProblem> {
    use socket2::{Domain, Protocol, Socket, Type};
    let failed = |e: io::Error| ConfigProblem(format!("cannot listen on {addr}: {e}"));
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(failed)?;
    socket.set_reuse_address(true).map_err(failed)?;
    socket.set_nonblocking(true).map_err(failed)?;
    socket.bind(&addr.into()).map_err(failed)?;
    socket.listen(backlog).map_err(failed)?;
    Ok(socket.into())
}

/// A gateway serving on its own runtime thread(s); [`Running::stop`] (or dropping it) closes
/// the listener and every connection, then joins the thread.
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    gateway: Arc<Gateway>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts a gateway on its own runtime (`config.threads` worker threads) listening on
/// `addr`, routing with `source` (None: a router built from `config`), with the embedder's
/// `hooks`. Returns once it listens.
pub fn spawn(
    addr: SocketAddr,
    config: GatewayConfig,
    source: Option<Arc<dyn RouterSource>>,
    hooks: Hooks,
) -> Result<Running, ConfigProblem> {
    let threads = config.threads;
    let backlog = listen_backlog(config.max_connections);
    let gateway = Arc::new(build(config, source, hooks)?);
    let std_listener = bind(addr, backlog)?;
    let addr = std_listener.local_addr().map_err(|e| ConfigProblem(e.to_string()))?;
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads);
        builder
    };
    let runtime = builder
        .enable_all()
        .thread_name("llmsched-gateway")
        .build()
        .map_err(|e| ConfigProblem(format!("cannot start the runtime: {e}")))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let served = gateway.clone();
    let thread = std::thread::Builder::new()
        .name("llmsched-gateway".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(std_listener) {
                    Ok(listener) => serve(served, listener, stop_rx).await,
                    Err(err) => eprintln!("llmsched-gateway: cannot listen: {err}"),
                }
            });
            // Dropping the runtime cancels every connection task.
            runtime.shutdown_timeout(Duration::from_secs(1));
        })
        .map_err(|e| ConfigProblem(format!("cannot start the gateway thread: {e}")))?;
    Ok(Running { addr, gateway, stop: Some(stop_tx), thread: Some(thread) })
}

impl Running {
    /// Stops listening, closes every connection (in-flight requests are cut) and joins the
    /// runtime thread. Idempotent.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Whether it still serves.
    pub fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.gateway.counters
    }

    /// The check that the token ids it routes on reach the engines' KV events
    /// ([`token_check`]), whose counts may be read from any thread, also after `stop()` (and
    /// from the embedder's metrics hook, which runs while [`Running::metrics_text`] is
    /// borrowed).
    pub fn token_check(&self) -> Arc<token_check::TokenCheck> {
        self.gateway.token_check.clone()
    }

    /// Replaces the engines (base URLs); returns the ids added and removed. Kept engines keep
    /// their health; with a router of its own the gateway updates the pool too (a shared
    /// router's pool is its owner's to update). An empty list takes every engine out (requests
    /// get a 503 until some come back); a repeated or malformed one changes nothing.
    pub fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.set_engines(engines)
    }

    /// [`Self::set_engines`], counting `changes` engine changes (`engine_changes`) in place
    /// of its own count: the embedder's, which also sees changes that reach no upstream (an
    /// engine's role, model or labels).
    pub fn set_engines_counting(
        &self,
        engines: &[EngineEntry],
        changes: u64,
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.replace_engines(engines, ChangeCount::Given(changes))
    }

    /// The `/metrics` text.
    pub fn metrics_text(&self) -> String {
        self.gateway.metrics_text()
    }

    /// Each engine's id and health state (`up`, `down`, `open`).
    pub fn health_states(&self) -> Vec<(String, &'static str)> {
        let upstreams = self.gateway.upstreams();
        upstreams
            .list
            .iter()
            .map(|u| {
                (u.id.clone(), u.health.lock().unwrap_or_else(|e| e.into_inner()).state.name())
            })
            .collect()
    }

    /// Sets the engines' context length (`None`: unknown): what a request's
    /// `truncate_prompt_tokens` of -1 keeps less one, as vLLM keeps it.
    pub fn set_max_model_len(&self, context: Option<usize>) {
        self.gateway.set_max_model_len(context);
    }

    /// The tokenizer's piece cache (None without a tokenizer).
    pub fn tokenizer_cache_stats(&self) -> Option<tokcache::CacheStats> {
        self.gateway.tokenizer.as_ref().map(tokenize::PromptTokenizer::cache_stats)
    }

    /// Flow control's snapshot (None when off).
    pub fn flow_stats(&self) -> Option<flow::FlowStats> {
        self.gateway.flow.as_ref().map(|f| f.stats(monotonic()))
    }

    /// Flow control's gauges and counters (None when off).
    pub fn flow_metrics(&self) -> Option<llmsched_core::flow::metrics::ControllerMetrics> {
        self.gateway.flow.as_ref().and_then(|f| f.metrics(monotonic()))
    }

    /// Engines a request could go to now.
    pub fn routable(&self) -> Vec<String> {
        self.gateway.routable()
    }

    /// This gateway's usage since the last call, for the other replicas ([`usage`]).
    pub fn drain_usage(&self) -> usage::Usage {
        self.gateway.drain_usage()
    }

    /// Charges other replicas' usage here ([`usage`]).
    pub fn apply_usage(&self, usage: &usage::Usage) {
        self.gateway.apply_usage(usage);
    }

    /// Requests being decoded in slices now (None when token slices are off).
    pub fn sliced_requests(&self) -> Option<usize> {
        self.gateway.slicing.as_ref().map(slicing::Slicing::tracked)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(gateway: Arc<Gateway>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    if let Some(interval) = gateway.config.scrape_interval_s {
        tokio::spawn(scrape(gateway.clone(), Duration::from_secs_f64(interval)));
    }
    tokio::spawn(probes(gateway.clone()));
    if let Some(flow) = &gateway.flow {
        tokio::spawn(flow.clone().run(monotonic));
    }
    let idle = Duration::from_secs_f64(gateway.config.idle_timeout_s);
    // A dropped sender is no stop signal.
    let stopped = async move {
        if stop.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(stopped);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stopped => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let counters = gateway.counters.clone();
        let open = counters.connections.fetch_add(1, Ordering::Relaxed);
        let gateway = gateway.clone();
        let max_headers = gateway.config.max_headers;
        tokio::spawn(async move {
            let counted = OpenConnection(counters.clone());
            if open as usize >= gateway.config.max_connections {
                counters.connections_refused.fetch_add(1, Ordering::Relaxed);
                refuse_connection(stream, counted).await;
                return;
            }
            // Writes to the client are bounded too (hyper has no write timeout): a client
            // that stops reading holds its answer for `idle_timeout_s` at most, and no longer
            // than its request's deadline.
            let deadline = client_io::AnswerDeadline::new();
            let total = gateway.config.total_timeout_s.map(Duration::from_secs_f64);
            let io = client_io::ClientIo::new(stream, idle, deadline.clone(), counters);
            let service = service_fn(move |request| {
                deadline.request_arrived(total);
                gateway.clone().handle(request)
            });
            // One buffer per write rather than a queue of them (`writev(false)`): an SSE
            // event's chunk (its size line, the data, the CRLF) is copied into it, which costs
            // less than queueing three buffers and gathering them for `writev` (the bytes sent
            // are the same, in a `write`).
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .writev(false)
                .header_read_timeout(idle)
                .max_headers(max_headers)
                .serve_connection(TokioIo::new(io), service)
                .await;
        });
    }
}

struct OpenConnection(Arc<Counters>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers a connection over the cap with a 503 and closes it; `open` (its count among the
/// open connections) is given back once the 503 is written, so that a refused client that is
/// slow to close does not keep others out.
async fn refuse_connection(mut stream: tokio::net::TcpStream, open: OpenConnection) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = br#"{"error":{"message":"too many connections","type":"service_unavailable","param":null,"code":503}}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let _ = stream.shutdown().await;
    drop(open);
    // Reads (and drops) what the client sends until it closes, bounded: closing over a request
    // left unread would reset the connection, and a client still writing it would lose the
    // 503 it had not read yet.
    // On the heap: an array here would be in every connection's task (this future is part
    // of it), copied whole each time one is spawned.
    let mut sink = vec![0u8; 16 << 10];
    let mut left = REFUSED_DRAIN_BYTES;
    let drain = async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(REFUSED_DRAIN_TIME, drain).await;
}

/// Reads and drops a refused request's body (at most `max_body` and a refused connection's
/// allowance, while its bytes keep coming: each read within [`REFUSED_BODY_GAP`], all within
/// `total`), so that the connection closes over no unread bytes: the client reads its refusal
/// rather than a reset. Bounded by pauses rather than by a short total: a client still sending
/// 16 MiB at a few MB/s (or on a busy machine) would otherwise be reset.
async fn drain_refused_body(mut body: Incoming, max_body: usize, total: Duration) {
    let mut left = max_body.saturating_add(REFUSED_DRAIN_BYTES);
    let drain = async {
        while let Ok(Some(Ok(frame))) = tokio::time::timeout(REFUSED_BODY_GAP, body.frame()).await {
            let read = frame.data_ref().map_or(0, Bytes::len);
            left = left.saturating_sub(read);
            if left == 0 {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(total, drain).await;
}

/// How long a refused connection's request is read and dropped at most before it is closed.
const REFUSED_DRAIN_TIME: Duration = Duration::from_millis(500);
/// How long a refused request's body may pause between reads before its connection is
/// closed (it is read for at most `body_timeout_s` in all, as long as any body may take).
const REFUSED_BODY_GAP: Duration = Duration::from_secs(1);
/// How much of a refused connection's request is read and dropped at most.
const REFUSED_DRAIN_BYTES: usize = 1 << 20;

/// Scrapes every engine's `/metrics` (concurrently) into the pool and flow control; backs off
/// while no request arrives, but never so far that the metrics go stale (see [`idle_scrape_limit`]).
async fn scrape(gateway: Arc<Gateway>, base: Duration) {
    let mut interval = base;
    let mut seen = u64::MAX;
    let timeout = Duration::from_secs_f64(gateway.config.scrape_timeout_s);
    let limit = idle_scrape_limit(&gateway, base);
    // The first round at once: with flow control on, engines without metrics count as
    // saturated, and the first requests would wait for a round (or be refused).
    let mut first = true;
    loop {
        if !first {
            tokio::time::sleep(interval).await;
        }
        first = false;
        let requests = gateway.counters.received.load(Ordering::Relaxed);
        interval = if requests == seen { (interval * 2).min(limit) } else { base };
        seen = requests;
        let upstreams = gateway.upstreams();
        for upstream in &upstreams.list {
            // Both kinds of every engine scraped, at 0 until one fails, as on the Python
            // plane: `rate()` and `increase()` read a series from its first scrape, where one
            // that appears with its first failure loses that failure.
            gateway.counters.scrape_failures.add(&[&upstream.id, "failed"], 0);
            gateway.counters.scrape_failures.add(&[&upstream.id, "timeout"], 0);
        }
        // All engines at once: their answers come back together, one wake-up of the thread
        // for the lot rather than one per engine (what an idle gateway spends its time on).
        let scrapes = upstreams.list.iter().map(|u| scrape_once(&gateway, u, timeout));
        let scrapes = futures::future::join_all(scrapes).await;
        for (upstream, scraped) in upstreams.list.iter().zip(scrapes) {
            let scraped = match scraped {
                Scraped::Answered(scraped) => {
                    upstream.scrape_failed.store(false, Ordering::Relaxed);
                    scraped
                }
                Scraped::Failed => {
                    gateway.counters.scrape_failures.inc(&[&upstream.id, "failed"]);
                    if !upstream.scrape_failed.swap(true, Ordering::Relaxed) {
                        gateway.routing_changed.notify_waiters();
                    }
                    continue;
                }
                // No answer in time is what a stall looks like (the engine's core or the
                // gateway's taken by something else for a second): the engine keeps its
                // place in routing and its metrics age, and confirming probes decide, so a
                // stall of every engine's core does not turn into a 503 for every request
                // until the next scrape gets through. A dead engine refuses the connection
                // (`Failed` above) and fails its probes within `health.timeout_s`.
                Scraped::TimedOut => {
                    gateway.counters.scrape_failures.inc(&[&upstream.id, "timeout"]);
                    gateway.ask_probes(upstream);
                    continue;
                }
            };
            let now = monotonic();
            let update = scraped.update;
            let _ = gateway.router().pool().update_metrics(&upstream.key, update, now);
            if let Some(size) = scraped.block_size.filter(|&size| size > 0) {
                let before = upstream.block_size.swap(size, Ordering::Relaxed);
                if let Some(hook) = gateway.block_size_hook.clone().filter(|_| before != size) {
                    let worker = upstream.id.clone();
                    tokio::task::spawn_blocking(move || hook(&worker, size));
                }
            }
            if let Some(loras) = scraped.loras {
                // The adapters it runs and waits on (`vllm:lora_requests_info`), what the LoRA
                // filters and scorers read.
                let _ = gateway.router().pool().set_loras(&upstream.key, loras);
            }
            if let Some(flow) = &gateway.flow {
                flow.update_endpoint(
                    &upstream.id,
                    EndpointMetrics {
                        waiting: u64::from(update.waiting.unwrap_or(0)),
                        running: u64::from(update.running.unwrap_or(0)),
                        kv_usage: update.kv_cache_usage.unwrap_or(0.0).clamp(0.0, 1.0),
                        timestamp: now,
                    },
                );
            }
        }
        if let Some(flow) = &gateway.flow {
            flow.pump(monotonic());
        }
    }
}

/// How one engine's scrape ended.
enum Scraped {
    /// Its metrics.
    Answered(metrics_text::Scrape),
    /// Refused, an error status, or text that does not parse: the engine answered (or its
    /// port did) that it cannot serve.
    Failed,
    /// No answer within `scrape_timeout_s`: the engine, or the gateway, may only be stalled.
    TimedOut,
}

/// The largest `/metrics` body read (8 MiB, as on the Python plane; vLLM's with eight
/// data-parallel ranks is about 270 KB).
const MAX_SCRAPE_BYTES: usize = 8 << 20;

/// One engine's scrape. A request that fails before any answer (typically a pooled
/// connection the engine closed meanwhile) is tried once more on a fresh one: one lost race
/// must not take a healthy engine out of routing.
async fn scrape_once(gateway: &Gateway, upstream: &Upstream, timeout: Duration) -> Scraped {
    let fetch = async {
        let answer = match gateway.client.get(upstream.metrics.clone()).await {
            Ok(answer) => answer,
            Err(_) => gateway.client.get(upstream.metrics.clone()).await.ok()?,
        };
        if !answer.status().is_success() {
            return None;
        }
        // Bounded, as the Python plane bounds it: an endless body is a failed scrape, not
        // gigabytes held.
        let body = Limited::new(answer.into_body(), MAX_SCRAPE_BYTES).collect().await.ok()?;
        // A label in another encoding (Latin-1) is not what a load figure needs. (Checked as
        // UTF-8 first: the lossy reading goes a byte at a time even through ASCII.)
        let bytes = body.to_bytes();
        Some(match std::str::from_utf8(&bytes) {
            Ok(text) => text.to_owned(),
            Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
        })
    };
    match tokio::time::timeout(timeout, fetch).await {
        Ok(Some(text)) => metrics_text::parse(&text).map_or(Scraped::Failed, Scraped::Answered),
        Ok(None) => Scraped::Failed,
        Err(_) => Scraped::TimedOut,
    }
}

/// The longest interval the idle scrape backs off to: 25 base intervals, but at most half
/// the shorter of the pool's and flow control's staleness limits (the other half is left
/// for the scrape itself), since a request arriving after an idle spell is routed and
/// admitted on the metrics already there, and stale ones count every engine saturated.
fn idle_scrape_limit(gateway: &Gateway, base: Duration) -> Duration {
    let mut stale = gateway.router().pool().policy().stale_after;
    if let Some(flow_stale) = gateway.flow.as_ref().and_then(|f| f.metrics_staleness_s()) {
        stale = stale.min(flow_stale);
    }
    let fresh = Duration::try_from_secs_f64(stale / 2.0).unwrap_or(Duration::MAX);
    (base * 25).min(fresh).max(base)
}

/// Active health checks: engines in routing every `health.interval_s`, engines out of it
/// (down, breaker open) when their next probe is due, suspects (failed attempts) at once.
async fn probes(gateway: Arc<Gateway>) {
    let config = gateway.config.health.clone();
    // Confirming probes run 100 ms apart; otherwise the loop sleeps until the next probe is
    // due (an idle gateway wakes once per `interval_s`), or until an attempt fails.
    let tick = 0.1;
    let mut next_active = monotonic() + config.interval_s.unwrap_or(1e9);
    loop {
        for upstream in gateway.cuts.take() {
            gateway.charge_cut(&upstream);
        }
        let now = monotonic();
        let mut wake = next_active;
        for upstream in &gateway.upstreams().list {
            let health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            wake = match health.state {
                health::State::Up if health.suspect => wake.min(now + tick),
                health::State::Up | health::State::Draining => wake,
                _ => wake.min(health.next_probe_at.max(now + tick)),
            };
        }
        let sleep = Duration::from_secs_f64((wake - now).clamp(0.0, 1e6));
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = gateway.suspect.notified() => continue,
            _ = gateway.cuts.wake.notified() => continue,
        }
        let now = monotonic();
        let active = now >= next_active;
        if active {
            next_active = now + config.interval_s.unwrap_or(1e9);
        }
        let upstreams = gateway.upstreams();
        for upstream in &upstreams.list {
            let due = {
                let health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
                match health.state {
                    health::State::Up => active || health.suspect,
                    health::State::Draining => false,
                    _ => now >= health.next_probe_at,
                }
            };
            if !due {
                continue;
            }
            let ok = gateway.probe(upstream).await;
            let result = if ok { "ok" } else { "failed" };
            gateway.counters.probes.inc(&[&upstream.id, result]);
            let change = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).probe(
                &config,
                ok,
                monotonic(),
            );
            gateway.apply(upstream, change);
        }
    }
}

type Answer = Response<AnswerBody>;

/// The body of an answer to a client: the gateway's own, whole (an engine's answer read
/// whole, a refusal), or passed on as it comes ([`Relay`]). The relay's state is boxed, so
/// that the whole answers, and every answer moved between the request's futures and hyper's
/// dispatcher, stay a few words.
pub enum AnswerBody {
    /// Sent as one frame.
    Whole(Option<Bytes>),
    /// An engine's answer (or a sliced request's stream), frame by frame.
    Relayed(Box<Relay>),
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        match self.get_mut() {
            AnswerBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            AnswerBody::Relayed(relay) => Pin::new(&mut **relay).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnswerBody::Whole(bytes) => bytes.is_none(),
            AnswerBody::Relayed(relay) => relay.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            AnswerBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            AnswerBody::Relayed(relay) => relay.size_hint(),
        }
    }
}

/// Whether `upstream` takes requests: in the pool, its last scrape answered, healthy.
fn in_routing(upstream: &Upstream, pool: &llmsched_core::routing::pool::Members) -> bool {
    pool.get(&upstream.key).is_some()
        && !upstream.scrape_failed.load(Ordering::Relaxed)
        && upstream.health.lock().unwrap_or_else(|e| e.into_inner()).state == health::State::Up
}

/// An OpenAI-shaped refusal of the gateway's own.
struct Refusal {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<Cow<'static, str>>,
    reason: Option<&'static str>,
    retry_after: Option<String>,
    close: bool,
}

impl Refusal {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            kind,
            message: message.into(),
            param: None,
            reason: None,
            retry_after: None,
            close: false,
        }
    }

    fn param(mut self, param: impl Into<Cow<'static, str>>) -> Refusal {
        self.param = Some(param.into());
        self
    }

    /// The 400 for a body [`Payload::parse`] refuses (naming the field when it can).
    fn unreadable(problem: payload::Problem) -> Refusal {
        let refusal = Refusal::new(400, "invalid_request_error", problem.to_string());
        match problem.param() {
            Some(param) => refusal.param(param.to_owned()),
            None => refusal,
        }
    }

    fn dropped(mut self, reason: &'static str, retry_after: String) -> Refusal {
        self.reason = Some(reason);
        self.retry_after = Some(retry_after);
        self
    }

    /// The OpenAI-shaped error object: an answer's body, or an SSE error event's data.
    fn error_body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

const TENANT_HEADER: &str = "x-llmsched-tenant";
const PRIORITY_HEADER: &str = "x-llmsched-priority";
const DROPPED_REASON_HEADER: &str = "x-llmsched-dropped-reason";
const SESSION_HEADER: &str = "x-session-id";

/// The request headers read on every completion request, as header names: a lookup by a
/// `&str` parses and lower-cases the name each time, one by a `HeaderName` does not.
static TENANT_HEADER_NAME: HeaderName = HeaderName::from_static(TENANT_HEADER);
static PRIORITY_HEADER_NAME: HeaderName = HeaderName::from_static(PRIORITY_HEADER);
static SESSION_HEADER_NAME: HeaderName = HeaderName::from_static(SESSION_HEADER);
static SESSION_TOKEN_HEADER_NAME: HeaderName =
    HeaderName::from_static(session_token::SESSION_TOKEN_HEADER);
const MAX_TOKEN_LIMIT: u64 = (1 << 31) - 1;
/// How many distinct routing failures [`Gateway::routing_failed`] logs.
const LOGGED_ROUTING_FAILURES: usize = 64;

/// What the gateway reads of a request's head, found in one pass over its fields (a request
/// has a few): a lookup by name hashes the name and probes the map, so a field the request
/// does not have is not looked up at all, and one it has is looked up as before (its first
/// value, or all of them). Read before anything else ([`Gateway::handle`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct RequestFields {
    /// The longest field, its name, value and `": "` (`limits.max_field_bytes`).
    largest: usize,
    /// How many `Host` fields.
    hosts: usize,
    length: bool,
    transfer: bool,
    encoding: bool,
    authorization: bool,
    api_key: bool,
    tenant: bool,
    priority: bool,
    session: bool,
    token: bool,
    accept: bool,
}

static API_KEY_HEADER_NAME: HeaderName = HeaderName::from_static("x-api-key");

impl RequestFields {
    fn of(headers: &HeaderMap) -> RequestFields {
        let mut fields = RequestFields::default();
        for (name, value) in headers {
            fields.largest = fields.largest.max(name.as_str().len() + value.len() + 2);
            let seen = if name == hyper::header::HOST {
                fields.hosts += 1;
                continue;
            } else if name == CONTENT_LENGTH {
                &mut fields.length
            } else if name == TRANSFER_ENCODING {
                &mut fields.transfer
            } else if name == hyper::header::CONTENT_ENCODING {
                &mut fields.encoding
            } else if name == hyper::header::AUTHORIZATION {
                &mut fields.authorization
            } else if name == hyper::header::ACCEPT {
                &mut fields.accept
            } else if name == TENANT_HEADER_NAME {
                &mut fields.tenant
            } else if name == PRIORITY_HEADER_NAME {
                &mut fields.priority
            } else if name == SESSION_HEADER_NAME {
                &mut fields.session
            } else if name == SESSION_TOKEN_HEADER_NAME {
                &mut fields.token
            } else if name == API_KEY_HEADER_NAME {
                &mut fields.api_key
            } else {
                continue;
            };
            *seen = true;
        }
        fields
    }

    /// `headers.get(name)` for a field this pass found (`present`), without a lookup for one
    /// it did not.
    fn get<'h>(
        present: bool,
        headers: &'h HeaderMap,
        name: &HeaderName,
    ) -> Option<&'h HeaderValue> {
        if present {
            headers.get(name)
        } else {
            None
        }
    }
}

/// The sampling fields the gateway reads have the types the OpenAI API gives them; 400
/// naming the field otherwise.
fn check_fields(payload: &Payload<'_>) -> Result<(), Refusal> {
    let bad = |field: &'static str, what: &str| {
        Refusal::new(400, "invalid_request_error", format!("'{field}' must be {what}")).param(field)
    };
    // None: absent; Some(None): a number out of f64's range, of no type the field takes.
    let read = |field: &str| payload.value(field).map(Result::ok);
    for field in ["max_tokens", "max_completion_tokens"] {
        // The usual value, read from its text without a `Value` made of it.
        match payload.text(field).and_then(token_limit_text) {
            Some(true) => continue,
            Some(false) => {
                return Err(bad(field, &format!("an integer in 1..{MAX_TOKEN_LIMIT} or null")))
            }
            None => {}
        }
        match read(field) {
            None | Some(Some(Value::Null)) => {}
            Some(Some(Value::Number(n)))
                if n.as_u64().is_some_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n)) => {}
            Some(_) => {
                return Err(bad(field, &format!("an integer in 1..{MAX_TOKEN_LIMIT} or null")))
            }
        }
    }
    match read("stop") {
        None | Some(Some(Value::Null | Value::String(_))) => {}
        Some(Some(Value::Array(items))) if items.iter().all(Value::is_string) => {}
        Some(_) => return Err(bad("stop", "a string, a list of strings or null")),
    }
    // The usual values, read from their text (a raw value's text is checked JSON: no
    // space around it).
    let literal = |field: &str| matches!(payload.text(field), Some("true" | "false" | "null"));
    match read("stream") {
        _ if literal("stream") => {}
        None | Some(Some(Value::Null | Value::Bool(_))) => {}
        Some(_) => return Err(bad("stream", "true, false or null")),
    }
    match read("stream_options") {
        None | Some(Some(Value::Null | Value::Object(_))) => {}
        Some(_) => return Err(bad("stream_options", "an object or null")),
    }
    match read("cache_salt") {
        None | Some(Some(Value::Null)) => {}
        // vLLM refuses an empty salt.
        Some(Some(Value::String(salt))) if !salt.is_empty() => {}
        Some(_) => return Err(bad("cache_salt", "a non-empty string or null")),
    }
    Ok(())
}

/// Whether a `max_tokens` (or `max_completion_tokens`) field of text `text`, a checked JSON
/// value, is an integer in `1..=MAX_TOKEN_LIMIT` or null, read from the text when it is
/// `null` or digits only (None for any other text, which is read as a `Value`). Digits only
/// are an integer as serde_json reads them: a `u64` when it fits, else a float (no `u64`,
/// refused as one past the limit is).
fn token_limit_text(text: &str) -> Option<bool> {
    if text == "null" {
        return Some(true);
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u64>().is_ok_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n)))
}

struct Identity {
    tenant: Arc<str>,
    priority: i32,
    limiter: Option<Arc<guards::KeyLimiter>>,
}

impl Gateway {
    fn router(&self) -> &Router {
        self.source.router()
    }

    fn upstreams(&self) -> Arc<Upstreams> {
        self.upstreams.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Decides for a prompt of `tokens`. A router that reads nothing of the prefix index
    /// decides on no block hashes (unless `record_unread_prefixes`): hashing, matching and
    /// recording them would change no decision of its, only the index's approximate records.
    /// `ids`: how many the prompt has (`tokens.len()`, unless the ids were not packed for a
    /// router that hashes none).
    fn decide(
        &self,
        tokens: &[u32],
        ids: usize,
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        let router = self.router();
        if self.hashes_prompts {
            router.decide(tokens, meta, now)
        } else {
            router.decide_hashes(Vec::new(), ids as u64, meta, now)
        }
    }

    /// [`Gateway::decide`] where it cannot stall the runtime: a router with a plugin that may
    /// block (a Python scorer or filter, which takes the GIL and has no timeout) decides on
    /// tokio's blocking pool, so that a slow one delays its own request only, not every
    /// connection of the runtime's threads (`native_threads`) and `/health`; any other
    /// decides in place (no copy, no thread hop).
    async fn decide_off_runtime(
        self: &Arc<Self>,
        tokens: &[u32],
        ids: usize,
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        if !self.decisions_block {
            return self.decide(tokens, ids, meta, now);
        }
        let (gateway, tokens, meta) = (self.clone(), tokens.to_vec(), meta.clone());
        let decided =
            tokio::task::spawn_blocking(move || gateway.decide(&tokens, ids, &meta, now)).await;
        decided.unwrap_or_else(|err| {
            Err(RoutingError::Plugin(PluginError {
                plugin: "router".into(),
                source: format!("the decision did not finish: {err}").into(),
            }))
        })
    }

    /// The answer to a decision a router plugin failed (a Python scorer or filter raised, or
    /// returned what it must not): a 500 that says why, counted in
    /// `rejections_total{reason="routing_failed"}`, the error logged on stderr once per
    /// distinct message (the first [`LOGGED_ROUTING_FAILURES`]). Nothing was taken for it.
    fn routing_failed(&self, err: &RoutingError) -> Refusal {
        let message = format!("routing failed: {err}");
        let mut logged = self.routing_failures.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() < LOGGED_ROUTING_FAILURES && logged.insert(message.clone()) {
            eprintln!("llmsched-gateway: {message} (answered 500)");
        }
        drop(logged);
        let mut refusal = Refusal::new(500, "internal_error", message);
        refusal.reason = Some("routing_failed");
        refusal
    }

    fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.replace_engines(engines, ChangeCount::Own)
    }

    /// The checks of [`token_check`] on a pick at `now` of a prompt whose ids are `kind`: run
    /// on every pick, each slice of a sliced request included (its first call and every
    /// continuation), as `Router.pick` runs them on each pick of the Python plane.
    fn check_ids(&self, kind: IdKind, tokens: &[u32], meta: &RequestMeta, now: f64) {
        match kind {
            IdKind::TokenIds if self.token_check.due(now) => self.check_tokens(tokens, meta, now),
            IdKind::Pseudo => self.count_pseudo(),
            _ => {}
        }
    }

    /// Runs [`token_check`] on a prompt of token ids picked at `now` (called at most once a
    /// second); gives its warning once, through the embedder's hook or on stderr.
    fn check_tokens(&self, tokens: &[u32], meta: &RequestMeta, now: f64) {
        let index = self.router().index();
        let lora = meta.lora.as_deref();
        let Some(unconfirmed) =
            self.token_check.step(index, tokens, lora, meta.cache_salt.as_deref(), now)
        else {
            return;
        };
        self.token_warning(token_check::TokenNote::Mismatch(unconfirmed));
    }

    /// Counts a prompt hashed as pseudo-tokens while engine events feed the index (they can
    /// match no block an engine reports); the first gives the warning.
    fn count_pseudo(&self) {
        if self.token_check.pseudo_pick(self.router().index()) {
            self.token_warning(token_check::TokenNote::Pseudo);
        }
    }

    /// Gives `note` through the embedder's hook (on a blocking thread) or on stderr.
    fn token_warning(&self, note: token_check::TokenNote) {
        match self.token_warning_hook.clone() {
            Some(hook) => {
                tokio::task::spawn_blocking(move || hook(note));
            }
            None => eprintln!("llmsched-gateway: router: {}", note.text()),
        }
    }

    /// [`Gateway::set_engines`]; `count`: how the changes go to `engine_changes`.
    fn replace_engines(
        &self,
        engines: &[EngineEntry],
        count: ChangeCount,
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        let current = self.upstreams();
        let mut next = Upstreams::default();
        let mut added = Vec::new();
        for entry in engines {
            let mut fresh = upstream(entry, &self.config)?;
            let base = fresh.completions.to_string();
            let base = base.trim_end_matches("/v1/completions");
            if next.by_key.contains_key(&fresh.key) {
                return Err(ConfigProblem(format!("engines: {} is listed twice", fresh.id)));
            }
            let probe = format!("{}{}", base.trim_end_matches('/'), self.config.health.path);
            fresh.probe = probe
                .parse()
                .map_err(|_| ConfigProblem(format!("health.path: {probe:?} is not a URL")))?;
            let kept =
                current.by_key.get(&fresh.key).filter(|u| u.completions == fresh.completions);
            let entry = match kept {
                Some(kept) => kept.clone(),
                None => {
                    added.push(fresh.id.clone());
                    Arc::new(fresh)
                }
            };
            next.by_key.insert(entry.key.clone(), entry.clone());
            next.list.push(entry);
        }
        let removed: Vec<String> = current
            .list
            .iter()
            .filter(|u| !next.by_key.get(&u.key).is_some_and(|n| Arc::ptr_eq(n, u)))
            .map(|u| u.id.clone())
            .collect();
        if self.owns_pool {
            let pool = self.router().pool();
            for gone in current.list.iter().filter(|u| removed.contains(&u.id)) {
                let _ = pool.remove(&gone.key);
            }
            // One step for the batch: a discovery file of thousands of engines is linear.
            pool.upsert_many(next.list.iter().filter(|u| added.contains(&u.id)).map(|new| {
                let address = new.models.authority().map(|a| a.to_string()).unwrap_or_default();
                Endpoint { address, ..Endpoint::new(new.key.clone()) }
            }));
        }
        if let Some(flow) = &self.flow {
            for gone in &removed {
                flow.remove_endpoint(gone);
            }
        }
        if let Some(slicing) = &self.slicing {
            // One that left is no migration target; one under another URL starts afresh.
            slicing.remove_endpoints(&removed);
            slicing.add_endpoints(&added);
        }
        // One re-added under another URL is another engine (or this one restarted): it holds
        // none of its stored responses. One that left may come back: see `Owners`.
        for gone in &removed {
            if added.contains(gone) {
                self.owners.forget_engine(gone);
            } else {
                self.owners.engine_left(gone);
            }
        }
        for new in &added {
            self.owners.engine_joined(new);
        }
        // An engine moved to another URL is one change (it is both added and removed).
        let moved = removed.iter().filter(|gone| added.contains(gone)).count();
        let changes = match count {
            ChangeCount::Uncounted => 0,
            ChangeCount::Own => (added.len() + removed.len() - moved) as u64,
            ChangeCount::Given(changes) => changes,
        };
        *self.upstreams.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
        self.counters.engine_changes.fetch_add(changes, Ordering::Relaxed);
        // An engine both removed and re-added (a changed URL) is reported once each way.
        Ok((added, removed))
    }

    /// Takes an engine out of routing or puts it back.
    fn apply(&self, upstream: &Upstream, change: health::Change) {
        let pool = self.router().pool();
        match change {
            health::Change::None => {}
            health::Change::Out(state) => {
                let family = match state {
                    health::State::Open => Some(&self.counters.breaker_opens),
                    health::State::Down => Some(&self.counters.ejections),
                    // An operator's drain is no failure.
                    health::State::Up | health::State::Draining => None,
                };
                if let Some(family) = family {
                    family.inc(&[&upstream.id]);
                }
                let snapshot = pool.snapshot();
                if let Some(member) = snapshot.get(&upstream.key) {
                    *upstream.parked.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(member.endpoint.clone());
                    let _ = pool.remove(&upstream.key);
                }
                self.routing_changed.notify_waiters();
            }
            health::Change::Back => {
                let parked = upstream.parked.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(endpoint) = parked {
                    pool.upsert(endpoint);
                }
            }
        }
    }

    fn attempt_ended(&self, upstream: &Upstream, failure: Option<&str>) {
        let (change, suspect) = {
            let mut health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            let others_up = || self.others_in_routing(upstream);
            let change = health.attempt(&self.config.health, failure, monotonic(), others_up);
            (change, health.suspect)
        };
        // The probe loop recomputes when its next probe is due.
        if suspect || change != health::Change::None {
            self.suspect.notify_one();
        }
        self.apply(upstream, change);
    }

    /// An answer of `upstream`'s was cut after its head, which counted as a success: the
    /// failure it was ([`health::Health::cut`]), as the Python plane records it.
    fn charge_cut(&self, upstream: &Upstream) {
        let (change, suspect) = {
            let mut health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            let others_up = || self.others_in_routing(upstream);
            let change = health.cut(&self.config.health, monotonic(), others_up);
            (change, health.suspect)
        };
        if suspect || change != health::Change::None {
            self.suspect.notify_one();
        }
        self.apply(upstream, change);
    }

    /// Whether an engine other than `upstream` is in routing, read from the pool alone (an
    /// engine down, open or drained has left it): no other engine's health lock is taken, as
    /// the caller holds `upstream`'s.
    fn others_in_routing(&self, upstream: &Upstream) -> bool {
        let snapshot = self.router().pool().snapshot();
        self.upstreams().list.iter().any(|other| {
            other.key != upstream.key
                && snapshot.get(&other.key).is_some()
                && !other.scrape_failed.load(Ordering::Relaxed)
        })
    }

    /// See [`Running::set_max_model_len`].
    fn set_max_model_len(&self, context: Option<usize>) {
        self.context_len.store(context.unwrap_or(0), Ordering::Relaxed);
        if let Some(tokenizer) = &self.tokenizer {
            tokenizer.set_context_len(context);
        }
    }

    /// The engines' context length, where known.
    fn context_len(&self) -> Option<usize> {
        Some(self.context_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Asks for confirming probes of `upstream` ([`health::Health::ask_probes`]).
    fn ask_probes(&self, upstream: &Upstream) {
        let asked = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).ask_probes();
        if asked {
            self.suspect.notify_one();
        }
    }

    async fn probe(&self, upstream: &Upstream) -> bool {
        let timeout = Duration::from_secs_f64(self.config.health.timeout_s);
        let fetch = async {
            let answer = self.client.get(upstream.probe.clone()).await.ok()?;
            let ok = answer.status() == StatusCode::OK;
            answer.into_body().collect().await.ok()?;
            Some(ok)
        };
        matches!(tokio::time::timeout(timeout, fetch).await, Ok(Some(true)))
    }

    fn routable(&self) -> Vec<String> {
        let snapshot = self.router().pool().snapshot();
        self.upstreams()
            .list
            .iter()
            .filter(|u| in_routing(u, &snapshot))
            .map(|u| u.id.clone())
            .collect()
    }

    /// Whether any engine is routable (what each request asks: no list is built).
    fn any_routable(&self) -> bool {
        let snapshot = self.router().pool().snapshot();
        self.upstreams().list.iter().any(|u| in_routing(u, &snapshot))
    }

    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Result<Answer, io::Error> {
        let fields = RequestFields::of(request.headers());
        if let Some(refused) =
            self.oversized(&request, &fields).or_else(|| host_refusal(&request, &fields))
        {
            return Ok(self.refuse_and_close(refused));
        }
        // HEAD is GET without the body (hyper leaves it out), as the Python plane answers it.
        let method = match request.method() {
            &Method::HEAD => &Method::GET,
            method => method,
        };
        let path = route_of(request.uri().path());
        if let Some(refused) = encoding_refusal(method, path, request.headers(), &fields) {
            let (parts, body) = request.into_parts();
            self.drain_refused(&parts.headers, body);
            return Ok(self.refuse_and_close(refused));
        }
        match (method, path) {
            (&Method::GET, "/health") => Ok(json_answer(StatusCode::OK, &json!({"status": "ok"}))),
            (&Method::GET, "/ready") => {
                let routable = self.routable().len();
                let status =
                    if routable > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                Ok(json_answer(status, &json!({"ready": routable > 0, "endpoints": routable})))
            }
            (&Method::GET, "/metrics") => {
                Ok(own(StatusCode::OK, "text/plain; version=0.0.4", self.metrics_text().into()))
            }
            (&Method::GET, "/v1/models") => Ok(self.models(&request).await),
            (&Method::POST, "/v1/completions") => {
                let gone = ClientGone::new(&self.counters, "completions");
                Ok(gone.answered(self.complete(request, "completions", &fields).await))
            }
            (&Method::POST, "/v1/chat/completions") => {
                let gone = ClientGone::new(&self.counters, "chat");
                Ok(gone.answered(self.complete(request, "chat", &fields).await))
            }
            (&Method::POST, "/v1/responses") => {
                let gone = ClientGone::new(&self.counters, "responses");
                Ok(gone.answered(self.complete(request, "responses", &fields).await))
            }
            (_, "/v1/responses/") => {
                let gone = ClientGone::new(&self.counters, BY_ID_ROUTE);
                Ok(gone.answered(self.by_id(request).await))
            }
            (_, "/health" | "/ready" | "/metrics" | "/v1/models") => Ok(method_not_allowed("GET")),
            (_, "/v1/completions" | "/v1/chat/completions" | "/v1/responses") => {
                Ok(method_not_allowed("POST"))
            }
            (_, "/admin/") => match self.admin(request).await {
                Some(answer) => Ok(answer),
                None => Ok(refusal(&Refusal::new(404, "not_found", "not found"))),
            },
            _ => Ok(refusal(&Refusal::new(404, "not_found", "not found"))),
        }
    }

    /// A refusal made before the request was read, with the connection closed after it.
    fn refuse_and_close(&self, refused: Refusal) -> Answer {
        let mut answer = self.refuse("other", refused);
        answer.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        answer
    }

    /// Returns once no engine is routable.
    async fn no_engine_left(&self) {
        loop {
            let changed = self.routing_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !self.any_routable() {
                return;
            }
            changed.await;
        }
    }

    /// A request head over the configured sizes (hyper bounds the number of headers).
    fn oversized(&self, request: &Request<Incoming>, fields: &RequestFields) -> Option<Refusal> {
        let target = request.uri().path_and_query().map_or(0, |p| p.as_str().len());
        if target > self.config.max_line_size {
            return Some(Refusal::new(
                414,
                "invalid_request_error",
                "the request line is too long",
            ));
        }
        if fields.largest > self.config.max_field_size {
            return Some(Refusal::new(
                431,
                "invalid_request_error",
                "a request header is too large",
            ));
        }
        None
    }

    fn metrics_text(&self) -> String {
        use metrics::{gauge, help};
        let mut out = String::with_capacity(4096);
        self.counters.render(&mut out);
        gauge(&mut out, "body_bytes_in_flight", &[], self.bodies.held() as f64);
        let snapshot = self.router().pool().snapshot();
        for upstream in &self.upstreams().list {
            let state = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).state;
            let up = state == health::State::Up && snapshot.get(&upstream.key).is_some();
            let value = if up { 1.0 } else { 0.0 };
            gauge(&mut out, "endpoint_up", &[("endpoint", &upstream.id)], value);
        }
        for upstream in &self.upstreams().list {
            if let Some(member) = snapshot.get(&upstream.key) {
                let load = member.inflight.local();
                let labels = [("endpoint", upstream.id.as_str())];
                gauge(&mut out, "endpoint_in_flight", &labels, load.requests as f64);
            }
        }
        let stats = self.router().index().stats();
        for (key, value) in [
            ("index_blocks", stats.blocks as f64),
            ("index_workers", stats.workers as f64),
            ("index_bytes", stats.bytes as f64),
        ] {
            gauge(&mut out, key, &[], value);
        }
        let counter = |out: &mut String, name: &str, value: u64| {
            out.push_str(&format!(
                "# HELP llmsched_gateway_{name}_total {}\n\
                 # TYPE llmsched_gateway_{name}_total counter\n\
                 llmsched_gateway_{name}_total {value}.0\n",
                help(name)
            ));
        };
        counter(&mut out, "index_evicted_blocks", stats.evicted_blocks);
        if let Some(tokenizer) = &self.tokenizer {
            tokenizer_cache_metrics(&mut out, &tokenizer.cache_stats());
        }
        if let Some(extra) = &self.extra_metrics {
            out.push_str(&extra());
        }
        gauge(&mut out, "response_owners", &[], self.owners.len() as f64);
        gauge(&mut out, "tenants", &[], self.tenants.len() as f64);
        if let Some(metrics) = self.flow.as_ref().and_then(|f| f.metrics(monotonic())) {
            gauge(&mut out, "saturation", &[], metrics.saturation);
            for band in &metrics.bands {
                let priority = band.priority.to_string();
                gauge(&mut out, "queue_length", &[("priority", &priority)], band.queued as f64);
            }
            gauge(&mut out, "running", &[], metrics.running as f64);
            gauge(&mut out, "flow_tenants", &[], metrics.tenants as f64);
            counter(&mut out, "flows_reclaimed", metrics.flows_reclaimed);
            counter(&mut out, "priorities_folded", metrics.priorities_folded);
            out.push_str(&format!(
                "# HELP llmsched_gateway_flow_outcomes_total {}\n\
                 # TYPE llmsched_gateway_flow_outcomes_total counter\n",
                help("flow_outcomes")
            ));
            for (outcome, count) in &metrics.outcomes {
                out.push_str(&format!(
                    "llmsched_gateway_flow_outcomes_total{{outcome=\"{outcome}\"}} {count}.0\n"
                ));
            }
        }
        out
    }

    fn refuse(&self, route: &str, refused: Refusal) -> Answer {
        let reason = refused.reason.unwrap_or(refused.kind);
        self.counters.rejections.inc(&[reason]);
        self.counters.requests.inc(&[route, &refused.status.as_u16().to_string()]);
        refusal(&refused)
    }

    fn identify(&self, headers: &HeaderMap, fields: &RequestFields) -> Result<Identity, Refusal> {
        if self.keys.enabled() {
            let authorization =
                RequestFields::get(fields.authorization, headers, &hyper::header::AUTHORIZATION);
            let presented = match authorization {
                Some(value) => value.to_str().ok().and_then(|v| {
                    let (scheme, token) = v.split_once(' ')?;
                    let token = token.trim();
                    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
                }),
                None => RequestFields::get(fields.api_key, headers, &API_KEY_HEADER_NAME)
                    .and_then(|v| v.to_str().ok()),
            };
            let found = presented.and_then(|key| self.keys.identify(key));
            let Some(found) = found else {
                return Err(Refusal::new(401, "invalid_api_key", "missing or invalid API key"));
            };
            return Ok(Identity {
                tenant: found.tenant.clone(),
                priority: found.priority,
                limiter: found.limiter.clone(),
            });
        }
        let header = |present: bool, name: &'static HeaderName| match RequestFields::get(
            present, headers, name,
        ) {
            None => Ok(None),
            Some(value) => match std::str::from_utf8(value.as_bytes()) {
                Ok(text) => Ok(Some(text)),
                Err(_) => Err(Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("header {name} is not valid UTF-8"),
                )
                .param(name.as_str())),
            },
        };
        let name = header(fields.tenant, &TENANT_HEADER_NAME)?
            .filter(|t| !t.is_empty())
            .unwrap_or("default");
        let (tenant, folded) = self.tenants.admit(name, monotonic());
        if folded {
            self.counters.tenants_folded.fetch_add(1, Ordering::Relaxed);
        }
        let priority = match header(fields.priority, &PRIORITY_HEADER_NAME)? {
            None => 0,
            Some(text) => text.trim().parse::<i32>().map_err(|_| {
                Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("{PRIORITY_HEADER} must be an int in -2**31..2**31-1"),
                )
                .param(PRIORITY_HEADER)
            })?,
        };
        Ok(Identity { tenant, priority, limiter: None })
    }

    async fn models(&self, request: &Request<Incoming>) -> Answer {
        let fields = RequestFields::of(request.headers());
        if let Err(refused) = self.identify(request.headers(), &fields) {
            return self.refuse("models", refused);
        }
        if self.config.models.is_empty() {
            let first = self.upstreams().list.first().map(|u| u.models.clone());
            let Some(uri) = first else {
                return self
                    .refuse("models", Refusal::new(503, "service_unavailable", "no engine"));
            };
            return match self.client.get(uri).await {
                Ok(answer) => relay(answer, Relaying::plain(self.counters.clone())),
                Err(_) => {
                    refusal(&Refusal::new(502, "upstream_error", "the engine did not answer"))
                }
            };
        }
        let mut data: Vec<Value> = self
            .config
            .models
            .iter()
            .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "llmsched"}))
            .collect();
        // Adapters as vLLM lists them: with their base model as `parent`.
        let mut adapters: Vec<_> = self.config.lora_adapters.iter().collect();
        adapters.sort();
        data.extend(adapters.into_iter().map(|(adapter, base)| {
            json!({
                "id": adapter, "object": "model", "created": 0, "owned_by": "llmsched",
                "parent": base,
            })
        }));
        self.counters.requests.inc(&["models", "200"]);
        json_answer(StatusCode::OK, &json!({"object": "list", "data": data}))
    }

    async fn complete(
        self: &Arc<Self>,
        request: Request<Incoming>,
        route: &'static str,
        fields: &RequestFields,
    ) -> Answer {
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        let arrived = monotonic();
        let deadline = arrived + self.config.total_timeout_s.unwrap_or(1e9);
        match self.serve_completion(request, route, fields, arrived, deadline).await {
            Ok(answer) => answer,
            Err(refused) => {
                let close = refused.close;
                let mut answer = self.refuse(route, refused);
                if close {
                    answer
                        .headers_mut()
                        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
                }
                answer
            }
        }
    }

    /// The caller's identity (its API key's), then the request's head and its body read
    /// within the body limits. A request its key refuses has its body drained aside, unread
    /// (see `drain_refused_body`).
    async fn identified_body(
        &self,
        request: Request<Incoming>,
        fields: &RequestFields,
    ) -> Result<(Identity, hyper::http::request::Parts, Bytes), Refusal> {
        let identity = match self.identify(request.headers(), fields) {
            Ok(identity) => identity,
            Err(refused) => {
                let (parts, body) = request.into_parts();
                self.drain_refused(&parts.headers, body);
                // A client waiting for `100 Continue` sends no body after this final status:
                // the connection is closed rather than read on for one.
                let close = refused.close || awaits_continue(&parts.headers);
                return Err(Refusal { close, ..refused });
            }
        };
        let (parts, body) = request.into_parts();
        let raw = self.read_body(&parts.headers, fields, body).await?;
        Ok((identity, parts, raw))
    }

    /// Reads and drops a refused request's body in the background (`drain_refused_body`,
    /// within `body_timeout_s`), unless its client waits for `100 Continue` before sending it
    /// ([`awaits_continue`]): that body is never asked for (reading it would send the `100
    /// Continue` after the refusal, or take the client's next request for it), and the
    /// connection closes after the refusal.
    fn drain_refused(&self, headers: &HeaderMap, body: Incoming) {
        if !awaits_continue(headers) {
            self.drain_body(body);
        }
    }

    /// Reads and drops a refused request's body in the background (`drain_refused_body`).
    fn drain_body(&self, body: Incoming) {
        let total = Duration::from_secs_f64(self.config.body_timeout_s);
        tokio::spawn(drain_refused_body(body, self.config.max_body, total));
    }

    /// A request's body, read up to `max_body` (413, and the connection closed; one declared
    /// larger is refused before it is read) within `body_timeout_s` (408), its bytes held
    /// against `max_body_in_flight` while it is read (503 `body-capacity`, and the connection
    /// closed: at once for a declared length that does not fit, as soon as a chunked body's
    /// next frame does not fit). The bytes are given back when this returns, whatever it
    /// returns, and when the request's future is dropped (its client gone).
    async fn read_body(
        &self,
        headers: &HeaderMap,
        fields: &RequestFields,
        mut body: Incoming,
    ) -> Result<Bytes, Refusal> {
        let declared = RequestFields::get(fields.length, headers, &CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let too_large = || Refusal {
            close: true,
            ..Refusal::new(413, "request_too_large", "the request body is too large")
        };
        let max_body = self.config.max_body;
        if declared.is_some_and(|n| n > max_body as u64) {
            // Answered before the body is read: the rest is read and dropped meanwhile, or
            // the close over it would reset the connection and a client still sending it
            // would lose the 413.
            self.drain_refused(headers, body);
            return Err(too_large());
        }
        let no_room = || Refusal {
            close: true,
            ..Refusal::new(
                503,
                "service_unavailable",
                "the gateway is receiving too many request bodies at once \
                 (limits.max_body_bytes_in_flight); retry later",
            )
            .dropped("body-capacity", self.config.retry_after_s.to_string())
        };
        let mut hold = self.bodies.hold();
        if let Some(length) = declared {
            if !hold.take(length) {
                self.drain_refused(headers, body);
                return Err(no_room());
            }
        }
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs_f64(self.config.body_timeout_s);
        // A body of one frame (the usual one) is kept as it came: no list, no copy.
        let mut first: Option<Bytes> = None;
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut read = 0usize;
        // One timer for the body's frames (made only if one is waited for).
        let slot = std::pin::pin!(None);
        let mut timer = AttemptTimer::new(slot);
        loop {
            let frame = match timer.within(deadline, std::pin::pin!(body.frame())).await {
                Err(_) => {
                    return Err(Refusal {
                        close: true,
                        ..Refusal::new(
                            408,
                            "request_timeout",
                            "the request body did not arrive in time",
                        )
                    })
                }
                Ok(None) => break,
                Ok(Some(Err(_))) => {
                    return Err(Refusal::new(
                        400,
                        "invalid_request_error",
                        "the body did not arrive",
                    ))
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else { continue }; // trailers
            read += data.len();
            // The body is coming (a `100 Continue` went out if it was awaited): the rest is
            // read and dropped.
            if read > max_body {
                self.drain_body(body);
                return Err(too_large());
            }
            if declared.is_none() && !hold.take(data.len() as u64) {
                self.drain_body(body);
                return Err(no_room());
            }
            match first {
                None => first = Some(data),
                Some(_) => chunks.push(data),
            }
        }
        // A UTF-8 byte order mark first is dropped (Python's `json.loads` of bytes, vLLM's
        // reading, skips it): read and forwarded without it.
        let body = match first {
            None => Bytes::new(),
            Some(first) if chunks.is_empty() => first,
            Some(first) => {
                let mut whole = bytes::BytesMut::with_capacity(read);
                whole.extend_from_slice(&first);
                for chunk in chunks {
                    whole.extend_from_slice(&chunk);
                }
                whole.freeze()
            }
        };
        Ok(if body.starts_with(payload::UTF8_BOM) {
            body.slice(payload::UTF8_BOM.len()..)
        } else {
            body
        })
    }

    async fn serve_completion(
        self: &Arc<Self>,
        request: Request<Incoming>,
        route: &'static str,
        fields: &RequestFields,
        arrived: f64,
        deadline: f64,
    ) -> Result<Answer, Refusal> {
        let (identity, mut parts, raw) = self.identified_body(request, fields).await?;
        let payload = Payload::parse(&raw).map_err(Refusal::unreadable)?;
        check_fields(&payload)?;
        let model = match (payload.text("model"), payload.str("model")) {
            (Some(_), Some(model)) => Some(model),
            // Without configured models (the standalone binary) the field is optional.
            (None, _) if self.models.is_empty() => None,
            _ => {
                return Err(Refusal::new(400, "invalid_request_error", "'model' must be a string")
                    .param("model"))
            }
        };
        let model = model.as_deref();
        // (adapter, its base model) when the request names an adapter.
        let adapter = model.and_then(|m| self.config.lora_adapters.get_key_value(m));
        if let Some(model) = model
            .filter(|m| !self.models.is_empty() && !self.models.contains(*m) && adapter.is_none())
        {
            // A configured key is never echoed back.
            let named = if self.keys.identify(model).is_some() { "<redacted>" } else { model };
            return Err(Refusal::new(
                404,
                "model_not_found",
                format!("model {named:?} is not served here"),
            )
            .param("model"));
        }
        let prompt = if self.tokenizer.is_some() && raw.len() >= OFFLOADED_PROMPT_BYTES {
            // Tokenizing a long prompt takes milliseconds to seconds: off the threads that
            // serve every other request (with one, they would all wait for it).
            let (gateway, body) = (self.clone(), raw.clone());
            let tokenized = tokio::task::spawn_blocking(move || {
                let payload = Payload::parse(&body).map_err(Refusal::unreadable)?;
                gateway.request_prompt(&payload, &body, route)
            });
            tokenized.await.map_err(|_| {
                Refusal::new(500, "internal_error", "tokenizing the prompt failed")
            })??
        } else {
            self.request_prompt(&payload, &raw, route)?
        };
        let Prompt { tokens, ids, size: prompt_size, previous, kind } = prompt;
        let sse = payload.stream();
        let limiter = limited(&identity, prompt_size as u64)?;
        // Made only for a refusal that sends it.
        let retry_after = || self.config.retry_after_s.to_string();
        if !self.any_routable() {
            return Err(Refusal::new(503, "service_unavailable", "no engine is available")
                .dropped("no-endpoints", retry_after()));
        }
        let mut queued_s = 0.0;
        let slot = match &self.flow {
            None => None,
            Some(flow) => {
                let queued_at = monotonic();
                let admit = flow.admit(
                    &identity.tenant,
                    identity.priority,
                    prompt_size as u64,
                    raw.len() as u64,
                    deadline,
                    monotonic,
                );
                let admitted = tokio::select! {
                    admitted = admit => admitted,
                    // Every engine left routing while the request waited: 503 at once (the
                    // queued request is cancelled).
                    _ = self.no_engine_left() => Err(flow::NotAdmitted::Outcome(
                        llmsched_core::flow::Outcome::RejectedNoEndpoints,
                    )),
                };
                let waited = monotonic() - queued_at;
                queued_s = waited;
                self.counters.histograms.admission_wait.observe(waited);
                match admitted {
                    Ok(slot) => Some(slot),
                    Err(flow::NotAdmitted::Deadline) => return Err(deadline_refusal()),
                    Err(flow::NotAdmitted::Outcome(outcome)) => {
                        let status = outcome.http_status();
                        let kind = if status == 429 {
                            "rate_limit_exceeded"
                        } else {
                            "service_unavailable"
                        };
                        return Err(Refusal::new(
                            status,
                            kind,
                            format!("request not admitted: {}", outcome.reason()),
                        )
                        .dropped(outcome.reason(), retry_after()));
                    }
                }
            }
        };
        let session = match RequestFields::get(fields.session, &parts.headers, &SESSION_HEADER_NAME)
        {
            None => None,
            Some(value) => Some(std::str::from_utf8(value.as_bytes()).map_err(|_| {
                Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("header {SESSION_HEADER} is not valid UTF-8"),
                )
                .param(SESSION_HEADER)
            })?),
        };
        let session_endpoint = self.session_endpoint(&parts.headers, fields);
        let meta = RequestMeta {
            // An adapter is served by its base model's engines; its cache blocks are keyed
            // by its name.
            model: match adapter {
                Some((_, base)) => Some(base.clone()),
                None => model.map(str::to_owned),
            },
            lora: adapter.map(|(name, _)| name.clone()),
            session_id: session.map(str::to_owned),
            // vLLM salts the prompt's first block with it: a salted prompt shares no block
            // with the same prompt unsalted or under another salt.
            cache_salt: payload.str("cache_salt").map(Cow::into_owned),
            session_endpoint,
            ..RequestMeta::default()
        };
        let stored = route == "responses"
            && responses::stores_response(payload.value("store").and_then(Result::ok).as_ref());
        // A conversation continued by `previous_response_id` goes to the engine holding it.
        let owner = match &previous {
            Some(id) => Some(self.response_owner(id, deadline, true).await?),
            None => None,
        };
        // The Responses API is never sliced.
        // Read in the condition, so that the assembler is no part of the waits that follow.
        if let Some(assembler) = self
            .slicing
            .as_ref()
            .filter(|_| route != "responses")
            .and_then(|s| s.assembler(&payload, route == "chat"))
        {
            self.counters.histograms.overhead.observe(monotonic() - arrived - queued_s);
            let run = slicing::SlicedRequest::new(
                assembler,
                route,
                identity.tenant.clone(),
                identity.priority,
                ids,
                meta,
                kind,
                sse,
                deadline,
                Guards { slot, limiter },
            );
            return Ok(Box::pin(self.serve_sliced(run)).await);
        }
        let router = self.router();
        let before = monotonic();
        let decided = self.decide_off_runtime(&tokens, ids, &meta, before).await;
        self.counters.histograms.decision.observe(monotonic() - before);
        self.check_ids(kind, &tokens, &meta, before);
        let decision = match decided {
            Ok(decision) => decision,
            Err(RoutingError::NoEndpoint { .. }) => {
                return Err(Refusal::new(503, "service_unavailable", "no engine is available")
                    .dropped("no-endpoints", retry_after()));
            }
            Err(err @ RoutingError::Plugin(_)) => return Err(self.routing_failed(&err)),
            Err(err) => return Err(Refusal::new(400, "invalid_request_error", err.to_string())),
        };
        let prefill = decision.prefill().map(|p| decision.endpoint(p).address.clone());
        // Borrowed from the decision (or the owner), read as the attempts go: no key is
        // copied, and no list is built, per request.
        let mut by_rank = decision.ranked().map(|c| &decision.endpoint(c).id);
        // Its engine, whatever the decision, and no other: any other would answer 404 for a
        // response it never stored (a failed attempt there is a 502).
        let mut owner_key = owner.as_ref().map(|owner| &owner.key);
        let owned = owner_key.is_some();
        let mut next_key = move || if owned { owner_key.take() } else { by_rank.next() };
        let upstreams = self.upstreams();
        let guards = Guards { slot, limiter };
        let attempts = self.config.retries + 1;
        let mut tried = 0;
        // Failures the request itself may have caused (a 5xx, a connection dropped before
        // the status line), held until it ends: see `settle_held`.
        let mut held: Vec<(&Upstream, &'static str)> = Vec::new();
        // The attempts' waits (an answer's head, then its body or first frame) on one timer.
        let slot = std::pin::pin!(None);
        let mut timer = AttemptTimer::new(slot);
        // What the engines get of the client's head, read once; the client's map, drained,
        // carries the first attempt's head (its allocation kept), a later attempt's is new.
        let accept =
            RequestFields::get(fields.accept, &parts.headers, &hyper::header::ACCEPT).cloned();
        let mut client_head = Some(std::mem::take(&mut parts.headers));
        while let Some(key) = next_key() {
            if tried == attempts {
                break;
            }
            let Some(upstream) = upstreams.by_key.get(key) else { continue };
            tried += 1;
            if tried > 1 {
                self.counters.retries.fetch_add(1, Ordering::Relaxed);
            }
            let path = match route {
                "chat" => &upstream.chat_path,
                "responses" => &upstream.responses_path,
                _ => &upstream.completions_path,
            };
            let mut forward = Request::new(Full::new(raw.clone()));
            *forward.method_mut() = Method::POST;
            *forward.uri_mut() = path.clone();
            let prefill_header = match (&self.pd_header, &prefill) {
                (Some(header), Some(address)) => {
                    HeaderValue::from_str(address).ok().map(|value| (header, value))
                }
                _ => None,
            };
            *forward.headers_mut() =
                forward_head(client_head.take(), accept.as_ref(), prefill_header);
            let Ok(ticket) = router.commit(&decision, Some(key), monotonic()) else { continue };
            if tried == 1 {
                self.counters.histograms.overhead.observe(monotonic() - arrived - queued_s);
            }
            let sent = upstream.connections.send(forward);
            // The status line is waited for `read_timeout_s`, and never past the deadline
            // (without a read timeout too).
            let left = (deadline - monotonic()).max(0.0);
            let wait = self.config.read_timeout_s.map_or(left, |read| read.min(left));
            // As `tokio::time::timeout` sets it (past `Instant`'s range: no bound).
            let answered =
                match tokio::time::Instant::now().checked_add(Duration::from_secs_f64(wait)) {
                    Some(at) => timer.within(at, std::pin::pin!(sent)).await,
                    None => Ok(sent.await),
                };
            let answer = match answered {
                Err(_) => {
                    // The engine has the request and may be running it: not sent again.
                    self.counters.upstream_errors.inc(&[&upstream.id, "timeout"]);
                    self.settle_held(&held, false);
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    if monotonic() >= deadline {
                        // The request's own deadline says nothing about the engine.
                        return Err(deadline_refusal());
                    }
                    self.attempt_ended(upstream, Some("timeout"));
                    return Err(Refusal::new(
                        504,
                        "timeout",
                        "the engine did not answer within timeouts.read_s",
                    ));
                }
                Ok(Err(err)) => {
                    // Refused (or timed out) connecting, or closed before a status line.
                    let kind = match err {
                        pool::SendError::Connect(_) => "connect",
                        pool::SendError::Broken(_) => "broken",
                    };
                    self.counters.upstream_errors.inc(&[&upstream.id, kind]);
                    if kind == "broken" {
                        held.push((upstream, kind));
                    } else {
                        self.attempt_ended(upstream, Some(kind));
                    }
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    continue;
                }
                Ok(Ok(answered)) => answered,
            };
            let (answer, lease) = answer;
            let head = AnswerFields::of(answer.headers());
            if answer.status().is_informational()
                || answer.status() == StatusCode::NO_CONTENT
                || answer.status() == StatusCode::NOT_MODIFIED
                || answer.status().as_u16() >= 600
                || head.coded_transfer(answer.headers())
            {
                // A final 1xx (101 Switching Protocols to a plain POST): no answer at all, and
                // nothing a client could use; the connection is the engine's now. A 204 or 304
                // has no body (hyper drops one sent all the same): no generation either, as
                // the Python plane reads it (an empty JSON answer, cut). A status past 599
                // (hyper reads up to 999) is no HTTP status a client knows either, and a body
                // in a transfer coding besides chunked (gzip) no body it could read.
                self.counters.upstream_errors.inc(&[&upstream.id, "broken"]);
                self.attempt_ended(upstream, Some("broken"));
                drop(ticket);
                self.drop_record(router, &decision, key);
                continue;
            }
            let failed = answer.status().is_server_error();
            if failed {
                self.counters.upstream_errors.inc(&[&upstream.id, "status_5xx"]);
                if self.config.retry_on_5xx {
                    // Not passed on: the next endpoint may do better.
                    held.push((upstream, "status_5xx"));
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    continue;
                }
                self.attempt_ended(upstream, Some("status_5xx"));
            } else {
                self.attempt_ended(upstream, None);
                self.counters.routed.inc(&[&upstream.id]);
                if answer.status().is_client_error() {
                    // The engine refused the request and cached none of it: the blocks
                    // recorded for it there go (they would draw its prefix to nothing).
                    self.drop_record(router, &decision, key);
                }
            }
            self.settle_held(&held, false);
            let responses = route == "responses";
            // A response the engine does not keep (`store` false) has no owner to learn.
            let learns = responses && stored && answer.status().is_success();
            let relaying = Relaying {
                ticket: Some(ticket),
                guards: Some(guards),
                route: Some(route),
                lease: Some(lease),
                responses,
                // Learned from the first event on: the stream's own client may ask for the
                // response (or cancel it) before the stream ends.
                id_scan: learns.then(|| OwnerScan {
                    owners: self.owners.clone(),
                    engine: upstream.label.clone(),
                    scan: responses::IdScan::default(),
                }),
                // A 5xx answer counted as the failure it is: cut or whole, nothing more.
                charge: (!failed)
                    .then(|| Charge { reports: self.cuts.clone(), upstream: upstream.clone() }),
                ..Relaying::completion(self, upstream, sse, deadline)
            };
            let token = self.sets_session_tokens.then(|| self.session_tokens.token(&upstream.id));
            // A JSON answer whose end is the connection's close is read whole and checked:
            // a cut there looks like a complete answer. An answer framed by its length is read
            // whole too (up to 8 MiB), whatever the request asked: an engine's JSON answer
            // to a stream request (its refusal, or no stream at all) cut short is a 502, as on
            // the Python plane, not a 200 whose relayed length hides the cut.
            let mut answered =
                if (sse || failed) && !head.checked_whole(&answer) && !head.length_framed() {
                    self.relay_from_first_frame(answer, relaying, &mut timer).await
                } else {
                    self.answer_whole(answer, head, relaying, &mut timer).await
                };
            if let (Ok(answer), Some(token)) = (&mut answered, token) {
                // The engine that served, for the client to echo (llm-d's session token).
                if let Ok(value) = HeaderValue::try_from(token) {
                    answer.headers_mut().insert(session_token::SESSION_TOKEN_HEADER, value);
                }
            }
            return answered;
        }
        drop(guards);
        self.settle_held(&held, true);
        Err(Refusal::new(502, "upstream_error", "no engine answered the request"))
    }

    /// The engine a request's `x-session-token` names, when it is one of the gateway's; any
    /// other token is ignored (and counted), as llm-d ignores it.
    fn session_endpoint(&self, headers: &HeaderMap, fields: &RequestFields) -> Option<WorkerKey> {
        let token = RequestFields::get(fields.token, headers, &SESSION_TOKEN_HEADER_NAME)?;
        let key = self.session_tokens.endpoint(token.as_bytes()).map(WorkerKey::Str);
        let known = key.filter(|key| self.upstreams().by_key.contains_key(key));
        if known.is_none() {
            self.counters.session_tokens_ignored.fetch_add(1, Ordering::Relaxed);
        }
        known
    }

    /// Counts the failures a request held (`held`) against their engines when it ends, unless
    /// it went `unanswered` after failing so on two or more engines: then the request, not
    /// the engines, is the likely cause (an input every engine answers with a 5xx), and
    /// counting it would let a few such requests open every engine's breaker. It is counted
    /// as poisoned instead, and those engines are probed: probes, not this request, decide
    /// whether they are well. A request answered elsewhere, or failed on one engine, counts
    /// as before.
    fn settle_held(&self, held: &[(&Upstream, &'static str)], unanswered: bool) {
        if unanswered && held.len() >= 2 {
            self.counters.poisoned.fetch_add(1, Ordering::Relaxed);
            // Probes tell an input every engine fails on from engines failing together.
            for (upstream, _) in held {
                self.ask_probes(upstream);
            }
            return;
        }
        for (upstream, kind) in held {
            self.attempt_ended(upstream, Some(kind));
        }
    }

    /// An answer relayed as it comes, its status held back until the engine's first body
    /// frame: an engine that sends its head and then fails or stays silent for the read
    /// timeout (vLLM sends a stream's head before prefill) gets the client a 502 with a JSON
    /// body, as any failure before the first byte, never a 200 cut short. A body that ends
    /// at once is relayed as it is, unless it is an event stream that needed its `[DONE]`.
    async fn relay_from_first_frame(
        &self,
        answer: Response<Incoming>,
        relaying: Relaying,
        timer: &mut AttemptTimer<'_>,
    ) -> Result<Answer, Refusal> {
        let (parts, mut body) = answer.into_parts();
        let wake = wake_at(relaying.read_timeout, relaying.deadline);
        let first = match timer.within(wake, std::pin::pin!(body.frame())).await {
            Ok(Some(Ok(frame))) => Some(frame),
            Ok(None)
                if !(is_event_stream(&parts.headers)
                    && ends_at_close(parts.status, &parts.headers)) =>
            {
                None
            }
            // The request's deadline, not the engine, ended the wait: its 504, no truncation
            // charged to the engine.
            Err(_) if relaying.deadline_passed() => return Err(deadline_refusal()),
            _ => {
                let endpoint = relaying.endpoint.clone().unwrap_or_else(|| Arc::from(""));
                self.counters.upstream_errors.inc(&[&endpoint, "truncated"]);
                self.counters.truncated.inc(&[&endpoint, "error"]);
                if let Some(charge) = &relaying.charge {
                    self.charge_cut(&charge.upstream);
                }
                return Err(Refusal::new(
                    502,
                    "upstream_error",
                    "the engine's answer was cut off before its first byte",
                ));
            }
        };
        Ok(relay_parts(parts, body, first, relaying))
    }

    /// A JSON answer read whole before anything is sent (up to 8 MiB; a larger one streams):
    /// cut off or silent for `read_timeout_s`, it is a 502 (counted as truncated), never a
    /// partial body.
    /// An attempt on `key` failed (the engine did not run the request): drops the
    /// approximate prefix blocks committing it recorded there (and on its prefill engine),
    /// the ones beyond what the endpoint held when the decision was made, unless an engine's
    /// KV events confirmed them since. As the Python plane's `Placement` does.
    fn drop_record(&self, router: &Router, decision: &Decision, key: &WorkerKey) {
        if decision.hashes.is_empty() {
            return;
        }
        let held = |id: &WorkerKey| {
            decision.base.iter().find(|c| &decision.endpoint(c).id == id).map(|c| c.cached_blocks)
        };
        let mut used = vec![(key.clone(), held(key))];
        if let Some(prefill) = decision.prefill() {
            let id = decision.endpoint(prefill).id.clone();
            used.push((id, Some(prefill.cached_blocks)));
        }
        let index = router.index();
        let mut removed = 0;
        for (worker, held) in used {
            let start = (held.unwrap_or(0) as usize).min(decision.hashes.len());
            let Ok(holdings) = index.holdings(&worker) else { continue };
            let ours: Vec<u64> = decision.hashes[start..]
                .iter()
                .rev()
                .copied()
                .filter(|h| {
                    holdings
                        .binary_search_by_key(h, |(hash, _, _)| *hash)
                        .is_ok_and(|i| !holdings[i].2)
                })
                .collect();
            if !ours.is_empty() {
                // Changed since read (an event, an expiry): left as it is.
                removed += index.remove(&worker, &ours, None).unwrap_or(0);
            }
        }
        if removed > 0 {
            self.counters.records_removed.fetch_add(removed, Ordering::Relaxed);
        }
    }

    /// The prompt of a request on `route` (`raw` its body): the ids the router hashes
    /// ([`Gateway::prompt_tokens`]), or a responses request's ([`Gateway::responses_prompt`]).
    fn request_prompt(
        &self,
        payload: &Payload<'_>,
        raw: &[u8],
        route: &str,
    ) -> Result<Prompt, Refusal> {
        if route == "responses" {
            return self.responses_prompt(payload, raw);
        }
        let chat = route == "chat";
        if !chat && !self.hashes_prompts && self.tokenizer.is_none() {
            // A router that hashes no prompt is told only its size: a text prompt's ids are
            // counted, not packed (as `prompt_tokens` would pack them; an empty prompt is
            // refused there).
            if let Some(text) = payload.str("prompt").filter(|text| !text.is_empty()) {
                let size = packed_len(text.len());
                return Ok(Prompt {
                    tokens: Vec::new(),
                    size,
                    ids: size,
                    previous: None,
                    kind: IdKind::Pseudo,
                });
            }
        }
        let tokens = self.prompt_tokens(payload, chat)?;
        let kind = if self.tokenizer.is_some() || (!chat && gives_token_ids(payload)) {
            IdKind::TokenIds
        } else if tokens.is_empty() {
            IdKind::Unhashed // embeddings only
        } else {
            IdKind::Pseudo
        };
        Ok(Prompt { size: tokens.len(), ids: tokens.len(), tokens, previous: None, kind })
    }

    /// The prompt of a `POST /v1/responses` request: the chat request vLLM makes of it
    /// ([`responses::chat_request_of`]), tokenized (or hashed) as a chat request is. A
    /// conversation continued by `previous_response_id` is not hashed: the engine puts its
    /// stored conversation first, which the gateway cannot see, so the blocks of the new input
    /// alone would be recorded for blocks the engine never caches; its engine is found by the
    /// id instead. An input the conversion does not cover, or that the chat path refuses (an
    /// image part, say: the engine's to take or refuse), is routed unhashed and counted.
    /// Without hashes, the prompt's size for limits and flow control is a quarter of its
    /// `input`'s JSON bytes (of the whole body when serde_json's `Value` cannot hold it: a
    /// number past f64's range). `previous_response_id` is read from `payload` (as parsed
    /// for every request), so that such a number anywhere neither hides it nor makes it
    /// pass unchecked.
    fn responses_prompt(&self, payload: &Payload<'_>, raw: &[u8]) -> Result<Prompt, Refusal> {
        let unhashed = |size: usize| {
            self.counters.responses_unhashed.fetch_add(1, Ordering::Relaxed);
            Ok(Prompt { tokens: Vec::new(), ids: 0, size, previous: None, kind: IdKind::Unhashed })
        };
        let previous = match payload.raw("previous_response_id") {
            None => None,
            Some(value) if value.get() == "null" => None,
            Some(value) => match payload::as_str(value) {
                Some(id) if !id.is_empty() => Some(id.into_owned()),
                _ => {
                    return Err(Refusal::new(
                        400,
                        "invalid_request_error",
                        "'previous_response_id' must be a non-empty string",
                    )
                    .param("previous_response_id"))
                }
            },
        };
        let body = serde_json::from_slice::<Value>(raw).ok();
        let size = match &body {
            Some(body) => body.get("input").map_or(4, |input| input.to_string().len()) / 4,
            None => raw.len() / 4,
        };
        if previous.is_some() {
            return Ok(Prompt {
                tokens: Vec::new(),
                ids: 0,
                size,
                previous,
                kind: IdKind::Unhashed,
            });
        }
        let Some(body) = body else { return unhashed(size) };
        let Some(chat) = responses::chat_request_of(&body) else { return unhashed(size) };
        if chat["messages"].as_array().is_none_or(Vec::is_empty) {
            // Nothing to hash (and nothing vLLM would render but a generation prompt).
            return Ok(Prompt {
                tokens: Vec::new(),
                ids: 0,
                size: 0,
                previous: None,
                kind: IdKind::Unhashed,
            });
        }
        let Ok(text) = serde_json::to_vec(&chat) else { return unhashed(size) };
        let Ok(payload) = Payload::parse(&text) else { return unhashed(size) };
        match self.prompt_tokens(&payload, true) {
            Ok(tokens) => {
                let kind = if self.tokenizer.is_some() { IdKind::TokenIds } else { IdKind::Pseudo };
                Ok(Prompt { size: tokens.len(), ids: tokens.len(), tokens, previous: None, kind })
            }
            Err(_) => unhashed(size),
        }
    }

    /// The engine holding stored response `id`: known from its answer, else asked of the
    /// engines ([`Gateway::locate`]); counted by outcome. `routable`: the engine must be in
    /// routing (a request continuing the conversation; a 503 `owner-unavailable` otherwise),
    /// else it need only be configured (a by-id request: no other engine can answer it). An
    /// engine that left the configuration within [`responses::OWNER_GRACE`] may come back
    /// with it: a 503 `owner-unavailable` too. No engine holds it: 404, as vLLM answers it.
    async fn response_owner(
        self: &Arc<Self>,
        id: &str,
        deadline: f64,
        routable: bool,
    ) -> Result<Arc<Upstream>, Refusal> {
        let lookups = &self.counters.response_lookups;
        let upstreams = self.upstreams();
        let unavailable = |why: &str| {
            lookups.inc(&["owner_unavailable"]);
            Refusal::new(
                503,
                "service_unavailable",
                format!("the engine holding response '{id}' is not available ({why})"),
            )
            .dropped("owner-unavailable", self.config.retry_after_s.to_string())
        };
        let known = match self.owners.owner(id) {
            Some(responses::Holder::Left(engine)) => {
                return Err(unavailable(&format!("'{engine}' left the configuration")));
            }
            Some(responses::Holder::Engine(engine)) => {
                upstreams.list.iter().find(|u| *u.label == *engine).cloned()
            }
            None => None,
        };
        if let Some(upstream) = known {
            if routable && !in_routing(&upstream, &self.router().pool().snapshot()) {
                return Err(unavailable(&format!("'{}' is out of routing", upstream.label)));
            }
            lookups.inc(&["owner"]);
            return Ok(upstream);
        }
        if let Some(upstream) = self.locate(id, deadline).await {
            lookups.inc(&["located"]);
            return Ok(upstream);
        }
        lookups.inc(&["not_found"]);
        let param = if routable { "previous_response_id" } else { "response_id" };
        Err(Refusal::new(
            404,
            "invalid_request_error",
            format!("Response with id '{id}' not found."),
        )
        .param(param))
    }

    /// Asks every engine in routing at once for stored response `id` (`GET
    /// /v1/responses/{id}`, each ask bounded by [`LOCATE_TIMEOUT_S`], the read timeout and
    /// `deadline`); the first to answer 200 with that very id (the top-level `id` of its
    /// JSON answer: an engine answering 200 for any id captures none) holds it, and is
    /// recorded; the other asks are dropped. For ids this gateway never saw: made before it
    /// started, or through another replica. Concurrent lookups of one id share one (a
    /// request's own deadline still bounds its wait); a lookup whose requests are all gone
    /// is dropped, its asks with it.
    async fn locate(self: &Arc<Self>, id: &str, deadline: f64) -> Option<Arc<Upstream>> {
        use futures::FutureExt;
        let (stamp, lookup) = {
            let mut locating = self.locating.lock().unwrap_or_else(|e| e.into_inner());
            let running = locating
                .map
                .get(id)
                .and_then(|(stamp, weak)| Some((*stamp, weak.upgrade()?)))
                .filter(|(_, lookup)| lookup.peek().is_none());
            match running {
                Some(running) => running,
                None => {
                    let (gateway, asked) = (self.clone(), id.to_owned());
                    let lookup: Lookup =
                        async move { gateway.ask_engines(&asked, deadline).await }.boxed().shared();
                    let stamp = locating.next;
                    locating.next += 1;
                    if let Some(weak) = lookup.downgrade() {
                        locating.map.insert(id.to_owned(), (stamp, weak));
                    }
                    (stamp, lookup)
                }
            }
        };
        let mut waiter = LookupWaiter { locating: &self.locating, id, stamp, lookup: Some(lookup) };
        let lookup = waiter.lookup.as_mut()?;
        let left = (deadline - monotonic()).max(0.0);
        tokio::time::timeout(Duration::from_secs_f64(left), lookup).await.ok().flatten()
    }

    /// One lookup of [`Gateway::locate`].
    async fn ask_engines(&self, id: &str, deadline: f64) -> Option<Arc<Upstream>> {
        use futures::StreamExt;
        let upstreams = self.upstreams();
        let pool = self.router().pool().snapshot();
        let each = self.config.read_timeout_s.map_or(LOCATE_TIMEOUT_S, |r| r.min(LOCATE_TIMEOUT_S));
        let wait = each.min(deadline - monotonic());
        if wait <= 0.0 {
            return None;
        }
        let wait = Duration::from_secs_f64(wait);
        let segment = responses::path_segment(id);
        let mut asks = futures::stream::FuturesUnordered::new();
        for upstream in upstreams.list.iter().filter(|u| in_routing(u, &pool)) {
            let Ok(uri) = format!("{}/v1/responses/{segment}", upstream.prefix).parse::<Uri>()
            else {
                continue;
            };
            let mut ask = Request::new(Full::new(Bytes::new()));
            *ask.uri_mut() = uri;
            asks.push(async move {
                let asked = async {
                    let (answer, lease) = upstream.connections.send(ask).await.ok()?;
                    let ok = answer.status() == StatusCode::OK;
                    // Read to its end, so that the connection can serve again.
                    let body = Limited::new(answer.into_body(), 8 << 20).collect().await.ok()?;
                    lease.release();
                    let named = responses::response_id_of(&body.to_bytes());
                    (ok && named.as_deref() == Some(id)).then_some(upstream)
                };
                tokio::time::timeout(wait, asked).await.ok().flatten()
            });
        }
        while let Some(found) = asks.next().await {
            if let Some(upstream) = found {
                self.owners.record(id, &upstream.id);
                return Some(upstream.clone());
            }
        }
        None
    }

    /// `/v1/responses/{id}` and the paths under it (`cancel`, `input_items`), any method:
    /// relayed (method, path, query, body, `Content-Type` and `Accept`) to the engine
    /// holding the response, which alone can answer it; never retried elsewhere.
    /// Authenticated and held to the key's request limits (rate and requests in progress,
    /// no tokens), but not admitted through flow control: no generation runs. Its answer is
    /// checked as a generation's is: ended by the connection's close, it is read whole (up
    /// to 8 MiB) and, JSON, must parse; an event stream must end with its terminal event;
    /// a transfer coding besides chunked is a 502.
    async fn by_id(self: &Arc<Self>, request: Request<Incoming>) -> Answer {
        let deadline = monotonic() + self.config.total_timeout_s.unwrap_or(1e9);
        match self.serve_by_id(request, deadline).await {
            Ok(answer) => answer,
            Err(refused) => {
                let close = refused.close;
                let mut answer = self.refuse(BY_ID_ROUTE, refused);
                if close {
                    answer
                        .headers_mut()
                        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
                }
                answer
            }
        }
    }

    async fn serve_by_id(
        self: &Arc<Self>,
        request: Request<Incoming>,
        deadline: f64,
    ) -> Result<Answer, Refusal> {
        let fields = RequestFields::of(request.headers());
        let (identity, parts, raw) = self.identified_body(request, &fields).await?;
        // A dot segment, or an escaped `/`, would name another path (for the engine, or a
        // proxy before it, that resolves them): no such path is served.
        let Some(target) = responses::by_id_target(parts.uri.path()) else {
            return Err(Refusal::new(404, "not_found", "not found"));
        };
        let limiter = limited(&identity, 0)?;
        let upstream = self.response_owner(&target.id, deadline, false).await?;
        let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        let uri = format!("{}{}{query}", upstream.prefix, target.path)
            .parse::<Uri>()
            .map_err(|_| Refusal::new(404, "not_found", "not found"))?;
        let mut forward = Request::new(Full::new(raw));
        *forward.method_mut() = parts.method.clone();
        *forward.uri_mut() = uri;
        for name in [CONTENT_TYPE, hyper::header::ACCEPT] {
            if let Some(value) = parts.headers.get(&name) {
                forward.headers_mut().insert(name, value.clone());
            }
        }
        let sent = upstream.connections.send(forward);
        let answered = match self.config.read_timeout_s {
            None => Ok(sent.await),
            Some(read) => {
                let wait = read.min((deadline - monotonic()).max(0.0));
                tokio::time::timeout(Duration::from_secs_f64(wait), sent).await
            }
        };
        let (answer, lease) = match answered {
            Err(_) => {
                self.counters.upstream_errors.inc(&[&upstream.id, "timeout"]);
                return Err(Refusal::new(504, "timeout", "the engine did not answer in time"));
            }
            Ok(Err(_)) => {
                self.counters.upstream_errors.inc(&[&upstream.id, "connect"]);
                return Err(Refusal::new(
                    502,
                    "upstream_error",
                    "the engine holding the response failed",
                ));
            }
            Ok(Ok(answered)) => answered,
        };
        if answer.status().is_informational()
            || answer.status().as_u16() >= 600
            || coded_transfer(answer.headers())
        {
            self.counters.upstream_errors.inc(&[&upstream.id, "broken"]);
            return Err(Refusal::new(
                502,
                "upstream_error",
                "the engine holding the response failed",
            ));
        }
        let relaying = Relaying {
            route: Some(BY_ID_ROUTE),
            lease: Some(lease),
            guards: Some(Guards { slot: None, limiter }),
            responses: true,
            completion: false,
            ..Relaying::completion(self, &upstream, false, deadline)
        };
        // Ended by the connection's close, a cut looks like the end: read whole and checked.
        // (An answer to HEAD has no body whatever its headers say.)
        let head = AnswerFields::of(answer.headers());
        if parts.method != Method::HEAD && head.checked_whole(&answer) {
            let slot = std::pin::pin!(None);
            let mut timer = AttemptTimer::new(slot);
            return self.answer_whole(answer, head, relaying, &mut timer).await;
        }
        Ok(relay(answer, relaying))
    }

    /// The ids the router hashes: with a tokenizer, the engine's; without, token ids as
    /// given and text as pseudo-tokens. A tokenizer's failure (a malformed conversation, a
    /// template that refuses it) is a 400 naming the problem; nothing it does can panic
    /// through here (a panic would be a 500, the gateway going on).
    fn prompt_tokens(&self, payload: &Payload<'_>, chat: bool) -> Result<Vec<u32>, Refusal> {
        let bad = |problem: String| Refusal::new(400, "invalid_request_error", problem);
        let empty = payload.text("prompt") == Some(r#""""#);
        if !chat && empty && !embeds_given(payload) {
            // As vLLM refuses it (nothing to route on, and the engine answers 400).
            return Err(bad(
                "Either prompt or prompt_embeds must be provided and non-empty.".into()
            )
            .param("prompt"));
        }
        if !chat && embeds_only(payload) {
            // vLLM takes the prompt as embeddings: no token to hash (their cache blocks are
            // keyed by the embeddings, which no other prompt shares by its tokens).
            return Ok(Vec::new());
        }
        let Some(tokenizer) = &self.tokenizer else {
            if chat {
                payload::check_messages(payload).map_err(bad)?; // as the Python plane does
            }
            return prompt_tokens(payload, chat, self.context_len()).map_err(|p| bad(p.to_owned()));
        };
        // The same first check as without a tokenizer.
        if chat && payload.raw("messages").and_then(payload::non_empty_array) != Some(true) {
            return Err(bad("'messages' must be a non-empty list".into()));
        }
        let tokenized = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if chat {
                tokenize::ChatRequest::of_payload(payload)
                    .and_then(|request| tokenizer.chat_tokens(&request))
            } else {
                let field = |name: &str| payload.value(name).and_then(Result::ok);
                let truncation = request_truncation(payload, tokenizer.context_len())
                    .map_err(|p| tokenize::PromptProblem(p.into()))?;
                tokenizer.completion_tokens(
                    field("prompt").as_ref(),
                    field("add_special_tokens").as_ref(),
                    truncation,
                )
            }
        }));
        match tokenized {
            Ok(Ok(tokens)) => Ok(tokens),
            Ok(Err(problem)) => Err(bad(problem.0)),
            Err(_) => Err(Refusal::new(500, "internal_error", "tokenizing the prompt failed")),
        }
    }

    async fn answer_whole(
        &self,
        answer: Response<Incoming>,
        head: AnswerFields,
        mut relaying: Relaying,
        timer: &mut AttemptTimer<'_>,
    ) -> Result<Answer, Refusal> {
        const WHOLE_LIMIT: u64 = 8 << 20;
        // Ended by the connection's close (no length, not chunked): the body is read whole
        // whatever its size hint, and a JSON one must parse, or it was cut.
        let at_close = head.checked_whole(&answer);
        if !at_close && answer.body().size_hint().upper().is_none_or(|n| n > WHOLE_LIMIT) {
            // Boxed: this rare wait would otherwise widen every JSON answer's future.
            return Box::pin(self.relay_from_first_frame(answer, relaying, timer)).await;
        }
        // Whether a body ended by the close must parse (read only for such a body).
        let must_parse = at_close && is_json(answer.headers());
        let events = head.length_framed_events(&answer, &relaying);
        let (parts, body) = answer.into_parts();
        let wake = wake_at(relaying.read_timeout, relaying.deadline);
        let read = timer.within(wake, std::pin::pin!(whole_body(body, WHOLE_LIMIT))).await;
        let endpoint = relaying.endpoint.clone().unwrap_or_else(|| Arc::from(""));
        let route = relaying.route.unwrap_or("completions");
        let bytes = match read {
            Ok(Some(bytes)) => Some(bytes),
            // The request's deadline, not the engine, ended the read (as above).
            Err(_) if relaying.deadline_passed() => return Err(deadline_refusal()),
            _ => None,
        };
        let whole = |bytes: &Bytes| {
            if events {
                return shows_its_end(bytes, relaying.responses);
            }
            !must_parse || serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok()
        };
        let Some(bytes) = bytes.filter(whole) else {
            self.counters.upstream_errors.inc(&[&endpoint, "truncated"]);
            self.counters.truncated.inc(&[&endpoint, "error"]);
            if let Some(charge) = &relaying.charge {
                self.charge_cut(&charge.upstream);
            }
            let message = if events {
                "the engine's event stream ended without its end event ([DONE])"
            } else if at_close {
                "the engine's answer was cut off (or, ended by closing the connection, is not \
                 whole JSON of at most 8 MiB)"
            } else {
                "the engine's answer was cut off"
            };
            return Err(Refusal::new(502, "upstream_error", message));
        };
        if let Some(lease) = relaying.lease.take() {
            lease.release();
        }
        if let Some(charge) = relaying.charge.take() {
            charge.whole();
        }
        let mut tokens = TokenCount { responses: relaying.responses, ..TokenCount::default() };
        if relaying.completion {
            tokens.feed(&bytes, events);
        }
        if let Some(mut scan) = relaying.id_scan.take() {
            if events {
                scan.feed(&bytes); // a whole Responses stream: its first event names it
            } else if let Some(id) = responses::response_id_of(&bytes) {
                scan.owners.record(&id, &scan.engine);
            }
        }
        if let Some(mut ticket) = relaying.ticket.take() {
            ticket.first_token();
            ticket.finish();
        }
        if let Some(mut guards) = relaying.guards.take() {
            guards.output_tokens(tokens.tokens());
        }
        if relaying.completion {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.requests.inc(&[route, parts.status.as_str()]);
        let mut out = Response::new(AnswerBody::Whole(Some(bytes)));
        *out.status_mut() = parts.status;
        *out.headers_mut() = whole_answer_headers(parts.headers);
        Ok(out)
    }
}

/// A whole body's data read to its end: one frame's bytes as they came (no copy), several
/// frames' copied into one, empty frames and trailers skipped; `None` when the body fails
/// or its data passes `limit` bytes. What `Limited::new(body, limit).collect()` and
/// `to_bytes` gave, without the list of frames and the trailers' slot a collection keeps
/// per body (`whole_body_reads_as_the_collection_did` compares the two).
async fn whole_body<B>(mut body: B, limit: u64) -> Option<Bytes>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut rest: Vec<Bytes> = Vec::new();
    let mut left = limit;
    while let Some(frame) = body.frame().await {
        // Trailers are skipped; a frame with more data than is left of the limit ends the
        // read, as `Limited` refuses it.
        let Ok(data) = frame.ok()?.into_data() else { continue };
        left = left.checked_sub(data.len() as u64)?;
        if data.is_empty() {
            continue;
        }
        match first {
            None => first = Some(data),
            Some(_) => rest.push(data),
        }
    }
    Some(match first {
        None => Bytes::new(),
        Some(first) if rest.is_empty() => first,
        Some(first) => {
            let mut whole = bytes::BytesMut::with_capacity((limit - left) as usize);
            whole.extend_from_slice(&first);
            for data in rest {
                whole.extend_from_slice(&data);
            }
            whole.freeze()
        }
    })
}

/// The head of a whole answer's client answer, from the engine's: `Content-Type` first (the
/// engine's last value, else `application/json`), then the engine's other [`PASSED_HEADERS`]
/// in its order, the last value of each, as `own`'s answer with each passed field of the
/// engine's inserted in turn had them. Written into the engine's own map, drained (its
/// values moved, its allocations kept): no map is made per answer.
fn whole_answer_headers(mut headers: HeaderMap) -> HeaderMap {
    /// Where the values of the field being drained go.
    enum Goes {
        Dropped,
        Type,
        Other,
    }
    let mut content_type: Option<HeaderValue> = None;
    let mut others: [Option<(HeaderName, HeaderValue)>; 2] = [None, None];
    let mut filled = 0;
    let mut into = Goes::Dropped;
    // A field's first value comes with its name, its further values without.
    for (name, value) in headers.drain() {
        match name {
            Some(name) if name == CONTENT_TYPE => {
                into = Goes::Type;
                content_type = Some(value);
            }
            // Each name comes once: the two passed besides the type fill `others` at most.
            Some(name) if PASSED_HEADERS.contains(&name) && filled < others.len() => {
                into = Goes::Other;
                others[filled] = Some((name, value));
                filled += 1;
            }
            Some(_) => into = Goes::Dropped,
            None => match into {
                Goes::Type => content_type = Some(value),
                Goes::Other => {
                    if let Some((_, last)) = &mut others[filled - 1] {
                        *last = value;
                    }
                }
                Goes::Dropped => {}
            },
        }
    }
    headers
        .insert(CONTENT_TYPE, content_type.unwrap_or(HeaderValue::from_static("application/json")));
    for (name, value) in others.into_iter().flatten() {
        headers.insert(name, value);
    }
    headers
}

/// The key's limits (`identity`'s) taken for a request of `prompt_tokens`: held until its
/// answer ends, or a 429 naming the limit reached.
fn limited(identity: &Identity, prompt_tokens: u64) -> Result<Option<LimiterGuard>, Refusal> {
    let Some(limiter) = &identity.limiter else { return Ok(None) };
    limiter.acquire(prompt_tokens, monotonic()).map_err(|over| {
        let what =
            if over.reason == "concurrency-limited" { "requests in progress" } else { "rate" };
        Refusal::new(429, "rate_limit_exceeded", format!("this key's {what} limit is reached"))
            .dropped(over.reason, (over.wait_s.ceil() as u64).max(1).to_string())
    })?;
    Ok(Some(LimiterGuard(limiter.clone(), 0)))
}

/// Waits for a shared lookup ([`Gateway::locate`]); gone (its answer read, or its request
/// gone), it removes the lookup from those in progress once no request waits for it, or
/// once it is done, so that none is left behind.
struct LookupWaiter<'a> {
    locating: &'a Mutex<Locating>,
    id: &'a str,
    stamp: u64,
    lookup: Option<Lookup>,
}

impl Drop for LookupWaiter<'_> {
    fn drop(&mut self) {
        // Its own share goes first: the last waiter then sees none left.
        drop(self.lookup.take());
        let mut locating = self.locating.lock().unwrap_or_else(|e| e.into_inner());
        let Some((stamp, weak)) = locating.map.get(self.id) else { return };
        if *stamp != self.stamp {
            return;
        }
        let finished = match weak.upgrade() {
            None => true,
            Some(lookup) => lookup.peek().is_some(),
        };
        if finished {
            locating.map.remove(self.id);
        }
    }
}

/// A request's prompt as routed.
struct Prompt {
    /// The ids the router hashes (none for a prompt not hashed, or for a router that hashes
    /// none).
    tokens: Vec<u32>,
    /// How many ids the router is told the prompt has: `tokens`', or as many as there would
    /// be for a router that hashes none.
    ids: usize,
    /// Its size in tokens for the key's limits and flow control (estimated when not hashed).
    size: usize,
    /// A responses request's `previous_response_id`.
    previous: Option<String>,
    /// What its ids are, for [`token_check`].
    kind: IdKind,
}

/// What a prompt's ids are, for the checks of [`token_check`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum IdKind {
    /// Token ids as the engine caches them (the tokenizer's, or a prompt given as ids):
    /// sampled by the check.
    TokenIds,
    /// Text hashed as pseudo-tokens (no tokenizer): counted, as the router counts its text
    /// picks.
    Pseudo,
    /// Not hashed (embeddings, a continued response).
    Unhashed,
}

/// The search for a Responses stream's id ([`responses::IdScan`]), recorded as `engine`'s
/// once found.
struct OwnerScan {
    owners: Arc<responses::Owners>,
    engine: Arc<str>,
    scan: responses::IdScan,
}

impl OwnerScan {
    /// Reads the next bytes of the stream.
    fn feed(&mut self, data: &[u8]) {
        if let Some(id) = self.scan.feed(data) {
            self.owners.record(id, &self.engine);
        }
    }
}

/// What an answer holds until its end: the flow-control slot and the key's concurrency.
struct Guards {
    slot: Option<flow::Slot>,
    limiter: Option<LimiterGuard>,
}

impl Guards {
    fn output_tokens(&mut self, tokens: u64) {
        if let Some(slot) = self.slot.as_mut() {
            slot.output_tokens = tokens;
        }
        if let Some(limiter) = self.limiter.as_mut() {
            limiter.1 = tokens;
        }
    }
}

struct LimiterGuard(Arc<guards::KeyLimiter>, u64);

impl Drop for LimiterGuard {
    fn drop(&mut self) {
        self.0.release(self.1, monotonic());
    }
}

/// The prompt as the router hashes it: token ids as given (cut as the request's truncation
/// cuts them, `context` the engines' context length where known), text as 4-byte
/// pseudo-tokens.
fn prompt_tokens(
    payload: &Payload<'_>,
    chat: bool,
    context: Option<usize>,
) -> Result<Vec<u32>, &'static str> {
    const BAD_PROMPT: &str = "'prompt' must be a string or a list of token ids";
    if chat {
        const NOT_A_LIST: &str = "'messages' must be a non-empty list";
        let messages = payload.raw("messages").and_then(payload::array_items).ok_or(NOT_A_LIST)?;
        if messages.is_empty() {
            return Err(NOT_A_LIST);
        }
        let mut text = String::new();
        for message in messages {
            let Ok(Some([role, content])) = payload::object_fields(message, &["role", "content"])
            else {
                return Err("each message must be an object");
            };
            text.push_str(role.and_then(payload::as_str).as_deref().unwrap_or(""));
            text.push('\n');
            match content {
                None => {}
                Some(raw) if raw.get() == "null" => {}
                Some(raw) => match payload::as_str(raw) {
                    Some(content) => text.push_str(&content),
                    // Other content (a list of parts) as compact JSON, as `Value` prints it.
                    None => text.push_str(
                        &serde_json::from_str::<Value>(raw.get())
                            .map(|v| v.to_string())
                            .unwrap_or_default(),
                    ),
                },
            }
            text.push('\n');
        }
        return Ok(pack_text(text.as_bytes()));
    }
    let raw = payload.text("prompt").ok_or(BAD_PROMPT)?;
    if let Some(text) = payload.str("prompt") {
        return Ok(pack_text(text.as_bytes()));
    }
    // Token ids, or a batch (small next to a text prompt): read whole.
    let prompt: Value = serde_json::from_str(raw).map_err(|_| BAD_PROMPT)?;
    let prompt = match &prompt {
        // A batch routes by its first prompt.
        Value::Array(items) if items.first().is_some_and(|p| p.is_string() || p.is_array()) => {
            &items[0]
        }
        prompt => prompt,
    };
    match prompt {
        Value::String(text) => Ok(pack_text(text.as_bytes())),
        Value::Array(ids) => {
            let mut ids = ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or(BAD_PROMPT)?;
            // The engine keeps what the request's truncation keeps of the ids.
            if let Some(truncation) = request_truncation(payload, context)? {
                truncation.cut(&mut ids);
            }
            Ok(ids)
        }
        _ => Err(BAD_PROMPT),
    }
}

/// Whether a completions request's `prompt` is token ids (`[1, 2]`, or a batch whose first
/// prompt is a list of ids): the router takes them as given, the ids the engine caches.
fn gives_token_ids(payload: &Payload<'_>) -> bool {
    let Some(raw) = payload.raw("prompt") else { return false };
    let ids = |text: &str| text.trim_start().starts_with(|c: char| c.is_ascii_digit());
    match raw.get().trim_start().strip_prefix('[') {
        Some(items) => ids(items) || items.trim_start().strip_prefix('[').is_some_and(ids),
        None => false,
    }
}

/// Whether a completions request gives its prompt only as `prompt_embeds` (vLLM's
/// `--enable-prompt-embeds`: base64 tensors, one or a list), with no `prompt`.
fn embeds_only(payload: &Payload<'_>) -> bool {
    let no_prompt = payload.text("prompt").is_none_or(|text| text == "null");
    no_prompt && embeds_given(payload)
}

/// Whether a completions request's `prompt_embeds` holds an embedding (a base64 text, or a
/// non-empty list of them).
fn embeds_given(payload: &Payload<'_>) -> bool {
    payload.raw("prompt_embeds").is_some_and(|raw| {
        payload::as_str(raw).is_some_and(|text| !text.is_empty())
            || payload::array_items(raw).is_some_and(|items| {
                !items.is_empty() && items.iter().all(|item| payload::as_str(item).is_some())
            })
    })
}

/// A request's `truncate_prompt_tokens` and `truncation_side` ([`truncation`]), `context`
/// the engines' context length where known.
fn request_truncation(
    payload: &Payload<'_>,
    context: Option<usize>,
) -> Result<Option<Truncation>, &'static str> {
    let field = |name: &str| payload.value(name).and_then(Result::ok);
    Truncation::of_fields(
        field("truncate_prompt_tokens").as_ref(),
        field("truncation_side").as_ref(),
        context,
    )
}

/// What an engine gets of the client's headers: the content type (always JSON) and
/// `Accept`. Nothing else (hosts, forwarding headers, keys, a client-sent prefill header)
/// reaches it.
///
/// The head is written into `spare` (the client's own map, on a request's first attempt)
/// cleared, its allocation kept, or into a new map: `Content-Type`, then `Accept` (the
/// client's first, `accept`), then the prefill header where one is sent, in that order
/// either way.
fn forward_head(
    spare: Option<HeaderMap>,
    accept: Option<&HeaderValue>,
    prefill: Option<(&HeaderName, HeaderValue)>,
) -> HeaderMap {
    let mut to = match spare {
        Some(mut map) => {
            map.clear();
            map
        }
        None => HeaderMap::new(),
    };
    to.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(accept) = accept {
        to.insert(hyper::header::ACCEPT, accept.clone());
    }
    if let Some((name, value)) = prefill {
        to.insert(name.clone(), value);
    }
    to
}

/// How an upstream answer is relayed.
struct Relaying {
    route: Option<&'static str>,
    ticket: Option<Ticket>,
    /// The upstream connection, released when the answer has been read to its end.
    lease: Option<pool::Lease>,
    guards: Option<Guards>,
    counters: Arc<Counters>,
    endpoint: Option<Arc<str>>,
    completion: bool,
    sse: bool,
    read_timeout: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    /// A Responses API answer: its stream ends with a terminal event (no `[DONE]`), its
    /// output tokens are its `*.delta` events or `usage.output_tokens`.
    responses: bool,
    /// Where a Responses stream's id is recorded (a 2xx answer to `POST /v1/responses`).
    id_scan: Option<OwnerScan>,
    /// Where a cut is charged (a generation's answer, whose attempt counted as a success).
    charge: Option<Charge>,
}

impl Relaying {
    fn plain(counters: Arc<Counters>) -> Relaying {
        Relaying {
            route: None,
            ticket: None,
            lease: None,
            guards: None,
            counters,
            endpoint: None,
            completion: false,
            sse: false,
            read_timeout: None,
            deadline: None,
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    fn completion(gateway: &Gateway, upstream: &Upstream, sse: bool, deadline: f64) -> Relaying {
        let left = Duration::from_secs_f64((deadline - monotonic()).clamp(0.0, 1e9));
        Relaying {
            route: None,
            ticket: None,
            lease: None,
            guards: None,
            counters: gateway.counters.clone(),
            endpoint: Some(upstream.label.clone()),
            completion: true,
            sse,
            read_timeout: gateway.config.read_timeout_s.map(Duration::from_secs_f64),
            deadline: gateway.config.total_timeout_s.map(|_| tokio::time::Instant::now() + left),
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    /// Whether the request's deadline has passed (what ended a wait that timed out, when it
    /// did).
    fn deadline_passed(&self) -> bool {
        self.deadline.is_some_and(|deadline| tokio::time::Instant::now() >= deadline)
    }
}

/// The 504 of a request whose deadline (`total_timeout_s`) passed before its answer began.
pub(crate) fn deadline_refusal() -> Refusal {
    Refusal::new(504, "timeout", DEADLINE_MESSAGE)
}

/// What a request whose deadline (`total_timeout_s`) passed is told.
const DEADLINE_MESSAGE: &str = "the request's deadline (timeouts.total_s) passed";

/// The error event ending an SSE answer the engine cut off (no `[DONE]` follows).
pub(crate) const CUT_EVENT: &str = "data: {\"error\":{\"message\":\"the engine's answer was cut \
off\",\"type\":\"upstream_error\",\"param\":null,\"code\":502}}\n\n";

/// The error event ending an SSE answer the request's own deadline (`timeouts.total_s`) cut:
/// the 504 it gets before its answer's head, as an event.
pub(crate) const DEADLINE_EVENT: &str = "data: {\"error\":{\"message\":\"the request's deadline \
(timeouts.total_s) passed\",\"type\":\"timeout\",\"param\":null,\"code\":504}}\n\n";

fn relay(answer: Response<Incoming>, relaying: Relaying) -> Answer {
    let (parts, body) = answer.into_parts();
    relay_parts(parts, body, None, relaying)
}

/// [`relay`] of an answer's head and body, `first` the body's frame already read from it.
fn relay_parts(
    parts: hyper::http::response::Parts,
    body: Incoming,
    first: Option<Frame<Bytes>>,
    relaying: Relaying,
) -> Answer {
    let event_stream = is_event_stream(&parts.headers);
    let sse = relaying.sse || event_stream;
    // An engine's event stream is whole only with its `[DONE]` (vLLM and SGLang end every
    // stream so, an error event included): a stream ended by the connection's close, or one
    // that ends cleanly without it, is cut.
    // A Responses stream's end is its terminal event ([`responses::TerminalScan`]).
    let done = if event_stream
        && ((relaying.completion || relaying.responses) && parts.status.is_success()
            || ends_at_close(parts.status, &parts.headers))
    {
        if relaying.responses {
            DoneScan::Events(responses::TerminalScan::default())
        } else {
            DoneScan::Looking(DoneEvent::default())
        }
    } else {
        DoneScan::Unneeded
    };
    // Framed by Transfer-Encoding, a Content-Length beside it is wrong (RFC 9112 6.3: an
    // intermediary removes it), and passed on it would cut the answer short.
    let chunked = parts.headers.contains_key(TRANSFER_ENCODING);
    let now = tokio::time::Instant::now();
    let timer = match (relaying.read_timeout, relaying.deadline) {
        (None, None) => None,
        _ => Some(Box::pin(tokio::time::sleep_until(due(
            relaying.read_timeout,
            relaying.deadline,
            now,
        )))),
    };
    // The frame read ahead is the latest read's, unless that read had the head too.
    let share = match relaying.lease.as_ref().and_then(pool::Lease::reads) {
        Some((meter, head_read)) if meter.last_read().0 != head_read => {
            let mut share = ReadShare::UNKNOWN;
            if let Some(data) = first.as_ref().and_then(Frame::data_ref) {
                share.handed_over(meter.last_read(), data.len(), chunked);
            }
            share
        }
        _ => ReadShare::UNKNOWN,
    };
    let mut out = Response::new(AnswerBody::Relayed(Box::new(Relay {
        route: relaying.route,
        status: parts.status,
        inner: Some(body),
        first_frame: first,
        lease: relaying.lease,
        ticket: relaying.ticket,
        guards: relaying.guards,
        counters: Some(relaying.counters),
        endpoint: relaying.endpoint,
        first: true,
        completion: relaying.completion,
        sse,
        timer,
        timer_waker: None,
        last_frame: now,
        read_timeout: relaying.read_timeout,
        deadline: relaying.deadline,
        broken: false,
        tokens: TokenCount { responses: relaying.responses, ..TokenCount::default() },
        sliced: None,
        held: None,
        after_held: None,
        done,
        tail: *b"\n\n",
        share,
        chunked,
        length_framed: !chunked && parts.headers.contains_key(CONTENT_LENGTH),
        responses: relaying.responses,
        id_scan: relaying.id_scan.filter(|_| event_stream),
        charge: relaying.charge,
    })));
    *out.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        // The length frames the body as relayed, unless the engine chunked it.
        let framing = !chunked && name == CONTENT_LENGTH;
        if framing || PASSED_HEADERS.contains(name) {
            out.headers_mut().append(HeaderName::clone(name), value.clone());
        }
    }
    out
}

/// The engine's answer headers a client gets, as on the Python plane: its body's type, coding
/// and caching. The others are the engine's hop's (its `Connection` and the fields that names,
/// RFC 9110 7.6.1), its own (`Server`, `Set-Cookie`), or would pass for the gateway's (an
/// engine's `x-llmsched-*`).
const PASSED_HEADERS: [HeaderName; 3] =
    [CONTENT_TYPE, hyper::header::CONTENT_ENCODING, hyper::header::CACHE_CONTROL];

/// The route name of by-id Responses API requests (`/v1/responses/{id}...`) in metrics.
const BY_ID_ROUTE: &str = "responses_by_id";

/// Counts a request whose handling was dropped before it answered as `client_gone` on its
/// route: hyper drops it when the client closes its connection first (waiting for its body,
/// in flow control's queue, for the engine's answer). An answer's body that the client leaves
/// is counted by [`Relay`]'s drop.
struct ClientGone<'a> {
    counters: &'a Counters,
    route: &'static str,
    armed: bool,
}

impl<'a> ClientGone<'a> {
    fn new(counters: &'a Counters, route: &'static str) -> ClientGone<'a> {
        ClientGone { counters, route, armed: true }
    }

    /// The request answered: nothing to count here.
    fn answered(mut self, answer: Answer) -> Answer {
        self.armed = false;
        answer
    }
}

impl Drop for ClientGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.counters.requests.inc(&[self.route, "client_gone"]);
        }
    }
}

/// Request bodies from this size on are tokenized on tokio's blocking threads.
const OFFLOADED_PROMPT_BYTES: usize = 128 << 10;

/// A 400 for a request without its one Host header (RFC 9112 3.2: an HTTP/1.1 request
/// names exactly one; any request at most one), as the Python plane's parser answers it.
fn host_refusal(request: &Request<Incoming>, fields: &RequestFields) -> Option<Refusal> {
    let hosts = fields.hosts;
    let missing = hosts == 0 && request.version() == hyper::Version::HTTP_11;
    (hosts > 1 || missing).then(|| {
        Refusal::new(400, "invalid_request_error", "the request needs exactly one Host header")
    })
}

/// A 415 for a request to a path served with a method it takes (`method`: HEAD read as GET)
/// whose body was sent with a Content-Encoding other than identity: bodies are taken as sent,
/// never decoded (as vLLM takes them), so a compressed one is refused, naming the encoding,
/// before it is read (a compressed body would read as "not JSON", a plain one labelled
/// compressed as JSON). As the Python plane answers it; an unknown path or method still gets
/// its 404 or 405.
fn encoding_refusal(
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    fields: &RequestFields,
) -> Option<Refusal> {
    let served = match *method {
        Method::GET => matches!(path, "/health" | "/ready" | "/metrics" | "/v1/models"),
        Method::POST => {
            matches!(path, "/v1/completions" | "/v1/chat/completions" | "/v1/responses")
        }
        _ => false,
    };
    if !served && !path.starts_with("/admin/") && path != "/v1/responses/" {
        return None;
    }
    if fields.transfer && coded_transfer(headers) {
        // hyper removes only the chunking: the body would be read still coded (gzip).
        let codings: Vec<String> = headers
            .get_all(TRANSFER_ENCODING)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        return Some(Refusal {
            close: true,
            ..Refusal::new(
                501,
                "invalid_request_error",
                format!(
                    "Transfer-Encoding '{}' is not supported: send the body chunked or with a \
                     Content-Length",
                    codings.join(", ")
                ),
            )
        });
    }
    if !fields.encoding {
        return None;
    }
    let encoding = headers
        .get_all(hyper::header::CONTENT_ENCODING)
        .iter()
        .find(|value| !value.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))?;
    let shown = String::from_utf8_lossy(encoding.as_bytes());
    Some(Refusal {
        close: true,
        ..Refusal::new(
            415,
            "invalid_request_error",
            format!("Content-Encoding '{shown}' is not supported: send the body uncompressed"),
        )
    })
}

/// The paths served (`/admin/` stands for every admin path, `/v1/responses/` for every path
/// under it: a stored response's).
const SERVED_PATHS: [&str; 9] = [
    "/health",
    "/ready",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/",
    "/admin/",
];

/// Which served path a request's path is (`""`: none), percent-escapes decoded as the Python
/// plane decodes them (`/v1/%63ompletions` is `/v1/completions`; an escaped `/` stays a
/// character of its segment, so a path holding one is none of these).
fn route_of(path: &str) -> &'static str {
    let decoded;
    let path = if path.contains('%') {
        if path.contains("%2F") || path.contains("%2f") {
            return "";
        }
        match admin::percent_decoded(path) {
            Some(path) => {
                decoded = path;
                decoded.as_str()
            }
            None => return "",
        }
    } else {
        path
    };
    if path.starts_with("/admin/") {
        return "/admin/";
    }
    if path.starts_with("/v1/responses/") {
        return "/v1/responses/";
    }
    SERVED_PATHS.iter().copied().find(|served| *served == path).unwrap_or("")
}

/// A 405 for a known path asked with another method, naming the one it takes.
fn method_not_allowed(allowed: &'static str) -> Answer {
    let problem = format!("this path takes {allowed} only");
    let mut answer = refusal(&Refusal::new(405, "method_not_allowed", problem));
    answer.headers_mut().insert(hyper::header::ALLOW, HeaderValue::from_static(allowed));
    answer
}

/// Whether an answer's `Transfer-Encoding` names a coding besides `chunked` (`gzip, chunked`):
/// hyper removes only the chunking, so the body would go on still coded, with nothing saying so.
fn coded_transfer(headers: &HeaderMap) -> bool {
    if chunked_alone(headers) {
        return false;
    }
    headers
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case("chunked"))
}

/// Whether an answer's `Transfer-Encoding` is the one value `chunked` (an engine's streamed
/// answer), read without splitting the field ([`coded_transfer`] and [`ends_at_close`] read
/// it so as well).
fn chunked_alone(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(TRANSFER_ENCODING).iter();
    matches!(
        (values.next(), values.next()),
        (Some(value), None) if value.as_bytes().eq_ignore_ascii_case(b"chunked")
    )
}

/// Whether an engine's answer ends where its connection closes (RFC 9112 6.3: no
/// Content-Length, and no Transfer-Encoding ending in `chunked`): a cut is then
/// indistinguishable from the end at the HTTP level.
fn ends_at_close(status: StatusCode, headers: &HeaderMap) -> bool {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return false;
    }
    if chunked_alone(headers) {
        return false;
    }
    let last_coding = headers
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(str::trim)
        .rfind(|c| !c.is_empty());
    match last_coding {
        Some(last) => !last.eq_ignore_ascii_case("chunked"),
        None => !headers.contains_key(CONTENT_LENGTH),
    }
}

/// Whether the client waits for a `100 Continue` before it sends its body (`Expect:
/// 100-continue`). Refused before its body is read, it gets the final status instead and sends
/// no body (RFC 9110 10.1.1): the connection must not be read on for one.
fn awaits_continue(headers: &HeaderMap) -> bool {
    headers
        .get(hyper::header::EXPECT)
        .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"100-continue"))
}

/// Whether a whole event stream shows its end: its `[DONE]` event, or a Responses stream's
/// terminal event.
fn shows_its_end(stream: &[u8], responses: bool) -> bool {
    let mut scan = if responses {
        DoneScan::Events(responses::TerminalScan::default())
    } else {
        DoneScan::Looking(DoneEvent::default())
    };
    scan.feed(stream);
    scan.whole()
}

/// What the gateway reads of an engine's answer head on every answer, found in one pass over
/// its fields (an answer has a few), as [`RequestFields`] for a request: the functions above
/// that look fields up by name, looking up only those the answer has.
#[derive(Clone, Copy, Debug, PartialEq)]
struct AnswerFields {
    transfer: bool,
    length: bool,
    /// Its first `Content-Type` says `text/event-stream` ([`is_event_stream`]).
    event_stream: bool,
}

impl AnswerFields {
    fn of(headers: &HeaderMap) -> AnswerFields {
        let mut fields = AnswerFields { transfer: false, length: false, event_stream: false };
        let mut typed = false;
        for (name, value) in headers {
            if name == TRANSFER_ENCODING {
                fields.transfer = true;
            } else if name == CONTENT_LENGTH {
                fields.length = true;
            } else if name == CONTENT_TYPE && !typed {
                typed = true;
                fields.event_stream =
                    value.to_str().is_ok_and(|v| v.starts_with("text/event-stream"));
            }
        }
        fields
    }

    /// [`coded_transfer`].
    fn coded_transfer(&self, headers: &HeaderMap) -> bool {
        self.transfer && coded_transfer(headers)
    }

    /// [`ends_at_close`].
    fn ends_at_close(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        if self.transfer {
            return ends_at_close(status, headers);
        }
        !(status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
            || self.length)
    }

    /// Whether an answer must be read whole and checked before it is passed on: ended by the
    /// connection's close and no event stream (a stream is checked for its `[DONE]` as it is
    /// relayed, [`DoneScan`]).
    fn checked_whole(&self, answer: &Response<Incoming>) -> bool {
        self.ends_at_close(answer.status(), answer.headers()) && !self.event_stream
    }

    /// A generation's event stream, answered with success and framed by a Content-Length:
    /// read whole and checked for its end before anything is sent ([`Gateway::answer_whole`],
    /// up to 8 MiB), because once its length is passed on, a missing `[DONE]` (or terminal
    /// event) could not be told to the client.
    fn length_framed_events(&self, answer: &Response<Incoming>, relaying: &Relaying) -> bool {
        self.generation_framed(answer.status(), relaying.completion || relaying.responses)
    }

    /// Whether the answer's body is framed by its `Content-Length` (and not chunked).
    fn length_framed(&self) -> bool {
        self.length && !self.transfer
    }

    /// [`AnswerFields::length_framed_events`] of an answer with `status` to a `generation`
    /// (a completion's, a response's).
    fn generation_framed(&self, status: StatusCode, generation: bool) -> bool {
        self.event_stream && generation && status.is_success() && self.length && !self.transfer
    }
}

fn content_type(headers: &HeaderMap) -> &str {
    headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("")
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    content_type(headers).starts_with("text/event-stream")
}

fn is_json(headers: &HeaderMap) -> bool {
    let essence = content_type(headers).split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
}

/// The search for an event stream's `[DONE]` event, without which an engine's stream is not
/// whole.
enum DoneScan {
    /// The stream's end is its own (a length, or a chunked body's last chunk).
    Unneeded,
    /// Not seen yet.
    Looking(DoneEvent),
    /// A Responses stream: whole once its terminal event was seen.
    Events(responses::TerminalScan),
    Seen,
}

impl DoneScan {
    fn feed(&mut self, data: &[u8]) {
        self.read(data);
    }

    /// [`DoneScan::feed`], and for an event stream still looking for its `[DONE]`, what the
    /// frame's scan found ([`sse_scan::scan`], of the frame with its line ends made LF).
    fn read(&mut self, data: &[u8]) -> Option<sse_scan::Found> {
        if let DoneScan::Events(scan) = self {
            scan.feed(data);
            if scan.seen() {
                *self = DoneScan::Seen;
            }
            return None;
        }
        let DoneScan::Looking(event) = self else { return None };
        let (found, seen) = event.read(data);
        if seen {
            *self = DoneScan::Seen;
        }
        Some(found)
    }

    /// Whether the answer may end here.
    fn whole(&self) -> bool {
        !matches!(self, DoneScan::Looking(_) | DoneScan::Events(_))
    }

    /// Whether a Responses stream's terminal event has begun and not yet ended.
    fn ending(&self) -> bool {
        matches!(self, DoneScan::Events(scan) if scan.ending())
    }
}

/// An event stream's `[DONE]` event: a line that is the `data` field `[DONE]` (`data:
/// [DONE]`, or `data:[DONE]`: the space is optional in SSE), with any of the line ends SSE
/// allows, split between frames anywhere. The same bytes inside a token's text (a JSON string
/// on a `data: {` line) or a comment line (`: ...`) are not it.
struct DoneEvent {
    /// The last bytes so far (`tail_len` of them), line ends made LF (a newline at the
    /// stream's start: its first line starts one).
    tail: [u8; DONE_KEEP],
    tail_len: usize,
    line_ends: responses::LineEnds,
}

/// Bytes of an event stream a [`DoneEvent`] keeps: a `[DONE]` event's line but one byte.
const DONE_KEEP: usize = b"\ndata: [DONE]".len() - 1;

impl Default for DoneEvent {
    fn default() -> Self {
        let mut tail = [0; DONE_KEEP];
        tail[0] = b'\n';
        DoneEvent { tail, tail_len: 1, line_ends: responses::LineEnds::default() }
    }
}

impl DoneEvent {
    /// Reads the stream's next bytes: what their scan found ([`sse_scan::scan`], of `data`
    /// with its line ends made LF), and whether the event was seen (in them, or begun in the
    /// bytes before).
    fn read(&mut self, data: &[u8]) -> (sse_scan::Found, bool) {
        // The line ends made LF only where the scan found a CR (then the LF bytes are read
        // again): a stream of LF line ends is searched once.
        let data = self.line_ends.next(data);
        let mut found = sse_scan::scan(data);
        let lf;
        let data = if found.cr {
            lf = responses::crs_to_lf(data);
            found = sse_scan::scan(&lf);
            &lf[..]
        } else {
            data
        };
        if found.done_line {
            return (found, true);
        }
        if self.tail[..self.tail_len].last() == Some(&b'\n') && data.len() >= DONE_KEEP {
            // The usual case: the bytes before ended a line, so an event across the boundary
            // is that line end and `data`'s start (`\n` opens no other prefix of the event).
            if data.starts_with(b"data: [DONE]") || data.starts_with(b"data:[DONE]") {
                return (found, true);
            }
            self.tail.copy_from_slice(&data[data.len() - DONE_KEEP..]);
            self.tail_len = DONE_KEEP;
            return (found, false);
        }
        // The last bytes before `data` and its first ones: an event across the boundary (then
        // its `[` is among them).
        let head = &data[..data.len().min(DONE_KEEP)];
        let mut window = [0; 2 * DONE_KEEP];
        window[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
        window[self.tail_len..self.tail_len + head.len()].copy_from_slice(head);
        let window = &window[..self.tail_len + head.len()];
        if memchr::memchr(b'[', window).is_some()
            && (DONE_SPACED.find(window).is_some() || DONE_UNSPACED.find(window).is_some())
        {
            return (found, true);
        }
        let last = if data.len() >= DONE_KEEP {
            &data[data.len() - DONE_KEEP..]
        } else {
            &window[window.len().saturating_sub(DONE_KEEP)..]
        };
        self.tail[..last.len()].copy_from_slice(last);
        self.tail_len = last.len();
        (found, false)
    }
}

static DONE_SPACED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\ndata: [DONE]"));
static DONE_UNSPACED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\ndata:[DONE]"));

fn wake_at(read: Option<Duration>, deadline: Option<tokio::time::Instant>) -> tokio::time::Instant {
    due(read, deadline, tokio::time::Instant::now())
}

/// When an answer silent since `since` is cut: a read timeout after it, or the deadline.
fn due(
    read: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    since: tokio::time::Instant,
) -> tokio::time::Instant {
    let by_read = since + read.unwrap_or(Duration::from_secs(86_400 * 365));
    deadline.map(|d| d.min(by_read)).unwrap_or(by_read)
}

fn own(status: StatusCode, content_type: &'static str, body: Bytes) -> Answer {
    let mut out = Response::new(AnswerBody::Whole(Some(body)));
    *out.status_mut() = status;
    out.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    out
}

/// The SSE answer of a sliced request.
fn sliced_answer(stream: slicing::SliceStream) -> Answer {
    let mut relay = Relay::idle(StatusCode::OK);
    relay.sliced = Some(Box::new(stream));
    let mut out = Response::new(AnswerBody::Relayed(Box::new(relay)));
    out.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    out
}

fn json_answer(status: StatusCode, body: &Value) -> Answer {
    own(status, "application/json", serde_json::to_vec(body).unwrap_or_default().into())
}

fn refusal(refused: &Refusal) -> Answer {
    let mut answer = json_answer(refused.status, &refused.error_body());
    if let Some(reason) = refused.reason {
        answer.headers_mut().insert(DROPPED_REASON_HEADER, HeaderValue::from_static(reason));
    }
    if let Some(after) = refused.retry_after.as_deref().and_then(|v| HeaderValue::from_str(v).ok())
    {
        answer.headers_mut().insert(hyper::header::RETRY_AFTER, after);
    }
    answer
}

/// Output tokens of an answer, for flow control's fairness and the key's token bucket: SSE
/// data events (one token each, `[DONE]` not counted) or a JSON answer's
/// `"completion_tokens"`.
#[derive(Default)]
struct TokenCount {
    events: u64,
    usage: Option<u64>,
    /// A Responses API answer: `*.delta` events, or a JSON answer's `usage.output_tokens`.
    responses: bool,
}

impl TokenCount {
    fn feed(&mut self, data: &[u8], sse: bool) {
        if self.responses {
            if sse {
                self.events += responses::output_deltas(data);
            } else if let Some(n) = responses::usage_output_tokens(data) {
                self.usage = Some(n);
            }
            return;
        }
        if sse {
            self.add(&sse_scan::scan(data));
        } else if let Some(n) = COMPLETION_TOKENS
            .find(data)
            .and_then(|at| sse_scan::count(&data[at + COMPLETION_TOKENS.needle().len()..]))
        {
            self.usage = Some(n);
        }
    }

    /// A frame of a Completions or Chat Completions event stream, as its scan found it.
    fn add(&mut self, found: &sse_scan::Found) {
        self.events += found.events;
        if let Some(n) = found.usage {
            self.usage = Some(n);
        }
    }

    /// A usage count above [`MAX_USAGE_TOKENS`] is the engine's error and counts as none, as
    /// on the Python plane: flow control and the key's bucket are not charged for it.
    fn tokens(&self) -> u64 {
        match self.usage {
            Some(n) if n > MAX_USAGE_TOKENS => 0,
            Some(n) => n,
            None => self.events,
        }
    }
}

/// The most output tokens an answer's usage block is believed for (no answer is longer).
const MAX_USAGE_TOKENS: u64 = u32::MAX as u64;

/// The searcher [`TokenCount::feed`] uses for a JSON answer, built once (building one costs
/// more than a search of a short answer).
static COMPLETION_TOKENS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"completion_tokens\":"));

/// Turns of the runtime a held stream tail waits at most ([`Relay::hold`]): hyper's client
/// hands a frame over in two (measured), for the last token, a usage event, `[DONE]` and the
/// body's end.
const HOLD_YIELDS: u8 = 8;
/// Bytes of a held stream tail at most.
const HOLD_BYTES: usize = 64 << 10;
/// Bytes of room a held frame gets beyond twice its own size ([`Relay::hold`]): a usage event
/// and `[DONE]`.
const HELD_ROOM: usize = 512;
/// Turns of the runtime SSE bytes from the middle of a stream are held while nothing more
/// comes ([`Relay::hold`]): hyper's client hands over a frame it has already read within two
/// (measured: with one, no fewer writes than without holding). Only while hyper holds more of
/// what it read from the engine than it has handed over ([`ReadShare`]).
const GATHER_YIELDS: u8 = 2;

/// What a relay has been handed of its engine connection's last read ([`pool::ReadMeter`]):
/// hyper reads the socket again only once it has handed over all of the last read, so while
/// the frames of a read (counted with their chunked framing) fall short of its bytes, hyper
/// holds more for the relay's next turns, and gathering can wait for it. When the engine's
/// events each come in a read of their own there is nothing to gather, and a frame goes out
/// at once.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ReadShare {
    /// The read (its number) the last frame came from.
    read: u64,
    /// Bytes of that read handed over, framing included.
    used: usize,
    /// Whether `used` counts all of the read: not for the read that had the answer's head.
    known: bool,
}

impl ReadShare {
    /// Nothing known: every read may hold more (gathering as without a meter).
    const UNKNOWN: ReadShare = ReadShare { read: u64::MAX, used: 0, known: false };

    /// A body frame of `len` bytes handed over, `reads` the connection's reads now.
    fn handed_over(&mut self, reads: (u64, usize), len: usize, chunked: bool) {
        if reads.0 != self.read {
            *self = ReadShare { read: reads.0, used: 0, known: true };
        }
        self.used = self.used.saturating_add(framed(len, chunked));
    }

    /// Whether hyper holds more of what it read than it has handed over, `reads` the
    /// connection's reads now (a read since the last frame: all of it).
    fn more(&self, reads: (u64, usize)) -> bool {
        reads.0 != self.read || !self.known || reads.1 > self.used
    }
}

/// The bytes of a chunked body's chunk of `len` data bytes (`{len:x}\r\n`, the data,
/// `\r\n`), or `len` for a body framed otherwise.
fn framed(len: usize, chunked: bool) -> usize {
    if !chunked {
        return len;
    }
    let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1) as usize;
    len + digits + 4
}

/// SSE bytes held back ([`Relay::hold`]).
struct Held {
    data: bytes::BytesMut,
    /// Turns waited: in all for a tail, since the last frame came while gathering.
    yields: u8,
    /// Whether the stream's end is near (its last token, `[DONE]`, a Responses stream's
    /// terminal event): held for up to [`HOLD_YIELDS`] turns in all, else
    /// [`GATHER_YIELDS`] turns without a new frame.
    tail: bool,
}

/// An answer passed on frame by frame (an SSE stream's tail, from its last token on, in one
/// write with the body's end: `Relay::hold`), with the router's ticket: the first frame
/// marks the first token, the end finishes it; dropped before the end (the client left), it counts a
/// disconnect and drops the upstream body, which closes that connection.
pub struct Relay {
    route: Option<&'static str>,
    status: StatusCode,
    inner: Option<Incoming>,
    /// A frame of `inner` read before the answer's head went out, passed on first.
    first_frame: Option<Frame<Bytes>>,
    /// The upstream connection of `inner`: back to its pool after a complete answer, closed
    /// otherwise.
    lease: Option<pool::Lease>,
    ticket: Option<Ticket>,
    guards: Option<Guards>,
    counters: Option<Arc<Counters>>,
    endpoint: Option<Arc<str>>,
    first: bool,
    completion: bool,
    sse: bool,
    /// Fires no earlier than the read timeout after `last_frame` (or at the deadline): set
    /// once, and moved on only when it fires, rather than reset at every frame.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The waker `timer` was last polled with, its poll having registered it: until the timer
    /// fires, it wakes that task, and a poll with the same waker would only say it has not
    /// fired ([`tokio::time::Sleep::is_elapsed`] says so without one).
    timer_waker: Option<std::task::Waker>,
    last_frame: tokio::time::Instant,
    read_timeout: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    broken: bool,
    tokens: TokenCount,
    /// A sliced request's stream ([`slicing`]), which makes the whole body.
    sliced: Option<Box<slicing::SliceStream>>,
    /// SSE bytes held back for what the engine sent with them (see [`Relay::hold`]).
    held: Option<Held>,
    /// A frame that came after a held tail and goes out after it.
    after_held: Option<Frame<Bytes>>,
    /// Whether the stream must show its `[DONE]` before it may end ([`DoneScan`]).
    done: DoneScan,
    /// The last two bytes relayed (`"\n\n"` ends an SSE event): an error event after a cut
    /// starts on its own rather than inside a half-sent one.
    tail: [u8; 2],
    /// What the relay has been handed of the engine connection's last read.
    share: ReadShare,
    /// Whether the engine's body is chunked (its frames' framing, for `share`).
    chunked: bool,
    /// Whether the client's body is framed by the engine's `Content-Length`: a cut then gets
    /// no error event, which would fill the length the client reads and pass for the answer's
    /// end; it is cut short (the connection closed), and the client sees the missing bytes.
    length_framed: bool,
    /// A Responses API answer (see [`Relaying`]'s field).
    responses: bool,
    /// Where a Responses stream's id is recorded, until it is found.
    id_scan: Option<OwnerScan>,
    /// Where a cut is charged (see [`Relaying`]'s field).
    charge: Option<Charge>,
}

/// The error that cuts a client's answer (hyper then closes the connection mid-body).
#[derive(Debug)]
pub struct Cut(&'static str);

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Cut {}

impl Relay {
    /// A relay with nothing to relay yet (for a sliced request's stream, `sliced`).
    fn idle(status: StatusCode) -> Relay {
        Relay {
            route: None,
            status,
            inner: None,
            first_frame: None,
            lease: None,
            ticket: None,
            guards: None,
            counters: None,
            endpoint: None,
            first: false,
            completion: false,
            sse: false,
            timer: None,
            timer_waker: None,
            last_frame: tokio::time::Instant::now(),
            read_timeout: None,
            deadline: None,
            broken: false,
            tokens: TokenCount::default(),
            sliced: None,
            held: None,
            after_held: None,
            done: DoneScan::Unneeded,
            tail: *b"\n\n",
            share: ReadShare::UNKNOWN,
            chunked: false,
            length_framed: false,
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    fn ended(&mut self, completed: bool) {
        self.inner = None;
        self.timer = None;
        if let Some(charge) = self.charge.take().filter(|_| completed) {
            charge.whole();
        }
        match self.lease.take() {
            Some(lease) if completed => lease.release(),
            _ => {}
        }
        if let Some(mut ticket) = self.ticket.take() {
            ticket.finish();
        }
        if let Some(mut guards) = self.guards.take() {
            guards.output_tokens(self.tokens.tokens());
        }
        if let Some(counters) = self.counters.take() {
            if self.completion && completed {
                counters.completed.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(route) = self.route.filter(|_| completed) {
                counters.requests.inc(&[route, self.status.as_str()]);
            }
        }
    }

    /// A frame from the engine: the first token, the output tokens, the read timeout's clock.
    /// Whether a Completions or Chat Completions event stream ends in it or nearly (it holds
    /// `data: [DONE]`, or an event with a string `finish_reason`, the last token's: a usage
    /// event and `[DONE]` follow at once; for [`Relay::ends_near`]). Such a stream's frame is
    /// scanned once for all of it ([`sse_scan::scan`]).
    fn received(&mut self, frame: &Frame<Bytes>) -> bool {
        let mut soon = false;
        if let Some(data) = frame.data_ref() {
            if self.first {
                self.first = false;
                if let Some(ticket) = self.ticket.as_mut() {
                    ticket.first_token();
                }
            }
            if self.sse && !self.responses {
                let found = self.done.read(data).unwrap_or_else(|| sse_scan::scan(data));
                if self.completion {
                    self.tokens.add(&found);
                }
                soon = found.ends_soon();
            } else {
                if self.completion {
                    self.tokens.feed(data, self.sse);
                }
                self.done.feed(data);
            }
            if let Some(scan) = self.id_scan.as_mut() {
                scan.feed(data);
            }
            self.tail = match data[..] {
                [] => self.tail,
                [only] => [self.tail[1], only],
                [.., a, b] => [a, b],
            };
        }
        if self.timer.is_some() {
            self.last_frame = tokio::time::Instant::now();
        }
        soon
    }

    /// A body frame came from the engine: counted against the connection's last read.
    fn handed_over(&mut self, frame: &Frame<Bytes>) {
        let (Some(data), Some((meter, _))) =
            (frame.data_ref(), self.lease.as_ref().and_then(pool::Lease::reads))
        else {
            return;
        };
        self.share.handed_over(meter.last_read(), data.len(), self.chunked);
    }

    /// Whether hyper holds more of what it read from the engine than it has handed over
    /// ([`ReadShare`]); true where that cannot be told (no connection of the pool).
    fn more_read(&self) -> bool {
        match self.lease.as_ref().and_then(pool::Lease::reads) {
            Some((meter, _)) => self.share.more(meter.last_read()),
            None => true,
        }
    }

    /// Holds `data`, SSE bytes read from the engine, for a turn of the runtime or a few
    /// ([`Held`]): hyper's client hands over what it has read a frame (an HTTP chunk) at a
    /// time, one frame per turn of its connection's task, so events read together (the
    /// engine's last token, `[DONE]` and the chunked body's end; or events that queued up
    /// while the gateway's thread was busy) would each cost a write to the client and a
    /// wake-up of it. What arrives meanwhile joins `data` and goes out in one write (with the
    /// body's end when that came). Never waits for the network: the turns are the thread's
    /// own, and then what is held goes out.
    fn hold(
        &mut self,
        mut held: Held,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let limit = if held.tail { HOLD_YIELDS } else { GATHER_YIELDS };
        // Gathering ends as soon as hyper has handed over all it read: what follows is the
        // network's.
        let gathered = !held.tail && !self.more_read();
        if held.yields >= limit || held.data.len() >= HOLD_BYTES || gathered {
            return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
        }
        held.yields += 1;
        self.held = Some(held);
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Whether an SSE frame ends its stream or nearly (then what follows is held longer:
    /// [`Held::tail`]); `terminal` for a Responses stream, whose terminal event may be split
    /// between frames. `soon`: whether a Completions or Chat Completions stream ends in it or
    /// nearly ([`Relay::received`]).
    fn ends_near(&self, data: &[u8], terminal: bool, soon: bool) -> bool {
        if self.responses {
            terminal || responses::ends_here(data)
        } else {
            soon
        }
    }

    /// The next poll of the engine's body while bytes are held ([`Relay::hold`]).
    fn held_frame(
        &mut self,
        polled: Poll<Option<Result<Frame<Bytes>, hyper::Error>>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let Some(mut held) = self.held.take() else { return Poll::Pending };
        match polled {
            // Nothing yet: hyper's connection task may not have handed over what it has
            // read; a few more turns, then it goes out (the engine's body has registered
            // this task's waker for what comes later).
            Poll::Pending => self.hold(held, cx),
            Poll::Ready(None) if !self.done.whole() => {
                self.held = Some(held);
                self.cut()
            }
            Poll::Ready(None) => {
                // `is_end_stream` is now true: hyper writes the held data and the end of
                // the chunked body in one write.
                self.ended(true);
                Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))))
            }
            Poll::Ready(Some(Err(_))) => {
                self.held = Some(held);
                self.cut()
            }
            Poll::Ready(Some(Ok(frame))) => {
                let (was_whole, was_ending) = (self.done.whole(), self.done.ending());
                let soon = self.received(&frame);
                let Some(data) = frame.data_ref() else {
                    // Trailers: they follow what is held.
                    self.after_held = Some(frame);
                    return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
                };
                held.data.extend_from_slice(data);
                if self.done.whole() && self.inner.as_ref().is_some_and(Body::is_end_stream) {
                    self.ended(true);
                    return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
                }
                if !held.tail {
                    // Gathering: more came, so more may be waiting; from the stream's end
                    // on, the tail's longer hold.
                    let terminal =
                        was_ending || self.done.ending() || was_whole != self.done.whole();
                    held.tail = self.ends_near(data, terminal, soon);
                    held.yields = 0;
                }
                self.hold(held, cx)
            }
        }
    }

    /// The answer broke off upstream (an error or a timeout): counted, and the client sees a
    /// break, never a complete answer.
    fn cut(&mut self) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        self.broken = true;
        let endpoint = self.endpoint.clone().unwrap_or_else(|| Arc::from(""));
        // An error event goes only where the gateway frames the body (chunked, or ended by
        // the close): inside the engine's length it would pass for the answer's last bytes.
        let sse = self.sse && !self.length_framed;
        // Against the engine, unless the request's own deadline ended the answer.
        let deadline_passed = self.deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
        if let Some(charge) = self.charge.take().filter(|_| !deadline_passed) {
            charge.reports.report(charge.upstream);
        }
        if let Some(counters) = &self.counters {
            if let Some(route) = self.route {
                counters.requests.inc(&[route, "aborted"]);
            }
            if self.completion || self.responses {
                if deadline_passed {
                    // The gateway's own deadline, not the engine's failure (as before the
                    // answer's head: the request's timeout).
                    counters.rejections.inc(&["timeout"]);
                } else {
                    counters.upstream_errors.inc(&[&endpoint, "truncated"]);
                }
                counters.truncated.inc(&[&endpoint, if sse { "sse_error" } else { "reset" }]);
            }
        }
        self.ended(false);
        // `first` now marks whether the error event went out (see `poll_frame`).
        self.first = false;
        if sse {
            // A blank line first where the stream broke off inside an event: the error event
            // must parse on its own, not run on from the half-sent one.
            let gap = if self.tail == *b"\n\n" { "" } else { "\n\n" };
            let event = match (self.responses, deadline_passed) {
                (true, false) => responses::CUT_EVENT,
                (true, true) => responses::DEADLINE_EVENT,
                (false, false) => CUT_EVENT,
                (false, true) => DEADLINE_EVENT,
            };
            let text = format!("{gap}{event}");
            // Complete events held back go out first, with the error event.
            let mut out = self.held.take().map(|held| held.data).unwrap_or_default();
            out.extend_from_slice(text.as_bytes());
            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
        }
        Poll::Ready(Some(Err(Cut("the engine's answer was cut off"))))
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let this = self.get_mut();
        if let Some(stream) = this.sliced.as_mut() {
            return stream.poll_frame(cx);
        }
        if let Some(frame) = this.after_held.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if this.broken {
            // After an SSE error event: once it has been flushed (one Pending lets hyper
            // write it out), close without the last chunk.
            if !this.first {
                this.first = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.broken = false;
            return Poll::Ready(Some(Err(Cut("the engine's answer was cut off"))));
        }
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        // The frame read before the answer's head goes out with the head, not gathered.
        let (polled, gather) = match this.first_frame.take() {
            Some(frame) => (Poll::Ready(Some(Ok(frame))), false),
            None => {
                let polled = Pin::new(inner).poll_frame(cx);
                if let Poll::Ready(Some(Ok(frame))) = &polled {
                    this.handed_over(frame);
                }
                (polled, true)
            }
        };
        if this.held.is_some() {
            return this.held_frame(polled, cx);
        }
        match polled {
            Poll::Pending => {
                if let Some(timer) = this.timer.as_mut() {
                    // Registered with this task's waker and not fired: a poll (once a frame)
                    // would only register the same waker again.
                    let waker = cx.waker();
                    if this.timer_waker.as_ref().is_some_and(|w| w.will_wake(waker))
                        && !timer.is_elapsed()
                    {
                        return Poll::Pending;
                    }
                    while timer.as_mut().poll(cx).is_ready() {
                        let due = due(this.read_timeout, this.deadline, this.last_frame);
                        if due <= tokio::time::Instant::now() {
                            return this.cut();
                        }
                        // A frame came since it was set: silent for less than the timeout.
                        timer.as_mut().reset(due);
                    }
                    // Its last poll registered the waker unless the task's budget was spent
                    // (a pending poll gives back what it took; a spent one yields instead).
                    this.timer_waker = tokio::task::coop::has_budget_remaining()
                        .then(|| this.timer_waker.take().filter(|w| w.will_wake(waker)))
                        .map(|kept| kept.unwrap_or_else(|| waker.clone()));
                }
                Poll::Pending
            }
            Poll::Ready(None) if !this.done.whole() => this.cut(),
            Poll::Ready(None) => {
                this.ended(true);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(_))) => this.cut(),
            Poll::Ready(Some(Ok(frame))) => {
                // A Responses stream ends near its terminal event: a frame holding its line,
                // or any part of it (split between frames), is held with what follows.
                let (was_whole, was_ending) = (this.done.whole(), this.done.ending());
                let soon = this.received(&frame);
                let terminal = was_ending || this.done.ending() || was_whole != this.done.whole();
                if this.done.whole() && this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.ended(true);
                } else if let Some(data) = frame.data_ref().filter(|_| this.sse) {
                    let tail = this.ends_near(data, terminal, soon);
                    if tail || (gather && this.more_read()) {
                        // Room for what usually joins it (a stream's tail: its usage event
                        // and `[DONE]`), so that the first join does not move it.
                        let mut held = bytes::BytesMut::with_capacity(data.len() * 2 + HELD_ROOM);
                        held.extend_from_slice(data);
                        return this.hold(Held { data: held, yields: 0, tail }, cx);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if let Some(stream) = &self.sliced {
            return stream.is_end_stream();
        }
        match &self.inner {
            Some(inner) => self.first_frame.is_none() && inner.is_end_stream() && self.done.whole(),
            None => !self.broken,
        }
    }

    fn size_hint(&self) -> SizeHint {
        if self.sliced.is_some() {
            return SizeHint::default();
        }
        match &self.inner {
            Some(inner) => {
                // The frame read ahead is still to come.
                let ahead =
                    self.first_frame.as_ref().and_then(Frame::data_ref).map_or(0, |d| d.len());
                let inner = inner.size_hint();
                let mut hint = SizeHint::new();
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + ahead as u64);
                }
                hint.set_lower(inner.lower() + ahead as u64);
                hint
            }
            None => SizeHint::with_exact(0),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.inner.is_some() {
            if let Some(counters) = &self.counters {
                if self.completion {
                    counters.disconnects.fetch_add(1, Ordering::Relaxed);
                }
                // The client left mid-answer, as the Python plane counts it.
                if let Some(route) = self.route {
                    counters.requests.inc(&[route, "client_gone"]);
                }
            }
            self.ended(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_is_framed_by_its_hex_size_line_and_two_crlfs() {
        assert_eq!(framed(0, true), 5, "0\\r\\n\\r\\n");
        assert_eq!(framed(15, true), 15 + 1 + 4);
        assert_eq!(framed(16, true), 16 + 2 + 4);
        assert_eq!(framed(0x1234, true), 0x1234 + 4 + 4);
        assert_eq!(framed(16, false), 16);
        for len in [1usize, 9, 200, 4096, 70_000] {
            assert_eq!(framed(len, true), format!("{len:x}\r\n").len() + len + 2);
        }
    }

    #[test]
    fn more_is_held_until_the_read_is_handed_over() {
        let event = 90; // one event's chunk data
        let read = 3 * framed(event, true) + framed(0, true);
        let mut share = ReadShare::UNKNOWN;
        assert!(share.more((0, 0)), "nothing known: gather");
        share.handed_over((7, read), event, true);
        assert!(share.more((7, read)), "two events and the end still in hyper's buffer");
        share.handed_over((7, read), event, true);
        share.handed_over((7, read), event, true);
        assert!(share.more((7, read)), "the body's end still to come");
        // A read of one event alone: nothing more once it is handed over.
        share.handed_over((8, framed(event, true)), event, true);
        assert!(!share.more((8, framed(event, true))));
        // hyper read again since: that read is not handed over yet.
        assert!(share.more((9, framed(event, true))));
        // Unchunked bodies count their bytes alone.
        share.handed_over((10, 2 * event), event, false);
        assert!(share.more((10, 2 * event)));
        share.handed_over((10, 2 * event), event, false);
        assert!(!share.more((10, 2 * event)));
    }

    #[test]
    fn a_done_split_anywhere_between_frames_is_seen_and_none_is_not_whole() {
        let stream = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        // Two frames, split at every byte; and one byte a frame.
        for at in 0..=stream.len() {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            scan.feed(&stream[..at]);
            scan.feed(&stream[at..]);
            assert!(scan.whole(), "split at {at}");
        }
        let mut scan = DoneScan::Looking(DoneEvent::default());
        for byte in stream {
            scan.feed(std::slice::from_ref(byte));
        }
        assert!(scan.whole());
        // Without it (cut inside it too), the stream is not whole.
        for end in [0, 20, stream.len() - 4] {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            for byte in &stream[..end] {
                scan.feed(std::slice::from_ref(byte));
            }
            assert!(!scan.whole(), "cut at {end}");
        }
        assert!(DoneScan::Unneeded.whole());
    }

    /// Whether `stream`, fed split at every byte and one byte a frame, shows its `[DONE]`
    /// event (the same answer each way).
    fn shows_done(stream: &[u8]) -> bool {
        let whole = |frames: &[&[u8]]| {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            for frame in frames {
                scan.feed(frame);
            }
            scan.whole()
        };
        let seen = whole(&[stream]);
        for at in 0..=stream.len() {
            assert_eq!(whole(&[&stream[..at], &stream[at..]]), seen, "split at {at}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(whole(&bytes), seen, "a byte a frame");
        seen
    }

    #[test]
    fn only_a_done_line_ends_a_stream() {
        // The event, with or without the field's space, with every line end SSE allows.
        for stream in [
            &b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"[..],
            b"data: {\"choices\":[]}\n\ndata:[DONE]\n\n",
            b"data: {\"choices\":[]}\r\n\r\ndata: [DONE]\r\n\r\n",
            b"data: {\"choices\":[]}\r\rdata:[DONE]\r\r",
            b"data: [DONE]\n\n",
        ] {
            assert!(shows_done(stream), "{}", String::from_utf8_lossy(stream));
        }
        // The same bytes in a token's text or a comment line, or not starting a line: cut.
        for stream in [
            &b"data: {\"text\":\"data: [DONE]\"}\n\n"[..],
            b": data: [DONE]\n\n",
            b"data: {\"choices\":[]}\n\n: data:[DONE]\r\n",
            b"event: x data: [DONE]\n\n",
            b"data: [DON",
        ] {
            assert!(!shows_done(stream), "{}", String::from_utf8_lossy(stream));
        }
    }

    #[test]
    fn an_answer_ends_at_its_close_only_without_a_length_or_a_final_chunked() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.append(*name, HeaderValue::from_static(value));
            }
            map
        };
        let ok = StatusCode::OK;
        assert!(ends_at_close(ok, &headers(&[])));
        assert!(!ends_at_close(ok, &headers(&[("content-length", "5")])));
        assert!(!ends_at_close(ok, &headers(&[("transfer-encoding", "chunked")])));
        assert!(!ends_at_close(ok, &headers(&[("transfer-encoding", "gzip, Chunked")])));
        assert!(ends_at_close(ok, &headers(&[("transfer-encoding", "chunked, gzip")])));
        assert!(ends_at_close(
            ok,
            &headers(&[("transfer-encoding", "gzip"), ("content-length", "5")])
        ));
        assert!(!ends_at_close(StatusCode::NO_CONTENT, &headers(&[])));
        assert!(!ends_at_close(StatusCode::NOT_MODIFIED, &headers(&[])));
    }

    #[test]
    fn a_lone_chunked_is_read_as_the_split_field_reads_it() {
        let headers = |values: &[&'static str]| {
            let mut map = HeaderMap::new();
            for value in values {
                map.append(TRANSFER_ENCODING, HeaderValue::from_static(value));
            }
            map
        };
        // The split reading of the field, as before the shortcut.
        let codings = |map: &HeaderMap| -> Vec<String> {
            map.get_all(TRANSFER_ENCODING)
                .iter()
                .flat_map(|v| v.to_str().unwrap_or("?").split(','))
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty())
                .collect()
        };
        let ok = StatusCode::OK;
        for values in [
            &["chunked"][..],
            &["Chunked"],
            &["CHUNKED"],
            &["chunked", "chunked"],
            &["gzip", "chunked"],
            &["chunked", "gzip"],
            &["gzip, chunked"],
            &["chunked,"],
            &["chunkedx"],
            &["chunk"],
            &[""],
            &[],
        ] {
            let map = headers(values);
            let split = codings(&map);
            let alone = chunked_alone(&map);
            assert_eq!(
                alone,
                values.len() == 1 && split == ["chunked"] && !values[0].contains(',')
            );
            assert_eq!(coded_transfer(&map), split.iter().any(|c| c != "chunked"), "{values:?}");
            let at_close = match split.last() {
                Some(last) => last != "chunked",
                None => true,
            };
            assert_eq!(ends_at_close(ok, &map), at_close, "{values:?}");
        }
    }

    #[test]
    fn responses_paths_are_routes_of_their_own() {
        assert_eq!(route_of("/v1/responses"), "/v1/responses");
        for path in ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/v1/responses/"] {
            assert_eq!(route_of(path), "/v1/responses/", "{path}");
        }
        assert_eq!(route_of("/v1/%72esponses/resp_1"), "/v1/responses/");
        assert_eq!(route_of("/v1/responses%2Fresp_1"), "");
        assert_eq!(route_of("/v1/responsesx"), "");
    }

    #[test]
    fn a_responses_stream_is_whole_at_its_terminal_event_and_counts_its_deltas() {
        let stream = b"event: response.created\ndata: {}\n\nevent: response.output_text.delta\n\
            data: {}\n\nevent: response.completed\ndata: {}\n\n";
        let mut done = DoneScan::Events(responses::TerminalScan::default());
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        // Whole only once the blank line closing the terminal event came (the last byte);
        // ending from its line's end on.
        let line_end = memchr::memmem::find(stream, b"event: response.completed").unwrap_or(0) + 26;
        for (i, chunk) in stream.chunks(7).enumerate() {
            assert!(!done.whole(), "chunk {i}");
            done.feed(chunk);
            tokens.feed(chunk, true);
            assert_eq!(done.ending(), !done.whole() && i * 7 + 7 >= line_end, "chunk {i}");
        }
        assert!(done.whole());
        // Cut inside the terminal event's data, split anywhere: not whole.
        let cut = &stream[..stream.len() - 3];
        for at in 0..=cut.len() {
            let mut done = DoneScan::Events(responses::TerminalScan::default());
            done.feed(&cut[..at]);
            done.feed(&cut[at..]);
            assert!(!done.whole(), "split at {at}");
        }
        // A split `.delta\ndata: ` is not counted (as a split `data: ` is not for chat).
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        tokens.feed(stream, true);
        assert_eq!(tokens.tokens(), 1);
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        tokens.feed(br#"{"usage":{"output_tokens":9,"completion_tokens":3}}"#, false);
        assert_eq!(tokens.tokens(), 9);
    }

    #[test]
    fn a_usage_count_no_answer_can_hold_counts_as_none() {
        // Probe 49 F14: an engine's 2^63 reached flow control and wrapped the tenant's service.
        for (usage, expected) in
            [("7", 7), ("4294967295", 4_294_967_295), ("4294967296", 0), ("9223372036854775808", 0)]
        {
            let mut tokens = TokenCount::default();
            tokens
                .feed(format!(r#"{{"usage":{{"completion_tokens":{usage}}}}}"#).as_bytes(), false);
            assert_eq!(tokens.tokens(), expected, "{usage}");
        }
    }

    #[test]
    fn a_shared_lookup_is_forgotten_once_done_or_once_no_request_waits() {
        use futures::FutureExt;
        let locating = Mutex::new(Locating::default());
        let start = |lookup: Lookup, stamp: u64| {
            let weak = lookup.downgrade().expect("not yet polled to its end");
            locating.lock().unwrap().map.insert("resp_1".into(), (stamp, weak));
            lookup
        };
        let waiter = |lookup: Lookup, stamp: u64| LookupWaiter {
            locating: &locating,
            id: "resp_1",
            stamp,
            lookup: Some(lookup),
        };
        // Two requests wait; the first leaves: kept for the other; the other leaves: gone.
        let lookup = start(futures::future::pending().boxed().shared(), 0);
        let (first, second) = (waiter(lookup.clone(), 0), waiter(lookup, 0));
        drop(first);
        assert_eq!(locating.lock().unwrap().map.len(), 1);
        drop(second);
        assert!(locating.lock().unwrap().map.is_empty());
        // Done: gone when its first waiter is, the others still read its answer.
        let lookup = start(futures::future::ready(None).boxed().shared(), 1);
        let (first, mut second) = (waiter(lookup.clone(), 1), waiter(lookup, 1));
        let answer = futures::executor::block_on(second.lookup.as_mut().unwrap());
        assert!(answer.is_none());
        drop(first);
        assert!(locating.lock().unwrap().map.is_empty());
        drop(second);
        // A waiter of an older lookup leaves a newer one of the same id alone.
        let lookup = start(futures::future::pending().boxed().shared(), 3);
        drop(waiter(futures::future::pending().boxed().shared(), 2));
        assert_eq!(locating.lock().unwrap().map.len(), 1);
        drop(waiter(lookup, 3));
        assert!(locating.lock().unwrap().map.is_empty());
    }

    #[test]
    fn the_backlog_holds_every_connection_and_never_shrinks() {
        assert_eq!(listen_backlog(1), 1024);
        assert_eq!(listen_backlog(4096), 4096);
        assert_eq!(listen_backlog(usize::MAX), i32::MAX);
    }

    /// The backlog the kernel applied: a listening socket's `TCP_INFO` reports it as
    /// `tcpi_sacked` (Linux).
    #[cfg(target_os = "linux")]
    #[test]
    fn the_listener_gets_the_backlog_asked_for() {
        use std::os::fd::AsRawFd;
        let somaxconn: i32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4096);
        for asked in [1024, 2000] {
            let listener = bind("127.0.0.1:0".parse().unwrap(), asked).unwrap();
            // SAFETY: `info` is a plain C struct and `len` its size, as getsockopt expects.
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            let got = unsafe {
                libc::getsockopt(
                    listener.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    std::ptr::addr_of_mut!(info).cast(),
                    &mut len,
                )
            };
            assert_eq!(got, 0);
            assert_eq!(info.tcpi_sacked as i32, asked.min(somaxconn));
        }
    }

    /// The relay's scans of an SSE frame before [`sse_scan`] (one search of the frame for
    /// each needle), kept as they were to check the one pass against.
    mod before_one_pass {
        use super::responses;

        fn finder(needle: &'static [u8]) -> memchr::memmem::Finder<'static> {
            memchr::memmem::Finder::new(needle)
        }

        /// `TokenCount::feed` of a Completions or Chat Completions answer: `(events, usage)`.
        pub fn token_feed(count: &mut (u64, Option<u64>), data: &[u8], sse: bool) {
            if sse {
                let mut rest = data;
                while let Some(at) = finder(b"data: ").find(rest) {
                    rest = &rest[at + 6..];
                    if !rest.starts_with(b"[DONE]") {
                        count.0 += 1;
                    }
                }
            }
            if let Some(at) = finder(b"\"completion_tokens\":").find(data) {
                let rest = &data[at + 20..];
                let start = rest.iter().take_while(|b| **b == b' ').count();
                let digits = rest[start..].iter().take_while(|b| b.is_ascii_digit()).count();
                if let Ok(n) =
                    std::str::from_utf8(&rest[start..start + digits]).unwrap_or("").parse()
                {
                    count.1 = Some(n);
                }
            }
        }

        pub fn has_done_word(data: &[u8]) -> bool {
            finder(b"[DONE]").find(data).is_some()
        }

        pub struct DoneEvent {
            tail: Vec<u8>,
            line_ends: responses::LineEnds,
        }

        impl Default for DoneEvent {
            fn default() -> Self {
                DoneEvent { tail: b"\n".to_vec(), line_ends: responses::LineEnds::default() }
            }
        }

        impl DoneEvent {
            pub fn feed(&mut self, data: &[u8], word: bool) -> bool {
                let data = self.line_ends.to_lf(data);
                let (spaced, unspaced) = (finder(b"\ndata: [DONE]"), finder(b"\ndata:[DONE]"));
                let keep = spaced.needle().len() - 1;
                self.tail.extend_from_slice(&data[..data.len().min(keep)]);
                let found =
                    |bytes: &[u8]| spaced.find(bytes).is_some() || unspaced.find(bytes).is_some();
                let across = memchr::memchr(b'[', &self.tail).is_some() && found(&self.tail);
                if across || word && found(&data[..]) {
                    return true;
                }
                if data.len() >= keep {
                    self.tail.clear();
                    self.tail.extend_from_slice(&data[data.len() - keep..]);
                } else {
                    let old = self.tail.len().saturating_sub(keep);
                    self.tail.drain(..old);
                }
                false
            }
        }

        pub fn ends_soon(data: &[u8], word: bool) -> bool {
            if word && finder(b"data: [DONE]").find(data).is_some() {
                return true;
            }
            let needle = finder(b"\"finish_reason\":");
            let mut rest = data;
            while let Some(at) = needle.find(rest) {
                rest = &rest[at + needle.needle().len()..];
                let value = rest.iter().position(|b| *b != b' ').map(|i| &rest[i..]).unwrap_or(&[]);
                if value.first() == Some(&b'"') {
                    return true;
                }
            }
            false
        }
    }

    /// Pieces of event streams, real and adversarial: events split anywhere, `[DONE]` in a
    /// token's text, in a comment, without its space or its line, escaped quotes, usage
    /// blocks with odd counts, the line ends SSE allows.
    const STREAM_PIECES: &[&str] = &[
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\
         \"choices\":[{\"index\":0,\"text\":\" t1\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\
         \"delta\":{\"content\":\"x\"},\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":8,\
         \"total_tokens\":13}}\n\n",
        "data: [DONE]\n\n",
        "data:[DONE]\r\n\r\n",
        "data: {\"text\":\"data: [DONE]\"}\n\n",
        "data: {\"text\":\"\\\"finish_reason\\\":\\\"stop\\\" \\\"completion_tokens\\\":3\"}\n\n",
        ": data: [DONE]\n",
        "event: x data: [DONE]\n",
        "data: ",
        "data:",
        "data",
        "ata: ",
        ":",
        " ",
        "[DONE]",
        "[DON",
        "E]",
        "\n",
        "\r",
        "\r\n",
        "\n\n",
        "\"finish_reason\":",
        "\"finish_reason\":  \"stop\"",
        "\"finish_reason\": null",
        "\"completion_tokens\":",
        "\"completion_tokens\": 12",
        "\"completion_tokens\":null",
        "18446744073709551616",
        "7",
        "\"",
        "\\\"",
        "x",
        "{\"choices\":[",
        "data: [DONE]",
        "\"stop_reason\": \"stop\"",
        "\"prompt_tokens\":5,",
        "metadata: x",
        "data: {\"choices\":[{\"index\":0,\"text\":\"y\",\"finish_reason\":null,\
         \"stop_reason\":null}]}\n\ndata: [DONE]\n\n",
    ];

    /// What the relay's scans tell of a stream, frame by frame: the tokens and usage so
    /// far, whether it is whole, whether the frame ends it or nearly.
    type Told = Vec<(u64, Option<u64>, bool, bool)>;

    /// The stream through [`Relay::received`] (an event stream of a completion, looking
    /// for its `[DONE]`).
    fn told_now(frames: &[&[u8]]) -> Told {
        let relay = &mut Relay::idle(StatusCode::OK);
        (relay.completion, relay.sse) = (true, true);
        relay.done = DoneScan::Looking(DoneEvent::default());
        frames
            .iter()
            .map(|frame| {
                let soon = relay.received(&Frame::data(Bytes::copy_from_slice(frame)));
                let tokens = (relay.tokens.events, relay.tokens.usage);
                (tokens.0, tokens.1, relay.done.whole(), soon)
            })
            .collect()
    }

    /// The same through the scans before [`sse_scan`].
    fn told_before(frames: &[&[u8]]) -> Told {
        let (mut tokens, mut done) = ((0, None), Some(before_one_pass::DoneEvent::default()));
        frames
            .iter()
            .map(|frame| {
                before_one_pass::token_feed(&mut tokens, frame, true);
                let word = before_one_pass::has_done_word(frame);
                if done.as_mut().is_some_and(|event| event.feed(frame, word)) {
                    done = None;
                }
                (tokens.0, tokens.1, done.is_none(), before_one_pass::ends_soon(frame, word))
            })
            .collect()
    }

    /// `stream` cut into frames at `cuts` (positions, any order, repeats allowed).
    fn frames_of(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        at.extend([0, stream.len()]);
        at.sort_unstable();
        at.windows(2).map(|w| stream[w[0]..w[1]].to_vec()).collect()
    }

    fn check_against_before(stream: &[u8], cuts: &[usize]) -> Result<(), String> {
        let frames = frames_of(stream, cuts);
        let frames: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (now, before) = (told_now(&frames), told_before(&frames));
        if now != before {
            return Err(format!("{frames:?}: {now:?} against {before:?}"));
        }
        // A whole answer's reading (`answer_whole`, `shows_its_end`): the stream at once.
        let mut tokens = TokenCount::default();
        let mut old = (0, None);
        for sse in [true, false] {
            tokens.feed(stream, sse);
            before_one_pass::token_feed(&mut old, stream, sse);
            if (tokens.events, tokens.usage) != old {
                return Err(format!("whole, sse {sse}: {:?} against {old:?}", tokens.usage));
            }
        }
        let whole_before = before_one_pass::DoneEvent::default()
            .feed(stream, before_one_pass::has_done_word(stream));
        if shows_its_end(stream, false) != whole_before {
            return Err("whole: the end read differently".into());
        }
        Ok(())
    }

    #[test]
    fn the_one_pass_reads_every_piece_split_anywhere_as_the_searches_did() {
        for piece in STREAM_PIECES {
            let stream = piece.as_bytes();
            for at in 0..=stream.len() {
                check_against_before(stream, &[at]).unwrap();
                check_against_before(stream, &[at, at + 1, at + 5]).unwrap();
            }
            let bytes: Vec<usize> = (0..stream.len()).collect();
            check_against_before(stream, &bytes).unwrap();
        }
    }

    /// A body of the given frames, each ready when asked for.
    struct Frames(std::collections::VecDeque<Result<Frame<Bytes>, &'static str>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    /// A whole body of one frame (empty frames and trailers beside it) is that frame's
    /// bytes, not a copy; several frames' are one copy of them all.
    #[test]
    fn whole_body_keeps_a_single_frame_s_bytes() {
        let data = Bytes::from(vec![b'x'; 300]);
        let frames = Frames(
            [
                Ok(Frame::data(Bytes::new())),
                Ok(Frame::data(data.clone())),
                Ok(Frame::trailers(HeaderMap::new())),
            ]
            .into(),
        );
        let read = futures::executor::block_on(whole_body(frames, 300)).unwrap();
        assert_eq!(read.as_ptr(), data.as_ptr());
        assert_eq!(read.len(), 300);
        let frames = Frames([Ok(Frame::data(data.clone())), Ok(Frame::data(data.clone()))].into());
        assert_eq!(futures::executor::block_on(whole_body(frames, 599)), None);
        let frames = Frames([Ok(Frame::data(data.clone())), Ok(Frame::data(data.clone()))].into());
        let read = futures::executor::block_on(whole_body(frames, 600)).unwrap();
        assert_eq!(read, [&data[..], &data[..]].concat());
    }

    /// An attempt's timer, as `answer_whole` borrows it.
    type Timer = &'static mut AttemptTimer<'static>;

    /// The size of what `f` returns (a future), without running it.
    fn returned_size<A, B, T>(_: impl FnOnce(A, B) -> T) -> usize {
        std::mem::size_of::<T>()
    }

    /// Every move of a request's future (into hyper's dispatcher, into its caller's) and of its
    /// answer copies it whole: the rare paths' parts are boxed, and so is a relayed answer's
    /// state. Bounds with some room over the sizes of December 7 (handle 4,976 bytes, whole
    /// answers 1,288, the answer 152, a refused connection 336), well under the sizes before
    /// (7,952, 1,600, 840 and over 16 KiB).
    #[test]
    fn the_futures_and_answers_moved_per_request_stay_small() {
        assert!(std::mem::size_of::<Answer>() <= 256);
        let handle = returned_size(|g: Arc<Gateway>, r: Request<Incoming>| g.handle(r));
        assert!(handle <= 6144, "{handle}");
        let whole = returned_size(|g: &'static Gateway, r: (Response<Incoming>, Timer)| {
            let fields = AnswerFields { transfer: false, length: false, event_stream: false };
            g.answer_whole(r.0, fields, Relaying::plain(Arc::default()), r.1)
        });
        // 1,488 bytes in the test profile since a ticket holds its two shares inline (120
        // bytes in the answer's `Relaying`, 32 as a list): two allocations a request fewer
        // for some 90 bytes more in each move of this future.
        assert!(whole <= 1536, "{whole}");
        let refused =
            returned_size(|s: tokio::net::TcpStream, o: OpenConnection| refuse_connection(s, o));
        assert!(refused <= 1024, "{refused}");
    }

    /// Header fields the gateway reads, their near misses, and others, each with values that
    /// read differently.
    const FIELD_NAMES: [&str; 16] = [
        "host",
        "content-length",
        "transfer-encoding",
        "content-encoding",
        "content-type",
        "authorization",
        "accept",
        "accept-encoding",
        "x-llmsched-tenant",
        "x-llmsched-priority",
        "x-session-id",
        "x-session-token",
        "x-session-i",
        "x-api-key",
        "x-api-keys",
        "date",
    ];
    const FIELD_VALUES: [&[u8]; 14] = [
        b"",
        b"5",
        b"chunked",
        b"Chunked",
        b"gzip, chunked",
        b"chunked, gzip",
        b" , ",
        b"text/event-stream",
        b"text/event-stream; charset=utf-8",
        b"TEXT/EVENT-STREAM",
        b"application/json",
        b"\xfftext/event-stream",
        b"identity",
        b"a-rather-long-value-that-makes-the-field-the-largest-of-the-head",
    ];

    fn head_of(fields: &[(usize, usize)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in fields {
            let value = HeaderValue::from_bytes(FIELD_VALUES[value % FIELD_VALUES.len()]).unwrap();
            map.append(HeaderName::from_static(FIELD_NAMES[name % FIELD_NAMES.len()]), value);
        }
        map
    }

    /// A whole answer's head as `answer_whole` made it before `whole_answer_headers`: `own`'s
    /// answer (its `Content-Type`), each passed field of the engine's inserted in turn.
    fn whole_answer_headers_before(engine: &HeaderMap) -> HeaderMap {
        let mut out = own(StatusCode::OK, "application/json", Bytes::new());
        for (name, value) in engine {
            if PASSED_HEADERS.contains(name) {
                out.headers_mut().insert(HeaderName::clone(name), value.clone());
            }
        }
        out.headers().clone()
    }

    /// Answer fields: the passed ones, their near misses and others.
    const ANSWER_NAMES: [&str; 8] = [
        "content-type",
        "content-encoding",
        "cache-control",
        "content-length",
        "date",
        "server",
        "x-llmsched-note",
        "content-typo",
    ];

    /// Whether `max_tokens` of text `text` passes `check_fields` as it read it before
    /// `token_limit_text` (as a `Value`).
    fn token_limit_before(text: &str) -> bool {
        match serde_json::from_str::<Value>(text).ok() {
            Some(Value::Null) => true,
            Some(Value::Number(n)) => {
                n.as_u64().is_some_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n))
            }
            _ => false,
        }
    }

    #[test]
    fn token_limits_read_from_their_text_as_from_a_value() {
        let texts = [
            "null",
            "0",
            "1",
            "7",
            "16",
            "2147483647",
            "2147483648",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999",
            "1.0",
            "1e3",
            "-1",
            "-0",
            "0.5",
            "true",
            "false",
            "\"16\"",
            "[16]",
            "{}",
        ];
        let long = "9".repeat(400);
        for text in texts.iter().copied().chain([long.as_str()]) {
            let fast = token_limit_text(text);
            if let Some(fast) = fast {
                assert_eq!(fast, token_limit_before(text), "{text}");
            }
            // Through `check_fields`, fast or not, as a `Value` read it.
            for field in ["max_tokens", "max_completion_tokens"] {
                let body = format!("{{\"{field}\": {text}}}");
                let Ok(payload) = Payload::parse(body.as_bytes()) else {
                    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
                    continue;
                };
                let refused = check_fields(&payload).err().map(|r| (r.status, r.message));
                let before = (!token_limit_before(text)).then(|| {
                    let what = format!("an integer in 1..{MAX_TOKEN_LIMIT} or null");
                    (StatusCode::BAD_REQUEST, format!("'{field}' must be {what}"))
                });
                assert_eq!(refused, before, "{body}");
            }
        }
        assert_eq!(token_limit_text("16"), Some(true));
        assert_eq!(token_limit_text("1e3"), None);
        // The literals `stream` takes, read from the text too; any other as before.
        for (text, ok) in [("true", true), ("false", true), ("null", true), ("1", false)] {
            let body = format!("{{\"stream\": {text}}}");
            let payload = Payload::parse(body.as_bytes()).unwrap();
            assert_eq!(check_fields(&payload).is_ok(), ok, "{body}");
        }
    }

    proptest::proptest! {
        /// One pass over a request's fields finds what the lookups by name found.
        #[test]
        fn the_request_fields_read_as_the_lookups_did(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..10),
        ) {
            let headers = head_of(&fields);
            let read = RequestFields::of(&headers);
            let largest =
                headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 2).max().unwrap_or(0);
            proptest::prop_assert_eq!(read.largest, largest);
            proptest::prop_assert_eq!(
                read.hosts,
                headers.get_all(hyper::header::HOST).iter().count()
            );
            for (present, name) in [
                (read.length, &CONTENT_LENGTH),
                (read.transfer, &TRANSFER_ENCODING),
                (read.encoding, &hyper::header::CONTENT_ENCODING),
                (read.authorization, &hyper::header::AUTHORIZATION),
                (read.accept, &hyper::header::ACCEPT),
                (read.tenant, &TENANT_HEADER_NAME),
                (read.priority, &PRIORITY_HEADER_NAME),
                (read.session, &SESSION_HEADER_NAME),
                (read.token, &SESSION_TOKEN_HEADER_NAME),
                (read.api_key, &API_KEY_HEADER_NAME),
            ] {
                proptest::prop_assert_eq!(
                    RequestFields::get(present, &headers, name),
                    headers.get(name),
                    "{}",
                    name
                );
            }
            for method in [Method::GET, Method::POST, Method::PUT] {
                for path in ["/v1/completions", "/metrics", "/admin/", "/other"] {
                    let now = encoding_refusal(&method, path, &headers, &read);
                    let all = RequestFields { transfer: true, encoding: true, ..read };
                    let before = encoding_refusal(&method, path, &headers, &all);
                    proptest::prop_assert_eq!(
                        now.map(|r| (r.status, r.message)),
                        before.map(|r| (r.status, r.message))
                    );
                }
            }
        }

        /// A whole answer's body is read as `Limited::new(body, limit).collect()` and
        /// `to_bytes` read it: the same bytes, or none for a failed body or one past its
        /// limit; frames of any size, empty ones, trailers (first, between, last) and
        /// failures anywhere.
        #[test]
        fn whole_body_reads_as_the_collection_did(
            frames in proptest::collection::vec((0u8..10, 0usize..40), 0..8),
            limit in 0u64..160,
        ) {
            let made = || Frames(
                frames
                    .iter()
                    .enumerate()
                    .map(|(i, &(kind, size))| match kind {
                        0 => Err("failed"),
                        1 => Ok(Frame::trailers(HeaderMap::new())),
                        _ => Ok(Frame::data(Bytes::from(vec![b'a' + i as u8; size]))),
                    })
                    .collect(),
            );
            let before = futures::executor::block_on(
                Limited::new(made(), limit as usize).collect(),
            )
            .ok()
            .map(|collected| collected.to_bytes());
            let now = futures::executor::block_on(whole_body(made(), limit));
            proptest::prop_assert_eq!(&now, &before);
        }

        /// One pass over an answer's fields reads its framing and type as the lookups did.
        #[test]
        fn the_answer_fields_read_as_the_lookups_did(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..8),
            status in proptest::sample::select(vec![100u16, 101, 200, 204, 206, 304, 404, 500]),
        ) {
            let headers = head_of(&fields);
            let status = StatusCode::from_u16(status).unwrap();
            let read = AnswerFields::of(&headers);
            proptest::prop_assert_eq!(read.event_stream, is_event_stream(&headers));
            proptest::prop_assert_eq!(read.coded_transfer(&headers), coded_transfer(&headers));
            let at_close = ends_at_close(status, &headers);
            proptest::prop_assert_eq!(read.ends_at_close(status, &headers), at_close);
            // As `checked_whole` and `length_framed_events` read an answer before.
            proptest::prop_assert_eq!(
                read.ends_at_close(status, &headers) && !read.event_stream,
                at_close && !is_event_stream(&headers)
            );
            for generation in [false, true] {
                let before = is_event_stream(&headers)
                    && generation
                    && status.is_success()
                    && headers.contains_key(CONTENT_LENGTH)
                    && !headers.contains_key(TRANSFER_ENCODING);
                proptest::prop_assert_eq!(read.generation_framed(status, generation), before);
            }
        }

        /// A whole answer's head, written into the engine's drained map, is the one `own`'s
        /// answer with the passed fields inserted in turn was: the same fields, values and
        /// order.
        #[test]
        fn a_whole_answers_head_is_made_as_before(
            fields in proptest::collection::vec((0usize..8, 0usize..14), 0..12),
        ) {
            let mut engine = HeaderMap::new();
            for &(name, value) in &fields {
                let value = HeaderValue::from_bytes(FIELD_VALUES[value]).unwrap();
                engine.append(HeaderName::from_static(ANSWER_NAMES[name]), value);
            }
            let before = whole_answer_headers_before(&engine);
            let now = whole_answer_headers(engine);
            let listed = |map: &HeaderMap| -> Vec<(String, Vec<u8>)> {
                map.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
            };
            proptest::prop_assert_eq!(listed(&now), listed(&before));
        }

        /// An attempt's head, written into the client's drained map (a first attempt) or a
        /// new one, is the one `forward_headers` wrote into a new map before, the prefill
        /// header inserted after it: the same fields, values and order.
        #[test]
        fn an_attempts_head_is_made_as_before(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..12),
            prefill in proptest::option::of(0usize..14),
            first in proptest::bool::ANY,
        ) {
            let client = head_of(&fields);
            let read = RequestFields::of(&client);
            let pd = HeaderName::from_static("x-prefiller-host-port");
            let prefill = prefill.and_then(|v| HeaderValue::from_bytes(FIELD_VALUES[v]).ok());
            // Before: a new map, `forward_headers`, then the prefill header.
            let mut before = HeaderMap::new();
            before.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if let Some(accept) = RequestFields::get(read.accept, &client, &hyper::header::ACCEPT)
            {
                before.insert(hyper::header::ACCEPT, accept.clone());
            }
            if let Some(value) = &prefill {
                before.insert(pd.clone(), value.clone());
            }
            let accept = RequestFields::get(read.accept, &client, &hyper::header::ACCEPT).cloned();
            let spare = first.then(|| client.clone());
            let now = forward_head(spare, accept.as_ref(), prefill.map(|value| (&pd, value)));
            let listed = |map: &HeaderMap| -> Vec<(String, Vec<u8>)> {
                map.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
            };
            proptest::prop_assert_eq!(listed(&now), listed(&before));
            proptest::prop_assert_eq!(now.len(), before.len());
        }

        #[test]
        fn the_one_pass_reads_any_stream_as_the_searches_did(
            pieces in proptest::collection::vec(0..STREAM_PIECES.len(), 0..24),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..8),
            cuts in proptest::collection::vec(0usize..4096, 0..12),
        ) {
            let mut stream: Vec<u8> =
                pieces.iter().flat_map(|i| STREAM_PIECES[*i].bytes()).collect();
            // A few arbitrary bytes in arbitrary places.
            for (i, byte) in noise.iter().enumerate() {
                let at = (usize::from(*byte) * (i + 7)) % (stream.len() + 1);
                stream.insert(at, *byte);
            }
            let checked = check_against_before(&stream, &cuts);
            proptest::prop_assert!(checked.is_ok(), "{}", checked.unwrap_err());
        }
    }
}
