//! A Python simulator `Policy` object (`llmsched.sim.policies.Policy`) as the Rust engine's
//! [`PolicyHook`]: each call takes the GIL for itself only. The request handed to the policy is
//! an `llmsched.sim.request.Request`, made at its `pick` and kept until its `on_finished` (so
//! what a policy stores on it, `handle` for one, stays), its fields set from the engine's state
//! before every call.

use std::collections::HashMap;

use numpy::PyArray1;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};

use llmsched_sim::{PolicyFailure, PolicyHook, RequestView};

pub(crate) struct PyPolicyHook {
    policy: Py<PyAny>,
    request_class: Py<PyAny>,
    /// The `Request` objects of the requests between their `pick` and `on_finished`.
    requests: HashMap<usize, Py<PyAny>>,
}

impl PyPolicyHook {
    pub(crate) fn new(py: Python<'_>, policy: Py<PyAny>) -> PyResult<Self> {
        let request_class = py.import("llmsched.sim.request")?.getattr("Request")?.unbind();
        Ok(Self { policy, request_class, requests: HashMap::new() })
    }

    /// The `Request` of `req`, made on first use, its engine state set from `req`.
    fn request<'py>(
        &mut self,
        py: Python<'py>,
        req: &RequestView<'_>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = match self.requests.get(&req.slot) {
            Some(obj) => obj.bind(py).clone(),
            None => {
                let hashes = PyArray1::from_slice(py, req.hashes);
                let obj = self.request_class.bind(py).call1((
                    req.id,
                    req.arrival,
                    req.prompt_len,
                    req.output_len,
                    hashes,
                ))?;
                obj.setattr(intern!(py, "tenant"), req.tenant)?;
                obj.setattr(intern!(py, "priority"), req.priority)?;
                match (req.session, req.session_name) {
                    (Some(sid), _) => obj.setattr(intern!(py, "session"), sid)?,
                    (None, name) => obj.setattr(intern!(py, "session"), name)?,
                }
                obj.setattr(intern!(py, "turn"), req.turn)?;
                self.requests.insert(req.slot, obj.clone().unbind());
                obj
            }
        };
        obj.setattr(intern!(py, "phase"), req.phase)?;
        obj.setattr(intern!(py, "target"), req.target)?;
        obj.setattr(intern!(py, "computed"), req.computed)?;
        obj.setattr(intern!(py, "generated"), req.generated)?;
        obj.setattr(intern!(py, "high_water"), req.high_water)?;
        obj.setattr(intern!(py, "kv_ready"), req.kv_ready)?;
        obj.setattr(intern!(py, "dispatched"), req.dispatched)?;
        obj.setattr(intern!(py, "first_token_time"), req.first_token)?;
        obj.setattr(intern!(py, "finish_time"), req.finish)?;
        obj.setattr(intern!(py, "cached_tokens"), req.cached_tokens)?;
        obj.setattr(intern!(py, "prefilled_tokens"), req.prefilled)?;
        obj.setattr(intern!(py, "recomputed_tokens"), req.recomputed)?;
        obj.setattr(intern!(py, "preemptions"), req.preemptions)?;
        obj.setattr(intern!(py, "rejected"), req.rejected)?;
        obj.setattr(intern!(py, "call_end"), req.call_end)?;
        obj.setattr(intern!(py, "slice_start"), req.slice_start)?;
        obj.setattr(intern!(py, "replica"), req.replica)?;
        obj.setattr(intern!(py, "prefill_replica"), req.prefill_replica)?;
        obj.setattr(intern!(py, "decode_replica"), req.decode_replica)?;
        Ok(obj)
    }

    /// Calls `method(request, now)` on the policy.
    fn call_with_request<'py>(
        &mut self,
        py: Python<'py>,
        method: &Bound<'py, pyo3::types::PyString>,
        req: &RequestView<'_>,
        now: f64,
    ) -> Result<Bound<'py, PyAny>, PolicyFailure> {
        let call = |hook: &mut Self| -> PyResult<Bound<'py, PyAny>> {
            let obj = hook.request(py, req)?;
            hook.policy.bind(py).call_method1(method, (obj, now))
        };
        call(self).map_err(|e| raised(py, &format!("{method}()"), Some(req.id), now, e))
    }
}

/// A failure carrying the policy's exception (chained by the caller of the engine).
fn raised(py: Python<'_>, call: &str, id: Option<u64>, now: f64, err: PyErr) -> PolicyFailure {
    let kind = err.get_type(py).name().map_or_else(|_| "exception".to_string(), |n| n.to_string());
    let what = id.map_or_else(String::new, |id| format!(" for request {id}"));
    PolicyFailure {
        message: format!("{call}{what} at t={now} raised {kind}: {}", err.value(py)),
        source: Some(Box::new(err)),
    }
}

/// A replica number out of `pick`'s answer: an int (or anything with `__index__`, numpy's
/// integers), not a bool, not negative.
fn replica_number(value: &Bound<'_, PyAny>, what: &str) -> Result<usize, String> {
    if value.is_instance_of::<PyBool>() {
        return Err(format!("{what} must be an int, got a bool"));
    }
    let n: i64 = value.extract().map_err(|_| {
        let kind = value.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string());
        format!("{what} must be an int, got {kind}")
    })?;
    usize::try_from(n).map_err(|_| format!("{what} {n} is out of range (replicas count from 0)"))
}

/// `pick`'s answer as (decode replica, prefill replica or None).
fn pick_answer(out: &Bound<'_, PyAny>) -> Result<(usize, Option<usize>), String> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(t) = out.cast::<PyTuple>() {
        t.iter().collect()
    } else if let Ok(l) = out.cast::<PyList>() {
        l.iter().collect()
    } else {
        Vec::new()
    };
    let [target, prefill] = items.as_slice() else {
        let shown = out.repr().map_or_else(|_| "?".into(), |r| r.to_string());
        return Err(format!("must return (decode replica, prefill replica or None), got {shown}"));
    };
    let target = replica_number(target, "the decode replica")?;
    let prefill = if prefill.is_none() {
        None
    } else {
        Some(replica_number(prefill, "the prefill replica")?)
    };
    Ok((target, prefill))
}

impl PolicyHook for PyPolicyHook {
    fn update_metrics(
        &mut self,
        replica: usize,
        waiting: u32,
        running: u32,
        kv_cache_usage: f64,
        now: f64,
    ) -> Result<(), PolicyFailure> {
        Python::attach(|py| {
            self.policy
                .bind(py)
                .call_method1(
                    intern!(py, "update_metrics"),
                    (replica, waiting, running, kv_cache_usage, now),
                )
                .map(drop)
                .map_err(|e| {
                    raised(py, &format!("update_metrics() of replica {replica}"), None, now, e)
                })
        })
    }

    fn pick(
        &mut self,
        req: &RequestView<'_>,
        now: f64,
    ) -> Result<(usize, Option<usize>), PolicyFailure> {
        Python::attach(|py| {
            let out = self.call_with_request(py, intern!(py, "pick"), req, now)?;
            pick_answer(&out)
                .map_err(|e| PolicyFailure::new(format!("pick() for request {} {e}", req.id)))
        })
    }

    fn on_first_token(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure> {
        Python::attach(|py| {
            self.call_with_request(py, intern!(py, "on_first_token"), req, now).map(drop)
        })
    }

    fn on_finished(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure> {
        Python::attach(|py| {
            let done = self.call_with_request(py, intern!(py, "on_finished"), req, now).map(drop);
            self.requests.remove(&req.slot);
            done
        })
    }
}

impl Drop for PyPolicyHook {
    /// The kept requests go with the GIL held (the hook may be dropped without it).
    fn drop(&mut self) {
        if !self.requests.is_empty() {
            Python::attach(|_| self.requests.clear());
        }
    }
}

/// The Python exception for a failed policy call: `PolicyError` naming the policy and the call,
/// the policy's own exception chained as its cause; an exception that is not an `Exception`
/// (KeyboardInterrupt, SystemExit) propagates as it is.
pub(crate) fn policy_error(py: Python<'_>, name: Option<&str>, failure: PolicyFailure) -> PyErr {
    let cause = failure.source.and_then(|s| s.downcast::<PyErr>().ok()).map(|e| *e);
    if let Some(cause) = &cause {
        if !cause.is_instance_of::<PyException>(py) {
            return cause.clone_ref(py);
        }
    }
    let message = match name {
        Some(name) => format!("policy '{name}': {}", failure.message),
        None => format!("policy: {}", failure.message),
    };
    let err = crate::errors::PolicyError::new_err(message);
    err.set_cause(py, cause);
    err
}
