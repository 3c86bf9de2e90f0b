"""Wide-EP sizing, the dual-batch-overlap cost term, calibration and the CLI."""

import numpy as np
import pytest
import yaml

from llmsched.errors import ConfigError
from llmsched.executor.sizing import MoEModelSpec, ParallelLayout, dbo_step_time, kv_tokens_per_rank
from llmsched.executor.step_time import StepSample, StepTimeProfile

H200 = 141e9
V3 = MoEModelSpec.deepseek_v3()


def test_kv_per_rank_grows_as_expert_parallelism_widens() -> None:
    v3 = MoEModelSpec.deepseek_v3()
    tp8 = kv_tokens_per_rank(v3, ParallelLayout(tp=8), H200)
    # llm-d quotes 598K KV tokens per 8-GPU node at TP8; the plain model gives 612K (2% off).
    assert tp8.total_kv_tokens == pytest.approx(598e3, rel=0.05)
    widths = [8, 16, 32, 64]
    per_rank = [
        kv_tokens_per_rank(v3, ParallelLayout(dp=w, ep=w), H200).kv_tokens_per_rank for w in widths
    ]
    assert per_rank == sorted(per_rank) and per_rank[-1] > 3 * per_rank[0]
    # Per node (8 ranks) data-parallel attention holds several times the TP8 figure.
    ep8 = kv_tokens_per_rank(v3, ParallelLayout(dp=8, ep=8), H200)
    assert ep8.total_kv_tokens > 2 * tp8.total_kv_tokens


def test_kv_heads_split_over_tensor_parallel_ranks_when_there_are_enough() -> None:
    gqa = MoEModelSpec(
        "gqa", dense_params=1e9, expert_params=8e9, kv_bytes_per_token=1024, kv_heads=8
    )
    assert kv_tokens_per_rank(gqa, ParallelLayout(tp=4), 80e9).kv_bytes_per_token_per_rank == 256
    mla = MoEModelSpec(
        "mla", dense_params=1e9, expert_params=8e9, kv_bytes_per_token=1024, kv_heads=1
    )
    assert kv_tokens_per_rank(mla, ParallelLayout(tp=4), 80e9).kv_bytes_per_token_per_rank == 1024


def test_sizing_rejects_layouts_that_do_not_fit() -> None:
    with pytest.raises(ConfigError, match="no KV space"):
        kv_tokens_per_rank(MoEModelSpec.deepseek_v3(), ParallelLayout(tp=2), H200)
    with pytest.raises(ConfigError, match="must divide"):
        ParallelLayout(tp=4, ep=3)


@pytest.mark.parametrize(
    ("compute", "comm", "expected"),
    [(1.0, 0.0, 1.0), (1.0, 0.1, 1.05), (1.0, 1.0, 1.5), (1.0, 4.0, 4.5), (0.0, 2.0, 2.0)],
)
def test_dual_batch_overlap_cost_term(compute, comm, expected) -> None:
    assert dbo_step_time(compute, comm) == pytest.approx(expected)
    assert dbo_step_time(compute, comm, micro_batches=1) == pytest.approx(compute + comm)


def test_dbo_gain_is_large_when_communication_is_slow_and_small_when_fast() -> None:
    gain = lambda comm: (1.0 + comm) / dbo_step_time(1.0, comm)  # noqa: E731
    assert gain(1.0) > 1.3
    assert gain(0.05) < 1.03


def test_step_time_fit_recovers_known_coefficients(tmp_path) -> None:
    truth = {
        "b0": 2e-3,
        "prefill_tokens": 1e-5,
        "decode_tokens": 3e-5,
        "prefill_tokens_sq": 1e-9,
        "decode_context_tokens": 2e-8,
    }
    samples = []
    for batch in (1, 2, 4, 8):
        for context in (16, 128, 512):
            for p, d, sq, ctx in (
                (batch * context, 0, batch * context**2, 0),
                (0, batch, 0, batch * context),
                (context, batch, context**2, batch * context),
            ):
                t = truth["b0"] + truth["prefill_tokens"] * p + truth["decode_tokens"] * d
                t += truth["prefill_tokens_sq"] * sq + truth["decode_context_tokens"] * ctx
                samples.append(StepSample(p, d, sq, ctx, t))
    profile = StepTimeProfile.fit(samples, {"device": "synthetic"})
    for term, value in truth.items():
        assert profile.coefficients[term] == pytest.approx(value, rel=1e-6)
    assert profile.error.max < 1e-9
    assert profile.linear_error.median > profile.error.median
    path = tmp_path / "profile.yaml"
    profile.save(path)
    loaded = StepTimeProfile.load(path)
    assert loaded.coefficients == profile.coefficients
    assert loaded.predict(100, 4, 10_000, 400) == pytest.approx(
        profile.predict(100, 4, 10_000, 400)
    )
    path.write_text("kind: something-else\n")
    with pytest.raises(ConfigError, match=r"not a llmsched\.step_time_profile"):
        StepTimeProfile.load(path)


def test_cli_help(capsys) -> None:
    from llmsched import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", "--help"])
    assert exit_info.value.code == 0
    assert "least squares" in capsys.readouterr().out


def test_calibrate_command_writes_a_profile_with_fit_error(tmp_path, capsys) -> None:
    torch = pytest.importorskip("torch")
    from llmsched import cli

    threads = torch.get_num_threads()
    out = tmp_path / "profile.yaml"
    try:
        status = cli.main(
            [
                "calibrate",
                "--out",
                str(out),
                "--device",
                "cpu",
                "--batch-sizes",
                "1,4",
                "--context-lens",
                "16,64,128",
                "--repeats",
                "2",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    profile = StepTimeProfile.load(out)
    assert len(profile.samples) == 18
    assert profile.meta["device"] == "cpu" and profile.meta["model"]["num_experts"] == 8
    assert all(s.seconds > 0 for s in profile.samples)
    printed = capsys.readouterr().out
    assert "fit error (relative): median" in printed
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--batch-sizes", "a,b"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefill_requests", "2"),  # a bare TypeError from the < 0 comparison
        ("prefill_requests", 1.5),  # a fractional sequence count was fitted
        ("prefill_requests", True),
        ("after_idle", "yes"),  # a ValueError only when fitted
        ("after_idle", None),
        ("after_idle", 2),
    ],
)
def test_step_samples_refuse_malformed_batch_fields(tmp_path, field, value) -> None:
    """Probe 60: these were accepted when built and failed (or fitted nonsense) later."""
    with pytest.raises(ConfigError, match=field):
        StepSample(16, 0, 256, 0, 1e-3, **{field: value})
    good = [StepSample(16 * i, 0, 256 * i * i, 0, 1e-3 * i) for i in range(1, 9)]
    good += [StepSample(0, b, 0, c * b, 1e-3 + 1e-4 * b) for b, c in ((1, 90), (2, 9), (4, 30))]
    doc = StepTimeProfile.fit(good).to_dict()
    doc["samples"][0][field] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=field):
        StepTimeProfile.load(path)


def test_step_samples_take_numpy_counts_and_flags() -> None:
    sample = StepSample(16, 0, 256, 0, 1e-3, prefill_requests=np.int64(2), after_idle=np.True_)
    assert sample.prefill_requests == 2 and type(sample.prefill_requests) is int
    assert sample.after_idle is True
    assert StepSample(16, 0, 256, 0, 1e-3, after_idle=1).after_idle is True


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kv_tokens_per_rank(V3, ParallelLayout(tp=8), float("nan")), "hbm_bytes"),
        (lambda: kv_tokens_per_rank(V3, ParallelLayout(tp=8), float("inf")), "hbm_bytes"),
        (
            lambda: kv_tokens_per_rank(
                V3, ParallelLayout(tp=8), H200, activation_reserve_bytes=float("nan")
            ),
            "activation_reserve_bytes",
        ),
        (
            lambda: kv_tokens_per_rank(
                V3, ParallelLayout(tp=8), H200, activation_reserve_bytes=-1e12
            ),
            "activation_reserve_bytes",
        ),
        (lambda: MoEModelSpec("m", 1e9, 1e9, 100, 0), "kv_heads"),  # ZeroDivisionError
        (lambda: MoEModelSpec("m", 1e9, 1e9, 0, 1), "kv_bytes_per_token"),  # ZeroDivisionError
        (lambda: MoEModelSpec("m", -1e12, 1e9, 100, 1), "dense_params"),  # more KV than HBM
        (lambda: MoEModelSpec("m", 1e9, 1e9, 100, 1, weight_bytes=float("nan")), "weight_bytes"),
        (lambda: ParallelLayout(tp=True), "tp"),
        (lambda: dbo_step_time(float("nan"), 1.0), "times"),
        (lambda: dbo_step_time(1.0, 1.0, micro_batches=1.5), "micro_batches"),
    ],
)
def test_sizing_refuses_values_that_give_nan_or_crash(call, message) -> None:
    """Probe 60: NaN and infinite sizes came back as NaN or inf token counts, a spec with no
    KV heads or no KV bytes was a ZeroDivisionError, negative weights gave more KV than HBM."""
    with pytest.raises(ConfigError, match=message):
        call()


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"batch_sizes": (1.5,)}, "batch_sizes"),  # accepted, then range(1.5) mid-timing
        ({"batch_sizes": (True,)}, "batch_sizes"),
        ({"context_lens": ("16",)}, "context_lens"),  # a bare TypeError
        ({"repeats": 0}, "repeats"),
        ({"max_prefill_tokens": 2.5}, "max_prefill_tokens"),
    ],
)
def test_calibration_grids_hold_positive_ints(grid, message) -> None:
    pytest.importorskip("torch")
    from llmsched.executor.calibrate import CalibrationGrid

    with pytest.raises(ConfigError, match=message):
        CalibrationGrid(**grid)


def test_calibrate_refuses_contexts_past_max_position_before_timing() -> None:
    """A decode at position max_position was an IndexError after the other points were timed
    (probe 60)."""
    pytest.importorskip("torch")
    from llmsched.executor.calibrate import CalibrationGrid, calibrate
    from llmsched.executor.config import ModelConfig

    grid = CalibrationGrid(batch_sizes=(1,), context_lens=(16, 32, 64), repeats=1)
    with pytest.raises(ConfigError, match=r"context length 64 .*max_position = 64"):
        calibrate(ModelConfig(max_position=64), grid)
    profile = calibrate(ModelConfig(max_position=65), grid)
    assert len(profile.samples) == 9
