"""Every public name has a docstring: what ``help()`` and the API pages of the manual show.

Public means listed in the ``__all__`` of ``llmsched`` or of one of its public modules and
subpackages (those whose extra is missing are skipped); for a class, each public method and
property too (``inspect.getdoc``: a docstring inherited from a base class counts).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import llmsched

MODULES = ["llmsched"] + [
    m.name
    for m in pkgutil.iter_modules(llmsched.__path__, "llmsched.")
    if not m.name.rsplit(".", 1)[1].startswith("_")
]


def _undocumented(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = [] if inspect.getdoc(module) else [module_name]
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue  # constants and type aliases: documented where they are assigned
        if not inspect.getdoc(obj):
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            for attr, raw in vars(obj).items():
                member = getattr(obj, attr, None)
                if attr.startswith("_") or not (
                    isinstance(raw, property) or inspect.isroutine(member)
                ):
                    continue
                if not inspect.getdoc(raw if isinstance(raw, property) else member):
                    missing.append(f"{module_name}.{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", MODULES)
def test_public_names_have_docstrings(module_name: str) -> None:
    try:
        missing = _undocumented(module_name)
    except ImportError as exc:
        pytest.skip(str(exc))
    assert missing == []
