//! Where each block of the tree sits: block hash -> (node, offset), without storing the hash.
//!
//! Every block hash is already stored once, in its node's edge (`Node::hashes`). The table keeps
//! only the 8-byte location and finds an entry by comparing the hash at that location, so an
//! entry costs a location and a control byte instead of a hash, a location and a control byte.
//! A lookup that finds its block reads the node's edge (one more memory access); a lookup of an
//! absent hash reads an edge only when a 7-bit tag matches by chance.
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
    table: HashTable<Loc>,
    hasher: DefaultHashBuilder,
}

/// The block hash at `loc`, if `loc` is a position of `nodes`.
#[inline]
fn hash_at(nodes: &[Node], loc: Loc) -> Option<u64> {
    nodes.get(loc.node as usize)?.hashes.get(loc.offset as usize).copied()
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
                let loc = Loc { node: id as u32, offset: j as u32 };
                // Room was made above: the hasher is never called.
                table.insert_unique(self.hasher.hash_one(h), loc, |_| 0);
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

    /// Where block `hash` is.
    #[inline]
    pub fn get(&self, nodes: &[Node], hash: u64) -> Option<Loc> {
        self.table.find(self.hash(hash), |&l| hash_at(nodes, l) == Some(hash)).copied()
    }

    #[inline]
    pub fn contains(&self, nodes: &[Node], hash: u64) -> bool {
        self.get(nodes, hash).is_some()
    }

    /// Makes room for `additional` new blocks. Call only where every entry is in place; when the
    /// table must grow, it is rebuilt from `nodes` at least twice as large (as a hash table
    /// grows), or at its size when removals left its free slots as tombstones.
    pub fn reserve(&mut self, nodes: &[Node], additional: usize) {
        let room = self.table.capacity() - self.table.len();
        if room >= additional {
            return;
        }
        let len = self.table.len();
        self.fill_from(nodes, (len + additional).max(self.table.capacity() + 1));
        debug_assert_eq!(self.table.len(), len, "the table matches the nodes");
    }

    /// Records block `hash`, not in the table, at `loc` (already written into its node).
    #[inline]
    pub fn insert_new(&mut self, nodes: &[Node], hash: u64, loc: Loc) {
        debug_assert_eq!(hash_at(nodes, loc), Some(hash));
        let hasher = &self.hasher;
        // Without a `reserve` first this may grow the table by rehashing its entries, each
        // read from its node (every entry already inserted is in place).
        self.table.insert_unique(self.hasher.hash_one(hash), loc, |&l| {
            hasher.hash_one(hash_at(nodes, l).unwrap_or_default())
        });
    }

    /// Moves block `hash`'s entry from `from` to `to` (the edges may be mid-edit).
    #[inline]
    pub fn relocate(&mut self, hash: u64, from: Loc, to: Loc) {
        let found = self.table.find_mut(self.hash(hash), |&l| l == from);
        debug_assert!(found.is_some(), "block {hash:#x} is at {from:?}");
        if let Some(l) = found {
            *l = to;
        }
    }

    /// Forgets block `hash`, whose entry is at `loc` (its node may be emptied already).
    #[inline]
    pub fn remove(&mut self, hash: u64, loc: Loc) {
        let found = self.table.find_entry(self.hash(hash), |&l| l == loc);
        debug_assert!(found.is_ok(), "block {hash:#x} is at {loc:?}");
        if let Ok(entry) = found {
            entry.remove();
        }
    }

    /// Heap bytes as allocated.
    pub fn bytes(&self) -> u64 {
        self.table.allocation_size() as u64
    }
}
