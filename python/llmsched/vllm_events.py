"""Decoding vLLM KV-cache event payloads (a debug view of what the prefix index consumes).

vLLM publishes each engine step's cache changes over ZMQ as ``[topic, seq, payload]``; the
payload is a msgpack ``EventBatch``, ``[ts, events, dp_rank]``. Events come array-encoded
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
...]``, vLLM <= 0.23) or map-encoded (``{"type": "BlockStored", ...}``, vLLM >= 0.24); both are
accepted, also mixed in one batch. The decoder is written in Rust and is the one
``PrefixIndex.apply_vllm_events`` uses; :func:`decode_vllm_events` shows its result as plain
Python data.

Decisions worth knowing (the Rust module ``vllm_events`` documents all of them):

* unknown event types are skipped and counted in ``unknown_events``; unknown fields are ignored;
* block hashes become unsigned 64-bit ints: an int hash as its u64 bits, a bytes hash as its last
  8 bytes read big-endian (vLLM's int form of the same digest), so both forms agree;
* ``medium`` nil or absent means ``"GPU"``; names are matched ignoring ASCII case;
* ``len(token_ids)`` must be ``len(block_hashes) * block_size``; token ids must fit 0..2**32-1;
* ``has_extra_keys`` holds one flag per block (empty when the event sends no ``extra_keys``):
  such a block's cache content depends on more than its tokens (images, LoRA, cache salt);
  ``cache_salt`` is the salt vLLM hashed into a root event's first block (its one string key
  beside the LoRA name), and ``opaque_extra_keys`` is true when any key is more than the LoRA
  name and that salt: the index skips such events. ``content_extra_keys`` (implying it) is true
  when a key is not a string (multimodal inputs' ``(identifier, offset)`` pairs,
  prompt-embedding digests): the index counts those apart (``multimodal``) from strings it
  cannot explain (``extra_keys``);
* a malformed payload raises :class:`~llmsched.errors.MalformedEventError` naming the byte offset;
  hostile declared lengths or nesting cannot make the decoder allocate beyond the payload's size.

>>> import msgpack
>>> payload = msgpack.packb([1.5, [["BlockRemoved", [7], "CPU"], {"type": "Unknown"}], 0])
>>> decode_vllm_events(payload)
{'ts': 1.5, 'events': [{'type': 'BlockRemoved', 'block_hashes': [7], 'medium': 'CPU', 'group_idx': None}], 'dp_rank': 0, 'unknown_events': 1}
"""  # noqa: E501

from __future__ import annotations

from llmsched import _llmsched
from llmsched.errors import InvalidTypeError
from llmsched.types import EventBatchDict

__all__ = ["decode_vllm_events"]


def decode_vllm_events(payload: bytes | bytearray | memoryview) -> EventBatchDict:
    """Decode one vLLM KV-event ``EventBatch`` payload (the third ZMQ frame) to a dict.

    The result (an :class:`~llmsched.types.EventBatchDict`) has ``ts`` (float), ``dp_rank``
    (int or None), ``unknown_events`` (int) and ``events``: dicts tagged by ``type``. A
    ``BlockStored`` dict holds ``block_hashes``, ``parent_block_hash``, ``token_ids``,
    ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``has_extra_keys``, ``cache_salt``,
    ``opaque_extra_keys``, ``content_extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window``; a ``BlockRemoved`` dict
    ``block_hashes``, ``medium`` and ``group_idx``; an ``AllBlocksCleared`` dict only its type.

    Raises :class:`~llmsched.errors.MalformedEventError` (a ``ValueError``) when the payload is
    not a well-formed batch, and :class:`~llmsched.errors.InvalidTypeError` (a ``TypeError``) when
    it is not bytes-like.

    >>> import msgpack
    >>> event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
    ...          "token_ids": [5, 6], "block_size": 2}
    >>> batch = decode_vllm_events(msgpack.packb([0.0, [event], None]))
    >>> stored = batch["events"][0]
    >>> stored["token_ids"], stored["medium"], stored["has_extra_keys"]
    ([5, 6], 'GPU', [])
    """
    if isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    if not isinstance(payload, bytes):
        raise InvalidTypeError(
            f"payload must be bytes, bytearray or memoryview, not {type(payload).__name__}"
        )
    return _llmsched.decode_vllm_events(payload)
