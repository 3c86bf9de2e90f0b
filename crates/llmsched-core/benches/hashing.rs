//! Pure-Rust block hashing throughput, in tokens per second (`cargo bench --bench hashing`).
//!
//! Scenarios: the xxh3 chain from u32 (hashed in place) and i64 (converted per block) tokens at
//! 10,000 and 1,000,000 tokens; the chain over long blocks (64 and 128 ids, 256 and 512 bytes)
//! with the run-time AVX2 long path and with `xxhash_rust`'s; vLLM's sha256_cbor chain; raw text
//! packed 4 bytes per pseudo-token; a batch of 64 prompts on 1 and 2 threads.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use llmsched_core::hashing::batch::hash_batch;
use llmsched_core::hashing::text::text_chain_hashes;
use llmsched_core::hashing::vllm::{VllmBlockHasher, DEFAULT_NONE_HASH_SEED};
use llmsched_core::hashing::xxh3::with_reference_xxh3;
use llmsched_core::hashing::{chain_hashes, ChainHashes, TokenSlice};

const BLOCK_SIZE: usize = 16;

/// Deterministic token ids below a 150k vocabulary.
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (i.wrapping_mul(2_654_435_761) % 150_000) as u32).collect()
}

fn xxh3_chain(c: &mut Criterion) {
    let mut group = c.benchmark_group("xxh3_chain");
    for n in [10_000, 1_000_000] {
        let as_u32 = tokens(n);
        let as_i64: Vec<i64> = as_u32.iter().map(|&t| i64::from(t)).collect();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("u32", n), &as_u32, |b, t| {
            b.iter(|| chain_hashes(black_box(t), BLOCK_SIZE, 0))
        });
        group.bench_with_input(BenchmarkId::new("i64", n), &as_i64, |b, t| {
            b.iter(|| chain_hashes(black_box(t), BLOCK_SIZE, 0))
        });
    }
    group.finish();
}

/// Each block's hash seeds the next, so this is the latency of one long-block hash; time per
/// element is time per block.
fn xxh3_long_blocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("xxh3_long_block_chain");
    let blocks = 1_000;
    for block_size in [64, 128] {
        let toks = tokens(blocks * block_size);
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_with_input(BenchmarkId::new("run_time_avx2", block_size), &toks, |b, t| {
            b.iter(|| chain_hashes(black_box(t), block_size, 1))
        });
        group.bench_with_input(BenchmarkId::new("xxhash_rust", block_size), &toks, |b, t| {
            b.iter(|| with_reference_xxh3(|| chain_hashes(black_box(t), block_size, 1)))
        });
    }
    group.finish();
}

fn vllm_sha256_cbor(c: &mut Criterion) {
    let mut group = c.benchmark_group("vllm_sha256_cbor");
    let n = 10_000;
    let toks = tokens(n);
    let plain = VllmBlockHasher::new(BLOCK_SIZE, DEFAULT_NONE_HASH_SEED, None, None).unwrap();
    let lora =
        VllmBlockHasher::new(BLOCK_SIZE, DEFAULT_NONE_HASH_SEED, Some("adapter"), None).unwrap();
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function(BenchmarkId::new("event_hashes", n), |b| {
        b.iter(|| plain.event_hashes(black_box(&toks)))
    });
    group.bench_function(BenchmarkId::new("event_hashes_lora", n), |b| {
        b.iter(|| lora.event_hashes(black_box(&toks)))
    });
    group.finish();
}

fn text(c: &mut Criterion) {
    let mut group = c.benchmark_group("text_chain");
    let text: Vec<u8> = (0..40_000u32).map(|i| b'a' + (i * 7 % 26) as u8).collect();
    // Throughput in pseudo-tokens (4 bytes each).
    group.throughput(Throughput::Elements((text.len() / 4) as u64));
    group.bench_function(BenchmarkId::new("block64_partial", text.len()), |b| {
        b.iter(|| text_chain_hashes(black_box(&text), 64, 0, true, 131_072))
    });
    group.finish();
}

fn batch(c: &mut Criterion) {
    let mut group = c.benchmark_group("batch_64_prompts");
    let prompts: Vec<Vec<u32>> = (0..64).map(|i| tokens(2_000 + 250 * i)).collect();
    let slices: Vec<TokenSlice<'_>> = prompts.iter().map(|p| TokenSlice::U32(p)).collect();
    let total: usize = prompts.iter().map(Vec::len).sum();
    let visitor = ChainHashes { block_size: BLOCK_SIZE, chain_seed: 0 };
    group.throughput(Throughput::Elements(total as u64));
    for threads in [1, 2] {
        group.bench_function(BenchmarkId::new("xxh3_threads", threads), |b| {
            b.iter(|| hash_batch(black_box(&slices), threads, |s| s.visit(visitor)))
        });
    }
    group.finish();
}

criterion_group!(benches, xxh3_chain, xxh3_long_blocks, vllm_sha256_cbor, text, batch);
criterion_main!(benches);
