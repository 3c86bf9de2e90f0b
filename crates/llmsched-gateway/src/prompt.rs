//! A request's prompt as the router hashes it: token ids (given, or the tokenizer's) cut as
//! the request's truncation cuts them, or text as 4-byte pseudo-tokens; and the checks of
//! [`token_check`] on the ids routed on.

use std::sync::atomic::Ordering;

use llmsched_core::hashing::text::{pack_text, packed_len};
use llmsched_core::routing::RequestMeta;
use serde_json::Value;

use crate::payload::Payload;
use crate::refusal::Refusal;
use crate::truncation::Truncation;
use crate::{payload, responses, token_check, tokenize, Gateway};

/// A request's prompt as routed.
pub(crate) struct Prompt {
    /// The ids the router hashes (none for a prompt not hashed, or for a router that hashes
    /// none).
    pub(crate) tokens: Vec<u32>,
    /// How many ids the router is told the prompt has: `tokens`', or as many as there would
    /// be for a router that hashes none.
    pub(crate) ids: usize,
    /// Its size in tokens for the key's limits and flow control (estimated when not hashed).
    pub(crate) size: usize,
    /// A responses request's `previous_response_id`.
    pub(crate) previous: Option<String>,
    /// What its ids are, for [`token_check`].
    pub(crate) kind: IdKind,
}

/// What a prompt's ids are, for the checks of [`token_check`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum IdKind {
    /// Token ids as the engine caches them (the tokenizer's, or a prompt given as ids):
    /// sampled by the check.
    TokenIds,
    /// Text hashed as pseudo-tokens (no tokenizer): counted, as the router counts its text
    /// picks.
    Pseudo,
    /// Not hashed (embeddings, a continued response).
    Unhashed,
}

/// The prompt as the router hashes it: token ids as given (cut as the request's truncation
/// cuts them, `context` the engines' context length where known), text as 4-byte
/// pseudo-tokens.
pub(crate) fn prompt_tokens(
    payload: &Payload<'_>,
    chat: bool,
    context: Option<usize>,
) -> Result<Vec<u32>, &'static str> {
    const BAD_PROMPT: &str = "'prompt' must be a string or a list of token ids";
    if chat {
        const NOT_A_LIST: &str = "'messages' must be a non-empty list";
        let messages = payload.raw("messages").and_then(payload::array_items).ok_or(NOT_A_LIST)?;
        if messages.is_empty() {
            return Err(NOT_A_LIST);
        }
        let mut text = String::new();
        for message in messages {
            let Ok(Some([role, content])) = payload::object_fields(message, &["role", "content"])
            else {
                return Err("each message must be an object");
            };
            text.push_str(role.and_then(payload::as_str).as_deref().unwrap_or(""));
            text.push('\n');
            match content {
                None => {}
                Some(raw) if raw.get() == "null" => {}
                Some(raw) => match payload::as_str(raw) {
                    Some(content) => text.push_str(&content),
                    // Other content (a list of parts) as compact JSON, as `Value` prints it.
                    None => text.push_str(
                        &serde_json::from_str::<Value>(raw.get())
                            .map(|v| v.to_string())
                            .unwrap_or_default(),
                    ),
                },
            }
            text.push('\n');
        }
        return Ok(pack_text(text.as_bytes()));
    }
    let raw = payload.text("prompt").ok_or(BAD_PROMPT)?;
    if let Some(text) = payload.str("prompt") {
        return Ok(pack_text(text.as_bytes()));
    }
    // Token ids, or a batch (small next to a text prompt): read whole.
    let prompt: Value = serde_json::from_str(raw).map_err(|_| BAD_PROMPT)?;
    let prompt = match &prompt {
        // A batch routes by its first prompt.
        Value::Array(items) if items.first().is_some_and(|p| p.is_string() || p.is_array()) => {
            &items[0]
        }
        prompt => prompt,
    };
    match prompt {
        Value::String(text) => Ok(pack_text(text.as_bytes())),
        Value::Array(ids) => {
            let mut ids = ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or(BAD_PROMPT)?;
            // The engine keeps what the request's truncation keeps of the ids.
            if let Some(truncation) = request_truncation(payload, context)? {
                truncation.cut(&mut ids);
            }
            Ok(ids)
        }
        _ => Err(BAD_PROMPT),
    }
}

/// Whether a completions request's `prompt` is token ids (`[1, 2]`, or a batch whose first
/// prompt is a list of ids): the router takes them as given, the ids the engine caches.
fn gives_token_ids(payload: &Payload<'_>) -> bool {
    let Some(raw) = payload.raw("prompt") else { return false };
    let ids = |text: &str| text.trim_start().starts_with(|c: char| c.is_ascii_digit());
    match raw.get().trim_start().strip_prefix('[') {
        Some(items) => ids(items) || items.trim_start().strip_prefix('[').is_some_and(ids),
        None => false,
    }
}

/// Whether a completions request gives its prompt only as `prompt_embeds` (vLLM's
/// `--enable-prompt-embeds`: base64 tensors, one or a list), with no `prompt`.
fn embeds_only(payload: &Payload<'_>) -> bool {
    let no_prompt = payload.text("prompt").is_none_or(|text| text == "null");
    no_prompt && embeds_given(payload)
}

/// Whether a completions request's `prompt_embeds` holds an embedding (a base64 text, or a
/// non-empty list of them).
fn embeds_given(payload: &Payload<'_>) -> bool {
    payload.raw("prompt_embeds").is_some_and(|raw| {
        payload::as_str(raw).is_some_and(|text| !text.is_empty())
            || payload::array_items(raw).is_some_and(|items| {
                !items.is_empty() && items.iter().all(|item| payload::as_str(item).is_some())
            })
    })
}

/// A request's `truncate_prompt_tokens` and `truncation_side` ([`truncation`]), `context`
/// the engines' context length where known.
fn request_truncation(
    payload: &Payload<'_>,
    context: Option<usize>,
) -> Result<Option<Truncation>, &'static str> {
    let field = |name: &str| payload.value(name).and_then(Result::ok);
    Truncation::of_fields(
        field("truncate_prompt_tokens").as_ref(),
        field("truncation_side").as_ref(),
        context,
    )
}

impl Gateway {
    /// The checks of [`token_check`] on a pick at `now` of a prompt whose ids are `kind`: run
    /// on every pick, each slice of a sliced request included (its first call and every
    /// continuation), as `Router.pick` runs them on each pick of the Python plane.
    pub(crate) fn check_ids(&self, kind: IdKind, tokens: &[u32], meta: &RequestMeta, now: f64) {
        match kind {
            IdKind::TokenIds if self.token_check.due(now) => self.check_tokens(tokens, meta, now),
            IdKind::Pseudo => self.count_pseudo(),
            _ => {}
        }
    }

    /// Runs [`token_check`] on a prompt of token ids picked at `now` (called at most once a
    /// second); gives its warning once, through the embedder's hook or on stderr.
    fn check_tokens(&self, tokens: &[u32], meta: &RequestMeta, now: f64) {
        let index = self.router().index();
        let lora = meta.lora.as_deref();
        let Some(unconfirmed) =
            self.token_check.step(index, tokens, lora, meta.cache_salt.as_deref(), now)
        else {
            return;
        };
        self.token_warning(token_check::TokenNote::Mismatch(unconfirmed));
    }

    /// Counts a prompt hashed as pseudo-tokens while engine events feed the index (they can
    /// match no block an engine reports); the first gives the warning.
    fn count_pseudo(&self) {
        if self.token_check.pseudo_pick(self.router().index()) {
            self.token_warning(token_check::TokenNote::Pseudo);
        }
    }

    /// Gives `note` through the embedder's hook (on a blocking thread) or on stderr.
    fn token_warning(&self, note: token_check::TokenNote) {
        match self.token_warning_hook.clone() {
            Some(hook) => {
                tokio::task::spawn_blocking(move || hook(note));
            }
            None => eprintln!("llmsched-gateway: router: {}", note.text()),
        }
    }

    /// The prompt of a request on `route` (`raw` its body): the ids the router hashes
    /// ([`Gateway::prompt_tokens`]), or a responses request's ([`Gateway::responses_prompt`]).
    pub(crate) fn request_prompt(
        &self,
        payload: &Payload<'_>,
        raw: &[u8],
        route: &str,
    ) -> Result<Prompt, Refusal> {
        if route == "responses" {
            return self.responses_prompt(payload, raw);
        }
        let chat = route == "chat";
        if !chat && !self.hashes_prompts && self.tokenizer.is_none() {
            // A router that hashes no prompt is told only its size: a text prompt's ids are
            // counted, not packed (as `prompt_tokens` would pack them; an empty prompt is
            // refused there).
            if let Some(text) = payload.str("prompt").filter(|text| !text.is_empty()) {
                let size = packed_len(text.len());
                return Ok(Prompt {
                    tokens: Vec::new(),
                    size,
                    ids: size,
                    previous: None,
                    kind: IdKind::Pseudo,
                });
            }
        }
        let tokens = self.prompt_tokens(payload, chat)?;
        let kind = if self.tokenizer.is_some() || (!chat && gives_token_ids(payload)) {
            IdKind::TokenIds
        } else if tokens.is_empty() {
            IdKind::Unhashed // embeddings only
        } else {
            IdKind::Pseudo
        };
        Ok(Prompt { size: tokens.len(), ids: tokens.len(), tokens, previous: None, kind })
    }

    /// The prompt of a `POST /v1/responses` request: the chat request vLLM makes of it
    /// ([`responses::chat_request_of`]), tokenized (or hashed) as a chat request is. A
    /// conversation continued by `previous_response_id` is not hashed: the engine puts its
    /// stored conversation first, which the gateway cannot see, so the blocks of the new input
    /// alone would be recorded for blocks the engine never caches; its engine is found by the
    /// id instead. An input the conversion does not cover, or that the chat path refuses (an
    /// image part, say: the engine's to take or refuse), is routed unhashed and counted.
    /// Without hashes, the prompt's size for limits and flow control is a quarter of its
    /// `input`'s JSON bytes (of the whole body when serde_json's `Value` cannot hold it: a
    /// number past f64's range). `previous_response_id` is read from `payload` (as parsed
    /// for every request), so that such a number anywhere neither hides it nor makes it
    /// pass unchecked.
    fn responses_prompt(&self, payload: &Payload<'_>, raw: &[u8]) -> Result<Prompt, Refusal> {
        let unhashed = |size: usize| {
            self.counters.responses_unhashed.fetch_add(1, Ordering::Relaxed);
            Ok(Prompt { tokens: Vec::new(), ids: 0, size, previous: None, kind: IdKind::Unhashed })
        };
        let previous = match payload.raw("previous_response_id") {
            None => None,
            Some(value) if value.get() == "null" => None,
            Some(value) => match payload::as_str(value) {
                Some(id) if !id.is_empty() => Some(id.into_owned()),
                _ => {
                    return Err(Refusal::new(
                        400,
                        "invalid_request_error",
                        "'previous_response_id' must be a non-empty string",
                    )
                    .param("previous_response_id"))
                }
            },
        };
        let body = serde_json::from_slice::<Value>(raw).ok();
        let size = match &body {
            Some(body) => body.get("input").map_or(4, |input| input.to_string().len()) / 4,
            None => raw.len() / 4,
        };
        if previous.is_some() {
            return Ok(Prompt {
                tokens: Vec::new(),
                ids: 0,
                size,
                previous,
                kind: IdKind::Unhashed,
            });
        }
        let Some(body) = body else { return unhashed(size) };
        let Some(chat) = responses::chat_request_of(&body) else { return unhashed(size) };
        if chat["messages"].as_array().is_none_or(Vec::is_empty) {
            // Nothing to hash (and nothing vLLM would render but a generation prompt).
            return Ok(Prompt {
                tokens: Vec::new(),
                ids: 0,
                size: 0,
                previous: None,
                kind: IdKind::Unhashed,
            });
        }
        let Ok(text) = serde_json::to_vec(&chat) else { return unhashed(size) };
        let Ok(payload) = Payload::parse(&text) else { return unhashed(size) };
        match self.prompt_tokens(&payload, true) {
            Ok(tokens) => {
                let kind = if self.tokenizer.is_some() { IdKind::TokenIds } else { IdKind::Pseudo };
                Ok(Prompt { size: tokens.len(), ids: tokens.len(), tokens, previous: None, kind })
            }
            Err(_) => unhashed(size),
        }
    }

    /// The ids the router hashes: with a tokenizer, the engine's; without, token ids as
    /// given and text as pseudo-tokens. A tokenizer's failure (a malformed conversation, a
    /// template that refuses it) is a 400 naming the problem; nothing it does can panic
    /// through here (a panic would be a 500, the gateway going on).
    pub(crate) fn prompt_tokens(
        &self,
        payload: &Payload<'_>,
        chat: bool,
    ) -> Result<Vec<u32>, Refusal> {
        let bad = |problem: String| Refusal::new(400, "invalid_request_error", problem);
        let empty = payload.text("prompt") == Some(r#""""#);
        if !chat && empty && !embeds_given(payload) {
            // As vLLM refuses it (nothing to route on, and the engine answers 400).
            return Err(bad(
                "Either prompt or prompt_embeds must be provided and non-empty.".into()
            )
            .param("prompt"));
        }
        if !chat && embeds_only(payload) {
            // vLLM takes the prompt as embeddings: no token to hash (their cache blocks are
            // keyed by the embeddings, which no other prompt shares by its tokens).
            return Ok(Vec::new());
        }
        let Some(tokenizer) = &self.tokenizer else {
            if chat {
                payload::check_messages(payload).map_err(bad)?; // as the Python plane does
            }
            return prompt_tokens(payload, chat, self.context_len()).map_err(|p| bad(p.to_owned()));
        };
        // The same first check as without a tokenizer.
        if chat && payload.raw("messages").and_then(payload::non_empty_array) != Some(true) {
            return Err(bad("'messages' must be a non-empty list".into()));
        }
        let tokenized = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if chat {
                tokenize::ChatRequest::of_payload(payload)
                    .and_then(|request| tokenizer.chat_tokens(&request))
            } else {
                let field = |name: &str| payload.value(name).and_then(Result::ok);
                let truncation = request_truncation(payload, tokenizer.context_len())
                    .map_err(|p| tokenize::PromptProblem(p.into()))?;
                tokenizer.completion_tokens(
                    field("prompt").as_ref(),
                    field("add_special_tokens").as_ref(),
                    truncation,
                )
            }
        }));
        match tokenized {
            Ok(Ok(tokens)) => Ok(tokens),
            Ok(Err(problem)) => Err(bad(problem.0)),
            Err(_) => Err(Refusal::new(500, "internal_error", "tokenizing the prompt failed")),
        }
    }
}
