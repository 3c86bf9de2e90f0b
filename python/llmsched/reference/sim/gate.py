"""Flow control in front of the router: the simulator's adapter to :mod:`llmsched.flow`.

Arrivals are offered to a :class:`llmsched.flow.FlowController` whose clock is the simulated
time; the simulator routes whatever it dispatches, feeds it every replica's metrics (its
saturation detector) and reports completions. Requests it refuses or lets expire are
rejected. Without ``flow.enabled`` arrivals go straight to the router.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from llmsched.errors import ConfigError
from llmsched.sim.request import Request

__all__ = ["FlowGate"]


class FlowGate:
    """A flow controller driven in simulated time."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        clock: Callable[[], float],
        replicas: int,
        slo: Mapping[int, Mapping[str, float]],
    ) -> None:
        try:
            # Imported by name: flow control is its own component and optional here.
            flow: Any = importlib.import_module("llmsched.flow")
        except ImportError:
            raise ConfigError("flow.enabled needs llmsched.flow, which is not installed") from None
        self._flow_request = flow.FlowRequest
        # Every replica starts idle.
        self.controller = flow.FlowController(config, clock=clock)
        for replica in range(replicas):
            self.endpoint(replica, 0, 0, 0.0, 0.0)
        self._slo = slo
        self.queued = 0

    def offer(self, req: Request, now: float) -> bool:
        """Queue ``req``; False when the controller refuses it at once."""
        ttft = self._slo.get(req.priority, {}).get("ttft_s")
        refused = self.controller.enqueue(
            self._flow_request(
                req.id,
                priority=req.priority,
                tenant=str(req.tenant),
                prompt_tokens=req.prompt_len,
                ttft_target=ttft,
                payload=req,
            ),
            now=now,
        )
        if refused is None:
            self.queued += 1
        return refused is None

    def ready(self, now: float) -> Iterator[Request]:
        """Requests the controller lets go now, in dispatch order."""
        while self.queued:
            decision = self.controller.dispatch(now=now)
            if decision is None:
                return
            self.queued -= 1
            yield decision.payload

    def expired(self, now: float) -> list[Request]:
        """Queued requests whose time to live ran out (or that were evicted)."""
        gone = list(self.controller.expire(now=now)) + list(self.controller.drain_evicted())
        self.queued -= len(gone)
        return [d.payload for d in gone]

    def endpoint(
        self, replica: int, waiting: int, running: int, kv_cache_usage: float, now: float
    ) -> None:
        """A replica's metrics, for the saturation detector."""
        self.controller.update_endpoint(
            str(replica),
            waiting=waiting,
            running=running,
            kv_cache_usage=min(kv_cache_usage, 1.0),
            timestamp=now,
        )

    def complete(self, req: Request, now: float) -> None:
        """``req`` finished: its in-flight share is freed and its tokens charged."""
        self.controller.complete(req.id, output_tokens=req.output_len, now=now)
