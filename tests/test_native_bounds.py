"""Values that size an allocation are bounded before use: an in-range but absurd block size, from
an argument or from a snapshot, is refused with a library error instead of aborting the process
or raising pyo3's PanicException (a BaseException)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import llmsched
from llmsched.errors import (
    ConfigError,
    InternalError,
    InvalidValueError,
    LlmschedError,
    SnapshotError,
)

HUGE = [2**16 + 1, 2**40, 2**63]
# The Python wrappers check arguments first (llmsched.validation); the native layer checks again
# for callers that reach it directly. Either refuses with a library error naming block_size.
REFUSED = (ConfigError, InvalidValueError)


@pytest.mark.parametrize("block_size", HUGE)
def test_prefix_index_refuses_a_huge_block_size(block_size: int) -> None:
    with pytest.raises(REFUSED, match="block_size"):
        llmsched.PrefixIndex(block_size=block_size)


@pytest.mark.parametrize("block_size", HUGE)
def test_hashing_refuses_a_huge_block_size(block_size: int) -> None:
    tokens = np.arange(16, dtype=np.uint32)
    with pytest.raises(REFUSED, match="block_size"):
        llmsched.block_hashes(tokens, block_size=block_size)
    with pytest.raises(REFUSED, match="block_size"):
        llmsched.block_hashes(list(range(16)), block_size=block_size, algo="vllm_sha256_cbor")
    with pytest.raises(REFUSED, match="block_size"):
        llmsched.text_block_hashes("hello " * 10, block_size=block_size)
    with pytest.raises(REFUSED, match="block_size"):
        llmsched.block_hashes_batch([tokens, tokens], block_size=block_size)


def test_the_native_layer_checks_too() -> None:
    from llmsched import _llmsched

    assert _llmsched.MAX_BLOCK_SIZE == 2**16
    with pytest.raises(ConfigError, match="block_size"):
        _llmsched.PrefixIndex(2**16 + 1, 0, None, None, None)
    with pytest.raises(ConfigError, match="block_size"):
        _llmsched.xxh3_block_hashes(np.arange(16, dtype=np.uint32), 2**40, 0)


def test_the_largest_block_size_still_works() -> None:
    tokens = np.arange(2**16, dtype=np.uint32)
    assert len(llmsched.block_hashes(tokens, block_size=2**16)) == 1
    index = llmsched.PrefixIndex(block_size=2**16)
    assert index.match_tokens(range(16)).longest == 0


def _snapshot_with(field: int, value: object) -> bytes:
    """A snapshot with one field changed, in the first format (no checksum to match), so that
    the checks behind the checksum are what refuses it."""
    index = llmsched.PrefixIndex(block_size=4)
    index.store("a", index.hash_tokens(range(32)))
    snapshot = msgpack.unpackb(index.dumps()[:-8], strict_map_key=False)  # less its checksum
    snapshot[0] = 1  # the format
    snapshot[field] = value
    return bytes(msgpack.packb(snapshot))


@pytest.mark.parametrize("block_size", [0, *HUGE, 2**64 - 1])
def test_loads_refuses_a_snapshot_with_a_huge_block_size(block_size: int) -> None:
    data = _snapshot_with(1, block_size)  # [format, block_size, seed, ...]
    with pytest.raises(SnapshotError, match="block_size"):
        llmsched.PrefixIndex.loads(data)


def test_loads_refuses_a_snapshot_with_zero_worker_capacity() -> None:
    with pytest.raises(SnapshotError, match="worker_capacity"):
        llmsched.PrefixIndex.loads(_snapshot_with(4, 0))


def test_damaged_snapshots_raise_library_errors_only() -> None:
    rng = np.random.default_rng(7)
    index = llmsched.PrefixIndex(block_size=4)
    index.store("a", index.hash_tokens(range(64)))
    index.record("b", index.hash_tokens(range(40)), ttl_s=10.0)
    good = index.dumps()
    for _ in range(3_000):
        data = bytearray(good)
        for position in rng.integers(0, len(data), size=rng.integers(1, 4)):
            data[position] = int(rng.integers(0, 256))
        try:
            loaded = llmsched.PrefixIndex.loads(bytes(data))
        except LlmschedError:
            continue
        loaded.match_tokens(range(64))
        llmsched.PrefixIndex.loads(loaded.dumps())


def test_internal_error_is_an_ordinary_exception() -> None:
    assert issubclass(InternalError, LlmschedError)
    assert issubclass(InternalError, RuntimeError)


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(2**24 + 1, 16), (2**32 - 1, 16), (8, 2**20)]
)
def test_the_simulated_kv_cache_refuses_absurd_sizes(num_blocks: int, block_size: int) -> None:
    from llmsched.sim.kv import make_kv_cache

    with pytest.raises(ConfigError, match="num_blocks"):
        make_kv_cache(num_blocks, block_size)
