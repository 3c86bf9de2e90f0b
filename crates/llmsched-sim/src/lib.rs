//! The serving simulator's Rust side: the replicas' KV cache (used by the Python engine too),
//! the step-time models, workload plans and the whole discrete-event engine (`engine`), which
//! runs a scenario without a Python round-trip per request. The Python engine
//! (`llmsched.sim.simulator`) stays as the reference twin and covers what this one does not.

pub mod engine;
pub mod kv_cache;
pub mod plan;
pub mod stepmodel;

pub use engine::{simulate, Counters, DoneRecord, ReplicaEnd, SimConfig, SimError, SimOutput};
pub use kv_cache::{IdEvent, KvCache, KvCore, KvError, KvEvent, MAX_KV_BLOCKS};
pub use plan::{Contents, OpenRequest, Plan, PlanError, Session, Turn};
pub use stepmodel::{DecodeRun, Linear, Roofline, StepModel, StepWork};
