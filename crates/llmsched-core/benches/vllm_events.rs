//! Decode throughput of vLLM KV-event batches, in blocks per second.
//!
//! Scenario: one engine step's batch of 64 `BlockStored` events, each storing 16 blocks of 16
//! tokens (1,024 blocks, 16,384 tokens) with token ids drawn from a 150k vocabulary, written the
//! way vLLM 0.32 writes them (map events with extra_keys, group_idx, kv_cache_spec_kind), and the
//! same batch in the older array encoding. Then one `BlockStored` of 30 blocks of 64 tokens (the
//! mean event of `bench_peers_index.py --size large`) from a 128k vocabulary, whose ids mix the
//! u16 and u32 forms, decoded on the default path (AVX-512 VBMI chunks or AVX2 steps, whichever
//! the processor has), on the AVX2 steps at most, and on the scalar path.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use llmsched_core::vllm_events::{
    decode_event_batch, recycle, with_avx2_decoding, with_scalar_decoding,
};
use rmpv::Value;
use std::hint::black_box;

const EVENTS: usize = 64;
const BLOCKS_PER_EVENT: usize = 16;
const BLOCK_SIZE: usize = 16;

/// A small deterministic generator (SplitMix64) so the payload is the same on every run.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn stored_event(rng: &mut u64, as_map: bool) -> Value {
    let hashes: Vec<Value> = (0..BLOCKS_PER_EVENT).map(|_| Value::from(splitmix(rng))).collect();
    let tokens: Vec<Value> =
        (0..BLOCKS_PER_EVENT * BLOCK_SIZE).map(|_| Value::from(splitmix(rng) % 150_000)).collect();
    let fields: Vec<(&str, Value)> = vec![
        ("block_hashes", Value::Array(hashes)),
        ("parent_block_hash", Value::from(splitmix(rng))),
        ("token_ids", Value::Array(tokens)),
        ("block_size", Value::from(BLOCK_SIZE as u64)),
        ("lora_id", Value::Nil),
        ("medium", Value::from("GPU")),
        ("lora_name", Value::Nil),
        ("extra_keys", Value::Array(vec![Value::Nil; BLOCKS_PER_EVENT])),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", Value::from("full_attention")),
    ];
    if as_map {
        let mut entries = vec![(Value::from("type"), Value::from("BlockStored"))];
        entries.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
        Value::Map(entries)
    } else {
        let mut items = vec![Value::from("BlockStored")];
        items.extend(fields.into_iter().map(|(_, v)| v));
        Value::Array(items)
    }
}

fn payload(as_map: bool) -> Vec<u8> {
    let mut rng = 42u64;
    let events = (0..EVENTS).map(|_| stored_event(&mut rng, as_map)).collect();
    let batch = Value::Array(vec![Value::F64(1.8e9), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encoding to a Vec cannot fail");
    out
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("vllm_events_decode");
    group.throughput(Throughput::Elements((EVENTS * BLOCKS_PER_EVENT) as u64));
    for (name, as_map) in [("map_events", true), ("array_events", false)] {
        let bytes = payload(as_map);
        let decoded = decode_event_batch(&bytes).expect("the bench payload decodes");
        assert_eq!(decoded.events.len(), EVENTS);
        group.bench_with_input(BenchmarkId::new(name, bytes.len()), &bytes, |b, bytes| {
            b.iter(|| decode_event_batch(black_box(bytes)))
        });
    }
    group.finish();
}

/// One array-encoded `BlockStored` of `blocks` blocks of `block_size` tokens, ids below `vocab`.
fn long_event(blocks: usize, block_size: usize, vocab: u64) -> Vec<u8> {
    let mut rng = 7u64;
    let hashes = (0..blocks).map(|_| Value::from(splitmix(&mut rng))).collect();
    let tokens =
        (0..blocks * block_size).map(|_| Value::from(splitmix(&mut rng) % vocab)).collect();
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes),
        Value::Nil,
        Value::Array(tokens),
        Value::from(block_size as u64),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let batch = Value::Array(vec![Value::F64(1.8e9), Value::Array(vec![event]), Value::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encoding to a Vec cannot fail");
    out
}

fn bench_token_ids(c: &mut Criterion) {
    const BLOCKS: usize = 30;
    let mut group = c.benchmark_group("vllm_events_token_ids");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    let bytes = long_event(BLOCKS, 64, 128_000);
    assert_eq!(
        decode_event_batch(&bytes),
        with_scalar_decoding(|| decode_event_batch(&bytes)),
        "the default and scalar paths agree"
    );
    assert_eq!(
        decode_event_batch(&bytes),
        with_avx2_decoding(|| decode_event_batch(&bytes)),
        "the default and AVX2 paths agree"
    );
    for name in ["default", "avx2", "scalar"] {
        group.bench_with_input(BenchmarkId::new(name, "bs64x30"), &bytes, |b, bytes| {
            let decode = || recycle(decode_event_batch(black_box(bytes)).expect("decodes"));
            match name {
                "scalar" => with_scalar_decoding(|| b.iter(decode)),
                "avx2" => with_avx2_decoding(|| b.iter(decode)),
                _ => b.iter(decode),
            }
        });
    }
    group.finish();
}

criterion_group!(benches, bench_decode, bench_token_ids);
criterion_main!(benches);
