//! The prefix index: which worker holds which cached prefix, as a concurrent compressed radix
//! tree over chained block hashes (see the `tree` submodule for the algorithm).
//!
//! Workers are named by the caller (an integer or a string) and interned to dense ids. Holdings
//! come from the engines (`store`, vLLM KV events: confirmed) or from the router's own decisions
//! (`record`: approximate, expiring). One readers-writer lock guards the whole index: matches share
//! it, and writers hold it only for the duration of one call, so a batch of events applies
//! atomically. It is a [`ReadMostlyLock`], whose readers write only a slot of their own thread:
//! threads matching at once do not pass a lock word between their cores.

mod block_table;
mod children;
mod engine_map;
mod events;
mod snapshot;
pub(crate) mod tree;

use hashbrown::HashMap;
use thiserror::Error;

use engine_map::OwnEntries;
pub use events::ApplyReport;
use tree::{Attrs, StoreRefusal, Tree};
pub use tree::{MatchEntry, WorkerId};

use crate::buffer_pool::{self, BufferPool};
use crate::hashing::{self, HashError, TokenId};
use crate::protocols::DecodeError;
pub use crate::protocols::{Tier, WorkerKey};
use crate::read_mostly::{ReadMostlyLock, WriteGuard};
use crate::vllm_events::{EventBatch, KvEvent};

/// Construction parameters. Defaults live here and nowhere else.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexConfig {
    /// Tokens per block; must divide the engines' block size for events to apply.
    pub block_size: usize,
    /// Base seed of every hash chain.
    pub seed: u64,
    /// Model name folded into the chain seed.
    pub model: Option<String>,
    /// Blocks each worker may hold before its least recently used are evicted.
    pub worker_capacity: Option<u64>,
    /// Estimated bytes the whole index may use before the globally oldest leaves are evicted.
    pub max_bytes: Option<u64>,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig { block_size: 16, seed: 0, model: None, worker_capacity: None, max_bytes: None }
    }
}

impl IndexConfig {
    /// Checks every field that sizes something, before anything is built from the config.
    pub fn validate(&self) -> Result<(), IndexError> {
        hashing::check_block_size(self.block_size)
            .map_err(|err| IndexError::InvalidConfig(err.to_string()))?;
        if self.worker_capacity == Some(0) {
            return Err(IndexError::InvalidConfig("worker_capacity must be at least 1".into()));
        }
        Ok(())
    }
}

/// Errors from index operations. The index is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum IndexError {
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerKey),
    #[error("parent block {0:#018x} is not in the index")]
    UnknownParent(u64),
    #[error("worker {worker} does not hold parent block {hash:#018x}")]
    ParentNotHeld { worker: WorkerKey, hash: u64 },
    #[error("block {0:#018x} is already in the index at another position: hashes must be a chain")]
    Conflict(u64),
    #[error("worker {worker} does not hold block {hash:#018x}")]
    NotHeld { worker: WorkerKey, hash: u64 },
    #[error("invalid index configuration: {0}")]
    InvalidConfig(String),
    #[error("ttl must be a positive finite number of seconds, got {0}")]
    InvalidTtl(f64),
    #[error(transparent)]
    Hash(#[from] HashError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("invalid index snapshot: {0}")]
    Snapshot(String),
}

/// The result of a match: per worker, the leading blocks it holds, overall and per tier.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MatchResult {
    /// Workers with at least one leading block, sorted by id.
    pub entries: Vec<MatchEntry>,
    /// Blocks in the query.
    pub query_blocks: usize,
    /// Leading blocks present in the index at all (held by any worker).
    pub tree_blocks: usize,
}

impl MatchResult {
    /// The longest match over all workers.
    pub fn longest(&self) -> u32 {
        self.entries.iter().map(|e| e.blocks).max().unwrap_or(0)
    }

    /// Hands this result's allocation back for a later [`PrefixIndex::match_hashes`] on this
    /// thread. A match over hundreds of workers fills kilobytes of entries, beyond the
    /// allocator's small-size caches: allocating and freeing them cost a tenth of a match at
    /// 256 workers. Optional: a result simply dropped is freed.
    pub fn recycle(self) {
        buffer_pool::give(&RESULT_POOL, self.entries);
    }

    /// An empty result for `query_blocks` blocks, its entries' allocation taken from this
    /// thread's pool when there is one.
    fn pooled(query_blocks: usize) -> MatchResult {
        MatchResult { entries: buffer_pool::take(&RESULT_POOL), query_blocks, tree_blocks: 0 }
    }
}

thread_local! {
    /// Entry buffers handed back by [`MatchResult::recycle`].
    static RESULT_POOL: BufferPool<MatchEntry> = const { BufferPool::new(8, 1 << 14) };
}

/// Counts describing the index.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IndexStats {
    pub workers: usize,
    pub nodes: usize,
    pub blocks: usize,
    pub holdings: usize,
    pub worker_blocks: Vec<(WorkerId, u64)>,
    pub engine_blocks: usize,
    pub bytes: u64,
    /// Blocks evicted for a worker's capacity or the memory cap, since the index was made (or
    /// loaded: [`PrefixIndex::loads`] starts every counter here from 0; a snapshot holds the
    /// index's content, not its counters).
    pub evicted_blocks: u64,
    /// Times the memory cap evicted every block the index held, the blocks just stored with
    /// them: `max_bytes` is too small for what was stored (below what one block takes, for
    /// a cap of a few bytes), and the index holds nothing. Since the index was made or loaded.
    pub max_bytes_emptied: u64,
    /// Engine blocks a worker stored again with other content under the same engine hash
    /// ([`ApplyReport::replaced`]), since the index was made or loaded.
    pub replaced_engine_blocks: u64,
}

/// Per-worker state kept beside the tree.
#[derive(Debug, Clone, Default)]
pub(crate) struct Workers {
    pub keys: Vec<Option<WorkerKey>>,
    pub ids: HashMap<WorkerKey, WorkerId>,
    pub capacity: Vec<Option<u64>>,
    /// Engine block hash -> (first, last, count) of the index blocks covering that engine block.
    pub engine: engine_map::EngineMap,
}

impl Workers {
    fn id(&self, key: &WorkerKey) -> Option<WorkerId> {
        self.ids.get(key).copied()
    }

    fn intern(&mut self, key: &WorkerKey, default_capacity: Option<u64>) -> WorkerId {
        if let Some(id) = self.ids.get(key) {
            return *id;
        }
        let id = self.keys.len() as WorkerId;
        self.keys.push(Some(key.clone()));
        self.ids.insert(key.clone(), id);
        self.capacity.push(default_capacity);
        self.engine.ensure_worker(id);
        id
    }

    fn engine_entries(&self) -> usize {
        self.engine.len()
    }
}

pub(crate) struct State {
    pub tree: Tree,
    pub workers: Workers,
    /// The blocks each stepped [`PrefixIndex::clear`] (or `remove_worker`) dropped, whichever
    /// threads dropped them.
    pub clears: ClearTally,
}

/// Blocks dropped by the stepped clears that a [`PrefixIndex::clear`] or
/// [`PrefixIndex::remove_worker`] call waits on: other threads (a snapshot, a write for the
/// worker) may drop some of the steps, and the call still returns them all.
#[derive(Default)]
pub(crate) struct ClearTally {
    /// Per hidden worker: the waiting call's ticket and the blocks dropped so far.
    running: HashMap<WorkerId, (u64, u64)>,
    /// Per ticket: the blocks a finished clear dropped, until its call collects them.
    done: HashMap<u64, u64>,
    next: u64,
}

impl ClearTally {
    fn open(&mut self, w: WorkerId) -> u64 {
        self.next += 1;
        self.running.insert(w, (self.next, 0));
        self.next
    }

    fn add(&mut self, w: WorkerId, dropped: u64) {
        if let Some((_, total)) = self.running.get_mut(&w) {
            *total += dropped;
        }
    }

    fn close(&mut self, w: WorkerId) {
        if let Some((ticket, total)) = self.running.remove(&w) {
            self.done.insert(ticket, total);
        }
    }

    fn collect(&mut self, ticket: u64) -> u64 {
        self.done.remove(&ticket).unwrap_or(0)
    }
}

/// A concurrent prefix index. Share it between threads by reference or `Arc`.
pub struct PrefixIndex {
    config: IndexConfig,
    state: ReadMostlyLock<State>,
    /// Engine event batches applied, by any caller (the bindings, a native KV-event feed).
    event_batches: std::sync::atomic::AtomicU64,
    /// Blocks evicted by [`PrefixIndex::enforce_bounds`].
    evicted_blocks: std::sync::atomic::AtomicU64,
    /// See [`IndexStats::max_bytes_emptied`].
    max_bytes_emptied: std::sync::atomic::AtomicU64,
    /// See [`IndexStats::replaced_engine_blocks`].
    replaced_engine_blocks: std::sync::atomic::AtomicU64,
}

// The running memory estimate that `max_bytes` is checked against and `stats()` reports: the
// hash tables as allocated, the node array from its length, and per item what
// allocation adds on top of the item (allocator headers, vectors' growth slack, the per-worker
// leaf sets, the child tables of the few nodes with more children than a node holds in place),
// measured on engine-fed and store-fed workloads (`benches/bench_peers_index.py` prints the
// estimate over the measured growth).
const BYTES_PER_BLOCK_EDGE: u64 = 10;
const BYTES_PER_NODE_HEAP: u64 = 32;
const BYTES_PER_HOLDING: u64 = std::mem::size_of::<tree::Holder>() as u64 * 5 / 4 + 14;

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Result<Self, IndexError> {
        config.validate()?;
        Ok(PrefixIndex {
            config,
            state: ReadMostlyLock::new(State {
                tree: Tree::new(),
                workers: Workers::default(),
                clears: ClearTally::default(),
            }),
            event_batches: std::sync::atomic::AtomicU64::new(0),
            evicted_blocks: std::sync::atomic::AtomicU64::new(0),
            max_bytes_emptied: std::sync::atomic::AtomicU64::new(0),
            replaced_engine_blocks: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// The chain seed for prompts of a LoRA adapter and cache salt under this index's model.
    pub fn chain_seed(&self, lora: Option<&str>, cache_salt: Option<&str>) -> u64 {
        hashing::namespace_seed(self.config.seed, self.config.model.as_deref(), lora, cache_salt)
    }

    /// Chained hashes of `tokens` under this index's block size and namespace.
    pub fn hash_tokens<T: TokenId>(
        &self,
        tokens: &[T],
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, IndexError> {
        let seed = self.chain_seed(lora, cache_salt);
        Ok(hashing::chain_hashes(tokens, self.config.block_size, seed)?)
    }

    /// The id of a known worker.
    pub fn worker_id(&self, key: &WorkerKey) -> Option<WorkerId> {
        self.state.read().workers.id(key)
    }

    /// The name of worker `id`, if it is still registered.
    pub fn worker_key(&self, id: WorkerId) -> Option<WorkerKey> {
        self.state.read().workers.keys.get(id as usize).cloned().flatten()
    }

    /// Blocks `worker` holds (0 for an unknown worker): the size of its tree.
    pub fn held_blocks(&self, worker: &WorkerKey) -> u64 {
        let st = self.state.read();
        st.workers.id(worker).filter(|&w| !st.tree.is_hidden(w)).map_or(0, |w| st.tree.held(w))
    }

    /// Registered workers as (id, name).
    pub fn workers(&self) -> Vec<(WorkerId, WorkerKey)> {
        let st = self.state.read();
        let keys = st.workers.keys.iter().enumerate();
        keys.filter_map(|(i, k)| k.clone().map(|k| (i as WorkerId, k))).collect()
    }

    /// Records that `worker` holds `hashes` (a chain after `parent`, or from the root) on `tier`.
    /// Returns the blocks it newly holds.
    pub fn store(
        &self,
        worker: &WorkerKey,
        hashes: &[u64],
        parent: Option<u64>,
        tier: Tier,
    ) -> Result<u64, IndexError> {
        let attrs = Attrs { tiers: tier.bit(), confirmed: true, expires: f64::INFINITY };
        self.store_with(worker, hashes, parent, attrs)
    }

    /// Notes a routing decision: `worker` will soon hold `hashes` (from the root), until `now + ttl`
    /// unless an engine confirms them first.
    pub fn record(
        &self,
        worker: &WorkerKey,
        hashes: &[u64],
        ttl: f64,
        now: f64,
    ) -> Result<u64, IndexError> {
        if !(ttl.is_finite() && ttl > 0.0) {
            return Err(IndexError::InvalidTtl(ttl));
        }
        let attrs = Attrs { tiers: Tier::Gpu.bit(), confirmed: false, expires: now + ttl };
        self.store_with(worker, hashes, None, attrs)
    }

    /// Drops `worker`'s holding of each block (of `tier` only, if given) and, for a block left in
    /// no tier, of everything below it. Every block must be held, or nothing changes.
    pub fn remove(
        &self,
        worker: &WorkerKey,
        hashes: &[u64],
        tier: Option<Tier>,
    ) -> Result<u64, IndexError> {
        let (mut st, w) = self.write_for(worker);
        let w = w.ok_or_else(|| IndexError::UnknownWorker(worker.clone()))?;
        if let Some(&h) = hashes.iter().find(|&&h| !st.tree.holds(w, h)) {
            return Err(IndexError::NotHeld { worker: worker.clone(), hash: h });
        }
        let tiers = tier.map_or(0b111, Tier::bit);
        let mut dropped = 0;
        for &h in hashes {
            dropped += st.tree.remove_tiers(w, h, tiers).1;
        }
        Ok(dropped)
    }

    /// Drops everything `worker` holds; the worker stays registered.
    ///
    /// Matches stop seeing the worker's blocks at once; a worker holding more than
    /// [`CLEAR_STEP`] blocks has them dropped in steps of that many, the lock released between
    /// steps, so that matches wait for one step rather than the whole clear (89 ms for a
    /// million blocks). Writes for this worker from other threads wait for the clear to end.
    /// Returns every block the clear dropped, also those of steps another thread took (a
    /// snapshot, or a write for the worker, finishes a clear under way).
    pub fn clear(&self, worker: &WorkerKey) -> Result<u64, IndexError> {
        let (mut st, w) = self.write_for(worker);
        let w = w.ok_or_else(|| IndexError::UnknownWorker(worker.clone()))?;
        let (dropped, own) = start_clear(&mut st, w);
        self.finish_own_clear(st, own, w, dropped)
    }

    /// Drops everything `worker` holds and forgets the worker (in steps, as [`Self::clear`]).
    pub fn remove_worker(&self, worker: &WorkerKey) -> Result<u64, IndexError> {
        let (mut st, w) = self.write_for(worker);
        let w = w.ok_or_else(|| IndexError::UnknownWorker(worker.clone()))?;
        let (dropped, own) = start_clear(&mut st, w);
        st.workers.keys[w as usize] = None;
        st.workers.ids.remove(worker);
        self.finish_own_clear(st, own, w, dropped)
    }

    /// Ends a [`Self::clear`] or [`Self::remove_worker`] begun by [`start_clear`]: finishes its
    /// steps (with any other thread that helps) and returns all the blocks it dropped.
    fn finish_own_clear(
        &self,
        mut st: WriteGuard<'_, State>,
        own: OwnEntries,
        w: WorkerId,
        dropped: u64,
    ) -> Result<u64, IndexError> {
        if !st.tree.is_hidden(w) {
            drop(st);
            drop(own);
            return Ok(dropped);
        }
        let ticket = st.clears.open(w);
        drop(st);
        drop(own);
        self.finish_clear(w);
        Ok(dropped + self.state.write().clears.collect(ticket))
    }

    /// The write lock, once no clear of `worker` is under way, and the worker's id if it is
    /// registered: a write for a worker being cleared in steps helps finish the clear first, so
    /// that it lands after it.
    fn write_for(&self, worker: &WorkerKey) -> (WriteGuard<'_, State>, Option<WorkerId>) {
        loop {
            let st = self.state.write();
            match st.workers.id(worker) {
                Some(w) if st.tree.is_hidden(w) => {
                    drop(st);
                    self.finish_clear(w);
                }
                id => return (st, id),
            }
        }
    }

    /// Drops hidden worker `w`'s blocks [`CLEAR_STEP`] at a time, handing the lock to waiting
    /// threads between steps, and shows the worker again once it holds nothing. Returns blocks
    /// dropped (by this call: another thread may share the work).
    fn finish_clear(&self, w: WorkerId) -> u64 {
        let mut dropped = 0;
        loop {
            let mut st = self.state.write();
            if !st.tree.is_hidden(w) {
                return dropped;
            }
            let step = st.tree.drop_some(w, CLEAR_STEP);
            st.clears.add(w, step);
            dropped += step;
            if st.tree.held(w) == 0 {
                st.tree.unhide(w);
                st.clears.close(w);
                drop(st);
                self.sweep_engine_map();
                return dropped;
            }
            st.unlock_fair();
            #[cfg(test)]
            BETWEEN_CLEAR_STEPS.with(|hook| {
                if let Some(f) = hook.try_borrow_mut().ok().as_mut().and_then(|h| h.as_mut()) {
                    f(self);
                }
            });
        }
    }

    /// Sweeps the engine-hash map of entries left behind by dropped blocks, a step at a time,
    /// handing the lock to waiting threads between steps.
    fn sweep_engine_map(&self) {
        loop {
            let mut guard = self.state.write();
            let st = &mut *guard;
            if !st.workers.engine.sweep_step(&st.tree) {
                return;
            }
            guard.unlock_fair();
        }
    }

    /// Finishes every clear under way (for a snapshot, which must not see a half-cleared
    /// worker).
    fn finish_clears(&self) {
        loop {
            let hidden = self.state.read().tree.hidden_workers();
            if hidden.is_empty() {
                return;
            }
            for w in hidden {
                self.finish_clear(w);
            }
        }
    }

    /// Sets (or lifts, with None) a worker's capacity in blocks, evicting at once if over it.
    pub fn set_capacity(&self, worker: &WorkerKey, blocks: Option<u64>) -> Result<u64, IndexError> {
        if blocks == Some(0) {
            return Err(IndexError::InvalidConfig("capacity must be at least 1 block".into()));
        }
        let (mut st, _) = self.write_for(worker);
        let w = st.workers.intern(worker, self.config.worker_capacity);
        st.workers.capacity[w as usize] = blocks;
        Ok(self.enforce_bounds(&mut st, w))
    }

    /// Leading blocks of `hashes` held by each worker (approximate holdings expired at `now` do
    /// not count).
    pub fn match_hashes(&self, hashes: &[u64], now: f64) -> MatchResult {
        let mut out = MatchResult::pooled(hashes.len());
        self.match_into(hashes, now, &mut out);
        out
    }

    /// Like [`Self::match_hashes`], reusing `out`'s allocation.
    pub fn match_into(&self, hashes: &[u64], now: f64, out: &mut MatchResult) {
        let st = self.state.read();
        out.query_blocks = hashes.len();
        out.tree_blocks = st.tree.match_hashes(hashes, now, &mut out.entries);
    }

    /// Hashes `tokens` and matches them.
    pub fn match_tokens<T: TokenId>(
        &self,
        tokens: &[T],
        lora: Option<&str>,
        cache_salt: Option<&str>,
        now: f64,
    ) -> Result<MatchResult, IndexError> {
        let hashes = self.hash_tokens(tokens, lora, cache_salt)?;
        Ok(self.match_hashes(&hashes, now))
    }

    /// Decodes a vLLM `EventBatch` payload and applies it for `worker` atomically; a batch
    /// that clears a worker of more than [`CLEAR_STEP`] blocks applies in two steps, the
    /// events up to the clear, then (once the cleared blocks are dropped, see [`Self::clear`])
    /// the rest.
    pub fn apply_vllm_events(
        &self,
        worker: &WorkerKey,
        payload: &[u8],
    ) -> Result<ApplyReport, IndexError> {
        let batch = crate::vllm_events::decode_event_batch(payload)?;
        Ok(self.apply_event_batch(worker, batch))
    }

    /// [`Self::apply_vllm_events`] for a batch already decoded (the bindings decode first, to
    /// see whether the batch clears a worker in steps before choosing how to call this).
    pub fn apply_event_batch(&self, worker: &WorkerKey, batch: EventBatch) -> ApplyReport {
        let mut report = ApplyReport {
            events: batch.events.len() as u64,
            unknown_events: u64::from(batch.unknown_events),
            ..Default::default()
        };
        let mut from = 0;
        loop {
            let (mut guard, id) = self.write_for(worker);
            let w = match id {
                Some(w) => w,
                None => guard.workers.intern(worker, self.config.worker_capacity),
            };
            // A worker registered by `set_capacity` has no tree state yet.
            guard.tree.ensure_worker(w);
            let paused =
                events::apply_events(self, &mut guard, w, &batch.events[from..], &mut report);
            self.enforce_bounds(&mut guard, w);
            // One step of the sweep per batch: the work of a sweep is spread over the batches.
            let st = &mut *guard;
            st.workers.engine.sweep_step(&st.tree);
            drop(guard);
            let Some((applied, own)) = paused else { break };
            drop(own);
            self.finish_clear(w);
            from += applied;
        }
        crate::vllm_events::recycle(batch);
        self.event_batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if report.replaced > 0 {
            let replaced = &self.replaced_engine_blocks;
            replaced.fetch_add(report.replaced, std::sync::atomic::Ordering::Relaxed);
        }
        report
    }

    /// Whether applying `batch` for `worker` clears a worker of more than [`CLEAR_STEP`]
    /// blocks, in steps: a caller holding another lock that matches wait on (Python's)
    /// releases it for such a call.
    pub fn clears_in_steps(&self, worker: &WorkerKey, batch: &EventBatch) -> bool {
        batch.events.iter().any(|e| matches!(e, KvEvent::AllCleared))
            && self.held_blocks(worker) > CLEAR_STEP
    }

    /// Engine event batches applied so far ([`PrefixIndex::apply_vllm_events`] calls that
    /// decoded).
    pub fn event_batches(&self) -> u64 {
        self.event_batches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`IndexStats::max_bytes_emptied`] alone (one atomic load: the bindings check it after
    /// each store to warn once of a cap too small to hold a block).
    pub fn max_bytes_emptied(&self) -> u64 {
        self.max_bytes_emptied.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every block `worker` holds: (hash, tier bits, confirmed), sorted by hash.
    pub fn holdings(&self, worker: &WorkerKey) -> Result<Vec<(u64, u8, bool)>, IndexError> {
        let st = self.state.read();
        let w = st.workers.id(worker).ok_or_else(|| IndexError::UnknownWorker(worker.clone()))?;
        if st.tree.is_hidden(w) {
            return Ok(Vec::new());
        }
        Ok(st.tree.holdings(w))
    }

    /// Drops approximate holdings that expired at `now`. Returns blocks dropped.
    pub fn expire(&self, now: f64) -> u64 {
        self.state.write().tree.expire(now)
    }

    /// Counts and an estimate of the bytes used.
    pub fn stats(&self) -> IndexStats {
        let st = self.state.read();
        let live = st.workers.keys.iter().enumerate().filter(|(_, k)| k.is_some());
        IndexStats {
            workers: st.workers.ids.len(),
            nodes: st.tree.live_nodes(),
            blocks: st.tree.blocks.len(),
            holdings: st.tree.holder_count,
            worker_blocks: live
                .map(|(i, _)| i as WorkerId)
                .map(|w| (w, if st.tree.is_hidden(w) { 0 } else { st.tree.held(w) }))
                .collect(),
            engine_blocks: st.workers.engine_entries(),
            bytes: estimated_bytes(&st),
            evicted_blocks: self.evicted_blocks.load(std::sync::atomic::Ordering::Relaxed),
            max_bytes_emptied: self.max_bytes_emptied(),
            replaced_engine_blocks: self
                .replaced_engine_blocks
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// A digest of how this index hashes prompts (its block size, seed and model): two
    /// indexes with the same one compute the same block hashes for the same tokens, so the
    /// records one shares (replica sync) can match in the other.
    pub fn hashing_fingerprint(&self) -> u64 {
        let mut bytes = Vec::with_capacity(24);
        bytes.extend_from_slice(&(self.config.block_size as u64).to_le_bytes());
        bytes.extend_from_slice(&self.config.seed.to_le_bytes());
        if let Some(model) = &self.config.model {
            bytes.extend_from_slice(model.as_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }

    /// Serialises the index. Approximate holdings keep their remaining lifetime relative to `now`.
    pub fn dumps(&self, now: f64) -> Vec<u8> {
        loop {
            self.finish_clears();
            let st = self.state.read();
            if st.tree.hidden_workers().is_empty() {
                return snapshot::dump(&self.config, &st, now);
            }
        }
    }

    /// Rebuilds an index from [`Self::dumps`] output, on a clock that reads `now`. Its counters
    /// ([`IndexStats`]' `evicted_blocks` and after, [`Self::event_batches`]) start from 0: they
    /// count what one index object saw, and a snapshot holds content only.
    pub fn loads(data: &[u8], now: f64) -> Result<Self, IndexError> {
        let (config, state) = snapshot::load(data, now)?;
        Ok(PrefixIndex {
            config,
            state: ReadMostlyLock::new(state),
            event_batches: std::sync::atomic::AtomicU64::new(0),
            evicted_blocks: std::sync::atomic::AtomicU64::new(0),
            max_bytes_emptied: std::sync::atomic::AtomicU64::new(0),
            replaced_engine_blocks: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Stores under the write lock; a new worker is registered only when the store succeeds.
    fn store_with(
        &self,
        worker: &WorkerKey,
        hashes: &[u64],
        parent: Option<u64>,
        attrs: Attrs,
    ) -> Result<u64, IndexError> {
        // A routing decision recorded for a worker being cleared in steps is dropped rather
        // than made to wait for the clear (the routing path must not): the hint is lost, and
        // the worker's engine reports the blocks once it holds them.
        let (mut st, id) = if attrs.confirmed {
            self.write_for(worker)
        } else {
            let st = self.state.write();
            let id = st.workers.id(worker);
            (st, id)
        };
        let w = id.unwrap_or(st.workers.keys.len() as WorkerId);
        if st.tree.is_hidden(w) {
            return Ok(0);
        }
        let added = st.tree.store(w, hashes, parent, attrs).map_err(|r| refusal(r, worker))?;
        st.workers.intern(worker, self.config.worker_capacity);
        st.tree.ensure_worker(w);
        self.enforce_bounds(&mut st, w);
        Ok(added)
    }

    /// Evicts for `w`'s capacity, then for the global memory cap. Returns blocks evicted.
    fn enforce_bounds(&self, st: &mut State, w: WorkerId) -> u64 {
        let mut evicted = 0;
        if let Some(cap) = st.workers.capacity.get(w as usize).copied().flatten() {
            evicted += st.tree.evict_to(w, cap);
        }
        if let Some(max) = self.config.max_bytes.filter(|&max| estimated_bytes(st) > max) {
            // The hash tables grow by doubling and never shrink: one whose last doubling took
            // it past the cap cannot be brought under it by evicting blocks (every block was
            // evicted, and the cap still not met). Evict until what is left fits with the
            // tables rebuilt for it, then rebuild them.
            let mut by_cap = 0;
            while fitted_bytes(st) > max {
                let Some(oldest) = oldest_worker(&st.tree) else { break };
                by_cap += st.tree.evict_oldest_leaf(oldest, u64::MAX);
            }
            evicted += by_cap;
            if by_cap > 0 && st.tree.blocks.len() == 0 {
                // Not one block fits under the cap: every store is evicted at once.
                self.max_bytes_emptied.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let tree = &mut st.tree;
            tree.blocks.fit(&tree.nodes);
            st.workers.engine.fit();
        }
        if evicted > 0 {
            self.evicted_blocks.fetch_add(evicted, std::sync::atomic::Ordering::Relaxed);
        }
        evicted
    }
}

/// Blocks a clear drops under one hold of the write lock (about 0.3-0.4 ms on the development
/// machine); a worker holding more is cleared in steps (see [`PrefixIndex::clear`]).
#[cfg(not(test))]
pub const CLEAR_STEP: u64 = 4096;
/// Small in tests, so that the model tests' clears go through the steps.
#[cfg(test)]
pub const CLEAR_STEP: u64 = 3;

/// A test's look at an index between two steps of a clear.
#[cfg(test)]
pub(crate) type StepHook = Box<dyn FnMut(&PrefixIndex)>;

#[cfg(test)]
thread_local! {
    /// Called by [`PrefixIndex::finish_clear`], on its thread, between two steps (the lock
    /// released): tests look at the index half cleared there.
    pub(crate) static BETWEEN_CLEAR_STEPS: std::cell::RefCell<Option<StepHook>> =
        const { std::cell::RefCell::new(None) };
}

/// Starts clearing `w`: at once when it holds at most [`CLEAR_STEP`] blocks, else by hiding it
/// from matches for [`PrefixIndex::finish_clear`]. Returns the blocks dropped now and the
/// worker's engine-hash entries, to be freed after the lock is released.
fn start_clear(st: &mut State, w: WorkerId) -> (u64, OwnEntries) {
    let own = st.workers.engine.take_worker(w);
    if st.tree.held(w) <= CLEAR_STEP {
        return (st.tree.clear_worker(w), own);
    }
    st.tree.hide(w);
    (0, own)
}

fn refusal(r: StoreRefusal, worker: &WorkerKey) -> IndexError {
    match r {
        StoreRefusal::UnknownParent(h) => IndexError::UnknownParent(h),
        StoreRefusal::ParentNotHeld(h) => {
            IndexError::ParentNotHeld { worker: worker.clone(), hash: h }
        }
        StoreRefusal::Conflict(h) => IndexError::Conflict(h),
    }
}

/// The worker whose least recently used leaf is the oldest of all.
fn oldest_worker(tree: &Tree) -> Option<WorkerId> {
    (0..tree.workers.len() as WorkerId)
        .filter_map(|w| tree.oldest_leaf_stamp(w).map(|s| (s, w)))
        .min()
        .map(|(_, w)| w)
}

/// [`estimated_bytes`] with the hash tables rebuilt for what they hold.
fn fitted_bytes(st: &State) -> u64 {
    let (blocks, engine) = (&st.tree.blocks, &st.workers.engine);
    estimated_bytes(st) - blocks.bytes() - engine.bytes()
        + blocks.fitted_bytes()
        + engine.fitted_bytes()
}

fn estimated_bytes(st: &State) -> u64 {
    let t = &st.tree;
    t.blocks.bytes()
        + (t.live_nodes() * std::mem::size_of::<tree::Node>() * 5 / 4) as u64
        + t.blocks.len() as u64 * BYTES_PER_BLOCK_EDGE
        + t.live_nodes() as u64 * BYTES_PER_NODE_HEAP
        + t.holder_count as u64 * BYTES_PER_HOLDING
        + st.workers.engine.bytes()
}

#[cfg(test)]
mod clear_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod replace_tests;
