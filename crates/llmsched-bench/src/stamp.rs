//! Engine timestamps in streamed events, so that what a gateway adds to a stream can be told
//! apart from the fake engine's own schedule.
//!
//! A streamed answer's latency is mostly the engine's: its tokens come a timer's sleep apart,
//! and tokio's timer wakes with about a millisecond of jitter, more than a gateway adds. With
//! stamping on (`llmsched-fake-engine --stamp`) every `data: {...}` event of a stream carries
//! two more JSON fields, [`RECEIVED`] (when the engine had read the request) and [`SENT`]
//! (when it handed the event to its connection), both nanoseconds of `CLOCK_MONOTONIC`
//! ([`monotonic_ns`]), the clock the generator reads too (one machine). From them the
//! generator measures, per request:
//!
//! * forward: the request's start at the client to its arrival at the engine (through the
//!   gateway: reading, parsing, routing, the second connection);
//! * relay: for each event, its hand-over at the engine to its arrival at the client (through
//!   the gateway: one more read and write per event);
//! * net latency: the latency less the engine's time (its first reading of the request to its
//!   last stamped event): forward + the last event's relay + the `[DONE]` after it.
//!
//! The gateway's added streamed latency is then the net latency's quantile through it minus
//! the direct one: the engine's timer jitter is no longer in either. The stamps are fields a
//! client ignores (the gateways relay events unchanged), about 60 bytes per event.

/// The field with the engine's reading of the request, nanoseconds of `CLOCK_MONOTONIC`.
pub const RECEIVED: &str = "x_received_ns";
/// The field with the event's hand-over at the engine, nanoseconds of `CLOCK_MONOTONIC`.
pub const SENT: &str = "x_sent_ns";

/// Nanoseconds of `CLOCK_MONOTONIC` (what `std::time::Instant` reads on Linux, as a number
/// that two processes on one machine can compare).
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec for clock_gettime to fill; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// `event` (`data: {...}\n\n`, or a named one, `event: <name>\ndata: {...}\n\n`, as the
/// Responses API streams) with the two stamps added as the object's last fields; any other
/// event (`data: [DONE]`, a comment) unchanged.
pub fn stamp(event: &[u8], received_ns: u64, sent_ns: u64) -> Vec<u8> {
    let Some(body) = event.strip_suffix(b"}\n\n").filter(|_| carries_object(event)) else {
        return event.to_vec();
    };
    let mut out = Vec::with_capacity(event.len() + 64);
    out.extend_from_slice(body);
    // An empty object takes no comma.
    if !body.ends_with(b"{") {
        out.push(b',');
    }
    out.extend_from_slice(
        format!("\"{RECEIVED}\":{received_ns},\"{SENT}\":{sent_ns}}}\n\n").as_bytes(),
    );
    out
}

/// Whether an event's data line (its first line, or its second after an `event:` name) opens
/// a JSON object.
fn carries_object(event: &[u8]) -> bool {
    let data = match event.strip_prefix(b"event: ") {
        Some(named) => match named.iter().position(|&b| b == b'\n') {
            Some(end) => &named[end + 1..],
            None => return false,
        },
        None => event,
    };
    data.starts_with(b"data: {")
}

/// The stamps of one event (its bytes without the blank line that ends it): (received, sent),
/// or None when it carries none.
pub fn read(event: &[u8]) -> Option<(u64, u64)> {
    Some((field(event, RECEIVED)?, field(event, SENT)?))
}

/// The unsigned integer after `"name":` in `event` (the last occurrence: the stamps are the
/// object's last fields, after anything a prompt could have put in it).
fn field(event: &[u8], name: &str) -> Option<u64> {
    let key = format!("\"{name}\":");
    let at = event.windows(key.len()).rposition(|w| w == key.as_bytes())? + key.len();
    let digits = event[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 20 {
        return None;
    }
    std::str::from_utf8(&event[at..at + digits]).ok()?.parse().ok()
}

/// What the stamps of one stream give, in seconds (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamTimes {
    /// Client start to the engine's reading of the request.
    pub forward: f64,
    /// Per stamped event: engine hand-over to client arrival.
    pub relay: Vec<f64>,
    /// Latency less the engine's time (first reading to last stamped event).
    pub net_latency: f64,
}

/// The times of a stream that started at `started_ns`, ended at `finished_ns` and whose
/// stamped events (received, sent) arrived at the client at the given times (all
/// nanoseconds of `CLOCK_MONOTONIC`); None without a stamped event.
pub fn stream_times(
    started_ns: u64,
    finished_ns: u64,
    events: &[((u64, u64), u64)],
) -> Option<StreamTimes> {
    let &((received, _), _) = events.first()?;
    let &((_, last_sent), _) = events.last()?;
    let seconds = |from: u64, to: u64| (to as f64 - from as f64) / 1e9;
    Some(StreamTimes {
        forward: seconds(started_ns, received),
        relay: events.iter().map(|&((_, sent), arrived)| seconds(sent, arrived)).collect(),
        // latency - (last_sent - received)
        net_latency: seconds(started_ns, finished_ns) - seconds(received, last_sent),
    })
}

/// One stream's way through, event by event, for the slowest streams of a load
/// (`llmsched-loadgen --slow-streams N`): where its time beyond the engine's went. Times are
/// milliseconds; `started_ns` is `CLOCK_MONOTONIC` (what `perf record -k CLOCK_MONOTONIC`
/// stamps its samples with), so a slow stream can be found in a trace of the machine.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StreamTrace {
    /// The client's start, nanoseconds of `CLOCK_MONOTONIC`.
    pub started_ns: u64,
    /// The latency less the engine's own time ([`StreamTimes::net_latency`]).
    pub net_ms: f64,
    /// The client's start to the engine's reading of the request.
    pub forward_ms: f64,
    /// The engine's reading of the request to its first event's hand-over (its own time).
    pub engine_first_ms: f64,
    /// Per stamped event: its hand-over at the engine to its arrival at the client.
    pub relay_ms: Vec<f64>,
    /// Per stamped event after the first: the engine's time since the one before (its own
    /// schedule, taken out of `net_ms`).
    pub engine_gap_ms: Vec<f64>,
    /// The last stamped event's arrival to the stream's end (`[DONE]` and the close of the
    /// body).
    pub tail_ms: f64,
}

/// The event-by-event account of a stream (arguments as [`stream_times`]); None without a
/// stamped event.
pub fn stream_trace(
    started_ns: u64,
    finished_ns: u64,
    events: &[((u64, u64), u64)],
) -> Option<StreamTrace> {
    let times = stream_times(started_ns, finished_ns, events)?;
    let ms = |from: u64, to: u64| (to as f64 - from as f64) / 1e6;
    let &((received, first_sent), _) = events.first()?;
    let &(_, last_arrived) = events.last()?;
    Some(StreamTrace {
        started_ns,
        net_ms: times.net_latency * 1e3,
        forward_ms: times.forward * 1e3,
        engine_first_ms: ms(received, first_sent),
        relay_ms: times.relay.iter().map(|s| s * 1e3).collect(),
        engine_gap_ms: events.windows(2).map(|w| ms(w[0].0 .1, w[1].0 .1)).collect(),
        tail_ms: ms(last_arrived, finished_ns),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamped_event_reads_back_and_stays_json() {
        let event = b"data: {\"id\":\"cmpl-1\",\"choices\":[{\"text\":\" t0\"}]}\n\n";
        let stamped = stamp(event, 12, 3_456_789_012_345);
        let text = std::str::from_utf8(&stamped).unwrap();
        assert!(text.starts_with("data: {") && text.ends_with("}\n\n"), "{text}");
        let json: serde_json::Value =
            serde_json::from_str(text.trim_start_matches("data: ").trim_end()).unwrap();
        assert_eq!(json["x_received_ns"], 12);
        assert_eq!(json["x_sent_ns"], 3_456_789_012_345u64);
        assert_eq!(json["choices"][0]["text"], " t0");
        assert_eq!(read(stamped.strip_suffix(b"\n\n").unwrap()), Some((12, 3_456_789_012_345)));
    }

    #[test]
    fn a_named_event_is_stamped_in_its_data_line() {
        let event = b"event: response.output_text.delta\ndata: {\"delta\":\" t0\"}\n\n";
        let stamped = stamp(event, 7, 8);
        assert_eq!(
            stamped,
            b"event: response.output_text.delta\ndata: {\"delta\":\" t0\",\"x_received_ns\":7,\
              \"x_sent_ns\":8}\n\n"
        );
        assert_eq!(read(&stamped), Some((7, 8)));
        for other in [&b"event: ping\n\n"[..], b"event: x\ndata: [DONE]\n\n", b"event: x"] {
            assert_eq!(stamp(other, 1, 2), other.to_vec());
        }
    }

    #[test]
    fn other_events_pass_unchanged_and_read_none() {
        for event in [&b"data: [DONE]\n\n"[..], b": comment\n\n", b"data: {\"a\":1}"] {
            assert_eq!(stamp(event, 1, 2), event.to_vec());
        }
        assert_eq!(
            stamp(b"data: {}\n\n", 1, 2),
            b"data: {\"x_received_ns\":1,\"x_sent_ns\":2}\n\n"
        );
        assert_eq!(read(b"data: [DONE]"), None);
        assert_eq!(read(b"data: {\"x_sent_ns\":5}"), None, "both stamps or none");
        assert_eq!(read(b"data: {\"x_received_ns\":,\"x_sent_ns\":5}"), None);
        assert_eq!(read(b"data: {\"x_received_ns\":-1,\"x_sent_ns\":5}"), None);
        assert_eq!(
            read(b"data: {\"x_received_ns\":99999999999999999999999,\"x_sent_ns\":5}"),
            None
        );
    }

    #[test]
    fn the_last_stamp_wins_over_text_that_looks_like_one() {
        // A prompt echoed into the text cannot forge the engine's stamps.
        let event = b"data: {\"text\":\"\\\"x_sent_ns\\\":1\"}\n\n";
        let stamped = stamp(event, 7, 9);
        assert_eq!(read(&stamped), Some((7, 9)));
    }

    #[test]
    fn stream_times_take_the_engine_out() {
        // Started at 1000; the engine read it at 1300, sent at 1400 and 9400; the client got
        // them at 1500 and 9450 and the end at 9500.
        let times = stream_times(1_000, 9_500, &[((1_300, 1_400), 1_500), ((1_300, 9_400), 9_450)])
            .unwrap();
        assert!((times.forward - 300e-9).abs() < 1e-15);
        assert_eq!(times.relay.len(), 2);
        assert!((times.relay[0] - 100e-9).abs() < 1e-15 && (times.relay[1] - 50e-9).abs() < 1e-15);
        // 8500 ns of latency less 8100 ns at the engine.
        assert!((times.net_latency - 400e-9).abs() < 1e-15);
        assert_eq!(stream_times(0, 1, &[]), None);
    }

    #[test]
    fn a_trace_accounts_for_every_nanosecond_beyond_the_engine() {
        let events = [((1_300, 1_400), 1_500), ((1_300, 9_400), 9_450)];
        let trace = stream_trace(1_000, 9_500, &events).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert_eq!(trace.started_ns, 1_000);
        assert!(close(trace.forward_ms, 300e-6) && close(trace.engine_first_ms, 100e-6));
        assert!(close(trace.relay_ms[0], 100e-6) && close(trace.relay_ms[1], 50e-6));
        assert_eq!(trace.engine_gap_ms.len(), 1);
        assert!(close(trace.engine_gap_ms[0], 8_000e-6) && close(trace.tail_ms, 50e-6));
        // net = forward + last relay + tail: the parts add up to the whole.
        assert!(close(trace.net_ms, trace.forward_ms + trace.relay_ms[1] + trace.tail_ms));
        assert!(close(trace.net_ms, 400e-6));
        assert_eq!(stream_trace(0, 1, &[]), None);
    }

    #[test]
    fn the_clock_moves_forward() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(a > 0 && b >= a);
    }
}
