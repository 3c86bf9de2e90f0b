"""Profile-guided optimisation of the native extension: makes the profile and says how to use it.

The extension's release builds (``make build``, ``make wheel``) compile the Rust code with the
execution profile kept in ``pgo/llmsched.profdata.xz``: LLVM lays out the hot paths
together, inlines and orders branches by what the profile saw run. On this project's machine
that made the index's ingest of engine events 1.11-1.16x as fast and cut the gateway's
user-mode CPU per request to 0.71-0.97x (docs/measurements.md, "Profile-guided optimisation").

``rustflags``: prints the ``RUSTFLAGS`` a release build adds (nothing
when the profile is absent, when ``LLMSCHED_PGO=0``, or when the rustc in use has an older LLVM
than the one that wrote the profile, which it cannot read; the last says so on stderr). The
profile is decompressed into ``target/pgo/`` when the compressed one is newer.

``make`` (what ``make pgo-profile`` runs): builds the extension instrumented
(``-Cprofile-generate``), twice (see ``BUILDS``), and runs a training load with each (the
simulator's default scenario, the short benchmark pass of ``benches/`` without the twins, the
prefix index at the small size of ``benches/bench_peers_index.py``, and ``llmsched serve`` with
its native data plane at 1,000 requests/s: chat and plain completions, JSON and streamed, the
llm-d preset and round-robin), merges what it recorded with ``llvm-profdata`` (from rustup's
``llvm-tools`` component, added when missing) and writes ``pgo/llmsched.profdata.xz`` and
``pgo/profile.json`` (the LLVM and rustc versions, the commit, the time each load took).

A profile made before later changes still serves: a function whose code changed since is
compiled without its profile (LLVM matches each function by name and a hash of its control
flow), the others with it. Remake it after large changes to hot paths or a dependency bump.
"""

from __future__ import annotations

import argparse
import json
import lzma
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
PROFILE = ROOT / "pgo" / "llmsched.profdata.xz"
PROFILE_INFO = ROOT / "pgo" / "profile.json"
UNPACKED = ROOT / "target" / "pgo" / "llmsched.profdata"
# Quiet about functions whose code changed since the profile was made (they are compiled
# without it); a stale profile is expected between remakes, not a fault.
QUIET = "-Cllvm-args=-no-pgo-warn-mismatch"


class PgoError(Exception):
    """A step of making the profile failed; the message names it."""


def rustc_field(pattern: str, rustc: str = "rustc") -> str:
    """The first group of ``pattern`` matched against a line of ``rustc -vV``."""
    out = subprocess.run([rustc, "-vV"], capture_output=True, text=True, check=True).stdout
    match = re.search(pattern, out, re.MULTILINE)
    if match is None:
        raise PgoError(f"{rustc} -vV has no line matching {pattern!r}:\n{out}")
    return match.group(1)


def rustc_llvm_major(rustc: str = "rustc") -> int:
    """The major version of the LLVM inside ``rustc``."""
    return int(rustc_field(r"^LLVM version: (\d+)", rustc))


def profile_llvm_major(info: Path = PROFILE_INFO) -> int | None:
    """The LLVM major version that wrote the kept profile (None without its record)."""
    try:
        return int(json.loads(info.read_text())["llvm_major"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def unpack(profile: Path = PROFILE, out: Path = UNPACKED) -> Path:
    """``profile`` decompressed to ``out``, redone only when ``profile`` is newer."""
    if not out.exists() or out.stat().st_mtime < profile.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Its own part file: makes run side by side (`make -j2 docs wheel`) each unpack.
        part = out.with_suffix(f".part{os.getpid()}")
        with lzma.open(profile) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        part.replace(out)
    return out


def rustflags(
    profile: Path = PROFILE,
    info: Path = PROFILE_INFO,
    out: Path = UNPACKED,
    llvm_major: int | None = None,
    enabled: str | None = None,
    rustc: str = "rustc",
) -> str:
    """The ``RUSTFLAGS`` a release build adds to use ``profile``; empty when there is none to
    use (see the module's docstring). ``llvm_major`` stands for asking ``rustc``."""
    if (enabled if enabled is not None else os.environ.get("LLMSCHED_PGO", "1")) == "0":
        return ""
    if not profile.exists():
        return ""
    wrote = profile_llvm_major(info)
    if wrote is None:
        print(
            f"pgo: building without {profile.name}: {info.name} does not say which LLVM wrote it",
            file=sys.stderr,
        )
        return ""
    try:
        have = llvm_major if llvm_major is not None else rustc_llvm_major(rustc)
    except (OSError, subprocess.CalledProcessError, PgoError) as exc:
        # A build without a rustc on the path fails by itself, saying so: no error here too.
        print(f"pgo: building without {profile.name}: cannot ask {rustc}: {exc}", file=sys.stderr)
        return ""
    if have < wrote:
        print(
            f"pgo: building without {profile.name}: it was written by LLVM {wrote}, "
            f"this rustc has LLVM {have}, which cannot read it",
            file=sys.stderr,
        )
        return ""
    return f"-Cprofile-use={unpack(profile, out)} {QUIET}"


def host_target() -> str:
    """The target triple of the machine rustc runs on."""
    return rustc_field(r"^host: (\S+)")


def llvm_profdata() -> Path:
    """rustup's ``llvm-profdata`` for the rustc in use, adding ``llvm-tools`` when missing."""
    sysroot = subprocess.run(
        ["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tool = Path(sysroot) / "lib" / "rustlib" / host_target() / "bin" / "llvm-profdata"
    if not tool.exists():
        if shutil.which("rustup") is None:
            raise PgoError(f"{tool} is missing and there is no rustup to add llvm-tools")
        subprocess.run(["rustup", "component", "add", "llvm-tools"], check=True)
    if not tool.exists():
        raise PgoError(f"{tool} is still missing after adding llvm-tools")
    return tool


# The two builds a profile serves: `make build`'s and the wheel's (`make wheel`: maturin's zig
# build, linked against glibc 2.17). LLVM finds a function's profile by its symbol, whose hash
# cargo derives from the build's settings, and the zig build's settings give other hashes: it
# names the target and keeps the target's settings off the build scripts (cargo's unstable
# `target-applies-to-host`, which maturin turns on), so every crate with a build script and all
# that depends on one differ. Each is trained and the profile holds both. The wheel's is
# instrumented with the same settings but linked by the system's linker (the linker is not part
# of the hash; zig's cannot link LLVM's profiling runtime).
BUILDS: dict[str, tuple[list[str], dict[str, str]]] = {
    "develop": (["build", "--release"], {}),
    "wheel": (
        ["build", "--release", "--target", "HOST"],
        {
            "CARGO_TARGET_APPLIES_TO_HOST": "false",
            "CARGO_UNSTABLE_TARGET_APPLIES_TO_HOST": "true",
            "__CARGO_TEST_CHANNEL_OVERRIDE_DO_NOT_USE_THIS": "nightly",
        },
    ),
}


def build_instrumented(work: Path, raw: Path, build: str) -> Path:
    """``build`` (a key of ``BUILDS``) made with ``-Cprofile-generate`` and unpacked into
    ``work/<build>/pkg`` (a directory to put first on ``PYTHONPATH``)."""
    env = dict(os.environ)
    # The caller's own flags stay; a kept profile in use does not (this build makes the next).
    kept = [
        f
        for f in env.get("RUSTFLAGS", "").split()
        if not f.startswith("-Cprofile-use") and f != QUIET
    ]
    env["RUSTFLAGS"] = " ".join([*kept, f"-Cprofile-generate={raw}"])
    env["CARGO_TARGET_DIR"] = str(ROOT / "target" / f"pgo-generate-{build}")
    args, settings = BUILDS[build]
    env.update(settings)
    wheels = work / build / "wheel"
    maturin = Path(sys.executable).parent / "maturin"
    args = [host_target() if a == "HOST" else a for a in args]
    command = [str(maturin), *args, "--out", str(wheels)]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    (wheel,) = wheels.glob("llmsched-*.whl")
    pkg = work / build / "pkg"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(pkg)
    # The build ran instrumented build scripts; their records are not the library's.
    for stray in raw.glob("*.profraw"):
        stray.unlink()
    return pkg


def training_loads(work: Path) -> list[tuple[str, list[str]]]:
    """The training loads: (name, command), each run with the instrumented package first on
    the path."""
    py = sys.executable
    tokenizer = work / "tokenizer"
    gateway = [
        py,
        "tools/bench_gateway_peers.py",
        "--python",
        py,
        "--gateways",
        "llmsched-serve-native-llm-d,llmsched-serve-native-round-robin",
        "--rates",
        "1000",
        "--repeats",
        "1",
        "--seconds",
        "3",
        "--idle-seconds",
        "0",
    ]
    return [
        ("simulator, default scenario", [py, "-m", "llmsched", "demo"]),
        (
            "benches/, short pass without the twins",
            [
                py,
                "-m",
                "pytest",
                "benches",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                "not twin",
                "--benchmark-enable",
                "--benchmark-min-rounds=3",
                "--benchmark-max-time=0.05",
            ],
        ),
        (
            "prefix index, small size",
            [py, "benches/bench_peers_index.py", "--size", "small", "--no-install"],
        ),
        (
            "llmsched serve, chat",
            [*gateway, "--chat", "--prompt-words", "122", "--tokenizer", str(tokenizer)],
        ),
        ("llmsched serve, completions", gateway),
    ]


def train(work: Path, build: str, raw: Path) -> dict[str, float]:
    """Builds ``build`` instrumented and runs every training load on it, recording into
    ``raw/<build>``; seconds per load."""
    raw = raw / build
    raw.mkdir()
    pkg = build_instrumented(work, raw, build)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pkg), env.get("PYTHONPATH")]))
    # One file per process: the loads start many (gateways, pytest's subprocesses).
    env["LLVM_PROFILE_FILE"] = str(raw / "llmsched-%p.profraw")
    took: dict[str, float] = {}
    for name, command in training_loads(work):
        start = time.monotonic()
        print(f"pgo: {build} build, training load: {name}", flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        took[name] = round(time.monotonic() - start, 1)
    return took


def make_profile(work: Path) -> dict[str, object]:
    """Builds instrumented, trains, merges; writes the kept profile and its record."""
    profdata = llvm_profdata()
    raw = work / "raw"
    raw.mkdir()
    # Here, not at the top: `rustflags` runs (at every make) where llmsched is not installed.
    from llmsched.testing.openai_engine import write_tokenizer

    write_tokenizer(work / "tokenizer")
    took = {build: train(work, build, raw) for build in BUILDS}
    records = sorted(raw.glob("*/*.profraw"))
    if not records:
        raise PgoError(f"the training loads recorded nothing in {raw}")
    merged = work / "llmsched.profdata"
    subprocess.run([str(profdata), "merge", "-o", str(merged), *map(str, records)], check=True)
    PROFILE.parent.mkdir(exist_ok=True)
    with merged.open("rb") as src, lzma.open(PROFILE, "wb", preset=9) as dst:
        shutil.copyfileobj(src, dst)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    info: dict[str, object] = {
        "llvm_major": rustc_llvm_major(),
        "rustc": rustc_field(r"^(rustc \S+.*)$"),
        "commit": commit,
        "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "processes": len(records),
        "loads_seconds": took,
    }
    PROFILE_INFO.write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rustflags", help="print the RUSTFLAGS a release build adds")
    make = sub.add_parser("make", help="build instrumented, train and keep the profile")
    make.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    try:
        if args.command == "rustflags":
            print(rustflags())
            return 0
        work = Path(tempfile.mkdtemp(prefix="llmsched-pgo-"))
        try:
            info = make_profile(work)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        size = PROFILE.stat().st_size
        print(f"pgo: wrote {PROFILE.relative_to(ROOT)} ({size:,} bytes): {json.dumps(info)}")
        return 0
    except (PgoError, subprocess.CalledProcessError) as exc:
        print(f"pgo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
