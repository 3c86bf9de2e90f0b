"""The gateway peer benchmark's rate ladder (tools/bench_gateway_peers.py ``--ladder``): which
rates count as held and the highest one each gateway holds. The loads themselves run in
``make bench-gateway-peers``."""

from __future__ import annotations

import argparse

import pytest

bench = pytest.importorskip("tools.bench_gateway_peers")


def figures(p99: float, errors: int = 0, cpu: float = 0.1, rate: float = 1000) -> object:
    return bench.Figures(
        ok=int(rate * 2) - errors,
        errors=errors,
        error_kinds={"timeout": errors} if errors else {},
        cpu_ms=cpu,
        latency_p50=p99 / 4,
        latency_p99=p99,
        ttft_p50=0.5,
        itl_p99=1.0,
        achieved_rate=rate,
        lag_p99=0.2,
    )


def args(repeats: int = 2) -> argparse.Namespace:
    return argparse.Namespace(repeats=repeats, seconds=2.0, ladder_p99_ms=50.0)


@pytest.mark.parametrize(
    ("p99", "errors", "held"),
    [(49.9, 0, True), (50.0, 0, False), (3.0, 1, False), (80.0, 2, False)],
)
def test_a_rate_is_held_under_the_bound_without_errors(p99: float, errors: int, held: bool) -> None:
    assert bench.holds(figures(p99, errors), 50.0) is held


def test_the_highest_rate_held_needs_every_repeat_and_every_rate_below() -> None:
    results = bench.Results()
    for rate, p99s in [(1000, (5, 6)), (2000, (8, 9)), (3000, (70, 9)), (4000, (9, 9))]:
        for p99 in p99s:
            results.add(("gw", "json", rate), figures(p99, rate=rate))
    # 2000 held in both repeats; 3000 lost in one; 4000 held, but above a rate lost.
    results.add(("solo", "json", 1000), figures(5))  # one repeat of two: not held
    steps = bench.ladder_steps(results, args())
    held = {(s.gateway, s.rate): s.held for s in steps}
    assert held == {
        ("gw", 1000): True,
        ("gw", 2000): True,
        ("gw", 3000): False,
        ("gw", 4000): True,
        ("solo", 1000): False,
    }
    text = bench.ladder_table(steps, 50.0)
    assert "| json | gw | 2000 | 0.100 |" in text
    assert "| json | solo | none | - |" in text
    # The share of the gateway's core: 0.1 ms per request at 2,000/s is 20 %.
    assert "| json | gw | 2000 | 2000.000 | 2000.000 | 0 | 2.125 / 8.500 | 0.100 | 20 |" in text


def test_a_ladder_of_rates_is_checked() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--ladder", "1000,fast", "--gateways", "direct"])
    with pytest.raises(SystemExit):
        bench.main(["--ladder", "0,1000", "--gateways", "direct"])
