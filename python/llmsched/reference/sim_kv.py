"""Pure-Python twin of :class:`llmsched.sim.KvCache`: one replica's paged KV cache.

The semantics, in the plainest terms (vLLM V1's block pool with prefix caching, simplified):

- ``num_blocks`` blocks of ``block_size`` tokens. A block is *in use* (reference count > 0) or
  *free*; a free block may still be *cached*: it keeps its content hash and can be hit.
- Free blocks wait in one queue, least recently freed first. A request's blocks are freed last
  block first, so a chain's tail is evicted before its head; a free block without a hash goes
  to the front (reusing it loses nothing). Allocation pops the front; popping a cached block
  evicts it (a ``removed`` event).
- ``start`` takes a reference on the leading blocks of a request's hash chain that are cached
  (the prefix-cache hit, at most ``max_blocks``). ``allocate`` adds blocks until the request
  holds ``ceil(tokens / block_size)``; all or nothing. ``commit`` gives the request's full
  blocks their hashes (a ``stored`` event); a hash already cached elsewhere makes the request
  share that block and release its own copy, so cached content is never duplicated and every
  cached chain stays prefix-closed. ``free`` drops the request's references.
- Decoding requests grow by one token per step: ``decode_capacity`` is how many steps fit in the
  free blocks, ``advance_decoding`` allocates them.

Events come out of :meth:`take_events` in order: ``("stored", parent, hashes)`` and
``("removed", hashes)`` (roots of the evicted subtrees only), ready for
:meth:`llmsched.PrefixIndex.store` / ``remove``.

>>> kv = ReferenceKvCache(num_blocks=4, block_size=2)
>>> kv.start(1, [10, 11], max_blocks=1), kv.allocate(1, 4)
(0, True)
>>> kv.commit(1, [10, 11], 2); kv.free(1); kv.start(2, [10, 11, 12], max_blocks=3)
2
>>> kv.take_events()
[('stored', None, [10, 11])]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from llmsched.errors import ConfigError, DuplicateRequestError, UnknownRequestError
from llmsched.types import KVCacheEvent

__all__ = ["ReferenceKvCache"]


HashChain = Sequence[int] | npt.NDArray[np.uint64]
"""A request's block hashes: a list of ints or a numpy ``uint64`` array."""


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0
    committed: int = 0
    decoding: bool = False


class ReferenceKvCache:
    """One replica's paged KV cache with prefix caching (see the module docs)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ConfigError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._requests: dict[int, _Request] = {}
        self._events: list[tuple[Any, ...]] = []

    # -- queries ---------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks not in use (cached or empty)."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks with a hash (in use or free)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, hashes: HashChain, max_blocks: int | None = None) -> int:
        """Leading blocks of ``hashes`` that are cached (at most ``max_blocks``)."""
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        n = 0
        while n < limit and int(hashes[n]) in self._cached:
            n += 1
        return n

    def blocks_of(self, req: int) -> int:
        """Blocks ``req`` holds."""
        return len(self._get(req).blocks)

    def tokens_of(self, req: int) -> int:
        """Tokens ``req`` has room for."""
        return self._get(req).tokens

    def requests(self) -> int:
        """Requests holding blocks."""
        return len(self._requests)

    # -- request life cycle ----------------------------------------------------------------

    def start(self, req: int, hashes: HashChain, max_blocks: int) -> int:
        """Register ``req`` and take its prefix-cache hit; returns the blocks hit."""
        if req in self._requests:
            raise DuplicateRequestError(f"request {req} is already started")
        hit = self.lookup(hashes, max_blocks)
        state = _Request()
        for h in hashes[:hit]:
            block = self._cached[int(h)]
            self._ref(block)
            state.blocks.append(block)
        state.tokens = hit * self.block_size
        state.committed = hit
        self._requests[req] = state
        return hit

    def allocate(self, req: int, tokens: int) -> bool:
        """Give ``req`` room for ``tokens`` tokens; False (and no change) if blocks run out."""
        state = self._get(req)
        need = -(-tokens // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            state.blocks.append(self._pop_free())
        state.tokens = max(state.tokens, tokens)
        return True

    def commit(self, req: int, hashes: HashChain, upto: int) -> None:
        """Cache ``req``'s blocks ``[committed, upto)`` under ``hashes`` (full blocks only)."""
        state = self._get(req)
        stop = min(upto, len(state.blocks), len(hashes), state.tokens // self.block_size)
        run: list[int] = []
        run_parent: int | None = None
        for i in range(state.committed, stop):
            h = int(hashes[i])
            other = self._cached.get(h)
            if other is not None and other != state.blocks[i]:
                self._flush(run_parent, run)
                run = []
                self._ref(other)
                self._unref(state.blocks[i])
                state.blocks[i] = other
            elif other is None:
                if not run:
                    run_parent = int(hashes[i - 1]) if i > 0 else None
                self._hash[state.blocks[i]] = h
                self._parent[state.blocks[i]] = int(hashes[i - 1]) if i > 0 else None
                self._cached[h] = state.blocks[i]
                run.append(h)
        self._flush(run_parent, run)
        state.committed = max(state.committed, stop)

    def free(self, req: int) -> None:
        """Drop ``req``'s references, last block first."""
        state = self._requests.pop(req, None)
        if state is None:
            raise UnknownRequestError(f"request {req} holds no blocks")
        for block in reversed(state.blocks):
            self._unref(block)

    def set_decoding(self, req: int, decoding: bool) -> None:
        """Mark ``req`` as growing one token per decode step (or not)."""
        self._get(req).decoding = decoding

    def decode_capacity(self, limit: int) -> int:
        """The most decode steps (at most ``limit``) whose new blocks fit in the free blocks."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._decode_need(mid) <= len(self._free):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance_decoding(self, steps: int) -> bool:
        """Grow every decoding request by ``steps`` tokens; False (and no change) if it does
        not fit."""
        if self._decode_need(steps) > len(self._free):
            return False
        for state in self._requests.values():
            if state.decoding:
                state.tokens += steps
                while len(state.blocks) * self.block_size < state.tokens:
                    state.blocks.append(self._pop_free())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The stored/removed events since the last call, in order. A removal lists only blocks
        whose parent was not removed with them (dropping a block from a prefix index drops
        everything below it)."""
        events, self._events = self._events, []
        out: list[KVCacheEvent] = []
        for event in events:
            if event[0] == "removed":
                gone = {h for h, _ in event[1]}
                out.append(("removed", [h for h, p in event[1] if p is None or p not in gone]))
            else:
                out.append(event)
        return out

    # -- internals -------------------------------------------------------------------------

    def _get(self, req: int) -> _Request:
        state = self._requests.get(req)
        if state is None:
            raise UnknownRequestError(f"request {req} holds no blocks")
        return state

    def _decode_need(self, steps: int) -> int:
        bs = self.block_size
        return sum(
            max(0, -(-(s.tokens + steps) // bs) - len(s.blocks))
            for s in self._requests.values()
            if s.decoding
        )

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None
            if self._hash[block] is None:
                self._free.move_to_end(block, last=False)

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None
            removed = (h, self._parent[block])
            if self._events and self._events[-1][0] == "removed":
                self._events[-1][1].append(removed)
            else:
                self._events.append(("removed", [removed]))
        self._refs[block] = 1
        return block

    def _flush(self, parent: int | None, run: list[int]) -> None:
        if run:
            self._events.append(("stored", parent, run))
