"""The replica's KV cache: the native ``KvCache`` (Rust), with the pure-Python twin
:class:`llmsched.reference.sim_kv.ReferenceKvCache` as its oracle (``native=False``).

Both have the same methods: ``lookup, start, allocate, commit, free, set_decoding,
decode_capacity, advance_decoding, take_events, usage, tokens_of, blocks_of`` and the
``free_blocks`` / ``cached_blocks`` counts. Hash arguments are numpy ``uint64`` arrays.

>>> import numpy as np
>>> kv = make_kv_cache(num_blocks=8, block_size=4)
>>> kv.start(1, np.array([5, 6], dtype=np.uint64), 1), kv.allocate(1, 8), kv.usage()
(0, True, 0.25)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched.errors import ConfigError
from llmsched.reference.sim_kv import ReferenceKvCache
from llmsched.types import KVCacheEvent

__all__ = ["KVCache", "KVCacheEvent", "make_kv_cache"]


class KVCache(Protocol):
    """What a replica needs of its KV cache (the native ``KvCache`` and its twin both are one).

    Requests are ints; hash chains are numpy ``uint64`` arrays.
    """

    @property
    def num_blocks(self) -> int:
        """Blocks in the cache."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds (cached or empty)."""
        ...

    @property
    def cached_blocks(self) -> int:
        """Blocks that hold a content hash (in use or free)."""
        ...

    def usage(self) -> float:
        """Fraction of blocks in use."""
        ...

    def requests(self) -> int:
        """Requests holding blocks."""
        ...

    def lookup(self, hashes: npt.NDArray[np.uint64], max_blocks: int | None = None) -> int:
        """Leading blocks of ``hashes`` that are cached (at most ``max_blocks``)."""
        ...

    def tokens_of(self, req: int) -> int:
        """Tokens ``req`` has room for."""
        ...

    def blocks_of(self, req: int) -> int:
        """Blocks ``req`` holds."""
        ...

    def start(self, req: int, hashes: npt.NDArray[np.uint64], max_blocks: int) -> int:
        """Take the cached leading blocks of ``req``'s chain; returns how many."""
        ...

    def allocate(self, req: int, tokens: int) -> bool:
        """Grow ``req`` to hold ``tokens`` (all or nothing)."""
        ...

    def commit(self, req: int, hashes: npt.NDArray[np.uint64], upto: int) -> None:
        """Give ``req``'s first ``upto`` full blocks their hashes."""
        ...

    def free(self, req: int) -> None:
        """Drop ``req``'s references."""
        ...

    def set_decoding(self, req: int, decoding: bool) -> None:
        """Count ``req`` among the decoding requests (or not)."""
        ...

    def decode_capacity(self, limit: int) -> int:
        """Decode steps (up to ``limit``) that fit in the free blocks."""
        ...

    def advance_decoding(self, steps: int) -> bool:
        """Allocate ``steps`` decode steps for every decoding request."""
        ...

    def take_events(self) -> list[KVCacheEvent]:
        """The stored / removed events since the last call, in order."""
        ...


def make_kv_cache(num_blocks: int, block_size: int, *, native: bool = True) -> KVCache:
    """A KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**32 - 1:
            raise ConfigError(f"{name} must be an int in 1..2**32-2, got {value!r}")
    if native:
        return _llmsched.KvCache(num_blocks, block_size)
    return ReferenceKvCache(num_blocks, block_size)
