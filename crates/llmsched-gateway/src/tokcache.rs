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
//! The split at added tokens: when every added token is matched on the raw text without
//! strip or single-word rules (chat models' role markers are), it is a leftmost-longest
//! Aho-Corasick search over their contents, the matching the tokenizer's own trie does,
//! checked against the tokenizer's split on every probe text; otherwise the tokenizer's
//! added vocabulary splits (`extract_and_normalize` without the normalizer, slower: it builds
//! alignments for each byte).
//!
//! Complexity: per chat request one scan of the text for added tokens, one hash and
//! comparison per piece, the ids copied out; the tokenizer's normalizer, pre-tokenizer
//! (regular expressions) and model run on misses only. Memory: at most `capacity` bytes of
//! piece text and ids (plus [`ENTRY_OVERHEAD`] per entry), least recently used pieces evicted
//! first. One mutex guards the map (held for a lookup or an insertion, never while
//! encoding).

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
}

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
        }
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

    fn get(&mut self, text: &str, first: bool) -> Option<Arc<[u32]>> {
        let slot = *self.maps[usize::from(first)].get(text)?;
        if self.head != slot {
            self.unlink(slot);
            self.push_front(slot);
        }
        Some(self.nodes[slot].ids.clone())
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
    capacity: usize,
    counters: Counters,
}

impl std::fmt::Debug for PieceEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceEncoder")
            .field("enabled", &self.cache.is_some())
            .field("disabled_reason", &self.disabled_reason)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl PieceEncoder {
    /// The encoder for `tokenizer` with a cache of `capacity` bytes (0: off), after checking
    /// the tokenizer's pipeline and probing it with `probes` (texts the chat template
    /// renders) and texts built around its added tokens.
    pub fn new(tokenizer: &Tokenizer, capacity: usize, probes: &[String]) -> PieceEncoder {
        let mut encoder = PieceEncoder {
            splitter: Splitter::Tokenizer,
            cache: None,
            anchor: None,
            disabled_reason: None,
            capacity,
            counters: Counters::default(),
        };
        if capacity == 0 {
            encoder.disabled_reason = Some("tokenizer_cache_bytes is 0".into());
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
        for text in &texts {
            let whole = match tokenizer.encode_fast(text.as_str(), false) {
                Ok(encoding) => encoding.get_ids().to_vec(),
                Err(_) => continue,
            };
            for pass in ["cold", "warm"] {
                // `None`: a piece that cannot be encoded alone, whose prompt is encoded whole
                // (exact, if not faster).
                let Some(pieces) = encoder.encode_pieces(tokenizer, text) else { continue };
                if pieces != whole {
                    encoder.cache = None;
                    encoder.disabled_reason = Some(format!(
                        "encoding the probe text {:?} piece by piece ({pass}) does not give its \
                         whole encoding",
                        shorten(text)
                    ));
                    return encoder;
                }
            }
        }
        // The probes' pieces do not stay, nor count.
        encoder.cache = Some(Mutex::new(Lru::new(capacity)));
        encoder.counters = Counters::default();
        encoder
    }

    /// An encoder that encodes every text whole, for `reason`.
    pub fn off(reason: &str) -> PieceEncoder {
        PieceEncoder {
            splitter: Splitter::Tokenizer,
            cache: None,
            anchor: None,
            disabled_reason: Some(reason.to_owned()),
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
            if let Some(ids) = self.encode_pieces(tokenizer, text) {
                return Ok(ids);
            }
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(tokenizer.encode_fast(text, false)?.get_ids().to_vec())
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
        CacheStats {
            enabled: self.cache.is_some(),
            disabled_reason: self.disabled_reason.clone(),
            capacity_bytes: self.capacity as u64,
            bytes,
            entries,
            hits: load(&self.counters.hits),
            misses: load(&self.counters.misses),
            evictions: load(&self.counters.evictions),
            fallbacks: load(&self.counters.fallbacks),
        }
    }

    /// The piecewise ids of `text`, or `None` when a piece cannot be encoded on its own (or
    /// the tokenizer fails: the whole encoding reports it).
    fn encode_pieces(&self, tokenizer: &Tokenizer, text: &str) -> Option<Vec<u32>> {
        let cache = self.cache.as_ref()?;
        let pieces = self.splitter.split(tokenizer, text);
        // Each text piece's ids (shared with the cache), then the whole in one allocation of
        // the exact size: growing a guess cost two reallocations a chat where a tokenizer
        // makes about one id a character.
        let mut found: Vec<Arc<[u32]>> = Vec::with_capacity(pieces.len());
        for piece in &pieces {
            let &Piece::Text { text: piece, first } = piece else { continue };
            let cached = cache.lock().unwrap_or_else(|e| e.into_inner()).get(piece, first);
            if let Some(cached) = cached {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                found.push(cached);
                continue;
            }
            let encoded: Arc<[u32]> = Arc::from(self.encode_piece(tokenizer, piece, first)?);
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            let evicted = cache.lock().unwrap_or_else(|e| e.into_inner()).insert(
                piece,
                first,
                encoded.clone(),
            );
            if evicted > 0 {
                self.counters.evictions.fetch_add(evicted, Ordering::Relaxed);
            }
            found.push(encoded);
        }
        let tokens = pieces.iter().filter(|p| matches!(p, Piece::Token(_))).count();
        let mut ids = Vec::with_capacity(tokens + found.iter().map(|f| f.len()).sum::<usize>());
        let mut found = found.iter();
        for piece in &pieces {
            match piece {
                Piece::Token(id) => ids.push(*id),
                Piece::Text { .. } => ids.extend_from_slice(found.next()?),
            }
        }
        Some(ids)
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
