"""Flow controller from Python, beside its pure-Python twin (same group, ``_twin`` suffix).

``cycle`` groups time 1,000 request lifecycles (enqueue, dispatch, complete = 3 calls each)
over a standing backlog in 8 priority bands and 1,000 tenants: per-call cost is the time
divided by 3,000. ``test_cycle`` calls the native core with plain arguments (as the twin is
called); ``test_cycle_wrapper`` goes through the friendly ``FlowController`` (a
``FlowRequest`` built per request, keyword arguments). ``depth`` times 1,000 enqueue +
dispatch pairs, then their completions, at 10,000 queued (both) and at 1,000,000 queued
(native only: the naive twin is O(n) per call); the 1,000,000 fixture also reports resident
memory per queued request, measured in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from llmsched._llmsched import FlowCore
from llmsched.flow import FlowController, FlowRequest, resolve_config
from llmsched.reference.flow import FlowControllerTwin

BANDS, TENANTS, LIFECYCLES = 8, 1_000, 1_000
# The twin scans its whole backlog per dispatch (naive on purpose), so it runs a fifth of the
# calls; the summary compares time per call.
TWIN_LIFECYCLES = LIFECYCLES // 5
TENANT_NAMES = [f"tenant-{t}" for t in range(TENANTS)]


def config(fairness: str) -> dict[str, Any]:
    return {
        "saturation": {"type": "concurrency", "max_requests": 10**9},
        "shedding": {"type": "none"},
        "default_band": {
            "max_requests": None,
            "max_bytes": None,
            "ttl_s": None,
            "fairness": {"type": fairness},
        },
    }


class Workload:
    """Deterministic requests spread over bands and tenants; drives any FlowCore-like target."""

    def __init__(self) -> None:
        self.next_id = 0
        self.now = 0.0

    def args(self) -> tuple[Any, ...]:
        self.next_id += 1
        self.now += 1e-6
        mixed = (self.next_id * 0x9E3779B97F4A7C15) & (2**64 - 1)
        priority = (mixed >> 61) % BANDS
        tenant = TENANT_NAMES[(mixed >> 20) % TENANTS]
        return (self.next_id, priority, tenant, 64, 4096, None, None, None, self.now)

    def fill(self, target: Any, count: int) -> None:
        for _ in range(count):
            target.enqueue(*self.args())

    def lifecycles(self, target: Any, count: int) -> int:
        done = 0
        for _ in range(count):
            target.enqueue(*self.args())
            decision = target.dispatch(self.now)
            target.complete(decision.id, 16, self.now)
            done += 1
        return done

    def pairs(self, target: Any, count: int) -> list[int]:
        ids = []
        for _ in range(count):
            target.enqueue(*self.args())
            ids.append(target.dispatch(self.now).id)
        return ids


class WrapperWorkload(Workload):
    """The same requests through the friendly API (FlowRequest objects, keyword calls)."""

    def lifecycles(self, target: Any, count: int) -> int:
        done = 0
        for _ in range(count):
            rid, priority, tenant, tokens, size, *_, now = self.args()
            target.enqueue(FlowRequest(rid, priority, tenant, tokens, size), now=now)
            decision = target.dispatch(now=now)
            target.complete(decision.id, 16, now=now)
            done += 1
        return done


def backlog(target: Any, workload: Workload, count: int) -> Any:
    workload.fill(target, count)
    return target


@pytest.fixture(scope="module")
def twin_backlogs() -> dict[str, tuple[Any, Workload]]:
    """Twins with 10,000 queued, by fairness, shared by the module's twin benchmarks.

    Filling a twin costs O(n^2) (each enqueue rescans its backlog), seconds at 10,000; every
    benchmark leaves as many queued as it found, so one fill serves them all.
    """
    return {}


def twin_backlog(cache: dict[str, tuple[Any, Workload]], fairness: str) -> tuple[Any, Workload]:
    if fairness not in cache:
        workload = Workload()
        twin = backlog(FlowControllerTwin(resolve_config(config(fairness))), workload, 10_000)
        cache[fairness] = (twin, workload)
    return cache[fairness]


@pytest.mark.parametrize("fairness", ["round-robin", "vtc"])
def test_cycle(benchmark: Any, fairness: str) -> None:
    workload = Workload()
    core = backlog(FlowCore(config(fairness)), workload, 10_000)
    assert workload.lifecycles(core, 10) == 10 and len(core) == 10_000
    benchmark.group = f"flow-cycle-{fairness}"
    benchmark.extra_info.update(items=3 * LIFECYCLES, unit="calls")
    assert benchmark(workload.lifecycles, core, LIFECYCLES) == LIFECYCLES


@pytest.mark.parametrize("fairness", ["round-robin", "vtc"])
def test_cycle_wrapper(benchmark: Any, fairness: str) -> None:
    workload = WrapperWorkload()
    ctrl = FlowController(config(fairness))
    backlog(ctrl._core, workload, 10_000)
    assert workload.lifecycles(ctrl, 10) == 10 and len(ctrl) == 10_000
    benchmark.group = f"flow-cycle-{fairness}"
    benchmark.extra_info.update(items=3 * LIFECYCLES, unit="calls")
    assert benchmark(workload.lifecycles, ctrl, LIFECYCLES) == LIFECYCLES


@pytest.mark.parametrize("fairness", ["round-robin", "vtc"])
def test_cycle_twin(
    benchmark: Any, fairness: str, twin_backlogs: dict[str, tuple[Any, Workload]]
) -> None:
    twin, workload = twin_backlog(twin_backlogs, fairness)
    assert workload.lifecycles(twin, 10) == 10 and len(twin) == 10_000
    benchmark.group = f"flow-cycle-{fairness}"
    benchmark.extra_info.update(items=3 * TWIN_LIFECYCLES, unit="calls")
    result = benchmark.pedantic(workload.lifecycles, args=(twin, TWIN_LIFECYCLES), rounds=1)
    assert result == TWIN_LIFECYCLES


_MEMORY_PROBE = """
import json, os, sys
from llmsched._llmsched import FlowCore

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

core = FlowCore(json.loads(sys.argv[1]))
tenants = [f"tenant-{t}" for t in range(1000)]
for i in range(1, 8001):  # every band and flow exists before measuring
    core.enqueue(i, i % 8, tenants[i % 1000], 64, 4096, None, None, None, 0.0)
before = resident()
for i in range(8001, 1_008_001):
    core.enqueue(i, i % 8, tenants[(i * 7919) % 1000], 64, 4096, None, None, None, 0.0)
print((resident() - before) / 1_000_000)
"""


def resident_bytes_per_queued_request() -> float:
    """Measured in a fresh interpreter, so pages freed by earlier benchmarks cannot hide it."""
    probe = [sys.executable, "-c", _MEMORY_PROBE, json.dumps(config("vtc"))]
    return float(subprocess.run(probe, check=True, capture_output=True, text=True).stdout)


@pytest.fixture(scope="module")
def million() -> Iterator[tuple[FlowCore, Workload, float]]:
    workload = Workload()
    core = backlog(FlowCore(config("vtc")), workload, 1_000_000)
    yield core, workload, resident_bytes_per_queued_request()


def _pairs_then_complete(target: Any, workload: Workload, count: int) -> int:
    ids = workload.pairs(target, count)
    for rid in ids:
        target.complete(rid, 16, workload.now)
    return len(ids)


@pytest.mark.benchmark(group="flow-depth")
def test_pairs_at_1m_queued(
    benchmark: Any, million: tuple[FlowCore, Workload, float], capsys: Any
) -> None:
    core, workload, per_request = million
    assert len(core) == 1_000_000
    benchmark.extra_info["resident_bytes_per_queued_request"] = round(per_request)
    with capsys.disabled():
        print(f"\nflow: {per_request:.0f} resident bytes per queued request at 1,000,000 queued")
    benchmark.extra_info.update(items=3_000, unit="calls")
    assert benchmark(_pairs_then_complete, core, workload, 1_000) == 1_000
    assert len(core) == 1_000_000


@pytest.mark.benchmark(group="flow-depth")
def test_pairs_at_10k_queued(benchmark: Any) -> None:
    workload = Workload()
    core = backlog(FlowCore(config("vtc")), workload, 10_000)
    benchmark.extra_info.update(items=3_000, unit="calls")
    assert benchmark(_pairs_then_complete, core, workload, 1_000) == 1_000


@pytest.mark.benchmark(group="flow-depth")
def test_pairs_at_10k_queued_twin(
    benchmark: Any, twin_backlogs: dict[str, tuple[Any, Workload]]
) -> None:
    twin, workload = twin_backlog(twin_backlogs, "vtc")
    assert _pairs_then_complete(twin, workload, 10) == 10
    benchmark.extra_info.update(items=3 * TWIN_LIFECYCLES, unit="calls")
    result = benchmark.pedantic(
        _pairs_then_complete, args=(twin, workload, TWIN_LIFECYCLES), rounds=1
    )
    assert result == TWIN_LIFECYCLES
