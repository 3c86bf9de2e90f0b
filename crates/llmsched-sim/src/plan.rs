//! A workload, materialised: every request's lengths and block hashes, generated once (by
//! [`crate::workload`], or from the Python workload classes' requests, which build the same
//! plan) and replayed by the engine.
//!
//! Only *when* a closed-loop session's next turn arrives depends on the simulation (its previous
//! turn's finish plus a think time); what it contains depends only on the seed and the session's
//! number, so a plan holds sessions as scripts and the engine starts turns as turns finish.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use crate::kv_cache::ByContent;

/// A request whose arrival time is fixed in advance (open loop).
#[derive(Debug, Clone, PartialEq)]
pub struct OpenRequest {
    pub arrival: f64,
    pub prompt_len: u64,
    pub output_len: u64,
    pub tenant: i64,
    pub priority: i64,
    pub session: Option<String>,
    /// Into [`Plan::hashes`]: the chained hashes of the full blocks of prompt plus output.
    pub hashes: Range<usize>,
}

/// One turn of a session script.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    pub prompt_len: u64,
    pub output_len: u64,
    /// Leading hashes of the session's chain this turn covers.
    pub blocks: usize,
    /// Think time after this turn finishes (before the next turn, or before a new session).
    pub think: f64,
}

/// A multi-turn session: each turn's prompt is the previous prompt, output and a new message.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub tenant: i64,
    pub hashes: Range<usize>,
    pub turns: Vec<Turn>,
}

/// A whole workload. The builders own its hashes; a caller that has them already (the Python
/// bindings, in a numpy array) lends them instead of copying hundreds of megabytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan<'h> {
    pub hashes: Cow<'h, [u64]>,
    /// Open-loop requests in arrival order (empty for a session workload).
    pub open: Vec<OpenRequest>,
    /// Session scripts by session number.
    pub sessions: Vec<Session>,
    /// Start times of the sessions started by the arrival stream (the first `starts.len()`).
    pub starts: Vec<f64>,
    /// Closed loop: a finished session starts the next one after its last think time.
    pub closed: bool,
    /// `hashes` numbered once for every run of the plan (None: each run numbers them).
    pub contents: Option<Arc<Contents>>,
}

/// Dense content ids for a hash array: equal hashes get equal ids, numbered by first
/// appearance, so the KV caches index arrays by id instead of hashing 64-bit hashes.
/// Built only by [`Contents::number`], so ids and hashes always agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    ids: Vec<u32>,
    unique: Vec<u64>,
}

impl Contents {
    /// Numbers `hashes` (one hash-map pass).
    pub fn number(hashes: &[u64]) -> Self {
        let mut number: ByContent<u32> = ByContent::default();
        number.reserve(hashes.len());
        let mut unique = Vec::new();
        let ids = hashes
            .iter()
            .map(|&h| {
                *number.entry(h).or_insert_with(|| {
                    unique.push(h);
                    (unique.len() - 1) as u32
                })
            })
            .collect();
        Contents { ids, unique }
    }

    /// The numbering of `hashes` a plan builder already knows (`ids[i]` the id of
    /// `hashes[i]`, `unique[id]` its hash), accepted only when it is exactly what
    /// [`Contents::number`] would build: ids numbered by first appearance, each id's hash the
    /// hash at its positions, and no hash under two ids (checked by sorting `unique` in
    /// buckets of its top bits, without a hash map). None otherwise.
    pub fn from_parts(hashes: &[u64], ids: Vec<u32>, unique: Vec<u64>) -> Option<Self> {
        Self::exact(hashes, &ids, &unique).then_some(Contents { ids, unique })
    }

    /// Whether `ids` and `unique` are exactly the numbering [`Contents::number`] would build
    /// for `hashes` (the check [`Contents::from_parts`] makes).
    pub fn exact(hashes: &[u64], ids: &[u32], unique: &[u64]) -> bool {
        if ids.len() != hashes.len() || unique.len() > u32::MAX as usize {
            return false;
        }
        let mut next = 0u32;
        for (&id, &h) in ids.iter().zip(hashes) {
            if id > next || unique.get(id as usize) != Some(&h) {
                return false;
            }
            next += u32::from(id == next);
        }
        next as usize == unique.len() && !has_duplicates(unique)
    }

    /// A numbering [`Contents::exact`] accepted.
    pub(crate) fn checked(ids: Vec<u32>, unique: Vec<u64>) -> Self {
        Contents { ids, unique }
    }

    /// The id of each position of the numbered hash array.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Each id's hash.
    pub fn unique(&self) -> &[u64] {
        &self.unique
    }

    /// Whether these are the ids of `hashes` (one pass, no hashing).
    pub fn numbers(&self, hashes: &[u64]) -> bool {
        self.ids.len() == hashes.len()
            && self.ids.iter().zip(hashes).all(|(&id, &h)| self.unique.get(id as usize) == Some(&h))
    }
}

/// Whether any value occurs twice: a scatter by the top 8 bits into 256 buckets, then each
/// bucket (cache-sized for a plan's hashes) scattered by the next 8 bits and each small part
/// sorted. Two passes of 256 write streams each: one pass of 65,536 streams missed the cache
/// and the TLB on nearly every write.
fn has_duplicates(values: &[u64]) -> bool {
    const SMALL: usize = 1 << 12;
    if values.len() < SMALL {
        return sorted_has_duplicates(&mut values.to_vec());
    }
    let mut scattered = vec![0u64; values.len()];
    let starts = scatter(values, 56, &mut scattered);
    let buckets = |range: &[usize]| {
        let mut scratch = Vec::new();
        range.windows(2).any(|w| {
            let bucket = &scattered[w[0]..w[1]];
            if bucket.len() < SMALL {
                return sorted_has_duplicates(&mut bucket.to_vec());
            }
            scratch.resize(bucket.len(), 0);
            let inner = scatter(bucket, 48, &mut scratch);
            inner.windows(2).any(|v| sorted_has_duplicates(&mut scratch[v[0]..v[1]]))
        })
    };
    // The buckets are independent: two threads take half of them each (the answer is the
    // same however they are shared out).
    let (low, high) = (&starts[..=128], &starts[128..]);
    std::thread::scope(|scope| {
        let other = scope.spawn(|| buckets(high));
        let found = buckets(low);
        // A panicking thread (it cannot: slices in bounds) would count as a duplicate, which
        // only sends the caller to the exact numbering.
        other.join().unwrap_or(true) || found
    })
}

/// `values` into `out` grouped by the 8 bits at `shift` (stable); the groups' start offsets
/// (257 of them, the last `values.len()`).
fn scatter(values: &[u64], shift: u32, out: &mut [u64]) -> Vec<usize> {
    let digit = |v: u64| ((v >> shift) & 0xff) as usize;
    let mut starts = vec![0usize; 257];
    for &v in values {
        starts[digit(v) + 1] += 1;
    }
    for d in 0..256 {
        starts[d + 1] += starts[d];
    }
    let mut fill = starts.clone();
    for &v in values {
        let d = digit(v);
        out[fill[d]] = v;
        fill[d] += 1;
    }
    starts
}

fn sorted_has_duplicates(values: &mut [u64]) -> bool {
    values.sort_unstable();
    values.windows(2).any(|w| w[0] == w[1])
}

/// Why a plan is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid workload plan: {0}")]
pub struct PlanError(pub String);

impl Plan<'_> {
    /// Checks every range and count, so the engine may index without further checks.
    pub fn validate(&self) -> Result<(), PlanError> {
        let n = self.hashes.len();
        let bad = |what: String| Err(PlanError(what));
        if !self.open.is_empty() && !self.sessions.is_empty() {
            return bad("a plan has open requests or sessions, not both".into());
        }
        if self.starts.len() > self.sessions.len() {
            return bad("more session starts than sessions".into());
        }
        for (i, r) in self.open.iter().enumerate() {
            if r.hashes.start > r.hashes.end || r.hashes.end > n {
                return bad(format!("request {i}: hash range out of bounds"));
            }
            if r.prompt_len == 0 || !r.arrival.is_finite() {
                return bad(format!("request {i}: empty prompt or arrival not finite"));
            }
        }
        for (i, s) in self.sessions.iter().enumerate() {
            if s.hashes.start > s.hashes.end || s.hashes.end > n {
                return bad(format!("session {i}: hash range out of bounds"));
            }
            if s.turns.is_empty() {
                return bad(format!("session {i}: no turns"));
            }
            for t in &s.turns {
                if t.blocks > s.hashes.len()
                    || t.prompt_len == 0
                    || t.think.is_nan()
                    || t.think < 0.0
                {
                    return bad(format!("session {i}: a turn is malformed"));
                }
            }
        }
        if self.starts.iter().any(|t| !t.is_finite()) {
            return bad("session start not finite".into());
        }
        if self.contents.as_ref().is_some_and(|c| !c.numbers(&self.hashes)) {
            return bad("content ids were numbered from other hashes".into());
        }
        Ok(())
    }

    /// Requests the plan makes in all.
    pub fn expected_requests(&self) -> usize {
        self.open.len() + self.sessions.iter().map(|s| s.turns.len()).sum::<usize>()
    }

    /// Where each request's private blocks begin: the blocks after its last block whose
    /// content (`ids`, numbering `contents` distinct contents) some other request, or another
    /// of its own positions, holds too. Call on a validated plan.
    pub(crate) fn private_from(&self, ids: &[u32], contents: usize) -> PrivateFrom {
        // Occurrences per content, counted to 2.
        let mut seen = vec![0u8; contents];
        let mut count = |range: Range<usize>| {
            for &id in &ids[range] {
                let c = &mut seen[id as usize];
                *c = (*c + 1).min(2);
            }
        };
        for r in &self.open {
            count(r.hashes.clone());
        }
        for s in &self.sessions {
            for t in &s.turns {
                count(s.hashes.start..s.hashes.start + t.blocks);
            }
        }
        let from = |range: Range<usize>| {
            let private = ids[range.clone()].iter().rev().take_while(|&&id| seen[id as usize] == 1);
            u32::try_from(range.len() - private.count()).unwrap_or(u32::MAX)
        };
        PrivateFrom {
            open: self.open.iter().map(|r| from(r.hashes.clone())).collect(),
            turns: self
                .sessions
                .iter()
                .map(|s| {
                    s.turns
                        .iter()
                        .map(|t| from(s.hashes.start..s.hashes.start + t.blocks))
                        .collect()
                })
                .collect(),
        }
    }
}

/// Per request, the offset into its blocks where its private blocks begin: no other request
/// holds any of them, so no other request's prefix match can reach them (see
/// [`Plan::private_from`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PrivateFrom {
    /// Per open request.
    pub open: Vec<u32>,
    /// Per session, per turn.
    pub turns: Vec<Vec<u32>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_blocks_are_the_tail_no_other_request_holds() {
        let open = |hashes: Range<usize>| OpenRequest {
            arrival: 0.0,
            prompt_len: 64,
            output_len: 1,
            tenant: 0,
            priority: 0,
            session: None,
            hashes,
        };
        // Two requests share their first two blocks; the third holds nothing of its own.
        let plan = Plan {
            hashes: vec![1, 2, 3, 4, 1, 2, 5, 1, 2].into(),
            open: vec![open(0..4), open(4..7), open(7..9)],
            ..Plan::default()
        };
        let c = Contents::number(&plan.hashes);
        let private = plan.private_from(c.ids(), c.unique().len());
        assert_eq!(private.open, vec![2, 2, 2]);
        // A session's turns hold their predecessors' blocks: only the last turn's new ones
        // are private.
        let turn = |blocks| Turn { prompt_len: 64, output_len: 1, blocks, think: 0.0 };
        let plan = Plan {
            hashes: vec![10, 11, 12, 13, 14].into(),
            sessions: vec![Session {
                tenant: 0,
                hashes: 0..5,
                turns: vec![turn(2), turn(3), turn(5)],
            }],
            ..Plan::default()
        };
        let c = Contents::number(&plan.hashes);
        assert_eq!(plan.private_from(c.ids(), c.unique().len()).turns, vec![vec![2, 3, 3]]);
    }

    #[test]
    fn known_numberings_are_checked() {
        let hashes = [5u64, 9, 5, 7];
        let good = Contents::from_parts(&hashes, vec![0, 1, 0, 2], vec![5, 9, 7]).unwrap();
        assert_eq!(good, Contents::number(&hashes));
        assert!(Contents::from_parts(&hashes, vec![0, 1, 2, 3], vec![5, 9, 5, 7]).is_none());
        assert!(Contents::from_parts(&hashes, vec![1, 0, 1, 2], vec![9, 5, 7]).is_none());
        assert!(Contents::from_parts(&hashes, vec![0, 1, 0, 2], vec![5, 9, 8]).is_none());
    }

    #[test]
    fn duplicates_are_found_in_large_arrays() {
        let mut values: Vec<u64> =
            (0..100_000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
        assert!(!has_duplicates(&values));
        values.push(values[77]);
        assert!(has_duplicates(&values));
        // Values sharing their top 16 bits land in one bucket of both passes: found there too,
        // in either thread's half of the buckets.
        for top in [0x12CD_u64, 0xABCD] {
            let mut close: Vec<u64> = (0..50_000u64).map(|i| (top << 48) | (i * 977)).collect();
            assert!(!has_duplicates(&close));
            close.push((top << 48) | (977 * 49_999));
            assert!(has_duplicates(&close));
        }
    }
}
