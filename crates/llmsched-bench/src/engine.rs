//! A fake OpenAI-compatible engine: HTTP/1.1 on hyper, cheap enough (a few microseconds of CPU
//! per answer) that a gateway in front of it, not the engine, is what a benchmark measures.
//!
//! It answers `POST /v1/completions` and `POST /v1/chat/completions` in vLLM's shapes: a JSON
//! answer, or with `"stream": true` server-sent events `data: {...}` ending with `data: [DONE]`
//! (a usage event before it when `stream_options.include_usage` is set). `POST /v1/responses`
//! (OpenAI's Responses API as vLLM 0.32 serves it) keeps each response it makes and answers
//! `GET /v1/responses/{id}` from that store; a `previous_response_id` it does not hold is
//! vLLM's 404, counted, so that a benchmark can tell how many continuations a gateway sent to
//! the wrong engine ([`responses`]). Output token `k` reads
//! `" t<k>"`; a continuation (its earlier output in the prompt) carries on the count, as the
//! Python fake in `llmsched.testing.openai_engine` does. `GET /v1/models`, `GET /health`, a
//! vLLM-style `GET /metrics` (live running count, KV usage, success and token counters) and
//! `GET /stats` (this fake's own counters as JSON, for tests) complete it.
//!
//! With [`EngineConfig::stamp`] each streamed event also carries the engine's clock
//! ([`crate::stamp`]), so that a client can tell the engine's schedule from the path's delay.
//!
//! Faults are scripted per engine ([`EngineConfig::mode`]), every n-th request
//! ([`EngineConfig::faults`]), or per request with a body field `x_fake_mode` (it wins):
//! see [`Mode`]. Accepted sockets get `TCP_NODELAY`, so a small event is never held back by
//! Nagle's algorithm waiting for the peer's delayed ACK.
//!
//! Decisions beyond what vLLM specifies: the Responses store is bounded
//! ([`EngineConfig::response_store`], the oldest dropped); the body is bounded ([`EngineConfig::max_body`], 413
//! beyond it); prompt tokens are counted as a quarter of the prompt's JSON length; the KV usage
//! in `/metrics` is the running count over [`EngineConfig::max_num_seqs`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::Sleep;

pub mod responses;

/// Which OpenAI endpoint a generation request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses`.
    Responses,
}

/// How an engine answers a completion request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Answer normally (streamed tokens [`EngineConfig::token_delay`] apart).
    Ok,
    /// Close the connection before answering.
    Drop,
    /// Answer 500 with an OpenAI-style error body.
    Error500,
    /// Answer 503 with an OpenAI-style error body.
    Error503,
    /// Never answer (the request waits until the client leaves).
    Stall,
    /// Send the status line and headers, then nothing more.
    Headers,
    /// Answer with [`EngineConfig::slow_delay`] between streamed tokens.
    Slow,
    /// Send the status line and part of the answer (a stream's first event, half of a JSON
    /// answer's declared length), then close the connection.
    Cut,
    /// The same as [`Mode::Cut`], then silence instead of a close.
    Hang,
}

impl Mode {
    /// Every mode's name, as `--mode`, `--fault` and `x_fake_mode` spell it.
    pub const NAMES: [&'static str; 9] =
        ["ok", "drop", "error500", "error503", "stall", "headers", "slow", "cut", "hang"];
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Ok(match name {
            "ok" => Mode::Ok,
            "drop" => Mode::Drop,
            "error500" => Mode::Error500,
            "error503" => Mode::Error503,
            "stall" => Mode::Stall,
            "headers" => Mode::Headers,
            "slow" => Mode::Slow,
            "cut" => Mode::Cut,
            "hang" => Mode::Hang,
            _ => return Err(format!("unknown mode {name:?} (one of {})", Mode::NAMES.join(", "))),
        })
    }
}

/// A scripted fault: every `every`-th completion request (counting from 1) is answered in `mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The period, at least 1.
    pub every: u64,
    /// How those requests are answered.
    pub mode: Mode,
}

impl FromStr for Fault {
    type Err = String;

    /// `MODE:EVERY`, e.g. `error500:4` answers every 4th request with a 500.
    fn from_str(text: &str) -> Result<Self, String> {
        let (mode, every) =
            text.split_once(':').ok_or_else(|| format!("fault {text:?} is not MODE:EVERY"))?;
        let every: u64 = every
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("fault {text:?}: EVERY must be an integer >= 1"))?;
        Ok(Fault { every, mode: mode.parse()? })
    }
}

/// What an engine serves and how.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The served model name (`/v1/models`, metric labels).
    pub model: String,
    /// Tokens per answer, capped by the request's `max_tokens`.
    pub answer_tokens: usize,
    /// Delay before a stream's first token (prefill), after the headers.
    pub first_token_delay: Duration,
    /// Delay between streamed tokens in [`Mode::Ok`].
    pub token_delay: Duration,
    /// Delay between streamed tokens in [`Mode::Slow`].
    pub slow_delay: Duration,
    /// How requests without a fault or `x_fake_mode` are answered.
    pub mode: Mode,
    /// Every-n-th-request faults; the first that matches a request wins.
    pub faults: Vec<Fault>,
    /// The largest request body accepted (413 beyond it).
    pub max_body: usize,
    /// The denominator of the KV usage reported in `/metrics`.
    pub max_num_seqs: usize,
    /// Stamp each streamed event with the engine's clock ([`crate::stamp`]).
    pub stamp: bool,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`, the oldest
    /// dropped beyond it (0: none kept).
    pub response_store: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model: "fake".into(),
            answer_tokens: 4,
            first_token_delay: Duration::ZERO,
            token_delay: Duration::ZERO,
            slow_delay: Duration::from_millis(50),
            mode: Mode::Ok,
            faults: Vec::new(),
            max_body: 16 << 20,
            max_num_seqs: 256,
            stamp: false,
            response_store: 100_000,
        }
    }
}

/// One engine's live counters.
#[derive(Default, Debug)]
pub struct Counters {
    /// Valid completion requests received.
    pub received: AtomicU64,
    /// Answers sent in full.
    pub completed: AtomicU64,
    /// Requests whose client left before the answer was complete.
    pub disconnects: AtomicU64,
    /// Requests answered with a scripted fault (any mode but ok).
    pub faults: AtomicU64,
    /// Requests refused with a 4xx.
    pub rejected: AtomicU64,
    /// Requests being answered now.
    pub running: AtomicI64,
    /// Prompt tokens of completed answers.
    pub prompt_tokens: AtomicU64,
    /// Output tokens of completed answers.
    pub generation_tokens: AtomicU64,
    /// Responses made (`POST /v1/responses` answered 200, stored or not).
    pub responses: AtomicU64,
    /// Responses requests naming a `previous_response_id` (valid bodies).
    pub continuations: AtomicU64,
    /// Of those, answered 404: the previous response is not in this engine's store.
    pub continuations_missed: AtomicU64,
    /// `GET /v1/responses/{id}` answered from the store.
    pub retrievals: AtomicU64,
    /// `GET /v1/responses/{id}` answered 404.
    pub retrievals_missed: AtomicU64,
}

struct Engine {
    config: EngineConfig,
    counters: Arc<Counters>,
    /// The port it listens on (part of its response ids, unique among engines on one host).
    port: u16,
    store: Arc<responses::Store>,
}

/// A listening engine: its address and counters. Serving goes on in a task of the runtime it
/// was started on.
pub struct EngineHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counters (shared with the serving task).
    pub counters: Arc<Counters>,
}

/// Binds `addr` (port 0 picks a free one) and serves `config` from a task on the current tokio
/// runtime until the runtime stops.
pub async fn start(addr: SocketAddr, config: EngineConfig) -> io::Result<EngineHandle> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let counters = Arc::new(Counters::default());
    let store = Arc::new(responses::Store::new(config.response_store));
    let engine = Arc::new(Engine { config, counters: counters.clone(), port: addr.port(), store });
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                // Out of file descriptors or a connection reset before accept: go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let engine = engine.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| handle(engine.clone(), request));
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(EngineHandle { addr, counters })
}

type Answer = Response<AnswerBody>;

async fn handle(engine: Arc<Engine>, request: Request<Incoming>) -> Result<Answer, io::Error> {
    let method = request.method().clone();
    match (method, request.uri().path()) {
        (Method::GET, "/health") => Ok(plain(StatusCode::OK, "text/plain", Bytes::new())),
        (Method::GET, "/v1/models") => Ok(engine.models()),
        (Method::GET, "/metrics") => Ok(engine.metrics()),
        (Method::GET, "/stats") => Ok(engine.stats()),
        (Method::POST, "/v1/completions") => engine.complete(request, Api::Completions).await,
        (Method::POST, "/v1/chat/completions") => engine.complete(request, Api::Chat).await,
        (Method::POST, "/v1/responses") => engine.complete(request, Api::Responses).await,
        (Method::GET, path) if path.starts_with(responses::PREFIX) => {
            Ok(engine.retrieve(&path[responses::PREFIX.len()..], request.uri().query()))
        }
        (_, "/health" | "/v1/models" | "/metrics" | "/stats")
        | (_, "/v1/completions" | "/v1/chat/completions" | "/v1/responses") => {
            Ok(error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"))
        }
        _ => Ok(error(StatusCode::NOT_FOUND, "not found")),
    }
}

impl Engine {
    fn models(&self) -> Answer {
        let body = json!({"object": "list", "data": [{
            "id": self.config.model, "object": "model", "created": unix_time(),
            "owned_by": "llmsched", "root": self.config.model, "max_model_len": 131072,
        }]});
        plain(StatusCode::OK, "application/json", serde_json::to_vec(&body).unwrap().into())
    }

    fn metrics(&self) -> Answer {
        let c = &self.counters;
        let running = c.running.load(Ordering::Relaxed).max(0) as f64;
        let usage = (running / self.config.max_num_seqs.max(1) as f64).min(1.0);
        let m = &self.config.model;
        let text = format!(
            "# TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{model_name=\"{m}\"}} {running:.1}\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"{m}\"}} 0.0\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
             # TYPE vllm:request_success_total counter\n\
             vllm:request_success_total{{finished_reason=\"length\",model_name=\"{m}\"}} {}.0\n\
             # TYPE vllm:prompt_tokens_total counter\n\
             vllm:prompt_tokens_total{{model_name=\"{m}\"}} {}.0\n\
             # TYPE vllm:generation_tokens_total counter\n\
             vllm:generation_tokens_total{{model_name=\"{m}\"}} {}.0\n",
            c.completed.load(Ordering::Relaxed),
            c.prompt_tokens.load(Ordering::Relaxed),
            c.generation_tokens.load(Ordering::Relaxed),
        );
        plain(StatusCode::OK, "text/plain; version=0.0.4", text.into())
    }

    fn stats(&self) -> Answer {
        let c = &self.counters;
        let body = json!({
            "received": c.received.load(Ordering::Relaxed),
            "completed": c.completed.load(Ordering::Relaxed),
            "disconnects": c.disconnects.load(Ordering::Relaxed),
            "faults": c.faults.load(Ordering::Relaxed),
            "rejected": c.rejected.load(Ordering::Relaxed),
            "running": c.running.load(Ordering::Relaxed),
            "responses": c.responses.load(Ordering::Relaxed),
            "continuations": c.continuations.load(Ordering::Relaxed),
            "continuations_missed": c.continuations_missed.load(Ordering::Relaxed),
            "retrievals": c.retrievals.load(Ordering::Relaxed),
            "retrievals_missed": c.retrievals_missed.load(Ordering::Relaxed),
            "stored": self.store.len(),
        });
        plain(StatusCode::OK, "application/json", serde_json::to_vec(&body).unwrap().into())
    }

    async fn complete(
        self: Arc<Self>,
        request: Request<Incoming>,
        api: Api,
    ) -> Result<Answer, io::Error> {
        let chat = api == Api::Chat;
        let raw = match Limited::new(request.into_body(), self.config.max_body).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) if err.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                return Ok(self.reject(StatusCode::PAYLOAD_TOO_LARGE, "the body is too large"));
            }
            Err(err) => return Err(io::Error::other(err)),
        };
        let received_ns = crate::stamp::monotonic_ns();
        let Ok(body) = serde_json::from_slice::<Value>(&raw) else {
            return Ok(self.reject(StatusCode::BAD_REQUEST, "the body is not valid JSON"));
        };
        if let Err(problem) = check_body(&body, api) {
            return Ok(self.reject(StatusCode::BAD_REQUEST, problem));
        }
        if api == Api::Responses {
            if let Some(missing) = self.continuation_missing(&body) {
                return Ok(missing);
            }
        }
        let mode = match body.get("x_fake_mode") {
            Some(Value::String(name)) => match name.parse::<Mode>() {
                Ok(mode) => Some(mode),
                Err(problem) => return Ok(self.reject(StatusCode::BAD_REQUEST, &problem)),
            },
            Some(_) => return Ok(self.reject(StatusCode::BAD_REQUEST, "x_fake_mode: not a string")),
            None => None,
        };
        let seq = self.counters.received.fetch_add(1, Ordering::Relaxed) + 1;
        let mode = mode
            .or_else(|| self.config.faults.iter().find(|f| seq % f.every == 0).map(|f| f.mode))
            .unwrap_or(self.config.mode);
        let mut guard = InFlight::new(self.counters.clone());
        if mode != Mode::Ok {
            self.counters.faults.fetch_add(1, Ordering::Relaxed);
        }
        match mode {
            Mode::Drop => {
                guard.done = true;
                // A service error makes hyper close the connection without an answer.
                return Err(io::Error::other("scripted drop"));
            }
            Mode::Error500 | Mode::Error503 => {
                guard.done = true;
                let status = if mode == Mode::Error500 {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                return Ok(error(status, "engine failure"));
            }
            Mode::Stall => {
                // Dropped (and counted as a disconnect) when the client leaves.
                std::future::pending::<()>().await;
                unreachable!("a pending future never completes");
            }
            _ => {}
        }
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let content_type =
            if stream { "text/event-stream; charset=utf-8" } else { "application/json" };
        if mode == Mode::Headers {
            let answer = AnswerBody::new(Vec::new(), Some(Break::Hang), None, guard);
            return Ok(respond(StatusCode::OK, content_type, answer));
        }
        if api == Api::Responses {
            let generation = responses::Generation { mode, stream, seq, received_ns };
            return Ok(self.respond_to(&body, generation, guard));
        }
        // vLLM reads either name (OpenAI's newer one first).
        let limit = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|name| body.get(*name).and_then(Value::as_u64))
            .unwrap_or(u64::MAX);
        let n = self.config.answer_tokens.min(usize::try_from(limit).unwrap_or(usize::MAX));
        let before = generated_before(&body, chat);
        let pieces: Vec<String> = (before..before + n).map(|k| format!(" t{k}")).collect();
        let ids: Option<Vec<u64>> = body
            .get("return_token_ids")
            .and_then(Value::as_bool)
            .filter(|&b| b)
            .map(|_| (before..before + n).map(|k| (OUTPUT_ID_BASE + k) as u64).collect());
        let prompt = body.get("messages").or_else(|| body.get("prompt")).unwrap_or(&Value::Null);
        let prompt_tokens = serde_json::to_string(prompt).map_or(0, |s| s.len() / 4);
        let ident = format!("{}-{seq}", if chat { "chatcmpl" } else { "cmpl" });
        let model = body.get("model").cloned().unwrap_or(Value::Null);
        let created = unix_time();
        guard.tokens = Some((prompt_tokens as u64, n as u64));
        let breaks = match mode {
            Mode::Cut => Some(Break::Cut),
            Mode::Hang => Some(Break::Hang),
            _ => None,
        };
        if !stream {
            let text: String = pieces.concat();
            let choice = if chat {
                json!({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"})
            } else {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
            };
            let mut full = json!({
                "id": ident, "object": if chat { "chat.completion" } else { "text_completion" },
                "created": created, "model": model, "choices": [choice],
                "usage": usage(prompt_tokens, n),
            });
            if let Some(ids) = ids {
                full["choices"][0]["token_ids"] = json!(ids);
            }
            let bytes = Bytes::from(serde_json::to_vec(&full).unwrap());
            let length = bytes.len() as u64;
            let events = match breaks {
                // Half of the declared length, then the break.
                Some(_) => vec![(bytes.slice(..bytes.len() / 2), Duration::ZERO)],
                None => vec![(bytes, Duration::ZERO)],
            };
            let answer = AnswerBody::new(events, breaks, Some(length), guard);
            let mut response = respond(StatusCode::OK, content_type, answer);
            response.headers_mut().insert(CONTENT_LENGTH, length.into());
            return Ok(response);
        }
        let gap = if mode == Mode::Slow { self.config.slow_delay } else { self.config.token_delay };
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let mut events = Vec::with_capacity(n + 2);
        for (i, piece) in pieces.iter().enumerate() {
            let finish = if i + 1 == n { json!("length") } else { Value::Null };
            let mut choice = if chat {
                json!({"index": 0, "delta": {"content": piece}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": piece, "logprobs": null, "finish_reason": finish})
            };
            if let Some(ids) = &ids {
                choice["token_ids"] = json!([ids[i]]);
            }
            let chunk = json!({"id": ident, "object": object, "created": created,
                               "model": model, "choices": [choice]});
            let delay = if i == 0 { self.config.first_token_delay } else { gap };
            events.push((sse(&chunk), delay));
        }
        let include_usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if include_usage {
            let chunk = json!({"id": ident, "object": object, "created": created, "model": model,
                               "choices": [], "usage": usage(prompt_tokens, n)});
            events.push((sse(&chunk), Duration::ZERO));
        }
        events.push((Bytes::from_static(b"data: [DONE]\n\n"), Duration::ZERO));
        if breaks.is_some() {
            events.truncate(1);
        }
        let mut answer = AnswerBody::new(events, breaks, None, guard);
        answer.stamp = self.config.stamp.then_some(received_ns);
        Ok(respond(StatusCode::OK, content_type, answer))
    }

    fn reject(&self, status: StatusCode, message: &str) -> Answer {
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        error(status, message)
    }
}

/// Output token id of `" t0"` (the Python fake's `OUTPUT_ID_BASE`).
pub const OUTPUT_ID_BASE: usize = 1000;

fn usage(prompt_tokens: usize, n: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": n,
           "total_tokens": prompt_tokens + n})
}

fn sse(chunk: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    serde_json::to_writer(&mut out, chunk).unwrap();
    out.extend_from_slice(b"\n\n");
    out.into()
}

/// What vLLM's request validation would refuse with a 400 (the fields this fake reads).
fn check_body(body: &Value, api: Api) -> Result<(), &'static str> {
    let Some(fields) = body.as_object() else {
        return Err("the body must be a JSON object");
    };
    for name in ["max_tokens", "max_completion_tokens"] {
        match fields.get(name) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {}
            Some(_) => return Err("max_tokens and max_completion_tokens must be integers >= 1"),
        }
    }
    if !matches!(fields.get("stream"), None | Some(Value::Null | Value::Bool(_))) {
        return Err("stream must be a boolean");
    }
    if !matches!(fields.get("stream_options"), None | Some(Value::Null | Value::Object(_))) {
        return Err("stream_options must be an object");
    }
    match api {
        Api::Chat => match fields.get("messages") {
            Some(Value::Array(messages)) if messages.iter().all(Value::is_object) => {}
            _ => return Err("messages must be a list of objects"),
        },
        Api::Completions => {
            if !matches!(fields.get("prompt"), Some(Value::String(_) | Value::Array(_))) {
                return Err("prompt must be a string or a list");
            }
        }
        Api::Responses => responses::check_body(fields)?,
    }
    Ok(())
}

/// Output tokens of an earlier call found in a continuation's prompt: `" t<digits>"` pieces in
/// a text prompt (or a chat's final message with `continue_final_message`), ids at or above
/// [`OUTPUT_ID_BASE`] in a token prompt.
fn generated_before(body: &Value, chat: bool) -> usize {
    fn pieces(text: &str) -> usize {
        let bytes = text.as_bytes();
        (0..bytes.len().saturating_sub(2))
            .filter(|&i| &bytes[i..i + 2] == b" t" && bytes[i + 2].is_ascii_digit())
            .count()
    }
    if chat {
        let continues = body.get("continue_final_message").and_then(Value::as_bool);
        let last = body.get("messages").and_then(Value::as_array).and_then(|m| m.last());
        return match (continues, last.and_then(|m| m.get("content")).and_then(Value::as_str)) {
            (Some(true), Some(content)) => pieces(content),
            _ => 0,
        };
    }
    match body.get("prompt") {
        Some(Value::String(text)) => pieces(text),
        Some(Value::Array(ids)) => {
            ids.iter().filter(|t| t.as_u64().is_some_and(|t| t >= OUTPUT_ID_BASE as u64)).count()
        }
        _ => 0,
    }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn plain(status: StatusCode, content_type: &'static str, body: Bytes) -> Answer {
    let length = body.len() as u64;
    let answer =
        AnswerBody::new(vec![(body, Duration::ZERO)], None, Some(length), InFlight::none());
    respond(status, content_type, answer)
}

fn error(status: StatusCode, message: &str) -> Answer {
    let kind = if status.is_server_error() { "InternalServerError" } else { "BadRequestError" };
    let body = json!({"error": {"message": message, "type": kind, "param": null,
                                "code": status.as_u16()}});
    plain(status, "application/json", serde_json::to_vec(&body).unwrap().into())
}

fn respond(status: StatusCode, content_type: &'static str, body: AnswerBody) -> Answer {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, content_type.parse().unwrap());
    response
}

/// Accounts for one completion request: running while alive; on drop, a completion (with its
/// tokens) or a disconnect.
struct InFlight {
    counters: Option<Arc<Counters>>,
    done: bool,
    tokens: Option<(u64, u64)>,
}

impl InFlight {
    fn new(counters: Arc<Counters>) -> Self {
        counters.running.fetch_add(1, Ordering::Relaxed);
        InFlight { counters: Some(counters), done: false, tokens: None }
    }

    fn none() -> Self {
        InFlight { counters: None, done: true, tokens: None }
    }

    fn finish(&mut self) {
        if let (Some(counters), Some((prompt, generated))) = (&self.counters, self.tokens.take()) {
            counters.completed.fetch_add(1, Ordering::Relaxed);
            counters.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
            counters.generation_tokens.fetch_add(generated, Ordering::Relaxed);
        }
        self.done = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(counters) = &self.counters {
            counters.running.fetch_sub(1, Ordering::Relaxed);
            if !self.done {
                counters.disconnects.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// How a scripted answer breaks off after its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    /// An error from the body: hyper closes the connection.
    Cut,
    /// Never another frame.
    Hang,
}

/// An answer's body: events, each sent after its delay, then the end (or the scripted break).
struct AnswerBody {
    events: std::vec::IntoIter<(Bytes, Duration)>,
    next: Option<(Bytes, Duration)>,
    sleep: Option<Pin<Box<Sleep>>>,
    breaks: Option<Break>,
    length: Option<u64>,
    flushed: bool,
    guard: InFlight,
    /// The engine's reading of the request, when events are stamped.
    stamp: Option<u64>,
    /// Run just before the last event goes out, when the answer is not scripted to break
    /// (a streamed response is stored then, as vLLM stores it before `response.completed`).
    before_last: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl AnswerBody {
    fn new(
        events: Vec<(Bytes, Duration)>,
        breaks: Option<Break>,
        length: Option<u64>,
        guard: InFlight,
    ) -> Self {
        let mut events = events.into_iter();
        let next = events.next();
        AnswerBody {
            events,
            next,
            sleep: None,
            breaks,
            length,
            flushed: false,
            guard,
            stamp: None,
            before_last: None,
        }
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let Some((_, delay)) = &this.next else {
            return match this.breaks {
                None => {
                    this.guard.finish();
                    Poll::Ready(None)
                }
                Some(Break::Cut) if !this.flushed => {
                    // Pending once so hyper writes out what it holds before the cut.
                    this.flushed = true;
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Some(Break::Cut) => {
                    this.guard.done = true;
                    Poll::Ready(Some(Err(io::Error::other("scripted cut"))))
                }
                Some(Break::Hang) => {
                    // Scripted: the client sees silence; counted when it leaves.
                    this.guard.tokens = None;
                    Poll::Pending
                }
            };
        };
        if !delay.is_zero() {
            let sleep = this.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(*delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
        }
        let (mut data, _) = this.next.take().expect("checked above");
        if let Some(received) = this.stamp {
            data = crate::stamp::stamp(&data, received, crate::stamp::monotonic_ns()).into();
        }
        this.next = this.events.next();
        if this.next.is_none() && this.breaks.is_none() {
            if let Some(before_last) = this.before_last.take() {
                before_last();
            }
            // The last frame: hyper may not poll again once the body says it has ended.
            this.guard.finish();
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.next.is_none() && self.breaks.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(length) if self.breaks.is_none() => SizeHint::with_exact(length),
            _ => SizeHint::default(),
        }
    }
}
