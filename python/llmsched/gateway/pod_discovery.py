"""Kubernetes discovery in ``llmsched serve`` (``discovery.kubernetes``), for either data plane.

:class:`PodDiscovery` runs a :class:`~llmsched.integrations.kubernetes.KubernetesDiscovery` for
a gateway and hands each new engine set to the gateway's ``set_engines``, the path a discovery
file's engines take, so the pool, the prefix index, the KV-event subscriber, health and flow
control follow the pods as they follow the file. The differences from the file:

- **No engines until the first list.** The gateway starts with none: ``/ready`` answers 503
  and requests get a 503 ``no engine is available`` (``x-llmsched-dropped-reason:
  no-endpoints``) until the API server has answered, however long it is down.
- **An empty set is taken.** No Ready pod is no engine (the API server's word, where an empty
  file is a mistake): the engines leave routing, and requests get the 503 above.
- **Errors never end it.** API trouble is retried by the watcher with backoff and counted in
  its counters; a set the gateway refuses (``set_engines`` raised) keeps the current engines,
  counts as a discovery error (``llmsched_gateway_discovery_errors_total``) and is offered
  again after a pause.

The watcher's :meth:`PodDiscovery.stats` (counters, skipped pods, whether the first list came)
is on each plane's ``/metrics`` as ``llmsched_gateway_kubernetes_*``
(:func:`~llmsched.gateway.metrics.kubernetes_metrics_text`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypedDict

from llmsched._aio import cancel_and_wait
from llmsched.gateway.config import KubernetesConfig
from llmsched.integrations import EngineSpec

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

    from llmsched.integrations.kubernetes import KubernetesDiscovery

__all__ = ["EngineReceiver", "PodDiscovery", "PodDiscoveryStats"]

log = logging.getLogger("llmsched.gateway")


class EngineReceiver(Protocol):
    """A gateway whose engines discovery replaces (either data plane)."""

    async def set_engines(
        self, engines: Iterable[EngineSpec], *, allow_empty: bool = False
    ) -> tuple[list[str], list[str]]:
        """Replaces the engines; returns the worker ids added and removed."""
        ...


class PodDiscoveryStats(TypedDict):
    """What :meth:`PodDiscovery.stats` reports."""

    synced: bool
    """Whether the first list of pods has been offered to the gateway."""
    engines: int
    """Engines the gateway took from the pods last (0 before the first list)."""
    counters: dict[str, int]
    """The watcher's :meth:`~llmsched.integrations.kubernetes.KubernetesDiscovery.counters`."""
    skipped_pods: dict[str, str]
    """Ready pods left out of the engines, each with why."""


class PodDiscovery:
    """Keeps a gateway's engines those of the pods ``config`` selects (see the module doc).

    ``on_error`` is called for each engine set the gateway refused (the gateway counts it).
    :meth:`start` loads the API client and starts the watcher; :meth:`stop` cancels it and
    closes the client.
    """

    def __init__(
        self,
        config: KubernetesConfig,
        gateway: EngineReceiver,
        *,
        on_error: Callable[[], None],
    ) -> None:
        self.config = config
        self._gateway = gateway
        self._on_error = on_error
        self._watcher: KubernetesDiscovery | None = None
        self._client: ApiClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Loads the API client and starts watching. ConfigError when the ``kubernetes``
        extra is missing or the client cannot be loaded (the kubeconfig, or the in-cluster
        service account outside a cluster); an API server that does not answer is no error
        (the watcher retries, the gateway has no engines meanwhile)."""
        selector = self.config.pod_selector()  # ConfigError naming the extra when missing
        from llmsched.integrations.kubernetes import KubernetesDiscovery, load_api_client

        kubeconfig = self.config.kubeconfig
        self._client = await load_api_client(None if kubeconfig is None else str(kubeconfig))
        config = self.config
        self._watcher = KubernetesDiscovery(
            selector,
            self._hand_over,
            api_client=self._client,
            resync_s=config.resync_s,
            watch_timeout_s=config.watch_timeout_s,
            request_timeout_s=config.request_timeout_s,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            settle_s=config.settle_s,
        )
        self._task = asyncio.create_task(self._watch(self._watcher))

    async def stop(self) -> None:
        """Ends the watcher and closes the API client (a no-op when not started). The
        watcher's own stop: a cancellation the HTTP client turned into a TimeoutError ends
        it too, instead of being retried as a timeout (and logged as one)."""
        task, self._task = self._task, None
        if task is not None:
            if self._watcher is not None:
                await self._watcher.stop()
            await cancel_and_wait(task)  # not started yet, or already ended
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _watch(self, watcher: KubernetesDiscovery) -> None:
        try:
            await watcher.run()
        except Exception:
            # The watcher retries whatever the server does; this is a bug, and the gateway
            # goes on with the engines it has rather than dying with it.
            log.exception("kubernetes discovery stopped; the current engines stay")
            self._on_error()

    async def _hand_over(self, engines: tuple[EngineSpec, ...]) -> None:
        try:
            await self._gateway.set_engines(engines, allow_empty=True)
        except Exception:
            # Raised on: the watcher logs it, keeps the set it had and offers this one again.
            self._on_error()
            raise

    def stats(self) -> PodDiscoveryStats:
        """Whether the first list came, the engines taken, the watcher's counters and the
        Ready pods skipped, with why (all zero and empty before :meth:`start`)."""
        watcher = self._watcher
        if watcher is None:
            return {"synced": False, "engines": 0, "counters": {}, "skipped_pods": {}}
        return {
            "synced": watcher.synced.is_set(),
            "engines": len(watcher.engines()),
            "counters": watcher.counters(),
            "skipped_pods": watcher.skipped_pods(),
        }
