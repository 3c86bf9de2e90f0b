"""The vLLM KV-event decoder: the test vectors, the real capture, both encodings, hostile input, and
agreement with the pure-Python twin on generated, non-canonically encoded and mutated payloads."""

from __future__ import annotations

import doctest
import math
import struct
from typing import Any

import msgpack
import pytest
from _data import load_vector
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmsched
import llmsched.vllm_events
from llmsched.errors import MalformedEventError
from llmsched.reference import vllm_events as twin


def _outcome(decode: Any, payload: bytes) -> Any:
    """("ok", result) or ("error",), with a NaN ts made comparable."""
    try:
        result = decode(payload)
    except MalformedEventError:
        return ("error",)
    if isinstance(result["ts"], float) and math.isnan(result["ts"]):
        result["ts"] = "nan"
    return ("ok", result)


def _agree(payload: bytes) -> Any:
    native = _outcome(llmsched.decode_vllm_events, payload)
    assert native == _outcome(twin.decode_vllm_events, payload), payload.hex()
    return native


# ---- vectors and captures ----


@pytest.mark.parametrize("decode", [llmsched.decode_vllm_events, twin.decode_vllm_events])
def test_kv_events_vector(decode: Any) -> None:
    vector = load_vector("vllm_kv_events.json")
    decoded = decode(bytes.fromhex(vector["payload_hex"]))
    expected = vector["decoded"]
    assert decoded["ts"] == expected["ts"]
    assert decoded["dp_rank"] == expected["dp_rank"]
    assert decoded["unknown_events"] == 0
    assert len(decoded["events"]) == len(expected["events"])
    for got, want in zip(decoded["events"], expected["events"], strict=True):
        assert {key: got[key] for key in want} == want


def test_real_capture_frames_decode_identically() -> None:
    capture = load_vector("vllm_real_capture_gap.json")
    kinds: set[str] = set()
    for topic_hex, _seq_hex, payload_hex in capture["frames"]:
        assert bytes.fromhex(topic_hex).decode() == "kv@tiny"
        status, batch = _agree(bytes.fromhex(payload_hex))
        assert status == "ok"
        for event in batch["events"]:
            kinds.add(event["type"])
            if event["type"] == "BlockStored":
                assert len(event["token_ids"]) == len(event["block_hashes"]) * 32
                assert event["kv_cache_spec_kind"] == "full_attention"
                assert event["has_extra_keys"] == [False] * len(event["block_hashes"])
    assert kinds == {"BlockStored", "BlockRemoved"}


def test_old_array_encoding() -> None:
    payload = msgpack.packb(
        [
            3,
            [
                ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, 7, "GPU"],
                ["BlockRemoved", [12], "cpu"],
                ["AllBlocksCleared"],
            ],
            1,
        ]
    )
    status, batch = _agree(payload)
    assert status == "ok"
    stored, removed, cleared = batch["events"]
    assert stored["block_hashes"] == [11, 12] and stored["parent_block_hash"] == 10
    assert stored["lora_id"] == 7 and stored["lora_name"] is None
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [12],
        "medium": "CPU",
        "group_idx": None,
    }
    assert cleared == {"type": "AllBlocksCleared"}
    assert batch["ts"] == 3.0 and batch["dp_rank"] == 1


def test_int_and_bytes_hashes_agree() -> None:
    digest = bytes(range(24)) + (0xF892553BEF84EF0C).to_bytes(8, "big")
    forms = [0xF892553BEF84EF0C, 0xF892553BEF84EF0C - 2**64, digest]
    events = [{"type": "BlockRemoved", "block_hashes": [form]} for form in forms]
    _, batch = _agree(msgpack.packb([0.0, events, 0]))
    assert {event["block_hashes"][0] for event in batch["events"]} == {0xF892553BEF84EF0C}


def test_accepts_bytes_like_and_rejects_other_types() -> None:
    payload = msgpack.packb([0.0, [], None])
    expected = {"ts": 0.0, "events": [], "dp_rank": None, "unknown_events": 0}
    assert llmsched.decode_vllm_events(bytearray(payload)) == expected
    assert llmsched.decode_vllm_events(memoryview(payload)) == expected
    with pytest.raises(TypeError, match="payload must be bytes"):
        llmsched.decode_vllm_events("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (msgpack.packb([0.0, [{"type": "BlockRemoved"}], 0]), "lacks block_hashes"),
        (msgpack.packb([0.0, [["BlockStored", [1], None, [5], 2]], 0]), "1 token_ids for 1 blocks"),
        (msgpack.packb([0.0, [["BlockStored", [1], None, [-5], 1]], 0]), "token id -5"),
        (msgpack.packb([0.0, [["BlockStored", [1], None, [2**32], 1]], 0]), "token id 4294967296"),
        (msgpack.packb([0.0, [["BlockRemoved", [1], "TPU"]], 0]), 'medium "TPU"'),
        (msgpack.packb([0.0, [], 0]) + b"\x00", "trailing"),
        (b"\x93\x00\xdd\xff\xff\xff\xff", "declares 4294967295 elements"),
        (b"\x93\x00\x91\x92\xa1Z" + b"\x91" * 40 + b"\xc0\xc0", "nested deeper than 32"),
    ],
)
def test_malformed_payloads_raise_naming_the_problem(payload: bytes, needle: str) -> None:
    with pytest.raises(MalformedEventError, match=needle):
        llmsched.decode_vllm_events(payload)
    with pytest.raises(MalformedEventError):
        twin.decode_vllm_events(payload)
    assert issubclass(MalformedEventError, ValueError)


def test_every_truncation_of_the_vector_raises() -> None:
    payload = bytes.fromhex(load_vector("vllm_kv_events.json")["payload_hex"])
    for cut in range(len(payload)):
        assert _agree(payload[:cut]) == ("error",)


def test_docstring_examples_run() -> None:
    for module in (llmsched.vllm_events, twin):
        failures, attempted = doctest.testmod(module)
        assert attempted > 0 and failures == 0, module.__name__


# ---- generated payloads: the twin is the oracle ----


class Pairs(list):  # type: ignore[type-arg]
    """A msgpack map as its (key, value) pairs, so tests can write duplicate keys."""


class Ext:
    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


def _pack_int(value: int, draw: Any) -> bytes:
    """An integer in a randomly chosen valid width (msgpack allows non-minimal encodings)."""
    forms: list[bytes] = []
    if 0 <= value <= 0x7F:
        forms.append(bytes([value]))
    if -32 <= value < 0:
        forms.append(struct.pack(">b", value))
    for marker, fmt, low, high in (
        (0xCC, ">B", 0, 2**8 - 1),
        (0xCD, ">H", 0, 2**16 - 1),
        (0xCE, ">I", 0, 2**32 - 1),
        (0xCF, ">Q", 0, 2**64 - 1),
        (0xD0, ">b", -(2**7), 2**7 - 1),
        (0xD1, ">h", -(2**15), 2**15 - 1),
        (0xD2, ">i", -(2**31), 2**31 - 1),
        (0xD3, ">q", -(2**63), 2**63 - 1),
    ):
        if low <= value <= high:
            forms.append(bytes([marker]) + struct.pack(fmt, value))
    return bytes(draw(st.sampled_from(forms)))


def _pack_len(count: int, fix_base: int | None, fix_max: int, markers: tuple[int, ...]) -> bytes:
    if fix_base is not None and count <= fix_max:
        return bytes([fix_base | count])
    for marker, fmt in zip(markers, (">B", ">H", ">I"), strict=True):
        if count < 2 ** (8 * struct.calcsize(fmt)):
            return bytes([marker]) + struct.pack(fmt, count)
    raise ValueError(count)


def _fits_f32(value: float) -> bool:
    try:
        return bool(struct.unpack(">f", struct.pack(">f", value))[0] == value)
    except OverflowError:
        return False


def _pack(value: Any, draw: Any) -> bytes:
    """A small msgpack encoder with random integer widths and random float widths."""
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return _pack_int(value, draw)
    if isinstance(value, float):
        if _fits_f32(value) and draw(st.booleans()):
            return b"\xca" + struct.pack(">f", value)
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogateescape")
        return _pack_len(len(data), 0xA0, 31, (0xD9, 0xDA, 0xDB)) + data
    if isinstance(value, bytes):
        return _pack_len(len(value), None, 0, (0xC4, 0xC5, 0xC6)) + value
    if isinstance(value, Ext):
        return _pack_len(len(value.data), None, 0, (0xC7, 0xC8, 0xC9)) + (
            struct.pack(">b", value.code) + value.data
        )
    if isinstance(value, Pairs):
        head = _pack_len(len(value), 0x80, 15, (0xDE, 0xDE, 0xDF))
        return head + b"".join(_pack(k, draw) + _pack(v, draw) for k, v in value)
    if isinstance(value, list):
        head = _pack_len(len(value), 0x90, 15, (0xDC, 0xDC, 0xDD))
        return head + b"".join(_pack(item, draw) for item in value)
    raise TypeError(value)


def _nested(depth: int) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value]
    return value


any_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.binary(max_size=10),
    st.builds(Ext, st.integers(-128, 127), st.binary(max_size=12)),
)
junk = st.one_of(
    any_scalar,
    st.integers(28, 36).map(_nested),
    st.lists(any_scalar, max_size=3),
    st.lists(st.tuples(st.text(max_size=4), any_scalar), max_size=2).map(Pairs),
)
block_hash = st.one_of(
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), -1),
    st.binary(max_size=32),
)
token = st.one_of(st.integers(0, 200_000), st.integers(0, 2**32 - 1))
medium = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE", "gpu", "Cpu", "TPU"]))
optional_u32 = st.one_of(st.none(), st.integers(0, 2**32 - 1))
extra_entry = st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=2), junk)


@st.composite
def stored_fields(draw: Any) -> list[tuple[str, Any]]:
    blocks = draw(st.integers(0, 3))
    block_size = draw(st.integers(1, 4))
    tokens = draw(st.lists(token, min_size=blocks * block_size, max_size=blocks * block_size))
    if draw(st.integers(0, 9)) == 0:  # occasionally break an invariant
        tokens = [*tokens, draw(st.one_of(token, st.just(-1), st.just(2**32), st.just(1.0)))]
    extra = draw(
        st.one_of(
            st.none(), st.lists(extra_entry, min_size=blocks, max_size=blocks + (blocks == 0))
        )
    )
    return [
        ("block_hashes", draw(st.lists(block_hash, min_size=blocks, max_size=blocks))),
        ("parent_block_hash", draw(st.one_of(st.none(), block_hash))),
        ("token_ids", tokens),
        (
            "block_size",
            draw(st.one_of(st.just(block_size), st.just(0), st.just(-1)))
            if draw(st.integers(0, 9)) == 0
            else block_size,
        ),
        ("lora_id", draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))),
        ("medium", draw(medium)),
        ("lora_name", draw(st.one_of(st.none(), st.text(max_size=8)))),
        ("extra_keys", extra),
        ("group_idx", draw(optional_u32)),
        (
            "kv_cache_spec_kind",
            draw(st.one_of(st.none(), st.sampled_from(["full_attention", "x"]))),
        ),
        ("kv_cache_spec_sliding_window", draw(optional_u32)),
    ]


@st.composite
def removed_fields(draw: Any) -> list[tuple[str, Any]]:
    return [
        ("block_hashes", draw(st.lists(block_hash, max_size=4))),
        ("medium", draw(medium)),
        ("group_idx", draw(optional_u32)),
    ]


@st.composite
def event(draw: Any) -> Any:
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Moved"]))
    if tag == "BlockStored":
        fields = draw(stored_fields())
    elif tag == "BlockRemoved":
        fields = draw(removed_fields())
    else:
        fields = [(f"f{i}", value) for i, value in enumerate(draw(st.lists(junk, max_size=2)))]
    if draw(st.booleans()):  # array-encoded: a prefix of the positional fields, maybe more
        keep = draw(st.integers(0, len(fields)))
        items = [value for _, value in fields[:keep]]
        if keep == len(fields):
            items += draw(st.lists(junk, max_size=2))
        return [tag, *items]
    # map-encoded: defaulted fields may be dropped, unknown ones added, order shuffled
    pairs = [(name, value) for name, value in fields if value is not None or draw(st.booleans())]
    pairs += [("type", tag)]
    pairs += draw(st.lists(st.tuples(st.sampled_from(["locality", "ownership"]), junk), max_size=2))
    if draw(st.integers(0, 19)) == 0:
        pairs.append(draw(st.sampled_from(pairs)))  # a duplicate key
    return Pairs(draw(st.permutations(pairs)) if draw(st.booleans()) else pairs[-1:] + pairs[:-1])


@st.composite
def batch_payload(draw: Any) -> bytes:
    events = draw(st.lists(event(), max_size=5))
    ts = draw(st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40)))
    dp_rank = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    shape = draw(st.sampled_from(["array3", "array2", "array4", "map"]))
    if shape == "map":
        batch: Any = Pairs([("ts", ts), ("events", events), ("data_parallel_rank", dp_rank)])
    else:
        batch = [ts, events, dp_rank, draw(junk)][: {"array2": 2, "array3": 3, "array4": 4}[shape]]
    return _pack(batch, draw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_payload())
def test_generated_batches_agree_with_twin(payload: bytes) -> None:
    _agree(payload)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_payload(), st.data())
def test_mutated_batches_agree_with_twin(payload: bytes, data: Any) -> None:
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        action = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = data.draw(st.integers(0, max(len(mutated) - 1, 0)))
        if action == "flip" and mutated:
            mutated[at] = data.draw(st.integers(0, 255))
        elif action == "insert":
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=3))
        elif action == "delete":
            del mutated[at : at + data.draw(st.integers(1, 4))]
        else:
            del mutated[at:]
    _agree(bytes(mutated))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_agree_with_twin(payload: bytes) -> None:
    _agree(payload)


def test_generated_batches_are_mostly_valid() -> None:
    """Guards the generator: the agreement tests must see many accepted payloads too."""
    accepted = 0

    @settings(max_examples=200, deadline=None, database=None)
    @given(batch_payload())
    def count(payload: bytes) -> None:
        nonlocal accepted
        accepted += _agree(payload)[0] == "ok"

    count()
    assert accepted >= 40, accepted
