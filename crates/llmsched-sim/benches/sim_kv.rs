//! The simulator's KV cache, per request life cycle (start, allocate, commit, free, take the
//! events) of a 750-block agentic context: [`KvCore`], which the Rust engine runs on contents
//! numbered once per plan, beside [`KvCache`], the same cache addressed by 64-bit hashes (the
//! Python engine's, interning each hash). `evict`: 32 chains cycled through a cache of 20, so
//! every block is evicted and re-filled; `hit`: 16 chains in a cache of 40, every prefix hit.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use llmsched_sim::{Contents, KvCache, KvCore};

const BLOCKS: usize = 750;
const BLOCK_SIZE: u32 = 16;

/// `chains` chains of `BLOCKS` pseudo-random hashes (a splitmix64 stream).
fn chains(chains: usize) -> Vec<Vec<u64>> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..chains).map(|_| (0..BLOCKS).map(|_| next()).collect()).collect()
}

fn life_core(kv: &mut KvCore, req: u64, ids: &[u32]) -> usize {
    let hit = kv.start(req, ids, BLOCKS - 1).unwrap();
    assert!(kv.allocate(req, (BLOCKS as u64) * u64::from(BLOCK_SIZE)).unwrap());
    kv.commit(req, ids, BLOCKS).unwrap();
    kv.free(req).unwrap();
    black_box(kv.take_events());
    hit
}

fn life_hashed(kv: &mut KvCache, req: u64, hashes: &[u64]) -> usize {
    let hit = kv.start(req, hashes, BLOCKS - 1).unwrap();
    assert!(kv.allocate(req, (BLOCKS as u64) * u64::from(BLOCK_SIZE)).unwrap());
    kv.commit(req, hashes, BLOCKS).unwrap();
    kv.free(req).unwrap();
    black_box(kv.take_events());
    hit
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("sim_kv life cycle (750 blocks)");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    for (case, n_chains, capacity) in [("evict", 32, 20), ("hit", 16, 40)] {
        let hashes = chains(n_chains);
        let flat: Vec<u64> = hashes.concat();
        let contents = Contents::number(&flat);
        let ids: Vec<&[u32]> = contents.ids().chunks(BLOCKS).collect();
        let num_blocks = (capacity * BLOCKS) as u32;

        let mut core = KvCore::new(num_blocks, BLOCK_SIZE, contents.unique().len()).unwrap();
        let mut req = 0u64;
        group.bench_function(BenchmarkId::new("KvCore (ids)", case), |b| {
            b.iter(|| {
                req += 1;
                life_core(&mut core, req, ids[req as usize % n_chains])
            })
        });
        let mut hashed = KvCache::new(num_blocks, BLOCK_SIZE).unwrap();
        let mut req = 0u64;
        group.bench_function(BenchmarkId::new("KvCache (hashes)", case), |b| {
            b.iter(|| {
                req += 1;
                life_hashed(&mut hashed, req, &hashes[req as usize % n_chains])
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
