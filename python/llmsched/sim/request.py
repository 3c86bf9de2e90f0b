"""A simulated request: what the workload asks for, and what happens to it.

>>> import numpy as np
>>> r = Request(0, arrival=1.0, prompt_len=40, output_len=3, hashes=np.zeros(2, np.uint64))
>>> r.target, r.finished
(40, False)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Request"]

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


class Request:
    """One request. The workload sets the first block of fields; the simulator the rest.

    ``hashes`` are the chained block hashes (:mod:`llmsched.hashing`, the prefix index's
    namespace) of the full blocks of the prompt followed by the output the request will
    generate, so a later turn that repeats both hits the cache. ``tokens`` are the prompt's
    token ids when the workload has them (a router that hashes prompts itself needs them).
    ``output_len`` is at least 1: a request asking for none produces the token of its prefill
    step (a trace line with ``output_length`` 0), while ``hashes`` cover only its prompt.

    >>> no_blocks = np.zeros(0, np.uint64)
    >>> asks_none = Request(0, arrival=0.0, prompt_len=4, output_len=0, hashes=no_blocks)
    >>> asks_none.output_len
    1
    """

    __slots__ = (
        "arrival",
        "cached_tokens",
        "call_end",
        "computed",
        "decode_replica",
        "dispatched",
        "finish_time",
        "first_token_time",
        "generated",
        "handle",
        "hashes",
        "high_water",
        "id",
        "join_gen",
        "join_step",
        "kv_ready",
        "kv_started",
        "output_len",
        "phase",
        "preemptions",
        "prefill_replica",
        "prefilled_tokens",
        "priority",
        "prompt_len",
        "readmitting",
        "recomputed_tokens",
        "rejected",
        "replica",
        "session",
        "slice_endpoint",
        "slice_start",
        "target",
        "tenant",
        "tokens",
        "turn",
        "version",
    )

    def __init__(
        self,
        id: int,
        arrival: float,
        prompt_len: int,
        output_len: int,
        hashes: npt.NDArray[np.uint64],
        *,
        tokens: npt.NDArray[np.uint32] | None = None,
        tenant: int = 0,
        priority: int = 0,
        session: int | None = None,
        turn: int = 0,
    ) -> None:
        self.id = id
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = max(1, output_len)
        self.hashes = hashes
        self.tokens = tokens
        self.tenant = tenant
        self.priority = priority
        self.session = session
        self.turn = turn
        # Simulator state.
        self.phase = WAITING
        self.target = prompt_len  # tokens whose KV the next prefill must hold
        self.computed = 0
        self.generated = 0
        self.high_water = 0  # most tokens ever computed (recompute accounting)
        self.join_step = 0
        self.join_gen = 0
        self.kv_started = False
        self.kv_ready = False  # P/D: the KV arrives by transfer (cleared when preempted)
        self.version = 0
        self.replica: Any = None
        self.prefill_replica: Any = None
        self.decode_replica: Any = None
        self.handle: Any = None
        self.dispatched = -1.0
        self.first_token_time = -1.0
        self.finish_time = -1.0
        self.cached_tokens = -1  # prefix-cache hit at first admission
        self.prefilled_tokens = 0
        self.recomputed_tokens = 0
        self.preemptions = 0
        # Preempted since its last admission: the next one is a readmission, left out of the
        # prefix-cache counters (cleared at admission; a slice continuation is counted).
        self.readmitting = False
        self.rejected = False
        self.call_end = 0  # token slices: this call stops when generated reaches it
        self.slice_start = 0  # tokens generated when the current slice began
        self.slice_endpoint = -1  # where a yielded or migrated slice continues

    @property
    def finished(self) -> bool:
        """Whether the request has completed."""
        return self.phase == DONE

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, arrival={self.arrival:.3f}, prompt={self.prompt_len}, "
            f"output={self.output_len}, tenant={self.tenant}, priority={self.priority})"
        )
