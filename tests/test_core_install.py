"""The wheel installed alone, without extras, into a fresh virtual environment.

Checks what ``pip install llmsched`` gives: only numpy and PyYAML besides llmsched, a working
core API, ``import llmsched`` without asyncio or any optional package, and an ``ImportError``
naming the extra for every optional module. The import time and installed size are measured
and reported (``-s`` prints them), not asserted.

The wheel comes from ``$LLMSCHED_WHEEL`` when set (``make test`` sets it to the wheel in
``dist/`` while ``make wheel`` left a current one there), else ``maturin build --release`` into a
temporary folder (the Rust build is incremental in ``target/``); the venv is made with ``uv``
from its local cache (``--offline``). The test skips, saying why, when either step cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

OPTIONAL = {
    "llmsched.integrations": "integrations",
    "llmsched.gateway": "gateway",
    "llmsched.cluster": "cluster",
    "llmsched.tokenize": "tokenize",
    "llmsched.testing": "test",
    "llmsched.reference.hashing": "test",
    "llmsched.reference.vllm_events": "test",
    "llmsched.executor.engine": "executor",
    "llmsched.executor.model": "executor",
}
"""Modules that need an extra, and the extra their ImportError must name."""

CORE_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, time
    start = time.perf_counter()
    import llmsched
    import_s = time.perf_counter() - start
    loaded = set(sys.modules)
    import numpy as np
    from llmsched import (EndpointPool, FlowController, FlowRequest, PrefixIndex, Router,
                          SliceTracker, block_hashes, text_block_hashes)

    index = PrefixIndex(block_size=4)
    index.store("a", index.hash_text("0123456789abcdef" * 4))
    router = Router(EndpointPool(["a", "b"], stale_policy="ignore"), index, config="prefix-only")
    decision = router.pick(text="0123456789abcdef" * 4, now=0.0)
    assert (decision.endpoint, decision.cached) == ("a", 16), decision
    assert len(block_hashes(np.arange(64), 16)) == 4 and len(text_block_hashes("x" * 64)) == 1
    flow = FlowController({"saturation": {"type": "concurrency", "max_requests": 2}})
    assert flow.enqueue(FlowRequest(1, tenant="t")) is None and flow.dispatch().id == 1
    tracker = SliceTracker("fixed")
    tracker.set_endpoint("a", kv_cache_usage=0.5)
    from llmsched import Endpoint, Scheduler, ScheduleRequest  # over ids and Endpoints: core
    scheduler = Scheduler(["a", Endpoint("b", address="10.0.0.7:8000")], router="round-robin")
    with scheduler.schedule_sync(ScheduleRequest(tokens=[1, 2])) as placement:
        assert placement.endpoint == "a", placement
    import llmsched.sim, llmsched.executor  # the torch-free parts import without extras

    errors = {}
    for module in sys.argv[1].split(","):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            errors[module] = str(exc)
        else:
            errors[module] = None
    try:
        from llmsched.sim.runner import write_plot
        write_plot("unused.png", [])
    except ImportError as exc:
        errors["write_plot"] = str(exc)
    print(json.dumps({
        "import_s": import_s,
        "asyncio": "asyncio" in loaded,
        "optional_loaded": sorted(m for m in ("zmq", "aiohttp", "yaml", "tokenizers", "jinja2",
            "matplotlib", "tqdm", "torch", "xxhash", "cbor2", "msgpack") if m in loaded),
        "errors": errors,
    }))
    """
)


def _run(*argv: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    # Without the caller's PYTHONPATH: run from a checkout with PYTHONPATH=python (as the
    # contributor docs say), the venv imported that checkout, not the wheel under test.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    kw.setdefault("env", env)
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload, no-any-return]


def _tool(name: str) -> str | None:
    found = BIN / name
    return str(found) if found.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv holding the wheel and its required dependencies only."""
    uv = _tool("uv")
    if uv is None:
        pytest.skip("uv is not installed: cannot make a fresh venv from the local cache")
    tmp = tmp_path_factory.mktemp("core")
    wheel_env = os.environ.get("LLMSCHED_WHEEL")
    if wheel_env:
        wheel = Path(wheel_env)
    else:
        maturin = _tool("maturin")
        if maturin is None:
            pytest.skip("maturin is not installed and $LLMSCHED_WHEEL is unset: no wheel")
        built = _run(maturin, "build", "--release", "-q", "--out", tmp / "dist", cwd=ROOT)
        wheels = sorted((tmp / "dist").glob("llmsched-*.whl"))
        if built.returncode != 0 or not wheels:
            pytest.skip(f"maturin build failed: {built.stderr.strip()[-500:]}")
        wheel = wheels[0]
    venv = tmp / "venv"
    made = _run(uv, "venv", "-q", "-p", sys.executable, venv)
    if made.returncode != 0:
        pytest.skip(f"uv venv failed: {made.stderr.strip()[-500:]}")
    python = venv / "bin" / "python"
    installed = _run(uv, "pip", "install", "-q", "--offline", "-p", python, wheel)
    if installed.returncode != 0:
        pytest.skip(
            "numpy/PyYAML not in the local uv cache (offline install failed): "
            + installed.stderr.strip()[-300:]
        )
    yield python


def test_core_install_has_only_the_core_dependencies(core_env: Path) -> None:
    uv = _tool("uv")
    assert uv is not None
    listed = _run(uv, "pip", "list", "--format", "json", "-p", core_env)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert names == {"llmsched", "numpy", "pyyaml"}, names
    site = next(core_env.parent.parent.glob("lib/python*/site-packages"))
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    print(f"\ncore install: {len(names)} packages, {size / 1e6:.1f} MB in site-packages")


def test_core_api_works_and_optional_modules_name_their_extra(core_env: Path) -> None:
    done = _run(core_env, "-c", CORE_SCRIPT, ",".join(OPTIONAL), cwd=core_env.parent.parent)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["asyncio"] is False
    assert report["optional_loaded"] == []  # not even PyYAML (core, loaded for config files)
    for module, extra in OPTIONAL.items():
        message = report["errors"][module]
        assert message is not None, f"{module} imported without its extra"
        assert f"pip install 'llmsched[{extra}]'" in message, message
    assert "llmsched[sim]" in report["errors"]["write_plot"]
    print(f"\nimport llmsched (cold process): {report['import_s'] * 1e3:.0f} ms")


def test_core_import_time_is_reported(core_env: Path) -> None:
    """``python -X importtime``: llmsched's own share, numpy's and the total (reported)."""
    _run(core_env, "-c", "import llmsched")  # warm the bytecode caches
    done = _run(core_env, "-X", "importtime", "-c", "import llmsched")
    assert done.returncode == 0, done.stderr
    cumulative: dict[str, int] = {}
    for line in done.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[1].isdigit():
            name = parts[2]
            cumulative[name.strip()] = int(parts[1])
            if not name.startswith(" ") and name.strip() == "asyncio":
                pytest.fail("import llmsched imported asyncio")
    assert "asyncio" not in cumulative
    total, numpy = cumulative["llmsched"], cumulative.get("numpy", 0)
    print(f"\nimport llmsched warm: {total / 1e3:.0f} ms, of which numpy {numpy / 1e3:.0f} ms")


def test_cli_names_the_missing_extra(core_env: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "replicas: 2\npolicies: [random]\n"
        "workload: {kind: long_short, num_requests: 20, arrival: {rate: 20.0}}\n"
    )
    llmsched = core_env.parent / "llmsched"
    plot = _run(llmsched, "sim", "--config", scenario, "--plot", tmp_path / "p.png")
    assert plot.returncode == 2 and plot.stdout == ""
    assert plot.stderr.strip() == (
        "llmsched sim: llmsched sim --plot needs the optional package matplotlib: "
        "pip install 'llmsched[sim]'"
    )
    serve = _run(llmsched, "serve", "--config", scenario)
    assert serve.returncode == 2 and "pip install 'llmsched[gateway]'" in serve.stderr
    # The simulator itself is core: it runs without a progress bar.
    sim = _run(llmsched, "sim", "--config", scenario, "--jobs", "1")
    assert sim.returncode == 0, sim.stderr
    assert "no progress bar without tqdm" in sim.stdout and "random" in sim.stdout


def test_import_llmsched_loads_no_optional_or_heavy_module() -> None:
    """In this (fully equipped) environment too: the extras' packages, asyncio, PyYAML and
    logging load only when a feature that needs them is used."""
    script = (
        "import sys, llmsched; print(sorted(m for m in ('asyncio', 'yaml', 'logging', 'zmq', "
        "'aiohttp', 'tokenizers', 'jinja2', 'matplotlib', 'tqdm', 'torch', 'xxhash', 'cbor2', "
        "'msgpack') if m in sys.modules))"
    )
    done = _run(sys.executable, "-c", script, env=dict(os.environ))  # this checkout's llmsched
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
