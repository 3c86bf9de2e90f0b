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

from typing import Any

from llmsched import _llmsched
from llmsched.errors import ConfigError
from llmsched.reference.sim_kv import ReferenceKvCache

__all__ = ["make_kv_cache"]


def make_kv_cache(num_blocks: int, block_size: int, *, native: bool = True) -> Any:
    """A KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**32 - 1:
            raise ConfigError(f"{name} must be an int in 1..2**32-2, got {value!r}")
    if native:
        return _llmsched.KvCache(num_blocks, block_size)
    return ReferenceKvCache(num_blocks, block_size)
