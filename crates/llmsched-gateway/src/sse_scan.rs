//! One pass over a frame of a Completions or Chat Completions event stream, finding all the
//! relay reads in it: the `data: ` events (the output tokens), the usage block's
//! `"completion_tokens":`, `data: [DONE]` (and whether it starts a line: the stream's end
//! event) and a string `"finish_reason":` (the last token's, the stream's end near).
//!
//! Every one of these holds a `:`, once, so the frame is searched for that byte alone (16
//! bytes at a time, [`colons`]) and each hit is told apart by the bytes around it (first the
//! four before it, which turn away most of the JSON keys); the searches of each needle over
//! the whole frame (four to six a frame) are gone. The same pass says whether the frame holds a
//! CR (SSE allows CR and CRLF line ends, read as LF).

/// What [`scan`] found in a frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Found {
    /// `data: ` fields but `data: [DONE]`, anywhere in the frame (one token each).
    pub events: u64,
    /// The count after the frame's first `"completion_tokens":` (spaces skipped), when it has
    /// one that a `u64` holds.
    pub usage: Option<u64>,
    /// Whether the frame holds `data: [DONE]`.
    pub done_field: bool,
    /// Whether the frame holds `\ndata: [DONE]` or `\ndata:[DONE]` (the `[DONE]` event, its
    /// line started within the frame; line ends made LF by the caller).
    pub done_line: bool,
    /// Whether a `"finish_reason":` has a string value (spaces skipped).
    pub finish: bool,
    /// Whether the frame holds a CR (then its line ends are to be made LF and the frame read
    /// again: [`crate::responses::LineEnds::next`]; found in the same pass, so that a stream
    /// of LF line ends, the usual, is not searched for CRs again).
    pub cr: bool,
}

impl Found {
    /// Whether the stream's end is near: `data: [DONE]`, or the last token's
    /// `finish_reason`.
    pub(crate) fn ends_soon(&self) -> bool {
        self.done_field || self.finish
    }
}

/// Scans an SSE frame once ([`Found`]).
pub(crate) fn scan(data: &[u8]) -> Found {
    let mut found = Found::default();
    let mut usage_read = false;
    let mut crs = Crs::default();
    let mut base = 0;
    while base < data.len() {
        let (from, mut bits) = match data.get(base..base + 16) {
            Some(chunk) => (base, colons(chunk.try_into().unwrap_or(&[0; 16]), &mut crs)),
            None => match data.last_chunk::<16>() {
                // The frame's last 16 bytes, those read already masked off: no copy.
                Some(last) => {
                    let read = base - (data.len() - 16);
                    (data.len() - 16, colons(last, &mut crs) >> read << read)
                }
                None => {
                    // A frame shorter than 16 bytes, padded (a zero is no `:` and no CR).
                    let mut last = [0; 16];
                    last[..data.len()].copy_from_slice(data);
                    (0, colons(&last, &mut crs))
                }
            },
        };
        while bits != 0 {
            let at = from + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            colon(data, at, &mut found, &mut usage_read);
        }
        base += 16;
    }
    found.cr = crs.any();
    found
}

/// The four bytes before the `:` of each needle, as a little-endian `u32` ([`colon`]):
/// `data:`, `"finish_reason":` and `"completion_tokens":`.
const DATA: u32 = u32::from_le_bytes(*b"data");
const REASON: u32 = u32::from_le_bytes(*b"son\"");
const TOKENS: u32 = u32::from_le_bytes(*b"ens\"");

/// Tells what the `:` at `at` of `data` is ([`scan`]). Most of a frame's `:` end JSON keys
/// that are none of the needles: one load of the four bytes before and three compares turn
/// them away (no needle has fewer than four bytes before its `:`).
#[inline(always)]
fn colon(data: &[u8], at: usize, found: &mut Found, usage_read: &mut bool) {
    let key = match at.checked_sub(4).and_then(|from| data.get(from..at)) {
        Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
        _ => return,
    };
    if key != DATA && key != REASON && key != TOKENS {
        return;
    }
    let (before, after) = (&data[..at], &data[at + 1..]);
    match before {
        [.., b'd', b'a', b't', b'a'] => {
            let (spaced, value) = match after {
                [b' ', rest @ ..] => (true, rest),
                _ => (false, after),
            };
            if !value.starts_with(b"[DONE]") {
                found.events += u64::from(spaced);
                return;
            }
            found.done_field |= spaced;
            found.done_line |= before.len() > 4 && before[before.len() - 5] == b'\n';
        }
        [.., b'n', b'"'] if before.ends_with(b"\"finish_reason\"") => {
            found.finish |= after.iter().find(|b| **b != b' ') == Some(&b'"');
        }
        [.., b's', b'"'] if !*usage_read && before.ends_with(b"\"completion_tokens\"") => {
            *usage_read = true;
            found.usage = count(after);
        }
        _ => {}
    }
}

/// Whether any of the chunks [`colons`] read held a CR: the compares or-ed together as they
/// come, one test at the end.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[derive(Clone, Copy)]
struct Crs(std::arch::x86_64::__m128i);

#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
impl Default for Crs {
    fn default() -> Self {
        // SAFETY: SSE2 is enabled at compile time; the load reads the 16 bytes of the array.
        Crs(unsafe { std::arch::x86_64::_mm_loadu_si128([0u8; 16].as_ptr().cast()) })
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
impl Crs {
    fn any(self) -> bool {
        let mut lanes = [0u8; 16];
        // SAFETY: SSE2 is enabled at compile time, and the store writes 16 bytes to an array
        // of 16.
        unsafe { std::arch::x86_64::_mm_storeu_si128(lanes.as_mut_ptr().cast(), self.0) };
        lanes != [0; 16]
    }
}

/// Bit `i` set where `chunk[i]` is a `:`; a CR among the bytes is noted in `crs` (SSE2, which
/// every x86-64 processor has).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn colons(chunk: &[u8; 16], crs: &mut Crs) -> u32 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is enabled at compile time (the `cfg` above), and the load reads the 16
    // bytes of `chunk` (unaligned loads allowed).
    unsafe {
        let bytes = _mm_loadu_si128(chunk.as_ptr().cast());
        crs.0 = _mm_or_si128(crs.0, _mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'\r' as i8)));
        _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b':' as i8))) as u32
    }
}

/// Whether any of the chunks [`colons`] read held a CR.
#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
#[derive(Clone, Copy, Default)]
struct Crs(u32);

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
impl Crs {
    fn any(self) -> bool {
        self.0 != 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
fn colons(chunk: &[u8; 16], crs: &mut Crs) -> u32 {
    crs.0 |= bytes_portable(chunk, b'\r');
    bytes_portable(chunk, b':')
}

/// Bit `i` set where `chunk[i]` is `byte` ([`colons`]), eight bytes at a time in a `u64`,
/// without SIMD.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "sse2", not(test)), allow(dead_code))]
fn bytes_portable(chunk: &[u8; 16], byte: u8) -> u32 {
    let word = |half: &[u8]| {
        let x =
            u64::from_le_bytes(half.try_into().unwrap_or([0; 8])) ^ u64::from_le_bytes([byte; 8]);
        // The high bit of each byte that is zero (exactly: no borrow between bytes).
        let high =
            !(((x & 0x7f7f_7f7f_7f7f_7f7f) + 0x7f7f_7f7f_7f7f_7f7f) | x | 0x7f7f_7f7f_7f7f_7f7f);
        // Those eight bits gathered into one byte, byte i's as bit i.
        (((high >> 7).wrapping_mul(0x0102_0408_1020_4080)) >> 56) as u32
    };
    word(&chunk[..8]) | word(&chunk[8..]) << 8
}

/// The count at the start of `value` (after spaces), as `u64`.
pub(crate) fn count(value: &[u8]) -> Option<u64> {
    let start = value.iter().take_while(|b| **b == b' ').count();
    let digits = value[start..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&value[start..start + digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_of_events_is_read_in_one_pass() {
        let frame = b"data: {\"choices\":[{\"text\":\"a\",\"finish_reason\":null}]}\n\n\
            data: {\"choices\":[{\"text\":\"b\",\"finish_reason\": \"length\"}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"completion_tokens\": 2}}\n\ndata: [DONE]\n\n";
        let found = scan(frame);
        assert_eq!(
            found,
            Found {
                events: 3,
                usage: Some(2),
                done_field: true,
                done_line: true,
                finish: true,
                cr: false
            }
        );
        assert!(found.ends_soon());
    }

    #[test]
    fn done_inside_a_token_or_unspaced_or_at_the_start_is_told_apart() {
        // In a token's text: the field but no line.
        let found = scan(b"data: {\"text\":\"data: [DONE]\"}\n\n");
        assert_eq!((found.events, found.done_field, found.done_line), (1, true, false));
        // Without the space: the line (after a newline) but not the field.
        let found = scan(b"\n\ndata:[DONE]\n\n");
        assert_eq!((found.events, found.done_field, found.done_line), (0, false, true));
        // At the frame's start the line is the caller's to tell (the bytes before).
        let found = scan(b"data: [DONE]\n\n");
        assert_eq!((found.events, found.done_field, found.done_line), (0, true, false));
        // A null finish reason, an escaped quote's `:`, and a key ending alike: none.
        let found = scan(b"data: {\"x\\\":\":1,\"finish_reason\": null,\"reason\":\"a\"}");
        assert_eq!(found, Found { events: 1, ..Found::default() });
    }

    #[test]
    fn keys_ending_like_a_needle_are_told_apart_past_the_four_bytes() {
        // `son"`, `ens"` and `data` before the `:`, but other keys (`stop_reason` is vLLM's).
        let frame = b"data: {\"stop_reason\": \"x\",\"prompt_tokens\":5,\"reason\":\"y\",\
            \"tens\":1,\"metadata\":2,\"xdata\":3,\"ens\":4}";
        assert_eq!(scan(frame), Found { events: 1, ..Found::default() });
        // A needle near the frame's start (fewer than four bytes before a `:`: none).
        assert_eq!(scan(b":ata: ").events, 0);
        assert_eq!(scan(b"a:data:").events, 0);
        assert_eq!(scan(b"data: x").events, 1);
        assert_eq!(scan(b"metadata: x").events, 1);
        assert_eq!(scan(b"\"completion_tokens\":4").usage, Some(4));
        assert!(scan(b"\"finish_reason\":\"stop\"").finish);
    }

    /// [`scan`] as a byte loop over the whole frame: each needle looked for at each offset.
    fn scan_bytewise(data: &[u8]) -> Found {
        let mut found = Found::default();
        let at = |i: usize, needle: &[u8]| data[i..].starts_with(needle);
        let mut usage_read = false;
        found.cr = data.contains(&b'\r');
        for i in 0..data.len() {
            if at(i, b"data: ") {
                if at(i + 6, b"[DONE]") {
                    found.done_field = true;
                } else {
                    found.events += 1;
                }
            }
            if i > 0 && data[i - 1] == b'\n' && (at(i, b"data: [DONE]") || at(i, b"data:[DONE]")) {
                found.done_line = true;
            }
            if at(i, b"\"finish_reason\":") {
                let value = &data[i + 16..];
                found.finish |= value.iter().find(|b| **b != b' ') == Some(&b'"');
            }
            if !usage_read && at(i, b"\"completion_tokens\":") {
                usage_read = true;
                found.usage = count(&data[i + 20..]);
            }
        }
        found
    }

    proptest::proptest! {
        #[test]
        fn a_frame_is_read_as_a_byte_loop_reads_it(pieces in proptest::collection::vec(
            proptest::sample::select(vec![
                &b"data"[..], b": ", b":", b"[DONE]", b"\n", b"\"", b"son\"", b"ens\"",
                b"\"finish_reason\"", b"\"stop_reason\"", b"\"completion_tokens\"",
                b"\"prompt_tokens\"", b" ", b"12", b"null", b"x", b"meta", b"{\"id\":", b"\r",
            ]),
            0..40,
        )) {
            let frame: Vec<u8> = pieces.concat();
            proptest::prop_assert_eq!(scan(&frame), scan_bytewise(&frame));
        }

        #[test]
        fn colons_are_found_with_simd_as_without(chunk in proptest::array::uniform16(
            proptest::sample::select(vec![b':', b'9', b'z', 0, 0xba, 0x3b, 0x39, 0xff, b'\r', 0x8d])
        )) {
            let slow = |byte: u8| {
                chunk.iter().enumerate().fold(0, |m, (i, b)| m | u32::from(*b == byte) << i)
            };
            let mut crs = Crs::default();
            proptest::prop_assert_eq!(colons(&chunk, &mut crs), slow(b':'));
            proptest::prop_assert_eq!(crs.any(), slow(b'\r') != 0);
            proptest::prop_assert_eq!(bytes_portable(&chunk, b':'), slow(b':'));
            proptest::prop_assert_eq!(bytes_portable(&chunk, b'\r'), slow(b'\r'));
        }
    }

    #[test]
    fn every_length_and_offset_of_a_frame_is_read() {
        // Needles across and at the ends of the 16-byte chunks, the last chunk read from the
        // frame's end (overlapping) or padded.
        for pad in 0..40 {
            for tail in 0..20 {
                for needle in [&b"data: [DONE]\r"[..], b"\"completion_tokens\":7", b"data: x"] {
                    let frame = [vec![b'x'; pad], needle.to_vec(), vec![b':'; tail]].concat();
                    assert_eq!(scan(&frame), scan_bytewise(&frame), "{pad} {tail} {needle:?}");
                }
            }
        }
    }

    #[test]
    fn the_first_usage_count_is_read_even_without_digits() {
        assert_eq!(scan(b"{\"completion_tokens\":  17,\"x\":1}").usage, Some(17));
        let first_null = b"{\"completion_tokens\":null},{\"completion_tokens\":3}";
        assert_eq!(scan(first_null).usage, None);
        assert_eq!(scan(b"{\"completion_tokens\":18446744073709551616}").usage, None);
        assert_eq!(scan(b"{\"completion_tokens\":").usage, None);
    }
}
