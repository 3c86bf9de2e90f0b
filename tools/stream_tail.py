"""Where the slowest streams' time goes: each slow stream's hops beside the scheduler's trace.

The engines, gateways and cores are those of ``tools/bench_gateway_peers.py``. Each gateway in
turn (``direct``: none) is loaded with streamed completions at ``--rate`` while
``perf record -a -k CLOCK_MONOTONIC`` records every context switch and wake-up of the machine;
the generator reports its slowest streams event by event (``llmsched-loadgen
--slow-streams``: the client's start, the forward hop, each event's relay from the engine's
hand-over to the client, the ``[DONE]`` after the last), all on the clock the trace uses.

For each slow stream the largest of its three parts beyond the engine's own time (forward,
the last event's relay, the tail after it) is its worst hop; over that window the trace gives,
for each process on the stream's path, how long its thread was runnable but not running
(woken, waiting for its core), and who held the core meanwhile. What is left of the window is
work and the kernel's own handling (loopback, interrupts). Printed per gateway: the slow
streams' median parts, the summed waits by thread over their worst windows, and the
processes that held the client core while the generator waited.

``--sched fifo`` runs every process of the load as the benchmark's ``--sched fifo`` does.
Needs ``perf`` with tracepoints readable (root, or ``perf_event_paranoid`` <= 1).

Usage: python tools/stream_tail.py [--gateways direct,bare-proxy,...] [--rate 1000]
[--seconds 4] [--slow 0.01] [--paired]
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gateway_peers as bench

EVENTS = ("sched:sched_switch", "sched:sched_waking")
LINE = re.compile(r"^\s*(\d+)\s+\[(\d+)\]\s+(\d+)\.(\d+):\s+(sched:\w+):\s+(.*)$")


@dataclass
class Thread:
    """One thread's time in the trace: intervals (start, end) in ns."""

    waits: list[tuple[int, int]] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    woken: int | None = None
    since: int | None = None


@dataclass
class Trace:
    """Per thread id: its waits (woken to running) and runs; per CPU: who ran when."""

    threads: dict[int, Thread] = field(default_factory=lambda: defaultdict(Thread))
    cpu_runs: dict[int, list[tuple[int, int, str, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )


def parse(script: str) -> Trace:
    """``perf script -F tid,cpu,time,event,trace --ns`` output into intervals."""
    trace = Trace()
    # By CPU (the idle task is pid 0 on every CPU): who runs there, since when.
    on_cpu: dict[int, tuple[int, str, int]] = {}
    for line in script.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        cpu, ts = int(m[2]), int(m[3]) * 1_000_000_000 + int(m[4].ljust(9, "0")[:9])
        event, body = m[5], m[6]
        fields = dict(re.findall(r"(\w+)=(\S+)", body))
        if event == "sched:sched_waking":
            thread = trace.threads[int(fields["pid"])]
            if thread.since is None and thread.woken is None:
                thread.woken = ts
        elif event == "sched:sched_switch":
            prev, nxt = int(fields["prev_pid"]), int(fields["next_pid"])
            old = trace.threads[prev]
            if old.since is not None:
                old.runs.append((old.since, ts))
                old.since = None
            # Preempted (state R): runnable from now on.
            if fields.get("prev_state", "").startswith("R"):
                old.woken = ts
            if cpu in on_cpu:
                start, comm, tid = on_cpu.pop(cpu)
                trace.cpu_runs[cpu].append((start, ts, comm, tid))
            new = trace.threads[nxt]
            if new.woken is not None:
                new.waits.append((new.woken, ts))
                new.woken = None
            new.since = ts
            on_cpu[cpu] = (ts, fields["next_comm"], nxt)
    return trace


def within(intervals: list[Any], start: int, end: int) -> list[Any]:
    """The intervals (start, end, ...) that meet [start, end]; ``intervals`` do not overlap and
    come in time order (one thread's, or one CPU's), so a bisection finds the first."""
    first = bisect.bisect_right(intervals, start, key=lambda i: i[1])
    out = []
    for interval in intervals[first:]:
        if interval[0] >= end:
            break
        out.append(interval)
    return out


def worst_hop(stream: dict[str, Any]) -> tuple[str, int, int]:
    """The largest of the stream's parts beyond the engine: (name, start ns, end ns)."""
    ms = 1e6
    started = int(stream["started_ns"])
    received = started + round(stream["forward_ms"] * ms)
    last_sent = received + round((stream["engine_first_ms"] + sum(stream["engine_gap_ms"])) * ms)
    arrived = last_sent + round(stream["relay_ms"][-1] * ms)
    parts = [
        ("forward", started, received),
        ("last relay", last_sent, arrived),
        ("tail", arrived, arrived + round(stream["tail_ms"] * ms)),
    ]
    return max(parts, key=lambda p: p[2] - p[1])


def attribute(
    streams: list[dict[str, Any]], trace: Trace, who: dict[str, tuple[list[int], int]]
) -> dict[str, Any]:
    """The slow streams' median parts, waits by process over their worst windows, and who held
    each process's core while it waited (``who``: name to its thread ids and core)."""
    hops: Counter[str] = Counter()
    window_ms = 0.0
    waits: Counter[str] = Counter({name: 0 for name in who})
    holders: dict[str, Counter[str]] = {name: Counter() for name in who}
    # A holder of the load's own is named by its part ("gateway's python"), so that the
    # gateway's other threads are told from other processes of the same name.
    part = {tid: name for name, (tids, _) in who.items() for tid in tids}
    for stream in streams:
        hop, start, end = worst_hop(stream)
        hops[hop] += 1
        window_ms += (end - start) / 1e6
        for name, (tids, core) in who.items():
            for tid in tids:
                for a, b in within(trace.threads[tid].waits, start, end):
                    a, b = max(a, start), min(b, end)
                    waits[name] += b - a
                    for r0, r1, comm, holder in within(trace.cpu_runs[core], a, b):
                        held = min(r1, b) - max(r0, a)
                        label = re.sub(r"[-:/]?\d+$", "", comm)
                        if holder in part:
                            label = f"{part[holder]}'s {label}"
                        holders[name][label] += held

    def med(key: str) -> float:
        return round(statistics.median(s[key] for s in streams), 3)

    return {
        "streams": len(streams),
        "net_ms": med("net_ms"),
        "forward_ms": med("forward_ms"),
        "last_relay_ms": round(statistics.median(s["relay_ms"][-1] for s in streams), 3),
        "max_relay_ms": round(statistics.median(max(s["relay_ms"]) for s in streams), 3),
        "tail_ms": med("tail_ms"),
        "worst_hop": dict(hops),
        "worst_windows_ms": round(window_ms, 2),
        "waiting_in_them_ms": {k: round(v / 1e6, 2) for k, v in waits.items()},
        "core_held_while_waiting_ms": {
            name: {k: round(v / 1e6, 2) for k, v in held.most_common(5)}
            for name, held in holders.items()
            if held
        },
    }


def timeline(stream: dict[str, Any], trace: Trace, args: argparse.Namespace) -> str:
    """Who ran on each core over a stream's worst window (and 0.5 ms before it)."""
    hop, start, end = worst_hop(stream)
    lines = [f"stream net {stream['net_ms']:.3f} ms, worst: {hop} {(end - start) / 1e6:.3f} ms"]
    for core in (args.gateway_core, args.client_core):
        runs = within(trace.cpu_runs[core], start - 500_000, end)
        text = " ".join(
            f"{comm}:{tid}[{(a - start) / 1e3:+.0f},{(b - a) / 1e3:.0f}us]"
            for a, b, comm, tid in runs
        )
        lines.append(f"  core {core}: {text}")
    return "\n".join(lines)


def tids(pid: int) -> list[int]:
    """Thread ids of ``pid`` and its descendants."""
    out = []
    for p in bench.descendants(pid):
        with suppress(OSError):
            out += [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
    return out


def main() -> None:
    """Loads each gateway under the trace and prints the attribution."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_setup_arguments(parser)
    parser.add_argument("--gateways", default="direct,bare-proxy,llmsched-serve-native-round-robin")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--slow", type=float, default=0.01, help="the slowest share of streams")
    parser.add_argument("--paired", action="store_true", help="a direct load beside each")
    parser.add_argument("--json-out", default=None)
    parser.add_argument(
        "--timeline", type=int, default=0, help="print the N slowest streams' worst windows"
    )
    args = parser.parse_args()
    args.answers = "stream"
    bin_dir = Path(args.bin)
    engine_bin, load_bin = bin_dir / "llmsched-fake-engine", bin_dir / "llmsched-loadgen"
    names = [g for g in args.gateways.split(",") if g]
    rows = bench.gateways(names, args.python, args.peers_python, str(bin_dir / "llmsched-gateway"))
    slow = max(1, int(args.rate * args.seconds * args.slow))
    out: dict[str, Any] = {}
    engines_process, ports = bench.start_engines(
        engine_bin, args.client_core, args.tokens, args.token_delay_ms, args.sched
    )
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for gateway in rows:
                with ExitStack() as stack:
                    urls, gateway_tids = engines, []
                    if gateway.kind != "direct":
                        port = bench.free_port()
                        command = bench.scheduled(
                            args.sched,
                            bench.pinned(
                                args.gateway_core,
                                bench.gateway_command(gateway, port, engines, work, args.tokenizer),
                            ),
                        )
                        child = stack.enter_context(
                            bench.process(command, work / f"{gateway.name}.log")
                        )
                        urls = [f"http://127.0.0.1:{port}"]
                        if not bench.wait_ready(urls[0], 60):
                            raise SystemExit(f"{gateway.name} did not start")
                        time.sleep(0.5)
                        gateway_tids = tids(child.pid)
                    out[gateway.name] = run_one(
                        args, load_bin, urls, engines, slow, gateway_tids, engines_process.pid, work
                    )
                print(f"{gateway.name}: {json.dumps(out[gateway.name])}", flush=True)
    finally:
        engines_process.terminate()
        engines_process.wait(timeout=10)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))


def run_one(
    args: argparse.Namespace,
    load_bin: Path,
    urls: list[str],
    engines: list[str],
    slow: int,
    gateway_tids: list[int],
    engine_pid: int,
    work: Path,
) -> dict[str, Any]:
    """One traced load (and its direct pair); the attribution of its slow streams."""
    data = work / "perf.data"
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-o", str(data)]
        + [a for e in EVENTS for a in ("-e", e)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)

    def command(targets: list[str], seed: int) -> list[str]:
        base = bench.load_command(
            load_bin, args.client_core, targets, args.rate, args, True, [], seed
        )
        return [*base, "--slow-streams", str(slow)]

    try:
        procs = [subprocess.Popen(command(urls, 1), stdout=subprocess.PIPE, text=True)]
        if args.paired:
            procs.append(subprocess.Popen(command(engines, 2), stdout=subprocess.PIPE, text=True))
        generator_tids = [t for p in procs for t in tids(p.pid)]
        with ThreadPoolExecutor(len(procs)) as pool:
            outputs = list(pool.map(lambda p: p.communicate()[0], procs))
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "--ns", "-F", "tid,cpu,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    trace = parse(script)
    reports = [json.loads(o) for o in outputs]
    who = {
        "generator": (generator_tids, args.client_core),
        "gateway": (gateway_tids, args.gateway_core),
        "engines": (tids(engine_pid), args.client_core),
    }
    for stream in reports[0]["slow_streams"][: args.timeline]:
        print(timeline(stream, trace, args))
    result = {
        "net_p50_ms": reports[0]["net_latency_ms"]["p50"],
        "net_p99_ms": reports[0]["net_latency_ms"]["p99"],
        "slow": attribute(reports[0]["slow_streams"], trace, who),
    }
    if args.paired:
        result["direct_net_p50_ms"] = reports[1]["net_latency_ms"]["p50"]
        result["direct_net_p99_ms"] = reports[1]["net_latency_ms"]["p99"]
        result["direct_slow"] = attribute(reports[1]["slow_streams"], trace, who)
    return result


if __name__ == "__main__":
    main()
