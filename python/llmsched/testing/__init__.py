"""Test doubles that speak the real protocols on loopback (for llmsched's tests and yours).

- :class:`~llmsched.testing.fake_engine.FakeKVPublisher`: a vLLM-style KV-event publisher (ZMQ
  PUB and replay ROUTER) that publishes scripted batches, can lose some, restart, or misbehave.
- :class:`~llmsched.testing.fake_engine.FakeHTTPEngine`: an aiohttp server on its own thread that
  serves a scripted Prometheus ``/metrics`` (text, status, delay) and any routes you add.
- :func:`~llmsched.testing.fake_engine.event_batch`, ``stored_event`` and friends: msgpack
  ``EventBatch`` payloads.
"""

from __future__ import annotations

from llmsched._extras import require

require("test", "zmq", "aiohttp", "msgpack", feature="llmsched.testing")

from llmsched.testing.fake_engine import (
    FakeHTTPEngine,
    FakeKVPublisher,
    cleared_event,
    event_batch,
    removed_event,
    stored_event,
)

__all__ = [
    "FakeHTTPEngine",
    "FakeKVPublisher",
    "cleared_event",
    "event_batch",
    "removed_event",
    "stored_event",
]
