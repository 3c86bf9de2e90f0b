"""One way to read configuration: a mapping, YAML / JSON text, or a YAML / JSON file.

Every component that takes configuration (the router, the flow controller, the gateway and its
discovery file, simulator scenarios, step-model profiles) reads it through :func:`load_mapping`
or :func:`read_document`, so they accept the same inputs and fail the same way:

* a ``Mapping`` is copied (one level) and used as is;
* an ``os.PathLike`` is a file; a ``str`` is a file too, unless it is blank, holds a newline,
  starts with ``{`` or ``[``, or names no file and contains ``:`` (then it is YAML / JSON text);
* files ending in ``.json`` are parsed as JSON, everything else as YAML (a superset of JSON);
  an empty document is an empty mapping.

Errors are :class:`~llmsched.errors.ConfigError` naming what was being read and the file:
``"flow config: cannot read 'flow.yaml': does not exist"``,
``"config: cannot read 'gw.yaml': not valid YAML / JSON (...)"``,
``"scenario: must be a mapping, got list ('s.yaml')"``. Errors about a key inside the
document name the file too: :meth:`ConfigDocument.error`.

>>> load_mapping("default_band: {ttl_s: 30}", what="flow config")
{'default_band': {'ttl_s': 30}}
>>> load_mapping({"a": 1}, what="config")
{'a': 1}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsched.errors import ConfigError, InvalidTypeError

__all__ = [
    "ConfigDocument",
    "ConfigSource",
    "load_mapping",
    "looks_like_text",
    "read_config",
    "read_document",
]

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
    return ":" in source and not Path(source).is_file()


def read_document(source: str | os.PathLike[str], *, what: str) -> Any:
    """The YAML / JSON value held by a file or text, whatever its type (``None`` when empty).

    >>> read_document("[1, 2]", what="engines")
    [1, 2]
    """
    if isinstance(source, str) and looks_like_text(source):
        return _parse(source, json_only=False, what=what, path=None)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidTypeError(
            f"{what} must be a path or YAML / JSON text, got {type(source).__name__}"
        )
    path = Path(source)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {reason}") from None
    return _parse(text, json_only=path.suffix == ".json", what=what, path=path)


def _parse(text: str, *, json_only: bool, what: str, path: Path | None) -> Any:
    if json_only:
        try:
            return json.loads(text) if text.strip() else None
        except ValueError as exc:  # json.JSONDecodeError
            reason = str(exc)
    else:
        import yaml  # YAML is only needed when a document is read

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            reason = " ".join(str(exc).split())
    if path is None:
        raise ConfigError(f"{what}: not valid YAML / JSON ({reason})")
    raise ConfigError(f"{what}: cannot read {str(path)!r}: not valid YAML / JSON ({reason})")


def read_config(source: ConfigSource, *, what: str) -> ConfigDocument:
    """The mapping ``source`` holds, with where it came from (see the module docs).

    >>> read_config("a: 1", what="config").data
    {'a': 1}
    """
    if isinstance(source, Mapping):
        return ConfigDocument(dict(source), what)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidTypeError(
            f"{what} must be a mapping, a path or YAML / JSON text, got {type(source).__name__}"
        )
    path = None if isinstance(source, str) and looks_like_text(source) else Path(source)
    value = read_document(source, what=what)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        origin = "" if path is None else f" ({str(path)!r})"
        raise ConfigError(f"{what}: must be a mapping, got {type(value).__name__}{origin}")
    return ConfigDocument(value, what, path)


def load_mapping(source: ConfigSource, *, what: str) -> dict[str, Any]:
    """The mapping ``source`` holds (a copy for a mapping; see the module docs).

    >>> load_mapping('{"replicas": 4}', what="scenario")
    {'replicas': 4}
    """
    return read_config(source, what=what).data
