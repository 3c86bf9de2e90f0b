"""The argument rules every component shares: times, sizes, probabilities and ids.

Each check either returns the value in its canonical Python type or raises, naming the argument
and the value; nothing is clamped or rounded. One rule per kind of value, used everywhere, so
``PrefixIndex.record(now=...)``, ``Router.pick(now=...)``, ``FlowController.enqueue(now=...)``
and ``SliceTracker.step(now=...)`` accept and refuse exactly the same clocks.

* ``now``: an ``int`` or ``float`` (not ``bool``), finite and ``>= 0``, in seconds on the
  caller's monotonic clock; ``None`` reads the clock.
* sizes and counts: an ``int`` (not ``bool``) within the stated bounds.
* probabilities and fractions: a finite number in ``[0, 1]``.
* ids (workers, endpoints): an ``int`` that fits 64 bits signed, or a ``str``.
* names and text: a ``str``; payloads: ``bytes`` (or a ``bytearray`` or ``memoryview``). A
  ``str`` the native core keeps must encode as UTF-8 (:func:`check_utf8`): Python strings may
  hold lone surrogates (``"\\ud800"``, also valid JSON), Rust strings may not.

Type mistakes raise :class:`~llmsched.errors.InvalidTypeError` (a ``TypeError``); values out of
range raise :class:`~llmsched.errors.InvalidValueError` (a ``ValueError``).

Arguments the native layer converts itself (an ``int`` or ``float`` handed to Rust) are checked
only when it refuses one: the wrapper catches the bare ``TypeError`` and names the argument with
:func:`check_int_like` / :func:`check_number_like`, which accept what the native conversion
accepts (numpy scalars too), so a call that goes through pays nothing for them.

>>> check_now(12.5)
12.5
>>> check_now(float("nan"))
Traceback (most recent call last):
    ...
llmsched.errors.InvalidValueError: now must be a finite number of seconds >= 0, got nan
>>> check_probability("kv_cache_usage", 0.25)
0.25
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from llmsched._llmsched import MAX_BLOCK_SIZE
from llmsched.errors import ConfigError, InvalidTypeError, InvalidValueError, LlmschedError

__all__ = [
    "I64_MAX",
    "U32_MAX",
    "U64_MAX",
    "check_block_size",
    "check_bool",
    "check_bytes",
    "check_callable",
    "check_config_data",
    "check_id",
    "check_index",
    "check_int",
    "check_int_like",
    "check_iterable",
    "check_no_empty_names",
    "check_now",
    "check_number_like",
    "check_optional_str",
    "check_positive_seconds",
    "check_probability",
    "check_seed",
    "check_str",
    "check_str_mapping",
    "check_utf8",
    "describe_int",
    "is_bool",
    "is_finite_number",
    "is_utf8_text",
    "normal_address",
    "refuse_json_constant",
]

U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


def is_bool(value: object) -> bool:
    """Whether ``value`` is a ``bool`` or a numpy bool (``np.True_``: no ``int`` subclass, but
    read by the native layer as 1.0 where a float belongs, and by numpy 1 as 1 where an int
    does): a flag where a number, a count or an id belongs is a mistake.

    >>> import numpy as np
    >>> is_bool(True), is_bool(np.False_), is_bool(1), is_bool(np.int8(1))
    (True, True, False, False)
    """
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _is_number(value: object) -> bool:
    # bool is an int subclass; a True where a time or size belongs is always a mistake.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_now(
    now: object, clock: Callable[[], float] = time.monotonic, *, name: str = "now"
) -> float:
    """``now`` as seconds: ``clock()`` when ``None``, else finite and ``>= 0`` (errors call it
    ``name``).

    >>> check_now(None, clock=lambda: 3.0)
    3.0
    >>> check_now(-1)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: now must be a finite number of seconds >= 0, got -1
    """
    if now is None:
        return float(clock())
    return _seconds(name, now, strictly_positive=False)


def check_positive_seconds(name: str, value: object) -> float:
    """A duration that must be finite and ``> 0`` (intervals, timeouts).

    >>> check_positive_seconds("poll_interval_s", 0.5)
    0.5
    """
    return _seconds(name, value, strictly_positive=True)


def _seconds(name: str, value: object, *, strictly_positive: bool) -> float:
    if not _is_number(value):
        raise InvalidTypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    bound = "> 0" if strictly_positive else ">= 0"
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond a float's range (about 1.8e308)
        raise InvalidValueError(
            f"{name} must be a finite number of seconds {bound}, got {describe_int(value)}"
        ) from None
    in_range = seconds > 0.0 if strictly_positive else seconds >= 0.0
    if not (math.isfinite(seconds) and in_range):
        raise InvalidValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not ``bool``) with a finite float value:
    false for NaN, the infinities and an int beyond a float's range (where ``float()`` and
    ``math.isfinite`` raise OverflowError).

    >>> is_finite_number(1.5), is_finite_number(float("inf")), is_finite_number(10**400)
    (True, False, False)
    """
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:
        return False


def describe_int(value: object) -> str:
    """``value`` for an error message: its digits, or its size when it is too long to show (an
    int of thousands of digits has no ``str`` at all past Python's 4,300-digit limit).

    >>> describe_int(12), describe_int(10**400)
    ('12', 'an int of 1329 bits')
    """
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int = I64_MAX) -> int:
    """An ``int`` (not ``bool``) in ``minimum..maximum``.

    >>> check_int("threads", 4, minimum=1, maximum=1024)
    4
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidValueError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise InvalidValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_index(name: str, value: object, *, minimum: int = 0, maximum: int = I64_MAX) -> int:
    """An integer as the native layer reads one (an ``int`` or a numpy integer: anything with
    ``__index__``, but not a ``bool``) in ``minimum..maximum``, as a Python ``int``.

    >>> import numpy as np
    >>> check_index("waiting", np.int64(3), maximum=2**32 - 1)
    3
    >>> check_index("max_loras", -1)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: max_loras must be at least 0, got -1
    """
    index = getattr(type(value), "__index__", None)
    if index is None or is_bool(value):
        raise InvalidTypeError(f"{name} must be an int, got {_type_name(value)}")
    return check_int(name, int(index(value)), minimum=minimum, maximum=maximum)


def check_block_size(block_size: object) -> int:
    """A block size: an ``int`` from 1 to ``MAX_BLOCK_SIZE`` (65,536) tokens per block, the
    native core's bound on every per-block buffer.

    >>> check_block_size(16)
    16
    >>> check_block_size(2**40)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: block_size must be at most 65536, got 1099511627776
    """
    return check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)


def check_seed(seed: object) -> int:
    """A 64-bit hash seed: an ``int`` in ``0..2**64-1``.

    >>> check_seed(1337)
    1337
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidTypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= U64_MAX:
        raise InvalidValueError(f"seed must be in 0..2**64-1, got {seed}")
    return seed


def check_probability(name: str, value: object) -> float:
    """A probability or fraction: a finite number in ``[0, 1]``.

    >>> check_probability("long_fraction", 1)
    1.0
    """
    if not _is_number(value):
        raise InvalidTypeError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    try:
        p = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond a float's range
        raise InvalidValueError(f"{name} must be in [0, 1], got {describe_int(value)}") from None
    if not 0.0 <= p <= 1.0:  # also false for nan
        raise InvalidValueError(f"{name} must be in [0, 1], got {value!r}")
    return p


def check_id(name: str, value: object) -> int | str:
    """A worker or endpoint id: an ``int`` that fits 64 bits signed, or a ``str``.

    >>> check_id("worker", "gpu-0")
    'gpu-0'
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int or a str, got {type(value).__name__}")
    if not -(2**63) <= value <= I64_MAX:
        raise InvalidValueError(f"{name} must fit in 64 bits (signed), got {value}")
    return value


def _type_name(value: object) -> str:
    return type(value).__name__


def check_str(name: str, value: object) -> str:
    """A ``str``.

    >>> check_str("tenant", None)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidTypeError: tenant must be a str, got NoneType
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"{name} must be a str, got {_type_name(value)}")
    return value


def check_optional_str(name: str, value: object) -> str | None:
    """A ``str`` or ``None``.

    >>> check_optional_str("lora", None) is None
    True
    """
    if value is not None and not isinstance(value, str):
        raise InvalidTypeError(f"{name} must be a str or None, got {_type_name(value)}")
    return value


_UNSET_NAMES = {"model": "any model", "lora": "the base model", "cache_salt": "no salt"}
"""What ``None`` means for each name a request may give (``Router.pick``, ``ScheduleRequest``)."""


def check_no_empty_names(
    error: type[LlmschedError] = InvalidValueError, **names: str | None
) -> None:
    """Refuse an empty ``model``, ``lora`` or ``cache_salt`` of a request: each is a name or
    None, and ``""`` is most likely an unset setting. It would not mean None: ``model=""``
    would be served only by endpoints serving any model, and ``lora=""`` or ``cache_salt=""``
    would hash the prompt into a namespace no engine's cache is in (vLLM and both gateways
    refuse an empty ``cache_salt``). Raises ``error`` (InvalidValueError by default).

    >>> check_no_empty_names(model="m", lora=None)
    >>> check_no_empty_names(model="")
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: model must be a non-empty str or None (None: any model), got ''
    """  # noqa: E501
    for name, value in names.items():
        if value == "":
            raise error(
                f"{name} must be a non-empty str or None (None: {_UNSET_NAMES[name]}), got ''"
            )


def check_bool(name: str, value: object) -> bool:
    """A ``bool`` (not an int: a 0 or 1 where a flag belongs is a mistake).

    >>> check_bool("finished", True)
    True
    """
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be a bool, got {_type_name(value)}")
    return value


def check_bytes(name: str, value: object) -> bytes:
    """A payload: ``bytes``, or a ``bytearray`` or ``memoryview`` (copied to ``bytes``).

    >>> check_bytes("payload", bytearray(b"ab"))
    b'ab'
    """
    if type(value) is bytes:
        return value
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"{name} must be bytes, got {_type_name(value)}")
    return bytes(value)


def check_callable(name: str, value: object) -> Callable[..., Any]:
    """Something to call (a clock, a hook).

    >>> check_callable("clock", time.monotonic) is time.monotonic
    True
    """
    if not callable(value):
        raise InvalidTypeError(f"{name} must be callable, got {_type_name(value)}")
    return value


def check_iterable(name: str, value: object) -> list[Any]:
    """The items of an iterable, as a list (a ``str`` is an iterable of characters: callers
    that take one for a single item check that first).

    >>> check_iterable("endpoints", ("a", "b"))
    ['a', 'b']
    """
    if not isinstance(value, Iterable):
        raise InvalidTypeError(f"{name} must be an iterable, got {_type_name(value)}")
    return list(value)


def check_int_like(name: str, value: object, *, optional: bool = False) -> None:
    """Raise unless ``value`` is what the native layer reads as an int: anything with
    ``__index__`` (an ``int``, a numpy integer) but a ``bool`` or numpy bool (which the native
    layer would read as 0 or 1), or ``None`` when ``optional``. For the error path of a native
    call, to name the argument it refused (its range is the core's to check), and before a
    native call that would take a bool.

    >>> check_int_like("request_id", 1.5)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidTypeError: request_id must be an int, got float
    >>> check_int_like("max_sessions", True)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidTypeError: max_sessions must be an int, got bool
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or is_bool(value) or not hasattr(type(value), "__index__"):
        kind = "an int or None" if optional else "an int"
        raise InvalidTypeError(f"{name} must be {kind}, got {_type_name(value)}")


def check_number_like(name: str, value: object, *, optional: bool = False) -> None:
    """Raise unless ``value`` is what the native layer reads as a float: anything with
    ``__float__`` or ``__index__`` (an ``int``, a ``float``, a numpy scalar) but a ``str`` or
    a ``bool`` or numpy bool (a True where seconds, a rate or a share belong is a mistake,
    which the native layer would read as 1.0), or ``None`` when ``optional``. For the error path of a native
    call, as :func:`check_int_like`, and before a native call that would take a bool.

    >>> check_number_like("ttl_s", "5")
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidTypeError: ttl_s must be a number, got str
    >>> check_number_like("ttl_s", True)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidTypeError: ttl_s must be a number, got bool
    >>> check_number_like("ttl_s", 10**400)
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: ttl_s must be a number within a float's range, got an int of 1329 bits
    """  # noqa: E501
    if optional and value is None:
        return
    kind = type(value)
    if is_bool(value) or not (hasattr(kind, "__float__") or hasattr(kind, "__index__")):
        expected = "a number or None" if optional else "a number"
        raise InvalidTypeError(f"{name} must be {expected}, got {_type_name(value)}")
    if isinstance(value, int) and value.bit_length() > 1024:  # float() would overflow
        raise InvalidValueError(
            f"{name} must be a number within a float's range, got {describe_int(value)}"
        )


def is_utf8_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8, that is holds no lone surrogate (``"\\ud800"`` is
    valid JSON, and how aiohttp hands over header bytes that are not UTF-8, but no text an
    engine or a tokenizer takes).

    >>> is_utf8_text("héllo"), is_utf8_text("a" + chr(0xD800))
    (True, False)
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_utf8(name: str, value: object, *, error: type[LlmschedError] = InvalidValueError) -> str:
    """A ``str`` that encodes as UTF-8 (no lone surrogate), as every name, label and text the
    native core keeps must: checked here, before anything changes, so the error names the
    argument (the conversion's own is a bare ``UnicodeEncodeError``). ``error`` is the class
    raised for a surrogate, for callers whose documented error is another ``ValueError``.

    >>> check_utf8("tenant", "acme")
    'acme'
    >>> check_utf8("tenant", "a" + chr(0xD800))
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: tenant must be valid UTF-8 (no lone surrogates)
    """
    text = check_str(name, value)
    # isascii() reads a flag CPython keeps: the common case costs no encoding.
    if not (text.isascii() or is_utf8_text(text)):
        raise error(f"{name} must be valid UTF-8 (no lone surrogates)")
    return text


def check_str_mapping(name: str, value: object) -> dict[str, str]:
    """A mapping of ``str`` to ``str`` (labels, headers) with every key and value valid UTF-8
    (:func:`check_utf8`), copied to a ``dict``.

    >>> check_str_mapping("labels", {"zone": "eu"})
    {'zone': 'eu'}
    >>> check_str_mapping("labels", {"zone": chr(0xDC80)})
    Traceback (most recent call last):
        ...
    llmsched.errors.InvalidValueError: labels['zone'] must be valid UTF-8 (no lone surrogates)
    """
    if not isinstance(value, Mapping):
        raise InvalidTypeError(f"{name} must be a mapping of str to str, got {_type_name(value)}")
    items = dict(value)
    for key, text in items.items():
        if not (isinstance(key, str) and isinstance(text, str)):
            raise InvalidTypeError(f"{name} must map str to str")
        # repr() escapes a surrogate, so the message itself stays valid text.
        check_utf8(f"a key of {name} ({key!r})", key)
        check_utf8(f"{name}[{key!r}]", text)
    return items


_CONFIG_INT_RANGE = (-(2**63), U64_MAX)
"""The ints a config carries to the native side (a JSON number: i64 or u64)."""

_CONFIG_MAX_DEPTH = 32
"""How deep :func:`check_config_data` looks (the native conversion refuses deeper first)."""


def check_config_data(what: str, config: object) -> None:
    """Raise :class:`~llmsched.errors.ConfigError` naming the key path of the first value in
    ``config`` (plain data: dicts, lists, str, numbers) that cannot cross to the native side: a
    key that is not a ``str``, a key or text that is not valid UTF-8, an int beyond 64 bits.
    For the error path of a native config conversion, whose own message names no key; returns
    when it finds none (the native error then stands).

    >>> check_config_data("flow config", {"weights": {7: 2}})
    Traceback (most recent call last):
        ...
    llmsched.errors.ConfigError: flow config: key 7 at weights must be a str, got int
    """
    _check_config_data(what, config, "", 0)


def _check_config_data(what: str, value: object, path: str, depth: int) -> None:
    if depth > _CONFIG_MAX_DEPTH:
        return
    where = path or "the top level"
    if isinstance(value, str):
        if not is_utf8_text(value):
            raise ConfigError(f"{what}: text at {where} must be valid UTF-8 (no lone surrogates)")
    elif isinstance(value, int) and not isinstance(value, bool):
        low, high = _CONFIG_INT_RANGE
        if not low <= value <= high:
            raise ConfigError(
                f"{what}: value at {where} must fit in 64 bits, got {describe_int(value)}"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"{what}: key {key!r} at {where} must be a str, got {_type_name(key)}"
                )
            if not is_utf8_text(key):
                raise ConfigError(
                    f"{what}: key {key!r} at {where} must be valid UTF-8 (no lone surrogates)"
                )
            _check_config_data(what, item, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_config_data(what, item, f"{path}[{i}]", depth + 1)


def refuse_json_constant(name: str) -> NoReturn:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are not
    JSON (the native data plane and the engines refuse them); raises ``ValueError`` naming
    the literal, as for any text that is not JSON."""
    raise ValueError(f"{name} is not JSON")


def normal_address(address: str) -> str:
    """``host:port`` of an endpoint address given with or without scheme and trailing slash,
    in one spelling per address: an IP literal in its short form (``[0:0::1]`` is ``[::1]``),
    a host name in lower case (DNS names are case-insensitive). Two spellings of one address
    once made a second endpoint for an engine the pool already had. (Here, not in
    ``llmsched.integrations``, so that the core's :class:`~llmsched.Scheduler` can file engines
    by address without that extra.)

    >>> normal_address("http://[0:0:0:0:0:0:0:1]:8000/"), normal_address("Engine-A:80")
    ('[::1]:8000', 'engine-a:80')
    """
    for scheme in ("http://", "https://"):
        address = address.removeprefix(scheme)
    address = address.rstrip("/")
    host, colon, port = address.rpartition(":")
    if not colon:
        return address.lower()
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return address.lower()
    host = ip.compressed
    # IPv6 literals are bracketed so that "host:port" stays unambiguous.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
