"""The reference engine's router: a :class:`llmsched.Router` behind the simulator's
:class:`~llmsched.sim.policies.Policy` interface.

The prefix index the router reads is the reference engine's :class:`llmsched.PrefixIndex`,
fed by the replicas' KV events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from llmsched.errors import ConfigError
from llmsched.prefix_index import PrefixIndex
from llmsched.routing import ConfigLike, Endpoint, EndpointPool, Role, Router
from llmsched.sim.policies import Policy, PolicyLike, resolve_policy
from llmsched.sim.request import Request

__all__ = ["RouterPolicy", "make_policy"]


class RouterPolicy:
    """A :class:`llmsched.routing.Router` driving the simulation: every replica is an endpoint
    (role ``prefill``/``decode`` when pools are split) whose metrics the replicas publish;
    the router matches prompts against the simulation's prefix index and keeps its in-flight
    counts through the decision's ``started`` / ``first_token`` / ``finished``.

    Metrics are never stale in simulated time (each replica republishes whenever they
    change), so the pool reads them as they are (``stale_policy="ignore"``).
    """

    def __init__(
        self,
        name: str,
        config: ConfigLike,
        *,
        roles: Sequence[str],
        index: PrefixIndex,
        seed: int,
    ) -> None:
        pool_roles: list[Role | None] = [None if r == "both" else cast(Role, r) for r in roles]
        endpoints = [Endpoint(i, role=role) for i, role in enumerate(pool_roles)]
        self.name = name
        self.pool = EndpointPool(endpoints, stale_policy="ignore")
        self.router = Router(self.pool, index, config=config, seed=seed)

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


def make_policy(spec: PolicyLike, *, roles: Sequence[str], index: PrefixIndex, seed: int) -> Policy:
    """The policy ``spec`` names: a router preset name, ``{"name": ..., "config": <llm-d style
    router config or preset>}``, or a :class:`Policy` object used as it is."""
    if not isinstance(spec, (str, Mapping)):
        if all(hasattr(spec, m) for m in ("pick", "on_finished", "update_metrics")):
            return spec
        raise ConfigError(f"policy must be a name, a router config or a Policy, got {spec!r}")
    name, config = resolve_policy(spec)
    return RouterPolicy(name, config, roles=roles, index=index, seed=seed)
