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

use hashbrown::HashMap;

use super::tree::{Tree, WorkerId};

/// An engine block's index blocks: (first, last, count).
pub(crate) type Span = (u64, u64, u32);

#[derive(Debug, Clone, Default)]
pub(crate) struct EngineMap {
    one: HashMap<u64, u64>,
    span: HashMap<u64, Span>,
    /// Per worker, entries that differ from the shared one for the same engine hash.
    own: Vec<HashMap<u64, Span>>,
}

impl EngineMap {
    pub fn ensure_worker(&mut self, w: WorkerId) {
        if self.own.len() <= w as usize {
            self.own.resize_with(w as usize + 1, HashMap::new);
        }
    }

    fn shared(&self, engine: u64) -> Option<Span> {
        match self.one.get(&engine) {
            Some(&b) => Some((b, b, 1)),
            None => self.span.get(&engine).copied(),
        }
    }

    /// The index blocks worker `w`'s engine block `engine` became.
    pub fn get(&self, w: WorkerId, engine: u64) -> Option<Span> {
        if let Some(own) = self.own.get(w as usize).filter(|m| !m.is_empty()) {
            if let Some(&s) = own.get(&engine) {
                return Some(s);
            }
        }
        self.shared(engine)
    }

    /// Looks up every one of `engines` in the shared table before they are inserted: the
    /// lookups do not depend on each other, so the processor overlaps their cache misses (one
    /// per block in a table of millions), which the inserts, each writing the table, would
    /// take one after another.
    pub fn warm(&self, engines: &[u64]) {
        for engine in engines {
            std::hint::black_box(self.one.get(engine));
        }
    }

    /// Records that worker `w`'s engine block `engine` became `span`.
    pub fn insert(&mut self, w: WorkerId, engine: u64, span: Span) {
        self.ensure_worker(w);
        if span.2 == 1 && span.0 == span.1 && self.span.is_empty() {
            // The common case (engine and index blocks alike): one probe of one table.
            match self.one.entry(engine) {
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(span.0);
                    return;
                }
                hashbrown::hash_map::Entry::Occupied(o) if *o.get() == span.0 => {
                    if !self.own[w as usize].is_empty() {
                        self.own[w as usize].remove(&engine);
                    }
                    return;
                }
                hashbrown::hash_map::Entry::Occupied(_) => {}
            }
        }
        match self.shared(engine) {
            Some(s) if s == span => {
                self.own[w as usize].remove(&engine);
            }
            Some(_) => {
                self.own[w as usize].insert(engine, span);
            }
            None => {
                if span.2 == 1 && span.0 == span.1 {
                    self.one.insert(engine, span.0);
                } else {
                    self.span.insert(engine, span);
                }
            }
        }
    }

    /// Forgets worker `w`'s entry for `engine` after `w` stopped holding its first block: its
    /// own entry, or the shared one once no worker holds that block.
    pub fn forget(&mut self, w: WorkerId, engine: u64, tree: &Tree) {
        if let Some(own) = self.own.get_mut(w as usize) {
            if own.remove(&engine).is_some() {
                return;
            }
        }
        if let Some((first, _, _)) = self.shared(engine) {
            if !tree.blocks.contains(&tree.nodes, first) {
                self.one.remove(&engine);
                self.span.remove(&engine);
            }
        }
    }

    /// Drops worker `w`'s own entries (it cleared its cache or left).
    pub fn clear_worker(&mut self, w: WorkerId) {
        if let Some(own) = self.own.get_mut(w as usize) {
            *own = HashMap::new();
        }
    }

    /// Drops shared entries whose first block the index no longer holds, once there are more of
    /// them than live blocks.
    pub fn sweep(&mut self, tree: &Tree) {
        let shared = self.one.len() + self.span.len();
        if shared <= 2 * tree.blocks.len() + 4096 {
            return;
        }
        self.one.retain(|_, b| tree.blocks.contains(&tree.nodes, *b));
        self.span.retain(|_, s| tree.blocks.contains(&tree.nodes, s.0));
    }

    pub fn len(&self) -> usize {
        self.one.len() + self.span.len() + self.own.iter().map(HashMap::len).sum::<usize>()
    }

    /// Heap bytes of the tables as allocated (see [`table_bytes`]).
    pub fn bytes(&self) -> u64 {
        let own: u64 = self.own.iter().map(table_bytes).sum();
        table_bytes(&self.one) + table_bytes(&self.span) + own
    }

    /// What [`EngineMap::bytes`] would be after [`EngineMap::fit`].
    pub fn fitted_bytes(&self) -> u64 {
        let own: u64 = self.own.iter().map(fitted).sum();
        fitted(&self.one) + fitted(&self.span) + own
    }

    /// Shrinks the tables that removals left larger than their entries need (a table never
    /// shrinks by itself).
    pub fn fit(&mut self) {
        fit(&mut self.one);
        fit(&mut self.span);
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
        let shared = self
            .one
            .iter()
            .map(|(&e, &b)| (e, (b, b, 1)))
            .chain(self.span.iter().map(|(&e, &s)| (e, s)));
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
    if fitted_table_bytes::<(u64, V)>(map.len()) < table_bytes(map) {
        map.shrink_to_fit();
    }
}

fn fitted<V>(map: &HashMap<u64, V>) -> u64 {
    table_bytes(map).min(fitted_table_bytes::<(u64, V)>(map.len()))
}

/// Heap bytes of a hashbrown table as allocated: a bucket and a control byte per slot of its
/// capacity (a power of two of buckets, at most 7/8 of them usable), and a group of trailing
/// control bytes. From the capacity rather than the length: a table never shrinks by itself, so
/// what it holds is what the process holds.
pub(crate) fn table_bytes<K, V>(map: &HashMap<K, V>) -> u64 {
    let capacity = map.capacity();
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 { capacity + 1 } else { capacity / 7 * 8 };
    (buckets * (std::mem::size_of::<(K, V)>() + 1) + 16) as u64
}
