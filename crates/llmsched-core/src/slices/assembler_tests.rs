//! The assembler's own cases; `tests/test_slices_assembler.py` runs the full suite (stop
//! strings across boundaries, recompute equivalence) through the Python class that wraps it.

use serde_json::json;

use super::*;

fn completion(text: &str, ids: &[u32], finish: Option<&str>) -> Value {
    json!({"id": "e", "created": 7, "choices": [
        {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    ]})
}

fn texts(chunks: &[Value]) -> Vec<String> {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| c["text"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn token_ids_continue_the_prompt_and_the_slices_are_stitched() {
    let request = json!({"model": "m", "prompt": [1, 2], "max_tokens": 3});
    let options = AssemblerOptions { response_id: Some("r".into()), ..Default::default() };
    let mut asm = SliceAssembler::new(&request, Api::Completions, options).unwrap();
    let first = asm.next_request(2).unwrap();
    assert_eq!(first["max_tokens"], 2);
    assert_eq!(first["prompt"], json!([1, 2]));
    assert_eq!(first["return_token_ids"], true);
    let out = asm.feed(&completion("ab", &[5, 6], Some("length"))).unwrap();
    assert_eq!(texts(&out), ["ab"]);
    assert!(asm.end_slice().unwrap().is_empty());
    assert!(!asm.done());
    let second = asm.next_request(2).unwrap();
    assert_eq!(second["prompt"], json!([1, 2, 5, 6]));
    assert_eq!(second["max_tokens"], 1);
    asm.feed(&completion("c", &[7], Some("length"))).unwrap();
    let end = asm.end_slice().unwrap();
    assert_eq!(end.last().unwrap()["choices"][0]["finish_reason"], "length");
    let whole = asm.response().unwrap();
    assert_eq!(whole["id"], "r");
    assert_eq!(whole["created"], 7);
    assert_eq!(whole["choices"][0]["text"], "abc");
    assert_eq!(whole["usage"]["slice_details"]["slices"], 2);
    assert_eq!(whole["usage"]["prompt_tokens"], 2);
}

#[test]
fn a_stop_string_across_a_boundary_is_found_in_characters() {
    // "é" and "€" are several bytes: positions are counted in characters, as Python does.
    let request = json!({"prompt": "x", "max_tokens": 10, "stop": ["é€z"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    let out = asm.feed(&completion("abé€", &[], None)).unwrap();
    assert_eq!(texts(&out), ["ab"], "the last two characters are held back");
    asm.feed(&json!({"choices": [], "usage": {"completion_tokens": 4}})).unwrap();
    let mut usage_only = asm.end_slice();
    // No finish reason, but the slice's budget was used: not at a boundary without "length".
    assert!(usage_only.is_err());
    let request = json!({"prompt": "x", "max_tokens": 10, "stop": ["é€z"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    asm.feed(&completion("abé€", &[], Some("length"))).unwrap();
    asm.feed(&json!({"usage": {"completion_tokens": 4}})).unwrap();
    usage_only = asm.end_slice();
    assert_eq!(usage_only.unwrap(), Vec::<Value>::new());
    let next = asm.next_request(4).unwrap();
    assert_eq!(next["prompt"], "xabé€", "the continuation carries the held-back text");
    let out = asm.feed(&completion("zq", &[], Some("length"))).unwrap();
    assert!(texts(&out).iter().all(String::is_empty) || out.is_empty());
    assert!(asm.done());
    assert_eq!(asm.stop_reason(), Some("é€z"));
    assert_eq!(asm.text(), "ab");
}

#[test]
fn a_stop_string_the_engine_cut_still_yields_to_one_across_the_boundary() {
    // Unsliced, "b" then "a" ends "ba" first (ties: "ba" is listed first): the answer is "".
    // Sliced one token at a time, the second slice's engine sees only "a", matches "a" and cuts
    // it from its text: the assembler must put it back to find "ba" across the boundary.
    let request = json!({"prompt": [1], "max_tokens": 5, "stop": ["ba", "a"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(1).unwrap();
    asm.feed(&completion("b", &[98], Some("length"))).unwrap();
    assert!(asm.end_slice().unwrap().is_empty());
    asm.next_request(1).unwrap();
    let stop = json!({"choices": [{"index": 0, "text": "", "token_ids": [97],
        "finish_reason": "stop", "stop_reason": "a"}]});
    asm.feed(&stop).unwrap();
    let end = asm.end_slice().unwrap();
    assert_eq!(texts(&end), [""]);
    assert_eq!((asm.text(), asm.stop_reason()), ("", Some("ba")));
    assert_eq!(asm.usage().completion_tokens, 2);
    // Where no occurrence straddles, the engine's own stop stands and the text is kept.
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(1).unwrap();
    asm.feed(&completion("b", &[98], Some("length"))).unwrap();
    asm.end_slice().unwrap();
    asm.next_request(1).unwrap();
    let stop = json!({"choices": [{"index": 0, "text": "", "token_ids": [97],
        "finish_reason": "stop", "stop_reason": "x"}]});
    asm.feed(&stop).unwrap();
    let end = asm.end_slice().unwrap();
    assert_eq!(texts(&end), ["b", ""]);
    assert_eq!((asm.text(), asm.stop_reason()), ("b", Some("x")));
}

#[test]
fn a_chat_continues_its_final_assistant_message() {
    let request = json!({"model": "m", "max_completion_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}});
    let mut asm = SliceAssembler::new(&request, Api::Chat, Default::default()).unwrap();
    let first = asm.next_request(2).unwrap();
    assert!(first.get("max_completion_tokens").is_none());
    let chunk = json!({"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": "length"}],
        "usage": {"completion_tokens": 2, "prompt_tokens": 5}});
    let out = asm.feed(&chunk).unwrap();
    assert_eq!(out[0]["choices"][0]["delta"], json!({"role": "assistant", "content": "ab"}));
    asm.end_slice().unwrap();
    let second = asm.next_request(2).unwrap();
    assert_eq!(second["messages"][1], json!({"role": "assistant", "content": "ab"}));
    assert_eq!(second["continue_final_message"], true);
    assert_eq!(second["add_generation_prompt"], false);
    let chunk = json!({"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "stop"}],
        "usage": {"completion_tokens": 1, "prompt_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 4}}});
    asm.feed(&chunk).unwrap();
    let end = asm.end_slice().unwrap();
    assert_eq!(end.len(), 2, "the finish chunk, then the usage chunk");
    let usage = asm.usage();
    assert_eq!((usage.prompt_tokens, usage.resent_prompt_tokens), (5, 2));
    assert_eq!(usage.recomputed_prompt_tokens, 2);
    assert_eq!(asm.response().unwrap()["object"], "chat.completion");
}

#[test]
fn requests_and_calls_that_cannot_be_served_are_refused() {
    let unsupported = |request: Value, api| {
        matches!(
            SliceAssembler::new(&request, api, Default::default()),
            Err(AssemblyError::Unsupported(_))
        )
    };
    assert!(unsupported(json!({"prompt": "x", "max_tokens": 2, "n": 2}), Api::Completions));
    assert!(unsupported(json!({"prompt": "x", "max_tokens": 2, "logprobs": 1}), Api::Completions));
    assert!(unsupported(json!({"prompt": ["a", "b"], "max_tokens": 2}), Api::Completions));
    assert!(unsupported(json!({"prompt": "x"}), Api::Completions));
    assert!(unsupported(json!({"messages": [], "max_tokens": 2}), Api::Chat));
    assert!(unsupported(json!({"prompt": "x", "max_tokens": 2, "stop": [""]}), Api::Completions));
    // logprobs: 0 is Python's False: allowed.
    assert!(!unsupported(json!({"prompt": "x", "max_tokens": 2, "logprobs": 0}), Api::Completions));
    let request = json!({"prompt": [1], "max_tokens": 2});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    assert!(matches!(asm.feed(&json!({})), Err(AssemblyError::State(_))));
    assert!(matches!(asm.next_request(0), Err(AssemblyError::Value(_))));
    asm.next_request(2).unwrap();
    let bad = json!({"choices": [{"index": 1, "text": "x"}]});
    assert!(matches!(asm.feed(&bad), Err(AssemblyError::Value(_))));
    asm.feed(&json!({"usage": {"completion_tokens": 3}})).unwrap();
    let over = asm.end_slice().unwrap_err();
    assert_eq!(over.to_string(), "the engine generated 3 tokens in a slice of 2");
}

/// One slice of one-character tokens (ids 100 on), ending at the slice's budget.
fn slice_of(asm: &mut SliceAssembler, pieces: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let finish = (i + 1 == pieces.len()).then_some("length");
        out.extend(texts(&asm.feed(&completion(piece, &[100 + i as u32], finish)).unwrap()));
    }
    out.extend(texts(&asm.end_slice().unwrap()));
    out
}

#[test]
fn no_stop_string_ends_within_the_first_min_tokens() {
    // vLLM checks stop strings only once `min_tokens` are generated: an occurrence counts where
    // it ends after the text of the first `min_tokens` tokens. The slice reaching min_tokens is
    // cut short there, so that text is known exactly.
    let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": 3, "stop": ["b"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    let first = asm.next_request(4).unwrap();
    assert_eq!((&first["max_tokens"], &first["min_tokens"]), (&json!(3), &json!(3)));
    assert_eq!(slice_of(&mut asm, &["a", "b", "a"]), ["a", "b", "a"]);
    assert!(!asm.done(), "the 'b' of token 2 is within min_tokens");
    let second = asm.next_request(4).unwrap();
    assert_eq!((&second["max_tokens"], &second["min_tokens"]), (&json!(4), &json!(0)));
    asm.feed(&completion("c", &[7], None)).unwrap();
    asm.feed(&completion("b", &[8], None)).unwrap();
    assert!(asm.done());
    assert_eq!((asm.text(), asm.stop_reason()), ("abac", Some("b")));
    // Without stop strings the slices are not cut short.
    let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": 3});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    assert_eq!(asm.next_request(4).unwrap()["max_tokens"], 4);
}

#[test]
fn a_stop_string_ending_after_min_tokens_counts_though_it_starts_within_them() {
    // Straddling the min_tokens point: "ab" over tokens 2 and 3 ends the answer (vLLM's search
    // starts a stop's length before the point).
    let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": 2, "stop": ["ab"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    assert_eq!(slice_of(&mut asm, &["x", "a"]), ["x"]);
    asm.next_request(4).unwrap();
    asm.feed(&completion("b", &[9], None)).unwrap();
    assert_eq!((asm.text(), asm.stop_reason()), ("x", Some("ab")));
    // Overlapping occurrences: "aa" within min_tokens does not count, "aa" over the point does.
    let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": 2, "stop": ["aa"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    slice_of(&mut asm, &["a", "a"]);
    assert!(!asm.done());
    asm.next_request(4).unwrap();
    asm.feed(&completion("a", &[9], None)).unwrap();
    assert_eq!((asm.text(), asm.stop_reason()), ("a", Some("aa")));
    // An engine that stopped on a stop string within min_tokens anyway is believed.
    let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": 4, "stop": ["z", "q"]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    asm.feed(&completion("q", &[5], None)).unwrap();
    let stop = json!({"choices": [{"index": 0, "text": "", "token_ids": [6],
        "finish_reason": "stop", "stop_reason": "z"}]});
    asm.feed(&stop).unwrap();
    asm.end_slice().unwrap();
    assert_eq!((asm.text(), asm.stop_reason()), ("q", Some("z")));
}

#[test]
fn a_min_tokens_the_engine_would_refuse_is_not_sliced() {
    // Negative, not an int, or above max_tokens: the engine's 400 on the request unsliced,
    // not a continuation that hides the value or a 502 from a slice.
    for min_tokens in [json!(-1), json!("3"), json!(true), json!(2.5), json!(11)] {
        let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": min_tokens});
        let refused = SliceAssembler::new(&request, Api::Completions, Default::default());
        assert!(matches!(refused, Err(AssemblyError::Unsupported(_))), "{min_tokens}");
    }
    for min_tokens in [json!(null), json!(0), json!(10)] {
        let request = json!({"prompt": [1], "max_tokens": 10, "min_tokens": min_tokens});
        assert!(SliceAssembler::new(&request, Api::Completions, Default::default()).is_ok());
    }
}

#[test]
fn produced_tokens_count_the_slice_in_progress() {
    // A client leaving mid-slice is charged what the engine streamed of it, not only the
    // slices that ended (before: generated_tokens alone, the current slice's tokens lost).
    let request = json!({"prompt": [1], "max_tokens": 10});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    asm.feed(&completion("ab", &[5, 6, 7, 8], Some("length"))).unwrap();
    asm.end_slice().unwrap();
    assert_eq!((asm.generated_tokens(), asm.produced_tokens()), (4, 4));
    asm.next_request(4).unwrap();
    assert_eq!(asm.produced_tokens(), 4, "nothing streamed of the new slice yet");
    asm.feed(&completion("c", &[9], None)).unwrap();
    asm.feed(&completion("d", &[10], None)).unwrap();
    assert_eq!((asm.generated_tokens(), asm.produced_tokens()), (4, 6));
    // Without token ids, one token per streamed choice (as the unsliced path counts).
    let request = json!({"prompt": "x", "max_tokens": 10});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(4).unwrap();
    for piece in ["a", "b", "c"] {
        asm.feed(&completion(piece, &[], None)).unwrap();
    }
    assert_eq!(asm.produced_tokens(), 3);
    // A usage block mid-slice counts, capped at the slice's budget.
    asm.feed(&json!({"choices": [], "usage": {"completion_tokens": 99}})).unwrap();
    assert_eq!(asm.produced_tokens(), 4);
}

#[test]
fn a_seeded_request_gets_a_seed_of_its_own_per_continuation() {
    let request = json!({"model": "m", "prompt": [1], "max_tokens": 9, "seed": -5});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    let mut seeds = Vec::new();
    for _ in 0..3 {
        let body = asm.next_request(3).unwrap();
        seeds.push(body["seed"].clone());
        asm.feed(&completion("abc", &[5, 6, 7], Some("length"))).unwrap();
        asm.end_slice().unwrap();
    }
    assert!(asm.done());
    assert_eq!(seeds[0], -5, "the first slice is the user's request");
    let derived: Vec<i64> = seeds[1..].iter().map(|s| s.as_i64().unwrap()).collect();
    assert!(derived.iter().all(|s| *s >= 0), "{derived:?}");
    assert_ne!(derived[0], derived[1]);
    assert_eq!(continuation_seed(5, 3), continuation_seed(5, 3));
    assert_ne!(continuation_seed(5, 3), continuation_seed(6, 3));
    assert!(continuation_seed(u64::MAX, u64::MAX) < 1 << 63);
}

#[test]
fn a_stop_token_id_is_the_stop_reason_as_unsliced() {
    let request = json!({"model": "m", "prompt": [1], "max_tokens": 9, "stop_token_ids": [7]});
    let mut asm = SliceAssembler::new(&request, Api::Completions, Default::default()).unwrap();
    asm.next_request(3).unwrap();
    asm.feed(&completion("ab", &[5, 6], Some("length"))).unwrap();
    asm.feed(&completion("c", &[8], Some("length"))).unwrap();
    asm.end_slice().unwrap();
    asm.next_request(3).unwrap();
    let mut last = completion("d", &[7], Some("stop"));
    last["choices"][0]["stop_reason"] = json!(7);
    asm.feed(&last).unwrap();
    let end = asm.end_slice().unwrap();
    assert!(asm.done());
    assert_eq!(end.last().unwrap()["choices"][0]["stop_reason"], 7);
    assert_eq!(asm.response().unwrap()["choices"][0]["stop_reason"], 7);
    assert_eq!(asm.stop_reason(), None, "no stop string ended it");
}
