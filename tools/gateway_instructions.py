"""User-space instructions per request of each gateway: a steadier figure than CPU time.

The engines, gateways and load are those of ``tools/bench_gateway_peers.py`` (same commands,
same cores). Each gateway in turn is started, warmed up, and sent ``--rate`` requests a second
for ``--seconds`` (a fixed number of requests) while its user-mode instructions are counted;
the count is divided by the requests sent. Repeats are interleaved (every gateway once, then
again), so that a build and the one before it (``llmsched-native-*@base`` with ``--base-bin``)
meet the same machine.

Two counters:

* ``perf``: ``perf stat -e instructions:u,cycles:u -p PID`` on the gateway's processes (needs
  the CPU's counters, which many virtual machines do not expose; ``perf stat -e
  instructions:u true`` then prints ``<not supported>``);
* ``callgrind``: the gateway runs under ``valgrind --tool=callgrind``; its counts are zeroed
  (``callgrind_control --zero``) just before the measured load and dumped (``--dump``) just
  after it, and the dump's instruction total is taken (cycles are not counted; switching
  the instrumentation on for the load only, ``--instr-atstart=no``, counted nothing here).
  The program runs some 50 times slower there, so keep the rate low (100/s holds for the
  standalone binary). With ``--out-dir`` the dumps are kept there (for
  ``callgrind_annotate``), and ``--fold N`` prints each one's instructions per request by
  crate (the functions' own instructions, not their callees'), the N largest.

``auto`` (the default) takes ``perf`` where it counts instructions, else ``callgrind``. A
gateway's own periodic work (the engines' ``/metrics`` scrapes, health probes) is counted
too, the same for each build at the same rate and duration, a larger share at a low rate.

Usage: python tools/gateway_instructions.py [--gateways a,b] [--rate 100] [--seconds 5]
[--repeats 3] [--answers json,stream] [--counter auto|perf|callgrind] [--base-bin DIR]
[--out-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gateway_peers as bench


def perf_counts_instructions() -> bool:
    """Whether ``perf stat`` can count user-mode instructions here."""
    try:
        out = subprocess.run(
            ["perf", "stat", "-x", ",", "-e", "instructions:u", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(
        line.split(",")[0].isdigit() for line in out.stderr.splitlines()
    )


def perf_totals(perf_csv: str) -> dict[str, int]:
    r"""Event totals from ``perf stat -x ,`` output (events perf could not count left out).

    >>> perf_totals("123456,,instructions:u,1,100.00,,\n<not supported>,,cycles:u,0,100.00,,")
    {'instructions': 123456}
    """
    totals: dict[str, int] = {}
    for line in perf_csv.splitlines():
        fields = line.split(",")
        if len(fields) > 3 and fields[0].isdigit():
            totals[fields[2].split(":")[0]] = int(fields[0])
    return totals


def callgrind_total(dump: str) -> int:
    """The instruction total of a callgrind dump (its ``summary:`` or ``totals:`` line; the
    first event is ``Ir`` without other ``--collect`` options).

    >>> callgrind_total("events: Ir\\nfn=(1) main\\n3 10\\nsummary: 4242\\n")
    4242
    """
    for line in dump.splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError("no summary line in the callgrind dump")


def crate_of(function: str) -> str:
    """The crate a demangled function name belongs to (glibc's allocator: ``malloc``, its
    ``mem*`` functions: ``memcpy``, another C function: its name).

    >>> crate_of("<hyper::proto::h1::role::Server as hyper::proto::h1::Http1Transaction>::parse")
    'hyper'
    >>> crate_of("llmsched_gateway::Gateway::handle::{{closure}}"), crate_of("_int_free")
    ('llmsched_gateway', 'malloc')
    >>> crate_of("__memcpy_avx_unaligned_erms")
    'memcpy'
    """
    name = function.lstrip("<&*")
    name = name.removeprefix("mut ").removeprefix("dyn ")
    own, as_trait, trait = name.partition(" as ")
    if as_trait and "::" not in own.split("<", 1)[0]:
        name = trait  # a primitive's (`<&str as core::fmt::Display>`): the trait's crate
    if "::" in name:
        return name.split("::", 1)[0]
    name = name.split("@")[0]
    if name.lstrip("_").startswith(("int_malloc", "int_free", "malloc", "free", "calloc")):
        return "malloc"
    if name.startswith(("__mem", "mem")):
        return "memcpy"
    return name


def fold(dump: str, requests: float) -> list[tuple[str, float]]:
    """Own instructions per request in a callgrind dump, by crate, largest first (a call's
    line is its callee's inclusive cost and is skipped)."""
    names: dict[str, str] = {}
    by_crate: dict[str, float] = {}
    current, after_calls = "", False

    def named(text: str) -> str:
        ident, _, rest = text.partition(") ")
        if ident.startswith("("):
            if rest:
                names[ident] = rest
            return names.get(ident.rstrip(")"), names.get(ident, text))
        return text

    for line in dump.splitlines():
        if line.startswith("fn="):
            current = crate_of(named(line[3:]))
        elif line.startswith("cfn="):
            named(line[4:])
        elif line.startswith("calls="):
            after_calls = True
        elif line[:1].isdigit() or line[:1] in "+-*":
            fields = line.split()
            if len(fields) > 1 and not after_calls:
                by_crate[current] = by_crate.get(current, 0.0) + int(fields[1]) / requests
            after_calls = False
    return sorted(by_crate.items(), key=lambda item: -item[1])


def measure(
    gateway: bench.Gateway,
    engines: list[str],
    work: Path,
    args: argparse.Namespace,
    load_bin: Path,
    stream: bool,
    tag: str,
) -> dict[str, float]:
    """Instructions (and cycles, with ``perf``) per request of one gateway under one load."""
    port = bench.free_port()
    command = bench.gateway_command(gateway, port, engines, work, None)
    dump = work / f"callgrind.{tag}"
    if args.counter == "callgrind":
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={dump}",
            *command,
        ]
    command = bench.scheduled(args.sched, bench.pinned(args.gateway_core, command))
    with bench.process(command, work / f"{tag}.log") as child:
        url = f"http://127.0.0.1:{port}"
        if not bench.wait_ready(url, 180):
            raise SystemExit(f"{gateway.name} did not start (log: {work / f'{tag}.log'})")
        pids = bench.descendants(child.pid)
        warm = argparse.Namespace(**vars(args))
        warm.seconds, warm.warmup = args.warmup, 0.0
        bench.load(load_bin, args.client_core, [url], args.rate, warm, stream, [])
        measured = argparse.Namespace(**vars(args))
        measured.warmup = 0.0
        counts: dict[str, float] = {}
        if args.counter == "perf":
            events = "instructions:u,cycles:u"
            pid_list = ",".join(map(str, pids))
            perf = subprocess.Popen(
                ["perf", "stat", "-x", ",", "-e", events, "-p", pid_list],
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(0.3)  # perf attached
            figures = bench.load(load_bin, args.client_core, [url], args.rate, measured, stream, [])
            perf.send_signal(2)
            _, err = perf.communicate(timeout=30)
            counts.update(perf_totals(err))
        else:

            def control(option: str) -> None:
                subprocess.run(
                    ["callgrind_control", option, str(child.pid)], check=True, capture_output=True
                )

            control("--zero")
            figures = bench.load(load_bin, args.client_core, [url], args.rate, measured, stream, [])
            control("--dump")
            dumps = sorted(work.glob(f"callgrind.{tag}.*"))
            dumps = [d for d in dumps if d.stat().st_size > 0]
            counts["instructions"] = sum(callgrind_total(d.read_text()) for d in dumps)
    requests = figures["ok"] + figures["errors"]
    out = {name: total / max(requests, 1) for name, total in counts.items()}
    out["requests"], out["errors"] = requests, figures["errors"]
    if args.out_dir and args.counter == "callgrind":
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        for d in work.glob(f"callgrind.{tag}.*"):
            if args.fold:
                shares = fold(d.read_text(), max(requests, 1))[: args.fold]
                print(f"{tag}: " + ", ".join(f"{c} {n:,.0f}" for c, n in shares), flush=True)
            d.replace(Path(args.out_dir) / d.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_setup_arguments(parser)
    parser.add_argument(
        "--gateways", default="bare-proxy,llmsched-native-round-robin,llmsched-native-llm-d"
    )
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--counter", choices=("auto", "perf", "callgrind"), default="auto")
    parser.add_argument("--out-dir", default=None, help="keeps the callgrind dumps here")
    parser.add_argument("--fold", type=int, default=0, help="with --out-dir: crates shown")
    args = parser.parse_args()
    if args.counter == "auto":
        args.counter = "perf" if perf_counts_instructions() else "callgrind"
    print(f"counter: {args.counter}", flush=True)
    bin_dir = Path(args.bin)
    engines_process, ports = bench.start_engines(
        bin_dir / "llmsched-fake-engine",
        args.client_core,
        args.tokens,
        args.token_delay_ms,
        args.sched,
    )
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    base_bin = str(Path(args.base_bin) / "llmsched-gateway") if args.base_bin else None
    chosen = bench.gateways(
        args.gateways.split(","),
        args.python,
        args.peers_python,
        str(bin_dir / "llmsched-gateway"),
        args.base_python,
        base_bin,
    )
    found: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for answer in args.answers.split(","):
                    for gateway in chosen:
                        tag = f"{gateway.name}.{answer}.{repeat}"
                        counts = measure(
                            gateway,
                            engines,
                            Path(tmp),
                            args,
                            bin_dir / "llmsched-loadgen",
                            answer == "stream",
                            tag,
                        )
                        found.setdefault((gateway.name, answer), []).append(counts)
                        figures = "  ".join(
                            f"{k} {v:,.0f}" for k, v in counts.items() if k != "requests"
                        )
                        print(
                            f"{gateway.name:36} {answer:6} requests {counts['requests']:.0f}  "
                            f"{figures}",
                            flush=True,
                        )
    finally:
        engines_process.terminate()
        engines_process.wait(timeout=10)
    print("\nmedian (range) per request:")
    for (name, answer), runs in found.items():
        values = [r["instructions"] for r in runs if "instructions" in r]
        if values:
            print(
                f"{name:36} {answer:6} instructions {statistics.median(values):,.0f} "
                f"({min(values):,.0f}-{max(values):,.0f})"
            )


if __name__ == "__main__":
    main()
