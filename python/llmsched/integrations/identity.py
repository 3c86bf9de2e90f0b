"""Engine identity: the one mapping from an engine to the worker id that the prefix index, the
endpoint pool, the flow controller, the metrics scraper and the KV-event subscriber share.

An engine's worker id is its ``name`` when it has one, else ``host:port`` (plus ``/dp<rank>``).
:func:`resolve_engines` names the unnamed engines after the pool's endpoint at the same
address, so an endpoint the user named (``Endpoint("engine-a", address="10.0.0.7:8000")``) is
the one every component feeds, never a second copy keyed by its address; a genuine conflict
(two endpoints at one address, a name whose endpoint is elsewhere) raises ConfigError.

>>> from llmsched.integrations import EngineSpec, worker_id
>>> worker_id("10.0.0.7", 8000), worker_id("10.0.0.7", 8000, dp_rank=1)
('10.0.0.7:8000', '10.0.0.7:8000/dp1')
>>> spec = EngineSpec.from_dict({"host": "10.0.0.7", "port": 8000,
...                              "kv_events": "tcp://10.0.0.7:5557", "topic": "kv@tiny"})
>>> spec.worker_id, spec.base_url
('10.0.0.7:8000', 'http://10.0.0.7:8000')
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmsched.errors import ConfigError, InvalidTypeError
from llmsched.validation import is_utf8_text, normal_address

if TYPE_CHECKING:
    from llmsched.routing import EndpointId, EndpointPool
    from llmsched.types import ConfigInfo

log = logging.getLogger("llmsched")

__all__ = [
    "ENDPOINT_SCHEMES",
    "ROLES",
    "EngineSpec",
    "endpoint_problem",
    "normal_address",
    "resolve_engines",
    "wire_for_router",
    "worker_id",
]

ROLES = ("prefill", "decode", "both")
"""Values of :attr:`EngineSpec.role` besides None (unlabelled: serves both)."""

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
"""ZMQ transports accepted for the KV-event and replay endpoints."""


def _host_part(host: str) -> str:
    # IPv6 literals are bracketed so that "host:port" stays unambiguous.
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _check_host(host: object) -> str:
    if isinstance(host, str) and "://" in host:
        # A URL where a host belongs: the scheme and port have keys of their own.
        raise ConfigError(
            f"host must be a host name or address without a scheme, got {host!r} "
            "(an engine at http://10.0.0.7:8000 is host: 10.0.0.7, port: 8000)"
        )
    if not isinstance(host, str) or not host or host != host.strip() or "/" in host:
        raise ConfigError(f"host must be a non-empty host name or address, got {host!r}")
    if ":" in host:
        # Only an IPv6 address has colons; "10.0.0.7:8000" became "[10.0.0.7:8000]:8000".
        try:
            ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise ConfigError(
                f"host {host!r} is not a host name or address (a port goes in port)"
            ) from None
    return host


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"port must be an int in 1..65535, got {port!r}")
    return port


def _check_dp_rank(dp_rank: object) -> int:
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise ConfigError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
    return dp_rank


def worker_id(host: str, port: int, dp_rank: int = 0) -> str:
    """The worker id of an engine: ``"host:port"`` for data-parallel rank 0, else
    ``"host:port/dp<rank>"``. Raises ConfigError (a ValueError) naming a bad field.

    >>> worker_id("::1", 8000, 2)
    '[::1]:8000/dp2'
    >>> worker_id("h", 0)
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: port must be an int in 1..65535, got 0
    """
    base = f"{_host_part(_check_host(host))}:{_check_port(port)}"
    rank = _check_dp_rank(dp_rank)
    return base if rank == 0 else f"{base}/dp{rank}"


def _check_endpoint(name: str, endpoint: object, *, bind: bool = False) -> None:
    if endpoint is None:
        return
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        raise ConfigError(
            f"{name} must be a ZMQ endpoint starting with one of {ENDPOINT_SCHEMES}, "
            f"got {endpoint!r}"
        )
    problem = endpoint_problem(endpoint, bind=bind)
    if problem is not None:
        raise ConfigError(f"{name} {endpoint!r} {problem}")


_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def endpoint_problem(endpoint: str, *, bind: bool = False) -> str | None:
    """Why a ZMQ endpoint can never be bound (``bind``) or connected to, or None. A ``tcp://``
    host is ``*``, an IPv4 address, an IPv6 address in brackets or a host name (letters,
    digits, ``-`` and ``_`` in dot-separated labels); its port is 1..65535 (0 or ``*`` to bind
    any free port). Whether the host resolves, or the port is free, is known only when the
    socket is opened (a failure then is logged and retried, see
    :class:`~llmsched.integrations.KVEventSubscriber`). The native feed checks the same rules
    (``llmsched_gateway::kv_events::endpoint_problem``).

    >>> endpoint_problem("tcp://10.0.0.7:5557"), endpoint_problem("tcp://*:5557", bind=True)
    (None, None)
    >>> endpoint_problem("tcp://999.1.1.1:5")
    "has an invalid host: '999.1.1.1' is not an IPv4 address"
    >>> endpoint_problem("tcp://127.0.0.1:70000")
    'has an invalid port: 70000 is not in 1..65535'
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None if rest else "names no address"
    if ":" not in rest:
        return "has no port"
    host, _, port = rest.rpartition(":")
    if port != "*":
        lowest = 0 if bind else 1
        if not (port.isascii() and port.isdigit()) or not lowest <= int(port) <= 65535:
            return f"has an invalid port: {port} is not in {lowest}..65535"
    problem = _host_problem(host)
    return None if problem is None else f"has an invalid host: {problem}"


def _host_problem(host: str) -> str | None:
    if host == "*":
        return None  # any address (refused where the endpoint is connected to)
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        if "%" in host:
            return f"{host!r} has a zone index, which the native feed cannot take"
        return None
    if not host:
        return "it is empty"
    if all(c.isdigit() or c == "." for c in host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address"
        return None
    if ":" in host or "[" in host or "]" in host:
        return f"{host!r}: an IPv6 address is written in brackets, as tcp://[::1]:5557"
    labels = host.split(".")
    if len(host) > 253 or not all(label.isascii() and _LABEL.fullmatch(label) for label in labels):
        return f"{host!r} is not a host name"
    return None


@dataclass(frozen=True)
class EngineSpec:
    """One engine (one data-parallel rank): where its HTTP API, metrics and KV events are.

    Attributes:
        host, port: the engine's HTTP address (OpenAI API and ``/metrics``).
        dp_rank: its data-parallel rank (each rank publishes its own KV events).
        model: the served model name (None: any).
        role: ``"prefill"``, ``"decode"``, ``"both"`` or None.
        kv_events: the ZMQ endpoint of its KV-event publisher (``tcp://host:port``; one
            that can never work, see :func:`endpoint_problem`, is refused here).
        kv_events_bind: True when the subscriber binds ``kv_events`` (vLLM given an endpoint
            without ``*`` connects to it); False when the subscriber connects.
        replay: the ZMQ endpoint of its replay ROUTER socket (the subscriber connects).
        topic: the topic it publishes with; messages with any other topic are refused.
        metrics_path: the path of its Prometheus metrics.
        labels: free-form labels (copied to the router's endpoint).
        name: its worker id, when the user names it (e.g. ``"engine-a"``); None: the
            address-based :func:`worker_id`.

    >>> EngineSpec("10.0.0.7", 8000, role="decode").role
    'decode'
    >>> EngineSpec("10.0.0.7", 8000, role="leader")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: role must be one of ... got 'leader'
    """

    host: str
    port: int
    dp_rank: int = 0
    model: str | None = None
    role: str | None = None
    kv_events: str | None = None
    kv_events_bind: bool = False
    replay: str | None = None
    topic: str = ""
    metrics_path: str = "/metrics"
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError(f"name must be a non-empty str or None, got {self.name!r}")
        _check_host(self.host)
        _check_port(self.port)
        _check_dp_rank(self.dp_rank)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a non-empty str or None, got {self.model!r}")
        if self.role is not None and self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES} or None, got {self.role!r}")
        if not isinstance(self.kv_events_bind, bool):
            raise ConfigError(f"kv_events_bind must be a bool, got {self.kv_events_bind!r}")
        _check_endpoint("kv_events", self.kv_events, bind=self.kv_events_bind)
        _check_endpoint("replay", self.replay)
        if self.kv_events is not None and not self.kv_events_bind and "*" in self.kv_events:
            raise ConfigError(
                f"kv_events {self.kv_events!r} is a wildcard: a subscriber that connects needs "
                "the engine's address (or set kv_events_bind to bind it)"
            )
        if self.replay is not None and "*" in self.replay:
            raise ConfigError(f"replay {self.replay!r} is a wildcard; give the engine's address")
        if self.replay is not None and self.kv_events is None:
            raise ConfigError("replay is set but kv_events is not")
        if not isinstance(self.topic, str):
            raise ConfigError(f"topic must be a str, got {self.topic!r}")
        if not isinstance(self.metrics_path, str) or not self.metrics_path.startswith("/"):
            raise ConfigError(f"metrics_path must start with '/', got {self.metrics_path!r}")
        if not isinstance(self.labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise ConfigError(f"labels must map str to str, got {self.labels!r}")
        # A lone surrogate (``"\\ud800"`` in a JSON entry, as the admin API takes it) is no
        # text the router, the metrics or the native plane can hold: refused here, by name,
        # rather than by the engine set after (an admin call's 500).
        texts = {"host": self.host, "name": self.name, "model": self.model, "topic": self.topic}
        texts["metrics_path"] = self.metrics_path
        texts.update((f"labels[{k[:40]!a}]", f"{k}{v}") for k, v in self.labels.items())
        for key, text in texts.items():
            if text is not None and not is_utf8_text(text):
                raise ConfigError(f"{key} holds a lone surrogate escape, not UTF-8 text")
        # A private copy: a caller's later change to its dict must not reach a frozen spec.
        object.__setattr__(self, "labels", dict(self.labels))

    @property
    def worker_id(self) -> str:
        """Its :attr:`name`, else :func:`worker_id` of its address and rank.

        >>> EngineSpec("h", 80, name="engine-a").worker_id
        'engine-a'
        """
        if self.name is not None:
            return self.name
        return worker_id(self.host, self.port, self.dp_rank)

    @property
    def address(self) -> str:
        """``host:port``, the form of :attr:`Endpoint.address <llmsched.Endpoint.address>`.

        >>> EngineSpec("::1", 8000).address
        '[::1]:8000'
        """
        return f"{_host_part(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://host:port``."""
        return f"http://{_host_part(self.host)}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The URL of its Prometheus metrics.

        >>> EngineSpec("h", 80).metrics_url
        'http://h:80/metrics'
        """
        return self.base_url + self.metrics_path

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSpec:
        """An EngineSpec from its config-file form (keys as the attributes). An unknown or
        missing key raises ConfigError naming it.

        >>> EngineSpec.from_dict({"host": "h", "port": 8000, "replicas": 2})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        llmsched.errors.ConfigError: unknown engine key 'replicas' (known: host, port, ...)
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"an engine must be a mapping, got {type(d).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                raise ConfigError(f"unknown engine key {key!r} (known: {', '.join(known)})")
        for key in ("host", "port"):
            if key not in d:
                raise ConfigError(f"engine {dict(d)!r} has no {key!r}")
        return cls(**dict(d))


def resolve_engines(engines: Iterable[EngineSpec], pool: EndpointPool) -> list[EngineSpec]:
    """``engines`` with each unnamed one named after the pool endpoint at its address.

    An engine whose address-based worker id is already a pool endpoint keeps it, as does one
    whose address no endpoint has (it is new to the pool). A named engine must not contradict
    the pool: its endpoint's address, when set, must be the engine's. Raises ConfigError naming
    the conflict: several endpoints at an unnamed engine's address (data-parallel ranks: name
    each engine), or two engines resolving to one endpoint.

    >>> from llmsched import Endpoint, EndpointPool
    >>> pool = EndpointPool([Endpoint("engine-a", address="10.0.0.7:8000")])
    >>> [e.worker_id for e in resolve_engines([EngineSpec("10.0.0.7", 8000)], pool)]
    ['engine-a']
    """
    by_address: dict[str, list[EndpointId]] = {}
    addresses: dict[EndpointId, str] = {}
    for e in pool.endpoints():
        if e["address"]:
            address = normal_address(e["address"])
            by_address.setdefault(address, []).append(e["id"])
            addresses[e["id"]] = address
    out = []
    for spec in engines:
        if not isinstance(spec, EngineSpec):
            raise InvalidTypeError(f"engines must be EngineSpec, got {type(spec).__name__}")
        spec_address = normal_address(spec.address)
        there = by_address.get(spec_address, [])
        if spec.name is not None:
            if spec.name in addresses and addresses[spec.name] != spec_address:
                raise ConfigError(
                    f"engine {spec.name!r} is at {spec.address} but the pool's endpoint "
                    f"{spec.name!r} is at {addresses[spec.name]}"
                )
            out.append(spec)
            continue
        if spec.worker_id in addresses or not there:
            out.append(spec)  # already keyed by its address, or new to the pool
            continue
        if len(there) > 1:
            raise ConfigError(
                f"engine at {spec.address} matches several pool endpoints "
                f"({', '.join(map(repr, there))}); give the engine a name"
            )
        if not isinstance(there[0], str):
            raise ConfigError(
                f"engine at {spec.address} matches the pool endpoint {there[0]!r}, whose id is "
                "not a str; give the endpoint a str id or the engine a name"
            )
        out.append(dataclasses.replace(spec, name=there[0]))
    seen: dict[str, EngineSpec] = {}
    for spec in out:
        if spec.worker_id in seen:
            raise ConfigError(
                f"engines at {seen[spec.worker_id].address} (rank {seen[spec.worker_id].dp_rank})"
                f" and {spec.address} (rank {spec.dp_rank}) both resolve to endpoint "
                f"{spec.worker_id!r}; name each engine"
            )
        seen[spec.worker_id] = spec
    return out


def wire_for_router(
    engines: tuple[EngineSpec, ...], info: ConfigInfo, models: tuple[str, ...] = ()
) -> tuple[EngineSpec, ...]:
    """The engine specs as a router config (its :func:`llmsched.routing.config_info`) asks: with
    llm-d's precise prefix scorer, KV events to ``kvEventsConfig.zmqEndpoint`` for engines
    without their own; with a ``metrics-data-source``, its ``path`` as the metrics path of
    engines that keep the default one. ``models`` are the models served, for the topic of an
    engine that names none. The gateway and :class:`llmsched.Scheduler` both wire engines
    this way, so an llm-d config means the same to either."""

    metrics = info["metrics_source"]
    if metrics is not None:
        engines = tuple(
            dataclasses.replace(spec, metrics_path=metrics["path"])
            if spec.metrics_path == "/metrics"
            else spec
            for spec in engines
        )
    precise = info["precise"]
    return engines if precise is None else _shared_kv_events(engines, models, precise)


def _shared_kv_events(
    engines: tuple[EngineSpec, ...], models: tuple[str, ...], precise: Mapping[str, Any]
) -> tuple[EngineSpec, ...]:
    """Engines without their own ``kv_events`` publish to ``kvEventsConfig.zmqEndpoint``, which
    the subscriber binds once for all of them (llm-d's layout: every vLLM pod connects there and
    publishes as ``kv@<pod-ip>@<model>``); their topic, when not set, is that one, with the
    engine's ``model`` or the gateway's only model. With ``discoverPods`` llm-d connects to
    each pod instead, which here is an engine's own ``kv_events``."""

    if precise["discover_pods"]:
        return engines
    endpoint = precise["zmq_endpoint"]
    out = []
    for i, spec in enumerate(engines):
        if spec.kv_events is not None:
            out.append(spec)
            continue
        topic = spec.topic
        model = spec.model or (models[0] if len(models) == 1 else None)
        if not topic and model is None:
            log.warning(
                "engines[%d] (%s): cannot publish to kvEventsConfig.zmqEndpoint %s: its topic "
                "is llm-d's %s<pod-ip>@<model> but the engine names no model and the gateway "
                "serves several; set the engine's topic (or model)",
                i,
                spec.worker_id,
                endpoint,
                precise["topic_filter"],
            )
            out.append(spec)
            continue
        if spec.dp_rank != 0:
            log.warning(
                "engines[%d] (%s): data-parallel rank %d publishes on its own port; give it "
                "its own kv_events",
                i,
                spec.worker_id,
                spec.dp_rank,
            )
            out.append(spec)
            continue
        if not topic:
            topic = f"{precise['topic_filter']}{spec.host}@{model}"
        out.append(dataclasses.replace(spec, kv_events=endpoint, kv_events_bind=True, topic=topic))
    return tuple(out)
