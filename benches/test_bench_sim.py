"""Simulator benchmarks: the KV cache beside its pure-Python twin; whole simulations on the
reference engine with the native cache and with the twin; the Rust engine beside the reference
engine (simulated requests per wall second in ``extra_info``); a Python ``Policy`` object on
both engines (the Rust engine calls it back; the cost of a call in ``extra_info``); router
replicas in front of 256 engines (the Rust engine only); and a Mooncake-style trace end to end,
its plan built natively beside the plan built by the Python workload classes.

The comparison tables of ``llmsched sim`` report the same rate for the default scenario; here a
smaller agentic run keeps ``make bench`` short.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _timing import median_s, min_s, per_second
from _workload import mooncake_trace

from llmsched import PrefixIndex
from llmsched.reference.sim_kv import ReferenceKvCache
from llmsched.sim import ScenarioConfig, Simulation, fast
from llmsched.sim.kv import make_kv_cache

BLOCKS = 750  # a 12,000-token agentic context in 16-token blocks


def _chains(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    index = PrefixIndex(block_size=16)
    return [index.hash_tokens(rng.integers(0, 128_000, BLOCKS * 16)) for _ in range(n)]


CHAINS = _chains(64)


def _life_cycles(kv, chains) -> int:
    """Admit, fill, cache and free each chain once (the cache is 20 chains big, so it evicts)."""
    hits = 0
    for rid, chain in enumerate(chains):
        hits += kv.start(rid, chain, BLOCKS - 1)
        assert kv.allocate(rid, BLOCKS * 16)
        kv.commit(rid, chain, BLOCKS)
        kv.free(rid)
        kv.take_events()
    return hits


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_kv_cache_life_cycles(benchmark, native: bool) -> None:
    benchmark.group = f"KV cache: 64 request life cycles of {BLOCKS} blocks"
    twice = CHAINS[:32] + CHAINS[:32]

    def setup():
        return (make_kv_cache(BLOCKS * 20, 16, native=native), twice), {}

    kv, _ = setup()[0]
    assert _life_cycles(kv, twice) == 0  # 32 chains do not fit in 20: every one is evicted
    benchmark.pedantic(_life_cycles, setup=setup, rounds=5 if native else 2)
    per_second(benchmark, "blocks_per_s", 64 * BLOCKS)


def test_kv_cache_twin_agrees() -> None:
    native, twin = make_kv_cache(BLOCKS * 40, 16), ReferenceKvCache(BLOCKS * 40, 16)
    chains = CHAINS[:16] + CHAINS[:16]
    assert _life_cycles(native, chains) == _life_cycles(twin, chains) == 16 * (BLOCKS - 1)


AGENTIC = ScenarioConfig.from_dict(
    {"base": "agentic", "workload": {"kind": "agentic", "sessions": 100}}
)


@pytest.mark.parametrize("policy", ["random", "llm-d"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
def test_simulate_agentic(benchmark, policy: str, native: bool) -> None:
    benchmark.group = f"Python engine: simulate agentic, 600 requests, {policy}"

    def run():
        return Simulation(AGENTIC, policy, native_kv=native, engine="python").run().summary()

    summary = run()
    assert summary["completed"] == 600
    benchmark.pedantic(run, rounds=3 if native else 1)
    per_second(benchmark, "sim_requests_per_wall_s", 600)
    benchmark.extra_info["decision_share"] = round(summary["decision_share"], 3)


@pytest.mark.parametrize("policy", ["random", "llm-d"])
@pytest.mark.parametrize("engine", ["rust", "python"])
def test_engines_simulate_agentic(benchmark, policy: str, engine: str) -> None:
    """The Rust engine beside the Python engine (its twin) on the same scenario: both produce
    the same result, so the ratio of the medians is the engine's speed-up."""
    benchmark.group = f"engines: simulate agentic, 600 requests, {policy}"

    def run():
        return Simulation(AGENTIC, policy, engine=engine).run()

    result = run()
    other = Simulation(AGENTIC, policy, engine="python" if engine == "rust" else "rust").run()
    for key in result.requests:
        assert np.array_equal(result.requests[key], other.requests[key]), key
    summary = result.summary()
    assert summary["completed"] == 600 and summary["engine"] == engine
    benchmark.pedantic(run, rounds=5 if engine == "rust" else 2)
    per_second(benchmark, "sim_requests_per_wall_s", 600)
    benchmark.extra_info["decision_share"] = round(summary["decision_share"], 3)


def _variant(base: str, label: str, requests: int) -> ScenarioConfig:
    cfg = ScenarioConfig.from_dict({"base": base})
    workload = {**cfg.workload, "num_requests": requests}
    (variant,) = [
        c
        for name, c in ScenarioConfig.from_dict({"base": base, "workload": workload}).expand()
        if name == label
    ]
    return variant


FEATURES = {
    "flow control": (_variant("priority", "flow control", 1500), "llm-d"),
    "slices mlfq": (_variant("slices", "mlfq 128", 1000), "round-robin"),
    "P/D 2P+6D": (_variant("pd", "2P+6D", 1000), "llm-d-pd"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("engine", ["rust", "python"])
def test_engines_simulate_features(benchmark, feature: str, engine: str) -> None:
    """Flow control, token slices and P/D pools on the Rust engine beside the reference
    engine: the same result, so the ratio of the medians is the speed-up."""
    cfg, policy = FEATURES[feature]
    n = cfg.workload["num_requests"]
    benchmark.group = f"engines: {feature}, {n} requests, {policy}"

    def run():
        return Simulation(cfg, policy, engine=engine).run()

    result = run()
    other = Simulation(cfg, policy, engine="python" if engine == "rust" else "rust").run()
    for key in result.requests:
        assert np.array_equal(result.requests[key], other.requests[key]), key
    assert result.summary()["engine"] == engine
    benchmark.pedantic(run, rounds=3 if engine == "rust" else 1)
    per_second(benchmark, "sim_requests_per_wall_s", n)


# -- router replicas in front of many engines (the Rust engine only: no twin) -----------------

ROUTER_ENGINES = 256
ROUTER_SESSIONS = 400  # 2,400 requests


def _router_replicas(routers: int) -> ScenarioConfig:
    return ScenarioConfig.from_dict(
        {
            "base": "agentic",
            "replicas": ROUTER_ENGINES,
            "kv_events_delay_s": 0.05,
            "workload": {
                "kind": "agentic",
                "sessions": ROUTER_SESSIONS,
                "arrival": {"process": "closed", "concurrency": 10 * ROUTER_ENGINES},
            },
            "router_replicas": routers,
            "router_sync_delay_s": 0.005 if routers > 1 else None,
        }
    )


@pytest.mark.parametrize("routers", [1, 8, 32])
def test_router_replicas_many_engines(benchmark, routers: int) -> None:
    """Agentic sessions over 256 engines through 1, 8 or 32 synced router replicas: the time
    per simulated request. Each replica's pool gets every engine's metrics and its index every
    engine's KV events, so that part grows with the replicas; the scrape before each decision
    (a decode run's KV use) costs O(1) per engine once no block was added since the last."""
    cfg = _router_replicas(routers)
    n = 6 * ROUTER_SESSIONS
    benchmark.group = f"router replicas: agentic, {n:,} requests over {ROUTER_ENGINES} engines"

    def run():
        return Simulation(cfg, "llm-d").run().summary()

    summary = benchmark.pedantic(run, rounds=1 if routers > 8 else 3)
    assert summary["completed"] == n and summary["engine"] == "rust"
    benchmark.extra_info["items"] = n
    benchmark.extra_info["unit"] = "requests"
    median = median_s(benchmark)
    if median is not None:
        benchmark.extra_info["us_per_request"] = round(median / n * 1e6)
    benchmark.extra_info["feed_share"] = round(summary["feed_share"], 3)


# -- a Python Policy object: called back from the Rust engine, or driven by the reference engine


class KeepingRoundRobin:
    """A Python ``Policy`` object that keeps what a policy keeps (each replica's last metrics,
    its own in-flight counts through ``req.handle``) and picks in turn, as the native
    ``round-robin`` router does: both runs give the same result, so the Rust engine's extra
    time over the native router is what the calls cost."""

    name = "py-round-robin"

    def __init__(self, replicas: int) -> None:
        self.metrics = [(0, 0, 0.0)] * replicas
        self.in_flight = [0] * replicas
        self.next = 0
        self.calls = 0

    def update_metrics(self, replica, waiting, running, kv_cache_usage, now) -> None:
        self.calls += 1
        self.metrics[replica] = (waiting, running, kv_cache_usage)

    def pick(self, req, now):
        self.calls += 1
        replica = self.next % len(self.metrics)
        self.next += 1
        self.in_flight[replica] += 1
        req.handle = replica
        return replica, None

    def on_first_token(self, req, now) -> None:
        self.calls += 1

    def on_finished(self, req, now) -> None:
        self.calls += 1
        self.in_flight[req.handle] -= 1


POLICY_SCENARIO = ScenarioConfig.from_dict(
    {"replicas": 8, "workload": {"kind": "long_short", "num_requests": 6000}}
)


def _same(a, b) -> None:
    for key in a.requests:
        assert np.array_equal(a.requests[key], b.requests[key]), key


@pytest.mark.parametrize("engine", ["rust", "python"], ids=["native", "twin"])
def test_engines_simulate_policy_object(benchmark, engine: str) -> None:
    """The same Python Policy object on the Rust engine (called back, the GIL taken for each
    call) and on the reference engine: the same result and the same calls, so the ratio of the
    medians is the speed-up. On the Rust engine, ``us_per_call`` is the run's time beyond the
    same run under the native ``round-robin`` router (the same decisions), per policy call
    (the best run of each)."""
    cfg = POLICY_SCENARIO
    n = cfg.workload["num_requests"]
    benchmark.group = f"engines: a Python Policy object, {n} requests over 8 replicas"
    policies: list[KeepingRoundRobin] = []

    def run():
        policies.append(KeepingRoundRobin(cfg.replicas))
        return Simulation(cfg, policies[-1], engine=engine).run()

    result = run()
    other_policy = KeepingRoundRobin(cfg.replicas)
    other = Simulation(cfg, other_policy, engine="python" if engine == "rust" else "rust").run()
    _same(result, other)
    _same(result, Simulation(cfg, "round-robin", engine="rust").run())
    assert policies[0].calls == other_policy.calls and result.summary()["engine"] == engine
    benchmark.pedantic(run, rounds=5 if engine == "rust" else 1)
    per_second(benchmark, "sim_requests_per_wall_s", n)
    benchmark.extra_info["policy_calls"] = policies[0].calls
    fastest = min_s(benchmark)
    if engine == "rust" and fastest is not None:
        # Best of each (the least disturbed run on a shared machine), the native runs after.
        native = []
        for _ in range(5):
            start = time.perf_counter()
            Simulation(cfg, "round-robin", engine="rust").run()
            native.append(time.perf_counter() - start)
        benchmark.extra_info["native_router_s"] = round(min(native), 4)
        benchmark.extra_info["policy_s"] = round(fastest, 4)
        calls = policies[0].calls
        benchmark.extra_info["us_per_call"] = round((fastest - min(native)) / calls * 1e6, 2)


# -- traces: the plan built natively against the plan built by the Python workload classes ----

TRACE_LINES = 100_000
TWIN_LINES = 2_000  # the Python workload classes keep every shared prefix's tokens: 100k lines
# would need tens of GB


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("trace") / "mooncake.jsonl"
    mooncake_trace(str(path), TRACE_LINES)
    return str(path)


def _trace(path: str, lines: int) -> ScenarioConfig:
    return ScenarioConfig.from_dict(
        {"replicas": 8, "workload": {"kind": "trace", "path": path, "limit": lines}}
    )


def _python_plan(cfg: ScenarioConfig) -> dict:
    return fast.build_plan(cfg.workload, cfg.seed, cfg.engine.block_size, cfg.seed, native=False)


def _end_to_end(cfg: ScenarioConfig):
    fast.clear_plan_cache()  # every round reads the trace and builds the plan
    return Simulation(cfg, "llm-d", engine="rust").run()


@pytest.mark.parametrize("plan", ["native", "twin"])
def test_trace_end_to_end(benchmark, monkeypatch, mooncake: str, plan: str) -> None:
    """The first 2,000 lines of a Mooncake-style trace on the Rust engine, the whole run (trace
    read, plan built, simulated): the plan built natively or by the Python workload classes.
    Both plans give the same result."""
    benchmark.group = f"trace end to end: {TWIN_LINES:,} requests, Rust engine"
    cfg = _trace(mooncake, TWIN_LINES)
    native = _end_to_end(cfg)
    monkeypatch.setattr(fast, "cached_plan", _python_plan)
    monkeypatch.setattr(fast, "trace_build", lambda *args: None)  # no plan built during the run
    twin = _end_to_end(cfg)
    for key in native.requests:
        assert np.array_equal(native.requests[key], twin.requests[key]), key
    if plan == "native":
        monkeypatch.undo()
    result = benchmark.pedantic(_end_to_end, args=(cfg,), rounds=3 if plan == "native" else 1)
    assert result.summary()["completed"] == TWIN_LINES
    per_second(benchmark, "sim_requests_per_wall_s", TWIN_LINES)


def test_trace_100k_end_to_end(benchmark, mooncake: str) -> None:
    """The whole 100,000-line trace end to end on the native plan (no twin: see TWIN_LINES)."""
    benchmark.group = f"trace end to end: {TRACE_LINES:,} requests, Rust engine"
    cfg = _trace(mooncake, TRACE_LINES)
    # One round: a run takes 10-20 s here, and `make bench` is the short pass.
    result = benchmark.pedantic(_end_to_end, args=(cfg,), rounds=1)
    summary = result.summary()
    assert summary["completed"] == TRACE_LINES and summary["engine"] == "rust"
    assert summary["prefix_hit_rate"] > 0.2  # the shared contexts are found
    benchmark.extra_info["items"] = TRACE_LINES
    benchmark.extra_info["unit"] = "requests"
    per_second(benchmark, "sim_requests_per_wall_s", TRACE_LINES)
    plan = fast.cached_plan(cfg)
    benchmark.extra_info["blocks"] = len(plan["hashes"])
