//! Criterion benchmarks of one routing decision in pure Rust (no Python): hash a 10,000-token
//! prompt, match it, 1 filter, 3 scorers, max-score, over 64 and 1,024 endpoints. Scenarios:
//! `hit` (the prompt extends a stored conversation) and `miss` (nothing cached).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use serde_json::json;

use llmsched_core::prefix_index::{IndexConfig, PrefixIndex, Tier, WorkerKey};
use llmsched_core::routing::{
    parse_config, Endpoint, EndpointPool, MetricsUpdate, RequestMeta, Role, Router, RouterOptions,
    StaleMode, StalePolicy,
};

/// A small deterministic generator (SplitMix64), enough for synthetic workloads.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 128_000) as u32).collect()
    }
}

fn router(endpoints: usize) -> (Router, Vec<u32>) {
    let pool = Arc::new(
        EndpointPool::new(StalePolicy { mode: StaleMode::Ignore, ..StalePolicy::default() })
            .unwrap(),
    );
    let index = Arc::new(
        PrefixIndex::new(IndexConfig { block_size: 16, ..IndexConfig::default() }).unwrap(),
    );
    let mut gen = Gen(endpoints as u64);
    for i in 0..endpoints {
        let role = if i % 4 == 0 { Role::Both } else { Role::Decode };
        pool.upsert(Endpoint { role: Some(role), ..Endpoint::new(WorkerKey::Int(i as i64)) });
        let update = MetricsUpdate {
            waiting: Some((gen.next() % 20) as u32),
            kv_cache_usage: Some((gen.next() % 100) as f64 / 100.0),
            ..MetricsUpdate::default()
        };
        pool.update_metrics(&WorkerKey::Int(i as i64), update, 0.0).unwrap();
    }
    // Conversations over 16 system prompts, growing turn by turn, held by random endpoints.
    let systems: Vec<Vec<u32>> = (0..16).map(|_| gen.tokens(1_500)).collect();
    let mut longest = Vec::new();
    for conversation in 0..400 {
        let mut prompt = systems[conversation % 16].clone();
        let worker = WorkerKey::Int((gen.next() % endpoints as u64) as i64);
        for _ in 0..5 {
            prompt.extend(gen.tokens(800));
            let hashes = index.hash_tokens(&prompt, None, None).unwrap();
            index.store(&worker, &hashes, None, Tier::Gpu).unwrap();
        }
        if prompt.len() > longest.len() {
            longest = prompt.clone();
        }
    }
    longest.truncate(10_000);
    longest.extend(gen.tokens(10_000 - longest.len()));
    let config = json!({
        "plugins": [{"type": "decode-filter"}, {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                    {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "decode-filter"},
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "max-score-picker"}]}]
    });
    let router =
        Router::new(pool, index, parse_config(&config).unwrap(), RouterOptions::default()).unwrap();
    (router, longest)
}

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("routing decision, 10,000 tokens");
    group.throughput(Throughput::Elements(1));
    let meta = RequestMeta::default();
    for endpoints in [64usize, 1024] {
        let (router, hit) = router(endpoints);
        let miss = Gen(99).tokens(10_000);
        let warm = router.decide(&hit, &meta, 0.0).unwrap();
        assert!(warm.base.iter().map(|c| c.cached_blocks).max().unwrap_or(0) > 100);
        for (scenario, prompt) in [("hit", &hit), ("miss", &miss)] {
            group.bench_with_input(BenchmarkId::new(scenario, endpoints), prompt, |b, p| {
                b.iter(|| router.decide(black_box(p), &meta, 0.0).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
