//! Building blocks of the serving simulator whose Python versions were too slow (profiled:
//! the per-block KV bookkeeping took most of the run time). The event loop, engines and
//! workloads live in Python (`llmsched.sim`).

pub mod kv_cache;

pub use kv_cache::{KvCache, KvError, KvEvent};
