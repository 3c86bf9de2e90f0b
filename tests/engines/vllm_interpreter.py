"""One Python process of the vLLM environment that runs the reference checks sent to it.

The tests that hold the gateway against vLLM's own code without an engine (its chat template
content-format detection, its Responses API conversion) each needed vLLM imported, about 12
CPU-s apiece on two cores, and making the tiny model and its LoRA adapter imported torch and
transformers (about 8 CPU-s each): they now share one interpreter (the session fixture
``vllm_interpreter``), which imports what each job needs on top of what is already loaded.

A check is Python source defining ``main(payload)``, which returns what is sent back as JSON.
The process reads one JSON job a line from its stdin and answers on one line of stdout that
starts with :data:`ANSWER` (vLLM and its dependencies may print on stdout while importing).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

from .vllm_engine import vllm_python

ANSWER = "@@llmsched-answer "

# The loop the process runs: each job's source is executed in a namespace of its own; an error
# comes back as its traceback rather than ending the process.
_LOOP = f"""
import json, sys, traceback, warnings
warnings.filterwarnings("ignore")
for line in sys.stdin:
    job = json.loads(line)
    try:
        namespace = {{}}
        exec(compile(job["source"], job["name"], "exec"), namespace)
        answer = {{"result": namespace["main"](job["payload"])}}
    except BaseException:
        answer = {{"error": traceback.format_exc()}}
    sys.stdout.write({ANSWER!r} + json.dumps(answer) + "\\n")
    sys.stdout.flush()
"""


# A script run as `python script args...` would run it (its own module globals, `__main__`).
_RUN_SCRIPT = """
import runpy, sys

def main(argv):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise RuntimeError(f"{argv[0]} exited with {done.code}") from done
"""


class VllmCheckError(RuntimeError):
    """A check failed inside the vLLM process (the message holds its traceback), or the
    process ended or fell silent."""


class VllmInterpreter:
    """The vLLM environment's interpreter, started at its first job (so that a missing
    environment fails that job, as a check of its own would), running jobs one at a time."""

    def __init__(self, log: Path) -> None:
        self._log = log
        self._stderr = log.open("wb")
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None:
            self._process = subprocess.Popen(
                [str(vllm_python()), "-c", _LOOP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
            )
        return self._process

    def run(self, name: str, source: str, payload: Any, timeout_s: float = 300.0) -> Any:
        """``main(payload)`` of ``source`` run in the vLLM process; its JSON result."""
        job = json.dumps({"name": name, "source": source, "payload": payload})
        with self._lock:
            process = self._started()
            stdin, stdout = process.stdin, process.stdout
            assert stdin is not None and stdout is not None
            try:
                stdin.write(job + "\n")
                stdin.flush()
            except BrokenPipeError:
                raise VllmCheckError(f"{name}: the vLLM process has ended{self._tail()}") from None
            answer = self._read_answer(name, process, timeout_s)
        if "error" in answer:
            raise VllmCheckError(f"{name} failed in the vLLM process:\n{answer['error']}")
        return answer["result"]

    def run_script(self, script: Path, args: list[str], timeout_s: float = 600.0) -> None:
        """Run ``script`` as ``__main__`` with ``args`` as its command line, as
        ``python script args...`` would; its ``SystemExit`` with a non-zero code is an error."""
        argv = [str(script), *args]
        self.run(script.name, _RUN_SCRIPT, argv, timeout_s)

    def _read_answer(
        self, name: str, process: subprocess.Popen[str], timeout_s: float
    ) -> dict[str, Any]:
        found: list[str] = []

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith(ANSWER):
                    found.append(line[len(ANSWER) :])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            state = "is silent" if reader.is_alive() else "has ended"
            process.kill()  # a later check must not read this one's answer
            raise VllmCheckError(f"{name}: the vLLM process {state}{self._tail()}")
        answer: dict[str, Any] = json.loads(found[0])
        return answer

    def _tail(self) -> str:
        self._stderr.flush()
        lines = self._log.read_text(errors="replace").splitlines()[-20:]
        return ("; its stderr ends:\n" + "\n".join(lines)) if lines else ""

    def close(self) -> None:
        """End the process, if started (its stdin closed, then killed if it lingers)."""
        process = self._process
        if process is not None:
            if process.stdin is not None:
                # A process that has ended leaves the pipe broken: what was left in it is moot.
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._stderr.close()
