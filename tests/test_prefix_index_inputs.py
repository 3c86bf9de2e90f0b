"""Input forms of PrefixIndex: lists, tuples, array.array and numpy arrays give one result, and a
bad element raises the same error whichever form it comes in, changing nothing."""

from __future__ import annotations

import array
import pickle
from typing import Any

import numpy as np
import pytest

from llmsched import PrefixIndex, errors, namespace_seed


def loaded() -> tuple[PrefixIndex, np.ndarray, np.ndarray]:
    index = PrefixIndex(block_size=4)
    tokens = np.random.default_rng(0).integers(0, 128_000, size=400, dtype=np.uint32)
    hashes = index.hash_tokens(tokens)
    index.store("a", hashes)
    index.store(7, hashes[:30])
    return index, tokens, hashes


def state(index: PrefixIndex) -> tuple[object, ...]:
    return index.stats(), {w: index.holdings(w) for w in index.workers()}


def unaligned(values: np.ndarray) -> np.ndarray:
    """``values`` in an array whose data starts one byte into its buffer (not aligned)."""
    buf = bytearray(values.nbytes + 1)
    out = np.frombuffer(buf, dtype=values.dtype, offset=1, count=len(values))
    out[:] = values
    assert not out.flags.aligned
    return out


def forms(values: np.ndarray, code: str) -> list[Any]:
    return [
        unaligned(values),
        values,
        values.tolist(),
        tuple(values.tolist()),
        array.array(code, values.tolist()),
        memoryview(array.array(code, values.tolist())),
        iter(values.tolist()),
        values.astype(np.int64) if code == "I" else values.astype(">u8"),
        np.repeat(values, 2)[::2],
    ]


def test_every_token_form_hashes_and_matches_alike() -> None:
    index, tokens, hashes = loaded()
    want = index.match_tokens(tokens).as_dict()
    assert want == {"a": 100, 7: 30}
    for form in forms(tokens, "I"):
        assert index.hash_tokens(form).tolist() == hashes.tolist()
    for form in forms(tokens, "I"):
        assert index.match_tokens(form).as_dict() == want


def test_every_hash_form_matches_alike() -> None:
    index, _tokens, hashes = loaded()
    want = index.match(hashes).as_dict()
    for form in forms(hashes, "Q"):
        assert index.match(form).as_dict() == want
    assert [m.as_dict() for m in index.match_many(forms(hashes, "Q")[:4])] == [want] * 4


def test_large_token_ids_and_hashes_in_lists() -> None:
    index = PrefixIndex(block_size=2)
    tokens = [0, 1, 2**30 - 1, 2**30, 2**31 + 5, 2**32 - 1]
    assert (
        index.hash_tokens(tokens).tolist()
        == index.hash_tokens(np.array(tokens, dtype=np.uint32)).tolist()
    )
    # Ints of zero, one, two and three 30-bit digits, each read at its value.
    hashes = [0, 1, 2**30, 2**60 + 7, 2**64 - 1, 2**59 + 3]
    index.store("w", hashes)
    assert sorted(index.holdings("w")) == sorted(hashes)
    assert index.match(np.array(hashes, dtype=np.uint64)).as_dict() == {"w": 6}
    assert index.match(hashes).as_dict() == {"w": 6}
    assert index.match(tuple(hashes)).as_dict() == {"w": 6}


class MyInt(int):
    pass


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([1, -1], errors.InvalidTokenError),
        ([1, 2**32], errors.InvalidTokenError),
        ([1, 2**70], errors.InvalidTokenError),
        ([1, 2.0], TypeError),
        ([1, None], TypeError),
        (["a"], TypeError),
        ([True, False], TypeError),
        ((1, -5), errors.InvalidTokenError),
        ((1, "x"), TypeError),
    ],
    ids=repr,
)
def test_bad_token_lists_raise_as_before(bad: list[Any], error: type[Exception]) -> None:
    index, _tokens, _hashes = loaded()
    before = state(index)
    with pytest.raises(error):
        index.match_tokens(bad)
    with pytest.raises(error):
        index.hash_tokens(bad)
    assert state(index) == before


def test_token_list_elements_the_general_path_accepts_still_work() -> None:
    index, _tokens, _hashes = loaded()
    plain = index.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8]).tolist()
    assert index.hash_tokens([MyInt(1), 2, 3, 4, 5, 6, 7, 8]).tolist() == plain
    assert index.hash_tokens([np.uint32(1), 2, 3, 4, 5, 6, 7, 8]).tolist() == plain


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([1, -1], errors.InvalidValueError),
        ([1, 2**64], errors.InvalidValueError),
        ([1, 2.0], TypeError),
        ([1, None], TypeError),
        ([True], TypeError),
        ((1, "x"), TypeError),
        (array.array("d", [1.0]), TypeError),
        (b"\x01", TypeError),
    ],
    ids=repr,
)
def test_bad_hash_lists_raise_and_change_nothing(bad: Any, error: type[Exception]) -> None:
    index, _tokens, hashes = loaded()
    before = state(index)
    for call in (
        lambda: index.match(bad),
        lambda: index.store("a", bad),
        lambda: index.store("new", bad),
        lambda: index.record("a", bad, now=0.0),
        lambda: index.remove("a", bad),
        lambda: index.match_many([hashes, bad]),
    ):
        with pytest.raises(error):
            call()
    assert state(index) == before


class MyList(list):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_token_lists_hashed_while_read_agree_with_arrays(block_size: int) -> None:
    # A list is hashed block by block as it is read: every length (empty, shorter than a block,
    # whole blocks, a trailing partial block), ids of one and two 30-bit digits, and each
    # namespace give the hashes of the same ids as an array.
    index = PrefixIndex(block_size=block_size, model="m")
    rng = np.random.default_rng(block_size)
    # The reader asks for the int objects 256 items ahead of the one it reads: lengths about
    # that window and well beyond it too.
    windows = (255, 256, 257, 259, 260, 261, 263, 4 * 256 + block_size + 1)
    for n in (0, 1, block_size - 1, block_size, 5 * block_size, 5 * block_size + 2, *windows):
        # Mostly two-digit ids (2**30 and above), and mostly one-digit ids (read four at a
        # time) with zeros and two-digit ids among them.
        wide = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
        wide[::7] = rng.integers(0, 2**30, size=len(wide[::7]), dtype=np.uint32)
        narrow = rng.integers(1, 128_000, size=n, dtype=np.uint32)
        narrow[::5] = 0
        narrow[3::11] = 2**32 - 1
        for ids in (wide, narrow):
            for ns in ({}, {"lora": "l"}, {"cache_salt": "s"}):
                want = index.hash_tokens(ids, **ns).tolist()
                assert index.hash_tokens(ids.tolist(), **ns).tolist() == want
                assert index.hash_tokens(MyList(ids.tolist()), **ns).tolist() == want
    tokens = rng.integers(0, 128_000, size=10 * block_size + block_size // 2, dtype=np.uint32)
    index.store("a", index.hash_tokens(tokens))
    assert index.match_tokens(tokens.tolist()).as_dict() == {"a": 10}
    assert index.match_tokens(tokens.tolist(), lora="l").as_dict() == {}


@pytest.mark.parametrize("at", [0, 255, 256, 1_000, 1_999, 2_043, 2_046])
def test_a_bad_id_in_a_long_token_list_raises_and_changes_nothing(at: int) -> None:
    # Read with its objects fetched ahead (a hint): a bad id before, inside or past the last
    # stretch fetched ahead still raises and leaves the index unchanged.
    index, _tokens, _hashes = loaded()
    ids: list[Any] = np.random.default_rng(at).integers(1, 128_000, size=2_047).tolist()
    ids[at] = -5
    before = state(index)
    with pytest.raises(errors.InvalidTokenError, match=f"position {at}"):
        index.match_tokens(ids)
    ids[at] = "7"
    with pytest.raises(TypeError):
        index.hash_tokens(ids)
    assert state(index) == before


@pytest.mark.parametrize("where", ["first", "middle block", "last block", "tail"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (-1, errors.InvalidTokenError),
        (2**32, errors.InvalidTokenError),
        (None, TypeError),
        (True, TypeError),
        (1.0, TypeError),
    ],
)
def test_a_bad_id_anywhere_in_a_token_list_raises_and_changes_nothing(
    where: str, bad: Any, error: type[Exception]
) -> None:
    # Blocks before the bad id have been hashed by then: the call still raises the general
    # path's error naming it, and the index is as it was.
    index, tokens, _hashes = loaded()
    ids: list[Any] = tokens[:43].tolist()  # 10 blocks of 4 and a tail of 3
    at = {"first": 0, "middle block": 17, "last block": 39, "tail": 41}[where]
    ids[at] = bad
    before = state(index)
    named = f"position {at}" if error is errors.InvalidTokenError else None
    with pytest.raises(error, match=named):
        index.match_tokens(ids)
    with pytest.raises(error):
        index.hash_tokens(ids)
    assert state(index) == before


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_list_read_floor_reads_every_value_and_refuses_what_the_readers_refuse(
    prefetch: bool,
) -> None:
    """``_read_list_floor`` (the benchmark's floor of a cold list) reads every item's value,
    of every size the list readers take, in lists longer and shorter than its prefetch
    distance, and refuses anything but a list of exact ints in ``0..2**64``."""
    from llmsched import _llmsched

    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 300, 5_000):
        ids = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True).tolist()
        ids[: n // 3] = [i % 2**30 for i in ids[: n // 3]]  # one-digit ints too
        ids[n // 3 : n // 2] = [i % 2**60 for i in ids[n // 3 : n // 2]]  # and two-digit
        assert _llmsched._read_list_floor(ids, prefetch) == sum(ids) % 2**64
    for bad in ([1, -1], [1, 2**64], [1, True], [1, 2.0], (1, 2), np.arange(3), None):
        with pytest.raises(TypeError, match="list of ints"):
            _llmsched._read_list_floor(bad, prefetch)  # type: ignore[arg-type]


def test_an_object_shared_between_threads_is_still_freed() -> None:
    """``_share_between_threads`` (deferred reference counting on free-threaded 3.14, a no-op
    elsewhere) leaves an object to the collector, which frees it."""
    import gc
    import weakref

    from llmsched import _llmsched

    class Held:
        pass

    obj = Held()
    _llmsched._share_between_threads(obj)
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    assert ref() is None
    index = PrefixIndex(block_size=4)  # the wrapper and the native index are shared so
    index.store("a", index.hash_tokens(list(range(8))))
    assert index.match_tokens(list(range(8))).as_dict() == {"a": 2}


@pytest.mark.parametrize("at", [0, 7, 29, 30, 63, 64, 99])
@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, errors.InvalidValueError), (2**64, errors.InvalidValueError), ("x", TypeError)],
)
def test_a_bad_hash_anywhere_in_a_list_raises_and_changes_nothing(
    at: int, bad: Any, error: type[Exception]
) -> None:
    # Before, inside and past the native reader's first stretch of items fetched ahead (64),
    # within and past worker 7's 30 blocks of worker "a"'s 100.
    index, _tokens, hashes = loaded()
    items: list[Any] = hashes.tolist()
    items[at] = bad
    before = state(index)
    with pytest.raises(error):
        index.match(items)
    assert state(index) == before


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 30, 31, 100])
@pytest.mark.parametrize("changed", [None, 0, 5, 8, 29, 30, 64])
def test_hash_lists_match_as_their_arrays_do(length: int, changed: int | None) -> None:
    # Queries that end, or leave the tree, before, at and after the end of worker 7's holding
    # (30 blocks) and the native reader's first stretch of items fetched ahead (64).
    index, _tokens, hashes = loaded()
    query = hashes[:length].copy()
    if changed is not None and changed < length:
        query[changed] ^= np.uint64(1)
    want = index.match(query, now=0.0)
    got = index.match(query.tolist(), now=0.0)
    assert got.as_dict() == want.as_dict()
    assert (got.query_blocks, got.tree_blocks) == (want.query_blocks, want.tree_blocks)


def test_an_index_pickles_as_its_snapshot_and_surrogate_names_are_refused() -> None:
    """Probe 48 F8: pickling failed on the index's lock; a lone surrogate in a model name was
    a builtin UnicodeEncodeError."""
    index = PrefixIndex(block_size=4, model="m", worker_capacity=100)
    hashes = index.hash_tokens(list(range(40)))
    index.store("w", hashes)
    index.record(3, hashes[:5], ttl_s=60)
    copy = pickle.loads(pickle.dumps(index))
    assert (copy.block_size, copy.model, copy.worker_capacity) == (4, "m", 100)
    assert copy.match(hashes).as_dict() == index.match(hashes).as_dict()
    for name in ("model", "lora", "cache_salt"):
        with pytest.raises(errors.InvalidValueError, match=name):
            namespace_seed(**{name: "a\ud800"})
