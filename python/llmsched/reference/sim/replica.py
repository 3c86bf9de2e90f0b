"""One simulated vLLM-like engine: continuous batching over a paged, prefix-cached KV cache.

Algorithm (vLLM V1's scheduler, per step):

1. Requests part-way through their prefill continue with a chunk of at most the step's token
   budget (``max_num_batched_tokens`` less one token per decoding request).
2. Waiting requests are admitted in order while the budget, ``max_num_seqs`` and the KV cache
   allow: the prefix-cache hit is taken (at most all but the last prompt token), then blocks
   for the first chunk are allocated. Nothing is admitted in a step that preempted.
3. Decoding requests need a slot for their next token; when the cache is full the most recently
   admitted running request (lowest priority first under ``scheduling: priority``) is preempted
   by recompute: its blocks are freed (full ones stay cached) and it waits at the front of the
   queue to prefill its prompt and output so far again.
4. The step takes the step model's time; a request whose prefill completes samples a token at
   its end (its first token, unless it is resuming).

Speed: while no request is prefilling and none can be admitted, the batch is constant until the
next finish, the next arrival or a full cache, so that whole run of decode steps is one event
(:class:`~llmsched.sim.stepmodel.DecodeRun` sums it in closed form; an arrival cuts it at the
step in progress). Per-request decode progress is implicit: a decoding request that joined at
decode step ``s`` with ``g`` tokens has ``g + (S - s)`` after step ``S``. Cost: O(log n) per
event plus O(requests touched), never O(tokens).

KV use: the blocks a run grows are allocated at its end, but the replica still knows, for any
instant, how many it holds (:meth:`Replica.kv_grown`: a decoding request takes a block every
``block_size`` steps, at known steps), which the engine publishes before a routing decision; the
peak and the time integral of blocks held are accounted per block added (``kv_peak``,
``kv_area``), O(blocks added) per run.
"""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections import deque
from typing import Any, Protocol

from llmsched.errors import ConfigError
from llmsched.sim.config import ROLES, EngineConfig
from llmsched.sim.kv import KVCache
from llmsched.sim.request import DECODE, DONE, PREFILL, WAITING, Request
from llmsched.sim.stepmodel import DecodeRun, StepModel

__all__ = ["Replica", "ReplicaHost"]


class ReplicaHost(Protocol):
    """What a replica calls back: the event queue, the gateway's view (metrics and KV events)
    and the request life cycle. The reference engine implements it; a replica knows nothing
    else of the simulation."""

    def at(self, when: float, replica: Replica) -> None:
        """Wake ``replica`` at ``when`` (its current step's end)."""
        ...

    def publish(self, replica: Replica, now: float) -> None:
        """The replica's metrics changed."""
        ...

    def kv_events(self, replica: Replica, now: float) -> None:
        """The replica's KV cache has events to forward."""
        ...

    def prefill_done(self, req: Request, now: float) -> None:
        """A prefill-only replica finished ``req``'s prompt."""
        ...

    def first_token(self, req: Request, now: float) -> None:
        """``req`` produced its first token."""
        ...

    def slice_continues(self, req: Request, now: float) -> bool:
        """A token slice of ``req`` ended: True when the next one runs on in the batch."""
        ...

    def finished(self, req: Request, now: float) -> None:
        """``req`` finished, ended a token slice, or was refused."""
        ...


def _priority_key(r: Request) -> tuple[int, float, int]:
    return (-r.priority, r.arrival, r.id)


class Replica:
    """One engine. The simulation calls :meth:`enqueue` and :meth:`on_step_end`; the replica
    calls back its :class:`ReplicaHost` for first tokens, finishes and completed P/D
    prefills."""

    def __init__(
        self,
        rid: int,
        role: str,
        cfg: EngineConfig,
        model: StepModel,
        kv: KVCache,
        host: ReplicaHost,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown replica role {role!r}; known: {list(ROLES)}")
        self.id = rid
        self.role = role
        self.cfg = cfg
        self.bs = cfg.block_size
        self.model = model
        self.kv = kv
        self.host = host
        self.waiting: Any = [] if cfg.scheduling == "priority" else deque()
        self.running: list[Request] = []
        self.prefilling: list[Request] = []
        self.decode_n = 0
        self.decode_ctx = 0  # KV tokens of the decoding requests after step ``decode_step``
        self.decode_step = 0
        self.finishes: list[tuple[int, int, int, Request]] = []
        self.version = 0
        self.busy = False
        self.stepping = False  # applying a step: arrivals wait for the next schedule
        # The step (or decode run) in flight.
        self.step_start = 0.0
        self.step_end = 0.0
        self.last_end = -math.inf  # when the last step ended: a later start is after idle
        self.chunks: list[tuple[Request, int]] = []
        self.run: DecodeRun | None = None
        self.run_steps = 0  # 0: a single step (decode slots already allocated)
        # Counters.
        self.prefill_tokens = 0
        self.recomputed_tokens = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.busy_time = 0.0
        # KV use over time, in blocks (see :meth:`kv_observe`): the blocks held since
        # ``kv_since``, the integral of blocks held over time until then, and the peak.
        self.kv_held = 0
        self.kv_since = 0.0
        self.kv_area = 0.0
        self.kv_peak = 0

    # -- signals -----------------------------------------------------------------------------

    def metrics(self) -> tuple[int, int, float]:
        """(waiting, running, KV-cache use 0..1), as the engine's /metrics would report."""
        return len(self.waiting), len(self.running), self.kv.usage()

    def in_run(self, now: float) -> bool:
        """A decode run is in flight at ``now``, past its start."""
        return self.busy and self.run_steps > 0 and now > self.step_start

    def run_growth(self, elapsed: float, upto: int) -> tuple[int, float]:
        """Blocks the decode run in flight allocates in its first ``upto`` steps, and the
        integral over its first ``elapsed`` seconds of the blocks those add (block-seconds).

        A decoding request holding ``t`` tokens in ``b`` blocks takes a new block at the start
        of steps ``b*bs - t``, then every ``bs`` steps (vLLM allocates a step's slots when it
        schedules it). Cost: O(decoding requests + blocks added), not O(steps).
        """
        run = self.run
        assert run is not None
        bs, kv = self.bs, self.kv
        grown, area = 0, 0.0
        for req in self.running:
            if req.phase != DECODE:
                continue
            s = kv.blocks_of(req.id) * bs - kv.tokens_of(req.id)
            while s < upto:
                grown += 1
                area += elapsed - run.time(s)
                s += bs
        return grown, area

    def kv_grown(self, now: float) -> int:
        """Blocks the decode run in flight has added by ``now`` and not yet committed to the
        cache (0 outside a run): with them, the blocks held at ``now``, what vLLM's
        ``kv_cache_usage_perc`` would report if scraped then."""
        if not self.in_run(now):
            return 0
        assert self.run is not None
        done = self.run.steps_within(now - self.step_start, self.run_steps)
        return self.run_growth(0.0, min(done + 1, self.run_steps))[0]

    def kv_observe(self, now: float) -> None:
        """Account the blocks held up to ``now`` (called whenever the metrics are published;
        a decode run in flight is accounted when it ends)."""
        if self.in_run(now):
            return
        self.kv_area += self.kv_held * (now - self.kv_since)
        self.kv_since = now
        self.kv_held = self.kv.num_blocks - self.kv.free_blocks
        self.kv_peak = max(self.kv_peak, self.kv_held)

    def kv_totals(self, now: float) -> tuple[int, float]:
        """(peak blocks, block-seconds held) from the start to ``now``."""
        if not self.in_run(now):
            area = self.kv_area + self.kv_held * (now - self.kv_since)
            return max(self.kv_peak, self.kv_held), area
        assert self.run is not None
        elapsed = now - self.step_start
        done = self.run.steps_within(elapsed, self.run_steps)
        grown, area = self.run_growth(elapsed, min(done + 1, self.run_steps))
        held = self.kv_held + grown
        return max(self.kv_peak, held), self.kv_area + self.kv_held * elapsed + area

    # -- input -------------------------------------------------------------------------------

    def enqueue(self, req: Request, now: float) -> None:
        """A request arrives (routed here, or its KV transferred here)."""
        req.replica = self
        req.phase = WAITING
        self._wait(req)
        if self.stepping:
            return  # arrived from a callback of the step being applied: scheduled right after
        if not self.busy:
            self._schedule(now)
        elif self.run_steps > 1:
            self._cut_run(now)
        self.host.publish(self, now)

    def _wait(self, req: Request, front: bool = False) -> None:
        if self.cfg.scheduling == "priority":
            insort(self.waiting, req, key=_priority_key)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _cut_run(self, now: float) -> None:
        """End the decode run at the step in progress, so the arrival is seen at its end."""
        assert self.run is not None
        done = self.run.steps_within(now - self.step_start, self.run_steps)
        keep = min(done + 1, self.run_steps)
        if keep < self.run_steps:
            self.run_steps = keep
            self.step_end = self.step_start + self.run.time(keep)
            self.version += 1
            self.host.at(self.step_end, self)

    # -- the step ----------------------------------------------------------------------------

    def on_step_end(self, now: float) -> None:
        """Apply the step (or decode run) that just ended, then start the next one."""
        self.busy = False
        self.stepping = True
        self.last_end = now
        self.busy_time += now - self.step_start
        if self.run_steps:
            k = self.run_steps
            # The run's KV growth, before its finishes free their blocks (peak and area).
            elapsed = now - self.step_start
            added, area = self.run_growth(elapsed, k)
            self.kv_area += self.kv_held * elapsed + area
            self.kv_held += added
            self.kv_since = now
            self.kv_peak = max(self.kv_peak, self.kv_held)
            grown = self.kv.advance_decoding(k)
            assert grown, "decode run was sized to fit the cache"
            self.decode_step += k
            self.decode_ctx += self.decode_n * k
            self.steps += k
        else:
            self.steps += 1
            if self.decode_n:
                self.decode_step += 1
                self.decode_ctx += self.decode_n
            for req, chunk in self.chunks:
                self._prefilled(req, chunk, now)
        self.chunks = []
        self._finish_due(now)
        self.stepping = False
        self._schedule(now)
        self.host.kv_events(self, now)
        self.host.publish(self, now)

    def _prefilled(self, req: Request, chunk: int, now: float) -> None:
        req.computed += chunk
        kv = self.kv
        kv.commit(req.id, req.hashes, req.computed // self.bs)
        if req.computed < req.target:
            return
        self.prefilling.remove(req)
        if self.role == "prefill" and req.decode_replica is not None:
            # Split by the router: the KV moves to the decode replica. (A request routed whole
            # to a prefill replica, by a policy that ignores roles, is served there.)
            self.running.remove(req)
            kv.free(req.id)
            req.kv_started = False
            self.host.prefill_done(req, now)
            return
        req.generated += 1
        if req.first_token_time < 0:
            self.host.first_token(req, now)
        if req.generated >= req.output_len or (
            req.call_end == req.generated and not self.host.slice_continues(req, now)
        ):
            self._finish(req, now)
            return
        req.phase = DECODE
        req.join_step = self.decode_step
        req.join_gen = req.generated
        kv.set_decoding(req.id, True)
        self.decode_n += 1
        self.decode_ctx += req.computed
        stop = req.output_len
        if req.call_end:
            stop = min(stop, req.call_end)
        heapq.heappush(
            self.finishes, (self.decode_step + stop - req.generated, req.id, req.version, req)
        )

    def _finish_due(self, now: float) -> None:
        finishes = self.finishes
        while finishes and finishes[0][0] <= self.decode_step:
            _, _, version, req = heapq.heappop(finishes)
            if version != req.version or req.phase != DECODE:
                continue
            generated = req.join_gen + self.decode_step - req.join_step
            if generated < req.output_len:
                req.generated = generated
                if self.host.slice_continues(req, now):
                    # The next slice goes on in the batch: only the stopping point moves.
                    stop = min(req.output_len, req.call_end)
                    heapq.heappush(
                        finishes, (req.join_step + stop - req.join_gen, req.id, version, req)
                    )
                    continue
            self._leave_decode(req)
            self._finish(req, now)

    def _leave_decode(self, req: Request) -> None:
        tokens = self.kv.tokens_of(req.id)
        req.generated = req.join_gen + self.decode_step - req.join_step
        req.computed = tokens
        self.decode_n -= 1
        self.decode_ctx -= tokens
        self.kv.set_decoding(req.id, False)

    def _finish(self, req: Request, now: float) -> None:
        kv = self.kv
        kv.commit(req.id, req.hashes, req.computed // self.bs)
        kv.free(req.id)
        req.kv_started = False
        req.phase = DONE
        req.version += 1
        self.running.remove(req)
        self.host.finished(req, now)

    def _preempt(self, victim: Request) -> None:
        """Recompute preemption: free the victim's blocks, requeue it at the front."""
        if victim.phase == DECODE:
            self._leave_decode(victim)
        else:
            self.prefilling.remove(victim)
            for i, (req, _) in enumerate(self.chunks):
                if req is victim:
                    del self.chunks[i]
                    break
        self.kv.commit(victim.id, victim.hashes, victim.computed // self.bs)
        self.kv.free(victim.id)
        self.running.remove(victim)
        victim.kv_started = False
        victim.high_water = max(victim.high_water, victim.computed)
        victim.computed = 0
        victim.target = victim.prompt_len + victim.generated
        victim.phase = WAITING
        victim.version += 1
        victim.preemptions += 1
        victim.readmitting = True
        # P/D: the transferred KV is loaded once; readmitted, the request is a local one that
        # recomputes what its prefix cache no longer holds (as the Rust engine does).
        victim.kv_ready = False
        self.preemptions += 1
        self._wait(victim, front=True)

    def _victim(self, spare: Request | None = None) -> Request | None:
        candidates = [r for r in self.running if r is not spare]
        if not candidates:
            return None
        if self.cfg.scheduling == "priority":
            return max(candidates, key=lambda r: (-r.priority, r.arrival, r.id))
        return candidates[-1]

    def _schedule(self, now: float) -> None:
        """Build and start the next step, or go idle."""
        budget = self.cfg.max_num_batched_tokens - self.decode_n
        chunks = self.chunks
        kv = self.kv
        preempted = False
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req.phase != PREFILL:
                continue
            chunk = min(req.target - req.computed, budget)
            while not kv.allocate(req.id, req.computed + chunk):
                victim = self._victim(spare=req)
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
            else:
                chunks.append((req, chunk))
                budget -= chunk
        if not preempted:
            budget = self._admit(budget, now)
        if chunks and self.decode_n:
            # Decode slots for this step; if prefills get preempted for them, the step may
            # end up decode-only, which is still a single step with its slots allocated.
            while not kv.advance_decoding(1):
                victim = self._victim()
                assert victim is not None
                self._preempt(victim)
            self._start_single(now)
        elif chunks:
            self._start_single(now)
        elif self.decode_n:
            self._start_run(now)
        elif self.waiting and not self.running:
            if not preempted:
                # Nothing runs and the head still does not fit: it never will. Refusing it may
                # let flow control dispatch here at once: that only joins the queue (as during
                # a step), and the schedule below takes it.
                head = (
                    self.waiting.popleft()
                    if isinstance(self.waiting, deque)
                    else self.waiting.pop(0)
                )
                was, self.stepping = self.stepping, True
                self._reject(head, now)
                self.stepping = was
            self._schedule(now)

    def _admit(self, budget: int, now: float) -> int:
        kv = self.kv
        bs = self.bs
        waiting = self.waiting
        seats = self.cfg.max_num_seqs - len(self.running)
        while waiting and budget > 0 and seats > 0:
            req = waiting[0]
            looked_up = -1
            if not req.kv_started:
                hit = kv.start(req.id, req.hashes, (req.target - 1) // bs)
                req.kv_started = True
                req.computed = hit * bs
                if req.kv_ready:
                    req.computed = max(req.computed, req.target - 1)
                looked_up = hit * bs
            chunk = min(req.target - req.computed, budget)
            if not kv.allocate(req.id, req.computed + chunk):
                kv.free(req.id)
                req.kv_started = False
                break
            if looked_up >= 0:
                # vLLM's prefix-cache counters: recorded at admission (a lookup whose blocks
                # did not fit is looked up again, not counted), a preempted request's
                # readmission apart from them (outside vllm:prefix_cache_queries). A token
                # slice's continuation is a new call: counted, preempted before or not.
                if req.readmitting:
                    req.readmitting = False
                else:
                    self.hit_tokens += looked_up
                    self.query_tokens += req.target
                if req.cached_tokens < 0:
                    req.cached_tokens = looked_up
            if isinstance(waiting, deque):
                waiting.popleft()
            else:
                waiting.pop(0)
            req.phase = PREFILL
            self.running.append(req)
            self.prefilling.append(req)
            self.chunks.append((req, chunk))
            budget -= chunk
            seats -= 1
        return budget

    def _start_single(self, now: float) -> None:
        p = sq = ctx = read = 0
        for req, chunk in self.chunks:
            done = req.computed
            p += chunk
            sq += chunk * chunk
            ctx += chunk * done
            read += done
            if done < req.high_water:
                recomputed = min(done + chunk, req.high_water) - done
                self.recomputed_tokens += recomputed
                req.recomputed_tokens += recomputed
            req.prefilled_tokens += chunk
        self.prefill_tokens += p
        dt = self.model.step_time(
            p, sq, ctx, self.decode_n, self.decode_ctx, read, len(self.chunks), now > self.last_end
        )
        self.run = None
        self.run_steps = 0
        self._start(now, dt)

    def _start_run(self, now: float) -> None:
        kv = self.kv
        limit = self.finishes[0][0] - self.decode_step if self.finishes else 1
        limit = max(1, limit)
        fit = kv.decode_capacity(limit)
        while fit == 0:
            victim = self._victim()
            assert victim is not None
            self._preempt(victim)
            if not self.decode_n:
                self._schedule(now)
                return
            fit = kv.decode_capacity(limit)
        self.run = self.model.decode_run(self.decode_n, self.decode_ctx)
        self.run_steps = fit
        self._start(now, self.run.time(fit))

    def _start(self, now: float, dt: float) -> None:
        self.busy = True
        self.step_start = now
        self.step_end = now + dt
        self.version += 1
        self.host.at(self.step_end, self)

    def _reject(self, req: Request, now: float) -> None:
        """A request that cannot fit in an empty cache: vLLM refuses it."""
        if req.kv_started:
            self.kv.free(req.id)
            req.kv_started = False
        req.rejected = True
        req.phase = DONE
        self.host.finished(req, now)
