//! Decoding of vLLM KV-cache event batches (the msgpack payload, third ZMQ frame).
//!
//! Wire format (vLLM `vllm/distributed/kv_events.py`): an `EventBatch` is
//! `[ts, events, dp_rank]`; each event is either an array `["BlockStored", field, ...]` with every
//! declared field in order (vLLM <= 0.23) or a map `{"type": "BlockStored", field: value, ...}`
//! whose defaulted fields may be missing (vLLM >= 0.24). Both encodings may appear in one batch.
//!
//! Algorithm / Complexity: one forward pass over the payload with a bounds-checked cursor
//! (`reader::Reader`); O(payload bytes) time. Memory is O(payload bytes) too: a declared
//! length is checked against the bytes that remain before anything is allocated for it, so a
//! hostile payload cannot make the decoder reserve more than a small multiple of its own size.
//! Values that are skipped (unknown fields, unknown event types, `extra_keys` entries) are walked
//! iteratively with at most [`MAX_SKIP_DEPTH`] nested containers. A map event whose `type` is not
//! its first key is scanned twice (once to find the tag); msgspec always writes the tag first.
//! Token ids, most of a payload's bytes, are decoded 64 payload bytes (16-21 ids) at a time where
//! the processor has AVX-512 VBMI (`vbmi`), else by several chains at once in AVX2 steps of
//! three or four ids where it has AVX2 (`simd`), else by two scalar chains
//! ([`with_avx2_decoding`] and [`with_scalar_decoding`] narrow the choice, for comparisons), and
//! the payload's lines are prefetched before it is read.
//!
//! Decisions, beyond what vLLM specifies:
//! - Unknown event types are skipped and counted in [`EventBatch::unknown_events`], not errors,
//!   so a newer engine with a new event kind does not stall the feed. Their contents must still
//!   be well-formed msgpack (map keys str), nested at most [`MAX_SKIP_DEPTH`] deep per value.
//! - Unknown fields are ignored (map) or skipped (array positions past the known ones), likewise
//!   depth-bounded. Known fields are type-checked strictly; a repeated key in a map is an error.
//! - Required: `block_hashes`, `parent_block_hash`, `token_ids`, `block_size` for `BlockStored`
//!   (vLLM declares them without defaults, so they are always written); `block_hashes` for
//!   `BlockRemoved`. Every later field defaults to nil/absent; `medium` nil or absent means GPU.
//! - `medium` is matched ASCII-case-insensitively against GPU, CPU and STORAGE; any other name is
//!   an error (a tier the index cannot represent).
//! - Block hashes: an integer (negative int64 reinterpreted as its u64 bits) or a bin (its last 8
//!   bytes read big-endian, left-padded with zeros), so the int and bytes forms of one engine hash
//!   give the same u64 (vLLM's int form is the digest's last 8 bytes read big-endian).
//! - `extra_keys` (one entry per block, vLLM 0.32's shapes: the LoRA name on every block of an
//!   adapter, `(mm_identifier, offset)` pairs, the cache salt on a prompt's first block,
//!   prompt-embedding digests): [`BlockStored::has_extra_keys`] records which blocks carry any;
//!   string keys are read (a str that is not UTF-8 counts as an opaque key, never an error),
//!   so that keys that are only the LoRA name and a root block's salt are explained
//!   ([`BlockStored::cache_salt`]) and any other marks the event
//!   ([`BlockStored::opaque_extra_keys`]): no request's hashes can name such a block. A key
//!   that is not a string (a pair, bytes, a number) or an entry that is not an array stands
//!   for content beside the tokens ([`BlockStored::content_extra_keys`]: multimodal inputs,
//!   prompt embeddings); strings that are not explained are keys of another kind (an
//!   older engine's, a LoRA name the event does not give), counted apart by the index.
//! - The batch itself is also accepted as a map `{"ts", "events", "data_parallel_rank"}` (msgspec
//!   writes that if the struct is not declared `array_like`), and as a 2-element array (dp_rank
//!   omitted as a default); elements past the third are skipped.
//! - Skipped values are still checked to be well-formed msgpack, including the one extension the
//!   msgpack spec defines (timestamp, type -1: 4, 8 or 12 bytes, nanoseconds below 10^9); other
//!   extension types are opaque. Strings are checked for UTF-8 only where they are read.
//! - The pure-Python twin `llmsched.reference.vllm_events` accepts and rejects the same payloads
//!   (hypothesis tests compare the two on generated, re-encoded and mutated payloads).

mod reader;
mod simd;
mod vbmi;

use crate::buffer_pool::{self, BufferPool};
use crate::prefetch::prefetch_ptr;
use crate::protocols::Tier;
pub use crate::protocols::{BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};
pub use reader::MAX_SKIP_DEPTH;
use reader::{Container, Reader};
pub use simd::{with_avx2_decoding, with_scalar_decoding};

type Result<T> = std::result::Result<T, DecodeError>;

/// The shortest encoding of an event that yields an entry: `["AllBlocksCleared"]` (1 + 1 + 16
/// bytes). Bounds the up-front allocation for a declared event count.
const MIN_EVENT_BYTES: usize = 18;

/// The leading bytes of a payload prefetched before decoding (longer ones are prefetched as the
/// token arrays are read).
const PREFETCH_BYTES: usize = 64 << 10;

/// Hands a decoded batch's token arrays back to this thread's decoder, which reuses their
/// allocations for the next batches it decodes (a few per thread, of up to 65,536 ids each):
/// for a caller that applies a batch and drops it, as the prefix index does.
pub fn recycle(batch: EventBatch) {
    let mut events = batch.events;
    for event in events.drain(..) {
        match event {
            KvEvent::Stored(stored) => {
                reader::recycle_tokens(stored.token_ids);
                reader::recycle_hashes(stored.block_hashes);
            }
            KvEvent::Removed(removed) => reader::recycle_hashes(removed.block_hashes),
            KvEvent::AllCleared => {}
        }
    }
    buffer_pool::give(&EVENT_POOL, events);
}

thread_local! {
    /// Event lists handed back by [`recycle`] (a batch's list is a malloc and a free otherwise).
    static EVENT_POOL: BufferPool<KvEvent> = const { BufferPool::new(4, 1 << 10) };
}

/// Decodes one msgpack `EventBatch` payload. Never panics; a malformed payload gives a
/// [`DecodeError`] naming the byte offset and the problem.
pub fn decode_event_batch(payload: &[u8]) -> Result<EventBatch> {
    // A payload is read once, usually from memory (a socket's buffer, a queue of them): asking
    // for all of its lines now overlaps their misses, where the decoder's chains would otherwise
    // wait on each line in turn.
    for line in (0..payload.len().min(PREFETCH_BYTES)).step_by(64) {
        prefetch_ptr(payload.as_ptr().wrapping_add(line));
    }
    let mut reader = Reader::new(payload);
    let (at, container) = reader.container("EventBatch")?;
    let batch = match container {
        Container::Array(len) => decode_batch_array(&mut reader, at, len)?,
        Container::Map(len) => decode_batch_map(&mut reader, at, len)?,
    };
    if reader.remaining() > 0 {
        return Err(reader.error(
            reader.position(),
            format!("{} bytes of trailing data after the EventBatch", reader.remaining()),
        ));
    }
    Ok(batch)
}

fn decode_batch_array(reader: &mut Reader<'_>, at: usize, len: usize) -> Result<EventBatch> {
    if len < 2 {
        return Err(reader.error(
            at,
            format!("EventBatch array has {len} elements; [ts, events, dp_rank] expected"),
        ));
    }
    let ts = reader.number("EventBatch ts")?;
    let (events, unknown_events) = decode_events(reader)?;
    let dp_rank =
        if len >= 3 { reader.optional_integer_in::<i64>("EventBatch dp_rank")? } else { None };
    for _ in 3..len {
        reader.skip_value("EventBatch trailing element")?;
    }
    Ok(EventBatch { ts, events, dp_rank, unknown_events })
}

fn decode_batch_map(reader: &mut Reader<'_>, at: usize, len: usize) -> Result<EventBatch> {
    let mut ts = None;
    let mut events = None;
    let mut dp_rank = None;
    for _ in 0..len {
        let key_at = reader.position();
        let key = reader.str("EventBatch key")?;
        let duplicate = match key {
            "ts" => ts.replace(reader.number("EventBatch ts")?).is_some(),
            "events" => events.replace(decode_events(reader)?).is_some(),
            "data_parallel_rank" => dp_rank
                .replace(reader.optional_integer_in::<i64>("EventBatch data_parallel_rank")?)
                .is_some(),
            _ => {
                reader.skip_value("EventBatch unknown field")?;
                false
            }
        };
        if duplicate {
            return Err(reader.error(key_at, format!("EventBatch key {key:?} appears twice")));
        }
    }
    let (Some(ts), Some((events, unknown_events))) = (ts, events) else {
        return Err(reader.error(at, "EventBatch map needs both \"ts\" and \"events\""));
    };
    Ok(EventBatch { ts, events, dp_rank: dp_rank.flatten(), unknown_events })
}

fn decode_events(reader: &mut Reader<'_>) -> Result<(Vec<KvEvent>, u32)> {
    let count = reader.array_len("EventBatch events")?;
    let mut events = buffer_pool::take(&EVENT_POOL);
    events.reserve(count.min(reader.remaining() / MIN_EVENT_BYTES));
    let mut unknown = 0u32;
    for index in 0..count {
        match decode_event(reader).map_err(|err| err.within_event(index))? {
            Some(event) => events.push(event),
            None => unknown = unknown.saturating_add(1),
        }
    }
    Ok((events, unknown))
}

/// The event kinds this decoder knows, by tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKind {
    Stored,
    Removed,
    AllCleared,
    Unknown,
}

impl EventKind {
    fn from_tag(tag: &[u8]) -> Self {
        match tag {
            b"BlockStored" => EventKind::Stored,
            b"BlockRemoved" => EventKind::Removed,
            b"AllBlocksCleared" => EventKind::AllCleared,
            _ => EventKind::Unknown,
        }
    }

    /// Reads a type tag: a known one needs no UTF-8 check; any other must still be a str.
    fn read(reader: &mut Reader<'_>) -> Result<Self> {
        let (at, tag) = reader.str_bytes("event type tag")?;
        let kind = EventKind::from_tag(tag);
        if kind == EventKind::Unknown {
            reader.utf8(at, tag, "event type tag")?;
        }
        Ok(kind)
    }
}

/// A map key, as errors name it. Keys are read as bytes and checked to be UTF-8 only when they
/// are not a name the decoder knows (those are ASCII): a payload carries several keys per event,
/// and the check was a tenth of decoding a small event.
const KEY: &str = "event field name";

/// Decodes one event; `None` for an event of unknown type (skipped).
fn decode_event(reader: &mut Reader<'_>) -> Result<Option<KvEvent>> {
    let (at, container) = reader.container("event")?;
    match container {
        Container::Array(len) => decode_array_event(reader, at, len),
        Container::Map(len) => decode_map_event(reader, at, len),
    }
}

fn decode_array_event(reader: &mut Reader<'_>, at: usize, len: usize) -> Result<Option<KvEvent>> {
    if len == 0 {
        return Err(reader.error(at, "event array is empty; its first element is the type tag"));
    }
    let kind = EventKind::read(reader)?;
    let field_count = len - 1;
    match kind {
        EventKind::Stored => {
            let mut fields = StoredFields::default();
            for position in 0..field_count {
                fields.read(reader, StoredField::at_position(position))?;
            }
            fields.finish(reader, at).map(|event| Some(KvEvent::Stored(event)))
        }
        EventKind::Removed => {
            let mut fields = RemovedFields::default();
            for position in 0..field_count {
                fields.read(reader, RemovedField::at_position(position))?;
            }
            fields.finish(reader, at).map(|event| Some(KvEvent::Removed(event)))
        }
        EventKind::AllCleared | EventKind::Unknown => {
            for _ in 0..field_count {
                reader.skip_value("event field")?;
            }
            Ok((kind == EventKind::AllCleared).then_some(KvEvent::AllCleared))
        }
    }
}

const TYPE_KEY: &[u8] = b"type";

fn decode_map_event(reader: &mut Reader<'_>, at: usize, len: usize) -> Result<Option<KvEvent>> {
    let (kind, tag_first) = find_map_tag(reader, at, len)?;
    let mut stored = StoredFields::default();
    let mut removed = RemovedFields::default();
    // Read already when it was the first key (as it is in vLLM's payloads).
    let mut tag_seen = tag_first;
    for _ in usize::from(tag_first)..len {
        let (key_at, key) = reader.str_bytes(KEY)?;
        if key == TYPE_KEY {
            if tag_seen {
                return Err(reader.error(key_at, "event key \"type\" appears twice"));
            }
            tag_seen = true;
            EventKind::read(reader)?;
            continue;
        }
        match kind {
            EventKind::Stored => stored.read_named(reader, key_at, key)?,
            EventKind::Removed => removed.read_named(reader, key_at, key)?,
            EventKind::AllCleared | EventKind::Unknown => {
                reader.utf8(key_at, key, KEY)?;
                reader.skip_value("event field")?
            }
        }
    }
    match kind {
        EventKind::Stored => stored.finish(reader, at).map(|event| Some(KvEvent::Stored(event))),
        EventKind::Removed => removed.finish(reader, at).map(|event| Some(KvEvent::Removed(event))),
        EventKind::AllCleared => Ok(Some(KvEvent::AllCleared)),
        EventKind::Unknown => Ok(None),
    }
}

/// Reads the `type` tag of a map event. The tag is normally the first key: then the reader is
/// left after it and the second value is `true`. Otherwise the map is scanned ahead and the
/// reader rewound to its first key.
fn find_map_tag(reader: &mut Reader<'_>, at: usize, len: usize) -> Result<(EventKind, bool)> {
    let first_key_at = reader.position();
    for index in 0..len {
        let (key_at, key) = reader.str_bytes(KEY)?;
        if key == TYPE_KEY {
            let kind = EventKind::read(reader)?;
            if index == 0 {
                return Ok((kind, true));
            }
            reader.rewind_to(first_key_at);
            return Ok((kind, false));
        }
        reader.utf8(key_at, key, KEY)?;
        // Only well-formedness is checked here; the value is read again, fully, afterwards.
        reader.skip_value_unbounded("event field")?;
    }
    Err(reader.error(at, "event map has no \"type\" key"))
}

/// vLLM's `medium` name for a tier.
pub fn medium_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Storage => "STORAGE",
    }
}

/// The tier a `medium` names (ASCII case ignored); nil or absent means GPU.
fn parse_tier(reader: &Reader<'_>, at: usize, medium: Option<&str>) -> Result<Tier> {
    let Some(name) = medium else {
        return Ok(Tier::Gpu);
    };
    [Tier::Gpu, Tier::Cpu, Tier::Storage]
        .into_iter()
        .find(|&tier| name.eq_ignore_ascii_case(medium_name(tier)))
        .ok_or_else(|| reader.error(at, format!("medium {name:?} is not one of GPU, CPU, STORAGE")))
}

fn read_block_hashes(reader: &mut Reader<'_>) -> Result<Vec<u64>> {
    let count = reader.array_len("block_hashes")?;
    let mut hashes = reader::pooled_hashes(count);
    for _ in 0..count {
        hashes.push(reader.block_hash("block hash")?);
    }
    Ok(hashes)
}

/// One block's extra keys, as far as the index reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKeys<'a> {
    /// nil: none.
    None,
    /// An array of up to two UTF-8 strings: their count and the first two.
    Strings(u8, &'a str, &'a str),
    /// An array of strings only, but more than two of them or one that is not UTF-8.
    OtherStrings,
    /// Anything else (pairs, bytes, numbers, a value other than an array): keys that stand
    /// for content, such as multimodal inputs' `(identifier, offset)` pairs and
    /// prompt-embedding digests.
    Content,
}

/// Reads `extra_keys`: nil, or one entry per block.
fn read_extra_keys<'a>(reader: &mut Reader<'a>) -> Result<Option<Vec<BlockKeys<'a>>>> {
    if reader.take_nil("extra_keys")? {
        return Ok(None);
    }
    let count = reader.array_len("extra_keys")?;
    let mut blocks = Vec::with_capacity(count);
    for _ in 0..count {
        blocks.push(read_block_keys(reader)?);
    }
    Ok(Some(blocks))
}

fn read_block_keys<'a>(reader: &mut Reader<'a>) -> Result<BlockKeys<'a>> {
    const WHAT: &str = "extra_keys entry";
    if reader.take_nil(WHAT)? {
        return Ok(BlockKeys::None);
    }
    let start = reader.position();
    let array = matches!(
        reader.peek_marker(WHAT)?,
        rmp::Marker::FixArray(_) | rmp::Marker::Array16 | rmp::Marker::Array32
    );
    // Checked whole first, as every skipped value is (nesting bounded); an array read again.
    reader.skip_value(WHAT)?;
    if !array {
        return Ok(BlockKeys::Content);
    }
    reader.rewind_to(start);
    classify_block_keys(reader)
}

/// A checked array entry: its strings, or content (read to its end).
fn classify_block_keys<'a>(reader: &mut Reader<'a>) -> Result<BlockKeys<'a>> {
    const WHAT: &str = "extra_keys entry";
    let len = reader.array_len(WHAT)?;
    let mut strings = (0u8, "", "");
    let mut other = len > 2;
    let mut content = false;
    for _ in 0..len {
        let item = reader.position();
        let text = match reader.str_bytes(WHAT) {
            Ok((_, bytes)) => std::str::from_utf8(bytes).ok(),
            Err(_) => {
                reader.rewind_to(item);
                reader.skip_value_unbounded(WHAT)?;
                content = true;
                continue;
            }
        };
        match (text, strings.0) {
            (Some(text), 0) => strings = (1, text, ""),
            (Some(text), 1) => strings = (2, strings.1, text),
            _ => other = true,
        }
    }
    Ok(if content {
        BlockKeys::Content
    } else if other {
        BlockKeys::OtherStrings
    } else {
        BlockKeys::Strings(strings.0, strings.1, strings.2)
    })
}

/// What the blocks' extra keys say: the cache salt of a root block, whether any key is more
/// than the LoRA name and that salt, and whether any stands for content (not a string).
fn explain_extra_keys<'a>(
    blocks: &[BlockKeys<'a>],
    lora_name: Option<&str>,
    root: bool,
) -> (Option<&'a str>, bool, bool) {
    let mut salt = None;
    let mut opaque = false;
    for (i, keys) in blocks.iter().enumerate() {
        let (count, first, second) = match *keys {
            BlockKeys::None => continue,
            BlockKeys::Content => return (None, true, true),
            BlockKeys::OtherStrings => {
                opaque = true;
                continue;
            }
            BlockKeys::Strings(count, first, second) => (count, first, second),
        };
        // vLLM writes the LoRA name first, the salt last.
        let (rest, rest_first) = match lora_name {
            Some(lora) if count > 0 && first == lora => (count - 1, second),
            _ => (count, first),
        };
        match rest {
            0 => {}
            1 if i == 0 && root => salt = Some(rest_first),
            _ => opaque = true,
        }
    }
    if opaque {
        (None, true, false)
    } else {
        (salt, false, false)
    }
}

/// `BlockStored` fields in declaration order (vLLM's `BlockStored` class); `Ignored` covers the later
/// fields this decoder does not use (locality, ownership, session_id, lookahead_token_ids) and
/// anything newer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredField {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Ignored,
}

const STORED_FIELD_ORDER: [(StoredField, &str); 11] = [
    (StoredField::BlockHashes, "block_hashes"),
    (StoredField::ParentBlockHash, "parent_block_hash"),
    (StoredField::TokenIds, "token_ids"),
    (StoredField::BlockSize, "block_size"),
    (StoredField::LoraId, "lora_id"),
    (StoredField::Medium, "medium"),
    (StoredField::LoraName, "lora_name"),
    (StoredField::ExtraKeys, "extra_keys"),
    (StoredField::GroupIdx, "group_idx"),
    (StoredField::SpecKind, "kv_cache_spec_kind"),
    (StoredField::SlidingWindow, "kv_cache_spec_sliding_window"),
];

/// The fields without a default in vLLM's declaration; the first four positions.
const STORED_REQUIRED: usize = 4;

impl StoredField {
    fn at_position(position: usize) -> Self {
        STORED_FIELD_ORDER.get(position).map_or(StoredField::Ignored, |&(field, _)| field)
    }

    fn named(name: &[u8]) -> Self {
        STORED_FIELD_ORDER
            .iter()
            .find(|&&(_, known)| known.as_bytes() == name)
            .map_or(StoredField::Ignored, |&(field, _)| field)
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// The fields of one `BlockStored` event as they are read, in any order.
#[derive(Default)]
struct StoredFields<'a> {
    seen: u16,
    block_hashes: Vec<u64>,
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Option<&'a str>,
    medium_at: usize,
    lora_name: Option<&'a str>,
    extra_keys: Option<Vec<BlockKeys<'a>>>,
    group_idx: Option<u32>,
    spec_kind: Option<&'a str>,
    sliding_window: Option<u32>,
}

impl<'a> StoredFields<'a> {
    fn read_named(&mut self, reader: &mut Reader<'a>, key_at: usize, name: &[u8]) -> Result<()> {
        let field = StoredField::named(name);
        if field == StoredField::Ignored {
            reader.utf8(key_at, name, KEY)?;
        } else if self.seen & field.bit() != 0 {
            let name = String::from_utf8_lossy(name); // a known name: ASCII
            return Err(reader.error(key_at, format!("BlockStored field {name:?} appears twice")));
        }
        self.read(reader, field)
    }

    fn read(&mut self, reader: &mut Reader<'a>, field: StoredField) -> Result<()> {
        let at = reader.position();
        match field {
            StoredField::BlockHashes => self.block_hashes = read_block_hashes(reader)?,
            StoredField::ParentBlockHash => {
                self.parent_block_hash = if reader.take_nil("parent_block_hash")? {
                    None
                } else {
                    Some(reader.block_hash("parent_block_hash")?)
                };
            }
            StoredField::TokenIds => self.token_ids = reader.token_ids("token_ids")?,
            StoredField::BlockSize => {
                self.block_size = reader.integer_in::<u32>("block_size")?;
                if self.block_size == 0 {
                    return Err(reader.error(at, "block_size is 0"));
                }
            }
            StoredField::LoraId => self.lora_id = reader.optional_integer_in::<i64>("lora_id")?,
            StoredField::Medium => {
                self.medium = reader.optional_str("medium")?;
                self.medium_at = at;
            }
            StoredField::LoraName => self.lora_name = reader.optional_str("lora_name")?,
            StoredField::ExtraKeys => self.extra_keys = read_extra_keys(reader)?,
            StoredField::GroupIdx => {
                self.group_idx = reader.optional_integer_in::<u32>("group_idx")?
            }
            StoredField::SpecKind => self.spec_kind = reader.optional_str("kv_cache_spec_kind")?,
            StoredField::SlidingWindow => {
                self.sliding_window =
                    reader.optional_integer_in::<u32>("kv_cache_spec_sliding_window")?;
            }
            StoredField::Ignored => return reader.skip_value("BlockStored field"),
        }
        self.seen |= field.bit();
        Ok(())
    }

    fn finish(self, reader: &Reader<'_>, at: usize) -> Result<BlockStored> {
        for &(field, name) in &STORED_FIELD_ORDER[..STORED_REQUIRED] {
            if self.seen & field.bit() == 0 {
                return Err(reader.error(at, format!("BlockStored lacks {name}")));
            }
        }
        let blocks = self.block_hashes.len();
        let expected_tokens = blocks.checked_mul(self.block_size as usize);
        if expected_tokens != Some(self.token_ids.len()) {
            return Err(reader.error(
                at,
                format!(
                    "BlockStored has {} token_ids for {blocks} blocks of {} tokens",
                    self.token_ids.len(),
                    self.block_size
                ),
            ));
        }
        if let Some(extra) = &self.extra_keys {
            if extra.len() != blocks {
                return Err(reader.error(
                    at,
                    format!(
                        "BlockStored has {} extra_keys entries for {blocks} blocks",
                        extra.len()
                    ),
                ));
            }
        }
        let extra = self.extra_keys.unwrap_or_default();
        let (cache_salt, opaque_extra_keys, content_extra_keys) =
            explain_extra_keys(&extra, self.lora_name, self.parent_block_hash.is_none());
        Ok(BlockStored {
            medium: parse_tier(reader, self.medium_at, self.medium)?,
            block_hashes: self.block_hashes,
            parent_block_hash: self.parent_block_hash,
            token_ids: self.token_ids,
            block_size: self.block_size,
            lora_name: self.lora_name.map(str::to_owned),
            lora_id: self.lora_id,
            has_extra_keys: extra.iter().map(|keys| *keys != BlockKeys::None).collect(),
            cache_salt: cache_salt.map(str::to_owned),
            opaque_extra_keys,
            content_extra_keys,
            group_idx: self.group_idx,
            kv_cache_spec_kind: self.spec_kind.map(str::to_owned),
            kv_cache_spec_sliding_window: self.sliding_window,
        })
    }
}

/// `BlockRemoved` fields in declaration order; `Ignored` covers locality, ownership and newer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RemovedField {
    BlockHashes,
    Medium,
    GroupIdx,
    Ignored,
}

const REMOVED_FIELD_ORDER: [(RemovedField, &str); 3] = [
    (RemovedField::BlockHashes, "block_hashes"),
    (RemovedField::Medium, "medium"),
    (RemovedField::GroupIdx, "group_idx"),
];

impl RemovedField {
    fn at_position(position: usize) -> Self {
        REMOVED_FIELD_ORDER.get(position).map_or(RemovedField::Ignored, |&(field, _)| field)
    }

    fn named(name: &[u8]) -> Self {
        REMOVED_FIELD_ORDER
            .iter()
            .find(|&&(_, known)| known.as_bytes() == name)
            .map_or(RemovedField::Ignored, |&(field, _)| field)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

#[derive(Default)]
struct RemovedFields<'a> {
    seen: u8,
    block_hashes: Vec<u64>,
    medium: Option<&'a str>,
    medium_at: usize,
    group_idx: Option<u32>,
}

impl<'a> RemovedFields<'a> {
    fn read_named(&mut self, reader: &mut Reader<'a>, key_at: usize, name: &[u8]) -> Result<()> {
        let field = RemovedField::named(name);
        if field == RemovedField::Ignored {
            reader.utf8(key_at, name, KEY)?;
        } else if self.seen & field.bit() != 0 {
            let name = String::from_utf8_lossy(name); // a known name: ASCII
            return Err(reader.error(key_at, format!("BlockRemoved field {name:?} appears twice")));
        }
        self.read(reader, field)
    }

    fn read(&mut self, reader: &mut Reader<'a>, field: RemovedField) -> Result<()> {
        match field {
            RemovedField::BlockHashes => self.block_hashes = read_block_hashes(reader)?,
            RemovedField::Medium => {
                self.medium_at = reader.position();
                self.medium = reader.optional_str("medium")?;
            }
            RemovedField::GroupIdx => {
                self.group_idx = reader.optional_integer_in::<u32>("group_idx")?;
            }
            RemovedField::Ignored => return reader.skip_value("BlockRemoved field"),
        }
        self.seen |= field.bit();
        Ok(())
    }

    fn finish(self, reader: &Reader<'_>, at: usize) -> Result<BlockRemoved> {
        if self.seen & RemovedField::BlockHashes.bit() == 0 {
            return Err(reader.error(at, "BlockRemoved lacks block_hashes"));
        }
        Ok(BlockRemoved {
            block_hashes: self.block_hashes,
            medium: parse_tier(reader, self.medium_at, self.medium)?,
            group_idx: self.group_idx,
        })
    }
}
