"""User-space instructions per request of the standalone native gateways, counted by callgrind.

A measure that the machine's other load does not move: CPU time per request varies by 10-20%
between runs on a shared machine, and where the hardware counters are not exposed (a VM:
``perf stat -e instructions:u`` reads ``<not supported>``) there is no instruction count
from ``perf``. Valgrind's callgrind counts every instruction a process executes in user space.
Each gateway in turn (``llmsched-native-round-robin`` / ``-llm-d`` from ``--bin``, the same
with ``@base`` from ``--base-bin``, ``bare-proxy``) runs under ``valgrind --tool=callgrind``,
pinned to ``--gateway-core``, in front of the four fake engines of
``tools/bench_gateway_peers.py`` (same options: ``--tokens``, ``--token-delay-ms``, cores,
``--sched``); after a warm-up load its counts are zeroed (``callgrind_control -z``), a load of
``--rate`` requests a second for ``--seconds`` is sent, and the counts are dumped
(``callgrind_control -d``): instructions (``Ir``) per request sent. The gateways are
interleaved, their order rotating each repeat. Under callgrind a gateway runs some 50 times
slower, so the rate must stay low (a gateway that falls behind reads events together that it
would read one at a time at full speed: raise ``--token-delay-ms`` to keep them apart). The
syscalls' own kernel work is not counted (``tools/gateway_syscalls.py`` counts the syscalls).
With ``--keep DIR`` the dumps are kept there for ``callgrind_annotate``.

Usage: python tools/gateway_callgrind.py --bin DIR --base-bin BASE_DIR
[--gateways llmsched-native-round-robin,llmsched-native-round-robin@base,bare-proxy]
[--answers stream] [--rate 100] [--seconds 10] [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gateway_peers as bench


def instructions(dump: str) -> int:
    """The ``Ir`` total of a callgrind dump (its ``summary:`` or ``totals:`` line).

    >>> instructions("events: Ir\\nfl=(1) a.rs\\nfn=(1) f\\n3 10\\nsummary: 1234\\n")
    1234
    >>> instructions("events: Ir\\ntotals: 99\\n")
    99
    """
    for line in dump.splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError("no summary line in the callgrind dump")


def measure(
    gateway: bench.Gateway,
    engines: list[str],
    work: Path,
    args: argparse.Namespace,
    load_bin: Path,
    stream: bool,
    keep: Path | None,
    tag: str,
) -> tuple[float, int]:
    """Instructions per request of one gateway under one load, and the load's errors."""
    port = bench.free_port()
    out = work / f"{gateway.name}.{tag}.%p"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--dump-instr=no",
        f"--callgrind-out-file={out}",
        *bench.gateway_command(gateway, port, engines, work, None),
    ]
    command = bench.scheduled(args.sched, bench.pinned(args.gateway_core, command))
    with bench.process(command, work / f"{gateway.name}.{tag}.log") as child:
        url = f"http://127.0.0.1:{port}"
        if not bench.wait_ready(url, 120):
            raise SystemExit(f"{gateway.name} did not start under valgrind")
        pid = child.pid
        load_args = argparse.Namespace(**vars(args))
        load_args.seconds, load_args.warmup = args.warmup_seconds, 0.0
        bench.load(load_bin, args.client_core, [url], args.rate, load_args, stream, [])
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        load_args.seconds = args.seconds
        figures = bench.load(load_bin, args.client_core, [url], args.rate, load_args, stream, [])
        before = set(work.glob(f"{gateway.name}.{tag}.{pid}*"))
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        dumps: list[Path] = []
        while time.monotonic() < deadline and not dumps:
            dumps = sorted(set(work.glob(f"{gateway.name}.{tag}.{pid}*")) - before)
            time.sleep(0.2)
        if not dumps:
            raise SystemExit(f"{gateway.name}: callgrind wrote no dump")
        time.sleep(0.5)  # written whole
        counted = instructions(dumps[-1].read_text())
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(dumps[-1], keep / f"callgrind.{gateway.name}.{tag}")
    requests = figures["ok"] + figures["errors"]
    return counted / max(requests, 1), int(figures["errors"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_setup_arguments(parser)
    parser.add_argument(
        "--gateways",
        default="llmsched-native-round-robin,llmsched-native-round-robin@base,bare-proxy",
    )
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", default=None, help="keep the callgrind dumps in this folder")
    args = parser.parse_args()
    args.warmup = 0.0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind (with callgrind_control)")
    bin_dir = Path(args.bin)
    engines_process, ports = bench.start_engines(
        bin_dir / "llmsched-fake-engine",
        args.client_core,
        args.tokens,
        args.token_delay_ms,
        args.sched,
    )
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    keep = Path(args.keep) if args.keep else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            chosen = bench.gateways(
                args.gateways.split(","),
                args.python,
                None,
                str(bin_dir / "llmsched-gateway"),
                base_bin=str(Path(args.base_bin) / "llmsched-gateway") if args.base_bin else None,
            )
            for answer in args.answers.split(","):
                results: dict[str, list[float]] = {g.name: [] for g in chosen}
                for repeat in range(args.repeats):
                    shift = repeat % len(chosen)
                    for gateway in chosen[shift:] + chosen[:shift]:
                        per_request, errors = measure(
                            gateway,
                            engines,
                            Path(tmp),
                            args,
                            bin_dir / "llmsched-loadgen",
                            answer == "stream",
                            keep,
                            f"{answer}{repeat}",
                        )
                        results[gateway.name].append(per_request)
                        print(
                            f"{gateway.name:36} {answer:6} repeat {repeat}: "
                            f"{per_request:,.0f} instructions/request, {errors} errors",
                            flush=True,
                        )
                for name, values in results.items():
                    middle = bench.median(values) or 0.0
                    shown = ", ".join(f"{v:,.0f}" for v in values)
                    print(f"{name:36} {answer:6} median {middle:,.0f} ({shown})", flush=True)
    finally:
        engines_process.terminate()
        engines_process.wait(timeout=10)


if __name__ == "__main__":
    main()
