"""``llmsched calibrate`` against real vLLM engines, then the simulator with the fitted model
held against a real run: a mixed trace (tenants sharing system prompts, fresh questions, mixed
output lengths) replayed through the gateway to both engines at a few rates. Runs before the
failover test, which stops an engine.

The figures compared, per rate: TTFT p50 and p90, TPOT p50 and output throughput at the
client, the engines' own TTFT and TPOT means, and the prefix hit rate (the engines' counters
against the simulator's). What is bounded, and why, is stated beside the bounds below; every
figure is printed (``-s``) and, when ``LLMSCHED_CALIBRATION_REPORT`` names a file, written
there as JSON.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmsched import cli
from llmsched.calibrate import StreamTiming, engine_info, timed_completion
from llmsched.executor.step_time import StepTimeProfile
from llmsched.sim import ScenarioConfig, Simulation

from .gateway_thread import GatewayThread, gateway_config
from .vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine

# The engines' settings (tests/engines/vllm_engine.py) that shape scheduling.
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's default for this engine (see its startup log)

# Replay: tenants with a shared system prompt of SYSTEM_BLOCKS blocks, each request adding a
# fresh question of 16-112 tokens and asking for 8, 16 or 32 tokens; requests arrive as a
# Poisson process at each rate.
TENANTS = 4
SYSTEM_BLOCKS = 6
REQUESTS = 40
RATES = (1.5, 4.0)  # requests per second over both engines

# What is asserted, from runs on the shared two-core machine (other builds and engines on it;
# the simulator docs give the measured figures):
# - throughput (relative error) and prefix hit rate (absolute difference): the simulator's
#   schedule and cache model; measured within 0-12% and 0.00-0.04;
# - TPOT, the engines' own mean (their clock, immune to a front end that streams several tokens
#   in one chunk): within a factor; real / sim was 1.0-2.1 with both engines calibrated at
#   once, 2.2-2.8 when one was calibrated alone (the replay runs both, the gateway and the
#   client on two cores), and up to 4.0 at 4 requests/s with the machine at a load of 15;
#   0.495 once (a clean-clone CI run, December 7, 4 requests/s: the grid timed while the
#   machine was busier than during the replay, its decode steps twice the replay's);
# - TTFT, the engines' own mean (queue + prefill, their clock): within a factor, against a
#   simulation of the same run without the step model's cost of waking an idle engine. The
#   calibration times that cost as a client sees it (about 10 ms here), and most of it is
#   spent before the engine's clock starts (the HTTP front end handing the request to the
#   engine core), so the engines' own figure leaves it out. Compared with the wake-up cost
#   included, real / sim was 1.0-1.6 at 1.5 requests/s and 1.2-7.9 at 4 on this machine, and
#   0.61 and 0.42 on a quiet CI machine, where the front end's part is the larger. Without
#   it the simulated mean is about 10 ms lower, which a busy machine's ratio (7.9 above, with
#   it) would take to about 14;
# - TTFT at the client (p50, p90): the simulator predicts the engine's queue and prefill,
#   which the client's figure includes, so sim <= real; the rest (the HTTP front end, the
#   gateway and CPU contention, outside any step model) is 4-20x the simulator's figure.
THROUGHPUT_ERROR = 0.25
HIT_RATE_ERROR = 0.06
TPOT_FACTOR = (0.4, 4.0)  # real / sim, engines' own mean
ENGINE_TTFT_FACTOR = (0.5, 16.0)  # real / sim, engines' own mean, sim without the wake-up
# The grid's median relative fit error: 3-26% over the prompt-alone and decode grid; 17-39%
# with the prompts also timed beside a decoding request and several at once, on this
# machine at a load of 8-15 (the same session's prompt-alone grid: 13.5%).
FIT_MEDIAN_ERROR = 0.5
METRICS = (
    "ttft_p50",
    "ttft_p90",
    "tpot_p50",
    "throughput",
    "prefix_hit_rate",
    "engine_ttft_mean",
    "engine_tpot_mean",
)


@pytest.fixture(scope="module")
def fitted(engines: list[VllmEngine], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llmsched calibrate --engine`` run against both engines at once (as a user would:
    they share the machine when they serve, and slow each other down). Two timings per point
    (calibrate's default is three): the median of four samples (two engines) still sets one
    slow timing aside, and the grid took a third of this folder's time at three."""
    out = tmp_path_factory.mktemp("calibrate") / "vllm-cpu.yaml"
    urls = ",".join(e.base_url for e in engines)
    argv = ["calibrate", "--engine", urls, "--out", str(out)]
    argv += ["--prompt-lens", "32,128,512,1024", "--batch-sizes", "1,2,4"]
    argv += ["--context-lens", "32,224,448", "--repeats", "2"]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def gateway(engines: list[VllmEngine], tiny_model: Path) -> Iterator[GatewayThread]:
    runner = GatewayThread(gateway_config(engines, str(tiny_model)))
    try:
        yield runner
    finally:
        runner.stop()


def trace_rows(rate: float, salt: int, seed: int = 0) -> list[dict[str, Any]]:
    """The mixed trace at ``rate``: Mooncake-style rows (seconds), ``salt`` making its content
    new to the engines' caches."""
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(REQUESTS):
        t += rng.expovariate(rate)
        tenant = rng.randrange(TENANTS)
        system = [salt + tenant * 1000 + k for k in range(SYSTEM_BLOCKS)]
        question = rng.randint(16, 112)
        length = SYSTEM_BLOCKS * BLOCK_SIZE + question
        own = [salt + 500_000 + 10 * i + k for k in range(-(-question // BLOCK_SIZE))]
        rows.append(
            {
                "timestamp": t,
                "input_length": length,
                "output_length": rng.choice((8, 16, 32)),
                "hash_ids": system + own,
                "tenant": tenant,
            }
        )
    return rows


def prompt_of(row: dict[str, Any], vocabulary: tuple[int, ...]) -> list[int]:
    """The real prompt: each hash id's block from a generator seeded by the id (equal ids,
    equal blocks, as the simulator assumes), cut to the row's length."""
    tokens: list[int] = []
    for block in row["hash_ids"]:
        rng = random.Random(block)
        tokens += [rng.choice(vocabulary) for _ in range(BLOCK_SIZE)]
    return tokens[: row["input_length"]]


COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "requests": "vllm:request_prefill_time_seconds_count",
    "tpot_s": "vllm:request_time_per_output_token_seconds_sum",
    "tpot_requests": "vllm:request_time_per_output_token_seconds_count",
}


def counters(engines: list[VllmEngine]) -> dict[str, float]:
    """The engines' own counters, summed over both (the engine's clock: queue and prefill are
    measured in its core, so a front end that falls behind does not show in them)."""
    return {key: sum(e.metric(name) for e in engines) for key, name in COUNTERS.items()}


def replay(url: str, rows: list[dict[str, Any]], vocabulary: tuple[int, ...]) -> list[StreamTiming]:
    """Send each row at its time (one thread each), streamed, and time its tokens."""
    prompts = [prompt_of(row, vocabulary) for row in rows]
    timings: list[StreamTiming | None] = [None] * len(rows)
    errors: list[BaseException] = []
    start = time.perf_counter() + 0.2

    def send(i: int) -> None:
        delay = start + rows[i]["timestamp"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            timings[i] = timed_completion(url, MODEL_NAME, prompts[i], rows[i]["output_length"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[0]
    return [t for t in timings if t is not None]


def figures(
    ttft: np.ndarray, tpot: np.ndarray, output_tokens: int, span: float, hit_rate: float
) -> dict[str, float]:
    return {
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p90": float(np.percentile(ttft, 90)),
        "tpot_p50": float(np.percentile(tpot, 50)),
        "throughput": output_tokens / span,
        "prefix_hit_rate": hit_rate,
    }


def real_figures(
    timings: list[StreamTiming], rows: list[dict[str, Any]], engine: dict[str, float]
) -> dict[str, float]:
    """The client's figures, plus the engines' own view of the same requests (``engine``:
    counter deltas over the replay)."""
    ttft = np.array([t.ttft for t in timings])
    tpot = np.array([t.tpot() for t in timings])
    span = max(t.finish for t in timings) - min(t.sent for t in timings)
    out = figures(
        ttft, tpot, sum(r["output_length"] for r in rows), span, engine["hits"] / engine["queries"]
    )
    out["engine_ttft_mean"] = (engine["queue_s"] + engine["prefill_s"]) / engine["requests"]
    out["engine_tpot_mean"] = engine["tpot_s"] / engine["tpot_requests"]
    return out


def simulated_figures(profile: Path, rows: list[dict[str, Any]], trace: Path) -> dict[str, float]:
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = ScenarioConfig.from_dict(
        {
            "name": "vllm-cpu",
            "replicas": 2,
            "step_model": {"profile": str(profile)},
            "engine": {
                "block_size": BLOCK_SIZE,
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            },
            "workload": {
                "kind": "trace",
                "path": str(trace),
                "timestamp_unit": "s",
                "hash_block": BLOCK_SIZE,
            },
            "policies": ["llm-d"],
        }
    )
    s = Simulation(config, "llm-d").run().summary()
    assert s["completed"] == len(rows)
    return {
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p90": s["ttft_s"]["p90"],
        "tpot_p50": s["tpot_s"]["p50"],
        "throughput": s["output_tok_s"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "engine_ttft_mean": s["ttft_s"]["mean"],
        "engine_tpot_mean": s["tpot_s"]["mean"],
    }


def error(metric: str, sim: float, real: float) -> float:
    """Relative error (prefix hit rate: absolute difference)."""
    if metric == "prefix_hit_rate":
        return abs(sim - real)
    return abs(sim - real) / real


def violations(rate: float, sim: dict[str, float], real: dict[str, float]) -> list[str]:
    """What the replay at ``rate`` breaks of the bounds above."""
    out = []
    if error("throughput", sim["throughput"], real["throughput"]) > THROUGHPUT_ERROR:
        out.append("throughput")
    if error("prefix_hit_rate", sim["prefix_hit_rate"], real["prefix_hit_rate"]) > HIT_RATE_ERROR:
        out.append("prefix_hit_rate")
    ratio = real["engine_tpot_mean"] / sim["engine_tpot_mean"]
    if not TPOT_FACTOR[0] <= ratio <= TPOT_FACTOR[1]:
        out.append("engine_tpot_mean")
    ratio = real["engine_ttft_mean"] / sim["engine_ttft_mean"]
    if not ENGINE_TTFT_FACTOR[0] <= ratio <= ENGINE_TTFT_FACTOR[1]:
        out.append("engine_ttft_mean")
    out += [m for m in ("ttft_p50", "ttft_p90") if sim[m] > real[m]]
    return [f"rate {rate}: {m} sim {sim[m]:.4g} real {real[m]:.4g}" for m in out]


def test_calibrate_fits_the_real_engine(fitted: Path) -> None:
    profile = StepTimeProfile.load(fitted)
    assert profile.kv_tokens == 64 * BLOCK_SIZE  # from vllm:cache_config_info
    # Fresh prompts: the grid never hit the cache, and vLLM saw every request the client sent.
    engine = profile.meta["engine_metrics"]
    assert engine["prefix_cache_hit_tokens"] == 0
    assert engine["prefix_cache_query_tokens"] > 0
    c = profile.coefficients
    # A step costs something, and a prefill grows with its length.
    assert c["b0"] > 0 and c["prefill_tokens"] + c["prefill_tokens_sq"] > 0
    # The fit explains the grid (its noise is the machine's: other jobs share the cores).
    assert profile.error.median < FIT_MEDIAN_ERROR, profile.error


def test_simulator_with_the_fitted_model_predicts_a_real_run(
    fitted: Path,
    engines: list[VllmEngine],
    gateway: GatewayThread,
    tmp_path: Path,
) -> None:
    vocabulary = engine_info(engines[0].base_url).vocabulary
    url = f"http://127.0.0.1:{gateway.gateway.port}"
    profile = StepTimeProfile.load(fitted)
    report: dict[str, Any] = {"fit_error": profile.error.__dict__}
    # The engines' clock starts once the engine core has the request: after the wake-up.
    profile.coefficients["after_idle"] = 0.0
    engine_clock = tmp_path / "engine-clock.yaml"
    profile.save(engine_clock)
    failures = []
    for k, rate in enumerate(RATES):
        rows = trace_rows(rate, salt=(int(time.time()) % 10_000 + k) * 10_000_000)
        before = counters(engines)
        timings = replay(url, rows, vocabulary)
        time.sleep(0.5)  # the last step's counters
        after = counters(engines)
        real = real_figures(timings, rows, {k: after[k] - before[k] for k in after})
        sim = simulated_figures(fitted, rows, tmp_path / f"trace-{rate}.jsonl")
        on_engine_clock = simulated_figures(engine_clock, rows, tmp_path / f"trace-{rate}.jsonl")
        sim["engine_ttft_mean"] = on_engine_clock["engine_ttft_mean"]
        errors = {m: error(m, sim[m], real[m]) for m in METRICS}
        report[f"rate {rate}"] = {"real": real, "sim": sim, "error": errors}
        failures += violations(rate, sim, real)
    text = json.dumps(report, indent=2)
    print(text)
    out = os.environ.get("LLMSCHED_CALIBRATION_REPORT")
    if out:
        Path(out).write_text(text)
    assert not failures, "\n".join(failures) + "\n" + text
