//! Fairness policies: which flow of a priority band is served next.
//!
//! A band tells its policy when a flow joins, when a flow's head item changes (`Some` head) or it
//! empties (`None`), and what service a flow received (prompt tokens at dispatch, output tokens
//! as they stream). `pick` names the backlogged flow to serve. Every operation is O(log F) for F
//! flows in the band.
//!
//! | type | serves | params (defaults) |
//! |---|---|---|
//! | `strict` | the flow whose head item the ordering policy ranks first (one global order) | none |
//! | `round-robin` | backlogged flows in turn; a flow that returns joins the back | none |
//! | `vtc` | least virtual token counter, with the lift rule | `w_p` 1, `w_q` 2, `weights` {} |
//! | `las` | least attained service, decayed by a half-life | `prompt_weight` 1, `completion_weight` 2, `half_life_s` 60, `weights` {} |
//!
//! Ties always go to the lowest flow number. Numbers are given in creation order, and the number
//! of a reclaimed flow (idle past `flow_idle_s`) goes to the next new flow, which starts with
//! no service history.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::heap::FlowHeap;
use super::key::{Key, QueueKey};

/// Index of a flow inside its band (creation order).
pub type FlowIdx = u32;

/// Chooses the next flow to serve within one priority band.
pub trait FairnessPolicy: Send + fmt::Debug {
    /// A new flow joined the band under number `flow`: either the number of flows added
    /// before, or the number of a reclaimed flow (which was idle, so not backlogged), whose
    /// state it replaces.
    fn add_flow(&mut self, flow: FlowIdx, tenant: &str);
    /// The head of `flow` is now `head`, or the flow emptied (`None`).
    fn head_changed(&mut self, flow: FlowIdx, head: Option<QueueKey>);
    /// The backlogged flow to serve next; the caller dispatches its head item.
    fn pick(&mut self) -> Option<FlowIdx>;
    /// Service rendered to `flow` at time `now`.
    fn charge(&mut self, flow: FlowIdx, prompt_tokens: u64, output_tokens: u64, now: f64);
    /// The policy's per-flow number at `now` (VTC counter, LAS attained service), for metrics.
    fn counter(&self, _flow: FlowIdx, _now: f64) -> Option<f64> {
        None
    }
}

fn at(flow: FlowIdx) -> usize {
    flow as usize
}

/// `strict`: one order across all flows of the band, as if they were a single queue.
#[derive(Debug, Default)]
pub struct StrictFairness {
    heads: FlowHeap<QueueKey>,
}

impl FairnessPolicy for StrictFairness {
    fn add_flow(&mut self, _flow: FlowIdx, _tenant: &str) {}

    fn head_changed(&mut self, flow: FlowIdx, head: Option<QueueKey>) {
        match head {
            Some(key) => self.heads.set(flow, key),
            None => self.heads.remove(flow),
        }
    }

    fn pick(&mut self) -> Option<FlowIdx> {
        self.heads.peek().map(|(_, flow)| flow)
    }

    fn charge(&mut self, _flow: FlowIdx, _prompt: u64, _output: u64, _now: f64) {}
}

/// `round-robin`: each backlogged flow in turn; the served flow moves to the back.
///
/// The ring is a deque of `(flow, turn)`; an entry is live while its flow is backlogged and the
/// turn is the flow's latest, so a flow that empties leaves a stale entry behind instead of an
/// O(F) removal. Stale entries are skipped when reached and compacted away when they outnumber
/// live ones.
#[derive(Debug, Default)]
pub struct RoundRobinFairness {
    ring: VecDeque<(FlowIdx, u32)>,
    turn: Vec<u32>,
    active: Vec<bool>,
    live: usize,
}

impl RoundRobinFairness {
    fn join_back(&mut self, flow: FlowIdx) {
        let turn = &mut self.turn[at(flow)];
        *turn = turn.wrapping_add(1);
        self.ring.push_back((flow, *turn));
    }

    fn is_live(&self, (flow, turn): (FlowIdx, u32)) -> bool {
        self.active[at(flow)] && self.turn[at(flow)] == turn
    }

    fn compact(&mut self) {
        let mut ring = std::mem::take(&mut self.ring);
        ring.retain(|&entry| self.is_live(entry));
        self.ring = ring;
    }
}

impl FairnessPolicy for RoundRobinFairness {
    fn add_flow(&mut self, flow: FlowIdx, _tenant: &str) {
        // A reused number keeps its turn counter, so ring entries left from before stay stale.
        if at(flow) == self.turn.len() {
            self.turn.push(0);
            self.active.push(false);
        }
    }

    fn head_changed(&mut self, flow: FlowIdx, head: Option<QueueKey>) {
        match (head, self.active[at(flow)]) {
            (Some(_), false) => {
                self.active[at(flow)] = true;
                self.live += 1;
                self.join_back(flow);
                if self.ring.len() > 2 * self.live + 16 {
                    self.compact();
                }
            }
            (None, true) => {
                self.active[at(flow)] = false;
                self.live -= 1;
            }
            _ => {}
        }
    }

    fn pick(&mut self) -> Option<FlowIdx> {
        while let Some(entry) = self.ring.pop_front() {
            if self.is_live(entry) {
                self.join_back(entry.0);
                return Some(entry.0);
            }
        }
        None
    }

    fn charge(&mut self, _flow: FlowIdx, _prompt: u64, _output: u64, _now: f64) {}
}

/// Per-tenant weights; a tenant not listed has weight 1.
pub type TenantWeights = BTreeMap<String, f64>;

fn check_weights(weights: &TenantWeights) -> Result<(), String> {
    match weights.iter().find(|(_, w)| !(w.is_finite() && **w > 0.0)) {
        Some((tenant, w)) => Err(format!("weight of tenant '{tenant}' must be > 0, got {w}")),
        None => Ok(()),
    }
}

fn check_non_negative(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} must be a finite number >= 0, got {value}"))
    }
}

/// Backlogged flows ordered by a per-flow counter; shared by `vtc` and `las`.
#[derive(Debug, Default)]
struct CounterOrder {
    counters: Vec<f64>,
    weights: Vec<f64>,
    order: FlowHeap<Key>,
}

impl CounterOrder {
    fn add_flow(&mut self, flow: FlowIdx, weight: f64) {
        if at(flow) == self.counters.len() {
            self.counters.push(0.0);
            self.weights.push(weight);
        } else {
            self.counters[at(flow)] = 0.0;
            self.weights[at(flow)] = weight;
        }
    }

    fn is_backlogged(&self, flow: FlowIdx) -> bool {
        self.order.contains(flow)
    }

    fn set(&mut self, flow: FlowIdx, value: f64) {
        self.counters[at(flow)] = value;
        if self.order.contains(flow) {
            self.order.set(flow, Key(value));
        }
    }

    fn join(&mut self, flow: FlowIdx) {
        self.order.set(flow, Key(self.counters[at(flow)]));
    }

    fn leave(&mut self, flow: FlowIdx) {
        self.order.remove(flow);
    }

    fn least(&self) -> Option<(f64, FlowIdx)> {
        self.order.peek().map(|(key, flow)| (key.0, flow))
    }
}

/// Parameters of `vtc`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VtcParams {
    /// Weight of a prompt token.
    pub w_p: f64,
    /// Weight of an output token.
    pub w_q: f64,
    pub weights: TenantWeights,
}

impl Default for VtcParams {
    fn default() -> Self {
        // Sheng et al., OSDI'24: output tokens cost twice prompt tokens.
        VtcParams { w_p: 1.0, w_q: 2.0, weights: TenantWeights::new() }
    }
}

impl VtcParams {
    pub fn validate(&self) -> Result<(), String> {
        check_non_negative("w_p", self.w_p)?;
        check_non_negative("w_q", self.w_q)?;
        check_weights(&self.weights)
    }
}

/// `vtc`: Virtual Token Counter (Sheng et al., OSDI'24).
///
/// Algorithm: a counter per flow grows by `(w_p * prompt + w_q * output) / weight` as service is
/// rendered; the backlogged flow with the least counter is served. A flow that becomes backlogged
/// is lifted to `max(own, least backlogged counter)` (or, with nobody backlogged, to the counter
/// of the flow that left last), so idling never banks credit. Two continuously backlogged flows
/// then receive service within `2 * max(w_p * L_in, w_q * M)` of each other.
#[derive(Debug)]
pub struct VtcFairness {
    params: VtcParams,
    counters: CounterOrder,
    last_left: f64,
}

impl VtcFairness {
    pub fn new(params: VtcParams) -> Self {
        VtcFairness { params, counters: CounterOrder::default(), last_left: 0.0 }
    }

    /// The counter of `flow` (for metrics and tests).
    pub fn counter(&self, flow: FlowIdx) -> f64 {
        self.counters.counters[at(flow)]
    }
}

impl FairnessPolicy for VtcFairness {
    fn add_flow(&mut self, flow: FlowIdx, tenant: &str) {
        self.counters.add_flow(flow, self.params.weights.get(tenant).copied().unwrap_or(1.0));
    }

    fn head_changed(&mut self, flow: FlowIdx, head: Option<QueueKey>) {
        let backlogged = self.counters.is_backlogged(flow);
        match head {
            Some(_) if !backlogged => {
                let floor = self.counters.least().map_or(self.last_left, |(c, _)| c);
                let own = self.counters.counters[at(flow)];
                self.counters.set(flow, own.max(floor));
                self.counters.join(flow);
            }
            None if backlogged => {
                self.counters.leave(flow);
                self.last_left = self.counters.counters[at(flow)];
            }
            _ => {}
        }
    }

    fn pick(&mut self) -> Option<FlowIdx> {
        self.counters.least().map(|(_, flow)| flow)
    }

    fn charge(&mut self, flow: FlowIdx, prompt: u64, output: u64, _now: f64) {
        let weight = self.counters.weights[at(flow)];
        let cost = (self.params.w_p * prompt as f64 + self.params.w_q * output as f64) / weight;
        let value = self.counters.counters[at(flow)] + cost;
        self.counters.set(flow, value);
    }

    fn counter(&self, flow: FlowIdx, _now: f64) -> Option<f64> {
        Some(self.counters.counters[at(flow)])
    }
}

/// Parameters of `las`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LasParams {
    pub prompt_weight: f64,
    pub completion_weight: f64,
    /// Attained service halves every `half_life_s` seconds.
    pub half_life_s: f64,
    pub weights: TenantWeights,
}

impl Default for LasParams {
    fn default() -> Self {
        // llm-d's token-cost fairness: prompt + 2 * completion, 60 s half-life.
        LasParams {
            prompt_weight: 1.0,
            completion_weight: 2.0,
            half_life_s: 60.0,
            weights: TenantWeights::new(),
        }
    }
}

impl LasParams {
    pub fn validate(&self) -> Result<(), String> {
        check_non_negative("prompt_weight", self.prompt_weight)?;
        check_non_negative("completion_weight", self.completion_weight)?;
        if !(self.half_life_s.is_finite() && self.half_life_s > 0.0) {
            return Err(format!("half_life_s must be > 0, got {}", self.half_life_s));
        }
        check_weights(&self.weights)
    }
}

/// Past this many half-lives since the reference time the scaled counters are rebased, so they
/// stay far from overflow.
const LAS_REBASE_HALF_LIVES: f64 = 64.0;

/// `las`: least attained service with exponential decay.
///
/// Algorithm: attained service `s(t) = sum cost_i * 2^(-(t - t_i) / h)` decays by the same
/// factor for every flow, so the order of flows never changes by decay alone. Each flow stores
/// `s * 2^((t - t_ref) / h)` instead; a charge adds `cost * 2^((now - t_ref) / h)`, and the
/// least stored value is the least attained service. Counters are rebased (O(F), rarely) when
/// `now - t_ref` exceeds 64 half-lives.
#[derive(Debug)]
pub struct LasFairness {
    params: LasParams,
    counters: CounterOrder,
    t_ref: f64,
}

impl LasFairness {
    pub fn new(params: LasParams) -> Self {
        LasFairness { params, counters: CounterOrder::default(), t_ref: 0.0 }
    }

    fn rebase(&mut self, now: f64) {
        let factor = (-(now - self.t_ref) / self.params.half_life_s).exp2();
        let flows = self.counters.counters.len() as FlowIdx;
        for flow in 0..flows {
            let value = self.counters.counters[at(flow)] * factor;
            self.counters.set(flow, value);
        }
        self.t_ref = now;
    }
}

impl FairnessPolicy for LasFairness {
    fn add_flow(&mut self, flow: FlowIdx, tenant: &str) {
        self.counters.add_flow(flow, self.params.weights.get(tenant).copied().unwrap_or(1.0));
    }

    fn head_changed(&mut self, flow: FlowIdx, head: Option<QueueKey>) {
        let backlogged = self.counters.is_backlogged(flow);
        match head {
            Some(_) if !backlogged => self.counters.join(flow),
            None if backlogged => self.counters.leave(flow),
            _ => {}
        }
    }

    fn pick(&mut self) -> Option<FlowIdx> {
        self.counters.least().map(|(_, flow)| flow)
    }

    fn charge(&mut self, flow: FlowIdx, prompt: u64, output: u64, now: f64) {
        if (now - self.t_ref) / self.params.half_life_s > LAS_REBASE_HALF_LIVES {
            self.rebase(now);
        }
        let weight = self.counters.weights[at(flow)];
        let cost = (self.params.prompt_weight * prompt as f64
            + self.params.completion_weight * output as f64)
            / weight;
        let scale = ((now - self.t_ref) / self.params.half_life_s).exp2();
        let value = self.counters.counters[at(flow)] + cost * scale;
        self.counters.set(flow, value);
    }

    fn counter(&self, flow: FlowIdx, now: f64) -> Option<f64> {
        let decay = (-(now - self.t_ref) / self.params.half_life_s).exp2();
        Some(self.counters.counters[at(flow)] * decay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(seq: u64) -> Option<QueueKey> {
        Some((Key(0.0), seq))
    }

    #[test]
    fn round_robin_cycles_and_rejoins_at_back() {
        let mut rr = RoundRobinFairness::default();
        for f in 0..3 {
            rr.add_flow(f, "t");
            rr.head_changed(f, head(f as u64));
        }
        assert_eq!(rr.pick(), Some(0));
        assert_eq!(rr.pick(), Some(1));
        rr.head_changed(0, None);
        assert_eq!(rr.pick(), Some(2));
        assert_eq!(rr.pick(), Some(1));
        rr.head_changed(0, head(9));
        assert_eq!(rr.pick(), Some(2));
        assert_eq!(rr.pick(), Some(1));
        assert_eq!(rr.pick(), Some(0));
    }

    #[test]
    fn strict_follows_heads() {
        let mut s = StrictFairness::default();
        s.add_flow(0, "a");
        s.add_flow(1, "b");
        s.head_changed(0, Some((Key(5.0), 1)));
        s.head_changed(1, Some((Key(3.0), 2)));
        assert_eq!(s.pick(), Some(1));
        s.head_changed(1, Some((Key(7.0), 3)));
        assert_eq!(s.pick(), Some(0));
        s.head_changed(0, None);
        assert_eq!(s.pick(), Some(1));
    }

    #[test]
    fn vtc_lifts_returning_flow() {
        let mut v = VtcFairness::new(VtcParams::default());
        v.add_flow(0, "a");
        v.add_flow(1, "b");
        v.head_changed(0, head(0));
        v.charge(0, 100, 0, 0.0);
        v.charge(0, 0, 10, 0.0);
        assert_eq!(v.counter(0), 120.0);
        // b returns while a is backlogged: lifted to a's counter, not left at 0.
        v.head_changed(1, head(1));
        assert_eq!(v.counter(1), 120.0);
        assert_eq!(v.pick(), Some(0), "tie goes to the older flow");
        v.charge(0, 1, 0, 0.0);
        assert_eq!(v.pick(), Some(1));
    }

    #[test]
    fn vtc_weights_divide_cost() {
        let mut params = VtcParams::default();
        params.weights.insert("gold".into(), 4.0);
        let mut v = VtcFairness::new(params);
        v.add_flow(0, "gold");
        v.charge(0, 40, 0, 0.0);
        assert_eq!(v.counter(0), 10.0);
    }

    #[test]
    fn las_prefers_flow_whose_service_decayed() {
        let mut las = LasFairness::new(LasParams { half_life_s: 1.0, ..LasParams::default() });
        las.add_flow(0, "a");
        las.add_flow(1, "b");
        las.charge(0, 100, 0, 0.0);
        las.charge(1, 60, 0, 1.0); // a's 100 decayed to 50 by now
        las.head_changed(0, head(0));
        las.head_changed(1, head(1));
        assert_eq!(las.pick(), Some(0));
        // Far in the future counters are rebased without changing the order.
        las.charge(1, 1, 0, 500.0);
        assert_eq!(las.pick(), Some(0));
        assert!(las.counters.counters.iter().all(|c| c.is_finite()));
    }
}
