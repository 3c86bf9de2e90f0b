//! Bindings for `llmsched_core::vllm_events`: a debug view of one decoded payload as plain Python data.

use crate::errors::{detach, CoreResult};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use llmsched_core::vllm_events::{self, BlockRemoved, BlockStored, EventBatch, KvEvent};

/// Decodes one vLLM `EventBatch` payload to a dict (see `llmsched.vllm_events`).
#[pyfunction]
fn decode_vllm_events<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let batch = detach(py, || vllm_events::decode_event_batch(payload))?.py()?;
    batch_dict(py, &batch)
}

fn batch_dict<'py>(py: Python<'py>, batch: &EventBatch) -> PyResult<Bound<'py, PyDict>> {
    let events = PyList::empty(py);
    for event in &batch.events {
        events.append(event_dict(py, event)?)?;
    }
    let dict = PyDict::new(py);
    dict.set_item("ts", batch.ts)?;
    dict.set_item("events", events)?;
    dict.set_item("dp_rank", batch.dp_rank)?;
    dict.set_item("unknown_events", batch.unknown_events)?;
    Ok(dict)
}

fn event_dict<'py>(py: Python<'py>, event: &KvEvent) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    match event {
        KvEvent::Stored(stored) => fill_stored(&dict, stored)?,
        KvEvent::Removed(removed) => fill_removed(&dict, removed)?,
        KvEvent::AllCleared => dict.set_item("type", "AllBlocksCleared")?,
    }
    Ok(dict)
}

fn fill_stored(dict: &Bound<'_, PyDict>, stored: &BlockStored) -> PyResult<()> {
    dict.set_item("type", "BlockStored")?;
    dict.set_item("block_hashes", &stored.block_hashes)?;
    dict.set_item("parent_block_hash", stored.parent_block_hash)?;
    dict.set_item("token_ids", &stored.token_ids)?;
    dict.set_item("block_size", stored.block_size)?;
    dict.set_item("lora_id", stored.lora_id)?;
    dict.set_item("medium", vllm_events::medium_name(stored.medium))?;
    dict.set_item("lora_name", stored.lora_name.as_deref())?;
    dict.set_item("has_extra_keys", &stored.has_extra_keys)?;
    dict.set_item("cache_salt", stored.cache_salt.as_deref())?;
    dict.set_item("opaque_extra_keys", stored.opaque_extra_keys)?;
    dict.set_item("content_extra_keys", stored.content_extra_keys)?;
    dict.set_item("group_idx", stored.group_idx)?;
    dict.set_item("kv_cache_spec_kind", stored.kv_cache_spec_kind.as_deref())?;
    dict.set_item("kv_cache_spec_sliding_window", stored.kv_cache_spec_sliding_window)?;
    Ok(())
}

fn fill_removed(dict: &Bound<'_, PyDict>, removed: &BlockRemoved) -> PyResult<()> {
    dict.set_item("type", "BlockRemoved")?;
    dict.set_item("block_hashes", &removed.block_hashes)?;
    dict.set_item("medium", vllm_events::medium_name(removed.medium))?;
    dict.set_item("group_idx", removed.group_idx)?;
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_vllm_events, m)?)?;
    Ok(())
}
