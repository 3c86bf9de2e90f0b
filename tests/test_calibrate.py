"""The step-model fit on synthetic data with known coefficients, and ``llmsched calibrate
--engine`` end to end against a fake streaming engine (the real vLLM run is in tests/engines)."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from llmsched import cli
from llmsched.calibrate import EngineGrid, GridPoint, StreamTiming, calibrate_engine, engine_info
from llmsched.errors import ConfigError
from llmsched.executor.step_time import TERMS, StepSample, StepTimeProfile
from llmsched.sim.stepmodel import load_step_model

TRUE = {
    "b0": 4e-3,
    "prefill_tokens": 2.5e-5,
    "decode_tokens": 3e-4,
    "prefill_tokens_sq": 4e-9,
    "decode_context_tokens": 2e-7,
}


def synthetic(noise: float = 0.0, truth: dict[str, float] = TRUE, seed: int = 0) -> list:
    """The calibrate grid's shapes (prefill alone, decode batches), timed by ``truth``."""
    rng = random.Random(seed)
    samples = []
    shapes = [(n, 0, n * n, 0) for n in (32, 128, 512, 1024, 2048)]
    shapes += [(0, b, 0, b * (n + 12)) for b in (1, 2, 4, 8) for n in (32, 256, 1024)]
    for p, d, sq, ctx in shapes:
        features = [1.0, p, d, sq, ctx]
        t = sum(truth[name] * f for name, f in zip(TERMS, features, strict=True))
        samples.append(StepSample(p, d, sq, ctx, t * (1 + rng.uniform(-noise, noise))))
    return samples


def test_fit_recovers_known_coefficients_exactly() -> None:
    profile = StepTimeProfile.fit(synthetic())
    for name, want in TRUE.items():
        assert profile.coefficients[name] == pytest.approx(want, rel=1e-6), name
    assert profile.error.max < 1e-9
    # The three-term model cannot express the attention terms: it fits worse.
    assert profile.linear_error.max > 0.05


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
    assert len(grid.points(kv_tokens=None, max_model_len=None)) == 6
    with pytest.raises(ConfigError, match="decode_tokens"):
        EngineGrid(decode_tokens=2)
    with pytest.raises(ConfigError, match=">= 1"):
        EngineGrid(batch_sizes=(0,))


def test_stream_timing_figures() -> None:
    t = StreamTiming(10.0, (10.5, 10.6, 10.8), 7)
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot() == pytest.approx(0.15)
    assert t.finish == 10.8


def fake_openai_engine(law: dict[str, float] | None = None):
    """A streaming engine on loopback with vLLM's /v1/models, /tokenize and metrics. With
    ``law`` (linear-model coefficients) it also exports vLLM's per-request prefill and decode
    time counters as if each step took what the law says (one request at a time)."""
    from aiohttp import web

    from llmsched.testing import FakeHTTPEngine

    served: dict[str, list] = {"prompts": []}
    cache_info = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="64"} 1.0\n'
    totals = {"prefill_s": 0.0, "decode_s": 0.0, "requests": 0, "tokens": 0}
    holder: list[FakeHTTPEngine] = []

    def publish() -> None:
        holder[0].metrics_text = cache_info + (
            f"vllm:request_prefill_time_seconds_sum {totals['prefill_s']!r}\n"
            f"vllm:request_prefill_time_seconds_count {totals['requests']}\n"
            f"vllm:request_decode_time_seconds_sum {totals['decode_s']!r}\n"
            f"vllm:request_generation_tokens_sum {totals['tokens']}\n"
            f"vllm:request_generation_tokens_count {totals['requests']}\n"
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 2000}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": [10 + (ord(c) % 50) for c in body["prompt"]]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        served["prompts"].append(body["prompt"])
        reply = web.StreamResponse()
        await reply.prepare(request)
        n, m = len(body["prompt"]), body["max_tokens"]
        for i in range(m):
            await asyncio.sleep(1e-3)
            usage = {"prompt_tokens": n, "completion_tokens": i + 1}
            chunk = {"choices": [{"text": "x"}], "usage": usage}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        if law is not None:
            totals["prefill_s"] += law["b0"] + law["b1"] * n + law["b3"] * n * n
            # Decode step j (1..m-1) reads n + j tokens of KV: the mean is n + m/2.
            step = law["b0"] + law["b2"] + law["b4"] * (n + m / 2)
            totals["decode_s"] += (m - 1) * step
            totals["requests"] += 1
            totals["tokens"] += m
            publish()
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


def test_calibrate_command_against_a_streaming_engine(tmp_path, capsys) -> None:
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
    shapes = [(s.prefill_tokens, s.decode_tokens, s.decode_context_tokens) for s in profile.samples]
    assert shapes == [
        (16, 0, 0),
        (64, 0, 0),
        (256, 0, 0),
        (0, 1, 16 + 3),
        (0, 1, 128 + 3),
        (0, 2, 2 * (16 + 3)),
        (0, 2, 2 * (128 + 3)),
    ]
    assert profile.kv_tokens == 2048 and profile.meta["engine"] == engine.url
    # Fresh prompts of the asked lengths (plus the warm-up's 8 tokens): no prefix reuse.
    lengths = sorted(len(p) for p in served["prompts"])
    assert lengths == sorted([8, 16, 64, 256, 16, 128, 16, 16, 128, 128])
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
    what a known linear model gives yields that model back (batch 1: the fake does not slow
    down with concurrency)."""
    law = {"b0": 2e-3, "b1": 3e-5, "b2": 4e-4, "b3": 2e-9, "b4": 5e-7}
    engine, _ = fake_openai_engine(law)
    with engine:
        grid = EngineGrid(
            prompt_lens=(16, 64, 256), batch_sizes=(1,), context_lens=(16, 128), decode_tokens=8
        )
        profile = calibrate_engine(engine.url, grid)
    assert profile.meta["timing"] == "engine metrics"
    names = dict(zip(("b0", "b1", "b2", "b3", "b4"), TERMS, strict=True))
    for short, want in law.items():
        assert profile.coefficients[names[short]] == pytest.approx(want, rel=1e-6), short
    assert profile.error.max < 1e-9
    # The client's view (a fake that streams in milliseconds) is kept beside, and differs.
    assert profile.meta["client_coefficients"] != profile.coefficients


def test_sim_refuses_a_bad_step_model_file_before_simulating(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("coefficients: {b0: 0.001, b1: -1.0, b2: 0.001}\n")
    assert cli.main(["sim", "--step-model", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "b1" in err and "llmsched sim" in err
