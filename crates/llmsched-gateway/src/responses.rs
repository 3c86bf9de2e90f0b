//! OpenAI's Responses API (`POST /v1/responses`, `/v1/responses/{id}`): the chat request a
//! responses request makes, which engine holds which stored response, and how its answers are
//! read.
//!
//! Model: vLLM (0.32) keeps each response it makes, and the conversation behind it, in the
//! memory of the engine that made it. A request continuing a conversation
//! (`previous_response_id`), and a by-id request (`GET`, `cancel`, `input_items`), is answered
//! by that engine alone (any other answers 404). So the gateway learns each response's engine
//! from the answer that made it ([`Owners`]: from a JSON answer's top-level `id`,
//! [`response_id_of`], or a stream's first event, [`IdScan`]) and sends the conversation's
//! next request there (which also holds its KV cache). A request without
//! `previous_response_id` is routed as the chat request vLLM renders of it
//! ([`chat_request_of`]), so that its blocks match what the engine caches.
//!
//! A Responses event stream has no `data: [DONE]`: it is whole once its terminal event
//! (`response.completed`, `response.incomplete`, `response.failed` or `error`) has ended, its
//! blank line seen ([`TerminalScan`]); cut, it gets [`CUT_EVENT`]. Its output tokens are its
//! `*.delta` events ([`output_deltas`]); a JSON answer's are its top-level
//! `usage.output_tokens` ([`usage_output_tokens`]).
//!
//! Complexity: the conversion is linear in the request; [`Owners`] is a map plus an
//! ordered index (O(log n) a lookup or record, O(n) forgetting an engine, which happens
//! only when the configuration changes); the scanners keep a few bytes between frames (the
//! id scanner up to 64 KiB of the first event).
//!
//! Decisions beyond what vLLM specifies (the Python plane's `llmsched.gateway.responses` makes
//! the same): an input the conversion does not cover (an item without a role other than a
//! function or custom tool call, its output or a reasoning item; reasoning with encrypted
//! content; a tool without a type) is routed without prefix hashing rather than refused (the
//! engine answers it); `chat_template_kwargs` that is not an object is ignored; a response
//! made with `store` false ([`stores_response`]) is not remembered, as the engine keeps none.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value};

/// Response ids kept at most (least recently used dropped first): about 10 MB of vLLM's
/// 37-byte ids, up to about 60 MB of ids of [`MAX_RESPONSE_ID_BYTES`].
pub const MAX_OWNERS: usize = 100_000;

/// Longer ids are not kept (vLLM's are `resp_` and 32 hex digits).
pub const MAX_RESPONSE_ID_BYTES: usize = 256;

/// Bytes of a stream read for its first event (`response.created` echoes the request's
/// instructions and tools).
pub const FIRST_EVENT_LIMIT: usize = 64 << 10;

/// The event the gateway appends to a Responses stream cut upstream (after a blank line when
/// the stream broke off inside an event), before it closes it without its last chunk.
pub const CUT_EVENT: &str = "event: error\ndata: {\"type\":\"error\",\"code\":\"upstream_error\",\
\"message\":\"the engine's answer was cut off\",\"param\":null}\n\n";

/// The error event ending a stream the request's own deadline (`timeouts.total_s`) cut.
pub const DEADLINE_EVENT: &str = "event: error\ndata: {\"type\":\"error\",\"code\":\"timeout\",\
\"message\":\"the request's deadline (timeouts.total_s) passed\",\"param\":null}\n\n";

/// The chat request (a JSON object) vLLM renders for the responses request `body` (models
/// without the Harmony format), to be tokenized as a chat request is; `None` when `body` has
/// something this conversion does not cover, which is then routed without prefix hashing.
///
/// `instructions` becomes a system message and a string `input` a user message; list items
/// become messages as vLLM's `construct_input_messages` makes them: a `function_call` joins
/// the assistant message before it as a tool call (or makes one), a `function_call_output`
/// (or `custom_tool_call_output`) is a `tool` message, an assistant item's text (its string content, or its first part's
/// `text`) fills the content of an assistant message before it that has none (or makes
/// one), any other item with a `role` (and no `type` but `message`) is a chat message as it
/// is. A `custom_tool_call` is a tool call whose arguments are `{"input": ...}`, a namespaced
/// `function_call` is named `namespace__name`, a `reasoning` item's text (its first content
/// part's, else its first summary's) is the `reasoning` of the assistant message before it
/// that has none (or makes one). Function tools take the chat shape (`{"type": "function",
/// "function": {...}}`, with `tool_choice` when there are tools), a namespace's functions are
/// flattened (`ns__f`), a custom tool is a function taking one string `input`, and the other
/// tools (web search, MCP, ...) are left out, as vLLM shows them to no model without the
/// Harmony format; `reasoning.effort` becomes `reasoning_effort` (and,
/// unless `chat_template_kwargs` sets it, `enable_thinking`: whether the effort is not
/// `"none"`); a last item of type `message` or `reasoning` whose status is `in_progress` or
/// `incomplete` is continued (`continue_final_message`), otherwise a generation prompt is
/// added.
///
/// ```
/// use llmsched_gateway::responses::chat_request_of;
/// use serde_json::json;
/// let chat = chat_request_of(&json!({"model": "m", "instructions": "Be brief.", "input": "Hi"}));
/// assert_eq!(
///     chat.unwrap()["messages"],
///     json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
/// );
/// assert!(chat_request_of(&json!({"input": [{"type": "image_generation_call"}]})).is_none());
/// ```
pub fn chat_request_of(body: &Value) -> Option<Value> {
    let body = body.as_object()?;
    let mut messages: Vec<Value> = Vec::new();
    match body.get("instructions") {
        Some(Value::String(text)) if !text.is_empty() => {
            messages.push(message("system", Value::String(text.clone())));
        }
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => return None,
    }
    let mut continue_final = false;
    match body.get("input") {
        Some(Value::String(text)) => messages.push(message("user", Value::String(text.clone()))),
        Some(Value::Array(items)) => {
            for item in items {
                add_item(&mut messages, item.as_object()?)?;
            }
            continue_final = items.last().and_then(Value::as_object).is_some_and(|last| {
                let kind = match last.get("type") {
                    None => Some("message"),
                    Some(kind) => kind.as_str(),
                };
                matches!(kind, Some("message" | "reasoning"))
                    && matches!(
                        last.get("status").and_then(Value::as_str),
                        Some("in_progress" | "incomplete")
                    )
            });
        }
        _ => return None,
    }
    let mut chat = Map::new();
    chat.insert("model".into(), body.get("model").cloned().unwrap_or(Value::Null));
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").filter(|tools| truthy(tools)) {
        chat.insert("tools".into(), Value::Array(chat_tools(tools)?));
        if let Some(choice) = body.get("tool_choice") {
            chat.insert("tool_choice".into(), choice.clone());
        }
    }
    let mut kwargs = match body.get("chat_template_kwargs") {
        Some(Value::Object(kwargs)) => kwargs.clone(),
        _ => Map::new(),
    };
    let effort = body
        .get("reasoning")
        .and_then(Value::as_object)
        .and_then(|reasoning| reasoning.get("effort"))
        .filter(|effort| !effort.is_null());
    if let Some(effort) = effort {
        chat.insert("reasoning_effort".into(), effort.clone());
        kwargs
            .entry("enable_thinking")
            .or_insert_with(|| Value::Bool(effort.as_str() != Some("none")));
    }
    if !kwargs.is_empty() {
        chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
    }
    chat.insert("add_generation_prompt".into(), Value::Bool(!continue_final));
    chat.insert("continue_final_message".into(), Value::Bool(continue_final));
    Some(Value::Object(chat))
}

/// Between a namespace's name and its function's: vLLM shows a namespace's functions to the
/// model flattened (`ns__f`).
const NAMESPACE_SEPARATOR: &str = "__";

/// A responses request's tools as the chat tools vLLM renders (`None`: not covered): a
/// function in the chat shape, a namespace's functions flattened (`ns__f`), a custom tool as a
/// function taking one string `input`; other tools (web search, MCP, ...) are not shown to a
/// model without the Harmony format: left out.
fn chat_tools(tools: &Value) -> Option<Vec<Value>> {
    let mut converted = Vec::new();
    for tool in tools.as_array()? {
        let tool = tool.as_object()?;
        match tool.get("type")?.as_str()? {
            "function" => converted.push(chat_function(tool, None)),
            "namespace" => {
                let namespace = tool.get("name")?.as_str()?;
                for function in tool.get("tools")?.as_array()? {
                    let function = function.as_object()?;
                    let name = function.get("name")?.as_str()?;
                    if function.get("type").and_then(Value::as_str) == Some("function") {
                        let flat = format!("{namespace}{NAMESPACE_SEPARATOR}{name}");
                        converted.push(chat_function(function, Some(flat)));
                    }
                }
            }
            "custom" => {
                let function = Map::from_iter([
                    ("name".to_owned(), tool.get("name").cloned().unwrap_or(Value::Null)),
                    (
                        "description".to_owned(),
                        tool.get("description").cloned().unwrap_or(Value::Null),
                    ),
                    ("parameters".to_owned(), custom_tool_parameters()),
                ]);
                converted.push(Value::Object(Map::from_iter([
                    ("type".to_owned(), Value::from("function")),
                    ("function".to_owned(), Value::Object(function)),
                ])));
            }
            _ => {}
        }
    }
    Some(converted)
}

/// A function tool in the chat shape (`name`, when given, in place of its own).
fn chat_function(tool: &Map<String, Value>, name: Option<String>) -> Value {
    let mut function: Map<String, Value> =
        tool.iter().filter(|(k, _)| *k != "type").map(|(k, v)| (k.clone(), v.clone())).collect();
    if let Some(name) = name {
        function.insert("name".into(), Value::String(name));
    }
    Value::Object(Map::from_iter([
        ("type".to_owned(), Value::from("function")),
        ("function".to_owned(), Value::Object(function)),
    ]))
}

/// The parameters of the function vLLM shows the model for a `custom` tool (its input is one
/// string).
fn custom_tool_parameters() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": ["input"],
        "additionalProperties": false,
    })
}

/// Whether vLLM keeps the response a responses request makes, given the request's `store`
/// (`None`: absent): unless it is false as vLLM's request model reads it (`null`, `false`,
/// `0`, `"no"`, ...). A response not kept has no engine to remember.
///
/// ```
/// use llmsched_gateway::responses::stores_response;
/// use serde_json::json;
/// assert!(stores_response(None) && stores_response(Some(&json!("yes"))));
/// assert!(!stores_response(Some(&json!(false))) && !stores_response(Some(&json!(null))));
/// ```
pub fn stores_response(store: Option<&Value>) -> bool {
    match store {
        None => true,
        Some(Value::Bool(store)) => *store,
        Some(Value::Number(n)) => n.as_f64() == Some(1.0),
        Some(Value::String(s)) => {
            matches!(s.to_lowercase().as_str(), "1" | "on" | "t" | "true" | "y" | "yes")
        }
        Some(_) => false,
    }
}

fn message(role: &str, content: Value) -> Value {
    Value::Object(Map::from_iter([
        ("role".to_owned(), Value::from(role)),
        ("content".to_owned(), content),
    ]))
}

/// Python's truth of a JSON value (`if tools:`).
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|n| n != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Adds one input item to `messages` as vLLM does; `None` when it is not covered.
fn add_item(messages: &mut Vec<Value>, item: &Map<String, Value>) -> Option<()> {
    let field = |name: &str| item.get(name).cloned().unwrap_or(Value::Null);
    let kind = item.get("type");
    // The last message, when it is the assistant's.
    let previous = messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    let call_of = |name: Value, arguments: Value| {
        Value::Object(Map::from_iter([
            ("id".to_owned(), field("call_id")),
            (
                "function".to_owned(),
                Value::Object(Map::from_iter([
                    ("name".to_owned(), name),
                    ("arguments".to_owned(), arguments),
                ])),
            ),
            ("type".to_owned(), Value::from("function")),
        ]))
    };
    let call = match kind.and_then(Value::as_str) {
        Some("function_call") => {
            let name = match item.get("namespace").filter(|n| truthy(n)) {
                Some(namespace) => Value::String(format!(
                    "{}{NAMESPACE_SEPARATOR}{}",
                    namespace.as_str()?,
                    item.get("name")?.as_str()?
                )),
                None => field("name"),
            };
            Some(call_of(name, field("arguments")))
        }
        Some("custom_tool_call") => {
            // vLLM passes a custom tool's input as its function shim's arguments, written as
            // Python's `json.dumps({"input": ...}, ensure_ascii=False)` writes them.
            let input = match item.get("input").filter(|input| truthy(input)) {
                Some(input) => input.as_str()?,
                None => "",
            };
            let arguments = format!("{{\"input\": {}}}", Value::from(input));
            Some(call_of(field("name"), Value::String(arguments)))
        }
        _ => None,
    };
    if let Some(call) = call {
        match previous {
            Some(previous) if previous.get("tool_calls").is_none_or(Value::is_array) => {
                let calls =
                    previous.entry("tool_calls").or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(calls) = calls {
                    calls.push(call);
                }
            }
            _ => messages.push(Value::Object(Map::from_iter([
                ("role".to_owned(), Value::from("assistant")),
                ("tool_calls".to_owned(), Value::Array(vec![call])),
            ]))),
        }
        return Some(());
    }
    match kind.and_then(Value::as_str) {
        Some("function_call_output" | "custom_tool_call_output") => {
            messages.push(Value::Object(Map::from_iter([
                ("role".to_owned(), Value::from("tool")),
                ("content".to_owned(), field("output")),
                ("tool_call_id".to_owned(), field("call_id")),
            ])));
            return Some(());
        }
        Some("reasoning") => {
            let reasoning = reasoning_text(item)?;
            match previous {
                Some(previous) if previous.get("reasoning").is_none_or(Value::is_null) => {
                    previous.insert("reasoning".into(), reasoning);
                }
                _ => messages.push(message_with("reasoning", reasoning)),
            }
            return Some(());
        }
        _ => {}
    }
    if item.get("role").and_then(Value::as_str) == Some("assistant") {
        let text = match item.get("content") {
            Some(Value::String(text)) => Some(Value::String(text.clone())),
            Some(Value::Array(parts)) => parts
                .first()
                .and_then(Value::as_object)
                .and_then(|first| first.get("text"))
                .filter(|text| !text.is_null())
                .cloned(),
            _ => None,
        };
        if let Some(text) = text {
            match previous {
                Some(previous) if previous.get("content").is_none_or(Value::is_null) => {
                    previous.insert("content".into(), text);
                }
                _ => messages.push(message("assistant", text)),
            }
            return Some(());
        }
    }
    let plain_kind = match kind {
        None | Some(Value::Null) => true,
        Some(kind) => kind.as_str() == Some("message"),
    };
    if item.contains_key("role") && plain_kind {
        messages.push(Value::Object(item.clone()));
        return Some(());
    }
    None
}

/// A reasoning item's text as vLLM reads it: its first content part's, else its first
/// summary's, else empty; `None` when not covered (encrypted content, which vLLM refuses, or
/// parts of another shape).
fn reasoning_text(item: &Map<String, Value>) -> Option<Value> {
    if item.get("encrypted_content").is_some_and(truthy) {
        return None;
    }
    let summary = item.get("summary")?.as_array()?;
    let parts = match item.get("content") {
        None | Some(Value::Null) => summary,
        Some(content) => Some(content.as_array()?).filter(|c| !c.is_empty()).unwrap_or(summary),
    };
    match parts.first() {
        None => Some(Value::from("")),
        Some(first) => Some(Value::from(first.as_object()?.get("text")?.as_str()?)),
    }
}

/// An assistant message holding `value` under `field` alone.
fn message_with(field: &str, value: Value) -> Value {
    Value::Object(Map::from_iter([
        ("role".to_owned(), Value::from("assistant")),
        (field.to_owned(), value),
    ]))
}

/// Which engine made each stored response: at most a capacity of ids, least recently used
/// dropped first; ids longer than [`MAX_RESPONSE_ID_BYTES`] (or empty) are not kept. Shared
/// between threads (one lock, held for a map operation).
///
/// It follows the engines configured ([`Owners::engine_joined`], [`Owners::engine_left`]): an
/// engine that leaves keeps its ids for [`OWNER_GRACE`] as [`Holder::Left`] (discovery can
/// drop an engine for a moment while it still holds them; asking the others would only find
/// none), and gets them back if it returns by then; after that they are forgotten. An id
/// answered by an engine no longer configured is not kept.
///
/// ```
/// use llmsched_gateway::responses::{Holder, Owners};
/// let owners = Owners::new(2);
/// owners.engine_joined("e0");
/// owners.engine_joined("e1");
/// owners.record("resp_a", "e0");
/// owners.record("resp_b", "e1");
/// owners.record("resp_c", "e0");
/// assert_eq!(owners.owner("resp_a"), None);
/// assert_eq!(owners.owner("resp_c"), Some(Holder::Engine("e0".into())));
/// owners.engine_left("e0");
/// assert_eq!(owners.owner("resp_c"), Some(Holder::Left("e0".into())));
/// owners.forget_engine("e0");
/// assert_eq!((owners.owner("resp_c"), owners.len()), (None, 1));
/// ```
pub struct Owners {
    capacity: usize,
    grace: Duration,
    inner: Mutex<Lru>,
}

/// Where a stored response is, as far as the gateway knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Made by this engine, which is configured.
    Engine(Arc<str>),
    /// Made by this engine, which left the configuration less than the grace ago.
    Left(Arc<str>),
}

/// How long the ids of an engine that left the configuration are kept for its return.
pub const OWNER_GRACE: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Lru {
    /// id -> (engine, its stamp in `order`).
    map: HashMap<Box<str>, (Arc<str>, u64)>,
    /// Stamps, oldest first, with their ids.
    order: BTreeMap<u64, Box<str>>,
    next: u64,
    /// The engines configured.
    engines: HashSet<Arc<str>>,
    /// Engines that left, with when; their ids go once the grace has passed.
    left: HashMap<Arc<str>, Instant>,
}

impl Lru {
    fn forget(&mut self, engine: &str) {
        let order = &mut self.order;
        self.map.retain(|_, (owner, stamp)| {
            let keep = &**owner != engine;
            if !keep {
                order.remove(stamp);
            }
            keep
        });
    }

    /// Forgets the ids of the engines that left more than `grace` ago.
    fn expire(&mut self, grace: Duration) {
        if self.left.is_empty() {
            return;
        }
        let now = Instant::now();
        let gone: Vec<Arc<str>> = self
            .left
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= grace)
            .map(|(engine, _)| engine.clone())
            .collect();
        for engine in gone {
            self.left.remove(&engine);
            self.forget(&engine);
        }
    }
}

impl Owners {
    /// An empty map keeping at most `capacity` ids, with the grace [`OWNER_GRACE`].
    pub fn new(capacity: usize) -> Owners {
        Owners::with_grace(capacity, OWNER_GRACE)
    }

    /// An empty map keeping at most `capacity` ids, and those of an engine that left for
    /// `grace`.
    pub fn with_grace(capacity: usize, grace: Duration) -> Owners {
        Owners { capacity, grace, inner: Mutex::new(Lru::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        let mut lru = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        lru.expire(self.grace);
        lru
    }

    /// `engine` is configured: one that left within the grace gets its ids back.
    pub fn engine_joined(&self, engine: &str) {
        let mut lru = self.lock();
        lru.left.remove(engine);
        lru.engines.insert(engine.into());
    }

    /// `engine` left the configuration: its ids are [`Holder::Left`] for the grace.
    pub fn engine_left(&self, engine: &str) {
        let mut lru = self.lock();
        if let Some(engine) = lru.engines.take(engine) {
            lru.left.insert(engine, Instant::now());
        }
    }

    /// Forgets every id `engine` made at once (another engine, or this one restarted, now
    /// answers under its name).
    pub fn forget_engine(&self, engine: &str) {
        let mut lru = self.lock();
        lru.left.remove(engine);
        lru.forget(engine);
    }

    /// `engine` made (and stores) `id`; not kept when `engine` is neither configured nor
    /// within its grace (it left while answering).
    pub fn record(&self, id: &str, engine: &str) {
        if id.is_empty() || id.len() > MAX_RESPONSE_ID_BYTES || self.capacity == 0 {
            return;
        }
        let mut lru = self.lock();
        let lru = &mut *lru;
        let Some(engine) =
            lru.engines.get(engine).or_else(|| lru.left.get_key_value(engine).map(|(e, _)| e))
        else {
            return;
        };
        let engine = engine.clone();
        let stamp = lru.next;
        lru.next += 1;
        match lru.map.get_mut(id) {
            Some((owner, old)) => {
                *owner = engine;
                if let Some(key) = lru.order.remove(old) {
                    lru.order.insert(stamp, key);
                }
                *old = stamp;
            }
            None => {
                lru.map.insert(id.into(), (engine, stamp));
                lru.order.insert(stamp, id.into());
                while lru.map.len() > self.capacity {
                    let Some((_, oldest)) = lru.order.pop_first() else { break };
                    lru.map.remove(&oldest);
                }
            }
        }
    }

    /// Where `id` is, or `None` when not known here (a lookup counts as a use).
    pub fn owner(&self, id: &str) -> Option<Holder> {
        let mut lru = self.lock();
        let lru = &mut *lru;
        let stamp = lru.next;
        let (engine, old) = lru.map.get_mut(id)?;
        let holder = if lru.left.contains_key(engine) {
            Holder::Left(engine.clone())
        } else {
            Holder::Engine(engine.clone())
        };
        if let Some(key) = lru.order.remove(old) {
            lru.order.insert(stamp, key);
        }
        *old = stamp;
        lru.next += 1;
        Some(holder)
    }

    /// Ids known (those of engines within their grace included).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether no id is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for Owners {
    fn default() -> Self {
        Owners::new(MAX_OWNERS)
    }
}

#[derive(Deserialize)]
struct WithId<'a> {
    #[serde(borrow, default)]
    id: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Created<'a> {
    #[serde(borrow, default)]
    response: Option<WithId<'a>>,
}

/// `json` when it is an object's text (a derived struct would read an array too).
fn object(json: &[u8]) -> Option<&[u8]> {
    let start = json.iter().position(|b| !b.is_ascii_whitespace())?;
    (json[start] == b'{').then_some(json)
}

/// The top-level `id` of a JSON Responses answer, when it is a string.
pub fn response_id_of(body: &[u8]) -> Option<String> {
    let parsed: WithId<'_> = serde_json::from_slice(object(body)?).ok()?;
    parsed.id.map(std::borrow::Cow::into_owned)
}

/// The response id a Responses event stream announces in its first event
/// (`response.created`: `{"response": {"id": ...}}`), fed the stream frame by frame: read
/// where vLLM writes it, first in the event's data ([`leading_id`]), whatever the event's
/// length, else once the first event has ended (a blank line) within [`FIRST_EVENT_LIMIT`]
/// bytes.
#[derive(Debug, Default)]
pub struct IdScan {
    buffer: Vec<u8>,
    line_ends: LineEnds,
    done: bool,
    /// The id, once found.
    pub id: Option<String>,
}

impl IdScan {
    /// Reads the next bytes of the stream; returns the id when this frame completed it.
    pub fn feed(&mut self, data: &[u8]) -> Option<&str> {
        if self.done {
            return None;
        }
        let data = self.line_ends.to_lf(data);
        let data = &data[..];
        // A blank line split between frames: the last byte before this frame searched too.
        let from = self.buffer.len().saturating_sub(1);
        let searched = self.buffer.len() < LEADING_ID_WITHIN;
        self.buffer.extend_from_slice(data);
        if searched {
            let within = &self.buffer[..self.buffer.len().min(LEADING_ID_WITHIN)];
            if let Some(id) = leading_id(within) {
                self.id = Some(id.to_owned());
                self.done = true;
                self.buffer = Vec::new();
                return self.id.as_deref();
            }
        }
        let Some(end) = memchr::memmem::find(&self.buffer[from..], b"\n\n").map(|at| at + from)
        else {
            if self.buffer.len() > FIRST_EVENT_LIMIT {
                self.done = true;
                self.buffer = Vec::new();
            }
            return None;
        };
        self.done = true;
        let buffer = std::mem::take(&mut self.buffer);
        let mut data = Vec::new();
        for line in buffer[..end].split(|b| *b == b'\n') {
            if let Some(rest) = line.strip_prefix(b"data:") {
                let start = rest.iter().take_while(|b| **b == b' ').count();
                data.extend_from_slice(&rest[start..]);
            }
        }
        let created: Created<'_> = serde_json::from_slice(object(&data)?).ok()?;
        self.id = created.response.and_then(|r| r.id).map(std::borrow::Cow::into_owned);
        self.id.as_deref()
    }
}

/// Bytes of a stream searched for [`leading_id`].
const LEADING_ID_WITHIN: usize = 512;

/// The id where vLLM writes it, first in the first event's data line
/// (`data: {"response":{"id":"resp_..."`, spaces allowed between the tokens): found without
/// reading the rest of the event, which echoes the request's instructions and tools and may
/// run past [`FIRST_EVENT_LIMIT`]. `None` until the id's closing quote is in `data`, and for
/// an id with an escape or longer than [`MAX_RESPONSE_ID_BYTES`].
pub fn leading_id(data: &[u8]) -> Option<&str> {
    // Of the first event only.
    let data = &data[..memchr::memmem::find(data, b"\n\n").unwrap_or(data.len())];
    let line =
        if data.starts_with(b"data:") { 0 } else { memchr::memmem::find(data, b"\ndata:")? + 1 };
    let mut rest = &data[line + b"data:".len()..];
    for token in [&b"{"[..], b"\"response\"", b":", b"{", b"\"id\"", b":", b"\""] {
        let spaces = rest.iter().take_while(|b| matches!(b, b' ' | b'\t' | b'\r')).count();
        rest = rest[spaces..].strip_prefix(token)?;
    }
    let end = rest.iter().position(|b| matches!(b, b'"' | b'\\' | b'\n'))?;
    if rest[end] != b'"' || end == 0 || end > MAX_RESPONSE_ID_BYTES {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok()
}

/// The events that end a Responses stream, each starting a line.
const TERMINAL_EVENTS: [&[u8]; 4] = [
    b"\nevent: response.completed\n",
    b"\nevent: response.incomplete\n",
    b"\nevent: response.failed\n",
    b"\nevent: error\n",
];

static TERMINAL: std::sync::LazyLock<aho_corasick::AhoCorasick> = std::sync::LazyLock::new(|| {
    aho_corasick::AhoCorasick::new(TERMINAL_EVENTS).unwrap_or_else(|_| unreachable!())
});

/// The longest of [`TERMINAL_EVENTS`].
const LONGEST_TERMINAL: usize = 28;

/// Whether a Responses event stream has shown, whole, the event that ends it
/// (`response.completed`, `response.incomplete`, `response.failed` or `error`): its `event:`
/// line at the start of a line, then the blank line (`\n\n`) that closes the event, so that a
/// stream cut inside the terminal event's data is cut. Fed frame by frame, split anywhere. A
/// data field quoting one is no event.
#[derive(Debug)]
pub struct TerminalScan {
    /// The last bytes so far (a newline at the stream's start: its first line starts one).
    tail: Vec<u8>,
    line_ends: LineEnds,
    /// Once the terminal event's line was seen: whether the last byte read was a newline
    /// (the blank line closing the event may be split between frames).
    ending: Option<bool>,
    seen: bool,
}

impl Default for TerminalScan {
    fn default() -> Self {
        TerminalScan {
            tail: b"\n".to_vec(),
            line_ends: LineEnds::default(),
            ending: None,
            seen: false,
        }
    }
}

impl TerminalScan {
    /// Reads the next bytes of the stream, with any of the line ends the SSE spec allows
    /// ([`LineEnds`]).
    pub fn feed(&mut self, data: &[u8]) {
        if self.seen {
            return;
        }
        let data = self.line_ends.to_lf(data);
        self.feed_lines(&data);
    }

    fn feed_lines(&mut self, data: &[u8]) {
        if self.ending.is_some() {
            self.find_end(data);
            return;
        }
        let keep = LONGEST_TERMINAL - 1;
        // Across the boundary: the tail and this frame's first bytes; then the frame.
        let head = data.len().min(keep);
        self.tail.extend_from_slice(&data[..head]);
        if let Some(found) = TERMINAL.find(&self.tail[..]) {
            // What follows the event's line: the rest of the tail, then the frame's rest.
            let after = self.tail.split_off(found.end());
            self.tail = Vec::new();
            // The line ends with a newline: a newline next is the blank line.
            self.ending = Some(true);
            self.find_end(&after);
            self.find_end(&data[head..]);
            return;
        }
        if let Some(found) = TERMINAL.find(data) {
            self.tail = Vec::new();
            self.ending = Some(true);
            self.find_end(&data[found.end()..]);
            return;
        }
        if data.len() >= keep {
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - keep..]);
        } else {
            let old = self.tail.len().saturating_sub(keep);
            self.tail.drain(..old);
        }
    }

    /// Reads bytes after the terminal event's line, for the blank line that ends the event.
    fn find_end(&mut self, data: &[u8]) {
        let Some(newline) = self.ending else { return };
        if self.seen || data.is_empty() {
            return;
        }
        if (newline && data[0] == b'\n') || memchr::memmem::find(data, b"\n\n").is_some() {
            self.seen = true;
            self.ending = None;
            return;
        }
        self.ending = Some(data.last() == Some(&b'\n'));
    }

    /// Whether the terminal event was seen, whole.
    pub fn seen(&self) -> bool {
        self.seen
    }

    /// Whether the terminal event's line was seen and its end is still to come.
    pub fn ending(&self) -> bool {
        self.ending.is_some()
    }
}

/// Whether `data` holds a terminal event line of its own (the end of a stream is near).
pub fn ends_here(data: &[u8]) -> bool {
    TERMINAL.is_match(data)
}

static DELTA: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b".delta\ndata: "));

/// Events of a Responses stream's frame that carry output (`*.delta`: text, reasoning,
/// function arguments), counted as output tokens (vLLM sends one per token by default).
pub fn output_deltas(data: &[u8]) -> u64 {
    let mut count = DELTA.find_iter(data).count();
    if memchr::memchr(b'\r', data).is_some() {
        count += DELTA_CRLF.find_iter(data).count() + DELTA_CR.find_iter(data).count();
    }
    count as u64
}

static DELTA_CRLF: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b".delta\r\ndata: "));

static DELTA_CR: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b".delta\rdata: "));

/// An event stream's line ends made LF, frame by frame, split anywhere: the SSE spec allows
/// CRLF (as `sse-starlette` writes them), a lone CR and LF.
#[derive(Debug, Default)]
pub struct LineEnds {
    /// The last byte read was a CR: an LF first in the next frame belongs to it.
    after_cr: bool,
}

impl LineEnds {
    /// `data`, the stream's next bytes, with each line end as LF (borrowed when it has no CR).
    pub fn to_lf<'a>(&mut self, data: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        let data = self.next(data);
        if memchr::memchr(b'\r', data).is_none() {
            return std::borrow::Cow::Borrowed(data);
        }
        std::borrow::Cow::Owned(crs_to_lf(data))
    }

    /// [`LineEnds::to_lf`] in two steps, for a caller that finds CRs itself (in a pass over
    /// the bytes it makes anyway): `data` without the LF of a CRLF split before it, and the
    /// stream's state moved past it. Where what is returned holds a CR, [`crs_to_lf`] of it is
    /// what [`LineEnds::to_lf`] returns; else the bytes themselves.
    pub fn next<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let data = match data {
            [b'\n', rest @ ..] if self.after_cr => rest,
            _ => data,
        };
        if let Some(&last) = data.last() {
            self.after_cr = last == b'\r';
        }
        data
    }
}

/// `data` with each CR, and each CRLF, made LF (the line ends of [`LineEnds::next`]'s bytes).
pub fn crs_to_lf(data: &[u8]) -> Vec<u8> {
    let mut lf = Vec::with_capacity(data.len());
    let mut rest = data;
    while let Some(at) = memchr::memchr(b'\r', rest) {
        lf.extend_from_slice(&rest[..at]);
        lf.push(b'\n');
        rest = &rest[at + 1..];
        if let [b'\n', after @ ..] = rest {
            rest = after;
        }
    }
    lf.extend_from_slice(rest);
    lf
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    output_tokens: Option<u64>,
}

/// A JSON Responses answer's top-level `usage.output_tokens`, `data` being the whole answer
/// (parsed: the answer echoes the request's `metadata` and tool schemas, which may hold an
/// `output_tokens` key of the client's choosing, before its `usage`). `None` when `data` is
/// no whole JSON object or has no such count.
pub fn usage_output_tokens(data: &[u8]) -> Option<u64> {
    let parsed: WithUsage = serde_json::from_slice(object(data)?).ok()?;
    parsed.usage?.output_tokens
}

/// What a by-id path (`/v1/responses/{id}[/...]`) names: the stored response's id
/// (percent-decoded) and the origin-form path to send its engine.
#[derive(Debug, PartialEq, Eq)]
pub struct ByIdTarget {
    /// The response's id.
    pub id: String,
    /// `/v1/responses/` and the rest of the path as the client sent it (the fixed part
    /// without the escapes it may have had: `/v1/%72esponses/x` is `/v1/responses/x`).
    pub path: String,
}

/// The target of a by-id request's `path` (no query), segment by segment with its escapes
/// decoded; `None` (a 404) when it is no by-id path: not under `/v1/responses/`, an empty or
/// undecodable id, an escaped `/` anywhere, or any segment that is, decoded, `.` or `..` (the
/// engine, or a proxy before it, could read it as another path).
///
/// ```
/// use llmsched_gateway::responses::by_id_target;
/// let target = by_id_target("/v1/%72esponses/resp_1/cancel").unwrap();
/// assert_eq!((target.id.as_str(), target.path.as_str()), ("resp_1", "/v1/responses/resp_1/cancel"));
/// assert!(by_id_target("/v1/responses/resp_1/%2e%2E/models").is_none());
/// ```
pub fn by_id_target(path: &str) -> Option<ByIdTarget> {
    let mut segments = path.split('/');
    let decoded = |segment: &str| -> Option<String> {
        if segment.contains('%') {
            crate::admin::percent_decoded(segment)
        } else {
            Some(segment.to_owned())
        }
    };
    if segments.next() != Some("") {
        return None;
    }
    for fixed in ["v1", "responses"] {
        if decoded(segments.next()?)? != fixed {
            return None;
        }
    }
    let rest: Vec<&str> = segments.collect();
    let escaped_slash = |segment: &&str| segment.contains("%2F") || segment.contains("%2f");
    if rest.iter().any(escaped_slash) {
        return None;
    }
    for segment in &rest {
        if matches!(decoded(segment).as_deref(), Some("." | "..")) {
            return None;
        }
    }
    let id = decoded(rest.first()?)?;
    if id.is_empty() {
        return None;
    }
    Some(ByIdTarget { id, path: format!("/v1/responses/{}", rest.join("/")) })
}

/// `id` as one path segment: every byte but the unreserved ones (RFC 3986) percent-encoded,
/// so that an id holding `/`, `?` or `..` names no other path.
pub fn path_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Value {
        chat_request_of(&body).expect("covered")
    }

    #[test]
    fn instructions_and_a_string_input_are_a_system_and_a_user_message() {
        let out = chat(json!({"model": "m", "instructions": "Be brief.", "input": "Hi"}));
        assert_eq!(
            out,
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ],
                "add_generation_prompt": true,
                "continue_final_message": false,
            })
        );
        // Empty or null instructions add nothing; other types are not covered.
        for instructions in [json!(""), json!(null)] {
            let out = chat(json!({"instructions": instructions, "input": "Hi"}));
            assert_eq!(out["messages"], json!([{"role": "user", "content": "Hi"}]));
        }
        assert!(chat_request_of(&json!({"instructions": 3, "input": "Hi"})).is_none());
    }

    #[test]
    fn an_input_neither_a_string_nor_a_list_is_not_covered() {
        for input in [json!(null), json!(3), json!({"role": "user"})] {
            assert!(chat_request_of(&json!({ "input": input })).is_none(), "{input}");
        }
        assert!(chat_request_of(&json!({})).is_none());
        assert!(chat_request_of(&json!(["not an object"])).is_none());
        // An empty list: no message.
        assert_eq!(chat(json!({"input": []}))["messages"], json!([]));
    }

    #[test]
    fn function_calls_join_the_assistant_message_before_them() {
        let call = |id: &str| json!({"type": "function_call", "call_id": id, "name": "f", "arguments": "{}"});
        let tool_call = |id: &str| json!({"id": id, "function": {"name": "f", "arguments": "{}"}, "type": "function"});
        let out = chat(json!({"input": [
            {"role": "user", "content": "q"},
            call("c1"),
            call("c2"),
            {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            {"type": "function_call_output", "call_id": "c2", "output": "r2"},
            {"role": "assistant", "content": "done"},
            call("c3"),
        ]}));
        assert_eq!(
            out["messages"],
            json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c1"), tool_call("c2")]},
                {"role": "tool", "content": "r1", "tool_call_id": "c1"},
                {"role": "tool", "content": "r2", "tool_call_id": "c2"},
                {"role": "assistant", "content": "done", "tool_calls": [tool_call("c3")]},
            ])
        );
        // An assistant message whose tool_calls is no list gets a message of its own after it.
        let out = chat(
            json!({"input": [{"role": "assistant", "content": null, "tool_calls": "x"}, call("c")]}),
        );
        assert_eq!(
            out["messages"][1],
            json!({"role": "assistant", "tool_calls": [tool_call("c")]})
        );
        // Missing fields are nulls, as vLLM leaves them to its parser.
        let out = chat(json!({"input": [{"type": "function_call_output"}]}));
        assert_eq!(
            out["messages"][0],
            json!({"role": "tool", "content": null, "tool_call_id": null})
        );
        // A namespaced call is named as vLLM shows the model its namespace's functions.
        let namespaced = json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"});
        let out = chat(json!({ "input": [namespaced] }));
        assert_eq!(out["messages"][0]["tool_calls"][0]["function"]["name"], json!("ns__f"));
    }

    #[test]
    fn assistant_text_fills_the_content_of_an_assistant_message_before_it() {
        let out = chat(json!({"input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
            {"role": "assistant", "content": "again"},
        ]}));
        let messages = out["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["content"], json!("a"));
        assert_eq!(messages[0]["tool_calls"][0]["id"], json!("c"));
        assert_eq!(messages[1], json!({"role": "assistant", "content": "again"}));
        // A first part without text: the item is a chat message as it is.
        let item = json!({"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]});
        assert_eq!(chat(json!({ "input": [item.clone()] }))["messages"], json!([item]));
    }

    #[test]
    fn other_items_with_a_role_pass_as_they_are_and_the_rest_is_not_covered() {
        let user = json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]});
        let developer = json!({"role": "developer", "content": "rules"});
        let out = chat(json!({ "input": [developer.clone(), user.clone()] }));
        assert_eq!(out["messages"], json!([developer, user]));
        for item in [
            json!({"type": "reasoning", "summary": [], "encrypted_content": "opaque"}),
            json!({"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}),
            json!({"type": "image_generation_call"}),
            json!({"type": "web_search_call", "role": "user"}),
            json!({"content": "no role"}),
        ] {
            assert!(chat_request_of(&json!({ "input": [item] })).is_none(), "{item}");
        }
    }

    #[test]
    fn reasoning_items_join_the_assistant_message_as_vllm_reads_them() {
        let user = json!({"role": "user", "content": "q"});
        let reasoning = |text: &str| {
            json!({"type": "reasoning", "id": "rs", "summary": [],
                   "content": [{"type": "reasoning_text", "text": text}]})
        };
        let answer = json!({"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "a"}]});
        let call = json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"});
        let out = chat(json!({"input": [
            user.clone(), reasoning("r1"), answer.clone(), reasoning("r2"), call.clone(),
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "reasoning", "summary": []},
        ]}));
        assert_eq!(
            out["messages"],
            json!([
                user,
                {"role": "assistant", "reasoning": "r1", "content": "a"},
                {"role": "assistant", "reasoning": "r2", "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": "{}"}, "type": "function"}
                ]},
                {"role": "assistant", "reasoning": "s"},
                {"role": "assistant", "reasoning": ""},
            ])
        );
    }

    #[test]
    fn custom_and_namespaced_calls_take_the_names_and_arguments_vllm_gives_them() {
        let out = chat(json!({"input": [
            {"type": "custom_tool_call", "call_id": "c1", "name": "sh", "input": "echo \"é\"\n\u{1}"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
            {"type": "function_call", "call_id": "c2", "namespace": "ns", "name": "f", "arguments": "{}"},
            {"type": "custom_tool_call", "call_id": "c3", "name": "sh"},
        ]}));
        let call = |id: &str, name: &str, arguments: &str| json!({"id": id, "function": {"name": name, "arguments": arguments}, "type": "function"});
        assert_eq!(
            out["messages"],
            json!([
                {"role": "assistant", "tool_calls": [call("c1", "sh", "{\"input\": \"echo \\\"é\\\"\\n\\u0001\"}")]},
                {"role": "tool", "content": "ok", "tool_call_id": "c1"},
                {"role": "assistant", "tool_calls": [call("c2", "ns__f", "{}"), call("c3", "sh", "{\"input\": \"\"}")]},
            ])
        );
        for item in [
            json!({"type": "function_call", "namespace": 3, "name": "f"}),
            json!({"type": "custom_tool_call", "name": "sh", "input": 5}),
        ] {
            assert!(chat_request_of(&json!({ "input": [item] })).is_none(), "{item}");
        }
    }

    #[test]
    fn a_response_not_stored_is_one_store_false_as_pydantic_reads_it() {
        for (store, kept) in [
            (json!(true), true),
            (json!(1), true),
            (json!("Yes"), true),
            (json!(false), false),
            (json!(null), false),
            (json!(0), false),
            (json!("off"), false),
            (json!([true]), false),
        ] {
            assert_eq!(stores_response(Some(&store)), kept, "{store}");
        }
        assert!(stores_response(None));
    }

    #[test]
    fn function_tools_take_the_chat_shape_and_others_are_not_covered() {
        let tool = json!({"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true});
        let out = chat(json!({"input": "x", "tools": [tool], "tool_choice": "auto"}));
        assert_eq!(
            out["tools"],
            json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(out["tool_choice"], json!("auto"));
        // No tools: no tool_choice either.
        let out = chat(json!({"input": "x", "tools": [], "tool_choice": "auto"}));
        assert!(out.get("tools").is_none() && out.get("tool_choice").is_none());
        for tools in [json!(["f"]), json!({"type": "function"}), json!([{"name": "untyped"}])] {
            assert!(chat_request_of(&json!({"input": "x", "tools": tools})).is_none(), "{tools}");
        }
        // Namespaces flattened, custom tools as their function shim, the others left out (a
        // model without the Harmony format is not shown them).
        let out = chat(json!({"input": "x", "tools": [
            {"type": "web_search"},
            {"type": "namespace", "name": "ns", "description": "d", "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {"type": "custom", "name": "c"},
            ]},
            {"type": "custom", "name": "sh", "format": {"type": "text"}},
        ]}));
        assert_eq!(
            out["tools"][0],
            json!({"type": "function", "function": {"name": "ns__f", "parameters": {"type": "object"}}})
        );
        assert_eq!(out["tools"][1]["function"]["name"], json!("sh"));
        assert_eq!(out["tools"][1]["function"]["description"], json!(null));
        assert_eq!(out["tools"][1]["function"]["parameters"]["required"], json!(["input"]));
        assert_eq!(out["tools"].as_array().map(Vec::len), Some(2));
        // Only tools left out: an empty list, as vLLM hands the template.
        let out = chat(json!({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]}));
        assert_eq!(out["tools"], json!([]));
    }

    #[test]
    fn reasoning_effort_sets_enable_thinking_unless_the_kwargs_do() {
        let out = chat(json!({"input": "x", "reasoning": {"effort": "high"}}));
        assert_eq!(out["reasoning_effort"], json!("high"));
        assert_eq!(out["chat_template_kwargs"], json!({"enable_thinking": true}));
        let out = chat(json!({"input": "x", "reasoning": {"effort": "none"}}));
        assert_eq!(out["chat_template_kwargs"], json!({"enable_thinking": false}));
        let out = chat(json!({
            "input": "x", "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"enable_thinking": false, "k": 1},
        }));
        assert_eq!(out["chat_template_kwargs"], json!({"enable_thinking": false, "k": 1}));
        let out =
            chat(json!({"input": "x", "reasoning": {"effort": null}, "chat_template_kwargs": 3}));
        assert!(out.get("reasoning_effort").is_none() && out.get("chat_template_kwargs").is_none());
    }

    #[test]
    fn a_last_item_in_progress_is_continued() {
        for (last, continued) in [
            (json!({"role": "assistant", "content": "par", "status": "in_progress"}), true),
            (
                json!({"type": "message", "role": "assistant", "content": "par", "status": "incomplete"}),
                true,
            ),
            (json!({"role": "assistant", "content": "par", "status": "completed"}), false),
            (
                json!({"type": "function_call_output", "call_id": "c", "output": "o", "status": "incomplete"}),
                false,
            ),
            (
                json!({"type": null, "role": "assistant", "content": "par", "status": "incomplete"}),
                false,
            ),
        ] {
            let out = chat(json!({"input": [{"role": "user", "content": "q"}, last.clone()]}));
            assert_eq!(out["continue_final_message"], json!(continued), "{last}");
            assert_eq!(out["add_generation_prompt"], json!(!continued), "{last}");
        }
    }

    fn owners_of(capacity: usize, engines: &[&str]) -> Owners {
        let owners = Owners::new(capacity);
        for engine in engines {
            owners.engine_joined(engine);
        }
        owners
    }

    fn engine(owners: &Owners, id: &str) -> Option<String> {
        match owners.owner(id)? {
            Holder::Engine(engine) => Some(engine.to_string()),
            Holder::Left(engine) => panic!("{id}: {engine} left"),
        }
    }

    #[test]
    fn owners_keep_the_most_recently_used_ids_up_to_their_capacity() {
        let owners = owners_of(3, &["e0", "e1", "e2"]);
        for id in ["a", "b", "c"] {
            owners.record(id, "e0");
        }
        assert_eq!(engine(&owners, "a").as_deref(), Some("e0")); // a is now the newest
        owners.record("d", "e1");
        assert_eq!(owners.len(), 3);
        assert!(owners.owner("b").is_none());
        for id in ["a", "c", "d"] {
            assert!(owners.owner(id).is_some(), "{id}");
        }
        // Recorded again: the engine changes, nothing is added.
        owners.record("a", "e2");
        assert_eq!((engine(&owners, "a").as_deref(), owners.len()), (Some("e2"), 3));
        // Too long or empty: not kept.
        owners.record(&"x".repeat(MAX_RESPONSE_ID_BYTES + 1), "e0");
        owners.record("", "e0");
        assert_eq!(owners.len(), 3);
        owners.record(&"y".repeat(MAX_RESPONSE_ID_BYTES), "e0");
        assert!(owners.owner(&"y".repeat(MAX_RESPONSE_ID_BYTES)).is_some());
        // The bound holds over many ids.
        let owners = owners_of(100, &["e"]);
        for i in 0..1000 {
            owners.record(&format!("resp_{i}"), "e");
        }
        assert_eq!(owners.len(), 100);
        assert!(owners.owner("resp_899").is_none() && owners.owner("resp_900").is_some());
        assert_eq!(owners.lock().order.len(), 100);
    }

    #[test]
    fn owners_forget_an_engine_replaced() {
        let owners = owners_of(MAX_OWNERS, &["e0", "e1"]);
        for i in 0..10 {
            owners.record(&format!("r{i}"), if i % 2 == 0 { "e0" } else { "e1" });
        }
        owners.forget_engine("e0");
        assert_eq!(owners.len(), 5);
        assert!(owners.owner("r0").is_none() && engine(&owners, "r1").as_deref() == Some("e1"));
        assert_eq!(owners.lock().order.len(), 5);
        // Later records still evict in order.
        let owners = owners_of(2, &["e0", "e1"]);
        owners.record("a", "e0");
        owners.record("b", "e1");
        owners.forget_engine("e0");
        owners.record("c", "e1");
        owners.record("d", "e1");
        assert!(owners.owner("b").is_none());
        assert_eq!(owners.len(), 2);
    }

    #[test]
    fn an_engine_that_left_keeps_its_ids_for_the_grace_and_back_in_it_owns_them_again() {
        let owners = Owners::with_grace(MAX_OWNERS, Duration::from_millis(200));
        owners.engine_joined("e0");
        owners.engine_joined("e1");
        owners.record("a", "e0");
        owners.record("b", "e1");
        owners.engine_left("e0");
        assert_eq!(owners.owner("a"), Some(Holder::Left("e0".into())));
        // An answer that ends after its engine left is still its engine's (F13).
        owners.record("c", "e0");
        assert_eq!(owners.owner("c"), Some(Holder::Left("e0".into())));
        owners.engine_joined("e0");
        assert_eq!(engine(&owners, "a").as_deref(), Some("e0"));
        assert_eq!(engine(&owners, "c").as_deref(), Some("e0"));
        // Past the grace its ids are gone, and one answered later is not kept.
        owners.engine_left("e0");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!((owners.owner("a"), owners.len()), (None, 1));
        owners.record("d", "e0");
        owners.record("e", "e9"); // never configured
        assert_eq!((owners.owner("d"), owners.owner("e"), owners.len()), (None, None, 1));
        assert_eq!(owners.lock().order.len(), 1);
        // Back after the grace, it owns none of them.
        owners.engine_joined("e0");
        assert_eq!((owners.owner("a"), engine(&owners, "b").as_deref()), (None, Some("e1")));
    }

    const STREAM: &[u8] = b"event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"},\"sequence_number\":0,\"type\":\"response.created\"}\n\n\
event: response.output_text.delta\ndata: {\"delta\":\"a\",\"type\":\"response.output_text.delta\"}\n\n\
event: response.output_text.delta\ndata: {\"delta\":\"b\",\"type\":\"response.output_text.delta\"}\n\n\
event: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"usage\":{\"output_tokens\":2}},\"type\":\"response.completed\"}\n\n";

    #[test]
    fn the_leading_id_is_read_whatever_the_event_length() {
        let big = [
            &b"event: response.created\ndata: {\"response\":{\"id\":\"resp_big\",\"i\":\""[..],
            &vec![b'x'; 100_000],
            b"\"}}\n\n",
        ]
        .concat();
        for cut in 1..120 {
            // The rest in frames of 4 KiB: the event's end comes past FIRST_EVENT_LIMIT.
            let mut scan = IdScan::default();
            let mut found = scan.feed(&big[..cut]).map(str::to_owned);
            for frame in big[cut..].chunks(4096) {
                found = found.or_else(|| scan.feed(frame).map(str::to_owned));
            }
            assert_eq!(found.as_deref(), Some("resp_big"), "cut at {cut}");
        }
        assert_eq!(leading_id(b"data: { \"response\" : { \"id\" : \"r1\" }"), Some("r1"));
        assert_eq!(leading_id(b"data: {\"response\":{\"id\":\"r1"), None);
        assert_eq!(leading_id(b"data: {\"response\":{\"id\":\"a\\\"b\"}"), None);
        assert_eq!(leading_id(b"data: {\"sequence_number\":0,\"response\":{\"id\":\"r\"}"), None);
        assert_eq!(leading_id(b"event: x\ndata: {}\n\ndata: {\"response\":{\"id\":\"r\"}"), None);
    }

    #[test]
    fn the_id_of_the_first_event_is_found_split_anywhere() {
        for at in 0..=STREAM.len() {
            let mut scan = IdScan::default();
            let first = scan.feed(&STREAM[..at]).map(str::to_owned);
            let second = scan.feed(&STREAM[at..]).map(str::to_owned);
            assert_eq!(first.or(second).as_deref(), Some("resp_1"), "split at {at}");
            assert_eq!(scan.id.as_deref(), Some("resp_1"));
        }
        let mut scan = IdScan::default();
        for byte in STREAM {
            scan.feed(std::slice::from_ref(byte));
        }
        assert_eq!(scan.id.as_deref(), Some("resp_1"));
        // A first event without one (an error), or past the limit: none.
        let mut scan = IdScan::default();
        scan.feed(b"event: error\ndata: {\"type\":\"error\"}\n\nevent: x\ndata: {\"response\":{\"id\":\"r\"}}\n\n");
        assert!(scan.id.is_none());
        let mut scan = IdScan::default();
        scan.feed(&vec![b'a'; FIRST_EVENT_LIMIT + 1]);
        scan.feed(b"\n\ndata: {\"response\":{\"id\":\"r\"}}\n\n");
        assert!(scan.id.is_none());
        assert_eq!(
            response_id_of(br#"{"id": "resp_2", "object": "response"}"#).as_deref(),
            Some("resp_2")
        );
        assert!(response_id_of(br#"{"id": 3}"#).is_none() && response_id_of(b"[\"r\"]").is_none());
    }

    #[test]
    fn a_terminal_event_split_anywhere_is_seen_and_none_is_not() {
        for at in 0..=STREAM.len() {
            let mut scan = TerminalScan::default();
            scan.feed(&STREAM[..at]);
            scan.feed(&STREAM[at..]);
            assert!(scan.seen(), "split at {at}");
        }
        let mut scan = TerminalScan::default();
        for byte in STREAM {
            scan.feed(std::slice::from_ref(byte));
        }
        assert!(scan.seen());
        // Cut anywhere before the blank line closing the terminal event (inside its line,
        // inside its data, between its data line and the blank line): not seen, however the
        // bytes came (two frames split anywhere, or a byte at a time).
        for cut in 0..STREAM.len() {
            let part = &STREAM[..cut];
            for at in 0..=cut {
                let mut scan = TerminalScan::default();
                scan.feed(&part[..at]);
                scan.feed(&part[at..]);
                assert!(!scan.seen(), "cut at {cut}, split at {at}");
            }
            let mut scan = TerminalScan::default();
            for byte in part {
                scan.feed(std::slice::from_ref(byte));
            }
            assert!(!scan.seen(), "cut at {cut}, a byte a frame");
        }
        // Three frames, split at every pair of places.
        for a in 0..=STREAM.len() {
            for b in a..=STREAM.len() {
                let mut scan = TerminalScan::default();
                scan.feed(&STREAM[..a]);
                scan.feed(&STREAM[a..b]);
                scan.feed(&STREAM[b..]);
                assert!(scan.seen(), "split at {a} and {b}");
            }
        }
        // The terminal line seen, its end not yet: ending.
        let mut scan = TerminalScan::default();
        scan.feed(b"event: response.completed\ndata: {\"type\"");
        assert!(scan.ending() && !scan.seen());
        scan.feed(b": 1}\n");
        assert!(scan.ending() && !scan.seen());
        scan.feed(b"\n");
        assert!(!scan.ending() && scan.seen());
        // An event with no data ends at the blank line right after its line.
        let mut scan = TerminalScan::default();
        scan.feed(b"event: error\n");
        scan.feed(b"\n");
        assert!(scan.seen());
        // A blank line before the terminal event is not its end.
        let mut scan = TerminalScan::default();
        scan.feed(b"data: {}\n\nevent: response.failed\ndata: {}\n");
        assert!(!scan.seen());
        // Each terminal event; an error event first of all; a quoted name is no event.
        for event in ["response.incomplete", "response.failed", "error"] {
            let mut scan = TerminalScan::default();
            scan.feed(format!("event: {event}\ndata: {{}}\n\n").as_bytes());
            assert!(scan.seen(), "{event}");
        }
        let mut scan = TerminalScan::default();
        scan.feed(b"data: {\"x\": \"\\nevent: error\\n\"} event: error\n\n");
        assert!(!scan.seen());
    }

    #[test]
    fn a_stream_with_crlf_lines_ends_as_one_with_lf() {
        let stream = b"event: response.created\r\ndata: {}\r\n\r\n\
            event: response.output_text.delta\r\ndata: {}\r\n\r\n\
            event: response.completed\r\ndata: {}\r\n\r\n";
        for cut in 0..stream.len() {
            let mut scan = TerminalScan::default();
            scan.feed(&stream[..cut]);
            scan.feed(&stream[cut..]);
            assert!(scan.seen(), "cut at {cut}");
        }
        let mut scan = TerminalScan::default();
        scan.feed(&stream[..stream.len() - 2]);
        assert!(!scan.seen());
        assert_eq!(output_deltas(stream), 1);
    }

    #[test]
    fn a_stream_with_lone_cr_lines_ends_and_names_its_id_as_one_with_lf() {
        let stream = b"event: response.created\rdata: {\"response\": {\"id\": \"resp_cr\"}}\r\r\
            event: response.output_text.delta\rdata: {}\r\r\
            event: response.completed\rdata: {}\r\r";
        for cut in 0..stream.len() {
            let mut scan = TerminalScan::default();
            scan.feed(&stream[..cut]);
            scan.feed(&stream[cut..]);
            assert!(scan.seen(), "cut at {cut}");
            let mut ids = IdScan::default();
            ids.feed(&stream[..cut]);
            ids.feed(&stream[cut..]);
            assert_eq!(ids.id.as_deref(), Some("resp_cr"), "cut at {cut}");
        }
        let mut scan = TerminalScan::default();
        scan.feed(&stream[..stream.len() - 1]);
        assert!(!scan.seen());
        assert_eq!(output_deltas(stream), 1);
    }

    #[test]
    fn line_ends_are_lf_whatever_the_frames() {
        let stream = b"a\r\nb\rc\n\r\r\n\rd";
        for cut in 0..=stream.len() {
            let mut ends = LineEnds::default();
            let mut lf = ends.to_lf(&stream[..cut]).into_owned();
            lf.extend_from_slice(&ends.to_lf(b""));
            lf.extend_from_slice(&ends.to_lf(&stream[cut..]));
            assert_eq!(lf, b"a\nb\nc\n\n\n\nd", "cut at {cut}");
        }
    }

    #[test]
    fn output_tokens_are_delta_events_or_the_usage() {
        assert_eq!(output_deltas(STREAM), 2);
        assert_eq!(
            usage_output_tokens(br#"{"usage":{"input_tokens":5,"output_tokens_details":{"reasoning_tokens":0},"output_tokens": 7}}"#),
            Some(7)
        );
        assert_eq!(usage_output_tokens(b"{}"), None);
        // The top-level usage's, whatever comes before it (echoed metadata, tool schemas).
        let answer = br#"{"id": "resp_1", "metadata": {"output_tokens": 0},
            "tools": [{"type": "function", "name": "f", "parameters": {"properties": {"output_tokens": {"type": "integer"}}}}],
            "output": [{"content": [{"text": "\"output_tokens\": 1"}]}],
            "usage": {"input_tokens": 3, "output_tokens": 500, "total_tokens": 503}}"#;
        assert_eq!(usage_output_tokens(answer), Some(500));
        let nested = br#"{"response": {"usage": {"output_tokens": 4}}, "usage": null}"#;
        assert_eq!(usage_output_tokens(nested), None);
        // Cut, or not an object: none.
        assert_eq!(usage_output_tokens(&answer[..answer.len() - 1]), None);
        assert_eq!(usage_output_tokens(br#"[{"usage": {"output_tokens": 4}}]"#), None);
        assert_eq!(usage_output_tokens(br#"{"usage": {"output_tokens": "4"}}"#), None);
        // Numbers past f64's range elsewhere do not stop it.
        assert_eq!(
            usage_output_tokens(br#"{"metadata": {"n": 1e400}, "usage": {"output_tokens": 2}}"#),
            Some(2)
        );
    }

    #[test]
    fn an_id_is_one_path_segment() {
        assert_eq!(path_segment("resp_1a-B.~"), "resp_1a-B.~");
        assert_eq!(path_segment("../models?x=1 é"), "..%2Fmodels%3Fx%3D1%20%C3%A9");
        assert!(format!("/v1/responses/{}", path_segment("a/b\n\0")).parse::<hyper::Uri>().is_ok());
    }

    #[test]
    fn a_by_id_path_names_its_id_and_the_path_sent_on() {
        let target = |path: &str| by_id_target(path).map(|t| (t.id, t.path));
        let own = |id: &str, path: &str| Some((id.to_owned(), path.to_owned()));
        assert_eq!(target("/v1/responses/resp_1"), own("resp_1", "/v1/responses/resp_1"));
        assert_eq!(
            target("/v1/responses/resp_1/cancel"),
            own("resp_1", "/v1/responses/resp_1/cancel")
        );
        // Escapes: decoded in the id, kept in the path sent on; the fixed part's are read.
        assert_eq!(target("/v1/responses/resp%5F1"), own("resp_1", "/v1/responses/resp%5F1"));
        assert_eq!(
            target("/v1/%72esponses/resp_1/input_items"),
            own("resp_1", "/v1/responses/resp_1/input_items")
        );
        assert_eq!(target("/%76%31/RESPONSES/resp_1"), None);
        assert_eq!(target("/%76%31/responses/r"), own("r", "/v1/responses/r"));
        for path in [
            "/v1/responses/",
            "/v1/responses//cancel",
            "/v1/responses",
            "/v1/responsesx/r",
            "v1/responses/r",
            "/v2/responses/r",
            // An escaped slash, in the id or anywhere.
            "/v1/responses/resp_1%2Fx",
            "/v1/responses/resp_1/a%2fb",
            "/v1%2Fresponses/r",
            // Dot segments, escaped or not, anywhere.
            "/v1/responses/..",
            "/v1/responses/.",
            "/v1/responses/resp_1/../../../metrics",
            "/v1/responses/resp_1/./cancel",
            "/v1/responses/resp_1/%2e%2E/x",
            "/v1/responses/%2e",
            "/v1/responses/resp_1/cancel/..",
            // Not UTF-8 once decoded.
            "/v1/responses/%FF%FE",
        ] {
            assert_eq!(target(path), None, "{path}");
        }
        // Dots that are no dot segment.
        assert_eq!(target("/v1/responses/.../x"), own("...", "/v1/responses/.../x"));
        assert_eq!(target("/v1/responses/r/..x"), own("r", "/v1/responses/r/..x"));
    }
}
