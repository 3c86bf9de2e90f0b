//! A chat request's messages as vLLM hands them to the chat template, so that the gateway
//! renders the text the engine renders (vLLM 0.32, `vllm/renderers/chat_utils.py` and
//! `vllm/renderers/hf.py`; the behaviour is described here in the project's own words).
//!
//! - Each message the template sees is built anew: `role` and `content`, then `tool_calls`
//!   (an assistant's, unless null; an empty list is dropped and each call's `arguments` JSON
//!   text becomes an object, `{}` when it is not one; a call's fields and its function's in
//!   the order of vLLM's request model, [`TOOL_CALL_FIELDS`]), `reasoning` and
//!   `reasoning_content` (an assistant's `reasoning`, or without one the deprecated
//!   `reasoning_content` vLLM renames to it), `tool_call_id` (a tool's), `name` and `task`
//!   (when strings), `tools` (a developer's). Other keys the client sent are not seen.
//! - Content: a string, a list of parts, or null (no parts). Text-like parts (plain strings,
//!   `text`, `input_text`, `output_text`, `refusal`, `thinking`) give their text, a null one
//!   skipped and an empty one left out of the `string` format's join but kept as a part in
//!   the `openai` format; a `tool_reference` its name; media parts (images, audio, video,
//!   embeddings) are the engine's. A system message's text part starting with Claude Code's
//!   billing header loses that first line.
//! - [`ContentFormat`]: a template that loops over a message's content gets the parts as a
//!   list of `{type, ...}` objects (`openai`); any other gets the texts joined by newlines
//!   (`string`), a tool message's text parts joined in either format.
//! - A `developer` message, when the template never names that role, becomes a system
//!   message, and the system messages are then merged into one at the start.
//! - The request's `tools` as vLLM's request model hands them on ([`vllm_tools`]), and its
//!   `continue_final_message` as transformers does it ([`mark_final_message`],
//!   [`cut_at_final_mark`]).
//! - Media: the engine puts a media part's placeholder tokens in the prompt and hashes the
//!   media into the cache blocks after them, which a gateway cannot reproduce. The first
//!   media part is replaced by [`MEDIA_MARK`] (at the start of its message's content in the
//!   `string` format, where vLLM puts the placeholders, or at the part in the `openai`
//!   format), and the render is cut there ([`cut_at_media`]): the beginning before it is what
//!   another request can share.

use minijinja::machinery::{ast, parse, WhitespaceConfig};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Value, ValueKind};

use crate::chat_values::Members;
use crate::pyvalues::python_str;

/// Stands for the first media part while the template renders; the rendered text is cut
/// where it appears. Private-use characters, so no template writes it and no tokenizer merges
/// across the cut.
pub const MEDIA_MARK: &str = "\u{E000}llmsched:media\u{E001}";

/// The text vLLM puts in place of a `prompt_embeds` part (`openai` format).
const PROMPT_EMBEDS_PLACEHOLDER: &str = "<prompt_embeds>";

/// Text part types and the field holding their text.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// Media part types and their modality (a part without a type is media when it holds one of
/// these fields).
const MEDIA_PARTS: [(&str, &str); 10] = [
    ("image_url", "image"),
    ("input_image", "image"),
    ("image_embeds", "image"),
    ("image_pil", "image"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("audio_embeds", "audio"),
    ("video_url", "video"),
    ("video_embeds", "video"),
    ("prompt_embeds", "prompt_embeds"),
];

/// The fields of the content part types vLLM knows; a part's other fields are copied into
/// the part an `openai` template sees.
const KNOWN_PART_FIELDS: [&str; 18] = [
    "audio_embeds",
    "audio_url",
    "closed",
    "data",
    "file",
    "image_embeds",
    "image_pil",
    "image_url",
    "input_audio",
    "name",
    "prompt_cache_breakpoint",
    "refusal",
    "text",
    "thinking",
    "type",
    "uuid",
    "video_embeds",
    "video_url",
];

/// The first line of a system text Claude Code adds on every request (its value changes on
/// every request, so vLLM drops it to keep the prefix cacheable).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// How a chat template takes a message's list content (vLLM's
/// `--chat-template-content-format`, detected as vLLM detects it: [`ContentFormat::detect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// The texts joined by newlines.
    String,
    /// The parts as `{type, ...}` objects.
    OpenAi,
}

impl ContentFormat {
    /// `openai` when the template loops over a message's content (`for part in
    /// message['content']`, through variables set from the messages, a macro given the
    /// content, or a loop over a variable named `content` outside macros), else `string`; a
    /// template that does not parse is `string`.
    pub fn detect(source: &str) -> ContentFormat {
        let Ok(root) = parse(source, "chat", SyntaxConfig, WhitespaceConfig::default()) else {
            return ContentFormat::String;
        };
        let mut nodes = Nodes::default();
        nodes.stmt(&root, None);
        if nodes.loops_over_content() {
            ContentFormat::OpenAi
        } else {
            ContentFormat::String
        }
    }

    /// The name vLLM gives it.
    pub fn name(self) -> &'static str {
        match self {
            ContentFormat::String => "string",
            ContentFormat::OpenAi => "openai",
        }
    }
}

/// Whether a template adds to a `safe` filter's result (`"..." | safe + text`): on Python that
/// is Jinja's `Markup`, whose `+` HTML-escapes the other operand, and minijinja has no such
/// type, so the native plane would render such a template otherwise (probe 52 F6).
pub fn adds_to_safe_text(source: &str) -> bool {
    let Ok(root) = parse(source, "chat", SyntaxConfig, WhitespaceConfig::default()) else {
        return false;
    };
    let mut nodes = Nodes::default();
    nodes.stmt(&root, None);
    nodes.adds_to_safe
}

/// Whether a template names the `developer` role (as a quoted string anywhere in it).
pub fn names_developer_role(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

/// The messages a template sees for a request's `messages` (see the module documentation),
/// and whether a media part was met.
pub fn template_messages(
    messages: &Value,
    format: ContentFormat,
    developer_role: bool,
) -> Result<(Value, bool), String> {
    let shape = || "messages must be a non-empty list of {role, content} objects".to_owned();
    if messages.kind() != ValueKind::Seq || messages.len() == Some(0) {
        return Err(shape());
    }
    let mut builder = Builder { format, media: false };
    let mut out = Vec::with_capacity(messages.len().unwrap_or(0));
    let mut developer = false;
    // Whether a message was rebuilt (else the list is the template's as it is).
    let mut rebuilt = false;
    for (i, message) in messages.try_iter().map_err(|_| shape())?.enumerate() {
        let role = message.get_attr("role").ok();
        let Some(role) =
            role.as_ref().and_then(Value::as_str).filter(|_| message.kind() == ValueKind::Map)
        else {
            return Err(format!("messages[{i}] must be an object with a string role"));
        };
        developer |= role == "developer";
        match builder.as_sent(role, &message) {
            Some(same) => out.push(same),
            None => {
                rebuilt = true;
                out.push(builder.message(i, role, &message)?);
            }
        }
    }
    if developer && !developer_role {
        out = developer_as_system(out);
    } else if !rebuilt {
        return Ok((messages.clone(), builder.media));
    }
    Ok((Value::from(out), builder.media))
}

/// Cuts a render at [`MEDIA_MARK`]. A template that did not write the marked part (one that
/// leaves some messages out) keeps its whole text.
pub fn cut_at_media(text: &mut String) {
    if let Some(at) = text.find(MEDIA_MARK) {
        text.truncate(at);
    }
}

/// The request's `tools` as vLLM's request model dumps them: each `{type: function,
/// function: {name, description, parameters[, strict][, defer_loading]}}`, absent fields as
/// null, other fields dropped (a tool's own `defer_loading` moves into its function).
pub fn vllm_tools(tools: &Value) -> Result<Value, String> {
    if tools.kind() != ValueKind::Seq {
        return Err("tools must be a list".into());
    }
    let mut out = Vec::new();
    for (i, tool) in tools.try_iter().into_iter().flatten().enumerate() {
        let function = if tool.kind() == ValueKind::Map {
            tool.get_attr("function").unwrap_or_default()
        } else {
            Value::UNDEFINED
        };
        let field =
            |name: &str| function.get_attr(name).ok().filter(|v| !v.is_undefined() && !v.is_none());
        let name = function.get_attr("name").unwrap_or_default();
        if function.kind() != ValueKind::Map || name.kind() != ValueKind::String {
            return Err(format!("tools[{i}] must be an object with a function that has a name"));
        }
        let kind = tool.get_attr("type").unwrap_or_default();
        if !(kind.is_undefined() || kind.is_none() || kind.as_str() == Some("function")) {
            return Err(format!("tools[{i}].type must be 'function'"));
        }
        let description = field("description");
        let parameters = field("parameters");
        let strict = field("strict");
        if description.as_ref().is_some_and(|d| d.kind() != ValueKind::String) {
            return Err(format!("tools[{i}].function.description must be a string"));
        }
        if parameters.as_ref().is_some_and(|p| p.kind() != ValueKind::Map) {
            return Err(format!("tools[{i}].function.parameters must be an object"));
        }
        if strict.as_ref().is_some_and(|s| s.kind() != ValueKind::Bool) {
            return Err(format!("tools[{i}].function.strict must be a boolean"));
        }
        let mut dumped = vec![
            (Value::from("name"), name),
            (Value::from("description"), description.unwrap_or(Value::from(()))),
            (Value::from("parameters"), parameters.unwrap_or(Value::from(()))),
        ];
        if let Some(strict) = strict {
            dumped.push((Value::from("strict"), strict));
        }
        let tool_defer =
            tool.get_attr("defer_loading").ok().filter(|v| !v.is_undefined() && !v.is_none());
        if let Some(defer) = field("defer_loading").or(tool_defer) {
            if defer.kind() != ValueKind::Bool {
                return Err(format!("tools[{i}].defer_loading must be a boolean"));
            }
            dumped.push((Value::from("defer_loading"), defer));
        }
        out.push(Members::value(vec![
            (Value::from("type"), Value::from("function")),
            (Value::from("function"), Members::value(dumped)),
        ]));
    }
    Ok(Value::from(out))
}

/// What transformers appends to the final message to find where it ends in the render.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The messages with transformers' continue tag (`CONTINUE_FINAL_MESSAGE_TAG `) appended to
/// the last one's content (its last text part, for a list), as transformers does for
/// `continue_final_message`, and the text so marked. `reads_content`: whether the
/// template's source names `content` at all.
pub fn mark_final_message(
    messages: &Value,
    reads_content: bool,
) -> Result<(Value, String), String> {
    if !reads_content {
        return Err("continue_final_message is set but the chat template never reads a message's \
                    content"
            .into());
    }
    let mut list: Vec<Value> = messages.try_iter().into_iter().flatten().collect();
    let Some(last) = list.pop() else { return Err("there is no final message".into()) };
    let content = last.get_attr("content").unwrap_or_default();
    let (content, text) = match content.kind() {
        ValueKind::String => {
            let text = content.as_str().unwrap_or("").to_owned();
            (Value::from(format!("{text}{CONTINUE_TAG}")), text)
        }
        ValueKind::Seq => {
            let mut parts: Vec<Value> = content.try_iter().into_iter().flatten().collect();
            let at = parts.iter().rposition(|part| {
                part.kind() == ValueKind::Map
                    && !part.get_attr("text").unwrap_or_default().is_undefined()
            });
            let Some(at) = at else {
                return Err(
                    "continue_final_message is set but the final message has no text".into()
                );
            };
            let text = python_str(&parts[at].get_attr("text").unwrap_or_default());
            parts[at] =
                replace_field(&parts[at], "text", Value::from(format!("{text}{CONTINUE_TAG}")));
            (Value::from(parts), text)
        }
        _ => {
            return Err("continue_final_message is set but the final message has no content".into())
        }
    };
    list.push(replace_field(&last, "content", content));
    Ok((Value::from(list), text))
}

/// Cuts a render where the final message's content ends (transformers' rule: at the tag, or
/// before the spaces the template trimmed off with it).
pub fn cut_at_final_mark(text: &mut String, final_text: &str) -> Result<(), String> {
    let tag = CONTINUE_TAG.trim();
    if !text.contains(final_text.trim()) || !text.contains(tag) {
        return Err("continue_final_message is set but the final message does not appear in the \
                    rendered chat (the template changes it)"
            .into());
    }
    let at = text.rfind(tag).unwrap_or(0);
    if text[at..].starts_with(CONTINUE_TAG) {
        text.truncate(at);
    } else {
        text.truncate(text[..at].trim_end().len());
    }
    Ok(())
}

struct Builder {
    format: ContentFormat,
    /// Whether the first media part was met (and marked).
    media: bool,
}

/// One part of a list content.
enum Part {
    /// Text (None: null or absent, skipped; an empty text is kept in the `openai` format).
    Text(Option<String>),
    /// A tool reference's name (None: absent, skipped).
    ToolReference(Option<String>),
    /// A media part and its modality.
    Media(&'static str),
}

impl Builder {
    /// The message built anew (see the module documentation).
    fn message(&mut self, i: usize, role: &str, message: &Value) -> Result<Value, String> {
        let field = |name: &str| message.get_attr(name).ok().filter(|v| !v.is_undefined());
        let content = field("content");
        let parts: Vec<Value> = match content.as_ref().map(Value::kind) {
            None | Some(ValueKind::None) => Vec::new(),
            Some(ValueKind::String) => vec![content.clone().unwrap_or_default()],
            Some(ValueKind::Seq) => {
                content.iter().flat_map(|c| c.try_iter().into_iter().flatten()).collect()
            }
            Some(_) => {
                return Err(format!("messages[{i}].content must be a string or a list of parts"))
            }
        };
        let parts = if role == "system" { without_billing_header(parts) } else { parts };
        let mut content = match (self.format, content) {
            // A string content kept as it is (no copy), as joining its one text would give.
            (ContentFormat::String, Some(text))
                if text.kind() == ValueKind::String && parts.first() == Some(&text) =>
            {
                text
            }
            _ => self.content(i, &parts)?,
        };
        if role == "tool" {
            content = tool_content(content);
        }
        let mut fields: Vec<(Value, Value)> =
            vec![(Value::from("role"), Value::from(role)), (Value::from("content"), content)];
        match role {
            "assistant" => {
                if let Some(calls) = field("tool_calls").filter(|c| !c.is_none()) {
                    if let Some(calls) = tool_calls(i, &calls)? {
                        fields.push((Value::from("tool_calls"), calls));
                    }
                }
                let reasoning = field("reasoning").filter(|r| !r.is_none());
                // vLLM's request model renames the deprecated field to `reasoning`.
                let reasoning =
                    reasoning.or_else(|| field("reasoning_content").filter(|r| !r.is_none()));
                if let Some(reasoning) = reasoning {
                    fields.push((Value::from("reasoning"), reasoning.clone()));
                    fields.push((Value::from("reasoning_content"), reasoning));
                }
            }
            "tool" => {
                if let Some(id) = field("tool_call_id") {
                    fields.push((Value::from("tool_call_id"), id));
                }
            }
            _ => {}
        }
        for key in ["name", "task"] {
            if let Some(text) = field(key).filter(|v| v.kind() == ValueKind::String) {
                fields.push((Value::from(key), text));
            }
        }
        if role == "developer" {
            fields.push((Value::from("tools"), field("tools").unwrap_or(Value::from(()))));
        }
        Ok(Members::value(fields))
    }

    /// The message itself when vLLM would build the same (`role`, a string `content`, and a
    /// string `name`, in that order; no media, no header to drop, no developer), so that a
    /// plain conversation is not copied.
    fn as_sent(&self, role: &str, message: &Value) -> Option<Value> {
        if self.format == ContentFormat::OpenAi || role == "developer" {
            return None;
        }
        // A small object as the request's JSON made it (larger ones are rebuilt).
        let entries = message.downcast_object_ref::<Members>()?.entries();
        let key = |i: usize| entries.get(i).and_then(|(key, _)| key.as_str());
        let string = |i: usize| entries.get(i).filter(|(_, v)| v.kind() == ValueKind::String);
        let as_vllm_orders_it = match entries.len() {
            2 => true,
            3 => key(2) == Some("name") && string(2).is_some(),
            _ => false,
        };
        if !as_vllm_orders_it || key(0) != Some("role") || key(1) != Some("content") {
            return None;
        }
        let text = string(1)?.1.as_str()?;
        if role == "system" && text.starts_with(BILLING_HEADER) {
            return None;
        }
        Some(message.clone())
    }

    /// A message's content from its parts, in the template's format.
    fn content(&mut self, i: usize, parts: &[Value]) -> Result<Value, String> {
        let mut texts: Vec<String> = Vec::new();
        let mut items: Vec<Value> = Vec::new();
        let mut media_here = false;
        for (j, part) in parts.iter().enumerate() {
            let kind = content_part(part)
                .map_err(|problem| format!("messages[{i}].content[{j}] {problem}"))?;
            match (self.format, kind) {
                (ContentFormat::String, Part::Text(text) | Part::ToolReference(text)) => {
                    texts.extend(text.filter(|t| !t.is_empty()));
                }
                (ContentFormat::String, Part::Media(_)) => media_here = true,
                (ContentFormat::OpenAi, Part::Text(Some(text))) => {
                    items.push(text_part(&text, Some(part)));
                }
                (ContentFormat::OpenAi, Part::ToolReference(Some(name))) => {
                    items.push(Members::value(vec![
                        (Value::from("type"), Value::from("tool_reference")),
                        (Value::from("name"), Value::from(name)),
                    ]));
                }
                (ContentFormat::OpenAi, Part::Text(None) | Part::ToolReference(None)) => {}
                (ContentFormat::OpenAi, Part::Media(modality)) => {
                    if !self.media {
                        self.media = true;
                        items.push(text_part(MEDIA_MARK, None));
                    } else if modality == "prompt_embeds" {
                        items.push(text_part(PROMPT_EMBEDS_PLACEHOLDER, None));
                    } else {
                        let mut fields = vec![(Value::from("type"), Value::from(modality))];
                        fields.extend(extra_fields(part));
                        items.push(Members::value(fields));
                    }
                }
            }
        }
        Ok(match self.format {
            ContentFormat::OpenAi => Value::from(items),
            ContentFormat::String if media_here && !self.media => {
                self.media = true;
                Value::from(MEDIA_MARK)
            }
            ContentFormat::String => Value::from(texts.join("\n")),
        })
    }
}

/// A `{type: text, text}` part, with the fields of `part` vLLM does not know.
fn text_part(text: &str, part: Option<&Value>) -> Value {
    let mut fields =
        vec![(Value::from("type"), Value::from("text")), (Value::from("text"), Value::from(text))];
    if let Some(part) = part {
        fields.extend(extra_fields(part));
    }
    Members::value(fields)
}

fn extra_fields(part: &Value) -> Vec<(Value, Value)> {
    if part.kind() != ValueKind::Map {
        return Vec::new();
    }
    let keys = part.try_iter().into_iter().flatten();
    keys.filter(|key| key.as_str().is_some_and(|k| !KNOWN_PART_FIELDS.contains(&k)))
        .map(|key| {
            let value = part.get_item(&key).unwrap_or_default();
            (key, value)
        })
        .collect()
}

fn content_part(part: &Value) -> Result<Part, String> {
    let text_of = |value: Value| match value.kind() {
        ValueKind::Undefined | ValueKind::None => None,
        _ => Some(python_str(&value)),
    };
    match part.kind() {
        ValueKind::String => return Ok(Part::Text(text_of(part.clone()))),
        ValueKind::Map => {}
        _ => return Err("must be a string or an object with a type".into()),
    }
    let field = |name: &str| part.get_attr(name).unwrap_or_default();
    let kind = field("type");
    match kind.kind() {
        ValueKind::String => {
            let kind = kind.as_str().unwrap_or("");
            if let Some((_, text)) = TEXT_PARTS.iter().find(|(name, _)| *name == kind) {
                return Ok(Part::Text(text_of(field(text))));
            }
            if kind == "tool_reference" {
                return Ok(Part::ToolReference(text_of(field("name"))));
            }
            if let Some((_, modality)) = MEDIA_PARTS.iter().find(|(name, _)| *name == kind) {
                return Ok(Part::Media(modality));
            }
            Err(format!("unsupported content part type {kind:?}"))
        }
        ValueKind::Undefined | ValueKind::None => {
            let holds = |name: &str| !field(name).is_undefined();
            if let Some((_, modality)) = MEDIA_PARTS.iter().find(|(name, _)| holds(name)) {
                Ok(Part::Media(modality))
            } else if holds("tool_reference") {
                Ok(Part::ToolReference(text_of(field("tool_reference"))))
            } else {
                Err("has no 'type'".into())
            }
        }
        _ => Err("'type' must be a string".into()),
    }
}

/// A system message's parts without Claude Code's billing header line (a text part that is
/// only that line is dropped).
fn without_billing_header(parts: Vec<Value>) -> Vec<Value> {
    parts
        .into_iter()
        .filter_map(|part| {
            let text = if part.kind() == ValueKind::String {
                part.as_str().map(str::to_owned)
            } else if part.kind() == ValueKind::Map
                && part.get_attr("type").ok().as_ref().and_then(Value::as_str) == Some("text")
            {
                part.get_attr("text").ok().and_then(|t| t.as_str().map(str::to_owned))
            } else {
                None
            };
            let Some(text) = text.filter(|t| t.starts_with(BILLING_HEADER)) else {
                return Some(part);
            };
            let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
            if rest.is_empty() {
                return None;
            }
            if part.kind() == ValueKind::String {
                return Some(Value::from(rest));
            }
            Some(replace_field(&part, "text", Value::from(rest)))
        })
        .collect()
}

/// A tool message's list content: its texts joined by newlines when every part is text.
fn tool_content(content: Value) -> Value {
    if content.kind() != ValueKind::Seq {
        return content;
    }
    let items: Vec<Value> = content.try_iter().into_iter().flatten().collect();
    let is_text =
        |item: &Value| item.get_attr("type").ok().as_ref().and_then(Value::as_str) == Some("text");
    if !items.iter().all(is_text) {
        return content;
    }
    let texts: Vec<String> = items
        .iter()
        .map(|item| item.get_attr("text").ok().map(|t| python_str(&t)).unwrap_or_default())
        .collect();
    Value::from(texts.join("\n"))
}

/// An assistant's `tool_calls` as the template sees them (None: an empty list, dropped; a
/// value that is not a list is left as it is).
fn tool_calls(i: usize, calls: &Value) -> Result<Option<Value>, String> {
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    if calls.len() == Some(0) {
        return Ok(None);
    }
    let bad = |what: &str| format!("messages[{i}].tool_calls: {what}");
    let mut out = Vec::new();
    for call in calls.try_iter().into_iter().flatten() {
        if call.kind() != ValueKind::Map {
            return Err(bad("entries must be objects"));
        }
        let kind = call.get_attr("type").unwrap_or_default();
        let function = call.get_attr("function").unwrap_or_default();
        let is_function = kind.is_undefined() || kind.as_str() == Some("function");
        if !is_function || function.kind() != ValueKind::Map {
            return Err(bad("only calls of type 'function' are supported"));
        }
        let arguments = arguments_object(&function.get_attr("arguments").unwrap_or_default());
        let function = replace_field(&function, "arguments", arguments);
        let function = in_field_order(&function, FUNCTION_FIELDS);
        out.push(in_field_order(&replace_field(&call, "function", function), TOOL_CALL_FIELDS));
    }
    Ok(Some(Value::from(out)))
}

/// The fields of a tool call in the order vLLM's request model (the OpenAI `TypedDict`s,
/// validated by pydantic) hands them to the template, whatever order the request sent them
/// in: a template writing a call with `tojson` writes them so. [`FUNCTION_FIELDS`]: its
/// function's.
pub const TOOL_CALL_FIELDS: &[&str] = &["id", "function", "type"];
/// See [`TOOL_CALL_FIELDS`].
pub const FUNCTION_FIELDS: &[&str] = &["arguments", "name"];

/// Map `value` with its `fields` first, in that order, then its other keys as they came.
fn in_field_order(value: &Value, fields: &[&str]) -> Value {
    let keys: Vec<Value> = value.try_iter().into_iter().flatten().collect();
    let rank = |key: &Value| {
        key.as_str().and_then(|k| fields.iter().position(|f| *f == k)).unwrap_or(fields.len())
    };
    let mut ordered: Vec<(usize, Value)> = keys.into_iter().map(|k| (rank(&k), k)).collect();
    // A stable sort: the other keys keep their order after the named ones.
    ordered.sort_by_key(|(rank, _)| *rank);
    let members = ordered
        .into_iter()
        .map(|(_, key)| {
            let item = value.get_item(&key).unwrap_or_default();
            (key, item)
        })
        .collect();
    Members::value(members)
}

/// A call's `arguments` as an object: an object as it is, a JSON text of an object read, and
/// anything else (empty, null, not JSON, not an object) `{}`.
fn arguments_object(arguments: &Value) -> Value {
    if arguments.kind() == ValueKind::Map {
        return arguments.clone();
    }
    let parsed = match arguments.as_str().filter(|_| arguments.kind() == ValueKind::String) {
        Some(text) => serde_json::from_str::<&serde_json::value::RawValue>(text)
            .ok()
            .and_then(|raw| crate::chat_values::template_value(raw).ok()),
        None => None,
    };
    parsed.filter(|v| v.kind() == ValueKind::Map).unwrap_or_else(|| Members::value(Vec::new()))
}

/// A copy of map `value` with `key` set to `new` (in its place, or added last).
fn replace_field(value: &Value, key: &str, new: Value) -> Value {
    let mut fields: Vec<(Value, Value)> = value
        .try_iter()
        .into_iter()
        .flatten()
        .filter(|k| k.as_str() != Some(key))
        .map(|k| {
            let v = value.get_item(&k).unwrap_or_default();
            (k, v)
        })
        .collect();
    let at = value.try_iter().into_iter().flatten().position(|k| k.as_str() == Some(key));
    fields.insert(at.unwrap_or(fields.len()), (Value::from(key), new));
    Members::value(fields)
}

/// Developer messages as system messages, then the system messages merged into one at the
/// start (their texts joined by a blank line, empty ones left out) when there is more than
/// one or one is not first.
fn developer_as_system(messages: Vec<Value>) -> Vec<Value> {
    let role_of = |m: &Value| m.get_attr("role").ok().and_then(|r| r.as_str().map(str::to_owned));
    let messages: Vec<Value> = messages
        .into_iter()
        .map(|message| {
            if role_of(&message).as_deref() != Some("developer") {
                return message;
            }
            let keys = message.try_iter().into_iter().flatten();
            let fields = keys
                .filter(|key| key.as_str() != Some("tools"))
                .map(|key| {
                    let value = if key.as_str() == Some("role") {
                        Value::from("system")
                    } else {
                        message.get_item(&key).unwrap_or_default()
                    };
                    (key, value)
                })
                .collect();
            Members::value(fields)
        })
        .collect();
    let systems: Vec<usize> = (0..messages.len())
        .filter(|&i| role_of(&messages[i]).as_deref() == Some("system"))
        .collect();
    if !(systems.len() > 1 || systems.first().is_some_and(|&i| i > 0)) {
        return messages;
    }
    let texts: Vec<String> = systems
        .iter()
        .map(|&i| system_text(&messages[i].get_attr("content").unwrap_or_default()))
        .filter(|text| !text.is_empty())
        .collect();
    let merged = Members::value(vec![
        (Value::from("role"), Value::from("system")),
        (Value::from("content"), Value::from(texts.join("\n\n"))),
    ]);
    let mut out = vec![merged];
    out.extend(
        messages.into_iter().enumerate().filter(|(i, _)| !systems.contains(i)).map(|(_, m)| m),
    );
    out
}

/// A system message's content as one text (a list's text parts joined by newlines).
fn system_text(content: &Value) -> String {
    match content.kind() {
        ValueKind::String => content.as_str().unwrap_or("").to_owned(),
        ValueKind::Seq => content
            .try_iter()
            .into_iter()
            .flatten()
            .filter_map(|part| {
                if part.kind() == ValueKind::String {
                    return part.as_str().map(str::to_owned);
                }
                let text = part.get_attr("text").ok().filter(|t| !t.is_undefined())?;
                Some(python_str(&text))
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// What [`ContentFormat::detect`] collects of a template: its loops, `set` statements, macros
/// and calls, each loop with the macro it is in.
#[derive(Default)]
struct Nodes<'a> {
    loops: Vec<(&'a ast::ForLoop<'a>, Option<usize>)>,
    sets: Vec<&'a ast::Set<'a>>,
    macros: Vec<&'a ast::Macro<'a>>,
    calls: Vec<&'a ast::Call<'a>>,
    /// An addition with a `safe` filter's result as an operand ([`adds_to_safe_text`]).
    adds_to_safe: bool,
}

impl<'a> Nodes<'a> {
    fn stmts(&mut self, stmts: &'a [ast::Stmt<'a>], in_macro: Option<usize>) {
        for stmt in stmts {
            self.stmt(stmt, in_macro);
        }
    }

    fn stmt(&mut self, stmt: &'a ast::Stmt<'a>, in_macro: Option<usize>) {
        use ast::Stmt;
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children, in_macro),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(f) => {
                self.loops.push((f, in_macro));
                self.expr(&f.target);
                self.expr(&f.iter);
                if let Some(filter) = &f.filter_expr {
                    self.expr(filter);
                }
                self.stmts(&f.body, in_macro);
                self.stmts(&f.else_body, in_macro);
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr);
                self.stmts(&c.true_body, in_macro);
                self.stmts(&c.false_body, in_macro);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.expr(target);
                    self.expr(value);
                }
                self.stmts(&w.body, in_macro);
            }
            Stmt::Set(s) => {
                self.sets.push(s);
                self.expr(&s.target);
                self.expr(&s.expr);
            }
            Stmt::SetBlock(s) => {
                if let Some(filter) = &s.filter {
                    self.expr(filter);
                }
                self.stmts(&s.body, in_macro);
            }
            Stmt::AutoEscape(a) => {
                self.expr(&a.enabled);
                self.stmts(&a.body, in_macro);
            }
            Stmt::FilterBlock(f) => {
                self.expr(&f.filter);
                self.stmts(&f.body, in_macro);
            }
            Stmt::Block(b) => self.stmts(&b.body, in_macro),
            Stmt::Import(i) => {
                self.expr(&i.expr);
                self.expr(&i.name);
            }
            Stmt::FromImport(i) => self.expr(&i.expr),
            Stmt::Extends(e) => self.expr(&e.name),
            Stmt::Include(i) => self.expr(&i.name),
            Stmt::Macro(m) => self.macro_decl(m),
            // A call block's body is no macro in Jinja's own tree (vLLM's rule reads that).
            Stmt::CallBlock(c) => {
                self.call(&c.call);
                for default in &c.macro_decl.defaults {
                    self.expr(default);
                }
                self.stmts(&c.macro_decl.body, in_macro);
            }
            Stmt::Do(d) => self.call(&d.call),
        }
    }

    fn macro_decl(&mut self, m: &'a ast::Macro<'a>) {
        self.macros.push(m);
        let id = self.macros.len() - 1;
        for default in &m.defaults {
            self.expr(default);
        }
        self.stmts(&m.body, Some(id));
    }

    fn call(&mut self, call: &'a ast::Call<'a>) {
        self.calls.push(call);
        self.expr(&call.expr);
        for arg in &call.args {
            self.call_arg(arg);
        }
    }

    fn call_arg(&mut self, arg: &'a ast::CallArg<'a>) {
        match arg {
            ast::CallArg::Pos(e)
            | ast::CallArg::Kwarg(_, e)
            | ast::CallArg::PosSplat(e)
            | ast::CallArg::KwargSplat(e) => self.expr(e),
        }
    }

    fn expr(&mut self, expr: &'a ast::Expr<'a>) {
        use ast::Expr;
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for e in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(e);
                }
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                let safe = |e: &ast::Expr<'_>| matches!(e, Expr::Filter(f) if f.name == "safe");
                if matches!(b.op, ast::BinOpKind::Add) && (safe(&b.left) || safe(&b.right)) {
                    self.adds_to_safe = true;
                }
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(e) = &i.false_expr {
                    self.expr(e);
                }
            }
            Expr::Filter(f) => {
                if let Some(e) = &f.expr {
                    self.expr(e);
                }
                for arg in &f.args {
                    self.call_arg(arg);
                }
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                for arg in &t.args {
                    self.call_arg(arg);
                }
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(c) => self.call(c),
            Expr::List(l) => {
                for e in &l.items {
                    self.expr(e);
                }
            }
            Expr::Map(m) => {
                for e in m.keys.iter().chain(&m.values) {
                    self.expr(e);
                }
            }
        }
    }

    /// vLLM's rule: the names bound to the messages (`messages` and variables set from it
    /// or its slices, filtered or tested), the targets of loops over them, and then a loop
    /// over one of those targets' `content`, over a macro parameter given such a content,
    /// or over a variable named `content` outside macros.
    fn loops_over_content(&self) -> bool {
        let mut message_lists = vec!["messages"];
        let mut at = 0;
        while at < message_lists.len() {
            let name = message_lists[at];
            at += 1;
            for set in &self.sets {
                if refers_to(&set.expr, name, None) {
                    let ast::Expr::Var(target) = &set.target else { return false };
                    if !message_lists.contains(&target.id) {
                        message_lists.push(target.id);
                    }
                }
            }
        }
        let mut messages = Vec::new();
        for (f, _) in &self.loops {
            if message_lists.iter().any(|name| refers_to(&f.iter, name, None)) {
                let ast::Expr::Var(target) = &f.target else { return false };
                messages.push(target.id);
            }
        }
        let is_content =
            |e: &ast::Expr<'_>| messages.iter().any(|m| refers_to(e, m, Some("content")));
        let mut content_params: Vec<(usize, Vec<&str>)> = Vec::new();
        for (id, m) in self.macros.iter().enumerate() {
            let params: Vec<&str> = m
                .args
                .iter()
                .filter_map(|a| if let ast::Expr::Var(v) = a { Some(v.id) } else { None })
                .collect();
            let mut given = Vec::new();
            for call in &self.calls {
                if !matches!(&call.expr, ast::Expr::Var(v) if v.id == m.name) {
                    continue;
                }
                let mut position = 0;
                for arg in &call.args {
                    match arg {
                        ast::CallArg::Pos(e) => {
                            if is_content(e) {
                                if let Some(p) = params.get(position) {
                                    given.push(*p);
                                }
                            }
                            position += 1;
                        }
                        ast::CallArg::Kwarg(key, e) if params.contains(key) && is_content(e) => {
                            given.push(*key);
                        }
                        _ => {}
                    }
                }
            }
            if !given.is_empty() {
                content_params.push((id, given));
            }
        }
        let over_content = |f: &ast::ForLoop<'_>, in_macro: &Option<usize>| {
            if is_content(&f.iter) {
                return true;
            }
            let ast::Expr::Var(iter) = &f.iter else { return false };
            match in_macro {
                Some(id) => {
                    content_params.iter().any(|(m, params)| m == id && params.contains(&iter.id))
                }
                None => iter.id == "content",
            }
        };
        // The first such loop decides; one whose target is not a name makes vLLM's detection
        // fail, which reads as `string`.
        self.loops
            .iter()
            .find(|(f, in_macro)| over_content(f, in_macro))
            .is_some_and(|(f, _)| matches!(f.target, ast::Expr::Var(_)))
    }
}

/// Whether `expr` is variable `name` (or its `key` member, `name.key` or `name['key']`),
/// possibly sliced, filtered or tested.
fn refers_to(expr: &ast::Expr<'_>, name: &str, key: Option<&str>) -> bool {
    use ast::Expr;
    match expr {
        Expr::Filter(f) => f.expr.as_ref().is_some_and(|e| refers_to(e, name, key)),
        Expr::Test(t) => refers_to(&t.expr, name, key),
        Expr::Slice(s) => refers_to(&s.expr, name, key),
        _ => match key {
            None => matches!(expr, Expr::Var(v) if v.id == name),
            Some(key) => match expr {
                Expr::GetAttr(g) => {
                    g.name == key && matches!(&g.expr, Expr::Var(v) if v.id == name)
                }
                Expr::GetItem(g) => {
                    matches!(&g.expr, Expr::Var(v) if v.id == name)
                        && matches!(&g.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
                }
                _ => false,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let problem = template_messages(&messages, ContentFormat::String, true).unwrap_err();
            assert!(problem.contains(needle), "{bad}: {problem}");
        }
        let messages: Value = serde_json::from_str(
            r#"[{"role": "user", "name": "n", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]"#,
        )
        .unwrap();
        let (reduced, media) = template_messages(&messages, ContentFormat::String, true).unwrap();
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
        let (reduced, media) = template_messages(&messages, ContentFormat::String, true).unwrap();
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
            let (reduced, media) =
                template_messages(&messages, ContentFormat::String, true).unwrap();
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

    fn messages(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    fn item(list: &Value, i: i64) -> Value {
        list.get_item(&Value::from(i)).unwrap()
    }

    #[test]
    fn content_format_is_detected_as_vllm_detects_it() {
        for (template, format) in [
            ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
            ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
            ("{% for m in messages %}{% for p in m.content | selectattr('type') %}x{% endfor %}{% endfor %}", "openai"),
            ("{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content %}{% endfor %}{% endfor %}", "openai"),
            ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}", "openai"),
            ("{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}", "openai"),
            ("{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(c=m['content']) }}{% endfor %}", "openai"),
            ("{% macro r(content) %}{% for p in content %}{% endfor %}{% endmacro %}{% for m in messages %}{{ r('x') }}{% endfor %}", "string"),
            ("{% for m in messages %}{% for k, v in m.content %}{% endfor %}{% endfor %}", "string"),
            ("{% for m in messages %}{% for p in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
            ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),
            ("{% for p in messages[0]['content'] %}{% endfor %}", "string"),
            ("{% for %}", "string"),
        ] {
            assert_eq!(ContentFormat::detect(template).name(), format, "{template}");
        }
    }

    #[test]
    fn messages_carry_only_what_vllm_gives_the_template() {
        let (out, media) = template_messages(
            &messages(
                r#"[{"content": "hi", "role": "user", "extra": 1, "name": 5},
                   {"role": "assistant", "content": "", "reasoning": "think", "tool_calls": [
                       {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                       {"function": {"name": "g", "arguments": "not json"}},
                       {"function": {"name": "h", "arguments": "[1]"}}]},
                   {"role": "tool", "content": [{"type": "text", "text": "a"}, "b"], "tool_call_id": "a", "name": "t"}]"#,
            ),
            ContentFormat::String,
            true,
        )
        .unwrap();
        assert!(!media);
        let user = item(&out, 0);
        let keys: Vec<String> = user.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["role", "content"]);
        let assistant = item(&out, 1);
        assert_eq!(assistant.get_attr("reasoning_content").unwrap().as_str(), Some("think"));
        let calls = assistant.get_attr("tool_calls").unwrap();
        let arguments =
            |i: i64| item(&calls, i).get_attr("function").unwrap().get_attr("arguments").unwrap();
        assert_eq!(arguments(0).get_attr("x").unwrap(), Value::from(1));
        assert_eq!(arguments(1).len(), Some(0));
        assert_eq!(arguments(2).len(), Some(0));
        assert_eq!(item(&calls, 0).get_attr("id").unwrap().as_str(), Some("a"));
        let tool = item(&out, 2);
        assert_eq!(tool.get_attr("content").unwrap().as_str(), Some("a\nb"));
        assert_eq!(tool.get_attr("tool_call_id").unwrap().as_str(), Some("a"));
        assert_eq!(tool.get_attr("name").unwrap().as_str(), Some("t"));
        let problem = template_messages(
            &messages(
                r#"[{"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]}]"#,
            ),
            ContentFormat::String,
            true,
        )
        .unwrap_err();
        assert!(problem.contains("only calls of type 'function'"), "{problem}");
    }

    #[test]
    fn reasoning_content_empty_parts_and_call_fields_as_vllm_builds_them() {
        let (out, _) = template_messages(
            &messages(
                r#"[{"role": "user", "content": ""},
                   {"role": "assistant", "content": [{"type": "text", "text": ""}, "x"],
                    "reasoning_content": "rc", "tool_calls": [
                       {"type": "function", "index": 0, "function": {"extra": 1, "name": "f", "arguments": "{}"}, "id": "a"}]},
                   {"role": "assistant", "content": "y", "reasoning": "r", "reasoning_content": "rc"}]"#,
            ),
            ContentFormat::OpenAi,
            true,
        )
        .unwrap();
        let keys =
            |v: &Value| -> Vec<String> { v.try_iter().unwrap().map(|k| k.to_string()).collect() };
        let empty = item(&out, 0).get_attr("content").unwrap();
        assert_eq!(empty.len(), Some(1));
        assert_eq!(item(&empty, 0).get_attr("text").unwrap().as_str(), Some(""));
        let assistant = item(&out, 1);
        assert_eq!(assistant.get_attr("content").unwrap().len(), Some(2));
        assert_eq!(assistant.get_attr("reasoning").unwrap().as_str(), Some("rc"));
        assert_eq!(assistant.get_attr("reasoning_content").unwrap().as_str(), Some("rc"));
        let call = item(&assistant.get_attr("tool_calls").unwrap(), 0);
        assert_eq!(keys(&call), ["id", "function", "type", "index"]);
        assert_eq!(keys(&call.get_attr("function").unwrap()), ["arguments", "name", "extra"]);
        assert_eq!(item(&out, 2).get_attr("reasoning_content").unwrap().as_str(), Some("r"));
        // The string format still leaves an empty text out of the join.
        let (out, _) = template_messages(
            &messages(r#"[{"role": "user", "content": [{"type": "text", "text": ""}, "x"]}]"#),
            ContentFormat::String,
            true,
        )
        .unwrap();
        assert_eq!(item(&out, 0).get_attr("content").unwrap().as_str(), Some("x"));
    }

    #[test]
    fn openai_format_parts_and_the_media_mark() {
        let (out, media) = template_messages(
            &messages(
                r#"[{"role": "user", "content": "plain"},
                   {"role": "user", "content": [{"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                       {"type": "image_url", "image_url": {"url": "u"}}, {"type": "input_audio", "input_audio": {}}]}]"#,
            ),
            ContentFormat::OpenAi,
            true,
        )
        .unwrap();
        assert!(media);
        let first = item(&out, 0).get_attr("content").unwrap();
        assert_eq!(item(&first, 0).get_attr("text").unwrap().as_str(), Some("plain"));
        let second = item(&out, 1).get_attr("content").unwrap();
        assert_eq!(second.len(), Some(3));
        assert!(!item(&second, 0).get_attr("cache_control").unwrap().is_undefined());
        assert_eq!(item(&second, 1).get_attr("text").unwrap().as_str(), Some(MEDIA_MARK));
        assert_eq!(item(&second, 2).get_attr("type").unwrap().as_str(), Some("audio"));
    }

    #[test]
    fn developer_messages_become_one_system_message_unless_the_template_names_the_role() {
        let sent = messages(
            r#"[{"role": "system", "content": "a"}, {"role": "user", "content": "u"},
               {"role": "developer", "content": "d", "tools": []}, {"role": "system", "content": ""}]"#,
        );
        let (out, _) = template_messages(&sent, ContentFormat::String, false).unwrap();
        assert_eq!(out.len(), Some(2));
        assert_eq!(item(&out, 0).get_attr("content").unwrap().as_str(), Some("a\n\nd"));
        assert_eq!(item(&out, 1).get_attr("role").unwrap().as_str(), Some("user"));
        let (kept, _) = template_messages(&sent, ContentFormat::String, true).unwrap();
        assert_eq!(kept.len(), Some(4));
        assert_eq!(item(&kept, 2).get_attr("role").unwrap().as_str(), Some("developer"));
        assert!(names_developer_role("{% if m.role == 'developer' %}"));
        assert!(!names_developer_role("{{ developer }}"));
    }

    #[test]
    fn claude_codes_billing_header_line_is_dropped_from_system_text() {
        let (out, _) = template_messages(
            &messages(
                r#"[{"role": "system", "content": "x-anthropic-billing-header: cch=1\nbe brief"}]"#,
            ),
            ContentFormat::String,
            true,
        )
        .unwrap();
        assert_eq!(item(&out, 0).get_attr("content").unwrap().as_str(), Some("be brief"));
    }

    #[test]
    fn tools_are_dumped_as_vllms_request_model_dumps_them() {
        let tools = vllm_tools(&messages(
            r#"[{"function": {"name": "f", "extra": 1}, "other": 2, "defer_loading": true},
               {"type": "function", "function": {"name": "g", "description": "d", "parameters": {"b": 1}, "strict": true}}]"#,
        ))
        .unwrap();
        let function = |i: i64| item(&tools, i).get_attr("function").unwrap();
        let keys = |v: Value| v.try_iter().unwrap().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!(keys(item(&tools, 0)), ["type", "function"]);
        assert_eq!(keys(function(0)), ["name", "description", "parameters", "defer_loading"]);
        assert!(function(0).get_attr("description").unwrap().is_none());
        assert_eq!(keys(function(1)), ["name", "description", "parameters", "strict"]);
        for (bad, problem) in [
            (r#"{"a": 1}"#, "tools must be a list"),
            (r#"[{"type": "code", "function": {"name": "f"}}]"#, "tools[0].type"),
            (r#"[{"function": {"name": 1}}]"#, "must be an object with a function"),
            (r#"[{"function": {"name": "f", "parameters": []}}]"#, "parameters must be an object"),
        ] {
            assert!(vllm_tools(&messages(bad)).unwrap_err().contains(problem), "{bad}");
        }
    }

    #[test]
    fn the_final_message_is_marked_and_the_render_cut_as_transformers_does() {
        let sent = messages(
            r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once  "}]"#,
        );
        let (marked, text) = mark_final_message(&sent, true).unwrap();
        assert_eq!(text, "Once  ");
        let last = item(&marked, 1).get_attr("content").unwrap();
        assert_eq!(last.as_str(), Some("Once  CONTINUE_FINAL_MESSAGE_TAG "));
        // A template that keeps the spacing, and one that trims the content.
        let mut kept = "<a>Once  CONTINUE_FINAL_MESSAGE_TAG </s>".to_owned();
        cut_at_final_mark(&mut kept, &text).unwrap();
        assert_eq!(kept, "<a>Once  ");
        let mut trimmed = "<a>Once  CONTINUE_FINAL_MESSAGE_TAG</s>".to_owned();
        cut_at_final_mark(&mut trimmed, &text).unwrap();
        assert_eq!(trimmed, "<a>Once");
        let mut dropped = "<a></s>".to_owned();
        assert!(cut_at_final_mark(&mut dropped, &text).is_err());
        assert!(mark_final_message(&sent, false).is_err());
        let parts = messages(
            r#"[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]"#,
        );
        let (marked, text) = mark_final_message(&parts, true).unwrap();
        assert_eq!(text, "a");
        let content = item(&marked, 0).get_attr("content").unwrap();
        assert_eq!(
            item(&content, 0).get_attr("text").unwrap().as_str(),
            Some("aCONTINUE_FINAL_MESSAGE_TAG ")
        );
    }
}
