"""Pure-Python twin of :class:`llmsched.PrefixIndex`: one dict per worker, no tree.

It defines the index's semantics in the plainest terms and is the oracle of the property tests:

- Holdings are per (worker, block): tiers, confirmed or approximate (with an expiry), and a
  recency stamp. Each worker's holdings are prefix-closed.
- A store or record touches the whole path from the root to its last block: every block on it
  gets the operation's stamp.
- Eviction for a worker's capacity removes, one block at a time, the worker's leaf (a held block
  with no held child) with the oldest stamp.
- A match counts, per worker, the leading blocks held and not expired (overall and per tier).

>>> from llmsched.reference.prefix_index import ReferencePrefixIndex
>>> ref = ReferencePrefixIndex(block_size=2)
>>> ref.store("a", [11, 12])
2
>>> ref.match([11, 12, 13])
{'a': (2, 2, 0, 0)}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmsched.errors import (
    ConfigError,
    HashChainError,
    UnknownBlockError,
    UnknownWorkerError,
)
from llmsched.reference.hashing import block_hashes, namespace_seed

TIERS = ("gpu", "cpu", "storage")
_MISSING = object()


@dataclass
class Holding:
    """One worker's holding of one block."""

    tiers: set[str]
    confirmed: bool
    expires: float
    stamp: int = 0


@dataclass
class ReferencePrefixIndex:
    """The naive twin. Same constructor and method names as the native index."""

    block_size: int = 16
    seed: int = 0
    model: str | None = None
    worker_capacity: int | None = None
    parent_of: dict[int, int | None] = field(default_factory=dict)
    held: dict[object, dict[int, Holding]] = field(default_factory=dict)
    capacity: dict[object, int | None] = field(default_factory=dict)
    engine: dict[object, dict[int, tuple[int, int, int]]] = field(default_factory=dict)
    stamp: int = 0

    # -- hashing ------------------------------------------------------------------------------

    def chain_seed(self, lora: str | None = None, cache_salt: str | None = None) -> int:
        """Chain seed of this index's namespace."""
        return namespace_seed(self.seed, model=self.model, lora=lora, cache_salt=cache_salt)

    def hash_tokens(
        self, tokens: Sequence[int], lora: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Chained block hashes of ``tokens``."""
        return block_hashes(list(tokens), self.block_size, self.chain_seed(lora, cache_salt))

    # -- writes -------------------------------------------------------------------------------

    def store(
        self,
        worker: object,
        hashes: Sequence[int],
        parent: int | None = None,
        tier: str = "gpu",
        *,
        confirmed: bool = True,
        expires: float = math.inf,
    ) -> int:
        """Same contract as :meth:`llmsched.PrefixIndex.store`."""
        hashes = [int(h) for h in hashes]
        mine = self.held.get(worker, {})
        if parent is not None:
            if parent not in self.parent_of:
                raise UnknownBlockError(f"parent block {parent:#018x} is not in the index")
            if parent not in mine:
                raise UnknownBlockError(f"worker does not hold parent block {parent:#018x}")
        pending: dict[int, int | None] = {}
        prev = parent
        for h in hashes:
            known = self.parent_of.get(h, pending.get(h, _MISSING))
            if known is _MISSING:
                pending[h] = prev
            elif known != prev:
                raise HashChainError(f"block {h:#018x} is already at another position")
            prev = h
        mine = self.held.setdefault(worker, mine)
        self.capacity.setdefault(worker, self.worker_capacity)
        self.engine.setdefault(worker, {})
        if not hashes:
            return 0
        self.stamp += 1
        added = 0
        prev = parent
        for h in hashes:
            self.parent_of.setdefault(h, prev)
            old = mine.get(h)
            if old is None:
                mine[h] = Holding({tier}, confirmed, math.inf if confirmed else expires)
                added += 1
            else:
                old.tiers.add(tier)
                old.confirmed = old.confirmed or confirmed
                old.expires = math.inf if old.confirmed else max(old.expires, expires)
            prev = h
        self._touch_path(worker, hashes[-1], confirmed)
        self._enforce_capacity(worker)
        return added

    def record(self, worker: object, hashes: Sequence[int], ttl_s: float, now: float) -> int:
        """Same contract as :meth:`llmsched.PrefixIndex.record`."""
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl must be a positive finite number of seconds, got {ttl_s}")
        return self.store(worker, hashes, None, "gpu", confirmed=False, expires=now + ttl_s)

    def remove(self, worker: object, hashes: Sequence[int], tier: str | None = None) -> int:
        """Same contract as :meth:`llmsched.PrefixIndex.remove`."""
        mine = self._known(worker)
        hashes = [int(h) for h in hashes]
        for h in hashes:
            if h not in mine:
                raise UnknownBlockError(f"worker does not hold block {h:#018x}")
        dropped = 0
        for h in hashes:
            holding = mine.get(h)
            if holding is None:
                continue
            if tier is None:
                holding.tiers.clear()
            else:
                holding.tiers.discard(tier)
            if not holding.tiers:
                dropped += self._drop_from(worker, h)
        return dropped

    def clear(self, worker: object) -> int:
        """Drop everything ``worker`` holds."""
        mine = self._known(worker)
        self.engine[worker] = {}
        dropped = len(mine)
        for h in list(mine):
            del mine[h]
            self._forget_if_unheld(h)
        return dropped

    def remove_worker(self, worker: object) -> int:
        """Drop everything ``worker`` holds and forget it."""
        dropped = self.clear(worker)
        del self.held[worker]
        del self.capacity[worker]
        del self.engine[worker]
        return dropped

    def set_capacity(self, worker: object, blocks: int | None) -> int:
        """Set a worker's capacity; returns blocks evicted."""
        if blocks is not None and blocks < 1:
            raise ConfigError("capacity must be at least 1 block")
        self.held.setdefault(worker, {})
        self.engine.setdefault(worker, {})
        self.capacity[worker] = blocks
        return self._enforce_capacity(worker)

    def expire(self, now: float) -> int:
        """Drop approximate holdings expired at ``now``."""
        dropped = 0
        for worker, mine in self.held.items():
            for h in [h for h, x in mine.items() if x.expires <= now]:
                if h in mine:
                    dropped += self._drop_from(worker, h)
        return dropped

    # -- reads --------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], now: float = 0.0) -> dict[object, tuple[int, ...]]:
        """``{worker: (blocks, gpu, cpu, storage)}`` for workers with a leading block."""
        out: dict[object, tuple[int, ...]] = {}
        for worker, mine in self.held.items():
            counts = [0, 0, 0, 0]
            alive = [True, True, True, True]
            prev: int | None = None
            for h in map(int, hashes):
                x = mine.get(h)
                if x is None or x.expires <= now or self.parent_of[h] != prev:
                    break
                prev = h
                for k, ok in enumerate((True, *(t in x.tiers for t in TIERS))):
                    alive[k] = alive[k] and ok
                    counts[k] += alive[k]
            if counts[0]:
                out[worker] = tuple(counts)
        return out

    def tree_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` present in the index at all."""
        prev = None
        for i, h in enumerate(hashes):
            if self.parent_of.get(int(h), _MISSING) != prev:
                return i
            prev = int(h)
        return len(hashes)

    def holdings(self, worker: object) -> dict[int, tuple[list[str], bool]]:
        """``{hash: (tiers, confirmed)}``, tiers in gpu, cpu, storage order."""
        mine = self._known(worker)
        return {h: ([t for t in TIERS if t in x.tiers], x.confirmed) for h, x in mine.items()}

    def workers(self) -> list[object]:
        """Registered workers."""
        return list(self.held)

    # -- internals ----------------------------------------------------------------------------

    def _known(self, worker: object) -> dict[int, Holding]:
        if worker not in self.held:
            raise UnknownWorkerError(f"unknown worker {worker!r}")
        return self.held[worker]

    def _touch_path(self, worker: object, last: int, confirm: bool) -> None:
        mine = self.held[worker]
        h: int | None = last
        while h is not None:
            x = mine[h]
            x.stamp = self.stamp
            if confirm:
                x.confirmed = True
                x.expires = math.inf
            h = self.parent_of[h]

    def _descendants(self, worker: object, top: int) -> list[int]:
        mine = self.held[worker]
        out = []
        for h in mine:
            cur: int | None = h
            while cur is not None and cur != top:
                cur = self.parent_of[cur]
            if cur == top:
                out.append(h)
        return out

    def _drop_from(self, worker: object, top: int) -> int:
        mine = self.held[worker]
        gone = self._descendants(worker, top)
        for h in gone:
            del mine[h]
        for h in gone:
            self._forget_if_unheld(h)
        return len(gone)

    def _forget_if_unheld(self, h: int) -> None:
        if not any(h in mine for mine in self.held.values()):
            self.parent_of.pop(h, None)

    def _enforce_capacity(self, worker: object) -> int:
        cap = self.capacity.get(worker)
        mine = self.held[worker]
        evicted = 0
        while cap is not None and len(mine) > cap:
            parents = {self.parent_of[h] for h in mine}
            leaves = [h for h in mine if h not in parents]
            victim = min(leaves, key=lambda h: mine[h].stamp)
            del mine[victim]
            self._forget_if_unheld(victim)
            evicted += 1
        return evicted
