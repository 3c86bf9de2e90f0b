"""The gateway's own Prometheus metrics, in a dedicated registry (never the global one, so
several gateways in one process, e.g. in tests, keep separate figures).

Counters and histograms are updated on the request path; gauges that mirror state owned by
other components (flow-control queues and saturation, the prefix index, KV-event counters)
are read when ``/metrics`` is scraped, by :class:`_StateCollector`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmsched import _llmsched
from llmsched.flow import FlowController
from llmsched.gateway.engine_models import ModelFinding
from llmsched.prefix_index import PrefixIndex
from llmsched.types import EndpointInfo, FlowMetrics

if TYPE_CHECKING:
    from llmsched.gateway.pod_discovery import PodDiscoveryStats

__all__ = [
    "DISCOVERY_ERRORS_HELP",
    "GatewayMetrics",
    "cluster_metrics_text",
    "config_metrics_text",
    "kubernetes_metrics_text",
    "metric_help",
    "model_check_metrics_text",
]

PREFIX = "llmsched_gateway"

_HELP: Final[Mapping[str, str]] = MappingProxyType(_llmsched.gateway_metric_help())
"""Every family's HELP text, by name without the prefix (and a counter's ``_total``): the
native gateway's table (``crates/llmsched-gateway/src/metrics.rs``, ``HELP``), the one place
both data planes take them from."""


def metric_help(name: str) -> str:
    """The HELP text of family ``llmsched_gateway_<name>`` (a counter without its ``_total``),
    as both data planes give it; KeyError for a family the gateway does not export.

    >>> metric_help("retries")
    'Requests re-sent to another endpoint'
    """
    return _HELP[name]


DISCOVERY_ERRORS_HELP = _HELP["discovery_errors"]
"""The HELP text of ``llmsched_gateway_discovery_errors_total``."""

KV_FAILING_SOCKETS = f"{PREFIX}_kv_events_failing_sockets"
KV_FAILING_HELP = _HELP["kv_events_failing_sockets"]

# Decisions take tens of microseconds; requests through the gateway take milliseconds.
_DECISION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)  # fmt: skip
_OVERHEAD_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5, 10.0, 60.0,
)  # fmt: skip


class GatewayMetrics:
    """Every metric the gateway exports. ``render()`` is the ``/metrics`` body."""

    def __init__(
        self,
        *,
        flow: FlowController | None,
        index: PrefixIndex,
        kv_counters: Callable[[], dict[str, int]] | None = None,
        endpoints: Callable[[], list[EndpointInfo]] | None = None,
        cluster: Callable[[], Mapping[str, object] | None] | None = None,
        scrapes: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        model_findings: Callable[[], list[ModelFinding]] | None = None,
        kv_failing: Callable[[], Mapping[str, str]] | None = None,
        kubernetes: Callable[[], PodDiscoveryStats] | None = None,
        config_warnings: Callable[[], int] | None = None,
        engine_block_sizes: Callable[[], Mapping[Any, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            _HELP["requests"],
            ["route", "status"],
            registry=r,
        )
        self.rejections = Counter(
            f"{PREFIX}_rejections",
            _HELP["rejections"],
            ["reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            f"{PREFIX}_decision_seconds",
            _HELP["decision_seconds"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.overhead_seconds = Histogram(
            f"{PREFIX}_overhead_seconds",
            _HELP["overhead_seconds"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            f"{PREFIX}_admission_wait_seconds",
            _HELP["admission_wait_seconds"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors",
            _HELP["upstream_errors"],
            ["endpoint", "kind"],
            registry=r,
        )
        self.slices = Counter(f"{PREFIX}_slices", _HELP["slices"], registry=r)
        self.retries = Counter(f"{PREFIX}_retries", _HELP["retries"], registry=r)
        self.poisoned_requests = Counter(
            f"{PREFIX}_poisoned_requests",
            _HELP["poisoned_requests"],
            registry=r,
        )
        self.session_tokens_ignored = Counter(
            f"{PREFIX}_session_tokens_ignored",
            _HELP["session_tokens_ignored"],
            registry=r,
        )
        self.response_lookups = Counter(
            f"{PREFIX}_response_lookups",
            _HELP["response_lookups"],
            ["outcome"],
            registry=r,
        )
        self.responses_unhashed = Counter(
            f"{PREFIX}_responses_unhashed",
            _HELP["responses_unhashed"],
            registry=r,
        )
        self.response_owners = Gauge(
            f"{PREFIX}_response_owners",
            _HELP["response_owners"],
            registry=r,
        )
        self.routed = Counter(
            f"{PREFIX}_routed",
            _HELP["routed"],
            ["endpoint"],
            registry=r,
        )
        self.ejections = Counter(
            f"{PREFIX}_ejections",
            _HELP["ejections"],
            ["endpoint"],
            registry=r,
        )
        self.breaker_opens = Counter(
            f"{PREFIX}_breaker_opens",
            _HELP["breaker_opens"],
            ["endpoint"],
            registry=r,
        )
        self.probes = Counter(
            f"{PREFIX}_health_probes",
            _HELP["health_probes"],
            ["endpoint", "result"],
            registry=r,
        )
        self.engine_up = Gauge(
            f"{PREFIX}_endpoint_up",
            _HELP["endpoint_up"],
            ["endpoint"],
            registry=r,
        )
        self.truncated = Counter(
            f"{PREFIX}_truncated_answers",
            _HELP["truncated_answers"],
            ["endpoint", "outcome"],
            registry=r,
        )
        self.admin_requests = Counter(
            f"{PREFIX}_admin_requests",
            _HELP["admin_requests"],
            ["action", "status"],
            registry=r,
        )
        self.tenants = Gauge(f"{PREFIX}_tenants", _HELP["tenants"], registry=r)
        self.tenants_folded = Counter(
            f"{PREFIX}_tenants_folded",
            _HELP["tenants_folded"],
            registry=r,
        )
        self.connections = Gauge(f"{PREFIX}_connections", _HELP["connections"], registry=r)
        self.body_bytes_in_flight = Gauge(
            f"{PREFIX}_body_bytes_in_flight",
            _HELP["body_bytes_in_flight"],
            registry=r,
        )
        self.connections_refused = Counter(
            f"{PREFIX}_connections_refused",
            _HELP["connections_refused"],
            registry=r,
        )
        self.engines_changed = Counter(
            f"{PREFIX}_engine_changes",
            _HELP["engine_changes"],
            registry=r,
        )
        self.discovery_errors = Counter(
            f"{PREFIX}_discovery_errors", _HELP["discovery_errors"], registry=r
        )
        r.register(
            _StateCollector(
                flow, index, kv_counters, endpoints, cluster, scrapes, model_findings, kv_failing
            )
        )
        if kubernetes is not None:
            r.register(_LiveFamilies(lambda: list(_kubernetes_metrics(kubernetes()))))
        r.register(
            _LiveFamilies(
                lambda: list(
                    _config_metrics(
                        0 if config_warnings is None else config_warnings(),
                        index.block_size_mismatch(),
                        index.extra_keys(),
                        {} if engine_block_sizes is None else engine_block_sizes(),
                    )
                )
            )
        )

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges and counters read from the live components when scraped."""

    def __init__(
        self,
        flow: FlowController | None,
        index: PrefixIndex,
        kv_counters: Callable[[], dict[str, int]] | None,
        endpoints: Callable[[], list[EndpointInfo]] | None = None,
        cluster: Callable[[], Mapping[str, object] | None] | None = None,
        scrapes: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        model_findings: Callable[[], list[ModelFinding]] | None = None,
        kv_failing: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self._flow = flow
        self._kv_failing = kv_failing
        self._model_findings = model_findings
        self._scrapes = scrapes
        self._index = index
        self._kv_counters = kv_counters
        self._endpoints = endpoints
        self._cluster = cluster

    def describe(self) -> list[Metric]:
        return []  # unchecked: the families depend on the live state

    def collect(self) -> Iterator[Metric]:
        stats: Mapping[str, Any] = self._index.stats()
        for key in ("blocks", "workers", "bytes"):
            yield GaugeMetricFamily(
                f"{PREFIX}_index_{key}", _HELP[f"index_{key}"], value=stats[key]
            )
        yield CounterMetricFamily(
            f"{PREFIX}_index_evicted_blocks",
            _HELP["index_evicted_blocks"],
            value=stats["evicted_blocks"],
        )
        if self._endpoints is not None:
            in_flight = GaugeMetricFamily(
                f"{PREFIX}_endpoint_in_flight", _HELP["endpoint_in_flight"], labels=["endpoint"]
            )
            for endpoint in self._endpoints():
                # This gateway's own, as on the native plane: the pool's count adds the other
                # replicas' (replica sync), which a sum over the replicas would count again.
                own = endpoint["in_flight_requests"] - endpoint["remote_in_flight_requests"]
                in_flight.add_metric([str(endpoint["id"])], max(own, 0))
            yield in_flight
        if self._scrapes is not None:
            failures = CounterMetricFamily(
                f"{PREFIX}_scrape_failures",
                _HELP["scrape_failures"],
                labels=["endpoint", "kind"],
            )
            for worker, scrape in sorted(self._scrapes().items()):
                timeouts = scrape["timeouts"]
                failures.add_metric([worker, "timeout"], timeouts)
                failures.add_metric([worker, "failed"], scrape["failures"] - timeouts)
            yield failures
        if self._model_findings is not None:
            yield _model_mismatches(self._model_findings())
        if self._flow is not None:
            yield from self._flow_metrics(self._flow.metrics())
        cluster = self._cluster() if self._cluster is not None else None
        if cluster is not None:
            yield from _cluster_metrics(cluster)
        if self._kv_counters is not None:
            family = CounterMetricFamily(
                f"{PREFIX}_kv_events", _HELP["kv_events"], labels=["counter"]
            )
            for name, value in sorted(self._kv_counters().items()):
                family.add_metric([name], value)
            yield family
        if self._kv_failing is not None:
            yield GaugeMetricFamily(
                KV_FAILING_SOCKETS,
                _HELP["kv_events_failing_sockets"],
                value=len(self._kv_failing()),
            )

    @staticmethod
    def _flow_metrics(metrics: FlowMetrics) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_saturation",
            _HELP["saturation"],
            value=metrics["saturation"],
        )
        queued = GaugeMetricFamily(
            f"{PREFIX}_queue_length",
            _HELP["queue_length"],
            labels=["priority"],
        )
        for band in metrics["bands"]:
            queued.add_metric([str(band["priority"])], band["queued"])
        yield queued
        yield GaugeMetricFamily(f"{PREFIX}_running", _HELP["running"], value=metrics["running"])
        yield GaugeMetricFamily(
            f"{PREFIX}_flow_tenants",
            _HELP["flow_tenants"],
            value=metrics["tenants"],
        )
        yield CounterMetricFamily(
            f"{PREFIX}_flows_reclaimed",
            _HELP["flows_reclaimed"],
            value=metrics["flows_reclaimed"],
        )
        yield CounterMetricFamily(
            f"{PREFIX}_priorities_folded",
            _HELP["priorities_folded"],
            value=metrics["priorities_folded"],
        )
        outcomes = CounterMetricFamily(
            f"{PREFIX}_flow_outcomes", _HELP["flow_outcomes"], labels=["outcome"]
        )
        for key, count in sorted(metrics["outcomes"].items()):
            outcomes.add_metric([key], count)
        yield outcomes


def _cluster_metrics(stats: Mapping[str, object]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        f"{PREFIX}_cluster_connected",
        _HELP["cluster_connected"],
        value=1 if stats["connected"] else 0,
    )
    peers = stats["peers"]
    yield GaugeMetricFamily(
        f"{PREFIX}_cluster_peers",
        _HELP["cluster_peers"],
        value=len(peers) if isinstance(peers, list) else 0,
    )
    family = CounterMetricFamily(f"{PREFIX}_cluster", _HELP["cluster"], labels=["counter"])
    for name, value in sorted(stats.items()):
        if isinstance(value, int) and not isinstance(value, bool):
            family.add_metric([name], value)
    yield family


def _config_metrics(
    warnings: int,
    block_size_mismatch: Mapping[Any, int],
    extra_keys: Mapping[Any, int],
    engine_block_sizes: Mapping[Any, int],
) -> Iterator[Metric]:
    """``llmsched_gateway_config_warnings``,
    ``llmsched_gateway_index_block_size_mismatch_total``,
    ``llmsched_gateway_index_extra_keys_total`` and
    ``llmsched_gateway_engine_block_size_mismatch`` (by engine)."""
    yield GaugeMetricFamily(
        f"{PREFIX}_config_warnings",
        _HELP["config_warnings"],
        value=warnings,
    )
    skipped = CounterMetricFamily(
        f"{PREFIX}_index_block_size_mismatch",
        _HELP["index_block_size_mismatch"],
        labels=["engine"],
    )
    for worker, count in sorted(block_size_mismatch.items(), key=lambda item: str(item[0])):
        skipped.add_metric([str(worker)], count)
    yield skipped
    keyed = CounterMetricFamily(
        f"{PREFIX}_index_extra_keys",
        _HELP["index_extra_keys"],
        labels=["engine"],
    )
    for worker, count in sorted(extra_keys.items(), key=lambda item: str(item[0])):
        keyed.add_metric([str(worker)], count)
    yield keyed
    sizes = GaugeMetricFamily(
        f"{PREFIX}_engine_block_size_mismatch",
        _HELP["engine_block_size_mismatch"],
        labels=["engine"],
    )
    for worker, size in sorted(engine_block_sizes.items(), key=lambda item: str(item[0])):
        sizes.add_metric([str(worker)], size)
    yield sizes


def config_metrics_text(
    warnings: int,
    block_size_mismatch: Mapping[Any, int],
    *,
    extra_keys: Mapping[Any, int] | None = None,
    engine_block_sizes: Mapping[Any, int] | None = None,
) -> str:
    """``llmsched_gateway_config_warnings`` (the scheduler's warnings),
    ``llmsched_gateway_index_block_size_mismatch_total`` and
    ``llmsched_gateway_index_extra_keys_total`` (the index's skipped events by engine) and
    ``llmsched_gateway_engine_block_size_mismatch`` (engines whose scraped KV block size the
    index cannot split, while their KV events feed it), as exposition text (the native plane
    appends it to its ``/metrics``).

    >>> text = config_metrics_text(1, {"e0": 3}, extra_keys={"e1": 2})
    >>> "llmsched_gateway_config_warnings 1.0" in text
    True
    >>> 'llmsched_gateway_index_block_size_mismatch_total{engine="e0"} 3.0' in text
    True
    >>> 'llmsched_gateway_index_extra_keys_total{engine="e1"} 2.0' in text
    True
    """
    registry = CollectorRegistry(auto_describe=False)
    families = _config_metrics(
        warnings, block_size_mismatch, extra_keys or {}, engine_block_sizes or {}
    )
    registry.register(_Families(list(families)))
    return generate_latest(registry).decode()


def _model_mismatches(findings: list[ModelFinding]) -> Metric:
    family = GaugeMetricFamily(
        f"{PREFIX}_engine_model_mismatches",
        _HELP["engine_model_mismatches"],
        labels=["engine", "kind"],
    )
    counts: dict[tuple[str, str], int] = {}
    for finding in findings:
        key = (finding.engine, finding.kind)
        counts[key] = counts.get(key, 0) + 1
    for (engine, kind), count in sorted(counts.items()):
        family.add_metric([engine, kind], count)
    return family


def _kubernetes_metrics(stats: PodDiscoveryStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        f"{PREFIX}_kubernetes_synced",
        _HELP["kubernetes_synced"],
        value=1 if stats["synced"] else 0,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_kubernetes_engines",
        _HELP["kubernetes_engines"],
        value=stats["engines"],
    )
    counters = CounterMetricFamily(
        f"{PREFIX}_kubernetes_discovery",
        _HELP["kubernetes_discovery"],
        labels=["counter"],
    )
    for name, value in sorted(stats["counters"].items()):
        counters.add_metric([name], value)
    yield counters
    skipped = GaugeMetricFamily(
        f"{PREFIX}_kubernetes_skipped_pod",
        _HELP["kubernetes_skipped_pod"],
        labels=["pod", "reason"],
    )
    for pod, why in sorted(stats["skipped_pods"].items()):
        skipped.add_metric([pod, why], 1)
    yield skipped


class _LiveFamilies(Collector):
    """Families made afresh at each scrape."""

    def __init__(self, families: Callable[[], list[Metric]]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._families()


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def cluster_metrics_text(stats: Mapping[str, object]) -> str:
    """The replica-sync families of ``/metrics`` (``llmsched_gateway_cluster_*``) for
    :meth:`llmsched.cluster.ClusterSync.stats`, as exposition text (the native plane appends
    it to its own)."""
    registry = CollectorRegistry()
    registry.register(_Families(list(_cluster_metrics(stats))))
    return generate_latest(registry).decode()


def model_check_metrics_text(findings: list[ModelFinding]) -> str:
    """``llmsched_gateway_engine_model_mismatches`` for the findings of
    :class:`~llmsched.gateway.engine_models.EngineModelCheck`, as exposition text (the native
    plane appends it to its own).

    >>> from llmsched.gateway.engine_models import ModelFinding
    >>> text = model_check_metrics_text([ModelFinding("model_not_served", "e0", "m", "...")])
    >>> 'llmsched_gateway_engine_model_mismatches{engine="e0",kind="model_not_served"} 1.0' in text
    True
    """
    registry = CollectorRegistry()
    registry.register(_Families([_model_mismatches(findings)]))
    return generate_latest(registry).decode()


def kubernetes_metrics_text(stats: PodDiscoveryStats) -> str:
    """The Kubernetes discovery families of ``/metrics`` (``llmsched_gateway_kubernetes_*``)
    for :meth:`llmsched.gateway.pod_discovery.PodDiscovery.stats`, as exposition text (the
    native plane appends it to its own; the Python plane registers the same families).

    >>> text = kubernetes_metrics_text({"synced": True, "engines": 1,
    ...     "counters": {"lists": 1}, "skipped_pods": {"p": "bad role"}})
    >>> 'llmsched_gateway_kubernetes_discovery_total{counter="lists"} 1.0' in text
    True
    >>> 'llmsched_gateway_kubernetes_skipped_pod{pod="p",reason="bad role"} 1.0' in text
    True
    """
    registry = CollectorRegistry()
    registry.register(_Families(list(_kubernetes_metrics(stats))))
    return generate_latest(registry).decode()
