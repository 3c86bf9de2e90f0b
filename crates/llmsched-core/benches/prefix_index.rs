//! Criterion benchmarks of the prefix index (pure Rust figures, no Python call overhead).
//!
//! Workload: 16 shared system prompts, multi-turn sessions of 1,000-10,000 tokens, block size 16,
//! 10,000 stored sequences over 64 workers. Scenario ids: hit (a 625-block prompt extending the
//! longest stored sequence), miss (an unknown prompt), partial (shared system prompt only),
//! store (fresh sequences into an empty index), concurrent (two threads matching at once).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use llmsched_core::hashing::chain_hashes;
use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, Tier, WorkerKey};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
    fn tokens(&mut self, n: u64) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 128_000) as u32).collect()
    }
}

fn workload(workers: u64, sequences: usize) -> Vec<(u64, Vec<u32>)> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let systems: Vec<Vec<u32>> = (0..16)
        .map(|_| {
            let n = rng.range(800, 2000);
            rng.tokens(n)
        })
        .collect();
    let mut out = Vec::new();
    let mut session = 0usize;
    while out.len() < sequences {
        let mut prompt = systems[session % systems.len()].clone();
        let worker = rng.range(0, workers);
        for _ in 0..5 {
            let n = rng.range(200, 1600);
            prompt.extend(rng.tokens(n));
            if prompt.len() > 10_000 {
                break;
            }
            out.push((worker, prompt.clone()));
        }
        session += 1;
    }
    out.truncate(sequences);
    out
}

fn loaded(workers: u64) -> (PrefixIndex, Vec<Vec<u64>>) {
    let index = PrefixIndex::new(IndexConfig::default()).expect("valid config");
    let seqs = workload(workers, 10_000);
    let mut hashes = Vec::new();
    for (w, tokens) in &seqs {
        let h = chain_hashes(tokens, 16, 0).expect("valid tokens");
        index.store(&WorkerKey::Int(*w as i64), &h, None, Tier::Gpu).expect("a chain");
        hashes.push(h);
    }
    (index, hashes)
}

fn query(hashes: &[Vec<u64>], rng: &mut Rng) -> Vec<u64> {
    let longest = hashes.iter().max_by_key(|h| h.len()).expect("sequences");
    let mut q = longest.clone();
    q.truncate(625);
    let tail = rng.tokens((625 - q.len() as u64) * 16);
    let last = *q.last().expect("non-empty");
    q.extend(chain_hashes(&tail, 16, last).expect("valid tokens"));
    q
}

fn bench_match(c: &mut Criterion) {
    let mut rng = Rng(7);
    for workers in [64u64, 1024] {
        let (index, hashes) = loaded(workers);
        let hit = query(&hashes, &mut rng);
        let miss = chain_hashes(&rng.tokens(10_000), 16, 0).expect("valid tokens");
        let mut partial = hashes[0][..50].to_vec();
        partial.extend(chain_hashes(&rng.tokens(575 * 16), 16, partial[49]).expect("valid"));
        let mut g = c.benchmark_group(format!("match/{workers}_workers"));
        g.throughput(Throughput::Elements(625));
        for (name, q) in [("hit", &hit), ("miss", &miss), ("partial", &partial)] {
            g.bench_function(name, |b| b.iter(|| black_box(index.match_hashes(black_box(q), 0.0))));
        }
        g.finish();
    }
}

fn bench_store(c: &mut Criterion) {
    let seqs = workload(64, 200);
    let hashes: Vec<(u64, Vec<u64>)> =
        seqs.iter().map(|(w, t)| (*w, chain_hashes(t, 16, 0).expect("valid"))).collect();
    let blocks: u64 = hashes.iter().map(|(_, h)| h.len() as u64).sum();
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("200_sequences_64_workers", |b| {
        b.iter_batched(
            || PrefixIndex::new(IndexConfig::default()).expect("valid config"),
            |index| {
                for (w, h) in &hashes {
                    index.store(&WorkerKey::Int(*w as i64), h, None, Tier::Gpu).expect("chain");
                }
                index
            },
            criterion::BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// Matches per second with one thread and with two, over the same shared index.
fn bench_concurrent(c: &mut Criterion) {
    let (index, hashes) = loaded(64);
    let q = query(&hashes, &mut Rng(11));
    let mut g = c.benchmark_group("concurrent");
    g.throughput(Throughput::Elements(20_000));
    for threads in [1usize, 2] {
        g.bench_function(format!("{threads}_threads_20000_matches"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    std::thread::scope(|s| {
                        for _ in 0..threads {
                            s.spawn(|| {
                                for _ in 0..20_000 / threads {
                                    black_box(index.match_hashes(&q, 0.0));
                                }
                            });
                        }
                    });
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_match, bench_store, bench_concurrent
}
criterion_main!(benches);
