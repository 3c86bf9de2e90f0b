//! Fuzz target for the vLLM KV-event decoder.
//!
//! Checks, for any input: no panic; an error names an offset inside the payload; every decoding
//! path the processor has (AVX-512 VBMI, AVX2, scalar) gives the same batch or the same error; a
//! successful decode satisfies the decoder's documented invariants, allocates no more elements
//! than the payload has bytes, and survives a round trip (re-encoded canonically as map events,
//! it decodes to the same batch). Decoded batches are handed back (`recycle`), so later inputs
//! also decode into reused token buffers.

#![no_main]

use llmsched_core::vllm_events::{
    decode_event_batch, medium_name, recycle, with_avx2_decoding, with_scalar_decoding,
    DecodeError, EventBatch, KvEvent,
};
use libfuzzer_sys::fuzz_target;
use rmpv::Value;

fuzz_target!(|data: &[u8]| {
    let decoded = decode_event_batch(data);
    same_on_every_path(data, &decoded);
    match decoded {
        Err(err) => assert!(err.offset <= data.len(), "{err} (len {})", data.len()),
        Ok(batch) => {
            check_invariants(&batch, data.len());
            let again = decode_event_batch(&reencode(&batch)).expect("re-encoded batch decodes");
            assert_same_batch(&again, &batch, "round trip");
            assert_eq!(again.unknown_events, 0);
            // Hand the token buffers back, as the prefix index does, so later inputs decode
            // into reused buffers too.
            recycle(again);
            recycle(batch);
        }
    }
});

/// The narrower decoding paths (AVX2, then scalar) decode `data` to `decoded` exactly: the
/// same events, or the same error at the same offset.
fn same_on_every_path(data: &[u8], decoded: &Result<EventBatch, DecodeError>) {
    for (path, other) in [
        ("AVX2", with_avx2_decoding(|| decode_event_batch(data))),
        ("scalar", with_scalar_decoding(|| decode_event_batch(data))),
    ] {
        match (decoded, &other) {
            (Ok(a), Ok(b)) => {
                assert_same_batch(a, b, path);
                assert_eq!(a.unknown_events, b.unknown_events, "{path}: unknown events");
            }
            (Err(a), Err(b)) => assert_eq!(a, b, "{path}: error"),
            _ => panic!("{path} disagrees: {decoded:?} against {other:?}"),
        }
        if let Ok(batch) = other {
            recycle(batch);
        }
    }
}

/// `a` and `b` hold the same timestamp (bit for bit: a NaN is a NaN), rank and events.
fn assert_same_batch(a: &EventBatch, b: &EventBatch, what: &str) {
    assert_eq!(a.ts.to_bits(), b.ts.to_bits(), "{what}: ts");
    assert_eq!(a.dp_rank, b.dp_rank, "{what}: dp_rank");
    assert_eq!(a.events, b.events, "{what}: events");
}

fn check_invariants(batch: &EventBatch, payload_len: usize) {
    assert!(batch.events.len() + batch.unknown_events as usize <= payload_len);
    let mut elements = 0usize;
    for event in &batch.events {
        match event {
            KvEvent::Stored(stored) => {
                assert!(stored.block_size >= 1);
                let blocks = stored.block_hashes.len();
                assert_eq!(stored.token_ids.len(), blocks * stored.block_size as usize);
                assert!(stored.has_extra_keys.is_empty() || stored.has_extra_keys.len() == blocks);
                elements += blocks + stored.token_ids.len() + stored.has_extra_keys.len();
            }
            KvEvent::Removed(removed) => elements += removed.block_hashes.len(),
            KvEvent::AllCleared => {}
        }
    }
    // Every decoded element was read from at least one payload byte.
    assert!(elements <= payload_len, "{elements} elements from {payload_len} bytes");
}

fn opt<T>(value: &Option<T>, to_value: impl Fn(&T) -> Value) -> Value {
    value.as_ref().map_or(Value::Nil, to_value)
}

fn hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|&h| Value::from(h)).collect())
}

fn event_value(event: &KvEvent) -> Value {
    let fields: Vec<(&str, Value)> = match event {
        KvEvent::Stored(e) => {
            let extra = if e.has_extra_keys.is_empty() {
                Value::Nil
            } else {
                let entry = |&present: &bool| {
                    if present {
                        Value::Array(vec![Value::from("x")])
                    } else {
                        Value::Nil
                    }
                };
                Value::Array(e.has_extra_keys.iter().map(entry).collect())
            };
            vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", hashes(&e.block_hashes)),
                ("parent_block_hash", opt(&e.parent_block_hash, |&h| Value::from(h))),
                ("token_ids", Value::Array(e.token_ids.iter().map(|&t| Value::from(t)).collect())),
                ("block_size", Value::from(e.block_size)),
                ("lora_id", opt(&e.lora_id, |&v| Value::from(v))),
                ("medium", Value::from(medium_name(e.medium))),
                ("lora_name", opt(&e.lora_name, |v| Value::from(v.as_str()))),
                ("extra_keys", extra),
                ("group_idx", opt(&e.group_idx, |&v| Value::from(v))),
                ("kv_cache_spec_kind", opt(&e.kv_cache_spec_kind, |v| Value::from(v.as_str()))),
                (
                    "kv_cache_spec_sliding_window",
                    opt(&e.kv_cache_spec_sliding_window, |&v| Value::from(v)),
                ),
            ]
        }
        KvEvent::Removed(e) => vec![
            ("type", Value::from("BlockRemoved")),
            ("block_hashes", hashes(&e.block_hashes)),
            ("medium", Value::from(medium_name(e.medium))),
            ("group_idx", opt(&e.group_idx, |&v| Value::from(v))),
        ],
        KvEvent::AllCleared => vec![("type", Value::from("AllBlocksCleared"))],
    };
    Value::Map(fields.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

fn reencode(batch: &EventBatch) -> Vec<u8> {
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(event_value).collect()),
        opt(&batch.dp_rank, |&v| Value::from(v)),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("writing to a Vec cannot fail");
    out
}
