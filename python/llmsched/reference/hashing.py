"""Pure-Python twin of :mod:`llmsched.hashing` (xxh3 chain).

>>> from llmsched.reference.hashing import block_hashes
>>> len(block_hashes(list(range(32)), 16))
2
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash


def namespace_seed(
    seed: int = 0,
    *,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> int:
    """Same definition as :func:`llmsched.hashing.namespace_seed`."""
    if model is None and lora is None and cache_salt is None:
        return seed
    ns = bytearray()
    for part in (model, lora, cache_salt):
        if part is None:
            ns.append(0)
        else:
            raw = part.encode()
            ns.append(1)
            ns += struct.pack("<I", len(raw))
            ns += raw
    return int(xxhash.xxh3_64_intdigest(bytes(ns), seed=seed))


def block_hashes(tokens: Sequence[int], block_size: int = 16, chain_seed: int = 0) -> list[int]:
    """One chained xxh3 hash per full block."""
    out: list[int] = []
    prev = chain_seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = int(xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=prev))
        out.append(prev)
    return out
