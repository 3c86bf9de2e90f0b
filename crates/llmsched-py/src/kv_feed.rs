//! `NativeKVEventSubscriber`: the native KV-event feed (`llmsched_gateway::kv_events`) on its
//! own thread, feeding a `PrefixIndex` with no Python per batch. `llmsched.integrations.
//! NativeKVEventSubscriber` wraps it (checks, `wait_for`).

use std::sync::Arc;
use std::time::Duration;

use llmsched_core::prefix_index::ApplyReport;
use llmsched_gateway::kv_events::{
    Counts, KvEngine, KvFeed, KvOptions, MismatchHook, SocketHook, SocketReport,
};
use parking_lot::Mutex;
use pyo3::exceptions::{PyKeyError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{detach, ConfigError};
use crate::prefix_index::PyPrefixIndex;

/// The native feed of one set of engines.
#[pyclass(frozen, module = "llmsched._llmsched", name = "NativeKVEventSubscriber")]
pub struct PyKvFeed {
    feed: Mutex<KvFeed>,
}

fn counts_dict<'py>(py: Python<'py>, counts: &Counts) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (name, value) in counts.named() {
        out.set_item(name, value)?;
    }
    Ok(out)
}

fn unknown(worker: &str) -> PyErr {
    PyKeyError::new_err(format!("no engine with worker id {worker:?} is subscribed"))
}

#[pymethods]
impl PyKvFeed {
    /// A feed into `index` of `engines` (`(worker, endpoint, bind, replay, topic)` tuples)
    /// with `options` (JSON of `llmsched_gateway::kv_events::KvOptions`); `on_mismatch(worker,
    /// block_size_mismatch, extra_keys, multimodal, replaced)` is called, with the GIL, for a
    /// batch whose stored events were skipped for their block size, for extra keys no request
    /// names or for keys standing for content, or that stored engine hashes again with other
    /// content (the counts of each; never for a batch with none); `on_socket(workers, endpoint, action,
    /// error)` each time opening a socket fails (`action` `bind` or `connect`, `error` what
    /// the OS or ZMQ said), once when it opens after failing (`error` None), and for the first
    /// peer connection an endpoint drops (`action` `drop`, `error` why), and for an engine's
    /// first malformed batch (`action` `malformed`, `error` what was skipped). ConfigError naming
    /// the problem.
    #[new]
    #[pyo3(signature = (index, engines, options, on_mismatch=None, on_socket=None))]
    fn new(
        index: &Bound<'_, PyPrefixIndex>,
        engines: Vec<(String, String, bool, Option<String>, String)>,
        options: &str,
        on_mismatch: Option<Py<PyAny>>,
        on_socket: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let options: KvOptions = serde_json::from_str(options)
            .map_err(|e| ConfigError::new_err(format!("KV-event feed options: {e}")))?;
        let engines = engines
            .into_iter()
            .map(|(worker, endpoint, bind, replay, topic)| KvEngine {
                worker,
                endpoint,
                bind,
                replay,
                topic,
            })
            .collect();
        let hook = on_mismatch.map(|callable| {
            Arc::new(move |worker: &str, report: &ApplyReport| {
                let counts = (
                    report.block_size_mismatch,
                    report.extra_keys,
                    report.multimodal,
                    report.replaced,
                );
                Python::attach(|py| {
                    // A failing warning must not stop the feed.
                    let _ = callable.call1(py, (worker, counts.0, counts.1, counts.2, counts.3));
                });
            }) as MismatchHook
        });
        let socket_hook = on_socket.map(|callable| {
            Arc::new(move |report: &SocketReport<'_>| {
                Python::attach(|py| {
                    // A failing log call must not stop the feed.
                    let args =
                        (report.workers.clone(), report.endpoint, report.action, report.error);
                    let _ = callable.call1(py, args);
                });
            }) as SocketHook
        });
        let index = index.get().inner.clone();
        let feed = KvFeed::new(index, engines, options, hook, socket_hook)
            .map_err(ConfigError::new_err)?;
        Ok(PyKvFeed { feed: Mutex::new(feed) })
    }

    /// Starts the feed's thread (RuntimeError when it runs already).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let started = detach(py, || self.feed.lock().start())?;
        started.map_err(PyRuntimeError::new_err)
    }

    /// Stops the thread and closes every socket.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        detach(py, || self.feed.lock().stop())
    }

    /// Whether the thread runs.
    #[getter]
    fn running(&self) -> bool {
        self.feed.lock().running()
    }

    /// Totals over every engine.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = detach(py, || self.feed.lock().counters())?;
        counts_dict(py, &counts)
    }

    /// One engine's counters (KeyError: not subscribed).
    fn worker_counters<'py>(&self, py: Python<'py>, worker: &str) -> PyResult<Bound<'py, PyDict>> {
        let counts = detach(py, || self.feed.lock().worker_counters(worker))?;
        counts_dict(py, &counts.ok_or_else(|| unknown(worker))?)
    }

    /// The last sequence number taken from `worker` (None before any; KeyError: not
    /// subscribed).
    fn last_seq(&self, py: Python<'_>, worker: &str) -> PyResult<Option<u64>> {
        detach(py, || self.feed.lock().last_seq(worker))?.ok_or_else(|| unknown(worker))
    }

    /// Where `worker`'s stream stands (`KVEventSubscriber.worker_state`'s keys).
    fn worker_state<'py>(&self, py: Python<'py>, worker: &str) -> PyResult<Bound<'py, PyDict>> {
        let state =
            detach(py, || self.feed.lock().worker_state(worker))?.ok_or_else(|| unknown(worker))?;
        let out = PyDict::new(py);
        out.set_item("next_seq", state.next_seq)?;
        out.set_item("highest_seq", state.highest_seq)?;
        out.set_item("held", state.held)?;
        out.set_item("held_bytes", state.held_bytes)?;
        out.set_item("held_peak", state.held_peak)?;
        out.set_item("replaying", state.replaying)?;
        out.set_item("replay_backoff_s", state.replay_backoff_s)?;
        Ok(out)
    }

    /// The endpoint bound for `worker` once bound (None: not bound, or connecting).
    fn bound_endpoint(&self, py: Python<'_>, worker: &str) -> PyResult<Option<String>> {
        detach(py, || self.feed.lock().bound_endpoint(worker))?.ok_or_else(|| unknown(worker))
    }

    /// The sockets failing to open now: `(endpoint, error)` each.
    fn failing_sockets(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        detach(py, || self.feed.lock().failing_sockets())
    }

    /// The subscribed workers.
    fn workers(&self) -> Vec<String> {
        self.feed.lock().workers()
    }

    /// Waits (the GIL released) until the counters change after generation `seen`, or
    /// `timeout_s` passes; returns the generation now.
    fn wait_changed(&self, py: Python<'_>, seen: u64, timeout_s: f64) -> PyResult<u64> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::MAX);
        // Not under the feed's lock: `stop` and the readers go on meanwhile.
        let feed = &self.feed;
        detach(py, || {
            let waiter = feed.lock().waiter();
            waiter.wait(seen, timeout)
        })
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvFeed>()
}
