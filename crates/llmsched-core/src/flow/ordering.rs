//! Ordering policies: which request of a flow goes first.
//!
//! A policy maps a request to a key; a flow serves its smallest `(key, arrival sequence)`.
//!
//! | type | key | params (defaults) |
//! |---|---|---|
//! | `fcfs` | none: arrival order | none |
//! | `edf` | the request's deadline; requests without one after all that have one | none |
//! | `slo-deadline` | arrival + TTFT target | `default_ttft_s` 1.0 (requests without a target) |

use std::fmt;

use serde::{Deserialize, Serialize};

/// What an ordering policy may look at.
#[derive(Debug, Clone, Copy)]
pub struct OrderingInput {
    pub arrival: f64,
    pub deadline: Option<f64>,
    pub ttft_target: Option<f64>,
}

/// Orders the requests within one flow.
pub trait OrderingPolicy: Send + fmt::Debug {
    /// The request's key; smaller goes first.
    fn key(&self, request: &OrderingInput) -> f64;
    /// True when the key never depends on the request, so arrival order is the order (the
    /// flow then keeps an O(1) list instead of a tree).
    fn is_fifo(&self) -> bool {
        false
    }
}

/// `fcfs`: first come, first served.
#[derive(Debug, Default)]
pub struct Fcfs;

impl OrderingPolicy for Fcfs {
    fn key(&self, _request: &OrderingInput) -> f64 {
        0.0
    }

    fn is_fifo(&self) -> bool {
        true
    }
}

/// `edf`: earliest deadline first.
#[derive(Debug, Default)]
pub struct EarliestDeadline;

impl OrderingPolicy for EarliestDeadline {
    fn key(&self, request: &OrderingInput) -> f64 {
        request.deadline.unwrap_or(f64::INFINITY)
    }
}

/// Parameters of `slo-deadline`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloDeadlineParams {
    /// TTFT target assumed for requests that carry none, in seconds.
    pub default_ttft_s: f64,
}

impl Default for SloDeadlineParams {
    fn default() -> Self {
        SloDeadlineParams { default_ttft_s: 1.0 }
    }
}

impl SloDeadlineParams {
    pub fn validate(&self) -> Result<(), String> {
        if self.default_ttft_s.is_finite() && self.default_ttft_s >= 0.0 {
            Ok(())
        } else {
            Err(format!("default_ttft_s must be a finite number >= 0, got {}", self.default_ttft_s))
        }
    }
}

/// `slo-deadline`: the request whose TTFT deadline (arrival + target) comes first.
#[derive(Debug)]
pub struct SloDeadline {
    pub params: SloDeadlineParams,
}

impl OrderingPolicy for SloDeadline {
    fn key(&self, request: &OrderingInput) -> f64 {
        request.arrival + request.ttft_target.unwrap_or(self.params.default_ttft_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_table() {
        let slo = SloDeadline { params: SloDeadlineParams { default_ttft_s: 2.0 } };
        let cases: [(OrderingInput, f64, f64, f64); 3] = [
            (
                OrderingInput { arrival: 1.0, deadline: None, ttft_target: None },
                0.0,
                f64::INFINITY,
                3.0,
            ),
            (
                OrderingInput { arrival: 1.0, deadline: Some(5.0), ttft_target: Some(0.5) },
                0.0,
                5.0,
                1.5,
            ),
            (
                OrderingInput { arrival: 4.0, deadline: Some(-1.0), ttft_target: Some(0.0) },
                0.0,
                -1.0,
                4.0,
            ),
        ];
        for (input, fcfs, edf, slo_key) in cases {
            assert_eq!(Fcfs.key(&input), fcfs);
            assert_eq!(EarliestDeadline.key(&input), edf);
            assert_eq!(slo.key(&input), slo_key);
        }
    }
}
