"""The simulator's modules import each other without a cycle.

The graph is built statically (``ast``) from every import statement of ``llmsched.sim`` and
``llmsched.reference.sim`` — module level, under ``TYPE_CHECKING`` and inside functions alike —
with an edge to the module an import names (``from llmsched.sim.x import y``: to ``x``;
``from llmsched.sim import y``: to ``y`` when it is a submodule, else to the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

PYTHON = Path(__file__).resolve().parent.parent / "python"
PACKAGES = ("llmsched.sim", "llmsched.reference.sim")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every module of ``packages`` under ``root``."""
    out: dict[str, Path] = {}
    for package in packages:
        folder = root.joinpath(*package.split("."))
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Edges between the given modules (name -> source): who imports whom."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        package = name if name in PACKAGES else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                if target in graph and target != name:
                    graph[name].add(target)
                    break
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_simulator_modules_import_without_a_cycle() -> None:
    files = module_files(PYTHON, PACKAGES)
    assert "llmsched.sim.simulator" in files and "llmsched.reference.sim.engine" in files
    graph = import_graph({name: path.read_text() for name, path in files.items()})
    assert graph["llmsched.reference.sim.engine"] >= {"llmsched.reference.sim.replica"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_a_cycle_is_found() -> None:
    """The checker itself: a back-pointer import under TYPE_CHECKING, or a relative one, is a
    cycle."""
    modules = {
        "llmsched.sim": "",
        "llmsched.sim.replica": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from llmsched.sim.simulator import Simulation\n"
        ),
        "llmsched.sim.simulator": "from .replica import Replica\n",
    }
    cycle = find_cycle(import_graph(modules))
    assert cycle == ["llmsched.sim.replica", "llmsched.sim.simulator", "llmsched.sim.replica"]
    modules["llmsched.sim.simulator"] = "import os\n"
    assert find_cycle(import_graph(modules)) is None
    # A name imported from the package is an edge to its submodule when there is one.
    modules["llmsched.sim.simulator"] = "def f():\n    from llmsched.sim import replica\n"
    assert find_cycle(import_graph(modules)) is not None
