//! An exact cache of the token ids of chat prompts' pieces: the text between the tokenizer's
//! added tokens (a chat template's role markers), which Hugging Face tokenizers encode
//! independently of each other.
//!
//! Model. `tokenizers` encodes a text in stages: its added vocabulary splits the text at the
//! added tokens (their ids are fixed), then each remaining piece is normalized,
//! pre-tokenized and run through the model on its own; with `add_special_tokens` off the
//! post-processor adds nothing. A piece's ids therefore depend on its text and on one bit of
//! context, whether it starts the text (Metaspace's `prepend_scheme: first` reads the
//! piece's offset). The cache maps (piece text, starts the text) to ids: a chat whose
//! system message of 1,000 tokens repeats on every turn encodes it once.
//!
//! A miss encodes the piece with the tokenizer itself: alone when it starts the text, else
//! after an *anchor* (an added token without strip or single-word rules, its id dropped
//! again), so that the piece sits at a non-zero offset as it did in the whole text. Either
//! way the split of that text is checked to be the anchor and the piece, nothing else (an
//! added token whose single-word rule matched differently there falls back to encoding
//! the whole text).
//!
//! Exactness is checked at load ([`PieceEncoder::new`]): a tokenizer that truncates or pads,
//! a BPE model with dropout, added tokens matched after normalization, or any probe text
//! whose piecewise ids differ from its whole ids (encoded cold, then warm) turns the cache
//! off, with the reason kept for stats and `/metrics`.
//!
//! Every piece is cached, short ones too: encoding even a one-character piece through the
//! tokenizer costs microseconds of fixed pipeline work (building the pre-tokenized string,
//! its alignments and an `Encoding`), a lookup a small fraction of one.
//!
//! Chunks. A long piece is cut into chunks of about [`CHUNK_BYTES`], each cached on its own
//! as a piece is (the first chunk of a piece that starts the text keeps that bit, the others
//! are encoded after the anchor). A cut falls only where the text has an ASCII letter, digit
//! or punctuation mark, a space, then an ASCII letter (`chunk_ends`): there every
//! pre-tokenizer in use (byte-level and Llama-3-style regular expressions, Metaspace,
//! whitespace and BERT splitting) starts a new word at the space, and no byte-pair merge
//! crosses a word. The cuts depend only on the text before them, so two prompts sharing a
//! long prefix (a `/v1/completions` prompt that repeats its instructions, a conversation's
//! earlier turns in one message) share every chunk before the first one where they differ.
//! A chunk not in the cache is looked up word by word, cut at every such boundary
//! (`word_ends`), and only the words not in the cache go through the tokenizer: a text no
//! prompt has shared yet is still mostly words seen before. Whether cutting is exact is
//! proved at load as the pieces are, on long probe texts: a tokenizer whose chunked ids
//! differ from its whole ids on any of them (the older Llama layout, whose `Prepend`
//! normalizer adds a space marker to every piece it is handed, is one) keeps the piece
//! cache with chunks off, and says why.
//!
//! Completions. A `/v1/completions` prompt is encoded with special tokens added; for a single
//! text every post-processor adds fixed ids before and after the others (a `<s>` or
//! `[CLS]` ... `[SEP]`), found at load from the probe texts and checked on each of them, so
//! such prompts go through the same cache with those ids put around.
//!
//! The split at added tokens: when every added token is matched on the raw text without
//! strip or single-word rules (chat models' role markers are), it is a leftmost-longest
//! Aho-Corasick search over their contents, the matching the tokenizer's own trie does,
//! checked against the tokenizer's split on every probe text; otherwise the tokenizer's
//! added vocabulary splits (`extract_and_normalize` without the normalizer, slower: it builds
//! alignments for each byte).
//!
//! Complexity: per prompt one scan of the text for added tokens and one for word boundaries,
//! one hash and comparison per short piece or chunk, the ids copied out; the tokenizer's normalizer, pre-tokenizer
//! (regular expressions) and model run on misses only. Memory: at most `capacity` bytes of
//! piece text and ids (plus [`ENTRY_OVERHEAD`] per entry), least recently used pieces evicted
//! first. One mutex guards the map (held while a piece's chunks are looked up and their ids
//! copied out, and for an insertion; never while encoding).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hashbrown::HashMap;
use tokenizers::models::ModelWrapper;
use tokenizers::{
    NormalizerWrapper, OffsetReferential, OffsetType, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer,
};

/// Bytes counted per entry beyond its text and ids: the list node (56), the map slot (24),
/// the two `Arc` headers (32) and allocator rounding.
pub const ENTRY_OVERHEAD: usize = 128;

/// The default capacity in bytes (`tokenizer_cache_bytes`).
pub const DEFAULT_CAPACITY: usize = 32 << 20;

/// The least length of a chunk of a long piece before it is cut at the next word boundary
/// (and of a piece before it is cut at all). Smaller chunks leave less text to encode where
/// two prompts part (on average half a chunk, a few microseconds a word on a miss), larger
/// ones mean fewer lookups on a hit (a few hundred nanoseconds each).
pub const CHUNK_BYTES: usize = 64;

/// The cache's counters and state, as stats and `/metrics` show them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheStats {
    /// Whether chat prompts are encoded through the cache.
    pub enabled: bool,
    /// Why not, when not (`None` when enabled).
    pub disabled_reason: Option<String>,
    /// Byte capacity configured (0: off by configuration).
    pub capacity_bytes: u64,
    /// Bytes held now (text, ids and per-entry overhead).
    pub bytes: u64,
    /// Pieces held now.
    pub entries: u64,
    /// Pieces found.
    pub hits: u64,
    /// Pieces encoded and inserted.
    pub misses: u64,
    /// Pieces evicted to stay within the capacity.
    pub evictions: u64,
    /// Prompts encoded whole because a piece could not be encoded on its own.
    pub fallbacks: u64,
    /// Whether long pieces are cut into chunks cached on their own (see the module docs).
    pub chunks: bool,
    /// Why not, when the cache is on but chunks are off.
    pub chunks_disabled_reason: Option<String>,
    /// Whether `/v1/completions` prompts (special tokens added) go through the cache.
    pub completions: bool,
}

const NIL: usize = usize::MAX;

struct Node {
    /// Shared with the map's key.
    text: Arc<str>,
    first: bool,
    ids: Arc<[u32]>,
    prev: usize,
    next: usize,
}

/// A least-recently-used map from (piece, starts the text) to ids, bounded in bytes.
struct Lru {
    /// Slot of each piece, by whether it starts the text.
    maps: [HashMap<Arc<str>, usize>; 2],
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Most recently used.
    head: usize,
    /// Least recently used.
    tail: usize,
    bytes: usize,
    capacity: usize,
    /// Fingerprints of long pieces last assembled whole from cached chunks, one per slot
    /// (direct-mapped): a piece assembled again while its fingerprint is still there repeats
    /// whole, and is kept whole too ([`Lru::assembled`]).
    assembled: Vec<u64>,
}

/// Slots of [`Lru::assembled`] (8 bytes each).
const ASSEMBLED_SLOTS: usize = 4096;

fn cost(text: &str, ids: usize) -> usize {
    text.len() + ids * 4 + ENTRY_OVERHEAD
}

impl Lru {
    fn new(capacity: usize) -> Lru {
        Lru {
            maps: [HashMap::new(), HashMap::new()],
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            bytes: 0,
            capacity,
            assembled: vec![0; ASSEMBLED_SLOTS],
        }
    }

    /// Records that a long piece was assembled from cached chunks; true when it was the
    /// last piece recorded in its slot (it repeats whole: keep it whole). A fingerprint
    /// shared by two pieces only keeps a piece whole early (its ids are its own either way).
    fn assembled(&mut self, text: &str, first: bool) -> bool {
        use std::hash::BuildHasher as _;
        // Never 0, the empty slot's value.
        let fingerprint = self.maps[usize::from(first)].hasher().hash_one(text) | 1;
        let slot = &mut self.assembled[(fingerprint >> 32) as usize % ASSEMBLED_SLOTS];
        std::mem::replace(slot, fingerprint) == fingerprint
    }

    fn unlink(&mut self, slot: usize) {
        let (prev, next) = (self.nodes[slot].prev, self.nodes[slot].next);
        match prev {
            NIL => self.head = next,
            p => self.nodes[p].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n].prev = prev,
        }
    }

    fn push_front(&mut self, slot: usize) {
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
    }

    #[cfg(test)]
    fn get(&mut self, text: &str, first: bool) -> Option<Arc<[u32]>> {
        let slot = self.touch(text, first)?;
        Some(self.nodes[slot].ids.clone())
    }

    /// Appends the ids of a piece held to `out` (true), or leaves it as it was (false).
    fn extend_with(&mut self, text: &str, first: bool, out: &mut Vec<u32>) -> bool {
        let Some(slot) = self.touch(text, first) else { return false };
        out.extend_from_slice(&self.nodes[slot].ids);
        true
    }

    /// The slot of a piece held, made the most recently used.
    fn touch(&mut self, text: &str, first: bool) -> Option<usize> {
        let slot = *self.maps[usize::from(first)].get(text)?;
        if self.head != slot {
            self.unlink(slot);
            self.push_front(slot);
        }
        Some(slot)
    }

    /// Inserts (or refreshes) a piece; returns how many entries were evicted. A piece larger
    /// than a quarter of the capacity is not kept (it would flush the others).
    fn insert(&mut self, text: &str, first: bool, ids: Arc<[u32]>) -> u64 {
        let size = cost(text, ids.len());
        if size > self.capacity / 4 || self.maps[usize::from(first)].contains_key(text) {
            return 0;
        }
        let mut evicted = 0;
        while self.bytes + size > self.capacity && self.tail != NIL {
            let slot = self.tail;
            self.unlink(slot);
            let node = &mut self.nodes[slot];
            self.bytes -= cost(&node.text, node.ids.len());
            let text = std::mem::replace(&mut node.text, Arc::from(""));
            node.ids = Arc::from(Vec::new());
            self.maps[usize::from(node.first)].remove(&text);
            self.free.push(slot);
            evicted += 1;
        }
        let text: Arc<str> = Arc::from(text);
        let node = Node { text: text.clone(), first, ids, prev: NIL, next: NIL };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.maps[usize::from(first)].insert(text, slot);
        self.push_front(slot);
        self.bytes += size;
        evicted
    }

    fn len(&self) -> usize {
        self.maps[0].len() + self.maps[1].len()
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    fallbacks: AtomicU64,
}

/// One piece of a split text: an added token's id, or text to encode.
enum Piece<'t> {
    Token(u32),
    Text { text: &'t str, first: bool },
}

/// The ends of the chunks `text` is cut into, the last one its length: each cut at least
/// [`CHUNK_BYTES`] after the one before, at the first space there with an ASCII letter, digit
/// or punctuation mark before it and an ASCII letter after it (the next chunk starts with the
/// space, as the
/// pre-tokenizer's next word does). A text shorter than two chunks, or any text when `cut`
/// is false, is one chunk. A cut depends on the text up to the byte after it only.
fn chunk_ends(text: &str, cut: bool) -> ChunkEnds<'_> {
    let bytes = text.as_bytes();
    ChunkEnds { bytes, at: 0, least: CHUNK_BYTES, cut: cut && bytes.len() >= 2 * CHUNK_BYTES }
}

/// The ends of the words of a chunk, cut at every boundary of [`chunk_ends`]: a chunk that
/// is not cached is looked up word by word (most words of a text are in the cache long
/// before its chunks are).
fn word_ends(chunk: &str) -> ChunkEnds<'_> {
    let bytes = chunk.as_bytes();
    ChunkEnds { bytes, at: 0, least: 1, cut: bytes.len() >= 2 }
}

/// The iterator of [`chunk_ends`] and [`word_ends`].
struct ChunkEnds<'t> {
    bytes: &'t [u8],
    /// The last end given.
    at: usize,
    /// The least length of a part before the next cut.
    least: usize,
    /// Whether the text is long enough to be cut.
    cut: bool,
}

impl Iterator for ChunkEnds<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let len = self.bytes.len();
        if self.at >= len {
            return None;
        }
        let end = match self.cut {
            true => next_cut(self.bytes, self.at + self.least).unwrap_or(len),
            false => len,
        };
        self.at = end;
        Some(end)
    }
}

/// The first word boundary of [`chunk_ends`] at or after `from`.
fn next_cut(bytes: &[u8], from: usize) -> Option<usize> {
    // A plain loop: the next space is most often a few bytes away, nearer than a vectored
    // search pays off.
    (from.max(1)..bytes.len().saturating_sub(1)).find(|&at| {
        bytes[at] == b' ' && bytes[at - 1].is_ascii_graphic() && bytes[at + 1].is_ascii_alphabetic()
    })
}

/// Finds the added tokens in a text.
enum Splitter {
    /// Leftmost-longest matches of the added tokens' contents (their ids by pattern).
    Plain(aho_corasick::AhoCorasick, Vec<u32>),
    /// The tokenizer's added vocabulary.
    Tokenizer,
}

impl Splitter {
    /// The plain splitter when every added token is matched on the raw text without strip
    /// or single-word rules (and special tokens are not encoded as text), else the
    /// tokenizer's.
    fn for_tokenizer(tokenizer: &Tokenizer) -> Splitter {
        let tokens = tokenizer.get_added_tokens_decoder();
        let plain = !tokenizer.get_encode_special_tokens()
            && tokens.values().all(|t| !(t.normalized || t.lstrip || t.rstrip || t.single_word));
        if !plain || tokens.is_empty() {
            return Splitter::Tokenizer;
        }
        let (ids, patterns): (Vec<u32>, Vec<String>) =
            tokens.into_iter().map(|(id, t)| (id, t.content)).unzip();
        match aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&patterns)
        {
            Ok(automaton) => Splitter::Plain(automaton, ids),
            Err(_) => Splitter::Tokenizer,
        }
    }

    fn split<'t>(&self, tokenizer: &Tokenizer, text: &'t str) -> Vec<Piece<'t>> {
        let Splitter::Plain(automaton, ids) = self else { return split(tokenizer, text) };
        let mut out = Vec::with_capacity(16);
        let mut at = 0;
        for found in automaton.find_iter(text) {
            if found.start() > at {
                out.push(Piece::Text { text: &text[at..found.start()], first: at == 0 });
            }
            out.push(Piece::Token(ids[found.pattern().as_usize()]));
            at = found.end();
        }
        if at < text.len() {
            out.push(Piece::Text { text: &text[at..], first: at == 0 });
        }
        out
    }
}

/// Encodes texts (without special tokens added) through the piece cache when the tokenizer
/// was proved piecewise at load, else whole (see the module documentation).
pub struct PieceEncoder {
    splitter: Splitter,
    /// `None`: off (the reason in `disabled_reason`).
    cache: Option<Mutex<Lru>>,
    /// The added token a non-first piece is encoded after: (its text, its id).
    anchor: Option<(String, u32)>,
    disabled_reason: Option<String>,
    /// Whether long pieces are cut into chunks (proved at load).
    chunks: bool,
    chunks_disabled_reason: Option<String>,
    /// The ids the post-processor puts before and after a single text's when special tokens
    /// are added (`None`: not proved; such texts are encoded whole).
    affixes: Option<(Vec<u32>, Vec<u32>)>,
    capacity: usize,
    counters: Counters,
}

impl std::fmt::Debug for PieceEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceEncoder")
            .field("enabled", &self.cache.is_some())
            .field("disabled_reason", &self.disabled_reason)
            .field("chunks", &self.chunks)
            .field("completions", &self.affixes.is_some())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl PieceEncoder {
    /// The encoder for `tokenizer` with a cache of `capacity` bytes (0: off), after checking
    /// the tokenizer's pipeline and probing it with `probes` (texts the chat template
    /// renders) and texts built around its added tokens; then, with long texts, whether
    /// long pieces may be cut into chunks, and which ids special tokens add around a text.
    pub fn new(tokenizer: &Tokenizer, capacity: usize, probes: &[String]) -> PieceEncoder {
        let mut encoder = PieceEncoder::off("tokenizer_cache_bytes is 0");
        encoder.capacity = capacity;
        if capacity == 0 {
            return encoder;
        }
        if let Err(reason) = pipeline_is_piecewise(tokenizer) {
            encoder.disabled_reason = Some(reason);
            return encoder;
        }
        let Some(anchor) = find_anchor(tokenizer) else {
            encoder.disabled_reason = Some(
                "the tokenizer has no added token that encodes alone to its id without strip \
                 or single-word rules (needed to encode a piece in place)"
                    .into(),
            );
            return encoder;
        };
        encoder.anchor = Some(anchor);
        encoder.disabled_reason = None;
        encoder.cache = Some(Mutex::new(Lru::new(capacity)));
        let mut texts: Vec<String> = probes.to_vec();
        texts.extend(synthetic_probes(tokenizer));
        encoder.splitter = Splitter::for_tokenizer(tokenizer);
        if texts
            .iter()
            .any(|t| !same_split(&encoder.splitter.split(tokenizer, t), &split(tokenizer, t)))
        {
            encoder.splitter = Splitter::Tokenizer;
        }
        if let Some(mismatch) = encoder.first_mismatch(tokenizer, &texts) {
            encoder.cache = None;
            encoder.disabled_reason = Some(mismatch_reason(mismatch, "piece by piece"));
            return encoder;
        }
        // Chunks, probed on long texts from a cold cache.
        let long = chunk_probes(&texts);
        encoder.cache = Some(Mutex::new(Lru::new(capacity)));
        encoder.chunks = true;
        if let Some(mismatch) = encoder.first_mismatch(tokenizer, &long) {
            encoder.chunks = false;
            encoder.chunks_disabled_reason = Some(mismatch_reason(mismatch, "chunk by chunk"));
        }
        texts.extend(long);
        encoder.affixes = special_affixes(tokenizer, &texts);
        // The probes' pieces do not stay, nor count.
        encoder.cache = Some(Mutex::new(Lru::new(capacity)));
        encoder.counters = Counters::default();
        encoder
    }

    /// The first of `texts` (and the pass, cold or warm) whose ids through the cache differ
    /// from its whole ids. A text with a piece that cannot be encoded alone is encoded whole
    /// at run time (exact, if not faster), so it does not count.
    fn first_mismatch<'t>(
        &self,
        tokenizer: &Tokenizer,
        texts: &'t [String],
    ) -> Option<(&'t str, &'static str)> {
        for text in texts {
            let Ok(whole) = tokenizer.encode_fast(text.as_str(), false) else { continue };
            for pass in ["cold", "warm"] {
                let Some(pieces) = self.encode_pieces(tokenizer, text, &[], &[]) else {
                    continue;
                };
                if pieces != whole.get_ids() {
                    return Some((text, pass));
                }
            }
        }
        None
    }

    /// An encoder that encodes every text whole, for `reason`.
    pub fn off(reason: &str) -> PieceEncoder {
        PieceEncoder {
            splitter: Splitter::Tokenizer,
            cache: None,
            anchor: None,
            disabled_reason: Some(reason.to_owned()),
            chunks: false,
            chunks_disabled_reason: None,
            affixes: None,
            capacity: 0,
            counters: Counters::default(),
        }
    }

    /// Whether texts go through the cache.
    pub fn enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// The ids of `text` without special tokens added: through the cache when enabled (the
    /// same ids as `Tokenizer::encode_fast`, proved at load), else whole.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        if self.cache.is_some() {
            if let Some(ids) = self.encode_pieces(tokenizer, text, &[], &[]) {
                return Ok(ids);
            }
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(tokenizer.encode_fast(text, false)?.get_ids().to_vec())
    }

    /// The ids of `text` with special tokens added, as a `/v1/completions` prompt is encoded:
    /// through the cache, between the ids the post-processor adds, when both were proved at
    /// load; else whole.
    pub fn encode_with_special_tokens(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
    ) -> tokenizers::Result<Vec<u32>> {
        if let (Some(_), Some((before, after))) = (&self.cache, &self.affixes) {
            if let Some(ids) = self.encode_pieces(tokenizer, text, before, after) {
                return Ok(ids);
            }
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(tokenizer.encode_fast(text, true)?.get_ids().to_vec())
    }

    /// The ids the post-processor puts before and after a single text's when special tokens
    /// are added, when proved at load (the cache on).
    pub fn affixes(&self) -> Option<(&[u32], &[u32])> {
        self.affixes.as_ref().map(|(before, after)| (before.as_slice(), after.as_slice()))
    }

    /// The counters and state.
    pub fn stats(&self) -> CacheStats {
        let (bytes, entries) = match &self.cache {
            Some(cache) => {
                let lru = cache.lock().unwrap_or_else(|e| e.into_inner());
                (lru.bytes as u64, lru.len() as u64)
            }
            None => (0, 0),
        };
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let enabled = self.cache.is_some();
        CacheStats {
            enabled,
            disabled_reason: self.disabled_reason.clone(),
            capacity_bytes: self.capacity as u64,
            bytes,
            entries,
            hits: load(&self.counters.hits),
            misses: load(&self.counters.misses),
            evictions: load(&self.counters.evictions),
            fallbacks: load(&self.counters.fallbacks),
            chunks: enabled && self.chunks,
            chunks_disabled_reason: self.chunks_disabled_reason.clone(),
            completions: enabled && self.affixes.is_some(),
        }
    }

    /// The piecewise ids of `text` between `before` and `after`, or `None` when a piece
    /// cannot be encoded on its own (or the tokenizer fails: the whole encoding reports it).
    fn encode_pieces(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        before: &[u32],
        after: &[u32],
    ) -> Option<Vec<u32>> {
        let cache = self.cache.as_ref()?;
        let pieces = self.splitter.split(tokenizer, text);
        // Room for one id a byte (about what a small vocabulary makes), so that the ids are
        // copied out of the cache without growing the vector.
        let mut ids = Vec::with_capacity(before.len() + text.len() + pieces.len() + after.len());
        ids.extend_from_slice(before);
        let mut hits = 0;
        for piece in &pieces {
            let (piece, first) = match *piece {
                Piece::Token(id) => {
                    ids.push(id);
                    continue;
                }
                Piece::Text { text, first } => (text, first),
            };
            let ends = chunk_ends(piece, self.chunks);
            let cut = ends.cut;
            // A long piece seen whole before (a system message on every turn) is one lookup.
            if cut
                && cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_with(piece, first, &mut ids)
            {
                hits += 1;
                continue;
            }
            let from = ids.len();
            let encode_chunk = |chunk: &str, first: bool, hits: &mut u64| match self.chunks {
                true => self.encode_by_words(tokenizer, chunk, first, hits),
                false => Some(Arc::from(self.encode_piece(tokenizer, chunk, first)?)),
            };
            let all_cached =
                self.extend_by_parts(piece, first, ends, &mut ids, &mut hits, encode_chunk)?;
            if cut && all_cached {
                let mut lru = cache.lock().unwrap_or_else(|e| e.into_inner());
                if lru.assembled(piece, first) {
                    self.keep(&mut lru, piece, first, Arc::from(&ids[from..]));
                }
            }
        }
        self.counters.hits.fetch_add(hits, Ordering::Relaxed);
        ids.extend_from_slice(after);
        Some(ids)
    }

    /// Appends the ids of `text`'s parts (cut at `ends`) to `ids`: each from the cache, else
    /// made by `encode` (without the lock held: another thread's lookups go on meanwhile),
    /// counted as a miss and kept. Returns whether every part was in the cache; `None` when
    /// `encode` could not make a part's ids.
    fn extend_by_parts(
        &self,
        text: &str,
        first: bool,
        ends: ChunkEnds<'_>,
        ids: &mut Vec<u32>,
        hits: &mut u64,
        encode: impl Fn(&str, bool, &mut u64) -> Option<Arc<[u32]>>,
    ) -> Option<bool> {
        let cache = self.cache.as_ref()?;
        let (mut start, mut all_cached) = (0, true);
        let mut lru = cache.lock().unwrap_or_else(|e| e.into_inner());
        for end in ends {
            let (part, first) = (&text[start..end], first && start == 0);
            start = end;
            if lru.extend_with(part, first, ids) {
                *hits += 1;
                continue;
            }
            all_cached = false;
            drop(lru);
            let encoded = encode(part, first, hits)?;
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            ids.extend_from_slice(&encoded);
            lru = cache.lock().unwrap_or_else(|e| e.into_inner());
            self.keep(&mut lru, part, first, encoded);
        }
        Some(all_cached)
    }

    /// Inserts a piece's ids into the cache, counting what that evicts.
    fn keep(&self, lru: &mut Lru, text: &str, first: bool, ids: Arc<[u32]>) {
        let evicted = lru.insert(text, first, ids);
        if evicted > 0 {
            self.counters.evictions.fetch_add(evicted, Ordering::Relaxed);
        }
    }

    /// The ids of a chunk not in the cache, word by word ([`word_ends`]): each word from the
    /// cache or encoded in place and kept (a word costs the tokenizer's fixed work of a few
    /// microseconds on its own, a lookup a few hundred instructions).
    fn encode_by_words(
        &self,
        tokenizer: &Tokenizer,
        chunk: &str,
        first: bool,
        hits: &mut u64,
    ) -> Option<Arc<[u32]>> {
        let words = word_ends(chunk);
        if !words.cut {
            return Some(Arc::from(self.encode_piece(tokenizer, chunk, first)?));
        }
        let mut ids = Vec::with_capacity(chunk.len());
        let encode_word = |word: &str, first: bool, _: &mut u64| {
            Some(Arc::from(self.encode_piece(tokenizer, word, first)?))
        };
        self.extend_by_parts(chunk, first, words, &mut ids, hits, encode_word)?;
        Some(Arc::from(ids))
    }

    /// One piece's ids as it encodes inside a text: alone when it starts the text, else
    /// after the anchor (whose id is dropped). `None` when that text does not split into
    /// exactly (the anchor and) the piece.
    fn encode_piece(&self, tokenizer: &Tokenizer, piece: &str, first: bool) -> Option<Vec<u32>> {
        if first {
            match split(tokenizer, piece).as_slice() {
                [Piece::Text { text, .. }] if *text == piece => {}
                _ => return None,
            }
            return tokenizer.encode_fast(piece, false).ok().map(|e| e.get_ids().to_vec());
        }
        let (anchor, anchor_id) = self.anchor.as_ref()?;
        let mut text = String::with_capacity(anchor.len() + piece.len());
        text.push_str(anchor);
        text.push_str(piece);
        match split(tokenizer, &text).as_slice() {
            [Piece::Token(id), Piece::Text { text: rest, .. }]
                if id == anchor_id && *rest == piece => {}
            _ => return None,
        }
        let encoding = tokenizer.encode_fast(text.as_str(), false).ok()?;
        match encoding.get_ids() {
            [id, rest @ ..] if id == anchor_id => Some(rest.to_vec()),
            _ => None,
        }
    }
}

/// `text` split by the tokenizer's added vocabulary, as its own encoding splits it (the
/// tokenizer's normalizer is not run: [`pipeline_is_piecewise`] requires that no added
/// token is matched on normalized text when there is one).
fn split<'t>(tokenizer: &Tokenizer, text: &'t str) -> Vec<Piece<'t>> {
    let pretokenized =
        tokenizer.get_added_vocabulary().extract_and_normalize(None::<&NormalizerWrapper>, text);
    pretokenized
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .flat_map(|(_, (start, end), tokens)| match tokens {
            Some(tokens) => tokens.iter().map(|t| Piece::Token(t.id)).collect::<Vec<_>>(),
            None if start == end => Vec::new(),
            None => vec![Piece::Text { text: &text[start..end], first: start == 0 }],
        })
        .collect()
}

/// Checks the stages the cache relies on; the error names the one it cannot vouch for.
fn pipeline_is_piecewise(tokenizer: &Tokenizer) -> Result<(), String> {
    if tokenizer.get_truncation().is_some() {
        return Err("the tokenizer truncates (its ids depend on the whole text)".into());
    }
    if tokenizer.get_padding().is_some() {
        return Err("the tokenizer pads (its ids depend on the whole text)".into());
    }
    if let ModelWrapper::BPE(bpe) = tokenizer.get_model() {
        if bpe.dropout.is_some_and(|p| p > 0.0) {
            return Err("the BPE model has dropout (its ids are random)".into());
        }
    }
    if let Some(normalizer) = tokenizer.get_normalizer() {
        normalizer_is_known(normalizer);
        if tokenizer.get_added_tokens_decoder().values().any(|t| t.normalized) {
            return Err("an added token is matched after normalization (normalized: true) and \
                        the tokenizer has a normalizer"
                .into());
        }
    }
    if let Some(pre_tokenizer) = tokenizer.get_pre_tokenizer() {
        pre_tokenizer_is_known(pre_tokenizer);
    }
    if let Some(processor) = tokenizer.get_post_processor() {
        post_processor_is_known(processor);
    }
    Ok(())
}

/// Every normalizer of `tokenizers` 0.23 rewrites the piece it is given, which the
/// tokenizer itself hands it piece by piece. The match has no wildcard: a new variant in a
/// later version must be looked at before this compiles.
fn normalizer_is_known(normalizer: &NormalizerWrapper) {
    match normalizer {
        NormalizerWrapper::BertNormalizer(_)
        | NormalizerWrapper::StripNormalizer(_)
        | NormalizerWrapper::StripAccents(_)
        | NormalizerWrapper::NFC(_)
        | NormalizerWrapper::NFD(_)
        | NormalizerWrapper::NFKC(_)
        | NormalizerWrapper::NFKD(_)
        | NormalizerWrapper::Sequence(_)
        | NormalizerWrapper::Lowercase(_)
        | NormalizerWrapper::Nmt(_)
        | NormalizerWrapper::Precompiled(_)
        | NormalizerWrapper::Replace(_)
        | NormalizerWrapper::Prepend(_)
        | NormalizerWrapper::ByteLevel(_) => {}
    }
}

/// Every pre-tokenizer of `tokenizers` 0.23 splits each piece on its own, ignoring the
/// split's index; Metaspace's `prepend_scheme: first` reads whether the piece starts the
/// text, which is part of the cache key.
fn pre_tokenizer_is_known(pre_tokenizer: &PreTokenizerWrapper) {
    match pre_tokenizer {
        PreTokenizerWrapper::BertPreTokenizer(_)
        | PreTokenizerWrapper::ByteLevel(_)
        | PreTokenizerWrapper::Delimiter(_)
        | PreTokenizerWrapper::Metaspace(_)
        | PreTokenizerWrapper::Whitespace(_)
        | PreTokenizerWrapper::Sequence(_)
        | PreTokenizerWrapper::Split(_)
        | PreTokenizerWrapper::Punctuation(_)
        | PreTokenizerWrapper::WhitespaceSplit(_)
        | PreTokenizerWrapper::Digits(_)
        | PreTokenizerWrapper::UnicodeScripts(_)
        | PreTokenizerWrapper::FixedLength(_) => {}
    }
}

/// Without special tokens added, every post-processor of `tokenizers` 0.23 leaves the ids
/// as they are (ByteLevel trims offsets only).
fn post_processor_is_known(processor: &PostProcessorWrapper) {
    match processor {
        PostProcessorWrapper::Roberta(_)
        | PostProcessorWrapper::Bert(_)
        | PostProcessorWrapper::ByteLevel(_)
        | PostProcessorWrapper::Template(_)
        | PostProcessorWrapper::Sequence(_) => {}
    }
}

/// The lowest-id added token that has no strip or single-word rule, is matched on the raw
/// text and encodes alone to its own id.
fn find_anchor(tokenizer: &Tokenizer) -> Option<(String, u32)> {
    let mut tokens: Vec<(u32, tokenizers::AddedToken)> =
        tokenizer.get_added_tokens_decoder().into_iter().collect();
    tokens.sort_by_key(|(id, _)| *id);
    tokens.into_iter().find_map(|(id, token)| {
        if token.lstrip || token.rstrip || token.single_word || token.normalized {
            return None;
        }
        let ids = tokenizer.encode_fast(token.content.as_str(), false).ok()?;
        (ids.get_ids() == [id]).then_some((token.content, id))
    })
}

/// Texts built around the added tokens: tokens at the start, the end, side by side,
/// between words, spaces, newlines and unicode, and long pieces (cached) among short ones.
fn synthetic_probes(tokenizer: &Tokenizer) -> Vec<String> {
    let mut tokens: Vec<(u32, String)> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, token)| (id, token.content))
        .collect();
    tokens.sort();
    let tokens: Vec<String> = tokens.into_iter().take(8).map(|(_, t)| t).collect();
    let long = "The quick brown fox jumps over the lazy dog, and then   it rests.\n\
                Héllo wörld — 日本語 🐉 tab\there 12345 don't stop"
        .to_owned();
    let fillers = [
        "hello",
        " hello there",
        "\n",
        "  spaced  ",
        "system\nyou are a helpful assistant",
        long.as_str(),
        "user\n what's 2+2?",
        "▁meta space",
        "",
    ];
    let mut out = vec![long.clone(), format!("{long}{long}")];
    for (i, token) in tokens.iter().enumerate() {
        let other = &tokens[(i + 1) % tokens.len()];
        for (j, filler) in fillers.iter().enumerate() {
            let next = fillers[(j + 3) % fillers.len()];
            out.push(format!("{token}{filler}{other}{next}"));
            out.push(format!("{filler}{token}{long}{other}{next}{token}"));
            out.push(format!("{next} {token} {filler} {other}{other}\n{long}"));
        }
    }
    out
}

/// Long texts that are cut into chunks: prose, numbers, contractions, code, unicode and
/// whitespace beside the cuts, each probe text repeated, and added tokens between long runs.
fn chunk_probes(probes: &[String]) -> Vec<String> {
    const WORDS: [&str; 24] = [
        "the",
        "Quick",
        "brown",
        "fox's",
        "jumps",
        "over",
        "2024",
        "lazy",
        "dogs",
        "don't",
        "x1",
        "café",
        "naïve",
        "日本語",
        "🐉",
        "re-run",
        "it's",
        "we'll",
        "A",
        "b",
        "e.g.",
        "(nested)",
        "1,000",
        "O'Neil",
    ];
    const SEPARATORS: [&str; 10] = [" ", " ", " ", " ", "  ", "\n", ", ", ". ", " \t", "\n\n"];
    let mut out = Vec::new();
    let mut state = 0x9e37_79b9_u32;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state as usize % n
    };
    for _ in 0..6 {
        let mut text = String::new();
        while text.len() < 1200 {
            text.push_str(WORDS[next(WORDS.len())]);
            text.push_str(SEPARATORS[next(SEPARATORS.len())]);
        }
        out.push(text);
    }
    let code = "def area(r):\n    return 3.14159 * r ** 2  # the circle's area\n\n\
                for i in range(10): print(i, area(i))\n";
    out.push(code.repeat(8));
    out.push("Session 3: context ".repeat(40) + "turn 7");
    out.push("word ".repeat(60) + "12 34 abc 5x y");
    for probe in probes.iter().take(24) {
        if probe.len() < 4 * CHUNK_BYTES {
            out.push(format!("{probe} {probe} {probe} {probe} {probe} {probe}"));
        }
    }
    out
}

/// The ids the post-processor adds before and after a single text's when special tokens
/// are added, the same around every probe text's ids (`None` when they are not).
fn special_affixes(tokenizer: &Tokenizer, texts: &[String]) -> Option<(Vec<u32>, Vec<u32>)> {
    let pair = |text: &str| -> Option<(Vec<u32>, Vec<u32>)> {
        let with = tokenizer.encode_fast(text, true).ok()?.get_ids().to_vec();
        let without = tokenizer.encode_fast(text, false).ok()?.get_ids().to_vec();
        Some((with, without))
    };
    let (with, without) = texts.iter().filter_map(|t| pair(t)).find(|(_, w)| !w.is_empty())?;
    let at = (0..=with.len().checked_sub(without.len())?)
        .find(|&at| with[at..at + without.len()] == without[..])?;
    let (before, after) = (with[..at].to_vec(), with[at + without.len()..].to_vec());
    let fits = |(with, without): (Vec<u32>, Vec<u32>)| {
        with.len() == before.len() + without.len() + after.len()
            && with.starts_with(&before)
            && with.ends_with(&after)
            && with[before.len()..with.len() - after.len()] == without[..]
    };
    texts.iter().all(|t| pair(t).is_some_and(fits)).then_some((before, after))
}

fn same_split(a: &[Piece<'_>], b: &[Piece<'_>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|pair| match pair {
            (Piece::Token(x), Piece::Token(y)) => x == y,
            (Piece::Text { text: x, first: f }, Piece::Text { text: y, first: g }) => {
                x == y && f == g
            }
            _ => false,
        })
}

/// Why a probe text's ids through the cache (`how`: piece by piece, chunk by chunk) rule it
/// out: the text and the pass (cold or warm) whose ids differed from its whole ids.
fn mismatch_reason((text, pass): (&str, &str), how: &str) -> String {
    format!(
        "encoding the probe text {:?} {how} ({pass}) does not give its whole encoding",
        shorten(text)
    )
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<u32>>().into()
    }

    #[test]
    fn lru_evicts_the_least_recently_used_within_its_bytes() {
        let a = "a".repeat(40);
        let b = "b".repeat(40);
        let c = "c".repeat(40);
        let one = cost(&a, 10);
        let mut lru = Lru::new(one * 4 + one / 2);
        assert_eq!(lru.insert(&a, false, ids(10)), 0);
        assert_eq!(lru.insert(&b, false, ids(10)), 0);
        assert_eq!(lru.insert(&c, true, ids(10)), 0);
        assert_eq!(lru.insert(&c, false, ids(10)), 0);
        assert_eq!(lru.len(), 4);
        // `a` used: `b` is the oldest now.
        assert_eq!(lru.get(&a, false).as_deref(), Some(&ids(10)[..]));
        assert_eq!(lru.get(&a, true), None);
        assert_eq!(lru.insert("d".repeat(40).as_str(), false, ids(10)), 1);
        assert_eq!(lru.get(&b, false), None);
        assert!(lru.get(&a, false).is_some());
        assert!(lru.get(&c, true).is_some());
        assert_eq!(lru.bytes, one * 4);
        // Too large for the capacity: not kept, nothing evicted.
        assert_eq!(lru.insert(&"e".repeat(2000), false, ids(10)), 0);
        assert_eq!(lru.len(), 4);
        assert!(lru.bytes <= lru.capacity);
    }

    fn chunks(text: &str) -> Vec<&str> {
        let mut start = 0;
        chunk_ends(text, true)
            .map(|end| {
                let chunk = &text[start..end];
                start = end;
                chunk
            })
            .collect()
    }

    #[test]
    fn a_long_text_is_cut_before_a_space_between_an_ascii_word_and_a_letter() {
        let text = "context ".repeat(40) + "turn 7";
        let parts = chunks(&text);
        assert!(parts.len() > 3, "{parts:?}");
        assert_eq!(parts.concat(), text);
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                assert!(part.starts_with(" c") || part.starts_with(" t"), "{part:?}");
            }
            if i + 1 < parts.len() {
                assert!(part.len() >= CHUNK_BYTES && part.ends_with('t'), "{part:?}");
            }
        }
        // A cut depends on the text before it (and the byte after): a longer text with the
        // same beginning is cut at the same places there.
        let longer = text.clone() + " and then some more words to go on with";
        let more = chunks(&longer);
        assert_eq!(parts[..parts.len() - 1], more[..parts.len() - 1]);
    }

    #[test]
    fn texts_without_a_word_boundary_or_shorter_than_two_chunks_stay_whole() {
        let short = "word ".repeat(2 * CHUNK_BYTES / 5 - 1);
        assert!(short.len() < 2 * CHUNK_BYTES);
        assert_eq!(chunks(&short), vec![short.as_str()]);
        // No ASCII letter after a space, no ASCII letter, digit or punctuation mark before.
        for text in [
            "ab  ".repeat(64),
            "é é ".repeat(64),
            "x 1,".repeat(64),
            "x\t x".repeat(64),
            "x\ny\t".repeat(64),
            "日本語 ".repeat(64),
        ] {
            assert_eq!(chunks(&text), vec![text.as_str()], "{text:?}");
        }
        assert_eq!(chunks(""), Vec::<&str>::new());
        let long = "context ".repeat(40);
        assert_eq!(chunk_ends(&long, false).collect::<Vec<_>>(), vec![long.len()]);
        // Punctuation before the space counts.
        let commas = "word, x ".repeat(40);
        assert!(chunks(&commas).iter().skip(1).all(|c| c.starts_with(" x") || c.starts_with(" w")));
        assert!(chunks(&commas).len() > 1);
        // Digits before the space count, after it do not.
        let digits = "12345 x ".repeat(40);
        assert!(chunks(&digits).len() > 1);
        assert!(chunks(&digits).iter().skip(1).all(|c| c.starts_with(" x")));
    }

    #[test]
    fn lru_reuses_slots_and_keeps_its_links() {
        let mut lru = Lru::new(cost("x", 1) * 40);
        for round in 0..50u32 {
            for k in 0..20u32 {
                let key = format!("{round}-{k}");
                lru.insert(&key, k % 2 == 0, ids(1));
                assert!(lru.bytes <= lru.capacity);
            }
        }
        assert!(lru.nodes.len() <= 40);
        let mut walked = 0;
        let mut slot = lru.head;
        while slot != NIL {
            walked += 1;
            slot = lru.nodes[slot].next;
        }
        assert_eq!(walked, lru.len());
    }
}
