"""Routing policies as the simulator calls them: a thin adapter over :class:`llmsched.Router`.

The simulator asks a :class:`Policy` for each request's replica (and prefill replica when
prefill/decode pools exist), tells it about first tokens and finishes (in-flight accounting),
and feeds it engine metrics. The prefix index the policies read is the simulation's
:class:`llmsched.PrefixIndex`, fed by the replicas' KV events.

>>> {"random", "round-robin", "least-load", "prefix-only"} <= set(policy_names())
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from llmsched.errors import ConfigError
from llmsched.routing import ConfigLike, Endpoint, EndpointPool, Role, Router
from llmsched.sim.request import Request

if TYPE_CHECKING:
    from llmsched.sim.simulator import Simulation

__all__ = [
    "Policy",
    "PolicyLike",
    "RouterPolicy",
    "make_policy",
    "policy_names",
    "resolve_policy",
]


class Policy(Protocol):
    """What the simulator needs from a router."""

    name: str

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
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


PolicyLike = str | Mapping[str, Any] | Policy
"""A policy as scenarios name it: a router preset, ``{"name": ..., "config": <router config>}``,
or a :class:`Policy` object."""


class RouterPolicy:
    """A :class:`llmsched.routing.Router` driving the simulation: every replica is an endpoint
    (role ``prefill``/``decode`` when pools are split) whose metrics the replicas publish;
    the router matches prompts against the simulation's prefix index and keeps its in-flight
    counts through the decision's ``started`` / ``first_token`` / ``finished``.

    Metrics are never stale in simulated time (each replica republishes whenever they
    change), so the pool reads them as they are (``stale_policy="ignore"``).
    """

    def __init__(self, name: str, config: ConfigLike, sim: Simulation) -> None:
        roles: list[Role | None] = [
            None if r == "both" else cast(Role, r) for r in sim.config.roles()
        ]
        endpoints = [Endpoint(i, role=role) for i, role in enumerate(roles)]
        self.name = name
        self.pool = EndpointPool(endpoints, stale_policy="ignore")
        self.router = Router(self.pool, sim.index, config=config, seed=sim.config.seed)

    def update_metrics(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
    ) -> None:
        """Forward a metrics snapshot to the pool."""
        self.pool.update(
            replica,
            waiting=waiting,
            running=running,
            kv_cache_usage=min(kv_cache_usage, 1.0),
            now=now,
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


def policy_names() -> list[str]:
    """Names :func:`make_policy` accepts: the router's presets."""
    return list(Router.presets())


def make_policy(spec: PolicyLike, sim: Simulation) -> Policy:
    """The policy ``spec`` names: a router preset name, ``{"name": ..., "config": <llm-d style
    router config or preset>}``, or a :class:`Policy` object used as it is."""
    if not isinstance(spec, (str, Mapping)):
        if all(hasattr(spec, m) for m in ("pick", "on_finished", "update_metrics")):
            return spec
        raise ConfigError(f"policy must be a name, a router config or a Policy, got {spec!r}")
    name, config = resolve_policy(spec)
    return RouterPolicy(name, config, sim)


def resolve_policy(spec: str | Mapping[str, Any]) -> tuple[str, ConfigLike]:
    """(name, router config) of a policy given by name or as ``{"name", "config"}``.

    >>> resolve_policy({"name": "mine", "config": "llm-d"})
    ('mine', 'llm-d')
    """
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"name", "config"})
        if unknown or "name" not in spec:
            raise ConfigError(f"policy entries need 'name' (and may give 'config'), got {spec}")
        name, config = str(spec["name"]), spec.get("config", spec["name"])
    else:
        name, config = spec, spec
    if isinstance(config, str) and config not in policy_names():
        raise ConfigError(f"unknown policy {config!r}; known: {policy_names()}")
    return name, config
