"""Routing policies on real engines: ``llmsched serve`` in front of two real vLLM CPU engines.

The claim the simulator makes (prefix-aware routing raises the cache hit rate and cuts the time
to first token on a multi-turn workload) is checked here on real engines, with a real benchmark
client, beside the simulator's prediction for the same run:

* **Engines:** two vLLM CPU engines (``tests/engines/vllm_engine.py``), one core each, serving a
  random Llama model made at run time, large enough that prefill dominates a step on CPU
  (hidden size 512, 4 layers by default: a 1,000-token prefill costs about 15 decode steps), and
  with a KV cache smaller than the workload's working set, so where a request lands matters.
* **Gateway:** the real ``llmsched serve`` process, once per policy (``random``,
  ``round-robin``, ``llm-d``), fed by the engines' KV events like a deployment.
* **Client:** inference-perf (the Kubernetes serving working group's benchmark tool, from PyPI,
  in its own environment) with its ``shared_prefix`` generator in multi-turn mode: groups of
  users share a system prompt, and each user's next turn extends their own conversation.
  Constant arrival rate, streamed completions.
* **Figures per policy:** the engines' prefix-cache hit rate (``vllm:prefix_cache_hits`` over
  ``vllm:prefix_cache_queries``, both engines, over the run), TTFT p50/p90, output tokens/s and
  requests/s as the client measured them; medians over ``--repeats``, policies interleaved (the
  order rotates each repeat) and the engines' caches reset before each run.
* **Prediction:** the step model is fitted from the engines (``llmsched calibrate --engine``),
  each run's requests (prompt tokens and start times, from inference-perf's per-request report,
  tokenized with the model's tokenizer) become a trace, and ``llmsched.sim`` replays it on two
  simulated replicas with the same KV capacity, batch limits and policy. The table shows each
  real figure beside the predicted one.

Usage: python -m tools.bench_engines [--rate 2] [--repeats 2] [--out DIR] ...
(``make bench-engines`` installs inference-perf and runs it.) Exit status 0 unless an engine,
the gateway or the client could not run; timing never fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.engines.vllm_engine import (  # noqa: E402
    BLOCK_SIZE,
    MODEL_NAME,
    VllmEngine,
    free_port,
    make_tiny_model,
    start_engines,
)

POLICIES = ("random", "round-robin", "llm-d")
MAX_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 4096


@dataclass
class Setup:
    """One benchmark's shape: model, engines and workload."""

    hidden: int = 512
    layers: int = 4
    num_blocks: int = 1024  # per engine: 32,768 tokens of KV, two thirds of the working set
    max_num_seqs: int = 8
    # 35 users: an odd count, so round-robin over two engines does not send each user back to
    # the same engine by accident (inference-perf cycles through its users in a fixed order).
    groups: int = 7
    users_per_group: int = 5
    system_prompt_len: int = 400
    question_len: int = 100
    output_len: int = 8
    rounds: int = 3
    rate: float = 3.0
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.groups * self.users_per_group * self.rounds

    @property
    def duration_s(self) -> int:
        return max(1, round(self.requests / self.rate))


class Figures(TypedDict):
    """What one run (or its prediction) measured."""

    requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    output_tok_s: float
    requests_s: float


# -- the gateway ------------------------------------------------------------------------------


def gateway_config(
    engines: Sequence[VllmEngine], model_dir: Path, policy: str
) -> dict[str, object]:
    """``llmsched serve``'s config for ``policy`` in front of ``engines``."""
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "models": [MODEL_NAME],
        "block_size": BLOCK_SIZE,
        "tokenizer": str(model_dir),
        "router": policy,
        "engines": [
            {
                "host": "127.0.0.1",
                "port": e.port,
                "model": MODEL_NAME,
                "kv_events": e.kv_events_endpoint,
                "kv_events_bind": True,
                "replay": e.replay_endpoint,
                "topic": e.topic,
            }
            for e in engines
        ],
    }


@contextmanager
def serve(config: dict[str, object], workdir: Path) -> Iterator[str]:
    """Run ``llmsched serve`` with ``config``; yields its base URL once ``/ready`` answers."""
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    listen = config["listen"]
    assert isinstance(listen, dict)
    url = f"http://127.0.0.1:{listen['port']}"
    log = (workdir / "gateway.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    try:
        deadline = time.monotonic() + 120
        while not _answers(url + "/ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "gateway.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"llmsched serve did not become ready:\n{tail}")
            time.sleep(0.2)
        yield url
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """End ``process`` and its process group (TERM, then KILL after 30 s); gone is fine."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    except ProcessLookupError:
        pass


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# -- the client -------------------------------------------------------------------------------


def client_config(setup: Setup, base_url: str, model_dir: Path, out: Path) -> dict[str, object]:
    """inference-perf's config: multi-turn shared prefixes at a constant rate, streamed."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": setup.groups,
                "num_prompts_per_group": setup.users_per_group,
                "system_prompt_len": setup.system_prompt_len,
                "question_len": setup.question_len,
                "output_len": setup.output_len,
                "seed": setup.seed,
                "enable_multi_turn_chat": True,
            },
        },
        "load": {
            "type": "constant",
            "stages": [{"rate": setup.rate, "duration": setup.duration_s}],
            "num_workers": 1,
            "worker_max_concurrency": 256,
        },
        "server": {
            "type": "vllm",
            "model_name": MODEL_NAME,
            "base_url": base_url,
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(model_dir)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": True}},
        "storage": {"local_storage": {"path": str(out)}},
    }


def run_client(client_python: Path, config: dict[str, object], workdir: Path) -> Path:
    """Run inference-perf; returns its report folder."""
    path = workdir / "client.yaml"
    path.write_text(yaml.safe_dump(config))
    with (workdir / "client.log").open("wb") as log:
        done = subprocess.run(
            [str(client_python), "-m", "inference_perf.main", "--config_file", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            timeout=1800,
        )
    storage = config["storage"]
    assert isinstance(storage, dict)
    out = Path(storage["local_storage"]["path"])
    if done.returncode != 0 or not (out / "summary_lifecycle_metrics.json").exists():
        tail = (workdir / "client.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"inference-perf failed ({done.returncode}):\n{tail}")
    return out


# -- the engines ------------------------------------------------------------------------------


def reset_caches(engines: Sequence[VllmEngine]) -> None:
    """Empty both engines' prefix caches (vLLM's development endpoint)."""
    for engine in engines:
        request = urllib.request.Request(engine.base_url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            reply.read()


def cache_counters(engines: Sequence[VllmEngine]) -> tuple[float, float]:
    """Prefix-cache hit and query tokens, summed over the engines."""
    hits = sum(e.metric("vllm:prefix_cache_hits_total") for e in engines)
    queries = sum(e.metric("vllm:prefix_cache_queries_total") for e in engines)
    return hits, queries


# -- reports ----------------------------------------------------------------------------------


def client_figures(report: Path, hit_rate: float) -> Figures:
    """The client's figures: TTFT quantiles from its summary; output tokens/s and requests/s
    over the run's span (first start to last end, as the simulator counts them) from its
    per-request records."""
    summary = json.loads((report / "summary_lifecycle_metrics.json").read_text())
    ttft = summary["successes"]["latency"]["time_to_first_token"]
    records = [
        r
        for r in json.loads((report / "per_request_lifecycle_metrics.json").read_text())
        if not r.get("error")
    ]
    span = max(float(r["end_time"]) for r in records) - min(float(r["start_time"]) for r in records)
    output = sum(int(json.loads(r["request"])["max_tokens"]) for r in records)
    return {
        "requests": len(records),
        "hit_rate": hit_rate,
        "ttft_p50_s": float(ttft["median"]),
        "ttft_p90_s": float(ttft["p90"]),
        "output_tok_s": output / span if span > 0 else 0.0,
        "requests_s": len(records) / span if span > 0 else 0.0,
    }


def trace_rows(report: Path, model_dir: Path) -> list[dict[str, object]]:
    """The run's requests as simulator trace lines: start time, the prompt's token count and
    the ids of its full blocks (chained, so equal prefixes get equal ids), output length."""
    from llmsched.tokenize import PromptTokenizer

    tokenizer = PromptTokenizer(model_dir)
    records = json.loads((report / "per_request_lifecycle_metrics.json").read_text())
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}
    rows: list[dict[str, object]] = []
    for record in records:
        if record.get("error"):
            continue
        body = json.loads(record["request"])
        tokens = tokenizer.completion_tokens(body["prompt"])
        ids: list[int] = []
        parent = 0
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            key = (parent, tuple(tokens[start : start + BLOCK_SIZE]))
            parent = block_ids.setdefault(key, len(block_ids) + 1)
            ids.append(parent)
        output = body["max_tokens"]  # exact: the client sends ignore_eos
        rows.append(
            {
                "timestamp": float(record["start_time"]),
                "input_length": len(tokens),
                "output_length": int(output),
                "hash_ids": ids,
            }
        )
    return rows


def predict(
    setup: Setup, rows: list[dict[str, object]], step_model: Path, policy: str, workdir: Path
) -> Figures:
    """The simulator's figures for a run's requests on two replicas like the engines."""
    from llmsched.sim import ScenarioConfig, Simulation

    trace = workdir / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = ScenarioConfig.from_dict(
        {
            "name": "real-engines",
            "replicas": 2,
            "seed": setup.seed,
            "step_model": {"profile": str(step_model)},
            "engine": {
                "block_size": BLOCK_SIZE,
                "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                "max_num_seqs": setup.max_num_seqs,
                "kv_tokens": setup.num_blocks * BLOCK_SIZE,
            },
            "workload": {
                "kind": "trace",
                "path": str(trace),
                "timestamp_unit": "s",
                "hash_block": BLOCK_SIZE,
            },
            "policies": [policy],
        }
    )
    summary = Simulation(config, policy).run().summary()
    return {
        "requests": int(summary["completed"]),
        "hit_rate": float(summary["prefix_hit_rate"]),
        "ttft_p50_s": float(summary["ttft_s"]["p50"]),
        "ttft_p90_s": float(summary["ttft_s"]["p90"]),
        "output_tok_s": float(summary["output_tok_s"]),
        "requests_s": float(summary["requests_s"]),
    }


def calibrate(engines: Sequence[VllmEngine], out: Path, repeats: int | None = None) -> Path:
    """Fit the step model with ``llmsched calibrate --engine``, both engines timed at once
    (engines sharing a machine slow each other down, as they do in the runs); ``repeats``: timed
    runs per grid point (calibrate's default, 3, where None)."""
    urls = ",".join(e.base_url for e in engines)
    command = [sys.executable, "-m", "llmsched", "calibrate", "--engine", urls]
    command += ["--model", MODEL_NAME, "--out", str(out)]
    if repeats is not None:
        command += ["--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llmsched calibrate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("[")))
    return out


# -- the run ----------------------------------------------------------------------------------


def median_figures(runs: list[Figures]) -> Figures:
    """Each figure's median over ``runs``."""
    keys = ("requests", "hit_rate", "ttft_p50_s", "ttft_p90_s", "output_tok_s", "requests_s")
    out = {key: statistics.median(float(run[key]) for run in runs) for key in keys}  # type: ignore[literal-required]
    return {  # a TypedDict built key by key keeps mypy's checks
        "requests": int(out["requests"]),
        "hit_rate": out["hit_rate"],
        "ttft_p50_s": out["ttft_p50_s"],
        "ttft_p90_s": out["ttft_p90_s"],
        "output_tok_s": out["output_tok_s"],
        "requests_s": out["requests_s"],
    }


def run_policy(
    setup: Setup,
    engines: Sequence[VllmEngine],
    model_dir: Path,
    client_python: Path,
    policy: str,
    workdir: Path,
) -> tuple[Figures, list[dict[str, object]]]:
    """One policy, one repeat: fresh caches, a fresh gateway, one client run."""
    workdir.mkdir(parents=True, exist_ok=True)
    reset_caches(engines)
    with serve(gateway_config(engines, model_dir, policy), workdir) as url:
        hits0, queries0 = cache_counters(engines)
        report = run_client(
            client_python, client_config(setup, url, model_dir, workdir / "report"), workdir
        )
        hits1, queries1 = cache_counters(engines)
    queried = queries1 - queries0
    hit_rate = (hits1 - hits0) / queried if queried > 0 else 0.0
    return client_figures(report, hit_rate), trace_rows(report, model_dir)


def print_table(real: dict[str, Figures], predicted: dict[str, Figures]) -> None:
    """Each policy's real figures beside the prediction (``-`` without one)."""

    def pair(policy: str, key: str, fmt: str) -> str:
        mine = format(real[policy][key], fmt)  # type: ignore[literal-required]
        guess = predicted.get(policy)
        return f"{mine} / {format(guess[key], fmt) if guess else '-'}"  # type: ignore[literal-required]

    print("\nreal / simulated, medians over the repeats")
    print("| policy | hit rate | TTFT p50 s | TTFT p90 s | out tok/s | req/s |")
    print("|---|---|---|---|---|---|")
    for policy in real:
        cells = [
            pair(policy, "hit_rate", ".0%"),
            pair(policy, "ttft_p50_s", ".3f"),
            pair(policy, "ttft_p90_s", ".3f"),
            pair(policy, "output_tok_s", ".1f"),
            pair(policy, "requests_s", ".2f"),
        ]
        print(f"| {policy} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client-python", type=Path, required=True, help="inference-perf's Python")
    parser.add_argument("--out", type=Path, default=None, help="keep runs and results here")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", type=float, default=Setup.rate, help="requests per second")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--short",
        action="store_true",
        help="one repeat, fewer users, each calibration point timed once",
    )
    args = parser.parse_args(argv)
    setup = Setup(rate=args.rate)
    repeats = args.repeats
    # The calibration's three timings per grid point (75 requests in all) took 60% of the short
    # form's time (237 of 387 s in CI): one each still fits the 7 coefficients from 25 points.
    calibration_repeats: int | None = None
    if args.short:
        setup = Setup(rate=args.rate, groups=3, users_per_group=3, rounds=2)
        repeats = 1
        calibration_repeats = 1
    policies = [p for p in args.policies.split(",") if p]
    out = args.out or Path(tempfile.mkdtemp(prefix="llmsched-bench-engines-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"setup: {asdict(setup)}; {setup.requests} requests per run; results in {out}")

    model_dir = make_tiny_model(
        out / "model",
        setup.seed,
        (
            "--hidden",
            str(setup.hidden),
            "--layers",
            str(setup.layers),
            "--max-positions",
            str(MAX_MODEL_LEN),
        ),
    )
    engines = [
        VllmEngine(
            model_dir=model_dir,
            name=f"engine{i}",
            log_path=out / f"engine{i}.log",
            num_blocks=setup.num_blocks,
            max_num_seqs=setup.max_num_seqs,
            cpu=i % max(1, os.cpu_count() or 1),
            max_model_len=MAX_MODEL_LEN,
            dev_mode=True,
            extra_args=("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)),
        )
        for i in range(2)
    ]
    print(f"engines healthy after {start_engines(engines):.0f} s")
    try:
        started = time.monotonic()
        step_model = calibrate(engines, out / "step_model.yaml", calibration_repeats)
        print(f"calibrated in {time.monotonic() - started:.0f} s", flush=True)
        reset_caches(engines)
        runs: dict[str, list[Figures]] = {p: [] for p in policies}
        predictions: dict[str, list[Figures]] = {p: [] for p in policies}
        for repeat in range(repeats):
            order = policies[repeat % len(policies) :] + policies[: repeat % len(policies)]
            for policy in order:
                workdir = out / f"{policy}-{repeat}"
                started = time.monotonic()
                figures, rows = run_policy(
                    setup, engines, model_dir, args.client_python, policy, workdir
                )
                runs[policy].append(figures)
                took = time.monotonic() - started
                print(f"{policy} repeat {repeat} (run in {took:.0f} s): {figures}", flush=True)
                predictions[policy].append(predict(setup, rows, step_model, policy, workdir))
    finally:
        for engine in engines:
            engine.stop()
    real = {p: median_figures(runs[p]) for p in policies}
    predicted = {p: median_figures(predictions[p]) for p in policies}
    print_table(real, predicted)
    (out / "results.json").write_text(
        json.dumps({"setup": asdict(setup), "real": runs, "predicted": predictions}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
