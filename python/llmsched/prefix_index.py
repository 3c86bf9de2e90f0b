"""The prefix index: which worker holds which cached prefix.

A concurrent compressed radix tree over chained block hashes (see :mod:`llmsched.hashing`). Fed
by the engines (:meth:`PrefixIndex.store`, :meth:`PrefixIndex.apply_vllm_events`: confirmed
holdings) or by the router's own decisions (:meth:`PrefixIndex.record`: approximate holdings that
expire), and queried with :meth:`PrefixIndex.match` on every request.

>>> import numpy as np
>>> from llmsched import PrefixIndex
>>> index = PrefixIndex(block_size=4)
>>> prompt = np.arange(40, dtype=np.uint32)
>>> index.store("replica-a", index.hash_tokens(prompt))
10
>>> index.store("replica-b", index.hash_tokens(prompt[:20]))
5
>>> index.match_tokens(prompt).as_dict()
{'replica-a': 10, 'replica-b': 5}
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias, Union

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched._copying import by_value
from llmsched._llmsched import PrefixMatch
from llmsched._tokens import TokensLike, native_tokens
from llmsched.errors import InvalidTypeError, InvalidValueError
from llmsched.hashing import DEFAULT_BLOCK_SIZE, text_block_hashes
from llmsched.types import ApplyReport, IndexStats
from llmsched.validation import (
    check_block_size,
    check_bytes,
    check_id,
    check_int,
    check_int_like,
    check_iterable,
    check_now,
    check_number_like,
    check_optional_str,
    check_seed,
    check_str,
    is_bool,
)

__all__ = ["DEFAULT_RECORD_TTL_S", "PrefixIndex", "PrefixMatch", "Tier", "Worker"]

Worker = int | str
"""A worker's name: any int (64-bit) or str, chosen by the caller."""

Tier = Literal["gpu", "cpu", "storage"]
"""Where a cached block lives (vLLM's ``medium``)."""

HashesLike: TypeAlias = Union["npt.NDArray[np.integer[Any]]", Iterable["int | np.integer[Any]"]]
"""Block hashes: a numpy ``uint64`` array (read in place), another integer array or an integer
buffer such as ``array.array("Q")`` (converted or wrapped), a list or tuple of ints in
``0..2**64-1`` (read natively in one pass), or any other iterable of ints."""

_INT_FORMATS = frozenset("bBhHiIlLqQnN")  # struct codes of integer buffers

DEFAULT_RECORD_TTL_S = 60.0
"""How long a routing decision noted by :meth:`PrefixIndex.record` counts, unless confirmed."""


def as_hash_array(hashes: HashesLike, what: str = "hashes") -> npt.NDArray[np.uint64]:
    """Return ``hashes`` as a 1-D contiguous, aligned ``uint64`` array, copying only when needed.

    >>> as_hash_array([1, 2]).dtype
    dtype('uint64')
    """
    arr: npt.NDArray[np.uint64]
    if isinstance(hashes, np.ndarray):
        if hashes.dtype.kind == "i" and hashes.size and (hashes < 0).any():
            raise InvalidValueError(f"{what} must be non-negative 64-bit ints")
        if hashes.dtype.kind not in "iu":
            raise InvalidTypeError(f"{what} must be integers, got dtype {hashes.dtype}")
        arr = hashes.astype(np.uint64, copy=False)  # no copy when already uint64
    else:
        if isinstance(hashes, (bytes, bytearray, str)):
            raise InvalidTypeError(
                f"{what} must be a sequence of ints, got {type(hashes).__name__}"
            )
        if not isinstance(hashes, (list, tuple)):
            try:
                view = memoryview(hashes)  # type: ignore[arg-type]
            except TypeError:
                pass
            else:  # a buffer of integers (array.array, ...): wrapped without copying
                if view.format.lstrip("@=<>!") not in (
                    "b",
                    "B",
                    "h",
                    "H",
                    "i",
                    "I",
                    "l",
                    "L",
                    "q",
                    "Q",
                    "n",
                    "N",
                ):
                    raise InvalidTypeError(
                        f"{what} must be integers, got buffer format {view.format!r}"
                    )
                return as_hash_array(np.asarray(view), what)
        if not isinstance(hashes, Iterable):
            raise InvalidTypeError(
                f"{what} must be a sequence of ints, got {type(hashes).__name__}"
            )
        items = list(hashes)
        if any(isinstance(h, bool) or not isinstance(h, (int, np.integer)) for h in items):
            raise InvalidTypeError(f"{what} must be ints")
        try:
            arr = np.array(items, dtype=np.uint64)
        except OverflowError:
            raise InvalidValueError(f"{what} must be ints in 0..2**64-1") from None
    if arr.ndim != 1:
        raise InvalidValueError(f"{what} must be one-dimensional, got {arr.ndim} dimensions")
    if not (arr.flags.c_contiguous and arr.flags.aligned):
        arr = np.require(arr, requirements=["C", "A"])
    return arr


class PrefixIndex:
    """A concurrent prefix index over chained block hashes.

    Args:
        block_size: tokens per block. Engines' block sizes must be multiples of it for their
            KV events to apply.
        seed: base seed of every hash chain.
        model: model name folded into the chain seed.
        worker_capacity: blocks each worker may hold; beyond it the worker's least recently used
            blocks are evicted (always from the tail, so holdings stay prefix-closed).
        max_bytes: bytes the whole index may use, as ``stats()["bytes"]`` counts them (its hash
            tables as allocated: they grow by doubling and never shrink, so a doubling makes
            room by evicting); beyond it the globally least recently used leaves are evicted.

    One index may be shared by many threads: matches run in parallel, writes are serialised,
    and every call that grows with its input releases the GIL.

    Hashing: :meth:`hash_tokens` and :meth:`hash_text` are the index's one way to turn a prompt
    into block hashes; ``Router.pick(tokens=/text=/messages=)`` hashes the same way, and
    :func:`~llmsched.block_hashes` / :func:`~llmsched.text_block_hashes` agree when given the
    index's ``block_size``, ``seed`` and ``model``.

    >>> PrefixIndex(block_size=16).block_size
    16
    """

    __slots__ = (
        "_cap_watch",
        "_extra_keys",
        "_lock",
        "_mismatch",
        "_multimodal",
        "_native",
        "_replaced_warned",
    )

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        seed: int = 0,
        model: str | None = None,
        worker_capacity: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        check_block_size(block_size)
        check_seed(seed)
        check_optional_str("model", model)
        for name, value in (("worker_capacity", worker_capacity), ("max_bytes", max_bytes)):
            if isinstance(value, bool):  # an int to Python: True would bound the index to 1
                raise InvalidTypeError(f"{name} must be an int or None, got bool")
            if value is not None and (not isinstance(value, int) or not 1 <= value < 2**64):
                raise InvalidValueError(
                    f"{name} must be a positive int (below 2**64) or None, got {value!r}"
                )
        self._native = _llmsched.PrefixIndex(block_size, seed, model, worker_capacity, max_bytes)
        self._init_state()

    def _init_state(self) -> None:
        # Free-threaded 3.14: every match loads this object; see `_share_between_threads`.
        _llmsched._share_between_threads(self)
        self._lock = threading.Lock()
        self._mismatch: dict[Worker, int] = {}  # stored events skipped for their size, by worker
        # Stored events skipped for extra keys no request names / for content keys, by worker.
        self._extra_keys: dict[Worker, int] = {}
        self._multimodal: dict[Worker, int] = {}
        # Whether a store should look for a cap too small for one block (warned once).
        self._cap_watch = self._native.max_bytes is not None
        self._replaced_warned = False

    @classmethod
    def _wrap(cls, native: _llmsched.PrefixIndex) -> PrefixIndex:
        self = cls.__new__(cls)
        self._native = native
        self._init_state()
        return self

    @property
    def fed_by_engine_events(self) -> bool:
        """Whether engine KV events (real token ids) have been applied to this index."""
        return self._native.event_batches > 0

    @property
    def native(self) -> _llmsched.PrefixIndex:
        """The native index (what the router and the native KV-event feed work on)."""
        return self._native

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._native.block_size

    @property
    def seed(self) -> int:
        """Base seed of every hash chain."""
        return self._native.seed

    @property
    def model(self) -> str | None:
        """Model name folded into the chain seed."""
        return self._native.model

    @property
    def worker_capacity(self) -> int | None:
        """Blocks each worker may hold (None: no bound)."""
        return self._native.worker_capacity

    @property
    def max_bytes(self) -> int | None:
        """Bytes the whole index may use (None: no bound)."""
        return self._native.max_bytes

    def hash_tokens(
        self, tokens: TokensLike, *, lora: str | None = None, cache_salt: str | None = None
    ) -> npt.NDArray[np.uint64]:
        """Chained block hashes of ``tokens`` in this index's namespace.

        >>> len(PrefixIndex(block_size=4).hash_tokens(range(10)))
        2
        """
        try:
            return self._native.hash_tokens(native_tokens(tokens), lora, cache_salt)
        except TypeError:
            _check_namespace(lora, cache_salt)
            raise

    def hash_text(
        self, text: str | bytes, *, lora: str | None = None, cache_salt: str | None = None
    ) -> npt.NDArray[np.uint64]:
        """Chained block hashes of raw text in this index's namespace: its UTF-8 bytes packed
        4 per pseudo-token (:func:`~llmsched.pack_text`), full blocks only. The same hashes as
        ``Router.pick(text=text)`` matches and as ``text_block_hashes(text, index.block_size,
        seed=index.seed, model=index.model)``.

        Pseudo-tokens never equal an engine's token ids: an index fed by KV events holds no
        blocks these hashes can match (tokenize with :mod:`llmsched.tokenize` instead).

        >>> index = PrefixIndex(block_size=4)
        >>> len(index.hash_text("0123456789abcdef" * 2))  # 32 bytes = 8 pseudo-tokens
        2
        """
        return text_block_hashes(
            text,
            self.block_size,
            seed=self.seed,
            model=self.model,
            lora=lora,
            cache_salt=cache_salt,
        )

    def store(
        self, worker: Worker, hashes: HashesLike, parent: int | None = None, tier: Tier = "gpu"
    ) -> int:
        """Record that ``worker`` holds ``hashes`` on ``tier``: a chain starting at the root, or
        continuing after block ``parent`` (which ``worker`` must hold). Returns the blocks
        ``worker`` newly holds. Raises UnknownBlockError or HashChainError, changing nothing.

        >>> index = PrefixIndex(block_size=2)
        >>> h = index.hash_tokens([1, 2, 3, 4, 5, 6])
        >>> index.store(0, h[:2]), index.store(0, h[2:], parent=int(h[1]))
        (2, 1)
        """
        if (
            parent is not None
            and type(parent) not in (int, bool)
            and hasattr(type(parent), "__index__")
        ):
            parent = operator.index(parent)  # a numpy integer: its range is checked as an int's
        if type(parent) is int and not 0 <= parent < 2**64:
            raise InvalidValueError(f"parent must be a block hash in 0..2**64-1, got {parent}")
        if is_bool(parent):  # the native side would read it as block 0 or 1
            raise InvalidTypeError("parent must be a block hash (an int) or None, got bool")
        try:
            added = self._native.store(worker, hashes, parent, tier)
        except TypeError:  # name what the native conversion refused
            check_int_like("parent", parent, optional=True)
            check_str("tier", tier)
            raise
        if self._cap_watch:
            self._check_cap()
        return added

    def record(
        self,
        worker: Worker,
        hashes: HashesLike,
        ttl_s: float = DEFAULT_RECORD_TTL_S,
        *,
        now: float | None = None,
    ) -> int:
        """Note a routing decision: ``worker`` will soon hold ``hashes`` (from the root). The
        holding is approximate: it stops counting after ``ttl_s`` seconds unless an engine
        confirms it. ``now`` defaults to ``time.monotonic()``.

        >>> index = PrefixIndex(block_size=2)
        >>> index.record("a", index.hash_tokens([1, 2, 3, 4]), ttl_s=5.0, now=0.0)
        2
        >>> index.match_tokens([1, 2, 3, 4], now=4.0).longest
        2
        >>> index.match_tokens([1, 2, 3, 4], now=6.0).longest
        0
        """
        now = _now(now)
        if is_bool(ttl_s):  # the native side would read it as 1 second
            check_number_like("ttl_s", ttl_s)
        try:
            added = self._native.record(worker, hashes, ttl_s, now)
        except (TypeError, OverflowError):  # OverflowError: an int beyond a float's range
            check_number_like("ttl_s", ttl_s)
            raise
        if self._cap_watch:
            self._check_cap()
        return added

    def _check_cap(self) -> None:
        """Warns once that ``max_bytes`` evicted every block (``stats()['max_bytes_emptied']``):
        a cap too small for one block makes every store evict what it stored."""
        if not self._native.max_bytes_emptied:
            return
        self._cap_watch = False
        import logging  # only on this rare path: `import llmsched` stays light

        logging.getLogger("llmsched").warning(
            "prefix index: max_bytes=%d evicted every block the index held, those just stored "
            "with them (see stats()['max_bytes_emptied']): the cap is too small for what was "
            "stored and the index matches nothing. Raise max_bytes (an index of a few blocks "
            "takes a few hundred bytes)",
            self._native.max_bytes,
        )

    def remove(self, worker: Worker, hashes: HashesLike, tier: Tier | None = None) -> int:
        """Drop ``worker``'s holding of each block (of ``tier`` only, if given); a block left in
        no tier is dropped with everything below it. Every block must be held, or
        UnknownBlockError is raised and nothing changes. Returns the blocks dropped.
        """
        try:
            return self._native.remove(worker, hashes, tier)
        except TypeError:
            check_optional_str("tier", tier)
            raise

    def clear(self, worker: Worker) -> int:
        """Drop everything ``worker`` holds (it stays registered). Returns the blocks dropped.

        Matches stop seeing the worker's blocks at once. A worker holding more than 4,096
        blocks has them dropped 4,096 at a time with the index's lock (and the GIL) released
        between steps, so that other threads' matches wait for one step, not for the whole
        clear; writes for this worker from other threads land after the clear. The count
        returned is every block the clear dropped, also those of steps that another thread
        (a :meth:`dumps`, a write for this worker) took to finish it.
        """
        return self._native.clear(worker)

    def remove_worker(self, worker: Worker) -> int:
        """Drop everything ``worker`` holds and forget it. Returns the blocks dropped.

        Large holdings are dropped in steps, as by :meth:`clear`.
        """
        return self._native.remove_worker(worker)

    def set_capacity(self, worker: Worker, blocks: int | None) -> int:
        """Set (or lift, with None) ``worker``'s capacity in blocks; returns blocks evicted.
        A worker not known yet is registered (it holds nothing; the capacity holds from its
        first block on), unlike :meth:`clear` and :meth:`remove_worker`, which refuse it.

        >>> index = PrefixIndex(block_size=2)
        >>> index.set_capacity("new", 8), index.workers()
        (0, ['new'])
        """
        if blocks is not None:
            if isinstance(blocks, bool) or not isinstance(blocks, int):
                raise InvalidTypeError(
                    f"blocks must be an int or None, got {type(blocks).__name__}"
                )
            if not 1 <= blocks < 2**64:
                raise InvalidValueError(
                    f"capacity must be a positive int (below 2**64) or None, got {blocks!r}"
                )
        return self._native.set_capacity(worker, blocks)

    def match(self, hashes: HashesLike, *, now: float | None = None) -> PrefixMatch:
        """The leading blocks of ``hashes`` each worker holds, overall and per tier, as a native
        :class:`PrefixMatch` that makes Python objects only for what is read (``longest``,
        ``best``, ``top(k)``, ``m[worker]``, numpy columns, ``as_dict()``).

        >>> index = PrefixIndex(block_size=2)
        >>> h = index.hash_tokens([1, 2, 3, 4])
        >>> _ = index.store("a", h)
        >>> index.match(h).as_dict()
        {'a': 2}
        """
        # `_now` inlined: this is the per-request call, and a frame is a third of its cost
        # when the query is short.
        if now is None:
            now = time.monotonic()
        elif type(now) is not float or not 0.0 <= now < _INF:
            now = check_now(now)
        return self._native.match_hashes(hashes, now)

    def match_tokens(
        self,
        tokens: TokensLike,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        now: float | None = None,
    ) -> PrefixMatch:
        """Hash ``tokens`` in this index's namespace and match them, in one native call."""
        if now is None:  # `_now` inlined, as in `match`
            now = time.monotonic()
        elif type(now) is not float or not 0.0 <= now < _INF:
            now = check_now(now)
        if type(tokens) is not list and type(tokens) is not tuple:
            tokens = native_tokens(tokens)  # a list or tuple goes as it is (see native_tokens)
        try:
            return self._native.match_tokens(tokens, lora, cache_salt, now)
        except TypeError:
            _check_namespace(lora, cache_salt)
            raise

    def match_many(
        self, queries: Iterable[HashesLike], *, now: float | None = None
    ) -> list[PrefixMatch]:
        """:meth:`match` for many queries in one call (one GIL release)."""
        listed = check_iterable("queries", queries)
        now = _now(now)
        try:
            return self._native.match_many(listed, now)
        except (TypeError, ValueError):
            for i, query in enumerate(listed):  # name the query the native reader refused
                as_hash_array(query, f"queries[{i}]")
            raise

    def match_tokens_many(
        self,
        prompts: Iterable[TokensLike],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        now: float | None = None,
    ) -> list[PrefixMatch]:
        """:meth:`match_tokens` for many prompts (hashing releases the GIL per prompt).

        >>> index = PrefixIndex(block_size=2)
        >>> _ = index.store("a", index.hash_tokens([1, 2, 3, 4]))
        >>> [m.longest for m in index.match_tokens_many([[1, 2, 3, 4], [9, 9]])]
        [2, 0]
        """
        now = _now(now)
        _check_namespace(lora, cache_salt)
        native = self._native
        hashes = [
            native.hash_tokens(native_tokens(p, f"prompts[{i}]"), lora, cache_salt)
            for i, p in enumerate(check_iterable("prompts", prompts))
        ]
        return native.match_many(hashes, now)

    def apply_vllm_events(self, worker: Worker, payload: bytes) -> ApplyReport:
        """Decode a vLLM ``EventBatch`` msgpack payload and apply it for ``worker`` atomically.

        Both event encodings are accepted (array-encoded before vLLM 0.24, map-encoded since).
        Blocks are keyed by this index's own hash of each event's ``token_ids``, so the engine's
        hash algorithm and seed never matter. A stored event whose parent is unknown, or a
        removal of an unknown block, is skipped and counted in the returned report, as are events
        of KV-cache groups other than group 0 (hybrid models repeat their events per group) and
        stored blocks whose extra keys no request's hashes can name: ``multimodal`` where a key
        stands for content beside the tokens (images, prompt embeddings), ``extra_keys`` where
        the keys are strings other than the LoRA name and a root block's cache salt (which the
        index hashes as a request naming them is), or the adapter is named only by its number
        (both counted per worker in :meth:`stats`; the second warned of, see
        :meth:`note_extra_keys`). A malformed payload raises MalformedEventError and changes
        nothing.

        An ``AllBlocksCleared`` for a worker holding more than 4,096 blocks is applied as
        :meth:`clear` does, in steps: the events up to it apply at once, the rest once the
        cleared blocks are dropped.
        """
        if type(payload) is not bytes:
            payload = check_bytes("payload", payload)
        report = self._native.apply_vllm_events(worker, payload)
        skipped = report["block_size_mismatch"]
        if skipped:
            self.note_block_size_mismatch(worker, skipped)
        if report["extra_keys"]:
            self.note_extra_keys(worker, report["extra_keys"])
        if report["multimodal"]:
            self.note_multimodal(worker, report["multimodal"])
        if report["replaced"] and not self._replaced_warned:
            self.note_replaced_engine_blocks(worker, report["replaced"])
        if self._cap_watch:
            self._check_cap()
        return report

    def note_replaced_engine_blocks(self, worker: Worker, replaced: int) -> None:
        """Warns, the first time only, that ``worker`` stored ``replaced`` engine block hashes
        again with other token content. The index counts them itself as it applies the events
        (``stats()['replaced_engine_blocks']``); this is the warning alone.
        :meth:`apply_vllm_events` calls it; so does a feed that applies events natively
        (:class:`~llmsched.integrations.NativeKVEventSubscriber`).

        >>> index = PrefixIndex(block_size=16)
        >>> index.note_replaced_engine_blocks("w", 1)  # logged on the "llmsched" logger
        >>> index.stats()["replaced_engine_blocks"]  # the index's own count, not this call's
        0
        """
        check_id("worker", worker)
        check_int("replaced", replaced)
        with self._lock:
            if self._replaced_warned or not replaced:
                return
            self._replaced_warned = True
        import logging  # only on this rare path: `import llmsched` stays light

        logging.getLogger("llmsched").warning(
            "prefix index: worker %r stored %d engine block hash(es) again with other token "
            "content (see stats()['replaced_engine_blocks']): the index keeps the newer "
            "content and drops the older. Two engines reporting as one worker, or engine "
            "block hashes that do not cover the blocks' content, cause this",
            worker,
            replaced,
        )

    def note_block_size_mismatch(self, worker: Worker, skipped: int) -> None:
        """Counts stored events of ``worker`` skipped because the engine's block size is not a
        multiple of :attr:`block_size` (``stats()['block_size_mismatch']``), warning the first
        time for each worker. :meth:`apply_vllm_events` calls it; so does a feed that applies
        events natively (:class:`~llmsched.integrations.NativeKVEventSubscriber`).

        >>> index = PrefixIndex(block_size=16)
        >>> index.note_block_size_mismatch("w", 2)
        >>> index.stats()["block_size_mismatch"]
        {'w': 2}
        """
        check_id("worker", worker)
        check_int("skipped", skipped)
        with self._lock:
            first = worker not in self._mismatch
            self._mismatch[worker] = self._mismatch.get(worker, 0) + skipped
        if first:
            # Every later event of this worker is skipped too: its prefix hits are lost.
            import logging  # only on this rare path: `import llmsched` stays light

            logging.getLogger("llmsched").warning(
                "prefix index: the engine block size of worker %r is not a multiple of the "
                "index block size %d: its stored events are skipped (%d so far, see "
                "stats()['block_size_mismatch']) and its cache is never matched. Give the "
                "index a block size that divides the engine's (vLLM's --block-size)",
                worker,
                self.block_size,
                skipped,
            )

    def note_extra_keys(self, worker: Worker, skipped: int) -> None:
        """Counts stored events of ``worker`` skipped for extra keys no request's hashes can
        name (``stats()['extra_keys']``: string keys other than the LoRA name and a root
        block's cache salt, or an adapter named only by its ``lora_id``), warning the first
        time for each worker: each is a prefix hit lost. :meth:`apply_vllm_events` calls it;
        so does a feed that applies events natively.

        >>> index = PrefixIndex(block_size=16)
        >>> index.note_extra_keys("w", 2)
        >>> index.extra_keys()
        {'w': 2}
        """
        check_id("worker", worker)
        check_int("skipped", skipped)
        with self._lock:
            first = worker not in self._extra_keys
            self._extra_keys[worker] = self._extra_keys.get(worker, 0) + skipped
        if first:
            import logging  # only on this rare path: `import llmsched` stays light

            logging.getLogger("llmsched").warning(
                "prefix index: stored KV events of worker %r carry extra keys the index cannot "
                "name (%d skipped so far, see stats()['extra_keys']): those blocks are never "
                "matched. Send the LoRA adapter's name (vLLM 0.20 or later names it in its "
                "events) and no keys beside it and a prompt's cache salt",
                worker,
                skipped,
            )

    def note_multimodal(self, worker: Worker, skipped: int) -> None:
        """Counts stored events of ``worker`` skipped because their extra keys stand for
        content beside their tokens (``stats()['multimodal']``: images, prompt embeddings).
        Not warned of: no configuration makes them match a prompt's token hashes.

        >>> index = PrefixIndex(block_size=16)
        >>> index.note_multimodal("w", 1)
        >>> index.stats()["multimodal"]
        {'w': 1}
        """
        check_id("worker", worker)
        check_int("skipped", skipped)
        with self._lock:
            self._multimodal[worker] = self._multimodal.get(worker, 0) + skipped

    def extra_keys(self) -> dict[Worker, int]:
        """``stats()['extra_keys']`` alone: per worker, the stored events skipped for extra keys
        no request's hashes can name (see :meth:`note_extra_keys`).

        >>> PrefixIndex(block_size=16).extra_keys()
        {}
        """
        with self._lock:
            return dict(self._extra_keys)

    def block_size_mismatch(self) -> dict[Worker, int]:
        """``stats()['block_size_mismatch']`` alone, without the rest of :meth:`stats`: per
        worker, the stored events skipped because the engine's block size is not a multiple of
        :attr:`block_size`.

        >>> index = PrefixIndex(block_size=16)
        >>> index.block_size_mismatch()
        {}
        """
        with self._lock:
            return dict(self._mismatch)

    def expire(self, *, now: float | None = None) -> int:
        """Drop approximate holdings that have expired; returns the blocks dropped."""
        return self._native.expire(_now(now))

    def holdings(self, worker: Worker) -> dict[int, tuple[list[str], bool]]:
        """Every block ``worker`` holds: ``{hash: (tiers, confirmed)}``."""
        return self._native.holdings(worker)

    def workers(self) -> list[Worker]:
        """The registered workers."""
        return self._native.workers()

    def stats(self) -> IndexStats:
        """Counts (workers, nodes, blocks, holdings, per-worker blocks) and estimated bytes;
        ``event_batches``: engine KV-event batches applied; ``block_size_mismatch``: per worker,
        the stored events skipped because the engine's block size is not a multiple of
        :attr:`block_size` (a warning is logged the first time for each worker);
        ``extra_keys`` and ``multimodal``: per worker, the stored events skipped for extra keys
        no request names (warned of, :meth:`note_extra_keys`) and for keys standing for content
        beside the tokens (:meth:`note_multimodal`); ``max_bytes_emptied``: times ``max_bytes``
        evicted every block (a cap too small for one block; warned of once);
        ``replaced_engine_blocks``: engine hashes a worker stored again with other content, the
        older blocks released (warned of once). The counters (``evicted_blocks`` and those
        from ``event_batches`` on) count what this object saw: :meth:`loads` and unpickling
        start them from 0 and warn again (see :class:`~llmsched.types.IndexStats`).
        """
        stats = self._native.stats()
        with self._lock:
            stats["event_batches"] = self._native.event_batches
            stats["block_size_mismatch"] = dict(self._mismatch)
            stats["extra_keys"] = dict(self._extra_keys)
            stats["multimodal"] = dict(self._multimodal)
        return stats

    def dumps(self) -> bytes:
        """Serialise the index's content (approximate holdings keep their remaining lifetime);
        not its counters (:meth:`stats`), which count what one object saw."""
        return self._native.dumps(time.monotonic())

    @classmethod
    def loads(cls, data: bytes) -> PrefixIndex:
        """Rebuild an index from :meth:`dumps` output; SnapshotError if it is corrupt. Its
        counters (:meth:`stats`) start from 0, as a new index's.

        >>> index = PrefixIndex(block_size=2)
        >>> _ = index.store(1, index.hash_tokens([5, 6, 7, 8]))
        >>> PrefixIndex.loads(index.dumps()).match_tokens([5, 6, 7, 8]).as_dict()
        {1: 2}
        """
        return cls._wrap(_llmsched.PrefixIndex.loads(check_bytes("data", data), time.monotonic()))

    def __reduce__(self) -> tuple[Callable[[bytes], PrefixIndex], tuple[bytes]]:
        """Pickled as its :meth:`dumps` snapshot (a multiprocessing worker gets a copy).

        >>> import pickle
        >>> index = PrefixIndex(block_size=2)
        >>> _ = index.store("w", index.hash_tokens([1, 2, 3, 4]))
        >>> pickle.loads(pickle.dumps(index)).match_tokens([1, 2, 3, 4]).as_dict()
        {'w': 2}
        """
        return (PrefixIndex.loads, (self.dumps(),))

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PrefixIndex(block_size={self.block_size}, workers={s['workers']}, "
            f"blocks={s['blocks']}, nodes={s['nodes']})"
        )


_INF = math.inf


def _check_namespace(lora: object, cache_salt: object) -> None:
    check_optional_str("lora", lora)
    check_optional_str("cache_salt", cache_salt)


def _now(now: float | None) -> float:
    # The common cases inline (every match passes through here), the rest through check_now.
    if now is None:
        return time.monotonic()
    if type(now) is float and 0.0 <= now < _INF:
        return now
    return check_now(now)


by_value(PrefixIndex, PrefixIndex.__reduce__)  # its snapshot
