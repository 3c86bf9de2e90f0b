//! A native data plane for OpenAI-compatible engines: HTTP/1.1 on tokio and hyper, routing with
//! `llmsched-core`'s [`Router`] and no Python on the request path.
//!
//! Per request (`POST /v1/completions`, `POST /v1/chat/completions`): read the body up to
//! [`GatewayConfig::max_body`] (413 beyond it), parse it as JSON (400 otherwise), hash the prompt
//! as pseudo-tokens of 4 UTF-8 bytes (llm-d's approximate prefix mode; a chat's messages are
//! rendered as `role\ncontent\n` each first; a token-id prompt is hashed as given), decide with
//! the core router (`model` restricts the endpoints; `x-session-id` binds a session), then send
//! the body unchanged to the chosen endpoint. Before the first byte of an answer has been
//! passed on, a refused connection or a 5xx answer moves the request to the next endpoint in the
//! decision's ranking, at most [`GatewayConfig::retries`] times. The answer streams through
//! frame by frame (SSE or JSON, status and headers as the engine sent them, hop-by-hop headers
//! dropped). The router's in-flight ticket is committed when the request is sent, marks the first
//! token with the first body frame and finishes at the end of the answer; a client that leaves
//! drops the answer, which closes the upstream connection (the engine sees the disconnect) and
//! finishes the ticket. Both sides set `TCP_NODELAY`.
//!
//! The engines' `/metrics` are scraped every [`GatewayConfig::scrape_interval`] into the pool
//! (vLLM or SGLang names, through `routing::metrics_text`); while no request arrives the
//! interval doubles up to 25 times its base, so an idle gateway costs next to nothing.
//! `GET /health` answers 200, `GET /metrics` the gateway's own counters, `GET /v1/models` the
//! first endpoint's answer.
//!
//! Not done here (the Python gateway, `llmsched serve`, does them): API keys, tenants and
//! priorities, flow control and its queue, rate limits, a tokenizer and chat template, P/D
//! headers, token slices, discovery, KV events, health checks and the circuit breaker, timeouts
//! other than the engines' own, and YAML configuration.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use llmsched_core::hashing::text::pack_text;
use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, WorkerKey};
use llmsched_core::routing::{
    metrics_text, parse_config, presets, Endpoint, EndpointPool, RequestMeta, Router,
    RouterOptions, RoutingError, StalePolicy, Ticket,
};
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// What a gateway serves and how.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Base URLs of the engines (`http://127.0.0.1:8000`).
    pub engines: Vec<String>,
    /// The router configuration: a preset name (`llm-d`, `round-robin`, ...) or llm-d's
    /// `EndpointPickerConfig` shape as JSON.
    pub router: Value,
    /// Tokens per block of the prefix index.
    pub block_size: usize,
    /// The largest request body accepted (413 beyond it).
    pub max_body: usize,
    /// Further endpoints tried when one refuses the connection or answers 5xx before the first
    /// byte.
    pub retries: usize,
    /// Base interval of the metrics scrape; `None` disables it.
    pub scrape_interval: Option<Duration>,
    /// Seed of the router's random choices.
    pub seed: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            engines: Vec::new(),
            router: json!("llm-d"),
            block_size: 16,
            max_body: 16 << 20,
            retries: 2,
            scrape_interval: Some(Duration::from_millis(200)),
            seed: 0,
        }
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

/// The gateway's counters (`GET /metrics`).
#[derive(Default, Debug)]
pub struct Counters {
    /// Completion requests received.
    pub requests: AtomicU64,
    /// Answers passed on to the end.
    pub completed: AtomicU64,
    /// Requests refused by the gateway (4xx of its own, no endpoint).
    pub refused: AtomicU64,
    /// Requests moved to another endpoint before the first byte.
    pub retries: AtomicU64,
    /// Requests that no endpoint answered (502) or that broke off upstream mid-answer.
    pub upstream_errors: AtomicU64,
    /// Answers the client left before their end.
    pub disconnects: AtomicU64,
}

struct Upstream {
    key: WorkerKey,
    completions: Uri,
    chat: Uri,
    metrics: Uri,
    models: Uri,
}

struct Gateway {
    router: Router,
    upstreams: Vec<Upstream>,
    client: Client<HttpConnector, Full<Bytes>>,
    config: GatewayConfig,
    counters: Arc<Counters>,
    epoch: Instant,
}

/// A listening gateway.
pub struct GatewayHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counters.
    pub counters: Arc<Counters>,
}

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

fn build(config: GatewayConfig) -> Result<Gateway, ConfigProblem> {
    if config.engines.is_empty() {
        return Err(ConfigProblem("engines: at least one engine is needed".into()));
    }
    let parsed = parse_config(&router_config(&config.router)?)
        .map_err(|e| ConfigProblem(format!("router: {e}")))?;
    let index =
        PrefixIndex::new(IndexConfig { block_size: config.block_size, ..Default::default() })
            .map_err(|e| ConfigProblem(format!("block_size: {e}")))?;
    let pool = EndpointPool::new(StalePolicy::default())
        .map_err(|e| ConfigProblem(format!("pool: {e}")))?;
    let mut upstreams = Vec::new();
    for base in &config.engines {
        let base = base.trim_end_matches('/').to_string();
        let not_http = || ConfigProblem(format!("engines: {base:?} is not an http:// URL"));
        base.parse::<Uri>()
            .ok()
            .filter(|u| u.scheme_str() == Some("http") && u.authority().is_some())
            .ok_or_else(not_http)?;
        let at = |path: &str| format!("{base}{path}").parse::<Uri>().map_err(|_| not_http());
        let key = WorkerKey::Str(base.clone());
        if !pool.upsert(Endpoint { address: base.clone(), ..Endpoint::new(key.clone()) }) {
            return Err(ConfigProblem(format!("engines: {base:?} is listed twice")));
        }
        upstreams.push(Upstream {
            key,
            completions: at("/v1/completions")?,
            chat: at("/v1/chat/completions")?,
            metrics: at("/metrics")?,
            models: at("/v1/models")?,
        });
    }
    let options = RouterOptions { seed: config.seed, ..RouterOptions::default() };
    let router = Router::new(Arc::new(pool), Arc::new(index), parsed, options)
        .map_err(|e| ConfigProblem(format!("router: {e}")))?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector);
    Ok(Gateway {
        router,
        upstreams,
        client,
        config,
        counters: Arc::new(Counters::default()),
        epoch: Instant::now(),
    })
}

/// Checks `config`, binds `addr` and serves from tasks on the current tokio runtime (the
/// metrics scrape included) until the runtime stops.
pub async fn start(
    addr: SocketAddr,
    config: GatewayConfig,
) -> Result<GatewayHandle, ConfigProblem> {
    let gateway = Arc::new(build(config)?);
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| ConfigProblem(format!("cannot listen on {addr}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| ConfigProblem(e.to_string()))?;
    let counters = gateway.counters.clone();
    if let Some(interval) = gateway.config.scrape_interval {
        tokio::spawn(scrape(gateway.clone(), interval));
    }
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            let gateway = gateway.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| gateway.clone().handle(request));
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(GatewayHandle { addr, counters })
}

/// Scrapes every engine's `/metrics` into the pool; backs off while no request arrives.
async fn scrape(gateway: Arc<Gateway>, base: Duration) {
    let mut interval = base;
    let mut seen = u64::MAX;
    loop {
        tokio::time::sleep(interval).await;
        let requests = gateway.counters.requests.load(Ordering::Relaxed);
        interval = if requests == seen { (interval * 2).min(base * 25) } else { base };
        seen = requests;
        for upstream in &gateway.upstreams {
            let Ok(answer) = gateway.client.get(upstream.metrics.clone()).await else { continue };
            if !answer.status().is_success() {
                continue;
            }
            let Ok(body) = answer.into_body().collect().await else { continue };
            let Ok(text) = std::str::from_utf8(&body.to_bytes()).map(str::to_owned) else {
                continue;
            };
            if let Ok(scraped) = metrics_text::parse(&text) {
                let now = gateway.now();
                let _ = gateway.router.pool().update_metrics(&upstream.key, scraped.update, now);
            }
        }
    }
}

type Answer = Response<Relay>;

impl Gateway {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Result<Answer, io::Error> {
        match (request.method(), request.uri().path()) {
            (&Method::GET, "/health") => Ok(own(StatusCode::OK, "text/plain", Bytes::new())),
            (&Method::GET, "/metrics") => Ok(self.metrics()),
            (&Method::GET, "/v1/models") => Ok(self.models().await),
            (&Method::POST, path @ ("/v1/completions" | "/v1/chat/completions")) => {
                let chat = path == "/v1/chat/completions";
                Ok(self.complete(request, chat).await)
            }
            _ => Ok(refusal(StatusCode::NOT_FOUND, "not found")),
        }
    }

    fn metrics(&self) -> Answer {
        let c = &self.counters;
        let text = format!(
            "llmsched_gateway_requests_total {}\nllmsched_gateway_completed_total {}\n\
             llmsched_gateway_refused_total {}\nllmsched_gateway_retries_total {}\n\
             llmsched_gateway_upstream_errors_total {}\nllmsched_gateway_disconnects_total {}\n",
            c.requests.load(Ordering::Relaxed),
            c.completed.load(Ordering::Relaxed),
            c.refused.load(Ordering::Relaxed),
            c.retries.load(Ordering::Relaxed),
            c.upstream_errors.load(Ordering::Relaxed),
            c.disconnects.load(Ordering::Relaxed),
        );
        own(StatusCode::OK, "text/plain; version=0.0.4", text.into())
    }

    async fn models(&self) -> Answer {
        match self.client.get(self.upstreams[0].models.clone()).await {
            Ok(answer) => relay(answer, None, self.counters.clone(), false),
            Err(_) => refusal(StatusCode::BAD_GATEWAY, "the engine did not answer"),
        }
    }

    fn refuse(&self, status: StatusCode, message: &str) -> Answer {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        refusal(status, message)
    }

    async fn complete(&self, request: Request<Incoming>, chat: bool) -> Answer {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let (parts, body) = request.into_parts();
        let raw = match Limited::new(body, self.config.max_body).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) if err.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                return self.refuse(StatusCode::PAYLOAD_TOO_LARGE, "the body is too large");
            }
            Err(_) => return self.refuse(StatusCode::BAD_REQUEST, "the body did not arrive"),
        };
        let Ok(payload) = serde_json::from_slice::<Value>(&raw) else {
            return self.refuse(StatusCode::BAD_REQUEST, "the body is not valid JSON");
        };
        let tokens = match prompt_tokens(&payload, chat) {
            Ok(tokens) => tokens,
            Err(problem) => return self.refuse(StatusCode::BAD_REQUEST, problem),
        };
        let session = parts.headers.get("x-session-id").and_then(|v| v.to_str().ok());
        let meta = RequestMeta {
            model: payload.get("model").and_then(Value::as_str).map(str::to_owned),
            session_id: session.map(str::to_owned),
            ..RequestMeta::default()
        };
        let now = self.now();
        let decision = match self.router.decide(&tokens, &meta, now) {
            Ok(decision) => decision,
            Err(RoutingError::NoEndpoint { detail, .. }) => {
                return self.refuse(StatusCode::SERVICE_UNAVAILABLE, &detail);
            }
            Err(err) => return self.refuse(StatusCode::BAD_REQUEST, &err.to_string()),
        };
        let ranked: Vec<WorkerKey> =
            decision.ranked().map(|c| decision.endpoint(c).id.clone()).collect();
        let mut last_failure: Option<Answer> = None;
        for (attempt, key) in ranked.iter().take(self.config.retries + 1).enumerate() {
            if attempt > 0 {
                self.counters.retries.fetch_add(1, Ordering::Relaxed);
            }
            let Some(upstream) = self.upstreams.iter().find(|u| &u.key == key) else { continue };
            let uri = if chat { &upstream.chat } else { &upstream.completions };
            let mut forward =
                Request::post(uri.clone()).body(Full::new(raw.clone())).expect("a request");
            copy_end_to_end(&parts.headers, forward.headers_mut());
            let Ok(ticket) = self.router.commit(&decision, Some(key), self.now()) else { continue };
            match self.client.request(forward).await {
                Ok(answer) if answer.status().is_server_error() => {
                    // Not passed on yet: the next endpoint may do better.
                    last_failure = Some(relay(answer, None, self.counters.clone(), false));
                    drop(ticket);
                }
                Ok(answer) => return relay(answer, Some(ticket), self.counters.clone(), true),
                Err(_) => drop(ticket),
            }
        }
        self.counters.upstream_errors.fetch_add(1, Ordering::Relaxed);
        last_failure
            .unwrap_or_else(|| refusal(StatusCode::BAD_GATEWAY, "no engine answered the request"))
    }
}

/// The prompt as the router hashes it: token ids as given, text as 4-byte pseudo-tokens.
fn prompt_tokens(payload: &Value, chat: bool) -> Result<Vec<u32>, &'static str> {
    if chat {
        let Some(messages) = payload.get("messages").and_then(Value::as_array) else {
            return Err("'messages' must be a non-empty list");
        };
        if messages.is_empty() {
            return Err("'messages' must be a non-empty list");
        }
        let mut text = String::new();
        for message in messages {
            let Some(fields) = message.as_object() else {
                return Err("each message must be an object");
            };
            text.push_str(fields.get("role").and_then(Value::as_str).unwrap_or(""));
            text.push('\n');
            match fields.get("content") {
                Some(Value::String(content)) => text.push_str(content),
                Some(other) => text.push_str(&other.to_string()),
                None => {}
            }
            text.push('\n');
        }
        return Ok(pack_text(text.as_bytes()));
    }
    let prompt = match payload.get("prompt") {
        // A batch routes by its first prompt.
        Some(Value::Array(items))
            if items.first().is_some_and(|p| p.is_string() || p.is_array()) =>
        {
            &items[0]
        }
        Some(prompt) => prompt,
        None => return Err("'prompt' must be a string or a list of token ids"),
    };
    match prompt {
        Value::String(text) => Ok(pack_text(text.as_bytes())),
        Value::Array(ids) => ids
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or("'prompt' must be a string or a list of token ids"),
        _ => Err("'prompt' must be a string or a list of token ids"),
    }
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
];

fn copy_end_to_end(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP.contains(&name.as_str()) && name != hyper::header::CONTENT_LENGTH {
            to.append(name.clone(), value.clone());
        }
    }
}

fn relay(
    answer: Response<Incoming>,
    ticket: Option<Ticket>,
    counters: Arc<Counters>,
    completion: bool,
) -> Answer {
    let (parts, body) = answer.into_parts();
    let mut out = Response::new(Relay {
        inner: Some(body),
        ticket,
        counters: Some(counters),
        first: true,
        completion,
        own: None,
    });
    *out.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        let hop = HOP_BY_HOP.contains(&name.as_str());
        if !hop {
            out.headers_mut().append(HeaderName::clone(name), value.clone());
        }
    }
    out
}

fn own(status: StatusCode, content_type: &'static str, body: Bytes) -> Answer {
    let mut out = Response::new(Relay {
        inner: None,
        ticket: None,
        counters: None,
        first: false,
        completion: false,
        own: Some(body),
    });
    *out.status_mut() = status;
    out.headers_mut().insert(CONTENT_TYPE, content_type.parse().expect("a header value"));
    out
}

fn refusal(status: StatusCode, message: &str) -> Answer {
    let kind = if status.is_server_error() { "InternalServerError" } else { "BadRequestError" };
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    own(status, "application/json", serde_json::to_vec(&body).expect("JSON").into())
}

/// An answer passed on frame by frame, with the router's ticket: the first frame marks the
/// first token, the end finishes it; dropped before the end (the client left), it counts a
/// disconnect and drops the upstream body, which closes that connection.
pub struct Relay {
    inner: Option<Incoming>,
    ticket: Option<Ticket>,
    counters: Option<Arc<Counters>>,
    first: bool,
    completion: bool,
    own: Option<Bytes>,
}

impl Relay {
    fn ended(&mut self, completed: bool) {
        self.inner = None;
        if let Some(mut ticket) = self.ticket.take() {
            ticket.finish();
        }
        if let Some(counters) = self.counters.take() {
            if !self.completion {
                return;
            }
            let counter = if completed { &counters.completed } else { &counters.upstream_errors };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(bytes) = this.own.take() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                this.ended(true);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(err))) => {
                this.ended(false);
                Poll::Ready(Some(Err(err)))
            }
            Poll::Ready(Some(Ok(frame))) => {
                if this.first && frame.is_data() {
                    this.first = false;
                    if let Some(ticket) = this.ticket.as_mut() {
                        ticket.first_token();
                    }
                }
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.ended(true);
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Some(inner) => inner.is_end_stream(),
            None => self.own.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.own) {
            (Some(inner), _) => inner.size_hint(),
            (None, Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            (None, None) => SizeHint::with_exact(0),
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
            }
            self.counters = None;
            self.ended(false);
        }
    }
}
