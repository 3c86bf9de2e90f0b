//! Applying decoded vLLM KV events to the index.
//!
//! The index never reproduces the engine's hash: each `BlockStored` is re-hashed from its
//! `token_ids` with this index's chain (seeded by the parent's index hash, or by the namespace
//! of its LoRA adapter at the root), and a map shared by the workers (`engine_map`) remembers which
//! index blocks each engine block became. An engine block may span several index blocks when the engine's block size is a
//! multiple of the index's.

use super::engine_map::OwnEntries;
use super::tree::{Attrs, StoreRefusal, WorkerId};
use super::{start_clear, PrefixIndex, State, Tier};
use crate::buffer_pool::{self, BufferPool};
use crate::hashing;
use crate::vllm_events::{BlockRemoved, BlockStored, KvEvent};

/// What applying one batch did. Skipped events change nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub events: u64,
    /// Engine blocks stored.
    pub blocks_stored: u64,
    /// Engine blocks removed (from the named tier).
    pub blocks_removed: u64,
    /// `AllBlocksCleared` events applied.
    pub cleared: u64,
    /// Stored events skipped because their parent block is unknown for this worker (a missed
    /// event, or a parent evicted from the index).
    pub unknown_parent: u64,
    /// Removed engine blocks that were not known for this worker.
    pub unknown_removed: u64,
    /// Stored events skipped because the engine's block size is not a multiple of the index's.
    pub block_size_mismatch: u64,
    /// Stored events whose blocks conflict with the index's structure (hash collisions).
    pub conflicts: u64,
    /// Events of a type this index does not know, skipped.
    pub unknown_events: u64,
    /// Events for a KV-cache group other than group 0, skipped: hybrid models send one event per
    /// group for the same tokens, and only the first (full attention) group decides prefix reuse.
    pub other_groups: u64,
    /// Stored events skipped because their blocks carry extra keys that no request's hashes
    /// can name, though their content is their tokens: string keys other than the LoRA name
    /// and a root block's cache salt (which the chain's seed holds), such as a LoRA name the
    /// event does not give or keys of an older engine; also a LoRA adapter's blocks named
    /// only by its `lora_id` (vLLM before 0.20), whose name no request's hashes can take.
    /// Every one is a routing miss that configuration may cure (the index warns).
    pub extra_keys: u64,
    /// Stored events skipped because their blocks' extra keys stand for content beside their
    /// tokens ([`BlockStored::content_extra_keys`]: multimodal inputs, prompt embeddings):
    /// no prompt's token hashes can match them, whatever the configuration.
    pub multimodal: u64,
    /// Engine blocks stored again under a hash the worker had stored with other content (a
    /// hash collision, or two engines reporting as one worker): the hash now names the new
    /// content, and the worker's holding of the old blocks is released.
    pub replaced: u64,
}

/// Applies `events` (the batch's events from some position on) for `w` into `report`, up to
/// and including the first clear of a worker too large to clear at once. Returns, for such a
/// clear, the number of events applied and the engine-hash entries it took from the worker
/// (freed by the caller once the lock is released); the caller finishes the clear in steps
/// ([`PrefixIndex::finish_clear`]) before applying the rest.
pub(super) fn apply_events(
    index: &PrefixIndex,
    st: &mut State,
    w: WorkerId,
    events: &[KvEvent],
    report: &mut ApplyReport,
) -> Option<(usize, OwnEntries)> {
    for (i, event) in events.iter().enumerate() {
        match event {
            KvEvent::Stored(stored) => apply_stored(index, st, w, stored, report),
            KvEvent::Removed(removed) => apply_removed(st, w, removed, report),
            KvEvent::AllCleared => {
                report.cleared += 1;
                let (_, own) = start_clear(st, w);
                if st.tree.is_hidden(w) {
                    return Some((i + 1, own));
                }
            }
        }
    }
    None
}

fn apply_stored(
    index: &PrefixIndex,
    st: &mut State,
    w: WorkerId,
    ev: &BlockStored,
    report: &mut ApplyReport,
) {
    if ev.group_idx.unwrap_or(0) != 0 {
        report.other_groups += 1;
        return;
    }
    // vLLM before 0.20 names an adapter only by its number (no `lora_name`, no `extra_keys`)
    // but keys the adapter's blocks by it: no request's hashes can name it, and chained from
    // the base model's seed its blocks would match the base model's prompts.
    let numbered_adapter = ev.lora_name.is_none() && ev.lora_id.is_some_and(|id| id != 0);
    if ev.content_extra_keys {
        report.multimodal += 1;
        return;
    }
    if ev.opaque_extra_keys || numbered_adapter {
        report.extra_keys += 1;
        return;
    }
    let bs = index.config.block_size;
    let engine_bs = ev.block_size as usize;
    if engine_bs % bs != 0 {
        report.block_size_mismatch += 1;
        return;
    }
    let per_engine_block = engine_bs / bs;
    let parent = match ev.parent_block_hash {
        None => None,
        Some(p) => match st.workers.engine.get(w, p) {
            Some((_, last, _)) if st.tree.holds(w, last) => Some(last),
            _ => {
                report.unknown_parent += 1;
                return;
            }
        },
    };
    let seed = parent
        .unwrap_or_else(|| index.chain_seed(ev.lora_name.as_deref(), ev.cache_salt.as_deref()));
    let mut ours = buffer_pool::take(&CHAIN_POOL);
    if hashing::chain_hashes_into(&ev.token_ids, bs, seed, &mut ours).is_ok() {
        store_chain(st, w, ev, parent, &ours, per_engine_block, report);
    } else {
        report.conflicts += 1;
    }
    buffer_pool::give(&CHAIN_POOL, ours);
}

thread_local! {
    /// The index hashes of one stored event, reused from event to event.
    static CHAIN_POOL: BufferPool<u64> = const { BufferPool::new(2, 1 << 16) };
}

/// Stores the index blocks `ours` of event `ev` after `parent` and records which of them each
/// engine block became.
fn store_chain(
    st: &mut State,
    w: WorkerId,
    ev: &BlockStored,
    parent: Option<u64>,
    ours: &[u64],
    per_engine_block: usize,
    report: &mut ApplyReport,
) {
    if ours.len() != ev.block_hashes.len() * per_engine_block {
        report.block_size_mismatch += 1;
        return;
    }
    let attrs = Attrs { tiers: ev.medium.bit(), confirmed: true, expires: f64::INFINITY };
    match st.tree.store(w, ours, parent, attrs) {
        Ok(_) => {}
        Err(StoreRefusal::Conflict(_)) => {
            report.conflicts += 1;
            return;
        }
        Err(StoreRefusal::UnknownParent(_) | StoreRefusal::ParentNotHeld(_)) => {
            report.unknown_parent += 1;
            return;
        }
    }
    let mut replaced = Vec::new();
    st.workers.engine.insert_event(w, &ev.block_hashes, ours, per_engine_block, &mut replaced);
    report.blocks_stored += ev.block_hashes.len() as u64;
    if !replaced.is_empty() {
        release_replaced(st, w, &replaced, ours, report);
    }
}

/// Releases `w`'s holding of the blocks that engine hashes it stored again with other content
/// (`replaced`) named before: the engine's hash now names the new content, so no
/// `BlockRemoved` could ever drop the old blocks. Counted where the worker held them. A
/// replaced block is dropped as a removal of
/// it would drop it (with what lies below it), unless the chain just stored runs through it
/// (a cycle of engine hashes: a collision, or two engines reporting under one worker).
fn release_replaced(
    st: &mut State,
    w: WorkerId,
    replaced: &[(u64, u64, u32)],
    ours: &[u64],
    report: &mut ApplyReport,
) {
    let Some(&last) = ours.last() else { return };
    for &(first, _, _) in replaced {
        // Not held: another worker's entry (engines with their own hash seeds), or blocks
        // already evicted.
        if !st.tree.holds(w, first) {
            continue;
        }
        report.replaced += 1;
        if !st.tree.chain_contains(last, first) {
            st.tree.drop_from(w, first);
        }
    }
}

fn apply_removed(st: &mut State, w: WorkerId, ev: &BlockRemoved, report: &mut ApplyReport) {
    if ev.group_idx.unwrap_or(0) != 0 {
        report.other_groups += 1;
        return;
    }
    for &engine_hash in &ev.block_hashes {
        let Some((first, last, span)) = st.workers.engine.get(w, engine_hash) else {
            report.unknown_removed += 1;
            continue;
        };
        if !st.tree.holds(w, first) {
            st.workers.engine.forget(w, engine_hash, &st.tree);
            report.unknown_removed += 1;
            continue;
        }
        // The engine block's index blocks, first to last; when its tail is already gone, the
        // first block alone (dropping it drops what is left below).
        let blocks = if st.tree.holds(w, last) {
            st.tree.chain_tail(last, span as usize)
        } else {
            vec![first]
        };
        let mut changed = false;
        for h in blocks {
            changed |= st.tree.remove_tiers(w, h, ev.medium.bit()).0;
        }
        if changed {
            report.blocks_removed += 1;
        } else {
            report.unknown_removed += 1;
        }
        if !st.tree.holds(w, first) {
            st.workers.engine.forget(w, engine_hash, &st.tree);
        }
    }
}

impl Tier {
    /// The tier for vLLM's `medium` field (None means GPU in old versions).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        medium.and_then(Tier::parse).unwrap_or(Tier::Gpu)
    }
}
