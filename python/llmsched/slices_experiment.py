"""A small in-process experiment: short requests behind long ones, with and without slices.

One endpoint with ``slots`` batch slots decodes one token per running request per step of
``step_s``. Long requests arrive first and take every slot; short ones arrive later. Without
slicing the short ones wait for a long one to finish. With slicing, at each slice boundary the
:class:`~llmsched.slices.SliceTracker` weighs the waiting work against the switch cost: a long
request that yields keeps its KV as evictable cache (least recently paused evicted first, as
vLLM does), and on resumption recomputes whatever was evicted at ``prefill_tokens_per_s``.

Run it: ``python -m llmsched.slices_experiment`` (a table of waits and overheads).

>>> cfg = ExperimentConfig(n_long=2, slots=2, long_prompt=400, long_output=300, n_short=12,
...                        short_prompt=200, short_output=10, kv_capacity_tokens=1400,
...                        slice_tokens=32)
>>> none, mlfq = run_experiment("none", cfg), run_experiment("mlfq", cfg)
>>> round(none.short_wait_mean_s, 2), round(mlfq.short_wait_mean_s, 2)
(2.88, 0.87)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from llmsched.slices import SliceTracker, SwitchCostModel, WaitingRequest

__all__ = ["ExperimentConfig", "ExperimentResult", "main", "run_experiment"]


@dataclass(frozen=True)
class ExperimentConfig:
    """Workload and endpoint of the experiment (all times in seconds).

    >>> ExperimentConfig().slots
    4
    """

    slots: int = 4
    n_long: int = 4
    long_prompt: int = 2000
    long_output: int = 1500
    n_short: int = 60
    short_prompt: int = 1000
    short_output: int = 40
    short_start_s: float = 1.0
    short_gap_s: float = 0.5
    step_s: float = 0.02
    prefill_tokens_per_s: float = 20_000.0
    kv_capacity_tokens: int = 14_000
    requeue_delay_s: float = 0.01
    slice_tokens: int = 128
    seed: int = 0


@dataclass(frozen=True)
class ExperimentResult:
    """What a run measured.

    ``short_wait_*``: arrival to admission of the short requests; ``long_finish_mean_s``:
    arrival to completion of the long ones; ``overhead_s``: recompute time of evicted KV plus
    requeue delays, over all switches; ``overhead_share``: overhead over the run's length.
    """

    policy: str
    short_wait_mean_s: float
    short_wait_p90_s: float
    long_finish_mean_s: float
    makespan_s: float
    switches: int
    recomputed_tokens: int
    overhead_s: float
    overhead_share: float


@dataclass
class _Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    is_long: bool
    level: int = 0
    ready: float = 0.0
    generated: int = 0
    cached: int = 0  # KV tokens kept while paused
    paused_at: float = 0.0
    prefill_left: float = 0.0
    admitted: float | None = None
    finished: float | None = None
    seen: bool = False

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass
class _Sim:
    cfg: ExperimentConfig
    tracker: SliceTracker | None
    reqs: list[_Req]
    now: float = 0.0
    queue: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)
    paused: list[_Req] = field(default_factory=list)
    switches: int = 0
    recomputed: int = 0

    def kv_used(self) -> int:
        return sum(r.context for r in self.running)

    def make_room(self, tokens: int, keep: _Req) -> bool:
        """Evict other paused KV (least recently paused first, tail first) until ``tokens``
        fit."""
        free = self.cfg.kv_capacity_tokens - self.kv_used() - sum(r.cached for r in self.paused)
        others = (r for r in self.paused if r is not keep)
        for victim in sorted(others, key=lambda r: r.paused_at):
            if free >= tokens:
                break
            take = min(victim.cached, tokens - free)
            victim.cached -= take
            free += take
        return free >= tokens

    def dispatch(self) -> None:
        self.queue.sort(key=lambda r: (r.level, r.ready, r.rid))
        for req in list(self.queue):
            if len(self.running) >= self.cfg.slots:
                return
            if req.ready > self.now:
                continue
            recompute = req.context - req.cached
            if not self.make_room(recompute + 1, keep=req):
                continue
            if req in self.paused:
                self.paused.remove(req)
            self.queue.remove(req)
            if req.seen:
                self.recomputed += recompute
                if self.tracker is not None:
                    self.tracker.resume(req.rid, endpoint="gpu")
            else:
                req.admitted = self.now
                if self.tracker is not None:
                    self.tracker.admit(
                        req.rid, prompt_tokens=req.prompt, max_tokens=req.output, endpoint="gpu"
                    )
            req.seen, req.cached = True, 0
            req.prefill_left = recompute / self.cfg.prefill_tokens_per_s
            self.running.append(req)

    def waiting(self) -> list[WaitingRequest]:
        head = sorted((r for r in self.queue if r.ready <= self.now), key=lambda r: r.level)
        return [WaitingRequest(0, r.level, r.context, r.output - r.generated) for r in head[:8]]

    def step(self) -> None:
        for req in list(self.running):
            if req.prefill_left > 0:
                req.prefill_left -= self.cfg.step_s
                continue
            if not self.make_room(1, keep=req):
                continue  # no KV for the next token: stall this step
            req.generated += 1
            if self.tracker is None:
                if req.generated == req.output:
                    self.finish(req)
                continue
            if self.tracker.record_tokens(req.rid, 1) > 0 and req.generated < req.output:
                continue
            self.report_load()
            done = req.generated == req.output
            decision = self.tracker.decide(
                req.rid, finished=done, waiting=self.waiting(), now=self.now
            )
            if decision.action == "finish":
                self.finish(req)
            elif decision.action != "continue":
                self.running.remove(req)
                req.level, req.cached, req.paused_at = decision.level, req.context, self.now
                req.ready = self.now + self.cfg.requeue_delay_s
                self.paused.append(req)
                self.queue.append(req)
                self.switches += 1

    def finish(self, req: _Req) -> None:
        self.running.remove(req)
        req.finished = self.now

    def report_load(self) -> None:
        assert self.tracker is not None
        usage = min(1.0, self.kv_used() / self.cfg.kv_capacity_tokens)
        self.tracker.set_endpoint("gpu", kv_cache_usage=usage, waiting=len(self.queue))

    def run(self) -> None:
        pending = sorted(self.reqs, key=lambda r: r.arrival)
        while pending or self.queue or self.running:
            while pending and pending[0].arrival <= self.now:
                req = pending.pop(0)
                req.ready = req.arrival
                if self.tracker is not None:
                    req.level = self.tracker.entry_level(req.prompt)
                self.queue.append(req)
            if self.tracker is not None:
                for rid, level in self.tracker.promote(now=self.now):
                    next(r for r in self.queue if r.rid == rid).level = level
            self.dispatch()
            self.step()
            self.now += self.cfg.step_s


def _workload(cfg: ExperimentConfig) -> list[_Req]:
    rng = random.Random(cfg.seed)
    reqs = [
        _Req(i, 0.05 * i, cfg.long_prompt, cfg.long_output, is_long=True) for i in range(cfg.n_long)
    ]
    at = cfg.short_start_s
    for i in range(cfg.n_short):
        reqs.append(_Req(cfg.n_long + i, at, cfg.short_prompt, cfg.short_output, is_long=False))
        at += rng.expovariate(1.0 / cfg.short_gap_s)
    return reqs


def run_experiment(policy: str, cfg: ExperimentConfig | None = None) -> ExperimentResult:
    """Run the workload with ``policy``: ``"none"`` (no slices), ``"fixed"`` or ``"mlfq"``."""
    cfg = cfg or ExperimentConfig()
    tracker = None
    if policy != "none":
        cost = SwitchCostModel(
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            decode_step_s=cfg.step_s,
            kv_capacity_tokens=cfg.kv_capacity_tokens,
            requeue_delay_s=cfg.requeue_delay_s,
        )
        params = (
            {"slice_tokens": cfg.slice_tokens}
            if policy == "fixed"
            else {"base_quantum": cfg.slice_tokens, "levels": 4, "join_ratio": 8}
        )
        tracker = SliceTracker(policy, params, cost_model=cost, endpoints=["gpu"])
    sim = _Sim(cfg, tracker, _workload(cfg))
    sim.run()
    shorts = sorted(r.admitted - r.arrival for r in sim.reqs if not r.is_long if r.admitted)
    longs = [r.finished - r.arrival for r in sim.reqs if r.is_long if r.finished is not None]
    overhead = sim.recomputed / cfg.prefill_tokens_per_s + sim.switches * cfg.requeue_delay_s
    p90 = shorts[min(len(shorts) - 1, math.ceil(0.9 * len(shorts)) - 1)] if shorts else 0.0
    return ExperimentResult(
        policy=policy,
        short_wait_mean_s=sum(shorts) / max(1, len(shorts)),
        short_wait_p90_s=p90,
        long_finish_mean_s=sum(longs) / max(1, len(longs)),
        makespan_s=sim.now,
        switches=sim.switches,
        recomputed_tokens=sim.recomputed,
        overhead_s=overhead,
        overhead_share=overhead / sim.now if sim.now else 0.0,
    )


def main() -> None:
    """Print the comparison table (the README's figures)."""
    cfg = ExperimentConfig()
    print(
        "| policy | short wait mean (s) | short wait p90 (s) | long finish mean (s) | "
        "makespan (s) | switches | recomputed tokens | switch overhead (s, share) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for policy in ("none", "fixed", "mlfq"):
        r = run_experiment(policy, cfg)
        print(
            f"| {policy} | {r.short_wait_mean_s:.2f} | {r.short_wait_p90_s:.2f} | "
            f"{r.long_finish_mean_s:.2f} | {r.makespan_s:.2f} | {r.switches} | "
            f"{r.recomputed_tokens} | {r.overhead_s:.2f} ({100 * r.overhead_share:.1f}%) |"
        )


if __name__ == "__main__":
    main()
