//! Fuzz target for `PrefixIndex::loads`: any bytes are refused with an error or load into an
//! index that can be matched, written to, expired and dumped again; nothing panics or aborts.
//! Each input is tried as it is and sealed with its checksum (as `dumps` ends a snapshot), so
//! that the checks behind the checksum are reached: a mutated snapshot fails the checksum.

#![no_main]

use libfuzzer_sys::fuzz_target;
use llmsched_core::prefix_index::{PrefixIndex, WorkerKey};

fuzz_target!(|data: &[u8]| {
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(data).to_le_bytes());
    for input in [data, &sealed] {
        try_load(input);
    }
});

fn try_load(data: &[u8]) {
    let Ok(index) = PrefixIndex::loads(data, 0.0) else { return };
    let tokens: Vec<u32> = (0..256).collect();
    if let Ok(hashes) = index.hash_tokens(&tokens, None, None) {
        let _ = index.match_hashes(&hashes, 1.0);
        let _ = index.record(&WorkerKey::Int(1), &hashes, 5.0, 1.0);
    }
    let _ = index.stats();
    let _ = index.expire(1e9);
    let again = index.dumps(1e9);
    PrefixIndex::loads(&again, 1e9).expect("a dump of a loaded index loads");
}
