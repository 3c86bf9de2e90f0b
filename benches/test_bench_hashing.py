"""Block hashing: native vs the pure-Python twin (``llmsched.reference.hashing``).

Groups pair each native benchmark with its ``_twin``; the conftest prints medians, tokens/s
and twin/native ratios. Workload: token ids below a 150k vocabulary, block size 16 (64 for
text), as numpy ``uint32`` (hashed in place) and ``int64`` (converted per block) arrays, and
``uint32`` at block sizes 64 and 128, whose 256- and 512-byte blocks take xxh3's long path (run
with AVX2 where the processor has it).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest

import llmsched
from llmsched.reference import hashing as ref

SIZES = {"10k": 10_000, "1m": 1_000_000}
BLOCK_SIZE = 16


@cache
def tokens(n: int, dtype: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(n)
    arr = rng.integers(0, 150_000, size=n).astype(dtype)
    arr.flags.writeable = False
    return arr


@cache
def twin_hashes(n: int) -> list[int]:
    return ref.block_hashes(tokens(n, "uint32").tolist(), BLOCK_SIZE)


def _setup(benchmark: Any, group: str, items: int, unit: str = "tokens") -> None:
    benchmark.group = group
    benchmark.extra_info.update(items=items, unit=unit)


@pytest.mark.parametrize("dtype", ["uint32", "int64"])
@pytest.mark.parametrize("size", SIZES)
def test_xxh3(benchmark: Any, size: str, dtype: str) -> None:
    n = SIZES[size]
    arr = tokens(n, dtype)
    _setup(benchmark, f"xxh3 {size} tokens {dtype}", n)
    assert llmsched.block_hashes(arr, BLOCK_SIZE).tolist() == twin_hashes(n)
    benchmark(llmsched.block_hashes, arr, BLOCK_SIZE)


@pytest.mark.parametrize("dtype", ["uint32", "int64"])
@pytest.mark.parametrize("size", SIZES)
def test_xxh3_twin(benchmark: Any, size: str, dtype: str) -> None:
    n = SIZES[size]
    as_list = tokens(n, dtype).tolist()  # the twin's natural input; converted outside timing
    _setup(benchmark, f"xxh3 {size} tokens {dtype}", n)
    assert ref.block_hashes(as_list, BLOCK_SIZE) == twin_hashes(n)
    benchmark(ref.block_hashes, as_list, BLOCK_SIZE)


LONG_BLOCK_SIZES = [64, 128]
LONG_N = 10_240


@pytest.mark.parametrize("block_size", LONG_BLOCK_SIZES)
def test_xxh3_long_blocks(benchmark: Any, block_size: int) -> None:
    arr = tokens(LONG_N, "uint32")
    _setup(benchmark, f"xxh3 10k tokens uint32 bs{block_size}", LONG_N)
    expect = ref.block_hashes(arr.tolist(), block_size)
    assert llmsched.block_hashes(arr, block_size).tolist() == expect
    benchmark(llmsched.block_hashes, arr, block_size)


@pytest.mark.parametrize("block_size", LONG_BLOCK_SIZES)
def test_xxh3_long_blocks_twin(benchmark: Any, block_size: int) -> None:
    as_list = tokens(LONG_N, "uint32").tolist()
    _setup(benchmark, f"xxh3 10k tokens uint32 bs{block_size}", LONG_N)
    benchmark(ref.block_hashes, as_list, block_size)


VLLM_N = 10_000


def test_vllm_sha256_cbor(benchmark: Any) -> None:
    arr = tokens(VLLM_N, "int64")
    _setup(benchmark, "vllm_sha256_cbor 10k tokens", VLLM_N)
    got = llmsched.block_hashes(arr, BLOCK_SIZE, lora="adapter", algo="vllm_sha256_cbor")
    assert got.tolist() == ref.vllm_block_hashes(arr.tolist(), BLOCK_SIZE, lora="adapter")
    benchmark(llmsched.block_hashes, arr, BLOCK_SIZE, lora="adapter", algo="vllm_sha256_cbor")


def test_vllm_sha256_cbor_twin(benchmark: Any) -> None:
    as_list = tokens(VLLM_N, "int64").tolist()
    _setup(benchmark, "vllm_sha256_cbor 10k tokens", VLLM_N)
    benchmark(ref.vllm_block_hashes, as_list, BLOCK_SIZE, lora="adapter")


TEXT = ("You are a helpful assistant. Cite sources. Ünïcödé prompts count too. " * 600)[:40_000]
TEXT_TOKENS = len(TEXT.encode()) // 4


def test_text(benchmark: Any) -> None:
    _setup(benchmark, "text 40k chars", TEXT_TOKENS, unit="pseudo-tokens")
    # llm-d's approximate mode, as the twin's defaults
    kw = {"include_partial": True, "max_tokens": llmsched.hashing.TEXT_MAX_TOKENS}
    assert llmsched.text_block_hashes(TEXT, 64, **kw).tolist() == ref.text_block_hashes(TEXT)
    benchmark(llmsched.text_block_hashes, TEXT, 64, **kw)


def test_text_twin(benchmark: Any) -> None:
    _setup(benchmark, "text 40k chars", TEXT_TOKENS, unit="pseudo-tokens")
    benchmark(ref.text_block_hashes, TEXT)


@cache
def batch(prompts: int, length: int) -> list[np.ndarray[Any, Any]]:
    """``prompts`` uint32 prompts of about ``length`` tokens (lengths vary by up to 50%)."""
    rng = np.random.default_rng(prompts * length)
    lengths = rng.integers(length // 2, length * 3 // 2, size=prompts)
    return [rng.integers(0, 150_000, size=int(n)).astype(np.uint32) for n in lengths]


def test_batch(benchmark: Any) -> None:
    prompts = batch(64, 10_000)
    _setup(benchmark, "batch 64 prompts x 10k", sum(len(p) for p in prompts))
    got = llmsched.block_hashes_batch(prompts, BLOCK_SIZE)
    assert [h.tolist() for h in got] == [twin_hashes_of(p) for p in prompts]
    benchmark(llmsched.block_hashes_batch, prompts, BLOCK_SIZE)


def test_batch_twin(benchmark: Any) -> None:
    as_lists = [p.tolist() for p in batch(64, 10_000)]
    _setup(benchmark, "batch 64 prompts x 10k", sum(len(p) for p in as_lists))
    benchmark(ref.block_hashes_batch, as_lists, BLOCK_SIZE)


def twin_hashes_of(prompt: np.ndarray[Any, Any]) -> list[int]:
    return ref.block_hashes(prompt.tolist(), BLOCK_SIZE)


# Whether a second thread pays off, by batch size (no twin: native against native).
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("prompts", "length"), [(64, 1_000), (64, 4_000), (64, 10_000), (256, 10_000)]
)
def test_batch_threads(benchmark: Any, prompts: int, length: int, threads: int) -> None:
    batch_ = batch(prompts, length)
    _setup(benchmark, f"batch threads {prompts} x {length}", sum(len(p) for p in batch_))
    one = llmsched.block_hashes_batch(batch_, BLOCK_SIZE, threads=1)
    got = llmsched.block_hashes_batch(batch_, BLOCK_SIZE, threads=threads)
    assert [h.tolist() for h in got] == [h.tolist() for h in one]
    benchmark(llmsched.block_hashes_batch, batch_, BLOCK_SIZE, threads=threads)
