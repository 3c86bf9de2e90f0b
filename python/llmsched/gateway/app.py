"""The reference gateway: an OpenAI-compatible HTTP front that admits, routes and proxies.

Per request: authenticate, read the body (size- and time-limited), check it, tokenize (or hash
the text), then, through the public request pipeline (:class:`~llmsched.Scheduler`: flow
control's admission, the router's pick, the in-flight ticket, the fallbacks, the accounting),
send to the chosen engine and stream its answer back byte for byte. An attempt whose
connection fails or is closed before the engine's status line (or that gets a 5xx) goes to the
next endpoint (bounded by ``retries.max_attempts``); one that waits ``timeouts.read_s`` for its
status line gets a 504; an answer whose status line arrived is never sent again: cut off or
timed out later, it is a 502 when the client got nothing yet, else the client's connection is
reset (an SSE stream gets an error event and ends without ``[DONE]``). An answer the engine
ends by closing its connection (no Content-Length, not chunked), where a cut looks like the end,
passes only as whole JSON (read whole first, up to 8 MiB) or as an event stream that showed its
``data: [DONE]`` (a Responses API stream: its terminal event). Engine health follows
:mod:`llmsched.gateway.health`. The upstream URL is always built from the configured
:class:`~llmsched.integrations.EngineSpec`, never from anything in the request. The Responses
API's stored responses are reached through the engine that made them
(:mod:`llmsched.gateway.responses`).

>>> import asyncio
>>> gw = Gateway({"engines": [{"host": "127.0.0.1", "port": 9}], "models": ["m"],
...               "scrape": {"enabled": False}})
>>> sorted(r.resource.canonical for r in gw.app.router.routes()
...        if r.method == "POST")
['/v1/chat/completions', '/v1/completions', '/v1/responses']
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import hmac
import inspect
import io
import json
import logging
import os
import re
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar
from urllib.parse import quote, unquote

import aiohttp
import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from llmsched._aio import cancel_and_wait, settled
from llmsched.errors import (
    ConfigError,
    FlowRejected,
    InvalidRequestError,
    InvalidTokenError,
    NoEndpointError,
    UnknownEndpointError,
)
from llmsched.gateway.admin import check_engine_url
from llmsched.gateway.config import (
    ApiKey,
    DiscoveryErrors,
    GatewayConfig,
    cluster_sync,
    engine_set,
    file_version,
    gateway_index,
    load_config,
    read_engines_file,
)
from llmsched.gateway.engine_models import EngineModelCheck
from llmsched.gateway.health import EngineHealth
from llmsched.gateway.metrics import GatewayMetrics
from llmsched.gateway.pod_discovery import PodDiscovery
from llmsched.gateway.ratelimit import KeyLimiter, retry_after
from llmsched.gateway.responses import (
    LineEnds,
    ResponseIdScan,
    ResponseOwners,
    TerminalEventScan,
    chat_request_of,
    output_deltas,
    response_id_of,
    stores_response,
)
from llmsched.gateway.session_token import SESSION_TOKEN_HEADER, SessionTokens
from llmsched.gateway.slicing import SlicedRequest, make_assembler
from llmsched.integrations import EngineSpec
from llmsched.routing import Decision
from llmsched.scheduler import Admission, Placement, Scheduler, ScheduleRequest
from llmsched.slices import SliceTracker
from llmsched.tokenize import PromptError, PromptTokenizer, Truncation
from llmsched.validation import is_utf8_text, refuse_json_constant

if TYPE_CHECKING:
    from llmsched.cluster import ClusterSync, Usage

__all__ = ["Gateway", "Refusal"]

log = logging.getLogger("llmsched.gateway")

TENANT_HEADER = "x-llmsched-tenant"
PRIORITY_HEADER = "x-llmsched-priority"
SESSION_HEADER = "x-session-id"
DROPPED_REASON_HEADER = "x-llmsched-dropped-reason"
OVERFLOW_TENANT = "~overflow"
"""The tenant of requests whose header names a tenant past ``limits.max_tenants``."""

_ROUTES = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
_ROUTE_OF_PATH = {path: route for route, path in _ROUTES.items()}
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What the native plane takes as a priority (Rust's i32 parse): ASCII digits only, no "_".
_PRIORITY = re.compile(r"[+-]?[0-9]+", re.ASCII)
_LARGE_UPSTREAM_BODY = 1 << 20
"""Bodies past this size (aiohttp's own bound for a bytes body) are sent as a file object."""

_OFFLOADED_PROMPT_BYTES = 128 << 10
"""Request bodies from this size on are tokenized on a worker thread."""

# Response headers copied from the engine; hop-by-hop and framing headers are aiohttp's job.
_PASSED_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "Cache-Control")
# Bodies read whole to find the usage block of a non-streaming answer.
_USAGE_PARSE_LIMIT = 1 << 20
# The most output tokens an answer's usage block is believed for (the native plane's bound too).
_MAX_USAGE_TOKENS = 2**32 - 1
# Non-streamed answers up to this size are read whole and sent in one response.
_WHOLE_BODY_LIMIT = 8 << 20
_LOCATE_TIMEOUT_S = 2.0
"""The most an engine is waited for when asked whether it holds a response (a lookup in its
memory): one that stalls holds no lookup longer."""
_SHUTDOWN_GRACE_S = 60.0
"""How long :meth:`Gateway.stop` lets requests in flight end before it cancels them (aiohttp's
default grace); the connections left are then reset."""
_LISTENER_CLOSE_S = 1.0
"""How long :meth:`Gateway.stop` waits for its listener to close once every connection was
reset."""
# How often queued requests learn that no engine is left (they then get a 503 at once).
_ROUTABLE_CHECK_S = 0.2
# Body fields the gateway checks whatever the engine: (name, what is allowed).
_TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
_MAX_TOKEN_LIMIT = 2**31 - 1
# Deepest nesting of a request body (chat content parts and tool schemas need a few levels).
_MAX_DEPTH = 64


class Refusal(Exception):
    """A request answered by the gateway itself: HTTP ``status``, OpenAI error ``kind``
    (``type``), ``message``, the field at fault (``param``), extra ``headers``, whether the
    client connection is closed after the answer (``close``: the rest of a body is unread) and
    whether what the client still sends of its body is read and dropped, briefly, after the
    answer went out (``drain``: a client still sending reads its answer, not a reset).

    Package-internal: :mod:`llmsched.gateway.slicing` raises it through :meth:`Gateway.refuse`.
    """

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        headers: Mapping[str, str] | None = None,
        *,
        param: str | None = None,
        close: bool = False,
        drain: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = dict(headers or {})
        self.param = param
        self.close = close
        self.drain = drain


class _BodyBudget:
    """The bytes of the request bodies being received (``limits.max_body_bytes_in_flight``),
    as the native plane's ``guards::BodyBudget``: each body takes its declared length at once
    (or its chunks as they arrive) through a hold that gives them all back when it closes,
    whatever way the reading ends. The event loop is the only user (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[_BodyHold]:
        hold = _BodyHold(self)
        try:
            yield hold
        finally:
            self.held -= hold.bytes
            hold.bytes = 0


class _BodyHold:
    """One body's share of a :class:`_BodyBudget`."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: _BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def take(self, n: int) -> bool:
        """Takes ``n`` more bytes if the budget has room for them (False, nothing taken,
        else)."""
        if self.budget.held + n > self.budget.limit:
            return False
        self.budget.held += n
        self.bytes += n
        return True


class _UpstreamFailed(Exception):
    """One attempt failed before the engine's status line, or with a 5xx (retryable)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _NoAnswer(Exception):
    """The request went to the engine and no status line came within ``timeouts.read_s`` (or
    the deadline: ``by_deadline``): not retried, since the engine may be running it."""

    def __init__(self, *, by_deadline: bool) -> None:
        super().__init__()
        self.by_deadline = by_deadline


class _DeadlinePassed(Exception):
    """The request's deadline (``timeouts.total_s``) passed after the engine's status line
    but before anything went to the client: the request's 504, no failure of the engine."""


def _deadline_ended(error: BaseException) -> bool:
    """Whether the request's deadline, not the engine, ended an upstream wait that raised
    ``error``: aiohttp raises its ServerTimeoutError for ``sock_read`` (``timeouts.read_s``)
    and a plain TimeoutError for ``total`` (the time left to the deadline)."""
    return isinstance(error, asyncio.TimeoutError) and not isinstance(
        error, aiohttp.ServerTimeoutError
    )


# Timeouts of the connection itself (the request was not sent): retryable. aiohttp < 3.10 does
# not tell them apart from read timeouts; there every timeout counts as a read timeout.
_CONNECT_TIMEOUTS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(aiohttp, "ConnectionTimeoutError", None),) if isinstance(t, type)
)


# Attempt failures a request can cause itself; held until it ends (Gateway._settle_held).
_HELD_FAILURES = frozenset({"status_5xx", "broken"})


class _Truncated(Exception):
    """The engine's answer had its status line, then was cut off or timed out before anything
    went to the client (never retried: the engine may have run the request)."""


@dataclass
class _Incoming:
    """A request read and checked, before admission."""

    tenant: str
    priority: int
    body: bytes
    payload: dict[str, Any]
    prompt: _Prompt
    pick_args: dict[str, Any]
    scheduled: ScheduleRequest
    deadline: float
    queued_s: float = 0.0
    limiter: KeyLimiter | None = None


@dataclass
class _FlowSlot:
    """A request's place in flow control: the scheduler's admission to release (None while
    nothing is held, e.g. a sliced continuation waiting to be admitted again) and the output
    tokens to charge."""

    admission: Admission | None
    output_tokens: int = 0
    key_tokens: int | None = None
    """Output tokens to charge the API key's token bucket, when not ``output_tokens`` (a
    sliced request charged flow control at each yield, the key only at the end)."""


@dataclass
class _Prompt:
    """What routing and flow control need from a request body."""

    tokens: np.ndarray[Any, Any] | None
    text: str | None
    messages: list[dict[str, Any]] | None
    size: int


class Gateway:
    """The gateway: an aiohttp :attr:`app` plus the llmsched components behind it.

    Args:
        config: a :class:`~llmsched.gateway.config.GatewayConfig`, a mapping or a YAML path.

    Components (public, for embedding and tests): :attr:`scheduler` (the
    :class:`~llmsched.Scheduler` every request goes through, which owns the rest), :attr:`index`
    (one :class:`~llmsched.PrefixIndex` with the configured block size and ``index`` bounds),
    :attr:`pool` (an :class:`~llmsched.Endpoint` per engine, id = ``spec.worker_id``),
    :attr:`router`,
    :attr:`flow` (None when ``flow`` is null), :attr:`metrics`. :meth:`start` also starts the
    scheduler's feeds: a KV-event subscriber (engines with ``kv_events``) and a metrics
    scraper.
    """

    def __init__(self, config: GatewayConfig | Mapping[str, Any] | str | os.PathLike[str]) -> None:
        self.config = config if isinstance(config, GatewayConfig) else load_config(config)
        cfg = self.config
        for spec in cfg.engines:
            check_engine_url(spec)
        self._specs: dict[str, EngineSpec] = {spec.worker_id: spec for spec in cfg.engines}
        self._urls = _upstream_urls(self._specs)
        # The request pipeline: pool, index, router, flow control and the feeds. Scraped
        # metrics count as fresh for a few scrape intervals; without scraping there are no
        # metrics, and the load scorers read in-flight counts only.
        self.scheduler = Scheduler(
            cfg.engines,
            router=cfg.router,
            flow=cfg.flow,
            index=gateway_index(cfg),
            scrape=cfg.scrape.enabled,
            scrape_interval_s=cfg.scrape.interval_s,
            scrape_timeout_s=cfg.scrape.timeout_s,
            retry_after_s=cfg.limits.retry_after_s,
            notes=cfg.notes,
            # The loader applied the router config's flow sections (or noted them).
            wires_flow=True,
        )
        self.index = self.scheduler.index
        self.pool = self.scheduler.pool
        self.router = self.scheduler.router
        self.flow = self.scheduler.flow
        kubernetes = cfg.discovery.kubernetes
        self._session_tokens = SessionTokens(None if kubernetes is None else kubernetes.namespace)
        # The messages of the routing failures logged so far (see _routing_failed).
        self._routing_failures: set[str] = set()
        # llm-d's session-affinity scorer answers with the serving pod's token: so does a
        # router whose profiles read the session.
        self._sets_session_tokens = self.router.config_info["session_affinity"]
        self.tokenizer = (
            None
            if cfg.tokenizer is None
            else PromptTokenizer(
                cfg.tokenizer,
                content_format=cfg.chat_template_content_format,
                chat_template=cfg.chat_template,
                default_chat_template_kwargs=cfg.default_chat_template_kwargs,
                exclude_tools_when_tool_choice_none=cfg.exclude_tools_when_tool_choice_none,
                trust_request_chat_template=cfg.trust_request_chat_template,
                max_model_len=cfg.max_model_len,
            )
        )
        self.slice_tracker = (
            SliceTracker(cfg.slices.policy, cfg.slices.params, endpoints=list(self._specs))
            if cfg.slices.enabled
            else None
        )
        self.cluster: ClusterSync | None = cluster_sync(cfg, self.scheduler.router)
        """Replica sync (``cluster`` section; None when off)."""
        if self.cluster is not None:
            self.cluster.share_usage(self._collect_usage, self._apply_usage)
        self._context = cfg.max_model_len
        self.model_check = EngineModelCheck(
            cfg.models,
            cfg.lora_adapters,
            max_model_len=cfg.max_model_len,
            on_context=self._set_context,
        )
        """Each engine's ``/v1/models`` against ``models`` and ``lora_adapters``."""
        self.model_check.set_engines(self._specs.values())
        self.kubernetes: PodDiscovery | None = None
        """Kubernetes discovery (``discovery.kubernetes``; None when off)."""
        if cfg.discovery.kubernetes is not None:
            self.kubernetes = PodDiscovery(
                cfg.discovery.kubernetes,
                self,
                on_error=lambda: self.metrics.discovery_errors.inc(),
            )
        self.metrics = GatewayMetrics(
            flow=self.flow,
            index=self.index,
            kv_counters=self._kv_counters,
            endpoints=self.pool.endpoints,
            cluster=None if self.cluster is None else self.cluster.stats,
            # Summed over the scraper's restarts (engine changes): the counters only go up.
            scrapes=self.scheduler.scrape_counters,
            model_findings=self.model_check.findings,
            kv_failing=self._kv_failing,
            kubernetes=None if self.kubernetes is None else self.kubernetes.stats,
            config_warnings=lambda: len(self.scheduler.warnings),
            engine_block_sizes=self.scheduler.engine_block_size_mismatch,
        )
        self._bodies = _BodyBudget(cfg.limits.max_body_bytes_in_flight)
        # The body each client connection is sending now, by its transport: a client that
        # half-closes its connection mid-body gets its 400 (_HalfClosable).
        self._reading: dict[object, aiohttp.StreamReader] = {}
        self.metrics.body_bytes_in_flight.set_function(lambda: self._bodies.held)
        self._keys = {
            hashlib.sha256(key.encode()).digest(): identity
            for key, identity in cfg.auth.api_keys.items()
        }
        self._limiters = {
            digest: KeyLimiter(**identity.limits())
            for digest, identity in self._keys.items()
            if identity.limited
        }
        # Tenant name -> when last seen (monotonic), least recently seen first.
        self._tenants: OrderedDict[str, float] = OrderedDict()
        self.metrics.tenants.set_function(lambda: len(self._tenants))
        self.response_owners = ResponseOwners(grace_s=cfg.discovery.left_grace_s or 0.0)
        """Which engine made each stored response (Responses API)."""
        for worker in self._specs:
            self.response_owners.engine_joined(worker)
        self.metrics.response_owners.set_function(lambda: len(self.response_owners))
        # Lookups of unknown response ids in progress, shared by the requests naming one.
        self._locating: dict[str, asyncio.Future[str | None]] = {}
        self.health = EngineHealth(
            cfg.health,
            recheck_s=cfg.retries.eject_s,
            probe=self._probe,
            on_change=self._routing_changed,
            metrics=self.metrics,
        )
        self.health.set_engines(self._specs)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._model_check_task: asyncio.Task[None] | None = None
        self._send_guard: _SendGuard | None = None
        self._send_guard_task: asyncio.Task[None] | None = None
        # Set while no engine is routable: queued requests then leave with a 503 at once.
        self._nothing_routable: asyncio.Event | None = None
        self._port: int | None = None
        self.app = web.Application(
            client_max_size=cfg.limits.max_body_bytes, middlewares=[self._before_handler]
        )
        self.app.on_response_prepare.append(_close_after_unframed)
        self.app.add_routes(
            [
                web.post(_ROUTES["completions"], self._completions),
                web.post(_ROUTES["chat"], self._chat),
                web.post(_ROUTES["responses"], self._responses),
                web.route("*", "/v1/responses/{tail:.+}", self._responses_by_id),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/ready", self._ready),
                web.get("/metrics", self._metrics),
            ]
        )
        if cfg.admin.token is not None:
            from llmsched.gateway.admin import add_admin_routes

            add_admin_routes(self.app, self, cfg.admin.token)

    # -- lifecycle -----------------------------------------------------------------------

    def _set_context(self, context: int | None) -> None:
        """The engines' context length changed (what ``truncate_prompt_tokens: -1`` keeps)."""
        self._context = context
        if self.tokenizer is not None:
            self.tokenizer.max_model_len = context

    @property
    def port(self) -> int:
        """The port listened on (known after :meth:`start`; useful with ``listen.port: 0``)."""
        if self._port is None:
            raise RuntimeError("the gateway is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` of the running gateway (an IPv6 address in brackets)."""
        return self.config.listen.url(self.port)

    def _collect_usage(self) -> Usage:
        """What this replica took per rate-limited key (by its digest: the key never leaves)
        and served per tenant since the last flush (replica sync)."""
        keys: dict[str, tuple[float, float]] = {}
        for digest, limiter in self._limiters.items():
            if limiter.limits_rates:
                used = limiter.drain_usage()
                if used != (0.0, 0.0):
                    keys[digest.hex()] = used
        tenants = self.flow.drain_service() if self.flow is not None else []
        return {"keys": keys, "tenants": tenants}

    def _apply_usage(self, usage: Usage) -> None:
        """Another replica's usage: charged to the same keys' buckets and tenants' flows."""
        for digest_hex, (requests, tokens) in usage["keys"].items():
            try:
                limiter = self._limiters.get(bytes.fromhex(digest_hex))
            except ValueError:
                continue
            if limiter is not None:
                limiter.charge_remote(requests, tokens)
        if self.flow is not None:
            for tenant, priority, prompt, output in usage["tenants"]:
                self.flow.charge_remote(
                    tenant, priority, prompt_tokens=prompt, output_tokens=output
                )

    async def start(self) -> None:
        """Opens the upstream client, starts the KV-event subscriber and the metrics scraper,
        then listens. A failure to listen (port busy, a host that does not resolve) stops
        what was started and raises (an OSError; a ConfigError naming ``listen.host`` for a
        host that does not resolve)."""
        try:
            await self._start()
        except BaseException:
            # Nothing started is left behind (the upstream session warned when collected).
            await self.stop()
            raise

    async def _start(self) -> None:
        cfg = self.config
        timeouts = cfg.timeouts
        logging.getLogger("aiohttp.server").addFilter(_QUIET_PARSER_ERRORS)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_s
            ),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        await self.scheduler.start()
        if self.cluster is not None:
            await self.cluster.start()
        if cfg.discovery.file is not None:
            self._discovery_task = asyncio.create_task(self._watch_discovery(cfg.discovery.file))
        if self.kubernetes is not None:
            await self.kubernetes.start()
        self._nothing_routable = asyncio.Event()
        self._health_task = asyncio.create_task(self.health.run())
        self._watch_task = asyncio.create_task(self._watch_routable())
        self._model_check_task = asyncio.create_task(self.model_check.run())
        limits = cfg.limits
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,  # a client that goes away cancels its upstream request
            access_log=None,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
            # A body left unread (refused before or while reading it) is not drained here: the
            # connection closes after the answer, so a slow or endless body holds nothing (a
            # refused one is read and dropped briefly after its answer, _refuse_unread).
            lingering_time=0,
            # Idle keep-alive connections and request headers that never end are closed.
            keepalive_timeout=limits.idle_timeout_s,
            # A compressed body is refused (415) before it is read, never decoded.
            shutdown_timeout=_SHUTDOWN_GRACE_S,
            **_NO_DECOMPRESSION,
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        self._send_guard = _SendGuard(server, limits.idle_timeout_s, self.metrics)
        self._send_guard_task = asyncio.create_task(self._send_guard.run())
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                _capped(server, limits.max_connections, self.metrics, self._reading),
                cfg.listen.host,
                cfg.listen.port,
                reuse_address=True,
            )
        except socket.gaierror as exc:
            # As the native plane names it.
            raise ConfigError(
                f"listen.host: cannot resolve {cfg.listen.host!r}: {exc.strerror}"
            ) from None
        address = self._listener.sockets[0].getsockname() if self._listener.sockets else None
        self._port = int(address[1]) if isinstance(address, tuple) else cfg.listen.port

    async def stop(self) -> None:
        """Stops listening, gives the requests in flight aiohttp's shutdown grace
        (:data:`_SHUTDOWN_GRACE_S`) to end, cancels those left, resets the connections still
        open (an answer a client does not read would keep its connection, and the stop, from
        ever ending), then stops the background work."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()  # no new connections
        runner, self._runner = self._runner, None
        if runner is not None:
            server = runner.server
            # aiohttp forgets its connections (and they their transports) while shutting them
            # down: kept to reset them.
            transports = [] if server is None else [c.transport for c in server.connections]
            await runner.cleanup()
            for transport in transports:
                if transport is not None:
                    # aiohttp's close waits to deliver what the transport holds, forever for a
                    # client that does not read: a reset ends it now.
                    _reset(transport)
        if listener is not None:
            # uvloop's waits for every connection to end: bounded all the same.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(listener.wait_closed(), _LISTENER_CLOSE_S)
        tasks = (
            self._discovery_task,
            self._health_task,
            self._watch_task,
            self._model_check_task,
            self._send_guard_task,
        )
        for task in tasks:
            if task is not None:
                await cancel_and_wait(task)
        self._discovery_task = self._health_task = self._watch_task = None
        self._model_check_task = self._send_guard_task = self._send_guard = None
        if self.kubernetes is not None:
            await self.kubernetes.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.scheduler.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._port = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def engines(self) -> list[EngineSpec]:
        """The engines requests may go to now (from ``engines``, the discovery file or the
        pods Kubernetes discovery selects)."""
        return list(self._specs.values())

    async def set_engines(
        self, engines: Iterable[EngineSpec], *, allow_empty: bool = False
    ) -> tuple[list[str], list[str]]:
        """Replace the set of engines (what discovery calls); returns the worker ids added and
        removed. Engines kept keep their metrics, in-flight counts and index entries; removed
        ones leave the pool, the flow controller and the index; a running gateway restarts its
        KV-event subscriber (which catches up from the replay sockets) and its scraper on the
        new set. A repeated set, or an empty one unless ``allow_empty`` (then requests get a
        503 and ``/ready`` says not ready), raises ConfigError and changes nothing."""
        specs = engine_set(self.config, engines, allow_empty=allow_empty)
        for spec in specs.values():
            check_engine_url(spec)  # before anything changes
        # Pool, flow controller, index and feeds in one call; a changed engine starts over as
        # up, with its new spec.
        new, gone, updated = self.scheduler.set_engines(specs.values())
        added, removed, changed = (list(map(str, ids)) for ids in (new, gone, updated))
        if not (added or removed or changed):
            return [], []
        if self.slice_tracker is not None:
            # One that left is no migration target; one at another address starts afresh.
            for worker in removed + changed:
                self.slice_tracker.remove_endpoint(worker)
            for worker in added + changed:
                self.slice_tracker.set_endpoint(worker)
        self._specs = specs
        self._urls = _upstream_urls(specs)
        self.health.set_engines(specs, reset=changed)
        self.model_check.set_engines(specs.values())
        # One with a changed URL is another engine (or this one restarted): it holds none of
        # its stored responses. One that left may come back: see ResponseOwners.
        for worker in changed:
            self.response_owners.forget_engine(worker)
        for worker in removed:
            self.response_owners.engine_left(worker)
        for worker in added:
            self.response_owners.engine_joined(worker)
        self.metrics.engines_changed.inc(len(added) + len(removed) + len(changed))
        # At once, not at the next check: engines that came after none take requests now.
        self._note_routable()
        log.info("engines now %s (added %s, removed %s)", sorted(specs), added, removed)
        await self.scheduler.feeds_settled()  # started: the feeds follow the new set
        return added, removed

    async def _watch_discovery(self, path: Path) -> None:
        """Re-reads the discovery file when it changes; a file that cannot be read or checked
        keeps the current engines (counted, and logged once per distinct error)."""
        # The first pass re-reads the file: it may have changed since the config was loaded
        # (a no-op when it did not).
        seen: tuple[int, int, int] | None = (-1, -1, -1)
        errors = DiscoveryErrors()
        while True:
            await asyncio.sleep(self.config.discovery.interval_s)
            # Anything a file can provoke is caught, not only ConfigError (a RecursionError
            # from a deeply nested file, a bug): a watcher that dies stops discovery for good,
            # later good files ignored, and fails the shutdown.
            try:
                version = file_version(path)
                if version == seen:
                    continue
                seen = version
                engines = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: read_engines_file(path, max_bytes=self.config.discovery.max_bytes)
                )
                await self.set_engines(engines)
            except Exception as exc:
                self.metrics.discovery_errors.inc()
                errors.log(exc)

    def _kv_counters(self) -> dict[str, int]:
        # Summed over the feed's restarts (engine changes): the counters only go up.
        return self.scheduler.kv_event_counters()

    def _kv_failing(self) -> dict[str, str]:
        subscriber = self.scheduler.subscriber
        return {} if subscriber is None else subscriber.failing_sockets()

    # -- small endpoints -----------------------------------------------------------------

    @web.middleware
    async def _before_handler(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """What every request meets first: an unknown path or a method a path does not take
        gets an OpenAI-shaped error (as on the native plane), and a body with a
        Content-Encoding a 415 before it is read. Its answer is to be written by its deadline
        (``timeouts.total_s``, see :class:`_SendGuard`)."""
        if self._send_guard is not None and request.protocol is not None:
            total_s = self.config.timeouts.total_s
            deadline = None if total_s is None else time.monotonic() + total_s
            self._send_guard.request_arrived(request.protocol, deadline)
        routing_error = request.match_info.http_exception
        if routing_error is not None:
            return _error_response(_routing_refusal(request.path, routing_error))
        refusal = _encoding_refusal(request)
        if refusal is not None:
            route = _ROUTE_OF_PATH.get(request.path)
            return _error_response(refusal) if route is None else self.refuse(route, refusal)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        routable = self.routable_endpoints()
        status = 200 if routable else 503
        return web.json_response(
            {"ready": bool(routable), "endpoints": len(routable)}, status=status
        )

    def routable_endpoints(self) -> list[str]:
        """Engines a request could go to now: in the pool, up by the health model (not down,
        breaker not open) and not failing their scrapes (a timed-out scrape is no failure)."""
        present = {str(e["id"]) for e in self.pool.endpoints()}
        snapshot = self._scrape_snapshot()
        return [
            worker
            for worker in self._specs
            if worker in present
            and self.health.routable(worker)
            and _answering(snapshot.get(worker))
        ]

    def _scrape_snapshot(self) -> dict[str, dict[str, Any]]:
        """The metrics scraper's snapshot (empty while none runs)."""
        scraper = self.scheduler.scraper
        return scraper.snapshot() if scraper is not None else {}

    async def _watch_routable(self) -> None:
        """Keeps ``_nothing_routable`` current (scrapes and probes change it)."""
        while True:
            self._note_routable()
            await asyncio.sleep(_ROUTABLE_CHECK_S)

    def _note_routable(self) -> None:
        """``_nothing_routable`` as the engines are now (a no-op before :meth:`start`)."""
        if self._nothing_routable is not None:
            if self.routable_endpoints():
                self._nothing_routable.clear()
            else:
                self._nothing_routable.set()

    def _routing_changed(self, worker: str, routable: bool) -> None:
        """The health model took an engine out of routing or brought it back."""
        with contextlib.suppress(UnknownEndpointError):  # not (or no longer) configured
            if routable:
                self.scheduler.resume(worker)
            else:
                self.scheduler.drain(worker)
        self._note_routable()

    async def _probe(self, worker: str) -> bool:
        """One health probe: ``GET <engine><health.path>`` answered 200 within the timeout."""
        spec = self._specs.get(worker)
        if spec is None or self._session is None:
            return False
        timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_s)
        async with self._session.get(
            spec.base_url + self.config.health.path, timeout=timeout
        ) as response:
            await response.read()
            return response.status == 200

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authenticate(request)
        except Refusal as refusal:
            return self.refuse("models", refusal)
        data: list[dict[str, object]] = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llmsched"}
            for m in self.config.models
        ]
        # Adapters as vLLM lists them: with their base model as ``parent``.
        data += [
            {"id": a, "object": "model", "created": 0, "owned_by": "llmsched", "parent": base}
            for a, base in sorted(self.config.lora_adapters.items())
        ]
        self.metrics.requests.labels("models", "200").inc()
        return web.json_response({"object": "list", "data": data})

    # -- generation ----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._gone_counted("completions", self._generate(request, "completions"))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._gone_counted("chat", self._generate(request, "chat"))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._gone_counted("responses", self._generate(request, "responses"))

    async def _gone_counted(
        self, route: str, serving: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """``serving``'s answer. A client that leaves first cancels its handler
        (``handler_cancellation``): counted as ``client_gone`` on ``route``, wherever it was
        (read, queued, waiting for or relaying the answer), as the native plane counts it."""
        try:
            return await serving
        except asyncio.CancelledError:
            self.metrics.requests.labels(route, "client_gone").inc()
            raise

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        """One generation request: read and check it, admit it, serve it, release it."""
        arrived = time.perf_counter()
        total_s = self.config.timeouts.total_s
        deadline = time.monotonic() + (total_s if total_s is not None else 1e9)
        try:
            incoming = await self._read_request(request, route, deadline)
            # Kept current by probes and scrapes (a flag, not a scan of the engines).
            if self._nothing_routable is not None and self._nothing_routable.is_set():
                raise self._no_engine_refusal()
        except Refusal as refusal:
            return await self._refuse_unread(request, route, refusal)
        limiter = incoming.limiter
        if limiter is not None:
            over = limiter.acquire(prompt_tokens=incoming.prompt.size)
            if over is not None:
                reason, wait_s = over
                return self.refuse(route, _limit_refusal(reason, wait_s))
        slot = _FlowSlot(None)
        try:
            if self.flow is not None:
                try:
                    slot.admission = await self._admit(incoming)
                except FlowRejected as rejected:
                    dropped = _flow_refusal(rejected, self.config.limits.retry_after_s)
                    return self.refuse(route, dropped)
                except Refusal as refusal:
                    return self.refuse(route, refusal)
            else:  # admitted at once: an id, no slot
                slot.admission = await self.scheduler.admit(incoming.scheduled)
            request_id = slot.admission.id
            try:
                return await self._serve(request, route, incoming, slot, request_id, arrived)
            finally:
                # The admission held at the end: the first, or a sliced continuation's.
                if slot.admission is not None:
                    slot.admission.release(slot.output_tokens)
        finally:
            if limiter is not None:
                key_tokens = slot.key_tokens
                limiter.release(
                    output_tokens=slot.output_tokens if key_tokens is None else key_tokens
                )

    async def _response_engine(
        self, response_id: str, deadline: float, *, generating: bool = True
    ) -> str:
        """The engine holding stored response ``response_id``: known from its answer, else
        asked of the engines (:meth:`_locate`). Refusal: 404 when no engine has it; 503 when
        ``generating`` (a conversation continued) and its engine is out of routing: no other
        can answer for it. A request about the response itself (``GET``, ``cancel``) goes to
        its engine whatever its routing state (drained, it still answers). An engine that left
        the configuration within :data:`~llmsched.gateway.responses.OWNER_GRACE_S` may come
        back with it: a 503 too."""
        holder = self.response_owners.owner(response_id)
        if holder is not None and holder.left:
            raise self._owner_unavailable(response_id, f"{holder.engine!r} left the configuration")
        engine = None if holder is None else holder.engine
        if engine is not None and engine in self._specs:
            if generating and engine not in self.routable_endpoints():
                raise self._owner_unavailable(response_id, f"{engine!r} is out of routing")
            self.metrics.response_lookups.labels("owner").inc()
            return engine
        engine = await self._locate(response_id, deadline)
        if engine is None:
            self.metrics.response_lookups.labels("not_found").inc()
            raise _response_not_found(
                response_id, "previous_response_id" if generating else "response_id"
            )
        self.metrics.response_lookups.labels("located").inc()
        return engine

    def _owner_unavailable(self, response_id: str, why: str) -> Refusal:
        self.metrics.response_lookups.labels("owner_unavailable").inc()
        return Refusal(
            503,
            "service_unavailable",
            f"the engine holding response {response_id!r} is not available ({why})",
            {
                DROPPED_REASON_HEADER: "owner-unavailable",
                "Retry-After": str(self.config.limits.retry_after_s),
            },
        )

    async def _locate(self, response_id: str, deadline: float) -> str | None:
        """Asks every engine in routing at once for ``response_id`` (``GET
        /v1/responses/{id}``, each ask bounded by :data:`_LOCATE_TIMEOUT_S`); the first to
        answer 200 with that very id holds it and is recorded. For ids this gateway never
        saw: made before it started, or through another replica. Concurrent lookups of one
        id share one."""
        shared = self._locating.get(response_id)
        if shared is None:
            shared = asyncio.ensure_future(self._ask_engines(response_id, deadline))
            self._locating[response_id] = shared
            shared.add_done_callback(lambda _: self._locating.pop(response_id, None))
        # A waiter leaving (its client gone) leaves the lookup to the others.
        return await asyncio.shield(shared)

    async def _ask_engines(self, response_id: str, deadline: float) -> str | None:
        session = self.upstream_session()
        timeouts = self.config.timeouts
        bound = min(_LOCATE_TIMEOUT_S, timeouts.read_s or _LOCATE_TIMEOUT_S)
        timeout = aiohttp.ClientTimeout(
            total=max(min(deadline - time.monotonic(), bound), 0.001),
            sock_connect=timeouts.connect_s,
        )

        async def holds(engine: str) -> str | None:
            # One path segment whatever the id holds (a "/" or "?" names no other path).
            base = self._urls[(engine, "responses")]
            url = URL(f"{base}/{quote(response_id, safe='')}", encoded=True)
            try:
                async with session.get(url, timeout=timeout) as answer:
                    if answer.status != 200:
                        return None
                    body = await _read_at_most(answer, _WHOLE_BODY_LIMIT)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None
            # An engine answering 200 for any id must not capture it: the answer names it.
            return engine if body is not None and response_id_of(body) == response_id else None

        asks = [asyncio.ensure_future(holds(engine)) for engine in self.routable_endpoints()]
        try:
            for finished in asyncio.as_completed(asks):
                engine = await finished
                if engine is not None:
                    self.response_owners.record(response_id, engine)
                    return engine
            return None
        finally:
            for ask in asks:
                ask.cancel()

    async def _responses_by_id(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses/{id}`` (see :meth:`_response_by_id`), a client leaving first counted."""
        return await self._gone_counted("responses_by_id", self._response_by_id(request))

    async def _response_by_id(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses/{id}`` and the paths under it (``cancel``, ``input_items``), any
        method: relayed to the engine holding the response (no other can answer for it).
        Authenticated and held to the key's request limits, but not admitted through flow
        control: no generation runs."""
        route = "responses_by_id"
        total_s = self.config.timeouts.total_s
        deadline = time.monotonic() + (total_s if total_s is not None else 1e9)
        limiter: KeyLimiter | None = None
        try:
            _, _, limiter = self._authenticate(request)
            target = request.rel_url.raw_path
            segments = [unquote(part) for part in target.split("/")]
            if "%2f" in target.lower() or any(part in (".", "..") for part in segments):
                # An escaped "/" or a dot segment names some other path on the engine.
                raise Refusal(404, "not_found", "not found")
            try:
                # An id whose escapes are no UTF-8 text names no response (as natively).
                response_id = unquote(target.split("/")[3], errors="strict")
            except (IndexError, UnicodeDecodeError):
                response_id = ""
            if not response_id:
                raise Refusal(404, "not_found", "not found")
            if limiter is not None:
                over = limiter.acquire(prompt_tokens=0)
                if over is not None:
                    limiter = None  # not admitted: nothing to release
                    raise _limit_refusal(*over)
            body = await self._read_body(request)
            engine = await self._response_engine(response_id, deadline, generating=False)
            return await self._relay_by_id(request, route, engine, body, deadline)
        except Refusal as refusal:
            return await self._refuse_unread(request, route, refusal)
        finally:
            if limiter is not None:
                limiter.release(output_tokens=0)

    async def _relay_by_id(
        self, request: web.Request, route: str, engine: str, body: bytes, deadline: float
    ) -> web.StreamResponse:
        """Relays a by-id request to ``engine``, its answer checked as a generation's is: an
        answer ended by the engine's close must be whole JSON, a transfer coding besides
        chunked is refused, an event stream must show its terminal event."""
        target = request.rel_url.raw_path_qs  # origin form, whatever form the client sent
        url = URL(self._specs[engine].base_url + target, encoded=True)
        headers = {
            name: value
            for name in ("Content-Type", "Accept")
            if (value := request.headers.get(name)) is not None
        }
        session = self.upstream_session()
        cut_off = Refusal(502, "upstream_error", "the engine's answer was cut off")
        try:
            upstream = await session.request(
                request.method,
                url,
                data=body or None,
                headers=headers,
                timeout=self.upstream_timeout(deadline),
            )
        except asyncio.TimeoutError:
            self.metrics.upstream_errors.labels(engine, "timeout").inc()
            raise Refusal(504, "timeout", "the engine did not answer in time") from None
        except aiohttp.ClientError:
            self.metrics.upstream_errors.labels(engine, "connect").inc()
            raise Refusal(502, "upstream_error", "the engine holding the response failed") from None
        try:
            if upstream.status < 200 or _coded_transfer(upstream):
                self.metrics.upstream_errors.labels(engine, "broken").inc()
                raise Refusal(502, "upstream_error", "the engine's answer is not one to relay")
            sse = "event-stream" in upstream.headers.get("Content-Type", "")
            # A HEAD answer has no body, whatever its headers say.
            if not sse and request.method != "HEAD" and _ends_at_close(upstream):
                try:
                    data = await _read_at_most(upstream, _WHOLE_BODY_LIMIT)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    data = None
                if data is None or (_is_json(upstream) and not _parses(data)):
                    self.metrics.upstream_errors.labels(engine, "truncated").inc()
                    raise cut_off
                whole = _passed_on(upstream, web.Response(body=data, status=upstream.status))
                self.metrics.requests.labels(route, str(upstream.status)).inc()
                return whole
            response = _passed_on(upstream, web.StreamResponse(status=upstream.status))
            done = TerminalEventScan() if sse and upstream.status < 300 else None
            feeds: tuple[_Feed, ...] = () if done is None else (done,)
            try:
                await response.prepare(request)
                relayed = await _relay_chunks(upstream, response, None, *feeds)
            except ConnectionError:
                self.metrics.requests.labels(route, "client_gone").inc()
                return response
            if relayed.cut or (done is not None and not done.seen):
                timed_out = time.monotonic() >= deadline
                self._count_cut(engine, timed_out=timed_out)
                await self.abort_response(
                    request,
                    response,
                    engine,
                    sse=sse,
                    mid_event=relayed.mid_event,
                    responses=True,
                    timed_out=timed_out,
                )
                self.metrics.requests.labels(route, "aborted").inc()
                return response
            await response.write_eof()
            self.metrics.requests.labels(route, str(upstream.status)).inc()
            return response
        finally:
            upstream.close()

    def _no_engine_refusal(self) -> Refusal:
        return Refusal(
            503,
            "service_unavailable",
            "no engine is available",
            {
                DROPPED_REASON_HEADER: "no-endpoints",
                "Retry-After": str(self.config.limits.retry_after_s),
            },
        )

    async def _read_request(self, request: web.Request, route: str, deadline: float) -> _Incoming:
        """Authenticates, reads (size- and time-limited) and checks a request; raises
        Refusal."""
        tenant, priority, limiter = self._authenticate(request)
        body = await self._read_body(request)
        payload = _json_object(body)
        # Escapes may encode lone surrogates, which no engine can take: strings are checked
        # only when the body has escapes.
        _check_structure(payload, "", 0, text=b"\\u" in body)
        model = payload.get("model")
        if not isinstance(model, str):
            raise Refusal(400, "invalid_request_error", "'model' must be a string", param="model")
        if model not in self.config.models and model not in self.config.lora_adapters:
            raise Refusal(
                404, "model_not_found", f"model {model!r} is not served here", param="model"
            )
        _check_fields(payload)
        if self.tokenizer is not None and len(body) >= _OFFLOADED_PROMPT_BYTES:
            # Tokenizing a long prompt takes milliseconds to seconds: off the event loop that
            # serves every other request.
            prompt = await asyncio.to_thread(self._prompt, route, payload)
        else:
            prompt = self._prompt(route, payload)
        pick_args = self._pick_args(prompt, model, priority, payload, request)
        try:
            scheduled = ScheduleRequest(
                tokens=pick_args.get("tokens"),
                text=pick_args.get("text"),
                messages=pick_args.get("messages"),
                model=pick_args["model"],
                lora=pick_args.get("lora"),
                tenant=tenant,
                priority=priority,
                session_id=pick_args.get("session_id"),
                session_endpoint=pick_args.get("session_endpoint"),
                cache_salt=pick_args.get("cache_salt"),
                prompt_tokens=prompt.size,
                size_bytes=len(body),
            )
        except (InvalidRequestError, InvalidTokenError) as exc:
            raise Refusal(400, "invalid_request_error", str(exc)) from None
        return _Incoming(
            tenant,
            priority,
            body,
            payload,
            prompt,
            pick_args,
            scheduled,
            deadline,
            limiter=limiter,
        )

    async def _admit(self, incoming: _Incoming) -> Admission:
        """Waits for flow control to dispatch the request (its queued time in the metrics)."""
        admission = await self._wait_admitted(incoming.scheduled, incoming.deadline)
        incoming.queued_s = admission.queued_s
        self.metrics.queue_seconds.observe(admission.queued_s)
        return admission

    async def _wait_admitted(self, scheduled: ScheduleRequest, deadline: float) -> Admission:
        """The scheduler's admission, left with a 503 as soon as no engine is routable, or a
        504 at the request's deadline (the queued request is cancelled either way)."""
        assert self._nothing_routable is not None
        admitted = asyncio.ensure_future(self.scheduler.admit(scheduled))
        nothing = asyncio.ensure_future(self._nothing_routable.wait())
        try:
            await asyncio.wait(
                (admitted, nothing),
                timeout=max(deadline - time.monotonic(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            nothing.cancel()
            if not admitted.done():
                admitted.cancel()
                # Its refusal or cancellation is read below; the handler's own goes through.
                await settled(admitted)
        if admitted.cancelled():
            if time.monotonic() >= deadline:
                raise _deadline_refusal()
            raise self._no_engine_refusal()
        return admitted.result()  # raises FlowRejected

    async def _serve(
        self,
        request: web.Request,
        route: str,
        incoming: _Incoming,
        slot: _FlowSlot,
        request_id: int,
        arrived: float,
    ) -> web.StreamResponse:
        """Routes and proxies an admitted request (sliced when slices are on and it can be);
        records in ``slot`` what flow control must be told at the end."""
        assembler = (
            None
            if self.slice_tracker is None or route == "responses"
            else make_assembler(incoming.payload, route, self.config.slices.default_max_tokens)
        )
        if assembler is not None and self.slice_tracker is not None:
            assert slot.admission is not None
            sliced = SlicedRequest(
                self,
                self.slice_tracker,
                assembler,
                route=route,
                request_id=request_id,
                admission=slot.admission,
                tenant=incoming.tenant,
                priority=incoming.priority,
                prompt_tokens=incoming.prompt.size,
                stream=bool(incoming.payload.get("stream")),
                base_pick_args=incoming.pick_args,
                deadline=incoming.deadline,
            )
            self.metrics.overhead_seconds.observe(time.perf_counter() - arrived - incoming.queued_s)
            try:
                return await sliced.run(request)
            finally:
                slot.admission, slot.output_tokens = sliced.admission, sliced.uncharged_tokens()
                slot.key_tokens = sliced.asm.produced_tokens
        first = None
        previous = incoming.payload.get("previous_response_id") if route == "responses" else None
        if isinstance(previous, str):
            try:
                first = await self._response_engine(previous, incoming.deadline)
            except Refusal as refusal:
                return self.refuse(route, refusal)
        try:
            placement = self.place(incoming.scheduled, first=first)
        except Refusal as refusal:
            return self.refuse(route, refusal)
        if placement is None:
            return self.refuse(route, self._no_engine_refusal())
        self.metrics.overhead_seconds.observe(time.perf_counter() - arrived - incoming.queued_s)
        response, slot.output_tokens = await self._proxy(
            request,
            route,
            incoming.body,
            placement,
            incoming.deadline,
            pinned=first is not None,
            stored=route == "responses" and stores_response(incoming.payload),
        )
        return response

    def _authenticate(self, request: web.Request) -> tuple[str, int, KeyLimiter | None]:
        """(tenant, priority, the key's limiter): from the API key when auth is on (headers
        ignored), else from the ``x-llmsched-tenant`` / ``x-llmsched-priority`` headers."""
        if self.config.auth.enabled:
            found = self._identity(_presented_key(request))
            if found is None:
                raise Refusal(401, "invalid_api_key", "missing or invalid API key")
            digest, identity = found
            return identity.tenant, identity.priority, self._limiters.get(digest)
        tenant = self._bounded_tenant(_header(request, TENANT_HEADER) or "default")
        raw = _header(request, PRIORITY_HEADER)
        if raw is None:
            return tenant, 0, None
        priority = int(raw) if _PRIORITY.fullmatch(raw) else 1 << 40
        if not -(2**31) <= priority < 2**31:
            raise Refusal(
                400,
                "invalid_request_error",
                f"{PRIORITY_HEADER} must be an int",
                param=PRIORITY_HEADER,
            )
        return tenant, priority, None

    def _bounded_tenant(self, tenant: str) -> str:
        """Tenant names from a header are the client's choice: past ``limits.max_tenants``
        distinct names seen within ``limits.tenant_idle_s``, new ones share one flow
        (:data:`OVERFLOW_TENANT`), so flow control holds a bounded number of flows whatever
        clients send. A name unseen for ``tenant_idle_s`` gives its place back."""
        now = time.monotonic()
        idle_s = self.config.limits.tenant_idle_s
        while self._tenants:
            oldest, seen = next(iter(self._tenants.items()))
            if seen + idle_s > now:
                break
            del self._tenants[oldest]
        if tenant in self._tenants:
            self._tenants[tenant] = now
            self._tenants.move_to_end(tenant)
            return tenant
        if len(self._tenants) >= self.config.limits.max_tenants:
            self.metrics.tenants_folded.inc()
            return OVERFLOW_TENANT
        self._tenants[tenant] = now
        return tenant

    def _identity(self, key: str | None) -> tuple[bytes, ApiKey] | None:
        if key is None:
            return None
        # A header with bytes that are not UTF-8 reaches here with surrogate escapes: its bytes
        # are hashed as they came, and match no key.
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        # Every stored digest is compared, in constant time, whatever matches: the time taken
        # says nothing about which key or how much of it was right.
        found = None
        for stored, identity in self._keys.items():
            if hmac.compare_digest(stored, digest):
                found = stored, identity
        return found

    async def _read_body(self, request: web.Request) -> bytes:
        """The request's body, read up to ``limits.max_body_bytes`` (413; one declared larger
        is refused before it is read) within ``limits.body_timeout_s`` (408), its bytes held
        against ``limits.max_body_bytes_in_flight`` while it is read (503 ``body-capacity``:
        at once for a declared length that does not fit, as soon as a chunked body's next
        chunk does not fit). Every way out gives the bytes back, a client that leaves too."""
        limits = self.config.limits
        too_large = Refusal(
            413,
            "request_too_large",
            f"body exceeds {limits.max_body_bytes} bytes",
            close=True,
            drain=True,
        )
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes:
            raise too_large  # refused before a byte of it is read
        no_room = Refusal(
            503,
            "service_unavailable",
            "the gateway is receiving too many request bodies at once "
            "(limits.max_body_bytes_in_flight); retry later",
            {DROPPED_REASON_HEADER: "body-capacity", "Retry-After": str(limits.retry_after_s)},
            close=True,
            drain=True,
        )
        with self._bodies.hold() as hold:
            if declared is not None and not hold.take(declared):
                raise no_room

            async def chunks() -> bytes:
                body = bytearray()
                while chunk := await request.content.readany():
                    if len(body) + len(chunk) > limits.max_body_bytes:
                        raise too_large
                    if declared is None and not hold.take(len(chunk)):
                        raise no_room
                    body += chunk
                return bytes(body)

            transport = request.transport
            if transport is not None:
                self._reading[transport] = request.content
            try:
                body = await asyncio.wait_for(chunks(), limits.body_timeout_s)
                # A UTF-8 byte order mark first is dropped (Python's ``json.loads`` of bytes,
                # vLLM's reading, skips it): read and forwarded without it, as natively.
                return body.removeprefix(codecs.BOM_UTF8)
            except _BodyCut:
                # The client half-closed its connection before its body's end: answered on
                # the half left open, as the native plane (hyper) answers it.
                raise Refusal(
                    400, "invalid_request_error", "the body did not arrive", close=True
                ) from None
            except ConnectionResetError:
                # The client went away while sending its body: nothing to answer, nothing to
                # log (aiohttp logs a traceback per such request otherwise, noise any client
                # can make).
                raise asyncio.CancelledError from None
            except asyncio.TimeoutError:
                raise Refusal(
                    408,
                    "request_timeout",
                    f"the body did not arrive within {limits.body_timeout_s:g} s",
                    close=True,
                ) from None
            finally:
                if transport is not None:
                    self._reading.pop(transport, None)

    def _prompt(self, route: str, payload: dict[str, Any]) -> _Prompt:
        try:
            if route == "responses":
                return self._responses_prompt(payload)
            if route == "chat":
                messages = payload.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise PromptError("'messages' must be a non-empty list")
                if self.tokenizer is not None:
                    ids = self.tokenizer.chat_request_tokens(payload)
                    return _Prompt(np.asarray(ids, dtype=np.uint32), None, None, len(ids))
                _check_messages(messages)
                size = sum(len(str(m.get("content", ""))) for m in messages) // 4
                return _Prompt(None, None, messages, size)
            prompt = payload.get("prompt")
            if prompt == "" and not _embeds_only(payload.get("prompt_embeds")):
                # As vLLM refuses it (nothing to route on, and the engine answers 400).
                raise Refusal(
                    400,
                    "invalid_request_error",
                    "Either prompt or prompt_embeds must be provided and non-empty.",
                    param="prompt",
                )
            if prompt is None and _embeds_only(payload.get("prompt_embeds")):
                # vLLM takes the prompt as embeddings: no token to hash (their cache blocks
                # are keyed by the embeddings, which no other prompt shares by its tokens).
                return _Prompt(np.empty(0, dtype=np.uint32), None, None, 0)
            if self.tokenizer is not None:
                add_special_tokens = payload.get("add_special_tokens")
                ids = self.tokenizer.completion_tokens(
                    prompt,
                    True if add_special_tokens is None else add_special_tokens,
                    payload.get("truncate_prompt_tokens"),
                    payload.get("truncation_side"),
                )
                return _Prompt(np.asarray(ids, dtype=np.uint32), None, None, len(ids))
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch routes by its first prompt
            if isinstance(prompt, str):
                return _Prompt(None, prompt, None, len(prompt) // 4)
            if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
                # The engine keeps what the request's truncation keeps of the ids.
                truncation = Truncation.read(
                    payload.get("truncate_prompt_tokens"),
                    payload.get("truncation_side"),
                    self._context,
                )
                if truncation is not None:
                    prompt = truncation.cut(prompt)
                return _Prompt(np.asarray(prompt, dtype=np.uint32), None, None, len(prompt))
            raise PromptError("'prompt' must be a string or a list of token ids")
        except PromptError as exc:
            raise Refusal(400, "invalid_request_error", str(exc)) from None

    def _responses_prompt(self, payload: dict[str, Any]) -> _Prompt:
        """The prompt of a ``POST /v1/responses`` request: the chat request vLLM makes of it,
        tokenized (or rendered) as a chat request is. A conversation continued by
        ``previous_response_id`` is not hashed: the engine puts its stored conversation
        first, which the gateway cannot see, so the blocks of the new input alone would be
        recorded for blocks the engine never caches. Its engine is found by the id instead."""
        previous = payload.get("previous_response_id")
        size = len(json.dumps(payload.get("input"))) // 4
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise Refusal(
                    400,
                    "invalid_request_error",
                    "'previous_response_id' must be a non-empty string",
                    param="previous_response_id",
                )
            return _Prompt(np.empty(0, dtype=np.uint32), None, None, size)
        chat = chat_request_of(payload)
        if chat is None:
            self.metrics.responses_unhashed.inc()
            return _Prompt(np.empty(0, dtype=np.uint32), None, None, size)
        if self.tokenizer is not None:
            try:
                ids = self.tokenizer.chat_request_tokens(chat)
            except PromptError:
                # Content the chat path refuses (an image part, say) may still be the
                # engine's to take or refuse: routed without hashing.
                self.metrics.responses_unhashed.inc()
                return _Prompt(np.empty(0, dtype=np.uint32), None, None, size)
            return _Prompt(np.asarray(ids, dtype=np.uint32), None, None, len(ids))
        messages = chat["messages"]
        if not messages:
            return _Prompt(np.empty(0, dtype=np.uint32), None, None, 0)
        try:
            _check_messages(messages)
        except PromptError:  # the engine's to refuse, as with a tokenizer
            self.metrics.responses_unhashed.inc()
            return _Prompt(np.empty(0, dtype=np.uint32), None, None, size)
        return _Prompt(None, None, messages, size)

    def _pick_args(
        self,
        prompt: _Prompt,
        model: str,
        priority: int,
        payload: Mapping[str, Any],
        request: web.Request,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"model": model, "priority": priority}
        base = self.config.lora_adapters.get(model)
        if base is not None:
            # An adapter is served by its base model's engines; its cache blocks are keyed
            # by its name.
            args["model"] = base
            args["lora"] = model
        if prompt.tokens is not None:
            args["tokens"] = prompt.tokens
        elif prompt.text is not None:
            args["text"] = prompt.text
        else:
            args["messages"] = prompt.messages
        salt = payload.get("cache_salt")
        if isinstance(salt, str):
            args["cache_salt"] = salt
        session = _header(request, SESSION_HEADER)
        if session:
            args["session_id"] = session
        token = request.headers.get(SESSION_TOKEN_HEADER)
        if token is not None:
            endpoint = self._session_tokens.endpoint(token)
            if endpoint is not None and endpoint in self._specs:
                args["session_endpoint"] = endpoint
            else:  # ignored, as llm-d ignores it
                self.metrics.session_tokens_ignored.inc()
        return args

    def _mark_session(self, response: _Answer, endpoint: str) -> _Answer:
        """``response`` with the ``x-session-token`` of ``endpoint``, the engine that served,
        when the router's profiles read the session (as llm-d's session-affinity scorer
        sets it)."""
        if self._sets_session_tokens:
            response.headers[SESSION_TOKEN_HEADER] = self._session_tokens.token(endpoint)
        return response

    # -- package-internal seam (used by llmsched.gateway.slicing) ---------------------------

    def place(self, scheduled: ScheduleRequest, *, first: str | None = None) -> Placement | None:
        """The scheduler's placement of an admitted request (picked and in flight), timed in
        the metrics; None when no endpoint can serve it. The caller holds the admission.
        ``first``: the engine tried first whatever the decision (it holds the request's
        state). Raises :class:`Refusal` (see :meth:`_routing_failed`) when the decision
        failed otherwise: a router plugin's error, whatever its class. Package-internal."""
        started = time.perf_counter()
        try:
            return self.scheduler.place(scheduled, first=first)
        except NoEndpointError:
            return None
        except BaseException as exc:
            # A Python scorer or filter that raised (KeyboardInterrupt and SystemExit too: on
            # the event loop they would end the server) or returned what it must not.
            raise self._routing_failed(exc) from exc
        finally:
            self.metrics.decision_seconds.observe(time.perf_counter() - started)

    def _routing_failed(self, error: BaseException) -> Refusal:
        """The answer to a decision a router plugin failed, as the native plane gives it: a
        500 that says why, counted in ``rejections_total{reason="routing_failed"}``, the error
        logged (with its traceback) once per distinct message, the first
        :data:`_LOGGED_ROUTING_FAILURES`. Nothing was taken for the request."""
        message = f"routing failed: {_describe_error(error)}"
        if (
            message not in self._routing_failures
            and len(self._routing_failures) < _LOGGED_ROUTING_FAILURES
        ):
            self._routing_failures.add(message)
            log.error("%s (answered 500)", message, exc_info=error)
        return Refusal(500, "internal_error", message, {DROPPED_REASON_HEADER: "routing_failed"})

    # -- upstream ------------------------------------------------------------------------

    async def _proxy(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        placement: Placement,
        deadline: float,
        *,
        pinned: bool = False,
        stored: bool = False,
    ) -> tuple[web.StreamResponse, int]:
        """Sends to the placed endpoint, then (:meth:`Placement.retry`) to the fallbacks while
        attempts fail before the engine's status line (or get a 5xx). Returns the response
        sent and the output tokens counted. The placement's exit settles the accounting: a
        failed request drops its approximate prefix record, a client gone cancels it.
        ``pinned``: only the placed endpoint can run it (it holds the request's state): no
        fallback is tried, as any other would answer 404. ``stored``: a Responses request
        whose response the engine keeps: its id is recorded as the answering engine's."""
        # Failures the request itself may have caused (a 5xx, a connection dropped before the
        # status line), held until it ends: see _settle_held.
        held: list[tuple[str, str]] = []
        try:
            return await self._proxy_attempts(
                request, route, body, placement, deadline, held, pinned=pinned, stored=stored
            )
        finally:
            self._settle_held(held, unanswered=False)

    def _settle_held(self, held: list[tuple[str, str]], *, unanswered: bool) -> None:
        """Counts the failures a request held against their engines (and empties ``held``),
        unless it went ``unanswered`` after failing so on two or more engines: then the
        request, not the engines, is the likely cause (an input every engine answers with a
        5xx), and counting it would let a few such requests open every engine's breaker; it is
        counted as poisoned instead, and those engines are probed: probes, not this request,
        decide whether they are well. A request answered elsewhere, or failed on one engine,
        counts as before."""
        if unanswered and len(held) >= 2:
            self.metrics.poisoned_requests.inc()
            for endpoint, _ in held:
                # Probes tell an input every engine fails on from engines failing together.
                self.health.ask_probes(endpoint)
        else:
            for endpoint, kind in held:
                self.health.record(endpoint, kind)
        held.clear()

    async def _proxy_attempts(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        placement: Placement,
        deadline: float,
        held: list[tuple[str, str]],
        *,
        pinned: bool = False,
        stored: bool = False,
    ) -> tuple[web.StreamResponse, int]:
        with placement:
            while True:
                endpoint = str(placement.endpoint)
                if placement.attempts > 1:
                    self.metrics.retries.inc()
                try:
                    answered = await self._attempt(
                        request,
                        route,
                        body,
                        placement.decision,
                        endpoint,
                        deadline,
                        held,
                        stored=stored,
                    )
                    if 400 <= answered[0].status < 500:
                        # The engine refused the request and cached none of it: the blocks
                        # recorded for it there go (they would draw its prefix to nothing).
                        placement.fail()
                    return answered
                except _UpstreamFailed as failed:
                    self.metrics.upstream_errors.labels(endpoint, failed.kind).inc()
                    # The request's own deadline ending an attempt says nothing about the
                    # engine.
                    if failed.kind in _HELD_FAILURES and time.monotonic() < deadline:
                        held.append((endpoint, failed.kind))
                    elif failed.kind != "removed" and time.monotonic() < deadline:
                        self.health.record(endpoint, failed.kind)
                except _NoAnswer as no_answer:
                    placement.fail()
                    self.metrics.upstream_errors.labels(endpoint, "timeout").inc()
                    if not no_answer.by_deadline:
                        self.health.record(endpoint, "timeout")
                        return self.refuse(
                            route,
                            Refusal(
                                504, "timeout", "the engine did not answer within timeouts.read_s"
                            ),
                        ), 0
                    return self.refuse(route, _deadline_refusal()), 0
                except _DeadlinePassed:
                    # Neither a truncation nor the engine's failure: the request ran out of
                    # time (a short total_s would otherwise show healthy engines cutting).
                    placement.fail()
                    return self.refuse(route, _deadline_refusal()), 0
                except _Truncated as truncated:
                    # The status line came: the request ran (or runs) there; it is not re-sent.
                    placement.fail()
                    self.metrics.upstream_errors.labels(endpoint, "truncated").inc()
                    self.metrics.truncated.labels(endpoint, "error").inc()
                    return self.refuse(route, Refusal(502, "upstream_error", str(truncated))), 0
                # The attempt failed before the engine took the request: the next endpoint.
                if pinned or placement.attempts >= self.config.retries.max_attempts:
                    break
                if time.monotonic() >= deadline:
                    placement.fail()
                    return self.refuse(route, _deadline_refusal()), 0
                started = time.perf_counter()
                try:
                    placement.retry()
                except NoEndpointError:
                    break
                finally:
                    self.metrics.decision_seconds.observe(time.perf_counter() - started)
            placement.fail()
        if time.monotonic() >= deadline:
            return self.refuse(route, _deadline_refusal()), 0
        self._settle_held(held, unanswered=True)
        return self.refuse(
            route,
            Refusal(502, "upstream_error", f"no engine answered ({placement.attempts} attempts)"),
        ), 0

    def upstream_timeout(self, deadline: float) -> aiohttp.ClientTimeout:
        """Upstream timeouts of an attempt: ``timeouts.connect_s`` / ``read_s``, and the time
        left until the request's ``deadline`` (monotonic seconds) in all. Package-internal."""
        timeouts = self.config.timeouts
        return aiohttp.ClientTimeout(
            total=max(deadline - time.monotonic(), 0.001),
            sock_connect=timeouts.connect_s,
            sock_read=timeouts.read_s,
        )

    def _cut_failure(self, endpoint: str, deadline: float) -> None:
        """Counts an answer cut off or timed out after its status line against the engine,
        unless the request's own deadline ended it."""
        if time.monotonic() < deadline:
            self.health.record(endpoint, "truncated")

    async def _attempt(
        self,
        request: web.Request,
        route: str,
        body: bytes,
        decision: Decision,
        endpoint: str,
        deadline: float,
        held: list[tuple[str, str]],
        *,
        stored: bool = False,
    ) -> tuple[web.StreamResponse, int]:
        """One upstream attempt (``stored``: as in :meth:`_proxy`). Raises _UpstreamFailed
        when the request did not get through (connection refused or timed out, or closed
        before a status line) or got a 5xx; _NoAnswer when no status line came in time;
        _Truncated when the answer fails before the client got a byte; after that, a failure
        aborts the client's response. Once the engine answers, the failures ``held`` from
        earlier attempts count against their engines (not when the answer ends: a stream can
        last minutes)."""
        assert self._session is not None, "the gateway is not started"
        headers = {"Content-Type": "application/json"}
        accept = request.headers.get("Accept")
        if accept:
            headers["Accept"] = accept
        prefill = decision.prefill_address
        if self.config.pd.enabled and prefill is not None and decision.disaggregated:
            # llm-d's routing sidecar on the decode engine runs prefill on the host:port named
            # in this header (llm-d/llm-d-routing-sidecar, README).
            headers[self.config.pd.header] = prefill
        url = self._urls.get((endpoint, route))
        if url is None:  # discovery removed the engine after it was picked
            raise _UpstreamFailed("removed")
        # aiohttp writes a large bytes body in one call, which can hold the loop (and warns):
        # as a file-like object it goes out in pieces.
        data: bytes | io.BytesIO = io.BytesIO(body) if len(body) > _LARGE_UPSTREAM_BODY else body
        try:
            upstream = await self._session.post(
                url, data=data, headers=headers, timeout=self.upstream_timeout(deadline)
            )
        except _CONNECT_TIMEOUTS:
            raise _UpstreamFailed("timeout") from None
        except asyncio.TimeoutError as error:
            raise _NoAnswer(by_deadline=_deadline_ended(error)) from None
        except aiohttp.ClientConnectorError:
            raise _UpstreamFailed("connect") from None
        except aiohttp.ClientError:  # connected, then closed before any status line
            raise _UpstreamFailed("broken") from None
        # The attempt's outcome for the health model (a relayed 5xx still counts as failed).
        outcome: str | None = None
        try:
            if upstream.status < 200 or _coded_transfer(upstream):
                # A final 1xx (101 Switching Protocols to a plain POST), or a body in a transfer
                # coding besides chunked (gzip: only the chunking is removed): no answer a
                # client could use, as the native plane reads it.
                raise _UpstreamFailed("broken")
            if upstream.status >= 500:
                if self.config.retries.on_5xx:
                    raise _UpstreamFailed("status_5xx")
                outcome = "status_5xx"
                self.metrics.upstream_errors.labels(endpoint, outcome).inc()
            else:
                # The successful attempt, counted once its status line came (never re-sent
                # from here), as the native plane counts it: whatever becomes of its body
                # (cut, or left by its client).
                self.metrics.routed.labels(endpoint).inc()
            self._settle_held(held, unanswered=False)
            content_type = upstream.headers.get("Content-Type", "")
            sse = "event-stream" in content_type
            length = upstream.content_length
            # Ended by the engine closing the connection, a cut answer looks complete: a JSON
            # one is read whole and checked, an event stream must show its [DONE].
            at_close = _ends_at_close(upstream)
            small = length is not None and length <= _WHOLE_BODY_LIMIT
            # An event stream framed by a length is read whole and checked for its end before
            # anything is sent: once its length is passed on, a missing [DONE] cannot be told.
            framed_events = (
                sse
                and upstream.status < 300
                and small
                and "Transfer-Encoding" not in upstream.headers
            )
            if framed_events or (not sse and (at_close or small)):
                return await self._answer_whole(
                    request,
                    route,
                    upstream,
                    decision,
                    endpoint,
                    deadline,
                    outcome,
                    at_close,
                    events=framed_events,
                    stored=stored,
                )
            # An event stream is whole only with its [DONE] (vLLM and SGLang end every stream
            # so, an error event included): one ended by the connection's close, or cleanly
            # without it, is cut.
            responses = route == "responses"
            done: _DoneScan | TerminalEventScan | None = None
            if (sse and upstream.status < 300) or at_close:
                # A Responses stream ends with its terminal event, no [DONE] after it.
                done = TerminalEventScan() if responses else _DoneScan()
            try:
                first = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                if _deadline_ended(error):
                    raise _DeadlinePassed from None
                self._cut_failure(endpoint, deadline)
                raise _Truncated("the engine's answer was cut off before its first byte") from None
            decision.first_token()
            response = self._mark_session(
                _passed_on(upstream, web.StreamResponse(status=upstream.status)), endpoint
            )
            counter = _OutputCounter(content_type, responses=responses)
            feeds: list[_Feed] = [counter]
            if done is not None:
                feeds.append(done)
            if stored and sse and upstream.status < 300:
                # Known from the first event on: the stream's own client may ask for it (or
                # cancel it) before it ends.
                feeds.append(_OwnerRecorder(self.response_owners, endpoint))
            try:
                await response.prepare(request)
                relayed = await _relay_chunks(upstream, response, first, *feeds)
                if relayed.cut or (done is not None and not done.seen):
                    # Mid-answer failure (or an event stream ended by the connection's close
                    # without its [DONE]): the client already has bytes and must not take
                    # what it got for a whole answer. The request's own deadline is no
                    # failure of the engine's, and the client is told which it was.
                    timed_out = time.monotonic() >= deadline
                    self._count_cut(endpoint, timed_out=timed_out)
                    self._cut_failure(endpoint, deadline)
                    await self.abort_response(
                        request,
                        response,
                        endpoint,
                        sse=sse,
                        mid_event=relayed.mid_event,
                        responses=responses,
                        timed_out=timed_out,
                    )
                    self.metrics.requests.labels(route, "aborted").inc()
                    return response, counter.tokens()
                await response.write_eof()
            except ConnectionError:  # the client went away; the finally closes upstream
                self.metrics.requests.labels(route, "client_gone").inc()
                return response, counter.tokens()
            self.health.record(endpoint, outcome)
            self.metrics.requests.labels(route, str(upstream.status)).inc()
            return response, counter.tokens()
        finally:
            # A response not read to its end (failure, client gone) closes its connection.
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    def _count_cut(self, endpoint: str, *, timed_out: bool) -> None:
        """Counts an answer that broke off after its status line: against the engine
        (``upstream_errors{kind="truncated"}``), or, when the request's deadline
        (``timeouts.total_s``) ended it, as the request's ``timeout`` rejection."""
        if timed_out:
            self.metrics.rejections.labels("timeout").inc()
        else:
            self.metrics.upstream_errors.labels(endpoint, "truncated").inc()

    async def abort_response(
        self,
        request: web.Request,
        response: web.StreamResponse,
        endpoint: str,
        *,
        sse: bool,
        mid_event: bool = False,
        responses: bool = False,
        timed_out: bool = False,
        refusal: Refusal | None = None,
    ) -> None:
        """Ends a client response whose upstream answer broke off, so that no client takes it
        for complete: an SSE stream gets an error event and is closed without its final chunk
        (no ``[DONE]``); any other body is reset (RST), as Envoy and nginx do. Counted.
        ``mid_event``: the stream broke off inside an event, so a blank line goes first and
        the error event parses on its own. ``responses``: the stream is the Responses API's,
        whose events are named (an ``error`` event). ``timed_out``: the request's own deadline
        (``timeouts.total_s``) ended it, not the engine: the event says so (type ``timeout``,
        code 504, the 504 a request gets when its deadline passes before its answer's head).
        ``refusal``: the gateway itself ended it (a sliced request whose continuation's
        decision failed): the event is what a request not yet answered is told (type, message
        and code of the refusal). Package-internal."""
        protocol = request.protocol
        if sse:
            if refusal is not None:
                message, kind, code = self._redacted(refusal.message), refusal.kind, refusal.status
            elif timed_out:
                message, kind, code = _DEADLINE_MESSAGE, "timeout", 504
            else:
                message, kind, code = "the engine's answer was cut off", "upstream_error", 502
            if responses:
                error = {"type": "error", "code": kind, "message": message}
                event = b"event: error\ndata: " + json.dumps({**error, "param": None}).encode()
            else:
                detail = {"message": message, "type": kind, "param": None}
                event = b"data: " + json.dumps({"error": {**detail, "code": code}}).encode()
            gap = b"\n\n" if mid_event else b""
            with contextlib.suppress(ConnectionError):
                await response.write(gap + event + b"\n\n")
            self.metrics.truncated.labels(endpoint, "sse_error").inc()
        else:
            if request.transport is not None:
                _linger_zero(request.transport)
            self.metrics.truncated.labels(endpoint, "reset").inc()
        # Closing the connection without the terminating chunk: the client's parser sees a
        # body that ended early (with SO_LINGER 0 the close is a reset).
        protocol.force_close()

    async def _answer_whole(
        self,
        request: web.Request,
        route: str,
        upstream: aiohttp.ClientResponse,
        decision: Decision,
        endpoint: str,
        deadline: float,
        outcome: str | None,
        at_close: bool = False,
        *,
        events: bool = False,
        stored: bool = False,
    ) -> tuple[web.StreamResponse, int]:
        """A complete (non-streamed) answer of known length: read it whole, then send it in
        one response (fewer writes than relaying chunks; ``stored``: as in :meth:`_proxy`). A
        failure while reading comes after the status line: a 502, never a retry.
        ``at_close``: the answer ends where the engine closes the connection, so a cut looks
        like its end: it is read up to
        :data:`_WHOLE_BODY_LIMIT` and, when JSON, must parse, or it is a 502 too. ``events``:
        an event stream framed by its length, which must show its end (``[DONE]``, or a
        Responses stream's terminal event), or it is a 502."""
        try:
            data = await (
                _read_at_most(upstream, _WHOLE_BODY_LIMIT) if at_close else upstream.read()
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            if _deadline_ended(error):
                raise _DeadlinePassed from None
            self._cut_failure(endpoint, deadline)
            raise _Truncated("the engine's answer was cut off") from None
        if at_close and (data is None or (_is_json(upstream) and not _parses(data))):
            self._cut_failure(endpoint, deadline)
            raise _Truncated(
                "the engine's answer was cut off (or, ended by closing the connection, is not "
                "whole JSON of at most 8 MiB)"
            )
        assert data is not None
        if events and not _shows_its_end(data, responses=route == "responses"):
            self._cut_failure(endpoint, deadline)
            raise _Truncated("the engine's event stream ended without its end event ([DONE])")
        decision.first_token()
        response = self._mark_session(
            _passed_on(upstream, web.Response(body=data, status=upstream.status)), endpoint
        )
        counter = _OutputCounter(
            response.headers.get("Content-Type", ""), responses=route == "responses"
        )
        counter.feed(data)
        if stored and 200 <= upstream.status < 300:
            response_id = _stream_response_id(data) if events else response_id_of(data)
            if response_id is not None:
                self.response_owners.record(response_id, endpoint)
        self.health.record(endpoint, outcome)
        self.metrics.requests.labels(route, str(upstream.status)).inc()
        return response, counter.tokens()

    def refuse(self, route: str, refusal: Refusal) -> web.Response:
        """The gateway's own answer to a request (OpenAI error shape), counted. A configured
        API key never appears in it. Package-internal."""
        reason = refusal.headers.get(DROPPED_REASON_HEADER, refusal.kind)
        self.metrics.rejections.labels(reason).inc()
        self.metrics.requests.labels(route, str(refusal.status)).inc()
        return _error_response(refusal, self._redacted(refusal.message))

    async def _refuse_unread(
        self, request: web.Request, route: str, refusal: Refusal
    ) -> web.StreamResponse:
        """:meth:`refuse`; for a refusal that leaves the body unread (``drain``), the answer
        goes out first, then what the client still sends of its body is read and dropped (at
        most ``max_body_bytes`` and :data:`_REFUSED_DRAIN_BYTES`, while it keeps coming: each
        read within :data:`_REFUSED_BODY_GAP_S`, all within ``limits.body_timeout_s``), as the
        native plane does: closing over unread bytes would reset the connection, and a client
        still sending would lose its answer."""
        response = self.refuse(route, refusal)
        if not refusal.drain:
            return response
        left = self.config.limits.max_body_bytes + _REFUSED_DRAIN_BYTES

        async def drain() -> None:
            nonlocal left
            await response.prepare(request)
            await response.write_eof()
            while left > 0 and (
                chunk := await asyncio.wait_for(request.content.readany(), _REFUSED_BODY_GAP_S)
            ):
                left -= len(chunk)

        with contextlib.suppress(
            asyncio.TimeoutError, ConnectionError, HttpProcessingError, aiohttp.ClientError
        ):
            await asyncio.wait_for(drain(), self.config.limits.body_timeout_s)
        return response

    def _redacted(self, message: str) -> str:
        for key in self.config.auth.api_keys:
            if key in message:
                message = message.replace(key, "<redacted>")
        return message

    def upstream_session(self) -> aiohttp.ClientSession:
        """The upstream HTTP client (the gateway must be started). Package-internal."""
        if self._session is None:
            raise RuntimeError("the gateway is not started")
        return self._session

    def upstream_url(self, endpoint: str, route: str) -> URL | None:
        """The URL of ``route`` on a configured engine; None when the engine is not (or no
        longer) configured. Package-internal."""
        return self._urls.get((endpoint, route))


class _ParserErrors(logging.Filter):
    """Drops aiohttp's ERROR traceback for each request its parser refuses (a bad method,
    URL or over-long line: the client already got its 400), log noise any client could make
    at will; one DEBUG line is left."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            log.debug("refused a request the HTTP parser could not read: %s", type(error).__name__)
            return False
        return True


_QUIET_PARSER_ERRORS = _ParserErrors()


class _OutputCounter:
    """Output tokens of an answer, for flow control's fairness accounting: the usage block of
    a JSON answer, else one token per streamed event (what vLLM sends by default; of a
    Responses stream, its ``*.delta`` events)."""

    __slots__ = ("_body", "_events", "_json", "_responses")

    def __init__(self, content_type: str, *, responses: bool = False) -> None:
        self._json = content_type.startswith("application/json")
        self._responses = responses
        self._body = bytearray()
        self._events = 0

    def feed(self, chunk: bytes) -> None:
        if self._json:
            if len(self._body) + len(chunk) <= _USAGE_PARSE_LIMIT:
                self._body += chunk
        elif self._responses:
            self._events += output_deltas(chunk)
        else:
            self._events += chunk.count(b"data: {")

    def tokens(self) -> int:
        if not self._json:
            return self._events
        try:
            usage = json.loads(self._body).get("usage") or {}
            value = usage.get("output_tokens" if self._responses else "completion_tokens", 0)
        except (ValueError, AttributeError):
            return 0
        # A count no answer can hold is the engine's error: charged as none, as a negative one
        # is, rather than a number flow control and the key's bucket cannot take.
        return value if type(value) is int and 0 <= value <= _MAX_USAGE_TOKENS else 0


class _Feed(Protocol):
    """What reads a relayed answer's chunks as they pass (a counter, a scan)."""

    def feed(self, chunk: bytes) -> None: ...


class _OwnerRecorder:
    """Records a Responses stream's id as owned by ``endpoint`` once its first event shows it."""

    __slots__ = ("_endpoint", "_owners", "_scan")

    def __init__(self, owners: ResponseOwners, endpoint: str) -> None:
        self._owners = owners
        self._endpoint = endpoint
        self._scan: ResponseIdScan | None = ResponseIdScan()

    def feed(self, chunk: bytes) -> None:
        if self._scan is None:
            return
        self._scan.feed(chunk)
        if self._scan.id is not None:
            self._owners.record(self._scan.id, self._endpoint)
            self._scan = None


class _Relayed(NamedTuple):
    """How a relay of an answer's chunks ended."""

    cut: bool
    """The engine's side failed (or timed out) before the answer's end."""
    mid_event: bool
    """The last bytes relayed do not end an event: an error event written after them needs a
    blank line first."""


async def _relay_chunks(
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    first: bytes | None,
    *feeds: _Feed,
) -> _Relayed:
    """Writes the engine's answer to the prepared client ``response`` chunk by chunk as it
    comes (``first``: a chunk already read, or None), each chunk fed to ``feeds`` before it
    is written. A client gone raises ConnectionError from the write."""
    tail = b"\n\n"  # the last two bytes relayed ("\n\n" ends an event)
    chunk = first
    while True:
        if chunk is None:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return _Relayed(cut=True, mid_event=tail != b"\n\n")
        if not chunk:
            return _Relayed(cut=False, mid_event=tail != b"\n\n")
        for reader in feeds:
            reader.feed(chunk)
        tail = (tail + chunk[-2:])[-2:]
        await response.write(chunk)
        chunk = None


async def _close_after_unframed(request: web.Request, response: web.StreamResponse) -> None:
    """Closes the connection after an answer sent without a length to an HTTP/1.0 client (a
    stream): HTTP/1.0 has no chunked coding, so such an answer ends where its connection
    closes. aiohttp would keep the connection of a keep-alive client open, and that client
    would wait for the end of the answer until the idle timeout."""
    if (
        request.version < aiohttp.HttpVersion11
        and response.content_length is None
        and not response.chunked
    ):
        response.force_close()


_Answer = TypeVar("_Answer", bound=web.StreamResponse)


def _passed_on(upstream: aiohttp.ClientResponse, response: _Answer) -> _Answer:
    """``response`` with the engine's end-to-end headers that a client needs copied onto it
    (framing and hop-by-hop headers are aiohttp's job), and, for a relayed body, its length
    when the engine gave one."""
    for name in _PASSED_RESPONSE_HEADERS:
        if (value := upstream.headers.get(name)) is not None:
            response.headers[name] = value
    if not isinstance(response, web.Response) and upstream.content_length is not None:
        response.content_length = upstream.content_length
    return response


def _ends_at_close(upstream: aiohttp.ClientResponse) -> bool:
    """Whether an engine's answer ends where its connection closes (RFC 9112 6.3: no
    Content-Length, and no Transfer-Encoding ending in ``chunked``)."""
    if upstream.status < 200 or upstream.status in (204, 304):
        return False
    codings = [
        c.strip()
        for value in upstream.headers.getall("Transfer-Encoding", ())
        for c in value.split(",")
        if c.strip()
    ]
    if codings:
        return codings[-1].lower() != "chunked"
    return "Content-Length" not in upstream.headers


def _coded_transfer(upstream: aiohttp.ClientResponse) -> bool:
    """Whether the answer's ``Transfer-Encoding`` names a coding besides ``chunked``."""
    codings = ",".join(upstream.headers.getall("Transfer-Encoding", [])).split(",")
    return any(c.strip() and c.strip().lower() != "chunked" for c in codings)


def _is_json(upstream: aiohttp.ClientResponse) -> bool:
    essence = upstream.headers.get("Content-Type", "").split(";")[0].strip().lower()
    return essence == "application/json" or essence.endswith("+json")


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


async def _read_at_most(upstream: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None when it is longer than ``limit``."""
    data = bytearray()
    while chunk := await upstream.content.readany():
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


class _DoneScan:
    """Whether an event stream has shown its ``[DONE]`` event: a line that is the ``data``
    field ``[DONE]`` (``data: [DONE]``, or ``data:[DONE]``: the space is optional in SSE),
    with any of the line ends SSE allows, split between chunks anywhere. The same bytes inside
    a token's text (a JSON string on a ``data: {`` line) or a comment line are not it.

    >>> scan = _DoneScan()
    >>> scan.feed(b'data: {"text": "data: [DONE]"}\\n\\n: data: [DONE]\\n\\n')
    >>> scan.seen
    False
    >>> scan.feed(b"data:[DO")
    >>> scan.feed(b"NE]\\r\\n\\r\\n")
    >>> scan.seen
    True
    """

    # Each starts a line: the stream's start is one (the tail begins as a newline).
    _EVENTS = (b"\ndata: [DONE]", b"\ndata:[DONE]")
    _KEEP = len(_EVENTS[0]) - 1

    def __init__(self) -> None:
        self.seen = False
        self._tail = b"\n"
        self._line_ends = LineEnds()

    def feed(self, chunk: bytes) -> None:
        if self.seen:
            return
        joined = self._tail + self._line_ends.to_lf(chunk)
        if any(event in joined for event in self._EVENTS):
            self.seen = True
            return
        self._tail = joined[-self._KEEP :]


def _stream_response_id(stream: bytes) -> str | None:
    """The response id a whole Responses event stream announces in its first event."""
    scan = ResponseIdScan()
    scan.feed(stream)
    return scan.id


def _shows_its_end(stream: bytes, *, responses: bool) -> bool:
    """Whether a whole event stream shows its end: its ``[DONE]`` event, or a Responses
    stream's terminal event."""
    scan = TerminalEventScan() if responses else _DoneScan()
    scan.feed(stream)
    return scan.seen


def _answering(scrape: Mapping[str, Any] | None) -> bool:
    """Not known to fail: never scraped yet, or its last scrape that got an answer (or a
    refusal) succeeded. A timed-out scrape is what a stall looks like (the engine's core or
    ours taken for a while) and changes nothing: the requests wait, as through a plain proxy,
    and the engine's own failed attempts and probes take it down if it is gone."""
    return scrape is None or not scrape.get("failing")


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return request.headers.get("x-api-key")


def _wide_encoding(body: bytes) -> str | None:
    """``"UTF-16"`` or ``"UTF-32"`` when ``body`` is JSON in one of those, as
    ``json.detect_encoding`` reads it: such a body is refused by name rather than transcoded, as
    on the native plane (bodies are forwarded as sent).

    >>> _wide_encoding('{"a": 1}'.encode("utf-16")), _wide_encoding('{}'.encode("utf-32-be"))
    ('UTF-16', 'UTF-32')
    >>> _wide_encoding(b'{"a": 1}') is None
    True
    """
    encoding = json.detect_encoding(body)
    return encoding[:6].upper() if encoding.startswith(("utf-16", "utf-32")) else None


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        # UTF-8 only, as on the native plane: ``json.loads`` of bytes also reads UTF-16 and
        # UTF-32, and reads a surrogate's UTF-8 form (not UTF-8) as a lone surrogate, which
        # the escape check below never saw (a 500 where such a string was encoded). (A UTF-8
        # byte order mark was dropped as the body was read.)
        text = body.decode("utf-8")
        # NaN and Infinity are not JSON (the native plane and the engines refuse them).
        payload = json.loads(text, parse_constant=refuse_json_constant)
    except RecursionError:
        raise Refusal(400, "invalid_request_error", "the body is nested too deeply") from None
    except ValueError:
        encoding = _wide_encoding(body)
        message = (
            "the body is not valid JSON"
            if encoding is None
            else f"the body is not valid JSON: it is encoded as {encoding} (send UTF-8)"
        )
        raise Refusal(400, "invalid_request_error", message) from None
    if not isinstance(payload, dict):
        raise Refusal(400, "invalid_request_error", "the body must be a JSON object")
    return payload


def _error_response(refusal: Refusal, message: str | None = None) -> web.Response:
    """The OpenAI-shaped answer to ``refusal`` (``message``: its text, when not the
    refusal's own)."""
    body = {
        "error": {
            "message": refusal.message if message is None else message,
            "type": refusal.kind,
            "param": refusal.param,
            "code": refusal.status,
        }
    }
    response = web.json_response(body, status=refusal.status, headers=refusal.headers)
    if refusal.close:
        response.force_close()
    return response


def _response_not_found(response_id: str, param: str) -> Refusal:
    """vLLM's answer for a response id no engine holds, naming the field that gave it."""
    return Refusal(
        404, "invalid_request_error", f"Response with id '{response_id}' not found.", param=param
    )


def _routing_refusal(path: str, error: web.HTTPException) -> Refusal:
    """The native plane's answer to a path nothing serves (404) or a method its path does not
    take (405, with ``Allow``; an admin path answers 404 either way, as there)."""
    if isinstance(error, web.HTTPMethodNotAllowed) and not path.startswith("/admin/"):
        # HEAD goes with GET (RFC 9110), so the native plane names GET alone.
        allowed = ", ".join(sorted(error.allowed_methods - {"HEAD"}))
        return Refusal(
            405, "method_not_allowed", f"this path takes {allowed} only", {"Allow": allowed}
        )
    return Refusal(404, "not_found", "not found")


def _encoding_refusal(request: web.Request) -> Refusal | None:
    """A 415 for a body sent with a Content-Encoding other than identity: bodies are taken
    as sent, never decoded (as vLLM takes them), so a compressed one is refused, naming the
    encoding, before a byte of it is read. A 501 for a Transfer-Encoding naming a coding
    besides chunked (``gzip, chunked``): only the chunking is removed, so the body would be
    read still coded (RFC 9112 6.1)."""
    codings = request.headers.getall("Transfer-Encoding", ())
    if any(c.strip().lower() not in ("", "chunked") for v in codings for c in v.split(",")):
        return Refusal(
            501,
            "invalid_request_error",
            f"Transfer-Encoding '{', '.join(codings)}' is not supported: send the body chunked "
            "or with a Content-Length",
            close=True,
        )
    for value in request.headers.getall("Content-Encoding", ()):
        if value.strip().lower() != "identity":
            return Refusal(
                415,
                "invalid_request_error",
                f"Content-Encoding '{value}' is not supported: send the body uncompressed",
                close=True,
            )
    return None


def _embeds_only(embeds: object) -> bool:
    """Whether ``prompt_embeds`` (vLLM's ``--enable-prompt-embeds``: base64 tensors, one or a
    list) stands in for an absent ``prompt``."""
    if isinstance(embeds, str):
        return bool(embeds)
    return isinstance(embeds, list) and bool(embeds) and all(isinstance(e, str) for e in embeds)


def _check_messages(messages: Sequence[Any]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts")


def _flow_refusal(rejected: FlowRejected, retry_after_s: int) -> Refusal:
    return Refusal(
        rejected.http_status,
        "rate_limit_exceeded" if rejected.http_status == 429 else "service_unavailable",
        f"request not admitted: {rejected.reason}",
        {DROPPED_REASON_HEADER: rejected.reason, "Retry-After": str(retry_after_s)},
    )


def _upstream_urls(specs: Mapping[str, EngineSpec]) -> dict[tuple[str, str], URL]:
    """Upstream URLs, parsed once, from the configured engines only."""
    return {
        (worker, route): URL(spec.base_url + path)
        for worker, spec in specs.items()
        for route, path in _ROUTES.items()
    }


def _limit_refusal(reason: str, wait_s: float) -> Refusal:
    what = "requests in progress" if reason == "concurrency-limited" else "rate"
    return Refusal(
        429,
        "rate_limit_exceeded",
        f"this key's {what} limit is reached",
        {DROPPED_REASON_HEADER: reason, "Retry-After": retry_after(wait_s)},
    )


# How many distinct routing failures Gateway._routing_failed logs.
_LOGGED_ROUTING_FAILURES = 64


def _describe_error(error: BaseException) -> str:
    """``"ValueError: text"``: an exception's class and text, as a traceback's last line
    shows them (an exception whose ``str()`` raises, too).

    >>> _describe_error(ValueError("bad"))
    'ValueError: bad'
    >>> _describe_error(KeyboardInterrupt())
    'KeyboardInterrupt'
    """
    try:
        text = str(error)
    except BaseException:
        text = "<str() failed>"
    name = type(error).__qualname__
    return f"{name}: {text}" if text else name


# What a request whose deadline (timeouts.total_s) passed is told.
_DEADLINE_MESSAGE = "the request's deadline (timeouts.total_s) passed"


def _deadline_refusal() -> Refusal:
    return Refusal(504, "timeout", _DEADLINE_MESSAGE)


def _header(request: web.Request, name: str) -> str | None:
    """A request header's value; 400 naming the header when its bytes are not UTF-8 (aiohttp
    hands such bytes over as surrogate escapes, which nothing downstream can encode)."""
    value = request.headers.get(name)
    if value is not None and not is_utf8_text(value):
        raise Refusal(400, "invalid_request_error", f"header {name} is not valid UTF-8", param=name)
    return value


def _check_structure(value: Any, path: str, depth: int, *, text: bool) -> None:
    """400 when the body nests deeper than :data:`_MAX_DEPTH` or (``text``) a string, key or
    value, holds a lone surrogate (``"\\ud800"`` is valid JSON but no UTF-8 text); the error
    names the first such field."""
    if isinstance(value, str):
        if text and not is_utf8_text(value):
            raise Refusal(
                400,
                "invalid_request_error",
                f"'{path or 'body'}' holds a lone surrogate escape (not valid UTF-8 text)",
                param=path or None,
            )
        return
    if not isinstance(value, (dict, list)):
        return
    if depth >= _MAX_DEPTH:
        raise Refusal(
            400,
            "invalid_request_error",
            f"'{path or 'body'}' is nested deeper than {_MAX_DEPTH} levels",
            param=path or None,
        )
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if text and not is_utf8_text(key):
                raise Refusal(
                    400,
                    "invalid_request_error",
                    f"a key in '{path or 'body'}' holds a lone surrogate escape",
                    param=path or None,
                )
            if isinstance(item, (str, dict, list)):
                _check_structure(item, where, depth + 1, text=text)
    else:
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                _check_structure(item, f"{path}[{i}]", depth + 1, text=text)


def _check_fields(payload: Mapping[str, Any]) -> None:
    """The sampling fields the gateway reads itself (slicing, streaming, cache salt) have the
    types the OpenAI API gives them; 400 naming the field otherwise."""

    def bad(field: str, what: str) -> Refusal:
        return Refusal(400, "invalid_request_error", f"'{field}' must be {what}", param=field)

    for field in _TOKEN_LIMIT_FIELDS:
        value = payload.get(field)
        if value is not None and (type(value) is not int or not 1 <= value <= _MAX_TOKEN_LIMIT):
            raise bad(field, f"an integer in 1..{_MAX_TOKEN_LIMIT} or null")
    stop = payload.get("stop")
    if not (
        stop is None
        or isinstance(stop, str)
        or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise bad("stop", "a string, a list of strings or null")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "true, false or null")
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "an object or null")
    salt = payload.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        # vLLM refuses an empty salt.
        raise bad("cache_salt", "a non-empty string or null")


class _SendGuard:
    """Bounds the writing of answers to clients that do not read them (aiohttp has no write
    timeout): an answer whose bytes wait in a connection's write buffer without any leaving
    for ``stall_s`` (``limits.idle_timeout_s``), or still wait when the request's deadline
    (``timeouts.total_s``) passes, has its connection reset. Before, a client that stopped
    reading held a JSON answer of up to 8 MiB (and its connection) for as long as it kept the
    connection open.

    Nothing runs per write: :meth:`run` looks at every open connection's write buffer a few
    times per ``stall_s`` (at most once a second). Progress is a buffer that shrank (or
    emptied) since the last look; one that only grew (more of a stream queued behind the
    stalled bytes) made none. Cuts are counted in ``rejections_total{reason}`` (``send_timeout``,
    ``timeout``) and logged once per reason.
    """

    def __init__(self, server: web.Server, stall_s: float, metrics: GatewayMetrics) -> None:
        self.server = server
        self.stall_s = stall_s
        self.metrics = metrics
        self.tick_s = min(max(stall_s / 4, 0.05), 1.0)
        # Connection -> the deadline of the request it answers (monotonic seconds).
        self._deadlines: dict[web.RequestHandler, float] = {}
        # Connection -> [buffered bytes at the last look, when it last shrank, when it was
        # first seen holding bytes]; only for connections with bytes waiting.
        self._waiting: dict[web.RequestHandler, list[float]] = {}
        self._logged: set[str] = set()

    def request_arrived(self, connection: web.RequestHandler, deadline: float | None) -> None:
        """A request arrived on ``connection``: its answer must be written by ``deadline``
        (None: no limit)."""
        if deadline is None:
            self._deadlines.pop(connection, None)
        else:
            self._deadlines[connection] = deadline

    async def run(self) -> None:
        """Looks at the connections every :attr:`tick_s` until cancelled."""
        while True:
            await asyncio.sleep(self.tick_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One look at every connection: resets those stalled past a bound."""
        connections = self.server.connections
        waiting: dict[web.RequestHandler, list[float]] = {}
        for connection in connections:
            transport = connection.transport
            if transport is None:
                continue
            size = transport.get_write_buffer_size()
            if size == 0:
                continue
            seen = self._waiting.get(connection)
            if seen is None:
                seen = [size, now, now]
            elif size < seen[0]:
                seen[0], seen[1] = size, now
            else:
                seen[0] = size
            deadline = self._deadlines.get(connection)
            if now - seen[1] >= self.stall_s:
                self._cut(connection, transport, "send_timeout")
            elif deadline is not None and now >= deadline and seen[2] < now:
                # Past the deadline with bytes still waiting since an earlier look (not a
                # buffer the kernel is about to take).
                self._cut(connection, transport, "timeout")
            else:
                waiting[connection] = seen
        self._waiting = waiting
        if len(self._deadlines) > len(connections):
            alive = set(connections)
            self._deadlines = {c: d for c, d in self._deadlines.items() if c in alive}

    def _cut(
        self, connection: web.RequestHandler, transport: asyncio.Transport, reason: str
    ) -> None:
        self.metrics.rejections.labels(reason).inc()
        self._deadlines.pop(connection, None)
        if reason not in self._logged:
            self._logged.add(reason)
            what = (
                f"read nothing of its answer for limits.idle_timeout_s ({self.stall_s:g} s)"
                if reason == "send_timeout"
                else "had not read its answer when its deadline (timeouts.total_s) passed"
            )
            log.warning(
                "a client %s: its connection was reset (logged once; each one is counted in "
                'llmsched_gateway_rejections_total{reason="%s"})',
                what,
                reason,
            )
        _reset(transport)


def _linger_zero(transport: asyncio.BaseTransport) -> None:
    """Makes the client connection's close a reset (SO_LINGER 0): what its buffers still hold
    for the client is dropped (a plain close waits to deliver it first)."""
    # uvloop's pseudo-socket of a transport closed already raises ValueError.
    with contextlib.suppress(OSError, ValueError):
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _reset(transport: asyncio.Transport) -> None:
    """Closes a client connection now, with a reset (:func:`_linger_zero`)."""
    _linger_zero(transport)
    transport.abort()


class _Refuser(asyncio.Protocol):
    """A connection over ``limits.max_connections``: one 503, then closed. What the client
    sends meanwhile is read and dropped (at most :data:`_REFUSED_DRAIN_BYTES`, for at most
    :data:`_REFUSED_DRAIN_S`): closing over a request left unread would reset the connection,
    and the client would lose the 503 (as the native plane does)."""

    def __init__(self) -> None:
        self._transport: Any = None
        self._left = _REFUSED_DRAIN_BYTES
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.WriteTransport subclass: no isinstance check.
        self._transport = transport
        transport.write(_TOO_MANY_CONNECTIONS)  # type: ignore[attr-defined]
        # The 503 then the end of the answer; the client may have gone already.
        with contextlib.suppress(OSError):
            if transport.can_write_eof():  # type: ignore[attr-defined]
                transport.write_eof()  # type: ignore[attr-defined]
        self._timer = asyncio.get_running_loop().call_later(_REFUSED_DRAIN_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left <= 0 and self._transport is not None:
            self._transport.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None


_REFUSED_DRAIN_S = 0.5
"""How long a refused connection's request is read and dropped at most before it is closed."""
_REFUSED_DRAIN_BYTES = 1 << 20
"""How much of a refused connection's request is read and dropped at most."""
_REFUSED_BODY_GAP_S = 1.0
"""How long a refused request's body may pause between reads before its connection is closed
(it is read for at most ``limits.body_timeout_s`` in all, as long as any body may take):
bounded by pauses rather than by a short total, as a client still sending 16 MiB at a few MB/s
would otherwise be reset."""


_TOO_MANY_BODY = json.dumps(
    {
        "error": {
            "message": "too many connections",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
    }
).encode()
_TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nRetry-After: 1\r\n"
    + f"Content-Length: {len(_TOO_MANY_BODY)}\r\n\r\n".encode()
    + _TOO_MANY_BODY
)


# aiohttp decodes gzip, deflate (and br with Brotli) request bodies itself unless told not to
# (the server side takes the flag since aiohttp 3.9; older ones decode until the 415 check).
_NO_DECOMPRESSION: dict[str, Any] = (
    {"auto_decompress": False}
    if "auto_decompress" in inspect.signature(web.RequestHandler.__init__).parameters
    else {}
)


class _BodyCut(Exception):
    """A request's body ended early: its client half-closed the connection mid-body."""


class _HalfClosable(asyncio.Protocol):
    """aiohttp's handler of one client connection (``handler``, which gets every event),
    save for a client that half-closes the connection (shuts down its write side) while its
    request's body is read (``reading``: the body each connection sends now, by transport):
    that body fails (:class:`_BodyCut`) and the transport stays open for the 400 that names
    it, as the native plane answers it. aiohttp lets the transport close at any end of input
    (which loses the answer): any other half-close still closes it, as the native plane does
    too (a client's close is how it leaves)."""

    __slots__ = ("_handler", "_reading", "_transport")

    def __init__(self, handler: web.RequestHandler, reading: Mapping[object, Any]) -> None:
        self._handler = handler
        self._reading = reading
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> bool:
        if not self._cut_body():
            # The request's handler may not have begun to read its body: it was woken when
            # the request came, so it runs before this looks again.
            asyncio.get_running_loop().call_soon(self._settle)
        return True  # open for the answer (closed after it), or until _settle

    def _cut_body(self) -> bool:
        """Fails the body being read on this connection, if one is and has not ended."""
        body = self._reading.get(self._transport)
        if body is None or body.is_eof():
            return False
        body.set_exception(_BodyCut())
        return True

    def _settle(self) -> None:
        transport = self._transport
        if transport is None or self._cut_body():
            return
        # No body cut short: the end of input closes the connection, as aiohttp has it.
        self._handler.eof_received()
        transport.close()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._handler.connection_lost(exc)


def _capped(
    server: web.Server, cap: int, metrics: GatewayMetrics, reading: Mapping[object, Any]
) -> Callable[[], asyncio.Protocol]:
    """The listener's protocol factory: aiohttp's handler (:class:`_HalfClosable`, with
    ``reading``) while fewer than ``cap`` client connections are open, else a
    :class:`_Refuser` (a 503, then closed)."""
    metrics.connections.set_function(lambda: len(server.connections))

    def accept() -> asyncio.Protocol:
        if len(server.connections) >= cap:
            metrics.connections_refused.inc()
            return _Refuser()
        return _HalfClosable(server(), reading)

    return accept
