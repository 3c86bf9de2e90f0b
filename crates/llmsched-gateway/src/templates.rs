//! Chat templates: which one a chat request is rendered with, chosen as vLLM 0.32 and
//! transformers choose it, each compiled once.
//!
//! A tokenizer directory holds one template (`chat_template.jinja`, or a string under
//! `chat_template` in `tokenizer_config.json`) or several named ones (`chat_template.jinja` as
//! `default` beside `additional_chat_templates/NAME.jinja`, or a list of `{name, template}`
//! under `chat_template`). vLLM hands transformers' `get_chat_template` the request's
//! `chat_template` when it is not empty, else the engines' `--chat-template`, else a
//! `chat_template` among the request's `chat_template_kwargs`, else nothing; then:
//! - named templates: a name among them picks that template; nothing asked for picks
//!   `tool_use` when the request has tools (an empty list counts) and the tokenizer names
//!   one, else `default`; any other text is the template itself;
//! - one template: the text asked for, else the tokenizer's.
//!
//! A request's own template (the field or the kwarg) is refused unless the engines were
//! started with `--trust-request-chat-template`, as vLLM refuses it; where they were, it is
//! compiled once per distinct text (a bounded cache) and rendered on a bounded amount of
//! work ([`REQUEST_TEMPLATE_FUEL`]), so that no request can keep the gateway's thread busy.
//! vLLM detects the content format and the `developer` role on the template chosen, so each
//! compiled template carries both.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};
use serde_json::Value as Json;

use crate::conversation::{adds_to_safe_text, names_developer_role, ContentFormat};
use crate::pyvalues::{python_formatter, python_str, tojson};

/// The template's name in its environment.
const TEMPLATE: &str = "chat";

/// The work a request's own template may do per render (minijinja's instructions): far
/// above what a real template spends on a long conversation, far below a second of CPU.
pub const REQUEST_TEMPLATE_FUEL: u64 = 20_000_000;

/// Distinct request templates kept compiled; past this the cache starts again (as vLLM
/// bounds its own cache of request templates' content formats).
const REQUEST_TEMPLATES_KEPT: usize = 64;

/// The message vLLM answers a request's own template with, unless trusted, and what the
/// gateway's operator can do about it.
const UNTRUSTED: &str = "the request sets its own chat template, which the engines refuse \
    unless started with --trust-request-chat-template (set trust_request_chat_template: true \
    in the gateway's config when they are)";

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

/// Whether the template raised `err` itself (`raise_exception`).
pub fn raised(err: &Error) -> bool {
    std::error::Error::source(err).is_some_and(|s| s.downcast_ref::<Raised>().is_some())
}

/// An error's text: the template's own message for `raise_exception`, else the engine's
/// description with the template line.
pub fn describe(err: &Error) -> String {
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

/// A compiled chat template and what vLLM reads off its source.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// How it takes a message's list content, as vLLM detects it.
    pub content_format: ContentFormat,
    /// Whether its source names the `developer` role.
    pub developer_role: bool,
    /// Whether its source names `content` (transformers' check for `continue_final_message`).
    pub reads_content: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("content_format", &self.content_format)
            .field("developer_role", &self.developer_role)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` set up as transformers sets up Jinja; the error names the problem.
    pub fn compile(source: &str) -> Result<ChatTemplate, String> {
        let source = rewrite_generation_tags(source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        // Filters and tests where minijinja's own differ from Jinja on Python.
        env.add_filter("string", python_string);
        env.add_filter("trim", python_trim);
        env.add_test("iterable", python_iterable);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        if adds_to_safe_text(&source) {
            return Err("chat template adds to a `safe` filter's result (`\"...\" | safe + \
                        text`), which HTML-escapes the text on Python (Jinja's Markup) and not \
                        here; serve it with data_plane: python"
                .to_owned());
        }
        let content_format = ContentFormat::detect(&source);
        let developer_role = names_developer_role(&source);
        let reads_content = source.contains("content");
        env.add_template_owned(TEMPLATE, source)
            .map_err(|e| format!("chat template does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate { env, content_format, developer_role, reads_content })
    }

    /// Renders the template with `context` as its variables.
    pub fn render(&self, context: Value) -> Result<String, Error> {
        self.env.get_template(TEMPLATE)?.render(context)
    }
}

/// The tokenizer directory's own templates.
enum Own {
    None,
    One(Arc<ChatTemplate>),
    /// By name, in the order found.
    Named(Vec<(String, Arc<ChatTemplate>)>),
}

/// What a chat request asks of the template choice ([`ChatTemplates::choose`]).
#[derive(Debug, Clone, Default)]
pub struct TemplateAsked {
    /// The request's `chat_template` field (a name or a template's text), when not null.
    pub field: Option<String>,
    /// A `chat_template` among its `chat_template_kwargs`, when not null.
    pub kwarg: Option<String>,
}

/// Every template a request can be rendered with, and the rule choosing among them (see the
/// module documentation).
pub struct ChatTemplates {
    own: Own,
    /// The engines' `--chat-template`.
    engine: Option<Arc<ChatTemplate>>,
    /// The engines' `--trust-request-chat-template`.
    trust_requests: bool,
    /// Request templates compiled, by their text.
    requested: Mutex<HashMap<String, Arc<ChatTemplate>>>,
}

impl std::fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplates")
            .field("names", &self.names())
            .field("engine", &self.engine.is_some())
            .field("trust_requests", &self.trust_requests)
            .finish_non_exhaustive()
    }
}

impl ChatTemplates {
    /// The templates of a `save_pretrained` directory (`config`: its `tokenizer_config.json`,
    /// or null), with `engine` (the engines' `--chat-template`, as text) in front when given.
    /// The error names the file or the template that does not compile.
    pub fn load(
        directory: &Path,
        config: &Json,
        engine: Option<&str>,
    ) -> Result<ChatTemplates, String> {
        let compiled = |name: &str, source: &str| {
            ChatTemplate::compile(source).map(Arc::new).map_err(|e| match name {
                "" => e,
                _ => format!("chat template {name:?}: {e}"),
            })
        };
        let own = match own_sources(directory, config)? {
            OwnSources::None => Own::None,
            OwnSources::One(source) => Own::One(compiled("", &source)?),
            OwnSources::Named(named) if named.is_empty() => Own::None,
            OwnSources::Named(named) => Own::Named(
                named
                    .iter()
                    .map(|(name, source)| Ok((name.clone(), compiled(name, source)?)))
                    .collect::<Result<_, String>>()?,
            ),
        };
        let engine = engine.map(|source| compiled("", source)).transpose()?;
        Ok(ChatTemplates { own, engine, trust_requests: false, requested: Mutex::default() })
    }

    /// The templates for engines started with `--trust-request-chat-template` (or without).
    pub fn with_trust_requests(mut self, trust: bool) -> ChatTemplates {
        self.trust_requests = trust;
        self
    }

    /// Whether a request that asks for no template of its own can be rendered.
    pub fn has_default(&self) -> bool {
        self.default_template().is_some()
    }

    /// The template of a request asking for nothing, without tools (None: there is none).
    pub fn default_template(&self) -> Option<Arc<ChatTemplate>> {
        self.choose(&TemplateAsked::default(), false).ok()
    }

    /// The names of the directory's named templates (empty for one template or none).
    pub fn names(&self) -> Vec<&str> {
        match &self.own {
            Own::Named(named) => named.iter().map(|(name, _)| name.as_str()).collect(),
            _ => Vec::new(),
        }
    }

    /// Every template loaded (the engines' first, then the directory's), each with its name
    /// where the directory names several, for probing.
    pub fn loaded(&self) -> Vec<(Option<&str>, Arc<ChatTemplate>)> {
        let mut all: Vec<(Option<&str>, Arc<ChatTemplate>)> =
            self.engine.iter().map(|t| (None, t.clone())).collect();
        match &self.own {
            Own::None => {}
            Own::One(template) => all.push((None, template.clone())),
            Own::Named(named) => {
                all.extend(named.iter().map(|(n, t)| (Some(n.as_str()), t.clone())));
            }
        }
        all
    }

    /// The template a request is rendered with (`tools`: whether the template is handed tools,
    /// an empty list counting); a problem (a 400) when the request sets its own template and
    /// the engines do not trust it, when that template does not compile, or when there is
    /// none to choose.
    pub fn choose(&self, asked: &TemplateAsked, tools: bool) -> Result<Arc<ChatTemplate>, String> {
        if !self.trust_requests && (asked.field.is_some() || asked.kwarg.is_some()) {
            return Err(UNTRUSTED.to_owned());
        }
        let text = match asked.field.as_deref().filter(|field| !field.is_empty()) {
            Some(field) => Some(field),
            None => match &self.engine {
                Some(engine) => return Ok(engine.clone()),
                None => asked.kwarg.as_deref(),
            },
        };
        match (text, &self.own) {
            (Some(text), _) => match self.named(text) {
                Some(template) => Ok(template),
                None => self.requested(text),
            },
            (None, Own::One(template)) => Ok(template.clone()),
            (None, Own::Named(_)) => tools
                .then(|| self.named("tool_use"))
                .flatten()
                .or_else(|| self.named("default"))
                .ok_or_else(|| {
                    format!(
                        "the tokenizer has several chat templates and none named 'default' \
                         (it has {}): the request must name one in chat_template",
                        self.names().join(", ")
                    )
                }),
            (None, Own::None) => Err("the configured tokenizer has no chat template".into()),
        }
    }

    fn named(&self, name: &str) -> Option<Arc<ChatTemplate>> {
        match &self.own {
            Own::Named(named) => named.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone()),
            _ => None,
        }
    }

    /// A request's own template, compiled once per distinct text.
    fn requested(&self, text: &str) -> Result<Arc<ChatTemplate>, String> {
        let mut kept = self.requested.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(template) = kept.get(text) {
            return Ok(template.clone());
        }
        let mut template =
            ChatTemplate::compile(text).map_err(|e| format!("the request's chat_template: {e}"))?;
        template.env.set_fuel(Some(REQUEST_TEMPLATE_FUEL));
        let template = Arc::new(template);
        if kept.len() >= REQUEST_TEMPLATES_KEPT {
            kept.clear();
        }
        kept.insert(text.to_owned(), template.clone());
        Ok(template)
    }
}

/// A directory's template sources, as transformers holds them: one string or a dict.
enum OwnSources {
    None,
    One(String),
    Named(Vec<(String, String)>),
}

/// The directory's templates, as transformers loads them: `chat_template.jinja` (as
/// `default`) and `additional_chat_templates/*.jinja` when there are such files (one
/// template when there is only the first), else the `chat_template` entry of
/// `tokenizer_config.json` (a string, or a list of `{name, template}`, kept as named
/// templates however many). The additional files are taken in name order, so that the
/// order does not depend on the file system's.
fn own_sources(directory: &Path, config: &Json) -> Result<OwnSources, String> {
    let read = |file: &Path| {
        std::fs::read_to_string(file).map_err(|e| format!("{:?}: {e}", file.display().to_string()))
    };
    let mut named = Vec::new();
    let default_file = directory.join("chat_template.jinja");
    if default_file.is_file() {
        named.push(("default".to_owned(), read(&default_file)?));
    }
    let extra_dir = directory.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let entries = std::fs::read_dir(&extra_dir)
            .map_err(|e| format!("{:?}: {e}", extra_dir.display().to_string()))?;
        let mut extra = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name =
                path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".jinja"));
            if let Some(name) = name.filter(|_| path.is_file()) {
                extra.push((name.to_owned(), read(&path)?));
            }
        }
        extra.sort();
        // A `default.jinja` here takes the place of `chat_template.jinja`'s, as transformers'
        // dict keeps the later of the two.
        for (name, source) in extra {
            named.retain(|(n, _)| *n != name);
            named.push((name, source));
        }
    }
    if named.len() == 1 && named[0].0 == "default" {
        return Ok(OwnSources::One(named.remove(0).1));
    }
    if !named.is_empty() {
        return Ok(OwnSources::Named(named));
    }
    Ok(match config.get("chat_template") {
        Some(Json::String(template)) => OwnSources::One(template.clone()),
        Some(Json::Array(entries)) => OwnSources::Named(
            entries
                .iter()
                .filter_map(|entry| {
                    let name = entry.get("name")?.as_str()?;
                    let template = entry.get("template")?.as_str()?;
                    Some((name.to_owned(), template.to_owned()))
                })
                .collect(),
        ),
        _ => OwnSources::None,
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

/// `value | string`: Python's `str()` (a list or a mapping as its `repr()`, `None` as
/// `None`), where minijinja writes its own form (`["a"]`, `none`).
fn python_string(value: &Value) -> Value {
    if value.kind() == minijinja::value::ValueKind::String {
        return value.clone();
    }
    Value::from(python_str(value))
}

/// `value | trim(chars)`: Python's `str(value).strip(chars)`; minijinja's own takes only
/// strings, so a list (a message's content in the `openai` format) was written in its form.
fn python_trim(value: &Value, chars: Option<&str>) -> Value {
    let text = python_str(value);
    let trimmed = match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)),
        None => text.trim(),
    };
    Value::from(trimmed)
}

/// `value is iterable` as on Python: `none` is not (minijinja iterates it as empty, so
/// `tools is iterable and tools | length > 0` failed on every request without tools).
fn python_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &ChatTemplate, context: Value) -> String {
        template.render(context).unwrap()
    }

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
    fn tojson_is_python_json_dumps() {
        let template = ChatTemplate::compile(
            "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(ensure_ascii=true) }}",
        )
        .unwrap();
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, null, true], "a": "é<\"\n"}"#).unwrap();
        assert_eq!(
            render(&template, minijinja::context! { v }),
            "{\"b\": [1, 2.5, null, true], \"a\": \"é<\\\"\\n\"}|{\n  \"b\": [\n    1,\n    \
             2.5,\n    null,\n    true\n  ],\n  \"a\": \"é<\\\"\\n\"\n}|{\"b\": [1, 2.5, null, \
             true], \"a\": \"\\u00e9<\\\"\\n\"}"
        );
    }

    #[test]
    fn values_print_as_python_str() {
        let template = ChatTemplate::compile("{{ n }} {{ t }} {{ l }} {{ d }} {{ u }}.").unwrap();
        let d: Value = serde_json::from_str(r#"{"k": "it's", "x": 1.0}"#).unwrap();
        let out =
            render(&template, minijinja::context! { n => (), t => true, l => vec!["a", "b"], d });
        assert_eq!(out, "None True ['a', 'b'] {'k': \"it's\", 'x': 1.0} .");
    }

    #[test]
    fn adding_to_safe_text_is_refused() {
        for source in [
            "{{ \"f:\" | safe + t }}",
            "{% set x = a + (b | safe) %}{{ x }}",
            "{% for t in tools %}{{ \"f:\"|safe + t.name + \"<\" }}{% endfor %}",
        ] {
            let Err(problem) = ChatTemplate::compile(source) else {
                panic!("{source} compiled");
            };
            assert!(problem.contains("data_plane: python"), "{problem}");
        }
        // Concatenation (`~`) does not escape on Python either, nor does `safe` alone.
        for source in ["{{ \"f:\" | safe ~ t }}", "{{ t | safe }}", "{{ a + b }}"] {
            assert!(ChatTemplate::compile(source).is_ok(), "{source}");
        }
    }

    #[test]
    fn string_trim_and_iterable_are_jinja_on_python_s() {
        let template = ChatTemplate::compile(
            "{{ l | trim }}|{{ l | string }}|{{ n | string }}|{{ ' x.' | trim(' .') }}|\
             {{ n is iterable }} {{ l is iterable }} {{ s is iterable }} {{ u is iterable }}|\
             {% if n is iterable and n | length > 0 %}tools{% endif %}",
        )
        .unwrap();
        let l: Value = serde_json::from_str(r#"[{"type": "text", "text": " hi "}]"#).unwrap();
        let out = render(&template, minijinja::context! { l, n => (), s => "ab" });
        assert_eq!(
            out,
            "[{'type': 'text', 'text': ' hi '}]|[{'type': 'text', 'text': ' hi '}]|None|x|\
             False True True True|"
        );
    }

    fn named(config: Json, engine: Option<&str>, trust: bool) -> ChatTemplates {
        let empty = std::env::temp_dir().join("llmsched-templates-test-none");
        ChatTemplates::load(&empty, &config, engine).unwrap().with_trust_requests(trust)
    }

    fn chosen(
        templates: &ChatTemplates,
        (asked, tools): (TemplateAsked, bool),
    ) -> Result<String, String> {
        templates.choose(&asked, tools).map(|t| render(&t, Value::UNDEFINED))
    }

    #[test]
    fn templates_are_chosen_as_transformers_chooses_them() {
        let config = serde_json::json!({"chat_template": [
            {"name": "default", "template": "D"},
            {"name": "tool_use", "template": "T"},
            {"name": "rag", "template": "R"},
        ]});
        let templates = named(config.clone(), None, true);
        let ask = |field: Option<&str>, kwarg: Option<&str>, tools: bool| {
            let asked =
                TemplateAsked { field: field.map(str::to_owned), kwarg: kwarg.map(str::to_owned) };
            (asked, tools)
        };
        assert_eq!(chosen(&templates, ask(None, None, false)).unwrap(), "D");
        assert_eq!(chosen(&templates, ask(None, None, true)).unwrap(), "T");
        assert_eq!(chosen(&templates, ask(Some("rag"), None, true)).unwrap(), "R");
        assert_eq!(chosen(&templates, ask(Some("own {{ 1 + 1 }}"), None, false)).unwrap(), "own 2");
        // An empty field asks for nothing; the kwarg comes after it.
        assert_eq!(chosen(&templates, ask(Some(""), Some("rag"), false)).unwrap(), "R");
        assert_eq!(chosen(&templates, ask(Some("default"), Some("rag"), true)).unwrap(), "D");
        // The engines' template comes before the kwarg, after the field.
        let engine = named(config, Some("E"), true);
        assert_eq!(chosen(&engine, ask(None, Some("rag"), true)).unwrap(), "E");
        assert_eq!(chosen(&engine, ask(Some("rag"), None, false)).unwrap(), "R");
        let one = named(serde_json::json!({"chat_template": "O"}), None, true);
        assert_eq!(chosen(&one, ask(None, None, true)).unwrap(), "O");
        assert_eq!(chosen(&one, ask(Some("tool_use"), None, false)).unwrap(), "tool_use");
        let no_default = named(
            serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}]}),
            None,
            false,
        );
        assert_eq!(chosen(&no_default, ask(None, None, true)).unwrap(), "T");
        let err = chosen(&no_default, ask(None, None, false)).unwrap_err();
        assert!(err.contains("none named 'default'") && err.contains("tool_use"), "{err}");
    }

    #[test]
    fn a_request_template_needs_trust_and_is_bounded() {
        let config = serde_json::json!({"chat_template": "O"});
        let untrusted = named(config.clone(), None, false);
        for asked in [
            TemplateAsked { field: Some(String::new()), ..TemplateAsked::default() },
            TemplateAsked { kwarg: Some("x".into()), ..TemplateAsked::default() },
        ] {
            let err = chosen(&untrusted, (asked, false)).unwrap_err();
            assert!(err.contains("--trust-request-chat-template"), "{err}");
        }
        let trusted = named(config, None, true);
        let endless = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}\
                       {% endfor %}";
        let template = trusted
            .choose(
                &TemplateAsked { field: Some(endless.into()), ..TemplateAsked::default() },
                false,
            )
            .unwrap();
        let err = template.render(Value::UNDEFINED).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfFuel);
        let err = trusted
            .choose(
                &TemplateAsked { field: Some("{% if %}".into()), ..TemplateAsked::default() },
                false,
            )
            .unwrap_err();
        assert!(err.starts_with("the request's chat_template: chat template does not compile"));
        // Compiled once per text.
        let asked = TemplateAsked { field: Some("X{{ 1 }}".into()), ..TemplateAsked::default() };
        let first = trusted.choose(&asked, false).unwrap();
        assert!(Arc::ptr_eq(&first, &trusted.choose(&asked, false).unwrap()));
    }

    #[test]
    fn named_template_files_are_read_as_transformers_reads_them() {
        let dir = std::env::temp_dir().join(format!("llmsched-templates-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "D").unwrap();
        std::fs::write(dir.join("additional_chat_templates/tool_use.jinja"), "T").unwrap();
        std::fs::write(dir.join("additional_chat_templates/notes.txt"), "not a template").unwrap();
        // The files come before the config's entry.
        let config = serde_json::json!({"chat_template": "C"});
        let templates = ChatTemplates::load(&dir, &config, None).unwrap();
        assert_eq!(templates.names(), ["default", "tool_use"]);
        assert_eq!(chosen(&templates, (TemplateAsked::default(), true)).unwrap(), "T");
        std::fs::write(dir.join("additional_chat_templates/broken.jinja"), "{% if %}").unwrap();
        let err = ChatTemplates::load(&dir, &config, None).unwrap_err();
        assert!(err.starts_with("chat template \"broken\": chat template does not compile"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
