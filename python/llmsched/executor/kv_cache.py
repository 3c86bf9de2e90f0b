"""A paged KV cache with prefix caching and LRU eviction, in the manner of vLLM V1.

Blocks hold ``block_size`` tokens' keys and values (the tensors live in
:class:`~llmsched.executor.model.PagedKV`). Each request owns a block table. A block becomes a
*cached* block once it is full and computed: it is then keyed by its chained block hash
(:func:`llmsched.hashing.block_hashes`, xxh3, chained from the engine's ``hash_seed``), so a
later request whose prompt starts with the same tokens reuses it instead of recomputing.

Free blocks wait in one queue, front evicted first. A freed block without a hash goes to the
front (nothing to lose); a freed cached block goes to the back, so unused cached blocks are
evicted least recently used first, and a request's blocks are freed tail first so its deeper
blocks go before its shared prefix. Allocating a cached block evicts its hash.

Every change to the set of cached blocks is recorded as a vLLM KV event (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``); :meth:`BlockPool.take_events` hands them out.

At most one block is cached per hash: when two requests compute the same block at the same
time, the second copy stays uncached, so a ``BlockRemoved`` always means the content is gone.

>>> pool = BlockPool(num_blocks=4, block_size=2)
>>> blocks = pool.allocate(2)
>>> pool.cache(blocks, [11, 22], None, [1, 2, 3, 4])
>>> pool.free(blocks)
>>> pool.find_prefix([11, 22, 33])
[0, 1]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError
from llmsched.executor.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from llmsched.hashing import block_hashes

__all__ = ["BlockPool", "CachedBlock", "KVCacheManager", "NoFreeBlocksError"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free (the caller preempts and retries)."""


@dataclass(frozen=True)
class CachedBlock:
    """What the cache holds under one hash: the block id, its parent's hash and its tokens."""

    block_id: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class BlockPool:
    """Block allocation, reference counts, the hash -> block map and the eviction queue.

    Algorithm: an ordered dict is the free queue (O(1) pop-front, append, remove); a dict maps
    hash -> cached block. Allocation, free, touch and cache are O(blocks involved).
    """

    def __init__(self, num_blocks: int, block_size: int, medium: str = "GPU") -> None:
        for name, size in (("num_blocks", num_blocks), ("block_size", block_size)):
            # 2.5 and "4" were bare TypeErrors, True a pool of one block.
            if not _is_int(size) or size < 1:
                raise ConfigError(f"{name} must be a positive int, got {size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, CachedBlock] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached or empty)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_blocks

    def find_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest run of ``hashes`` (from the first) that is cached."""
        found: list[int] = []
        for block_hash in hashes:
            cached = self.cached.get(block_hash)
            if cached is None:
                break
            found.append(cached.block_id)
        return found

    def _block_ids(self, blocks: Sequence[int], what: str) -> list[int]:
        """``blocks`` as ids of this pool, or an InvalidValueError naming the first that is
        not one (a negative id indexed the tables from their end)."""
        ids = []
        for block in blocks:
            if (
                isinstance(block, (bool, np.bool_))
                or not isinstance(block, (int, np.integer))
                or not 0 <= block < self.num_blocks
            ):
                raise InvalidValueError(
                    f"{what}: {block!r} is not a block of this pool (0..{self.num_blocks - 1})"
                )
            ids.append(int(block))
        return ids

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`find_prefix`.

        Block ids outside the pool are an InvalidValueError, and nothing is taken.
        """
        blocks = self._block_ids(blocks, "touch")
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks from the front of the free queue, evicting their hashes.

        ``count`` is an int >= 0 (InvalidTypeError, InvalidValueError: -1 gave no block
        without a word, True one block).
        """
        if not _is_int(count):
            raise InvalidTypeError(f"count must be an int, got {type(count).__name__}")
        if count < 0:
            raise InvalidValueError(f"count must be an int >= 0, got {count}")
        if count > self.num_free:
            raise NoFreeBlocksError(f"need {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is None:
            return
        self.block_hash[block] = None
        del self.cached[block_hash]
        self._events.append(BlockRemoved((block_hash,), self.medium))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, last block first.

        A block outside the pool, or freed more often than it is referenced, is an
        InvalidValueError, and nothing is freed (the check comes first: it used to leave the
        blocks before it freed and the count at -1, a block then handed out twice).
        """
        blocks = self._block_ids(blocks, "free")
        frees: dict[int, int] = {}
        for block in blocks:
            frees[block] = frees.get(block, 0) + 1
        for block, count in frees.items():
            if count > self.ref_count[block]:
                raise InvalidValueError(
                    f"block {block} freed {count} time(s), referenced {self.ref_count[block]}"
                )
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """Register full, computed ``blocks`` under ``hashes`` (chained after ``parent_hash``).

        ``blocks`` are blocks of this pool a request holds, one hash each, and ``token_ids``
        their ``len(blocks) * block_size`` tokens; anything else is an InvalidValueError and
        nothing changes (a block outside the pool or a hash missing cached the blocks before
        it, with no event, before a bare IndexError or ValueError; -1 was cached as block -1;
        too few tokens published a ``BlockStored`` of a partial block; a free block was cached
        at the front of the eviction queue).

        Blocks already cached, and blocks whose hash another block holds, are skipped; each run
        of newly cached blocks becomes one ``BlockStored`` event.
        """
        size = self.block_size
        blocks = self._block_ids(blocks, "cache")
        if len(hashes) != len(blocks):
            raise InvalidValueError(
                f"cache: {len(blocks)} blocks, {len(hashes)} hashes; give one hash per block"
            )
        if len(token_ids) != len(blocks) * size:
            raise InvalidValueError(
                f"cache: {len(blocks)} blocks of {size} tokens need {len(blocks) * size} token "
                f"ids, got {len(token_ids)}"
            )
        for block in blocks:
            if self.ref_count[block] == 0:
                raise InvalidValueError(
                    f"cache: block {block} is not held by any request (only computed blocks "
                    "are cached)"
                )
        run: list[int] = []
        run_parent = parent_hash
        parent = parent_hash
        for index, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            fresh = self.block_hash[block] is None and block_hash not in self.cached
            if fresh:
                tokens = tuple(token_ids[index * size : (index + 1) * size])
                self.block_hash[block] = block_hash
                self.cached[block_hash] = CachedBlock(block, parent, tokens)
                if not run:
                    run_parent = parent
                run.append(index)
            elif run:
                self._emit_stored(run, hashes, run_parent, token_ids)
                run = []
            parent = block_hash
        if run:
            self._emit_stored(run, hashes, run_parent, token_ids)

    def _emit_stored(
        self,
        run: list[int],
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
    ) -> None:
        size = self.block_size
        tokens = tuple(token_ids[run[0] * size : (run[-1] + 1) * size])
        stored = tuple(int(hashes[i]) for i in run)
        self._events.append(BlockStored(stored, parent, tokens, size, self.medium))

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if any(self.ref_count):
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call."""
        events, self._events = self._events, []
        return events


@dataclass
class _RequestBlocks:
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_cached: int = 0


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`, with prefix-cache lookups.

    >>> kvm = KVCacheManager(num_blocks=8, block_size=4)
    >>> kvm.lookup("a", list(range(10)))
    0
    >>> kvm.allocate("a", 10)
    True
    >>> kvm.block_table("a")
    [0, 1, 2]
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        medium: str = "GPU",
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, medium)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._requests: dict[str, _RequestBlocks] = {}

    def _state(self, request_id: str) -> _RequestBlocks:
        return self._requests.setdefault(request_id, _RequestBlocks())

    def _extend_hashes(self, state: _RequestBlocks, token_ids: Sequence[int], upto: int) -> None:
        """Hash full blocks of ``token_ids[:upto]`` not hashed yet (continuing the chain)."""
        size = self.block_size
        full = upto // size
        done = len(state.hashes)
        if full <= done:
            return
        parent = state.hashes[-1] if state.hashes else self.hash_seed
        new = np.asarray(token_ids[done * size : full * size], dtype=np.int64)
        state.hashes.extend(int(h) for h in block_hashes(new, size, seed=parent))

    def _cached_prefix(self, state: _RequestBlocks, token_ids: Sequence[int]) -> list[int]:
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        limit = (len(token_ids) - 1) // self.block_size * self.block_size
        self._extend_hashes(state, token_ids, limit)
        return self.pool.find_prefix(state.hashes[: limit // self.block_size])

    def peek(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Tokens :meth:`lookup` would find cached now, taking no reference (so the LRU order
        is unchanged); the request's block hashes are kept for the lookup."""
        state = self._state(request_id)
        if state.blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        return len(self._cached_prefix(state, token_ids)) * self.block_size

    def can_admit(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether :meth:`lookup` then :meth:`allocate` of ``num_tokens`` would succeed now.

        Takes nothing. As vLLM counts them, cached prefix blocks no request holds are taken
        out of the free queue by the lookup, so they count against the free blocks too.
        """
        state = self._state(request_id)
        if state.blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(state, token_ids)
        idle_hits = sum(1 for block in hits if self.pool.ref_count[block] == 0)
        needed = max(-(-num_tokens // self.block_size) - len(hits), 0)
        return needed + idle_hits <= self.pool.num_free

    def lookup(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Take the longest cached prefix of a request with no blocks yet; tokens it covers.

        The last token is always left to compute (its logits are needed), as vLLM does.
        Taking a reference moves the blocks out of the LRU queue (they go back to its end when
        freed); check with :meth:`can_admit` first, as the engine does, so that a request
        which then cannot be allocated leaves the eviction order alone, as in vLLM.
        """
        state = self._state(request_id)
        if state.blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(state, token_ids)
        self.pool.touch(hits)
        state.blocks = hits
        state.num_cached = len(hits)
        return len(hits) * self.block_size

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens``; False (nothing taken) if short."""
        state = self._state(request_id)
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        state.blocks.extend(self.pool.allocate(needed))
        return True

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed now."""
        held = len(self._requests[request_id].blocks) if request_id in self._requests else 0
        return -(-num_tokens // self.block_size) - held <= self.pool.num_free

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Cache the request's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        state = self._requests[request_id]
        full = num_computed // self.block_size
        if full <= state.num_cached:
            return
        self._extend_hashes(state, token_ids, full * self.block_size)
        start, size = state.num_cached, self.block_size
        parent = state.hashes[start - 1] if start else None
        self.pool.cache(
            state.blocks[start:full],
            state.hashes[start:full],
            parent,
            token_ids[start * size : full * size],
        )
        state.num_cached = full

    def free(self, request_id: str) -> None:
        """Release the request's blocks (cached ones stay cached until evicted)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free(state.blocks)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in position order."""
        return list(self._requests[request_id].blocks) if request_id in self._requests else []
