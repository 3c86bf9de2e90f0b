"""Collection rules for the whole suite: what needs an optional dependency is skipped, with the
reason, when that dependency is not installed.

* A test module whose import fails because an optional dependency is missing (``torch``,
  ``zmq``, ``aiohttp``, ``matplotlib``, ``tokenizers``, ...) is reported as skipped, naming the
  missing module and the extra that installs it, instead of failing collection.
* The package's own modules are collected for doctests; one that cannot be imported without an
  optional dependency (the executor without ``torch``, ...) is left out of collection and listed
  at the end of the run.

Which modules are optional is read from ``pyproject.toml``: every distribution named in
``[project.optional-dependencies]`` and not in ``[project.dependencies]``. The test-only and
developer extras count too, so ``pytest`` never fails collection for a missing plugin's import.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "python" / "llmsched"

# Distribution name -> import name, where they differ.
_IMPORT_NAMES = {
    "pyzmq": "zmq",
    "pyyaml": "yaml",
    "prometheus-client": "prometheus_client",
    "types-pyyaml": "",  # stubs only, nothing to import
    "pytest-benchmark": "pytest_benchmark",
    "pytest-timeout": "pytest_timeout",
}
# Imports that are optional although no extra names them (tests that build a real model).
_UNLISTED = {"transformers": None, "torch": None}


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return match.group(1).lower().replace("_", "-") if match else ""


def _optional_imports() -> dict[str, str | None]:
    """Import name -> the extra that installs it (None: no extra does)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r) for r in project.get("dependencies", [])}
    optional: dict[str, str | None] = dict(_UNLISTED)
    for extra, requirements in project.get("optional-dependencies", {}).items():
        for requirement in requirements:
            dist = _requirement_name(requirement)
            if dist.startswith("llmsched") or dist in required:
                continue
            name = _IMPORT_NAMES.get(dist, dist.replace("-", "_"))
            if name:
                optional.setdefault(name, extra)
                if optional[name] is None:
                    optional[name] = extra
    return optional


OPTIONAL = _optional_imports()


def missing_optional(exc: BaseException | None) -> str | None:
    """The skip reason when ``exc`` (or what caused it) is a missing optional dependency."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.split(".")[0]
            if top in OPTIONAL:
                extra = OPTIONAL[top]
                how = f"pip install 'llmsched[{extra}]'" if extra else f"pip install {top}"
                return f"needs {top}, which is not installed ({how})"
            return None
        exc = exc.__cause__ or exc.__context__
    return None


class _OptionalDependencyModule(pytest.Module):
    """A test module that is skipped, with the reason, when an optional dependency is missing."""

    def _getobj(self) -> object:
        try:
            return super()._getobj()
        except self.CollectError as exc:
            reason = missing_optional(exc)
            if reason is None:
                raise
            pytest.skip(reason, allow_module_level=True)


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if module_path.name == "__init__.py":
        return None
    return _OptionalDependencyModule.from_parent(parent, path=module_path)


_LEFT_OUT: dict[str, str] = {}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leaves out of doctest collection a package module that needs a missing optional
    dependency (importing it is what doctest collection would do first)."""
    if collection_path.suffix != ".py" or PACKAGE not in collection_path.parents:
        return None
    if collection_path.name == "__main__.py":  # doctest collection skips it; importing runs it
        return None
    parts = collection_path.relative_to(PACKAGE.parent).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    try:
        importlib.import_module(module)
    except ImportError as exc:
        reason = missing_optional(exc)
        if reason is not None:
            _LEFT_OUT[module] = reason
            return True
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for module, reason in sorted(_LEFT_OUT.items()):
        terminalreporter.write_line(f"doctests of {module} not collected: {reason}")
