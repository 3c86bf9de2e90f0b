//! Prompt tokenization on the native plane: the token ids a vLLM engine feeds its model, the
//! ids `llmsched.tokenize.PromptTokenizer` computes on the Python plane, with no Python on
//! the request path.
//!
//! A tokenizer directory as `save_pretrained` writes it (`tokenizer.json`,
//! `tokenizer_config.json`, possibly `chat_template.jinja`) is loaded with the Hugging Face
//! `tokenizers` crate (the library under Python's `tokenizers`, with the pure-Rust regex
//! engine); the chat template runs on `minijinja` set up the way Hugging Face's
//! `apply_chat_template` sets up Jinja: `trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a `tojson` that is Python's `json.dumps`, Python's
//! string and dict methods (`minijinja-contrib`'s pycompat), `{% generation %}` blocks
//! rendered as their body, values printed as Python's `str()` prints them.
//!
//! - completions: a string prompt is encoded with the tokenizer's special tokens; a list of
//!   ids is used as is; a batch routes by its first prompt;
//! - chat: the messages (list contents reduced to their text parts joined by newlines, a
//!   null content to `""`, as vLLM's "string" content format) are rendered with the special
//!   tokens, `chat_template_kwargs` items, `tools` and `add_generation_prompt` (default true)
//!   as variables, and the text is encoded without adding special tokens again;
//! - media: a conversation with an image, audio, video or embeddings part is rendered up to
//!   the start of the first message holding one. The engine puts the media's placeholder
//!   tokens there and hashes the media into the cache blocks after it, so that beginning is
//!   the part of the prompt a router can match; the request itself goes to the engine whole.
//!
//! A template the engine cannot render is found at load time by rendering probe
//! conversations ([`PromptTokenizer::load`] fails); a conversation the template refuses, or
//! a malformed one, is a [`PromptProblem`] (a 400 on the request path).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior, Value};
use serde_json::value::RawValue;
use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::chat_values::{template_value, ChatContext};
use crate::payload::Payload;
use crate::tokcache::{CacheStats, PieceEncoder};

const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A probe conversation's system message: long enough to be cached, with spaces, newlines,
/// digits and unicode.
const PROBE_SYSTEM: &str = "You are a helpful assistant. Answer briefly; use  two spaces here,\n\
    a newline there, digits 1234567 and unicode: héllo, 日本語, 🐉.\n\n  Indented line.";

/// The template's name in its environment.
const TEMPLATE: &str = "chat";

/// A prompt or conversation that cannot be turned into tokens (answered with HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptProblem(pub String);

impl std::fmt::Display for PromptProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PromptProblem {}

/// Marks an error the template raised itself (`raise_exception`), as opposed to one the
/// engine met (an unknown filter or method, a type error).
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

/// Token ids of completion prompts and chat conversations (see the module documentation).
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    special: Vec<(String, String)>,
    /// The same, as the template's values (shared by every render).
    special_values: Arc<[(String, Value)]>,
    env: Option<Environment<'static>>,
    /// Chat prompts' ids through the piece cache ([`crate::tokcache`]).
    pieces: PieceEncoder,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("special", &self.special)
            .field("has_chat_template", &self.env.is_some())
            .field("pieces", &self.pieces)
            .finish()
    }
}

/// The fields of a chat request the template sees, as the JSON text they were sent as (read
/// into template values with map order kept: a template iterating a dict, or `tojson` of the
/// tools, writes keys in the order the client sent them, as Python's `json` module keeps it).
#[derive(Clone, Copy, Debug)]
pub struct ChatRequest<'a> {
    /// The conversation (a list of `{role, content}` objects).
    pub messages: &'a RawValue,
    /// The tools offered (absent or `null`: none).
    pub tools: Option<&'a RawValue>,
    /// Further template variables (used when an object).
    pub chat_template_kwargs: Option<&'a RawValue>,
}

impl<'a> ChatRequest<'a> {
    /// The chat fields of a request body as the gateway read it (a repeated key keeps its
    /// last value, as everywhere in the body); a problem when it has no `messages`.
    pub fn of_payload(payload: &Payload<'a>) -> Result<ChatRequest<'a>, PromptProblem> {
        let messages = payload
            .raw("messages")
            .ok_or_else(|| PromptProblem("the chat request has no 'messages'".into()))?;
        Ok(ChatRequest {
            messages,
            tools: payload.raw("tools"),
            chat_template_kwargs: payload.raw("chat_template_kwargs"),
        })
    }
}

impl PromptTokenizer {
    /// Loads a `save_pretrained` directory with a piece cache of the default size
    /// ([`PromptTokenizer::load_with_cache`]).
    pub fn load(directory: &Path) -> Result<PromptTokenizer, String> {
        PromptTokenizer::load_with_cache(directory, crate::tokcache::DEFAULT_CAPACITY)
    }

    /// Loads a `save_pretrained` directory; the error names the file or the template
    /// problem. A template that compiles but that the engine cannot render (an unknown
    /// filter, method or test) fails here: probe conversations are rendered. Chat prompts
    /// are encoded through a piece cache of `cache_bytes` (0: none) when the tokenizer
    /// proves piecewise on probe texts ([`PieceEncoder::new`]); else the cache is off and
    /// [`PromptTokenizer::cache_stats`] says why.
    pub fn load_with_cache(
        directory: &Path,
        cache_bytes: usize,
    ) -> Result<PromptTokenizer, String> {
        let file = directory.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&file)
            .map_err(|e| format!("cannot load {:?}: {e}", directory.display().to_string()))?;
        let config_path = directory.join("tokenizer_config.json");
        let config: Json = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| format!("{:?}: {e}", config_path.display().to_string()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("{:?}: {e}", config_path.display().to_string()))?
        } else {
            Json::Null
        };
        let special: Vec<(String, String)> = SPECIAL_TOKEN_KEYS
            .iter()
            .filter_map(|key| {
                let text = match config.get(*key) {
                    Some(Json::String(text)) => Some(text.clone()),
                    Some(Json::Object(fields)) => {
                        fields.get("content").and_then(Json::as_str).map(str::to_owned)
                    }
                    _ => None,
                };
                text.filter(|t| !t.is_empty()).map(|t| ((*key).to_owned(), t))
            })
            .collect();
        let source = chat_template_source(directory, &config)?;
        let env = match source {
            None => None,
            Some(source) => Some(environment(source)?),
        };
        let special_values =
            special.iter().map(|(key, text)| (key.clone(), Value::from(text.as_str()))).collect();
        let mut loaded = PromptTokenizer {
            tokenizer,
            special,
            special_values,
            env,
            pieces: PieceEncoder::off("not probed yet"),
        };
        let probes = loaded.probe()?;
        loaded.pieces = PieceEncoder::new(&loaded.tokenizer, cache_bytes, &probes);
        Ok(loaded)
    }

    /// Whether chat requests can be tokenized.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// The special tokens the chat template sees (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special
    }

    /// Renders probe conversations: at least one must render, unless every failure is the
    /// template's own `raise_exception` (a template with rules of its own about roles).
    /// Returns the texts rendered (the piece cache's probes).
    fn probe(&self) -> Result<Vec<String>, String> {
        let Some(env) = &self.env else { return Ok(Vec::new()) };
        let probes = [
            serde_json::json!([{"role": "user", "content": "hello"}]),
            serde_json::json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ]),
            serde_json::json!([
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "bye"},
            ]),
            serde_json::json!([
                {"role": "system", "content": PROBE_SYSTEM},
                {"role": "user", "content": " what's the weather in Zürich?  "},
                {"role": "assistant", "content": "Sunny, 21 °C.\n"},
                {"role": "user", "content": "and tomorrow"},
            ]),
        ];
        let mut engine_error = None;
        let mut rendered = Vec::new();
        for probe in probes {
            let messages = Value::from_serialize(&probe);
            match self.render_values(env, &messages, None, None) {
                Ok(text) => rendered.push(text),
                Err(RenderError::Template(err)) if raised(&err) => {}
                Err(RenderError::Template(err)) => engine_error = Some(describe(&err)),
                Err(RenderError::Prompt(problem)) => engine_error = Some(problem.0),
            }
        }
        match engine_error {
            Some(problem) if rendered.is_empty() => Err(format!(
                "the chat template cannot be rendered by the native plane's template engine \
                 ({problem}); serve it with data_plane: python"
            )),
            _ => Ok(rendered),
        }
    }

    /// The ids of a `/v1/completions` prompt: a string (encoded with special tokens) or a
    /// list of ids (as is); a batch yields its first prompt's.
    pub fn completion_tokens(&self, prompt: Option<&Json>) -> Result<Vec<u32>, PromptProblem> {
        let bad = || PromptProblem("prompt must be a string or a list of token ids".into());
        let prompt = match prompt {
            Some(Json::Array(items))
                if items.first().is_some_and(|p| p.is_string() || p.is_array()) =>
            {
                &items[0]
            }
            Some(prompt) => prompt,
            None => return Err(bad()),
        };
        match prompt {
            Json::String(text) => self.encode_completion(text),
            Json::Array(ids) => ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }

    /// The ids of a chat request's body (`messages`, `tools`, `chat_template_kwargs`): the
    /// rendered template, encoded without adding special tokens. The body is read as the
    /// gateway reads it ([`Payload::parse`], [`ChatRequest::of_payload`]).
    pub fn chat_tokens_of_body(&self, body: &[u8]) -> Result<Vec<u32>, PromptProblem> {
        let text = self.render_body(body)?;
        self.encode_chat(&text)
    }

    /// The ids of a chat request's fields (see [`PromptTokenizer::chat_tokens_of_body`]).
    pub fn chat_tokens(&self, request: &ChatRequest<'_>) -> Result<Vec<u32>, PromptProblem> {
        let text = self.render_request(request)?;
        self.encode_chat(&text)
    }

    /// The ids of a rendered chat prompt (no special tokens added): through the piece cache
    /// when it is on, the same ids as [`PromptTokenizer::encode`] either way.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, PromptProblem> {
        self.pieces
            .encode(&self.tokenizer, text)
            .map_err(|e| PromptProblem(format!("cannot tokenize the prompt: {e}")))
    }

    /// The ids of a completion prompt's text, special tokens added: through the piece cache
    /// when it is on and the ids special tokens add were proved at load, the same ids as
    /// [`PromptTokenizer::encode`] with `add_special_tokens` either way.
    pub fn encode_completion(&self, text: &str) -> Result<Vec<u32>, PromptProblem> {
        self.pieces
            .encode_with_special_tokens(&self.tokenizer, text)
            .map_err(|e| PromptProblem(format!("cannot tokenize the prompt: {e}")))
    }

    /// The piece cache's counters and state (why it is off, when it is).
    pub fn cache_stats(&self) -> CacheStats {
        self.pieces.stats()
    }

    /// The chat template's text for a chat request's body.
    pub fn render_body(&self, body: &[u8]) -> Result<String, PromptProblem> {
        let payload = Payload::parse(body).map_err(unreadable)?;
        self.render_request(&ChatRequest::of_payload(&payload)?)
    }

    /// The chat template's text for a chat request's fields.
    pub fn render_request(&self, request: &ChatRequest<'_>) -> Result<String, PromptProblem> {
        let value = |raw: &RawValue| template_value(raw).map_err(unreadable);
        let messages = value(request.messages)?;
        let present = |raw: &&RawValue| raw.get() != "null";
        let tools = request.tools.filter(present).map(value).transpose()?;
        let extra = request.chat_template_kwargs.map(value).transpose()?;
        let extra = extra.filter(|v| v.kind() == ValueKind::Map);
        self.render(&messages, tools.as_ref(), extra.as_ref())
    }

    /// The chat template's text for `messages` (a list of `{role, content}` maps) with
    /// `tools` and further variables (`extra`, a map) set; with a media part, the text up to
    /// the start of the first message holding one (see the module documentation).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        extra: Option<&Value>,
    ) -> Result<String, PromptProblem> {
        let Some(env) = &self.env else {
            return Err(PromptProblem("the configured tokenizer has no chat template".into()));
        };
        self.render_values(env, messages, tools, extra).map_err(|err| match err {
            RenderError::Prompt(problem) => problem,
            RenderError::Template(err) => {
                PromptProblem(format!("chat template: {}", describe(&err)))
            }
        })
    }

    fn render_values(
        &self,
        env: &Environment<'static>,
        messages: &Value,
        tools: Option<&Value>,
        extra: Option<&Value>,
    ) -> Result<String, RenderError> {
        let (messages, media) = string_contents(messages).map_err(RenderError::Prompt)?;
        let context = ChatContext {
            messages,
            tools: tools.cloned(),
            extra: extra.cloned(),
            special: self.special_values.clone(),
        };
        let template = env.get_template(TEMPLATE).map_err(RenderError::Template)?;
        let mut text =
            template.render(Value::from_object(context)).map_err(RenderError::Template)?;
        if media {
            cut_at_media(&mut text);
        }
        Ok(text)
    }

    /// The ids of `text`, with the tokenizer's special tokens added or not (without the
    /// offsets the router has no use for: the same ids, less work).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptProblem> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| PromptProblem(format!("cannot tokenize the prompt: {e}")))
    }
}

/// A chat request whose JSON cannot be read (a body [`Payload::parse`] refuses, or a field
/// that does not read as template values).
fn unreadable(err: impl std::fmt::Display) -> PromptProblem {
    PromptProblem(format!("cannot read the chat request: {err}"))
}

enum RenderError {
    Prompt(PromptProblem),
    Template(Error),
}

fn raised(err: &Error) -> bool {
    std::error::Error::source(err).is_some_and(|s| s.downcast_ref::<Raised>().is_some())
}

/// An error's text: the template's own message for `raise_exception`, else the engine's
/// description with the template line.
fn describe(err: &Error) -> String {
    if raised(err) {
        return err.detail().unwrap_or("raised an exception").to_owned();
    }
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(inner) = source {
        let _ = write!(text, ": {inner}");
        source = inner.source();
    }
    text
}

/// `chat_template.jinja` (newer `save_pretrained`), else the `chat_template` entry of
/// `tokenizer_config.json` (a string, or named templates whose `default` is taken).
fn chat_template_source(directory: &Path, config: &Json) -> Result<Option<String>, String> {
    let file = directory.join("chat_template.jinja");
    if file.is_file() {
        return std::fs::read_to_string(&file)
            .map(Some)
            .map_err(|e| format!("{:?}: {e}", file.display().to_string()));
    }
    Ok(match config.get("chat_template") {
        Some(Json::String(template)) => Some(template.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    })
}

/// `{% generation %}` / `{% endgeneration %}` (Hugging Face's assistant-mask marker) as an
/// always-true `if`: the body renders unchanged, whitespace control included.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (body, close) = match body.strip_suffix(['-', '+']) {
            Some(trimmed) => (trimmed, &body[body.len() - 1..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{open} if true {close}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{open} endif {close}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn environment(source: String) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned(TEMPLATE, rewrite_generation_tags(&source))
        .map_err(|e| format!("chat template does not compile: {}", describe(&e)))?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
}

/// The local time formatted with C's `strftime` (Python's `datetime.now().strftime`).
fn strftime_now(format: String) -> Result<Value, Error> {
    let bad = || Error::new(ErrorKind::InvalidOperation, "strftime_now: bad format");
    let c_format = std::ffi::CString::new(format).map_err(|_| bad())?;
    let mut buffer = vec![0u8; 512];
    // SAFETY: `time` and `localtime_r` write only into the locals given; `strftime` writes at
    // most `buffer.len()` bytes into `buffer` and reads the NUL-terminated format.
    let written = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad());
        }
        libc::strftime(buffer.as_mut_ptr().cast(), buffer.len(), c_format.as_ptr(), &tm)
    };
    buffer.truncate(written);
    String::from_utf8(buffer).map(Value::from).map_err(|_| bad())
}

/// Stands for the content of the first message holding a media part while the template
/// renders; the rendered text is cut where it appears. Private-use characters, so no
/// template writes it and no tokenizer merges across the cut.
const MEDIA_MARK: &str = "\u{E000}llmsched:media\u{E001}";

/// Text part types and the field holding their text, as vLLM reads them (its
/// `entrypoints/chat_utils.py`: text, input and output text, refusal, thinking; a tool
/// reference contributes its name).
const TEXT_PARTS: [(&str, &str); 6] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
    ("tool_reference", "name"),
];

/// Media part types (vLLM's): the engine puts the media's placeholder tokens and its own
/// processing in their place, which a gateway cannot reproduce. A part without a type is
/// media when it holds one of these fields, as vLLM infers it.
const MEDIA_PARTS: [&str; 10] = [
    "image_url",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// One part of a list content.
enum Part {
    /// Text for the message (an empty or absent text is skipped, as vLLM skips it).
    Text(Option<String>),
    Media,
}

fn content_part(part: &Value) -> Result<Part, String> {
    let text_of = |value: Value| match value.kind() {
        ValueKind::Undefined | ValueKind::None => None,
        _ => Some(python_str(&value)).filter(|text| !text.is_empty()),
    };
    match part.kind() {
        ValueKind::String => return Ok(Part::Text(text_of(part.clone()))),
        ValueKind::Map => {}
        _ => return Err("must be a string or an object with a type".into()),
    }
    let kind = part.get_attr("type").unwrap_or_default();
    match kind.kind() {
        ValueKind::String => {
            let kind = kind.as_str().unwrap_or("");
            if let Some((_, field)) = TEXT_PARTS.iter().find(|(name, _)| *name == kind) {
                return Ok(Part::Text(text_of(part.get_attr(field).unwrap_or_default())));
            }
            if MEDIA_PARTS.contains(&kind) {
                return Ok(Part::Media);
            }
            Err(format!("unsupported content part type {kind:?}"))
        }
        ValueKind::Undefined | ValueKind::None => {
            let holds = |field: &str| part.get_attr(field).is_ok_and(|v| !v.is_undefined());
            if MEDIA_PARTS.iter().any(|field| holds(field)) {
                Ok(Part::Media)
            } else if holds("tool_reference") {
                Ok(Part::Text(text_of(part.get_attr("tool_reference").unwrap_or_default())))
            } else {
                Err("has no 'type'".into())
            }
        }
        _ => Err("'type' must be a string".into()),
    }
}

/// Messages as the template sees them, and whether a media part was met: each message a map
/// with a string role. A list content is reduced to its text parts joined by newlines, an
/// absent or null content to `""` (vLLM's "string" content format). The first message
/// holding a media part gets [`MEDIA_MARK`] as its content: vLLM puts the media's
/// placeholders at the start of that message's text, so the prompt the gateway can know ends
/// there. Messages whose contents are all strings are the template's as they are (no new
/// list).
fn string_contents(messages: &Value) -> Result<(Value, bool), PromptProblem> {
    let shape =
        || PromptProblem("messages must be a non-empty list of {role, content} objects".into());
    if messages.kind() != ValueKind::Seq || messages.len() == Some(0) {
        return Err(shape());
    }
    let mut media = false;
    // The messages before the first reduced one are copied in when it is met.
    let mut out: Option<Vec<Value>> = None;
    for (i, message) in messages.try_iter().map_err(|_| shape())?.enumerate() {
        let role = message.get_attr("role").ok();
        if message.kind() != ValueKind::Map || role.as_ref().and_then(Value::as_str).is_none() {
            return Err(PromptProblem(format!(
                "messages[{i}] must be an object with a string role"
            )));
        }
        let content = message.get_attr("content").unwrap_or_default();
        let reduced = match content.kind() {
            ValueKind::Seq => {
                let mut texts = Vec::new();
                let mut has_media = false;
                for (j, part) in content.try_iter().map_err(|_| shape())?.enumerate() {
                    match content_part(&part) {
                        Ok(Part::Text(text)) => texts.extend(text),
                        Ok(Part::Media) => has_media = true,
                        Err(problem) => {
                            return Err(PromptProblem(format!(
                                "messages[{i}].content[{j}] {problem}"
                            )))
                        }
                    }
                }
                if has_media && !media {
                    media = true;
                    Some(Value::from(MEDIA_MARK))
                } else {
                    Some(Value::from(texts.join("\n")))
                }
            }
            ValueKind::String => None,
            ValueKind::None | ValueKind::Undefined => Some(Value::from("")),
            _ => {
                return Err(PromptProblem(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )))
            }
        };
        match reduced {
            None => {
                if let Some(out) = out.as_mut() {
                    out.push(message);
                }
            }
            Some(text) => {
                let keys = message.try_iter().map_err(|_| shape())?;
                let mut fields: Vec<(Value, Value)> = keys
                    .map(|key| {
                        let value = if key.as_str() == Some("content") {
                            text.clone()
                        } else {
                            message.get_item(&key).unwrap_or_default()
                        };
                        (key, value)
                    })
                    .collect();
                if content.is_undefined() {
                    fields.push((Value::from("content"), text));
                }
                let out = out.get_or_insert_with(|| {
                    let mut before = Vec::with_capacity(messages.len().unwrap_or(0));
                    before.extend(messages.try_iter().into_iter().flatten().take(i));
                    before
                });
                out.push(Value::from_iter(fields));
            }
        }
    }
    Ok((out.map_or_else(|| messages.clone(), Value::from), media))
}

/// Cuts a render at [`MEDIA_MARK`]. A template that did not write the marked content (one
/// that leaves some messages out) keeps its whole text, the media's message left out.
fn cut_at_media(text: &mut String) {
    if let Some(at) = text.find(MEDIA_MARK) {
        text.truncate(at);
    }
}

/// `{{ value }}` as Jinja on Python writes it: Python's `str()` (`None`, `True`, `['a']`).
fn python_formatter(
    out: &mut minijinja::Output,
    _state: &State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::String => out.write_str(value.as_str().unwrap_or("")).map_err(Error::from),
        _ => out.write_str(&python_str(value)).map_err(Error::from),
    }
}

/// Python's `str()` of a value: strings as they are, everything else its `repr()`.
fn python_str(value: &Value) -> String {
    match value.as_str() {
        Some(text) if value.kind() == ValueKind::String => text.to_owned(),
        _ => {
            let mut out = String::new();
            python_repr(value, &mut out);
            out
        }
    }
}

fn python_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => match f64_of(value) {
            Some(f) => out.push_str(&python_float(f, false)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => repr_str(value.as_str().unwrap_or(""), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&key, out);
                    out.push_str(": ");
                    python_repr(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr()` of a string.
fn repr_str(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A number that is a float (not an integer), as `f64`.
fn f64_of(value: &Value) -> Option<f64> {
    if value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// Python's `repr(float)` (`json` spells the non-finite ones `NaN`, `Infinity`).
fn python_float(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if f.is_infinite() {
        let text = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{text}") } else { text.into() };
    }
    let scientific = format!("{f:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if f != 0.0 && !(-4..16).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs());
    }
    let fixed = format!("{f}");
    if fixed.contains('.') {
        fixed
    } else {
        format!("{fixed}.0")
    }
}

/// Hugging Face's `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, keyword or positional arguments in that order.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let positional = |i: usize| args.get(i).cloned();
    let ensure_ascii = kwargs
        .get::<Option<bool>>("ensure_ascii")?
        .or_else(|| positional(0).map(|v| v.is_true()))
        .unwrap_or(false);
    let indent = kwargs.get::<Option<Value>>("indent")?.or_else(|| positional(1));
    let separators = kwargs.get::<Option<Value>>("separators")?.or_else(|| positional(2));
    let sort_keys = kwargs
        .get::<Option<bool>>("sort_keys")?
        .or_else(|| positional(3).map(|v| v.is_true()))
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) => match i64::try_from(v) {
            Ok(n) => Some(" ".repeat(n.max(0) as usize)),
            Err(_) => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: bad indent"));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or(",").to_owned(), b.as_str().unwrap_or(":").to_owned())
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let dumper = Dumper { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from(out))
}

struct Dumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Dumper {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn separator(&self, level: usize, out: &mut String) {
        out.push_str(&self.item_sep);
        self.newline(level, out);
    }

    fn dump(&self, value: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match f64_of(value) {
                Some(f) => out.push_str(&python_float(f, true)),
                None => {
                    let _ = write!(out, "{value}");
                }
            },
            ValueKind::String => self.string(value.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                self.newline(level + 1, out);
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.separator(level + 1, out);
                    }
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let name = match key.kind() {
                        ValueKind::String => key.as_str().unwrap_or("").to_owned(),
                        ValueKind::None => "null".into(),
                        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                        ValueKind::Number => match f64_of(&key) {
                            Some(f) => python_float(f, true),
                            None => key.to_string(),
                        },
                        _ => {
                            return Err(Error::new(
                                ErrorKind::InvalidOperation,
                                "tojson: keys must be str, int, float, bool or None",
                            ))
                        }
                    };
                    entries.push((name, item));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                self.newline(level + 1, out);
                for (i, (name, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        self.separator(level + 1, out);
                    }
                    self.string(name, out);
                    out.push_str(&self.key_sep);
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// A JSON string as Python's `json` writes it.
    fn string(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && (c as u32) > 0x7e => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_an_if() {
        assert_eq!(
            rewrite_generation_tags("a{% generation %}b{%- endgeneration -%}c{{ x }}"),
            "a{% if true %}b{%- endif -%}c{{ x }}"
        );
        assert_eq!(rewrite_generation_tags("{% if x %}"), "{% if x %}");
        assert_eq!(rewrite_generation_tags("{% unclosed"), "{% unclosed");
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, text) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.25, "123456789.25"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(python_float(f, false), text);
        }
        assert_eq!(python_float(f64::NAN, true), "NaN");
        assert_eq!(python_float(f64::NEG_INFINITY, true), "-Infinity");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let env = environment(
            "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(ensure_ascii=true) }}"
                .into(),
        )
        .unwrap();
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, null, true], "a": "é<\"\n"}"#).unwrap();
        let out = env.get_template(TEMPLATE).unwrap().render(minijinja::context! { v }).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, null, true], \"a\": \"é<\\\"\\n\"}|{\n  \"b\": [\n    1,\n    \
             2.5,\n    null,\n    true\n  ],\n  \"a\": \"é<\\\"\\n\"\n}|{\"b\": [1, 2.5, null, \
             true], \"a\": \"\\u00e9<\\\"\\n\"}"
        );
    }

    #[test]
    fn values_print_as_python_str() {
        let env = environment("{{ n }} {{ t }} {{ l }} {{ d }} {{ u }}.".into()).unwrap();
        let d: Value = serde_json::from_str(r#"{"k": "it's", "x": 1.0}"#).unwrap();
        let out = env
            .get_template(TEMPLATE)
            .unwrap()
            .render(minijinja::context! { n => (), t => true, l => vec!["a", "b"], d })
            .unwrap();
        assert_eq!(out, "None True ['a', 'b'] {'k': \"it's\", 'x': 1.0} .");
    }

    #[test]
    fn malformed_messages_are_prompt_problems() {
        for (bad, needle) in [
            ("[]", "non-empty list"),
            ("{}", "non-empty list"),
            ("\"x\"", "non-empty list"),
            ("[1]", "messages[0] must be an object"),
            ("[{\"content\": \"x\"}]", "messages[0] must be an object"),
            ("[{\"role\": 1}]", "messages[0] must be an object"),
            ("[{\"role\": \"user\", \"content\": 5}]", "must be a string or a list of parts"),
            ("[{\"role\": \"user\", \"content\": [{\"type\": \"image\"}]}]", "type \"image\""),
            ("[{\"role\": \"user\", \"content\": [3]}]", "content[0] must be a string or"),
            ("[{\"role\": \"user\", \"content\": [{\"text\": \"a\"}]}]", "has no 'type'"),
            ("[{\"role\": \"user\", \"content\": [{\"type\": 1}]}]", "'type' must be"),
        ] {
            let messages: Value = serde_json::from_str(bad).unwrap();
            let problem = string_contents(&messages).unwrap_err();
            assert!(problem.0.contains(needle), "{bad}: {problem}");
        }
        let messages: Value = serde_json::from_str(
            r#"[{"role": "user", "name": "n", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]"#,
        )
        .unwrap();
        let (reduced, media) = string_contents(&messages).unwrap();
        assert!(!media);
        let first = reduced.get_item(&Value::from(0)).unwrap();
        assert_eq!(first.get_attr("content").unwrap().as_str(), Some("a\nb"));
        assert_eq!(first.get_attr("name").unwrap().as_str(), Some("n"));
    }

    #[test]
    fn text_parts_are_joined_as_vllm_joins_them() {
        let messages: Value = serde_json::from_str(
            r#"[{"role": "user", "content": ["plain", {"type": "input_text", "text": "in"},
                {"type": "text", "text": ""}, {"type": "text", "text": null}, {"type": "text"},
                {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}]},
               {"role": "assistant", "content": null, "tool_calls": []},
               {"role": "tool"}]"#,
        )
        .unwrap();
        let (reduced, media) = string_contents(&messages).unwrap();
        assert!(!media);
        let content = |i: i64| {
            let message = reduced.get_item(&Value::from(i)).unwrap();
            message.get_attr("content").unwrap().as_str().map(str::to_owned)
        };
        assert_eq!(content(0).as_deref(), Some("plain\nin\nno\nhm"));
        assert_eq!(content(1).as_deref(), Some(""));
        assert_eq!(content(2).as_deref(), Some(""));
    }

    #[test]
    fn the_first_media_part_marks_its_message() {
        for part in [
            r#"{"type": "image_url", "image_url": {"url": "data:,"}}"#,
            r#"{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}"#,
            r#"{"image_url": {"url": "data:,"}}"#,
            r#"{"type": "video_url", "video_url": {"url": "v"}}"#,
        ] {
            let messages: Value = serde_json::from_str(&format!(
                r#"[{{"role": "system", "content": "s"}},
                   {{"role": "user", "content": [{{"type": "text", "text": "look"}}, {part}]}},
                   {{"role": "user", "content": [{part}, "again"]}}]"#
            ))
            .unwrap();
            let (reduced, media) = string_contents(&messages).unwrap();
            assert!(media, "{part}");
            let content = |i: i64| {
                let message = reduced.get_item(&Value::from(i)).unwrap();
                message.get_attr("content").unwrap().as_str().map(str::to_owned)
            };
            assert_eq!(content(0).as_deref(), Some("s"));
            assert_eq!(content(1).as_deref(), Some(MEDIA_MARK));
            assert_eq!(content(2).as_deref(), Some("again"));
        }
        let mut text = format!("<s>system{MEDIA_MARK}more");
        cut_at_media(&mut text);
        assert_eq!(text, "<s>system");
    }
}
