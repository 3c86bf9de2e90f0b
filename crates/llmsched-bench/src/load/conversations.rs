//! Conversations on OpenAI's Responses API for the open-loop load ([`super::LoadConfig::responses`]).
//!
//! At each scheduled start the generator takes the conversation that has waited longest among
//! those whose last turn has been answered and that have turns left
//! ([`super::LoadConfig::turns`]), and sends its continuation: `previous_response_id` set to
//! its last response's id and a short new user `input`, to the URL its first turn went to.
//! With none waiting it opens a new conversation: `instructions` chosen among
//! [`super::LoadConfig::system_prompts`] shared texts, an `input` of
//! [`super::LoadConfig::prompt_words`] words. The schedule never waits for a conversation: a
//! slow server gets more conversations open at once, not fewer requests.
//!
//! A response's id is read from the JSON answer's `id` or from the first event of a stream
//! (where vLLM writes it first, [`first_id`]). A conversation ends at its last turn or at its
//! first failed request: a continuation answered 404 went to an engine that does not hold
//! the conversation (vLLM keeps it in the memory of the engine that made the response), and
//! is counted as lost ([`ConversationCounts::continuations_lost`]).
//!
//! Complexity: one lock of a queue per request; the first turns' bodies are made before the
//! clock starts, a continuation's (a few dozen bytes) when it is sent.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{json, Value};

use super::{LoadConfig, Timing};

/// Words in each shared `instructions` text.
pub const INSTRUCTION_WORDS: usize = 100;

/// What a Responses load counted in its measured window.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConversationCounts {
    /// Conversations opened (first turns sent).
    pub started: usize,
    /// Continuations sent (requests with `previous_response_id`).
    pub continuations: usize,
    /// Of those, answered 404: the engine that answered does not hold the conversation.
    pub continuations_lost: usize,
    /// Answers with a 200 whose response id could not be read (their conversations end).
    pub ids_unread: usize,
}

impl ConversationCounts {
    /// Counts the measured requests: each one's turn and outcome.
    pub(super) fn of<'a>(
        records: impl Iterator<Item = (Option<&'a Turn>, &'a Result<Timing, String>)>,
    ) -> Self {
        let mut counts = ConversationCounts::default();
        for (turn, outcome) in records {
            let Some(turn) = turn else { continue };
            if turn.number == 0 {
                counts.started += 1;
            } else {
                counts.continuations += 1;
                if matches!(outcome, Err(kind) if kind == "status_404") {
                    counts.continuations_lost += 1;
                }
            }
            if matches!(outcome, Ok(timing) if timing.response_id.is_none()) {
                counts.ids_unread += 1;
            }
        }
        counts
    }
}

/// One request's place in its conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Turn {
    /// The conversation's number, from 0.
    pub(super) conversation: usize,
    /// The index of the URL the conversation's requests go to.
    pub(super) target: usize,
    /// The turn's number in the conversation, from 0 (the first request).
    pub(super) number: usize,
}

/// A conversation whose last turn has been answered, with turns left.
struct Waiting {
    turn: Turn,
    last_id: String,
}

/// The conversations waiting for their next turn, shared by the dispatcher and the requests.
pub(super) struct Idle {
    queue: Mutex<VecDeque<Waiting>>,
    turns: usize,
}

impl Idle {
    /// Records a request's end: with the id of its response and turns left, its conversation
    /// waits for the next turn; otherwise it ends.
    pub(super) fn finished(&self, turn: &Turn, response_id: Option<String>) {
        let Some(last_id) = response_id else { return };
        if turn.number + 1 >= self.turns {
            return;
        }
        let next = Turn { number: turn.number + 1, ..turn.clone() };
        self.queue.lock().unwrap().push_back(Waiting { turn: next, last_id });
    }

    fn take(&self) -> Option<Waiting> {
        self.queue.lock().unwrap().pop_front()
    }
}

/// The conversations of one load: the first turns' bodies and the waiting queue.
pub(super) struct Conversations {
    idle: Arc<Idle>,
    firsts: Vec<Bytes>,
    opened: usize,
    urls: usize,
    model: String,
    max_tokens: u32,
    stream: bool,
}

impl Conversations {
    /// `bodies` first turns made ahead (conversation `c` sends body `c % bodies`), over `urls`
    /// URLs (conversation `c` on URL `c % urls`).
    pub(super) fn new(config: &LoadConfig, bodies: usize, urls: usize) -> Self {
        let firsts = (0..bodies.max(1))
            .map(|c| Bytes::from(serde_json::to_vec(&first_body(config, c)).unwrap()))
            .collect();
        Conversations {
            idle: Arc::new(Idle { queue: Mutex::new(VecDeque::new()), turns: config.turns.max(1) }),
            firsts,
            opened: 0,
            urls: urls.max(1),
            model: config.model.clone(),
            max_tokens: config.max_tokens,
            stream: config.stream,
        }
    }

    /// The queue the requests report back to.
    pub(super) fn idle(&self) -> Arc<Idle> {
        self.idle.clone()
    }

    /// The next request: the longest-waiting conversation's next turn, or a new conversation.
    pub(super) fn next(&mut self) -> (Turn, Bytes) {
        if let Some(waiting) = self.idle.take() {
            let body = continuation_body(
                &self.model,
                self.max_tokens,
                self.stream,
                &waiting.last_id,
                &waiting.turn,
            );
            return (waiting.turn, Bytes::from(serde_json::to_vec(&body).unwrap()));
        }
        let conversation = self.opened;
        self.opened += 1;
        let turn = Turn { conversation, target: conversation % self.urls, number: 0 };
        (turn, self.firsts[conversation % self.firsts.len()].clone())
    }
}

/// The shared `instructions` text number `i`.
pub fn system_prompt(i: usize) -> String {
    format!(
        "You are assistant {i}. {}",
        "Answer briefly and politely. ".repeat(INSTRUCTION_WORDS / 4)
    )
}

/// The first request of conversation `c`: a shared system prompt as `instructions`, an `input`
/// of `prompt_words` words of its own.
pub fn first_body(config: &LoadConfig, c: usize) -> Value {
    let instructions = system_prompt(c % config.system_prompts.max(1));
    let input = format!("Conversation {c}: {}", "question ".repeat(config.prompt_words));
    let mut body = json!({"model": config.model, "instructions": instructions, "input": input,
                          "max_output_tokens": config.max_tokens});
    if config.stream {
        body["stream"] = json!(true);
    }
    body
}

/// A continuation: the previous response's id and a short new user input.
fn continuation_body(
    model: &str,
    max_tokens: u32,
    stream: bool,
    previous: &str,
    turn: &Turn,
) -> Value {
    let input = format!("Turn {} of conversation {}: go on.", turn.number, turn.conversation);
    let mut body = json!({"model": model, "previous_response_id": previous, "input": input,
                          "max_output_tokens": max_tokens});
    if stream {
        body["stream"] = json!(true);
    }
    body
}

/// The response id of a stream's first event: the string value of its first `"id"` key
/// (vLLM writes `{"response": {"id": ...` first), without parsing the event.
pub fn first_id(event: &[u8]) -> Option<String> {
    let key = super::find(event, b"\"id\"")?;
    let rest = event[key + 4..].trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
    (rest.get(end) == Some(&b'"')).then(|| String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// The `id` of a JSON answer (None when it does not parse or has no string `id`).
pub fn json_id(answer: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct WithId {
        id: String,
    }
    serde_json::from_slice::<WithId>(answer).ok().map(|a| a.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(turns: usize, stream: bool) -> LoadConfig {
        LoadConfig { responses: true, turns, stream, prompt_words: 3, ..LoadConfig::default() }
    }

    #[test]
    fn ids_are_read_from_the_first_event_and_the_json_answer() {
        let event = br#"event: response.created
data: {"response": {"id": "resp_7_8000", "object": "response"}, "type": "response.created"}"#;
        assert_eq!(first_id(event).as_deref(), Some("resp_7_8000"));
        assert_eq!(first_id(br#"data: {"response":{"id":"resp_1"}}"#).as_deref(), Some("resp_1"));
        assert_eq!(first_id(br#"data: {"item_id":"msg_1"}"#), None);
        assert_eq!(first_id(br#"data: {"id":"a\"b"}"#), None, "escapes are not read");
        assert_eq!(first_id(br#"data: {"id":"cut"#), None);
        assert_eq!(json_id(br#"{"id":"resp_1","output":[]}"#).as_deref(), Some("resp_1"));
        assert_eq!(json_id(br#"{"id":"resp_1","output":["#), None);
        assert_eq!(json_id(br#"{"error":{}}"#), None);
    }

    #[test]
    fn conversations_continue_until_their_turns_are_spent() {
        let mut conversations = Conversations::new(&config(2, true), 8, 3);
        let (first, body) = conversations.next();
        assert_eq!(first, Turn { conversation: 0, target: 0, number: 0 });
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["input"], "Conversation 0: question question question ");
        assert_eq!(body["instructions"], system_prompt(0));
        assert_eq!(body["stream"], true);
        assert!(body.get("previous_response_id").is_none());
        // Nothing answered yet: the next start opens another conversation, on the next URL.
        let (second, _) = conversations.next();
        assert_eq!((second.conversation, second.target), (1, 1));
        let idle = conversations.idle();
        idle.finished(&second, Some("resp_b".into()));
        idle.finished(&first, None); // failed: it ends
        let (turn, body) = conversations.next();
        assert_eq!(turn, Turn { conversation: 1, target: 1, number: 1 });
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["previous_response_id"], "resp_b");
        assert_eq!(body["max_output_tokens"], 4);
        // Its last turn answered: it ends, and the next start opens conversation 2.
        idle.finished(&turn, Some("resp_c".into()));
        assert_eq!(conversations.next().0, Turn { conversation: 2, target: 2, number: 0 });
    }

    #[test]
    fn counts_tell_lost_continuations_from_other_errors() {
        let turn = |number| Turn { conversation: 0, target: 0, number };
        let ok = |id: Option<&str>| -> Result<Timing, String> {
            Ok(Timing {
                response_id: id.map(str::to_string),
                latency: 0.0,
                ttft: 0.0,
                gaps: Vec::new(),
                stamped: None,
                trace: None,
            })
        };
        let records = [
            (turn(0), ok(Some("a"))),
            (turn(1), ok(Some("b"))),
            (turn(1), Err("status_404".to_string())),
            (turn(2), Err("status_502".to_string())),
            (turn(0), ok(None)),
        ];
        let counts = ConversationCounts::of(records.iter().map(|(t, o)| (Some(t), o)));
        assert_eq!(
            counts,
            ConversationCounts {
                started: 2,
                continuations: 3,
                continuations_lost: 1,
                ids_unread: 1
            }
        );
    }
}
