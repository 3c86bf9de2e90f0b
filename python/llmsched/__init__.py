"""llmsched: where and when an LLM request runs.

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
