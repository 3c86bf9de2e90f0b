//! The fake engine's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) in the
//! shapes vLLM 0.32 serves (the Python fake `llmsched.testing.openai_engine` is the reference).
//!
//! A JSON answer is the `response` object, its `id` first; a stream is named server-sent events
//! (`event: <type>\ndata: {...}\n\n`): `response.created` (the response id first in it),
//! `response.in_progress`, one `response.output_text.delta` per token,
//! `response.output_text.done`, and `response.completed` carrying the whole response with its
//! usage, and no `data: [DONE]`. Output token `k` reads `" t<k>"`, counted from 0 each turn.
//!
//! vLLM keeps each response, and the conversation behind it, in the memory of the engine that
//! made it: a request whose `previous_response_id` this engine does not hold is answered 404
//! with vLLM's error and counted in [`super::Counters::continuations_missed`]. Every response
//! made is stored unless the request says `"store": false`, in a bounded store
//! ([`super::EngineConfig::response_store`]: the oldest dropped first), one lock per request
//! (a hash lookup and an insert): a JSON answer before it is sent, a stream as it completes
//! (just before its `response.completed`; a stream scripted to break off is never stored), as
//! vLLM stores them. `GET /v1/responses/{id}?stream=true` answers a stored response as vLLM
//! answers one that was not streamed in the background (vLLM keeps the events of those
//! only, and this fake has no background mode): the head of a stream, then the connection is
//! cut; a `stream` that is no boolean is vLLM's 400.
//!
//! Decisions beyond what vLLM specifies: `max_output_tokens` caps the answer like `max_tokens`
//! does elsewhere; input tokens are a quarter of the `input`'s JSON length; the stored
//! conversation is not read back into the prompt (a continuation is answered like a first turn).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::CONTENT_LENGTH;
use hyper::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};

use super::{plain, respond, unix_time, Answer, AnswerBody, Break, Engine, InFlight, Mode};

/// The path prefix of one stored response (`GET /v1/responses/{id}`).
pub const PREFIX: &str = "/v1/responses/";

/// Responses by id, the oldest dropped beyond a bound.
pub(super) struct Store {
    capacity: usize,
    inner: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_id: HashMap<Box<str>, Bytes>,
    order: VecDeque<Box<str>>,
}

impl Store {
    /// A store of at most `capacity` responses (0: keeps none).
    pub(super) fn new(capacity: usize) -> Self {
        Store { capacity, inner: Mutex::new(Kept::default()) }
    }

    /// Keeps `answer` (the final response JSON) under `id`, dropping the oldest beyond the bound.
    pub(super) fn insert(&self, id: &str, answer: Bytes) {
        if self.capacity == 0 {
            return;
        }
        let mut kept = self.inner.lock().unwrap();
        if kept.by_id.insert(id.into(), answer).is_none() {
            kept.order.push_back(id.into());
        }
        while kept.order.len() > self.capacity {
            if let Some(oldest) = kept.order.pop_front() {
                kept.by_id.remove(&oldest);
            }
        }
    }

    /// The response stored under `id`.
    pub(super) fn get(&self, id: &str) -> Option<Bytes> {
        self.inner.lock().unwrap().by_id.get(id).cloned()
    }

    /// Whether `id` is stored.
    pub(super) fn contains(&self, id: &str) -> bool {
        self.inner.lock().unwrap().by_id.contains_key(id)
    }

    /// How many responses are stored.
    pub(super) fn len(&self) -> usize {
        self.inner.lock().unwrap().order.len()
    }
}

/// How one admitted Responses request is answered.
pub(super) struct Generation {
    /// The mode it was scripted in (past the modes that answer nothing).
    pub(super) mode: Mode,
    /// `"stream": true`.
    pub(super) stream: bool,
    /// Its number among this engine's requests (from 1; part of its id).
    pub(super) seq: u64,
    /// The engine's reading of the request ([`crate::stamp::monotonic_ns`]).
    pub(super) received_ns: u64,
}

/// What vLLM would refuse with a 400 in a Responses request (the fields this fake reads).
pub(super) fn check_body(fields: &Map<String, Value>) -> Result<(), &'static str> {
    match fields.get("input") {
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) if items.iter().all(Value::is_object) => {}
        _ => return Err("input must be a string or a list of items"),
    }
    match fields.get("max_output_tokens") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {}
        Some(_) => return Err("max_output_tokens must be an integer >= 1"),
    }
    if !matches!(fields.get("instructions"), None | Some(Value::Null | Value::String(_))) {
        return Err("instructions must be a string");
    }
    if !matches!(fields.get("store"), None | Some(Value::Null | Value::Bool(_))) {
        return Err("store must be a boolean");
    }
    match fields.get("previous_response_id") {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(_) => Err("previous_response_id must be a string"),
    }
}

/// vLLM's answer for a response id it does not hold (the Python fake's `_not_found`).
fn not_found(id: &str) -> Answer {
    let body = serde_json::json!({"error": {
        "message": format!("Response with id '{id}' not found."),
        "type": "invalid_request_error", "param": "response_id", "code": 404,
    }});
    plain(StatusCode::NOT_FOUND, "application/json", serde_json::to_vec(&body).unwrap().into())
}

/// The token usage of a response.
#[derive(Serialize)]
struct Usage {
    input_tokens: usize,
    output_tokens: usize,
    total_tokens: usize,
}

/// The text of an output message.
#[derive(Serialize)]
struct OutputText<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    annotations: [(); 0],
}

/// The assistant message a response outputs.
#[derive(Serialize)]
struct OutputMessage<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    status: &'static str,
    content: [OutputText<'a>; 1],
}

/// A `response` object in vLLM's shape (the fields clients read), `id` first.
#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    model: &'a Value,
    status: &'static str,
    instructions: &'a Value,
    previous_response_id: &'a Value,
    output: Vec<OutputMessage<'a>>,
    usage: Usage,
}

/// A lifecycle event (`response.created`, `response.in_progress`, `response.completed`).
#[derive(Serialize)]
struct Lifecycle<'a> {
    response: &'a ResponseObject<'a>,
    sequence_number: usize,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// A `response.output_text.delta` event (`text` as `delta`) or `response.output_text.done`.
#[derive(Serialize)]
struct TextEvent<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    item_id: &'a str,
    output_index: usize,
    content_index: usize,
    sequence_number: usize,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// One named server-sent event: `event: <kind>\ndata: <json>\n\n`.
fn named_event(kind: &str, data: &impl Serialize) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    serde_json::to_writer(&mut out, data).unwrap();
    out.extend_from_slice(b"\n\n");
    out.into()
}

/// The fields of a request a response echoes, and its text.
struct Made<'a> {
    id: String,
    item_id: String,
    body: &'a Value,
    pieces: Vec<String>,
    text: String,
    input_tokens: usize,
    created_at: u64,
}

impl Made<'_> {
    /// The response object in `status`, with its output message (none when `empty`).
    fn object(&self, status: &'static str, empty: bool) -> ResponseObject<'_> {
        let output_tokens = if empty { 0 } else { self.pieces.len() };
        let output = if empty || self.pieces.is_empty() {
            Vec::new()
        } else {
            vec![OutputMessage {
                id: &self.item_id,
                kind: "message",
                role: "assistant",
                status: "completed",
                content: [OutputText { kind: "output_text", text: &self.text, annotations: [] }],
            }]
        };
        ResponseObject {
            id: &self.id,
            object: "response",
            created_at: self.created_at,
            model: self.body.get("model").unwrap_or(&Value::Null),
            status,
            instructions: self.body.get("instructions").unwrap_or(&Value::Null),
            previous_response_id: self.body.get("previous_response_id").unwrap_or(&Value::Null),
            output,
            usage: Usage {
                input_tokens: self.input_tokens,
                output_tokens,
                total_tokens: self.input_tokens + output_tokens,
            },
        }
    }

    /// A text event numbered `sequence_number`: a delta with `delta`, else the done event.
    fn text_event(&self, delta: Option<&str>, sequence_number: usize) -> Bytes {
        let kind = if delta.is_some() {
            "response.output_text.delta"
        } else {
            "response.output_text.done"
        };
        let event = TextEvent {
            delta,
            text: delta.is_none().then_some(self.text.as_str()),
            item_id: &self.item_id,
            output_index: 0,
            content_index: 0,
            sequence_number,
            kind,
        };
        named_event(kind, &event)
    }
}

/// The break a scripted mode makes after the first part of the answer.
fn break_of(mode: Mode) -> Option<Break> {
    match mode {
        Mode::Cut => Some(Break::Cut),
        Mode::Hang => Some(Break::Hang),
        _ => None,
    }
}

impl Engine {
    /// The 404 for a continuation whose `previous_response_id` this engine does not hold
    /// (None when the request names none, or one stored here); counts continuations.
    pub(super) fn continuation_missing(&self, body: &Value) -> Option<Answer> {
        let previous = body.get("previous_response_id").and_then(Value::as_str)?;
        self.counters.continuations.fetch_add(1, Ordering::Relaxed);
        if self.store.contains(previous) {
            return None;
        }
        self.counters.continuations_missed.fetch_add(1, Ordering::Relaxed);
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        Some(not_found(previous))
    }

    /// `GET /v1/responses/{id}` (`query`: the URI's query): the stored response, or vLLM's
    /// 404; with `stream=true`, a stream's head and then a cut (see the module docs).
    pub(super) fn retrieve(&self, id: &str, query: Option<&str>) -> Answer {
        let Ok(stream) = stream_asked(query) else {
            return super::error(StatusCode::BAD_REQUEST, "stream must be a boolean");
        };
        match self.store.get(id) {
            Some(_) if stream => {
                self.counters.retrievals.fetch_add(1, Ordering::Relaxed);
                let cut = AnswerBody::new(Vec::new(), Some(Break::Cut), None, InFlight::none());
                respond(StatusCode::OK, "text/event-stream; charset=utf-8", cut)
            }
            Some(found) => {
                self.counters.retrievals.fetch_add(1, Ordering::Relaxed);
                plain(StatusCode::OK, "application/json", found)
            }
            None => {
                self.counters.retrievals_missed.fetch_add(1, Ordering::Relaxed);
                not_found(id)
            }
        }
    }

    /// Answers an admitted Responses request (JSON or a stream), storing the final response
    /// unless `"store": false`.
    pub(super) fn respond_to(
        &self,
        body: &Value,
        generation: Generation,
        mut guard: InFlight,
    ) -> Answer {
        let limit = body.get("max_output_tokens").and_then(Value::as_u64).unwrap_or(u64::MAX);
        let n = self.config.answer_tokens.min(usize::try_from(limit).unwrap_or(usize::MAX));
        let pieces: Vec<String> = (0..n).map(|k| format!(" t{k}")).collect();
        let id = format!("resp_{}_{}", generation.seq, self.port);
        let made = Made {
            item_id: format!("msg_{id}"),
            id,
            body,
            text: pieces.concat(),
            pieces,
            input_tokens: body.get("input").map_or(0, |input| json_length(input) / 4),
            created_at: unix_time(),
        };
        let final_json = Bytes::from(serde_json::to_vec(&made.object("completed", false)).unwrap());
        let stored = body.get("store").and_then(Value::as_bool) != Some(false);
        self.counters.responses.fetch_add(1, Ordering::Relaxed);
        guard.tokens = Some((made.input_tokens as u64, n as u64));
        if generation.stream {
            let mut answer = self.stream_answer(&made, generation, guard);
            if stored {
                let (store, id) = (self.store.clone(), made.id.clone());
                answer.body_mut().before_last =
                    Some(Box::new(move || store.insert(&id, final_json)));
            }
            answer
        } else {
            if stored {
                self.store.insert(&made.id, final_json.clone());
            }
            json_answer(final_json, generation.mode, guard)
        }
    }

    /// The named events of a streamed response, each after its delay.
    fn stream_answer(&self, made: &Made<'_>, generation: Generation, guard: InFlight) -> Answer {
        let gap = if generation.mode == Mode::Slow {
            self.config.slow_delay
        } else {
            self.config.token_delay
        };
        let started = made.object("in_progress", true);
        let mut events = Vec::with_capacity(made.pieces.len() + 4);
        for (i, kind) in ["response.created", "response.in_progress"].into_iter().enumerate() {
            let event = Lifecycle { response: &started, sequence_number: i, kind };
            events.push((named_event(kind, &event), Duration::ZERO));
        }
        for (i, piece) in made.pieces.iter().enumerate() {
            let delay = if i == 0 { self.config.first_token_delay } else { gap };
            events.push((made.text_event(Some(piece), events.len()), delay));
        }
        events.push((made.text_event(None, events.len()), Duration::ZERO));
        let done = made.object("completed", false);
        let kind = "response.completed";
        let event = Lifecycle { response: &done, sequence_number: events.len(), kind };
        events.push((named_event(kind, &event), Duration::ZERO));
        let breaks = break_of(generation.mode);
        if breaks.is_some() {
            events.truncate(1);
        }
        let mut answer = AnswerBody::new(events, breaks, None, guard);
        answer.stamp = self.config.stamp.then_some(generation.received_ns);
        respond(StatusCode::OK, "text/event-stream; charset=utf-8", answer)
    }
}

/// `stream` of a `GET /v1/responses/{id}` query read as FastAPI reads a `bool` (false when
/// absent; `Err` when it is no boolean).
fn stream_asked(query: Option<&str>) -> Result<bool, ()> {
    // The last one counts, as Starlette reads a repeated parameter.
    let Some(value) = query.unwrap_or_default().split('&').rev().find_map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        (name == "stream").then_some(value)
    }) else {
        return Ok(false);
    };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" | "t" | "y" => Ok(true),
        "0" | "false" | "off" | "no" | "f" | "n" => Ok(false),
        _ => Err(()),
    }
}

/// A JSON answer with its declared length (half of it, then the break, when scripted so).
fn json_answer(bytes: Bytes, mode: Mode, guard: InFlight) -> Answer {
    let length = bytes.len() as u64;
    let breaks = break_of(mode);
    let sent = if breaks.is_some() { bytes.slice(..bytes.len() / 2) } else { bytes };
    let answer = AnswerBody::new(vec![(sent, Duration::ZERO)], breaks, Some(length), guard);
    let mut response = respond(StatusCode::OK, "application/json", answer);
    response.headers_mut().insert(CONTENT_LENGTH, length.into());
    response
}

/// The length of `value` written as JSON, without keeping the text.
fn json_length(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).map_or(0, |()| count.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_drops_the_oldest_beyond_its_bound() {
        let store = Store::new(2);
        for id in ["a", "b", "c"] {
            store.insert(id, Bytes::from(id.to_string()));
        }
        assert_eq!(store.len(), 2);
        assert!(!store.contains("a"));
        assert_eq!(store.get("c").as_deref(), Some(&b"c"[..]));
        // Storing an id again keeps one entry.
        store.insert("c", Bytes::from_static(b"c2"));
        assert_eq!(store.len(), 2);
        assert!(store.contains("b"));
        let none = Store::new(0);
        none.insert("a", Bytes::new());
        assert_eq!(none.len(), 0);
    }

    #[test]
    fn bodies_are_checked_as_vllm_checks_them() {
        let fields = |v: Value| v.as_object().unwrap().clone();
        assert!(check_body(&fields(serde_json::json!({"input": "hi"}))).is_ok());
        let items = serde_json::json!({"input": [{"role": "user", "content": "hi"}],
                                       "instructions": "be brief", "store": false,
                                       "previous_response_id": "resp_1"});
        assert!(check_body(&fields(items)).is_ok());
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"input": 3}),
            serde_json::json!({"input": ["x"]}),
            serde_json::json!({"input": "x", "max_output_tokens": 0}),
            serde_json::json!({"input": "x", "instructions": 1}),
            serde_json::json!({"input": "x", "store": "no"}),
            serde_json::json!({"input": "x", "previous_response_id": 7}),
        ] {
            assert!(check_body(&fields(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_stream_query_is_read_as_fastapi_reads_a_bool() {
        for (query, expected) in [
            (None, Ok(false)),
            (Some(""), Ok(false)),
            (Some("starting_after=3"), Ok(false)),
            (Some("stream=true"), Ok(true)),
            (Some("starting_after=1&stream=1"), Ok(true)),
            (Some("stream=Yes"), Ok(true)),
            (Some("stream=false&stream=true"), Ok(true)),
            (Some("stream=false"), Ok(false)),
            (Some("stream=maybe"), Err(())),
            (Some("stream"), Err(())),
        ] {
            assert_eq!(stream_asked(query), expected, "{query:?}");
        }
    }

    #[test]
    fn json_length_is_the_written_length() {
        let value = serde_json::json!([{"role": "user", "content": "héllo \"x\""}]);
        assert_eq!(json_length(&value), serde_json::to_vec(&value).unwrap().len());
    }
}
