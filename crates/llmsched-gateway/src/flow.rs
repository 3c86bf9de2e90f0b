//! Admission through the core flow controller (`llmsched_core::flow`): a request joins its
//! `(tenant, priority)` flow and waits, without a thread, until the controller dispatches it;
//! it holds its slot until its answer ends. One lock guards the controller; every operation
//! under it is O(log n).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use llmsched_core::flow::metrics::ControllerMetrics;
use llmsched_core::flow::{
    EndpointMetrics, FlowConfig, FlowController, FlowDecision, FlowRequest, Outcome, PolicyRegistry,
};
use serde_json::Value;
use tokio::sync::{oneshot, Notify};

type Waiter = oneshot::Sender<Outcome>;

/// The gateway's flow control.
pub struct Flow {
    core: Mutex<FlowController<Waiter>>,
    ids: AtomicU64,
    queued: Notify,
    /// How old engine metrics may be before the saturation detector counts them as stale
    /// (None: its detector reads no engine metrics).
    metrics_staleness_s: Option<f64>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy)]
pub enum NotAdmitted {
    /// The controller's outcome (rejected or evicted).
    Outcome(Outcome),
    /// The request's deadline passed while it waited.
    Deadline,
}

/// A dispatched request's place: completing it (dropping it) frees the slot.
pub struct Slot {
    flow: Arc<Flow>,
    id: u64,
    clock: fn() -> f64,
    /// Output tokens to charge at the end.
    pub output_tokens: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let now = (self.clock)();
        let _ = self.flow.lock().complete(self.id, self.output_tokens, now);
        self.flow.pump(now);
    }
}

/// A request waiting in the controller; dropped while armed, it leaves the queue (or, when it
/// was dispatched meanwhile, frees its slot).
struct Queued<'a> {
    flow: &'a Arc<Flow>,
    id: u64,
    clock: fn() -> f64,
    armed: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let now = (self.clock)();
        let mut core = self.flow.lock();
        if core.cancel(self.id, now).ok().flatten().is_none() && core.is_running(self.id) {
            let _ = core.complete(self.id, 0, now);
        }
        drop(core);
        self.flow.pump(now);
    }
}

impl Flow {
    /// The controller of a flow config (the input format of `llmsched.FlowController`).
    pub fn new(config: &Value) -> Result<Flow, String> {
        let metrics_staleness_s =
            config.get("saturation").and_then(|s| s.get("staleness_s")).and_then(Value::as_f64);
        let config = FlowConfig::from_value(config.clone()).map_err(|e| e.to_string())?;
        let core = FlowController::with_registry(&config, PolicyRegistry::builtin())
            .map_err(|e| e.to_string())?;
        Ok(Flow {
            core: Mutex::new(core),
            ids: AtomicU64::new(1),
            queued: Notify::new(),
            metrics_staleness_s,
        })
    }

    /// How old engine metrics may be before saturation counts them as stale, when its
    /// detector reads engine metrics.
    pub fn metrics_staleness_s(&self) -> Option<f64> {
        self.metrics_staleness_s
    }

    fn lock(&self) -> MutexGuard<'_, FlowController<Waiter>> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the request is dispatched (or refused, evicted, or past `deadline`).
    #[allow(clippy::too_many_arguments)]
    pub async fn admit(
        self: &Arc<Self>,
        tenant: &str,
        priority: i32,
        tokens: u64,
        bytes: u64,
        deadline: f64,
        clock: fn() -> f64,
    ) -> Result<Slot, NotAdmitted> {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let request = FlowRequest {
            id,
            priority,
            tenant,
            tokens,
            bytes,
            deadline: None,
            ttft_target: None,
            payload: tx,
        };
        let now = clock();
        let enqueued = self.lock().enqueue(request, now);
        // Even when this request is refused: its enqueue may have evicted expired ones.
        self.pump(now);
        match enqueued {
            Ok(None) => {}
            Ok(Some(refused)) => return Err(NotAdmitted::Outcome(refused.outcome)),
            Err(_) => return Err(NotAdmitted::Outcome(Outcome::RejectedCapacity)),
        }
        // The expiry loop runs only while requests wait: one dispatched at once needs no
        // wake-up of it.
        if !self.lock().is_empty() {
            self.queued.notify_one();
        }
        let wait = Duration::from_secs_f64((deadline - now).max(0.0));
        // Declared before `queued`, so dropped after it: a request whose waiter is dropped
        // leaves the queue (cancelled) before its receiver goes, never dispatched unclaimed.
        let timed = tokio::time::timeout(wait, rx);
        tokio::pin!(timed);
        // Dropped while queued (the client left, or no engine is left): cancelled.
        let mut queued = Queued { flow: self, id, clock, armed: true };
        let outcome = timed.await;
        queued.armed = false;
        match outcome {
            Ok(Ok(Outcome::Dispatched)) => {
                Ok(Slot { flow: self.clone(), id, clock, output_tokens: 0 })
            }
            Ok(Ok(outcome)) => Err(NotAdmitted::Outcome(outcome)),
            Ok(Err(_)) => Err(NotAdmitted::Outcome(Outcome::EvictedCancelled)),
            Err(_) => {
                queued.armed = true;
                drop(queued);
                Err(NotAdmitted::Deadline)
            }
        }
    }

    /// Dispatches what the controller allows now and tells evicted requests their outcome
    /// (those `enqueue` and `dispatch` evicted: expired, preempted).
    pub fn pump(&self, now: f64) {
        let mut core = self.lock();
        let mut unclaimed = Vec::new();
        while let Ok(Some(decision)) = core.dispatch(now) {
            let FlowDecision { id, payload, .. } = decision;
            if payload.send(Outcome::Dispatched).is_err() {
                // Its request left while queued (e.g. a client disconnect).
                unclaimed.push(id);
            }
        }
        for id in unclaimed {
            let _ = core.complete(id, 0, now);
        }
        // After dispatching: `dispatch` moves requests whose TTL ran out to the outbox (the
        // last of them leaves the queue empty, and the expiry loop asleep).
        for evicted in core.drain_evicted() {
            let _ = evicted.payload.send(evicted.outcome);
        }
    }

    /// Evicts expired queued requests and dispatches; waits while nothing is queued.
    pub async fn run(self: Arc<Self>, clock: fn() -> f64) {
        loop {
            if self.lock().is_empty() {
                self.queued.notified().await;
                continue;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = clock();
            let expired = self.lock().expire(now).unwrap_or_default();
            for decision in expired {
                let _ = decision.payload.send(decision.outcome);
            }
            self.pump(now);
        }
    }

    /// An endpoint's scraped load (for the `utilization` saturation detector).
    pub fn update_endpoint(&self, endpoint: &str, metrics: EndpointMetrics) {
        let _ = self.lock().update_endpoint(endpoint, metrics);
    }

    /// Forgets an endpoint's load.
    pub fn remove_endpoint(&self, endpoint: &str) {
        self.lock().remove_endpoint(endpoint);
    }

    /// Prompt and output tokens served per flow since the last call (for other replicas).
    pub fn drain_service(&self) -> Vec<(Arc<str>, i32, u64, u64)> {
        self.lock().drain_service()
    }

    /// Service another replica gave a tenant, charged to its flow here (fairness across
    /// replicas); false when the tenant has no flow at that priority here.
    pub fn charge_remote(
        &self,
        tenant: &str,
        priority: i32,
        prompt: u64,
        output: u64,
        now: f64,
    ) -> bool {
        self.lock().charge_remote(tenant, priority, prompt, output, now).unwrap_or(false)
    }

    /// Every gauge and counter of the controller.
    pub fn metrics(&self, now: f64) -> Option<ControllerMetrics> {
        self.lock().metrics(now).ok()
    }

    /// Queued requests, running requests, the saturation gauge, live tenants and the count of
    /// each outcome (in `Outcome::ALL` order).
    pub fn stats(&self, now: f64) -> FlowStats {
        let mut core = self.lock();
        let saturation = core.saturation(now).map(|s| s.value).unwrap_or(0.0);
        FlowStats {
            queued: core.len(),
            running: core.running_len(),
            saturation,
            tenants: core.tenant_count(),
            outcomes: Outcome::ALL.iter().copied().zip(core.outcome_counts()).collect(),
        }
    }
}

/// A snapshot of flow control.
#[derive(Debug, Clone)]
pub struct FlowStats {
    /// Requests waiting.
    pub queued: usize,
    /// Requests dispatched and not complete.
    pub running: usize,
    /// The saturation gauge.
    pub saturation: f64,
    /// Tenants with a flow.
    pub tenants: usize,
    /// Requests per outcome.
    pub outcomes: Vec<(Outcome, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The clock of the TTL test, in f64 bits (a `fn` clock cannot capture).
    static TTL_CLOCK: AtomicU64 = AtomicU64::new(0);

    fn ttl_clock() -> f64 {
        f64::from_bits(TTL_CLOCK.load(Ordering::Relaxed))
    }

    #[tokio::test]
    async fn a_request_expiring_as_a_slot_frees_is_told_at_once() {
        // One slot; B queues behind A with a 1 s TTL. A's release comes after B's TTL ran out:
        // its dispatch finds B expired and moves it to the eviction outbox, leaving the queue
        // empty (so the expiry loop sleeps). B must be told its eviction then, not wait for its
        // deadline.
        TTL_CLOCK.store(100f64.to_bits(), Ordering::Relaxed);
        let config = json!({
            "saturation": {"type": "concurrency", "max_requests": 1},
            "default_band": {"ttl_s": 1.0},
        });
        let flow = Arc::new(Flow::new(&config).unwrap());
        let far = 1e9;
        let a = flow.admit("t", 0, 1, 1, far, ttl_clock).await.ok().unwrap();
        let waiting = flow.clone();
        // B's own deadline: 5 s of real time from now (a Deadline answer means it was not told).
        let deadline = 100.0 + 5.0;
        let b = tokio::spawn(async move { waiting.admit("t", 0, 1, 1, deadline, ttl_clock).await });
        while flow.stats(ttl_clock()).queued == 0 {
            tokio::task::yield_now().await;
        }
        TTL_CLOCK.store(102f64.to_bits(), Ordering::Relaxed);
        drop(a);
        match b.await.unwrap() {
            Err(NotAdmitted::Outcome(outcome)) => assert_eq!(outcome, Outcome::EvictedTtl),
            Err(NotAdmitted::Deadline) => panic!("B waited for its deadline"),
            Ok(_) => panic!("B was dispatched after its TTL"),
        }
        let stats = flow.stats(ttl_clock());
        assert_eq!((stats.queued, stats.running), (0, 0));
    }
}
