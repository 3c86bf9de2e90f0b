//! Shedding: whether a sheddable arrival (priority < 0) is refused at the door.
//!
//! | type | refuses when | params (defaults) |
//! |---|---|---|
//! | `probabilistic` | `u < min(sat^power * scale, 1)`, `u` uniform in [0, 1) | `power` 5, `scale` 300, `seed` 0 |
//! | `threshold` | `sat >= threshold` | `threshold` 0.9 |
//! | `none` | never | none |
//!
//! `u` comes from SplitMix64 seeded with `seed` (one draw per sheddable arrival, whether or not
//! it is shed): the top 53 bits of the next output times 2^-53. Any language can replay it.

use std::fmt;

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::SplitMix64;
use serde::{Deserialize, Serialize};

/// Decides on sheddable arrivals.
pub trait SheddingPolicy: Send + fmt::Debug {
    fn shed(&mut self, saturation: f64) -> bool;
}

/// Parameters of `probabilistic`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProbabilisticParams {
    pub power: f64,
    pub scale: f64,
    pub seed: u64,
}

impl Default for ProbabilisticParams {
    fn default() -> Self {
        // llm-d: min(sat^5 * 300, 1).
        ProbabilisticParams { power: 5.0, scale: 300.0, seed: 0 }
    }
}

impl ProbabilisticParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.power.is_finite() && self.power > 0.0) {
            return Err(format!("power must be a finite number > 0, got {}", self.power));
        }
        if !(self.scale.is_finite() && self.scale >= 0.0) {
            return Err(format!("scale must be a finite number >= 0, got {}", self.scale));
        }
        Ok(())
    }
}

/// `probabilistic`: refuse with probability `min(sat^power * scale, 1)`.
#[derive(Debug)]
pub struct ProbabilisticShedding {
    params: ProbabilisticParams,
    rng: SplitMix64,
}

impl ProbabilisticShedding {
    pub fn new(params: ProbabilisticParams) -> Self {
        let rng = SplitMix64::seed_from_u64(params.seed);
        ProbabilisticShedding { params, rng }
    }

    /// The refusal probability at `saturation`.
    pub fn probability(&self, saturation: f64) -> f64 {
        (saturation.max(0.0).powf(self.params.power) * self.params.scale).min(1.0)
    }
}

/// 2^-53: maps the top 53 bits of a u64 onto [0, 1).
const UNIT: f64 = 1.0 / (1u64 << 53) as f64;

impl SheddingPolicy for ProbabilisticShedding {
    fn shed(&mut self, saturation: f64) -> bool {
        let draw = (self.rng.next_u64() >> 11) as f64 * UNIT;
        draw < self.probability(saturation)
    }
}

/// Parameters of `threshold`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThresholdParams {
    pub threshold: f64,
}

impl Default for ThresholdParams {
    fn default() -> Self {
        ThresholdParams { threshold: 0.9 }
    }
}

impl ThresholdParams {
    pub fn validate(&self) -> Result<(), String> {
        if self.threshold.is_finite() && self.threshold >= 0.0 {
            Ok(())
        } else {
            Err(format!("threshold must be a finite number >= 0, got {}", self.threshold))
        }
    }
}

/// `threshold`: refuse once saturation reaches `threshold`.
#[derive(Debug)]
pub struct ThresholdShedding {
    pub params: ThresholdParams,
}

impl SheddingPolicy for ThresholdShedding {
    fn shed(&mut self, saturation: f64) -> bool {
        saturation >= self.params.threshold
    }
}

/// `none`: never refuse.
#[derive(Debug, Default)]
pub struct NoShedding;

impl SheddingPolicy for NoShedding {
    fn shed(&mut self, _saturation: f64) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_value() {
        // First output of splitmix64 from state 0 (Vigna's splitmix64.c).
        let mut rng = SplitMix64::seed_from_u64(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn probability_table() {
        let p = ProbabilisticShedding::new(ProbabilisticParams::default());
        assert_eq!(p.probability(0.0), 0.0);
        assert_eq!(p.probability(0.5), 1.0);
        assert!((p.probability(0.2) - 0.096).abs() < 1e-12);
    }

    #[test]
    fn shedding_rate_follows_probability() {
        let mut p = ProbabilisticShedding::new(ProbabilisticParams::default());
        let shed = (0..100_000).filter(|_| p.shed(0.2)).count();
        assert!((9_000..10_200).contains(&shed), "{shed}");
        let mut t = ThresholdShedding { params: ThresholdParams { threshold: 0.5 } };
        assert!(!t.shed(0.49) && t.shed(0.5));
    }
}
