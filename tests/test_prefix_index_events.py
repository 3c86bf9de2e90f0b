"""The prefix index fed by vLLM KV events: the test vectors and a real engine's capture."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from _data import load_vector

import llmsched
from llmsched import PrefixIndex


def load(name: str) -> dict:
    return load_vector(name)


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }


def batch(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def test_vector_batch_applies_all_three_event_kinds() -> None:
    vec = load("vllm_kv_events.json")
    index = PrefixIndex(block_size=16)
    report = index.apply_vllm_events("engine", bytes.fromhex(vec["payload_hex"]))
    assert report["events"] == 3
    assert report["blocks_stored"] == 2
    assert report["blocks_removed"] == 1
    assert report["cleared"] == 1
    assert index.match_tokens(list(range(32))).as_dict() == {}


def test_vector_events_one_by_one() -> None:
    events = load("vllm_kv_events.json")["decoded"]["events"]
    index = PrefixIndex(block_size=16)
    tokens = list(range(32))
    index.apply_vllm_events("e", batch(events[0]))
    assert index.match_tokens(tokens).as_dict() == {"e": 2}
    index.apply_vllm_events("e", batch(events[1]))
    assert index.match_tokens(tokens).as_dict() == {"e": 1}
    index.apply_vllm_events("e", batch(events[2]))
    assert index.match_tokens(tokens).as_dict() == {}


def test_old_array_encoding_and_finer_index_blocks() -> None:
    """vLLM <= 0.23 positional events; an index with blocks half the engine's size."""
    index = PrefixIndex(block_size=8)
    tokens = list(range(48))
    old = ["BlockStored", [11, 12], None, tokens[:32], 16, None, "GPU"]
    child = ["BlockStored", [13], 12, tokens[32:], 16, None, None]
    report = index.apply_vllm_events(3, batch(old, child))
    assert report["blocks_stored"] == 3
    assert index.match_tokens(tokens).as_dict() == {3: 6}
    index.apply_vllm_events(3, batch(["BlockRemoved", [12], "GPU"]))
    assert index.match_tokens(tokens).as_dict() == {3: 2}


def test_unknown_parent_and_removal_are_counted_and_skipped() -> None:
    index = PrefixIndex(block_size=16)
    tokens = list(range(64))
    report = index.apply_vllm_events(
        "e",
        batch(
            stored([1], None, tokens[:16]),
            stored([3], 2, tokens[32:48]),
            {"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"},
            {"type": "SomethingNew", "x": 1},
        ),
    )
    assert report["blocks_stored"] == 1
    assert report["unknown_parent"] == 1
    assert report["unknown_removed"] == 1
    assert report["unknown_events"] == 1
    assert index.match_tokens(tokens).as_dict() == {"e": 1}


def test_tiers_from_medium_and_lora_namespaces() -> None:
    index = PrefixIndex(block_size=16)
    tokens = list(range(32))
    index.apply_vllm_events(
        "e",
        batch(
            stored([1, 2], None, tokens),
            stored([1, 2], None, tokens, medium="CPU"),
            stored([7], None, tokens[:16], lora_name="sql-adapter"),
        ),
    )
    assert index.match_tokens(tokens).tiers() == {"e": {"gpu": 2, "cpu": 2, "storage": 0}}
    assert index.match_tokens(tokens, lora="sql-adapter").as_dict() == {"e": 1}
    index.apply_vllm_events(
        "e", batch({"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"})
    )
    assert index.match_tokens(tokens).tiers() == {"e": {"gpu": 1, "cpu": 2, "storage": 0}}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        msgpack.packb([1.0, [stored([1], None, list(range(15)))], 0]),
        msgpack.packb([1.0, [stored([1], None, [-1] * 16)], 0]),
        msgpack.packb([1.0, [stored([1], None, [2**40] * 16)], 0]),
        msgpack.packb({"not": "a batch"}),
        b"\xdd\xff\xff\xff\xff",
    ],
)
def test_malformed_payload_raises_and_changes_nothing(payload: bytes) -> None:
    index = PrefixIndex(block_size=16)
    index.apply_vllm_events("e", batch(stored([1], None, list(range(16)))))
    before = (index.stats(), index.holdings("e"))
    with pytest.raises(llmsched.MalformedEventError):
        index.apply_vllm_events("e", payload)
    assert (index.stats(), index.holdings("e")) == before


def test_a_batch_with_a_bad_event_applies_nothing() -> None:
    index = PrefixIndex(block_size=16)
    good = stored([1], None, list(range(16)))
    bad = stored([2], 1, list(range(3)))
    with pytest.raises(llmsched.MalformedEventError):
        index.apply_vllm_events("e", batch(good, bad))
    assert index.workers() == []


@pytest.mark.parametrize("block_size", [32, 16])
def test_real_engine_capture_with_a_gap(block_size: int) -> None:
    """A real vLLM CPU engine's events, joined late (seq 0 and 1 missed): the index must agree
    with what the engine held at the end, skipping events whose parent it never saw."""
    cap = load("vllm_real_capture_gap.json")
    assert cap["block_size"] == 32
    index = PrefixIndex(block_size=block_size)
    skipped = 0
    for _topic, seq, payload in cap["frames"]:
        assert int(seq, 16) >= 2
        report = index.apply_vllm_events("tiny", bytes.fromhex(payload))
        skipped += report["unknown_parent"]
    assert skipped > 0
    scale = 32 // block_size
    for request, expected in zip(cap["requests"], cap["expected_prompt_blocks"], strict=True):
        prompt = np.array(request["prompt"], dtype=np.uint32)
        got = index.match_tokens(prompt).as_dict().get("tiny", 0)
        assert got == expected * scale, (len(prompt), got, expected)


def test_other_cache_groups_and_extra_keys_are_skipped() -> None:
    """Hybrid models repeat events per KV-cache group; only group 0 is indexed. Blocks whose
    extra keys (images: vLLM 0.32 writes ``(identifier, offset)`` pairs) make them more than
    their tokens are not keyed by tokens; the LoRA name and a root block's cache salt are
    the chain's namespace, as a request naming them is hashed."""
    index = PrefixIndex(block_size=16)
    tokens = list(range(16))
    report = index.apply_vllm_events(
        "e",
        batch(
            stored([1], None, tokens, group_idx=1),
            stored([2], None, tokens, extra_keys=[[["image-hash", 0]]]),
            stored([3], None, tokens, extra_keys=[None]),
            stored([4], None, tokens, lora_name="sql", extra_keys=[["sql"]]),
            stored([5], None, tokens, extra_keys=[["tenant"]]),
            stored([6], None, tokens, lora_name="sql", extra_keys=[["sql", "tenant"]]),
            stored([7], 5, tokens, extra_keys=[["again"]]),
            {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 1},
        ),
    )
    assert report["other_groups"] == 2
    # The image's block (content keys) and the salt-like key on a child block (a string
    # the index cannot name) are skipped for different causes, counted apart.
    assert (report["multimodal"], report["extra_keys"]) == (1, 1)
    assert report["blocks_stored"] == 4
    assert index.match_tokens(tokens).as_dict() == {"e": 1}
    assert index.match_tokens(tokens, lora="sql").as_dict() == {"e": 1}
    assert index.match_tokens(tokens, cache_salt="tenant").as_dict() == {"e": 1}
    assert index.match_tokens(tokens, lora="sql", cache_salt="tenant").as_dict() == {"e": 1}
    assert index.match_tokens(tokens, cache_salt="other").as_dict() == {}


def test_engine_hashes_shared_and_conflicting_across_workers() -> None:
    """Workers reporting the same content under the same engine hash share one entry; one whose
    engine uses that hash for other content keeps its own, and each resolves its own parents and
    removals, across dumps()/loads() too."""
    index = PrefixIndex(block_size=16)
    x, y, child = list(range(16)), list(range(100, 116)), list(range(200, 216))
    for w in ("a", "b"):
        index.apply_vllm_events(w, batch(stored([1], None, x)))
    index.apply_vllm_events("c", batch(stored([1], None, y)))  # engine hash 1, other content
    assert index.stats()["engine_blocks"] == 2  # one shared entry, one of c's own
    for w in ("a", "c"):
        report = index.apply_vllm_events(w, batch(stored([2], 1, child)))
        assert report["blocks_stored"] == 1 and report["unknown_parent"] == 0
    assert index.match_tokens(x + child).as_dict() == {"a": 2, "b": 1}
    assert index.match_tokens(y + child).as_dict() == {"c": 2}
    copy = PrefixIndex.loads(index.dumps())
    for idx in (index, copy):
        removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
        assert idx.apply_vllm_events("c", batch(removed))["blocks_removed"] == 1
        assert idx.match_tokens(y + child).as_dict() == {}
        assert idx.match_tokens(x + child).as_dict() == {"a": 2, "b": 1}
        assert idx.apply_vllm_events("a", batch(removed))["blocks_removed"] == 1
        assert idx.match_tokens(x + child).as_dict() == {"b": 1}
        # b still resolves the shared entry: its child lands under x.
        assert idx.apply_vllm_events("b", batch(stored([2], 1, child)))["blocks_stored"] == 1
        assert idx.match_tokens(x + child).as_dict() == {"b": 2}


def test_a_bad_marker_anywhere_in_a_long_token_run_raises_where_it_is_and_changes_nothing() -> None:
    """A run long enough for the decoder's two chains and its vector steps (ids of 2 and 4
    bytes, mixed at random): a byte that is no integer marker in place of any id's marker is
    reported at that id's offset, and the batch applies nothing."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(256, 128_000, size=40 * 16)]
    payload = batch(stored(list(range(100, 140)), None, tokens))
    start = payload.index(b"\xa9token_ids") + 10 + 3  # the str, then the array16 header
    offsets = np.cumsum([0] + [3 if t < 65_536 else 5 for t in tokens])[:-1] + start
    assert payload[start] in (0xCD, 0xCE) and payload[offsets[-1]] in (0xCD, 0xCE)
    index = PrefixIndex(block_size=16)
    index.apply_vllm_events("e", batch(stored([1], None, list(range(16)))))
    before = (index.stats(), index.holdings("e"))
    for k in [*range(0, len(tokens), 5), len(tokens) - 1]:
        for byte in (0xC1, 0xA1, 0xCB):
            bad = bytearray(payload)
            bad[offsets[k]] = byte
            with pytest.raises(llmsched.MalformedEventError, match=f"at byte {offsets[k]}:"):
                index.apply_vllm_events("e", bytes(bad))
    assert (index.stats(), index.holdings("e")) == before
    index.apply_vllm_events("e", payload)
    assert index.match_tokens(tokens).as_dict() == {"e": 40}


def test_an_adapter_named_only_by_its_number_is_not_indexed_as_the_base_model() -> None:
    """Probe 57 F4: vLLM before 0.20 names a LoRA adapter in its events only by ``lora_id``
    (no ``lora_name``, no ``extra_keys``), but keys the adapter's blocks by it. Such blocks
    were chained as the base model's: a base-model prompt matched blocks the engine can only
    reuse for the adapter. No request's hashes can name a numbered adapter, so the event is
    skipped as one whose blocks are more than their tokens (``extra_keys``)."""
    index = PrefixIndex(block_size=16)
    tokens = list(range(16))
    report = index.apply_vllm_events("e", batch(stored([1], None, tokens, lora_id=3)))
    assert (report["extra_keys"], report["blocks_stored"]) == (1, 0)
    assert index.match_tokens(tokens).as_dict() == {}
    # A removal of the skipped block is an unknown one; the base model's blocks still index,
    # with lora_id nil or 0 (no adapter), and a named adapter under its name.
    report = index.apply_vllm_events(
        "e",
        batch(
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            stored([2], None, tokens, lora_id=0),
            stored([4], None, tokens, lora_id=3, lora_name="sql"),
        ),
    )
    assert (report["unknown_removed"], report["blocks_stored"], report["extra_keys"]) == (1, 2, 0)
    assert index.match_tokens(tokens).as_dict() == {"e": 1}
    assert index.match_tokens(tokens, lora="sql").as_dict() == {"e": 1}


def test_extra_keys_and_multimodal_events_are_counted_apart_and_extra_keys_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Probe 66: events skipped for extra keys the index cannot name (a LoRA adapter named
    only by its number, string keys beside the LoRA name and a root's salt) were counted with
    multimodal ones in one ``extra_keys`` and said nothing: each is a prefix hit lost that
    configuration can cure. Now ``multimodal`` and ``extra_keys`` are apart, per worker in
    ``stats()``, and the second is warned once per worker."""
    import logging

    caplog.set_level(logging.WARNING, logger="llmsched")
    index = PrefixIndex(block_size=16)
    tokens = list(range(16))
    image = stored([1], None, tokens, extra_keys=[[["image-hash", 0]]])
    embeds = stored([2], None, tokens, extra_keys=[[b"\x01" * 32]])
    numbered = stored([3], None, tokens, lora_id=3)
    strings = stored([4], None, tokens, extra_keys=[["a", "b", "c"]])
    report = index.apply_vllm_events("e", batch(image, embeds))
    assert (report["multimodal"], report["extra_keys"]) == (2, 0)
    assert [r for r in caplog.records if "extra keys" in r.getMessage()] == []
    for _ in range(2):
        report = index.apply_vllm_events("e", batch(numbered, strings))
        assert (report["multimodal"], report["extra_keys"]) == (0, 2)
    index.apply_vllm_events("f", batch(numbered))
    stats = index.stats()
    assert stats["multimodal"] == {"e": 2}
    assert stats["extra_keys"] == {"e": 4, "f": 1} == index.extra_keys()
    warned = [r.getMessage() for r in caplog.records if "extra keys" in r.getMessage()]
    assert len(warned) == 2 and "'e'" in warned[0] and "'f'" in warned[1]
    assert PrefixIndex(16).stats()["extra_keys"] == {}


def test_a_hash_stored_again_with_other_content_replaces_the_old_and_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Probe: an engine storing engine hash 7 again with other tokens left the first content
    held by the worker for good (no BlockRemoved of 7 could reach it). The newer content now
    replaces it, counted in the report and stats(), warned of once."""
    import logging

    caplog.set_level(logging.WARNING, logger="llmsched")
    index = PrefixIndex(block_size=16)
    first, second = list(range(16)), list(range(100, 116))
    index.apply_vllm_events("e", batch(stored([7], None, first)))
    for _ in range(2):
        report = index.apply_vllm_events("e", batch(stored([7], None, second)))
        assert report["replaced"] == 1
        assert index.match_tokens(first).as_dict() == {}
        assert index.match_tokens(second).as_dict() == {"e": 1}
        report = index.apply_vllm_events("e", batch(stored([7], None, first)))
        assert report["replaced"] == 1
    assert index.match_tokens(first).as_dict() == {"e": 1}
    assert index.match_tokens(second).as_dict() == {}
    report = index.apply_vllm_events("e", batch({"type": "BlockRemoved", "block_hashes": [7]}))
    assert (report["blocks_removed"], report["unknown_removed"]) == (1, 0)
    stats = index.stats()
    assert (stats["blocks"], stats["replaced_engine_blocks"]) == (0, 4)
    warned = [r.getMessage() for r in caplog.records if "again with other" in r.getMessage()]
    assert len(warned) == 1 and "'e'" in warned[0]


@pytest.mark.parametrize("rebuild", ["loads", "pickle"])
def test_a_loaded_index_keeps_the_content_and_counts_from_zero(
    rebuild: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Probe 75: the counters of stats() started from 0 after ``loads()`` / unpickling, which
    no document said (only ``evicted_blocks``'s). Decided: a snapshot holds the index's
    content, not what one object saw (a copy in another process counts its own, so summing
    copies never counts an event twice); documented on each counter, and warned of anew."""
    import logging
    import pickle

    caplog.set_level(logging.WARNING, logger="llmsched")
    index = PrefixIndex(block_size=16)
    first, second = list(range(16)), list(range(100, 116))
    index.apply_vllm_events("e", batch(stored([7], None, first)))
    index.apply_vllm_events("e", batch(stored([7], None, second)))  # replaced
    index.apply_vllm_events("e", batch(stored([8], None, first[:8], block_size=8)))  # mismatch
    index.apply_vllm_events("e", batch(stored([9], None, first, extra_keys=[["a", "b", "c"]])))
    stats = index.stats()
    counted = {
        "event_batches": 4,
        "replaced_engine_blocks": 1,
        "block_size_mismatch": {"e": 1},
        "extra_keys": {"e": 1},
    }
    assert {k: stats[k] for k in counted} == counted  # type: ignore[literal-required]
    if rebuild == "loads":
        loaded = PrefixIndex.loads(index.dumps())
    else:
        loaded = pickle.loads(pickle.dumps(index))
    assert loaded.match_tokens(second).as_dict() == {"e": 1}
    assert loaded.match_tokens(first).as_dict() == {}
    after = loaded.stats()
    assert loaded.holdings("e") == index.holdings("e")
    assert after["blocks"] == stats["blocks"]
    assert {k: after[k] for k in counted} == {  # type: ignore[literal-required]
        "event_batches": 0,
        "replaced_engine_blocks": 0,
        "block_size_mismatch": {},
        "extra_keys": {},
    }
    assert (after["evicted_blocks"], after["max_bytes_emptied"], after["multimodal"]) == (0, 0, {})
    caplog.clear()
    loaded.apply_vllm_events("e", batch(stored([7], None, first)))
    assert loaded.stats()["replaced_engine_blocks"] == 1
    warned = [r.getMessage() for r in caplog.records if "again with other" in r.getMessage()]
    assert len(warned) == 1, warned


def test_a_loaded_capped_index_counts_its_own_emptying() -> None:
    """Probe 75: ``max_bytes_emptied`` of a loaded index counts from 0 (see above)."""
    index = PrefixIndex(block_size=16, max_bytes=1)
    index.store("w", index.hash_tokens(list(range(32))))
    assert index.stats()["max_bytes_emptied"] == 1
    loaded = PrefixIndex.loads(index.dumps())
    assert loaded.stats()["max_bytes_emptied"] == 0
    loaded.store("w", loaded.hash_tokens(list(range(32))))
    assert loaded.stats()["max_bytes_emptied"] == 1
