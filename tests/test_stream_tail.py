"""The slow-stream attribution (tools/stream_tail.py): a scheduler trace read into each
thread's waits and each core's runs, and a slow stream's worst hop charged to who waited and
who held the core. The traced loads themselves need perf and run by hand."""

from __future__ import annotations

import pytest

tail = pytest.importorskip("tools.stream_tail")

# Thread 10 (the generator) on core 1 is woken at 1.000100 s while thread 20 (an engine)
# runs there; it runs from 1.000400 s until 1.000450 s. Core 0 runs thread 30 meanwhile.
SCRIPT = """\
      20 [001]     1.000000000:       sched:sched_switch: prev_comm=swapper/1 prev_pid=0 \
prev_prio=120 prev_state=R ==> next_comm=engine next_pid=20 next_prio=120
      30 [000]     1.000050000:       sched:sched_switch: prev_comm=swapper/0 prev_pid=0 \
prev_prio=120 prev_state=R ==> next_comm=gw next_pid=30 next_prio=120
      30 [000]     1.000100000:       sched:sched_waking: comm=gen pid=10 prio=120 target_cpu=001
      20 [001]     1.000400000:       sched:sched_switch: prev_comm=engine prev_pid=20 \
prev_prio=120 prev_state=S ==> next_comm=gen next_pid=10 next_prio=120
      10 [001]     1.000450000:       sched:sched_switch: prev_comm=gen prev_pid=10 \
prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
"""


def test_a_trace_gives_each_thread_its_waits_and_each_core_its_runs() -> None:
    trace = tail.parse(SCRIPT)
    assert trace.threads[10].waits == [(1_000_100_000, 1_000_400_000)]
    assert trace.threads[10].runs == [(1_000_400_000, 1_000_450_000)]
    assert trace.cpu_runs[1] == [
        (1_000_000_000, 1_000_400_000, "engine", 20),
        (1_000_400_000, 1_000_450_000, "gen", 10),
    ]
    assert tail.within(trace.cpu_runs[1], 1_000_420_000, 1_000_430_000) == [
        (1_000_400_000, 1_000_450_000, "gen", 10)
    ]
    assert tail.within(trace.cpu_runs[1], 1_000_500_000, 1_000_600_000) == []


def test_a_slow_streams_worst_hop_is_charged_to_who_waited_and_who_held_the_core() -> None:
    trace = tail.parse(SCRIPT)
    # Started at 0.9999 s, read by the engine 0.1 ms later, its one event sent at 1.0001 s
    # and received at 1.00045 s: the last relay (0.35 ms) is the worst hop.
    stream = {
        "started_ns": 999_900_000,
        "net_ms": 0.5,
        "forward_ms": 0.1,
        "engine_first_ms": 0.1,
        "relay_ms": [0.35],
        "engine_gap_ms": [],
        "tail_ms": 0.05,
    }
    assert tail.worst_hop(stream) == ("last relay", 1_000_100_000, 1_000_450_000)
    who = {"generator": ([10], 1), "gateway": ([30], 0), "engines": ([20], 1)}
    result = tail.attribute([stream], trace, who)
    assert result["worst_hop"] == {"last relay": 1}
    assert result["waiting_in_them_ms"]["generator"] == pytest.approx(0.3)
    assert result["waiting_in_them_ms"]["gateway"] == 0
    # The engine is the load's own, so it is named by its part.
    assert result["core_held_while_waiting_ms"] == {"generator": {"engines's engine": 0.3}}
    # Another process holding the core keeps its own name.
    who = {"generator": ([10], 1), "gateway": ([30], 0)}
    result = tail.attribute([stream], trace, who)
    assert result["core_held_while_waiting_ms"] == {"generator": {"engine": 0.3}}
