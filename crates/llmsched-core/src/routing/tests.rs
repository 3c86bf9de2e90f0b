//! End-to-end tests of the router: the worked example of llm-d's documentation, staleness,
//! P/D edges, fallbacks, seeding, commits and a thread stress test.

use std::sync::Arc;

use serde_json::{json, Value};

use super::endpoint::{Endpoint, Role};
use super::plugin::RequestMeta;
use super::pool::{EndpointPool, MetricsUpdate, StaleMode, StalePolicy};
use super::router::{Decision, PdReason, Router, RouterOptions};
use super::{parse_config, presets, RoutingError};
use crate::prefix_index::{IndexConfig, PrefixIndex, WorkerKey};

fn key(s: &str) -> WorkerKey {
    WorkerKey::Str(s.into())
}

struct Setup {
    pool: Arc<EndpointPool>,
    index: Arc<PrefixIndex>,
}

impl Setup {
    fn new(names: &[&str], policy: StalePolicy) -> Setup {
        let pool = Arc::new(EndpointPool::new(policy).unwrap());
        for n in names {
            pool.upsert(Endpoint { address: format!("{n}:8000"), ..Endpoint::new(key(n)) });
        }
        let index = Arc::new(
            PrefixIndex::new(IndexConfig { block_size: 16, ..IndexConfig::default() }).unwrap(),
        );
        Setup { pool, index }
    }

    fn metrics(&self, name: &str, waiting: u32, kv: f64, now: f64) {
        let u = MetricsUpdate {
            waiting: Some(waiting),
            kv_cache_usage: Some(kv),
            ..Default::default()
        };
        self.pool.update_metrics(&key(name), u, now).unwrap();
    }

    fn store(&self, name: &str, tokens: &[u32]) {
        let h = self.index.hash_tokens(tokens, None, None).unwrap();
        self.index.store(&key(name), &h, None, crate::prefix_index::Tier::Gpu).unwrap();
    }

    fn router(&self, config: Value, seed: u64) -> Router {
        let options = RouterOptions { seed, ..RouterOptions::default() };
        Router::new(self.pool.clone(), self.index.clone(), parse_config(&config).unwrap(), options)
            .unwrap()
    }
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn name(d: &super::Decision, c: &super::plugin::Candidate) -> String {
    match &d.endpoint(c).id {
        WorkerKey::Str(s) => s.clone(),
        WorkerKey::Int(i) => i.to_string(),
    }
}

#[test]
fn worked_example_b_wins_with_4_4() {
    let s = Setup::new(&["A", "B", "C"], StalePolicy::default());
    for (n, q, kv) in [("A", 0, 0.2), ("B", 4, 0.5), ("C", 8, 0.9)] {
        s.metrics(n, q, kv, 0.0);
    }
    let p = prompt(160); // 10 blocks
    s.store("B", &p[..128]);
    s.store("C", &p);
    let router = s.router(presets::preset("llm-d").unwrap(), 0);
    let d = router.decide(&p, &RequestMeta::default(), 0.1).unwrap();
    assert_eq!(name(&d, d.chosen()), "B");
    let o = &d.outcomes[0];
    let totals: Vec<(String, f64)> =
        o.kept.iter().zip(&o.totals).map(|(&b, &t)| (name(&d, &d.base[b as usize]), t)).collect();
    for (n, want) in [("A", 3.6), ("B", 4.4), ("C", 3.2)] {
        let got = totals.iter().find(|(x, _)| x == n).unwrap().1;
        assert!((got - want).abs() < 1e-9, "{n}: {got}");
    }
    let ranked: Vec<String> = d.ranked().map(|c| name(&d, c)).collect();
    assert_eq!(ranked, vec!["B", "A", "C"]);
}

#[test]
fn stale_metrics_policies() {
    for (mode, want) in [(StaleMode::Saturated, "B"), (StaleMode::Ignore, "A")] {
        let s = Setup::new(&["A", "B"], StalePolicy { stale_after: 0.2, mode });
        s.metrics("A", 0, 0.0, 0.0); // stale at t = 1
        s.metrics("B", 5, 0.5, 0.95);
        let config = json!({"plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}],
            "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "kv-cache-utilization-scorer"}]}]});
        let d = s.router(config, 0).decide(&prompt(32), &RequestMeta::default(), 1.0).unwrap();
        assert_eq!(name(&d, d.chosen()), want, "{mode:?}");
    }
}

fn pd_setup() -> Setup {
    let s = Setup::new(&[], StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() });
    for (n, role) in [("D", Role::Decode), ("P", Role::Prefill)] {
        s.pool.upsert(Endpoint { role: Some(role), ..Endpoint::new(key(n)) });
    }
    s
}

fn pd_config(decider: Value) -> Value {
    json!({
        "plugins": [{"type": "prefill-filter"}, {"type": "decode-filter"}, {"type": "queue-scorer"},
                    decider, {"type": "pd-profile-handler", "parameters": {"deciderPluginName": "decider"}}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "queue-scorer"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "queue-scorer"}]}]
    })
}

#[test]
fn pd_threshold_edges() {
    let s = pd_setup();
    let p = prompt(160);
    s.store("D", &p[..64]); // 4 blocks = 64 tokens cached: 96 uncached
    for (threshold, split) in [(95, true), (96, true), (97, false), (0, true)] {
        let decider = json!({"type": "prefix-based-pd-decider", "name": "decider", "parameters": {"nonCachedTokens": threshold}});
        let d = s.router(pd_config(decider), 0).decide(&p, &RequestMeta::default(), 0.0).unwrap();
        assert_eq!(name(&d, d.chosen()), "D");
        assert_eq!(d.pd.unwrap().uncached_tokens, 96);
        assert_eq!(d.prefill().is_some(), split, "threshold {threshold}");
        if split {
            assert_eq!(name(&d, d.prefill().unwrap()), "P");
        }
    }
}

#[test]
fn load_aware_pd_rule_weighs_queues() {
    let s = pd_setup();
    let decider = json!({"type": "load-aware-pd-decider", "name": "decider", "parameters": {"nonCachedTokens": 16, "queueMargin": 2}});
    let router = s.router(pd_config(decider), 0);
    let update = |n: &str, q: u32| {
        s.pool
            .update_metrics(&key(n), MetricsUpdate { waiting: Some(q), ..Default::default() }, 0.0)
            .unwrap()
    };
    for (pq, dq, split) in [(0, 0, true), (3, 1, true), (4, 1, false)] {
        update("P", pq);
        update("D", dq);
        let d = router.decide(&prompt(160), &RequestMeta::default(), 0.0).unwrap();
        assert_eq!(d.prefill().is_some(), split, "prefill queue {pq}, decode queue {dq}");
        assert!(d.pd.unwrap().wanted);
        let reason = if split { PdReason::Split } else { PdReason::PrefillQueueLonger };
        assert_eq!(d.pd.unwrap().reason, reason);
    }
}

#[test]
fn no_prefill_endpoint_means_no_split_and_no_decode_endpoint_is_an_error() {
    let s = Setup::new(&["D"], StalePolicy::default());
    let decider = json!({"type": "prefix-based-pd-decider", "name": "decider"});
    let d = s
        .router(pd_config(decider.clone()), 0)
        .decide(&prompt(64), &RequestMeta::default(), 0.0)
        .unwrap();
    assert!(d.pd.unwrap().wanted && d.prefill().is_none());
    assert_eq!(d.pd.unwrap().reason, PdReason::NoPrefillEndpoint);
    let only_prefill = pd_setup();
    only_prefill.pool.remove(&key("D")).unwrap();
    let err = only_prefill
        .router(pd_config(decider), 0)
        .decide(&prompt(64), &RequestMeta::default(), 0.0)
        .err()
        .unwrap();
    assert!(
        matches!(err, RoutingError::NoEndpoint { ref profile, .. } if profile == "decode"),
        "{err}"
    );
}

#[test]
fn a_prefill_pick_of_the_decode_endpoint_is_no_split() {
    // One `both` endpoint passes both role filters: each profile picks it.
    let s = Setup::new(&[], StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() });
    s.pool.upsert(Endpoint { role: Some(Role::Both), ..Endpoint::new(key("B")) });
    for decider in [
        json!({"type": "prefix-based-pd-decider", "name": "decider"}),
        json!({"type": "load-aware-pd-decider", "name": "decider"}),
    ] {
        let d = s.router(pd_config(decider), 0).decide(&prompt(64), &RequestMeta::default(), 0.0);
        let d = d.unwrap();
        let note = d.pd.unwrap();
        assert!(note.wanted && !note.disaggregated);
        assert_eq!(note.reason, PdReason::SameEndpoint);
        assert!(d.prefill().is_none());
        assert_eq!(d.outcomes.len(), 2, "the prefill profile ran (explain shows it)");
        assert_eq!(d.outcomes[1].chosen(), d.outcomes[0].chosen());
    }
    // With a prefill endpoint beside it, the split goes there; reasons name each outcome.
    s.pool.upsert(Endpoint { role: Some(Role::Prefill), ..Endpoint::new(key("P")) });
    s.metrics("B", 5, 0.0, 0.0); // a longer queue: the prefill profile prefers P
    let decider = json!({"type": "prefix-based-pd-decider", "name": "decider"});
    let d = s.router(pd_config(decider), 0).decide(&prompt(64), &RequestMeta::default(), 0.0);
    let d = d.unwrap();
    assert_eq!(d.pd.unwrap().reason, PdReason::Split);
    assert_eq!(name(&d, d.prefill().unwrap()), "P");
    let few = json!({"type": "prefix-based-pd-decider", "name": "decider", "parameters": {"nonCachedTokens": 65}});
    let d = s.router(pd_config(few), 0).decide(&prompt(64), &RequestMeta::default(), 0.0).unwrap();
    assert_eq!(d.pd.unwrap().reason, PdReason::BelowThreshold);
}

#[test]
fn seeded_decisions_replay_and_fallbacks_are_ordered() {
    let names: Vec<String> = (0..16).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let s = Setup::new(&refs, StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() });
    for (i, n) in refs.iter().enumerate() {
        s.metrics(n, (i % 4) as u32, 0.1 * (i % 5) as f64, 0.0);
    }
    for preset in ["random", "llm-d", "least-load"] {
        let run = |seed| {
            let router = s.router(presets::preset(preset).unwrap(), seed);
            (0..20)
                .map(|_| {
                    let d = router.decide(&prompt(100), &RequestMeta::default(), 0.0).unwrap();
                    d.ranked().map(|c| c.slot).collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7), "{preset}");
    }
    let router = s.router(presets::preset("llm-d").unwrap(), 1);
    let d = router.decide(&prompt(100), &RequestMeta::default(), 0.0).unwrap();
    let o = &d.outcomes[0];
    let total_of = |b: u32| o.totals[o.kept.iter().position(|&k| k == b).unwrap()];
    let ranked: Vec<f64> = o.order.iter().map(|&b| total_of(b)).collect();
    assert_eq!(ranked.len(), 4);
    assert!(ranked.windows(2).all(|w| w[0] >= w[1]), "{ranked:?}");
    let best = o.totals.iter().copied().fold(f64::MIN, f64::max);
    assert_eq!(ranked[0], best);
}

#[test]
fn commit_records_prefix_and_counts_return_to_zero() {
    let s =
        Setup::new(&["A", "B"], StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() });
    let router = s.router(presets::preset("prefix-only").unwrap(), 0);
    let p = prompt(64);
    let d = router.decide(&p, &RequestMeta::default(), 0.0).unwrap();
    assert!(d.cold);
    let chosen = name(&d, d.chosen());
    let mut ticket = router.commit(&d, None, 0.0).unwrap();
    let member = s.pool.snapshot().get(&key(&chosen)).unwrap().clone();
    assert_eq!(member.inflight.snapshot().prefill_tokens, 64);
    // The approximate entry makes the next identical prompt warm on the same endpoint.
    let again = router.decide(&p, &RequestMeta::default(), 1.0).unwrap();
    assert_eq!(name(&again, again.chosen()), chosen);
    assert!(!again.cold);
    // It expires after the record ttl (60 s).
    assert!(router.decide(&p, &RequestMeta::default(), 61.0).unwrap().cold);
    ticket.first_token();
    assert_eq!(member.inflight.snapshot().prefill_tokens, 0);
    assert_eq!(member.inflight.snapshot().requests, 1);
    drop(ticket);
    assert_eq!(member.inflight.snapshot().requests, 0);
    // Committing to an endpoint that was not considered is refused.
    assert!(matches!(
        router.commit(&d, Some(&key("Z")), 0.0),
        Err(RoutingError::UnknownEndpoint(_))
    ));
}

#[test]
fn sessions_stick_after_commit() {
    let s = Setup::new(
        &["A", "B", "C"],
        StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() },
    );
    // The profile lists no picker: it gets a max-score-picker (a declared random-picker would
    // be taken instead, as in llm-d).
    let config = json!({"plugins": [{"type": "session-affinity-scorer"}],
        "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "session-affinity-scorer"}]}]});
    let router = s.router(config, 3);
    let meta = RequestMeta { session_id: Some("s1".into()), ..RequestMeta::default() };
    let first = router.decide(&prompt(8), &meta, 0.0).unwrap();
    let bound = name(&first, first.chosen());
    drop(router.commit(&first, None, 0.0).unwrap());
    for t in 1..10 {
        let d = router.decide(&prompt(8), &meta, f64::from(t)).unwrap();
        assert_eq!(name(&d, d.chosen()), bound);
    }
}

/// The endpoint the session plugin of `d`'s only profile favoured: the one a filter kept, or
/// the one a scorer gave 1; None when it favoured none.
fn favoured(d: &super::Decision) -> Option<String> {
    let o = &d.outcomes[0];
    let kept: Vec<usize> =
        (0..o.kept.len()).filter(|&i| o.scores.is_empty() || o.score(0, i) == 1.0).collect();
    match kept[..] {
        [i] if o.kept.len() == 1 || !o.scores.is_empty() => {
            Some(name(d, &d.base[o.kept[i] as usize]))
        }
        _ => None,
    }
}

#[test]
fn a_named_session_endpoint_is_the_session_s_unless_a_binding_lives() {
    let s = Setup::new(
        &["A", "B", "C"],
        StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() },
    );
    for plugin in ["session-affinity-scorer", "session-affinity-filter"] {
        let config = json!({"plugins": [{"type": plugin}],
            "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": plugin}]}]});
        let router = s.router(config, 3);
        assert!(router.config().reads_session(), "{plugin}");
        let pinned = |endpoint: &str, session: Option<&str>| RequestMeta {
            session_endpoint: Some(key(endpoint)),
            session_id: session.map(str::to_string),
            ..RequestMeta::default()
        };
        let d = router.decide(&prompt(8), &RequestMeta::default(), 0.0).unwrap();
        assert_eq!(favoured(&d), None, "{plugin}");
        for t in 0..4 {
            let d = router.decide(&prompt(8), &pinned("B", None), f64::from(t)).unwrap();
            assert_eq!(favoured(&d).as_deref(), Some("B"), "{plugin}");
            assert_eq!(name(&d, d.chosen()), "B", "{plugin}");
            // Nothing is bound without a session id.
            drop(router.commit(&d, None, f64::from(t)).unwrap());
        }
        assert!(router.sessions().is_empty());
        // Not a member: ignored, no error.
        let d = router.decide(&prompt(8), &pinned("Z", None), 5.0).unwrap();
        assert_eq!(favoured(&d), None, "{plugin}");
        // With a session id: the endpoint named pins the first request, whose commit binds
        // the id; from then on the live binding wins over a name of another endpoint.
        let d = router.decide(&prompt(8), &pinned("C", Some("s1")), 10.0).unwrap();
        assert_eq!(favoured(&d).as_deref(), Some("C"), "{plugin}");
        drop(router.commit(&d, None, 10.0).unwrap());
        for t in 11..14 {
            let d = router.decide(&prompt(8), &pinned("A", Some("s1")), f64::from(t)).unwrap();
            assert_eq!(favoured(&d).as_deref(), Some("C"), "{plugin}");
        }
        // A session id without a live binding: the name holds.
        let d = router.decide(&prompt(8), &pinned("A", Some("s2")), 14.0).unwrap();
        assert_eq!(favoured(&d).as_deref(), Some("A"), "{plugin}");
    }
    let plain = s.router(json!({"plugins": [{"type": "round-robin-picker"}]}), 0);
    assert!(!plain.config().reads_session());
    let least = s.router(presets::preset("llm-d").unwrap(), 0);
    assert!(!least.config().reads_session());
}

#[test]
fn concurrent_decisions_leave_no_in_flight_counts() {
    let names: Vec<String> = (0..8).map(|i| format!("e{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let s = Setup::new(&refs, StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() });
    let router = Arc::new(s.router(presets::preset("llm-d").unwrap(), 0));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let router = router.clone();
            let pool = s.pool.clone();
            std::thread::spawn(move || {
                for i in 0..500u32 {
                    let tokens: Vec<u32> =
                        (0..64).map(|x| x + (i % 7) * 1000 + t * 100_000).collect();
                    let d = router.decide(&tokens, &RequestMeta::default(), f64::from(i)).unwrap();
                    let mut ticket = router.commit(&d, None, f64::from(i)).unwrap();
                    if i % 2 == 0 {
                        ticket.first_token();
                    }
                    let u = MetricsUpdate { waiting: Some(i % 5), ..Default::default() };
                    pool.update_metrics(&WorkerKey::Str(format!("e{}", i % 8)), u, f64::from(i))
                        .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for m in &s.pool.snapshot().list {
        assert_eq!(m.inflight.snapshot(), super::InFlightSnapshot::default());
    }
}

#[test]
fn shared_index_block_size_must_match() {
    let s = Setup::new(&["A"], StalePolicy::default());
    let config = json!({"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSize": 64}}],
        "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "prefix-cache-scorer"}]}]});
    let err = Router::new(
        s.pool.clone(),
        s.index.clone(),
        parse_config(&config).unwrap(),
        RouterOptions::default(),
    )
    .err()
    .unwrap();
    assert!(
        matches!(err, RoutingError::Config(ref e) if e.key == "plugins[0].parameters.blockSize"),
        "{err}"
    );
}

#[test]
fn model_mismatch_is_not_a_candidate() {
    let s = Setup::new(&[], StalePolicy::default());
    s.pool.upsert(Endpoint { model: Some("m1".into()), ..Endpoint::new(key("A")) });
    s.pool.upsert(Endpoint { model: Some("m2".into()), ..Endpoint::new(key("B")) });
    let router = s.router(presets::preset("random").unwrap(), 0);
    for _ in 0..10 {
        let meta = RequestMeta { model: Some("m2".into()), ..RequestMeta::default() };
        let d = router.decide(&prompt(8), &meta, 0.0).unwrap();
        assert_eq!(name(&d, d.chosen()), "B");
    }
    let meta = RequestMeta { model: Some("m3".into()), ..RequestMeta::default() };
    assert!(matches!(router.decide(&prompt(8), &meta, 0.0), Err(RoutingError::NoEndpoint { .. })));
}

#[test]
fn only_a_picker_breaking_ties_by_tree_size_reads_tree_sizes() {
    for (preset, reads) in [("llm-d", false), ("llm-d-pd", false), ("dynamo-kv", true)] {
        let config = parse_config(&presets::preset(preset).unwrap()).unwrap();
        assert_eq!(config.reads_tree_size(), reads, "{preset}");
    }
}

#[test]
fn a_token_cap_below_one_block_of_the_index_is_refused() {
    // maxPrefixTokensToMatch 10 over blocks of 16: a cap of 0 blocks, every endpoint 0.
    let s = Setup::new(&["A"], StalePolicy::default());
    let config = |tokens: u64| {
        json!({"plugins": [{"type": "prefix-cache-scorer",
            "parameters": {"maxPrefixTokensToMatch": tokens}}],
        "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "prefix-cache-scorer"}]}]})
    };
    let build = |tokens| {
        Router::new(
            s.pool.clone(),
            s.index.clone(),
            parse_config(&config(tokens)).unwrap(),
            RouterOptions::default(),
        )
    };
    let err = build(10).err().unwrap();
    assert!(
        matches!(err, RoutingError::Config(ref e)
            if e.key == "plugins[0].parameters.maxPrefixTokensToMatch"
                && e.message.contains("16 tokens")),
        "{err}"
    );
    assert!(build(16).is_ok());
}

#[test]
fn no_endpoint_names_an_empty_pool_apart_from_a_model_no_endpoint_serves() {
    let s = Setup::new(&[], StalePolicy::default());
    let router = s.router(presets::preset("random").unwrap(), 0);
    let detail = |meta: &RequestMeta| match router.decide(&prompt(8), meta, 0.0) {
        Err(RoutingError::NoEndpoint { detail, .. }) => detail,
        other => panic!("{:?}", other.map(|_| ())),
    };
    assert_eq!(detail(&RequestMeta::default()), "the pool has no endpoints");
    s.pool.upsert(Endpoint { model: Some("m1".into()), ..Endpoint::new(key("A")) });
    let meta = RequestMeta { model: Some("m3".into()), ..RequestMeta::default() };
    assert_eq!(detail(&meta), "none of the pool's 1 endpoints serves model \"m3\"");
}

#[test]
fn positions_map_each_base_candidate_to_its_kept_slot_and_rank() {
    let outcome = super::profile::ProfileOutcome {
        profile: 0,
        removed_by: vec![super::profile::KEPT, 0, super::profile::KEPT, super::profile::KEPT],
        skipped_filters: Vec::new(),
        kept: vec![0, 2, 3],
        scores: Vec::new(),
        totals: vec![0.1, 0.9, 0.5],
        order: vec![2, 3],
    };
    assert_eq!(
        outcome.positions(4),
        [(Some(0), None), (None, None), (Some(1), Some(0)), (Some(2), Some(1))]
    );
}

/// The picker's list is a thread's reused one (`Profile::run`): what a decision over a larger
/// pool left in it never shows in a later decision's ranking, which is the one a thread that
/// decided nothing before makes.
#[test]
fn a_decision_ranks_as_on_a_fresh_thread_after_a_larger_one() {
    let ranked = |preset: &str, names: &[&str], seed: u64| -> Vec<Vec<String>> {
        let s = Setup::new(names, StalePolicy::default());
        let router = s.router(presets::preset(preset).unwrap(), seed);
        (0..6)
            .map(|_| {
                let d = router.decide(&prompt(40), &RequestMeta::default(), 0.0).unwrap();
                d.ranked().map(|c| name(&d, c)).collect()
            })
            .collect()
    };
    for preset in ["random", "round-robin", "llm-d"] {
        let fresh = std::thread::spawn(move || ranked(preset, &["A", "B"], 7)).join().unwrap();
        // This thread's list held six endpoints' picks last.
        let large = ranked(preset, &["A", "B", "C", "D", "E", "F"], 3);
        assert!(large.iter().all(|r| !r.is_empty()));
        assert_eq!(ranked(preset, &["A", "B"], 7), fresh, "{preset}");
        assert!(fresh.iter().flatten().all(|n| n == "A" || n == "B"), "{preset}");
    }
}

/// A decision is written on the lists a dropped one left on its thread (`Spare`): whatever
/// they held (a larger pool's candidates, a P/D decision's two outcomes with filters,
/// skipped filters and scores) never shows in a later decision, which is the one a thread
/// that decided nothing before makes, field by field.
#[test]
fn a_decision_on_a_dropped_decisions_lists_is_a_fresh_threads() {
    fn record(d: &Decision) -> String {
        format!("{:?} {:?} {:?} {:?} {}", d.base, d.outcomes, d.prefill_outcome, d.pd, d.cold)
    }
    let decided = |config: Value, seed: u64, split: bool| -> Vec<String> {
        let s = if split { pd_setup() } else { Setup::new(&["A", "B"], StalePolicy::default()) };
        s.store(if split { "P" } else { "A" }, &prompt(48));
        let router = s.router(config, seed);
        (0..4)
            .map(|i| {
                let d = router.decide(&prompt(40 + 8 * i), &RequestMeta::default(), 0.0).unwrap();
                record(&d)
            })
            .collect()
    };
    let pd = |threshold: u32| {
        pd_config(json!({"type": "prefix-based-pd-decider", "name": "decider",
                         "parameters": {"nonCachedTokens": threshold}}))
    };
    let configs = [
        ("random", presets::preset("random").unwrap(), false),
        ("round-robin", presets::preset("round-robin").unwrap(), false),
        ("llm-d", presets::preset("llm-d").unwrap(), false),
        ("pd split", pd(0), true),
        ("pd whole", pd(100_000), true),
    ];
    for (label, config, split) in configs {
        let fresh = {
            let config = config.clone();
            std::thread::spawn(move || decided(config, 5, split)).join().unwrap()
        };
        // This thread's spare lists last held a larger pool's decision, then a split one's.
        let large = Setup::new(&["A", "B", "C", "D", "E", "F"], StalePolicy::default());
        let many = large.router(presets::preset("llm-d").unwrap(), 3);
        drop(many.decide(&prompt(64), &RequestMeta::default(), 0.0).unwrap());
        let split_router = pd_setup().router(pd(0), 3);
        drop(split_router.decide(&prompt(64), &RequestMeta::default(), 0.0).unwrap());
        assert_eq!(decided(config, 5, split), fresh, "{label}");
    }
}

/// Decisions alive at once on a thread each leave their lists when dropped, and as many
/// later decisions reuse them (a thread kept one set before: of three decisions alive
/// together, the next three found one set), deciding as a fresh thread's decisions do.
#[test]
fn decisions_alive_together_leave_their_lists_to_as_many_later_ones() {
    fn record(d: &Decision) -> String {
        format!("{:?} {:?} {:?} {:?} {}", d.base, d.outcomes, d.prefill_outcome, d.pd, d.cold)
    }
    for name in ["round-robin", "llm-d"] {
        let decide_three = |router: &Router, from: u32| -> Vec<Decision> {
            (0..3)
                .map(|i| {
                    let tokens = prompt(40 + 8 * (from + i));
                    router.decide(&tokens, &RequestMeta::default(), 0.0).unwrap()
                })
                .collect()
        };
        let setup = || {
            let s = Setup::new(&["A", "B", "C"], StalePolicy::default());
            s.store("A", &prompt(48));
            s
        };
        let fresh: Vec<String> = std::thread::spawn(move || {
            let s = setup();
            let router = s.router(presets::preset(name).unwrap(), 5);
            let first = decide_three(&router, 0);
            let later = decide_three(&router, 3);
            drop(first);
            later.iter().map(record).collect()
        })
        .join()
        .unwrap();
        // A thread of its own: no other test's lists among its spares.
        let (kept, reused, later) = std::thread::spawn(move || {
            let s = setup();
            let router = s.router(presets::preset(name).unwrap(), 5);
            let first = decide_three(&router, 0);
            let kept: Vec<usize> = first.iter().map(|d| d.base.as_ptr() as usize).collect();
            drop(first);
            let later = decide_three(&router, 3);
            let reused: Vec<usize> = later.iter().map(|d| d.base.as_ptr() as usize).collect();
            (kept, reused, later.iter().map(record).collect::<Vec<String>>())
        })
        .join()
        .unwrap();
        let mut sorted = kept.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 3, "{name}: three lists alive together");
        // The most recently dropped first.
        assert_eq!(reused, kept.iter().rev().copied().collect::<Vec<_>>(), "{name}");
        assert_eq!(later, fresh, "{name}");
    }
}
