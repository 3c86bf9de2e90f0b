"""The Makefile's build steps that `.ci/run` leans on, run in a copy of it with stand-ins for
maturin, cargo and the venv's Python that only log their calls: `make build` calls maturin only
when something the extension is made of changed, and `make test` builds the benchmark harness
in its Rust half before `cargo test`."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("rustc") is None,
    reason="needs GNU make and rustc",
)

_LOGGER = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
{extra}
"""

# The venv's Python also logs what it would do with bytecode: its two variables, as it sees them;
# as tools/develop_from_wheel.py it leaves the extension, as the real one does.
_BYTECODE = 'echo "bytecode ${PYTHONDONTWRITEBYTECODE-unset} ${PYTHONPYCACHEPREFIX-}" >> "{log}"'
_DEVELOP = (
    'if [ "$1" = tools/develop_from_wheel.py ]; then touch python/llmsched/_llmsched.abi3.so; fi'
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the Makefile and what its parse reads, a venv of logging stand-ins."""
    for name in ("Makefile", "tools/pgo_profile.py", "pgo/profile.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    for name in (
        "Cargo.toml",
        "Cargo.lock",
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "crates/c/src/lib.rs",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "python" / "llmsched").mkdir(parents=True)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    stand_ins = {
        "maturin": "touch python/llmsched/_llmsched.abi3.so",
        "cargo": "",
        "ruff": "",
        "mypy": "",
        "python": _BYTECODE.replace("{log}", str(log)) + "\n" + _DEVELOP,
    }
    for name, extra in stand_ins.items():
        (bin_dir / name).write_text(_LOGGER.format(log=log, extra=extra))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "venv" / ".deps").touch()  # newer than pyproject.toml: no venv made
    return tmp_path


def _make(tree: Path, *args: str, **env: str) -> list[str]:
    """Runs make in ``tree``; the stand-ins' calls logged so far."""
    # A clean environment: under `make test` this process inherits the outer make's variables
    # (TEST_RUST_AFTER, TEST_RUST_PREFIX, MAKEFLAGS) and PYTHONPYCACHEPREFIX, which would decide
    # the copy's behaviour instead of the Makefile.
    environ = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "TMPDIR") or k.startswith(("RUSTUP_", "CARGO_HOME"))
    }
    # No real server is installed or looked for (`servers` installs nats-server when missing).
    command = ["make", "--no-print-directory", "VENV=venv", "NATS_SERVER=/bin/true", *args]
    done = subprocess.run(
        command,
        cwd=tree,
        env={**environ, "LLMSCHED_PGO": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = tree / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def _builds(calls: list[str]) -> int:
    return sum(call.startswith("maturin develop --release") for call in calls)


def test_build_runs_maturin_only_when_something_changed(tree: Path) -> None:
    assert _builds(_make(tree, "build")) == 1
    assert _builds(_make(tree, "build")) == 1  # nothing changed: no maturin
    assert _builds(_make(tree, "build", RUSTFLAGS="-Ctarget-cpu=native")) == 2  # other flags
    assert _builds(_make(tree, "build")) == 3  # and back
    assert _builds(_make(tree, "build")) == 3
    (tree / "python" / "llmsched" / "_llmsched.abi3.so").unlink()
    assert _builds(_make(tree, "build")) == 4  # the extension gone
    stamp, source = tree / "venv" / ".build", tree / "crates" / "c" / "src" / "lib.rs"
    built = stamp.stat().st_mtime - 10
    os.utime(stamp, (built, built))
    os.utime(source, (built + 5, built + 5))  # edited since the last build
    assert _builds(_make(tree, "build")) == 5  # a source newer than the build
    assert _builds(_make(tree, "build")) == 5
    _make(tree, "build-dev")  # the debug extension replaces the release one
    assert _builds(_make(tree, "build")) == 6


def test_build_from_wheel_installs_the_wheels_extension_and_compiles_once(tree: Path) -> None:
    """CI's `make build BUILD_FROM_WHEEL=1`: the wheel's release build, then its extension put
    in place by tools/develop_from_wheel.py, no `maturin develop`; a later plain `make build`
    (as `make test` runs it) finds the extension current."""
    (tree / "dist").mkdir()  # where the real maturin writes the wheel
    calls = _make(tree, "build", "BUILD_FROM_WHEEL=1")
    maturin = [call for call in calls if call.startswith("maturin ")]
    assert _builds(calls) == 0, calls
    assert maturin[0].startswith("maturin build --release --zig"), calls
    assert any(c.startswith("python tools/develop_from_wheel.py dist/") for c in calls), calls
    (tree / "calls.log").unlink()
    assert [c for c in _make(tree, "build") if not c.startswith("bytecode ")] == []


def test_make_test_runs_the_python_tests_in_several_processes(tree: Path) -> None:
    pytest_calls = [c for c in _make(tree, "test-python") if c.startswith("python -m pytest")]
    assert pytest_calls and pytest_calls[0].endswith(" -n 3"), pytest_calls
    (tree / "calls.log").unlink()
    calls = _make(tree, "test-python", "PYTEST_WORKERS=1")
    pytest_calls = [c for c in calls if c.startswith("python -m pytest")]
    assert pytest_calls and " -n " not in pytest_calls[0], pytest_calls


def test_make_test_builds_the_harness_before_cargo_test(tree: Path) -> None:
    calls = _make(tree, "test")
    cargo = [call for call in calls if call.startswith("cargo ")]
    assert cargo[:2] == ["cargo build --release -p llmsched-bench", "cargo test --workspace"], calls
    assert any(call.startswith("python -m pytest") for call in calls), calls
    # `make test-rust` alone does not build it.
    (tree / "calls.log").unlink()
    alone = [call for call in _make(tree, "test-rust") if call.startswith("cargo ")]
    assert alone[0] == "cargo test --workspace", alone


def test_lint_is_its_quick_half_and_clippy_and_ci_runs_both(tree: Path) -> None:
    """`.ci/run` runs `make lint` as two targets, `lint-quick` alone and `clippy` beside the
    wheel's build: `make lint` runs exactly their two sets of checks, and CI names both (or
    `lint` itself)."""
    _make(tree, "build")
    runs: dict[str, list[str]] = {}
    for target in ("lint", "lint-quick", "clippy"):
        (tree / "calls.log").unlink()
        runs[target] = _make(tree, target)
    clippy = "cargo clippy --release --workspace --all-targets --all-features -- -D warnings"
    assert runs["clippy"] == [clippy], runs["clippy"]
    assert any(call.startswith("mypy") for call in runs["lint-quick"]), runs["lint-quick"]
    assert sorted(runs["lint"]) == sorted(runs["lint-quick"] + runs["clippy"])
    targets = {
        word
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("step make ")
        for word in shlex.split(line, comments=True)[2:]
        if not word.startswith("-") and "=" not in word
    }
    assert "lint" in targets or {"lint-quick", "clippy"} <= targets, targets


def test_make_test_python_keeps_bytecode_where_the_environment_writes_none(tree: Path) -> None:
    """With PYTHONDONTWRITEBYTECODE set, every Python process the tests start compiled all it
    imports from source: the tests' bytecode goes to target/pycache instead, once. Without it,
    Python's own __pycache__ is left alone."""
    calls = _make(tree, "test-python", PYTHONDONTWRITEBYTECODE="1")
    bytecode = [call for call in calls if call.startswith("bytecode ")]
    assert bytecode == [f"bytecode unset {tree / 'target' / 'pycache'}"], calls
    (tree / "calls.log").unlink()
    calls = _make(tree, "test-python", PYTHONDONTWRITEBYTECODE="")
    assert [call for call in calls if call.startswith("bytecode ")] == ["bytecode  "], calls
