//! Prompt truncation as vLLM 0.32 applies it before a prompt reaches the engine's cache.
//!
//! A request's `truncate_prompt_tokens: N` makes the engine keep N tokens of its prompt; the
//! blocks it caches are those of the kept tokens, so a router must hash those, not the whole
//! prompt (for the engines' default side, the last N: every block differs from the whole
//! prompt's). vLLM's rules (`renderers/params.py`, `TokenizeParams`):
//!
//! - `truncation_side` `left` keeps the last N ids, `right` the first N, of the prompt as
//!   encoded whole (special tokens included);
//! - without a side, a text prompt is truncated by the tokenizer while it encodes, on the
//!   side vLLM sets for generative models (left): the text's own ids are cut to leave room
//!   for the special tokens the tokenizer adds (a `/v1/completions` prompt keeps its BOS); a
//!   prompt of token ids is cut on that side;
//! - `-1` means the engine's context length less one (vLLM holds a token back for output):
//!   with the context length known (the config's `max_model_len`, or the engines' `/v1/models`)
//!   it is that many; unknown, the whole prompt is hashed.
//!
//! The request goes to the engine as it was sent; only the ids the router hashes change.

use serde_json::Value as Json;

/// Which end of the prompt a truncation keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Keeps the last ids (vLLM's `truncation_side: "left"`, its default for generation).
    Left,
    /// Keeps the first ids (`"right"`).
    Right,
}

/// A request's `truncate_prompt_tokens` (and `truncation_side`), when it cuts the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncation {
    /// How many ids the engine keeps.
    pub keep: usize,
    /// The side the request names (`None`: the tokenizer's, left).
    pub side: Option<Side>,
}

/// What an unreadable `truncate_prompt_tokens` is answered with (HTTP 400).
pub const BAD_KEEP: &str = "truncate_prompt_tokens must be an integer of at least -1";
/// What an unreadable `truncation_side` is answered with (HTTP 400).
pub const BAD_SIDE: &str = "truncation_side must be 'left' or 'right'";

impl Truncation {
    /// The truncation a request's fields ask for: `None` when there is none the gateway can
    /// apply (absent, null, or -1 with `context`, the engines' context length, unknown); an
    /// error naming the field when one is malformed.
    pub fn of_fields(
        keep: Option<&Json>,
        side: Option<&Json>,
        context: Option<usize>,
    ) -> Result<Option<Truncation>, &'static str> {
        let side = match side {
            None | Some(Json::Null) => None,
            Some(Json::String(side)) if side == "left" => Some(Side::Left),
            Some(Json::String(side)) if side == "right" => Some(Side::Right),
            Some(_) => return Err(BAD_SIDE),
        };
        let keep = match keep {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::Number(keep)) => keep
                .as_i64()
                .or_else(|| {
                    keep.as_f64().filter(|k| k.fract() == 0.0 && k.abs() < 9e15).map(|k| k as i64)
                })
                .ok_or(BAD_KEEP)?,
            Some(_) => return Err(BAD_KEEP),
        };
        match keep {
            // vLLM's `max_truncation_tokens`: the context less the token held for output.
            -1 => Ok(context.map(|context| Truncation { keep: context.saturating_sub(1), side })),
            keep if keep < -1 => Err(BAD_KEEP),
            keep => {
                Ok(Some(Truncation { keep: usize::try_from(keep).unwrap_or(usize::MAX), side }))
            }
        }
    }

    /// [`Truncation::of_fields`] of a request body's `truncate_prompt_tokens` and
    /// `truncation_side`.
    pub fn of_body(
        body: &Json,
        context: Option<usize>,
    ) -> Result<Option<Truncation>, &'static str> {
        Truncation::of_fields(
            body.get("truncate_prompt_tokens"),
            body.get("truncation_side"),
            context,
        )
    }

    /// Cuts ids as the engine cuts them after encoding: `keep` of them from the side named,
    /// else from the tokenizer's (left).
    pub fn cut(&self, ids: &mut Vec<u32>) {
        if ids.len() <= self.keep {
            return;
        }
        match self.side {
            Some(Side::Right) => ids.truncate(self.keep),
            None | Some(Side::Left) => {
                ids.drain(..ids.len() - self.keep);
            }
        }
    }

    /// The ids of a text encoded with `before` and `after` (the special tokens the tokenizer
    /// adds) around its own `content` ids, truncated as the tokenizer truncates without a
    /// side named: the content's last ids that leave room for the special tokens.
    pub fn cut_within(&self, before: &[u32], content: &[u32], after: &[u32]) -> Vec<u32> {
        let room = self.keep.saturating_sub(before.len() + after.len());
        let kept = &content[content.len().saturating_sub(room)..];
        let mut ids = Vec::with_capacity(before.len() + kept.len() + after.len());
        ids.extend_from_slice(before);
        ids.extend_from_slice(kept);
        ids.extend_from_slice(after);
        // Special tokens alone longer than `keep`: the engine's own cut applies after.
        self.cut(&mut ids);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(keep: Json, side: Json) -> Result<Option<Truncation>, &'static str> {
        Truncation::of_fields(Some(&keep), Some(&side), None)
    }

    #[test]
    fn minus_one_keeps_the_context_less_one_when_it_is_known() {
        let read = |side: Json| Truncation::of_fields(Some(&json!(-1)), Some(&side), Some(8));
        assert_eq!(read(json!(null)), Ok(Some(Truncation { keep: 7, side: None })));
        assert_eq!(read(json!("right")), Ok(Some(Truncation { keep: 7, side: Some(Side::Right) })));
        let one = Truncation::of_fields(Some(&json!(-1)), None, Some(1));
        assert_eq!(one, Ok(Some(Truncation { keep: 0, side: None })));
        // A count of its own is kept as given.
        let five = Truncation::of_fields(Some(&json!(5)), None, Some(8));
        assert_eq!(five, Ok(Some(Truncation { keep: 5, side: None })));
    }

    #[test]
    fn fields_are_read_as_vllm_reads_them() {
        assert_eq!(read(json!(null), json!(null)), Ok(None));
        assert_eq!(read(json!(-1), json!("left")), Ok(None));
        assert_eq!(read(json!(5), json!(null)), Ok(Some(Truncation { keep: 5, side: None })));
        assert_eq!(
            read(json!(5.0), json!("right")),
            Ok(Some(Truncation { keep: 5, side: Some(Side::Right) }))
        );
        assert_eq!(read(json!(0), json!("left")).unwrap().unwrap().keep, 0);
        assert_eq!(Truncation::of_fields(None, None, None), Ok(None));
        for bad in [json!(-2), json!(1.5), json!("5"), json!(true), json!([5])] {
            assert_eq!(read(bad, json!(null)), Err(BAD_KEEP));
        }
        for bad in [json!("middle"), json!(1), json!("Left")] {
            assert_eq!(read(json!(5), bad), Err(BAD_SIDE));
        }
    }

    #[test]
    fn cuts_keep_the_side_asked_for() {
        let ids: Vec<u32> = (0..10).collect();
        let cut = |keep, side| {
            let mut ids = ids.clone();
            Truncation { keep, side }.cut(&mut ids);
            ids
        };
        assert_eq!(cut(3, None), vec![7, 8, 9]);
        assert_eq!(cut(3, Some(Side::Left)), vec![7, 8, 9]);
        assert_eq!(cut(3, Some(Side::Right)), vec![0, 1, 2]);
        assert_eq!(cut(0, None), Vec::<u32>::new());
        assert_eq!(cut(20, None), ids);
    }

    #[test]
    fn the_tokenizer_keeps_its_special_tokens() {
        let content: Vec<u32> = (10..20).collect();
        let t = |keep| Truncation { keep, side: None };
        assert_eq!(t(4).cut_within(&[1], &content, &[]), vec![1, 17, 18, 19]);
        assert_eq!(t(4).cut_within(&[1], &content, &[2]), vec![1, 18, 19, 2]);
        assert_eq!(t(1).cut_within(&[1], &content, &[]), vec![1]);
        // Less room than the special tokens take: the engine's cut after encoding.
        assert_eq!(t(1).cut_within(&[1], &content, &[2]), vec![2]);
        assert_eq!(t(50).cut_within(&[1], &content, &[]).len(), 11);
    }
}
