//! A cache prefetch hint, for loops whose next loads' addresses are known well before they are
//! used (the radix tree's next node, the int objects of a Python list read further ahead).
//!
//! On x86_64 it is `prefetcht0` (into every cache level); elsewhere it does nothing, so code
//! written around it is correct, only slower, on other targets.

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

/// Asks the CPU to start loading `value`'s first cache line.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    prefetch_ptr(value as *const T);
}
