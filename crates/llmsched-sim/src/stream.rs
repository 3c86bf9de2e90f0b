//! A trace simulated while its plan is built: a second thread builds the plan line by line
//! ([`TraceLines::build`]) into the plan's arrays, allocated at their final lengths up front
//! (every line's block count is known from its lengths), and publishes what it has built every
//! `CHUNK` lines; the engine, on the calling thread, starts on the first lines and waits only
//! when it reaches a line not yet published. On two cores the plan's build (a fifth of a
//! Mooncake-style trace's CPU) then costs the run almost no wall time.
//!
//! Results are those of building the plan first and simulating it: the builder makes the same
//! plan bit for bit ([`trace_plan`](crate::workload::trace_plan)'s, tested), and the engine
//! reads a request's hashes and content ids only once they are published. What is known only
//! at the end is whether the builder's numbering of the contents is exact (a 64-bit collision
//! between different contents, about one in 10^4 for a 100,000-line trace, makes it wrong;
//! [`Contents::exact`] checks it on the builder's thread after the last line): when it is not,
//! [`simulate_trace`] returns no output and the plan numbered exactly, for the caller to
//! simulate again.
//!
//! Sharing: one writer fills the arrays front to back, the engine reads only below the lengths
//! published under the mutex (which orders the writes before the reads), and nothing is
//! written twice, so the two never touch the same element at the same time.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use llmsched_core::routing::{RouterConfig, RoutingError};
use llmsched_core::slices::SliceTracker;

use crate::engine::{simulate_fed, FlowSetup, SimConfig, SimError, SimOutput};
use crate::plan::{Contents, OpenRequest, Plan};
use crate::rng::Pcg64;
use crate::stepmodel::StepModel;
use crate::workload::{LineSink, TraceLines, WorkloadError};

/// Lines built between two publications (a lock and a wake-up each; the first lines reach the
/// engine after a few milliseconds).
const CHUNK: usize = 512;

/// What the builder has published.
#[derive(Debug, Default)]
struct Progress {
    lines: usize,
    blocks: usize,
    contents: usize,
    /// The builder has stopped: every line is published, or `failed` says why not.
    done: bool,
    failed: Option<WorkloadError>,
    /// The builder's numbering is exact (known once done).
    exact: bool,
}

/// The part of a plan the engine may read: the first requests and what they refer to.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Published<'a> {
    pub open: &'a [OpenRequest],
    pub hashes: &'a [u64],
    pub ids: &'a [u32],
    pub unique: &'a [u64],
    /// Per request: where its private blocks begin (see [`LineSink`]).
    pub private_from: &'a [u32],
}

/// The plan's arrays shared by the builder, which writes past what it has published, and the
/// engine, which reads only what is published.
pub(crate) struct Feed<'a> {
    hashes: *mut u64,
    ids: *mut u32,
    unique: *mut u64,
    open: *mut OpenRequest,
    private_from: *mut u32,
    blocks: usize,
    lines: usize,
    progress: Mutex<Progress>,
    ready: Condvar,
    /// The engine stopped (an error): the builder stops too.
    stop: AtomicBool,
    _arrays: PhantomData<&'a mut [u64]>,
}

// SAFETY: the arrays are written by one `Writer` only, each element once and before it is
// published, and read only after it is published; the mutex orders the writes before the reads.
unsafe impl Send for Feed<'_> {}
// SAFETY: as above.
unsafe impl Sync for Feed<'_> {}

fn lock(progress: &Mutex<Progress>) -> MutexGuard<'_, Progress> {
    // Nothing panics while holding it; a poisoned lock still holds consistent counts.
    progress.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<'a> Feed<'a> {
    fn new(
        hashes: &'a mut [u64],
        ids: &'a mut [u32],
        unique: &'a mut [u64],
        open: &'a mut [MaybeUninit<OpenRequest>],
        private_from: &'a mut [u32],
    ) -> Self {
        debug_assert!(ids.len() == hashes.len() && unique.len() == hashes.len());
        debug_assert!(private_from.len() == open.len());
        Feed {
            hashes: hashes.as_mut_ptr(),
            ids: ids.as_mut_ptr(),
            unique: unique.as_mut_ptr(),
            open: open.as_mut_ptr().cast(),
            private_from: private_from.as_mut_ptr(),
            blocks: hashes.len(),
            lines: open.len(),
            progress: Mutex::new(Progress::default()),
            ready: Condvar::new(),
            stop: AtomicBool::new(false),
            _arrays: PhantomData,
        }
    }

    /// Block hashes in the whole plan (a bound on its distinct contents).
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// What is published once more than `lines` lines are, or the builder stopped.
    pub(crate) fn wait_past(&self, lines: usize) -> Result<Published<'_>, WorkloadError> {
        let mut p = lock(&self.progress);
        while p.lines <= lines && !p.done {
            p = self.ready.wait(p).unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(e) = &p.failed {
            return Err(e.clone());
        }
        Ok(self.published(&p))
    }

    fn published(&self, p: &Progress) -> Published<'_> {
        // SAFETY: published elements are initialised, within the arrays and never written
        // again (see the module docs).
        unsafe {
            Published {
                open: std::slice::from_raw_parts(self.open, p.lines),
                hashes: std::slice::from_raw_parts(self.hashes, p.blocks),
                ids: std::slice::from_raw_parts(self.ids, p.blocks),
                unique: std::slice::from_raw_parts(self.unique, p.contents),
                private_from: std::slice::from_raw_parts(self.private_from, p.lines),
            }
        }
    }

    fn into_progress(self) -> Progress {
        self.progress.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The builder's end of a [`Feed`].
struct Writer<'f, 'a> {
    feed: &'f Feed<'a>,
    lines: usize,
    blocks: usize,
    contents: usize,
    published: usize,
    finished: bool,
}

impl<'f, 'a> Writer<'f, 'a> {
    fn new(feed: &'f Feed<'a>) -> Self {
        Writer { feed, lines: 0, blocks: 0, contents: 0, published: 0, finished: false }
    }

    fn publish(&mut self) -> MutexGuard<'f, Progress> {
        let feed: &'f Feed<'a> = self.feed;
        let mut p = lock(&feed.progress);
        (p.lines, p.blocks, p.contents) = (self.lines, self.blocks, self.contents);
        self.published = self.lines;
        p
    }

    /// The build ended: everything written is published, the numbering checked, the engine
    /// woken for the last time.
    fn finish(mut self, built: Result<(), WorkloadError>) {
        let built = built.and_then(|()| {
            if self.lines == self.feed.lines {
                Ok(())
            } else {
                Err(WorkloadError("trace plan builder: lines missing".into()))
            }
        });
        let exact = built.is_ok() && {
            let p = self.publish();
            let published = self.feed.published(&p);
            drop(p);
            Contents::exact(published.hashes, published.ids, published.unique)
        };
        let mut p = self.publish();
        p.exact = exact;
        p.failed = built.err();
        p.done = true;
        drop(p);
        self.finished = true;
        self.feed.ready.notify_all();
    }
}

impl Drop for Writer<'_, '_> {
    /// A builder that panicked still lets the engine go (with an error).
    fn drop(&mut self) {
        if !self.finished {
            let mut p = self.publish();
            p.failed = Some(WorkloadError("trace plan builder failed".into()));
            p.done = true;
            drop(p);
            self.feed.ready.notify_all();
        }
    }
}

impl LineSink for Writer<'_, '_> {
    fn line(
        &mut self,
        hashes: &[u64],
        ids: &[u32],
        new_contents: &[u64],
        request: OpenRequest,
        private_from: usize,
    ) -> Result<(), WorkloadError> {
        let f = self.feed;
        if f.stop.load(Ordering::Relaxed) {
            return Err(WorkloadError("trace plan builder stopped".into()));
        }
        let n = hashes.len();
        let fits = self.lines < f.lines
            && ids.len() == n
            && request.hashes == (self.blocks..self.blocks + n)
            && self.blocks + n <= f.blocks
            && self.contents + new_contents.len() <= f.blocks
            && private_from <= n
            && u32::try_from(n).is_ok()
            && request.prompt_len > 0
            && request.arrival.is_finite();
        if !fits {
            return Err(WorkloadError(format!(
                "trace plan builder: line {} does not fit the plan",
                self.lines
            )));
        }
        // SAFETY: in bounds (checked above) and past the published lengths, where only this
        // writer writes; the engine reads them only after `publish`.
        unsafe {
            std::ptr::copy_nonoverlapping(hashes.as_ptr(), f.hashes.add(self.blocks), n);
            std::ptr::copy_nonoverlapping(ids.as_ptr(), f.ids.add(self.blocks), n);
            std::ptr::copy_nonoverlapping(
                new_contents.as_ptr(),
                f.unique.add(self.contents),
                new_contents.len(),
            );
            f.open.add(self.lines).write(request);
            f.private_from.add(self.lines).write(private_from as u32);
        }
        self.lines += 1;
        self.blocks += n;
        self.contents += new_contents.len();
        if self.lines - self.published >= CHUNK {
            drop(self.publish());
            f.ready.notify_all();
        }
        Ok(())
    }
}

/// Simulates the trace `lines` lays out while a second thread builds its plan (see the module
/// docs); `rng` is the workload's generator. Returns the plan, and the output: None when the
/// builder's numbering proved inexact, the plan then numbered exactly for the caller to run
/// with [`crate::simulate`] (which gives what this run would have given with that numbering).
pub fn simulate_trace(
    cfg: SimConfig,
    model: StepModel,
    router_config: &dyn Fn() -> Result<RouterConfig, RoutingError>,
    lines: &TraceLines<'_>,
    rng: Pcg64,
    flow: Option<&FlowSetup>,
    slices: Option<SliceTracker>,
) -> Result<(Option<SimOutput>, Plan<'static>), SimError> {
    let (blocks, n) = (lines.blocks(), lines.len());
    // Zeroed pages come from the kernel untouched: only what the builder writes is paid for.
    let mut hashes = vec![0u64; blocks];
    let mut ids = vec![0u32; blocks];
    let mut unique = vec![0u64; blocks];
    let mut open: Vec<OpenRequest> = Vec::with_capacity(n);
    let mut private_from = vec![0u32; n];
    let feed = Feed::new(
        &mut hashes,
        &mut ids,
        &mut unique,
        &mut open.spare_capacity_mut()[..n],
        &mut private_from,
    );
    let out = std::thread::scope(|scope| {
        let builder = scope.spawn(|| {
            let mut writer = Writer::new(&feed);
            let built = lines.build(rng, &mut writer);
            writer.finish(built);
        });
        let out = simulate_fed(cfg, model, router_config, &feed, n, flow, slices);
        if out.is_err() {
            feed.stop.store(true, Ordering::Relaxed);
        }
        // A panic in the builder is reported through its writer's drop (`failed`).
        let _ = builder.join();
        out
    });
    let progress = feed.into_progress();
    // SAFETY: the builder wrote (and published) the first `progress.lines` requests.
    unsafe { open.set_len(progress.lines) };
    let out = out?; // the engine's error first: the builder's may only say it was stopped
    if let Some(e) = progress.failed {
        return Err(e.into());
    }
    unique.truncate(progress.contents);
    let mut plan = Plan { hashes: hashes.into(), open, ..Plan::default() };
    let out = if progress.exact {
        plan.contents = Some(Arc::new(Contents::checked(ids, unique)));
        Some(out)
    } else {
        plan.contents = Some(Arc::new(Contents::number(&plan.hashes)));
        None
    };
    Ok((out, plan))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::simulate;
    use crate::workload::{read_trace, trace_plan, TraceSpec};
    use llmsched_core::routing::{parse_config, presets};
    use serde_json::json;

    const SPEC: TraceSpec =
        TraceSpec { millis: true, time_scale: 1.0, hash_block: 64, limit: None };

    /// `lines` lines over shared contexts (ids reused by later lines, some prompts ending inside
    /// an id's blocks), some lines without ids, a few sessions: several chunks' worth.
    fn trace(lines: usize) -> String {
        let mut text = String::new();
        let mut fresh = 10_000u64;
        for i in 0..lines as u64 {
            let input = 40 + (i * 7919) % 700;
            let need = input.div_ceil(64);
            let shared = (i % 5).min(need);
            let mut ids: Vec<u64> = (0..shared).map(|k| (i % 7) * 100 + k).collect();
            ids.extend(fresh..fresh + need - shared);
            fresh += need - shared;
            let mut row = json!({"timestamp": i * 3 + (i % 4), "input_length": input,
                                 "output_length": (i * 31) % 50, "tenant": i % 3});
            if i % 9 != 0 {
                row["hash_ids"] = json!(ids);
            }
            if i % 11 == 0 {
                row["session"] = json!(format!("s{}", i % 4));
            }
            text.push_str(&format!("{row}\n"));
        }
        text
    }

    fn config(kv_events_delay: f64) -> SimConfig {
        serde_json::from_value(json!({
            "replicas": 3, "block_size": 16, "kv_blocks": 600,
            "max_num_batched_tokens": 512, "max_num_seqs": 16, "priority_scheduling": false,
            "metrics_delay_s": 0.0, "kv_events_delay_s": kv_events_delay, "kv_sample_s": 1.0,
            "max_time_s": null, "seed": 0,
        }))
        .unwrap()
    }

    fn model() -> StepModel {
        serde_json::from_value(json!({"kind": "linear", "b0": 0.01, "b1": 1e-5, "b2": 1e-4,
                                      "b3": 0.0, "b4": 0.0}))
        .unwrap()
    }

    #[test]
    fn built_while_running_equals_built_first() {
        let rows = read_trace(&trace(3 * CHUNK + 77), "t", &SPEC).unwrap();
        let value = presets::preset("llm-d").unwrap();
        let make = || parse_config(&value).map_err(RoutingError::from);
        let rng = || Pcg64::from_entropy(&[7]);
        let first = trace_plan(&rows, &SPEC, rng(), 16, 5).unwrap();
        let lines = TraceLines::new(&rows, &SPEC, 16, 5).unwrap();
        assert_eq!(lines.blocks(), first.hashes.len());
        for delay in [0.0, 0.5] {
            let (out, plan) =
                simulate_trace(config(delay), model(), &make, &lines, rng(), None, None).unwrap();
            assert_eq!(plan, first); // hashes, requests and the numbering
            let expected = simulate(config(delay), model(), &make, &first, None, None).unwrap();
            let mut out = out.unwrap();
            assert!(out.replicas.iter().any(|r| r.counters.hit_tokens > 0));
            (out.decision, out.feed) = (expected.decision, expected.feed); // wall times
            assert_eq!(out, expected);
            // Leaving the private blocks out of the index changes nothing.
            let mut full = crate::engine::with_full_index(|| {
                simulate(config(delay), model(), &make, &first, None, None).unwrap()
            });
            (full.decision, full.feed) = (expected.decision, expected.feed);
            assert_eq!(full, expected);
        }
    }

    /// Records what the builder says of each line.
    #[derive(Default)]
    struct Lines {
        private_from: Vec<usize>,
    }

    impl LineSink for Lines {
        fn line(
            &mut self,
            _: &[u64],
            _: &[u32],
            _: &[u64],
            _: OpenRequest,
            private_from: usize,
        ) -> Result<(), WorkloadError> {
            self.private_from.push(private_from);
            Ok(())
        }
    }

    #[test]
    fn the_builder_marks_private_only_blocks_no_other_line_holds() {
        let rows = read_trace(&trace(2 * CHUNK), "t", &SPEC).unwrap();
        let rng = || Pcg64::from_entropy(&[3]);
        let lines = TraceLines::new(&rows, &SPEC, 16, 0).unwrap();
        let mut said = Lines::default();
        lines.build(rng(), &mut said).unwrap();
        let plan = trace_plan(&rows, &SPEC, rng(), 16, 0).unwrap();
        let contents = plan.contents.as_deref().unwrap();
        // Counted over the whole plan: the fewest private blocks each line can have.
        let counted = plan.private_from(contents.ids(), contents.unique().len());
        let mut private = 0;
        for (i, r) in plan.open.iter().enumerate() {
            assert!(said.private_from[i] >= counted.open[i] as usize, "line {i}");
            assert!(said.private_from[i] <= r.hashes.len());
            private += r.hashes.len() - said.private_from[i];
        }
        assert!(private > plan.hashes.len() / 4, "most fresh blocks are private: {private}");
    }

    #[test]
    fn an_engine_error_stops_the_builder() {
        let rows = read_trace(&trace(2 * CHUNK), "t", &SPEC).unwrap();
        let lines = TraceLines::new(&rows, &SPEC, 16, 0).unwrap();
        let value = presets::preset("llm-d").unwrap();
        let make = || parse_config(&value).map_err(RoutingError::from);
        let mut cfg = config(0.0);
        cfg.replicas = 0;
        let rng = Pcg64::from_entropy(&[0]);
        let e = simulate_trace(cfg, model(), &make, &lines, rng, None, None).unwrap_err();
        assert!(matches!(e, SimError::Config(_)), "{e}");
    }

    #[test]
    fn an_empty_trace_runs() {
        let lines = TraceLines::new(&[], &SPEC, 16, 0).unwrap();
        let value = presets::preset("llm-d").unwrap();
        let make = || parse_config(&value).map_err(RoutingError::from);
        let rng = Pcg64::from_entropy(&[0]);
        let (out, plan) =
            simulate_trace(config(0.0), model(), &make, &lines, rng, None, None).unwrap();
        assert!(out.unwrap().done.is_empty() && plan.open.is_empty());
    }
}
