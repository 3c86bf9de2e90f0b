"""``llmsched serve`` beside the Rust routers it is compared with, in front of the same engines.

Four native fake engines (``llmsched-fake-engine``) serve; each gateway in turn is started in
front of them pinned to one core (``taskset``), and the native open-loop generator
(``llmsched-loadgen``, on another core with the engines) sends JSON and streamed completions at
each rate, straight to the engines (``direct``) and through the gateway, a freshly started
gateway for each load. The gateways are interleaved (their order rotates each repeat) and every
figure is the median over the repeats:

* CPU per request: the gateway process's (and its children's) user + system CPU time over the
  measured window, per request sent; its kernel share, the system part of the gateway's CPU
  over the whole load (warm-up included, from ``/proc/PID/stat``'s clock ticks): the sockets'
  reads and writes, the loopback's TCP work and the thread's sleeps and wake-ups, which every
  proxy pays alike, against the user part, which is the gateway's own;
* added latency p50 / p99: the gateway's latency quantile minus the direct one of the same
  repeat; TTFT overhead p50 the same for the time to first token; ITL p99 of streams;
* streamed, net of the engine (``stream net added p50 / p99``): a stream's latency is mostly
  the fake engine's schedule (its tokens a timer's sleep apart, and tokio's timer wakes with
  about a millisecond of jitter, more than a gateway adds), so the raw difference above reads
  the engine's jitter, not the gateway. The engines therefore stamp every streamed event with
  their clock (``llmsched-fake-engine --stamp``: ``CLOCK_MONOTONIC`` nanoseconds when the
  request was read and when the event was handed to the connection; about 60 bytes more per
  event, the same for every row) and the generator, on the same machine and clock, takes the
  engine's time (its reading of the request to its last token event) out of each stream's
  latency. What is left is the client's start to the engine's reading of the request (the
  forward path: through a gateway its reading, parsing, routing and second connection) plus
  the last token event's way from the engine to the client and the ``[DONE]`` after it; its
  quantile through the gateway minus the direct one is the streamed added latency judged
  against the same targets as JSON. ``relay added p50 / p99`` is the same for every token
  event's way from the engine to the client (what a gateway adds to each chunk);
* ``--paired``: each gateway's load runs at the same time as a direct load of the same rate
  (a second generator, its own Poisson seed, on the same core), and the gateway's added
  figures are taken against that direct load rather than against the direct row's own turn.
  Whatever else runs on the machine then (another process on either core, the engines'
  bursts) falls on both paths at once, so the difference no longer carries it; both paths'
  requests share the engines and the client core, so neither is measured on an idle machine.
  The direct loads of a pair are kept apart (``direct@<gateway>``) from the direct row;
* ``--sched fifo``: every process of the benchmark (the engines, the generators, each gateway
  with all its threads) runs under ``SCHED_FIFO`` priority 1 (``chrt -f 1``), so that once
  woken it takes its core from whatever else runs on the machine (other builds, tests); among
  themselves they stay equals (a thread runs until it blocks). The default ``normal`` leaves
  them to the fair scheduler, which lets another process hold the gateway's core for a slice
  of several milliseconds while the gateway waits: on a shared machine that, and not the
  gateways, is the streamed p99 (``tools/stream_tail.py`` traces it per slow stream);
* a name ending in ``@base`` (``llmsched-serve-native-llm-d@base``) runs that gateway with
  ``--base-python`` instead of ``--python``: another build (e.g. main's) interleaved with this
  one in the same run; ``llmsched-native-round-robin@base`` runs the standalone binary of
  ``--base-bin`` (another build's ``target/release``) the same way;
* errors: requests without a 200 and a complete answer (summed over the repeats, by kind);
  a peer with errors is not taken as the best peer;
* idle CPU: percent of a core the gateway used over ``--idle-seconds`` before its first load;
* the ratio of each llmsched figure to the best peer's in the same mode (round-robin beside the
  peers' round-robin; the llm-d preset beside their cache-aware modes).

``bare-proxy`` (``llmsched-bare-proxy``, in the default list) is the least a proxy on tokio and
hyper does: requests to each engine in turn, bodies unchanged, nothing read or counted. It is
never taken as the best peer; its row (beside the round-robin peers) is the floor of any
gateway on that stack on this machine, and so tells how low a ratio can go here.

``--ladder 1000,2000,...`` climbs instead: each gateway and answer kind is loaded at each rate in
turn (a fresh gateway for each), stopping at the first rate whose p99 latency reaches
``--ladder-p99-ms`` (50) or that has errors; per rate it reports the rate achieved, answers per
second, errors, p50 / p99 latency, CPU per request and the share of the gateway's core, and per
gateway the highest rate held (p99 under the bound, no errors, in every repeat). The ``direct``
row is the same ladder straight to the engines: the engines and the generator (one core
between them) hold at least that rate, so a gateway's ceiling below it is the gateway's.

``--responses`` loads conversations on OpenAI's Responses API instead (``POST /v1/responses``,
``llmsched-loadgen --responses``): each start continues an idle conversation (its last turn
answered, ``--turns`` not spent) with ``previous_response_id`` and a short new input, or opens a
new one (shared ``instructions``, an input of ``--prompt-words`` words). The fake engines keep
each response they make, as vLLM does, and answer a continuation whose previous response they
do not hold with vLLM's 404: a gateway that sends a continuation to another engine than the one
holding the conversation loses it. Beside the usual table a second one gives, per gateway, the
CPU per request (median and range over the repeats), the continuations sent and the share lost
(404); lost continuations count as errors in the first table but not when the best peer is
chosen (a peer's CPU ratio is still taken against the cheapest peer that answered everything
else). The last column is the busiest engine's share of the requests of each repeat (from the
engines' ``/stats``; 25% is an even spread over the four): a gateway that sends everything to
one engine loses no continuation. A lost continuation ends its conversation, so a gateway
that loses them sends more first turns (longer inputs) than one that does not.

Usage: python tools/bench_gateway_peers.py [--short] [--rates 300,1000] [--repeats 3] ...
(``--chat --tokenizer DIR``: chat requests, ``llmsched serve`` routing on DIR's token ids, the
same for ``--responses``;
``llmsched-serve-native-llm-d-nocache`` in ``--gateways`` adds the native plane without its
tokenizer cache.)
(``make bench-gateway-peers`` runs it with the peers installed in their own environment.)
Exit status 0 unless a gateway could not be started; timing never fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
# A generous flow-control bound: the gateways are compared on relaying, not on queueing.
FLOW = {"saturation": {"type": "concurrency", "max_requests": 4096}}


class Figures(TypedDict, total=False):
    """One load's figures as the generator reports them (milliseconds)."""

    ok: int
    errors: int
    error_kinds: dict[str, int]
    cpu_ms: float | None
    latency_p50: float
    latency_p99: float
    ttft_p50: float
    itl_p99: float
    achieved_rate: float
    lag_p99: float
    net_p50: float | None
    net_p99: float | None
    relay_p50: float | None
    relay_p99: float | None
    kernel_share: float | None
    continuations: int
    continuations_lost: int
    busiest_engine_share: float | None


StampedKey = Literal["net_p50", "net_p99", "relay_p50", "relay_p99"]
"""The figures of stamped streams (see the module docs)."""


@dataclass(frozen=True)
class Gateway:
    """A gateway to start in front of the engines (``direct``: none)."""

    name: str
    # "direct", "llmsched" (llmsched serve: llmsched-* on the python data plane,
    # llmsched-serve-native-* on the native one), "native" (the llmsched-gateway binary), "peer"
    kind: str
    mode: str  # "round-robin" or "cache-aware" (llmsched's llm-d preset counts as cache-aware)
    command: tuple[str, ...] = ()


@dataclass
class Results:
    """Figures by (gateway, answer, rate), one entry per repeat."""

    runs: dict[tuple[str, str, float], list[Figures]] = field(default_factory=dict)
    idle: dict[str, list[float]] = field(default_factory=dict)
    """Percent of a core each gateway used while idle, one entry per repeat."""

    def add(self, key: tuple[str, str, float], figures: Figures) -> None:
        """Records one repeat's figures."""
        self.runs.setdefault(key, []).append(figures)


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(core: int | None, command: Sequence[str]) -> list[str]:
    """``command`` under ``taskset -c core`` (unpinned where taskset or the core is missing)."""
    if core is None or not _has_taskset() or core >= (os.cpu_count() or 1):
        return list(command)
    return ["taskset", "-c", str(core), *command]


def scheduled(policy: str, command: Sequence[str]) -> list[str]:
    """``command`` (the engines, a generator or a gateway) under the scheduling ``policy``:
    ``normal`` as it is, ``fifo`` under ``chrt -f 1`` (real-time: once woken it takes its core
    from any normal process, see the module docs)."""
    if policy == "normal":
        return list(command)
    if policy == "fifo":
        return ["chrt", "-f", "1", *command]
    raise ValueError(f"unknown scheduling policy {policy!r}")


def _has_taskset() -> bool:
    return subprocess.run(["sh", "-c", "command -v taskset"], capture_output=True).returncode == 0


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        stack.extend(children.get(p, []))
    return found


def user_system_ticks(pids: Sequence[int]) -> tuple[int, int]:
    """Clock ticks every thread of ``pids`` spent in user and in kernel mode so far
    (``utime`` and ``stime`` of ``/proc/PID/stat``); processes gone count nothing."""
    user = system = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces) in parentheses; utime and
        # stime are the 14th and 15th of the whole line.
        fields = stat[stat.rfind(")") + 2 :].split()
        user += int(fields[11])
        system += int(fields[12])
    return user, system


def kernel_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The kernel's part of the CPU time between two :func:`user_system_ticks` readings (None
    when too few ticks passed to tell: under 20, a tick being 10 ms)."""
    user, system = after[0] - before[0], after[1] - before[1]
    return system / (user + system) if user + system >= 20 else None


def cpu_ns(pids: Sequence[int]) -> int:
    """Nanoseconds on CPU of every thread of ``pids`` (``/proc/PID/task/*/schedstat``)."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def wait_ready(url: str, seconds: float) -> bool:
    """Polls a small completion through ``url`` until it answers 200 (bounded)."""
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


@contextmanager
def process(command: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Runs ``command`` with its output in ``log``; SIGTERM (then SIGKILL) on exit."""
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield child
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def start_engines(
    binary: Path, core: int | None, tokens: int, token_delay_ms: float, policy: str = "none"
) -> tuple[subprocess.Popen[str], list[int]]:
    """Four fake engines in one process; returns it and their ports."""
    command = scheduled(
        policy,
        pinned(
            core,
            [
                str(binary),
                "--engines",
                "4",
                "--model",
                MODEL,
                "--answer-tokens",
                str(tokens),
                "--token-delay-ms",
                str(token_delay_ms),
                # Streamed events carry the engine's clock (see the module docs).
                "--stamp",
            ],
        ),
    )
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    try:
        ports = [int(p) for p in json.loads(line)["ports"]]
    except (ValueError, KeyError) as exc:
        child.kill()
        raise SystemExit(f"the fake engines did not start: {line!r}") from exc
    return child, ports


def gateways(
    names: Sequence[str],
    python: str,
    peers_python: str | None,
    native_bin: str,
    base_python: str | None = None,
    base_bin: str | None = None,
) -> list[Gateway]:
    """The gateways asked for; a peer is skipped (with a message) when it is not installed.
    ``llmsched-*@base`` runs ``llmsched serve`` with ``base_python`` (another build), and
    ``llmsched-native-*@base`` the standalone binary ``base_bin`` (another build's
    ``llmsched-gateway``)."""
    found: list[Gateway] = []
    for name in names:
        if name.endswith("@base") and name.startswith("llmsched-native-"):
            if base_bin is None:
                raise SystemExit(f"{name!r} needs --base-bin")
            if not Path(base_bin).exists():
                raise SystemExit(f"{name!r}: {base_bin} is not built")
            (row,) = gateways([name.removesuffix("@base")], python, None, base_bin)
            found.append(Gateway(name, row.kind, row.mode, row.command))
        elif name.endswith("@base"):
            plain = name.removesuffix("@base")
            if not plain.startswith("llmsched-"):
                raise SystemExit(f"{name!r}: only llmsched rows take @base")
            if base_python is None:
                raise SystemExit(f"{name!r} needs --base-python")
            (row,) = gateways([plain], base_python, None, native_bin)
            found.append(Gateway(name, row.kind, row.mode, row.command))
        elif name == "direct":
            found.append(Gateway(name, "direct", "none"))
        elif name in (
            "llmsched-llm-d",
            "llmsched-round-robin",
            "llmsched-serve-native-llm-d",
            "llmsched-serve-native-round-robin",
            "llmsched-serve-native-llm-d-nocache",
        ):
            plane = "native" if name.startswith("llmsched-serve-native-") else "python"
            router = _router_of(name)
            found.append(
                Gateway(
                    name,
                    "llmsched",
                    "round-robin" if router == "round-robin" else "cache-aware",
                    (
                        python,
                        "-m",
                        "llmsched",
                        "serve",
                        "--log-level",
                        "ERROR",
                        "--data-plane",
                        plane,
                        "--config",
                    ),
                )
            )
        elif name == "bare-proxy":
            binary = Path(native_bin).with_name("llmsched-bare-proxy")
            if not binary.exists():
                print(f"skipping {name}: {binary} is not built (cargo build --release)")
                continue
            found.append(Gateway(name, "native", "round-robin", (str(binary),)))
        elif name in ("llmsched-native-llm-d", "llmsched-native-round-robin"):
            binary = Path(native_bin)
            if not binary.exists():
                print(f"skipping {name}: {binary} is not built (cargo build --release)")
                continue
            router = name.removeprefix("llmsched-native-")
            found.append(
                Gateway(
                    name,
                    "native",
                    "round-robin" if router == "round-robin" else "cache-aware",
                    (str(binary), "--router", router),
                )
            )
        elif name.startswith(("sglang-", "vllm-")):
            peer, policy = name.split("-", 1)
            if peers_python is None:
                print(f"skipping {name}: no peers environment (make bench-gateway-peers makes one)")
                continue
            module = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}
            check = subprocess.run(
                [peers_python, "-c", f"import {module[peer].split('.')[0]}"], capture_output=True
            )
            if check.returncode != 0:
                print(f"skipping {name}: {peer}-router is not installed in {peers_python}")
                continue
            found.append(
                Gateway(
                    name,
                    "peer",
                    policy.replace("_", "-"),
                    (peers_python, "-m", module[peer], "--policy", policy),
                )
            )
        else:
            raise SystemExit(f"unknown gateway {name!r}")
    return found


def _router_of(name: str) -> str:
    """The router preset of an ``llmsched-*`` gateway name (``-nocache``: the native plane
    with ``tokenizer_cache_bytes: 0``)."""
    return (
        name.removesuffix("@base")
        .removeprefix("llmsched-serve-native-")
        .removeprefix("llmsched-")
        .removesuffix("-nocache")
    )


def gateway_command(
    gateway: Gateway, port: int, engines: list[str], work: Path, tokenizer: str | None = None
) -> list[str]:
    """The command line starting ``gateway`` on ``port`` in front of ``engines``
    (``tokenizer``: the tokenizer directory of ``llmsched serve``'s config)."""
    if gateway.kind == "llmsched":
        import yaml

        router = _router_of(gateway.name)
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "engines": [
                {"host": u.split(":")[1].strip("/"), "port": int(u.rsplit(":", 1)[1])}
                for u in engines
            ],
            "models": [MODEL],
            "block_size": 16,
            "router": router,
            "flow": FLOW,
            "scrape": {"enabled": True, "interval_s": 0.2},
        }
        if tokenizer is not None:
            config["tokenizer"] = tokenizer
        if gateway.name.removesuffix("@base").endswith("-nocache"):
            config["tokenizer_cache_bytes"] = 0
        path = work / f"{gateway.name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return [*gateway.command, str(path)]
    if gateway.kind == "native":
        flags = [a for u in engines for a in ("--engine", u)]
        return [*gateway.command, "--listen", f"127.0.0.1:{port}", *flags]
    return [
        *gateway.command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "error",
        "--worker-urls",
        *engines,
    ]


def load(
    binary: Path,
    core: int | None,
    urls: Sequence[str],
    rate: float,
    args: argparse.Namespace,
    stream: bool,
    pids: Sequence[int],
    seed: int = 1,
) -> Figures:
    """One open-loop load through ``urls``; the generator's figures."""
    command = load_command(binary, core, urls, rate, args, stream, pids, seed)
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return figures_of(json.loads(out.stdout))


def load_command(
    binary: Path,
    core: int | None,
    urls: Sequence[str],
    rate: float,
    args: argparse.Namespace,
    stream: bool,
    pids: Sequence[int],
    seed: int = 1,
) -> list[str]:
    """The generator's command line for :func:`load` (pinned to ``core``)."""
    command = [
        str(binary),
        "--json",
        "--rate",
        str(rate),
        "--duration",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
        "--model",
        MODEL,
        "--max-tokens",
        str(args.tokens),
        "--prompt-words",
        str(args.prompt_words),
        "--timeout-s",
        "20",
        "--seed",
        str(seed),
        *(a for u in urls for a in ("--url", u)),
        *(a for p in pids for a in ("--cpu", f"gateway={p}")),
    ]
    if stream:
        command.append("--stream")
    if args.responses:
        command += ["--responses", "--turns", str(args.turns)]
    elif args.chat:
        command.append("--chat")
    return scheduled(args.sched, pinned(core, command))


def figures_of(report: dict[str, Any]) -> Figures:
    """A generator report's figures (the stamped-stream ones None where it has none)."""

    def stamped(summary: str, quantile: str) -> float | None:
        found = report.get(summary) or {}
        return float(found[quantile]) if found.get("n") else None

    conversations = report.get("conversations") or {}
    return Figures(
        continuations=int(conversations.get("continuations", 0)),
        continuations_lost=int(conversations.get("continuations_lost", 0)),
        ok=report["ok"],
        errors=sum(report["errors"].values()),
        error_kinds=dict(report["errors"]),
        cpu_ms=report["cpu_ms_per_request"].get("gateway"),
        latency_p50=report["latency_ms"]["p50"],
        latency_p99=report["latency_ms"]["p99"],
        ttft_p50=report["ttft_ms"]["p50"],
        itl_p99=report["itl_ms"]["p99"],
        achieved_rate=report["achieved_rate"],
        lag_p99=report["lag_ms"]["p99"],
        net_p50=stamped("net_latency_ms", "p50"),
        net_p99=stamped("net_latency_ms", "p99"),
        relay_p50=stamped("relay_ms", "p50"),
        relay_p99=stamped("relay_ms", "p99"),
    )


def run(args: argparse.Namespace) -> Results:
    """Every gateway, answer kind and rate, ``args.repeats`` times, interleaved."""
    bin_dir = Path(args.bin)
    engine_bin, load_bin = bin_dir / "llmsched-fake-engine", bin_dir / "llmsched-loadgen"
    for binary in (engine_bin, load_bin):
        if not binary.exists():
            raise SystemExit(f"{binary} is missing: cargo build --release -p llmsched-bench")
    results = Results()
    engines_process, ports = start_engines(
        engine_bin, args.client_core, args.tokens, args.token_delay_ms, args.sched
    )
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    answers = [a for a in args.answers.split(",") if a]
    rates = [float(r) for r in args.rates.split(",") if r]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            native = str(bin_dir / "llmsched-gateway")
            base_bin = str(Path(args.base_bin) / "llmsched-gateway") if args.base_bin else None
            chosen = gateways(
                args.gateways.split(","),
                args.python,
                args.peers_python,
                native,
                args.base_python,
                base_bin,
            )
            for repeat in range(args.repeats):
                order = chosen[repeat % len(chosen) :] + chosen[: repeat % len(chosen)]
                for gateway in order:
                    run_gateway(gateway, engines, work, rates, answers, args, results, load_bin)
    finally:
        engines_process.terminate()
        engines_process.wait(timeout=10)
    return results


def run_gateway(
    gateway: Gateway,
    engines: list[str],
    work: Path,
    rates: list[float],
    answers: list[str],
    args: argparse.Namespace,
    results: Results,
    load_bin: Path,
) -> None:
    """Starts ``gateway`` (unless direct), loads it at every rate and answer kind, stops it.
    On a ladder (``args.ladder``) the rates of an answer kind stop at the first one not held."""
    given_up: set[str] = set()

    def held(answer: str, figures: Figures) -> None:
        if args.ladder and not holds(figures, args.ladder_p99_ms):
            given_up.add(answer)

    if gateway.kind == "direct":
        for answer in answers:
            for rate in rates:
                if answer in given_up:
                    continue
                figures = load(
                    load_bin, args.client_core, engines, rate, args, answer == "stream", []
                )
                results.add((gateway.name, answer, rate), figures)
                report_line(gateway.name, answer, rate, figures)
                held(answer, figures)
        return
    # A fresh gateway for every load: one that a load overran does not carry its backlog
    # into the next.
    for i, (answer, rate) in enumerate((a, r) for a in answers for r in rates):
        if answer in given_up:
            continue
        port = free_port()
        command = scheduled(
            args.sched,
            pinned(
                args.gateway_core, gateway_command(gateway, port, engines, work, args.tokenizer)
            ),
        )
        with process(command, work / f"{gateway.name}.log") as child:
            url = f"http://127.0.0.1:{port}"
            if not wait_ready(url, 60):
                log = (work / f"{gateway.name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{gateway.name} did not start:\n{log}")
            time.sleep(0.5)  # health checks and the first scrape settle
            if i == 0 and args.idle_seconds > 0:
                pids = descendants(child.pid)
                before = cpu_ns(pids)
                time.sleep(args.idle_seconds)
                idle = (cpu_ns(pids) - before) / (args.idle_seconds * 1e9) * 100
                results.idle.setdefault(gateway.name, []).append(idle)
            pids = descendants(child.pid)
            stream = answer == "stream"
            ticks = user_system_ticks(pids)
            if args.paired:
                # The direct half of the pair, at once: another seed, so that the two
                # schedules do not send at the same instants.
                with ThreadPoolExecutor(2) as pool:
                    direct = pool.submit(
                        load, load_bin, args.client_core, engines, rate, args, stream, [], 2
                    )
                    figures = load(load_bin, args.client_core, [url], rate, args, stream, pids)
                    paired = direct.result()
                results.add((paired_name(gateway.name), answer, rate), paired)
                report_line(paired_name(gateway.name), answer, rate, paired)
            else:
                before_load = engine_requests(engines) if args.responses else []
                figures = load(load_bin, args.client_core, [url], rate, args, stream, pids)
                if args.responses:
                    figures["busiest_engine_share"] = busiest_share(
                        before_load, engine_requests(engines)
                    )
            figures["kernel_share"] = kernel_share(ticks, user_system_ticks(pids))
            results.add((gateway.name, answer, rate), figures)
            report_line(gateway.name, answer, rate, figures)
            held(answer, figures)


def engine_requests(engines: Sequence[str]) -> list[int]:
    """Requests each fake engine has received so far (its ``/stats``)."""
    counts = []
    for engine in engines:
        with urllib.request.urlopen(engine + "/stats", timeout=5) as answer:
            counts.append(int(json.load(answer)["received"]))
    return counts


def busiest_share(before: Sequence[int], after: Sequence[int]) -> float | None:
    """The busiest engine's share of the requests received between two
    :func:`engine_requests` readings (None when none were)."""
    received = [b - a for a, b in zip(before, after, strict=True)]
    return max(received) / sum(received) if sum(received) else None


def paired_name(gateway: str) -> str:
    """The key of the direct loads run beside ``gateway``'s (``--paired``)."""
    return f"direct@{gateway}"


def holds(figures: Figures, p99_ms: float) -> bool:
    """Whether a load was held: every request answered, p99 latency under ``p99_ms``."""
    return figures["errors"] == 0 and figures["latency_p99"] < p99_ms


def report_line(name: str, answer: str, rate: float, figures: Figures) -> None:
    """One load's figures as they come (the table follows at the end)."""
    net = figures.get("net_p50")
    stamped = "" if net is None else f" net p50 {net} p99 {figures.get('net_p99')} ms"
    share = figures.get("kernel_share")
    kernel = "" if share is None else f" (kernel {share:.0%})"
    sent = figures.get("continuations", 0)
    lost = f"  lost {figures.get('continuations_lost', 0)}/{sent} continuations" if sent else ""
    print(
        f"  {name:24} {answer:6} {rate:6g}/s  cpu {figures.get('cpu_ms')} ms/req{kernel}  "
        f"p50 {figures['latency_p50']} p99 {figures['latency_p99']} ttft {figures['ttft_p50']} ms"
        f"{stamped}  errors {figures['errors']} {figures.get('error_kinds') or ''}{lost}",
        flush=True,
    )


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values present (None when none are)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    """One gateway's figures at one answer kind and rate (medians over the repeats)."""

    gateway: str
    answer: str
    rate: float
    cpu_ms: float | None
    added_p50: float | None
    added_p99: float | None
    ttft_overhead_p50: float | None
    itl_p99: float | None
    errors: int
    error_kinds: dict[str, int]
    repeats: int
    net_added_p50: float | None = None
    net_added_p99: float | None = None
    relay_added_p50: float | None = None
    relay_added_p99: float | None = None
    kernel_share: float | None = None
    cpu_range: tuple[float, float] | None = None
    busiest_engine_shares: list[float | None] = field(default_factory=list)
    continuations: int = 0
    continuations_lost: int = 0

    @property
    def lost_share(self) -> float | None:
        """The share of continuations answered 404 (None when none were sent)."""
        return self.continuations_lost / self.continuations if self.continuations else None

    @property
    def mode(self) -> str:
        """round-robin or cache-aware (llmsched's llm-d preset counts as cache-aware)."""
        return (
            "round-robin"
            if self.gateway.removesuffix("@base").endswith(("round_robin", "round-robin"))
            or self.gateway == "bare-proxy"
            else ("cache-aware")
        )


def rows_of(results: Results) -> list[Row]:
    """Each gateway's medians beside the direct path of the same repeats."""
    rows: list[Row] = []
    for (name, answer, rate), runs in results.runs.items():
        if name.startswith("direct"):
            continue
        # Against the direct loads run beside this gateway's where there are (--paired).
        direct = results.runs.get(
            (paired_name(name), answer, rate), results.runs.get(("direct", answer, rate), [])
        )
        added = [
            (
                f["latency_p50"] - d["latency_p50"],
                f["latency_p99"] - d["latency_p99"],
                f["ttft_p50"] - d["ttft_p50"],
            )
            for f, d in zip(runs, direct, strict=False)
        ]

        rows.append(
            Row(
                gateway=name,
                answer=answer,
                rate=rate,
                cpu_ms=median([f.get("cpu_ms") for f in runs]),
                cpu_range=value_range([f.get("cpu_ms") for f in runs]),
                continuations=sum(f.get("continuations", 0) for f in runs),
                busiest_engine_shares=[f.get("busiest_engine_share") for f in runs],
                continuations_lost=sum(f.get("continuations_lost", 0) for f in runs),
                kernel_share=median([f.get("kernel_share") for f in runs]),
                added_p50=median([a[0] for a in added]),
                added_p99=median([a[1] for a in added]),
                ttft_overhead_p50=median([a[2] for a in added]),
                itl_p99=median([f["itl_p99"] for f in runs]) if answer == "stream" else None,
                errors=sum(f["errors"] for f in runs),
                error_kinds={
                    kind: sum(f.get("error_kinds", {}).get(kind, 0) for f in runs)
                    for kind in sorted({k for f in runs for k in f.get("error_kinds", {})})
                },
                repeats=len(runs),
                net_added_p50=stamped_added(runs, direct, "net_p50"),
                net_added_p99=stamped_added(runs, direct, "net_p99"),
                relay_added_p50=stamped_added(runs, direct, "relay_p50"),
                relay_added_p99=stamped_added(runs, direct, "relay_p99"),
            )
        )
    rows.sort(key=lambda r: (r.answer, r.rate))
    return rows


def value_range(values: Sequence[float | None]) -> tuple[float, float] | None:
    """The least and the largest of the values present (None when none are)."""
    present = [v for v in values if v is not None]
    return (min(present), max(present)) if present else None


def stamped_added(
    runs: Sequence[Figures], direct: Sequence[Figures], key: StampedKey
) -> float | None:
    """The median over the repeats of a gateway's stamped-stream figure less the direct one of
    the same repeat (None where either lacks it)."""
    differences: list[float | None] = []
    for mine, theirs in zip(runs, direct, strict=False):
        a, b = mine.get(key), theirs.get(key)
        differences.append(None if a is None or b is None else a - b)
    return median(differences)


def is_peer(name: str) -> bool:
    """Whether a gateway is one of the Rust routers compared with (not llmsched, not the
    reference proxy)."""
    return name.startswith(("sglang-", "vllm-"))


def best_peers(rows: Sequence[Row]) -> dict[tuple[str, float, str], Row]:
    """The peer with the lowest CPU per request at each answer kind, rate and mode, among
    those that answered every request (a lost continuation aside: see ``--responses``)."""
    best: dict[tuple[str, float, str], Row] = {}
    for row in rows:
        if not is_peer(row.gateway) or row.cpu_ms is None:
            continue
        if row.errors - row.continuations_lost:
            continue
        key = (row.answer, row.rate, row.mode)
        held = best.get(key)
        if held is None or (held.cpu_ms is not None and row.cpu_ms < held.cpu_ms):
            best[key] = row
    return best


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(mine: float | None, theirs: float | None) -> str:
    if mine is None or theirs is None or theirs <= 0:
        return "-"
    return f"{mine / theirs:.2f}x"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _errors(row: Row) -> str:
    if not row.errors:
        return "0"
    kinds = ", ".join(f"{k} {n}" for k, n in row.error_kinds.items())
    return f"{row.errors} ({kinds})"


def table(rows: Sequence[Row]) -> str:
    """The summary as a markdown table, each llmsched row with its ratios to the best peer."""
    best = best_peers(rows)
    lines = [
        "| answer | rate/s | gateway | CPU ms/req | kernel share | added p50 / p99 ms "
        "| TTFT overhead p50 ms "
        "| stream net added p50 / p99 ms | relay added p50 / p99 ms "
        "| ITL p99 ms | errors | best peer | CPU ratio | added p50 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peer = best.get((row.answer, row.rate, row.mode))
        versus = peer if peer is not None and peer is not row else None
        lines.append(
            f"| {row.answer} | {row.rate:g} | {row.gateway} | {_fmt(row.cpu_ms)} | "
            f"{_share(row.kernel_share)} | {_fmt(row.added_p50)} / {_fmt(row.added_p99)} | "
            f"{_fmt(row.ttft_overhead_p50)} | "
            f"{_fmt(row.net_added_p50)} / {_fmt(row.net_added_p99)} | "
            f"{_fmt(row.relay_added_p50)} / {_fmt(row.relay_added_p99)} | "
            f"{_fmt(row.itl_p99)} | {_errors(row)} | {versus.gateway if versus else '-'} | "
            f"{_ratio(row.cpu_ms, versus.cpu_ms) if versus else '-'} | "
            f"{_ratio(row.added_p50, versus.added_p50) if versus else '-'} |"
        )
    return "\n".join(lines)


def responses_table(rows: Sequence[Row]) -> str:
    """Per gateway on the Responses API: CPU per request (median, range over the repeats, ratio
    to the best peer), continuations sent and lost (answered 404 by an engine that does not
    hold the conversation)."""
    best = best_peers(rows)
    lines = [
        "| answer | rate/s | gateway | CPU ms/req median (range) | best peer | CPU ratio "
        "| continuations | lost (404) | lost share | other errors "
        "| busiest engine's share, each repeat |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peer = best.get((row.answer, row.rate, row.mode))
        versus = peer if peer is not None and peer is not row else None
        spread = (
            "" if row.cpu_range is None else f" ({row.cpu_range[0]:.3f}-{row.cpu_range[1]:.3f})"
        )
        lines.append(
            f"| {row.answer} | {row.rate:g} | {row.gateway} | {_fmt(row.cpu_ms)}{spread} | "
            f"{versus.gateway if versus else '-'} | "
            f"{_ratio(row.cpu_ms, versus.cpu_ms) if versus else '-'} | {row.continuations} | "
            f"{row.continuations_lost} | {_share(row.lost_share)} | "
            f"{row.errors - row.continuations_lost} | "
            f"{', '.join(_share(s) for s in row.busiest_engine_shares) or '-'} |"
        )
    return "\n".join(lines)


@dataclass
class Step:
    """One gateway's figures at one rate of a ladder (medians over the repeats)."""

    gateway: str
    answer: str
    rate: float
    achieved_rate: float | None
    answered_per_s: float | None
    errors: int
    latency_p50: float | None
    latency_p99: float | None
    cpu_ms: float | None
    lag_p99: float | None
    repeats: int
    held: bool

    @property
    def core_percent(self) -> float | None:
        """The gateway's CPU at this rate, in percent of a core."""
        if self.cpu_ms is None or self.achieved_rate is None:
            return None
        return self.cpu_ms * self.achieved_rate / 10


def ladder_steps(results: Results, args: argparse.Namespace) -> list[Step]:
    """Each gateway's figures at each rate it was loaded at; ``held`` when every repeat held
    it (a repeat that stopped below it did not)."""
    steps: list[Step] = []
    for (name, answer, rate), runs in results.runs.items():
        steps.append(
            Step(
                gateway=name,
                answer=answer,
                rate=rate,
                achieved_rate=median([f["achieved_rate"] for f in runs]),
                answered_per_s=median([f["ok"] / args.seconds for f in runs]),
                errors=sum(f["errors"] for f in runs),
                latency_p50=median([f["latency_p50"] for f in runs]),
                latency_p99=median([f["latency_p99"] for f in runs]),
                cpu_ms=median([f.get("cpu_ms") for f in runs]),
                lag_p99=median([f.get("lag_p99") for f in runs]),
                repeats=len(runs),
                held=len(runs) == args.repeats and all(holds(f, args.ladder_p99_ms) for f in runs),
            )
        )
    steps.sort(key=lambda s: (s.answer, s.gateway, s.rate))
    return steps


def ladder_table(steps: Sequence[Step], p99_ms: float) -> str:
    """Every step, then each gateway's highest rate held (all the rates below it held too)."""
    lines = [
        "| answer | gateway | rate/s | achieved/s | answered/s | errors | p50 / p99 ms "
        "| CPU ms/req | gateway core % | generator lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        lines.append(
            f"| {s.answer} | {s.gateway} | {s.rate:g} | {_fmt(s.achieved_rate)} | "
            f"{_fmt(s.answered_per_s)} | {s.errors} | {_fmt(s.latency_p50)} / "
            f"{_fmt(s.latency_p99)} | {_fmt(s.cpu_ms)} | "
            f"{'-' if s.core_percent is None else f'{s.core_percent:.0f}'} | {_fmt(s.lag_p99)} |"
        )
    lines += [
        "",
        f"| answer | gateway | highest rate held (p99 < {p99_ms:g} ms, no errors) "
        "| CPU ms/req there |",
        "|---|---|---|---|",
    ]
    by_gateway: dict[tuple[str, str], list[Step]] = {}
    for s in steps:
        by_gateway.setdefault((s.answer, s.gateway), []).append(s)
    for (answer, gateway), climbed in by_gateway.items():
        top: Step | None = None
        for s in sorted(climbed, key=lambda s: s.rate):
            if not s.held:
                break
            top = s
        lines.append(
            f"| {answer} | {gateway} | {'none' if top is None else f'{top.rate:g}'} | "
            f"{'-' if top is None else _fmt(top.cpu_ms)} |"
        )
    return "\n".join(lines)


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that set up the engines, the gateways and the requests, shared with
    ``tools/gateway_syscalls.py``: binaries, Python environments, answers, tokens, prompts,
    cores."""
    parser.add_argument("--bin", default=str(ROOT / "target" / "release"))
    parser.add_argument("--python", default=sys.executable, help="runs llmsched serve")
    parser.add_argument("--peers-python", default=None, help="the peers' environment's python")
    parser.add_argument(
        "--base-python", default=None, help="runs the llmsched-*@base rows (another build)"
    )
    parser.add_argument(
        "--base-bin",
        default=None,
        help="another build's binaries directory: its llmsched-gateway runs the "
        "llmsched-native-*@base rows",
    )
    parser.add_argument("--answers", default="json,stream")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--token-delay-ms", type=float, default=1.0, help="between streamed tokens")
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--chat", action="store_true", help="chat completions")
    parser.add_argument(
        "--responses",
        action="store_true",
        help="conversations on the Responses API (/v1/responses, see above; wins over --chat)",
    )
    parser.add_argument(
        "--turns", type=int, default=4, help="--responses: requests per conversation"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer directory for llmsched serve (prompts routed on its token ids)",
    )
    parser.add_argument("--gateway-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument(
        "--sched",
        choices=("normal", "fifo"),
        default="normal",
        help="every process of the benchmark under this scheduling policy (see above)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the matrix and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setup_arguments(parser)
    parser.add_argument(
        "--gateways",
        default="direct,llmsched-llm-d,llmsched-round-robin,llmsched-serve-native-llm-d,"
        "llmsched-serve-native-round-robin,llmsched-native-llm-d,"
        "llmsched-native-round-robin,sglang-cache_aware,sglang-round_robin,vllm-cache_aware,"
        "vllm-round_robin,bare-proxy",
    )
    parser.add_argument("--rates", default="300,1000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--idle-seconds", type=float, default=2.0, help="idle CPU measured this long (0: not)"
    )
    parser.add_argument("--short", action="store_true", help="one repeat of 2 s at 300 req/s")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="a direct load beside each gateway's, the added figures against it (see above)",
    )
    parser.add_argument("--json-out", default=None, help="also write the rows here")
    parser.add_argument(
        "--ladder",
        default=None,
        help="rising rates (1000,2000,...): each gateway's highest rate held, see above",
    )
    parser.add_argument(
        "--ladder-p99-ms", type=float, default=50.0, help="the p99 latency a held rate stays under"
    )
    args = parser.parse_args(argv)
    if args.short:
        args.repeats, args.seconds, args.warmup, args.rates = 1, 2.0, 0.5, "300"
        args.idle_seconds = min(args.idle_seconds, 1.0)
    if args.repeats < 1 or args.seconds <= 0:
        parser.error("--repeats and --seconds must be positive")
    if args.ladder and args.paired:
        parser.error("--paired measures added latency; a --ladder runs without it")
    if args.ladder:  # after --short: its rates give way
        try:
            rates = [float(r) for r in args.ladder.split(",") if r]
        except ValueError:
            parser.error(f"--ladder {args.ladder!r}: not a list of rates")
        if not rates or any(r <= 0 for r in rates):
            parser.error("--ladder: rates must be positive")
        args.rates = ",".join(f"{r:g}" for r in sorted(rates))
    print(
        f"gateways pinned to core {args.gateway_core}, engines and load on core "
        f"{args.client_core}; {args.repeats} repeat(s) of {args.seconds:g} s (+{args.warmup:g} s "
        f"warm-up); {args.tokens} tokens per answer, streamed {args.token_delay_ms:g} ms apart; "
        f"scheduling {args.sched}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    results = run(args)
    if args.ladder:
        steps = ladder_steps(results, args)
        print("\n" + ladder_table(steps, args.ladder_p99_ms))
        out: list[dict[str, object]] = [asdict(s) for s in steps]
    else:
        rows = rows_of(results)
        print("\n" + table(rows))
        if args.responses:
            print("\n" + responses_table(rows))
        out = [asdict(r) for r in rows]
    if results.idle:
        print("\n| gateway | idle CPU, % of a core (median, range) |\n|---|---|")
        for name, values in results.idle.items():
            print(
                f"| {name} | {statistics.median(values):.3f} "
                f"({min(values):.3f}-{max(values):.3f}) |"
            )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
