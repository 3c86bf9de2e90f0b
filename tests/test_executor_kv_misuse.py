"""The executor's block pool under misuse: a block it does not hold, or an id outside it, is an
InvalidValueError that leaves every reference count and the free queue as they were."""

import pytest

pytest.importorskip("torch")

from llmsched.errors import InvalidValueError
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
