//! The PyO3 layer: argument extraction, GIL release, error mapping. No logic lives here.

use pyo3::prelude::*;

mod convert;
mod errors;
mod flow;
mod gateway;
mod hashing;
mod kv_feed;
mod prefix_index;
mod pyints;
mod rebuild;
mod replica_sync;
mod routing;
mod sim;
mod sim_policy;
mod slices;
mod tokens;
mod vllm_events;

#[pymodule(gil_used = false)]
fn _llmsched(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_BLOCK_SIZE", llmsched_core::hashing::MAX_BLOCK_SIZE)?;
    hashing::register(m)?;
    prefix_index::register(m)?;
    slices::register(m)?;
    vllm_events::register(m)?;
    routing::register(m)?;
    replica_sync::register(m)?;
    sim::register(m)?;
    flow::register(m)?;
    gateway::register(m)?;
    kv_feed::register(m)?;
    pyints::register(m)?;
    Ok(())
}
