//! Tests of the vLLM KV-event decoder: shared vectors, a real capture, the old array encoding,
//! hostile payloads, and a proptest round trip through both encodings.

use llmsched_core::prefix_index::Tier;
use llmsched_core::vllm_events::{
    decode_event_batch, medium_name, recycle, with_avx2_decoding, with_scalar_decoding,
    BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, MAX_SKIP_DEPTH,
};
use proptest::prelude::*;
use rmpv::Value;

const KV_EVENTS_VECTOR: &str = "vllm_kv_events.json";
const CAPTURE_VECTOR: &str = "vllm_real_capture_gap.json";

/// Reads a test vector of the repository's `tests/data/` (see the README there for where each
/// came from). A missing vector fails the test.
fn read_json(name: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path:?}: {err}"));
    serde_json::from_str(&text).expect("vector file is JSON")
}

fn from_hex(hex: &str) -> Vec<u8> {
    assert!(hex.len() % 2 == 0, "odd hex length");
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
}

fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn ints<T: Into<Value> + Copy>(values: &[T]) -> Value {
    Value::Array(values.iter().map(|&v| v.into()).collect())
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![Value::F64(12.5), Value::Array(events), Value::from(3)]))
}

fn decode_err(payload: &[u8]) -> String {
    match decode_event_batch(payload) {
        Ok(batch) => panic!("expected an error, decoded {batch:?}"),
        Err(err) => err.to_string(),
    }
}

fn json_u64s(value: &serde_json::Value) -> Vec<u64> {
    value.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

#[test]
fn shared_vector_decodes_as_documented() {
    let vector = read_json(KV_EVENTS_VECTOR);
    let payload = from_hex(vector["payload_hex"].as_str().unwrap());
    let decoded = decode_event_batch(&payload).unwrap();
    let expected = &vector["decoded"];
    assert_eq!(decoded.ts, expected["ts"].as_f64().unwrap());
    assert_eq!(decoded.dp_rank, expected["dp_rank"].as_i64());
    assert_eq!(decoded.unknown_events, 0);
    let expected_events = expected["events"].as_array().unwrap();
    assert_eq!(decoded.events.len(), expected_events.len());
    for (event, want) in decoded.events.iter().zip(expected_events) {
        match (event, want["type"].as_str().unwrap()) {
            (KvEvent::Stored(stored), "BlockStored") => {
                assert_eq!(stored.block_hashes, json_u64s(&want["block_hashes"]));
                assert_eq!(stored.parent_block_hash, want["parent_block_hash"].as_u64());
                let tokens: Vec<u32> =
                    json_u64s(&want["token_ids"]).iter().map(|&t| t as u32).collect();
                assert_eq!(stored.token_ids, tokens);
                assert_eq!(u64::from(stored.block_size), want["block_size"].as_u64().unwrap());
                assert_eq!(medium_name(stored.medium), want["medium"].as_str().unwrap());
                assert_eq!(stored.lora_name, None);
                assert_eq!(stored.lora_id, None);
            }
            (KvEvent::Removed(removed), "BlockRemoved") => {
                assert_eq!(removed.block_hashes, json_u64s(&want["block_hashes"]));
                assert_eq!(medium_name(removed.medium), want["medium"].as_str().unwrap());
            }
            (KvEvent::AllCleared, "AllBlocksCleared") => {}
            (event, kind) => panic!("decoded {event:?}, expected a {kind}"),
        }
    }
}

#[test]
fn every_frame_of_the_real_capture_decodes() {
    let capture = read_json(CAPTURE_VECTOR);
    let block_size = capture["block_size"].as_u64().unwrap() as u32;
    let frames = capture["frames"].as_array().unwrap();
    assert!(!frames.is_empty());
    let (mut stored_blocks, mut removed_blocks) = (0usize, 0usize);
    for (index, frame) in frames.iter().enumerate() {
        let payload = from_hex(frame[2].as_str().unwrap());
        let batch =
            decode_event_batch(&payload).unwrap_or_else(|err| panic!("frame {index}: {err}"));
        assert_eq!(batch.unknown_events, 0);
        assert_eq!(batch.dp_rank, Some(0));
        assert!(batch.ts > 1.7e9, "frame {index}: ts {}", batch.ts);
        for event in &batch.events {
            match event {
                KvEvent::Stored(stored) => {
                    assert_eq!(stored.block_size, block_size);
                    assert_eq!(stored.token_ids.len(), stored.block_hashes.len() * 32);
                    assert_eq!(stored.medium, Tier::Gpu);
                    assert_eq!(stored.group_idx, Some(0));
                    assert_eq!(stored.kv_cache_spec_kind.as_deref(), Some("full_attention"));
                    // The capture's extra_keys are [None, ...]: one flag per block, all false.
                    assert_eq!(stored.has_extra_keys, vec![false; stored.block_hashes.len()]);
                    stored_blocks += stored.block_hashes.len();
                }
                KvEvent::Removed(removed) => {
                    assert_eq!(removed.group_idx, Some(0));
                    removed_blocks += removed.block_hashes.len();
                }
                KvEvent::AllCleared => {}
            }
        }
    }
    assert!(stored_blocks > 0 && removed_blocks > 0, "{stored_blocks} {removed_blocks}");
}

/// A vLLM 0.11-style array-encoded batch: `[tag, block_hashes, parent, tokens, block_size,
/// lora_id, medium]` with no later fields.
fn old_format_batch() -> Vec<u8> {
    batch(vec![
        Value::Array(vec![
            s("BlockStored"),
            ints(&[11u64, 12]),
            Value::from(10u64),
            ints(&[1u32, 2, 3, 4]),
            Value::from(2),
            Value::from(7),
            s("GPU"),
        ]),
        Value::Array(vec![s("BlockRemoved"), ints(&[12u64]), s("CPU")]),
        Value::Array(vec![s("AllBlocksCleared")]),
    ])
}

#[test]
fn old_array_encoding_decodes() {
    let decoded = decode_event_batch(&old_format_batch()).unwrap();
    assert_eq!(
        decoded,
        EventBatch {
            ts: 12.5,
            dp_rank: Some(3),
            unknown_events: 0,
            events: vec![
                KvEvent::Stored(BlockStored {
                    block_hashes: vec![11, 12],
                    parent_block_hash: Some(10),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: Some(7),
                    ..BlockStored::default()
                }),
                KvEvent::Removed(BlockRemoved {
                    block_hashes: vec![12],
                    medium: Tier::Cpu,
                    group_idx: None
                }),
                KvEvent::AllCleared,
            ],
        }
    );
}

#[test]
fn array_encoding_with_every_field_and_trailing_extras() {
    // 0.33 field order, then two fields from a future version.
    let stored = Value::Array(vec![
        s("BlockStored"),
        ints(&[5u64]),
        Value::Nil,
        ints(&[9u32, 8]),
        Value::from(2),
        Value::Nil,
        s("storage"),
        s("adapter-a"),
        Value::Array(vec![Value::Array(vec![s("mm-hash"), Value::from(3)])]),
        Value::from(1),
        s("sliding_window"),
        Value::from(128),
        s("local"),
        Value::Nil,
        s("session-1"),
        ints(&[4u32, 5]),
        Value::Map(vec![(s("future"), ints(&[1u8]))]),
        Value::Nil,
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        ints(&[5u64]),
        Value::Nil,
        Value::from(1),
        s("local"),
        Value::Nil,
        Value::from(99),
    ]);
    let decoded = decode_event_batch(&batch(vec![stored, removed])).unwrap();
    let KvEvent::Stored(stored) = &decoded.events[0] else { panic!("{decoded:?}") };
    assert_eq!(stored.medium, Tier::Storage);
    assert_eq!(stored.lora_name.as_deref(), Some("adapter-a"));
    assert_eq!(stored.has_extra_keys, vec![true]);
    assert!(stored.any_extra_keys());
    assert!(stored.opaque_extra_keys && stored.content_extra_keys);
    assert_eq!(stored.group_idx, Some(1));
    assert_eq!(stored.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(stored.kv_cache_spec_sliding_window, Some(128));
    assert_eq!(
        decoded.events[1],
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![5],
            medium: Tier::Gpu,
            group_idx: Some(1)
        })
    );
}

#[test]
fn array_encoding_without_optional_trailing_fields() {
    let minimal = Value::Array(vec![
        s("BlockStored"),
        ints(&[5u64]),
        Value::Nil,
        ints(&[9u32]),
        Value::from(1),
    ]);
    let removed = Value::Array(vec![s("BlockRemoved"), ints(&[5u64])]);
    let decoded = decode_event_batch(&batch(vec![minimal, removed])).unwrap();
    let KvEvent::Stored(stored) = &decoded.events[0] else { panic!("{decoded:?}") };
    assert_eq!(stored.medium, Tier::Gpu);
    assert_eq!(stored.token_ids, vec![9]);
    let too_short = Value::Array(vec![s("BlockStored"), ints(&[5u64]), Value::Nil, ints(&[9u32])]);
    assert!(decode_err(&batch(vec![too_short])).contains("lacks block_size"));
    assert!(decode_err(&batch(vec![Value::Array(vec![s("BlockRemoved")])]))
        .contains("lacks block_hashes"));
    assert!(decode_err(&batch(vec![Value::Array(vec![])])).contains("empty"));
}

#[test]
fn map_encoding_omits_defaults_ignores_unknown_fields_and_tag_order() {
    let stored = map(vec![
        ("block_hashes", ints(&[1u64, 2])),
        ("future_field", Value::Array(vec![map(vec![("x", Value::Nil)])])),
        ("token_ids", ints(&[1u32, 2])),
        ("parent_block_hash", Value::Nil),
        ("type", s("BlockStored")),
        ("block_size", Value::from(1)),
    ]);
    let cleared = map(vec![("type", s("AllBlocksCleared")), ("reason", s("reset"))]);
    let decoded = decode_event_batch(&batch(vec![stored, cleared])).unwrap();
    assert_eq!(
        decoded.events,
        vec![
            KvEvent::Stored(BlockStored {
                block_hashes: vec![1, 2],
                token_ids: vec![1, 2],
                block_size: 1,
                ..BlockStored::default()
            }),
            KvEvent::AllCleared,
        ]
    );
    // A required field missing from a map.
    let no_parent = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1u64])),
        ("token_ids", ints(&[1u32])),
        ("block_size", Value::from(1)),
    ]);
    assert!(decode_err(&batch(vec![no_parent])).contains("lacks parent_block_hash"));
    assert!(decode_err(&batch(vec![map(vec![("block_hashes", ints(&[1u64]))])]))
        .contains("no \"type\" key"));
}

#[test]
fn unknown_event_types_are_counted_and_skipped() {
    let events = vec![
        map(vec![("type", s("BlockMoved")), ("to", s("CPU")), ("blocks", ints(&[1u64]))]),
        Value::Array(vec![s("Heartbeat"), Value::from(1), Value::Nil]),
        Value::Array(vec![s("AllBlocksCleared")]),
    ];
    let decoded = decode_event_batch(&batch(events)).unwrap();
    assert_eq!(decoded.unknown_events, 2);
    assert_eq!(decoded.events, vec![KvEvent::AllCleared]);
}

#[test]
fn int_and_bytes_forms_of_a_hash_agree() {
    let hash: u64 = 0xf892_553b_ef84_ef0c;
    let mut digest = vec![0x5a; 24];
    digest.extend(hash.to_be_bytes());
    let removed = |hashes: Value| map(vec![("type", s("BlockRemoved")), ("block_hashes", hashes)]);
    let events = vec![
        removed(Value::Array(vec![Value::from(hash)])),
        removed(Value::Array(vec![Value::from(hash as i64)])),
        removed(Value::Array(vec![Value::Binary(digest)])),
        removed(Value::Array(vec![Value::Binary(hash.to_be_bytes().to_vec())])),
        removed(Value::Array(vec![Value::Binary(vec![0x01, 0x02])])),
    ];
    let decoded = decode_event_batch(&batch(events)).unwrap();
    let hashes: Vec<u64> = decoded
        .events
        .iter()
        .map(|event| match event {
            KvEvent::Removed(removed) => removed.block_hashes[0],
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(hashes, vec![hash, hash, hash, hash, 0x0102]);
}

/// A two-block stored event (array form) with `parent`, `lora_name` and `extra_keys`.
fn keyed_event(parent: Option<u64>, lora: Option<&str>, extra: Value) -> BlockStored {
    let event = Value::Array(vec![
        s("BlockStored"),
        ints(&[1u64, 2]),
        parent.map_or(Value::Nil, Value::from),
        ints(&[1u32, 2, 3, 4]),
        Value::from(2),
        Value::Nil,
        Value::Nil,
        lora.map_or(Value::Nil, s),
        extra,
    ]);
    match decode_event_batch(&batch(vec![event])).unwrap().events.remove(0) {
        KvEvent::Stored(stored) => stored,
        other => panic!("{other:?}"),
    }
}

#[test]
fn extra_keys_of_a_lora_name_and_a_root_salt_are_explained() {
    let keys = |entries: Vec<Value>| Value::Array(entries);
    let strs = |items: &[&str]| Value::Array(items.iter().map(|t| s(t)).collect());
    // vLLM 0.32's shapes: the salt on the first block, the LoRA name on every block.
    let salted = keyed_event(None, None, keys(vec![strs(&["tenant"]), Value::Nil]));
    assert_eq!((salted.cache_salt.as_deref(), salted.opaque_extra_keys), (Some("tenant"), false));
    assert_eq!(salted.has_extra_keys, vec![true, false]);
    let lora = keyed_event(None, Some("sql"), keys(vec![strs(&["sql"]), strs(&["sql"])]));
    assert_eq!((lora.cache_salt, lora.opaque_extra_keys), (None, false));
    let both = keyed_event(None, Some("sql"), keys(vec![strs(&["sql", "t"]), strs(&["sql"])]));
    assert_eq!((both.cache_salt.as_deref(), both.opaque_extra_keys), (Some("t"), false));
    // A salt-like key that vLLM never writes there, or more keys, or other kinds: opaque.
    let opaque = [
        keyed_event(Some(9), None, keys(vec![strs(&["tenant"]), Value::Nil])),
        keyed_event(None, None, keys(vec![Value::Nil, strs(&["tenant"])])),
        keyed_event(None, Some("sql"), keys(vec![strs(&["sql", "a", "b"]), strs(&["sql"])])),
        keyed_event(None, Some("sql"), keys(vec![strs(&["sql"]), strs(&["other"])])),
        keyed_event(None, None, keys(vec![strs(&["a", "b"]), Value::Nil])),
        keyed_event(None, None, keys(vec![Value::Array(vec![ints(&[1u8, 2])]), Value::Nil])),
        keyed_event(None, None, keys(vec![Value::Array(vec![Value::Binary(vec![1])]), Value::Nil])),
        keyed_event(None, None, keys(vec![s("not a tuple"), Value::Nil])),
    ];
    for (i, event) in opaque.iter().enumerate() {
        assert!(event.opaque_extra_keys && event.cache_salt.is_none(), "{i}: {event:?}");
        // Strings only (the first five) are keys of another kind; the rest stand for content.
        assert_eq!(event.content_extra_keys, i >= 5, "{i}: {event:?}");
    }
    assert!(![&salted, &both].iter().any(|e| e.content_extra_keys) && !lora.content_extra_keys);
    // A str key that is not UTF-8 is an opaque key, not a decoding error.
    let event = Value::Array(vec![
        s("BlockStored"),
        ints(&[1u64]),
        Value::Nil,
        ints(&[1u32, 2]),
        Value::from(2),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        keys(vec![strs(&["\u{7f}salt"])]),
    ]);
    let mut payload = batch(vec![event]);
    let at = payload.windows(5).position(|w| w == b"\x7fsalt").unwrap();
    payload[at] = 0xff;
    let KvEvent::Stored(stored) = &decode_event_batch(&payload).unwrap().events[0] else {
        panic!("not a stored event")
    };
    assert!(stored.opaque_extra_keys && stored.cache_salt.is_none());
    assert!(!stored.content_extra_keys, "a string key, though not UTF-8");
}

#[test]
fn batch_shapes() {
    // Map-encoded batch, and a 2-element array (dp_rank omitted as a default).
    let as_map = encode(&map(vec![
        ("ts", Value::from(7)),
        ("events", Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])])),
        ("data_parallel_rank", Value::Nil),
        ("future", Value::Nil),
    ]));
    let decoded = decode_event_batch(&as_map).unwrap();
    assert_eq!((decoded.ts, decoded.dp_rank, decoded.events.len()), (7.0, None, 1));
    let two = encode(&Value::Array(vec![Value::F32(1.5), Value::Array(vec![])]));
    assert_eq!(decode_event_batch(&two).unwrap().dp_rank, None);
    let four = encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![]),
        Value::from(-2),
        s("later"),
    ]));
    assert_eq!(decode_event_batch(&four).unwrap().dp_rank, Some(-2));
    assert!(decode_err(&encode(&Value::Array(vec![Value::F64(1.0)]))).contains("1 elements"));
    assert!(decode_err(&encode(&map(vec![("ts", Value::from(1))]))).contains("\"events\""));
    assert!(decode_err(&encode(&s("batch"))).contains("expected an array or a map"));
    assert!(decode_err(&[]).contains("payload ends"));
}

#[test]
fn trailing_garbage_is_rejected() {
    let mut payload = old_format_batch();
    let length = payload.len();
    payload.push(0xc0);
    let err = decode_event_batch(&payload).unwrap_err();
    assert_eq!(err.offset, length);
    assert!(err.reason.contains("trailing"));
}

#[test]
fn every_truncation_of_a_vector_fails_cleanly() {
    let vector = read_json(KV_EVENTS_VECTOR);
    let capture = read_json(CAPTURE_VECTOR);
    let mut payloads = vec![from_hex(vector["payload_hex"].as_str().unwrap()), old_format_batch()];
    payloads.push(from_hex(capture["frames"][0][2].as_str().unwrap()));
    for payload in payloads {
        decode_event_batch(&payload).unwrap();
        for cut in 0..payload.len() {
            let err = decode_event_batch(&payload[..cut]).unwrap_err();
            assert!(err.offset <= cut, "cut {cut}: {err}");
        }
    }
}

#[test]
fn huge_declared_lengths_fail_before_allocating() {
    // Each declares 2**32 - 1 elements or bytes and supplies a few.
    let cases: Vec<Vec<u8>> = vec![
        vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
        vec![0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
        vec![0x93, 0x00, 0x91, 0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0],
        vec![0x93, 0x00, 0x91, 0x92, 0xdb, 0xff, 0xff, 0xff, 0xff, b'x'],
        vec![0x93, 0x00, 0x91, 0x93, 0xa1, b'Z', 0xc6, 0xff, 0xff, 0xff, 0xff, b'x'],
        vec![0x93, 0x00, 0x91, 0x93, 0xa1, b'Z', 0xc9, 0xff, 0xff, 0xff, 0xff, b'x'],
    ];
    for payload in cases {
        let err = decode_event_batch(&payload).unwrap_err();
        assert!(
            err.reason.contains("declares") || err.reason.contains("payload ends"),
            "{payload:02x?}: {err}"
        );
    }
    // A BlockStored whose token_ids declares a huge length.
    let mut payload = vec![0x93, 0x00, 0x91, 0x95, 0xab];
    payload.extend(b"BlockStored");
    payload.extend([0x91, 0x01, 0xc0, 0xdd, 0x7f, 0xff, 0xff, 0xff, 0x01, 0x02]);
    assert!(decode_err(&payload).contains("token_ids declares 2147483647 elements"));
}

fn nested_arrays(depth: usize) -> Value {
    let mut value = Value::Nil;
    for _ in 0..depth {
        value = Value::Array(vec![value]);
    }
    value
}

#[test]
fn nesting_in_skipped_values_is_bounded() {
    let with_unknown =
        |value: Value| batch(vec![map(vec![("type", s("AllBlocksCleared")), ("blob", value)])]);
    decode_event_batch(&with_unknown(nested_arrays(MAX_SKIP_DEPTH))).unwrap();
    assert!(decode_err(&with_unknown(nested_arrays(MAX_SKIP_DEPTH + 1))).contains("nested deeper"));
    // Far deeper than any stack allows, built by hand (rmpv's encoder recurses).
    let mut payload = vec![0x93, 0x00, 0x91, 0x82, 0xa4];
    payload.extend(b"type");
    payload.push(0xb0);
    payload.extend(b"AllBlocksCleared");
    payload.extend([0xa1, b'x']);
    payload.extend(std::iter::repeat_n(0x91, 1_000_000));
    payload.push(0xc0);
    payload.push(0xc0);
    assert!(decode_err(&payload).contains("nested deeper"));
    // The same depth before the tag (the scan-ahead path) and in an unknown event type.
    let mut tag_last = vec![0x93, 0x00, 0x91, 0x82, 0xa1, b'x'];
    tag_last.extend(std::iter::repeat_n(0x91, 1_000_000));
    tag_last.push(0xc0);
    tag_last.extend([0xa4, b't', b'y', b'p', b'e', 0xa1, b'Z', 0xc0]);
    assert!(decode_err(&tag_last).contains("nested deeper"));
    let entry = Value::Array(vec![nested_arrays(MAX_SKIP_DEPTH + 1)]);
    let stored = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1u64])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&[1u32])),
        ("block_size", Value::from(1)),
        ("extra_keys", entry),
    ]);
    assert!(decode_err(&batch(vec![stored])).contains("nested deeper"));
}

fn stored_with(field: &str, value: Value) -> Vec<u8> {
    let mut entries = vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1u64, 2])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&[1u32, 2, 3, 4])),
        ("block_size", Value::from(2)),
    ];
    entries.retain(|(name, _)| *name != field);
    entries.push((field, value));
    batch(vec![map(entries)])
}

#[test]
fn wrong_types_and_values_are_rejected() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (stored_with("block_hashes", s("12")), "expected an array"),
        (stored_with("block_hashes", Value::Array(vec![s("1"), s("2")])), "an integer or a bin"),
        (
            stored_with("block_hashes", Value::Array(vec![Value::F64(1.0), Value::from(2)])),
            "found a float",
        ),
        (stored_with("parent_block_hash", Value::Boolean(true)), "found a bool"),
        (stored_with("token_ids", Value::Array(vec![Value::F64(1.0); 4])), "token id"),
        (stored_with("token_ids", ints(&[1i64, 2, -1, 4])), "token id -1"),
        (stored_with("token_ids", ints(&[1u64, 2, 1 << 32, 4])), "token id 4294967296"),
        (stored_with("token_ids", ints(&[1u32, 2, 3])), "3 token_ids for 2 blocks of 2"),
        (stored_with("block_size", Value::from(0)), "block_size is 0"),
        (stored_with("block_size", Value::from(-2)), "out of range"),
        (stored_with("block_size", Value::Nil), "expected an integer"),
        (stored_with("medium", s("TPU")), "medium \"TPU\""),
        (stored_with("medium", Value::from(1)), "expected a str"),
        (stored_with("lora_name", Value::from(1)), "expected a str"),
        (stored_with("group_idx", Value::from(-1)), "out of range"),
        (stored_with("extra_keys", ints(&[1u8])), "1 extra_keys entries for 2 blocks"),
        (stored_with("extra_keys", s("x")), "expected an array"),
        (stored_with("lora_id", Value::from(u64::MAX)), "out of range"),
        (batch(vec![Value::from(1)]), "event: expected an array or a map"),
        (batch(vec![Value::Array(vec![Value::from(1)])]), "event type tag"),
        (batch(vec![map(vec![("type", Value::from(1))])]), "event type tag"),
        (encode(&Value::Array(vec![s("ts"), Value::Array(vec![]), Value::Nil])), "ts"),
        (encode(&Value::Array(vec![Value::F64(1.0), Value::Nil, Value::Nil])), "events"),
        (encode(&Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), s("0")])), "dp_rank"),
    ];
    for (payload, needle) in cases {
        let err = decode_err(&payload);
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    // Case-insensitive medium.
    let decoded = decode_event_batch(&stored_with("medium", s("cPu"))).unwrap();
    let KvEvent::Stored(stored) = &decoded.events[0] else { panic!() };
    assert_eq!(stored.medium, Tier::Cpu);
}

#[test]
fn duplicate_keys_are_rejected() {
    let mut entries = vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(&[1u64])),
        ("block_hashes", ints(&[2u64])),
    ];
    assert!(decode_err(&batch(vec![map(entries.clone())]))
        .contains("BlockRemoved field \"block_hashes\" appears twice"));
    entries.remove(2);
    entries.push(("type", s("BlockRemoved")));
    assert!(decode_err(&batch(vec![map(entries)])).contains("\"type\" appears twice"));
    let twice_ts = encode(&map(vec![
        ("ts", Value::from(1)),
        ("ts", Value::from(1)),
        ("events", Value::Array(vec![])),
    ]));
    assert!(decode_err(&twice_ts).contains("appears twice"));
}

#[test]
fn strings_must_be_utf8_where_read() {
    // The type tag "Block\xff".
    let payload = [0x93, 0x00, 0x91, 0x91, 0xa6, b'B', b'l', b'o', b'c', b'k', 0xff, 0xc0];
    assert!(decode_err(&payload).contains("UTF-8"));
    let mut payload = stored_with("medium", s("GPU"));
    let at = payload.windows(3).position(|w| w == b"GPU").unwrap();
    payload[at] = 0xc3;
    assert!(decode_err(&payload).contains("UTF-8"));
}

/// Map keys the decoder knows are matched as bytes; any other key (first, before the tag, or
/// later), and any type tag it does not know, must still be UTF-8, and the error points at it.
#[test]
fn unknown_map_keys_and_tags_must_be_utf8() {
    let stored = || {
        vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[1u64])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", ints(&[1u32, 2])),
            ("block_size", Value::from(2)),
        ]
    };
    let placements: [(usize, &str); 3] = [(0, "first"), (1, "after the tag"), (5, "last")];
    for (position, label) in placements {
        let mut entries = stored();
        entries.insert(position, ("zzzz", Value::from(7)));
        let mut payload = batch(vec![map(entries)]);
        let key = payload.windows(4).position(|w| w == b"zzzz").unwrap();
        assert!(decode_event_batch(&payload).is_ok(), "{label}: an unknown key is skipped");
        payload[key + 1] = 0xff;
        let err = decode_event_batch(&payload).unwrap_err();
        assert!(err.reason.contains("event field name: str is not valid UTF-8"), "{label}: {err}");
        assert_eq!(err.offset, key - 1, "{label}: the offset is the key's marker");
    }
    let mut payload = batch(vec![map(vec![("type", s("Qzzzz")), ("x", Value::from(1))])]);
    let tag = payload.windows(5).position(|w| w == b"Qzzzz").unwrap();
    assert_eq!(decode_event_batch(&payload).unwrap().unknown_events, 1);
    payload[tag + 2] = 0xc3;
    let err = decode_event_batch(&payload).unwrap_err();
    assert!(err.reason.contains("event type tag: str is not valid UTF-8"), "{err}");
    assert_eq!(err.offset, tag - 1);
}

#[test]
fn errors_name_the_event_and_offset() {
    let payload = batch(vec![Value::Array(vec![s("AllBlocksCleared")]), Value::from(5)]);
    let err = decode_event_batch(&payload).unwrap_err();
    assert!(err.reason.starts_with("event 1:"), "{err}");
    assert_eq!(payload[err.offset], 0x05);
}

// ---- proptest: random batches in both encodings decode to the model ----

#[derive(Debug, Clone)]
enum HashForm {
    Unsigned,
    Signed,
    Digest(usize),
}

fn hash_value(hash: u64, form: &HashForm) -> Value {
    match form {
        HashForm::Unsigned => Value::from(hash),
        HashForm::Signed => Value::from(hash as i64),
        HashForm::Digest(prefix) => {
            let mut bytes = vec![0xab; *prefix];
            bytes.extend(hash.to_be_bytes());
            Value::Binary(bytes)
        }
    }
}

fn hash_form() -> impl Strategy<Value = HashForm> {
    prop_oneof![
        Just(HashForm::Unsigned),
        Just(HashForm::Signed),
        (0usize..25).prop_map(HashForm::Digest)
    ]
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Gpu), Just(Tier::Cpu), Just(Tier::Storage)]
}

fn stored_event() -> impl Strategy<Value = BlockStored> {
    (1u32..5, 0usize..4).prop_flat_map(|(block_size, blocks)| {
        (
            proptest::collection::vec(any::<u64>(), blocks),
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u32>(), blocks * block_size as usize),
            tier(),
            proptest::option::of("[a-z]{0,8}"),
            proptest::option::of(any::<i64>()),
            proptest::option::of(proptest::collection::vec(any::<bool>(), blocks)),
            proptest::option::of(any::<u32>()),
            proptest::option::of("[a-z_]{0,12}"),
            proptest::option::of(any::<u32>()),
        )
            .prop_map(
                move |(
                    hashes,
                    parent,
                    tokens,
                    medium,
                    lora,
                    lora_id,
                    extra,
                    group,
                    kind,
                    window,
                )| {
                    let extra = extra.unwrap_or_default();
                    BlockStored {
                        block_hashes: hashes,
                        parent_block_hash: parent,
                        token_ids: tokens,
                        block_size,
                        lora_name: lora,
                        medium,
                        lora_id,
                        // Written as ["mm", 1]: a multimodal key, opaque.
                        opaque_extra_keys: extra.contains(&true),
                        content_extra_keys: extra.contains(&true),
                        cache_salt: None,
                        has_extra_keys: extra,
                        group_idx: group,
                        kv_cache_spec_kind: kind,
                        kv_cache_spec_sliding_window: window,
                    }
                },
            )
    })
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        4 => stored_event().prop_map(KvEvent::Stored),
        2 => (proptest::collection::vec(any::<u64>(), 0..4), tier(), proptest::option::of(any::<u32>()))
            .prop_map(|(block_hashes, medium, group_idx)| {
                KvEvent::Removed(BlockRemoved { block_hashes, medium, group_idx })
            }),
        1 => Just(KvEvent::AllCleared),
    ]
}

/// How one event is written: array or map, hash form, map key order, padding.
#[derive(Debug, Clone)]
struct Encoding {
    as_map: bool,
    hash_form: HashForm,
    rotate_keys: usize,
    unknown_field: bool,
    explicit_defaults: bool,
}

fn encoding() -> impl Strategy<Value = Encoding> {
    (any::<bool>(), hash_form(), 0usize..16, any::<bool>(), any::<bool>()).prop_map(
        |(as_map, hash_form, rotate_keys, unknown_field, explicit_defaults)| Encoding {
            as_map,
            hash_form,
            rotate_keys,
            unknown_field,
            explicit_defaults,
        },
    )
}

fn opt<T>(value: &Option<T>, f: impl Fn(&T) -> Value) -> Value {
    value.as_ref().map_or(Value::Nil, f)
}

fn event_fields(event: &KvEvent, enc: &Encoding) -> (&'static str, Vec<(&'static str, Value)>) {
    let hashes = |hashes: &[u64]| {
        Value::Array(hashes.iter().map(|&h| hash_value(h, &enc.hash_form)).collect())
    };
    match event {
        KvEvent::Stored(e) => {
            let extra = if e.has_extra_keys.is_empty() {
                Value::Nil
            } else {
                Value::Array(
                    e.has_extra_keys
                        .iter()
                        .map(|&present| {
                            if present {
                                Value::Array(vec![s("mm"), Value::from(1)])
                            } else {
                                Value::Nil
                            }
                        })
                        .collect(),
                )
            };
            let fields = vec![
                ("block_hashes", hashes(&e.block_hashes)),
                (
                    "parent_block_hash",
                    opt(&e.parent_block_hash, |&h| hash_value(h, &enc.hash_form)),
                ),
                ("token_ids", ints(&e.token_ids)),
                ("block_size", Value::from(e.block_size)),
                ("lora_id", opt(&e.lora_id, |&v| Value::from(v))),
                ("medium", s(medium_name(e.medium))),
                ("lora_name", opt(&e.lora_name, |v| s(v))),
                ("extra_keys", extra),
                ("group_idx", opt(&e.group_idx, |&v| Value::from(v))),
                ("kv_cache_spec_kind", opt(&e.kv_cache_spec_kind, |v| s(v))),
                (
                    "kv_cache_spec_sliding_window",
                    opt(&e.kv_cache_spec_sliding_window, |&v| Value::from(v)),
                ),
            ];
            ("BlockStored", fields)
        }
        KvEvent::Removed(e) => {
            let fields = vec![
                ("block_hashes", hashes(&e.block_hashes)),
                ("medium", s(medium_name(e.medium))),
                ("group_idx", opt(&e.group_idx, |&v| Value::from(v))),
            ];
            ("BlockRemoved", fields)
        }
        KvEvent::AllCleared => ("AllBlocksCleared", vec![]),
    }
}

fn encode_event(event: &KvEvent, enc: &Encoding) -> Value {
    let (tag, mut fields) = event_fields(event, enc);
    let required = if tag == "BlockStored" { 4 } else { 1 }.min(fields.len());
    if enc.as_map {
        // Defaulted fields at their default may be omitted (msgspec omit_defaults).
        if !enc.explicit_defaults {
            let mut index = 0;
            fields.retain(|(_, value)| {
                index += 1;
                index <= required || *value != Value::Nil
            });
        }
        let mut entries: Vec<(Value, Value)> = vec![(s("type"), s(tag))];
        entries.extend(fields.into_iter().map(|(k, v)| (s(k), v)));
        if enc.unknown_field {
            entries.push((s("locality"), Value::Array(vec![s("rack-1"), Value::from(-3)])));
        }
        let len = entries.len();
        entries.rotate_left(enc.rotate_keys % len);
        Value::Map(entries)
    } else {
        // Trailing nils may be omitted (msgspec array_like with omit_defaults).
        if !enc.explicit_defaults {
            while fields.len() > required && fields.last().is_some_and(|(_, v)| *v == Value::Nil) {
                fields.pop();
            }
        }
        let mut items = vec![s(tag)];
        items.extend(fields.into_iter().map(|(_, v)| v));
        if enc.unknown_field && items.len() == 12 {
            items.push(s("later-field"));
        }
        Value::Array(items)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_batches_round_trip_in_both_encodings(
        ts in -1e12f64..1e12,
        dp_rank in proptest::option::of(any::<i64>()),
        events in proptest::collection::vec((event(), encoding()), 0..6),
        unknown_at in proptest::collection::vec(0usize..8, 0..3),
    ) {
        let mut values: Vec<Value> =
            events.iter().map(|(event, enc)| encode_event(event, enc)).collect();
        for &position in &unknown_at {
            let unknown = Value::Array(vec![s("BlockMoved"), ints(&[1u64]), Value::Nil]);
            values.insert(position.min(values.len()), unknown);
        }
        let dp_value = dp_rank.map_or(Value::Nil, Value::from);
        let payload = encode(&Value::Array(vec![Value::F64(ts), Value::Array(values), dp_value]));
        let decoded = decode_event_batch(&payload).unwrap();
        let expected = EventBatch {
            ts,
            dp_rank,
            unknown_events: unknown_at.len() as u32,
            events: events.into_iter().map(|(event, _)| event).collect(),
        };
        prop_assert_eq!(decoded, expected);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_event_batch(&bytes);
    }

    #[test]
    fn mutated_vectors_never_panic(position in 0usize..1000, byte in any::<u8>()) {
        let vector = read_json(KV_EVENTS_VECTOR);
        let mut payload = from_hex(vector["payload_hex"].as_str().unwrap());
        let at = position % payload.len();
        payload[at] = byte;
        if let Ok(batch) = decode_event_batch(&payload) {
            for event in batch.events {
                if let KvEvent::Stored(stored) = event {
                    prop_assert_eq!(
                        stored.token_ids.len(),
                        stored.block_hashes.len() * stored.block_size as usize
                    );
                }
            }
        }
    }
}

// ---- token ids in every integer form, mixed at random ----

/// Appends `v` to a msgpack buffer in form `form`: 0 minimal (fixint, u8, u16 or u32, the forms
/// the decoder takes two at a time), 1 always u32, 2 u64, 3 int64 (the general path).
fn raw_token(out: &mut Vec<u8>, v: u32, form: u8) {
    match form {
        0 if v < 128 => out.push(v as u8),
        0 if v < 256 => out.extend([0xcc, v as u8]),
        0 if v < 65_536 => {
            out.push(0xcd);
            out.extend((v as u16).to_be_bytes());
        }
        0 | 1 => {
            out.push(0xce);
            out.extend(v.to_be_bytes());
        }
        2 => {
            out.push(0xcf);
            out.extend(u64::from(v).to_be_bytes());
        }
        _ => {
            out.push(0xd3);
            out.extend(i64::from(v).to_be_bytes());
        }
    }
}

fn raw_str(out: &mut Vec<u8>, text: &str) {
    out.push(0xa0 | text.len() as u8);
    out.extend(text.as_bytes());
}

/// A one-event batch whose `BlockStored` carries `tokens` (block size 1) written in `forms`,
/// with the token ids the event's last field or followed by `block_size`.
fn stored_raw(tokens: &[(u32, u8)], token_ids_last: bool) -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend(12.5f64.to_be_bytes());
    out.extend([0x91, 0x85]);
    raw_str(&mut out, "type");
    raw_str(&mut out, "BlockStored");
    raw_str(&mut out, "block_hashes");
    out.push(0xdc);
    out.extend((tokens.len() as u16).to_be_bytes());
    for h in 1..=tokens.len() as u16 {
        out.push(0xcd);
        out.extend(h.to_be_bytes());
    }
    raw_str(&mut out, "parent_block_hash");
    out.push(0xc0);
    let block_size = |out: &mut Vec<u8>| {
        raw_str(out, "block_size");
        out.push(1);
    };
    if token_ids_last {
        block_size(&mut out);
    }
    raw_str(&mut out, "token_ids");
    out.push(0xdc);
    out.extend((tokens.len() as u16).to_be_bytes());
    for &(v, form) in tokens {
        raw_token(&mut out, v, form);
    }
    if !token_ids_last {
        block_size(&mut out);
    }
    out.push(3);
    out
}

fn token_value() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..128, 128u32..256, 256u32..65_536, 65_536u32..=u32::MAX]
}

proptest! {
    #[test]
    fn token_ids_decode_in_every_form_and_mix(
        tokens in proptest::collection::vec(
            (token_value(), prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)]),
            1..100,
        ),
        token_ids_last in any::<bool>(),
    ) {
        let batch = decode_event_batch(&stored_raw(&tokens, token_ids_last)).unwrap();
        let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored: {batch:?}") };
        let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
        prop_assert_eq!(&stored.token_ids, &want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Arrays long enough to be decoded by two chains at once: mostly the fast forms of one
    /// vocabulary, the general forms now and then.
    #[test]
    fn long_token_id_arrays_decode_in_every_form_and_mix(
        vocab in prop_oneof![Just(200u32), Just(60_000u32), Just(128_000u32), Just(u32::MAX)],
        seed in any::<u64>(),
        len in 256usize..3_000,
        slow_every in prop_oneof![Just(0usize), 1usize..40, Just(997usize)],
        token_ids_last in any::<bool>(),
    ) {
        let mut x = seed | 1;
        let tokens: Vec<(u32, u8)> = (0..len)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let form = if slow_every > 0 && i % slow_every == 5 { 1 + (x % 3) as u8 } else { 0 };
                ((x % u64::from(vocab)) as u32, form)
            })
            .collect();
        let batch = decode_event_batch(&stored_raw(&tokens, token_ids_last)).unwrap();
        let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored: {batch:?}") };
        let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
        prop_assert_eq!(&stored.token_ids, &want);
    }
}

/// `n` token ids of a vocabulary of `vocab`, from a xorshift generator seeded with `seed`, each
/// in the minimal form except every `slow_every`-th (from the 8th), in u64 or int64 form.
fn token_run(n: usize, vocab: u64, seed: u64, slow_every: usize) -> Vec<(u32, u8)> {
    let mut x = seed | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let form = if slow_every > 0 && i % slow_every == 7 { 2 + (i % 2) as u8 } else { 0 };
            ((x % vocab) as u32, form)
        })
        .collect()
}

#[test]
fn long_token_arrays_decode_alike_wherever_the_second_chain_starts() {
    // Vocabularies whose ids take 1-2, 1-3 and 3-5 bytes, lengths around the split threshold
    // and well above it, ids in the general forms here and there (the second chain restarts,
    // or the first takes the slow path), the array followed by other fields or not.
    for (n, vocab, seed) in [(256, 200, 1), (257, 128_000, 2), (300, 256, 3), (1_000, 60_000, 4)]
        .into_iter()
        .chain((5..30).map(|s| (256 + 97 * s as usize, 1 << (8 + s % 24), s)))
    {
        for slow_every in [0usize, 3, 50, 999] {
            let tokens = token_run(n, vocab, seed, slow_every);
            let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
            for last in [false, true] {
                let batch = decode_event_batch(&stored_raw(&tokens, last)).unwrap();
                let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored") };
                assert_eq!(stored.token_ids, want, "n {n} vocab {vocab} slow {slow_every}");
            }
        }
    }
}

#[test]
fn a_bad_id_late_in_a_long_token_array_is_reported_where_it_is() {
    let mut tokens = token_run(2_000, 128_000, 9, 0);
    tokens[1_700] = (5, 3);
    let mut payload = stored_raw(&tokens, false);
    // Id 1,700 (int64 5, the only int64 with that value) becomes -1: out of range.
    let int64_five = [0xd3, 0, 0, 0, 0, 0, 0, 0, 5];
    let at = payload.windows(9).position(|w| w == int64_five).unwrap();
    payload[at + 1..at + 9].copy_from_slice(&(-1i64).to_be_bytes());
    let err = decode_err(&payload);
    assert!(err.contains("token id -1"), "{err}");
    assert!(err.contains(&format!("byte {at}")), "{err}");
}

#[test]
fn token_ids_out_of_range_in_the_middle_of_a_fast_run_are_rejected() {
    let mut tokens: Vec<(u32, u8)> = (0..20).map(|i| (70_000 + i, 0)).collect();
    // The 11th id becomes 2**32 in u64 form, the same width as the u64 it replaces.
    tokens[10].1 = 2;
    let good = stored_raw(&tokens, false);
    let at = good.windows(9).position(|w| w == [0xcf, 0, 0, 0, 0, 0, 1, 0x11, 0x7a]).unwrap();
    let mut payload = good.clone();
    payload[at + 4] = 1;
    assert!(decode_event_batch(&good).is_ok());
    assert!(decode_err(&payload).contains("outside 0..=4294967295"), "{}", decode_err(&payload));
}

#[test]
fn recycled_token_buffers_and_reused_chain_buffers_leave_nothing_behind() {
    // Long, short, longer and failing arrays on one thread, each batch handed back after use
    // (as the prefix index does): every decode gives exactly its own ids and block hashes, none
    // left over from an earlier, longer array in the same buffer (a recycled token buffer keeps
    // its ids, for the decoder to overwrite), on each decoding path.
    decode_recycled_runs();
    with_avx2_decoding(decode_recycled_runs);
    with_scalar_decoding(decode_recycled_runs);
}

fn decode_recycled_runs() {
    let lengths = [3_000usize, 40, 300, 5_000, 256, 1, 2_999, 65_000, 600];
    for round in 0..3u64 {
        for (i, &n) in lengths.iter().enumerate() {
            let vocab = [200u64, 60_000, 128_000, 1 << 32][(i + round as usize) % 4];
            let tokens =
                token_run(n, vocab, 100 * round + i as u64, if i % 3 == 0 { 0 } else { 50 });
            let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
            let batch = decode_event_batch(&stored_raw(&tokens, i % 2 == 0)).unwrap();
            let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored") };
            assert_eq!(stored.token_ids, want, "round {round}, n {n}");
            // The block hashes and the event list come from per-thread pools too.
            assert_eq!(stored.block_hashes, (1..=n as u64).collect::<Vec<_>>(), "n {n}");
            assert_eq!(batch.events.len(), 1);
            recycle(batch);
            // A payload cut inside its token array fails cleanly between the good ones.
            let whole = stored_raw(&tokens, false);
            assert!(decode_event_batch(&whole[..whole.len() / 2]).is_err());
        }
    }
}

// ---- the AVX2 path against the scalar path ----

/// `payload` decoded on the default path (AVX-512 VBMI chunks or AVX2 steps, whichever this
/// processor has), on the AVX2 path at most and on the scalar path alone; the test fails
/// unless they agree, results and errors alike.
fn assert_paths_agree(payload: &[u8], context: &str) -> Result<EventBatch, DecodeError> {
    let default = decode_event_batch(payload);
    let avx2 = with_avx2_decoding(|| decode_event_batch(payload));
    let scalar = with_scalar_decoding(|| decode_event_batch(payload));
    assert_eq!(default, scalar, "{context}: default and scalar");
    assert_eq!(avx2, scalar, "{context}: AVX2 and scalar");
    default
}

/// `n` ids of which every one is u16 or u32 (a 128k vocabulary, the AVX2 steps' forms) except
/// where `other` says: `Some(form)` for id `i` writes it as `raw_token` form `form` with a
/// value for that form (0 with a value below 256: a fixint or a u8 id).
fn mixed_run(n: usize, seed: u64, other: impl Fn(usize) -> Option<u8>) -> Vec<(u32, u8)> {
    let mut x = seed | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match other(i) {
                Some(0) => ((x % 256) as u32, 0),
                Some(form) => ((x % 128_000) as u32, form),
                None => ((256 + x % 127_744) as u32, 0),
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random mixes of every form, every length from none to several thousand ids (one chain
    /// and two), cut anywhere or not at all.
    #[test]
    fn simd_and_scalar_paths_agree_on_mixed_widths_and_truncations(
        n in prop_oneof![0usize..40, 200usize..400, 1_000usize..3_000],
        seed in any::<u64>(),
        other_every in prop_oneof![Just(0usize), 1usize..8, 9usize..200],
        other_form in 0u8..4,
        token_ids_last in any::<bool>(),
        cut in proptest::option::of(any::<proptest::sample::Index>()),
    ) {
        let tokens = mixed_run(n, seed, |i| {
            (other_every > 0 && i % other_every == other_every / 2).then_some(other_form)
        });
        let mut payload = stored_raw(&tokens, token_ids_last);
        if let Some(cut) = cut {
            payload.truncate(cut.index(payload.len()));
        }
        let decoded = assert_paths_agree(&payload, "mixed run");
        if cut.is_none() {
            let batch = decoded.unwrap();
            let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored") };
            let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
            prop_assert_eq!(&stored.token_ids, &want);
        }
    }
}

#[test]
fn simd_and_scalar_paths_agree_on_a_bad_byte_anywhere_in_a_run() {
    // Every byte of runs short (one chain) and long (two chains) in turn replaced by bytes that
    // are no token id (reserved, str, float, negative fixint, nested array), by an int64 and a
    // u64 marker (the general path), and by the markers the steps take, which shift every id
    // after them: the error, or the ids, must be the scalar path's.
    let replacements = [0xc1, 0xa1, 0xcb, 0xff, 0x91, 0xd3, 0xcf, 0xcc, 0xcd, 0xce, 0x05];
    for (n, seed) in [(21, 3), (300, 5)] {
        let tokens = mixed_run(n, seed, |i| (i % 37 == 11).then_some(0));
        for last in [false, true] {
            let payload = stored_raw(&tokens, last);
            let ids_start = payload.windows(10).position(|w| w == b"\xa9token_ids").unwrap() + 13;
            let mut bad_ones = 0;
            for at in ids_start..payload.len() {
                for &byte in &replacements {
                    let mut bad = payload.clone();
                    bad[at] = byte;
                    let context = format!("n {n}, byte {at} = {byte:#04x}");
                    bad_ones += usize::from(assert_paths_agree(&bad, &context).is_err());
                }
            }
            // Most replacements break the payload: the comparisons above include errors.
            assert!(bad_ones > payload.len() - ids_start, "{bad_ones}");
        }
    }
}

#[test]
fn vector_paths_agree_wherever_a_run_starts_stops_and_ends() {
    // Runs of every length up to 300 ids (the VBMI chunks' 64-byte windows cut ids at every
    // offset, and up to 22 ids per chunk), vocabularies of u16 ids only, u32 only and mixed,
    // one id in another form at a sliding position, the array last in the payload (its end
    // near the buffer's) or not.
    for (vocab_low, vocab_span) in [(256u32, 65_280u32), (65_536, 1 << 24), (256, 127_744)] {
        for n in (0..=300).step_by(7).chain([64, 65, 128, 129, 255, 256, 257]) {
            let mut x = u64::from(vocab_span) ^ n as u64 | 1;
            let tokens: Vec<(u32, u8)> = (0..n)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if n > 0 && i == (x as usize >> 40) % n && i % 3 == 0 {
                        ((x % 200) as u32, 0)
                    } else {
                        (vocab_low + (x % u64::from(vocab_span)) as u32, 0)
                    }
                })
                .collect();
            for last in [false, true] {
                let decoded = assert_paths_agree(&stored_raw(&tokens, last), &format!("n {n}"));
                let batch = decoded.unwrap();
                let KvEvent::Stored(stored) = &batch.events[0] else { panic!("not stored") };
                let want: Vec<u32> = tokens.iter().map(|&(v, _)| v).collect();
                assert_eq!(stored.token_ids, want, "n {n}, vocab from {vocab_low}");
            }
        }
    }
}
