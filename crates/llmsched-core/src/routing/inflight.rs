//! Router-side in-flight accounting per endpoint: requests and tokens the router sent there and
//! that have not finished. These counts are fresh (the router made the decisions), unlike
//! scraped metrics.
//!
//! A [`Ticket`] holds one request's share on each endpoint it uses and gives it back in steps:
//! at the first token the prefill share goes (the whole share of a separate prefill endpoint), at
//! the end everything. Dropping a ticket finishes it, so counts cannot leak.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crossbeam_utils::atomic::AtomicCell;

/// Counters of one endpoint. Shared by the pool and by tickets through an `Arc`.
///
/// Beside this router's own counts it holds what other router replicas report they sent to
/// the same endpoint (see [`crate::routing::replica_sync`]); decisions read the sum, so
/// replicas that share their counts do not herd onto one endpoint between scrapes.
#[derive(Debug, Default)]
pub struct InFlight {
    requests: AtomicI64,
    prefill_requests: AtomicI64,
    prefill_tokens: AtomicI64,
    tokens: AtomicI64,
    remote: AtomicCell<InFlightSnapshot>,
}

/// A copy of an endpoint's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightSnapshot {
    /// Requests sent and not finished.
    pub requests: u64,
    /// Of those, requests that have not produced their first token.
    pub prefill_requests: u64,
    /// Uncached prompt tokens of requests that have not produced their first token.
    pub prefill_tokens: u64,
    /// Prompt tokens of all requests sent and not finished.
    pub tokens: u64,
}

impl InFlightSnapshot {
    fn plus(self, other: InFlightSnapshot) -> InFlightSnapshot {
        InFlightSnapshot {
            requests: self.requests.saturating_add(other.requests),
            prefill_requests: self.prefill_requests.saturating_add(other.prefill_requests),
            prefill_tokens: self.prefill_tokens.saturating_add(other.prefill_tokens),
            tokens: self.tokens.saturating_add(other.tokens),
        }
    }

    /// The field-wise sum of `loads`, saturating.
    pub fn sum<'a>(loads: impl IntoIterator<Item = &'a InFlightSnapshot>) -> InFlightSnapshot {
        loads.into_iter().fold(InFlightSnapshot::default(), |acc, l| acc.plus(*l))
    }
}

impl InFlight {
    /// What decisions see: this router's counts plus the other replicas' reported counts.
    pub fn snapshot(&self) -> InFlightSnapshot {
        self.local().plus(self.remote.load())
    }

    /// This router's own counts only (what it reports to other replicas).
    pub fn local(&self) -> InFlightSnapshot {
        let read = |a: &AtomicI64| a.load(Ordering::Relaxed).max(0) as u64;
        InFlightSnapshot {
            requests: read(&self.requests),
            prefill_requests: read(&self.prefill_requests),
            prefill_tokens: read(&self.prefill_tokens),
            tokens: read(&self.tokens),
        }
    }

    /// The other replicas' counts on this endpoint, replacing what was set before.
    pub fn set_remote(&self, load: InFlightSnapshot) {
        self.remote.store(load);
    }

    /// The other replicas' counts last set.
    pub fn remote(&self) -> InFlightSnapshot {
        self.remote.load()
    }

    fn add(&self, share: &Share, sign: i64) {
        self.requests.fetch_add(sign * share.requests, Ordering::Relaxed);
        self.prefill_requests.fetch_add(sign * share.prefill_requests, Ordering::Relaxed);
        self.prefill_tokens.fetch_add(sign * share.prefill_tokens, Ordering::Relaxed);
        self.tokens.fetch_add(sign * share.tokens, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Share {
    requests: i64,
    prefill_requests: i64,
    prefill_tokens: i64,
    tokens: i64,
}

/// What a request does on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Prefill and decode on one endpoint.
    Whole { uncached_tokens: u64 },
    /// Prefill only: the share ends at the first token.
    Prefill { uncached_tokens: u64 },
    /// Decode only, after a remote prefill.
    Decode,
}

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Running,
    Decoding,
    Finished,
}

/// One request's in-flight share on the endpoints it uses.
///
/// A request uses one endpoint, or two when split (its prefill and decode endpoints): the
/// shares are held inline, so that a ticket allocates nothing.
#[derive(Debug)]
pub struct Ticket {
    holdings: [Option<(Arc<InFlight>, Part, Share)>; 2],
    stage: Stage,
}

impl Ticket {
    /// Adds the request to each endpoint's counters (at most two: a request's prefill and
    /// decode endpoints; panics on more).
    pub fn start(
        parts: impl IntoIterator<Item = (Arc<InFlight>, Part)>,
        prompt_tokens: u64,
    ) -> Ticket {
        let tokens = prompt_tokens as i64;
        let mut holdings = [None, None];
        for (i, (counters, part)) in parts.into_iter().enumerate() {
            assert!(i < holdings.len(), "a ticket holds shares on at most two endpoints");
            let share = match part {
                Part::Whole { uncached_tokens } | Part::Prefill { uncached_tokens } => Share {
                    requests: 1,
                    prefill_requests: 1,
                    prefill_tokens: uncached_tokens as i64,
                    tokens,
                },
                Part::Decode => Share { requests: 1, tokens, ..Share::default() },
            };
            counters.add(&share, 1);
            holdings[i] = Some((counters, part, share));
        }
        Ticket { holdings, stage: Stage::Running }
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The first token arrived: prefill work is done. Returns false if it was already noted or
    /// the request finished.
    pub fn first_token(&mut self) -> bool {
        if self.stage != Stage::Running {
            return false;
        }
        for (counters, part, share) in self.holdings.iter_mut().flatten() {
            let done = match part {
                Part::Prefill { .. } => *share,
                Part::Whole { .. } => Share {
                    prefill_requests: share.prefill_requests,
                    prefill_tokens: share.prefill_tokens,
                    ..Share::default()
                },
                Part::Decode => Share::default(),
            };
            counters.add(&done, -1);
            share.requests -= done.requests;
            share.prefill_requests -= done.prefill_requests;
            share.prefill_tokens -= done.prefill_tokens;
            share.tokens -= done.tokens;
        }
        self.stage = Stage::Decoding;
        true
    }

    /// The request ended (success, error or cancel): gives back everything still held. Returns
    /// false if it had already finished.
    pub fn finish(&mut self) -> bool {
        if self.stage == Stage::Finished {
            return false;
        }
        for (counters, _, share) in self.holdings.iter_mut().flatten() {
            counters.add(share, -1);
            *share = Share::default();
        }
        self.stage = Stage::Finished;
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_return_to_zero_in_steps() {
        let d = Arc::new(InFlight::default());
        let p = Arc::new(InFlight::default());
        let mut local = Ticket::start(vec![(d.clone(), Part::Whole { uncached_tokens: 30 })], 100);
        let mut split = Ticket::start(
            vec![(p.clone(), Part::Prefill { uncached_tokens: 80 }), (d.clone(), Part::Decode)],
            100,
        );
        let s = d.snapshot();
        assert_eq!((s.requests, s.prefill_requests, s.prefill_tokens, s.tokens), (2, 1, 30, 200));
        assert_eq!(p.snapshot().prefill_tokens, 80);
        assert!(split.first_token());
        assert_eq!(p.snapshot(), InFlightSnapshot::default());
        assert!(local.first_token());
        assert!(!local.first_token());
        let s = d.snapshot();
        assert_eq!((s.requests, s.prefill_requests, s.prefill_tokens, s.tokens), (2, 0, 0, 200));
        assert!(local.finish());
        assert!(!local.finish());
        drop(split);
        assert_eq!(d.snapshot(), InFlightSnapshot::default());
    }

    /// The shares are held inline, two at most (a request's prefill and decode endpoints):
    /// a third is refused before any count is taken for it.
    #[test]
    #[should_panic(expected = "at most two endpoints")]
    fn a_ticket_holds_two_shares_at_most() {
        let d = Arc::new(InFlight::default());
        let _ = Ticket::start(
            [
                (d.clone(), Part::Prefill { uncached_tokens: 1 }),
                (d.clone(), Part::Decode),
                (d.clone(), Part::Decode),
            ],
            10,
        );
    }

    #[test]
    fn remote_counts_add_to_what_decisions_see_but_not_to_the_local_share() {
        let d = Arc::new(InFlight::default());
        let _t = Ticket::start(vec![(d.clone(), Part::Whole { uncached_tokens: 10 })], 40);
        let remote =
            InFlightSnapshot { requests: 3, prefill_requests: 1, prefill_tokens: 7, tokens: 90 };
        d.set_remote(remote);
        let s = d.snapshot();
        assert_eq!((s.requests, s.prefill_requests, s.prefill_tokens, s.tokens), (4, 2, 17, 130));
        assert_eq!(d.local().requests, 1);
        assert_eq!(d.remote(), remote);
        d.set_remote(InFlightSnapshot::default());
        assert_eq!(d.snapshot(), d.local());
        let big = InFlightSnapshot { requests: u64::MAX, ..InFlightSnapshot::default() };
        d.set_remote(big);
        assert_eq!(d.snapshot().requests, u64::MAX, "saturates, never wraps");
    }
}
