//! Token slices: time-sliced decoding with a per-request budget tracker and a switch-cost model.
//!
//! A long response is decoded in slices of a few hundred tokens; between two slices the
//! scheduler may let waiting work through. Each slice after the first is a new completion call
//! that sends the prompt plus the tokens generated so far; if the request's KV was evicted
//! meanwhile, that context is recomputed. [`SliceTracker`] keeps the budget of every sliced
//! request and decides, at each slice boundary, whether ending the slice pays for itself.
//!
//! # Algorithm / Complexity
//!
//! Per request: slice budget `min(quantum(level), max_tokens - generated)`, tokens in the
//! current slice and in total, slices used, context (`prompt + generated`), the endpoint holding
//! its KV, priority and level. Levels come from a [`SlicePolicy`] (fixed slices, or a skip-join
//! MLFQ with doubling quanta, demotion after a used quantum and promotion of paused requests
//! that waited too long).
//!
//! At a boundary of request R (priority weight `w_R = priority_base ** p_R`, next slice
//! `x_R = min(quantum(level'), remaining)`, context `C`, on endpoint E with decode step `t`):
//! - finished (end of sequence, stop, budget spent) -> **Finish**;
//! - nobody waiting -> **Continue** (an unsaturated system pays nothing for slicing);
//! - otherwise the yield lets through `L`, the longest head of the waiting list (in dispatch
//!   order, at least one) whose slices `x_i = min(quantum(level_i), expected_i)` fit in `x_R`:
//!   - benefit `B = t * x_R * sum_{i in L} w_i` (each of them starts R's slice earlier);
//!   - yield cost `w_R * (t * sum x_i + recompute / prefill_E + requeue_delay)`, with
//!     `recompute = min(C, max(p_evict * C, tail))` tokens,
//!     `p_evict = clamp((sum_{i in L}(context_i + x_i) - free_kv_E) / C, 0, 1)` and `tail` the
//!     last KV block, which a continuation recomputes even with nothing evicted
//!     ([`SwitchCostModel::recompute_tokens`]);
//!   - migrate cost to an endpoint E' with nobody waiting and room for `C + x_R` (one taken
//!     out with [`SliceTracker::remove_endpoint`] is none until it is reported again):
//!     `w_R * (C / prefill_E' + requeue_delay)` (full recompute, no pause);
//!   - the cheaper of yield and the best migration is taken iff `B` exceeds its cost
//!     (**Yield** or **Migrate**), else **Continue**. Ties go to yield (KV affinity).
//!
//! This is Smith's exchange argument (weighted shortest processing time) applied to one batch
//! slot for one slice, with the switch cost charged to the request that yields. Cost: one hash
//! lookup, `O(|L|)` for the waiting head and `O(endpoints)` for migration targets (scanned only
//! when someone waits); no allocation. Every other operation is `O(1)` except
//! [`SliceTracker::promote`], `O(tracked requests)`.
//!
//! Comparison: llm-d's experimental chunked decode continues every chunk on the same decoder
//! and never weighs a cost; vLLM preempts by recompute with no cost model.

pub mod assembler;
pub mod cost;
pub mod policy;

use std::sync::Arc;

use hashbrown::HashMap;
use thiserror::Error;

pub use assembler::{Api, AssemblerOptions, AssemblyError, SliceAssembler, SliceUsage};
pub use cost::{
    evict_probability, CostModelDims, GpuSpec, ModelDims, SwitchCostModel, DEFAULT_BLOCK_SIZE,
};
pub use policy::{build_policy, policy_defaults, FixedSlice, Mlfq, SlicePolicy, REGISTRY};

/// A request's id as the caller numbers it.
pub type RequestKey = u64;

type EndpointId = u32;

/// Why a slice operation was refused. Every refusal leaves the tracker unchanged.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SliceError {
    #[error("unknown slice policy {name:?}; known: {known}")]
    UnknownPolicy { name: String, known: String },
    #[error("bad {what} parameters: {reason}")]
    BadParams { what: String, reason: String },
    #[error("unknown request {0}")]
    UnknownRequest(RequestKey),
    #[error("request {0} is already tracked")]
    DuplicateRequest(RequestKey),
    #[error("unknown endpoint {0:?}")]
    UnknownEndpoint(String),
    #[error("request {key} is {actual}; this needs it {expected}")]
    WrongPhase { key: RequestKey, expected: &'static str, actual: &'static str },
    #[error("request {key}: {tokens} tokens exceed the {left} left in its slice")]
    SliceOverrun { key: RequestKey, tokens: u32, left: u32 },
    #[error("request {key} is not at a slice boundary: {left} tokens left in its slice")]
    NotAtBoundary { key: RequestKey, left: u32 },
    #[error("invalid {name}: {reason}")]
    InvalidValue { name: String, reason: String },
}

fn invalid(name: impl Into<String>, reason: impl Into<String>) -> SliceError {
    SliceError::InvalidValue { name: name.into(), reason: reason.into() }
}

/// What happens after a slice boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Keep decoding on the same endpoint: the next slice starts at once.
    Continue,
    /// End the slice; the continuation re-enters the queue at (priority, level) and is routed
    /// with affinity to the endpoint holding its KV.
    Yield,
    /// End the slice; the continuation goes to another endpoint, which recomputes the context.
    Migrate,
    /// The response is complete; the tracker forgets the request.
    Finish,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Continue => "continue",
            Action::Yield => "yield",
            Action::Migrate => "migrate",
            Action::Finish => "finish",
        }
    }
}

/// A request waiting for a batch slot, as the flow controller sees it (dispatch order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitingRequest {
    pub priority: i32,
    /// Its slice level (a new request: [`SliceTracker::entry_level`]).
    pub level: u8,
    /// KV tokens it needs on admission (prompt, or prompt + generated for a continuation).
    pub context_tokens: u32,
    /// Expected remaining output tokens (>= 1).
    pub expected_tokens: u32,
}

/// The outcome of [`SliceTracker::decide`], with the numbers that produced it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub action: Action,
    /// The request's level after this slice; with `priority` the flow-control key.
    pub level: u8,
    pub priority: i32,
    /// Where the next slice should run: the endpoint holding the KV, or the migration target.
    /// None after Finish.
    pub endpoint: Option<Arc<str>>,
    /// Tokens of the next slice (0 after Finish).
    pub next_slice_tokens: u32,
    pub context_tokens: u64,
    pub generated_tokens: u32,
    pub slices: u32,
    /// Weighted seconds the waiting work gains if this slice ends (0 when nobody waits).
    pub benefit_s: f64,
    /// Weighted seconds yielding costs this request (0 when nobody waits).
    pub yield_cost_s: f64,
    /// Weighted seconds of the best migration; None when no endpoint qualifies or nobody waits.
    pub migrate_cost_s: Option<f64>,
    /// Expected share of the context evicted before resumption if it yields.
    pub evict_probability: f64,
}

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Phase {
    /// Decoding a slice.
    Running,
    /// Between slices, waiting to resume since `since` (seconds, the caller's clock).
    Paused { since: f64 },
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Running => "running",
            Phase::Paused { .. } => "paused",
        }
    }
}

/// The start of a slice: its level and token budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceStart {
    pub level: u8,
    pub slice_tokens: u32,
}

/// A snapshot of one tracked request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestView {
    pub priority: i32,
    pub level: u8,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub generated_tokens: u32,
    pub slice_generated: u32,
    pub slice_tokens: u32,
    pub slices: u32,
    pub context_tokens: u64,
    /// The endpoint holding its KV (where it last ran).
    pub endpoint: Arc<str>,
    /// Where its next slice should run (differs from `endpoint` after a migration decision).
    pub route_to: Arc<str>,
    pub phase: Phase,
}

/// The load of one endpoint as last reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointLoad {
    /// KV cache size in tokens (vLLM: `num_gpu_blocks * block_size`).
    pub kv_capacity_tokens: f64,
    /// Used share of the KV cache (vLLM `vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Requests waiting at the endpoint (vLLM `vllm:num_requests_waiting`).
    pub waiting: u32,
    pub prefill_tokens_per_s: f64,
    pub decode_step_s: f64,
}

impl EndpointLoad {
    /// Free KV tokens: `(1 - kv_usage) * kv_capacity_tokens`.
    pub fn kv_free_tokens(&self) -> f64 {
        (1.0 - self.kv_usage) * self.kv_capacity_tokens
    }
}

/// A load report; a field left None keeps its previous value (the cost model's default for a
/// new endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EndpointReport {
    pub kv_usage: f64,
    pub waiting: u32,
    pub kv_capacity_tokens: Option<f64>,
    pub prefill_tokens_per_s: Option<f64>,
    pub decode_step_s: Option<f64>,
}

#[derive(Debug)]
struct Endpoint {
    name: Arc<str>,
    load: EndpointLoad,
    kv_free_tokens: f64,
    /// Taken out ([`SliceTracker::remove_endpoint`]): no migration target, not listed, until
    /// reported again. Its id stays while requests still name it, then its slot is freed.
    gone: bool,
    /// References from tracked requests (their `endpoint` and `route_to`, one each).
    users: u32,
}

#[derive(Debug, Clone, Copy)]
struct Request {
    priority: i32,
    level: u8,
    prompt_tokens: u32,
    max_tokens: u32,
    generated: u32,
    slice_generated: u32,
    slice_tokens: u32,
    slices: u32,
    endpoint: EndpointId,
    route_to: EndpointId,
    phase: Phase,
}

impl Request {
    fn context_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.generated)
    }

    fn remaining(&self) -> u32 {
        self.max_tokens - self.generated
    }
}

/// How ending a slice compares with continuing.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tradeoff {
    action: Action,
    target: EndpointId,
    benefit_s: f64,
    yield_cost_s: f64,
    migrate_cost_s: Option<f64>,
    evict_probability: f64,
}

/// Per-request slice budgets and the boundary decision. Not internally locked: share it behind
/// a mutex (the Python binding does).
#[derive(Debug)]
pub struct SliceTracker {
    policy: Box<dyn SlicePolicy>,
    cost: SwitchCostModel,
    requests: HashMap<RequestKey, Request>,
    /// Slots by id; a freed one (gone, no user, its name out of `endpoint_ids`) is reused.
    endpoints: Vec<Endpoint>,
    endpoint_ids: HashMap<Arc<str>, EndpointId>,
    /// Freed slots, reused by the next new name: the tracker holds the endpoints known now
    /// and those requests still name, not every name ever reported (discovery renames pods
    /// at every rollout).
    free: Vec<EndpointId>,
}

impl SliceTracker {
    pub fn new(policy: Box<dyn SlicePolicy>, cost: SwitchCostModel) -> Self {
        Self {
            policy,
            cost,
            requests: HashMap::new(),
            endpoints: Vec::new(),
            endpoint_ids: HashMap::new(),
            free: Vec::new(),
        }
    }

    /// A tracker with policy `name` built from an object of parameters over its defaults.
    pub fn from_config(
        policy: &str,
        params: &serde_json::Value,
        cost: SwitchCostModel,
    ) -> Result<Self, SliceError> {
        Ok(Self::new(build_policy(policy, params)?, cost.validated()?))
    }

    pub fn policy(&self) -> &dyn SlicePolicy {
        self.policy.as_ref()
    }

    pub fn cost_model(&self) -> &SwitchCostModel {
        &self.cost
    }

    /// Number of tracked requests (running or paused).
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub fn contains(&self, key: RequestKey) -> bool {
        self.requests.contains_key(&key)
    }

    /// The level a new request with `prompt_tokens` enters at (for the flow controller's key).
    pub fn entry_level(&self, prompt_tokens: u32) -> u8 {
        self.policy.entry_level(prompt_tokens)
    }

    /// Slice length at `level` under the policy.
    pub fn quantum(&self, level: u8) -> Result<u32, SliceError> {
        let levels = self.policy.levels();
        if level >= levels {
            return Err(invalid(
                "level",
                format!("{level} is not below the policy's {levels} levels"),
            ));
        }
        Ok(self.policy.quantum(level))
    }

    /// Names of the known endpoints (those taken out left out), in the order they were first
    /// reported.
    pub fn endpoint_names(&self) -> Vec<Arc<str>> {
        self.endpoints.iter().filter(|e| !e.gone).map(|e| e.name.clone()).collect()
    }

    /// The last load of endpoint `name` (None when unknown or taken out).
    pub fn endpoint_load(&self, name: &str) -> Option<EndpointLoad> {
        let endpoint = &self.endpoints[*self.endpoint_ids.get(name)? as usize];
        (!endpoint.gone).then_some(endpoint.load)
    }

    /// Takes endpoint `name` out (it left the engine set, or routing: drained, down, its
    /// breaker open): it is no migration target any more, whatever load it last reported, and
    /// is not listed. Requests whose slices ran there keep it; once none names it, it is
    /// forgotten (unknown to [`Self::admit`] and [`Self::resume`]) and its slot is reused.
    /// [`Self::set_endpoint`] brings it back with a fresh load (the cost model's for what the
    /// report leaves out). False when it was unknown or already out.
    pub fn remove_endpoint(&mut self, name: &str) -> bool {
        let Some(&id) = self.endpoint_ids.get(name) else { return false };
        let endpoint = &mut self.endpoints[id as usize];
        if std::mem::replace(&mut endpoint.gone, true) {
            return false;
        }
        if endpoint.users == 0 {
            self.free_slot(id);
        }
        true
    }

    /// Forgets the name of slot `id` (gone, no user) and keeps the slot for reuse.
    fn free_slot(&mut self, id: EndpointId) {
        let endpoint = &mut self.endpoints[id as usize];
        debug_assert!(endpoint.gone && endpoint.users == 0);
        let name = std::mem::replace(&mut endpoint.name, Arc::from(""));
        self.endpoint_ids.remove(&name);
        self.free.push(id);
    }

    /// One more request reference to slot `id`.
    fn hold(&mut self, id: EndpointId) {
        self.endpoints[id as usize].users += 1;
    }

    /// One request reference to slot `id` fewer; frees a slot taken out when it was the last.
    fn release(&mut self, id: EndpointId) {
        let endpoint = &mut self.endpoints[id as usize];
        endpoint.users -= 1;
        if endpoint.users == 0 && endpoint.gone {
            self.free_slot(id);
        }
    }

    /// Releases both references of a request that leaves the tracker.
    fn release_request(&mut self, request: &Request) {
        self.release(request.endpoint);
        self.release(request.route_to);
    }

    /// Adds endpoint `name` or updates its load (bringing it back when taken out).
    pub fn set_endpoint(&mut self, name: &str, report: EndpointReport) -> Result<(), SliceError> {
        let previous = self.endpoint_load(name);
        let base = previous.unwrap_or(EndpointLoad {
            kv_capacity_tokens: self.cost.kv_capacity_tokens,
            kv_usage: 0.0,
            waiting: 0,
            prefill_tokens_per_s: self.cost.prefill_tokens_per_s,
            decode_step_s: self.cost.decode_step_s,
        });
        let load = EndpointLoad {
            kv_capacity_tokens: report.kv_capacity_tokens.unwrap_or(base.kv_capacity_tokens),
            kv_usage: report.kv_usage,
            waiting: report.waiting,
            prefill_tokens_per_s: report.prefill_tokens_per_s.unwrap_or(base.prefill_tokens_per_s),
            decode_step_s: report.decode_step_s.unwrap_or(base.decode_step_s),
        };
        validate_load(&load)?;
        let kv_free_tokens = load.kv_free_tokens();
        match self.endpoint_ids.get(name) {
            Some(&id) => {
                let endpoint = &mut self.endpoints[id as usize];
                endpoint.load = load;
                endpoint.kv_free_tokens = kv_free_tokens;
                endpoint.gone = false;
            }
            None => {
                let name: Arc<str> = Arc::from(name);
                let endpoint =
                    Endpoint { name: name.clone(), load, kv_free_tokens, gone: false, users: 0 };
                let id = match self.free.pop() {
                    Some(id) => {
                        self.endpoints[id as usize] = endpoint;
                        id
                    }
                    None => {
                        let id = EndpointId::try_from(self.endpoints.len())
                            .map_err(|_| invalid("endpoint", "too many endpoints"))?;
                        self.endpoints.push(endpoint);
                        id
                    }
                };
                self.endpoint_ids.insert(name, id);
            }
        }
        Ok(())
    }

    fn endpoint_id(&self, name: &str) -> Result<EndpointId, SliceError> {
        self.endpoint_ids
            .get(name)
            .copied()
            .ok_or_else(|| SliceError::UnknownEndpoint(name.to_string()))
    }

    /// Starts tracking a request whose first slice runs on `endpoint`.
    pub fn admit(
        &mut self,
        key: RequestKey,
        prompt_tokens: u32,
        max_tokens: u32,
        priority: i32,
        endpoint: &str,
    ) -> Result<SliceStart, SliceError> {
        if self.requests.contains_key(&key) {
            return Err(SliceError::DuplicateRequest(key));
        }
        if max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1"));
        }
        let endpoint = self.endpoint_id(endpoint)?;
        let level = self.policy.entry_level(prompt_tokens);
        let slice_tokens = self.policy.quantum(level).min(max_tokens);
        self.hold(endpoint);
        self.hold(endpoint);
        self.requests.insert(
            key,
            Request {
                priority,
                level,
                prompt_tokens,
                max_tokens,
                generated: 0,
                slice_generated: 0,
                slice_tokens,
                slices: 1,
                endpoint,
                route_to: endpoint,
                phase: Phase::Running,
            },
        );
        Ok(SliceStart { level, slice_tokens })
    }

    fn running(&mut self, key: RequestKey) -> Result<&mut Request, SliceError> {
        let request = self.requests.get_mut(&key).ok_or(SliceError::UnknownRequest(key))?;
        match request.phase {
            Phase::Running => Ok(request),
            other => Err(SliceError::WrongPhase { key, expected: "running", actual: other.name() }),
        }
    }

    /// Counts `tokens` generated in the current slice; returns the tokens left in it.
    pub fn record_tokens(&mut self, key: RequestKey, tokens: u32) -> Result<u32, SliceError> {
        let request = self.running(key)?;
        let left = request.slice_tokens - request.slice_generated;
        if tokens > left {
            return Err(SliceError::SliceOverrun { key, tokens, left });
        }
        request.slice_generated += tokens;
        request.generated += tokens;
        Ok(left - tokens)
    }

    /// The decision at a slice boundary of `key` (see the module docs). `finished` says the
    /// engine ended the response (end of sequence or a stop string). `waiting` lists the
    /// requests a yield would let through, in dispatch order. `now` stamps a pause.
    pub fn decide(
        &mut self,
        key: RequestKey,
        finished: bool,
        waiting: &[WaitingRequest],
        now: f64,
    ) -> Result<Decision, SliceError> {
        check_time(now)?;
        self.check_waiting(waiting)?;
        let request = *self.running(key)?;
        let done = finished || request.generated >= request.max_tokens;
        if !done && request.slice_generated < request.slice_tokens {
            let left = request.slice_tokens - request.slice_generated;
            return Err(SliceError::NotAtBoundary { key, left });
        }
        if done {
            self.requests.remove(&key);
            self.release_request(&request);
            return Ok(self.finish_decision(&request));
        }
        let level = self.policy.level_after_quantum(request.level);
        let next_slice_tokens = self.policy.quantum(level).min(request.remaining());
        let trade = self.weigh(&request, next_slice_tokens, waiting);
        let stored = self.requests.get_mut(&key).ok_or(SliceError::UnknownRequest(key))?;
        stored.level = level;
        stored.slice_generated = 0;
        stored.slice_tokens = next_slice_tokens;
        let route_to = stored.route_to;
        match trade.action {
            Action::Continue => stored.slices += 1,
            _ => {
                stored.phase = Phase::Paused { since: now };
                stored.route_to = trade.target;
                self.hold(trade.target);
                self.release(route_to);
            }
        }
        Ok(Decision {
            action: trade.action,
            level,
            priority: request.priority,
            endpoint: Some(self.endpoints[trade.target as usize].name.clone()),
            next_slice_tokens,
            context_tokens: request.context_tokens(),
            generated_tokens: request.generated,
            slices: request.slices,
            benefit_s: trade.benefit_s,
            yield_cost_s: trade.yield_cost_s,
            migrate_cost_s: trade.migrate_cost_s,
            evict_probability: trade.evict_probability,
        })
    }

    fn finish_decision(&self, request: &Request) -> Decision {
        Decision {
            action: Action::Finish,
            level: request.level,
            priority: request.priority,
            endpoint: None,
            next_slice_tokens: 0,
            context_tokens: request.context_tokens(),
            generated_tokens: request.generated,
            slices: request.slices,
            benefit_s: 0.0,
            yield_cost_s: 0.0,
            migrate_cost_s: None,
            evict_probability: 0.0,
        }
    }

    fn check_waiting(&self, waiting: &[WaitingRequest]) -> Result<(), SliceError> {
        let levels = self.policy.levels();
        for (i, w) in waiting.iter().enumerate() {
            if w.level >= levels {
                let reason = format!("level {} is not below the policy's {levels} levels", w.level);
                return Err(invalid(format!("waiting[{i}]"), reason));
            }
            if w.expected_tokens == 0 {
                return Err(invalid(format!("waiting[{i}]"), "expected_tokens must be at least 1"));
            }
        }
        Ok(())
    }

    /// Compares ending the slice (yield or migrate) with continuing; see the module docs.
    fn weigh(&self, request: &Request, next_slice: u32, waiting: &[WaitingRequest]) -> Tradeoff {
        let here = request.endpoint;
        if waiting.is_empty() {
            return Tradeoff {
                action: Action::Continue,
                target: here,
                benefit_s: 0.0,
                yield_cost_s: 0.0,
                migrate_cost_s: None,
                evict_probability: 0.0,
            };
        }
        let endpoint = &self.endpoints[here as usize];
        let x_r = f64::from(next_slice);
        let (mut let_through, mut weight_sum, mut demand) = (0.0, 0.0, 0.0);
        for (i, w) in waiting.iter().enumerate() {
            let x_i = f64::from(self.policy.quantum(w.level).min(w.expected_tokens));
            if i > 0 && let_through + x_i > x_r {
                break;
            }
            let_through += x_i;
            weight_sum += self.cost.weight(w.priority);
            demand += f64::from(w.context_tokens) + x_i;
        }
        let step_s = endpoint.load.decode_step_s;
        let benefit_s = step_s * x_r * weight_sum;
        let context = request.context_tokens() as f64;
        let evict_probability = evict_probability(context, demand, endpoint.kv_free_tokens);
        let w_r = self.cost.weight(request.priority);
        let switch_s =
            self.cost.switch_s(evict_probability, context, endpoint.load.prefill_tokens_per_s);
        let yield_cost_s = w_r * (step_s * let_through + switch_s);
        let migration = self.best_migration(here, context + x_r, context, w_r);
        let (action, target, cost) = match migration {
            Some((id, cost)) if cost < yield_cost_s => (Action::Migrate, id, cost),
            _ => (Action::Yield, here, yield_cost_s),
        };
        let (action, target) =
            if benefit_s > cost { (action, target) } else { (Action::Continue, here) };
        Tradeoff {
            action,
            target,
            benefit_s,
            yield_cost_s,
            migrate_cost_s: migration.map(|(_, cost)| cost),
            evict_probability,
        }
    }

    /// The cheapest endpoint other than `here`, not taken out, with nobody waiting and `room`
    /// free KV tokens.
    fn best_migration(
        &self,
        here: EndpointId,
        room: f64,
        context: f64,
        weight: f64,
    ) -> Option<(EndpointId, f64)> {
        let mut best: Option<(EndpointId, f64)> = None;
        for (id, endpoint) in (0..).zip(&self.endpoints) {
            if id == here
                || endpoint.gone
                || endpoint.load.waiting > 0
                || endpoint.kv_free_tokens < room
            {
                continue;
            }
            let cost =
                weight * self.cost.switch_s(1.0, context, endpoint.load.prefill_tokens_per_s);
            if best.is_none_or(|(_, c)| cost < c) {
                best = Some((id, cost));
            }
        }
        best
    }

    /// Starts the next slice of a paused request on `endpoint` (where the router sent it).
    pub fn resume(&mut self, key: RequestKey, endpoint: &str) -> Result<SliceStart, SliceError> {
        let endpoint = self.endpoint_id(endpoint)?;
        let request = self.requests.get_mut(&key).ok_or(SliceError::UnknownRequest(key))?;
        if request.phase == Phase::Running {
            return Err(SliceError::WrongPhase { key, expected: "paused", actual: "running" });
        }
        let slice_tokens = self.policy.quantum(request.level).min(request.remaining());
        let before = (request.endpoint, request.route_to);
        request.phase = Phase::Running;
        request.endpoint = endpoint;
        request.route_to = endpoint;
        request.slices += 1;
        request.slice_generated = 0;
        request.slice_tokens = slice_tokens;
        let level = request.level;
        // Held before the old ones go: a slot taken out that the request stays on is kept.
        self.hold(endpoint);
        self.hold(endpoint);
        self.release(before.0);
        self.release(before.1);
        Ok(SliceStart { level, slice_tokens })
    }

    /// Promotes to level 0 every paused request that has waited `promote_after_s` or longer by
    /// `now`; returns the promoted `(key, new level)` pairs sorted by key, so the flow
    /// controller can re-key its queue entries.
    pub fn promote(&mut self, now: f64) -> Result<Vec<(RequestKey, u8)>, SliceError> {
        check_time(now)?;
        let Some(after) = self.policy.promote_after_s() else {
            return Ok(Vec::new());
        };
        let mut promoted = Vec::new();
        for (&key, request) in self.requests.iter_mut() {
            if let Phase::Paused { since } = request.phase {
                if request.level > 0 && now - since >= after {
                    request.level = 0;
                    request.slice_tokens = self.policy.quantum(0).min(request.remaining());
                    promoted.push((key, 0));
                }
            }
        }
        promoted.sort_unstable();
        Ok(promoted)
    }

    /// Stops tracking `key` (cancelled or failed); returns whether it was tracked.
    pub fn remove(&mut self, key: RequestKey) -> bool {
        match self.requests.remove(&key) {
            Some(request) => {
                self.release_request(&request);
                true
            }
            None => false,
        }
    }

    /// A snapshot of request `key`.
    pub fn get(&self, key: RequestKey) -> Option<RequestView> {
        let request = self.requests.get(&key)?;
        Some(RequestView {
            priority: request.priority,
            level: request.level,
            prompt_tokens: request.prompt_tokens,
            max_tokens: request.max_tokens,
            generated_tokens: request.generated,
            slice_generated: request.slice_generated,
            slice_tokens: request.slice_tokens,
            slices: request.slices,
            context_tokens: request.context_tokens(),
            endpoint: self.endpoints[request.endpoint as usize].name.clone(),
            route_to: self.endpoints[request.route_to as usize].name.clone(),
            phase: request.phase,
        })
    }
}

fn check_time(now: f64) -> Result<(), SliceError> {
    if now.is_finite() {
        Ok(())
    } else {
        Err(invalid("now", "must be a finite number of seconds"))
    }
}

fn validate_load(load: &EndpointLoad) -> Result<(), SliceError> {
    if !(0.0..=1.0).contains(&load.kv_usage) {
        return Err(invalid("kv_cache_usage", "must be in [0, 1]"));
    }
    for (name, value) in [
        ("kv_capacity_tokens", load.kv_capacity_tokens),
        ("prefill_tokens_per_s", load.prefill_tokens_per_s),
        ("decode_step_s", load.decode_step_s),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(invalid(name, "must be a positive finite number"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
