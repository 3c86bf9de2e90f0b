"""Checks the declared minimum Rust version against the dependency graph.

Every crate that building the workspace's libraries compiles (dependencies included) must declare a
`rust-version` no newer than the workspace's, or none; otherwise a user on the declared minimum
toolchain could not build llmsched. Only one toolchain is installed where this runs, so this is the
check that can be made without the minimum compiler itself.

Usage: python tools/check_msrv.py  (exit 1 naming each offending crate)
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def version_tuple(text: str) -> tuple[int, ...]:
    """'1.85' or '1.85.0' as a comparable tuple (missing parts are 0)."""
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def library_closure(meta: dict[str, Any], members: set[str]) -> set[str]:
    """The packages that building the workspace's libraries compiles: the members and what they
    reach through normal and build dependencies (dev-dependencies, used only by tests and
    benchmarks, may need a newer toolchain)."""
    edges = {
        node["id"]: [
            dep["pkg"]
            for dep in node["deps"]
            if any(kind["kind"] in (None, "build") for kind in dep["dep_kinds"])
        ]
        for node in meta["resolve"]["nodes"]
    }
    seen: set[str] = set()
    stack = list(members)
    while stack:
        package = stack.pop()
        if package not in seen:
            seen.add(package)
            stack.extend(edges.get(package, []))
    return seen


def main() -> int:
    """Compares every package's rust-version with the workspace's; prints the result."""
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    meta = json.loads(out)
    members = set(meta["workspace_members"])
    declared = {p["rust_version"] for p in meta["packages"] if p["id"] in members}
    if len(declared) != 1 or None in declared:
        print(f"workspace members must share one rust-version, found {sorted(map(str, declared))}")
        return 1
    msrv = declared.pop()
    packages = {p["id"]: p for p in meta["packages"]}
    built = library_closure(meta, members)
    too_new = [
        f"{p['name']} {p['version']} needs Rust {p['rust_version']}"
        for p in (packages[i] for i in built)
        if p.get("rust_version") and version_tuple(p["rust_version"]) > version_tuple(msrv)
    ]
    if too_new:
        print(f"dependencies newer than the declared rust-version {msrv}:")
        print("\n".join(f"  {line}" for line in sorted(too_new)))
        return 1
    print(f"rust-version {msrv}: all {len(built)} crates of the libraries declare it or older")
    return 0


if __name__ == "__main__":
    sys.exit(main())
