//! A cache prefetch hint, for loops whose next loads' addresses are known well before they are
//! used (the radix tree's next node, the int objects of a Python list read further ahead).
//!
//! On x86_64 it is `prefetcht0` (into every cache level), or `prefetchnta` for data read once
//! ([`prefetch_once_ptr`]); elsewhere it does nothing, so code written around it is correct, only
//! slower, on other targets.

/// Asks the CPU to start loading the cache line holding `ptr`. A hint: it never faults, never
/// writes and never changes a result, whatever `ptr` is (dangling or null included).
#[inline(always)]
pub fn prefetch_ptr<T>(ptr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; it does not fault or write for any address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

/// Like [`prefetch_ptr`], for data read once (an engine event's payload): `prefetchnta`, which
/// keeps the line out of the outer caches where the processor can, so a stream of payloads does
/// not evict the index's tables that the same call reads next (on the bs64 ingest of
/// `benches/bench_peers_index.py`, 800 MB of payloads streamed past them).
#[inline(always)]
pub fn prefetch_once_ptr<T>(ptr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; it does not fault or write for any address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA};
        _mm_prefetch::<_MM_HINT_NTA>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

/// Asks the CPU to start loading `value`'s first cache line.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    prefetch_ptr(value as *const T);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_hints_take_any_address_and_change_nothing() {
        let data = vec![7u8; 4096];
        for hint in [prefetch_ptr::<u8>, prefetch_once_ptr::<u8>] {
            hint(data.as_ptr());
            hint(data.as_ptr().wrapping_add(1 << 20)); // past the allocation
            hint(std::ptr::null());
            hint(usize::MAX as *const u8);
        }
        prefetch(&data);
        assert!(data.iter().all(|&b| b == 7));
    }
}
