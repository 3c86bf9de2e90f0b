//! A chat request as its chat template sees it: the JSON of the request's messages, tools and
//! template arguments as template values, and the variables of one render.
//!
//! A template reads a few members of a few small objects (each message's `role` and
//! `content`, again for every message), so a JSON object of up to [`SMALL`] members becomes a
//! [`Members`]: its members in the order sent, found by comparing keys. minijinja's own map
//! hashes every key with SipHash when it is built and on every `m['role']`, which cost more
//! than the comparisons over so few members; larger objects (a tool's schema, say) still become
//! minijinja's map. Every other value is what minijinja's own deserialisation makes of it, and
//! a map behaves the same either way: members in the order sent, a repeated key keeping its
//! first place and its last value (as Python's `json` keeps it).

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectExt, ObjectRepr, Value};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Objects of up to this many members are [`Members`]; larger ones minijinja's hash map.
pub const SMALL: usize = 16;

/// A JSON text as the template's value (see the module documentation).
///
/// A raw value is valid JSON by construction, and the body it came from was checked whole
/// ([`crate::payload::Payload::parse`]): a direct reader takes the usual shapes, finding each
/// string's end with `memchr` where serde_json checks every byte again for control
/// characters. What it does not take (a float, an integer past 64 bits, a lone surrogate
/// escape, nesting past 100 levels) is read by serde_json, which decides it.
pub fn template_value(raw: &RawValue) -> Result<Value, serde_json::Error> {
    let text = raw.get();
    let mut direct = Direct { text, at: 0, depth: 0 };
    if let Some(value) = direct.value() {
        direct.skip_whitespace();
        if direct.at == text.len() {
            return Ok(value);
        }
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value = TemplateValue.deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// Nesting past this is left to serde_json (whose recursion limit is 128).
const DIRECT_DEPTH: usize = 100;

/// Reads a JSON text into template values as [`TemplateValue`] does, or gives up (`None`) on
/// anything past the usual shapes (see [`template_value`]).
struct Direct<'a> {
    text: &'a str,
    at: usize,
    depth: usize,
}

impl<'a> Direct<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => self.string().map(|s| Value::from(&*s)),
            b't' => self.literal("true", Value::from(true)),
            b'f' => self.literal("false", Value::from(false)),
            b'n' => self.literal("null", Value::from(())),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &str, value: Value) -> Option<Value> {
        self.text[self.at..].starts_with(word).then(|| {
            self.at += word.len();
            value
        })
    }

    /// A number as Python's `json` reads it: an integer (past 64 bits too, up to 128: a JSON
    /// Schema's `maximum` may be; `-0` is the integer 0) or a float, correctly rounded as
    /// Python's `float()` rounds it; None (left to serde_json) for an integer past 128 bits or
    /// a float out of range.
    fn integer(&mut self) -> Option<Value> {
        let start = self.at;
        let negative = self.peek() == Some(b'-');
        self.at += usize::from(negative);
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
        let mut float = false;
        if self.peek() == Some(b'.') {
            float = true;
            self.at += 1;
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.at += 1;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            float = true;
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.at += 1;
            }
        }
        let digits = &self.text[start..self.at];
        if float {
            return digits.parse::<f64>().ok().filter(|f| f.is_finite()).map(Value::from);
        }
        if let Ok(value) = digits.parse::<u64>() {
            return Some(Value::from(value));
        }
        if let Ok(value) = digits.parse::<i64>() {
            return Some(Value::from(value));
        }
        digits.parse::<i128>().ok().map(Value::from)
    }

    /// The string at the cursor (an opening quote), borrowed when it has no escape.
    fn string(&mut self) -> Option<std::borrow::Cow<'a, str>> {
        let bytes = self.text.as_bytes();
        let start = self.at + 1;
        let end = start + memchr::memchr2(b'"', b'\\', &bytes[start..])?;
        if bytes[end] == b'"' {
            self.at = end + 1;
            return Some(std::borrow::Cow::Borrowed(&self.text[start..end]));
        }
        let mut out = String::with_capacity(end - start + 16);
        let mut from = start;
        let mut at = end;
        loop {
            out.push_str(&self.text[from..at]);
            if bytes[at] == b'"' {
                self.at = at + 1;
                return Some(std::borrow::Cow::Owned(out));
            }
            at = self.escape(at + 1, &mut out)?;
            from = at;
            at += memchr::memchr2(b'"', b'\\', &bytes[at..])?;
        }
    }

    /// Appends the escape after a backslash at `at`; returns the offset after it.
    fn escape(&self, at: usize, out: &mut String) -> Option<usize> {
        let bytes = self.text.as_bytes();
        let simple = match *bytes.get(at)? {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let high = self.hex4(at + 1)?;
                if !(0xD800..0xDC00).contains(&high) {
                    out.push(char::from_u32(high)?);
                    return Some(at + 5);
                }
                // A pair, or a lone surrogate that serde_json refuses.
                if bytes.get(at + 5..at + 7)? != b"\\u" {
                    return None;
                }
                let low = self.hex4(at + 7)?;
                if !(0xDC00..0xE000).contains(&low) {
                    return None;
                }
                out.push(char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))?);
                return Some(at + 11);
            }
            _ => return None,
        };
        out.push(simple);
        Some(at + 1)
    }

    fn hex4(&self, at: usize) -> Option<u32> {
        let digits = self.text.get(at..at + 4)?;
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(digits, 16).ok()
    }

    fn array(&mut self) -> Option<Value> {
        let mut items = Vec::new();
        self.elements(b']', |this| {
            items.push(this.value()?);
            Some(())
        })?;
        Some(Value::from(items))
    }

    fn object(&mut self) -> Option<Value> {
        let mut members: Vec<(Value, Value)> = Vec::with_capacity(4);
        self.elements(b'}', |this| {
            this.skip_whitespace();
            if this.peek()? != b'"' {
                return None;
            }
            let key = Value::from(&*this.string()?);
            this.skip_whitespace();
            if this.peek()? != b':' {
                return None;
            }
            this.at += 1;
            members.push((key, this.value()?));
            Some(())
        })?;
        Some(Members::value(members))
    }

    /// The comma-separated elements of the array or object at the cursor (its opening
    /// bracket), each read by `element`, through the `close` bracket; None past
    /// [`DIRECT_DEPTH`] levels or on anything else.
    fn elements(
        &mut self,
        close: u8,
        mut element: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        self.at += 1;
        self.depth += 1;
        if self.depth > DIRECT_DEPTH {
            return None;
        }
        self.skip_whitespace();
        if self.peek() == Some(close) {
            self.at += 1;
        } else {
            loop {
                element(self)?;
                self.skip_whitespace();
                match self.peek()? {
                    b',' => self.at += 1,
                    b if b == close => {
                        self.at += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.depth -= 1;
        Some(())
    }
}

/// Reads any JSON value as a template value.
#[derive(Clone, Copy)]
struct TemplateValue;

impl<'de> DeserializeSeed<'de> for TemplateValue {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TemplateValue {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::from(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members: Vec<(Value, Value)> = Vec::with_capacity(map.size_hint().unwrap_or(4));
        while let Some(key) = map.next_key_seed(self)? {
            let value = map.next_value_seed(self)?;
            members.push((key, value));
        }
        Ok(Members::value(members))
    }
}

/// A small JSON object (see the module documentation).
#[derive(Debug)]
pub struct Members(Vec<(Value, Value)>);

impl Members {
    /// The members, in the order sent.
    pub fn entries(&self) -> &[(Value, Value)] {
        &self.0
    }

    /// The object of `members` as sent (a repeated key keeps its first place and its last
    /// value): a [`Members`] when small, else minijinja's map.
    pub fn value(members: Vec<(Value, Value)>) -> Value {
        if members.len() > SMALL {
            return Value::from_iter(members);
        }
        let mut members = members;
        // In place: a later repeat's value moves into the first place of its key.
        let mut kept = 0;
        for i in 0..members.len() {
            match members[..kept].iter().position(|(seen, _)| *seen == members[i].0) {
                Some(first) => members[first].1 = std::mem::take(&mut members[i].1),
                None => {
                    members.swap(kept, i);
                    kept += 1;
                }
            }
        }
        members.truncate(kept);
        Value::from_object(Members(members))
    }
}

impl Object for Members {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.0.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_rev_key_value_enumerator(|this| {
            Box::new(this.0.iter().map(|(k, v)| (k.clone(), v.clone())))
        })
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// The variables of one render, as vLLM 0.32 hands them to transformers'
/// `apply_chat_template` (`OnlineRenderer.preprocess_chat`, `ChatParams.with_defaults`):
///
/// - `messages`; `add_generation_prompt` (the request's own field);
/// - the request's `chat_template_kwargs`, a value of `None` or `"auto"` left out (vLLM's
///   `merge_kwargs` drops such overrides), over the engines' default kwargs, over the
///   tokenizer's special tokens: so a kwarg overrides a default, and either a special token,
///   of its name;
/// - `tools`: a kwarg of that name, else the request's `tools`, else a default, else none;
///   `documents`: the request's, else a kwarg, else a default, else none (both defined, as
///   transformers passes them);
/// - `reasoning_effort` and `enable_thinking` from the request's `reasoning_effort` over the
///   kwargs;
/// - the names transformers' `apply_chat_template` takes as its own arguments
///   (`continue_final_message`, `padding`, ...) are no template variables.
///
/// Built per render without copying the special tokens (shared) or the kwargs (looked up in
/// place).
#[derive(Debug)]
pub struct ChatContext {
    /// The messages, as the template iterates them.
    pub messages: Value,
    /// The request's `tools`, as vLLM hands them on.
    pub tools: Option<Value>,
    /// The request's `documents`.
    pub documents: Option<Value>,
    /// `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// `reasoning_effort` and `enable_thinking`, when the request sets them.
    pub reasoning: Vec<(&'static str, Value)>,
    /// The request's `chat_template_kwargs`, when a map.
    pub extra: Option<Value>,
    /// The engines' default `chat_template_kwargs`, when set (a map).
    pub defaults: Option<Value>,
    /// The tokenizer's special tokens (`bos_token`, ...) and their texts.
    pub special: Arc<[(String, Value)]>,
}

/// The variable the request's own field sets.
const ADD_GENERATION_PROMPT: &str = "add_generation_prompt";

/// Arguments of transformers' `apply_chat_template` that never reach the template.
const APPLY_ARGUMENTS: [&str; 10] = [
    "chat_template",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

impl ChatContext {
    /// A request kwarg, unless vLLM drops it (`None` or `"auto"`).
    fn extra(&self, key: &str) -> Option<Value> {
        request_kwarg(self.extra.as_ref(), key)
    }

    fn default(&self, key: &str) -> Option<Value> {
        default_kwarg(self.defaults.as_ref(), key)
    }
}

/// A kwarg of the request's `chat_template_kwargs` (`extra`), unless vLLM drops it (`None` or
/// `"auto"`).
fn request_kwarg(extra: Option<&Value>, key: &str) -> Option<Value> {
    let value = extra?.get_attr(key).ok()?;
    let unset = value.is_undefined() || value.is_none() || value.as_str() == Some("auto");
    (!unset).then_some(value)
}

/// A kwarg of the engines' default `chat_template_kwargs`.
fn default_kwarg(defaults: Option<&Value>, key: &str) -> Option<Value> {
    defaults?.get_attr(key).ok().filter(|v| !v.is_undefined())
}

/// The `tools` a template is handed, as vLLM merges them: a request kwarg, else the request's
/// own (`tools`, as vLLM hands them on), else a default kwarg; `None` when none is.
pub fn tools_variable(
    extra: Option<&Value>,
    tools: Option<&Value>,
    defaults: Option<&Value>,
) -> Option<Value> {
    request_kwarg(extra, "tools")
        .or_else(|| tools.cloned())
        .or_else(|| default_kwarg(defaults, "tools"))
        .filter(|tools| !tools.is_none())
}

impl Object for ChatContext {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.get_value_by_str(key.as_str()?)
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        match key {
            "messages" => return Some(self.messages.clone()),
            ADD_GENERATION_PROMPT => return Some(Value::from(self.add_generation_prompt)),
            "tools" => {
                let tools = tools_variable(
                    self.extra.as_ref(),
                    self.tools.as_ref(),
                    self.defaults.as_ref(),
                );
                return Some(tools.unwrap_or(Value::from(())));
            }
            "documents" => {
                let documents = self.documents.clone().or_else(|| self.extra("documents"));
                return Some(
                    documents.or_else(|| self.default("documents")).unwrap_or(Value::from(())),
                );
            }
            key if APPLY_ARGUMENTS.contains(&key) => return None,
            _ => {}
        }
        if let Some((_, value)) = self.reasoning.iter().find(|(name, _)| *name == key) {
            return Some(value.clone());
        }
        if let Some(value) = self.extra(key).or_else(|| self.default(key)) {
            return Some(value);
        }
        self.special.iter().find(|(name, _)| name == key).map(|(_, text)| text.clone())
    }

    /// Every variable's name, sorted.
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let mut names: Vec<String> = self.special.iter().map(|(name, _)| name.clone()).collect();
        let kwargs = [&self.extra, &self.defaults];
        for map in kwargs.into_iter().flatten() {
            if let Ok(keys) = map.try_iter() {
                names.extend(
                    keys.filter_map(|key| key.as_str().map(str::to_owned))
                        .filter(|key| self.get_value_by_str(key).is_some()),
                );
            }
        }
        names.retain(|name| !APPLY_ARGUMENTS.contains(&name.as_str()));
        names.extend(["messages", "tools", "documents", ADD_GENERATION_PROMPT].map(str::to_owned));
        names.extend(self.reasoning.iter().map(|(name, _)| (*name).to_owned()));
        names.sort_unstable();
        names.dedup();
        Enumerator::Values(names.into_iter().map(Value::from).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str) -> Value {
        template_value(serde_json::from_str(text).unwrap()).unwrap()
    }

    /// minijinja's own reading of the same JSON.
    fn minijinja_value(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn values_equal_minijinja_s_own_reading() {
        let texts = [
            r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]"#,
            r#"{"a": 1, "b": -2, "c": 1.5, "d": true, "e": null, "f": [1, "x", {}], "g": ""}"#,
            r#"{"k": 1, "k": 2, "j": 3}"#,
            r#"{"big": 18446744073709551615, "neg": -9223372036854775808, "e": 1e300}"#,
            r#""text with \"escapes\" \u00e9 \ud83d\udc09""#,
        ];
        for text in texts {
            let (ours, theirs) = (value(text), minijinja_value(text));
            assert_eq!(ours, theirs, "{text}");
            assert_eq!(format!("{ours:?}"), format!("{theirs:?}"), "{text}");
        }
    }

    #[test]
    fn members_keep_the_first_place_and_the_last_value_of_a_repeated_key() {
        let object = value(r#"{"k": 1, "j": 2, "k": 3}"#);
        let keys: Vec<Value> = object.try_iter().unwrap().collect();
        assert_eq!(keys, [Value::from("k"), Value::from("j")]);
        assert_eq!(object.get_attr("k").unwrap(), Value::from(3));
        assert_eq!(object.get_item(&Value::from("j")).unwrap(), Value::from(2));
        assert!(object.get_attr("missing").unwrap().is_undefined());
        assert_eq!(object.len(), Some(2));
    }

    #[test]
    fn large_objects_are_minijinja_maps_with_the_same_reading() {
        let members: Vec<String> = (0..=SMALL).map(|i| format!("\"m{i}\": {i}")).collect();
        let text = format!("{{{}, \"m0\": -1}}", members.join(", "));
        let (ours, theirs) = (value(&text), minijinja_value(&text));
        assert_eq!(ours, theirs);
        assert_eq!(ours.get_attr("m0").unwrap(), Value::from(-1));
        let keys: Vec<Value> = ours.try_iter().unwrap().collect();
        assert_eq!(keys.len(), SMALL + 1);
        assert_eq!(keys[0], Value::from("m0"));
    }

    /// JSON texts of any shape, objects of up to twice [`SMALL`] members with keys drawn from
    /// a few (so that keys repeat).
    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("null".to_owned()),
            any::<bool>().prop_map(|b| b.to_string()),
            any::<i64>().prop_map(|i| i.to_string()),
            any::<u64>().prop_map(|u| u.to_string()),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
            any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
            any::<String>().prop_map(|s| ascii_json(&s)),
            Just(r#""\/\b\f\n\r\t\"\\ \ud83d\udc09 \u00E9""#.to_owned()),
        ];
        leaf.prop_recursive(4, 64, 2 * SMALL as u32, |inner| {
            let key = prop_oneof![
                (0..24u8).prop_map(|k| format!("\"k{k}\"")),
                any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
                any::<String>().prop_map(|s| ascii_json(&s)),
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|items| { format!("[{}]", items.join(",")) }),
                prop::collection::vec((key, inner), 0..2 * SMALL).prop_map(|members| {
                    let members: Vec<String> =
                        members.into_iter().map(|(k, v)| format!("{k}: {v}")).collect();
                    format!("{{{}}}", members.join(", "))
                }),
            ]
        })
    }

    /// `s` as a JSON string with every character past ASCII escaped (`\\uXXXX`, surrogate
    /// pairs past the BMP), as Python's `json.dumps` writes it by default.
    fn ascii_json(s: &str) -> String {
        let mut out = String::from("\"");
        for c in s.chars() {
            if c.is_ascii() {
                let quoted = serde_json::to_string(&c.to_string()).unwrap();
                out.push_str(&quoted[1..quoted.len() - 1]);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        out.push('"');
        out
    }

    #[test]
    fn the_direct_reader_takes_the_usual_shapes() {
        let texts = [
            r#"[{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]"#,
            r#" { "a" : [ 1 , -2 , true , false , null , { } , [ ] ] , "b" : "" } "#,
            r#""\"q\" \\ \/ \b\f\n\r\t \u00e9 \ud83d\udc09 é 🐉""#,
            "[18446744073709551615, -9223372036854775808, 0, -1]",
        ];
        for text in texts {
            let mut direct = Direct { text, at: 0, depth: 0 };
            let read = direct.value().expect(text);
            direct.skip_whitespace();
            assert_eq!(direct.at, text.len(), "{text}");
            assert_eq!(format!("{read:?}"), format!("{:?}", minijinja_value(text)), "{text}");
        }
    }

    #[test]
    fn numbers_read_as_python_s_json_reads_them() {
        // Floats correctly rounded, `-0` the integer 0, integers past 64 bits exact.
        let read =
            value("[1.5, -2e3, 0.0, -0, 1E2, 0.1, 18446744073709551616, -9223372036854775809]");
        let items: Vec<Value> = read.try_iter().unwrap().collect();
        let expected = [
            Value::from(1.5),
            Value::from(-2000.0),
            Value::from(0.0),
            Value::from(0),
            Value::from(100.0),
            Value::from(0.1),
            Value::from(18_446_744_073_709_551_616_i128),
            Value::from(-9_223_372_036_854_775_809_i128),
        ];
        for (item, want) in items.iter().zip(expected) {
            assert_eq!(format!("{item:?}"), format!("{want:?}"));
            assert_eq!(item.is_integer(), want.is_integer(), "{item:?}");
        }
        assert_eq!(format!("{:?}", items[6]), "18446744073709551616");
    }

    #[test]
    fn what_the_direct_reader_leaves_to_serde_json_reads_the_same() {
        // Deep nesting, integers past 128 bits; a lone surrogate fails either way, and so does
        // a float out of range.
        let deep = format!("{}1{}", "[".repeat(DIRECT_DEPTH + 5), "]".repeat(DIRECT_DEPTH + 5));
        let huge = "[1000000000000000000000000000000000000000000]";
        for text in [&deep, huge] {
            let (ours, theirs) = (value(text), minijinja_value(text));
            assert_eq!(format!("{ours:?}"), format!("{theirs:?}"), "{text}");
        }
        for text in [r#""\ud83d""#, r#""\udc09""#, r#""\ud83d\u0041""#, "1e400"] {
            let raw: &RawValue = serde_json::from_str(text).unwrap();
            assert!(template_value(raw).is_err(), "{text}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_json_reads_as_minijinja_reads_it(text in json_text(), spaced in proptest::bool::ANY) {
            // Whitespace around the separators (inside strings it stays part of the text).
            let text = if spaced { text.replace(", ", " ,  ").replace(": ", " :  ") } else { text };
            let (ours, theirs) = (value(&text), minijinja_value(&text));
            proptest::prop_assert_eq!(&ours, &theirs);
            // The same members in the same order (Debug writes them in iteration order).
            proptest::prop_assert_eq!(format!("{ours:?}"), format!("{theirs:?}"));
            proptest::prop_assert_eq!(ours.len(), theirs.len());
        }
    }

    fn context(extra: Option<&str>, tools: Option<&str>, defaults: Option<&str>) -> Value {
        let special: Arc<[(String, Value)]> =
            Arc::from(vec![("bos_token".to_owned(), Value::from("<s>"))]);
        Value::from_object(ChatContext {
            messages: value(r#"[{"role": "user", "content": "hi"}]"#),
            tools: tools.map(value),
            documents: None,
            add_generation_prompt: true,
            reasoning: vec![("reasoning_effort", Value::from("low"))],
            extra: extra.map(value),
            defaults: defaults.map(value),
            special,
        })
    }

    #[test]
    fn variables_resolve_in_the_documented_order() {
        let plain = context(None, None, None);
        assert_eq!(plain.get_attr("bos_token").unwrap(), Value::from("<s>"));
        assert_eq!(plain.get_attr(ADD_GENERATION_PROMPT).unwrap(), Value::from(true));
        assert!(plain.get_attr("tools").unwrap().is_none());
        assert!(plain.get_attr("documents").unwrap().is_none());
        assert!(plain.get_attr("nothing").unwrap().is_undefined());
        let kwargs = r#"{"bos_token": "B", "add_generation_prompt": false, "flag": 1,
            "reasoning_effort": "high", "continue_final_message": true, "padding": true,
            "unset": null, "auto": "auto"}"#;
        let set = context(Some(kwargs), None, None);
        assert_eq!(set.get_attr("bos_token").unwrap(), Value::from("B"));
        assert_eq!(set.get_attr(ADD_GENERATION_PROMPT).unwrap(), Value::from(true));
        assert!(set.get_attr("tools").unwrap().is_none());
        assert_eq!(set.get_attr("flag").unwrap(), Value::from(1));
        assert_eq!(set.get_attr("reasoning_effort").unwrap(), Value::from("low"));
        assert!(set.get_attr("continue_final_message").unwrap().is_undefined());
        assert!(set.get_attr("padding").unwrap().is_undefined());
        // vLLM drops a kwarg of None or "auto": the variable is undefined, or the default.
        assert!(set.get_attr("unset").unwrap().is_undefined());
        assert!(set.get_attr("auto").unwrap().is_undefined());
        assert_eq!(set.get_attr("messages").unwrap().len(), Some(1));
        let with_tools = context(Some(kwargs), Some(r#"[{"name": "f"}]"#), None);
        assert_eq!(with_tools.get_attr("tools").unwrap().len(), Some(1));
        let names: Vec<Value> = with_tools.try_iter().unwrap().collect();
        let expected = [
            "add_generation_prompt",
            "bos_token",
            "documents",
            "flag",
            "messages",
            "reasoning_effort",
            "tools",
        ];
        assert_eq!(names, expected.map(Value::from));
    }

    #[test]
    fn kwargs_override_defaults_and_the_request_s_tools() {
        let defaults = r#"{"unset": 7, "mode": "brief", "tools": "default", "bos_token": "D",
            "documents": "default"}"#;
        let kwargs = r#"{"unset": null, "mode": "long", "tools": [1, 2, 3]}"#;
        let both = context(Some(kwargs), Some(r#"[{"name": "f"}]"#), Some(defaults));
        assert_eq!(both.get_attr("unset").unwrap(), Value::from(7));
        assert_eq!(both.get_attr("mode").unwrap(), Value::from("long"));
        assert_eq!(both.get_attr("tools").unwrap().len(), Some(3));
        assert_eq!(both.get_attr("bos_token").unwrap(), Value::from("D"));
        assert_eq!(both.get_attr("documents").unwrap(), Value::from("default"));
        let request_tools = context(None, Some(r#"[{"name": "f"}]"#), Some(defaults));
        assert_eq!(request_tools.get_attr("tools").unwrap().len(), Some(1));
        let default_tools = context(Some(r#"{"tools": null}"#), None, Some(defaults));
        assert_eq!(default_tools.get_attr("tools").unwrap(), Value::from("default"));
    }
}
