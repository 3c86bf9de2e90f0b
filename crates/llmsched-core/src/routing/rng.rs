//! Seeded randomness for one decision. Each decision draws from its own generator, seeded from
//! the router's seed and the decision's sequence number, so a run replays exactly when the same
//! requests arrive in the same order, whatever the threads.

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// The generator of one decision, seeded at its first draw (most decisions draw nothing: a
/// round-robin or a least-loaded pick).
pub struct DecisionRng {
    seed: u64,
    rng: Option<Xoshiro256PlusPlus>,
}

impl DecisionRng {
    pub fn new(seed: u64, sequence: u64) -> Self {
        // Spread the sequence number so neighbouring decisions get unrelated streams.
        let mixed = seed ^ sequence.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        DecisionRng { seed: mixed, rng: None }
    }

    pub fn next_u64(&mut self) -> u64 {
        let seed = self.seed;
        self.rng.get_or_insert_with(|| Xoshiro256PlusPlus::seed_from_u64(seed)).next_u64()
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1): never 0, so logarithms and powers stay finite.
    pub fn open_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform index below `n` (n > 0), by Lemire's multiply-shift (bias below 2^-64 * n).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A standard Gumbel draw.
    pub fn gumbel(&mut self) -> f64 {
        -(-self.open_unit().ln()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeding at the first draw changes no draw: the same numbers as the generator seeded
    /// when the decision starts.
    #[test]
    fn the_draws_are_those_of_the_generator_seeded_up_front() {
        for (seed, sequence) in [(0u64, 0u64), (7, 42), (u64::MAX, 1 << 40)] {
            let mut lazy = DecisionRng::new(seed, sequence);
            let mixed = seed ^ sequence.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
            let mut eager = Xoshiro256PlusPlus::seed_from_u64(mixed);
            for _ in 0..16 {
                assert_eq!(lazy.next_u64(), eager.next_u64());
            }
        }
    }
}
