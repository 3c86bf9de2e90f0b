"""The real-engine tests' startup logic (``tests/engines/vllm_engine.py``), against fake engine
interpreters: readiness follows progress, a failure is one clear error with the log tail."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from engines import vllm_engine
from engines.vllm_engine import EngineStartupError, VllmEngine, start_engines
from engines.vllm_interpreter import ANSWER

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for the vLLM environment's interpreter: it answers every job sent to the shared
# interpreter (tests/engines/vllm_interpreter.py) as done, the "tiny model" among them, and
# serves the engine per SCRIPT below (any of: lines with pauses, exit, /health).
FAKE = """#!{python}
import http.server, sys, time
args = sys.argv[1:]
if args[:1] == ["-c"]:
    for line in sys.stdin:
        print({answer!r} + '{{"result": null}}', flush=True)
    sys.exit(0)
port = int(args[args.index("--port") + 1])
{body}
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def fake_interpreter(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE.format(python=sys.executable, answer=ANSWER, body=body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def engine(tmp_path: Path) -> VllmEngine:
    return VllmEngine(tmp_path, "fake", tmp_path / "fake.log")


def test_engine_that_exits_is_one_error_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = 'print("loading weights", flush=True)\nprint("ERROR: out of memory", flush=True)\n'
    monkeypatch.setenv(
        "LLMSCHED_VLLM_PYTHON", str(fake_interpreter(tmp_path, body + "sys.exit(3)"))
    )
    e = engine(tmp_path)
    with pytest.raises(EngineStartupError, match=r"(?s)exited with code 3.*out of memory"):
        start_engines([e])
    assert not e.running


def test_engine_without_progress_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = 'print("stuck", flush=True)\ntime.sleep(600)\n'
    monkeypatch.setenv("LLMSCHED_VLLM_PYTHON", str(fake_interpreter(tmp_path, body)))
    monkeypatch.setattr(vllm_engine, "STARTUP_STALL_S", 1.0)
    e = engine(tmp_path)
    with pytest.raises(EngineStartupError, match=r"(?s)no progress.*stuck"):
        start_engines([e])
    assert not e.running  # stopped, its whole process group with it


def test_slow_engine_is_waited_for_while_it_progresses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Startup longer than the stall limit, a log line every 0.1 s: it is waited for."""
    body = 'for i in range(30):\n    print("step", i, flush=True)\n    time.sleep(0.1)\n'
    monkeypatch.setenv("LLMSCHED_VLLM_PYTHON", str(fake_interpreter(tmp_path, body)))
    monkeypatch.setattr(vllm_engine, "STARTUP_STALL_S", 2.0)
    e = engine(tmp_path)
    try:
        took = start_engines([e])
        assert e.healthy() and took > vllm_engine.STARTUP_STALL_S
        assert vllm_engine.machine_factor() >= 1.0
    finally:
        e.stop()
    assert "step 29" in e.log_tail()


def test_startup_failure_is_reported_once_not_per_test(tmp_path: Path) -> None:
    """The real-engine suite with engines that cannot start: one error carrying the engine's
    log, every other test skipped with a pointer to it."""
    for module in ("zmq", "aiohttp", "tokenizers"):  # the engine tests' own imports
        pytest.importorskip(module, reason="the real-engine tests need the gateway extra")
    fake = fake_interpreter(tmp_path, 'print("ERROR: no such device", flush=True)\nsys.exit(3)')
    env = {**os.environ, "LLMSCHED_VLLM_PYTHON": str(fake)}
    command = [sys.executable, "-m", "pytest", "tests/engines", "-m", "engines", "-q"]
    run = subprocess.run(
        [*command, "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    summary = re.search(r"(\d+) skipped, 1 error", out)
    assert summary is not None and int(summary.group(1)) >= 1, out
    assert out.count("no such device") >= 1 and "exited with code 3" in out, out
    assert out.count("ERROR at setup") == 1, out
