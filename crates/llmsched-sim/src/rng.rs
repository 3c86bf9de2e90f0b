//! The two random generators the Python workload classes draw from, reimplemented so that a
//! plan built here equals the plan the Python classes build for the same seed, draw for draw:
//!
//! - [`Pcg64`]: numpy's `Generator(PCG64)` as `numpy.random.default_rng` makes it — the
//!   PCG XSL-RR 128/64 generator, seeded through numpy's `SeedSequence` (its hash-mixing pool
//!   of four 32-bit words), with the 32-bit draws numpy buffers (two per 64-bit output, the
//!   spare kept across calls), `random()` doubles (53 high bits) and the bounded integers of
//!   `Generator.integers` (Lemire's multiply-and-reject, 32-bit whenever the range fits).
//! - [`PyRandom`]: CPython's `random.Random` — MT19937 seeded by `init_by_array` from the
//!   seed's 32-bit words, `random()`, `getrandbits`, `randrange(n)` by rejection on
//!   `n.bit_length()` bits, `expovariate` and `gammavariate` (Cheng's method above shape 1,
//!   Kennedy and Gentle's GS below it), with the same floating-point expressions in the same
//!   order (the libm calls are the platform's, as CPython's are).
//!
//! Distributions numpy draws through its ziggurat tables (exponential, gamma, normal) are not
//! here: the workload classes draw those in Python and hand this module the generator state
//! that follows ([`Pcg64::from_state`]).
//!
//! The tests in `tests/test_sim_workloads.py` compare every function here with numpy and
//! CPython over many seeds.

/// numpy's PCG64 multiplier (the 128-bit default multiplier of the PCG family).
const PCG_MULT: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

/// numpy's `Generator(PCG64(seed))`: the state, increment and the buffered 32-bit half.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    /// The high half of the last 64-bit output, not yet handed out as a 32-bit draw.
    spare: Option<u32>,
}

impl Pcg64 {
    /// The generator numpy seeds from this entropy: `default_rng(n)` is `from_entropy(&words(n))`,
    /// `default_rng([a, b])` is `words(a)` followed by `words(b)` (see [`words`]).
    pub fn from_entropy(entropy: &[u32]) -> Self {
        let w = seed_sequence_state(entropy, 8);
        let word = |i: usize| u64::from(w[2 * i]) | (u64::from(w[2 * i + 1]) << 32);
        let seed = (u128::from(word(0)) << 64) | u128::from(word(1));
        let inc = (u128::from(word(2)) << 64) | u128::from(word(3));
        let mut g = Pcg64 { state: 0, inc: (inc << 1) | 1, spare: None };
        g.step();
        g.state = g.state.wrapping_add(seed);
        g.step();
        g
    }

    /// The generator in the state numpy reports (`bit_generator.state`: `state`, `inc`,
    /// `has_uint32`, `uinteger`).
    pub fn from_state(state: u128, inc: u128, has_uint32: bool, uinteger: u32) -> Self {
        Pcg64 { state, inc, spare: has_uint32.then_some(uinteger) }
    }

    /// The state as numpy reports it (`state`, `inc`, `has_uint32`, `uinteger`).
    pub fn state(&self) -> (u128, u128, bool, u32) {
        (self.state, self.inc, self.spare.is_some(), self.spare.unwrap_or(0))
    }

    #[inline]
    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// The next 64-bit output (XSL-RR of the advanced state).
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        (((s >> 64) as u64) ^ (s as u64)).rotate_right((s >> 122) as u32)
    }

    /// The next 32-bit draw: the low half of a fresh 64-bit output, then its high half.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.spare.take() {
            return high;
        }
        let next = self.next_u64();
        self.spare = Some((next >> 32) as u32);
        next as u32
    }

    /// `random()`: a double in [0, 1) from the 53 high bits of a 64-bit output.
    #[inline]
    pub fn next_double(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// One of `integers(low, high)` for a range below 2**32 (`span = high - low - 1`, inclusive):
    /// Lemire's method on 32-bit draws.
    #[inline]
    fn bounded_u32(&mut self, span: u32) -> u32 {
        if span == 0 {
            return 0;
        }
        if span == u32::MAX {
            return self.next_u32();
        }
        let excl = span + 1;
        let mut m = u64::from(self.next_u32()) * u64::from(excl);
        let mut leftover = m as u32;
        if leftover < excl {
            let threshold = (u32::MAX - span) % excl;
            while leftover < threshold {
                m = u64::from(self.next_u32()) * u64::from(excl);
                leftover = m as u32;
            }
        }
        (m >> 32) as u32
    }

    /// One of `integers(low, high)` for any 64-bit range (`span` inclusive): 32-bit draws
    /// when the span fits in 32 bits, as numpy does, else Lemire's method on 64-bit outputs.
    #[inline]
    fn bounded_u64(&mut self, span: u64) -> u64 {
        if span <= u64::from(u32::MAX) {
            return u64::from(self.bounded_u32(span as u32));
        }
        if span == u64::MAX {
            return self.next_u64();
        }
        let excl = span + 1;
        let mut m = u128::from(self.next_u64()) * u128::from(excl);
        let mut leftover = m as u64;
        if leftover < excl {
            let threshold = (u64::MAX - span) % excl;
            while leftover < threshold {
                m = u128::from(self.next_u64()) * u128::from(excl);
                leftover = m as u64;
            }
        }
        (m >> 64) as u64
    }

    /// `integers(low, high, n, dtype=np.uint32)` appended to `out` (`low < high`).
    ///
    /// `bounded_u32` unrolled over both halves of each 64-bit output: a draw is
    /// rejected exactly when its low product word is below `(2**32 - excl) % excl`, the
    /// threshold numpy computes after its `leftover < excl` shortcut, and a rejected draw is
    /// redrawn from the next 32-bit half, as numpy's loop does.
    pub fn fill_u32(&mut self, low: u32, high: u32, n: usize, out: &mut Vec<u32>) {
        debug_assert!(low < high);
        let span = high - low - 1;
        if span == 0 || span == u32::MAX {
            out.reserve(n);
            out.extend((0..n).map(|_| low + self.bounded_u32(span)));
            return;
        }
        let excl = span + 1;
        let threshold = (u32::MAX - span) % excl;
        let accept = |u: u32| {
            let m = u64::from(u) * u64::from(excl);
            ((m as u32) >= threshold).then_some(low + (m >> 32) as u32)
        };
        let start = out.len();
        out.resize(start + n, 0);
        let buf = &mut out[start..];
        let mut k = 0;
        while k < n {
            if let Some(high_half) = self.spare.take() {
                if let Some(v) = accept(high_half) {
                    buf[k] = v;
                    k += 1;
                }
                continue;
            }
            if n - k == 1 {
                if let Some(v) = accept(self.next_u32()) {
                    buf[k] = v;
                    k += 1;
                }
                continue;
            }
            let r = self.next_u64();
            match accept(r as u32) {
                Some(v) => {
                    buf[k] = v;
                    k += 1;
                }
                None => {
                    self.spare = Some((r >> 32) as u32);
                    continue;
                }
            }
            if let Some(v) = accept((r >> 32) as u32) {
                buf[k] = v;
                k += 1;
            }
        }
    }

    /// `integers(low, high, n, dtype=np.int64)` appended to `out` (`low < high`), as `u64`
    /// bit patterns (the workloads draw only non-negative values).
    pub fn fill_i64(&mut self, low: i64, high: i64, n: usize, out: &mut Vec<u64>) {
        debug_assert!(low < high);
        let span = (high as u64).wrapping_sub(low as u64).wrapping_sub(1);
        out.reserve(n);
        out.extend((0..n).map(|_| (low as u64).wrapping_add(self.bounded_u64(span))));
    }
}

/// numpy's conversion of a non-negative integer to `SeedSequence` entropy: its 32-bit words,
/// least significant first (`[0]` for zero).
pub fn words(n: u128) -> Vec<u32> {
    if n == 0 {
        return vec![0];
    }
    let mut out = Vec::with_capacity(4);
    let mut n = n;
    while n > 0 {
        out.push(n as u32);
        n >>= 32;
    }
    out
}

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const POOL_SIZE: usize = 4;

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut value = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    value = value.wrapping_mul(*hash_const);
    value ^ (value >> 16)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L.wrapping_mul(x).wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> 16)
}

/// `SeedSequence(entropy).generate_state(n_words, np.uint32)`.
pub fn seed_sequence_state(entropy: &[u32], n_words: usize) -> Vec<u32> {
    let mut pool = [0u32; POOL_SIZE];
    let mut hash_const = INIT_A;
    for (i, slot) in pool.iter_mut().enumerate() {
        *slot = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hash_const);
    }
    for src in 0..POOL_SIZE {
        for dst in 0..POOL_SIZE {
            if src != dst {
                pool[dst] = mix(pool[dst], hashmix(pool[src], &mut hash_const));
            }
        }
    }
    for &word in entropy.iter().skip(POOL_SIZE) {
        for slot in &mut pool {
            *slot = mix(*slot, hashmix(word, &mut hash_const));
        }
    }
    let mut hash_const = INIT_B;
    (0..n_words)
        .map(|i| {
            let mut v = pool[i % POOL_SIZE] ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hash_const);
            v ^ (v >> 16)
        })
        .collect()
}

const MT_N: usize = 624;
const MT_M: usize = 397;

/// CPython's `random.Random(seed)` for a non-negative integer seed.
#[derive(Clone)]
pub struct PyRandom {
    mt: Box<[u32; MT_N]>,
    index: usize,
}

impl std::fmt::Debug for PyRandom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyRandom").field("index", &self.index).finish_non_exhaustive()
    }
}

impl PyRandom {
    /// `random.Random(seed)` (CPython seeds with the absolute value's 32-bit words).
    pub fn new(seed: u128) -> Self {
        let key = words(seed);
        let mut mt = Box::new([0u32; MT_N]);
        mt[0] = 19_650_218;
        for i in 1..MT_N {
            mt[i] =
                1_812_433_253u32.wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_add(i as u32);
        }
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..MT_N.max(key.len()) {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= MT_N {
                mt[0] = mt[MT_N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..MT_N - 1 {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= MT_N {
                mt[0] = mt[MT_N - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
        PyRandom { mt, index: MT_N }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        let mag = |y: u32| if y & 1 == 1 { 0x9908_b0df } else { 0 };
        let mt = &mut self.mt;
        for k in 0..MT_N {
            let y = (mt[k] & UPPER) | (mt[(k + 1) % MT_N] & LOWER);
            mt[k] = mt[(k + MT_M) % MT_N] ^ (y >> 1) ^ mag(y);
        }
        self.index = 0;
    }

    /// The next 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= MT_N {
            self.twist();
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `random()`: 53 bits from two outputs.
    pub fn random(&mut self) -> f64 {
        let a = self.next_u32() >> 5;
        let b = self.next_u32() >> 6;
        (f64::from(a) * 67_108_864.0 + f64::from(b)) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for `1 <= k <= 32`.
    fn getrandbits(&mut self, k: u32) -> u32 {
        self.next_u32() >> (32 - k)
    }

    /// `randrange(n)` for `1 <= n < 2**32`.
    pub fn randbelow(&mut self, n: u32) -> u32 {
        let k = 32 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `expovariate(lambd)`.
    pub fn expovariate(&mut self, lambd: f64) -> f64 {
        -(1.0 - self.random()).ln() / lambd
    }

    /// `gammavariate(alpha, beta)` for `alpha > 0`, `beta > 0`.
    pub fn gammavariate(&mut self, alpha: f64, beta: f64) -> f64 {
        debug_assert!(alpha > 0.0 && beta > 0.0);
        if alpha > 1.0 {
            let log4 = 4.0f64.ln();
            let sg_magicconst = 1.0 + 4.5f64.ln();
            let ainv = (2.0 * alpha - 1.0).sqrt();
            let bbb = alpha - log4;
            let ccc = alpha + ainv;
            loop {
                let u1 = self.random();
                if !(1e-7 < u1 && u1 < 0.999_999_9) {
                    continue;
                }
                let u2 = 1.0 - self.random();
                let v = (u1 / (1.0 - u1)).ln() / ainv;
                let x = alpha * v.exp();
                let z = u1 * u1 * u2;
                let r = bbb + ccc * v - x;
                if r + sg_magicconst - 4.5 * z >= 0.0 || r >= z.ln() {
                    return x * beta;
                }
            }
        } else if alpha == 1.0 {
            -(1.0 - self.random()).ln() * beta
        } else {
            let e = std::f64::consts::E;
            let x = loop {
                let u = self.random();
                let b = (e + alpha) / e;
                let p = b * u;
                let x = if p <= 1.0 { p.powf(1.0 / alpha) } else { -((b - p) / alpha).ln() };
                let u1 = self.random();
                if p > 1.0 {
                    if u1 <= x.powf(alpha - 1.0) {
                        break x;
                    }
                } else if u1 <= (-x).exp() {
                    break x;
                }
            };
            x * beta
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values numpy 2 and CPython 3.11 give for these seeds (the Python tests compare whole
    /// plans over many seeds; these pin the generators without Python).
    #[test]
    fn draws_equal_numpy_and_cpython() {
        let mut g = Pcg64::from_entropy(&words(0));
        assert_eq!(
            g.state(),
            (
                35_399_562_948_360_463_058_890_781_895_381_311_971,
                87_136_372_517_582_989_555_478_159_403_783_844_777,
                false,
                0
            )
        );
        let mut tokens = Vec::new();
        g.fill_u32(0, 128_000, 5, &mut tokens);
        assert_eq!(tokens, [108_879, 81_531, 65_425, 34_532, 39_402]);
        let mut ids = Vec::new();
        g.fill_i64(1, i64::MAX, 2, &mut ids);
        assert_eq!(ids, [152_440_531_369_162_767, 7_501_093_982_645_987_484]);
        assert_eq!(g.next_double(), 0.912_755_577_277_721_7);
        let mut g = Pcg64::from_entropy(&[7, 1, 256]); // default_rng([7, 2**40 + 1])
        let mut small = Vec::new();
        g.fill_i64(0, 10, 3, &mut small);
        assert_eq!(small, [6, 0, 0]);
        let mut r = PyRandom::new((1 << 70) + 3);
        assert_eq!(r.random(), 0.163_395_072_006_424_56);
        assert_eq!(r.randbelow(5), 1);
        assert_eq!(r.gammavariate(11.1, 2.0), 25.379_930_961_894_615);
        assert_eq!(r.gammavariate(1.0, 2.0), 0.900_740_298_104_166);
        assert_eq!(r.gammavariate(0.3, 2.0), 0.062_151_729_184_785_884);
        assert_eq!(r.expovariate(0.5), 0.895_027_506_851_957_9);
    }

    #[test]
    fn words_split_little_endian() {
        assert_eq!(words(0), vec![0]);
        assert_eq!(words(5), vec![5]);
        assert_eq!(words(1 << 32 | 7), vec![7, 1]);
    }

    #[test]
    fn bounded_draws_stay_in_range() {
        let mut g = Pcg64::from_entropy(&[3]);
        let mut out = Vec::new();
        g.fill_u32(0, 128_000, 1000, &mut out);
        assert!(out.iter().all(|&t| t < 128_000));
        let mut big = Vec::new();
        g.fill_i64(1, i64::MAX, 1000, &mut big);
        assert!(big.iter().all(|&h| h >= 1 && h < i64::MAX as u64));
        g.fill_u32(7, 8, 3, &mut out);
        assert_eq!(&out[1000..], &[7, 7, 7]);
    }

    #[test]
    fn the_spare_half_is_handed_out_next() {
        let mut a = Pcg64::from_entropy(&[1]);
        let mut b = a.clone();
        let full = b.next_u64();
        assert_eq!(a.next_u32(), full as u32);
        assert!(a.state().2);
        assert_eq!(a.next_u32(), (full >> 32) as u32);
        let (s, inc, has, spare) = a.state();
        assert_eq!(Pcg64::from_state(s, inc, has, spare), a);
    }

    #[test]
    fn python_random_draws_are_in_range() {
        let mut r = PyRandom::new(0);
        for _ in 0..1000 {
            let u = r.random();
            assert!((0.0..1.0).contains(&u));
            assert!(r.randbelow(5) < 5);
            assert!(r.gammavariate(0.5, 2.0) >= 0.0);
            assert!(r.gammavariate(11.1, 2.0) > 0.0);
            assert!(r.expovariate(0.5) >= 0.0);
        }
    }
}
