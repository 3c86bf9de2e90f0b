"""Step-time models: closed-form decode runs against step-by-step sums, presets, YAML profiles."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from llmsched.errors import ConfigError
from llmsched.sim.stepmodel import (
    GPUS,
    MODELS,
    DecodeRun,
    LinearStepModel,
    ModelSpec,
    RooflineStepModel,
    StepModelConfig,
    build_step_model,
    load_step_model,
)

finite = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(finite, finite, finite, finite, finite, st.integers(0, 300))
def test_decode_run_time_is_the_sum_of_its_steps(a1, g1, a2, g2, c, k) -> None:
    run = DecodeRun(a1, g1, a2, g2, c)
    brute = sum(max(a1 + g1 * j, a2 + g2 * j) + c for j in range(k))
    assert math.isclose(run.time(k), brute, rel_tol=1e-9, abs_tol=1e-9)


@given(finite, finite, st.floats(1e-3, 5.0), st.floats(0.0, 500.0), st.integers(0, 200))
def test_steps_within_inverts_time(a, g, c, seconds, limit) -> None:
    run = DecodeRun(a, g, a / 2, g * 2, c)
    k = run.steps_within(seconds, limit)
    assert 0 <= k <= limit
    assert run.time(k) <= seconds + 1e-12
    if k < limit:
        assert run.time(k + 1) > seconds


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_roofline_decode_run_matches_step_time(model: str, gpu: str) -> None:
    tp = 2 if model != "llama-3.1-8b" else 1
    m = RooflineStepModel(MODELS[model], GPUS[gpu], tp=tp)
    for batch, ctx in [(1, 1000), (32, 32 * 4000), (256, 256 * 900)]:
        run = m.decode_run(batch, ctx)
        steps = [m.step_time(decode_tokens=batch, decode_ctx=ctx + batch * j) for j in range(50)]
        assert math.isclose(run.time(50), sum(steps), rel_tol=1e-9)


def test_linear_decode_run_matches_step_time() -> None:
    m = LinearStepModel(b0=2e-3, b1=3e-5, b2=1e-4, b3=1e-9, b4=2e-8)
    run = m.decode_run(16, 16 * 500)
    steps = [m.step_time(decode_tokens=16, decode_ctx=16 * 500 + 16 * j) for j in range(40)]
    assert math.isclose(run.time(40), sum(steps), rel_tol=1e-12)


def test_roofline_figures_from_the_reference() -> None:
    llama = MODELS["llama-3.1-8b"]
    assert llama.kv_bytes_per_token == 128 * 1024  # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
    m = RooflineStepModel(llama, GPUS["H100"])
    # Prefill is compute bound: ~2 * 7 B body FLOPs per token at 74% of 989 TFLOP/s.
    per_token = m.step_time(prefill_tokens=4096, prefill_sq=4096**2) / 4096
    assert 18e-6 < per_token < 30e-6
    # Decode of one request is bandwidth bound: 15 GB of weights at 67% of 3.35 TB/s.
    assert 6e-3 < m.step_time(decode_tokens=1, decode_ctx=100) < 8e-3
    assert m.step_time() == 0.0
    h200 = RooflineStepModel(llama, GPUS["H200"])
    assert h200.step_time(decode_tokens=8, decode_ctx=8000) < m.step_time(
        decode_tokens=8, decode_ctx=8000
    )
    assert h200.kv_capacity_tokens() > m.kv_capacity_tokens()


def test_moe_reads_fewer_weights_for_small_batches() -> None:
    moe = MODELS["qwen3-30b-a3b"]
    assert moe.weight_bytes_read(1) < 0.2 * moe.params * 2
    # A large batch touches every expert: every weight but the untied embedding table.
    assert moe.weight_bytes_read(4096) == pytest.approx(moe.read_params * 2, rel=1e-3)
    assert moe.read_params == moe.params - 151936 * 2048


def test_tensor_parallel_adds_all_reduce_time() -> None:
    spec = MODELS["qwen2.5-32b"]
    tp2 = RooflineStepModel(spec, GPUS["H100"])
    assert tp2.tp == 2
    assert tp2.step_time(decode_tokens=1, decode_ctx=10) > tp2.step_overhead_s + 2 * 64 * 8e-6


def test_roofline_rejects_impossible_settings() -> None:
    with pytest.raises(ConfigError, match="compute_eff"):
        RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"], compute_eff=1.5)
    with pytest.raises(ConfigError, match="does not fit"):
        RooflineStepModel(MODELS["qwen2.5-32b"], GPUS["A100"], tp=1, gpu_memory_utilization=0.8)
    with pytest.raises(ConfigError, match="tp"):
        RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"], tp=0)


def test_build_step_model_names_unknown_things() -> None:
    assert isinstance(build_step_model(StepModelConfig()), RooflineStepModel)
    with pytest.raises(ConfigError, match="unknown model 'gpt-9'"):
        build_step_model(StepModelConfig(model="gpt-9"))
    with pytest.raises(ConfigError, match="unknown gpu 'B300'"):
        build_step_model(StepModelConfig(gpu="B300"))
    with pytest.raises(ConfigError, match="mfu"):
        build_step_model(StepModelConfig(roofline={"mfu": 0.5}))
    m = build_step_model(StepModelConfig(roofline={"compute_eff": 0.5}))
    assert isinstance(m, RooflineStepModel) and m.compute_eff == 0.5


def test_load_step_model_both_schemas(tmp_path) -> None:
    short = tmp_path / "short.yaml"
    short.write_text(
        yaml.safe_dump(
            {"model": "m", "kv_tokens": 1000, "coefficients": {"b0": 1e-3, "b1": 2e-5, "b2": 3e-5}}
        )
    )
    m = load_step_model(short)
    assert (m.b0, m.b1, m.b2, m.b3, m.b4, m.kv_tokens, m.model) == (
        1e-3,
        2e-5,
        3e-5,
        0.0,
        0.0,
        1000,
        "m",
    )
    # The document `llmsched calibrate` writes.
    calibrated = tmp_path / "cal.yaml"
    calibrated.write_text(
        yaml.safe_dump(
            {
                "kind": "llmsched.step_time_profile",
                "version": 1,
                "meta": {"model": "tiny"},
                "coefficients": {
                    "b0": 1e-3,
                    "prefill_tokens": 2e-5,
                    "decode_tokens": 3e-5,
                    "prefill_tokens_sq": 1e-10,
                    "decode_context_tokens": 1e-9,
                },
            }
        )
    )
    c = load_step_model(calibrated)
    assert (c.b3, c.b4, c.model) == (1e-10, 1e-9, "tiny")
    assert c.step_time(prefill_tokens=100, prefill_sq=100**2, decode_tokens=2, decode_ctx=50) == (
        pytest.approx(1e-3 + 2e-5 * 100 + 3e-5 * 2 + 1e-10 * 1e4 + 1e-9 * 50)
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "coefficients"),
        ({"coefficients": {"b0": 1.0, "b1": 1.0}}, "missing coefficient"),
        ({"coefficients": {"b0": 1.0, "b1": 1.0, "b2": 1.0, "b9": 1.0}}, "unknown coefficient"),
        ({"coefficients": {"b0": 1.0, "b1": -1.0, "b2": 1.0}}, "b1 must be"),
        ({"coefficients": {"b0": 0, "b1": 0, "b2": 0}}, "must take time"),
        ({"coefficients": {"b0": 1, "b1": 1, "b2": 1, "decode_tokens": 1}}, "both"),
        (
            {"coefficients": {"b0": "x", "b1": 1, "b2": 1}},
            "b0 must be a finite number >= 0, got .x.",
        ),
        ({"coefficients": {"b0": 1, "b1": 1, "b2": 1}, "kv_tokens": 0}, "kv_tokens"),
    ],
)
def test_load_step_model_errors(doc, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_step_model(doc)


def test_load_step_model_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_step_model(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("coefficients: [unclosed")
    with pytest.raises(ConfigError, match=r"step model: cannot read .*bad\.yaml.*not valid YAML"):
        load_step_model(bad)


def test_reads_the_profile_llmsched_calibrate_writes(tmp_path) -> None:
    from llmsched.executor.step_time import StepSample, StepTimeProfile

    truth = (1e-3, 2e-6, 5e-6, 1e-10, 3e-9)
    samples = [
        StepSample(
            p, d, p * p, c, truth[0] + truth[1] * p + truth[2] * d + truth[3] * p * p + truth[4] * c
        )
        for p, d, c in [
            (0, 1, 100),
            (0, 8, 900),
            (16, 0, 0),
            (64, 0, 0),
            (512, 0, 0),
            (0, 32, 5000),
            (32, 4, 700),
            (256, 16, 3000),
        ]
    ]
    path = tmp_path / "profile.yaml"
    StepTimeProfile.fit(samples, meta={"model": "tiny-moe"}).save(path)
    model = load_step_model(path)
    assert model.model == "tiny-moe"
    for got, want in zip((model.b0, model.b1, model.b2, model.b3, model.b4), truth, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)


def test_linear_model_charges_each_prefill_chunk() -> None:
    m = LinearStepModel(b0=1e-3, b1=2e-5, b2=1e-4, b3=1e-9, b5=5e-4)
    # Two 64-token chunks beside one decode: b5 twice.
    two = m.step_time(128, 2 * 64**2, 0, 1, 100, 0, prefill_requests=2)
    assert two == pytest.approx(1e-3 + 2e-5 * 128 + 1e-4 + 1e-9 * 2 * 64**2 + 2 * 5e-4)
    # Left out, a step with prefill tokens is one chunk; a decode-only step none.
    assert m.step_time(prefill_tokens=64, prefill_sq=64**2) == m.step_time(
        prefill_tokens=64, prefill_sq=64**2, prefill_requests=1
    )
    assert m.step_time(decode_tokens=4) == pytest.approx(1e-3 + 4e-4)
    assert m.decode_run(4, 0).time(1) == pytest.approx(1e-3 + 4e-4)
    # The calibrate file's name for it.
    doc = {"coefficients": {"b0": 1e-3, "prefill_tokens": 1e-5, "decode_tokens": 1e-4}}
    doc["coefficients"]["prefill_requests"] = 7e-4
    assert load_step_model(doc).b5 == 7e-4
    with pytest.raises(ConfigError, match="b5 must be"):
        LinearStepModel(b0=1e-3, b1=1e-5, b2=1e-4, b5=-1.0)
    # A step on an idle replica pays b6 once; the calibrate file calls it after_idle.
    idle = LinearStepModel(b0=1e-3, b1=2e-5, b2=1e-4, b6=9e-3)
    woken = idle.step_time(prefill_tokens=64, prefill_sq=64**2, after_idle=True)
    assert woken - idle.step_time(prefill_tokens=64, prefill_sq=64**2) == pytest.approx(9e-3)
    doc["coefficients"]["after_idle"] = 6e-3
    assert load_step_model(doc).b6 == 6e-3


def test_roofline_charges_each_prefill_chunk_when_asked() -> None:
    base = RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"])
    charged = RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"], prefill_request_s=2e-4)
    work = {"prefill_tokens": 1024, "prefill_sq": 4 * 256**2, "decode_tokens": 8}
    # The presets charge nothing per chunk: the count changes nothing...
    assert base.step_time(**work, prefill_requests=4) == base.step_time(**work)
    # ... and a set cost is paid once per chunk, on top of the same step.
    extra = charged.step_time(**work, prefill_requests=4) - base.step_time(**work)
    assert extra == pytest.approx(4 * 2e-4)
    assert charged.decode_run(8, 800).time(3) == base.decode_run(8, 800).time(3)
    assert charged.constants()["prefill_request_s"] == 2e-4
    woken = RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"], idle_start_s=5e-3)
    assert woken.step_time(**work, after_idle=True) - base.step_time(**work) == pytest.approx(5e-3)
    assert base.step_time(**work, after_idle=True) == base.step_time(**work)
    with pytest.raises(ConfigError, match="prefill_request_s"):
        RooflineStepModel(MODELS["llama-3.1-8b"], GPUS["H100"], prefill_request_s=-1.0)


@given(finite, finite, finite, finite, finite, finite, finite, st.integers(0, 300))
def test_three_piece_decode_run_is_the_sum_of_its_steps(a1, g1, a2, g2, a3, g3, c, k) -> None:
    run = DecodeRun(a1, g1, a2, g2, c, a3, g3)
    brute = sum(max(a1 + g1 * j, a2 + g2 * j, a3 + g3 * j) + c for j in range(k))
    assert math.isclose(run.time(k), brute, rel_tol=1e-9, abs_tol=1e-9)


# Vidur's published per-operator profiles of vLLM's layers (github.com/microsoft/vidur,
# data/profiling/compute/<gpu>/meta-llama/<model>/mlp.csv): per transformer layer, the median
# milliseconds of its four linear layers (QKV, output, gate+up, down projections) plus its
# element-wise layers (two norms, rotary embedding, activation, residual add), by tokens in the
# batch. A100: Meta-Llama-3-8B; H100: Llama-2-7b-hf.
VIDUR = {
    "A100": {
        "shape": (4096, 14336, 32, 8),
        "ms": {
            1: 0.276 + 0.027,
            8: 0.286 + 0.026,
            64: 0.324 + 0.027,
            128: 0.377 + 0.035,
            256: 0.554 + 0.055,
            512: 0.994 + 0.089,
            2048: 4.072 + 0.359,
            8192: 15.551 + 1.405,
            16384: 31.555 + 2.854,
        },
    },
    "H100": {
        "shape": (4096, 11008, 32, 32),
        "ms": {
            1: 0.156 + 0.019,
            8: 0.152 + 0.020,
            64: 0.162 + 0.021,
            128: 0.180 + 0.019,
            256: 0.260 + 0.026,
            512: 0.329 + 0.046,
            2048: 1.087 + 0.179,
            4096: 2.205 + 0.387,
        },
    },
}
VIDUR_TOLERANCE = 0.08  # relative, every point of both profiles


def one_layer(hidden: int, ffn: int, heads: int, kv_heads: int) -> ModelSpec:
    """The linear layers of one transformer layer as a model (no vocabulary, no attention)."""
    head_dim = hidden // heads
    params = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden + 3 * hidden * ffn
    return ModelSpec("layer", float(params), 1, hidden, heads, kv_heads, head_dim)


@pytest.mark.parametrize("gpu", sorted(VIDUR))
def test_gpu_presets_reproduce_the_measured_layer_times(gpu: str) -> None:
    profile = VIDUR[gpu]
    m = RooflineStepModel(one_layer(*profile["shape"]), GPUS[gpu], step_overhead_s=0.0)
    errors = {}
    for tokens, measured_ms in profile["ms"].items():
        predicted_ms = m.step_time(prefill_tokens=tokens) * 1e3
        errors[tokens] = predicted_ms / measured_ms - 1
    assert max(abs(e) for e in errors.values()) <= VIDUR_TOLERANCE, errors


@pytest.mark.parametrize("gpu", sorted(VIDUR))
def test_single_bounds_miss_the_profile(gpu: str) -> None:
    """With the two bounds alone (no transition term, the efficiencies refitted at each end),
    some point of the profile is off by more than the tolerance: the regime between the
    bounds is what the term is for."""
    profile = VIDUR[gpu]
    for mbu in (0.6, 0.65, 0.7, 0.75, 0.8):
        m = RooflineStepModel(
            one_layer(*profile["shape"]),
            GPUS[gpu],
            step_overhead_s=0.0,
            overlap=0.0,
            memory_eff=mbu,
        )
        worst = max(
            abs(m.step_time(prefill_tokens=t) * 1e3 / ms - 1) for t, ms in profile["ms"].items()
        )
        assert worst > VIDUR_TOLERANCE, (mbu, worst)


def test_prefill_counts_no_embedding_matmul_and_one_lm_head_row() -> None:
    llama = MODELS["llama-3.1-8b"]
    m = RooflineStepModel(llama, GPUS["H100"], step_overhead_s=0.0, elementwise_bytes=0.0)
    # 8.03 B weights less the 2 x 525 M of the embedding table and the LM head.
    assert llama.body_params == pytest.approx(8.03e9 - 2 * 128256 * 4096)
    flops = m.constants()["body2"] * 8192 + m.constants()["lm2"]
    expected = flops / (989e12 * 0.74)
    assert m.step_time(prefill_tokens=8192) == pytest.approx(expected)
    # Each decode token needs its logits: 8 decodes cost 8 LM-head rows.
    c = m.constants()
    assert c["lm2"] == 2 * 128256 * 4096
    tied = ModelSpec("tied", 1e9, 8, 1024, 8, 8, 128, vocab=32000, tied_embeddings=True)
    assert tied.body_params == pytest.approx(1e9 - 32000 * 1024)
    assert tied.read_params == 1e9  # the one table is read as the LM head


def test_roofline_refuses_bad_efficiencies() -> None:
    llama = MODELS["llama-3.1-8b"]
    with pytest.raises(ConfigError, match="overlap"):
        RooflineStepModel(llama, GPUS["H100"], overlap=1.5)
    with pytest.raises(ConfigError, match="request_overhead_s"):
        RooflineStepModel(llama, GPUS["H100"], request_overhead_s=-1.0)
    with pytest.raises(ConfigError, match="leave no active parameters"):
        RooflineStepModel(ModelSpec("x", 1e6, 1, 1024, 8, 8, 128, vocab=32000), GPUS["H100"])
