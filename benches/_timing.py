"""Reading a benchmark's timings, which exist only when timing is on.

``pyproject.toml`` disables pytest-benchmark's timing by default (``--benchmark-disable``): the
test suite and a plain ``pytest benches`` then run each benchmarked function once, checked, and
``benchmark.stats`` is ``None``. ``make bench`` turns timing on. Derived figures go into
``extra_info`` only when there are timings to derive them from.
"""

from __future__ import annotations

from typing import Any


def median_s(benchmark: Any) -> float | None:
    """The median time of ``benchmark``'s rounds in seconds, ``None`` when timing is off."""
    return None if benchmark.stats is None else float(benchmark.stats.stats.median)


def min_s(benchmark: Any) -> float | None:
    """The fastest of ``benchmark``'s rounds in seconds, ``None`` when timing is off."""
    return None if benchmark.stats is None else float(benchmark.stats.stats.min)


def per_second(benchmark: Any, key: str, count: float, *, rounded: bool = True) -> None:
    """Store ``count`` over the median time (rounded to an int unless ``rounded`` is false)
    as ``extra_info[key]`` when timing is on."""
    median = median_s(benchmark)
    if median is not None:
        rate = count / median
        benchmark.extra_info[key] = round(rate) if rounded else rate
