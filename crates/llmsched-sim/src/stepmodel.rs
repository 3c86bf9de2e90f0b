//! Step time of one engine step: the roofline and fitted linear models of
//! `llmsched.sim.stepmodel`, evaluated with the same floating-point expressions in the same order
//! so the Rust engine's clock agrees with the Python engine's to the last bit.
//!
//! The Python side derives every constant (`_flop_rate`, `_attn`, ...) and hands them over as
//! [`Roofline`]; the formulas, and where each preset's efficiencies were measured, are
//! documented there.

use serde::Deserialize;

/// Constants of a roofline model (see `RooflineStepModel` in Python).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Roofline {
    pub flop_rate: f64,
    pub byte_rate: f64,
    pub attn: f64,
    pub kvb: f64,
    /// Two FLOPs per active parameter but the embedding table and the LM head.
    pub body2: f64,
    /// LM-head FLOPs per row that needs logits.
    pub lm2: f64,
    /// Weight bytes a dense model reads per step; 0 for a MoE model (see `weights`).
    pub dense_bytes: f64,
    /// Weight of `t_c + t_m` in the transition between the compute and memory bounds.
    pub overlap: f64,
    /// Seconds of element-wise layers per token.
    pub token_s: f64,
    /// Seconds per row that needs logits.
    pub request_s: f64,
    /// Seconds per prefill chunk in the step (0 when not given).
    #[serde(default)]
    pub prefill_request_s: f64,
    /// Seconds a step that starts on an idle replica adds (0 when not given).
    #[serde(default)]
    pub idle_start_s: f64,
    /// Every weight (what the Python side hands over; the step reads `read_params`).
    pub params: f64,
    /// Parameters a step reads in full (all but an untied embedding table).
    pub read_params: f64,
    pub expert_params: f64,
    pub experts: f64,
    pub experts_per_token: f64,
    pub bytes_per_param: f64,
    pub tp: u64,
    pub hidden: u64,
    pub layers: u64,
    pub step_overhead: f64,
    pub allreduce_latency: f64,
    pub link_bw: f64,
}

/// `t = b0 + b1*P + b2*D + b3*prefill_sq + b4*decode_ctx + b5*prefill_requests
/// + b6*after_idle`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Linear {
    pub b0: f64,
    pub b1: f64,
    pub b2: f64,
    pub b3: f64,
    pub b4: f64,
    /// Seconds per prefill chunk in the step (0 when not given).
    #[serde(default)]
    pub b5: f64,
    /// Seconds a step that starts on an idle replica adds (0 when not given).
    #[serde(default)]
    pub b6: f64,
}

/// A step-time model; decoded from `{"kind": "roofline" | "linear", <constants>}`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum StepModel {
    Roofline(Roofline),
    Linear(Linear),
}

/// The work of one step (the arguments of Python's `step_time`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// Prefill chunks in the step (one per request that prefills).
    pub prefill_requests: u64,
    pub prefill_tokens: u64,
    pub prefill_sq: u64,
    pub prefill_ctx: u64,
    pub decode_tokens: u64,
    pub decode_ctx: u64,
    pub prefill_read: u64,
    /// The step starts on a replica that had no step in flight.
    pub after_idle: bool,
}

impl Roofline {
    fn fixed(&self, tokens: u64) -> f64 {
        if self.tp == 1 || tokens == 0 {
            return self.step_overhead;
        }
        let per_reduce = (tokens * self.hidden * 2 * 2 * (self.tp - 1)) as f64 / self.tp as f64;
        let comm = (2 * self.layers) as f64 * (self.allreduce_latency + per_reduce / self.link_bw);
        self.step_overhead + comm
    }

    fn weights(&self, tokens: u64) -> f64 {
        if self.dense_bytes != 0.0 {
            return self.dense_bytes;
        }
        if self.experts == 0.0 || tokens == 0 {
            return self.read_params * self.bytes_per_param;
        }
        let shared = self.read_params - self.expert_params;
        let touched = 1.0 - (1.0 - self.experts_per_token / self.experts).powf(tokens as f64);
        (shared + self.expert_params * touched) * self.bytes_per_param
    }
}

/// Python's `max(a, b)`: `a` unless `b` is larger.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

impl StepModel {
    /// Seconds for one step of `w`.
    pub fn step_time(&self, w: &StepWork) -> f64 {
        let tokens = w.prefill_tokens + w.decode_tokens;
        if tokens == 0 {
            return 0.0;
        }
        match self {
            StepModel::Roofline(r) => {
                let rows = w.decode_tokens + u64::from(w.prefill_tokens > 0);
                let attn_terms =
                    w.prefill_ctx as f64 + w.prefill_sq as f64 / 2.0 + w.decode_ctx as f64;
                let flops = r.body2 * tokens as f64 + r.lm2 * rows as f64 + r.attn * attn_terms;
                let moved =
                    r.weights(tokens) + r.kvb * (tokens + w.prefill_read + w.decode_ctx) as f64;
                let t_c = flops / r.flop_rate;
                let t_m = moved / r.byte_rate;
                let bound = py_max(py_max(t_c, t_m), r.overlap * (t_c + t_m));
                let per_item = r.token_s * tokens as f64
                    + r.request_s * rows as f64
                    + r.prefill_request_s * w.prefill_requests as f64
                    + r.idle_start_s * f64::from(u8::from(w.after_idle));
                bound + per_item + r.fixed(tokens)
            }
            StepModel::Linear(l) => {
                l.b0 + l.b1 * w.prefill_tokens as f64
                    + l.b2 * w.decode_tokens as f64
                    + l.b3 * w.prefill_sq as f64
                    + l.b4 * w.decode_ctx as f64
                    + l.b5 * w.prefill_requests as f64
                    + l.b6 * f64::from(u8::from(w.after_idle))
            }
        }
    }

    /// The decode-only steps of `batch` requests whose KV lengths sum to `ctx`.
    pub fn decode_run(&self, batch: u64, ctx: u64) -> DecodeRun {
        match self {
            StepModel::Roofline(r) => {
                let a1 = (r.body2 * batch as f64 + r.lm2 * batch as f64 + r.attn * ctx as f64)
                    / r.flop_rate;
                let g1 = r.attn * batch as f64 / r.flop_rate;
                let a2 = (r.weights(batch) + r.kvb * (batch + ctx) as f64) / r.byte_rate;
                let g2 = r.kvb * batch as f64 / r.byte_rate;
                let per_item = r.token_s * batch as f64 + r.request_s * batch as f64;
                DecodeRun {
                    a1,
                    g1,
                    a2,
                    g2,
                    c: per_item + r.fixed(batch),
                    a3: r.overlap * (a1 + a2),
                    g3: r.overlap * (g1 + g2),
                }
            }
            StepModel::Linear(l) => {
                let a = l.b0 + l.b2 * batch as f64 + l.b4 * ctx as f64;
                let g = l.b4 * batch as f64;
                DecodeRun { a1: a, g1: g, a2: a, g2: g, c: 0.0, a3: 0.0, g3: 0.0 }
            }
        }
    }

    /// A request's time alone on an idle replica: its chunked prefill (the first chunk starts on
    /// the idle replica), then its decode steps.
    pub fn ideal(&self, prompt: u64, output: u64, budget: u64) -> f64 {
        let (mut t, mut left, mut ctx) = (0.0, prompt, 0u64);
        while left > 0 {
            let chunk = left.min(budget);
            t += self.step_time(&StepWork {
                prefill_requests: 1,
                prefill_tokens: chunk,
                prefill_sq: chunk * chunk,
                prefill_ctx: chunk * ctx,
                prefill_read: ctx,
                after_idle: ctx == 0,
                ..StepWork::default()
            });
            left -= chunk;
            ctx += chunk;
        }
        t + self.decode_run(1, prompt).time(output.saturating_sub(1))
    }
}

/// Step `j` of a decode-only run takes `max(a1 + g1*j, a2 + g2*j, a3 + g3*j) + c` seconds.
///
/// Algorithm: each piece is affine in `j`, so their maximum is convex and piecewise affine and
/// `k` steps split at the crossovers into at most three arithmetic series: O(1). From the piece
/// largest at `j = 0` (the steeper on a tie) the run moves, at each crossover, to the piece
/// that overtakes it first. `steps_within` bisects over `k`: O(log k).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeRun {
    pub a1: f64,
    pub g1: f64,
    pub a2: f64,
    pub g2: f64,
    pub c: f64,
    pub a3: f64,
    pub g3: f64,
}

/// Sum of `a + g*j` for `start <= j < stop`.
fn series(a: f64, g: f64, start: u64, stop: u64) -> f64 {
    if stop <= start {
        return 0.0;
    }
    let n = (stop - start) as f64;
    a * n + g * (start + stop - 1) as f64 * n / 2.0
}

impl DecodeRun {
    /// Seconds for the first `k` steps.
    pub fn time(&self, k: u64) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let pieces = [(self.a1, self.g1), (self.a2, self.g2), (self.a3, self.g3)];
        let mut cur = 0;
        for i in [1, 2] {
            let (a, g) = pieces[i];
            if a > pieces[cur].0 || (a == pieces[cur].0 && g > pieces[cur].1) {
                cur = i;
            }
        }
        let (mut total, mut start) = (0.0, 0u64);
        while start < k {
            let (a, g) = pieces[cur];
            // The piece that overtakes this one first (the steeper of two at the same point).
            let (mut first, mut next) = (k as f64, cur);
            for (i, &(other_a, other_g)) in pieces.iter().enumerate() {
                if other_g > g {
                    let crossover = (a - other_a) / (other_g - g);
                    if crossover < first
                        || (crossover == first && next != cur && other_g > pieces[next].1)
                    {
                        (first, next) = (crossover, i);
                    }
                }
            }
            if next == cur {
                total += series(a, g, start, k);
                break;
            }
            let split = start.max(first.ceil().max(0.0) as u64);
            total += series(a, g, start, split);
            (start, cur) = (split, next);
        }
        total + self.c * k as f64
    }

    /// The most steps (at most `limit`) that complete within `seconds`.
    pub fn steps_within(&self, seconds: f64, limit: u64) -> u64 {
        let (mut lo, mut hi) = (0, limit);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.time(mid) <= seconds {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_run_matches_the_python_doctest() {
        let run = DecodeRun { a1: 1.0, g1: 0.0, a2: 0.0, g2: 1.0, c: 0.0, a3: 0.0, g3: 0.0 };
        let times: Vec<f64> = (0..5).map(|k| run.time(k)).collect();
        assert_eq!(times, vec![0.0, 1.0, 2.0, 4.0, 7.0]);
        assert_eq!(run.steps_within(4.5, 10), 3);
    }

    #[test]
    fn three_piece_run_is_the_sum_of_its_steps() {
        let runs = [
            // A steeper piece overtakes first, a steeper one still later (the case where the
            // earliest crossover, not the steepest piece, decides).
            DecodeRun { a1: 1.5, g1: 6.0, a2: 2.0, g2: 0.0, c: 0.0, a3: 0.0, g3: 7.0 },
            DecodeRun { a1: 10.0, g1: 0.1, a2: 3.0, g2: 0.5, c: 0.25, a3: 9.75, g3: 0.45 },
            DecodeRun { a1: 0.0, g1: 0.0, a2: 0.0, g2: 0.0, c: 1.0, a3: 0.0, g3: 0.0 },
            DecodeRun { a1: 2.0, g1: 1.0, a2: 2.0, g2: 1.0, c: 0.0, a3: 2.0, g3: 1.0 },
        ];
        for run in runs {
            for k in 0..60u64 {
                let brute: f64 = (0..k)
                    .map(|j| {
                        let j = j as f64;
                        (run.a1 + run.g1 * j).max(run.a2 + run.g2 * j).max(run.a3 + run.g3 * j)
                            + run.c
                    })
                    .sum();
                assert!((run.time(k) - brute).abs() <= 1e-9 * brute.max(1.0), "{run:?} k={k}");
            }
        }
    }

    #[test]
    fn linear_model_is_affine() {
        let m = StepModel::Linear(Linear {
            b0: 1e-3,
            b1: 2e-5,
            b2: 1e-4,
            b3: 0.0,
            b4: 0.0,
            b5: 5e-4,
            b6: 0.0,
        });
        let w = StepWork {
            prefill_requests: 2,
            prefill_tokens: 100,
            decode_tokens: 10,
            ..StepWork::default()
        };
        assert!((m.step_time(&w) - 0.005).abs() < 1e-15);
        assert_eq!(m.step_time(&StepWork::default()), 0.0);
        let run = m.decode_run(2, 10);
        assert!((run.time(3) - 3.0 * (1e-3 + 2e-4)).abs() < 1e-15);
    }
}
