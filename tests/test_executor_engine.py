"""The engine: batching, chunked prefill, preemption by recompute, token slices, sampling."""

import random

import pytest

torch = pytest.importorskip("torch")

from llmsched.errors import (  # noqa: E402
    ConfigError,
    DuplicateRequestError,
    InvalidTokenError,
    InvalidTypeError,
    InvalidValueError,
    LlmschedError,
    UnknownRequestError,
)
from llmsched.executor.config import EngineConfig, ModelConfig  # noqa: E402
from llmsched.executor.engine import Engine, SamplingParams  # noqa: E402
from llmsched.executor.model import MoETransformer  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    return MoETransformer(ModelConfig())


def prompts(count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(shared)]
    return [
        prefix + [rng.randrange(512) for _ in range(rng.randrange(3, 70))] for _ in range(count)
    ]


def dense_greedy(model: MoETransformer, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model.forward_dense(tokens)[-1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def reference(model: MoETransformer) -> list[list[int]]:
    """Greedy tokens from a roomy engine (checked against dense attention below)."""
    engine = Engine(model, EngineConfig(num_blocks=128, max_num_batched_tokens=1024))
    return engine.generate(prompts(8, shared=20), SamplingParams(max_tokens=24))


def test_engine_matches_dense_greedy_decoding(model, reference) -> None:
    for prompt, tokens in list(zip(prompts(8, shared=20), reference, strict=True))[:3]:
        assert tokens == dense_greedy(model, prompt, 24)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(num_blocks=128, max_num_batched_tokens=16),  # chunked prefill
        EngineConfig(num_blocks=14, max_num_batched_tokens=64),  # preemption
        EngineConfig(num_blocks=128, enable_prefix_caching=False, max_num_seqs=2),
        EngineConfig(num_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=128),
    ],
    ids=["chunked", "preempting", "no-prefix-cache", "whole-prompts"],
)
def test_scheduling_choices_do_not_change_greedy_tokens(model, reference, config) -> None:
    engine = Engine(model, config)
    assert engine.generate(prompts(8, shared=20), SamplingParams(max_tokens=24)) == reference
    metrics = engine.metrics()
    assert metrics.num_requests_running == metrics.num_requests_waiting == 0
    assert metrics.kv_cache_usage == 0.0
    if config.num_blocks == 14:
        assert metrics.num_preemptions > 0
    if config.enable_prefix_caching:
        assert metrics.prefix_cache_hits > 0
    else:
        assert metrics.prefix_cache_hits == 0


def test_dual_batch_overlap_gives_identical_tokens(model, reference) -> None:
    engine = Engine(model, EngineConfig(num_blocks=128), dual_batch_overlap=True)
    assert engine.generate(prompts(8, shared=20), SamplingParams(max_tokens=24)) == reference


def test_chunked_prefill_respects_the_token_budget(model) -> None:
    engine = Engine(model, EngineConfig(max_num_batched_tokens=10))
    engine.add_request("long", list(range(35)), SamplingParams(max_tokens=2))
    computed = []
    while engine.has_unfinished():
        before = engine.requests["long"].num_computed_tokens if "long" in engine.requests else 0
        engine.step()
        after = engine.requests["long"].num_computed_tokens if "long" in engine.requests else None
        computed.append((before, after))
    assert computed[:4] == [(0, 10), (10, 20), (20, 30), (30, 35)]


@pytest.mark.parametrize("slice_tokens", [1, 5, 16])
def test_token_slices_with_kv_evicted_between_slices_give_the_same_tokens(
    model, slice_tokens
) -> None:
    """Each slice is a new request continuing the last one; the cache is wiped in between."""
    prompt = prompts(1, seed=3)[0]
    engine = Engine(model, EngineConfig(num_blocks=32))
    (whole,) = engine.generate([prompt], SamplingParams(max_tokens=30))
    sliced: list[int] = []
    while len(sliced) < 30:
        assert engine.reset_prefix_cache()
        count = min(slice_tokens, 30 - len(sliced))
        (part,) = engine.generate([prompt + sliced], SamplingParams(max_tokens=count))
        sliced += part
    assert sliced == whole
    assert engine.metrics().prefix_cache_hits == 0


def test_preempting_mid_generation_recomputes_to_the_same_tokens(model) -> None:
    prompt = prompts(1, seed=4)[0]
    (whole,) = Engine(model).generate([prompt], SamplingParams(max_tokens=30))
    for params in (
        SamplingParams(max_tokens=30),
        SamplingParams(max_tokens=30, temperature=1.0, seed=9),
    ):
        engine = Engine(model, EngineConfig(enable_prefix_caching=False))
        engine.add_request("r", prompt, params)
        outputs = []
        while engine.has_unfinished():
            for out in engine.step():
                outputs = out.output_token_ids
            if "r" in engine.requests and len(engine.requests["r"].output_token_ids) % 7 == 3:
                engine.preempt("r")
        (uninterrupted,) = Engine(model).generate([prompt], params)
        assert outputs == uninterrupted
        assert engine.metrics().num_preemptions >= 4
    assert whole == Engine(model).generate([prompt], SamplingParams(max_tokens=30))[0]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model) -> None:
    batch = prompts(3, seed=5)
    run = lambda seed: Engine(model).generate(  # noqa: E731
        batch, SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
    )
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_tokens_and_metrics(model, reference) -> None:
    first = reference[0]
    engine = Engine(model)
    engine.add_request(
        "a", prompts(8, shared=20)[0], SamplingParams(max_tokens=24, stop_token_ids=(first[4],))
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_token_ids == first[: first.index(first[4]) + 1]
    text = engine.metrics().prometheus("tiny")
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"}' in text


def test_bad_requests_are_rejected_without_changing_the_engine(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=4))
    engine.add_request("ok", [1, 2, 3])
    with pytest.raises(InvalidTokenError, match="position 1"):
        engine.add_request("bad", [1, 512, 3])
    with pytest.raises(DuplicateRequestError, match="already"):
        engine.add_request("ok", [1])
    with pytest.raises(ConfigError, match="at most 64"):
        engine.add_request("long", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.add_request("empty", [])
    with pytest.raises(UnknownRequestError, match="not running"):
        engine.preempt("ok")
    assert [r.request_id for r in engine.waiting] == ["ok"]
    assert set(engine.requests) == {"ok"}


def _engine_state(engine: Engine) -> tuple[object, ...]:
    return (
        sorted(engine.requests),
        [r.request_id for r in engine.waiting],
        [r.request_id for r in engine.running],
        engine.kv_manager.pool.usage,
        engine.metrics(),
    )


def test_request_ids_misused_raise_their_errors_and_change_nothing(model) -> None:
    """Probe 62: a duplicate id was a ConfigError (DuplicateRequestError is the library's
    error for an id in use), an unknown id for abort/preempt a ConfigError, and an id that
    cannot be hashed a bare TypeError from the dict lookup."""
    engine = Engine(model, EngineConfig(num_blocks=8))
    engine.add_request("waiting", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.step()  # "waiting" runs now
    engine.add_request("queued", [4, 5], SamplingParams(max_tokens=2))
    before = _engine_state(engine)
    for request_id in ("waiting", "queued"):
        with pytest.raises(DuplicateRequestError, match="already in the engine") as caught:
            engine.add_request(request_id, [7])
        assert isinstance(caught.value, ValueError)  # as ConfigError was: except keeps working
    cases: list[tuple[type[LlmschedError], str, object]] = [
        (UnknownRequestError, "unknown request id 'gone'", lambda: engine.abort_request("gone")),
        (UnknownRequestError, "'queued' is not running", lambda: engine.preempt("queued")),
        (UnknownRequestError, "'gone' is not running", lambda: engine.preempt("gone")),
        (InvalidTypeError, "got list", lambda: engine.abort_request(["x"])),  # type: ignore[arg-type]
        (InvalidTypeError, "got list", lambda: engine.preempt(["x"])),  # type: ignore[arg-type]
        (InvalidTypeError, "got int", lambda: engine.abort_request(5)),  # type: ignore[arg-type]
        (InvalidTypeError, "got bool", lambda: engine.add_request(True, [1])),  # type: ignore[arg-type]
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()  # type: ignore[operator]
        assert _engine_state(engine) == before
    # A finished request's id may be used again.
    while engine.has_unfinished():
        engine.step()
    engine.add_request("waiting", [1, 2, 3], SamplingParams(max_tokens=1))
    assert set(engine.requests) == {"waiting"}
    engine.abort_request("waiting")
    with pytest.raises(UnknownRequestError):
        engine.abort_request("waiting")


def test_wrong_types_and_huge_values_are_llmsched_errors(model) -> None:
    """Probe 62: each of these was a bare TypeError, AttributeError, OverflowError or
    ValueError (an int of thousands of digits has no str for the message)."""
    engine = Engine(model, EngineConfig(num_blocks=8))
    engine.add_request("r", [1, 2])
    before = _engine_state(engine)
    huge = 10**5000
    cases: list[tuple[type[Exception], str, object]] = [
        (InvalidTypeError, "collection of prompts, got NoneType", lambda: engine.generate(None)),
        (InvalidTypeError, "got generator", lambda: engine.generate(p for p in [[1]])),
        (InvalidTypeError, "got str", lambda: engine.generate("123")),
        (InvalidTypeError, "params must be", lambda: engine.generate([[1]], 5)),
        (InvalidTokenError, "an int of 16610 bits", lambda: engine.add_request("h", [huge])),
        (
            ConfigError,
            "may reach an int of 16610 bits",
            lambda: engine.add_request("h", [1], SamplingParams(max_tokens=huge)),
        ),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()  # type: ignore[operator]
        assert _engine_state(engine) == before
    with pytest.raises(InvalidTypeError, match="config must be an EngineConfig"):
        Engine(model, {"num_blocks": 4})  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="model must be a MoETransformer"):
        Engine(None)  # type: ignore[arg-type]
    assert engine.generate([[3, 4]], SamplingParams(max_tokens=1)) != []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": ("eos",)}, r"stop_token_ids\[0\]"),
        # Probe 62: a bare OverflowError, a bare TypeError, and bare ValueErrors (no str for
        # an int of thousands of digits).
        ({"temperature": 10**400}, "an int of 1329 bits"),
        ({"stop_token_ids": None}, "stop_token_ids must be an iterable"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be an iterable"),
        ({"seed": 10**5000}, "an int of 16610 bits"),
        ({"temperature": 10**5000}, "an int of 16610 bits"),
        ({"max_tokens": -(10**5000)}, "an int of 16610 bits"),
        ({"stop_token_ids": (1.5,)}, r"stop_token_ids\[0\] must be an int, got 1.5"),
    ],
)
def test_bad_sampling_params_are_refused_when_built(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**overrides)


def test_generate_leaves_the_callers_own_requests_alone(model) -> None:
    """Probe 62: generate named its requests ``generate-N-i`` whatever the engine held, so a
    caller's request of that name made it raise DuplicateRequestError, and its clean-up
    aborted the caller's request."""
    engine = Engine(model, EngineConfig(num_blocks=16))
    expected = Engine(model, EngineConfig(num_blocks=16)).generate(
        [[4, 5, 6]], SamplingParams(max_tokens=2)
    )
    engine.add_request("generate-1-0", [1, 2, 3], SamplingParams(max_tokens=8))
    assert engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2)) == expected
    assert "generate-1-0" in engine.requests
    # A failed generate aborts only what it added.
    with pytest.raises(InvalidTokenError):
        engine.generate([[1, 2], [1, 512]], SamplingParams(max_tokens=2))
    assert set(engine.requests) == {"generate-1-0"}


def test_stop_token_ids_are_kept_as_a_tuple() -> None:
    # A list made the frozen params unhashable.
    params = SamplingParams(stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4) and hash(params) == hash(
        SamplingParams(stop_token_ids=(3, 4))
    )


def test_a_tiny_temperature_samples_greedily(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=8))
    greedy = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    # logits / 1e-300 overflowed to inf and softmax gave NaN probabilities.
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=1e-300)) == greedy


def test_a_failed_generate_leaves_the_engine_usable(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=8))
    expected = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidTokenError):
        engine.generate([[1, 2, 3], [1, 512]], SamplingParams(max_tokens=2))
    assert not engine.requests and not engine.has_unfinished()
    with pytest.raises(ConfigError, match="2 sampling params for 1 prompts"):
        engine.generate([[1, 2, 3]], [SamplingParams(), SamplingParams()])
    assert not engine.requests

    def interrupt(_: Engine) -> None:
        raise KeyboardInterrupt

    engine.step_hooks.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[4, 5, 6]], SamplingParams(max_tokens=4))
    engine.step_hooks.clear()
    assert not engine.requests and not engine.has_unfinished()
    assert engine.kv_manager.pool.num_free == 8
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2)) == expected


def test_a_kv_cache_past_memory_is_refused_before_allocating(model) -> None:
    with pytest.raises(
        ConfigError, match=r"Engine would allocate .*the largest part is num_blocks"
    ):
        Engine(model, EngineConfig(num_blocks=2**40))


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "refused"),
    [(20, 2, True), (8, 4, True), (8, 1, False), (5, 4, False)],
)
def test_requests_a_whole_prompt_step_can_never_hold_are_refused(
    model, prompt_len, max_tokens, refused
) -> None:
    """With chunked prefill off, a prompt (or, after a preemption, prompt plus output) past
    the token budget was never scheduled: ``generate`` looped forever (probe 60)."""
    config = EngineConfig(num_blocks=16, max_num_batched_tokens=8, enable_chunked_prefill=False)
    engine = Engine(model, config)
    prompt = list(range(prompt_len))
    params = SamplingParams(max_tokens=max_tokens)
    if refused:
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            engine.add_request("r", prompt, params)
        assert not engine.requests and not engine.has_unfinished()
        return
    engine.add_request("r", prompt, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        if "r" in engine.requests and engine.requests["r"].output_token_ids:
            engine.preempt("r")  # the recompute is prompt plus output: it must still fit
        steps += 1
        assert steps < 50, "the request is never scheduled"


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([1.7, 2], InvalidTypeError),
        ([True, 2], InvalidTypeError),
        (["5", 2], InvalidTypeError),
        ("123", InvalidTypeError),
        ("abc", InvalidTypeError),
        ([[1, 2]], InvalidValueError),
        ([1, -1], InvalidTokenError),
        ([1, 2**40], InvalidTokenError),
    ],
)
def test_prompts_that_are_not_token_ids_are_refused(model, prompt, error) -> None:
    """A float was truncated (1.7 ran as 1), ``"123"`` ran as [1, 2, 3], ``"abc"`` was a bare
    ValueError (probe 60)."""
    engine = Engine(model, EngineConfig(num_blocks=8))
    with pytest.raises(error):
        engine.add_request("r", prompt)
    assert not engine.requests and not engine.has_unfinished()
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))


def test_request_ids_and_params_of_the_wrong_type_are_refused(model) -> None:
    engine = Engine(model, EngineConfig(num_blocks=8))
    with pytest.raises(InvalidTypeError, match="request_id"):
        engine.add_request(5, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="SamplingParams"):
        engine.add_request("r", [1, 2], 5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="SamplingParams"):
        engine.generate([[1, 2]], [5])  # type: ignore[list-item]
    assert not engine.requests and not engine.has_unfinished()
    import numpy as np

    engine.add_request("np", np.array([1, 2, 3], dtype=np.int32))
    assert engine.requests["np"].token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hash_seed": 1.5}, "hash_seed"),  # a TypeError mid-generate
        ({"hash_seed": True}, "hash_seed"),  # an error from the hashing mid-step
        ({"hash_seed": "3"}, "hash_seed"),  # a bare TypeError
        ({"dp_rank": -1}, "dp_rank"),  # published in every event batch
        ({"dp_rank": "x"}, "dp_rank"),
        ({"dp_rank": 2**70}, "dp_rank"),  # an OverflowError after the forward pass
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),  # truthy: caching on
        ({"enable_chunked_prefill": None}, "enable_chunked_prefill"),
    ],
)
def test_engine_config_fields_are_checked_when_built(overrides, message) -> None:
    """Probe 60: these were accepted and failed, or silently misbehaved, while serving."""
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**overrides)
