//! proptest model test of the flow controller: random operation sequences against a naive model
//! that knows every request's state. Checks: no request lost or finished twice, strict priority
//! and no inversion (dispatch serves the highest live band, refuses only when it is blocked,
//! never idles when it is not), capacity never exceeded, TTL honoured, and, with `strict`
//! fairness, the exact request the ordering policy ranks first.

use std::collections::BTreeMap;

use llmsched_core::flow::{FlowController, FlowDecision, FlowRequest, Outcome};
use proptest::prelude::*;

const TTL: f64 = 5.0;
const BAND_MAX: usize = 4;
const GLOBAL_MAX: usize = 7;

#[derive(Debug, Clone)]
enum Op {
    Enqueue { priority: i32, tenant: u8, tokens: u64, deadline: Option<u8> },
    Dispatch,
    Complete(usize),
    Cancel(usize),
    Expire,
    Advance(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (-2i32..=2, 0u8..3, 0u64..50, proptest::option::of(0u8..20))
            .prop_map(|(priority, tenant, tokens, deadline)| Op::Enqueue { priority, tenant, tokens, deadline }),
        3 => Just(Op::Dispatch),
        2 => any::<usize>().prop_map(Op::Complete),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => Just(Op::Expire),
        2 => (0u8..30).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Queued { priority: i32, arrival: f64, key: f64, seq: u64, tenant: u8 },
    Running,
    Done(Outcome),
}

struct Model {
    states: BTreeMap<u64, State>,
    max_running: usize,
    strict: bool,
    ordering: &'static str,
}

impl Model {
    fn queued(&self) -> impl Iterator<Item = (u64, &State)> {
        self.states
            .iter()
            .filter(|(_, s)| matches!(s, State::Queued { .. }))
            .map(|(id, s)| (*id, s))
    }

    fn running(&self) -> Vec<u64> {
        self.states.iter().filter(|(_, s)| **s == State::Running).map(|(id, _)| *id).collect()
    }

    fn live(&self, now: f64) -> Vec<(u64, State)> {
        self.queued()
            .filter(|(_, s)| matches!(s, State::Queued { arrival, .. } if arrival + TTL > now))
            .map(|(id, s)| (id, *s))
            .collect()
    }

    /// Every decision must concern a queued request and end it exactly once.
    fn finish(&mut self, decision: &FlowDecision<()>) {
        let state = self.states.get(&decision.id).copied();
        assert!(matches!(state, Some(State::Queued { .. })), "{decision:?} for {state:?}");
        let next = if decision.outcome == Outcome::Dispatched {
            State::Running
        } else {
            State::Done(decision.outcome)
        };
        self.states.insert(decision.id, next);
    }

    /// The queued requests an arrival of `priority` evicts (lowest priority, newest first), or
    /// `None` when it cannot be admitted.
    fn victims_for(&self, priority: i32, now: f64) -> Option<Vec<u64>> {
        let live = self.live(now);
        let same = live
            .iter()
            .filter(|(_, s)| matches!(s, State::Queued { priority: p, .. } if *p == priority));
        if same.count() >= BAND_MAX {
            return None;
        }
        let over = (live.len() + 1).saturating_sub(GLOBAL_MAX);
        let mut lower: Vec<(i32, u64, u64)> = live
            .iter()
            .filter_map(|(id, s)| match *s {
                State::Queued { priority: p, seq, .. } if p < priority => {
                    Some((p, u64::MAX - seq, *id))
                }
                _ => None,
            })
            .collect();
        lower.sort_unstable();
        (lower.len() >= over).then(|| lower[..over].iter().map(|&(_, _, id)| id).collect())
    }

    fn check_capacity(&self) {
        let mut per_band: BTreeMap<i32, usize> = BTreeMap::new();
        for (_, s) in self.queued() {
            if let State::Queued { priority, .. } = s {
                *per_band.entry(*priority).or_default() += 1;
            }
        }
        assert!(per_band.values().all(|&n| n <= BAND_MAX), "{per_band:?}");
        assert!(per_band.values().sum::<usize>() <= GLOBAL_MAX);
    }
}

fn config(fairness: &str, ordering: &str, max_running: usize) -> String {
    format!(
        r#"{{"saturation": {{"type": "concurrency", "max_requests": {max_running}}},
            "default_band": {{"max_requests": {BAND_MAX}, "ttl_s": {TTL},
                              "fairness": {{"type": "{fairness}"}}, "ordering": {{"type": "{ordering}"}}}},
            "global": {{"max_requests": {GLOBAL_MAX}}},
            "shedding": {{"type": "probabilistic", "power": 1, "scale": 0.5}}}}"#
    )
}

fn run(fairness: &'static str, ordering: &'static str, max_running: usize, ops: Vec<Op>) {
    let mut c: FlowController<()> =
        FlowController::from_json(&config(fairness, ordering, max_running)).unwrap();
    let mut model =
        Model { states: BTreeMap::new(), max_running, strict: fairness == "strict", ordering };
    let tenants = ["a", "b", "c"];
    let mut now = 0.0;
    let mut next_id = 0u64;
    let mut seq = 0u64;
    for op in ops {
        match op {
            Op::Advance(dt) => now += f64::from(dt) / 10.0,
            Op::Enqueue { priority, tenant, tokens, deadline } => {
                next_id += 1;
                let deadline = deadline.map(|d| now + f64::from(d));
                let request = FlowRequest {
                    id: next_id,
                    priority,
                    tenant: tenants[tenant as usize],
                    tokens,
                    bytes: 1,
                    deadline,
                    ttft_target: None,
                    payload: (),
                };
                let key = match ordering {
                    "edf" => deadline.unwrap_or(f64::INFINITY),
                    "slo-deadline" => now + 1.0,
                    _ => 0.0,
                };
                let expected_victims = model.victims_for(priority, now);
                let result = c.enqueue(request, now).unwrap();
                // Expired requests leave first, then victims of the arrival.
                let mut victims = Vec::new();
                for d in c.drain_evicted() {
                    if d.outcome == Outcome::EvictedPreempted {
                        victims.push(d.id);
                    } else {
                        assert_eq!(d.outcome, Outcome::EvictedTtl);
                    }
                    model.finish(&d);
                }
                match (&result, &expected_victims) {
                    (Some(d), _) if d.outcome == Outcome::RejectedShed => {}
                    (Some(d), None) => assert_eq!(d.outcome, Outcome::RejectedCapacity),
                    (None, Some(expected)) => {
                        assert_eq!(&victims, expected, "lowest, newest first")
                    }
                    _ => panic!("admission {result:?}, expected victims {expected_victims:?}"),
                }
                match result {
                    None => {
                        seq += 1;
                        model.states.insert(
                            next_id,
                            State::Queued { priority, arrival: now, key, seq, tenant },
                        );
                    }
                    Some(d) => {
                        assert!(matches!(
                            d.outcome,
                            Outcome::RejectedCapacity | Outcome::RejectedShed
                        ));
                        if d.outcome == Outcome::RejectedShed {
                            assert!(priority < 0, "only sheddable requests are shed");
                        }
                        model.states.insert(next_id, State::Done(d.outcome));
                    }
                }
            }
            Op::Dispatch => {
                let live = model.live(now);
                let blocked = model.running().len() >= model.max_running;
                let got = c.dispatch(now).unwrap();
                for d in c.drain_evicted() {
                    assert_eq!(d.outcome, Outcome::EvictedTtl);
                    model.finish(&d);
                }
                match got {
                    None => assert!(live.is_empty() || blocked, "idle while {live:?} could go"),
                    Some(d) => {
                        assert!(!blocked);
                        let top = live.iter().filter_map(|(_, s)| match s {
                            State::Queued { priority, .. } => Some(*priority),
                            _ => None,
                        });
                        assert_eq!(Some(d.priority), top.max(), "strict priority");
                        let Some(State::Queued { arrival, tenant, .. }) =
                            model.states.get(&d.id).copied()
                        else {
                            panic!("dispatched unknown {d:?}");
                        };
                        assert!(arrival + TTL > now, "TTL honoured");
                        // The request is its flow's first by (key, seq); with strict fairness the band's first.
                        let rank = |s: &State| match *s {
                            State::Queued { key, seq, .. } => (key, seq),
                            _ => unreachable!(),
                        };
                        let candidates = live.iter().filter(|(_, s)| match s {
                            State::Queued { priority, tenant: t, .. } => {
                                *priority == d.priority && (model.strict || *t == tenant)
                            }
                            _ => false,
                        });
                        let best = candidates
                            .min_by(|a, b| rank(&a.1).partial_cmp(&rank(&b.1)).unwrap())
                            .map(|(id, _)| *id);
                        assert_eq!(best, Some(d.id), "ordering {}", model.ordering);
                        model.finish(&d);
                    }
                }
            }
            Op::Complete(pick) => {
                let running = model.running();
                if running.is_empty() {
                    assert!(c.complete(999_999, 0, now).is_err());
                } else {
                    let id = running[pick % running.len()];
                    c.complete(id, 3, now).unwrap();
                    model.states.insert(id, State::Done(Outcome::Dispatched));
                }
            }
            Op::Cancel(pick) => {
                let ids: Vec<u64> = model.states.keys().copied().collect();
                if ids.is_empty() {
                    continue;
                }
                let id = ids[pick % ids.len()];
                let was_queued = matches!(model.states[&id], State::Queued { .. });
                match c.cancel(id, now).unwrap() {
                    Some(d) => {
                        assert!(was_queued);
                        assert_eq!(d.outcome, Outcome::EvictedCancelled);
                        model.finish(&d);
                    }
                    None => assert!(!was_queued || c.drain_evicted().iter().any(|d| d.id == id)),
                }
            }
            Op::Expire => {
                let due: Vec<u64> = model
                    .queued()
                    .filter(
                        |(_, s)| matches!(s, State::Queued { arrival, .. } if arrival + TTL <= now),
                    )
                    .map(|(id, _)| id)
                    .collect();
                let mut expired: Vec<u64> = Vec::new();
                for d in c.drain_evicted().into_iter().chain(c.expire(now).unwrap()) {
                    assert_eq!(d.outcome, Outcome::EvictedTtl);
                    model.finish(&d);
                    expired.push(d.id);
                }
                expired.sort_unstable();
                assert_eq!(expired, due);
            }
        }
        model.check_capacity();
        assert_eq!(c.len(), model.queued().count());
        assert_eq!(c.running_len(), model.running().len());
    }
    // Accounting: every request is queued, running or finished exactly once, and the
    // controller's outcome counters agree with the model.
    let mut counts = [0u64; 7];
    for s in model.states.values() {
        match s {
            State::Done(outcome) => counts[outcome.index()] += 1,
            State::Running => counts[Outcome::Dispatched.index()] += 1,
            State::Queued { .. } => {}
        }
    }
    assert_eq!(c.outcome_counts(), counts);
    assert_eq!(model.states.len() as u64, next_id);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn strict_fcfs(ops in proptest::collection::vec(op(), 1..160), cap in 1usize..5) {
        run("strict", "fcfs", cap, ops);
    }

    #[test]
    fn strict_edf(ops in proptest::collection::vec(op(), 1..160), cap in 1usize..5) {
        run("strict", "edf", cap, ops);
    }

    #[test]
    fn round_robin_slo(ops in proptest::collection::vec(op(), 1..160), cap in 1usize..5) {
        run("round-robin", "slo-deadline", cap, ops);
    }

    #[test]
    fn vtc_fcfs(ops in proptest::collection::vec(op(), 1..160), cap in 1usize..5) {
        run("vtc", "fcfs", cap, ops);
    }

    #[test]
    fn las_edf(ops in proptest::collection::vec(op(), 1..160), cap in 1usize..5) {
        run("las", "edf", cap, ops);
    }
}
