//! Serving a gateway: binding its listener (with [`listen_backlog`]), the accept loop with its
//! connection limit (a connection past it gets a 503 and is closed), and the two ways to run it:
//! [`start`] on the caller's runtime ([`GatewayHandle`]) or [`spawn`] on its own threads
//! ([`Running`]).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{build, ConfigProblem, EngineEntry, GatewayConfig};
use crate::engines::ChangeCount;
use crate::metrics::Counters;
use crate::probes::probes;
use crate::scrape::scrape;
use crate::{
    client_io, flow, monotonic, slicing, tokcache, token_check, tokenize, usage, Gateway, Hooks,
    RouterSource,
};

/// A listening gateway on the caller's runtime.
pub struct GatewayHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counters.
    pub counters: Arc<Counters>,
    gateway: Arc<Gateway>,
}

impl GatewayHandle {
    /// See [`Running::set_engines`].
    pub fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.set_engines(engines)
    }
}

/// Checks `config`, binds `addr` and serves from tasks on the current tokio runtime (the
/// metrics scrape, health probes and flow control's timer included) until the runtime stops.
pub async fn start(
    addr: SocketAddr,
    config: GatewayConfig,
) -> Result<GatewayHandle, ConfigProblem> {
    let backlog = listen_backlog(config.max_connections);
    let gateway = Arc::new(build(config, None, Hooks::default())?);
    let listener = TcpListener::from_std(bind(addr, backlog)?)
        .map_err(|e| ConfigProblem(format!("cannot listen on {addr}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| ConfigProblem(e.to_string()))?;
    let counters = gateway.counters.clone();
    // No stop signal: it serves until the runtime stops.
    let (_, stop) = watch::channel(false);
    tokio::spawn(serve(gateway.clone(), listener, stop));
    Ok(GatewayHandle { addr, counters, gateway })
}

/// The tokio runtime of `threads` worker threads. One thread: everything on the thread that
/// runs the loop (a current-thread runtime: no cross-thread wake-ups).
pub fn runtime_builder(threads: usize) -> tokio::runtime::Builder {
    if threads == 1 {
        return tokio::runtime::Builder::new_current_thread();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(threads);
    builder
}

/// The listen backlog of a gateway taking `max_connections` client connections: room for
/// all of them to arrive at once, never less than tokio's default of 1,024 (the kernel caps it
/// at `net.core.somaxconn`). Under a burst of new connections a short queue overflows and
/// the kernel drops the clients' SYNs (they retry after a second) before the gateway could
/// answer them, or refuse the ones over the cap with a 503.
pub fn listen_backlog(max_connections: usize) -> i32 {
    i32::try_from(max_connections.max(1024)).unwrap_or(i32::MAX)
}

/// A non-blocking listening socket on `addr` with `backlog` (`SO_REUSEADDR` set, as std's
/// `TcpListener::bind` does).
fn bind(addr: SocketAddr, backlog: i32) -> Result<std::net::TcpListener, ConfigProblem> {
    use socket2::{Domain, Protocol, Socket, Type};
    let failed = |e: io::Error| ConfigProblem(format!("cannot listen on {addr}: {e}"));
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(failed)?;
    socket.set_reuse_address(true).map_err(failed)?;
    socket.set_nonblocking(true).map_err(failed)?;
    socket.bind(&addr.into()).map_err(failed)?;
    socket.listen(backlog).map_err(failed)?;
    Ok(socket.into())
}

/// A gateway serving on its own runtime thread(s); [`Running::stop`] (or dropping it) closes
/// the listener and every connection, then joins the thread.
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    gateway: Arc<Gateway>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts a gateway on its own runtime (`config.threads` worker threads) listening on
/// `addr`, routing with `source` (None: a router built from `config`), with the embedder's
/// `hooks`. Returns once it listens.
pub fn spawn(
    addr: SocketAddr,
    config: GatewayConfig,
    source: Option<Arc<dyn RouterSource>>,
    hooks: Hooks,
) -> Result<Running, ConfigProblem> {
    let threads = config.threads;
    let backlog = listen_backlog(config.max_connections);
    let gateway = Arc::new(build(config, source, hooks)?);
    let std_listener = bind(addr, backlog)?;
    let addr = std_listener.local_addr().map_err(|e| ConfigProblem(e.to_string()))?;
    let runtime = runtime_builder(threads)
        .enable_all()
        .thread_name("llmsched-gateway")
        .build()
        .map_err(|e| ConfigProblem(format!("cannot start the runtime: {e}")))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let served = gateway.clone();
    let thread = std::thread::Builder::new()
        .name("llmsched-gateway".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(std_listener) {
                    Ok(listener) => serve(served, listener, stop_rx).await,
                    Err(err) => eprintln!("llmsched-gateway: cannot listen: {err}"),
                }
            });
            // Dropping the runtime cancels every connection task.
            runtime.shutdown_timeout(Duration::from_secs(1));
        })
        .map_err(|e| ConfigProblem(format!("cannot start the gateway thread: {e}")))?;
    Ok(Running { addr, gateway, stop: Some(stop_tx), thread: Some(thread) })
}

impl Running {
    /// Stops listening, closes every connection (in-flight requests are cut) and joins the
    /// runtime thread. Idempotent.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Whether it still serves.
    pub fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.gateway.counters
    }

    /// The check that the token ids it routes on reach the engines' KV events
    /// ([`token_check`]), whose counts may be read from any thread, also after `stop()` (and
    /// from the embedder's metrics hook, which runs while [`Running::metrics_text`] is
    /// borrowed).
    pub fn token_check(&self) -> Arc<token_check::TokenCheck> {
        self.gateway.token_check.clone()
    }

    /// Replaces the engines (base URLs); returns the ids added and removed. Kept engines keep
    /// their health; with a router of its own the gateway updates the pool too (a shared
    /// router's pool is its owner's to update). An empty list takes every engine out (requests
    /// get a 503 until some come back); a repeated or malformed one changes nothing.
    pub fn set_engines(
        &self,
        engines: &[EngineEntry],
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.set_engines(engines)
    }

    /// [`Self::set_engines`], counting `changes` engine changes (`engine_changes`) in place
    /// of its own count: the embedder's, which also sees changes that reach no upstream (an
    /// engine's role, model or labels).
    pub fn set_engines_counting(
        &self,
        engines: &[EngineEntry],
        changes: u64,
    ) -> Result<(Vec<String>, Vec<String>), ConfigProblem> {
        self.gateway.replace_engines(engines, ChangeCount::Given(changes))
    }

    /// The `/metrics` text.
    pub fn metrics_text(&self) -> String {
        self.gateway.metrics_text()
    }

    /// Each engine's id and health state (`up`, `down`, `open`).
    pub fn health_states(&self) -> Vec<(String, &'static str)> {
        let upstreams = self.gateway.upstreams();
        upstreams
            .list
            .iter()
            .map(|u| {
                (u.id.clone(), u.health.lock().unwrap_or_else(|e| e.into_inner()).state.name())
            })
            .collect()
    }

    /// Sets the engines' context length (`None`: unknown): what a request's
    /// `truncate_prompt_tokens` of -1 keeps less one, as vLLM keeps it.
    pub fn set_max_model_len(&self, context: Option<usize>) {
        self.gateway.set_max_model_len(context);
    }

    /// The tokenizer's piece cache (None without a tokenizer).
    pub fn tokenizer_cache_stats(&self) -> Option<tokcache::CacheStats> {
        self.gateway.tokenizer.as_ref().map(tokenize::PromptTokenizer::cache_stats)
    }

    /// Flow control's snapshot (None when off).
    pub fn flow_stats(&self) -> Option<flow::FlowStats> {
        self.gateway.flow.as_ref().map(|f| f.stats(monotonic()))
    }

    /// Flow control's gauges and counters (None when off).
    pub fn flow_metrics(&self) -> Option<llmsched_core::flow::metrics::ControllerMetrics> {
        self.gateway.flow.as_ref().and_then(|f| f.metrics(monotonic()))
    }

    /// Engines a request could go to now.
    pub fn routable(&self) -> Vec<String> {
        self.gateway.routable()
    }

    /// This gateway's usage since the last call, for the other replicas ([`usage`]).
    pub fn drain_usage(&self) -> usage::Usage {
        self.gateway.drain_usage()
    }

    /// Charges other replicas' usage here ([`usage`]).
    pub fn apply_usage(&self, usage: &usage::Usage) {
        self.gateway.apply_usage(usage);
    }

    /// Requests being decoded in slices now (None when token slices are off).
    pub fn sliced_requests(&self) -> Option<usize> {
        self.gateway.slicing.as_ref().map(slicing::Slicing::tracked)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(gateway: Arc<Gateway>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    if let Some(interval) = gateway.config.scrape_interval_s {
        tokio::spawn(scrape(gateway.clone(), Duration::from_secs_f64(interval)));
    }
    tokio::spawn(probes(gateway.clone()));
    if let Some(flow) = &gateway.flow {
        tokio::spawn(flow.clone().run(monotonic));
    }
    let idle = Duration::from_secs_f64(gateway.config.idle_timeout_s);
    // A dropped sender is no stop signal.
    let stopped = async move {
        if stop.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(stopped);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stopped => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let counters = gateway.counters.clone();
        let open = counters.connections.fetch_add(1, Ordering::Relaxed);
        let gateway = gateway.clone();
        let max_headers = gateway.config.max_headers;
        tokio::spawn(async move {
            let counted = OpenConnection(counters.clone());
            if open as usize >= gateway.config.max_connections {
                counters.connections_refused.fetch_add(1, Ordering::Relaxed);
                refuse_connection(stream, counted).await;
                return;
            }
            // Writes to the client are bounded too (hyper has no write timeout): a client
            // that stops reading holds its answer for `idle_timeout_s` at most, and no longer
            // than its request's deadline.
            let deadline = client_io::AnswerDeadline::new();
            let total = gateway.config.total_timeout_s.map(Duration::from_secs_f64);
            let io = client_io::ClientIo::new(stream, idle, deadline.clone(), counters);
            let service = service_fn(move |request| {
                deadline.request_arrived(total);
                gateway.clone().handle(request)
            });
            // One buffer per write rather than a queue of them (`writev(false)`): an SSE
            // event's chunk (its size line, the data, the CRLF) is copied into it, which costs
            // less than queueing three buffers and gathering them for `writev` (the bytes sent
            // are the same, in a `write`).
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .writev(false)
                .header_read_timeout(idle)
                .max_headers(max_headers)
                .serve_connection(TokioIo::new(io), service)
                .await;
        });
    }
}

pub(crate) struct OpenConnection(Arc<Counters>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers a connection over the cap with a 503 and closes it; `open` (its count among the
/// open connections) is given back once the 503 is written, so that a refused client that is
/// slow to close does not keep others out.
pub(crate) async fn refuse_connection(mut stream: tokio::net::TcpStream, open: OpenConnection) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = br#"{"error":{"message":"too many connections","type":"service_unavailable","param":null,"code":503}}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let _ = stream.shutdown().await;
    drop(open);
    // Reads (and drops) what the client sends until it closes, bounded: closing over a request
    // left unread would reset the connection, and a client still writing it would lose the
    // 503 it had not read yet.
    // On the heap: an array here would be in every connection's task (this future is part
    // of it), copied whole each time one is spawned.
    let mut sink = vec![0u8; 16 << 10];
    let mut left = REFUSED_DRAIN_BYTES;
    let drain = async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(REFUSED_DRAIN_TIME, drain).await;
}

/// Reads and drops a refused request's body (at most `max_body` and a refused connection's
/// allowance, while its bytes keep coming: each read within [`REFUSED_BODY_GAP`], all within
/// `total`), so that the connection closes over no unread bytes: the client reads its refusal
/// rather than a reset. Bounded by pauses rather than by a short total: a client still sending
/// 16 MiB at a few MB/s (or on a busy machine) would otherwise be reset.
pub(crate) async fn drain_refused_body(mut body: Incoming, max_body: usize, total: Duration) {
    let mut left = max_body.saturating_add(REFUSED_DRAIN_BYTES);
    let drain = async {
        while let Ok(Some(Ok(frame))) = tokio::time::timeout(REFUSED_BODY_GAP, body.frame()).await {
            let read = frame.data_ref().map_or(0, Bytes::len);
            left = left.saturating_sub(read);
            if left == 0 {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(total, drain).await;
}

/// How long a refused connection's request is read and dropped at most before it is closed.
const REFUSED_DRAIN_TIME: Duration = Duration::from_millis(500);

/// How long a refused request's body may pause between reads before its connection is
/// closed (it is read for at most `body_timeout_s` in all, as long as any body may take).
const REFUSED_BODY_GAP: Duration = Duration::from_secs(1);

/// How much of a refused connection's request is read and dropped at most.
const REFUSED_DRAIN_BYTES: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backlog_holds_every_connection_and_never_shrinks() {
        assert_eq!(listen_backlog(1), 1024);
        assert_eq!(listen_backlog(4096), 4096);
        assert_eq!(listen_backlog(usize::MAX), i32::MAX);
    }

    /// The backlog the kernel applied: a listening socket's `TCP_INFO` reports it as
    /// `tcpi_sacked` (Linux).
    #[cfg(target_os = "linux")]
    #[test]
    fn the_listener_gets_the_backlog_asked_for() {
        use std::os::fd::AsRawFd;
        let somaxconn: i32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4096);
        for asked in [1024, 2000] {
            let listener = bind("127.0.0.1:0".parse().unwrap(), asked).unwrap();
            // SAFETY: `info` is a plain C struct and `len` its size, as getsockopt expects.
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            let got = unsafe {
                libc::getsockopt(
                    listener.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    std::ptr::addr_of_mut!(info).cast(),
                    &mut len,
                )
            };
            assert_eq!(got, 0);
            assert_eq!(info.tcpi_sacked as i32, asked.min(somaxconn));
        }
    }
}
