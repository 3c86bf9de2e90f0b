"""Kernel work per request of each gateway: syscalls by type, context switches, packets.

The engines and gateways are those of ``tools/bench_gateway_peers.py`` (same commands, same
cores). Each gateway in turn is started, warmed up, and loaded at ``--rate`` for ``--seconds``
while ``perf stat`` counts syscall tracepoints, context switches and loopback packets sent
(``net:net_dev_xmit``) in its processes; every count is divided by the requests sent. The
threads' voluntary / involuntary context switches come from ``/proc/PID/task/*/status``.
Needs ``perf`` with tracepoints readable (root, or ``perf_event_paranoid`` <= 1).

Usage: python tools/gateway_syscalls.py --peers-python .venv-peers/bin/python
[--gateways a,b] [--rate 1000] [--seconds 4] [--answers json,stream]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gateway_peers as bench

SYSCALLS = [
    "read",
    "recvfrom",
    "recvmsg",
    "readv",
    "write",
    "sendto",
    "sendmsg",
    "writev",
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_ctl",
    "futex",
    "accept4",
    "connect",
    "socket",
    "close",
    "shutdown",
    "setsockopt",
    "getsockopt",
    "getsockname",
    "getpeername",
    "ioctl",
    "fcntl",
    "sched_yield",
    "mmap",
    "munmap",
    "madvise",
    "mprotect",
    "brk",
    "nanosleep",
    "clock_nanosleep",
    "timerfd_settime",
    "poll",
    "ppoll",
    "getrandom",
    "openat",
    "statx",
]
EVENTS = [
    "raw_syscalls:sys_enter",
    *(f"syscalls:sys_enter_{name}" for name in SYSCALLS),
    "context-switches",
    "net:net_dev_xmit",
]


def switches(pids: list[int]) -> tuple[int, int]:
    """Voluntary and involuntary context switches of every thread of ``pids``."""
    voluntary = involuntary = 0
    for pid in pids:
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
    return voluntary, involuntary


def per_request(perf_csv: str, requests: int) -> dict[str, float]:
    r"""Each event's count in ``perf stat -x ,`` output divided by ``requests`` (syscall
    tracepoints by the syscall's name; events perf could not count are left out).

    >>> per_request("5500,,raw_syscalls:sys_enter,1,100.00,,\n"
    ...             "2000,,syscalls:sys_enter_writev,1,100.00,,\n"
    ...             "<not counted>,,syscalls:sys_enter_futex,0,0.00,,", 1000)
    {'raw_syscalls:sys_enter': 5.5, 'writev': 2.0}
    """
    counts: dict[str, float] = {}
    for line in perf_csv.splitlines():
        fields = line.split(",")
        if len(fields) > 3 and fields[0].replace(".", "").isdigit():
            name = fields[2].removeprefix("syscalls:sys_enter_")
            counts[name] = int(float(fields[0])) / max(requests, 1)
    return counts


def count(
    gateway: bench.Gateway,
    engines: list[str],
    work: Path,
    args: argparse.Namespace,
    load_bin: Path,
    stream: bool,
) -> dict[str, float]:
    """Per-request counts of one gateway under one load."""
    port = bench.free_port()
    command = bench.scheduled(
        args.sched,
        bench.pinned(args.gateway_core, bench.gateway_command(gateway, port, engines, work, None)),
    )
    with bench.process(command, work / f"{gateway.name}.log") as child:
        url = f"http://127.0.0.1:{port}"
        if not bench.wait_ready(url, 60):
            raise SystemExit(f"{gateway.name} did not start")
        time.sleep(0.5)
        pids = bench.descendants(child.pid)
        load_args = argparse.Namespace(**vars(args))
        load_args.seconds, load_args.warmup = 1.0, 0.0
        bench.load(load_bin, args.client_core, [url], args.rate, load_args, stream, [])
        load_args.seconds = args.seconds
        before = switches(pids)
        perf = subprocess.Popen(
            [
                "perf",
                "stat",
                "-x",
                ",",
                "-e",
                ",".join(EVENTS),
                "-p",
                ",".join(map(str, pids)),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)  # perf attached
        figures = bench.load(load_bin, args.client_core, [url], args.rate, load_args, stream, [])
        perf.send_signal(2)
        _, err = perf.communicate(timeout=30)
        after = switches(pids)
    requests = figures["ok"] + figures["errors"]
    counts = per_request(err, requests)
    counts["requests"], counts["errors"] = requests, figures["errors"]
    counts["voluntary_cs"] = (after[0] - before[0]) / requests
    counts["involuntary_cs"] = (after[1] - before[1]) / requests
    return counts


def label(event: str) -> str:
    """A short column name: ``syscalls`` for every syscall, else the event without its group.

    >>> label("raw_syscalls:sys_enter"), label("net:net_dev_xmit"), label("writev")
    ('syscalls', 'net_dev_xmit', 'writev')
    """
    return "syscalls" if event == "raw_syscalls:sys_enter" else event.split(":")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_setup_arguments(parser)
    parser.add_argument(
        "--gateways",
        default="llmsched-serve-native-llm-d,llmsched-serve-native-round-robin,"
        "llmsched-native-llm-d,llmsched-native-round-robin,bare-proxy,"
        "sglang-cache_aware,sglang-round_robin,vllm-round_robin",
    )
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    bin_dir = Path(args.bin)
    engines_process, ports = bench.start_engines(
        bin_dir / "llmsched-fake-engine",
        args.client_core,
        args.tokens,
        args.token_delay_ms,
        args.sched,
    )
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    native = str(bin_dir / "llmsched-gateway")
    shown = ["requests", "raw_syscalls:sys_enter", *SYSCALLS, "context-switches"]
    shown += ["voluntary_cs", "involuntary_cs", "net:net_dev_xmit", "errors"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            chosen = bench.gateways(
                args.gateways.split(","), args.python, args.peers_python, native
            )
            for answer in args.answers.split(","):
                for gateway in chosen:
                    counts = count(
                        gateway,
                        engines,
                        Path(tmp),
                        args,
                        bin_dir / "llmsched-loadgen",
                        answer == "stream",
                    )
                    figures = "  ".join(
                        f"{label(k)} {counts[k]:.2f}" for k in shown if counts.get(k)
                    )
                    print(f"{gateway.name:36} {answer:6} {figures}", flush=True)
    finally:
        engines_process.terminate()
        engines_process.wait(timeout=10)


if __name__ == "__main__":
    main()
