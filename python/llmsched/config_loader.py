"""One way to read configuration: a mapping, YAML / JSON text, or a YAML / JSON file.

Every component that takes configuration (the router, the flow controller, the gateway and its
discovery file, simulator scenarios, step-model profiles) reads it through :func:`load_mapping`
or :func:`read_document`, so they accept the same inputs and fail the same way:

* a ``Mapping`` is copied (one level) and used as is;
* an ``os.PathLike`` is a file; a ``str`` is a file too, unless it is blank, holds a newline,
  starts with ``{`` or ``[``, or names no file and contains ``:`` (then it is YAML / JSON text);
* files ending in ``.json`` are parsed as JSON, everything else as YAML (a superset of JSON);
  an empty document is an empty mapping, and a YAML file holds one document (empty ones after
  it, a trailing ``---``, are passed over, as llm-d's Go loader reads the first; a router
  config, llm-d's, is read with ``read_config(..., first_document=True)``, which takes the
  first document of several and says where the rest begins). A number
  written with an exponent (``1e-3``, ``1.5e3``) is a number, as in JSON, YAML 1.2 and llm-d's
  Go loader (PyYAML's YAML 1.1 reads those two as strings); quoted, it stays a string.

Errors are :class:`~llmsched.errors.ConfigError` naming what was being read and the file:
``"flow config: cannot read 'flow.yaml': does not exist"``,
``"config: cannot read 'gw.yaml': not valid YAML / JSON (...)"``,
``"scenario: must be a mapping, got list ('s.yaml')"``. Errors about a key inside the
document name the file too: :meth:`ConfigDocument.error`.

A document is also refused, as a ConfigError, when it nests more than :data:`MAX_DEPTH` levels
(the parsers would otherwise raise ``RecursionError`` on a few kilobytes of ``[[[[...``), when a
YAML alias refers to the node that holds it (a cycle every later walk would follow forever),
or when YAML aliases repeat more than :data:`MAX_ALIASED_VALUES` values (a "billion laughs"
document: a kilobyte that every later copy or check expands to gigabytes). Every text a user
supplies goes through :func:`parse_document`, so no loader can forget these checks. A mapping
that names a key twice is refused too (YAML and JSON parsers keep the last one silently: a second
``auth:`` section would turn the keys of the first off), as is a string holding a lone surrogate
(a ``"\\ud800"`` escape: no UTF-8 can carry it to an engine or to the native plane), and a
document larger than :data:`MAX_DOCUMENT_BYTES` (parsing YAML takes about a second a megabyte).

>>> load_mapping("default_band: {ttl_s: 30}", what="flow config")
{'default_band': {'ttl_s': 30}}
>>> load_mapping({"a": 1}, what="config")
{'a': 1}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsched.errors import ConfigError, InvalidTypeError
from llmsched.validation import is_utf8_text

__all__ = [
    "MAX_ALIASED_VALUES",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "ConfigDocument",
    "ConfigSource",
    "check_ints",
    "load_mapping",
    "looks_like_text",
    "parse_document",
    "read_config",
    "read_document",
]

MAX_DEPTH = 32
"""Nesting deeper than this is refused (configs are a few levels deep; the native layer refuses
the same depth when a config crosses to the core)."""

MAX_ALIASED_VALUES = 1_000_000
"""How many values YAML aliases may repeat in one document (each alias counts the values it
stands for); a document without aliases never comes near it."""

MAX_DOCUMENT_BYTES = 16 << 20
"""The largest document read (16 MiB): a config, keys file or discovery file is far smaller, and
the YAML parser takes about a second a megabyte (a 100 MB file held ``llmsched serve`` for
minutes)."""

ConfigSource = Mapping[str, Any] | str | os.PathLike[str]
"""What a config argument accepts: a mapping, YAML / JSON text, or a file path."""


@dataclass(frozen=True)
class ConfigDocument:
    """A configuration mapping and where it came from (``path`` is None for a mapping or text).

    >>> doc = read_config({"block_size": 0}, what="config")
    >>> str(doc.error("block_size", "must be at least 1"))
    'config: block_size: must be at least 1'
    """

    data: dict[str, Any]
    what: str
    path: Path | None = None
    ignored_line: int | None = None
    """With ``first_document``: the line where the documents left unread begin (None: none
    with content)."""

    def where(self, key: str = "") -> str:
        """``what`` and the file, then ``key``: the prefix of every message about this document."""
        head = self.what if self.path is None else f"{self.what} {str(self.path)!r}"
        return f"{head}: {key}" if key else head

    def error(self, key: str, message: str) -> ConfigError:
        """A ConfigError about ``key`` of this document, naming the file it came from."""
        return ConfigError(f"{self.where(key)}: {message}")


def looks_like_text(source: str) -> bool:
    """Whether a ``str`` config argument is YAML / JSON text rather than a file path.

    >>> looks_like_text("routing.yaml"), looks_like_text("plugins: []")
    (False, True)
    """
    if not source.strip() or "\n" in source or source.lstrip().startswith(("{", "[")):
        return True
    if ":" not in source:
        return False
    try:
        return not Path(source).is_file()
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte) is text
        return True


def read_document(source: str | os.PathLike[str], *, what: str, secret: bool = False) -> Any:
    """The YAML / JSON value held by a file or text, whatever its type (``None`` when empty).
    With ``secret``, a YAML error names the line and column but never quotes the text (the
    document holds secrets, e.g. API keys).

    >>> read_document("[1, 2]", what="engines")
    [1, 2]
    """
    return _read(source, what=what, secret=secret, first_document=False)[0]


def _read(
    source: str | os.PathLike[str], *, what: str, secret: bool, first_document: bool
) -> tuple[Any, int | None]:
    """:func:`read_document`, with the line where unread documents begin (``first_document``:
    see :func:`read_config`)."""
    if isinstance(source, str) and looks_like_text(source):
        return _parse(source, what=what, secret=secret, first_document=first_document)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidTypeError(
            f"{what} must be a path or YAML / JSON text, got {type(source).__name__}"
        )
    path = Path(source)
    try:
        with path.open("rb") as file:
            data = file.read(MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ConfigError(
                f"{what}: cannot read {str(path)!r}: larger than {MAX_DOCUMENT_BYTES:,} bytes"
            )
        text = data.decode()
    except FileNotFoundError:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {reason}") from None
    return _parse(
        text,
        what=what,
        path=path,
        json_only=path.suffix == ".json",
        secret=secret,
        first_document=first_document,
    )


def parse_document(
    text: str | bytes,
    *,
    what: str,
    path: Path | None = None,
    json_only: bool = False,
    secret: bool = False,
) -> Any:
    """The YAML (or, with ``json_only``, JSON) value of ``text`` read from ``path`` (if any);
    ConfigError naming ``what``, the file and the problem when it is not valid, nests too
    deeply or expands too far through aliases (see the module docs). With ``secret``, a YAML
    error never quotes the text (see :func:`read_document`).

    >>> parse_document("engines: [{port: 8000}]", what="discovery.file")
    {'engines': [{'port': 8000}]}
    >>> parse_document("[" * 5000, what="config")
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: config: not valid YAML / JSON (nested more than 32 levels)
    """
    return _parse(
        text, what=what, path=path, json_only=json_only, secret=secret, first_document=False
    )[0]


def _parse(
    text: str | bytes,
    *,
    what: str,
    path: Path | None = None,
    json_only: bool = False,
    secret: bool = False,
    first_document: bool,
) -> tuple[Any, int | None]:
    """:func:`parse_document`; with ``first_document``, YAML documents after the first are
    left unread and the line where they begin is returned beside the value."""
    ignored: int | None = None
    # RecursionError is the parsers' answer to deep nesting (both are recursive descent);
    # it is caught here, where the text is known, so that no caller sees it as a crash.
    deep = f"nested more than {MAX_DEPTH} levels"
    reason: str | None
    if len(text) > MAX_DOCUMENT_BYTES:
        reason = f"larger than {MAX_DOCUMENT_BYTES:,} bytes"
        value = None
    elif json_only:
        try:
            value = (
                json.loads(text, object_pairs_hook=_unique_keys_object) if text.strip() else None
            )
        except _DuplicateKey as exc:
            reason = exc.hidden if secret else str(exc)
        except ValueError as exc:  # json.JSONDecodeError
            reason = str(exc)
        except RecursionError:
            reason = deep
        else:
            reason = _shape_problem(value, secret=secret)
    else:
        import yaml  # YAML is only needed when a document is read

        try:
            loader = _unique_keys_loader()(text)  # a SafeLoader
            loader.first_only = first_document
            try:
                value = loader.get_single_data()
                ignored = loader.ignored_line
            finally:
                loader.dispose()
        except _DuplicateKey as exc:
            reason = exc.hidden if secret else str(exc)
        except yaml.YAMLError as exc:
            reason = _yaml_reason(exc, secret=secret)
        except RecursionError:
            reason = deep
        except (ValueError, OverflowError) as exc:
            # A scalar the safe loader cannot build: a date such as 2020-13-01, ``!!int x``,
            # an int of more digits than Python converts.
            reason = f"a value cannot be read: {exc}"
        else:
            reason = _shape_problem(value, secret=secret)
    if reason is None:
        return value, ignored
    if path is None:
        raise ConfigError(f"{what}: not valid YAML / JSON ({reason})")
    raise ConfigError(f"{what}: cannot read {str(path)!r}: not valid YAML / JSON ({reason})")


def _yaml_reason(exc: Any, *, secret: bool) -> str:
    r"""A YAML error on one line: the problem at its line and column, the text of that line
    (unless ``secret``: the line of a key, in a keys file), then what the parser was in the
    middle of and where that began. PyYAML's own message spreads this over several lines,
    names the text ``"<unicode string>"`` and marks the column with a caret that one line
    cannot show.

    >>> import yaml
    >>> try:
    ...     yaml.safe_load("replicas: 4\nworkload: {sessions: 20, turns: 3\n  seed: 1\n")
    ... except yaml.YAMLError as exc:
    ...     print(_yaml_reason(exc, secret=False))  # doctest: +NORMALIZE_WHITESPACE
    expected ',' or '}', but got ':' at line 3, column 7: '  seed: 1'
    (while parsing a flow mapping that begins at line 2, column 11)
    """
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split()) if not secret else str(problem or "not valid YAML")
    reason = f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    if not secret and mark.buffer is not None and mark.pointer is not None:
        # The line around the mark, as PyYAML breaks lines (its own snippet does the same).
        buffer, breaks = mark.buffer, "\0\r\n\x85\u2028\u2029"
        start = mark.pointer
        while start > 0 and buffer[start - 1] not in breaks:
            start -= 1
        end = mark.pointer
        while end < len(buffer) and buffer[end] not in breaks:
            end += 1
        if buffer[start:end].strip():
            reason += f": {buffer[start:end].rstrip()[:80]!r}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        at = f"line {context_mark.line + 1}, column {context_mark.column + 1}"
        reason += f" ({context} that begins at {at})"
    return reason


def _shape_problem(value: Any, *, secret: bool = False) -> str | None:
    """Why a parsed document cannot be used (too deep, a cycle, an alias bomb), or None.

    Iterative, so that it cannot itself run out of stack, and each container is walked once:
    a node reached again through an alias adds its memoised size instead of being re-walked.
    """
    if not isinstance(value, _CONTAINERS):
        return None
    sizes: dict[int, int] = {}  # id -> how many values the container stands for, expanded
    open_ids: set[int] = set()  # the containers on the path being walked
    repeated = 0
    # [container, its children still to walk, values counted so far]
    stack: list[tuple[Any, Iterator[Any], list[int]]] = []

    def enter(node: Any) -> None:
        children = iter([*node.keys(), *node.values()] if isinstance(node, dict) else node)
        open_ids.add(id(node))
        stack.append((node, children, [1]))

    enter(value)
    while stack:
        node, children, count = stack[-1]
        child = next(children, _DONE)
        if child is _DONE:
            stack.pop()
            open_ids.discard(id(node))
            sizes[id(node)] = count[0]
            if stack:
                stack[-1][2][0] += count[0]
            continue
        if not isinstance(child, _CONTAINERS):
            count[0] += 1
            if isinstance(child, str) and not is_utf8_text(child):
                what = "a string" if secret else f"the string {child[:40]!a}"
                return f"{what} holds a lone surrogate escape, not UTF-8"
        elif id(child) in open_ids:
            return "a YAML alias refers to a node that contains it"
        elif id(child) in sizes:
            count[0] += sizes[id(child)]
            repeated += sizes[id(child)]
            if repeated > MAX_ALIASED_VALUES:
                return f"YAML aliases repeat more than {MAX_ALIASED_VALUES:,} values"
        elif len(stack) >= MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels"
        else:
            enter(child)
    return None


class _DuplicateKey(ValueError):
    """A mapping names a key twice (the message says which, and where; ``hidden`` without
    the key, for a document of secrets)."""

    def __init__(self, message: str, hidden: str) -> None:
        super().__init__(message)
        self.hidden = hidden


def _unique_keys_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a dict, or _DuplicateKey when a key comes twice."""
    value: dict[str, Any] = {}
    for key, item in pairs:
        if key in value:
            raise _DuplicateKey(
                f"the key {key!r} appears twice in one object", "a key appears twice in one object"
            )
        value[key] = item
    return value


_LOADER: Any = None


def _unique_keys_loader() -> Any:
    """YAML's safe loader, refusing a mapping that names a scalar key twice (keys a ``<<``
    merge brings in may still be overridden, as YAML intends)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        # first_only: documents after the first are left unread, as llm-d's Go loader leaves
        # them; ignored_line is where the first of them with content begins.
        first_only = False
        ignored_line: int | None = None

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: set[tuple[str, str]] = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode):
                        continue
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        mark = key_node.start_mark
                        where = f"(line {mark.line + 1}, column {mark.column + 1})"
                        raise _DuplicateKey(
                            f"the key {key_node.value!r} appears twice in one mapping {where}",
                            f"a key appears twice in one mapping {where}",
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

        def get_single_node(self) -> Any:
            # PyYAML's, but an empty document after the first (a trailing `---`, as editors
            # and templates leave one) is passed over: llm-d's Go loader reads the first
            # document. One with content is refused as PyYAML refuses it, or with first_only
            # left unread (its line kept), as llm-d's loader leaves it, even when not valid.
            self.get_event()  # type: ignore[no-untyped-call]  # the stream start
            document = None
            if not self.check_event(yaml.StreamEndEvent):
                document = self.compose_document()
            start = None
            while True:
                try:
                    if self.check_event(yaml.StreamEndEvent):
                        break
                    start = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                    extra = self.compose_document()
                except yaml.YAMLError as exc:
                    if not self.first_only:
                        raise
                    mark = start if start is not None else getattr(exc, "problem_mark", None)
                    self.ignored_line = 1 if mark is None else mark.line + 1
                    return document
                if not (
                    isinstance(extra, yaml.ScalarNode)
                    and extra.tag == "tag:yaml.org,2002:null"
                    and extra.value == ""
                ):
                    if self.first_only:
                        self.ignored_line = start.line + 1
                        return document
                    raise yaml.composer.ComposerError(
                        "expected a single document in the stream",
                        None if document is None else document.start_mark,
                        "but found another document",
                        start,
                    )
            self.get_event()  # type: ignore[no-untyped-call]  # the stream end
            return document

    # YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent: `1e-3` and
    # `1.5e3` were strings, so a threshold written so failed as "expected f64". YAML 1.2,
    # JSON and llm-d's Go loader read them as numbers; so does this loader.
    UniqueKeyLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789")
    )
    _LOADER = UniqueKeyLoader
    return _LOADER


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
"""A number with an exponent that YAML 1.1 leaves a string: without a dot (`1e-3`), or with an
unsigned exponent (`1.5e3`)."""


_DONE = object()
# What YAML's safe loader builds that holds other values (tuples and sets come from !!omap,
# !!pairs and !!set).
_CONTAINERS = (dict, list, tuple, set, frozenset)


def check_ints(value: Any, where: str) -> None:
    """Refuses, naming its key path, an int in ``value`` that no config field can hold: the
    core reads every config int as an i32, u32, i64 or u64, and an int beyond all of them
    reaches it as "JSON number out of range", naming no key.

    >>> try:
    ...     check_ints({"bands": [{"max_requests": 2**64}]}, "flow")
    ... except ConfigError as exc:
    ...     print(exc)
    flow.bands[0].max_requests: must be an int in -2**63..2**64-1, got 18446744073709551616
    """
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, int) and not isinstance(node, bool):
            if not _INT_MIN <= node <= _INT_MAX:
                raise ConfigError(f"{path}: must be an int in -2**63..2**64-1, got {node}")
            continue
        if id(node) in seen:  # a mapping built in Python may share or contain itself
            continue
        if isinstance(node, Mapping):
            seen.add(id(node))
            stack.extend((f"{path}.{key}", child) for key, child in node.items())
        elif isinstance(node, (list, tuple)):
            seen.add(id(node))
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(node))


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def read_config(source: ConfigSource, *, what: str, first_document: bool = False) -> ConfigDocument:
    """The mapping ``source`` holds, with where it came from (see the module docs). With
    ``first_document``, a YAML stream of several documents gives its first, as llm-d's Go
    loader reads one (:attr:`ConfigDocument.ignored_line` says where the others begin);
    without, it is refused.

    >>> read_config("a: 1", what="config").data
    {'a': 1}
    >>> read_config("a: 1\\n---\\nb: 2\\n", what="config", first_document=True).ignored_line
    2
    """
    if isinstance(source, Mapping):
        return ConfigDocument(dict(source), what)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidTypeError(
            f"{what} must be a mapping, a path or YAML / JSON text, got {type(source).__name__}"
        )
    path = None if isinstance(source, str) and looks_like_text(source) else Path(source)
    value, ignored = _read(source, what=what, secret=False, first_document=first_document)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        origin = "" if path is None else f" ({str(path)!r})"
        raise ConfigError(f"{what}: must be a mapping, got {type(value).__name__}{origin}")
    return ConfigDocument(value, what, path, ignored)


def load_mapping(source: ConfigSource, *, what: str) -> dict[str, Any]:
    """The mapping ``source`` holds (a copy for a mapping; see the module docs).

    >>> load_mapping('{"replicas": 4}', what="scenario")
    {'replicas': 4}
    """
    return read_config(source, what=what).data
