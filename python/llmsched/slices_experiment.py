"""The token-slice experiment, a scenario of ``llmsched sim``: short requests behind long ones
on one engine, with and without slices.

One simulated vLLM-like engine (4 sequence slots, 14k KV tokens, 20 ms decode steps, 20k
prompt tokens a second) serves 64 requests at 2 a second, a few of them 2000-token prompts
with 1500-token answers and the rest 1000 + 40 tokens. Without slices a short request that
arrives while long ones hold the slots waits for one to finish; with slices the
:class:`~llmsched.slices.SliceTracker` weighs, at every slice boundary, the waiting work
against the switch cost, and a long request that yields keeps its KV as evictable cache
(recomputed on resumption if it was evicted). It is the named scenario ``slices-small``, run by
the simulator's Rust engine like any other.

Run it: ``python -m llmsched.slices_experiment`` (= ``llmsched sim --scenario slices-small``).

>>> results = run_experiment()
>>> none, fixed, mlfq = (short_ttft_p90(r) for r in results)
>>> fixed < none / 4 and mlfq < none / 4
True
"""

from __future__ import annotations

import numpy as np

from llmsched.sim.config import ScenarioConfig
from llmsched.sim.results import SimResult
from llmsched.sim.runner import compare

__all__ = ["SCENARIO", "main", "run_experiment", "short_ttft_p90"]

SCENARIO = "slices-small"
"""The named scenario the experiment is."""

LONG_PROMPT = 2000
"""Prompts at least this long are the long requests."""


def run_experiment(seed: int | None = None) -> list[SimResult]:
    """The scenario's variants (no slices, fixed 128, mlfq 128), in that order."""
    data: dict[str, object] = {"base": SCENARIO}
    if seed is not None:
        data["seed"] = seed
    return compare(ScenarioConfig.from_dict(data), jobs=1, progress=False)


def short_ttft_p90(result: SimResult) -> float:
    """The short requests' TTFT, 90th percentile (seconds)."""
    r = result.requests
    short = r["prompt"] < LONG_PROMPT
    return float(np.percentile((r["first_token"] - r["arrival"])[short], 90))


def main(argv: list[str] | None = None) -> int:
    """``llmsched sim --scenario slices-small`` (extra arguments are passed on)."""
    from llmsched.cli import main as cli_main

    return cli_main(["sim", "--scenario", SCENARIO, "--quiet", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main())
