//! Bindings for `llmsched_core::routing::replica_sync`: one router replica's end of the sync.
//! `llmsched.cluster` carries the bytes over the message bus.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{detach, CoreResult};
use crate::routing::PyRouter;
use llmsched_core::routing::replica_sync::{IncomingReport, ReplicaSync, SyncOptions};

/// The native replica sync; `llmsched.cluster.ClusterSync` drives it.
#[pyclass(frozen, module = "llmsched._llmsched", name = "ReplicaSync")]
pub struct PyReplicaSync {
    inner: ReplicaSync,
    router: Py<PyRouter>,
}

fn report_dict<'py>(py: Python<'py>, r: &IncomingReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("own", r.own)?;
    d.set_item("duplicate", r.duplicate)?;
    d.set_item("missed", r.missed)?;
    d.set_item("records", r.records)?;
    d.set_item("sessions", r.sessions)?;
    d.set_item("unknown_endpoints", r.unknown_endpoints)?;
    d.set_item("records_mismatched", r.records_mismatched)?;
    d.set_item("records_refused", r.records_refused)?;
    d.set_item("identity_conflict", r.identity_conflict)?;
    d.set_item("stale", r.stale)?;
    d.set_item("behind", r.behind)?;
    Ok(d)
}

impl PyReplicaSync {
    /// The index learns the Python names of endpoints it first hears of through a peer.
    fn remember_endpoints(&self, py: Python<'_>) -> PyResult<()> {
        let router = self.router.get();
        let index = router.index.get();
        for m in &router.inner.pool().snapshot().list {
            index.remember_key(py, &m.endpoint.id)?;
        }
        Ok(())
    }
}

#[pymethods]
impl PyReplicaSync {
    #[new]
    #[pyo3(signature = (router, replica, incarnation, journal_limit, load_ttl, history_limit))]
    fn new(
        router: Py<PyRouter>,
        replica: String,
        incarnation: u64,
        journal_limit: usize,
        load_ttl: f64,
        history_limit: usize,
    ) -> Self {
        let options = SyncOptions { journal_limit, load_ttl, history_limit };
        let inner = router.get().inner.replica_sync(replica, incarnation, options);
        PyReplicaSync { inner, router }
    }

    #[getter]
    fn replica(&self) -> &str {
        self.inner.replica()
    }

    #[pyo3(signature = (now, heartbeat, max_bytes))]
    fn outgoing<'py>(
        &self,
        py: Python<'py>,
        now: f64,
        heartbeat: bool,
        max_bytes: usize,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let out = detach(py, || self.inner.outgoing_split(now, heartbeat, max_bytes))?;
        Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    fn incoming<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        now: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let report = detach(py, || self.inner.incoming(data, now))?.py()?;
        if report.records > 0 || report.sessions > 0 {
            self.remember_endpoints(py)?;
        }
        report_dict(py, &report)
    }

    fn apply_catch_up<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        now: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let report = detach(py, || self.inner.apply_catch_up(data, now))?.py()?;
        self.remember_endpoints(py)?;
        report_dict(py, &report)
    }

    #[pyo3(signature = (now, max_bytes, request=None))]
    fn catch_up<'py>(
        &self,
        py: Python<'py>,
        now: f64,
        max_bytes: usize,
        request: Option<&[u8]>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let batches = detach(py, || match request {
            Some(request) => self.inner.answer(request, now, max_bytes),
            None => self.inner.catch_up(now, max_bytes),
        })?;
        Ok(batches.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    fn catch_up_request<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let request = detach(py, || self.inner.catch_up_request())?;
        Ok(PyBytes::new(py, &request))
    }

    fn request_to<'py>(
        &self,
        py: Python<'py>,
        replica: &str,
        incarnation: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let request = detach(py, || self.inner.request_to(replica, incarnation))?;
        Ok(PyBytes::new(py, &request))
    }

    /// `(replica, incarnation, request)` per peer to ask for a gap in its batches.
    #[allow(clippy::type_complexity)]
    fn repair_requests<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(String, u64, Bound<'py, PyBytes>)>> {
        let requests = detach(py, || self.inner.repair_requests_to())?;
        Ok(requests.into_iter().map(|((n, i), b)| (n, i, PyBytes::new(py, &b))).collect())
    }

    fn repair_unanswered(&self, py: Python<'_>, replica: &str, incarnation: u64) -> PyResult<bool> {
        detach(py, || self.inner.repair_unanswered(replica, incarnation))
    }

    fn peer_ids(&self) -> Vec<(String, u64)> {
        self.inner.peer_ids()
    }

    fn expire(&self, py: Python<'_>, now: f64) -> PyResult<usize> {
        detach(py, || self.inner.expire(now))
    }

    fn peers(&self) -> Vec<String> {
        self.inner.peers()
    }

    fn shared_names(&self) -> Vec<String> {
        self.inner.shared_names()
    }

    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        let d = PyDict::new(py);
        for (name, value) in [
            ("batches_out", c.batches_out),
            ("bytes_out", c.bytes_out),
            ("entries_out", c.entries_out),
            ("skipped_out", c.skipped_out),
            ("journal_dropped", c.journal_dropped),
            ("batches_in", c.batches_in),
            ("bytes_in", c.bytes_in),
            ("own_in", c.own_in),
            ("duplicates_in", c.duplicates_in),
            ("missed_in", c.missed_in),
            ("malformed_in", c.malformed_in),
            ("records_applied", c.records_applied),
            ("sessions_applied", c.sessions_applied),
            ("unknown_endpoints", c.unknown_endpoints),
            ("mismatched_in", c.mismatched_in),
            ("records_mismatched", c.records_mismatched),
            ("records_refused", c.records_refused),
            ("replicas_expired", c.replicas_expired),
            ("identity_conflicts", c.identity_conflicts),
            ("stale_in", c.stale_in),
            ("catch_up_batches_out", c.catch_up_batches_out),
            ("catch_up_bytes_out", c.catch_up_bytes_out),
            ("catch_up_entries_out", c.catch_up_entries_out),
            ("repairs_asked", c.repairs_asked),
            ("repairs_unanswered", c.repairs_unanswered),
            ("tables_asked", c.tables_asked),
        ] {
            d.set_item(name, value)?;
        }
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyReplicaSync>()
}
