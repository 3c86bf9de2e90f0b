"""The profile-guided optimisation's kept profile and the flags release builds take from it
(tools/pgo_profile.py)."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import pgo_profile

ROOT = Path(__file__).resolve().parent.parent

# The first bytes of LLVM's indexed profile format (its magic number, written little-endian).
INDEXED_MAGIC = b"\xfflprofi\x81"


def write_profile(tmp_path: Path, content: bytes, llvm_major: int | None) -> tuple[Path, Path]:
    profile = tmp_path / "p.profdata.xz"
    with lzma.open(profile, "wb") as f:
        f.write(content)
    info = tmp_path / "profile.json"
    if llvm_major is not None:
        info.write_text(json.dumps({"llvm_major": llvm_major}))
    return profile, info


def test_the_kept_profile_is_an_indexed_llvm_profile_this_rustc_can_read() -> None:
    assert pgo_profile.PROFILE.exists(), "pgo/llmsched.profdata.xz is missing: make pgo-profile"
    with lzma.open(pgo_profile.PROFILE) as f:
        head = f.read(8)
    assert head == INDEXED_MAGIC
    info = json.loads(pgo_profile.PROFILE_INFO.read_text())
    assert {"llvm_major", "rustc", "commit", "made"} <= info.keys()
    try:
        have = pgo_profile.rustc_llvm_major()
    except FileNotFoundError:
        pytest.skip("no rustc here")
    assert info["llvm_major"] <= have, "this rustc's LLVM is older than the profile's"


def test_flags_use_the_unpacked_profile_and_unpack_only_when_it_changed(tmp_path: Path) -> None:
    profile, info = write_profile(tmp_path, b"profile one", llvm_major=20)
    out = tmp_path / "target" / "unpacked.profdata"
    flags = pgo_profile.rustflags(profile, info, out, llvm_major=22, enabled="1")
    assert flags == f"-Cprofile-use={out} {pgo_profile.QUIET}"
    assert out.read_bytes() == b"profile one"
    # An unpacked copy newer than the kept profile is reused as it is.
    out.write_bytes(b"left alone")
    pgo_profile.rustflags(profile, info, out, llvm_major=22, enabled="1")
    assert out.read_bytes() == b"left alone"
    # A kept profile newer than the copy is unpacked again.
    with lzma.open(profile, "wb") as f:
        f.write(b"profile two")
    later = out.stat().st_mtime + 10
    os.utime(profile, (later, later))
    pgo_profile.rustflags(profile, info, out, llvm_major=22, enabled="1")
    assert out.read_bytes() == b"profile two"


def test_no_flags_when_disabled_absent_or_unreadable_by_this_llvm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, info = write_profile(tmp_path, b"x", llvm_major=22)
    out = tmp_path / "unpacked.profdata"
    assert pgo_profile.rustflags(profile, info, out, llvm_major=22, enabled="0") == ""
    missing = tmp_path / "missing.profdata.xz"
    assert pgo_profile.rustflags(missing, info, out, llvm_major=22, enabled="1") == ""
    assert capsys.readouterr().err == ""
    # An older LLVM cannot read a newer profile: built without it, and said so.
    assert pgo_profile.rustflags(profile, info, out, llvm_major=21, enabled="1") == ""
    err = capsys.readouterr().err
    assert "written by LLVM 22" in err and "LLVM 21" in err
    # A profile without its record is not guessed at.
    unrecorded = tmp_path / "none.json"
    assert pgo_profile.rustflags(profile, unrecorded, out, llvm_major=99, enabled="1") == ""
    assert "does not say which LLVM wrote it" in capsys.readouterr().err
    # Without a rustc to ask: none, said so (the build then fails by itself).
    absent = str(tmp_path / "no-rustc")
    assert pgo_profile.rustflags(profile, info, out, enabled="1", rustc=absent) == ""
    assert "cannot ask" in capsys.readouterr().err
    assert not out.exists()


def test_the_makefile_builds_releases_with_the_flags_the_tool_prints() -> None:
    printed = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "pgo_profile.py"), "rustflags"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LLMSCHED_PGO": "1"},
    ).stdout.strip()
    assert printed.startswith("-Cprofile-use=")
    assert f'RUSTFLAGS="{printed}"' in make_build_dry_run(pgo="1")
    assert "-Cprofile-use" not in make_build_dry_run(pgo="0")


def make_build_dry_run(pgo: str) -> str:
    """The commands ``make build`` would run with ``LLMSCHED_PGO=pgo`` (and no RUSTFLAGS)."""
    return subprocess.run(
        ["make", "-n", "build"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LLMSCHED_PGO": pgo, "RUSTFLAGS": ""},
    ).stdout
