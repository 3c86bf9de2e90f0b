//! Slice policies and their registry.
//!
//! A policy says how long a slice is at each level, where a request enters and how levels move.
//! Adding one takes a type implementing [`SlicePolicy`] with its own `Params` (decoded over
//! their defaults, unknown names rejected) and one line in [`REGISTRY`].

use std::fmt::Debug;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::cost::{bad_param, decode_params};
use super::SliceError;

/// How a slice policy sizes slices and moves levels. Level 0 is the most urgent.
pub trait SlicePolicy: Debug + Send + Sync {
    /// The registry name.
    fn name(&self) -> &'static str;
    /// Number of levels (>= 1).
    fn levels(&self) -> u8;
    /// The level a new request with `prompt_tokens` enters at.
    fn entry_level(&self, prompt_tokens: u32) -> u8;
    /// Slice length (tokens) at `level`.
    fn quantum(&self, level: u8) -> u32;
    /// The level after a slice that used its whole quantum at `level`.
    fn level_after_quantum(&self, level: u8) -> u8;
    /// Seconds a paused request may wait before it is promoted; None: never promoted.
    fn promote_after_s(&self) -> Option<f64>;
    /// The parameters in effect, as an object.
    fn params(&self) -> Value;
}

type Factory = fn(&Value) -> Result<Box<dyn SlicePolicy>, SliceError>;

/// Policy name -> factory decoding that policy's parameters. One line per policy.
pub const REGISTRY: &[(&str, Factory)] = &[("fixed", FixedSlice::build), ("mlfq", Mlfq::build)];

/// Builds the policy `name` from an object of parameters (null or empty: every default).
pub fn build_policy(name: &str, params: &Value) -> Result<Box<dyn SlicePolicy>, SliceError> {
    let (_, factory) =
        REGISTRY.iter().find(|(n, _)| *n == name).ok_or_else(|| SliceError::UnknownPolicy {
            name: name.to_string(),
            known: REGISTRY.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        })?;
    factory(params)
}

/// The default parameters of policy `name`, as an object.
pub fn policy_defaults(name: &str) -> Result<Value, SliceError> {
    Ok(build_policy(name, &Value::Null)?.params())
}

fn to_value<T: Serialize>(value: &T) -> Value {
    // Plain structs of numbers always serialise.
    serde_json::to_value(value).unwrap_or_default()
}

/// Every slice has the same length; one level; nothing moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FixedSlice {
    /// Tokens per slice (llm-d recommends >= 512 and a multiple of the KV block size).
    pub slice_tokens: u32,
}

impl Default for FixedSlice {
    fn default() -> Self {
        Self { slice_tokens: 512 }
    }
}

impl FixedSlice {
    fn build(params: &Value) -> Result<Box<dyn SlicePolicy>, SliceError> {
        let policy: Self = decode_params("policy fixed", params)?;
        if policy.slice_tokens == 0 {
            return Err(bad_param("policy fixed", "slice_tokens", "must be at least 1"));
        }
        Ok(Box::new(policy))
    }
}

impl SlicePolicy for FixedSlice {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn levels(&self) -> u8 {
        1
    }
    fn entry_level(&self, _prompt_tokens: u32) -> u8 {
        0
    }
    fn quantum(&self, _level: u8) -> u32 {
        self.slice_tokens
    }
    fn level_after_quantum(&self, _level: u8) -> u8 {
        0
    }
    fn promote_after_s(&self) -> Option<f64> {
        None
    }
    fn params(&self) -> Value {
        to_value(self)
    }
}

/// Multi-level feedback queue with skip-join (FastServe).
///
/// - Quantum doubles per level: `quantum(l) = base_quantum * 2**l`.
/// - Skip-join: a request enters the first level whose quantum covers its prompt,
///   `min l such that prompt_tokens <= join_ratio * quantum(l)` (else the last level), so long
///   prompts do not jump ahead of short work. `join_ratio` stands for the prompt tokens an
///   endpoint prefills in the time it decodes one token of a slice.
/// - Demotion: a slice that used its whole quantum moves the request one level down (to at
///   most `levels - 1`).
/// - Promotion: a paused request that has waited `promote_after_s` seconds goes back to level 0,
///   so nothing starves however much short work keeps arriving.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Mlfq {
    pub base_quantum: u32,
    pub levels: u8,
    pub join_ratio: f64,
    pub promote_after_s: f64,
}

impl Default for Mlfq {
    fn default() -> Self {
        Self { base_quantum: 512, levels: 4, join_ratio: 8.0, promote_after_s: 10.0 }
    }
}

impl Mlfq {
    fn build(params: &Value) -> Result<Box<dyn SlicePolicy>, SliceError> {
        let policy: Self = decode_params("policy mlfq", params)?;
        if policy.base_quantum == 0 {
            return Err(bad_param("policy mlfq", "base_quantum", "must be at least 1"));
        }
        if !(1..=16).contains(&policy.levels) {
            return Err(bad_param("policy mlfq", "levels", "must be in 1..=16"));
        }
        let top = u64::from(policy.base_quantum) << (policy.levels - 1);
        if top > u64::from(u32::MAX) {
            return Err(bad_param(
                "policy mlfq",
                "base_quantum",
                "doubled over every level exceeds 2**32 - 1 tokens",
            ));
        }
        if !(policy.join_ratio.is_finite() && policy.join_ratio > 0.0) {
            return Err(bad_param("policy mlfq", "join_ratio", "must be a positive finite number"));
        }
        if !(policy.promote_after_s.is_finite() && policy.promote_after_s > 0.0) {
            return Err(bad_param(
                "policy mlfq",
                "promote_after_s",
                "must be a positive finite number",
            ));
        }
        Ok(Box::new(policy))
    }
}

impl SlicePolicy for Mlfq {
    fn name(&self) -> &'static str {
        "mlfq"
    }
    fn levels(&self) -> u8 {
        self.levels
    }
    fn entry_level(&self, prompt_tokens: u32) -> u8 {
        let prompt = f64::from(prompt_tokens);
        (0..self.levels)
            .find(|&l| prompt <= self.join_ratio * f64::from(self.quantum(l)))
            .unwrap_or(self.levels - 1)
    }
    fn quantum(&self, level: u8) -> u32 {
        // Checked at build time: base_quantum << (levels - 1) fits in u32.
        self.base_quantum << level.min(self.levels - 1)
    }
    fn level_after_quantum(&self, level: u8) -> u8 {
        (level + 1).min(self.levels - 1)
    }
    fn promote_after_s(&self) -> Option<f64> {
        Some(self.promote_after_s)
    }
    fn params(&self) -> Value {
        to_value(self)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn registry_builds_each_policy_with_defaults() {
        for (name, _) in REGISTRY {
            let policy = build_policy(name, &Value::Null).unwrap();
            assert_eq!(policy.name(), *name);
            assert!(policy.levels() >= 1);
        }
        assert_eq!(policy_defaults("fixed").unwrap(), json!({"slice_tokens": 512}));
    }

    #[test]
    fn unknown_policy_and_params_are_rejected() {
        let err = build_policy("lottery", &json!({})).unwrap_err();
        assert!(err.to_string().contains("fixed, mlfq"), "{err}");
        let err = build_policy("mlfq", &json!({"quantum": 5})).unwrap_err();
        assert!(err.to_string().contains("unknown field `quantum`"), "{err}");
        for bad in [
            r#"{"levels": 0}"#,
            r#"{"levels": 17}"#,
            r#"{"base_quantum": 0}"#,
            r#"{"base_quantum": 1000000000, "levels": 4}"#,
            r#"{"join_ratio": -1}"#,
            r#"{"promote_after_s": 0}"#,
            r#"{"levels": -1}"#,
            r#"[1]"#,
        ] {
            let bad: Value = serde_json::from_str(bad).unwrap();
            assert!(build_policy("mlfq", &bad).is_err(), "{bad}");
        }
        assert!(build_policy("fixed", &json!({"slice_tokens": 0})).is_err());
    }

    #[test]
    fn mlfq_levels_table() {
        let p = build_policy("mlfq", &json!({"base_quantum": 100, "levels": 3, "join_ratio": 2}))
            .unwrap();
        // quantum: 100, 200, 400; join thresholds: 200, 400, 800.
        assert_eq!((p.quantum(0), p.quantum(1), p.quantum(2)), (100, 200, 400));
        let cases = [(0, 0), (200, 0), (201, 1), (400, 1), (401, 2), (800, 2), (100_000, 2)];
        for (prompt, level) in cases {
            assert_eq!(p.entry_level(prompt), level, "prompt {prompt}");
        }
        assert_eq!(p.level_after_quantum(0), 1);
        assert_eq!(p.level_after_quantum(2), 2);
        assert_eq!(p.promote_after_s(), Some(10.0));
    }
}
