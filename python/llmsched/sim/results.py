"""What a simulation measured: per-request records and the summary figures.

Counts (``summary()``): requests ``completed``, ``rejected`` (refused by flow control or by
their engine) and ``unfinished`` (arrived but still waiting, queued or running when
``max_time_s`` cut the run off; 0 in a run to the end): they add up to the requests that
arrived. Every figure below covers the requests that left.

Figures (``summary()``): TTFT, time per output token (TPOT, decode time over output tokens
after the first), end-to-end latency (p50/p90/p99, seconds); output tokens/s and requests/s
over the makespan (first arrival to last finish); the engines' prefix-cache hit rate (tokens
hit over tokens queried, counted once per request at its admission as vLLM's
``prefix_cache_hits`` / ``prefix_cache_queries`` are: neither a lookup whose blocks did not fit
nor a preempted request's readmission); prefill tokens computed and recomputed
after preemption; KV use (``peak``: the most blocks a replica held at any instant;
``mean``: each replica's mean over ``[0, end]`` weighted by time, averaged over replicas);
SLO attainment per priority with targets
(the share of the class's requests, refused ones included, that got TTFT and TPOT within its
targets; a priority without targets has none); TTFT
and end-to-end latency per tenant (up to 16 tenants); Jain's fairness over tenants of the mean
normalised speed (a request's time alone on an idle replica over its actual end-to-end time);
``prefill_imbalance``, the most prompt tokens one replica computed over the mean (over the
prefill replicas of a P/D split); and the wall time
with the share spent in the routing decision code, and which engine ran (``engine``:
``"rust"`` or ``"python"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from llmsched.errors import ConfigError

__all__ = [
    "COUNTERS",
    "MAX_TIME_S",
    "KvEnd",
    "ReplicaEnd",
    "RunRecord",
    "SimResult",
    "check_time",
    "collect",
    "jain",
]

COUNTERS = (
    "prefill_tokens",
    "recomputed_tokens",
    "hit_tokens",
    "query_tokens",
    "preemptions",
    "steps",
)
"""The engine counters every replica keeps (summed into :attr:`SimResult.engine`)."""

RECORD_FIELDS = (
    "id",
    "arrival",
    "dispatched",
    "first_token",
    "finish",
    "prompt",
    "output",
    "generated",
    "cached",
    "prefilled",
    "recomputed",
    "preemptions",
    "tenant",
    "priority",
    "session",
    "turn",
    "rejected",
    "ideal",
)
"""The per-request arrays of a :class:`RunRecord`, one entry per request that left the
simulation (finished or refused), in the order they left."""

FIELDS = (
    "arrival",
    "first_token",
    "finish",
    "prompt",
    "output",
    "cached",
    "prefilled",
    "recomputed",
    "tenant",
    "priority",
    "ideal",
)


MAX_TENANT_ROWS = 16  # per-tenant figures are reported up to this many tenants


def jain(values: npt.ArrayLike) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1 when all equal.

    >>> jain([1, 1, 1]), round(jain([1, 0, 0]), 3)
    (1.0, 0.333)
    """
    x = np.asarray(values, dtype=float)
    if len(x) == 0 or not (x * x).sum() > 0:
        return 1.0
    return float(x.sum() ** 2 / (len(x) * (x * x).sum()))


def _count(values: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _pct(x: npt.NDArray[np.float64]) -> dict[str, float]:
    if len(x) == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(x.mean())}


@dataclass
class SimResult:
    """Per-request arrays (completed requests), engine counters and timing of one run."""

    policy: str
    scenario: str
    requests: dict[str, npt.NDArray[Any]]
    rejected: int
    rejected_by_priority: dict[int, int]
    engine: dict[str, int]
    kv_trace: list[list[tuple[float, float]]]
    slo: dict[int, dict[str, float]]
    wall_s: float
    decision_s: float
    feed_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    engine_name: str = "rust"  # which engine ran it: "rust" or "python" (the reference)
    fallback_reason: str | None = None
    """Why the Rust engine did not run this scenario (None: it did, or the reference engine
    was asked for)."""

    def summary(self) -> dict[str, Any]:
        """The figures described in the module docs, as plain data."""
        r = self.requests
        n = len(r["arrival"])
        out: dict[str, Any] = {"policy": self.policy, "scenario": self.scenario, "completed": n}
        out["engine"] = self.engine_name
        if self.fallback_reason is not None:
            out["engine_fallback"] = self.fallback_reason
        out["rejected"] = self.rejected
        out["unfinished"] = int(self.extra.get("unfinished", 0))
        if n == 0:
            return out
        ttft = r["first_token"] - r["arrival"]
        e2e = r["finish"] - r["arrival"]
        multi = r["output"] > 1
        tpot = (r["finish"][multi] - r["first_token"][multi]) / (r["output"][multi] - 1)
        makespan = float(r["finish"].max() - r["arrival"].min())
        out["ttft_s"] = _pct(ttft)
        out["tpot_s"] = _pct(tpot)
        out["e2e_s"] = _pct(e2e)
        out["makespan_s"] = makespan
        out["output_tok_s"] = float(r["output"].sum() / makespan) if makespan > 0 else 0.0
        out["requests_s"] = n / makespan if makespan > 0 else 0.0
        eng = self.engine
        out["prefix_hit_rate"] = (
            eng["hit_tokens"] / eng["query_tokens"] if eng["query_tokens"] else 0.0
        )
        out["prefill_tokens"] = eng["prefill_tokens"]
        out["recomputed_tokens"] = eng["recomputed_tokens"]
        out["prompt_tokens"] = int(r["prompt"].sum())
        out["output_tokens"] = int(r["output"].sum())
        out["preemptions"] = eng["preemptions"]
        out["kv_use"] = self._kv_use()
        slo_out = {}
        for prio in sorted(set(r["priority"].tolist()) | set(self.rejected_by_priority)):
            mask = r["priority"] == prio
            target = self.slo.get(prio, {})
            if not target:
                continue  # no targets, nothing to attain (not 100%)
            ok = np.ones(int(mask.sum()), dtype=bool)
            if "ttft_s" in target:
                ok &= ttft[mask] <= target["ttft_s"]
            if "tpot_s" in target:
                req_tpot = np.where(
                    r["output"][mask] > 1,
                    (r["finish"][mask] - r["first_token"][mask])
                    / np.maximum(r["output"][mask] - 1, 1),
                    0.0,
                )
                ok &= req_tpot <= target["tpot_s"]
            # A request that was refused missed its targets too.
            slo_out[int(prio)] = float(
                ok.sum() / (len(ok) + self.rejected_by_priority.get(prio, 0))
            )
        out["slo_attainment"] = slo_out
        speed = r["ideal"] / np.maximum(e2e, 1e-12)
        tenants = sorted(set(r["tenant"].tolist()))
        out["fairness_jain"] = jain([speed[r["tenant"] == t].mean() for t in tenants])
        if len(tenants) <= MAX_TENANT_ROWS:
            out["by_tenant"] = {
                int(t): {
                    "completed": int((r["tenant"] == t).sum()),
                    "ttft_s": _pct(ttft[r["tenant"] == t]),
                    "e2e_s": _pct(e2e[r["tenant"] == t]),
                }
                for t in tenants
            }
        prefill = self.extra.get("prefill_by_replica")
        if prefill:
            mean = float(np.mean(prefill))
            out["prefill_imbalance"] = float(max(prefill)) / mean if mean > 0 else 1.0
        if self.extra.get("router_replicas", 1) > 1:
            out["router_replicas"] = self.extra["router_replicas"]
            out["sync_bytes_per_request"] = self.extra["sync_bytes"] / n
        out["wall_s"] = self.wall_s
        out["sim_requests_per_wall_s"] = n / self.wall_s if self.wall_s > 0 else 0.0
        out["decision_share"] = self.decision_s / self.wall_s if self.wall_s > 0 else 0.0
        out["feed_share"] = self.feed_s / self.wall_s if self.wall_s > 0 else 0.0
        return out

    def _kv_use(self) -> dict[str, float]:
        """Mean (over time, then over replicas) and peak KV use: from the engines' exact
        figures, or from the sampled trace for a result that has none."""
        peaks = self.extra.get("kv_peak_by_replica")
        means = self.extra.get("kv_mean_by_replica")
        if peaks and means:
            return {"mean": float(np.mean(means)), "peak": float(max(peaks))}
        usage = [u for trace in self.kv_trace for _, u in trace]
        return {"mean": float(np.mean(usage)) if usage else 0.0, "peak": max(usage, default=0.0)}

    def kv_series(self, points: int = 200) -> dict[str, list[float]]:
        """Mean KV use over replicas on a regular time grid (for plots and JSON): each
        replica's last sample at or before each point, 0 before its first (replicas start
        empty), every replica counted (an idle one as 0).

        >>> r = SimResult("p", "s", {}, 0, {}, {}, [[(1.0, 0.5)], []], {}, 0.0, 0.0, 0.0)
        >>> r.kv_series(3)["kv_use"]
        [0.0, 0.0, 0.25]
        """
        end = max((t for trace in self.kv_trace for t, _ in trace), default=0.0)
        grid = np.linspace(0.0, end, points)
        rows = []
        for trace in self.kv_trace:
            if not trace:
                rows.append(np.zeros(points))  # it was left out: the mean of the busy ones
                continue
            t = np.array([p[0] for p in trace])
            u = np.array([p[1] for p in trace])
            idx = np.searchsorted(t, grid, side="right") - 1
            # Before its first sample a replica held nothing (its first sample was used).
            rows.append(np.where(idx >= 0, u[np.maximum(idx, 0)], 0.0))
        mean = np.mean(rows, axis=0) if rows else np.zeros(points)
        return {"t": grid.tolist(), "kv_use": mean.tolist()}


class KvEnd:
    """A replica's KV cache when a run ended: its live requests and its use (0..1), and over
    the run: its peak use and its time-weighted mean use over ``[0, end]`` (the blocks held at
    every instant, a decode run's growth included)."""

    def __init__(self, requests: int, usage: float, peak: float = 0.0, mean: float = 0.0) -> None:
        self.live = requests
        self.use = usage
        self.peak = peak
        self.mean = mean

    def requests(self) -> int:
        """Requests holding blocks."""
        return self.live

    def usage(self) -> float:
        """Share of blocks in use."""
        return self.use


@dataclass
class ReplicaEnd:
    """A replica's counters and state when a run ended (what results and tests read)."""

    id: int
    prefill_tokens: int
    recomputed_tokens: int
    hit_tokens: int
    query_tokens: int
    preemptions: int
    steps: int
    running: int
    waiting: int
    decode_n: int
    decode_ctx: int
    kv: KvEnd


@dataclass
class RunRecord:
    """What one engine run produced, the same for either engine: the per-request arrays
    (:data:`RECORD_FIELDS`), every replica's end state and the run's counters."""

    requests: dict[str, npt.NDArray[Any]]
    replicas: list[ReplicaEnd]
    kv_trace: list[list[tuple[float, float]]]
    now: float
    feed_skipped: int = 0
    decision_s: float = 0.0
    feed_s: float = 0.0
    sync_batches: int = 0
    sync_bytes: int = 0
    slice_switches: int = 0
    arrived: int | None = None
    """Requests that arrived, session turns included (None: every request in ``requests``).
    Those that did not leave were still waiting, queued or running when ``max_time_s`` cut the
    run off."""

    @classmethod
    def from_native(cls, out: dict[str, Any]) -> RunRecord:
        """The record of a native (``_llmsched.simulate``) run."""
        replicas = [
            ReplicaEnd(
                i,
                int(d["prefill_tokens"]),
                int(d["recomputed_tokens"]),
                int(d["hit_tokens"]),
                int(d["query_tokens"]),
                int(d["preemptions"]),
                int(d["steps"]),
                running=int(d["running"]),
                waiting=int(d["waiting"]),
                decode_n=int(d["decode_n"]),
                decode_ctx=int(d["decode_ctx"]),
                kv=KvEnd(
                    int(d["kv_requests"]),
                    float(d["kv_usage"]),
                    float(d["kv_peak"]),
                    float(d["kv_mean"]),
                ),
            )
            for i, d in enumerate(out["replicas"])
        ]
        return cls(
            requests={name: out[name] for name in RECORD_FIELDS},
            replicas=replicas,
            kv_trace=out["kv_trace"],
            now=float(out["now"]),
            feed_skipped=int(out["feed_skipped"]),
            decision_s=float(out["decision_s"]),
            feed_s=float(out["feed_s"]),
            sync_batches=int(out["sync_batches"]),
            sync_bytes=int(out["sync_bytes"]),
            slice_switches=int(out.get("slice_switches", 0)),
            arrived=int(out["arrived"]),
        )


MAX_TIME_S = float(2**32)
"""The latest simulated time a run may reach (about 136 years): past it float64 seconds are
coarser than a microsecond, and TTFTs and latencies are rounded away (to 0 at 1e300 s)."""


def check_time(now: float) -> None:
    """ConfigError for a run that reached past :data:`MAX_TIME_S`.

    >>> check_time(1e300)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: simulated time reached 1e+300 s, past 2**32 s (136 years), \
where float64 seconds are coarser than a microsecond and every latency would be rounded; \
shorten the gaps: arrival.rate, think_time_s, a trace's time_scale
    """
    if now > MAX_TIME_S:
        raise ConfigError(
            f"simulated time reached {now:.3g} s, past 2**32 s (136 years), where float64 "
            "seconds are coarser than a microsecond and every latency would be rounded; "
            "shorten the gaps: arrival.rate, think_time_s, a trace's time_scale"
        )


def collect(
    record: RunRecord,
    *,
    policy: str,
    scenario: str,
    slo: dict[int, dict[str, float]],
    router_replicas: int,
    wall_s: float,
    engine_name: str,
    fallback_reason: str | None = None,
    prefill_replicas: int = 0,
) -> SimResult:
    """The :class:`SimResult` of a run: the one collector both engines' records go through.

    A run that reached past :data:`MAX_TIME_S` is a ConfigError (:func:`check_time`).
    ``prefill_replicas`` is the scenario's ``pd.prefill_replicas``: with a P/D split the
    prefill balance is taken over the prefill pool only.
    """
    check_time(record.now)
    out = record.requests
    rejected = out["rejected"].astype(bool)
    ok = ~rejected
    requests = {name: out[name][ok] for name in FIELDS}
    requests["cached"] = np.maximum(requests["cached"], 0)
    engine = {name: int(sum(getattr(rep, name) for rep in record.replicas)) for name in COUNTERS}
    by_priority = _count(int(p) for p in out["priority"][rejected].tolist())
    return SimResult(
        policy=policy,
        scenario=scenario,
        requests=requests,
        rejected=int(rejected.sum()),
        rejected_by_priority=by_priority,
        engine=engine,
        kv_trace=record.kv_trace,
        slo=slo,
        wall_s=wall_s,
        decision_s=record.decision_s,
        feed_s=record.feed_s,
        extra={
            "feed_skipped": record.feed_skipped,
            "router_replicas": router_replicas,
            "sync_batches": record.sync_batches,
            "sync_bytes": record.sync_bytes,
            "slice_switches": record.slice_switches,
            "unfinished": 0 if record.arrived is None else record.arrived - len(rejected),
            # The prefill pool's (every replica's without a P/D split): decode replicas
            # prefill a few tokens each, and counted in, they made a 2P+6D split whose two
            # prefill replicas were within 10% of each other read 4.4 times imbalanced.
            "prefill_by_replica": [
                rep.prefill_tokens for rep in record.replicas[: prefill_replicas or None]
            ],
            "kv_peak_by_replica": [rep.kv.peak for rep in record.replicas],
            "kv_mean_by_replica": [rep.kv.mean for rep in record.replicas],
        },
        engine_name=engine_name,
        fallback_reason=fallback_reason,
    )
