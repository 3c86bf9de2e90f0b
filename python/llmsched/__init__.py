"""llmsched: where and when an LLM request runs.

>>> import llmsched
>>> isinstance(llmsched.__version__, str)
True
"""

from __future__ import annotations

from llmsched._llmsched import __version__
from llmsched.errors import (
    ConfigError,
    InvalidTokenError,
    LlmschedError,
    MalformedEventError,
    UnknownBlockError,
    UnknownWorkerError,
)
from llmsched.hashing import block_hashes, namespace_seed

__all__ = [
    "ConfigError",
    "InvalidTokenError",
    "LlmschedError",
    "MalformedEventError",
    "UnknownBlockError",
    "UnknownWorkerError",
    "__version__",
    "block_hashes",
    "namespace_seed",
]
