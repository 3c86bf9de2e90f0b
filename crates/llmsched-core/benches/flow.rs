//! Flow controller throughput over a steady backlog in 8 priority bands and 1,000 tenants, per
//! fairness/ordering policy: `pair` times enqueue + dispatch (the dispatched requests are
//! completed outside the timed region, 1,024 at a time, so in-flight work stays flat); `cycle`
//! also times the `complete`. The same at 1,000,000 queued requests, and the heap bytes each
//! queued request costs (counted by a global allocator and printed once, since criterion
//! measures time only).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use llmsched_core::flow::{FlowController, FlowRequest};

/// Counts live heap bytes.
struct CountingAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const BANDS: u64 = 8;
const TENANTS: u64 = 1_000;

fn config(fairness: &str, ordering: &str) -> String {
    format!(
        r#"{{"saturation": {{"type": "concurrency", "max_requests": 1000000000}},
            "shedding": {{"type": "none"}},
            "default_band": {{"max_requests": null, "max_bytes": null,
                              "fairness": {{"type": "{fairness}"}}, "ordering": {{"type": "{ordering}"}}}}}}"#
    )
}

struct Workload {
    tenants: Vec<String>,
    next_id: u64,
    now: f64,
}

impl Workload {
    fn new() -> Self {
        Workload {
            tenants: (0..TENANTS).map(|t| format!("tenant-{t}")).collect(),
            next_id: 0,
            now: 0.0,
        }
    }

    /// The next request: bands and tenants spread by multiplicative hashing of the id.
    fn enqueue<P: Default>(&mut self, c: &mut FlowController<P>) {
        self.next_id += 1;
        self.now += 1e-6;
        let id = self.next_id;
        let mixed = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let request = FlowRequest {
            id,
            priority: (mixed >> 61) as i32 % BANDS as i32,
            tenant: &self.tenants[((mixed >> 20) % TENANTS) as usize],
            tokens: 64 + (mixed >> 40) % 1024,
            bytes: 4096,
            deadline: Some(self.now + ((mixed >> 8) % 1000) as f64 * 1e-3),
            ttft_target: None,
            payload: P::default(),
        };
        let refused = c.enqueue(request, self.now).expect("valid request");
        assert!(refused.is_none());
    }

    fn fill<P: Default>(&mut self, c: &mut FlowController<P>, queued: usize) {
        for _ in 0..queued {
            self.enqueue(c);
        }
    }

    /// Enqueue a request, dispatch one; returns the dispatched id.
    fn pair<P: Default>(&mut self, c: &mut FlowController<P>) -> u64 {
        self.enqueue(c);
        let decision = c.dispatch(self.now).expect("valid time").expect("backlog never empties");
        black_box(decision.id)
    }

    /// A pair plus the completion of the dispatched request.
    fn cycle<P: Default>(&mut self, c: &mut FlowController<P>) {
        let id = self.pair(c);
        c.complete(id, 16, self.now).expect("running");
    }

    /// `iters` pairs, timed; completions happen between timed chunks.
    fn timed_pairs<P: Default>(&mut self, c: &mut FlowController<P>, iters: u64) -> Duration {
        let mut elapsed = Duration::ZERO;
        let mut running = Vec::with_capacity(1024);
        let mut left = iters;
        while left > 0 {
            let chunk = left.min(1024);
            let start = Instant::now();
            for _ in 0..chunk {
                running.push(self.pair(c));
            }
            elapsed += start.elapsed();
            for id in running.drain(..) {
                c.complete(id, 16, self.now).expect("running");
            }
            left -= chunk;
        }
        elapsed
    }
}

fn bench_both<P: Default>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    scenario: &str,
    controller: &mut FlowController<P>,
    workload: &mut Workload,
) {
    group.bench_function(BenchmarkId::new(format!("pair/{name}"), scenario), |b| {
        b.iter_custom(|iters| workload.timed_pairs(controller, iters))
    });
    group.bench_function(BenchmarkId::new(format!("cycle/{name}"), scenario), |b| {
        b.iter(|| workload.cycle(controller))
    });
}

fn policies(c: &mut Criterion) {
    let mut group = c.benchmark_group("flow");
    group.throughput(Throughput::Elements(1));
    for (fairness, ordering) in [
        ("round-robin", "fcfs"),
        ("vtc", "fcfs"),
        ("las", "fcfs"),
        ("strict", "edf"),
        ("vtc", "slo-deadline"),
    ] {
        let mut controller: FlowController<()> =
            FlowController::from_json(&config(fairness, ordering)).unwrap();
        let mut workload = Workload::new();
        workload.fill(&mut controller, 100_000);
        let name = format!("{fairness}+{ordering}");
        let scenario = "8bands-1000flows-100k-queued";
        bench_both(&mut group, &name, scenario, &mut controller, &mut workload);
    }
    group.finish();
}

fn live_bytes_per_request<P: Default>(queued: usize) -> (f64, FlowController<P>, Workload) {
    let mut controller: FlowController<P> =
        FlowController::from_json(&config("vtc", "fcfs")).unwrap();
    let mut workload = Workload::new();
    workload.fill(&mut controller, 1_000); // flows and bands exist before measuring
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    workload.fill(&mut controller, queued);
    let after = LIVE_BYTES.load(Ordering::Relaxed);
    ((after - before) as f64 / queued as f64, controller, workload)
}

fn million_queued(c: &mut Criterion) {
    let (bytes_word, _, _) = live_bytes_per_request::<u64>(1_000_000);
    let (bytes, mut controller, mut workload) = live_bytes_per_request::<()>(1_000_000);
    eprintln!(
        "flow/memory: {bytes:.0} heap bytes per queued request with no payload, \
         {bytes_word:.0} with an 8-byte payload (a Python object pointer), at 1,000,000 queued"
    );
    let mut group = c.benchmark_group("flow");
    group.throughput(Throughput::Elements(1));
    let scenario = "8bands-1000flows-1M-queued";
    bench_both(&mut group, "vtc+fcfs", scenario, &mut controller, &mut workload);
    group.finish();
}

criterion_group!(benches, policies, million_queued);
criterion_main!(benches);
