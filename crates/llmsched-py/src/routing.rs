//! Bindings for `llmsched_core::routing`: the pool, the router, decisions, and Python plugins.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::convert::{config_mapping, to_python};
use crate::errors::{
    attached, detach, CoreResult, InvalidTypeError, InvalidValueError, PlacementError, ToPyErr,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySequence, PyString};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::prefix_index::{id_key, PyPrefixIndex};
use super::tokens::{TokenArray, TokenVisitor, DETACH_MIN_TOKENS};
use llmsched_core::hashing::TokenId;
use llmsched_core::prefix_index::WorkerKey;
use llmsched_core::routing::inflight::{Stage, Ticket};
use llmsched_core::routing::plugin::{
    Candidate, Filter, OnEmpty, PluginResult, RequestContext, Scorer,
};
use llmsched_core::routing::profile::{ProfileOutcome, KEPT};
use llmsched_core::routing::registry::{
    decode, defaults_of, ParamDoc, ParamError, ParamKind, Plugin, PluginDoc, Registry,
};
use llmsched_core::routing::rng::DecisionRng;
use llmsched_core::routing::{
    config, metrics_text, presets, Decision, Endpoint, EndpointPool, LoraState, MetricsUpdate,
    RequestMeta, Role, Router, RouterOptions, RoutingError, StaleMode, StalePolicy,
};

fn key_object<'py>(py: Python<'py>, key: &WorkerKey) -> PyResult<Bound<'py, PyAny>> {
    Ok(match key {
        WorkerKey::Int(i) => i.into_pyobject(py)?.into_any(),
        WorkerKey::Str(s) => s.into_pyobject(py)?.into_any(),
    })
}

// ---- pool ---------------------------------------------------------------------------------

/// The native endpoint pool; `llmsched.EndpointPool` wraps it.
#[pyclass(frozen, module = "llmsched._llmsched", name = "EndpointPool")]
pub struct PyEndpointPool {
    pub inner: Arc<EndpointPool>,
}

#[pymethods]
impl PyEndpointPool {
    #[new]
    fn new(stale_after: f64, stale_policy: &str) -> PyResult<Self> {
        let mode = StaleMode::parse(stale_policy).ok_or_else(|| {
            InvalidValueError::new_err(format!(
                "stale_policy must be 'saturated' or 'ignore', got {stale_policy:?}"
            ))
        })?;
        Ok(PyEndpointPool {
            inner: Arc::new(EndpointPool::new(StalePolicy { stale_after, mode }).py()?),
        })
    }

    #[staticmethod]
    fn default_staleness() -> (f64, &'static str) {
        let p = StalePolicy::default();
        (p.stale_after, p.mode.name())
    }

    #[getter]
    fn stale_after(&self) -> f64 {
        self.inner.policy().stale_after
    }

    #[getter]
    fn stale_policy(&self) -> &'static str {
        self.inner.policy().mode.name()
    }

    #[pyo3(signature = (id, address, role, labels, model))]
    fn upsert(
        &self,
        py: Python<'_>,
        id: &Bound<'_, PyAny>,
        address: String,
        role: Option<&str>,
        labels: BTreeMap<String, String>,
        model: Option<String>,
    ) -> PyResult<bool> {
        let endpoint = endpoint_of(id, address, role, labels, model)?;
        detach(py, || self.inner.upsert(endpoint))
    }

    /// `upsert` of each `(id, address, role, labels, model)` row in one step; every row is
    /// converted before anything changes. Returns how many were new.
    fn upsert_many(&self, py: Python<'_>, rows: &Bound<'_, PyList>) -> PyResult<usize> {
        let endpoints = rows
            .iter()
            .map(|row| {
                let (id, address, role, labels, model): EndpointRow<'_> = row.extract()?;
                endpoint_of(&id, address, role.as_deref(), labels, model)
            })
            .collect::<PyResult<Vec<_>>>()?;
        detach(py, || self.inner.upsert_many(endpoints))
    }

    fn remove(&self, py: Python<'_>, id: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = id_key(id, "endpoint")?;
        detach(py, || self.inner.remove(&key))?.py()
    }

    #[pyo3(signature = (id, waiting, running, kv_cache_usage, max_concurrency, now))]
    fn update(
        &self,
        id: &Bound<'_, PyAny>,
        waiting: Option<u32>,
        running: Option<u32>,
        kv_cache_usage: Option<f64>,
        max_concurrency: Option<u32>,
        now: f64,
    ) -> PyResult<()> {
        let key = id_key(id, "endpoint")?;
        let update = MetricsUpdate { waiting, running, kv_cache_usage, max_concurrency };
        self.inner.update_metrics(&key, update, now).py()
    }

    fn set_loras(
        &self,
        id: &Bound<'_, PyAny>,
        active: Vec<String>,
        waiting: Vec<String>,
        max_loras: u32,
    ) -> PyResult<()> {
        let key = id_key(id, "endpoint")?;
        self.inner.set_loras(&key, LoraState { active, waiting, max_loras }).py()
    }

    /// Applies a Prometheus text scrape; returns the fields it found.
    fn update_from_metrics_text<'py>(
        &self,
        py: Python<'py>,
        id: &Bound<'py, PyAny>,
        text: &str,
        now: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let key = id_key(id, "endpoint")?;
        let scrape = detach(py, || metrics_text::parse(text))?.py()?;
        if self.inner.snapshot().get(&key).is_none() {
            return Err(RoutingError::UnknownEndpoint(key).to_py_err());
        }
        self.inner.update_metrics(&key, scrape.update, now).py()?;
        let out = PyDict::new(py);
        out.set_item("waiting", scrape.update.waiting)?;
        out.set_item("running", scrape.update.running)?;
        out.set_item("kv_cache_usage", scrape.update.kv_cache_usage)?;
        if let Some(l) = scrape.loras {
            out.set_item("active_loras", l.active.clone())?;
            out.set_item("waiting_loras", l.waiting.clone())?;
            out.set_item("max_loras", l.max_loras)?;
            self.inner.set_loras(&key, l).py()?;
        }
        Ok(out)
    }

    /// Every endpoint as a dict (description, metrics, LoRA state, in-flight counts).
    fn endpoints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let members = self.inner.snapshot();
        let rows = members
            .list
            .iter()
            .map(|m| {
                let e = &m.endpoint;
                let d = PyDict::new(py);
                d.set_item("id", key_object(py, &e.id)?)?;
                d.set_item("address", &e.address)?;
                d.set_item("role", e.role.map(Role::name))?;
                d.set_item("labels", e.labels.clone())?;
                d.set_item("model", e.model.clone())?;
                let mt = m.metrics();
                d.set_item("waiting", mt.waiting)?;
                d.set_item("running", mt.running)?;
                d.set_item("kv_cache_usage", mt.kv_cache_usage)?;
                d.set_item("max_concurrency", mt.max_concurrency)?;
                d.set_item(
                    "timestamp",
                    if mt.timestamp.is_finite() { Some(mt.timestamp) } else { None },
                )?;
                let l = m.loras();
                d.set_item("active_loras", l.active.clone())?;
                d.set_item("waiting_loras", l.waiting.clone())?;
                d.set_item("max_loras", l.max_loras)?;
                let f = m.inflight.snapshot();
                d.set_item("in_flight_requests", f.requests)?;
                d.set_item("in_flight_prefill_tokens", f.prefill_tokens)?;
                d.set_item("in_flight_tokens", f.tokens)?;
                d.set_item("remote_in_flight_requests", m.inflight.remote().requests)?;
                Ok(d)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, rows)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// A row of `upsert_many`: `(id, address, role, labels, model)`, as `upsert` takes them.
type EndpointRow<'py> =
    (Bound<'py, PyAny>, String, Option<String>, BTreeMap<String, String>, Option<String>);

fn endpoint_of(
    id: &Bound<'_, PyAny>,
    address: String,
    role: Option<&str>,
    labels: BTreeMap<String, String>,
    model: Option<String>,
) -> PyResult<Endpoint> {
    let role = match role {
        None => None,
        Some(r) => Some(Role::parse(r).ok_or_else(|| {
            InvalidValueError::new_err(format!(
                "role must be 'prefill', 'decode', 'both' or None, got {r:?}"
            ))
        })?),
    };
    Ok(Endpoint { id: id_key(id, "endpoint")?, address, role, labels, model })
}

// ---- Python plugins -------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct PyPluginParams {
    handle: usize,
    // The plugin's name in the config, for errors; set by the Python layer like `handle`.
    #[serde(skip_serializing)]
    plugin: String,
    fail_open: bool,
    reads_metrics: bool,
}

/// A Python callable as a scorer or filter. It is called once per decision with the GIL held:
/// `fn(request: dict, endpoints: list[dict]) -> list[float] | list[bool]`.
struct PyCallable {
    /// The plugin's config name and the function's, as errors show them.
    name: String,
    function: Py<PyAny>,
    fail_open: bool,
    reads_metrics: bool,
}

impl PyCallable {
    /// Calls the function; `what`: one value of `T` as errors name it ("number", "bool").
    fn call<T>(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        what: &str,
    ) -> Result<Vec<T>, Box<dyn std::error::Error + Send + Sync>>
    where
        T: for<'a, 'py> FromPyObject<'a, 'py>,
    {
        Python::attach(|py| -> PyResult<Vec<T>> {
            let request = request_dict(py, ctx)?;
            let endpoints =
                cands.iter().map(|c| candidate_dict(py, ctx, c)).collect::<PyResult<Vec<_>>>()?;
            let out = self.function.call1(py, (request, PyList::new(py, endpoints)?))?;
            let values: Vec<T> = out.bind(py).extract().map_err(|_| {
                InvalidTypeError::new_err(format!(
                    "plugin {} must return a list with one {what} per endpoint: {}",
                    self.name,
                    unexpected::<T>(out.bind(py))
                ))
            })?;
            if values.len() != cands.len() {
                return Err(InvalidValueError::new_err(format!(
                    "plugin {} returned {} values for {} endpoints (one per endpoint expected)",
                    self.name,
                    values.len(),
                    cands.len()
                )));
            }
            Ok(values)
        })
        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    }
}

/// What a plugin returned in place of a list of `T`, for its error: the first item that is no
/// `T` (a list, a tuple, a numpy array), else the object's type. A generator or other
/// iterator is not consumed.
fn unexpected<T>(out: &Bound<'_, PyAny>) -> String
where
    T: for<'a, 'py> FromPyObject<'a, 'py>,
{
    let shown = |o: &Bound<'_, PyAny>| {
        let kind = o.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        let mut text = o.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
        if text.chars().count() > 40 {
            text = text.chars().take(40).chain(std::iter::once('…')).collect();
        }
        format!("{kind} {text}")
    };
    if out.cast::<PySequence>().is_ok() && !out.is_instance_of::<PyString>() {
        if let Ok(items) = out.try_iter() {
            for (i, item) in items.enumerate() {
                let Ok(item) = item else { break };
                if item.extract::<T>().is_err() {
                    return format!("item {i} is {}", shown(&item));
                }
            }
        }
    }
    format!("got {}", shown(out))
}

fn request_dict<'py>(py: Python<'py>, ctx: &RequestContext<'_>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt_tokens", ctx.prompt_tokens)?;
    d.set_item("prompt_blocks", ctx.query_blocks)?;
    d.set_item("block_size", ctx.block_size)?;
    d.set_item("model", ctx.meta.model.clone())?;
    d.set_item("lora", ctx.meta.lora.clone())?;
    d.set_item("priority", ctx.meta.priority)?;
    d.set_item("session_id", ctx.meta.session_id.clone())?;
    let session_endpoint = ctx.meta.session_endpoint.as_ref().map(|k| key_object(py, k));
    d.set_item("session_endpoint", session_endpoint.transpose()?)?;
    d.set_item("headers", ctx.meta.headers.iter().cloned().collect::<BTreeMap<_, _>>())?;
    d.set_item("now", ctx.now)?;
    Ok(d)
}

fn candidate_dict<'py>(
    py: Python<'py>,
    ctx: &RequestContext<'_>,
    c: &Candidate,
) -> PyResult<Bound<'py, PyDict>> {
    let e = ctx.endpoint(c);
    let d = PyDict::new(py);
    d.set_item("id", key_object(py, &e.id)?)?;
    d.set_item("address", &e.address)?;
    d.set_item("role", e.role.map(Role::name))?;
    d.set_item("labels", e.labels.clone())?;
    d.set_item("waiting", c.metrics.waiting)?;
    d.set_item("running", c.metrics.running)?;
    d.set_item("kv_cache_usage", c.metrics.kv_cache_usage)?;
    d.set_item("saturated", c.saturated)?;
    d.set_item("in_flight_requests", c.inflight.requests)?;
    d.set_item("in_flight_prefill_tokens", c.inflight.prefill_tokens)?;
    d.set_item("cached_blocks", c.cached_blocks)?;
    d.set_item("cached_tokens", ctx.cached_tokens(c))?;
    Ok(d)
}

impl Scorer for PyCallable {
    fn score(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        out: &mut [f64],
    ) -> PluginResult {
        let scores = self.call::<f64>(ctx, cands, "number")?;
        // Out-of-range numbers are clamped into [0, 1]; NaN has no place to clamp to, and
        // reading it as 0 would hide the plugin's bug.
        if let Some(i) = scores.iter().position(|s| s.is_nan()) {
            let message = format!(
                "plugin {} returned NaN for endpoint {i} of {} (a score is a number, clamped \
                 into [0, 1])",
                self.name,
                cands.len()
            );
            return Err(Box::new(InvalidValueError::new_err(message)));
        }
        out.copy_from_slice(&scores);
        Ok(())
    }

    fn reads_metrics(&self) -> bool {
        self.reads_metrics
    }

    fn may_block(&self) -> bool {
        true
    }
}

impl Filter for PyCallable {
    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        cands: &[Candidate],
        keep: &mut [bool],
        _: &mut DecisionRng,
    ) -> PluginResult {
        keep.copy_from_slice(&self.call::<bool>(ctx, cands, "bool")?);
        Ok(())
    }

    fn may_block(&self) -> bool {
        true
    }

    fn on_empty(&self) -> OnEmpty {
        if self.fail_open {
            OnEmpty::FailOpen
        } else {
            OnEmpty::FailClosed
        }
    }
}

// `handle` is what the Python layer puts in place of `function`, so it is not listed.
const PY_PLUGIN_PARAMS: &[ParamDoc] = &[
    ParamDoc::new(
        "function",
        ParamKind::Callable,
        "`fn(request, endpoints)`, called once per decision with the GIL held: the callable \
         itself in a dict config, its import path `\"module:function\"` in a YAML or JSON one",
    )
    .required(),
    ParamDoc::boolean("failOpen", "a filter that would keep nothing keeps everything instead"),
    ParamDoc::boolean("readsMetrics", "a scorer whose saturated or stale endpoints score 0"),
];

fn python_scorer_doc() -> PluginDoc {
    PluginDoc::new(
        "scorer",
        "a Python callable returning one score in [0, 1] per endpoint (a slower path)",
        PY_PLUGIN_PARAMS,
        defaults_of::<PyPluginParams>(),
    )
}

fn python_filter_doc() -> PluginDoc {
    PluginDoc::new(
        "filter",
        "a Python callable returning one keep flag per endpoint (a slower path)",
        PY_PLUGIN_PARAMS,
        defaults_of::<PyPluginParams>(),
    )
}

/// The built-in registry plus `python-scorer` and `python-filter` over `functions`.
pub(crate) fn registry(py: Python<'_>, functions: &[Py<PyAny>]) -> Registry {
    let mut r = Registry::builtin();
    r.document("python-scorer", python_scorer_doc);
    r.document("python-filter", python_filter_doc);
    for (type_name, filter) in [("python-scorer", false), ("python-filter", true)] {
        let functions: Vec<Py<PyAny>> = functions.iter().map(|f| f.clone_ref(py)).collect();
        r.add(type_name, move |params: &Value| {
            let p: PyPluginParams = decode(params)?;
            let function = functions
                .get(p.handle)
                .ok_or_else(|| ParamError::new("function", "must be a callable"))?;
            let function_name = Python::attach(|py| {
                function
                    .bind(py)
                    .getattr("__name__")
                    .and_then(|n| n.extract::<String>())
                    .unwrap_or_else(|_| "python".into())
            });
            let name = if p.plugin.is_empty() {
                format!("{function_name:?}")
            } else {
                format!("{:?} (function {function_name})", p.plugin)
            };
            let plugin = PyCallable {
                name,
                function: Python::attach(|py| function.clone_ref(py)),
                fail_open: p.fail_open,
                reads_metrics: p.reads_metrics,
            };
            Ok(if filter { Plugin::filter(plugin) } else { Plugin::scorer(plugin) })
        });
    }
    r
}

// ---- router -------------------------------------------------------------------------------

/// The native router; `llmsched.Router` wraps it.
#[pyclass(frozen, module = "llmsched._llmsched", name = "Router")]
pub struct PyRouter {
    pub(crate) inner: Router,
    pub(crate) index: Py<PyPrefixIndex>,
}

struct Decide<'a> {
    router: &'a Router,
    meta: &'a RequestMeta,
    now: f64,
}

impl TokenVisitor for Decide<'_> {
    type Output = Result<Decision, RoutingError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        self.router.decide(tokens, self.meta, self.now)
    }
}

#[pymethods]
impl PyRouter {
    #[new]
    #[pyo3(signature = (pool, index, config, functions, seed, record_ttl, session_ttl, max_sessions))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: &PyEndpointPool,
        index: Py<PyPrefixIndex>,
        config: &Bound<'_, PyAny>,
        functions: Vec<Py<PyAny>>,
        seed: Option<u64>,
        record_ttl: Option<f64>,
        session_ttl: Option<f64>,
        max_sessions: Option<usize>,
    ) -> PyResult<Self> {
        let value = config_mapping(Some(config), "router config")?;
        let config =
            config::parse(&value, &registry(py, &functions)).map_err(RoutingError::from).py()?;
        let d = RouterOptions::default();
        let options = RouterOptions {
            seed: seed.unwrap_or(d.seed),
            record_ttl: record_ttl.unwrap_or(d.record_ttl),
            session_ttl: session_ttl.unwrap_or(d.session_ttl),
            max_sessions: max_sessions.unwrap_or(d.max_sessions),
        };
        let inner =
            Router::new(pool.inner.clone(), index.get().inner.clone(), config, options).py()?;
        Ok(PyRouter { inner, index })
    }

    /// What a configuration asks of its caller: the index hints, the notes (older
    /// names, settings without effect), the precise prefix wiring, the saturation thresholds
    /// and whether flow control is turned on.
    #[staticmethod]
    fn config_info(
        py: Python<'_>,
        config: &Bound<'_, PyAny>,
        functions: Vec<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let value = config_mapping(Some(config), "router config")?;
        let c =
            config::parse(&value, &registry(py, &functions)).map_err(RoutingError::from).py()?;
        let notes: Vec<Value> = c
            .notes
            .iter()
            .map(|n| serde_json::json!({"key": n.key, "message": n.message}))
            .collect();
        let precise = c.precise.as_ref().map(|(key, p)| {
            serde_json::json!({
                "key": key,
                "block_size": p.block_size,
                "hash_seed": p.hash_seed,
                "vllm_seed": p.vllm_seed,
                "zmq_endpoint": p.kv_events.zmq_endpoint,
                "topic_filter": p.kv_events.topic_filter,
                "discover_pods": p.kv_events.discover_pods,
            })
        });
        let saturation = c.saturation.map(|s| {
            serde_json::json!({
                "queue_depth_threshold": s.queue_depth_threshold,
                "kv_cache_util_threshold": s.kv_cache_util_threshold,
                "metrics_staleness_s": s.metrics_staleness_s,
            })
        });
        let tokenizer = c
            .tokenizer
            .as_ref()
            .map(|(key, model)| serde_json::json!({"key": key, "model": model}));
        let data_layer = c.data_layer.as_ref().map(|d| {
            let sources: Vec<Value> = d
                .sources
                .iter()
                .map(|s| serde_json::json!({"source": s.source, "extractors": s.extractors}))
                .collect();
            serde_json::json!({"sources": sources, "inject_defaults": d.inject_defaults})
        });
        let prefill_header = c
            .prefill_header
            .as_ref()
            .map(|(key, header)| serde_json::json!({"key": key, "header": header}));
        let metrics_source = c
            .metrics_source
            .as_ref()
            .map(|(key, path)| serde_json::json!({"key": key, "path": path}));
        let info = serde_json::json!({
            "block_size": c.index_hints.block_size,
            "worker_capacity": c.index_hints.worker_capacity,
            "notes": notes,
            "precise": precise,
            "saturation": saturation,
            "flow_control": c.flow_control,
            "tokenizer": tokenizer,
            "data_layer": data_layer,
            "prefill_header": prefill_header,
            "default_profile": c.default_profile,
            "metrics_source": metrics_source,
            "session_affinity": c.reads_session(),
        });
        Ok(to_python(py, &info)?.unbind())
    }

    /// The config of a named preset, or None.
    #[staticmethod]
    fn preset<'py>(py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        presets::preset(name).map(|value| to_python(py, &value)).transpose()
    }

    #[staticmethod]
    fn preset_names() -> Vec<&'static str> {
        presets::NAMES.to_vec()
    }

    /// Every plugin type with its kind, summary and parameters (defaults, ranges), as plain
    /// data: the registry's catalogue, Python plugins included.
    #[staticmethod]
    fn plugin_catalogue(py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(to_python(py, &registry(py, &[]).catalogue())?.unbind())
    }

    #[staticmethod]
    fn plugin_types() -> Vec<String> {
        let mut names = Registry::builtin().type_names();
        names.extend(["python-filter".to_string(), "python-scorer".to_string()]);
        names.sort();
        names
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.options().seed
    }

    #[getter]
    fn record_ttl(&self) -> f64 {
        self.inner.options().record_ttl
    }

    #[getter]
    fn profiles(&self) -> Vec<String> {
        self.inner.config().profiles.iter().map(|p| p.name.clone()).collect()
    }

    #[pyo3(signature = (
        tokens, model, lora, priority, session_id, headers, cache_salt, now, session_endpoint=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn pick(
        slf: &Bound<'_, Self>,
        tokens: &Bound<'_, PyAny>,
        model: Option<String>,
        lora: Option<String>,
        priority: i32,
        session_id: Option<String>,
        headers: Vec<(String, String)>,
        cache_salt: Option<String>,
        now: f64,
        session_endpoint: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyDecision> {
        let py = slf.py();
        let tokens = TokenArray::extract(tokens, "tokens")?;
        let session_endpoint =
            session_endpoint.map(|e| id_key(e, "session_endpoint")).transpose()?;
        let meta = RequestMeta {
            model,
            lora,
            priority,
            session_id,
            headers,
            cache_salt,
            session_endpoint,
        };
        let router = &slf.get().inner;
        let decision = tokens
            .visit(py, Decide { router, meta: &meta, now }, DETACH_MIN_TOKENS)?
            .map_err(routing_err)?;
        Ok(PyDecision {
            router: slf.clone().unbind(),
            decision: Arc::new(decision),
            ticket: Mutex::new(TicketState::Picked),
        })
    }
}

// ---- decision -----------------------------------------------------------------------------

enum TicketState {
    Picked,
    Sent(Ticket),
    Closed,
}

/// The outcome of one pick (see `llmsched.Decision`).
#[pyclass(frozen, module = "llmsched._llmsched", name = "Decision")]
pub struct PyDecision {
    router: Py<PyRouter>,
    /// Shared with the decisions [`PyDecision::again`] makes.
    decision: Arc<Decision>,
    ticket: Mutex<TicketState>,
}

impl PyDecision {
    fn id<'py>(&self, py: Python<'py>, c: &Candidate) -> PyResult<Bound<'py, PyAny>> {
        key_object(py, &self.decision.endpoint(c).id)
    }

    /// One row of `explain_data`: base candidate `b` in outcome `o`.
    fn explain_row_dict<'py>(
        &self,
        py: Python<'py>,
        o: &ProfileOutcome,
        filters: &[&str],
        b: usize,
        (kept_at, rank): (Option<usize>, Option<usize>),
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = &self.decision;
        let c = &d.base[b];
        let r = PyDict::new(py);
        r.set_item("endpoint", self.id(py, c)?)?;
        r.set_item("address", &d.endpoint(c).address)?;
        r.set_item("cached_tokens", d.cached_tokens(c))?;
        r.set_item("saturated", c.saturated)?;
        // The metrics' time as the pick read them (None: never reported), so that explain()
        // says how old they were then, whatever the pool holds now.
        let stamp = c.metrics.timestamp;
        r.set_item("metrics_timestamp", stamp.is_finite().then_some(stamp))?;
        let removed = o.removed_by[b];
        r.set_item(
            "removed_by",
            if removed == KEPT { None } else { Some(filters[removed as usize]) },
        )?;
        if let Some(i) = kept_at {
            // `kept_at` is Some: `kept` is not empty.
            let scorers = o.scores.len() / o.kept.len();
            let scores: Vec<f64> = (0..scorers).map(|j| o.score(j, i)).collect();
            r.set_item("scores", scores)?;
            r.set_item("total", o.totals.get(i).copied())?;
        } else {
            r.set_item("scores", py.None())?;
            r.set_item("total", py.None())?;
        }
        r.set_item("rank", rank)?;
        Ok(r)
    }
}

#[pymethods]
impl PyDecision {
    #[getter]
    fn endpoint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.id(py, self.decision.chosen())
    }

    #[getter]
    fn address(&self) -> String {
        self.decision.endpoint(self.decision.chosen()).address.clone()
    }

    #[getter]
    fn fallbacks<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.decision.ranked().skip(1).map(|c| self.id(py, c)).collect()
    }

    #[getter]
    fn fallback_addresses(&self) -> Vec<String> {
        self.decision.ranked().skip(1).map(|c| self.decision.endpoint(c).address.clone()).collect()
    }

    #[getter]
    fn prefill_endpoint<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.decision.prefill().map(|c| self.id(py, c)).transpose()
    }

    #[getter]
    fn prefill_address(&self) -> Option<String> {
        self.decision.prefill().map(|c| self.decision.endpoint(c).address.clone())
    }

    #[getter]
    fn prompt_tokens(&self) -> u64 {
        self.decision.prompt_tokens
    }

    #[getter]
    fn cold(&self) -> bool {
        self.decision.cold
    }

    #[getter]
    fn sequence(&self) -> u64 {
        self.decision.sequence
    }

    /// Prompt tokens cached on the chosen endpoint.
    #[getter]
    fn cached(&self) -> u64 {
        self.decision.cached_tokens(self.decision.chosen())
    }

    /// `{endpoint: cached prompt tokens}` for every endpoint considered.
    fn cached_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for c in &self.decision.base {
            d.set_item(self.id(py, c)?, self.decision.cached_tokens(c))?;
        }
        Ok(d)
    }

    /// The P/D decision: None without a P/D handler.
    fn pd<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(note) = self.decision.pd else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("uncached_tokens", note.uncached_tokens)?;
        d.set_item("wanted", note.wanted)?;
        d.set_item("disaggregated", note.disaggregated)?;
        d.set_item("reason", note.reason.name())?;
        Ok(Some(d))
    }

    /// Raw material of `Decision.explain()`: one dict per profile run. `limit`: at most that
    /// many rows per profile, the first in the table's order (by rank, then kept rows by total,
    /// then removed rows), the rest counted in `omitted`, `omitted_kept` and
    /// `omitted_removed_by`; None (or a profile with no more endpoints): every row, in pool
    /// order.
    #[pyo3(signature = (limit=None))]
    fn explain_data<'py>(
        &self,
        py: Python<'py>,
        limit: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let router = self.router.get();
        let d = &self.decision;
        let mut profiles = Vec::new();
        for o in &d.outcomes {
            let profile = &router.inner.config().profiles[o.profile];
            let p = PyDict::new(py);
            p.set_item("profile", &profile.name)?;
            p.set_item("picker", &profile.picker_name)?;
            let filters: Vec<&str> = profile.filters.iter().map(|f| f.name.as_str()).collect();
            p.set_item("filters", &filters)?;
            p.set_item(
                "skipped_filters",
                o.skipped_filters.iter().map(|&f| filters[f]).collect::<Vec<_>>(),
            )?;
            p.set_item(
                "scorers",
                profile.scorers.iter().map(|s| (s.name.clone(), s.weight)).collect::<Vec<_>>(),
            )?;
            let positions = o.positions(d.base.len());
            let shown: Vec<usize> = match limit {
                Some(k) if k < d.base.len() => {
                    // The table's order: ranked rows by rank, kept rows by total (highest
                    // first), removed rows; ties in pool order.
                    let class = |b: usize| match positions[b] {
                        (_, Some(rank)) => (0, rank, 0.0),
                        (Some(i), None) => (1, 0, -o.totals.get(i).copied().unwrap_or(0.0)),
                        (None, None) => (2, 0, 0.0),
                    };
                    let mut all: Vec<usize> = (0..d.base.len()).collect();
                    let cmp = |a: &usize, b: &usize| {
                        let (ka, kb) = (class(*a), class(*b));
                        (ka.0, ka.1).cmp(&(kb.0, kb.1)).then(ka.2.total_cmp(&kb.2)).then(a.cmp(b))
                    };
                    if k > 0 {
                        all.select_nth_unstable_by(k - 1, cmp);
                    }
                    all.truncate(k);
                    all.sort_unstable_by(cmp);
                    all
                }
                _ => (0..d.base.len()).collect(),
            };
            let mut is_shown = vec![false; d.base.len()];
            let rows = PyList::empty(py);
            for &b in &shown {
                is_shown[b] = true;
                rows.append(self.explain_row_dict(py, o, &filters, b, positions[b])?)?;
            }
            let mut omitted_kept = 0usize;
            let mut omitted_removed: BTreeMap<&str, usize> = BTreeMap::new();
            for (b, _) in is_shown.iter().enumerate().filter(|(_, s)| !**s) {
                match o.removed_by[b] {
                    KEPT => omitted_kept += 1,
                    f => *omitted_removed.entry(filters[f as usize]).or_default() += 1,
                }
            }
            p.set_item("rows", rows)?;
            p.set_item("omitted", d.base.len() - shown.len())?;
            p.set_item("omitted_kept", omitted_kept)?;
            p.set_item("omitted_removed_by", omitted_removed)?;
            profiles.push(p);
        }
        PyList::new(py, profiles)
    }

    /// The explain row of `endpoint` in the `profile`-th profile run, None when it was not
    /// considered (or no such run).
    fn explain_row<'py>(
        &self,
        py: Python<'py>,
        profile: usize,
        endpoint: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let key = id_key(endpoint, "endpoint")?;
        let d = &self.decision;
        let Some(o) = d.outcomes.get(profile) else { return Ok(None) };
        let Some(b) = d.base.iter().position(|c| d.endpoint(c).id == key) else {
            return Ok(None);
        };
        let router = self.router.get();
        let config = &router.inner.config().profiles[o.profile];
        let filters: Vec<&str> = config.filters.iter().map(|f| f.name.as_str()).collect();
        let position = o.positions(d.base.len())[b];
        self.explain_row_dict(py, o, &filters, b, position).map(Some)
    }

    /// "picked", "sent", "decoding" or "finished".
    #[getter]
    fn stage(&self) -> &'static str {
        match &*self.ticket.lock() {
            TicketState::Picked => "picked",
            TicketState::Sent(t) => match t.stage() {
                Stage::Running => "sent",
                Stage::Decoding => "decoding",
                Stage::Finished => "finished",
            },
            TicketState::Closed => "finished",
        }
    }

    /// A fresh decision with this one's choice, fallbacks and scores, not started (`started`
    /// may then send it to a fallback): a retry's, as the native data plane commits the same
    /// decision again, without a new pick that would move a stateful picker (round-robin).
    fn again(&self, py: Python<'_>) -> PyDecision {
        PyDecision {
            router: self.router.clone_ref(py),
            decision: Arc::clone(&self.decision),
            ticket: Mutex::new(TicketState::Picked),
        }
    }

    #[pyo3(signature = (endpoint, now))]
    fn started(
        &self,
        py: Python<'_>,
        endpoint: Option<&Bound<'_, PyAny>>,
        now: f64,
    ) -> PyResult<()> {
        let key = endpoint.map(|e| id_key(e, "endpoint")).transpose()?;
        let mut state = self.ticket.lock();
        if !matches!(*state, TicketState::Picked) {
            return Err(PlacementError::new_err("started() was already called for this decision"));
        }
        let router = self.router.get();
        // With the GIL held: a commit records the prompt's blocks, microseconds of work, and
        // getting a released GIL back from a thread running Python waits out its switch
        // interval (5 ms by default) on every request.
        let ticket = attached(|| router.inner.commit(&self.decision, key.as_ref(), now))?.py()?;
        let index = router.index.get();
        index.remember_key(
            py,
            key.as_ref().unwrap_or(&self.decision.endpoint(self.decision.chosen()).id),
        )?;
        if let Some(p) = self.decision.prefill() {
            index.remember_key(py, &self.decision.endpoint(p).id)?;
        }
        *state = TicketState::Sent(ticket);
        Ok(())
    }

    fn first_token(&self) -> PyResult<bool> {
        match &mut *self.ticket.lock() {
            TicketState::Sent(t) => Ok(t.first_token()),
            TicketState::Picked => Err(PlacementError::new_err("first_token() before started()")),
            TicketState::Closed => Ok(false),
        }
    }

    fn finished(&self) -> bool {
        let mut state = self.ticket.lock();
        let was_open = match &mut *state {
            TicketState::Sent(t) => t.finish(),
            TicketState::Picked => true,
            TicketState::Closed => false,
        };
        *state = TicketState::Closed;
        was_open
    }
}

/// Reads an engine's `/metrics` text as the Python plane's scraper does
/// (`llmsched.integrations.metrics.parse_engine_metrics`): the values present, in the order
/// that function documents.
#[pyfunction]
fn parse_engine_metrics_text<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyDict>> {
    let m = detach(py, || metrics_text::parse_engine(text))?.py()?;
    let out = PyDict::new(py);
    let counts = |out: &Bound<'py, PyDict>, pairs: &[(&str, Option<u32>)]| -> PyResult<()> {
        for (key, value) in pairs {
            if let Some(value) = value {
                out.set_item(*key, *value)?;
            }
        }
        Ok(())
    };
    counts(&out, &[("waiting", m.waiting), ("running", m.running)])?;
    if let Some(kv) = m.kv_cache_usage {
        out.set_item("kv_cache_usage", kv)?;
    }
    counts(
        &out,
        &[
            ("block_size", m.block_size),
            ("num_gpu_blocks", m.num_gpu_blocks),
            ("prefix_cache_queries", m.prefix_cache_queries),
            ("prefix_cache_hits", m.prefix_cache_hits),
            ("preemptions", m.preemptions),
        ],
    )?;
    if let Some(l) = m.loras {
        out.set_item("active_loras", l.active)?;
        out.set_item("waiting_loras", l.waiting)?;
        out.set_item("max_loras", l.max_loras)?;
    }
    Ok(out)
}

fn routing_err(e: RoutingError) -> PyErr {
    e.to_py_err()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEndpointPool>()?;
    m.add_class::<PyRouter>()?;
    m.add_class::<PyDecision>()?;
    m.add_function(wrap_pyfunction!(parse_engine_metrics_text, m)?)?;
    Ok(())
}
