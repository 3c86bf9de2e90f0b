"""The gateway's configuration: one YAML file (or a dict) read into frozen dataclasses.

Every key is checked when the file is read; a wrong one raises
:class:`~llmsched.errors.ConfigError` naming it (``"limits.max_body_bytes: must be ..."``).
Defaults live in the dataclasses below and nowhere else.

>>> config = load_config({
...     "engines": [{"host": "127.0.0.1", "port": 8001}, {"host": "127.0.0.1", "port": 8002}],
...     "models": ["tiny"],
...     "block_size": 32,
... })
>>> [e.worker_id for e in config.engines], config.listen.port
(['127.0.0.1:8001', '127.0.0.1:8002'], 8000)
>>> load_config({"engines": [], "models": ["tiny"]})
Traceback (most recent call last):
...
llmsched.errors.ConfigError: engines: must list at least one engine
"""

from __future__ import annotations

import logging
import os
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsched.config_loader import check_ints, load_mapping, parse_document, read_document
from llmsched.errors import ConfigError, InvalidTypeError
from llmsched.integrations import EngineSpec
from llmsched.integrations.identity import wire_for_router
from llmsched.types import ConfigInfo, KeyLimits

if TYPE_CHECKING:
    from llmsched.cluster import ClusterSync
    from llmsched.integrations.kubernetes import PodSelector
    from llmsched.prefix_index import PrefixIndex
    from llmsched.routing import Router

_log = logging.getLogger("llmsched")

__all__ = [
    "CONTENT_FORMATS",
    "DATA_PLANES",
    "AdminConfig",
    "ApiKey",
    "AuthConfig",
    "ClusterConfig",
    "DiscoveryConfig",
    "DiscoveryErrors",
    "GatewayConfig",
    "HealthConfig",
    "IndexConfig",
    "KubernetesConfig",
    "LimitsConfig",
    "ListenConfig",
    "PdConfig",
    "RetriesConfig",
    "ScrapeConfig",
    "SlicesConfig",
    "TimeoutsConfig",
    "check_kv_transports",
    "engine_set",
    "file_version",
    "gateway_index",
    "load_config",
    "read_engines_file",
]


@dataclass(frozen=True)
class ListenConfig:
    """Where the gateway listens."""

    host: str = "127.0.0.1"
    port: int = 8000

    def url(self, port: int | None = None) -> str:
        """``http://host:port``, an IPv6 address in brackets; ``port``: the port bound (for a
        :attr:`port` of 0), else :attr:`port`.

        >>> ListenConfig("::1", 8000).url(), ListenConfig().url(41000)
        ('http://[::1]:8000', 'http://127.0.0.1:41000')
        """
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port if port is None else port}"


_LIMIT_FIELDS = ("requests_per_s", "burst_requests", "tokens_per_s", "burst_tokens")


@dataclass(frozen=True)
class ApiKey:
    """What an API key stands for: the fairness id and priority of every request it signs,
    and its own limits (None: unlimited; see :mod:`llmsched.gateway.ratelimit`). The
    priority is a 32-bit signed int and ``max_concurrent`` at most 2**64 - 1, as the native
    plane holds them."""

    tenant: str
    priority: int = 0
    requests_per_s: float | None = None
    burst_requests: float | None = None
    tokens_per_s: float | None = None
    burst_tokens: float | None = None
    max_concurrent: int | None = None

    @property
    def limited(self) -> bool:
        """Whether the key has any rate or concurrency limit."""
        return any(v is not None for v in self.limits().values())

    def limits(self) -> KeyLimits:
        """The key's limits, as :class:`~llmsched.gateway.ratelimit.KeyLimiter` keywords."""
        return {
            "requests_per_s": self.requests_per_s,
            "burst_requests": self.burst_requests,
            "tokens_per_s": self.tokens_per_s,
            "burst_tokens": self.burst_tokens,
            "max_concurrent": self.max_concurrent,
        }


@dataclass(frozen=True)
class AuthConfig:
    """API keys (``Authorization: Bearer <key>`` or ``x-api-key: <key>``): at least 8
    characters of visible ASCII, spaces inside only (a client sends a key in a header).

    ``api_keys`` merges the keys written in the config, in ``api_keys_file`` (a YAML / JSON
    mapping of the same form) and in the environment variable ``api_keys_env`` (the same
    form as YAML / JSON text), later sources overriding earlier ones.
    """

    api_keys: Mapping[str, ApiKey] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether requests must carry a key (some key is configured)."""
        return bool(self.api_keys)


@dataclass(frozen=True)
class LimitsConfig:
    """Request limits (aiohttp refuses bigger request lines and headers before a handler runs).

    ``max_body_bytes`` also refuses a declared ``Content-Length`` over it before the body is
    read (413). ``max_body_bytes_in_flight`` bounds the bytes of all the request bodies being
    received at once (at least ``max_body_bytes``): a body whose declared ``Content-Length``
    would pass it is refused at once, a chunked one as soon as it passes it, with a 503,
    ``Retry-After`` and ``x-llmsched-dropped-reason: body-capacity``; a body's bytes count
    until it is read whole (or refused, or its client leaves). The default, 256 MiB, keeps
    what slow uploads can hold within a small container's memory (64 bodies of the largest
    size at once; a body of a few KB takes milliseconds to arrive, so the budget is reached
    only by bodies held back on purpose or over a very slow link), where the connection and
    body limits alone allowed ``max_connections`` x ``max_body_bytes`` (16 GiB).
    ``body_timeout_s`` bounds the reading of a request body (408 after it: a body
    that trickles in or never ends holds no connection longer); ``idle_timeout_s`` closes a
    connection idle between requests or whose request headers have not all arrived, and
    resets one whose answer the client takes no byte of for that long (counted as
    ``send_timeout``). ``max_connections`` caps open client connections (the operators'
    endpoints, ``/metrics`` and ``/health`` included); one over the cap gets a 503 and is
    closed (the native plane also listens with a backlog of that many, at least 1,024, so a
    burst of connects waits for its answer). ``max_tenants`` bounds the distinct tenant names
    taken from ``x-llmsched-tenant`` (auth off) and seen within the last ``tenant_idle_s``
    seconds: later names share one overflow tenant, so flow control's per-tenant flows stay
    bounded; a name unseen for ``tenant_idle_s`` gives its place back (flow control reclaims
    its flow after the flow config's ``flow_idle_s``). ``retry_after_s`` is the
    ``Retry-After`` a flow-control rejection or a 503 carries.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_body_bytes_in_flight: int = 256 * 1024 * 1024
    max_field_size: int = 8190
    max_line_size: int = 8190
    max_headers: int = 64
    retry_after_s: int = 1
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    max_connections: int = 4096
    max_tenants: int = 10_000
    tenant_idle_s: float = 300.0


@dataclass(frozen=True)
class RetriesConfig:
    """Attempts per request (the first included) while attempts do not get through (see
    :mod:`llmsched.gateway.app`), and how often an engine taken down by its health probes is
    probed again (``eject_s``). ``on_5xx``: a 5xx answer is retried (the engine said it
    failed the request); false relays it to the client (a request then never runs twice)."""

    max_attempts: int = 3
    eject_s: float = 5.0
    on_5xx: bool = True


@dataclass(frozen=True)
class TimeoutsConfig:
    """Timeouts in seconds (None: no limit). ``connect_s`` and ``read_s`` (the longest silence
    between two chunks of an engine's answer) are upstream; ``total_s`` is a whole request's
    deadline from its arrival, flow-control queueing and streaming included."""

    connect_s: float | None = 2.0
    read_s: float | None = 600.0
    total_s: float | None = 1800.0


@dataclass(frozen=True)
class HealthConfig:
    """How engine health is judged (see :mod:`llmsched.gateway.health` for the model).

    Probes are ``GET <engine><path>``; ``interval_s`` (null: off) is the active-check period of
    engines in routing; ``unhealthy_threshold`` failed probes in a row take an engine down,
    ``healthy_threshold`` good ones bring it back; ``failures_to_probe`` failed attempts in a
    row start confirming probes. The circuit breaker opens when, over ``breaker_window_s``,
    at least ``breaker_min_requests`` attempts ended and ``breaker_failure_rate`` (null: no
    breaker) of them failed; it stays open ``breaker_open_s`` before a half-open probe."""

    path: str = "/health"
    interval_s: float | None = 5.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    failures_to_probe: int = 5
    breaker_window_s: float = 10.0
    breaker_min_requests: int = 20
    breaker_failure_rate: float | None = 0.5
    breaker_open_s: float = 10.0


@dataclass(frozen=True)
class ScrapeConfig:
    """How often and how patiently engines' ``/metrics`` are scraped. Without ``interval_s``,
    a router config's metric staleness threshold (a ``utilization-detector``'s or
    ``saturationDetector``'s ``metricsStalenessThreshold``) no longer than 0.2 s sets it to a
    quarter of that threshold (llm-d's 200 ms: 0.05 s, as llm-d scrapes), not under 0.01 s."""

    enabled: bool = True
    interval_s: float = 0.2
    timeout_s: float = 1.0


@dataclass(frozen=True)
class PdConfig:
    """Prefill/decode disaggregation: when the router splits a request, it goes to the decode
    endpoint with the prefill endpoint in ``header`` (llm-d's routing sidecar reads
    ``x-prefiller-host-port``; a header the gateway sets or frames the request with itself,
    such as ``content-length`` or ``host``, is refused)."""

    enabled: bool = False
    header: str = "x-prefiller-host-port"


@dataclass(frozen=True)
class SlicesConfig:
    """Token slices: decode in slices of ``policy``'s length (a :class:`~llmsched.SliceTracker`
    policy and its ``params``), re-routing each continuation; ``default_max_tokens`` bounds a
    request that sets no ``max_tokens``."""

    enabled: bool = False
    policy: str = "fixed"
    params: Mapping[str, Any] = field(default_factory=dict)
    default_max_tokens: int = 256


@dataclass(frozen=True)
class KubernetesConfig:
    """Engines discovered from the Kubernetes API (``discovery.kubernetes``): the Ready pods
    of ``namespace`` that ``selector`` picks (a mapping of labels that must all match, or a
    label-selector string such as ``"app=vllm,tier in (a,b)"``), each an engine at
    ``<pod IP>:<target_port>`` named after its pod (see
    :mod:`llmsched.integrations.kubernetes`). Needs the ``kubernetes`` extra.

    ``role_label``: the pod label holding its P/D role (``prefill``, ``decode``, ``both``);
    ``kv_events_port`` / ``replay_port``: the ports of each pod's KV-event publisher and replay
    socket (``tcp://<pod IP>:<port>``), published with ``topic``; ``model``: the model every
    pod serves (null: any); ``labels``: labels every engine gets besides ``pod``.
    ``kubeconfig``: a kubeconfig file (relative to the config file); null: the in-cluster
    service account. The rest tune the watcher, with its own defaults: ``resync_s`` (a full
    list even while the watch is healthy), ``watch_timeout_s`` (the server ends each watch
    after it), ``request_timeout_s`` (an unanswered request or silent watch is cut),
    ``backoff_initial_s`` / ``backoff_max_s`` (the pause after an error, doubling) and
    ``settle_s`` (changes within it are handed on as one).

    What an ``engines`` entry can say per engine and a pod cannot (``dp_rank``,
    ``metrics_path``, ``kv_events_bind``, a model, topic or labels of its own) is not
    offered: every selected pod is one rank-0 engine with ``/metrics``, the subscriber
    connects to its KV-event port, and ``model``, ``topic`` and ``labels`` hold for all of
    them (one section selects one kind of engine).

    >>> KubernetesConfig("llm", {"app": "vllm"}, 8000).pod_selector().label_selector()
    'app=vllm'
    """

    namespace: str
    selector: Mapping[str, str] | str
    target_port: int
    role_label: str | None = None
    kv_events_port: int | None = None
    replay_port: int | None = None
    topic: str = ""
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    kubeconfig: Path | None = None
    resync_s: float = 300.0
    watch_timeout_s: float = 240.0
    request_timeout_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    settle_s: float = 0.1

    def pod_selector(self) -> PodSelector:
        """The :class:`~llmsched.integrations.kubernetes.PodSelector` of these keys (needs
        the ``kubernetes`` extra: ConfigError naming it otherwise)."""
        return _pod_selector(
            {name: getattr(self, name) for name in _SELECTOR_KEYS}, "discovery.kubernetes"
        )


_SELECTOR_KEYS = (
    "namespace",
    "selector",
    "target_port",
    "role_label",
    "kv_events_port",
    "replay_port",
    "topic",
    "model",
    "labels",
)
"""The keys of ``discovery.kubernetes`` that :class:`PodSelector` takes (and checks)."""

_WATCH_SECONDS = (
    "resync_s",
    "watch_timeout_s",
    "request_timeout_s",
    "backoff_initial_s",
    "backoff_max_s",
)
"""The watcher's timings in ``discovery.kubernetes`` (seconds > 0; ``settle_s`` may be 0)."""


@dataclass(frozen=True)
class DiscoveryConfig:
    """Engines listed in a file the gateway re-reads when it changes: a Kubernetes ConfigMap
    mounted as a volume, or a file any discovery agent rewrites. The file holds the same list
    as ``engines`` (or a mapping with that one key); it is the only source of engines when set,
    and like ``engines`` it is configuration, never taken from requests. A file over
    ``max_bytes`` is refused unread (a runaway agent cannot keep discovery busy).

    ``left_grace_s``: an engine that leaves the set (the file, or ``DELETE /admin/engines``)
    may be back soon (a pod's readiness flapping); for this long the Responses API requests
    naming its stored responses get a 503 with ``Retry-After`` rather than a 404, and it gets
    them back if it returns. Null: they are forgotten at once.

    ``kubernetes``: engines from the Kubernetes API instead (:class:`KubernetesConfig`), with
    neither ``file`` nor ``engines``; ``interval_s`` and ``max_bytes`` are the file's alone."""

    file: Path | None = None
    interval_s: float = 2.0
    max_bytes: int = 1 << 20
    left_grace_s: float | None = 30.0
    kubernetes: KubernetesConfig | None = None


@dataclass(frozen=True)
class IndexConfig:
    """The gateway's prefix index. ``max_bytes``: the bytes it may use, as its
    ``stats()["bytes"]`` counts them; past them the least recently used blocks of all engines
    are evicted (``llmsched_gateway_index_evicted_blocks_total``). 1 GiB holds about 11-25
    million (block, engine) pairs. Null: unbounded, and an engine (or any peer of a bound
    ``kv_events`` port) that stores blocks and never removes them grows the gateway without
    end. ``worker_capacity``: blocks each engine may hold in it (its least recently used
    evicted past them); null: the router config's (llm-d's ``lruCapacityPerServer``), else
    none."""

    max_bytes: int | None = 1 << 30
    worker_capacity: int | None = None


@dataclass(frozen=True)
class AdminConfig:
    """The admin API (:mod:`llmsched.gateway.admin`): on when a token is set, in the config
    (``token``) or in the environment variable ``token_env`` names."""

    token: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether the admin routes exist."""
        return self.token is not None


@dataclass(frozen=True)
class ClusterConfig:
    """Replica sync (:mod:`llmsched.cluster`): gateways with the same ``name`` on the same NATS
    ``servers`` share approximate prefix records, sessions and in-flight counts. Off while
    ``servers`` is empty."""

    servers: tuple[str, ...] = ()
    name: str = "llmsched"
    replica: str | None = None
    flush_s: float = 0.005
    heartbeat_s: float = 1.0
    load_ttl_s: float = 3.0

    @property
    def enabled(self) -> bool:
        """Whether the gateway joins a cluster."""
        return bool(self.servers)


@dataclass(frozen=True)
class GatewayConfig:
    """The whole gateway configuration. Build it with :func:`load_config`.

    ``models``: the model names requests may ask for; ``lora_adapters``: LoRA adapters the
    engines serve, each mapped to its base model (one of ``models``). A request naming an
    adapter goes to its base model's engines, is forwarded as sent, and its prompt is
    hashed, matched and recorded under the adapter's name, as vLLM keys the adapter's cache
    blocks (and names it in its KV events); ``/v1/models`` lists each adapter with its base
    as ``parent``.
    ``data_plane``: who serves requests, ``native`` (the default: the Rust data plane in the
    same process, :mod:`llmsched.gateway.native`) or ``python`` (the aiohttp gateway,
    :mod:`llmsched.gateway.app`); both serve every section of the config;
    ``native_threads``: the native plane's worker threads (1: all on one thread);
    ``tokenizer_cache_bytes``: the native plane's cache of prompts' pieces (the text
    between the tokenizer's added tokens, long pieces cut at word boundaries into chunks of
    about 64 bytes, with their ids; least recently used evicted first), for chat and
    completion prompts, in bytes; 0: none. It is used only where the tokenizer's piecewise
    encoding is proved exact at start-up (else a warning and ``tokenizer_cache_stats()`` say
    why);
    ``chat_template``: the chat template as the engines were started with vLLM's
    ``--chat-template`` (a file's path, relative to the config file, or the template's text),
    in place of the tokenizer directory's own; ``default_chat_template_kwargs``: the
    template variables the engines were given with ``--default-chat-template-kwargs``, under
    every request's ``chat_template_kwargs`` (a request's kwarg of null or ``"auto"`` leaves
    the default, as in vLLM); ``exclude_tools_when_tool_choice_none``: the engines' flag of
    that name (a request's ``tool_choice`` of ``"none"`` leaves its tools out of the
    template); ``trust_request_chat_template``: the engines' ``--trust-request-chat-template``
    (a request's own ``chat_template``, or one among its ``chat_template_kwargs``, is
    rendered; without it such a request is refused with a 400, as the engines refuse it).
    These need ``tokenizer``, and change the token ids chats are routed on: set
    them as the engines have them;
    ``chat_template_content_format``: how the chat template takes a message's list
    content, as the engines were started with vLLM's ``--chat-template-content-format``:
    ``auto`` (the default: detected from the template as vLLM detects it), ``string`` (the
    texts joined by newlines) or ``openai`` (the parts as ``{type, ...}`` objects);
    ``record_unread_prefixes``: whether the native plane hashes each prompt and records its
    blocks in the prefix index for the engine it is sent to when the router reads nothing of
    the index (``round-robin``, ``random``, ``least-load``, ...: no filter, scorer or picker
    reads a prefix match and no P/D decider weighs uncached tokens). Off (the default), such a
    router decides without hashing the prompt, and the index (its gauges, ``/metrics``) holds
    only what engines' KV events report; on, every sent request records its blocks as with a
    prefix-aware router. A router that reads the index always records. The Python plane always
    records; ``max_model_len``: the engines' context length (vLLM's ``--max-model-len``),
    what a request's ``truncate_prompt_tokens`` of -1 keeps less one, as vLLM keeps it (such a
    prompt longer than that is cut by the engine, and routed on the ids it keeps). Null (the
    default): learned from the engines' ``/v1/models`` when they agree; until then, and where
    they differ, such a prompt is routed on its whole ids.
    ``notes`` (not a key): what the loader found will route badly (a ``saturationDetector``
    without flow control, a precise prefix scorer over engines without ``kv_events``, a
    ``token-producer`` tokenizer not found), each logged once as it loaded; the gateway lists
    them in its scheduler's ``warnings`` and counts them in ``llmsched_gateway_config_warnings``."""

    engines: tuple[EngineSpec, ...]
    models: tuple[str, ...]
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    listen: ListenConfig = ListenConfig()
    block_size: int = 16
    tokenizer: Path | None = None
    router: str | Mapping[str, Any] = "llm-d"
    flow: Mapping[str, Any] | None = None
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    retries: RetriesConfig = RetriesConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    pd: PdConfig = PdConfig()
    slices: SlicesConfig = SlicesConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    index: IndexConfig = IndexConfig()
    admin: AdminConfig = AdminConfig()
    cluster: ClusterConfig = ClusterConfig()
    data_plane: str = "native"
    native_threads: int = 1
    tokenizer_cache_bytes: int = 32 * 1024 * 1024
    chat_template_content_format: str = "auto"
    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False
    trust_request_chat_template: bool = False
    record_unread_prefixes: bool = False
    max_model_len: int | None = None
    notes: tuple[str, ...] = ()


DATA_PLANES = ("python", "native")
"""``data_plane``: ``native`` (the default: the Rust data plane in the same process, see
:mod:`llmsched.gateway.native`) or ``python`` (the aiohttp gateway)."""

_TOP_KEYS = frozenset(
    {
        "data_plane",
        "native_threads",
        "listen",
        "engines",
        "models",
        "lora_adapters",
        "block_size",
        "tokenizer",
        "tokenizer_cache_bytes",
        "chat_template_content_format",
        "chat_template",
        "default_chat_template_kwargs",
        "exclude_tools_when_tool_choice_none",
        "trust_request_chat_template",
        "record_unread_prefixes",
        "max_model_len",
        "router",
        "flow",
        "auth",
        "limits",
        "retries",
        "timeouts",
        "health",
        "scrape",
        "pd",
        "slices",
        "discovery",
        "index",
        "admin",
        "cluster",
    }
)


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> GatewayConfig:
    """Reads and checks a gateway config from a mapping or a YAML / JSON file path.

    Relative paths inside a file (``tokenizer``, ``auth.api_keys_file``) are resolved against
    the file's directory.
    """
    base = Path.cwd()
    if isinstance(source, Mapping):
        raw: Any = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        raw = load_mapping(path, what="config")
        base = path.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError("config: must be a mapping")
    unknown = sorted(set(raw) - _TOP_KEYS, key=str)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    discovery = _discovery(_section(raw, "discovery"), base)
    source = "discovery.file" if discovery.file is not None else "discovery.kubernetes"
    if discovery.file is None and discovery.kubernetes is None:
        engines = _engines(raw.get("engines"))
    elif raw.get("engines") is not None:
        raise ConfigError(f"engines: give either engines or {source}, not both")
    elif discovery.file is not None:
        engines = read_engines_file(discovery.file, max_bytes=discovery.max_bytes)
    else:
        engines = ()  # until the first list of pods
    models = _models(raw.get("models"))
    block_size = _int(raw, "block_size", GatewayConfig.block_size, "", low=1)
    tokenizer = _tokenizer(raw.get("tokenizer"), base)
    router = _router(raw.get("router", GatewayConfig.router), base)
    flow = raw.get("flow")
    if flow is not None and not isinstance(flow, Mapping):
        raise ConfigError("flow: must be a mapping or null")
    # The core checks these sections' fields, but an int beyond 64 bits reaches it as a
    # message that names no key: named here, on both planes, when the config is loaded.
    if flow is not None:
        _check_band_priorities(flow)
        check_ints(flow, "flow")
    if isinstance(router, Mapping):
        check_ints(router, "router")
    pd = _pd(_section(raw, "pd"))
    notes: list[str] = []
    wired = _wire_router(router, raw, block_size, flow, engines, models, tokenizer, pd, notes)
    block_size, flow, engines, tokenizer, pd = wired
    scrape_raw = _section(raw, "scrape")
    scrape = _fit_scrape(router, _scrape(scrape_raw), "interval_s" in scrape_raw, notes)
    for key in ("chat_template", "default_chat_template_kwargs"):
        if raw.get(key) is not None and tokenizer is None:
            raise ConfigError(f"{key}: needs a tokenizer (it changes the chats' token ids)")
    data_plane = _data_plane(raw.get("data_plane", GatewayConfig.data_plane))
    check_kv_transports(engines, data_plane)
    return GatewayConfig(
        engines=engines,
        models=models,
        lora_adapters=_lora_adapters(raw.get("lora_adapters"), models),
        listen=_listen(_section(raw, "listen")),
        block_size=block_size,
        tokenizer=tokenizer,
        router=router,
        flow=flow,
        auth=_auth(_section(raw, "auth"), base),
        limits=_limits(_section(raw, "limits")),
        retries=_retries(_section(raw, "retries")),
        timeouts=_timeouts(_section(raw, "timeouts")),
        health=_health(_section(raw, "health")),
        scrape=scrape,
        pd=pd,
        slices=_slices(_section(raw, "slices")),
        discovery=discovery,
        index=_index(_section(raw, "index")),
        admin=_admin(_section(raw, "admin")),
        cluster=_cluster(_section(raw, "cluster")),
        data_plane=data_plane,
        native_threads=_int(
            raw, "native_threads", GatewayConfig.native_threads, "", low=1, high=64
        ),
        tokenizer_cache_bytes=_int(
            raw, "tokenizer_cache_bytes", GatewayConfig.tokenizer_cache_bytes, "", low=0, high=2**40
        ),
        chat_template_content_format=_content_format(
            raw.get("chat_template_content_format", GatewayConfig.chat_template_content_format)
        ),
        chat_template=_chat_template(raw.get("chat_template"), base),
        default_chat_template_kwargs=_default_kwargs(raw.get("default_chat_template_kwargs")),
        exclude_tools_when_tool_choice_none=_bool(
            raw,
            "exclude_tools_when_tool_choice_none",
            GatewayConfig.exclude_tools_when_tool_choice_none,
            "",
        ),
        trust_request_chat_template=_bool(
            raw,
            "trust_request_chat_template",
            GatewayConfig.trust_request_chat_template,
            "",
        ),
        record_unread_prefixes=_bool(
            raw, "record_unread_prefixes", GatewayConfig.record_unread_prefixes, ""
        ),
        max_model_len=(
            None
            if raw.get("max_model_len") is None
            else _int(raw, "max_model_len", 1, "", low=1, high=2**31)
        ),
        notes=tuple(notes),
    )


def check_kv_transports(
    engines: Iterable[EngineSpec], data_plane: str, *, by_worker: bool = False
) -> None:
    """ConfigError for a KV-event or replay endpoint ``data_plane``'s subscriber can never
    reach, naming the engine (``engines[i]``, or its worker id with ``by_worker``) and the
    key: ``inproc://`` on either plane (only sockets of the subscriber's own ZMQ context reach
    it, no engine), anything but ``tcp://`` on the native plane (its feed reads TCP only).
    The endpoints' hosts and ports are checked by
    :class:`~llmsched.integrations.EngineSpec` itself.

    >>> spec = EngineSpec("h", 8000, kv_events="ipc:///tmp/kv", kv_events_bind=True)
    >>> check_kv_transports([spec], "python")
    >>> check_kv_transports([spec], "native")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: engines[0].kv_events: 'ipc:///tmp/kv': the native data plane ...
    """
    for i, spec in enumerate(engines):
        for key in ("kv_events", "replay"):
            endpoint = getattr(spec, key)
            if endpoint is None:
                continue
            name = f"engine {spec.worker_id}: {key}" if by_worker else f"engines[{i}].{key}"
            if endpoint.startswith("inproc://"):
                raise ConfigError(
                    f"{name}: {endpoint!r}: inproc:// reaches only the subscriber's own ZMQ "
                    "context, where no engine publishes; use tcp:// (or ipc://)"
                )
            if data_plane == "native" and not endpoint.startswith("tcp://"):
                raise ConfigError(
                    f"{name}: {endpoint!r}: the native data plane reads KV events over tcp:// "
                    "only (data_plane: python reads ipc:// too)"
                )


def _data_plane(value: Any) -> str:
    if value not in DATA_PLANES:
        raise ConfigError(f"data_plane: must be one of {', '.join(DATA_PLANES)}, got {value!r}")
    return str(value)


CONTENT_FORMATS = ("auto", "string", "openai")
"""``chat_template_content_format``: vLLM's ``--chat-template-content-format`` values."""


def _content_format(value: Any) -> str:
    if value not in CONTENT_FORMATS:
        raise ConfigError(
            f"chat_template_content_format: must be one of {', '.join(CONTENT_FORMATS)}, "
            f"got {value!r}"
        )
    return str(value)


def _chat_template(value: Any, base: Path) -> str | None:
    """The template's text, read as vLLM reads ``--chat-template``: a file (relative to the
    config file), else the value itself when it holds ``{``, ``}`` or a newline."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError("chat_template: must be a template file's path or a template's text")
    path = Path(value)
    if not path.is_absolute():
        path = base / path
    if "\n" not in value and path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"chat_template: cannot read {str(path)!r}: {exc}") from None
    if not any(c in value for c in "{}\n"):
        raise ConfigError(
            f"chat_template: {value!r} is no file (vLLM's built-in template names are not "
            "known here: give the template's file)"
        )
    return value


def _default_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError("default_chat_template_kwargs: must be a mapping")
    for name in ("chat_template", "tokenize", "messages"):
        if name in value:
            raise ConfigError(f"default_chat_template_kwargs: may not set {name!r}")
    return dict(value)


def _check_band_priorities(flow: Mapping[str, Any]) -> None:
    """A band's priority is an i32 in the core: one outside it is named with its path here
    (the core's own message names the band but not the range)."""
    bands = flow.get("bands")
    if not isinstance(bands, list):
        return  # the core names any other shape
    for i, band in enumerate(bands):
        priority = band.get("priority") if isinstance(band, Mapping) else None
        if isinstance(priority, int) and not _I32_MIN <= priority <= _I32_MAX:
            raise ConfigError(
                f"flow.bands[{i}].priority: must be an int in {_I32_MIN}..{_I32_MAX}, "
                f"got {priority}"
            )


def _router(value: Any, base: Path) -> str | Mapping[str, Any]:
    """The router config: a preset name, a mapping, or a path (relative to the config file)."""
    if isinstance(value, Mapping):
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError("router: must be a preset name, a file path or a mapping")
    path = Path(value)
    if not path.is_absolute() and (base / path).is_file():
        return str(base / path)
    return value


def _wire_router(
    router: str | Mapping[str, Any],
    raw: Mapping[str, Any],
    block_size: int,
    flow: Mapping[str, Any] | None,
    engines: tuple[EngineSpec, ...],
    models: tuple[str, ...],
    tokenizer: Path | None,
    pd: PdConfig,
    notes: list[str],
) -> tuple[int, dict[str, Any] | None, tuple[EngineSpec, ...], Path | None, PdConfig]:
    """What an ``EndpointPickerConfig`` asks of the gateway: the index's block size (taken
    when ``block_size`` is not set, checked when it is), flow control (``featureGates:
    [flowControl]`` turns it on with llm-d's defaults; ``saturationDetector`` sets its
    utilization thresholds), the KV events a precise prefix scorer reads (engines without
    their own ``kv_events`` publish to ``kvEventsConfig.zmqEndpoint``, one socket the gateway
    binds and splits by topic), the tokenizer a ``token-producer`` names (found in the local
    Hugging Face cache when ``tokenizer`` is not set) and the prefill header of llm-d's
    disaggregation handlers (``pd`` turned on with it). What will route badly is logged and
    appended to ``notes``."""
    from llmsched.routing import config_info

    try:
        info = config_info(router)
    except ConfigError as exc:
        raise ConfigError(f"router: {exc}") from None
    wanted = info["block_size"]
    if wanted is not None:
        if "block_size" not in raw:
            block_size = wanted
        elif block_size != wanted:
            raise ConfigError(
                f"block_size: is {block_size} but the router config asks for blocks of {wanted} "
                "tokens; set them equal (or leave block_size out)"
            )
    out = None if flow is None else _json_copy(flow)
    if out is None and info["flow_control"]:
        out = {}
    saturation = info["saturation"]
    if saturation is not None:
        if out is None:
            _note(
                notes,
                "router config saturationDetector has no effect: flow control is off (add "
                "featureGates: [flowControl] to the router config or a flow section here)",
            )
        else:
            _merge_saturation(out, saturation)
    engines = _wire_specs(engines, models, info)
    metrics = info["metrics_source"]
    scrape = raw.get("scrape") or {}
    if metrics is not None and isinstance(scrape, Mapping) and scrape.get("enabled") is False:
        raise ConfigError(
            f"scrape.enabled: is false but the router config's {metrics['key']} "
            "(metrics-data-source) polls the engines' metrics; remove one"
        )
    precise = info["precise"]
    if precise is not None:
        without = [spec.worker_id for spec in engines if spec.kv_events is None]
        if without:
            _note(
                notes,
                f"router config {precise['key']}: the precise prefix scorer reads KV events, "
                f"but engines {', '.join(without)} list no kv_events endpoint and cannot "
                f"publish to kvEventsConfig.zmqEndpoint {precise['zmq_endpoint']} (see above); "
                "their caches are known only from routed requests",
            )
        for i, spec in enumerate(engines):
            if spec.kv_events is not None and not spec.topic.startswith(precise["topic_filter"]):
                _log.warning(
                    "engines[%d].topic %r does not start with kvEventsConfig.topicFilter %r; "
                    "the gateway subscribes to the engine's own topic",
                    i,
                    spec.topic,
                    precise["topic_filter"],
                )
    wanted_tokenizer = info["tokenizer"]
    if wanted_tokenizer is not None and tokenizer is None:
        tokenizer = _cached_tokenizer(wanted_tokenizer["model"])
        if tokenizer is not None:
            _log.info(
                "router config %s: tokenizing with %r's tokenizer from %s",
                wanted_tokenizer["key"],
                wanted_tokenizer["model"],
                tokenizer,
            )
        else:
            _note(
                notes,
                f"router config {wanted_tokenizer['key']}: the token-producer tokenizes "
                f"prompts with {wanted_tokenizer['model']!r}'s tokenizer, which is not in the "
                "local Hugging Face cache; set `tokenizer` to a directory holding its "
                "tokenizer.json. Until then prompts are hashed as pseudo-tokens, which never "
                "match the engines' KV events",
            )
    header = info["prefill_header"]
    if header is not None:
        section = raw.get("pd") or {}
        if isinstance(section, Mapping) and section.get("enabled") is False:
            raise ConfigError(
                f"pd.enabled: is false but the router config's {header['key']} sets the "
                f"prefill header {header['header']}; remove one"
            )
        if isinstance(section, Mapping) and "header" in section and pd.header != header["header"]:
            raise ConfigError(
                f"pd.header: is {pd.header!r} but the router config's {header['key']} sets "
                f"{header['header']!r} (llm-d's routing sidecar reads it); give it once"
            )
        pd = PdConfig(enabled=True, header=header["header"])
    return block_size, out, engines, tokenizer, pd


def wire_engines(config: GatewayConfig, engines: Iterable[EngineSpec]) -> tuple[EngineSpec, ...]:
    """``engines`` as the router config wires them (engines added later, by discovery or the
    admin API, the way :func:`load_config` wired the first ones): with llm-d's precise prefix
    scorer, an engine without ``kv_events`` publishes to ``kvEventsConfig.zmqEndpoint``."""
    from llmsched.routing import config_info

    return _wire_specs(tuple(engines), config.models, config_info(config.router))


def engine_set(
    config: GatewayConfig, engines: Iterable[EngineSpec], *, allow_empty: bool = False
) -> dict[str, EngineSpec]:
    """A new set of engines (discovery, the admin API) checked and wired as
    :func:`wire_engines` does, by worker id. InvalidTypeError (a TypeError) for an element
    that is not an :class:`~llmsched.integrations.EngineSpec`; ConfigError for a repeated
    set, or an empty one unless ``allow_empty`` (Kubernetes discovery: no Ready pod is no
    engine, where an empty file or admin call is a mistake)."""
    specs: dict[str, EngineSpec] = {}
    for spec in engines:
        if not isinstance(spec, EngineSpec):
            raise InvalidTypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
        if spec.worker_id in specs:
            raise ConfigError(f"engines: {spec.worker_id} is listed twice")
        specs[spec.worker_id] = spec
    if not specs and not allow_empty:
        raise ConfigError("engines: must list at least one engine")
    wired = wire_engines(config, specs.values())
    check_kv_transports(wired, config.data_plane, by_worker=True)
    return {s.worker_id: s for s in wired}


def _wire_specs(
    engines: tuple[EngineSpec, ...], models: tuple[str, ...], info: ConfigInfo
) -> tuple[EngineSpec, ...]:
    """The engine specs as the router config asks (:func:`wire_for_router`)."""
    return wire_for_router(engines, info, models)


def _cached_tokenizer(model: str) -> Path | None:
    """The newest snapshot directory of ``model`` in the local Hugging Face cache that holds a
    ``tokenizer.json`` (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``);
    None when there is none. Nothing is downloaded."""
    hub = os.environ.get("HF_HUB_CACHE")
    if hub is None:
        home = os.environ.get("HF_HOME")
        hub = os.path.join(home, "hub") if home else os.path.expanduser("~/.cache/huggingface/hub")
    snapshots = Path(hub) / f"models--{model.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    found = [d for d in snapshots.iterdir() if (d / "tokenizer.json").is_file()]
    if not found:
        return None
    return max(found, key=lambda d: (d / "tokenizer.json").stat().st_mtime)


def _fit_scrape(
    router: str | Mapping[str, Any], scrape: ScrapeConfig, interval_given: bool, notes: list[str]
) -> ScrapeConfig:
    """The scrape section fitted to the router config's metric staleness thresholds (a
    ``utilization-detector``'s ``metricsStalenessThreshold``, or ``saturationDetector``'s):
    a threshold no longer than the scrape interval makes every engine's metrics older than it
    between two scrapes, so for part of every interval the detector's filter drops them all
    (and, failing open, keeps them all) and flow control counts them saturated. llm-d scrapes
    every 50 ms under its 200 ms default; so, when ``scrape.interval_s`` is not given, the
    interval becomes a quarter of the shortest such threshold (200 ms: 0.05 s, as llm-d's; not
    under 0.01 s); a threshold still no longer than the interval is noted."""
    if not scrape.enabled:
        return scrape
    thresholds = _staleness_thresholds(router)
    if not thresholds:
        return scrape
    shortest = min(seconds for _, _, seconds in thresholds)
    if not interval_given and shortest <= scrape.interval_s:
        interval = max(shortest / 4, _SHORTEST_FITTED_SCRAPE_S)
        scrape = ScrapeConfig(
            enabled=scrape.enabled, interval_s=interval, timeout_s=scrape.timeout_s
        )
    for key, text, seconds in thresholds:
        if seconds <= scrape.interval_s:
            _note(
                notes,
                f"router config {key}: {text} is no longer than the scrape interval "
                f"(scrape.interval_s {scrape.interval_s:g} s): between two scrapes the engines' "
                "metrics are older than it, so for part of every interval the detector drops "
                "them (keeping all, as it fails open) and flow control counts them saturated; "
                "set it above the interval (several intervals, as the default staleness is) "
                "or leave it out"
                + (
                    ", or leave scrape.interval_s out (a quarter of it is used)"
                    if interval_given
                    else ""
                ),
            )
    return scrape


# The shortest scrape interval _fit_scrape sets from a staleness threshold (a shorter
# threshold is noted instead).
_SHORTEST_FITTED_SCRAPE_S = 0.01


def _staleness_thresholds(router: str | Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """The router config's metric staleness thresholds: (key, text as written, seconds) of
    each ``utilization-detector``'s ``metricsStalenessThreshold`` and of
    ``saturationDetector.metricsStalenessThreshold``, read as the core reads them (the config
    has loaded: they are valid)."""
    from llmsched.routing import config_info, load_config

    loaded = load_config(router)
    found: list[tuple[str, str, float]] = []
    written: list[tuple[str, object, dict[str, Any]]] = []
    for i, plugin in enumerate(loaded.get("plugins") or []):
        if not isinstance(plugin, Mapping) or plugin.get("type") != "utilization-detector":
            continue
        params = plugin.get("parameters") or {}
        text = params.get("metricsStalenessThreshold") if isinstance(params, Mapping) else None
        alone = {"plugins": [{"type": "utilization-detector", "parameters": {
            "metricsStalenessThreshold": text}}]}  # fmt: skip
        written.append((f"plugins[{i}].parameters.metricsStalenessThreshold", text, alone))
    detector = loaded.get("saturationDetector")
    if isinstance(detector, Mapping) and detector.get("metricsStalenessThreshold") is not None:
        text = detector["metricsStalenessThreshold"]
        written.append(("saturationDetector.metricsStalenessThreshold", text, dict(loaded)))
    for key, text, alone in written:
        if text is None:
            continue
        saturation = config_info(alone)["saturation"]
        seconds = None if saturation is None else saturation["metrics_staleness_s"]
        if seconds is not None:
            found.append((key, str(text), seconds))
    return found


def _note(notes: list[str], message: str) -> None:
    """A configuration that will route badly: logged (logger ``llmsched``) and kept in
    ``notes`` (:attr:`GatewayConfig.notes`, counted by the gateway's scheduler)."""
    _log.warning("%s", message)
    notes.append(message)


def _json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a YAML / JSON mapping."""
    import json

    copied: dict[str, Any] = json.loads(json.dumps(value))
    return copied


def _merge_saturation(flow: dict[str, Any], saturation: Mapping[str, Any]) -> None:
    """``saturationDetector``'s thresholds into the flow config's ``utilization`` detector; a
    value the flow config sets differently is an error naming both."""
    section = flow.setdefault("saturation", {"type": "utilization"})
    if not isinstance(section, dict) or section.get("type", "utilization") != "utilization":
        raise ConfigError(
            "flow.saturation: the router config's saturationDetector configures the "
            "utilization detector; this flow config uses another"
        )
    for ours, theirs in (
        ("queue_threshold", "queue_depth_threshold"),
        ("kv_threshold", "kv_cache_util_threshold"),
        ("staleness_s", "metrics_staleness_s"),
    ):
        value = saturation[theirs]
        if value is None:
            continue
        if ours in section and section[ours] != value:
            raise ConfigError(
                f"flow.saturation.{ours}: is {section[ours]!r} but the router config's "
                f"saturationDetector sets {value!r}; give it once"
            )
        section[ours] = value


def cluster_sync(config: GatewayConfig, router: Router) -> ClusterSync | None:
    """The replica sync of ``config``'s ``cluster`` section for ``router`` (None when off);
    either data plane starts and stops it. Needs the ``cluster`` extra when on."""
    cluster = config.cluster
    if not cluster.enabled:
        return None
    from llmsched.cluster import ClusterSync

    return ClusterSync(
        router,
        servers=list(cluster.servers),
        cluster=cluster.name,
        replica=cluster.replica,
        flush_s=cluster.flush_s,
        heartbeat_s=cluster.heartbeat_s,
        load_ttl_s=cluster.load_ttl_s,
    )


def read_engines_file(
    path: Path, *, max_bytes: int = DiscoveryConfig.max_bytes
) -> tuple[EngineSpec, ...]:
    """The engines a discovery file lists (ConfigError naming the problem otherwise; a file
    over ``max_bytes`` is refused before it is parsed)."""
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"discovery.file: cannot read {str(path)!r}: {exc}") from None
    if len(data) > max_bytes:
        raise ConfigError(
            f"discovery.file {str(path)!r}: larger than discovery.max_bytes ({max_bytes} bytes)"
        )
    raw = parse_document(data, what="discovery.file", path=path)
    if isinstance(raw, Mapping) and set(raw) == {"engines"}:
        raw = raw["engines"]
    try:
        return _engines(raw)
    except ConfigError as exc:
        raise ConfigError(f"discovery.file {str(path)!r}: {exc}") from None


def _read_yaml(path: Path, what: str) -> Any:
    # Only the keys file is read here: a parser's message must not quote it.
    return read_document(path, what=what, secret=True)


def file_version(path: Path) -> tuple[int, int, int] | None:
    """What tells a rewritten file apart (inode, modification time and size); None if
    unreadable. The inode tells apart a file replaced (renamed over, or a ConfigMap's new
    data) by one of the same size within one tick of the file system's clock, which an
    agent rewriting the file often does."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class DiscoveryErrors:
    """The errors of a discovery watcher (both data planes'), each logged the first time it
    is seen: a file rewritten with the same mistake, or a fault that repeats every interval,
    would flood the log. One that is not a ConfigError (a bug, not a bad file) is logged with
    its traceback."""

    MAX_REMEMBERED = 64
    """Distinct errors remembered as logged (then the memory starts over)."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def log(self, exc: Exception) -> None:
        """Logs ``exc`` (logger ``llmsched``) unless an equal error was logged before."""
        key = f"{type(exc).__name__}: {exc}"
        if key in self._logged:
            _log.debug("discovery: keeping the current engines: %s", key)
            return
        if len(self._logged) >= self.MAX_REMEMBERED:
            self._logged.clear()
        self._logged.add(key)
        if isinstance(exc, ConfigError):
            _log.warning("discovery: keeping the current engines: %s", exc)
        else:
            _log.error("discovery: keeping the current engines: %s", key, exc_info=exc)


def _section(raw: Mapping[str, Any], key: str, name: str | None = None) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name or key}: must be a mapping")
    return dict(value)


def _reject_unknown(section: Mapping[str, Any], prefix: str, known: set[str]) -> None:
    unknown = sorted(set(section) - known, key=str)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")


def _int(
    raw: Mapping[str, Any], key: str, default: int, prefix: str, *, low: int, high: int = 2**31
) -> int:
    value = raw.get(key, default)
    name = f"{prefix}.{key}" if prefix else key
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}: must be an int in {low}..{high}, got {value!r}")
    return value


def _seconds(
    raw: Mapping[str, Any], key: str, default: float | None, prefix: str, *, nullable: bool
) -> float | None:
    value = raw.get(key, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        allowed = " or null" if nullable else ""
        raise ConfigError(
            f"{prefix}.{key}: must be a number of seconds > 0{allowed}, got {value!r}"
        )
    return float(value)


def _bool(raw: Mapping[str, Any], key: str, default: bool, prefix: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        name = f"{prefix}.{key}" if prefix else key
        raise ConfigError(f"{name}: must be true or false, got {value!r}")
    return value


_ENGINE_FORM = "{host: 127.0.0.1, port: 8001} (docs/config-keys.md, `engines` entries)"
"""The shape of one ``engines`` entry, quoted when an entry has another."""


def _engines(value: Any) -> tuple[EngineSpec, ...]:
    if value is not None and not isinstance(value, list):
        raise ConfigError(
            f"engines: must be a list of engines, each a mapping such as {_ENGINE_FORM}; "
            f"got {type(value).__name__} {reprlib.repr(value)}"
        )
    if not value:
        raise ConfigError("engines: must list at least one engine")
    engines = []
    for i, entry in enumerate(value):
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"engines[{i}]: must be a mapping such as {_ENGINE_FORM}; "
                f"got {type(entry).__name__} {reprlib.repr(entry)}"
            )
        try:
            engines.append(EngineSpec.from_dict(entry))
        except (ConfigError, ValueError, TypeError) as exc:
            raise ConfigError(f"engines[{i}]: {exc}") from None
    ids = [e.worker_id for e in engines]
    duplicates = sorted({w for w in ids if ids.count(w) > 1})
    if duplicates:
        raise ConfigError(f"engines: {duplicates[0]} is listed twice")
    return tuple(engines)


def _models(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise ConfigError("models: must list at least one model name")
    return tuple(value)


def _lora_adapters(value: Any, models: tuple[str, ...]) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError("lora_adapters: must map each adapter's name to its base model")
    out: dict[str, str] = {}
    for adapter, base in value.items():
        if not isinstance(adapter, str) or not adapter or not isinstance(base, str):
            raise ConfigError("lora_adapters: must map each adapter's name to its base model")
        if adapter in models:
            raise ConfigError(f"lora_adapters: {adapter!r} is also a model in models")
        if base not in models:
            raise ConfigError(f"lora_adapters: {adapter!r}'s base model {base!r} is not in models")
        out[adapter] = base
    return out


def _tokenizer(value: Any, base: Path) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError("tokenizer: must be a directory path or null")
    path = base / value
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer: {str(path)!r} holds no tokenizer.json")
    return path


def _listen(raw: dict[str, Any]) -> ListenConfig:
    _reject_unknown(raw, "listen", {"host", "port"})
    host = raw.get("host", ListenConfig.host)
    if not isinstance(host, str) or not host:
        raise ConfigError(f"listen.host: must be a host name or address, got {host!r}")
    return ListenConfig(
        host=host, port=_int(raw, "port", ListenConfig.port, "listen", low=0, high=65535)
    )


def _auth(raw: dict[str, Any], base: Path) -> AuthConfig:
    _reject_unknown(raw, "auth", {"api_keys", "api_keys_file", "api_keys_env"})
    keys = _api_keys(raw.get("api_keys"), "auth.api_keys")
    file = raw.get("api_keys_file")
    if file is not None:
        if not isinstance(file, str):
            raise ConfigError("auth.api_keys_file: must be a path")
        path = base / file
        if not path.is_file():
            raise ConfigError(f"auth.api_keys_file: {str(path)!r} does not exist")
        keys.update(_api_keys(_read_yaml(path, "auth.api_keys_file"), "auth.api_keys_file"))
    env = raw.get("api_keys_env")
    if env is not None:
        if not isinstance(env, str) or not env:
            raise ConfigError("auth.api_keys_env: must name an environment variable")
        text = os.environ.get(env)
        if text is None:
            raise ConfigError(f"auth.api_keys_env: environment variable {env} is not set")
        try:
            loaded = parse_document(text, what=f"auth.api_keys_env ({env})")
        except ConfigError:
            # The variable holds keys: the parser's message could quote one.
            raise ConfigError(f"auth.api_keys_env: {env} is not a YAML / JSON mapping") from None
        keys.update(_api_keys(loaded, f"auth.api_keys_env ({env})"))
    return AuthConfig(api_keys=keys)


# The integer ranges of the native plane's fields (serde refuses anything outside them).
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_U64_MAX = 2**64 - 1


def _api_keys(value: Any, where: str) -> dict[str, ApiKey]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must map API keys to {{tenant, priority}}")
    keys = {}
    for key, spec in value.items():
        # Keys are secrets: an error names the tenant, never the key itself.
        if not isinstance(key, str) or len(key) < 8:
            raise ConfigError(f"{where}: every key must be a str of at least 8 characters")
        if not _PRESENTABLE_KEY.fullmatch(key):
            # A client sends the key in a header: the native plane reads only visible ASCII
            # there (a key with an accented letter worked on one plane only), and both planes
            # trim the ends (a key with a space at an end matched nothing).
            tenant = spec.get("tenant") if isinstance(spec, Mapping) else None
            owner = f" (tenant {tenant!r})" if isinstance(tenant, str) else ""
            raise ConfigError(
                f"{where}: a key{owner} must be visible ASCII (spaces inside only): "
                "clients send it in an HTTP header"
            )
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: the entry of each key must be a mapping")
        known = {"tenant", "priority", "max_concurrent", *_LIMIT_FIELDS}
        unknown = sorted(set(spec) - known, key=str)
        if unknown:
            raise ConfigError(
                f"{where}.<key>.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})"
            )
        tenant = spec.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{where}.<key>.tenant: must be a non-empty str")
        # The native plane holds a key's priority as i32 and max_concurrent as u64: a value
        # outside them is this file's mistake, named here, not each request's (a 400) or a
        # serde message naming no key at start-up.
        priority = spec.get("priority", 0)
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not _I32_MIN <= priority <= _I32_MAX
        ):
            raise ConfigError(
                f"{where}.<key {tenant}>.priority: must be an int in {_I32_MIN}..{_I32_MAX}, "
                f"got {priority!r}"
            )
        limits: dict[str, Any] = {}
        for name in _LIMIT_FIELDS:
            value = spec.get(name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and 0 < value < 1e12):
                raise ConfigError(
                    f"{where}.<key {tenant}>.{name}: must be a number > 0 or null, got {value!r}"
                )
            limits[name] = None if value is None else float(value)
        concurrent = spec.get("max_concurrent")
        if concurrent is not None and (
            isinstance(concurrent, bool)
            or not isinstance(concurrent, int)
            or not 1 <= concurrent <= _U64_MAX
        ):
            raise ConfigError(
                f"{where}.<key {tenant}>.max_concurrent: must be an int in 1..{_U64_MAX} or "
                f"null, got {concurrent!r}"
            )
        keys[key] = ApiKey(tenant=tenant, priority=priority, max_concurrent=concurrent, **limits)
    return keys


def _admin(raw: dict[str, Any]) -> AdminConfig:
    _reject_unknown(raw, "admin", {"token", "token_env"})
    token = raw.get("token")
    env = raw.get("token_env")
    if token is not None and env is not None:
        raise ConfigError("admin: give either token or token_env, not both")
    if env is not None:
        if not isinstance(env, str) or not env:
            raise ConfigError("admin.token_env: must name an environment variable")
        token = os.environ.get(env)
        if token is None:
            raise ConfigError(f"admin.token_env: environment variable {env} is not set")
    # A secret: errors never show it.
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise ConfigError("admin.token: must be a str of at least 16 characters")
    return AdminConfig(token=token)


def _cluster(raw: dict[str, Any]) -> ClusterConfig:
    d = ClusterConfig()
    _reject_unknown(raw, "cluster", set(d.__dataclass_fields__))
    servers = raw.get("servers", [])
    if isinstance(servers, str):
        servers = [servers]
    if not isinstance(servers, list) or not all(
        isinstance(u, str) and u.startswith(("nats://", "tls://")) for u in servers
    ):
        raise ConfigError("cluster.servers: must be a list of nats:// URLs")
    name = raw.get("name", d.name)
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(f"cluster.name: must be letters, digits, '-' or '_', got {name!r}")
    replica = raw.get("replica")
    if replica is not None and (not isinstance(replica, str) or not replica):
        raise ConfigError("cluster.replica: must be a non-empty name (default host and pid)")
    heartbeat = _required_seconds(raw, "heartbeat_s", d.heartbeat_s, "cluster")
    load_ttl = _required_seconds(raw, "load_ttl_s", d.load_ttl_s, "cluster")
    if load_ttl <= heartbeat:
        raise ConfigError("cluster.load_ttl_s: must exceed cluster.heartbeat_s")
    return ClusterConfig(
        servers=tuple(servers),
        name=name,
        replica=replica,
        flush_s=_required_seconds(raw, "flush_s", d.flush_s, "cluster"),
        heartbeat_s=heartbeat,
        load_ttl_s=load_ttl,
    )


def _limits(raw: dict[str, Any]) -> LimitsConfig:
    d = LimitsConfig()
    _reject_unknown(raw, "limits", set(d.__dataclass_fields__))
    max_body = _int(raw, "max_body_bytes", d.max_body_bytes, "limits", low=1024)
    in_flight = _int(
        raw, "max_body_bytes_in_flight", d.max_body_bytes_in_flight, "limits", low=1024, high=2**48
    )
    if in_flight < max_body:
        given = "" if "max_body_bytes_in_flight" in raw else " (the default)"
        raise ConfigError(
            f"limits.max_body_bytes_in_flight: must be at least limits.max_body_bytes "
            f"({max_body}), got {in_flight}{given}: a body of the largest size would never fit"
        )
    return LimitsConfig(
        max_body_bytes=max_body,
        max_body_bytes_in_flight=in_flight,
        max_field_size=_int(raw, "max_field_size", d.max_field_size, "limits", low=256),
        max_line_size=_int(raw, "max_line_size", d.max_line_size, "limits", low=256),
        max_headers=_int(raw, "max_headers", d.max_headers, "limits", low=8, high=10_000),
        retry_after_s=_int(raw, "retry_after_s", d.retry_after_s, "limits", low=0),
        body_timeout_s=_required_seconds(raw, "body_timeout_s", d.body_timeout_s, "limits"),
        idle_timeout_s=_required_seconds(raw, "idle_timeout_s", d.idle_timeout_s, "limits"),
        max_connections=_int(
            raw, "max_connections", d.max_connections, "limits", low=1, high=1_000_000
        ),
        max_tenants=_int(raw, "max_tenants", d.max_tenants, "limits", low=1, high=10_000_000),
        tenant_idle_s=_required_seconds(raw, "tenant_idle_s", d.tenant_idle_s, "limits"),
    )


def _required_seconds(raw: Mapping[str, Any], key: str, default: float, prefix: str) -> float:
    value = _seconds(raw, key, default, prefix, nullable=False)
    assert value is not None
    return value


def _health(raw: dict[str, Any]) -> HealthConfig:
    d = HealthConfig()
    _reject_unknown(raw, "health", set(d.__dataclass_fields__))
    path = raw.get("path", d.path)
    if not isinstance(path, str) or not path.startswith("/") or not path.isascii() or " " in path:
        raise ConfigError(f"health.path: must be a URL path starting with /, got {path!r}")
    rate = raw.get("breaker_failure_rate", d.breaker_failure_rate)
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1
    ):
        raise ConfigError(
            f"health.breaker_failure_rate: must be a number in (0, 1] or null, got {rate!r}"
        )
    return HealthConfig(
        path=path,
        interval_s=_seconds(raw, "interval_s", d.interval_s, "health", nullable=True),
        timeout_s=_required_seconds(raw, "timeout_s", d.timeout_s, "health"),
        unhealthy_threshold=_int(
            raw, "unhealthy_threshold", d.unhealthy_threshold, "health", low=1, high=100
        ),
        healthy_threshold=_int(
            raw, "healthy_threshold", d.healthy_threshold, "health", low=1, high=100
        ),
        failures_to_probe=_int(
            raw, "failures_to_probe", d.failures_to_probe, "health", low=1, high=10_000
        ),
        breaker_window_s=_required_seconds(raw, "breaker_window_s", d.breaker_window_s, "health"),
        breaker_min_requests=_int(
            raw, "breaker_min_requests", d.breaker_min_requests, "health", low=1, high=1_000_000
        ),
        breaker_failure_rate=None if rate is None else float(rate),
        breaker_open_s=_required_seconds(raw, "breaker_open_s", d.breaker_open_s, "health"),
    )


def _retries(raw: dict[str, Any]) -> RetriesConfig:
    d = RetriesConfig()
    _reject_unknown(raw, "retries", set(d.__dataclass_fields__))
    eject = _seconds(raw, "eject_s", d.eject_s, "retries", nullable=False)
    assert eject is not None
    return RetriesConfig(
        max_attempts=_int(raw, "max_attempts", d.max_attempts, "retries", low=1, high=100),
        eject_s=eject,
        on_5xx=_bool(raw, "on_5xx", d.on_5xx, "retries"),
    )


def _timeouts(raw: dict[str, Any]) -> TimeoutsConfig:
    d = TimeoutsConfig()
    _reject_unknown(raw, "timeouts", set(d.__dataclass_fields__))
    return TimeoutsConfig(
        connect_s=_seconds(raw, "connect_s", d.connect_s, "timeouts", nullable=True),
        read_s=_seconds(raw, "read_s", d.read_s, "timeouts", nullable=True),
        total_s=_seconds(raw, "total_s", d.total_s, "timeouts", nullable=True),
    )


def _scrape(raw: dict[str, Any]) -> ScrapeConfig:
    d = ScrapeConfig()
    _reject_unknown(raw, "scrape", set(d.__dataclass_fields__))
    interval = _seconds(raw, "interval_s", d.interval_s, "scrape", nullable=False)
    timeout = _seconds(raw, "timeout_s", d.timeout_s, "scrape", nullable=False)
    assert interval is not None and timeout is not None
    return ScrapeConfig(
        enabled=_bool(raw, "enabled", d.enabled, "scrape"), interval_s=interval, timeout_s=timeout
    )


def _discovery(raw: dict[str, Any], base: Path) -> DiscoveryConfig:
    d = DiscoveryConfig()
    _reject_unknown(raw, "discovery", set(d.__dataclass_fields__))
    interval = _seconds(raw, "interval_s", d.interval_s, "discovery", nullable=False)
    assert interval is not None
    max_bytes = _int(raw, "max_bytes", d.max_bytes, "discovery", low=1024, high=1 << 30)
    grace = _seconds(raw, "left_grace_s", d.left_grace_s, "discovery", nullable=True)
    file = raw.get("file")
    kubernetes = None
    if raw.get("kubernetes") is not None:
        kubernetes = _kubernetes(_section(raw, "kubernetes", "discovery.kubernetes"), base)
        if file is not None:
            raise ConfigError(
                "discovery: give either discovery.file or discovery.kubernetes, not both"
            )
    if file is None:
        return DiscoveryConfig(
            interval_s=interval, max_bytes=max_bytes, left_grace_s=grace, kubernetes=kubernetes
        )
    if not isinstance(file, (str, os.PathLike)) or not str(file):
        raise ConfigError(f"discovery.file: must be a path, got {file!r}")
    path = Path(file)
    return DiscoveryConfig(
        file=path if path.is_absolute() else base / path,
        interval_s=interval,
        max_bytes=max_bytes,
        left_grace_s=grace,
    )


def _kubernetes(raw: dict[str, Any], base: Path) -> KubernetesConfig:
    prefix = "discovery.kubernetes"
    _reject_unknown(raw, prefix, set(KubernetesConfig.__dataclass_fields__))
    for key in ("namespace", "selector", "target_port"):
        if key not in raw:
            raise ConfigError(f"{prefix}.{key}: required")
    _pod_selector({k: raw[k] for k in _SELECTOR_KEYS if k in raw}, prefix)  # its own checks
    seconds = {
        key: _required_seconds(raw, key, getattr(KubernetesConfig, key), prefix)
        for key in _WATCH_SECONDS
    }
    if seconds["backoff_max_s"] < seconds["backoff_initial_s"]:
        raise ConfigError(f"{prefix}.backoff_max_s: must be at least {prefix}.backoff_initial_s")
    settle = raw.get("settle_s", KubernetesConfig.settle_s)
    if isinstance(settle, bool) or not isinstance(settle, (int, float)) or not 0 <= settle < 1e9:
        raise ConfigError(f"{prefix}.settle_s: must be a number of seconds >= 0, got {settle!r}")
    kubeconfig = raw.get("kubeconfig")
    path = None
    if kubeconfig is not None:
        if not isinstance(kubeconfig, (str, os.PathLike)) or not str(kubeconfig):
            raise ConfigError(f"{prefix}.kubeconfig: must be a path, got {kubeconfig!r}")
        path = base / kubeconfig
        if not path.is_file():
            raise ConfigError(f"{prefix}.kubeconfig: {str(path)!r} does not exist")
    selector = raw["selector"]
    return KubernetesConfig(
        namespace=raw["namespace"],
        selector=selector if isinstance(selector, str) else dict(selector),
        target_port=raw["target_port"],
        role_label=raw.get("role_label"),
        kv_events_port=raw.get("kv_events_port"),
        replay_port=raw.get("replay_port"),
        topic=raw.get("topic", KubernetesConfig.topic),
        model=raw.get("model"),
        labels=dict(raw.get("labels") or {}),
        kubeconfig=path,
        settle_s=float(settle),
        **seconds,
    )


def _pod_selector(fields: Mapping[str, Any], prefix: str) -> PodSelector:
    """``PodSelector(**fields)``, its ConfigError naming the key under ``prefix``; a missing
    ``kubernetes`` extra is a ConfigError saying what to install."""
    try:
        from llmsched.integrations.kubernetes import PodSelector
    except ImportError as exc:
        raise ConfigError(f"{prefix}: {exc}") from None
    try:
        return PodSelector(**fields)
    except ConfigError as exc:
        raise ConfigError(_under(prefix, str(exc), fields)) from None


def _under(prefix: str, message: str, keys: Iterable[str]) -> str:
    """``message`` of a check that names its key first (``"target_port must be ..."``,
    ``"selector: ..."``) as ``"<prefix>.<key>: ..."``."""
    for key in keys:
        for separator in (": ", " "):
            if message.startswith(key + separator):
                return f"{prefix}.{key}: {message[len(key) + len(separator) :]}"
    return f"{prefix}: {message}"


def _index(raw: dict[str, Any]) -> IndexConfig:
    d = IndexConfig()
    _reject_unknown(raw, "index", set(d.__dataclass_fields__))
    max_bytes, capacity = raw.get("max_bytes", d.max_bytes), raw.get("worker_capacity")
    return IndexConfig(
        max_bytes=None
        if max_bytes is None
        else _int(raw, "max_bytes", max_bytes, "index", low=1 << 20, high=1 << 50),
        worker_capacity=None
        if capacity is None
        else _int(raw, "worker_capacity", 0, "index", low=1, high=1 << 40),
    )


def gateway_index(config: GatewayConfig) -> PrefixIndex:
    """The prefix index a gateway of ``config`` routes on: its block size, bounded by its
    ``index`` section (``worker_capacity`` defaulting to the router config's)."""
    from llmsched.prefix_index import PrefixIndex
    from llmsched.routing import config_info

    capacity = config.index.worker_capacity
    if capacity is None:
        capacity = config_info(config.router)["worker_capacity"]
    return PrefixIndex(
        config.block_size, worker_capacity=capacity, max_bytes=config.index.max_bytes
    )


def _pd(raw: dict[str, Any]) -> PdConfig:
    d = PdConfig()
    _reject_unknown(raw, "pd", set(d.__dataclass_fields__))
    header = raw.get("header", d.header)
    if not isinstance(header, str) or not _HEADER_NAME.fullmatch(header):
        raise ConfigError(f"pd.header: must be an HTTP header name, got {header!r}")
    if header.lower() in _GATEWAY_HEADERS:
        # The python plane would send a Content-Length of "host:port" (a 500 for every split
        # request) or a body framed twice; the native plane dropped the header silently.
        raise ConfigError(
            f"pd.header: {header!r} frames or routes the request the gateway sends itself; "
            "name another header"
        )
    return PdConfig(enabled=_bool(raw, "enabled", d.enabled, "pd"), header=header.lower())


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", re.ASCII)
"""An HTTP header name (RFC 9110's token)."""

_PRESENTABLE_KEY = re.compile(r"[!-~](?:[ -~]*[!-~])?", re.ASCII)
"""An API key a client can present: visible ASCII, spaces inside only."""

_GATEWAY_HEADERS = frozenset(
    {
        "accept",
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "expect",
        "host",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers the gateway sets on (or that frame) the request it sends to an engine."""


def _slices(raw: dict[str, Any]) -> SlicesConfig:
    d = SlicesConfig()
    _reject_unknown(raw, "slices", set(d.__dataclass_fields__))
    policy = raw.get("policy", d.policy)
    params = raw.get("params") or {}
    if not isinstance(policy, str):
        raise ConfigError(f"slices.policy: must be a policy name, got {policy!r}")
    if not isinstance(params, Mapping):
        raise ConfigError("slices.params: must be a mapping")
    from llmsched.slices import SliceTracker

    try:
        SliceTracker(policy, params)
    except ConfigError as exc:
        raise ConfigError(f"slices: {exc}") from None
    return SlicesConfig(
        enabled=_bool(raw, "enabled", d.enabled, "slices"),
        policy=policy,
        params=dict(params),
        default_max_tokens=_int(
            raw, "default_max_tokens", d.default_max_tokens, "slices", low=1, high=2**31
        ),
    )
