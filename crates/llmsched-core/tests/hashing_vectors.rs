//! vLLM `sha256_cbor` test vectors (`tests/data/vllm_block_hashes.json`) and proptest
//! checks of the hashing definitions against naive restatements.

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use llmsched_core::hashing::batch::hash_batch;
use llmsched_core::hashing::text::{pack_text, text_chain_hashes};
use llmsched_core::hashing::vllm::{encode_block_input, none_hash, VllmBlockHasher};
use llmsched_core::hashing::xxh3::{self, with_reference_xxh3};
use llmsched_core::hashing::{chain_hashes, ChainHashes, HashError, TokenSlice};

/// A test vector of the repository's `tests/data/` (the README there says where each came from).
fn vectors_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data").join(name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn load_vllm_vectors() -> Value {
    let text = std::fs::read_to_string(vectors_file("vllm_block_hashes.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn vllm_vectors_every_case() {
    let v = load_vllm_vectors();
    let tokens: Vec<u32> =
        v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let block_size = v["block_size"].as_u64().unwrap() as usize;
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for case in cases {
        assert!(case["extra_keys"].is_null());
        let seed = case["seed"].as_str().unwrap();
        let hasher = VllmBlockHasher::new(block_size, seed, None, None).unwrap();
        assert_eq!(hex(hasher.none_hash()), case["none_hash_hex"].as_str().unwrap());
        let digests: Vec<String> =
            hasher.digests(&tokens).unwrap().iter().map(|d| hex(d)).collect();
        let expect: Vec<&str> = case["block_hashes_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap())
            .collect();
        assert_eq!(digests, expect, "seed {seed}");
        let events: Vec<u64> =
            case["event_uint64"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect();
        assert_eq!(hasher.event_hashes(&tokens).unwrap(), events, "seed {seed}");
        // Any integer width gives the same digests.
        let as_i64: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        assert_eq!(hasher.event_hashes(&as_i64).unwrap(), events);
    }
}

#[test]
fn vllm_vectors_exact_cbor_bytes() {
    let v = load_vllm_vectors();
    let tokens: Vec<u32> = (0..16).collect();
    let mut seed_cbor = Vec::new();
    minicbor::Encoder::new(&mut seed_cbor).str("vllm-none-hash").unwrap();
    assert_eq!(hex(&seed_cbor), v["cbor_of_seed_vllm-none-hash_hex"].as_str().unwrap());
    let mut block0 = Vec::new();
    encode_block_input(&mut block0, &none_hash("vllm-none-hash"), &tokens, &[]).unwrap();
    assert_eq!(hex(&block0), v["cbor_of_block0_input_hex"].as_str().unwrap());
}

/// The xxh3 chain restated naively: collect each block's bytes, hash, chain.
fn naive_chain(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut prev = seed;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = xxh3_64_with_seed(&bytes, prev);
            prev
        })
        .collect()
}

proptest! {
    #[test]
    fn xxh3_chain_matches_naive(
        tokens in proptest::collection::vec(any::<u32>(), 0..300),
        block_size in 1usize..40,
        seed in any::<u64>(),
    ) {
        let expect = naive_chain(&tokens, block_size, seed);
        prop_assert_eq!(&chain_hashes(&tokens, block_size, seed).unwrap(), &expect);
        let as_i64: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        prop_assert_eq!(&chain_hashes(&as_i64, block_size, seed).unwrap(), &expect);
        let as_u64: Vec<u64> = tokens.iter().map(|&t| u64::from(t)).collect();
        prop_assert_eq!(&chain_hashes(&as_u64, block_size, seed).unwrap(), &expect);
    }

    #[test]
    fn first_bad_id_is_reported(
        mut tokens in proptest::collection::vec(0i64..1000, 1..200),
        bad in prop_oneof![i64::MIN..0, (1i64 << 32)..i64::MAX],
        at in any::<prop::sample::Index>(),
        block_size in 1usize..20,
    ) {
        let position = at.index(tokens.len());
        tokens[position] = bad;
        // A later bad id, possibly in the unhashed tail, must not mask the first.
        let last = tokens.len() - 1;
        if position < last {
            tokens[last] = -1;
        }
        let expect = HashError::TokenOutOfRange { position, value: i128::from(bad) };
        prop_assert_eq!(chain_hashes(&tokens, block_size, 0), Err(expect.clone()));
        let vllm = VllmBlockHasher::new(block_size, "s", None, None).unwrap();
        prop_assert_eq!(vllm.digests(&tokens), Err(expect));
    }

    #[test]
    fn xxh3_equals_xxhash_rust_at_any_length_seed_and_offset(
        bytes in proptest::collection::vec(any::<u8>(), 0..2_600),
        seed in prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()],
        start in 0usize..8,
    ) {
        let input = &bytes[start.min(bytes.len())..];
        let expect = xxh3_64_with_seed(input, seed);
        prop_assert_eq!(xxh3::xxh3_64_with_seed(input, seed), expect);
        prop_assert_eq!(with_reference_xxh3(|| xxh3::xxh3_64_with_seed(input, seed)), expect);
    }

    #[test]
    fn text_full_blocks_are_the_chain_over_packed_text(
        text in proptest::collection::vec(any::<u8>(), 0..600),
        block_size in 1usize..40,
        seed in any::<u64>(),
        max_tokens in 0usize..200,
    ) {
        let packed = pack_text(&text);
        let kept = &packed[..packed.len().min(max_tokens)];
        let full = naive_chain(kept, block_size, seed);
        let only_full = text_chain_hashes(&text, block_size, seed, false, max_tokens).unwrap();
        prop_assert_eq!(&only_full, &full);
        let got = text_chain_hashes(&text, block_size, seed, true, max_tokens).unwrap();
        prop_assert_eq!(&got[..full.len()], &full[..]);
        let tail = &kept[full.len() * block_size..];
        prop_assert_eq!(got.len(), full.len() + usize::from(!tail.is_empty()));
        if let Some(&last) = got.get(full.len()) {
            let bytes: Vec<u8> = tail.iter().flat_map(|t| t.to_le_bytes()).collect();
            let parent = full.last().copied().unwrap_or(seed);
            prop_assert_eq!(last, xxh3_64_with_seed(&bytes, parent));
        }
    }

    #[test]
    fn batch_equals_one_by_one(
        prompts in proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..100), 0..12),
        threads in 1usize..4,
        block_size in 1usize..10,
    ) {
        let slices: Vec<TokenSlice<'_>> = prompts.iter().map(|p| TokenSlice::U32(p)).collect();
        let visitor = ChainHashes { block_size, chain_seed: 3 };
        let got = hash_batch(&slices, threads, |s| s.visit(visitor)).unwrap();
        let expect: Vec<Vec<u64>> = prompts.iter().map(|p| naive_chain(p, block_size, 3)).collect();
        prop_assert_eq!(got, expect);
    }
}
