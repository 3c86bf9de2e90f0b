//! Slice-boundary decision cost (target: under 1 us). Each iteration finishes a slice
//! (`record_tokens`) and decides; the yield scenario also resumes.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use llmsched_core::slices::{
    Action, EndpointReport, SliceTracker, SwitchCostModel, WaitingRequest,
};

const SLICE: u32 = 64;

fn tracker(endpoints: usize, kv_usage: f64) -> SliceTracker {
    let params = serde_json::json!({"slice_tokens": 64});
    let mut t = SliceTracker::from_config("fixed", &params, SwitchCostModel::default()).unwrap();
    for i in 0..endpoints {
        // Others are busy (waiting > 0) so the migration scan visits all and picks none.
        let report = EndpointReport { kv_usage, waiting: u32::from(i > 0), ..Default::default() };
        t.set_endpoint(&format!("gpu-{i}"), report).unwrap();
    }
    // Other tracked requests make the hash lookup realistic.
    for key in 1..1000 {
        t.admit(key, 1000, u32::MAX, 0, "gpu-0").unwrap();
    }
    t.admit(0, 2000, u32::MAX, 0, "gpu-0").unwrap();
    t
}

fn waiting(n: usize, expected: u32) -> Vec<WaitingRequest> {
    (0..n)
        .map(|i| WaitingRequest {
            priority: 0,
            level: 0,
            context_tokens: 500 + i as u32,
            expected_tokens: expected,
        })
        .collect()
}

fn bench_decide(c: &mut Criterion) {
    let mut group = c.benchmark_group("slices/decide");
    group.throughput(Throughput::Elements(1));

    let scenarios: [(&str, usize, usize, u32, Action); 4] = [
        ("continue-nobody-waiting", 1, 0, 1, Action::Continue),
        ("continue-8-waiting-long", 16, 8, 100_000, Action::Continue),
        ("yield-8-waiting-short", 16, 8, 4, Action::Yield),
        ("continue-8-waiting-long-64-endpoints", 64, 8, 100_000, Action::Continue),
    ];
    for (name, endpoints, n_waiting, expected, want) in scenarios {
        let mut t = tracker(endpoints, 0.5);
        let w = waiting(n_waiting, expected);
        // Check the scenario's outcome before timing it.
        t.record_tokens(0, SLICE).unwrap();
        let d = t.decide(0, false, &w, 0.0).unwrap();
        assert_eq!(d.action, want, "{name}");
        if d.action != Action::Continue {
            t.resume(0, "gpu-0").unwrap();
        }
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                t.record_tokens(0, SLICE).unwrap();
                let d = t.decide(black_box(0), false, black_box(&w), 1.0).unwrap();
                if d.action != Action::Continue {
                    t.resume(0, "gpu-0").unwrap();
                }
                d.action
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_decide);
criterion_main!(benches);
