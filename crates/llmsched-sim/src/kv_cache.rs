//! One simulated replica's paged KV cache with prefix caching (vLLM V1's block pool, simplified).
//!
//! Semantics (the pure-Python twin `llmsched.reference.sim_kv` states them at length):
//! - `num_blocks` blocks; a block is in use (references > 0) or free. A free block may keep its
//!   content hash (cached) and be hit again until it is reused.
//! - Free blocks wait in one queue, least recently freed first; a request's blocks are freed
//!   last block first so chains are evicted tail first; free blocks without a hash go to the
//!   front. Allocation pops the front, evicting the popped block's hash.
//! - `commit` hashes a request's full blocks; if the hash is already cached by another block the
//!   request shares that block and releases its copy, so cached chains stay prefix-closed (a
//!   block is never evicted before its cached descendants).
//!
//! Algorithm / complexity: [`KvCore`] names contents by dense ids (0, 1, 2, ... assigned once
//! per workload plan, see `Plan::content_ids`), so "which block holds this content" is an array
//! slot, not a hash-map probe: the free queue is a ring of (block, push number) entries, a
//! block taken back out of it (a prefix hit on a cached free block) leaving its entry behind
//! as stale (its push number no longer the block's, or the block in use) for the pop or a
//! compaction to skip (O(1) amortised push, pop and removal); a content-id -> block array,
//! per-request block vectors. Unlike a linked list, popping does not chase pointers from block
//! to block: the next blocks to pop are known from the ring and fetched ahead, so a long
//! allocation's cache misses overlap. Every operation costs O(blocks it touches) with no
//! hashing; `decode_capacity` bisects over steps, O(R log k)
//! for R decoding requests. [`KvCache`] is the same cache addressed by 64-bit content hashes
//! (the Python engine's), interning each hash to an id on first sight.
//!
//! Events: `Stored { parent, hashes }` for each run of newly cached blocks, `Removed { hashes }`
//! for each run of evictions, reduced to the roots of the evicted subtrees (a prefix index that
//! drops a block drops everything below it, and every descendant of an evicted block has
//! already been evicted).

use std::collections::VecDeque;
use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::{HashMap, HashSet};
use thiserror::Error;

/// Content hashes are already uniformly distributed (xxh3 chains), so the interner uses them
/// as they are instead of hashing them again.
#[derive(Default, Clone, Copy)]
pub struct ContentHasher(u64);

impl Hasher for ContentHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A map keyed by content hash.
pub type ByContent<V> = HashMap<u64, V, BuildHasherDefault<ContentHasher>>;

/// The most blocks one simulated replica's cache may have: about 20 bytes each are allocated up
/// front, so the bound keeps a mistaken size from exhausting memory (an H200 serving an 8B
/// model holds about a million 16-token blocks).
pub const MAX_KV_BLOCKS: u32 = 1 << 24;

/// Errors from KV-cache operations; nothing changes when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    #[error(
        "num_blocks must be 1 to {MAX_KV_BLOCKS} and block_size 1 to {} tokens",
        llmsched_core::hashing::MAX_BLOCK_SIZE
    )]
    InvalidConfig,
    #[error("request {0} holds no blocks")]
    UnknownRequest(u64),
    #[error("request {0} is already started")]
    DuplicateRequest(u64),
}

/// A change to the set of cached blocks, in the order it happened, contents named by hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks newly cached, a chain continuing after `parent` (None: from the root).
    Stored { parent: Option<u64>, hashes: Vec<u64> },
    /// Cached blocks evicted (roots of the evicted subtrees only).
    Removed { hashes: Vec<u64> },
}

/// [`KvEvent`] with contents named by id (what [`KvCore`] reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdEvent {
    Stored { parent: Option<u32>, ids: Vec<u32> },
    Removed { ids: Vec<u32> },
}

/// How many blocks ahead the walks over a request's blocks ask for the next block's cache line:
/// blocks are visited in an order unrelated to memory, so each is otherwise a cache miss.
const PREFETCH_AHEAD: usize = 8;

/// Asks the CPU to load `value`'s cache line (a hint: no effect on results).
#[inline(always)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults or writes; the pointer comes from a live reference.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// No content / no parent / no block.
const NONE: u32 = u32::MAX;

/// An event as recorded: removals keep each block's parent until they are reduced.
#[derive(Debug, Clone)]
enum Pending {
    Stored { parent: Option<u32>, ids: Vec<u32> },
    Removed(Vec<(u32, u32)>),
}

/// 16 bytes: the free queue pops blocks in an order unrelated to memory, so every block
/// touched is a cache miss and a smaller block is a faster cache.
#[derive(Debug, Clone)]
struct Block {
    /// Content id, NONE when the block holds no cached content.
    content: u32,
    /// Parent's content id, NONE for a chain's first block.
    parent: u32,
    refs: u32,
    /// The push number of the block's current free-queue entry (meaningful while refs is 0).
    queued: u32,
}

/// A free-queue entry: block `block`, pushed as push number `push`. It is live while the block
/// is free and `push` is still the block's `queued`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    block: u32,
    push: u32,
}

#[derive(Debug, Clone, Default)]
struct Request {
    blocks: Vec<u32>,
    tokens: u64,
    committed: usize,
    decoding: bool,
}

/// One replica's KV cache, contents named by dense ids.
#[derive(Debug, Clone)]
pub struct KvCore {
    block_size: u64,
    blocks: Vec<Block>,
    /// Free blocks, least recently freed first, with stale entries in between (see the
    /// module docs); `free_len` counts the live ones.
    queue: VecDeque<Entry>,
    /// Pushes so far (wrapping; the queue is compacted when it wraps, so a stale entry can
    /// never match its block's push number again).
    pushes: u32,
    free_len: usize,
    /// Content id -> 1 + the block caching it (0: not cached); grows on demand. Zero means
    /// empty so that a large table starts as untouched zero pages: a replica writes only the
    /// pages of the contents it caches, not a table as long as the whole plan.
    block_of: Vec<u32>,
    cached_len: usize,
    requests: HashMap<u64, Request>,
    events: Vec<Pending>,
    /// Scratch for reducing removals (see [`removal_roots`]): the contents of the batch being
    /// reduced (a set the size of one batch, not a table as long as the plan: that table's
    /// pages, one per replica, were written all over a long trace).
    gone: HashSet<u32>,
    /// Vectors of finished requests and reduced removal batches, reused: each request's block
    /// list and each batch's list grew from empty (with the event feed's buffer, 3% of the
    /// engine's instructions on a long trace).
    spare_blocks: Vec<Vec<u32>>,
    spare_removed: Vec<(u32, u32)>,
}

/// The most block lists a cache keeps for reuse (a few KiB each).
const SPARE_BLOCK_LISTS: usize = 64;

impl KvCore {
    /// An empty cache of `num_blocks` blocks of `block_size` tokens, all free; `contents` is
    /// a size hint for the number of distinct content ids.
    pub fn new(num_blocks: u32, block_size: u32, contents: usize) -> Result<Self, KvError> {
        let block_size_ok =
            (1..=llmsched_core::hashing::MAX_BLOCK_SIZE).contains(&(block_size as usize));
        if num_blocks == 0 || num_blocks > MAX_KV_BLOCKS || !block_size_ok {
            return Err(KvError::InvalidConfig);
        }
        let n = num_blocks as usize;
        let blocks = (0..n)
            .map(|i| Block { content: NONE, parent: NONE, refs: 0, queued: i as u32 })
            .collect::<Vec<_>>();
        let queue = (0..num_blocks).map(|b| Entry { block: b, push: b }).collect();
        Ok(KvCore {
            block_size: u64::from(block_size),
            blocks,
            queue,
            pushes: num_blocks,
            free_len: n,
            block_of: vec![0; contents],
            cached_len: 0,
            requests: HashMap::new(),
            events: Vec::new(),
            gone: HashSet::new(),
            spare_blocks: Vec::new(),
            spare_removed: Vec::new(),
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Blocks not in use (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free_len
    }

    /// Blocks with a content.
    pub fn cached_blocks(&self) -> usize {
        self.cached_len
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        1.0 - self.free_len as f64 / self.num_blocks() as f64
    }

    /// Requests holding blocks.
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    fn cached(&self, id: u32) -> Option<u32> {
        self.block_of.get(id as usize).copied().filter(|&b| b != 0).map(|b| b - 1)
    }

    /// Leading contents of `ids` that are cached, at most `max_blocks`.
    pub fn lookup(&self, ids: &[u32], max_blocks: usize) -> usize {
        ids.iter().take(max_blocks).take_while(|&&id| self.cached(id).is_some()).count()
    }

    pub fn tokens_of(&self, req: u64) -> Result<u64, KvError> {
        Ok(self.get(req)?.tokens)
    }

    pub fn blocks_of(&self, req: u64) -> Result<usize, KvError> {
        Ok(self.get(req)?.blocks.len())
    }

    /// Registers `req` and takes references on its cached prefix; returns the blocks hit.
    pub fn start(&mut self, req: u64, ids: &[u32], max_blocks: usize) -> Result<usize, KvError> {
        if self.requests.contains_key(&req) {
            return Err(KvError::DuplicateRequest(req));
        }
        let mut state =
            Request { blocks: self.spare_blocks.pop().unwrap_or_default(), ..Request::default() };
        state.blocks.reserve(ids.len());
        for (i, &id) in ids.iter().take(max_blocks).enumerate() {
            if let Some(ahead) = ids.get(i + PREFETCH_AHEAD).and_then(|&a| self.cached(a)) {
                prefetch(&self.blocks[ahead as usize]);
            }
            let Some(block) = self.cached(id) else { break };
            self.take_ref(block);
            state.blocks.push(block);
        }
        let hit = state.blocks.len();
        state.tokens = hit as u64 * self.block_size;
        state.committed = hit;
        self.requests.insert(req, state);
        Ok(hit)
    }

    /// Gives `req` room for `tokens` tokens; Ok(false), changing nothing, if blocks run out.
    pub fn allocate(&mut self, req: u64, tokens: u64) -> Result<bool, KvError> {
        let have = self.get(req)?.blocks.len();
        let need = (tokens.div_ceil(self.block_size) as usize).saturating_sub(have);
        if need > self.free_len {
            return Ok(false);
        }
        let mut state = self.requests.remove(&req).expect("checked above");
        state.blocks.reserve(need);
        for _ in 0..need {
            state.blocks.push(self.pop_free());
        }
        state.tokens = state.tokens.max(tokens);
        self.requests.insert(req, state);
        Ok(true)
    }

    /// Caches `req`'s full blocks `[committed, upto)` under `ids`.
    pub fn commit(&mut self, req: u64, ids: &[u32], upto: usize) -> Result<(), KvError> {
        let mut state = self.requests.remove(&req).ok_or(KvError::UnknownRequest(req))?;
        let full = (state.tokens / self.block_size) as usize;
        let stop = upto.min(state.blocks.len()).min(ids.len()).min(full);
        if let Some(&top) = ids[..stop].iter().max() {
            if top as usize >= self.block_of.len() {
                self.block_of.resize(top as usize + 1, 0);
            }
        }
        // Most commits cache every block they cover as one run: sized once, not grown.
        let mut run: Vec<u32> = Vec::with_capacity(stop.saturating_sub(state.committed));
        let mut run_parent = None;
        for i in state.committed..stop {
            let id = ids[i];
            let parent = if i > 0 { ids[i - 1] } else { NONE };
            let mine = state.blocks[i];
            let other = self.block_of[id as usize].wrapping_sub(1); // NONE when not cached
            if other == NONE {
                self.block_of[id as usize] = mine + 1;
                self.cached_len += 1;
                if run.is_empty() {
                    run_parent = (parent != NONE).then_some(parent);
                }
                let block = &mut self.blocks[mine as usize];
                block.content = id;
                block.parent = parent;
                run.push(id);
            } else if other != mine {
                self.flush_stored(run_parent, &mut run);
                self.take_ref(other);
                self.drop_ref(mine);
                state.blocks[i] = other;
            }
        }
        self.flush_stored(run_parent, &mut run);
        state.committed = state.committed.max(stop);
        self.requests.insert(req, state);
        Ok(())
    }

    /// Drops `req`'s references, last block first.
    pub fn free(&mut self, req: u64) -> Result<(), KvError> {
        let state = self.requests.remove(&req).ok_or(KvError::UnknownRequest(req))?;
        let blocks = &state.blocks;
        for i in (0..blocks.len()).rev() {
            if let Some(&ahead) = i.checked_sub(PREFETCH_AHEAD).and_then(|j| blocks.get(j)) {
                prefetch(&self.blocks[ahead as usize]);
            }
            self.drop_ref(blocks[i]);
        }
        if self.spare_blocks.len() < SPARE_BLOCK_LISTS {
            let mut blocks = state.blocks;
            blocks.clear();
            self.spare_blocks.push(blocks);
        }
        Ok(())
    }

    /// Marks `req` as growing one token per decode step (or not).
    pub fn set_decoding(&mut self, req: u64, decoding: bool) -> Result<(), KvError> {
        self.requests.get_mut(&req).ok_or(KvError::UnknownRequest(req))?.decoding = decoding;
        Ok(())
    }

    fn decode_need(&self, steps: u64) -> usize {
        self.requests
            .values()
            .filter(|s| s.decoding)
            .map(|s| {
                ((s.tokens + steps).div_ceil(self.block_size) as usize)
                    .saturating_sub(s.blocks.len())
            })
            .sum()
    }

    /// The most decode steps, at most `limit`, whose new blocks fit in the free blocks.
    pub fn decode_capacity(&self, limit: u64) -> u64 {
        let (mut lo, mut hi) = (0u64, limit);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.decode_need(mid) <= self.free_len {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Grows every decoding request by `steps` tokens; false, changing nothing, if it does not fit.
    pub fn advance_decoding(&mut self, steps: u64) -> bool {
        if self.decode_need(steps) > self.free_len {
            return false;
        }
        let ids: Vec<u64> =
            self.requests.iter().filter(|(_, s)| s.decoding).map(|(&id, _)| id).collect();
        for id in ids {
            let mut s = self.requests.remove(&id).expect("collected above");
            s.tokens += steps;
            let need = (s.tokens.div_ceil(self.block_size) as usize).saturating_sub(s.blocks.len());
            for _ in 0..need {
                s.blocks.push(self.pop_free());
            }
            self.requests.insert(id, s);
        }
        true
    }

    /// The events since the last call, in order; removals reduced to subtree roots.
    pub fn take_events(&mut self) -> Vec<IdEvent> {
        let events = std::mem::take(&mut self.events);
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            match event {
                Pending::Stored { parent, ids } => out.push(IdEvent::Stored { parent, ids }),
                Pending::Removed(mut removed) => {
                    let ids = removal_roots(&removed, &mut self.gone);
                    out.push(IdEvent::Removed { ids });
                    if removed.capacity() > self.spare_removed.capacity() {
                        removed.clear();
                        self.spare_removed = removed;
                    }
                }
            }
        }
        out
    }

    // ---- internals -----------------------------------------------------------------------

    fn get(&self, req: u64) -> Result<&Request, KvError> {
        self.requests.get(&req).ok_or(KvError::UnknownRequest(req))
    }

    fn is_live(&self, e: Entry) -> bool {
        let block = &self.blocks[e.block as usize];
        block.refs == 0 && block.queued == e.push
    }

    /// Queues free block `b` at the back (cached content, evicted last) or the front (none).
    fn push_free(&mut self, b: u32, back: bool) {
        if self.pushes == u32::MAX {
            // Before the push numbers wrap: only live entries stay, so none can match again.
            self.compact();
            self.pushes = 0;
        }
        self.pushes += 1;
        self.blocks[b as usize].queued = self.pushes;
        let entry = Entry { block: b, push: self.pushes };
        if back {
            self.queue.push_back(entry);
        } else {
            self.queue.push_front(entry);
        }
        self.free_len += 1;
        // Blocks taken back out of the queue leave stale entries: bound them by the live ones.
        if self.queue.len() > 2 * self.free_len + 1024 {
            self.compact();
        }
    }

    /// Drops the stale entries, keeping the live ones in order.
    fn compact(&mut self) {
        let mut queue = std::mem::take(&mut self.queue);
        queue.retain(|&e| self.is_live(e));
        self.queue = queue;
    }

    fn take_ref(&mut self, b: u32) {
        let block = &mut self.blocks[b as usize];
        if block.refs == 0 {
            // Its queue entry goes stale (the block is in use).
            self.free_len -= 1;
        }
        block.refs += 1;
    }

    fn drop_ref(&mut self, b: u32) {
        let block = &mut self.blocks[b as usize];
        block.refs -= 1;
        if block.refs == 0 {
            let back = block.content != NONE;
            self.push_free(b, back);
        }
    }

    /// Pops the least recently freed block (the caller checked one is free), evicting its content.
    fn pop_free(&mut self) -> u32 {
        let b = loop {
            let e = self.queue.pop_front().expect("the caller checked a block is free");
            // The blocks a few pops ahead, and the content slots of nearer ones (their blocks
            // already fetched), so that a long allocation's misses overlap.
            if let Some(ahead) = self.queue.get(PREFETCH_AHEAD) {
                prefetch(&self.blocks[ahead.block as usize]);
            }
            if let Some(near) = self.queue.get(PREFETCH_AHEAD / 2) {
                let content = self.blocks[near.block as usize].content;
                if let Some(slot) = self.block_of.get(content as usize) {
                    prefetch(slot);
                }
            }
            if self.is_live(e) {
                break e.block;
            }
        };
        self.free_len -= 1;
        let block = &mut self.blocks[b as usize];
        block.refs = 1;
        let (content, parent) = (block.content, block.parent);
        if content != NONE {
            block.content = NONE;
            block.parent = NONE;
            self.block_of[content as usize] = 0;
            self.cached_len -= 1;
            self.push_removed(content, parent);
        }
        b
    }

    fn push_removed(&mut self, id: u32, parent: u32) {
        match self.events.last_mut() {
            Some(Pending::Removed(removed)) => removed.push((id, parent)),
            _ => {
                let mut removed = std::mem::take(&mut self.spare_removed);
                removed.push((id, parent));
                self.events.push(Pending::Removed(removed));
            }
        }
    }

    fn flush_stored(&mut self, parent: Option<u32>, run: &mut Vec<u32>) {
        if !run.is_empty() {
            self.events.push(Pending::Stored { parent, ids: std::mem::take(run) });
        }
    }
}

/// The ids of `removed` (evicted contents and their parents, in eviction order) whose parent is
/// not evicted with them: the roots of the evicted subtrees.
///
/// A chain is evicted tail first, so an evicted block's parent, when it goes too, is nearly
/// always the next entry. Only the others (each chain's first evicted block, usually) are
/// looked for among the rest: by a scan while there are few, else in `set` (filled with the
/// batch's ids once). Hashing every id of every batch into a set was 12% of the engine's
/// instructions on a long trace.
fn removal_roots(removed: &[(u32, u32)], set: &mut HashSet<u32>) -> Vec<u32> {
    const SCAN_MAX: usize = 1 << 14;
    let parent_next = |i: usize| removed.get(i + 1).is_some_and(|&(next, _)| next == removed[i].1);
    let unsure = (0..removed.len()).filter(|&i| removed[i].1 != NONE && !parent_next(i)).count();
    let by_set = unsure * removed.len() > SCAN_MAX;
    if by_set {
        set.clear();
        set.extend(removed.iter().map(|&(id, _)| id));
    }
    let evicted = |p: u32| {
        if by_set {
            set.contains(&p)
        } else {
            removed.iter().any(|&(id, _)| id == p)
        }
    };
    let mut roots = Vec::with_capacity(unsure + 1);
    for (i, &(id, parent)) in removed.iter().enumerate() {
        if parent == NONE || !(parent_next(i) || evicted(parent)) {
            roots.push(id);
        }
    }
    roots
}

/// One replica's KV cache addressed by 64-bit content hashes: a [`KvCore`] plus an interner
/// that numbers each hash on first sight (numbers are never reused, so memory grows with the
/// distinct hashes seen).
#[derive(Debug, Clone)]
pub struct KvCache {
    core: KvCore,
    ids: ByContent<u32>,
    hashes: Vec<u64>,
}

impl KvCache {
    /// An empty cache of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: u32, block_size: u32) -> Result<Self, KvError> {
        Ok(KvCache {
            core: KvCore::new(num_blocks, block_size, 0)?,
            ids: ByContent::default(),
            hashes: Vec::new(),
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.core.num_blocks()
    }

    pub fn block_size(&self) -> u64 {
        self.core.block_size()
    }

    /// Blocks not in use (cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.core.free_blocks()
    }

    /// Blocks with a content hash.
    pub fn cached_blocks(&self) -> usize {
        self.core.cached_blocks()
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        self.core.usage()
    }

    /// Requests holding blocks.
    pub fn requests(&self) -> usize {
        self.core.requests()
    }

    /// The ids of the leading hashes already numbered, at most `max_blocks` (a hash never
    /// seen is not cached, so a lookup may stop there).
    fn known(&self, hashes: &[u64], max_blocks: usize) -> Vec<u32> {
        hashes.iter().take(max_blocks).map_while(|h| self.ids.get(h).copied()).collect()
    }

    /// Leading blocks of `hashes` that are cached, at most `max_blocks`.
    pub fn lookup(&self, hashes: &[u64], max_blocks: usize) -> usize {
        self.core.lookup(&self.known(hashes, max_blocks), max_blocks)
    }

    pub fn tokens_of(&self, req: u64) -> Result<u64, KvError> {
        self.core.tokens_of(req)
    }

    pub fn blocks_of(&self, req: u64) -> Result<usize, KvError> {
        self.core.blocks_of(req)
    }

    /// Registers `req` and takes references on its cached prefix; returns the blocks hit.
    pub fn start(&mut self, req: u64, hashes: &[u64], max_blocks: usize) -> Result<usize, KvError> {
        let ids = self.known(hashes, max_blocks);
        self.core.start(req, &ids, max_blocks)
    }

    /// Gives `req` room for `tokens` tokens; Ok(false), changing nothing, if blocks run out.
    pub fn allocate(&mut self, req: u64, tokens: u64) -> Result<bool, KvError> {
        self.core.allocate(req, tokens)
    }

    /// Caches `req`'s full blocks `[committed, upto)` under `hashes`.
    pub fn commit(&mut self, req: u64, hashes: &[u64], upto: usize) -> Result<(), KvError> {
        self.core.get(req)?;
        let ids: Vec<u32> = hashes.iter().take(upto).map(|&h| self.intern(h)).collect();
        self.core.commit(req, &ids, upto)
    }

    /// Drops `req`'s references, last block first.
    pub fn free(&mut self, req: u64) -> Result<(), KvError> {
        self.core.free(req)
    }

    /// Marks `req` as growing one token per decode step (or not).
    pub fn set_decoding(&mut self, req: u64, decoding: bool) -> Result<(), KvError> {
        self.core.set_decoding(req, decoding)
    }

    /// The most decode steps, at most `limit`, whose new blocks fit in the free blocks.
    pub fn decode_capacity(&self, limit: u64) -> u64 {
        self.core.decode_capacity(limit)
    }

    /// Grows every decoding request by `steps` tokens; false, changing nothing, if it does not fit.
    pub fn advance_decoding(&mut self, steps: u64) -> bool {
        self.core.advance_decoding(steps)
    }

    /// The events since the last call, in order; removals reduced to subtree roots.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let hash = |id: u32| self.hashes[id as usize];
        self.core
            .take_events()
            .into_iter()
            .map(|event| match event {
                IdEvent::Stored { parent, ids } => KvEvent::Stored {
                    parent: parent.map(hash),
                    hashes: ids.into_iter().map(hash).collect(),
                },
                IdEvent::Removed { ids } => {
                    KvEvent::Removed { hashes: ids.into_iter().map(hash).collect() }
                }
            })
            .collect()
    }

    fn intern(&mut self, hash: u64) -> u32 {
        let next = self.hashes.len() as u32;
        let id = *self.ids.entry(hash).or_insert(next);
        if id == next {
            self.hashes.push(hash);
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn removed(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::Removed { hashes } => hashes.clone(),
                KvEvent::Stored { .. } => Vec::new(),
            })
            .collect()
    }

    /// Fills `req` with `chain`, caches it and frees it.
    fn cache_chain(kv: &mut KvCache, req: u64, chain: &[u64]) {
        kv.start(req, chain, chain.len()).unwrap();
        assert!(kv.allocate(req, chain.len() as u64 * kv.block_size()).unwrap());
        kv.commit(req, chain, chain.len()).unwrap();
        kv.free(req).unwrap();
    }

    #[test]
    fn hits_take_references_and_free_releases_them() {
        let mut kv = KvCache::new(8, 4).unwrap();
        cache_chain(&mut kv, 1, &[10, 11, 12]);
        assert_eq!((kv.free_blocks(), kv.cached_blocks()), (8, 3));
        assert_eq!(
            kv.take_events(),
            vec![KvEvent::Stored { parent: None, hashes: vec![10, 11, 12] }]
        );
        assert_eq!(kv.start(2, &[10, 11, 99], 3).unwrap(), 2);
        assert_eq!(kv.free_blocks(), 6);
        assert_eq!(kv.tokens_of(2).unwrap(), 8);
        kv.free(2).unwrap();
        assert_eq!(kv.free_blocks(), 8);
        assert_eq!(kv.start(3, &[10, 11, 12], 1).unwrap(), 1, "max_blocks caps the hit");
    }

    #[test]
    fn eviction_is_tail_first_and_reported_as_subtree_roots() {
        let mut kv = KvCache::new(4, 4).unwrap();
        cache_chain(&mut kv, 1, &[1, 2]);
        cache_chain(&mut kv, 2, &[7, 8]);
        kv.take_events();
        // Three fresh blocks: the empty ones go first... there are none, so the oldest chain's
        // tail (2), then its head (1), then the next chain's tail (8) are evicted.
        kv.start(3, &[], 0).unwrap();
        assert!(kv.allocate(3, 12).unwrap());
        let events = kv.take_events();
        assert_eq!(removed(&events), vec![1, 8], "2 is implied by its parent 1");
        assert_eq!(kv.lookup(&[7, 8], 2), 1);
        assert!(!kv.allocate(3, 20).unwrap(), "all or nothing");
        assert_eq!(kv.blocks_of(3).unwrap(), 3);
    }

    #[test]
    fn blocks_hit_while_free_leave_the_queue_and_rejoin_at_the_back() {
        let mut kv = KvCache::new(6, 4).unwrap();
        cache_chain(&mut kv, 1, &[1, 2]);
        cache_chain(&mut kv, 2, &[3, 4]);
        cache_chain(&mut kv, 3, &[5, 6]);
        // Thousands of hits on the middle chain: each takes its blocks out of the queue and
        // frees them to the back, leaving stale entries that compactions drop.
        for req in 10..3_000 {
            assert_eq!(kv.start(req, &[3, 4], 2).unwrap(), 2);
            kv.free(req).unwrap();
        }
        assert_eq!(kv.free_blocks(), 6);
        kv.take_events();
        // Least recently freed first: chain 1, then chain 3, then the hit chain.
        kv.start(4, &[], 0).unwrap();
        assert!(kv.allocate(4, 8).unwrap());
        assert_eq!(removed(&kv.take_events()), vec![1]);
        assert!(kv.allocate(4, 16).unwrap());
        assert_eq!(removed(&kv.take_events()), vec![5]);
        assert_eq!(kv.lookup(&[3, 4], 2), 2);
        assert!(kv.allocate(4, 20).unwrap());
        assert_eq!(removed(&kv.take_events()), vec![4], "the chain's tail first");
        assert_eq!((kv.free_blocks(), kv.lookup(&[3, 4], 2)), (1, 1));
    }

    #[test]
    fn duplicate_content_shares_the_cached_block() {
        let mut kv = KvCache::new(8, 4).unwrap();
        for req in [1, 2] {
            kv.start(req, &[5, 6], 0).unwrap();
            assert!(kv.allocate(req, 8).unwrap());
        }
        kv.commit(1, &[5, 6], 2).unwrap();
        kv.commit(2, &[5, 6], 2).unwrap();
        assert_eq!((kv.cached_blocks(), kv.free_blocks()), (2, 6));
        kv.free(1).unwrap();
        assert_eq!(kv.free_blocks(), 6, "request 2 still holds the shared blocks");
        kv.free(2).unwrap();
        assert_eq!(kv.free_blocks(), 8);
    }

    #[test]
    fn decode_capacity_counts_block_boundaries() {
        let mut kv = KvCache::new(4, 4).unwrap();
        kv.start(1, &[], 0).unwrap();
        assert!(kv.allocate(1, 3).unwrap()); // one block, one slot left
        kv.set_decoding(1, true).unwrap();
        assert_eq!(kv.decode_capacity(100), 13, "1 slot + 3 free blocks of 4");
        assert!(kv.advance_decoding(13));
        assert_eq!(kv.free_blocks(), 0);
        assert!(!kv.advance_decoding(1));
        assert_eq!(kv.tokens_of(1).unwrap(), 16);
    }

    #[test]
    fn removal_roots_are_the_ids_whose_parent_is_not_evicted_with_them() {
        // Batches of chain pieces evicted tail first, shuffled by chain, with lone blocks and
        // parents evicted out of order; small batches are scanned, large ones use the set.
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut set = HashSet::new();
        for round in 0..300 {
            let mut removed: Vec<(u32, u32)> = Vec::new();
            for _ in 0..=next(if round % 10 == 0 { 200 } else { 6 }) {
                let base = next(1 << 20) as u32 * 64;
                let len = 1 + next(40) as u32;
                for k in (0..len).rev() {
                    let parent = if k == 0 && next(3) == 0 { NONE } else { base + k - 1 };
                    removed.push((base + k, parent));
                }
                if next(4) == 0 {
                    let (at, last) = (next(removed.len() as u64) as usize, removed.len() - 1);
                    removed.swap(at, last);
                }
            }
            let ids: HashSet<u32> = removed.iter().map(|&(id, _)| id).collect();
            let want: Vec<u32> = removed
                .iter()
                .filter(|&&(_, p)| p == NONE || !ids.contains(&p))
                .map(|&(id, _)| id)
                .collect();
            assert_eq!(removal_roots(&removed, &mut set), want, "round {round}");
        }
    }

    #[test]
    fn errors_change_nothing() {
        let mut kv = KvCache::new(4, 4).unwrap();
        assert_eq!(KvCache::new(0, 4).unwrap_err(), KvError::InvalidConfig);
        assert_eq!(KvCache::new(MAX_KV_BLOCKS + 1, 4).unwrap_err(), KvError::InvalidConfig);
        assert_eq!(KvCache::new(u32::MAX, 4).unwrap_err(), KvError::InvalidConfig);
        assert_eq!(KvCache::new(4, 1 << 20).unwrap_err(), KvError::InvalidConfig);
        assert_eq!(kv.allocate(9, 4).unwrap_err(), KvError::UnknownRequest(9));
        kv.start(1, &[], 0).unwrap();
        assert_eq!(kv.start(1, &[], 0).unwrap_err(), KvError::DuplicateRequest(1));
        assert_eq!(kv.free(2).unwrap_err(), KvError::UnknownRequest(2));
        assert_eq!((kv.requests(), kv.free_blocks()), (1, 4));
    }
}
