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
mod admission;
mod answer;
mod answer_scan;
mod by_id;
pub mod chat_values;
pub mod client_io;
mod completion;
mod config;
pub mod conversation;
mod decision;
mod engines;
mod exposition;
pub mod flow;
mod framing;
pub mod guards;
mod handling;
pub mod health;
mod json_scan;
pub mod kv_events;
pub mod metrics;
pub mod payload;
pub mod pool;
mod probes;
mod prompt;
pub mod pyvalues;
mod refusal;
mod relay;
mod request_fields;
pub mod responses;
mod scrape;
mod server;
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
mod whole_body;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::HeaderName;
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use llmsched_core::prefix_index::WorkerKey;
use llmsched_core::routing::{Endpoint, Router};

use crate::by_id::Locating;
use crate::probes::CutReports;

pub use answer::AnswerBody;
pub use config::{ConfigProblem, EngineEntry, GatewayConfig, DEFAULT_INDEX_MAX_BYTES, MAX_THREADS};
pub use guards::ApiKeyConfig;
pub use health::HealthConfig;
pub use metrics::Counters;
pub use relay::{Cut, Relay};
pub use server::{listen_backlog, runtime_builder, spawn, start, GatewayHandle, Running};

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

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;

    use hyper::body::Incoming;
    use hyper::{Request, Response};

    use crate::answer::Answer;
    use crate::answer_scan::AnswerFields;
    use crate::relay::Relaying;
    use crate::server::{refuse_connection, OpenConnection};
    use crate::waits::AttemptTimer;

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
}
