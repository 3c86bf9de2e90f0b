//! Keep-alive HTTP/1.1 connections to one engine, driven through hyper's connection-level
//! client (`hyper::client::conn::http1`), for the completion requests the gateway forwards.
//!
//! Model: each engine has a list of idle connections. A request takes the most recently used
//! one that is ready (LIFO: a few warm connections carry the load, the others age out), or
//! connects a new one (resolve, connect within the connect timeout, `TCP_NODELAY`, the HTTP/1
//! handshake, and a task that drives the connection). The [`Lease`] goes back to the list when
//! its answer has been read to the end ([`Lease::release`]); dropped before that (the client
//! left, the answer was cut or not wanted), it closes the connection, which is how the engine
//! sees a cancelled request. Requests carry origin-form URIs and a `Host` header made once per
//! engine.
//!
//! Why not hyper-util's pooled `Client` (which the gateway still uses for scrapes, probes and
//! `/v1/models`): per request it builds a pool key, races a checkout against a lazily built
//! connect future (which starts connecting whenever no idle connection is ready at that
//! instant), rewrites the URI to origin form, formats the `Host` header and spawns a task that
//! waits for the connection to be ready again. On the gateway's one thread that was about a
//! sixth of the instructions of a proxied request.
//!
//! Each connection's socket counts its reads ([`ReadMeter`]): the relay of a streamed answer
//! tells from it whether hyper holds more of what it read than it has handed over, and only
//! then waits for that before writing to the client (see `Relay::hold` in the crate root).
//!
//! Failures: connecting (refused, unreachable, unresolvable, over the connect timeout) is
//! [`SendError::Connect`]; a connection that fails after the request went out (closed before
//! the status line, a malformed answer) is [`SendError::Broken`]. A reused connection found
//! closed before the request was written (the engine closed it while idle) is not a failure:
//! the request goes out on another connection, once.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::header::HOST;
use hyper::{Request, Response, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The request body the gateway forwards: the client's bytes, unchanged.
pub type Body = Full<Bytes>;

/// Idle connections kept per engine at most (more are closed when released): a burst's
/// connections are not all kept open.
pub const MAX_IDLE: usize = 256;

/// Why a request did not get an answer.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made (refused, unreachable, no address, connect timeout).
    Connect(String),
    /// The connection failed after the request was sent (closed before the status line, an
    /// answer hyper could not parse).
    Broken(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(why) => write!(f, "cannot connect: {why}"),
            SendError::Broken(err) => write!(f, "the connection failed: {err}"),
        }
    }
}

impl std::error::Error for SendError {}

/// The reads of one upstream connection's socket: how many, and the bytes the last one got.
/// hyper reads the socket only once it has parsed all it read before (the body's decoder asks
/// for more only when its buffer is empty), so the bytes of the last read not yet handed over
/// as body frames (counted by the reader, with their chunked framing) are bytes hyper holds
/// and hands over at its next turns, without waiting for the network.
#[derive(Debug, Default)]
pub struct ReadMeter {
    reads: AtomicU64,
    last: AtomicUsize,
}

impl ReadMeter {
    /// Reads that got bytes so far, and the bytes of the last of them.
    pub fn last_read(&self) -> (u64, usize) {
        (self.reads.load(Ordering::Relaxed), self.last.load(Ordering::Relaxed))
    }

    fn read(&self, bytes: usize) {
        self.last.store(bytes, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
    }
}

/// An upstream connection's socket, its reads counted in a [`ReadMeter`]; writes pass
/// through.
struct Metered {
    inner: TcpStream,
    meter: Arc<ReadMeter>,
}

impl AsyncRead for Metered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        let got = buf.filled().len() - before;
        if got > 0 {
            this.meter.read(got);
        }
        read
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
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

/// A connection: the request side of hyper's connection and its socket's reads.
struct Conn {
    sender: http1::SendRequest<Body>,
    meter: Arc<ReadMeter>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

struct Shared {
    /// `host:port` to resolve and connect to.
    address: String,
    /// The `Host` header of every request.
    host: hyper::header::HeaderValue,
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

/// A connection in use by one request; see [`Lease::release`].
pub struct Lease {
    conn: Option<Conn>,
    home: Connections,
    /// The connection's reads when the answer's head had been read.
    head_read: u64,
}

impl Lease {
    /// The answer was read to its end: the connection goes back to its engine's idle list
    /// (unless it is closing, or the list is full).
    pub fn release(mut self) {
        if let Some(conn) = self.conn.take() {
            self.home.put(conn);
        }
    }

    /// The reads of the connection's socket ([`ReadMeter::last_read`]), and which of them
    /// had the answer's head.
    pub fn reads(&self) -> Option<(&ReadMeter, u64)> {
        self.conn.as_ref().map(|conn| (&*conn.meter, self.head_read))
    }
}

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
        // The Host header as hyper-util's client writes it: the port only when it is not 80.
        let host_header = match authority.port_u16() {
            Some(port) if port != 80 => format!("{host}:{port}"),
            _ => host.to_string(),
        };
        let host_header = hyper::header::HeaderValue::from_str(&host_header)
            .map_err(|_| format!("{uri}: not a valid host"))?;
        // A bracketed IPv6 literal resolves as it is written in the URL.
        Ok(Connections(Arc::new(Shared {
            address: format!("{host}:{port}"),
            host: host_header,
            connect_timeout,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
        })))
    }

    /// Idle connections held now.
    pub fn idle(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.0.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `request` (an origin-form URI; its `Host` header is set here) on an idle
    /// connection or a new one. The lease holds the connection until the answer is read.
    pub async fn send(
        &self,
        mut request: Request<Body>,
    ) -> Result<(Response<Incoming>, Lease), SendError> {
        request.headers_mut().insert(HOST, self.0.host.clone());
        if let Some(mut conn) = self.checkout() {
            match conn.sender.try_send_request(request).await {
                Ok(answer) => return Ok((answer, self.lease(conn))),
                Err(mut failed) => match failed.take_message() {
                    // Not written: the connection had closed meanwhile; a new one follows.
                    Some(unsent) => request = unsent,
                    None => return Err(SendError::Broken(failed.into_error())),
                },
            }
        }
        // Boxed: connecting is rare, and its future would widen every request's.
        let mut conn = Box::pin(self.connect()).await?;
        match conn.sender.send_request(request).await {
            Ok(answer) => Ok((answer, self.lease(conn))),
            Err(err) => Err(SendError::Broken(err)),
        }
    }

    fn lease(&self, conn: Conn) -> Lease {
        let head_read = conn.meter.last_read().0;
        Lease { conn: Some(conn), home: self.clone(), head_read }
    }

    /// The most recently released connection that can take a request now. Closed and
    /// expired ones are dropped; one still finishing its last answer is left in the list.
    fn checkout(&self) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.lock();
        let mut busy = Vec::new();
        let mut found = None;
        while let Some(entry) = idle.pop() {
            let sender = &entry.conn.sender;
            if sender.is_closed() || now.duration_since(entry.since) > self.0.idle_timeout {
                continue;
            }
            if sender.is_ready() {
                found = Some(entry.conn);
                break;
            }
            busy.push(entry);
        }
        idle.extend(busy.into_iter().rev());
        found
    }

    fn put(&self, conn: Conn) {
        if conn.sender.is_closed() {
            return;
        }
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
            let meter = Arc::new(ReadMeter::default());
            let io = Metered { inner: stream, meter: meter.clone() };
            let (sender, connection) = http1::Builder::new()
                .handshake::<_, Body>(TokioIo::new(io))
                .await
                .map_err(|e| SendError::Connect(e.to_string()))?;
            // Drives the connection until it closes (the lease and the answer dropped, the
            // engine closing it); its error is the requests' to report.
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok(Conn { sender, meter })
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn get(path: &'static str) -> Request<Body> {
        let mut request = Request::new(Full::new(Bytes::new()));
        *request.uri_mut() = Uri::from_static(path);
        request
    }

    /// A server that answers every request on a connection with a fixed body, counting the
    /// connections it accepted and keeping what it read.
    async fn server(
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
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(answer).await.is_err() || close_after_one {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}").parse().unwrap(), accepted, seen)
    }

    async fn read_all(answer: Response<Incoming>) -> Bytes {
        use http_body_util::BodyExt;
        answer.into_body().collect().await.unwrap().to_bytes()
    }

    /// One request answered and read to its end, its connection released.
    async fn round_trip(pool: &Connections, path: &'static str) {
        let (answer, lease) = pool.send(get(path)).await.unwrap();
        assert_eq!(read_all(answer).await, "ok");
        lease.release();
    }

    #[tokio::test]
    async fn a_released_connection_is_reused_and_sends_host() {
        let (uri, accepted, seen) = server(false).await;
        let pool = Connections::new(&uri, None, Duration::from_secs(60)).unwrap();
        for _ in 0..3 {
            round_trip(&pool, "/v1/completions").await;
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(pool.idle(), 1);
        let text = String::from_utf8(seen.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("GET").count(), 3, "{text}");
        let port = uri.port_u16().unwrap();
        assert!(text.contains(&format!("host: 127.0.0.1:{port}\r\n")), "{text}");
        assert!(text.starts_with("GET /v1/completions HTTP/1.1\r\n"), "{text}");
    }

    #[tokio::test]
    async fn a_dropped_lease_closes_its_connection() {
        let (uri, accepted, _) = server(false).await;
        let pool = Connections::new(&uri, None, Duration::from_secs(60)).unwrap();
        let (answer, lease) = pool.send(get("/")).await.unwrap();
        drop((answer, lease));
        assert_eq!(pool.idle(), 0);
        round_trip(&pool, "/").await;
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_the_engine_closed_is_not_a_failure() {
        let (uri, accepted, _) = server(true).await;
        let pool = Connections::new(&uri, None, Duration::from_secs(60)).unwrap();
        for _ in 0..3 {
            round_trip(&pool, "/").await;
            // Let the connection task see the close.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn expired_connections_are_not_reused() {
        let (uri, accepted, _) = server(false).await;
        let pool = Connections::new(&uri, None, Duration::from_millis(30)).unwrap();
        round_trip(&pool, "/").await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        round_trip(&pool, "/").await;
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(pool.idle(), 1);
    }

    #[tokio::test]
    async fn refused_and_unresolvable_are_connect_errors() {
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap()
        };
        let uri: Uri = format!("http://{closed}").parse().unwrap();
        let pool =
            Connections::new(&uri, Some(Duration::from_secs(2)), Duration::from_secs(1)).unwrap();
        assert!(matches!(pool.send(get("/")).await, Err(SendError::Connect(_))));
        let uri: Uri = "http://no-such-host.invalid:9".parse().unwrap();
        let pool =
            Connections::new(&uri, Some(Duration::from_secs(5)), Duration::from_secs(1)).unwrap();
        assert!(matches!(pool.send(get("/")).await, Err(SendError::Connect(_))));
    }

    #[tokio::test]
    async fn closed_before_the_status_line_is_broken() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
        });
        let uri: Uri = format!("http://{addr}").parse().unwrap();
        let pool = Connections::new(&uri, None, Duration::from_secs(1)).unwrap();
        assert!(matches!(pool.send(get("/")).await, Err(SendError::Broken(_))));
    }

    #[test]
    fn host_header_leaves_out_port_80() {
        let pool =
            Connections::new(&"http://engine".parse().unwrap(), None, Duration::from_secs(1))
                .unwrap();
        assert_eq!(pool.0.host, "engine");
        assert_eq!(pool.0.address, "engine:80");
        let pool =
            Connections::new(&"http://[::1]:8001".parse().unwrap(), None, Duration::from_secs(1))
                .unwrap();
        assert_eq!(pool.0.host, "[::1]:8001");
        assert_eq!(pool.0.address, "[::1]:8001");
    }
}
