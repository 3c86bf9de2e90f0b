//! Bindings for `llmsched_sim`: the simulator's KV cache (the Python engine's) and the whole
//! Rust engine (`simulate`).

use crate::convert::{config_mapping, config_struct};
use crate::errors::{detach, CoreResult};
use numpy::{IntoPyArray, PyReadonlyArray1};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use llmsched_core::routing::{parse_config, RoutingError};
use std::sync::Arc;

use llmsched_sim::{
    simulate as sim_engine, Contents, DoneRecord, KvCache, KvEvent, OpenRequest, Plan, Session,
    SimConfig, SimOutput, StepModel, Turn,
};

/// One simulated replica's KV cache; `llmsched.sim.kv` uses it. Not shared between threads:
/// each simulation owns its replicas' caches.
#[pyclass(module = "llmsched._llmsched", name = "KvCache")]
pub struct PyKvCache {
    inner: KvCache,
}

#[pymethods]
impl PyKvCache {
    #[new]
    fn new(num_blocks: u32, block_size: u32) -> PyResult<Self> {
        Ok(Self { inner: KvCache::new(num_blocks, block_size).py()? })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> u64 {
        self.inner.block_size()
    }

    #[getter]
    fn free_blocks(&self) -> usize {
        self.inner.free_blocks()
    }

    #[getter]
    fn cached_blocks(&self) -> usize {
        self.inner.cached_blocks()
    }

    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    fn requests(&self) -> usize {
        self.inner.requests()
    }

    #[pyo3(signature = (hashes, max_blocks = None))]
    fn lookup(
        &self,
        hashes: PyReadonlyArray1<'_, u64>,
        max_blocks: Option<usize>,
    ) -> PyResult<usize> {
        Ok(self.inner.lookup(hashes.as_slice()?, max_blocks.unwrap_or(usize::MAX)))
    }

    fn tokens_of(&self, req: u64) -> PyResult<u64> {
        self.inner.tokens_of(req).py()
    }

    fn blocks_of(&self, req: u64) -> PyResult<usize> {
        self.inner.blocks_of(req).py()
    }

    fn start(
        &mut self,
        req: u64,
        hashes: PyReadonlyArray1<'_, u64>,
        max_blocks: usize,
    ) -> PyResult<usize> {
        self.inner.start(req, hashes.as_slice()?, max_blocks).py()
    }

    fn allocate(&mut self, req: u64, tokens: u64) -> PyResult<bool> {
        self.inner.allocate(req, tokens).py()
    }

    fn commit(&mut self, req: u64, hashes: PyReadonlyArray1<'_, u64>, upto: usize) -> PyResult<()> {
        self.inner.commit(req, hashes.as_slice()?, upto).py()
    }

    fn free(&mut self, req: u64) -> PyResult<()> {
        self.inner.free(req).py()
    }

    fn set_decoding(&mut self, req: u64, decoding: bool) -> PyResult<()> {
        self.inner.set_decoding(req, decoding).py()
    }

    fn decode_capacity(&self, limit: u64) -> u64 {
        self.inner.decode_capacity(limit)
    }

    fn advance_decoding(&mut self, steps: u64) -> bool {
        self.inner.advance_decoding(steps)
    }

    /// `("stored", parent | None, hashes)` and `("removed", hashes)` tuples, hashes as numpy.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .take_events()
            .into_iter()
            .map(|event| match event {
                KvEvent::Stored { parent, hashes } => PyTuple::new(
                    py,
                    [
                        "stored".into_pyobject(py)?.into_any(),
                        parent.into_pyobject(py)?.into_any(),
                        hashes.into_pyarray(py).into_any(),
                    ],
                ),
                KvEvent::Removed { hashes } => PyTuple::new(
                    py,
                    ["removed".into_pyobject(py)?.into_any(), hashes.into_pyarray(py).into_any()],
                ),
            })
            .collect()
    }
}

// ---- the Rust engine ----------------------------------------------------------------------

/// A workload plan's block hashes numbered once (equal hashes, equal ids), so that every run
/// of the plan skips that pass; `number_contents` builds it and `simulate` checks it matches
/// the plan's hashes.
#[pyclass(module = "llmsched._llmsched", name = "PlanContents", frozen)]
pub struct PyPlanContents {
    inner: Arc<Contents>,
}

#[pymethods]
impl PyPlanContents {
    /// Distinct hashes.
    #[getter]
    fn distinct(&self) -> usize {
        self.inner.unique().len()
    }

    fn __len__(&self) -> usize {
        self.inner.ids().len()
    }
}

/// Numbers a plan's block hashes (the GIL released while it runs).
#[pyfunction]
fn number_contents(py: Python<'_>, hashes: PyReadonlyArray1<'_, u64>) -> PyResult<PyPlanContents> {
    let hashes = hashes.as_slice()?;
    let inner = detach(py, || Arc::new(Contents::number(hashes)))?;
    Ok(PyPlanContents { inner })
}

/// `dict[name]`, converted; a missing or mistyped item raises naming it.
fn item<'py, T>(dict: &Bound<'py, PyDict>, name: &str) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    let value = dict
        .get_item(name)?
        .ok_or_else(|| PyKeyError::new_err(format!("simulation argument {name:?} is missing")))?;
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyTypeError::new_err(format!("simulation argument {name:?}: {e}"))
    })
}

fn usizes(values: &[i64], name: &str) -> PyResult<Vec<usize>> {
    values
        .iter()
        .map(|&v| {
            usize::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {v}")))
        })
        .collect()
}

fn ranges(offsets: &[usize], name: &str) -> PyResult<Vec<std::ops::Range<usize>>> {
    if offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(PyValueError::new_err(format!("{name} must not decrease")));
    }
    Ok(offsets.windows(2).map(|w| w[0]..w[1]).collect())
}

fn plan(d: &Bound<'_, PyDict>) -> PyResult<Plan> {
    let hashes: PyReadonlyArray1<'_, u64> = item(d, "hashes")?;
    let hashes = hashes.as_slice()?.to_vec();
    let kind: String = item(d, "kind")?;
    let contents = match d.get_item("contents")? {
        Some(c) if !c.is_none() => Some(
            c.cast::<PyPlanContents>()
                .map_err(|_| PyTypeError::new_err("plan item \"contents\" must be PlanContents"))?
                .get()
                .inner
                .clone(),
        ),
        _ => None,
    };
    let mut plan = Plan { hashes, contents, ..Plan::default() };
    let offsets: PyReadonlyArray1<'_, i64> = item(d, "hash_offsets")?;
    let spans = ranges(&usizes(offsets.as_slice()?, "hash_offsets")?, "hash_offsets")?;
    let tenant: PyReadonlyArray1<'_, i64> = item(d, "tenant")?;
    let tenant = tenant.as_slice()?;
    if kind == "open" {
        let arrival: PyReadonlyArray1<'_, f64> = item(d, "arrival")?;
        let prompt: PyReadonlyArray1<'_, i64> = item(d, "prompt")?;
        let output: PyReadonlyArray1<'_, i64> = item(d, "output")?;
        let priority: PyReadonlyArray1<'_, i64> = item(d, "priority")?;
        let sessions: Vec<Option<String>> = item(d, "session")?;
        let (arrival, priority) = (arrival.as_slice()?, priority.as_slice()?);
        let prompt = usizes(prompt.as_slice()?, "prompt")?;
        let output = usizes(output.as_slice()?, "output")?;
        let n = arrival.len();
        if [prompt.len(), output.len(), priority.len(), tenant.len(), sessions.len(), spans.len()]
            .iter()
            .any(|&len| len != n)
        {
            return Err(PyValueError::new_err("plan arrays differ in length"));
        }
        plan.open = (0..n)
            .map(|i| OpenRequest {
                arrival: arrival[i],
                prompt_len: prompt[i] as u64,
                output_len: output[i] as u64,
                tenant: tenant[i],
                priority: priority[i],
                session: sessions[i].clone(),
                hashes: spans[i].clone(),
            })
            .collect();
    } else if kind == "sessions" {
        let starts: PyReadonlyArray1<'_, f64> = item(d, "starts")?;
        plan.starts = starts.as_slice()?.to_vec();
        plan.closed = item(d, "closed")?;
        let turn_offsets: PyReadonlyArray1<'_, i64> = item(d, "turn_offsets")?;
        let turns = ranges(&usizes(turn_offsets.as_slice()?, "turn_offsets")?, "turn_offsets")?;
        let prompt: PyReadonlyArray1<'_, i64> = item(d, "turn_prompt")?;
        let output: PyReadonlyArray1<'_, i64> = item(d, "turn_output")?;
        let blocks: PyReadonlyArray1<'_, i64> = item(d, "turn_blocks")?;
        let think: PyReadonlyArray1<'_, f64> = item(d, "turn_think")?;
        let prompt = usizes(prompt.as_slice()?, "turn_prompt")?;
        let output = usizes(output.as_slice()?, "turn_output")?;
        let blocks = usizes(blocks.as_slice()?, "turn_blocks")?;
        let think = think.as_slice()?;
        let t = prompt.len();
        if [output.len(), blocks.len(), think.len()].iter().any(|&len| len != t)
            || turns.len() != spans.len()
            || tenant.len() != spans.len()
            || turns.last().is_some_and(|r| r.end > t)
        {
            return Err(PyValueError::new_err("plan arrays differ in length"));
        }
        plan.sessions = (0..spans.len())
            .map(|s| Session {
                tenant: tenant[s],
                hashes: spans[s].clone(),
                turns: turns[s]
                    .clone()
                    .map(|i| Turn {
                        prompt_len: prompt[i] as u64,
                        output_len: output[i] as u64,
                        blocks: blocks[i],
                        think: think[i],
                    })
                    .collect(),
            })
            .collect();
    } else {
        return Err(PyValueError::new_err(format!("unknown plan kind {kind:?}")));
    }
    Ok(plan)
}

/// Runs one scenario on the Rust engine (`llmsched.sim.fast` prepares the arguments) with the
/// GIL released; returns the finished requests as arrays, per-replica end states, the KV-use
/// trace and the time spent in routing decisions and feeds.
#[pyfunction]
fn simulate<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyAny>,
    step: &Bound<'py, PyAny>,
    router: &Bound<'py, PyAny>,
    workload: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg: SimConfig = config_struct(config, "simulation config")?;
    let model: StepModel = config_struct(step, "step model")?;
    let value = config_mapping(Some(router), "router config")?;
    parse_config(&value).map_err(RoutingError::from).py()?; // errors surface here, once
    let make = || parse_config(&value).map_err(RoutingError::from);
    let plan = plan(workload)?;
    let budget = cfg.max_num_batched_tokens;
    let (out, ideal) = py
        .detach(|| {
            let out = sim_engine(cfg, model, &make, &plan)?;
            let ideal: Vec<f64> =
                out.done.iter().map(|r| model.ideal(r.prompt_len, r.output_len, budget)).collect();
            Ok::<_, llmsched_sim::SimError>((out, ideal))
        })
        .py()?;
    let d = output(py, out)?;
    d.set_item("ideal", ideal.into_pyarray(py))?;
    Ok(d)
}

fn output<'py>(py: Python<'py>, out: SimOutput) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let done = &out.done;
    let f = |g: fn(&DoneRecord) -> f64| done.iter().map(g).collect::<Vec<f64>>().into_pyarray(py);
    let i = |g: fn(&DoneRecord) -> i64| done.iter().map(g).collect::<Vec<i64>>().into_pyarray(py);
    d.set_item("id", i(|r| r.id as i64))?;
    d.set_item("arrival", f(|r| r.arrival))?;
    d.set_item("dispatched", f(|r| r.dispatched))?;
    d.set_item("first_token", f(|r| r.first_token))?;
    d.set_item("finish", f(|r| r.finish))?;
    d.set_item("prompt", i(|r| r.prompt_len as i64))?;
    d.set_item("output", i(|r| r.output_len as i64))?;
    d.set_item("generated", i(|r| r.generated as i64))?;
    d.set_item("cached", i(|r| r.cached_tokens))?;
    d.set_item("prefilled", i(|r| r.prefilled as i64))?;
    d.set_item("recomputed", i(|r| r.recomputed as i64))?;
    d.set_item("preemptions", i(|r| r.preemptions as i64))?;
    d.set_item("tenant", i(|r| r.tenant))?;
    d.set_item("priority", i(|r| r.priority))?;
    d.set_item("session", i(|r| r.session.map_or(-1, |s| s as i64)))?;
    d.set_item("turn", i(|r| r.turn as i64))?;
    d.set_item(
        "rejected",
        done.iter().map(|r| r.rejected).collect::<Vec<bool>>().into_pyarray(py),
    )?;
    d.set_item("sync_batches", out.sync_batches)?;
    d.set_item("sync_bytes", out.sync_bytes)?;
    let replicas = PyList::empty(py);
    for rep in &out.replicas {
        let r = PyDict::new(py);
        let c = rep.counters;
        r.set_item("prefill_tokens", c.prefill_tokens)?;
        r.set_item("recomputed_tokens", c.recomputed_tokens)?;
        r.set_item("hit_tokens", c.hit_tokens)?;
        r.set_item("query_tokens", c.query_tokens)?;
        r.set_item("preemptions", c.preemptions)?;
        r.set_item("steps", c.steps)?;
        r.set_item("kv_requests", rep.kv_requests)?;
        r.set_item("kv_usage", rep.kv_usage)?;
        r.set_item("running", rep.running)?;
        r.set_item("waiting", rep.waiting)?;
        r.set_item("decode_n", rep.decode_n)?;
        r.set_item("decode_ctx", rep.decode_ctx)?;
        replicas.append(r)?;
    }
    d.set_item("replicas", replicas)?;
    d.set_item("kv_trace", out.kv_trace)?;
    d.set_item("decision_s", out.decision.as_secs_f64())?;
    d.set_item("feed_s", out.feed.as_secs_f64())?;
    d.set_item("feed_skipped", out.feed_skipped)?;
    d.set_item("now", out.now)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvCache>()?;
    m.add_class::<PyPlanContents>()?;
    m.add_function(wrap_pyfunction!(number_contents, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)
}
