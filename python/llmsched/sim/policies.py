"""Routing policies as the simulator calls them: a thin adapter over the library's deciders.

The simulator asks a :class:`Policy` for each request's replica (and prefill replica when
prefill/decode pools exist), tells it about first tokens and finishes (in-flight accounting),
and feeds it engine metrics. The prefix index the policies read is the simulation's
:class:`llmsched.PrefixIndex`, fed by the replicas' KV events.

>>> {"random", "round-robin", "least-load", "prefix-only"} <= set(policy_names())
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmsched.errors import ConfigError
from llmsched.sim.request import Request

if TYPE_CHECKING:
    from llmsched.sim.simulator import Simulation

__all__ = ["Policy", "make_policy", "policy_names"]


class Policy(Protocol):
    """What the simulator needs from a router."""

    name: str

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_usage: float, now: float
    ) -> None:
        """An engine's metrics as the gateway now sees them (published at ``now``)."""
        ...

    def pick(self, req: Request, now: float) -> tuple[int, int | None]:
        """(replica that decodes, prefill replica or None) for ``req``."""
        ...

    def on_first_token(self, req: Request, now: float) -> None:
        """``req`` produced its first token."""
        ...

    def on_finished(self, req: Request, now: float) -> None:
        """``req`` completed."""
        ...


class _IndexPolicy:
    """Policies that need only the prefix index and in-flight counts."""

    def __init__(self, name: str, sim: Simulation) -> None:
        self.name = name
        self.index = sim.index
        roles = sim.config.roles()
        self.decoders = np.array([i for i, r in enumerate(roles) if r != "prefill"])
        self.prefillers = np.array([i for i, r in enumerate(roles) if r == "prefill"])
        self.rng = np.random.default_rng(sim.config.seed)
        self.inflight = np.zeros(len(roles), dtype=np.int64)
        self._rr = 0

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_usage: float, now: float
    ) -> None:
        """These policies use their own in-flight counts instead."""

    def _least(self, candidates: np.ndarray) -> int:
        load = self.inflight[candidates]
        best = candidates[load == load.min()]
        return int(best[self.rng.integers(len(best))])

    def _choose(self, req: Request, now: float) -> int:
        if self.name == "random":
            return int(self.decoders[self.rng.integers(len(self.decoders))])
        if self.name == "round-robin":
            self._rr += 1
            return int(self.decoders[self._rr % len(self.decoders)])
        if self.name == "least-load":
            return self._least(self.decoders)
        match = self.index.match(req.hashes[: req.prompt_len // self.index.block_size], now=now)
        held = dict(zip(match.workers, match.blocks.tolist(), strict=True))
        blocks = np.array([held.get(int(r), 0) for r in self.decoders])
        best = self.decoders[blocks == blocks.max()]
        return self._least(best)

    def pick(self, req: Request, now: float) -> tuple[int, int | None]:
        """The choice, plus the least-loaded prefill replica when pools are split."""
        target = self._choose(req, now)
        self.inflight[target] += 1
        prefill = None
        if len(self.prefillers):
            prefill = self._least(self.prefillers)
            self.inflight[prefill] += 1
        req.handle = (target, prefill)
        return target, prefill

    def on_first_token(self, req: Request, now: float) -> None:
        """Prefill work is over: the prefill replica's in-flight count drops."""
        _, prefill = req.handle
        if prefill is not None:
            self.inflight[prefill] -= 1

    def on_finished(self, req: Request, now: float) -> None:
        """The request leaves its replica."""
        target, _ = req.handle
        self.inflight[target] -= 1


class RouterPolicy:
    """A :class:`llmsched.routing.Router` driving the simulation: every replica is an endpoint
    (role ``prefill``/``decode`` when pools are split) whose metrics the replicas publish;
    the router matches prompts against the simulation's prefix index and keeps its in-flight
    counts through the decision's ``started`` / ``first_token`` / ``finished``.

    Metrics are never stale in simulated time (each replica republishes whenever they
    change), so the pool reads them as they are (``stale_policy="ignore"``).
    """

    def __init__(self, name: str, config: Any, sim: Simulation) -> None:
        routing = _routing()
        assert routing is not None
        Endpoint, EndpointPool, Router = routing.Endpoint, routing.EndpointPool, routing.Router
        roles = sim.config.roles()
        endpoints = [Endpoint(i, role=None if r == "both" else r) for i, r in enumerate(roles)]
        self.name = name
        self.pool = EndpointPool(endpoints, stale_policy="ignore")
        self.router = Router(self.pool, sim.index, config=config, seed=sim.config.seed)

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_usage: float, now: float
    ) -> None:
        """Forward a metrics snapshot to the pool."""
        self.pool.update(
            replica, waiting=waiting, running=running, kv_cache_usage=min(kv_usage, 1.0), now=now
        )

    def pick(self, req: Request, now: float) -> tuple[int, int | None]:
        """Route with the router and start the decision's in-flight accounting."""
        session = None if req.session is None else str(req.session)
        decision = self.router.pick(
            tokens=req.tokens, priority=req.priority, session_id=session, now=now
        )
        decision.started(now=now)
        req.handle = decision
        prefill = decision.prefill_endpoint
        return int(decision.endpoint), None if prefill is None else int(prefill)

    def on_first_token(self, req: Request, now: float) -> None:
        """Prefill work is over."""
        req.handle.first_token()

    def on_finished(self, req: Request, now: float) -> None:
        """The request's in-flight counts go back."""
        req.handle.finished()


def _routing() -> Any:
    """:mod:`llmsched.routing` (issue 3), or None where it is not installed yet."""
    try:
        return importlib.import_module("llmsched.routing")
    except ImportError:
        return None


def _router_presets() -> list[str] | None:
    routing = _routing()
    return None if routing is None else list(routing.Router.presets())


_INDEX_POLICIES = ("random", "round-robin", "least-load", "prefix-only")


def policy_names() -> list[str]:
    """Names :func:`make_policy` accepts (the router's presets)."""
    presets = _router_presets()
    return presets if presets is not None else list(_INDEX_POLICIES)


def make_policy(spec: Any, sim: Simulation) -> Policy:
    """The policy ``spec`` names: a router preset name, ``{"name": ..., "config": <llm-d style
    router config or preset>}``, or a :class:`Policy` object used as it is."""
    if not isinstance(spec, (str, dict)):
        if all(hasattr(spec, m) for m in ("pick", "on_finished", "update_metrics")):
            policy: Policy = spec
            return policy
        raise ConfigError(f"policy must be a name, a router config or a Policy, got {spec!r}")
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {"name", "config"})
        if unknown or "name" not in spec:
            raise ConfigError(f"policy entries need 'name' (and may give 'config'), got {spec}")
        name, config = str(spec["name"]), spec.get("config", spec["name"])
    else:
        name, config = spec, spec
    presets = _router_presets()
    if presets is not None:
        if isinstance(config, str) and config not in presets:
            raise ConfigError(f"unknown policy {config!r}; known: {presets}")
        return RouterPolicy(name, config, sim)
    if name in _INDEX_POLICIES:
        return _IndexPolicy(name, sim)
    raise ConfigError(f"unknown policy {name!r}; known: {policy_names()}")
