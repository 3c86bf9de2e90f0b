//! Flow control: decides *when* a request may be dispatched, so high-priority traffic stays fast
//! under overload while batch work fills idle capacity (after llm-d-router's flow control layer).
//!
//! Model: a request joins the flow `(tenant, priority)` inside the band of its priority.
//! `dispatch` serves the highest non-empty band, provided pool saturation is below that band's
//! ceiling; if that band is blocked, nothing lower dispatches (no priority inversion). Within the
//! band a [fairness policy](fairness) picks the flow and an [ordering policy](ordering) the
//! request. Every request ends in exactly one [`Outcome`]: dispatched, rejected at the door
//! (capacity, shedding, no endpoints) or evicted from the queue (TTL, preemption, cancellation).
//! Dispatched requests stay *running* until `complete`, which feeds fairness (output tokens),
//! concurrency saturation and preemption.
//!
//! Time is the caller's: every call takes `now` in seconds on one monotonic clock; an earlier
//! `now` than already seen counts as the latest seen.
//!
//! Flows are reclaimed: a flow with no queued and no running request for `flow_idle_s` is
//! removed at the first call that takes `now` from then on (its tenant too, once it has no flow
//! left), so a stream of one-off tenant names costs memory only while they are active.
//!
//! Bands are made for the configured priorities, then for each other priority a request names,
//! up to [`MAX_BANDS`] of those: past that, a request whose priority has no band queues in the nearest
//! band below it (the lowest band when none is below), keeping its own priority for shedding
//! and preemption, and is counted in `priorities_folded`. A gateway that takes the priority
//! from a client's header thus keeps its bands, and its metrics, bounded.
//!
//! Complexity: with n queued requests, F flows in a band and B bands, `enqueue`, `dispatch`,
//! `cancel` and `complete` cost O(log n + log F + B) plus O(log n) per request they evict;
//! `expire` costs O(B) plus O(log n) per expired request.
//!
//! Token and byte sums (running tokens, a flow's service, queued bytes) saturate at `u64::MAX`
//! instead of wrapping: each request may declare up to `u64::MAX`, so a few absurd ones would
//! otherwise wrap a sum to a small number. A saturated sum is an underestimate, never below 0,
//! and the running and queued sums are back at 0 once those requests end.

mod band;
pub mod config;
pub mod fairness;
mod heap;
mod key;
pub mod metrics;
pub mod ordering;
pub mod registry;
pub mod request;
pub mod saturation;
pub mod shedding;
mod slab;

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};
use std::mem;
use std::sync::Arc;

use hashbrown::{HashMap, HashSet};

use band::{Band, TenantId};
pub use config::{BandConfig, FlowConfig, Limits, PolicySpec, PreemptionConfig, ResolvedConfig};
use fairness::FlowIdx;
use metrics::{jain_index, BandMetrics, ControllerMetrics, FlowMetrics};
use ordering::OrderingInput;
pub use registry::PolicyRegistry;
use request::check_time;
pub use request::{FlowDecision, FlowError, FlowRequest, Outcome, RequestId};
pub use saturation::EndpointMetrics;
use saturation::{CeilingPolicy, InFlight, Saturation, SaturationDetector};
use shedding::SheddingPolicy;
use slab::{Chain, NewSlot, Slab, SlotState, NIL};

/// The most bands a controller makes besides the configured ones.
pub const MAX_BANDS: usize = 256;

/// Tenant names interned once, with each tenant's flow in every band it has used. The id of a
/// tenant whose flows were all reclaimed is reused, lowest first.
#[derive(Default)]
struct Tenants {
    names: Vec<Arc<str>>,
    ids: HashMap<Arc<str>, TenantId>,
    /// `flows[tenant][band]`: the tenant's flow in that band, or `NIL`.
    flows: Vec<Vec<FlowIdx>>,
    free: BinaryHeap<Reverse<TenantId>>,
}

impl Tenants {
    fn intern(&mut self, name: &str) -> TenantId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let shared: Arc<str> = Arc::from(name);
        let id = match self.free.pop() {
            Some(Reverse(id)) => {
                self.names[id as usize] = shared.clone();
                id
            }
            None => {
                self.names.push(shared.clone());
                self.flows.push(Vec::new());
                (self.names.len() - 1) as TenantId
            }
        };
        self.ids.insert(shared, id);
        id
    }

    fn shared(&self, name: &str) -> Arc<str> {
        match self.ids.get(name) {
            Some(&id) => self.names[id as usize].clone(),
            None => Arc::from(name),
        }
    }

    /// The tenant's flow in `band`, created there on first use.
    fn flow_in(&mut self, tenant: TenantId, band_index: u32, band: &mut Band) -> FlowIdx {
        let flows = &mut self.flows[tenant as usize];
        if let Some(&flow) = flows.get(band_index as usize) {
            if flow != NIL {
                return flow;
            }
        }
        if flows.len() <= band_index as usize {
            flows.resize(band_index as usize + 1, NIL);
        }
        let flow = band.add_flow(tenant, &self.names[tenant as usize]);
        flows[band_index as usize] = flow;
        flow
    }

    /// Forgets the tenant's flow in `band`, and the tenant once it has no flow left.
    fn drop_flow(&mut self, tenant: TenantId, band_index: u32) {
        let flows = &mut self.flows[tenant as usize];
        flows[band_index as usize] = NIL;
        if flows.iter().all(|&flow| flow == NIL) {
            flows.clear();
            self.ids.remove(&self.names[tenant as usize]);
            self.free.push(Reverse(tenant));
        }
    }

    fn is_live(&self, tenant: TenantId) -> bool {
        !self.flows[tenant as usize].is_empty()
    }

    /// Tenants with at least one flow.
    fn live_count(&self) -> usize {
        self.ids.len()
    }
}

/// A flow that turned idle at `since`; stale once the flow's idle generation moved on.
struct IdleMark {
    since: f64,
    band: u32,
    flow: FlowIdx,
    generation: u32,
}

/// What a capacity check allows.
enum Admission {
    Fits,
    /// Fits once these lower-priority queued slots are evicted.
    FitsAfterEvicting(Vec<u32>),
    Refused,
}

/// Victims named by `preemption_victims` and the pacing of the next decision.
#[derive(Default)]
struct Preemption {
    /// Running sheddable requests: lowest priority first, then newest dispatch first.
    candidates: BTreeSet<(i32, Reverse<u64>, RequestId)>,
    pending: HashSet<RequestId>,
    next_decision_at: f64,
}

/// The flow controller. `P` is an opaque payload carried from `enqueue` to the decision.
pub struct FlowController<P> {
    config: ResolvedConfig,
    registry: PolicyRegistry,
    buckets: Arc<[f64]>,
    bands: Vec<Band>,
    /// Band indexes from the highest priority down.
    band_order: Vec<u32>,
    band_of_priority: HashMap<i32, u32>,
    tenants: Tenants,
    /// Queued and running requests.
    slab: Slab<P>,
    /// Request id to slot.
    index: HashMap<RequestId, u32>,
    queued: u64,
    queued_bytes: u64,
    inflight: InFlight,
    detector: Box<dyn SaturationDetector>,
    ceilings: Box<dyn CeilingPolicy>,
    shedder: Box<dyn SheddingPolicy>,
    preemption: Preemption,
    /// Evictions that happened as a side effect (TTL during dispatch, preemption on arrival).
    evicted: Vec<FlowDecision<P>>,
    outcome_counts: [u64; Outcome::ALL.len()],
    clock: f64,
    next_seq: u64,
    /// No queued request expires before this time (a lower bound).
    next_expiry: f64,
    /// Flows that turned idle, oldest first (the clock never goes back).
    idle_flows: VecDeque<IdleMark>,
    flows_reclaimed: u64,
    /// Requests queued in another priority's band, [`MAX_BANDS`] being reached.
    priorities_folded: u64,
}

impl<P> FlowController<P> {
    /// A controller with the built-in policies.
    pub fn new(config: &FlowConfig) -> Result<Self, FlowError> {
        Self::with_registry(config, PolicyRegistry::builtin())
    }

    /// A controller from a JSON config (absent keys default, unknown keys are errors).
    pub fn from_json(text: &str) -> Result<Self, FlowError> {
        Self::new(&FlowConfig::from_json(text)?)
    }

    /// A controller whose policies come from `registry`.
    pub fn with_registry(config: &FlowConfig, registry: PolicyRegistry) -> Result<Self, FlowError> {
        let config = config.resolve(&registry)?;
        let detector = registry.saturation(&config.saturation)?.policy;
        let ceilings = registry.ceilings(&config.ceilings)?.policy;
        let shedder = registry.shedding(&config.shedding)?.policy;
        let buckets: Arc<[f64]> = Arc::from(config.wait_buckets_s.clone());
        let mut controller = FlowController {
            registry,
            buckets,
            bands: Vec::new(),
            band_order: Vec::new(),
            band_of_priority: HashMap::new(),
            tenants: Tenants::default(),
            slab: Slab::default(),
            index: HashMap::new(),
            queued: 0,
            queued_bytes: 0,
            inflight: InFlight::default(),
            detector,
            ceilings,
            shedder,
            preemption: Preemption::default(),
            evicted: Vec::new(),
            outcome_counts: [0; Outcome::ALL.len()],
            clock: f64::NEG_INFINITY,
            next_seq: 0,
            next_expiry: f64::INFINITY,
            idle_flows: VecDeque::new(),
            flows_reclaimed: 0,
            priorities_folded: 0,
            config,
        };
        let configured: Vec<i32> = controller.config.bands.keys().copied().collect();
        for priority in configured {
            controller.band_index(priority)?;
        }
        Ok(controller)
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ResolvedConfig {
        &self.config
    }

    /// Queued requests.
    pub fn len(&self) -> usize {
        self.queued as usize
    }

    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Dispatched requests not yet completed.
    pub fn running_len(&self) -> usize {
        self.inflight.requests as usize
    }

    fn state_of(&self, id: RequestId) -> Option<(u32, SlotState)> {
        self.index.get(&id).map(|&slot| (slot, self.slab.get(slot).state))
    }

    pub fn is_queued(&self, id: RequestId) -> bool {
        matches!(self.state_of(id), Some((_, SlotState::Queued)))
    }

    pub fn is_running(&self, id: RequestId) -> bool {
        matches!(self.state_of(id), Some((_, SlotState::Running)))
    }

    /// Side-effect evictions waiting in the outbox.
    pub fn evicted_len(&self) -> usize {
        self.evicted.len()
    }

    /// Takes the evictions that happened as side effects of `enqueue` (preempted queued
    /// requests) and `dispatch`/`enqueue`/`preemption_victims` (TTL), oldest first.
    pub fn drain_evicted(&mut self) -> Vec<FlowDecision<P>> {
        mem::take(&mut self.evicted)
    }

    /// Offers a request. `Ok(None)`: queued. `Ok(Some(decision))`: refused at the door
    /// (capacity, shedding or no endpoints), payload returned. Errors leave everything unchanged.
    pub fn enqueue(
        &mut self,
        request: FlowRequest<'_, P>,
        now: f64,
    ) -> Result<Option<FlowDecision<P>>, FlowError> {
        self.enqueue_ticketed(request, None, now)
    }

    /// [`enqueue`](Self::enqueue), the request keeping `ticket` while queued and running, so a
    /// caller releases exactly its own request with
    /// [`complete_ticketed`](Self::complete_ticketed) (ids may be used again once a request
    /// has ended; tickets are the caller's to keep unique).
    pub fn enqueue_ticketed(
        &mut self,
        request: FlowRequest<'_, P>,
        ticket: Option<u64>,
        now: f64,
    ) -> Result<Option<FlowDecision<P>>, FlowError> {
        request.validate()?;
        let now = check_time("now", now)?;
        if self.index.contains_key(&request.id) {
            return Err(FlowError::DuplicateRequest(request.id));
        }
        let now = self.advance(now);
        self.expire_to_outbox(now);
        let saturation = self.saturation_at(now);
        if saturation.no_endpoints {
            return Ok(Some(self.refuse(request, Outcome::RejectedNoEndpoints)));
        }
        if request.priority < 0 && self.shedder.shed(saturation.value) {
            return Ok(Some(self.refuse(request, Outcome::RejectedShed)));
        }
        let victims = match self.admission(request.priority, request.bytes) {
            Admission::Refused => return Ok(Some(self.refuse(request, Outcome::RejectedCapacity))),
            Admission::Fits => Vec::new(),
            Admission::FitsAfterEvicting(victims) => victims,
        };
        let band = self.band_index(request.priority)?;
        for victim in victims {
            if let Some(decision) = self.evict_slot(victim, Outcome::EvictedPreempted, now) {
                self.evicted.push(decision);
            }
        }
        self.insert(band, request, ticket, now);
        Ok(None)
    }

    /// The next request to send to an endpoint, or `None` when nothing is queued or the highest
    /// non-empty band is blocked by saturation (or there are no endpoints). Expired requests met
    /// on the way go to the eviction outbox.
    pub fn dispatch(&mut self, now: f64) -> Result<Option<FlowDecision<P>>, FlowError> {
        let now = self.advance(check_time("now", now)?);
        self.expire_to_outbox(now);
        let saturation = self.saturation_at(now);
        let Some(band) = self.top_nonempty_band() else {
            return Ok(None);
        };
        if Self::blocks(saturation, self.bands[band as usize].ceiling) {
            return Ok(None);
        }
        Ok(self.dispatch_from(band, now))
    }

    /// Removes a queued request (outcome `EvictedCancelled`); `None` when it is not queued.
    pub fn cancel(
        &mut self,
        id: RequestId,
        now: f64,
    ) -> Result<Option<FlowDecision<P>>, FlowError> {
        self.cancel_if(id, now, |_| true)
    }

    /// [`cancel`](Self::cancel), only when the queued request's payload passes `owns`; `None`
    /// otherwise, and nothing changes. Ids are unique among live requests only, so a caller
    /// whose request may have left the queue already (and its id been queued again since, by
    /// a retry or another caller) names its own request by the payload it gave: it then never
    /// cancels the later one.
    pub fn cancel_if(
        &mut self,
        id: RequestId,
        now: f64,
        owns: impl FnOnce(&P) -> bool,
    ) -> Result<Option<FlowDecision<P>>, FlowError> {
        let now = self.advance(check_time("now", now)?);
        match self.state_of(id) {
            Some((slot, SlotState::Queued))
                if self.slab.get(slot).payload.as_ref().is_some_and(owns) =>
            {
                Ok(self.evict_slot(slot, Outcome::EvictedCancelled, now))
            }
            _ => Ok(None),
        }
    }

    /// Evicts every queued request whose TTL has run out (`arrival + ttl_s <= now`).
    pub fn expire(&mut self, now: f64) -> Result<Vec<FlowDecision<P>>, FlowError> {
        let now = self.advance(check_time("now", now)?);
        let mut expired = Vec::new();
        self.expire_into(now, &mut expired);
        Ok(expired)
    }

    fn running_slot(&self, id: RequestId) -> Result<u32, FlowError> {
        match self.state_of(id) {
            Some((slot, SlotState::Running)) => Ok(slot),
            _ => Err(FlowError::UnknownRequest(id)),
        }
    }

    /// Service another router replica gave `tenant` at `priority` (replica sync): charged to
    /// the fairness policy of the tenant's flow in that band, so a tenant heavy on other
    /// replicas is not served as new here. A flow this controller does not have is not
    /// created (its first request starts it with the policy's catch-up rule); returns whether
    /// one was charged. Local service metrics are not changed.
    pub fn charge_remote(
        &mut self,
        tenant: &str,
        priority: i32,
        prompt_tokens: u64,
        output_tokens: u64,
        now: f64,
    ) -> Result<bool, FlowError> {
        let now = check_time("now", now)?;
        let now = self.advance(now);
        let (Some(&t), Some(b)) = (self.tenants.ids.get(tenant), self.existing_band(priority))
        else {
            return Ok(false);
        };
        let flow = self.tenants.flows[t as usize].get(b as usize).copied().unwrap_or(NIL);
        if flow == NIL {
            return Ok(false);
        }
        self.bands[b as usize].fairness.charge(flow, prompt_tokens, output_tokens, now);
        Ok(true)
    }

    /// Service given since the last call, per flow with any: `(tenant, priority, prompt
    /// tokens, output tokens)`, for replica sync to hand to the other replicas'
    /// [`FlowController::charge_remote`]. Service of a flow reclaimed in between is dropped.
    pub fn drain_service(&mut self) -> Vec<(Arc<str>, i32, u64, u64)> {
        let mut out = Vec::new();
        for band in &mut self.bands {
            let priority = band.priority;
            for flow in band.flows.iter_mut().filter(|f| f.live && f.unsynced != (0, 0)) {
                let (prompt, output) = std::mem::take(&mut flow.unsynced);
                out.push((
                    self.tenants.names[flow.tenant as usize].clone(),
                    priority,
                    prompt,
                    output,
                ));
            }
        }
        out
    }

    /// Charges output tokens of a running request to its flow as they stream.
    pub fn record_output(
        &mut self,
        id: RequestId,
        output_tokens: u64,
        now: f64,
    ) -> Result<(), FlowError> {
        self.record_output_for(id, None, output_tokens, now).map(|_| ())
    }

    /// [`record_output`](Self::record_output), only when the running request `id` was
    /// enqueued with `ticket` ([`enqueue_ticketed`](Self::enqueue_ticketed)). `Ok(false)`,
    /// charging nothing, when `id` runs for another enqueue (a stale handle, whose own request
    /// ended and whose id was dispatched again since). An id not running is
    /// [`FlowError::UnknownRequest`], as for `record_output`.
    pub fn record_output_ticketed(
        &mut self,
        id: RequestId,
        ticket: u64,
        output_tokens: u64,
        now: f64,
    ) -> Result<bool, FlowError> {
        self.record_output_for(id, Some(ticket), output_tokens, now)
    }

    fn record_output_for(
        &mut self,
        id: RequestId,
        ticket: Option<u64>,
        output_tokens: u64,
        now: f64,
    ) -> Result<bool, FlowError> {
        let now = check_time("now", now)?;
        let Some(slot) = self.running_slot_for(id, ticket)? else {
            return Ok(false);
        };
        let now = self.advance(now);
        self.charge_output(slot, output_tokens, now);
        Ok(true)
    }

    /// A running request finished (or was revoked); `output_tokens` not yet recorded are charged.
    pub fn complete(
        &mut self,
        id: RequestId,
        output_tokens: u64,
        now: f64,
    ) -> Result<(), FlowError> {
        self.complete_for(id, None, output_tokens, now).map(|_| ())
    }

    /// [`complete`](Self::complete), only when the running request `id` was enqueued with
    /// `ticket` ([`enqueue_ticketed`](Self::enqueue_ticketed)). `Ok(false)`, changing nothing,
    /// when `id` runs for another enqueue: a stale release, whose own request ended already
    /// and whose id was dispatched again since (a retry, another caller). An id not running
    /// is [`FlowError::UnknownRequest`], as for `complete`.
    pub fn complete_ticketed(
        &mut self,
        id: RequestId,
        ticket: u64,
        output_tokens: u64,
        now: f64,
    ) -> Result<bool, FlowError> {
        self.complete_for(id, Some(ticket), output_tokens, now)
    }

    fn complete_for(
        &mut self,
        id: RequestId,
        ticket: Option<u64>,
        output_tokens: u64,
        now: f64,
    ) -> Result<bool, FlowError> {
        let now = check_time("now", now)?;
        let Some(slot) = self.running_slot_for(id, ticket)? else {
            return Ok(false);
        };
        self.complete_slot(slot, output_tokens, now);
        Ok(true)
    }

    /// The slot of running request `id`; `None` when `ticket` is given and `id` runs for
    /// another enqueue (a stale handle). An id not running is [`FlowError::UnknownRequest`].
    fn running_slot_for(
        &self,
        id: RequestId,
        ticket: Option<u64>,
    ) -> Result<Option<u32>, FlowError> {
        let slot = self.running_slot(id)?;
        let current = ticket.is_none() || self.slab.get(slot).ticket == ticket;
        Ok(current.then_some(slot))
    }

    fn complete_slot(&mut self, slot: u32, output_tokens: u64, now: f64) {
        let now = self.advance(now);
        self.charge_output(slot, output_tokens, now);
        let running = self.slab.get(slot);
        let id = running.id;
        let (priority, dispatch_seq, tokens) = (running.priority, running.seq, running.tokens);
        let (band, flow) = (running.band, running.flow);
        self.bands[band as usize].flows[flow as usize].running -= 1;
        self.inflight.requests -= 1;
        self.inflight.tokens = self.inflight.tokens.saturating_sub(tokens);
        if priority < 0 {
            self.preemption.candidates.remove(&(priority, Reverse(dispatch_seq), id));
        }
        if self.preemption.pending.remove(&id) && self.preemption.pending.is_empty() {
            self.preemption.next_decision_at = now + self.config.preemption.pacing_s;
        }
        self.index.remove(&id);
        self.slab.release(slot);
        self.note_if_idle(band, flow, now);
    }

    /// Running sheddable requests to revoke because a higher band is blocked by saturation:
    /// lowest priority first, then newest dispatch, at most `max_victims`. No new victims are
    /// named until every named victim has completed and `pacing_s` has passed.
    pub fn preemption_victims(&mut self, now: f64) -> Result<Vec<RequestId>, FlowError> {
        let now = self.advance(check_time("now", now)?);
        let limit = self.config.preemption.max_victims as usize;
        if limit == 0 || !self.preemption.pending.is_empty() {
            return Ok(Vec::new());
        }
        if now < self.preemption.next_decision_at {
            return Ok(Vec::new());
        }
        self.expire_to_outbox(now);
        let saturation = self.saturation_at(now);
        let Some(band) = self.top_nonempty_band() else {
            return Ok(Vec::new());
        };
        let band = &self.bands[band as usize];
        if saturation.no_endpoints || saturation.value < band.ceiling {
            return Ok(Vec::new());
        }
        let victims: Vec<RequestId> = self
            .preemption
            .candidates
            .iter()
            .take_while(|(priority, _, _)| *priority < band.priority)
            .take(limit)
            .map(|&(_, _, id)| id)
            .collect();
        self.preemption.pending.extend(victims.iter().copied());
        Ok(victims)
    }

    /// Records an endpoint's load report (for the `utilization` detector).
    pub fn update_endpoint(
        &mut self,
        endpoint: &str,
        metrics: EndpointMetrics,
    ) -> Result<(), FlowError> {
        check_time("timestamp", metrics.timestamp)?;
        if !(metrics.kv_usage.is_finite() && (0.0..=1.0).contains(&metrics.kv_usage)) {
            return Err(FlowError::InvalidInput(format!(
                "kv_cache_usage of endpoint '{endpoint}' must be in [0, 1], got {}",
                metrics.kv_usage
            )));
        }
        self.detector.update_endpoint(endpoint, metrics);
        Ok(())
    }

    /// Forgets an endpoint; false when it was unknown.
    pub fn remove_endpoint(&mut self, endpoint: &str) -> bool {
        self.detector.remove_endpoint(endpoint)
    }

    /// The saturation gauge at `now`.
    pub fn saturation(&mut self, now: f64) -> Result<Saturation, FlowError> {
        let now = self.advance(check_time("now", now)?);
        Ok(self.saturation_at(now))
    }

    /// Jain's fairness index over the service tokens of the flows of band `priority`, or over
    /// tenants (all bands together) when `priority` is `None`.
    pub fn jain_index(&self, priority: Option<i32>) -> f64 {
        match priority {
            Some(p) => match self.existing_band(p) {
                Some(band) => jain_index(
                    self.bands[band as usize].live_flows().map(|(_, f)| f.service_tokens as f64),
                ),
                None => 1.0,
            },
            None => {
                let mut per_tenant = vec![0u64; self.tenants.names.len()];
                for (_, flow) in self.bands.iter().flat_map(|b| b.live_flows()) {
                    let tenant = &mut per_tenant[flow.tenant as usize];
                    *tenant = tenant.saturating_add(flow.service_tokens);
                }
                let live = per_tenant
                    .into_iter()
                    .enumerate()
                    .filter(|&(tenant, _)| self.tenants.is_live(tenant as TenantId));
                jain_index(live.map(|(_, s)| s as f64))
            }
        }
    }

    /// A snapshot of every gauge and counter.
    pub fn metrics(&mut self, now: f64) -> Result<ControllerMetrics, FlowError> {
        let now = self.advance(check_time("now", now)?);
        let saturation = self.saturation_at(now);
        let bands = self
            .band_order
            .iter()
            .map(|&b| {
                let band = &self.bands[b as usize];
                BandMetrics {
                    priority: band.priority,
                    ceiling: band.ceiling,
                    queued: band.queued,
                    queued_bytes: band.bytes,
                    flows: band.live_flows().count(),
                    dispatched: band.dispatched,
                    wait_s: band.wait_s.clone(),
                }
            })
            .collect();
        let flows = self
            .band_order
            .iter()
            .flat_map(|&b| {
                let band = &self.bands[b as usize];
                band.live_flows().map(move |(index, flow)| (band, index, flow))
            })
            .map(|(band, index, flow)| FlowMetrics {
                tenant: self.tenants.names[flow.tenant as usize].to_string(),
                priority: band.priority,
                queued: flow.len,
                queued_bytes: flow.bytes,
                dispatched: flow.dispatched,
                service_tokens: flow.service_tokens,
                fairness_counter: band.fairness.counter(index, now),
            })
            .collect();
        let outcomes = Outcome::ALL
            .iter()
            .map(|outcome| (outcome.name(), self.outcome_counts[outcome.index()]))
            .collect();
        Ok(ControllerMetrics {
            saturation: saturation.value,
            no_endpoints: saturation.no_endpoints,
            queued: self.queued,
            queued_bytes: self.queued_bytes,
            running: self.inflight.requests,
            running_tokens: self.inflight.tokens,
            outcomes,
            bands,
            flows,
            jain_index: self.jain_index(None),
            tenants: self.tenants.live_count(),
            flows_reclaimed: self.flows_reclaimed,
            priorities_folded: self.priorities_folded,
        })
    }

    /// How many requests ended in each outcome, in [`Outcome::ALL`] order.
    pub fn outcome_counts(&self) -> [u64; Outcome::ALL.len()] {
        self.outcome_counts
    }

    /// Moves the clock to `now` (never back) and reclaims the flows idle long enough by then.
    fn advance(&mut self, now: f64) -> f64 {
        self.clock = self.clock.max(now);
        self.reclaim_idle_flows(self.clock);
        self.clock
    }

    /// Tenants with at least one flow (reclaimed ones are gone).
    pub fn tenant_count(&self) -> usize {
        self.tenants.live_count()
    }

    /// Flows alive in every band together.
    pub fn flow_count(&self) -> usize {
        self.bands.iter().map(|band| band.live_flows().count()).sum()
    }

    /// Marks the flow for reclaim if it has nothing queued and nothing running.
    fn note_if_idle(&mut self, band: u32, flow: FlowIdx, now: f64) {
        if self.config.flow_idle_s.is_none() {
            return;
        }
        let queue = &mut self.bands[band as usize].flows[flow as usize];
        if !queue.is_idle() {
            return;
        }
        queue.idle_generation = queue.idle_generation.wrapping_add(1);
        let generation = queue.idle_generation;
        self.idle_flows.push_back(IdleMark { since: now, band, flow, generation });
    }

    fn reclaim_idle_flows(&mut self, now: f64) {
        let Some(idle_s) = self.config.flow_idle_s else {
            return;
        };
        while let Some(mark) = self.idle_flows.front() {
            if mark.since + idle_s > now {
                break;
            }
            let IdleMark { band, flow, generation, .. } = *mark;
            self.idle_flows.pop_front();
            let band_ref = &mut self.bands[band as usize];
            let queue = &band_ref.flows[flow as usize];
            // Stale: the flow got busy (and maybe idle again, with a newer mark) since.
            if !queue.live || queue.idle_generation != generation || !queue.is_idle() {
                continue;
            }
            let tenant = queue.tenant;
            band_ref.reclaim_flow(flow);
            self.tenants.drop_flow(tenant, band);
            self.flows_reclaimed += 1;
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn saturation_at(&mut self, now: f64) -> Saturation {
        self.detector.saturation(now, self.inflight)
    }

    fn blocks(saturation: Saturation, ceiling: f64) -> bool {
        saturation.no_endpoints || saturation.value >= ceiling
    }

    fn top_nonempty_band(&self) -> Option<u32> {
        self.band_order.iter().copied().find(|&b| self.bands[b as usize].queued > 0)
    }

    /// The band a request of `priority` joins if one exists: its own, or, [`MAX_BANDS`] more than
    /// the configured ones being made, the nearest band below it (the lowest when none is below).
    fn existing_band(&self, priority: i32) -> Option<u32> {
        if let Some(&band) = self.band_of_priority.get(&priority) {
            return Some(band);
        }
        if self.bands.len() < self.config.bands.len() + MAX_BANDS {
            return None;
        }
        // `band_order` runs from the highest priority down.
        let below =
            self.band_order.partition_point(|&b| self.bands[b as usize].priority > priority);
        self.band_order.get(below).or(self.band_order.last()).copied()
    }

    /// The band of `priority`, created (and every band's ceiling re-ranked) on first use, or
    /// another's past [`MAX_BANDS`] (counted).
    fn band_index(&mut self, priority: i32) -> Result<u32, FlowError> {
        if let Some(band) = self.existing_band(priority) {
            if self.bands[band as usize].priority != priority {
                self.priorities_folded += 1;
            }
            return Ok(band);
        }
        let settings = self.config.band(priority);
        let band = Band::new(priority, settings, &self.registry, self.buckets.clone())?;
        let index = self.bands.len() as u32;
        self.bands.push(band);
        self.band_of_priority.insert(priority, index);
        let position =
            self.band_order.partition_point(|&b| self.bands[b as usize].priority > priority);
        self.band_order.insert(position, index);
        for (rank, &b) in self.band_order.iter().enumerate() {
            let band = &mut self.bands[b as usize];
            band.ceiling = band.settings.ceiling.unwrap_or_else(|| self.ceilings.ceiling(rank));
        }
        Ok(index)
    }

    /// Band and global limits; over the global limits, lower-priority queued requests (lowest
    /// band first, newest first) may make room.
    fn admission(&self, priority: i32, bytes: u64) -> Admission {
        let band_fits = match self.existing_band(priority) {
            Some(band) => self.bands[band as usize].fits(bytes),
            None => Band::fits_limits(self.config.band(priority), 0, 0, bytes),
        };
        if !band_fits {
            return Admission::Refused;
        }
        let global = &self.config.global;
        let over_requests =
            global.max_requests.map_or(0, |max| (self.queued + 1).saturating_sub(max));
        let over_bytes = global
            .max_bytes
            .map_or(0, |max| self.queued_bytes.saturating_add(bytes).saturating_sub(max));
        if over_requests == 0 && over_bytes == 0 {
            return Admission::Fits;
        }
        if !self.config.preemption.evict_queued {
            return Admission::Refused;
        }
        let (mut freed_requests, mut freed_bytes) = (0u64, 0u64);
        let mut victims = Vec::new();
        // Below the band the request joins (its own priority's, or the one it is folded into).
        let joins =
            self.existing_band(priority).map_or(priority, |b| self.bands[b as usize].priority);
        let lower_bands = self
            .band_order
            .iter()
            .rev()
            .map(|&b| &self.bands[b as usize])
            .take_while(|band| band.priority < joins);
        for band in lower_bands {
            let mut slot = band.arrivals.tail;
            while slot != NIL {
                if freed_requests >= over_requests && freed_bytes >= over_bytes {
                    return Admission::FitsAfterEvicting(victims);
                }
                victims.push(slot);
                freed_requests += 1;
                freed_bytes = freed_bytes.saturating_add(self.slab.get(slot).bytes);
                slot = self.slab.prev(slot, Chain::Band);
            }
        }
        if freed_requests >= over_requests && freed_bytes >= over_bytes {
            Admission::FitsAfterEvicting(victims)
        } else {
            Admission::Refused
        }
    }

    fn insert(
        &mut self,
        band_index: u32,
        request: FlowRequest<'_, P>,
        ticket: Option<u64>,
        now: f64,
    ) {
        let tenant = self.tenants.intern(request.tenant);
        let seq = self.next_seq();
        let band = &mut self.bands[band_index as usize];
        let flow = self.tenants.flow_in(tenant, band_index, band);
        let input = OrderingInput {
            arrival: now,
            deadline: request.deadline,
            ttft_target: request.ttft_target,
        };
        let slot = self.slab.insert(NewSlot {
            id: request.id,
            seq,
            arrival: now,
            key: band.ordering.key(&input),
            tokens: request.tokens,
            bytes: request.bytes,
            band: band_index,
            flow,
            priority: request.priority,
            payload: request.payload,
            ticket,
        });
        band.push(&mut self.slab, slot);
        if let Some(ttl) = band.settings.ttl_s {
            self.next_expiry = self.next_expiry.min(now + ttl);
        }
        self.queued += 1;
        self.queued_bytes = self.queued_bytes.saturating_add(request.bytes);
        self.index.insert(request.id, slot);
    }

    fn refuse(&mut self, request: FlowRequest<'_, P>, outcome: Outcome) -> FlowDecision<P> {
        self.outcome_counts[outcome.index()] += 1;
        FlowDecision {
            id: request.id,
            outcome,
            priority: request.priority,
            tenant: self.tenants.shared(request.tenant),
            tokens: request.tokens,
            bytes: request.bytes,
            waited_s: 0.0,
            payload: request.payload,
        }
    }

    /// The decision for a slot leaving the queue; takes its payload.
    fn decision(&mut self, slot: u32, outcome: Outcome, now: f64) -> Option<FlowDecision<P>> {
        let entry = self.slab.get_mut(slot);
        let payload = entry.payload.take()?;
        let band = &self.bands[entry.band as usize];
        let tenant = band.flows[entry.flow as usize].tenant;
        self.outcome_counts[outcome.index()] += 1;
        Some(FlowDecision {
            id: entry.id,
            outcome,
            priority: entry.priority,
            tenant: self.tenants.names[tenant as usize].clone(),
            tokens: entry.tokens,
            bytes: entry.bytes,
            waited_s: now - entry.arrival,
            payload,
        })
    }

    /// Removes a queued slot with an eviction outcome.
    fn evict_slot(&mut self, slot: u32, outcome: Outcome, now: f64) -> Option<FlowDecision<P>> {
        let entry = self.slab.get(slot);
        let (id, band, flow, bytes) = (entry.id, entry.band, entry.flow, entry.bytes);
        self.bands[band as usize].remove(&mut self.slab, slot, None);
        self.queued -= 1;
        self.queued_bytes = self.queued_bytes.saturating_sub(bytes);
        let decision = self.decision(slot, outcome, now);
        self.index.remove(&id);
        self.slab.release(slot);
        self.note_if_idle(band, flow, now);
        decision
    }

    fn dispatch_from(&mut self, band_index: u32, now: f64) -> Option<FlowDecision<P>> {
        let band = &mut self.bands[band_index as usize];
        let slot = band.next(&self.slab)?;
        let entry = self.slab.get(slot);
        let (tokens, bytes, arrival, priority, id, flow) =
            (entry.tokens, entry.bytes, entry.arrival, entry.priority, entry.id, entry.flow);
        band.remove(&mut self.slab, slot, Some((tokens, now)));
        band.flows[flow as usize].running += 1;
        band.wait_s.record(now - arrival);
        self.queued -= 1;
        self.queued_bytes = self.queued_bytes.saturating_sub(bytes);
        let dispatch_seq = self.next_seq();
        let decision = self.decision(slot, Outcome::Dispatched, now);
        let entry = self.slab.get_mut(slot);
        entry.state = SlotState::Running;
        entry.seq = dispatch_seq;
        self.inflight.requests += 1;
        self.inflight.tokens = self.inflight.tokens.saturating_add(tokens);
        if priority < 0 {
            self.preemption.candidates.insert((priority, Reverse(dispatch_seq), id));
        }
        decision
    }

    fn charge_output(&mut self, slot: u32, output_tokens: u64, now: f64) {
        let entry = self.slab.get(slot);
        let band = &mut self.bands[entry.band as usize];
        let flow = &mut band.flows[entry.flow as usize];
        flow.service_tokens = flow.service_tokens.saturating_add(output_tokens);
        flow.unsynced.1 = flow.unsynced.1.saturating_add(output_tokens);
        band.fairness.charge(entry.flow, 0, output_tokens, now);
    }

    fn expire_to_outbox(&mut self, now: f64) {
        if now < self.next_expiry {
            return;
        }
        let mut outbox = mem::take(&mut self.evicted);
        self.expire_into(now, &mut outbox);
        self.evicted = outbox;
    }

    /// Evicts expired requests band by band, oldest first; within a band arrival order is
    /// expiry order because the band's TTL is one number.
    fn expire_into(&mut self, now: f64, out: &mut Vec<FlowDecision<P>>) {
        let mut next_expiry = f64::INFINITY;
        for b in 0..self.bands.len() {
            let Some(ttl) = self.bands[b].settings.ttl_s else {
                continue;
            };
            loop {
                let oldest = self.bands[b].arrivals.head;
                if oldest == NIL {
                    break;
                }
                let expires_at = self.slab.get(oldest).arrival + ttl;
                if expires_at > now {
                    next_expiry = next_expiry.min(expires_at);
                    break;
                }
                if let Some(decision) = self.evict_slot(oldest, Outcome::EvictedTtl, now) {
                    out.push(decision);
                }
            }
        }
        self.next_expiry = next_expiry;
    }

    /// Heap slots held (queued, running and free), for memory reports.
    pub fn slots_allocated(&self) -> usize {
        self.slab.capacity()
    }
}

#[cfg(test)]
mod tests;
