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

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Errors from hashing token input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HashError {
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("token id {value} at position {position} is out of range (0 to 4294967295)")]
    TokenOutOfRange { position: usize, value: i128 },
}

/// A token id element type accepted without conversion of the whole input.
pub trait TokenId: Copy {
    /// The id as u32, or None when negative or above u32::MAX.
    fn to_u32(self) -> Option<u32>;
    /// The raw value, for error messages.
    fn raw(self) -> i128;
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
impl_token_id!(u8, u16, u32, u64, i8, i16, i32, i64);

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
    if block_size == 0 {
        return Err(HashError::ZeroBlockSize);
    }
    let start = out.len();
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut prev = parent;
    for (b, block) in tokens.chunks_exact(block_size).enumerate() {
        bytes.clear();
        for (j, &t) in block.iter().enumerate() {
            match t.to_u32() {
                Some(v) => bytes.extend_from_slice(&v.to_le_bytes()),
                None => {
                    out.truncate(start);
                    return Err(HashError::TokenOutOfRange {
                        position: b * block_size + j,
                        value: t.raw(),
                    });
                }
            }
        }
        prev = xxh3_64_with_seed(&bytes, prev);
        out.push(prev);
    }
    Ok(())
}

/// One chained hash per full block of `tokens`, starting from `chain_seed`.
pub fn chain_hashes<T: TokenId>(
    tokens: &[T],
    block_size: usize,
    chain_seed: u64,
) -> Result<Vec<u64>, HashError> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    chain_hashes_into(tokens, block_size, chain_seed, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            err,
            HashError::TokenOutOfRange {
                position: 2,
                value: -3
            }
        );
        assert_eq!(out, vec![7]);
        assert_eq!(chain_hashes(&[1u32], 0, 0), Err(HashError::ZeroBlockSize));
    }
}
