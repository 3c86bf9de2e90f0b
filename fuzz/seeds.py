"""Write the seed corpus of the vllm_events fuzz target from the test vectors in tests/data.

Usage: python fuzz/seeds.py OUT_DIR. Seeds: the vLLM 0.33 vector, every payload of the real
vLLM 0.32 capture, and hand-built payloads in the older array encoding (vLLM <= 0.23).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent


def array_encoded_seeds() -> list[bytes]:
    stored_011 = ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None, "GPU"]
    stored_033 = [
        "BlockStored",
        [2**64 - 1],
        None,
        [70000, 5],
        2,
        3,
        "cpu",
        "lora-a",
        [["mm", b"\x01\x02"]],
        1,
        "sliding_window",
        128,
        "local",
        None,
        "s1",
        [9],
    ]
    removed = ["BlockRemoved", [b"\x00" * 24 + b"\x12" * 8], "STORAGE", 0]
    return [
        msgpack.packb([1.5, [stored_011, removed, ["AllBlocksCleared"]], 0]),
        msgpack.packb([2, [stored_033, ["Unknown", 1]], None]),
        msgpack.packb({"ts": 3.0, "events": [removed], "data_parallel_rank": 1}),
    ]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vectors = ROOT / "tests" / "data"
    seeds = [
        bytes.fromhex(json.loads((vectors / "vllm_kv_events.json").read_text())["payload_hex"])
    ]
    capture = json.loads((vectors / "vllm_real_capture_gap.json").read_text())
    seeds += [bytes.fromhex(frame[2]) for frame in capture["frames"]]
    seeds += array_encoded_seeds()
    for seed in seeds:
        (out / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    print(f"{len(seeds)} seeds in {out}")


if __name__ == "__main__":
    main()
