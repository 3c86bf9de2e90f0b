"""Run one scenario under several policies (in parallel threads or processes) and report the
results.

>>> from llmsched.sim.config import ScenarioConfig
>>> cfg = ScenarioConfig.from_dict({"replicas": 2, "policies": ["random", "round-robin"],
...     "workload": {"kind": "long_short", "num_requests": 40}})
>>> results = compare(cfg, jobs=1, progress=False)
>>> [r.policy for r in results]
['random', 'round-robin']
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from pathlib import Path
from typing import Any, TextIO

from llmsched._extras import require
from llmsched.errors import ConfigError
from llmsched.sim import fast
from llmsched.sim.config import ScenarioConfig
from llmsched.sim.policies import PolicyLike
from llmsched.sim.results import SimResult
from llmsched.sim.simulator import Simulation

__all__ = ["TABLE_LEGEND", "compare", "format_table", "policy_colours", "write_json", "write_plot"]

TABLE_LEGEND = """\
columns (times are simulated; ms, s or d for days, as printed):
  out tok/s, req/s   output tokens and completed requests per simulated second (first arrival
                     to last finish)
  TTFT p50/p90/p99   time to first token, percentiles over completed requests
  TPOT p50           time per output token after the first, median
  E2E p90            arrival to last token, 90th percentile
  hit                share of prompt tokens found in the engines' prefix caches
  prefill, recomp    prompt tokens computed, and tokens recomputed after preemption (millions)
  preempt            preemptions by the engines (a request preempted twice counts twice)
  SLO                share of requests meeting their priority's TTFT/TPOT targets (refused
                     requests miss), mean over priorities; - without targets
  Jain               Jain's fairness index over tenants of ideal/actual latency (1 = fair)"""
"""What each column of :func:`format_table` means, in which unit."""

_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _counter
    _counter = counter


def _bump(done: int, last: list[int]) -> None:
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += done - last[0]
    last[0] = done


def _simulate(
    config: ScenarioConfig, policy: PolicyLike, label: str = "", engine: str = "auto"
) -> SimResult:
    last = [0]
    sim = Simulation(
        config, policy, progress=lambda n: _bump(n, last), progress_every=200, engine=engine
    )
    result = sim.run()
    if label:
        result.policy = f"{result.policy} [{label}]"
    return result


def _native(run: tuple[ScenarioConfig, PolicyLike, str, str]) -> bool:
    """Whether this (scenario, policy, label, engine) run goes to a thread: the Rust engine runs
    it and its policy is a name or a router config. A Python ``Policy`` object runs in a process
    (or inline) as before, on whichever engine: one object in several threads at once would mix
    the runs' states."""
    if not isinstance(run[1], (str, Mapping)):
        return False
    return run[3] != "python" and fast.unsupported(run[0], run[1]) is None


def compare(
    config: ScenarioConfig,
    policies: list[PolicyLike] | None = None,
    *,
    jobs: int | None = None,
    progress: bool = True,
    out: TextIO = sys.stderr,
    engine: str = "auto",
) -> list[SimResult]:
    """Simulate ``config`` once per policy (each variant's ``policies`` by default) and variant,
    ``jobs`` at a time (default: one per CPU, at most one per run): Rust-engine runs in threads,
    Python-engine runs in separate processes, with a progress bar over simulated requests.
    ``engine`` is passed to each :class:`Simulation`. Results come back in (variant, policy)
    order. A :class:`~llmsched.sim.policies.Policy` object that runs more than once (in each
    variant, or named twice) starts each run from its state as given: the first run inline
    uses the object itself (in this process), every other run a deep copy taken before any run."""
    runs = _own_policy_objects(
        [
            (cfg, p, label, engine)
            for label, cfg in config.expand()
            for p in (policies if policies is not None else cfg.policies)
        ]
    )
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(runs)))
    counter = multiprocessing.get_context("spawn").Value("q", 0)
    _init_worker(counter)
    bar = None
    if progress:
        require("sim", "tqdm", feature="the llmsched sim progress bar")
        from tqdm import tqdm

        total = _expected_requests(config) * len(runs)
        bar = tqdm(total=total, unit="req", file=out, desc=config.name, leave=False)
    try:
        # Rust-engine runs go to threads of this process (the engine releases the GIL and the
        # policies share one workload plan); the rest to processes (or inline with one job).
        native = [i for i, run in enumerate(runs) if _native(run)]
        python = [i for i in range(len(runs)) if i not in set(native)]
        results: list[SimResult | None] = [None] * len(runs)
        threaded = _threads([runs[i] for i in native], jobs, counter, bar)
        for i, result in zip(native, threaded, strict=True):
            results[i] = result
        if jobs == 1 or len(python) <= 1:
            for i in python:
                results[i] = _simulate(*runs[i])
                _tick(bar, counter)
        else:
            spawned = _parallel([runs[i] for i in python], jobs, counter, bar)
            for i, result in zip(python, spawned, strict=True):
                results[i] = result
        return [r for r in results if r is not None]
    finally:
        if bar is not None:
            bar.close()
        _init_worker(None)


def _own_policy_objects(
    runs: list[tuple[ScenarioConfig, PolicyLike, str, str]],
) -> list[tuple[ScenarioConfig, PolicyLike, str, str]]:
    """``runs`` with each later run of one :class:`~llmsched.sim.policies.Policy` object (a
    variant's, or the object named twice) on a deep copy taken before any run: every run starts
    from the object's state as given, inline or in a process (which gets a pickled copy).
    Inline runs shared the object, so a stateful policy began the second variant where the
    first left off, and ``jobs=1`` and ``jobs=2`` gave different figures.

    >>> cfg = ScenarioConfig()
    >>> class P:
    ...     name = "p"
    ...     def update_metrics(self, *a): ...
    ...     def pick(self, req, now): ...
    ...     def on_finished(self, req, now): ...
    >>> obj = P()
    >>> a, b = _own_policy_objects([(cfg, obj, "a", "auto"), (cfg, obj, "b", "auto")])
    >>> a[1] is obj, b[1] is obj, type(b[1]) is P
    (True, False, True)
    """
    seen: set[int] = set()
    out = []
    for cfg, policy, label, engine in runs:
        if not isinstance(policy, (str, Mapping)):
            if id(policy) in seen:
                try:
                    policy = copy.deepcopy(policy)
                except Exception as exc:
                    raise ConfigError(
                        f"policy {getattr(policy, 'name', policy)!r} runs more than once in this "
                        f"comparison and each run needs a copy of it (copy.deepcopy): {exc}"
                    ) from exc
            else:
                seen.add(id(policy))
        out.append((cfg, policy, label, engine))
    return out


def _threads(
    runs: list[tuple[ScenarioConfig, PolicyLike, str, str]], jobs: int, counter: Any, bar: Any
) -> list[SimResult]:
    if not runs:
        return []
    for config, *_ in runs:
        fast.cached_plan(config)  # once per workload, before the threads share it
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_simulate, *run) for run in runs]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _tick(bar, counter)
        return [f.result() for f in futures]


def _parallel(
    runs: list[tuple[ScenarioConfig, PolicyLike, str, str]], jobs: int, counter: Any, bar: Any
) -> list[SimResult]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(counter,)
    ) as pool:
        futures: dict[Future[SimResult], int] = {
            pool.submit(_simulate, *run): i for i, run in enumerate(runs)
        }
        results: list[SimResult | None] = [None] * len(runs)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for f in done:
                results[futures[f]] = f.result()
            _tick(bar, counter)
    return [r for r in results if r is not None]


def _tick(bar: Any, counter: Any) -> None:
    if bar is not None:
        bar.n = counter.value
        bar.refresh()


def _trace_lines(spec: Mapping[str, Any]) -> int:
    """The requests a trace replays, for the progress bar: its non-blank lines, at most its
    ``limit``, counted without parsing them (the run reads and checks them, and reports a
    file it cannot read); 1 for a file it cannot read."""
    limit = spec.get("limit")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        limit = None
    try:
        with open(str(spec.get("path", "")), "rb") as lines:
            requests = (line for line in lines if not line.isspace())
            return sum(1 for _ in itertools.islice(requests, limit))
    except (OSError, TypeError, ValueError):
        return 1


def _expected_requests(config: ScenarioConfig) -> int:
    spec = dict(config.workload)
    if spec.get("kind") == "trace":
        return max(1, _trace_lines(spec))
    for key in ("num_requests",):
        if key in spec:
            return int(spec[key])
    if spec.get("kind") == "agentic":
        from llmsched.sim.workloads import AgenticConfig, from_dict

        params = {k: v for k, v in spec.items() if k != "kind"}
        cfg = from_dict(AgenticConfig, params, "workload")
        return int(cfg.sessions * (1 + cfg.followup_turns))
    from llmsched.sim.workloads import KINDS

    return int(KINDS[spec["kind"]][0]().num_requests)


def format_table(results: list[SimResult], wall_s: float | None = None) -> str:
    """The comparison table (one row per policy) and a timing footer; :data:`TABLE_LEGEND`
    explains the columns."""
    # Every cell keeps a space before it: a variant's policy name past 28 characters, or a
    # TTFT of 16402.5 s in an 8-wide column, ran into the next figure.
    first = max([28, *(len(r.policy) + 2 for r in results)])
    header = f"{'policy':<{first}}" + _cells([name for name, _ in _COLUMNS])
    lines = [header, "-" * len(header)]
    total = 0
    refused: dict[str, int] = {}
    unfinished: dict[str, int] = {}
    decision = wall = 0.0
    for r in results:
        s = r.summary()
        total += s["completed"]
        if s["unfinished"]:
            unfinished[s["policy"]] = s["unfinished"]
        if s["rejected"]:
            refused[s["policy"]] = s["rejected"]
        wall += s.get("wall_s", 0.0)
        decision += s.get("decision_share", 0.0) * s.get("wall_s", 0.0)
        if s["completed"] == 0:
            lines.append(f"{s['policy']:<{first}}(no request completed)")
            continue
        slo = s["slo_attainment"]
        slo_all = f"{sum(slo.values()) / len(slo):.0%}" if slo else "-"
        cells = [
            f"{s['output_tok_s']:.0f}",
            f"{s['requests_s']:.2f}",
            _secs(s["ttft_s"]["p50"]),
            _secs(s["ttft_s"]["p90"]),
            _secs(s["ttft_s"]["p99"]),
            _secs(s["tpot_s"]["p50"]),
            _secs(s["e2e_s"]["p90"]),
            f"{s['prefix_hit_rate']:.0%}",
            f"{s['prefill_tokens'] / 1e6:.1f}M",
            f"{s['recomputed_tokens'] / 1e6:.2f}M",
            str(s["preemptions"]),
            slo_all,
            f"{s['fairness_jain']:.2f}",
        ]
        lines.append(f"{s['policy']:<{first}}" + _cells(cells))
    elapsed = wall_s if wall_s is not None else wall
    share = decision / wall if wall > 0 else 0.0
    engines = sorted({r.engine_name for r in results})
    lines.append(
        f"\n{total} simulated requests in {elapsed:.1f} s wall "
        f"({total / elapsed if elapsed > 0 else 0:,.0f} requests/s); "
        f"routing decisions took {share:.1%} of simulation time "
        f"(engine: {' and '.join(engines)})"
    )
    if unfinished:
        # Per policy: a policy that left most of its requests queued at the cut reads better in
        # every column than one that served them, and the total did not say which it was.
        counts = ", ".join(f"{n} under {policy}" for policy, n in unfinished.items())
        lines.append(
            f"{sum(unfinished.values())} requests unfinished at max_time_s ({counts}: arrived, "
            f"still waiting or running): left out of every figure"
        )
    if refused:
        # Refused requests are in no column but SLO: without this line a run that refused
        # most of its requests (too long for a replica's KV cache) read like a clean one.
        counts = ", ".join(f"{n} under {policy}" for policy, n in refused.items())
        lines.append(
            f"{sum(refused.values())} requests refused ({counts}: by flow control, or longer "
            f"than a replica's KV cache holds): SLO counts them as misses, the other columns "
            f"leave them out"
        )
    reasons = sorted({r.fallback_reason for r in results if r.fallback_reason is not None})
    if reasons:
        lines.append(
            f"reference (Python) engine for what the Rust engine does not cover: "
            f"{', '.join(reasons)}"
        )
    return "\n".join(lines)


_COLUMNS = (
    ("out tok/s", 10),
    ("req/s", 7),
    ("TTFT p50", 9),
    ("p90", 8),
    ("p99", 8),
    ("TPOT p50", 9),
    ("E2E p90", 9),
    ("hit", 6),
    ("prefill", 9),
    ("recomp", 8),
    ("preempt", 8),
    ("SLO", 6),
    ("Jain", 6),
)
"""The table's columns after the policy: (header, width)."""


def _cells(texts: list[str]) -> str:
    """``texts`` right-aligned in :data:`_COLUMNS`' widths, each after at least one space.

    >>> _cells(["1", "2"])
    '         1      2'
    >>> _cells(["1", "12345678"])
    '         1 12345678'
    """
    out = []
    for text, (_, width) in zip(texts, _COLUMNS, strict=False):
        out.append(f"{text:>{width}}" if len(text) < width else f" {text}")
    return "".join(out)


def _secs(x: float) -> str:
    """A simulated duration in at most 7 characters: ms below 1 s, s (one decimal below
    1,000 s) below 10**6 s, days beyond.

    >>> [_secs(x) for x in (0.25, 12.34, 16402.5, 4e6, float("nan"))]
    ['250ms', '12.3s', '16402s', '46d', '-']
    """
    if x != x:  # nan
        return "-"
    if x < 1:
        return f"{x * 1e3:.0f}ms"
    if x < 1e3:
        return f"{x:.1f}s"
    if x < 1e6:
        return f"{x:.0f}s"
    return f"{x / 86400:.0f}d"


def write_json(
    path: str | Path, config: ScenarioConfig, results: list[SimResult], wall_s: float
) -> None:
    """Every summary figure plus the KV-use series, and the scenario, as JSON."""
    doc = {
        "scenario": config.to_dict(),
        "wall_s": wall_s,
        "results": [dict(r.summary(), kv_use_series=r.kv_series()) for r in results],
    }
    # Strict JSON: a figure without samples (NaN: the TPOT of one-token answers) is null.
    Path(path).write_text(json.dumps(_finite(doc), indent=1, default=_jsonable, allow_nan=False))


def _finite(x: Any) -> Any:
    """``x`` with every float that is not finite (NaN, an infinity) replaced by None.

    >>> _finite({"p50": float("nan"), "n": [1.5, float("inf")]})
    {'p50': None, 'n': [1.5, None]}
    """
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot encode {type(x).__name__}")


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
"""File types :func:`write_plot` writes (chosen by the path's suffix)."""


def policy_colours(policies: list[str]) -> dict[str, str]:
    """One colour per policy, the same in every panel: matplotlib's tab10/tab20 cycle in the
    order the policies first appear.

    >>> policy_colours(["llm-d", "random", "llm-d"])
    {'llm-d': '#1f77b4', 'random': '#ff7f0e'}
    """
    tab10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    tab10 += ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    names = list(dict.fromkeys(policies))
    if len(names) <= len(tab10):
        return {n: tab10[i] for i, n in enumerate(names)}
    # More policies than tab10 has colours: spread them around the hue circle instead.
    import colorsys

    out = {}
    for i, n in enumerate(names):
        r, g, b = colorsys.hsv_to_rgb(i / len(names), 0.75, 0.85)
        out[n] = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
    return out


def write_plot(path: str | Path, results: list[SimResult], title: str | None = None) -> None:
    """TTFT CDFs, output throughput and prefix-cache hit-rate bars, KV use over time, under
    ``title`` (e.g. scenario, seed and engine), one colour per policy in every panel.

    Needs the ``sim`` extra (matplotlib); without it raises ``ImportError`` naming the extra.
    """
    require("sim", "matplotlib", feature="llmsched sim plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summaries = [r.summary() for r in results]
    names = [s["policy"] for s in summaries]
    colours = policy_colours(names)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for r in results:
        ttft = np.sort(r.requests["first_token"] - r.requests["arrival"])
        # A policy that completed nothing still gets its legend entry (an empty line).
        ys = np.arange(1, len(ttft) + 1) / max(len(ttft), 1)
        ax.plot(ttft, ys, label=r.policy, color=colours[r.policy])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, simulated)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.legend(fontsize=8)
    bars = [colours[n] for n in names]
    axes[0][1].bar(names, [s.get("output_tok_s", 0.0) for s in summaries], color=bars)
    axes[0][1].set_title("output tokens per simulated second")
    axes[1][0].bar(names, [s.get("prefix_hit_rate", 0.0) for s in summaries], color=bars)
    axes[1][0].set_title("prefix-cache hit rate (share of prompt tokens)")
    axes[1][0].set_ylim(0, 1)
    for a in (axes[0][1], axes[1][0]):
        a.tick_params(axis="x", rotation=30, labelsize=8)
    ax = axes[1][1]
    for r in results:
        series = r.kv_series()
        ax.plot(series["t"], series["kv_use"], label=r.policy, color=colours[r.policy])
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("share of KV-cache blocks in use")
    ax.set_title("mean KV-cache use over replicas")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timed_compare(config: ScenarioConfig, **kw: Any) -> tuple[list[SimResult], float]:
    """:func:`compare` and its wall time."""
    start = time.perf_counter()
    results = compare(config, **kw)
    return results, time.perf_counter() - start
