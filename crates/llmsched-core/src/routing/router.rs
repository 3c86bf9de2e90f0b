//! The router: one decision per request, then in-flight accounting once it is sent.
//!
//! Algorithm (per request): hash the prompt once (the index's block size and namespace), match
//! it once against the shared prefix index, read every member's metrics and in-flight counts
//! once into candidates, then let the profile handler run profiles (filters -> scorers ->
//! picker) over those shared candidates. Complexity: O(prompt tokens) hashing, O(prompt blocks)
//! matching, O(endpoints x plugins) scoring, O(endpoints) picking. No lock is held while
//! plugins run; a decision reads an immutable member list and lock-free metric cells.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use super::config::RouterConfig;
use super::endpoint::Endpoint;
use super::handler::Handler;
use super::inflight::{Part, Ticket};
use super::plugin::{Candidate, Commit, RequestContext, RequestMeta};
use super::pool::{EndpointPool, Members};
use super::profile::ProfileOutcome;
use super::replica_sync::{ReplicaSync, SyncEntry, SyncJournal, SyncOptions};
use super::rng::DecisionRng;
use super::sessions::{session_key, Sessions};
use super::RoutingError;
use crate::hashing::TokenId;
use crate::prefix_index::{MatchResult, PrefixIndex, WorkerId, WorkerKey};

/// Router options. Defaults live here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterOptions {
    /// Seed of every random choice.
    pub seed: u64,
    /// Seconds an approximate prefix entry recorded for a sent request counts, unless an engine
    /// confirms it.
    pub record_ttl: f64,
    /// Seconds a session stays bound to its endpoint after its last request.
    pub session_ttl: f64,
    /// Most sessions remembered.
    pub max_sessions: usize,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions { seed: 0, record_ttl: 60.0, session_ttl: 3600.0, max_sessions: 100_000 }
    }
}

/// Index worker id -> member slot, for one member-list generation.
#[derive(Default)]
struct IdMap {
    generation: u64,
    /// By index worker id: slot, or [`NOT_A_MEMBER`]. Ids past the end are unknown yet.
    slots: Vec<u32>,
}

const NOT_A_MEMBER: u32 = u32::MAX;

/// Why a P/D decision split the request or did not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdReason {
    /// Split: another endpoint prefills, then hands the KV to the decode endpoint.
    Split,
    /// Fewer prompt tokens uncached on the decode endpoint than the decider's threshold.
    BelowThreshold,
    /// The prefill profile found no endpoint.
    NoPrefillEndpoint,
    /// The load-aware decider found the prefill endpoint's queue too long.
    PrefillQueueLonger,
    /// The prefill profile picked the decode endpoint itself (one of role `both`): it
    /// prefills locally rather than hand the request off to itself.
    SameEndpoint,
}

impl PdReason {
    /// The name `Decision.pd()` gives it.
    pub fn name(self) -> &'static str {
        match self {
            PdReason::Split => "split",
            PdReason::BelowThreshold => "below-threshold",
            PdReason::NoPrefillEndpoint => "no-prefill-endpoint",
            PdReason::PrefillQueueLonger => "prefill-queue-longer",
            PdReason::SameEndpoint => "same-endpoint",
        }
    }
}

/// The P/D decision, when a P/D handler ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdNote {
    /// Prompt tokens not cached on the chosen decode endpoint.
    pub uncached_tokens: u64,
    /// Whether the decider asked for a prefill endpoint.
    pub wanted: bool,
    /// Whether one is used: a prefill endpoint other than the decode endpoint was picked and
    /// kept.
    pub disaggregated: bool,
    /// Why it is or is not.
    pub reason: PdReason,
}

/// The outcome of [`Router::decide`].
pub struct Decision {
    pub members: Arc<Members>,
    /// Every endpoint considered (serving the request's model).
    pub base: Vec<Candidate>,
    /// Profile runs in order; the first is the primary (decode) profile.
    pub outcomes: Vec<ProfileOutcome>,
    /// The outcome of the prefill profile, when the request is split.
    pub prefill_outcome: Option<usize>,
    pub pd: Option<PdNote>,
    pub hashes: Vec<u64>,
    pub prompt_tokens: u64,
    pub block_size: usize,
    /// No endpoint held any part of the prompt.
    pub cold: bool,
    pub session_id: Option<String>,
    pub sequence: u64,
}

/// A dropped decision's lists (its candidates, its profile outcomes with theirs), kept for
/// a later decision on the thread: a decision then allocates none of them anew.
#[derive(Default)]
struct Spare {
    base: Vec<Candidate>,
    outcomes: Vec<ProfileOutcome>,
}

/// How many dropped decisions' lists a thread keeps: as many decisions alive at once on a
/// thread (requests overlapping on a gateway's thread) reuse theirs. A thread kept one set
/// before, which a second decision alive beside the first never found (it allocated its
/// own, and the first one's dropped set then freed the other's).
const SPARES: usize = 16;

thread_local! {
    /// The lists of the decisions last dropped on this thread, the most recent last. What
    /// they held is cleared before they are written again.
    static SPARE: std::cell::RefCell<Vec<Spare>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for Decision {
    fn drop(&mut self) {
        let spare = Spare {
            base: std::mem::take(&mut self.base),
            outcomes: std::mem::take(&mut self.outcomes),
        };
        // A thread ending drops its spares first: then the lists are simply freed, as are
        // those past [`SPARES`].
        let _ = SPARE.try_with(|cell| {
            if let Ok(mut spares) = cell.try_borrow_mut() {
                if spares.len() < SPARES {
                    spares.push(spare);
                }
            }
        });
    }
}

/// The spare lists of the thread's last dropped decision not yet reused (empty ones when
/// there are none, or when the thread is ending).
fn take_spare() -> Spare {
    SPARE
        .try_with(|cell| cell.try_borrow_mut().ok().and_then(|mut spares| spares.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Decision {
    fn candidate(&self, base_index: usize) -> &Candidate {
        &self.base[base_index]
    }

    /// The chosen (decode) endpoint.
    pub fn chosen(&self) -> &Candidate {
        self.candidate(self.outcomes[0].order[0] as usize)
    }

    /// The chosen endpoint, then the fallbacks, in order.
    pub fn ranked(&self) -> impl Iterator<Item = &Candidate> {
        self.outcomes[0].order.iter().map(|&i| self.candidate(i as usize))
    }

    /// The prefill endpoint, when split.
    pub fn prefill(&self) -> Option<&Candidate> {
        self.prefill_outcome.and_then(|o| self.outcomes[o].chosen()).map(|i| self.candidate(i))
    }

    pub fn endpoint(&self, c: &Candidate) -> &Endpoint {
        &self.members.list[c.slot].endpoint
    }

    /// Prompt tokens cached on `c`.
    pub fn cached_tokens(&self, c: &Candidate) -> u64 {
        (u64::from(c.cached_blocks) * self.block_size as u64).min(self.prompt_tokens)
    }
}

/// Routes requests over a pool with a configuration. Share it between threads.
pub struct Router {
    pool: Arc<EndpointPool>,
    index: Arc<PrefixIndex>,
    config: RouterConfig,
    options: RouterOptions,
    ids: RwLock<IdMap>,
    sessions: Arc<Sessions>,
    journal: Arc<SyncJournal>,
    sequence: AtomicU64,
}

impl Router {
    pub fn new(
        pool: Arc<EndpointPool>,
        index: Arc<PrefixIndex>,
        config: RouterConfig,
        options: RouterOptions,
    ) -> Result<Router, RoutingError> {
        let index_bs = index.config().block_size;
        if let (Some(bs), Some(key)) = (config.index_hints.block_size, &config.block_size_key) {
            if bs != index_bs {
                return Err(RoutingError::Config(super::config::ConfigError {
                    key: key.clone(),
                    message: format!(
                        "is {bs} but the prefix index uses blocks of {index_bs} tokens"
                    ),
                }));
            }
        }
        // llm-d: maxBlocks = maxPrefixTokensToMatch / blockSize. Under one block the cap is 0
        // blocks and the scorer gives every endpoint 0 whatever the index holds.
        if let Some((key, tokens)) =
            config.token_caps.iter().find(|&&(_, tokens)| tokens < index_bs as u64)
        {
            return Err(RoutingError::Config(super::config::ConfigError {
                key: key.clone(),
                message: format!(
                    "is {tokens}, less than one block of the prefix index ({index_bs} tokens): \
                     the scorer would give every endpoint 0; give at least {index_bs}"
                ),
            }));
        }
        if !(options.record_ttl.is_finite() && options.record_ttl > 0.0) {
            return Err(RoutingError::InvalidValue(format!(
                "record_ttl must be positive, got {}",
                options.record_ttl
            )));
        }
        if options.session_ttl.is_nan() || options.session_ttl <= 0.0 || options.max_sessions == 0 {
            return Err(RoutingError::InvalidValue(
                "session_ttl and max_sessions must be positive".into(),
            ));
        }
        Ok(Router {
            pool,
            index,
            config,
            options,
            ids: RwLock::new(IdMap::default()),
            sessions: Arc::new(Sessions::new(options.session_ttl, options.max_sessions)),
            journal: Arc::new(SyncJournal::default()),
            sequence: AtomicU64::new(0),
        })
    }

    pub fn pool(&self) -> &Arc<EndpointPool> {
        &self.pool
    }

    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn options(&self) -> RouterOptions {
        self.options
    }

    /// Hashes `tokens` in the index's namespace (LoRA and cache salt from `meta`) and decides.
    pub fn decide<T: TokenId>(
        &self,
        tokens: &[T],
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        let hashes =
            self.index.hash_tokens(tokens, meta.lora.as_deref(), meta.cache_salt.as_deref())?;
        self.decide_hashes(hashes, tokens.len() as u64, meta, now)
    }

    /// Decides for a prompt of `prompt_tokens` tokens whose block hashes are `hashes`.
    pub fn decide_hashes(
        &self,
        hashes: Vec<u64>,
        prompt_tokens: u64,
        meta: &RequestMeta,
        now: f64,
    ) -> Result<Decision, RoutingError> {
        if !now.is_finite() {
            return Err(RoutingError::InvalidValue(format!("now must be finite, got {now}")));
        }
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed);
        let mut rng = DecisionRng::new(self.options.seed, sequence);
        let members = self.pool.snapshot();
        // None: nothing to match (no full block, or a caller whose router reads no match).
        let cached = (!hashes.is_empty()).then(|| {
            let matched = self.index.match_hashes(&hashes, now);
            let cached = self.cached_by_slot(&members, &matched);
            matched.recycle();
            cached
        });
        let policy = self.pool.policy();
        // On the lists of a decision dropped on this thread before (their allocations reused).
        let Spare { mut base, outcomes } = take_spare();
        base.clear();
        base.extend(
            members.list.iter().enumerate().filter(|(_, m)| serves(&m.endpoint, meta)).map(
                |(slot, m)| {
                    let metrics = m.metrics();
                    Candidate {
                        slot,
                        metrics,
                        saturated: policy.saturated(metrics.timestamp, now),
                        inflight: m.inflight.snapshot(),
                        cached_blocks: cached.as_ref().map_or(0, |cached| cached[slot]),
                    }
                },
            ),
        );
        let ctx = RequestContext {
            meta,
            prompt_tokens,
            query_blocks: hashes.len(),
            block_size: self.index.config().block_size,
            any_hit: base.iter().any(|c| c.cached_blocks > 0),
            session_slot: self.session_slot(meta, &members, now),
            now,
            members: &members,
            index: Some(&self.index),
        };
        let (outcomes, prefill_outcome, pd) = self.run_handler(&ctx, &base, &mut rng, outcomes)?;
        let cold = !ctx.any_hit;
        Ok(Decision {
            members,
            base,
            outcomes,
            prefill_outcome,
            pd,
            hashes,
            prompt_tokens,
            block_size: self.index.config().block_size,
            cold,
            session_id: meta.session_id.clone(),
            sequence,
        })
    }

    /// Runs profile `i` into `out`, an earlier outcome whose lists are reused (see
    /// [`Profile::run_into`](super::profile::Profile)).
    fn run_profile(
        &self,
        out: ProfileOutcome,
        i: usize,
        ctx: &RequestContext<'_>,
        base: &[Candidate],
        rng: &mut DecisionRng,
    ) -> Result<ProfileOutcome, RoutingError> {
        Ok(self.config.profiles[i].run_into(out, i, ctx, base, rng)?)
    }

    /// The profiles' outcomes, written into `spare` (a dropped decision's list of outcomes,
    /// with their lists: reused, whatever they held).
    #[allow(clippy::type_complexity)]
    fn run_handler(
        &self,
        ctx: &RequestContext<'_>,
        base: &[Candidate],
        rng: &mut DecisionRng,
        mut spare: Vec<ProfileOutcome>,
    ) -> Result<(Vec<ProfileOutcome>, Option<usize>, Option<PdNote>), RoutingError> {
        let primary = match self.config.handler {
            Handler::Single { profile } | Handler::Pd { decode: profile, .. } => profile,
        };
        let first = self.run_profile(spare.pop().unwrap_or_default(), primary, ctx, base, rng)?;
        let Some(chosen) = first.chosen() else {
            return Err(self.no_endpoint(primary, base.len(), ctx));
        };
        let second_spare = spare.pop();
        let mut outcomes = spare;
        outcomes.clear();
        outcomes.push(first);
        let Handler::Pd { prefill, decider, .. } = self.config.handler else {
            return Ok((outcomes, None, None));
        };
        let decode = &base[chosen];
        let uncached_tokens = ctx.uncached_tokens(decode);
        let mut note = PdNote {
            uncached_tokens,
            wanted: decider.wants_prefill(uncached_tokens),
            disaggregated: false,
            reason: PdReason::BelowThreshold,
        };
        if note.wanted {
            let second =
                self.run_profile(second_spare.unwrap_or_default(), prefill, ctx, base, rng)?;
            // A prefill pick that is the decode endpoint (role `both`) is no split: a
            // hand-off to itself would only add a KV transfer (llm-d sets its prefill header
            // whatever the prefill profile picked).
            note.reason = match second.chosen() {
                None => PdReason::NoPrefillEndpoint,
                Some(p) if p == chosen => PdReason::SameEndpoint,
                Some(p) if !decider.keeps_prefill(decode, &base[p]) => PdReason::PrefillQueueLonger,
                Some(_) => PdReason::Split,
            };
            note.disaggregated = note.reason == PdReason::Split;
            outcomes.push(second);
        }
        let prefill_outcome = note.disaggregated.then_some(1);
        Ok((outcomes, prefill_outcome, Some(note)))
    }

    fn no_endpoint(
        &self,
        profile: usize,
        considered: usize,
        ctx: &RequestContext<'_>,
    ) -> RoutingError {
        let name = self.config.profiles[profile].name.clone();
        let members = ctx.members.list.len();
        let detail = if members == 0 {
            "the pool has no endpoints".to_string()
        } else if considered == 0 {
            // Only a model the request names can leave a non-empty pool without candidates.
            let model = ctx.meta.model.as_deref().unwrap_or_default();
            format!("none of the pool's {members} endpoints serves model {model:?}")
        } else {
            format!("the filters removed all {considered} endpoints")
        };
        RoutingError::NoEndpoint { profile: name, detail }
    }

    /// Cached blocks per member slot, from a match keyed by index worker id.
    fn cached_by_slot(&self, members: &Members, matched: &MatchResult) -> Vec<u32> {
        // Not `vec![0; n]`: glibc's `calloc` costs more than `malloc` for a few words.
        let mut cached: Vec<u32> = std::iter::repeat_n(0, members.list.len()).collect();
        if matched.entries.is_empty() {
            return cached;
        }
        let resolve = |ids: &IdMap, cached: &mut [u32]| -> bool {
            if ids.generation != members.generation {
                return false;
            }
            for e in &matched.entries {
                match ids.slots.get(e.worker as usize) {
                    Some(&NOT_A_MEMBER) => {}
                    Some(&slot) => cached[slot as usize] = e.blocks,
                    None => return false,
                }
            }
            true
        };
        if resolve(&self.ids.read(), &mut cached) {
            return cached;
        }
        // A new generation or a worker registered since the map was built: rebuild it.
        let mut ids = self.ids.write();
        *ids = self.build_id_map(members);
        cached.fill(0);
        resolve(&ids, &mut cached);
        cached
    }

    fn build_id_map(&self, members: &Members) -> IdMap {
        let workers: Vec<(WorkerId, WorkerKey)> = self.index.workers();
        let len = workers.iter().map(|(id, _)| *id as usize + 1).max().unwrap_or(0);
        let mut slots = vec![NOT_A_MEMBER; len];
        for (id, key) in workers {
            if let Some(&slot) = members.by_id.get(&key) {
                slots[id as usize] = slot as u32;
            }
        }
        IdMap { generation: members.generation, slots }
    }

    /// The member of the session's live binding, else of the endpoint the request names as
    /// the session's (`session_endpoint`, e.g. a decoded `x-session-token`), when a member.
    fn session_slot(&self, meta: &RequestMeta, members: &Members, now: f64) -> Option<usize> {
        let bound = meta.session_id.as_ref().and_then(|id| {
            self.sessions.with_bound(id, now, |key| members.by_id.get(key).copied())
        });
        bound.or_else(|| meta.session_endpoint.as_ref().and_then(|k| members.by_id.get(k).copied()))
    }

    /// Turns on replica sync for this router: from now on commits are journaled, and the
    /// returned [`ReplicaSync`] publishes them and applies other replicas' batches. Calling it
    /// again gives another handle over the same journal (one handle per router is meant).
    pub fn replica_sync(
        &self,
        replica: String,
        incarnation: u64,
        options: SyncOptions,
    ) -> ReplicaSync {
        ReplicaSync::new(
            replica,
            incarnation,
            self.pool.clone(),
            self.index.clone(),
            self.sessions.clone(),
            self.journal.clone(),
            self.options.record_ttl,
            options,
        )
    }

    /// Sessions bound to endpoints.
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The request of `decision` is being sent to its chosen endpoint (or to `endpoint`, one of
    /// the considered endpoints, e.g. a fallback): adds it to the in-flight counts, records
    /// approximate prefix entries for the endpoints used, binds the session and lets stateful
    /// plugins see the commit. Returns the ticket that gives the counts back.
    pub fn commit(
        &self,
        decision: &Decision,
        endpoint: Option<&WorkerKey>,
        now: f64,
    ) -> Result<Ticket, RoutingError> {
        let decode = match endpoint {
            None => decision.chosen(),
            Some(key) => decision
                .base
                .iter()
                .find(|c| &decision.endpoint(c).id == key)
                .ok_or_else(|| RoutingError::UnknownEndpoint(key.clone()))?,
        };
        let prefill = decision.prefill();
        let decode_key = &decision.endpoint(decode).id;
        let prefill_key = prefill.map(|p| &decision.endpoint(p).id);
        if !decision.hashes.is_empty() {
            self.index.record(decode_key, &decision.hashes, self.options.record_ttl, now)?;
            if let Some(key) = prefill_key {
                self.index.record(key, &decision.hashes, self.options.record_ttl, now)?;
            }
            if self.journal.enabled() {
                for key in std::iter::once(decode_key).chain(prefill_key) {
                    self.journal.push(SyncEntry::Record {
                        endpoint: key.clone(),
                        hashes: decision.hashes.clone(),
                        age_s: 0.0,
                    });
                }
            }
        }
        let member = |c: &Candidate| decision.members.list[c.slot].inflight.clone();
        let uncached = |c: &Candidate| decision.prompt_tokens - decision.cached_tokens(c);
        // Built in place (no list): the prefill share first when split, as before.
        let parts = match prefill {
            Some(p) => [
                Some((member(p), Part::Prefill { uncached_tokens: uncached(p) })),
                Some((member(decode), Part::Decode)),
            ],
            None => {
                [Some((member(decode), Part::Whole { uncached_tokens: uncached(decode) })), None]
            }
        };
        let commit = Commit { decode: decode_key, prefill: prefill_key, cold: decision.cold, now };
        for scorer in &self.config.scorers {
            scorer.on_commit(&commit);
        }
        if let Some(id) = &decision.session_id {
            self.sessions.bind(id, decode_key, now, 0.0);
            if self.journal.enabled() {
                self.journal.push(SyncEntry::Session {
                    endpoint: decode_key.clone(),
                    // As kept: a long id travels as its digest.
                    id: session_key(id).into_owned(),
                    age_s: 0.0,
                });
            }
        }
        Ok(Ticket::start(parts.into_iter().flatten(), decision.prompt_tokens))
    }
}

/// Whether `endpoint` serves the request's model (either side unspecified matches).
fn serves(endpoint: &Endpoint, meta: &RequestMeta) -> bool {
    match (&endpoint.model, &meta.model) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}
