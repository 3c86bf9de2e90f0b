"""Pure-Python twin of :mod:`llmsched.hashing`: every algorithm, written the obvious way.

It uses ``xxhash``, ``cbor2`` and ``hashlib`` directly and serves as the oracle of the property
tests and the baseline of the benchmarks.

>>> from llmsched.reference.hashing import block_hashes, vllm_block_hashes
>>> len(block_hashes(list(range(32)), 16))
2
>>> vllm_block_hashes(list(range(32)), 16)[1]
17911472383915781900
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from llmsched._extras import require

require("test", "xxhash", "cbor2", feature="llmsched.reference.hashing")

import cbor2
import xxhash

from llmsched.errors import InvalidTokenError

VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def check_tokens(tokens: Sequence[int]) -> None:
    """Raise InvalidTokenError for the first id outside 0..2**32-1."""
    for position, value in enumerate(tokens):
        if not 0 <= value <= 0xFFFFFFFF:
            raise InvalidTokenError(
                f"token id {value} at position {position} is out of range (0 to 4294967295)"
            )


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
    check_tokens(tokens)
    out: list[int] = []
    prev = chain_seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = int(xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=prev))
        out.append(prev)
    return out


def block_hashes_batch(
    prompts: Sequence[Sequence[int]], block_size: int = 16, chain_seed: int = 0
) -> list[list[int]]:
    """:func:`block_hashes` of each prompt."""
    return [block_hashes(p, block_size, chain_seed) for p in prompts]


def pack_text(text: str | bytes) -> list[int]:
    """UTF-8 bytes packed 4 per pseudo-token, little-endian, the last zero-padded."""
    raw = text.encode() if isinstance(text, str) else text
    raw += b"\0" * (-len(raw) % 4)
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


def text_block_hashes(
    text: str | bytes,
    block_size: int = 64,
    chain_seed: int = 0,
    include_partial: bool = True,
    max_tokens: int | None = 131_072,
) -> list[int]:
    """The xxh3 chain over packed text, plus the trailing partial block when asked."""
    tokens = pack_text(text)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    out = block_hashes(tokens, block_size, chain_seed)
    tail = tokens[len(out) * block_size :]
    if include_partial and tail:
        parent = out[-1] if out else chain_seed
        out.append(int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tail)}I", *tail), parent)))
    return out


def vllm_none_hash(seed: str = VLLM_DEFAULT_NONE_HASH_SEED) -> bytes:
    """vLLM's NONE_HASH: sha256 of the canonical CBOR of the seed string."""
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int = 16,
    seed: str = VLLM_DEFAULT_NONE_HASH_SEED,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM's sha256_cbor chain, as vLLM's hash_block_tokens computes it."""
    check_tokens(tokens)
    parent = vllm_none_hash(seed)
    out: list[bytes] = []
    for index, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        keys = [lora] if lora is not None else []
        if index == 0 and cache_salt:
            keys.append(cache_salt)
        extra_keys = tuple(keys) if keys else None
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, extra_keys), canonical=True)).digest()
        out.append(parent)
    return out


def vllm_event_hash(digest: bytes) -> int:
    """The 64-bit form vLLM publishes in KV events: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int = 16,
    seed: str = VLLM_DEFAULT_NONE_HASH_SEED,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The event form of :func:`vllm_block_digests`."""
    digests = vllm_block_digests(tokens, block_size, seed, lora, cache_salt)
    return [vllm_event_hash(d) for d in digests]
