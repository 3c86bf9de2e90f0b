//! The feed's sockets, on its tokio runtime: a task per SUB socket (its members' sequence
//! state, replay replies and deadlines) and a task per replay socket (DEALER), which connects
//! in the background and forwards replies to its SUB task tagged with its generation (a
//! replaced socket's late replies are dropped).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc as fmpsc;
use futures::StreamExt;
use tokio::sync::{mpsc, watch};

use super::stream::{Counter, Wire};
use super::zmtp::{
    delay, DealerSocket, SocketEvent, SocketOptions, SubSocket, ZmqError, ZmqMessage,
    DEFAULT_MAX_MESSAGE,
};
use super::{lock, Group, KvOptions, Shared};
use crate::monotonic;

/// How long a ZMQ connection (TCP and handshake) may take once the endpoint answers.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs every SUB socket's task until `stop` (or its sender's drop).
pub(super) async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut tasks = tokio::task::JoinSet::new();
    for group in 0..shared.groups.len() {
        tasks.spawn(group_task(shared.clone(), group));
    }
    let _ = stop.changed().await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}

/// A reply of a replay socket, or why its connection was dropped.
struct Reply {
    member: usize,
    generation: u64,
    frames: Result<Vec<Bytes>, ZmqError>,
}

/// An endpoint with `*` (any port, any address) as `0` and `0.0.0.0`.
fn zmq_endpoint(endpoint: &str) -> String {
    let endpoint = endpoint.strip_suffix(":*").map_or(endpoint.to_owned(), |e| format!("{e}:0"));
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// What a failed bind or connect says: the OS error's own text for a network error
/// (`Address already in use (os error 98)`), else ZMQ's.
fn error_text(error: &ZmqError) -> String {
    match error {
        ZmqError::Network(e) => e.to_string(),
        other => other.to_string(),
    }
}

/// Waits until a TCP endpoint accepts connections (with the feed's backoff), so that the ZMQ
/// connection made after it is made at once (libzmq connects lazily).
async fn reachable(endpoint: &str, backoff: (f64, f64)) {
    let Some(address) = endpoint.strip_prefix("tcp://") else { return };
    let mut failures = 0;
    while tokio::net::TcpStream::connect(address).await.is_err() {
        tokio::time::sleep(delay(backoff, failures)).await;
        failures += 1;
    }
}

/// The sockets' options: the connect timeout, the feed's backoff for a lost connection, and
/// the message cap: the larger of [`DEFAULT_MAX_MESSAGE`] and `buffer_cap_bytes` (a message
/// the feed could hold), so a peer declaring more is dropped before anything is allocated.
fn options(feed: &KvOptions) -> SocketOptions {
    let mut options = SocketOptions::default();
    options
        .connect_timeout(CONNECT_TIMEOUT)
        .reconnect_backoff(feed.backoff_s)
        .max_message(feed.buffer_cap_bytes.max(DEFAULT_MAX_MESSAGE));
    options
}

/// Reports a dropped peer, the first one of an endpoint only (the rest are counted): to the
/// embedder's hook as a `drop` (Python logs it through `logging`), else on stderr.
fn warn_dropped(
    warned: &mut bool,
    hook: Option<&super::SocketHook>,
    workers: Vec<&str>,
    endpoint: &str,
    peer: &str,
    error: &ZmqError,
) {
    if std::mem::replace(warned, true) {
        return;
    }
    let counter = if error.is_protocol() { "decode_errors" } else { "socket_errors" };
    let text = format!(
        "dropped the connection of {peer}: {error} (counted in {counter}; later ones on this \
         endpoint are counted, not logged)"
    );
    match hook {
        Some(hook) => {
            hook(&super::SocketReport { workers, endpoint, action: "drop", error: Some(&text) })
        }
        None => eprintln!("llmsched: warning: KV events {endpoint}: {text}"),
    }
}

/// A replay socket seen from its SUB task.
struct Dealer {
    endpoint: String,
    backoff: (f64, f64),
    options: SocketOptions,
    member: usize,
    generation: u64,
    requests: mpsc::UnboundedSender<u64>,
    replies: mpsc::UnboundedSender<Reply>,
    task: tokio::task::JoinHandle<()>,
    /// Whether a dropped connection was logged.
    warned: bool,
}

impl Dealer {
    fn new(
        endpoint: String,
        feed: &KvOptions,
        member: usize,
        replies: mpsc::UnboundedSender<Reply>,
    ) -> Dealer {
        let (backoff, options) = (feed.backoff_s, options(feed));
        let (requests, task) =
            Dealer::spawn(&endpoint, backoff, &options, member, 0, replies.clone());
        Dealer {
            endpoint,
            backoff,
            options,
            member,
            generation: 0,
            requests,
            replies,
            task,
            warned: false,
        }
    }

    fn spawn(
        endpoint: &str,
        backoff: (f64, f64),
        options: &SocketOptions,
        member: usize,
        generation: u64,
        replies: mpsc::UnboundedSender<Reply>,
    ) -> (mpsc::UnboundedSender<u64>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(dealer_task(
            zmq_endpoint(endpoint),
            backoff,
            options.clone(),
            member,
            generation,
            rx,
            replies,
        ));
        (tx, task)
    }

    /// A fresh socket: replies to an abandoned request never reach it.
    fn reset(&mut self) {
        self.task.abort();
        self.generation += 1;
        let (requests, task) = Dealer::spawn(
            &self.endpoint,
            self.backoff,
            &self.options,
            self.member,
            self.generation,
            self.replies.clone(),
        );
        self.requests = requests;
        self.task = task;
    }
}

impl Drop for Dealer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One replay socket: connects (again, after a failure), sends the replay requests it is
/// given and forwards the replies, and why a connection was dropped (a peer breaking the
/// protocol, or too slow a handshake: connected again after the backoff).
async fn dealer_task(
    endpoint: String,
    backoff: (f64, f64),
    options: SocketOptions,
    member: usize,
    generation: u64,
    mut requests: mpsc::UnboundedReceiver<u64>,
    replies: mpsc::UnboundedSender<Reply>,
) {
    let mut failures = 0;
    // Connections dropped for the peer's fault since its last reply: the pause grows with them.
    let mut strikes = 0;
    loop {
        reachable(&endpoint, backoff).await;
        let mut dealer = DealerSocket::with_options(options.clone());
        if let Err(e) = dealer.connect(&endpoint).await {
            if e.reported() {
                let frames = Err(e);
                if replies.send(Reply { member, generation, frames }).is_err() {
                    return;
                }
            }
            tokio::time::sleep(delay(backoff, failures)).await;
            failures += 1;
            continue;
        }
        failures = 0;
        loop {
            tokio::select! {
                start = requests.recv() => {
                    let Some(start) = start else { return };
                    // The ROUTER sees [identity, empty delimiter, start].
                    let frames = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
                    let Ok(message) = ZmqMessage::try_from(frames) else { continue };
                    if dealer.send(message).await.is_err() {
                        break; // reconnect; the replay times out and is asked again later
                    }
                }
                reply = dealer.recv() => match reply {
                    Ok(message) => {
                        strikes = 0;
                        let frames = Ok(message.into_vec());
                        if replies.send(Reply { member, generation, frames }).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.reported() => {
                        if replies.send(Reply { member, generation, frames: Err(e) }).is_err() {
                            return;
                        }
                        tokio::time::sleep(delay(backoff, strikes)).await;
                        strikes += 1;
                        break;
                    }
                    Err(_) => break,
                },
            }
        }
    }
}

/// What a member's stream asks of the index and its replay socket.
struct MemberWire<'a> {
    shared: &'a Shared,
    member: usize,
    dealer: Option<&'a mut Dealer>,
}

impl Wire for MemberWire<'_> {
    fn apply(
        &mut self,
        payload: &[u8],
    ) -> Result<llmsched_core::prefix_index::ApplyReport, String> {
        let member = &self.shared.members[self.member];
        let report =
            self.shared.index.apply_vllm_events(&member.key, payload).map_err(|e| e.to_string())?;
        let noted =
            report.block_size_mismatch + report.extra_keys + report.multimodal + report.replaced;
        if let Some(hook) = self.shared.on_mismatch.as_ref().filter(|_| noted > 0) {
            hook(&member.spec.worker, &report);
        }
        Ok(report)
    }

    fn malformed_batch(&mut self, seq: u64, error: &str) {
        let Some(hook) = self.shared.on_socket.as_ref() else { return };
        let spec = &self.shared.members[self.member].spec;
        let error = format!(
            "batch {seq} is malformed and skipped ({error}); the worker is resynchronised \
             (counted in decode_errors and resyncs; later ones are not logged)"
        );
        hook(&super::SocketReport {
            workers: vec![spec.worker.as_str()],
            endpoint: &spec.endpoint,
            action: "malformed",
            error: Some(&error),
        });
    }

    fn clear(&mut self) {
        let _ = self.shared.index.clear(&self.shared.members[self.member].key);
    }

    fn has_replay(&self) -> bool {
        self.dealer.is_some()
    }

    fn ask_replay(&mut self, start: u64) {
        if let Some(dealer) = self.dealer.as_mut() {
            let _ = dealer.requests.send(start);
        }
    }

    fn reset_replay(&mut self) {
        if let Some(dealer) = self.dealer.as_mut() {
            dealer.reset();
        }
    }
}

/// One SUB socket's task.
struct GroupTask {
    shared: Arc<Shared>,
    group: usize,
    /// Replay sockets by member (None: no replay socket).
    dealers: Vec<Option<Dealer>>,
    /// Whether a peer dropped by the SUB socket was logged.
    warned: bool,
    /// Whether a message of another topic than its engine's was logged (own socket only).
    foreign_warned: bool,
}

impl GroupTask {
    fn group(&self) -> &Group {
        &self.shared.groups[self.group]
    }

    /// Runs `f` on member `m`'s stream with its wire, then wakes the readers.
    fn with_stream(&mut self, m: usize, f: impl FnOnce(&mut super::Stream, &mut MemberWire<'_>)) {
        let shared = self.shared.clone();
        let slot = self.group().members.iter().position(|&x| x == m);
        let dealer = slot.and_then(|s| self.dealers[s].as_mut());
        let mut wire = MemberWire { shared: &shared, member: m, dealer };
        {
            let mut stream = lock(&shared.members[m].stream);
            f(&mut stream, &mut wire);
        }
        shared.touched();
    }

    fn bump_extra(&self, counter: Counter) {
        lock(&self.shared.extra).bump(counter, 1);
        self.shared.touched();
    }

    fn shared_socket(&self) -> bool {
        self.group().members.len() > 1
    }

    fn on_event(&mut self, event: SocketEvent) {
        let now = monotonic();
        let members = self.group().members.clone();
        match event {
            SocketEvent::Connected(..) | SocketEvent::Accepted(..) => {
                // A connecting socket whose handshakes failed works again.
                if !self.group().bind && lock(&self.group().failure).take().is_some() {
                    self.report(None);
                }
                let own = !self.shared_socket();
                if !own {
                    self.bump_extra(Counter::Connects);
                }
                for m in members {
                    self.with_stream(m, |s, w| s.connected(own, now, w));
                }
            }
            SocketEvent::Disconnected(..) if self.shared_socket() => {
                self.bump_extra(Counter::Disconnects);
            }
            SocketEvent::Disconnected(..) => {
                self.with_stream(members[0], |s, _| s.disconnected());
            }
            SocketEvent::Dropped(peer, error) => {
                let shared = self.shared.clone();
                let group = &shared.groups[self.group];
                let endpoint = lock(&group.bound).clone().unwrap_or_else(|| group.endpoint.clone());
                let workers =
                    group.members.iter().map(|&m| shared.members[m].spec.worker.as_str()).collect();
                let hook = shared.on_socket.as_ref();
                if group.bind {
                    warn_dropped(&mut self.warned, hook, workers, &endpoint, &peer, &error);
                } else {
                    // The endpoint this socket connects to answers TCP but not as a ZMQ
                    // publisher (an engine's HTTP port, another protocol): the socket cannot
                    // work as configured, so it is failing until a handshake succeeds.
                    let text = format!("the peer's ZMTP handshake failed: {error}");
                    let mut failure = lock(&group.failure);
                    if failure.as_deref() != Some(text.as_str()) {
                        *failure = Some(text.clone());
                        drop(failure);
                        self.report(Some(&text));
                    }
                }
                let protocol = error.is_protocol();
                if self.shared_socket() {
                    self.bump_extra(if protocol {
                        Counter::DecodeErrors
                    } else {
                        Counter::SocketErrors
                    });
                } else if protocol {
                    self.with_stream(members[0], |s, _| s.malformed());
                } else {
                    self.with_stream(members[0], |s, _| s.socket_failed());
                }
            }
        }
    }

    fn on_live(&mut self, frames: Vec<Bytes>) {
        let now = monotonic();
        let well_formed = frames.len() == 3 && frames[1].len() == 8;
        let members = self.group().members.clone();
        let own = members.iter().copied().find(|&m| {
            frames
                .first()
                .is_some_and(|t| t.as_ref() == self.shared.members[m].spec.topic.as_bytes())
        });
        let Some(m) = own else {
            if self.shared_socket() {
                self.bump_extra(if well_formed {
                    Counter::TopicRejected
                } else {
                    Counter::DecodeErrors
                });
            } else if !well_formed {
                self.with_stream(members[0], |s, _| s.malformed());
            } else {
                self.with_stream(members[0], |s, _| s.foreign_topic());
                if let Some(topic) = frames.first().filter(|_| !self.foreign_warned) {
                    self.foreign_warned = true;
                    self.report_foreign_topic(members[0], topic);
                }
            }
            return;
        };
        if !well_formed {
            self.with_stream(m, |s, _| s.malformed());
            return;
        }
        let seq = u64::from_be_bytes(frames[1].as_ref().try_into().unwrap_or([0; 8]));
        let payload = frames[2].clone();
        self.with_stream(m, |s, w| s.on_live(seq, payload, now, w));
    }

    fn on_reply(&mut self, reply: Reply) {
        let slot = self.group().members.iter().position(|&x| x == reply.member);
        let Some(dealer) = slot.and_then(|s| self.dealers[s].as_mut()) else { return };
        if dealer.generation != reply.generation {
            return; // from a socket replaced since
        }
        let frames = match reply.frames {
            Ok(frames) => frames,
            Err(error) => {
                let worker = self.shared.members[reply.member].spec.worker.as_str();
                let hook = self.shared.on_socket.as_ref();
                let (endpoint, peer) = (&dealer.endpoint, "the replay socket");
                warn_dropped(&mut dealer.warned, hook, vec![worker], endpoint, peer, &error);
                if error.is_protocol() {
                    self.with_stream(reply.member, |s, _| s.malformed());
                } else {
                    self.with_stream(reply.member, |s, _| s.socket_failed());
                }
                return;
            }
        };
        let topic = self.shared.members[reply.member].spec.topic.clone();
        let now = monotonic();
        self.with_stream(reply.member, |s, w| s.on_replay_reply(&frames, topic.as_bytes(), now, w));
    }

    fn check_timers(&mut self) {
        let now = monotonic();
        for m in self.group().members.clone() {
            self.with_stream(m, |s, w| s.check_timers(now, w));
        }
    }

    fn next_deadline(&self) -> Option<f64> {
        let group = self.group();
        group
            .members
            .iter()
            .filter_map(|&m| lock(&self.shared.members[m].stream).next_deadline())
            .min_by(f64::total_cmp)
    }

    /// Tells the embedder's hook (if any) of the first message on member `m`'s own socket whose
    /// topic is not the engine's (refused, counted in `topic_rejected`).
    fn report_foreign_topic(&self, m: usize, topic: &[u8]) {
        let Some(hook) = self.shared.on_socket.as_ref() else { return };
        let spec = &self.shared.members[m].spec;
        let shown = String::from_utf8_lossy(&topic[..topic.len().min(200)]).into_owned();
        let error = format!(
            "a message with topic {shown:?} arrived where the engine's topic is {:?}: refused \
             (counted in topic_rejected; later ones are not logged); give the engine spec the \
             topic of the engine's --kv-events-config",
            spec.topic
        );
        hook(&super::SocketReport {
            workers: vec![spec.worker.as_str()],
            endpoint: &spec.endpoint,
            action: "topic",
            error: Some(&error),
        });
    }

    /// Tells the embedder's hook (if any) what opening the socket gave.
    fn report(&self, error: Option<&str>) {
        let Some(hook) = self.shared.on_socket.as_ref() else { return };
        let group = self.group();
        let workers =
            group.members.iter().map(|&m| self.shared.members[m].spec.worker.as_str()).collect();
        let action = if group.bind { "bind" } else { "connect" };
        hook(&super::SocketReport { workers, endpoint: &group.endpoint, action, error });
    }

    /// Opens the SUB socket (binding, or connecting once the endpoint answers TCP), retrying
    /// with the backoff after a failure of the bind or the connect (counted in
    /// `socket_errors`, kept for [`super::KvFeed::failing_sockets`] and reported to the
    /// embedder's hook). A connecting socket's endpoint that does not answer yet (its engine
    /// not up) is waited for, not a failure.
    async fn open(&mut self) -> (SubSocket, fmpsc::Receiver<SocketEvent>) {
        let backoff = self.shared.options.backoff_s;
        let endpoint = zmq_endpoint(&self.group().endpoint);
        let mut failures = 0;
        loop {
            let mut sub = SubSocket::with_options(options(&self.shared.options));
            let monitor = sub.monitor();
            let mut subscribed = Ok(());
            // A socket of its own takes every topic and refuses the others itself, counted
            // and logged: subscribed to its engine's topic alone, a topic set otherwise on the
            // engine left nothing arriving, and nothing said (a publisher sends one topic).
            let own = !self.shared_socket();
            for &m in &self.group().members {
                let topic =
                    if own { String::new() } else { self.shared.members[m].spec.topic.clone() };
                if let Err(e) = sub.subscribe(&topic).await {
                    subscribed = Err(e);
                }
            }
            let opened = match subscribed {
                Err(e) => Err(e),
                Ok(()) if self.group().bind => {
                    sub.bind(&endpoint).await.map(|e| Some(e.to_string()))
                }
                Ok(()) => {
                    reachable(&endpoint, backoff).await;
                    sub.connect(&endpoint).await.map(|()| None)
                }
            };
            let first = !self.group().tried.swap(true, std::sync::atomic::Ordering::AcqRel);
            match opened {
                Ok(bound) => {
                    *lock(&self.group().bound) = bound;
                    if lock(&self.group().failure).take().is_some() {
                        self.report(None);
                    }
                    self.shared.touched();
                    return (sub, monitor);
                }
                Err(error) => {
                    let error = error_text(&error);
                    *lock(&self.group().failure) = Some(error.clone());
                    if self.shared_socket() {
                        self.bump_extra(Counter::SocketErrors);
                    } else {
                        let m = self.group().members[0];
                        self.with_stream(m, |s, _| s.socket_failed());
                    }
                    self.report(Some(&error));
                }
            }
            if first {
                self.shared.touched();
            }
            tokio::time::sleep(delay(backoff, failures)).await;
            failures += 1;
        }
    }
}

async fn group_task(shared: Arc<Shared>, group: usize) {
    let (replies_tx, mut replies) = mpsc::unbounded_channel();
    let dealers = shared.groups[group]
        .members
        .iter()
        .map(|&m| {
            let replay = shared.members[m].spec.replay.clone();
            replay.map(|endpoint| Dealer::new(endpoint, &shared.options, m, replies_tx.clone()))
        })
        .collect();
    let mut task = GroupTask { shared, group, dealers, warned: false, foreign_warned: false };
    let (mut sub, mut monitor) = task.open().await;
    let mut monitoring = true;
    loop {
        let wake = task.next_deadline().map_or(Duration::from_secs(3600), |at| {
            Duration::from_secs_f64((at - monotonic()).clamp(0.0, 3600.0))
        });
        tokio::select! {
            biased;
            event = monitor.next(), if monitoring => match event {
                Some(event) => task.on_event(event),
                None => monitoring = false,
            },
            // Replies first: a replay in progress decides how the live batches are taken.
            Some(reply) = replies.recv() => task.on_reply(reply),
            message = sub.recv() => {
                if let Ok(message) = message {
                    task.on_live(message.into_vec());
                }
            }
            () = tokio::time::sleep(wake) => task.check_timers(),
        }
    }
}
