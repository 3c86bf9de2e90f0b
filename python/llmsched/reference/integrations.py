"""Pure-Python twin of the KV-event subscriber's work: decode each payload into Python objects
(:mod:`llmsched.reference.vllm_events`) and apply them event by event to a
:class:`~llmsched.reference.prefix_index.ReferencePrefixIndex`.

It is the benchmark baseline of :class:`llmsched.integrations.KVEventSubscriber` (which hands
the payload bytes to the native index in one call) and an oracle for simple scripts: plain
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events of group 0 with no extra keys,
engine block sizes a multiple of the index's.

>>> import msgpack
>>> from llmsched.reference.prefix_index import ReferencePrefixIndex
>>> applier = ReferenceEventApplier(ReferencePrefixIndex(block_size=2))
>>> ev = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None,
...       "token_ids": [1, 2, 3, 4], "block_size": 4}
>>> applier.apply("w", msgpack.packb([0.0, [ev], None]))
2
>>> applier.index.match(applier.index.hash_tokens([1, 2, 3, 4]))
{'w': (2, 2, 0, 0)}
"""

from __future__ import annotations

from typing import Any

from llmsched.errors import UnknownBlockError
from llmsched.reference.hashing import block_hashes
from llmsched.reference.prefix_index import ReferencePrefixIndex
from llmsched.reference.vllm_events import decode_vllm_events

__all__ = ["ReferenceEventApplier"]


class ReferenceEventApplier:
    """Applies vLLM ``EventBatch`` payloads to a reference index, keeping per worker the map
    from the engine's block hash to the index's hashes of that block's sub-blocks."""

    def __init__(self, index: ReferencePrefixIndex) -> None:
        self.index = index
        self.blocks: dict[object, dict[int, list[int]]] = {}

    def apply(self, worker: object, payload: bytes) -> int:
        """Decode ``payload`` and apply its events for ``worker``; returns blocks stored."""
        stored = 0
        mine = self.blocks.setdefault(worker, {})
        for event in decode_vllm_events(payload)["events"]:
            kind = event["type"]
            if kind == "BlockStored":
                stored += self._store(worker, mine, event)
            elif kind == "BlockRemoved":
                self._remove(worker, mine, event)
            elif kind == "AllBlocksCleared" and worker in self.index.held:
                self.index.clear(worker)
                mine.clear()
        return stored

    def _store(self, worker: object, mine: dict[int, list[int]], event: dict[str, Any]) -> int:
        parent = event["parent_block_hash"]
        if parent is not None and parent not in mine:
            return 0  # its parent was never seen: skipped, as the native index does
        if event["opaque_extra_keys"]:
            return 0  # its blocks' content is more than their tokens, as the native index says
        if event["lora_name"] is None and event["lora_id"] not in (None, 0):
            return 0  # an adapter named only by its number: no request's hashes name it
        seed = (
            mine[parent][-1]
            if parent is not None
            else self.index.chain_seed(event["lora_name"], event["cache_salt"])
        )
        ours = block_hashes(event["token_ids"], self.index.block_size, seed)
        per_block = event["block_size"] // self.index.block_size
        tier = event["medium"].lower()
        stored = self.index.store(worker, ours, None if parent is None else seed, tier)
        for i, engine_hash in enumerate(event["block_hashes"]):
            mine[engine_hash] = ours[i * per_block : (i + 1) * per_block]
        return stored

    def _remove(self, worker: object, mine: dict[int, list[int]], event: dict[str, Any]) -> None:
        for engine_hash in event["block_hashes"]:
            ours = mine.pop(engine_hash, None)
            if ours is None:
                continue
            try:
                self.index.remove(worker, ours[:1], event["medium"].lower())
            except UnknownBlockError:
                continue  # already dropped with an ancestor
