//! Whether the token ids the gateway routes on ever reach the engines' KV events: the check
//! `llmsched.Router` runs on the Python plane (`llmsched.routing`'s token check, the same
//! constants), run here on the prompts the native plane tokenizes itself (with a `tokenizer`)
//! or is given as ids.
//!
//! A tokenizer directory of another model than the engines', or a chat template other than
//! theirs, gives ids that never match a block the engines report: prefix scores come only from
//! the gateway's own short-lived records, and nothing else says so. So, at most once a second,
//! a prompt of [`MIN_TOKENS`] ids or more is sampled: its first block's hash is remembered and,
//! from [`AFTER_S`] to [`GIVE_UP_S`] after the pick, looked for among the blocks the engines
//! reported (a match past every record's expiry sees no routing record). Found on any engine,
//! the prompt is confirmed; not found by then, while engine events kept arriving, unconfirmed
//! (without events after the pick the feed is idle or down, and the prompt is not judged).
//! [`VERDICT`] unconfirmed with none confirmed is warned of once.
//!
//! Without a tokenizer a text prompt is hashed as pseudo-tokens, which can match no block an
//! engine reports: such prompts are counted while engine events feed the index, the first
//! warned of, as the router counts and notes its text picks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use llmsched_core::prefix_index::PrefixIndex;

/// Prompts shorter than this are not checked: an engine caches whole blocks of its own size.
pub const MIN_TOKENS: usize = 512;
/// At most one prompt a second is sampled, and pending checks are looked at as often.
pub const EVERY_S: f64 = 1.0;
/// A sampled prompt's first block is looked for from this long after its pick...
pub const AFTER_S: f64 = 5.0;
/// ...until this long after it.
pub const GIVE_UP_S: f64 = 60.0;
/// Unconfirmed prompts, with none confirmed, before the warning.
pub const VERDICT: u64 = 32;
/// Prompts waiting for their verdict at most.
const PENDING: usize = 64;
/// A match at this time sees only blocks the engines reported (every record expired).
const FAR_FUTURE: f64 = 1e300;

/// The check's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCheckStats {
    /// Sampled prompts whose first block an engine reported within [`GIVE_UP_S`].
    pub confirmed: u64,
    /// Sampled prompts no engine reported by then, while engine events kept arriving.
    pub unconfirmed: u64,
    /// The unconfirmed count when the warning was given (None: not given).
    pub warned_at: Option<u64>,
    /// Prompts hashed as pseudo-tokens while engine events fed the index.
    pub pseudo_picks: u64,
}

/// A warning of the check, for the embedder to give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenNote {
    /// The first prompt hashed as pseudo-tokens while engine events feed the index.
    Pseudo,
    /// So many sampled prompts never found in the engines' reported cache, none found.
    Mismatch(u64),
}

impl TokenNote {
    /// The warning's text (`llmsched serve` gives `llmsched.routing`'s own instead).
    pub fn text(self) -> String {
        match self {
            TokenNote::Pseudo => PSEUDO_NOTE.to_owned(),
            TokenNote::Mismatch(unconfirmed) => note(unconfirmed),
        }
    }
}

/// Why a prompt hashed as pseudo-tokens is warned of.
pub const PSEUDO_NOTE: &str =
    "prompt given as text: hashed as pseudo-tokens (4 UTF-8 bytes each), \
    but the index is fed by engine KV events (real token ids), so no cached prefix can match; \
    give the gateway the engines' `tokenizer`";

#[derive(Default)]
struct State {
    /// (pick time, first block hash, engine event batches applied by then)
    pending: Vec<(f64, u64, u64)>,
    stats: TokenCheckStats,
}

/// The check of one gateway (see the module docs); every method may be called from any
/// thread.
pub struct TokenCheck {
    /// When [`TokenCheck::step`] is due next (an f64's bits): the request path reads one
    /// atomic.
    next_at: AtomicU64,
    state: Mutex<State>,
}

impl Default for TokenCheck {
    fn default() -> Self {
        TokenCheck {
            next_at: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
            state: Mutex::new(State::default()),
        }
    }
}

impl TokenCheck {
    /// Whether a pick at `clock` should call [`TokenCheck::step`].
    pub fn due(&self, clock: f64) -> bool {
        clock >= f64::from_bits(self.next_at.load(Ordering::Relaxed))
    }

    /// Judges the pending prompts that are due and samples this one (`tokens`, hashed under
    /// `lora` and `cache_salt` as the router hashes it). Returns the unconfirmed count the one
    /// time the warning is to be given.
    pub fn step(
        &self,
        index: &PrefixIndex,
        tokens: &[u32],
        lora: Option<&str>,
        cache_salt: Option<&str>,
        clock: f64,
    ) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !self.due(clock) {
            return None;
        }
        self.next_at.store((clock + EVERY_S).to_bits(), Ordering::Relaxed);
        let batches = index.event_batches();
        if batches == 0 {
            return None; // not fed by engine events (yet): nothing to compare with
        }
        let State { pending, stats } = &mut *state;
        pending.retain(|&(at, first, seen)| {
            let age = clock - at;
            if age < AFTER_S {
                true
            } else if index.match_hashes(&[first], FAR_FUTURE).longest() > 0 {
                stats.confirmed += 1;
                false
            } else if age < GIVE_UP_S {
                true
            } else {
                if batches > seen {
                    stats.unconfirmed += 1;
                }
                false
            }
        });
        let block = index.config().block_size;
        if tokens.len() >= MIN_TOKENS && pending.len() < PENDING {
            if let Ok(hashes) = index.hash_tokens(&tokens[..block], lora, cache_salt) {
                if let Some(&first) = hashes.first() {
                    pending.push((clock, first, batches));
                }
            }
        }
        if stats.warned_at.is_none() && stats.confirmed == 0 && stats.unconfirmed >= VERDICT {
            stats.warned_at = Some(stats.unconfirmed);
            return stats.warned_at;
        }
        None
    }

    /// Counts a prompt hashed as pseudo-tokens when engine events feed `index`; true for
    /// the first (the one to warn of).
    pub fn pseudo_pick(&self, index: &PrefixIndex) -> bool {
        if index.event_batches() == 0 {
            return false;
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.stats.pseudo_picks += 1;
        state.stats.pseudo_picks == 1
    }

    /// The counts so far.
    pub fn stats(&self) -> TokenCheckStats {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).stats
    }
}

/// The warning given after `unconfirmed` prompts (the text `llmsched.routing.TOKEN_MISMATCH_NOTE`
/// gives on the Python plane; `llmsched serve` logs that one).
pub fn note(unconfirmed: u64) -> String {
    format!(
        "none of the prompts routed with tokens= was ever found in an engine's reported cache \
         ({unconfirmed} checked, 0 found) while the engines' KV events flowed: the token ids the \
         gateway's tokenizer gives are not the ones the engines cache (another tokenizer, \
         another chat template), or they are hashed under another model, LoRA name or cache \
         salt than the engines' events give"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use llmsched_core::prefix_index::{IndexConfig, WorkerKey};
    use llmsched_core::protocols::{BlockStored, EventBatch, KvEvent};

    const BLOCK: usize = 16;

    fn index() -> PrefixIndex {
        PrefixIndex::new(IndexConfig {
            block_size: BLOCK,
            seed: 0,
            model: None,
            worker_capacity: None,
            max_bytes: None,
        })
        .unwrap()
    }

    fn prompt(i: u32) -> Vec<u32> {
        (0..600).map(|t| 1 + (i * 7919 + t * 31) % 30_000).collect()
    }

    /// The engine reports the first block of `tokens` (or of nothing: a batch all the same).
    fn report(index: &PrefixIndex, tokens: Option<&[u32]>, hash: u64) {
        let events = match tokens {
            Some(tokens) => vec![KvEvent::Stored(BlockStored {
                block_hashes: vec![hash],
                token_ids: tokens[..BLOCK].to_vec(),
                block_size: BLOCK as u32,
                has_extra_keys: vec![false],
                ..BlockStored::default()
            })],
            None => Vec::new(),
        };
        let batch = EventBatch { ts: 0.0, events, dp_rank: None, unknown_events: 0 };
        index.apply_event_batch(&WorkerKey::Str("a".into()), batch);
    }

    /// One prompt a second for `seconds`: picked as `given(i)`, the engine reporting its own
    /// `engine(i)` (with `events`; always the first).
    fn serve(
        check: &TokenCheck,
        index: &PrefixIndex,
        seconds: u32,
        events: bool,
        shift: bool,
    ) -> Vec<u64> {
        let mut warned = Vec::new();
        for i in 0..seconds {
            let engine = prompt(i);
            let given: Vec<u32> = if shift {
                [1].into_iter().chain(engine.iter().copied()).collect()
            } else {
                engine.clone()
            };
            if check.due(f64::from(i)) {
                warned.extend(check.step(index, &given, None, None, f64::from(i)));
            }
            if events || i == 0 {
                report(index, Some(&engine), u64::from(i) + 1);
            }
        }
        warned
    }

    #[test]
    fn ids_the_engines_never_report_are_warned_of_once() {
        let (check, index) = (TokenCheck::default(), index());
        let warned = serve(&check, &index, GIVE_UP_S as u32 + VERDICT as u32 + 20, true, true);
        let stats = check.stats();
        assert_eq!(stats.confirmed, 0);
        assert!(stats.unconfirmed >= VERDICT, "{stats:?}");
        assert_eq!(warned, vec![VERDICT]);
        assert_eq!(stats.warned_at, Some(VERDICT));
    }

    #[test]
    fn ids_the_engines_report_are_confirmed_and_never_warned_of() {
        let (check, index) = (TokenCheck::default(), index());
        let warned = serve(&check, &index, GIVE_UP_S as u32 + VERDICT as u32 + 20, true, false);
        let stats = check.stats();
        assert_eq!(stats.unconfirmed, 0);
        assert!(stats.confirmed >= VERDICT, "{stats:?}");
        assert!(warned.is_empty());
    }

    #[test]
    fn without_events_after_the_pick_nothing_is_judged() {
        let (check, index) = (TokenCheck::default(), index());
        let warned = serve(&check, &index, GIVE_UP_S as u32 + VERDICT as u32 + 20, false, true);
        assert_eq!(check.stats(), TokenCheckStats::default());
        assert!(warned.is_empty());
    }

    #[test]
    fn an_index_no_engine_feeds_and_short_prompts_are_not_checked() {
        let (check, index) = (TokenCheck::default(), index());
        for i in 0..100 {
            check.step(&index, &prompt(i), None, None, f64::from(i));
        }
        assert_eq!(check.stats(), TokenCheckStats::default());
        report(&index, None, 0);
        for i in 100..300 {
            check.step(&index, &prompt(i)[..MIN_TOKENS - 1], None, None, f64::from(i));
            report(&index, None, 0);
        }
        assert_eq!(check.stats(), TokenCheckStats::default());
    }

    #[test]
    fn at_most_one_prompt_a_second_is_sampled() {
        let (check, index) = (TokenCheck::default(), index());
        report(&index, None, 0);
        assert!(check.due(0.0));
        check.step(&index, &prompt(0), None, None, 0.0);
        assert!(!check.due(0.5));
        assert_eq!(check.step(&index, &prompt(1), None, None, 0.5), None);
        assert_eq!(check.state.lock().unwrap().pending.len(), 1);
        assert!(check.due(1.0));
    }

    #[test]
    fn pseudo_tokens_are_counted_once_events_feed_the_index_and_warned_of_once() {
        let (check, index) = (TokenCheck::default(), index());
        assert!(!check.pseudo_pick(&index));
        report(&index, None, 0);
        assert!(check.pseudo_pick(&index));
        assert!(!check.pseudo_pick(&index));
        assert_eq!(check.stats().pseudo_picks, 2);
    }

    #[test]
    fn the_note_names_the_count() {
        assert!(note(32).contains("(32 checked, 0 found)"));
    }
}
