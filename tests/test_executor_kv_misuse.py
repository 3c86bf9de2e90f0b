"""The executor's block pool under misuse: a block it does not hold, or an id outside it, is an
InvalidValueError that leaves every reference count and the free queue as they were (and, for
``cache``, the hashes, the cached blocks and the events)."""

import pytest

pytest.importorskip("torch")

from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError
from llmsched.executor.kv_cache import BlockPool


def _state(pool: BlockPool) -> tuple[list[int], int]:
    return list(pool.ref_count), pool.num_free


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ([0, 3], "block 3 freed 1 time"),  # block 3 is free: 0 was freed, 3 went to -1
        ([0, 0, 1], "block 0 freed 2 time"),
        ([-1], "-1 is not a block of this pool"),  # read as block 3
        ([4], "4 is not a block of this pool"),  # an IndexError after freeing the rest
        ([1.0], "1.0 is not a block"),
    ],
)
def test_free_of_blocks_not_held_changes_nothing(blocks: list[int], match: str) -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    held = pool.allocate(2)
    assert held == [0, 1]
    before = _state(pool)
    with pytest.raises(InvalidValueError, match=match):
        pool.free(blocks)
    assert _state(pool) == before
    # The pool still works: both blocks come back and every block is handed out once.
    pool.free(held)
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_touch_of_an_id_outside_the_pool_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(2)
    pool.cache(blocks, [11, 22], None, [1, 2, 3, 4])
    pool.free(blocks)
    before = _state(pool)
    with pytest.raises(InvalidValueError, match="7 is not a block"):
        pool.touch([0, 7])  # block 0 was taken before the IndexError
    assert _state(pool) == before
    pool.touch(pool.find_prefix([11, 22]))
    assert pool.ref_count == [1, 1, 0, 0]


def _whole(pool: BlockPool) -> tuple[object, ...]:
    return (
        list(pool.ref_count),
        list(pool.block_hash),
        dict(pool.cached),
        pool.num_free,
        pool.take_events(),
    )


@pytest.mark.parametrize(
    ("blocks", "hashes", "tokens", "match"),
    [
        # Block 0 was cached under 11 with no BlockStored, then a bare ValueError from zip.
        ([0, 1], [11], [1, 2, 3, 4], "2 blocks, 1 hashes"),
        # Block 0 cached, then a bare IndexError.
        ([0, 7], [11, 22], [1, 2, 3, 4], "7 is not a block of this pool"),
        # Cached as block -1 (the last block's hash slot), found by find_prefix as -1.
        ([-1], [11], [1, 2], "-1 is not a block of this pool"),
        # Block 1 cached holding one token, published as a BlockStored of 3 tokens for 2 blocks.
        ([0, 1], [11, 22], [1, 2, 3], "2 blocks of 2 tokens need 4 token ids, got 3"),
        # A free block, in front of the eviction queue, cached as if computed.
        ([2], [11], [1, 2], "block 2 is not held"),
    ],
)
def test_cache_of_blocks_or_tokens_that_do_not_fit_changes_nothing(
    blocks: list[int], hashes: list[int], tokens: list[int], match: str
) -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.allocate(2) == [0, 1]
    before = _whole(pool)
    with pytest.raises(InvalidValueError, match=match):
        pool.cache(blocks, hashes, None, tokens)
    assert _whole(pool) == before
    pool.cache([0, 1], [11, 22], None, [1, 2, 3, 4])  # the pool still works
    assert pool.find_prefix([11, 22]) == [0, 1]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 2), "num_blocks must be a positive int, got 0"),
        ((2.5, 2), "num_blocks must be a positive int, got 2.5"),  # a bare TypeError
        ((True, 2), "num_blocks must be a positive int, got True"),  # a pool of one block
        (("4", 2), "num_blocks must be a positive int, got '4'"),  # a bare TypeError
        ((4, 0), "block_size must be a positive int, got 0"),
        ((4, 2.0), "block_size must be a positive int, got 2.0"),
    ],
)
def test_pool_sizes_are_positive_ints(args: tuple[object, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BlockPool(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        (-1, InvalidValueError, "count must be an int >= 0, got -1"),  # gave [] without a word
        (True, InvalidTypeError, "count must be an int, got bool"),  # gave one block
        (1.5, InvalidTypeError, "count must be an int, got float"),  # a bare TypeError
    ],
)
def test_allocate_takes_a_count_of_blocks(count: object, error: type, match: str) -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    before = _whole(pool)
    with pytest.raises(error, match=match):
        pool.allocate(count)  # type: ignore[arg-type]
    assert _whole(pool) == before
    assert pool.allocate(0) == []
