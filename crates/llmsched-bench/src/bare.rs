//! The least an HTTP/1.1 proxy on tokio and hyper does, as a reference point for the gateway
//! benchmark (`llmsched-bare-proxy`): each request goes to the next engine in turn with its
//! method, target, `Content-Type` and body unchanged, and the answer comes back frame by frame,
//! over keep-alive connections, on one current-thread runtime. It reads no body, routes on
//! nothing, bounds nothing and counts nothing, so what it costs per request on a machine is the
//! floor of a gateway built on the same stack there (the sockets, the wake-ups, hyper).
//!
//! An engine that cannot be reached is a 502; nothing else is checked.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::Empty;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1 as client;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

type Sender = client::SendRequest<Incoming>;

struct Engine {
    addr: SocketAddr,
    host: hyper::header::HeaderValue,
    idle: Mutex<Vec<Sender>>,
}

struct Proxy {
    engines: Vec<Engine>,
    next: AtomicUsize,
}

/// Serves on `listener` in front of `engines` until the runtime stops.
pub async fn serve(listener: TcpListener, engines: &[SocketAddr]) {
    let proxy = Arc::new(Proxy {
        engines: engines
            .iter()
            .map(|addr| Engine {
                addr: *addr,
                host: hyper::header::HeaderValue::from_str(&addr.to_string())
                    .expect("a socket address is a valid header value"),
                idle: Mutex::new(Vec::new()),
            })
            .collect(),
        next: AtomicUsize::new(0),
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| proxy.clone().forward(request));
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// The answer's body, which puts its connection back when it ends.
pub struct Relayed {
    inner: Incoming,
    back: Option<(Sender, Arc<Proxy>, usize)>,
}

impl Body for Relayed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            if let Some((sender, proxy, engine)) = self.back.take() {
                proxy.engines[engine].idle.lock().unwrap_or_else(|e| e.into_inner()).push(sender);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

type Answer = Response<http_body_util::Either<Relayed, Empty<Bytes>>>;

impl Proxy {
    async fn forward(self: Arc<Self>, request: Request<Incoming>) -> Result<Answer, hyper::Error> {
        let engine = self.next.fetch_add(1, Ordering::Relaxed) % self.engines.len();
        let (parts, body) = request.into_parts();
        let mut forward = Request::new(body);
        *forward.method_mut() = parts.method;
        *forward.uri_mut() = parts.uri;
        let mut headers = HeaderMap::with_capacity(2);
        headers.insert(HOST, self.engines[engine].host.clone());
        if let Some(kind) = parts.headers.get(CONTENT_TYPE) {
            headers.insert(CONTENT_TYPE, kind.clone());
        }
        *forward.headers_mut() = headers;
        let Some(mut sender) = self.sender(engine).await else { return Ok(bad_gateway()) };
        let Ok(answer) = sender.send_request(forward).await else { return Ok(bad_gateway()) };
        let (parts, inner) = answer.into_parts();
        let body = Relayed { inner, back: Some((sender, self.clone(), engine)) };
        Ok(Response::from_parts(parts, http_body_util::Either::Left(body)))
    }

    /// An idle connection ready for a request, or a new one.
    async fn sender(&self, engine: usize) -> Option<Sender> {
        loop {
            let idle = self.engines[engine].idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(sender) if sender.is_ready() => return Some(sender),
                Some(_) => continue,
                None => break,
            }
        }
        let stream = TcpStream::connect(self.engines[engine].addr).await.ok()?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = client::handshake(TokioIo::new(stream)).await.ok()?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Some(sender)
    }
}

fn bad_gateway() -> Answer {
    let mut answer = Response::new(http_body_util::Either::Right(Empty::new()));
    *answer.status_mut() = StatusCode::BAD_GATEWAY;
    answer
}
