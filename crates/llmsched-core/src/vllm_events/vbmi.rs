//! AVX-512 VBMI decoding of runs of token ids in the u16 (`0xcd`) and u32 (`0xce`) forms, a
//! 64-byte chunk of payload (16 to 21 ids) per step.
//!
//! Why: the AVX2 steps of [`super::simd`] each take 3 or 4 ids and the next step's position
//! depends on this one's (a load, compares, a table load), so a step costs its latency and the
//! decoder runs several chains to hide it. Here the chunks sit at fixed offsets from the start,
//! so every chunk is worked on independently; only where the first id of a chunk starts (0-4
//! bytes in, where the previous chunk's last id ends) carries from chunk to chunk, one byte
//! read from a table.
//!
//! Algorithm, per chunk: `J1[p]` is where the id after one starting at byte `p` would start
//! (`p + 3` after a `0xcd`, `p + 5` after a `0xce`, a dead mark, `kernel::DEAD`, after any
//! other byte); positions 64 and above (the next chunk) map to themselves, so do `J1[J1]` etc.
//! Squaring the map five times (`vpermi2b`, a 128-entry byte table: the chunk's map, then the
//! identity) gives `J2`, `J4`, ..., `J32`: `J32[e]` is where the run entering at `e` leaves the
//! chunk (no chunk holds more than 22 ids), or the dead mark when it meets another form. The
//! positions of the chunk's ids are `J^k[e]` for lane `k`, built from the powers by the bits of
//! `k` (five masked permutes), and a last permute gathers each id's value bytes (from this chunk
//! and the next 4 bytes), reversed into little-endian u32 lanes, the upper two zeroed for a u16.
//!
//! The run stops before an id in another form (fixint, u8, u64, int64, anything else: the
//! caller takes it on the scalar path, which also reports every error), at the array's end, or
//! when fewer than 68 bytes remain; the ids decoded are therefore exactly the scalar path's.
//!
//! Used on x86_64 when the processor has AVX-512 F, BW and VBMI (checked at run time) and the
//! crate was built by Rust 1.89 or newer (whose AVX-512 intrinsics are stable: `build.rs` sets
//! `llmsched_avx512`); [`super::with_avx2_decoding`] and [`super::with_scalar_decoding`] turn
//! it off.

/// Bytes a chunk's ids may reach: 64 of the chunk and the last id's tail (4 bytes at most).
const CHUNK_REACH: usize = 68;

/// Proof that this processor runs AVX-512 F, BW and VBMI (only [`Vbmi::detect`] makes one).
#[derive(Debug, Clone, Copy)]
pub(super) struct Vbmi(());

impl Vbmi {
    /// `Some` when the VBMI path may run here and now.
    #[inline]
    pub fn detect() -> Option<Vbmi> {
        #[cfg(all(target_arch = "x86_64", llmsched_avx512))]
        if super::simd::vector_level() == super::simd::VectorLevel::Best
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vbmi")
        {
            return Some(Vbmi(()));
        }
        None
    }

    /// Decodes ids from `pos` into `tokens[i..]` until an id in another form, the end of
    /// `tokens`, or the last [`CHUNK_REACH`] bytes of `buf`; returns the new `(i, pos)`.
    #[inline]
    pub fn run(self, buf: &[u8], pos: usize, tokens: &mut [u32], i: usize) -> (usize, usize) {
        if i >= tokens.len() || pos.saturating_add(CHUNK_REACH) > buf.len() {
            return (i, pos);
        }
        #[cfg(all(target_arch = "x86_64", llmsched_avx512))]
        // SAFETY: `self` exists only where the features were detected.
        unsafe {
            kernel::run(buf, pos, tokens, i)
        }
        #[cfg(not(all(target_arch = "x86_64", llmsched_avx512)))]
        (i, pos)
    }
}

// Compiled only where the intrinsics are stable (`llmsched_avx512`), whatever the declared
// minimum Rust version says.
#[cfg(all(target_arch = "x86_64", llmsched_avx512))]
#[allow(clippy::incompatible_msrv)]
mod kernel {
    use super::CHUNK_REACH;
    use crate::prefetch::prefetch_ptr;

    /// A position after which no id of the run is valid (an id in another form): maps to itself.
    const DEAD: u8 = 127;

    /// How far ahead of the chunk (bytes) the payload is asked for: `decode_event_batch` asks
    /// for a payload's first 64 KiB up front, and a longer one is read from memory as it goes.
    const PREFETCH_AHEAD: usize = 512;

    /// `[0, 1, ..., 63]`.
    static IOTA: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            t[k] = k as u8;
            k += 1;
        }
        t
    };

    /// Lane `4k + t` reads the position of id `k` (ids 0-15; with 16 added, ids 16-31), in
    /// [`EXPAND`]; in [`EXPAND_NEXT`], of id `k + 1`.
    static EXPAND: [[u8; 64]; 2] = expand_table(0);
    /// See [`EXPAND`].
    static EXPAND_NEXT: [[u8; 64]; 2] = expand_table(1);

    const fn expand_table(shift: usize) -> [[u8; 64]; 2] {
        let mut t = [[0u8; 64]; 2];
        let mut half = 0;
        while half < 2 {
            let mut lane = 0;
            while lane < 64 {
                t[half][lane] = (16 * half + lane / 4 + shift) as u8;
                lane += 1;
            }
            half += 1;
        }
        t
    }

    /// `1 + t` in lane `4k + t`: byte `t` of an id's little-endian value is the `t + 1`-th byte
    /// before the next id's start.
    static BACK: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut lane = 0;
        while lane < 64 {
            t[lane] = (1 + lane % 4) as u8;
            lane += 1;
        }
        t
    };

    /// Lane `k` of the orbit takes the map's `2^b`-th power when bit `b` of `k` is set (lanes
    /// 0-31).
    const ORBIT_BITS: [u64; 5] = {
        let mut masks = [0u64; 5];
        let mut b = 0;
        while b < 5 {
            let mut k = 0;
            while k < 32 {
                if k >> b & 1 == 1 {
                    masks[b] |= 1 << k;
                }
                k += 1;
            }
            b += 1;
        }
        masks
    };

    /// [`super::Vbmi::run`]'s chunks from `start` (at least [`CHUNK_REACH`] bytes before the
    /// end of `buf`) into `tokens[i..]` (`i` below `tokens.len()`).
    ///
    /// # Safety
    /// The processor must have AVX-512 F, BW and VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn run(
        buf: &[u8],
        start: usize,
        tokens: &mut [u32],
        mut i: usize,
    ) -> (usize, usize) {
        use std::arch::x86_64::*;
        let count = tokens.len();
        let base = buf.as_ptr();
        let out = tokens.as_mut_ptr();
        // SAFETY (every intrinsic below): the features are enabled for this function; every load
        // reads inside `buf` (the chunk's 64 bytes while `chunk + 68 <= buf.len()`, the next 64
        // masked to what `buf` holds), and every store writes inside `tokens`: its mask keeps the
        // first `take` lanes, at most the ids that remain (a masked-off lane is neither written nor
        // checked for faults, so a store of no lanes past the end writes nothing).
        unsafe {
            let iota = _mm512_loadu_si512(IOTA.as_ptr().cast());
            let identity_high = _mm512_add_epi8(iota, _mm512_set1_epi8(64));
            let after_u16 = _mm512_add_epi8(iota, _mm512_set1_epi8(3));
            let after_u32 = _mm512_add_epi8(iota, _mm512_set1_epi8(5));
            let dead = _mm512_set1_epi8(DEAD as i8);
            let u16_marker = _mm512_set1_epi8(0xcd_u8 as i8);
            let u32_marker = _mm512_set1_epi8(0xce_u8 as i8);
            let back = _mm512_loadu_si512(BACK.as_ptr().cast());
            let expand = [
                (
                    _mm512_loadu_si512(EXPAND[0].as_ptr().cast()),
                    _mm512_loadu_si512(EXPAND_NEXT[0].as_ptr().cast()),
                ),
                (
                    _mm512_loadu_si512(EXPAND[1].as_ptr().cast()),
                    _mm512_loadu_si512(EXPAND_NEXT[1].as_ptr().cast()),
                ),
            ];
            let mut chunk = start;
            let mut entry = 0usize;
            while chunk + CHUNK_REACH <= buf.len() {
                prefetch_ptr(base.wrapping_add(chunk + PREFETCH_AHEAD));
                let here = _mm512_loadu_si512(base.add(chunk).cast());
                let after = buf.len() - chunk - 64;
                let next_mask = if after >= 64 { u64::MAX } else { (1u64 << after) - 1 };
                let next = _mm512_maskz_loadu_epi8(next_mask, base.add(chunk + 64).cast());
                let is_u32 = _mm512_cmpeq_epi8_mask(here, u32_marker);
                let is_u16 = _mm512_cmpeq_epi8_mask(here, u16_marker);
                let j1 = _mm512_mask_blend_epi8(
                    is_u32,
                    _mm512_mask_blend_epi8(is_u16, dead, after_u16),
                    after_u32,
                );
                let j2 = _mm512_permutex2var_epi8(j1, j1, identity_high);
                let j4 = _mm512_permutex2var_epi8(j2, j2, identity_high);
                let j8 = _mm512_permutex2var_epi8(j4, j4, identity_high);
                let j16 = _mm512_permutex2var_epi8(j8, j8, identity_high);
                let j32 = _mm512_permutex2var_epi8(j16, j16, identity_high);
                let exit_lanes = _mm512_permutexvar_epi8(_mm512_set1_epi8(entry as i8), j32);
                let exit = (_mm_cvtsi128_si32(_mm512_castsi512_si128(exit_lanes)) & 0xff) as usize;
                // Lane k: where the k-th id from `entry` starts.
                let mut orbit = _mm512_set1_epi8(entry as i8);
                for (power, bits) in [j1, j2, j4, j8, j16].into_iter().zip(ORBIT_BITS) {
                    orbit = _mm512_mask2_permutex2var_epi8(power, orbit, bits, identity_high);
                }
                // The lanes inside the chunk are the first ones (the positions only grow).
                let inside = _mm512_cmplt_epu8_mask(orbit, _mm512_set1_epi8(64)) & 0xffff_ffff;
                let mut ids = (!inside).trailing_zeros() as usize;
                let stopped = exit == usize::from(DEAD);
                // When stopped, the last position inside is the id in another form.
                ids -= usize::from(stopped);
                let take = ids.min(count - i);
                // Both halves are written whatever `take` is (a store of no lanes writes nothing):
                // whether a chunk holds more than 16 ids is a coin toss a branch would mispredict.
                let lanes = (1u32 << take) - 1;
                for (half, &(expand, expand_next)) in expand.iter().enumerate() {
                    // An id's value is the bytes between its marker and the next id's start, read
                    // backwards; lanes at or before its marker (the top two of a u16) are zeroed
                    // (compared signed: positions are below 128, one before the chunk is -1).
                    let starts = _mm512_permutexvar_epi8(expand, orbit);
                    let index = _mm512_sub_epi8(_mm512_permutexvar_epi8(expand_next, orbit), back);
                    let keep = _mm512_cmpgt_epi8_mask(index, starts);
                    let values = _mm512_maskz_permutex2var_epi8(keep, here, index, next);
                    let store = (lanes >> (16 * half)) as u16;
                    _mm512_mask_storeu_epi32(out.wrapping_add(i + 16 * half).cast(), store, values);
                }
                i += take;
                if stopped || take < ids || i == count {
                    let mut positions = [0u8; 64];
                    _mm512_storeu_si512(positions.as_mut_ptr().cast(), orbit);
                    return (i, chunk + usize::from(positions[take]));
                }
                chunk += 64;
                entry = exit - 64;
            }
            (i, chunk + entry)
        }
    }
}
