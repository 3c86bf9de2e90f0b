//! What the relay reads of an answer as it passes: its framing and type ([`AnswerFields`]),
//! whether an event stream showed its end (`data: [DONE]`, a Responses stream's terminal
//! event), its output tokens, and a Responses stream's id.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::{HeaderMap, Response, StatusCode};

use crate::framing::{coded_transfer, ends_at_close};
use crate::relay::Relaying;
use crate::{responses, sse_scan};

/// The search for a Responses stream's id ([`responses::IdScan`]), recorded as `engine`'s
/// once found.
pub(crate) struct OwnerScan {
    pub(crate) owners: Arc<responses::Owners>,
    pub(crate) engine: Arc<str>,
    pub(crate) scan: responses::IdScan,
}

impl OwnerScan {
    /// Reads the next bytes of the stream.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        if let Some(id) = self.scan.feed(data) {
            self.owners.record(id, &self.engine);
        }
    }
}

/// Whether a whole event stream shows its end: its `[DONE]` event, or a Responses stream's
/// terminal event.
pub(crate) fn shows_its_end(stream: &[u8], responses: bool) -> bool {
    let mut scan = if responses {
        DoneScan::Events(responses::TerminalScan::default())
    } else {
        DoneScan::Looking(DoneEvent::default())
    };
    scan.feed(stream);
    scan.whole()
}

/// What the gateway reads of an engine's answer head on every answer, found in one pass over
/// its fields (an answer has a few), as [`RequestFields`] for a request: the functions above
/// that look fields up by name, looking up only those the answer has.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AnswerFields {
    pub(crate) transfer: bool,
    pub(crate) length: bool,
    /// Its first `Content-Type` says `text/event-stream` ([`is_event_stream`]).
    pub(crate) event_stream: bool,
}

impl AnswerFields {
    pub(crate) fn of(headers: &HeaderMap) -> AnswerFields {
        let mut fields = AnswerFields { transfer: false, length: false, event_stream: false };
        let mut typed = false;
        for (name, value) in headers {
            if name == TRANSFER_ENCODING {
                fields.transfer = true;
            } else if name == CONTENT_LENGTH {
                fields.length = true;
            } else if name == CONTENT_TYPE && !typed {
                typed = true;
                fields.event_stream =
                    value.to_str().is_ok_and(|v| v.starts_with("text/event-stream"));
            }
        }
        fields
    }

    /// [`coded_transfer`].
    pub(crate) fn coded_transfer(&self, headers: &HeaderMap) -> bool {
        self.transfer && coded_transfer(headers)
    }

    /// [`ends_at_close`].
    pub(crate) fn ends_at_close(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        if self.transfer {
            return ends_at_close(status, headers);
        }
        !(status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
            || self.length)
    }

    /// Whether an answer must be read whole and checked before it is passed on: ended by the
    /// connection's close and no event stream (a stream is checked for its `[DONE]` as it is
    /// relayed, [`DoneScan`]).
    pub(crate) fn checked_whole(&self, answer: &Response<Incoming>) -> bool {
        self.ends_at_close(answer.status(), answer.headers()) && !self.event_stream
    }

    /// A generation's event stream, answered with success and framed by a Content-Length:
    /// read whole and checked for its end before anything is sent ([`Gateway::answer_whole`],
    /// up to 8 MiB), because once its length is passed on, a missing `[DONE]` (or terminal
    /// event) could not be told to the client.
    pub(crate) fn length_framed_events(
        &self,
        answer: &Response<Incoming>,
        relaying: &Relaying,
    ) -> bool {
        self.generation_framed(answer.status(), relaying.completion || relaying.responses)
    }

    /// Whether the answer's body is framed by its `Content-Length` (and not chunked).
    pub(crate) fn length_framed(&self) -> bool {
        self.length && !self.transfer
    }

    /// [`AnswerFields::length_framed_events`] of an answer with `status` to a `generation`
    /// (a completion's, a response's).
    fn generation_framed(&self, status: StatusCode, generation: bool) -> bool {
        self.event_stream && generation && status.is_success() && self.length && !self.transfer
    }
}

pub(crate) fn content_type(headers: &HeaderMap) -> &str {
    headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("")
}

pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    content_type(headers).starts_with("text/event-stream")
}

pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    let essence = content_type(headers).split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
}

/// The search for an event stream's `[DONE]` event, without which an engine's stream is not
/// whole.
pub(crate) enum DoneScan {
    /// The stream's end is its own (a length, or a chunked body's last chunk).
    Unneeded,
    /// Not seen yet.
    Looking(DoneEvent),
    /// A Responses stream: whole once its terminal event was seen.
    Events(responses::TerminalScan),
    Seen,
}

impl DoneScan {
    pub(crate) fn feed(&mut self, data: &[u8]) {
        self.read(data);
    }

    /// [`DoneScan::feed`], and for an event stream still looking for its `[DONE]`, what the
    /// frame's scan found ([`sse_scan::scan`], of the frame with its line ends made LF).
    pub(crate) fn read(&mut self, data: &[u8]) -> Option<sse_scan::Found> {
        if let DoneScan::Events(scan) = self {
            scan.feed(data);
            if scan.seen() {
                *self = DoneScan::Seen;
            }
            return None;
        }
        let DoneScan::Looking(event) = self else { return None };
        let (found, seen) = event.read(data);
        if seen {
            *self = DoneScan::Seen;
        }
        Some(found)
    }

    /// Whether the answer may end here.
    pub(crate) fn whole(&self) -> bool {
        !matches!(self, DoneScan::Looking(_) | DoneScan::Events(_))
    }

    /// Whether a Responses stream's terminal event has begun and not yet ended.
    pub(crate) fn ending(&self) -> bool {
        matches!(self, DoneScan::Events(scan) if scan.ending())
    }
}

/// An event stream's `[DONE]` event: a line that is the `data` field `[DONE]` (`data:
/// [DONE]`, or `data:[DONE]`: the space is optional in SSE), with any of the line ends SSE
/// allows, split between frames anywhere. The same bytes inside a token's text (a JSON string
/// on a `data: {` line) or a comment line (`: ...`) are not it.
pub(crate) struct DoneEvent {
    /// The last bytes so far (`tail_len` of them), line ends made LF (a newline at the
    /// stream's start: its first line starts one).
    tail: [u8; DONE_KEEP],
    tail_len: usize,
    line_ends: responses::LineEnds,
}

/// Bytes of an event stream a [`DoneEvent`] keeps: a `[DONE]` event's line but one byte.
const DONE_KEEP: usize = b"\ndata: [DONE]".len() - 1;

impl Default for DoneEvent {
    fn default() -> Self {
        let mut tail = [0; DONE_KEEP];
        tail[0] = b'\n';
        DoneEvent { tail, tail_len: 1, line_ends: responses::LineEnds::default() }
    }
}

impl DoneEvent {
    /// Reads the stream's next bytes: what their scan found ([`sse_scan::scan`], of `data`
    /// with its line ends made LF), and whether the event was seen (in them, or begun in the
    /// bytes before).
    fn read(&mut self, data: &[u8]) -> (sse_scan::Found, bool) {
        // The line ends made LF only where the scan found a CR (then the LF bytes are read
        // again): a stream of LF line ends is searched once.
        let data = self.line_ends.next(data);
        let mut found = sse_scan::scan(data);
        let lf;
        let data = if found.cr {
            lf = responses::crs_to_lf(data);
            found = sse_scan::scan(&lf);
            &lf[..]
        } else {
            data
        };
        if found.done_line {
            return (found, true);
        }
        if self.tail[..self.tail_len].last() == Some(&b'\n') && data.len() >= DONE_KEEP {
            // The usual case: the bytes before ended a line, so an event across the boundary
            // is that line end and `data`'s start (`\n` opens no other prefix of the event).
            if data.starts_with(b"data: [DONE]") || data.starts_with(b"data:[DONE]") {
                return (found, true);
            }
            self.tail.copy_from_slice(&data[data.len() - DONE_KEEP..]);
            self.tail_len = DONE_KEEP;
            return (found, false);
        }
        // The last bytes before `data` and its first ones: an event across the boundary (then
        // its `[` is among them).
        let head = &data[..data.len().min(DONE_KEEP)];
        let mut window = [0; 2 * DONE_KEEP];
        window[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
        window[self.tail_len..self.tail_len + head.len()].copy_from_slice(head);
        let window = &window[..self.tail_len + head.len()];
        if memchr::memchr(b'[', window).is_some()
            && (DONE_SPACED.find(window).is_some() || DONE_UNSPACED.find(window).is_some())
        {
            return (found, true);
        }
        let last = if data.len() >= DONE_KEEP {
            &data[data.len() - DONE_KEEP..]
        } else {
            &window[window.len().saturating_sub(DONE_KEEP)..]
        };
        self.tail[..last.len()].copy_from_slice(last);
        self.tail_len = last.len();
        (found, false)
    }
}

static DONE_SPACED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\ndata: [DONE]"));

static DONE_UNSPACED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\ndata:[DONE]"));

/// Output tokens of an answer, for flow control's fairness and the key's token bucket: SSE
/// data events (one token each, `[DONE]` not counted) or a JSON answer's
/// `"completion_tokens"`.
#[derive(Default)]
pub(crate) struct TokenCount {
    pub(crate) events: u64,
    pub(crate) usage: Option<u64>,
    /// A Responses API answer: `*.delta` events, or a JSON answer's `usage.output_tokens`.
    pub(crate) responses: bool,
}

impl TokenCount {
    pub(crate) fn feed(&mut self, data: &[u8], sse: bool) {
        if self.responses {
            if sse {
                self.events += responses::output_deltas(data);
            } else if let Some(n) = responses::usage_output_tokens(data) {
                self.usage = Some(n);
            }
            return;
        }
        if sse {
            self.add(&sse_scan::scan(data));
        } else if let Some(n) = COMPLETION_TOKENS
            .find(data)
            .and_then(|at| sse_scan::count(&data[at + COMPLETION_TOKENS.needle().len()..]))
        {
            self.usage = Some(n);
        }
    }

    /// A frame of a Completions or Chat Completions event stream, as its scan found it.
    pub(crate) fn add(&mut self, found: &sse_scan::Found) {
        self.events += found.events;
        if let Some(n) = found.usage {
            self.usage = Some(n);
        }
    }

    /// A usage count above [`MAX_USAGE_TOKENS`] is the engine's error and counts as none, as
    /// on the Python plane: flow control and the key's bucket are not charged for it.
    pub(crate) fn tokens(&self) -> u64 {
        match self.usage {
            Some(n) if n > MAX_USAGE_TOKENS => 0,
            Some(n) => n,
            None => self.events,
        }
    }
}

/// The most output tokens an answer's usage block is believed for (no answer is longer).
const MAX_USAGE_TOKENS: u64 = u32::MAX as u64;

/// The searcher [`TokenCount::feed`] uses for a JSON answer, built once (building one costs
/// more than a search of a short answer).
static COMPLETION_TOKENS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"completion_tokens\":"));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request_fields::tests::head_of;

    #[test]
    fn a_done_split_anywhere_between_frames_is_seen_and_none_is_not_whole() {
        let stream = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        // Two frames, split at every byte; and one byte a frame.
        for at in 0..=stream.len() {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            scan.feed(&stream[..at]);
            scan.feed(&stream[at..]);
            assert!(scan.whole(), "split at {at}");
        }
        let mut scan = DoneScan::Looking(DoneEvent::default());
        for byte in stream {
            scan.feed(std::slice::from_ref(byte));
        }
        assert!(scan.whole());
        // Without it (cut inside it too), the stream is not whole.
        for end in [0, 20, stream.len() - 4] {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            for byte in &stream[..end] {
                scan.feed(std::slice::from_ref(byte));
            }
            assert!(!scan.whole(), "cut at {end}");
        }
        assert!(DoneScan::Unneeded.whole());
    }

    /// Whether `stream`, fed split at every byte and one byte a frame, shows its `[DONE]`
    /// event (the same answer each way).
    fn shows_done(stream: &[u8]) -> bool {
        let whole = |frames: &[&[u8]]| {
            let mut scan = DoneScan::Looking(DoneEvent::default());
            for frame in frames {
                scan.feed(frame);
            }
            scan.whole()
        };
        let seen = whole(&[stream]);
        for at in 0..=stream.len() {
            assert_eq!(whole(&[&stream[..at], &stream[at..]]), seen, "split at {at}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(whole(&bytes), seen, "a byte a frame");
        seen
    }

    #[test]
    fn only_a_done_line_ends_a_stream() {
        // The event, with or without the field's space, with every line end SSE allows.
        for stream in [
            &b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"[..],
            b"data: {\"choices\":[]}\n\ndata:[DONE]\n\n",
            b"data: {\"choices\":[]}\r\n\r\ndata: [DONE]\r\n\r\n",
            b"data: {\"choices\":[]}\r\rdata:[DONE]\r\r",
            b"data: [DONE]\n\n",
        ] {
            assert!(shows_done(stream), "{}", String::from_utf8_lossy(stream));
        }
        // The same bytes in a token's text or a comment line, or not starting a line: cut.
        for stream in [
            &b"data: {\"text\":\"data: [DONE]\"}\n\n"[..],
            b": data: [DONE]\n\n",
            b"data: {\"choices\":[]}\n\n: data:[DONE]\r\n",
            b"event: x data: [DONE]\n\n",
            b"data: [DON",
        ] {
            assert!(!shows_done(stream), "{}", String::from_utf8_lossy(stream));
        }
    }

    #[test]
    fn a_responses_stream_is_whole_at_its_terminal_event_and_counts_its_deltas() {
        let stream = b"event: response.created\ndata: {}\n\nevent: response.output_text.delta\n\
            data: {}\n\nevent: response.completed\ndata: {}\n\n";
        let mut done = DoneScan::Events(responses::TerminalScan::default());
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        // Whole only once the blank line closing the terminal event came (the last byte);
        // ending from its line's end on.
        let line_end = memchr::memmem::find(stream, b"event: response.completed").unwrap_or(0) + 26;
        for (i, chunk) in stream.chunks(7).enumerate() {
            assert!(!done.whole(), "chunk {i}");
            done.feed(chunk);
            tokens.feed(chunk, true);
            assert_eq!(done.ending(), !done.whole() && i * 7 + 7 >= line_end, "chunk {i}");
        }
        assert!(done.whole());
        // Cut inside the terminal event's data, split anywhere: not whole.
        let cut = &stream[..stream.len() - 3];
        for at in 0..=cut.len() {
            let mut done = DoneScan::Events(responses::TerminalScan::default());
            done.feed(&cut[..at]);
            done.feed(&cut[at..]);
            assert!(!done.whole(), "split at {at}");
        }
        // A split `.delta\ndata: ` is not counted (as a split `data: ` is not for chat).
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        tokens.feed(stream, true);
        assert_eq!(tokens.tokens(), 1);
        let mut tokens = TokenCount { responses: true, ..TokenCount::default() };
        tokens.feed(br#"{"usage":{"output_tokens":9,"completion_tokens":3}}"#, false);
        assert_eq!(tokens.tokens(), 9);
    }

    #[test]
    fn a_usage_count_no_answer_can_hold_counts_as_none() {
        // Probe 49 F14: an engine's 2^63 reached flow control and wrapped the tenant's service.
        for (usage, expected) in
            [("7", 7), ("4294967295", 4_294_967_295), ("4294967296", 0), ("9223372036854775808", 0)]
        {
            let mut tokens = TokenCount::default();
            tokens
                .feed(format!(r#"{{"usage":{{"completion_tokens":{usage}}}}}"#).as_bytes(), false);
            assert_eq!(tokens.tokens(), expected, "{usage}");
        }
    }

    proptest::proptest! {
        /// One pass over an answer's fields reads its framing and type as the lookups did.
        #[test]
        fn the_answer_fields_read_as_the_lookups_did(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..8),
            status in proptest::sample::select(vec![100u16, 101, 200, 204, 206, 304, 404, 500]),
        ) {
            let headers = head_of(&fields);
            let status = StatusCode::from_u16(status).unwrap();
            let read = AnswerFields::of(&headers);
            proptest::prop_assert_eq!(read.event_stream, is_event_stream(&headers));
            proptest::prop_assert_eq!(read.coded_transfer(&headers), coded_transfer(&headers));
            let at_close = ends_at_close(status, &headers);
            proptest::prop_assert_eq!(read.ends_at_close(status, &headers), at_close);
            // As `checked_whole` and `length_framed_events` read an answer before.
            proptest::prop_assert_eq!(
                read.ends_at_close(status, &headers) && !read.event_stream,
                at_close && !is_event_stream(&headers)
            );
            for generation in [false, true] {
                let before = is_event_stream(&headers)
                    && generation
                    && status.is_success()
                    && headers.contains_key(CONTENT_LENGTH)
                    && !headers.contains_key(TRANSFER_ENCODING);
                proptest::prop_assert_eq!(read.generation_framed(status, generation), before);
            }
        }
    }
}
