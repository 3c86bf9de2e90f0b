//! Table-driven behaviour tests of the controller.

use super::*;

fn controller(json: &str) -> FlowController<u32> {
    FlowController::from_json(json).unwrap()
}

/// Concurrency saturation (no endpoints needed) with plenty of room.
const ROOMY: &str = r#"{"saturation": {"type": "concurrency", "max_requests": 1000}}"#;

fn request(id: RequestId, priority: i32, tenant: &str) -> FlowRequest<'_, u32> {
    FlowRequest {
        id,
        priority,
        tenant,
        tokens: 10,
        bytes: 100,
        deadline: None,
        ttft_target: None,
        payload: id as u32,
    }
}

fn drain_ids(c: &mut FlowController<u32>, now: f64) -> Vec<RequestId> {
    let mut ids = Vec::new();
    while let Some(d) = c.dispatch(now).unwrap() {
        assert_eq!(d.outcome, Outcome::Dispatched);
        assert_eq!(d.payload, d.id as u32);
        ids.push(d.id);
    }
    ids
}

#[test]
fn higher_bands_first_then_round_robin_within() {
    let mut c = controller(ROOMY);
    for (id, priority, tenant) in [(1, 0, "a"), (2, 0, "a"), (3, 0, "b"), (4, 5, "z"), (5, -1, "a")]
    {
        assert!(c.enqueue(request(id, priority, tenant), 0.0).unwrap().is_none());
    }
    assert_eq!(drain_ids(&mut c, 1.0), vec![4, 1, 3, 2, 5]);
    assert_eq!(c.running_len(), 5);
}

#[test]
fn blocked_higher_band_stops_lower_bands() {
    let json = r#"{"saturation": {"type": "utilization"},
        "bands": [{"priority": 10, "ceiling": 0.5}, {"priority": 0, "ceiling": 1.0}]}"#;
    let mut c = controller(json);
    let load = |kv| EndpointMetrics { waiting: 0, running: 0, kv_usage: kv, timestamp: 0.0 };
    c.update_endpoint("e", load(0.56)).unwrap(); // saturation 0.7
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), vec![1], "low band alone dispatches at 0.7 < 1.0");
    c.enqueue(request(2, 10, "a"), 0.0).unwrap();
    c.enqueue(request(3, 0, "a"), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), Vec::<RequestId>::new(), "no inversion");
    c.update_endpoint("e", load(0.32)).unwrap(); // saturation 0.4
    assert_eq!(drain_ids(&mut c, 0.1), vec![2, 3]);
}

#[test]
fn no_endpoints_refuses_and_stale_metrics_saturate() {
    let mut c = controller("{}");
    let d = c.enqueue(request(1, 0, "a"), 0.0).unwrap().unwrap();
    assert_eq!((d.outcome, d.payload), (Outcome::RejectedNoEndpoints, 1));
    assert_eq!(d.outcome.http_status(), 503);
    let load = EndpointMetrics { waiting: 0, running: 0, kv_usage: 0.0, timestamp: 0.0 };
    c.update_endpoint("e", load).unwrap();
    assert!(c.enqueue(request(2, 0, "a"), 0.1).unwrap().is_none());
    assert_eq!(c.saturation(1.0).unwrap().value, 0.0, "1 s old is still fresh");
    assert_eq!(c.saturation(1.5).unwrap().value, 1.0, "older than 1 s counts as saturated");
    assert!(c.dispatch(1.5).unwrap().is_none());
    c.update_endpoint("e", EndpointMetrics { timestamp: 1.5, ..load }).unwrap();
    assert_eq!(drain_ids(&mut c, 1.5), vec![2]);
}

#[test]
fn ttl_expires_in_arrival_order_and_never_dispatches_late() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1},
        "default_band": {"ttl_s": 10}}"#;
    let mut c = controller(json);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.enqueue(request(2, 0, "a"), 1.0).unwrap();
    c.enqueue(request(3, 0, "b"), 5.0).unwrap();
    assert_eq!(drain_ids(&mut c, 9.0), vec![1]); // saturated after one
    let expired: Vec<_> = c.expire(11.0).unwrap().iter().map(|d| (d.id, d.outcome)).collect();
    assert_eq!(expired, vec![(2, Outcome::EvictedTtl)]);
    c.complete(1, 5, 12.0).unwrap();
    // 3 expires at 15: a dispatch at 15 must evict rather than serve it.
    assert!(c.dispatch(15.0).unwrap().is_none());
    let evicted: Vec<_> = c.drain_evicted().iter().map(|d| (d.id, d.waited_s)).collect();
    assert_eq!(evicted, vec![(3, 10.0)]);
    assert_eq!(c.outcome_counts()[Outcome::EvictedTtl.index()], 2);
}

#[test]
fn band_capacity_refuses_and_global_capacity_evicts_lower_newest_first() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
        "global": {"max_requests": 3},
        "bands": [{"priority": 9, "max_requests": 1}]}"#;
    let mut c = controller(json);
    for (id, priority) in [(1, -2), (2, -2), (3, 0)] {
        assert!(c.enqueue(request(id, priority, "a"), 0.0).unwrap().is_none());
    }
    // Same priority as the lowest band cannot evict anything.
    let d = c.enqueue(request(4, -2, "a"), 0.0).unwrap().unwrap();
    assert_eq!(d.outcome, Outcome::RejectedCapacity);
    assert_eq!(d.outcome.http_status(), 429);
    assert!(c.enqueue(request(5, 9, "a"), 0.0).unwrap().is_none());
    let evicted: Vec<_> = c.drain_evicted().iter().map(|d| (d.id, d.outcome)).collect();
    assert_eq!(evicted, vec![(2, Outcome::EvictedPreempted)]);
    let d = c.enqueue(request(6, 9, "b"), 0.0).unwrap().unwrap();
    assert_eq!(d.outcome, Outcome::RejectedCapacity, "band 9 holds one request");
    assert_eq!(drain_ids(&mut c, 0.0), vec![5, 3, 1]);
}

#[test]
fn byte_capacity_counts_bytes() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 10},
        "global": {"max_bytes": 250}, "preemption": {"evict_queued": false}}"#;
    let mut c = controller(json);
    assert!(c.enqueue(request(1, 0, "a"), 0.0).unwrap().is_none());
    assert!(c.enqueue(request(2, 0, "a"), 0.0).unwrap().is_none());
    let d = c.enqueue(request(3, 5, "a"), 0.0).unwrap().unwrap();
    assert_eq!(d.outcome, Outcome::RejectedCapacity);
}

#[test]
fn shedding_only_touches_negative_priorities() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 2},
        "shedding": {"type": "threshold", "threshold": 0.5}}"#;
    let mut c = controller(json);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), vec![1]); // saturation now 0.5
    let d = c.enqueue(request(2, -1, "a"), 0.0).unwrap().unwrap();
    assert_eq!((d.outcome, d.outcome.reason()), (Outcome::RejectedShed, "load-shed"));
    assert!(c.enqueue(request(3, 0, "a"), 0.0).unwrap().is_none());
}

#[test]
fn cancel_and_bad_input_leave_state_consistent() {
    let mut c = controller(ROOMY);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    assert_eq!(c.enqueue(request(1, 3, "b"), 0.0).unwrap_err(), FlowError::DuplicateRequest(1));
    let bad = FlowRequest { deadline: Some(f64::NAN), ..request(2, 0, "a") };
    assert!(matches!(c.enqueue(bad, 0.0), Err(FlowError::InvalidInput(_))));
    assert!(matches!(c.dispatch(f64::INFINITY), Err(FlowError::InvalidInput(_))));
    assert_eq!(c.len(), 1);
    let d = c.cancel(1, 1.0).unwrap().unwrap();
    assert_eq!((d.id, d.outcome, d.waited_s), (1, Outcome::EvictedCancelled, 1.0));
    assert!(c.cancel(1, 1.0).unwrap().is_none());
    assert_eq!(c.complete(1, 0, 1.0).unwrap_err(), FlowError::UnknownRequest(1));
    assert!(c.is_empty());
}

#[test]
fn cancel_if_cancels_only_the_request_whose_payload_it_names() {
    let mut c = controller(ROOMY);
    // The first request under id 1 left; a retry queued under the same id, payload 9.
    c.enqueue(FlowRequest { payload: 9, ..request(1, 0, "a") }, 0.0).unwrap();
    assert!(c.cancel_if(1, 1.0, |&p| p == 1).unwrap().is_none());
    assert!(c.is_queued(1) && c.len() == 1, "another's request stays queued");
    assert_eq!(c.outcome_counts()[Outcome::EvictedCancelled.index()], 0);
    let d = c.cancel_if(1, 1.0, |&p| p == 9).unwrap().unwrap();
    assert_eq!((d.id, d.outcome, d.payload), (1, Outcome::EvictedCancelled, 9));
    // A running request is never cancelled, whatever the predicate says.
    c.enqueue(request(2, 0, "a"), 1.0).unwrap();
    assert_eq!(drain_ids(&mut c, 1.0), vec![2]);
    assert!(c.cancel_if(2, 1.0, |_| true).unwrap().is_none());
    assert!(c.is_running(2));
}

#[test]
fn complete_ticketed_releases_only_the_request_enqueued_with_the_ticket() {
    let mut c = controller(ROOMY);
    c.enqueue_ticketed(request(7, 0, "a"), Some(1), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), vec![7]);
    // Ticket 1's request was revoked; id 7 was queued again with ticket 2 and dispatched.
    c.complete(7, 0, 1.0).unwrap();
    c.enqueue_ticketed(request(7, 0, "a"), Some(2), 1.0).unwrap();
    assert_eq!(drain_ids(&mut c, 1.0), vec![7]);
    assert!(!c.complete_ticketed(7, 1, 5, 2.0).unwrap(), "a stale release changes nothing");
    assert!(c.is_running(7) && c.running_len() == 1);
    assert!(c.complete_ticketed(7, 2, 5, 2.0).unwrap());
    assert!(!c.is_running(7) && c.running_len() == 0);
    assert!(matches!(c.complete_ticketed(7, 2, 0, 2.0), Err(FlowError::UnknownRequest(7))));
    // A request enqueued without a ticket is released by id only.
    c.enqueue(request(8, 0, "a"), 2.0).unwrap();
    assert_eq!(drain_ids(&mut c, 2.0), vec![8]);
    assert!(!c.complete_ticketed(8, 2, 0, 2.0).unwrap());
    c.complete(8, 0, 2.0).unwrap();
    assert_eq!(c.running_len(), 0);
}

#[test]
fn record_output_ticketed_charges_only_the_request_enqueued_with_the_ticket() {
    let mut c = controller(ROOMY);
    c.enqueue_ticketed(request(7, 0, "a"), Some(1), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), vec![7]);
    c.complete(7, 0, 1.0).unwrap();
    c.enqueue_ticketed(request(7, 0, "a"), Some(2), 1.0).unwrap();
    assert_eq!(drain_ids(&mut c, 1.0), vec![7]);
    let output =
        |c: &mut FlowController<u32>| -> u64 { c.drain_service().iter().map(|s| s.3).sum() };
    assert_eq!(output(&mut c), 0);
    assert!(!c.record_output_ticketed(7, 1, 5, 2.0).unwrap(), "a stale handle charges nothing");
    assert_eq!(output(&mut c), 0);
    assert!(c.record_output_ticketed(7, 2, 5, 2.0).unwrap());
    assert_eq!(output(&mut c), 5);
    assert!(c.is_running(7), "recording output leaves the request running");
    c.complete_ticketed(7, 2, 0, 3.0).unwrap();
    let stale = c.record_output_ticketed(7, 2, 1, 3.0);
    assert!(matches!(stale, Err(FlowError::UnknownRequest(7))));
}

#[test]
fn preemption_victims_lowest_priority_newest_first_capped_and_paced() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 4},
        "shedding": {"type": "none"}}"#;
    let mut c = controller(json);
    for (id, priority) in [(1, -1), (2, -3), (3, -3), (4, -2)] {
        c.enqueue(request(id, priority, "batch"), 0.0).unwrap();
    }
    assert_eq!(drain_ids(&mut c, 0.0), vec![1, 4, 2, 3]);
    assert!(c.preemption_victims(0.0).unwrap().is_empty(), "nothing blocked yet");
    c.enqueue(request(10, 5, "chat"), 0.0).unwrap();
    assert!(c.dispatch(0.0).unwrap().is_none(), "pool full");
    assert_eq!(c.preemption_victims(0.0).unwrap(), vec![3, 2]);
    assert!(c.preemption_victims(0.1).unwrap().is_empty(), "victims still running");
    c.complete(3, 0, 0.2).unwrap();
    assert_eq!(drain_ids(&mut c, 0.2), vec![10]);
    c.enqueue(request(11, 5, "chat"), 0.2).unwrap();
    c.complete(2, 0, 0.3).unwrap();
    assert_eq!(drain_ids(&mut c, 0.3), vec![11]);
    c.enqueue(request(12, 5, "chat"), 0.3).unwrap();
    assert!(c.preemption_victims(0.5).unwrap().is_empty(), "paced until 0.3 + 0.5");
    assert_eq!(c.preemption_victims(0.8).unwrap(), vec![4, 1]);
}

#[test]
fn edf_and_slo_orderings() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 100},
        "bands": [{"priority": 1, "ordering": {"type": "edf"}},
                  {"priority": 2, "ordering": {"type": "slo-deadline", "default_ttft_s": 5}}]}"#;
    let mut c = controller(json);
    let with = |id, priority, deadline, ttft| FlowRequest {
        deadline,
        ttft_target: ttft,
        ..request(id, priority, "a")
    };
    c.enqueue(with(1, 1, None, None), 0.0).unwrap();
    c.enqueue(with(2, 1, Some(9.0), None), 0.0).unwrap();
    c.enqueue(with(3, 1, Some(3.0), None), 0.0).unwrap();
    c.enqueue(with(4, 2, None, None), 0.0).unwrap(); // due 5
    c.enqueue(with(5, 2, None, Some(1.0)), 2.0).unwrap(); // due 3
    assert_eq!(drain_ids(&mut c, 2.0), vec![5, 4, 3, 2, 1]);
}

#[test]
fn vtc_serves_the_light_tenant() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
        "default_band": {"fairness": {"type": "vtc"}}}"#;
    let mut c = controller(json);
    let sized = |id, tenant, tokens| FlowRequest { tokens, ..request(id, 0, tenant) };
    c.enqueue(sized(1, "heavy", 1000), 0.0).unwrap();
    c.enqueue(sized(2, "heavy", 1000), 0.0).unwrap();
    c.enqueue(sized(3, "light", 10), 0.0).unwrap();
    c.enqueue(sized(4, "light", 10), 0.0).unwrap();
    assert_eq!(drain_ids(&mut c, 0.0), vec![1, 3, 4, 2]);
    assert!(c.jain_index(None) < 0.6);
}

#[test]
fn remote_service_counts_for_fairness() {
    // Two tenants with equal requests queued; without remote service the first queued
    // (heavy) goes first. Another replica reports it served "heavy" a lot: "light" goes first.
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
        "default_band": {"fairness": {"type": "vtc"}}}"#;
    let order = |charge: bool| {
        let mut c = controller(json);
        c.enqueue(request(1, 0, "heavy"), 0.0).unwrap();
        c.enqueue(request(2, 0, "light"), 0.0).unwrap();
        if charge {
            assert!(c.charge_remote("heavy", 0, 5_000, 5_000, 0.0).unwrap());
        }
        drain_ids(&mut c, 0.0)
    };
    assert_eq!(order(false), vec![1, 2]);
    assert_eq!(order(true), vec![2, 1]);
    // A tenant or band this controller does not have is not created.
    let mut c = controller(json);
    assert!(!c.charge_remote("nobody", 0, 1, 1, 0.0).unwrap());
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    assert!(!c.charge_remote("a", 7, 1, 1, 0.0).unwrap());
    assert!(c.charge_remote("a", 0, 0, 0, 0.0).unwrap());
    assert!(c.charge_remote("a", 0, 1, 1, f64::NAN).is_err());
    assert_eq!(c.metrics(0.0).unwrap().bands.len(), 1);
}

#[test]
fn service_is_drained_once_per_flow() {
    let mut c = controller(ROOMY);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.enqueue(request(2, 3, "b"), 0.0).unwrap();
    assert!(c.drain_service().is_empty(), "nothing served yet");
    drain_ids(&mut c, 0.0);
    c.complete(1, 7, 0.0).unwrap();
    let mut got: Vec<_> =
        c.drain_service().into_iter().map(|(t, p, a, b)| (t.to_string(), p, a, b)).collect();
    got.sort();
    assert_eq!(got, vec![("a".into(), 0, 10, 7), ("b".into(), 3, 10, 0)]);
    assert!(c.drain_service().is_empty(), "taken once");
    c.record_output(2, 4, 0.0).unwrap();
    let got: Vec<_> =
        c.drain_service().into_iter().map(|(t, p, a, b)| (t.to_string(), p, a, b)).collect();
    assert_eq!(got, vec![("b".into(), 3, 0, 4)]);
}

#[test]
fn holdback_ceilings_follow_rank() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 10},
        "ceilings": {"type": "holdback", "top": 1.0, "step": 0.5, "floor": 0.1}}"#;
    let mut c = controller(json);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.enqueue(request(2, 9, "a"), 0.0).unwrap();
    let m = c.metrics(0.0).unwrap();
    let ceilings: Vec<_> = m.bands.iter().map(|b| (b.priority, b.ceiling)).collect();
    assert_eq!(ceilings, vec![(9, 1.0), (0, 0.5)]);
}

#[test]
fn metrics_snapshot() {
    let mut c = controller(ROOMY);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.enqueue(request(2, 0, "b"), 0.0).unwrap();
    c.enqueue(request(3, 0, "b"), 0.0).unwrap();
    c.dispatch(0.02).unwrap();
    let m = c.metrics(0.02).unwrap();
    assert_eq!((m.queued, m.queued_bytes, m.running, m.running_tokens), (2, 200, 1, 10));
    assert_eq!(m.outcomes["dispatched"], 1);
    assert_eq!(m.bands[0].wait_s.count, 1);
    assert_eq!(m.bands[0].wait_s.counts[2], 1, "0.02 s lands in (0.01, 0.025]");
    let flows: Vec<_> = m.flows.iter().map(|f| (f.tenant.as_str(), f.queued)).collect();
    assert_eq!(flows, vec![("a", 0), ("b", 2)]);
    assert_eq!(m.saturation, 0.001);
}

/// Roomy, with flows reclaimed after 10 s idle.
const RECLAIMING: &str = r#"{"saturation": {"type": "concurrency", "max_requests": 100000},
    "flow_idle_s": 10, "default_band": {"ttl_s": null, "max_requests": null}}"#;

#[test]
fn idle_flows_and_tenants_are_reclaimed() {
    let mut c = controller(RECLAIMING);
    let names: Vec<String> = (0..8_000).map(|i| format!("tenant-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        assert!(c.enqueue(request(i as u64, 0, name), 0.0).unwrap().is_none());
    }
    assert_eq!((c.tenant_count(), c.flow_count()), (8_000, 8_000));
    assert_eq!(drain_ids(&mut c, 1.0).len(), 8_000);
    for i in 0..8_000u64 {
        c.complete(i, 5, 2.0).unwrap();
    }
    // Idle since 2.0: still there at 11.9, gone at 12.0.
    c.expire(11.9).unwrap();
    assert_eq!(c.flow_count(), 8_000);
    c.expire(12.0).unwrap();
    assert_eq!((c.tenant_count(), c.flow_count()), (0, 0));
    let metrics = c.metrics(12.0).unwrap();
    assert_eq!((metrics.tenants, metrics.flows_reclaimed, metrics.flows.len()), (0, 8_000, 0));
    // A second wave of new names reuses the numbers: the tables do not grow.
    for i in 0..8_000u64 {
        let name = format!("other-{i}");
        assert!(c.enqueue(request(10_000 + i, 0, &name), 13.0).unwrap().is_none());
    }
    assert_eq!(c.tenants.names.len(), 8_000);
    assert_eq!(c.bands[0].flows.len(), 8_000);
    assert_eq!(c.tenant_count(), 8_000);
    assert_eq!(drain_ids(&mut c, 14.0).len(), 8_000, "every reused flow serves its request");
}

#[test]
fn running_or_queued_requests_keep_a_flow() {
    let mut c = controller(RECLAIMING);
    c.enqueue(request(1, 0, "busy"), 0.0).unwrap();
    c.enqueue(request(2, 0, "waiting"), 0.0).unwrap();
    assert_eq!(c.dispatch(0.0).unwrap().unwrap().id, 1);
    c.expire(100.0).unwrap();
    assert_eq!(c.flow_count(), 2, "a running and a queued request keep their flows");
    c.complete(1, 0, 100.0).unwrap();
    c.expire(109.0).unwrap();
    assert_eq!(c.flow_count(), 2);
    c.expire(110.0).unwrap();
    assert_eq!(c.flow_count(), 1, "the busy flow went 10 s after its completion");
    assert_eq!(c.metrics(110.0).unwrap().flows[0].tenant, "waiting");
}

#[test]
fn a_flow_that_turns_busy_again_is_not_reclaimed_by_its_old_idle_mark() {
    let mut c = controller(RECLAIMING);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.cancel(1, 1.0).unwrap(); // idle from 1.0
    c.enqueue(request(2, 0, "a"), 5.0).unwrap();
    c.cancel(2, 8.0).unwrap(); // idle again from 8.0
    c.expire(12.0).unwrap();
    assert_eq!(c.flow_count(), 1, "the mark from 1.0 is stale");
    c.expire(18.0).unwrap();
    assert_eq!(c.flow_count(), 0);
}

#[test]
fn a_reused_flow_number_starts_without_history() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
        "flow_idle_s": 0, "default_band": {"fairness": {"type": "vtc"}}}"#;
    let mut c = controller(json);
    c.enqueue(request(1, 0, "old"), 0.0).unwrap();
    drain_ids(&mut c, 0.0);
    c.complete(1, 1_000, 0.0).unwrap();
    c.enqueue(request(2, 0, "new"), 1.0).unwrap();
    let metrics = c.metrics(1.0).unwrap();
    assert_eq!(metrics.flows.len(), 1);
    let flow = &metrics.flows[0];
    assert_eq!((flow.tenant.as_str(), flow.service_tokens, flow.dispatched), ("new", 0, 0));
    // Not the old flow's 2,010: a fresh counter, lifted to where the last flow left (VTC).
    assert_eq!(flow.fairness_counter, Some(10.0));
    assert_eq!(metrics.jain_index, 1.0);
}

#[test]
fn flows_are_kept_without_an_idle_timeout() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
        "flow_idle_s": null}"#;
    let mut c = controller(json);
    c.enqueue(request(1, 0, "a"), 0.0).unwrap();
    c.cancel(1, 0.0).unwrap();
    c.expire(1e9).unwrap();
    assert_eq!((c.flow_count(), c.tenant_count()), (1, 1));
    assert!(c.idle_flows.is_empty());
}

#[test]
fn flow_idle_s_is_validated() {
    for bad in ["-1", "1e999", "\"x\""] {
        let json = format!(r#"{{"flow_idle_s": {bad}}}"#);
        assert!(FlowController::<u32>::from_json(&json).is_err(), "{bad}");
    }
}

#[test]
fn priorities_past_max_bands_queue_in_the_nearest_band_below() {
    let json = r#"{"saturation": {"type": "concurrency", "max_requests": 100000},
        "bands": [{"priority": 1000000}], "default_band": {"ttl_s": null, "max_requests": null}}"#;
    let mut c = controller(json);
    // Priorities 0, 10, 20, ...: the configured band and MAX_BANDS more are made.
    let made = MAX_BANDS as i32;
    for i in 0..made {
        assert!(c.enqueue(request(i as u64, i * 10, "a"), 0.0).unwrap().is_none());
    }
    assert_eq!(c.metrics(0.0).unwrap().bands.len(), MAX_BANDS + 1);
    // Past the cap: 15 joins band 10, -5 the lowest band (0), 5_000 the top made band.
    for (id, priority) in [(1_000, 15), (1_001, -5), (1_002, 5_000)] {
        assert!(c.enqueue(request(id, priority, "b"), 0.0).unwrap().is_none());
    }
    let metrics = c.metrics(0.0).unwrap();
    assert_eq!(metrics.bands.len(), MAX_BANDS + 1, "no band made past the cap");
    assert_eq!(metrics.priorities_folded, 3);
    let queued = |p: i32| metrics.bands.iter().find(|b| b.priority == p).unwrap().queued;
    assert_eq!((queued(10), queued(0), queued((made - 1) * 10)), (2, 2, 2));
    // A band that exists is still its own priority's, not folded.
    assert!(c.enqueue(request(1_003, 20, "c"), 0.0).unwrap().is_none());
    assert_eq!(c.metrics(0.0).unwrap().priorities_folded, 3);
    // Dispatch follows the bands: the folded 5_000 with band 2550, 15 with band 10.
    let order = drain_ids(&mut c, 1.0);
    let at = |id: RequestId| order.iter().position(|&x| x == id).unwrap();
    assert!(at(1_002) < at(254) && at(1) < at(1_000) && at(1_000) < at(0));
    assert_eq!(order.last(), Some(&1_001));
    // Fairness queries and remote charges of a folded priority find its band.
    assert!(c.charge_remote("b", 15, 5, 5, 2.0).unwrap());
}

#[test]
fn token_and_byte_sums_saturate_instead_of_wrapping() {
    // Probe 49 F13: three prompts of 2^63 - 1 tokens wrapped `running_tokens` to a small
    // number (and a debug build panicked on the overflow). No byte limit: bytes add up too.
    let mut c = controller(
        r#"{"saturation": {"type": "concurrency", "max_requests": 1000},
            "default_band": {"max_bytes": null}}"#,
    );
    let huge =
        |id| FlowRequest { tokens: u64::MAX / 2, bytes: u64::MAX / 2, ..request(id, 0, "t") };
    for id in 1..=3 {
        assert!(c.enqueue(huge(id), 0.0).unwrap().is_none());
    }
    assert_eq!(c.metrics(0.0).unwrap().queued_bytes, u64::MAX);
    assert_eq!(drain_ids(&mut c, 0.0), vec![1, 2, 3]);
    let m = c.metrics(0.0).unwrap();
    assert_eq!((m.running_tokens, m.queued_bytes), (u64::MAX, 0));
    for id in 1..=3 {
        c.complete(id, u64::MAX, 0.0).unwrap();
    }
    let m = c.metrics(0.0).unwrap();
    assert_eq!((m.running, m.running_tokens), (0, 0), "back at 0, not below");
    assert_eq!(m.flows[0].service_tokens, u64::MAX);
    assert_eq!(c.jain_index(None), 1.0);
}
