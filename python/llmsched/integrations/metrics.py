"""Scrape engines' Prometheus ``/metrics`` and feed the router's pool and the flow controller.

All engines are scraped concurrently (aiohttp, one session, a timeout per request). The text is
read by the native parser, in one pass linear in its length (an engine's text is untrusted: a
body of one 8 MiB line costs milliseconds, where ``prometheus_client``'s parser, super-linear on
long lines, held the event loop for minutes); vLLM names of several versions and SGLang names
map to the endpoint metrics:

================================  =========================================================
value                             source (summed over an engine's label sets unless noted)
================================  =========================================================
``waiting``                       ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``
``running``                       ``vllm:num_requests_running``, ``sglang:num_running_reqs``
``kv_cache_usage`` (mean, 0..1)   ``vllm:kv_cache_usage_perc``, older
                                  ``vllm:gpu_cache_usage_perc``, ``sglang:token_usage``
``prefix_cache_queries/hits``     ``vllm:prefix_cache_{queries,hits}_total`` (tokens), older
                                  ``vllm:gpu_prefix_cache_{queries,hits}_total``
``preemptions``                   ``vllm:num_preemptions_total``
``block_size``, ``num_gpu_blocks``  labels of ``vllm:cache_config_info``
``active/waiting_loras``          labels of ``vllm:lora_requests_info`` (latest sample)
================================  =========================================================

A successful scrape updates ``pool`` (:meth:`EndpointPool.update`, :meth:`EndpointPool.set_loras`)
and ``flow`` (:meth:`FlowController.update_endpoint`); a failed one (timeout, HTTP error, text
without load metrics) is counted and leaves the endpoint to go stale in the pool.

>>> import asyncio
>>> from llmsched import EndpointPool
>>> from llmsched.integrations import MetricsScraper
>>> from llmsched.testing import FakeHTTPEngine
>>> text = 'vllm:num_requests_running{engine="0"} 3\\nvllm:num_requests_waiting{engine="0"} 7\\n'
>>> with FakeHTTPEngine(metrics_text=text) as engine:
...     pool = EndpointPool()
...     scraper = MetricsScraper([engine.spec()], pool=pool)
...     result = asyncio.run(scraper.scrape_once())[engine.spec().worker_id]
>>> result.ok, result.values["running"], result.values["waiting"]
(True, 3, 7)
>>> pool.endpoints()[0]["waiting"]
7
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llmsched._llmsched import parse_engine_metrics_text
from llmsched.errors import (
    ConfigError,
    InvalidTypeError,
    InvalidValueError,
    UnknownEndpointError,
)
from llmsched.flow import FlowController
from llmsched.integrations.identity import EngineSpec, resolve_engines
from llmsched.routing import Endpoint, EndpointPool, Role
from llmsched.types import EngineMetricValues
from llmsched.validation import check_str

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_TIMEOUT_S",
    "MetricsScraper",
    "ScrapeResult",
    "parse_engine_metrics",
    "read_capped",
]

DEFAULT_INTERVAL_S = 0.2
"""Seconds between the starts of two scrape rounds."""

DEFAULT_TIMEOUT_S = 1.0
"""Seconds one scrape may take in all (connect, headers, body)."""

MAX_BODY_BYTES = 8 * 1024 * 1024
"""A larger metrics body is refused (a misbehaving engine must not exhaust memory)."""

# Sample name -> (value, how it combines over an engine's label sets).
_SUMS = {
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_queue_reqs": "waiting",
    "vllm:num_requests_running": "running",
    "sglang:num_running_reqs": "running",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:num_preemptions_total": "preemptions",
}
# KV-cache use, by preference: the current vLLM name, the older one, SGLang's.
_KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_CACHE_INFO = "vllm:cache_config_info"
_LORA_INFO = "vllm:lora_requests_info"
_COUNTS = ("waiting", "running", "prefix_cache_queries", "prefix_cache_hits", "preemptions")


@dataclass(frozen=True)
class ScrapeResult:
    """One engine's scrape: ``ok``, the ``values`` read (see the module table), the ``error``
    of a failed scrape, when it finished (``at``, ``time.monotonic()``), how long it took and
    whether it failed by getting no answer within the timeout (``timed_out``)."""

    worker: str
    ok: bool
    values: EngineMetricValues = field(default_factory=lambda: EngineMetricValues())
    error: str | None = None
    at: float = 0.0
    duration_s: float = 0.0
    timed_out: bool = False


def parse_engine_metrics(text: str, *, prefilter: bool = True) -> EngineMetricValues:
    """Read a vLLM or SGLang ``/metrics`` text into the values of the module table. Raises
    :class:`~llmsched.errors.InvalidValueError` (a ValueError) when a line of a metric read does
    not parse (the message names it) or the text holds no load metric (waiting, running, KV use).

    The native parser reads only the lines of the metrics in the table, in one pass, with the
    GIL released. ``prefilter=False`` reads the whole text with ``prometheus_client``'s parser
    instead: the pure-Python reference the tests and the benchmark compare with, the same values
    at a cost super-linear in a line's length (never for an engine's text on an event loop).

    >>> parse_engine_metrics('sglang:num_queue_reqs 4\\nsglang:token_usage 0.25\\n')
    {'waiting': 4, 'kv_cache_usage': 0.25}
    """
    if prefilter:
        try:
            values = parse_engine_metrics_text(check_str("text", text))
        except UnicodeEncodeError:
            raise InvalidValueError("text must be valid UTF-8 (no lone surrogates)") from None
        return values
    return _parse_with_prometheus_client(text)


def _parse_with_prometheus_client(text: str) -> EngineMetricValues:
    """:func:`parse_engine_metrics` by ``prometheus_client``'s parser (the reference)."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {}
    values: dict[str, Any] = {}
    lora: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text + "\n"):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if not math.isfinite(value):  # NaN or an infinity is no load reading
                continue
            if name in _SUMS:
                key = _SUMS[name]
                sums[key] = sums.get(key, 0.0) + value
            elif name in _KV_NAMES:
                kv.setdefault(name, []).append(value)
            elif name == _CACHE_INFO:
                values.update(_cache_config(sample.labels))
            elif name == _LORA_INFO and (lora is None or value >= lora[0]):
                lora = (value, sample.labels)
    for key in _COUNTS:
        if key in sums:
            # Within what the pool holds (an unsigned 32-bit count), as the native plane reads it.
            values[key] = min(max(0, round(sums[key])), _MAX_COUNT)
    for name in _KV_NAMES:
        if kv.get(name):
            mean = sum(kv[name]) / len(kv[name])
            values["kv_cache_usage"] = min(1.0, max(0.0, mean))
            break
    if lora is not None:
        values.update(_loras(lora[1]))
    if not {"waiting", "running", "kv_cache_usage"} & values.keys():
        raise InvalidValueError("no vLLM or SGLang load metrics in the text")
    # Keys are set from the tables above, so mypy cannot follow them one by one.
    return cast(EngineMetricValues, _ordered(values))


def _ordered(values: dict[str, Any]) -> dict[str, Any]:
    order = ("waiting", "running", "kv_cache_usage")
    head = {k: values[k] for k in order if k in values}
    return head | {k: v for k, v in values.items() if k not in head}


def _cache_config(labels: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in ("block_size", "num_gpu_blocks"):
        number = _label_count(labels.get(key, ""))
        if number is not None:
            out[key] = number
    return out


def _label_count(raw: str) -> int | None:
    """A label's ASCII decimal count up to ``_MAX_COUNT`` (None: anything else)."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 10:
        return None
    number = int(raw)
    return number if number <= _MAX_COUNT else None


def _loras(labels: dict[str, str]) -> dict[str, Any]:
    def names(key: str) -> list[str]:
        return [n.strip() for n in labels.get(key, "").split(",") if n.strip()]

    return {
        "active_loras": names("running_lora_adapters"),
        "waiting_loras": names("waiting_lora_adapters"),
        "max_loras": _label_count(labels.get("max_lora", "")) or 0,
    }


_MAX_COUNT = 2**32 - 1


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """An engine's whole answer body, or None when it is over ``limit`` bytes (read no
    further). ``response.content.read(n)`` would return only what has arrived so far.

    >>> import asyncio
    >>> from llmsched.testing.openai_engine import FakeOpenAIEngine
    >>> async def main() -> tuple[int, bool]:
    ...     async with FakeOpenAIEngine() as engine, aiohttp.ClientSession() as session:
    ...         async with session.get(engine.url + "/v1/models") as response:
    ...             body = await read_capped(response, 1 << 20)
    ...         async with session.get(engine.url + "/v1/models") as response:
    ...             over = await read_capped(response, 10)
    ...     return len(body or b""), over is None
    >>> size, cut = asyncio.run(main())
    >>> size > 10 and cut
    True
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class _EngineState:
    """What the scraper remembers of one engine (guarded by the scraper's lock)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.last: ScrapeResult | None = None
        self.last_ok: float | None = None
        self.scrapes = 0
        self.failures = 0
        self.consecutive_failures = 0
        # Whether the last scrape that was not a timeout failed.
        self.failing = False
        self.timeouts = 0
        self.values = EngineMetricValues()


class MetricsScraper:
    """Polls the engines' ``/metrics`` and feeds ``pool`` and ``flow``.

    Args:
        engines: the engines (worker ids as in :func:`~llmsched.integrations.worker_id`).
        pool: the router's endpoint pool; engines it lacks are added (address, role, labels,
            model from the spec). An unnamed engine at the address of an endpoint already in
            the pool feeds that endpoint (:func:`~llmsched.integrations.resolve_engines`).
        flow: a flow controller to feed load reports to.
        interval_s: seconds between the starts of two rounds.
        timeout_s: seconds one scrape may take.
        on_block_size: called with a worker and the KV block size its ``/metrics`` gives
            (``vllm:cache_config_info``), on the first scrape that gives one and when it
            changes (:meth:`Scheduler.note_engine_block_size
            <llmsched.Scheduler.note_engine_block_size>` compares it with the index's).

    Run ``await run()`` on your event loop, or :meth:`start` / :meth:`stop` for a thread with
    its own loop. :meth:`snapshot` may be read from any thread.
    """

    def __init__(
        self,
        engines: Iterable[EngineSpec],
        *,
        pool: EndpointPool | None = None,
        flow: FlowController | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_block_size: Callable[[str, int], None] | None = None,
    ) -> None:
        if on_block_size is not None and not callable(on_block_size):
            raise InvalidTypeError(
                f"on_block_size must be callable, got {type(on_block_size).__name__}"
            )
        self._on_block_size = on_block_size
        for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and 0 < value < math.inf
            ):
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        self._engines: dict[str, _EngineState] = {}
        if pool is not None:
            engines = resolve_engines(engines, pool)
        for spec in engines:
            if not isinstance(spec, EngineSpec):
                raise InvalidTypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
            if spec.worker_id in self._engines:
                raise ConfigError(f"engine {spec.worker_id} is listed twice")
            self._engines[spec.worker_id] = _EngineState(spec)
        self.pool = pool
        self.flow = flow
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        if pool is not None:
            known = {e["id"] for e in pool.endpoints()}
            for worker, state in self._engines.items():
                if worker not in known:
                    pool.add(_endpoint_of(state.spec))
        self._lock = threading.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._rounds = 0

    # -- scraping -----------------------------------------------------------------------------

    async def scrape_once(self) -> dict[str, ScrapeResult]:
        """Scrape every engine concurrently, apply the results, and return them by worker."""
        if self._session is not None:
            return await self._round(self._session)
        async with self._new_session() as session:
            return await self._round(session)

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _round(self, session: aiohttp.ClientSession) -> dict[str, ScrapeResult]:
        results = await asyncio.gather(
            *(self._scrape(session, state.spec) for state in self._engines.values())
        )
        for result in results:
            self._apply(result)
        with self._lock:
            self._rounds += 1
        return {r.worker: r for r in results}

    async def _scrape(self, session: aiohttp.ClientSession, spec: EngineSpec) -> ScrapeResult:
        worker = spec.worker_id
        started = time.monotonic()
        try:
            async with session.get(spec.metrics_url) as response:
                if response.status != 200:
                    raise _ScrapeFailed(f"HTTP {response.status}")
                body = await read_capped(response, MAX_BODY_BYTES)
                if body is None:
                    raise _ScrapeFailed(f"metrics body over {MAX_BODY_BYTES} bytes")
            text = body.decode("utf-8", errors="replace")
            values = parse_engine_metrics(text)
        except asyncio.TimeoutError:
            return self._failure(worker, started, f"timeout after {self.timeout_s} s", True)
        except aiohttp.ClientError as err:
            return self._failure(worker, started, f"{type(err).__name__}: {err}")
        except (_ScrapeFailed, ValueError, RecursionError) as err:
            return self._failure(worker, started, str(err))
        done = time.monotonic()
        return ScrapeResult(worker, True, values, None, done, done - started)

    @staticmethod
    def _failure(worker: str, started: float, error: str, timed_out: bool = False) -> ScrapeResult:
        done = time.monotonic()
        return ScrapeResult(worker, False, {}, error, done, done - started, timed_out)

    def _apply(self, result: ScrapeResult) -> None:
        state = self._engines[result.worker]
        if result.ok:
            try:
                self._feed(result)
            except (ValueError, OverflowError) as err:  # a value the pool refuses
                result = self._failure(result.worker, result.at - result.duration_s, str(err))
        block_size = result.values.get("block_size") if result.ok else None
        changed = False
        with self._lock:
            state.last = result
            state.scrapes += 1
            if not result.timed_out:
                state.failing = not result.ok
            if result.ok:
                state.last_ok = result.at
                state.consecutive_failures = 0
                changed = block_size != state.values.get("block_size")
                state.values = result.values.copy()
            else:
                state.failures += 1
                state.timeouts += result.timed_out
                state.consecutive_failures += 1
        if block_size and changed and self._on_block_size is not None:
            self._on_block_size(result.worker, block_size)

    def _feed(self, result: ScrapeResult) -> None:
        values = result.values
        # An endpoint the gateway removed from the pool meanwhile is simply not updated.
        with contextlib.suppress(UnknownEndpointError):
            self._feed_pool(result.worker, values)
        if self.flow is not None:
            self.flow.update_endpoint(
                result.worker,
                waiting=values.get("waiting", 0),
                running=values.get("running", 0),
                kv_cache_usage=values.get("kv_cache_usage", 0.0),
            )

    def _feed_pool(self, worker: str, values: EngineMetricValues) -> None:
        if self.pool is not None:
            self.pool.update(
                worker,
                waiting=values.get("waiting"),
                running=values.get("running"),
                kv_cache_usage=values.get("kv_cache_usage"),
            )
            if "active_loras" in values:
                self.pool.set_loras(
                    worker, values["active_loras"], values["waiting_loras"], values["max_loras"]
                )

    # -- loops --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Scrape every ``interval_s`` until cancelled (one session for the whole run)."""
        if self._session is not None:
            raise RuntimeError("the scraper is already running")
        async with self._new_session() as session:
            self._session = session
            try:
                while True:
                    started = time.monotonic()
                    await self._round(session)
                    await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
            finally:
                self._session = None

    def start(self) -> None:
        """Run :meth:`run` on a daemon thread with its own event loop."""
        if self._thread is not None:
            raise RuntimeError("the scraper is already running")
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            self._task = loop.create_task(self.run())
            started.set()
            try:
                loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name="llmsched-metrics", daemon=True)
        self._thread.start()
        started.wait()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Cancel the thread's loop and wait for it (sockets and session closed)."""
        thread, loop, task = self._thread, self._loop, self._task
        if thread is None or loop is None or task is None:
            return
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the scraper thread did not stop within {timeout} s")
        self._thread = self._loop = self._task = None

    def __enter__(self) -> MetricsScraper:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- reading ------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per worker: ``ok`` (last scrape), ``values`` (of the last good scrape), ``scrapes``,
        ``failures``, ``consecutive_failures``, ``last_ok`` (monotonic time or None),
        ``last_error``, ``last_duration_s``, ``timeouts`` (failures that were timeouts) and
        ``failing``: whether the last scrape that got
        an answer or a refusal failed (a scrape that timed out leaves it as it was: a stalled
        engine is not known to fail). A consistent copy.

        >>> MetricsScraper([EngineSpec("h", 1)]).snapshot()["h:1"]["ok"]
        False
        """
        with self._lock:
            return {
                worker: {
                    "ok": s.last is not None and s.last.ok,
                    "values": dict(s.values),
                    "scrapes": s.scrapes,
                    "failures": s.failures,
                    "consecutive_failures": s.consecutive_failures,
                    "last_ok": s.last_ok,
                    "last_error": None if s.last is None else s.last.error,
                    "last_duration_s": None if s.last is None else s.last.duration_s,
                    "timeouts": s.timeouts,
                    "failing": s.failing,
                }
                for worker, s in self._engines.items()
            }

    @property
    def rounds(self) -> int:
        """Scrape rounds completed."""
        with self._lock:
            return self._rounds

    def __repr__(self) -> str:
        return f"MetricsScraper({len(self._engines)} engines, every {self.interval_s} s)"


class _ScrapeFailed(Exception):
    """A scrape got an answer that is not a usable metrics text."""


def _endpoint_of(spec: EngineSpec) -> Endpoint:
    role: Role | None = spec.role  # type: ignore[assignment]
    return Endpoint(
        spec.worker_id,
        address=spec.address,
        role=role,
        labels=spec.labels,
        model=spec.model,
    )
