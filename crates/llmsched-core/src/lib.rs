//! llmsched-core: the decisions an LLM gateway makes on every request, fast enough for its hot
//! path, in plain Rust (no Python anywhere in this crate).
//!
//! One module per concept:
//!
//! - [`protocols`]: the shared vocabulary (block hashes, worker keys, tiers, KV-cache events and
//!   their errors). Every other module depends on it; it depends on none of them.
//! - [`hashing`]: chained block hashes of token sequences (xxh3, or vLLM's `sha256_cbor`).
//! - [`vllm_events`]: the decoder of vLLM's msgpack KV-event batches.
//! - [`prefix_index`]: a concurrent radix tree of which worker holds which cached prefix.
//! - [`routing`]: endpoint pools, filters, weighted scorers and pickers, the router.
//! - [`flow`]: admission control (priority bands, tenant fairness, saturation, shedding).
//! - [`slices`]: decoding cut into slices a scheduler can re-plan, with a switch-cost model.
//!
//! The modules form a layered graph without cycles (a test checks it):
//! `protocols` ← `hashing` ← `vllm_events` ← `prefix_index` ← `routing`; `flow` and `slices`
//! stand alone.
//!
//! # Example: route a request to the worker that holds its prefix
//!
//! ```
//! use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, Tier, WorkerKey};
//!
//! let index = PrefixIndex::new(IndexConfig { block_size: 4, ..IndexConfig::default() }).unwrap();
//! let prompt: Vec<u32> = (0..16).collect();
//! let hashes = index.hash_tokens(&prompt, None, None).unwrap();
//! let engine_a = WorkerKey::Str("engine-a".into());
//! // The engine reports that it cached the first three blocks of the prompt.
//! index.store(&engine_a, &hashes[..3], None, Tier::Gpu).unwrap();
//! let best = index.match_hashes(&hashes, 0.0);
//! assert_eq!(best.longest(), 3);
//! ```

pub mod flow;
pub mod hashing;
pub mod prefix_index;
pub mod protocols;
pub mod routing;
pub mod slices;
pub mod vllm_events;
