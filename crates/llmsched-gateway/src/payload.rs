//! A completion request's body as the gateway reads it: parsed once, borrowing from the bytes.
//!
//! The gateway forwards the body unchanged and reads a few fields of it (`model`, `stream`,
//! the prompt or the messages, and the sampling fields it checks). Building a
//! `serde_json::Value` of the whole body copied every string (a 1,000-token prompt is a few
//! kilobytes) into its own allocation and every key into a map; here one pass keeps each field
//! the gateway reads as the raw JSON text it was sent as (`&RawValue`, no copy) and skips the
//! others, and a field is decoded only when it is read.
//!
//! What is refused is what a full parse into `serde_json::Value` refused, except numbers
//! outside `f64`'s range, which are now forwarded as sent (the engine parses them; Python's
//! `json` reads them as infinities): a body that is not JSON, or not UTF-8; a body that is
//! not a JSON object ([`Problem::NotObject`]); a lone surrogate escape anywhere (checked by a
//! full parse only when the body has a surrogate escape at all), named as the Python plane
//! names it ([`Problem::LoneSurrogate`]: the path of the first string holding one, in the
//! body's order); nesting deeper than serde_json's recursion limit or than [`MAX_DEPTH`]
//! ([`Problem::Nested`]). As with `Value`, a repeated key keeps its last value.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;

use crate::json_scan;

/// The UTF-8 byte order mark, which a body may start with (Python's `json.loads` of bytes,
/// vLLM's reading, skips it): the gateway reads and forwards the body without it.
pub const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// `UTF-16` or `UTF-32` when a body that is not UTF-8 JSON is JSON in one of those (its byte
/// order mark, or the zero bytes beside its first ASCII character), read as Python's
/// `json.detect_encoding` reads them: such a body is refused by name rather than
/// transcoded (the gateway forwards bodies as sent).
pub fn wide_encoding(raw: &[u8]) -> Option<&'static str> {
    match raw {
        [0xFF, 0xFE, 0, 0, ..] | [0, 0, 0xFE, 0xFF, ..] => Some("UTF-32"),
        [0xFF, 0xFE, ..] | [0xFE, 0xFF, ..] => Some("UTF-16"),
        [0, 0, _, _, ..] | [_, 0, 0, 0, ..] => Some("UTF-32"),
        [0, _, ..] | [_, 0, ..] => Some("UTF-16"),
        _ => None,
    }
}

/// Deepest nesting of arrays and objects accepted (chat content parts and tool schemas need a
/// few levels).
pub const MAX_DEPTH: usize = 64;

/// Why a body cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub enum Problem {
    /// Not JSON (or not UTF-8).
    NotJson,
    /// JSON whose string at `path` (`messages[0].content`; empty: the body) holds a lone
    /// surrogate escape (`"\ud800"`: JSON, but no UTF-8 text), in a key of the object at
    /// `path` when `in_key`.
    LoneSurrogate {
        /// Where, spelt as the Python plane spells it.
        path: String,
        /// In a key of the object at `path` rather than in the string at `path`.
        in_key: bool,
    },
    /// JSON, but not an object.
    NotObject,
    /// Nested past [`MAX_DEPTH`] (or serde_json's own recursion limit).
    Nested,
    /// Not JSON in UTF-8: JSON in UTF-16 or UTF-32 (named), which the gateway does not
    /// transcode ([`wide_encoding`]).
    Encoding(&'static str),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Problem::NotJson => "the body is not valid JSON",
            Problem::NotObject => "the body must be a JSON object",
            Problem::Nested => "the body is nested too deeply",
            Problem::Encoding(name) => {
                return write!(
                    f,
                    "the body is not valid JSON: it is encoded as {name} (send UTF-8)"
                )
            }
            Problem::LoneSurrogate { path, in_key } => {
                let at = if path.is_empty() { "body" } else { path };
                return if *in_key {
                    write!(f, "a key in '{at}' holds a lone surrogate escape")
                } else {
                    write!(f, "'{at}' holds a lone surrogate escape (not valid UTF-8 text)")
                };
            }
        })
    }
}

impl Problem {
    /// The field a refusal names (the `param` of the 400), when there is one.
    pub fn param(&self) -> Option<&str> {
        match self {
            Problem::LoneSurrogate { path, .. } if !path.is_empty() => Some(path),
            _ => None,
        }
    }
}

/// The fields of a request body the gateway reads.
const FIELDS: [&str; 23] = [
    "model",
    "prompt",
    "messages",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream_options",
    "cache_salt",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "truncate_prompt_tokens",
    "truncation_side",
    "tool_choice",
    "prompt_embeds",
    "chat_template",
    // The Responses API's (`POST /v1/responses`).
    "previous_response_id",
    "store",
];

/// A request body's fields, each as the JSON text it was sent as (checked JSON: a
/// `&RawValue` is made of it only when [`Payload::raw`] asks for one).
pub struct Payload<'a> {
    raw: &'a [u8],
    fields: [Option<&'a str>; FIELDS.len()],
    /// Bit `i` set: field `i` is known to be a string without an escape (known only when
    /// read the fast way).
    plain: u32,
}

impl fmt::Debug for Payload<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_map();
        for (name, value) in FIELDS.iter().zip(&self.fields) {
            if let Some(value) = value {
                out.entry(name, value);
            }
        }
        out.finish()
    }
}

impl<'a> Payload<'a> {
    /// Reads `raw` (see the module docs for what is refused).
    pub fn parse(raw: &'a [u8]) -> Result<Payload<'a>, Problem> {
        match Payload::parse_plain(raw) {
            Some(payload) => Ok(payload),
            None => Payload::parse_checked(raw).map_err(|problem| match problem {
                Problem::NotJson => wide_encoding(raw).map_or(Problem::NotJson, Problem::Encoding),
                problem => problem,
            }),
        }
    }

    /// The usual body (JSON without an escaped key or a surrogate escape, nested at most
    /// [`MAX_DEPTH`] deep) read by [`json_scan::object_members`], which crosses long strings
    /// faster than serde_json; None for any other, which [`Payload::parse_checked`] reads.
    fn parse_plain(raw: &'a [u8]) -> Option<Payload<'a>> {
        let mut spans = [None; FIELDS_LEN];
        let mut plain = 0u32;
        json_scan::object_members(raw, MAX_DEPTH, |key, start, end, escaped| {
            // A repeated key keeps its last value, as a parse into `Value` does.
            if let Some(i) = FIELDS.iter().position(|name| name.as_bytes() == key) {
                spans[i] = Some((start, end));
                let string = raw[start] == b'"' && !escaped;
                plain = (plain & !(1 << i)) | (u32::from(string) << i);
            }
        })?;
        // Only now is the text known to be UTF-8: the scan checks it as it ends (a member is
        // handed over before the bytes after it are checked).
        // A plain loop: `spans.map` compiled to an out-of-line array map (about 360
        // instructions a request in session 58's profile).
        let mut fields = [None; FIELDS_LEN];
        for (field, span) in fields.iter_mut().zip(spans) {
            if let Some((start, end)) = span {
                // The scan checked the text as UTF-8 (all of it ASCII, or checked whole), and
                // a value starts and ends at ASCII bytes (its first byte, and a quote,
                // bracket, letter or digit last): a character boundary each.
                let bytes = &raw[start..end];
                debug_assert!(std::str::from_utf8(bytes).is_ok());
                // SAFETY: as said above, `bytes` is UTF-8.
                *field = Some(unsafe { std::str::from_utf8_unchecked(bytes) });
            }
        }
        Some(Payload { raw, fields, plain })
    }

    /// Reads `raw` with serde_json, naming why a body is refused.
    fn parse_checked(raw: &'a [u8]) -> Result<Payload<'a>, Problem> {
        // Checked once here: parsed as text, serde_json checks no raw value again.
        let Ok(text) = std::str::from_utf8(raw) else { return Err(Problem::NotJson) };
        // serde_json skips the members it does not keep without a recursion limit: the
        // nesting is measured here instead, and past serde_json's own limit it is refused
        // before anything else, as a parse into `Value` refuses it.
        let deep = depth_past_limit(raw);
        if deep.is_some_and(|depth| depth > SERDE_DEPTH) {
            return Err(Problem::Nested);
        }
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let named = || {
            lone_surrogate(raw)
                .map_or(Problem::NotJson, |(path, in_key)| Problem::LoneSurrogate { path, in_key })
        };
        let picked = match Pick::<FIELDS_LEN>(&FIELDS, PhantomData).deserialize(&mut deserializer) {
            Ok(picked) => deserializer.end().map(|()| picked).map_err(|e| problem(&e)),
            Err(err) => Err(problem(&err)),
        };
        let picked = match picked {
            // A key is decoded to be picked: one with a lone surrogate fails here.
            Err(Problem::NotJson) if has_surrogate_escape(raw) => return Err(named()),
            picked => picked?,
        };
        let Some(fields) = picked else { return Err(Problem::NotObject) };
        if has_surrogate_escape(raw) && serde_json::from_slice::<Value>(raw).is_err() {
            return Err(named());
        }
        if deep.is_some() {
            return Err(Problem::Nested);
        }
        Ok(Payload { raw, fields: fields.map(|field| field.map(RawValue::get)), plain: 0 })
    }

    /// The field's JSON text, when the body has it (`null` included): checked JSON, with
    /// no space around it.
    pub fn text(&self, name: &str) -> Option<&'a str> {
        FIELDS.iter().position(|f| *f == name).and_then(|i| self.fields[i])
    }

    /// The field's JSON text as a raw value, when the body has it (`null` included).
    pub fn raw(&self, name: &str) -> Option<&'a RawValue> {
        // The text is one JSON value, checked: it reads as one (the second reading, should
        // `checked_raw` ever fail, makes the same raw value the slow way).
        self.text(name)
            .and_then(|text| checked_raw(text).or_else(|| serde_json::from_str(text).ok()))
    }

    /// The field decoded (None when absent; an error for a number out of `f64`'s range, in
    /// it). Only for small fields: this allocates.
    pub fn value(&self, name: &str) -> Option<Result<Value, serde_json::Error>> {
        self.text(name).map(serde_json::from_str)
    }

    /// The field when it is a JSON string (borrowed unless it has escapes).
    pub fn str(&self, name: &str) -> Option<Cow<'a, str>> {
        let i = FIELDS.iter().position(|f| *f == name)?;
        let text = self.fields[i]?;
        if self.plain & (1 << i) != 0 {
            // Known to be a string without an escape: the text between its quotes.
            return Some(Cow::Borrowed(&text[1..text.len() - 1]));
        }
        text_as_str(text)
    }

    /// Whether the body asks for a streamed answer (`"stream": true`).
    pub fn stream(&self) -> bool {
        self.text("stream") == Some("true")
    }

    /// The whole body as a `Value` (for code that needs all of it; this copies everything).
    pub fn to_value(&self) -> Value {
        serde_json::from_slice(self.raw).unwrap_or(Value::Null)
    }
}

const FIELDS_LEN: usize = FIELDS.len();
const _: () = assert!(FIELDS_LEN <= 32, "Payload::plain has a bit per field");

/// `text`, a JSON value's text already checked, as a `&RawValue` borrowing it, without
/// reading it again. serde_json builds one only as it parses (its constructor from a borrowed
/// text is private); the same borrowed text goes through the protocol its own deserializer
/// uses to hand one over (a map of one member named by its marker, the text as a borrowed
/// string). Should that protocol ever change, this is None and the body is read the slow way
/// (`the_usual_body_is_read_the_fast_way` fails).
fn checked_raw(text: &str) -> Option<&RawValue> {
    use serde::de::value::{BorrowedStrDeserializer, Error, MapDeserializer};
    const RAW_VALUE_MARKER: &str = "$serde_json::private::RawValue";
    let member = (RAW_VALUE_MARKER, BorrowedStrDeserializer::<Error>::new(text));
    let handed = MapDeserializer::<_, Error>::new(std::iter::once(member));
    serde::Deserialize::deserialize(handed).ok()
}

/// `raw` as a string when it is a JSON string.
pub fn as_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    text_as_str(raw.get())
}

/// `text`, a JSON value's checked text, as a string when it is a JSON string.
fn text_as_str(text: &str) -> Option<Cow<'_, str>> {
    let inner = text.strip_prefix('"')?.strip_suffix('"')?;
    // Without a backslash the text between the quotes is the string (a valid JSON string has
    // no raw control characters); only escapes need decoding.
    if memchr::memchr(b'\\', inner.as_bytes()).is_none() {
        return Some(Cow::Borrowed(inner));
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    deserializer.deserialize_str(StrVisitor).ok()
}

/// The members of a JSON object named in `names`, each as its raw text; a member not an
/// object gives `Ok(None)` (for a message of a chat's `messages`, say).
pub fn object_fields<'a, const N: usize>(
    raw: &'a RawValue,
    names: &[&'static str; N],
) -> Result<Option<[Option<&'a RawValue>; N]>, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_str(raw.get());
    Pick::<N>(names, PhantomData).deserialize(&mut deserializer)
}

/// The elements of a JSON array as raw texts (None when `raw` is not an array).
pub fn array_items(raw: &RawValue) -> Option<Vec<&RawValue>> {
    if !raw.get().starts_with('[') {
        return None;
    }
    serde_json::from_str(raw.get()).ok()
}

/// Whether `raw` is a JSON array with at least one element (None when it is not an array).
/// Read from its first bytes: a raw value is checked JSON, so `[` and then anything but `]`
/// past the whitespace starts an element; nothing is parsed or collected.
pub fn non_empty_array(raw: &RawValue) -> Option<bool> {
    let inner = raw.get().strip_prefix('[')?;
    Some(!inner.trim_start_matches([' ', '\t', '\n', '\r']).starts_with(']'))
}

/// The checks the Python plane makes of a chat's `messages` when no tokenizer reads them
/// (`_check_messages` in python/llmsched/gateway/app.py, `render_messages` in
/// python/llmsched/routing.py), in its words: each message an object with a string role, its
/// content null, a string or a list of parts, a text part's text a string. `messages` that is
/// not a list is left to the caller.
pub fn check_messages(payload: &Payload<'_>) -> Result<(), String> {
    let Some(messages) = payload.raw("messages").and_then(array_items) else {
        return Ok(());
    };
    for (i, message) in messages.into_iter().enumerate() {
        let fields = object_fields(message, &["role", "content"]).ok().flatten();
        let Some([Some(role), content]) = fields else {
            return Err(format!("messages[{i}] must be an object with a string role"));
        };
        if as_str(role).is_none() {
            return Err(format!("messages[{i}] must be an object with a string role"));
        }
        match content {
            None => {}
            Some(raw) if raw.get() == "null" || as_str(raw).is_some() => {}
            Some(raw) => check_parts(raw, i)?,
        }
    }
    Ok(())
}

/// Message `i`'s content as a list of parts, each text part's text a string.
fn check_parts(content: &RawValue, i: usize) -> Result<(), String> {
    let parts = array_items(content)
        .ok_or_else(|| format!("messages[{i}].content must be a string or a list of parts"))?;
    for (j, part) in parts.into_iter().enumerate() {
        if let Ok(Some([Some(kind), Some(text)])) = object_fields(part, &["type", "text"]) {
            if as_str(kind).as_deref() == Some("text") && as_str(text).is_none() {
                return Err(format!("messages[{i}]['content'][{j}]['text'] must be a str"));
            }
        }
    }
    Ok(())
}

fn problem(err: &serde_json::Error) -> Problem {
    if err.to_string().contains("recursion limit") {
        Problem::Nested
    } else {
        Problem::NotJson
    }
}

/// Whether the body has a `\uD800`-`\uDFFF` escape (paired or not), case-insensitive. An
/// escaped backslash before `uD800` text counts too (a full parse then settles it).
fn has_surrogate_escape(raw: &[u8]) -> bool {
    memchr::memchr_iter(b'\\', raw).any(|at| match raw.get(at + 1..at + 4) {
        Some([b'u', d, hex]) => {
            d.eq_ignore_ascii_case(&b'd')
                && matches!(hex.to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')
        }
        _ => false,
    })
}

/// The first string of a JSON text, in its order, that holds a lone surrogate escape: its
/// path as the Python plane writes it (`a.b[0]`: keys joined by dots, indices in brackets)
/// and whether it is a key (then the path is the object's). None when there is none, or when
/// the text is not JSON but for its lone surrogates (Python's `json` refuses it then, `NaN`
/// and `Infinity` included). The nesting is bounded by the caller ([`SERDE_DEPTH`]); any
/// bytes are scanned safely.
fn lone_surrogate(raw: &[u8]) -> Option<(String, bool)> {
    let mut scan = SurrogateScan { raw, at: 0, path: Vec::new(), found: None };
    scan.value().ok()?;
    scan.skip_space();
    if scan.at != raw.len() {
        return None;
    }
    scan.found
}

/// One step of a path into a JSON value.
enum Step {
    Key(String),
    Index(usize),
}

/// A recursive-descent check of a JSON text that decodes its strings (the keys kept for the
/// path) and notes the first one holding a lone surrogate escape. `Err(())`: not JSON.
struct SurrogateScan<'a> {
    raw: &'a [u8],
    at: usize,
    path: Vec<Step>,
    found: Option<(String, bool)>,
}

impl SurrogateScan<'_> {
    /// Notes a lone surrogate in the value at the current path (in a key of it when `in_key`),
    /// unless an earlier one was noted.
    fn note(&mut self, in_key: bool) {
        if self.found.is_some() {
            return;
        }
        let mut out = String::new();
        for step in &self.path {
            match step {
                // As Python's `f"{path}.{key}" if path else key`.
                Step::Key(key) if out.is_empty() => out.push_str(key),
                Step::Key(key) => {
                    out.push('.');
                    out.push_str(key);
                }
                Step::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        self.found = Some((out, in_key));
    }

    fn skip_space(&mut self) {
        while matches!(self.raw.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_space();
        let found = self.raw.get(self.at) == Some(&byte);
        if found {
            self.at += 1;
        }
        found
    }

    fn value(&mut self) -> Result<(), ()> {
        self.skip_space();
        match self.raw.get(self.at) {
            Some(b'"') => {
                let (_, lone) = self.string()?;
                if lone {
                    self.note(false);
                }
                Ok(())
            }
            Some(b'{') => {
                self.at += 1;
                if self.eat(b'}') {
                    return Ok(());
                }
                loop {
                    self.skip_space();
                    if self.raw.get(self.at) != Some(&b'"') {
                        return Err(());
                    }
                    let (key, lone) = self.string()?;
                    if lone {
                        self.note(true);
                    }
                    if !self.eat(b':') {
                        return Err(());
                    }
                    self.path.push(Step::Key(key));
                    self.value()?;
                    self.path.pop();
                    if self.eat(b'}') {
                        return Ok(());
                    }
                    if !self.eat(b',') {
                        return Err(());
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                if self.eat(b']') {
                    return Ok(());
                }
                let mut index = 0;
                loop {
                    self.path.push(Step::Index(index));
                    self.value()?;
                    self.path.pop();
                    if self.eat(b']') {
                        return Ok(());
                    }
                    if !self.eat(b',') {
                        return Err(());
                    }
                    index += 1;
                }
            }
            Some(_) => {
                // A number, true, false or null: checked with serde_json, to the delimiter.
                let rest = &self.raw[self.at..];
                let len = rest
                    .iter()
                    .position(|b| matches!(b, b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(rest.len());
                serde_json::from_slice::<IgnoredAny>(&rest[..len]).map_err(drop)?;
                self.at += len;
                Ok(())
            }
            None => Err(()),
        }
    }

    /// Reads the string at the cursor (its opening quote): its text (lone surrogates left
    /// out) and whether it holds a lone surrogate escape.
    fn string(&mut self) -> Result<(String, bool), ()> {
        self.at += 1;
        let mut text = Vec::new();
        let mut lone = false;
        loop {
            let rest = self.raw.get(self.at..).unwrap_or_default();
            let next = memchr::memchr2(b'"', b'\\', rest).ok_or(())?;
            if rest[..next].iter().any(|&b| b < 0x20) {
                return Err(()); // a raw control character: not JSON
            }
            text.extend_from_slice(&rest[..next]);
            self.at += next + 1;
            if rest[next] == b'"' {
                // Split at ASCII bytes only: the text stays as UTF-8 as the body was.
                return Ok((String::from_utf8_lossy(&text).into_owned(), lone));
            }
            let escaped = match self.raw.get(self.at) {
                Some(b'u') => {
                    let unit = self.hex(self.at + 1).ok_or(())?;
                    self.at += 5;
                    match unit {
                        0xD800..=0xDBFF => {
                            let low = (self.raw.get(self.at..self.at + 2) == Some(b"\\u"))
                                .then(|| self.hex(self.at + 2))
                                .flatten()
                                .filter(|low| (0xDC00..=0xDFFF).contains(low));
                            match low {
                                Some(low) => {
                                    self.at += 6;
                                    char::from_u32(
                                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00),
                                    )
                                }
                                None => None,
                            }
                        }
                        0xDC00..=0xDFFF => None,
                        _ => char::from_u32(unit),
                    }
                }
                Some(&byte) => {
                    self.at += 1;
                    Some(match byte {
                        b'"' | b'\\' | b'/' => char::from(byte),
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        _ => return Err(()),
                    })
                }
                None => return Err(()),
            };
            match escaped {
                Some(c) => text.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                None => lone = true,
            }
        }
    }

    /// The four hex digits at `at`.
    fn hex(&self, at: usize) -> Option<u32> {
        let digits = self.raw.get(at..at + 4)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    }
}

/// serde_json's recursion limit (a parse into `Value` refuses deeper nesting).
const SERDE_DEPTH: usize = 128;

/// How deep arrays and objects nest, when deeper than [`MAX_DEPTH`] (counted up to one past
/// [`SERDE_DEPTH`]); None when not. Most bodies have fewer brackets in all than the limit,
/// which settles it with one fast count; the others are scanned, skipping strings. Any bytes
/// are scanned safely; the result means something for JSON only.
fn depth_past_limit(raw: &[u8]) -> Option<usize> {
    if memchr::memchr2_iter(b'[', b'{', raw).count() <= MAX_DEPTH {
        return None;
    }
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut at = 0;
    while let Some(&byte) = raw.get(at) {
        match byte {
            b'"' => {
                // To the closing quote, past escaped characters.
                at += 1;
                while let Some(next) = raw.get(at..).and_then(|r| memchr::memchr2(b'"', b'\\', r)) {
                    at += next;
                    if raw[at] == b'"' {
                        break;
                    }
                    at += 2;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
                if deepest > SERDE_DEPTH {
                    break;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at += 1;
    }
    (deepest > MAX_DEPTH).then_some(deepest)
}

/// A string, borrowed from the input when it has no escapes.
struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// An object key (borrowed unless escaped).
struct Key<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(StrVisitor).map(Key)
    }
}

/// Picks the members named in `.0` out of any JSON value: `Some` of them for an object, `None`
/// for anything else (read to its end all the same, so that the input is checked whole).
struct Pick<'n, const N: usize>(&'n [&'static str; N], PhantomData<()>);

impl<'de, const N: usize> DeserializeSeed<'de> for Pick<'_, N> {
    type Value = Option<[Option<&'de RawValue>; N]>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for Pick<'_, N> {
    type Value = Option<[Option<&'de RawValue>; N]>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = [None; N];
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            match self.0.iter().position(|name| *name == key) {
                // A repeated key keeps its last value, as a parse into `Value` does.
                Some(i) => found[i] = Some(map.next_value::<&'de RawValue>()?),
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(found))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Payload<'_>, Problem> {
        Payload::parse(text.as_bytes())
    }

    #[test]
    fn messages_are_checked_as_the_python_plane_checks_them() {
        let check = |messages: &str| {
            let body = format!(r#"{{"messages": {messages}}}"#);
            check_messages(&parse(&body).unwrap())
        };
        let ok = r#"[{"role": "user", "content": [{"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "a", "content": null},
            {"role": "tool", "tool_calls": []}]"#;
        assert_eq!(check(ok), Ok(()));
        for (messages, problem) in [
            (r#"[{"content": "hi"}]"#, "messages[0] must be an object with a string role"),
            (r#"[{"role": "u"}, 5]"#, "messages[1] must be an object with a string role"),
            (r#"[{"role": 1, "content": "hi"}]"#, "messages[0] must be an object"),
            (r#"[{"role": "u", "content": 5}]"#, "messages[0].content must be a string or a"),
            (
                r#"[{"role": "u", "content": [{"type": "text", "text": "a"},
                   {"type": "text", "text": 5}]}]"#,
                "messages[0]['content'][1]['text'] must be a str",
            ),
        ] {
            let found = check(messages).unwrap_err();
            assert!(found.starts_with(problem), "{messages}: {found}");
        }
    }

    #[test]
    fn reads_the_fields_it_names_and_skips_the_rest() {
        let body = r#"{"model": "m", "temperature": 0.5, "prompt": "a \"b\"", "tools": [{"x": 1}],
            "stream": true, "stop": ["\n"], "max_tokens": 7}"#;
        let payload = parse(body).unwrap();
        assert_eq!(payload.str("model").as_deref(), Some("m"));
        assert!(matches!(payload.str("model"), Some(Cow::Borrowed(_))));
        assert_eq!(payload.str("prompt").as_deref(), Some("a \"b\""));
        assert!(payload.stream());
        assert_eq!(payload.value("max_tokens").unwrap().unwrap(), serde_json::json!(7));
        assert_eq!(payload.value("stop").unwrap().unwrap(), serde_json::json!(["\n"]));
        assert!(payload.raw("messages").is_none());
        assert!(payload.raw("temperature").is_none());
        assert_eq!(payload.to_value()["temperature"], serde_json::json!(0.5));
        // A number out of f64's range is forwarded as sent; read alone, it is an error.
        let payload = parse(r#"{"max_tokens": 1e400, "temperature": -1e999}"#).unwrap();
        assert!(payload.value("max_tokens").unwrap().is_err());
        // A Responses request's previous_response_id, whatever numbers the body holds.
        let payload =
            parse(r#"{"input": "x", "metadata": {"n": 1e400}, "previous_response_id": "resp_1"}"#)
                .unwrap();
        assert_eq!(payload.str("previous_response_id").as_deref(), Some("resp_1"));
        let payload = parse(r#"{"previous_response_id": 1e400}"#).unwrap();
        assert_eq!(payload.raw("previous_response_id").map(RawValue::get), Some("1e400"));
        assert_eq!(payload.str("previous_response_id"), None);
    }

    #[test]
    fn null_is_kept_and_a_repeated_key_keeps_its_last_value() {
        let payload = parse(r#"{"model": null, "stream": true, "stream": false}"#).unwrap();
        assert_eq!(payload.raw("model").map(RawValue::get), Some("null"));
        assert_eq!(payload.str("model"), None);
        assert!(!payload.stream());
        // An escaped key is the same key.
        let payload = parse(r#"{"mod\u0065l": "x"}"#).unwrap();
        assert_eq!(payload.str("model").as_deref(), Some("x"));
    }

    #[test]
    fn refuses_what_a_value_parse_refuses() {
        for text in ["", "{", "{\"a\": }", "{} x", "nul"] {
            assert_eq!(parse(text).unwrap_err(), Problem::NotJson, "{text:?}");
        }
        assert!(Payload::parse(b"{\"a\": \"\xff\"}").is_err());
        // JSON in UTF-16 or UTF-32 is refused by its name; a UTF-8 BOM is dropped first.
        let utf16le: Vec<u8> = "{}".encode_utf16().flat_map(u16::to_le_bytes).collect();
        let utf16be: Vec<u8> = "{}".encode_utf16().flat_map(u16::to_be_bytes).collect();
        let utf32: Vec<u8> = "{}".chars().flat_map(|c| (c as u32).to_le_bytes()).collect();
        for (body, name) in [(&utf16le, "UTF-16"), (&utf16be, "UTF-16"), (&utf32, "UTF-32")] {
            assert_eq!(Payload::parse(body).err(), Some(Problem::Encoding(name)));
            let mut marked =
                if name == "UTF-16" { vec![0xFF, 0xFE] } else { vec![0xFF, 0xFE, 0, 0] };
            marked.extend_from_slice(body);
            assert_eq!(Payload::parse(&marked).err(), Some(Problem::Encoding(name)));
        }
        assert_eq!(Payload::parse(b"nope").err(), Some(Problem::NotJson));
        // A UTF-8 BOM is no JSON: the gateway drops it before parsing.
        assert_eq!(Payload::parse(b"\xEF\xBB\xBF{}").err(), Some(Problem::NotJson));
        // Not an object comes first, as the Python plane checks it first.
        for text in ["[]", "[1, {\"a\": 2}]", "3", "\"s\"", "true", "null", "[\"\\udfff\"]"] {
            assert_eq!(parse(text).unwrap_err(), Problem::NotObject, "{text:?}");
        }
        // Text like a surrogate escape after an escaped backslash has the body parsed whole,
        // which refuses a number past f64's range (that is accepted otherwise).
        assert_eq!(parse(r#"{"a": "\\ud800", "b": 1e400}"#).unwrap_err(), Problem::NotJson);
        assert!(parse(r#"{"a": "\\ud800", "b": 1}"#).is_ok());
        // Paired surrogates are text.
        let payload = parse(r#"{"prompt": "\ud83d\ude00", "x": "\uD83D\uDE00"}"#).unwrap();
        assert_eq!(payload.str("prompt").as_deref(), Some("\u{1F600}"));
    }

    #[test]
    fn a_lone_surrogate_is_named_as_the_python_plane_names_it() {
        let lone = |path: &str, in_key: bool| Problem::LoneSurrogate { path: path.into(), in_key };
        for (text, expected) in [
            (r#"{"a": "\ud800"}"#, lone("a", false)),
            (r#"{"x": ["ok", "\uDFFF"]}"#, lone("x[1]", false)),
            (r#"{"previous_response_id": "id\udc00"}"#, lone("previous_response_id", false)),
            // A high surrogate followed by anything but a low one is lone.
            (r#"{"a": "\ud800\u0041"}"#, lone("a", false)),
            (r#"{"a": "\ud800\ud800"}"#, lone("a", false)),
            (r#"{"a": "\ud800\\udc00"}"#, lone("a", false)),
            // Keys: the object holding them; escaped keys decoded; paired escapes are text.
            (r#"{"m": [{"\ud800": 1}]}"#, lone("m[0]", true)),
            (r#"{"\ud800": 1}"#, lone("", true)),
            (
                r#"{"\u0061\"b": {"c": ["\ud83d\ude00", 1e400, true, null, "\udbff"]}}"#,
                lone("a\"b.c[4]", false),
            ),
            // The first in the body's order.
            (r#"{"b": {"\udc00": "\ud800"}, "a": "\ud800"}"#, lone("b", true)),
            // An empty key at the top: no dot (Python's `if path`).
            (r#"{"": {"k": "\ud800"}}"#, lone("k", false)),
        ] {
            let problem = parse(text).unwrap_err();
            assert_eq!(problem, expected, "{text}");
        }
        assert_eq!(
            lone("input[0].id", false).to_string(),
            "'input[0].id' holds a lone surrogate escape (not valid UTF-8 text)"
        );
        assert_eq!(lone("", true).to_string(), "a key in 'body' holds a lone surrogate escape");
        assert_eq!(lone("", false).param(), None);
        assert_eq!(lone("m[0]", true).param(), Some("m[0]"));
        assert_eq!(Problem::NotJson.param(), None);
        // Not JSON for another reason, before or after it: not named.
        for text in [
            r#"{"a": "\ud800", "b": }"#,
            r#"{"\ud800": 1, "b": }"#,
            r#"{"\ud800": NaN}"#,
            r#"{"a": "\ud800"} x"#,
            r#"{"a": tru, "b": "\ud800"}"#,
            "{\"a\": \"\\ud800\t\"}",
        ] {
            assert_eq!(parse(text).unwrap_err(), Problem::NotJson, "{text}");
        }
        // Junk is scanned without panicking.
        for junk in [&b"{\"a\": \"\\ud8"[..], b"{\"a\" \"\\ud800\"}", b"[1,", b"{\"a\": \"\xff"] {
            assert_eq!(lone_surrogate(junk), None);
        }
    }

    #[test]
    fn nesting_past_the_limit_is_refused() {
        let nested = |n: usize| format!("{{\"tools\": {}{}}}", "[".repeat(n), "]".repeat(n));
        assert!(parse(&nested(MAX_DEPTH - 1)).is_ok());
        assert_eq!(parse(&nested(MAX_DEPTH)).unwrap_err(), Problem::Nested);
        let deeper = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(parse(&deeper).unwrap_err(), Problem::Nested);
        // A deep array that is not an object: too deep for serde_json is nested, less is not
        // an object (as a parse into `Value` says).
        let array = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(parse(&array(100)).unwrap_err(), Problem::NotObject);
        assert_eq!(parse(&array(200)).unwrap_err(), Problem::Nested);
        // Unterminated strings and stray escapes are scanned without panicking.
        for tail in ["\"", "\"\\", "\"\\\""] {
            let junk = "[".repeat(70) + tail;
            assert_eq!(parse(&junk).unwrap_err(), Problem::NotJson);
        }
        // Many brackets, shallow, and brackets inside strings do not count.
        let wide =
            format!("{{\"a\": [{}[]], \"b\": \"{}\\\"[[\"}}", "[], ".repeat(200), "[".repeat(99));
        assert!(parse(&wide).is_ok());
    }

    #[test]
    fn depth_matches_a_value_walk() {
        fn depth(value: &Value) -> usize {
            match value {
                Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
                Value::Object(fields) => 1 + fields.values().map(depth).max().unwrap_or(0),
                _ => 0,
            }
        }
        for n in [60, 63, 64, 65, 70] {
            let text = format!(
                "{{\"s\": \"]]]}}\\\\\", \"t\": {}1{}, \"u\": [{}]}}",
                "[{\"k\": ".repeat(n / 2),
                "}]".repeat(n / 2),
                ["[]"; 70].join(", ")
            );
            let value: Value = serde_json::from_str(&text).unwrap();
            let expected = depth(&value);
            let found = depth_past_limit(text.as_bytes());
            assert_eq!(found, (expected > MAX_DEPTH).then_some(expected), "{n}");
        }
    }

    #[test]
    fn object_members_and_array_items() {
        let raw: &RawValue =
            serde_json::from_str(r#"[{"role": "user", "content": "x", "role": "a"}, 3]"#).unwrap();
        let items = array_items(raw).unwrap();
        let fields = object_fields(items[0], &["role", "content"]).unwrap().unwrap();
        assert_eq!(fields[0].map(RawValue::get), Some("\"a\""));
        assert_eq!(fields[1].and_then(as_str).as_deref(), Some("x"));
        assert!(object_fields(items[1], &["role"]).unwrap().is_none());
        assert!(array_items(items[1]).is_none());
    }

    #[test]
    fn the_usual_body_is_read_the_fast_way() {
        let prompt = format!("Session 1: {}turn 2 caf\u{e9} \\n \\u00e9", "context ".repeat(200));
        let body = format!(
            r#"{{"model": "m", "prompt": "{prompt}", "max_tokens": 16,
            "stream": false, "other": {{"k": [1, -2.5e3, true, null, "\ud83d\ude00"]}}}}"#
        );
        // Without a surrogate escape (the other member's is left to the slow reading).
        let plain = body.replace(r"\ud83d\ude00", "x");
        let payload = Payload::parse_plain(plain.as_bytes()).expect("read the fast way");
        assert_eq!(payload.raw("prompt").map(RawValue::get), Some(&*format!("\"{prompt}\"")));
        assert_eq!(payload.str("model").as_deref(), Some("m"));
        assert_eq!(payload.value("max_tokens").unwrap().unwrap(), serde_json::json!(16));
        assert!(!payload.stream());
        assert!(payload.raw("messages").is_none());
        assert!(Payload::parse_plain(body.as_bytes()).is_none());
        assert_eq!(
            format!("{:?}", Payload::parse(body.as_bytes()).unwrap()),
            format!("{:?}", payload)
        );
    }

    /// A body as [`Payload::parse`] reads it, and as serde_json alone reads it.
    fn both_readings(raw: &[u8]) -> (Result<String, Problem>, Result<String, Problem>) {
        // Each field's text, and each as a string (the fast reading knows some are plain).
        let shown = |payload: Payload<'_>| {
            let strings: Vec<_> = FIELDS.iter().map(|name| payload.str(name)).collect();
            format!("{payload:?} {strings:?}")
        };
        (Payload::parse(raw).map(shown), Payload::parse_checked(raw).map(shown))
    }

    /// JSON objects of the fields the gateway reads and others, their values of any shape
    /// (strings with and without escapes, past ASCII, long; numbers of any size), with
    /// whitespace or none around the separators.
    fn body_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let string = prop_oneof![
            any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
            "[ -~]{0,40}".prop_map(|s| serde_json::to_string(&s).unwrap()),
            "[a-z ]{0,300}".prop_map(|s| format!("\"{s}\"")),
            Just(r#""\/\b\f\n\r\t\"\\ \u00E9 \u0000 \\ud800""#.to_owned()),
            Just(r#""\ud83d\ude00""#.to_owned()),
            Just(r#""\udc00""#.to_owned()),
        ];
        let leaf = prop_oneof![
            Just("null".to_owned()),
            any::<bool>().prop_map(|b| b.to_string()),
            any::<i64>().prop_map(|i| i.to_string()),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
            prop::sample::select(vec![
                "0",
                "-0",
                "1e400",
                "-1.5E-3",
                "0.0e+0",
                "123456789012345678901234"
            ])
            .prop_map(str::to_owned),
            string.clone(),
        ];
        let value = leaf.prop_recursive(3, 32, 5, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|items| format!("[{}]", items.join(","))),
                prop::collection::vec(("[a-z]{1,3}", inner), 0..5).prop_map(|members| {
                    let members: Vec<String> =
                        members.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        });
        let key = prop_oneof![
            prop::sample::select(FIELDS.to_vec()).prop_map(|k| format!("\"{k}\"")),
            "[a-z_]{1,8}".prop_map(|k| format!("\"{k}\"")),
            Just(r#""mod\u0065l""#.to_owned()),
            string,
        ];
        let spaces = prop::sample::select(vec!["", " ", "\n\t ", "\r"]);
        (prop::collection::vec((key, value), 0..8), spaces).prop_map(|(members, space)| {
            let members: Vec<String> =
                members.into_iter().map(|(k, v)| format!("{space}{k}{space}:{space}{v}")).collect();
            format!("{space}{{{}{space}}}{space}", members.join(","))
        })
    }

    /// A byte edit of a body: where, what (0 replaces the byte there, 1 inserts one before it,
    /// 2 removes it) and which byte.
    type Edit = (proptest::sample::Index, u8, u8);

    /// Up to two edits of a generated body, anywhere in it or at its end, with JSON's
    /// punctuation, escapes, controls, bytes past ASCII and a few plain bytes.
    fn edits() -> impl proptest::strategy::Strategy<Value = Vec<Edit>> {
        proptest::collection::vec(
            (
                proptest::prelude::any::<proptest::sample::Index>(),
                0..3u8,
                proptest::sample::select(b"\"\\\x01\x1f\x7f\xff\xc3\xa9u{}[],:0-.eE d8 ".to_vec()),
            ),
            0..3,
        )
    }

    /// `text` with `edits` made in turn (an edit past the end that has no byte to replace or
    /// remove leaves it as it is).
    fn edited(text: String, edits: &[Edit]) -> Vec<u8> {
        let mut raw = text.into_bytes();
        for &(at, edit, byte) in edits {
            let at = at.index(raw.len() + 1);
            match edit {
                0 if at < raw.len() => raw[at] = byte,
                1 => raw.insert(at, byte),
                _ if at < raw.len() => {
                    raw.remove(at);
                }
                _ => {}
            }
        }
        raw
    }

    proptest::proptest! {
        #[test]
        fn any_body_reads_as_serde_json_reads_it(
            text in body_text(),
            edits in edits(),
        ) {
            // The text as generated (JSON), then with bytes replaced, inserted or removed.
            let (ours, theirs) = both_readings(text.as_bytes());
            proptest::prop_assert_eq!(ours, theirs);
            let raw = edited(text, &edits);
            let (ours, theirs) = both_readings(&raw);
            proptest::prop_assert_eq!(ours, theirs);
        }
    }

    /// The reading before fields were kept as text (session 58's `Payload`, which made a
    /// `&RawValue` of each field as it read the body), kept to compare the two.
    mod old {
        use super::super::*;

        pub struct Payload<'a> {
            fields: [Option<&'a RawValue>; FIELDS_LEN],
            plain: u32,
        }

        impl<'a> Payload<'a> {
            pub fn parse(raw: &'a [u8]) -> Result<Payload<'a>, Problem> {
                match Payload::parse_plain(raw) {
                    Some(payload) => Ok(payload),
                    None => Payload::parse_checked(raw).map_err(|problem| match problem {
                        Problem::NotJson => {
                            wide_encoding(raw).map_or(Problem::NotJson, Problem::Encoding)
                        }
                        problem => problem,
                    }),
                }
            }

            fn parse_plain(raw: &'a [u8]) -> Option<Payload<'a>> {
                let mut spans = [None; FIELDS_LEN];
                let mut plain = 0u32;
                json_scan::object_members(raw, MAX_DEPTH, |key, start, end, escaped| {
                    if let Some(i) = FIELDS.iter().position(|name| name.as_bytes() == key) {
                        spans[i] = Some((start, end));
                        let string = raw[start] == b'"' && !escaped;
                        plain = (plain & !(1 << i)) | (u32::from(string) << i);
                    }
                })?;
                let mut fields = [None; FIELDS_LEN];
                for (field, span) in fields.iter_mut().zip(spans) {
                    if let Some((start, end)) = span {
                        let text = std::str::from_utf8(&raw[start..end]).ok()?;
                        *field = Some(checked_raw(text)?);
                    }
                }
                Some(Payload { fields, plain })
            }

            fn parse_checked(raw: &'a [u8]) -> Result<Payload<'a>, Problem> {
                let Ok(text) = std::str::from_utf8(raw) else { return Err(Problem::NotJson) };
                let deep = depth_past_limit(raw);
                if deep.is_some_and(|depth| depth > SERDE_DEPTH) {
                    return Err(Problem::Nested);
                }
                let mut deserializer = serde_json::Deserializer::from_str(text);
                let named = || {
                    lone_surrogate(raw).map_or(Problem::NotJson, |(path, in_key)| {
                        Problem::LoneSurrogate { path, in_key }
                    })
                };
                let picked =
                    match Pick::<FIELDS_LEN>(&FIELDS, PhantomData).deserialize(&mut deserializer) {
                        Ok(picked) => deserializer.end().map(|()| picked).map_err(|e| problem(&e)),
                        Err(err) => Err(problem(&err)),
                    };
                let picked = match picked {
                    Err(Problem::NotJson) if has_surrogate_escape(raw) => return Err(named()),
                    picked => picked?,
                };
                let Some(fields) = picked else { return Err(Problem::NotObject) };
                if has_surrogate_escape(raw) && serde_json::from_slice::<Value>(raw).is_err() {
                    return Err(named());
                }
                if deep.is_some() {
                    return Err(Problem::Nested);
                }
                Ok(Payload { fields, plain: 0 })
            }

            pub fn raw(&self, name: &str) -> Option<&'a RawValue> {
                FIELDS.iter().position(|f| *f == name).and_then(|i| self.fields[i])
            }

            pub fn value(&self, name: &str) -> Option<Result<Value, serde_json::Error>> {
                self.raw(name).map(|raw| serde_json::from_str(raw.get()))
            }

            pub fn str(&self, name: &str) -> Option<Cow<'a, str>> {
                let i = FIELDS.iter().position(|f| *f == name)?;
                let raw = self.fields[i]?;
                if self.plain & (1 << i) != 0 {
                    let text = raw.get();
                    return Some(Cow::Borrowed(&text[1..text.len() - 1]));
                }
                as_str(raw)
            }

            pub fn stream(&self) -> bool {
                self.raw("stream").is_some_and(|v| v.get() == "true")
            }
        }
    }

    /// Everything a body's reading answers, by this reading and by session 58's: each
    /// field's text, raw value, string (and whether it is borrowed), decoded value, and
    /// whether the body asks for a stream; or the problem the body has.
    fn new_and_old_readings(raw: &[u8]) -> (Result<String, Problem>, Result<String, Problem>) {
        let names = FIELDS.iter().copied().chain(["temperature", "", "Model", "models"]);
        let decoded = |value: Option<Result<Value, serde_json::Error>>| {
            value.map(|value| value.map_err(|err| err.to_string()))
        };
        let borrowed = |text: &Option<Cow<'_, str>>| matches!(text, Some(Cow::Borrowed(_)));
        let new = Payload::parse(raw).map(|payload| {
            let read: Vec<String> = names
                .clone()
                .map(|name| {
                    let text = payload.str(name);
                    format!(
                        "{:?} {:?} {:?} {} {:?}",
                        payload.text(name),
                        payload.raw(name).map(RawValue::get),
                        text,
                        borrowed(&text),
                        decoded(payload.value(name)),
                    )
                })
                .collect();
            format!("{read:?} {}", payload.stream())
        });
        let old = old::Payload::parse(raw).map(|payload| {
            let read: Vec<String> = names
                .clone()
                .map(|name| {
                    let text = payload.str(name);
                    let raw = payload.raw(name).map(RawValue::get);
                    format!(
                        "{:?} {:?} {:?} {} {:?}",
                        raw,
                        raw,
                        text,
                        borrowed(&text),
                        decoded(payload.value(name)),
                    )
                })
                .collect();
            format!("{read:?} {}", payload.stream())
        });
        (new, old)
    }

    #[test]
    fn the_usual_bodies_read_as_before() {
        for body in [
            r#"{"model": "m", "prompt": "hello", "max_tokens": 16, "stream": false}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            r#"{"model": "m\u00e9", "prompt": [1, 2, 3], "max_tokens": null, "stop": ["\n"]}"#,
            r#"{"mod\u0065l": "x", "stream": true, "stream": "true"}"#,
            r#"{"prompt": "\ud83d\ude00", "previous_response_id": 1e400}"#,
            r#"[1, 2]"#,
            r#"{"model": "m""#,
        ] {
            let (new, old) = new_and_old_readings(body.as_bytes());
            assert_eq!(new, old, "{body}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_body_reads_as_the_old_reading_read_it(
            text in body_text(),
            edits in edits(),
        ) {
            let (new, old) = new_and_old_readings(text.as_bytes());
            proptest::prop_assert_eq!(new, old);
            let raw = edited(text, &edits);
            let (new, old) = new_and_old_readings(&raw);
            proptest::prop_assert_eq!(new, old);
        }
    }

    #[test]
    fn a_non_empty_array_is_told_from_its_first_bytes() {
        for (text, expected) in [
            ("[1]", Some(true)),
            ("[ \n\t\r ]", Some(false)),
            ("[]", Some(false)),
            ("[ [] ]", Some(true)),
            (r#"[ {"role": "user"} ]"#, Some(true)),
            (r#""[]""#, None),
            ("{}", None),
            ("null", None),
        ] {
            let raw: &RawValue = serde_json::from_str(text).unwrap();
            assert_eq!(non_empty_array(raw), expected, "{text}");
            let items = array_items(raw).map(|items| !items.is_empty());
            assert_eq!(items, expected, "agrees with array_items: {text}");
        }
    }
}
