//! Clearing a worker in steps: matches on other threads never see it half cleared, get in
//! between the steps, and writes for it land after the clear.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rmpv::Value;

use super::{IndexConfig, PrefixIndex, Tier, WorkerKey, BETWEEN_CLEAR_STEPS, CLEAR_STEP};

const BIG: WorkerKey = WorkerKey::Int(1);
const OTHER: WorkerKey = WorkerKey::Int(2);

fn index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig::default()).unwrap()
}

/// `count` chains of `len` blocks, each of its own root, hashes from `first` on.
fn chains(first: u64, count: u64, len: u64) -> Vec<Vec<u64>> {
    (0..count).map(|c| (0..len).map(|j| first + c * len + j).collect()).collect()
}

fn store_all(index: &PrefixIndex, worker: &WorkerKey, chains: &[Vec<u64>]) {
    for chain in chains {
        index.store(worker, chain, None, Tier::Gpu).unwrap();
    }
}

/// The leading blocks `worker` holds of `hashes` by a match (0 when it is not in the result).
fn depth(index: &PrefixIndex, worker: &WorkerKey, hashes: &[u64]) -> u32 {
    let id = index.worker_id(worker);
    let m = index.match_hashes(hashes, 0.0);
    m.entries.iter().find(|e| Some(e.worker) == id).map_or(0, |e| e.blocks)
}

/// Runs `f` on another thread and waits for it at most 10 s (a lock still held would hang it).
fn on_other_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(Duration::from_secs(10)).expect("the other thread got the lock")
}

fn set_hook(hook: impl FnMut(&PrefixIndex) + 'static) {
    BETWEEN_CLEAR_STEPS.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
}

fn clear_hook() {
    BETWEEN_CLEAR_STEPS.with(|h| *h.borrow_mut() = None);
}

#[test]
fn a_clear_in_steps_leaves_the_index_as_a_clear_at_once_does() {
    let (stepped, whole) = (index(), index());
    let big = chains(1000, 40, 25);
    let shared = &big[..5];
    for idx in [&stepped, &whole] {
        store_all(idx, &BIG, &big);
        store_all(idx, &OTHER, shared);
    }
    assert!(stepped.held_blocks(&BIG) > 100 * CLEAR_STEP);
    assert_eq!(stepped.clear(&BIG).unwrap(), 1000);
    // The same clear, as one step, straight on the tree.
    {
        let mut st = whole.state.write();
        let w = st.workers.id(&BIG).unwrap();
        st.workers.engine.take_worker(w);
        assert_eq!(st.tree.clear_worker(w), 1000);
    }
    assert_eq!(stepped.stats(), whole.stats());
    assert_eq!(stepped.holdings(&OTHER).unwrap(), whole.holdings(&OTHER).unwrap());
    assert_eq!(stepped.held_blocks(&BIG), 0);
    for chain in &big {
        assert_eq!(depth(&stepped, &BIG, chain), 0);
    }
    // The worker is usable again.
    store_all(&stepped, &BIG, &big[..2]);
    assert_eq!(stepped.held_blocks(&BIG), 50);
}

#[test]
fn between_steps_matches_get_in_and_see_the_worker_gone() {
    let index = Arc::new(index());
    let big = chains(1000, 20, 30);
    store_all(&index, &BIG, &big);
    store_all(&index, &OTHER, &big[..1]);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (idx, log, probe) = (Arc::clone(&index), Arc::clone(&seen), big[0].clone());
    set_hook(move |_| {
        let (idx, probe) = (Arc::clone(&idx), probe.clone());
        let got = on_other_thread(move || {
            let m = idx.match_hashes(&probe, 0.0);
            let left = idx.stats().holdings;
            (m.entries.len(), depth(&idx, &OTHER, &probe), left, idx.held_blocks(&BIG))
        });
        log.lock().unwrap().push(got);
    });
    let dropped = index.clear(&BIG).unwrap();
    clear_hook();
    assert_eq!(dropped, 600);
    let seen = seen.lock().unwrap();
    assert!(seen.len() >= 600 / CLEAR_STEP as usize - 2, "{} steps seen", seen.len());
    for &(entries, other, _, held) in seen.iter() {
        assert_eq!((entries, other, held), (1, 30, 0), "only the other worker, all of it");
    }
    // Half cleared: holdings of the cleared worker were still in the tree, fewer each step.
    let holdings: Vec<usize> = seen.iter().map(|s| s.2).collect();
    assert!(holdings.first() > holdings.last(), "{holdings:?}");
}

#[test]
fn writes_for_a_worker_being_cleared_land_after_the_clear() {
    let index = Arc::new(index());
    let big = chains(1000, 10, 30);
    store_all(&index, &BIG, &big);
    store_all(&index, &OTHER, &big[..1]);
    let (idx, done) = (Arc::clone(&index), Arc::new(AtomicBool::new(false)));
    let once = Arc::clone(&done);
    set_hook(move |_| {
        if once.swap(true, Ordering::SeqCst) {
            return;
        }
        let idx = Arc::clone(&idx);
        on_other_thread(move || {
            // A decision recorded meanwhile is dropped, not made to wait.
            assert_eq!(idx.record(&BIG, &[7, 8], 10.0, 0.0).unwrap(), 0);
            // A store waits for (and helps finish) the clear, then lands.
            idx.store(&BIG, &[5, 6], None, Tier::Gpu).unwrap();
            // So does a store whose parent the worker held before the clear: refused.
            let err = idx.store(&BIG, &[9], Some(1000), Tier::Gpu).unwrap_err();
            assert!(err.to_string().contains("does not hold parent"), "{err}");
        });
    });
    index.clear(&BIG).unwrap();
    clear_hook();
    assert!(done.load(Ordering::SeqCst));
    let held: Vec<u64> = index.holdings(&BIG).unwrap().iter().map(|h| h.0).collect();
    assert_eq!(held, vec![5, 6]);
    assert_eq!(index.stats().blocks, 32);
}

#[test]
fn threads_matching_during_clears_see_a_worker_whole_or_gone() {
    let index = Arc::new(index());
    let big = chains(1000, 50, 40);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    store_all(&index, &OTHER, &big[..3]);
    let readers: Vec<_> = (0..3)
        .map(|t| {
            let (index, stop, big) = (Arc::clone(&index), Arc::clone(&stop), big.clone());
            let started = Arc::clone(&started);
            std::thread::spawn(move || {
                let mut matches = 0u64;
                started.fetch_add(1, Ordering::SeqCst);
                while !stop.load(Ordering::Relaxed) {
                    let chain = &big[(matches as usize * 7 + t) % big.len()];
                    let m = index.match_hashes(chain, 0.0);
                    for e in &m.entries {
                        assert_eq!(e.blocks, 40, "worker {} seen half cleared", e.worker);
                    }
                    matches += 1;
                }
                matches
            })
        })
        .collect();
    while started.load(Ordering::SeqCst) < 3 {
        std::thread::yield_now();
    }
    for round in 0..20 {
        store_all(&index, &BIG, &big);
        assert_eq!(index.clear(&BIG).unwrap(), 2000, "round {round}");
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.holdings), (120, 3));
}

/// A vLLM `BlockStored` event (array-encoded): blocks `hashes` holding `tokens` (block size
/// 1), under engine block `parent` (None: the root).
fn stored_event(hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> Value {
    Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        parent.map_or(Value::Nil, Value::from),
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(1),
        Value::Nil,
        Value::from("GPU"),
    ])
}

/// The msgpack payload of a vLLM event batch holding `events`.
fn payload_of(ts: f64, events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events), Value::Nil]);
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// A vLLM batch: blocks `hashes` stored from the root (a token per block, index block size 1),
/// then optionally a clear, then blocks `after`.
fn batch(hashes: &[u64], clear: bool, after: &[u64]) -> Vec<u8> {
    let tokens = |hs: &[u64]| hs.iter().map(|&h| h % 50_000).collect::<Vec<_>>();
    let mut events = vec![stored_event(hashes, None, &tokens(hashes))];
    if clear {
        events.push(Value::Array(vec![Value::from("AllBlocksCleared")]));
    }
    events.push(stored_event(after, None, &tokens(after)));
    payload_of(1.0, events)
}

#[test]
fn an_event_batch_with_a_large_clear_applies_as_one_in_order() {
    let config = IndexConfig { block_size: 1, ..IndexConfig::default() };
    let index = PrefixIndex::new(config).unwrap();
    let first: Vec<u64> = (1..=500).collect();
    index.apply_vllm_events(&BIG, &batch(&first, false, &[])).unwrap();
    assert_eq!(index.held_blocks(&BIG), 500);
    let second: Vec<u64> = (501..=900).collect();
    let report = index.apply_vllm_events(&BIG, &batch(&second, true, &[901, 902])).unwrap();
    assert_eq!((report.events, report.cleared, report.blocks_stored), (3, 1, 402));
    // Everything before the clear is gone; the two blocks after it are held, and found by
    // their engine hashes (a later event's parent).
    assert_eq!(index.held_blocks(&BIG), 2);
    let more = payload_of(2.0, vec![stored_event(&[903], Some(902), &[903])]);
    let report = index.apply_vllm_events(&BIG, &more).unwrap();
    assert_eq!((report.blocks_stored, report.unknown_parent), (1, 0));
    assert_eq!(index.held_blocks(&BIG), 3);
    assert_eq!(index.stats().blocks, 3);
}

#[test]
fn a_snapshot_taken_during_a_clear_waits_for_it() {
    let index = Arc::new(index());
    store_all(&index, &BIG, &chains(1000, 10, 30));
    store_all(&index, &OTHER, &chains(9000, 1, 5));
    let (idx, taken) = (Arc::clone(&index), Arc::new(std::sync::Mutex::new(None)));
    let slot = Arc::clone(&taken);
    set_hook(move |_| {
        if slot.lock().unwrap().is_none() {
            let idx = Arc::clone(&idx);
            *slot.lock().unwrap() = Some(on_other_thread(move || idx.dumps(0.0)));
        }
    });
    index.clear(&BIG).unwrap();
    clear_hook();
    let snap = taken.lock().unwrap().take().expect("a snapshot taken between steps");
    let loaded = PrefixIndex::loads(&snap, 0.0).unwrap();
    assert_eq!(loaded.stats().blocks, 5);
    assert_eq!(loaded.held_blocks(&BIG), 0);
}

/// Probe 53 F1: a clear whose steps another thread finished (a snapshot, a write for the
/// worker) returned only the blocks of its own steps (often 0), not all it dropped.
#[test]
fn a_clear_finished_by_another_thread_returns_every_block_it_dropped() {
    type Helper = fn(&PrefixIndex);
    let helpers: [Helper; 2] = [
        |idx| {
            idx.dumps(0.0);
        },
        |idx| {
            idx.store(&BIG, &[77_777], None, Tier::Gpu).unwrap();
        },
    ];
    for (i, helper) in helpers.into_iter().enumerate() {
        for remove in [false, true] {
            let index = Arc::new(index());
            store_all(&index, &BIG, &chains(1000, 10, 30));
            store_all(&index, &OTHER, &chains(9000, 1, 5));
            let held = index.held_blocks(&BIG);
            assert!(held > 2 * CLEAR_STEP, "{held} blocks clear at once");
            let (idx, helped) = (Arc::clone(&index), Arc::new(AtomicBool::new(false)));
            let flag = Arc::clone(&helped);
            set_hook(move |_| {
                if !flag.swap(true, Ordering::SeqCst) {
                    let idx = Arc::clone(&idx);
                    on_other_thread(move || helper(&idx));
                }
            });
            let dropped =
                if remove { index.remove_worker(&BIG) } else { index.clear(&BIG) }.unwrap();
            clear_hook();
            assert!(helped.load(Ordering::SeqCst), "helper {i}: no step was taken elsewhere");
            assert_eq!(dropped, held, "helper {i}, remove_worker: {remove}");
            assert_eq!(index.stats().blocks, 5 + usize::from(i == 1));
            assert!(index.state.read().clears.running.is_empty());
            assert!(index.state.read().clears.done.is_empty());
        }
    }
}

#[test]
fn a_large_clear_sweeps_the_engine_hash_map_in_steps() {
    let config = IndexConfig { block_size: 1, ..IndexConfig::default() };
    let index = PrefixIndex::new(config).unwrap();
    for start in (1..=40_000u64).step_by(4000) {
        let hashes: Vec<u64> = (start..start + 4000).collect();
        let mut payload = batch(&hashes, false, &[]);
        if start > 1 {
            // Each chain continues the previous one.
            let parent = Value::from(start - 1);
            let mut value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
            if let Value::Array(parts) = &mut value {
                if let Value::Array(events) = &mut parts[1] {
                    if let Value::Array(fields) = &mut events[0] {
                        fields[2] = parent;
                    }
                }
            }
            payload.clear();
            rmpv::encode::write_value(&mut payload, &value).unwrap();
        }
        index.apply_vllm_events(&BIG, &payload).unwrap();
    }
    assert_eq!(index.stats().engine_blocks, 40_000);
    index.apply_vllm_events(&OTHER, &batch(&[900_001], false, &[])).unwrap();
    let report = index.apply_vllm_events(&BIG, &batch(&[], true, &[])).unwrap();
    assert_eq!(report.cleared, 1);
    // Swept down to what the map keeps between sweeps (twice the live blocks and a margin).
    let stats = index.stats();
    assert_eq!(stats.blocks, 1);
    assert!(stats.engine_blocks <= 2 + 4096, "{} entries left", stats.engine_blocks);
}

#[test]
fn engines_with_their_own_hash_seeds_do_not_sweep_every_batch() {
    // vLLM picks a random hash seed per engine unless told otherwise: eight engines storing the
    // same prompts give the shared map eight entries per index block, all live. Sweeping must
    // still cost O(1) an entry (it swept the whole map after every batch: 435 us a batch of
    // 32 blocks where 100 would do, growing with the map).
    let config = IndexConfig { block_size: 1, ..IndexConfig::default() };
    let index = PrefixIndex::new(config).unwrap();
    let mut inserted = 0usize;
    for prompt in 0..300u64 {
        let tokens: Vec<u64> = (0..16).map(|j| prompt * 16 + j).collect();
        for engine in 0..8u64 {
            let hashes: Vec<u64> = tokens.iter().map(|t| (engine << 40) | t).collect();
            let payload = payload_of(1.0, vec![stored_event(&hashes, None, &tokens)]);
            index.apply_vllm_events(&WorkerKey::Int(engine as i64), &payload).unwrap();
            inserted += 16;
        }
    }
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.engine_blocks), (4800, inserted));
    let swept = index.state.read().workers.engine.swept;
    assert!(swept <= 4 * inserted, "{swept} entries visited for {inserted} inserted");
}
