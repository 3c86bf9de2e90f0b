"""The native data plane of ``llmsched serve`` (``data_plane: native``).

Python reads and checks the YAML config (:func:`~llmsched.gateway.config.load_config`, the one
loader), builds the pool, prefix index and router (a :class:`~llmsched.Scheduler`, whose
KV-event subscriber keeps feeding the index), watches the discovery file (or the pods of
``discovery.kubernetes``, :mod:`llmsched.gateway.pod_discovery`), and then starts the
Rust gateway (``llmsched-gateway``) in-process on its own runtime thread, handing it the router
itself: both sides share one pool, one index and one set of in-flight counts. Every request
is served in Rust (auth, limits, flow control, routing, proxying, metrics), and the engines'
KV events are read and applied in Rust
(:class:`~llmsched.integrations.NativeKVEventSubscriber`, no Python per batch); Python runs
only for configuration, discovery and, when the router config names a Python scorer or
filter, that one call (the GIL is taken for it alone).

With a ``tokenizer`` the native plane computes the engine's token ids itself (the Rust
``tokenizers`` crate and a Jinja engine for the chat template, the ids
:class:`~llmsched.tokenize.PromptTokenizer` computes); a chat template that engine cannot
render raises ConfigError at start. Chat prompts' pieces (the text between the tokenizer's
added tokens: a system message repeated on every turn) are cached with their ids
(``tokenizer_cache_bytes``) where the tokenizer's piecewise encoding is proved exact at start;
where it is not, the cache is off with one warning and the reason in
:meth:`NativeGateway.tokenizer_cache_stats` and ``/metrics``. Token slices (``slices``) run
natively too: each slice is routed, admitted again after a yield and stitched by the Rust cores
the Python plane uses (the slice tracker and :class:`~llmsched.SliceAssembler`'s assembler).
The admin API (``admin``) is served natively; adding and removing engines run the Python
plane's code on the event loop (admin calls are rare; no request waits for them). Replica sync
(``cluster``) journals the router's commits natively and carries them over NATS from Python
(:class:`~llmsched.cluster.ClusterSync`, once per ``flush_s``, never per request), with the
rate-limit and fairness usage counted natively.

>>> import asyncio
>>> async def main() -> int:
...     gateway = NativeGateway({"engines": [{"host": "127.0.0.1", "port": 9}],
...                              "models": ["m"], "listen": {"port": 0},
...                              "scrape": {"enabled": False}, "data_plane": "native"})
...     await gateway.start()
...     try:
...         return gateway.port
...     finally:
...         await gateway.stop()
>>> asyncio.run(main()) > 0
True
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsched import _llmsched
from llmsched._aio import cancel_and_wait
from llmsched._copying import refuse
from llmsched.errors import ConfigError, GatewayStoppedError
from llmsched.flow import FlowController
from llmsched.gateway.admin import check_engine_url
from llmsched.gateway.config import (
    DiscoveryErrors,
    GatewayConfig,
    check_kv_transports,
    cluster_sync,
    engine_set,
    file_version,
    gateway_index,
    load_config,
    read_engines_file,
)
from llmsched.gateway.engine_models import EngineModelCheck
from llmsched.gateway.metrics import (
    KV_FAILING_SOCKETS,
    cluster_metrics_text,
    config_metrics_text,
    kubernetes_metrics_text,
    metric_help,
    model_check_metrics_text,
)
from llmsched.gateway.pod_discovery import PodDiscovery
from llmsched.integrations import EngineSpec
from llmsched.routing import PSEUDO_TOKEN_NOTE, TOKEN_MISMATCH_NOTE, TokenCheckCounts
from llmsched.scheduler import Scheduler, warn_flow_without_load

if TYPE_CHECKING:
    from llmsched.cluster import ClusterSync, Usage
    from llmsched.types import (
        EndpointInfo,
        FlowConfig,
        FlowMetrics,
        NativeFlowStats,
        NativeGatewayConfig,
        NativeSlicesConfig,
        TokenizerCacheStats,
    )

__all__ = [
    "NativeFlowView",
    "NativeGateway",
    "NativeHealthView",
    "NativeMetrics",
    "NativeSliceView",
]

log = logging.getLogger("llmsched.gateway")


class NativeMetrics:
    """The native plane's ``/metrics`` (the Python plane's metric names)."""

    def __init__(self, owner: NativeGateway) -> None:
        self._owner = owner

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return self._owner.native().metrics_text().encode()


class NativeHealthView:
    """Engine health as the native plane judges it (probes and circuit breaker)."""

    def __init__(self, owner: NativeGateway) -> None:
        self._owner = owner

    def state(self, worker: str) -> str:
        """``up``, ``down`` (its probes failed), ``open`` (its breaker) or ``draining`` (the
        admin API); KeyError when the engine is not configured."""
        states = dict(self._owner.native().health_states())
        return states[worker]

    def routable(self, worker: str) -> bool:
        """Whether the engine is up."""
        return self.state(worker) == "up"


class NativeFlowView:
    """Flow control as the native plane runs it (the core flow controller in Rust)."""

    def __init__(self, owner: NativeGateway) -> None:
        self._owner = owner

    def _stats(self) -> NativeFlowStats:
        stats = self._owner.native().flow_stats()
        if stats is None:
            raise ConfigError("flow: flow control is off")
        return stats

    def running_count(self) -> int:
        """Dispatched requests not yet complete."""
        return int(self._stats()["running"])

    def queued_count(self) -> int:
        """Requests waiting to be dispatched."""
        return int(self._stats()["queued"])

    def saturation(self) -> float:
        """The saturation gauge."""
        return float(self._stats()["saturation"])

    def metrics(self) -> FlowMetrics:
        """Queue lengths per band and flow, outcome counts, saturation and fairness, as
        :meth:`llmsched.FlowController.metrics` gives them."""
        metrics = self._owner.native().flow_metrics()
        if metrics is None:
            raise ConfigError("flow: flow control is off")
        return metrics

    def __len__(self) -> int:
        return self.queued_count()

    def outcome_counts(self) -> dict[str, int]:
        """Requests per outcome (``dispatched``, ``rejected_capacity``, ...)."""
        return dict(self._stats()["outcomes"])


class NativeSliceView:
    """Token slices as the native plane runs them (the core slice tracker in Rust)."""

    def __init__(self, owner: NativeGateway) -> None:
        self._owner = owner

    def __len__(self) -> int:
        """Requests being decoded in slices now."""
        return int(self._owner.native().sliced_requests() or 0)


def native_config(config: GatewayConfig, engines: Iterable[EngineSpec]) -> NativeGatewayConfig:
    """The native gateway's configuration (``llmsched_gateway::GatewayConfig`` as JSON) for a
    checked gateway config."""
    flow: FlowConfig | None = None
    if config.flow is not None:
        flow = _flow_config(config)
    health = config.health
    timeouts = config.timeouts
    limits = config.limits
    return {
        "engines": [{"id": spec.worker_id, "url": spec.base_url} for spec in engines],
        "models": list(config.models),
        "lora_adapters": dict(config.lora_adapters),
        "max_body": limits.max_body_bytes,
        "max_body_in_flight": limits.max_body_bytes_in_flight,
        "retries": config.retries.max_attempts - 1,
        "retry_on_5xx": config.retries.on_5xx,
        "scrape_interval_s": config.scrape.interval_s if config.scrape.enabled else None,
        "scrape_timeout_s": config.scrape.timeout_s,
        "flow": flow,
        "api_keys": [
            {"key": key, "tenant": ident.tenant, "priority": ident.priority, **ident.limits()}
            for key, ident in config.auth.api_keys.items()
        ],
        "retry_after_s": limits.retry_after_s,
        "body_timeout_s": limits.body_timeout_s,
        "idle_timeout_s": limits.idle_timeout_s,
        "connect_timeout_s": timeouts.connect_s,
        "read_timeout_s": timeouts.read_s,
        "total_timeout_s": timeouts.total_s,
        "max_connections": limits.max_connections,
        "max_headers": limits.max_headers,
        "max_field_size": limits.max_field_size,
        "max_line_size": limits.max_line_size,
        "max_tenants": limits.max_tenants,
        "tenant_idle_s": limits.tenant_idle_s,
        "left_grace_s": config.discovery.left_grace_s,
        "health": {
            "path": health.path,
            "interval_s": health.interval_s,
            "timeout_s": health.timeout_s,
            "unhealthy_threshold": health.unhealthy_threshold,
            "healthy_threshold": health.healthy_threshold,
            "failures_to_probe": health.failures_to_probe,
            "breaker_window_s": health.breaker_window_s,
            "breaker_min_requests": health.breaker_min_requests,
            "breaker_failure_rate": health.breaker_failure_rate,
            "breaker_open_s": health.breaker_open_s,
            "eject_s": config.retries.eject_s,
        },
        "pd_header": config.pd.header if config.pd.enabled else None,
        "threads": config.native_threads,
        "tokenizer": None if config.tokenizer is None else str(config.tokenizer),
        "tokenizer_cache_bytes": config.tokenizer_cache_bytes,
        "chat_template_content_format": config.chat_template_content_format,
        "chat_template": config.chat_template,
        "default_chat_template_kwargs": dict(config.default_chat_template_kwargs) or None,
        "exclude_tools_when_tool_choice_none": config.exclude_tools_when_tool_choice_none,
        "trust_request_chat_template": config.trust_request_chat_template,
        "max_model_len": config.max_model_len,
        "slices": _slices_config(config),
        "admin": None if config.admin.token is None else {"token": config.admin.token},
        "record_unread_prefixes": config.record_unread_prefixes,
        "session_token_namespace": (
            None if config.discovery.kubernetes is None else config.discovery.kubernetes.namespace
        ),
    }


def _slices_config(config: GatewayConfig) -> NativeSlicesConfig | None:
    slices = config.slices
    if not slices.enabled:
        return None
    return {
        "policy": slices.policy,
        "params": dict(slices.params),
        "default_max_tokens": slices.default_max_tokens,
    }


def _flow_config(config: GatewayConfig) -> FlowConfig:
    """The flow config resolved by the flow controller (checked), with the saturation
    staleness matched to the scrape interval unless it sets it."""
    assert config.flow is not None
    raw: dict[str, Any] = json.loads(json.dumps(dict(config.flow)))
    saturation = raw.setdefault("saturation", {"type": "utilization"})
    if isinstance(saturation, dict) and saturation.get("type", "utilization") == "utilization":
        saturation.setdefault("staleness_s", _stale_after(config))
    try:
        resolved = FlowController(raw).config
    except ConfigError as exc:
        raise ConfigError(f"flow: {exc}") from None
    return resolved


# An admin call's engine change waits this long for the event loop at most.
_ADMIN_WAIT_S = 60.0


class _AdminClaim:
    """Who decides an admin engine change that timed out: the event loop, which takes it up
    (:meth:`start`), or the admin thread, which gave up waiting (:meth:`abandon`); whichever
    comes first, under one lock. An abandoned change never starts, so the admin call can say
    it was not made; a started one is made (see :meth:`NativeGateway._admin_engines`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._abandoned = False

    def start(self) -> bool:
        """On the loop, before the change: False when the caller has abandoned it."""
        with self._lock:
            self._started = not self._abandoned
            return self._started

    def abandon(self) -> bool:
        """On the admin thread, once it stopped waiting: True when the change had not started
        (it never will)."""
        with self._lock:
            self._abandoned = not self._started
            return self._abandoned


def _admin_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = "service_unavailable" if status == 503 else "timeout"
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _stale_after(config: GatewayConfig) -> float:
    return 3 * config.scrape.interval_s + config.scrape.timeout_s


class NativeGateway:
    """``llmsched serve`` on the native data plane, with the surface of
    :class:`~llmsched.gateway.Gateway`: :meth:`start`, :meth:`stop`, :attr:`port`,
    :attr:`url`, :meth:`set_engines`, :attr:`metrics`, :attr:`pool`, :attr:`index`,
    :attr:`router`, :attr:`scheduler`, :attr:`health`, :attr:`flow` (None when flow
    control is off) and :attr:`slice_tracker` (None when token slices are off).

    Args:
        config: a :class:`~llmsched.gateway.config.GatewayConfig`, a mapping or a YAML path.
    """

    def __init__(self, config: GatewayConfig | Mapping[str, Any] | str | os.PathLike[str]) -> None:
        self.config = config if isinstance(config, GatewayConfig) else load_config(config)
        cfg = self.config
        native_config(cfg, cfg.engines)  # a bad flow config fails here, before anything starts
        # The config may have been loaded for the other plane (`llmsched serve --data-plane`).
        check_kv_transports(cfg.engines, "native")
        self._specs: dict[str, EngineSpec] = {spec.worker_id: spec for spec in cfg.engines}
        # The pool, index and router are built in Python and shared; scraping, flow control,
        # health and the KV-event feed run natively.
        notes = list(cfg.notes)
        if cfg.flow is not None:
            # Flow control runs in Rust here, so the scheduler never sees it: its note on a
            # configuration that refuses every request is given here, and handed to the
            # scheduler to list and count as the Python plane's does.
            saturation = cfg.flow.get("saturation")
            note = warn_flow_without_load(
                saturation if isinstance(saturation, Mapping) else {}, scrape=cfg.scrape.enabled
            )
            if note is not None:
                notes.append(note)
        self.scheduler = Scheduler(
            cfg.engines,
            router=cfg.router,
            index=gateway_index(cfg),
            scrape=False,
            # The engines' KV events are read and applied in Rust too.
            kv_feed="native",
            stale_after_s=_stale_after(cfg),
            stale_policy="saturated" if cfg.scrape.enabled else "ignore",
            retry_after_s=cfg.limits.retry_after_s,
            notes=notes,
            # The loader applied the router config's flow sections (or noted them).
            wires_flow=True,
        )
        self.index = self.scheduler.index
        self.pool = self.scheduler.pool
        self.router = self.scheduler.router
        # The prompts are tokenized and routed natively, outside `Router.pick`: the native
        # plane runs the router's token-id check itself, counted as the router's own.
        self._token_counts_past: TokenCheckCounts = (0, 0, None, 0)
        self.router.add_token_check(self._token_counts)
        self.metrics = NativeMetrics(self)
        self.health = NativeHealthView(self)
        self.flow: NativeFlowView | None = None if cfg.flow is None else NativeFlowView(self)
        self.slice_tracker: NativeSliceView | None = (
            NativeSliceView(self) if cfg.slices.enabled else None
        )
        self._native: _llmsched.NativeGateway | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._discovery_errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.cluster: ClusterSync | None = cluster_sync(cfg, self.router)
        """Replica sync (``cluster`` section; None when off): the NATS transport runs here,
        on the event loop, once per flush; the router's commits are journaled natively."""
        if self.cluster is not None:
            self.cluster.share_usage(self._collect_usage, self._apply_usage)
        self.model_check = EngineModelCheck(
            cfg.models,
            cfg.lora_adapters,
            max_model_len=cfg.max_model_len,
            on_context=self._set_context,
        )
        """Each engine's ``/v1/models`` against ``models`` and ``lora_adapters`` (run here,
        on the event loop)."""
        self.model_check.set_engines(self._specs.values())
        self._model_check_task: asyncio.Task[None] | None = None
        self.kubernetes: PodDiscovery | None = None
        """Kubernetes discovery (``discovery.kubernetes``; None when off), run here, on the
        event loop."""
        if cfg.discovery.kubernetes is not None:
            self.kubernetes = PodDiscovery(
                cfg.discovery.kubernetes, self, on_error=self._count_discovery_error
            )

    def _count_discovery_error(self) -> None:
        self._discovery_errors += 1

    def _set_context(self, context: int | None) -> None:
        """The engines' context length changed (what ``truncate_prompt_tokens: -1`` keeps)."""
        if self._native is not None:
            self._native.set_max_model_len(context)

    def native(self) -> _llmsched.NativeGateway:
        """The running native gateway (GatewayStoppedError when not started)."""
        if self._native is None:
            raise GatewayStoppedError("the gateway is not started")
        return self._native

    @property
    def port(self) -> int:
        """The port listened on (known after :meth:`start`)."""
        return int(self.native().port)

    @property
    def url(self) -> str:
        """``http://host:port`` of the running gateway (an IPv6 address in brackets)."""
        return self.config.listen.url(self.port)

    @property
    def engines(self) -> list[EngineSpec]:
        """The engines requests may go to now."""
        return list(self._specs.values())

    async def start(self) -> None:
        """Starts the KV-event feed, the discovery watcher and the native gateway."""
        cfg = self.config
        await self.scheduler.start()
        self._loop = asyncio.get_running_loop()
        text = json.dumps(native_config(cfg, self._specs.values()))
        try:
            self._native = _llmsched.NativeGateway(
                text,
                cfg.listen.host,
                cfg.listen.port,
                self.router,
                self._extra_metrics,
                self._admin_engines if cfg.admin.enabled else None,
                self.scheduler.note_engine_block_size,
                self._token_warning,
            )
        except BaseException:
            await self.scheduler.stop()
            raise
        if self.cluster is not None:
            await self.cluster.start()
        cache = self._native.tokenizer_cache_stats()
        if cache is not None and not cache["enabled"] and cfg.tokenizer_cache_bytes > 0:
            log.warning(
                "tokenizer %s: the tokenizer cache is off, every chat prompt is encoded whole: %s",
                cfg.tokenizer,
                cache["disabled_reason"],
            )
        elif cache is not None and cache["enabled"] and not cache["chunks"]:
            log.info(
                "tokenizer %s: long prompt pieces are encoded whole, not chunk by chunk: %s",
                cfg.tokenizer,
                cache["chunks_disabled_reason"],
            )
        if cfg.discovery.file is not None:
            self._discovery_task = asyncio.create_task(self._watch_discovery(cfg.discovery.file))
        self._model_check_task = asyncio.create_task(self.model_check.run())
        if self.kubernetes is not None:
            try:
                await self.kubernetes.start()
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        """Stops the native gateway (connections are closed), then the feeds."""
        for task in (self._discovery_task, self._model_check_task):
            if task is not None:
                await cancel_and_wait(task)
        self._discovery_task = self._model_check_task = None
        if self.kubernetes is not None:
            await self.kubernetes.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        if self._native is not None:
            self._token_counts_past = self._token_counts()
            native, self._native = self._native, None
            await asyncio.get_running_loop().run_in_executor(None, native.stop)
        await self.scheduler.stop()

    def _token_counts(self) -> TokenCheckCounts:
        """The native token-id check's counts (the router's ``stats()["token_prompts_..."]``
        and ``token_warning`` add them), summed over this gateway's runs."""
        past = self._token_counts_past
        native = self._native
        if native is None:
            return past
        confirmed, unconfirmed, warned_at, pseudo = native.token_check()
        return (
            past[0] + confirmed,
            past[1] + unconfirmed,
            warned_at if past[2] is None else past[2],
            past[3] + pseudo,
        )

    @staticmethod
    def _token_warning(kind: str, count: int) -> None:
        """A warning of the native plane's token checks (``"pseudo"``: the first prompt hashed
        as pseudo-tokens while engine events feed the index; ``"mismatch"``: none of ``count``
        sampled prompts found in the engines' reported cache), logged as the router logs it
        on the Python plane."""
        note = PSEUDO_TOKEN_NOTE if kind == "pseudo" else TOKEN_MISMATCH_NOTE
        logging.getLogger("llmsched").warning("router: %s", note.format(unconfirmed=count))

    async def __aenter__(self) -> NativeGateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _admin_engines(self, action: str, argument: str) -> tuple[int, str]:
        """An admin call adding (``add``, the request body) or removing (``remove``, the worker
        id) an engine, from the native gateway's blocking thread: run on the event loop by
        :func:`~llmsched.gateway.admin.add_engine` / :func:`~llmsched.gateway.admin.remove_engine`
        (the Python plane's code); returns the status and the JSON body.

        A change the loop has not taken up within ``_ADMIN_WAIT_S`` is abandoned (it never
        runs; 503, nothing changed). One taken up changes the engine set in the loop step that
        starts it (only the KV-event feeds are awaited after that): past the wait it is
        answered as made, from the engine set, while the feeds catch up."""
        from llmsched.gateway.admin import add_engine, remove_engine

        loop = self._loop
        if loop is None or loop.is_closed():
            return 503, json.dumps({"error": {"message": "the gateway is stopping"}})
        claim = _AdminClaim()

        async def change() -> tuple[int, dict[str, Any]]:
            if not claim.start():
                return _admin_error(503, "abandoned")  # nobody waits for this answer
            if action == "add":
                return await add_engine(self, argument)
            return await remove_engine(self, argument)

        future = asyncio.run_coroutine_threadsafe(change(), loop)
        try:
            status, body = future.result(_ADMIN_WAIT_S)
        except concurrent.futures.TimeoutError:
            if future.done():  # the change's own TimeoutError: a failure, as any other
                raise
            status, body = self._admin_timed_out(action, argument, claim, future)
        return status, json.dumps(body)

    def _admin_timed_out(
        self,
        action: str,
        argument: str,
        claim: _AdminClaim,
        future: concurrent.futures.Future[tuple[int, dict[str, Any]]],
    ) -> tuple[int, dict[str, Any]]:
        """The answer to an admin engine change still unfinished after ``_ADMIN_WAIT_S``: what
        happened to the engine set, never a failure for a change that is made."""
        waited = f"{_ADMIN_WAIT_S:g} s"
        if claim.abandon():
            return _admin_error(
                503,
                f"the engine change was not made: the gateway did not take it up within "
                f"{waited} (its event loop is busy); nothing changed, try again",
            )
        if future.done():  # it ended meanwhile: its own answer
            return future.result()
        worker = argument
        if action == "add":
            with contextlib.suppress(ValueError, TypeError, ConfigError, RecursionError):
                worker = EngineSpec.from_dict(json.loads(argument)).worker_id
        there = worker in self._specs
        if there == (action == "add"):
            log.warning(
                "admin: engine %s %s; its KV-event feeds had not followed after %s",
                worker,
                "added" if action == "add" else "removed",
                waited,
            )
            return (201, {"added": worker}) if action == "add" else (200, {"removed": worker})
        return _admin_error(
            504,
            f"the engine change is under way and did not end within {waited}: it may still "
            "be made; GET /admin/engines shows the engines",
        )

    def _collect_usage(self) -> Usage:
        """What this replica took per rate-limited key and served per tenant since the last
        flush (replica sync; counted natively)."""
        native = self._native
        if native is None:
            return {"keys": {}, "tenants": []}
        usage = native.drain_usage()
        return {"keys": dict(usage["keys"]), "tenants": list(usage["tenants"])}

    def _apply_usage(self, usage: Usage) -> None:
        """Another replica's usage: charged natively to the same keys and tenants' flows."""
        if self._native is not None:
            self._native.apply_usage(usage["keys"], usage["tenants"])

    def _extra_metrics(self) -> str:
        """What runs in Python, for the native ``/metrics``: discovery errors, the KV-event
        subscriber's counters and failing sockets, replica sync's state and the engines' model
        check."""
        lines = [
            f"# HELP llmsched_gateway_discovery_errors_total {metric_help('discovery_errors')}",
            "# TYPE llmsched_gateway_discovery_errors_total counter",
            f"llmsched_gateway_discovery_errors_total {float(self._discovery_errors)}",
        ]
        cluster = "" if self.cluster is None else cluster_metrics_text(self.cluster.stats())
        cluster += model_check_metrics_text(self.model_check.findings())
        cluster += config_metrics_text(
            len(self.scheduler.warnings),
            self.index.block_size_mismatch(),
            extra_keys=self.index.extra_keys(),
            engine_block_sizes=self.scheduler.engine_block_size_mismatch(),
        )
        if self.kubernetes is not None:
            cluster += kubernetes_metrics_text(self.kubernetes.stats())
        subscriber = self.scheduler.subscriber
        failing = 0 if subscriber is None else len(subscriber.failing_sockets())
        lines += [
            f"# HELP {KV_FAILING_SOCKETS} {metric_help('kv_events_failing_sockets')}",
            f"# TYPE {KV_FAILING_SOCKETS} gauge",
            f"{KV_FAILING_SOCKETS} {float(failing)}",
        ]
        # Summed over the feed's restarts (engine changes): the counters only go up.
        counters = self.scheduler.kv_event_counters()
        if not counters:
            return "\n".join(lines) + "\n" + cluster
        lines += [
            f"# HELP llmsched_gateway_kv_events_total {metric_help('kv_events')}",
            "# TYPE llmsched_gateway_kv_events_total counter",
        ]
        for name, value in sorted(counters.items()):
            lines.append(f'llmsched_gateway_kv_events_total{{counter="{name}"}} {float(value)}')
        return "\n".join(lines) + "\n" + cluster

    def tokenizer_cache_stats(self) -> TokenizerCacheStats | None:
        """The native tokenizer's piece cache: hits, misses, evictions, size, and why it is
        off when it is (None without a ``tokenizer``; GatewayStoppedError when not started).

        >>> import asyncio, tempfile
        >>> from llmsched.testing.openai_engine import write_tokenizer
        >>> async def main() -> TokenizerCacheStats | None:
        ...     directory = write_tokenizer(tempfile.mkdtemp())
        ...     gateway = NativeGateway({"engines": [{"host": "127.0.0.1", "port": 9}],
        ...                              "models": ["m"], "listen": {"port": 0},
        ...                              "tokenizer": str(directory),
        ...                              "scrape": {"enabled": False}, "data_plane": "native"})
        ...     await gateway.start()
        ...     try:
        ...         return gateway.tokenizer_cache_stats()
        ...     finally:
        ...         await gateway.stop()
        >>> stats = asyncio.run(main())
        >>> stats is not None and (stats["enabled"], stats["hits"], stats["disabled_reason"])
        (True, 0, None)
        """
        return self.native().tokenizer_cache_stats()

    def routable_endpoints(self) -> list[str]:
        """Engines a request could go to now (in the pool and up)."""
        return [str(w) for w in self.native().routable()]

    def endpoints(self) -> list[EndpointInfo]:
        """The pool's endpoints (:meth:`llmsched.EndpointPool.endpoints`)."""
        return self.pool.endpoints()

    async def set_engines(
        self, engines: Iterable[EngineSpec], *, allow_empty: bool = False
    ) -> tuple[list[str], list[str]]:
        """Replaces the set of engines (what discovery calls): the shared pool and index as
        :meth:`llmsched.gateway.Gateway.set_engines` does, then the native gateway's upstream
        set; returns the worker ids added and removed. A repeated set, or an empty one unless
        ``allow_empty`` (then requests get a 503 and ``/ready`` says not ready), raises
        ConfigError and changes nothing."""
        specs = engine_set(self.config, engines, allow_empty=allow_empty)
        check_kv_transports(specs.values(), "native", by_worker=True)
        for spec in specs.values():
            # Before anything changes: the Rust upstream set refuses such a URL after the
            # pool took it, which left the two apart.
            check_engine_url(spec)
        new, gone, updated = self.scheduler.set_engines(specs.values())
        added, removed, changed = (list(map(str, ids)) for ids in (new, gone, updated))
        if not (added or removed or changed):
            return [], []
        self._specs = specs
        self.model_check.set_engines(specs.values())
        if self._native is not None:
            # Counted as the Python plane counts (an engine changed, at another URL or with
            # another role, model or labels, is one change).
            changes = len(added) + len(removed) + len(changed)
            self._native.set_engines(
                [(s.worker_id, s.base_url) for s in specs.values()], changes=changes
            )
        log.info("engines now %s (added %s, removed %s)", sorted(specs), added, removed)
        await self.scheduler.feeds_settled()
        return added, removed

    async def _watch_discovery(self, path: Path) -> None:
        """Re-reads the discovery file when it changes; a file that cannot be read or checked
        keeps the current engines (logged once per distinct error, and counted)."""
        seen: tuple[int, int, int] | None = (-1, -1, -1)
        errors = DiscoveryErrors()
        while True:
            await asyncio.sleep(self.config.discovery.interval_s)
            # Anything a file can provoke is caught, not only ConfigError: a task that dies
            # stops discovery for good (later good files ignored) and fails the shutdown.
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
                self._discovery_errors += 1
                errors.log(exc)


refuse(
    NativeGateway,
    "start one gateway per process from its config",
    name="llmsched.gateway.NativeGateway",
)
