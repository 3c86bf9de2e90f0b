"""Puts the extension of a built wheel into the source tree, as ``maturin develop`` would.

``python tools/develop_from_wheel.py WHEEL`` (``make build BUILD_FROM_WHEEL=1``, which CI runs):
``make wheel`` and ``make build`` compile the same crates with the same profile-guided flags,
but the wheel links through zig against glibc 2.17 in its own target directory, so the two are
separate release builds of several minutes each. Where the wheel is built anyway, this takes
its ``llmsched/_llmsched.abi3.so`` into ``python/llmsched/`` and, when the running venv lacks
it, installs the editable form that ``maturin develop`` leaves (``llmsched.pth`` naming
``python/``, the wheel's metadata and its ``llmsched`` console script), so that the tests, lint
and benchmarks run on the extension that ships.

Exit status 1 with a message naming the problem: no or several wheels, a wheel without the
extension, or an install that failed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from wheel_check import tool  # tools/ is this script's directory, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "python"
EXTENSION = "llmsched/_llmsched.abi3.so"


class DevelopFailed(Exception):
    """The wheel cannot be put into the source tree; the message says why."""


def record_line(name: str, data: bytes) -> str:
    """A RECORD row (PEP 376): path, urlsafe sha256 without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def take_extension(wheel: zipfile.ZipFile) -> Path:
    """Writes the wheel's extension into ``python/llmsched`` (replacing it, never writing into
    a file a running process may have mapped)."""
    try:
        data = wheel.read(EXTENSION)
    except KeyError:
        raise DevelopFailed(f"{wheel.filename} holds no {EXTENSION}") from None
    target = SOURCE / EXTENSION
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".extension-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def editable_installed() -> bool:
    """Whether this interpreter's site-packages has the editable install pointing here."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "llmsched.pth"
    try:
        return pth.read_text().strip() == str(SOURCE)
    except OSError:
        return False


def editable_wheel(wheel: zipfile.ZipFile, out_dir: Path) -> Path:
    """A wheel of the built one's metadata plus ``llmsched.pth``: what ``maturin develop``
    installs, with the package itself left in the source tree."""
    dist_info = [n for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")]
    if not dist_info:
        raise DevelopFailed(f"{wheel.filename} has no .dist-info")
    record_name = next((n for n in dist_info if n.endswith("/RECORD")), None)
    if record_name is None:
        raise DevelopFailed(f"{wheel.filename} has no RECORD")
    path = out_dir / Path(wheel.filename or "llmsched.whl").name
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as editable:
        members = [(n, wheel.read(n)) for n in dist_info if n != record_name]
        members.append(("llmsched.pth", f"{SOURCE}\n".encode()))
        for name, data in members:
            editable.writestr(name, data)
            rows.append(record_line(name, data))
        rows.append(f"{record_name},,")
        editable.writestr(record_name, "\n".join(rows) + "\n")
    return path


def install(path: Path) -> None:
    """Installs ``path`` into this interpreter's environment with uv (no dependencies: the
    venv has them)."""
    uv = tool("uv")
    if uv is None:
        raise DevelopFailed("uv is not installed (`make venv` installs it)")
    command = [
        uv,
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--reinstall",
        "-p",
        sys.executable,
        str(path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DevelopFailed(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, nargs="+", help="the wheel (exactly one)")
    args = parser.parse_args()
    try:
        if len(args.wheel) != 1 or not args.wheel[0].is_file():
            raise DevelopFailed(f"expected one built wheel, got {[str(w) for w in args.wheel]}")
        with zipfile.ZipFile(args.wheel[0]) as wheel:
            target = take_extension(wheel)
            if not editable_installed():
                with tempfile.TemporaryDirectory(prefix="llmsched-develop-") as tmp:
                    install(editable_wheel(wheel, Path(tmp)))
        print(f"{target.relative_to(ROOT)} from {args.wheel[0].name}")
    except (DevelopFailed, OSError, zipfile.BadZipFile) as exc:
        sys.exit(f"develop_from_wheel: {exc}")


if __name__ == "__main__":
    main()
