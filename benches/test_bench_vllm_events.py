"""Decode throughput of a vLLM KV-event payload: the Rust decoder against its pure-Python twin.

Workload: one engine step's batch of 64 map-encoded BlockStored events (vLLM >= 0.24 layout with
the fields vLLM 0.32 sends), each 16 blocks of 16 tokens drawn from a 150k vocabulary: 1,024
blocks. Each benchmark records blocks/s in its extra_info.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from _timing import per_second

import llmsched
from llmsched.reference import vllm_events as twin

EVENTS, BLOCKS_PER_EVENT, BLOCK_SIZE = 64, 16, 16
BLOCKS = EVENTS * BLOCKS_PER_EVENT


def _payload() -> bytes:
    rng = random.Random(42)
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)],
            "parent_block_hash": rng.getrandbits(64),
            "token_ids": [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * BLOCK_SIZE)],
            "block_size": BLOCK_SIZE,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * BLOCKS_PER_EVENT,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        for _ in range(EVENTS)
    ]
    return bytes(msgpack.packb([1.8e9, events, 0]))


PAYLOAD = _payload()


@pytest.mark.parametrize(
    "decode",
    [llmsched.decode_vllm_events, twin.decode_vllm_events],
    ids=["native", "python_twin"],
)
def test_bench_decode_batch(benchmark: Any, decode: Any) -> None:
    decoded = decode(PAYLOAD)
    assert decoded == twin.decode_vllm_events(PAYLOAD)
    assert sum(len(e["block_hashes"]) for e in decoded["events"]) == BLOCKS
    benchmark.group = "vllm_events_decode (64 events x 16 blocks x 16 tokens)"
    benchmark(decode, PAYLOAD)
    per_second(benchmark, "blocks_per_s", BLOCKS, rounded=False)
