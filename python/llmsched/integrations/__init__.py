"""Real engines in the loop: worker identity, the vLLM KV-event subscriber and the metrics scraper.

- :func:`worker_id` / :class:`EngineSpec`: one engine (one data-parallel rank) and the worker id
  that the prefix index, the endpoint pool, the flow controller and the scraper all use.
- :class:`KVEventSubscriber`: keeps a :class:`~llmsched.PrefixIndex` current from the engines'
  ZMQ KV events, with gap detection, replay and resynchronisation;
  :class:`NativeKVEventSubscriber` does the same in Rust, with no Python per batch.
Needs the ``integrations`` extra (``pip install 'llmsched[integrations]'``).

- :class:`MetricsScraper`: polls the engines' Prometheus ``/metrics`` and feeds the
  :class:`~llmsched.EndpointPool` and :class:`~llmsched.FlowController`.

>>> from llmsched.integrations import EngineSpec
>>> EngineSpec("10.0.0.7", 8000, dp_rank=1).worker_id
'10.0.0.7:8000/dp1'
"""

from __future__ import annotations

from llmsched._extras import require

require("integrations", "zmq", "aiohttp", "prometheus_client", feature="llmsched.integrations")

from llmsched.integrations.identity import (
    EngineSpec,
    resolve_engines,
    wire_for_router,
    worker_id,
)
from llmsched.integrations.kv_events import KVEventSubscriber, NativeKVEventSubscriber
from llmsched.integrations.metrics import MetricsScraper, ScrapeResult

__all__ = [
    "EngineSpec",
    "KVEventSubscriber",
    "MetricsScraper",
    "NativeKVEventSubscriber",
    "ScrapeResult",
    "resolve_engines",
    "wire_for_router",
    "worker_id",
]
