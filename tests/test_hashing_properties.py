"""Property tests: the native hashing equals its pure-Python twin on random input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmsched
from llmsched import InvalidTokenError
from llmsched.hashing import ALGORITHMS
from llmsched.reference import hashing as ref

token_ids = st.integers(min_value=0, max_value=2**32 - 1)
small_ids = st.integers(min_value=0, max_value=300)
token_lists = st.lists(st.one_of(token_ids, small_ids), max_size=200)
block_sizes = st.integers(min_value=1, max_value=40)
seeds = st.integers(min_value=0, max_value=2**64 - 1)
names = st.one_of(st.none(), st.text(max_size=12))
dtypes = st.sampled_from([np.uint32, np.uint64, np.int64])


@settings(max_examples=150, deadline=None)
@given(token_lists, block_sizes, seeds, names, names, names, dtypes)
def test_xxh3_equals_twin(
    tokens: list[int],
    block_size: int,
    seed: int,
    model: str | None,
    lora: str | None,
    salt: str | None,
    dtype: Any,
) -> None:
    got = llmsched.block_hashes(
        np.asarray(tokens, dtype=dtype),
        block_size,
        seed=seed,
        model=model,
        lora=lora,
        cache_salt=salt,
    )
    chain_seed = ref.namespace_seed(seed, model=model, lora=lora, cache_salt=salt)
    assert got.tolist() == ref.block_hashes(tokens, block_size, chain_seed)


@settings(max_examples=80, deadline=None)
@given(token_lists, block_sizes, st.text(max_size=16), names, names)
def test_vllm_equals_twin(
    tokens: list[int], block_size: int, seed: str, lora: str | None, salt: str | None
) -> None:
    digests = llmsched.vllm_block_digests(tokens, block_size, seed=seed, lora=lora, cache_salt=salt)
    assert digests == ref.vllm_block_digests(tokens, block_size, seed, lora, salt)
    events = llmsched.block_hashes(
        tokens, block_size, seed=seed, lora=lora, cache_salt=salt, algo="vllm_sha256_cbor"
    )
    assert events.tolist() == [ref.vllm_event_hash(d) for d in digests]


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(st.text(max_size=400), st.binary(max_size=400)),
    block_sizes,
    seeds,
    names,
    st.booleans(),
    st.one_of(st.none(), st.integers(min_value=0, max_value=150)),
)
def test_text_equals_twin(
    text: str | bytes,
    block_size: int,
    seed: int,
    model: str | None,
    include_partial: bool,
    max_tokens: int | None,
) -> None:
    got = llmsched.text_block_hashes(
        text,
        block_size,
        seed=seed,
        model=model,
        include_partial=include_partial,
        max_tokens=max_tokens,
    )
    chain_seed = ref.namespace_seed(seed, model=model)
    expect = ref.text_block_hashes(text, block_size, chain_seed, include_partial, max_tokens)
    assert got.tolist() == expect
    assert llmsched.pack_text(text).tolist() == ref.pack_text(text)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(token_lists, max_size=12),
    block_sizes,
    seeds,
    st.integers(min_value=1, max_value=4),
)
def test_batch_equals_twin(
    prompts: list[list[int]], block_size: int, seed: int, threads: int
) -> None:
    got = llmsched.block_hashes_batch(prompts, block_size, seed=seed, threads=threads)
    assert [h.tolist() for h in got] == ref.block_hashes_batch(prompts, block_size, seed)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(small_ids, min_size=1, max_size=120),
    st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32, max_value=2**80)),
    st.data(),
    block_sizes,
)
def test_bad_id_reported_like_twin(
    tokens: list[int], bad: int, data: st.DataObject, block_size: int
) -> None:
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    tokens[position] = bad
    message = f"token id {bad} at position {position} "
    with pytest.raises(InvalidTokenError, match=message):
        ref.block_hashes(tokens, block_size)
    for algo in ALGORITHMS:
        with pytest.raises(InvalidTokenError, match=message):
            llmsched.block_hashes(tokens, block_size, algo=algo)
