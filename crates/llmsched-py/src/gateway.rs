//! `NativeGateway`: the native data plane (`llmsched-gateway`) started in-process on its own
//! runtime thread, routing with a `Router` built in Python (one pool, index and router shared
//! by both sides). Every method releases the GIL; the request path never takes it (a Python
//! scorer or filter configured in the router takes it for its own call only).

use std::net::ToSocketAddrs;
use std::sync::Arc;

use llmsched_core::routing::Router;
use llmsched_gateway::admin::EnginesHook;
use llmsched_gateway::conversation::ContentFormat;
use llmsched_gateway::tokcache::{CacheStats, DEFAULT_CAPACITY};
use llmsched_gateway::token_check::{TokenCheck, TokenNote};
use llmsched_gateway::tokenize::{PromptProblem, PromptTokenizer};
use llmsched_gateway::truncation::Truncation;
use llmsched_gateway::{
    BlockSizeHook, EngineEntry, ExtraMetrics, GatewayConfig, Hooks, RouterSource, Running,
    TokenWarningHook,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::to_python;
use crate::errors::{
    detach, ConfigError, GatewayStoppedError, InvalidRequestError, InvalidTypeError,
};
use crate::routing::PyRouter;

/// A Python router seen from the gateway's threads (the class is frozen: no GIL needed to
/// read it).
struct SharedRouter(Py<PyRouter>);

impl RouterSource for SharedRouter {
    fn router(&self) -> &Router {
        &self.0.get().inner
    }
}

/// The native data plane, serving on its own thread until `stop()`.
#[pyclass(frozen, module = "llmsched._llmsched", name = "NativeGateway")]
pub struct PyNativeGateway {
    running: Mutex<Option<Running>>,
    /// Read without `running`'s lock: `extra_metrics`, called while `metrics_text` holds it,
    /// reads the router's stats, which read this.
    token_check: Arc<TokenCheck>,
    host: String,
    port: u16,
}

fn stopped() -> PyErr {
    GatewayStoppedError::new_err("the native gateway is stopped")
}

#[pymethods]
impl PyNativeGateway {
    /// Starts serving on `host:port` (0: any free port) with `config` (the JSON of
    /// `llmsched_gateway::GatewayConfig`), routing with `router` (an `llmsched.Router` or the
    /// native router inside one; None: a router built from `config`); `extra_metrics()`
    /// returns more `/metrics` text (called, with the GIL, on each scrape of `/metrics`);
    /// `engines(action, argument)` adds (`"add"`, the request body) or removes (`"remove"`,
    /// the worker id) an engine for the admin API and returns the status and JSON body to
    /// answer (called, with the GIL, on a blocking thread, per such admin call only);
    /// `block_size(worker, size)` is told the KV block size an engine's `/metrics` gives, on
    /// the first scrape that gives one and when it changes (with the GIL, on a blocking
    /// thread); `token_warning(kind, count)` is called (with the GIL, on a blocking thread)
    /// once with `("pseudo", 1)` at the first prompt hashed as pseudo-tokens while engine
    /// events feed the index, and once with `("mismatch", unconfirmed)` when the token ids the
    /// gateway routes on were never found among the blocks the engines' KV events report (see
    /// `token_check()`). Raises ConfigError naming the problem.
    #[new]
    #[pyo3(signature = (
        config, host, port, router=None, extra_metrics=None, engines=None, block_size=None,
        token_warning=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config: &str,
        host: &str,
        port: u16,
        router: Option<&Bound<'_, PyAny>>,
        extra_metrics: Option<Py<PyAny>>,
        engines: Option<Py<PyAny>>,
        block_size: Option<Py<PyAny>>,
        token_warning: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let token_warning: Option<TokenWarningHook> = token_warning.map(|callable| {
            Arc::new(move |note: TokenNote| {
                let (kind, count) = match note {
                    TokenNote::Pseudo => ("pseudo", 1),
                    TokenNote::Mismatch(unconfirmed) => ("mismatch", unconfirmed),
                };
                Python::attach(|py| {
                    // A failing warning must not stop the gateway.
                    let _ = callable.call1(py, (kind, count));
                });
            }) as TokenWarningHook
        });
        let block_size: Option<BlockSizeHook> = block_size.map(|callable| {
            Arc::new(move |worker: &str, size: u32| {
                Python::attach(|py| {
                    // A failing warning must not stop the scrape.
                    let _ = callable.call1(py, (worker, size));
                });
            }) as BlockSizeHook
        });
        let engines: Option<EnginesHook> = engines.map(|callable| {
            Arc::new(move |action: &str, argument: &str| {
                Python::attach(|py| {
                    callable
                        .call1(py, (action, argument))
                        .and_then(|v| v.extract::<(u16, String)>(py))
                        .map_err(|e| e.to_string())
                })
            }) as EnginesHook
        });
        // Called on a scrape of `/metrics` only: the GIL for that call, nothing else.
        let extra: Option<ExtraMetrics> = extra_metrics.map(|callable| {
            Arc::new(move || {
                Python::attach(|py| {
                    callable.call0(py).and_then(|v| v.extract::<String>(py)).unwrap_or_default()
                })
            }) as ExtraMetrics
        });
        let router: Option<Py<PyRouter>> = match router {
            None => None,
            Some(r) => Some(match r.cast::<PyRouter>() {
                Ok(native) => native.clone().unbind(),
                Err(_) => r
                    .getattr("_native")
                    .ok()
                    .and_then(|n| n.cast::<PyRouter>().ok().map(|n| n.clone().unbind()))
                    .ok_or_else(|| {
                        InvalidTypeError::new_err("router must be an llmsched.Router")
                    })?,
            }),
        };
        let config: GatewayConfig = serde_json::from_str(config)
            .map_err(|e| ConfigError::new_err(format!("native gateway config: {e}")))?;
        let host = host.to_string();
        let source = router.map(|r| Arc::new(SharedRouter(r)) as Arc<dyn RouterSource>);
        let started = detach(py, move || {
            let addr = (host.as_str(), port)
                .to_socket_addrs()
                .map_err(|e| format!("listen.host: cannot resolve {host:?}: {e}"))?
                .next()
                .ok_or_else(|| format!("listen.host: {host:?} has no address"))?;
            let hooks = Hooks { extra_metrics: extra, engines, block_size, token_warning };
            llmsched_gateway::spawn(addr, config, source, hooks).map_err(|e| e.to_string())
        })?;
        let running = started.map_err(ConfigError::new_err)?;
        let (host, port) = (running.addr.ip().to_string(), running.addr.port());
        let token_check = running.token_check();
        Ok(PyNativeGateway { running: Mutex::new(Some(running)), token_check, host, port })
    }

    /// The check that the token ids the gateway routes on reach the engines' KV events:
    /// `(confirmed, unconfirmed, warned_at, pseudo_picks)` (the prompts sampled that an engine
    /// reported, those it did not while events kept arriving, the unconfirmed count when the
    /// warning was given or None, and the prompts hashed as pseudo-tokens while engine events
    /// fed the index). Also after `stop()`; never waits for the gateway (the router's stats
    /// read it, also from `extra_metrics` while `metrics_text` runs).
    fn token_check(&self) -> (u64, u64, Option<u64>, u64) {
        let stats = self.token_check.stats();
        (stats.confirmed, stats.unconfirmed, stats.warned_at, stats.pseudo_picks)
    }

    /// The address listened on.
    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    /// The port listened on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Whether it serves.
    #[getter]
    fn running(&self) -> bool {
        self.running.lock().as_ref().is_some_and(Running::running)
    }

    /// Stops listening, closes every connection and joins the runtime thread. Idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let running = self.running.lock().take();
        detach(py, move || drop(running))
    }

    /// Replaces the engines (`(id, base URL)` pairs); returns the ids added and removed. The shared
    /// router's pool is the caller's to update. An empty list leaves no engine (requests get a
    /// 503 until some come); ConfigError (nothing changed) on a repeated or malformed list.
    /// `changes`: the engine changes to count (`engine_changes`), as the Python plane counts
    /// them (None: the gateway's own count).
    #[pyo3(signature = (engines, changes=None))]
    fn set_engines(
        &self,
        py: Python<'_>,
        engines: Vec<(String, String)>,
        changes: Option<u64>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let engines: Vec<EngineEntry> =
            engines.into_iter().map(|(id, url)| EngineEntry::Named { id, url }).collect();
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        let result = detach(py, || match changes {
            Some(changes) => running.set_engines_counting(&engines, changes),
            None => running.set_engines(&engines),
        })?;
        result.map_err(|e| ConfigError::new_err(e.to_string()))
    }

    /// The `/metrics` text.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        detach(py, || running.metrics_text())
    }

    /// Each engine's health state: `up`, `down` (its probes failed), `open` (its breaker) or
    /// `draining` (the admin API).
    fn health_states(&self, py: Python<'_>) -> PyResult<Vec<(String, &'static str)>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        detach(py, || running.health_states())
    }

    /// Engines a request could go to now (in the pool and up).
    fn routable(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        detach(py, || running.routable())
    }

    /// This gateway's usage since the last call (`llmsched.cluster.Usage`: `keys` by digest
    /// with requests and tokens taken, `tenants` with prompt and output tokens served).
    fn drain_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        let usage = detach(py, || running.drain_usage())?;
        let keys = PyDict::new(py);
        for (digest, requests, tokens) in usage.keys {
            keys.set_item(digest, (requests, tokens))?;
        }
        let out = PyDict::new(py);
        out.set_item("keys", keys)?;
        out.set_item("tenants", usage.tenants)?;
        Ok(out)
    }

    /// Charges other replicas' usage (the shape `drain_usage` returns) to the same keys'
    /// buckets and tenants' flows here.
    fn apply_usage(
        &self,
        py: Python<'_>,
        keys: std::collections::HashMap<String, (f64, f64)>,
        tenants: Vec<(String, i32, u64, u64)>,
    ) -> PyResult<()> {
        let usage = llmsched_gateway::usage::Usage {
            keys: keys.into_iter().map(|(d, (r, t))| (d, r, t)).collect(),
            tenants,
        };
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        detach(py, || running.apply_usage(&usage))
    }

    /// Requests being decoded in token slices now, or None when slices are off.
    fn sliced_requests(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        detach(py, || running.sliced_requests())
    }

    /// Flow control's snapshot (`queued`, `running`, `saturation`, `tenants`, `outcomes`), or
    /// None when flow control is off.
    fn flow_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        let Some(stats) = detach(py, || running.flow_stats())? else { return Ok(None) };
        let out = PyDict::new(py);
        out.set_item("queued", stats.queued)?;
        out.set_item("running", stats.running)?;
        out.set_item("saturation", stats.saturation)?;
        out.set_item("tenants", stats.tenants)?;
        let outcomes = PyDict::new(py);
        for (outcome, count) in stats.outcomes {
            outcomes.set_item(outcome.name(), count)?;
        }
        out.set_item("outcomes", outcomes)?;
        Ok(Some(out))
    }

    /// Flow control's gauges and counters (the shape of `llmsched.FlowController.metrics()`),
    /// or None when flow control is off.
    fn flow_metrics<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        match detach(py, || running.flow_metrics())? {
            None => Ok(None),
            Some(metrics) => to_python(py, &metrics).map(Some),
        }
    }

    /// Connection and request counters: `received`, `completed`, `disconnects`,
    /// `connections`, `retries`, `records_removed`.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        let c = running.counters();
        let out = PyDict::new(py);
        out.set_item("received", c.received.load(Relaxed))?;
        out.set_item("completed", c.completed.load(Relaxed))?;
        out.set_item("disconnects", c.disconnects.load(Relaxed))?;
        out.set_item("connections", c.connections.load(Relaxed))?;
        out.set_item("retries", c.retries.load(Relaxed))?;
        out.set_item("records_removed", c.records_removed.load(Relaxed))?;
        Ok(out)
    }

    /// Sets the engines' context length (None: unknown): what a request's
    /// `truncate_prompt_tokens` of -1 keeps less one, as vLLM keeps it.
    #[pyo3(signature = (max_model_len))]
    fn set_max_model_len(&self, max_model_len: Option<usize>) -> PyResult<()> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        running.set_max_model_len(max_model_len.filter(|&n| n > 0));
        Ok(())
    }

    /// The tokenizer's piece cache (`TokenizerCacheStats`), or None without a tokenizer.
    fn tokenizer_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let guard = self.running.lock();
        let running = guard.as_ref().ok_or_else(stopped)?;
        match detach(py, || running.tokenizer_cache_stats())? {
            None => Ok(None),
            Some(stats) => cache_stats_dict(py, &stats).map(Some),
        }
    }
}

// `NativePromptTokenizer`'s default `cache_bytes`, written out for its signature.
const _: () = assert!(DEFAULT_CAPACITY == 33_554_432);

/// `TokenizerCacheStats` as a dict.
fn cache_stats_dict<'py>(py: Python<'py>, stats: &CacheStats) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("enabled", stats.enabled)?;
    out.set_item("disabled_reason", stats.disabled_reason.as_deref())?;
    out.set_item("capacity_bytes", stats.capacity_bytes)?;
    out.set_item("bytes", stats.bytes)?;
    out.set_item("entries", stats.entries)?;
    out.set_item("hits", stats.hits)?;
    out.set_item("misses", stats.misses)?;
    out.set_item("evictions", stats.evictions)?;
    out.set_item("fallbacks", stats.fallbacks)?;
    out.set_item("chunks", stats.chunks)?;
    out.set_item("chunks_disabled_reason", stats.chunks_disabled_reason.as_deref())?;
    out.set_item("completions", stats.completions)?;
    Ok(out)
}

/// The native plane's prompt tokenizer on its own (`llmsched_gateway::tokenize`): what
/// `llmsched serve --data-plane native` computes per request, callable from Python to compare
/// with `llmsched.tokenize.PromptTokenizer`.
#[pyclass(frozen, module = "llmsched._llmsched", name = "NativePromptTokenizer")]
pub struct PyNativePromptTokenizer {
    inner: PromptTokenizer,
}

fn prompt_error(problem: PromptProblem) -> PyErr {
    InvalidRequestError::new_err(problem.0)
}

#[pymethods]
impl PyNativePromptTokenizer {
    /// Loads a `save_pretrained` tokenizer directory; ConfigError when it cannot be loaded or
    /// its chat template cannot be rendered (probe conversations are rendered). Chat prompts
    /// go through a piece cache of `cache_bytes` (0: none) where the tokenizer's piecewise
    /// encoding is proved exact at load. `content_format`: `"auto"` (detected from the
    /// template as vLLM detects it), `"string"` or `"openai"` (as vLLM's
    /// `--chat-template-content-format` sets it). `chat_template`: a template's text in place
    /// of the directory's own (vLLM's `--chat-template`); `default_chat_template_kwargs`: a
    /// JSON object's text, the variables under every request's (vLLM's
    /// `--default-chat-template-kwargs`); `exclude_tools_when_tool_choice_none`: vLLM's flag of
    /// that name (a request's `tool_choice` of `"none"` leaves its tools out);
    /// `trust_request_chat_template`: vLLM's `--trust-request-chat-template` (a request's own
    /// `chat_template` is rendered; without it, such a request is refused); `max_model_len`:
    /// the engines' context length (a `truncate_prompt_tokens` of -1 keeps one less).
    #[new]
    #[pyo3(signature = (
        directory,
        cache_bytes=33554432,
        content_format="auto",
        chat_template=None,
        default_chat_template_kwargs=None,
        exclude_tools_when_tool_choice_none=false,
        trust_request_chat_template=false,
        max_model_len=None,
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per engine option
    fn new(
        py: Python<'_>,
        directory: &str,
        cache_bytes: i64,
        content_format: &str,
        chat_template: Option<&str>,
        default_chat_template_kwargs: Option<&str>,
        exclude_tools_when_tool_choice_none: bool,
        trust_request_chat_template: bool,
        max_model_len: Option<usize>,
    ) -> PyResult<Self> {
        let cache_bytes = usize::try_from(cache_bytes).map_err(|_| {
            ConfigError::new_err(format!("cache_bytes: must be an int >= 0, got {cache_bytes}"))
        })?;
        let format = match content_format {
            "auto" => None,
            "string" => Some(ContentFormat::String),
            "openai" => Some(ContentFormat::OpenAi),
            other => {
                return Err(ConfigError::new_err(format!(
                    "content_format: must be one of auto, string, openai, got {other:?}"
                )))
            }
        };
        let path = std::path::PathBuf::from(directory);
        let mut inner =
            detach(py, || PromptTokenizer::load_with_template(&path, cache_bytes, chat_template))?
                .map_err(|e| ConfigError::new_err(format!("tokenizer: {e}")))?
                .with_content_format(format)
                .with_exclude_tools_when_tool_choice_none(exclude_tools_when_tool_choice_none)
                .with_trust_request_chat_template(trust_request_chat_template);
        if let Some(kwargs) = default_chat_template_kwargs {
            inner = inner.with_default_kwargs(kwargs).map_err(ConfigError::new_err)?;
        }
        inner.set_context_len(max_model_len.filter(|&n| n > 0));
        Ok(PyNativePromptTokenizer { inner })
    }

    /// Whether chat requests can be tokenized.
    #[getter]
    fn has_chat_template(&self) -> bool {
        self.inner.has_chat_template()
    }

    /// How the chat template takes a message's list content, detected from its source as
    /// vLLM detects it: `"openai"` (parts as `{type, ...}` objects) when it loops over a
    /// message's content, else `"string"` (texts joined by newlines).
    #[getter]
    fn content_format(&self) -> &'static str {
        self.inner.content_format().name()
    }

    /// The special tokens the chat template sees (`bos_token`, `eos_token`, ...).
    #[getter]
    fn special_tokens(&self) -> Vec<(String, String)> {
        self.inner.special_tokens().to_vec()
    }

    /// The chat template's text for a chat request body (JSON text with `messages`, maybe
    /// `tools` and `chat_template_kwargs`); InvalidRequestError naming the problem.
    fn render_chat(&self, py: Python<'_>, request: &str) -> PyResult<String> {
        detach(py, || self.inner.render_body(request.as_bytes()))?.map_err(prompt_error)
    }

    /// The token ids of a chat request body, as the native plane routes on them.
    fn chat_tokens(&self, py: Python<'_>, request: &str) -> PyResult<Vec<u32>> {
        detach(py, || self.inner.chat_tokens_of_body(request.as_bytes()))?.map_err(prompt_error)
    }

    /// The token ids of a completions request body's `prompt` (JSON text), special tokens
    /// added unless its `add_special_tokens` is false.
    fn completion_tokens(&self, py: Python<'_>, request: &str) -> PyResult<Vec<u32>> {
        let body: serde_json::Value = serde_json::from_str(request)
            .map_err(|e| InvalidRequestError::new_err(format!("request: {e}")))?;
        let truncation = Truncation::of_body(&body, self.inner.context_len())
            .map_err(InvalidRequestError::new_err)?;
        let tokens = detach(py, || {
            self.inner.completion_tokens(
                body.get("prompt"),
                body.get("add_special_tokens"),
                truncation,
            )
        })?;
        tokens.map_err(prompt_error)
    }

    /// The ids of a rendered chat prompt (no special tokens added), through the piece cache
    /// when it is on.
    fn encode_chat(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        detach(py, || self.inner.encode_chat(text))?.map_err(prompt_error)
    }

    /// The ids of `text` (no special tokens added), encoded whole without the cache: the
    /// oracle of `encode_chat`.
    fn encode_whole(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        detach(py, || self.inner.encode(text, false))?.map_err(prompt_error)
    }

    /// The piece cache's counters and state (`TokenizerCacheStats`).
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = detach(py, || self.inner.cache_stats())?;
        cache_stats_dict(py, &stats)
    }
}

/// The HELP text of every family of the gateway's `/metrics`, by name without the
/// `llmsched_gateway_` prefix (and a counter's `_total`): `llmsched_gateway::metrics::HELP`,
/// which both data planes read (a new dict each call).
#[pyfunction]
fn gateway_metric_help(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let help = PyDict::new(py);
    for &(name, text) in llmsched_gateway::metrics::HELP {
        help.set_item(name, text)?;
    }
    Ok(help)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNativeGateway>()?;
    m.add_class::<PyNativePromptTokenizer>()?;
    m.add_function(wrap_pyfunction!(gateway_metric_help, m)?)
}
