//! The serving simulator's Rust side: the replicas' KV cache (used by the reference engine too),
//! the step-time models, workload plans (and their native generators, `workload` over `rng`) and the whole discrete-event engine (`engine`; `stream` runs it on a trace while a second thread builds the trace's plan), which
//! runs a scenario without a Python round-trip per request. The pure-Python reference engine
//! (`llmsched.reference.sim`) is its oracle and covers what this one does not yet.

pub mod engine;
pub mod kv_cache;
pub mod plan;
pub mod policy;
pub mod rng;
pub mod stepmodel;
pub mod stream;
pub mod workload;

pub use engine::{
    simulate, simulate_with_policy, Counters, DoneRecord, FlowSetup, ReplicaEnd, SimConfig,
    SimError, SimOutput,
};
pub use kv_cache::{IdEvent, KvCache, KvCore, KvError, KvEvent, MAX_KV_BLOCKS};
pub use plan::{Contents, OpenRequest, Plan, PlanError, Session, Turn};
pub use policy::{check_pick, PolicyFailure, PolicyHook, RequestView};
pub use rng::{Pcg64, PyRandom};
pub use stepmodel::{DecodeRun, Linear, Roofline, StepModel, StepWork};
pub use stream::simulate_trace;
pub use workload::{
    agentic_plan, independent_plan, load_trace, prompted_plan, trace_plan, Agentic, Independent,
    LineSink, Prompted, TraceLines, TraceRow, TraceSpec, WorkloadError,
};
