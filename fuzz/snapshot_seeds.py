"""Writes seed snapshots for the `snapshot` fuzz target: `PrefixIndex.dumps()` of small indexes
(empty; confirmed, approximate and engine-fed holdings; several workers and tiers)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from llmsched import PrefixIndex


def seeds() -> list[bytes]:
    """A handful of valid snapshots covering every kind of holding."""
    out = [PrefixIndex(block_size=4).dumps()]
    index = PrefixIndex(block_size=4, model="m", worker_capacity=64)
    tokens = np.arange(128, dtype=np.uint32)
    hashes = index.hash_tokens(tokens)
    index.store("a", hashes[:10], tier="gpu")
    index.store(3, hashes[:4], tier="cpu")
    index.record("b", hashes[:20], ttl_s=30.0, now=0.0)
    out.append(index.dumps())
    index.store("c", index.hash_tokens(tokens[::-1]), tier="storage")
    out.append(index.dumps())
    return out


def main(folder: str) -> None:
    """Writes the seeds into `folder`, without their 8-byte checksum: the target seals each
    input, so mutations of the content reach the checks behind it."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(seeds()):
        (target / f"seed-{i}").write_bytes(data[:-8])


if __name__ == "__main__":
    main(sys.argv[1])
