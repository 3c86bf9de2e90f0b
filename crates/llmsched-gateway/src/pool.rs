//! Keep-alive HTTP/1.1 connections to one engine, with a client of the gateway's own, for the
//! completion requests it forwards.
//!
//! Model: each engine has a list of idle connections (a socket and its read buffer). A request
//! takes the most recently used one (LIFO: a few warm connections carry the load, the others
//! age out), or connects a new one (resolve, connect within the connect timeout,
//! `TCP_NODELAY`). The request goes out in one write: a request line and `Host` field made once
//! per engine and path ([`Target`]), the given fields, `Content-Length` and the body. The
//! answer's head is parsed with `httparse` and its body decoded as it is read ([`h1`]), by the
//! task that polls the answer's body ([`Reading`]): no connection task, no channel between the
//! socket and the relay. The connection goes back to the list when the body has been read to
//! its end (unless the engine asked to close it); a [`Reading`] dropped before that (the
//! client left, the answer was cut or not wanted) closes the connection, which is how the
//! engine sees a cancelled request.
//!
//! Why not hyper's client: its connection task reads the socket and hands each chunk over a
//! channel to the task relaying the answer, a wake-up and a hop per chunk, and the request
//! goes through a channel to that task before it is written; the relay of a streamed answer
//! cost the gateway's one thread more than the rest of the request (measured: see the
//! CHANGELOG). hyper-util's pooled `Client` (which the gateway still uses for scrapes, probes
//! and `/v1/models`) adds a pool key, a checkout racing a connect and a task per request.
//!
//! Failures: connecting (refused, unreachable, unresolvable, over the connect timeout) is
//! [`SendError::Connect`]; a connection that fails after the request went out (closed before
//! the status line, a malformed head) is [`SendError::Broken`], and a body that breaks off or
//! is malformed ends its [`Reading`] with an error. A reused connection found closed before the
//! request was written (the engine closed it while idle), or whose write fails, is not a
//! failure: the request goes out on a new connection, once. Timeouts are the caller's (it
//! stops polling, which drops and so closes the connection).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Response, Uri, Version};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::h1;

/// Idle connections kept per engine at most (more are closed when released): a burst's
/// connections are not all kept open.
pub const MAX_IDLE: usize = 256;

/// Bytes a read asks for (at least): an answer's head and a short JSON body fit in one.
const READ_SIZE: usize = 8 << 10;

/// Why a request did not get an answer.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made (refused, unreachable, no address, connect timeout).
    Connect(String),
    /// The connection failed after the request was sent (closed before the status line, a
    /// head that could not be parsed).
    Broken(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(why) => write!(f, "cannot connect: {why}"),
            SendError::Broken(why) => write!(f, "the connection failed: {why}"),
        }
    }
}

impl std::error::Error for SendError {}

/// Why an answer's body did not arrive whole.
#[derive(Debug)]
pub enum BodyError {
    /// The framing was broken, or the connection closed before the body's end.
    Malformed(h1::Malformed),
    /// Reading the socket failed.
    Io(io::Error),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Malformed(why) => why.fmt(f),
            BodyError::Io(err) => write!(f, "reading the answer failed: {err}"),
        }
    }
}

impl std::error::Error for BodyError {}

/// One connection: the socket and what has been read from it but not yet decoded.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    /// Reads more into the buffer: Ready(Ok(0)) at the close.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf)
    }

    /// Whether an idle connection can take a request: the engine has not closed it and sent
    /// nothing unasked. Costs no system call unless the socket has signalled since its last
    /// read (tokio clears readiness on a short read).
    fn usable(&self) -> bool {
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

struct Shared {
    /// `host:port` to resolve and connect to.
    address: String,
    /// The `Host` field's value of every request.
    host: String,
    connect_timeout: Option<Duration>,
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle>>,
}

/// One engine's connections (cheap to clone: the clones share the idle list).
#[derive(Clone)]
pub struct Connections(Arc<Shared>);

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections").field("address", &self.0.address).finish()
    }
}

/// A request line and `Host` field, made once per engine and path ([`Connections::target`]).
#[derive(Debug, Clone)]
pub struct Target(Box<[u8]>);

impl Connections {
    /// Connections to the engine at `uri`'s authority (an `http://` base URL; port 80 when
    /// it names none), connecting within `connect_timeout` (None: no bound), closing
    /// connections idle longer than `idle_timeout`.
    pub fn new(
        uri: &Uri,
        connect_timeout: Option<Duration>,
        idle_timeout: Duration,
    ) -> Result<Connections, String> {
        let authority = uri.authority().ok_or_else(|| format!("{uri} has no host"))?;
        let host = authority.host();
        let port = authority.port_u16().unwrap_or(80);
        // The Host field as hyper-util's client writes it: the port only when it is not 80.
        let host_field = match authority.port_u16() {
            Some(port) if port != 80 => format!("{host}:{port}"),
            _ => host.to_string(),
        };
        HeaderValue::from_str(&host_field).map_err(|_| format!("{uri}: not a valid host"))?;
        // A bracketed IPv6 literal resolves as it is written in the URL.
        Ok(Connections(Arc::new(Shared {
            address: format!("{host}:{port}"),
            host: host_field,
            connect_timeout,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        })))
    }

    /// The request line of `POST` to `path` (an origin-form target: a path and query) with
    /// this engine's `Host` field.
    pub fn post(&self, path: &Uri) -> Target {
        let target = path.path_and_query().map_or("/", |p| p.as_str());
        Target(format!("POST {target} HTTP/1.1\r\nhost: {}\r\n", self.0.host).into_bytes().into())
    }

    /// Idle connections held now.
    pub fn idle(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.0.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends a request to `target` with `fields` (names and values are valid by their types,
    /// so nothing can be injected) and `body`, on an idle connection or a new one; the answer's
    /// head, and its body to read.
    pub async fn send(
        &self,
        target: &Target,
        fields: &[(&HeaderName, &HeaderValue)],
        body: &[u8],
    ) -> Result<Response<Reading>, SendError> {
        let request = encode(target, fields, body);
        if let Some(mut conn) = self.checkout() {
            // A failed write on a reused connection: the engine closed it meanwhile and got
            // nothing it could run; a new connection follows.
            if conn.stream.write_all(&request).await.is_ok() {
                return self.answer(conn).await;
            }
        }
        let mut conn = self.connect().await?;
        conn.stream.write_all(&request).await.map_err(|e| SendError::Broken(e.to_string()))?;
        self.answer(conn).await
    }

    /// Reads the answer's head off `conn`.
    async fn answer(&self, mut conn: Conn) -> Result<Response<Reading>, SendError> {
        let head = loop {
            match h1::parse_head(&conn.buf) {
                Ok(Some((head, used))) => {
                    let _ = conn.buf.split_to(used);
                    break head;
                }
                Ok(None) => {}
                Err(malformed) => return Err(SendError::Broken(malformed.to_string())),
            }
            match poll_fn(|cx| conn.poll_fill(cx)).await {
                Ok(0) => return Err(SendError::Broken("closed before the status line".into())),
                Ok(_) => {}
                Err(err) => return Err(SendError::Broken(err.to_string())),
            }
        };
        let body = Reading {
            conn: Some(conn),
            decoder: h1::Decoder::new(head.framing),
            keep_alive: head.keep_alive,
            home: self.clone(),
        };
        let mut answer = Response::new(body);
        *answer.status_mut() = head.status;
        *answer.version_mut() = Version::HTTP_11;
        *answer.headers_mut() = head.headers;
        if answer.body().decoder.is_done() {
            answer.body_mut().finish();
        }
        Ok(answer)
    }

    /// The most recently released connection that is still usable. Closed and expired ones
    /// are dropped.
    fn checkout(&self) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.lock();
        while let Some(entry) = idle.pop() {
            if now.duration_since(entry.since) <= self.0.idle_timeout && entry.conn.usable() {
                return Some(entry.conn);
            }
        }
        None
    }

    fn put(&self, conn: Conn) {
        let now = Instant::now();
        let mut idle = self.lock();
        // The oldest sit at the front: drop those past the idle timeout, and make room.
        let expired =
            idle.iter().take_while(|e| now.duration_since(e.since) > self.0.idle_timeout).count();
        let over = (idle.len() - expired + 1).saturating_sub(MAX_IDLE);
        idle.drain(..expired + over);
        idle.push(Idle { conn, since: now });
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let connecting = async {
            let stream = self.open().await?;
            let _ = stream.set_nodelay(true);
            Ok(Conn { stream, buf: BytesMut::with_capacity(READ_SIZE) })
        };
        match self.0.connect_timeout {
            None => connecting.await,
            Some(limit) => tokio::time::timeout(limit, connecting)
                .await
                .unwrap_or_else(|_| Err(SendError::Connect("timed out".into()))),
        }
    }

    /// A connected socket: each resolved address in turn.
    async fn open(&self) -> Result<TcpStream, SendError> {
        let addresses = tokio::net::lookup_host(self.0.address.as_str())
            .await
            .map_err(|e| SendError::Connect(format!("{}: {e}", self.0.address)))?;
        let mut last = format!("{}: no address", self.0.address);
        for address in addresses {
            match TcpStream::connect(address).await {
                Ok(stream) => return Ok(stream),
                Err(err) => last = format!("{address}: {err}"),
            }
        }
        Err(SendError::Connect(last))
    }
}

/// The request's bytes: head and body in one buffer, for one write.
fn encode(target: &Target, fields: &[(&HeaderName, &HeaderValue)], body: &[u8]) -> Vec<u8> {
    let fields_len: usize = fields.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum();
    let mut out = Vec::with_capacity(target.0.len() + fields_len + 40 + body.len());
    out.extend_from_slice(&target.0);
    for (name, value) in fields {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body);
    out
}

/// An answer's body, read from its connection by whoever polls it; the connection goes back
/// to its engine's idle list at the body's end, and is closed if this is dropped before.
pub struct Reading {
    /// None once the body has ended or failed.
    conn: Option<Conn>,
    decoder: h1::Decoder,
    keep_alive: bool,
    home: Connections,
}

impl Reading {
    /// The body has been read to its end: the connection is put back if it can carry another
    /// request (nothing more was sent after the body).
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.keep_alive && conn.buf.is_empty() {
                self.home.put(conn);
            }
        }
    }

    fn fail(&mut self, err: BodyError) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.conn = None;
        Poll::Ready(Some(Err(err)))
    }
}

impl Body for Reading {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = this.conn.as_mut() else { return Poll::Ready(None) };
            match this.decoder.decode(&mut conn.buf) {
                Err(malformed) => return this.fail(BodyError::Malformed(malformed)),
                Ok(data) => {
                    let done = this.decoder.is_done();
                    if done {
                        this.finish();
                    }
                    if let Some(data) = data {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    if done {
                        return Poll::Ready(None);
                    }
                }
            }
            let Some(conn) = this.conn.as_mut() else { return Poll::Ready(None) };
            match ready!(conn.poll_fill(cx)) {
                Ok(0) => {
                    if let Err(malformed) = this.decoder.closed() {
                        return this.fail(BodyError::Malformed(malformed));
                    }
                    // A body framed by the close: its end (the connection is not reusable).
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(_) => {}
                Err(err) => return this.fail(BodyError::Io(err)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use hyper::header::{ACCEPT, CONTENT_TYPE};
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A server that answers every request on a connection with `answer`, counting the
    /// connections it accepted and keeping what it read (`close_after_one`: it closes each
    /// connection after its first answer).
    async fn server(
        answer: &'static [u8],
        close_after_one: bool,
    ) -> (Uri, Arc<std::sync::atomic::AtomicUsize>, Arc<Mutex<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (count, log) = (accepted.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    loop {
                        let n = match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        log.lock().unwrap().extend_from_slice(&buf[..n]);
                        if stream.write_all(answer).await.is_err() || close_after_one {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}").parse().unwrap(), accepted, seen)
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    fn pool(uri: &Uri, idle: Duration) -> Connections {
        Connections::new(uri, Some(Duration::from_secs(5)), idle).unwrap()
    }

    async fn send(pool: &Connections, path: &'static str) -> Result<Response<Reading>, SendError> {
        pool.send(&pool.post(&Uri::from_static(path)), &[], b"{}").await
    }

    /// One request answered and read to its end (which releases its connection).
    async fn round_trip(pool: &Connections, path: &'static str) -> Bytes {
        let answer = send(pool, path).await.unwrap();
        answer.into_body().collect().await.unwrap().to_bytes()
    }

    fn accepted(count: &std::sync::atomic::AtomicUsize) -> usize {
        count.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_released_connection_is_reused_and_the_request_is_one_write() {
        let (uri, count, seen) = server(OK, false).await;
        let pool = pool(&uri, Duration::from_secs(60));
        for _ in 0..3 {
            assert_eq!(round_trip(&pool, "/v1/completions").await, "ok");
        }
        assert_eq!(accepted(&count), 1);
        assert_eq!(pool.idle(), 1);
        let text = String::from_utf8(seen.lock().unwrap().clone()).unwrap();
        let port = uri.port_u16().unwrap();
        let one = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        assert_eq!(text, one.repeat(3));
    }

    #[tokio::test]
    async fn fields_go_out_as_given() {
        let (uri, _, seen) = server(OK, false).await;
        let pool = pool(&uri, Duration::from_secs(60));
        let json = HeaderValue::from_static("application/json");
        let accept = HeaderValue::from_static("text/event-stream");
        let fields = [(&CONTENT_TYPE, &json), (&ACCEPT, &accept)];
        let target = pool.post(&Uri::from_static("/base/v1/chat/completions?x=1"));
        let answer = pool.send(&target, &fields, b"{\"a\":1}").await.unwrap();
        assert_eq!(answer.into_body().collect().await.unwrap().to_bytes(), "ok");
        let text = String::from_utf8(seen.lock().unwrap().clone()).unwrap();
        assert!(text.starts_with("POST /base/v1/chat/completions?x=1 HTTP/1.1\r\n"), "{text}");
        assert!(text.contains("\r\ncontent-type: application/json\r\naccept: text/event-stream\r\ncontent-length: 7\r\n\r\n{\"a\":1}"), "{text}");
    }

    #[tokio::test]
    async fn a_dropped_answer_closes_its_connection() {
        let (uri, count, _) = server(OK, false).await;
        let pool = pool(&uri, Duration::from_secs(60));
        let answer = send(&pool, "/").await.unwrap();
        drop(answer);
        assert_eq!(pool.idle(), 0);
        assert_eq!(round_trip(&pool, "/").await, "ok");
        assert_eq!(accepted(&count), 2);
    }

    #[tokio::test]
    async fn a_connection_the_engine_closed_is_not_a_failure() {
        let (uri, count, _) = server(OK, true).await;
        let pool = pool(&uri, Duration::from_secs(60));
        for _ in 0..3 {
            assert_eq!(round_trip(&pool, "/").await, "ok");
            // Let the close arrive.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted(&count), 3);
    }

    #[tokio::test]
    async fn an_answer_asking_to_close_is_not_kept() {
        let (uri, count, _) =
            server(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", false)
                .await;
        let pool = pool(&uri, Duration::from_secs(60));
        assert_eq!(round_trip(&pool, "/").await, "ok");
        assert_eq!(pool.idle(), 0);
        assert_eq!(round_trip(&pool, "/").await, "ok");
        assert_eq!(accepted(&count), 2);
    }

    #[tokio::test]
    async fn expired_connections_are_not_reused() {
        let (uri, count, _) = server(OK, false).await;
        let pool = pool(&uri, Duration::from_millis(30));
        round_trip(&pool, "/").await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        round_trip(&pool, "/").await;
        assert_eq!(accepted(&count), 2);
        assert_eq!(pool.idle(), 1);
    }

    #[tokio::test]
    async fn a_chunked_stream_is_relayed_and_its_connection_reused() {
        const STREAM: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n3;x=y\r\n1\n\n\r\n0\r\ntrailer: t\r\n\r\n";
        let (uri, count, _) = server(STREAM, false).await;
        let pool = pool(&uri, Duration::from_secs(60));
        for _ in 0..2 {
            let answer = send(&pool, "/").await.unwrap();
            assert_eq!(answer.headers()["content-type"], "text/event-stream");
            assert!(answer.body().size_hint().upper().is_none());
            assert_eq!(answer.into_body().collect().await.unwrap().to_bytes(), "data: 1\n\n");
        }
        assert_eq!(accepted(&count), 1);
    }

    #[tokio::test]
    async fn a_body_to_the_close_ends_there() {
        let (uri, count, _) = server(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", true).await;
        let pool = pool(&uri, Duration::from_secs(60));
        assert_eq!(round_trip(&pool, "/").await, "until the end");
        assert_eq!(pool.idle(), 0);
        assert_eq!(accepted(&count), 1);
    }

    #[tokio::test]
    async fn a_body_cut_short_is_an_error() {
        let (uri, _, _) = server(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true).await;
        let pool = pool(&uri, Duration::from_secs(60));
        let answer = send(&pool, "/").await.unwrap();
        let err = answer.into_body().collect().await.unwrap_err();
        assert!(matches!(err, BodyError::Malformed(_)), "{err}");
        assert_eq!(pool.idle(), 0);
        let (uri, _, _) =
            server(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", false).await;
        let pool = self::pool(&uri, Duration::from_secs(60));
        let answer = send(&pool, "/").await.unwrap();
        assert!(answer.into_body().collect().await.is_err());
        assert_eq!(pool.idle(), 0);
    }

    #[tokio::test]
    async fn refused_and_unresolvable_are_connect_errors() {
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap()
        };
        let uri: Uri = format!("http://{closed}").parse().unwrap();
        let refused = pool(&uri, Duration::from_secs(1));
        assert!(matches!(send(&refused, "/").await, Err(SendError::Connect(_))));
        let uri: Uri = "http://no-such-host.invalid:9".parse().unwrap();
        let unknown = pool(&uri, Duration::from_secs(1));
        assert!(matches!(send(&unknown, "/").await, Err(SendError::Connect(_))));
    }

    #[tokio::test]
    async fn closed_before_the_status_line_or_malformed_is_broken() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
        });
        let uri: Uri = format!("http://{addr}").parse().unwrap();
        assert!(matches!(
            send(&pool(&uri, Duration::from_secs(1)), "/").await,
            Err(SendError::Broken(_))
        ));
        let (uri, _, _) = server(b"HTTP/1.1 abc\r\n\r\n", false).await;
        assert!(matches!(
            send(&pool(&uri, Duration::from_secs(1)), "/").await,
            Err(SendError::Broken(_))
        ));
    }

    #[test]
    fn host_field_leaves_out_port_80() {
        let pool =
            Connections::new(&"http://engine".parse().unwrap(), None, Duration::from_secs(1))
                .unwrap();
        assert_eq!(pool.0.host, "engine");
        assert_eq!(pool.0.address, "engine:80");
        assert_eq!(
            &*pool.post(&Uri::from_static("/v1")).0,
            b"POST /v1 HTTP/1.1\r\nhost: engine\r\n"
        );
        let pool =
            Connections::new(&"http://[::1]:8001".parse().unwrap(), None, Duration::from_secs(1))
                .unwrap();
        assert_eq!(pool.0.host, "[::1]:8001");
        assert_eq!(pool.0.address, "[::1]:8001");
    }
}
