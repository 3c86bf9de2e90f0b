"""The real-engine policy benchmark's bookkeeping (tools/bench_engines.py): the client's records
become the simulator's trace and figures. The engines themselves run in ``make bench-engines``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptTokenizer

bench = pytest.importorskip("tools.bench_engines")

WORDS = ["the", "cache", "of", "a", "prefix", "is", "a", "block", "of", "tokens", "routed", "to"]


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def write_report(folder: Path, records: list[dict[str, object]]) -> Path:
    folder.mkdir()
    (folder / "per_request_lifecycle_metrics.json").write_text(json.dumps(records))
    summary = {
        "successes": {"latency": {"time_to_first_token": {"median": 0.1, "p90": 0.3}}},
    }
    (folder / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    return folder


def record(prompt: str, start: float, end: float, error: object = None) -> dict[str, object]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "stream": True}
    return {
        "start_time": str(start),
        "end_time": str(end),
        "request": json.dumps(body),
        "error": error,
    }


def test_trace_rows_share_ids_exactly_over_shared_full_blocks(tmp_path: Path) -> None:
    model = write_tokenizer(tmp_path / "tok")
    first = text(150, 0)
    follow_up = first + " " + text(80, 3)
    other = text(150, 5)
    report = write_report(
        tmp_path / "report",
        [
            record(first, 10.0, 10.5),
            record(follow_up, 11.0, 11.4),
            record(other, 12.0, 12.2),
            record(other, 12.5, 13.0, error={"message": "boom"}),
        ],
    )
    rows = bench.trace_rows(report, model)
    assert len(rows) == 3  # the failed request is not replayed
    tokenizer = PromptTokenizer(model)
    ids = [tokenizer.completion_tokens(p) for p in (first, follow_up, other)]
    for row, tokens in zip(rows, ids, strict=True):
        assert row["input_length"] == len(tokens)
        assert len(row["hash_ids"]) == len(tokens) // bench.BLOCK_SIZE
        assert row["output_length"] == 5
    common = next(
        (i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b), len(ids[0])
    )
    shared = common // bench.BLOCK_SIZE
    assert shared >= 2
    assert rows[1]["hash_ids"][:shared] == rows[0]["hash_ids"][:shared]
    assert rows[1]["hash_ids"][shared] not in rows[0]["hash_ids"]
    assert not set(rows[2]["hash_ids"]) & set(rows[0]["hash_ids"])
    assert [row["timestamp"] for row in rows] == [10.0, 11.0, 12.0]


def test_client_figures_count_over_the_runs_span(tmp_path: Path) -> None:
    report = write_report(
        tmp_path / "report",
        [record("a b", 100.0, 101.0), record("a c", 100.5, 104.0), record("x", 101, 102, "err")],
    )
    figures = bench.client_figures(report, hit_rate=0.25)
    assert figures == {
        "requests": 2,
        "hit_rate": 0.25,
        "ttft_p50_s": 0.1,
        "ttft_p90_s": 0.3,
        "output_tok_s": 10 / 4.0,
        "requests_s": 2 / 4.0,
    }


def test_prediction_replays_the_trace_and_sees_the_repeated_prefix(tmp_path: Path) -> None:
    model = write_tokenizer(tmp_path / "tok")
    prompt = text(300, 1)
    report = write_report(tmp_path / "report", [record(prompt, 0.0, 1.0), record(prompt, 5.0, 6.0)])
    rows = bench.trace_rows(report, model)
    profile = tmp_path / "step.yaml"
    profile.write_text(
        "model: tiny\nkv_tokens: 10240\n"
        "coefficients: {b0: 0.005, b1: 0.0001, b2: 0.001, b3: 0.0, b4: 0.0}\n"
    )
    setup = bench.Setup()
    figures = bench.predict(setup, rows, profile, "llm-d", tmp_path)
    assert figures["requests"] == 2
    # The second request finds the first one's full blocks on the same replica.
    full = len(rows[0]["hash_ids"]) * bench.BLOCK_SIZE
    total = 2 * rows[0]["input_length"]
    assert figures["hit_rate"] == pytest.approx(
        min(full, rows[0]["input_length"] - 1) / total, abs=0.02
    )
    assert figures["ttft_p50_s"] > 0
