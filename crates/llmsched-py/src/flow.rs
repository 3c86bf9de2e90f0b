//! Bindings for `llmsched_core::flow`: `FlowCore` (the controller behind a lock, shareable by many
//! Python threads), `FlowDecision` and `Outcome`.

use std::sync::Arc;

use crate::convert::{config_mapping, to_python};
use crate::errors::{detach, CoreResult};
use crate::rebuild::Fields;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::errors::InvalidRequestError;
use llmsched_core::flow::{
    EndpointMetrics, FlowConfig, FlowController, FlowDecision, FlowRequest, Outcome, PolicyRegistry,
};

type Core = FlowController<Carried>;

/// What a queued request carries through the core: the caller's payload and the ticket of the
/// `admit()` awaiting it (None for a plain `enqueue`). Ids may be reused once a request has
/// left, so the ticket, not the id, says which awaiting call a decision belongs to.
struct Carried {
    payload: Py<PyAny>,
    ticket: Option<u64>,
}

/// The terminal outcome of a request, with its HTTP status and dropped-reason header value.
#[pyclass(frozen, eq, eq_int, hash, name = "Outcome", module = "llmsched._llmsched")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyOutcome {
    #[pyo3(name = "DISPATCHED")]
    Dispatched,
    #[pyo3(name = "REJECTED_CAPACITY")]
    RejectedCapacity,
    #[pyo3(name = "REJECTED_SHED")]
    RejectedShed,
    #[pyo3(name = "REJECTED_NO_ENDPOINTS")]
    RejectedNoEndpoints,
    #[pyo3(name = "EVICTED_TTL")]
    EvictedTtl,
    #[pyo3(name = "EVICTED_PREEMPTED")]
    EvictedPreempted,
    #[pyo3(name = "EVICTED_CANCELLED")]
    EvictedCancelled,
}

impl From<Outcome> for PyOutcome {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Dispatched => PyOutcome::Dispatched,
            Outcome::RejectedCapacity => PyOutcome::RejectedCapacity,
            Outcome::RejectedShed => PyOutcome::RejectedShed,
            Outcome::RejectedNoEndpoints => PyOutcome::RejectedNoEndpoints,
            Outcome::EvictedTtl => PyOutcome::EvictedTtl,
            Outcome::EvictedPreempted => PyOutcome::EvictedPreempted,
            Outcome::EvictedCancelled => PyOutcome::EvictedCancelled,
        }
    }
}

impl PyOutcome {
    fn core(self) -> Outcome {
        Outcome::ALL[self as usize]
    }
}

#[pymethods]
impl PyOutcome {
    /// The HTTP status a gateway answers with (200, 429 or 503).
    #[getter]
    fn http_status(&self) -> u16 {
        self.core().http_status()
    }

    /// The dropped-reason header value ("" when dispatched).
    #[getter]
    fn reason(&self) -> &'static str {
        self.core().reason()
    }

    /// The snake_case name used as metrics key.
    #[getter]
    fn key(&self) -> &'static str {
        self.core().name()
    }
}

/// A [`PyFlowDecision`]'s fields in its constructor's order.
const FLOW_DECISION_FIELDS: &str =
    "id outcome priority tenant prompt_tokens size_bytes wait_s payload ticket";

/// A request leaving the queue (or refused at the door): id, outcome and payload.
#[pyclass(frozen, name = "FlowDecision", module = "llmsched._llmsched")]
pub struct PyFlowDecision {
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    outcome: PyOutcome,
    #[pyo3(get)]
    priority: i32,
    tenant: Arc<str>,
    #[pyo3(get)]
    prompt_tokens: u64,
    #[pyo3(get)]
    size_bytes: u64,
    #[pyo3(get)]
    wait_s: f64,
    #[pyo3(get)]
    payload: Py<PyAny>,
    /// The ticket given at enqueue (the awaiting `admit()`), or None.
    #[pyo3(get)]
    ticket: Option<u64>,
}

impl From<FlowDecision<Carried>> for PyFlowDecision {
    fn from(d: FlowDecision<Carried>) -> Self {
        PyFlowDecision {
            id: d.id,
            outcome: d.outcome.into(),
            priority: d.priority,
            tenant: d.tenant,
            prompt_tokens: d.tokens,
            size_bytes: d.bytes,
            wait_s: d.waited_s,
            payload: d.payload.payload,
            ticket: d.payload.ticket,
        }
    }
}

#[pymethods]
impl PyFlowDecision {
    /// A decision rebuilt from its fields, in `FLOW_DECISION_FIELDS`' order (what `pickle`
    /// and `copy` call).
    #[new]
    #[pyo3(signature = (*fields))]
    fn new(fields: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let mut f = Fields::new("FlowDecision", FLOW_DECISION_FIELDS, fields)?;
        Ok(PyFlowDecision {
            id: f.next()?,
            outcome: *f.next::<PyRef<'_, PyOutcome>>()?,
            priority: f.next()?,
            tenant: f.next::<String>()?.into(),
            prompt_tokens: f.next()?,
            size_bytes: f.next()?,
            wait_s: f.next()?,
            payload: f.next_any()?.unbind(),
            ticket: f.next()?,
        })
    }

    #[getter]
    fn tenant(&self) -> &str {
        &self.tenant
    }

    #[getter]
    fn http_status(&self) -> u16 {
        self.outcome.core().http_status()
    }

    #[getter]
    fn reason(&self) -> &'static str {
        self.outcome.core().reason()
    }

    fn __repr__(&self) -> String {
        format!(
            "FlowDecision(id={}, outcome={}, priority={}, tenant={:?}, wait_s={})",
            self.id,
            self.outcome.core().name(),
            self.priority,
            &*self.tenant,
            self.wait_s
        )
    }
}

fn decisions(list: Vec<FlowDecision<Carried>>) -> Vec<PyFlowDecision> {
    list.into_iter().map(PyFlowDecision::from).collect()
}

fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| InvalidRequestError::new_err(format!("{name} must be >= 0, got {value}")))
}

fn priority_i32(value: i64) -> PyResult<i32> {
    i32::try_from(value).map_err(|_| {
        InvalidRequestError::new_err(format!("priority must fit in 32 bits, got {value}"))
    })
}

/// The flow controller core (see `llmsched.flow.FlowController` for the friendly API).
///
/// Every method takes the lock for the duration of one O(log n) operation; payloads are never
/// dropped while the lock is held.
#[pyclass(frozen, name = "FlowCore", module = "llmsched._llmsched")]
pub struct PyFlowCore {
    inner: Arc<Mutex<Core>>,
}

#[pymethods]
impl PyFlowCore {
    #[new]
    #[pyo3(signature = (config))]
    fn new(config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = FlowConfig::from_value(config_mapping(Some(config), "flow config")?).py()?;
        let core = FlowController::with_registry(&config, PolicyRegistry::builtin()).py()?;
        Ok(PyFlowCore { inner: Arc::new(Mutex::new(core)) })
    }

    /// The resolved configuration, in the input format.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let value = self.inner.lock().config().to_value();
        to_python(py, &value)
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, priority, tenant, prompt_tokens, size_bytes, deadline, ttft_target, payload, now, ticket=None))]
    fn enqueue(
        &self,
        id: i64,
        priority: i64,
        tenant: &str,
        prompt_tokens: i64,
        size_bytes: i64,
        deadline: Option<f64>,
        ttft_target: Option<f64>,
        payload: Py<PyAny>,
        now: f64,
        ticket: Option<u64>,
    ) -> PyResult<Option<PyOutcome>> {
        let request = FlowRequest {
            id: non_negative("id", id)?,
            priority: priority_i32(priority)?,
            tenant,
            tokens: non_negative("prompt_tokens", prompt_tokens)?,
            bytes: non_negative("size_bytes", size_bytes)?,
            deadline,
            ttft_target,
            payload: Carried { payload, ticket },
        };
        let refused = self.inner.lock().enqueue_ticketed(request, ticket, now).py()?;
        Ok(refused.map(|decision| decision.outcome.into()))
    }

    fn dispatch(&self, now: f64) -> PyResult<Option<PyFlowDecision>> {
        let dispatched = self.inner.lock().dispatch(now).py()?;
        Ok(dispatched.map(PyFlowDecision::from))
    }

    /// Cancels the queued request `id`; given a `ticket`, only the one enqueued with it.
    #[pyo3(signature = (id, now, ticket=None))]
    fn cancel(&self, id: i64, now: f64, ticket: Option<u64>) -> PyResult<Option<PyFlowDecision>> {
        let id = non_negative("id", id)?;
        let owns = |carried: &Carried| ticket.is_none() || carried.ticket == ticket;
        let cancelled = self.inner.lock().cancel_if(id, now, owns).py()?;
        Ok(cancelled.map(PyFlowDecision::from))
    }

    fn expire(&self, py: Python<'_>, now: f64) -> PyResult<Vec<PyFlowDecision>> {
        let inner = &self.inner;
        let expired = detach(py, || inner.lock().expire(now))?.py()?;
        Ok(decisions(expired))
    }

    fn drain_evicted(&self) -> Vec<PyFlowDecision> {
        let evicted = self.inner.lock().drain_evicted();
        decisions(evicted)
    }

    fn has_evicted(&self) -> bool {
        self.inner.lock().evicted_len() > 0
    }

    /// Charges streamed output of the running request `id`; given a `ticket`, only the one
    /// enqueued with it (False, charging nothing, when `id` runs for another enqueue).
    #[pyo3(signature = (id, output_tokens, now, ticket=None))]
    fn record_output(
        &self,
        id: i64,
        output_tokens: i64,
        now: f64,
        ticket: Option<u64>,
    ) -> PyResult<bool> {
        let (id, tokens) = (non_negative("id", id)?, non_negative("output_tokens", output_tokens)?);
        let mut core = self.inner.lock();
        match ticket {
            None => core.record_output(id, tokens, now).py().map(|()| true),
            Some(ticket) => core.record_output_ticketed(id, ticket, tokens, now).py(),
        }
    }

    fn charge_remote(
        &self,
        tenant: &str,
        priority: i32,
        prompt_tokens: i64,
        output_tokens: i64,
        now: f64,
    ) -> PyResult<bool> {
        let prompt = non_negative("prompt_tokens", prompt_tokens)?;
        let output = non_negative("output_tokens", output_tokens)?;
        self.inner.lock().charge_remote(tenant, priority, prompt, output, now).py()
    }

    fn drain_service(&self) -> Vec<(String, i32, u64, u64)> {
        let drained = self.inner.lock().drain_service();
        drained.into_iter().map(|(t, p, a, b)| (t.to_string(), p, a, b)).collect()
    }

    /// Completes the running request `id`; given a `ticket`, only the one enqueued with it
    /// (False, changing nothing, when `id` runs for another enqueue: a stale release).
    #[pyo3(signature = (id, output_tokens, now, ticket=None))]
    fn complete(
        &self,
        id: i64,
        output_tokens: i64,
        now: f64,
        ticket: Option<u64>,
    ) -> PyResult<bool> {
        let (id, tokens) = (non_negative("id", id)?, non_negative("output_tokens", output_tokens)?);
        let mut core = self.inner.lock();
        match ticket {
            None => core.complete(id, tokens, now).py().map(|()| true),
            Some(ticket) => core.complete_ticketed(id, ticket, tokens, now).py(),
        }
    }

    fn preemption_victims(&self, now: f64) -> PyResult<Vec<u64>> {
        self.inner.lock().preemption_victims(now).py()
    }

    fn update_endpoint(
        &self,
        endpoint: &str,
        waiting: i64,
        running: i64,
        kv_usage: f64,
        timestamp: f64,
    ) -> PyResult<()> {
        let metrics = EndpointMetrics {
            waiting: non_negative("waiting", waiting)?,
            running: non_negative("running", running)?,
            kv_usage,
            timestamp,
        };
        self.inner.lock().update_endpoint(endpoint, metrics).py()
    }

    fn remove_endpoint(&self, endpoint: &str) -> bool {
        self.inner.lock().remove_endpoint(endpoint)
    }

    fn saturation(&self, now: f64) -> PyResult<f64> {
        Ok(self.inner.lock().saturation(now).py()?.value)
    }

    #[pyo3(signature = (priority=None))]
    fn jain_index(&self, priority: Option<i64>) -> PyResult<f64> {
        let priority = priority.map(priority_i32).transpose()?;
        Ok(self.inner.lock().jain_index(priority))
    }

    fn metrics<'py>(&self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyAny>> {
        let inner = &self.inner;
        let metrics = detach(py, || inner.lock().metrics(now))?.py()?;
        to_python(py, &metrics)
    }

    fn is_queued(&self, id: u64) -> bool {
        self.inner.lock().is_queued(id)
    }

    fn is_running(&self, id: u64) -> bool {
        self.inner.lock().is_running(id)
    }

    fn running_count(&self) -> usize {
        self.inner.lock().running_len()
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }
}

/// Resolves a config (defaults filled in, everything checked) and returns it.
#[pyfunction]
fn flow_resolve_config<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let config = FlowConfig::from_value(config_mapping(Some(config), "flow config")?).py()?;
    to_python(py, &config.resolve(&PolicyRegistry::builtin()).py()?.to_value())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyOutcome>()?;
    m.add_class::<PyFlowDecision>()?;
    m.add_class::<PyFlowCore>()?;
    m.add_function(wrap_pyfunction!(flow_resolve_config, m)?)?;
    Ok(())
}
