"""Pure-Python twin of :func:`llmsched.vllm_events.decode_vllm_events`, built on ``msgpack``.

It accepts and rejects the same payloads as the Rust decoder and returns the same dict, so the
property tests can compare the two; it is also the benchmark baseline. The msgpack package parses
the whole payload first; the rules below are then checked on the Python objects.

>>> import msgpack
>>> decode_vllm_events(msgpack.packb([2.0, [["AllBlocksCleared"]]]))
{'ts': 2.0, 'events': [{'type': 'AllBlocksCleared'}], 'dp_rank': None, 'unknown_events': 0}
"""

from __future__ import annotations

from typing import Any

from llmsched._extras import require

require("test", "msgpack", feature="llmsched.reference.vllm_events")

import msgpack

from llmsched.errors import MalformedEventError

__all__ = ["MAX_SKIP_DEPTH", "decode_vllm_events"]

#: The deepest nesting of containers accepted inside one skipped value (as in Rust).
MAX_SKIP_DEPTH = 32

_U32_MAX = 2**32 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U64_MASK = 2**64 - 1

#: BlockStored fields in declaration order (vLLM 0.11 ... 0.22); later positions are ignored.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_REQUIRED = _STORED_FIELDS[:4]
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MEDIA = ("GPU", "CPU", "STORAGE")


class _Map(list):  # type: ignore[type-arg]
    """A msgpack map kept as its list of (key, value) pairs, so duplicates stay visible."""


class _Malformed(Exception):
    """Why the payload is malformed; becomes a MalformedEventError at the top."""


class _Ext:
    """An extension value other than a timestamp: opaque, as in Rust (any type code)."""

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


def _fail(reason: str) -> _Malformed:
    return _Malformed(reason)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _depth(value: object) -> int:
    """Nesting depth in containers: 0 for a scalar, 1 + the deepest child for a container.

    Stops counting past the limit, so hostile nesting costs no more than the limit.
    """
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, level = stack.pop()
        if isinstance(item, _Map):
            children: list[object] = [part for pair in item for part in pair]
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_SKIP_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _skip(value: object, what: str) -> None:
    if _depth(value) > MAX_SKIP_DEPTH:
        raise _fail(f"{what}: nested deeper than {MAX_SKIP_DEPTH} containers")


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what}: expected a str")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates stand for invalid UTF-8 bytes
        raise _fail(f"{what}: str is not valid UTF-8") from exc
    return value


def _optional_text(value: object, what: str) -> str | None:
    return None if value is None else _text(value, what)


def _integer(value: object, what: str, low: int, high: int) -> int:
    if not _is_int(value):
        raise _fail(f"{what}: expected an integer")
    assert isinstance(value, int)
    if not low <= value <= high:
        raise _fail(f"{what}: {value} is out of range")
    return value


def _optional_integer(value: object, what: str, low: int, high: int) -> int | None:
    return None if value is None else _integer(value, what, low, high)


def _number(value: object, what: str) -> float:
    if isinstance(value, float):
        return value
    if _is_int(value):
        assert isinstance(value, int)
        return float(value)
    raise _fail(f"{what}: expected a float or an integer")


def _block_hash(value: object, what: str) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    if _is_int(value):
        assert isinstance(value, int)
        return value & _U64_MASK
    raise _fail(f"{what}: expected an integer or a bin")


def _array(value: object, what: str) -> list[Any]:
    if not isinstance(value, list) or isinstance(value, _Map):
        raise _fail(f"{what}: expected an array")
    return value


def _block_hashes(value: object) -> list[int]:
    return [_block_hash(item, "block hash") for item in _array(value, "block_hashes")]


def _token_ids(value: object) -> list[int]:
    return [_integer(item, "token id", 0, _U32_MAX) for item in _array(value, "token_ids")]


_CONTENT = "content"
"""A block's extra keys holding a value other than a string, or not an array: keys standing
for content beside the tokens (multimodal inputs, prompt embeddings)."""

_OTHER_STRINGS = "strings"
"""A block's extra keys that are strings only, but more than two or one not UTF-8."""


def _extra_keys(value: object) -> list[tuple[str, ...] | str | None] | None:
    """One entry per block: None, a tuple of its (up to two) string keys, ``_CONTENT`` or
    ``_OTHER_STRINGS``."""
    if value is None:
        return None
    blocks: list[tuple[str, ...] | str | None] = []
    for entry in _array(value, "extra_keys"):
        if entry is None:
            blocks.append(None)
            continue
        _skip(entry, "extra_keys entry")
        blocks.append(_block_keys(entry))
    return blocks


def _block_keys(entry: object) -> tuple[str, ...] | str:
    if not isinstance(entry, list) or isinstance(entry, _Map):
        return _CONTENT
    if not all(isinstance(item, str) for item in entry):
        return _CONTENT
    strings = []
    for item in entry:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate stands for an invalid UTF-8 byte
            return _OTHER_STRINGS
        strings.append(item)
    return tuple(strings) if len(strings) <= 2 else _OTHER_STRINGS


def _explain_extra_keys(
    blocks: list[tuple[str, ...] | str | None], lora_name: str | None, root: bool
) -> tuple[str | None, bool, bool]:
    """(the cache salt of a root block, whether any key is more than the LoRA name and that
    salt, whether any stands for content): vLLM writes the LoRA name first on every block,
    the salt last on a prompt's first."""
    salt = None
    opaque = False
    for i, keys in enumerate(blocks):
        if keys is None:
            continue
        if keys == _CONTENT:
            return None, True, True
        if isinstance(keys, str):
            opaque = True
            continue
        rest = keys[1:] if lora_name is not None and keys[:1] == (lora_name,) else keys
        if not rest:
            continue
        if len(rest) == 1 and i == 0 and root:
            salt = rest[0]
            continue
        opaque = True
    return (None, True, False) if opaque else (salt, False, False)


def _medium(value: str | None) -> str:
    if value is None:
        return "GPU"
    # bytes.upper() folds ASCII only, as Rust's eq_ignore_ascii_case does.
    folded = value.encode("utf-8").upper().decode("utf-8")
    if folded not in _MEDIA:
        raise _fail(f"medium {value!r} is not one of GPU, CPU, STORAGE")
    return folded


def _read_stored_field(fields: dict[str, Any], name: str | None, value: object) -> None:
    if name == "block_hashes":
        fields[name] = _block_hashes(value)
    elif name == "parent_block_hash":
        fields[name] = None if value is None else _block_hash(value, name)
    elif name == "token_ids":
        fields[name] = _token_ids(value)
    elif name == "block_size":
        fields[name] = _integer(value, name, 0, _U32_MAX)
        if fields[name] == 0:
            raise _fail("block_size is 0")
    elif name == "lora_id":
        fields[name] = _optional_integer(value, name, _I64_MIN, _I64_MAX)
    elif name in ("medium", "lora_name", "kv_cache_spec_kind"):
        fields[name] = _optional_text(value, name)
    elif name == "extra_keys":
        fields[name] = _extra_keys(value)
    elif name in ("group_idx", "kv_cache_spec_sliding_window"):
        fields[name] = _optional_integer(value, name, 0, _U32_MAX)
    else:
        _skip(value, "BlockStored field")


def _finish_stored(fields: dict[str, Any]) -> dict[str, Any]:
    for name in _STORED_REQUIRED:
        if name not in fields:
            raise _fail(f"BlockStored lacks {name}")
    blocks = len(fields["block_hashes"])
    if len(fields["token_ids"]) != blocks * fields["block_size"]:
        raise _fail(
            f"BlockStored has {len(fields['token_ids'])} token_ids for {blocks} blocks "
            f"of {fields['block_size']} tokens"
        )
    extra = fields.get("extra_keys")
    if extra is not None and len(extra) != blocks:
        raise _fail(f"BlockStored has {len(extra)} extra_keys entries for {blocks} blocks")
    salt, opaque, content = _explain_extra_keys(
        extra or [], fields.get("lora_name"), fields["parent_block_hash"] is None
    )
    return {
        "type": "BlockStored",
        "block_hashes": fields["block_hashes"],
        "parent_block_hash": fields["parent_block_hash"],
        "token_ids": fields["token_ids"],
        "block_size": fields["block_size"],
        "lora_id": fields.get("lora_id"),
        "medium": _medium(fields.get("medium")),
        "lora_name": fields.get("lora_name"),
        "has_extra_keys": [keys is not None for keys in extra or []],
        "cache_salt": salt,
        "opaque_extra_keys": opaque,
        "content_extra_keys": content,
        "group_idx": fields.get("group_idx"),
        "kv_cache_spec_kind": fields.get("kv_cache_spec_kind"),
        "kv_cache_spec_sliding_window": fields.get("kv_cache_spec_sliding_window"),
    }


def _read_removed_field(fields: dict[str, Any], name: str | None, value: object) -> None:
    if name == "block_hashes":
        fields[name] = _block_hashes(value)
    elif name == "medium":
        fields[name] = _optional_text(value, name)
    elif name == "group_idx":
        fields[name] = _optional_integer(value, name, 0, _U32_MAX)
    else:
        _skip(value, "BlockRemoved field")


def _finish_removed(fields: dict[str, Any]) -> dict[str, Any]:
    if "block_hashes" not in fields:
        raise _fail("BlockRemoved lacks block_hashes")
    return {
        "type": "BlockRemoved",
        "block_hashes": fields["block_hashes"],
        "medium": _medium(fields.get("medium")),
        "group_idx": fields.get("group_idx"),
    }


def _array_event(items: list[Any]) -> dict[str, Any] | None:
    if not items:
        raise _fail("event array is empty; its first element is the type tag")
    tag = _text(items[0], "event type tag")
    values = items[1:]
    fields: dict[str, Any] = {}
    if tag == "BlockStored":
        for position, value in enumerate(values):
            name = _STORED_FIELDS[position] if position < len(_STORED_FIELDS) else None
            _read_stored_field(fields, name, value)
        return _finish_stored(fields)
    if tag == "BlockRemoved":
        for position, value in enumerate(values):
            name = _REMOVED_FIELDS[position] if position < len(_REMOVED_FIELDS) else None
            _read_removed_field(fields, name, value)
        return _finish_removed(fields)
    for value in values:
        _skip(value, "event field")
    return {"type": "AllBlocksCleared"} if tag == "AllBlocksCleared" else None


def _map_event(pairs: _Map) -> dict[str, Any] | None:
    keys = [_text(key, "event field name") for key, _ in pairs]
    if keys.count("type") > 1:
        raise _fail('event key "type" appears twice')
    if "type" not in keys:
        raise _fail('event map has no "type" key')
    tag = _text(pairs[keys.index("type")][1], "event type tag")
    known: tuple[str, ...] = ()
    if tag == "BlockStored":
        known, read, finish = _STORED_FIELDS, _read_stored_field, _finish_stored
    elif tag == "BlockRemoved":
        known, read, finish = _REMOVED_FIELDS, _read_removed_field, _finish_removed
    fields: dict[str, Any] = {}
    for key, (_, value) in zip(keys, pairs, strict=True):
        if key == "type":
            continue
        if not known:
            _skip(value, "event field")
            continue
        if key in known and key in fields:
            raise _fail(f"{tag} field {key!r} appears twice")
        read(fields, key if key in known else None, value)
    if known:
        return finish(fields)
    return {"type": "AllBlocksCleared"} if tag == "AllBlocksCleared" else None


def _events(value: object) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    unknown = 0
    for index, event in enumerate(_array(value, "EventBatch events")):
        try:
            if isinstance(event, _Map):
                decoded = _map_event(event)
            elif isinstance(event, list):
                decoded = _array_event(event)
            else:
                raise _fail("event: expected an array or a map")
        except _Malformed as exc:
            raise _fail(f"event {index}: {exc}") from exc
        if decoded is None:
            unknown += 1
        else:
            events.append(decoded)
    return events, unknown


def _batch_from_map(pairs: _Map) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        name = _text(key, "EventBatch key")
        if name in found:
            raise _fail(f"EventBatch key {name!r} appears twice")
        if name == "ts":
            found[name] = _number(value, "EventBatch ts")
        elif name == "events":
            found[name] = _events(value)
        elif name == "data_parallel_rank":
            found[name] = _optional_integer(value, name, _I64_MIN, _I64_MAX)
        else:
            _skip(value, "EventBatch unknown field")
    if "ts" not in found or "events" not in found:
        raise _fail('EventBatch map needs both "ts" and "events"')
    events, unknown = found["events"]
    return _batch(found["ts"], events, found.get("data_parallel_rank"), unknown)


def _batch_from_array(items: list[Any]) -> dict[str, Any]:
    if len(items) < 2:
        raise _fail(f"EventBatch array has {len(items)} elements; [ts, events, dp_rank] expected")
    ts = _number(items[0], "EventBatch ts")
    events, unknown = _events(items[1])
    dp_rank = None
    if len(items) >= 3:
        dp_rank = _optional_integer(items[2], "EventBatch dp_rank", _I64_MIN, _I64_MAX)
    for extra in items[3:]:
        _skip(extra, "EventBatch trailing element")
    return _batch(ts, events, dp_rank, unknown)


def _batch(
    ts: float, events: list[dict[str, Any]], dp_rank: int | None, unknown: int
) -> dict[str, Any]:
    return {"ts": ts, "events": events, "dp_rank": dp_rank, "unknown_events": unknown}


def decode_vllm_events(payload: bytes) -> dict[str, Any]:
    """Decode one ``EventBatch`` payload exactly as the Rust decoder does."""
    try:
        root = msgpack.unpackb(
            payload,
            raw=False,
            unicode_errors="surrogateescape",
            object_pairs_hook=_Map,
            strict_map_key=False,
            ext_hook=_Ext,
        )
    except Exception as exc:  # every msgpack failure (truncation, 0xc1, extra data, ...)
        raise MalformedEventError(f"malformed vLLM event batch: not msgpack ({exc!r})") from exc
    try:
        if isinstance(root, _Map):
            return _batch_from_map(root)
        if isinstance(root, list):
            return _batch_from_array(root)
        raise _fail("EventBatch: expected an array or a map")
    except _Malformed as exc:
        raise MalformedEventError(f"malformed vLLM event batch: {exc}") from None
