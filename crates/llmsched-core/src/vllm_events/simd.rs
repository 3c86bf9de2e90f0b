//! AVX2 decoding of runs of token ids in the two forms a large vocabulary mixes: u16 (`0xcd`
//! and 2 bytes) and u32 (`0xce` and 4 bytes), several ids per step.
//!
//! Algorithm: a step loads the 16 bytes at the cursor and compares them with both markers at
//! once. Where ids only take 3 or 5 bytes, where each of the first four starts in a window is
//! fixed by whether the ones before it are `0xce`: by the `0xce` bits at the 9 offsets an id
//! can start at (0, 3, 5, 6, 8, 9, 10, 11, 13). Those 9 bits index a table ([`STEPS`], built at
//! compile time) that says how many ids fit in the window (3 or 4), the bytes they take, where
//! they start, and the byte shuffle that turns them into little-endian u32 lanes. The step is
//! taken only when every start the table assumed holds one of the two markers (a start not
//! `0xce` must be `0xcd`); otherwise nothing is consumed and the caller decodes the next id on
//! the scalar path, which handles every other form and every error. The ids decoded are
//! therefore exactly the scalar path's.
//!
//! Complexity: a load, two compares, two shuffles, two masks and a table entry per 3 or 4 ids,
//! where the scalar path pays a table load and a shift per id. Each step still depends on the
//! previous one's width, so [`super::reader`] runs three chains of steps at once (the scalar
//! path keeps two: more cost it more instructions than they saved).
//!
//! Used on x86_64 when the processor has AVX2 (checked at run time) and not AVX-512 VBMI (whose
//! 64-byte chunks, `super::vbmi`, take the long runs there); elsewhere, or with
//! [`with_scalar_decoding`], only the scalar path runs. [`with_avx2_decoding`] keeps this path
//! where VBMI would run.

use std::cell::Cell;

/// The offsets in a 16-byte window at which one of the first four ids can start when every id
/// takes 3 or 5 bytes; bit `k` of a table index is the `0xce` bit of offset `STARTS[k]`.
const STARTS: [usize; 9] = [0, 3, 5, 6, 8, 9, 10, 11, 13];

/// One table entry: what a window whose `0xce` bits at [`STARTS`] are the entry's index holds.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(super) struct Step {
    /// `pshufb` control: lane `k` gets id `k`'s value bytes reversed, zeros above (0x80).
    shuffle: [u8; 16],
    /// Offsets of the ids' markers (a bit per byte of the window).
    markers: u16,
    /// Ids in the window (3 or 4: three of 5 bytes fit).
    pub count: u8,
    /// Bytes they take.
    pub consumed: u8,
    /// Where each id starts (unused lanes 0).
    pub starts: [u8; 4],
}

const fn build_step(index: usize) -> Step {
    let mut step = Step { shuffle: [0x80; 16], markers: 0, count: 0, consumed: 0, starts: [0; 4] };
    let mut pos = 0;
    let mut count = 0;
    while count < 4 {
        // Which bit of the index describes `pos`; an offset not in STARTS ends the run (no
        // fourth id can start there and fit).
        let mut bit = 0;
        while bit < STARTS.len() && STARTS[bit] != pos {
            bit += 1;
        }
        if bit == STARTS.len() {
            break;
        }
        let width = if index & (1 << bit) != 0 { 5 } else { 3 };
        if pos + width > 16 {
            break;
        }
        // Value bytes pos+1 .. pos+width-1, big-endian: the last one is the lane's lowest.
        let mut b = 0;
        while b < width - 1 {
            step.shuffle[4 * count + b] = (pos + width - 1 - b) as u8;
            b += 1;
        }
        step.markers |= 1 << pos;
        step.starts[count] = pos as u8;
        count += 1;
        pos += width;
    }
    step.count = count as u8;
    step.consumed = pos as u8;
    step
}

/// Every [`Step`], by the `0xce` bits at [`STARTS`] (12 KiB, read by the hot loop only).
pub(super) static STEPS: [Step; 512] = {
    let mut table = [build_step(0); 512];
    let mut i = 0;
    while i < 512 {
        table[i] = build_step(i);
        i += 1;
    }
    table
};

/// `pshufb` control gathering the bytes at [`STARTS`] into the low bytes (zeros above).
static GATHER_STARTS: [u8; 16] = {
    let mut control = [0x80; 16];
    let mut k = 0;
    while k < STARTS.len() {
        control[k] = STARTS[k] as u8;
        k += 1;
    }
    control
};

/// The table index of a window from its `0xce` mask (bit `p` set when byte `p` is `0xce`):
/// the mask's bits at [`STARTS`], packed; what the step's gather computes, for the tests.
#[cfg(test)]
fn step_index(ce: u32) -> usize {
    ((ce & 1) | ((ce >> 2) & 0x2) | ((ce >> 3) & 0xc) | ((ce >> 4) & 0xf0) | ((ce >> 5) & 0x100))
        as usize
}

/// The widest vector path the decoder may take on this thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum VectorLevel {
    /// The scalar path alone.
    Scalar,
    /// AVX2 steps at most.
    Avx2,
    /// Whatever the processor runs (AVX-512 VBMI chunks where it has them).
    Best,
}

thread_local! {
    /// Lowered by [`with_scalar_decoding`] and [`with_avx2_decoding`] for their closures.
    static LEVEL: Cell<VectorLevel> = const { Cell::new(VectorLevel::Best) };
}

/// The widest vector path the decoder may take on this thread now.
#[inline]
pub(super) fn vector_level() -> VectorLevel {
    LEVEL.with(Cell::get)
}

/// Runs `f` with the decoder's vector path at most `level` on this thread.
fn with_level<R>(level: VectorLevel, f: impl FnOnce() -> R) -> R {
    struct Restore(VectorLevel);
    impl Drop for Restore {
        fn drop(&mut self) {
            LEVEL.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(LEVEL.with(|l| l.replace(level.min(l.get()))));
    f()
}

/// Runs `f` with the vector paths turned off on this thread, so that tests and benchmarks can
/// compare them with the scalar path on the same payloads.
pub fn with_scalar_decoding<R>(f: impl FnOnce() -> R) -> R {
    with_level(VectorLevel::Scalar, f)
}

/// Runs `f` with the AVX-512 VBMI path turned off on this thread (AVX2 steps where the
/// processor has AVX2, else the scalar path), so that tests and benchmarks can compare the
/// two vector paths.
pub fn with_avx2_decoding<R>(f: impl FnOnce() -> R) -> R {
    with_level(VectorLevel::Avx2, f)
}

/// Proof that this processor runs AVX2 (only [`Avx2::detect`] makes one).
#[derive(Debug, Clone, Copy)]
pub(super) struct Avx2(());

impl Avx2 {
    /// `Some` when the AVX2 path may run here and now.
    #[inline]
    pub fn detect() -> Option<Avx2> {
        #[cfg(target_arch = "x86_64")]
        if vector_level() >= VectorLevel::Avx2 && std::is_x86_feature_detected!("avx2") {
            return Some(Avx2(()));
        }
        None
    }

    /// Runs `f` inside a function compiled with AVX2 enabled, so that the steps of the loops
    /// in `f` (marked `#[inline(always)]`) are inlined into it rather than called one by one.
    #[inline(always)]
    pub fn enabled<R>(self, f: impl FnOnce() -> R) -> R {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2")]
            unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: `self` exists only where AVX2 was detected.
            unsafe { with_avx2(f) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        f()
    }

    /// Decodes one step at `pos` into `out[0..4]` (all four lanes are written; the step's
    /// `count` of them are ids) and returns the step, or `None` (nothing written) when the
    /// window is not a run of u16/u32 ids, or fewer than 16 bytes remain, or `out` has fewer
    /// than 4 slots.
    #[inline(always)]
    pub fn step(self, buf: &[u8], pos: usize, out: &mut [u32]) -> Option<&'static Step> {
        let window: &[u8; 16] = buf.get(pos..pos.wrapping_add(16))?.try_into().ok()?;
        let out: &mut [u32; 4] = out.get_mut(..4)?.try_into().ok()?;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `self` exists only where AVX2 was detected.
        unsafe {
            step_avx2(window, out)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (window, out);
            None
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn step_avx2(window: &[u8; 16], out: &mut [u32; 4]) -> Option<&'static Step> {
    use std::arch::x86_64::*;
    // SAFETY (every intrinsic below): AVX2 is enabled for this function, and the loads and the
    // store go through references to exactly 16 bytes.
    unsafe {
        let v = _mm_loadu_si128(window.as_ptr().cast());
        let ce = _mm_cmpeq_epi8(v, _mm_set1_epi8(0xce_u8 as i8));
        let cd = _mm_cmpeq_epi8(v, _mm_set1_epi8(0xcd_u8 as i8));
        let marker_mask = _mm_movemask_epi8(_mm_or_si128(ce, cd)) as u32;
        // The 0xce bytes at STARTS gathered into the low 9 bytes: their mask is the index.
        let gather = _mm_loadu_si128(GATHER_STARTS.as_ptr().cast());
        let index = _mm_movemask_epi8(_mm_shuffle_epi8(ce, gather)) as usize;
        let step = &STEPS[index & (STEPS.len() - 1)];
        let markers = u32::from(step.markers);
        if marker_mask & markers != markers {
            return None;
        }
        let control = _mm_loadu_si128(step.shuffle.as_ptr().cast());
        _mm_storeu_si128(out.as_mut_ptr().cast(), _mm_shuffle_epi8(v, control));
        Some(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_walks_every_width_pattern() {
        // Every sequence of widths 3/5: the entry its 0xce bits index lists the ids that fit.
        for pattern in 0u32..16 {
            let widths: Vec<usize> =
                (0..4).map(|k| if pattern >> k & 1 != 0 { 5 } else { 3 }).collect();
            let mut ce = 0u32;
            let (mut pos, mut fit) = (0, 0);
            for &w in &widths {
                if w == 5 {
                    ce |= 1 << pos;
                }
                if pos + w > 16 {
                    break;
                }
                pos += w;
                fit += 1;
            }
            let step = &STEPS[step_index(ce)];
            assert_eq!(usize::from(step.count), fit, "{widths:?}");
            assert!(fit >= 3, "{widths:?}");
            assert_eq!(usize::from(step.consumed), pos, "{widths:?}");
        }
    }

    #[test]
    fn a_step_decodes_the_ids_of_every_width_pattern_and_refuses_other_forms() {
        let Some(avx2) = Avx2::detect() else { return };
        for pattern in 0u32..32 {
            // Ids of 3 and 5 bytes as `pattern` says, values that show every byte's place.
            let mut window = Vec::new();
            let mut want = Vec::new();
            for k in 0..5 {
                let value = 0x0102_0304_u32.wrapping_mul(k + 7);
                if pattern >> k & 1 != 0 {
                    window.push(0xce);
                    window.extend(value.to_be_bytes());
                    want.push((window.len(), value));
                } else {
                    window.push(0xcd);
                    window.extend((value as u16).to_be_bytes());
                    want.push((window.len(), u32::from(value as u16)));
                }
            }
            window.resize(32, 0xc1);
            let mut out = [0u32; 4];
            let step = avx2.step(&window, 0, &mut out).expect("a run of u16/u32 ids");
            let fit: Vec<u32> =
                want.iter().take(4).filter(|&&(end, _)| end <= 16).map(|&(_, v)| v).collect();
            assert_eq!(&out[..usize::from(step.count)], &fit[..], "pattern {pattern:05b}");
            assert_eq!(usize::from(step.consumed), want[fit.len() - 1].0);
            // Any id's marker replaced by a byte of another form: no step.
            let mut starts = vec![0usize];
            for &(end, _) in &want[..fit.len() - 1] {
                starts.push(end);
            }
            for &at in &starts {
                for bad in [0x05, 0xcc, 0xcf, 0xd1, 0xc1] {
                    let mut broken = window.clone();
                    broken[at] = bad;
                    assert!(
                        avx2.step(&broken, 0, &mut out).is_none(),
                        "{pattern:05b} {at} {bad:#x}"
                    );
                }
            }
        }
    }
}
