//! Bindings for `llmsched_core::prefix_index`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::errors::{detach, detach_if, CoreResult, InvalidTypeError, InvalidValueError};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use super::tokens::{TokenArray, TokenVisitor, DETACH_MIN_TOKENS};
use crate::pyints;
use llmsched_core::buffer_pool::{self, BufferPool};
use llmsched_core::hashing::{self, TokenId};
use llmsched_core::prefix_index::{
    ApplyReport, IndexConfig, IndexError, MatchResult, PrefixIndex, Tier, WorkerId, WorkerKey,
};

/// Block hashes from Python: a borrowed `uint64` array, or the ints of a list or tuple.
pub enum Hashes<'py> {
    Array(PyReadonlyArray1<'py, u64>),
    Owned(Vec<u64>),
}

impl<'py> Hashes<'py> {
    /// Reads `obj`: a 1-D contiguous `uint64` array in place, a list or tuple of ints in
    /// `0..2**64-1` in one native pass; anything else (and a list the native reader refuses)
    /// through `llmsched.prefix_index.as_hash_array`, which converts it or raises the precise
    /// error.
    pub fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
            let mut out = buffer_pool::take(&HASH_BUFFERS);
            if pyints::read_ints(obj, u64::MAX, &mut out) {
                return Ok(Self::Owned(out));
            }
            buffer_pool::give(&HASH_BUFFERS, out);
        } else if let Ok(arr) = obj.extract::<PyReadonlyArray1<'py, u64>>() {
            if arr.is_c_contiguous() && aligned(arr.data()) {
                return Ok(Self::Array(arr));
            }
        } else if let Ok(arr) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
            // Hashes kept as int64 (numpy's and pandas' default integer): checked and copied
            // here, a match of 2,000 took 1.4 us against 9.2 us through numpy's comparison and
            // cast in `as_hash_array`. A negative value takes that general path, which names it.
            if let Ok(signed) = arr.as_slice() {
                if signed.iter().all(|&h| h >= 0) {
                    let mut out = buffer_pool::take(&HASH_BUFFERS);
                    out.extend(signed.iter().map(|&h| h as u64));
                    return Ok(Self::Owned(out));
                }
            }
        }
        let general = obj.py().import("llmsched.prefix_index")?.getattr("as_hash_array")?;
        let arr = general.call1((obj,))?;
        Ok(Self::Array(arr.extract()?))
    }

    pub fn as_slice(&self) -> PyResult<&[u64]> {
        match self {
            Self::Array(a) => Ok(a.as_slice()?),
            Self::Owned(v) => Ok(v),
        }
    }
}

impl Drop for Hashes<'_> {
    fn drop(&mut self) {
        if let Self::Owned(hashes) = self {
            buffer_pool::give(&HASH_BUFFERS, std::mem::take(hashes));
        }
    }
}

thread_local! {
    /// Buffers of lists of hashes read by [`Hashes::extract`], kept between calls: a query's
    /// hundreds of hashes are kilobytes, beyond the allocator's small-size caches.
    static HASH_BUFFERS: BufferPool<u64> = const { BufferPool::new(4, 1 << 16) };
}

/// Whether a numpy array's data can be read as a `&[u64]` (an array over a buffer at an odd
/// offset cannot; `as_hash_array` copies it).
fn aligned(data: *const u64) -> bool {
    data as usize % std::mem::align_of::<u64>() == 0
}

/// Queries, and stores, records and removals, of fewer blocks than this run without releasing
/// the GIL: a microsecond to a millisecond of work, where handing the GIL over and back costs
/// more, and getting it back from a thread running Python waits out that thread's switch
/// interval (5 ms by default; see [`DETACH_MIN_PAYLOAD_BYTES`]).
const DETACH_MIN_BLOCKS: usize = 4096;

/// Event payloads shorter than this are applied without releasing the GIL (about 250 blocks of
/// 64 ids, some 60 us of work; an engine's payload is usually far smaller). Getting the GIL back
/// after releasing it waits, while another thread runs Python, for that thread's switch
/// interval (5 ms by default): one-block payloads took 1.7 ms each beside a busy Python thread
/// when every call released it, 1.2 us with the GIL kept.
const DETACH_MIN_PAYLOAD_BYTES: usize = 64 << 10;

/// Matches `hashes`, releasing the GIL only for long queries: a match of a few thousand blocks
/// takes a microsecond or two, whatever the number of workers, and handing the GIL over and back
/// costs more than that when threads contend (two threads releasing it per call measured 0.3x
/// one).
fn match_short(
    py: Python<'_>,
    index: &PrefixIndex,
    hashes: &[u64],
    now: f64,
) -> PyResult<MatchResult> {
    detach_if(py, hashes.len() >= DETACH_MIN_BLOCKS, || index.match_hashes(hashes, now))
}

/// A worker name from Python: an int or a str.
pub fn worker_key(obj: &Bound<'_, PyAny>) -> PyResult<WorkerKey> {
    id_key(obj, "worker")
}

/// An id from Python (a worker, an endpoint): an int or a str; errors name it `what`.
pub fn id_key(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<WorkerKey> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(InvalidTypeError::new_err(format!("{what} must be an int or a str, got bool")));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        let name = s.to_str().map_err(|_| {
            InvalidValueError::new_err(format!(
                "{what} names must be valid UTF-8 (no lone surrogates)"
            ))
        })?;
        return Ok(WorkerKey::Str(name.to_owned()));
    }
    match obj.extract::<i64>() {
        Ok(i) => Ok(WorkerKey::Int(i)),
        Err(_) if obj.is_instance_of::<pyo3::types::PyInt>() => Err(InvalidValueError::new_err(
            format!("{what} ids that are ints must fit in 64 bits (signed), got {obj}"),
        )),
        Err(_) => Err(InvalidTypeError::new_err(format!(
            "{what} must be an int (64-bit) or a str, got {}",
            obj.get_type().name()?
        ))),
    }
}

fn tier(name: &str) -> PyResult<Tier> {
    Tier::parse(name).ok_or_else(|| {
        InvalidValueError::new_err(format!(
            "unknown tier {name:?}: expected 'gpu', 'cpu' or 'storage'"
        ))
    })
}

/// Python names of interned workers, by id, so results do not rebuild strings.
#[derive(Default)]
struct Names(RwLock<Vec<Option<Py<PyAny>>>>);

impl Names {
    fn remember(&self, id: WorkerId, name: Py<PyAny>) {
        let mut names = self.0.write();
        if names.len() <= id as usize {
            names.resize_with(id as usize + 1, || None);
        }
        names[id as usize] = Some(name);
    }

    /// The Python name of worker `id`: the one remembered, else its key in `index` (a worker
    /// another component registered without naming it here: the native gateway's records),
    /// remembered from then on; None for an id the core does not know.
    fn name(&self, py: Python<'_>, index: &PrefixIndex, id: WorkerId) -> Py<PyAny> {
        if let Some(Some(n)) = self.0.read().get(id as usize) {
            return n.clone_ref(py);
        }
        let Some(key) = index.worker_key(id) else { return py.None() };
        let obj = match &key {
            WorkerKey::Int(i) => i.into_pyobject(py).map(|o| o.into_any().unbind()),
            WorkerKey::Str(s) => s.into_pyobject(py).map(|o| o.into_any().unbind()),
        };
        match obj {
            Ok(obj) => {
                self.remember(id, obj.clone_ref(py));
                obj
            }
            Err(_) => py.None(),
        }
    }
}

/// What a match result needs of its index (the core, to look workers up, and the names), held
/// by one small object per thread.
///
/// Why not the index itself: on free-threaded CPython, taking a reference to an object another
/// thread made is an atomic update of its reference count, so two threads whose results each
/// referenced the one index passed its count's cache line between their cores on every match
/// (after the lock, the largest cost two threads shared). A handle made by the calling thread
/// is counted by that thread alone, without atomics; a result dropped on another thread still
/// counts correctly, atomically.
#[pyclass(frozen, module = "llmsched._llmsched", name = "_IndexHandle")]
struct IndexHandle {
    inner: Arc<PrefixIndex>,
    names: Arc<Names>,
}

/// Handles per index: threads take slots in turn, so beyond this many threads two share one
/// (still correct, one of them counting atomically).
const HANDLE_SLOTS: usize = 16;

static NEXT_HANDLE_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static HANDLE_SLOT: usize = NEXT_HANDLE_SLOT.fetch_add(1, Ordering::Relaxed) % HANDLE_SLOTS;
}

/// The native prefix index; `llmsched.PrefixIndex` wraps it.
#[pyclass(frozen, module = "llmsched._llmsched", name = "PrefixIndex")]
pub struct PyPrefixIndex {
    pub inner: Arc<PrefixIndex>,
    names: Arc<Names>,
    /// Each thread's handle for its results (see [`IndexHandle`]), made at its first match.
    handles: [PyOnceLock<Py<IndexHandle>>; HANDLE_SLOTS],
}

impl PyPrefixIndex {
    fn wrap(py: Python<'_>, inner: PrefixIndex) -> PyResult<Self> {
        let this = PyPrefixIndex {
            inner: Arc::new(inner),
            names: Arc::default(),
            handles: std::array::from_fn(|_| PyOnceLock::new()),
        };
        for (id, key) in this.inner.workers() {
            let obj = match key {
                WorkerKey::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
                WorkerKey::Str(s) => s.into_pyobject(py)?.into_any().unbind(),
            };
            this.names.remember(id, obj);
        }
        Ok(this)
    }

    /// This thread's handle (see [`IndexHandle`]), made on its first call.
    fn handle(slf: &Bound<'_, Self>) -> PyResult<Py<IndexHandle>> {
        let (this, py) = (slf.get(), slf.py());
        let slot = &this.handles[HANDLE_SLOT.with(|s| *s)];
        if let Some(h) = slot.get(py) {
            return Ok(h.clone_ref(py));
        }
        share(slf);
        let handle = IndexHandle { inner: Arc::clone(&this.inner), names: Arc::clone(&this.names) };
        let made = Py::new(py, handle)?;
        Ok(slot.get_or_init(py, || made).clone_ref(py))
    }

    /// Remembers the Python name (an int or a str) of a worker another component registered.
    pub fn remember_key(&self, py: Python<'_>, key: &WorkerKey) -> PyResult<()> {
        let obj = match key {
            WorkerKey::Int(i) => i.into_pyobject(py)?.into_any(),
            WorkerKey::Str(s) => s.into_pyobject(py)?.into_any(),
        };
        self.remember_name(&obj, key);
        Ok(())
    }

    /// Remembers the Python name of `worker` once the core has registered it.
    fn remember_name(&self, worker: &Bound<'_, PyAny>, key: &WorkerKey) {
        let Some(id) = self.inner.worker_id(key) else { return };
        let known = self.names.0.read().get(id as usize).is_some_and(|n| n.is_some());
        if !known {
            self.names.remember(id, worker.clone().unbind());
        }
    }

    /// The Python name of worker `id` (see [`Names::name`]).
    fn name(&self, py: Python<'_>, id: WorkerId) -> Py<PyAny> {
        self.names.name(py, &self.inner, id)
    }
}

/// A match result that keeps what it needs of the index alive (this thread's handle) to name
/// its workers when, and only when, they are read.
fn result(slf: &Bound<'_, PyPrefixIndex>, m: MatchResult) -> PyResult<PyMatch> {
    Ok(PyMatch { m, index: PyPrefixIndex::handle(slf)? })
}

/// Lets threads other than the one that made the index take references to it without a lock,
/// on free-threaded CPython (a no-op elsewhere).
///
/// Why: a thread that does not own an object takes a reference (as the Python wrapper's
/// `self._native` does on every call) by incrementing its shared count, which CPython refuses
/// while that count is zero, as it is whenever the owner holds every reference; the load then
/// falls back to locking the object holding the attribute, and two threads matching at once
/// queued on that lock (`sched_yield` and context switches in the profile).
fn share(slf: &Bound<'_, PyPrefixIndex>) {
    #[cfg(all(Py_GIL_DISABLED, Py_3_14, not(Py_LIMITED_API)))]
    // SAFETY: `slf` is a live object; CPython makes the change with an atomic update.
    unsafe {
        pyo3::ffi::PyUnstable_EnableTryIncRef(slf.as_ptr());
    }
    defer_refcount(slf.as_any());
}

#[cfg(all(Py_GIL_DISABLED, Py_3_14, not(Py_LIMITED_API)))]
extern "C" {
    // CPython 3.14's unstable API; PyO3 0.30's ffi does not declare it.
    fn PyUnstable_Object_EnableDeferredRefcount(op: *mut pyo3::ffi::PyObject) -> std::ffi::c_int;
}

/// Deferred reference counting for an object that threads share for as long as it lives (the
/// index, its Python wrapper), on free-threaded CPython 3.14 (a no-op elsewhere).
///
/// Why: every call that loads the object (`self._native`, an `index` attribute or closure
/// variable) otherwise adds and drops a reference, an atomic update of its shared count from
/// any thread but the one that made it, and two threads matching at once passed that count's
/// cache line between their cores twice per match. The interpreter does not count references
/// from its own stack to a deferred object. The cost: such an object is freed by the cyclic
/// collector (its next pass), not when its last reference goes.
fn defer_refcount(obj: &Bound<'_, PyAny>) {
    #[cfg(all(Py_GIL_DISABLED, Py_3_14, not(Py_LIMITED_API)))]
    // SAFETY: `obj` is a live object; CPython checks that its type is tracked by the collector
    // (else it does nothing) and makes the change with atomic updates.
    unsafe {
        PyUnstable_Object_EnableDeferredRefcount(obj.as_ptr());
    }
    #[cfg(not(all(Py_GIL_DISABLED, Py_3_14, not(Py_LIMITED_API))))]
    let _ = obj;
}

/// `_share_between_threads(obj)`: [`defer_refcount`] from Python, for the wrapper of the index
/// (`llmsched.PrefixIndex`), which every match loads too.
#[pyfunction]
#[pyo3(name = "_share_between_threads")]
fn share_between_threads(obj: &Bound<'_, PyAny>) {
    defer_refcount(obj);
}

struct MatchTokens<'a> {
    index: &'a PrefixIndex,
    lora: Option<&'a str>,
    cache_salt: Option<&'a str>,
    now: f64,
}

impl TokenVisitor for MatchTokens<'_> {
    type Output = Result<MatchResult, IndexError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        self.index.match_tokens(tokens, self.lora, self.cache_salt, self.now)
    }
}

/// The block hashes of `tokens` when it is a list the native reader takes, hashed block by block
/// while the list is read; None when it needs the general path (a tuple, an array, any element
/// the reader refuses).
fn hash_token_list(
    index: &PrefixIndex,
    tokens: &Bound<'_, PyAny>,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> Option<Vec<u64>> {
    let list = tokens.cast::<PyList>().ok()?;
    let block_size = index.config().block_size;
    let mut hashes = Vec::with_capacity(list.len() / block_size);
    let mut prev = index.chain_seed(lora, cache_salt);
    let mut buf = Vec::new();
    let read = pyints::read_token_blocks(tokens, block_size, &mut buf, |block| {
        prev = hashing::hash_block(block, prev);
        hashes.push(prev);
    });
    read.then_some(hashes)
}

struct HashTokens<'a> {
    index: &'a PrefixIndex,
    lora: Option<&'a str>,
    cache_salt: Option<&'a str>,
}

impl TokenVisitor for HashTokens<'_> {
    type Output = Result<Vec<u64>, IndexError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        self.index.hash_tokens(tokens, self.lora, self.cache_salt)
    }
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (block_size, seed, model, worker_capacity, max_bytes))]
    fn new(
        py: Python<'_>,
        block_size: usize,
        seed: u64,
        model: Option<String>,
        worker_capacity: Option<u64>,
        max_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let config = IndexConfig { block_size, seed, model, worker_capacity, max_bytes };
        Self::wrap(py, PrefixIndex::new(config).py()?)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.config().seed
    }

    #[getter]
    fn model(&self) -> Option<String> {
        self.inner.config().model.clone()
    }

    #[getter]
    fn worker_capacity(&self) -> Option<u64> {
        self.inner.config().worker_capacity
    }

    #[getter]
    fn max_bytes(&self) -> Option<u64> {
        self.inner.config().max_bytes
    }

    fn store(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        parent: Option<u64>,
        tier_name: &str,
    ) -> PyResult<u64> {
        let key = worker_key(worker)?;
        let t = tier(tier_name)?;
        let hashes = Hashes::extract(hashes)?;
        let hashes = hashes.as_slice()?;
        let long = hashes.len() >= DETACH_MIN_BLOCKS;
        let added = detach_if(py, long, || self.inner.store(&key, hashes, parent, t))?.py()?;
        self.remember_name(worker, &key);
        Ok(added)
    }

    fn record(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        ttl: f64,
        now: f64,
    ) -> PyResult<u64> {
        let key = worker_key(worker)?;
        let hashes = Hashes::extract(hashes)?;
        let hashes = hashes.as_slice()?;
        let long = hashes.len() >= DETACH_MIN_BLOCKS;
        let added = detach_if(py, long, || self.inner.record(&key, hashes, ttl, now))?.py()?;
        self.remember_name(worker, &key);
        Ok(added)
    }

    #[pyo3(signature = (worker, hashes, tier_name=None))]
    fn remove(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        tier_name: Option<&str>,
    ) -> PyResult<u64> {
        let key = worker_key(worker)?;
        let t = tier_name.map(tier).transpose()?;
        let hashes = Hashes::extract(hashes)?;
        let hashes = hashes.as_slice()?;
        let long = hashes.len() >= DETACH_MIN_BLOCKS;
        detach_if(py, long, || self.inner.remove(&key, hashes, t))?.py()
    }

    fn clear(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        let key = worker_key(worker)?;
        detach(py, || self.inner.clear(&key))?.py()
    }

    fn remove_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        let key = worker_key(worker)?;
        detach(py, || self.inner.remove_worker(&key))?.py()
    }

    fn set_capacity(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        blocks: Option<u64>,
    ) -> PyResult<u64> {
        let key = worker_key(worker)?;
        let evicted = detach(py, || self.inner.set_capacity(&key, blocks))?.py()?;
        self.remember_name(worker, &key);
        Ok(evicted)
    }

    fn match_hashes(
        slf: &Bound<'_, Self>,
        hashes: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<PyMatch> {
        let this = slf.get();
        if let Ok(arr) = hashes.cast::<PyArray1<u64>>() {
            if arr.is_c_contiguous() && aligned(arr.data()) && arr.len() < DETACH_MIN_BLOCKS {
                // SAFETY: the GIL is held from here to the end of the match and no Python code
                // runs meanwhile, so no Python thread can write the array while it is read; the
                // short match keeps the GIL anyway (see below), and skipping numpy's borrow
                // registry saves a fifth of a short match. Free-threaded, another thread may
                // write the array meanwhile (numpy's registry would not stop it either: it sees
                // only Rust borrows): this query then reads some old and some new hashes, as
                // any numpy reader racing a writer does; the array, referenced here, keeps its
                // buffer for the whole read.
                let slice = unsafe { arr.as_slice() }?;
                return result(slf, this.inner.match_hashes(slice, now));
            }
        }
        let hashes = Hashes::extract(hashes)?;
        let hashes = hashes.as_slice()?;
        result(slf, match_short(slf.py(), &this.inner, hashes, now)?)
    }

    #[pyo3(signature = (tokens, lora, cache_salt, now))]
    fn match_tokens(
        slf: &Bound<'_, Self>,
        tokens: &Bound<'_, PyAny>,
        lora: Option<&str>,
        cache_salt: Option<&str>,
        now: f64,
    ) -> PyResult<PyMatch> {
        let index = &slf.get().inner;
        if let Some(hashes) = hash_token_list(index, tokens, lora, cache_salt) {
            return result(slf, match_short(slf.py(), index, &hashes, now)?);
        }
        let tokens = TokenArray::extract(tokens, "tokens")?;
        let visitor = MatchTokens { index: &slf.get().inner, lora, cache_salt, now };
        let m = tokens.visit(slf.py(), visitor, DETACH_MIN_TOKENS)?.py()?;
        result(slf, m)
    }

    #[pyo3(signature = (tokens, lora, cache_salt))]
    fn hash_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        if let Some(hashes) = hash_token_list(&self.inner, tokens, lora, cache_salt) {
            return Ok(hashes.into_pyarray(py));
        }
        let tokens = TokenArray::extract(tokens, "tokens")?;
        let visitor = HashTokens { index: &self.inner, lora, cache_salt };
        Ok(tokens.visit(py, visitor, DETACH_MIN_TOKENS)?.py()?.into_pyarray(py))
    }

    fn match_many(
        slf: &Bound<'_, Self>,
        queries: Vec<Bound<'_, PyAny>>,
        now: f64,
    ) -> PyResult<Vec<PyMatch>> {
        let this = slf.get();
        let queries = queries.iter().map(Hashes::extract).collect::<PyResult<Vec<_>>>()?;
        let slices = queries.iter().map(Hashes::as_slice).collect::<PyResult<Vec<_>>>()?;
        let results: Vec<MatchResult> =
            detach(slf.py(), || slices.iter().map(|h| this.inner.match_hashes(h, now)).collect())?;
        results.into_iter().map(|m| result(slf, m)).collect()
    }

    fn apply_vllm_events<'py>(
        &self,
        py: Python<'py>,
        worker: &Bound<'py, PyAny>,
        payload: &[u8],
    ) -> PyResult<Bound<'py, PyDict>> {
        let key = worker_key(worker)?;
        let long = payload.len() >= DETACH_MIN_PAYLOAD_BYTES;
        let batch =
            detach_if(py, long, || llmsched_core::vllm_events::decode_event_batch(payload))?
                .map_err(IndexError::from)
                .py()?;
        // A long payload, or a clear the core does in steps (so that other threads' matches get
        // in between them: they would wait for the GIL instead).
        let long = long || self.inner.clears_in_steps(&key, &batch);
        let report = detach_if(py, long, || self.inner.apply_event_batch(&key, batch))?;
        self.remember_name(worker, &key);
        report_dict(py, &report)
    }

    /// Engine event batches applied so far.
    #[getter]
    fn event_batches(&self) -> u64 {
        self.inner.event_batches()
    }

    /// Times the memory cap evicted every block (`stats()["max_bytes_emptied"]`), one atomic
    /// load: the wrapper checks it after a store to warn once of a cap too small for a block.
    #[getter]
    fn max_bytes_emptied(&self) -> u64 {
        self.inner.max_bytes_emptied()
    }

    fn expire(&self, py: Python<'_>, now: f64) -> PyResult<u64> {
        detach(py, || self.inner.expire(now))
    }

    fn holdings<'py>(
        &self,
        py: Python<'py>,
        worker: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let key = worker_key(worker)?;
        let rows = detach(py, || self.inner.holdings(&key))?.py()?;
        let out = PyDict::new(py);
        for (hash, tiers, confirmed) in rows {
            let names: Vec<&str> =
                Tier::ALL.iter().filter(|t| tiers & t.bit() != 0).map(|t| t.name()).collect();
            out.set_item(hash, (names, confirmed))?;
        }
        Ok(out)
    }

    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let live = self.inner.workers();
        let objs: Vec<Py<PyAny>> = live.iter().map(|(id, _)| self.name(py, *id)).collect();
        PyList::new(py, objs)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = detach(py, || self.inner.stats())?;
        let out = PyDict::new(py);
        out.set_item("workers", s.workers)?;
        out.set_item("nodes", s.nodes)?;
        out.set_item("blocks", s.blocks)?;
        out.set_item("holdings", s.holdings)?;
        out.set_item("engine_blocks", s.engine_blocks)?;
        out.set_item("bytes", s.bytes)?;
        out.set_item("evicted_blocks", s.evicted_blocks)?;
        out.set_item("max_bytes_emptied", s.max_bytes_emptied)?;
        out.set_item("replaced_engine_blocks", s.replaced_engine_blocks)?;
        let per_worker = PyDict::new(py);
        for (id, blocks) in s.worker_blocks {
            let name = self.name(py, id);
            if !name.is_none(py) {
                per_worker.set_item(name.bind(py), blocks)?;
            }
        }
        out.set_item("worker_blocks", per_worker)?;
        Ok(out)
    }

    fn dumps<'py>(&self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyBytes>> {
        let data = detach(py, || self.inner.dumps(now))?;
        Ok(PyBytes::new(py, &data))
    }

    #[staticmethod]
    fn loads(py: Python<'_>, data: &[u8], now: f64) -> PyResult<Self> {
        let inner = detach(py, || PrefixIndex::loads(data, now))?.py()?;
        Self::wrap(py, inner)
    }
}

/// The report as a dict: a copy of a template holding every key at zero (built once per
/// interpreter, with its keys), with the counts that are not zero set. A report is built per
/// engine event batch, and most of its counts are zero.
fn report_dict<'py>(py: Python<'py>, r: &ApplyReport) -> PyResult<Bound<'py, PyDict>> {
    static TEMPLATE: PyOnceLock<(Py<PyDict>, Vec<Py<PyString>>)> = PyOnceLock::new();
    let fields = [
        ("events", r.events),
        ("blocks_stored", r.blocks_stored),
        ("blocks_removed", r.blocks_removed),
        ("cleared", r.cleared),
        ("unknown_parent", r.unknown_parent),
        ("unknown_removed", r.unknown_removed),
        ("block_size_mismatch", r.block_size_mismatch),
        ("conflicts", r.conflicts),
        ("unknown_events", r.unknown_events),
        ("other_groups", r.other_groups),
        ("extra_keys", r.extra_keys),
        ("multimodal", r.multimodal),
        ("replaced", r.replaced),
    ];
    let (template, keys) = TEMPLATE.get_or_try_init(py, || -> PyResult<_> {
        let d = PyDict::new(py);
        let keys: Vec<Py<PyString>> =
            fields.iter().map(|(k, _)| PyString::intern(py, k).unbind()).collect();
        for key in &keys {
            d.set_item(key.bind(py), 0)?;
        }
        Ok((d.unbind(), keys))
    })?;
    let d = template.bind(py).copy()?;
    for (key, (_, value)) in keys.iter().zip(fields) {
        if value != 0 {
            d.set_item(key.bind(py), value)?;
        }
    }
    Ok(d)
}

/// The result of a prefix match (see `llmsched.PrefixMatch`): per-worker depths held natively,
/// Python objects made only for what is read.
#[pyclass(frozen, module = "llmsched._llmsched", name = "PrefixMatch", mapping)]
pub struct PyMatch {
    pub m: MatchResult,
    index: Py<IndexHandle>,
}

impl Drop for PyMatch {
    /// Hands the entries' allocation back for the next match on this thread (a result over
    /// hundreds of workers is kilobytes, which the allocator is slow to hand out and take back).
    fn drop(&mut self) {
        std::mem::take(&mut self.m).recycle();
    }
}

impl PyMatch {
    fn column<'py>(&self, py: Python<'py>, f: impl Fn(usize) -> u32) -> Bound<'py, PyArray1<u32>> {
        (0..self.m.entries.len()).map(f).collect::<Vec<u32>>().into_pyarray(py)
    }

    fn name(&self, py: Python<'_>, i: usize) -> Py<PyAny> {
        let index = self.index.get();
        index.names.name(py, &index.inner, self.m.entries[i].worker)
    }

    /// The entry of the worker named `worker`, if it matched.
    fn entry(&self, worker: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let key = worker_key(worker)?;
        let Some(id) = self.index.get().inner.worker_id(&key) else { return Ok(None) };
        Ok(self.m.entries.binary_search_by_key(&id, |e| e.worker).ok())
    }

    /// Entry positions ordered by leading blocks, most first (ties in worker-id order).
    fn ranked(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.m.entries.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.m.entries[i].blocks));
        order
    }
}

#[pymethods]
impl PyMatch {
    /// Workers holding at least one leading block, in worker-id order.
    #[getter]
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, (0..self.m.entries.len()).map(|i| self.name(py, i)))
    }

    /// The index's worker ids of `workers` (numpy, in the same order as `blocks`).
    #[getter]
    fn worker_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.column(py, |i| self.m.entries[i].worker)
    }

    /// Leading blocks held by each worker in `workers`, in any tier.
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.column(py, |i| self.m.entries[i].blocks)
    }

    #[getter]
    fn gpu_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.column(py, |i| self.m.entries[i].tiers[Tier::Gpu as usize])
    }

    #[getter]
    fn cpu_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.column(py, |i| self.m.entries[i].tiers[Tier::Cpu as usize])
    }

    #[getter]
    fn storage_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.column(py, |i| self.m.entries[i].tiers[Tier::Storage as usize])
    }

    #[getter]
    fn longest(&self) -> u32 {
        self.m.longest()
    }

    /// The workers holding the longest match, in worker-id order (empty when none matched).
    #[getter]
    fn best<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let longest = self.m.longest();
        let best = (0..self.m.entries.len())
            .filter(|&i| longest > 0 && self.m.entries[i].blocks == longest);
        PyList::new(py, best.map(|i| self.name(py, i)))
    }

    /// The `k` workers with the most leading blocks as `(worker, blocks)`, most first.
    fn top<'py>(&self, py: Python<'py>, k: usize) -> PyResult<Bound<'py, PyList>> {
        let mut order = self.ranked();
        order.truncate(k);
        let rows: Vec<(Py<PyAny>, u32)> =
            order.into_iter().map(|i| (self.name(py, i), self.m.entries[i].blocks)).collect();
        PyList::new(py, rows)
    }

    #[getter]
    fn query_blocks(&self) -> usize {
        self.m.query_blocks
    }

    #[getter]
    fn tree_blocks(&self) -> usize {
        self.m.tree_blocks
    }

    /// Leading blocks of `worker`, or `default` (0 unless given) when it matched none.
    #[pyo3(signature = (worker, default=None))]
    fn get<'py>(
        &self,
        worker: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = worker.py();
        match (self.entry(worker)?, default) {
            (Some(i), _) => Ok(self.m.entries[i].blocks.into_pyobject(py)?.into_any()),
            (None, Some(d)) => Ok(d),
            (None, None) => Ok(0u32.into_pyobject(py)?.into_any()),
        }
    }

    fn __getitem__(&self, worker: &Bound<'_, PyAny>) -> PyResult<u32> {
        match self.entry(worker)? {
            Some(i) => Ok(self.m.entries[i].blocks),
            None => Err(pyo3::exceptions::PyKeyError::new_err(worker.clone().unbind())),
        }
    }

    fn __contains__(&self, worker: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.entry(worker)?.is_some())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.workers(py)?.as_any().try_iter().map(Bound::into_any)
    }

    /// The matched workers, in worker-id order.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.workers(py)
    }

    /// Leading blocks per matched worker, in worker-id order.
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.m.entries.iter().map(|e| e.blocks))
    }

    /// `(worker, leading blocks)` per matched worker, in worker-id order.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows: Vec<(Py<PyAny>, u32)> = (0..self.m.entries.len())
            .map(|i| (self.name(py, i), self.m.entries[i].blocks))
            .collect();
        PyList::new(py, rows)
    }

    /// `{worker: leading blocks}` for workers with at least one.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (i, e) in self.m.entries.iter().enumerate() {
            d.set_item(self.name(py, i), e.blocks)?;
        }
        Ok(d)
    }

    /// `{worker: {"gpu": n, "cpu": n, "storage": n}}` for workers with at least one block.
    fn tiers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (i, e) in self.m.entries.iter().enumerate() {
            let t = PyDict::new(py);
            for tier in Tier::ALL {
                t.set_item(tier.name(), e.tiers[tier as usize])?;
            }
            d.set_item(self.name(py, i), t)?;
        }
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.m.entries.len()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "PrefixMatch(longest={}, query_blocks={}, workers={})",
            self.m.longest(),
            self.m.query_blocks,
            self.as_dict(py)?.repr()?
        ))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()?;
    m.add_class::<PyMatch>()?;
    m.add_function(wrap_pyfunction!(share_between_threads, m)?)?;
    Ok(())
}
