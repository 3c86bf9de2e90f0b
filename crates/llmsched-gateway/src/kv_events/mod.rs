//! A native KV-event feed: vLLM engines' ZMQ KV-event streams read in Rust (our own ZMTP,
//! [`zmtp`], no libzmq) and applied to the prefix index with no Python per batch. It
//! does what the Python subscriber (`llmsched.integrations.kv_events`) does, with its options,
//! counters and rules: one SUB socket per engine (connecting, or binding), engines binding one
//! fixed endpoint sharing a socket split by topic, the replay (DEALER to the engine's ROUTER)
//! for gaps and catch-ups, reordering within a window, resyncs and restarts ([`stream`]).
//!
//! The feed runs on a thread of its own with a single-threaded tokio runtime: one task per
//! SUB socket (its members' sequence state, timers and replay replies), one per replay
//! socket. It sleeps until a message or a deadline (a replay's, a hole's), so an idle feed
//! costs nothing. Counters and stream states are read from any thread.
//!
//! Differences from the Python subscriber, where libzmq and this ZMQ implementation differ:
//! a connecting socket probes the endpoint over TCP with the `backoff_s` backoff until it
//! answers before its ZMQ connection is made (libzmq connects lazily on its own), and a lost
//! connection is re-made with the same backoff; a peer that breaks the protocol, declares a
//! message over the cap or does not finish its handshake is dropped and counted ([`zmtp`]).

mod sockets;
pub mod stream;
pub mod zmtp;

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use llmsched_core::prefix_index::{ApplyReport, PrefixIndex, WorkerKey};
use serde::Deserialize;
use tokio::sync::watch;

pub use stream::{Counter, Counts, StreamConfig, StreamState, COUNTERS};

use stream::Stream;

/// One engine's KV-event publisher (`EngineSpec`'s KV-event fields).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KvEngine {
    /// The worker id its events are applied to.
    pub worker: String,
    /// The ZMQ endpoint of its live stream.
    pub endpoint: String,
    /// Whether the feed binds the endpoint (the engine connects).
    #[serde(default)]
    pub bind: bool,
    /// Its replay socket (ROUTER), if any.
    #[serde(default)]
    pub replay: Option<String>,
    /// Its topic (the first frame of every message).
    #[serde(default)]
    pub topic: String,
}

/// How the feed tolerates loss and disorder (the Python subscriber's keyword arguments).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KvOptions {
    /// First and largest delay between connection attempts.
    pub backoff_s: (f64, f64),
    /// How long a replay may stay silent before it is given up.
    pub replay_timeout_s: f64,
    /// First and largest pause before a failed replay socket is asked again.
    pub replay_backoff_s: (f64, f64),
    /// Later batches held while a hole waits for a late arrival.
    pub reorder_window: u64,
    /// How long a hole waits for a late arrival before it is a gap.
    pub reorder_wait_s: f64,
    /// Most batches held per engine.
    pub buffer_cap: usize,
    /// Most payload bytes held per engine.
    pub buffer_cap_bytes: usize,
    /// Ask the replay socket for what was missed whenever a publisher (re)connects (asked
    /// again, after the replay backoff, when that replay times out).
    pub catch_up: bool,
}

impl Default for KvOptions {
    fn default() -> Self {
        KvOptions {
            backoff_s: (0.05, 2.0),
            replay_timeout_s: 2.0,
            replay_backoff_s: (10.0, 300.0),
            reorder_window: 64,
            reorder_wait_s: 0.05,
            buffer_cap: 10_000,
            buffer_cap_bytes: 64 << 20,
            catch_up: false,
        }
    }
}

impl KvOptions {
    fn check(&self) -> Result<(), String> {
        for (name, (first, largest)) in
            [("backoff_s", self.backoff_s), ("replay_backoff_s", self.replay_backoff_s)]
        {
            if !(first > 0.0 && first <= largest && largest.is_finite()) {
                return Err(format!(
                    "{name} must be (first, largest) with 0 < first <= largest, got ({first}, {largest})"
                ));
            }
        }
        for (name, value) in
            [("replay_timeout_s", self.replay_timeout_s), ("reorder_wait_s", self.reorder_wait_s)]
        {
            if !(value > 0.0 && value.is_finite()) {
                return Err(format!("{name} must be a finite number > 0, got {value}"));
            }
        }
        if self.buffer_cap == 0 || self.buffer_cap_bytes == 0 {
            return Err("buffer_cap and buffer_cap_bytes must be ints >= 1".into());
        }
        if self.buffer_cap as u64 <= self.reorder_window {
            return Err(format!(
                "buffer_cap ({}) must be larger than reorder_window ({}): the reorder wait holds \
                 that many batches",
                self.buffer_cap, self.reorder_window
            ));
        }
        Ok(())
    }

    fn stream(&self) -> StreamConfig {
        StreamConfig {
            reorder_window: self.reorder_window,
            reorder_wait_s: self.reorder_wait_s,
            buffer_cap: self.buffer_cap,
            buffer_cap_bytes: self.buffer_cap_bytes,
            replay_timeout_s: self.replay_timeout_s,
            replay_backoff_s: self.replay_backoff_s,
            catch_up: self.catch_up,
        }
    }
}

/// One subscribed engine.
struct Member {
    spec: KvEngine,
    key: WorkerKey,
    stream: Mutex<Stream>,
}

/// The SUB sockets: one engine's own, or one bound endpoint shared by several (by topic).
struct Group {
    endpoint: String,
    bind: bool,
    members: Vec<usize>,
    /// The endpoint actually bound (a `*` port resolved), once bound.
    bound: Mutex<Option<String>>,
    /// Why the last attempt to open the socket failed, while it has not opened since.
    failure: Mutex<Option<String>>,
    /// Whether its first attempt to open (bind) was made ([`KvFeed::start`] waits for it).
    tried: std::sync::atomic::AtomicBool,
}

/// Called with a worker and the report of one batch some of whose stored events were skipped
/// for a cause the embedder counts and warns about: the engine's block size is not a multiple
/// of the index's (`block_size_mismatch`), their blocks carry extra keys no request's hashes
/// can name (`extra_keys`), or keys standing for content beside the tokens (`multimodal`);
/// also for a batch that stored engine hashes again with other content (`replaced`: the index
/// counted them, the embedder warns). Never called for a batch with none of these.
pub type MismatchHook = Arc<dyn Fn(&str, &ApplyReport) + Send + Sync>;

/// What a socket did, for [`SocketHook`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketReport<'a> {
    /// The workers whose events it carries (several on a shared bound endpoint).
    pub workers: Vec<&'a str>,
    /// Its endpoint as configured.
    pub endpoint: &'a str,
    /// `bind` or `connect`; `drop` for a peer connection the socket dropped (a protocol
    /// violation, a handshake that did not finish), the first of the endpoint only;
    /// `malformed` for an engine's first batch that does not decode (skipped, the worker
    /// resynchronised); `topic` for the first message on an engine's own socket whose topic is
    /// not the engine's (refused).
    pub action: &'static str,
    /// Why opening it failed (what the OS or ZMQ said), or why the peer was dropped; `None`:
    /// it opened after failing.
    pub error: Option<&'a str>,
}

/// Called (on the feed's thread) each time opening a socket fails, once when it opens after
/// failing, and for the first peer connection an endpoint drops: the embedder logs it (the
/// feed retries with its backoff either way; a drop does not make the socket failing).
pub type SocketHook = Arc<dyn Fn(&SocketReport<'_>) + Send + Sync>;

/// What the feed's tasks and its readers share.
struct Shared {
    index: Arc<PrefixIndex>,
    on_mismatch: Option<MismatchHook>,
    on_socket: Option<SocketHook>,
    options: KvOptions,
    members: Vec<Member>,
    by_worker: HashMap<String, usize>,
    groups: Vec<Group>,
    /// Counts no single engine owns (a shared socket's connections, foreign topics).
    extra: Mutex<Counts>,
    /// Bumped after every change of the counters (for [`KvFeed::wait_changed`]).
    generation: Mutex<u64>,
    changed: Condvar,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn touched(&self) {
        *lock(&self.generation) += 1;
        self.changed.notify_all();
    }
}

/// A running (or stopped) feed; dropping it stops it.
pub struct KvFeed {
    shared: Arc<Shared>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Whether a bound endpoint names its port (`tcp://*:5557`), not `*`.
fn fixed_port(endpoint: &str) -> bool {
    !endpoint.ends_with(":*")
}

/// Why an endpoint can never be bound (`bind`) or connected to by this feed, or `None`: the
/// rules of the Python side's `llmsched.integrations.identity.endpoint_problem`, for the one
/// transport the feed reads (`tcp://`). The host is `*`, an IPv4 address, an IPv6 address in
/// brackets or a host name (letters, digits, `-` and `_` in dot-separated labels); the port
/// is 1..65535 (0 or `*` to bind any free port); `*` is for binding only. Whether the host resolves, or the port is
/// free, is known only when the socket is opened (a failure then is reported and retried).
///
/// ```
/// use llmsched_gateway::kv_events::endpoint_problem;
/// assert_eq!(endpoint_problem("tcp://10.0.0.7:5557", false), None);
/// assert_eq!(endpoint_problem("tcp://*:*", true), None);
/// assert_eq!(
///     endpoint_problem("tcp://999.1.1.1:5", true).as_deref(),
///     Some("has an invalid host: '999.1.1.1' is not an IPv4 address")
/// );
/// ```
pub fn endpoint_problem(endpoint: &str, bind: bool) -> Option<String> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Some("is not tcp://: the native KV-event feed reads TCP only".into());
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Some("has no port".into());
    };
    if !bind && (host == "*" || port == "*") {
        return Some("is a wildcard: a socket that connects needs the engine's address".into());
    }
    if port != "*" {
        let lowest = u32::from(!bind);
        let valid = port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u32>().is_ok_and(|p| (lowest..=65535).contains(&p));
        if !valid {
            return Some(format!("has an invalid port: {port} is not in {lowest}..65535"));
        }
    }
    host_problem(host).map(|problem| format!("has an invalid host: {problem}"))
}

fn host_problem(host: &str) -> Option<String> {
    if host == "*" {
        return None; // any address (refused where the endpoint is connected to)
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        if inner.contains('%') {
            return Some(format!("'{host}' has a zone index, which the native feed cannot take"));
        }
        return match inner.parse::<std::net::Ipv6Addr>() {
            Ok(_) => None,
            Err(_) => Some(format!("'{host}' is not an IPv6 address")),
        };
    }
    if host.is_empty() {
        return Some("it is empty".into());
    }
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return match host.parse::<std::net::Ipv4Addr>() {
            Ok(_) => None,
            Err(_) => Some(format!("'{host}' is not an IPv4 address")),
        };
    }
    if host.contains([':', '[', ']']) {
        return Some(format!(
            "'{host}': an IPv6 address is written in brackets, as tcp://[::1]:5557"
        ));
    }
    let label = |l: &str| {
        let inner = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let bytes = l.as_bytes();
        (1..=63).contains(&bytes.len())
            && inner(bytes[0])
            && inner(bytes[bytes.len() - 1])
            && bytes.iter().all(|&b| inner(b) || b == b'-')
    };
    if host.len() > 253 || !host.split('.').all(label) {
        return Some(format!("'{host}' is not a host name"));
    }
    None
}

impl KvFeed {
    /// A feed of `engines` into `index` (worker names are the engines' `worker`); checked as
    /// the Python subscriber checks them, each endpoint by [`endpoint_problem`]. Not started.
    pub fn new(
        index: Arc<PrefixIndex>,
        engines: Vec<KvEngine>,
        options: KvOptions,
        on_mismatch: Option<MismatchHook>,
        on_socket: Option<SocketHook>,
    ) -> Result<KvFeed, String> {
        options.check()?;
        for engine in &engines {
            let checks = [
                ("kv_events", Some(&engine.endpoint), engine.bind),
                ("replay", engine.replay.as_ref(), false),
            ];
            for (key, endpoint, bind) in checks {
                let Some(endpoint) = endpoint else { continue };
                if let Some(problem) = endpoint_problem(endpoint, bind) {
                    return Err(format!("engine {}: {key} '{endpoint}' {problem}", engine.worker));
                }
            }
        }
        let mut binds: HashMap<&str, usize> = HashMap::new();
        for engine in engines.iter().filter(|e| e.bind && fixed_port(&e.endpoint)) {
            *binds.entry(engine.endpoint.as_str()).or_default() += 1;
        }
        let shared_endpoints: Vec<String> =
            binds.into_iter().filter(|(_, n)| *n > 1).map(|(e, _)| e.to_owned()).collect();
        let mut groups: Vec<Group> = shared_endpoints
            .iter()
            .map(|e| Group {
                endpoint: e.clone(),
                bind: true,
                members: Vec::new(),
                bound: Mutex::new(None),
                failure: Mutex::new(None),
                tried: Default::default(),
            })
            .collect();
        let shared_count = groups.len();
        let mut members = Vec::new();
        let mut by_worker = HashMap::new();
        let mut seen: HashMap<String, String> = HashMap::new();
        for engine in engines {
            if by_worker.contains_key(&engine.worker) {
                return Err(format!("engine {} is listed twice", engine.worker));
            }
            let at = members.len();
            let shared = engine
                .bind
                .then(|| groups[..shared_count].iter().position(|g| g.endpoint == engine.endpoint))
                .flatten();
            match shared {
                Some(g) => {
                    if engine.topic.is_empty() {
                        return Err(format!(
                            "engine {} binds the shared KV-event endpoint {} without a topic",
                            engine.worker, engine.endpoint
                        ));
                    }
                    let clash = groups[g].members.iter().find(|&&m| {
                        let other: &Member = &members[m];
                        other.spec.topic == engine.topic
                    });
                    if let Some(&other) = clash {
                        let other: &Member = &members[other];
                        return Err(format!(
                            "engines {} and {} bind the KV-event endpoint {} with the same topic",
                            other.spec.worker, engine.worker, engine.endpoint
                        ));
                    }
                    groups[g].members.push(at);
                }
                None => {
                    if let Some(other) =
                        seen.get(&engine.endpoint).filter(|_| !engine.endpoint.contains('*'))
                    {
                        return Err(format!(
                            "engines {other} and {} share the KV-event endpoint {}",
                            engine.worker, engine.endpoint
                        ));
                    }
                    seen.insert(engine.endpoint.clone(), engine.worker.clone());
                    groups.push(Group {
                        endpoint: engine.endpoint.clone(),
                        bind: engine.bind,
                        members: vec![at],
                        bound: Mutex::new(None),
                        failure: Mutex::new(None),
                        tried: Default::default(),
                    });
                }
            }
            by_worker.insert(engine.worker.clone(), at);
            members.push(Member {
                key: WorkerKey::Str(engine.worker.clone()),
                stream: Mutex::new(Stream::new(options.stream())),
                spec: engine,
            });
        }
        let shared = Shared {
            index,
            on_mismatch,
            on_socket,
            options,
            members,
            by_worker,
            groups,
            extra: Mutex::new(Counts::default()),
            generation: Mutex::new(0),
            changed: Condvar::new(),
        };
        Ok(KvFeed { shared: Arc::new(shared), stop: None, thread: None })
    }

    /// Starts the feed's thread; an error when it runs already or the thread cannot start.
    pub fn start(&mut self) -> Result<(), String> {
        if self.thread.is_some() {
            return Err("the subscriber is already running".into());
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the KV-event runtime: {e}"))?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let shared = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name("llmsched-kv-events".into())
            .spawn(move || {
                runtime.block_on(sockets::run(shared, stop_rx));
                // Every socket task is dropped with the runtime.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(|e| format!("cannot start the KV-event thread: {e}"))?;
        self.stop = Some(stop_tx);
        self.thread = Some(thread);
        // As the Python subscriber binds in `start`: a bound endpoint (or the failure to bind
        // it, counted) is known when this returns.
        let waiter = self.waiter();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut seen = 0;
        while self
            .shared
            .groups
            .iter()
            .any(|g| g.bind && !g.tried.load(std::sync::atomic::Ordering::Acquire))
        {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            seen = waiter.wait(seen, left.min(Duration::from_millis(50)));
        }
        Ok(())
    }

    /// Stops the thread and closes every socket. Idempotent.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for group in &self.shared.groups {
            *lock(&group.bound) = None;
            *lock(&group.failure) = None;
            group.tried.store(false, std::sync::atomic::Ordering::Release);
        }
        for member in &self.shared.members {
            lock(&member.stream).stopped();
        }
    }

    /// Whether the thread runs.
    pub fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Totals over every engine.
    pub fn counters(&self) -> Counts {
        let mut total = *lock(&self.shared.extra);
        for member in &self.shared.members {
            total.add(&lock(&member.stream).counts);
        }
        total
    }

    fn member(&self, worker: &str) -> Option<&Member> {
        self.shared.by_worker.get(worker).map(|&i| &self.shared.members[i])
    }

    /// One engine's counters (None: not subscribed).
    pub fn worker_counters(&self, worker: &str) -> Option<Counts> {
        self.member(worker).map(|m| lock(&m.stream).counts)
    }

    /// The sequence number of the last batch taken from `worker` (outer None: not subscribed).
    pub fn last_seq(&self, worker: &str) -> Option<Option<u64>> {
        self.member(worker).map(|m| lock(&m.stream).last_seq())
    }

    /// Where `worker`'s stream stands (None: not subscribed).
    pub fn worker_state(&self, worker: &str) -> Option<StreamState> {
        self.member(worker).map(|m| lock(&m.stream).state(crate::monotonic()))
    }

    /// The endpoint bound for `worker` (outer None: not subscribed; inner: not bound).
    pub fn bound_endpoint(&self, worker: &str) -> Option<Option<String>> {
        let at = *self.shared.by_worker.get(worker)?;
        let group = self.shared.groups.iter().find(|g| g.members.contains(&at))?;
        Some(lock(&group.bound).clone())
    }

    /// The sockets whose last attempt to open failed and that have not opened since: each
    /// one's endpoint (as configured) and what the OS or ZMQ said. Retried with the backoff.
    pub fn failing_sockets(&self) -> Vec<(String, String)> {
        self.shared
            .groups
            .iter()
            .filter_map(|g| lock(&g.failure).clone().map(|error| (g.endpoint.clone(), error)))
            .collect()
    }

    /// The subscribed workers, in the order given.
    pub fn workers(&self) -> Vec<String> {
        self.shared.members.iter().map(|m| m.spec.worker.clone()).collect()
    }

    /// A handle to wait for the counters to change with (without holding the feed).
    pub fn waiter(&self) -> Waiter {
        Waiter(self.shared.clone())
    }
}

/// Waits for a feed's counters to change (see [`KvFeed::waiter`]).
pub struct Waiter(Arc<Shared>);

impl Waiter {
    /// Waits until the counters change after generation `seen` (or `timeout` passes);
    /// returns the generation now.
    pub fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let generation = lock(&self.0.generation);
        let (generation, _) = self
            .0
            .changed
            .wait_timeout_while(generation, timeout, |g| *g <= seen)
            .unwrap_or_else(|e| e.into_inner());
        *generation
    }
}

impl Drop for KvFeed {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llmsched_core::prefix_index::IndexConfig;

    #[test]
    fn endpoints_that_can_never_work_are_named() {
        // The table of `tests/test_gateway_kv_endpoints.py`, which holds the Python side to the
        // same answers.
        for (endpoint, bind) in [
            ("tcp://10.0.0.7:5557", false),
            ("tcp://engine-a.default.svc:5557", false),
            ("tcp://[::1]:5557", false),
            ("tcp://*:5557", true),
            ("tcp://127.0.0.1:*", true),
            ("tcp://127.0.0.1:0", true),
            ("tcp://localhost:65535", false),
        ] {
            assert_eq!(endpoint_problem(endpoint, bind), None, "{endpoint}");
        }
        for (endpoint, bind, problem) in [
            ("tcp://999.1.1.1:5", true, "'999.1.1.1' is not an IPv4 address"),
            ("tcp://1.2.3:5", false, "'1.2.3' is not an IPv4 address"),
            ("tcp://127.0.0.1:70000", true, "70000 is not in 0..65535"),
            ("tcp://127.0.0.1:0", false, "0 is not in 1..65535"),
            ("tcp://127.0.0.1:x", true, "x is not in 0..65535"),
            ("tcp://127.0.0.1:-1", true, "-1 is not in 0..65535"),
            ("tcp://h", false, "has no port"),
            ("tcp://:5557", true, "it is empty"),
            ("tcp://host name:5557", true, "'host name' is not a host name"),
            ("tcp://-a.b:5557", true, "'-a.b' is not a host name"),
            ("tcp://::1:5557", false, "an IPv6 address is written in brackets"),
            ("tcp://[::g]:5557", false, "'[::g]' is not an IPv6 address"),
            ("tcp://[fe80::1%eth0]:5557", true, "has a zone index"),
            ("tcp://*:5557", false, "is a wildcard"),
            ("ipc:///tmp/kv", true, "the native KV-event feed reads TCP only"),
        ] {
            let found = endpoint_problem(endpoint, bind).unwrap_or_default();
            assert!(found.contains(problem), "{endpoint}: {found:?}");
        }
    }

    fn index() -> Arc<PrefixIndex> {
        Arc::new(PrefixIndex::new(IndexConfig { block_size: 4, ..Default::default() }).unwrap())
    }

    fn engine(worker: &str, endpoint: &str, bind: bool) -> KvEngine {
        KvEngine {
            worker: worker.into(),
            endpoint: endpoint.into(),
            bind,
            replay: None,
            topic: String::new(),
        }
    }

    #[test]
    fn a_feed_refuses_an_endpoint_that_can_never_work() {
        let bad = engine("a", "tcp://999.1.1.1:5", true);
        let problem = KvFeed::new(index(), vec![bad], KvOptions::default(), None, None)
            .err()
            .expect("refused");
        assert!(problem.starts_with("engine a: kv_events 'tcp://999.1.1.1:5' has an invalid host"));
        let replay =
            KvEngine { replay: Some("tcp://h:99999".into()), ..engine("b", "tcp://h:1", false) };
        let problem = KvFeed::new(index(), vec![replay], KvOptions::default(), None, None)
            .err()
            .expect("refused");
        assert!(problem.starts_with("engine b: replay 'tcp://h:99999' has an invalid port"));
    }

    #[test]
    fn a_bind_that_fails_is_retried_reported_and_listed_until_it_works() {
        let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://{}", busy.local_addr().unwrap());
        // (workers, endpoint, action, error) of each report.
        type Seen = (Vec<String>, String, &'static str, Option<String>);
        let reports: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let seen = reports.clone();
        let hook: SocketHook = Arc::new(move |r: &SocketReport<'_>| {
            let workers = r.workers.iter().map(|w| w.to_string()).collect();
            lock(&seen).push((workers, r.endpoint.into(), r.action, r.error.map(String::from)));
        });
        let options = KvOptions { backoff_s: (0.01, 0.05), ..KvOptions::default() };
        let engines = vec![engine("a", &endpoint, true)];
        let mut feed = KvFeed::new(index(), engines, options, None, Some(hook)).unwrap();
        feed.start().unwrap();
        // `start` returns once the first bind was tried: its failure is known.
        let failing = feed.failing_sockets();
        assert_eq!(failing.len(), 1);
        assert_eq!(failing[0].0, endpoint);
        assert!(failing[0].1.contains("os error"), "{failing:?}");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while feed.counters().get(Counter::SocketErrors) < 3 {
            assert!(std::time::Instant::now() < deadline, "not retried");
            std::thread::sleep(Duration::from_millis(10));
        }
        {
            let reports = lock(&reports);
            let first = &reports[0];
            assert_eq!(
                (&first.0[..], &first.1[..], first.2),
                (&["a".to_string()][..], &endpoint[..], "bind")
            );
            assert!(first.3.as_deref().is_some_and(|e| e.contains("in use")), "{first:?}");
            assert!(reports.iter().all(|r| r.3.is_some()), "no success while the port is taken");
        }
        drop(busy);
        while feed.bound_endpoint("a") != Some(Some(endpoint.clone())) {
            assert!(std::time::Instant::now() < deadline, "never bound");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(feed.failing_sockets().is_empty());
        assert_eq!(lock(&reports).last().map(|r| r.3.clone()), Some(None), "success reported");
        feed.stop();
    }
}
