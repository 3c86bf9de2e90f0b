//! xxh3-64 with a seed, bit-identical to `xxhash_rust::xxh3::xxh3_64_with_seed` for every input,
//! with the long path (inputs over 240 bytes: a block of 64 or more u32 ids) written for AVX2
//! and chosen at run time.
//!
//! Why: the project builds for generic x86_64, so `xxhash_rust` (which picks its vector code at
//! compile time) runs its SSE2 long path, and for a non-zero seed it first writes a 192-byte
//! secret derived from the seed and then reads it back. A chain of block hashes seeds each block
//! with the hash before it, so what counts is the latency from the seed to the hash.
//!
//! Algorithm (xxh3's long path, as in the reference): the derived secret's 64-bit word `k` is
//! the default secret's word `k` plus the seed for even `k`, minus it for odd `k`. Eight 64-bit
//! accumulators take one 64-byte stripe of input at a time, stripe `k` of a 1024-byte block
//! against the secret at byte `8k`; after each full block they are scrambled with the secret at
//! byte 128; the last 64 bytes of input are accumulated once more against the secret at byte
//! 121, and the accumulators merge (against the secret at byte 11) into the hash. Here the
//! secret is never stored: each 32-byte piece of it the stripes read is one load of the default
//! secret and one vector add, and the two unaligned pieces (bytes 121 and 11) are built from two
//! aligned ones with shifts. Each stripe is two 256-bit accumulator lanes.
//!
//! Inputs of 240 bytes or fewer, processors without AVX2, other architectures and code run
//! inside [`with_reference_xxh3`] use `xxhash_rust` itself.

use std::cell::Cell;

/// Inputs up to this many bytes take xxh3's short and mid-size paths, which derive no secret
/// and stay with `xxhash_rust`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MID_SIZE_MAX: usize = 240;

thread_local! {
    /// Set by [`with_reference_xxh3`] for the duration of its closure, on this thread.
    static REFERENCE_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the hand-written long path turned off on this thread (every hash is
/// `xxhash_rust`'s), so that tests and benchmarks can compare the two on the same processor.
pub fn with_reference_xxh3<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            REFERENCE_ONLY.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(REFERENCE_ONLY.with(|r| r.replace(true)));
    f()
}

/// True when [`xxh3_64_with_seed`] takes the AVX2 long path for inputs over 240 bytes on this
/// thread now (x86_64 with AVX2, outside [`with_reference_xxh3`]).
#[inline]
pub fn long_path_accelerated() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && !REFERENCE_ONLY.with(Cell::get)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The 64-bit xxh3 hash of `input` with `seed`: exactly `xxhash_rust::xxh3::xxh3_64_with_seed`.
#[inline]
pub fn xxh3_64_with_seed(input: &[u8], seed: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if input.len() > MID_SIZE_MAX && long_path_accelerated() {
        // SAFETY: AVX2 was detected on this processor, and the input is over 240 bytes.
        return unsafe { avx2::long_with_seed(input, seed) };
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(input, seed)
}

/// xxh3's default secret (the reference's `kSecret`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const DEFAULT_SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::DEFAULT_SECRET;

    const PRIME32_1: u64 = 0x9E37_79B1;
    const PRIME32_2: u64 = 0x85EB_CA77;
    const PRIME32_3: u64 = 0xC2B2_AE3D;
    const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
    const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

    /// The accumulators' starting values.
    const INITIAL_ACC: [u64; 8] =
        [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

    /// Bytes per stripe, and stripes per block (between scrambles).
    const STRIPE_LEN: usize = 64;
    const STRIPES_PER_BLOCK: usize = 16;
    const BLOCK_LEN: usize = STRIPE_LEN * STRIPES_PER_BLOCK;

    /// What the seed adds to four consecutive words of the default secret, starting at an even
    /// word (`even`: `+s, -s, +s, -s`) or an odd one (`odd`: `-s, +s, -s, +s`).
    #[derive(Clone, Copy)]
    struct SeedOffsets {
        even: __m256i,
        odd: __m256i,
    }

    /// Words `k..k + 4` of the secret derived from the seed.
    #[inline(always)]
    unsafe fn secret_words(k: usize, offsets: SeedOffsets) -> __m256i {
        debug_assert!(8 * k + 32 <= DEFAULT_SECRET.len());
        // SAFETY: the caller's `k` is at most 20, so the 32 bytes read lie in the secret.
        unsafe {
            let default = _mm256_loadu_si256(DEFAULT_SECRET.as_ptr().add(8 * k).cast());
            _mm256_add_epi64(default, if k % 2 == 0 { offsets.even } else { offsets.odd })
        }
    }

    /// The 32 bytes of the derived secret at byte `8k + SHIFT / 8` (an unaligned offset): each
    /// lane is the top of word `k + j` and the bottom of word `k + j + 1`.
    #[inline(always)]
    unsafe fn secret_words_unaligned<const SHIFT: i32, const BACK: i32>(
        k: usize,
        offsets: SeedOffsets,
    ) -> __m256i {
        // SAFETY: as for `secret_words`, with `k + 1` at most 20.
        unsafe {
            _mm256_or_si256(
                _mm256_srli_epi64::<SHIFT>(secret_words(k, offsets)),
                _mm256_slli_epi64::<BACK>(secret_words(k + 1, offsets)),
            )
        }
    }

    /// One 32-byte half of a stripe into its four accumulators: each gains the product of the
    /// low and high halves of (data ^ key), and its neighbour's data word.
    #[inline(always)]
    unsafe fn accumulate_half(acc: __m256i, data: *const u8, key: __m256i) -> __m256i {
        // SAFETY: the caller's `data` has 32 readable bytes.
        unsafe {
            let data = _mm256_loadu_si256(data.cast());
            let data_key = _mm256_xor_si256(data, key);
            let product = _mm256_mul_epu32(data_key, _mm256_srli_epi64::<32>(data_key));
            let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
            _mm256_add_epi64(acc, _mm256_add_epi64(swapped, product))
        }
    }

    /// Stripe `k` of a block (64 bytes at `data`) against the secret at byte `8k`.
    #[inline(always)]
    unsafe fn accumulate_stripe(
        acc: &mut [__m256i; 2],
        data: *const u8,
        k: usize,
        offsets: SeedOffsets,
    ) {
        // SAFETY: the caller's `data` has 64 readable bytes and `k` is below 16.
        unsafe {
            acc[0] = accumulate_half(acc[0], data, secret_words(k, offsets));
            acc[1] = accumulate_half(acc[1], data.add(32), secret_words(k + 4, offsets));
        }
    }

    /// The accumulators after a full block, against the secret at byte 128.
    #[inline(always)]
    unsafe fn scramble(acc: &mut [__m256i; 2], offsets: SeedOffsets) {
        // SAFETY: the secret words read are 16 to 23.
        unsafe {
            let prime = _mm256_set1_epi32(PRIME32_1 as i32);
            for (half, lane) in acc.iter_mut().enumerate() {
                let key = secret_words(16 + 4 * half, offsets);
                let mixed = _mm256_xor_si256(*lane, _mm256_srli_epi64::<47>(*lane));
                let data_key = _mm256_xor_si256(mixed, key);
                let low = _mm256_mul_epu32(data_key, prime);
                let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(data_key), prime);
                *lane = _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high));
            }
        }
    }

    /// The 128-bit product of two words, its halves xored.
    #[inline(always)]
    fn mul128_fold64(a: u64, b: u64) -> u64 {
        let product = u128::from(a) * u128::from(b);
        (product as u64) ^ ((product >> 64) as u64)
    }

    /// xxh3's final mix.
    #[inline(always)]
    fn avalanche(mut h: u64) -> u64 {
        h ^= h >> 37;
        h = h.wrapping_mul(0x1656_6791_9E37_79F9);
        h ^ (h >> 32)
    }

    /// xxh3-64 of `input` (over 240 bytes) with `seed`.
    ///
    /// # Safety
    /// The processor must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn long_with_seed(input: &[u8], seed: u64) -> u64 {
        let len = input.len();
        debug_assert!(len > super::MID_SIZE_MAX);
        let data = input.as_ptr();
        // SAFETY: every load below reads whole stripes inside `input` (the last stripe is its
        // final 64 bytes, and `len` is over 64) or words 0 to 23 of the 24-word secret.
        unsafe {
            let s = seed as i64;
            let offsets = SeedOffsets {
                even: _mm256_set_epi64x(s.wrapping_neg(), s, s.wrapping_neg(), s),
                odd: _mm256_set_epi64x(s, s.wrapping_neg(), s, s.wrapping_neg()),
            };
            let mut acc = [
                _mm256_loadu_si256(INITIAL_ACC.as_ptr().cast()),
                _mm256_loadu_si256(INITIAL_ACC.as_ptr().add(4).cast()),
            ];
            // The reference leaves the last byte out when counting blocks and stripes, so an
            // input ending exactly on a stripe still has its last stripe taken separately.
            let full_blocks = (len - 1) / BLOCK_LEN;
            for b in 0..full_blocks {
                let block = data.add(b * BLOCK_LEN);
                for k in 0..STRIPES_PER_BLOCK {
                    accumulate_stripe(&mut acc, block.add(k * STRIPE_LEN), k, offsets);
                }
                scramble(&mut acc, offsets);
            }
            let tail = full_blocks * BLOCK_LEN;
            let stripes = (len - 1 - tail) / STRIPE_LEN;
            let block = data.add(tail);
            for k in 0..stripes {
                accumulate_stripe(&mut acc, block.add(k * STRIPE_LEN), k, offsets);
            }
            // Last stripe: the secret at byte 121 = 8 * 15 + 1.
            let last = data.add(len - STRIPE_LEN);
            acc[0] = accumulate_half(acc[0], last, secret_words_unaligned::<8, 56>(15, offsets));
            acc[1] =
                accumulate_half(acc[1], last.add(32), secret_words_unaligned::<8, 56>(19, offsets));
            // Merge against the secret at byte 11 = 8 * 1 + 3.
            let merged = [
                _mm256_xor_si256(acc[0], secret_words_unaligned::<24, 40>(1, offsets)),
                _mm256_xor_si256(acc[1], secret_words_unaligned::<24, 40>(5, offsets)),
            ];
            let mut words = [0u64; 8];
            _mm256_storeu_si256(words.as_mut_ptr().cast(), merged[0]);
            _mm256_storeu_si256(words.as_mut_ptr().add(4).cast(), merged[1]);
            let pairs = (mul128_fold64(words[0], words[1])
                .wrapping_add(mul128_fold64(words[2], words[3])))
            .wrapping_add(
                mul128_fold64(words[4], words[5]).wrapping_add(mul128_fold64(words[6], words[7])),
            );
            avalanche((len as u64).wrapping_mul(PRIME64_1).wrapping_add(pairs))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64_with_seed as reference;

    /// Deterministic bytes (splitmix64), so that no two stripes repeat.
    fn bytes(n: usize, salt: u64) -> Vec<u8> {
        let mut x = salt;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u8
            })
            .collect()
    }

    const SEEDS: [u64; 8] = [
        0,
        1,
        u64::MAX,
        0x8000_0000_0000_0000,
        0x0123_4567_89ab_cdef,
        0xdead_beef_f00d_cafe,
        0x9E37_79B1_85EB_CA87,
        7,
    ];

    #[test]
    fn every_length_to_4096_matches_the_reference() {
        let data = bytes(4096 + 64, 1);
        for len in 0..=4096 {
            for &seed in &SEEDS {
                let input = &data[..len];
                assert_eq!(xxh3_64_with_seed(input, seed), reference(input, seed), "len {len}");
            }
        }
    }

    #[test]
    fn long_inputs_match_the_reference_at_every_alignment() {
        let data = bytes(70_000, 2);
        let mut seed = 0x1234_5678u64;
        for len in [241, 255, 256, 257, 511, 512, 1023, 1024, 1025, 2048, 4097, 16_384, 65_536] {
            for start in 0..8 {
                seed = avalanche_for_tests(seed);
                let input = &data[start..start + len];
                assert_eq!(xxh3_64_with_seed(input, seed), reference(input, seed), "len {len}");
            }
        }
    }

    #[test]
    fn the_long_path_is_the_one_tested_where_it_exists() {
        let data = bytes(512, 3);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            assert!(long_path_accelerated());
            // The AVX2 path directly, not through the dispatch.
            for seed in SEEDS {
                // SAFETY: AVX2 was detected, and the input is over 240 bytes.
                let got = unsafe { avx2::long_with_seed(&data, seed) };
                assert_eq!(got, reference(&data, seed));
            }
        }
        with_reference_xxh3(|| {
            assert!(!long_path_accelerated());
            for seed in SEEDS {
                assert_eq!(xxh3_64_with_seed(&data, seed), reference(&data, seed));
            }
        });
        assert_eq!(long_path_accelerated(), cfg!(target_arch = "x86_64") && avx2_here());
    }

    fn avx2_here() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    fn avalanche_for_tests(x: u64) -> u64 {
        let z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^ (z >> 31)
    }
}
