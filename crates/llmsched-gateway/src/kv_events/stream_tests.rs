//! The state machine alone, against a recording wire; `tests/test_integrations_kv_events.py`
//! runs the same cases over real sockets for both subscribers.

use super::*;

#[derive(Default)]
struct Recorder {
    applied: Vec<u8>,
    clears: usize,
    asked: Vec<u64>,
    resets: usize,
    replay: bool,
    /// The malformed batches reported, by sequence number.
    reported: Vec<u64>,
}

impl Wire for Recorder {
    fn apply(&mut self, payload: &[u8]) -> Result<ApplyReport, String> {
        let first = *payload.first().ok_or("an empty payload")?;
        self.applied.push(first);
        Ok(ApplyReport { events: 1, ..ApplyReport::default() })
    }
    fn malformed_batch(&mut self, seq: u64, error: &str) {
        assert_eq!(error, "an empty payload");
        self.reported.push(seq);
    }
    fn clear(&mut self) {
        self.clears += 1;
    }
    fn has_replay(&self) -> bool {
        self.replay
    }
    fn ask_replay(&mut self, start: u64) {
        self.asked.push(start);
    }
    fn reset_replay(&mut self) {
        self.resets += 1;
    }
}

fn config() -> StreamConfig {
    StreamConfig {
        reorder_window: 2,
        reorder_wait_s: 0.05,
        buffer_cap: 8,
        buffer_cap_bytes: 1 << 20,
        replay_timeout_s: 1.0,
        replay_backoff_s: (10.0, 300.0),
        catch_up: false,
    }
}

/// A batch whose one payload byte names its sequence number.
fn batch(seq: u64) -> Bytes {
    Bytes::from(vec![seq as u8])
}

fn reply(seq: i64) -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(vec![seq as u8])]
}

#[test]
fn in_order_batches_apply_and_duplicates_are_dropped() {
    let (mut s, mut w) = (Stream::new(config()), Recorder::default());
    for seq in [0, 1, 1, 2, 0] {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 0], "0 again after the stream moved on: a restart");
    assert_eq!(s.counts.get(Counter::Duplicates), 1, "the second 1");
    assert_eq!((s.counts.get(Counter::Restarts), w.clears), (1, 1));
    assert_eq!(s.last_seq(), Some(0));
}

#[test]
fn a_late_batch_within_the_window_fills_its_hole() {
    let (mut s, mut w) = (Stream::new(config()), Recorder::default());
    for seq in [0, 2, 1, 3] {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 3]);
    assert_eq!(s.counts.get(Counter::Reordered), 1);
    assert_eq!(s.counts.get(Counter::Gaps), 0);
}

#[test]
fn a_hole_that_waits_too_long_is_replayed_and_the_replay_fills_it() {
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.on_live(0, batch(0), 0.0, &mut w);
    s.on_live(3, batch(3), 0.0, &mut w);
    assert_eq!(s.next_deadline(), Some(0.05));
    s.check_timers(0.06, &mut w);
    assert_eq!((w.asked.clone(), s.counts.get(Counter::MissedBatches)), (vec![1], 2));
    s.on_live(4, batch(4), 0.07, &mut w); // held while the replay runs
    for seq in [1, 2, 3, -1] {
        s.on_replay_reply(&reply(seq), b"t", 0.08, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 3, 4]);
    // 3 was held from the live stream and applied once 2 came: its replayed copy is dropped.
    assert_eq!(s.counts.get(Counter::ReplayedBatches), 2);
    assert!(!s.state(0.1).replaying);
}

#[test]
fn a_silent_replay_is_given_up_the_worker_resynced_and_the_socket_backs_off() {
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.on_live(0, batch(0), 0.0, &mut w);
    for seq in 2..6 {
        s.on_live(seq, batch(seq), 0.0, &mut w); // past the window: a gap at once
    }
    assert_eq!(w.asked, [1]);
    s.check_timers(1.5, &mut w);
    assert_eq!(s.counts.get(Counter::ReplayTimeouts), 1);
    assert_eq!((w.clears, w.resets), (1, 1));
    assert_eq!(w.applied, [0, 2, 3, 4, 5]);
    assert!(s.state(1.5).replay_backoff_s > 9.0);
    // Another gap while the socket backs off resyncs at once.
    for seq in 7..10 {
        s.on_live(seq, batch(seq), 2.0, &mut w);
    }
    assert_eq!(s.counts.get(Counter::ReplaysSkipped), 1);
    assert_eq!(w.asked.len(), 1);
}

/// A stream that catches up on connecting, on a wire with a replay socket.
fn catching_up() -> (Stream, Recorder) {
    let config = StreamConfig { catch_up: true, ..config() };
    (Stream::new(config), Recorder { replay: true, ..Default::default() })
}

#[test]
fn a_catch_up_that_times_out_is_asked_again_after_the_backoff() {
    let (mut s, mut w) = catching_up();
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.connected(true, 0.0, &mut w); // a subscriber restarted while the publisher went quiet
    assert_eq!(w.asked, [3]);
    s.check_timers(1.5, &mut w); // no answer within the replay timeout
    assert_eq!(s.counts.get(Counter::ReplayTimeouts), 1);
    let retry = s.next_deadline().expect("the catch-up is due again");
    assert!((retry - 11.5).abs() < 1e-9, "after the 10 s backoff: {retry}");
    s.check_timers(5.0, &mut w);
    assert_eq!(w.asked, [3], "not during the backoff");
    s.check_timers(11.5, &mut w);
    assert_eq!(w.asked, [3, 3]);
    assert_eq!(s.counts.get(Counter::CatchUps), 2);
    for seq in [3, 4, -1] {
        s.on_replay_reply(&reply(seq), b"", 12.0, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 3, 4]);
    assert_eq!(s.next_deadline(), None, "answered: nothing more is due");
    s.check_timers(100.0, &mut w);
    assert_eq!(w.asked.len(), 2);
}

#[test]
fn a_replay_in_flight_when_the_feed_stops_is_forgotten() {
    let (mut s, mut w) = catching_up();
    s.connected(true, 0.0, &mut w);
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.5, &mut w); // the catch-up is still unanswered
    }
    assert!(s.state(0.5).replaying);
    s.stopped();
    assert_eq!(s.next_deadline(), None, "no timeout waits on a closed socket");
    s.connected(true, 0.6, &mut w); // started again
                                    // From the last batch taken (2): the new connection shows it continues the sequence.
    assert_eq!(w.asked, [0, 2], "asked afresh at once");
    assert_eq!(s.counts.get(Counter::ReplayTimeouts), 0);
    assert_eq!(s.state(0.6).replay_backoff_s, 0.0);
}

#[test]
fn a_hole_held_across_a_stop_is_asked_for_after_the_start() {
    // Without catch-ups: the hole's wait was spent before the stop (no late arrival can come
    // on a closed socket), so the first check after the start replays it.
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.on_live(0, batch(0), 0.0, &mut w);
    s.on_live(2, batch(2), 0.01, &mut w); // held, 1 missing
    s.stopped();
    s.connected(true, 10.0, &mut w);
    assert!(w.asked.is_empty());
    let due = s.next_deadline().expect("the hole's deadline is kept");
    assert!((due - 0.06).abs() < 1e-9, "{due}");
    s.check_timers(10.0, &mut w);
    assert_eq!(w.asked, [1]);
    for seq in [1, 2, -1] {
        s.on_replay_reply(&reply(seq), b"", 10.1, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2]);
    assert_eq!(s.counts.get(Counter::Gaps), 1);
    // With catch-ups: the start's catch-up asks from the hole and fills it, no gap counted.
    let (mut s, mut w) = catching_up();
    s.on_live(0, batch(0), 0.0, &mut w);
    s.on_live(2, batch(2), 0.01, &mut w);
    s.stopped();
    s.connected(true, 10.0, &mut w);
    assert_eq!(w.asked, [1]);
    s.check_timers(10.0, &mut w);
    assert_eq!(w.asked, [1], "the catch-up covers the hole");
    for seq in [1, 2, 3, -1] {
        s.on_replay_reply(&reply(seq), b"", 10.1, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 3]);
    assert_eq!(s.counts.get(Counter::Gaps), 0);
}

#[test]
fn a_gap_replay_that_times_out_is_not_a_catch_up() {
    let (mut s, mut w) = catching_up();
    s.on_live(0, batch(0), 0.0, &mut w);
    for seq in 2..6 {
        s.on_live(seq, batch(seq), 0.0, &mut w); // past the window: a gap at once
    }
    s.check_timers(1.5, &mut w);
    assert_eq!(s.counts.get(Counter::ReplayTimeouts), 1);
    assert_eq!(s.next_deadline(), None, "the hole was resynced; live batches show any new one");
    s.check_timers(20.0, &mut w);
    assert_eq!(w.asked, [1]);
}

#[test]
fn a_new_publisher_starting_over_is_a_restart() {
    let (mut s, mut w) = (Stream::new(config()), Recorder::default());
    for seq in 0..5 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.connected(true, 0.0, &mut w);
    s.connected(true, 0.0, &mut w); // a reconnection: the next batch decides
    s.on_live(3, batch(3), 0.0, &mut w);
    assert_eq!(s.counts.get(Counter::Restarts), 1);
    assert_eq!(w.clears, 1);
    assert_eq!(s.counts.get(Counter::Reconnects), 1);
}

#[test]
fn the_buffer_cap_ends_a_replay_that_does_not_answer() {
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.on_live(0, batch(0), 0.0, &mut w);
    for seq in 2..12 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    assert_eq!(w.asked, [1], "held past the window: a gap, replayed");
    assert_eq!(s.counts.get(Counter::BufferOverflows), 1);
    assert_eq!((w.resets, w.clears), (1, 1));
    assert_eq!(w.applied, [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(s.state(0.0).held_peak, 8);
}

#[test]
fn a_replay_answering_only_what_was_applied_times_out_as_a_silent_one() {
    // Probe 48 F3: every reply pushed the deadline back, so one answering stale batches (or
    // negative numbers) forever held the live stream until the buffer caps.
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.on_live(0, batch(0), 0.0, &mut w);
    for seq in 2..6 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    assert_eq!(w.asked, [1]);
    for t in 1..15 {
        let now = f64::from(t) * 0.1;
        s.on_replay_reply(&reply(if t % 2 == 0 { 0 } else { -7 }), b"t", now, &mut w);
        s.check_timers(now, &mut w);
    }
    assert_eq!(s.counts.get(Counter::ReplayTimeouts), 1, "given up at its deadline");
    assert_eq!(w.applied, [0, 2, 3, 4, 5]);
    assert!(!s.state(1.5).replaying);
    assert_eq!(s.counts.get(Counter::DecodeErrors), 5, "the replies of -7");
}

#[test]
fn a_sequence_number_past_int64_is_malformed_and_far_jumps_count_a_bounded_loss() {
    // Probe 48 F1: u64::MAX made the next expected number wrap to 0 (a repeat was applied
    // again after clearing the worker), and one far jump added 10^19 missed batches.
    let (mut s, mut w) = (Stream::new(config()), Recorder::default());
    for seq in [0, 1] {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    for _ in 0..2 {
        s.on_live(u64::MAX, batch(9), 0.0, &mut w);
        s.on_live(1 << 63, batch(9), 0.0, &mut w);
    }
    assert_eq!(s.counts.get(Counter::DecodeErrors), 4);
    assert_eq!((w.applied.clone(), s.last_seq(), w.clears), (vec![0, 1], Some(1), 0));
    let far = i64::MAX as u64;
    for seq in [far, far - 1, far - 2] {
        s.on_live(seq, batch(seq), 0.0, &mut w); // past the window: a gap at once
    }
    assert_eq!(s.counts.get(Counter::MissedBatches), MAX_GAP_COUNTED);
    assert_eq!(s.last_seq(), Some(far));
    let mut counts = Counts::default();
    counts.bump(Counter::Events, u64::MAX);
    counts.bump(Counter::Events, 5);
    counts.add(&counts.clone());
    assert_eq!(counts.get(Counter::Events), u64::MAX, "saturates, never wraps back");
}

/// A batch of a publisher's second run (an engine restarted): other bytes at the same number.
fn rerun(seq: u64) -> Bytes {
    Bytes::from(vec![100u8.wrapping_add(seq as u8)])
}

fn rerun_reply(seq: i64) -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), rerun(seq as u64)]
}

#[test]
fn a_malformed_batch_is_taken_reported_once_and_the_worker_resynced() {
    // Probe 57 F1: a malformed batch took its number and left the worker as it was, though
    // its events (removals among them) were lost; nothing was logged.
    let (mut s, mut w) = (Stream::new(config()), Recorder::default());
    for (seq, payload) in [(0, batch(0)), (1, Bytes::new()), (2, Bytes::new()), (3, batch(3))] {
        s.on_live(seq, payload, 0.0, &mut w);
    }
    assert_eq!((w.applied.clone(), s.last_seq()), (vec![0, 3], Some(3)));
    assert_eq!(s.counts.get(Counter::DecodeErrors), 2);
    assert_eq!((s.counts.get(Counter::Resyncs), w.clears), (2, 2), "lost for good: cleared");
    assert_eq!((s.counts.get(Counter::Gaps), s.counts.get(Counter::Batches)), (0, 2));
    assert_eq!(w.reported, [1], "the first one only");
    assert!(w.asked.is_empty(), "a replay would send the same bytes");
}

#[test]
fn a_reconnection_is_verified_by_the_last_batch_taken() {
    let (mut s, mut w) = catching_up();
    s.connected(true, 0.0, &mut w);
    for seq in [0, -1] {
        s.on_replay_reply(&reply(seq), b"", 0.0, &mut w);
    }
    for seq in 1..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.connected(true, 1.0, &mut w); // the same publisher, back after a blip
    assert_eq!(w.asked, [0, 2], "from the last batch taken");
    for seq in [2, 3, 4, -1] {
        s.on_replay_reply(&reply(seq), b"", 1.0, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 3, 4]);
    assert_eq!((s.counts.get(Counter::Restarts), w.clears), (0, 0));
    s.on_live(5, batch(5), 1.1, &mut w);
    assert_eq!(s.last_seq(), Some(5));
}

#[test]
fn an_engine_restarted_past_the_last_batch_taken_is_a_restart() {
    // Probe 57 F2: a restarted engine whose new run had passed the old one's last number by
    // the time the subscriber reconnected was taken for the same run: its gap was replayed
    // onto the old run's blocks, which stayed.
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    s.connected(true, 0.0, &mut w);
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.connected(true, 1.0, &mut w); // the engine's new process
    s.on_live(7, rerun(7), 1.0, &mut w); // past the last seen: no restart by number alone
    s.check_timers(1.1, &mut w); // the hole's wait is up: a gap
    assert_eq!(w.asked, [2], "from the last batch taken");
    s.on_replay_reply(&rerun_reply(2), b"", 1.1, &mut w);
    assert_eq!((s.counts.get(Counter::Restarts), w.clears), (1, 1));
    assert_eq!(w.asked, [2, 0], "the new run from its start");
    for seq in [0, 1, 2, 3, 4, 5, 6, 7, -1] {
        s.on_replay_reply(&rerun_reply(seq), b"", 1.2, &mut w);
    }
    s.on_live(8, rerun(8), 1.3, &mut w);
    assert_eq!(w.applied, [0, 1, 2, 100, 101, 102, 103, 104, 105, 106, 107, 108]);
    assert_eq!(s.counts.get(Counter::Resyncs), 0);
}

#[test]
fn a_replay_with_nothing_from_the_last_batch_taken_is_a_restart() {
    // The new run is behind the old one's last number: the catch-up finds nothing there.
    let (mut s, mut w) = catching_up();
    s.connected(true, 0.0, &mut w);
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.on_replay_reply(&reply(-1), b"", 0.0, &mut w); // the first catch-up: nothing new
    s.connected(true, 1.0, &mut w);
    assert_eq!(w.asked, [0, 2]);
    s.on_replay_reply(&rerun_reply(0), b"", 1.0, &mut w); // below: ignored
    s.on_replay_reply(&reply(-1), b"", 1.0, &mut w);
    assert_eq!((s.counts.get(Counter::Restarts), w.clears), (1, 1));
    assert_eq!(w.asked, [0, 2, 0]);
    for seq in [0, 1, -1] {
        s.on_replay_reply(&rerun_reply(seq), b"", 1.1, &mut w);
    }
    assert_eq!(w.applied, [0, 1, 2, 100, 101]);
}

#[test]
fn a_shared_socket_stream_going_back_after_a_connection_is_checked() {
    // Probe 57 F2: on a shared socket (no publisher identity) a restarted engine whose batch
    // 0 was lost sent numbers below the last taken: all dropped as duplicates, and its old
    // blocks kept.
    for replay in [true, false] {
        let (mut s, mut w) = (Stream::new(config()), Recorder { replay, ..Default::default() });
        for seq in 0..6 {
            s.on_live(seq, batch(seq), 0.0, &mut w);
        }
        s.connected(false, 1.0, &mut w); // some member's connection
        s.on_live(4, rerun(4), 1.0, &mut w); // within the window: a duplicate by number
        if replay {
            assert_eq!(w.asked, [5], "the last batch taken, to compare");
            s.on_replay_reply(&rerun_reply(5), b"", 1.0, &mut w);
            assert_eq!(w.asked, [5, 0]);
            for seq in 0..6 {
                s.on_replay_reply(&rerun_reply(seq), b"", 1.1, &mut w);
            }
        } else {
            s.check_timers(1.1, &mut w); // 0..3 of the new run are lost: a resync at 4
            assert_eq!(s.counts.get(Counter::Resyncs), 1);
        }
        assert_eq!(s.counts.get(Counter::Restarts), 1, "replay: {replay}");
        let tail: &[u8] = if replay { &[100, 101, 102, 103, 104, 105] } else { &[104] };
        assert_eq!(&w.applied[6..], tail, "replay: {replay}");
    }
    // The same publisher on a shared socket: its live stream moves on, nothing is asked.
    let (mut s, mut w) = (Stream::new(config()), Recorder { replay: true, ..Default::default() });
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.connected(false, 1.0, &mut w);
    s.on_live(3, batch(3), 1.0, &mut w);
    s.on_live(2, batch(2), 1.0, &mut w); // a duplicate once the stream moved on
    assert!(w.asked.is_empty());
    assert_eq!(s.counts.get(Counter::Duplicates), 1);
}

#[test]
fn a_publisher_that_no_longer_holds_the_last_batch_taken_resyncs() {
    let (mut s, mut w) = catching_up();
    s.connected(true, 0.0, &mut w);
    for seq in 0..3 {
        s.on_live(seq, batch(seq), 0.0, &mut w);
    }
    s.on_replay_reply(&reply(-1), b"", 0.0, &mut w);
    s.connected(true, 1.0, &mut w);
    for seq in [3, 4, -1] {
        s.on_replay_reply(&reply(seq), b"", 1.0, &mut w); // its buffer starts after 2
    }
    assert_eq!((s.counts.get(Counter::Resyncs), w.clears), (1, 1), "not shown to continue");
    assert_eq!(s.counts.get(Counter::Restarts), 0);
    assert_eq!(w.applied, [0, 1, 2, 3, 4]);
}
