"""The Rust engine against its oracle, the Python engine: the same scenario and seed give the
same requests, timings and counters, bit for bit; and scenarios the Rust engine does not
cover run on the reference engine visibly (a warning, a count, the reason in the result)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsched.errors import ConfigError
from llmsched.sim import ScenarioConfig, Simulation, fallback_counts, fast
from llmsched.sim.fast import build_plan, unsupported
from llmsched.sim.results import SimResult


def _rid(replica: Any) -> int | None:
    """A replica as a number: the reference engine's Request holds its Replica objects."""
    return getattr(replica, "id", replica)


class LoggingPolicy:
    """A stateful Python Policy object that logs every call with what it read.

    It keeps the last metrics of each replica and its own in-flight counts (through
    ``req.handle``, which must survive from ``pick`` to ``on_finished``) and sends each request
    to the decode replica with the least ``waiting + running + in flight + kv`` (ties broken by
    the request's id, tenant and prompt hashes). With ``split`` and prefill replicas, prompts of
    at least ``split`` tokens prefill on the least loaded prefill replica (a prefill replica
    returned from ``pick``); others run whole, and every seventh on a prefill replica.
    """

    def __init__(self, replicas: int, prefill_replicas: int, split: int | None) -> None:
        self.name = f"logging-{split}"
        self.prefill = prefill_replicas
        self.split = split
        self.metrics = [(0, 0, 0.0)] * replicas
        self.in_flight = [0] * replicas
        self.splits = 0
        self.log: list[tuple[Any, ...]] = []

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
    ) -> None:
        self.metrics[replica] = (waiting, running, kv_cache_usage)
        self.log.append(("metrics", replica, waiting, running, kv_cache_usage, now))

    def _read(self, req: Any) -> tuple[Any, ...]:
        hashes = req.hashes
        return (
            req.id,
            req.arrival,
            req.prompt_len,
            req.output_len,
            len(hashes),
            hash(hashes.tobytes()),
            req.tenant,
            req.priority,
            _sid(req.session),
            req.turn,
            req.phase,
            req.finished,
            req.target,
            req.computed,
            req.generated,
            req.kv_ready,
            req.dispatched,
            req.first_token_time,
            req.finish_time,
            req.cached_tokens,
            req.prefilled_tokens,
            req.recomputed_tokens,
            req.preemptions,
            req.rejected,
            req.call_end,
            req.slice_start,
            _rid(req.replica),
            _rid(req.prefill_replica),
            _rid(req.decode_replica),
        )

    def _least(self, replicas: range, key: int) -> int:
        def load(r: int) -> tuple[float, int]:
            waiting, running, kv = self.metrics[r]
            return (waiting + running + self.in_flight[r] + kv, (r + key) % len(replicas))

        return min(replicas, key=load)

    def pick(self, req: Any, now: float) -> tuple[int, int | None]:
        self.log.append(("pick", now, self._read(req)))
        n = len(self.metrics)
        key = req.id + 3 * req.tenant + int(req.hashes[:1].sum() % 5)
        decode = self._least(range(self.prefill, n), key)
        prefill = None
        if self.prefill and self.split is not None:
            if req.prompt_len >= self.split:
                prefill = self._least(range(self.prefill), key)
                self.splits += 1
            elif req.id % 7 == 0:
                decode = req.id % self.prefill
        elif self.prefill and req.id % 5 == 0:
            prefill = decode  # the same replica twice: served whole there
        self.in_flight[decode] += 1
        req.handle = decode
        return decode, prefill

    def on_first_token(self, req: Any, now: float) -> None:
        self.log.append(("first", now, self._read(req), req.handle))

    def on_finished(self, req: Any, now: float) -> None:
        self.log.append(("finished", now, self._read(req), req.handle))
        self.in_flight[req.handle] -= 1


class Logging:
    """Makes a fresh :class:`LoggingPolicy` for each engine (a policy keeps state)."""

    def __init__(self, split: int | None) -> None:
        self.split = split

    def __call__(self, cfg: ScenarioConfig) -> LoggingPolicy:
        return LoggingPolicy(cfg.replicas, cfg.pd.prefill_replicas, self.split)

    def __repr__(self) -> str:
        return f"Logging({self.split})"


POLICIES: list[Any] = [
    "random",
    "round-robin",
    "least-load",
    "prefix-only",
    "llm-d",
    "sglang-cache-aware",
    "dynamo-kv",
    Logging(None),
    Logging(200),
]


def both(cfg: ScenarioConfig, policy: Any) -> tuple[Simulation, SimResult, Simulation, SimResult]:
    py = Simulation(cfg, policy(cfg) if isinstance(policy, Logging) else policy, engine="python")
    py_result = py.run()
    rs = Simulation(cfg, policy(cfg) if isinstance(policy, Logging) else policy, engine="rust")
    rs_result = rs.run()
    return py, py_result, rs, rs_result


def assert_same(cfg: ScenarioConfig, policy: Any) -> None:
    py, a, rs, b = both(cfg, policy)
    assert (a.engine_name, b.engine_name) == ("python", "rust")
    if isinstance(policy, Logging):
        # The same calls, in the same order, with the same arguments and request fields.
        assert isinstance(py.policy, LoggingPolicy) and isinstance(rs.policy, LoggingPolicy)
        assert py.policy.log == rs.policy.log
        picks = sum(1 for entry in rs.policy.log if entry[0] == "pick")
        assert picks >= sum(1 for r in rs.done if r.dispatched >= 0)  # in flight at the end too
        assert py.policy.in_flight == rs.policy.in_flight
    for key in a.requests:
        np.testing.assert_array_equal(a.requests[key], b.requests[key], err_msg=key)
    assert a.engine == b.engine
    assert (a.rejected, a.rejected_by_priority) == (b.rejected, b.rejected_by_priority)
    assert [list(t) for t in a.kv_trace] == [list(t) for t in b.kv_trace]
    assert py.feed_skipped == rs.feed_skipped
    assert py.now == rs.now
    assert py.slice_switches == rs.slice_switches
    # Sessions by number (agentic); a trace's session names stay in the plan.
    rows = [
        (r.id, _sid(r.session), r.turn, r.dispatched, r.generated, r.preemptions, r.rejected)
        for r in py.done
    ]
    assert rows == [
        (r.id, r.session, r.turn, r.dispatched, r.generated, r.preemptions, r.rejected)
        for r in rs.done
    ]
    for p, r in zip(py.replicas, rs.replicas, strict=True):
        assert (p.kv.requests(), p.kv.usage(), p.decode_n, p.decode_ctx, p.steps) == (
            r.kv.requests(),
            r.kv.usage(),
            r.decode_n,
            r.decode_ctx,
            r.steps,
        )
        # KV use over the run: the peak and the time-weighted mean, bit for bit.
        assert (p.kv.peak, p.kv.mean) == (r.kv.peak, r.kv.mean)
    assert a.summary().get("kv_use") == b.summary().get("kv_use")


def _sid(session: Any) -> int | None:
    return session if isinstance(session, int) else None


WORKLOADS = st.one_of(
    st.fixed_dictionaries(
        {
            "kind": st.just("long_short"),
            "num_requests": st.integers(1, 120),
            "long_fraction": st.sampled_from([0.0, 0.2, 0.5]),
            "long_input": st.integers(500, 6000),
            "short_input": st.integers(1, 800),
            "short_output": st.integers(1, 200),
            "arrival": st.fixed_dictionaries(
                {
                    "process": st.sampled_from(["poisson", "gamma", "constant"]),
                    "rate": st.floats(2.0, 80.0),
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "kind": st.just("shared_prefix"),
            "num_requests": st.integers(1, 120),
            "num_groups": st.integers(1, 6),
            "num_prompts_per_group": st.integers(1, 3),
            "system_prompt_len": st.integers(16, 2000),
            "question_len": st.integers(1, 300),
            "output_len": st.integers(1, 120),
            "arrival": st.fixed_dictionaries({"rate": st.floats(2.0, 60.0)}),
        }
    ),
    st.fixed_dictionaries(
        {
            "kind": st.just("agentic"),
            "sessions": st.integers(1, 12),
            "first_input": st.integers(600, 3000),
            "first_output": st.integers(1, 200),
            "followup_turns": st.integers(0, 3),
            "followup_input": st.integers(1, 300),
            "followup_output": st.integers(1, 100),
            "system_prompt_len": st.integers(1, 500),
            "think_time_s": st.sampled_from([0.0, 0.5, 2.0]),
            "arrival": st.one_of(
                st.fixed_dictionaries(
                    {"process": st.just("closed"), "concurrency": st.integers(1, 8)}
                ),
                st.fixed_dictionaries(
                    {"process": st.just("poisson"), "rate": st.floats(0.5, 10.0)}
                ),
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "kind": st.just("priority"),
            "num_requests": st.integers(1, 120),
            "arrival": st.fixed_dictionaries({"rate": st.floats(2.0, 60.0)}),
        }
    ),
)

STEP_MODELS = st.one_of(
    st.fixed_dictionaries(
        {"model": st.sampled_from(["llama-3.1-8b", "qwen2.5-32b", "qwen3-30b-a3b"])}
    ),
    st.fixed_dictionaries(
        {
            "model": st.sampled_from(["llama-3.1-8b", "qwen3-30b-a3b"]),
            "roofline": st.fixed_dictionaries(
                {
                    "prefill_request_s": st.sampled_from([1e-4, 2e-3]),
                    "idle_start_s": st.sampled_from([0.0, 3e-3]),
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "linear": st.fixed_dictionaries(
                {
                    "b0": st.floats(0.0, 0.01),
                    "b1": st.floats(1e-6, 1e-4),
                    "b2": st.floats(0.0, 1e-3),
                    "b3": st.sampled_from([0.0, 1e-9]),
                    "b4": st.sampled_from([0.0, 1e-7]),
                    "b5": st.sampled_from([0.0, 5e-4]),
                    "b6": st.sampled_from([0.0, 4e-3]),
                }
            ),
            "profile": st.none(),
        }
    ),
)

SCENARIOS = st.fixed_dictionaries(
    {
        "replicas": st.integers(1, 4),
        "seed": st.integers(0, 2**32),
        "metrics_delay_s": st.sampled_from([0.0, 0.05, 0.3]),
        "kv_events_delay_s": st.sampled_from([0.0, 0.2]),
        "kv_sample_s": st.sampled_from([0.1, 1.0]),
        "max_time_s": st.sampled_from([None, None, 5.0]),
        "step_model": STEP_MODELS,
        "engine": st.fixed_dictionaries(
            {
                "block_size": st.sampled_from([16, 32]),
                # Small caches force preemption, eviction and refusals.
                "kv_tokens": st.sampled_from([1_000, 4_000, 20_000, 200_000]),
                "max_num_batched_tokens": st.sampled_from([256, 2048, 8192]),
                "max_num_seqs": st.sampled_from([2, 16, 256]),
                "scheduling": st.sampled_from(["fcfs", "priority"]),
            }
        ),
        "workload": WORKLOADS,
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=SCENARIOS, policy=st.sampled_from(POLICIES))
def test_rust_engine_equals_python_engine(scenario: dict[str, Any], policy: Any) -> None:
    assert_same(ScenarioConfig.from_dict(scenario), policy)


POLICY_SPECS = st.one_of(
    st.just({"type": "strict"}),
    st.just({"type": "round-robin"}),
    st.just({"type": "vtc"}),
    st.just({"type": "las"}),
)
ORDERINGS = st.sampled_from([{"type": "fcfs"}, {"type": "edf"}, {"type": "slo-deadline"}])
BAND = st.fixed_dictionaries(
    {},
    optional={
        "max_requests": st.integers(1, 60),
        "ttl_s": st.sampled_from([0.2, 2.0, 60.0]),
        "fairness": POLICY_SPECS,
        "ordering": ORDERINGS,
    },
)
FLOW_CONFIGS = st.fixed_dictionaries(
    {},
    optional={
        "saturation": st.one_of(
            st.fixed_dictionaries(
                {"type": st.just("concurrency"), "max_requests": st.integers(1, 40)}
            ),
            st.fixed_dictionaries(
                {
                    "type": st.just("utilization"),
                    "stale_policy": st.just("last"),
                    "queue_threshold": st.sampled_from([1.0, 5.0]),
                    "kv_threshold": st.sampled_from([0.3, 0.8]),
                }
            ),
        ),
        "default_band": BAND,
        "bands": st.lists(
            st.builds(lambda p, b: {"priority": p, **b}, st.sampled_from([-1, 1]), BAND),
            max_size=2,
            unique_by=lambda b: b["priority"],
        ),
        "global": st.fixed_dictionaries({"max_requests": st.integers(1, 80)}),
        "shedding": st.one_of(
            st.just({"type": "none"}),
            st.fixed_dictionaries(
                {"type": st.just("probabilistic"), "seed": st.integers(0, 9), "scale": st.just(3.0)}
            ),
        ),
        "preemption": st.fixed_dictionaries({"evict_queued": st.booleans()}),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=SCENARIOS, flow=FLOW_CONFIGS, policy=st.sampled_from(POLICIES))
def test_engines_agree_under_flow_control(
    scenario: dict[str, Any], flow: dict[str, Any], policy: Any
) -> None:
    """Flow control (the flow core in both engines): bands, fairness, ordering, capacity,
    saturation, shedding, TTLs and evictions give the same dispatches and refusals."""
    cfg = ScenarioConfig.from_dict({**scenario, "flow": {"enabled": True, "config": flow}})
    assert unsupported(cfg, policy) is None
    assert_same(cfg, policy)


PD_POLICIES: list[Any] = ["llm-d-pd", "round-robin", "llm-d", Logging(None), Logging(200)]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=SCENARIOS,
    pd=st.fixed_dictionaries(
        {
            "prefill_replicas": st.integers(1, 3),
            "transfer_bw": st.sampled_from([1e9, 25e9]),
            "transfer_latency_s": st.sampled_from([0.0, 1e-3, 0.05]),
            "kv_bytes_per_token": st.sampled_from([None, 4096]),
        }
    ),
    flow=st.one_of(st.none(), FLOW_CONFIGS),
    policy=st.sampled_from(PD_POLICIES),
)
def test_engines_agree_on_prefill_decode_pools(
    scenario: dict[str, Any], pd: dict[str, Any], flow: dict[str, Any] | None, policy: Any
) -> None:
    """P/D pools: split requests prefill on one replica, move their KV and decode on another,
    with the same timings on both engines (flow control in front or not)."""
    spec = {**scenario, "replicas": max(scenario["replicas"], pd["prefill_replicas"] + 1)}
    spec["pd"] = pd
    if flow is not None:
        spec["flow"] = {"enabled": True, "config": flow}
    cfg = ScenarioConfig.from_dict(spec)
    assert unsupported(cfg, policy) is None
    assert_same(cfg, policy)


SLICES = st.one_of(
    st.fixed_dictionaries(
        {
            "policy": st.just("fixed"),
            "params": st.fixed_dictionaries({"slice_tokens": st.integers(1, 300)}),
        }
    ),
    st.fixed_dictionaries(
        {
            "policy": st.just("mlfq"),
            "params": st.fixed_dictionaries(
                {"base_quantum": st.integers(1, 200)},
                optional={
                    "levels": st.integers(1, 4),
                    "promote_after_s": st.sampled_from([0.5, 30.0]),
                },
            ),
        }
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=SCENARIOS,
    slices=SLICES,
    flow=st.one_of(st.none(), FLOW_CONFIGS),
    prefill=st.sampled_from([0, 0, 1]),
    policy=st.sampled_from(POLICIES),
)
def test_engines_agree_on_token_slices(
    scenario: dict[str, Any],
    slices: dict[str, Any],
    flow: dict[str, Any] | None,
    prefill: int,
    policy: Any,
) -> None:
    """Token slices (the slice core in both engines): continues, yields and migrations at the
    same boundaries, with flow control and P/D pools or without."""
    spec = {**scenario, "slices": slices}
    if flow is not None:
        spec["flow"] = {"enabled": True, "config": flow}
    if prefill:
        spec["replicas"] = max(2, scenario["replicas"])
        spec["pd"] = {"prefill_replicas": prefill}
        if not isinstance(policy, Logging):
            policy = "llm-d-pd"
    cfg = ScenarioConfig.from_dict(spec)
    assert unsupported(cfg, policy) is None
    assert_same(cfg, policy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=SCENARIOS,
    prefill=st.sampled_from([0, 1, 2]),
    extra=st.one_of(
        st.none(),
        FLOW_CONFIGS.map(lambda f: {"flow": {"enabled": True, "config": f}}),
        SLICES.map(lambda s: {"slices": s}),
    ),
    policy=st.sampled_from([Logging(None), Logging(200), Logging(1)]),
)
def test_engines_agree_on_policy_objects(
    scenario: dict[str, Any], prefill: int, extra: dict[str, Any] | None, policy: Logging
) -> None:
    """Python Policy objects: the Rust engine calls them where the reference engine does (the
    call logs are equal) and both give the same result, over P/D pools (split requests, whole
    ones on prefill replicas), flow control and token slices."""
    spec = {**scenario, **(extra or {})}
    if prefill:
        spec["replicas"] = max(scenario["replicas"], prefill + 1)
        spec["pd"] = {"prefill_replicas": prefill}
    cfg = ScenarioConfig.from_dict(spec)
    assert unsupported(cfg, policy(cfg)) is None
    assert_same(cfg, policy)


def test_a_policy_object_splits_requests_over_pools() -> None:
    """A Policy object that returns prefill replicas: the requests it splits prefill on one
    replica and decode on another, the same on both engines."""
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 4,
            "pd": {"prefill_replicas": 2},
            "workload": {"kind": "long_short", "num_requests": 80, "long_fraction": 0.5},
        }
    )
    assert_same(cfg, Logging(1000))
    policy = Logging(1000)(cfg)
    result = Simulation(cfg, policy).run()
    assert result.engine_name == "rust" and 0 < policy.splits < 80
    assert sum(1 for entry in policy.log if entry[0] == "pick") == 80


def test_slice_boundaries_weigh_requests_dispatched_during_the_step() -> None:
    """Flow control lets a request go when another finishes inside a replica's step; the slice
    boundaries later in that step see it in the replica's queue on both engines (one-token
    slices: every boundary asks)."""
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 1,
            "seed": 0,
            "metrics_delay_s": 0.0,
            "kv_events_delay_s": 0.0,
            "kv_sample_s": 0.1,
            "step_model": {"model": "llama-3.1-8b"},
            "workload": {
                "kind": "priority",
                "arrival": {"rate": 17.742235570175474},
                "num_requests": 46,
            },
            "engine": {
                "block_size": 16,
                "scheduling": "fcfs",
                "kv_tokens": 200_000,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 256,
            },
            "slices": {"policy": "fixed", "params": {"slice_tokens": 1}},
            "flow": {
                "enabled": True,
                "config": {
                    "preemption": {"evict_queued": False},
                    "shedding": {"type": "none"},
                    "saturation": {"type": "concurrency", "max_requests": 35},
                },
            },
        }
    )
    assert_same(cfg, "random")
    assert Simulation(cfg, "random").run().engine_name == "rust"


@pytest.mark.parametrize("variant", [1, 2])
def test_slices_scenario_on_both_engines(variant: int) -> None:
    """docs/simulator.md's slices scenario (scaled down): fixed and mlfq slices, equal."""
    cfg = ScenarioConfig.from_dict(
        {"base": "slices", "workload": {"kind": "long_short", "num_requests": 500}}
    )
    label, sliced = cfg.expand()[variant]
    assert sliced.slices.policy
    assert_same(sliced, "round-robin")
    sim = Simulation(sliced, "round-robin")
    sim.run()
    assert sim.engine == "rust" and sim.slice_switches > 0, label


def test_pd_scenario_on_both_engines() -> None:
    """docs/simulator.md's P/D scenario (scaled down): 2P+6D on both engines, equal, and split."""
    cfg = ScenarioConfig.from_dict(
        {"base": "pd", "workload": {"kind": "long_short", "num_requests": 600}}
    )
    label, split = cfg.expand()[1]
    assert label == "2P+6D"
    assert_same(split, "llm-d-pd")
    sim = Simulation(split, "llm-d-pd")
    sim.run()
    assert sim.engine == "rust"
    assert sum(rep.prefill_tokens for rep in sim.replicas[:2]) > 0


def test_priority_scenario_with_flow_control_on_both_engines() -> None:
    """docs/simulator.md's priority scenario (scaled down): flow control on both engines, equal."""
    cfg = ScenarioConfig.from_dict(
        {
            "base": "priority",
            "workload": {"kind": "priority", "num_requests": 1500, "arrival": {"rate": 24.0}},
        }
    )
    label, flow = cfg.expand()[1]
    assert label == "flow control" and flow.flow.enabled
    assert_same(flow, "llm-d")


@st.composite
def trace_lines(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Trace lines: some with Mooncake hash_ids over a few shared contexts (covering the whole
    prompt, or all but its last block), some without."""
    lines = []
    for i in range(draw(st.integers(1, 40))):
        prompt = draw(st.integers(1, 3000))
        line: dict[str, Any] = {
            "timestamp": draw(st.integers(0, 20_000)),
            "input_length": prompt,
            "output_length": draw(st.integers(0, 200)),
        }
        if draw(st.booleans()):
            need = max(0, -(-prompt // 512) - draw(st.integers(0, 1)))
            shared = min(need, draw(st.integers(0, 6)))
            context = 100 * draw(st.integers(0, 2))
            line["hash_ids"] = [context + k for k in range(shared)] + [
                10_000 + 10 * i + k for k in range(need - shared)
            ]
        lines.append(line)
    return lines


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=trace_lines(),
    scenario=SCENARIOS,
    policy=st.sampled_from(POLICIES),
)
def test_engines_agree_on_traces(lines: list[dict[str, Any]], scenario, policy: str) -> None:
    """Traces too: the Rust engine's native plan and the Python engine's workload agree."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        spec = {**scenario, "workload": {"kind": "trace", "path": str(path)}}
        assert_same(ScenarioConfig.from_dict(spec), policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_default_scenario_shape_equal(policy: str) -> None:
    """The default scenario, scaled down: every preset routes identically on both engines."""
    cfg = ScenarioConfig.from_dict(
        {"base": "agentic", "workload": {"kind": "agentic", "sessions": 40}}
    )
    assert_same(cfg, policy)


def test_trace_workload_with_sessions(tmp_path) -> None:
    rows = [
        json.dumps(
            {
                "timestamp": i * 50,
                "input_length": 900 + i,
                "output_length": 20,
                "hash_ids": list(range(i % 3 + 1)),
                "session": f"s{i % 4}",
            }
        )
        for i in range(40)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(rows))
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 2,
            "workload": {"kind": "trace", "path": str(path), "timestamp_unit": "ms"},
        }
    )
    assert_same(cfg, "llm-d")


@pytest.mark.parametrize("hash_ids", [True, False])
def test_mooncake_style_trace_on_both_engines(tmp_path, hash_ids: bool) -> None:
    """Traces with and without hash_ids (long prompts included): the Rust engine replays the
    native plan, the Python engine the Python workload, with the same result."""
    rng = np.random.default_rng(2)
    rows = []
    for i in range(80):
        prompt = int(rng.integers(100, 4000))
        row = {
            "timestamp": i * 40,
            "input_length": prompt,
            "output_length": int(rng.integers(1, 60)),
        }
        if hash_ids:
            need = -(-prompt // 512)
            shared = list(range(int(rng.integers(0, need + 1))))
            row["hash_ids"] = shared + [100 + 10 * i + k for k in range(need - len(shared))]
        rows.append(json.dumps(row))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(rows))
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 3,
            "engine": {"kv_tokens": 20_000},
            "workload": {"kind": "trace", "path": str(path)},
        }
    )
    assert_same(cfg, "llm-d")


def test_policy_given_as_config_dict() -> None:
    cfg = ScenarioConfig.from_dict(
        {"replicas": 3, "workload": {"kind": "long_short", "num_requests": 80}}
    )
    policy = {
        "name": "queue-only",
        "config": {
            "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
                }
            ],
        },
    }
    assert_same(cfg, policy)
    assert Simulation(cfg, policy).run().policy == "queue-only"


def _scorer(request: dict[str, Any], endpoints: list[dict[str, Any]]) -> list[float]:
    return [1.0 for _ in endpoints]


class _PolicyObject:
    """A Policy object: round robin over the replicas, in Python."""

    name = "python-round-robin"

    def __init__(self) -> None:
        self.next = 0

    def update_metrics(self, replica, waiting, running, kv_cache_usage, now) -> None:
        pass

    def pick(self, req, now):
        self.next += 1
        return (self.next - 1) % 2, None

    def on_first_token(self, req, now) -> None:
        pass

    def on_finished(self, req, now) -> None:
        pass


def test_python_plugins_run_on_the_rust_engine_through_a_callback() -> None:
    """A python-scorer plugin is called back from the Rust engine, once per decision, with
    the same decisions as on the reference engine."""
    calls = {"n": 0}

    def prefer_short_queues(
        request: dict[str, Any], endpoints: list[dict[str, Any]]
    ) -> list[float]:
        calls["n"] += 1
        return [1.0 / (1.0 + e["waiting"] + e["in_flight_requests"]) for e in endpoints]

    policy = {
        "name": "python-queue",
        "config": {
            "plugins": [
                {
                    "type": "python-scorer",
                    "name": "q",
                    "parameters": {"function": prefer_short_queues},
                },
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "q"}]}],
        },
    }
    cfg = ScenarioConfig.from_dict(
        {"replicas": 3, "workload": {"kind": "long_short", "num_requests": 120}}
    )
    assert unsupported(cfg, policy) is None
    assert_same(cfg, policy)
    calls["n"] = 0
    result = Simulation(cfg, policy).run()
    assert result.engine_name == "rust" and calls["n"] == 120


FALLBACKS = [
    ({"pd": {"prefill_replicas": 1}}, "llm-d-pd", None),
    ({"engine": {"scheduling": "priority"}}, "llm-d", None),
    ({"flow": {"enabled": True}}, "llm-d", None),
    ({"slices": {"policy": "fixed", "params": {"slice_tokens": 64}}}, "llm-d", None),
    (
        {},
        {
            "name": "custom",
            "config": {
                "plugins": [
                    {"type": "python-scorer", "name": "mine", "parameters": {"function": _scorer}},
                    {"type": "max-score-picker"},
                ],
                "schedulingProfiles": [
                    {"name": "default", "plugins": [{"pluginRef": "mine"}]},
                ],
            },
        },
        None,
    ),
    ({}, _PolicyObject(), None),
    ({"native_kv": False}, _PolicyObject(), "the pure-Python KV cache twin"),
]


@pytest.mark.parametrize(("over", "policy", "reason"), FALLBACKS)
def test_uncovered_scenarios_fall_back_visibly(
    over: dict, policy: Any, reason: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    data = {"replicas": 2, "workload": {"kind": "long_short", "num_requests": 30}}
    over = dict(over)
    native_kv = over.pop("native_kv", True)
    data.update(over)
    cfg = ScenarioConfig.from_dict(data)
    assert unsupported(cfg, policy, native_kv) == reason
    sim = Simulation(cfg, policy, native_kv=native_kv)
    expected = "rust" if reason is None else "python"
    assert (sim.engine, sim.fallback_reason) == (expected, reason)
    before = fallback_counts().get(reason or "", 0)
    with caplog.at_level(logging.WARNING, logger="llmsched"):
        summary = sim.run().summary()
    assert summary["engine"] == expected
    assert summary.get("engine_fallback") == reason
    if reason is None:
        assert "reference engine" not in caplog.text
    else:
        # Counted every time; the warning names the reason (once per process).
        assert fallback_counts()[reason] == before + 1
        assert reason in caplog.text or before > 0
        with pytest.raises(ConfigError, match=reason):
            Simulation(cfg, policy, engine="rust", native_kv=native_kv)


def test_policy_objects_and_the_kv_twin_run_on_python() -> None:
    cfg = ScenarioConfig.from_dict({"replicas": 1, "workload": {"kind": "long_short"}})
    assert Simulation(cfg, "llm-d", native_kv=False).fallback_reason == (
        "the pure-Python KV cache twin"
    )
    assert Simulation(cfg, "llm-d", engine="python").fallback_reason is None


def test_bad_engine_and_policy_names_raise() -> None:
    cfg = ScenarioConfig.from_dict({"replicas": 1})
    with pytest.raises(ConfigError, match="unknown engine"):
        Simulation(cfg, "llm-d", engine="fortran")
    with pytest.raises(ConfigError, match="unknown policy"):
        Simulation(cfg, "no-such-policy")


def test_plan_matches_the_live_workload() -> None:
    """The plan the Rust engine replays holds exactly the requests the Python workload makes
    (session content never depends on timing)."""
    spec = {"kind": "agentic", "sessions": 5, "followup_turns": 2}
    plan = build_plan(spec, 7, 16, 7)
    assert plan["kind"] == "sessions" and len(plan["turn_prompt"]) == 15
    cfg = ScenarioConfig.from_dict({"replicas": 2, "seed": 7, "workload": spec})
    sim = Simulation(cfg, "round-robin", engine="python")
    sim.run()
    offsets = plan["turn_offsets"]
    for req in sim.done:
        i = offsets[req.session] + req.turn
        assert (req.prompt_len, req.output_len) == (
            plan["turn_prompt"][i],
            plan["turn_output"][i],
        )
        start = plan["hash_offsets"][req.session]
        np.testing.assert_array_equal(
            plan["hashes"][start : start + plan["turn_blocks"][i]], req.hashes
        )


def test_plan_contents_number_equal_hashes_equally(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's hashes are numbered once; a run without the numbering (the engine numbers them
    itself) gives the same result, and a numbering of other hashes is refused."""
    from llmsched import _llmsched
    from llmsched.sim import fast

    spec = {
        "kind": "shared_prefix",
        "num_groups": 2,
        "num_prompts_per_group": 4,
        "num_requests": 30,
    }
    plan = build_plan(spec, 3, 16, 3)
    contents = plan["contents"]
    assert len(contents) == len(plan["hashes"])
    assert contents.distinct == len(np.unique(plan["hashes"])) < len(plan["hashes"])
    cfg = ScenarioConfig.from_dict({"replicas": 2, "seed": 3, "workload": spec})
    numbered = Simulation(cfg, "llm-d", engine="rust").run()
    monkeypatch.setattr(fast, "cached_plan", lambda _cfg: {**plan, "contents": None})
    unnumbered = Simulation(cfg, "llm-d", engine="rust").run()
    for key in numbered.requests:
        np.testing.assert_array_equal(numbered.requests[key], unnumbered.requests[key])
    assert numbered.engine == unnumbered.engine
    other = _llmsched.number_contents(plan["hashes"][::-1].copy())
    monkeypatch.setattr(fast, "cached_plan", lambda _cfg: {**plan, "contents": other})
    with pytest.raises(ConfigError, match="numbered from other hashes"):
        Simulation(cfg, "llm-d", engine="rust").run()
    monkeypatch.setattr(fast, "cached_plan", lambda _cfg: {**plan, "contents": 5})
    with pytest.raises(TypeError, match="PlanContents"):
        Simulation(cfg, "llm-d", engine="rust").run()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_trace_built_while_running_equals_built_first(tmp_path, delay: float) -> None:
    """A trace no cached plan holds is built on a second thread while the engine runs on the
    lines built so far (`llmsched_sim::stream`, chunks of 512 lines): the same result as the
    run on the plan built first, and the plan the run leaves in the cache is that plan."""
    rng = np.random.default_rng(5)
    rows = []
    for i in range(1_500):
        prompt = int(rng.integers(20, 3000))
        need = -(-prompt // 512)
        shared = [100 * (i % 4) + k for k in range(int(rng.integers(0, need + 1)))]
        ids = shared + [10_000 + 10 * i + k for k in range(need - len(shared))]
        row = {"timestamp": i * 30, "input_length": prompt, "output_length": i % 40}
        rows.append(json.dumps(row | ({"hash_ids": ids} if i % 7 else {})))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(rows))
    cfg = ScenarioConfig.from_dict(
        {
            "replicas": 3,
            "kv_events_delay_s": delay,
            "engine": {"kv_tokens": 30_000},
            "workload": {"kind": "trace", "path": str(path)},
        }
    )
    fast.clear_plan_cache()
    streamed = Simulation(cfg, "llm-d", engine="rust").run()
    kept = fast.cached_plan(cfg)  # left by the run, not built again
    first = build_plan(cfg.workload, cfg.seed, cfg.engine.block_size, cfg.seed)
    assert kept.keys() == first.keys()
    for key in first:
        if key == "contents":
            assert (len(kept[key]), kept[key].distinct) == (len(first[key]), first[key].distinct)
        elif isinstance(first[key], np.ndarray):
            np.testing.assert_array_equal(kept[key], first[key], err_msg=key)
        else:
            assert kept[key] == first[key], key
    fast.clear_plan_cache()
    fast.cached_plan(cfg)  # built first: the run replays it
    again = Simulation(cfg, "llm-d", engine="rust").run()
    assert streamed.summary()["prefix_hit_rate"] > 0
    for key in again.requests:
        np.testing.assert_array_equal(streamed.requests[key], again.requests[key], err_msg=key)
    assert streamed.kv_trace == again.kv_trace


def test_trace_built_while_running_reports_bad_lines(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n{"timestamp": 1}\n')
    cfg = ScenarioConfig.from_dict({"workload": {"kind": "trace", "path": str(path)}})
    fast.clear_plan_cache()
    with pytest.raises(ConfigError, match=r"trace\.jsonl:2: input_length"):
        Simulation(cfg, "llm-d", engine="rust").run()
