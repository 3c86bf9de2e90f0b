//! Bindings for `llmsched_core::hashing`.

use crate::errors::{detach, detach_if, CoreResult, InvalidTypeError};
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use super::tokens::{TokenArray, TokenSlice, DETACH_MIN_TOKENS, DETACH_MIN_TOKENS_SHA256};
use llmsched_core::hashing::batch::hash_batch;
use llmsched_core::hashing::text::{pack_text as core_pack_text, text_chain_hashes};
use llmsched_core::hashing::vllm::{self, VllmBlockHasher, VllmDigests, VllmEventHashes};
use llmsched_core::hashing::{self, ChainHashes};

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
    let hashes =
        tokens.visit(py, ChainHashes { block_size, chain_seed }, DETACH_MIN_TOKENS)?.py()?;
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

/// vLLM `sha256_cbor` block hashes in their 64-bit event form (see
/// `llmsched.hashing.block_hashes`).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, seed, lora=None, cache_salt=None))]
fn vllm_block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    seed: &str,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let tokens = TokenArray::extract(tokens, "tokens")?;
    let hasher = VllmBlockHasher::new(block_size, seed, lora, cache_salt).py()?;
    let hashes = tokens.visit(py, VllmEventHashes(&hasher), DETACH_MIN_TOKENS_SHA256)?.py()?;
    Ok(hashes.into_pyarray(py))
}

/// vLLM `sha256_cbor` block digests, 32 bytes each (see `llmsched.hashing.vllm_block_digests`).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, seed, lora=None, cache_salt=None))]
fn vllm_block_digests<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    seed: &str,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> PyResult<Bound<'py, PyList>> {
    let tokens = TokenArray::extract(tokens, "tokens")?;
    let hasher = VllmBlockHasher::new(block_size, seed, lora, cache_salt).py()?;
    let digests = tokens.visit(py, VllmDigests(&hasher), DETACH_MIN_TOKENS_SHA256)?.py()?;
    PyList::new(py, digests.iter().map(|d| PyBytes::new(py, d)))
}

/// vLLM's `NONE_HASH` for a seed string (see `llmsched.hashing.vllm_none_hash`).
#[pyfunction]
fn vllm_none_hash<'py>(py: Python<'py>, seed: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &vllm::none_hash(seed))
}

/// The bytes of a `str` (UTF-8) or `bytes` object, borrowed.
fn text_bytes<'a>(text: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    if let Ok(s) = text.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes());
    }
    if let Ok(b) = text.cast::<PyBytes>() {
        return Ok(b.as_bytes());
    }
    Err(InvalidTypeError::new_err(format!(
        "text must be str or bytes, got {}",
        text.get_type().name()?
    )))
}

/// Whether text is long enough to hash or pack with the GIL released ([`DETACH_MIN_TOKENS`]
/// pseudo-tokens of 4 bytes).
fn long_text(bytes: &[u8]) -> bool {
    bytes.len() / 4 >= DETACH_MIN_TOKENS
}

/// Chained xxh3 hashes of text packed 4 bytes per pseudo-token (see
/// `llmsched.hashing.text_block_hashes`).
#[pyfunction]
#[pyo3(signature = (text, block_size, chain_seed, include_partial, max_tokens=None))]
fn text_block_hashes<'py>(
    py: Python<'py>,
    text: &Bound<'py, PyAny>,
    block_size: usize,
    chain_seed: u64,
    include_partial: bool,
    max_tokens: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let bytes = text_bytes(text)?;
    let max_tokens = max_tokens.unwrap_or(usize::MAX);
    let hash = || text_chain_hashes(bytes, block_size, chain_seed, include_partial, max_tokens);
    let hashes = detach_if(py, long_text(bytes), hash)?.py()?;
    Ok(hashes.into_pyarray(py))
}

/// Text packed 4 UTF-8 bytes per pseudo-token (see `llmsched.hashing.pack_text`).
#[pyfunction]
fn pack_text<'py>(
    py: Python<'py>,
    text: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let bytes = text_bytes(text)?;
    Ok(detach_if(py, long_text(bytes), || core_pack_text(bytes))?.into_pyarray(py))
}

/// Borrows every prompt of a batch as a typed slice.
fn prompt_arrays<'py>(prompts: &[Bound<'py, PyAny>]) -> PyResult<Vec<TokenArray<'py>>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| TokenArray::extract(p, &format!("prompts[{i}]")))
        .collect()
}

/// Hashes every prompt with `hash_one` with the GIL released, on `threads` threads, and returns
/// a list of numpy arrays.
fn batch_to_list<'py, F>(
    py: Python<'py>,
    prompts: &[Bound<'py, PyAny>],
    threads: usize,
    hash_one: F,
) -> PyResult<Bound<'py, PyList>>
where
    F: Fn(&TokenSlice<'_>) -> Result<Vec<u64>, hashing::HashError> + Send + Sync,
{
    let arrays = prompt_arrays(prompts)?;
    let slices = arrays.iter().map(TokenArray::as_token_slice).collect::<PyResult<Vec<_>>>()?;
    let results = detach(py, || hash_batch(&slices, threads, hash_one))?.py()?;
    PyList::new(py, results.into_iter().map(|hashes| hashes.into_pyarray(py)))
}

/// Chained xxh3 block hashes of many prompts (see `llmsched.hashing.block_hashes_batch`).
#[pyfunction]
#[pyo3(signature = (prompts, block_size, chain_seed, threads=1))]
fn xxh3_block_hashes_batch<'py>(
    py: Python<'py>,
    prompts: Vec<Bound<'py, PyAny>>,
    block_size: usize,
    chain_seed: u64,
    threads: usize,
) -> PyResult<Bound<'py, PyList>> {
    let visitor = ChainHashes { block_size, chain_seed };
    batch_to_list(py, &prompts, threads, |s| s.visit(visitor))
}

/// vLLM `sha256_cbor` event-form block hashes of many prompts (see
/// `llmsched.hashing.block_hashes_batch`).
#[pyfunction]
#[pyo3(signature = (prompts, block_size, seed, lora=None, cache_salt=None, threads=1))]
fn vllm_block_hashes_batch<'py>(
    py: Python<'py>,
    prompts: Vec<Bound<'py, PyAny>>,
    block_size: usize,
    seed: &str,
    lora: Option<&str>,
    cache_salt: Option<&str>,
    threads: usize,
) -> PyResult<Bound<'py, PyList>> {
    let hasher = VllmBlockHasher::new(block_size, seed, lora, cache_salt).py()?;
    batch_to_list(py, &prompts, threads, |s| s.visit(VllmEventHashes(&hasher)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(xxh3_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(namespace_seed, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_block_digests, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_none_hash, m)?)?;
    m.add_function(wrap_pyfunction!(text_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(pack_text, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_block_hashes_batch, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_block_hashes_batch, m)?)?;
    m.add("VLLM_DEFAULT_NONE_HASH_SEED", vllm::DEFAULT_NONE_HASH_SEED)?;
    Ok(())
}
