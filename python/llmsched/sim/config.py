"""Scenario configuration: plain data with defaults in one place, loadable from YAML.

A scenario file is a mapping with the keys of :class:`ScenarioConfig`; ``base: <name>`` starts
from a named scenario (:data:`SCENARIOS`) and overrides only what the file gives (nested
mappings merge). Unknown keys raise ConfigError naming them, and so does a value of the wrong
type (an int where the table says ``int``, a finite number for ``float``, ``true``/``false`` for
``bool``), NaN, or a number out of range (a workload's counts, lengths and times below 0, a
``seed`` outside 0..2**64-1, an SLO target that is not a finite number >= 0), when the file is
loaded and again when a :class:`~llmsched.sim.Simulation` is made.

>>> cfg = ScenarioConfig.from_dict({"base": "agentic", "replicas": 4})
>>> cfg.replicas, cfg.workload["kind"]
(4, 'agentic')
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsched._llmsched import MAX_BLOCK_SIZE
from llmsched.config_loader import load_mapping
from llmsched.errors import ConfigError
from llmsched.sim.stepmodel import StepModelConfig
from llmsched.sim.workloads import check_fields, from_dict
from llmsched.validation import U64_MAX, describe_int, is_finite_number

if TYPE_CHECKING:
    from llmsched.slices import SwitchCostModel

__all__ = [
    "DEFAULT_POLICIES",
    "ROLES",
    "SCENARIOS",
    "EngineConfig",
    "FlowConfig",
    "PDConfig",
    "ScenarioConfig",
    "SliceConfig",
    "load_scenario",
]

DEFAULT_POLICIES = [
    "random",
    "round-robin",
    "least-load",
    "prefix-only",
    "llm-d",
    "sglang-cache-aware",
    "dynamo-kv",
]


ROLES = ("both", "prefill", "decode")
"""The roles a replica may have (:meth:`ScenarioConfig.roles`)."""


@dataclass
class EngineConfig:
    """vLLM engine settings that shape scheduling (defaults: vLLM V1 on an 80 GB GPU)."""

    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_tokens: int | None = None  # KV capacity; None: from the step model
    scheduling: str = "fcfs"  # or "priority" (higher Request.priority first)

    def validate(self) -> None:
        """ConfigError for impossible settings."""
        check_fields(self, "engine")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if not 1 <= getattr(self, name) <= U64_MAX:
                raise ConfigError(
                    f"engine.{name} must be 1..2**64-1, got {describe_int(getattr(self, name))}"
                )
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ConfigError(
                f"engine.kv_tokens must hold at least one block, got {self.kv_tokens}"
            )
        if self.scheduling not in ("fcfs", "priority"):
            raise ConfigError(
                f"engine.scheduling must be 'fcfs' or 'priority', not {self.scheduling!r}"
            )


@dataclass
class PDConfig:
    """Prefill/decode disaggregation: the first ``prefill_replicas`` replicas only prefill;
    KV moves to the decode replica at ``transfer_bw`` bytes/s after ``transfer_latency_s``."""

    prefill_replicas: int = 0
    transfer_bw: float = 25e9  # a 200 Gb/s RDMA NIC
    transfer_latency_s: float = 1e-3
    kv_bytes_per_token: int | None = None  # None: from the step model

    def validate(self, replicas: int) -> None:
        """ConfigError for impossible settings (``replicas``: the scenario's)."""
        check_fields(self, "pd")
        if not 0 <= self.prefill_replicas < replicas:
            raise ConfigError("pd.prefill_replicas must leave at least one decode replica")
        if self.transfer_bw <= 0 or self.transfer_latency_s < 0:
            raise ConfigError("pd.transfer_bw must be > 0 and transfer_latency_s >= 0")
        kv_bytes = self.kv_bytes_per_token
        if kv_bytes is not None and not 1 <= kv_bytes <= U64_MAX:
            raise ConfigError(
                f"pd.kv_bytes_per_token must be 1..2**64-1 or null, got {describe_int(kv_bytes)}"
            )

    def kv_bytes(self, model: object) -> int:
        """KV bytes per token moved in a transfer: ``kv_bytes_per_token``, else the step
        model's (its ``model.kv_bytes_per_token``), else Llama-3-8B's in bf16 (2 * 32 layers *
        8 KV heads * 128 * 2 bytes).

        >>> PDConfig(kv_bytes_per_token=10).kv_bytes(None), PDConfig().kv_bytes(None)
        (10, 131072)
        """
        if self.kv_bytes_per_token:
            return int(self.kv_bytes_per_token)
        spec = getattr(model, "model", None)
        if spec is not None and hasattr(spec, "kv_bytes_per_token"):
            return int(spec.kv_bytes_per_token)
        return 131_072


@dataclass
class SliceConfig:
    """Token slices through :class:`llmsched.slices.SliceTracker`: ``policy`` ``fixed`` or
    ``mlfq`` with its ``params`` (empty: off). At each slice boundary the tracker decides,
    from the replica's queue and KV use, whether the request continues in the batch, yields
    (back to the end of its replica's queue, keeping its cached KV) or migrates (to an idle
    replica, which recomputes it)."""

    policy: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def cost_model(
        self, model: object, kv_tokens: int | None = None, block_size: int | None = None
    ) -> SwitchCostModel:
        """The tracker's switch-cost model, as both engines build it: from the model and GPU
        of a roofline step model; from a linear step model's coefficients (a prompt token
        costs ``b1``, a one-sequence decode step ``b0 + b2``); the defaults otherwise.
        ``kv_tokens`` is a simulated replica's KV capacity (what the engines hold): the
        tracker weighs evictions against it. ``block_size`` is the replicas' KV block size
        (``engine.block_size``): a continuation recomputes its last block; one past the cost
        model's bound (65,536 tokens) is priced as 65,536.

        >>> from llmsched.sim.stepmodel import LinearStepModel
        >>> cost = SliceConfig("fixed").cost_model(LinearStepModel(0.02, 5e-5, 0.0), 14_000)
        >>> cost.kv_capacity_tokens, cost.decode_step_s, round(cost.prefill_tokens_per_s)
        (14000.0, 0.02, 20000)
        """
        from llmsched.sim.stepmodel import LinearStepModel, RooflineStepModel
        from llmsched.slices import SwitchCostModel

        # A replica's own KV capacity, not the cost model's default (an 8B model on an H100:
        # 426,788 tokens, 30 times the 14,000 of slices-small), else the tracker saw room that
        # was not there and never expected a yielded request to be evicted.
        own: dict[str, float] = {} if kv_tokens is None else {"kv_capacity_tokens": kv_tokens}
        if block_size is not None:
            own["block_size"] = min(block_size, MAX_BLOCK_SIZE)
        if isinstance(model, LinearStepModel):
            decode_s = model.step_time(decode_tokens=1)
            if decode_s > 0:  # b0 = b2 = 0 (prefill costs only): the default step stays
                own["decode_step_s"] = decode_s
            if model.b1 > 0:
                own["prefill_tokens_per_s"] = 1.0 / model.b1
            return SwitchCostModel(**own)
        if not isinstance(model, RooflineStepModel):
            return SwitchCostModel(**own)
        spec, gpu = model.model, model.gpu
        tp = model.tp or 1
        derived = SwitchCostModel.from_model(
            params=spec.params,
            layers=spec.layers,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            gpu_flops=gpu.flops * tp,
            gpu_hbm_bytes_per_s=gpu.hbm_bw * tp,
            gpu_memory_bytes=gpu.memory * tp,
            compute_efficiency=model.compute_eff,
            bandwidth_efficiency=model.memory_eff,
            memory_fraction=model.gpu_memory_utilization,
        )
        if not own:
            return derived
        return SwitchCostModel(**{**derived.to_dict(), **own})


@dataclass
class FlowConfig:
    """Flow control in front of the router (:class:`llmsched.flow.FlowController`, built
    from ``config``, its llm-d style configuration): requests wait in priority bands until the
    pool's saturation lets their band dispatch; refused or expired ones count as rejected.
    ``config`` is checked when the scenario loads, enabled or not."""

    enabled: bool = False
    config: dict[str, Any] = field(default_factory=dict)

    def controller_config(self) -> dict[str, Any]:
        """The controller's configuration as both engines build it: simulated replicas report
        only when something changes, so a quiet replica's last report stays true (saturation
        ``utilization`` with ``stale_policy: last`` unless ``config`` gives a ``saturation``).

        >>> FlowConfig(True).controller_config()["saturation"]["stale_policy"]
        'last'
        """
        return {"saturation": {"type": "utilization", "stale_policy": "last"}, **self.config}

    def ttft_targets(self, slo: dict[int, dict[str, float]]) -> list[tuple[int, float]]:
        """(priority, TTFT target) for each priority whose SLO has one.

        >>> FlowConfig(True).ttft_targets({1: {"ttft_s": 1.0}, 0: {"tpot_s": 0.1}})
        [(1, 1.0)]
        """
        return [(p, float(t["ttft_s"])) for p, t in slo.items() if "ttft_s" in t]


def _default_slo() -> dict[int, dict[str, float]]:
    return {
        1: {"ttft_s": 1.0, "tpot_s": 0.05},
        0: {"ttft_s": 2.0, "tpot_s": 0.1},
        -1: {"ttft_s": 30.0, "tpot_s": 0.2},
    }


@dataclass
class ScenarioConfig:
    """Everything one simulated experiment needs."""

    name: str = "custom"
    description: str = ""
    replicas: int = 8
    seed: int = 0
    step_model: StepModelConfig = field(default_factory=StepModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: dict[str, Any] = field(default_factory=lambda: {"kind": "agentic"})
    policies: list[Any] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    metrics_delay_s: float = 0.05  # what a 50 ms metrics scrape shows at worst
    kv_events_delay_s: float = 0.0
    kv_sample_s: float = 1.0
    max_time_s: float | None = None
    router_replicas: int = 1
    """Router replicas in front of the engines; requests are spread over them in turn (a load
    balancer without stickiness). Each has its own pool and prefix index, fed by every
    engine's metrics and KV events. The Rust engine only."""
    router_sync_delay_s: float | None = None
    """With several router replicas: None, each decides on its own state; a number, replica
    sync (:mod:`llmsched.cluster`'s protocol) brings each one's prefix records, sessions and
    in-flight counts to the others that many seconds later (0: at once)."""
    pd: PDConfig = field(default_factory=PDConfig)
    slices: SliceConfig = field(default_factory=SliceConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    slo: dict[int, dict[str, float]] = field(default_factory=_default_slo)
    variants: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        """ConfigError for impossible settings: each value of the wrong type, not finite or
        out of range is named."""
        check_fields(self, "")
        for nested, where in (
            (self.step_model, "step_model"),
            (self.slices, "slices"),
            (self.flow, "flow"),
        ):
            check_fields(nested, where)
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if not 0 <= self.seed <= U64_MAX:
            raise ConfigError(f"seed must be in 0..2**64-1, got {self.seed}")
        self.pd.validate(self.replicas)
        if self.slices.policy:
            from llmsched.slices import policy_names

            if self.slices.policy not in policy_names():
                raise ConfigError(
                    f"unknown slices.policy {self.slices.policy!r}; known: {policy_names()}"
                )
        if self.flow.config:
            # Checked here, enabled or not: it was read only when a run began, so a typo in a
            # later variant's flow config stopped the comparison after the earlier variants
            # ran, and one in a disabled flow section was never seen.
            from llmsched.flow import resolve_config

            try:
                resolve_config(self.flow.controller_config())
            except ConfigError as exc:
                text = str(exc).removeprefix("flow config: ")
                raise ConfigError(f"flow.config: {text}") from None
        for name in ("metrics_delay_s", "kv_events_delay_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        limit = self.max_time_s
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0
        ):
            raise ConfigError(f"max_time_s must be null or > 0, got {limit!r}")
        if self.kv_sample_s <= 0:
            raise ConfigError("kv_sample_s must be > 0")
        if (
            isinstance(self.router_replicas, bool)
            or not isinstance(self.router_replicas, int)
            or not 1 <= self.router_replicas <= 1024
        ):
            raise ConfigError(f"router_replicas must be 1 to 1024, got {self.router_replicas!r}")
        delay = self.router_sync_delay_s
        if delay is not None and (
            isinstance(delay, bool) or not isinstance(delay, (int, float)) or not delay >= 0
        ):
            raise ConfigError(f"router_sync_delay_s must be null or >= 0, got {delay!r}")
        if not self.policies:
            raise ConfigError("policies must name at least one policy")
        for i, variant in enumerate(self.variants):
            if not isinstance(variant, dict) or not isinstance(variant.get("name"), str):
                raise ConfigError(f"variants[{i}] must be a mapping with a 'name'")
            if {"variants", "base"} & set(variant):
                raise ConfigError(f"variants[{i}] may not set variants or base")
        for prio, slo in self.slo.items():
            if not isinstance(slo, dict) or set(slo) - {"ttft_s", "tpot_s"}:
                raise ConfigError(f"slo[{prio}] must be a mapping with ttft_s and/or tpot_s")
            for key, target in slo.items():
                if not is_finite_number(target) or target < 0:
                    raise ConfigError(
                        f"slo[{prio}].{key} must be a finite number of seconds >= 0, got {target!r}"
                    )
        self.engine.validate()

    def roles(self) -> list[str]:
        """Each replica's role."""
        p = self.pd.prefill_replicas
        if not p:
            return ["both"] * self.replicas
        return ["prefill"] * p + ["decode"] * (self.replicas - p)

    def expand(self) -> list[tuple[str, ScenarioConfig]]:
        """(label, scenario) for each variant (overrides merged over this scenario), or just
        this scenario when it has none."""
        if not self.variants:
            return [("", self)]
        base = self.to_dict()
        base.pop("variants")
        out = []
        for variant in self.variants:
            over = copy.deepcopy(variant)
            label = over.pop("name")
            out.append((label, ScenarioConfig.from_dict(_merge(copy.deepcopy(base), over))))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``--json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScenarioConfig:
        """Build from plain data (see the module docs); ConfigError names what is wrong."""
        if not isinstance(data, dict):
            raise ConfigError(f"scenario: expected a mapping, got {type(data).__name__}")
        data = copy.deepcopy(data)
        base_name = data.pop("base", None)
        if base_name is not None:
            if base_name not in SCENARIOS:
                raise ConfigError(
                    f"unknown base scenario {base_name!r}; known: {sorted(SCENARIOS)}"
                )
            data = _merge(copy.deepcopy(SCENARIOS[base_name]), data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"scenario: unknown key(s) {unknown}; known: {sorted(known)}")
        nested = {
            "step_model": StepModelConfig,
            "engine": EngineConfig,
            "pd": PDConfig,
            "slices": SliceConfig,
            "flow": FlowConfig,
        }
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in nested:
                values[key] = from_dict(nested[key], value, key)
            elif key == "slo":
                if not isinstance(value, dict):
                    raise ConfigError("slo must map priorities to {ttft_s, tpot_s}")
                values[key] = {_priority(k): v for k, v in value.items()}
            else:
                values[key] = value
        try:
            cfg = cls(**values)
        except TypeError as exc:
            raise ConfigError(f"scenario: {exc}") from None
        cfg.validate()
        return cfg


def _priority(key: object) -> int:
    """An ``slo`` key: a priority (an int, or its text as YAML keys may be)."""
    try:
        return int(str(key).strip()) if not isinstance(key, bool) else int("x")
    except ValueError:
        raise ConfigError(f"slo: keys must be priorities (ints), got {key!r}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "slo":
            base[key] = _merge(base[key], value)
        else:
            base[key] = value
    return base


SCENARIOS: dict[str, dict[str, Any]] = {
    "agentic": {
        "name": "agentic",
        "description": "agentic multi-turn sessions on 8 x Llama-3.1-8B / H100",
        "workload": {"kind": "agentic"},
    },
    "shared-prefix": {
        "name": "shared-prefix",
        "description": "llm-d shared-prefix benchmark: 150 tenants x 6k-token contexts, "
        "8 x Qwen2.5-32B on 2 x H100",
        "step_model": {"model": "qwen2.5-32b"},
        "workload": {"kind": "shared_prefix", "num_requests": 3000, "arrival": {"rate": 15.0}},
    },
    "long-short": {
        "name": "long-short",
        "description": "short interactive requests behind long ones (head-of-line blocking)",
        "replicas": 4,
        "workload": {"kind": "long_short", "num_requests": 6000, "arrival": {"rate": 40.0}},
        "policies": ["least-load"],
    },
    "priority": {
        "name": "priority",
        "description": "interactive (priority 1) and batch (priority -1) traffic, overloaded, "
        "with and without flow control",
        "replicas": 4,
        "workload": {"kind": "priority", "num_requests": 6000, "arrival": {"rate": 24.0}},
        "policies": ["llm-d"],
        "variants": [
            {"name": "no flow control"},
            {"name": "flow control", "flow": {"enabled": True}},
        ],
    },
    "slices": {
        "name": "slices",
        "description": "long and short requests on memory-limited engines, with and without "
        "token slices",
        "replicas": 4,
        "engine": {"max_num_seqs": 32},
        "workload": {"kind": "long_short", "num_requests": 3000, "arrival": {"rate": 12.0}},
        "policies": ["round-robin"],
        "variants": [
            {"name": "no slices"},
            {"name": "fixed 256", "slices": {"policy": "fixed", "params": {"slice_tokens": 256}}},
            {"name": "mlfq 128", "slices": {"policy": "mlfq", "params": {"base_quantum": 128}}},
        ],
    },
    "slices-small": {
        "name": "slices-small",
        "description": "the token-slice experiment: one engine with 4 sequence slots and 14k KV "
        "tokens, a few 2000+1500-token requests among 1000+40-token ones, with and without "
        "slices",
        "replicas": 1,
        "engine": {"max_num_seqs": 4, "kv_tokens": 14_000},
        # 20 ms a decode step, 20k prompt tokens a second.
        "step_model": {"linear": {"b0": 0.02, "b1": 5e-5, "b2": 0.0}, "profile": None},
        "workload": {
            "kind": "long_short",
            "num_requests": 64,
            "long_fraction": 0.0625,
            "long_input": 2000,
            "long_output": 1500,
            "short_input": 1000,
            "short_output": 40,
            "length_cv": 0.0,
            "arrival": {"rate": 2.0},
        },
        "policies": ["round-robin"],
        "variants": [
            {"name": "no slices"},
            {"name": "fixed 128", "slices": {"policy": "fixed", "params": {"slice_tokens": 128}}},
            {"name": "mlfq 128", "slices": {"policy": "mlfq", "params": {"base_quantum": 128}}},
        ],
    },
    "router-replicas": {
        "name": "router-replicas",
        "description": "agentic sessions through 1 to 8 router replicas (turns spread over "
        "them), each on its own state (shared scrapes and KV events, 50 ms late) or synced",
        "kv_events_delay_s": 0.05,
        "policies": ["llm-d", "dynamo-kv"],
        "variants": [
            {"name": "1 router"},
            *(
                {
                    "name": f"{n} routers, {label}",
                    "router_replicas": n,
                    "router_sync_delay_s": delay,
                }
                for n in (2, 4, 8)
                for label, delay in (("alone", None), ("synced 5 ms", 0.005), ("synced 0", 0.0))
            ),
        ],
    },
    "pd": {
        "name": "pd",
        "description": "8 replicas serving both phases, or split 2 prefill + 6 decode "
        "(llm-d's P/D profile)",
        "workload": {
            "kind": "long_short",
            "num_requests": 4000,
            "long_fraction": 0.3,
            "long_input": 8000,
            "long_output": 500,
            "short_input": 2000,
            "short_output": 300,
            "arrival": {"rate": 14.0},
        },
        "policies": ["llm-d"],
        "variants": [
            {"name": "8 mixed"},
            {"name": "2P+6D", "pd": {"prefill_replicas": 2}, "policies": ["llm-d-pd"]},
            {"name": "3P+5D", "pd": {"prefill_replicas": 3}, "policies": ["llm-d-pd"]},
        ],
    },
}


def load_scenario(name: str | None = None, path: str | Path | None = None) -> ScenarioConfig:
    """A named scenario, or a YAML file (which may name its ``base``)."""
    if path is not None:
        data = load_mapping(Path(path), what="scenario")
        if name is not None:
            data.setdefault("base", name)
        return ScenarioConfig.from_dict(data)
    return ScenarioConfig.from_dict({"base": name or "agentic"})
