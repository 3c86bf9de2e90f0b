import llmsched
import numpy as np
import pytest
from llmsched.reference import hashing as ref


def test_matches_reference_twin() -> None:
    tokens = list(range(1000, 1100))
    got = llmsched.block_hashes(tokens, block_size=16, seed=5)
    assert got.dtype == np.uint64
    assert got.tolist() == ref.block_hashes(tokens, 16, 5)


def test_rejects_negative_token() -> None:
    with pytest.raises(llmsched.InvalidTokenError, match="position 1"):
        llmsched.block_hashes(np.array([1, -1, 2, 3], dtype=np.int32), block_size=2)
