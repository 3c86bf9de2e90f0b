"""Normalising token input for the native module (any buffer, list or numpy array)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

TokensLike = Any
"""Token ids: a numpy integer array, any buffer of integers, or a sequence of ints."""


def as_token_array(tokens: TokensLike, what: str = "tokens") -> npt.NDArray[np.integer]:
    """Return ``tokens`` as a 1-D C-contiguous numpy integer array, copying only when needed.

    >>> as_token_array([1, 2, 3]).dtype
    dtype('int64')
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what}: raw bytes are ambiguous; wrap them with numpy.frombuffer(buf, dtype=...)"
        )
    elif isinstance(tokens, (list, tuple, range)) or not hasattr(tokens, "__buffer__"):
        if isinstance(tokens, Iterable) and not isinstance(tokens, (list, tuple, range)):
            tokens = list(tokens)
        if len(tokens) == 0:
            return np.zeros(0, dtype=np.int64)
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise_out_of_range(tokens, what)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what} must be integers: {exc}") from None
    else:
        arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got {arr.ndim} dimensions")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def raise_out_of_range(tokens: Iterable[Any], what: str) -> None:
    """Raise InvalidTokenError naming the first id outside 0..2**32-1."""
    from llmsched.errors import InvalidTokenError

    for position, value in enumerate(tokens):
        if not 0 <= int(value) <= 0xFFFFFFFF:
            raise InvalidTokenError(
                f"{what}: token id {value} at position {position} is out of range (0 to 4294967295)"
            )
    raise InvalidTokenError(f"{what}: token id out of range (0 to 4294967295)")
