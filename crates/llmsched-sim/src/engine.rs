//! The discrete-event serving simulation in Rust: the same model as the reference engine
//! (`llmsched.reference.sim`, in pure Python), step for step, calling the real routing core
//! ([`Router`] over an [`EndpointPool`] and a [`PrefixIndex`] fed by the replicas' KV events)
//! directly instead of through Python.
//!
//! Algorithm: one heap of events ordered by (time, sequence) — stream arrivals, follow-up
//! arrivals, the end of a replica's step (or closed-form decode run) and delayed KV-event
//! batches. Each replica is vLLM V1's scheduler over a paged, prefix-cached [`KvCore`]
//! (chunked prefill under a token budget, recompute preemption, decode runs summed in closed
//! form); see `llmsched/reference/sim/replica.py` for the per-step rules, which this file
//! follows line for line so that both engines produce identical results for the same plan (the
//! reference engine is the oracle of the equivalence tests). Cost per event: O(log events +
//! blocks touched).
//!
//! KV use: a decode run's blocks are allocated at its end, but what a replica holds at any
//! instant is known (a decoding request takes a block every `block_size` steps, at known
//! steps): a replica in a run republishes it before each routing decision when it grew (its
//! count kept from one decision to the next until the run reaches a step that allocates a
//! block: O(1) per replica per decision), and the peak and time integral of blocks held are
//! accounted per block added (O(blocks added) per run), as vLLM's `kv_cache_usage_perc` would
//! read at every instant.
//!
//! Flow control: with a [`FlowSetup`], arrivals are offered to the flow core
//! ([`FlowController`], the one `llmsched.flow` wraps) in simulated time; what it dispatches is
//! routed, what it refuses or lets expire is rejected, and every replica's metrics feed its
//! saturation detector. Dispatching can happen inside a replica's step (a finish frees a slot):
//! a request routed to the replica being stepped waits in its inbox and joins its queue before
//! the next schedule, as in the reference engine.
//!
//! Prefill/decode disaggregation: the first `prefill_replicas` replicas only prefill (their pool
//! endpoints have role `prefill`, the others `decode`); a request the router splits is
//! prefilled there, its KV (the blocks the decode replica does not hold) moves at
//! `transfer_bw` after `transfer_latency_s`, and the decode replica admits it with all but its
//! last prompt token computed. Preempted there, it is readmitted as a local request: its blocks
//! were freed, and what its prefix cache no longer holds is recomputed as prefill on the decode
//! replica (vLLM loads a remote prefill's KV once).
//!
//! Token slices: with a [`SliceTracker`], a request decodes in slices; at each slice boundary
//! the tracker weighs the replica's queue against the switch cost and the request continues in
//! the batch, or yields (back to the end of its replica's queue, its KV left cached) or
//! migrates (to another replica, which recomputes it).
//!
//! Policies outside the engine: with a [`PolicyHook`] (a Python `Policy` object, through the
//! bindings) the hook routes instead of the router, called where the reference engine calls its
//! policy (see [`crate::policy`]); the router replica's prefix index is still fed (its skipped
//! batches are counted as with a router).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kv_cache::{IdEvent, KvCore, KvError};
use crate::plan::{Contents, OpenRequest, Plan, PlanError};
use crate::policy::{check_pick, PolicyFailure, PolicyHook, RequestView};
use crate::stepmodel::{DecodeRun, StepModel, StepWork};
use crate::stream::{Feed, Published};
use crate::workload::WorkloadError;
use hashbrown::HashMap;
use llmsched_core::flow::{
    EndpointMetrics, FlowConfig, FlowController, FlowError, FlowRequest, PolicyRegistry,
};
use llmsched_core::prefix_index::{IndexConfig, IndexError, PrefixIndex, Tier, WorkerKey};
use llmsched_core::routing::replica_sync::{ReplicaSync, SyncOptions};
use llmsched_core::routing::{
    Endpoint, EndpointPool, MetricsUpdate, RequestMeta, Role, Router, RouterConfig, RouterOptions,
    RoutingError, StaleMode, StalePolicy, Ticket,
};
use llmsched_core::slices::{
    Action, EndpointReport, SliceError, SliceTracker, WaitingRequest as SliceWaiting,
};

/// Engine and scenario settings (the fields of `EngineConfig` and `ScenarioConfig`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    pub replicas: usize,
    pub block_size: u32,
    pub kv_blocks: u32,
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: usize,
    /// `scheduling: priority` (else first come, first served).
    pub priority_scheduling: bool,
    #[serde(rename = "metrics_delay_s")]
    pub metrics_delay: f64,
    #[serde(rename = "kv_events_delay_s")]
    pub kv_events_delay: f64,
    #[serde(rename = "kv_sample_s")]
    pub kv_sample: f64,
    #[serde(rename = "max_time_s")]
    pub max_time: Option<f64>,
    pub seed: u64,
    /// Router replicas in front of the engines (requests spread over them in turn), each with
    /// its own pool and prefix index fed by every engine's metrics and KV events.
    #[serde(default = "one")]
    pub router_replicas: usize,
    /// With several router replicas: None, each decides on its own state (shared scrapes and KV
    /// events only); a delay, replica sync ([`llmsched_core::routing::replica_sync`]) delivers
    /// each replica's records, sessions and in-flight counts to the others that much later.
    #[serde(default, rename = "router_sync_delay_s")]
    pub router_sync_delay: Option<f64>,
    /// Replicas `0..prefill_replicas` only prefill (0: every replica serves both phases).
    #[serde(default)]
    pub prefill_replicas: usize,
    /// KV transfer from a prefill to a decode replica: bytes per second, fixed latency, and the
    /// KV bytes of one token.
    #[serde(default = "transfer_bw")]
    pub transfer_bw: f64,
    #[serde(default, rename = "transfer_latency_s")]
    pub transfer_latency: f64,
    #[serde(default)]
    pub kv_bytes_per_token: u64,
}

fn transfer_bw() -> f64 {
    25e9
}

fn one() -> usize {
    1
}

#[cfg(test)]
thread_local! {
    /// Tests: the prefix indexes get every block (no [`World::lean`]), to compare against.
    pub(crate) static FULL_INDEX: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the prefix indexes fed every block.
#[cfg(test)]
pub(crate) fn with_full_index<T>(f: impl FnOnce() -> T) -> T {
    FULL_INDEX.with(|full| full.set(true));
    let out = f();
    FULL_INDEX.with(|full| full.set(false));
    out
}

/// The most router replicas one simulation may have.
pub const MAX_ROUTER_REPLICAS: usize = 1024;

/// The most replicas one simulation may have.
pub const MAX_REPLICAS: usize = 65_536;
/// The most KV blocks all replicas may have together (about 20 bytes each, allocated up front).
pub const MAX_TOTAL_KV_BLOCKS: u64 = 1 << 28;

/// Errors that stop a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Routing(#[from] RoutingError),
    #[error(transparent)]
    Flow(#[from] FlowError),
    #[error(transparent)]
    Slices(#[from] SliceError),
    /// A [`PolicyHook`] call failed (raised, or answered something unusable).
    #[error(transparent)]
    Policy(#[from] PolicyFailure),
    /// A plan built while it is simulated could not be built.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
}

/// Flow control in front of the router: the flow core's configuration and each priority's
/// time-to-first-token target (the scenario's SLO, for the `slo-deadline` ordering).
#[derive(Debug, Clone)]
pub struct FlowSetup {
    pub config: FlowConfig,
    pub ttft_targets: Vec<(i64, f64)>,
}

/// The flow core driven in simulated time (the reference engine's `FlowGate`).
struct Gate {
    core: FlowController<usize>,
    /// Requests offered and not yet dispatched, refused, expired or evicted (as counted by
    /// the reference engine: evictions leave the count when they are drained).
    queued: i64,
    ttft: HashMap<i64, f64>,
    /// The endpoint names the core knows the replicas by.
    names: Vec<String>,
}

const WAITING: u8 = 0;
const PREFILL: u8 = 1;
const DECODE: u8 = 2;
const DONE: u8 = 3;

/// A request's state (the fields of Python's `Request` the engine uses).
#[derive(Debug)]
struct Req {
    id: u64,
    arrival: f64,
    prompt_len: u64,
    output_len: u64,
    hashes: (usize, usize),
    /// Its leading blocks other requests may hold too; the rest are private (see
    /// [`World::lean`]).
    shared: usize,
    tenant: i64,
    priority: i64,
    session: Option<usize>,
    session_name: Option<String>,
    turn: usize,
    phase: u8,
    target: u64,
    computed: u64,
    generated: u64,
    high_water: u64,
    join_step: u64,
    join_gen: u64,
    kv_started: bool,
    version: u64,
    dispatched: f64,
    first_token: f64,
    finish: f64,
    cached_tokens: i64,
    prefilled: u64,
    recomputed: u64,
    preemptions: u64,
    /// Preempted since its last admission: the next admission is a readmission, which vLLM
    /// counts apart from its prefix-cache queries. Cleared at admission, so a later token
    /// slice's continuation (a new call) is counted.
    readmitting: bool,
    rejected: bool,
    ticket: Option<Ticket>,
    /// The router replica that routed it.
    router: usize,
    /// Split by the router: the replica that decodes it after its prefill elsewhere.
    decode_replica: Option<usize>,
    /// Its KV arrived from a prefill replica (all but the last prompt token are computed at
    /// its next admission). Cleared when it is preempted: its blocks are freed, and vLLM loads
    /// the remote KV once (the connector clears `do_remote_prefill`), so the readmission is a
    /// local request that recomputes what its prefix cache no longer holds.
    kv_ready: bool,
    /// Token slices: this call stops when `generated` reaches it (0: no slices).
    call_end: u64,
    /// Tokens generated when the current slice began.
    slice_start: u64,
    /// Where a yielded or migrated slice continues.
    slice_endpoint: usize,
    /// The replica whose queue it joined last, and (split) where it was prefilled: what a
    /// [`PolicyHook`] sees.
    replica: Option<usize>,
    prefill_replica: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    StreamArrival,
    Arrival,
    Step,
    KvFeed,
    Sync,
    Transfer,
    /// A yielded or migrated slice joins the queue of `slice_endpoint`.
    Requeue,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    time: f64,
    seq: u64,
    kind: Kind,
    obj: usize,
    version: u64,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    /// Reversed: `BinaryHeap` pops the earliest (time, seq) first.
    fn cmp(&self, other: &Self) -> Ordering {
        other.time.total_cmp(&self.time).then(other.seq.cmp(&self.seq))
    }
}

/// A scheduled finish: (decode step, request id, version, request slot), min-heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Finish(u64, u64, u64, usize);
impl PartialOrd for Finish {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Finish {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.0, other.1, other.2).cmp(&(self.0, self.1, self.2))
    }
}

/// Engine counters of one replica (summed into the result).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub prefill_tokens: u64,
    pub recomputed_tokens: u64,
    pub hit_tokens: u64,
    pub query_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
}

struct Replica {
    id: usize,
    /// A prefill-only replica of a P/D split.
    prefill_only: bool,
    kv: KvCore,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    prefilling: Vec<usize>,
    decode_n: u64,
    decode_ctx: u64,
    decode_step: u64,
    finishes: BinaryHeap<Finish>,
    version: u64,
    busy: bool,
    stepping: bool,
    step_start: f64,
    /// When the last step ended: a step that starts later starts on an idle replica.
    last_end: f64,
    chunks: Vec<(usize, u64)>,
    run: Option<DecodeRun>,
    run_steps: u64,
    counters: Counters,
    /// KV use over time, in blocks (see [`Replica::kv_observe`]): the blocks held since
    /// `kv_since`, the integral of blocks held over time until then, and the peak.
    kv_held: u64,
    kv_since: f64,
    kv_area: f64,
    kv_peak: u64,
    /// What the last scrape of the decode run in flight found: (the run's `version`, the
    /// blocks it had added, the elapsed seconds from which it adds more). The blocks a run
    /// adds change only at known steps, so a scrape before then reads them here in O(1).
    scraped: Option<(u64, u64, f64)>,
}

/// One finished (or refused) request, in the order requests left the simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct DoneRecord {
    pub id: u64,
    pub arrival: f64,
    pub dispatched: f64,
    pub first_token: f64,
    pub finish: f64,
    pub prompt_len: u64,
    pub output_len: u64,
    pub generated: u64,
    pub cached_tokens: i64,
    pub prefilled: u64,
    pub recomputed: u64,
    pub preemptions: u64,
    pub tenant: i64,
    pub priority: i64,
    pub session: Option<usize>,
    pub turn: usize,
    pub rejected: bool,
}

/// A replica's state when the simulation ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaEnd {
    pub counters: Counters,
    pub kv_requests: usize,
    pub kv_usage: f64,
    pub running: usize,
    pub waiting: usize,
    pub decode_n: u64,
    pub decode_ctx: u64,
    /// Over the run: the peak KV use, and the mean over `[0, now]` weighted by time (the
    /// blocks held at every instant, a decode run's growth included).
    pub kv_peak: f64,
    pub kv_mean: f64,
}

/// What a simulation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOutput {
    pub done: Vec<DoneRecord>,
    pub replicas: Vec<ReplicaEnd>,
    /// Per replica: (time, KV use) samples.
    pub kv_trace: Vec<Vec<(f64, f64)>>,
    /// Time inside the routing core (decisions, commits, first-token and finish accounting).
    pub decision: Duration,
    /// Time feeding metrics to the pool and KV events to the index.
    pub feed: Duration,
    pub feed_skipped: u64,
    pub now: f64,
    /// Replica-sync batches published by the router replicas, and their bytes.
    pub sync_batches: u64,
    pub sync_bytes: u64,
    /// Token slices that yielded or migrated.
    pub slice_switches: u64,
    /// Requests that arrived (session turns included): each is in `done` or, in a run that
    /// `max_time_s` cut off, was still waiting, queued or running.
    pub arrived: u64,
}

/// One router replica: its own pool, index and router, and its end of replica sync.
struct RouterReplica {
    pool: Arc<EndpointPool>,
    index: Arc<PrefixIndex>,
    router: Router,
    sync: Option<ReplicaSync>,
}

/// The parts of the simulation a replica calls back into.
struct World<'p> {
    cfg: SimConfig,
    model: StepModel,
    /// Sessions (a plan built while it runs has none).
    plan: &'p Plan<'p>,
    /// The open requests, block hashes, their content ids (the KV caches') and each id's
    /// hash: the whole plan's, or what its builder has published so far.
    open: &'p [OpenRequest],
    hashes: &'p [u64],
    ids: &'p [u32],
    unique: &'p [u64],
    builder: Option<&'p Feed<'p>>,
    /// Where each open request's private blocks begin, and each session turn's.
    private_from: &'p [u32],
    turn_private: &'p [Vec<u32>],
    /// The prefix indexes leave out every request's private blocks (no other request holds
    /// them, so no match reaches them): its routing record stops before them and their KV
    /// events are dropped. Every match, and so every decision, is unchanged; only tree sizes
    /// are not, so not with a picker that reads them, nor with KV events delayed (a delayed
    /// batch may fail to apply and be counted) or replica sync (its batches carry the records).
    lean: bool,
    /// The private contents seen so far (a bit per content id), with `lean`.
    private: Vec<u64>,
    bs: u64,
    now: f64,
    heap: BinaryHeap<Event>,
    seq: u64,
    reqs: Vec<Req>,
    next_id: u64,
    stream_next: usize,
    sessions_started: usize,
    session_turn: Vec<usize>,
    done: Vec<usize>,
    pending_metrics: Vec<VecDeque<(f64, u32, u32, f64)>>,
    kv_trace: Vec<Vec<(f64, f64)>>,
    next_kv_sample: Vec<f64>,
    /// The KV use each replica published last.
    published: Vec<f64>,
    feeds: Vec<Option<(usize, Vec<IdEvent>)>>,
    /// A KV event's blocks as hashes (reused from event to event).
    event_hashes: Vec<u64>,
    decision: Duration,
    feed: Duration,
    feed_skipped: u64,
    routers: Vec<RouterReplica>,
    next_router: usize,
    /// Sync batches in flight: (from router, bytes), delivered by a `Sync` event.
    syncs: Vec<Option<(usize, Vec<u8>)>>,
    sync_batches: u64,
    sync_bytes: u64,
    keys: Vec<WorkerKey>,
    /// The replicas; one being stepped (or scheduled) is out of its slot meanwhile.
    replicas: Vec<Option<Box<Replica>>>,
    /// Requests routed to a replica while it was out of its slot, in order.
    inbox: Vec<Vec<usize>>,
    gate: Option<Gate>,
    slices: Option<SliceTracker>,
    slice_switches: u64,
    arrived: u64,
    /// Routes instead of the router when set.
    policy: Option<Box<dyn PolicyHook>>,
}

/// Runs one scenario under one routing configuration: `router_config` builds each router
/// replica's configuration (plugins keep state, so every replica gets its own).
pub fn simulate(
    cfg: SimConfig,
    model: StepModel,
    router_config: &dyn Fn() -> Result<RouterConfig, RoutingError>,
    plan: &Plan<'_>,
    flow: Option<&FlowSetup>,
    slices: Option<SliceTracker>,
) -> Result<SimOutput, SimError> {
    with_source(plan, |src| {
        Simulation::new(cfg, model, router_config, src, flow, slices, None)?.run()
    })
}

/// Runs `f` on `plan` as the engine reads it (its contents numbered here when it has none).
fn with_source<T>(
    plan: &Plan<'_>,
    f: impl FnOnce(Source<'_>) -> Result<T, SimError>,
) -> Result<T, SimError> {
    plan.validate()?;
    let numbered;
    let contents = match plan.contents.as_deref() {
        Some(c) => c,
        None => {
            numbered = Contents::number(&plan.hashes);
            &numbered
        }
    };
    let private = plan.private_from(contents.ids(), contents.unique().len());
    f(Source {
        plan,
        published: Published {
            open: &plan.open,
            hashes: &plan.hashes,
            ids: contents.ids(),
            unique: contents.unique(),
            private_from: &private.open,
        },
        turn_private: &private.turns,
        feed: None,
        requests: plan.expected_requests(),
    })
}

/// [`simulate`] on an open-loop plan being built: `feed` publishes its requests as they are
/// built (`lines` in all; see [`crate::stream`]).
pub(crate) fn simulate_fed(
    cfg: SimConfig,
    model: StepModel,
    router_config: &dyn Fn() -> Result<RouterConfig, RoutingError>,
    feed: &Feed<'_>,
    lines: usize,
    flow: Option<&FlowSetup>,
    slices: Option<SliceTracker>,
) -> Result<SimOutput, SimError> {
    let plan = Plan::default();
    let src = Source {
        plan: &plan,
        published: Published::default(),
        turn_private: &[],
        feed: Some(feed),
        requests: lines,
    };
    Simulation::new(cfg, model, router_config, src, flow, slices, None)?.run()
}

/// The plan as the engine reads it.
struct Source<'p> {
    plan: &'p Plan<'p>,
    published: Published<'p>,
    /// Per session, per turn: where its private blocks begin.
    turn_private: &'p [Vec<u32>],
    feed: Option<&'p Feed<'p>>,
    /// Requests the plan makes.
    requests: usize,
}

/// [`simulate`] with `policy` routing every request instead of the router (one router
/// replica; its prefix index is still fed, `router_config` builds it).
pub fn simulate_with_policy(
    cfg: SimConfig,
    model: StepModel,
    router_config: &dyn Fn() -> Result<RouterConfig, RoutingError>,
    plan: &Plan<'_>,
    flow: Option<&FlowSetup>,
    slices: Option<SliceTracker>,
    policy: Box<dyn PolicyHook>,
) -> Result<SimOutput, SimError> {
    with_source(plan, |src| {
        Simulation::new(cfg, model, router_config, src, flow, slices, Some(policy))?.run()
    })
}

struct Simulation<'p> {
    world: World<'p>,
}

impl<'p> Simulation<'p> {
    fn new(
        cfg: SimConfig,
        model: StepModel,
        router_config: &dyn Fn() -> Result<RouterConfig, RoutingError>,
        src: Source<'p>,
        flow: Option<&FlowSetup>,
        mut slices: Option<SliceTracker>,
        policy: Option<Box<dyn PolicyHook>>,
    ) -> Result<Self, SimError> {
        let plan = src.plan;
        if policy.is_some() && cfg.router_replicas != 1 {
            return Err(SimError::Config(
                "router_replicas needs a router configuration, not a Policy object".into(),
            ));
        }
        if cfg.replicas == 0 || cfg.block_size == 0 || cfg.max_num_seqs == 0 {
            return Err(SimError::Config(
                "replicas, block_size and max_num_seqs must be >= 1".into(),
            ));
        }
        let total_blocks = cfg.replicas as u64 * u64::from(cfg.kv_blocks);
        if cfg.replicas > MAX_REPLICAS || total_blocks > MAX_TOTAL_KV_BLOCKS {
            return Err(SimError::Config(format!(
                "{} replicas of {} KV blocks exceed the simulator's bounds ({MAX_REPLICAS} \
                 replicas, {MAX_TOTAL_KV_BLOCKS} blocks in all)",
                cfg.replicas, cfg.kv_blocks
            )));
        }
        if !(cfg.kv_sample > 0.0 && cfg.metrics_delay >= 0.0 && cfg.kv_events_delay >= 0.0) {
            return Err(SimError::Config("kv_sample must be > 0 and delays >= 0".into()));
        }
        if !(1..=MAX_ROUTER_REPLICAS).contains(&cfg.router_replicas) {
            return Err(SimError::Config(format!(
                "router_replicas must be 1 to {MAX_ROUTER_REPLICAS}, got {}",
                cfg.router_replicas
            )));
        }
        if cfg.prefill_replicas >= cfg.replicas {
            return Err(SimError::Config(
                "prefill_replicas must leave at least one decode replica".into(),
            ));
        }
        if !(cfg.transfer_bw > 0.0 && cfg.transfer_latency >= 0.0) {
            return Err(SimError::Config(
                "transfer_bw must be > 0 and transfer_latency_s >= 0".into(),
            ));
        }
        if cfg.router_sync_delay.is_some_and(|d| !(d.is_finite() && d >= 0.0)) {
            return Err(SimError::Config("router_sync_delay_s must be finite and >= 0".into()));
        }
        let keys: Vec<WorkerKey> = (0..cfg.replicas).map(|i| WorkerKey::Int(i as i64)).collect();
        let mut routers = Vec::with_capacity(cfg.router_replicas);
        let mut lean = cfg.kv_events_delay == 0.0
            && (cfg.router_replicas == 1 || cfg.router_sync_delay.is_none());
        #[cfg(test)]
        {
            lean &= !FULL_INDEX.with(std::cell::Cell::get);
        }
        for k in 0..cfg.router_replicas {
            let index = Arc::new(PrefixIndex::new(IndexConfig {
                block_size: cfg.block_size as usize,
                seed: cfg.seed,
                ..IndexConfig::default()
            })?);
            let pool = Arc::new(EndpointPool::new(StalePolicy {
                mode: StaleMode::Ignore,
                ..StalePolicy::default()
            })?);
            for (i, key) in keys.iter().enumerate() {
                let mut endpoint = Endpoint::new(key.clone());
                if cfg.prefill_replicas > 0 {
                    endpoint.role =
                        Some(if i < cfg.prefill_replicas { Role::Prefill } else { Role::Decode });
                }
                pool.upsert(endpoint);
            }
            // Each replica its own seed, as separate processes would draw.
            let seed = cfg.seed.wrapping_add(k as u64);
            let options = RouterOptions { seed, ..RouterOptions::default() };
            let config = router_config()?;
            lean &= !config.reads_tree_size();
            let router = Router::new(pool.clone(), index.clone(), config, options)?;
            let sync = (cfg.router_replicas > 1 && cfg.router_sync_delay.is_some()).then(|| {
                // Replicas never die here: counts never expire.
                let options = SyncOptions { load_ttl: f64::INFINITY, ..SyncOptions::default() };
                router.replica_sync(format!("router-{k}"), k as u64, options)
            });
            routers.push(RouterReplica { pool, index, router, sync });
        }
        // A bound on the distinct contents (the caches' id tables grow to it on demand).
        let contents = match src.feed {
            Some(feed) => feed.blocks(),
            None => src.published.unique.len(),
        };
        let mut replicas = Vec::with_capacity(cfg.replicas);
        for id in 0..cfg.replicas {
            replicas.push(Some(Box::new(Replica {
                id,
                prefill_only: id < cfg.prefill_replicas,
                kv: KvCore::new(cfg.kv_blocks, cfg.block_size, contents)?,
                waiting: VecDeque::new(),
                running: Vec::new(),
                prefilling: Vec::new(),
                decode_n: 0,
                decode_ctx: 0,
                decode_step: 0,
                finishes: BinaryHeap::new(),
                version: 0,
                busy: false,
                stepping: false,
                step_start: 0.0,
                last_end: f64::NEG_INFINITY,
                chunks: Vec::new(),
                run: None,
                run_steps: 0,
                counters: Counters::default(),
                kv_held: 0,
                kv_since: 0.0,
                kv_area: 0.0,
                kv_peak: 0,
                scraped: None,
            })));
        }
        let n = cfg.replicas;
        let gate = match flow {
            None => None,
            Some(setup) => {
                let mut core =
                    FlowController::with_registry(&setup.config, PolicyRegistry::builtin())?;
                let names: Vec<String> = (0..n).map(|i| i.to_string()).collect();
                // Every replica starts idle (the reference engine reports them so at time 0).
                for name in &names {
                    let idle =
                        EndpointMetrics { waiting: 0, running: 0, kv_usage: 0.0, timestamp: 0.0 };
                    core.update_endpoint(name, idle)?;
                }
                let ttft = setup.ttft_targets.iter().copied().collect();
                Some(Gate { core, queued: 0, ttft, names })
            }
        };
        if let Some(tracker) = slices.as_mut() {
            for i in 0..n {
                let idle = EndpointReport {
                    kv_usage: 0.0,
                    waiting: 0,
                    kv_capacity_tokens: None,
                    prefill_tokens_per_s: None,
                    decode_step_s: None,
                };
                tracker.set_endpoint(&i.to_string(), idle)?;
            }
        }
        let world = World {
            bs: u64::from(cfg.block_size),
            cfg,
            model,
            plan,
            open: src.published.open,
            hashes: src.published.hashes,
            ids: src.published.ids,
            unique: src.published.unique,
            builder: src.feed,
            private_from: src.published.private_from,
            turn_private: src.turn_private,
            lean,
            private: Vec::new(),
            now: 0.0,
            heap: BinaryHeap::new(),
            seq: 0,
            reqs: Vec::with_capacity(src.requests),
            next_id: 0,
            stream_next: 0,
            sessions_started: 0,
            session_turn: vec![0; plan.sessions.len()],
            done: Vec::with_capacity(src.requests),
            pending_metrics: vec![VecDeque::new(); n],
            kv_trace: vec![Vec::new(); n],
            next_kv_sample: vec![0.0; n],
            published: vec![0.0; n],
            feeds: Vec::new(),
            event_hashes: Vec::new(),
            decision: Duration::ZERO,
            feed: Duration::ZERO,
            feed_skipped: 0,
            routers,
            next_router: 0,
            syncs: Vec::new(),
            sync_batches: 0,
            sync_bytes: 0,
            keys,
            replicas,
            inbox: vec![Vec::new(); n],
            gate,
            slices,
            slice_switches: 0,
            arrived: 0,
            policy,
        };
        Ok(Simulation { world })
    }

    fn run(mut self) -> Result<SimOutput, SimError> {
        self.world.next_arrival()?;
        let limit = self.world.cfg.max_time;
        while let Some(ev) = self.world.heap.pop() {
            if limit.is_some_and(|l| ev.time > l) {
                break;
            }
            if !ev.time.is_finite() {
                // Otherwise requests finish at inf (or the routing core refuses the clock).
                return Err(SimError::Config(format!(
                    "simulated time left the finite range: a {:?} event at {} s (a step, a KV \
                     transfer or a think time too long: see the step model, pd.transfer_bw and \
                     the workload's times)",
                    ev.kind, ev.time
                )));
            }
            self.world.now = ev.time;
            match ev.kind {
                Kind::Step => self.world.step_end(ev.obj, ev.version, ev.time)?,
                Kind::StreamArrival => {
                    self.world.next_arrival()?;
                    self.world.arrive(ev.obj, ev.time)?;
                }
                Kind::Arrival => self.world.arrive(ev.obj, ev.time)?,
                Kind::KvFeed => {
                    if let Some((rid, events)) = self.world.feeds[ev.obj].take() {
                        self.world.apply_kv_events(rid, events)?;
                    }
                }
                Kind::Sync => {
                    if let Some((from, batch)) = self.world.syncs[ev.obj].take() {
                        self.world.deliver_sync(from, &batch, ev.time)?;
                    }
                }
                Kind::Requeue => {
                    let r = ev.obj;
                    let target = self.world.reqs[r].slice_endpoint;
                    self.world.enqueue(target, r, ev.time)?;
                }
                Kind::Transfer => {
                    let r = ev.obj;
                    let Some(decode) = self.world.reqs[r].decode_replica else {
                        return Err(SimError::Config(
                            "a KV transfer without its decode replica".into(),
                        ));
                    };
                    self.world.enqueue(decode, r, ev.time)?;
                }
            }
        }
        Ok(self.output())
    }

    fn output(self) -> SimOutput {
        let w = self.world;
        let done = w
            .done
            .iter()
            .map(|&r| {
                let q = &w.reqs[r];
                DoneRecord {
                    id: q.id,
                    arrival: q.arrival,
                    dispatched: q.dispatched,
                    first_token: q.first_token,
                    finish: q.finish,
                    prompt_len: q.prompt_len,
                    output_len: q.output_len,
                    generated: q.generated,
                    cached_tokens: q.cached_tokens,
                    prefilled: q.prefilled,
                    recomputed: q.recomputed,
                    preemptions: q.preemptions,
                    tenant: q.tenant,
                    priority: q.priority,
                    session: q.session,
                    turn: q.turn,
                    rejected: q.rejected,
                }
            })
            .collect();
        let replicas = w
            .replicas
            .iter()
            .flatten()
            .map(|rep| {
                let (peak, area) = rep.kv_totals(w.now, &w);
                let blocks = rep.kv.num_blocks() as f64;
                ReplicaEnd {
                    counters: rep.counters,
                    kv_requests: rep.kv.requests(),
                    kv_usage: rep.kv.usage(),
                    running: rep.running.len(),
                    waiting: rep.waiting.len(),
                    decode_n: rep.decode_n,
                    decode_ctx: rep.decode_ctx,
                    kv_peak: peak as f64 / blocks,
                    kv_mean: if w.now > 0.0 { area / (blocks * w.now) } else { 0.0 },
                }
            })
            .collect();
        SimOutput {
            done,
            replicas,
            kv_trace: w.kv_trace,
            decision: w.decision,
            feed: w.feed,
            feed_skipped: w.feed_skipped,
            now: w.now,
            sync_batches: w.sync_batches,
            sync_bytes: w.sync_bytes,
            slice_switches: w.slice_switches,
            arrived: w.arrived,
        }
    }
}

// ---- the world: arrivals, routing, metrics, KV events, finishes ------------------------------

impl<'p> World<'p> {
    /// Request `r` arrives: straight to the router, or offered to flow control.
    fn arrive(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        self.arrived += 1;
        if self.gate.is_none() {
            return self.dispatch(r, now);
        }
        if self.cfg.metrics_delay > 0.0 {
            self.deliver_metrics(now)?;
        }
        let q = &self.reqs[r];
        let tenant = q.tenant.to_string();
        let Some(gate) = self.gate.as_mut() else { return Ok(()) };
        let request = FlowRequest {
            id: q.id,
            priority: i32::try_from(q.priority).map_err(|_| {
                SimError::Config(format!("priority {} is out of range", q.priority))
            })?,
            tenant: &tenant,
            tokens: q.prompt_len,
            bytes: 0,
            deadline: None,
            ttft_target: gate.ttft.get(&q.priority).copied(),
            payload: r,
        };
        if gate.core.enqueue(request, now)?.is_some() {
            self.reject_at_gate(r, now);
        } else {
            gate.queued += 1;
        }
        self.pump(now)
    }

    /// Dispatches what flow control lets through now; rejects what it dropped.
    fn pump(&mut self, now: f64) -> Result<(), SimError> {
        let Some(gate) = self.gate.as_mut() else { return Ok(()) };
        let mut gone = gate.core.expire(now)?;
        gone.append(&mut gate.core.drain_evicted());
        gate.queued -= gone.len() as i64;
        for decision in gone {
            self.reject_at_gate(decision.payload, now);
        }
        loop {
            let Some(gate) = self.gate.as_mut() else { return Ok(()) };
            if gate.queued <= 0 {
                return Ok(());
            }
            let Some(decision) = gate.core.dispatch(now)? else { return Ok(()) };
            gate.queued -= 1;
            self.dispatch(decision.payload, now)?;
        }
    }

    /// Flow control refused request `r` (or let it expire): it leaves without service.
    fn reject_at_gate(&mut self, r: usize, now: f64) {
        let q = &mut self.reqs[r];
        q.rejected = true;
        q.phase = DONE;
        q.finish = now;
        self.done.push(r);
        self.on_finish(r, now);
    }

    /// Routes request `r` and hands it to its replica.
    fn dispatch(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        self.scrape_runs(now)?;
        if self.cfg.metrics_delay > 0.0 {
            self.deliver_metrics(now)?;
        }
        let (target, prefill) = self.pick(r, now)?;
        self.reqs[r].dispatched = now;
        if let Some(tracker) = self.slices.as_mut() {
            let q = &mut self.reqs[r];
            let start = tracker.admit(
                q.id,
                to_u32(q.prompt_len, "prompt_len")?,
                to_u32(q.output_len, "output_len")?,
                to_i32(q.priority)?,
                &target.to_string(),
            )?;
            q.call_end = q.output_len.min(u64::from(start.slice_tokens));
        }
        match prefill {
            Some(p) if p != target => {
                self.reqs[r].decode_replica = Some(target);
                self.reqs[r].prefill_replica = Some(p);
                self.enqueue(p, r, now)
            }
            _ => self.enqueue(target, r, now),
        }
    }

    /// A prefill replica finished request `r`'s prompt: its KV moves to the decode replica
    /// (the blocks that replica does not hold already).
    fn prefill_done(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        let Some(decode) = self.reqs[r].decode_replica else {
            return Err(SimError::Config("a split request without its decode replica".into()));
        };
        let Some(rep) = self.replicas[decode].as_ref() else {
            return Err(SimError::Config(format!("replica {decode} is missing")));
        };
        let q = &self.reqs[r];
        let whole = (q.prompt_len / self.bs) as usize;
        let ids = &self.ids[q.hashes.0..q.hashes.1];
        let uncached = (whole - rep.kv.lookup(ids, whole)) as u64;
        // In f64: the product of u64s wrapped past 2**64 for a huge kv_bytes_per_token.
        let nbytes = (uncached * self.bs) as f64 * self.cfg.kv_bytes_per_token as f64;
        let q = &mut self.reqs[r];
        q.kv_ready = true;
        q.computed = 0;
        q.phase = WAITING;
        let when = now + self.cfg.transfer_latency + nbytes / self.cfg.transfer_bw;
        self.push(when, Kind::Transfer, r, 0);
        Ok(())
    }

    /// Request `r` joins replica `target`'s queue; a replica out of its slot (being stepped)
    /// finds it in its inbox before its next schedule.
    fn enqueue(&mut self, target: usize, r: usize, now: f64) -> Result<(), SimError> {
        self.reqs[r].replica = Some(target);
        let Some(mut rep) = self.replicas[target].take() else {
            self.reqs[r].phase = WAITING;
            self.inbox[target].push(r);
            return Ok(());
        };
        let done = rep.enqueue(r, now, self);
        self.put_back(rep, now)?;
        done?;
        self.publish_replica(target, now)
    }

    /// The end of replica `rid`'s step (or decode run), unless a later one replaced it.
    fn step_end(&mut self, rid: usize, version: u64, now: f64) -> Result<(), SimError> {
        let Some(mut rep) = self.replicas[rid].take() else {
            return Err(SimError::Config(format!("replica {rid} is missing")));
        };
        if rep.version != version {
            self.replicas[rid] = Some(rep);
            return Ok(());
        }
        let done = rep.on_step_end(now, self);
        let events = rep.kv.take_events();
        self.put_back(rep, now)?;
        done?;
        self.kv_events(rid, events, now)?;
        self.publish_replica(rid, now)
    }

    /// Returns a replica to its slot (anything still in its inbox is enqueued now).
    fn put_back(&mut self, rep: Box<Replica>, now: f64) -> Result<(), SimError> {
        let rid = rep.id;
        self.replicas[rid] = Some(rep);
        let late = std::mem::take(&mut self.inbox[rid]);
        for r in late {
            self.enqueue(rid, r, now)?;
        }
        Ok(())
    }

    fn publish_replica(&mut self, rid: usize, now: f64) -> Result<(), SimError> {
        let Some(mut rep) = self.replicas[rid].take() else {
            return Err(SimError::Config(format!("replica {rid} is missing")));
        };
        rep.kv_observe(now);
        let (waiting, running, usage) =
            (rep.waiting.len() as u32, rep.running.len() as u32, rep.kv.usage());
        self.replicas[rid] = Some(rep);
        self.publish(rid, waiting, running, usage, now, true)
    }

    /// Before a routing decision: a replica in a decode run republishes its KV use as of
    /// `now` (the run's growth so far, as vLLM's gauge would read at a scrape), when it
    /// changed. It does not wake flow control (the decision under way goes first).
    ///
    /// Cost: O(1) per replica, plus O(decoding requests + blocks added) for a replica whose run
    /// added a block since its last scrape (see [`Replica::scrape`]).
    fn scrape_runs(&mut self, now: f64) -> Result<(), SimError> {
        for rid in 0..self.replicas.len() {
            let Some(mut rep) = self.replicas[rid].take() else { continue };
            if !rep.in_run(now) {
                self.replicas[rid] = Some(rep);
                continue;
            }
            let grown = rep.scrape(now, self);
            let free = rep.kv.free_blocks() as u64 - grown;
            let usage = 1.0 - free as f64 / rep.kv.num_blocks() as f64;
            let (waiting, running) = (rep.waiting.len() as u32, rep.running.len() as u32);
            self.replicas[rid] = Some(rep);
            if usage != self.published[rid] {
                self.publish(rid, waiting, running, usage, now, false)?;
            }
        }
        Ok(())
    }

    fn push(&mut self, time: f64, kind: Kind, obj: usize, version: u64) {
        self.seq += 1;
        self.heap.push(Event { time, seq: self.seq, kind, obj, version });
    }

    #[allow(clippy::too_many_arguments)]
    fn new_request(
        &mut self,
        arrival: f64,
        prompt_len: u64,
        output_len: u64,
        hashes: (usize, usize),
        shared: u32,
        tenant: i64,
        priority: i64,
        session: Option<usize>,
        session_name: Option<String>,
        turn: usize,
    ) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        let shared = (shared as usize).min(hashes.1 - hashes.0);
        if self.lean {
            // Its private contents occur nowhere else: marked once, here, before any event.
            for &c in &self.ids[hashes.0 + shared..hashes.1] {
                let (word, bit) = (c as usize / 64, c % 64);
                if word >= self.private.len() {
                    self.private.resize((word + 1).max(self.unique.len().div_ceil(64)), 0);
                }
                self.private[word] |= 1 << bit;
            }
        }
        self.reqs.push(Req {
            id,
            arrival,
            prompt_len,
            output_len: output_len.max(1),
            hashes,
            shared,
            tenant,
            priority,
            session,
            session_name,
            turn,
            phase: WAITING,
            target: prompt_len,
            computed: 0,
            generated: 0,
            high_water: 0,
            join_step: 0,
            join_gen: 0,
            kv_started: false,
            version: 0,
            dispatched: -1.0,
            first_token: -1.0,
            finish: -1.0,
            cached_tokens: -1,
            prefilled: 0,
            recomputed: 0,
            preemptions: 0,
            readmitting: false,
            rejected: false,
            ticket: None,
            router: 0,
            decode_replica: None,
            kv_ready: false,
            call_end: 0,
            slice_start: 0,
            slice_endpoint: 0,
            replica: None,
            prefill_replica: None,
        });
        self.reqs.len() - 1
    }

    /// Turn `turn` of session `sid`, arriving at `arrival`.
    fn session_turn_request(&mut self, sid: usize, turn: usize, arrival: f64) -> usize {
        let plan = self.plan;
        let s = &plan.sessions[sid];
        let t = s.turns[turn];
        self.session_turn[sid] = turn;
        let hashes = (s.hashes.start, s.hashes.start + t.blocks);
        let name = Some(sid.to_string());
        let shared = self.turn_private.get(sid).and_then(|p| p.get(turn)).copied();
        self.new_request(
            arrival,
            t.prompt_len,
            t.output_len,
            hashes,
            shared.unwrap_or(u32::MAX),
            s.tenant,
            0,
            Some(sid),
            name,
            turn,
        )
    }

    /// Open request `i`, waited for when the plan is still being built and its builder has
    /// not published it yet (None: the plan has no request `i`).
    fn open_request(&mut self, i: usize) -> Result<Option<&'p OpenRequest>, SimError> {
        if i >= self.open.len() {
            if let Some(feed) = self.builder {
                let published = feed.wait_past(i)?;
                self.open = published.open;
                self.hashes = published.hashes;
                self.ids = published.ids;
                self.unique = published.unique;
                self.private_from = published.private_from;
            }
        }
        Ok(self.open.get(i))
    }

    /// Pulls the next request of the arrival stream (Python's `_next_arrival`).
    fn next_arrival(&mut self) -> Result<(), SimError> {
        let plan = self.plan;
        let r = if let Some(o) = self.open_request(self.stream_next)? {
            let hashes = (o.hashes.start, o.hashes.end);
            let shared = self.private_from.get(self.stream_next).copied();
            self.new_request(
                o.arrival,
                o.prompt_len,
                o.output_len,
                hashes,
                shared.unwrap_or(u32::MAX),
                o.tenant,
                o.priority,
                None,
                o.session.clone(),
                0,
            )
        } else if self.open.is_empty()
            && self.stream_next < plan.starts.len()
            && self.sessions_started < plan.sessions.len()
        {
            let sid = self.sessions_started;
            self.sessions_started += 1;
            self.session_turn_request(sid, 0, plan.starts[self.stream_next])
        } else {
            return Ok(());
        };
        self.stream_next += 1;
        let arrival = self.reqs[r].arrival;
        self.push(arrival, Kind::StreamArrival, r, 0);
        Ok(())
    }

    /// The follow-up a finished request causes (the next turn, or a new session).
    fn on_finish(&mut self, r: usize, now: f64) {
        let Some(sid) = self.reqs[r].session else { return };
        let plan = self.plan;
        let s = &plan.sessions[sid];
        let turn = self.session_turn[sid];
        let think = s.turns[turn].think;
        let follow = if turn + 1 < s.turns.len() {
            self.session_turn_request(sid, turn + 1, now + think)
        } else if plan.closed && self.sessions_started < plan.sessions.len() {
            let next = self.sessions_started;
            self.sessions_started += 1;
            self.session_turn_request(next, 0, now + think)
        } else {
            return;
        };
        let arrival = self.reqs[follow].arrival;
        self.push(arrival, Kind::Arrival, follow, 0);
    }

    /// Routes request `r` and starts the decision's in-flight accounting; returns the replica
    /// that decodes it and, when the router split it, the one that prefills it.
    fn pick(&mut self, r: usize, now: f64) -> Result<(usize, Option<usize>), SimError> {
        if self.policy.is_some() {
            return self.policy_pick(r, now);
        }
        let q = &self.reqs[r];
        let whole = (q.prompt_len / self.bs) as usize;
        let hashes =
            self.hashes[q.hashes.0..q.hashes.0 + whole.min(q.hashes.1 - q.hashes.0)].to_vec();
        let meta = RequestMeta {
            model: None,
            lora: None,
            priority: q.priority as i32,
            session_id: q.session_name.clone(),
            headers: Vec::new(),
            cache_salt: None,
            session_endpoint: None,
        };
        let prompt_len = q.prompt_len;
        let k = self.next_router % self.routers.len();
        self.next_router += 1;
        let start = Instant::now();
        let router = &self.routers[k].router;
        let mut decision = router.decide_hashes(hashes, prompt_len, &meta, now)?;
        if self.lean {
            // The record stops before the private blocks (see `lean`).
            decision.hashes.truncate(self.reqs[r].shared);
        }
        let ticket = router.commit(&decision, None, now)?;
        self.decision += start.elapsed();
        self.reqs[r].router = k;
        let replica = |key: &WorkerKey| match key {
            WorkerKey::Int(i) if *i >= 0 && (*i as usize) < self.keys.len() => Ok(*i as usize),
            other => Err(SimError::Routing(RoutingError::UnknownEndpoint(other.clone()))),
        };
        let target = replica(&decision.endpoint(decision.chosen()).id)?;
        let prefill = match decision.prefill() {
            Some(p) => Some(replica(&decision.endpoint(p).id)?),
            None => None,
        };
        self.reqs[r].ticket = Some(ticket);
        self.publish_sync(k, now)?;
        Ok((target, prefill))
    }

    /// Router replica `k`'s news (records, sessions, counts) leaves for the others, arriving
    /// `router_sync_delay_s` later; a no-op without sync.
    fn publish_sync(&mut self, k: usize, now: f64) -> Result<(), SimError> {
        let (Some(sync), Some(delay)) = (&self.routers[k].sync, self.cfg.router_sync_delay) else {
            return Ok(());
        };
        let start = Instant::now();
        let batch = sync.outgoing(now, false);
        self.decision += start.elapsed();
        let Some(batch) = batch else { return Ok(()) };
        self.sync_batches += 1;
        self.sync_bytes += batch.len() as u64;
        if delay > 0.0 {
            self.syncs.push(Some((k, batch)));
            let slot = self.syncs.len() - 1;
            self.push(now + delay, Kind::Sync, slot, 0);
            Ok(())
        } else {
            self.deliver_sync(k, &batch, now)
        }
    }

    fn deliver_sync(&mut self, from: usize, batch: &[u8], now: f64) -> Result<(), SimError> {
        let start = Instant::now();
        for (k, replica) in self.routers.iter().enumerate() {
            if k != from {
                if let Some(sync) = &replica.sync {
                    sync.incoming(batch, now).map_err(|e| SimError::Config(e.to_string()))?;
                }
            }
        }
        self.decision += start.elapsed();
        Ok(())
    }

    /// [`pick`](Self::pick) by the policy hook, its answer checked.
    fn policy_pick(&mut self, r: usize, now: f64) -> Result<(usize, Option<usize>), SimError> {
        let Some(policy) = self.policy.as_mut() else {
            return Err(SimError::Config("no policy to pick with".into()));
        };
        let view = request_view(&self.reqs[r], r, self.hashes);
        let start = Instant::now();
        let (target, prefill) = policy.pick(&view, now)?;
        self.decision += start.elapsed();
        let (n, pools) = (self.replicas.len(), self.cfg.prefill_replicas);
        check_pick(target, prefill, n, pools).map_err(|e| {
            let prefill = prefill.map_or("None".to_string(), |p| p.to_string());
            PolicyFailure::new(format!(
                "pick() for request {} returned ({target}, {prefill}): {e}",
                self.reqs[r].id
            ))
        })?;
        Ok((target, prefill))
    }

    fn first_token(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        self.reqs[r].first_token = now;
        if let Some(policy) = self.policy.as_mut() {
            let view = request_view(&self.reqs[r], r, self.hashes);
            let start = Instant::now();
            policy.on_first_token(&view, now)?;
            self.decision += start.elapsed();
        }
        let start = Instant::now();
        if let Some(t) = self.reqs[r].ticket.as_mut() {
            t.first_token();
        }
        self.decision += start.elapsed();
        self.publish_sync(self.reqs[r].router, now)
    }

    fn finished(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        if let Some(tracker) = self.slices.as_mut() {
            let q = &mut self.reqs[r];
            if !q.rejected && q.generated < q.output_len {
                // A slice yielded or migrated: its continuation is a new call for the rest
                // (prompt plus output so far), queued where the tracker sent it.
                let start = tracker.resume(q.id, &q.slice_endpoint.to_string())?;
                q.high_water = q.high_water.max(q.computed);
                q.computed = 0;
                q.target = q.prompt_len + q.generated;
                q.call_end = q.output_len.min(q.generated + u64::from(start.slice_tokens));
                q.phase = WAITING;
                self.slice_switches += 1;
                self.push(now, Kind::Requeue, r, 0); // after the replica's step is applied
                return Ok(());
            }
            tracker.remove(q.id);
        }
        let q = &mut self.reqs[r];
        q.finish = now;
        q.phase = DONE;
        self.done.push(r);
        if let Some(policy) = self.policy.as_mut() {
            let view = request_view(&self.reqs[r], r, self.hashes);
            let start = Instant::now();
            policy.on_finished(&view, now)?;
            if !view.rejected {
                self.decision += start.elapsed();
            }
        }
        let q = &mut self.reqs[r];
        if q.rejected {
            if let Some(t) = q.ticket.as_mut() {
                t.finish();
            }
        } else {
            let start = Instant::now();
            if let Some(t) = q.ticket.as_mut() {
                t.finish();
            }
            self.decision += start.elapsed();
        }
        if let Some(gate) = self.gate.as_mut() {
            let q = &self.reqs[r];
            gate.core.complete(q.id, q.output_len, now)?;
            self.pump(now)?;
        }
        self.on_finish(r, now);
        self.publish_sync(self.reqs[r].router, now)
    }

    /// The replica's metrics changed; the gateway sees them `metrics_delay` later.
    fn publish(
        &mut self,
        rid: usize,
        waiting: u32,
        running: u32,
        usage: f64,
        now: f64,
        pump: bool,
    ) -> Result<(), SimError> {
        self.published[rid] = usage;
        if now >= self.next_kv_sample[rid] {
            self.kv_trace[rid].push((now, usage));
            self.next_kv_sample[rid] = now + self.cfg.kv_sample;
        }
        if self.cfg.metrics_delay > 0.0 {
            self.pending_metrics[rid].push_back((now, waiting, running, usage));
            Ok(())
        } else {
            self.metrics_seen(rid, waiting, running, usage, now, pump)
        }
    }

    /// The gateway sees a replica's metrics; flow control may dispatch on them (`pump`).
    fn metrics_seen(
        &mut self,
        rid: usize,
        waiting: u32,
        running: u32,
        usage: f64,
        now: f64,
        pump: bool,
    ) -> Result<(), SimError> {
        let start = Instant::now();
        if let Some(policy) = self.policy.as_mut() {
            policy.update_metrics(rid, waiting, running, usage, now)?;
        }
        let update = MetricsUpdate {
            waiting: Some(waiting),
            running: Some(running),
            kv_cache_usage: Some(usage.min(1.0)),
            max_concurrency: None,
        };
        for replica in &self.routers {
            replica.pool.update_metrics(&self.keys[rid], update, now)?;
        }
        let mut wake = false;
        if let Some(gate) = self.gate.as_mut() {
            let metrics = EndpointMetrics {
                waiting: u64::from(waiting),
                running: u64::from(running),
                kv_usage: usage.min(1.0),
                timestamp: now,
            };
            gate.core.update_endpoint(&gate.names[rid], metrics)?;
            wake = pump && gate.queued > 0;
        }
        self.feed += start.elapsed();
        if wake {
            self.pump(self.now)?;
        }
        Ok(())
    }

    fn deliver_metrics(&mut self, now: f64) -> Result<(), SimError> {
        let horizon = now - self.cfg.metrics_delay;
        for rid in 0..self.pending_metrics.len() {
            let mut last = None;
            while let Some(&front) = self.pending_metrics[rid].front() {
                if front.0 > horizon {
                    break;
                }
                last = self.pending_metrics[rid].pop_front();
            }
            if let Some((t, w, r, u)) = last {
                self.metrics_seen(rid, w, r, u, t, true)?;
            }
        }
        Ok(())
    }

    fn kv_events(&mut self, rid: usize, events: Vec<IdEvent>, now: f64) -> Result<(), SimError> {
        if events.is_empty() {
            return Ok(());
        }
        if self.cfg.kv_events_delay > 0.0 {
            self.feeds.push(Some((rid, events)));
            let slot = self.feeds.len() - 1;
            self.push(now + self.cfg.kv_events_delay, Kind::KvFeed, slot, 0);
            Ok(())
        } else {
            self.apply_kv_events(rid, events)
        }
    }

    fn apply_kv_events(&mut self, rid: usize, events: Vec<IdEvent>) -> Result<(), SimError> {
        let start = Instant::now();
        let key = &self.keys[rid];
        let unique = self.unique;
        let mut hashes = std::mem::take(&mut self.event_hashes);
        let private = &self.private;
        let is_private =
            |id: u32| private.get(id as usize / 64).is_some_and(|w| w >> (id % 64) & 1 != 0);
        for event in events {
            hashes.clear();
            let (ids, parent, store) = match &event {
                IdEvent::Stored { parent, ids } => (ids, *parent, true),
                IdEvent::Removed { ids } => (ids, None, false),
            };
            if !self.lean {
                hashes.extend(ids.iter().map(|&id| unique[id as usize]));
            } else if store {
                // A private block's descendants are private too: a stored run keeps the
                // blocks before its first private one (none after a private parent).
                if !parent.is_some_and(is_private) {
                    let keep = ids.iter().take_while(|&&id| !is_private(id));
                    hashes.extend(keep.map(|&id| unique[id as usize]));
                }
            } else {
                let keep = ids.iter().filter(|&&id| !is_private(id));
                hashes.extend(keep.map(|&id| unique[id as usize]));
            }
            if hashes.is_empty() && self.lean {
                continue;
            }
            let parent = parent.map(|id| unique[id as usize]);
            // Every router replica subscribes to every engine's events.
            for replica in &self.routers {
                let applied = if store {
                    replica.index.store(key, &hashes, parent, Tier::Gpu).map(|_| ())
                } else {
                    replica.index.remove(key, &hashes, None).map(|_| ())
                };
                match applied {
                    Ok(()) => {}
                    // Only when a delayed batch lands after its parent was dropped; counted.
                    Err(
                        IndexError::UnknownParent(_)
                        | IndexError::ParentNotHeld { .. }
                        | IndexError::NotHeld { .. },
                    ) => self.feed_skipped += 1,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        self.event_hashes = hashes;
        self.feed += start.elapsed();
        Ok(())
    }
}

/// What a [`PolicyHook`] sees of request `r` now.
fn request_view<'a>(q: &'a Req, r: usize, hashes: &'a [u64]) -> RequestView<'a> {
    RequestView {
        slot: r,
        id: q.id,
        arrival: q.arrival,
        prompt_len: q.prompt_len,
        output_len: q.output_len,
        hashes: &hashes[q.hashes.0..q.hashes.1],
        tenant: q.tenant,
        priority: q.priority,
        session: q.session,
        session_name: q.session_name.as_deref(),
        turn: q.turn,
        phase: q.phase,
        target: q.target,
        computed: q.computed,
        generated: q.generated,
        high_water: q.high_water,
        kv_ready: q.kv_ready,
        dispatched: q.dispatched,
        first_token: q.first_token,
        finish: q.finish,
        cached_tokens: q.cached_tokens,
        prefilled: q.prefilled,
        recomputed: q.recomputed,
        preemptions: q.preemptions,
        rejected: q.rejected,
        call_end: q.call_end,
        slice_start: q.slice_start,
        replica: q.replica,
        prefill_replica: q.prefill_replica,
        decode_replica: q.decode_replica,
    }
}

// ---- one replica ---------------------------------------------------------------------------

impl Replica {
    /// Request `r`'s content ids (its block hashes, numbered).
    fn hashes<'a>(&self, w: &'a World<'_>, r: usize) -> &'a [u32] {
        let (a, b) = w.reqs[r].hashes;
        &w.ids[a..b]
    }

    /// Request `r` arrives (the caller publishes the metrics after).
    fn enqueue(&mut self, r: usize, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        w.reqs[r].phase = WAITING;
        self.wait(r, false, w);
        if self.stepping {
            return Ok(());
        }
        if !self.busy {
            self.schedule(now, w)?;
        } else if self.run_steps > 1 {
            self.cut_run(now, w);
        }
        Ok(())
    }

    /// Requests routed here while this replica was out of its slot join its queue.
    fn take_inbox(&mut self, w: &mut World<'_>) {
        let late = std::mem::take(&mut w.inbox[self.id]);
        for r in late {
            w.reqs[r].phase = WAITING;
            self.wait(r, false, w);
        }
    }

    fn wait(&mut self, r: usize, front: bool, w: &World<'_>) {
        if w.cfg.priority_scheduling {
            let key = priority_key(&w.reqs[r]);
            let at = self.waiting.partition_point(|&x| priority_key(&w.reqs[x]) <= key);
            self.waiting.insert(at, r);
        } else if front {
            self.waiting.push_front(r);
        } else {
            self.waiting.push_back(r);
        }
    }

    fn cut_run(&mut self, now: f64, w: &mut World<'_>) {
        let run = self.run.expect("a decode run is in flight");
        let done = run.steps_within(now - self.step_start, self.run_steps);
        let keep = (done + 1).min(self.run_steps);
        if keep < self.run_steps {
            self.run_steps = keep;
            let end = self.step_start + run.time(keep);
            self.version += 1;
            w.push(end, Kind::Step, self.id, self.version);
        }
    }

    /// A decode run is in flight at `now`, past its start.
    fn in_run(&self, now: f64) -> bool {
        self.busy && self.run_steps > 0 && now > self.step_start
    }

    /// Blocks the decode run in flight allocates in its first `upto` steps, the integral
    /// over its first `elapsed` seconds of the blocks those add (block-seconds), and the first
    /// step at or after `upto` (and before the run's end) where it allocates one.
    ///
    /// A decoding request holding `t` tokens in `b` blocks takes a new block at the start of
    /// step `b*bs - t`, then every `bs` steps (vLLM allocates a step's slots when it schedules
    /// it). Cost: O(decoding requests + blocks added), not O(steps).
    fn run_growth(&self, elapsed: f64, upto: u64, w: &World<'_>) -> (u64, f64, Option<u64>) {
        let Some(run) = self.run else { return (0, 0.0, None) };
        let bs = w.bs;
        let (mut grown, mut area, mut next) = (0u64, 0.0f64, u64::MAX);
        for &r in &self.running {
            let q = &w.reqs[r];
            if q.phase != DECODE {
                continue;
            }
            let (Ok(blocks), Ok(tokens)) = (self.kv.blocks_of(q.id), self.kv.tokens_of(q.id))
            else {
                continue;
            };
            let mut s = (blocks as u64 * bs).saturating_sub(tokens);
            while s < upto {
                grown += 1;
                area += elapsed - run.time(s);
                s += bs;
            }
            next = next.min(s);
        }
        (grown, area, (next < self.run_steps).then_some(next))
    }

    /// [`kv_grown`](Self::kv_grown) for a scrape at `now` (a decode run in flight), from the
    /// last scrape's count while the run has reached no step that allocates a block since.
    ///
    /// Exact: with `done` steps complete the count covers steps `0..=done`, so it changes only
    /// once `done` reaches the next allocating step `s`, that is once `run.time(s)` seconds
    /// have elapsed (`steps_within`'s own test).
    fn scrape(&mut self, now: f64, w: &World<'_>) -> u64 {
        let elapsed = now - self.step_start;
        if let Some((version, grown, until)) = self.scraped {
            if version == self.version && elapsed < until {
                #[cfg(test)]
                assert_eq!(grown, self.kv_grown(now, w), "a stale scrape of replica {}", self.id);
                return grown;
            }
        }
        let Some(run) = self.run else { return 0 };
        let done = run.steps_within(elapsed, self.run_steps);
        let (grown, _, next) = self.run_growth(0.0, (done + 1).min(self.run_steps), w);
        let until = next.map_or(f64::INFINITY, |s| run.time(s));
        self.scraped = Some((self.version, grown, until));
        grown
    }

    /// Blocks the decode run in flight has added by `now` and not yet committed to the cache
    /// (0 outside a run): with them, the blocks held at `now`, what vLLM's
    /// `kv_cache_usage_perc` would report if scraped then.
    /// Tests check [`scrape`](Self::scrape) against it.
    #[cfg(test)]
    fn kv_grown(&self, now: f64, w: &World<'_>) -> u64 {
        let Some(run) = self.run.filter(|_| self.in_run(now)) else { return 0 };
        let done = run.steps_within(now - self.step_start, self.run_steps);
        self.run_growth(0.0, (done + 1).min(self.run_steps), w).0
    }

    /// Accounts the blocks held up to `now` (called whenever the metrics are published; a
    /// decode run in flight is accounted when it ends).
    fn kv_observe(&mut self, now: f64) {
        if self.in_run(now) {
            return;
        }
        self.kv_area += self.kv_held as f64 * (now - self.kv_since);
        self.kv_since = now;
        self.kv_held = (self.kv.num_blocks() - self.kv.free_blocks()) as u64;
        self.kv_peak = self.kv_peak.max(self.kv_held);
    }

    /// (peak blocks, block-seconds held) from the start to `now`.
    fn kv_totals(&self, now: f64, w: &World<'_>) -> (u64, f64) {
        let run = match self.run {
            Some(run) if self.in_run(now) => run,
            _ => {
                let area = self.kv_area + self.kv_held as f64 * (now - self.kv_since);
                return (self.kv_peak.max(self.kv_held), area);
            }
        };
        let elapsed = now - self.step_start;
        let done = run.steps_within(elapsed, self.run_steps);
        let (grown, area, _) = self.run_growth(elapsed, (done + 1).min(self.run_steps), w);
        let held = self.kv_held + grown;
        (self.kv_peak.max(held), self.kv_area + self.kv_held as f64 * elapsed + area)
    }

    fn on_step_end(&mut self, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        self.busy = false;
        self.stepping = true;
        self.last_end = now;
        if self.run_steps > 0 {
            let k = self.run_steps;
            // The run's KV growth, before its finishes free their blocks (peak and area).
            let elapsed = now - self.step_start;
            let (added, area, _) = self.run_growth(elapsed, k, w);
            self.kv_area += self.kv_held as f64 * elapsed + area;
            self.kv_held += added;
            self.kv_since = now;
            self.kv_peak = self.kv_peak.max(self.kv_held);
            let grown = self.kv.advance_decoding(k);
            debug_assert!(grown, "decode run was sized to fit the cache");
            self.decode_step += k;
            self.decode_ctx += self.decode_n * k;
            self.counters.steps += k;
        } else {
            self.counters.steps += 1;
            if self.decode_n > 0 {
                self.decode_step += 1;
                self.decode_ctx += self.decode_n;
            }
            let chunks = std::mem::take(&mut self.chunks);
            for &(r, chunk) in &chunks {
                self.prefilled(r, chunk, now, w)?;
            }
        }
        self.chunks.clear();
        self.finish_due(now, w)?;
        self.stepping = false;
        self.take_inbox(w);
        self.schedule(now, w)
    }

    fn prefilled(
        &mut self,
        r: usize,
        chunk: u64,
        now: f64,
        w: &mut World<'_>,
    ) -> Result<(), SimError> {
        let q = &mut w.reqs[r];
        q.computed += chunk;
        let (id, computed, target) = (q.id, q.computed, q.target);
        let upto = (computed / w.bs) as usize;
        self.kv.commit(id, self.hashes(w, r), upto)?;
        if computed < target {
            return Ok(());
        }
        remove_item(&mut self.prefilling, r);
        if self.prefill_only && w.reqs[r].decode_replica.is_some() {
            // Split by the router: the KV moves to the decode replica. (A request routed whole
            // to a prefill replica, by a policy that ignores roles, is served there.)
            remove_item(&mut self.running, r);
            self.kv.free(id)?;
            w.reqs[r].kv_started = false;
            return w.prefill_done(r, now);
        }
        w.reqs[r].generated += 1;
        if w.reqs[r].first_token < 0.0 {
            w.first_token(r, now)?;
        }
        let (generated, output_len, call_end) =
            (w.reqs[r].generated, w.reqs[r].output_len, w.reqs[r].call_end);
        if generated >= output_len || (call_end == generated && !self.slice_continues(r, now, w)?) {
            return self.finish(r, now, w);
        }
        let q = &mut w.reqs[r];
        q.phase = DECODE;
        q.join_step = self.decode_step;
        q.join_gen = q.generated;
        self.kv.set_decoding(q.id, true)?;
        self.decode_n += 1;
        self.decode_ctx += q.computed;
        let mut stop = q.output_len;
        if q.call_end > 0 {
            stop = stop.min(q.call_end);
        }
        self.finishes.push(Finish(self.decode_step + stop - q.generated, q.id, q.version, r));
        Ok(())
    }

    /// A slice of request `r` ended (`generated == call_end`): the tracker decides. True: the
    /// next slice runs on in the batch (`call_end` moved). False: the request leaves the batch
    /// and `finished` requeues it where `slice_endpoint` says.
    fn slice_continues(&mut self, r: usize, now: f64, w: &mut World<'_>) -> Result<bool, SimError> {
        // Requests dispatched to this replica during its step (flow control let them go when
        // another finished) are in its queue already in the reference engine: the tracker
        // weighs them too.
        self.take_inbox(w);
        let start = Instant::now();
        let Some(tracker) = w.slices.as_mut() else {
            return Err(SimError::Config("a slice boundary without token slices".into()));
        };
        let mut waiting = Vec::with_capacity(8);
        for &x in self.waiting.iter().take(8) {
            let q = &w.reqs[x];
            // Its entry level (mlfq skip-join) until its first slice ends, then the level it
            // was demoted or promoted to: every dispatched request was admitted.
            let level = tracker.get(q.id).ok_or(SliceError::UnknownRequest(q.id))?.level;
            waiting.push(SliceWaiting {
                priority: to_i32(q.priority)?,
                level,
                context_tokens: to_u32(q.prompt_len + q.generated, "context")?,
                expected_tokens: to_u32(q.output_len - q.generated, "output")?,
            });
        }
        let report = EndpointReport {
            kv_usage: self.kv.usage().min(1.0),
            waiting: to_u32(self.waiting.len() as u64, "waiting")?,
            kv_capacity_tokens: None,
            prefill_tokens_per_s: None,
            decode_step_s: None,
        };
        let q = &mut w.reqs[r];
        tracker.record_tokens(q.id, to_u32(q.generated - q.slice_start, "slice")?)?;
        tracker.set_endpoint(&self.id.to_string(), report)?;
        let decision = tracker.decide(q.id, false, &waiting, now)?;
        w.decision += start.elapsed();
        q.slice_start = q.generated;
        if decision.action == Action::Continue {
            q.call_end = q.output_len.min(q.generated + u64::from(decision.next_slice_tokens));
            return Ok(true);
        }
        q.slice_endpoint = match decision.endpoint.as_deref().map(str::parse::<usize>) {
            None => self.id,
            Some(Ok(i)) if i < w.replicas.len() => i,
            Some(_) => return Err(SimError::Config("a slice decision names no replica".into())),
        };
        Ok(false)
    }

    fn finish_due(&mut self, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        while let Some(&Finish(step, _, version, r)) = self.finishes.peek() {
            if step > self.decode_step {
                break;
            }
            self.finishes.pop();
            if version != w.reqs[r].version || w.reqs[r].phase != DECODE {
                continue;
            }
            let q = &mut w.reqs[r];
            let generated = q.join_gen + self.decode_step - q.join_step;
            if generated < q.output_len {
                q.generated = generated;
                if self.slice_continues(r, now, w)? {
                    // The next slice goes on in the batch: only the stopping point moves.
                    let q = &w.reqs[r];
                    let stop = q.output_len.min(q.call_end);
                    self.finishes.push(Finish(q.join_step + stop - q.join_gen, q.id, version, r));
                    continue;
                }
            }
            self.leave_decode(r, w)?;
            self.finish(r, now, w)?;
        }
        Ok(())
    }

    fn leave_decode(&mut self, r: usize, w: &mut World<'_>) -> Result<(), SimError> {
        let q = &mut w.reqs[r];
        let tokens = self.kv.tokens_of(q.id)?;
        q.generated = q.join_gen + self.decode_step - q.join_step;
        q.computed = tokens;
        self.decode_n -= 1;
        self.decode_ctx -= tokens;
        self.kv.set_decoding(q.id, false)?;
        Ok(())
    }

    fn finish(&mut self, r: usize, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        let (id, upto) = (w.reqs[r].id, (w.reqs[r].computed / w.bs) as usize);
        self.kv.commit(id, self.hashes(w, r), upto)?;
        self.kv.free(id)?;
        let q = &mut w.reqs[r];
        q.kv_started = false;
        q.phase = DONE;
        q.version += 1;
        remove_item(&mut self.running, r);
        w.finished(r, now)
    }

    fn preempt(&mut self, victim: usize, w: &mut World<'_>) -> Result<(), SimError> {
        if w.reqs[victim].phase == DECODE {
            self.leave_decode(victim, w)?;
        } else {
            remove_item(&mut self.prefilling, victim);
            if let Some(i) = self.chunks.iter().position(|&(r, _)| r == victim) {
                self.chunks.remove(i);
            }
        }
        let (id, upto) = (w.reqs[victim].id, (w.reqs[victim].computed / w.bs) as usize);
        self.kv.commit(id, self.hashes(w, victim), upto)?;
        self.kv.free(id)?;
        remove_item(&mut self.running, victim);
        let q = &mut w.reqs[victim];
        q.kv_started = false;
        q.high_water = q.high_water.max(q.computed);
        q.computed = 0;
        q.target = q.prompt_len + q.generated;
        q.phase = WAITING;
        q.version += 1;
        q.preemptions += 1;
        q.readmitting = true;
        q.kv_ready = false;
        self.counters.preemptions += 1;
        self.wait(victim, true, w);
        Ok(())
    }

    fn victim(&self, spare: Option<usize>, w: &World<'_>) -> Option<usize> {
        let mut candidates = self.running.iter().copied().filter(|&r| Some(r) != spare);
        if w.cfg.priority_scheduling {
            candidates.max_by(|&a, &b| {
                priority_key(&w.reqs[a])
                    .partial_cmp(&priority_key(&w.reqs[b]))
                    .unwrap_or(Ordering::Equal)
            })
        } else {
            candidates.next_back()
        }
    }

    fn schedule(&mut self, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        // Saturating: a setting past i64::MAX (the scenario allows up to 2**64 - 1) wrapped to a
        // negative budget, and every request was refused as one that never fits.
        let limit = i64::try_from(w.cfg.max_num_batched_tokens).unwrap_or(i64::MAX);
        let mut budget = limit - self.decode_n as i64;
        let mut preempted = false;
        let snapshot = self.prefilling.clone();
        for r in snapshot {
            if budget <= 0 {
                break;
            }
            if w.reqs[r].phase != PREFILL {
                continue;
            }
            let (id, computed, target) = (w.reqs[r].id, w.reqs[r].computed, w.reqs[r].target);
            let chunk = (target - computed).min(budget as u64);
            let mut fits = true;
            while !self.kv.allocate(id, computed + chunk)? {
                match self.victim(Some(r), w) {
                    None => {
                        fits = false;
                        break;
                    }
                    Some(v) => {
                        self.preempt(v, w)?;
                        preempted = true;
                    }
                }
            }
            if fits {
                self.chunks.push((r, chunk));
                budget -= chunk as i64;
            }
        }
        if !preempted {
            self.admit(budget, w)?;
        }
        if !self.chunks.is_empty() && self.decode_n > 0 {
            while !self.kv.advance_decoding(1) {
                let Some(v) = self.victim(None, w) else {
                    return Err(SimError::Config("no request to preempt for decode slots".into()));
                };
                self.preempt(v, w)?;
            }
            self.start_single(now, w);
        } else if !self.chunks.is_empty() {
            self.start_single(now, w);
        } else if self.decode_n > 0 {
            self.start_run(now, w)?;
        } else if !self.waiting.is_empty() && self.running.is_empty() {
            if !preempted {
                // Nothing runs and the head still does not fit: it never will. Refusing it may
                // let flow control dispatch here at once: that joins the queue first.
                if let Some(head) = self.waiting.pop_front() {
                    let was = std::mem::replace(&mut self.stepping, true);
                    let refused = self.reject(head, now, w);
                    self.stepping = was;
                    refused?;
                    self.take_inbox(w);
                }
            }
            self.schedule(now, w)?;
        }
        Ok(())
    }

    fn admit(&mut self, mut budget: i64, w: &mut World<'_>) -> Result<(), SimError> {
        let bs = w.bs;
        let seats_max = i64::try_from(w.cfg.max_num_seqs).unwrap_or(i64::MAX);
        let mut seats = seats_max - self.running.len() as i64;
        while budget > 0 && seats > 0 {
            let Some(&r) = self.waiting.front() else { break };
            let mut looked_up = None;
            if !w.reqs[r].kv_started {
                let max_blocks = ((w.reqs[r].target - 1) / bs) as usize;
                let hit = self.kv.start(w.reqs[r].id, self.hashes(w, r), max_blocks)? as u64;
                let q = &mut w.reqs[r];
                q.kv_started = true;
                q.computed = hit * bs;
                if q.kv_ready {
                    q.computed = q.computed.max(q.target - 1);
                }
                looked_up = Some(hit * bs);
            }
            let q = &mut w.reqs[r];
            let chunk = (q.target - q.computed).min(budget as u64);
            if !self.kv.allocate(q.id, q.computed + chunk)? {
                self.kv.free(q.id)?;
                q.kv_started = false;
                break;
            }
            if let Some(hit) = looked_up {
                // vLLM's prefix-cache counters: recorded at admission (a lookup whose blocks
                // did not fit is not counted; it is looked up again), and a preempted request's
                // readmission is counted apart, outside `vllm:prefix_cache_queries`. A token
                // slice's continuation is a new call: counted, preempted before or not.
                if !std::mem::take(&mut q.readmitting) {
                    self.counters.hit_tokens += hit;
                    self.counters.query_tokens += q.target;
                }
                if q.cached_tokens < 0 {
                    q.cached_tokens = hit as i64;
                }
            }
            self.waiting.pop_front();
            q.phase = PREFILL;
            self.running.push(r);
            self.prefilling.push(r);
            self.chunks.push((r, chunk));
            budget -= chunk as i64;
            seats -= 1;
        }
        Ok(())
    }

    fn start_single(&mut self, now: f64, w: &mut World<'_>) {
        let mut work = StepWork {
            prefill_requests: self.chunks.len() as u64,
            after_idle: now > self.last_end,
            decode_tokens: self.decode_n,
            decode_ctx: self.decode_ctx,
            ..StepWork::default()
        };
        for &(r, chunk) in &self.chunks {
            let q = &mut w.reqs[r];
            let done = q.computed;
            work.prefill_tokens += chunk;
            work.prefill_sq += chunk * chunk;
            work.prefill_ctx += chunk * done;
            work.prefill_read += done;
            if done < q.high_water {
                let recomputed = (done + chunk).min(q.high_water) - done;
                self.counters.recomputed_tokens += recomputed;
                q.recomputed += recomputed;
            }
            q.prefilled += chunk;
        }
        self.counters.prefill_tokens += work.prefill_tokens;
        let dt = w.model.step_time(&work);
        self.run = None;
        self.run_steps = 0;
        self.start(now, dt, w);
    }

    fn start_run(&mut self, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        let limit = match self.finishes.peek() {
            Some(f) => f.0 as i64 - self.decode_step as i64,
            None => 1,
        }
        .max(1) as u64;
        let mut fit = self.kv.decode_capacity(limit);
        while fit == 0 {
            let Some(v) = self.victim(None, w) else {
                return Err(SimError::Config("no request to preempt for a decode run".into()));
            };
            self.preempt(v, w)?;
            if self.decode_n == 0 {
                return self.schedule(now, w);
            }
            fit = self.kv.decode_capacity(limit);
        }
        let run = w.model.decode_run(self.decode_n, self.decode_ctx);
        self.run = Some(run);
        self.run_steps = fit;
        self.start(now, run.time(fit), w);
        Ok(())
    }

    fn start(&mut self, now: f64, dt: f64, w: &mut World<'_>) {
        self.busy = true;
        self.step_start = now;
        self.version += 1;
        w.push(now + dt, Kind::Step, self.id, self.version);
    }

    /// A request that cannot fit in an empty cache: vLLM refuses it.
    fn reject(&mut self, r: usize, now: f64, w: &mut World<'_>) -> Result<(), SimError> {
        if w.reqs[r].kv_started {
            self.kv.free(w.reqs[r].id)?;
            w.reqs[r].kv_started = false;
        }
        w.reqs[r].rejected = true;
        w.reqs[r].phase = DONE;
        w.finished(r, now)
    }
}

fn to_u32(value: u64, what: &str) -> Result<u32, SimError> {
    u32::try_from(value).map_err(|_| SimError::Config(format!("{what} {value} exceeds 2^32 - 1")))
}

fn to_i32(value: i64) -> Result<i32, SimError> {
    i32::try_from(value).map_err(|_| SimError::Config(format!("priority {value} is out of range")))
}

/// Python's `(-priority, arrival, id)`: the waiting order under priority scheduling.
fn priority_key(q: &Req) -> (i64, f64, u64) {
    (-q.priority, q.arrival, q.id)
}

fn remove_item(list: &mut Vec<usize>, item: usize) {
    if let Some(i) = list.iter().position(|&x| x == item) {
        list.remove(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::OpenRequest;
    use llmsched_core::routing::parse_config;
    use serde_json::json;

    /// `n` requests of `prompt` + `output` tokens, all arriving at `t = 0`, each with content
    /// of its own.
    fn burst(n: usize, prompt: u64, output: u64, priority: impl Fn(usize) -> i64) -> Plan<'static> {
        let blocks = (prompt / 16) as usize;
        let mut hashes = Vec::new();
        let mut open = Vec::new();
        for i in 0..n {
            let start = hashes.len();
            hashes.extend((0..blocks).map(|b| (i * 1000 + b + 1) as u64));
            open.push(OpenRequest {
                arrival: 0.0,
                prompt_len: prompt,
                output_len: output,
                tenant: (i % 3) as i64,
                priority: priority(i),
                session: None,
                hashes: start..hashes.len(),
            });
        }
        Plan {
            hashes: hashes.into(),
            open,
            sessions: Vec::new(),
            starts: Vec::new(),
            closed: false,
            contents: None,
        }
    }

    fn config(replicas: usize) -> SimConfig {
        serde_json::from_value(json!({
            "replicas": replicas, "block_size": 16, "kv_blocks": 4096,
            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "priority_scheduling": false,
            "metrics_delay_s": 0.0, "kv_events_delay_s": 0.0, "kv_sample_s": 1.0,
            "max_time_s": null, "seed": 0,
        }))
        .unwrap()
    }

    fn model() -> StepModel {
        serde_json::from_value(json!({"kind": "linear", "b0": 0.01, "b1": 1e-5, "b2": 1e-4,
                                      "b3": 0.0, "b4": 0.0}))
        .unwrap()
    }

    fn run(cfg: SimConfig, router: &str, plan: &Plan<'_>, flow: Option<&FlowSetup>) -> SimOutput {
        let value = match router {
            "round-robin" => json!({"plugins": [{"type": "round-robin-picker"}],
                "schedulingProfiles": [{"name": "default",
                                        "plugins": [{"pluginRef": "round-robin-picker"}]}]}),
            _ => json!({"plugins": [{"type": "prefill-filter"}, {"type": "decode-filter"},
                    {"type": "max-score-picker"}, {"type": "queue-scorer"},
                    {"type": "always-disagg-pd-decider"},
                    {"type": "pd-profile-handler",
                     "parameters": {"deciderPluginName": "always-disagg-pd-decider"}}],
                "schedulingProfiles": [
                    {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"},
                        {"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]},
                    {"name": "decode", "plugins": [{"pluginRef": "decode-filter"},
                        {"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}]}),
        };
        let make = || parse_config(&value).map_err(RoutingError::from);
        simulate(cfg, model(), &make, plan, flow, None).unwrap()
    }

    /// The calls a [`PolicyHook`] got (shared with the test: the engine owns the hook).
    #[derive(Default)]
    struct Calls {
        picks: Vec<(u64, f64)>,
        firsts: Vec<u64>,
        finishes: Vec<(u64, bool, u64)>,
        metrics: usize,
    }

    /// Round robin over `replicas`, or `answer` once `after` picks were made.
    struct Hook {
        calls: std::sync::Arc<std::sync::Mutex<Calls>>,
        replicas: usize,
        answer: Option<(usize, Option<usize>)>,
        after: usize,
    }

    impl PolicyHook for Hook {
        fn update_metrics(
            &mut self,
            replica: usize,
            _: u32,
            _: u32,
            _: f64,
            _: f64,
        ) -> Result<(), PolicyFailure> {
            assert!(replica < self.replicas);
            self.calls.lock().unwrap().metrics += 1;
            Ok(())
        }

        fn pick(
            &mut self,
            req: &RequestView<'_>,
            _: f64,
        ) -> Result<(usize, Option<usize>), PolicyFailure> {
            assert_eq!(req.dispatched, -1.0);
            let mut calls = self.calls.lock().unwrap();
            calls.picks.push((req.id, req.arrival));
            let n = calls.picks.len();
            match self.answer {
                Some(answer) if n > self.after => Ok(answer),
                _ => Ok(((n - 1) % self.replicas, None)),
            }
        }

        fn on_first_token(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure> {
            assert_eq!(req.first_token, now);
            self.calls.lock().unwrap().firsts.push(req.id);
            Ok(())
        }

        fn on_finished(&mut self, req: &RequestView<'_>, now: f64) -> Result<(), PolicyFailure> {
            assert_eq!(req.finish, now);
            self.calls.lock().unwrap().finishes.push((req.id, req.rejected, req.generated));
            Ok(())
        }
    }

    fn run_hook(
        cfg: SimConfig,
        plan: &Plan<'_>,
        answer: Option<(usize, Option<usize>)>,
    ) -> (Result<SimOutput, SimError>, Calls) {
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Calls::default()));
        let hook = Hook { calls: calls.clone(), replicas: cfg.replicas, answer, after: 3 };
        let value = json!({"plugins": [{"type": "round-robin-picker"}],
            "schedulingProfiles": [{"name": "default",
                                    "plugins": [{"pluginRef": "round-robin-picker"}]}]});
        let make = || parse_config(&value).map_err(RoutingError::from);
        let out = simulate_with_policy(cfg, model(), &make, plan, None, None, Box::new(hook));
        let calls = std::mem::take(&mut *calls.lock().unwrap());
        (out, calls)
    }

    #[test]
    fn a_policy_hook_routes_every_request_once() {
        let plan = burst(10, 256, 8, |_| 0);
        let (out, calls) = run_hook(config(2), &plan, None);
        let out = out.unwrap();
        assert_eq!(out.done.len(), 10);
        let ids: Vec<u64> = calls.picks.iter().map(|p| p.0).collect();
        assert_eq!(ids, (0..10).collect::<Vec<u64>>());
        assert_eq!(calls.firsts.len(), 10);
        assert_eq!(calls.finishes.len(), 10);
        assert!(calls.finishes.iter().all(|&(_, rejected, generated)| !rejected && generated == 8));
        assert!(calls.metrics > 0);
        // Round robin: each replica ran half the requests.
        assert!(out.replicas.iter().all(|r| r.counters.prefill_tokens == 5 * 256));
    }

    #[test]
    fn a_bad_pick_stops_the_run() {
        let plan = burst(10, 256, 8, |_| 0);
        let (out, calls) = run_hook(config(2), &plan, Some((2, None)));
        let err = out.unwrap_err().to_string();
        assert!(err.contains("pick() for request 3 returned (2, None)"), "{err}");
        assert!(err.contains("decode replica 2 is out of range (2 replicas)"), "{err}");
        assert_eq!(calls.picks.len(), 4);
        let mut two_routers = config(2);
        two_routers.router_replicas = 2;
        let (out, _) = run_hook(two_routers, &plan, None);
        assert!(out.unwrap_err().to_string().contains("router_replicas needs a router"));
    }

    fn flow(config: serde_json::Value) -> FlowSetup {
        FlowSetup { config: FlowConfig::from_value(config).unwrap(), ttft_targets: Vec::new() }
    }

    #[test]
    fn a_run_cut_off_by_max_time_counts_what_arrived() {
        let mut plan = burst(12, 256, 8, |_| 0);
        for (i, o) in plan.open.iter_mut().enumerate() {
            o.arrival = i as f64;
        }
        let out = run(config(1), "round-robin", &plan, None);
        assert_eq!((out.arrived, out.done.len()), (12, 12));
        let mut cut = config(1);
        cut.max_time = Some(5.05);
        let out = run(cut, "round-robin", &plan, None);
        // Arrivals at 0..=5 s, each done about 0.08 s later: the last is still running.
        assert_eq!(out.arrived, 6);
        assert_eq!(out.done.len(), 5);
    }

    #[test]
    fn time_past_the_finite_range_stops_the_run() {
        let plan = burst(2, 256, 8, |_| 0);
        let model: StepModel = serde_json::from_value(json!({"kind": "linear", "b0": 1e308,
            "b1": 1e308, "b2": 0.0, "b3": 0.0, "b4": 0.0}))
        .unwrap();
        let value = json!({"plugins": [{"type": "round-robin-picker"}],
            "schedulingProfiles": [{"name": "default",
                                    "plugins": [{"pluginRef": "round-robin-picker"}]}]});
        let make = || parse_config(&value).map_err(RoutingError::from);
        let err = simulate(config(1), model, &make, &plan, None, None).unwrap_err();
        assert!(err.to_string().contains("simulated time left the finite range"), "{err}");
    }

    #[test]
    fn flow_control_lets_one_request_run_at_a_time() {
        let plan = burst(12, 256, 8, |_| 0);
        let gate = flow(json!({"saturation": {"type": "concurrency", "max_requests": 1}}));
        let out = run(config(2), "round-robin", &plan, Some(&gate));
        assert_eq!(out.done.len(), 12);
        assert!(out.done.iter().all(|r| !r.rejected && r.generated == 8));
        let mut spans: Vec<(f64, f64)> =
            out.done.iter().map(|r| (r.dispatched, r.finish)).collect();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in spans.windows(2) {
            assert!(pair[1].0 >= pair[0].1, "dispatched before the previous one finished");
        }
        // Without flow control every request starts at once.
        let free = run(config(2), "round-robin", &plan, None);
        assert!(free.done.iter().all(|r| r.dispatched == 0.0));
    }

    #[test]
    fn flow_control_refuses_beyond_its_band_and_serves_priority_first() {
        let plan = burst(10, 256, 8, |i| if i < 5 { -1 } else { 1 });
        let gate = flow(json!({
            "saturation": {"type": "concurrency", "max_requests": 1},
            "default_band": {"max_requests": 3},
            "shedding": {"type": "none"},
        }));
        let out = run(config(1), "round-robin", &plan, Some(&gate));
        let rejected: Vec<&DoneRecord> = out.done.iter().filter(|r| r.rejected).collect();
        assert!(!rejected.is_empty());
        assert!(rejected.iter().all(|r| r.dispatched < 0.0 && r.first_token < 0.0));
        // The first batch request got in before the interactive ones arrived; after it, the
        // interactive band goes first.
        let served: Vec<&DoneRecord> = out.done.iter().filter(|r| !r.rejected).collect();
        let first_high = served.iter().filter(|r| r.priority == 1).map(|r| r.dispatched);
        let later_low: Vec<f64> = served
            .iter()
            .filter(|r| r.priority == -1 && r.dispatched > 0.0)
            .map(|r| r.dispatched)
            .collect();
        let first_high = first_high.fold(f64::INFINITY, f64::min);
        assert!(first_high > 0.0 && !later_low.is_empty());
        assert!(later_low.iter().all(|&t| t > first_high));
    }

    #[test]
    fn pd_split_prefills_on_one_replica_and_decodes_on_the_other() {
        let plan = burst(6, 1024, 16, |_| 0);
        let mut cfg = config(2);
        cfg.prefill_replicas = 1;
        cfg.kv_bytes_per_token = 1000;
        cfg.transfer_bw = 1e6;
        let out = run(cfg, "pd", &plan, None);
        assert!(out.done.iter().all(|r| !r.rejected && r.generated == 16));
        let (prefill, decode) = (out.replicas[0].counters, out.replicas[1].counters);
        assert_eq!(prefill.prefill_tokens, 6 * 1024);
        assert_eq!(decode.prefill_tokens, 6); // one token each: the KV came by transfer
                                              // Each transfer of 1024 tokens at 1 MB/s takes about a second before the first token.
        assert!(out.done.iter().all(|r| r.first_token - r.arrival > 1.0));
    }

    #[test]
    fn pd_readmission_on_the_decode_replica_recomputes() {
        // 162 blocks on each replica, 4 seats: 12 answers of 1024 + 600 tokens do not fit
        // together on the decode replica, which preempts. A readmission is a local request:
        // what its prefix cache no longer holds is prefilled again there (it used to start with
        // all but one token computed, its transferred KV taken as still there).
        let plan = burst(12, 1024, 600, |_| 0);
        let mut cfg = config(2);
        cfg.prefill_replicas = 1;
        cfg.kv_blocks = 162;
        cfg.max_num_seqs = 4;
        let out = run(cfg, "pd", &plan, None);
        assert!(out.done.iter().all(|r| !r.rejected && r.generated == 600));
        let (prefill, decode) = (out.replicas[0].counters, out.replicas[1].counters);
        assert_eq!(prefill.prefill_tokens, 12 * 1024);
        assert_eq!(prefill.preemptions, 0);
        assert!(decode.preemptions > 0);
        // One token at each admission is new (the last prompt token, or the token sampled
        // before the preemption); the rest of a readmission's prefill is recompute.
        assert!(decode.recomputed_tokens > 1024, "{decode:?}");
        assert_eq!(decode.prefill_tokens, 12 + decode.preemptions + decode.recomputed_tokens);
        // Counted once per replica, at the first admission: no content is shared.
        assert_eq!((decode.hit_tokens, decode.query_tokens), (0, 12 * 1024));
    }

    #[test]
    fn bad_pd_settings_are_refused() {
        let plan = burst(1, 64, 2, |_| 0);
        let mut cfg = config(2);
        cfg.prefill_replicas = 2;
        let make = || parse_config(&json!("round-robin")).map_err(RoutingError::from);
        assert!(matches!(
            simulate(cfg, model(), &make, &plan, None, None),
            Err(SimError::Config(_))
        ));
    }

    /// Requests `(arrival, prompt, output)`, each with content of its own.
    fn requests(rows: &[(f64, u64, u64)]) -> Plan<'static> {
        let mut plan = burst(0, 16, 1, |_| 0);
        let mut hashes = Vec::new();
        for (i, &(arrival, prompt, output)) in rows.iter().enumerate() {
            let start = hashes.len();
            hashes.extend((0..prompt / 16).map(|b| (i as u64) * 1000 + b + 1));
            plan.open.push(OpenRequest {
                arrival,
                prompt_len: prompt,
                output_len: output,
                tenant: 0,
                priority: 0,
                session: None,
                hashes: start..hashes.len(),
            });
        }
        plan.hashes = hashes.into();
        plan
    }

    /// Every step takes 10 ms; one replica of 64 blocks of 16 tokens (1024 tokens).
    fn kv_run(plan: &Plan<'_>) -> (SimOutput, Vec<f64>) {
        /// Sends everything to replica 0; records the KV use it last saw at each pick.
        struct KvSeen {
            kv: f64,
            seen: std::sync::Arc<std::sync::Mutex<Vec<f64>>>,
        }
        impl PolicyHook for KvSeen {
            fn update_metrics(
                &mut self,
                _: usize,
                _: u32,
                _: u32,
                kv: f64,
                _: f64,
            ) -> Result<(), PolicyFailure> {
                self.kv = kv;
                Ok(())
            }
            fn pick(
                &mut self,
                _: &RequestView<'_>,
                _: f64,
            ) -> Result<(usize, Option<usize>), PolicyFailure> {
                self.seen.lock().unwrap().push(self.kv);
                Ok((0, None))
            }
            fn on_first_token(&mut self, _: &RequestView<'_>, _: f64) -> Result<(), PolicyFailure> {
                Ok(())
            }
            fn on_finished(&mut self, _: &RequestView<'_>, _: f64) -> Result<(), PolicyFailure> {
                Ok(())
            }
        }
        let mut cfg = config(1);
        cfg.kv_blocks = 64;
        let model: StepModel = serde_json::from_value(json!({"kind": "linear", "b0": 0.01,
            "b1": 0.0, "b2": 0.0, "b3": 0.0, "b4": 0.0}))
        .unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let hook = KvSeen { kv: 0.0, seen: seen.clone() };
        let value = json!({"plugins": [{"type": "round-robin-picker"}],
            "schedulingProfiles": [{"name": "default",
                                    "plugins": [{"pluginRef": "round-robin-picker"}]}]});
        let make = || parse_config(&value).map_err(RoutingError::from);
        let out =
            simulate_with_policy(cfg, model, &make, plan, None, None, Box::new(hook)).unwrap();
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        (out, seen)
    }

    #[test]
    fn kv_use_counts_the_blocks_a_decode_run_grows() {
        // 32 prompt tokens (2 blocks), then 899 decode steps in one closed-form run: the
        // request ends holding 32 + 899 = 931 tokens, 59 blocks, freed at the run's end.
        let (out, _) = kv_run(&requests(&[(0.0, 32, 900)]));
        let rep = &out.replicas[0];
        assert_eq!(rep.kv_peak, 59.0 / 64.0);
        // Held over time: 2 blocks for the prefill step [0, 0.01], then 2 blocks plus one
        // more at the start of decode steps 0, 16, ..., 896 (57 blocks) until 9.0 s.
        let area = 2.0 * 0.01 + 59.0 * 8.99 - 0.01 * 16.0 * (0..57).sum::<u64>() as f64;
        assert!((out.now - 9.0).abs() < 1e-9, "{}", out.now);
        assert!((rep.kv_mean - area / (64.0 * 9.0)).abs() < 1e-9, "{}", rep.kv_mean);
    }

    #[test]
    fn a_router_sees_the_kv_held_at_its_decision() {
        // The second request arrives during decode step 49 of the first one's run: that
        // request holds its 2 prompt blocks plus those of steps 0, 16, 32 and 48.
        let (out, seen) = kv_run(&requests(&[(0.0, 32, 900), (0.505, 16, 2)]));
        assert_eq!(seen, vec![0.0, 6.0 / 64.0]);
        assert_eq!(out.replicas[0].kv_peak, 59.0 / 64.0);
    }

    #[test]
    fn scrapes_between_block_steps_see_the_blocks_held() {
        // Replica 0 decodes one request (32 prompt tokens, then 899 steps of 10 ms from
        // 0.01 s); 200 short requests go to replica 1 meanwhile, several per 16 steps, so most
        // scrapes of replica 0 find no block added since the last one (the engine's own check
        // against a full recount runs at each of them in tests). At decode step k it holds its 2
        // prompt blocks plus those of steps 0, 16, ..., up to k.
        struct Seen {
            kv: f64,
            seen: std::sync::Arc<std::sync::Mutex<Vec<(f64, f64)>>>,
        }
        impl PolicyHook for Seen {
            fn update_metrics(
                &mut self,
                replica: usize,
                _: u32,
                _: u32,
                kv: f64,
                _: f64,
            ) -> Result<(), PolicyFailure> {
                if replica == 0 {
                    self.kv = kv;
                }
                Ok(())
            }
            fn pick(
                &mut self,
                req: &RequestView<'_>,
                now: f64,
            ) -> Result<(usize, Option<usize>), PolicyFailure> {
                self.seen.lock().unwrap().push((now, self.kv));
                Ok((usize::from(req.id > 0), None))
            }
            fn on_first_token(&mut self, _: &RequestView<'_>, _: f64) -> Result<(), PolicyFailure> {
                Ok(())
            }
            fn on_finished(&mut self, _: &RequestView<'_>, _: f64) -> Result<(), PolicyFailure> {
                Ok(())
            }
        }
        let mut rows = vec![(0.0, 32, 900)];
        rows.extend((0..200).map(|i| (0.0155 + 0.037 * f64::from(i), 16, 2)));
        let mut cfg = config(2);
        cfg.kv_blocks = 64;
        let model: StepModel = serde_json::from_value(json!({"kind": "linear", "b0": 0.01,
            "b1": 0.0, "b2": 0.0, "b3": 0.0, "b4": 0.0}))
        .unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let hook = Seen { kv: 0.0, seen: seen.clone() };
        let value = json!({"plugins": [{"type": "round-robin-picker"}],
            "schedulingProfiles": [{"name": "default",
                                    "plugins": [{"pluginRef": "round-robin-picker"}]}]});
        let make = || parse_config(&value).map_err(RoutingError::from);
        let plan = requests(&rows);
        simulate_with_policy(cfg, model, &make, &plan, None, None, Box::new(hook)).unwrap();
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        assert_eq!(seen.len(), 201);
        for &(now, kv) in &seen[1..] {
            let step = ((now - 0.01) / 0.01).floor() as u64;
            assert_eq!(kv, (3 + step / 16) as f64 / 64.0, "at {now}");
        }
    }
}
