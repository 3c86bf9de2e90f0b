"""SliceAssembler: continuation requests, stitching, stop strings across boundaries, and a
deterministic fake engine showing that slicing + recompute gives the uninterrupted stream."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsched.errors import ConfigError, SliceStateError
from llmsched.slices import SliceAssembler, SliceTracker, SwitchCostModel, WaitingRequest

EOS = 0
BLOCK = 4


class FakeEngine:
    """A deterministic greedy 'model' with a character-level vocabulary (id = code point) and
    an OpenAI-style streaming API: the next token is a hash of the last three tokens; EOS when
    the hash says so once the context has 8 tokens (a function of the context only). A prefix
    cache of ``cache_tokens`` (block granular, oldest sequences evicted first) reports
    ``cached_tokens`` as vLLM does."""

    def __init__(self, *, seed: int = 7, eos_every: int = 0, cache_tokens: int = 0) -> None:
        self.seed = seed
        self.eos_every = eos_every
        self.cache_tokens = cache_tokens
        self.cache: list[list[int]] = []
        self.calls = 0

    def next_token(self, context: Sequence[int]) -> int:
        h = self.seed
        for t in context[-3:]:
            h = (h * 1_000_003 + t) & 0xFFFFFFFF
            h ^= h >> 13
        if self.eos_every and len(context) >= 8 and h % self.eos_every == 0:
            return EOS
        return ord("a") + h % 6 if h % 7 else ord(" ")

    @staticmethod
    def template(messages: list[dict[str, Any]], add_generation_prompt: bool, cont: bool) -> str:
        parts = [f"[{m['role']}]{m['content']}" + ("" if cont and i == len(messages) - 1 else "\n")
                 for i, m in enumerate(messages)]  # fmt: skip
        return "".join(parts) + ("[assistant]" if add_generation_prompt else "")

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.cache:
            n = 0
            while n < min(len(seq), len(prompt)) and seq[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK

    def _store(self, seq: list[int]) -> None:
        self.cache.append(seq)
        while self.cache and sum(len(s) for s in self.cache) > self.cache_tokens:
            self.cache.pop(0)

    def complete(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.calls += 1
        chat = "messages" in body
        if chat:
            text = self.template(
                body["messages"],
                body.get("add_generation_prompt", True),
                body.get("continue_final_message", False),
            )
            prompt = [ord(c) for c in text]
        elif isinstance(body["prompt"], str):
            prompt = [ord(c) for c in body["prompt"]]
        else:
            prompt = list(body["prompt"])
        cached = self._cached(prompt)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        hold = max((len(s) for s in stops), default=1) - 1  # vLLM holds back a tail too
        seq, out, sent, n, finish, stop_reason = list(prompt), "", 0, 0, "length", None
        envelope = {"id": f"engine-{self.calls}", "created": 1, "model": "fake"}
        while n < body["max_tokens"]:
            token = self.next_token(seq)
            seq.append(token)
            n += 1
            if token == EOS:
                yield self._chunk(envelope, chat, "", [token], None)
                finish = "stop"
                break
            out += chr(token)
            hit = next((s for s in stops if out.endswith(s)), None)
            if hit is not None:
                out = out[: -len(hit)]
                finish, stop_reason = "stop", hit
                yield self._chunk(envelope, chat, out[sent:], [token], None)
                sent = len(out)
                break
            upto = max(sent, len(out) - hold)
            yield self._chunk(envelope, chat, out[sent:upto], [token], None)
            sent = upto
        final = self._chunk(envelope, chat, out[sent:], [], finish)
        final["choices"][0]["stop_reason"] = stop_reason
        yield final
        self._store(seq)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        yield {**envelope, "choices": [], "usage": usage}

    @staticmethod
    def _chunk(
        envelope: dict[str, Any], chat: bool, text: str, ids: list[int], finish: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": ids}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        return {**envelope, "choices": [choice]}


def run_uninterrupted(engine: FakeEngine, request: dict[str, Any], api: str) -> dict[str, Any]:
    asm = SliceAssembler(request, api=api)  # type: ignore[arg-type]
    body = asm.next_request(asm.remaining_tokens)
    chunks = [c for engine_chunk in engine.complete(body) for c in asm.feed(engine_chunk)]
    chunks += asm.end_slice()
    assert asm.done
    return {"asm": asm, "chunks": chunks, "ids": list(asm.generated_token_ids)}


def run_sliced(
    engine: FakeEngine,
    request: dict[str, Any],
    api: str,
    tracker: SliceTracker,
    *,
    prompt_tokens: int,
    waiting: Sequence[WaitingRequest] = (),
) -> dict[str, Any]:
    """The gateway loop: slice with the tracker's budgets, stitch with the assembler."""
    asm = SliceAssembler(request, api=api, response_id="resp-1")  # type: ignore[arg-type]
    start = tracker.admit(
        1, prompt_tokens=prompt_tokens, max_tokens=asm.remaining_tokens, endpoint="a"
    )
    slice_tokens, chunks, actions = start.slice_tokens, [], []
    while True:
        body = asm.next_request(slice_tokens)
        for engine_chunk in engine.complete(body):
            chunks += asm.feed(engine_chunk)
            if asm.done:
                break  # a stop string straddled the boundary: cut the engine stream
        chunks += asm.end_slice()
        tracker.record_tokens(1, asm.last_slice_tokens)
        decision = tracker.decide(1, finished=asm.done, waiting=waiting, now=0.0)
        actions.append(decision.action)
        if decision.action == "finish":
            break
        slice_tokens = decision.next_slice_tokens
        if decision.action != "continue":
            assert decision.endpoint is not None
            slice_tokens = tracker.resume(1, endpoint=decision.endpoint).slice_tokens
    return {"asm": asm, "chunks": chunks, "ids": list(asm.generated_token_ids), "actions": actions}


def streamed_text(chunks: list[dict[str, Any]], api: str) -> str:
    key = "text" if api == "completions" else "content"
    out = []
    for c in chunks:
        for choice in c["choices"]:
            out.append(choice[key] if api == "completions" else choice["delta"].get(key, ""))
    return "".join(out)


def tracker(slice_tokens: int) -> SliceTracker:
    return SliceTracker("fixed", {"slice_tokens": slice_tokens}, endpoints=["a"])


# --------------------------------------------------------------------------------------------
# Fake engine: slicing + recompute == one uninterrupted generation
# --------------------------------------------------------------------------------------------

REQUESTS = {
    "completions-ids": ({"model": "m", "prompt": [104, 105, 33], "max_tokens": 50}, 3),
    "completions-text": ({"model": "m", "prompt": "hello", "max_tokens": 50}, 5),
    "chat": ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}, 20),
}


@pytest.mark.parametrize("kind", sorted(REQUESTS))
@pytest.mark.parametrize("slice_tokens", [1, 3, 7, 16, 50, 64])
@pytest.mark.parametrize("eos_every", [0, 11])
def test_slicing_matches_uninterrupted_generation(
    kind: str, slice_tokens: int, eos_every: int
) -> None:
    request, prompt_tokens = REQUESTS[kind]
    api = "chat" if kind == "chat" else "completions"
    whole = run_uninterrupted(FakeEngine(eos_every=eos_every), request, api)
    sliced = run_sliced(
        FakeEngine(eos_every=eos_every), request, api, tracker(slice_tokens),
        prompt_tokens=prompt_tokens,
    )  # fmt: skip
    assert sliced["ids"] == whole["ids"]
    assert sliced["asm"].text == whole["asm"].text != ""
    assert streamed_text(sliced["chunks"], api) == whole["asm"].text
    assert sliced["asm"].finish_reason == whole["asm"].finish_reason
    usage, whole_usage = sliced["asm"].usage, whole["asm"].usage
    assert usage.completion_tokens == whole_usage.completion_tokens == len(whole["ids"])
    assert usage.prompt_tokens == whole_usage.prompt_tokens
    assert usage.slices == len(sliced["actions"])
    assert usage.slices == -(-usage.completion_tokens // slice_tokens)
    # Slice k re-sends the output of slices 0..k-1 (text re-tokenises one id per character).
    n = usage.completion_tokens
    resent = sum(min(k * slice_tokens, n) for k in range(1, usage.slices))
    assert usage.resent_prompt_tokens == resent
    assert usage.recomputed_prompt_tokens == usage.resent_prompt_tokens  # no prefix cache
    ids = {c["id"] for c in sliced["chunks"]}
    assert ids == {"resp-1"}


def test_prefix_cache_hits_are_not_counted_as_recompute() -> None:
    request, _ = REQUESTS["completions-ids"]
    engine = FakeEngine(cache_tokens=10_000)
    sliced = run_sliced(engine, request, "completions", tracker(8), prompt_tokens=3)
    usage = sliced["asm"].usage
    assert usage.resent_prompt_tokens > 0
    # Everything re-sent except the last, partial block of each slice was cached.
    assert usage.recomputed_prompt_tokens < usage.resent_prompt_tokens
    assert usage.recomputed_prompt_tokens <= BLOCK * (usage.slices - 1)
    final_usage = sliced["asm"].response()["usage"]
    assert final_usage["slice_details"]["slices"] == usage.slices


def test_yielding_gateway_loop_still_matches() -> None:
    request, _ = REQUESTS["completions-ids"]
    t = SliceTracker("mlfq", {"base_quantum": 4, "levels": 3}, endpoints=["a", "b"])
    t.set_endpoint("a", kv_cache_usage=0.0)
    short = [WaitingRequest(priority=2, level=0, context_tokens=10, expected_tokens=1)]
    sliced = run_sliced(FakeEngine(), request, "completions", t, prompt_tokens=3, waiting=short)
    whole = run_uninterrupted(FakeEngine(), request, "completions")
    assert "yield" in sliced["actions"] or "migrate" in sliced["actions"]
    assert sliced["ids"] == whole["ids"]


@pytest.mark.parametrize("stop", [["d c"], ["zz", "ca"], ["b", "a "]])
@pytest.mark.parametrize("slice_tokens", [1, 2, 5])
@pytest.mark.parametrize("forward_stop", [True, False])
def test_stop_strings_with_the_engine(
    stop: list[str], slice_tokens: int, forward_stop: bool
) -> None:
    request = {"model": "m", "prompt": [104, 105], "max_tokens": 60, "stop": stop}
    whole = run_uninterrupted(FakeEngine(), request, "completions")
    asm = SliceAssembler(request, forward_stop=forward_stop)
    engine = FakeEngine()
    while not asm.done:
        for chunk in engine.complete(asm.next_request(slice_tokens)):
            asm.feed(chunk)
            if asm.done:
                break
        asm.end_slice()
    assert asm.text == whole["asm"].text
    assert (asm.finish_reason, asm.stop_reason) == (
        whole["asm"].finish_reason,
        whole["asm"].stop_reason,
    )


# --------------------------------------------------------------------------------------------
# Stop strings across slice boundaries: exactly the uninterrupted text
# --------------------------------------------------------------------------------------------


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The uninterrupted response checked character by character: it ends before (or after,
    with include) the stop occurrence that ends first; ties go to the stop listed first."""
    for end in range(1, len(text) + 1):
        for stop in stops:
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\nc", min_size=1, max_size=60),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=0, max_size=3),
    cuts=st.lists(st.integers(1, 8), min_size=1, max_size=30),
    pieces=st.integers(1, 3),
    include=st.booleans(),
    chat=st.booleans(),
)
def test_stop_strings_across_boundaries(
    text: str, stops: list[str], cuts: list[int], pieces: int, include: bool, chat: bool
) -> None:
    api = "chat" if chat else "completions"
    request: dict[str, Any] = {"model": "m", "max_tokens": len(text) + 1, "stop": stops}
    request["include_stop_str_in_output"] = include
    if chat:
        request["messages"] = [{"role": "user", "content": "q"}]
    else:
        request["prompt"] = "p"
    asm = SliceAssembler(request, api=api)  # type: ignore[arg-type]
    chunks: list[dict[str, Any]] = []
    pos, k = 0, 0
    key = "text" if api == "completions" else "content"
    while not asm.done:
        size = cuts[k % len(cuts)]
        k += 1
        body = asm.next_request(size)
        piece = text[pos : pos + body["max_tokens"]]
        tokens = len(piece)
        finish = "length"
        if pos + tokens >= len(text) and tokens < body["max_tokens"]:
            tokens += 1  # the end-of-sequence token
            finish = "stop"
        pos += len(piece)
        step = max(1, -(-len(piece) // pieces))
        for i in range(0, len(piece), step):
            part = piece[i : i + step]
            choice = {"index": 0, key: part} if not chat else {"index": 0, "delta": {key: part}}
            chunks += asm.feed({"choices": [choice]})
        chunks += asm.feed({"choices": [{"index": 0, key: "", "finish_reason": finish}]})
        usage = {"prompt_tokens": 1 + pos, "completion_tokens": tokens}
        chunks += asm.feed({"choices": [], "usage": usage})
        chunks += asm.end_slice()
    want, stop = reference_cut(text, stops, include)
    assert asm.text == want
    assert streamed_text(chunks, api) == want
    assert asm.stop_reason == stop
    assert asm.finish_reason == "stop"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and chunks[-1] is finals[0]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab", min_size=0, max_size=14),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=3), min_size=1, max_size=2),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    include=st.booleans(),
    chat=st.booleans(),
)
def test_stop_strings_the_engine_cuts_across_boundaries(
    text: str, stops: list[str], cuts: list[int], include: bool, chat: bool
) -> None:
    """The engine applies the forwarded stop strings to each slice's own output, as vLLM does
    (one character per token, checked after every token, stops in list order) and cuts the one
    it matched out of its text. An occurrence that straddles a boundary, which the engine
    cannot see, ends the response when it ends first, as in the uninterrupted generation."""
    api = "chat" if chat else "completions"
    request: dict[str, Any] = {"model": "m", "max_tokens": len(text) + 1, "stop": stops}
    request["include_stop_str_in_output"] = include
    if chat:
        request["messages"] = [{"role": "user", "content": "q"}]
    else:
        request["prompt"] = "p"
    asm = SliceAssembler(request, api=api)  # type: ignore[arg-type]
    chunks: list[dict[str, Any]] = []
    pos, k, made = 0, 0, 0
    key = "text" if api == "completions" else "content"
    while not asm.done:
        size = cuts[k % len(cuts)]
        k += 1
        body = asm.next_request(size)
        out, tokens, finish, stop_reason = "", 0, "length", None
        while tokens < body["max_tokens"]:
            tokens += 1
            if pos >= len(text):
                finish = "stop"  # the end-of-sequence token
                break
            out += text[pos]
            pos += 1
            hit = next((s for s in body["stop"] if out.endswith(s)), None)
            if hit is not None:
                out = out if include else out[: -len(hit)]
                finish, stop_reason = "stop", hit
                break
        made += tokens
        choice = {"index": 0, key: out} if not chat else {"index": 0, "delta": {key: out}}
        chunks += asm.feed({"choices": [choice]})
        final = {"index": 0, key: "", "finish_reason": finish, "stop_reason": stop_reason}
        chunks += asm.feed({"choices": [final]})
        chunks += asm.feed({"choices": [], "usage": {"completion_tokens": tokens}})
        chunks += asm.end_slice()
    want, stop = reference_cut(text, stops, include)
    assert (asm.text, asm.stop_reason) == (want, stop)
    assert streamed_text(chunks, api) == want
    assert asm.finish_reason == "stop"
    assert asm.usage.completion_tokens == made, "every slice's tokens are counted"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and chunks[-1] is finals[0]


# --------------------------------------------------------------------------------------------
# Continuation request shapes and errors
# --------------------------------------------------------------------------------------------


def _feed_slice(asm: SliceAssembler, text: str, ids: list[int] | None, finish: str) -> None:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    if asm.api == "chat":
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    asm.feed({"id": "x", "created": 5, "model": "m", "choices": [choice]})
    n = len(ids) if ids is not None else len(text)
    asm.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    asm.end_slice()


def _coin_engine(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A sampled engine as vLLM seeds one: a generator of its own per request, seeded with the
    request's ``seed``; each token a fair coin flip (id 1 or 2) drawn from it."""
    rng = random.Random(body["seed"])
    ids = [1 + rng.randrange(2) for _ in range(body["max_tokens"])]
    text = "".join("ab"[i - 1] for i in ids)
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "length"}
    yield {"id": "e", "created": 1, "choices": [choice]}
    yield {"id": "e", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(ids)}}


def _seeded_run(request: dict[str, Any], slice_tokens: int) -> tuple[list[int], list[object]]:
    asm = SliceAssembler(request)
    seeds = []
    while not asm.done:
        body = asm.next_request(slice_tokens)
        seeds.append(body.get("seed"))
        for chunk in _coin_engine(body):
            asm.feed(chunk)
        asm.end_slice()
    return list(asm.generated_token_ids), seeds


def test_a_seeded_request_draws_afresh_on_every_slice() -> None:
    # Every continuation carried the user's seed, so each slice replayed the first slice's
    # random draws: with one-token slices all 40 flips came out the same, a correlation across
    # boundaries no unsliced run has (not "equivalent in distribution").
    request = {"model": "m", "prompt": [5], "max_tokens": 40, "temperature": 1.0, "seed": 1234}
    ids, seeds = _seeded_run(request, 1)
    assert sorted(set(ids)) == [1, 2]
    assert abs(ids.count(1) - 20) < 12  # a fair coin, not one side
    assert seeds[0] == 1234  # the first slice is the unsliced request's own start
    assert len(set(seeds)) == len(seeds)  # each continuation its own stream
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)  # vLLM's seed range
    # Deterministic: the same request sliced the same way gives the same tokens.
    assert _seeded_run(request, 1) == (ids, seeds)
    # The first slice of a sliced run is the unsliced run's first tokens.
    whole, _ = _seeded_run(request, 40)
    assert _seeded_run(request, 8)[0][:8] == whole[:8]
    # Without a seed (the engine's own generator) or with one that is not an int, the field
    # is sent as given.
    for seed in (None, "7", 1.5):
        asm = SliceAssembler({**request, "seed": seed})
        asm.next_request(1)
        choice = {"index": 0, "text": "a", "token_ids": [1], "finish_reason": "length"}
        asm.feed({"choices": [choice]})
        asm.feed({"choices": [], "usage": {"completion_tokens": 1}})
        asm.end_slice()
        assert asm.next_request(1)["seed"] == seed


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_stop_token_id_is_the_stop_reason_as_unsliced(api: str) -> None:
    # vLLM reports the stop token id that ended an answer as its stop_reason (an int); the
    # sliced answer said null, streamed and whole, where the unsliced one says 7.
    base = {"model": "m", "max_tokens": 9, "stop_token_ids": [7]}
    if api == "chat":
        request = {**base, "messages": [{"role": "user", "content": "hi"}]}
    else:
        request = {**base, "prompt": [1]}
    asm = SliceAssembler(request, api=api)  # type: ignore[arg-type]

    def chunk(text: str, ids: list[int], finish: str, stop: object = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": finish}
        choice["stop_reason"] = stop
        if api == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        return {"id": "e", "created": 1, "choices": [choice]}

    asm.next_request(3)
    asm.feed(chunk("abc", [5, 6, 8], "length"))
    assert asm.end_slice() == []
    asm.next_request(3)
    asm.feed(chunk("d", [7], "stop", 7))
    end = asm.end_slice()
    assert asm.done and asm.finish_reason == "stop"
    assert end[-1]["choices"][0]["stop_reason"] == 7
    assert asm.response()["choices"][0]["stop_reason"] == 7
    assert asm.stop_reason is None  # no stop string ended it


def test_continuation_request_shapes() -> None:
    chat = SliceAssembler(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "max_completion_tokens": 10, "min_tokens": 6, "stream_options": {"include_usage": True}},
        api="chat",
    )  # fmt: skip
    first = chat.next_request(4)
    assert first["max_tokens"] == 4 and first["min_tokens"] == 4
    assert "max_completion_tokens" not in first and "continue_final_message" not in first
    _feed_slice(chat, "abcd", None, "length")
    second = chat.next_request(4)
    assert second["messages"][-1] == {"role": "assistant", "content": "abcd"}
    assert second["continue_final_message"] is True
    assert second["add_generation_prompt"] is False
    assert second["min_tokens"] == 2 and second["max_tokens"] == 4
    _feed_slice(chat, "efgh", None, "length")
    assert chat.next_request(100)["max_tokens"] == 2  # min(slice, remaining)

    prefilled = SliceAssembler(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A:"}],
         "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 9},
        api="chat",
    )  # fmt: skip
    prefilled.next_request(3)
    _feed_slice(prefilled, "xyz", None, "length")
    msgs = prefilled.next_request(3)["messages"]
    assert len(msgs) == 2 and msgs[-1]["content"] == "A:xyz"

    text = SliceAssembler({"prompt": ["once"], "max_tokens": 8, "stop": "."}, forward_stop=False)
    text.next_request(3)
    _feed_slice(text, " up", None, "length")
    body = text.next_request(3)
    assert body["prompt"] == "once up" and "stop" not in body and "return_token_ids" not in body


def test_finish_at_budget_and_eos_on_the_boundary() -> None:
    asm = SliceAssembler({"prompt": [1], "max_tokens": 4, "stream_options": {"include_usage": 1}})
    asm.next_request(2)
    _feed_slice(asm, "ab", [5, 6], "length")
    assert not asm.done
    asm.next_request(2)
    _feed_slice(asm, "cd", [7, 8], "length")
    assert (asm.done, asm.finish_reason, asm.text) == (True, "length", "abcd")
    # EOS as the first token of a slice: the response ends with nothing more.
    asm = SliceAssembler({"prompt": [1], "max_tokens": 10})
    asm.next_request(2)
    _feed_slice(asm, "ab", [5, 6], "length")
    asm.next_request(2)
    _feed_slice(asm, "", [EOS], "stop")
    assert (asm.done, asm.finish_reason, asm.text, asm.generated_tokens) == (True, "stop", "ab", 3)
    response = asm.response()
    assert response["choices"][0]["text"] == "ab" and response["id"] == "x"
    with pytest.raises(SliceStateError):
        asm.next_request(2)


@pytest.mark.parametrize(
    ("request_body", "kwargs", "match"),
    [
        ({"prompt": [1], "max_tokens": 5, "n": 2}, {}, "n=2"),
        ({"prompt": [1], "max_tokens": 5, "echo": True}, {}, "echo"),
        ({"prompt": [1], "max_tokens": 5, "logprobs": 2}, {}, "logprobs"),
        ({"prompt": "a b", "max_tokens": 5, "truncate_prompt_tokens": 1}, {}, "truncate_prompt"),
        ({"prompt": [1], "max_tokens": 5, "truncate_prompt_tokens": -1}, {}, "truncate_prompt"),
        (
            {"prompt": [1], "max_tokens": 5, "response_format": {"type": "json_object"}},
            {},
            "response_format",
        ),
        ({"prompt": [1], "max_tokens": 5, "guided_regex": "a+"}, {}, "guided_regex"),
        (
            {"prompt": [1], "max_tokens": 5, "structured_outputs": {"choice": ["a"]}},
            {},
            "structured_outputs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            {"api": "chat", "default_max_tokens": 3},
            "tool calling",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
                "tool_choice": "required",
            },
            {"api": "chat", "default_max_tokens": 3},
            "tool calling",
        ),
        (
            {
                "prompt": [1],
                "max_tokens": 5,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            {},
            "continuous_usage_stats",
        ),
        ({"prompt": ["a", "b"], "max_tokens": 5}, {}, "batched"),
        ({"prompt": [1, -2], "max_tokens": 5}, {}, "token ids"),
        ({"prompt": [1]}, {}, "no max_tokens"),
        ({"prompt": [1], "max_tokens": 5, "stop": [""]}, {}, "stop"),
        # The engine judges these on the request unsliced (probe 61).
        ({"prompt": [1], "max_tokens": 5, "min_tokens": -1}, {}, "min_tokens"),
        ({"prompt": [1], "max_tokens": 5, "min_tokens": 6}, {}, "min_tokens"),
        ({"prompt": [1], "max_tokens": 5, "min_tokens": "2"}, {}, "min_tokens"),
        ({"messages": []}, {"api": "chat", "default_max_tokens": 3}, "non-empty"),
        ({"prompt": [1], "max_tokens": 5}, {"api": "embeddings"}, "api"),
    ],
)
def test_bad_requests_raise_config_error(
    request_body: dict[str, Any], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        SliceAssembler(request_body, **kwargs)


def test_requests_whose_output_slicing_keeps_are_sliced() -> None:
    """A text response format, tools the request says not to call, null fields and usage
    only at the end leave a request sliceable."""
    for body in [
        {"prompt": [1], "max_tokens": 5, "response_format": {"type": "text"}},
        {"prompt": [1], "max_tokens": 5, "truncate_prompt_tokens": None, "guided_json": None},
        {"prompt": [1], "max_tokens": 5, "stream_options": {"include_usage": True}},
    ]:
        SliceAssembler(body)
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
    }
    SliceAssembler(chat, api="chat", default_max_tokens=3)
    SliceAssembler({**chat, "tools": []}, api="chat", default_max_tokens=3)


def test_engine_protocol_errors() -> None:
    asm = SliceAssembler({"prompt": [1], "max_tokens": 5})
    with pytest.raises(SliceStateError, match="next_request"):
        asm.feed({"choices": []})
    asm.next_request(2)
    asm.feed({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
    with pytest.raises(SliceStateError, match="usage"):
        asm.end_slice()
    asm.next_request(2)
    asm.feed({"choices": [{"index": 0, "text": "abc", "token_ids": [1, 2, 3]}]})
    for _ in range(2):  # a refused end_slice changes nothing
        with pytest.raises(SliceStateError, match="3 tokens in a slice of 2"):
            asm.end_slice()
        assert (asm.generated_tokens, asm.generated_token_ids, asm.usage.slices) == (0, [], 0)
    fresh = SliceAssembler({"prompt": [1], "max_tokens": 5})
    with pytest.raises(SliceStateError, match="end_slice"):
        fresh.end_slice()


def test_switch_cost_model_is_used_by_the_tracker() -> None:
    cost = SwitchCostModel(requeue_delay_s=100.0)  # switching never pays
    t = SliceTracker("fixed", {"slice_tokens": 4}, cost_model=cost, endpoints=["a"])
    request, _ = REQUESTS["completions-ids"]
    short = [WaitingRequest(priority=0, level=0, context_tokens=10, expected_tokens=1)]
    sliced = run_sliced(FakeEngine(), request, "completions", t, prompt_tokens=3, waiting=short)
    assert set(sliced["actions"]) <= {"continue", "finish"}
