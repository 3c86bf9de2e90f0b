"""Engine identity: the one mapping from an engine (host, port, data-parallel rank) to the worker
id that the prefix index, the endpoint pool, the flow controller and the metrics scraper share.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmsched.errors import ConfigError

__all__ = ["ENDPOINT_SCHEMES", "ROLES", "EngineSpec", "worker_id"]

ROLES = ("prefill", "decode", "both")
"""Values of :attr:`EngineSpec.role` besides None (unlabelled: serves both)."""

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
"""ZMQ transports accepted for the KV-event and replay endpoints."""


def _host_part(host: str) -> str:
    # IPv6 literals are bracketed so that "host:port" stays unambiguous.
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _check_host(host: object) -> str:
    if not isinstance(host, str) or not host or host != host.strip() or "/" in host:
        raise ConfigError(f"host must be a non-empty host name or address, got {host!r}")
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


def _check_endpoint(name: str, endpoint: object) -> None:
    if endpoint is None:
        return
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        raise ConfigError(
            f"{name} must be a ZMQ endpoint starting with one of {ENDPOINT_SCHEMES}, "
            f"got {endpoint!r}"
        )
    if endpoint.startswith("tcp://") and ":" not in endpoint[len("tcp://") :]:
        raise ConfigError(f"{name} {endpoint!r} has no port")


@dataclass(frozen=True)
class EngineSpec:
    """One engine (one data-parallel rank): where its HTTP API, metrics and KV events are.

    Attributes:
        host, port: the engine's HTTP address (OpenAI API and ``/metrics``).
        dp_rank: its data-parallel rank (each rank publishes its own KV events).
        model: the served model name (None: any).
        role: ``"prefill"``, ``"decode"``, ``"both"`` or None.
        kv_events: the ZMQ endpoint of its KV-event publisher.
        kv_events_bind: True when the subscriber binds ``kv_events`` (vLLM given an endpoint
            without ``*`` connects to it); False when the subscriber connects.
        replay: the ZMQ endpoint of its replay ROUTER socket (the subscriber connects).
        topic: the topic it publishes with; messages with any other topic are refused.
        metrics_path: the path of its Prometheus metrics.
        labels: free-form labels (copied to the router's endpoint).

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

    def __post_init__(self) -> None:
        _check_host(self.host)
        _check_port(self.port)
        _check_dp_rank(self.dp_rank)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a non-empty str or None, got {self.model!r}")
        if self.role is not None and self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES} or None, got {self.role!r}")
        _check_endpoint("kv_events", self.kv_events)
        _check_endpoint("replay", self.replay)
        if not isinstance(self.kv_events_bind, bool):
            raise ConfigError(f"kv_events_bind must be a bool, got {self.kv_events_bind!r}")
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
        # A private copy: a caller's later change to its dict must not reach a frozen spec.
        object.__setattr__(self, "labels", dict(self.labels))

    @property
    def worker_id(self) -> str:
        """:func:`worker_id` of this engine."""
        return worker_id(self.host, self.port, self.dp_rank)

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
