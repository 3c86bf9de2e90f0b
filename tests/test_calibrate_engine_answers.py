"""``llmsched calibrate --engine`` against engines that answer what no engine should (not JSON, a
list where an object belongs, token ids that are text, a max_model_len that is not a length):
one line naming the engine and the answer, exit status 2, never a traceback; and the KV
capacity read from ``vllm:cache_config_info`` as vLLM writes it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import pytest
from aiohttp import web

from llmsched import cli
from llmsched.calibrate import engine_info, timed_batch, timed_completion
from llmsched.errors import ConfigError
from llmsched.testing import FakeHTTPEngine

Answer = Callable[[], web.StreamResponse]

# vLLM exports every CacheConfig field as a label: the override is "None" when not given.
CACHE = (
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="512",'
    'num_gpu_blocks_override="None",engine="0"} 1.0\n'
)


def engine(
    models: Answer | None = None,
    tokenize: Answer | None = None,
    chunk: Callable[[int], str] | None = None,
    batch: Answer | None = None,
    metrics: str = CACHE,
    split_batches: bool = False,
) -> FakeHTTPEngine:
    """An OpenAI-compatible engine on loopback; each given answer replaces a well-formed one.
    ``split_batches``: its metrics count two steps with prefill for each request of several
    prompts (vLLM's ``vllm:iteration_tokens_total``): it never takes them in one step."""
    holder: list[FakeHTTPEngine] = []
    steps = [0]

    def count_steps() -> None:
        holder[0].metrics_text = metrics + (
            f'vllm:iteration_tokens_total_count{{engine="0"}} {steps[0]}\n'
        )

    async def v1_models(_: web.Request) -> web.StreamResponse:
        if models is not None:
            return models()
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 2000}]})

    async def v1_tokenize(request: web.Request) -> web.StreamResponse:
        if tokenize is not None:
            return tokenize()
        body = await request.json()
        return web.json_response({"tokens": [10 + ord(c) % 50 for c in body["prompt"]]})

    async def v1_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            if batch is not None:
                return batch()
            if split_batches:
                steps[0] += 2
                count_steps()
            return web.json_response(
                {"choices": [{"index": i} for i in range(len(body["prompt"]))]}
            )
        reply = web.StreamResponse()
        await reply.prepare(request)
        for i in range(body["max_tokens"]):
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": i + 1}
            text = chunk(i) if chunk is not None else json.dumps({"usage": usage})
            await reply.write(f"data: {text}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply

    def setup(app: web.Application) -> None:
        app.router.add_get("/v1/models", v1_models)
        app.router.add_post("/tokenize", v1_tokenize)
        app.router.add_post("/v1/completions", v1_completions)

    holder.append(FakeHTTPEngine(metrics_text=metrics, setup=setup))
    if split_batches:
        count_steps()
    return holder[0]


def text(body: str) -> Answer:
    return lambda: web.Response(text=body)


def data(value: object) -> Answer:
    return lambda: web.json_response(value)


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"models": text("<html>sign in</html>")}, r"/v1/models answered b'<html>.*not a JSON"),
        ({"models": data([1, 2])}, r"/v1/models answered b'\[1, 2\]', not a JSON object"),
        ({"models": data({"data": ["tiny"]})}, r"/v1/models data is \['tiny'\], not a list"),
        (
            {"models": data({"data": [{"id": "tiny", "max_model_len": "big"}]})},
            "'tiny' has max_model_len 'big'",
        ),
        ({"tokenize": text("nope")}, r"/tokenize answered b'nope', not a JSON object"),
        ({"tokenize": data([1, 2])}, r"/tokenize answered b'\[1, 2\]', not a JSON object"),
        ({"tokenize": data({"tokens": ["a", "b"]})}, "/tokenize tokens are not token ids"),
        ({"chunk": lambda i: "not json"}, "a streamed completion chunk answered b' not json'"),
        ({"chunk": lambda i: "[1, 2]"}, "a streamed completion chunk answered"),
        (
            {"chunk": lambda i: json.dumps({"usage": {"completion_tokens": "x"}})},
            "usage.completion_tokens must be a count, got 'x'",
        ),
        ({"chunk": lambda i: json.dumps({"usage": [1]})}, r"usage is \[1\]"),
        ({"batch": text("oops")}, "a batched completion answered b'oops', not a JSON object"),
        ({"batch": data({"choices": 3})}, "a batched completion's choices are 3"),
    ],
)
def test_an_engine_answering_garbage_is_named_on_one_line(
    answers: dict[str, object], message: str, tmp_path, capsys
) -> None:
    """These were JSONDecodeError, AttributeError or ValueError tracebacks."""
    with engine(**answers) as fake:  # type: ignore[arg-type]
        argv = ["calibrate", "--engine", fake.url, "--out", str(tmp_path / "p.yaml")]
        argv += ["--prompt-lens", "16", "--batch-sizes", "1,2", "--context-lens", "16"]
        argv += ["--decode-tokens", "4", "--repeats", "1"]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmsched calibrate: engine {fake.url}")
    assert err.count("\n") == 1
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("labels", "kv_tokens"),
    [
        # As vLLM writes it without --num-gpu-blocks-override: the capacity was lost.
        ('block_size="16",num_gpu_blocks="512",num_gpu_blocks_override="None"', 8192),
        # With the override vLLM sets num_gpu_blocks to it.
        ('block_size="16",num_gpu_blocks="64",num_gpu_blocks_override="64"', 1024),
        ('block_size="16",num_gpu_blocks="512"', 8192),
        ('block_size="16",num_gpu_blocks_override="64"', 1024),
        ('block_size="16",num_gpu_blocks="None"', None),
    ],
)
def test_kv_capacity_is_read_as_vllm_exports_it(labels: str, kv_tokens: int | None) -> None:
    with engine(metrics=f"vllm:cache_config_info{{{labels}}} 1.0\n") as fake:
        assert engine_info(fake.url).kv_tokens == kv_tokens


def _calibrate(fake: FakeHTTPEngine, out: str, prompt_lens: str) -> int:
    argv = ["calibrate", "--engine", fake.url, "--out", out, "--prompt-lens", prompt_lens]
    argv += ["--batch-sizes", "1,2", "--context-lens", "16,64", "--decode-tokens", "4"]
    return cli.main([*argv, "--repeats", "1"])


def test_an_engine_without_cache_info_is_said_to_give_no_kv_capacity(tmp_path, capsys) -> None:
    """Its profile fits, and the command says the simulator will need ``engine.kv_tokens``."""
    with engine(metrics="") as fake:
        assert _calibrate(fake, str(tmp_path / "p.yaml"), "16,64,256") == 0
    out = capsys.readouterr().out
    assert "no KV capacity" in out and "engine.kv_tokens" in out


def test_a_grid_left_short_by_split_prefills_says_so(tmp_path, capsys) -> None:
    with engine(split_batches=True) as fake:
        assert _calibrate(fake, str(tmp_path / "p.yaml"), "16,64") == 2
    err = capsys.readouterr().err
    assert "need at least 7 samples to fit, got 6" in err
    assert "6 batched prefill points were left out" in err


def _endless_engine() -> FakeHTTPEngine:
    """Answers every completion without end: a stream of keep-alive comments, an unstreamed
    answer one byte at a time."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        reply = web.StreamResponse()
        await reply.prepare(request)
        while True:
            await reply.write(b": keep-alive\n\n" if body.get("stream") else b" ")
            await asyncio.sleep(0.02)

    def setup(app: web.Application) -> None:
        app.router.add_post("/v1/completions", completions)

    return FakeHTTPEngine(setup=setup)


@pytest.mark.timeout(60)
def test_an_answer_that_never_ends_is_cut_off_at_the_timeout() -> None:
    """Each part came within the socket's timeout, so the stream (and the unstreamed read)
    went on for ever."""
    with _endless_engine() as fake:
        with pytest.raises(ConfigError, match=r"still streaming after 0\.5 s \(0 tokens"):
            timed_completion(fake.url, "tiny", [1, 2, 3], 4, timeout_s=0.5)
        with pytest.raises(ConfigError, match=r"POST /v1/completions still answering after 0\.5"):
            timed_batch(fake.url, "tiny", [[1, 2, 3]], 1, timeout_s=0.5)


@pytest.mark.parametrize(
    "urls",
    [
        "http://127.0.0.1:{port},http://127.0.0.1:{port}/",
        "http://LOCALHOST:{port},http://localhost:{port}",
    ],
)
def test_one_engine_given_twice_is_refused(tmp_path, capsys, urls: str) -> None:
    """It was timed against itself, each point sent to it twice at once: the fit was of its
    steps under twice the load, pooled as if from two engines."""
    with engine() as fake:
        argv = ["calibrate", "--engine", urls.format(port=fake.port)]
        assert cli.main([*argv, "--out", str(tmp_path / "p.yaml")]) == 2
    assert "are the same engine" in capsys.readouterr().err
