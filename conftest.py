"""Collection rules for the whole suite: what needs an optional dependency is skipped, with the
reason, when that dependency is not installed.

* A test module whose import fails because an optional dependency is missing (``torch``,
  ``zmq``, ``aiohttp``, ``matplotlib``, ``tokenizers``, ...) is reported as skipped, naming the
  missing module and the extra that installs it, instead of failing collection.
* The same for doctest collection (``--doctest-modules`` imports every module of the package
  and of ``tests/``): the executor's doctests are skipped without ``torch``, and so on; and for
  a test or doctest that fails in setup or while running only because such a dependency is
  missing (an example that touches ``llmsched.executor.Engine`` without ``torch``).
* Nothing else is turned into a skip: a missing module that no extra names, or a broken import
  inside an installed package, still fails.

Which modules are optional: every distribution named in ``[project.optional-dependencies]`` of
``pyproject.toml`` (the skip reason names its extra), and the heavier imports listed in
``_UNLISTED`` below.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Generator
from pathlib import Path

import pytest
from _pytest.doctest import DoctestModule

ROOT = Path(__file__).resolve().parent

# Distribution name -> import name, where they differ.
_IMPORT_NAMES = {
    "pyzmq": "zmq",
    "pyyaml": "yaml",
    "prometheus-client": "prometheus_client",
    "types-pyyaml": "",  # stubs only, nothing to import
    "pytest-benchmark": "pytest_benchmark",
    "pytest-timeout": "pytest_timeout",
}
_DIST_NAMES = {v: k for k, v in _IMPORT_NAMES.items() if v}

# Imports a test module may need that a minimal install can lack, whether or not an extra names
# them yet (an extra that lists one is named in the skip reason instead of the bare package).
_UNLISTED: dict[str, str | None] = dict.fromkeys(
    [
        "aiohttp",
        "jinja2",
        "matplotlib",
        "prometheus_client",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "uvloop",
        "yarl",
        "zmq",
    ]
)


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
    optional: dict[str, str | None] = dict(_UNLISTED)
    for extra, requirements in project.get("optional-dependencies", {}).items():
        for requirement in requirements:
            dist = _requirement_name(requirement)
            if dist.startswith("llmsched"):
                continue
            name = _IMPORT_NAMES.get(dist, dist.replace("-", "_"))
            if name and optional.get(name) is None:
                optional[name] = extra
    return optional


OPTIONAL = _optional_imports()


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_optional(exc: BaseException | None) -> str | None:
    """The skip reason when ``exc`` (or what caused it) is an optional dependency that is not
    installed; None for anything else (a broken import of an installed package fails)."""
    while exc is not None:
        # ModuleNotFoundError from a bare import, or the ImportError of
        # llmsched._extras.require (its `name` is the missing package).
        if isinstance(exc, ImportError) and exc.name:
            top = exc.name.split(".")[0]
            if top not in OPTIONAL or _installed(top):
                return None
            extra = OPTIONAL[top]
            dist = _DIST_NAMES.get(top, top)
            how = f"pip install 'llmsched[{extra}]'" if extra else f"pip install {dist}"
            return f"needs {top}, which is not installed ({how})"
        # A doctest example's exception travels inside doctest.UnexpectedException.exc_info.
        inner = getattr(exc, "exc_info", None)
        if isinstance(inner, tuple) and len(inner) == 3 and isinstance(inner[1], BaseException):
            exc = inner[1]
            continue
        exc = exc.__cause__ or exc.__context__
    return None


class _SkipsMissingOptional(pytest.Module):
    """A module collector that skips, with the reason, when importing the module needs a
    missing optional dependency."""

    def _getobj(self) -> object:
        try:
            return super()._getobj()
        except self.CollectError as exc:
            reason = missing_optional(exc)
            if reason is None:
                raise
            pytest.skip(reason, allow_module_level=True)


class _OptionalDependencyModule(_SkipsMissingOptional):
    """A test module (tests in it are skipped when an optional dependency is missing)."""


class _OptionalDependencyDoctests(_SkipsMissingOptional, DoctestModule):
    """A module's doctests (the executor's need ``torch``, the gateway's ``aiohttp``, ...)."""


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if module_path.name == "__init__.py":
        return None
    return _OptionalDependencyModule.from_parent(parent, path=module_path)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector], list[pytest.Collector]]:
    collectors = yield
    return [
        _OptionalDependencyDoctests.from_parent(parent, path=c.path)
        if type(c) is DoctestModule
        else c
        for c in collectors
    ]


def _skip_when_optional_missing(item: pytest.Item) -> Generator[None, None, None]:
    """Setup or call of a test or doctest that fails only because an optional dependency is
    missing: a doctest in a package whose ``__init__`` needs it fails in setup, an example that
    uses one lazily (``llmsched.executor.Engine`` without torch) in the call."""
    try:
        return (yield)
    except Exception as exc:
        reason = missing_optional(exc)
        if reason is None:
            raise
        pytest.skip(reason)


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_skip_when_optional_missing)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_skip_when_optional_missing)
