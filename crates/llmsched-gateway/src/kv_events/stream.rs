//! One publisher's stream of KV-event batches: the sequence state machine of the Python
//! subscriber (`llmsched.integrations.kv_events`, whose module docs state the algorithm: in
//! order, duplicates, out of order within a reorder window, gaps asked of the replay socket,
//! resyncs, restarts), without sockets. The socket side feeds it live batches, replay replies,
//! connections and the clock, and does what it asks through [`Wire`].

use std::collections::BTreeMap;

use bytes::Bytes;
use llmsched_core::prefix_index::ApplyReport;

/// The counters, in the order and with the names of the Python subscriber's `COUNTERS`.
pub const COUNTERS: [&str; 26] = [
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "all_cleared",
    "unknown_parent",
    "unknown_removed",
    "gaps",
    "missed_batches",
    "reordered",
    "duplicates",
    "held_batches",
    "buffer_overflows",
    "replays",
    "catch_ups",
    "replayed_batches",
    "replay_timeouts",
    "replays_skipped",
    "resyncs",
    "restarts",
    "decode_errors",
    "topic_rejected",
    "connects",
    "disconnects",
    "reconnects",
    "socket_errors",
];

/// A counter (an index into [`COUNTERS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Counter {
    Batches,
    Events,
    BlocksStored,
    BlocksRemoved,
    AllCleared,
    UnknownParent,
    UnknownRemoved,
    Gaps,
    MissedBatches,
    Reordered,
    Duplicates,
    HeldBatches,
    BufferOverflows,
    Replays,
    CatchUps,
    ReplayedBatches,
    ReplayTimeouts,
    ReplaysSkipped,
    Resyncs,
    Restarts,
    DecodeErrors,
    TopicRejected,
    Connects,
    Disconnects,
    Reconnects,
    SocketErrors,
}

/// Most batches one hole adds to `missed_batches`: a sequence number far ahead (a publisher's
/// bug) is not a measure of what was lost.
pub const MAX_GAP_COUNTED: u64 = 1 << 20;

/// A set of counters (saturating: a counter never wraps back).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts(pub [u64; 26]);

impl Counts {
    /// Adds `n` to `counter`.
    pub fn bump(&mut self, counter: Counter, n: u64) {
        let count = &mut self.0[counter as usize];
        *count = count.saturating_add(n);
    }

    /// One counter.
    pub fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize]
    }

    /// Adds every counter of `other`.
    pub fn add(&mut self, other: &Counts) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a = a.saturating_add(b);
        }
    }

    /// `(name, value)` pairs in [`COUNTERS`] order.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        COUNTERS.iter().copied().zip(self.0.iter().copied())
    }
}

/// How a stream tolerates disorder and loss (the Python subscriber's options).
#[derive(Clone, Debug, PartialEq)]
pub struct StreamConfig {
    /// Later batches held while a hole waits for a late arrival; a batch more than this far
    /// below the highest seen is a restart.
    pub reorder_window: u64,
    /// How long a hole waits for a late arrival before it is a gap.
    pub reorder_wait_s: f64,
    /// Most batches held.
    pub buffer_cap: usize,
    /// Most payload bytes held.
    pub buffer_cap_bytes: usize,
    /// How long a replay may stay silent before it is given up.
    pub replay_timeout_s: f64,
    /// First and largest pause before a replay socket that failed is asked again.
    pub replay_backoff_s: (f64, f64),
    /// Ask the replay socket for what was missed whenever a publisher (re)connects.
    pub catch_up: bool,
}

/// What a stream asks of its sockets and of the index.
pub trait Wire {
    /// Applies a batch to the worker in the index; the decoder's message when the payload is
    /// malformed (nothing of it applied).
    fn apply(&mut self, payload: &[u8]) -> Result<ApplyReport, String>;
    /// Reports the first malformed batch of the stream (the embedder logs it): `seq`, and what
    /// the decoder said.
    fn malformed_batch(&mut self, seq: u64, error: &str);
    /// Clears the worker in the index.
    fn clear(&mut self);
    /// Whether the publisher has a replay socket.
    fn has_replay(&self) -> bool;
    /// Asks the replay socket for every batch from `start`.
    fn ask_replay(&mut self, start: u64);
    /// Replaces the replay socket (replies to an abandoned request must not arrive).
    fn reset_replay(&mut self);
}

#[derive(Debug, Clone)]
struct Replay {
    start: u64,
    deadline: f64,
    /// Asked because the publisher (re)connected (`catch_up`), not because of a hole.
    catch_up: bool,
    /// The last batch taken, asked for again (`start` is its number) to show that the
    /// publisher behind a new connection continues the sequence: it must come back byte for
    /// byte. Dropped once decided.
    verify: Option<(u64, Bytes)>,
}

/// Where a stream stands (the Python subscriber's `worker_state`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamState {
    /// The sequence number expected next (None before any).
    pub next_seq: Option<u64>,
    /// The highest seen since the last restart.
    pub highest_seq: Option<u64>,
    /// Batches held back now, and their bytes.
    pub held: usize,
    /// Payload bytes held back now.
    pub held_bytes: usize,
    /// The most ever held at once.
    pub held_peak: usize,
    /// Whether a replay is in progress.
    pub replaying: bool,
    /// Seconds before a failed replay socket is asked again (0: it may be).
    pub replay_backoff_s: f64,
}

/// One publisher's sequence state.
#[derive(Debug)]
pub struct Stream {
    config: StreamConfig,
    next_seq: Option<u64>,
    highest: Option<u64>,
    new_peer: bool,
    peer_highest: Option<u64>,
    /// Whether the live stream delivered a batch since the last restart: until it has, a
    /// live batch 0 may be the live copy of one the catch-up replay applied first.
    live_seen: bool,
    held: BTreeMap<u64, Bytes>,
    held_bytes: usize,
    held_peak: usize,
    /// When the current hole was first seen.
    held_since: Option<f64>,
    replay: Option<Replay>,
    replay_failures: u32,
    replay_retry_at: f64,
    /// A catch-up whose replay timed out, asked again once the replay socket's backoff has
    /// passed: an idle publisher sends nothing that would show the hole.
    catch_up_due: bool,
    /// The payload of the last batch taken (None before any, and after a resync or restart).
    last_payload: Option<Bytes>,
    /// A connection was made since the last batch taken in order from the live stream: the
    /// next replay starts at the last batch taken, to show the publisher did not start over.
    verify: bool,
    /// Whether a malformed batch was reported (the first one only).
    malformed_reported: bool,
    /// This stream's counters.
    pub counts: Counts,
}

impl Stream {
    /// A stream that has seen nothing.
    pub fn new(config: StreamConfig) -> Stream {
        Stream {
            config,
            next_seq: None,
            highest: None,
            new_peer: false,
            peer_highest: None,
            live_seen: false,
            held: BTreeMap::new(),
            held_bytes: 0,
            held_peak: 0,
            held_since: None,
            replay: None,
            replay_failures: 0,
            replay_retry_at: 0.0,
            catch_up_due: false,
            last_payload: None,
            verify: false,
            malformed_reported: false,
            counts: Counts::default(),
        }
    }

    fn bump(&mut self, counter: Counter) {
        self.counts.bump(counter, 1);
    }

    /// The last sequence number taken (None before any).
    pub fn last_seq(&self) -> Option<u64> {
        self.next_seq.map(|n| n.saturating_sub(1))
    }

    /// Where it stands at `now`.
    pub fn state(&self, now: f64) -> StreamState {
        StreamState {
            next_seq: self.next_seq,
            highest_seq: self.highest,
            held: self.held.len(),
            held_bytes: self.held_bytes,
            held_peak: self.held_peak,
            replaying: self.replay.is_some(),
            replay_backoff_s: (self.replay_retry_at - now).max(0.0),
        }
    }

    /// When [`Stream::check_timers`] next has something to do (None: nothing pending).
    pub fn next_deadline(&self) -> Option<f64> {
        if let Some(replay) = &self.replay {
            return Some(replay.deadline);
        }
        let hole = self.held_since.map(|since| since + self.config.reorder_wait_s);
        let catch_up = self.catch_up_due.then_some(self.replay_retry_at);
        match (hole, catch_up) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn expected(&self) -> u64 {
        self.next_seq.unwrap_or(0)
    }

    /// A connection was made to (or accepted from) the publisher; `first` is false for a
    /// shared socket's connection, which cannot be told apart by publisher.
    pub fn connected(&mut self, own: bool, now: f64, wire: &mut dyn Wire) {
        if own {
            self.bump(Counter::Connects);
            if self.counts.get(Counter::Connects) > 1 {
                self.bump(Counter::Reconnects);
                // Possibly another process on the same address: its first batch decides.
                self.new_peer = true;
                self.peer_highest = self.highest;
            }
        }
        // Whoever is behind the connection must show it continues the sequence (a shared
        // socket's connection may be any member's).
        if !own || self.counts.get(Counter::Connects) > 1 {
            self.verify = self.next_seq.is_some() && self.last_payload.is_some();
        }
        // A new connection is a new chance for the replay socket too.
        self.replay_failures = 0;
        self.replay_retry_at = 0.0;
        self.catch_up_due = false;
        if self.config.catch_up {
            self.request_catch_up(now, wire);
        }
    }

    /// The feed stopped and closed its sockets: a replay in flight will never be answered, so
    /// it is forgotten (no timeout, no backoff) and the next start's connection asks afresh.
    pub fn stopped(&mut self) {
        self.replay = None;
        self.catch_up_due = false;
    }

    /// A connection was lost.
    pub fn disconnected(&mut self) {
        self.bump(Counter::Disconnects);
    }

    /// A socket failed (it is rebuilt after a backoff).
    pub fn socket_failed(&mut self) {
        self.bump(Counter::SocketErrors);
    }

    /// A malformed message.
    pub fn malformed(&mut self) {
        self.bump(Counter::DecodeErrors);
    }

    /// A message with a foreign topic.
    pub fn foreign_topic(&mut self) {
        self.bump(Counter::TopicRejected);
    }

    /// A live batch.
    pub fn on_live(&mut self, seq: u64, payload: Bytes, now: f64, wire: &mut dyn Wire) {
        if seq > i64::MAX as u64 {
            // vLLM numbers batches from 0 as an int64 (-1 only ends a replay): not a batch
            // number, and the next after u64::MAX would wrap to 0.
            self.malformed();
            return;
        }
        if self.is_restart(seq) {
            self.restart(wire);
        } else if self.verify && seq < self.expected() && self.replay.is_none() {
            // A live stream going back after a new connection: a duplicate only if the
            // publisher is the one whose batches were taken, which the replay shows; without
            // one, another process started over.
            if !wire.has_replay() {
                self.restart(wire);
            } else if now >= self.replay_retry_at {
                self.bump(Counter::CatchUps);
                self.ask_replay(self.expected(), false, now, wire);
            }
        }
        self.new_peer = false;
        self.live_seen = true;
        let expected = self.expected();
        if seq < expected || self.held.contains_key(&seq) {
            self.bump(Counter::Duplicates);
            return;
        }
        if self.highest.is_some_and(|h| seq < h) {
            self.bump(Counter::Reordered);
        }
        if self.highest.is_none_or(|h| seq > h) {
            self.highest = Some(seq);
        }
        if seq == expected {
            self.verify = false; // the live stream continues where it was
            self.apply(seq, &payload, false, wire);
            self.drain_held(now, wire);
        } else {
            self.hold(seq, payload, now, wire);
        }
    }

    fn is_restart(&self, seq: u64) -> bool {
        let Some(highest) = self.highest else { return false };
        if self.new_peer && self.peer_highest.is_some_and(|p| seq <= p) {
            return true;
        }
        if seq == 0 && self.live_seen && self.next_seq.is_some_and(|n| n > 0) {
            return true;
        }
        highest.checked_sub(self.config.reorder_window).is_some_and(|low| seq < low)
    }

    fn restart(&mut self, wire: &mut dyn Wire) {
        self.bump(Counter::Restarts);
        self.catch_up_due = false; // the new run's batches arrive live
        if self.replay.take().is_some() {
            wire.reset_replay();
        }
        self.drop_held();
        wire.clear();
        self.next_seq = None;
        self.highest = None;
        self.live_seen = false;
        self.last_payload = None;
        self.verify = false;
    }

    /// The publisher behind a new connection is not the one whose batches were taken (the
    /// replay showed another batch where the last one taken was, or none from there on): a
    /// restart, and its batches are asked for from its start.
    fn started_over(&mut self, now: f64, wire: &mut dyn Wire) {
        self.restart(wire);
        if wire.has_replay() {
            self.bump(Counter::CatchUps);
            self.ask_replay(0, true, now, wire);
        }
    }

    /// Keeps a batch that arrived after a hole until the hole is filled, within the caps; one
    /// that would pass a cap ends the wait (the replay is given up, every held batch applied,
    /// each remaining hole resynchronised).
    fn hold(&mut self, seq: u64, payload: Bytes, now: f64, wire: &mut dyn Wire) {
        let over = self.held.len() >= self.config.buffer_cap
            || self.held_bytes + payload.len() > self.config.buffer_cap_bytes;
        if over {
            self.bump(Counter::BufferOverflows);
            self.give_up_replay(now, wire);
            while !self.held.is_empty() {
                self.resync_to_held(now, wire);
            }
            if seq < self.expected() {
                self.bump(Counter::Duplicates); // its hole was given up on
                return;
            }
            if seq == self.expected() || payload.len() > self.config.buffer_cap_bytes {
                if seq > self.expected() {
                    self.resync(seq, wire);
                }
                self.apply(seq, &payload, false, wire);
                return;
            }
        }
        self.held_bytes += payload.len();
        self.held.insert(seq, payload);
        self.bump(Counter::HeldBatches);
        self.held_peak = self.held_peak.max(self.held.len());
        if self.held_since.is_none() {
            self.held_since = Some(now);
        }
        if self.replay.is_none() && self.held.len() as u64 > self.config.reorder_window {
            self.gap(now, wire);
        }
    }

    fn drop_held(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
        self.held_since = None;
    }

    /// Applies the held batches that now follow on; a hole that stays starts a new wait.
    fn drain_held(&mut self, now: f64, wire: &mut dyn Wire) {
        let mut progressed = false;
        while let Some(payload) = self.held.remove(&self.expected()) {
            self.held_bytes -= payload.len();
            self.apply(self.expected(), &payload, false, wire);
            progressed = true;
        }
        if self.held.is_empty() {
            self.held_since = None;
        } else if progressed || self.held_since.is_none() {
            self.held_since = Some(now);
        }
    }

    /// Batches before `target` neither applied nor held are lost for good: resynchronises at
    /// each such hole and applies what is held up to `target`.
    fn lose_before(&mut self, target: u64, now: f64, wire: &mut dyn Wire) {
        while self.expected() < target {
            let first_held = self.held.keys().next().copied().filter(|s| *s < target);
            let first = first_held.unwrap_or(target);
            if first > self.expected() || self.next_seq.is_none() {
                self.resync(first, wire);
            }
            self.drain_held(now, wire);
            if first_held.is_none() {
                return;
            }
        }
    }

    fn resync_to_held(&mut self, now: f64, wire: &mut dyn Wire) {
        if let Some(&first) = self.held.keys().next() {
            self.lose_before(first, now, wire);
        }
    }

    /// Gives up an overdue replay; declares a hole that waited too long a gap.
    pub fn check_timers(&mut self, now: f64, wire: &mut dyn Wire) {
        if let Some(replay) = self.replay.clone() {
            if now >= replay.deadline {
                self.bump(Counter::ReplayTimeouts);
                self.give_up_replay(now, wire);
                self.resync_to_held(now, wire);
                self.catch_up_due = replay.catch_up;
            }
        } else if self.catch_up_due && now >= self.replay_retry_at {
            self.catch_up_due = false;
            self.request_catch_up(now, wire);
        } else if self.held_since.is_some_and(|t| now - t >= self.config.reorder_wait_s) {
            self.gap(now, wire);
        }
    }

    /// The hole before the first held batch will not be filled by a late arrival.
    fn gap(&mut self, now: f64, wire: &mut dyn Wire) {
        let expected = self.expected();
        self.bump(Counter::Gaps);
        let first = self.held.keys().next().copied().unwrap_or(expected);
        self.counts
            .bump(Counter::MissedBatches, first.saturating_sub(expected).min(MAX_GAP_COUNTED));
        if !wire.has_replay() {
            self.resync_to_held(now, wire);
        } else if now < self.replay_retry_at {
            self.bump(Counter::ReplaysSkipped);
            self.resync_to_held(now, wire);
        } else {
            self.bump(Counter::Replays);
            self.ask_replay(expected, false, now, wire);
        }
    }

    fn request_catch_up(&mut self, now: f64, wire: &mut dyn Wire) {
        if !wire.has_replay() || self.replay.is_some() {
            return;
        }
        self.bump(Counter::CatchUps);
        self.ask_replay(self.expected(), true, now, wire);
    }

    /// Asks for every batch from `start`; from the last batch taken instead, when a new
    /// connection's continuity is still to be shown ([`Stream::verify`]).
    fn ask_replay(&mut self, start: u64, catch_up: bool, now: f64, wire: &mut dyn Wire) {
        let deadline = now + self.config.replay_timeout_s;
        let verify = match (&self.last_payload, self.next_seq) {
            (Some(payload), Some(next)) if self.verify && next > 0 && start == next => {
                Some((next - 1, payload.clone()))
            }
            _ => None,
        };
        let start = verify.as_ref().map_or(start, |(seq, _)| *seq);
        self.replay = Some(Replay { start, deadline, catch_up, verify });
        wire.ask_replay(start);
    }

    fn give_up_replay(&mut self, now: f64, wire: &mut dyn Wire) {
        if self.replay.take().is_none() {
            return;
        }
        wire.reset_replay();
        let (first, largest) = self.config.replay_backoff_s;
        let delay = largest.min(first * 2f64.powi(self.replay_failures.min(32) as i32));
        self.replay_failures += 1;
        self.replay_retry_at = now + delay;
    }

    /// One replay reply: `[b"", seq, payload]` or `[b"", topic, seq, payload]` (newer vLLM),
    /// the leading empty frame optional; `seq == -1` ends the replay.
    pub fn on_replay_reply(
        &mut self,
        frames: &[Bytes],
        topic: &[u8],
        now: f64,
        wire: &mut dyn Wire,
    ) {
        if self.replay.is_none() {
            return; // a straggler from a replay given up on
        }
        let frames = match frames.first() {
            Some(first) if first.is_empty() => &frames[1..],
            _ => frames,
        };
        let (seq, payload) = match frames {
            [frame_topic, seq, payload] => {
                if !frame_topic.is_empty() && frame_topic.as_ref() != topic {
                    self.bump(Counter::TopicRejected);
                    return;
                }
                (seq, payload)
            }
            [seq, payload] => (seq, payload),
            _ => {
                self.bump(Counter::DecodeErrors);
                return;
            }
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()) else {
            self.bump(Counter::DecodeErrors);
            return;
        };
        let seq = i64::from_be_bytes(seq);
        if seq == -1 {
            self.finish_replay(now, wire);
            return;
        }
        if let Some((verify_seq, taken)) = self.replay.as_ref().and_then(|r| r.verify.clone()) {
            match u64::try_from(seq) {
                Ok(s) if s == verify_seq => {
                    if let Some(replay) = self.replay.as_mut() {
                        replay.verify = None;
                        replay.deadline = now + self.config.replay_timeout_s;
                    }
                    if payload.as_ref() == taken.as_ref() {
                        self.verify = false; // the same publisher: its sequence goes on
                    } else {
                        self.started_over(now, wire);
                    }
                    return;
                }
                Ok(s) if s > verify_seq => {
                    // The publisher no longer holds the last batch taken: whether it started
                    // over cannot be shown, so what the worker holds is not trusted.
                    if let Some(replay) = self.replay.as_mut() {
                        replay.verify = None;
                    }
                    self.verify = false;
                    if s == self.expected() {
                        self.resync(s, wire);
                    } // (further on, `lose_before` resyncs)
                }
                _ => {}
            }
        }
        // Applied already (from the live stream or this replay), or not a batch number
        // (counted): no progress, so it does not keep the replay alive (one answering only
        // such replies would hold the live stream until the buffer caps).
        let Some(seq) = u64::try_from(seq).ok().filter(|&s| s >= self.expected()) else {
            if seq < 0 {
                self.bump(Counter::DecodeErrors);
            }
            return;
        };
        // A replay that keeps answering is not late: its deadline runs from its last useful
        // reply.
        if let Some(replay) = self.replay.as_mut() {
            replay.deadline = now + self.config.replay_timeout_s;
        }
        if seq > self.expected() {
            self.lose_before(seq, now, wire); // the engine no longer holds what lies before
            if seq < self.expected() {
                return; // its live copy was held and is applied now
            }
        }
        self.apply(seq, payload, true, wire);
        self.drain_held(now, wire);
    }

    fn finish_replay(&mut self, now: f64, wire: &mut dyn Wire) {
        let Some(replay) = self.replay.take() else { return };
        self.replay_failures = 0;
        if replay.verify.is_some() {
            // Nothing from the last batch taken on: the publisher's sequence is behind it.
            self.started_over(now, wire);
            return;
        }
        if !self.held.is_empty() && self.expected() <= replay.start {
            self.resync_to_held(now, wire);
        }
    }

    fn resync(&mut self, seq: u64, wire: &mut dyn Wire) {
        self.bump(Counter::Resyncs);
        wire.clear();
        self.next_seq = Some(seq);
        self.last_payload = None;
        self.verify = false;
    }

    fn apply(&mut self, seq: u64, payload: &Bytes, replayed: bool, wire: &mut dyn Wire) {
        if self.highest.is_none_or(|h| seq > h) {
            self.highest = Some(seq);
        }
        let report = wire.apply(payload);
        let report = match report {
            Ok(report) => report,
            Err(error) => {
                // Not waited for (a replay sends the same bytes), but its events are lost: the
                // worker is resynchronised as after any batch lost for good.
                self.bump(Counter::DecodeErrors);
                if !self.malformed_reported {
                    self.malformed_reported = true;
                    wire.malformed_batch(seq, &error);
                }
                self.resync(seq + 1, wire);
                self.last_payload = Some(payload.clone());
                return;
            }
        };
        // The sequence number moves with the counters, after the index: whoever reads
        // `last_seq` reach a batch (under the same lock) sees its blocks and counts too.
        self.next_seq = Some(seq + 1);
        self.last_payload = Some(payload.clone());
        self.bump(Counter::Batches);
        if replayed {
            self.bump(Counter::ReplayedBatches);
        }
        self.counts.bump(Counter::Events, report.events);
        self.counts.bump(Counter::BlocksStored, report.blocks_stored);
        self.counts.bump(Counter::BlocksRemoved, report.blocks_removed);
        self.counts.bump(Counter::AllCleared, report.cleared);
        self.counts.bump(Counter::UnknownParent, report.unknown_parent);
        self.counts.bump(Counter::UnknownRemoved, report.unknown_removed);
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
