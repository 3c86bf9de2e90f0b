//! Bindings for `llmsched_sim`: the simulator's KV cache (the reference engine's) and the whole
//! Rust engine (`simulate`).

use crate::convert::{config_mapping, config_struct};
use crate::errors::{detach, CoreResult, InvalidTypeError};
use numpy::{IntoPyArray, PyReadonlyArray1};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::errors::ToPyErr;
use crate::sim_policy::{policy_error, PyPolicyHook};
use crate::slices::PySwitchCostModel;
use llmsched_core::flow::FlowConfig;
use llmsched_core::routing::{config, RoutingError};
use llmsched_core::slices::SliceTracker;
use std::sync::Arc;

use llmsched_sim::{
    agentic_plan, independent_plan, load_trace, prompted_plan, simulate as sim_engine,
    simulate_trace, simulate_with_policy, trace_plan, Agentic, Contents, DoneRecord, FlowSetup,
    Independent, KvCache, KvEvent, OpenRequest, Pcg64, Plan, Prompted, PyRandom, Session,
    SimConfig, SimError, SimOutput, StepModel, TraceLines, TraceSpec, Turn,
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
        InvalidTypeError::new_err(format!("simulation argument {name:?}: {e}"))
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

/// The plan in `d`, its block hashes lent by the caller (the numpy array `d["hashes"]`, read
/// without copying while the engine runs).
fn plan<'h>(d: &Bound<'_, PyDict>, hashes: &'h [u64]) -> PyResult<Plan<'h>> {
    let kind: String = item(d, "kind")?;
    let contents = match d.get_item("contents")? {
        Some(c) if !c.is_none() => Some(
            c.cast::<PyPlanContents>()
                .map_err(|_| {
                    InvalidTypeError::new_err("plan item \"contents\" must be PlanContents")
                })?
                .get()
                .inner
                .clone(),
        ),
        _ => None,
    };
    let mut plan = Plan { hashes: hashes.into(), contents, ..Plan::default() };
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
/// trace and the time spent in routing decisions and feeds. The plan's hashes are read in place
/// from its numpy array (a 100,000-line trace's are 390 MB: a copy takes 0.2 s, and up to 1-2 s
/// when its fresh pages fault in on a busy machine), so nothing may write to that array
/// meanwhile; the plans `llmsched.sim.fast` builds and caches are never written.
///
/// A workload of kind `"trace"` (`path`, `settings` and `rng` as `plan_trace` takes them, and
/// `chain_seed`) is a trace whose plan a second thread builds while the engine runs on the
/// lines built so far (`llmsched_sim::stream`); the result then holds the plan too (`"plan"`,
/// as `plan_trace` returns it). Not with a `policy`.
#[pyfunction]
#[pyo3(signature = (config, step, router, workload, flow = None, ttft_targets = None, slices = None, functions = Vec::new(), policy = None))]
#[allow(clippy::too_many_arguments)]
fn simulate<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyAny>,
    step: &Bound<'py, PyAny>,
    router: &Bound<'py, PyAny>,
    workload: &Bound<'py, PyDict>,
    flow: Option<&Bound<'py, PyAny>>,
    ttft_targets: Option<Vec<(i64, f64)>>,
    slices: Option<(String, Bound<'py, PyAny>, PyRef<'py, PySwitchCostModel>)>,
    functions: Vec<Py<PyAny>>,
    policy: Option<(String, Py<PyAny>)>,
) -> PyResult<Bound<'py, PyDict>> {
    let slices = match slices {
        None => None,
        Some((policy, params, cost)) => {
            let params = config_mapping(Some(&params), &format!("policy {policy}"))?;
            SliceTracker::from_config(&policy, &params, cost.model).py()?; // errors surface here
            Some((policy, params, cost.model))
        }
    };
    // A tracker keeps state: every run gets its own.
    let make_slices = || {
        slices
            .as_ref()
            .map(|(policy, params, cost)| SliceTracker::from_config(policy, params, *cost))
            .transpose()
    };
    let cfg: SimConfig = config_struct(config, "simulation config")?;
    let flow = match flow {
        Some(f) if !f.is_none() => Some(FlowSetup {
            config: FlowConfig::from_value(config_mapping(Some(f), "flow config")?).py()?,
            ttft_targets: ttft_targets.unwrap_or_default(),
        }),
        _ => None,
    };
    let model: StepModel = config_struct(step, "step model")?;
    let value = config_mapping(Some(router), "router config")?;
    // Python plugins (`functions`) are called back with the GIL taken for each call only.
    let registry = crate::routing::registry(py, &functions);
    config::parse(&value, &registry).map_err(RoutingError::from).py()?; // errors surface here
    let make = || config::parse(&value, &registry).map_err(RoutingError::from);
    let budget = cfg.max_num_batched_tokens;
    let kind: String = item(workload, "kind")?;
    if kind == "trace" {
        if policy.is_some() {
            return Err(PyValueError::new_err("a trace built while it runs needs a router"));
        }
        let build = TraceBuild::from_dict(workload)?;
        let (out, ideal, plan) = detach(py, || {
            let rows = load_trace(&build.path, &build.spec)?;
            let bs = cfg.block_size as usize;
            let lines = TraceLines::new(&rows, &build.spec, bs, build.chain_seed)?;
            let rng = generator(build.rng);
            let (out, plan) = simulate_trace(
                cfg.clone(),
                model,
                &make,
                &lines,
                rng,
                flow.as_ref(),
                make_slices()?,
            )?;
            let out = match out {
                Some(out) => out,
                // The builder's numbering was not exact: run again on the plan numbered exactly.
                None => sim_engine(cfg, model, &make, &plan, flow.as_ref(), make_slices()?)?,
            };
            let ideal: Vec<f64> =
                out.done.iter().map(|r| model.ideal(r.prompt_len, r.output_len, budget)).collect();
            Ok::<_, SimError>((out, ideal, plan))
        })?
        .map_err(ToPyErr::to_py_err)?;
        let d = output(py, out)?;
        d.set_item("ideal", ideal.into_pyarray(py))?;
        d.set_item("plan", plan_dict(py, plan)?)?;
        return Ok(d);
    }
    let hashes: PyReadonlyArray1<'py, u64> = item(workload, "hashes")?;
    let plan = plan(workload, hashes.as_slice()?)?;
    // A Python `Policy` object routes instead (called back with the GIL taken for each call).
    let (name, hook) = match policy {
        Some((name, object)) => (Some(name), Some(PyPolicyHook::new(py, object)?)),
        None => (None, None),
    };
    let (out, ideal) = py
        .detach(|| {
            let out = match hook {
                Some(hook) => simulate_with_policy(
                    cfg,
                    model,
                    &make,
                    &plan,
                    flow.as_ref(),
                    make_slices()?,
                    Box::new(hook),
                )?,
                None => sim_engine(cfg, model, &make, &plan, flow.as_ref(), make_slices()?)?,
            };
            let ideal: Vec<f64> =
                out.done.iter().map(|r| model.ideal(r.prompt_len, r.output_len, budget)).collect();
            Ok::<_, llmsched_sim::SimError>((out, ideal))
        })
        .map_err(|e| match e {
            SimError::Policy(failure) => policy_error(py, name.as_deref(), failure),
            other => other.to_py_err(),
        })?;
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
    d.set_item("slice_switches", out.slice_switches)?;
    d.set_item("arrived", out.arrived)?;
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
        r.set_item("kv_peak", rep.kv_peak)?;
        r.set_item("kv_mean", rep.kv_mean)?;
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

// ---- native workload plans ---------------------------------------------------------------

/// numpy's `bit_generator.state` of a PCG64 generator: (`state`, `inc`, `has_uint32`,
/// `uinteger`).
type RngState = (u128, u128, bool, u32);

fn generator(state: RngState) -> Pcg64 {
    Pcg64::from_state(state.0, state.1, state.2, state.3)
}

/// A plan as the dict `llmsched.sim.fast` builds in Python (numpy arrays; `contents`
/// numbered here), so both feed `simulate` the same way.
fn plan_dict<'py>(py: Python<'py>, plan: Plan<'static>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let offsets = |spans: &mut dyn Iterator<Item = usize>| {
        let mut out = vec![0i64];
        out.extend(spans.map(|end| end as i64));
        out
    };
    let contents = match &plan.contents {
        Some(known) => known.clone(),
        None => detach(py, || Arc::new(Contents::number(&plan.hashes)))?,
    };
    if plan.sessions.is_empty() && plan.starts.is_empty() && !plan.closed {
        let open = &plan.open;
        let f = |g: fn(&OpenRequest) -> f64| open.iter().map(g).collect::<Vec<_>>();
        let i = |g: fn(&OpenRequest) -> i64| open.iter().map(g).collect::<Vec<_>>();
        d.set_item("kind", "open")?;
        d.set_item("arrival", f(|r| r.arrival).into_pyarray(py))?;
        d.set_item("prompt", i(|r| r.prompt_len as i64).into_pyarray(py))?;
        d.set_item("output", i(|r| r.output_len as i64).into_pyarray(py))?;
        d.set_item("tenant", i(|r| r.tenant).into_pyarray(py))?;
        d.set_item("priority", i(|r| r.priority).into_pyarray(py))?;
        let sessions: Vec<Option<&str>> = open.iter().map(|r| r.session.as_deref()).collect();
        d.set_item("session", sessions)?;
        let ends = offsets(&mut open.iter().map(|r| r.hashes.end));
        d.set_item("hash_offsets", ends.into_pyarray(py))?;
    } else {
        let sessions = &plan.sessions;
        let turns = || sessions.iter().flat_map(|s| s.turns.iter());
        d.set_item("kind", "sessions")?;
        d.set_item("starts", plan.starts.clone().into_pyarray(py))?;
        d.set_item("closed", plan.closed)?;
        let tenant: Vec<i64> = sessions.iter().map(|s| s.tenant).collect();
        d.set_item("tenant", tenant.into_pyarray(py))?;
        let ends = offsets(&mut sessions.iter().map(|s| s.hashes.end));
        d.set_item("hash_offsets", ends.into_pyarray(py))?;
        let mut count = 0;
        let turn_ends = offsets(&mut sessions.iter().map(|s| {
            count += s.turns.len();
            count
        }));
        d.set_item("turn_offsets", turn_ends.into_pyarray(py))?;
        let ints = |g: fn(&Turn) -> i64| turns().map(g).collect::<Vec<i64>>();
        d.set_item("turn_prompt", ints(|t| t.prompt_len as i64).into_pyarray(py))?;
        d.set_item("turn_output", ints(|t| t.output_len as i64).into_pyarray(py))?;
        d.set_item("turn_blocks", ints(|t| t.blocks as i64).into_pyarray(py))?;
        let think: Vec<f64> = turns().map(|t| t.think).collect();
        d.set_item("turn_think", think.into_pyarray(py))?;
    }
    d.set_item("hashes", plan.hashes.into_owned().into_pyarray(py))?;
    d.set_item("contents", Bound::new(py, PyPlanContents { inner: contents })?)?;
    Ok(d)
}

/// `TraceConfig`'s replay settings, as `plan_trace` takes them.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceArgs {
    timestamp_unit: String,
    time_scale: f64,
    hash_block: usize,
    limit: Option<usize>,
}

/// A trace to read and build a plan of, as `simulate` takes it.
struct TraceBuild {
    path: String,
    spec: TraceSpec,
    rng: RngState,
    chain_seed: u64,
}

impl TraceBuild {
    fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        let settings: Bound<'_, PyAny> = item(d, "settings")?;
        Ok(TraceBuild {
            path: item(d, "path")?,
            spec: trace_spec(&settings)?,
            rng: item(d, "rng")?,
            chain_seed: item(d, "chain_seed")?,
        })
    }
}

fn trace_spec(settings: &Bound<'_, PyAny>) -> PyResult<TraceSpec> {
    let args: TraceArgs = config_struct(settings, "trace settings")?;
    Ok(TraceSpec {
        millis: args.timestamp_unit == "ms",
        time_scale: args.time_scale,
        hash_block: args.hash_block,
        limit: args.limit,
    })
}

/// A trace's plan (`llmsched.sim.workloads.TraceWorkload`, built natively); `rng` is the state
/// of the workload's `default_rng(seed)`.
#[pyfunction]
fn plan_trace<'py>(
    py: Python<'py>,
    path: &str,
    settings: &Bound<'py, PyAny>,
    rng: RngState,
    block_size: usize,
    chain_seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let spec = trace_spec(settings)?;
    let plan = detach(py, || {
        let rows = load_trace(path, &spec)?;
        trace_plan(&rows, &spec, generator(rng), block_size, chain_seed)
    })?
    .py()?;
    plan_dict(py, plan)
}

/// The plan of independent requests (`long_short`, `priority`): arrival times, each request's
/// mean input and output lengths, tenant and priority, drawn on from the workload's generator
/// state `rng` and `random.Random(scalar_seed)`.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays of one request table, as Python holds them
fn plan_independent<'py>(
    py: Python<'py>,
    arrival: PyReadonlyArray1<'py, f64>,
    mean_input: PyReadonlyArray1<'py, f64>,
    mean_output: PyReadonlyArray1<'py, f64>,
    tenant: PyReadonlyArray1<'py, i64>,
    priority: PyReadonlyArray1<'py, i64>,
    length_cv: f64,
    rng: RngState,
    scalar_seed: u128,
    block_size: usize,
    chain_seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let spec = Independent {
        arrival: arrival.as_slice()?,
        mean_input: mean_input.as_slice()?,
        mean_output: mean_output.as_slice()?,
        tenant: tenant.as_slice()?,
        priority: priority.as_slice()?,
        length_cv,
    };
    let plan = detach(py, || {
        independent_plan(spec, generator(rng), PyRandom::new(scalar_seed), block_size, chain_seed)
    })?
    .py()?;
    plan_dict(py, plan)
}

/// The plan of requests over prompts built beforehand (`shared_prefix`): prompt `k`'s hashes
/// are `prompt_hashes[prompt_offsets[k]:prompt_offsets[k + 1]]`; request `i` asks prompt
/// `pick[i]`; the outputs' fresh ids come from the generator state `rng`.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the arrays of one request table, as Python holds them
fn plan_prompted<'py>(
    py: Python<'py>,
    prompt_hashes: PyReadonlyArray1<'py, u64>,
    prompt_offsets: PyReadonlyArray1<'py, i64>,
    prompt_len: PyReadonlyArray1<'py, i64>,
    arrival: PyReadonlyArray1<'py, f64>,
    pick: PyReadonlyArray1<'py, i64>,
    tenant: PyReadonlyArray1<'py, i64>,
    output_len: u64,
    rng: RngState,
    block_size: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let spans = ranges(&usizes(prompt_offsets.as_slice()?, "prompt_offsets")?, "prompt_offsets")?;
    let lens: Vec<u64> =
        usizes(prompt_len.as_slice()?, "prompt_len")?.into_iter().map(|v| v as u64).collect();
    let pick = usizes(pick.as_slice()?, "pick")?;
    let spec = Prompted {
        prompt_hashes: prompt_hashes.as_slice()?,
        prompt_spans: &spans,
        prompt_len: &lens,
        arrival: arrival.as_slice()?,
        pick: &pick,
        tenant: tenant.as_slice()?,
        output_len,
    };
    let plan = detach(py, || prompted_plan(spec, generator(rng), block_size))?.py()?;
    plan_dict(py, plan)
}

/// `AgenticConfig`'s numbers, as `plan_agentic` takes them.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AgenticArgs {
    sessions: usize,
    first_input: f64,
    first_output: f64,
    followup_turns: usize,
    followup_input: f64,
    followup_output: f64,
    length_cv: f64,
    think_time_s: f64,
    system_prompt_len: f64,
}

/// The session scripts of an agentic workload (`AgenticWorkload.script` for every session,
/// built natively); `systems` are the system prompts' tokens, `starts` the arrival stream's
/// session starts.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the workload's parts, as Python holds them
fn plan_agentic<'py>(
    py: Python<'py>,
    settings: &Bound<'py, PyAny>,
    systems: Vec<PyReadonlyArray1<'py, u32>>,
    starts: PyReadonlyArray1<'py, f64>,
    closed: bool,
    seed: u64,
    block_size: usize,
    chain_seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let a: AgenticArgs = config_struct(settings, "agentic settings")?;
    let cfg = Agentic {
        sessions: a.sessions,
        first_input: a.first_input,
        first_output: a.first_output,
        followup_turns: a.followup_turns,
        followup_input: a.followup_input,
        followup_output: a.followup_output,
        length_cv: a.length_cv,
        think_time_s: a.think_time_s,
        system_prompt_len: a.system_prompt_len,
    };
    let systems: Vec<Vec<u32>> =
        systems.iter().map(|s| s.as_slice().map(<[u32]>::to_vec)).collect::<Result<_, _>>()?;
    let starts = starts.as_slice()?.to_vec();
    let plan =
        detach(py, || agentic_plan(cfg, &systems, starts, closed, seed, block_size, chain_seed))?
            .py()?;
    plan_dict(py, plan)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvCache>()?;
    m.add_class::<PyPlanContents>()?;
    m.add_function(wrap_pyfunction!(number_contents, m)?)?;
    m.add_function(wrap_pyfunction!(plan_trace, m)?)?;
    m.add_function(wrap_pyfunction!(plan_independent, m)?)?;
    m.add_function(wrap_pyfunction!(plan_prompted, m)?)?;
    m.add_function(wrap_pyfunction!(plan_agentic, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)
}
