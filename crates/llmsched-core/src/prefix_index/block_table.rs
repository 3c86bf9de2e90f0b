//! Where each block of the tree sits: block hash -> (node, offset), without storing the hash.
//!
//! Every block hash is already stored once, in its node's edge (`Node::hashes`). The table keeps
//! only the 8-byte location and finds an entry by comparing the hash at that location, so an
//! entry costs a location and a control byte instead of a hash, a location and a control byte.
//! A lookup that finds its block reads the node's edge (one more memory access); a lookup of an
//! absent hash reads an edge only when a 7-bit tag matches by chance.
//!
//! A tag of 7 bits of the block hash rides in the entry's offset word (offsets below 2^24; the
//! rare longer edge's later blocks are stored untagged), so a probe whose control byte matches
//! by chance is rejected in a register instead of after reading the node and its edge (two
//! dependent cache misses in a table of millions: on the bs64 ingest, such chance matches on
//! the probes that check an event's new blocks cost more than the probes themselves).
//!
//! Offsets are recorded as the node numbers its edge for the table: block `i` of a node's edge
//! at `base + i` (`Node::base`), so that a split can leave its longer side's entries in place.
//! Locations handed in (to record, move or forget a block) are recorded ones; [`BlockTable::get`]
//! answers the offset in the edge.
//!
//! Invariant: the table holds exactly one entry per block of the live nodes, and each entry's
//! location names the block's current position. The tree keeps it across edits that move
//! blocks (`relocate`, by the old location, while the edges are being rewritten) and checks
//! nothing else mid-edit. Growth (`reserve`, at the start of a store, where the invariant
//! holds) rebuilds the table from the nodes' edges in order rather than rehashing the entries
//! one random edge read at a time.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use super::tree::{Loc, Node};

#[derive(Debug, Clone, Default)]
pub(crate) struct BlockTable {
    table: HashTable<Slot>,
    hasher: DefaultHashBuilder,
    /// Entries moved so far (the tree's tests bound what its edits move).
    #[cfg(test)]
    pub moved: usize,
}

/// A stored entry: the block's node and, in `word`, its offset, tagged when it fits.
///
/// `word` is `TAGGED | tag << 24 | offset` for an offset below [`TAGGED_OFFSETS`], and the bare
/// offset otherwise (below 2^31: an edge of 2^31 blocks would be 16 GiB of hashes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    node: u32,
    word: u32,
}

const TAGGED: u32 = 1 << 31;
pub(crate) const TAGGED_OFFSETS: u32 = 1 << 24;

/// 7 bits of the block hash (not those hashbrown's control byte takes from the table's own
/// hash of it, which is a different function of the block hash).
#[inline]
fn tag(hash: u64) -> u32 {
    (hash >> 57) as u32
}

impl Slot {
    #[inline]
    fn new(hash: u64, loc: Loc) -> Slot {
        debug_assert!(loc.offset < TAGGED, "edges hold fewer than 2^31 blocks");
        let word = if loc.offset < TAGGED_OFFSETS {
            TAGGED | tag(hash) << 24 | loc.offset
        } else {
            loc.offset
        };
        Slot { node: loc.node, word }
    }

    #[inline]
    fn loc(self) -> Loc {
        let offset =
            if self.word & TAGGED != 0 { self.word & (TAGGED_OFFSETS - 1) } else { self.word };
        Loc { node: self.node, offset }
    }

    /// Whether this entry may be block `hash`: false when its tag rules it out.
    #[inline]
    fn may_be(self, hash: u64) -> bool {
        self.word & TAGGED == 0 || (self.word >> 24) & 0x7f == tag(hash)
    }

    /// Whether this entry is block `hash`, reading the hash from its edge when the tag allows.
    #[inline]
    fn is(self, nodes: &[Node], hash: u64) -> bool {
        self.may_be(hash) && hash_at(nodes, self.loc()) == Some(hash)
    }
}

/// The block hash recorded at `loc`, if `loc` is a recorded position of `nodes`.
#[inline]
fn hash_at(nodes: &[Node], loc: Loc) -> Option<u64> {
    let node = nodes.get(loc.node as usize)?;
    node.hashes.get(loc.offset.checked_sub(node.base)? as usize).copied()
}

/// The block hash an entry names (for rehashing it).
#[inline]
fn hash_of(nodes: &[Node], slot: Slot) -> u64 {
    hash_at(nodes, slot.loc()).unwrap_or_default()
}

impl BlockTable {
    /// A table of every block of `nodes` (dead nodes and the root have no blocks).
    pub fn from_nodes(nodes: &[Node]) -> Self {
        let count = nodes.iter().map(|n| n.hashes.len()).sum();
        let mut out = BlockTable::default();
        out.fill_from(nodes, count);
        out
    }

    /// Replaces the table by one with room for `capacity` blocks, filled from `nodes`.
    fn fill_from(&mut self, nodes: &[Node], capacity: usize) {
        let mut table = HashTable::with_capacity(capacity);
        for (id, node) in nodes.iter().enumerate() {
            for (j, &h) in node.hashes.iter().enumerate() {
                let slot = Slot::new(h, Loc { node: id as u32, offset: node.base + j as u32 });
                // Room was made above: the hasher is never called.
                table.insert_unique(self.hasher.hash_one(h), slot, |_| 0);
            }
        }
        self.table = table;
    }

    #[inline]
    fn hash(&self, h: u64) -> u64 {
        self.hasher.hash_one(h)
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Where block `hash` is: its node and its offset in the node's edge.
    #[inline]
    pub fn get(&self, nodes: &[Node], hash: u64) -> Option<Loc> {
        let loc = self.table.find(self.hash(hash), |&s| s.is(nodes, hash))?.loc();
        Some(Loc { node: loc.node, offset: loc.offset - nodes[loc.node as usize].base })
    }

    #[inline]
    pub fn contains(&self, nodes: &[Node], hash: u64) -> bool {
        self.get(nodes, hash).is_some()
    }

    /// Whether [`Self::reserve`] of `additional` blocks would rebuild the table larger.
    pub fn must_grow(&self, additional: usize) -> bool {
        self.table.capacity() - self.table.len() < additional
    }

    /// Makes room for `additional` new blocks. Call only where every entry is in place; when the
    /// table must grow, it is rebuilt from `nodes` at least twice as large (as a hash table
    /// grows), or at its size when removals left its free slots as tombstones, but never more
    /// than half full.
    ///
    /// Why half: a removal leaves a tombstone instead of an empty slot when the slot sits in a
    /// run of 16 full ones, which is rare at half load and common near the table's 7/8 limit.
    /// Tombstones use up the room like entries do, so a table rebuilt nearly full while
    /// blocks come and go (an index fed by evictions) filled up with them and was rebuilt
    /// again after a few thousand stores: on a 100,000-request simulated trace, 384 rebuilds
    /// re-inserted 2.5 entries per block stored.
    pub fn reserve(&mut self, nodes: &[Node], additional: usize) {
        let room = self.table.capacity() - self.table.len();
        if room >= additional {
            return;
        }
        let len = self.table.len();
        let capacity = (len + additional).max(self.table.capacity() + 1).max(2 * len);
        self.fill_from(nodes, capacity);
        debug_assert_eq!(self.table.len(), len, "the table matches the nodes");
    }

    /// Looks up each of `hashes` ahead of inserting them: independent lookups let the processor
    /// overlap their cache misses (about one per block in a table of millions), where the
    /// inserts that follow, each writing the table, would wait on them one at a time.
    pub fn warm(&self, nodes: &[Node], hashes: &[u64]) {
        for &h in hashes {
            std::hint::black_box(self.get(nodes, h));
        }
    }

    /// Records block `hash` at `loc` (already written into its node) unless a block with that
    /// hash is in the table; returns whether it was recorded. One probe does both.
    #[inline]
    pub fn insert_absent(&mut self, nodes: &[Node], hash: u64, loc: Loc) -> bool {
        debug_assert_eq!(hash_at(nodes, loc), Some(hash));
        let hasher = &self.hasher;
        let entry = self.table.entry(
            hasher.hash_one(hash),
            |&s| s.is(nodes, hash),
            |&s| hasher.hash_one(hash_of(nodes, s)),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(_) => false,
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(Slot::new(hash, loc));
                true
            }
        }
    }

    /// Moves block `hash`'s entry from `from` to `to` (the edges may be mid-edit).
    #[inline]
    pub fn relocate(&mut self, hash: u64, from: Loc, to: Loc) {
        #[cfg(test)]
        {
            self.moved += 1;
        }
        let from = Slot::new(hash, from);
        let found = self.table.find_mut(self.hash(hash), |&s| s == from);
        debug_assert!(found.is_some(), "block {hash:#x} is at {from:?}");
        if let Some(s) = found {
            *s = Slot::new(hash, to);
        }
    }

    /// Forgets block `hash`, whose entry is at `loc` (its node may be emptied already).
    #[inline]
    pub fn remove(&mut self, hash: u64, loc: Loc) {
        let slot = Slot::new(hash, loc);
        let found = self.table.find_entry(self.hash(hash), |&s| s == slot);
        debug_assert!(found.is_ok(), "block {hash:#x} is at {loc:?}");
        if let Ok(entry) = found {
            entry.remove();
        }
    }

    /// Heap bytes as allocated.
    pub fn bytes(&self) -> u64 {
        self.table.allocation_size() as u64
    }

    /// What [`BlockTable::bytes`] would be after [`BlockTable::fit`].
    pub fn fitted_bytes(&self) -> u64 {
        self.bytes().min(super::engine_map::fitted_table_bytes::<Slot>(2 * self.len()))
    }

    /// Rebuilds the table at most half full (as [`BlockTable::reserve`] leaves it) when that
    /// takes less memory: a table never shrinks by itself, and one grown past the index's
    /// memory cap cannot be brought under it by evicting blocks.
    pub fn fit(&mut self, nodes: &[Node]) {
        if self.fitted_bytes() < self.bytes() {
            self.fill_from(nodes, 2 * self.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(hashes: &[u64]) -> Node {
        Node { hashes: hashes.to_vec(), ..Default::default() }
    }

    fn loc(node: u32, offset: u32) -> Loc {
        Loc { node, offset }
    }

    #[test]
    fn finds_each_block_by_the_hash_in_its_edge() {
        let nodes = vec![Node::default(), node(&[10, 11, 12]), node(&[20])];
        let table = BlockTable::from_nodes(&nodes);
        assert_eq!(table.len(), 4);
        assert_eq!(table.get(&nodes, 11), Some(loc(1, 1)));
        assert_eq!(table.get(&nodes, 20), Some(loc(2, 0)));
        assert_eq!(table.get(&nodes, 13), None);
        assert!(table.bytes() > 0);
    }

    #[test]
    fn an_entry_keeps_its_location_and_a_tag_of_its_hash() {
        let h = 0xabcd_0000_0000_1234u64;
        for offset in [0, 1, TAGGED_OFFSETS - 1, TAGGED_OFFSETS, TAGGED - 1] {
            let s = Slot::new(h, loc(7, offset));
            assert_eq!(s.loc(), loc(7, offset));
            assert!(s.may_be(h));
        }
        // Tagged: a hash with other top bits is ruled out without reading the edge; one with
        // the same top bits is not, and the edge decides.
        let s = Slot::new(h, loc(1, 3));
        assert!(!s.may_be(h ^ (1 << 60)));
        assert!(s.may_be(h ^ 1));
        // Untagged (an offset past the tagged range): every hash may be it.
        assert!(Slot::new(h, loc(1, TAGGED_OFFSETS)).may_be(h ^ (1 << 60)));
    }

    #[test]
    fn blocks_whose_tags_agree_are_told_apart_by_their_edges() {
        // Same top 7 bits (the tag), different hashes.
        let (a, b) = (0xfe00_0000_0000_0001u64, 0xfe00_0000_0000_0002u64);
        let nodes = vec![Node::default(), node(&[a, b])];
        let table = BlockTable::from_nodes(&nodes);
        assert_eq!(table.get(&nodes, a), Some(loc(1, 0)));
        assert_eq!(table.get(&nodes, b), Some(loc(1, 1)));
        assert_eq!(table.get(&nodes, 0xfe00_0000_0000_0003), None);
    }

    #[test]
    fn a_table_emptied_by_removals_fits_to_what_it_holds_as_estimated() {
        for (len, kept) in [(40_000u64, 100u64), (40_000, 9_000), (300_000, 70_000), (64, 3)] {
            let mut nodes = vec![Node::default(), node(&(1..=len).collect::<Vec<_>>())];
            let mut table = BlockTable::from_nodes(&nodes);
            let gone = nodes[1].hashes.split_off(kept as usize);
            for (j, &h) in gone.iter().enumerate() {
                table.remove(h, loc(1, (kept as usize + j) as u32));
            }
            let (before, fitted) = (table.bytes(), table.fitted_bytes());
            table.fit(&nodes);
            assert!(fitted < before, "{len} -> {kept}: {fitted} of {before}");
            assert_eq!(table.bytes(), fitted, "{len} -> {kept}");
            assert_eq!(table.len(), kept as usize);
            assert!((1..=kept).all(|h| table.contains(&nodes, h)));
            table.fit(&nodes); // fitted already: kept as it is
            assert_eq!(table.bytes(), fitted);
        }
    }

    #[test]
    fn follows_blocks_moved_by_a_split_and_forgets_removed_ones() {
        let mut nodes = vec![Node::default(), node(&[1, 2, 3, 4])];
        let mut table = BlockTable::from_nodes(&nodes);
        // Split before offset 2: the tail [3, 4] becomes node 2.
        let tail = nodes[1].hashes.split_off(2);
        nodes.push(node(&tail));
        table.relocate(3, loc(1, 2), loc(2, 0));
        table.relocate(4, loc(1, 3), loc(2, 1));
        assert_eq!(table.get(&nodes, 4), Some(loc(2, 1)));
        assert_eq!(table.get(&nodes, 2), Some(loc(1, 1)));
        // Delete node 2 (its edge is emptied first, as the tree does).
        let gone = std::mem::take(&mut nodes[2]);
        for (j, &h) in gone.hashes.iter().enumerate() {
            table.remove(h, loc(2, j as u32));
        }
        assert_eq!(table.len(), 2);
        assert_eq!(table.get(&nodes, 3), None);
        assert_eq!(table.get(&nodes, 1), Some(loc(1, 0)));
    }

    #[test]
    fn grows_by_rebuilding_from_the_edges_and_keeps_every_block() {
        let mut nodes = vec![Node::default(), Node::default()];
        let mut table = BlockTable::default();
        let mut next = 1000u64;
        for round in 0..50u64 {
            let new: Vec<u64> = (0..37).map(|i| next + i * 7 + round).collect();
            next += 1000;
            table.reserve(&nodes, new.len());
            let room = table.table.capacity() - table.len();
            let base = nodes[1].hashes.len();
            nodes[1].hashes.extend_from_slice(&new);
            for (j, &h) in new.iter().enumerate() {
                assert!(table.insert_absent(&nodes, h, loc(1, (base + j) as u32)));
            }
            assert!(room >= new.len(), "reserve made room for the store");
        }
        assert_eq!(table.len(), nodes[1].hashes.len());
        for (j, &h) in nodes[1].hashes.iter().enumerate() {
            assert_eq!(table.get(&nodes, h), Some(loc(1, j as u32)));
        }
        // Without a reserve, an insert still grows the table correctly.
        let mut table = BlockTable::default();
        let hashes: Vec<u64> = (0..500).map(|i| i * 31 + 5).collect();
        let nodes = vec![Node::default(), node(&hashes)];
        for (j, &h) in hashes.iter().enumerate() {
            assert!(table.insert_absent(&nodes, h, loc(1, j as u32)));
        }
        assert!(hashes
            .iter()
            .enumerate()
            .all(|(j, &h)| table.get(&nodes, h) == Some(loc(1, j as u32))));
    }

    /// Stores a node of `count` new blocks (room made first, as a store does) and deletes it
    /// again (its edge emptied first, as the tree does).
    fn store_and_delete(table: &mut BlockTable, nodes: &mut Vec<Node>, count: u64, round: u64) {
        let new: Vec<u64> = (0..count).map(|i| 1_000_000 * (round + 1) + i).collect();
        table.reserve(nodes, new.len());
        nodes.push(node(&new));
        let id = (nodes.len() - 1) as u32;
        for (j, &h) in new.iter().enumerate() {
            assert!(table.insert_absent(nodes, h, loc(id, j as u32)));
        }
        let gone = std::mem::take(&mut nodes[id as usize]);
        for (j, &h) in gone.hashes.iter().enumerate() {
            table.remove(h, loc(id, j as u32));
        }
    }

    #[test]
    fn a_nearly_full_table_under_churn_is_rebuilt_rarely() {
        // 3,500 blocks in a table of 4,096 slots, then 64 stored and 64 removed per round, as
        // an index fed by evictions does: at that load a removal often leaves a tombstone.
        let mut nodes = vec![Node::default(), node(&(0..3_500).collect::<Vec<u64>>())];
        let mut table = BlockTable::from_nodes(&nodes);
        let mut rebuilds = 0;
        for round in 0..2_000u64 {
            let before = table.table.capacity();
            store_and_delete(&mut table, &mut nodes, 64, round);
            rebuilds += usize::from(table.table.capacity() > before);
        }
        assert_eq!(table.len(), 3_500);
        // Rebuilt at its size, the table stayed 85% full and was rebuilt every few rounds.
        assert!(rebuilds <= 2, "{rebuilds} rebuilds");
    }

    #[test]
    fn a_table_full_of_tombstones_is_rebuilt_not_grown_without_bound() {
        let hashes: Vec<u64> = (0..4096).collect();
        let mut nodes = vec![Node::default(), node(&hashes)];
        let mut table = BlockTable::from_nodes(&nodes);
        let full = table.bytes();
        // Remove all but the first 16 blocks, then store as many new ones, many times over.
        let kept = nodes[1].hashes[..16].to_vec();
        for (j, &h) in nodes[1].hashes.iter().enumerate().skip(16) {
            table.remove(h, loc(1, j as u32));
        }
        nodes[1].hashes = kept;
        for round in 0..20u64 {
            store_and_delete(&mut table, &mut nodes, 1000, round);
        }
        assert_eq!(table.len(), 16);
        assert!(table.bytes() <= full, "{} > {full}", table.bytes());
        assert!(nodes[1]
            .hashes
            .iter()
            .enumerate()
            .all(|(j, &h)| table.get(&nodes, h) == Some(loc(1, j as u32))));
    }
}
