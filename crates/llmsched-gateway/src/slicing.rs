//! Token slices on the native plane: one request decoded as several engine calls, each routed
//! afresh, stitched back into one answer, with the Python plane's behaviour
//! (`llmsched.gateway.slicing`) and the same cores: `llmsched_core::slices`' tracker (budget
//! and boundary decision) and assembler (continuation calls, stop strings across boundaries).
//!
//! Per slice: build the continuation (prompt plus everything generated), hash it as the router
//! hashes any prompt (the tokenizer's ids when one is configured), decide and commit, call the
//! engine with `stream` on, feed each SSE event to the assembler and pass the user's chunks
//! on as they come (a client that asked for `stream` gets one SSE stream over every slice;
//! otherwise one JSON answer at the end). At a boundary the tracker sees every engine's load
//! and up to [`WAITING_SAMPLE`] requests queued in flow control; when it yields, the request
//! gives its flow-control slot back (charged with the tokens made so far) and queues again at
//! the decided priority with its context as its size, exactly as a new request would.
//!
//! Not covered, as on the Python plane: retries within a sliced request (a failed slice ends
//! it with a 502, or, once the stream started, with an SSE error event and a stream closed
//! without `[DONE]`), and requests the assembler cannot slice (`n > 1`, `logprobs`, batched
//! prompts), which are proxied whole.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper::header::CONTENT_TYPE;
use hyper::{Request, StatusCode};
use llmsched_core::routing::{RequestMeta, RoutingError};
use llmsched_core::slices::{
    Action, Api, AssemblerOptions, EndpointReport, Phase, SliceAssembler, SliceTracker,
    SwitchCostModel, WaitingRequest,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::admission::Guards;
use crate::answer::{json_answer, own, sliced_answer, Answer};
use crate::payload::Payload;
use crate::prompt::{prompt_tokens, IdKind};
use crate::refusal::{deadline_refusal, Refusal, CUT_EVENT, DEADLINE_EVENT};
use crate::relay::{wake_at, Cut};
use crate::truncation::Truncation;
use crate::{monotonic, Gateway, Upstream};

/// At most this many queued requests are described to the tracker at a boundary.
pub const WAITING_SAMPLE: usize = 16;

/// Token slices (`slices` of the gateway config, when enabled).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlicesConfig {
    /// A slice policy (`fixed`, `mlfq`).
    pub policy: String,
    /// Its parameters over its defaults.
    #[serde(default)]
    pub params: Value,
    /// The budget of a request without `max_tokens`.
    pub default_max_tokens: u64,
}

/// The gateway's slice tracker and settings.
pub(crate) struct Slicing {
    tracker: Mutex<SliceTracker>,
    default_max_tokens: u64,
    ids: AtomicU64,
}

impl Slicing {
    /// The tracker of `config`, knowing `endpoints`; the problem, named, otherwise.
    pub(crate) fn new(config: &SlicesConfig, endpoints: &[String]) -> Result<Slicing, String> {
        let params = if config.params.is_null() { json!({}) } else { config.params.clone() };
        let cost = SwitchCostModel::from_params(&json!({})).map_err(|e| e.to_string())?;
        let tracker =
            SliceTracker::from_config(&config.policy, &params, cost).map_err(|e| e.to_string())?;
        let slicing = Slicing {
            tracker: Mutex::new(tracker),
            default_max_tokens: config.default_max_tokens,
            ids: AtomicU64::new(1),
        };
        slicing.add_endpoints(endpoints);
        Ok(slicing)
    }

    fn lock(&self) -> MutexGuard<'_, SliceTracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes engines known to the tracker (a new one starts with the cost model's load).
    pub(crate) fn add_endpoints(&self, endpoints: &[String]) {
        let mut tracker = self.lock();
        for name in endpoints {
            if tracker.endpoint_load(name).is_none() {
                let _ = tracker.set_endpoint(name, EndpointReport::default());
            }
        }
    }

    /// Takes engines out of the tracker (they left the engine set): none is a migration
    /// target on the load it last reported.
    pub(crate) fn remove_endpoints(&self, endpoints: &[String]) {
        let mut tracker = self.lock();
        for name in endpoints {
            tracker.remove_endpoint(name);
        }
    }

    /// Requests being decoded in slices now.
    pub(crate) fn tracked(&self) -> usize {
        self.lock().len()
    }

    /// The assembler of a request, or None when it cannot be sliced (it is proxied whole).
    pub(crate) fn assembler(&self, payload: &Payload<'_>, chat: bool) -> Option<SliceAssembler> {
        let api = if chat { Api::Chat } else { Api::Completions };
        let options = AssemblerOptions {
            default_max_tokens: Some(self.default_max_tokens),
            ..AssemblerOptions::default()
        };
        // The assembler rewrites the whole body slice by slice: it needs every field.
        SliceAssembler::new(&payload.to_value(), api, options).ok()
    }
}

/// Why a sliced request ended early.
struct SliceFailed(String);

impl<E: std::fmt::Display> From<E> for SliceFailed {
    fn from(err: E) -> Self {
        SliceFailed(err.to_string())
    }
}

/// One sliced request as it runs.
pub(crate) struct SlicedRequest {
    pub(crate) assembler: SliceAssembler,
    pub(crate) route: &'static str,
    pub(crate) tenant: Arc<str>,
    pub(crate) priority: i32,
    pub(crate) prompt_tokens: usize,
    pub(crate) meta: RequestMeta,
    /// What the ids of its prompt (and so of each continuation) are, for the token checks.
    kind: IdKind,
    pub(crate) stream: bool,
    pub(crate) deadline: f64,
    pub(crate) guards: Guards,
    /// Output tokens already charged to the tenant in flow control (at a yield).
    charged: u64,
    /// The engine of the slice running or last run.
    endpoint: Option<Arc<str>>,
    /// Whether part of the answer went to the client.
    started: bool,
    /// The engine's own refusal (a 4xx) of the request's first slice: the client's answer,
    /// as an unsliced request gets it (a prompt past the context, a field the engine does not
    /// take), rather than the gateway's 502.
    refused: Option<EngineRefusal>,
    /// The gateway's answer to a slice's decision a router plugin failed (a Python scorer or
    /// filter raised): what an unsliced request gets (a 500 `routing failed: ...`), not an
    /// engine's failure.
    routing: Option<Refusal>,
}

/// An engine's refusal as it answered it: status, content type and (the first 64 KiB of) body.
type EngineRefusal = (StatusCode, Option<hyper::header::HeaderValue>, Bytes);

/// The most of an engine's refusal that is passed on (vLLM's error bodies are a few hundred
/// bytes).
const REFUSAL_LIMIT: usize = 64 << 10;

impl SlicedRequest {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        assembler: SliceAssembler,
        route: &'static str,
        tenant: Arc<str>,
        priority: i32,
        prompt_tokens: usize,
        meta: RequestMeta,
        kind: IdKind,
        stream: bool,
        deadline: f64,
        guards: Guards,
    ) -> SlicedRequest {
        SlicedRequest {
            assembler,
            route,
            tenant,
            priority,
            prompt_tokens,
            meta,
            kind,
            stream,
            deadline,
            guards,
            charged: 0,
            endpoint: None,
            started: false,
            refused: None,
            routing: None,
        }
    }

    /// Whether the request's deadline (`timeouts.total_s`) has passed: what ended a slice
    /// that failed now, rather than its engine.
    fn timed_out(&self) -> bool {
        monotonic() >= self.deadline
    }

    /// Hands the tokens not yet charged to flow control's slot and every token to the key's
    /// limiter (both charge them when dropped): those of the slice in progress too, streamed
    /// before a client left, as the unsliced path charges a stream its client left.
    fn settle(&mut self) {
        let generated = self.assembler.produced_tokens();
        if let Some(slot) = self.guards.slot.as_mut() {
            slot.output_tokens = generated - self.charged;
        }
        if let Some(limiter) = self.guards.limiter.as_mut() {
            limiter.1 = generated;
        }
    }
}

impl Drop for SlicedRequest {
    /// However the request ends (a client that leaves mid-answer drops it with its task):
    /// flow control and the key are charged the tokens generated, as at its end.
    fn drop(&mut self) {
        self.settle();
    }
}

/// What the slices' task hands the client's answer.
enum Out {
    /// SSE bytes to pass on.
    Data(Bytes),
    /// The request failed before anything was passed on (a 502 instead of a stream).
    Failed(String),
    /// A slice's decision failed (a router plugin's error) before anything was passed on:
    /// the gateway's answer instead of a stream.
    RoutingFailed(Refusal),
    /// The engine refused the request's first slice: its answer instead of a stream.
    Refused(EngineRefusal),
    /// The request's deadline passed before anything was passed on (a 504 instead).
    Deadline,
    /// The stream breaks off here (after its error event).
    Abort,
}

/// Stops tracking a request when its run ends, however it ends (a client that leaves drops
/// the run).
struct Tracked {
    gateway: Arc<Gateway>,
    id: u64,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(slicing) = &self.gateway.slicing {
            slicing.lock().remove(self.id);
        }
    }
}

/// Aborts the slices' task when the client's answer is dropped (the client left): the engine
/// call in flight is dropped, which closes its connection.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The client's SSE answer of a sliced request, fed by its task.
pub struct SliceStream {
    first: Option<Bytes>,
    rx: mpsc::Receiver<Out>,
    task: Option<AbortOnDrop>,
    /// Set after the error event of a broken stream: one Pending lets hyper write it out.
    breaking: Option<bool>,
    counters: Arc<crate::Counters>,
    /// The request's route, for its `client_gone` count.
    route: &'static str,
    ended: bool,
}

impl SliceStream {
    /// The next frame (`Relay::poll_frame` delegates here).
    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        if let Some(bytes) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        match self.breaking {
            Some(false) => {
                self.breaking = Some(true);
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Some(true) => {
                self.breaking = None;
                self.ended = true;
                return Poll::Ready(Some(Err(Cut("a slice of the answer failed"))));
            }
            None => {}
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Out::Data(bytes))) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(Some(
                Out::Abort
                | Out::Failed(_)
                | Out::RoutingFailed(_)
                | Out::Refused(_)
                | Out::Deadline,
            )) => {
                self.breaking = Some(false);
                self.poll_frame(cx)
            }
            Poll::Ready(None) => {
                self.ended = true;
                self.task = None;
                Poll::Ready(None)
            }
        }
    }

    /// Whether the stream has ended.
    pub(crate) fn is_end_stream(&self) -> bool {
        self.ended
    }
}

impl Drop for SliceStream {
    fn drop(&mut self) {
        if !self.ended {
            self.counters.disconnects.fetch_add(1, Ordering::Relaxed);
            // A task still running has counted nothing yet (a finished one counted its 200
            // or its abort): the client left first.
            if self.task.as_ref().is_some_and(|task| !task.0.is_finished()) {
                self.counters.requests.inc(&[self.route, "client_gone"]);
            }
        }
    }
}

/// The error event ending an SSE answer the gateway itself cut (`refusal`, as a request not
/// yet answered would have been told it).
fn error_event(refusal: &Refusal) -> Bytes {
    sse(&[refusal.error_body()])
}

fn sse(chunks: &[Value]) -> Bytes {
    let mut out = Vec::new();
    for chunk in chunks {
        out.extend_from_slice(b"data: ");
        // A serde value always serializes.
        let _ = serde_json::to_writer(&mut out, chunk);
        out.extend_from_slice(b"\n\n");
    }
    Bytes::from(out)
}

/// The most of one engine event held while its end (a blank line) is awaited: the 8 MiB the
/// plane reads of any engine answer it holds whole. An event past it ends the request.
pub(crate) const SLICE_EVENT_LIMIT: usize = 8 << 20;

impl Gateway {
    /// Serves an admitted request in slices (see the module docs).
    pub(crate) async fn serve_sliced(self: &Arc<Self>, run: SlicedRequest) -> Answer {
        let route = run.route;
        if !run.stream {
            let mut run = run;
            let ran = self.run_slices(&mut run, None).await;
            run.settle();
            return match ran.and_then(|()| Ok(run.assembler.response()?)) {
                Ok(whole) => {
                    self.counters.completed.fetch_add(1, Ordering::Relaxed);
                    self.counters.requests.inc(&[route, "200"]);
                    json_answer(StatusCode::OK, &whole)
                }
                Err(failed) => match (run.refused.take(), run.routing.take()) {
                    (Some(refused), _) => self.engine_refusal(route, refused),
                    (None, Some(routing)) => self.refuse(route, routing),
                    (None, None) if run.timed_out() => self.refuse(route, deadline_refusal()),
                    (None, None) => self.slice_refusal(route, run.endpoint.as_deref(), failed),
                },
            };
        }
        let (tx, mut rx) = mpsc::channel(16);
        let gateway = self.clone();
        let task = tokio::spawn(async move {
            let mut run = run;
            let ran = gateway.run_slices(&mut run, Some(&tx)).await;
            run.settle();
            match ran {
                Ok(()) => {
                    gateway.counters.completed.fetch_add(1, Ordering::Relaxed);
                    gateway.counters.requests.inc(&[run.route, "200"]);
                    let _ = tx.send(Out::Data(Bytes::from_static(b"data: [DONE]\n\n"))).await;
                }
                // The client left: nobody to tell.
                Err(_) if tx.is_closed() => {}
                Err(SliceFailed(message)) if !run.started => match run.refused.take() {
                    Some(refused) => {
                        let _ = tx.send(Out::Refused(refused)).await;
                    }
                    None if run.routing.is_some() => {
                        if let Some(routing) = run.routing.take() {
                            let _ = tx.send(Out::RoutingFailed(routing)).await;
                        }
                    }
                    None if run.timed_out() => {
                        let _ = tx.send(Out::Deadline).await;
                    }
                    None => {
                        let endpoint = run.endpoint.as_deref().unwrap_or("none");
                        gateway.counters.upstream_errors.inc(&[endpoint, "slice"]);
                        let _ = tx.send(Out::Failed(message)).await;
                    }
                },
                Err(SliceFailed(_)) => {
                    let endpoint = run.endpoint.as_deref().unwrap_or("none");
                    // A failed decision (a router plugin's error) and the request's own
                    // deadline (`timeouts.total_s`) are no engine's failure: the client is told
                    // which, and it counts as the request's rejection of that reason.
                    let routing = run.routing.take();
                    let timed_out = routing.is_none() && run.timed_out();
                    let event = if let Some(routing) = &routing {
                        gateway.counters.rejections.inc(&[routing.reason.unwrap_or(routing.kind)]);
                        error_event(routing)
                    } else if timed_out {
                        gateway.counters.rejections.inc(&["timeout"]);
                        Bytes::from_static(DEADLINE_EVENT.as_bytes())
                    } else {
                        gateway.counters.upstream_errors.inc(&[endpoint, "slice"]);
                        Bytes::from_static(CUT_EVENT.as_bytes())
                    };
                    gateway.counters.truncated.inc(&[endpoint, "sse_error"]);
                    gateway.counters.requests.inc(&[run.route, "aborted"]);
                    // Part of the stream went out: the client must not take it for a whole
                    // answer.
                    let _ = tx.send(Out::Data(event)).await;
                    let _ = tx.send(Out::Abort).await;
                }
            }
        });
        let task = AbortOnDrop(task);
        match rx.recv().await {
            Some(Out::Data(first)) => {
                let stream = SliceStream {
                    first: Some(first),
                    rx,
                    task: Some(task),
                    breaking: None,
                    counters: self.counters.clone(),
                    route,
                    ended: false,
                };
                sliced_answer(stream)
            }
            Some(Out::Refused(refused)) => self.engine_refusal(route, refused),
            Some(Out::Deadline) => self.refuse(route, deadline_refusal()),
            Some(Out::RoutingFailed(routing)) => self.refuse(route, routing),
            Some(Out::Failed(message)) => self.refuse(
                route,
                Refusal::new(502, "upstream_error", format!("a slice failed: {message}")),
            ),
            Some(Out::Abort) | None => self.refuse(
                route,
                Refusal::new(502, "upstream_error", "a slice failed: the request ended"),
            ),
        }
    }

    /// The engine's refusal of a request's first slice, answered as it gave it.
    fn engine_refusal(&self, route: &'static str, (status, kind, body): EngineRefusal) -> Answer {
        self.counters.requests.inc(&[route, status.as_str()]);
        let mut answer = own(status, "application/json", body);
        if let Some(kind) = kind {
            answer.headers_mut().insert(CONTENT_TYPE, kind);
        }
        answer
    }

    fn slice_refusal(
        &self,
        route: &'static str,
        endpoint: Option<&str>,
        failed: SliceFailed,
    ) -> Answer {
        self.counters.upstream_errors.inc(&[endpoint.unwrap_or("none"), "slice"]);
        self.refuse(
            route,
            Refusal::new(502, "upstream_error", format!("a slice failed: {}", failed.0)),
        )
    }

    /// Runs every slice of `run`; chunks go to `out` as they come (a streamed answer).
    async fn run_slices(
        self: &Arc<Self>,
        run: &mut SlicedRequest,
        out: Option<&mpsc::Sender<Out>>,
    ) -> Result<(), SliceFailed> {
        let Some(slicing) = &self.slicing else {
            return Err(SliceFailed("token slices are off".into()));
        };
        let id = slicing.ids.fetch_add(1, Ordering::Relaxed);
        let _tracked = Tracked { gateway: self.clone(), id };
        let mut slice_tokens = 0;
        let mut first = true;
        loop {
            let mut body = run.assembler.next_request(slice_tokens.max(1))?;
            let tokens = self
                .continuation_tokens(&body, run.route == "chat")
                .map_err(|e| SliceFailed(format!("the continuation cannot be routed: {e}")))?;
            let router = self.router();
            let before = monotonic();
            let decided = self.decide_off_runtime(&tokens, tokens.len(), &run.meta, before).await;
            self.counters.histograms.decision.observe(monotonic() - before);
            // Each call a pick, checked as an unsliced request's (and as the Python plane's
            // `Router.pick` checks each slice's).
            self.check_ids(run.kind, &tokens, &run.meta, before);
            let decision = match decided {
                Ok(decision) => decision,
                Err(RoutingError::NoEndpoint { .. }) => {
                    return Err(SliceFailed("no engine can serve the continuation".into()))
                }
                Err(err @ RoutingError::Plugin(_)) => {
                    let refusal = self.routing_failed(&err);
                    let failed = SliceFailed(refusal.message.clone());
                    run.routing = Some(refusal);
                    return Err(failed);
                }
                Err(err) => return Err(err.into()),
            };
            let upstreams = self.upstreams();
            let Some(upstream) = decision
                .ranked()
                .find_map(|c| upstreams.by_key.get(&decision.endpoint(c).id))
                .cloned()
            else {
                return Err(SliceFailed("no engine can serve the continuation".into()));
            };
            let mut ticket = router.commit(&decision, Some(&upstream.key), monotonic())?;
            run.endpoint = Some(Arc::from(upstream.id.as_str()));
            {
                let mut tracker = slicing.lock();
                if tracker.endpoint_load(&upstream.id).is_none() {
                    tracker.set_endpoint(&upstream.id, EndpointReport::default())?;
                }
                let start = if first {
                    let prompt = u32::try_from(run.prompt_tokens).unwrap_or(u32::MAX);
                    let left = u32::try_from(run.assembler.remaining_tokens()).unwrap_or(u32::MAX);
                    Some(tracker.admit(id, prompt, left, run.priority, &upstream.id)?)
                } else if tracker.get(id).is_some_and(|s| s.phase != Phase::Running) {
                    Some(tracker.resume(id, &upstream.id)?)
                } else {
                    None
                };
                drop(tracker);
                if let Some(start) = start {
                    body = run.assembler.next_request(u64::from(start.slice_tokens))?;
                }
            }
            let opening = first;
            first = false;
            let called = self.call_slice(&upstream, run, &body, &mut ticket, out, opening).await;
            if let Err(failed) = called {
                drop(ticket);
                self.drop_record(router, &decision, &upstream.key);
                return Err(failed);
            }
            ticket.finish();
            self.counters.slices.fetch_add(1, Ordering::Relaxed);
            let made = u32::try_from(run.assembler.last_slice_tokens()).unwrap_or(u32::MAX);
            let left = slicing.lock().record_tokens(id, made)?;
            if run.assembler.done() {
                return Ok(());
            }
            // A call the assembler cut short (at `min_tokens`) is no boundary: the rest of the
            // tracker's slice follows without a decision.
            slice_tokens =
                if left > 0 { u64::from(left) } else { self.boundary(slicing, id, run).await? };
        }
    }

    /// The ids the router hashes for a slice's call: its whole prompt, continuation included.
    fn continuation_tokens(&self, body: &Value, chat: bool) -> Result<Vec<u32>, String> {
        let Some(tokenizer) = &self.tokenizer else {
            let text = serde_json::to_vec(body).map_err(|e| e.to_string())?;
            let payload =
                Payload::parse(&text).map_err(|_| "the continuation is not a JSON object")?;
            return prompt_tokens(&payload, chat, None).map_err(str::to_owned);
        };
        if !chat {
            // A request with a truncation is never sliced: a continuation carries none.
            let truncation = Truncation::of_body(body, None)?;
            return tokenizer
                .completion_tokens(body.get("prompt"), body.get("add_special_tokens"), truncation)
                .map_err(|p| p.0);
        }
        // The continuation as the engine renders it: its body carries
        // `continue_final_message` and `add_generation_prompt` as the engine reads them.
        let text = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        tokenizer.chat_tokens_of_body(&text).map_err(|p| p.0)
    }

    /// One slice's engine call, streamed into the assembler; the user's chunks go to `out`.
    async fn call_slice(
        &self,
        upstream: &Upstream,
        run: &mut SlicedRequest,
        body: &Value,
        ticket: &mut llmsched_core::routing::Ticket,
        out: Option<&mpsc::Sender<Out>>,
        opening: bool,
    ) -> Result<(), SliceFailed> {
        let path =
            if run.route == "chat" { &upstream.chat_path } else { &upstream.completions_path };
        let payload = serde_json::to_vec(body)?;
        let request = Request::post(path.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(payload)))?;
        let read = self.config.read_timeout_s.map(Duration::from_secs_f64);
        let left = Duration::from_secs_f64((run.deadline - monotonic()).clamp(0.0, 1e9));
        let deadline = Some(tokio::time::Instant::now() + left);
        let sent = upstream.connections.send(request);
        let (answer, lease) = tokio::time::timeout_at(wake_at(read, deadline), sent)
            .await
            .map_err(|_| SliceFailed("the engine did not answer in time".into()))?
            .map_err(|e| SliceFailed(format!("the engine could not be reached ({e})")))?;
        if answer.status() != StatusCode::OK {
            let status = answer.status();
            if opening && status.is_client_error() {
                // The engine refused the request itself: the client's own mistake.
                let kind = answer.headers().get(CONTENT_TYPE).cloned();
                let body = http_body_util::Limited::new(answer.into_body(), REFUSAL_LIMIT);
                let read = tokio::time::timeout_at(wake_at(read, deadline), body.collect()).await;
                if let Ok(Ok(collected)) = read {
                    run.refused = Some((status, kind, collected.to_bytes()));
                }
            }
            return Err(SliceFailed(format!("engine answered {}", status.as_u16())));
        }
        let mut body = answer.into_body();
        let mut buffered: Vec<u8> = Vec::new();
        // Where the search for the next event's end resumes (the buffer before it has none).
        let mut scanned = 0;
        let mut first = true;
        // Events end at a blank line, whichever line ends the engine (or a proxy before it)
        // writes: the SSE spec allows CRLF and a lone CR besides LF.
        let mut line_ends = crate::responses::LineEnds::default();
        loop {
            let frame = tokio::time::timeout_at(wake_at(read, deadline), body.frame())
                .await
                .map_err(|_| SliceFailed("the engine's answer stalled".into()))?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|_| SliceFailed("the engine's answer broke off".into()))?;
            let Ok(data) = frame.into_data() else { continue };
            if first {
                ticket.first_token();
                first = false;
            }
            buffered.extend_from_slice(&line_ends.to_lf(&data));
            let mut chunks = Vec::new();
            while let Some(at) = buffered[scanned..].windows(2).position(|w| w == b"\n\n") {
                let at = scanned + at;
                let event: Vec<u8> = buffered.drain(..at + 2).collect();
                chunks.extend(feed_event(&mut run.assembler, &event[..at])?);
                scanned = 0;
            }
            // Its last byte may be the first of an end: the next search starts there.
            scanned = buffered.len().saturating_sub(1);
            if buffered.len() > SLICE_EVENT_LIMIT {
                // Held whole until its end came, an event has a bound, as any engine answer
                // the plane reads whole: past it the request ends (the engine's error).
                return Err(SliceFailed(format!(
                    "an event of the engine's stream exceeds {} MiB",
                    SLICE_EVENT_LIMIT >> 20
                )));
            }
            self.pass_on(run, &chunks, out).await?;
        }
        // Read to its end: the connection can carry the next slice.
        lease.release();
        let mut chunks = Vec::new();
        if !buffered.trim_ascii().is_empty() {
            chunks.extend(feed_event(&mut run.assembler, &buffered)?);
        }
        chunks.extend(run.assembler.end_slice()?);
        self.pass_on(run, &chunks, out).await
    }

    /// Sends user chunks to a streamed answer (a client gone ends the request).
    async fn pass_on(
        &self,
        run: &mut SlicedRequest,
        chunks: &[Value],
        out: Option<&mpsc::Sender<Out>>,
    ) -> Result<(), SliceFailed> {
        let Some(out) = out.filter(|_| !chunks.is_empty()) else { return Ok(()) };
        run.started = true;
        out.send(Out::Data(sse(chunks))).await.map_err(|_| SliceFailed("the client left".into()))
    }

    /// The tracker's decision at a slice boundary; returns the next slice's length. A yield
    /// gives the flow-control slot back and queues the continuation again.
    async fn boundary(
        &self,
        slicing: &Slicing,
        id: u64,
        run: &mut SlicedRequest,
    ) -> Result<u64, SliceFailed> {
        let waiting = self.waiting_sample(slicing);
        let decision = {
            let mut tracker = slicing.lock();
            let snapshot = self.router().pool().snapshot();
            for upstream in &self.upstreams().list {
                let Some(member) = snapshot.get(&upstream.key) else {
                    // Out of routing (drained, down, its breaker open): no migration target
                    // on the load it last reported.
                    tracker.remove_endpoint(&upstream.id);
                    continue;
                };
                let metrics = member.metrics();
                let report = EndpointReport {
                    kv_usage: metrics.kv_cache_usage.clamp(0.0, 1.0),
                    waiting: metrics.waiting,
                    ..EndpointReport::default()
                };
                let _ = tracker.set_endpoint(&upstream.id, report);
            }
            tracker.decide(id, false, &waiting, monotonic())?
        };
        match decision.action {
            Action::Finish => {
                return Err(SliceFailed(
                    "the slice tracker finished the request before its end".into(),
                ))
            }
            Action::Yield if run.guards.slot.is_some() => {
                run.settle();
                run.guards.slot = None; // the slot goes back, charged
                run.charged = run.assembler.produced_tokens();
                let Some(flow) = &self.flow else {
                    return Ok(u64::from(decision.next_slice_tokens));
                };
                let admitted = flow
                    .admit(
                        &run.tenant,
                        decision.priority,
                        decision.context_tokens,
                        0,
                        run.deadline,
                        monotonic,
                    )
                    .await;
                match admitted {
                    Ok(slot) => run.guards.slot = Some(slot),
                    Err(crate::flow::NotAdmitted::Deadline) => {
                        return Err(SliceFailed(
                            "continuation not admitted: the request's deadline passed".into(),
                        ))
                    }
                    Err(crate::flow::NotAdmitted::Outcome(outcome)) => {
                        return Err(SliceFailed(format!(
                            "continuation not admitted: {}",
                            outcome.reason()
                        )))
                    }
                }
            }
            _ => {}
        }
        Ok(u64::from(decision.next_slice_tokens))
    }

    /// The requests queued in flow control as the tracker sees them (their sizes are not
    /// exported by the controller: each counts as a short new request).
    fn waiting_sample(&self, slicing: &Slicing) -> Vec<WaitingRequest> {
        let Some(metrics) = self.flow.as_ref().and_then(|f| f.metrics(monotonic())) else {
            return Vec::new();
        };
        let quantum = slicing.lock().quantum(0).unwrap_or(1).max(1);
        metrics
            .bands
            .iter()
            .flat_map(|band| {
                (0..band.queued).map(move |_| WaitingRequest {
                    priority: band.priority,
                    level: 0,
                    context_tokens: 0,
                    expected_tokens: quantum,
                })
            })
            .take(WAITING_SAMPLE)
            .collect()
    }
}

/// One SSE event of an engine's stream fed to the assembler: its first `data:` line.
fn feed_event(assembler: &mut SliceAssembler, event: &[u8]) -> Result<Vec<Value>, SliceFailed> {
    for line in event.split(|b| *b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else { continue };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            return Ok(Vec::new());
        }
        let chunk: Value = serde_json::from_slice(data)
            .map_err(|e| SliceFailed(format!("malformed engine event: {e}")))?;
        return assembler
            .feed(&chunk)
            .map_err(|e| SliceFailed(format!("malformed engine event: {e}")));
    }
    Ok(Vec::new())
}
