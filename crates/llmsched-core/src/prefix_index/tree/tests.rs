//! The tree's shortcuts against the general operations they stand for: both must leave the same
//! tree (node ids aside).

use proptest::prelude::*;

use super::*;
use crate::hashing::chain_hashes;

const HELD: Attrs = Attrs { tiers: 1, confirmed: true, expires: f64::INFINITY };
const RECORDED: Attrs = Attrs { tiers: 1, confirmed: false, expires: 10.0 };

/// Everything about `t` but its node ids: each node's edge, holders and children (in order of
/// their first block), each worker's leaves by first block, the counts. Checks on the way that
/// children name their parent and every block is found where its edge has it.
fn shape(t: &Tree) -> String {
    fn node(t: &Tree, id: NodeId, out: &mut String) {
        let n = &t.nodes[id as usize];
        let holders: Vec<_> = n
            .holders
            .iter()
            .map(|h| (h.worker, h.attrs.tiers, h.attrs.confirmed, h.stamp, h.child_count))
            .collect();
        out.push_str(&format!("{:?} {holders:?} [", n.hashes));
        let mut kids: Vec<(u64, NodeId)> =
            n.children.values().map(|&c| (t.nodes[c as usize].hashes[0], c)).collect();
        kids.sort_unstable();
        for (first, c) in kids {
            assert_eq!(t.nodes[c as usize].parent, id);
            // Each child is found under its first hash.
            assert_eq!(n.children.get(&first), Some(&c));
            node(t, c, out);
        }
        out.push(']');
    }
    let mut out = String::new();
    node(t, ROOT, &mut out);
    for (w, wt) in t.workers.iter().enumerate() {
        t.check_leaves(w as WorkerId);
        let leaves: Vec<(u64, u64)> =
            wt.leaves.iter().map(|&(s, id)| (s, t.nodes[id as usize].hashes[0])).collect();
        out.push_str(&format!(" w{w}: held {} leaves {leaves:?}", wt.held));
    }
    out.push_str(&format!(" holders {} blocks {}", t.holder_count, t.blocks.len()));
    for (id, n) in t.nodes.iter().enumerate().filter(|&(id, _)| t.is_live(id as NodeId)) {
        for (j, &h) in n.hashes.iter().enumerate() {
            let at = Loc { node: id as NodeId, offset: j as u32 };
            assert_eq!(t.blocks.get(&t.nodes, h), Some(at), "block {h:#x}");
        }
    }
    out
}

/// `drop_from` without its shortcut: split off the tail, drop it, merge around.
fn drop_by_split(t: &mut Tree, w: WorkerId, hash: u64) -> u64 {
    let loc = t.blocks.get(&t.nodes, hash).expect("a held block");
    let (head, top) =
        if loc.offset > 0 { t.split(loc.node, loc.offset as usize) } else { (loc.node, loc.node) };
    let dropped = t.drop_subtree(w, top);
    t.merge_around(&[head]);
    dropped
}

/// Four chains of 12 blocks: two pairs, each pair sharing its first 5 blocks.
fn chains() -> Vec<Vec<u64>> {
    (0..4u32)
        .map(|c| {
            let shared = (0..10).map(|i| 1000 * (c / 2) + i);
            let own = (0..14).map(|i| 100_000 + 1000 * c + i);
            chain_hashes(&shared.chain(own).collect::<Vec<u32>>(), 2, 0).expect("valid tokens")
        })
        .collect()
}

#[test]
fn cutting_a_tail_with_children_leaves_what_a_split_leaves() {
    let c = chains();
    let mut t = Tree::new();
    t.store(0, &c[0], None, HELD).unwrap();
    t.store(0, &c[1], None, HELD).unwrap(); // blocks 0..5 now have two children
    let mut by_split = t.clone();
    assert_eq!(t.drop_from(0, c[0][2]), 3 + 7 + 7);
    assert_eq!(drop_by_split(&mut by_split, 0, c[0][2]), 3 + 7 + 7);
    assert_eq!(shape(&t), shape(&by_split));
    assert_eq!(t.nodes[t.blocks.get(&t.nodes, c[0][1]).unwrap().node as usize].hashes, c[0][..2]);
}

#[test]
fn a_staged_run_that_conflicts_leaves_the_tree_as_it_was() {
    let c = chains();
    let mut t = Tree::new();
    t.store(0, &c[0], None, HELD).unwrap();
    t.store(1, &c[2], None, HELD).unwrap();
    let before = shape(&t);
    let nodes = t.nodes.len();
    // Staged as a node of its own (a new child: the leaf is not worker 0's alone), long or
    // short: a block of another chain, then a block repeated.
    let elsewhere: Vec<u64> = c[1][5..].iter().copied().chain([c[2][3]]).collect();
    let repeated: Vec<u64> = c[1][5..].iter().copied().chain([c[1][6]]).collect();
    let short_elsewhere = vec![c[1][5], c[2][3]];
    let short_repeated = vec![c[1][5], c[1][6], c[1][5]];
    for run in [&elsewhere, &repeated, &short_elsewhere, &short_repeated] {
        let err = t.store(0, run, Some(c[1][4]), HELD).unwrap_err();
        assert_eq!(err, StoreRefusal::Conflict(run[run.len() - 1]));
        assert_eq!((shape(&t), t.nodes.len()), (before.clone(), nodes));
    }
    // With a free node to take: it goes back to the free list.
    t.drop_from(1, c[2][0]);
    let (before, free) = (shape(&t), t.free.clone());
    assert!(!free.is_empty());
    let run: Vec<u64> = c[1][5..].iter().copied().chain([c[0][0]]).collect();
    assert!(t.store(0, &run, Some(c[1][4]), HELD).is_err());
    assert_eq!((shape(&t), &t.free), (before, &free));
}

#[test]
fn a_refused_store_that_would_grow_the_block_table_leaves_it_its_size() {
    let c = chains();
    let mut t = Tree::new();
    t.store(0, &c[0][..2], None, HELD).unwrap();
    let (before, bytes) = (shape(&t), t.blocks.bytes());
    // A short new child, a long one, and an append onto worker 0's own leaf, each conflicting
    // (a block in the tree, or one repeated) and each needing the table to grow.
    let long: Vec<u64> = c[2][5..].iter().copied().chain([c[0][0]]).collect();
    let runs = [
        (vec![c[1][7], c[0][1]], None),
        (long, None),
        (vec![c[0][5], c[0][6], c[0][5]], Some(c[0][1])),
    ];
    for (run, parent) in runs {
        assert!(t.blocks.must_grow(run.len()));
        let err = t.store(0, &run, parent, HELD).unwrap_err();
        assert_eq!(err, StoreRefusal::Conflict(run[run.len() - 1]));
        assert_eq!((shape(&t), t.blocks.bytes()), (before.clone(), bytes));
    }
}

#[test]
fn a_short_run_after_blocks_restored_on_a_leaf_held_alone_extends_it() {
    // Worker 0 reports blocks it holds again with two new ones after them: the new run is
    // staged as a node (its position is known only once the held run is walked), then moved
    // onto the end of the leaf.
    let c = chains();
    let mut t = Tree::new();
    t.store(0, &c[0][..3], None, HELD).unwrap();
    assert_eq!(t.store(0, &c[0][..5], None, HELD).unwrap(), 2);
    let node = t.blocks.get(&t.nodes, c[0][0]).unwrap().node;
    assert_eq!(t.nodes[node as usize].hashes, c[0][..5], "one edge, grown in place");
    assert_eq!(t.live_nodes(), 1);
    shape(&t);
    // And the same run stored by another worker becomes a child of its own.
    assert_eq!(t.store(1, &c[0][..3], None, HELD).unwrap(), 3);
    assert_eq!(t.store(1, &[c[0][0], c[0][1], c[0][2], c[1][8]], None, HELD).unwrap(), 1);
    assert_eq!(t.blocks.get(&t.nodes, c[1][8]).unwrap().offset, 0);
    shape(&t);
}

#[test]
fn a_staged_run_onto_a_leaf_held_alone_extends_it() {
    let c = chains();
    let mut t = Tree::new();
    t.store(0, &c[0][..3], None, HELD).unwrap();
    t.store(0, &c[0][3..], Some(c[0][2]), HELD).unwrap();
    let node = t.blocks.get(&t.nodes, c[0][0]).unwrap().node;
    assert_eq!(t.nodes[node as usize].hashes, c[0], "one edge, grown in place");
    assert_eq!(t.live_nodes(), 1);
    shape(&t);
}

/// A run appended straight onto a leaf its worker holds alone (short or long: every such run
/// is entered at its final place, `stage_onto`) that conflicts, with a block elsewhere in the
/// tree or with itself, is taken back out: the tree is as it was, and the leaf still grows by
/// the next good run. Also where the leaf's base was raised by a split, so that the append
/// renumbers it first (the tests' `BASE_LIMIT` is 12).
#[test]
fn a_run_appended_onto_a_leaf_that_conflicts_leaves_the_tree_as_it_was() {
    let c = chains();
    for head in [0usize, 2] {
        let mut t = Tree::new();
        t.store(1, &c[2], None, HELD).unwrap();
        t.store(0, &c[0][..9], None, HELD).unwrap();
        if head > 0 {
            // Worker 1 takes a short head of worker 0's edge: the split leaves the longer tail
            // in the node, its base raised.
            t.store(1, &c[0][..head], None, HELD).unwrap();
        }
        let leaf = t.blocks.get(&t.nodes, c[0][8]).unwrap().node;
        assert_eq!(t.nodes[leaf as usize].base, head as u32, "head {head}");
        let before = shape(&t);
        let nodes = t.nodes.len();
        let elsewhere = [c[0][9], c[0][10], c[2][3]];
        let repeated = [c[0][9], c[0][10], c[0][9]];
        let longer: Vec<u64> = c[0][9..].iter().copied().chain([c[2][0]]).collect();
        for run in [&elsewhere[..], &repeated[..], &longer[..]] {
            assert!(t.appends_at(Pos { node: leaf, offset: 9 - head }, 0, HELD));
            let err = t.store(0, run, Some(c[0][8]), HELD).unwrap_err();
            assert_eq!(err, StoreRefusal::Conflict(run[run.len() - 1]), "head {head}");
            assert_eq!((shape(&t), t.nodes.len()), (before.clone(), nodes), "head {head}");
        }
        assert_eq!(t.store(0, &c[0][9..], Some(c[0][8]), HELD), Ok((c[0].len() - 9) as u64));
        assert_eq!(t.nodes[leaf as usize].hashes, c[0][head..], "grown in place");
        shape(&t);
    }
}

/// Every store that adds a holding (a new child, a branch inside another worker's edge, a
/// shared prefix taken over, an extension) leaves each worker's leaf set exactly its leaves at
/// their current stamps: a holding added by the store already carries the store's stamp, so
/// touching the path does not re-enter it, and eviction then trims the least recent first.
#[test]
fn stores_that_add_holdings_keep_each_leaf_once_at_its_stamp() {
    let c = chains();
    let mut t = Tree::new();
    let check = |t: &Tree| {
        for w in 0..t.workers.len() as WorkerId {
            t.check_leaves(w);
        }
    };
    t.store(0, &c[0][..4], None, HELD).unwrap(); // a new child of the root
    check(&t);
    t.store(0, &c[0][4..6], Some(c[0][3]), HELD).unwrap(); // appended to its own leaf
    check(&t);
    t.store(1, &c[1], None, HELD).unwrap(); // the shared head taken over, then a new child
    check(&t);
    t.store(2, &c[0][..2], None, RECORDED).unwrap(); // a prefix of an edge: a split
    check(&t);
    t.store(2, &c[0][2..8], Some(c[0][1]), HELD).unwrap(); // confirmed, then new blocks
    check(&t);
    assert_eq!(t.stamp, 5, "a stamp per store");
    // The oldest leaf of worker 0 is its own tail after the split, stamped by its second store.
    let oldest = t.oldest_leaf_stamp(0);
    assert_eq!(oldest, Some(2));
    assert_eq!(t.evict_oldest_leaf(0, 1), 1);
    check(&t);
    shape(&t);
}

/// A worker extending its hold a chunk at a time into a long edge another worker holds alone
/// (a chunked prefill of a shared prompt): each split leaves the longer tail where it is and
/// moves the chunk's entries, so a store moves a few chunks' worth, not the rest of the edge.
#[test]
fn a_chunked_extension_into_a_long_edge_moves_only_the_chunks() {
    let chain = chain_hashes(&(0..120u32).collect::<Vec<u32>>(), 2, 0).expect("valid tokens");
    let mut t = Tree::new();
    t.store(0, &chain[..30], None, HELD).unwrap();
    let long = t.blocks.get(&t.nodes, chain[0]).unwrap().node;
    let chunk = 3;
    for k in 0..8 {
        let (from, to) = (k * chunk, (k + 1) * chunk);
        let parent = (k > 0).then(|| chain[from - 1]);
        t.blocks.moved = 0;
        t.store(1, &chain[from..to], parent, HELD).unwrap();
        // The tail stays in the same node, numbered from where it starts in the chain.
        assert_eq!(t.nodes[long as usize].hashes, chain[to..30]);
        assert_eq!(t.nodes[long as usize].base as usize, to);
        assert!(t.blocks.moved <= 2 * chunk, "chunk {k}: {} entries moved", t.blocks.moved);
        // What the two share is one node again.
        let shared = t.blocks.get(&t.nodes, chain[0]).unwrap().node;
        assert_eq!(t.nodes[shared as usize].hashes, chain[..to]);
        shape(&t);
    }
    // Worker 1 lets go: the shared head (24 blocks) and the tail (6) are one edge again, the
    // tail's entries moved.
    t.blocks.moved = 0;
    assert_eq!(t.drop_from(1, chain[0]), 24);
    assert_eq!(t.blocks.moved, 6);
    assert_eq!(t.live_nodes(), 1);
    let long = t.blocks.get(&t.nodes, chain[0]).unwrap().node;
    assert_eq!(t.nodes[long as usize].hashes, chain[..30]);
    // A short head split off and merged back: only its entries move, both ways, and the long
    // side keeps its node.
    t.blocks.moved = 0;
    t.store(1, &chain[..2], None, HELD).unwrap();
    assert_eq!((t.nodes[long as usize].base, t.blocks.moved), (2, 2));
    assert_eq!(t.drop_from(1, chain[0]), 2);
    assert_eq!((t.nodes[long as usize].base, t.blocks.moved), (0, 4));
    assert_eq!(t.nodes[long as usize].hashes, chain[..30]);
    shape(&t);
    // Split again near the head, then the tail grows past the renumbering limit: the node is
    // renumbered from zero and every block is still found.
    t.store(1, &chain[..2], None, HELD).unwrap();
    assert!(t.nodes[long as usize].base > 0);
    t.store(0, &chain[30..60], Some(chain[29]), HELD).unwrap();
    assert_eq!(t.nodes[long as usize].hashes, chain[2..60]);
    assert_eq!(t.nodes[long as usize].base, 0);
    shape(&t);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Any tree of a few workers' stores and records, any held block dropped: the same tree
    /// either way.
    #[test]
    fn drop_from_leaves_what_a_split_leaves(
        stores in prop::collection::vec((0u32..3, 0usize..4, 0usize..12, 0usize..12, any::<bool>()), 1..12),
        drop in any::<prop::sample::Index>(),
    ) {
        let c = chains();
        let mut t = Tree::new();
        for (w, chain, a, b, confirmed) in stores {
            let (a, b) = (a.min(b), a.max(b) + 1);
            let attrs = if confirmed { HELD } else { RECORDED };
            // From the root, or after a block this worker holds already.
            let a = if a > 0 && t.holds(w, c[chain][a - 1]) { a } else { 0 };
            let parent = (a > 0).then(|| c[chain][a - 1]);
            t.store(w, &c[chain][a..b], parent, attrs).expect("a chain");
        }
        let held: Vec<(WorkerId, u64)> = (0..3)
            .flat_map(|w| t.holdings(w).into_iter().map(move |(h, _, _)| (w, h)))
            .collect();
        let (w, hash) = *drop.get(&held);
        let mut by_split = t.clone();
        prop_assert_eq!(t.drop_from(w, hash), drop_by_split(&mut by_split, w, hash));
        prop_assert_eq!(shape(&t), shape(&by_split));
    }
}
