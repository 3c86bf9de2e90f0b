"""Chained block hashing of token sequences and raw text.

Two algorithms, chosen with ``algo``:

``"xxh3"`` (the default, fast) is defined exactly, so any language can reproduce it: tokens are
cut into full blocks of ``block_size`` (a trailing partial block is not hashed); with
``h[-1] = chain_seed``, block ``i`` hashes to ``xxh3_64(bytes(block_i), seed=h[i-1])`` where
``bytes(block_i)`` is each token as an unsigned 32-bit little-endian integer. Equal hashes mean
equal prefixes. ``chain_seed`` is ``seed`` itself when no model, LoRA or cache salt is given;
otherwise ``xxh3_64(ns, seed=seed)`` where ``ns`` concatenates, for model, LoRA name and cache
salt in that order, one byte (0 absent, 1 present) and, if present, the UTF-8 length as u32
little-endian followed by the UTF-8 bytes. So different models, adapters or tenants never share
a hash.

``"vllm_sha256_cbor"`` reproduces vLLM's ``sha256_cbor`` prefix-cache hash bit for bit:
``h[i] = sha256(cbor([h[i-1], [block tokens], extra_keys or None]))`` over full blocks with
canonical CBOR, ``h[-1] = NONE_HASH = sha256(cbor(seed))``, ``seed`` the string vLLM hashes
(``$PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` in recent releases). Extra keys
supported: the LoRA name on every block and the cache salt on the first block (when non-empty),
as vLLM orders them; multimodal and prompt-embedding keys are not supported. ``block_hashes``
returns the 64-bit form vLLM publishes in KV events (the digest's last 8 bytes, big-endian);
:func:`vllm_block_digests` returns the 32-byte digests. An engine's events carry these only
under ``--prefix-caching-hash-algo sha256_cbor``: vLLM's default ``sha256`` hashes pickled
objects, and its ``xxhash`` variants take a random seed per process unless ``PYTHONHASHSEED``
is set (the prefix index hashes the events' token ids, so it never needs the engine's hashes).

Token input: a numpy integer array of any width (read in place, never copied when 1-D,
contiguous and native-endian), any integer buffer (``array.array``, ``memoryview``) or a list
of ints. Floats, bools, strings, raw bytes (``bytes``, ``bytearray`` or a ``memoryview`` of them
not cast to a token width), sets and mappings (no defined order) and numpy masked arrays raise
:class:`~llmsched.errors.InvalidTypeError` (a ``TypeError``); ids outside ``0..2**32-1`` anywhere in
the input (also in the unhashed tail) raise :class:`~llmsched.errors.InvalidTokenError` (a
``ValueError``) naming position and value; ``block_size < 1`` raises ``ValueError``.

>>> import numpy as np
>>> h = block_hashes(np.arange(40, dtype=np.uint32), block_size=16)
>>> h.dtype, len(h)
(dtype('uint64'), 2)
>>> int(block_hashes(range(32), algo="vllm_sha256_cbor")[1])
17911472383915781900
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched._tokens import TokensLike, as_token_array, native_tokens
from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError
from llmsched.validation import check_block_size, check_int, check_seed, check_utf8

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BLOCK_SIZE",
    "TEXT_MAX_TOKENS",
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "Algorithm",
    "block_hashes",
    "block_hashes_batch",
    "namespace_seed",
    "pack_text",
    "text_block_hashes",
    "vllm_block_digests",
    "vllm_none_hash",
]

Algorithm = Literal["xxh3", "vllm_sha256_cbor"]
ALGORITHMS: tuple[Algorithm, ...] = ("xxh3", "vllm_sha256_cbor")
"""The block hash algorithms, default first."""

VLLM_DEFAULT_NONE_HASH_SEED: str = _llmsched.VLLM_DEFAULT_NONE_HASH_SEED
"""The seed string vLLM hashes into ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset."""

TEXT_MAX_TOKENS = 131_072
"""llm-d's approximate mode's cap on pseudo-tokens hashed per text (pass it as ``max_tokens``)."""

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block when none is given: the same in :func:`block_hashes`,
:func:`text_block_hashes` and :class:`~llmsched.PrefixIndex` (vLLM's default block size)."""


def namespace_seed(
    seed: int = 0,
    *,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> int:
    """The xxh3 chain seed that folds a model, LoRA adapter and cache salt into ``seed``.

    >>> namespace_seed(7)
    7
    >>> namespace_seed(7, lora="a") != namespace_seed(7, lora="b")
    True
    """
    check_seed(seed)
    _check_names(model=model, lora=lora, cache_salt=cache_salt)
    return _llmsched.namespace_seed(seed, model, lora, cache_salt)


def block_hashes(
    tokens: TokensLike,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: int | str | None = None,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
    algo: Algorithm = "xxh3",
) -> npt.NDArray[np.uint64]:
    """One chained hash per full block of ``tokens``, as a numpy ``uint64`` array.

    ``seed``: for ``"xxh3"`` an int in ``0..2**64-1`` (default 0); for ``"vllm_sha256_cbor"``
    the string vLLM hashes into ``NONE_HASH`` (default ``"vllm-none-hash"``; pass the engine's
    ``PYTHONHASHSEED`` string when it sets one). ``model`` is part of the xxh3 namespace only;
    vLLM's hash has no model component, so passing it with ``"vllm_sha256_cbor"`` raises
    :class:`~llmsched.errors.ConfigError`. See the module docs for the exact definitions.

    >>> len(block_hashes(list(range(33)), block_size=16))
    2
    >>> a = block_hashes(range(32), lora="math")
    >>> b = block_hashes(range(32), lora="code")
    >>> bool((a != b).all())
    True
    """
    check_block_size(block_size)
    arr = native_tokens(tokens)
    if _check_algo(algo) == "xxh3":
        chain_seed = _xxh3_chain_seed(seed, model, lora, cache_salt)
        return _llmsched.xxh3_block_hashes(arr, block_size, chain_seed)
    vllm_seed = _vllm_seed(seed, model, lora, cache_salt)
    return _llmsched.vllm_block_hashes(arr, block_size, vllm_seed, lora, cache_salt)


def vllm_block_digests(
    tokens: TokensLike,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM's ``sha256_cbor`` block hashes as the 32-byte digests vLLM keys its cache by.

    ``block_hashes(..., algo="vllm_sha256_cbor")`` gives the same chain in its 64-bit event
    form: ``int.from_bytes(digest[-8:], "big")``.

    >>> d = vllm_block_digests(range(32))
    >>> d[0].hex()[:16], len(d[0])
    ('dc918a88b139e5af', 32)
    >>> int.from_bytes(d[1][-8:], "big") == int(block_hashes(range(32), algo="vllm_sha256_cbor")[1])
    True
    """
    check_block_size(block_size)
    arr = as_token_array(tokens)
    vllm_seed = _vllm_seed(seed, None, lora, cache_salt)
    return _llmsched.vllm_block_digests(arr, block_size, vllm_seed, lora, cache_salt)


def vllm_none_hash(seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH = sha256(cbor(seed))``, the parent hash of every first block.

    >>> vllm_none_hash().hex()[:16]
    '9bd96a485ad84efd'
    """
    return _llmsched.vllm_none_hash(_vllm_seed(seed, None, None, None))


def text_block_hashes(
    text: str | bytes,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: int = 0,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
    include_partial: bool = False,
    max_tokens: int | None = None,
) -> npt.NDArray[np.uint64]:
    """Chained xxh3 hashes of raw text, for approximate prefix routing without a tokenizer.

    The UTF-8 bytes (``bytes`` are taken as already encoded) are packed 4 per pseudo-token
    (:func:`pack_text`), as llm-d's approximate mode does; the first ``max_tokens``
    pseudo-tokens (``None``, the default: all) are hashed in blocks of ``block_size`` with the
    xxh3 chain of :func:`block_hashes` and the same namespace seed.

    The defaults are those of :meth:`PrefixIndex.hash_text <llmsched.PrefixIndex.hash_text>`
    and ``Router.pick(text=...)``: with the index's ``block_size``, ``seed`` and ``model``, all
    three give the same hashes for the same text. ``include_partial=True``,
    ``block_size=64`` and ``max_tokens=TEXT_MAX_TOKENS`` give llm-d's approximate mode instead:
    a trailing partial block is hashed too, over its pseudo-tokens' bytes, so it ends the
    array (those hashes never match an index's full-block ones). Zero padding makes a text
    and the same text plus 1-3 NUL bytes ending in the same pseudo-token hash alike.

    >>> text = "You are a helpful assistant. " * 20
    >>> len(text_block_hashes(text))  # 580 bytes = 145 pseudo-tokens = 9 full blocks of 16
    9
    >>> len(text_block_hashes(text, 64, include_partial=True))  # 2 full blocks + a partial one
    3
    >>> bool((text_block_hashes(text) == block_hashes(pack_text(text))).all())
    True
    """
    check_block_size(block_size)
    if not isinstance(include_partial, bool):
        raise InvalidTypeError(
            f"include_partial must be a bool, got {type(include_partial).__name__}"
        )
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, minimum=0)
    _check_text(text)
    chain_seed = namespace_seed(seed, model=model, lora=lora, cache_salt=cache_salt)
    try:
        return _llmsched.text_block_hashes(
            text, block_size, chain_seed, include_partial, max_tokens
        )
    except UnicodeEncodeError as exc:
        raise _unencodable(exc) from None


def pack_text(text: str | bytes) -> npt.NDArray[np.uint32]:
    """The UTF-8 bytes of ``text`` packed 4 per ``uint32`` pseudo-token, little-endian.

    The last pseudo-token is zero-padded. ``bytes`` are taken as already encoded.

    >>> pack_text("hello").tolist() == [int.from_bytes(b"hell", "little"), ord("o")]
    True
    """
    _check_text(text)
    try:
        return _llmsched.pack_text(text)
    except UnicodeEncodeError as exc:
        raise _unencodable(exc) from None


def block_hashes_batch(
    prompts: Sequence[TokensLike],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: int | str | None = None,
    model: str | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
    algo: Algorithm = "xxh3",
    threads: int = 1,
) -> list[npt.NDArray[np.uint64]]:
    """:func:`block_hashes` of many prompts in one call, with the GIL released throughout.

    Every prompt may have its own length and integer dtype; all share the block size and
    namespace. ``threads`` splits the batch across that many threads (one by default: on a
    busy 2-core machine a second thread measured slower up to 640,000 tokens and only
    sometimes faster, up to 1.6x, at 2.5 million; try 2 where cores sit idle and batches are
    large). If any prompt is bad the call raises, naming the prompt, and returns nothing.

    >>> out = block_hashes_batch([range(32), range(48)], block_size=16)
    >>> [len(h) for h in out]
    [2, 3]
    >>> bool((out[1][:2] == out[0]).all())
    True
    """
    check_block_size(block_size)
    check_int("threads", threads, minimum=1, maximum=1024)
    if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
        raise InvalidTypeError(
            f"prompts must be a list of token sequences, got {type(prompts).__name__}"
        )
    arrays = [as_token_array(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    if _check_algo(algo) == "xxh3":
        chain_seed = _xxh3_chain_seed(seed, model, lora, cache_salt)
        return _llmsched.xxh3_block_hashes_batch(arrays, block_size, chain_seed, threads)
    vllm_seed = _vllm_seed(seed, model, lora, cache_salt)
    return _llmsched.vllm_block_hashes_batch(
        arrays, block_size, vllm_seed, lora, cache_salt, threads
    )


def _xxh3_chain_seed(
    seed: int | str | None, model: str | None, lora: str | None, cache_salt: str | None
) -> int:
    if isinstance(seed, str):
        raise InvalidTypeError(
            "seed must be an int for algo='xxh3' (a str seed is for vLLM's hash)"
        )
    seed = 0 if seed is None else seed
    if model is None and lora is None and cache_salt is None:
        check_seed(seed)  # no namespace: the seed is the chain seed (saves a native call)
        return seed
    return namespace_seed(seed, model=model, lora=lora, cache_salt=cache_salt)


def _vllm_seed(
    seed: int | str | None, model: str | None, lora: str | None, cache_salt: str | None
) -> str:
    if seed is None:
        seed = VLLM_DEFAULT_NONE_HASH_SEED
    if not isinstance(seed, str):
        raise InvalidTypeError(
            "seed must be a str for algo='vllm_sha256_cbor': the string vLLM hashes into "
            f"NONE_HASH, e.g. the engine's PYTHONHASHSEED such as '0'; got {type(seed).__name__}"
        )
    if model is not None:
        raise ConfigError(
            "model is not part of vLLM's block hash (it covers tokens, LoRA name and cache "
            "salt only); leave model=None with algo='vllm_sha256_cbor'"
        )
    _check_names(seed=seed, lora=lora, cache_salt=cache_salt)
    return seed


def _check_algo(algo: object) -> Algorithm:
    if algo == "xxh3":
        return "xxh3"
    for known in ALGORITHMS:
        if algo == known:
            return known
    raise ConfigError(f"unknown hash algo {algo!r}; expected one of {', '.join(ALGORITHMS)}")


def _check_names(**names: str | None) -> None:
    for name, value in names.items():
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidTypeError(f"{name} must be a str or None, got {type(value).__name__}")
        check_utf8(name, value)  # a lone surrogate: no bytes to hash


def _unencodable(exc: UnicodeEncodeError) -> InvalidValueError:
    """A text with no UTF-8 bytes (a lone surrogate), named."""
    return InvalidValueError(
        f"text must be encodable as UTF-8: {exc.reason} at position {exc.start}"
    )


def _check_text(text: object) -> None:
    if not isinstance(text, (str, bytes)):
        raise InvalidTypeError(f"text must be str or bytes, got {type(text).__name__}")
