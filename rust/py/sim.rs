//! Bindings for `crate::sim` (the simulator's KV cache).

use numpy::{IntoPyArray, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::sim::{KvCache, KvEvent};

/// One simulated replica's KV cache; `llmsched.sim.kv` uses it. Not shared between threads:
/// each simulation owns its replicas' caches.
#[pyclass(module = "llmsched._llmsched", name = "KvCache")]
pub struct PyKvCache {
    inner: KvCache,
}

#[pymethods]
impl PyKvCache {
    #[new]
    fn new(num_blocks: u32, block_size: u32) -> PyResult<Self> {
        Ok(Self { inner: KvCache::new(num_blocks, block_size)? })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> u64 {
        self.inner.block_size()
    }

    #[getter]
    fn free_blocks(&self) -> usize {
        self.inner.free_blocks()
    }

    #[getter]
    fn cached_blocks(&self) -> usize {
        self.inner.cached_blocks()
    }

    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    fn requests(&self) -> usize {
        self.inner.requests()
    }

    #[pyo3(signature = (hashes, max_blocks = None))]
    fn lookup(
        &self,
        hashes: PyReadonlyArray1<'_, u64>,
        max_blocks: Option<usize>,
    ) -> PyResult<usize> {
        Ok(self.inner.lookup(hashes.as_slice()?, max_blocks.unwrap_or(usize::MAX)))
    }

    fn tokens_of(&self, req: u64) -> PyResult<u64> {
        Ok(self.inner.tokens_of(req)?)
    }

    fn blocks_of(&self, req: u64) -> PyResult<usize> {
        Ok(self.inner.blocks_of(req)?)
    }

    fn start(
        &mut self,
        req: u64,
        hashes: PyReadonlyArray1<'_, u64>,
        max_blocks: usize,
    ) -> PyResult<usize> {
        Ok(self.inner.start(req, hashes.as_slice()?, max_blocks)?)
    }

    fn allocate(&mut self, req: u64, tokens: u64) -> PyResult<bool> {
        Ok(self.inner.allocate(req, tokens)?)
    }

    fn commit(&mut self, req: u64, hashes: PyReadonlyArray1<'_, u64>, upto: usize) -> PyResult<()> {
        Ok(self.inner.commit(req, hashes.as_slice()?, upto)?)
    }

    fn free(&mut self, req: u64) -> PyResult<()> {
        Ok(self.inner.free(req)?)
    }

    fn set_decoding(&mut self, req: u64, decoding: bool) -> PyResult<()> {
        Ok(self.inner.set_decoding(req, decoding)?)
    }

    fn decode_capacity(&self, limit: u64) -> u64 {
        self.inner.decode_capacity(limit)
    }

    fn advance_decoding(&mut self, steps: u64) -> bool {
        self.inner.advance_decoding(steps)
    }

    /// `("stored", parent | None, hashes)` and `("removed", hashes)` tuples, hashes as numpy.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .take_events()
            .into_iter()
            .map(|event| match event {
                KvEvent::Stored { parent, hashes } => PyTuple::new(
                    py,
                    [
                        "stored".into_pyobject(py)?.into_any(),
                        parent.into_pyobject(py)?.into_any(),
                        hashes.into_pyarray(py).into_any(),
                    ],
                ),
                KvEvent::Removed { hashes } => PyTuple::new(
                    py,
                    ["removed".into_pyobject(py)?.into_any(), hashes.into_pyarray(py).into_any()],
                ),
            })
            .collect()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvCache>()
}
