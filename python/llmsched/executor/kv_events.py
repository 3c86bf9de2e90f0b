"""KV-cache events in vLLM's wire format (vLLM's ``vllm/distributed/kv_events.py``).

An ``EventBatch`` payload is msgpack ``[ts, [events...], dp_rank]``; events are maps tagged by
``"type"`` as vLLM >= 0.24 sends them. ``BlockStored`` carries the fields of vLLM 0.11 plus
``lora_name`` in this order: ``type, block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name`` -- byte for byte what ``vectors/vllm_kv_events.json`` holds.

>>> payload = encode_event_batch(1.5, [AllBlocksCleared()], 0)
>>> decode_event_batch(payload)
(1.5, [{'type': 'AllBlocksCleared'}], 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmsched._extras import require

require("executor", "msgpack", feature="llmsched.executor")

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "decode_event_batch",
    "encode_event_batch",
]


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache; ``token_ids`` holds all their tokens in order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = "GPU"
    lora_id: int | None = None
    lora_name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The vLLM map encoding (field order as vLLM declares it)."""
        return {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted)."""

    block_hashes: tuple[int, ...]
    medium: str = "GPU"

    def to_wire(self) -> dict[str, Any]:
        """The vLLM map encoding."""
        return {
            "type": "BlockRemoved",
            "block_hashes": list(self.block_hashes),
            "medium": self.medium,
        }


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    def to_wire(self) -> dict[str, Any]:
        """The vLLM map encoding."""
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event_batch(ts: float, events: Sequence[KVEvent], dp_rank: int | None) -> bytes:
    """One msgpack ``EventBatch`` payload (the third ZMQ frame vLLM publishes).

    Encoded as vLLM's msgspec encoder writes it: ``BlockStored`` (a struct of more than 15
    declared fields) always gets a 16-bit map header, smaller events a fixmap.

    >>> encode_event_batch(0.0, [], None).hex()
    '93cb000000000000000090c0'
    """
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_array_header(3), packer.pack(float(ts))]
    parts.append(packer.pack_array_header(len(events)))
    for event in events:
        fields = event.to_wire()
        if isinstance(event, BlockStored):
            parts.append(b"\xde" + len(fields).to_bytes(2, "big"))
        else:
            parts.append(packer.pack_map_header(len(fields)))
        for key, value in fields.items():
            parts.append(packer.pack(key))
            parts.append(packer.pack(value))
    parts.append(packer.pack(dp_rank))
    return b"".join(parts)


def decode_event_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Decode a map-encoded payload into ``(ts, events, dp_rank)`` (events as plain dicts).

    >>> decode_event_batch(encode_event_batch(2.0, [BlockRemoved((7,))], 1))[1]
    [{'type': 'BlockRemoved', 'block_hashes': [7], 'medium': 'GPU'}]
    """
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    return float(ts), list(events), dp_rank
