"""Shared pytest-benchmark conventions for ``benches/``: each figure beside its twin's.

Every hot path is benchmarked twice in one run: the native implementation and its pure-Python
twin from ``llmsched.reference``. At the end of a run with timing enabled (``make bench``) this
conftest prints, for each benchmark group, the median of every benchmark, its throughput when
known, and the ratio twin median / native median of each pair.

Conventions for ``benches/test_bench_<concept>.py`` (reuse them; nothing here is specific to
one concept):

- Put a benchmark and its twin in the same group: ``@pytest.mark.benchmark(group="...")`` or
  ``benchmark.group = "..."`` inside the test, before timing.
- Mark the twin either with a ``_twin`` suffix on the test function (``test_match`` and
  ``test_match_twin``) or with a ``twin`` part in the parameter id (``test_match[twin]`` beside
  ``test_match[native]``; parts are separated by ``-``). A pair is the native and twin
  benchmarks whose names are equal once the ``_twin`` suffix and the ``twin``/``native`` id
  parts are removed.
- For throughput, set ``benchmark.extra_info["items"] = n`` (and optionally
  ``benchmark.extra_info["unit"] = "tokens"``): the summary prints ``n / median`` per second.
- Assert the result before timing it; never assert on timing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

TWIN_SUFFIX = "_twin"
ROLE_PARTS = ("twin", "native")


def pair_key(name: str) -> tuple[str, bool]:
    """The pairing key of a benchmark name and whether it is the twin.

    >>> pair_key("test_match_twin[64-workers]")
    ('test_match[64-workers]', True)
    >>> pair_key("test_match[native-64]")
    ('test_match[64]', False)
    """
    func, _, params = name.partition("[")
    parts = params.rstrip("]").split("-") if params else []
    is_twin = func.endswith(TWIN_SUFFIX) or "twin" in parts
    func = func.removesuffix(TWIN_SUFFIX)
    kept = [p for p in parts if p not in ROLE_PARTS]
    return (f"{func}[{'-'.join(kept)}]" if kept else func), is_twin


def _format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _throughput(bench: Any) -> str:
    items = bench.extra_info.get("items")
    if not items:
        return ""
    unit = bench.extra_info.get("unit", "items")
    return f"  {items / bench.stats.median:.3g} {unit}/s"


def _per_item(bench: Any) -> float:
    """The median per item where the benchmark says how many items a call does.

    A twin may run fewer items than its native pair (a naive twin at full size would take
    most of ``make bench``), so the ratio compares time per item, not per call.
    """
    return float(bench.stats.median) / float(bench.extra_info.get("items") or 1)


def summary_lines(benchmarks: list[Any]) -> list[str]:
    """The summary: per group, each median (and throughput), then each twin/native ratio."""
    groups: dict[str, list[Any]] = defaultdict(list)
    for bench in benchmarks:
        groups[bench.group or "(no group)"].append(bench)
    lines: list[str] = []
    for group in sorted(groups):
        lines.append(f"{group}:")
        pairs: dict[str, dict[bool, Any]] = defaultdict(dict)
        for bench in sorted(groups[group], key=lambda b: b.name):
            key, is_twin = pair_key(bench.name)
            pairs[key][is_twin] = bench
            median = _format_seconds(bench.stats.median)
            lines.append(f"  {bench.name:<48} median {median:>9}{_throughput(bench)}")
        for key, pair in sorted(pairs.items()):
            if True in pair and False in pair:
                ratio = _per_item(pair[True]) / _per_item(pair[False])
                lines.append(f"  -> twin/native {key}: {ratio:,.1f}x")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Print :func:`summary_lines` after pytest-benchmark's own tables."""
    session = getattr(config, "_benchmarksession", None)
    benchmarks = [b for b in getattr(session, "benchmarks", []) if b and not b.has_error]
    if not benchmarks:
        return
    terminalreporter.section("native vs pure-Python twin (median)")
    for line in summary_lines(benchmarks):
        terminalreporter.write_line(line)
