"""No module of the package reaches into another module's private (``_name``) names.

A module may use its own ``_names`` and those of the native module ``llmsched._llmsched``;
anything another module needs is public, or a documented package-internal name without the
underscore. Checked statically (``ast``), so a new reach fails here before review:

* ``from llmsched.x import _name`` (absolute or relative);
* ``obj._name`` (read or written) where ``obj`` is not ``self`` / ``cls`` and the module itself
  defines no ``_name`` (function, class, or attribute set on ``self`` / ``cls`` or in a class
  body).

Underscore *modules* such as ``llmsched._tokens`` are package-internal by convention and may be
imported from.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "llmsched"
EXCLUDED: tuple[str, ...] = ()
NATIVE = "_llmsched"
# Private names of the standard library and of third-party objects that are their documented API.
ALLOWED_ATTRIBUTES = frozenset({"_asdict", "_replace", "_fields", "_make", "_exit"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.AST) -> set[str]:
    """Names this module defines: functions, classes, class-body and self/cls attributes."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "object.__setattr__"  # how frozen dataclasses set fields
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            own.add(str(node.args[1].value))
    return own


def private_reaches(source: str, module: str) -> list[str]:
    """Every reach into another module's private names in ``source`` (``module``: its dotted
    name, to resolve relative imports), as ``"line: what"`` strings."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".")[: -node.level]
                target = ".".join([*base, target] if target else base)
            if target.split(".")[0] != "llmsched":
                continue
            for alias in node.names:
                if _is_private(alias.name) and alias.name != NATIVE and not target.endswith(NATIVE):
                    found.append(f"{node.lineno}: from {target} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr in ALLOWED_ATTRIBUTES:
                continue
            if isinstance(node.value, ast.Name) and node.value.id == NATIVE:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in EXCLUDED
    )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_reach_across_modules(path: Path) -> None:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    reaches = private_reaches(path.read_text(), module)
    assert not reaches, f"{path.relative_to(PACKAGE.parent)} uses private names: {reaches}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from llmsched.hashing import _check_seed\n",
            ["1: from llmsched.hashing import _check_seed"],
        ),
        ("from ..routing import _native\n", ["1: from llmsched.routing import _native"]),
        ("def f(model):\n    return model._flop_rate\n", ["2: model._flop_rate"]),
        ("def f(sim, out):\n    sim._native_done = out\n", ["2: sim._native_done"]),
        ("from llmsched import _llmsched\nx = _llmsched.PrefixIndex\n", []),
        ("from llmsched._tokens import as_token_array\n", []),
        (
            "class A:\n    def __init__(self):\n        self._x = 1\n    def eq(self, o):\n"
            "        return o._x == self._x\n",
            [],
        ),
    ],
)
def test_the_check_finds_what_it_should(source: str, expected: list[str]) -> None:
    assert private_reaches(source, "llmsched.sim.fast") == expected
