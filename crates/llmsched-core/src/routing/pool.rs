//! The endpoint pool: endpoints, their latest metrics, and the staleness policy.
//!
//! Membership (endpoints added, changed or removed) is copy-on-write: a decision takes an
//! `Arc` of the current member list once and never blocks on writers. A change costs O(n) (one
//! copy of the list), so adding many endpoints goes through [`EndpointPool::upsert_many`], one
//! copy for the batch. Metrics and LoRA state
//! change in place per member: metrics sit in a seqlock cell (readers never write shared memory,
//! so deciding threads do not contend), LoRA state behind a small lock read only by LoRA plugins.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crossbeam_utils::atomic::AtomicCell;
use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};

use super::endpoint::{Endpoint, LoraState, Metrics};
use super::inflight::InFlight;
use super::RoutingError;
use crate::prefix_index::WorkerKey;

/// How metrics older than the staleness limit are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleMode {
    /// The endpoint counts as saturated: load scorers give it 0, utilization filters drop it.
    Saturated,
    /// The last metrics are used as they are.
    Ignore,
}

impl StaleMode {
    pub fn parse(name: &str) -> Option<StaleMode> {
        match name {
            "saturated" => Some(StaleMode::Saturated),
            "ignore" => Some(StaleMode::Ignore),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StaleMode::Saturated => "saturated",
            StaleMode::Ignore => "ignore",
        }
    }
}

/// Staleness policy. Defaults live here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StalePolicy {
    /// Metrics older than this many seconds are stale. The default, 1 s, is 5 scrape intervals
    /// of the metrics scraper (0.2 s): at 1x (llm-d's 200 ms) a quiet router scored 8% of its
    /// rows saturated from scheduling jitter alone.
    pub stale_after: f64,
    pub mode: StaleMode,
}

impl Default for StalePolicy {
    fn default() -> Self {
        StalePolicy { stale_after: 1.0, mode: StaleMode::Saturated }
    }
}

impl StalePolicy {
    /// Whether metrics taken at `timestamp` count as saturated at `now`.
    pub fn saturated(&self, timestamp: f64, now: f64) -> bool {
        self.mode == StaleMode::Saturated && now - timestamp > self.stale_after
    }
}

/// A partial metrics update: fields left None keep their value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MetricsUpdate {
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    pub kv_cache_usage: Option<f64>,
    pub max_concurrency: Option<u32>,
}

/// One endpoint with its live state.
#[derive(Debug)]
pub struct Member {
    pub endpoint: Endpoint,
    metrics: AtomicCell<Metrics>,
    loras: RwLock<Arc<LoraState>>,
    pub inflight: Arc<InFlight>,
    // Serialises read-modify-write metric updates of this member.
    update: Mutex<()>,
}

impl Member {
    pub(crate) fn new(endpoint: Endpoint) -> Self {
        Member {
            endpoint,
            metrics: AtomicCell::new(Metrics::default()),
            loras: RwLock::new(Arc::new(LoraState::default())),
            inflight: Arc::new(InFlight::default()),
            update: Mutex::new(()),
        }
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.load()
    }

    pub fn loras(&self) -> Arc<LoraState> {
        self.loras.read().clone()
    }

    #[cfg(test)]
    pub(crate) fn loras_mut(&self) -> parking_lot::RwLockWriteGuard<'_, Arc<LoraState>> {
        self.loras.write()
    }
}

/// An immutable member list. `generation` is unique across all pools of the process.
#[derive(Debug, Default)]
pub struct Members {
    pub list: Vec<Arc<Member>>,
    pub by_id: HashMap<WorkerKey, usize>,
    pub generation: u64,
}

static GENERATIONS: AtomicU64 = AtomicU64::new(1);

impl Members {
    pub(crate) fn build(list: Vec<Arc<Member>>) -> Members {
        let by_id = list.iter().enumerate().map(|(i, m)| (m.endpoint.id.clone(), i)).collect();
        Members { list, by_id, generation: GENERATIONS.fetch_add(1, Ordering::Relaxed) }
    }

    pub fn get(&self, id: &WorkerKey) -> Option<&Arc<Member>> {
        self.by_id.get(id).map(|&i| &self.list[i])
    }
}

/// The endpoints a router picks from. Share it between threads and routers with an `Arc`.
#[derive(Debug)]
pub struct EndpointPool {
    members: RwLock<Arc<Members>>,
    // Serialises membership changes (copy-on-write), never held by readers.
    membership: Mutex<Departed>,
    policy: StalePolicy,
}

/// The in-flight counters of removed endpoints, while tickets still hold them: an endpoint
/// removed and added back (a flapping pod, a health ejection) gets its counters back, so the
/// requests still running there keep counting. Weak, so that a removed endpoint's counters
/// go when its last ticket ends; dead entries are swept when the map has doubled.
#[derive(Debug, Default)]
struct Departed {
    inflight: HashMap<WorkerKey, Weak<InFlight>>,
    sweep_at: usize,
}

impl Departed {
    fn keep(&mut self, id: WorkerKey, inflight: &Arc<InFlight>) {
        self.inflight.insert(id, Arc::downgrade(inflight));
        if self.inflight.len() >= self.sweep_at {
            self.inflight.retain(|_, w| w.strong_count() > 0);
            // Amortised O(1) per removal.
            self.sweep_at = (2 * self.inflight.len()).max(64);
        }
    }

    fn take(&mut self, id: &WorkerKey) -> Option<Arc<InFlight>> {
        self.inflight.remove(id).and_then(|w| w.upgrade())
    }
}

impl EndpointPool {
    pub fn new(policy: StalePolicy) -> Result<Self, RoutingError> {
        if policy.stale_after.is_nan() || policy.stale_after < 0.0 {
            return Err(RoutingError::InvalidValue(format!(
                "stale_after must be a non-negative number of seconds, got {}",
                policy.stale_after
            )));
        }
        Ok(EndpointPool {
            members: RwLock::new(Arc::new(Members::build(Vec::new()))),
            membership: Mutex::new(Departed::default()),
            policy,
        })
    }

    pub fn policy(&self) -> StalePolicy {
        self.policy
    }

    /// The current members; cheap (one reference count).
    pub fn snapshot(&self) -> Arc<Members> {
        self.members.read().clone()
    }

    pub fn len(&self) -> usize {
        self.members.read().list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds an endpoint, or replaces the description of one with the same id while keeping its
    /// metrics, LoRA state and in-flight counts. Returns true if it was new. O(n): adding many
    /// endpoints one by one is quadratic, [`EndpointPool::upsert_many`] is not.
    pub fn upsert(&self, endpoint: Endpoint) -> bool {
        self.upsert_many(std::iter::once(endpoint)) == 1
    }

    /// [`EndpointPool::upsert`] of each endpoint in order, with one copy of the member list for
    /// the batch (O(n + batch)). Returns how many were new. Readers see all or none of it.
    pub fn upsert_many(&self, endpoints: impl IntoIterator<Item = Endpoint>) -> usize {
        let mut departed = self.membership.lock();
        let current = self.snapshot();
        let mut list = current.list.clone();
        let mut by_id = current.by_id.clone();
        let mut added = 0;
        for endpoint in endpoints {
            match by_id.get(&endpoint.id) {
                Some(&i) => {
                    let old = &list[i];
                    let member = Member {
                        endpoint,
                        metrics: AtomicCell::new(old.metrics()),
                        loras: RwLock::new(old.loras()),
                        inflight: old.inflight.clone(),
                        update: Mutex::new(()),
                    };
                    list[i] = Arc::new(member);
                }
                None => {
                    let mut member = Member::new(endpoint);
                    if let Some(inflight) = departed.take(&member.endpoint.id) {
                        member.inflight = inflight;
                    }
                    by_id.insert(member.endpoint.id.clone(), list.len());
                    list.push(Arc::new(member));
                    added += 1;
                }
            }
        }
        let generation = GENERATIONS.fetch_add(1, Ordering::Relaxed);
        *self.members.write() = Arc::new(Members { list, by_id, generation });
        added
    }

    /// Removes an endpoint. Requests in flight there keep their tickets, and their counts come
    /// back with the endpoint if it is added again while they run.
    pub fn remove(&self, id: &WorkerKey) -> Result<(), RoutingError> {
        let mut departed = self.membership.lock();
        let current = self.snapshot();
        let Some(&i) = current.by_id.get(id) else {
            return Err(RoutingError::UnknownEndpoint(id.clone()));
        };
        let mut list = current.list.clone();
        let gone = list.remove(i);
        departed.keep(id.clone(), &gone.inflight);
        *self.members.write() = Arc::new(Members::build(list));
        Ok(())
    }

    /// Applies a metrics update taken at `now`. Nothing changes on error.
    pub fn update_metrics(
        &self,
        id: &WorkerKey,
        update: MetricsUpdate,
        now: f64,
    ) -> Result<(), RoutingError> {
        if let Some(kv) = update.kv_cache_usage {
            if !(0.0..=1.0).contains(&kv) {
                return Err(RoutingError::InvalidValue(format!(
                    "kv_cache_usage must be in 0..1, got {kv}"
                )));
            }
        }
        if !now.is_finite() {
            return Err(RoutingError::InvalidValue(format!("now must be finite, got {now}")));
        }
        let members = self.snapshot();
        let member = members.get(id).ok_or_else(|| RoutingError::UnknownEndpoint(id.clone()))?;
        let _guard = member.update.lock();
        let mut m = member.metrics();
        m.waiting = update.waiting.unwrap_or(m.waiting);
        m.running = update.running.unwrap_or(m.running);
        m.kv_cache_usage = update.kv_cache_usage.unwrap_or(m.kv_cache_usage);
        m.max_concurrency = update.max_concurrency.unwrap_or(m.max_concurrency);
        m.timestamp = now;
        member.metrics.store(m);
        Ok(())
    }

    /// Replaces an endpoint's LoRA state.
    pub fn set_loras(&self, id: &WorkerKey, loras: LoraState) -> Result<(), RoutingError> {
        let members = self.snapshot();
        let member = members.get(id).ok_or_else(|| RoutingError::UnknownEndpoint(id.clone()))?;
        *member.loras.write() = Arc::new(loras);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> WorkerKey {
        WorkerKey::Str(s.into())
    }

    #[test]
    fn upsert_keeps_live_state_and_errors_change_nothing() {
        let pool = EndpointPool::new(StalePolicy::default()).unwrap();
        assert!(pool.upsert(Endpoint::new(key("a"))));
        let update = MetricsUpdate { waiting: Some(3), ..Default::default() };
        pool.update_metrics(&key("a"), update, 1.0).unwrap();
        let mut changed = Endpoint::new(key("a"));
        changed.address = "10.0.0.1:8000".into();
        assert!(!pool.upsert(changed));
        let snap = pool.snapshot();
        assert_eq!(snap.list[0].metrics().waiting, 3);
        assert_eq!(snap.list[0].endpoint.address, "10.0.0.1:8000");
        let bad =
            MetricsUpdate { waiting: Some(9), kv_cache_usage: Some(1.5), ..Default::default() };
        assert!(pool.update_metrics(&key("a"), bad, 2.0).is_err());
        assert_eq!(pool.snapshot().list[0].metrics().waiting, 3);
        assert!(matches!(pool.remove(&key("b")), Err(RoutingError::UnknownEndpoint(_))));
        pool.remove(&key("a")).unwrap();
        assert!(pool.is_empty());
    }

    #[test]
    fn a_removed_endpoint_added_back_keeps_the_counts_of_requests_still_running() {
        use super::super::inflight::{Part, Ticket};
        let pool = EndpointPool::new(StalePolicy::default()).unwrap();
        pool.upsert(Endpoint::new(key("a")));
        let held = pool.snapshot().get(&key("a")).unwrap().inflight.clone();
        let ticket = Ticket::start(vec![(held, Part::Whole { uncached_tokens: 5 })], 50);
        pool.remove(&key("a")).unwrap();
        assert!(pool.upsert(Endpoint::new(key("a"))));
        let counts = || pool.snapshot().get(&key("a")).unwrap().inflight.snapshot();
        assert_eq!((counts().requests, counts().tokens), (1, 50));
        drop(ticket);
        assert_eq!(counts(), Default::default());
        // Once no ticket holds them, a re-added endpoint starts from zero counters.
        pool.remove(&key("a")).unwrap();
        assert!(pool.upsert(Endpoint::new(key("a"))));
        assert_eq!(counts(), Default::default());
    }

    #[test]
    fn upsert_many_adds_in_one_step_and_replaces_known_ids() {
        let pool = EndpointPool::new(StalePolicy::default()).unwrap();
        pool.upsert(Endpoint::new(key("a")));
        let generation = pool.snapshot().generation;
        let mut again = Endpoint::new(key("a"));
        again.address = "h:1".into();
        let batch = vec![Endpoint::new(key("b")), again, Endpoint::new(key("c"))];
        assert_eq!(pool.upsert_many(batch), 2);
        let snap = pool.snapshot();
        assert!(snap.generation > generation);
        let ids: Vec<_> = snap.list.iter().map(|m| m.endpoint.id.clone()).collect();
        assert_eq!(ids, [key("a"), key("b"), key("c")]);
        assert_eq!(snap.get(&key("a")).unwrap().endpoint.address, "h:1");
        assert_eq!(snap.by_id.len(), 3);
    }

    #[test]
    fn departed_counters_are_swept_once_their_tickets_end() {
        let pool = EndpointPool::new(StalePolicy::default()).unwrap();
        for i in 0..1000 {
            pool.upsert(Endpoint::new(key(&format!("e{i}"))));
            pool.remove(&key(&format!("e{i}"))).unwrap();
        }
        assert!(pool.membership.lock().inflight.len() <= 128);
    }

    #[test]
    fn staleness_policy() {
        let p = StalePolicy { stale_after: 0.2, mode: StaleMode::Saturated };
        assert!(!p.saturated(1.0, 1.2));
        assert!(p.saturated(1.0, 1.2001));
        assert!(p.saturated(f64::NEG_INFINITY, 0.0));
        let ignore = StalePolicy { mode: StaleMode::Ignore, ..p };
        assert!(!ignore.saturated(f64::NEG_INFINITY, 100.0));
    }
}
