//! `dumps` / `loads`: the index as msgpack bytes, so a restarted router does not start cold.
//!
//! Nodes are written parents first; derived state (block map, leaf order, counts) is rebuilt on
//! load, and every structural invariant is checked, so a corrupt or hostile snapshot is refused
//! rather than loaded.

use hashbrown::{HashMap, HashSet};
use serde::{Deserialize, Serialize};

use super::block_table::BlockTable;
use super::tree::{Attrs, Holder, Node, NodeId, Tree, WorkerId, ROOT};
use super::{ClearTally, IndexConfig, IndexError, State, WorkerKey, Workers};

/// Snapshots are sealed: the msgpack bytes, then their xxh3-64 (8 bytes, little-endian), so a
/// damaged snapshot is refused rather than loaded as another index (the structural checks
/// alone let most one-bit changes through: a hash, a count or a lifetime changed).
const FORMAT: u32 = 2;
/// The first format, without the checksum: still read.
const FORMAT_UNSEALED: u32 = 1;

/// The largest use stamp a snapshot may carry. Stamps count stores (one per call), so no real
/// index comes near it; the bound leaves room to keep counting without overflow.
const MAX_STAMP: u64 = 1 << 62;

#[derive(Serialize, Deserialize)]
struct Snapshot {
    format: u32,
    block_size: u64,
    seed: u64,
    model: Option<String>,
    worker_capacity: Option<u64>,
    max_bytes: Option<u64>,
    stamp: u64,
    workers: Vec<SnapWorker>,
    nodes: Vec<SnapNode>,
}

#[derive(Serialize, Deserialize)]
struct SnapWorker {
    key: Option<WorkerKey>,
    capacity: Option<u64>,
    engine: Vec<(u64, u64, u64, u32)>,
}

#[derive(Serialize, Deserialize)]
struct SnapNode {
    /// Position of the parent in `nodes`, or None for a child of the root.
    parent: Option<u32>,
    hashes: Vec<u64>,
    /// (worker, tiers, confirmed, seconds left for approximate holdings, stamp)
    holders: Vec<(u32, u8, bool, f64, u64)>,
}

pub(super) fn dump(config: &IndexConfig, st: &State, now: f64) -> Vec<u8> {
    let mut order: Vec<NodeId> = Vec::new();
    let mut position: HashMap<NodeId, u32> = HashMap::new();
    let mut stack: Vec<NodeId> = st.tree.nodes[ROOT as usize].children.values().copied().collect();
    while let Some(id) = stack.pop() {
        position.insert(id, order.len() as u32);
        order.push(id);
        stack.extend(st.tree.nodes[id as usize].children.values().copied());
    }
    let nodes = order
        .iter()
        .map(|&id| {
            let n = &st.tree.nodes[id as usize];
            SnapNode {
                parent: (n.parent != ROOT).then(|| position[&n.parent]),
                hashes: n.hashes.clone(),
                holders: n
                    .holders
                    .iter()
                    .map(|h| {
                        let left =
                            if h.attrs.confirmed { f64::INFINITY } else { h.attrs.expires - now };
                        (h.worker, h.attrs.tiers, h.attrs.confirmed, left, h.stamp)
                    })
                    .collect(),
            }
        })
        .collect();
    let workers = (0..st.workers.keys.len())
        .map(|i| SnapWorker {
            key: st.workers.keys[i].clone(),
            capacity: st.workers.capacity[i],
            engine: st
                .workers
                .engine
                .entries_of(i as WorkerId, &st.tree)
                .into_iter()
                .map(|(e, (f, l, n))| (e, f, l, n))
                .collect(),
        })
        .collect();
    let snap = Snapshot {
        format: FORMAT,
        block_size: config.block_size as u64,
        seed: config.seed,
        model: config.model.clone(),
        worker_capacity: config.worker_capacity,
        max_bytes: config.max_bytes,
        stamp: st.tree.stamp,
        workers,
        nodes,
    };
    seal(&snap)
}

/// The snapshot's msgpack bytes followed by their checksum.
fn seal(snap: &Snapshot) -> Vec<u8> {
    sealed(rmp_serde::to_vec(snap).expect("snapshot types always serialise"))
}

fn sealed(mut data: Vec<u8>) -> Vec<u8> {
    let sum = xxhash_rust::xxh3::xxh3_64(&data);
    data.extend_from_slice(&sum.to_le_bytes());
    data
}

/// The snapshot in `data`: sealed with a checksum that matches, or of the first format (no
/// checksum, and no byte after it).
fn open(data: &[u8]) -> Result<Snapshot, IndexError> {
    if let Some((body, sum)) = data.split_last_chunk::<8>() {
        if xxhash_rust::xxh3::xxh3_64(body) == u64::from_le_bytes(*sum) {
            let snap: Snapshot = rmp_serde::from_slice(body).map_err(|e| bad(e.to_string()))?;
            return match snap.format {
                FORMAT => Ok(snap),
                other => Err(bad(format!("unsupported format {other}"))),
            };
        }
    }
    let mut rest = data;
    let snap: Snapshot = rmp_serde::decode::from_read(&mut rest)
        .map_err(|e| bad(format!("damaged or not a snapshot ({e})")))?;
    match snap.format {
        FORMAT_UNSEALED if rest.is_empty() => Ok(snap),
        FORMAT_UNSEALED => Err(bad(format!("{} bytes after its end", rest.len()))),
        FORMAT => Err(bad("damaged: its checksum does not match its content".into())),
        other => Err(bad(format!("unsupported format {other}"))),
    }
}

pub(super) fn load(data: &[u8], now: f64) -> Result<(IndexConfig, State), IndexError> {
    let snap = open(data)?;
    let config = IndexConfig {
        block_size: usize::try_from(snap.block_size).map_err(|_| bad("block_size".into()))?,
        seed: snap.seed,
        model: snap.model,
        worker_capacity: snap.worker_capacity,
        max_bytes: snap.max_bytes,
    };
    config.validate().map_err(|err| bad(err.to_string()))?;
    if snap.stamp > MAX_STAMP {
        return Err(bad(format!("stamp {} is above {MAX_STAMP}", snap.stamp)));
    }
    let workers = load_workers(snap.workers)?;
    let nodes = load_nodes(snap.nodes, &workers, now, snap.stamp)?;
    let tree = Tree::rebuild(nodes, snap.stamp, workers.keys.len())?;
    Ok((config, State { tree, workers, clears: ClearTally::default() }))
}

fn load_workers(snap: Vec<SnapWorker>) -> Result<Workers, IndexError> {
    let mut workers = Workers::default();
    for (i, sw) in snap.into_iter().enumerate() {
        if let Some(key) = &sw.key {
            if workers.ids.insert(key.clone(), i as u32).is_some() {
                return Err(bad(format!("worker {key} appears twice")));
            }
        }
        workers.keys.push(sw.key);
        workers.capacity.push(sw.capacity);
        workers.engine.ensure_worker(i as WorkerId);
        for (e, f, l, n) in sw.engine {
            workers.engine.insert(i as WorkerId, e, (f, l, n));
        }
    }
    Ok(workers)
}

fn load_nodes(
    snap: Vec<SnapNode>,
    workers: &Workers,
    now: f64,
    stamp_now: u64,
) -> Result<Vec<Node>, IndexError> {
    let mut nodes = vec![Node::default()];
    let mut seen: HashSet<u64> = HashSet::new();
    for (i, sn) in snap.into_iter().enumerate() {
        let parent = match sn.parent {
            None => ROOT,
            Some(p) if (p as usize) < i => p + 1,
            Some(p) => return Err(bad(format!("node {i} names parent {p} out of order"))),
        };
        if sn.hashes.is_empty() {
            return Err(bad(format!("node {i} has no blocks")));
        }
        if let Some(h) = sn.hashes.iter().find(|h| !seen.insert(**h)) {
            return Err(bad(format!("block {h:#018x} appears twice")));
        }
        let mut holders = Vec::with_capacity(sn.holders.len());
        for (w, tiers, confirmed, left, stamp) in sn.holders {
            let known = workers.keys.get(w as usize).is_some_and(|k| k.is_some());
            // A holding stamped after the index's own stamp would sort as newer than every later
            // store (LRU eviction order).
            if !known || tiers == 0 || tiers > 0b111 || left.is_nan() || stamp > stamp_now {
                return Err(bad(format!("node {i} has an invalid holding for worker {w}")));
            }
            let expires = if confirmed { f64::INFINITY } else { now + left };
            let attrs = Attrs { tiers, confirmed, expires };
            holders.push(Holder { worker: w, attrs, stamp, child_count: 0 });
        }
        if holders.is_empty() || !holders.windows(2).all(|p| p[0].worker < p[1].worker) {
            return Err(bad(format!("node {i} holders are empty or not sorted")));
        }
        let first = sn.hashes[0];
        let id = nodes.len() as NodeId;
        if nodes[parent as usize].children.insert(first, id).is_some() {
            return Err(bad(format!("node {i} duplicates a sibling")));
        }
        nodes.push(Node { hashes: sn.hashes, parent, holders, ..Default::default() });
    }
    Ok(nodes)
}

fn bad(reason: String) -> IndexError {
    IndexError::Snapshot(reason)
}

impl Tree {
    /// A tree from loaded nodes (index 0 the root, parents before children), with derived state
    /// rebuilt and prefix closure checked.
    fn rebuild(nodes: Vec<Node>, stamp: u64, workers: usize) -> Result<Tree, IndexError> {
        let mut tree = Tree::new();
        tree.nodes = nodes;
        tree.stamp = stamp;
        if workers > 0 {
            tree.ensure_worker(workers as u32 - 1);
        }
        for id in 1..tree.nodes.len() {
            let parent = tree.nodes[id].parent as usize;
            for k in 0..tree.nodes[id].holders.len() {
                let w = tree.nodes[id].holders[k].worker;
                if parent != ROOT as usize {
                    let Some(p) = tree.nodes[parent].holders.iter_mut().find(|h| h.worker == w)
                    else {
                        return Err(bad(format!("worker {w} holds a block without its parent")));
                    };
                    p.child_count += 1;
                }
                tree.workers[w as usize].held += tree.nodes[id].hashes.len() as u64;
            }
            tree.holder_count += tree.nodes[id].holders.len();
        }
        tree.blocks = BlockTable::from_nodes(&tree.nodes);
        for id in 1..tree.nodes.len() {
            for h in &tree.nodes[id].holders {
                if h.child_count == 0 {
                    tree.workers[h.worker as usize].leaves.insert((h.stamp, id as NodeId));
                }
            }
        }
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::prefix_index::{PrefixIndex, Tier};

    /// A small index with confirmed and approximate holdings, engine hashes and two workers.
    fn sample_snapshot() -> Vec<u8> {
        let index = PrefixIndex::new(IndexConfig { block_size: 4, ..IndexConfig::default() })
            .expect("valid config");
        let tokens: Vec<u32> = (0..64).collect();
        let hashes = index.hash_tokens(&tokens, None, None).expect("hashable");
        let a = WorkerKey::Str("a".into());
        let b = WorkerKey::Int(7);
        index.store(&a, &hashes[..10], None, Tier::Gpu).expect("stored");
        index.store(&b, &hashes[..4], None, Tier::Cpu).expect("stored");
        index.record(&b, &hashes[..12], 30.0, 0.0).expect("recorded");
        index.dumps(0.0)
    }

    fn decoded(data: &[u8]) -> Snapshot {
        open(data).expect("decodes")
    }

    fn with_block_size(block_size: u64) -> Vec<u8> {
        let mut snap = decoded(&sample_snapshot());
        snap.block_size = block_size;
        seal(&snap)
    }

    #[test]
    fn a_snapshot_with_any_bit_changed_is_refused_as_damaged() {
        let data = sample_snapshot();
        for i in 0..data.len() {
            for bit in 0..8 {
                let mut damaged = data.clone();
                damaged[i] ^= 1 << bit;
                let err = PrefixIndex::loads(&damaged, 0.0).err();
                assert!(matches!(err, Some(IndexError::Snapshot(_))), "byte {i} bit {bit}");
            }
        }
        let err = PrefixIndex::loads(&data[..data.len() - 1], 0.0).err();
        assert!(matches!(err, Some(IndexError::Snapshot(_))));
    }

    #[test]
    fn a_snapshot_of_the_first_format_without_a_checksum_still_loads() {
        let mut snap = decoded(&sample_snapshot());
        snap.format = FORMAT_UNSEALED;
        let unsealed = rmp_serde::to_vec(&snap).expect("encodes");
        let index = PrefixIndex::loads(&unsealed, 0.0).expect("loads");
        let original = PrefixIndex::loads(&sample_snapshot(), 0.0).expect("loads");
        assert_eq!(index.stats(), original.stats());
        let mut longer = unsealed.clone();
        longer.push(0);
        let err = PrefixIndex::loads(&longer, 0.0).err();
        assert!(matches!(err, Some(IndexError::Snapshot(ref m)) if m.contains("after")), "{err:?}");
        // A sealed snapshot of an unknown format is refused by name.
        snap.format = 9;
        let err = PrefixIndex::loads(&seal(&snap), 0.0).err();
        assert!(matches!(err, Some(IndexError::Snapshot(ref m)) if m.contains("format 9")));
    }

    #[test]
    fn a_snapshot_stamp_that_would_overflow_is_refused() {
        let mut snap = decoded(&sample_snapshot());
        let good_stamp = snap.stamp;
        snap.stamp = u64::MAX;
        let data = seal(&snap);
        let err = PrefixIndex::loads(&data, 0.0).err();
        assert!(matches!(err, Some(IndexError::Snapshot(ref m)) if m.contains("stamp")), "{err:?}");
        // A holding stamped after the index's stamp is refused too.
        snap.stamp = good_stamp;
        snap.nodes[0].holders[0].4 = good_stamp + 1;
        let data = seal(&snap);
        assert!(PrefixIndex::loads(&data, 0.0).is_err());
    }

    #[test]
    fn a_snapshot_with_a_huge_block_size_is_refused() {
        for block_size in
            [0, (crate::hashing::MAX_BLOCK_SIZE + 1) as u64, 1 << 40, 1 << 63, u64::MAX]
        {
            let err = PrefixIndex::loads(&with_block_size(block_size), 0.0).err();
            assert!(
                matches!(err, Some(IndexError::Snapshot(ref m)) if m.contains("block_size")),
                "block_size {block_size}: {err:?}"
            );
        }
        assert!(PrefixIndex::loads(&with_block_size(16), 0.0).is_ok());
    }

    /// Exercises a loaded index the way a router would after a restore.
    fn use_index(index: &PrefixIndex) {
        let tokens: Vec<u32> = (0..64).collect();
        if let Ok(hashes) = index.hash_tokens(&tokens, None, None) {
            let _ = index.match_hashes(&hashes, 1.0);
            let _ = index.record(&WorkerKey::Int(1), &hashes, 5.0, 1.0);
        }
        let _ = index.stats();
        let _ = index.expire(100.0);
        let again = index.dumps(100.0);
        PrefixIndex::loads(&again, 100.0).expect("a dump of a loaded index loads");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        /// Damaged snapshots, sealed again (so that the checks behind the checksum are what
        /// is tested: a snapshot made by other code, or damaged before it was sealed), are
        /// refused or load into a usable index; nothing panics.
        #[test]
        fn damaged_snapshots_never_panic(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let whole = sample_snapshot();
            let mut data = whole[..whole.len() - 8].to_vec();
            for (at, byte) in edits {
                let i = at.index(data.len());
                data[i] = byte;
            }
            if truncate {
                data.truncate(cut.index(data.len()));
            }
            if let Ok(index) = PrefixIndex::loads(&sealed(data), 0.0) {
                use_index(&index);
            }
        }
    }
}
