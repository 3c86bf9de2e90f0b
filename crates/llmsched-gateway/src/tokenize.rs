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
//! - chat: the messages, built as vLLM builds them ([`crate::conversation`]), are rendered
//!   with the special tokens, `chat_template_kwargs` items, `tools` and
//!   `add_generation_prompt` (default true) as variables, and the text is encoded without
//!   adding special tokens again; a conversation with a media part is rendered up to it.
//!
//! A template the engine cannot render is found at load time by rendering probe
//! conversations ([`PromptTokenizer::load`] fails); a conversation the template refuses, or
//! a malformed one, is a [`PromptProblem`] (a 400 on the request path).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use minijinja::value::ValueKind;
use minijinja::{Error, Value};
use serde_json::value::RawValue;
use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::chat_values::{template_value, tools_variable, ChatContext};
use crate::conversation::{
    cut_at_final_mark, cut_at_media, mark_final_message, template_messages, vllm_tools,
    ContentFormat,
};
use crate::payload::Payload;
use crate::templates::{describe, raised, ChatTemplate, ChatTemplates, TemplateAsked};
use crate::tokcache::{CacheStats, PieceEncoder};
use crate::truncation::Truncation;

const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A probe conversation's system message: long enough to be cached, with spaces, newlines,
/// digits and unicode.
const PROBE_SYSTEM: &str = "You are a helpful assistant. Answer briefly; use  two spaces here,\n\
    a newline there, digits 1234567 and unicode: héllo, 日本語, 🐉.\n\n  Indented line.";

/// A prompt or conversation that cannot be turned into tokens (answered with HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptProblem(pub String);

impl std::fmt::Display for PromptProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PromptProblem {}

/// Token ids of completion prompts and chat conversations (see the module documentation).
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    special: Vec<(String, String)>,
    /// The same, as the template's values (shared by every render).
    special_values: Arc<[(String, Value)]>,
    /// The chat templates and the rule choosing among them.
    templates: ChatTemplates,
    /// How every template takes list contents, where the engines were told
    /// (`--chat-template-content-format`); `None`: as detected on the template chosen.
    content_format: Option<ContentFormat>,
    /// Chat prompts' ids through the piece cache ([`crate::tokcache`]).
    pieces: PieceEncoder,
    /// The engines' `--default-chat-template-kwargs` (a map), under every request's.
    default_kwargs: Option<Value>,
    /// The engines' `--exclude-tools-when-tool-choice-none`.
    exclude_tools_when_tool_choice_none: bool,
    /// The engines' context length (`--max-model-len`; 0: unknown), for a
    /// `truncate_prompt_tokens` of -1; set while serving as the engines report it.
    context_len: AtomicUsize,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("special", &self.special)
            .field("templates", &self.templates)
            .field("content_format", &self.content_format)
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
    /// Further template variables (an object, or absent or `null`).
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// Whether the template adds the assistant's header (absent: true).
    pub add_generation_prompt: Option<&'a RawValue>,
    /// Whether the text ends where the last message's content does (absent: false).
    pub continue_final_message: Option<&'a RawValue>,
    /// Whether the rendered text is encoded with the tokenizer's special tokens added.
    pub add_special_tokens: Option<&'a RawValue>,
    /// Documents for retrieval-augmented templates (a list of objects).
    pub documents: Option<&'a RawValue>,
    /// The reasoning effort asked for (one of vLLM's names).
    pub reasoning_effort: Option<&'a RawValue>,
    /// How many of the prompt's ids the engine keeps ([`crate::truncation`]).
    pub truncate_prompt_tokens: Option<&'a RawValue>,
    /// Which end of the prompt a truncation keeps.
    pub truncation_side: Option<&'a RawValue>,
    /// The tool choice (`"none"` leaves the tools out where the engines were told to).
    pub tool_choice: Option<&'a RawValue>,
    /// The request's own chat template (a template's text or a template's name).
    pub chat_template: Option<&'a RawValue>,
}

impl<'a> ChatRequest<'a> {
    /// The chat fields of a request body as the gateway read it (a repeated key keeps its
    /// last value, as everywhere in the body); a problem when it has no `messages`.
    pub fn of_payload(payload: &Payload<'a>) -> Result<ChatRequest<'a>, PromptProblem> {
        let messages = payload
            .raw("messages")
            .ok_or_else(|| PromptProblem("the chat request has no 'messages'".into()))?;
        let present = |name: &str| payload.raw(name).filter(|raw| raw.get() != "null");
        Ok(ChatRequest {
            messages,
            tools: present("tools"),
            chat_template_kwargs: present("chat_template_kwargs"),
            add_generation_prompt: present("add_generation_prompt"),
            continue_final_message: present("continue_final_message"),
            add_special_tokens: present("add_special_tokens"),
            documents: present("documents"),
            reasoning_effort: present("reasoning_effort"),
            truncate_prompt_tokens: present("truncate_prompt_tokens"),
            truncation_side: present("truncation_side"),
            tool_choice: present("tool_choice"),
            chat_template: present("chat_template"),
        })
    }

    /// The request's fields besides its messages, read and checked as vLLM 0.32 reads them,
    /// for engines started with `--exclude-tools-when-tool-choice-none` or without: with it,
    /// a `tool_choice` of `"none"` leaves the request's tools out. `context`: the engines'
    /// context length, where known (what a `truncate_prompt_tokens` of -1 keeps).
    pub fn options(
        &self,
        exclude_tools_when_tool_choice_none: bool,
        context: Option<usize>,
    ) -> Result<ChatOptions, PromptProblem> {
        let value = |raw: &RawValue| template_value(raw).map_err(unreadable);
        let flag = |raw: Option<&RawValue>, name: &str, default: bool| match raw.map(RawValue::get)
        {
            None => Ok(default),
            Some("true") => Ok(true),
            Some("false") => Ok(false),
            Some(_) => Err(PromptProblem(format!("{name} must be a boolean"))),
        };
        let add_generation_prompt =
            flag(self.add_generation_prompt, "add_generation_prompt", true)?;
        let continue_final_message =
            flag(self.continue_final_message, "continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(PromptProblem(
                "continue_final_message and add_generation_prompt cannot both be true".into(),
            ));
        }
        let extra = self.chat_template_kwargs.map(value).transpose()?;
        if extra.as_ref().is_some_and(|e| e.kind() != ValueKind::Map) {
            return Err(PromptProblem("chat_template_kwargs must be an object".into()));
        }
        let kwarg = |name: &str| {
            extra.as_ref().and_then(|e| e.get_attr(name).ok()).filter(|v| !v.is_undefined())
        };
        // vLLM refuses the first; the second meets the conversation's own argument.
        for name in ["tokenize", "messages"] {
            if kwarg(name).is_some() {
                return Err(PromptProblem(format!("chat_template_kwargs may not set '{name}'")));
            }
        }
        let text = |value: Value, name: &str| match value.as_str() {
            Some(text) if value.kind() == ValueKind::String => Ok(text.to_owned()),
            _ => Err(PromptProblem(format!("{name} must be a string"))),
        };
        let template = TemplateAsked {
            field: self.chat_template.map(|raw| text(value(raw)?, "chat_template")).transpose()?,
            kwarg: kwarg("chat_template")
                .filter(|v| !v.is_none())
                .map(|v| text(v, "chat_template_kwargs' chat_template"))
                .transpose()?,
        };
        let excluded = exclude_tools_when_tool_choice_none
            && self.tool_choice.is_some_and(|choice| choice.get() == r#""none""#);
        let tools = match self.tools {
            Some(raw) if !excluded => Some(vllm_tools(&value(raw)?).map_err(PromptProblem)?),
            _ => None,
        };
        let documents = match self.documents {
            Some(raw) => {
                let documents = value(raw)?;
                let objects = documents.kind() == ValueKind::Seq
                    && documents
                        .try_iter()
                        .into_iter()
                        .flatten()
                        .all(|d| d.kind() == ValueKind::Map);
                if !objects {
                    return Err(PromptProblem("documents must be a list of objects".into()));
                }
                Some(documents)
            }
            None => None,
        };
        let mut reasoning = Vec::new();
        if let Some(raw) = self.reasoning_effort {
            let effort = value(raw)?;
            let known = effort.as_str().filter(|_| effort.kind() == ValueKind::String);
            let Some(known) = known.filter(|e| REASONING_EFFORTS.contains(e)) else {
                return Err(PromptProblem(format!(
                    "reasoning_effort must be one of {}",
                    REASONING_EFFORTS.join(", ")
                )));
            };
            if kwarg("enable_thinking").is_none() {
                reasoning.push(("enable_thinking", Value::from(known != "none")));
            }
            reasoning.push(("reasoning_effort", effort));
        }
        let json = |raw: Option<&RawValue>| {
            raw.map(|raw| serde_json::from_str::<Json>(raw.get())).transpose().map_err(unreadable)
        };
        let truncation = Truncation::of_fields(
            json(self.truncate_prompt_tokens)?.as_ref(),
            json(self.truncation_side)?.as_ref(),
            context,
        )
        .map_err(|problem| PromptProblem(problem.into()))?;
        Ok(ChatOptions {
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens: flag(self.add_special_tokens, "add_special_tokens", false)?,
            reasoning,
            extra,
            truncation,
            template,
        })
    }
}

/// The `reasoning_effort` values vLLM 0.32 accepts.
const REASONING_EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// What a chat request sets besides its messages ([`ChatRequest::options`]).
#[derive(Debug)]
pub struct ChatOptions {
    /// The request's `tools` as vLLM hands them on.
    pub tools: Option<Value>,
    /// The request's `documents`.
    pub documents: Option<Value>,
    /// `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Whether the text ends where the last message's content does.
    pub continue_final_message: bool,
    /// Whether the text is encoded with special tokens added.
    pub add_special_tokens: bool,
    /// `reasoning_effort` and `enable_thinking`, when the request sets them.
    pub reasoning: Vec<(&'static str, Value)>,
    /// The `chat_template_kwargs` (an object).
    pub extra: Option<Value>,
    /// How the engine cuts the encoded prompt (`truncate_prompt_tokens`).
    pub truncation: Option<Truncation>,
    /// What the request asks of the template choice ([`ChatTemplates::choose`]).
    pub template: TemplateAsked,
}

impl Default for ChatOptions {
    /// A request with messages alone: the assistant's header added, nothing else set.
    fn default() -> ChatOptions {
        ChatOptions {
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            reasoning: Vec::new(),
            extra: None,
            truncation: None,
            template: TemplateAsked::default(),
        }
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
        PromptTokenizer::load_with_template(directory, cache_bytes, None)
    }

    /// Loads a `save_pretrained` directory as [`PromptTokenizer::load_with_cache`] does, with
    /// `chat_template` (the engines' `--chat-template`, as its text) in place of the
    /// directory's own template when given.
    pub fn load_with_template(
        directory: &Path,
        cache_bytes: usize,
        chat_template: Option<&str>,
    ) -> Result<PromptTokenizer, String> {
        let file = directory.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&file)
            .map_err(|e| format!("cannot load {:?}: {e}", directory.display().to_string()))?;
        // transformers sets truncation and padding on every call, vLLM asking for neither
        // below the context length: a `tokenizer.json` that sets them is not how the engine
        // encodes.
        tokenizer
            .with_truncation(None)
            .map_err(|e| format!("cannot load {:?}: {e}", directory.display().to_string()))?;
        tokenizer.with_padding(None);
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
        let templates = ChatTemplates::load(directory, &config, chat_template)?;
        let special_values =
            special.iter().map(|(key, text)| (key.clone(), Value::from(text.as_str()))).collect();
        let mut loaded = PromptTokenizer {
            tokenizer,
            special,
            special_values,
            templates,
            content_format: None,
            pieces: PieceEncoder::off("not probed yet"),
            default_kwargs: None,
            exclude_tools_when_tool_choice_none: false,
            context_len: AtomicUsize::new(0),
        };
        let probes = loaded.probe()?;
        loaded.pieces = PieceEncoder::new(&loaded.tokenizer, cache_bytes, &probes);
        Ok(loaded)
    }

    /// Whether chat requests that ask for no template of their own can be tokenized.
    pub fn has_chat_template(&self) -> bool {
        self.templates.has_default()
    }

    /// How the chat template of a request asking for none (and without tools) takes a
    /// message's list content: as vLLM detects it, unless
    /// [`PromptTokenizer::with_content_format`] set it.
    pub fn content_format(&self) -> ContentFormat {
        let detected = self.templates.default_template().map(|t| t.content_format);
        self.content_format.or(detected).unwrap_or(ContentFormat::String)
    }

    /// The tokenizer with its content format set, as vLLM's `--chat-template-content-format`
    /// sets the engine's (`None`, vLLM's `auto`: detected on the template each request is
    /// rendered with).
    pub fn with_content_format(mut self, format: Option<ContentFormat>) -> PromptTokenizer {
        self.content_format = format;
        self
    }

    /// The tokenizer for engines started with `--trust-request-chat-template` (or without):
    /// with it, a request's own `chat_template` (or one among its `chat_template_kwargs`) is
    /// rendered; without, such a request is refused, as the engines refuse it.
    pub fn with_trust_request_chat_template(mut self, trust: bool) -> PromptTokenizer {
        self.templates = self.templates.with_trust_requests(trust);
        self
    }

    /// The tokenizer with the engines' `--default-chat-template-kwargs` (`kwargs`: a JSON
    /// object's text, its keys' order kept): the template variables every request's
    /// `chat_template_kwargs` and fields override. An error names the problem when `kwargs`
    /// is not an object, or sets a name vLLM refuses.
    pub fn with_default_kwargs(mut self, kwargs: &str) -> Result<PromptTokenizer, String> {
        let bad = |e: &dyn std::fmt::Display| format!("default_chat_template_kwargs: {e}");
        let raw: &RawValue = serde_json::from_str(kwargs).map_err(|e| bad(&e))?;
        let value = template_value(raw).map_err(|e| bad(&e))?;
        if value.kind() != ValueKind::Map {
            return Err(bad(&"must be a mapping"));
        }
        for name in ["chat_template", "tokenize", "messages"] {
            if value.get_attr(name).is_ok_and(|v| !v.is_undefined()) {
                return Err(bad(&format!("may not set {name:?}")));
            }
        }
        self.default_kwargs = Some(value);
        Ok(self)
    }

    /// Sets the engines' context length (`None`: unknown), what a request's
    /// `truncate_prompt_tokens` of -1 keeps less one ([`crate::truncation`]).
    pub fn set_context_len(&self, context: Option<usize>) {
        self.context_len.store(context.unwrap_or(0), Ordering::Relaxed);
    }

    /// The engines' context length, where known.
    pub fn context_len(&self) -> Option<usize> {
        Some(self.context_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// The tokenizer for engines started with `--exclude-tools-when-tool-choice-none` (or
    /// without): with it, a request's `tool_choice` of `"none"` leaves its tools out.
    pub fn with_exclude_tools_when_tool_choice_none(mut self, exclude: bool) -> PromptTokenizer {
        self.exclude_tools_when_tool_choice_none = exclude;
        self
    }

    /// The special tokens the chat template sees (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special
    }

    /// Renders probe conversations: at least one must render, unless every failure is the
    /// template's own `raise_exception` (a template with rules of its own about roles).
    /// Returns the texts rendered (the piece cache's probes).
    fn probe(&self) -> Result<Vec<String>, String> {
        let conversations = [
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
        let tool = serde_json::json!([{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }}]);
        let with_tools = ChatOptions {
            tools: Some(vllm_tools(&Value::from_serialize(&tool)).map_err(|e| e.to_string())?),
            ..ChatOptions::default()
        };
        let mut rendered = Vec::new();
        for (name, template) in self.templates.loaded() {
            let mut engine_error = None;
            let mut any = false;
            for options in [&ChatOptions::default(), &with_tools] {
                for probe in &conversations {
                    let messages = Value::from_serialize(probe);
                    match self.render_values(&template, &messages, options) {
                        Ok(text) => {
                            any = true;
                            rendered.push(text);
                        }
                        Err(RenderError::Template(err)) if raised(&err) => {}
                        Err(RenderError::Template(err)) => engine_error = Some(describe(&err)),
                        Err(RenderError::Prompt(problem)) => engine_error = Some(problem.0),
                    }
                }
            }
            if let Some(problem) = engine_error.filter(|_| !any) {
                let name = name.map(|name| format!(" {name:?}")).unwrap_or_default();
                return Err(format!(
                    "the chat template{name} cannot be rendered by the native plane's \
                     template engine ({problem}); serve it with data_plane: python"
                ));
            }
        }
        Ok(rendered)
    }

    /// The ids of a `/v1/completions` prompt: a string (encoded with special tokens unless
    /// the request's `add_special_tokens` is false, vLLM's default being true) or a list of
    /// ids (as is); a batch yields its first prompt's. With a `truncation`, the ids the
    /// engine keeps ([`crate::truncation`]).
    pub fn completion_tokens(
        &self,
        prompt: Option<&Json>,
        add_special_tokens: Option<&Json>,
        truncation: Option<Truncation>,
    ) -> Result<Vec<u32>, PromptProblem> {
        let add_special_tokens = match add_special_tokens {
            None | Some(Json::Null) => true,
            Some(Json::Bool(add)) => *add,
            Some(_) => return Err(PromptProblem("add_special_tokens must be a boolean".into())),
        };
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
            Json::String(text) => self.encode_prompt(text, add_special_tokens, truncation),
            Json::Array(ids) => {
                let mut ids = ids
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(bad)?;
                if let Some(truncation) = truncation {
                    truncation.cut(&mut ids);
                }
                Ok(ids)
            }
            _ => Err(bad()),
        }
    }

    /// The ids of a prompt's text as the engine feeds them to its model: encoded with or
    /// without special tokens, then truncated as the request asks.
    fn encode_prompt(
        &self,
        text: &str,
        add_special_tokens: bool,
        truncation: Option<Truncation>,
    ) -> Result<Vec<u32>, PromptProblem> {
        let mut ids = if add_special_tokens {
            self.encode_completion(text)?
        } else {
            self.encode_chat(text)?
        };
        let Some(truncation) = truncation else { return Ok(ids) };
        if ids.len() <= truncation.keep {
            return Ok(ids);
        }
        if add_special_tokens && truncation.side.is_none() {
            // The tokenizer truncates: the text's own ids, leaving room for its special tokens.
            return self.truncated_with_special_tokens(text, &ids, truncation);
        }
        truncation.cut(&mut ids);
        Ok(ids)
    }

    /// `text` encoded with special tokens and truncated by the tokenizer, as transformers
    /// does it for vLLM without a side named (`ids`: its whole encoding).
    fn truncated_with_special_tokens(
        &self,
        text: &str,
        ids: &[u32],
        truncation: Truncation,
    ) -> Result<Vec<u32>, PromptProblem> {
        if let Some((before, after)) = self.pieces.affixes() {
            let content = &ids[before.len()..ids.len() - after.len()];
            return Ok(truncation.cut_within(before, content, after));
        }
        // Which ids the post-processor adds was not proved at load: the tokenizer's own
        // truncation, as transformers asks it of the same library.
        let failed =
            |e: tokenizers::Error| PromptProblem(format!("cannot tokenize the prompt: {e}"));
        let mut encoding = self.tokenizer.encode_fast(text, false).map_err(failed)?;
        let added = self
            .tokenizer
            .get_post_processor()
            .map_or(0, |p| tokenizers::PostProcessor::added_tokens(p, false));
        encoding.truncate(
            truncation.keep.saturating_sub(added),
            0,
            tokenizers::TruncationDirection::Left,
        );
        let encoding = self.tokenizer.post_process(encoding, None, true).map_err(failed)?;
        let mut ids = encoding.get_ids().to_vec();
        truncation.cut(&mut ids);
        Ok(ids)
    }

    /// The ids of a chat request's body: the rendered template ([`ChatRequest::options`]),
    /// encoded without adding special tokens unless the request's `add_special_tokens` says
    /// so. The body is read as the gateway reads it ([`Payload::parse`],
    /// [`ChatRequest::of_payload`]).
    pub fn chat_tokens_of_body(&self, body: &[u8]) -> Result<Vec<u32>, PromptProblem> {
        let payload = Payload::parse(body).map_err(unreadable)?;
        self.chat_tokens(&ChatRequest::of_payload(&payload)?)
    }

    /// The ids of a chat request's fields (see [`PromptTokenizer::chat_tokens_of_body`]).
    pub fn chat_tokens(&self, request: &ChatRequest<'_>) -> Result<Vec<u32>, PromptProblem> {
        let options =
            request.options(self.exclude_tools_when_tool_choice_none, self.context_len())?;
        let messages = template_value(request.messages).map_err(unreadable)?;
        let text = self.render(&messages, &options)?;
        self.encode_prompt(&text, options.add_special_tokens, options.truncation)
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
        let options =
            request.options(self.exclude_tools_when_tool_choice_none, self.context_len())?;
        let messages = template_value(request.messages).map_err(unreadable)?;
        self.render(&messages, &options)
    }

    /// The chat template's text for `messages` (a list of `{role, content}` maps) with the
    /// request's other fields `options`; with a media part, the text up to it
    /// ([`crate::conversation`]).
    pub fn render(&self, messages: &Value, options: &ChatOptions) -> Result<String, PromptProblem> {
        let tools = tools_variable(
            options.extra.as_ref(),
            options.tools.as_ref(),
            self.default_kwargs.as_ref(),
        );
        let template =
            self.templates.choose(&options.template, tools.is_some()).map_err(PromptProblem)?;
        self.render_values(&template, messages, options).map_err(|err| match err {
            RenderError::Prompt(problem) => problem,
            RenderError::Template(err) => {
                PromptProblem(format!("chat template: {}", describe(&err)))
            }
        })
    }

    fn render_values(
        &self,
        template: &ChatTemplate,
        messages: &Value,
        options: &ChatOptions,
    ) -> Result<String, RenderError> {
        let problem = |text: String| RenderError::Prompt(PromptProblem(text));
        let format = self.content_format.unwrap_or(template.content_format);
        let (mut messages, media) =
            template_messages(messages, format, template.developer_role).map_err(problem)?;
        let mut final_text = None;
        if options.continue_final_message {
            let (marked, text) =
                mark_final_message(&messages, template.reads_content).map_err(problem)?;
            messages = marked;
            final_text = Some(text);
        }
        let context = ChatContext {
            messages,
            tools: options.tools.clone(),
            documents: options.documents.clone(),
            defaults: self.default_kwargs.clone(),
            add_generation_prompt: options.add_generation_prompt,
            reasoning: options.reasoning.clone(),
            extra: options.extra.clone(),
            special: self.special_values.clone(),
        };
        let mut text =
            template.render(Value::from_object(context)).map_err(RenderError::Template)?;
        if let Some(final_text) = final_text {
            cut_at_final_mark(&mut text, &final_text).map_err(problem)?;
        }
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
