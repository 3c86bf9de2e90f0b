"""Checks the distributable wheel that ``make wheel`` builds.

``tags WHEEL``: the wheel is the one we mean to ship: tagged ``cp310-abi3`` and
``manylinux_2_17`` (manylinux2014), holding ``_llmsched.abi3.so``, whose glibc symbol versions
(``objdump -T``) go no higher than 2.17 and which ``auditwheel show`` finds consistent with
manylinux_2_17. At least one of objdump and auditwheel must be present.

``smoke WHEEL [--python PATH ...]``: installs the wheel alone (with its required dependencies,
numpy and PyYAML, nothing else) into a fresh venv made by ``uv`` for each interpreter, and runs
``tools/wheel_smoke.py`` there, outside the repository. Without ``--python`` it takes the oldest
and the newest CPython 3.10+ that pyenv has (``$PYENV_ROOT/versions``, default ``~/.pyenv``).

Exit status 1 with a message naming the problem when a check fails. Prints the wheel's tags,
size and the time of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 10)
MAX_GLIBC = (2, 17)
CORE_PACKAGES = {"llmsched", "numpy", "pyyaml"}


class CheckFailed(Exception):
    """A wheel check failed; the message says which and why."""


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Runs a command, raising CheckFailed with its output when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise CheckFailed(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}".rstrip()
        )
    return done  # type: ignore[no-any-return]


def tool(name: str) -> str | None:
    """``name`` beside this interpreter (the venv) or on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def wheel_tags(wheel: Path) -> tuple[str, str, list[str]]:
    """(python tag, abi tag, platform tags) from a wheel's file name."""
    parts = wheel.name.removesuffix(".whl").split("-")
    if not wheel.name.endswith(".whl") or len(parts) not in (5, 6):
        raise CheckFailed(f"{wheel.name} is not a wheel file name")
    return parts[-3], parts[-2], parts[-1].split(".")


def glibc_max(library: Path) -> tuple[int, ...] | None:
    """The highest ``GLIBC_x.y`` symbol version ``library`` needs, or None without objdump."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    symbols = run([objdump, "-T", str(library)]).stdout
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"GLIBC_([\d.]+)", symbols)}
    if not versions:
        raise CheckFailed(f"objdump -T found no GLIBC symbol versions in {library.name}")
    return max(versions)


def check_tags(wheel: Path) -> None:
    """The tag, the extension's name and the glibc it needs (see the module docs)."""
    python, abi, platforms = wheel_tags(wheel)
    print(f"wheel: {wheel.name} ({wheel.stat().st_size / 1e6:.2f} MB)")
    if (python, abi) != ("cp310", "abi3"):
        raise CheckFailed(f"expected a cp310-abi3 wheel, got {python}-{abi}")
    if not any(p.startswith(("manylinux_2_17_", "manylinux2014_")) for p in platforms):
        raise CheckFailed(f"expected a manylinux_2_17 (manylinux2014) tag, got {platforms}")
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        libs = [n for n in zf.namelist() if re.fullmatch(r"llmsched/_llmsched[^/]*\.so", n)]
        if libs != ["llmsched/_llmsched.abi3.so"]:
            raise CheckFailed(f"expected llmsched/_llmsched.abi3.so in the wheel, found {libs}")
        library = Path(zf.extract(libs[0], tmp))
        found = glibc_max(library)
        if found is None:
            print("objdump not found: glibc symbol versions not read")
        else:
            print(f"highest glibc symbol version needed: {'.'.join(map(str, found))}")
            if found > MAX_GLIBC:
                raise CheckFailed(f"the extension needs glibc {found}, above {MAX_GLIBC}")
    auditwheel = tool("auditwheel")
    if auditwheel is None:
        if found is None:
            raise CheckFailed("neither objdump nor auditwheel is installed: cannot check glibc")
        print("auditwheel not found: `pip install auditwheel` to check the policy too")
        return
    shown = " ".join(run([auditwheel, "show", str(wheel)]).stdout.split())
    policy = re.search(r'constrains the platform tag to "(manylinux_(\d+)_(\d+)_\w+)"', shown)
    if policy is None:
        raise CheckFailed(f"unexpected auditwheel show output: {shown}")
    if (int(policy[2]), int(policy[3])) > MAX_GLIBC:
        raise CheckFailed(f"auditwheel: {shown}")
    print(f"auditwheel show: consistent with {policy[1]}")


def pyenv_pythons() -> list[Path]:
    """The oldest and newest CPython >= 3.10 under pyenv (one path if they coincide)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found: dict[tuple[int, ...], Path] = {}
    for entry in root.glob("*") if root.is_dir() else []:
        if re.fullmatch(r"\d+\.\d+\.\d+", entry.name) and (entry / "bin" / "python3").exists():
            version = tuple(int(p) for p in entry.name.split("."))
            if version[:2] >= MIN_PYTHON:
                found[version] = entry / "bin" / "python3"
    if not found:
        raise CheckFailed(
            f"no CPython >= 3.10 under {root}: pass interpreters with --python (make: PYTHONS=)"
        )
    return sorted({found[min(found)], found[max(found)]})


def smoke(wheel: Path, python: Path, uv: str) -> dict[str, object]:
    """Installs ``wheel`` alone into a fresh venv on ``python`` and runs the smoke script."""
    with tempfile.TemporaryDirectory(prefix="llmsched-wheel-") as tmp:
        venv = Path(tmp) / "venv"
        started = time.perf_counter()
        run([uv, "venv", "-q", "-p", str(python), str(venv)])
        venv_python = venv / "bin" / "python"
        run([uv, "pip", "install", "-q", "-p", str(venv_python), str(wheel)])
        install_s = time.perf_counter() - started
        listed = run([uv, "pip", "list", "--format", "json", "-p", str(venv_python)]).stdout
        names = {p["name"].lower() for p in json.loads(listed)}
        if names != CORE_PACKAGES:
            raise CheckFailed(f"{python}: the wheel installed {sorted(names)}")
        started = time.perf_counter()
        done = run(
            [
                str(venv_python),
                "-I",
                str(ROOT / "tools" / "wheel_smoke.py"),
                str(ROOT / "tests" / "data"),
            ],
            cwd=tmp,
        )
        smoke_s = time.perf_counter() - started
        report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        extension = Path(str(report["extension"]))
        if venv not in extension.parents or extension.name != "_llmsched.abi3.so":
            raise CheckFailed(f"{python}: llmsched was imported from {extension}, not the venv")
    return {**report, "install_s": install_s, "smoke_s": smoke_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["tags", "smoke"])
    parser.add_argument("wheel", type=Path, nargs="+", help="the wheel (exactly one)")
    parser.add_argument("--python", type=Path, action="append", help="interpreter to test on")
    args = parser.parse_args()
    try:
        if len(args.wheel) != 1:
            raise CheckFailed(f"expected one wheel, got {[str(w) for w in args.wheel]}")
        wheel = args.wheel[0].resolve()
        if not wheel.is_file():
            raise CheckFailed(f"{wheel} does not exist: run `make wheel`")
        if args.check == "tags":
            check_tags(wheel)
            return
        uv = tool("uv")
        if uv is None:
            raise CheckFailed("uv is not installed (`make venv` installs it)")
        for python in args.python or pyenv_pythons():
            r = smoke(wheel, python, uv)
            print(
                f"python {r['python']}: llmsched {r['llmsched']} from {wheel.name}: "
                f"install {r['install_s']:.1f} s, smoke test {r['smoke_s']:.1f} s, ok"
            )
    except CheckFailed as exc:
        sys.exit(f"wheel_check {args.check}: {exc}")


if __name__ == "__main__":
    main()
