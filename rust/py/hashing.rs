//! Bindings for `crate::hashing`.

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use super::tokens::{TokenArray, TokenVisitor};
use crate::hashing::{self, HashError, TokenId};

struct ChainHashes {
    block_size: usize,
    chain_seed: u64,
}

impl TokenVisitor for ChainHashes {
    type Output = Result<Vec<u64>, HashError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        hashing::chain_hashes(tokens, self.block_size, self.chain_seed)
    }
}

/// Chained xxh3 block hashes of a token array (see `llmsched.hashing.block_hashes`).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, chain_seed))]
fn xxh3_block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    chain_seed: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let tokens = TokenArray::extract(tokens, "tokens")?;
    let hashes = tokens.visit_detached(
        py,
        ChainHashes {
            block_size,
            chain_seed,
        },
    )??;
    Ok(hashes.into_pyarray(py))
}

/// The chain seed for a namespace (see `llmsched.hashing.namespace_seed`).
#[pyfunction]
#[pyo3(signature = (seed, model=None, lora=None, cache_salt=None))]
fn namespace_seed(
    seed: u64,
    model: Option<&str>,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> u64 {
    hashing::namespace_seed(seed, model, lora, cache_salt)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(xxh3_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_seed, m)?)?;
    Ok(())
}
