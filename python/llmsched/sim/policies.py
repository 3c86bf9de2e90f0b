"""Routing policies as the simulator names them: router presets, router configurations, or
:class:`Policy` objects.

The simulator asks a :class:`Policy` for each request's replica (and prefill replica when
prefill/decode pools exist), tells it about first tokens and finishes (in-flight accounting),
and feeds it engine metrics. Presets and router configurations run inside the Rust engine on
the routing core; a :class:`Policy` object is Python code that the Rust engine calls back (the
GIL taken for each call only) where the reference engine (:mod:`llmsched.reference.sim`) calls
it, handing it :class:`~llmsched.sim.request.Request` objects that hold the request's state at
each call (``docs/simulator.md`` lists what they carry); a failed call raises
:class:`~llmsched.errors.PolicyError`.

>>> {"random", "round-robin", "least-load", "prefix-only"} <= set(policy_names())
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from llmsched.errors import ConfigError
from llmsched.routing import ConfigLike, Router
from llmsched.sim.request import Request

__all__ = [
    "Policy",
    "PolicyLike",
    "is_policy_object",
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


def policy_names() -> list[str]:
    """Names :func:`make_policy` accepts: the router's presets."""
    return list(Router.presets())


def is_policy_object(spec: object) -> bool:
    """Whether ``spec`` is a :class:`Policy` object (not a name or a router config).

    >>> is_policy_object("llm-d"), is_policy_object({"name": "x"})
    (False, False)
    """
    if isinstance(spec, (str, Mapping)):
        return False
    if all(hasattr(spec, m) for m in ("pick", "on_finished", "update_metrics")):
        return True
    raise ConfigError(f"policy must be a name, a router config or a Policy, got {spec!r}")


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
