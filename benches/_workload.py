"""A realistic prefix-cache workload for the benchmarks: shared system prompts, multi-turn sessions.

Sessions start from one of a few system prompts and grow turn by turn; every turn's full prompt
(1,000 to 10,000 tokens) is one stored sequence, held by the session's worker and sometimes a
second one. Deterministic for a seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BLOCK_SIZE = 16


@dataclass
class Sequence:
    worker: int
    tokens: npt.NDArray[np.uint32]
    # Length in tokens of the previous turn of the same session (0 for a first turn).
    previous: int


def sessions(
    workers: int,
    sequences: int = 10_000,
    turns: int = 5,
    system_prompts: int = 16,
    seed: int = 0,
) -> list[Sequence]:
    """``sequences`` stored prompts: sessions of ``turns`` turns over shared system prompts."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, 128_000, size=int(rng.integers(800, 2_000)), dtype=np.uint32)
        for _ in range(system_prompts)
    ]
    out: list[Sequence] = []
    session = 0
    while len(out) < sequences:
        prompt = systems[session % system_prompts]
        worker = int(rng.integers(0, workers))
        previous = 0
        for _ in range(turns):
            turn = rng.integers(0, 128_000, size=int(rng.integers(200, 1_600)), dtype=np.uint32)
            prompt = np.concatenate([prompt, turn])
            if len(prompt) > 10_000:
                break
            out.append(Sequence(worker, prompt, previous))
            if rng.random() < 0.2:
                out.append(Sequence(int(rng.integers(0, workers)), prompt, 0))
            previous = len(prompt)
        session += 1
    return out[:sequences]


def long_prompt(seq: list[Sequence], tokens: int = 10_000, seed: int = 1) -> npt.NDArray[np.uint32]:
    """A prompt of exactly ``tokens`` tokens that extends the longest stored sequence."""
    rng = np.random.default_rng(seed)
    base = max(seq, key=lambda s: len(s.tokens)).tokens[:tokens]
    extra = rng.integers(0, 128_000, size=tokens - len(base), dtype=np.uint32)
    return np.concatenate([base, extra])


def mooncake_trace(path: str, lines: int, seed: int = 0, hash_ids: bool = True) -> None:
    """A Mooncake-style JSONL trace at ``path``: ``timestamp`` (ms, Poisson arrivals at about
    6.7 requests/s), ``input_length`` (gamma, mean 7,590 tokens) and ``output_length`` (mean
    182), the means of Mooncake's published conversation trace, and ``hash_ids`` (one id per
    512-token block): each line continues one of 2,000 shared contexts (Zipf-like popularity)
    for a random number of leading blocks, then has blocks of its own."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(150.0, lines)
    stamps = np.cumsum(gaps).astype(np.int64)
    inputs = np.maximum(1, rng.gamma(1.5, 7_590 / 1.5, lines)).astype(np.int64)
    outputs = np.maximum(1, rng.gamma(1.5, 182 / 1.5, lines)).astype(np.int64)
    contexts = np.minimum(rng.zipf(1.3, lines), 2_000) - 1
    shared_share = rng.random(lines)
    next_id = 2_000 * 64
    with open(path, "w") as out:
        for i in range(lines):
            row: dict[str, object] = {
                "timestamp": int(stamps[i]),
                "input_length": int(inputs[i]),
                "output_length": int(outputs[i]),
            }
            if hash_ids:
                need = -(-int(inputs[i]) // 512)
                shared = min(need, 64, int(need * shared_share[i]))
                base = int(contexts[i]) * 64
                ids = list(range(base, base + shared)) + list(
                    range(next_id, next_id + need - shared)
                )
                next_id += need - shared
                row["hash_ids"] = ids
            out.write(json.dumps(row) + "\n")
