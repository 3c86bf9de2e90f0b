"""Pure-Python twin of :mod:`llmsched.flow`'s controller (oracle and benchmark baseline).

Naive on purpose: one list of queued items per band, linear scans for every choice. It makes
the same decisions as the Rust core, bit for bit, given the same calls: same tie-breaks, same
float arithmetic, same SplitMix64 draws. It takes a *resolved* config (the output of
:func:`llmsched.flow.resolve_config`) so it holds no defaults of its own, and names outcomes by
their snake_case keys (``Outcome.key``).

Flows idle (nothing queued, nothing running) for ``flow_idle_s`` are reclaimed at the next call
that takes ``now``; a new flow takes the lowest free number, and a tenant left without flows
frees its place in the tenant order the same way.

It makes a band for every priority it is given: the core's cap (256 bands besides the
configured ones, past which a new priority queues in the nearest band below it) is not
modelled, so calls with that many distinct priorities are outside what the twin answers for
(the core's own tests check the cap).

>>> from llmsched.flow import resolve_config
>>> config = resolve_config({"saturation": {"type": "concurrency", "max_requests": 2}})
>>> twin = FlowControllerTwin(config)
>>> twin.enqueue(1, 0, "a", 10, 100, None, None, None, 0.0) is None
True
>>> twin.dispatch(0.5).outcome
'dispatched'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmsched.errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError

_MASK = (1 << 64) - 1
_I32 = (-(2**31), 2**31 - 1)
_exp2: Callable[[float], float] = getattr(math, "exp2", lambda x: 2.0**x)
_LAS_REBASE_HALF_LIVES = 64.0


@dataclass
class TwinDecision:
    """A request leaving the queue; ``outcome`` is the outcome's snake_case key."""

    id: int
    outcome: str
    priority: int
    tenant: str
    tokens: int
    size_bytes: int
    wait_s: float
    payload: Any
    ticket: int | None = None


@dataclass
class _Item:
    id: int
    priority: int
    tenant: str
    tokens: int
    size_bytes: int
    arrival: float
    key: float
    seq: int
    payload: Any
    ticket: int | None = None


@dataclass
class _Running:
    priority: int
    tenant: str
    tokens: int
    dispatch_seq: int
    ticket: int | None = None


class SplitMix64:
    """Vigna's splitmix64, the shedding draw of the core.

    >>> hex(SplitMix64(0).next())
    '0xe220a8397b1dcdaf'
    """

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return (self.next() >> 11) * 2.0**-53


class _Band:
    def __init__(self, priority: int, settings: dict[str, Any]) -> None:
        self.priority = priority
        self.settings = settings
        self.fairness: str = settings["fairness"]["type"]
        self.fairness_params: dict[str, Any] = settings["fairness"]
        self.tenants: list[str | None] = []
        self.idle_since: list[float | None] = []
        self.items: list[_Item] = []
        self.counters: list[float] = []
        self.weights: list[float] = []
        self.backlogged: list[bool] = []
        self.service: list[int] = []
        self.flow_dispatched: list[int] = []
        self.ring: list[int] = []
        self.last_left = 0.0
        self.t_ref = 0.0
        self.dispatched = 0

    def flow_of(self, tenant: str) -> int:
        if tenant in self.tenants:
            return self.tenants.index(tenant)
        weight = float(self.fairness_params.get("weights", {}).get(tenant, 1.0))
        if None in self.tenants:
            flow = self.tenants.index(None)
            self.tenants[flow] = tenant
            self.counters[flow] = 0.0
            self.weights[flow] = weight
            self.backlogged[flow] = False
            self.service[flow] = 0
            self.flow_dispatched[flow] = 0
            return flow
        self.tenants.append(tenant)
        self.idle_since.append(None)
        self.counters.append(0.0)
        self.weights.append(weight)
        self.backlogged.append(False)
        self.service.append(0)
        self.flow_dispatched.append(0)
        return len(self.tenants) - 1

    def live_flows(self) -> list[int]:
        return [flow for flow, tenant in enumerate(self.tenants) if tenant is not None]

    def flow_items(self, flow: int) -> list[_Item]:
        return [item for item in self.items if item.tenant == self.tenants[flow]]

    def push(self, item: _Item) -> None:
        flow = self.flow_of(item.tenant)
        was_empty = not self.flow_items(flow)
        self.idle_since[flow] = None
        self.items.append(item)
        if was_empty:
            self._joined(flow)

    def remove(self, item: _Item, served_at: float | None) -> None:
        flow = self.tenants.index(item.tenant)
        self.items.remove(item)
        if served_at is not None:
            self.dispatched += 1
            self.flow_dispatched[flow] += 1
            self.service[flow] += item.tokens
            self.charge(flow, item.tokens, 0, served_at)
        if not self.flow_items(flow):
            self._left(flow)

    def _joined(self, flow: int) -> None:
        if self.fairness == "round-robin":
            self.ring.append(flow)
        elif self.fairness == "vtc":
            live = [self.counters[f] for f in self.live_flows() if self.backlogged[f]]
            floor = min(live) if live else self.last_left
            self.counters[flow] = max(self.counters[flow], floor)
        self.backlogged[flow] = True

    def _left(self, flow: int) -> None:
        if self.fairness == "round-robin":
            self.ring.remove(flow)
        elif self.fairness == "vtc":
            self.last_left = self.counters[flow]
        self.backlogged[flow] = False

    def charge(self, flow: int, prompt: int, output: int, now: float) -> None:
        p = self.fairness_params
        if self.fairness == "vtc":
            cost = (p["w_p"] * prompt + p["w_q"] * output) / self.weights[flow]
            self.counters[flow] = self.counters[flow] + cost
        elif self.fairness == "las":
            half_life = p["half_life_s"]
            if (now - self.t_ref) / half_life > _LAS_REBASE_HALF_LIVES:
                factor = _exp2(-(now - self.t_ref) / half_life)
                self.counters = [c * factor for c in self.counters]
                self.t_ref = now
            cost = (p["prompt_weight"] * prompt + p["completion_weight"] * output) / self.weights[
                flow
            ]
            scale = _exp2((now - self.t_ref) / half_life)
            self.counters[flow] = self.counters[flow] + cost * scale

    def counter(self, flow: int, now: float) -> float | None:
        if self.fairness == "vtc":
            return self.counters[flow]
        if self.fairness == "las":
            half_life: float = self.fairness_params["half_life_s"]
            return self.counters[flow] * _exp2(-(now - self.t_ref) / half_life)
        return None

    def pick(self) -> int:
        if self.fairness == "strict":
            best = min(self.items, key=lambda item: (item.key, item.seq))
            return self.tenants.index(best.tenant)
        if self.fairness == "round-robin":
            flow = self.ring.pop(0)
            self.ring.append(flow)
            return flow
        live = [f for f in self.live_flows() if self.backlogged[f]]
        return min(live, key=lambda f: (self.counters[f], f))

    def head(self, flow: int) -> _Item:
        return min(self.flow_items(flow), key=lambda item: (item.key, item.seq))

    def bytes(self) -> int:
        return sum(item.size_bytes for item in self.items)


class FlowControllerTwin:
    """The naive flow controller; same calls as ``llmsched._llmsched.FlowCore``."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.bands: dict[int, _Band] = {}
        self.queued: dict[int, _Item] = {}
        self.running: dict[int, _Running] = {}
        self.endpoints: dict[str, tuple[int, int, float, float]] = {}
        self.evicted: list[TwinDecision] = []
        self.counts: dict[str, int] = {}
        self.tenant_order: list[str | None] = []
        self.flows_reclaimed = 0
        self.clock = -math.inf
        self.seq = 0
        shedding = config["shedding"]
        self.rng = SplitMix64(shedding.get("seed", 0))
        self.pending_victims: set[int] = set()
        self.next_victims_at = 0.0
        for band in config["bands"]:
            self._band(band["priority"])

    # -- helpers ---------------------------------------------------------------------------

    def _settings(self, priority: int) -> dict[str, Any]:
        for band in self.config["bands"]:
            if band["priority"] == priority:
                return band  # type: ignore[no-any-return]
        return self.config["default_band"]  # type: ignore[no-any-return]

    def _band(self, priority: int) -> _Band:
        if priority not in self.bands:
            self.bands[priority] = _Band(priority, self._settings(priority))
        return self.bands[priority]

    def _advance(self, now: float) -> float:
        if not math.isfinite(now):
            raise InvalidRequestError(f"now must be a finite number, got {now}")
        self.clock = max(self.clock, now)
        self._reclaim(self.clock)
        return self.clock

    def _note_if_idle(self, priority: int, tenant: str, now: float) -> None:
        band = self.bands[priority]
        flow = band.tenants.index(tenant)
        running = any(r.priority == priority and r.tenant == tenant for r in self.running.values())
        if not band.flow_items(flow) and not running:
            band.idle_since[flow] = now

    def _reclaim(self, now: float) -> None:
        idle_s = self.config["flow_idle_s"]
        if idle_s is None:
            return
        for band in self.bands.values():
            for flow in band.live_flows():
                since = band.idle_since[flow]
                if since is not None and since + idle_s <= now:
                    band.tenants[flow] = None
                    band.idle_since[flow] = None
                    self.flows_reclaimed += 1
        alive = {t for band in self.bands.values() for t in band.tenants if t is not None}
        self.tenant_order = [t if t in alive else None for t in self.tenant_order]

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def ceiling(self, priority: int) -> float:
        """The ceiling of an existing band."""
        band = self.bands[priority]
        if band.settings["ceiling"] is not None:
            return float(band.settings["ceiling"])
        rank = sorted(self.bands, reverse=True).index(priority)
        policy = self.config["ceilings"]
        if policy["type"] == "static":
            return float(policy["ceiling"])
        return float(max(policy["top"] - policy["step"] * rank, policy["floor"]))

    def saturation_state(self, now: float) -> tuple[float, bool]:
        detector = self.config["saturation"]
        if detector["type"] == "concurrency":
            by_requests = by_tokens = 0.0
            if detector["max_requests"] is not None:
                by_requests = len(self.running) / detector["max_requests"]
            if detector["max_tokens"] is not None:
                tokens = sum(r.tokens for r in self.running.values())
                by_tokens = tokens / detector["max_tokens"]
            return max(by_requests, by_tokens), False
        total, counted = 0.0, 0
        for name in sorted(self.endpoints):
            waiting, _running, kv_usage, timestamp = self.endpoints[name]
            value = max(waiting / detector["queue_threshold"], kv_usage / detector["kv_threshold"])
            if now - timestamp > detector["staleness_s"]:
                if detector["stale_policy"] == "saturated":
                    value = 1.0
                elif detector["stale_policy"] == "ignore":
                    continue
            total += value
            counted += 1
        if counted == 0:
            return 1.0, True
        return total / counted, False

    def _shed(self, saturation: float) -> bool:
        policy = self.config["shedding"]
        if policy["type"] == "probabilistic":
            draw = self.rng.uniform()
            power: float = policy["power"]
            scale: float = policy["scale"]
            probability = min(float(max(saturation, 0.0) ** power) * scale, 1.0)
            return draw < probability
        if policy["type"] == "threshold":
            return bool(saturation >= policy["threshold"])
        return False

    def _decision(self, item: _Item, outcome: str, now: float) -> TwinDecision:
        self._count(outcome)
        return TwinDecision(
            item.id,
            outcome,
            item.priority,
            item.tenant,
            item.tokens,
            item.size_bytes,
            now - item.arrival,
            item.payload,
            item.ticket,
        )

    def _evict(self, request_id: int, outcome: str, now: float) -> TwinDecision:
        item = self.queued.pop(request_id)
        self.bands[item.priority].remove(item, None)
        self._note_if_idle(item.priority, item.tenant, now)
        return self._decision(item, outcome, now)

    def _expire_into(self, now: float, out: list[TwinDecision]) -> None:
        for band in list(self.bands.values()):
            ttl = band.settings["ttl_s"]
            if ttl is None:
                continue
            for item in sorted(band.items, key=lambda it: it.seq):
                if item.arrival + ttl > now:
                    break
                out.append(self._evict(item.id, "evicted_ttl", now))

    def _victims(self, priority: int, size_bytes: int) -> list[int] | None:
        """Queued requests to evict so the arrival fits, [] when it fits, None when it can't."""
        settings = self._settings(priority)
        band = self.bands.get(priority)
        queued = len(band.items) if band else 0
        held = band.bytes() if band else 0
        if settings["max_requests"] is not None and queued >= settings["max_requests"]:
            return None
        if settings["max_bytes"] is not None and held + size_bytes > settings["max_bytes"]:
            return None
        limits = self.config["global"]
        total_bytes = sum(item.size_bytes for item in self.queued.values())
        over_requests = over_bytes = 0
        if limits["max_requests"] is not None:
            over_requests = max(0, len(self.queued) + 1 - limits["max_requests"])
        if limits["max_bytes"] is not None:
            over_bytes = max(0, total_bytes + size_bytes - limits["max_bytes"])
        if over_requests == 0 and over_bytes == 0:
            return []
        if not self.config["preemption"]["evict_queued"]:
            return None
        victims: list[int] = []
        freed_requests = freed_bytes = 0
        for p in sorted(self.bands):
            if p >= priority:
                break
            for item in sorted(self.bands[p].items, key=lambda it: -it.seq):
                if freed_requests >= over_requests and freed_bytes >= over_bytes:
                    return victims
                victims.append(item.id)
                freed_requests += 1
                freed_bytes += item.size_bytes
        if freed_requests >= over_requests and freed_bytes >= over_bytes:
            return victims
        return None

    def _top_band(self) -> _Band | None:
        live = [p for p, band in self.bands.items() if band.items]
        return self.bands[max(live)] if live else None

    # -- the FlowCore interface -----------------------------------------------------------

    def enqueue(
        self,
        request_id: int,
        priority: int,
        tenant: str,
        tokens: int,
        size_bytes: int,
        deadline: float | None,
        ttft_target: float | None,
        payload: Any,
        now: float,
        ticket: int | None = None,
    ) -> str | None:
        """None when queued, else the refusal outcome key; ``ticket`` comes back on the
        request's decision."""
        for name, value in (("id", request_id), ("tokens", tokens), ("size_bytes", size_bytes)):
            if value < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {value}")
        if not _I32[0] <= priority <= _I32[1]:
            raise InvalidRequestError(f"priority must fit in 32 bits, got {priority}")
        if deadline is not None and not math.isfinite(deadline):
            raise InvalidRequestError(f"deadline must be finite, got {deadline}")
        if ttft_target is not None and not (math.isfinite(ttft_target) and ttft_target >= 0):
            raise InvalidRequestError(f"ttft_target must be finite and >= 0, got {ttft_target}")
        if not math.isfinite(now):
            raise InvalidRequestError(f"now must be a finite number, got {now}")
        if request_id in self.queued or request_id in self.running:
            raise DuplicateRequestError(f"request {request_id} is already queued or running")
        now = self._advance(now)
        self._expire_into(now, self.evicted)
        saturation, no_endpoints = self.saturation_state(now)
        outcome = None
        victims: list[int] | None = []
        if no_endpoints:
            outcome = "rejected_no_endpoints"
        elif priority < 0 and self._shed(saturation):
            outcome = "rejected_shed"
        else:
            victims = self._victims(priority, size_bytes)
            if victims is None:
                outcome = "rejected_capacity"
        if outcome is not None:
            self._count(outcome)
            return outcome
        band = self._band(priority)
        for victim in victims or []:
            self.evicted.append(self._evict(victim, "evicted_preempted", now))
        if tenant not in self.tenant_order:
            if None in self.tenant_order:
                self.tenant_order[self.tenant_order.index(None)] = tenant
            else:
                self.tenant_order.append(tenant)
        ordering = band.settings["ordering"]
        if ordering["type"] == "edf":
            key = math.inf if deadline is None else deadline
        elif ordering["type"] == "slo-deadline":
            key = now + (ordering["default_ttft_s"] if ttft_target is None else ttft_target)
        else:
            key = 0.0
        seq = self._next_seq()
        item = _Item(
            request_id, priority, tenant, tokens, size_bytes, now, key, seq, payload, ticket
        )
        band.push(item)
        self.queued[request_id] = item
        return None

    def dispatch(self, now: float) -> TwinDecision | None:
        now = self._advance(now)
        self._expire_into(now, self.evicted)
        saturation, no_endpoints = self.saturation_state(now)
        band = self._top_band()
        if band is None or no_endpoints or saturation >= self.ceiling(band.priority):
            return None
        flow = band.pick()
        item = band.head(flow)
        del self.queued[item.id]
        band.remove(item, now)
        dispatch_seq = self._next_seq()
        self.running[item.id] = _Running(
            item.priority, item.tenant, item.tokens, dispatch_seq, item.ticket
        )
        return self._decision(item, "dispatched", now)

    def cancel(self, request_id: int, now: float, ticket: int | None = None) -> TwinDecision | None:
        """Evicts the queued request (given ``ticket``, only the one enqueued with it)."""
        now = self._advance(now)
        item = self.queued.get(request_id)
        if item is None or (ticket is not None and item.ticket != ticket):
            return None
        return self._evict(request_id, "evicted_cancelled", now)

    def expire(self, now: float) -> list[TwinDecision]:
        now = self._advance(now)
        out: list[TwinDecision] = []
        self._expire_into(now, out)
        return out

    def drain_evicted(self) -> list[TwinDecision]:
        out, self.evicted = self.evicted, []
        return out

    def has_evicted(self) -> bool:
        return bool(self.evicted)

    def _charge_output(self, request_id: int, output_tokens: int, now: float) -> None:
        running = self.running[request_id]
        band = self.bands[running.priority]
        flow = band.tenants.index(running.tenant)
        band.service[flow] += output_tokens
        band.charge(flow, 0, output_tokens, now)

    def record_output(
        self, request_id: int, output_tokens: int, now: float, ticket: int | None = None
    ) -> bool:
        """Charges streamed output of the running request; given ``ticket``, only the one
        enqueued with it (False, charging nothing, when the id runs for another enqueue)."""
        if output_tokens < 0:
            raise InvalidRequestError(f"output_tokens must be >= 0, got {output_tokens}")
        if not math.isfinite(now):
            raise InvalidRequestError(f"now must be a finite number, got {now}")
        if request_id not in self.running:
            raise UnknownRequestError(f"request {request_id} is not running")
        if ticket is not None and self.running[request_id].ticket != ticket:
            return False
        now = self._advance(now)
        self._charge_output(request_id, output_tokens, now)
        return True

    def complete(
        self, request_id: int, output_tokens: int, now: float, ticket: int | None = None
    ) -> bool:
        """Completes the running request; given ``ticket``, only the one enqueued with it
        (False, changing nothing, when the id runs for another enqueue: a stale release)."""
        if output_tokens < 0:
            raise InvalidRequestError(f"output_tokens must be >= 0, got {output_tokens}")
        if not math.isfinite(now):
            raise InvalidRequestError(f"now must be a finite number, got {now}")
        if request_id not in self.running:
            raise UnknownRequestError(f"request {request_id} is not running")
        if ticket is not None and self.running[request_id].ticket != ticket:
            return False
        now = self._advance(now)
        self._charge_output(request_id, output_tokens, now)
        finished = self.running.pop(request_id)
        self._note_if_idle(finished.priority, finished.tenant, now)
        if request_id in self.pending_victims:
            self.pending_victims.discard(request_id)
            if not self.pending_victims:
                self.next_victims_at = now + self.config["preemption"]["pacing_s"]
        return True

    def preemption_victims(self, now: float) -> list[int]:
        now = self._advance(now)
        limit = self.config["preemption"]["max_victims"]
        if limit == 0 or self.pending_victims or now < self.next_victims_at:
            return []
        self._expire_into(now, self.evicted)
        saturation, no_endpoints = self.saturation_state(now)
        band = self._top_band()
        if band is None or no_endpoints or saturation < self.ceiling(band.priority):
            return []
        candidates = sorted(
            (r.priority, -r.dispatch_seq, request_id)
            for request_id, r in self.running.items()
            if r.priority < 0 and r.priority < band.priority
        )
        victims = [request_id for _, _, request_id in candidates[:limit]]
        self.pending_victims.update(victims)
        return victims

    def update_endpoint(
        self, endpoint: str, waiting: int, running: int, kv_usage: float, timestamp: float
    ) -> None:
        if waiting < 0 or running < 0:
            raise InvalidRequestError("waiting and running must be >= 0")
        if not math.isfinite(timestamp):
            raise InvalidRequestError(f"timestamp must be a finite number, got {timestamp}")
        if not (math.isfinite(kv_usage) and 0.0 <= kv_usage <= 1.0):
            raise InvalidRequestError(f"kv_usage must be in [0, 1], got {kv_usage}")
        if self.config["saturation"]["type"] == "utilization":
            self.endpoints[endpoint] = (waiting, running, kv_usage, timestamp)

    def remove_endpoint(self, endpoint: str) -> bool:
        return self.endpoints.pop(endpoint, None) is not None

    def saturation(self, now: float) -> float:
        return self.saturation_state(self._advance(now))[0]

    def jain_index(self, priority: int | None = None) -> float:
        if priority is None:
            per_tenant = {t: 0 for t in self.tenant_order if t is not None}
            for band in self.bands.values():
                for flow in band.live_flows():
                    owner = band.tenants[flow]
                    assert owner is not None
                    per_tenant[owner] += band.service[flow]
            values = [float(v) for v in per_tenant.values()]
        elif priority in self.bands:
            band = self.bands[priority]
            values = [float(band.service[f]) for f in band.live_flows()]
        else:
            return 1.0
        total = sum_sq = 0.0
        for x in values:  # plain left-to-right sums, as the core adds them
            total += x
            sum_sq += x * x
        if not values or sum_sq == 0.0:
            return 1.0
        return total * total / (len(values) * sum_sq)

    def flow_metrics(self, now: float) -> list[tuple[str, int, int, int, int, float | None]]:
        """(tenant, priority, queued, dispatched, service tokens, fairness counter) per flow,
        bands from the highest priority down, flows in creation order."""
        now = self._advance(now)
        out = []
        for priority in sorted(self.bands, reverse=True):
            band = self.bands[priority]
            for flow in band.live_flows():
                tenant = band.tenants[flow]
                assert tenant is not None
                queued = len(band.flow_items(flow))
                dispatched = band.flow_dispatched[flow]
                out.append(
                    (
                        tenant,
                        priority,
                        queued,
                        dispatched,
                        band.service[flow],
                        band.counter(flow, now),
                    )
                )
        return out

    def running_count(self) -> int:
        return len(self.running)

    def is_queued(self, request_id: int) -> bool:
        return request_id in self.queued

    def is_running(self, request_id: int) -> bool:
        return request_id in self.running

    def __len__(self) -> int:
        return len(self.queued)
