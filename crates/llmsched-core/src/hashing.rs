//! Chained block hashing of token sequences.
//!
//! Definition (`xxh3`, the default): tokens are cut into full blocks of `block_size`; a trailing
//! partial block is not hashed. With `h[-1] = chain_seed`, block `i` hashes to
//! `h[i] = xxh3_64_with_seed(bytes(block_i), seed = h[i-1])`, where `bytes(block_i)` is each token
//! as an unsigned 32-bit little-endian integer. Because each hash is seeded by its parent's, equal
//! hashes mean equal prefixes (up to 64-bit collisions).
//!
//! `chain_seed` is the caller's `seed` when no namespace is given; otherwise it is
//! `xxh3_64_with_seed(ns, seed)` where `ns` concatenates, for model, LoRA name and cache salt in
//! that order, one byte (0 absent, 1 present) then, if present, the UTF-8 length as u32
//! little-endian and the UTF-8 bytes.
//!
//! Complexity: one pass over the tokens, O(n) time, no allocation beyond the output (and one
//! block-sized conversion buffer when the tokens are not already u32 little-endian in memory).
//!
//! Submodules: [`text`] (raw text packed 4 bytes per pseudo-token), [`vllm`] (vLLM's
//! `sha256_cbor` prefix-cache hash), [`batch`] (many prompts in one call) and [`xxh3`] (the
//! hash itself, with an AVX2 path for blocks over 240 bytes chosen at run time).

pub mod batch;
pub mod text;
pub mod vllm;
pub mod xxh3;

use self::xxh3::xxh3_64_with_seed;
use thiserror::Error;

/// Errors from hashing token input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HashError {
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("block_size {0} is above the largest supported, {MAX_BLOCK_SIZE} tokens")]
    BlockSizeTooLarge(usize),
    #[error("token id {value} at position {position} is out of range (0 to 4294967295)")]
    TokenOutOfRange { position: usize, value: i128 },
}

/// The largest block size accepted anywhere (tokens per block). Engines use 16 to a few
/// thousand; the bound keeps every per-block buffer small whatever a caller or a snapshot says.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

/// Checks a block size before anything is sized by it: 1 to [`MAX_BLOCK_SIZE`] tokens.
pub fn check_block_size(block_size: usize) -> Result<(), HashError> {
    match block_size {
        0 => Err(HashError::ZeroBlockSize),
        n if n > MAX_BLOCK_SIZE => Err(HashError::BlockSizeTooLarge(n)),
        _ => Ok(()),
    }
}

/// A token id element type accepted without conversion of the whole input.
pub trait TokenId: Copy {
    /// The id as u32, or None when negative or above u32::MAX.
    fn to_u32(self) -> Option<u32>;
    /// The raw value, for error messages.
    fn raw(self) -> i128;
    /// The tokens' memory when it already is the u32 little-endian bytes that get hashed, so a
    /// block can be hashed in place without conversion. None for every other element type.
    fn as_le_u32_bytes(_tokens: &[Self]) -> Option<&[u8]> {
        None
    }
}

macro_rules! impl_token_id {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline(always)]
            fn to_u32(self) -> Option<u32> { u32::try_from(self).ok() }
            fn raw(self) -> i128 { self as i128 }
        }
    )*};
}
impl_token_id!(u8, u16, u64, i8, i16, i32, i64);

impl TokenId for u32 {
    #[inline(always)]
    fn to_u32(self) -> Option<u32> {
        Some(self)
    }
    fn raw(self) -> i128 {
        i128::from(self)
    }
    #[inline(always)]
    fn as_le_u32_bytes(tokens: &[u32]) -> Option<&[u8]> {
        cfg!(target_endian = "little").then(|| bytemuck::cast_slice(tokens))
    }
}

/// Code that runs over a token slice of whatever integer type it holds.
pub trait TokenVisitor {
    type Output;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output;
}

/// A borrowed token sequence of any supported integer width (what a numpy array holds).
#[derive(Debug, Clone, Copy)]
pub enum TokenSlice<'a> {
    U8(&'a [u8]),
    U16(&'a [u16]),
    U32(&'a [u32]),
    U64(&'a [u64]),
    I8(&'a [i8]),
    I16(&'a [i16]),
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl TokenSlice<'_> {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(s) => s.len(),
            Self::U16(s) => s.len(),
            Self::U32(s) => s.len(),
            Self::U64(s) => s.len(),
            Self::I8(s) => s.len(),
            Self::I16(s) => s.len(),
            Self::I32(s) => s.len(),
            Self::I64(s) => s.len(),
        }
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `visitor` over the typed slice.
    pub fn visit<V: TokenVisitor>(&self, visitor: V) -> V::Output {
        match *self {
            Self::U8(s) => visitor.visit(s),
            Self::U16(s) => visitor.visit(s),
            Self::U32(s) => visitor.visit(s),
            Self::U64(s) => visitor.visit(s),
            Self::I8(s) => visitor.visit(s),
            Self::I16(s) => visitor.visit(s),
            Self::I32(s) => visitor.visit(s),
            Self::I64(s) => visitor.visit(s),
        }
    }
}

/// A [`TokenVisitor`] computing [`chain_hashes`].
#[derive(Debug, Clone, Copy)]
pub struct ChainHashes {
    pub block_size: usize,
    pub chain_seed: u64,
}

impl TokenVisitor for ChainHashes {
    type Output = Result<Vec<u64>, HashError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        chain_hashes(tokens, self.block_size, self.chain_seed)
    }
}

/// The chain seed for a namespace (see the module docs for the exact definition).
pub fn namespace_seed(
    seed: u64,
    model: Option<&str>,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> u64 {
    if model.is_none() && lora.is_none() && cache_salt.is_none() {
        return seed;
    }
    let mut ns = Vec::with_capacity(64);
    for part in [model, lora, cache_salt] {
        match part {
            None => ns.push(0u8),
            Some(s) => {
                ns.push(1u8);
                ns.extend_from_slice(&(s.len() as u32).to_le_bytes());
                ns.extend_from_slice(s.as_bytes());
            }
        }
    }
    xxh3_64_with_seed(&ns, seed)
}

/// Appends one chained hash per full block of `tokens` to `out`, continuing from `parent`
/// (the chain seed for a sequence that starts at the root). On error `out` is left unchanged.
pub fn chain_hashes_into<T: TokenId>(
    tokens: &[T],
    block_size: usize,
    parent: u64,
    out: &mut Vec<u64>,
) -> Result<(), HashError> {
    check_block_size(block_size)?;
    let start = out.len();
    out.reserve(tokens.len() / block_size);
    let mut words = BlockWords::new();
    let mut prev = parent;
    for (b, block) in tokens.chunks_exact(block_size).enumerate() {
        let bytes = match words.le_bytes(block) {
            Ok(bytes) => bytes,
            Err(offset) => {
                out.truncate(start);
                return Err(out_of_range(block, b * block_size, offset));
            }
        };
        prev = xxh3_64_with_seed(bytes, prev);
        out.push(prev);
    }
    // The trailing partial block is not hashed, but bad ids in it are still bad input.
    let tail_start = tokens.len() - tokens.len() % block_size;
    if let Some(j) = tokens[tail_start..].iter().position(|t| t.to_u32().is_none()) {
        out.truncate(start);
        let value = tokens[tail_start + j].raw();
        return Err(HashError::TokenOutOfRange { position: tail_start + j, value });
    }
    Ok(())
}

/// One step of the chain: the hash of one full block of ids after the block hashed to `parent`
/// (or after `chain_seed`, for the first block). [`chain_hashes`] is this, block after block;
/// a reader that produces the ids a block at a time hashes each block as soon as it is read.
#[inline]
pub fn hash_block(block: &[u32], parent: u64) -> u64 {
    match u32::as_le_u32_bytes(block) {
        Some(bytes) => xxh3_64_with_seed(bytes, parent),
        None => {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_64_with_seed(&bytes, parent)
        }
    }
}

/// One chained hash per full block of `tokens`, starting from `chain_seed`.
pub fn chain_hashes<T: TokenId>(
    tokens: &[T],
    block_size: usize,
    chain_seed: u64,
) -> Result<Vec<u64>, HashError> {
    let mut out = Vec::new();
    chain_hashes_into(tokens, block_size, chain_seed, &mut out)?;
    Ok(out)
}

/// The offset of the first id of `tokens` outside 0..=u32::MAX.
fn first_out_of_range<T: TokenId>(tokens: &[T]) -> Option<usize> {
    tokens.iter().position(|t| t.to_u32().is_none())
}

/// The error for the bad id at `block[offset]`, where `block` starts at token `block_start`.
fn out_of_range<T: TokenId>(block: &[T], block_start: usize, offset: usize) -> HashError {
    HashError::TokenOutOfRange { position: block_start + offset, value: block[offset].raw() }
}

/// A reusable buffer that turns one block of any token type into the u32 little-endian bytes
/// that get hashed.
struct BlockWords {
    words: Vec<u32>,
}

impl BlockWords {
    /// Sized by the first block that needs converting: u32 ids are borrowed in place and
    /// never need it (one allocation per engine event otherwise).
    fn new() -> Self {
        Self { words: Vec::new() }
    }

    /// The block's bytes, borrowed in place when possible; `Err(offset)` names the first id
    /// outside 0..=u32::MAX.
    #[inline]
    fn le_bytes<'a, T: TokenId>(&'a mut self, block: &'a [T]) -> Result<&'a [u8], usize> {
        if let Some(bytes) = T::as_le_u32_bytes(block) {
            return Ok(bytes);
        }
        // Convert and check the whole block without branches first (it vectorises); look for
        // the offending position only on the error path.
        if self.words.len() < block.len() {
            self.words.resize(block.len(), 0);
        }
        let mut all_in_range = true;
        for (word, &t) in self.words.iter_mut().zip(block) {
            let v = t.to_u32();
            all_in_range &= v.is_some();
            *word = v.unwrap_or(0).to_le();
        }
        if all_in_range {
            Ok(bytemuck::cast_slice(&self.words[..block.len()]))
        } else {
            Err(first_out_of_range(block).unwrap_or(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashing_block_by_block_is_the_chain() {
        let tokens: Vec<u32> = (0..100).map(|i| i * 104_729 % 128_000).collect();
        for bs in [1, 3, 16] {
            let mut prev = 99u64;
            let steps: Vec<u64> = tokens
                .chunks_exact(bs)
                .map(|b| {
                    prev = hash_block(b, prev);
                    prev
                })
                .collect();
            assert_eq!(steps, chain_hashes(&tokens, bs, 99).unwrap());
        }
    }

    #[test]
    fn equal_prefixes_hash_equal() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let ha = chain_hashes(&a, 16, 0).unwrap();
        let hb = chain_hashes(&b, 16, 0).unwrap();
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(ha[3], hb[3]);
    }

    #[test]
    fn rejects_out_of_range_without_output() {
        let mut out = vec![7];
        let err = chain_hashes_into(&[1i64, 2, -3, 4], 2, 0, &mut out).unwrap_err();
        assert_eq!(err, HashError::TokenOutOfRange { position: 2, value: -3 });
        assert_eq!(out, vec![7]);
        assert_eq!(chain_hashes(&[1u32], 0, 0), Err(HashError::ZeroBlockSize));
    }

    #[test]
    fn matches_the_definition_block_by_block() {
        let tokens: Vec<u32> = (0..50).map(|i| i * 7919 + 3).collect();
        let mut prev = 42u64;
        let mut expected = Vec::new();
        for block in tokens.chunks_exact(8) {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = xxh3_64_with_seed(&bytes, prev);
            expected.push(prev);
        }
        assert_eq!(chain_hashes(&tokens, 8, 42).unwrap(), expected);
    }

    #[test]
    fn every_integer_width_hashes_alike() {
        let base: Vec<u8> = (0..=200).collect();
        let expect = chain_hashes(&base, 16, 9).unwrap();
        let as_u16: Vec<u16> = base.iter().map(|&v| v.into()).collect();
        let as_u32: Vec<u32> = base.iter().map(|&v| v.into()).collect();
        let as_u64: Vec<u64> = base.iter().map(|&v| v.into()).collect();
        let as_i16: Vec<i16> = base.iter().map(|&v| v.into()).collect();
        let as_i64: Vec<i64> = base.iter().map(|&v| v.into()).collect();
        assert_eq!(chain_hashes(&as_u16, 16, 9).unwrap(), expect);
        assert_eq!(chain_hashes(&as_u32, 16, 9).unwrap(), expect);
        assert_eq!(chain_hashes(&as_u64, 16, 9).unwrap(), expect);
        assert_eq!(chain_hashes(&as_i16, 16, 9).unwrap(), expect);
        assert_eq!(chain_hashes(&as_i64, 16, 9).unwrap(), expect);
        assert_eq!(TokenSlice::I64(&as_i64).len(), base.len());
    }

    #[test]
    fn reports_the_first_bad_id_anywhere() {
        let mut tokens = vec![5u64; 42];
        tokens[37] = u64::from(u32::MAX) + 1;
        tokens[41] = u64::MAX; // in the unhashed tail: reported only when it is the first
        let err = chain_hashes(&tokens, 4, 0).unwrap_err();
        assert_eq!(err, HashError::TokenOutOfRange { position: 37, value: 1 << 32 });
        tokens[37] = 5;
        let err = chain_hashes(&tokens, 4, 0).unwrap_err();
        assert_eq!(err, HashError::TokenOutOfRange { position: 41, value: u64::MAX.into() });
        // Ids in the trailing partial block are not hashed, but must be valid all the same.
        let mut out = vec![1];
        assert_eq!(
            chain_hashes_into(&[1i8, 2, -1], 2, 0, &mut out),
            Err(HashError::TokenOutOfRange { position: 2, value: -1 })
        );
        assert_eq!(out, vec![1]);
    }
}
