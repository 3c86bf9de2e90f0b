"""llmsched: where and when an LLM request runs.

The library a gateway or router imports to make its per-request decisions. This package holds
the core, which needs only numpy and PyYAML:

- block hashing (:func:`block_hashes`, :func:`text_block_hashes`) and :class:`PrefixIndex`,
  which replica holds which cached prefix, fed by vLLM's KV events or the router's decisions;
- :class:`Router` over an :class:`EndpointPool`: filters, scorers and pickers in llm-d's
  configuration shape, or a named preset (``Router.presets()``);
- :class:`FlowController`: priority bands, tenant fairness, saturation, shedding, preemption;
- :class:`SliceTracker`: decoding cut into token slices;
- :class:`Scheduler`: all of the above wired into one request pipeline;
- :mod:`llmsched.errors`: every exception, each also the built-in it resembles.

Modules behind an extra (``pip install 'llmsched[EXTRA]'``; importing one without it raises an
``ImportError`` naming the extra): ``llmsched.integrations`` (``integrations``: KV-event
subscriber, metrics scraper), ``llmsched.tokenize`` (``tokenize``), ``llmsched.gateway``
(``gateway``: ``llmsched serve``), ``llmsched.cluster`` (``cluster``), ``llmsched.executor``
(``executor``), ``llmsched.testing`` and ``llmsched.reference`` (``test``); ``llmsched.sim``
runs without one (``sim`` adds plots). The manual starts at docs/index.md, the command line
at ``llmsched --help``.

>>> import llmsched
>>> isinstance(llmsched.__version__, str)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmsched._llmsched import __version__
from llmsched.errors import (
    ConfigError,
    DuplicateRequestError,
    FlowRejected,
    HashChainError,
    InvalidRequestError,
    InvalidTokenError,
    InvalidTypeError,
    InvalidValueError,
    LlmschedError,
    MalformedEventError,
    NoEndpointError,
    PlacementError,
    SliceStateError,
    SnapshotError,
    UnknownBlockError,
    UnknownEndpointError,
    UnknownRequestError,
    UnknownWorkerError,
)
from llmsched.flow import FlowController, FlowDecision, FlowRequest, Outcome
from llmsched.hashing import (
    block_hashes,
    block_hashes_batch,
    namespace_seed,
    pack_text,
    text_block_hashes,
    vllm_block_digests,
    vllm_none_hash,
)
from llmsched.prefix_index import PrefixIndex, PrefixMatch
from llmsched.routing import Decision, Endpoint, EndpointPool, Router
from llmsched.slices import SliceAssembler, SliceTracker, SwitchCostModel, WaitingRequest
from llmsched.vllm_events import decode_vllm_events

if TYPE_CHECKING:
    from llmsched.scheduler import Admission, Placement, Scheduler, ScheduleRequest

_LAZY = {
    "Admission": "llmsched.scheduler",
    "Placement": "llmsched.scheduler",
    "ScheduleRequest": "llmsched.scheduler",
    "Scheduler": "llmsched.scheduler",
}
"""Names imported on first use: the request pipeline imports asyncio, which ``import
llmsched`` does not."""


if not TYPE_CHECKING:  # type checkers see the imports above; a typo stays an error there

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'llmsched' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Admission",
    "ConfigError",
    "Decision",
    "DuplicateRequestError",
    "Endpoint",
    "EndpointPool",
    "FlowController",
    "FlowDecision",
    "FlowRejected",
    "FlowRequest",
    "HashChainError",
    "InvalidRequestError",
    "InvalidTokenError",
    "InvalidTypeError",
    "InvalidValueError",
    "LlmschedError",
    "MalformedEventError",
    "NoEndpointError",
    "Outcome",
    "Placement",
    "PlacementError",
    "PrefixIndex",
    "PrefixMatch",
    "Router",
    "ScheduleRequest",
    "Scheduler",
    "SliceAssembler",
    "SliceStateError",
    "SliceTracker",
    "SnapshotError",
    "SwitchCostModel",
    "UnknownBlockError",
    "UnknownEndpointError",
    "UnknownRequestError",
    "UnknownWorkerError",
    "WaitingRequest",
    "__version__",
    "block_hashes",
    "block_hashes_batch",
    "decode_vllm_events",
    "namespace_seed",
    "pack_text",
    "text_block_hashes",
    "vllm_block_digests",
    "vllm_none_hash",
]
