//! Approximate prefix hashing of raw text, for a gateway without a tokenizer.
//!
//! Definition: the text's UTF-8 bytes are packed 4 per pseudo-token, each pseudo-token a u32
//! read little-endian and the last one zero-padded, as llm-d's approximate prefix mode does
//! (llm-d's tokenizer-free prefix scorer). At most `max_tokens` pseudo-tokens are kept (the
//! start of the text). Blocks of `block_size` pseudo-tokens are then hashed with the xxh3 chain
//! of [`super`]: `h[i] = xxh3_64_with_seed(bytes(block_i), seed = h[i-1])`, `h[-1] = chain_seed`.
//! With `include_partial` (llm-d's behaviour) a trailing partial block is hashed the same way
//! over its pseudo-tokens' bytes, so every byte of a short prompt counts.
//!
//! Because a pseudo-token's u32 little-endian bytes are the text bytes themselves, full blocks
//! hash straight from the text without packing; only the last pseudo-token is padded. One
//! consequence of zero padding: a text and the same text followed by 1 to 3 NUL bytes that end on
//! the same pseudo-token hash alike.

use super::xxh3::xxh3_64_with_seed;

use super::HashError;

/// Bytes per pseudo-token.
const BYTES_PER_TOKEN: usize = 4;

/// The pseudo-tokens of `text`: 4 bytes each, little-endian, the last zero-padded.
pub fn pack_text(text: &[u8]) -> Vec<u32> {
    // Whole words first, then the padded tail: a copy of a fixed 4 bytes is one load, where a
    // copy of a chunk's variable length was a memcpy call per pseudo-token.
    let words = text.chunks_exact(BYTES_PER_TOKEN);
    let tail = words.remainder();
    let mut out = Vec::with_capacity(text.len().div_ceil(BYTES_PER_TOKEN));
    out.extend(words.map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])));
    if !tail.is_empty() {
        let mut word = [0u8; BYTES_PER_TOKEN];
        word[..tail.len()].copy_from_slice(tail);
        out.push(u32::from_le_bytes(word));
    }
    out
}

/// How many pseudo-tokens [`pack_text`] makes of `bytes` bytes of text.
pub fn packed_len(bytes: usize) -> usize {
    bytes.div_ceil(BYTES_PER_TOKEN)
}

/// Chained xxh3 hashes of `text`'s pseudo-token blocks (see the module docs).
pub fn text_chain_hashes(
    text: &[u8],
    block_size: usize,
    chain_seed: u64,
    include_partial: bool,
    max_tokens: usize,
) -> Result<Vec<u64>, HashError> {
    crate::hashing::check_block_size(block_size)?;
    let kept = &text[..text.len().min(max_tokens.saturating_mul(BYTES_PER_TOKEN))];
    let blocks = kept.chunks_exact(block_size.saturating_mul(BYTES_PER_TOKEN));
    let tail = blocks.remainder();
    let mut out = Vec::with_capacity(blocks.len() + 1);
    let mut prev = chain_seed;
    for block in blocks {
        prev = xxh3_64_with_seed(block, prev);
        out.push(prev);
    }
    // The tail is a full block when its last pseudo-token is the padded one.
    let tail_is_full_block = tail.len().div_ceil(BYTES_PER_TOKEN) == block_size;
    if !tail.is_empty() && (include_partial || tail_is_full_block) {
        let mut padded = tail.to_vec();
        padded.resize(tail.len().next_multiple_of(BYTES_PER_TOKEN), 0);
        out.push(xxh3_64_with_seed(&padded, prev));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::chain_hashes;
    use super::*;

    #[test]
    fn packs_little_endian_with_zero_padding() {
        assert_eq!(pack_text(b""), Vec::<u32>::new());
        assert_eq!(pack_text(b"abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        assert_eq!(pack_text(b"abcde"), vec![u32::from_le_bytes(*b"abcd"), u32::from(b'e')]);
        for n in 0..10 {
            assert_eq!(packed_len(n), pack_text(&vec![b'x'; n]).len(), "{n} bytes");
        }
        // Every tail length, against packing byte by byte.
        let text: Vec<u8> = (1..=23).collect();
        for n in 0..text.len() {
            let mut naive = vec![0u32; n.div_ceil(4)];
            for (i, byte) in text[..n].iter().enumerate() {
                naive[i / 4] |= u32::from(*byte) << (8 * (i % 4));
            }
            assert_eq!(pack_text(&text[..n]), naive, "{n} bytes");
        }
    }

    #[test]
    fn full_blocks_equal_the_token_chain_over_packed_text() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        for block_size in [1, 3, 16, 64] {
            let packed = pack_text(&text);
            let full = chain_hashes(&packed, block_size, 5).unwrap();
            let got = text_chain_hashes(&text, block_size, 5, false, usize::MAX).unwrap();
            assert_eq!(got, full, "block_size {block_size}");
        }
    }

    #[test]
    fn partial_block_hashes_its_padded_pseudo_tokens() {
        let text = b"0123456789"; // 3 pseudo-tokens, the last one "89\0\0"
        let got = text_chain_hashes(text, 2, 7, true, usize::MAX).unwrap();
        let first = xxh3_64_with_seed(b"01234567", 7);
        assert_eq!(got, vec![first, xxh3_64_with_seed(b"89\0\0", first)]);
        assert_eq!(text_chain_hashes(text, 2, 7, false, usize::MAX).unwrap(), vec![first]);
        assert_eq!(text_chain_hashes(b"", 2, 7, true, usize::MAX).unwrap(), Vec::<u64>::new());
    }

    #[test]
    fn a_full_block_ending_in_the_padded_pseudo_token_counts_as_full() {
        let text = b"012345"; // 2 pseudo-tokens, "0123" and "45\0\0": one full block of 2
        let expect = vec![xxh3_64_with_seed(b"012345\0\0", 3)];
        assert_eq!(text_chain_hashes(text, 2, 3, false, usize::MAX).unwrap(), expect);
        assert_eq!(text_chain_hashes(text, 2, 3, true, usize::MAX).unwrap(), expect);
        assert_eq!(text_chain_hashes(text, 1, 3, false, usize::MAX).unwrap().len(), 2);
    }

    #[test]
    fn keeps_at_most_max_tokens() {
        let text = b"abcdefghijklmnopqrstuvwxyz";
        let capped = text_chain_hashes(text, 2, 0, true, 3).unwrap();
        assert_eq!(capped, text_chain_hashes(&text[..12], 2, 0, true, usize::MAX).unwrap());
        assert!(text_chain_hashes(text, 2, 0, true, 0).unwrap().is_empty());
        assert_eq!(text_chain_hashes(text, 0, 0, true, 3), Err(HashError::ZeroBlockSize));
    }
}
