//! An engine storing the same engine block hash again with other content, and a memory cap
//! too small for one block.

use rmpv::Value;

use super::{IndexConfig, PrefixIndex, Tier, WorkerKey};

const W: WorkerKey = WorkerKey::Int(1);
const V: WorkerKey = WorkerKey::Int(2);

fn index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig { block_size: 1, ..IndexConfig::default() }).unwrap()
}

/// An array-encoded vLLM batch of one event.
fn payload(event: Value) -> Vec<u8> {
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![event]), Value::Nil]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// `BlockStored`: engine blocks `hashes` holding `tokens` (engine block size 1), after `parent`.
fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> Vec<u8> {
    stored_sized(hashes, parent, tokens, 1)
}

/// [`stored`] of engine blocks of `engine_bs` tokens each.
fn stored_sized(hashes: &[u64], parent: Option<u64>, tokens: &[u64], engine_bs: u32) -> Vec<u8> {
    payload(Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        parent.map_or(Value::Nil, Value::from),
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(engine_bs),
        Value::Nil,
        Value::from("GPU"),
    ]))
}

fn removed(hashes: &[u64]) -> Vec<u8> {
    payload(Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        Value::from("GPU"),
    ]))
}

#[test]
fn a_hash_stored_again_with_other_content_releases_the_old_blocks() {
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7], None, &[100])).unwrap();
    let report = index.apply_vllm_events(&W, &stored(&[7], None, &[200])).unwrap();
    assert_eq!((report.blocks_stored, report.replaced), (1, 1));
    // The old content is no longer held; the new one is, under the engine's hash.
    let old = index.hash_tokens(&[100u32], None, None).unwrap();
    let new = index.hash_tokens(&[200u32], None, None).unwrap();
    let held: Vec<u64> = index.holdings(&W).unwrap().iter().map(|r| r.0).collect();
    assert_eq!(held, new);
    assert!(!held.contains(&old[0]));
    // And removing the hash leaves the worker holding nothing (before: the old block stayed).
    let report = index.apply_vllm_events(&W, &removed(&[7])).unwrap();
    assert_eq!((report.blocks_removed, report.unknown_removed), (1, 0));
    assert_eq!(index.held_blocks(&W), 0);
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.replaced_engine_blocks), (0, 1));
}

#[test]
fn a_replaced_block_goes_with_the_blocks_below_it() {
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7, 8], None, &[100, 101])).unwrap();
    index.apply_vllm_events(&W, &stored(&[7], None, &[200])).unwrap();
    // Engine block 8 lay below the old content of 7: a removal of 7 would have dropped it.
    assert_eq!(index.held_blocks(&W), 1);
    let report = index.apply_vllm_events(&W, &removed(&[8])).unwrap();
    assert_eq!(report.unknown_removed, 1);
}

#[test]
fn the_same_content_stored_twice_is_no_replacement() {
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7], None, &[100])).unwrap();
    let report = index.apply_vllm_events(&W, &stored(&[7], None, &[100])).unwrap();
    assert_eq!(report.replaced, 0);
    assert_eq!(index.held_blocks(&W), 1);
    assert_eq!(index.stats().replaced_engine_blocks, 0);
}

#[test]
fn another_workers_content_under_the_same_hash_is_left_alone() {
    // Engines with their own hash seeds: worker V's hash 7 names other content than W's.
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7], None, &[100])).unwrap();
    let report = index.apply_vllm_events(&V, &stored(&[7], None, &[200])).unwrap();
    assert_eq!(report.replaced, 0);
    assert_eq!((index.held_blocks(&W), index.held_blocks(&V)), (1, 1));
    // V storing its hash again with W's content replaces V's entry only.
    let report = index.apply_vllm_events(&V, &stored(&[7], None, &[100])).unwrap();
    assert_eq!(report.replaced, 1);
    assert_eq!((index.held_blocks(&W), index.held_blocks(&V)), (1, 1));
    index.apply_vllm_events(&V, &removed(&[7])).unwrap();
    assert_eq!((index.held_blocks(&W), index.held_blocks(&V)), (1, 0));
    index.apply_vllm_events(&W, &removed(&[7])).unwrap();
    assert_eq!(index.stats().blocks, 0);
}

#[test]
fn a_chain_running_through_the_replaced_block_is_kept() {
    // Engine hashes 7 -> 8 -> 7 (a collision): the second 7 lies below the first.
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7, 8], None, &[100, 101])).unwrap();
    let report = index.apply_vllm_events(&W, &stored(&[7], Some(8), &[102])).unwrap();
    assert_eq!((report.blocks_stored, report.replaced), (1, 1));
    assert_eq!(index.held_blocks(&W), 3);
}

#[test]
fn a_cap_below_one_block_is_counted() {
    let config = IndexConfig { block_size: 1, max_bytes: Some(1), ..IndexConfig::default() };
    let index = PrefixIndex::new(config).unwrap();
    assert_eq!(index.max_bytes_emptied(), 0);
    index.store(&W, &[1, 2], None, Tier::Gpu).unwrap();
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.evicted_blocks, stats.max_bytes_emptied), (0, 2, 1));
    // A cap that holds the blocks is not counted.
    let config = IndexConfig { max_bytes: Some(1 << 20), ..IndexConfig::default() };
    let roomy = PrefixIndex::new(config).unwrap();
    roomy.store(&W, &[1, 2], None, Tier::Gpu).unwrap();
    assert_eq!(roomy.stats().max_bytes_emptied, 0);
}

#[test]
fn a_shared_entry_made_anew_is_not_shadowed_by_an_old_own_entry() {
    // V's own entry for 7 (other content than W's shared one) outlived the shared entry, and
    // shadowed the shared entry V's next store of 7 made: a removal of 7 found the old blocks.
    let index = index();
    index.apply_vllm_events(&W, &stored(&[7], None, &[100])).unwrap();
    index.apply_vllm_events(&V, &stored(&[7], None, &[200])).unwrap();
    index.apply_vllm_events(&W, &removed(&[7])).unwrap();
    let report = index.apply_vllm_events(&V, &stored(&[7], None, &[300])).unwrap();
    assert_eq!(report.replaced, 1);
    let report = index.apply_vllm_events(&V, &removed(&[7])).unwrap();
    assert_eq!(report.blocks_removed, 1);
    assert_eq!(index.stats().blocks, 0);
}

/// Engine hashes 1000.. for `n` blocks.
fn engine_hashes(n: u64) -> Vec<u64> {
    (1000..1000 + n).collect()
}

#[test]
fn an_event_longer_than_a_warming_chunk_maps_every_engine_block() {
    // 150 engine blocks: the engine map hashes and inserts them in chunks of 64, and each must
    // map to its own index block (a removal drops that block and everything below it).
    let index = index();
    let tokens: Vec<u64> = (0..150).collect();
    let report = index.apply_vllm_events(&W, &stored(&engine_hashes(150), None, &tokens)).unwrap();
    assert_eq!(report.blocks_stored, 150);
    // V's engine names the same hashes with other content: entries of V's own, past the
    // first chunk too.
    let other: Vec<u64> = (500..650).collect();
    index.apply_vllm_events(&V, &stored(&engine_hashes(150), None, &other)).unwrap();
    let report = index.apply_vllm_events(&V, &removed(&[1100])).unwrap();
    assert_eq!(report.blocks_removed, 1);
    assert_eq!((index.held_blocks(&W), index.held_blocks(&V)), (150, 100));
    // W storing hash 1130 again with other content (after 1129) replaces blocks 130.. only.
    let report = index.apply_vllm_events(&W, &stored(&[1130], Some(1129), &[9999])).unwrap();
    assert_eq!((report.blocks_stored, report.replaced), (1, 1));
    assert_eq!(index.held_blocks(&W), 131);
    let report = index.apply_vllm_events(&W, &removed(&[1070])).unwrap();
    assert_eq!(report.blocks_removed, 1);
    assert_eq!(index.held_blocks(&W), 70);
}

#[test]
fn engine_blocks_of_several_index_blocks_past_a_warming_chunk_keep_their_spans() {
    // Engine blocks of 2 tokens over index blocks of 1: each engine hash names a span of two
    // index blocks; 100 of them cross the 64-block chunk.
    let index = index();
    let tokens: Vec<u64> = (0..200).collect();
    let payload = stored_sized(&engine_hashes(100), None, &tokens, 2);
    let report = index.apply_vllm_events(&W, &payload).unwrap();
    assert_eq!(report.blocks_stored, 100);
    assert_eq!(index.held_blocks(&W), 200);
    let report = index.apply_vllm_events(&W, &removed(&[1070])).unwrap();
    assert_eq!(report.blocks_removed, 1);
    assert_eq!(index.held_blocks(&W), 140);
    // A chain continued after the last engine block left holds on from its last index block.
    let report = index.apply_vllm_events(&W, &stored_sized(&[2000], Some(1069), &[7, 8], 2));
    assert_eq!(report.unwrap().blocks_stored, 1);
    assert_eq!(index.held_blocks(&W), 142);
}
