//! vLLM's `sha256_cbor` prefix-cache block hash, reproduced bit for bit.
//!
//! Definition (vLLM `vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens` with `sha256_cbor`;
//! vectors: `tests/data/vllm_block_hashes.json`): over full blocks
//! only, `h[i] = SHA-256(CBOR([h[i-1], [t_0, ..., t_{B-1}], extra_keys[i]]))` with
//! `h[-1] = NONE_HASH = SHA-256(CBOR(seed))`, where `seed` is the text string vLLM hashes:
//! `$PYTHONHASHSEED` when set, else `"vllm-none-hash"` in recent releases (some releases use
//! random bytes instead when the variable is unset; those hashes cannot be reproduced).
//! CBOR is canonical: shortest-form integers and lengths, definite lengths; the parent digest is a
//! byte string, tokens are unsigned integers, extra keys an array of text strings or null.
//!
//! Extra keys supported: the LoRA adapter name on every block and the cache salt on the first
//! block only (skipped when empty), in vLLM's order `[lora_name, cache_salt]`; `null` when there
//! are none. Multimodal feature hashes and prompt-embedding hashes are not supported.
//!
//! Event form: vLLM's KV events publish, when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is on, the
//! last 8 bytes of the digest read big-endian.
//!
//! Complexity: O(n) time; one reused CBOR buffer; SHA-256 (hardware-accelerated where the CPU has
//! it) dominates.

use std::convert::Infallible;

use minicbor::encode::Error as EncodeError;
use minicbor::Encoder;
use sha2::{Digest as _, Sha256};

use super::{first_out_of_range, out_of_range, HashError, TokenId, TokenVisitor};

/// The seed vLLM hashes into `NONE_HASH` when `PYTHONHASHSEED` is unset (recent releases).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// A SHA-256 block digest.
pub type Digest = [u8; 32];

/// `NONE_HASH = SHA-256(CBOR(seed))`, the parent of a sequence's first block.
pub fn none_hash(seed: &str) -> Digest {
    let mut buf = Vec::with_capacity(seed.len() + 9);
    written(Encoder::new(&mut buf).str(seed));
    Sha256::digest(&buf).into()
}

/// The 64-bit form vLLM publishes in KV events: the digest's last 8 bytes, big-endian.
pub fn event_hash(digest: &Digest) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

/// Appends to `buf` the canonical CBOR of `[parent, [tokens...], extra_keys or null]`;
/// `Err(offset)` names the first id outside 0..=u32::MAX (then `buf` holds a partial encoding).
pub fn encode_block_input<T: TokenId>(
    buf: &mut Vec<u8>,
    parent: &Digest,
    block: &[T],
    extra_keys: &[&str],
) -> Result<(), usize> {
    let mut enc = Encoder::new(buf);
    written(enc.array(3));
    written(enc.bytes(parent));
    written(enc.array(block.len() as u64));
    for (offset, &t) in block.iter().enumerate() {
        written(enc.u32(t.to_u32().ok_or(offset)?));
    }
    if extra_keys.is_empty() {
        written(enc.null());
    } else {
        written(enc.array(extra_keys.len() as u64));
        for key in extra_keys {
            written(enc.str(key));
        }
    }
    Ok(())
}

/// Unwraps a CBOR write into a `Vec`, which cannot fail (its error type is `Infallible`; the
/// encoder raises no other error for these primitives).
fn written<T>(result: Result<T, EncodeError<Infallible>>) -> T {
    match result {
        Ok(value) => value,
        Err(err) => unreachable!("writing CBOR into a Vec failed: {err}"),
    }
}

/// vLLM's block hasher for one request shape: block size, seed and extra keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmBlockHasher {
    block_size: usize,
    none_hash: Digest,
    lora: Option<String>,
    cache_salt: Option<String>,
}

impl VllmBlockHasher {
    /// A hasher with `NONE_HASH = none_hash(seed)`; fails on a block size outside
    /// 1..=[`MAX_BLOCK_SIZE`](crate::hashing::MAX_BLOCK_SIZE).
    pub fn new(
        block_size: usize,
        seed: &str,
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Self, HashError> {
        crate::hashing::check_block_size(block_size)?;
        Ok(Self {
            block_size,
            none_hash: none_hash(seed),
            lora: lora.map(str::to_owned),
            // vLLM adds the salt only when it is truthy.
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        })
    }

    /// `NONE_HASH` for this hasher's seed.
    pub fn none_hash(&self) -> &Digest {
        &self.none_hash
    }

    /// The extra keys of block `index`, in vLLM's order.
    fn extra_keys(&self, index: usize) -> Vec<&str> {
        let salt = if index == 0 { self.cache_salt.as_deref() } else { None };
        self.lora.as_deref().into_iter().chain(salt).collect()
    }

    /// Calls `emit` with each full block's digest in order; nothing is emitted if any id (also
    /// in the trailing partial block) is out of range.
    fn for_each_digest<T: TokenId>(
        &self,
        tokens: &[T],
        mut emit: impl FnMut(&Digest),
    ) -> Result<(), HashError> {
        if let Some(offset) = first_out_of_range(tokens) {
            return Err(out_of_range(tokens, 0, offset));
        }
        let mut buf = Vec::with_capacity(64 + 5 * self.block_size);
        let mut parent = self.none_hash;
        for (b, block) in tokens.chunks_exact(self.block_size).enumerate() {
            buf.clear();
            encode_block_input(&mut buf, &parent, block, &self.extra_keys(b))
                .map_err(|offset| out_of_range(block, b * self.block_size, offset))?;
            parent = Sha256::digest(&buf).into();
            emit(&parent);
        }
        Ok(())
    }

    /// The SHA-256 digest of every full block of `tokens`.
    pub fn digests<T: TokenId>(&self, tokens: &[T]) -> Result<Vec<Digest>, HashError> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.for_each_digest(tokens, |d| out.push(*d))?;
        Ok(out)
    }

    /// The 64-bit event form ([`event_hash`]) of every full block of `tokens`.
    pub fn event_hashes<T: TokenId>(&self, tokens: &[T]) -> Result<Vec<u64>, HashError> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.for_each_digest(tokens, |d| out.push(event_hash(d)))?;
        Ok(out)
    }
}

/// A [`TokenVisitor`] computing [`VllmBlockHasher::digests`].
#[derive(Debug, Clone, Copy)]
pub struct VllmDigests<'a>(pub &'a VllmBlockHasher);

impl TokenVisitor for VllmDigests<'_> {
    type Output = Result<Vec<Digest>, HashError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        self.0.digests(tokens)
    }
}

/// A [`TokenVisitor`] computing [`VllmBlockHasher::event_hashes`].
#[derive(Debug, Clone, Copy)]
pub struct VllmEventHashes<'a>(pub &'a VllmBlockHasher);

impl TokenVisitor for VllmEventHashes<'_> {
    type Output = Result<Vec<u64>, HashError>;
    fn visit<T: TokenId + Sync>(self, tokens: &[T]) -> Self::Output {
        self.0.event_hashes(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_shortest_form_integers() {
        let mut buf = Vec::new();
        let parent = [0xAB; 32];
        encode_block_input(&mut buf, &parent, &[0u32, 23, 24, 255, 256, 65_536, u32::MAX], &[])
            .unwrap();
        let mut expect = vec![0x83, 0x58, 0x20];
        expect.extend_from_slice(&parent);
        expect.extend_from_slice(&[0x87, 0x00, 0x17, 0x18, 0x18, 0x18, 0xff, 0x19, 0x01, 0x00]);
        expect.extend_from_slice(&[0x1a, 0x00, 0x01, 0x00, 0x00, 0x1a, 0xff, 0xff, 0xff, 0xff]);
        expect.push(0xf6);
        assert_eq!(buf, expect);
    }

    #[test]
    fn encodes_extra_keys_as_text_strings() {
        let mut buf = Vec::new();
        encode_block_input(&mut buf, &[0; 32], &[1i64], &["ab", "c"]).unwrap();
        assert_eq!(&buf[buf.len() - 6..], &[0x82, 0x62, b'a', b'b', 0x61, b'c']);
        assert_eq!(encode_block_input(&mut Vec::new(), &[0; 32], &[1i64, -1], &[]), Err(1));
    }

    #[test]
    fn lora_on_every_block_salt_on_the_first_only() {
        let h = VllmBlockHasher::new(4, "s", Some("lora"), Some("salt")).unwrap();
        assert_eq!(h.extra_keys(0), vec!["lora", "salt"]);
        assert_eq!(h.extra_keys(1), vec!["lora"]);
        let empty_salt = VllmBlockHasher::new(4, "s", None, Some("")).unwrap();
        assert!(empty_salt.extra_keys(0).is_empty());
        assert_eq!(empty_salt, VllmBlockHasher::new(4, "s", None, None).unwrap());
    }

    #[test]
    fn chain_follows_the_definition() {
        let tokens: Vec<u32> = (100..110).collect();
        let h = VllmBlockHasher::new(4, "seed", Some("l"), None).unwrap();
        let mut parent = none_hash("seed");
        let mut expect = Vec::new();
        for block in tokens.chunks_exact(4) {
            let mut buf = Vec::new();
            encode_block_input(&mut buf, &parent, block, &["l"]).unwrap();
            parent = Sha256::digest(&buf).into();
            expect.push(parent);
        }
        assert_eq!(h.digests(&tokens).unwrap(), expect);
        let events: Vec<u64> = expect.iter().map(event_hash).collect();
        assert_eq!(h.event_hashes(&tokens).unwrap(), events);
    }

    #[test]
    fn rejects_bad_ids_and_zero_block_size() {
        let h = VllmBlockHasher::new(2, DEFAULT_NONE_HASH_SEED, None, None).unwrap();
        let err = h.digests(&[1i64, 2, 3, 1 << 40, 5]).unwrap_err();
        assert_eq!(err, HashError::TokenOutOfRange { position: 3, value: 1 << 40 });
        assert!(h.digests(&[1i64, 2, -1]).is_err());
        assert_eq!(VllmBlockHasher::new(0, "s", None, None), Err(HashError::ZeroBlockSize));
    }

    #[test]
    fn event_hash_reads_the_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(event_hash(&d), 0x0102_0304_0506_0708);
    }
}
