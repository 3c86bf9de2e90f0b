//! Replica sync: what one router replica learns that the other replicas of its cluster need,
//! as compact batches for a message bus to carry.
//!
//! Several router replicas in front of the same engines each see only their own requests. Left
//! alone they herd: between two scrapes each one sends its next requests to the engine that
//! looks idle to it, and a prompt routed by one replica is news to the others' prefix index
//! until the engine's KV events arrive. With sync on ([`SyncJournal::enable`]), a router
//! journals what it learns at commit time: the approximate prefix record of the request and
//! its session binding. [`ReplicaSync::outgoing`] drains the journal into a [`SyncBatch`] with
//! the replica's own in-flight counts per endpoint; [`ReplicaSync::incoming`] applies another
//! replica's batch: records go into the index with the router's record TTL (less the entry's
//! age), sessions are bound, and the replica's counts replace the ones it sent before. An
//! endpoint's remote count, which decisions add to their own, is the sum over the replicas
//! heard from within `load_ttl` seconds.
//!
//! Counts travel as absolute values per replica, not as deltas: a lost batch is healed by the
//! next one, and a replica that dies stops counting once its counts expire, instead of leaving
//! a drift behind. Records and sessions are idempotent (recording a prefix twice, or binding a
//! session to the endpoint it is bound to, changes nothing), so duplicates are harmless.
//!
//! A peer is a name and an incarnation. Incarnations of one name are ordered (`llmsched.cluster`
//! makes them from the start time): a newer incarnation replaces the older ones (a restart),
//! and a batch of an older one that arrives after a newer one was heard (a previous life's
//! batch, late) is dropped and counted ([`IncomingReport::stale`]). An older incarnation that
//! speaks again after the newer one spoke (their batches interleave: a dead life cannot answer
//! back), or keeps speaking for longer than `load_ttl`, or a newer one with this replica's own
//! name, shows two live replicas sharing a name: both count, and the name is listed
//! ([`ReplicaSync::shared_names`]) and its batches counted. [`ReplicaSync::outgoing_split`]
//! keeps every batch within the bus's message limit.
//!
//! Catch-up: a replica keeps its own records and session bindings with the sequence of their
//! batch, and tracks per peer incarnation the sequence through which it has that peer's
//! batches (a cursor). A connecting replica sends its cursors ([`ReplicaSync::catch_up_request`]);
//! each peer answers ([`ReplicaSync::answer`]) only its own entries past the asker's cursor for
//! it, or its records and the live sessions it owns when it has none; the answer's last batch
//! carries the peer's sequence, which moves the asker's cursor. A session is owned by the
//! replica whose binding is held (the last heard to use it). A replica that knew no peer then
//! asks one peer that answered for the sessions whose owner is none of those that answered
//! (a replica since gone, or one that did not answer), so that each session arrives once, and
//! for the records it applied from such replicas (a departed replica's engines, shared by every
//! replica, still hold what it routed there). A
//! gap in a peer's sequence (batches lost, or published while the bus was away) asks that
//! peer alone for what is missing ([`ReplicaSync::repair_requests`]), once until answered; a
//! repair the carrier gives up unanswered ([`ReplicaSync::repair_unanswered`]) is asked again
//! when a later batch of that peer shows the gap.
//!
//! Wire format (version 2, little-endian): `b"LSYN"`, version `u8`, replica name (`u16` length
//! then UTF-8), incarnation `u64` (random per process start), sequence `u64`, the sender's
//! hashing `u64` ([`PrefixIndex::hashing_fingerprint`]: block size, seed and model; version 1
//! has no such field, and its records are applied unchecked), then `u32` count
//! of loads (endpoint key, four `u64`: requests, prefill requests, prefill tokens, tokens), then
//! `u32` count of entries, each a tag `u8` (1: record, 2: session), the endpoint key, the age in
//! seconds `f32`, then for a record a `u32` count of block hashes and the `u64` hashes, for a
//! session its id (`u16` length then UTF-8). An endpoint key is a tag `u8` (0: integer, `i64`;
//! 1: string, `u16` length then UTF-8). Every length is checked against the bytes left before
//! anything is allocated, so a hostile batch costs at most its own size. A catch-up answer is
//! batches of this format without loads: sequence 0, except the last, which carries the
//! sender's sequence through which the answer is complete.
//!
//! Catch-up request (version 1, little-endian): `b"LSYQ"`, version `u8`, the asker's name
//! (`u16` length then UTF-8) and incarnation `u64`, flags `u8` (1: sessions wanted: with a
//! target, every live one whose owner is neither the asker nor a listed peer with a sequence
//! above 0, and the records applied from such peers; without, from a first start of the
//! release before, every live one; 2: a target
//! follows), the target's name and incarnation when flagged (only it answers), then `u32`
//! count of cursors, each a peer's name, incarnation `u64` and the sequence `u64` through
//! which the asker has its batches. A request without the magic
//! (the first format: the asker's name and incarnation as text) is answered in full.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;
use thiserror::Error;

use super::inflight::InFlightSnapshot;
use super::pool::{EndpointPool, Members};
use super::sessions::{session_key, Sessions};
use crate::prefix_index::{PrefixIndex, WorkerKey};
use crate::protocols::BlockHash;

const MAGIC: &[u8; 4] = b"LSYN";
const VERSION: u8 = 2;
/// The first version, without the sender's hashing: still read.
const VERSION_UNCHECKED: u8 = 1;
/// Most batches one batch's sequence adds to `missed_in`: a number far ahead (a bug) is not a
/// measure of what was lost.
const MAX_MISSED_COUNTED: u64 = 1 << 20;
const TAG_RECORD: u8 = 1;
const TAG_SESSION: u8 = 2;
const KEY_INT: u8 = 0;
const KEY_STR: u8 = 1;
/// The largest batch [`decode`] reads.
pub const MAX_BATCH_BYTES: usize = 16 << 20;

/// One thing a replica learned at commit time.
#[derive(Debug, Clone, PartialEq)]
pub enum SyncEntry {
    /// The request's prompt blocks were sent to `endpoint`: an approximate prefix record.
    Record { endpoint: WorkerKey, hashes: Vec<BlockHash>, age_s: f32 },
    /// The session `id` is bound to `endpoint`.
    Session { endpoint: WorkerKey, id: String, age_s: f32 },
}

/// One replica's message: who sent it, its counts per endpoint, and what it learned.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SyncBatch {
    pub replica: String,
    pub incarnation: u64,
    pub seq: u64,
    /// The sender's [`PrefixIndex::hashing_fingerprint`] (`None`: a version-1 batch, encoded
    /// as one).
    pub hashing: Option<u64>,
    /// Endpoints where the replica has requests in flight; absent endpoints count 0.
    pub loads: Vec<(WorkerKey, InFlightSnapshot)>,
    pub entries: Vec<SyncEntry>,
}

/// A batch that cannot be read: where and why.
#[derive(Debug, Error, PartialEq)]
#[error("sync batch: {message} at byte {offset}")]
pub struct SyncError {
    pub offset: usize,
    pub message: String,
}

// ---- the journal ---------------------------------------------------------------------------

/// What a router learned since the last drain. Off until enabled; bounded: entries past the
/// limit are dropped and counted (the next batches still carry counts, and records come back
/// with the engines' KV events).
#[derive(Debug, Default)]
pub struct SyncJournal {
    enabled: AtomicBool,
    limit: AtomicUsize,
    entries: Mutex<Vec<SyncEntry>>,
    dropped: AtomicU64,
}

impl SyncJournal {
    /// Starts journaling, keeping at most `limit` entries between drains.
    pub fn enable(&self, limit: usize) {
        self.limit.store(limit.max(1), Ordering::Relaxed);
        self.enabled.store(true, Ordering::Release);
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Adds an entry (a no-op while sync is off).
    pub fn push(&self, entry: SyncEntry) {
        if !self.enabled() {
            return;
        }
        let mut entries = self.entries.lock();
        if entries.len() >= self.limit.load(Ordering::Relaxed) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        entries.push(entry);
    }

    /// Everything journaled since the last drain.
    pub fn drain(&self) -> Vec<SyncEntry> {
        std::mem::take(&mut *self.entries.lock())
    }

    /// Entries dropped because the journal was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

// ---- the codec -----------------------------------------------------------------------------

fn put_str(out: &mut Vec<u8>, s: &str) -> bool {
    let Ok(len) = u16::try_from(s.len()) else { return false };
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    true
}

fn put_key(out: &mut Vec<u8>, key: &WorkerKey) -> bool {
    match key {
        WorkerKey::Int(i) => {
            out.push(KEY_INT);
            out.extend_from_slice(&i.to_le_bytes());
            true
        }
        WorkerKey::Str(s) => {
            out.push(KEY_STR);
            put_str(out, s)
        }
    }
}

fn key_fits(key: &WorkerKey) -> bool {
    match key {
        WorkerKey::Int(_) => true,
        WorkerKey::Str(s) => s.len() <= u16::MAX as usize,
    }
}

/// Encodes a batch. Entries or loads whose strings are longer than 65,535 bytes are left out;
/// the second value counts them.
pub fn encode(batch: &SyncBatch) -> (Vec<u8>, usize) {
    let mut out = Vec::with_capacity(64 + batch.loads.len() * 48);
    out.extend_from_slice(MAGIC);
    out.push(if batch.hashing.is_some() { VERSION } else { VERSION_UNCHECKED });
    let replica = if batch.replica.len() <= u16::MAX as usize { &batch.replica[..] } else { "" };
    put_str(&mut out, replica);
    out.extend_from_slice(&batch.incarnation.to_le_bytes());
    out.extend_from_slice(&batch.seq.to_le_bytes());
    if let Some(hashing) = batch.hashing {
        out.extend_from_slice(&hashing.to_le_bytes());
    }
    let mut skipped = 0;
    let loads: Vec<_> = batch.loads.iter().filter(|(k, _)| key_fits(k)).collect();
    skipped += batch.loads.len() - loads.len();
    out.extend_from_slice(&(loads.len() as u32).to_le_bytes());
    for (key, l) in loads {
        put_key(&mut out, key);
        for v in [l.requests, l.prefill_requests, l.prefill_tokens, l.tokens] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    let count_at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut count = 0u32;
    for entry in &batch.entries {
        let (key, age) = match entry {
            SyncEntry::Record { endpoint, age_s, .. }
            | SyncEntry::Session { endpoint, age_s, .. } => (endpoint, *age_s),
        };
        let fits = key_fits(key)
            && match entry {
                SyncEntry::Session { id, .. } => id.len() <= u16::MAX as usize,
                SyncEntry::Record { hashes, .. } => u32::try_from(hashes.len()).is_ok(),
            };
        if !fits {
            skipped += 1;
            continue;
        }
        match entry {
            SyncEntry::Record { hashes, .. } => {
                out.push(TAG_RECORD);
                put_key(&mut out, key);
                out.extend_from_slice(&age.to_le_bytes());
                out.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
                for h in hashes {
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
            SyncEntry::Session { id, .. } => {
                out.push(TAG_SESSION);
                put_key(&mut out, key);
                out.extend_from_slice(&age.to_le_bytes());
                put_str(&mut out, id);
            }
        }
        count += 1;
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
    (out, skipped)
}

fn key_size(key: &WorkerKey) -> usize {
    match key {
        WorkerKey::Int(_) => 1 + 8,
        WorkerKey::Str(s) => 1 + 2 + s.len(),
    }
}

/// The encoded size of a batch of `replica` with `loads` and no entries.
fn header_size(replica: &str, loads: &[(WorkerKey, InFlightSnapshot)]) -> usize {
    let loads: usize = loads.iter().map(|(k, _)| key_size(k) + 32).sum();
    4 + 1 + 2 + replica.len() + 8 + 8 + 8 + 4 + loads + 4
}

/// The encoded size of one entry.
fn entry_size(entry: &SyncEntry) -> usize {
    match entry {
        SyncEntry::Record { endpoint, hashes, .. } => {
            1 + key_size(endpoint) + 4 + 4 + 8 * hashes.len()
        }
        SyncEntry::Session { endpoint, id, .. } => 1 + key_size(endpoint) + 4 + 2 + id.len(),
    }
}

/// `entries` in runs whose batches (with a `header`-byte header) stay within `max_bytes`; an
/// entry too large on its own is a run by itself. One empty run when `entries` is empty.
fn chunks(entries: Vec<SyncEntry>, header: usize, max_bytes: usize) -> Vec<Vec<SyncEntry>> {
    let mut out = vec![Vec::new()];
    let mut size = header;
    for e in entries {
        let n = entry_size(&e);
        let last = out.last_mut().expect("never empty");
        if !last.is_empty() && size.saturating_add(n) > max_bytes {
            out.push(Vec::new());
            size = header;
        }
        size = size.saturating_add(n);
        out.last_mut().expect("never empty").push(e);
    }
    out
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, message: impl Into<String>) -> Result<T, SyncError> {
        Err(SyncError { offset: self.at, message: message.into() })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SyncError> {
        if self.data.len() - self.at < n {
            return self.fail(format!("{n} bytes needed, {} left", self.data.len() - self.at));
        }
        let out = &self.data[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn left(&self) -> usize {
        self.data.len() - self.at
    }

    fn u8(&mut self) -> Result<u8, SyncError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, SyncError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32, SyncError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, SyncError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn f32(&mut self) -> Result<f32, SyncError> {
        let v = f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
        if !(v.is_finite() && v >= 0.0) {
            self.at -= 4;
            return self.fail(format!("age must be finite and >= 0, got {v}"));
        }
        Ok(v)
    }

    fn str(&mut self) -> Result<String, SyncError> {
        let len = self.u16()? as usize;
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => {
                self.at -= len;
                self.fail("string is not UTF-8")
            }
        }
    }

    fn key(&mut self) -> Result<WorkerKey, SyncError> {
        match self.u8()? {
            KEY_INT => Ok(WorkerKey::Int(self.u64()? as i64)),
            KEY_STR => Ok(WorkerKey::Str(self.str()?)),
            other => {
                self.at -= 1;
                self.fail(format!("unknown endpoint key tag {other}"))
            }
        }
    }

    /// A count of items of at least `min_size` bytes each, checked against the bytes left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, SyncError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size) > self.left() {
            self.at -= 4;
            return self.fail(format!("{n} {what} cannot fit in {} bytes", self.left()));
        }
        Ok(n)
    }
}

/// Decodes a batch; anything malformed is an error naming the byte offset.
pub fn decode(data: &[u8]) -> Result<SyncBatch, SyncError> {
    let mut r = Reader { data, at: 0 };
    if data.len() > MAX_BATCH_BYTES {
        return r.fail(format!("{} bytes is over the {MAX_BATCH_BYTES}-byte limit", data.len()));
    }
    if r.take(4)? != MAGIC {
        r.at = 0;
        return r.fail("not a sync batch (bad magic)");
    }
    let version = r.u8()?;
    if version != VERSION && version != VERSION_UNCHECKED {
        r.at -= 1;
        return r.fail(format!("unknown version {version}"));
    }
    let replica = r.str()?;
    let incarnation = r.u64()?;
    let seq = r.u64()?;
    let hashing = if version == VERSION { Some(r.u64()?) } else { None };
    let n = r.count(3 + 32, "loads")?;
    let mut loads = Vec::with_capacity(n);
    for _ in 0..n {
        let key = r.key()?;
        let (a, b, c, d) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        loads.push((
            key,
            InFlightSnapshot { requests: a, prefill_requests: b, prefill_tokens: c, tokens: d },
        ));
    }
    let n = r.count(1 + 3 + 4 + 2, "entries")?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let tag = r.u8()?;
        if tag != TAG_RECORD && tag != TAG_SESSION {
            r.at -= 1;
            return r.fail(format!("unknown entry tag {tag}"));
        }
        let endpoint = r.key()?;
        let age_s = r.f32()?;
        if tag == TAG_RECORD {
            let len = r.count(8, "block hashes")?;
            let bytes = r.take(len * 8)?;
            let hashes = bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            entries.push(SyncEntry::Record { endpoint, hashes, age_s });
        } else {
            let id = r.str()?;
            entries.push(SyncEntry::Session { endpoint, id, age_s });
        }
    }
    if r.left() != 0 {
        return r.fail(format!("{} bytes after the batch", r.left()));
    }
    Ok(SyncBatch { replica, incarnation, seq, hashing, loads, entries })
}

// ---- catch-up requests ---------------------------------------------------------------------

/// What a replica asks its peers for when it connects, or one peer when it finds a gap in that
/// peer's batches: see [`ReplicaSync::catch_up_request`] and [`ReplicaSync::answer`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CatchUpRequest {
    /// The asker: its name and incarnation.
    pub replica: String,
    pub incarnation: u64,
    /// With a target (asked after a first start's catch-up): the target's answer carries
    /// every live session whose owner is neither the asker nor a peer listed with a sequence
    /// above 0.
    /// Without (a first start of the release before): every peer's carries every live
    /// session.
    pub wants_sessions: bool,
    /// Only this replica (name, incarnation) answers (a gap repair); `None`: every peer does.
    pub target: Option<(String, u64)>,
    /// Per peer (name, incarnation): the sequence through which the asker has its records and
    /// sessions. A peer answers only what it journaled after it; all of it when not listed.
    pub cursors: Vec<(String, u64, u64)>,
}

const REQUEST_MAGIC: &[u8; 4] = b"LSYQ";
const REQUEST_VERSION: u8 = 1;
const FLAG_WANTS_SESSIONS: u8 = 1;
const FLAG_TARGET: u8 = 2;

/// Encodes a catch-up request (names over 65,535 bytes are left out of the cursors).
pub fn encode_request(request: &CatchUpRequest) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + request.cursors.len() * 32);
    out.extend_from_slice(REQUEST_MAGIC);
    out.push(REQUEST_VERSION);
    put_str(
        &mut out,
        if request.replica.len() <= u16::MAX as usize { &request.replica } else { "" },
    );
    out.extend_from_slice(&request.incarnation.to_le_bytes());
    let mut flags = 0;
    if request.wants_sessions {
        flags |= FLAG_WANTS_SESSIONS;
    }
    if request.target.is_some() {
        flags |= FLAG_TARGET;
    }
    out.push(flags);
    if let Some((name, incarnation)) = &request.target {
        put_str(&mut out, if name.len() <= u16::MAX as usize { name } else { "" });
        out.extend_from_slice(&incarnation.to_le_bytes());
    }
    let cursors: Vec<_> =
        request.cursors.iter().filter(|(n, _, _)| n.len() <= u16::MAX as usize).collect();
    out.extend_from_slice(&(cursors.len() as u32).to_le_bytes());
    for (name, incarnation, seq) in cursors {
        put_str(&mut out, name);
        out.extend_from_slice(&incarnation.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
    }
    out
}

/// Decodes a catch-up request. `Ok(None)`: not one of this format (the first format's
/// request, the asker's name and incarnation as text), which is answered in full.
pub fn decode_request(data: &[u8]) -> Result<Option<CatchUpRequest>, SyncError> {
    if !data.starts_with(REQUEST_MAGIC) {
        return Ok(None);
    }
    let mut r = Reader { data, at: 4 };
    if data.len() > MAX_BATCH_BYTES {
        return r.fail(format!("{} bytes is over the {MAX_BATCH_BYTES}-byte limit", data.len()));
    }
    let version = r.u8()?;
    if version != REQUEST_VERSION {
        r.at -= 1;
        return r.fail(format!("unknown catch-up request version {version}"));
    }
    let replica = r.str()?;
    let incarnation = r.u64()?;
    let flags = r.u8()?;
    let target = if flags & FLAG_TARGET != 0 { Some((r.str()?, r.u64()?)) } else { None };
    let n = r.count(2 + 16, "cursors")?;
    let mut cursors = Vec::with_capacity(n);
    for _ in 0..n {
        cursors.push((r.str()?, r.u64()?, r.u64()?));
    }
    if r.left() != 0 {
        return r.fail(format!("{} bytes after the request", r.left()));
    }
    let wants_sessions = flags & FLAG_WANTS_SESSIONS != 0;
    Ok(Some(CatchUpRequest { replica, incarnation, wants_sessions, target, cursors }))
}

// ---- one replica's side --------------------------------------------------------------------

/// Settings of one replica's sync. Defaults live here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncOptions {
    /// Most journal entries between two drains.
    pub journal_limit: usize,
    /// Seconds another replica's counts are trusted without news from it.
    pub load_ttl: f64,
    /// Most entries kept for a late replica's catch-up.
    pub history_limit: usize,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions { journal_limit: 65_536, load_ttl: 3.0, history_limit: 200_000 }
    }
}

/// What [`ReplicaSync::incoming`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IncomingReport {
    /// The batch was this replica's own (a bus echoes to every subscriber).
    pub own: bool,
    /// Already seen (its sequence is not newer than the last one from that replica).
    pub duplicate: bool,
    /// Batches from that replica that never arrived before this one.
    pub missed: u64,
    pub records: u64,
    pub sessions: u64,
    /// Entries or loads for endpoints this replica's pool does not have.
    pub unknown_endpoints: u64,
    /// Records skipped because the sender hashes prompts otherwise (another block size, seed
    /// or model): they could never match here.
    pub records_mismatched: u64,
    /// Records the index refused (a chain that conflicts with what it holds).
    pub records_refused: u64,
    /// The sender's name is used by another live replica too (this one, or another peer):
    /// a misconfiguration that [`ReplicaSync::shared_names`] lists.
    pub identity_conflict: bool,
    /// From an older incarnation of a name whose newer one (or this replica) was heard: a
    /// batch of a replica's previous life, late. Dropped, unless that incarnation keeps
    /// speaking for longer than `load_ttl` (then it is alive and the name is shared).
    pub stale: bool,
    /// Batches of the sender are missing here (a gap, or a sender first heard past its first
    /// batch), and no repair was asked yet: [`ReplicaSync::repair_requests`] asks for them.
    pub behind: bool,
}

/// Counters of one replica's sync.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncCounters {
    pub batches_out: u64,
    pub bytes_out: u64,
    pub entries_out: u64,
    pub batches_in: u64,
    pub bytes_in: u64,
    pub own_in: u64,
    pub duplicates_in: u64,
    pub missed_in: u64,
    pub malformed_in: u64,
    pub records_applied: u64,
    pub sessions_applied: u64,
    pub unknown_endpoints: u64,
    /// Batches from a replica that hashes prompts otherwise, and the records they carried.
    pub mismatched_in: u64,
    pub records_mismatched: u64,
    pub records_refused: u64,
    pub journal_dropped: u64,
    pub skipped_out: u64,
    pub replicas_expired: u64,
    /// Batches from a replica whose name another live replica uses too (this one or a peer).
    pub identity_conflicts: u64,
    /// Batches dropped as an older incarnation's, late (see [`IncomingReport::stale`]).
    pub stale_in: u64,
    /// Catch-up answers built for peers: batches, bytes and entries.
    pub catch_up_batches_out: u64,
    pub catch_up_bytes_out: u64,
    pub catch_up_entries_out: u64,
    /// Targeted catch-up requests made for a gap in a peer's batches.
    pub repairs_asked: u64,
    /// Repairs (and a first start's session requests) given up unanswered
    /// ([`ReplicaSync::repair_unanswered`]): that peer's gap is asked for again when a later
    /// batch of it shows it, where it stayed "asked" for good.
    pub repairs_unanswered: u64,
    /// Requests to one peer, after a first start's catch-up, for the sessions that no peer
    /// that answered owns.
    pub tables_asked: u64,
}

impl SyncCounters {
    fn add_mismatch(&mut self, report: &IncomingReport) {
        if report.records_mismatched > 0 {
            self.mismatched_in += 1;
            self.records_mismatched += report.records_mismatched;
        }
        self.records_refused += report.records_refused;
    }
}

#[derive(Debug)]
struct Peer {
    seq: u64,
    last_seen: f64,
    /// The tick of its last batch (see `State::ticks`).
    tick: u64,
    loads: Vec<(WorkerKey, InFlightSnapshot)>,
}

/// A peer: its name and incarnation. Two live replicas that share a name (a misconfiguration)
/// are two peers, so that both their counts add up instead of replacing each other.
pub type PeerId = (String, u64);

/// What this replica holds of one peer incarnation's journal.
#[derive(Debug, Default)]
struct Cursor {
    /// Every batch through this sequence is here (live, or through a catch-up answer).
    have: u64,
    /// The last run of consecutive live batches: `run_start..=top`.
    run_start: u64,
    top: u64,
    /// A repair was asked and not answered yet.
    asked: bool,
    /// Last news from that incarnation.
    seen: f64,
}

impl Cursor {
    fn settle(&mut self) {
        if self.run_start <= self.have.saturating_add(1) {
            self.have = self.have.max(self.top);
        }
    }

    fn behind(&self) -> bool {
        self.have < self.top
    }
}

/// An older incarnation heard after a newer one of its name: since when, and last; how many
/// turns it spoke in (a turn ends when a newer incarnation of the name speaks), and the tick
/// of its last batch.
#[derive(Debug, Clone, Copy)]
struct Suspect {
    first: f64,
    last: f64,
    turns: u32,
    tick: u64,
}

/// Turns an older incarnation speaks in, alternating with a newer one of its name, before it
/// is taken for a second live replica: its first turn may be a late batch (or a burst of
/// them) of a previous life, but a dead life cannot speak again after the new one answered.
const LIVE_TURNS: u32 = 2;

#[derive(Debug, Default)]
struct State {
    seq: u64,
    last_loads: Vec<(WorkerKey, InFlightSnapshot)>,
    peers: HashMap<PeerId, Peer>,
    /// Older incarnations heard after a newer one of the same name: a late batch of a
    /// previous life, unless it keeps speaking for longer than `load_ttl` (then it is alive,
    /// and its name is shared).
    suspects: HashMap<PeerId, Suspect>,
    /// Names used by more than one live replica (this one included), and since when.
    shared: HashMap<String, f64>,
    /// Counts the batches this replica hears and sends, to order who spoke when (times may
    /// tie).
    ticks: u64,
    /// The tick of this replica's last outgoing batch.
    out_tick: u64,
    /// Records applied from peers' batches, oldest first: when, whose (the sender), the entry
    /// (as long as the own history). A first start's session request gets those whose sender
    /// did not answer it (a replica since gone: the engines it routed to still hold them).
    relayed: VecDeque<(f64, Arc<PeerId>, SyncEntry)>,
    /// What this replica holds of each peer incarnation's journal (kept for the record TTL
    /// after its last news, so that a reconnect asks only for what it missed).
    cursors: HashMap<PeerId, Cursor>,
    /// This replica's own records, oldest first: when, the sequence of their batch, the entry.
    history: VecDeque<(f64, u64, SyncEntry)>,
    /// This replica's own session bindings, the same way (served to peers that know it).
    session_history: VecDeque<(f64, u64, SyncEntry)>,
    /// Per live session: the replica whose binding it holds (its owner, the last one heard to
    /// use it) and when that use was. A replica that knows no peer gets each peer's own
    /// sessions from that peer, and the rest (owners gone, or that did not answer) from one.
    owners: HashMap<String, (Arc<PeerId>, f64)>,
    /// When `owners` was last rid of bindings idle for the session TTL.
    owners_pruned: f64,
    /// A first start's catch-up was asked: the next repair round asks one peer for the
    /// sessions no answering peer owns.
    table_pending: bool,
    counters: SyncCounters,
}

/// Which sessions a catch-up answer carries beside this replica's own.
enum Table {
    /// None else.
    Own,
    /// Every live one (a first start of the release before, or the first format's request).
    All,
    /// Those whose owner is none of these (the asker and the peers it has answers of) nor
    /// this replica; this replica takes over those whose owner it has not heard lately.
    Unowned(Vec<PeerId>),
}

/// `entry` with `age_s` more seconds of age.
fn aged(entry: &SyncEntry, extra_s: f64) -> SyncEntry {
    let extra = extra_s.max(0.0) as f32;
    match entry {
        SyncEntry::Record { endpoint, hashes, age_s } => SyncEntry::Record {
            endpoint: endpoint.clone(),
            hashes: hashes.clone(),
            age_s: age_s + extra,
        },
        SyncEntry::Session { endpoint, id, age_s } => {
            SyncEntry::Session { endpoint: endpoint.clone(), id: id.clone(), age_s: age_s + extra }
        }
    }
}

/// One replica's end of the sync: builds its outgoing batches and applies the others'.
pub struct ReplicaSync {
    replica: String,
    incarnation: u64,
    /// This replica as the owner of its sessions.
    me: Arc<PeerId>,
    pool: Arc<EndpointPool>,
    index: Arc<PrefixIndex>,
    sessions: Arc<Sessions>,
    journal: Arc<SyncJournal>,
    record_ttl: f64,
    options: SyncOptions,
    state: Mutex<State>,
}

impl ReplicaSync {
    /// The sync of replica `replica` over a router's parts (see `Router::replica_sync`).
    /// Incarnations of one name are compared: a larger one is a later life (see
    /// [`IncomingReport::stale`]), so make them grow with the start time.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        replica: String,
        incarnation: u64,
        pool: Arc<EndpointPool>,
        index: Arc<PrefixIndex>,
        sessions: Arc<Sessions>,
        journal: Arc<SyncJournal>,
        record_ttl: f64,
        options: SyncOptions,
    ) -> ReplicaSync {
        journal.enable(options.journal_limit);
        ReplicaSync {
            me: Arc::new((replica.clone(), incarnation)),
            replica,
            incarnation,
            pool,
            index,
            sessions,
            journal,
            record_ttl,
            options,
            state: Mutex::new(State::default()),
        }
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    fn local_loads(&self) -> Vec<(WorkerKey, InFlightSnapshot)> {
        let members = self.pool.snapshot();
        members
            .list
            .iter()
            .filter_map(|m| {
                let l = m.inflight.local();
                (l != InFlightSnapshot::default()).then(|| (m.endpoint.id.clone(), l))
            })
            .collect()
    }

    /// The next batch to publish: the journal since the last call and this replica's counts.
    /// None when there is nothing new and `heartbeat` is false (counts unchanged, nothing
    /// journaled); a heartbeat batch tells the others this replica is alive.
    pub fn outgoing(&self, now: f64, heartbeat: bool) -> Option<Vec<u8>> {
        self.outgoing_split(now, heartbeat, usize::MAX).pop()
    }

    /// Keeps `entry` of batch `seq` for catch-ups (records and session bindings apart).
    fn remember(&self, state: &mut State, now: f64, seq: u64, entry: &SyncEntry) {
        let limit = self.options.history_limit;
        if limit == 0 {
            return;
        }
        let history = match entry {
            SyncEntry::Record { .. } => &mut state.history,
            SyncEntry::Session { .. } => &mut state.session_history,
        };
        if history.len() >= limit {
            history.pop_front();
        }
        history.push_back((now, seq, entry.clone()));
    }

    /// [`ReplicaSync::outgoing`] for a bus that carries at most `max_bytes` per message: the
    /// journal is split over as many batches as it takes (consecutive sequence numbers, each
    /// with the replica's counts), so that a burst (or a stalled publisher) never makes one
    /// batch the bus refuses whole. Empty when there is nothing to send. An entry that cannot
    /// fit in `max_bytes` on its own goes alone into an oversized batch.
    pub fn outgoing_split(&self, now: f64, heartbeat: bool, max_bytes: usize) -> Vec<Vec<u8>> {
        let entries = self.journal.drain();
        let loads = self.local_loads();
        let mut state = self.state.lock();
        state.counters.journal_dropped = self.journal.dropped();
        if entries.is_empty() && loads == state.last_loads && !heartbeat {
            return Vec::new();
        }
        // The history keeps what a catch-up serves: records younger than the record TTL,
        // session bindings younger than the session TTL.
        while state.history.front().is_some_and(|(t, _, _)| now - t >= self.record_ttl) {
            state.history.pop_front();
        }
        let session_ttl = self.sessions.ttl();
        while state.session_history.front().is_some_and(|(t, _, _)| now - t >= session_ttl) {
            state.session_history.pop_front();
        }
        for e in &entries {
            if let SyncEntry::Session { id, age_s, .. } = e {
                let used = now - f64::from(*age_s);
                state.owners.insert(id.clone(), (self.me.clone(), used));
            }
        }
        self.prune_owners(&mut state, now);
        let header = header_size(&self.replica, &loads);
        let mut out = Vec::new();
        for chunk in chunks(entries, header, max_bytes) {
            state.seq += 1;
            let seq = state.seq;
            for e in &chunk {
                self.remember(&mut state, now, seq, e);
            }
            let batch = SyncBatch {
                replica: self.replica.clone(),
                incarnation: self.incarnation,
                seq,
                hashing: Some(self.index.hashing_fingerprint()),
                loads: loads.clone(),
                entries: chunk,
            };
            let (bytes, skipped) = encode(&batch);
            let c = &mut state.counters;
            c.batches_out += 1;
            c.bytes_out += bytes.len() as u64;
            c.entries_out += batch.entries.len() as u64;
            c.skipped_out += skipped as u64;
            out.push(bytes);
        }
        state.last_loads = loads;
        if !out.is_empty() {
            state.ticks += 1;
            state.out_tick = state.ticks;
        }
        out
    }

    /// Keeps the owners of sessions no larger than the session map: every second, and when
    /// it outgrows the map (a client cycling new ids evicts bindings), it drops the owners
    /// of bindings idle for the session TTL, then, still too large, those of bindings not
    /// held.
    fn prune_owners(&self, state: &mut State, now: f64) {
        let limit = 2 * self.sessions.capacity() + 64;
        if now - state.owners_pruned < 1.0 && state.owners.len() <= limit {
            return;
        }
        state.owners_pruned = now;
        let ttl = self.sessions.ttl();
        state.owners.retain(|_, (_, used)| now - *used < ttl);
        if state.owners.len() > limit {
            let sessions = &self.sessions;
            state.owners.retain(|id, _| sessions.with_bound(id, now, |_| Some(())).is_some());
        }
    }

    /// Applies another replica's batch at `now`. A malformed batch changes nothing and is
    /// counted.
    pub fn incoming(&self, data: &[u8], now: f64) -> Result<IncomingReport, SyncError> {
        let batch = self.decode_counted(data)?;
        let mut report = IncomingReport::default();
        let mut state = self.state.lock();
        state.counters.batches_in += 1;
        state.counters.bytes_in += data.len() as u64;
        if batch.replica == self.replica && batch.incarnation == self.incarnation {
            state.counters.own_in += 1;
            report.own = true;
            return Ok(report);
        }
        let members = self.pool.snapshot();
        let mut unknown =
            batch.loads.iter().filter(|(k, _)| members.get(k).is_none()).count() as u64;
        let id: PeerId = (batch.replica.clone(), batch.incarnation);
        state.ticks += 1;
        let tick = state.ticks;
        match state.peers.get_mut(&id) {
            // A batch more than `MAX_MISSED_COUNTED` behind the last is taken as the replica's
            // sequence starting over (below) rather than as a duplicate: one batch claiming a
            // sequence far ahead (a garbled or forged `u64::MAX`) would otherwise make every
            // later batch of that replica a duplicate until it restarted.
            Some(peer) if batch.seq <= peer.seq && peer.seq - batch.seq <= MAX_MISSED_COUNTED => {
                state.counters.duplicates_in += 1;
                report.duplicate = true;
                return Ok(report);
            }
            Some(peer) => {
                if batch.seq > peer.seq {
                    report.missed = (batch.seq - peer.seq - 1).min(MAX_MISSED_COUNTED);
                }
                peer.seq = batch.seq;
                peer.last_seen = now;
                peer.tick = tick;
                peer.loads = batch.loads;
            }
            None => {
                if !self.admit_incarnation(&mut state, &id, now, tick) {
                    state.counters.stale_in += 1;
                    report.stale = true;
                    return Ok(report);
                }
                state.peers.insert(
                    id.clone(),
                    Peer { seq: batch.seq, last_seen: now, tick, loads: batch.loads },
                );
            }
        }
        report.behind = self.note_live(&mut state, id.clone(), batch.seq, now);
        if state.shared.contains_key(&batch.replica) {
            state.counters.identity_conflicts += 1;
            report.identity_conflict = true;
        }
        let owner = Arc::new(id);
        let applied =
            self.apply_entries(&mut state, &batch.entries, batch.hashing, &members, now, &owner);
        report.records = applied.records;
        report.sessions = applied.sessions;
        report.records_mismatched = applied.records_mismatched;
        report.records_refused = applied.records_refused;
        unknown += applied.unknown_endpoints;
        report.unknown_endpoints = unknown;
        let c = &mut state.counters;
        c.missed_in = c.missed_in.saturating_add(report.missed);
        c.records_applied += report.records;
        c.sessions_applied += report.sessions;
        c.unknown_endpoints += unknown;
        c.add_mismatch(&report);
        self.prune_owners(&mut state, now);
        self.refresh(&mut state, now);
        Ok(report)
    }

    /// Moves the cursor of `id` past live batch `seq`; true when batches of it are missing
    /// here and no repair is asked yet.
    fn note_live(&self, state: &mut State, id: PeerId, seq: u64, now: f64) -> bool {
        let c = state.cursors.entry(id).or_default();
        if c.top != 0 && c.top.checked_add(1) == Some(seq) {
            c.top = seq;
        } else {
            // First heard, a gap, or the sequence starting over: a new run.
            c.run_start = seq;
            c.top = seq;
        }
        c.settle();
        c.seen = now;
        c.behind() && !c.asked
    }

    /// A replica incarnation heard from (batch `tick`) and not counted yet: false when it is
    /// a late batch of a previous life (a newer incarnation of its name, or this replica, was
    /// heard), unless that life speaks again after the newer one spoke since its last batch
    /// (two turns, [`LIVE_TURNS`]), or keeps speaking for longer than `load_ttl`: then it is
    /// alive, the name is shared, and both count. A newer incarnation replaces the older ones
    /// (a restart), unless the name is this replica's own or already shared.
    fn admit_incarnation(&self, state: &mut State, id: &PeerId, now: f64, tick: u64) -> bool {
        let (name, incarnation) = (&id.0, id.1);
        let own = *name == self.replica;
        // When a newer incarnation of the name last spoke (0: none heard).
        let newer = state
            .peers
            .iter()
            .filter(|(p, _)| p.0 == *name && p.1 > incarnation)
            .map(|(_, peer)| peer.tick.max(1))
            .chain((own && self.incarnation > incarnation).then_some(state.out_tick.max(1)))
            .max();
        if let Some(newer_tick) = newer {
            let suspect = state.suspects.entry(id.clone()).or_insert(Suspect {
                first: now,
                last: now,
                turns: 0,
                tick: 0,
            });
            if suspect.tick < newer_tick {
                suspect.turns += 1;
            }
            suspect.last = now;
            suspect.tick = tick;
            if suspect.turns < LIVE_TURNS && now - suspect.first <= self.options.load_ttl {
                return false;
            }
            state.suspects.remove(id);
            state.shared.insert(name.clone(), now);
            return true;
        }
        if own {
            // A later incarnation of this replica's name: never this replica's past.
            state.shared.insert(name.clone(), now);
            return true;
        }
        if state.shared.contains_key(name) {
            return true;
        }
        // A restart: the older lives are gone (a late batch of theirs is a suspect).
        state.peers.retain(|p, _| p.0 != *name);
        true
    }

    /// A batch decoded; a malformed one is counted.
    fn decode_counted(&self, data: &[u8]) -> Result<SyncBatch, SyncError> {
        decode(data).inspect_err(|_| self.state.lock().counters.malformed_in += 1)
    }

    /// Records and sessions of `entries` for endpoints in `members`; the rest are counted.
    /// The records of a sender that hashes prompts otherwise (`hashing`) are skipped: they
    /// could never match here, and would only take index memory for their lifetime. A session
    /// bound here (not older than the binding held) is `owner`'s.
    fn apply_entries(
        &self,
        state: &mut State,
        entries: &[SyncEntry],
        hashing: Option<u64>,
        members: &Members,
        now: f64,
        owner: &Arc<PeerId>,
    ) -> IncomingReport {
        let mut report = IncomingReport::default();
        let mismatched = hashing.is_some_and(|h| h != self.index.hashing_fingerprint());
        for entry in entries {
            let (endpoint, age_s) = match entry {
                SyncEntry::Record { endpoint, age_s, .. }
                | SyncEntry::Session { endpoint, age_s, .. } => (endpoint, f64::from(*age_s)),
            };
            if members.get(endpoint).is_none() {
                report.unknown_endpoints += 1;
                continue;
            }
            match entry {
                SyncEntry::Record { .. } if mismatched => report.records_mismatched += 1,
                SyncEntry::Record { hashes, .. } => {
                    let ttl = self.record_ttl - age_s;
                    if ttl > 0.0 && !hashes.is_empty() {
                        match self.index.record(endpoint, hashes, ttl, now) {
                            Ok(_) => {
                                report.records += 1;
                                self.relay(state, now - age_s, owner, entry);
                            }
                            Err(_) => report.records_refused += 1,
                        }
                    }
                }
                SyncEntry::Session { id, .. } => {
                    if self.sessions.bind(id, endpoint, now, age_s) {
                        let key = session_key(id).into_owned();
                        state.owners.insert(key, (owner.clone(), now - age_s));
                    }
                    report.sessions += 1;
                }
            }
        }
        report
    }

    /// Keeps a peer's record (made at `made`, `owner`'s) for a first start's session request,
    /// as long as the own history: the last `history_limit`, younger than the record TTL.
    fn relay(&self, state: &mut State, made: f64, owner: &Arc<PeerId>, entry: &SyncEntry) {
        let limit = self.options.history_limit;
        if limit == 0 {
            return;
        }
        while state.relayed.len() >= limit
            || state.relayed.front().is_some_and(|(t, _, _)| made - t >= self.record_ttl)
        {
            state.relayed.pop_front();
        }
        let SyncEntry::Record { endpoint, hashes, .. } = entry else { return };
        let kept =
            SyncEntry::Record { endpoint: endpoint.clone(), hashes: hashes.clone(), age_s: 0.0 };
        state.relayed.push_back((made, owner.clone(), kept));
    }

    /// Forgets replicas not heard from within `load_ttl` and sets every endpoint's remote
    /// count to the sum over the replicas left. Returns how many replicas were forgotten.
    pub fn expire(&self, now: f64) -> usize {
        let mut state = self.state.lock();
        self.refresh(&mut state, now)
    }

    fn refresh(&self, state: &mut State, now: f64) -> usize {
        let ttl = self.options.load_ttl;
        let before = state.peers.len();
        state.peers.retain(|_, p| now - p.last_seen <= ttl);
        let expired = before - state.peers.len();
        state.counters.replicas_expired += expired as u64;
        state.suspects.retain(|_, s| now - s.last <= ttl);
        let keep = self.record_ttl.max(self.sessions.ttl()).max(ttl);
        state.cursors.retain(|_, c| now - c.seen <= keep);
        // A name stays shared while more than one live replica uses it.
        let State { shared, peers, .. } = state;
        shared.retain(|name, _| {
            let others = peers.keys().filter(|p| p.0 == *name).take(2).count();
            others + usize::from(*name == self.replica) >= 2
        });
        let mut sums: HashMap<&WorkerKey, InFlightSnapshot> = HashMap::new();
        for peer in state.peers.values() {
            for (key, load) in &peer.loads {
                let slot = sums.entry(key).or_default();
                *slot = InFlightSnapshot::sum([&*slot, load]);
            }
        }
        for m in &self.pool.snapshot().list {
            m.inflight.set_remote(sums.get(&m.endpoint.id).copied().unwrap_or_default());
        }
        expired
    }

    fn request(&self, state: &State, target: Option<(String, u64)>, table: bool) -> Vec<u8> {
        let mut cursors: Vec<_> =
            state.cursors.iter().map(|(id, c)| (id.0.clone(), id.1, c.have)).collect();
        cursors.sort();
        encode_request(&CatchUpRequest {
            replica: self.replica.clone(),
            incarnation: self.incarnation,
            wants_sessions: table,
            target,
            cursors,
        })
    }

    /// The request a connecting replica sends every peer: what it holds of each (see
    /// [`CatchUpRequest`]), so that each answers only what is missing here, its own sessions
    /// only. When it knows no peer yet (a first start), the next [`ReplicaSync::repair_requests`]
    /// asks one peer that answered for the sessions no answering peer owns.
    pub fn catch_up_request(&self) -> Vec<u8> {
        let mut state = self.state.lock();
        if state.cursors.is_empty() {
            state.table_pending = true;
        }
        self.request(&state, None, false)
    }

    /// One targeted request per peer whose batches are missing here (a gap, or first heard
    /// past its first batch) and not asked for yet; each is asked once until it answers.
    /// After a first start's catch-up, the first of them asks one peer (the first by name of
    /// those that answered) for the sessions that no peer it has heard owns: those of
    /// replicas since gone, or that did not answer in time.
    pub fn repair_requests(&self) -> Vec<Vec<u8>> {
        self.repair_requests_to().into_iter().map(|(_, request)| request).collect()
    }

    /// [`ReplicaSync::repair_requests`], each with the peer it is aimed at (for
    /// [`ReplicaSync::repair_unanswered`]).
    pub fn repair_requests_to(&self) -> Vec<(PeerId, Vec<u8>)> {
        let mut state = self.state.lock();
        let mut out = Vec::new();
        let mut table_from = None;
        if std::mem::take(&mut state.table_pending) {
            table_from = state
                .cursors
                .iter()
                .min_by(|(a, x), (b, y)| (x.have == 0, *a).cmp(&(y.have == 0, *b)))
                .map(|(id, _)| id.clone());
            if let Some(id) = &table_from {
                out.push((id.clone(), self.request(&state, Some(id.clone()), true)));
                if let Some(c) = state.cursors.get_mut(id) {
                    c.asked = true;
                }
            }
        }
        let mut behind: Vec<PeerId> = state
            .cursors
            .iter()
            .filter(|(_, c)| c.behind() && !c.asked)
            .map(|(id, _)| id.clone())
            .collect();
        behind.sort();
        out.extend(
            behind.iter().map(|id| (id.clone(), self.request(&state, Some(id.clone()), false))),
        );
        for id in &behind {
            if let Some(c) = state.cursors.get_mut(id) {
                c.asked = true;
            }
        }
        state.counters.repairs_asked += behind.len() as u64;
        state.counters.tables_asked += u64::from(table_from.is_some());
        out
    }

    /// The repair of peer `replica` (`incarnation`) asked by [`ReplicaSync::repair_requests`]
    /// got no answer (asked again by the carrier, and still nothing: the answer was lost
    /// whole, or the peer cannot answer): the peer is no longer taken as asked, so that a
    /// later batch of it that shows the gap asks again. Counted (`repairs_unanswered`); false
    /// when no repair of it is outstanding (an answer moved its cursor meanwhile).
    pub fn repair_unanswered(&self, replica: &str, incarnation: u64) -> bool {
        let mut state = self.state.lock();
        let id = (replica.to_owned(), incarnation);
        let Some(c) = state.cursors.get_mut(&id).filter(|c| c.asked) else { return false };
        c.asked = false;
        state.counters.repairs_unanswered += 1;
        true
    }

    /// Every peer incarnation heard from within `load_ttl`, sorted (two when two live
    /// replicas share a name): those a catch-up request to every peer expects an answer of.
    pub fn peer_ids(&self) -> Vec<PeerId> {
        let mut ids: Vec<PeerId> = self.state.lock().peers.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// A request aimed at peer `replica` (`incarnation`) alone for what it has that is missing
    /// here (its answer to a request to every peer came without some of its pieces: an answer
    /// that is not whole moves no cursor, so asking again brings all of it).
    pub fn request_to(&self, replica: &str, incarnation: u64) -> Vec<u8> {
        let state = self.state.lock();
        self.request(&state, Some((replica.to_owned(), incarnation)), false)
    }

    /// The answer to a peer's catch-up request (`request` as sent, the first format's
    /// included): this replica's records and session bindings journaled after the asker's
    /// cursor for this incarnation (its records younger than the record TTL and the live
    /// sessions it owns when it has none), plus, for a request aimed at this replica that
    /// wants sessions, every live session whose owner is none of the peers the asker has
    /// (this replica then owns them), each batch at most `max_bytes`. The last batch carries
    /// this replica's sequence (the others 0): the asker has everything through it once
    /// applied ([`ReplicaSync::apply_catch_up`]). Always one batch at least, possibly without
    /// entries. Empty for a request of this replica's own, one aimed at another replica, or a
    /// malformed one (counted).
    pub fn answer(&self, request: &[u8], now: f64, max_bytes: usize) -> Vec<Vec<u8>> {
        let (after, table) = match decode_request(request) {
            Ok(None) => (None, Table::All),
            Ok(Some(r)) => {
                let me = |name: &str, inc: u64| name == self.replica && inc == self.incarnation;
                if me(&r.replica, r.incarnation)
                    || r.target.as_ref().is_some_and(|(n, i)| !me(n, *i))
                {
                    return Vec::new();
                }
                let after = r.cursors.iter().find(|(n, i, _)| me(n, *i)).map(|c| c.2);
                let table = match (r.wants_sessions, r.target.is_some()) {
                    (false, _) => Table::Own,
                    // A first start of the release before: every peer sends every session.
                    (true, false) => Table::All,
                    // Those the asker owns, or a peer it has answers of, it has.
                    (true, true) => Table::Unowned(
                        r.cursors
                            .into_iter()
                            .filter(|c| c.2 > 0)
                            .map(|c| (c.0, c.1))
                            .chain([(r.replica, r.incarnation)])
                            .collect(),
                    ),
                };
                (after, table)
            }
            Err(_) => {
                self.state.lock().counters.malformed_in += 1;
                return Vec::new();
            }
        };
        self.answer_after(after, table, now, max_bytes)
    }

    /// Batches that bring a late replica up to date: the prefix records of the last
    /// `record_ttl` seconds (with their ages) and every live session (see
    /// [`ReplicaSync::answer`], which this is for an asker that knows nothing).
    pub fn catch_up(&self, now: f64, max_bytes: usize) -> Vec<Vec<u8>> {
        self.answer_after(None, Table::All, now, max_bytes)
    }

    fn answer_after(
        &self,
        after: Option<u64>,
        table: Table,
        now: f64,
        max_bytes: usize,
    ) -> Vec<Vec<u8>> {
        let after = after.unwrap_or(0);
        let mut state = self.state.lock();
        let session_ttl = self.sessions.ttl();
        let mut entries: Vec<SyncEntry> = state
            .history
            .iter()
            .filter(|(t, seq, _)| *seq > after && now - t < self.record_ttl)
            .map(|(t, _, e)| aged(e, now - t))
            .collect();
        let live = |s: super::sessions::LiveSession| SyncEntry::Session {
            endpoint: s.endpoint,
            id: s.id,
            age_s: s.idle_s as f32,
        };
        let owned_by = |state: &State, id: &str| state.owners.get(id).map(|(o, _)| o.clone());
        if matches!(table, Table::All) {
            entries.extend(self.sessions.live(now).into_iter().map(live));
        } else if after == 0 {
            // The asker has nothing of this replica: the live sessions it owns (each once,
            // however often it was used, and only while this replica's binding holds).
            let mine: Vec<_> = self
                .sessions
                .live(now)
                .into_iter()
                .filter(|s| owned_by(&state, &s.id).is_some_and(|o| o == self.me))
                .map(live)
                .collect();
            entries.extend(mine);
        } else {
            entries.extend(
                state
                    .session_history
                    .iter()
                    .filter(|(t, seq, _)| *seq > after && now - t < session_ttl)
                    .map(|(t, _, e)| aged(e, now - t)),
            );
        }
        if let Table::Unowned(answered) = &table {
            let covered = |o: &Arc<PeerId>| {
                **o == *self.me || answered.iter().any(|p| p.0 == o.0 && p.1 == o.1)
            };
            // Owners are not taken over here: a peer that did (it answered for a departed
            // owner's sessions once) was seen as their owner by the askers it answered but not
            // by its peers, so a later first start got them from it and from the table answer
            // of a peer that still named the departed owner. Every first start asks one peer
            // for the sessions no answering peer owns, so they reach it once either way.
            let unowned = self
                .sessions
                .live(now)
                .into_iter()
                .filter(|s| !owned_by(&state, &s.id).is_some_and(|o| covered(&o)))
                .map(live);
            entries.extend(unowned);
            // The records of peers that did not answer (a replica gone: its engines, shared
            // by every replica, still hold what it routed there), each once: a record that
            // came twice (live, then in a repair's answer) is kept twice. A chain's last hash
            // and length name it (block hashes are chained); the latest copy is sent.
            let mut seen = hashbrown::HashSet::new();
            let mut relayed: Vec<SyncEntry> = state
                .relayed
                .iter()
                .rev()
                .filter(|(t, o, _)| !covered(o) && now - t < self.record_ttl)
                .filter(|(_, _, e)| match e {
                    SyncEntry::Record { endpoint, hashes, .. } => {
                        seen.insert((endpoint.clone(), hashes.last().copied(), hashes.len()))
                    }
                    SyncEntry::Session { .. } => true,
                })
                .map(|(t, _, e)| aged(e, now - t))
                .collect();
            relayed.reverse();
            entries.extend(relayed);
        }
        let through = state.seq;
        let mut out: Vec<Vec<u8>> = Vec::new();
        let runs = chunks(entries, header_size(&self.replica, &[]), max_bytes);
        let last = runs.len() - 1;
        for (i, entries) in runs.into_iter().enumerate() {
            let batch = SyncBatch {
                replica: self.replica.clone(),
                incarnation: self.incarnation,
                seq: if i == last { through } else { 0 },
                hashing: Some(self.index.hashing_fingerprint()),
                loads: Vec::new(),
                entries,
            };
            let c = &mut state.counters;
            c.catch_up_entries_out += batch.entries.len() as u64;
            let bytes = encode(&batch).0;
            c.catch_up_batches_out += 1;
            c.catch_up_bytes_out += bytes.len() as u64;
            out.push(bytes);
        }
        out
    }

    /// Applies a catch-up batch from [`ReplicaSync::answer`]: its records and sessions, not
    /// its (empty) counts. One with a sequence (an answer's last batch) moves the cursor of
    /// its sender past it; one without (the others, and every batch of the first format)
    /// only adds.
    pub fn apply_catch_up(&self, data: &[u8], now: f64) -> Result<IncomingReport, SyncError> {
        let batch = self.decode_counted(data)?;
        let members = self.pool.snapshot();
        let mut state = self.state.lock();
        let sender = Arc::new((batch.replica.clone(), batch.incarnation));
        let report =
            self.apply_entries(&mut state, &batch.entries, batch.hashing, &members, now, &sender);
        let own = batch.replica == self.replica && batch.incarnation == self.incarnation;
        if batch.seq > 0 && !own {
            let c = state.cursors.entry((batch.replica, batch.incarnation)).or_default();
            if c.top == 0 {
                c.run_start = 1;
            }
            c.have = c.have.max(batch.seq);
            c.top = c.top.max(c.have);
            c.settle();
            c.asked = false;
            c.seen = now;
        }
        let c = &mut state.counters;
        c.bytes_in += data.len() as u64;
        c.records_applied += report.records;
        c.sessions_applied += report.sessions;
        c.unknown_endpoints += report.unknown_endpoints;
        c.add_mismatch(&report);
        self.prune_owners(&mut state, now);
        Ok(report)
    }

    /// Counters since the sync started.
    pub fn counters(&self) -> SyncCounters {
        let mut state = self.state.lock();
        state.counters.journal_dropped = self.journal.dropped();
        state.counters
    }

    /// Replicas heard from within `load_ttl` (as of the last batch or expiry).
    pub fn peers(&self) -> Vec<String> {
        let mut names: Vec<String> = self.state.lock().peers.keys().map(|p| p.0.clone()).collect();
        names.sort();
        names.dedup();
        names
    }

    /// Names that more than one live replica uses (this replica's own included), heard within
    /// `load_ttl`: each should be unique (see [`IncomingReport::identity_conflict`]).
    pub fn shared_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.state.lock().shared.keys().cloned().collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_index::IndexConfig;
    use crate::routing::endpoint::Endpoint;
    use crate::routing::plugin::RequestMeta;
    use crate::routing::pool::StalePolicy;
    use crate::routing::router::{Router, RouterOptions};
    use crate::routing::{parse_config, presets};
    use proptest::prelude::*;

    fn key(s: &str) -> WorkerKey {
        WorkerKey::Str(s.into())
    }

    /// One replica: its own pool and index over the same three endpoints, and its sync.
    struct Replica {
        router: Router,
        sync: ReplicaSync,
    }

    fn replica(name: &str) -> Replica {
        hashing_replica(name, IndexConfig { block_size: 16, ..IndexConfig::default() })
    }

    fn hashing_replica(name: &str, config: IndexConfig) -> Replica {
        let pool = Arc::new(EndpointPool::new(StalePolicy::default()).unwrap());
        for n in ["a", "b", "c"] {
            pool.upsert(Endpoint { address: format!("{n}:8000"), ..Endpoint::new(key(n)) });
        }
        let index = Arc::new(PrefixIndex::new(config).unwrap());
        let config = parse_config(&presets::preset("llm-d").unwrap()).unwrap();
        let router = Router::new(pool, index, config, RouterOptions::default()).unwrap();
        let sync = router.replica_sync(name.into(), name.len() as u64, SyncOptions::default());
        Replica { router, sync }
    }

    fn prompt(first: u32) -> Vec<u32> {
        (first..first + 256).collect()
    }

    fn meta(session: Option<&str>) -> RequestMeta {
        RequestMeta { session_id: session.map(str::to_string), ..RequestMeta::default() }
    }

    fn cached_on(r: &Replica, tokens: &[u32], endpoint: &str) -> u64 {
        let d = r.router.decide(tokens, &meta(None), 1.0).unwrap();
        let c = d.base.iter().find(|c| d.endpoint(c).id == key(endpoint)).unwrap();
        d.cached_tokens(c)
    }

    #[test]
    fn a_record_made_by_one_replica_reaches_the_others_index() {
        let (one, two) = (replica("one"), replica("two"));
        let tokens = prompt(0);
        let d = one.router.decide(&tokens, &meta(Some("s1")), 1.0).unwrap();
        let chosen = d.endpoint(d.chosen()).id.clone();
        let _ticket = one.router.commit(&d, None, 1.0).unwrap();
        let WorkerKey::Str(name) = &chosen else { panic!() };
        assert_eq!(cached_on(&two, &tokens, name), 0);
        let batch = one.sync.outgoing(1.0, false).expect("something to send");
        let report = two.sync.incoming(&batch, 1.0).unwrap();
        assert_eq!((report.records, report.sessions), (1, 1));
        assert_eq!(cached_on(&two, &tokens, name), 256);
        // The session follows too, and the in-flight count of the chosen endpoint.
        let got = two.router.sessions().with_bound("s1", 1.0, |k| Some(k.clone()));
        assert_eq!(got, Some(chosen.clone()));
        let member = two.router.pool().snapshot();
        let m = member.get(&chosen).unwrap();
        assert_eq!((m.inflight.local().requests, m.inflight.snapshot().requests), (0, 1));
        // Its own echo is ignored; the same batch twice is a duplicate.
        assert!(one.sync.incoming(&batch, 1.0).unwrap().own);
        assert!(two.sync.incoming(&batch, 1.0).unwrap().duplicate);
    }

    #[test]
    fn records_of_a_replica_that_hashes_otherwise_are_counted_not_applied() {
        // Probe 48 F5: another block size (or seed, or model) never matches here, and was
        // applied and counted as if it did.
        let one = replica("one");
        let tokens = prompt(0);
        for (name, config) in [
            ("bs32", IndexConfig { block_size: 32, ..IndexConfig::default() }),
            ("seed9", IndexConfig { block_size: 16, seed: 9, ..IndexConfig::default() }),
            (
                "model",
                IndexConfig { block_size: 16, model: Some("m".into()), ..Default::default() },
            ),
        ] {
            let other = hashing_replica(name, config);
            let d = other.router.decide(&tokens, &meta(Some("s1")), 1.0).unwrap();
            let _ticket = other.router.commit(&d, None, 1.0).unwrap();
            let batch = other.sync.outgoing(1.0, false).unwrap();
            let report = one.sync.incoming(&batch, 1.0).unwrap();
            assert_eq!((report.records, report.records_mismatched), (0, 1));
            assert_eq!(report.sessions, 1, "sessions and counts do not depend on hashing");
        }
        let c = one.sync.counters();
        assert_eq!((c.mismatched_in, c.records_mismatched, c.records_applied), (3, 3, 0));
        assert_eq!(one.router.index().stats().blocks, 0);
        // The same hashing matches, and a far jump of the sequence counts a bounded loss.
        let same = replica("same");
        let d = same.router.decide(&tokens, &meta(None), 1.0).unwrap();
        let _ticket = same.router.commit(&d, None, 1.0).unwrap();
        let batch = decode(&same.sync.outgoing(1.0, false).unwrap()).unwrap();
        assert_eq!(one.sync.incoming(&encode(&batch).0, 1.0).unwrap().records, 1);
        let far = SyncBatch { seq: u64::MAX, ..batch.clone() };
        assert_eq!(one.sync.incoming(&encode(&far).0, 1.0).unwrap().missed, MAX_MISSED_COUNTED);
        // The replica's real batches that follow are not taken for duplicates of it...
        let next = SyncBatch { seq: batch.seq + 1, ..batch.clone() };
        let report = one.sync.incoming(&encode(&next).0, 1.0).unwrap();
        assert!(!report.duplicate && report.records == 1, "{report:?}");
        // ...and duplicates of those still are.
        assert!(one.sync.incoming(&encode(&next).0, 1.0).unwrap().duplicate);
        assert!(one.sync.incoming(&encode(&batch).0, 1.0).unwrap().duplicate);
    }

    #[test]
    fn counts_are_absolute_and_expire_with_their_replica() {
        let (one, two) = (replica("one"), replica("two"));
        let tokens = prompt(0);
        let d = one.router.decide(&tokens, &meta(None), 1.0).unwrap();
        let chosen = d.endpoint(d.chosen()).id.clone();
        let ticket = one.router.commit(&d, None, 1.0).unwrap();
        let first = one.sync.outgoing(1.0, false).unwrap();
        assert!(one.sync.outgoing(1.1, false).is_none(), "nothing new");
        drop(ticket);
        let second = one.sync.outgoing(1.2, false).expect("the count changed");
        let remote = |t| {
            let _ = two.sync.expire(t);
            two.router.pool().snapshot().get(&chosen).unwrap().inflight.remote().requests
        };
        two.sync.incoming(&second, 1.3).unwrap();
        assert_eq!(remote(1.3), 0);
        // A batch lost in between is healed by the next one; an old one is dropped.
        assert!(two.sync.incoming(&first, 1.3).unwrap().duplicate);
        let d = one.router.decide(&tokens, &meta(None), 2.0).unwrap();
        let _t = one.router.commit(&d, Some(&chosen), 2.0).unwrap();
        let _lost = one.sync.outgoing(2.0, false).unwrap();
        let heartbeat = one.sync.outgoing(2.1, true).unwrap();
        assert_eq!(two.sync.incoming(&heartbeat, 2.1).unwrap().missed, 1);
        assert_eq!(remote(2.1), 1);
        assert_eq!(two.sync.peers(), vec!["one".to_string()]);
        // Silent for longer than load_ttl: forgotten.
        assert_eq!(remote(2.1 + 3.5), 0);
        assert!(two.sync.peers().is_empty());
        assert_eq!(two.sync.counters().replicas_expired, 1);
    }

    #[test]
    fn remote_counts_steer_the_next_decision_away() {
        // Replica one has requests in flight on `a` and `b`; once its counts arrive, replica
        // two, scoring by in-flight requests, sends a cold prompt to `c` whatever its seed.
        let config = serde_json::json!({
            "plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"}],
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "active-request-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"}]}],
        });
        let one = replica("one");
        let _t: Vec<_> = ["a", "b"]
            .iter()
            .map(|e| {
                let d = one.router.decide(&prompt(0), &meta(None), 1.0).unwrap();
                one.router.commit(&d, Some(&key(e)), 1.0).unwrap()
            })
            .collect();
        let batch = one.sync.outgoing(1.0, false).unwrap();
        let mut elsewhere = 0;
        for seed in 0..16 {
            let two = replica("two");
            let options = RouterOptions { seed, ..RouterOptions::default() };
            let router = Router::new(
                two.router.pool().clone(),
                two.router.index().clone(),
                parse_config(&config).unwrap(),
                options,
            )
            .unwrap();
            let blind = router.decide(&prompt(5000), &meta(None), 1.0).unwrap();
            elsewhere += usize::from(blind.endpoint(blind.chosen()).id != key("c"));
            let sync = router.replica_sync("two".into(), 2, SyncOptions::default());
            sync.incoming(&batch, 1.0).unwrap();
            let d = router.decide(&prompt(5000), &meta(None), 1.0).unwrap();
            assert_eq!(d.endpoint(d.chosen()).id, key("c"), "seed {seed}");
        }
        assert!(elsewhere > 0, "without the counts some seeds pick a busy endpoint");
    }

    #[test]
    fn a_late_replica_catches_up_on_records_and_sessions() {
        let one = replica("one");
        let tokens = prompt(0);
        let d = one.router.decide(&tokens, &meta(Some("s9")), 1.0).unwrap();
        let chosen = d.endpoint(d.chosen()).id.clone();
        drop(one.router.commit(&d, None, 1.0).unwrap());
        one.sync.outgoing(1.0, false).unwrap();
        let late = replica("late");
        let batches = one.sync.catch_up(30.0, 1 << 20);
        assert_eq!(batches.len(), 1);
        let report = late.sync.apply_catch_up(&batches[0], 30.0).unwrap();
        assert_eq!((report.records, report.sessions), (1, 1));
        let WorkerKey::Str(name) = &chosen else { panic!() };
        assert_eq!(cached_on(&late, &tokens, name), 256);
        // Small chunks: one entry per batch.
        assert_eq!(one.sync.catch_up(30.0, 1).len(), 2);
        // Records older than record_ttl are not handed on.
        let stale = one.sync.catch_up(1.0 + 61.0, 1 << 20);
        let entries = decode(&stale[0]).unwrap().entries;
        assert!(entries.iter().all(|e| matches!(e, SyncEntry::Session { .. })));
    }

    /// A batch of replica `name`/`incarnation` with `requests` in flight on `a`.
    fn load_batch(name: &str, incarnation: u64, seq: u64, requests: u64) -> Vec<u8> {
        encode(&SyncBatch {
            replica: name.into(),
            incarnation,
            seq,
            hashing: None,
            loads: vec![(key("a"), InFlightSnapshot { requests, ..Default::default() })],
            entries: vec![],
        })
        .0
    }

    fn remote_on_a(r: &Replica) -> u64 {
        r.router.pool().snapshot().get(&key("a")).unwrap().inflight.remote().requests
    }

    #[test]
    fn a_peer_with_this_replicas_name_is_a_conflict_and_still_counts() {
        // "two" has incarnation 3 (its name's length); another process calls itself "two" too.
        let two = replica("two");
        let report = two.sync.incoming(&load_batch("two", 99, 1, 2), 1.0).unwrap();
        assert!(report.identity_conflict && !report.own);
        assert_eq!(two.sync.shared_names(), vec!["two".to_string()]);
        assert_eq!(two.sync.counters().identity_conflicts, 1);
        assert_eq!(remote_on_a(&two), 2, "its requests are real: they count");
        // Once it is silent for load_ttl, the name is ours alone again.
        two.sync.expire(1.0 + 3.5);
        assert!(two.sync.shared_names().is_empty());
    }

    #[test]
    fn two_peers_sharing_a_name_both_count_and_a_restart_replaces_the_old_life() {
        let one = replica("one");
        // "gw" restarts: its new incarnation replaces the old one (no double count).
        one.sync.incoming(&load_batch("gw", 1, 5, 4), 1.0).unwrap();
        let report = one.sync.incoming(&load_batch("gw", 2, 1, 1), 1.1).unwrap();
        assert!(!report.identity_conflict);
        assert_eq!(remote_on_a(&one), 1);
        assert_eq!(one.sync.peers(), vec!["gw".to_string()]);
        // The old incarnation speaks again: late batches of its life (a burst), dropped...
        for seq in [6, 7] {
            let report = one.sync.incoming(&load_batch("gw", 1, seq, 4), 1.2).unwrap();
            assert!(report.stale && !report.identity_conflict);
        }
        // ...until it speaks again after the new one spoke (a dead life cannot): two
        // replicas share the name at once, not after load_ttl (3 s), and their counts add up
        // instead of replacing each other batch after batch.
        assert!(!one.sync.incoming(&load_batch("gw", 2, 2, 1), 1.3).unwrap().stale);
        assert_eq!(remote_on_a(&one), 1);
        assert!(one.sync.shared_names().is_empty());
        assert_eq!(one.sync.counters().stale_in, 2);
        let report = one.sync.incoming(&load_batch("gw", 1, 8, 4), 1.4).unwrap();
        assert!(report.identity_conflict && !report.stale);
        assert_eq!(one.sync.shared_names(), vec!["gw".to_string()]);
        for (t, (inc, seq)) in [(1, 10), (2, 4), (1, 11), (2, 5)].into_iter().enumerate() {
            one.sync
                .incoming(
                    &load_batch("gw", inc, seq, if inc == 1 { 4 } else { 1 }),
                    1.5 + t as f64 * 0.1,
                )
                .unwrap();
            assert_eq!(remote_on_a(&one), 5);
        }
        assert_eq!(one.sync.shared_names(), vec!["gw".to_string()]);
        assert_eq!(one.sync.peers(), vec!["gw".to_string()]);
        assert_eq!(one.sync.counters().identity_conflicts, 5);
        // One of them goes quiet: forgotten after load_ttl, and the name is unique again.
        one.sync.incoming(&load_batch("gw", 2, 6, 1), 5.3).unwrap();
        assert_eq!(remote_on_a(&one), 1);
        assert!(one.sync.shared_names().is_empty());
    }

    #[test]
    fn a_late_batch_of_an_older_incarnation_is_stale_not_a_second_replica() {
        // Probe: a batch of a replica's previous life delayed past its new life's first batch
        // flagged the name shared for load_ttl and added the old life's counts.
        let one = replica("one");
        one.sync.incoming(&load_batch("gw", 7, 1, 1), 1.0).unwrap();
        let report = one.sync.incoming(&load_batch("gw", 5, 40, 4), 1.1).unwrap();
        assert!(report.stale && !report.identity_conflict, "{report:?}");
        assert_eq!(remote_on_a(&one), 1, "the old life's counts are not added");
        assert!(one.sync.shared_names().is_empty());
        // This replica's own previous life ("one" has incarnation 3) is stale too...
        let report = one.sync.incoming(&load_batch("one", 2, 9, 4), 1.2).unwrap();
        assert!(report.stale && !report.identity_conflict);
        assert!(one.sync.shared_names().is_empty());
        let c = one.sync.counters();
        assert_eq!((c.stale_in, c.identity_conflicts), (2, 0));
        // ...while a later incarnation of its name is another live replica at once.
        let report = one.sync.incoming(&load_batch("one", 4, 1, 2), 1.3).unwrap();
        assert!(report.identity_conflict && !report.stale);
        assert_eq!(one.sync.shared_names(), vec!["one".to_string()]);
        assert_eq!(remote_on_a(&one), 3);
        // A stale life that falls silent is forgotten: a late batch of it much later is
        // stale again, not taken for a replica that kept speaking.
        one.sync.incoming(&load_batch("gw", 7, 2, 1), 4.2).unwrap();
        let report = one.sync.incoming(&load_batch("gw", 5, 41, 4), 5.0).unwrap();
        assert!(report.stale);
    }

    #[test]
    fn an_older_life_of_this_replicas_name_that_speaks_after_it_is_a_second_replica_at_once() {
        // Probe: two live replicas of one name were told apart from a restart only once the
        // older kept speaking for load_ttl. "one" (incarnation 3) hears an older "one".
        let one = replica("one");
        let report = one.sync.incoming(&load_batch("one", 2, 1, 4), 1.0).unwrap();
        assert!(report.stale);
        assert!(one.sync.incoming(&load_batch("one", 2, 2, 4), 1.0).unwrap().stale);
        one.sync.outgoing(1.0, true).unwrap();
        let report = one.sync.incoming(&load_batch("one", 2, 3, 4), 1.0).unwrap();
        assert!(report.identity_conflict && !report.stale, "{report:?}");
        assert_eq!(one.sync.shared_names(), vec!["one".to_string()]);
        assert_eq!(remote_on_a(&one), 4);
        let c = one.sync.counters();
        assert_eq!((c.stale_in, c.identity_conflicts), (2, 1));
    }

    #[test]
    fn the_history_keeps_what_a_catch_up_would_serve_and_no_longer() {
        let one = replica("one");
        for i in 0..10 {
            let d =
                one.router.decide(&prompt(i * 1000), &meta(Some(&format!("s{i}"))), 1.0).unwrap();
            drop(one.router.commit(&d, None, 1.0).unwrap());
        }
        one.sync.outgoing(1.0, false).unwrap();
        // 10 records and 10 session bindings, kept apart.
        assert_eq!(one.sync.state.lock().history.len(), 10);
        assert_eq!(one.sync.state.lock().session_history.len(), 10);
        // Past the record TTL (60 s) the records are never served again: they go.
        let d = one.router.decide(&prompt(99_000), &meta(None), 70.0).unwrap();
        drop(one.router.commit(&d, None, 70.0).unwrap());
        one.sync.outgoing(70.0, false).unwrap();
        assert_eq!(one.sync.state.lock().history.len(), 1);
    }

    /// `n` requests with a session each routed by `r` at `now`, published; the batch.
    fn route(r: &Replica, from: u32, n: u32, now: f64) -> Vec<u8> {
        for i in from..from + n {
            let d = r.router.decide(&prompt(i * 1000), &meta(Some(&format!("s{i}"))), now).unwrap();
            drop(r.router.commit(&d, None, now).unwrap());
        }
        r.sync.outgoing(now, false).unwrap()
    }

    fn answer_entries(batches: &[Vec<u8>]) -> (usize, usize, u64) {
        let mut out = (0, 0, 0);
        for b in batches {
            let batch = decode(b).unwrap();
            for e in &batch.entries {
                match e {
                    SyncEntry::Record { .. } => out.0 += 1,
                    SyncEntry::Session { .. } => out.1 += 1,
                }
            }
            out.2 = batch.seq;
        }
        out
    }

    #[test]
    fn a_catch_up_answers_only_what_the_asker_misses() {
        // Probe: every peer answered every catch-up with its whole history and every live
        // session it knew (its peers' too), so a replica back from a short blip got it all
        // again from each peer.
        let (one, two) = (replica("one"), replica("two"));
        let first = route(&one, 0, 10, 1.0);
        assert!(!two.sync.incoming(&first, 1.0).unwrap().behind);
        // Up to date: the answer is one batch without entries, carrying one's sequence.
        let request = two.sync.catch_up_request();
        assert_eq!(answer_entries(&one.sync.answer(&request, 2.0, 1 << 20)), (0, 0, 1));
        // Two misses one's next batch (a blip): the one after shows the gap, once.
        let _lost = route(&one, 10, 3, 3.0);
        let next = route(&one, 13, 1, 4.0);
        let report = two.sync.incoming(&next, 4.0).unwrap();
        assert!(report.behind && report.missed == 1);
        let repairs = two.sync.repair_requests();
        assert_eq!(repairs.len(), 1);
        assert!(two.sync.repair_requests().is_empty(), "asked once");
        // Only one answers a repair aimed at it: the 3 records and sessions it missed, and
        // the one it has live again (batch 3 is after the cursor, 1).
        assert!(two.sync.answer(&repairs[0], 4.0, 1 << 20).is_empty());
        let answer = one.sync.answer(&repairs[0], 4.0, 1 << 20);
        assert_eq!(answer_entries(&answer), (4, 4, 3));
        for b in &answer {
            two.sync.apply_catch_up(b, 4.0).unwrap();
        }
        assert!(cached_on_any(&two, &prompt(11_000)));
        let later = route(&one, 14, 1, 5.0);
        assert!(!two.sync.incoming(&later, 5.0).unwrap().behind);
        let request = two.sync.catch_up_request();
        assert_eq!(answer_entries(&one.sync.answer(&request, 5.0, 1 << 20)), (0, 0, 4));
        // A replica that knows no one gets its records and the sessions it owns, not the
        // sessions it learned from two (two sends them); then, asked alone, the sessions and
        // records of owners that did not answer (here two's: only one did).
        let three = replica("three");
        let other = route(&two, 100, 2, 5.0);
        one.sync.incoming(&other, 5.0).unwrap();
        let request = three.sync.catch_up_request();
        let answer = one.sync.answer(&request, 5.0, 1 << 20);
        assert_eq!(answer_entries(&answer), (15, 15, 4));
        for b in &answer {
            three.sync.apply_catch_up(b, 5.0).unwrap();
        }
        let table = three.sync.repair_requests();
        assert_eq!(table.len(), 1);
        assert_eq!(answer_entries(&one.sync.answer(&table[0], 5.0, 1 << 20)), (2, 2, 4));
        assert_eq!(three.sync.counters().tables_asked, 1);
        // One that knows another peer but not this one: its records and its own sessions.
        let fresh = replica("four");
        fresh.sync.incoming(&other, 5.0).unwrap();
        let request = fresh.sync.catch_up_request();
        assert_eq!(answer_entries(&one.sync.answer(&request, 5.0, 1 << 20)), (15, 15, 4));
        // The first format's request (name and incarnation as text) is answered in full.
        assert_eq!(answer_entries(&one.sync.answer(b"old\n9", 5.0, 1 << 20)), (15, 17, 4));
        // Its own request and a malformed one are not answered.
        assert!(one.sync.answer(&one.sync.catch_up_request(), 5.0, 1 << 20).is_empty());
        assert!(one.sync.answer(b"LSYQ\x09", 5.0, 1 << 20).is_empty());
        assert_eq!(one.sync.counters().malformed_in, 1);
        let c = one.sync.counters();
        assert!(c.catch_up_batches_out >= 6 && c.catch_up_bytes_out > 0, "{c:?}");
    }

    /// Every live session binding of `r` at `now`: (id, endpoint), sorted.
    fn bindings(r: &Replica, now: f64) -> Vec<(String, WorkerKey)> {
        let mut out: Vec<_> =
            r.router.sessions().live(now).into_iter().map(|s| (s.id, s.endpoint)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// A catch-up of `new` from `peers` (the connect's request, then the repairs and the
    /// session table request): the session entries each peer sent.
    fn first_start(new: &Replica, peers: &[&Replica], now: f64) -> Vec<usize> {
        let mut sent = vec![0; peers.len()];
        let request = new.sync.catch_up_request();
        let mut rounds = vec![request];
        while !rounds.is_empty() {
            for request in &rounds {
                for (i, p) in peers.iter().enumerate() {
                    let answer = p.sync.answer(request, now, 1 << 20);
                    sent[i] += answer_entries(&answer).1;
                    for b in &answer {
                        new.sync.apply_catch_up(b, now).unwrap();
                    }
                }
            }
            rounds = new.sync.repair_requests();
        }
        sent
    }

    #[test]
    fn a_new_replica_gets_each_session_once_even_of_a_replica_gone() {
        // Probe: a replica that knew no peer got every peer's whole session table, so with 4
        // peers of 25 sessions each it got 400 session entries for 100 sessions.
        let peers: Vec<Replica> = ["p0", "p1", "p2", "p3"].into_iter().map(replica).collect();
        let deliver = |from: usize, batch: &[u8], at: f64| {
            for (i, p) in peers.iter().enumerate() {
                if i != from {
                    p.sync.incoming(batch, at).unwrap();
                }
            }
        };
        for (i, p) in peers.iter().enumerate() {
            deliver(i, &route(p, 100 * i as u32, 25, 1.0), 1.0);
        }
        // A later use of p0's session s0 on p1: p1's binding wins everywhere, p1 owns it.
        deliver(1, &route(&peers[1], 0, 1, 2.0), 2.0);
        let everyone = bindings(&peers[0], 3.0);
        assert_eq!(everyone.len(), 100);
        assert!(peers.iter().all(|p| bindings(p, 3.0) == everyone));
        let all: Vec<&Replica> = peers.iter().collect();
        let new = replica("new");
        let sent = first_start(&new, &all, 3.0);
        assert_eq!(sent, [24, 26, 25, 25], "each session once, by its owner");
        assert_eq!(bindings(&new, 3.0), everyone);
        assert_eq!(new.sync.counters().tables_asked, 1);
        // p3 is gone (every peer holds its sessions): the first peer by name hands them on.
        let live = &all[..3];
        let later = replica("later");
        let sent = first_start(&later, live, 4.0);
        assert_eq!(sent, [24 + 25, 26, 25]);
        assert_eq!(bindings(&later, 4.0), bindings(&peers[0], 4.0));
        assert_eq!(bindings(&later, 4.0).len(), 100);
        // p0 has taken them over: the next new replica gets them from it at once, still once.
        let last = replica("last");
        assert_eq!(first_start(&last, live, 5.0), [24 + 25, 26, 25]);
        assert_eq!(bindings(&last, 5.0).len(), 100);
        // A session request aimed at a new replica: what it learned from the asker (p0's
        // sessions and p3's, from p0) is the asker's, not sent back.
        let pending = replica("pending");
        let request = pending.sync.catch_up_request();
        for b in peers[0].sync.answer(&request, 6.0, 1 << 20) {
            pending.sync.apply_catch_up(&b, 6.0).unwrap();
        }
        pending.sync.incoming(&peers[0].sync.outgoing(6.0, true).unwrap(), 6.0).unwrap();
        pending.sync.incoming(&later.sync.outgoing(6.0, true).unwrap(), 6.0).unwrap();
        let table = pending.sync.repair_requests();
        assert_eq!(table.len(), 1, "aimed at later, first by name");
        assert!(peers[0].sync.answer(&table[0], 6.0, 1 << 20).is_empty());
        let ask = encode_request(&CatchUpRequest {
            replica: "p0".into(),
            incarnation: 2,
            wants_sessions: true,
            target: Some(("later".into(), 5)),
            cursors: vec![("later".into(), 5, 1)],
        });
        // p1's and p2's (not listed), not the 49 later has from p0 (p3's included).
        assert_eq!(answer_entries(&later.sync.answer(&ask, 6.0, 1 << 20)).1, 26 + 25);
        // The new replicas answer as peers too: a session they learned is theirs to hand on
        // only when its owner is gone; here every owner answers.
        let with_new: Vec<&Replica> = vec![&peers[0], &peers[1], &peers[2], &new];
        let fresh = replica("fresh");
        assert_eq!(first_start(&fresh, &with_new, 6.0), [24 + 25, 26, 25, 0]);
        assert_eq!(bindings(&fresh, 6.0).len(), 100);
    }

    #[test]
    fn a_new_replica_gets_a_departed_owners_sessions_once_whoever_answered_before() {
        // Probe: the peer that answered a first start's session request took over a departed
        // replica's sessions in its own view only. When a later first start asked another
        // peer (the first by name had not answered the earlier one), both sent them.
        let peers: Vec<Replica> = ["p0", "p1", "p2", "p3"].into_iter().map(replica).collect();
        for (i, p) in peers.iter().enumerate() {
            let batch = route(p, 100 * i as u32, 25, 1.0);
            for (j, q) in peers.iter().enumerate() {
                if i != j {
                    q.sync.incoming(&batch, 1.0).unwrap();
                }
            }
        }
        // p3 is gone; p0 does not answer x1, so p1 answers its session request.
        let x1 = replica("x1");
        assert_eq!(first_start(&x1, &[&peers[1], &peers[2]], 2.0), [25 + 25 + 25, 25]);
        assert_eq!(bindings(&x1, 2.0).len(), 100);
        // Every peer answers x2; p0 answers its session request: p3's sessions come once.
        let x2 = replica("x2");
        let all = [&peers[0], &peers[1], &peers[2], &x1];
        assert_eq!(first_start(&x2, &all, 3.0), [25 + 25, 25, 25, 0]);
        assert_eq!(x2.sync.counters().sessions_applied, 100);
        assert_eq!(bindings(&x2, 3.0).len(), 100);
    }

    #[test]
    fn a_new_replica_gets_the_records_of_a_replica_gone() {
        // Probe: a departed replica's prefix records reached no new replica (each peer
        // answers only its own), though the engines it routed to still hold those prefixes.
        let peers: Vec<Replica> = ["p0", "p1", "p2"].into_iter().map(replica).collect();
        for (i, p) in peers.iter().enumerate() {
            let batch = route(p, 100 * i as u32, 4, 1.0);
            for (j, q) in peers.iter().enumerate() {
                if i != j {
                    q.sync.incoming(&batch, 1.0).unwrap();
                }
            }
        }
        // p0 got p2's records a second time (a repair's answer after the live batch).
        for b in peers[2].sync.catch_up(1.0, 1 << 20) {
            peers[0].sync.apply_catch_up(&b, 1.0).unwrap();
        }
        // p2 is gone: p0 (asked for what no answering peer owns) hands on its records, once.
        let new = replica("new");
        first_start(&new, &[&peers[0], &peers[1]], 2.0);
        for i in (0..3).flat_map(|p| (0..4).map(move |j| 100 * p + j)) {
            assert!(cached_on_any(&new, &prompt(i * 1000)), "prompt {i}");
        }
        assert_eq!(new.sync.counters().records_applied, 12, "each record once");
        // Those of a peer that answered are its own to send, not relayed again; none older
        // than the record TTL is relayed.
        let later = replica("later");
        let live = [&peers[0], &peers[1], &new];
        first_start(&later, &live, 3.0);
        assert_eq!(later.sync.counters().records_applied, 12);
        let last = replica("last");
        first_start(&last, &[&peers[0], &peers[1]], 1.0 + 61.0);
        assert_eq!(last.sync.counters().records_applied, 0);
    }

    #[test]
    fn a_request_to_one_peer_is_answered_by_it_alone() {
        let (one, two, three) = (replica("one"), replica("two"), replica("three"));
        let batch = route(&one, 0, 3, 1.0);
        three.sync.incoming(&batch, 1.0).unwrap();
        let request = three.sync.request_to("one", 3);
        assert!(two.sync.answer(&request, 1.0, 1 << 20).is_empty());
        assert_eq!(answer_entries(&one.sync.answer(&request, 1.0, 1 << 20)), (0, 0, 1));
        let request = three.sync.request_to("two", 3);
        assert_eq!(answer_entries(&two.sync.answer(&request, 1.0, 1 << 20)), (0, 0, 0));
    }

    #[test]
    fn session_owners_stay_as_few_as_the_sessions_held() {
        let opts = RouterOptions { max_sessions: 8, ..RouterOptions::default() };
        let pool = Arc::new(EndpointPool::new(StalePolicy::default()).unwrap());
        pool.upsert(Endpoint { address: "a:8000".into(), ..Endpoint::new(key("a")) });
        let index = Arc::new(PrefixIndex::new(IndexConfig::default()).unwrap());
        let config = parse_config(&presets::preset("llm-d").unwrap()).unwrap();
        let router = Router::new(pool, index, config, opts).unwrap();
        let sync = router.replica_sync("one".into(), 1, SyncOptions::default());
        let r = Replica { router, sync };
        // A client cycling new session ids within one second.
        for i in 0..50 {
            route(&r, i, 1, 1.0);
        }
        assert!(r.sync.state.lock().owners.len() <= 2 * 8 + 64);
        for i in 50..200 {
            route(&r, i, 1, 1.5);
        }
        assert!(r.sync.state.lock().owners.len() <= 2 * 8 + 64);
        assert_eq!(bindings(&r, 1.5).len(), 8);
        // The 8 held are all this replica's: a first start gets them from it.
        let new = replica("new");
        assert_eq!(first_start(&new, &[&r], 2.0), [8]);
    }

    fn cached_on_any(r: &Replica, tokens: &[u32]) -> bool {
        ["a", "b", "c"].iter().any(|e| cached_on(r, tokens, e) == 256)
    }

    #[test]
    fn a_repair_given_up_unanswered_is_asked_again_at_the_next_sign_of_the_gap() {
        // Probe 75: a repair whose answer never came left the peer "asked" for good: later
        // batches showing the same gap (or a new one) asked nothing.
        let (one, two) = (replica("one"), replica("two"));
        assert!(!two.sync.incoming(&route(&one, 0, 1, 1.0), 1.0).unwrap().behind);
        let _lost = route(&one, 1, 2, 2.0);
        assert!(two.sync.incoming(&route(&one, 3, 1, 3.0), 3.0).unwrap().behind);
        let repairs = two.sync.repair_requests_to();
        assert_eq!(repairs.iter().map(|r| &r.0).collect::<Vec<_>>(), [&("one".into(), 3)]);
        // The answer is lost: still asked, so nothing more is asked.
        assert!(!two.sync.incoming(&route(&one, 4, 1, 4.0), 4.0).unwrap().behind);
        assert!(two.sync.repair_requests().is_empty());
        assert!(two.sync.repair_unanswered("one", 3));
        assert!(!two.sync.repair_unanswered("one", 3), "once");
        assert!(!two.sync.repair_unanswered("nobody", 3));
        assert_eq!(two.sync.counters().repairs_unanswered, 1);
        // The next batch shows the gap again, and it is asked for (and answered this time).
        assert!(two.sync.incoming(&route(&one, 5, 1, 5.0), 5.0).unwrap().behind);
        let repairs = two.sync.repair_requests();
        assert_eq!(repairs.len(), 1);
        for b in one.sync.answer(&repairs[0], 5.0, 1 << 20) {
            two.sync.apply_catch_up(&b, 5.0).unwrap();
        }
        assert!(cached_on_any(&two, &prompt(1000)) && cached_on_any(&two, &prompt(2000)));
        assert!(!two.sync.repair_unanswered("one", 3), "answered: nothing outstanding");
        assert!(!two.sync.incoming(&route(&one, 6, 1, 6.0), 6.0).unwrap().behind);
        assert_eq!(two.sync.peer_ids(), [("one".to_string(), 3)]);
    }

    #[test]
    fn a_peer_first_heard_past_its_first_batch_is_asked_for_the_rest() {
        let (one, two) = (replica("one"), replica("two"));
        let _unheard = route(&one, 0, 2, 1.0);
        let heard = route(&one, 2, 1, 2.0);
        assert!(two.sync.incoming(&heard, 2.0).unwrap().behind);
        let repairs = two.sync.repair_requests();
        for b in one.sync.answer(&repairs[0], 2.0, 1) {
            two.sync.apply_catch_up(&b, 2.0).unwrap();
        }
        assert!(cached_on_any(&two, &prompt(0)) && cached_on_any(&two, &prompt(1000)));
        // The answer came in several batches (1 byte each at most); only the last moved the
        // cursor, and it is up to date.
        assert!(!two.sync.incoming(&route(&one, 3, 1, 3.0), 3.0).unwrap().behind);
        assert!(two.sync.repair_requests().is_empty());
    }

    #[test]
    fn catch_up_requests_round_trip_and_refuse_garbage() {
        let request = CatchUpRequest {
            replica: "gw-1".into(),
            incarnation: u64::MAX,
            wants_sessions: false,
            target: Some(("gw-0".into(), 7)),
            cursors: vec![("gw-0".into(), 7, 3), ("é".into(), 0, u64::MAX)],
        };
        let bytes = encode_request(&request);
        assert_eq!(decode_request(&bytes).unwrap(), Some(request.clone()));
        let plain = CatchUpRequest { target: None, wants_sessions: true, ..request };
        assert_eq!(decode_request(&encode_request(&plain)).unwrap(), Some(plain));
        assert_eq!(decode_request(b"gw-0\n12").unwrap(), None);
        let mut huge = bytes.clone();
        let at = bytes.len() - 4 - (2 + 4 + 16) - (2 + 2 + 16);
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_request(&huge).unwrap_err().to_string().contains("cannot fit"));
        assert!(decode_request(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn a_journal_larger_than_the_bus_allows_is_split_over_batches() {
        let (one, two) = (replica("one"), replica("two"));
        // 40 records of 16 blocks (about 150 bytes each) in flight, over 1,000-byte messages.
        let _tickets: Vec<_> = (0..40)
            .map(|i| {
                let d = one.router.decide(&prompt(i * 1000), &meta(None), 1.0).unwrap();
                one.router.commit(&d, None, 1.0).unwrap()
            })
            .collect();
        let batches = one.sync.outgoing_split(1.0, false, 1000);
        assert!(batches.len() >= 6, "{}", batches.len());
        assert!(batches.iter().all(|b| b.len() <= 1000));
        let mut records = 0;
        for b in &batches {
            let report = two.sync.incoming(b, 1.0).unwrap();
            assert!(!report.duplicate && report.missed == 0);
            records += report.records;
        }
        assert_eq!(records, 40);
        let total: u64 = ["a", "b", "c"]
            .iter()
            .map(|e| two.router.pool().snapshot().get(&key(e)).unwrap().inflight.remote().requests)
            .sum();
        assert_eq!(total, 40, "every batch carries the counts");
        // Nothing new: nothing to send.
        assert!(one.sync.outgoing_split(1.1, false, 1000).is_empty());
        // Catch-up batches keep to the same bound.
        assert!(one.sync.catch_up(2.0, 1000).iter().all(|b| b.len() <= 1000));
    }

    #[test]
    fn entries_for_unknown_endpoints_are_counted_not_applied() {
        let two = replica("two");
        let batch = SyncBatch {
            replica: "one".into(),
            incarnation: 7,
            seq: 1,
            hashing: None,
            loads: vec![(key("zz"), InFlightSnapshot { requests: 4, ..Default::default() })],
            entries: vec![SyncEntry::Record {
                endpoint: key("zz"),
                hashes: vec![1, 2],
                age_s: 0.0,
            }],
        };
        let report = two.sync.incoming(&encode(&batch).0, 1.0).unwrap();
        assert_eq!((report.records, report.unknown_endpoints), (0, 2));
    }

    #[test]
    fn the_codec_round_trips() {
        let batch = SyncBatch {
            replica: "gw-0".into(),
            incarnation: u64::MAX,
            seq: 42,
            hashing: Some(0xfeed_beef),
            loads: vec![
                (
                    key("a"),
                    InFlightSnapshot {
                        requests: 1,
                        prefill_requests: 2,
                        prefill_tokens: 3,
                        tokens: 4,
                    },
                ),
                (WorkerKey::Int(-5), InFlightSnapshot::default()),
            ],
            entries: vec![
                SyncEntry::Record {
                    endpoint: WorkerKey::Int(3),
                    hashes: vec![u64::MAX, 0],
                    age_s: 1.5,
                },
                SyncEntry::Session { endpoint: key("é"), id: "s".into(), age_s: 0.0 },
            ],
        };
        let (bytes, skipped) = encode(&batch);
        assert_eq!(skipped, 0);
        assert_eq!(decode(&bytes).unwrap(), batch);
        // Without the sender's hashing: version 1, still read.
        let first = SyncBatch { hashing: None, ..batch.clone() };
        let (old, _) = encode(&first);
        assert_eq!((old[4], old.len() + 8), (1, bytes.len()));
        assert_eq!(decode(&old).unwrap(), first);
        // Too long a string is left out and counted, never truncated.
        let long = SyncBatch {
            entries: vec![SyncEntry::Session {
                endpoint: key("a"),
                id: "x".repeat(70_000),
                age_s: 0.0,
            }],
            ..batch.clone()
        };
        let (bytes, skipped) = encode(&long);
        assert_eq!(skipped, 1);
        assert!(decode(&bytes).unwrap().entries.is_empty());
    }

    #[test]
    fn malformed_batches_name_the_problem_and_change_nothing() {
        let two = replica("two");
        let good = encode(&SyncBatch {
            replica: "one".into(),
            incarnation: 1,
            seq: 1,
            hashing: None,
            loads: vec![],
            entries: vec![SyncEntry::Record { endpoint: key("a"), hashes: vec![9; 4], age_s: 0.0 }],
        })
        .0;
        let mut huge_count = good.clone();
        // magic, version, replica "one", incarnation, seq, no loads, one entry: tag, key "a", age.
        let at = 4 + 1 + (2 + 3) + 8 + 8 + 4 + 4 + 1 + (1 + 2 + 1) + 4; // the hash count
        huge_count[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut nan_age = good.clone();
        nan_age[at - 4..at].copy_from_slice(&f32::NAN.to_le_bytes());
        for (bytes, needle) in [
            (b"nope".to_vec(), "bad magic"),
            (good[..good.len() - 3].to_vec(), "cannot fit"),
            (good[..20].to_vec(), "bytes needed"),
            ([good.clone(), vec![0]].concat(), "after the batch"),
            (huge_count, "cannot fit"),
            (nan_age, "age must be finite"),
        ] {
            let err = two.sync.incoming(&bytes, 1.0).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
        assert_eq!(two.sync.counters().malformed_in, 6);
        assert!(two.sync.peers().is_empty());
        assert_eq!(two.sync.counters().records_applied, 0);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_cleanly(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&data);
            let mut request = b"LSYQ\x01".to_vec();
            request.extend_from_slice(&data);
            let _ = decode_request(&request);
            for version in [1u8, 2] {
                let mut framed = b"LSYN".to_vec();
                framed.push(version);
                framed.extend_from_slice(&data);
                let _ = decode(&framed);
            }
        }

        #[test]
        fn any_truncation_or_flip_of_a_good_batch_fails_cleanly(cut in 0usize..200, flip in 0usize..200, bit in 0u8..8) {
            let batch = SyncBatch {
                replica: "r".into(),
                incarnation: 3,
                seq: 9,
                hashing: Some(5),
                loads: vec![(key("a"), InFlightSnapshot { requests: 2, ..Default::default() })],
                entries: vec![
                    SyncEntry::Record { endpoint: key("b"), hashes: vec![1, 2, 3], age_s: 0.5 },
                    SyncEntry::Session { endpoint: WorkerKey::Int(1), id: "sess".into(), age_s: 2.0 },
                ],
            };
            let bytes = encode(&batch).0;
            let cut = cut.min(bytes.len());
            let _ = decode(&bytes[..cut]);
            let mut flipped = bytes.clone();
            let i = flip % flipped.len();
            flipped[i] ^= 1 << bit;
            let _ = decode(&flipped);
        }
    }
}
