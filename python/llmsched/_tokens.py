"""Normalising token input for the native module.

Accepted, in order of preference:

- a numpy array of any integer dtype (``int8`` .. ``uint64``): read in place when it is 1-D,
  C-contiguous and in native byte order, else copied once;
- any object exporting the buffer protocol with an integer format (``array.array``,
  ``memoryview``, ...): wrapped without copying;
- a list, tuple, range or other iterable of Python ints: converted once.

Rejected with ``TypeError``: floats, bools, strings, raw bytes -- ``bytes``, ``bytearray`` and a
``memoryview`` of them in its own byte format (their token width is ambiguous; wrap them with
``numpy.frombuffer(buf, dtype=...)`` or ``memoryview(buf).cast("I")``) --, sets and mappings
(no defined token order; a mapping iterates over its keys), numpy masked arrays (the mask
would be ignored; pass ``arr.compressed()``), and anything else that is not integers. Ids
outside ``0..2**32-1`` raise :class:`~llmsched.errors.InvalidTokenError` naming the position
and value; for numpy input the native code checks them while hashing.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, NoReturn, TypeAlias, Union

import numpy as np
import numpy.typing as npt

from llmsched.errors import InvalidTokenError, InvalidTypeError, InvalidValueError
from llmsched.validation import describe_int

TokensLike: TypeAlias = Union[
    "npt.NDArray[np.integer[Any]]",
    "array.array[int]",
    memoryview,
    Sequence[int],
    Iterable["int | np.integer[Any]"],
]
"""Token ids, in order of preference: a numpy integer array (read in place), a buffer of
integers (``array.array``, ``memoryview``, ...), a sequence of ints, or any iterable of ints.
``str``, ``bytes`` and floats are refused at run time (see the module docs)."""

MAX_TOKEN_ID = 0xFFFFFFFF
"""The largest token id (ids are unsigned 32-bit integers)."""


def as_token_array(tokens: TokensLike, what: str = "tokens") -> npt.NDArray[np.integer]:
    """Return ``tokens`` as a 1-D C-contiguous numpy integer array, copying only when needed.

    >>> as_token_array([1, 2, 3]).dtype
    dtype('int64')
    >>> import array
    >>> as_token_array(array.array("I", [7, 8])).dtype
    dtype('uint32')
    """
    if isinstance(tokens, np.ma.MaskedArray):
        raise InvalidTypeError(
            f"{what}: a masked array's mask would be ignored; pass arr.compressed() or "
            "arr.filled(value)"
        )
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple, range)):
        arr = _from_ints(tokens, what)
    elif isinstance(tokens, str):
        raise InvalidTypeError(
            f"{what} must be token ids, got str; hash raw text with text_block_hashes"
        )
    elif isinstance(tokens, (bytes, bytearray)) or _is_raw_bytes_view(tokens):
        # memoryview(b"...") reads as uint8 ids; refused as the bytes themselves are.
        raise InvalidTypeError(
            f"{what}: raw bytes ({type(tokens).__name__}) are ambiguous; wrap them with "
            'numpy.frombuffer(buf, dtype=...) or memoryview(buf).cast("I")'
        )
    elif isinstance(tokens, (Set, Mapping)):
        reason = (
            "a mapping iterates over its keys"
            if isinstance(tokens, Mapping)
            else ("a set has no defined order")
        )
        raise InvalidTypeError(
            f"{what} must be an ordered sequence of token ids, got {type(tokens).__name__} "
            f"({reason})"
        )
    else:
        arr = _from_other(tokens, what)
    return _checked(arr, what)


def native_tokens(
    tokens: TokensLike, what: str = "tokens"
) -> npt.NDArray[np.integer] | list[int] | tuple[int, ...]:
    """``tokens`` as the native module takes them: a list or tuple as it is (the native code
    reads its ints in one pass and falls back to :func:`as_token_array` for anything it
    refuses, so errors are the same), anything else through :func:`as_token_array`.

    >>> native_tokens([1, 2])
    [1, 2]
    """
    if type(tokens) is list or type(tokens) is tuple:
        return tokens
    return as_token_array(tokens, what)


def _is_raw_bytes_view(tokens: object) -> bool:
    """A memoryview of ``bytes``/``bytearray`` in their own byte format (not cast)."""
    return (
        isinstance(tokens, memoryview)
        and isinstance(tokens.obj, (bytes, bytearray))
        and tokens.format in ("B", "c")
    )


def _from_other(tokens: object, what: str) -> npt.NDArray[Any]:
    """A buffer (wrapped in place) or an iterable of ints (converted)."""
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]
    except TypeError:
        if isinstance(tokens, Iterable):
            return _from_ints(list(tokens), what)
        raise InvalidTypeError(
            f"{what} must be a numpy integer array, a buffer of integers or a sequence of ints, "
            f"got {type(tokens).__name__}"
        ) from None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as exc:
        raise InvalidTypeError(
            f"{what}: unsupported buffer format {view.format!r}: {exc}"
        ) from None


def _from_ints(values: Sequence[Any], what: str) -> npt.NDArray[Any]:
    """A numpy array of the Python ints in ``values`` (no silent float or bool conversion)."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.uint32)
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidTypeError(f"{what} must be a flat sequence of ints: {exc}") from None
    if arr.dtype.kind in "iu":
        # numpy reads a bool among ints as 0 or 1: refuse it as a bool alone is refused.
        if any(isinstance(v, (bool, np.bool_)) for v in values):
            _raise_for_elements(values, what)
        return arr
    if arr.dtype.kind in "fO":
        # numpy falls back to float or object for ints beyond int64/uint64 too: tell apart
        # an out-of-range id from a non-integer element.
        _raise_for_elements(values, what)
    raise InvalidTypeError(f"{what} must be integers, got elements of dtype {arr.dtype}")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _raise_for_elements(values: Iterable[Any], what: str) -> NoReturn:
    """Raise for the first element that is not an int in range."""
    for position, value in enumerate(values):
        if not _is_int(value):
            raise InvalidTypeError(f"{what}[{position}] must be an int, got {type(value).__name__}")
    raise_out_of_range(values, what)


def _checked(arr: npt.NDArray[Any], what: str) -> npt.NDArray[np.integer]:
    if arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidValueError(f"{what} must be one-dimensional, got {arr.ndim} dimensions")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not (arr.flags.c_contiguous and arr.flags.aligned):
        arr = np.require(arr, requirements=["C", "A"])
    return arr


def _shown(value: int) -> str:
    """``value``'s digits, or its size when Python refuses to print it (past
    ``sys.get_int_max_str_digits()`` digits ``str`` raises a bare ValueError)."""
    try:
        return str(value)
    except ValueError:
        return describe_int(value)


def raise_out_of_range(tokens: Iterable[Any], what: str) -> NoReturn:
    """Raise InvalidTokenError naming the first id outside 0..2**32-1."""
    for position, value in enumerate(tokens):
        if not 0 <= int(value) <= MAX_TOKEN_ID:
            raise InvalidTokenError(
                f"{what}: token id {_shown(int(value))} at position {position} is out of range "
                f"(0 to {MAX_TOKEN_ID})"
            )
    raise InvalidTokenError(f"{what}: token id out of range (0 to {MAX_TOKEN_ID})")
