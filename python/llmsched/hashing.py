"""Chained block hashing of token sequences.

``xxh3`` (the default) is defined exactly, so any language can reproduce it: tokens are cut into
full blocks of ``block_size`` (a trailing partial block is not hashed); with
``h[-1] = chain_seed``, block ``i`` hashes to ``xxh3_64(bytes(block_i), seed=h[i-1])`` where
``bytes(block_i)`` is each token as an unsigned 32-bit little-endian integer. Equal hashes mean
equal prefixes.

``chain_seed`` is ``seed`` itself when no model, LoRA or cache salt is given; otherwise
``xxh3_64(ns, seed=seed)`` where ``ns`` concatenates, for model, LoRA name and cache salt in that
order, one byte (0 absent, 1 present) and, if present, the UTF-8 length as u32 little-endian
followed by the UTF-8 bytes.

>>> import numpy as np
>>> h = block_hashes(np.arange(40, dtype=np.uint32), block_size=16)
>>> h.dtype, len(h)
(dtype('uint64'), 2)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched._tokens import TokensLike, as_token_array

__all__ = ["block_hashes", "namespace_seed"]


def namespace_seed(
    seed: int = 0,
    *,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> int:
    """The chain seed that folds a model, LoRA adapter and cache salt into ``seed``.

    >>> namespace_seed(7)
    7
    >>> namespace_seed(7, lora="a") != namespace_seed(7, lora="b")
    True
    """
    _check_seed(seed)
    return _llmsched.namespace_seed(seed, model, lora, cache_salt)


def block_hashes(
    tokens: TokensLike,
    block_size: int = 16,
    *,
    seed: int = 0,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> npt.NDArray[np.uint64]:
    """One chained hash per full block of ``tokens``, as a numpy ``uint64`` array.

    ``tokens`` may be a numpy integer array (read in place), any integer buffer or a list.

    >>> len(block_hashes(list(range(33)), block_size=16))
    2
    """
    _check_block_size(block_size)
    chain_seed = namespace_seed(seed, model=model, lora=lora, cache_salt=cache_salt)
    return _llmsched.xxh3_block_hashes(as_token_array(tokens), block_size, chain_seed)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
