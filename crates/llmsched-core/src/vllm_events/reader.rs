//! A bounds-checked msgpack cursor over a borrowed payload.
//!
//! Markers are classified with `rmp::Marker`; everything after the marker is read here from the
//! slice so that every failure carries the byte offset where it happened. Nothing is trusted:
//! a declared array, map, str or bin length is compared with the bytes that remain before any
//! caller allocates for it (every array element needs at least one byte, every map entry two),
//! skipping is iterative with a fixed nesting bound, and no read can index past the end.

use rmp::Marker;

use super::simd::Avx2;
use super::vbmi::Vbmi;
use super::DecodeError;
use crate::buffer_pool::{self, BufferPool};
use crate::prefetch::prefetch_ptr;

/// The deepest nesting of containers accepted inside one skipped (unknown or ignored) value.
/// vLLM's deepest legitimate value, an `extra_keys` entry, nests about three levels.
pub const MAX_SKIP_DEPTH: usize = 32;

pub type Result<T> = std::result::Result<T, DecodeError>;

/// A msgpack integer as written on the wire (msgpack keeps the signed/unsigned distinction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integer {
    Unsigned(u64),
    Signed(i64),
}

impl Integer {
    fn widened(self) -> i128 {
        match self {
            Integer::Unsigned(v) => i128::from(v),
            Integer::Signed(v) => i128::from(v),
        }
    }
}

/// Forward-only cursor; `pos` is always `<= buf.len()`.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A human name for what a marker introduces, for error messages.
pub fn marker_name(marker: Marker) -> &'static str {
    match marker {
        Marker::FixPos(_) | Marker::FixNeg(_) => "an integer",
        Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => "an integer",
        Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => "an integer",
        Marker::Null => "nil",
        Marker::True | Marker::False => "a bool",
        Marker::F32 | Marker::F64 => "a float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "a str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "a bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "an array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "a map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "an ext value",
        Marker::Reserved => "the reserved byte 0xc1",
    }
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Moves back to an earlier position (used to re-read a map whose tag was not first).
    pub fn rewind_to(&mut self, pos: usize) {
        debug_assert!(pos <= self.pos);
        self.pos = pos.min(self.buf.len());
    }

    pub fn error(&self, offset: usize, reason: impl Into<String>) -> DecodeError {
        DecodeError { offset, reason: reason.into() }
    }

    fn wrong_type(&self, at: usize, marker: Marker, expected: &str, what: &str) -> DecodeError {
        self.error(at, format!("{what}: expected {expected}, found {}", marker_name(marker)))
    }

    /// Takes the next `n` bytes.
    #[inline]
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.error(
                self.pos,
                format!("payload ends inside {what}: {n} bytes needed, {} left", self.remaining()),
            ));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    #[inline]
    fn take_array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let bytes = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    #[inline]
    fn be_u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take_array::<1>(what)?[0])
    }

    #[inline]
    fn be_u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_be_bytes(self.take_array(what)?))
    }

    #[inline]
    fn be_u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_be_bytes(self.take_array(what)?))
    }

    #[inline]
    fn be_u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_be_bytes(self.take_array(what)?))
    }

    /// Reads the next marker; returns it with the offset it was read at.
    #[inline]
    pub fn marker(&mut self, what: &str) -> Result<(usize, Marker)> {
        let at = self.pos;
        let byte = self.be_u8(what)?;
        Ok((at, Marker::from_u8(byte)))
    }

    /// The next marker without consuming it.
    #[inline]
    pub fn peek_marker(&self, what: &str) -> Result<Marker> {
        match self.buf.get(self.pos) {
            Some(&byte) => Ok(Marker::from_u8(byte)),
            None => Err(self.error(self.pos, format!("payload ends where {what} should start"))),
        }
    }

    /// True (and consumed) when the next value is nil.
    #[inline]
    pub fn take_nil(&mut self, what: &str) -> Result<bool> {
        if self.peek_marker(what)? == Marker::Null {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// Checks a declared element count against the bytes left (each element needs one byte or
    /// more), so callers may allocate `count` slots.
    fn checked_count(
        &self,
        at: usize,
        count: usize,
        min_bytes_each: usize,
        what: &str,
    ) -> Result<usize> {
        if count.saturating_mul(min_bytes_each) > self.remaining() {
            return Err(self.error(
                at,
                format!(
                    "{what} declares {count} elements but only {} bytes follow",
                    self.remaining()
                ),
            ));
        }
        Ok(count)
    }

    /// The length of the array header at `at` (after its marker was read), if `marker` is one.
    fn array_len_after(&mut self, marker: Marker, what: &str) -> Result<Option<usize>> {
        Ok(match marker {
            Marker::FixArray(n) => Some(usize::from(n)),
            Marker::Array16 => Some(usize::from(self.be_u16(what)?)),
            Marker::Array32 => Some(self.be_u32(what)? as usize),
            _ => None,
        })
    }

    fn map_len_after(&mut self, marker: Marker, what: &str) -> Result<Option<usize>> {
        Ok(match marker {
            Marker::FixMap(n) => Some(usize::from(n)),
            Marker::Map16 => Some(usize::from(self.be_u16(what)?)),
            Marker::Map32 => Some(self.be_u32(what)? as usize),
            _ => None,
        })
    }

    fn str_len_after(&mut self, marker: Marker, what: &str) -> Result<Option<usize>> {
        Ok(match marker {
            Marker::FixStr(n) => Some(usize::from(n)),
            Marker::Str8 => Some(usize::from(self.be_u8(what)?)),
            Marker::Str16 => Some(usize::from(self.be_u16(what)?)),
            Marker::Str32 => Some(self.be_u32(what)? as usize),
            _ => None,
        })
    }

    fn bin_len_after(&mut self, marker: Marker, what: &str) -> Result<Option<usize>> {
        Ok(match marker {
            Marker::Bin8 => Some(usize::from(self.be_u8(what)?)),
            Marker::Bin16 => Some(usize::from(self.be_u16(what)?)),
            Marker::Bin32 => Some(self.be_u32(what)? as usize),
            _ => None,
        })
    }

    /// Reads an array header; the returned count is safe to allocate for.
    pub fn array_len(&mut self, what: &str) -> Result<usize> {
        let (at, marker) = self.marker(what)?;
        match self.array_len_after(marker, what)? {
            Some(n) => self.checked_count(at, n, 1, what),
            None => Err(self.wrong_type(at, marker, "an array", what)),
        }
    }

    /// Reads a container header: `Ok(Container::Array(n))` or `Ok(Container::Map(n))`.
    pub fn container(&mut self, what: &str) -> Result<(usize, Container)> {
        let (at, marker) = self.marker(what)?;
        if let Some(n) = self.array_len_after(marker, what)? {
            return Ok((at, Container::Array(self.checked_count(at, n, 1, what)?)));
        }
        if let Some(n) = self.map_len_after(marker, what)? {
            return Ok((at, Container::Map(self.checked_count(at, n, 2, what)?)));
        }
        Err(self.wrong_type(at, marker, "an array or a map", what))
    }

    /// Reads a UTF-8 string without copying.
    pub fn str(&mut self, what: &str) -> Result<&'a str> {
        let (at, bytes) = self.str_bytes(what)?;
        self.utf8(at, bytes, what)
    }

    /// Reads a string's bytes without checking that they are UTF-8, with the offset of its
    /// marker: for names compared against known ASCII ones, which need no check when they
    /// match (pass any other to [`Reader::utf8`]).
    pub fn str_bytes(&mut self, what: &str) -> Result<(usize, &'a [u8])> {
        let (at, marker) = self.marker(what)?;
        let Some(len) = self.str_len_after(marker, what)? else {
            return Err(self.wrong_type(at, marker, "a str", what));
        };
        Ok((at, self.take(len, what)?))
    }

    /// `bytes` (a string read at `at`) as UTF-8, or the error [`Reader::str`] gives.
    pub fn utf8(&self, at: usize, bytes: &'a [u8], what: &str) -> Result<&'a str> {
        std::str::from_utf8(bytes)
            .map_err(|err| self.error(at, format!("{what}: str is not valid UTF-8 ({err})")))
    }

    /// Reads nil (None) or a UTF-8 string.
    pub fn optional_str(&mut self, what: &str) -> Result<Option<&'a str>> {
        if self.take_nil(what)? {
            return Ok(None);
        }
        self.str(what).map(Some)
    }

    /// Reads an integer of any width and signedness.
    pub fn integer(&mut self, what: &str) -> Result<Integer> {
        let (at, marker) = self.marker(what)?;
        self.integer_after(at, marker, what)
    }

    fn integer_after(&mut self, at: usize, marker: Marker, what: &str) -> Result<Integer> {
        Ok(match marker {
            Marker::FixPos(v) => Integer::Unsigned(u64::from(v)),
            Marker::FixNeg(v) => Integer::Signed(i64::from(v)),
            Marker::U8 => Integer::Unsigned(u64::from(self.be_u8(what)?)),
            Marker::U16 => Integer::Unsigned(u64::from(self.be_u16(what)?)),
            Marker::U32 => Integer::Unsigned(u64::from(self.be_u32(what)?)),
            Marker::U64 => Integer::Unsigned(self.be_u64(what)?),
            Marker::I8 => Integer::Signed(i64::from(self.be_u8(what)? as i8)),
            Marker::I16 => Integer::Signed(i64::from(self.be_u16(what)? as i16)),
            Marker::I32 => Integer::Signed(i64::from(self.be_u32(what)? as i32)),
            Marker::I64 => Integer::Signed(self.be_u64(what)? as i64),
            _ => return Err(self.wrong_type(at, marker, "an integer", what)),
        })
    }

    /// Reads an integer that must lie in `T`'s range.
    pub fn integer_in<T: TryFrom<i128>>(&mut self, what: &str) -> Result<T> {
        let at = self.pos;
        let value = self.integer(what)?.widened();
        T::try_from(value).map_err(|_| {
            self.error(
                at,
                format!("{what}: {value} is out of range for {}", std::any::type_name::<T>()),
            )
        })
    }

    /// Reads nil (None) or an integer in `T`'s range.
    pub fn optional_integer_in<T: TryFrom<i128>>(&mut self, what: &str) -> Result<Option<T>> {
        if self.take_nil(what)? {
            return Ok(None);
        }
        self.integer_in(what).map(Some)
    }

    /// Reads an array of token ids (integers in `0..=u32::MAX`): the hot loop of the decoder.
    ///
    /// Decoding msgpack integers is a serial chain (each marker gives the next one's position),
    /// so the loop keeps that chain short: the position lives in a local, the output is written
    /// through a pre-sized slice, and the encodings an engine writes for token ids (fixint, u8,
    /// u16, u32) are decoded two at a time without data-dependent branches: one 8-byte load holds
    /// the first marker and, at the first width, the second, and each value is the top bytes of
    /// the big-endian word after its marker (ids from a large vocabulary mix the u16 and u32
    /// forms at random, which a branch would mispredict). Other encodings, and the last few
    /// bytes of the payload, go through the general path.
    ///
    /// Where the processor has AVX2, the u16 and u32 forms are decoded three or four at a time
    /// instead (`super::simd`), by three chains over a long array; where it has AVX-512 VBMI, a
    /// 64-byte chunk at a time (`super::vbmi`). The ids and errors are the scalar path's (tests
    /// compare the three).
    pub fn token_ids(&mut self, what: &str) -> Result<Vec<u32>> {
        let count = self.array_len(what)?;
        let mut tokens = pooled_tokens(count);
        let vbmi = Vbmi::detect();
        let simd = Avx2::detect();
        let mut i = match (vbmi, simd) {
            _ if count < SPLIT_MIN => 0,
            // Ids mostly in the one- and two-byte forms (a vocabulary under 256), where every
            // vector step would fail: the scalar split.
            _ if (vbmi.is_some() || simd.is_some()) && self.first_two_ids_short() => {
                self.token_ids_split(&mut tokens)
            }
            (Some(_), _) => 0,
            (None, Some(avx2)) => avx2.enabled(|| self.token_ids_split_simd(avx2, &mut tokens)),
            (None, None) => self.token_ids_split(&mut tokens),
        };
        let buf = self.buf;
        let mut pos = self.pos;
        // Where the VBMI chunks are tried again after a run of few ids (ids mostly in other
        // forms, where a chunk costs more than the ids it takes).
        let mut vbmi_resume = 0;
        while i < count {
            match (vbmi, simd) {
                (Some(vbmi), _) if i >= vbmi_resume => {
                    let before = i;
                    (i, pos) = vbmi.run(buf, pos, &mut tokens, i);
                    if i - before < VBMI_MIN_RUN {
                        vbmi_resume = i + VBMI_BACKOFF;
                    }
                }
                (Some(_), _) => {
                    (i, pos) = pair_run(buf, pos, &mut tokens[..count.min(vbmi_resume)], i)
                }
                // Two to four ids per step (see `simd`); stops at any other form.
                (None, Some(avx2)) => {
                    (i, pos) = avx2.enabled(|| simd_run(avx2, buf, pos, &mut tokens, i));
                }
                (None, None) => (i, pos) = pair_run(buf, pos, &mut tokens, i),
            }
            if i == count {
                break;
            }
            // One id: a fast form while 8 bytes remain, else the general path.
            if let Some((value, width)) = fast_one(buf, pos) {
                tokens[i] = value;
                pos += width;
                i += 1;
                continue;
            }
            self.pos = pos;
            tokens[i] = self.token_id_general()?;
            pos = self.pos;
            i += 1;
        }
        self.pos = pos;
        Ok(tokens)
    }

    /// Whether the next two ids are positive fixints or u8s (one or two bytes each), the forms
    /// the vector steps do not take.
    fn first_two_ids_short(&self) -> bool {
        let short =
            |at: usize| self.buf.get(at).map(|&m| fast_width(m)).filter(|w| (1..=2).contains(w));
        short(self.pos).and_then(|w| short(self.pos + w)).is_some()
    }

    /// Decodes a leading part of a long token array (`tokens.len()` ids from the current
    /// position) in the fast forms, with two chains at once, and returns how many ids it
    /// decoded; the position is left after them.
    ///
    /// Each id's position is the previous id's position plus its width, so one chain cannot go
    /// faster than a load and a width computation per id. A second chain starts where the middle
    /// of the array is predicted to be (from the mean width of the first ids) and runs
    /// interleaved with the first, so the processor works on both at once. The second chain may
    /// start inside an id: it then reads data bytes as markers until it dies on one that is not
    /// a fast marker (it restarts a byte further on) or lands on a true id. Decoding is a
    /// function of the position, so where the first chain reaches a position the second one
    /// decoded, the second chain's ids are the first's from there on; the first chain is walked
    /// through the second's positions to find that meeting point, and the second chain's work is
    /// used only from there (all of it is dropped when they never meet).
    fn token_ids_split(&mut self, tokens: &mut [u32]) -> usize {
        let buf = self.buf;
        let count = tokens.len();
        let start = self.pos;
        let mut a = start;
        let mut i = 0;
        while i < SPLIT_PROBE {
            let Some((first, second, width)) = fast_pair(buf, a) else {
                self.pos = a;
                return i;
            };
            tokens[i] = first;
            tokens[i + 1] = second;
            a += width;
            i += 2;
        }
        let rest = count - i;
        let b = a + (a - start) * (rest / 2) / i;
        let kept = SPLIT_BUFFERS.try_with(|buffers| {
            let mut buffers = buffers.borrow_mut();
            let (b_values, b_positions) = &mut *buffers;
            // Written by index before they are read: grown, never cleared.
            if b_values.len() < rest / 2 + 2 {
                b_values.resize(rest / 2 + 2, 0);
                b_positions.resize(rest / 2 + 3, 0);
            }
            self.token_ids_second_chain(tokens, i, a, b, b_values, b_positions)
        });
        // Without the thread's buffers (a decode from a thread-local destructor), fresh ones.
        kept.unwrap_or_else(|_| {
            let (mut b_values, mut b_positions) = (vec![0; rest / 2 + 2], vec![0; rest / 2 + 3]);
            self.token_ids_second_chain(tokens, i, a, b, &mut b_values, &mut b_positions)
        })
    }

    /// [`Self::token_ids_split`] in AVX2 steps (see [`super::simd`]), with
    /// [`SIMD_CHAINS`] chains: the first from the start, each other one from where its share of
    /// the array is predicted to begin, all advancing three or four ids per step in turn; then the
    /// first chain meets each other one in order, by the same rule as with two chains. A chain
    /// whose step fails (an id in another form) takes one id on the scalar fast path and goes
    /// on, so an occasional fixint or u8 id does not end the split. (A step's chain is as long
    /// as the scalar path's but does more per step, so more chains pay here than there.)
    #[inline(always)]
    fn token_ids_split_simd(&mut self, avx2: Avx2, tokens: &mut [u32]) -> usize {
        let buf = self.buf;
        let count = tokens.len();
        let start = self.pos;
        let mut a = start;
        let mut i = 0;
        while i < SPLIT_PROBE {
            if let Some(step) = avx2.step(buf, a, &mut tokens[i..]) {
                i += usize::from(step.count);
                a += usize::from(step.consumed);
                continue;
            }
            let Some((value, width)) = fast_one(buf, a) else {
                self.pos = a;
                return i;
            };
            tokens[i] = value;
            a += width;
            i += 1;
        }
        let share = (count - i) / SIMD_CHAINS;
        let mut b = [0; SIMD_CHAINS - 1];
        for (j, b) in b.iter_mut().enumerate() {
            // Within the payload whatever its size (a start past it only wastes that chain).
            let ahead = (a - start).saturating_mul(share * (j + 1)) / i;
            *b = (a + ahead.min(buf.len())).min(buf.len());
        }
        // Each other chain decodes about `share` ids (as many steps as the first chain takes);
        // one that runs ahead stops when its slots are full.
        let slots = share + 16;
        // Taken out of the thread's slot for the call (a closure would not be compiled with
        // AVX2), put back after; fresh ones from a thread-local destructor.
        let (mut b_values, mut b_positions) =
            SPLIT_BUFFERS.try_with(|buffers| buffers.take()).unwrap_or_default();
        // Written by index before they are read: grown, never cleared.
        if b_values.len() < (SIMD_CHAINS - 1) * slots {
            b_values.resize((SIMD_CHAINS - 1) * slots, 0);
            b_positions.resize((SIMD_CHAINS - 1) * (slots + 1), 0);
        }
        let decoded =
            self.other_chains_simd(avx2, tokens, i, a, b, slots, &mut b_values, &mut b_positions);
        let _ = SPLIT_BUFFERS.try_with(|buffers| buffers.replace((b_values, b_positions)));
        decoded
    }

    /// The chains of [`Self::token_ids_split_simd`]: the first from its `i` ids ending at `a`,
    /// the others from `b`, chain `j`'s ids and their positions in the `j`-th `slots` of
    /// `b_values` and `slots + 1` of `b_positions`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn other_chains_simd(
        &mut self,
        avx2: Avx2,
        tokens: &mut [u32],
        mut i: usize,
        mut a: usize,
        mut b: [usize; SIMD_CHAINS - 1],
        slots: usize,
        b_values: &mut [u32],
        b_positions: &mut [usize],
    ) -> usize {
        let buf = self.buf;
        let count = tokens.len();
        let stop = i + (count - i) / SIMD_CHAINS;
        let mut nb = [0usize; SIMD_CHAINS - 1];
        let mut running = [true; SIMD_CHAINS - 1];
        while i < stop {
            // The payload is read once, from memory: each chain asks for its next lines early.
            prefetch_ptr(buf.as_ptr().wrapping_add(a.wrapping_add(PREFETCH_AHEAD)));
            if let Some(step) = avx2.step(buf, a, &mut tokens[i..]) {
                i += usize::from(step.count);
                a += usize::from(step.consumed);
            } else if let Some((value, width)) = fast_one(buf, a) {
                tokens[i] = value;
                a += width;
                i += 1;
            } else {
                break;
            }
            for j in 0..SIMD_CHAINS - 1 {
                // Room for a whole step (4 lanes) and the end mark.
                if !running[j] || nb[j] + 4 > slots {
                    continue;
                }
                let values = &mut b_values[j * slots..(j + 1) * slots];
                let positions = &mut b_positions[j * (slots + 1)..(j + 1) * (slots + 1)];
                let (bj, n) = (b[j], nb[j]);
                prefetch_ptr(buf.as_ptr().wrapping_add(bj.wrapping_add(PREFETCH_AHEAD)));
                if let Some(step) = avx2.step(buf, bj, &mut values[n..]) {
                    for (k, &offset) in step.starts.iter().enumerate() {
                        positions[n + k] = bj + usize::from(offset);
                    }
                    nb[j] += usize::from(step.count);
                    b[j] += usize::from(step.consumed);
                } else if let Some((value, width)) = fast_one(buf, bj) {
                    values[n] = value;
                    positions[n] = bj;
                    nb[j] += 1;
                    b[j] += width;
                } else if n >= SPLIT_TRUSTED_RUN {
                    // A long run is on the true ids (a misaligned chain dies within a few ids).
                    running[j] = false;
                } else {
                    nb[j] = 0;
                    b[j] += 1;
                }
            }
        }
        self.pos = a;
        for j in 0..SIMD_CHAINS - 1 {
            if i == count {
                break;
            }
            let values = &b_values[j * slots..j * slots + nb[j]];
            let positions = &mut b_positions[j * (slots + 1)..(j + 1) * (slots + 1)];
            i = self.merge_second_chain(tokens, i, self.pos, b[j], values, positions);
        }
        i
    }

    /// The rest of [`Self::token_ids_split`] from the first chain's `i` ids (ending at `a`) and the
    /// second chain's predicted start `b`, its `nb` ids and their positions (then the position
    /// after the last) written by index into `b_values` and `b_positions`, sized for every id
    /// it can decode.
    fn token_ids_second_chain(
        &mut self,
        tokens: &mut [u32],
        mut i: usize,
        mut a: usize,
        mut b: usize,
        b_values: &mut [u32],
        b_positions: &mut [usize],
    ) -> usize {
        let buf = self.buf;
        let count = tokens.len();
        let rest = count - i;
        let mut nb = 0;
        let mut b_running = true;
        for _ in 0..rest / 4 {
            let Some((first, second, width)) = fast_pair(buf, a) else { break };
            tokens[i] = first;
            tokens[i + 1] = second;
            a += width;
            i += 2;
            if !b_running {
                continue;
            }
            match fast_pair_at(buf, b) {
                Some((first, second, first_width, width)) => {
                    b_values[nb] = first;
                    b_values[nb + 1] = second;
                    b_positions[nb] = b;
                    b_positions[nb + 1] = b + first_width;
                    nb += 2;
                    b += width;
                }
                // A long run is on the true ids (a misaligned chain dies within a few ids): it
                // has reached the end of the array, or an id in another form. Keep it.
                None if nb >= SPLIT_TRUSTED_RUN => b_running = false,
                None => {
                    nb = 0;
                    b += 1;
                }
            }
        }
        self.merge_second_chain(tokens, i, a, b, &b_values[..nb], b_positions)
    }

    /// The end of a split decode: walks the first chain (its `i` ids, ending at `a`) on until it
    /// reaches a position where the second chain decoded an id (`b_values`, at `b_positions`,
    /// the second chain ending at `b`), then copies the second chain's ids from there; leaves
    /// the position after the last id decoded and returns how many there are.
    fn merge_second_chain(
        &mut self,
        tokens: &mut [u32],
        mut i: usize,
        mut a: usize,
        b: usize,
        b_values: &[u32],
        b_positions: &mut [usize],
    ) -> usize {
        let buf = self.buf;
        let count = tokens.len();
        let nb = b_values.len();
        b_positions[nb] = b;
        let mut k = 0;
        while k < nb {
            if a == b_positions[k] {
                let take = (count - i).min(nb - k);
                tokens[i..i + take].copy_from_slice(&b_values[k..k + take]);
                i += take;
                a = b_positions[k + take];
                break;
            }
            if a > b_positions[k] {
                k += 1;
                continue;
            }
            let Some((value, width)) = fast_one(buf, a).filter(|_| i < count) else { break };
            tokens[i] = value;
            a += width;
            i += 1;
        }
        self.pos = a;
        i
    }

    #[cold]
    #[inline(never)]
    fn token_id_general(&mut self) -> Result<u32> {
        let at = self.pos;
        let value = self.integer("token id")?.widened();
        u32::try_from(value)
            .map_err(|_| self.error(at, format!("token id {value} is outside 0..=4294967295")))
    }

    /// Reads a float (f32 or f64) or an integer, as f64.
    pub fn number(&mut self, what: &str) -> Result<f64> {
        let (at, marker) = self.marker(what)?;
        match marker {
            Marker::F32 => Ok(f64::from(f32::from_bits(self.be_u32(what)?))),
            Marker::F64 => Ok(f64::from_bits(self.be_u64(what)?)),
            _ => match self.integer_after(at, marker, what) {
                // Rounds to the nearest f64, as Python's float(int) does.
                Ok(Integer::Unsigned(v)) => Ok(v as f64),
                Ok(Integer::Signed(v)) => Ok(v as f64),
                Err(_) => Err(self.wrong_type(at, marker, "a float or an integer", what)),
            },
        }
    }

    /// Reads an opaque 64-bit block id: an integer (negative ones reinterpreted as their u64
    /// bits) or a bin whose last 8 bytes, read big-endian and left-padded with zeros, give the
    /// id. The two forms of one engine hash therefore agree.
    #[inline]
    pub fn block_hash(&mut self, what: &str) -> Result<u64> {
        // Fast path: the u64 form vLLM writes for int hashes (0xcf, then 8 bytes).
        if let [0xcf, b0, b1, b2, b3, b4, b5, b6, b7, ..] =
            *self.buf.get(self.pos..).unwrap_or_default()
        {
            self.pos += 9;
            return Ok(u64::from_be_bytes([b0, b1, b2, b3, b4, b5, b6, b7]));
        }
        self.block_hash_general(what)
    }

    #[cold]
    #[inline(never)]
    fn block_hash_general(&mut self, what: &str) -> Result<u64> {
        let (at, marker) = self.marker(what)?;
        if let Some(len) = self.bin_len_after(marker, what)? {
            let bytes = self.take(len, what)?;
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            return Ok(tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)));
        }
        match self.integer_after(at, marker, what) {
            Ok(Integer::Unsigned(v)) => Ok(v),
            Ok(Integer::Signed(v)) => Ok(v as u64),
            Err(_) => Err(self.wrong_type(at, marker, "an integer or a bin", what)),
        }
    }

    /// Skips one complete value of any type, without recursion: a fixed stack of pending
    /// element counts bounds the nesting at [`MAX_SKIP_DEPTH`] containers.
    pub fn skip_value(&mut self, what: &str) -> Result<()> {
        let mut pending = [0usize; MAX_SKIP_DEPTH];
        let mut depth = 0usize;
        loop {
            let (at, children) = self.skip_header(what)?;
            if let Some(children) = children {
                if depth == MAX_SKIP_DEPTH {
                    return Err(self.error(
                        at,
                        format!("{what}: nested deeper than {MAX_SKIP_DEPTH} containers"),
                    ));
                }
                if children > 0 {
                    pending[depth] = children;
                    depth += 1;
                    continue;
                }
            }
            // One value finished: retire it from the innermost open container, closing every
            // container that it completes.
            loop {
                if depth == 0 {
                    return Ok(());
                }
                pending[depth - 1] -= 1;
                if pending[depth - 1] > 0 {
                    break;
                }
                depth -= 1;
            }
        }
    }

    /// Skips one complete value of any nesting depth, checking only that it is well formed.
    /// Linear in its size with constant memory (a count of the values still owed). Used where a
    /// map is scanned ahead; the values are read again, with all checks, afterwards.
    pub fn skip_value_unbounded(&mut self, what: &str) -> Result<()> {
        let mut owed: usize = 1;
        while owed > 0 {
            owed -= 1;
            if let (_, Some(children)) = self.skip_header(what)? {
                // `children <= remaining bytes`, so this never overflows.
                owed += children;
            }
        }
        Ok(())
    }

    /// Consumes one value's header and any scalar payload; for a container returns how many
    /// values (elements, or keys plus values) follow it.
    fn skip_header(&mut self, what: &str) -> Result<(usize, Option<usize>)> {
        let (at, marker) = self.marker(what)?;
        if let Some(n) = self.array_len_after(marker, what)? {
            return self.children(at, n, 1, what);
        }
        if let Some(n) = self.map_len_after(marker, what)? {
            return self.children(at, n, 2, what);
        }
        let payload = match marker {
            // Handled just above.
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => 0,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => 0,
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(self.be_u8(what)?),
            Marker::Str16 | Marker::Bin16 => usize::from(self.be_u16(what)?),
            Marker::Str32 | Marker::Bin32 => self.be_u32(what)? as usize,
            Marker::FixExt1 => return self.skip_ext(at, 1, what),
            Marker::FixExt2 => return self.skip_ext(at, 2, what),
            Marker::FixExt4 => return self.skip_ext(at, 4, what),
            Marker::FixExt8 => return self.skip_ext(at, 8, what),
            Marker::FixExt16 => return self.skip_ext(at, 16, what),
            Marker::Ext8 => {
                let len = usize::from(self.be_u8(what)?);
                return self.skip_ext(at, len, what);
            }
            Marker::Ext16 => {
                let len = usize::from(self.be_u16(what)?);
                return self.skip_ext(at, len, what);
            }
            Marker::Ext32 => {
                let len = self.be_u32(what)? as usize;
                return self.skip_ext(at, len, what);
            }
            Marker::Reserved => {
                return Err(self.error(at, format!("{what}: the reserved byte 0xc1 is not msgpack")))
            }
        };
        self.take(payload, what)?;
        Ok((at, None))
    }

    /// Skips an extension value (type byte, then `len` data bytes). The one type the msgpack
    /// spec defines, the timestamp (-1), must be well formed: 4, 8 or 12 bytes with at most
    /// 999,999,999 nanoseconds.
    fn skip_ext(&mut self, at: usize, len: usize, what: &str) -> Result<(usize, Option<usize>)> {
        let ext_type = self.be_u8(what)? as i8;
        let data = self.take(len, what)?;
        if ext_type == -1 {
            let nanoseconds = match *data {
                [_, _, _, _] => 0,
                [b0, b1, b2, b3, b4, b5, b6, b7] => {
                    u64::from_be_bytes([b0, b1, b2, b3, b4, b5, b6, b7]) >> 34
                }
                [b0, b1, b2, b3, _, _, _, _, _, _, _, _] => {
                    u64::from(u32::from_be_bytes([b0, b1, b2, b3]))
                }
                _ => {
                    return Err(self.error(
                        at,
                        format!(
                            "{what}: a timestamp extension has {len} bytes; 4, 8 or 12 expected"
                        ),
                    ))
                }
            };
            if nanoseconds > 999_999_999 {
                return Err(self.error(
                    at,
                    format!("{what}: timestamp extension with {nanoseconds} nanoseconds"),
                ));
            }
        }
        Ok((at, None))
    }

    /// The number of values inside a container of `count` entries of `values_each` values.
    fn children(
        &self,
        at: usize,
        count: usize,
        values_each: usize,
        what: &str,
    ) -> Result<(usize, Option<usize>)> {
        let count = self.checked_count(at, count, values_each, what)?;
        Ok((at, Some(count * values_each)))
    }
}

/// Decodes pairs of ids in the fast forms from `pos` into `tokens[i..]` until one fails (an id
/// in another form, fewer than two slots or 16 bytes left); returns the new `(i, pos)`. One
/// 8-byte load gives the first marker and, shifted by the first width, the second, so the chain
/// is one load and two width computations per pair.
#[inline(always)]
fn pair_run(buf: &[u8], mut pos: usize, tokens: &mut [u32], mut i: usize) -> (usize, usize) {
    while i + 2 <= tokens.len() {
        let Some((first, second, width)) = fast_pair(buf, pos) else { break };
        tokens[i] = first;
        tokens[i + 1] = second;
        pos += width;
        i += 2;
    }
    (i, pos)
}

/// Decodes AVX2 steps from `pos` into `tokens[i..]` until one fails (an id in another form,
/// the end of the array or of the payload near); returns the new `(i, pos)`.
#[inline(always)]
fn simd_run(
    avx2: Avx2,
    buf: &[u8],
    mut pos: usize,
    tokens: &mut [u32],
    mut i: usize,
) -> (usize, usize) {
    while let Some(step) = avx2.step(buf, pos, &mut tokens[i..]) {
        i += usize::from(step.count);
        pos += usize::from(step.consumed);
    }
    (i, pos)
}

/// A container header: how many elements (array) or entries (map) follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Container {
    Array(usize),
    Map(usize),
}

/// The big-endian u64 of the first 8 bytes of `bytes` (at least 8).
#[inline(always)]
fn be_u64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(word)
}

/// The encoded width, marker included, of a token id in one of the forms an engine writes
/// (positive fixint: 1, u8: 2, u16: 3, u32: 5), or 0 for any other marker.
#[inline(always)]
fn fast_width(marker: u8) -> usize {
    usize::from(FAST_WIDTH[usize::from(marker)])
}

/// [`fast_width`] as a table: one load where the comparisons took a dozen instructions, in a
/// loop bound by how many instructions it issues per id (a 256-byte table stays in L1).
static FAST_WIDTH: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut m = 0;
    while m < 0x80 {
        table[m] = 1;
        m += 1;
    }
    table[0xcc] = 2;
    table[0xcd] = 3;
    table[0xce] = 5;
    table
};

/// The value bits of an id of each fast width once shifted down to the bottom of the word:
/// the marker itself for a fixint, else the `width - 1` bytes after it.
const FAST_MASK: [u64; 8] = [0, 0xff, 0xff, 0xffff, 0, 0xffff_ffff, 0, 0];

thread_local! {
    /// The other chains' ids and positions in [`Reader::token_ids_split`] and its AVX2 form,
    /// kept between calls: allocating them per token array (kilobytes each, beyond the
    /// allocator's small-size caches) cost a tenth of an ingest.
    static SPLIT_BUFFERS: std::cell::RefCell<(Vec<u32>, Vec<usize>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

thread_local! {
    /// Token buffers handed back by [`recycle_tokens`]. A token array of a few thousand ids is
    /// beyond the allocator's small-size caches: allocating one per event cost about a tenth of
    /// an ingest at 64-token blocks.
    static TOKEN_POOL: BufferPool<u32> = const { BufferPool::new(8, 1 << 16) };
}

/// A buffer of `count` ids for the decoder to overwrite, reusing one handed back on this thread
/// when there is one. A reused buffer keeps the ids it held: zeroing it first wrote every
/// byte twice (its ids are all written by the decode before the buffer is read).
fn pooled_tokens(count: usize) -> Vec<u32> {
    let mut tokens = buffer_pool::take(&TOKEN_POOL);
    tokens.truncate(count);
    tokens.resize(count, 0);
    tokens
}

/// Keeps `tokens`' allocation, ids and all, for a later token array decoded on this thread
/// (see [`crate::vllm_events::recycle`] and [`pooled_tokens`]).
pub fn recycle_tokens(tokens: Vec<u32>) {
    buffer_pool::give_filled(&TOKEN_POOL, tokens);
}

thread_local! {
    /// Block-hash lists handed back by [`recycle_hashes`]: one per event otherwise, a malloc
    /// and a free per event.
    static HASH_POOL: BufferPool<u64> = const { BufferPool::new(8, 1 << 14) };
}

/// An empty list with room for `count` block hashes, reusing one handed back on this thread
/// when there is one.
pub fn pooled_hashes(count: usize) -> Vec<u64> {
    let mut hashes = buffer_pool::take(&HASH_POOL);
    hashes.reserve(count);
    hashes
}

/// Keeps `hashes`' allocation for a later event's block hashes on this thread.
pub fn recycle_hashes(hashes: Vec<u64>) {
    buffer_pool::give(&HASH_POOL, hashes);
}

/// Token arrays of at least this many ids are decoded by two chains at once
/// ([`Reader::token_ids_split`]); shorter ones would not repay the second chain's restarts.
/// (`tests/vllm_events.rs` decodes arrays on both sides of it.)
const SPLIT_MIN: usize = 256;
/// A VBMI run that takes fewer ids than this (ids in other forms nearby) is not tried again
/// for the next [`VBMI_BACKOFF`] ids, which take the scalar pairs.
const VBMI_MIN_RUN: usize = 16;
/// See [`VBMI_MIN_RUN`].
const VBMI_BACKOFF: usize = 64;
/// How far ahead of each chain (bytes) the AVX2 split decode prefetches the payload.
const PREFETCH_AHEAD: usize = 512;
/// The chains of an AVX2 split decode ([`Reader::token_ids_split_simd`]).
const SIMD_CHAINS: usize = 3;
/// Ids decoded before the split, to estimate the mean width (even: they are read in pairs).
const SPLIT_PROBE: usize = 32;
/// A second chain that has decoded this many ids in the fast forms is taken to be on the true
/// ids: when it stops, it is kept rather than restarted.
const SPLIT_TRUSTED_RUN: usize = 16;

/// Two ids in the fast forms at `pos` and the width of both, or None (another form, or fewer
/// than 16 bytes left).
#[inline(always)]
fn fast_pair(buf: &[u8], pos: usize) -> Option<(u32, u32, usize)> {
    fast_pair_at(buf, pos).map(|(first, second, _, width)| (first, second, width))
}

/// [`fast_pair`], with the first id's width too.
///
/// One bounds check for both ids (a 16-byte window: the second id starts at most 5 bytes in
/// and is read as 8 bytes), the widths from a table and the values by shift and mask with no
/// branch on the width: the loop is bound by the instructions it issues per id as much as by
/// its chain of loads.
#[inline(always)]
fn fast_pair_at(buf: &[u8], pos: usize) -> Option<(u32, u32, usize, usize)> {
    let window: &[u8; 16] = buf.get(pos..pos.wrapping_add(16))?.try_into().ok()?;
    let first = be_u64(&window[..8]);
    let w0 = fast_width((first >> 56) as u8);
    // The byte at offset w0 (w0 <= 5); for w0 == 0 the pair is refused below.
    let w1 = fast_width(((first << (8 * (w0 & 7))) >> 56) as u8);
    if w0 == 0 || w1 == 0 {
        return None;
    }
    let second = be_u64(&window[(w0 & 7)..(w0 & 7) + 8]);
    Some((fast_value(first, w0), fast_value(second, w1), w0, w0 + w1))
}

/// One id in a fast form at `pos` and its width, or None (another form, or fewer than 8 bytes
/// left).
#[inline(always)]
fn fast_one(buf: &[u8], pos: usize) -> Option<(u32, usize)> {
    let word = be_u64(buf.get(pos..pos.wrapping_add(8))?);
    let width = fast_width((word >> 56) as u8);
    (width != 0).then(|| (fast_value(word, width), width))
}

/// The id encoded at the top of `word` (marker first, big-endian) in a fast form of `width`
/// (1 to 5): the marker for a fixint, else the `width - 1` bytes after it.
#[inline(always)]
fn fast_value(word: u64, width: usize) -> u32 {
    let width = width & 7;
    ((word >> ((64 - 8 * width) & 63)) & FAST_MASK[width]) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width() {
        let cases: &[(&[u8], Integer)] = &[
            (&[0x05], Integer::Unsigned(5)),
            (&[0xff], Integer::Signed(-1)),
            (&[0xcc, 0xff], Integer::Unsigned(255)),
            (&[0xcd, 0x01, 0x00], Integer::Unsigned(256)),
            (&[0xce, 0, 1, 0, 0], Integer::Unsigned(65536)),
            (&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], Integer::Unsigned(u64::MAX)),
            (&[0xd0, 0x80], Integer::Signed(-128)),
            (&[0xd1, 0x80, 0x00], Integer::Signed(-32768)),
            (&[0xd2, 0x80, 0, 0, 0], Integer::Signed(i64::from(i32::MIN))),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Integer::Signed(i64::MIN)),
        ];
        for (bytes, expected) in cases {
            let mut reader = Reader::new(bytes);
            assert_eq!(reader.integer("x").unwrap(), *expected, "{bytes:02x?}");
            assert_eq!(reader.remaining(), 0);
        }
    }

    #[test]
    fn block_hash_forms_agree() {
        let as_uint = [0xcf, 0xf8, 0x92, 0x55, 0x3b, 0xef, 0x84, 0xef, 0x0c];
        let as_int = [0xd3, 0xf8, 0x92, 0x55, 0x3b, 0xef, 0x84, 0xef, 0x0c];
        let mut as_bin = vec![0xc4, 32];
        as_bin.extend([0xaa; 24]);
        as_bin.extend([0xf8, 0x92, 0x55, 0x3b, 0xef, 0x84, 0xef, 0x0c]);
        let expected = 0xf892_553b_ef84_ef0c_u64;
        for bytes in [&as_uint[..], &as_int[..], &as_bin[..]] {
            assert_eq!(Reader::new(bytes).block_hash("h").unwrap(), expected);
        }
        // Short bins are left-padded with zeros.
        assert_eq!(Reader::new(&[0xc4, 2, 0x01, 0x02]).block_hash("h").unwrap(), 0x0102);
        assert_eq!(Reader::new(&[0xc4, 0]).block_hash("h").unwrap(), 0);
    }

    #[test]
    fn declared_lengths_are_checked_before_use() {
        let err = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x00]).array_len("a").unwrap_err();
        assert!(err.reason.contains("declares 4294967295 elements"), "{err}");
        let err = Reader::new(&[0xdf, 0x00, 0x00, 0x00, 0x02, 0x01, 0x02, 0x03])
            .container("m")
            .unwrap_err();
        assert!(err.reason.contains("declares 2 elements"), "{err}");
        let err = Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]).str("s").unwrap_err();
        assert!(err.reason.contains("payload ends inside"), "{err}");
    }

    #[test]
    fn skip_handles_every_kind_and_bounds_depth() {
        let mixed: &[u8] = &[
            0x94, 0xc0, 0xd4, 0x01, 0x02, 0x82, 0xa1, b'a', 0xc7, 0x01, 0x05, 0xff, 0xa1, b'b',
            0x90, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let mut reader = Reader::new(mixed);
        reader.skip_value("v").unwrap();
        assert_eq!(reader.remaining(), 0);

        let nested = |depth: usize| {
            let mut bytes = vec![0x91; depth - 1];
            bytes.push(0x90);
            bytes
        };
        Reader::new(&nested(MAX_SKIP_DEPTH)).skip_value("v").unwrap();
        let err = Reader::new(&nested(MAX_SKIP_DEPTH + 1)).skip_value("v").unwrap_err();
        assert!(err.reason.contains("nested deeper"), "{err}");
        assert_eq!(err.offset, MAX_SKIP_DEPTH);
        // The unbounded skip takes any depth in constant memory.
        let deep = nested(1_000_000);
        let mut reader = Reader::new(&deep);
        reader.skip_value_unbounded("v").unwrap();
        assert_eq!(reader.remaining(), 0);
    }

    #[test]
    fn timestamp_extensions_are_validated() {
        let valid: [&[u8]; 3] = [
            &[0xd6, 0xff, 0, 0, 0, 1],
            &[0xd7, 0xff, 0xee, 0x6b, 0x27, 0xfc, 0, 0, 0, 0],
            &[0xc7, 12, 0xff, 0x3b, 0x9a, 0xc9, 0xff, 0, 0, 0, 0, 0, 0, 0, 0],
        ];
        for bytes in valid {
            Reader::new(bytes).skip_value("t").unwrap();
        }
        let invalid: [&[u8]; 3] = [
            &[0xd4, 0xff, 0x01],
            &[0xd7, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0],
            &[0xc7, 12, 0xff, 0x3b, 0x9a, 0xca, 0x00, 0, 0, 0, 0, 0, 0, 0, 0],
        ];
        for bytes in invalid {
            let err = Reader::new(bytes).skip_value("t").unwrap_err();
            assert!(err.reason.contains("timestamp"), "{err}");
        }
        // Other extension types are opaque.
        Reader::new(&[0xd4, 0x05, 0x01]).skip_value("t").unwrap();
    }

    #[test]
    fn reserved_byte_and_bad_utf8_are_rejected() {
        assert!(Reader::new(&[0xc1]).skip_value("v").is_err());
        assert!(Reader::new(&[0xc1]).skip_value_unbounded("v").is_err());
        let err = Reader::new(&[0xa2, 0xff, 0xfe]).str("s").unwrap_err();
        assert!(err.reason.contains("UTF-8"), "{err}");
    }
}
