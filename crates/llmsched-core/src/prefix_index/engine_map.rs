//! Which index blocks each engine block hash became, shared by every worker.
//!
//! An engine's block hash is a function of the engine's hashing configuration and the block's
//! content, and so is the run of index blocks the index re-hashed it into: workers configured
//! alike report the same engine hash for the same content, and one entry serves them all. An
//! engine block of one index block (the engine's block size equals the index's) is one `u64`
//! (`one`); a longer span keeps its first and last index block and its length (`span`).
//!
//! A worker whose engine maps a hash to other content than the shared entry says (another hash
//! seed that happens to collide) keeps its own entry in `own`, looked up first. Entries are
//! valid only while the index still holds their first block; those left behind by blocks the
//! index dropped (evictions, cleared workers) are swept when they outnumber live blocks.
//!
//! The shared tables are split into [`SHARDS`] tables by the key's hash, so that a sweep visits
//! a few of them at a time, under one hold of the index's lock each, rather than millions of
//! entries at once (15 ms for a million, every match waiting). Each key is hashed once, by the
//! map's own seeded hasher, and that hash picks the shard and probes it (for an event's warming
//! lookup and its insert alike).

use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

use super::tree::{Tree, WorkerId};

/// An engine block's index blocks: (first, last, count).
pub(crate) type Span = (u64, u64, u32);

/// One worker's own entries (see [`EngineMap`]).
pub(crate) type OwnEntries = HashMap<u64, Span>;

/// Tables each shared map is split into.
const SHARDS: usize = 256;

/// Entries a sweep step visits at most (about 0.3 ms: a block-table lookup each).
const SWEEP_STEP: usize = 4096;

/// Engine blocks of an event hashed and looked up ahead of their inserts at a time (the hashes
/// kept on the stack between the two).
const WARM_CHUNK: usize = 64;

/// A map from engine hashes split into [`SHARDS`] tables by the key's hash (computed by the
/// caller, [`EngineMap::hash`]).
#[derive(Debug, Clone)]
struct Sharded<V> {
    tables: Box<[Shard<V>]>,
    len: usize,
}

/// One shard's table, its header (32 bytes: the table's pointer, mask and counts) within one
/// cache line: every block stored reads the header of a shard chosen by its hash, and a header
/// straddling two lines would cost two.
#[derive(Debug, Clone, Default)]
#[repr(align(32))]
struct Shard<V>(HashTable<(u64, V)>);

impl<V> Default for Sharded<V> {
    fn default() -> Self {
        Sharded { tables: (0..SHARDS).map(|_| Shard(HashTable::new())).collect(), len: 0 }
    }
}

impl<V: Copy> Sharded<V> {
    /// The shard of a key of hash `hash`: bits the tables do not use (hashbrown takes a
    /// bucket from the low bits and a tag from the top seven), so a shard's keys spread over
    /// its buckets and tags.
    fn shard(hash: u64) -> usize {
        const { assert!(SHARDS.is_power_of_two() && SHARDS > 1 && SHARDS <= 1 << 16) };
        (hash >> 32) as usize & (SHARDS - 1)
    }

    fn table(&self, hash: u64) -> &HashTable<(u64, V)> {
        &self.tables[Self::shard(hash)].0
    }

    fn get(&self, hash: u64, key: u64) -> Option<&V> {
        self.table(hash).find(hash, |e| e.0 == key).map(|e| &e.1)
    }

    fn insert(&mut self, hash: u64, key: u64, value: V, hasher: &DefaultHashBuilder) {
        let table = &mut self.tables[Self::shard(hash)].0;
        match table.entry(hash, |e| e.0 == key, |e| hasher.hash_one(e.0)) {
            Entry::Vacant(v) => {
                v.insert((key, value));
                self.len += 1;
            }
            Entry::Occupied(mut o) => o.get_mut().1 = value,
        }
    }

    /// Inserts `value` under `key` if absent; else returns the value there.
    fn insert_new(
        &mut self,
        hash: u64,
        key: u64,
        value: V,
        hasher: &DefaultHashBuilder,
    ) -> Option<V> {
        let table = &mut self.tables[Self::shard(hash)].0;
        match table.entry(hash, |e| e.0 == key, |e| hasher.hash_one(e.0)) {
            Entry::Vacant(v) => {
                v.insert((key, value));
                self.len += 1;
                None
            }
            Entry::Occupied(o) => Some(o.get().1),
        }
    }

    fn remove(&mut self, hash: u64, key: u64) {
        let table = &mut self.tables[Self::shard(hash)].0;
        if let Ok(o) = table.find_entry(hash, |e| e.0 == key) {
            o.remove();
            self.len -= 1;
        }
    }

    /// Keeps shard `i`'s entries that `keep` accepts. Returns the entries visited.
    fn retain_shard(&mut self, i: usize, mut keep: impl FnMut(&V) -> bool) -> usize {
        let table = &mut self.tables[i].0;
        let before = table.len();
        table.retain(|e| keep(&e.1));
        self.len -= before - table.len();
        before
    }

    fn iter(&self) -> impl Iterator<Item = &(u64, V)> {
        self.tables.iter().flat_map(|t| t.0.iter())
    }

    fn bytes(&self) -> u64 {
        self.tables.iter().map(|t| capacity_bytes::<(u64, V)>(t.0.capacity())).sum()
    }

    fn fitted_bytes(&self) -> u64 {
        self.tables.iter().map(|t| fitted_shard(&t.0)).sum()
    }

    fn fit(&mut self, hasher: &DefaultHashBuilder) {
        for t in self.tables.iter_mut() {
            let table = &mut t.0;
            if shrinks::<(u64, V)>(table.capacity(), table.len()) {
                table.shrink_to_fit(|e| hasher.hash_one(e.0));
            }
        }
    }
}

fn fitted_shard<V>(table: &HashTable<(u64, V)>) -> u64 {
    fitted_size::<(u64, V)>(table.capacity(), table.len())
}

#[derive(Debug, Clone, Default)]
pub(crate) struct EngineMap {
    /// Hashes the engine hashes for both shared maps (seeded per map, as hashbrown's own).
    hasher: DefaultHashBuilder,
    one: Sharded<u64>,
    span: Sharded<Span>,
    /// Per worker, entries that differ from the shared one for the same engine hash.
    own: Vec<OwnEntries>,
    /// The shard the next sweep step starts at.
    next_sweep: usize,
    /// Shards left to visit in the sweep under way (0: none under way).
    pass_left: usize,
    /// Entries kept so far by the sweep under way.
    pass_kept: usize,
    /// Entries the last whole sweep kept: live entries can outnumber live blocks (engines
    /// with their own hash seeds, vLLM's default, each map the same blocks under other
    /// hashes), and a sweep is due only once the map has doubled past what the last one kept.
    sweep_floor: usize,
    /// Entries visited by sweeps so far (tests check sweeping stays O(1) an entry).
    #[cfg(test)]
    pub swept: usize,
}

impl EngineMap {
    pub fn ensure_worker(&mut self, w: WorkerId) {
        if self.own.len() <= w as usize {
            self.own.resize_with(w as usize + 1, HashMap::new);
        }
    }

    /// The hash of engine hash `engine` in the shared maps.
    #[inline]
    fn hash(&self, engine: u64) -> u64 {
        self.hasher.hash_one(engine)
    }

    fn shared(&self, hash: u64, engine: u64) -> Option<Span> {
        match self.one.get(hash, engine) {
            Some(&b) => Some((b, b, 1)),
            None => self.span.get(hash, engine).copied(),
        }
    }

    /// The index blocks worker `w`'s engine block `engine` became.
    pub fn get(&self, w: WorkerId, engine: u64) -> Option<Span> {
        if let Some(own) = self.own.get(w as usize).filter(|m| !m.is_empty()) {
            if let Some(&s) = own.get(&engine) {
                return Some(s);
            }
        }
        self.shared(self.hash(engine), engine)
    }

    /// Records that worker `w`'s engine blocks `engines` became the index blocks `ours`,
    /// `per_engine_block` of them each, in order; pushes onto `replaced` what `w`'s lookups
    /// gave before where that was other blocks (see [`Self::insert`]).
    ///
    /// Each key is hashed once, and a chunk of them is looked up in the shared table before
    /// any of them is inserted: the lookups do not depend on each other, so the processor
    /// overlaps their cache misses (one per block in a table of millions), which the inserts,
    /// each writing the table, would take one after another.
    pub fn insert_event(
        &mut self,
        w: WorkerId,
        engines: &[u64],
        ours: &[u64],
        per_engine_block: usize,
        replaced: &mut Vec<Span>,
    ) {
        debug_assert_eq!(ours.len(), engines.len() * per_engine_block);
        self.ensure_worker(w);
        let mut hashes = [0u64; WARM_CHUNK];
        for (c, chunk) in engines.chunks(WARM_CHUNK).enumerate() {
            for (h, &engine) in hashes.iter_mut().zip(chunk) {
                *h = self.hash(engine);
                std::hint::black_box(self.one.get(*h, engine));
            }
            for (j, (&hash, &engine)) in hashes.iter().zip(chunk).enumerate() {
                let i = c * WARM_CHUNK + j;
                let span = &ours[i * per_engine_block..(i + 1) * per_engine_block];
                let span = (span[0], span[span.len() - 1], span.len() as u32);
                if let Some(old) = self.insert_hashed(w, hash, engine, span) {
                    replaced.push(old);
                }
            }
        }
    }

    /// Records that worker `w`'s engine block `engine` became `span`. Returns what `w`'s
    /// lookup of `engine` gave before when that was other blocks (the engine stored the same
    /// hash again with other content): the caller releases them.
    pub fn insert(&mut self, w: WorkerId, engine: u64, span: Span) -> Option<Span> {
        self.ensure_worker(w);
        self.insert_hashed(w, self.hash(engine), engine, span)
    }

    /// [`Self::insert`] of `engine` of hash `hash`, for a worker `w` already ensured.
    #[inline]
    fn insert_hashed(&mut self, w: WorkerId, hash: u64, engine: u64, span: Span) -> Option<Span> {
        // `span.len` first: with engine blocks the size of the index's (no spans at all), that
        // spares every insert a read of the span shard's header, another cache line.
        if span.2 == 1
            && span.0 == span.1
            && (self.span.len == 0 || self.span.table(hash).is_empty())
        {
            // The common case (engine and index blocks alike): one probe of one table.
            match self.one.insert_new(hash, engine, span.0, &self.hasher) {
                None => return self.take_own(w, engine, span),
                Some(first) if first == span.0 => return self.take_own(w, engine, span),
                Some(_) => {}
            }
        }
        let previous = match self.shared(hash, engine) {
            Some(s) if s == span => self.own[w as usize].remove(&engine),
            Some(s) => self.own[w as usize].insert(engine, span).or(Some(s)),
            None => {
                if span.2 == 1 && span.0 == span.1 {
                    self.one.insert(hash, engine, span.0, &self.hasher);
                } else {
                    self.span.insert(hash, engine, span, &self.hasher);
                }
                self.own[w as usize].remove(&engine)
            }
        };
        previous.filter(|&p| p != span)
    }

    /// Removes `w`'s own entry for `engine` now that the shared one is `span`; returns it if it
    /// was other blocks.
    #[inline(always)]
    fn take_own(&mut self, w: WorkerId, engine: u64, span: Span) -> Option<Span> {
        let own = &mut self.own[w as usize];
        if own.is_empty() {
            // Most workers have no entries of their own: the check alone, inlined.
            return None;
        }
        Self::take_own_entry(own, engine, span)
    }

    #[inline(never)]
    fn take_own_entry(own: &mut OwnEntries, engine: u64, span: Span) -> Option<Span> {
        own.remove(&engine).filter(|&p| p != span)
    }

    /// Forgets worker `w`'s entry for `engine` after `w` stopped holding its first block: its
    /// own entry, or the shared one once no worker holds that block.
    pub fn forget(&mut self, w: WorkerId, engine: u64, tree: &Tree) {
        if let Some(own) = self.own.get_mut(w as usize) {
            if own.remove(&engine).is_some() {
                return;
            }
        }
        let hash = self.hash(engine);
        if let Some((first, _, _)) = self.shared(hash, engine) {
            if !tree.blocks.contains(&tree.nodes, first) {
                self.one.remove(hash, engine);
                self.span.remove(hash, engine);
            }
        }
    }

    /// Takes worker `w`'s own entries out (it cleared its cache or left), for the caller to
    /// free after releasing the index's lock.
    pub fn take_worker(&mut self, w: WorkerId) -> OwnEntries {
        self.own.get_mut(w as usize).map(std::mem::take).unwrap_or_default()
    }

    /// Whether a sweep is under way, or due: shared entries outnumber twice the live blocks
    /// and twice what the last sweep kept (by more than a margin), so that sweeping costs
    /// each entry added O(1) however many entries stay live.
    fn needs_sweep(&self, tree: &Tree) -> bool {
        self.pass_left > 0
            || self.one.len + self.span.len > 2 * tree.blocks.len().max(self.sweep_floor) + 4096
    }

    /// When [`Self::needs_sweep`], drops the shared entries whose first block the index no
    /// longer holds from the next shards, about [`SWEEP_STEP`] entries' worth. Returns whether
    /// the sweep is still under way.
    pub fn sweep_step(&mut self, tree: &Tree) -> bool {
        if !self.needs_sweep(tree) {
            return false;
        }
        if self.pass_left == 0 {
            (self.pass_left, self.pass_kept) = (SHARDS, 0);
        }
        let mut visited = 0;
        while self.pass_left > 0 && visited < SWEEP_STEP {
            let i = self.next_sweep;
            self.next_sweep = (i + 1) % SHARDS;
            self.pass_left -= 1;
            visited += self.one.retain_shard(i, |&b| tree.blocks.contains(&tree.nodes, b));
            visited += self.span.retain_shard(i, |s| tree.blocks.contains(&tree.nodes, s.0));
            self.pass_kept += self.one.tables[i].0.len() + self.span.tables[i].0.len();
        }
        #[cfg(test)]
        {
            self.swept += visited;
        }
        if self.pass_left == 0 {
            self.sweep_floor = self.pass_kept;
        }
        self.pass_left > 0
    }

    pub fn len(&self) -> usize {
        self.one.len + self.span.len + self.own.iter().map(HashMap::len).sum::<usize>()
    }

    /// Heap bytes of the tables as allocated (see [`table_bytes`]).
    pub fn bytes(&self) -> u64 {
        let own: u64 = self.own.iter().map(table_bytes).sum();
        self.one.bytes() + self.span.bytes() + own
    }

    /// What [`EngineMap::bytes`] would be after [`EngineMap::fit`].
    pub fn fitted_bytes(&self) -> u64 {
        let own: u64 = self.own.iter().map(fitted).sum();
        self.one.fitted_bytes() + self.span.fitted_bytes() + own
    }

    /// Shrinks the tables that removals left larger than their entries need (a table never
    /// shrinks by itself).
    pub fn fit(&mut self) {
        self.one.fit(&self.hasher);
        self.span.fit(&self.hasher);
        self.own.iter_mut().for_each(fit);
    }

    /// Every entry worker `w` can use: its own, then the shared ones whose first block it holds.
    pub fn entries_of(&self, w: WorkerId, tree: &Tree) -> Vec<(u64, Span)> {
        let mut out: Vec<(u64, Span)> = self
            .own
            .get(w as usize)
            .map(|m| m.iter().map(|(&e, &s)| (e, s)).collect())
            .unwrap_or_default();
        let own = self.own.get(w as usize);
        let shared = self.one.iter().map(|&(e, b)| (e, (b, b, 1))).chain(self.span.iter().copied());
        for (e, s) in shared {
            if own.is_some_and(|m| m.contains_key(&e)) {
                continue;
            }
            if tree.holds(w, s.0) {
                out.push((e, s));
            }
        }
        out.sort_unstable();
        out
    }
}

/// Heap bytes of a hashbrown table of `T` made for `len` entries (`with_capacity(len)` or
/// `shrink_to(len)`): the power of two of buckets of which 7/8 hold them (at least 4, or 8
/// from 4 entries), with a control byte each and a group of trailing control bytes.
pub(crate) fn fitted_table_bytes<T>(len: usize) -> u64 {
    if len == 0 {
        return 0;
    }
    let buckets = match len {
        0..4 => 4,
        4..8 => 8,
        _ => (len * 8).div_ceil(7).next_power_of_two(),
    };
    (buckets * (std::mem::size_of::<T>() + 1) + 16) as u64
}

fn fit<V>(map: &mut HashMap<u64, V>) {
    if shrinks::<(u64, V)>(map.capacity(), map.len()) {
        map.shrink_to_fit();
    }
}

fn fitted<V>(map: &HashMap<u64, V>) -> u64 {
    fitted_size::<(u64, V)>(map.capacity(), map.len())
}

/// Whether a table of `T` of capacity `capacity` holding `len` entries would shrink if fitted.
fn shrinks<T>(capacity: usize, len: usize) -> bool {
    fitted_table_bytes::<T>(len) < capacity_bytes::<T>(capacity)
}

/// The bytes of a table of `T` of capacity `capacity` holding `len` entries once fitted.
fn fitted_size<T>(capacity: usize, len: usize) -> u64 {
    capacity_bytes::<T>(capacity).min(fitted_table_bytes::<T>(len))
}

/// Heap bytes of a hashbrown table as allocated: a bucket and a control byte per slot of its
/// capacity (a power of two of buckets, at most 7/8 of them usable), and a group of trailing
/// control bytes. From the capacity rather than the length: a table never shrinks by itself, so
/// what it holds is what the process holds.
pub(crate) fn table_bytes<K, V>(map: &HashMap<K, V>) -> u64 {
    capacity_bytes::<(K, V)>(map.capacity())
}

/// [`table_bytes`] of a table of `T` of capacity `capacity`.
fn capacity_bytes<T>(capacity: usize) -> u64 {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 { capacity + 1 } else { capacity / 7 * 8 };
    (buckets * (std::mem::size_of::<T>() + 1) + 16) as u64
}
