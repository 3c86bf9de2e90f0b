"""A short check of the core API, run by ``tools/wheel_check.py smoke`` inside a fresh venv that
holds only the installed wheel and its required dependencies (numpy, PyYAML).

It exercises each core component through the compiled extension: hashing against vLLM's own
block hashes and one real KV-event payload (``tests/data``), ``PrefixIndex``, ``Router`` over an
``EndpointPool``, ``FlowController`` and ``SliceTracker``, plus an error mapped from Rust to
``llmsched.errors``. It prints one JSON line (version, interpreter, where llmsched was imported
from) and exits non-zero on the first failure.

Usage: python -I tools/wheel_smoke.py TESTS_DATA_DIR
"""

from __future__ import annotations

import json
import platform
import sys
import threading
from pathlib import Path

import numpy as np

import llmsched
from llmsched import (
    EndpointPool,
    FlowController,
    FlowRequest,
    PrefixIndex,
    Router,
    SliceTracker,
    UnknownBlockError,
    block_hashes,
    decode_vllm_events,
    text_block_hashes,
    vllm_block_digests,
)


def check_hashing(data: Path) -> None:
    """The vLLM ``sha256_cbor`` chain matches vLLM's vectors; xxh3 is chained and dtype-blind."""
    vector = json.loads((data / "vllm_block_hashes.json").read_text())
    tokens, block_size = vector["tokens"], vector["block_size"]
    for case in vector["cases"]:
        digests = vllm_block_digests(tokens, block_size, seed=case["seed"])
        assert [d.hex() for d in digests] == case["block_hashes_hex"], case["seed"]
        events = block_hashes(tokens, block_size, seed=case["seed"], algo="vllm_sha256_cbor")
        assert [int(h) for h in events] == case["event_uint64"], case["seed"]
    full = block_hashes(np.arange(64, dtype=np.int64), 16)
    assert full.dtype == np.uint64 and len(full) == 4
    assert (block_hashes(np.arange(32, dtype=np.uint32), 16) == full[:2]).all()
    assert len(set(full.tolist())) == 4
    assert len(text_block_hashes("x" * 256, 16)) == 4


def check_index(data: Path) -> None:
    """A real event batch (store 32 tokens, remove one block, clear all) decodes and applies;
    the index matches what is stored."""
    kv = json.loads((data / "vllm_kv_events.json").read_text())
    index = PrefixIndex(block_size=16)
    payload = bytes.fromhex(kv["payload_hex"])
    decoded = decode_vllm_events(payload)  # the vector names the fields the payload carries
    assert decoded["ts"] == kv["decoded"]["ts"]
    for got, want in zip(decoded["events"], kv["decoded"]["events"], strict=True):
        assert {k: got.get(k) for k in want} == want, (got, want)
    report = index.apply_vllm_events("engine-a", payload)
    assert (report["blocks_stored"], report["blocks_removed"], report["cleared"]) == (2, 1, 1)
    assert index.match_tokens(range(32), now=0.0).as_dict() == {}  # the batch ends cleared
    local = PrefixIndex(block_size=4)
    assert local.store("b", local.hash_tokens(range(12))) == 3
    assert local.match_tokens(range(9), now=0.0).as_dict() == {"b": 2}
    # An error raised in Rust arrives as its llmsched.errors class and changes nothing.
    try:
        local.store("c", local.hash_tokens(range(8))[1:], parent=12345)
    except UnknownBlockError as exc:
        assert "parent block" in str(exc), exc
    else:
        raise AssertionError("a store under an unknown parent did not raise UnknownBlockError")
    assert local.workers() == ["b"], local.workers()


def check_router() -> None:
    """The prefix holder wins; picks from several threads at once all succeed."""
    index = PrefixIndex(block_size=4)
    prompt = "0123456789abcdef" * 4
    index.store("a", index.hash_text(prompt))
    pool = EndpointPool(["a", "b", "c"], stale_policy="ignore")
    router = Router(pool, index, config="prefix-only")
    decision = router.pick(text=prompt, now=0.0)
    assert (decision.endpoint, decision.cached) == ("a", 16), decision
    picked: list[str] = []

    def pick_many() -> None:
        for i in range(200):
            picked.append(str(router.pick(tokens=np.arange(i, i + 32), now=0.0).endpoint))

    threads = [threading.Thread(target=pick_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(picked) == 800 and set(picked) <= {"a", "b", "c"}, set(picked)


def check_flow() -> None:
    """A higher priority overtakes a queued request once the saturated pool has room."""
    flow = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
    assert flow.enqueue(FlowRequest(1, tenant="batch"), now=0.0) is None
    first = flow.dispatch(now=0.0)
    assert first is not None and first.id == 1, first
    assert flow.enqueue(FlowRequest(2, tenant="batch"), now=0.0) is None
    assert flow.enqueue(FlowRequest(3, tenant="chat", priority=5), now=0.0) is None
    assert flow.dispatch(now=0.0) is None  # saturated
    flow.complete(1, now=0.1)
    second = flow.dispatch(now=0.1)
    assert second is not None and second.id == 3, second


def check_slices() -> None:
    """A fixed-quantum slice runs out and is decided at its boundary."""
    tracker = SliceTracker("fixed", {"slice_tokens": 4}, endpoints=["a"])
    tracker.set_endpoint("a", kv_cache_usage=0.5, waiting=1)
    start = tracker.admit(7, prompt_tokens=10, max_tokens=20, endpoint="a")
    assert start.slice_tokens == 4, start
    assert tracker.record_tokens(7, 4) == 0
    decision = tracker.decide(7, now=1.0)
    assert decision.action in ("continue", "yield", "migrate"), decision.action
    assert tracker.state(7) is not None and len(tracker) == 1


def main() -> None:
    data = Path(sys.argv[1])
    check_hashing(data)
    check_index(data)
    check_router()
    check_flow()
    check_slices()
    print(
        json.dumps(
            {
                "llmsched": llmsched.__version__,
                "python": platform.python_version(),
                "file": llmsched.__file__,
                "extension": llmsched._llmsched.__file__,
            }
        )
    )


if __name__ == "__main__":
    main()
