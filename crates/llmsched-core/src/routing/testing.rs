//! Test fixtures: a member list and candidates built from plain numbers.

use std::sync::Arc;

use super::endpoint::{Endpoint, Metrics};
use super::inflight::InFlightSnapshot;
use super::plugin::{Candidate, RequestContext, RequestMeta};
use super::pool::{Member, Members};
use crate::prefix_index::WorkerKey;

pub struct Fixture {
    pub members: Members,
    pub meta: RequestMeta,
    pub candidates: Vec<Candidate>,
    pub prompt_tokens: u64,
    pub block_size: usize,
    pub session_slot: Option<usize>,
}

impl Fixture {
    /// `n` endpoints named "e0".."e{n-1}", idle, fresh metrics, nothing cached; a 160-token
    /// prompt in blocks of 16.
    pub fn new(n: usize) -> Fixture {
        let list = (0..n)
            .map(|i| Arc::new(Member::new(Endpoint::new(WorkerKey::Str(format!("e{i}"))))))
            .collect();
        let candidates = (0..n)
            .map(|slot| Candidate {
                slot,
                metrics: Metrics { timestamp: 0.0, ..Metrics::default() },
                saturated: false,
                inflight: InFlightSnapshot::default(),
                cached_blocks: 0,
            })
            .collect();
        Fixture {
            members: Members::build(list),
            meta: RequestMeta::default(),
            candidates,
            prompt_tokens: 160,
            block_size: 16,
            session_slot: None,
        }
    }

    pub fn waiting(mut self, values: &[u32]) -> Self {
        self.candidates.iter_mut().zip(values).for_each(|(c, &v)| c.metrics.waiting = v);
        self
    }

    pub fn running(mut self, values: &[u32]) -> Self {
        self.candidates.iter_mut().zip(values).for_each(|(c, &v)| c.metrics.running = v);
        self
    }

    pub fn kv(mut self, values: &[f64]) -> Self {
        self.candidates.iter_mut().zip(values).for_each(|(c, &v)| c.metrics.kv_cache_usage = v);
        self
    }

    pub fn cached(mut self, values: &[u32]) -> Self {
        self.candidates.iter_mut().zip(values).for_each(|(c, &v)| c.cached_blocks = v);
        self
    }

    pub fn inflight(mut self, requests: &[u64], prefill_tokens: &[u64]) -> Self {
        for (c, (&r, &t)) in self.candidates.iter_mut().zip(requests.iter().zip(prefill_tokens)) {
            c.inflight.requests = r;
            c.inflight.prefill_requests = r;
            c.inflight.prefill_tokens = t;
            c.inflight.tokens = t;
        }
        self
    }

    pub fn ctx(&self) -> RequestContext<'_> {
        RequestContext {
            meta: &self.meta,
            prompt_tokens: self.prompt_tokens,
            query_blocks: self.prompt_tokens as usize / self.block_size,
            block_size: self.block_size,
            any_hit: self.candidates.iter().any(|c| c.cached_blocks > 0),
            session_slot: self.session_slot,
            now: 0.0,
            members: &self.members,
            index: None,
        }
    }

    /// Runs a scorer over all candidates.
    pub fn score(&self, scorer: &dyn super::plugin::Scorer) -> Vec<f64> {
        let mut out = vec![f64::NAN; self.candidates.len()];
        scorer.score(&self.ctx(), &self.candidates, &mut out).unwrap();
        out
    }

    /// Runs a filter over all candidates; returns the kept slots.
    pub fn filter(&self, filter: &dyn super::plugin::Filter) -> Vec<usize> {
        let mut keep = vec![true; self.candidates.len()];
        let mut rng = super::rng::DecisionRng::new(0, 0);
        filter.filter(&self.ctx(), &self.candidates, &mut keep, &mut rng).unwrap();
        (0..keep.len()).filter(|&i| keep[i]).collect()
    }
}

pub fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
}
