//! Decoding of vLLM KV-cache event batches (msgpack `EventBatch` payloads).
//!
//! Placeholder types; the decoder lands with its own change.

use crate::prefix_index::Tier;
use thiserror::Error;

/// A block stored by the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, as u64 (bytes hashes: last 8 bytes big-endian).
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the parent block; None for a root block.
    pub parent_block_hash: Option<u64>,
    /// The tokens of every stored block, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<String>,
    pub medium: Tier,
}

/// Blocks removed by the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Tier,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    AllCleared,
}

/// A decoded `EventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<i64>,
    /// Events of a type this decoder does not know, skipped.
    pub unknown_events: u32,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("malformed vLLM event batch at byte {offset}: {reason}")]
pub struct DecodeError {
    pub offset: usize,
    pub reason: String,
}

/// Decodes one msgpack `EventBatch` payload.
pub fn decode_event_batch(_payload: &[u8]) -> Result<EventBatch, DecodeError> {
    Err(DecodeError { offset: 0, reason: "decoder not built yet".into() })
}
