//! Unit, table-driven and proptest model tests of the slice tracker.

use proptest::prelude::*;

use super::*;

const STEP: f64 = 0.01;
const PREFILL: f64 = 10_000.0;

fn cost() -> SwitchCostModel {
    SwitchCostModel {
        prefill_tokens_per_s: PREFILL,
        decode_step_s: STEP,
        kv_capacity_tokens: 100_000.0,
        requeue_delay_s: 0.005,
        priority_base: 2.0,
        block_size: 16,
    }
}

fn tracker(policy: &str, params: &str) -> SliceTracker {
    let params: serde_json::Value = serde_json::from_str(params).unwrap();
    let mut t = SliceTracker::from_config(policy, &params, cost()).unwrap();
    t.set_endpoint("a", EndpointReport::default()).unwrap();
    t
}

fn short(expected: u32) -> WaitingRequest {
    WaitingRequest { priority: 0, level: 0, context_tokens: 100, expected_tokens: expected }
}

/// Runs one full slice of `key` and decides with `waiting`.
fn boundary(t: &mut SliceTracker, key: RequestKey, waiting: &[WaitingRequest]) -> Decision {
    let left = t.get(key).unwrap().slice_tokens - t.get(key).unwrap().slice_generated;
    t.record_tokens(key, left).unwrap();
    t.decide(key, false, waiting, 1.0).unwrap()
}

#[test]
fn fixed_slices_add_up_to_the_budget() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 300}"#);
    let start = t.admit(1, 50, 1000, 0, "a").unwrap();
    assert_eq!(start, SliceStart { level: 0, slice_tokens: 300 });
    let mut budgets = vec![300];
    loop {
        let d = boundary(&mut t, 1, &[]);
        if d.action == Action::Finish {
            assert_eq!((d.generated_tokens, d.slices, d.context_tokens), (1000, 4, 1050));
            break;
        }
        assert_eq!(d.action, Action::Continue);
        assert_eq!(d.endpoint.as_deref(), Some("a"));
        budgets.push(d.next_slice_tokens);
    }
    assert_eq!(budgets, vec![300, 300, 300, 100]);
    assert!(t.is_empty());
}

#[test]
fn refusals_leave_the_tracker_unchanged() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 10}"#);
    t.admit(1, 5, 100, 0, "a").unwrap();
    t.record_tokens(1, 4).unwrap();
    let before = t.get(1).unwrap();
    assert_eq!(
        t.record_tokens(1, 7).unwrap_err(),
        SliceError::SliceOverrun { key: 1, tokens: 7, left: 6 }
    );
    assert_eq!(
        t.decide(1, false, &[], 0.0).unwrap_err(),
        SliceError::NotAtBoundary { key: 1, left: 6 }
    );
    assert_eq!(t.admit(1, 5, 100, 0, "a").unwrap_err(), SliceError::DuplicateRequest(1));
    assert!(matches!(t.admit(2, 5, 100, 0, "zz"), Err(SliceError::UnknownEndpoint(_))));
    assert!(matches!(t.admit(2, 5, 0, 0, "a"), Err(SliceError::InvalidValue { .. })));
    assert!(matches!(t.resume(1, "a"), Err(SliceError::WrongPhase { .. })));
    assert!(matches!(t.decide(1, false, &[], f64::NAN), Err(SliceError::InvalidValue { .. })));
    let bad_level = WaitingRequest { level: 1, ..short(5) };
    assert!(matches!(t.decide(1, true, &[bad_level], 0.0), Err(SliceError::InvalidValue { .. })));
    assert!(matches!(t.decide(1, true, &[short(0)], 0.0), Err(SliceError::InvalidValue { .. })));
    assert_eq!(t.decide(9, false, &[], 0.0).unwrap_err(), SliceError::UnknownRequest(9));
    let bad = EndpointReport { kv_usage: 1.5, ..EndpointReport::default() };
    assert!(t.set_endpoint("a", bad).is_err());
    assert!(t.set_endpoint("b", EndpointReport { decode_step_s: Some(-1.0), ..bad }).is_err());
    assert_eq!(t.get(1).unwrap(), before);
    assert_eq!(t.endpoint_names().len(), 1);
    assert_eq!(t.endpoint_load("a").unwrap().kv_usage, 0.0);
}

#[test]
fn mlfq_levels_move_as_specified() {
    let params = r#"{"base_quantum": 10, "levels": 3, "join_ratio": 10, "promote_after_s": 5}"#;
    let mut t = tracker("mlfq", params);
    // join thresholds: 100, 200, 400 prompt tokens.
    assert_eq!([50, 150, 300, 5000].map(|p| t.entry_level(p)), [0, 1, 2, 2]);
    let start = t.admit(1, 150, 1000, 0, "a").unwrap();
    assert_eq!(start, SliceStart { level: 1, slice_tokens: 20 });
    let d = boundary(&mut t, 1, &[]);
    assert_eq!((d.action, d.level, d.next_slice_tokens), (Action::Continue, 2, 40));
    let d = boundary(&mut t, 1, &[]);
    assert_eq!((d.level, d.next_slice_tokens), (2, 40)); // stays at the bottom
                                                         // A short waiting request at level 0 makes the long one yield.
    let d = boundary(&mut t, 1, &[short(5)]);
    assert_eq!(d.action, Action::Yield);
    assert_eq!(t.get(1).unwrap().phase, Phase::Paused { since: 1.0 });
    assert!(t.promote(5.9).unwrap().is_empty());
    assert_eq!(t.promote(6.0).unwrap(), vec![(1, 0)]);
    assert_eq!(t.resume(1, "a").unwrap(), SliceStart { level: 0, slice_tokens: 10 });
    let view = t.get(1).unwrap();
    assert_eq!((view.slices, view.generated_tokens, view.phase), (4, 100, Phase::Running));
}

#[test]
fn nobody_waiting_always_continues() {
    let mut t = tracker("mlfq", r#"{"base_quantum": 4, "levels": 2}"#);
    t.set_endpoint("a", EndpointReport { kv_usage: 1.0, ..EndpointReport::default() }).unwrap();
    t.admit(7, 10, 100, -3, "a").unwrap();
    for _ in 0..10 {
        let d = boundary(&mut t, 7, &[]);
        assert_eq!(d.action, Action::Continue);
        assert_eq!((d.benefit_s, d.yield_cost_s), (0.0, 0.0));
    }
}

#[test]
fn cost_and_benefit_follow_the_formulas() {
    // base quantum 100: the running request (prompt 900) enters level 0 and moves to level 1
    // (next slice 200); waiting shorts have x_i = 30 each.
    let mut t = tracker("mlfq", r#"{"base_quantum": 100, "levels": 3, "join_ratio": 10}"#);
    let report = EndpointReport {
        kv_usage: 0.999,
        kv_capacity_tokens: Some(100_000.0),
        ..EndpointReport::default()
    }; // 100 tokens free
    t.set_endpoint("a", report).unwrap();
    t.admit(1, 900, 10_000, 0, "a").unwrap();
    let waiting = [short(30); 8];
    let d = boundary(&mut t, 1, &waiting);
    // L: 6 requests (6 * 30 = 180 <= 200 < 210).
    let benefit = STEP * 200.0 * 6.0;
    let context: f64 = 1000.0;
    let demand = 6.0 * (100.0 + 30.0);
    let p = ((demand - 100.0) / context).clamp(0.0, 1.0);
    let cost = STEP * 180.0 + p * context / PREFILL + 0.005;
    assert!((d.benefit_s - benefit).abs() < 1e-9, "{d:?}");
    assert!((d.evict_probability - p).abs() < 1e-9, "{d:?}");
    assert!((d.yield_cost_s - cost).abs() < 1e-9, "{d:?}");
    assert_eq!(d.action, Action::Yield);
    assert_eq!(d.migrate_cost_s, None);
}

#[test]
fn an_endpoint_taken_out_is_no_migration_target_until_reported_again() {
    // Probe 78: an engine that left the gateway's set (or routing) kept the idle load it last
    // reported, so it stayed the cheapest migration target: a boundary that should yield (and
    // give the flow-control slot to the waiting request) "migrated" to an engine not there.
    let mut t = tracker("fixed", r#"{"slice_tokens": 500}"#);
    t.set_endpoint("c", EndpointReport::default()).unwrap();
    t.admit(1, 1000, 10_000, 0, "a").unwrap();
    t.admit(2, 1000, 10_000, 0, "a").unwrap();
    assert!(t.remove_endpoint("c"));
    assert!(!t.remove_endpoint("c") && !t.remove_endpoint("nowhere"));
    assert_eq!(t.endpoint_names(), vec![Arc::<str>::from("a")]);
    assert!(t.endpoint_load("c").is_none());
    let d = boundary(&mut t, 1, &[short(400)]);
    assert_eq!((d.action, d.endpoint.as_deref()), (Action::Yield, Some("a")));
    assert_eq!(d.migrate_cost_s, None);
    // Reported again (back in routing), with a fresh load: a target again.
    t.set_endpoint("c", EndpointReport::default()).unwrap();
    assert_eq!(t.endpoint_load("c").unwrap().kv_capacity_tokens, cost().kv_capacity_tokens);
    let d = boundary(&mut t, 2, &[short(400)]);
    assert_eq!((d.action, d.endpoint.as_deref()), (Action::Migrate, Some("c")));
    // Requests on an endpoint taken out keep running there.
    assert!(t.remove_endpoint("a"));
    t.resume(1, "a").unwrap();
    assert_eq!(&*t.get(1).unwrap().endpoint, "a");
}

/// The slot bookkeeping agrees with the requests: each slot's users are the references of
/// the tracked requests, the names map the slots in use, and a slot taken out that no request
/// names is freed.
fn check_slots(t: &SliceTracker) {
    let mut users = vec![0u32; t.endpoints.len()];
    for request in t.requests.values() {
        users[request.endpoint as usize] += 1;
        users[request.route_to as usize] += 1;
    }
    for (id, endpoint) in t.endpoints.iter().enumerate() {
        let id = EndpointId::try_from(id).unwrap();
        assert_eq!(endpoint.users, users[id as usize], "slot {id}");
        let freed = t.free.contains(&id);
        assert_eq!(freed, endpoint.gone && endpoint.users == 0, "slot {id}");
        if !freed {
            assert_eq!(t.endpoint_ids.get(&endpoint.name), Some(&id));
        }
    }
    assert_eq!(t.endpoint_ids.len() + t.free.len(), t.endpoints.len());
}

#[test]
fn endpoints_taken_out_are_forgotten_once_no_request_names_them() {
    // Probe 82: an endpoint taken out kept its slot (and its name) for good, so a gateway
    // whose discovery renames the pods at every rollout grew by one entry per name ever seen.
    let mut t = tracker("fixed", r#"{"slice_tokens": 100}"#);
    assert!(t.remove_endpoint("a"));
    let pod = |i: u64| format!("pod-{i}");
    for i in 0..20_000u64 {
        t.set_endpoint(&pod(i), EndpointReport::default()).unwrap();
        t.admit(i, 10, 1_000, 0, &pod(i)).unwrap();
        if i >= 1 {
            // The previous pod leaves while its request still runs there.
            assert!(t.remove_endpoint(&pod(i - 1)));
            assert!(t.endpoint_load(&pod(i - 1)).is_none());
            assert_eq!(&*t.get(i - 1).unwrap().endpoint, pod(i - 1).as_str());
        }
        if i >= 2 {
            // The one before ends: its pod, out and named by no request, is forgotten.
            if i % 2 == 0 {
                assert!(t.remove(i - 2));
            } else {
                let left = t.get(i - 2).unwrap().slice_tokens;
                t.record_tokens(i - 2, left).unwrap();
                assert_eq!(t.decide(i - 2, true, &[], 1.0).unwrap().action, Action::Finish);
            }
            assert!(!t.remove_endpoint(&pod(i - 2)));
            let refused = t.admit(u64::MAX, 10, 10, 0, &pod(i - 2));
            assert_eq!(refused, Err(SliceError::UnknownEndpoint(pod(i - 2))));
        }
        if i % 1_000 == 0 {
            check_slots(&t);
        }
    }
    check_slots(&t);
    assert!(t.endpoints.len() <= 3, "{} slots", t.endpoints.len());
    assert_eq!(t.endpoint_ids.len(), 2);
    assert_eq!(t.endpoint_names(), vec![Arc::<str>::from(pod(19_999).as_str())]);
}

#[test]
fn a_paused_request_keeps_the_endpoints_it_names() {
    // Taken out while a paused request runs there and is routed to another taken out too:
    // both stay (named in its view, resumable) until it moves on, then both are forgotten.
    let mut t = tracker("fixed", r#"{"slice_tokens": 500}"#);
    t.set_endpoint("c", EndpointReport::default()).unwrap();
    t.admit(1, 1000, 10_000, 0, "a").unwrap();
    let d = boundary(&mut t, 1, &[short(400)]);
    assert_eq!((d.action, d.endpoint.as_deref()), (Action::Migrate, Some("c")));
    assert!(t.remove_endpoint("a") && t.remove_endpoint("c"));
    check_slots(&t);
    let view = t.get(1).unwrap();
    assert_eq!((&*view.endpoint, &*view.route_to), ("a", "c"));
    t.set_endpoint("d", EndpointReport::default()).unwrap();
    assert_eq!(t.endpoints.len(), 3); // no slot free yet
    t.resume(1, "d").unwrap();
    check_slots(&t);
    assert_eq!(t.endpoint_names(), vec![Arc::<str>::from("d")]);
    assert_eq!(t.endpoint_ids.len(), 1);
    assert_eq!(t.free.len(), 2);
    // Resuming on the endpoint it ran on, taken out meanwhile, keeps that one.
    let d = boundary(&mut t, 1, &[short(400)]);
    assert_eq!(d.action, Action::Yield);
    assert!(t.remove_endpoint("d"));
    t.resume(1, "d").unwrap();
    check_slots(&t);
    assert!(t.remove(1));
    check_slots(&t);
    assert!(t.endpoint_ids.is_empty());
    // A new name takes a freed slot.
    t.set_endpoint("e", EndpointReport::default()).unwrap();
    assert_eq!(t.endpoints.len(), 3);
    check_slots(&t);
}

#[test]
fn a_yield_with_nothing_evicted_still_pays_for_the_last_block() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 100}"#);
    t.admit(1, 10, 10_000, 0, "a").unwrap();
    let d = boundary(&mut t, 1, &[short(20)]);
    // Context 110 with 100,000 tokens free: nothing evicted, yet the continuation recomputes
    // 110 - floor(109 / 16) * 16 = 14 tokens.
    assert_eq!(d.evict_probability, 0.0);
    let cost = STEP * 20.0 + 14.0 / PREFILL + 0.005;
    assert!((d.yield_cost_s - cost).abs() < 1e-12, "{d:?}");
}

#[test]
fn priority_weights_tilt_the_decision() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 100}"#);
    t.admit(1, 10, 10_000, 3, "a").unwrap(); // weight 8
    let d = boundary(&mut t, 1, &[short(20)]);
    // benefit 0.01*100*1 = 1.0 < cost 8 * (0.2 + requeue)
    assert_eq!(d.action, Action::Continue);
    t.admit(2, 10, 10_000, 0, "a").unwrap();
    let d = boundary(&mut t, 2, &[short(20)]);
    assert_eq!(d.action, Action::Yield);
    // Equal long work at the same priority never pays for a switch.
    t.admit(3, 10, 10_000, 0, "a").unwrap();
    let d = boundary(&mut t, 3, &[short(10_000)]);
    assert_eq!(d.action, Action::Continue);
}

#[test]
fn migrates_to_an_idle_endpoint_when_cheaper() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 500}"#);
    t.set_endpoint("b", EndpointReport { waiting: 2, ..EndpointReport::default() }).unwrap();
    t.set_endpoint("c", EndpointReport::default()).unwrap();
    t.admit(1, 1000, 10_000, 0, "a").unwrap();
    // Waiting work of 400 tokens: yield pauses 4 s, migrating costs 1.5k/10k + 0.005 s.
    let d = boundary(&mut t, 1, &[short(400)]);
    assert_eq!(d.action, Action::Migrate);
    assert_eq!(d.endpoint.as_deref(), Some("c"));
    let cost = 1500.0 / PREFILL + 0.005;
    assert!((d.migrate_cost_s.unwrap() - cost).abs() < 1e-12);
    let view = t.get(1).unwrap();
    assert_eq!((&*view.endpoint, &*view.route_to), ("a", "c"));
    t.resume(1, "c").unwrap();
    assert_eq!(&*t.get(1).unwrap().endpoint, "c");
}

#[test]
fn finish_on_end_of_sequence_or_budget() {
    let mut t = tracker("fixed", r#"{"slice_tokens": 8}"#);
    t.admit(1, 3, 20, 0, "a").unwrap();
    t.record_tokens(1, 5).unwrap();
    let d = t.decide(1, true, &[short(1)], 0.0).unwrap();
    assert_eq!((d.action, d.generated_tokens, d.endpoint), (Action::Finish, 5, None));
    assert!(!t.contains(1));
    t.admit(2, 3, 8, 0, "a").unwrap();
    t.record_tokens(2, 8).unwrap();
    assert_eq!(t.decide(2, false, &[short(1)], 0.0).unwrap().action, Action::Finish);
}

#[test]
fn endpoint_reports_keep_unset_fields() {
    let mut t = tracker("fixed", "{}");
    let first = EndpointReport {
        kv_usage: 0.5,
        kv_capacity_tokens: Some(1000.0),
        decode_step_s: Some(0.5),
        ..EndpointReport::default()
    };
    t.set_endpoint("b", first).unwrap();
    t.set_endpoint("b", EndpointReport { kv_usage: 0.25, ..EndpointReport::default() }).unwrap();
    let load = t.endpoint_load("b").unwrap();
    assert_eq!((load.kv_capacity_tokens, load.decode_step_s, load.kv_usage), (1000.0, 0.5, 0.25));
    assert_eq!(load.prefill_tokens_per_s, PREFILL);
    assert_eq!(load.kv_free_tokens(), 750.0);
}

/// Operations of the model test.
#[derive(Debug, Clone)]
enum Op {
    Record(u32),
    Decide { finished: bool, waiting: Vec<(i32, u32)> },
    Resume,
    Promote(f64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..300).prop_map(Op::Record),
        3 => (prop::bool::weighted(0.1), prop::collection::vec((-2i32..3, 1u32..500), 0..4))
            .prop_map(|(finished, waiting)| Op::Decide { finished, waiting }),
        1 => Just(Op::Resume),
        1 => (0.0f64..20.0).prop_map(Op::Promote),
    ]
}

proptest! {
    /// Budgets add up and levels move as the MLFQ rules say, whatever the call sequence.
    #[test]
    fn model_budgets_and_levels(prompt in 0u32..5000, max_tokens in 1u32..3000, ops in prop::collection::vec(op(), 1..60)) {
        let params = r#"{"base_quantum": 64, "levels": 4, "join_ratio": 8, "promote_after_s": 5}"#;
        let mut t = tracker("mlfq", params);
        t.set_endpoint("b", EndpointReport::default()).unwrap();
        t.admit(1, prompt, max_tokens, 0, "a").unwrap();
        let quantum = |l: u8| 64u32 << l;
        // The model.
        let (mut level, mut generated, mut in_slice, mut slices) = (t.entry_level(prompt), 0u32, 0u32, 1u32);
        let mut budget = quantum(level).min(max_tokens);
        let mut paused_since: Option<f64> = None;
        let mut now = 0.0;
        let mut done = false;
        for op in ops {
            if done { break; }
            now += 1.0;
            match op {
                Op::Record(n) => {
                    let res = t.record_tokens(1, n);
                    if paused_since.is_some() || n > budget - in_slice {
                        prop_assert!(res.is_err());
                    } else {
                        prop_assert_eq!(res.unwrap(), budget - in_slice - n);
                        generated += n;
                        in_slice += n;
                    }
                }
                Op::Decide { finished, waiting } => {
                    let waiting: Vec<_> = waiting.iter().map(|&(priority, expected)| WaitingRequest {
                        priority, level: 0, context_tokens: 100, expected_tokens: expected,
                    }).collect();
                    let res = t.decide(1, finished, &waiting, now);
                    let at_end = finished || generated == max_tokens;
                    if paused_since.is_some() || (!at_end && in_slice < budget) {
                        prop_assert!(res.is_err());
                        continue;
                    }
                    let d = res.unwrap();
                    prop_assert_eq!(d.generated_tokens, generated);
                    prop_assert_eq!(d.context_tokens, u64::from(prompt) + u64::from(generated));
                    prop_assert_eq!(d.slices, slices);
                    if at_end {
                        prop_assert_eq!(d.action, Action::Finish);
                        prop_assert!(!t.contains(1));
                        done = true;
                        continue;
                    }
                    level = (level + 1).min(3);
                    budget = quantum(level).min(max_tokens - generated);
                    in_slice = 0;
                    prop_assert_eq!(d.level, level);
                    prop_assert_eq!(d.next_slice_tokens, budget);
                    if waiting.is_empty() {
                        prop_assert_eq!(d.action, Action::Continue);
                    }
                    match d.action {
                        Action::Continue => slices += 1,
                        Action::Yield | Action::Migrate => paused_since = Some(now),
                        Action::Finish => prop_assert!(false, "finish before the end"),
                    }
                }
                Op::Resume => {
                    let res = t.resume(1, "a");
                    if paused_since.is_none() {
                        prop_assert!(res.is_err());
                    } else {
                        paused_since = None;
                        slices += 1;
                        budget = quantum(level).min(max_tokens - generated);
                        prop_assert_eq!(res.unwrap(), SliceStart { level, slice_tokens: budget });
                    }
                }
                Op::Promote(dt) => {
                    let promoted = t.promote(now + dt).unwrap();
                    let expect = matches!(paused_since, Some(s) if level > 0 && now + dt - s >= 5.0);
                    prop_assert_eq!(promoted.len(), usize::from(expect));
                    if expect {
                        level = 0;
                        budget = quantum(0).min(max_tokens - generated);
                    }
                }
            }
            if !done {
                let view = t.get(1).unwrap();
                prop_assert_eq!(view.generated_tokens, generated);
                prop_assert_eq!(view.slice_generated, in_slice);
                prop_assert_eq!(view.level, level);
                prop_assert_eq!(view.slices, slices);
                prop_assert!(view.generated_tokens <= max_tokens);
                prop_assert_eq!(view.slice_tokens, budget);
            }
            check_slots(&t);
        }
    }
}
