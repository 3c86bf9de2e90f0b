"""Exact cases of the simulated engine: idle-replica timings, conservation of tokens, queueing
formulas, preemption, prefix caching, P/D transfers and token slices."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llmsched.reference.sim import ReferenceSimulation
from llmsched.sim import ScenarioConfig, Simulation
from llmsched.sim.request import DONE

ENGINES = pytest.mark.parametrize("engine", ["rust", "python"])


def scenario(**over) -> ScenarioConfig:
    data = {"replicas": 1, "metrics_delay_s": 0.0, "policies": ["round-robin"]}
    data.update(over)
    return ScenarioConfig.from_dict(data)


def one_request(prompt: int, output: int, **over) -> ScenarioConfig:
    workload = {
        "kind": "long_short",
        "num_requests": 1,
        "long_fraction": 0.0,
        "short_input": prompt,
        "short_output": output,
        "length_cv": 0.0,
    }
    return scenario(workload=workload, **over)


def prefill_time(model, prompt: int, budget: int) -> float:
    t, ctx = 0.0, 0
    while ctx < prompt:
        chunk = min(budget, prompt - ctx)
        t += model.step_time(chunk, chunk * chunk, chunk * ctx, 0, 0, ctx)
        ctx += chunk
    return t


@pytest.mark.parametrize("prompt", [100, 8192, 20_000])
@ENGINES
def test_idle_replica_ttft_is_the_modelled_prefill_time(prompt: int, engine: str) -> None:
    sim = Simulation(one_request(prompt, 50), "round-robin", engine=engine)
    result = sim.run()
    (req,) = sim.done
    assert req.first_token_time - req.arrival == pytest.approx(
        prefill_time(sim.model, prompt, 8192), rel=1e-12
    )
    decode = sim.model.decode_run(1, prompt).time(49)
    assert req.finish_time - req.first_token_time == pytest.approx(decode, rel=1e-12)
    assert result.summary()["prefill_tokens"] == prompt


@ENGINES
def test_linear_model_single_request(engine: str) -> None:
    cfg = one_request(
        1000,
        11,
        step_model={"linear": {"b0": 0.002, "b1": 1e-4, "b2": 1e-3}},
        engine={"kv_tokens": 100_000},
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    sim.run()
    (req,) = sim.done
    assert req.first_token_time - req.arrival == pytest.approx(0.002 + 0.1)
    assert req.finish_time - req.first_token_time == pytest.approx(10 * (0.002 + 1e-3))


def conserved(sim: Simulation) -> None:
    """Every request finished with all its tokens, and no replica holds KV any more."""
    for req in sim.done:
        assert req.phase == DONE and not req.rejected
        assert req.generated == req.output_len
        assert req.prefilled_tokens >= req.prompt_len - req.cached_tokens
    assert sum(r.prefilled_tokens for r in sim.done) == sum(
        rep.prefill_tokens for rep in sim.replicas
    )
    for rep in sim.replicas:
        assert rep.kv.requests() == 0 and rep.kv.usage() == 0.0
        assert not rep.running and not rep.waiting and rep.decode_n == 0 and rep.decode_ctx == 0


@ENGINES
def test_tokens_in_equal_tokens_out_under_load(engine: str) -> None:
    cfg = scenario(
        replicas=2,
        workload={"kind": "long_short", "num_requests": 300, "arrival": {"rate": 30.0}},
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    result = sim.run()
    conserved(sim)
    s = result.summary()
    assert s["completed"] == 300
    assert s["output_tokens"] == sum(r.output_len for r in sim.done)


@ENGINES
def test_preemption_by_recompute_keeps_every_token(engine: str) -> None:
    # A tiny KV cache forces preemptions; work is recomputed and nothing is lost.
    cfg = scenario(
        engine={"kv_tokens": 6000, "max_num_seqs": 64},
        workload={
            "kind": "long_short",
            "num_requests": 60,
            "short_input": 400,
            "short_output": 600,
            "long_fraction": 0.0,
            "arrival": {"rate": 50.0},
        },
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    s = sim.run().summary()
    conserved(sim)
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert s["prefill_tokens"] >= s["prompt_tokens"] - s["prompt_tokens"] * s["prefix_hit_rate"]


@ENGINES
def test_request_larger_than_the_cache_is_refused(engine: str) -> None:
    sim = Simulation(
        one_request(5000, 10, engine={"kv_tokens": 2000}), "round-robin", engine=engine
    )
    s = sim.run().summary()
    assert s["completed"] == 0 and s["rejected"] == 1


@ENGINES
def test_repeated_prompt_hits_the_prefix_cache(engine: str) -> None:
    cfg = scenario(
        workload={
            "kind": "shared_prefix",
            "num_requests": 50,
            "num_groups": 1,
            "num_prompts_per_group": 1,
            "system_prompt_len": 4000,
            "question_len": 96,
            "output_len": 20,
            "arrival": {"rate": 2.0},
        }
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    s = sim.run().summary()
    # The first request computes everything; the rest hit all but the last block (at least one
    # prompt token is always computed, as in vLLM), so they recompute one block each.
    assert s["prefill_tokens"] == 4096 + 49 * 16
    assert s["prefix_hit_rate"] > 0.95
    conserved(sim)


def queue_run(cv: float, rate: float, n: int, engine: str) -> tuple[float, float]:
    cfg = scenario(
        step_model={"linear": {"b0": 0.0, "b1": 1e-4, "b2": 0.0}},
        engine={"max_num_seqs": 1, "kv_tokens": 1_000_000, "max_num_batched_tokens": 100_000},
        workload={
            "kind": "long_short",
            "num_requests": n,
            "long_fraction": 0.0,
            "short_input": 1000,
            "short_output": 1,
            "length_cv": cv,
            "arrival": {"rate": rate},
        },
        seed=3,
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    sim.run()
    sojourn = np.array([r.finish_time - r.arrival for r in sim.done])
    service = np.array([r.prompt_len * 1e-4 for r in sim.done])
    return float(sojourn.mean()), float(service.mean())


@ENGINES
def test_single_replica_matches_md1(engine: str) -> None:
    # No batching, deterministic service 0.1 s, Poisson arrivals at rho = 0.7:
    # W = S + rho * S / (2 * (1 - rho)) (Pollaczek-Khinchine).
    mean, service = queue_run(cv=0.0, rate=7.0, n=20_000, engine=engine)
    rho = 7.0 * service
    expected = service + rho * service / (2 * (1 - rho))
    assert math.isclose(mean, expected, rel_tol=0.05), (mean, expected)


@ENGINES
def test_single_replica_matches_mm1(engine: str) -> None:
    # Exponential prompt lengths make the service time exponential: W = 1 / (mu - lambda).
    mean, service = queue_run(cv=1.0, rate=6.0, n=30_000, engine=engine)
    expected = 1.0 / (1.0 / service - 6.0)
    assert math.isclose(mean, expected, rel_tol=0.08), (mean, expected)


@ENGINES
def test_pd_transfer_and_decode_split(engine: str) -> None:
    cfg = scenario(
        replicas=2,
        pd={"prefill_replicas": 1, "transfer_bw": 1e9, "transfer_latency_s": 0.01},
        workload={
            "kind": "long_short",
            "num_requests": 1,
            "long_fraction": 0.0,
            "short_input": 4096,
            "short_output": 10,
            "length_cv": 0.0,
        },
    )
    sim = Simulation(cfg, "llm-d-pd", engine=engine)
    sim.run()
    assert sim.engine == engine
    (req,) = sim.done
    prefill, decode = sim.replicas
    assert prefill.prefill_tokens == 4096 and decode.prefill_tokens == 1
    transfer = 0.01 + 4096 * cfg.pd.kv_bytes(sim.model) / 1e9
    first_step = sim.model.step_time(1, 1, 4095, 0, 0, 4095)
    expected = prefill_time(sim.model, 4096, 8192) + transfer + first_step
    assert req.first_token_time - req.arrival == pytest.approx(expected, rel=1e-9)
    conserved(sim)


@pytest.mark.parametrize("policy", ["fixed", "mlfq"])
@ENGINES
def test_token_slices_yield_and_finish(policy: str, engine: str) -> None:
    params = {"slice_tokens": 64} if policy == "fixed" else {"base_quantum": 64}
    cfg = scenario(
        slices={"policy": policy, "params": params},
        engine={"max_num_seqs": 4},
        workload={"kind": "long_short", "num_requests": 80, "arrival": {"rate": 20.0}},
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    s = sim.run().summary()
    assert s["completed"] == 80 and sim.engine == engine
    assert sim.slice_switches > 0  # with a queue, slices yield
    conserved(sim)
    if sim.reference is not None:
        assert sim.reference.slices is not None
        assert len(sim.reference.slices) == 0  # every request left the tracker


@ENGINES
def test_token_slices_continue_when_nobody_waits(engine: str) -> None:
    cfg = one_request(500, 300, slices={"policy": "fixed", "params": {"slice_tokens": 32}})
    sim = Simulation(cfg, "round-robin", engine=engine)
    sim.run()
    (req,) = sim.done
    assert sim.slice_switches == 0
    # No yield means no extra prefill: the idle-replica timing is unchanged.
    assert req.finish_time - req.first_token_time == pytest.approx(
        sim.model.decode_run(1, 500).time(299), rel=1e-12
    )


@ENGINES
def test_seeded_runs_replay_exactly(engine: str) -> None:
    cfg = scenario(replicas=3, workload={"kind": "agentic", "sessions": 12})
    a = Simulation(cfg, "random", engine=engine).run().summary()
    b = Simulation(cfg, "random", engine=engine).run().summary()
    for key in ("ttft_s", "e2e_s", "prefill_tokens", "output_tokens", "prefix_hit_rate"):
        assert a[key] == b[key]


def test_flow_control_protects_interactive_traffic() -> None:
    pytest.importorskip("llmsched.flow")
    runs = {}
    for label, cfg in ScenarioConfig.from_dict(
        {"base": "priority", "workload": {"kind": "priority", "num_requests": 1500}}
    ).expand():
        sim = Simulation(cfg, "llm-d")
        runs[label] = (sim, sim.run().summary())
    for sim, summary in runs.values():
        assert len(sim.done) == 1500  # every request completed or was refused
        assert summary["completed"] + summary["rejected"] == 1500
        for rep in sim.replicas:
            assert rep.kv.requests() == 0
    plain = runs["no flow control"][1]
    gated = runs["flow control"][1]
    assert gated["slo_attainment"][1] > plain["slo_attainment"][1]
    assert gated["by_tenant"][0]["ttft_s"]["p90"] < plain["by_tenant"][0]["ttft_s"]["p90"]


class _FakeFlow:
    """The slice of llmsched.flow's documented API the simulator uses: strict priority, at
    most ``max_running`` dispatched at once, refusals above ``max_queued``; ``resolve_config``
    (which a scenario's ``flow.config`` goes through when it loads) takes any config."""

    @staticmethod
    def resolve_config(config):
        return config

    class FlowRequest:
        def __init__(
            self, id, priority=0, tenant="", prompt_tokens=0, ttft_target=None, payload=None
        ):
            self.id, self.priority, self.payload = id, priority, payload

    class Decision:
        def __init__(self, req):
            self.id, self.payload = req.id, req.payload

    class FlowController:
        def __init__(self, config, clock):
            self.max_running = config["max_running"]
            self.max_queued = config["max_queued"]
            self.queue, self.running, self.endpoints = [], set(), {}

        def enqueue(self, request, now):
            if len(self.queue) >= self.max_queued:
                return "rejected_capacity"
            self.queue.append(request)
            return None

        def dispatch(self, now):
            if not self.queue or len(self.running) >= self.max_running:
                return None
            best = max(self.queue, key=lambda r: (r.priority, -r.id))
            self.queue.remove(best)
            self.running.add(best.id)
            return _FakeFlow.Decision(best)

        def expire(self, now):
            return []

        def drain_evicted(self):
            return []

        def update_endpoint(self, name, waiting, running, kv_cache_usage, timestamp):
            self.endpoints[name] = (waiting, running, kv_cache_usage)

        def complete(self, request_id, output_tokens, now):
            self.running.discard(request_id)


def test_flow_gate_plumbing(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llmsched.flow", _FakeFlow)
    cfg = scenario(
        replicas=2,
        flow={"enabled": True, "config": {"max_running": 8, "max_queued": 50}},
        workload={"kind": "priority", "num_requests": 400, "arrival": {"rate": 40.0}},
    )
    sim = ReferenceSimulation(cfg, "round-robin")
    s = sim.run().summary()
    assert len(sim.done) == 400 and s["completed"] + s["rejected"] == 400
    assert s["rejected"] > 0  # the queue bound refused some
    assert not sim.gate.controller.running and not sim.gate.controller.queue
    assert set(sim.gate.controller.endpoints) == {"0", "1"}
    for rep in sim.replicas:  # never more than the gate let through
        assert rep.kv.requests() == 0
    # Strict priority in the gate: interactive requests wait less there than batch ones.
    waits = {
        p: [r.dispatched - r.arrival for r in sim.done if r.priority == p and not r.rejected]
        for p in (1, -1)
    }
    assert np.mean(waits[1]) < np.mean(waits[-1])


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_index_mirrors_the_engines_caches(delay: float) -> None:
    """The router's index, fed by the replicas' KV events (now or ``delay`` later), ends up
    holding exactly what each replica's cache holds."""
    cfg = scenario(
        replicas=3,
        kv_events_delay_s=delay,
        metrics_delay_s=0.2,
        engine={"kv_tokens": 40_000},
        workload={
            "kind": "shared_prefix",
            "num_requests": 300,
            "num_groups": 12,
            "system_prompt_len": 2000,
            "question_len": 200,
            "output_len": 50,
            "arrival": {"rate": 30.0},
        },
    )
    sim = ReferenceSimulation(cfg, "prefix-only")  # the reference engine exposes its index
    sim.run()
    assert sim.feed_skipped == 0
    probes = {tuple(r.hashes[: r.prompt_len // 16].tolist()): r for r in sim.done}
    for prompt in probes:
        hashes = np.array(prompt, dtype=np.uint64)
        # Far in the future: a router's approximate entries have expired, confirmed ones stay.
        held = sim.index.match(hashes, now=sim.now + 1e6).as_dict()
        for rep in sim.replicas:
            assert held.get(rep.id, 0) == rep.kv.lookup(hashes)


@ENGINES
def test_a_step_on_an_idle_replica_pays_the_wake_up(engine: str, tmp_path) -> None:
    """``b6`` is paid by a step that starts on an idle replica (an arrival after a quiet
    spell), not by one that follows another step; ``b5`` by every prefill chunk."""
    rows = [(0.0, 100), (0.0, 100), (5.0, 100)]
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 2}) + "\n"
            for t, n in rows
        )
    )
    cfg = scenario(
        replicas=1,
        step_model={"linear": {"b0": 1e-3, "b1": 1e-4, "b2": 1e-3, "b5": 2e-3, "b6": 0.05}},
        engine={"kv_tokens": 100_000},
        workload={"kind": "trace", "path": str(trace), "timestamp_unit": "s"},
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    sim.run()
    ttft = sorted(
        ((r.arrival, r.first_token_time - r.arrival) for r in sim.done), key=lambda x: x[0]
    )
    alone = 1e-3 + 100 * 1e-4 + 2e-3 + 0.05  # the first step, on the idle replica
    beside = 1e-3 + 100 * 1e-4 + 1e-3 + 2e-3  # the next: the first request's decode, no wake-up
    firsts = sorted(t for a, t in ttft if a == 0.0)
    assert firsts == pytest.approx([alone, alone + beside], rel=1e-12)
    assert [t for a, t in ttft if a > 0] == pytest.approx([alone], rel=1e-12)


def _kv_trace_scenario(tmp_path, rows: list[tuple[float, int, int]], **over) -> ScenarioConfig:
    """One replica of 1024 KV tokens (64 blocks of 16) serving ``(arrival, prompt, output)``."""
    trace = tmp_path / "kv.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": p, "output_length": o}) + "\n"
            for t, p, o in rows
        )
    )
    workload = {"kind": "trace", "path": str(trace), "timestamp_unit": "s"}
    return scenario(engine={"kv_tokens": 1024}, workload=workload, **over)


@ENGINES
def test_peak_kv_use_counts_the_blocks_a_decode_run_grows(engine: str, tmp_path) -> None:
    """Probe 58: the 899 decode steps of one request run as one closed-form event; its KV
    grows from 2 blocks to ceil((32 + 899) / 16) = 59 of 64 before it finishes and frees
    them. The peak was read after the finish (0.031); it is 59/64."""
    cfg = _kv_trace_scenario(tmp_path, [(0.0, 32, 900)])
    sim = Simulation(cfg, "round-robin", engine=engine)
    summary = sim.run().summary()
    assert summary["kv_use"]["peak"] == 59 / 64


@ENGINES
def test_mean_kv_use_is_weighted_by_time(engine: str, tmp_path) -> None:
    """Every step takes 10 ms: 2 blocks for the prefill step, then one more block at the
    start of decode steps 0, 16, ..., 896 (vLLM allocates a step's slot when it schedules it)
    until the run ends at 9.0 s; the mean is the integral over ``[0, 9.0]`` over 64 blocks."""
    cfg = _kv_trace_scenario(
        tmp_path, [(0.0, 32, 900)], step_model={"linear": {"b0": 0.01, "b1": 0.0, "b2": 0.0}}
    )
    sim = Simulation(cfg, "round-robin", engine=engine)
    summary = sim.run().summary()
    area = 2 * 0.01 + 59 * 8.99 - 0.01 * 16 * sum(range(57))
    assert summary["kv_use"]["mean"] == pytest.approx(area / (64 * 9.0), rel=1e-9)
    assert summary["kv_use"]["peak"] == 59 / 64


class _KvSeen:
    """Sends every request to replica 0 and records the KV use it last saw at each pick."""

    name = "kv-seen"

    def __init__(self) -> None:
        self.kv = 0.0
        self.seen: list[float] = []

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
    ) -> None:
        self.kv = kv_cache_usage

    def pick(self, req, now: float) -> tuple[int, int | None]:
        self.seen.append(self.kv)
        return 0, None

    def on_first_token(self, req, now: float) -> None:
        pass

    def on_finished(self, req, now: float) -> None:
        pass


@ENGINES
def test_a_router_sees_the_kv_held_at_its_decision(engine: str, tmp_path) -> None:
    """Every step takes 10 ms. The second request arrives at 0.505 s, during decode step 49
    of the first request's run (which began at 0.01 s): that request holds its 2 prompt
    blocks plus the blocks of steps 0, 16, 32 and 48, so the router sees 6/64, not the 2/64
    published when the run began."""
    cfg = _kv_trace_scenario(
        tmp_path,
        [(0.0, 32, 900), (0.505, 16, 2)],
        step_model={"linear": {"b0": 0.01, "b1": 0.0, "b2": 0.0}},
    )
    policy = _KvSeen()
    sim = Simulation(cfg, policy, engine=engine)
    summary = sim.run().summary()
    assert policy.seen == [0.0, 6 / 64]
    assert summary["kv_use"]["peak"] == 59 / 64
