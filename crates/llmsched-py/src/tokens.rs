//! Token input: a 1-D contiguous numpy integer array of any width, read in place, or a list or
//! tuple of ints read in one native pass (`pyints`).

use crate::errors::{detach_if, InvalidTypeError, InvalidValueError};
use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::pyints;

pub use llmsched_core::hashing::{TokenSlice, TokenVisitor};

/// Token arrays shorter than this are hashed, matched and routed with the GIL held: that takes
/// tens of microseconds at most (xxh3 at about half a nanosecond a token), and getting the GIL
/// back after releasing it waits, while another thread runs Python, for that thread's switch
/// interval (5 ms by default). Beside a thread spinning in Python, a `Router.pick` of 2,000
/// tokens took 5.2 ms (p50) when every call released the GIL, 5.5 us alone.
pub const DETACH_MIN_TOKENS: usize = 1 << 16;

/// [`DETACH_MIN_TOKENS`] for vLLM's SHA-256 block hashes, some twenty times slower a token.
pub const DETACH_MIN_TOKENS_SHA256: usize = 1 << 12;

/// A borrowed numpy token array, or the ids of a list or tuple.
pub enum TokenArray<'py> {
    Owned(Vec<u32>),
    U8(PyReadonlyArray1<'py, u8>),
    U16(PyReadonlyArray1<'py, u16>),
    U32(PyReadonlyArray1<'py, u32>),
    U64(PyReadonlyArray1<'py, u64>),
    I8(PyReadonlyArray1<'py, i8>),
    I16(PyReadonlyArray1<'py, i16>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

impl<'py> TokenArray<'py> {
    /// Borrows `obj`, a 1-D C-contiguous numpy array of integers, or reads a list or tuple of
    /// ints in `0..2**32-1`. A list or tuple the native reader refuses (an element that is not an
    /// exact int in range) goes through `llmsched._tokens.as_token_array`, which raises the
    /// precise error or converts what it accepts.
    pub fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
            let mut ids = Vec::new();
            if pyints::read_ints(obj, u64::from(u32::MAX), &mut ids) {
                return Ok(Self::Owned(ids));
            }
            let py = obj.py();
            let general = py.import("llmsched._tokens")?.getattr("as_token_array")?;
            let arr = general.call1((obj, what))?;
            return Self::extract_array(&arr, what);
        }
        Self::extract_array(obj, what)
    }

    fn extract_array(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
            InvalidTypeError::new_err(format!("{what} must be a numpy array of integers"))
        })?;
        if arr.ndim() != 1 {
            return Err(InvalidValueError::new_err(format!(
                "{what} must be one-dimensional, got {} dimensions",
                arr.ndim()
            )));
        }
        let dtype = arr.dtype();
        let kind = dtype.kind();
        let size = dtype.itemsize();
        let out = match (kind, size) {
            (b'u', 1) => Self::U8(obj.extract()?),
            (b'u', 2) => Self::U16(obj.extract()?),
            (b'u', 4) => Self::U32(obj.extract()?),
            (b'u', 8) => Self::U64(obj.extract()?),
            (b'i', 1) => Self::I8(obj.extract()?),
            (b'i', 2) => Self::I16(obj.extract()?),
            (b'i', 4) => Self::I32(obj.extract()?),
            (b'i', 8) => Self::I64(obj.extract()?),
            _ => {
                return Err(InvalidTypeError::new_err(format!(
                    "{what} must have an integer dtype, got {}",
                    dtype.str()?
                )))
            }
        };
        Ok(out)
    }

    /// The tokens as a typed slice (fails if the array is not contiguous).
    pub fn as_token_slice(&self) -> PyResult<TokenSlice<'_>> {
        Ok(match self {
            Self::Owned(v) => TokenSlice::U32(v),
            Self::U8(a) => TokenSlice::U8(a.as_slice()?),
            Self::U16(a) => TokenSlice::U16(a.as_slice()?),
            Self::U32(a) => TokenSlice::U32(a.as_slice()?),
            Self::U64(a) => TokenSlice::U64(a.as_slice()?),
            Self::I8(a) => TokenSlice::I8(a.as_slice()?),
            Self::I16(a) => TokenSlice::I16(a.as_slice()?),
            Self::I32(a) => TokenSlice::I32(a.as_slice()?),
            Self::I64(a) => TokenSlice::I64(a.as_slice()?),
        })
    }

    /// Runs `visitor` over the tokens, with the GIL released when there are at least
    /// `detach_min` of them ([`DETACH_MIN_TOKENS`], [`DETACH_MIN_TOKENS_SHA256`]); a panic
    /// becomes `InternalError` either way.
    pub fn visit<V>(&self, py: Python<'_>, visitor: V, detach_min: usize) -> PyResult<V::Output>
    where
        V: TokenVisitor + Send,
        V::Output: Send,
    {
        let tokens = self.as_token_slice()?;
        detach_if(py, tokens.len() >= detach_min, || tokens.visit(visitor))
    }
}
