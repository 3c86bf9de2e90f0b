"""The step-model fit on synthetic data with known coefficients, and ``llmsched calibrate
--engine`` end to end against a fake streaming engine (the real vLLM run is in tests/engines)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np
import pytest

from llmsched import calibrate as calibrate_module
from llmsched import cli
from llmsched.calibrate import (
    PACER_PROMPT,
    PACER_TOKENS,
    EngineGrid,
    GridPoint,
    StreamTiming,
    calibrate_engine,
    engine_info,
)
from llmsched.errors import ConfigError
from llmsched.executor.step_time import TERMS, StepSample, StepTimeProfile
from llmsched.sim.stepmodel import load_step_model

TRUE = {
    "b0": 4e-3,
    "prefill_tokens": 2.5e-5,
    "decode_tokens": 3e-4,
    "prefill_tokens_sq": 4e-9,
    "decode_context_tokens": 2e-7,
    "prefill_requests": 1.5e-3,
    "after_idle": 8e-3,
}


def synthetic(noise: float = 0.0, truth: dict[str, float] = TRUE, seed: int = 0) -> list:
    """The calibrate grid's shapes (a prompt alone on an idle engine; one and k prompts of
    n // k tokens beside a decoding request; decode batches), timed by ``truth``."""
    rng = random.Random(seed)
    lengths = (32, 128, 512, 1024)
    shapes = [(n, 0, n * n, 0, 1, True) for n in lengths]
    shapes += [
        (k * (n // k), 1, k * (n // k) ** 2, 17, k, False) for k in (1, 2, 4) for n in lengths
    ]
    shapes += [(0, b, 0, b * (n + 12), 0, False) for b in (1, 2, 4, 8) for n in (32, 256, 1024)]
    samples = []
    for p, d, sq, ctx, k, idle in shapes:
        features = [1.0, p, d, sq, ctx, k, idle]
        t = sum(truth[name] * f for name, f in zip(TERMS, features, strict=True))
        t *= 1 + rng.uniform(-noise, noise)
        samples.append(StepSample(p, d, sq, ctx, t, prefill_requests=k, after_idle=idle))
    return samples


def test_fit_recovers_known_coefficients_exactly() -> None:
    profile = StepTimeProfile.fit(synthetic())
    for name, want in TRUE.items():
        assert profile.coefficients[name] == pytest.approx(want, rel=1e-6), name
    assert profile.error.max < 1e-9
    # The three-term model cannot express the attention terms: it fits worse.
    assert profile.linear_error.max > 0.05


def test_fit_recovers_the_cost_per_prefilled_sequence() -> None:
    """Several prompts prefilled in one step beside one prompt of the same total length: the
    fit takes the per-sequence cost apart from the per-token and per-step ones."""
    profile = StepTimeProfile.fit(synthetic())
    assert profile.coefficients["prefill_requests"] == pytest.approx(1.5e-3, rel=1e-6)
    # Four 256-token prompts in one step cost three sequences more than one 1024-token prompt
    # would, less the attention they do not share.
    four = profile.predict(1024, 0, 4 * 256**2, prefill_requests=4)
    one = profile.predict(1024, 0)
    assert four - one == pytest.approx(3 * 1.5e-3 - 4e-9 * (1024**2 - 4 * 256**2), rel=1e-6)
    # A step on an idle engine pays the wake-up once, whatever it holds.
    assert profile.coefficients["after_idle"] == pytest.approx(8e-3, rel=1e-6)
    assert profile.predict(64, 0, after_idle=True) - profile.predict(64, 0) == pytest.approx(8e-3)
    # Without the two terms the same grid fits worse (the five-term model, fitted the same way).
    x = np.array([s.features()[:5] for s in synthetic()])
    y = np.array([s.seconds for s in synthetic()])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    assert np.max(np.abs(x @ coef - y) / y) > 0.05


def test_fit_with_noise_stays_close_and_reports_the_noise() -> None:
    profile = StepTimeProfile.fit(synthetic(noise=0.03, seed=7))
    # The big terms come back within 10%; the error reported is the noise put in.
    for name in ("b0", "prefill_tokens", "decode_tokens"):
        assert profile.coefficients[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert 0.003 < profile.error.median < 0.03
    assert profile.error.max < 0.05


def test_fit_never_returns_a_negative_coefficient() -> None:
    # Decode steps that get *cheaper* with context: least squares alone says b4 < 0.
    truth = dict(TRUE, decode_context_tokens=-1e-7)
    samples = synthetic(truth=truth)
    x = np.array([s.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    unconstrained, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    assert unconstrained[4] < 0  # the case the constraint is for
    profile = StepTimeProfile.fit(samples)
    assert min(profile.coefficients.values()) >= 0
    assert profile.coefficients["decode_context_tokens"] == 0
    # ... so the simulator takes it (it refuses negative costs).
    doc = profile.to_dict()
    assert load_step_model(doc).b4 == 0


def test_profile_round_trips_with_kv_tokens(tmp_path) -> None:
    profile = StepTimeProfile.fit(synthetic(), {"model": "tiny"})
    profile.kv_tokens = 2048
    path = tmp_path / "p.yaml"
    profile.save(path)
    again = StepTimeProfile.load(path)
    assert again.kv_tokens == 2048 and again.coefficients == profile.coefficients
    model = load_step_model(path)
    assert model.kv_capacity_tokens() == 2048
    assert model.b1 == pytest.approx(TRUE["prefill_tokens"], rel=1e-6)


def test_grid_skips_points_the_cache_cannot_hold() -> None:
    grid = EngineGrid(prompt_lens=(32, 1024), batch_sizes=(1, 4), context_lens=(32, 512))
    points = grid.points(kv_tokens=2048, max_model_len=2000)
    assert GridPoint("prefill", 1, 1024, 1) in points
    assert GridPoint("decode", 4, 32, 32) in points
    # 4 x (512 + 32) tokens would not fit 2048: preemption would distort the step.
    assert GridPoint("decode", 4, 512, 32) not in points
    # Each prompt length also beside a decoding request, as one prompt and as 2 and 4 prompts
    # of a half and a quarter of it (the pacer's KV counted).
    assert GridPoint("prefill", 1, 1024, 1, paced=True) in points
    assert GridPoint("prefill", 4, 256, 1, paced=True) in points
    assert len(grid.points(kv_tokens=None, max_model_len=None)) == 2 + 6 + 4
    assert GridPoint("prefill", 1, 1024, 1, paced=True) not in grid.points(1100, None)
    assert len(EngineGrid(prefill_batches=()).points(None, None)) == 4 + 9
    with pytest.raises(ConfigError, match="decode_tokens"):
        EngineGrid(decode_tokens=2)
    with pytest.raises(ConfigError, match="prefill batches must be >= 2"):
        EngineGrid(prefill_batches=(1,))
    with pytest.raises(ConfigError, match=">= 1"):
        EngineGrid(batch_sizes=(0,))


def test_stream_timing_figures() -> None:
    t = StreamTiming(10.0, (10.5, 10.6, 10.8), 7)
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot() == pytest.approx(0.15)
    assert t.finish == 10.8


def fake_openai_engine(law: dict[str, float] | None = None, split: int = 0):
    """A streaming engine on loopback with vLLM's /v1/models, /tokenize and metrics. With
    ``law`` (linear-model coefficients) it also exports vLLM's per-request prefill and decode
    time counters and its step counts as if each step took what the law says: a request's
    prompts (one, or a list) are prefilled in one step, each one's prefill time that step's,
    beside the decodes of the streams then running (with none, the step starts on an idle
    engine and pays ``b6``); streams that run together decode as one batch.
    ``split``: that many requests of several prompts are instead prefilled one prompt per
    step."""
    from aiohttp import web

    from llmsched.testing import FakeHTTPEngine

    served: dict[str, list] = {"prompts": []}
    cache_info = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="64"} 1.0\n'
    totals = {"prefill_s": 0.0, "decode_s": 0.0, "requests": 0, "tokens": 0, "steps": 0}
    totals["one_token_steps"] = 0
    holder: list[FakeHTTPEngine] = []
    splits = [split]
    streaming: dict[int, list[int]] = {}  # running streams: [prompt length, tokens sent]
    batches = [0, 0]  # batched requests served, and the metrics requests served before the last

    async def pacer_held(batches_before: int) -> None:
        """The pacer's stream waits after its first token until the batch sent beside it has
        been answered and the scrape after it has come: a request sent meanwhile finds it at
        one token (as the client counts it: its KV length is then exact), and its end cannot
        come before the client saw the batch's reply, however late the client runs (a machine
        under load). Bounded, so a client that never sends them fails, not hangs."""
        deadline = asyncio.get_running_loop().time() + 60.0
        while batches[0] == batches_before or holder[0].metrics_requests == batches[1]:
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(1e-3)

    def publish() -> None:
        holder[0].metrics_text = cache_info + (
            f"vllm:request_prefill_time_seconds_sum {totals['prefill_s']!r}\n"
            f"vllm:request_prefill_time_seconds_count {totals['requests']}\n"
            f"vllm:request_decode_time_seconds_sum {totals['decode_s']!r}\n"
            f"vllm:request_generation_tokens_sum {totals['tokens']}\n"
            f"vllm:request_generation_tokens_count {totals['requests']}\n"
            f'vllm:iteration_tokens_total_count{{engine="0"}} {totals["steps"]}\n'
            f'vllm:iteration_tokens_total_bucket{{engine="0",le="1.0"}} '
            f"{totals['one_token_steps']}\n"
        )

    def run(lengths: list[int], m: int, beside: list[list[int]], batch: int = 1) -> None:
        """Prefill ``lengths`` (in one step unless split) beside the decodes of ``beside``
        (running streams), then decode ``m - 1`` tokens each in a batch of ``batch`` alike."""
        assert law is not None
        steps = [lengths]
        if len(lengths) > 1 and splits[0] > 0:
            splits[0] -= 1
            steps = [[n] for n in lengths]
        decode = law["b2"] * len(beside) + law["b4"] * sum(n + done for n, done in beside)
        # A step with nothing else running starts on an idle engine.
        decode += 0.0 if beside else law.get("b6", 0.0)
        for step in steps:
            p, sq = sum(step), sum(n * n for n in step)
            t = law["b0"] + law["b1"] * p + law["b3"] * sq + law.get("b5", 0.0) * len(step)
            totals["prefill_s"] += (t + decode) * len(step)
            totals["steps"] += 1
        for n in lengths:
            # Decode step j (1..m-1) reads n + j tokens of KV: the mean is n + m/2.
            step_s = law["b0"] + law["b2"] * batch + law["b4"] * batch * (n + m / 2)
            totals["decode_s"] += (m - 1) * step_s
            totals["steps"] += m - 1
            totals["one_token_steps"] += m - 1
            totals["requests"] += 1
            totals["tokens"] += m
        publish()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 2000}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": [10 + (ord(c) % 50) for c in body["prompt"]]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        m = body["max_tokens"]
        if not body.get("stream"):
            prompts = body["prompt"]
            served["prompts"].extend(prompts)
            await asyncio.sleep(1e-3)
            if law is not None:
                run([len(p) for p in prompts], m, list(streaming.values()))
            batches[0] += 1
            batches[1] = holder[0].metrics_requests
            choices = [{"index": i, "text": "x" * m} for i in range(len(prompts))]
            return web.json_response({"choices": choices})
        served["prompts"].append(body["prompt"])
        pacer = m == PACER_TOKENS and len(body["prompt"]) == PACER_PROMPT
        batches_before = batches[0]
        reply = web.StreamResponse()
        await reply.prepare(request)
        n = len(body["prompt"])
        state = streaming[id(reply)] = [n, 0]
        batch = 1  # the most streams that ran beside it: the decode batch it was part of
        for i in range(m):
            batch = max(batch, len(streaming))
            await asyncio.sleep(1e-3)
            usage = {"prompt_tokens": n, "completion_tokens": i + 1}
            chunk = {"choices": [{"text": "x"}], "usage": usage}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
            state[1] = i + 1
            if i == 0 and pacer:
                await pacer_held(batches_before)
            elif i == 0 and law is not None:
                # Held after its first token: streams sent together decode together.
                await asyncio.sleep(0.2)
        await reply.write(b"data: [DONE]\n\n")
        del streaming[id(reply)]
        if law is not None:
            run([n], m, [], batch)
        return reply

    def setup(app: web.Application) -> None:
        app.router.add_get("/v1/models", models)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/v1/completions", completions)

    engine = FakeHTTPEngine(metrics_text=cache_info, setup=setup)
    holder.append(engine)
    if law is not None:
        publish()
    return engine, served


def test_engine_info_reads_kv_capacity_and_vocabulary() -> None:
    engine, _ = fake_openai_engine()
    with engine:
        info = engine_info(engine.url)
        assert (info.model, info.max_model_len, info.block_size, info.kv_tokens) == (
            "tiny",
            2000,
            32,
            2048,
        )
        assert len(info.vocabulary) >= 16
        with pytest.raises(ConfigError, match="does not serve 'big'"):
            engine_info(engine.url, "big")


@pytest.mark.parametrize("late_client", [False, True])
def test_calibrate_command_against_a_streaming_engine(
    tmp_path, capsys, monkeypatch, late_client
) -> None:
    """``late_client``: each batched prefill is sent 0.3 s after the pacer's first token, as a
    client thread on a loaded machine may be (the fake's pacer then ended first: the points
    were taken again and the samples and prompts were not those below)."""
    if late_client:
        timed_batch = calibrate_module.timed_batch

        def late(*args, **kwargs):
            time.sleep(0.3)
            return timed_batch(*args, **kwargs)

        monkeypatch.setattr(calibrate_module, "timed_batch", late)
    engine, served = fake_openai_engine()
    out = tmp_path / "fitted.yaml"
    with engine:
        argv = ["calibrate", "--engine", engine.url, "--out", str(out)]
        argv += ["--prompt-lens", "16,64,256", "--batch-sizes", "1,2", "--context-lens", "16,128"]
        argv += ["--decode-tokens", "6", "--repeats", "1"]
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "fit error (relative)" in printed and "2048 KV tokens" in printed
    profile = StepTimeProfile.load(out)
    shapes = [
        (s.prefill_tokens, s.prefill_requests, s.decode_tokens, s.decode_context_tokens)
        for s in profile.samples
    ]
    # Alone on an idle engine; then the same totals as 1, 2 and 4 prompts prefilled together
    # beside the pacer's decode (its 16-token prompt and the tokens it had when they were sent).
    pacer = [ctx for p, k, d, ctx in shapes if d == 1 and p]
    assert all(16 < ctx < 16 + 128 for ctx in pacer)
    paced = [(p, k) for k in (1, 2, 4) for p in (16, 64, 256)]
    assert shapes == [
        (16, 1, 0, 0),
        (64, 1, 0, 0),
        (256, 1, 0, 0),
        *[(p, k, 1, ctx) for (p, k), ctx in zip(paced, pacer, strict=True)],
        (0, 0, 1, 16 + 3),
        (0, 0, 1, 128 + 3),
        (0, 0, 2, 2 * (16 + 3)),
        (0, 0, 2, 2 * (128 + 3)),
    ]
    assert [s.after_idle for s in profile.samples] == [True] * 3 + [False] * 13
    assert profile.kv_tokens == 2048 and profile.meta["engine"] == engine.url
    # Fresh prompts of the asked lengths (plus the warm-up's 8 tokens): no prefix reuse.
    lengths = sorted(len(p) for p in served["prompts"])
    paced = [16, 64, 256] + [8, 32, 128] * 2 + [4, 16, 64] * 4 + [16] * 9  # and the pacers
    assert lengths == sorted([8, 16, 64, 256, 16, 128, 16, 16, 128, 128, *paced])
    assert len({tuple(p) for p in served["prompts"]}) == len(served["prompts"])
    # The simulator takes the file.
    scenario = tmp_path / "small.yaml"
    scenario.write_text(
        "base: shared-prefix\nreplicas: 2\npolicies: [round-robin]\nworkload: {num_requests: 20}\n"
    )
    argv = ["sim", "--step-model", str(out), "--config", str(scenario), "--quiet"]
    assert cli.main(argv) == 0
    assert "round-robin" in capsys.readouterr().out


def test_calibrate_refuses_an_unreachable_engine(tmp_path) -> None:
    with pytest.raises(ConfigError, match="did not answer"):
        calibrate_engine("http://127.0.0.1:9", EngineGrid())
    with pytest.raises(ConfigError, match="expected http://host:port"):
        calibrate_engine("ftp://x", EngineGrid())


def test_calibrate_recovers_an_engine_whose_metrics_follow_a_known_law(tmp_path) -> None:
    """The engine's own clock is what is fitted: an engine whose metrics say each step took
    what a known linear model gives, with a fixed cost per prefilled sequence and one for a
    step on an idle engine, yields that model back. The first batched prefill reaches the
    engine split over steps: it is taken again."""
    law = {"b0": 2e-3, "b1": 3e-5, "b2": 4e-4, "b3": 2e-9, "b4": 5e-7, "b5": 1.2e-3, "b6": 9e-3}
    engine, _ = fake_openai_engine(law, split=1)
    with engine:
        grid = EngineGrid(
            prompt_lens=(16, 64, 256), batch_sizes=(1, 2), context_lens=(16, 128), decode_tokens=8
        )
        profile = calibrate_engine(engine.url, grid)
    assert profile.meta["timing"] == "engine metrics"
    assert profile.meta["split_retries"] == 1 and profile.meta["split_points"] == []
    names = dict(zip(("b0", "b1", "b2", "b3", "b4", "b5", "b6"), TERMS, strict=True))
    for short, want in law.items():
        assert profile.coefficients[names[short]] == pytest.approx(want, rel=1e-6), short
    assert profile.error.max < 1e-9
    # The client's view (a fake that streams in milliseconds) is kept beside, and differs.
    assert profile.meta["client_coefficients"] != profile.coefficients


def test_calibrate_leaves_out_a_batched_prefill_that_never_lands_in_one_step() -> None:
    law = {"b0": 2e-3, "b1": 3e-5, "b2": 4e-4, "b3": 2e-9, "b4": 5e-7, "b5": 1.2e-3, "b6": 9e-3}
    engine, _ = fake_openai_engine(law, split=10**6)
    with engine:
        grid = EngineGrid(
            prompt_lens=(16, 64, 256),
            batch_sizes=(1, 2),
            context_lens=(16, 128, 512),
            decode_tokens=8,
            prefill_batches=(2,),
            repeats=1,
        )
        profile = calibrate_engine(engine.url, grid)
    # Each of the three batched points tried twice, split each time: left out, not fitted.
    assert profile.meta["split_retries"] == 6
    assert profile.meta["split_points"] == [{"batch": 2, "prompt_len": n} for n in (8, 32, 128)]
    # Left: the prompts alone, idle and paced.
    assert [s.prefill_requests for s in profile.samples if s.prefill_tokens] == [1] * 6


def test_profile_from_before_the_per_sequence_term_loads(tmp_path) -> None:
    doc = StepTimeProfile.fit(synthetic()).to_dict()
    del doc["coefficients"]["prefill_requests"], doc["coefficients"]["after_idle"]
    for sample in doc["samples"]:
        del sample["prefill_requests"], sample["after_idle"]
    path = tmp_path / "old.yaml"
    path.write_text(json.dumps(doc))
    old = StepTimeProfile.load(path)
    assert old.coefficients["prefill_requests"] == old.coefficients["after_idle"] == 0.0
    # Without the field a sample with prefill tokens reads as one sequence.
    assert {s.prefill_requests for s in old.samples} == {0, 1}
    assert not any(s.after_idle for s in old.samples)
    assert (load_step_model(path).b5, load_step_model(path).b6) == (0.0, 0.0)
    with pytest.raises(ConfigError, match="cannot prefill"):
        StepSample(16, 0, 256, 0, 1e-3, prefill_requests=0)


def test_sim_refuses_a_bad_step_model_file_before_simulating(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("coefficients: {b0: 0.001, b1: -1.0, b2: 0.001}\n")
    assert cli.main(["sim", "--step-model", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "b1" in err and "llmsched sim" in err
