//! The answer relay: an engine's answer passed to the client frame by frame ([`Relay`]), with
//! the read timeout and the deadline, an SSE stream's last events held to go out with the
//! body's end, a cut answer ended so that it never passes as whole, and the ticket finished
//! at the end.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::{Response, StatusCode};
use llmsched_core::routing::Ticket;

use crate::admission::Guards;
use crate::answer::{Answer, AnswerBody};
use crate::answer_scan::{is_event_stream, DoneEvent, DoneScan, OwnerScan, TokenCount};
use crate::framing::{ends_at_close, framed};
use crate::metrics::Counters;
use crate::probes::Charge;
use crate::refusal::{CUT_EVENT, DEADLINE_EVENT};
use crate::{monotonic, pool, responses, slicing, sse_scan, Gateway, Upstream};

/// How an upstream answer is relayed.
pub(crate) struct Relaying {
    pub(crate) route: Option<&'static str>,
    pub(crate) ticket: Option<Ticket>,
    /// The upstream connection, released when the answer has been read to its end.
    pub(crate) lease: Option<pool::Lease>,
    pub(crate) guards: Option<Guards>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) endpoint: Option<Arc<str>>,
    pub(crate) completion: bool,
    pub(crate) sse: bool,
    pub(crate) read_timeout: Option<Duration>,
    pub(crate) deadline: Option<tokio::time::Instant>,
    /// A Responses API answer: its stream ends with a terminal event (no `[DONE]`), its
    /// output tokens are its `*.delta` events or `usage.output_tokens`.
    pub(crate) responses: bool,
    /// Where a Responses stream's id is recorded (a 2xx answer to `POST /v1/responses`).
    pub(crate) id_scan: Option<OwnerScan>,
    /// Where a cut is charged (a generation's answer, whose attempt counted as a success).
    pub(crate) charge: Option<Charge>,
}

impl Relaying {
    pub(crate) fn plain(counters: Arc<Counters>) -> Relaying {
        Relaying {
            route: None,
            ticket: None,
            lease: None,
            guards: None,
            counters,
            endpoint: None,
            completion: false,
            sse: false,
            read_timeout: None,
            deadline: None,
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    pub(crate) fn completion(
        gateway: &Gateway,
        upstream: &Upstream,
        sse: bool,
        deadline: f64,
    ) -> Relaying {
        let left = Duration::from_secs_f64((deadline - monotonic()).clamp(0.0, 1e9));
        Relaying {
            route: None,
            ticket: None,
            lease: None,
            guards: None,
            counters: gateway.counters.clone(),
            endpoint: Some(upstream.label.clone()),
            completion: true,
            sse,
            read_timeout: gateway.config.read_timeout_s.map(Duration::from_secs_f64),
            deadline: gateway.config.total_timeout_s.map(|_| tokio::time::Instant::now() + left),
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    /// Whether the request's deadline has passed (what ended a wait that timed out, when it
    /// did).
    pub(crate) fn deadline_passed(&self) -> bool {
        self.deadline.is_some_and(|deadline| tokio::time::Instant::now() >= deadline)
    }
}

pub(crate) fn relay(answer: Response<Incoming>, relaying: Relaying) -> Answer {
    let (parts, body) = answer.into_parts();
    relay_parts(parts, body, None, relaying)
}

/// [`relay`] of an answer's head and body, `first` the body's frame already read from it.
pub(crate) fn relay_parts(
    parts: hyper::http::response::Parts,
    body: Incoming,
    first: Option<Frame<Bytes>>,
    relaying: Relaying,
) -> Answer {
    let event_stream = is_event_stream(&parts.headers);
    let sse = relaying.sse || event_stream;
    // An engine's event stream is whole only with its `[DONE]` (vLLM and SGLang end every
    // stream so, an error event included): a stream ended by the connection's close, or one
    // that ends cleanly without it, is cut.
    // A Responses stream's end is its terminal event ([`responses::TerminalScan`]).
    let done = if event_stream
        && ((relaying.completion || relaying.responses) && parts.status.is_success()
            || ends_at_close(parts.status, &parts.headers))
    {
        if relaying.responses {
            DoneScan::Events(responses::TerminalScan::default())
        } else {
            DoneScan::Looking(DoneEvent::default())
        }
    } else {
        DoneScan::Unneeded
    };
    // Framed by Transfer-Encoding, a Content-Length beside it is wrong (RFC 9112 6.3: an
    // intermediary removes it), and passed on it would cut the answer short.
    let chunked = parts.headers.contains_key(TRANSFER_ENCODING);
    let now = tokio::time::Instant::now();
    let timer = match (relaying.read_timeout, relaying.deadline) {
        (None, None) => None,
        _ => Some(Box::pin(tokio::time::sleep_until(due(
            relaying.read_timeout,
            relaying.deadline,
            now,
        )))),
    };
    // The frame read ahead is the latest read's, unless that read had the head too.
    let share = match relaying.lease.as_ref().and_then(pool::Lease::reads) {
        Some((meter, head_read)) if meter.last_read().0 != head_read => {
            let mut share = ReadShare::UNKNOWN;
            if let Some(data) = first.as_ref().and_then(Frame::data_ref) {
                share.handed_over(meter.last_read(), data.len(), chunked);
            }
            share
        }
        _ => ReadShare::UNKNOWN,
    };
    let mut out = Response::new(AnswerBody::Relayed(Box::new(Relay {
        route: relaying.route,
        status: parts.status,
        inner: Some(body),
        first_frame: first,
        lease: relaying.lease,
        ticket: relaying.ticket,
        guards: relaying.guards,
        counters: Some(relaying.counters),
        endpoint: relaying.endpoint,
        first: true,
        completion: relaying.completion,
        sse,
        timer,
        timer_waker: None,
        last_frame: now,
        read_timeout: relaying.read_timeout,
        deadline: relaying.deadline,
        broken: false,
        tokens: TokenCount { responses: relaying.responses, ..TokenCount::default() },
        sliced: None,
        held: None,
        after_held: None,
        done,
        tail: *b"\n\n",
        share,
        chunked,
        length_framed: !chunked && parts.headers.contains_key(CONTENT_LENGTH),
        responses: relaying.responses,
        id_scan: relaying.id_scan.filter(|_| event_stream),
        charge: relaying.charge,
    })));
    *out.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        // The length frames the body as relayed, unless the engine chunked it.
        let framing = !chunked && name == CONTENT_LENGTH;
        if framing || PASSED_HEADERS.contains(name) {
            out.headers_mut().append(HeaderName::clone(name), value.clone());
        }
    }
    out
}

/// The engine's answer headers a client gets, as on the Python plane: its body's type, coding
/// and caching. The others are the engine's hop's (its `Connection` and the fields that names,
/// RFC 9110 7.6.1), its own (`Server`, `Set-Cookie`), or would pass for the gateway's (an
/// engine's `x-llmsched-*`).
pub(crate) const PASSED_HEADERS: [HeaderName; 3] =
    [CONTENT_TYPE, hyper::header::CONTENT_ENCODING, hyper::header::CACHE_CONTROL];

pub(crate) fn wake_at(
    read: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
) -> tokio::time::Instant {
    due(read, deadline, tokio::time::Instant::now())
}

/// When an answer silent since `since` is cut: a read timeout after it, or the deadline.
pub(crate) fn due(
    read: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    since: tokio::time::Instant,
) -> tokio::time::Instant {
    let by_read = since + read.unwrap_or(Duration::from_secs(86_400 * 365));
    deadline.map(|d| d.min(by_read)).unwrap_or(by_read)
}

/// Turns of the runtime a held stream tail waits at most ([`Relay::hold`]): hyper's client
/// hands a frame over in two (measured), for the last token, a usage event, `[DONE]` and the
/// body's end.
const HOLD_YIELDS: u8 = 8;

/// Bytes of a held stream tail at most.
const HOLD_BYTES: usize = 64 << 10;

/// Bytes of room a held frame gets beyond twice its own size ([`Relay::hold`]): a usage event
/// and `[DONE]`.
const HELD_ROOM: usize = 512;

/// Turns of the runtime SSE bytes from the middle of a stream are held while nothing more
/// comes ([`Relay::hold`]): hyper's client hands over a frame it has already read within two
/// (measured: with one, no fewer writes than without holding). Only while hyper holds more of
/// what it read from the engine than it has handed over ([`ReadShare`]).
const GATHER_YIELDS: u8 = 2;

/// What a relay has been handed of its engine connection's last read ([`pool::ReadMeter`]):
/// hyper reads the socket again only once it has handed over all of the last read, so while
/// the frames of a read (counted with their chunked framing) fall short of its bytes, hyper
/// holds more for the relay's next turns, and gathering can wait for it. When the engine's
/// events each come in a read of their own there is nothing to gather, and a frame goes out
/// at once.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ReadShare {
    /// The read (its number) the last frame came from.
    read: u64,
    /// Bytes of that read handed over, framing included.
    used: usize,
    /// Whether `used` counts all of the read: not for the read that had the answer's head.
    known: bool,
}

impl ReadShare {
    /// Nothing known: every read may hold more (gathering as without a meter).
    const UNKNOWN: ReadShare = ReadShare { read: u64::MAX, used: 0, known: false };

    /// A body frame of `len` bytes handed over, `reads` the connection's reads now.
    fn handed_over(&mut self, reads: (u64, usize), len: usize, chunked: bool) {
        if reads.0 != self.read {
            *self = ReadShare { read: reads.0, used: 0, known: true };
        }
        self.used = self.used.saturating_add(framed(len, chunked));
    }

    /// Whether hyper holds more of what it read than it has handed over, `reads` the
    /// connection's reads now (a read since the last frame: all of it).
    fn more(&self, reads: (u64, usize)) -> bool {
        reads.0 != self.read || !self.known || reads.1 > self.used
    }
}

/// SSE bytes held back ([`Relay::hold`]).
struct Held {
    data: bytes::BytesMut,
    /// Turns waited: in all for a tail, since the last frame came while gathering.
    yields: u8,
    /// Whether the stream's end is near (its last token, `[DONE]`, a Responses stream's
    /// terminal event): held for up to [`HOLD_YIELDS`] turns in all, else
    /// [`GATHER_YIELDS`] turns without a new frame.
    tail: bool,
}

/// An answer passed on frame by frame (an SSE stream's tail, from its last token on, in one
/// write with the body's end: `Relay::hold`), with the router's ticket: the first frame
/// marks the first token, the end finishes it; dropped before the end (the client left), it counts a
/// disconnect and drops the upstream body, which closes that connection.
pub struct Relay {
    route: Option<&'static str>,
    status: StatusCode,
    inner: Option<Incoming>,
    /// A frame of `inner` read before the answer's head went out, passed on first.
    first_frame: Option<Frame<Bytes>>,
    /// The upstream connection of `inner`: back to its pool after a complete answer, closed
    /// otherwise.
    lease: Option<pool::Lease>,
    ticket: Option<Ticket>,
    guards: Option<Guards>,
    counters: Option<Arc<Counters>>,
    endpoint: Option<Arc<str>>,
    first: bool,
    completion: bool,
    sse: bool,
    /// Fires no earlier than the read timeout after `last_frame` (or at the deadline): set
    /// once, and moved on only when it fires, rather than reset at every frame.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The waker `timer` was last polled with, its poll having registered it: until the timer
    /// fires, it wakes that task, and a poll with the same waker would only say it has not
    /// fired ([`tokio::time::Sleep::is_elapsed`] says so without one).
    timer_waker: Option<std::task::Waker>,
    last_frame: tokio::time::Instant,
    read_timeout: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    broken: bool,
    tokens: TokenCount,
    /// A sliced request's stream ([`slicing`]), which makes the whole body.
    pub(crate) sliced: Option<Box<slicing::SliceStream>>,
    /// SSE bytes held back for what the engine sent with them (see [`Relay::hold`]).
    held: Option<Held>,
    /// A frame that came after a held tail and goes out after it.
    after_held: Option<Frame<Bytes>>,
    /// Whether the stream must show its `[DONE]` before it may end ([`DoneScan`]).
    done: DoneScan,
    /// The last two bytes relayed (`"\n\n"` ends an SSE event): an error event after a cut
    /// starts on its own rather than inside a half-sent one.
    tail: [u8; 2],
    /// What the relay has been handed of the engine connection's last read.
    share: ReadShare,
    /// Whether the engine's body is chunked (its frames' framing, for `share`).
    chunked: bool,
    /// Whether the client's body is framed by the engine's `Content-Length`: a cut then gets
    /// no error event, which would fill the length the client reads and pass for the answer's
    /// end; it is cut short (the connection closed), and the client sees the missing bytes.
    length_framed: bool,
    /// A Responses API answer (see [`Relaying`]'s field).
    responses: bool,
    /// Where a Responses stream's id is recorded, until it is found.
    id_scan: Option<OwnerScan>,
    /// Where a cut is charged (see [`Relaying`]'s field).
    charge: Option<Charge>,
}

/// The error that cuts a client's answer (hyper then closes the connection mid-body).
#[derive(Debug)]
pub struct Cut(pub(crate) &'static str);

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Cut {}

impl Relay {
    /// A relay with nothing to relay yet (for a sliced request's stream, `sliced`).
    pub(crate) fn idle(status: StatusCode) -> Relay {
        Relay {
            route: None,
            status,
            inner: None,
            first_frame: None,
            lease: None,
            ticket: None,
            guards: None,
            counters: None,
            endpoint: None,
            first: false,
            completion: false,
            sse: false,
            timer: None,
            timer_waker: None,
            last_frame: tokio::time::Instant::now(),
            read_timeout: None,
            deadline: None,
            broken: false,
            tokens: TokenCount::default(),
            sliced: None,
            held: None,
            after_held: None,
            done: DoneScan::Unneeded,
            tail: *b"\n\n",
            share: ReadShare::UNKNOWN,
            chunked: false,
            length_framed: false,
            responses: false,
            id_scan: None,
            charge: None,
        }
    }

    fn ended(&mut self, completed: bool) {
        self.inner = None;
        self.timer = None;
        if let Some(charge) = self.charge.take().filter(|_| completed) {
            charge.whole();
        }
        match self.lease.take() {
            Some(lease) if completed => lease.release(),
            _ => {}
        }
        if let Some(mut ticket) = self.ticket.take() {
            ticket.finish();
        }
        if let Some(mut guards) = self.guards.take() {
            guards.output_tokens(self.tokens.tokens());
        }
        if let Some(counters) = self.counters.take() {
            if self.completion && completed {
                counters.completed.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(route) = self.route.filter(|_| completed) {
                counters.requests.inc(&[route, self.status.as_str()]);
            }
        }
    }

    /// A frame from the engine: the first token, the output tokens, the read timeout's clock.
    /// Whether a Completions or Chat Completions event stream ends in it or nearly (it holds
    /// `data: [DONE]`, or an event with a string `finish_reason`, the last token's: a usage
    /// event and `[DONE]` follow at once; for [`Relay::ends_near`]). Such a stream's frame is
    /// scanned once for all of it ([`sse_scan::scan`]).
    fn received(&mut self, frame: &Frame<Bytes>) -> bool {
        let mut soon = false;
        if let Some(data) = frame.data_ref() {
            if self.first {
                self.first = false;
                if let Some(ticket) = self.ticket.as_mut() {
                    ticket.first_token();
                }
            }
            if self.sse && !self.responses {
                let found = self.done.read(data).unwrap_or_else(|| sse_scan::scan(data));
                if self.completion {
                    self.tokens.add(&found);
                }
                soon = found.ends_soon();
            } else {
                if self.completion {
                    self.tokens.feed(data, self.sse);
                }
                self.done.feed(data);
            }
            if let Some(scan) = self.id_scan.as_mut() {
                scan.feed(data);
            }
            self.tail = match data[..] {
                [] => self.tail,
                [only] => [self.tail[1], only],
                [.., a, b] => [a, b],
            };
        }
        if self.timer.is_some() {
            self.last_frame = tokio::time::Instant::now();
        }
        soon
    }

    /// A body frame came from the engine: counted against the connection's last read.
    fn handed_over(&mut self, frame: &Frame<Bytes>) {
        let (Some(data), Some((meter, _))) =
            (frame.data_ref(), self.lease.as_ref().and_then(pool::Lease::reads))
        else {
            return;
        };
        self.share.handed_over(meter.last_read(), data.len(), self.chunked);
    }

    /// Whether hyper holds more of what it read from the engine than it has handed over
    /// ([`ReadShare`]); true where that cannot be told (no connection of the pool).
    fn more_read(&self) -> bool {
        match self.lease.as_ref().and_then(pool::Lease::reads) {
            Some((meter, _)) => self.share.more(meter.last_read()),
            None => true,
        }
    }

    /// Holds `data`, SSE bytes read from the engine, for a turn of the runtime or a few
    /// ([`Held`]): hyper's client hands over what it has read a frame (an HTTP chunk) at a
    /// time, one frame per turn of its connection's task, so events read together (the
    /// engine's last token, `[DONE]` and the chunked body's end; or events that queued up
    /// while the gateway's thread was busy) would each cost a write to the client and a
    /// wake-up of it. What arrives meanwhile joins `data` and goes out in one write (with the
    /// body's end when that came). Never waits for the network: the turns are the thread's
    /// own, and then what is held goes out.
    fn hold(
        &mut self,
        mut held: Held,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let limit = if held.tail { HOLD_YIELDS } else { GATHER_YIELDS };
        // Gathering ends as soon as hyper has handed over all it read: what follows is the
        // network's.
        let gathered = !held.tail && !self.more_read();
        if held.yields >= limit || held.data.len() >= HOLD_BYTES || gathered {
            return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
        }
        held.yields += 1;
        self.held = Some(held);
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Whether an SSE frame ends its stream or nearly (then what follows is held longer:
    /// [`Held::tail`]); `terminal` for a Responses stream, whose terminal event may be split
    /// between frames. `soon`: whether a Completions or Chat Completions stream ends in it or
    /// nearly ([`Relay::received`]).
    fn ends_near(&self, data: &[u8], terminal: bool, soon: bool) -> bool {
        if self.responses {
            terminal || responses::ends_here(data)
        } else {
            soon
        }
    }

    /// The next poll of the engine's body while bytes are held ([`Relay::hold`]).
    fn held_frame(
        &mut self,
        polled: Poll<Option<Result<Frame<Bytes>, hyper::Error>>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let Some(mut held) = self.held.take() else { return Poll::Pending };
        match polled {
            // Nothing yet: hyper's connection task may not have handed over what it has
            // read; a few more turns, then it goes out (the engine's body has registered
            // this task's waker for what comes later).
            Poll::Pending => self.hold(held, cx),
            Poll::Ready(None) if !self.done.whole() => {
                self.held = Some(held);
                self.cut()
            }
            Poll::Ready(None) => {
                // `is_end_stream` is now true: hyper writes the held data and the end of
                // the chunked body in one write.
                self.ended(true);
                Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))))
            }
            Poll::Ready(Some(Err(_))) => {
                self.held = Some(held);
                self.cut()
            }
            Poll::Ready(Some(Ok(frame))) => {
                let (was_whole, was_ending) = (self.done.whole(), self.done.ending());
                let soon = self.received(&frame);
                let Some(data) = frame.data_ref() else {
                    // Trailers: they follow what is held.
                    self.after_held = Some(frame);
                    return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
                };
                held.data.extend_from_slice(data);
                if self.done.whole() && self.inner.as_ref().is_some_and(Body::is_end_stream) {
                    self.ended(true);
                    return Poll::Ready(Some(Ok(Frame::data(held.data.freeze()))));
                }
                if !held.tail {
                    // Gathering: more came, so more may be waiting; from the stream's end
                    // on, the tail's longer hold.
                    let terminal =
                        was_ending || self.done.ending() || was_whole != self.done.whole();
                    held.tail = self.ends_near(data, terminal, soon);
                    held.yields = 0;
                }
                self.hold(held, cx)
            }
        }
    }

    /// The answer broke off upstream (an error or a timeout): counted, and the client sees a
    /// break, never a complete answer.
    fn cut(&mut self) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        self.broken = true;
        let endpoint = self.endpoint.clone().unwrap_or_else(|| Arc::from(""));
        // An error event goes only where the gateway frames the body (chunked, or ended by
        // the close): inside the engine's length it would pass for the answer's last bytes.
        let sse = self.sse && !self.length_framed;
        // Against the engine, unless the request's own deadline ended the answer.
        let deadline_passed = self.deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
        if let Some(charge) = self.charge.take().filter(|_| !deadline_passed) {
            charge.reports.report(charge.upstream);
        }
        if let Some(counters) = &self.counters {
            if let Some(route) = self.route {
                counters.requests.inc(&[route, "aborted"]);
            }
            if self.completion || self.responses {
                if deadline_passed {
                    // The gateway's own deadline, not the engine's failure (as before the
                    // answer's head: the request's timeout).
                    counters.rejections.inc(&["timeout"]);
                } else {
                    counters.upstream_errors.inc(&[&endpoint, "truncated"]);
                }
                counters.truncated.inc(&[&endpoint, if sse { "sse_error" } else { "reset" }]);
            }
        }
        self.ended(false);
        // `first` now marks whether the error event went out (see `poll_frame`).
        self.first = false;
        if sse {
            // A blank line first where the stream broke off inside an event: the error event
            // must parse on its own, not run on from the half-sent one.
            let gap = if self.tail == *b"\n\n" { "" } else { "\n\n" };
            let event = match (self.responses, deadline_passed) {
                (true, false) => responses::CUT_EVENT,
                (true, true) => responses::DEADLINE_EVENT,
                (false, false) => CUT_EVENT,
                (false, true) => DEADLINE_EVENT,
            };
            let text = format!("{gap}{event}");
            // Complete events held back go out first, with the error event.
            let mut out = self.held.take().map(|held| held.data).unwrap_or_default();
            out.extend_from_slice(text.as_bytes());
            return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
        }
        Poll::Ready(Some(Err(Cut("the engine's answer was cut off"))))
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        let this = self.get_mut();
        if let Some(stream) = this.sliced.as_mut() {
            return stream.poll_frame(cx);
        }
        if let Some(frame) = this.after_held.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if this.broken {
            // After an SSE error event: once it has been flushed (one Pending lets hyper
            // write it out), close without the last chunk.
            if !this.first {
                this.first = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.broken = false;
            return Poll::Ready(Some(Err(Cut("the engine's answer was cut off"))));
        }
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        // The frame read before the answer's head goes out with the head, not gathered.
        let (polled, gather) = match this.first_frame.take() {
            Some(frame) => (Poll::Ready(Some(Ok(frame))), false),
            None => {
                let polled = Pin::new(inner).poll_frame(cx);
                if let Poll::Ready(Some(Ok(frame))) = &polled {
                    this.handed_over(frame);
                }
                (polled, true)
            }
        };
        if this.held.is_some() {
            return this.held_frame(polled, cx);
        }
        match polled {
            Poll::Pending => {
                if let Some(timer) = this.timer.as_mut() {
                    // Registered with this task's waker and not fired: a poll (once a frame)
                    // would only register the same waker again.
                    let waker = cx.waker();
                    if this.timer_waker.as_ref().is_some_and(|w| w.will_wake(waker))
                        && !timer.is_elapsed()
                    {
                        return Poll::Pending;
                    }
                    while timer.as_mut().poll(cx).is_ready() {
                        let due = due(this.read_timeout, this.deadline, this.last_frame);
                        if due <= tokio::time::Instant::now() {
                            return this.cut();
                        }
                        // A frame came since it was set: silent for less than the timeout.
                        timer.as_mut().reset(due);
                    }
                    // Its last poll registered the waker unless the task's budget was spent
                    // (a pending poll gives back what it took; a spent one yields instead).
                    this.timer_waker = tokio::task::coop::has_budget_remaining()
                        .then(|| this.timer_waker.take().filter(|w| w.will_wake(waker)))
                        .map(|kept| kept.unwrap_or_else(|| waker.clone()));
                }
                Poll::Pending
            }
            Poll::Ready(None) if !this.done.whole() => this.cut(),
            Poll::Ready(None) => {
                this.ended(true);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(_))) => this.cut(),
            Poll::Ready(Some(Ok(frame))) => {
                // A Responses stream ends near its terminal event: a frame holding its line,
                // or any part of it (split between frames), is held with what follows.
                let (was_whole, was_ending) = (this.done.whole(), this.done.ending());
                let soon = this.received(&frame);
                let terminal = was_ending || this.done.ending() || was_whole != this.done.whole();
                if this.done.whole() && this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.ended(true);
                } else if let Some(data) = frame.data_ref().filter(|_| this.sse) {
                    let tail = this.ends_near(data, terminal, soon);
                    if tail || (gather && this.more_read()) {
                        // Room for what usually joins it (a stream's tail: its usage event
                        // and `[DONE]`), so that the first join does not move it.
                        let mut held = bytes::BytesMut::with_capacity(data.len() * 2 + HELD_ROOM);
                        held.extend_from_slice(data);
                        return this.hold(Held { data: held, yields: 0, tail }, cx);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if let Some(stream) = &self.sliced {
            return stream.is_end_stream();
        }
        match &self.inner {
            Some(inner) => self.first_frame.is_none() && inner.is_end_stream() && self.done.whole(),
            None => !self.broken,
        }
    }

    fn size_hint(&self) -> SizeHint {
        if self.sliced.is_some() {
            return SizeHint::default();
        }
        match &self.inner {
            Some(inner) => {
                // The frame read ahead is still to come.
                let ahead =
                    self.first_frame.as_ref().and_then(Frame::data_ref).map_or(0, |d| d.len());
                let inner = inner.size_hint();
                let mut hint = SizeHint::new();
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + ahead as u64);
                }
                hint.set_lower(inner.lower() + ahead as u64);
                hint
            }
            None => SizeHint::with_exact(0),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.inner.is_some() {
            if let Some(counters) = &self.counters {
                if self.completion {
                    counters.disconnects.fetch_add(1, Ordering::Relaxed);
                }
                // The client left mid-answer, as the Python plane counts it.
                if let Some(route) = self.route {
                    counters.requests.inc(&[route, "client_gone"]);
                }
            }
            self.ended(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer_scan::shows_its_end;

    #[test]
    fn more_is_held_until_the_read_is_handed_over() {
        let event = 90; // one event's chunk data
        let read = 3 * framed(event, true) + framed(0, true);
        let mut share = ReadShare::UNKNOWN;
        assert!(share.more((0, 0)), "nothing known: gather");
        share.handed_over((7, read), event, true);
        assert!(share.more((7, read)), "two events and the end still in hyper's buffer");
        share.handed_over((7, read), event, true);
        share.handed_over((7, read), event, true);
        assert!(share.more((7, read)), "the body's end still to come");
        // A read of one event alone: nothing more once it is handed over.
        share.handed_over((8, framed(event, true)), event, true);
        assert!(!share.more((8, framed(event, true))));
        // hyper read again since: that read is not handed over yet.
        assert!(share.more((9, framed(event, true))));
        // Unchunked bodies count their bytes alone.
        share.handed_over((10, 2 * event), event, false);
        assert!(share.more((10, 2 * event)));
        share.handed_over((10, 2 * event), event, false);
        assert!(!share.more((10, 2 * event)));
    }

    /// The relay's scans of an SSE frame before [`sse_scan`] (one search of the frame for
    /// each needle), kept as they were to check the one pass against.
    mod before_one_pass {
        use super::responses;

        fn finder(needle: &'static [u8]) -> memchr::memmem::Finder<'static> {
            memchr::memmem::Finder::new(needle)
        }

        /// `TokenCount::feed` of a Completions or Chat Completions answer: `(events, usage)`.
        pub fn token_feed(count: &mut (u64, Option<u64>), data: &[u8], sse: bool) {
            if sse {
                let mut rest = data;
                while let Some(at) = finder(b"data: ").find(rest) {
                    rest = &rest[at + 6..];
                    if !rest.starts_with(b"[DONE]") {
                        count.0 += 1;
                    }
                }
            }
            if let Some(at) = finder(b"\"completion_tokens\":").find(data) {
                let rest = &data[at + 20..];
                let start = rest.iter().take_while(|b| **b == b' ').count();
                let digits = rest[start..].iter().take_while(|b| b.is_ascii_digit()).count();
                if let Ok(n) =
                    std::str::from_utf8(&rest[start..start + digits]).unwrap_or("").parse()
                {
                    count.1 = Some(n);
                }
            }
        }

        pub fn has_done_word(data: &[u8]) -> bool {
            finder(b"[DONE]").find(data).is_some()
        }

        pub struct DoneEvent {
            tail: Vec<u8>,
            line_ends: responses::LineEnds,
        }

        impl Default for DoneEvent {
            fn default() -> Self {
                DoneEvent { tail: b"\n".to_vec(), line_ends: responses::LineEnds::default() }
            }
        }

        impl DoneEvent {
            pub fn feed(&mut self, data: &[u8], word: bool) -> bool {
                let data = self.line_ends.to_lf(data);
                let (spaced, unspaced) = (finder(b"\ndata: [DONE]"), finder(b"\ndata:[DONE]"));
                let keep = spaced.needle().len() - 1;
                self.tail.extend_from_slice(&data[..data.len().min(keep)]);
                let found =
                    |bytes: &[u8]| spaced.find(bytes).is_some() || unspaced.find(bytes).is_some();
                let across = memchr::memchr(b'[', &self.tail).is_some() && found(&self.tail);
                if across || word && found(&data[..]) {
                    return true;
                }
                if data.len() >= keep {
                    self.tail.clear();
                    self.tail.extend_from_slice(&data[data.len() - keep..]);
                } else {
                    let old = self.tail.len().saturating_sub(keep);
                    self.tail.drain(..old);
                }
                false
            }
        }

        pub fn ends_soon(data: &[u8], word: bool) -> bool {
            if word && finder(b"data: [DONE]").find(data).is_some() {
                return true;
            }
            let needle = finder(b"\"finish_reason\":");
            let mut rest = data;
            while let Some(at) = needle.find(rest) {
                rest = &rest[at + needle.needle().len()..];
                let value = rest.iter().position(|b| *b != b' ').map(|i| &rest[i..]).unwrap_or(&[]);
                if value.first() == Some(&b'"') {
                    return true;
                }
            }
            false
        }
    }

    /// Pieces of event streams, real and adversarial: events split anywhere, `[DONE]` in a
    /// token's text, in a comment, without its space or its line, escaped quotes, usage
    /// blocks with odd counts, the line ends SSE allows.
    const STREAM_PIECES: &[&str] = &[
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\
         \"choices\":[{\"index\":0,\"text\":\" t1\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\
         \"delta\":{\"content\":\"x\"},\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":8,\
         \"total_tokens\":13}}\n\n",
        "data: [DONE]\n\n",
        "data:[DONE]\r\n\r\n",
        "data: {\"text\":\"data: [DONE]\"}\n\n",
        "data: {\"text\":\"\\\"finish_reason\\\":\\\"stop\\\" \\\"completion_tokens\\\":3\"}\n\n",
        ": data: [DONE]\n",
        "event: x data: [DONE]\n",
        "data: ",
        "data:",
        "data",
        "ata: ",
        ":",
        " ",
        "[DONE]",
        "[DON",
        "E]",
        "\n",
        "\r",
        "\r\n",
        "\n\n",
        "\"finish_reason\":",
        "\"finish_reason\":  \"stop\"",
        "\"finish_reason\": null",
        "\"completion_tokens\":",
        "\"completion_tokens\": 12",
        "\"completion_tokens\":null",
        "18446744073709551616",
        "7",
        "\"",
        "\\\"",
        "x",
        "{\"choices\":[",
        "data: [DONE]",
        "\"stop_reason\": \"stop\"",
        "\"prompt_tokens\":5,",
        "metadata: x",
        "data: {\"choices\":[{\"index\":0,\"text\":\"y\",\"finish_reason\":null,\
         \"stop_reason\":null}]}\n\ndata: [DONE]\n\n",
    ];

    /// What the relay's scans tell of a stream, frame by frame: the tokens and usage so
    /// far, whether it is whole, whether the frame ends it or nearly.
    type Told = Vec<(u64, Option<u64>, bool, bool)>;

    /// The stream through [`Relay::received`] (an event stream of a completion, looking
    /// for its `[DONE]`).
    fn told_now(frames: &[&[u8]]) -> Told {
        let relay = &mut Relay::idle(StatusCode::OK);
        (relay.completion, relay.sse) = (true, true);
        relay.done = DoneScan::Looking(DoneEvent::default());
        frames
            .iter()
            .map(|frame| {
                let soon = relay.received(&Frame::data(Bytes::copy_from_slice(frame)));
                let tokens = (relay.tokens.events, relay.tokens.usage);
                (tokens.0, tokens.1, relay.done.whole(), soon)
            })
            .collect()
    }

    /// The same through the scans before [`sse_scan`].
    fn told_before(frames: &[&[u8]]) -> Told {
        let (mut tokens, mut done) = ((0, None), Some(before_one_pass::DoneEvent::default()));
        frames
            .iter()
            .map(|frame| {
                before_one_pass::token_feed(&mut tokens, frame, true);
                let word = before_one_pass::has_done_word(frame);
                if done.as_mut().is_some_and(|event| event.feed(frame, word)) {
                    done = None;
                }
                (tokens.0, tokens.1, done.is_none(), before_one_pass::ends_soon(frame, word))
            })
            .collect()
    }

    /// `stream` cut into frames at `cuts` (positions, any order, repeats allowed).
    fn frames_of(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        at.extend([0, stream.len()]);
        at.sort_unstable();
        at.windows(2).map(|w| stream[w[0]..w[1]].to_vec()).collect()
    }

    fn check_against_before(stream: &[u8], cuts: &[usize]) -> Result<(), String> {
        let frames = frames_of(stream, cuts);
        let frames: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (now, before) = (told_now(&frames), told_before(&frames));
        if now != before {
            return Err(format!("{frames:?}: {now:?} against {before:?}"));
        }
        // A whole answer's reading (`answer_whole`, `shows_its_end`): the stream at once.
        let mut tokens = TokenCount::default();
        let mut old = (0, None);
        for sse in [true, false] {
            tokens.feed(stream, sse);
            before_one_pass::token_feed(&mut old, stream, sse);
            if (tokens.events, tokens.usage) != old {
                return Err(format!("whole, sse {sse}: {:?} against {old:?}", tokens.usage));
            }
        }
        let whole_before = before_one_pass::DoneEvent::default()
            .feed(stream, before_one_pass::has_done_word(stream));
        if shows_its_end(stream, false) != whole_before {
            return Err("whole: the end read differently".into());
        }
        Ok(())
    }

    #[test]
    fn the_one_pass_reads_every_piece_split_anywhere_as_the_searches_did() {
        for piece in STREAM_PIECES {
            let stream = piece.as_bytes();
            for at in 0..=stream.len() {
                check_against_before(stream, &[at]).unwrap();
                check_against_before(stream, &[at, at + 1, at + 5]).unwrap();
            }
            let bytes: Vec<usize> = (0..stream.len()).collect();
            check_against_before(stream, &bytes).unwrap();
        }
    }

    proptest::proptest! {
        #[test]
        fn the_one_pass_reads_any_stream_as_the_searches_did(
            pieces in proptest::collection::vec(0..STREAM_PIECES.len(), 0..24),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..8),
            cuts in proptest::collection::vec(0usize..4096, 0..12),
        ) {
            let mut stream: Vec<u8> =
                pieces.iter().flat_map(|i| STREAM_PIECES[*i].bytes()).collect();
            // A few arbitrary bytes in arbitrary places.
            for (i, byte) in noise.iter().enumerate() {
                let at = (usize::from(*byte) * (i + 7)) % (stream.len() + 1);
                stream.insert(at, *byte);
            }
            let checked = check_against_before(&stream, &cuts);
            proptest::prop_assert!(checked.is_ok(), "{}", checked.unwrap_err());
        }
    }
}
