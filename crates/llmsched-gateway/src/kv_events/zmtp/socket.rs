//! The sockets on tokio: a task per connection (handshake, then reading frames, answering
//! PING, writing what its socket sends), whose messages go to a queue its socket reads. A SUB's
//! connections share one queue, bounded in bytes, that each waits its turn to add to (tokio's
//! semaphores and channels serve waiters in order): publishers are merged fairly, and a fast
//! one cannot crowd out the others beyond one message.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures::channel::mpsc as fmpsc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use super::codec::{self, Decoder, Item, Kind, GREETING_LEN, READ_CHUNK};
use super::{delay, tcp_address, SocketEvent, SocketOptions, ZmqError, ZmqMessage, ZmqResult};
use super::{MAX_HANDSHAKES, MAX_PEERS};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn closed() -> ZmqError {
    ZmqError::Network(io::ErrorKind::UnexpectedEof.into())
}

/// A connection past its handshake, with what has arrived after it.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
    decoder: Decoder,
}

/// Greeting and READY both ways, within the connect timeout.
async fn handshake(mut stream: TcpStream, kind: Kind, options: &SocketOptions) -> ZmqResult<Conn> {
    let work = async move {
        let _ = stream.set_nodelay(true);
        stream.write_all(&codec::greeting()).await?;
        let mut buf = BytesMut::with_capacity(1024);
        while buf.len() < GREETING_LEN {
            if stream.read_buf(&mut buf).await? == 0 {
                return Err(closed());
            }
            codec::check_greeting(&buf[..buf.len().min(GREETING_LEN)])?;
        }
        buf.advance(GREETING_LEN);
        stream.write_all(&codec::ready(kind)).await?;
        let mut decoder = Decoder::new(options.max_message);
        loop {
            match decoder.decode(&mut buf)? {
                Some(Item::Command { name, data }) if name.as_ref() == b"READY" => {
                    match codec::socket_type(&data)? {
                        Some(peer) if kind.accepts(peer) => break,
                        peer => {
                            return Err(ZmqError::Protocol(format!(
                                "a {} peer for a {} socket",
                                String::from_utf8_lossy(peer.unwrap_or(b"(no Socket-Type)")),
                                String::from_utf8_lossy(kind.name())
                            )))
                        }
                    }
                }
                Some(Item::Command { name, data }) if name.as_ref() == b"ERROR" => {
                    let reason = data.get(1..).unwrap_or_default();
                    return Err(ZmqError::Protocol(format!(
                        "the peer refused the handshake: {}",
                        String::from_utf8_lossy(reason)
                    )));
                }
                Some(_) => return Err(ZmqError::Protocol("a frame before READY".into())),
                None => {
                    buf.reserve(decoder.room(buf.len()));
                    if stream.read_buf(&mut buf).await? == 0 {
                        return Err(closed());
                    }
                }
            }
        }
        // The handshake's small buffer is replaced by a read chunk (any bytes past READY kept).
        let mut chunk = BytesMut::with_capacity(READ_CHUNK.max(buf.len()));
        chunk.extend_from_slice(&buf);
        Ok(Conn { stream, buf: chunk, decoder })
    };
    tokio::time::timeout(options.connect_timeout, work).await.map_err(|_| ZmqError::Timeout)?
}

/// Connects to `address` and makes the handshake, each within the connect timeout; the error
/// names the peer.
async fn dial(
    address: &str,
    kind: Kind,
    options: &SocketOptions,
) -> Result<(Conn, String), (String, ZmqError)> {
    let stream =
        match tokio::time::timeout(options.connect_timeout, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err((address.to_owned(), e.into())),
            Err(_) => {
                return Err((address.to_owned(), io::Error::from(io::ErrorKind::TimedOut).into()))
            }
        };
    let peer = stream.peer_addr().map_or_else(|_| address.to_owned(), |a| a.to_string());
    match handshake(stream, kind, options).await {
        Ok(conn) => Ok((conn, peer)),
        Err(e) => Err((peer, e)),
    }
}

/// A received message with its share of the queue's bytes (given back when it is read).
type Queued = (Vec<Bytes>, OwnedSemaphorePermit);

/// Where a socket's connections put their messages.
#[derive(Clone)]
struct Inbox {
    tx: mpsc::Sender<Queued>,
    bytes: Arc<Semaphore>,
    budget: usize,
}

/// A queue of messages holding at most `max_message` bytes (and 1,024 messages).
fn inbox(max_message: usize) -> (Inbox, mpsc::Receiver<Queued>) {
    let budget = max_message.min(u32::MAX as usize);
    let (tx, rx) = mpsc::channel(1024);
    (Inbox { tx, bytes: Arc::new(Semaphore::new(budget)), budget }, rx)
}

impl Inbox {
    /// Queues a message once there is room for it; Err when the socket is gone.
    async fn deliver(&self, frames: Vec<Bytes>) -> Result<(), ()> {
        let size: usize = frames.iter().map(Bytes::len).sum();
        let share = u32::try_from(size.min(self.budget)).unwrap_or(u32::MAX);
        let permit = self.bytes.clone().acquire_many_owned(share).await.map_err(|_| ())?;
        self.tx.send((frames, permit)).await.map_err(|_| ())
    }
}

/// Runs a connection until it fails (the reason) or its socket is gone (Ok): its messages to
/// `inbox`, PING answered, `outgoing`'s bytes written.
async fn serve(
    mut conn: Conn,
    mut outgoing: mpsc::UnboundedReceiver<Bytes>,
    inbox: Inbox,
) -> ZmqResult<()> {
    loop {
        while let Some(item) = conn.decoder.decode(&mut conn.buf)? {
            match item {
                Item::Message(frames) => {
                    if inbox.deliver(frames).await.is_err() {
                        return Ok(());
                    }
                }
                Item::Command { name, data } => match name.as_ref() {
                    b"PING" => conn.stream.write_all(&codec::pong(&data)).await?,
                    b"ERROR" => return Err(ZmqError::Protocol("the peer sent ERROR".into())),
                    b"READY" => return Err(ZmqError::Protocol("READY after the handshake".into())),
                    _ => {} // PONG, SUBSCRIBE, CANCEL: nothing for a SUB or a DEALER to do
                },
            }
        }
        conn.buf.reserve(conn.decoder.room(conn.buf.len()));
        tokio::select! {
            read = conn.stream.read_buf(&mut conn.buf) => {
                if read? == 0 {
                    return Err(closed());
                }
            }
            out = outgoing.recv() => match out {
                Some(bytes) => conn.stream.write_all(&bytes).await?,
                None => return Ok(()),
            },
        }
    }
}

/// A SUB socket's subscriptions and its connections' writers (each has been sent them all).
#[derive(Default)]
struct Subscribers {
    topics: Vec<Bytes>,
    writers: HashMap<u64, mpsc::UnboundedSender<Bytes>>,
    next: u64,
}

/// What a SUB socket's tasks share.
struct SubShared {
    options: SocketOptions,
    monitor: Mutex<Option<fmpsc::Sender<SocketEvent>>>,
    subscribers: Mutex<Subscribers>,
    inbox: Inbox,
}

impl SubShared {
    fn event(&self, event: SocketEvent) {
        if let Some(monitor) = lock(&self.monitor).as_mut() {
            let _ = monitor.try_send(event);
        }
    }

    /// Runs a handshaken connection to its end, its subscriptions sent first.
    async fn run(&self, conn: Conn) -> ZmqResult<()> {
        let (tx, outgoing) = mpsc::unbounded_channel();
        let id = {
            let mut subscribers = lock(&self.subscribers);
            for topic in &subscribers.topics {
                let _ = tx.send(topic.clone());
            }
            subscribers.next += 1;
            let id = subscribers.next;
            subscribers.writers.insert(id, tx);
            id
        };
        let result = serve(conn, outgoing, self.inbox.clone()).await;
        lock(&self.subscribers).writers.remove(&id);
        result
    }

    /// Reports the end of a connection that had completed its handshake.
    fn ended(&self, peer: String, result: ZmqResult<()>) {
        if let Err(e) = result {
            if e.reported() {
                self.event(SocketEvent::Dropped(peer.clone(), e));
            }
        }
        self.event(SocketEvent::Disconnected(peer));
    }
}

/// A SUB socket: binds (many publishers) and connects; see the module docs.
pub struct SubSocket {
    shared: Arc<SubShared>,
    messages: mpsc::Receiver<Queued>,
    /// Accepting and connecting tasks; dropping the socket aborts them and their connections.
    tasks: JoinSet<()>,
}

impl SubSocket {
    /// A socket with `options`, neither bound nor connected.
    pub fn with_options(options: SocketOptions) -> SubSocket {
        let (inbox, messages) = inbox(options.max_message);
        let shared = SubShared {
            options,
            monitor: Mutex::new(None),
            subscribers: Mutex::new(Subscribers::default()),
            inbox,
        };
        SubSocket { shared: Arc::new(shared), messages, tasks: JoinSet::new() }
    }

    /// The socket's events from now on (a full monitor loses events, never blocks the socket).
    pub fn monitor(&mut self) -> fmpsc::Receiver<SocketEvent> {
        let (tx, rx) = fmpsc::channel(1024);
        *lock(&self.shared.monitor) = Some(tx);
        rx
    }

    /// Subscribes to messages whose first frame starts with `topic` (every connection, those
    /// made later too).
    pub async fn subscribe(&mut self, topic: &str) -> ZmqResult<()> {
        let frame = codec::subscription(topic.as_bytes()).freeze();
        let mut subscribers = lock(&self.shared.subscribers);
        for writer in subscribers.writers.values() {
            let _ = writer.send(frame.clone());
        }
        subscribers.topics.push(frame);
        Ok(())
    }

    /// Binds `tcp://host:port` (`*` for any address or port) and accepts publishers; returns
    /// the endpoint bound.
    pub async fn bind(&mut self, endpoint: &str) -> ZmqResult<String> {
        let listener = TcpListener::bind(tcp_address(endpoint)?).await?;
        let local = listener.local_addr()?;
        self.tasks.spawn(accept(listener, self.shared.clone()));
        Ok(format!("tcp://{local}"))
    }

    /// Connects to `tcp://host:port` in the background, as libzmq does: the connection is
    /// made, and made again when lost, with the reconnect backoff.
    pub async fn connect(&mut self, endpoint: &str) -> ZmqResult<()> {
        let address = tcp_address(endpoint)?;
        self.tasks.spawn(reconnect(address, self.shared.clone()));
        Ok(())
    }

    /// The next message of any publisher.
    pub async fn recv(&mut self) -> ZmqResult<ZmqMessage> {
        match self.messages.recv().await {
            Some((frames, _share)) => Ok(ZmqMessage(frames)),
            None => Err(ZmqError::NoMessage),
        }
    }
}

/// A bound SUB socket's listener: a task per peer, within the caps.
async fn accept(listener: TcpListener, shared: Arc<SubShared>) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let mut peers = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, address)) = accepted else {
                    // Out of descriptors, say: try again soon, without spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let peer = address.to_string();
                let permit = handshakes.clone().try_acquire_owned().ok();
                let Some(permit) = permit.filter(|_| peers.len() < MAX_PEERS) else {
                    shared.event(SocketEvent::Dropped(peer, ZmqError::Busy));
                    continue; // the stream is closed as it is dropped
                };
                let shared = shared.clone();
                peers.spawn(async move {
                    let conn = match handshake(stream, Kind::Sub, &shared.options).await {
                        Ok(conn) => conn,
                        Err(e) => {
                            if e.reported() {
                                shared.event(SocketEvent::Dropped(peer, e));
                            }
                            return;
                        }
                    };
                    drop(permit);
                    shared.event(SocketEvent::Accepted(peer.clone()));
                    let result = shared.run(conn).await;
                    shared.ended(peer, result);
                });
            }
            Some(_) = peers.join_next(), if !peers.is_empty() => {}
        }
    }
}

/// A connecting SUB socket's connection, made again with the backoff whenever it is lost (the
/// delay grows while attempts fail or peers misbehave; a connection that ended cleanly is
/// made again after the first delay).
async fn reconnect(address: String, shared: Arc<SubShared>) {
    let mut failures = 0u32;
    loop {
        match dial(&address, Kind::Sub, &shared.options).await {
            Ok((conn, peer)) => {
                shared.event(SocketEvent::Connected(peer.clone()));
                let result = shared.run(conn).await;
                let clean = match &result {
                    Ok(()) => return, // the socket is gone
                    Err(e) => !e.reported(),
                };
                shared.ended(peer, result);
                failures = if clean { 0 } else { failures + 1 };
            }
            Err((peer, e)) => {
                if e.reported() {
                    shared.event(SocketEvent::Dropped(peer, e));
                }
                failures += 1;
            }
        }
        tokio::time::sleep(delay(shared.options.backoff, failures.saturating_sub(1))).await;
    }
}

/// A DEALER's one connection.
struct Link {
    writer: mpsc::UnboundedSender<Bytes>,
    messages: mpsc::Receiver<Queued>,
    /// The connection's task, until its end has been reported.
    task: Option<JoinHandle<ZmqResult<()>>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A DEALER socket with one connection (made again by its owner, with a new socket).
pub struct DealerSocket {
    options: SocketOptions,
    link: Option<Link>,
}

impl DealerSocket {
    /// A socket with `options`, not connected.
    pub fn with_options(options: SocketOptions) -> DealerSocket {
        DealerSocket { options, link: None }
    }

    /// Connects to `tcp://host:port` and makes the handshake, each within the connect timeout.
    pub async fn connect(&mut self, endpoint: &str) -> ZmqResult<()> {
        let address = tcp_address(endpoint)?;
        let (conn, _peer) =
            dial(&address, Kind::Dealer, &self.options).await.map_err(|(_, e)| e)?;
        let (writer, outgoing) = mpsc::unbounded_channel();
        let (inbox, messages) = inbox(self.options.max_message);
        let task = tokio::spawn(serve(conn, outgoing, inbox));
        self.link = Some(Link { writer, messages, task: Some(task) });
        Ok(())
    }

    /// Sends a message (queued for the connection's task).
    pub async fn send(&mut self, message: ZmqMessage) -> ZmqResult<()> {
        let link = self.link.as_ref().ok_or(ZmqError::NoMessage)?;
        let mut out = BytesMut::new();
        codec::put_message(&mut out, &message.0);
        link.writer.send(out.freeze()).map_err(|_| ZmqError::NoMessage)
    }

    /// The next message; once the connection has ended, why it did.
    pub async fn recv(&mut self) -> ZmqResult<ZmqMessage> {
        let link = self.link.as_mut().ok_or(ZmqError::NoMessage)?;
        if let Some((frames, _share)) = link.messages.recv().await {
            return Ok(ZmqMessage(frames));
        }
        let Some(task) = link.task.as_mut() else { return Err(ZmqError::NoMessage) };
        let ended = task.await;
        link.task = None;
        match ended {
            Ok(Err(e)) => Err(e),
            _ => Err(ZmqError::NoMessage),
        }
    }
}

#[cfg(test)]
#[path = "socket_tests.rs"]
mod tests;
