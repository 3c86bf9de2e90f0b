//! Response assembly for token slices: one OpenAI-style request cut into per-slice continuation
//! calls, and their streamed chunks stitched back into one response.
//!
//! `llmsched.SliceAssembler` (Python) and the native data plane both run this one
//! implementation; the Python class documents the request fields it relies on.
//!
//! # Algorithm
//!
//! Each slice's call is the user's request with `max_tokens = min(slice, remaining)`,
//! `stream` on with usage, and the prompt continued by the output so far: token ids appended
//! (`return_token_ids`) or text appended for a completion, a final assistant message continued
//! (`continue_final_message`) for a chat. A request's integer `seed` goes to the first slice
//! as given and to each continuation as a seed derived from it and the tokens generated so
//! far, so that no slice replays another's random draws. Engine chunks' text is released to the user as it
//! comes, except the last `max(len(stop)) - 1` characters, held back until the next text (or
//! the end) shows whether a stop string straddles the boundary; the first stop occurrence to
//! end (ties: the stop listed first) ends the response. With `min_tokens`, as vLLM checks stop
//! strings only once `min_tokens` are generated, an occurrence counts only where it ends after
//! the text of the first `min_tokens` tokens: a request with stop strings gets a slice
//! boundary there (its slices are cut short to reach it), where that text is known exactly.
//! Text positions are counted in
//! characters (Unicode scalar values), as Python's `str` counts them, so both planes cut the
//! same text at the same places. Every step is linear in the text it adds, except the stop
//! search, which rescans at most the held-back tail plus the new text.

use serde_json::{json, Map, Value};
use thiserror::Error;

/// Why an assembler refused a request or a step. Nothing changes on a refusal except where
/// [`SliceAssembler::end_slice`] says so.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AssemblyError {
    /// The request cannot be sliced (`n > 1`, `logprobs`, batched prompts, no budget, ...).
    #[error("{0}")]
    Unsupported(String),
    /// A call out of order, or an engine stream the assembler cannot continue from.
    #[error("{0}")]
    State(String),
    /// An argument or an engine chunk field of the wrong type.
    #[error("{0}")]
    Type(String),
    /// An argument or an engine chunk field out of range.
    #[error("{0}")]
    Value(String),
}

/// Which OpenAI API a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// What a response is made of besides the request.
#[derive(Debug, Clone, PartialEq)]
pub struct AssemblerOptions {
    /// The response id (None: the first engine chunk's).
    pub response_id: Option<String>,
    /// The creation time (None: the first engine chunk's).
    pub created: Option<i64>,
    /// The budget of a request without `max_tokens`.
    pub default_max_tokens: Option<u64>,
    /// Whether `stop` is sent to the engine (it may then stop early within a slice).
    pub forward_stop: bool,
}

impl Default for AssemblerOptions {
    fn default() -> Self {
        AssemblerOptions {
            response_id: None,
            created: None,
            default_max_tokens: None,
            forward_stop: true,
        }
    }
}

/// Token usage of a sliced response (see `llmsched.SliceUsage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceUsage {
    /// The user's prompt, counted once.
    pub prompt_tokens: i64,
    /// Output tokens over every slice.
    pub completion_tokens: i64,
    /// Their sum.
    pub total_tokens: i64,
    /// Slices ended.
    pub slices: i64,
    /// Prompt tokens of continuation slices beyond the user's.
    pub resent_prompt_tokens: i64,
    /// Those of them the engine prefilled again.
    pub recomputed_prompt_tokens: i64,
}

impl SliceUsage {
    /// The OpenAI `usage` object, with the slice figures under `slice_details`.
    pub fn as_openai(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "slice_details": {
                "slices": self.slices,
                "resent_prompt_tokens": self.resent_prompt_tokens,
                "recomputed_prompt_tokens": self.recomputed_prompt_tokens,
            },
        })
    }
}

const U32_MAX: u64 = u32::MAX as u64;
const UNSUPPORTED: [&str; 4] = ["echo", "logprobs", "top_logprobs", "suffix"];
/// The fields of vLLM's structured output (current and former names).
const STRUCTURED_OUTPUT_FIELDS: [&str; 7] = [
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "structural_tag",
];

/// Python's truthiness of a JSON value.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A JSON integer (not a float, not a bool), as Python's `isinstance(v, int)` reads JSON.
fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) if n.is_i64() || n.is_u64() => n.as_i64().or(Some(i64::MAX)),
        _ => None,
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

/// The byte offset `n` characters before `at` in `text` (0 at the start).
fn chars_back(text: &str, at: usize, n: usize) -> usize {
    if n == 0 {
        return at;
    }
    text[..at].char_indices().rev().nth(n - 1).map_or(0, |(i, _)| i)
}

/// The bits of an integer `seed` (a negative one as its two's complement); None for anything
/// else, which is sent on as given for the engine to judge.
fn seed_bits(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64().or_else(|| n.as_i64().map(|v| v as u64)),
        _ => None,
    }
}

/// The seed of the continuation that starts after `generated` tokens of a request seeded with
/// `seed`: splitmix64 of the two, in `0..2**63` (vLLM takes a signed 64-bit seed).
///
/// vLLM seeds a generator of the request's own with its `seed`, so a continuation sent the
/// user's seed would replay the first slice's random draws at every slice start: the tokens
/// at the same offset of every slice would be drawn from one noise, correlated across
/// boundaries as no unsliced run is. A seed of its own per continuation, fixed by the request's
/// seed and where the slice starts, keeps a sliced run deterministic and its draws fresh.
fn continuation_seed(seed: u64, generated: u64) -> u64 {
    let mut z =
        (seed ^ generated.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) >> 1
}

/// One sliced request's continuation calls and its stitched response.
#[derive(Debug, Clone)]
pub struct SliceAssembler {
    api: Api,
    request: Map<String, Value>,
    prompt_ids: Option<Vec<u32>>,
    prompt_text: Option<String>,
    messages: Vec<Value>,
    max_tokens: u64,
    stops: Vec<String>,
    /// Characters held back for a stop string straddling a boundary.
    holdback: usize,
    include_stop: bool,
    forward_stop: bool,
    include_usage: bool,
    id: Option<String>,
    created: Option<i64>,
    model: Value,
    generated_ids: Vec<u32>,
    /// Everything generated, as the engine produced it.
    text: String,
    /// Bytes of `text` sent to the user.
    emitted: usize,
    /// No stop string ends before this byte of `text`.
    scanned: usize,
    /// The request's `min_tokens` (0: none).
    min_tokens: u64,
    /// Stop strings count only where they end after this byte of `text`: the text of the
    /// first `min_tokens` tokens (vLLM checks stop strings only once `min_tokens` are
    /// generated); `usize::MAX` while the slice running lies wholly within them.
    stop_floor: usize,
    generated_tokens: u64,
    slices: u64,
    user_prompt_tokens: Option<i64>,
    resent: i64,
    recomputed: i64,
    finish_reason: Option<Value>,
    stop_reason: Option<String>,
    /// The stop token id that ended the response (vLLM's `stop_reason` for `stop_token_ids`).
    stop_token: Option<Value>,
    sent_role: bool,
    in_slice: bool,
    slice_max: u64,
    slice_resent: usize,
    slice_ids: Vec<u32>,
    /// Choices the engine streamed in the slice in progress (vLLM sends one token each).
    slice_events: u64,
    slice_usage: Option<Map<String, Value>>,
    slice_finish: Option<Value>,
    slice_stop_reason: Value,
    last_slice_tokens: u64,
}

impl SliceAssembler {
    /// An assembler for `request` (a JSON object); [`AssemblyError::Unsupported`] when it
    /// cannot be sliced.
    pub fn new(
        request: &Value,
        api: Api,
        options: AssemblerOptions,
    ) -> Result<SliceAssembler, AssemblyError> {
        let Some(request) = request.as_object() else {
            let kind = type_name(request);
            return Err(AssemblyError::Unsupported(format!(
                "request must be a mapping, got {kind}"
            )));
        };
        let mut asm = SliceAssembler {
            api,
            request: request.clone(),
            prompt_ids: None,
            prompt_text: None,
            messages: Vec::new(),
            max_tokens: 0,
            stops: Vec::new(),
            holdback: 0,
            include_stop: request.get("include_stop_str_in_output").is_some_and(truthy),
            forward_stop: options.forward_stop,
            include_usage: request
                .get("stream_options")
                .and_then(Value::as_object)
                .and_then(|o| o.get("include_usage"))
                .is_some_and(truthy),
            id: options.response_id,
            created: options.created,
            model: request.get("model").cloned().unwrap_or(Value::Null),
            generated_ids: Vec::new(),
            text: String::new(),
            emitted: 0,
            scanned: 0,
            min_tokens: 0,
            stop_floor: 0,
            generated_tokens: 0,
            slices: 0,
            user_prompt_tokens: None,
            resent: 0,
            recomputed: 0,
            finish_reason: None,
            stop_reason: None,
            stop_token: None,
            sent_role: false,
            in_slice: false,
            slice_max: 0,
            slice_resent: 0,
            slice_ids: Vec::new(),
            slice_events: 0,
            slice_usage: None,
            slice_finish: None,
            slice_stop_reason: Value::Null,
            last_slice_tokens: 0,
        };
        asm.check_supported()?;
        match api {
            Api::Completions => asm.read_prompt()?,
            Api::Chat => asm.read_messages()?,
        }
        asm.max_tokens = asm.read_budget(options.default_max_tokens)?;
        asm.min_tokens = asm.read_min_tokens()?;
        asm.stops = asm.read_stops()?;
        asm.holdback = asm.stops.iter().map(|s| s.chars().count()).max().unwrap_or(1) - 1;
        Ok(asm)
    }

    fn check_supported(&self) -> Result<(), AssemblyError> {
        for name in ["n", "best_of"] {
            let one = match self.request.get(name) {
                None | Some(Value::Null) | Some(Value::Bool(true)) => true,
                Some(Value::Number(n)) => n.as_f64() == Some(1.0),
                Some(_) => false,
            };
            if !one {
                let value = &self.request[name];
                return Err(AssemblyError::Unsupported(format!(
                    "{name}={value} is not supported across slices (use 1)"
                )));
            }
        }
        self.check_output_unconstrained()?;
        for name in UNSUPPORTED {
            // Python's `value not in (None, False)`: 0 is False there, "" and [] are not.
            let off = |v: &Value| match v {
                Value::Null | Value::Bool(false) => true,
                Value::Number(n) => n.as_f64() == Some(0.0),
                _ => false,
            };
            if self.request.get(name).is_some_and(|v| !off(v)) {
                return Err(AssemblyError::Unsupported(format!(
                    "{name} is not supported across slices"
                )));
            }
        }
        Ok(())
    }

    /// Requests whose answer a continuation would change, beyond what sampling does: the
    /// engine applies each of these to every slice as a request of its own.
    /// - `truncate_prompt_tokens`: a continuation's prompt holds the output so far, so the
    ///   engine would cut the kept prompt (and then early output) away;
    /// - structured output (`response_format` other than text, `structured_outputs`, vLLM's
    ///   `guided_*` fields) and tool calling (`tools` with a `tool_choice` other than
    ///   `"none"`): the grammar and the tool parser start again on each slice's output;
    /// - `stream_options.continuous_usage_stats`: usage in every event, which slices do not
    ///   report.
    fn check_output_unconstrained(&self) -> Result<(), AssemblyError> {
        let set = |name: &str| self.request.get(name).is_some_and(|v| !v.is_null());
        let unsupported = |what: &str| {
            Err(AssemblyError::Unsupported(format!("{what} is not supported across slices")))
        };
        if set("truncate_prompt_tokens") {
            return unsupported("truncate_prompt_tokens");
        }
        let response_format = self.request.get("response_format").filter(|v| !v.is_null());
        if response_format.is_some_and(|f| f.get("type") != Some(&Value::from("text"))) {
            return unsupported("response_format");
        }
        for name in STRUCTURED_OUTPUT_FIELDS {
            if set(name) {
                return unsupported(name);
            }
        }
        let tools =
            self.request.get("tools").is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        let choice_none = self.request.get("tool_choice") == Some(&Value::from("none"));
        if tools && !choice_none {
            return unsupported("tool calling (tools without tool_choice \"none\")");
        }
        let continuous = self
            .request
            .get("stream_options")
            .and_then(|o| o.get("continuous_usage_stats"))
            .is_some_and(truthy);
        if continuous {
            return unsupported("stream_options.continuous_usage_stats");
        }
        Ok(())
    }

    fn read_prompt(&mut self) -> Result<(), AssemblyError> {
        let mut prompt = self.request.get("prompt").unwrap_or(&Value::Null);
        if let Value::Array(items) = prompt {
            if items.len() == 1 && (items[0].is_array() || items[0].is_string()) {
                prompt = &items[0];
            }
        }
        match prompt {
            Value::String(text) => {
                self.prompt_text = Some(text.clone());
                return Ok(());
            }
            Value::Array(items) => {
                let ids: Option<Vec<u32>> = items
                    .iter()
                    .map(|t| match t {
                        Value::Number(n) => n.as_u64().and_then(|v| u32::try_from(v).ok()),
                        _ => None,
                    })
                    .collect();
                if let Some(ids) = ids {
                    self.user_prompt_tokens = Some(ids.len() as i64);
                    self.prompt_ids = Some(ids);
                    return Ok(());
                }
            }
            _ => {}
        }
        Err(AssemblyError::Unsupported(
            "prompt must be one string or one list of token ids (0..2**32-1); \
             batched prompts are not sliced"
                .into(),
        ))
    }

    fn read_messages(&mut self) -> Result<(), AssemblyError> {
        let messages = match self.request.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => m.clone(),
            _ => {
                return Err(AssemblyError::Unsupported("messages must be a non-empty list".into()))
            }
        };
        for (i, message) in messages.iter().enumerate() {
            if !message.as_object().is_some_and(|m| m.contains_key("role")) {
                return Err(AssemblyError::Unsupported(format!(
                    "messages[{i}] must be a mapping with a role"
                )));
            }
        }
        let continued = self.request.get("continue_final_message").is_some_and(truthy);
        let last_text =
            messages.last().and_then(|m| m.get("content")).is_some_and(Value::is_string);
        if continued && !last_text {
            return Err(AssemblyError::Unsupported(
                "continue_final_message needs a final message with text content".into(),
            ));
        }
        self.messages = messages;
        Ok(())
    }

    fn read_budget(&self, default: Option<u64>) -> Result<u64, AssemblyError> {
        let keys: &[&str] = match self.api {
            Api::Chat => &["max_completion_tokens", "max_tokens"],
            Api::Completions => &["max_tokens"],
        };
        let given = keys.iter().find_map(|k| self.request.get(*k).filter(|v| !v.is_null()));
        let budget = match (given, default) {
            (Some(value), _) => match value {
                Value::Number(_) if int(value).is_some() => int(value).unwrap_or(0),
                other => {
                    return Err(AssemblyError::Type(format!(
                        "max_tokens must be an int, got {}",
                        type_name(other)
                    )))
                }
            },
            (None, Some(default)) => i64::try_from(default).unwrap_or(i64::MAX),
            (None, None) => {
                return Err(AssemblyError::Unsupported(format!(
                    "the request has no {} and no default_max_tokens was given",
                    keys.join(" or ")
                )))
            }
        };
        if !(1..=U32_MAX as i64).contains(&budget) {
            return Err(AssemblyError::Value(format!(
                "max_tokens must be in 1..{U32_MAX}, got {budget}"
            )));
        }
        Ok(budget as u64)
    }

    /// `min_tokens`, an int in `0..=max_tokens`; any other value is the engine's to judge, on
    /// the request unsliced (a continuation would change or hide it).
    fn read_min_tokens(&self) -> Result<u64, AssemblyError> {
        let Some(value) = self.request.get("min_tokens").filter(|v| !v.is_null()) else {
            return Ok(0);
        };
        match int(value).and_then(|m| u64::try_from(m).ok()) {
            Some(m) if m <= self.max_tokens => Ok(m),
            _ => Err(AssemblyError::Unsupported(format!(
                "min_tokens={value} is not an int in 0..={}; the request is not sliced",
                self.max_tokens
            ))),
        }
    }

    fn read_stops(&self) -> Result<Vec<String>, AssemblyError> {
        let bad = || {
            AssemblyError::Unsupported("stop must be a non-empty string or a list of them".into())
        };
        match self.request.get("stop") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) if !s.is_empty() => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().filter(|s| !s.is_empty()).map(str::to_owned))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(bad),
            Some(_) => Err(bad()),
        }
    }

    /// Which API the request belongs to.
    pub fn api(&self) -> Api {
        self.api
    }

    /// Whether the response is complete (no further slice is needed).
    pub fn done(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// The finish reason once done (`stop`, `length` or the engine's other reason).
    pub fn finish_reason(&self) -> Option<&Value> {
        self.finish_reason.as_ref()
    }

    /// The stop string that ended the response, if one did.
    pub fn stop_reason(&self) -> Option<&str> {
        self.stop_reason.as_deref()
    }

    /// Output tokens generated over all slices.
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens
    }

    /// Output tokens the engine produced so far: those of the ended slices
    /// ([`generated_tokens`](Self::generated_tokens)) and those of the slice in progress
    /// streamed so far (its token ids, its usage when sent, else one token per streamed
    /// choice, as the unsliced path counts a stream). What a client leaving mid-slice is
    /// charged for.
    pub fn produced_tokens(&self) -> u64 {
        if !self.in_slice {
            return self.generated_tokens;
        }
        let reported = self.slice_usage.as_ref().and_then(|u| u.get("completion_tokens"));
        let reported = reported.and_then(int).map_or(0, |n| n.clamp(0, self.slice_max as i64));
        let current = (self.slice_ids.len() as u64).max(self.slice_events).max(reported as u64);
        self.generated_tokens + current.min(self.slice_max)
    }

    /// Output token ids over all slices, when the engine returned them.
    pub fn generated_token_ids(&self) -> &[u32] {
        &self.generated_ids
    }

    /// Output tokens the user's budget still allows.
    pub fn remaining_tokens(&self) -> u64 {
        self.max_tokens - self.generated_tokens
    }

    /// The response text released to the user so far.
    pub fn text(&self) -> &str {
        &self.text[..self.emitted]
    }

    /// Tokens the engine generated in the slice just ended.
    pub fn last_slice_tokens(&self) -> u64 {
        self.last_slice_tokens
    }

    /// The prompt tokens of the user's request when known: its token ids, else the first
    /// slice's reported `prompt_tokens`.
    pub fn user_prompt_tokens(&self) -> Option<i64> {
        self.user_prompt_tokens
    }

    /// Usage so far: the user's prompt once, re-sent and recomputed prompts apart.
    pub fn usage(&self) -> SliceUsage {
        let prompt = self.user_prompt_tokens.unwrap_or(0);
        let completion = self.generated_tokens as i64;
        SliceUsage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            slices: self.slices as i64,
            resent_prompt_tokens: self.resent,
            recomputed_prompt_tokens: self.recomputed,
        }
    }

    /// The engine request of the next slice, of at most `slice_tokens` tokens. Building it
    /// twice before feeding gives the same request.
    pub fn next_request(&mut self, slice_tokens: u64) -> Result<Value, AssemblyError> {
        if self.done() {
            return Err(AssemblyError::State("the response is complete; no further slice".into()));
        }
        if !(1..=U32_MAX).contains(&slice_tokens) {
            return Err(AssemblyError::Value(format!(
                "slice_tokens must be in 1..{U32_MAX}, got {slice_tokens}"
            )));
        }
        let mut body = self.request.clone();
        body.remove("max_completion_tokens");
        let mut max_tokens = slice_tokens.min(self.remaining_tokens());
        let min_left = self.min_tokens.saturating_sub(self.generated_tokens);
        if min_left > 0 && !self.stops.is_empty() {
            // The slice ends where `min_tokens` is reached: the text before that point is then
            // known exactly, and no stop string may end within it.
            max_tokens = max_tokens.min(min_left);
            self.stop_floor = usize::MAX;
        }
        body.insert("max_tokens".into(), max_tokens.into());
        body.insert("stream".into(), true.into());
        body.insert("stream_options".into(), json!({"include_usage": true}));
        if !self.forward_stop {
            body.remove("stop");
        }
        if self.min_tokens > 0 {
            body.insert("min_tokens".into(), min_left.min(max_tokens).into());
        }
        if self.generated_tokens > 0 {
            if let Some(seed) = self.request.get("seed").and_then(seed_bits) {
                body.insert("seed".into(), continuation_seed(seed, self.generated_tokens).into());
            }
        }
        match self.api {
            Api::Completions => match &self.prompt_ids {
                Some(ids) => {
                    let prompt: Vec<u32> = ids.iter().chain(&self.generated_ids).copied().collect();
                    body.insert("prompt".into(), prompt.into());
                    body.insert("return_token_ids".into(), true.into());
                }
                None => {
                    let text =
                        format!("{}{}", self.prompt_text.as_deref().unwrap_or(""), self.text);
                    body.insert("prompt".into(), text.into());
                }
            },
            Api::Chat if self.generated_tokens > 0 => {
                body.insert("messages".into(), self.continued_messages());
                body.insert("continue_final_message".into(), true.into());
                body.insert("add_generation_prompt".into(), false.into());
            }
            Api::Chat => {}
        }
        self.slice_max = max_tokens;
        self.slice_resent = self.generated_ids.len();
        self.in_slice = true;
        self.slice_ids.clear();
        self.slice_events = 0;
        self.slice_usage = None;
        self.slice_finish = None;
        self.slice_stop_reason = Value::Null;
        Ok(Value::Object(body))
    }

    fn continued_messages(&self) -> Value {
        let mut messages = self.messages.clone();
        if self.request.get("continue_final_message").is_some_and(truthy) {
            if let Some(Value::Object(last)) = messages.last_mut() {
                let content = last.get("content").and_then(Value::as_str).unwrap_or("");
                let joined = format!("{content}{}", self.text);
                last.insert("content".into(), joined.into());
            }
        } else {
            messages.push(json!({"role": "assistant", "content": self.text}));
        }
        Value::Array(messages)
    }

    /// Takes one streamed engine chunk of the current slice; returns the user-facing chunks.
    pub fn feed(&mut self, chunk: &Value) -> Result<Vec<Value>, AssemblyError> {
        if !self.in_slice {
            return Err(AssemblyError::State(
                "feed() before next_request() or after end_slice()".into(),
            ));
        }
        let Some(chunk) = chunk.as_object() else {
            return Err(AssemblyError::Type(format!(
                "chunk must be a mapping, got {}",
                type_name(chunk)
            )));
        };
        let empty = Vec::new();
        let choices = match chunk.get("choices") {
            Some(Value::Array(choices)) => choices,
            Some(other) if truthy(other) => {
                return Err(AssemblyError::Value("engine chunk's choices is not a list".into()))
            }
            _ => &empty,
        };
        // Checked whole before anything changes.
        let mut parsed = Vec::with_capacity(choices.len());
        for choice in choices {
            let Some(choice) = choice.as_object() else {
                return Err(AssemblyError::Value(
                    "engine chunk has a choice that is not an object".into(),
                ));
            };
            let index = choice.get("index").map_or(Some(0.0), Value::as_f64);
            if index != Some(0.0) {
                return Err(AssemblyError::Value(
                    "engine chunk has a choice index other than 0".into(),
                ));
            }
            let ids = match choice.get("token_ids") {
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| {
                        AssemblyError::Value(
                            "engine chunk has token_ids that are not token ids".into(),
                        )
                    })?,
                Some(other) if truthy(other) => {
                    return Err(AssemblyError::Value(
                        "engine chunk has token_ids that are not token ids".into(),
                    ))
                }
                _ => Vec::new(),
            };
            parsed.push((choice, ids));
        }
        if self.id.is_none() {
            self.id = chunk.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        if self.created.is_none() {
            self.created = chunk.get("created").and_then(int);
        }
        if self.model.is_null() {
            if let Some(model) = chunk.get("model").filter(|m| m.is_string()) {
                self.model = model.clone();
            }
        }
        if let Some(Value::Object(usage)) = chunk.get("usage").filter(|u| truthy(u)) {
            self.slice_usage = Some(usage.clone());
        }
        let mut out = Vec::new();
        for (choice, ids) in parsed {
            self.slice_events += 1;
            self.slice_ids.extend(ids);
            if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
                self.slice_finish = Some(reason.clone());
                self.slice_stop_reason = choice.get("stop_reason").cloned().unwrap_or(Value::Null);
            }
            if self.done() {
                continue; // a stop string already ended the response: the rest is dropped
            }
            let piece = match self.api {
                Api::Completions => choice.get("text"),
                Api::Chat => choice.get("delta").and_then(|d| d.get("content")),
            };
            if let Some(piece) = piece.and_then(Value::as_str).filter(|p| !p.is_empty()) {
                self.text.push_str(piece);
                out.extend(self.release(false));
            }
        }
        Ok(out)
    }

    /// Emits what is safe: up to a stop string found, or all but the held-back tail.
    fn release(&mut self, last: bool) -> Vec<Value> {
        let start = chars_back(&self.text, self.scanned, self.holdback);
        let mut best: Option<(usize, usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if self.stop_floor == usize::MAX {
                break; // the text so far is within the first `min_tokens` tokens
            }
            // An occurrence counts only where it ends after the floor.
            let mut from = start.max((self.stop_floor + 1).saturating_sub(stop.len()));
            while !self.text.is_char_boundary(from) {
                from += 1;
            }
            if let Some(at) = self.text[from..].find(stop.as_str()) {
                let at = from + at;
                let end = at + stop.len();
                if best.is_none_or(|(_, e, _)| end < e) {
                    best = Some((at, end, i));
                }
            }
        }
        if let Some((at, end, i)) = best {
            let cut = if self.include_stop { end } else { at };
            let chunks = self.emit_upto(cut);
            self.finish_reason = Some("stop".into());
            self.stop_reason = Some(self.stops[i].clone());
            return chunks;
        }
        self.scanned = self.text.len();
        let safe = if last {
            self.text.len()
        } else {
            chars_back(&self.text, self.text.len(), self.holdback)
        };
        self.emit_upto(safe)
    }

    /// [`release`](Self::release) at the end of the response. An engine that stopped on one
    /// of the stop strings cut it out of its text (unless `include_stop_str_in_output`), so the
    /// text seen here ends where that occurrence began; it is put back for the scan, so that an
    /// occurrence straddling the slice boundary (which the engine, seeing only its slice's
    /// output, could not match) still wins when it ends first, as it would have unsliced. The
    /// text put back is never released: a stop string is found at the latest there.
    fn release_last(&mut self, reason: &Value) -> Vec<Value> {
        let cut = match (reason.as_str(), self.slice_stop_reason.as_str()) {
            (Some("stop"), Some(stop)) if !self.include_stop => {
                self.stops.iter().find(|s| s.as_str() == stop).cloned()
            }
            _ => None,
        };
        let Some(stop) = cut else {
            return self.release(true);
        };
        let seen = self.text.len();
        self.text.push_str(&stop);
        let out = self.release(true);
        debug_assert!(self.done() && self.emitted <= seen);
        self.text.truncate(seen);
        self.scanned = self.scanned.min(seen);
        out
    }

    fn emit_upto(&mut self, end: usize) -> Vec<Value> {
        if end <= self.emitted {
            return Vec::new();
        }
        let piece = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        vec![self.chunk(&piece, None)]
    }

    /// Closes the current slice when the engine stream ends; returns the final user chunks
    /// when the response is complete (the finish chunk, then a usage chunk when the user asked
    /// for `stream_options.include_usage`), else nothing (text near the boundary stays held).
    /// An engine stream without a finish reason that did not end at the slice's budget is
    /// [`AssemblyError::State`], after the slice has been counted.
    pub fn end_slice(&mut self) -> Result<Vec<Value>, AssemblyError> {
        if !self.in_slice {
            return Err(AssemblyError::State("end_slice() without a slice in progress".into()));
        }
        let tokens = self.slice_token_count()?;
        self.in_slice = false;
        self.last_slice_tokens = tokens;
        self.generated_tokens += tokens;
        if self.stop_floor == usize::MAX {
            // The slice was capped at `min_tokens`: its text is all within them.
            self.stop_floor = self.text.len();
        }
        self.account_prompt();
        self.slices += 1;
        let mut out = Vec::new();
        if !self.done() {
            let reason = self.slice_finish.clone();
            let at_boundary = reason.as_ref().and_then(Value::as_str) == Some("length")
                && tokens == self.slice_max
                && self.remaining_tokens() > 0;
            if at_boundary {
                return Ok(out);
            }
            let Some(reason) = reason else {
                return Err(AssemblyError::State(
                    "the engine stream ended without a finish_reason".into(),
                ));
            };
            out.extend(self.release_last(&reason));
            if !self.done() {
                self.finish_reason = Some(reason);
                self.stop_reason = self.slice_stop_reason.as_str().map(str::to_owned);
                self.stop_token = Some(self.slice_stop_reason.clone()).filter(Value::is_number);
            }
        }
        let finish = self.finish_reason.clone();
        out.push(self.chunk("", finish));
        if self.include_usage {
            out.push(self.usage_chunk());
        }
        Ok(out)
    }

    fn slice_token_count(&mut self) -> Result<u64, AssemblyError> {
        let reported =
            self.slice_usage.as_ref().and_then(|u| u.get("completion_tokens")).and_then(int);
        let count = match reported {
            Some(count) => count,
            None if !self.slice_ids.is_empty() || self.done() => self.slice_ids.len() as i64,
            None => {
                return Err(AssemblyError::State(
                    "the engine reported neither usage nor token ids for the slice; \
                     it must honour stream_options.include_usage"
                        .into(),
                ))
            }
        };
        if !(0..=self.slice_max as i64).contains(&count) {
            return Err(AssemblyError::State(format!(
                "the engine generated {count} tokens in a slice of {}",
                self.slice_max
            )));
        }
        let ids_complete = self.slice_ids.len() as i64 == count;
        if self.prompt_ids.is_some() && !self.done() && !ids_complete {
            return Err(AssemblyError::State(format!(
                "the engine returned {} token ids for {count} tokens; \
                 token-id continuation needs return_token_ids",
                self.slice_ids.len()
            )));
        }
        if ids_complete || self.done() {
            self.generated_ids.extend_from_slice(&self.slice_ids);
        }
        Ok(count as u64)
    }

    fn account_prompt(&mut self) {
        let empty = Map::new();
        let usage = self.slice_usage.as_ref().unwrap_or(&empty);
        let prompt = match usage.get("prompt_tokens").and_then(int) {
            Some(prompt) => prompt,
            None => match &self.prompt_ids {
                None => return,
                Some(ids) => (ids.len() + self.slice_resent) as i64,
            },
        };
        let user = *self.user_prompt_tokens.get_or_insert(prompt);
        let resent = (prompt - user).max(0);
        if self.slices == 0 || resent == 0 {
            return;
        }
        let cached = usage
            .get("prompt_tokens_details")
            .and_then(Value::as_object)
            .and_then(|d| d.get("cached_tokens"))
            .and_then(int);
        self.resent += resent;
        self.recomputed += match cached {
            Some(cached) => (prompt - cached.max(user)).max(0),
            None => resent,
        };
    }

    fn object(&self, whole: bool) -> &'static str {
        match (self.api, whole) {
            (Api::Completions, _) => "text_completion",
            (Api::Chat, false) => "chat.completion.chunk",
            (Api::Chat, true) => "chat.completion",
        }
    }

    fn envelope(&self, object: &str) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("id".into(), self.id.clone().map_or(Value::Null, Value::from));
        out.insert("object".into(), object.into());
        out.insert("created".into(), self.created.map_or(Value::Null, Value::from));
        out.insert("model".into(), self.model.clone());
        out
    }

    fn chunk(&mut self, text: &str, finish_reason: Option<Value>) -> Value {
        let mut choice = Map::new();
        choice.insert("index".into(), 0.into());
        match self.api {
            Api::Completions => {
                choice.insert("text".into(), text.into());
            }
            Api::Chat => {
                let mut delta = Map::new();
                if !self.sent_role {
                    delta.insert("role".into(), "assistant".into());
                    self.sent_role = true;
                }
                if !text.is_empty() || finish_reason.is_none() {
                    delta.insert("content".into(), text.into());
                }
                choice.insert("delta".into(), Value::Object(delta));
            }
        }
        choice.insert("logprobs".into(), Value::Null);
        let finished = finish_reason.is_some();
        choice.insert("finish_reason".into(), finish_reason.unwrap_or(Value::Null));
        let stop = if finished { self.stop_reason_value() } else { Value::Null };
        if !stop.is_null() {
            choice.insert("stop_reason".into(), stop);
        }
        let mut out = self.envelope(self.object(false));
        out.insert("choices".into(), json!([choice]));
        Value::Object(out)
    }

    /// The response's `stop_reason` as vLLM reports it: the stop string, or the stop token id
    /// (an int) that ended it, else null.
    fn stop_reason_value(&self) -> Value {
        match (&self.stop_reason, &self.stop_token) {
            (Some(stop), _) => Value::from(stop.as_str()),
            (None, Some(token)) => token.clone(),
            (None, None) => Value::Null,
        }
    }

    fn usage_chunk(&self) -> Value {
        let mut out = self.envelope(self.object(false));
        out.insert("choices".into(), json!([]));
        out.insert("usage".into(), self.usage().as_openai());
        Value::Object(out)
    }

    /// The complete non-streaming response (OpenAI shape) once [`SliceAssembler::done`].
    pub fn response(&self) -> Result<Value, AssemblyError> {
        let Some(finish) = &self.finish_reason else {
            return Err(AssemblyError::State("the response is not complete yet".into()));
        };
        let mut choice = Map::new();
        choice.insert("index".into(), 0.into());
        match self.api {
            Api::Completions => choice.insert("text".into(), self.text().into()),
            Api::Chat => choice
                .insert("message".into(), json!({"role": "assistant", "content": self.text()})),
        };
        choice.insert("logprobs".into(), Value::Null);
        choice.insert("finish_reason".into(), finish.clone());
        choice.insert("stop_reason".into(), self.stop_reason_value());
        let mut out = self.envelope(self.object(true));
        out.insert("choices".into(), json!([choice]));
        out.insert("usage".into(), self.usage().as_openai());
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
#[path = "assembler_tests.rs"]
mod tests;
