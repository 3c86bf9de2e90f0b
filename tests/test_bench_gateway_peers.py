"""The gateway peer benchmark (tools/bench_gateway_peers.py): which rates of a ladder
(``--ladder``) count as held and the highest one each gateway holds; the generator's report
read into figures, the streamed added latency net of the engine (stamped streams) and the
``@base`` rows of another build. The loads themselves run in ``make bench-gateway-peers``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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


def report(net: tuple[float, float] | None, relay: tuple[float, float] | None) -> dict[str, object]:
    """A generator report as `llmsched-loadgen --json` prints it (stamped summaries empty when
    the engine did not stamp)."""

    def summary(q: tuple[float, float] | None) -> dict[str, object]:
        if q is None:
            return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
        return {"n": 10, "mean": q[0], "p50": q[0], "p90": q[1], "p99": q[1], "max": q[1]}

    return {
        "scheduled": 10,
        "ok": 10,
        "errors": {},
        "achieved_rate": 1000.0,
        "latency_ms": summary((9.0, 11.0)),
        "ttft_ms": summary((0.3, 0.9)),
        "itl_ms": summary((1.0, 2.0)),
        "lag_ms": summary((0.1, 1.0)),
        "forward_ms": summary(None if net is None else (0.1, 0.2)),
        "relay_ms": summary(relay),
        "net_latency_ms": summary(net),
        "cpu_ms_per_request": {"gateway": 0.1},
    }


def test_a_report_gives_its_stamped_figures_only_when_stamped() -> None:
    stamped = bench.figures_of(report((0.2, 0.5), (0.05, 0.1)))
    assert (stamped["net_p50"], stamped["net_p99"]) == (0.2, 0.5)
    assert (stamped["relay_p50"], stamped["relay_p99"]) == (0.05, 0.1)
    assert (stamped["latency_p50"], stamped["cpu_ms"], stamped["errors"]) == (9.0, 0.1, 0)
    plain = bench.figures_of(report(None, None))
    assert plain["net_p50"] is None and plain["relay_p99"] is None
    # An older generator without the summaries at all.
    older = report(None, None)
    for key in ("forward_ms", "relay_ms", "net_latency_ms"):
        del older[key]
    assert bench.figures_of(older)["net_p99"] is None


def test_streamed_added_latency_is_the_net_difference_of_each_repeat() -> None:
    results = bench.Results()
    for direct, through in [((0.10, 0.30), (0.20, 0.60)), ((0.12, 0.40), (0.25, 0.50))]:
        results.add(("direct", "stream", 1000.0), bench.figures_of(report(direct, (0.02, 0.05))))
        results.add(("gw", "stream", 1000.0), bench.figures_of(report(through, (0.05, 0.15))))
    (row,) = bench.rows_of(results)
    # Repeats: +0.10 and +0.13 at p50, +0.30 and +0.10 at p99; medians of two.
    assert row.net_added_p50 == pytest.approx(0.115)
    assert row.net_added_p99 == pytest.approx(0.20)
    assert (row.relay_added_p50, row.relay_added_p99) == (pytest.approx(0.03), pytest.approx(0.1))
    assert row.added_p50 == pytest.approx(0.0), "the raw latencies were the same"
    assert "0.115 / 0.200" in bench.table([row])


def test_unstamped_rows_have_no_net_figures() -> None:
    results = bench.Results()
    results.add(("direct", "json", 1000.0), bench.figures_of(report(None, None)))
    results.add(("gw", "json", 1000.0), bench.figures_of(report(None, None)))
    (row,) = bench.rows_of(results)
    assert row.net_added_p50 is None and row.relay_added_p99 is None
    assert "| - / - | - / - |" in bench.table([row])


def test_a_base_row_runs_the_other_build() -> None:
    rows = bench.gateways(
        ["llmsched-serve-native-llm-d", "llmsched-serve-native-round-robin@base"],
        "/new/python",
        None,
        "/nowhere/llmsched-gateway",
        "/main/python",
    )
    assert [r.name for r in rows] == [
        "llmsched-serve-native-llm-d",
        "llmsched-serve-native-round-robin@base",
    ]
    assert rows[0].command[0] == "/new/python" and rows[1].command[0] == "/main/python"
    assert "--data-plane" in rows[1].command and rows[1].mode == "round-robin"
    assert bench._router_of(rows[1].name) == "round-robin"
    with pytest.raises(SystemExit, match="--base-python"):
        bench.gateways(["llmsched-serve-native-llm-d@base"], "py", None, "/nowhere")
    with pytest.raises(SystemExit, match="only llmsched rows"):
        bench.gateways(["direct@base"], "py", None, "/nowhere", "/main/python")


def test_a_native_base_row_runs_the_other_builds_binary(tmp_path: Path) -> None:
    new, base = tmp_path / "new" / "llmsched-gateway", tmp_path / "base" / "llmsched-gateway"
    for binary in (new, base):
        binary.parent.mkdir()
        binary.write_text("")
    rows = bench.gateways(
        ["llmsched-native-round-robin", "llmsched-native-round-robin@base"],
        "py",
        None,
        str(new),
        None,
        str(base),
    )
    assert [r.command for r in rows] == [
        (str(new), "--router", "round-robin"),
        (str(base), "--router", "round-robin"),
    ]
    assert rows[1].name == "llmsched-native-round-robin@base" and rows[1].mode == "round-robin"
    with pytest.raises(SystemExit, match="--base-bin"):
        bench.gateways(["llmsched-native-llm-d@base"], "py", None, str(new))
    with pytest.raises(SystemExit, match="is not built"):
        bench.gateways(["llmsched-native-llm-d@base"], "py", None, str(new), None, "/nowhere")


def test_a_paired_gateway_is_measured_against_the_direct_load_beside_it() -> None:
    results = bench.Results()
    results.add(("direct", "stream", 1000.0), bench.figures_of(report((5.0, 9.0), (1.0, 2.0))))
    results.add(
        (bench.paired_name("gw"), "stream", 1000.0),
        bench.figures_of(report((0.2, 0.4), (0.03, 0.05))),
    )
    results.add(("gw", "stream", 1000.0), bench.figures_of(report((0.3, 0.9), (0.05, 0.25))))
    results.add(("other", "stream", 1000.0), bench.figures_of(report((5.5, 9.5), (1.0, 2.5))))
    rows = {row.gateway: row for row in bench.rows_of(results)}
    assert set(rows) == {"gw", "other"}, "no row for the direct loads themselves"
    assert (rows["gw"].net_added_p50, rows["gw"].net_added_p99) == (
        pytest.approx(0.1),
        pytest.approx(0.5),
    )
    # A gateway without a pair falls back on the direct row.
    assert rows["other"].net_added_p50 == pytest.approx(0.5)


def test_paired_and_ladder_do_not_mix() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--paired", "--ladder", "1000,2000"])


def test_the_scheduling_policy_wraps_every_command_of_the_load() -> None:
    assert bench.scheduled("normal", ["a", "b"]) == ["a", "b"]
    assert bench.scheduled("fifo", ["a"]) == ["chrt", "-f", "1", "a"]
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        bench.scheduled("idle", ["a"])
    load_args = argparse.Namespace(
        seconds=4.0,
        warmup=1.0,
        tokens=8,
        prompt_words=200,
        chat=False,
        responses=False,
        turns=4,
        sched="fifo",
    )
    gen = bench.Path("gen")
    command = bench.load_command(gen, None, ["http://x"], 1000.0, load_args, True, [])
    assert command[:4] == ["chrt", "-f", "1", "gen"] and "--stream" in command
    load_args.sched = "normal"
    command = bench.load_command(gen, None, ["http://x"], 1000.0, load_args, False, [])
    assert command[0] == "gen" and "--stream" not in command
    load_args.responses = True
    command = bench.load_command(gen, None, ["http://x"], 1000.0, load_args, False, [])
    assert command[-3:] == ["--responses", "--turns", "4"]


def test_the_kernel_share_is_the_system_part_of_the_ticks_or_none_when_too_few() -> None:
    assert bench.kernel_share((100, 50), (130, 70)) == pytest.approx(0.4)
    assert bench.kernel_share((0, 0), (10, 9)) is None, "19 ticks cannot tell"
    assert bench.user_system_ticks([]) == (0, 0)
    results = bench.Results()
    for share in (0.4, 0.5, 0.45):
        through = bench.figures_of(report(None, None))
        through["kernel_share"] = share
        results.add(("gw", "json", 1000.0), through)
        results.add(("direct", "json", 1000.0), bench.figures_of(report(None, None)))
    (row,) = bench.rows_of(results)
    assert row.kernel_share == pytest.approx(0.45)
    assert "| 45% |" in bench.table([row])


def test_ticks_are_read_for_a_live_process() -> None:
    user, system = bench.user_system_ticks([os.getpid()])
    assert user + system > 0, "this process has run"
