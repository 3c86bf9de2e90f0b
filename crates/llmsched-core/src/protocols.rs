//! The shared vocabulary of the core: the names every other module speaks in, so that the
//! modules depend on this one and never on each other for them.
//!
//! - [`BlockHash`]: a chained 64-bit block hash (ours, or an engine's as published in its events);
//! - [`WorkerKey`]: a worker's name as the caller gave it; [`Tier`]: where a cached block lives;
//! - the KV-cache events an engine publishes ([`EventBatch`], [`KvEvent`], [`BlockStored`],
//!   [`BlockRemoved`]) and [`DecodeError`], why a payload could not be read.
//!
//! The decoder ([`crate::vllm_events`]) produces these types and the prefix index
//! ([`crate::prefix_index`]) consumes them; neither imports the other's vocabulary.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A chained 64-bit block hash: equal hashes mean equal prefixes (see [`crate::hashing`]).
pub type BlockHash = u64;

/// The storage tier of a cached block (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    pub fn bit(self) -> u8 {
        1 << (self as u8)
    }

    /// Parses "gpu", "cpu" or "storage" (any case).
    pub fn parse(name: &str) -> Option<Tier> {
        match name.to_ascii_lowercase().as_str() {
            "gpu" => Some(Tier::Gpu),
            "cpu" => Some(Tier::Cpu),
            "storage" | "disk" => Some(Tier::Storage),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
        }
    }
}

/// A worker's name as the caller gave it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkerKey {
    Int(i64),
    Str(String),
}

impl std::fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerKey::Int(i) => write!(f, "{i}"),
            WorkerKey::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// Blocks stored by the engine (one event may store a run of consecutive blocks).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, as u64 (bytes hashes: last 8 bytes big-endian).
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the parent of the first block; None for a root block.
    pub parent_block_hash: Option<u64>,
    /// The tokens of every stored block, concatenated: `block_hashes.len() * block_size` ids.
    pub token_ids: Vec<u32>,
    /// Tokens per block, at least 1.
    pub block_size: u32,
    /// The LoRA adapter's name (vLLM >= 0.20), if any.
    pub lora_name: Option<String>,
    /// Where the blocks are held (nil or absent `medium`: GPU).
    pub medium: Tier,
    /// vLLM's deprecated numeric LoRA id (older engines send only this), if any.
    pub lora_id: Option<i64>,
    /// One flag per block: true where the engine hashed extra keys (multimodal inputs, LoRA
    /// name, cache salt) into the block, so its content is not determined by its tokens alone.
    /// Empty when the event carries no `extra_keys` (absent or nil).
    pub has_extra_keys: Vec<bool>,
    /// The cache salt vLLM hashed into the first block: its extra keys' one string beside
    /// the LoRA name, on a root block (vLLM salts a prompt's first block only).
    pub cache_salt: Option<String>,
    /// True where some block's extra keys are more than the LoRA name and a root block's
    /// cache salt (multimodal inputs, prompt embeddings, keys of an older engine): the
    /// content of such blocks is not their tokens, so no prompt's hashes can name them.
    pub opaque_extra_keys: bool,
    /// True where some block's extra keys stand for content beside its tokens: a key that is
    /// not a string (vLLM's `(identifier, offset)` pairs of multimodal inputs, prompt-embedding
    /// digests) or an entry that is not an array. Implies `opaque_extra_keys`; false where
    /// the keys are only strings the index cannot explain (an older engine's multimodal
    /// hashes among them: they are strings).
    pub content_extra_keys: bool,
    /// The KV-cache group (hybrid models keep one group per attention kind), if sent.
    pub group_idx: Option<u32>,
    /// The group's cache kind, e.g. "full_attention" or "sliding_window", if sent.
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding-window length of the group, if sent.
    pub kv_cache_spec_sliding_window: Option<u32>,
}

impl BlockStored {
    /// True when any stored block carries extra keys.
    pub fn any_extra_keys(&self) -> bool {
        self.has_extra_keys.iter().any(|&present| present)
    }
}

impl Default for BlockStored {
    /// An empty GPU event of block size 1; lets callers name only the fields they set.
    fn default() -> Self {
        BlockStored {
            block_hashes: Vec::new(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 1,
            lora_name: None,
            medium: Tier::Gpu,
            lora_id: None,
            has_extra_keys: Vec::new(),
            cache_salt: None,
            opaque_extra_keys: false,
            content_extra_keys: false,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    }
}

/// Blocks removed by the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// The engine's hashes of the removed blocks (same u64 mapping as [`BlockStored`]).
    pub block_hashes: Vec<u64>,
    /// The tier the blocks left (nil or absent `medium`: GPU).
    pub medium: Tier,
    /// The KV-cache group, if sent.
    pub group_idx: Option<u32>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The engine dropped every cached block (`AllBlocksCleared`).
    AllCleared,
}

/// A decoded `EventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp (seconds since the epoch).
    pub ts: f64,
    /// The known events, in payload order.
    pub events: Vec<KvEvent>,
    /// The publisher's data-parallel rank, if sent.
    pub dp_rank: Option<i64>,
    /// Events of a type this decoder does not know, skipped.
    pub unknown_events: u32,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("malformed vLLM event batch at byte {offset}: {reason}")]
pub struct DecodeError {
    /// Byte offset in the payload of the value (or missing bytes) at fault.
    pub offset: usize,
    pub reason: String,
}

impl DecodeError {
    pub(crate) fn within_event(mut self, index: usize) -> Self {
        self.reason = format!("event {index}: {}", self.reason);
        self
    }
}
