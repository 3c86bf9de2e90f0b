"""Per-key rate and concurrency limits of the gateway (token buckets).

Each API key may carry limits in its entry (``auth.api_keys``):

- ``requests_per_s`` / ``burst_requests``: a bucket of ``burst_requests`` (default: one
  second's worth, at least 1) refilled at ``requests_per_s``; a request takes one;
- ``tokens_per_s`` / ``burst_tokens``: a bucket counted in tokens; a request needs its prompt
  tokens (the gateway's estimate) in the bucket and takes them; its output tokens are taken when
  it ends (the bucket may then go below zero: the key waits until it refills);
- ``max_concurrent``: requests of the key in progress at once.

A request over a limit gets 429 with ``Retry-After`` (the seconds until the bucket holds what
it needs, rounded up) and ``x-llmsched-dropped-reason`` ``rate-limited`` or
``concurrency-limited``. Limits apply per key, before flow control. Gateways in one cluster
(``cluster`` section) share what each key took, so the rates hold across replicas (within one
sync interval); ``max_concurrent`` stays per replica.

>>> limiter = KeyLimiter(requests_per_s=1.0, burst_requests=2, clock=lambda: 0.0)
>>> [limiter.acquire(prompt_tokens=0) for _ in range(3)]
[None, None, ('rate-limited', 1.0)]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["KeyLimiter", "retry_after"]


class _Bucket:
    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (0 when it does)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate


class KeyLimiter:
    """The limits of one key (None: no such limit). Not thread-safe: one event loop."""

    def __init__(
        self,
        *,
        requests_per_s: float | None = None,
        burst_requests: float | None = None,
        tokens_per_s: float | None = None,
        burst_tokens: float | None = None,
        max_concurrent: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        now = clock()
        self._clock = clock
        self._requests = (
            None
            if requests_per_s is None
            else _Bucket(requests_per_s, burst_requests or max(requests_per_s, 1.0), now)
        )
        self._tokens = (
            None
            if tokens_per_s is None
            else _Bucket(tokens_per_s, burst_tokens or max(tokens_per_s, 1.0), now)
        )
        self.max_concurrent = max_concurrent
        self.in_progress = 0
        # What this gateway took since the last drain_usage(), for the other replicas.
        self._used_requests = 0.0
        self._used_tokens = 0.0

    def acquire(self, *, prompt_tokens: int) -> tuple[str, float] | None:
        """Admits one request (returns None and counts it in progress), or returns the reason
        and the seconds to wait. A request larger than the token bucket ever holds is
        admitted when the bucket is full (it then runs the bucket into debt)."""
        if self.max_concurrent is not None and self.in_progress >= self.max_concurrent:
            return "concurrency-limited", 1.0
        now = self._clock()
        if self._requests is not None:
            self._requests.refill(now)
            wait = self._requests.wait_for(1.0)
            if wait > 0:
                return "rate-limited", wait
        if self._tokens is not None:
            self._tokens.refill(now)
            need = min(float(prompt_tokens), self._tokens.capacity)
            wait = self._tokens.wait_for(need)
            if wait > 0:
                return "rate-limited", wait
            self._tokens.level -= prompt_tokens
            self._used_tokens += prompt_tokens
        if self._requests is not None:
            self._requests.level -= 1.0
            self._used_requests += 1.0
        self.in_progress += 1
        return None

    def release(self, *, output_tokens: int) -> None:
        """Ends an admitted request; its output tokens are taken from the token bucket."""
        self.in_progress = max(self.in_progress - 1, 0)
        if self._tokens is not None and output_tokens > 0:
            self._tokens.refill(self._clock())
            self._tokens.level -= output_tokens
            self._used_tokens += output_tokens

    @property
    def limits_rates(self) -> bool:
        """Whether the key has a request or token rate (what replicas share)."""
        return self._requests is not None or self._tokens is not None

    def drain_usage(self) -> tuple[float, float]:
        """Requests and tokens this gateway took from the buckets since the last call."""
        used = (self._used_requests, self._used_tokens)
        self._used_requests = self._used_tokens = 0.0
        return used

    def charge_remote(self, requests: float, tokens: float) -> None:
        """What other gateway replicas admitted for this key (replica sync): taken from the
        buckets as if admitted here, so the key's rate holds across replicas. The buckets may
        go below zero (the key then waits until they refill). Concurrency stays per replica."""
        now = self._clock()
        if self._requests is not None and requests > 0:
            self._requests.refill(now)
            self._requests.level -= requests
        if self._tokens is not None and tokens > 0:
            self._tokens.refill(now)
            self._tokens.level -= tokens


def retry_after(wait_s: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(wait_s)))
