//! Bindings for `llmsched_core::slices`.

use std::sync::Arc;

use crate::convert::{config_mapping, to_python};
use crate::errors::{detach, CoreResult, InvalidValueError};
use crate::rebuild::Fields;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use llmsched_core::slices::{
    self as core, Action, Decision, EndpointLoad, EndpointReport, Phase, RequestView, SliceStart,
    WaitingRequest,
};

/// The switch-cost model (see `llmsched.slices.SwitchCostModel`).
#[pyclass(frozen, name = "SwitchCostModel", module = "llmsched._llmsched")]
pub struct PySwitchCostModel {
    pub(crate) model: core::SwitchCostModel,
}

#[pymethods]
impl PySwitchCostModel {
    /// Parameters as a mapping decoded over the defaults.
    #[new]
    #[pyo3(signature = (params = None))]
    fn new(params: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let params = config_mapping(params, "cost model")?;
        Ok(Self { model: core::SwitchCostModel::from_params(&params).py()? })
    }

    /// Derives the model from model dimensions and GPU numbers given as a mapping.
    #[staticmethod]
    fn from_dims(dims: &Bound<'_, PyAny>) -> PyResult<Self> {
        let dims = config_mapping(Some(dims), "cost model dims")?;
        Ok(Self { model: core::SwitchCostModel::from_dims_params(&dims).py()? })
    }

    #[getter]
    fn prefill_tokens_per_s(&self) -> f64 {
        self.model.prefill_tokens_per_s
    }
    #[getter]
    fn decode_step_s(&self) -> f64 {
        self.model.decode_step_s
    }
    #[getter]
    fn kv_capacity_tokens(&self) -> f64 {
        self.model.kv_capacity_tokens
    }
    #[getter]
    fn requeue_delay_s(&self) -> f64 {
        self.model.requeue_delay_s
    }
    #[getter]
    fn priority_base(&self) -> f64 {
        self.model.priority_base
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.model.block_size
    }

    fn weight(&self, priority: i32) -> f64 {
        self.model.weight(priority)
    }

    fn recompute_s(&self, context: f64, prefill_tokens_per_s: f64) -> f64 {
        core::SwitchCostModel::recompute_s(context, prefill_tokens_per_s)
    }

    fn recompute_tokens(&self, evict_probability: f64, context: f64) -> f64 {
        self.model.recompute_tokens(evict_probability, context)
    }

    fn switch_s(&self, evict_probability: f64, context: f64, prefill_tokens_per_s: f64) -> f64 {
        self.model.switch_s(evict_probability, context, prefill_tokens_per_s)
    }

    /// The parameters, as a mapping.
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.model)
    }
}

/// `clamp((demand - free) / context, 0, 1)`.
#[pyfunction]
fn evict_probability(context: f64, demand_tokens: f64, free_tokens: f64) -> f64 {
    core::evict_probability(context, demand_tokens, free_tokens)
}

/// The registered slice policy names.
#[pyfunction]
fn slice_policy_names() -> Vec<&'static str> {
    core::REGISTRY.iter().map(|(name, _)| *name).collect()
}

/// The default parameters of a slice policy, as a mapping.
#[pyfunction]
fn slice_policy_defaults<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    to_python(py, &core::policy_defaults(name).py()?)
}

/// A [`PySliceDecision`]'s fields in its constructor's order.
const SLICE_DECISION_FIELDS: &str = concat!(
    "action level priority endpoint next_slice_tokens context_tokens generated_tokens slices ",
    "benefit_s yield_cost_s migrate_cost_s evict_probability"
);

/// A [`PySliceState`]'s fields in its constructor's order (its phase follows from the last).
const SLICE_STATE_FIELDS: &str = concat!(
    "priority level prompt_tokens max_tokens generated_tokens slice_generated slice_tokens ",
    "slices context_tokens endpoint route_to paused_since"
);

/// A [`PyEndpointLoad`]'s fields in its constructor's order (its free tokens follow).
const ENDPOINT_LOAD_FIELDS: &str =
    "kv_capacity_tokens kv_cache_usage waiting prefill_tokens_per_s decode_step_s";

/// A slice-boundary decision.
#[pyclass(frozen, get_all, name = "SliceDecision", module = "llmsched._llmsched")]
pub struct PySliceDecision {
    action: &'static str,
    level: u8,
    priority: i32,
    endpoint: Option<String>,
    next_slice_tokens: u32,
    context_tokens: u64,
    generated_tokens: u32,
    slices: u32,
    benefit_s: f64,
    yield_cost_s: f64,
    migrate_cost_s: Option<f64>,
    evict_probability: f64,
}

impl From<Decision> for PySliceDecision {
    fn from(d: Decision) -> Self {
        Self {
            action: d.action.as_str(),
            level: d.level,
            priority: d.priority,
            endpoint: d.endpoint.map(|e| e.to_string()),
            next_slice_tokens: d.next_slice_tokens,
            context_tokens: d.context_tokens,
            generated_tokens: d.generated_tokens,
            slices: d.slices,
            benefit_s: d.benefit_s,
            yield_cost_s: d.yield_cost_s,
            migrate_cost_s: d.migrate_cost_s,
            evict_probability: d.evict_probability,
        }
    }
}

#[pymethods]
impl PySliceDecision {
    /// A decision rebuilt from its fields, in `SLICE_DECISION_FIELDS`' order (what `pickle`
    /// and `copy` call).
    #[new]
    #[pyo3(signature = (*fields))]
    fn new(fields: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let mut f = Fields::new("SliceDecision", SLICE_DECISION_FIELDS, fields)?;
        let decision = Decision {
            action: action_named(&f.next::<String>()?)?,
            level: f.next()?,
            priority: f.next()?,
            endpoint: f.next::<Option<String>>()?.map(Arc::from),
            next_slice_tokens: f.next()?,
            context_tokens: f.next()?,
            generated_tokens: f.next()?,
            slices: f.next()?,
            benefit_s: f.next()?,
            yield_cost_s: f.next()?,
            migrate_cost_s: f.next()?,
            evict_probability: f.next()?,
        };
        Ok(decision.into())
    }

    fn __repr__(&self) -> String {
        format!(
            "SliceDecision(action={:?}, level={}, endpoint={:?}, next_slice_tokens={})",
            self.action, self.level, self.endpoint, self.next_slice_tokens
        )
    }
}

/// The action of that name (`Action::as_str`'s).
fn action_named(name: &str) -> PyResult<Action> {
    const ALL: [Action; 4] = [Action::Continue, Action::Yield, Action::Migrate, Action::Finish];
    ALL.into_iter().find(|a| a.as_str() == name).ok_or_else(|| {
        let known: Vec<&str> = ALL.iter().map(|a| a.as_str()).collect();
        InvalidValueError::new_err(format!(
            "SliceDecision: action must be one of {known:?}, got {name:?}"
        ))
    })
}

/// A snapshot of one tracked request.
#[pyclass(frozen, get_all, name = "SliceState", module = "llmsched._llmsched")]
pub struct PySliceState {
    priority: i32,
    level: u8,
    prompt_tokens: u32,
    max_tokens: u32,
    generated_tokens: u32,
    slice_generated: u32,
    slice_tokens: u32,
    slices: u32,
    context_tokens: u64,
    endpoint: String,
    route_to: String,
    phase: &'static str,
    paused_since: Option<f64>,
}

#[pymethods]
impl PySliceState {
    /// A snapshot rebuilt from its fields, in `SLICE_STATE_FIELDS`' order (what `pickle` and
    /// `copy` call); its ``phase`` is "paused" when ``paused_since`` is a time, else "running".
    #[new]
    #[pyo3(signature = (*fields))]
    fn new(fields: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let mut f = Fields::new("SliceState", SLICE_STATE_FIELDS, fields)?;
        let state = Self {
            priority: f.next()?,
            level: f.next()?,
            prompt_tokens: f.next()?,
            max_tokens: f.next()?,
            generated_tokens: f.next()?,
            slice_generated: f.next()?,
            slice_tokens: f.next()?,
            slices: f.next()?,
            context_tokens: f.next()?,
            endpoint: f.next()?,
            route_to: f.next()?,
            phase: phase_name(None),
            paused_since: f.next()?,
        };
        let paused = state.paused_since.map(|since| Phase::Paused { since });
        Ok(Self { phase: phase_name(paused), ..state })
    }
}

/// The name a snapshot shows for a phase: "running" or "paused".
fn phase_name(paused: Option<Phase>) -> &'static str {
    match paused.unwrap_or(Phase::Running) {
        Phase::Running => "running",
        Phase::Paused { .. } => "paused",
    }
}

impl From<RequestView> for PySliceState {
    fn from(v: RequestView) -> Self {
        let paused_since = match v.phase {
            Phase::Running => None,
            Phase::Paused { since } => Some(since),
        };
        let phase = phase_name(Some(v.phase));
        Self {
            priority: v.priority,
            level: v.level,
            prompt_tokens: v.prompt_tokens,
            max_tokens: v.max_tokens,
            generated_tokens: v.generated_tokens,
            slice_generated: v.slice_generated,
            slice_tokens: v.slice_tokens,
            slices: v.slices,
            context_tokens: v.context_tokens,
            endpoint: v.endpoint.to_string(),
            route_to: v.route_to.to_string(),
            phase,
            paused_since,
        }
    }
}

/// An endpoint's load as last reported.
#[pyclass(frozen, get_all, name = "EndpointLoad", module = "llmsched._llmsched")]
pub struct PyEndpointLoad {
    kv_capacity_tokens: f64,
    kv_cache_usage: f64,
    kv_free_tokens: f64,
    waiting: u32,
    prefill_tokens_per_s: f64,
    decode_step_s: f64,
}

#[pymethods]
impl PyEndpointLoad {
    /// A load rebuilt from its fields, in `ENDPOINT_LOAD_FIELDS`' order (what `pickle` and
    /// `copy` call); ``kv_free_tokens`` follows from the capacity and the usage.
    #[new]
    #[pyo3(signature = (*fields))]
    fn new(fields: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let mut f = Fields::new("EndpointLoad", ENDPOINT_LOAD_FIELDS, fields)?;
        let load = EndpointLoad {
            kv_capacity_tokens: f.next()?,
            kv_usage: f.next()?,
            waiting: f.next()?,
            prefill_tokens_per_s: f.next()?,
            decode_step_s: f.next()?,
        };
        Ok(load.into())
    }
}

impl From<EndpointLoad> for PyEndpointLoad {
    fn from(l: EndpointLoad) -> Self {
        Self {
            kv_capacity_tokens: l.kv_capacity_tokens,
            kv_cache_usage: l.kv_usage,
            kv_free_tokens: l.kv_free_tokens(),
            waiting: l.waiting,
            prefill_tokens_per_s: l.prefill_tokens_per_s,
            decode_step_s: l.decode_step_s,
        }
    }
}

fn start_tuple(start: SliceStart) -> (u8, u32) {
    (start.level, start.slice_tokens)
}

/// Per-request slice budgets and boundary decisions; one lock, shareable across threads.
#[pyclass(frozen, name = "SliceTracker", module = "llmsched._llmsched")]
pub struct PySliceTracker {
    inner: Arc<Mutex<core::SliceTracker>>,
}

#[pymethods]
impl PySliceTracker {
    #[new]
    #[pyo3(signature = (policy, params, cost_model))]
    fn new(
        policy: &str,
        params: Option<&Bound<'_, PyAny>>,
        cost_model: &PySwitchCostModel,
    ) -> PyResult<Self> {
        let params = config_mapping(params, &format!("policy {policy}"))?;
        let tracker = core::SliceTracker::from_config(policy, &params, cost_model.model).py()?;
        Ok(Self { inner: Arc::new(Mutex::new(tracker)) })
    }

    #[getter]
    fn policy_name(&self) -> &'static str {
        self.inner.lock().policy().name()
    }

    #[getter]
    fn levels(&self) -> u8 {
        self.inner.lock().policy().levels()
    }

    fn policy_params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let params = self.inner.lock().policy().params();
        to_python(py, &params)
    }

    fn cost_model(&self) -> PySwitchCostModel {
        PySwitchCostModel { model: *self.inner.lock().cost_model() }
    }

    fn quantum(&self, level: u8) -> PyResult<u32> {
        self.inner.lock().quantum(level).py()
    }

    fn entry_level(&self, prompt_tokens: u32) -> u8 {
        self.inner.lock().entry_level(prompt_tokens)
    }

    #[pyo3(signature = (name, kv_usage, waiting, kv_capacity_tokens=None, prefill_tokens_per_s=None, decode_step_s=None))]
    fn set_endpoint(
        &self,
        name: &str,
        kv_usage: f64,
        waiting: u32,
        kv_capacity_tokens: Option<f64>,
        prefill_tokens_per_s: Option<f64>,
        decode_step_s: Option<f64>,
    ) -> PyResult<()> {
        let report = EndpointReport {
            kv_usage,
            waiting,
            kv_capacity_tokens,
            prefill_tokens_per_s,
            decode_step_s,
        };
        self.inner.lock().set_endpoint(name, report).py()
    }

    fn endpoint_load(&self, name: &str) -> Option<PyEndpointLoad> {
        self.inner.lock().endpoint_load(name).map(PyEndpointLoad::from)
    }

    fn endpoint_names(&self) -> Vec<String> {
        self.inner.lock().endpoint_names().iter().map(|n| n.to_string()).collect()
    }

    fn remove_endpoint(&self, name: &str) -> bool {
        self.inner.lock().remove_endpoint(name)
    }

    fn admit(
        &self,
        key: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        priority: i32,
        endpoint: &str,
    ) -> PyResult<(u8, u32)> {
        let start =
            self.inner.lock().admit(key, prompt_tokens, max_tokens, priority, endpoint).py()?;
        Ok(start_tuple(start))
    }

    fn record_tokens(&self, key: u64, tokens: u32) -> PyResult<u32> {
        self.inner.lock().record_tokens(key, tokens).py()
    }

    /// `waiting`: (priority, level, context_tokens, expected_tokens) tuples in dispatch order.
    fn decide(
        &self,
        key: u64,
        finished: bool,
        waiting: Vec<(i32, u8, u32, u32)>,
        now: f64,
    ) -> PyResult<PySliceDecision> {
        let waiting: Vec<WaitingRequest> = waiting
            .into_iter()
            .map(|(priority, level, context_tokens, expected_tokens)| WaitingRequest {
                priority,
                level,
                context_tokens,
                expected_tokens,
            })
            .collect();
        let decision = self.inner.lock().decide(key, finished, &waiting, now).py()?;
        Ok(decision.into())
    }

    fn resume(&self, key: u64, endpoint: &str) -> PyResult<(u8, u32)> {
        Ok(start_tuple(self.inner.lock().resume(key, endpoint).py()?))
    }

    fn promote(&self, py: Python<'_>, now: f64) -> PyResult<Vec<(u64, u8)>> {
        let inner = Arc::clone(&self.inner);
        detach(py, move || inner.lock().promote(now))?.py()
    }

    fn remove(&self, key: u64) -> bool {
        self.inner.lock().remove(key)
    }

    fn state(&self, key: u64) -> Option<PySliceState> {
        self.inner.lock().get(key).map(PySliceState::from)
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }

    fn __contains__(&self, key: u64) -> bool {
        self.inner.lock().contains(key)
    }
}

/// One sliced request's continuation calls and stitched response (see
/// `llmsched.slices.SliceAssembler`, which wraps it; `llmsched_core::slices::assembler`).
#[pyclass(frozen, name = "SliceAssembler", module = "llmsched._llmsched")]
pub struct PySliceAssembler {
    inner: Mutex<core::SliceAssembler>,
}

/// A Python value (a request, an engine chunk: plain JSON data) as a serde value.
fn json_value(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<serde_json::Value> {
    pythonize::depythonize::<serde_json::Value>(obj).map_err(|err| {
        let err: PyErr = err.into();
        crate::errors::InvalidTypeError::new_err(format!("{what} must be plain JSON data: {err}"))
    })
}

fn values<'py>(py: Python<'py>, chunks: &[serde_json::Value]) -> PyResult<Bound<'py, PyAny>> {
    to_python(py, &chunks)
}

#[pymethods]
impl PySliceAssembler {
    #[new]
    #[pyo3(signature = (request, api, response_id=None, created=None, default_max_tokens=None, forward_stop=true))]
    fn new(
        request: &Bound<'_, PyAny>,
        api: &str,
        response_id: Option<String>,
        created: Option<i64>,
        default_max_tokens: Option<u64>,
        forward_stop: bool,
    ) -> PyResult<Self> {
        let api = match api {
            "completions" => core::Api::Completions,
            "chat" => core::Api::Chat,
            other => {
                return Err(crate::errors::ConfigError::new_err(format!(
                    "api must be 'completions' or 'chat', got {other:?}"
                )))
            }
        };
        let request = json_value(request, "request")?;
        let options =
            core::AssemblerOptions { response_id, created, default_max_tokens, forward_stop };
        let inner = core::SliceAssembler::new(&request, api, options).py()?;
        Ok(Self { inner: Mutex::new(inner) })
    }

    fn next_request<'py>(&self, py: Python<'py>, slice_tokens: u64) -> PyResult<Bound<'py, PyAny>> {
        let body = self.inner.lock().next_request(slice_tokens).py()?;
        to_python(py, &body)
    }

    fn feed<'py>(&self, py: Python<'py>, chunk: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let chunk = json_value(chunk, "chunk")?;
        let out = self.inner.lock().feed(&chunk).py()?;
        values(py, &out)
    }

    fn end_slice<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let out = self.inner.lock().end_slice().py()?;
        values(py, &out)
    }

    fn response<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let whole = self.inner.lock().response().py()?;
        to_python(py, &whole)
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.lock().done()
    }

    #[getter]
    fn finish_reason<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let reason = self.inner.lock().finish_reason().cloned();
        to_python(py, &reason)
    }

    #[getter]
    fn stop_reason(&self) -> Option<String> {
        self.inner.lock().stop_reason().map(str::to_owned)
    }

    #[getter]
    fn generated_tokens(&self) -> u64 {
        self.inner.lock().generated_tokens()
    }

    #[getter]
    fn produced_tokens(&self) -> u64 {
        self.inner.lock().produced_tokens()
    }

    #[getter]
    fn generated_token_ids(&self) -> Vec<u32> {
        self.inner.lock().generated_token_ids().to_vec()
    }

    #[getter]
    fn remaining_tokens(&self) -> u64 {
        self.inner.lock().remaining_tokens()
    }

    #[getter]
    fn text(&self) -> String {
        self.inner.lock().text().to_owned()
    }

    #[getter]
    fn last_slice_tokens(&self) -> u64 {
        self.inner.lock().last_slice_tokens()
    }

    /// `(prompt, completion, total, slices, resent, recomputed)` tokens.
    #[getter]
    fn usage(&self) -> (i64, i64, i64, i64, i64, i64) {
        let u = self.inner.lock().usage();
        (
            u.prompt_tokens,
            u.completion_tokens,
            u.total_tokens,
            u.slices,
            u.resent_prompt_tokens,
            u.recomputed_prompt_tokens,
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySliceAssembler>()?;
    m.add_class::<PySwitchCostModel>()?;
    m.add_class::<PySliceDecision>()?;
    m.add_class::<PySliceState>()?;
    m.add_class::<PyEndpointLoad>()?;
    m.add_class::<PySliceTracker>()?;
    m.add_function(wrap_pyfunction!(evict_probability, m)?)?;
    m.add_function(wrap_pyfunction!(slice_policy_names, m)?)?;
    m.add_function(wrap_pyfunction!(slice_policy_defaults, m)?)?;
    Ok(())
}
