"""The Rust engine: the whole simulation in native code, calling the routing core directly.

:class:`llmsched.sim.Simulation` runs it. A scenario it does not cover yet
(:func:`unsupported` names why) runs on the reference engine (:mod:`llmsched.reference.sim`),
with a warning, a count and the reason in the result. Both engines run the same model step
for step and give the same results for the same seed and scenario (the equivalence tests
compare them request by request).

The workload is generated once into a *plan* (every request's lengths and block hashes;
sessions as scripts whose turns start as earlier turns finish) that the engine replays, built
natively (:func:`~llmsched.sim.workloads.native_plan`: the same plan, bit for bit, as the
Python workload classes make, which :func:`build_plan` also builds with ``native=False``);
plans are cached, so the policies of one comparison share one plan, and each plan's block
hashes are numbered once (``contents``: the KV caches address blocks by these dense ids
instead of hashing 64-bit hashes in every run). A trace's plan, when no cached plan has it,
is built on a second thread while the engine runs on its first lines, and cached after the
run (the same plan and results as building it first).

>>> from llmsched.sim.config import ScenarioConfig
>>> cfg = ScenarioConfig.from_dict({"replicas": 2, "workload": {"kind": "long_short",
...     "num_requests": 50, "arrival": {"rate": 5.0}}})
>>> unsupported(cfg, "round-robin") is None
True

A :class:`~llmsched.sim.policies.Policy` object runs here too: the engine calls it where the
reference engine does (see :mod:`llmsched.sim.policies`), handing it
:class:`~llmsched.sim.request.Request` objects that carry the request's state at each call.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from llmsched import _llmsched
from llmsched.errors import ConfigError
from llmsched.routing import ConfigLike, load_config, native_config
from llmsched.sim.config import ScenarioConfig
from llmsched.sim.policies import Policy, PolicyLike
from llmsched.sim.request import DONE, Request
from llmsched.sim.results import RunRecord
from llmsched.sim.stepmodel import (
    LinearStepModel,
    RooflineStepModel,
    StepModel,
    build_step_model,
)
from llmsched.sim.workloads import AgenticWorkload, make_workload, native_plan, trace_build

__all__ = [
    "build_plan",
    "cached_plan",
    "clear_plan_cache",
    "done_requests",
    "engine_settings",
    "run",
    "step_args",
    "unsupported",
]

ENGINES = ("auto", "rust", "python")
PLAN_CACHE_SIZE = 4  # plans kept (one comparison needs one per variant)


def unsupported(
    config: ScenarioConfig, policy: PolicyLike, native_kv: bool = True, model: Any = None
) -> str | None:
    """Why the Rust engine cannot run ``policy`` on ``config`` (None: it can).

    >>> from llmsched.sim.config import ScenarioConfig
    >>> unsupported(ScenarioConfig.from_dict({}), "llm-d", native_kv=False)
    'the pure-Python KV cache twin'
    """
    if not native_kv:
        return "the pure-Python KV cache twin"
    if model is None:
        model = build_step_model(config.step_model)
    if not isinstance(
        model, (RooflineStepModel, LinearStepModel)
    ):  # pragma: no cover - build_step_model only makes these
        return "a custom step model"
    return None


def step_args(model: StepModel) -> dict[str, Any]:
    """The step model's constants for the native engine (same expressions, same order)."""
    if isinstance(model, LinearStepModel):
        return {"kind": "linear", **{b: float(getattr(model, b)) for b in LINEAR}}
    assert isinstance(model, RooflineStepModel)
    spec, tp = model.model, model.tp
    assert tp is not None
    return {
        "kind": "roofline",
        **model.constants(),
        "params": float(spec.params),
        "expert_params": float(spec.expert_params),
        "experts": float(spec.experts),
        "experts_per_token": float(spec.experts_per_token),
        "bytes_per_param": float(spec.bytes_per_param),
        "tp": tp,
        "hidden": spec.hidden,
        "layers": spec.layers,
        "step_overhead": float(model.step_overhead_s),
        "allreduce_latency": float(model.allreduce_latency_s),
        "link_bw": float(model.gpu.link_bw),
    }


LINEAR = ("b0", "b1", "b2", "b3", "b4", "b5", "b6")


# -- plans ------------------------------------------------------------------------------------


def build_plan(
    spec: dict[str, Any], seed: int, block_size: int, chain_seed: int, native: bool = True
) -> dict[str, Any]:
    """The workload ``spec`` as plain arrays (see the module docs): built natively
    (:func:`~llmsched.sim.workloads.native_plan`), or with ``native=False`` from the Python
    workload classes' requests, the oracle the native plans are tested against.

    >>> plan = build_plan({"kind": "long_short", "num_requests": 3}, 0, 16, 0)
    >>> plan["kind"], len(plan["arrival"])
    ('open', 3)
    """
    if native:
        return native_plan(spec, seed=seed, block_size=block_size, chain_seed=chain_seed)
    workload = make_workload(spec, seed=seed, block_size=block_size, chain_seed=chain_seed)
    if isinstance(workload, AgenticWorkload):
        plan = _session_plan(workload)
        plan["contents"] = _llmsched.number_contents(plan["hashes"])
        return plan
    requests = list(workload.arrivals())
    hashes = [r.hashes for r in requests]
    all_hashes = _concat(hashes)
    return {
        "kind": "open",
        "arrival": np.array([r.arrival for r in requests], dtype=np.float64),
        "prompt": np.array([r.prompt_len for r in requests], dtype=np.int64),
        "output": np.array([r.output_len for r in requests], dtype=np.int64),
        "tenant": np.array([r.tenant for r in requests], dtype=np.int64),
        "priority": np.array([r.priority for r in requests], dtype=np.int64),
        "session": [None if r.session is None else str(r.session) for r in requests],
        "hash_offsets": _offsets([len(h) for h in hashes]),
        "hashes": all_hashes,
        "contents": _llmsched.number_contents(all_hashes),
    }


def _session_plan(workload: AgenticWorkload) -> dict[str, Any]:
    starts = workload.starts()
    scripts = [workload.script(sid) for sid in range(workload.cfg.sessions)]
    turns = [t for s in scripts for t in s.turns]
    hashes = [s.conv.hashes for s in scripts]
    return {
        "kind": "sessions",
        "starts": np.asarray(starts, dtype=np.float64),
        "closed": workload.cfg.arrival.process == "closed",
        "tenant": np.array([s.tenant for s in scripts], dtype=np.int64),
        "hash_offsets": _offsets([len(h) for h in hashes]),
        "hashes": _concat(hashes),
        "turn_offsets": _offsets([len(s.turns) for s in scripts]),
        "turn_prompt": np.array([t[0] for t in turns], dtype=np.int64),
        "turn_output": np.array([t[1] for t in turns], dtype=np.int64),
        "turn_blocks": np.array([t[2] for t in turns], dtype=np.int64),
        "turn_think": np.array([th for s in scripts for th in s.thinks], dtype=np.float64),
    }


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=np.uint64)
    return np.ascontiguousarray(np.concatenate(arrays), dtype=np.uint64)


_plans: OrderedDict[str, dict[str, Any]] = OrderedDict()
_plans_lock = threading.Lock()


def clear_plan_cache() -> None:
    """Forget the cached plans (the next run of every workload builds its plan again)."""
    with _plans_lock:
        _plans.clear()


def _plan_key(config: ScenarioConfig) -> str:
    spec = config.workload
    key_parts: list[Any] = [spec, config.seed, config.engine.block_size]
    if spec.get("kind") == "trace" and isinstance(spec.get("path"), str):
        try:
            st = os.stat(spec["path"])
            key_parts.append((st.st_mtime_ns, st.st_size))
        except OSError:
            pass  # make_workload reports the unreadable file
    return json.dumps(key_parts, sort_keys=True, default=str)


def _keep(key: str, plan: dict[str, Any]) -> None:
    _plans[key] = plan
    while len(_plans) > PLAN_CACHE_SIZE:
        _plans.popitem(last=False)


def cached_plan(config: ScenarioConfig) -> dict[str, Any]:
    """:func:`build_plan` for ``config``, shared by runs of the same workload and seed."""
    key = _plan_key(config)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            plan = build_plan(config.workload, config.seed, config.engine.block_size, config.seed)
            _keep(key, plan)
        else:
            _plans.move_to_end(key)
        return plan


def _plan_or_build(config: ScenarioConfig) -> tuple[str, dict[str, Any]]:
    """:func:`cached_plan`, except for a trace no cached plan holds: what builds its plan
    during the run (the engine returns the plan, which :func:`run` caches under the key)."""
    bs = config.engine.block_size
    build = trace_build(config.workload, config.seed, bs, config.seed)
    if build is None:
        return "", cached_plan(config)
    key = _plan_key(config)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return key, plan
    return key, build


# -- running ---------------------------------------------------------------------------------


def engine_settings(config: ScenarioConfig, kv_blocks: int, model: StepModel) -> dict[str, Any]:
    """The scenario's engine settings as the native engine takes them."""
    engine = config.engine
    return {
        "replicas": config.replicas,
        "block_size": engine.block_size,
        "kv_blocks": kv_blocks,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_num_seqs": engine.max_num_seqs,
        "priority_scheduling": engine.scheduling == "priority",
        "metrics_delay_s": float(config.metrics_delay_s),
        "kv_events_delay_s": float(config.kv_events_delay_s),
        "kv_sample_s": float(config.kv_sample_s),
        "max_time_s": None if config.max_time_s is None else float(config.max_time_s),
        "seed": config.seed,
        "router_replicas": config.router_replicas,
        "router_sync_delay_s": (
            None if config.router_sync_delay_s is None else float(config.router_sync_delay_s)
        ),
        "prefill_replicas": config.pd.prefill_replicas,
        "transfer_bw": float(config.pd.transfer_bw),
        "transfer_latency_s": float(config.pd.transfer_latency_s),
        "kv_bytes_per_token": config.pd.kv_bytes(model),
    }


POLICY_INDEX_ROUTER = "round-robin"
"""The router configuration a run under a :class:`~llmsched.sim.policies.Policy` object builds
its prefix index with (fed by the engines' KV events as under a router; never asked to route)."""


def run(
    config: ScenarioConfig,
    model: StepModel,
    kv_blocks: int,
    router_config: ConfigLike | None,
    policy: Policy | None = None,
) -> RunRecord:
    """Run ``config`` on the Rust engine under the router ``router_config``, or under the
    :class:`~llmsched.sim.policies.Policy` object ``policy`` (called back from the engine, the
    GIL taken for each call): its record (the plan is built, or taken from the cache, first).
    A policy that raises, or answers ``pick`` with something that is not a replica, stops the
    run with :class:`~llmsched.errors.PolicyError` (its own exception chained)."""
    if (router_config is None) == (policy is None):
        raise ConfigError("give a router configuration or a Policy object, not both or neither")
    if policy is not None and config.router_replicas > 1:
        raise ConfigError("router_replicas needs a router configuration, not a Policy object")
    router, functions = native_config(load_config(router_config or POLICY_INDEX_ROUTER))
    key, plan = _plan_or_build(config) if policy is None else ("", cached_plan(config))
    flow, ttft = None, None
    if config.flow.enabled:
        flow, ttft = config.flow.controller_config(), config.flow.ttft_targets(config.slo)
    slices = None
    if config.slices.policy:
        block_size = config.engine.block_size
        cost = config.slices.cost_model(model, kv_blocks * block_size, block_size).native
        slices = (config.slices.policy, config.slices.params, cost)
    settings = engine_settings(config, kv_blocks, model)
    named = None
    if policy is not None:
        named = (str(getattr(policy, "name", type(policy).__name__)), policy)
    out = _llmsched.simulate(
        settings, step_args(model), router, plan, flow, ttft, slices, functions, named
    )
    if plan["kind"] == "trace":
        with _plans_lock:
            _keep(key, out.pop("plan"))
    return RunRecord.from_native(out)


def done_requests(record: RunRecord) -> list[Request]:
    """The requests of a run that left the simulation as :class:`Request` objects (without
    hashes or tokens; ``session`` is the session number of agentic turns, None otherwise)."""
    out = record.requests
    empty = np.zeros(0, dtype=np.uint64)
    done = []
    for i in range(len(out["id"])):
        session = int(out["session"][i])
        req = Request(
            int(out["id"][i]),
            float(out["arrival"][i]),
            int(out["prompt"][i]),
            int(out["output"][i]),
            empty,
            tenant=int(out["tenant"][i]),
            priority=int(out["priority"][i]),
            session=None if session < 0 else session,
            turn=int(out["turn"][i]),
        )
        req.phase = DONE
        req.dispatched = float(out["dispatched"][i])
        req.first_token_time = float(out["first_token"][i])
        req.finish_time = float(out["finish"][i])
        req.generated = int(out["generated"][i])
        req.cached_tokens = int(out["cached"][i])
        req.prefilled_tokens = int(out["prefilled"][i])
        req.recomputed_tokens = int(out["recomputed"][i])
        req.preemptions = int(out["preemptions"][i])
        req.rejected = bool(out["rejected"][i])
        done.append(req)
    return done
