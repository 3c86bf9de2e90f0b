//! Token input: a 1-D contiguous numpy integer array of any width, read in place.

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::hashing::TokenId;

/// Code that runs over a token slice of whatever integer type the array holds.
pub trait TokenVisitor {
    type Output;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output;
}

/// A borrowed numpy token array.
pub enum TokenArray<'py> {
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
    /// Borrows `obj`, which must be a 1-D C-contiguous numpy array of integers.
    pub fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
            PyTypeError::new_err(format!("{what} must be a numpy array of integers"))
        })?;
        if arr.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
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
                return Err(PyTypeError::new_err(format!(
                    "{what} must have an integer dtype, got {}",
                    dtype.str()?
                )))
            }
        };
        Ok(out)
    }

    /// Runs `visitor` over the tokens with the GIL released.
    pub fn visit_detached<V>(&self, py: Python<'_>, visitor: V) -> PyResult<V::Output>
    where
        V: TokenVisitor + Send,
        V::Output: Send,
    {
        match self {
            Self::U8(a) => run(py, a.as_slice()?, visitor),
            Self::U16(a) => run(py, a.as_slice()?, visitor),
            Self::U32(a) => run(py, a.as_slice()?, visitor),
            Self::U64(a) => run(py, a.as_slice()?, visitor),
            Self::I8(a) => run(py, a.as_slice()?, visitor),
            Self::I16(a) => run(py, a.as_slice()?, visitor),
            Self::I32(a) => run(py, a.as_slice()?, visitor),
            Self::I64(a) => run(py, a.as_slice()?, visitor),
        }
    }
}

fn run<T, V>(py: Python<'_>, tokens: &[T], visitor: V) -> PyResult<V::Output>
where
    T: TokenId + Sync,
    V: TokenVisitor + Send,
    V::Output: Send,
{
    Ok(py.detach(|| visitor.visit(tokens)))
}
