//! The client connection's socket, with a bound on writes that make no progress.
//!
//! hyper has no write timeout: an answer to a client that stops reading waits in hyper's
//! write buffer (a JSON answer of up to 8 MiB, read whole before it is sent) for as long as
//! the client keeps its connection open, and an event stream waits at its backpressure.
//! [`ClientIo`] arms a timer when a write cannot go on (`Pending`: the kernel's send buffer
//! is full because the client does not read) and disarms it at the next write that moves
//! bytes. When the timer fires, the write fails, which ends hyper's connection, and the
//! socket is closed with a reset (`SO_LINGER` 0) so that the kernel drops what it still held
//! for the client too. The timer fires after [`GatewayConfig::idle_timeout_s`] without
//! progress, or at the deadline of the request being answered
//! ([`GatewayConfig::total_timeout_s`], the whole-request deadline, writing included),
//! whichever comes first; each cut is counted in `llmsched_gateway_rejections_total` with
//! reason `send_timeout` or `timeout`.
//!
//! Cost: nothing on a write that completes at once (the common case); the timer is allocated
//! at the connection's first stalled write and reset, not reallocated, after that.
//!
//! [`GatewayConfig::idle_timeout_s`]: crate::GatewayConfig::idle_timeout_s
//! [`GatewayConfig::total_timeout_s`]: crate::GatewayConfig::total_timeout_s

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::metrics::Counters;

/// The deadline of the request a connection is answering, shared by its service (which sets
/// it when a request arrives) and its [`ClientIo`] (which bounds the answer's writes by it).
/// Nanoseconds after the connection's start; `u64::MAX`: none.
pub struct AnswerDeadline {
    start: Instant,
    at: AtomicU64,
}

impl AnswerDeadline {
    /// No deadline yet, counted from now.
    pub fn new() -> Arc<AnswerDeadline> {
        Arc::new(AnswerDeadline { start: Instant::now(), at: AtomicU64::new(u64::MAX) })
    }

    /// A request arrived: its answer must be written within `total` from now (None: no limit).
    pub fn request_arrived(&self, total: Option<Duration>) {
        let at = total.map_or(u64::MAX, |total| {
            let due = self.start.elapsed().saturating_add(total);
            u64::try_from(due.as_nanos()).unwrap_or(u64::MAX)
        });
        self.at.store(at, Ordering::Relaxed);
    }

    fn get(&self) -> Option<Instant> {
        match self.at.load(Ordering::Relaxed) {
            u64::MAX => None,
            at => self.start.checked_add(Duration::from_nanos(at)),
        }
    }
}

/// A client connection's socket whose writes fail once they make no progress for `stall`, or
/// once the current request's deadline passes while one waits (see the module docs).
pub struct ClientIo {
    inner: TcpStream,
    stall: Duration,
    deadline: Arc<AnswerDeadline>,
    counters: Arc<Counters>,
    /// Armed while a write waits; allocated at the first one.
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
    /// Whether the armed timer is the request's deadline (else the stall bound).
    by_deadline: bool,
    /// Cut already (counted once; every later write fails at once).
    cut: bool,
}

impl ClientIo {
    /// `inner` with writes bounded by `stall` without progress and by `deadline`.
    pub fn new(
        inner: TcpStream,
        stall: Duration,
        deadline: Arc<AnswerDeadline>,
        counters: Arc<Counters>,
    ) -> ClientIo {
        ClientIo {
            inner,
            stall,
            deadline,
            counters,
            timer: None,
            armed: false,
            by_deadline: false,
            cut: false,
        }
    }

    /// A write of `written` (Pending: it could not go on) passes through; a stalled one arms
    /// the timer, and one stalled past it is an error.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if self.cut {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the answer's write timed out",
            )));
        }
        if written.is_ready() {
            self.armed = false;
            return written;
        }
        if !self.armed {
            let by_stall = Instant::now() + self.stall;
            let (due, by_deadline) = match self.deadline.get() {
                Some(deadline) if deadline <= by_stall => (deadline, true),
                _ => (by_stall, false),
            };
            match &mut self.timer {
                Some(timer) => timer.as_mut().reset(due),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(due))),
            }
            self.armed = true;
            self.by_deadline = by_deadline;
        }
        let Some(timer) = self.timer.as_mut() else { return Poll::Pending };
        ready!(timer.as_mut().poll(cx));
        self.cut = true;
        let reason = if self.by_deadline { "timeout" } else { "send_timeout" };
        self.counters.rejections.inc(&[reason]);
        // A reset, not a close: the kernel drops what it still holds for the client instead of
        // trying to deliver it.
        let _ = socket2::SockRef::from(&self.inner).set_linger(Some(Duration::ZERO));
        let what = if self.by_deadline {
            "the request's deadline (timeouts.total_s) passed while its answer was written"
        } else {
            "the client read nothing of its answer for limits.idle_timeout_s"
        };
        Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, what)))
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bounded(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bounded(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
