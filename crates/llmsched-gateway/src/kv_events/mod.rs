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

use llmsched_core::prefix_index::{PrefixIndex, WorkerKey};
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
    /// Whether its first attempt to open (bind) was made ([`KvFeed::start`] waits for it).
    tried: std::sync::atomic::AtomicBool,
}

/// Called with a worker and the stored events of one batch skipped because the engine's
/// block size is not a multiple of the index's (a misconfiguration the embedder warns about;
/// never called while the sizes agree).
pub type MismatchHook = Arc<dyn Fn(&str, u64) + Send + Sync>;

/// What the feed's tasks and its readers share.
struct Shared {
    index: Arc<PrefixIndex>,
    on_mismatch: Option<MismatchHook>,
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

impl KvFeed {
    /// A feed of `engines` into `index` (worker names are the engines' `worker`); checked as
    /// the Python subscriber checks them. Not started.
    pub fn new(
        index: Arc<PrefixIndex>,
        engines: Vec<KvEngine>,
        options: KvOptions,
        on_mismatch: Option<MismatchHook>,
    ) -> Result<KvFeed, String> {
        options.check()?;
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
