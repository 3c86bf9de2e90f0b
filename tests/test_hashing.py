"""llmsched.hashing: vLLM vectors, input forms, namespaces, text, batch and every error path."""

from __future__ import annotations

import array
import threading
import tracemalloc
from typing import Any

import cbor2
import numpy as np
import pytest
from _data import load_vector

import llmsched
import llmsched._tokens
import llmsched.hashing
from llmsched import ConfigError, InvalidTokenError
from llmsched.errors import InvalidTypeError
from llmsched.reference import hashing as ref

INT_DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64]


VLLM = load_vector("vllm_block_hashes.json")
VLLM_CASES = VLLM["cases"]


# --- vLLM sha256_cbor vectors -------------------------------------------------------------


def test_vllm_vectors_hold_both_cases() -> None:
    assert [c["seed"] for c in VLLM_CASES] == ["vllm-none-hash", "0"]


@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: f"seed={c['seed']}")
def test_vllm_vectors_native(case: dict[str, Any]) -> None:
    tokens, block_size, seed = VLLM["tokens"], VLLM["block_size"], case["seed"]
    assert case["extra_keys"] is None
    assert llmsched.vllm_none_hash(seed).hex() == case["none_hash_hex"]
    digests = llmsched.vllm_block_digests(tokens, block_size, seed=seed)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    events = llmsched.block_hashes(tokens, block_size, seed=seed, algo="vllm_sha256_cbor")
    assert events.dtype == np.uint64
    assert events.tolist() == case["event_uint64"]
    as_u16 = np.asarray(tokens, dtype=np.uint16)
    again = llmsched.block_hashes(as_u16, block_size, seed=seed, algo="vllm_sha256_cbor")
    assert again.tolist() == case["event_uint64"]


@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: f"seed={c['seed']}")
def test_vllm_vectors_twin(case: dict[str, Any]) -> None:
    tokens, block_size, seed = VLLM["tokens"], VLLM["block_size"], case["seed"]
    assert ref.vllm_none_hash(seed).hex() == case["none_hash_hex"]
    digests = ref.vllm_block_digests(tokens, block_size, seed)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    assert ref.vllm_block_hashes(tokens, block_size, seed) == case["event_uint64"]


def test_vllm_vectors_cbor_bytes() -> None:
    assert (
        cbor2.dumps("vllm-none-hash", canonical=True).hex()
        == VLLM["cbor_of_seed_vllm-none-hash_hex"]
    )
    block0 = (ref.vllm_none_hash(), tuple(VLLM["tokens"][:16]), None)
    assert cbor2.dumps(block0, canonical=True).hex() == VLLM["cbor_of_block0_input_hex"]


def test_vllm_default_seed_is_vllm_none_hash() -> None:
    assert llmsched.hashing.VLLM_DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert llmsched.vllm_none_hash() == llmsched.vllm_none_hash("vllm-none-hash")
    assert (
        llmsched.block_hashes(VLLM["tokens"], algo="vllm_sha256_cbor").tolist()
        == (VLLM_CASES[0]["event_uint64"])
    )


def test_vllm_extra_keys_match_twin() -> None:
    tokens = list(range(1000, 1100))
    for lora, salt in [("adapter", None), (None, "tenant"), ("adapter", "tenant"), ("", None)]:
        got = llmsched.vllm_block_digests(tokens, 16, lora=lora, cache_salt=salt)
        assert got == ref.vllm_block_digests(tokens, 16, lora=lora, cache_salt=salt)
        plain = llmsched.vllm_block_digests(tokens, 16)
        assert all(a != b for a, b in zip(got, plain, strict=True))


def test_vllm_empty_cache_salt_is_no_salt() -> None:
    tokens = list(range(64))
    assert llmsched.vllm_block_digests(tokens, cache_salt="") == llmsched.vllm_block_digests(tokens)


# --- xxh3 chain ------------------------------------------------------------------------------


def test_matches_reference_twin() -> None:
    tokens = list(range(1000, 1100))
    got = llmsched.block_hashes(tokens, block_size=16, seed=5)
    assert got.dtype == np.uint64
    assert got.tolist() == ref.block_hashes(tokens, 16, 5)


@pytest.mark.parametrize("block_size", [60, 61, 64, 65, 128, 255, 256, 257, 1024])
@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1, 0x8000_0000_0000_0000, 0x0123_4567_89AB_CDEF])
def test_long_blocks_match_the_twin(block_size: int, seed: int) -> None:
    # Blocks over 240 bytes (61 ids and more) take xxh3's long path, run with AVX2 where the
    # processor has it; the twin's `xxhash` is the C library's own code, an independent check.
    rng = np.random.default_rng(block_size)
    tokens = rng.integers(0, 2**32, size=3 * block_size + 5, dtype=np.uint64).astype(np.uint32)
    expect = ref.block_hashes(tokens.tolist(), block_size, seed)
    assert llmsched.block_hashes(tokens, block_size, seed=seed).tolist() == expect
    # The same ids one byte off alignment, and as a list: other read paths, the same hashes.
    unaligned = np.frombuffer(bytearray(b"\0" + tokens.tobytes()), np.uint32, offset=1)
    assert not unaligned.flags.aligned
    assert llmsched.block_hashes(unaligned, block_size, seed=seed).tolist() == expect
    assert llmsched.block_hashes(tokens.tolist(), block_size, seed=seed).tolist() == expect


def test_xxh3_definition_from_the_docstring() -> None:
    import struct

    import xxhash

    tokens = [7, 8, 9, 10, 11, 12]
    h0 = xxhash.xxh3_64_intdigest(struct.pack("<3I", 7, 8, 9), seed=42)
    h1 = xxhash.xxh3_64_intdigest(struct.pack("<3I", 10, 11, 12), seed=h0)
    assert llmsched.block_hashes(tokens, 3, seed=42).tolist() == [h0, h1]


def test_equal_prefix_equal_hashes() -> None:
    a = np.arange(100, dtype=np.uint32)
    b = a.copy()
    b[40] = 1
    ha, hb = llmsched.block_hashes(a), llmsched.block_hashes(b)
    assert ha[:2].tolist() == hb[:2].tolist()
    assert (ha[2:] != hb[2:]).all()


def test_namespaces_separate_every_block() -> None:
    tokens = np.arange(64, dtype=np.uint32)
    variants = [
        {},
        {"model": "m"},
        {"lora": "m"},
        {"cache_salt": "m"},
        {"model": ""},
        {"model": "m", "lora": "a"},
        {"seed": 1},
    ]
    hashes = [llmsched.block_hashes(tokens, **kw).tolist() for kw in variants]  # type: ignore[arg-type]
    blocks = [h for hs in hashes for h in hs]
    assert len(set(blocks)) == len(blocks)
    again = llmsched.block_hashes(tokens, model="m", lora="a")
    assert again.tolist() == hashes[5]
    seed = llmsched.namespace_seed(0, model="m", lora="a")
    assert hashes[5] == ref.block_hashes(tokens.tolist(), 16, seed)
    assert seed == ref.namespace_seed(0, model="m", lora="a")


def test_short_input_gives_empty_array() -> None:
    for tokens in ([], [1, 2, 3], np.zeros(0, dtype=np.int32)):
        out = llmsched.block_hashes(tokens, 4)
        assert out.dtype == np.uint64
        assert out.shape == (0,)


# --- input forms ---------------------------------------------------------------------------

TOKENS = [int(t) for t in np.random.default_rng(1).integers(0, 120, size=70)]
EXPECT = ref.block_hashes(TOKENS, 8, 3)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_integer_dtype(dtype: Any) -> None:
    assert llmsched.block_hashes(np.asarray(TOKENS, dtype=dtype), 8, seed=3).tolist() == EXPECT


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: (x for x in t),
        lambda t: array.array("I", t),
        lambda t: array.array("q", t),
        lambda t: memoryview(array.array("H", t)),
        lambda t: memoryview(array.array("B", t)),  # format "B": one byte per token
        lambda t: np.asarray(t, dtype=">u4"),  # non-native byte order
        lambda t: np.repeat(np.asarray(t, dtype=np.int32), 2)[::2],  # strided view
        lambda t: np.asarray(t, dtype=np.int64).view(np.int64),
    ],
    ids=[
        "list",
        "tuple",
        "generator",
        "array-I",
        "array-q",
        "memoryview-H",
        "memoryview-B",
        "big-endian",
        "strided",
        "view",
    ],
)
def test_input_forms(make: Any) -> None:
    assert llmsched.block_hashes(make(TOKENS), 8, seed=3).tolist() == EXPECT


def test_range_input() -> None:
    assert llmsched.block_hashes(range(70), 8).tolist() == ref.block_hashes(list(range(70)), 8)


def test_read_only_array() -> None:
    arr = np.asarray(TOKENS, dtype=np.uint32)
    arr.flags.writeable = False
    assert llmsched.block_hashes(arr, 8, seed=3).tolist() == EXPECT


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_numpy_input_is_read_in_place(dtype: Any) -> None:
    tokens = np.arange(1_000_000, dtype=dtype) % 50_000
    llmsched.block_hashes(tokens)  # warm up imports and caches
    tracemalloc.start()
    try:
        llmsched.block_hashes(tokens)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A copy or conversion of the input would show as an allocation of its size.
    assert peak < tokens.nbytes // 4


def test_as_token_array_does_not_copy_contiguous_input() -> None:
    arr = np.arange(10, dtype=np.int16)
    assert llmsched._tokens.as_token_array(arr) is arr
    buf = array.array("I", range(10))
    assert np.shares_memory(llmsched._tokens.as_token_array(buf), np.frombuffer(buf, np.uint32))


# --- rejected input --------------------------------------------------------------------------


def stable_id(value: object) -> str:
    """A test id that is the same in every process (a memoryview's repr holds its address,
    and pytest-xdist's workers must collect the same ids)."""
    if isinstance(value, memoryview):
        access = "ro" if value.readonly else "rw"
        return f"memoryview-{value.format}-{value.nbytes}-{access}"
    return repr(value)


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array([1, 2], dtype=object),
        np.array(["a", "b"]),
        [1.5, 2],
        [1, 2.0],
        [True, False],
        [1, None],
        ["a"],
        "hello",
        b"\x01\x02",
        bytearray(b"\x01\x02"),
        memoryview(array.array("d", [1.0])),
        3,
        None,
    ],
    ids=stable_id,
)
def test_non_integer_input_raises_type_error(tokens: Any) -> None:
    with pytest.raises(TypeError):
        llmsched.block_hashes(tokens)
    with pytest.raises(TypeError):
        llmsched.block_hashes(tokens, algo="vllm_sha256_cbor")


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        (set(range(16)), "no defined order"),
        (frozenset(range(16)), "no defined order"),
        ({i: 0 for i in range(16)}, "iterates over its keys"),
        (memoryview(bytes(range(16))), "raw bytes"),
        (memoryview(bytearray(16)), "raw bytes"),
        (memoryview(bytes(range(16)))[2:], "raw bytes"),
        (np.ma.masked_array(np.arange(16), mask=[False] * 15 + [True]), "masked array"),
    ],
    ids=stable_id,
)
def test_unordered_raw_byte_and_masked_input_is_refused(tokens: Any, match: str) -> None:
    # Each was hashed before: a set in its iteration order, a dict's keys, a memoryview of
    # bytes as uint8 ids (while bytes were refused), a masked array with its mask ignored.
    for call in (
        lambda: llmsched.block_hashes(tokens),
        lambda: llmsched.block_hashes(tokens, algo="vllm_sha256_cbor"),
        lambda: llmsched.PrefixIndex().hash_tokens(tokens),
    ):
        with pytest.raises(InvalidTypeError, match=match):
            call()


def test_raw_bytes_hash_once_their_width_is_given() -> None:
    raw = np.arange(64, dtype=np.uint32).tobytes()
    expected = llmsched.block_hashes(range(64)).tolist()
    assert llmsched.block_hashes(memoryview(raw).cast("I")).tolist() == expected
    assert llmsched.block_hashes(np.frombuffer(raw, dtype=np.uint32)).tolist() == expected


def test_text_input_error_points_to_text_hashing() -> None:
    with pytest.raises(TypeError, match="text_block_hashes"):
        llmsched.block_hashes("some prompt")


@pytest.mark.parametrize(
    "tokens", [np.zeros((2, 16), dtype=np.int32), [[1, 2], [3, 4]], np.int64(5)], ids=repr
)
def test_not_one_dimensional_raises_value_error(tokens: Any) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        llmsched.block_hashes(tokens)


@pytest.mark.parametrize("algo", llmsched.hashing.ALGORITHMS)
@pytest.mark.parametrize(
    ("tokens", "position", "value"),
    [
        (np.array([1, -1, 2, 3], dtype=np.int32), 1, -1),
        (np.array([1, 2, 3, 2**32], dtype=np.uint64), 3, 2**32),
        (np.array([0] * 40 + [-7], dtype=np.int8), 40, -7),  # in the unhashed tail
        ([5, 6, 2**32], 2, 2**32),
        ([5, 2**70, 6], 1, 2**70),  # beyond int64: numpy makes an object array
        ([-1, 2**63], 0, -1),  # numpy makes a float array
        ([3, 4, 2**64 + 1], 2, 2**64 + 1),
    ],
)
def test_out_of_range_ids_name_position_and_value(
    tokens: Any, position: int, value: int, algo: llmsched.hashing.Algorithm
) -> None:
    snapshot = np.array(tokens, dtype=object).copy()
    with pytest.raises(InvalidTokenError, match=rf"{value} at position {position}\b") as info:
        llmsched.block_hashes(tokens, 4, algo=algo)
    assert isinstance(info.value, ValueError)
    assert (np.array(tokens, dtype=object) == snapshot).all()  # input untouched


@pytest.mark.parametrize("block_size", [0, -1, -(2**70), 2**64])
def test_bad_block_size_raises_value_error(block_size: int) -> None:
    for fn in (llmsched.block_hashes, llmsched.vllm_block_digests, llmsched.block_hashes_batch):
        with pytest.raises(ValueError, match="block_size"):
            fn([[1, 2]] if fn is llmsched.block_hashes_batch else [1, 2], block_size)
    with pytest.raises(ValueError, match="block_size"):
        llmsched.text_block_hashes("abc", block_size)


@pytest.mark.parametrize("block_size", [1.0, True, "16", None])
def test_non_int_block_size_raises_type_error(block_size: Any) -> None:
    with pytest.raises(TypeError, match="block_size"):
        llmsched.block_hashes([1, 2], block_size)


def test_bad_seeds() -> None:
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            llmsched.block_hashes([1, 2], seed=seed)
    with pytest.raises(TypeError, match="seed must be an int"):
        llmsched.block_hashes([1, 2], seed="0")
    with pytest.raises(TypeError, match="PYTHONHASHSEED"):
        llmsched.block_hashes([1, 2], seed=0, algo="vllm_sha256_cbor")
    with pytest.raises(TypeError, match="seed must be a str"):
        llmsched.vllm_none_hash(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        llmsched.text_block_hashes("abc", seed="x")  # type: ignore[arg-type]


def test_bad_namespace_names() -> None:
    with pytest.raises(TypeError, match="lora"):
        llmsched.block_hashes([1, 2], lora=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_salt"):
        llmsched.block_hashes([1, 2], cache_salt=b"x", algo="vllm_sha256_cbor")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model is not part of vLLM"):
        llmsched.block_hashes([1, 2], model="m", algo="vllm_sha256_cbor")


def test_unknown_algo() -> None:
    with pytest.raises(ConfigError, match="unknown hash algo 'sha1'"):
        llmsched.block_hashes([1, 2], algo="sha1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        llmsched.block_hashes_batch([[1, 2]], algo="md5")  # type: ignore[arg-type]


def test_errors_leave_no_state_behind() -> None:
    tokens = np.arange(64, dtype=np.int64)
    before = llmsched.block_hashes(tokens).tolist()
    bad = tokens.copy()
    bad[63] = -1
    with pytest.raises(InvalidTokenError):
        llmsched.block_hashes(bad)
    with pytest.raises(InvalidTokenError):
        llmsched.block_hashes_batch([tokens, bad])
    assert bad[63] == -1 and (bad[:63] == tokens[:63]).all()
    assert llmsched.block_hashes(tokens).tolist() == before


# --- text ----------------------------------------------------------------------------------

PROMPT = "You are a helpful assistant. Answer briefly. ünïcödé ✓ 🚀 " * 13


@pytest.mark.parametrize("include_partial", [True, False])
@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_text_matches_twin(include_partial: bool, block_size: int) -> None:
    got = llmsched.text_block_hashes(
        PROMPT, block_size, seed=9, lora="x", include_partial=include_partial
    )
    chain_seed = ref.namespace_seed(9, lora="x")
    expect = ref.text_block_hashes(PROMPT, block_size, chain_seed, include_partial)
    assert got.tolist() == expect


def test_text_partial_block_and_cap() -> None:
    n_tokens = len(llmsched.pack_text(PROMPT))
    assert n_tokens % 64 != 0
    full = llmsched.text_block_hashes(PROMPT, 64)
    with_tail = llmsched.text_block_hashes(PROMPT, 64, include_partial=True)
    assert len(full) == n_tokens // 64
    assert len(with_tail) == len(full) + 1
    assert with_tail[:-1].tolist() == full.tolist()
    capped = llmsched.text_block_hashes(PROMPT, 64, include_partial=True, max_tokens=100)
    expect = llmsched.text_block_hashes(PROMPT.encode()[:400], 64, include_partial=True)
    assert capped.tolist() == expect.tolist()
    assert llmsched.text_block_hashes(PROMPT, max_tokens=0).tolist() == []
    assert llmsched.text_block_hashes("").tolist() == []


def test_text_defaults_are_the_index_s_and_llm_d_mode_is_opt_in() -> None:
    long = "x" * (4 * 131_072 + 400)
    # No cap by default (the router hashes every pseudo-token); llm-d's cap when asked.
    assert len(llmsched.text_block_hashes(long)) == (131_072 + 100) // 16
    llm_d = llmsched.text_block_hashes(
        long, 64, include_partial=True, max_tokens=llmsched.hashing.TEXT_MAX_TOKENS
    )
    assert len(llm_d) == 131_072 // 64
    assert llmsched.text_block_hashes(PROMPT).tolist() == (
        llmsched.block_hashes(llmsched.pack_text(PROMPT)).tolist()
    )


def test_text_bytes_equal_str_and_pack_text() -> None:
    assert (
        llmsched.text_block_hashes(PROMPT, include_partial=True).tolist()
        == llmsched.text_block_hashes(PROMPT.encode(), include_partial=True).tolist()
    )
    packed = llmsched.pack_text(PROMPT)
    assert packed.dtype == np.uint32
    assert packed.tolist() == ref.pack_text(PROMPT)
    assert llmsched.pack_text(b"abcde").tolist() == [
        int.from_bytes(b"abcd", "little"),
        ord("e"),
    ]
    full = llmsched.text_block_hashes(PROMPT, 16, include_partial=False)
    assert full.tolist() == llmsched.block_hashes(packed, 16).tolist()


def test_text_errors() -> None:
    with pytest.raises(TypeError, match="text must be str or bytes"):
        llmsched.text_block_hashes(["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text must be str or bytes"):
        llmsched.pack_text(bytearray(b"ab"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        llmsched.text_block_hashes("abc", max_tokens=-1)
    with pytest.raises(TypeError, match="include_partial"):
        llmsched.text_block_hashes("abc", include_partial="yes")  # type: ignore[arg-type]
    # No UTF-8 bytes: llmsched's error (a ValueError), naming where.
    with pytest.raises(
        llmsched.InvalidValueError, match="UTF-8: surrogates not allowed at position 15"
    ):
        llmsched.text_block_hashes("lone surrogate \ud800")
    with pytest.raises(llmsched.InvalidValueError, match="UTF-8"):
        llmsched.pack_text("\ud800")
    with pytest.raises(llmsched.InvalidValueError, match="UTF-8"):
        llmsched.Router(llmsched.EndpointPool(["a"])).pick(text="\udc00 x")


# --- batch ---------------------------------------------------------------------------------


def _prompts() -> list[Any]:
    rng = np.random.default_rng(7)
    out: list[Any] = []
    for i in range(40):
        arr = rng.integers(0, 50_000, size=int(rng.integers(0, 300)))
        out.append(arr.astype(INT_DTYPES[i % len(INT_DTYPES)]) % 120 if i % 5 else arr.tolist())
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batch_equals_one_by_one_xxh3(threads: int) -> None:
    prompts = _prompts()
    got = llmsched.block_hashes_batch(prompts, 16, seed=4, lora="l", threads=threads)
    assert len(got) == len(prompts)
    for p, h in zip(prompts, got, strict=True):
        assert h.dtype == np.uint64
        assert h.tolist() == llmsched.block_hashes(p, 16, seed=4, lora="l").tolist()


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_equals_one_by_one_vllm(threads: int) -> None:
    prompts = _prompts()[:10]
    kw: dict[str, Any] = {"seed": "0", "lora": "a", "cache_salt": "s"}
    got = llmsched.block_hashes_batch(prompts, 16, algo="vllm_sha256_cbor", threads=threads, **kw)
    for p, h in zip(prompts, got, strict=True):
        expect = ref.vllm_block_hashes(np.asarray(p).tolist(), 16, "0", "a", "s")
        assert h.tolist() == expect


def test_batch_default_equals_two_threads() -> None:
    prompts = [np.arange(n, dtype=np.uint32) % 999 for n in range(20_000, 20_030)]
    two = llmsched.block_hashes_batch(prompts, threads=2)
    default = llmsched.block_hashes_batch(prompts)
    assert [h.tolist() for h in two] == [h.tolist() for h in default]
    assert [h.tolist() for h in default] == [llmsched.block_hashes(p).tolist() for p in prompts]


def test_batch_errors_name_the_prompt() -> None:
    good = np.arange(64, dtype=np.int64)
    bad = good.copy()
    bad[17] = -3
    for threads in (1, 2):
        with pytest.raises(InvalidTokenError, match=r"prompt 2: token id -3 at position 17"):
            llmsched.block_hashes_batch([good, good, bad, good, bad], threads=threads)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llmsched.block_hashes_batch([good, [1.5]])
    with pytest.raises(TypeError, match="prompts must be a list"):
        llmsched.block_hashes_batch(good)
    for threads in (0, 5000):
        with pytest.raises(ValueError, match="threads"):
            llmsched.block_hashes_batch([good], threads=threads)
    with pytest.raises(TypeError, match="threads"):
        llmsched.block_hashes_batch([good], threads=None)  # type: ignore[arg-type]
    assert llmsched.block_hashes_batch([]) == []


def test_concurrent_calls_agree_with_sequential() -> None:
    prompts = [np.arange(5_000, dtype=np.uint32) * (i + 1) % 40_000 for i in range(8)]
    expect = [llmsched.block_hashes(p).tolist() for p in prompts]
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        for _ in range(20):
            results[i] = llmsched.block_hashes(prompts[i]).tolist()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(prompts))] == expect


def test_a_lone_surrogate_in_the_vllm_seed_is_named() -> None:
    """Probe 49 F2: the vLLM seed was a bare UnicodeEncodeError (LoRA names were checked)."""
    with pytest.raises(llmsched.InvalidValueError, match=r"^seed must be valid UTF-8"):
        llmsched.block_hashes(range(64), seed="0\ud800", algo="vllm_sha256_cbor")
    with pytest.raises(llmsched.InvalidValueError, match=r"^seed must be valid UTF-8"):
        llmsched.hashing.vllm_none_hash("0\ud800")
