//! The plugin interfaces and the per-request context every plugin reads.
//!
//! A decision computes the expensive parts once (hashing, prefix match, the candidates'
//! metrics and in-flight counts) and hands them to every plugin: the prefix-cache scorer only
//! divides two numbers. Scorers return raw scores; the framework clamps them to [0, 1],
//! weights them and sums them.

use std::sync::Arc;

use super::endpoint::{Endpoint, LoraState, Metrics};
use super::inflight::InFlightSnapshot;
use super::pool::Members;
use super::rng::DecisionRng;
use crate::prefix_index::{PrefixIndex, WorkerKey};

/// What the caller told us about a request, besides its prompt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestMeta {
    pub model: Option<String>,
    pub lora: Option<String>,
    pub priority: i32,
    pub session_id: Option<String>,
    pub headers: Vec<(String, String)>,
    pub cache_salt: Option<String>,
    /// The endpoint the caller names as the session's (llm-d's `x-session-token`, decoded): the
    /// session's endpoint when `session_id` has no live binding. One that is not a member is
    /// ignored.
    pub session_endpoint: Option<WorkerKey>,
}

impl RequestMeta {
    /// The value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// One endpoint as the plugins see it during a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Position in the decision's member list.
    pub slot: usize,
    pub metrics: Metrics,
    /// Stale metrics under the "saturated" policy.
    pub saturated: bool,
    pub inflight: InFlightSnapshot,
    /// Leading blocks of the prompt this endpoint holds (prefix index, any tier).
    pub cached_blocks: u32,
}

/// Everything computed once per request and shared by all plugins.
pub struct RequestContext<'a> {
    pub meta: &'a RequestMeta,
    pub prompt_tokens: u64,
    /// Full blocks in the prompt (hashes matched).
    pub query_blocks: usize,
    pub block_size: usize,
    /// Whether any endpoint of the pool holds part of the prompt.
    pub any_hit: bool,
    /// The member the request's session is bound to (its `session_id`'s live binding, else
    /// its `session_endpoint` when a member), if any.
    pub session_slot: Option<usize>,
    pub now: f64,
    pub members: &'a Members,
    /// The shared prefix index, for the rare plugin that needs more than the match.
    pub index: Option<&'a PrefixIndex>,
}

impl RequestContext<'_> {
    pub fn endpoint(&self, c: &Candidate) -> &Endpoint {
        &self.members.list[c.slot].endpoint
    }

    pub fn id(&self, c: &Candidate) -> &WorkerKey {
        &self.members.list[c.slot].endpoint.id
    }

    pub fn loras(&self, c: &Candidate) -> Arc<LoraState> {
        self.members.list[c.slot].loras()
    }

    /// Prompt tokens `c` holds in its cache.
    pub fn cached_tokens(&self, c: &Candidate) -> u64 {
        (u64::from(c.cached_blocks) * self.block_size as u64).min(self.prompt_tokens)
    }

    /// Prompt tokens `c` would have to prefill.
    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        self.prompt_tokens - self.cached_tokens(c)
    }

    /// Blocks `c` holds in the prefix index (its tree size).
    pub fn held_blocks(&self, c: &Candidate) -> u64 {
        self.index.map_or(0, |index| index.held_blocks(self.id(c)))
    }

    /// Blocks of the prompt, counting a trailing partial block.
    pub fn prompt_blocks(&self) -> u64 {
        self.prompt_tokens.div_ceil(self.block_size as u64)
    }
}

/// An error raised inside a plugin (a user plugin's exception, a bad return value).
#[derive(Debug)]
pub struct PluginError {
    pub plugin: String,
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "plugin {:?} failed: {}", self.plugin, self.source)
    }
}

pub type PluginResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// What happens when a filter would remove every candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnEmpty {
    /// The filter is skipped: all candidates stay.
    FailOpen,
    /// No candidate stays; the profile finds no endpoint.
    FailClosed,
}

/// Keeps some candidates. `keep` starts all true.
pub trait Filter: Send + Sync {
    fn filter(
        &self,
        ctx: &RequestContext<'_>,
        candidates: &[Candidate],
        keep: &mut [bool],
        rng: &mut DecisionRng,
    ) -> PluginResult;

    fn on_empty(&self) -> OnEmpty;

    /// Whether it reads what the prefix index says of the prompt: a candidate's cached blocks,
    /// whether any endpoint holds part of it, the index itself, or what depends on those (the
    /// in-flight uncached prompt tokens). Unknown plugins (a Python callable) do. A router whose
    /// plugins read none of it may decide without hashing the prompt
    /// ([`RouterConfig::reads_prefix_match`](super::config::RouterConfig::reads_prefix_match)).
    fn reads_prefix_match(&self) -> bool {
        true
    }

    /// Whether it reads the session's endpoint ([`RequestContext::session_slot`]): a router
    /// with such a plugin answers with the serving endpoint's session token
    /// ([`RouterConfig::reads_session`](super::config::RouterConfig::reads_session)).
    fn reads_session(&self) -> bool {
        false
    }

    /// Whether a call may take long or wait on a lock (a Python callable: it takes the GIL
    /// and runs for as long as it runs): a server decides with such a plugin off the threads
    /// that serve its connections
    /// ([`RouterConfig::may_block`](super::config::RouterConfig::may_block)).
    fn may_block(&self) -> bool {
        false
    }
}

/// Scores candidates; each score should be in [0, 1] (the framework clamps).
pub trait Scorer: Send + Sync {
    fn score(
        &self,
        ctx: &RequestContext<'_>,
        candidates: &[Candidate],
        scores: &mut [f64],
    ) -> PluginResult;

    /// Whether the score depends on scraped metrics. Saturated candidates then get 0 and the
    /// scorer sees only the others (so min-max scorers normalise over fresh endpoints).
    fn reads_metrics(&self) -> bool {
        false
    }

    /// Whether it reads what the prefix index says of the prompt: a candidate's cached blocks,
    /// whether any endpoint holds part of it, the index itself, or what depends on those (the
    /// in-flight uncached prompt tokens). Unknown plugins (a Python callable) do. A router whose
    /// plugins read none of it may decide without hashing the prompt
    /// ([`RouterConfig::reads_prefix_match`](super::config::RouterConfig::reads_prefix_match)).
    fn reads_prefix_match(&self) -> bool {
        true
    }

    /// Whether it reads the session's endpoint (as [`Filter::reads_session`]).
    fn reads_session(&self) -> bool {
        false
    }

    /// Whether a call may take long or wait on a lock (as [`Filter::may_block`]).
    fn may_block(&self) -> bool {
        false
    }

    /// Called when a decision is committed (the request is sent).
    fn on_commit(&self, _commit: &Commit<'_>) {}

    /// What the scorer needs of the prefix index.
    fn index_hints(&self) -> IndexHints {
        IndexHints::default()
    }

    /// The wiring a precise (KV-event fed) prefix scorer needs around the router.
    fn precise(&self) -> Option<&super::scorers::precise_prefix::PreciseSpec> {
        None
    }
}

/// What a plugin asks of the prefix index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexHints {
    pub block_size: Option<usize>,
    pub worker_capacity: Option<u64>,
    /// A cap in tokens on the prefix a scorer reads (`maxPrefixTokensToMatch`).
    pub max_tokens: Option<u64>,
}

/// Orders candidates: the first is chosen, the rest are fallbacks. Writes at most `limit`
/// indices into `order` (which starts empty).
pub trait Picker: Send + Sync {
    fn pick(
        &self,
        ctx: &RequestContext<'_>,
        candidates: &[Candidate],
        totals: &[f64],
        rng: &mut DecisionRng,
        order: &mut Vec<usize>,
    ) -> PluginResult;

    /// Most endpoints returned (the chosen one and its fallbacks).
    fn limit(&self) -> usize;

    /// Whether it reads what the prefix index says of the prompt: a candidate's cached blocks,
    /// whether any endpoint holds part of it, the index itself, or what depends on those (the
    /// in-flight uncached prompt tokens). Unknown plugins (a Python callable) do. A router whose
    /// plugins read none of it may decide without hashing the prompt
    /// ([`RouterConfig::reads_prefix_match`](super::config::RouterConfig::reads_prefix_match)).
    fn reads_prefix_match(&self) -> bool {
        true
    }

    /// Whether it reads the weighted totals of the scorers. A picker that orders endpoints by
    /// its own measure (at random, in turn, by its own cost) makes a profile's scorers moot:
    /// the configuration notes it.
    fn reads_scores(&self) -> bool {
        true
    }

    /// Whether it reads [`RequestContext::held_blocks`] (the size of an endpoint's tree in the
    /// prefix index): a caller that leaves out of the index blocks no match can reach (the
    /// simulator) keeps every match the same but not the tree sizes.
    fn reads_tree_size(&self) -> bool {
        false
    }
}

/// A committed decision, as the stateful plugins see it.
pub struct Commit<'a> {
    pub decode: &'a WorkerKey,
    pub prefill: Option<&'a WorkerKey>,
    /// No endpoint held any part of the prompt.
    pub cold: bool,
    pub now: f64,
}
