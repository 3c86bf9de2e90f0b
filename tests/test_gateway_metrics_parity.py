"""Both data planes' ``/metrics`` for the same traffic: the same HELP text for every family
both export, and the same series (label sets, zero-valued ones included), so that a dashboard
or an alert reads either plane alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _gateway_harness import MODEL, Rig, rig, run, until
from prometheus_client.parser import text_string_to_metric_families

from llmsched import PrefixIndex
from llmsched._llmsched import gateway_metric_help
from llmsched.gateway.metrics import GatewayMetrics

ADMIN_TOKEN = "parity82-admin-token"
SCRAPE = {"enabled": True, "interval_s": 0.05, "timeout_s": 1.0}
FLOW = {"saturation": {"type": "concurrency", "max_requests": 8}}
# Probes off and the breaker out of the way: the traffic alone decides the figures.
HEALTH = {"interval_s": None, "breaker_min_requests": 1000, "failures_to_probe": 1000}


@dataclass(frozen=True)
class Family:
    """One family of a ``/metrics`` body, its engine labels named by engine order."""

    help: str
    type: str
    series: frozenset[tuple[str, tuple[tuple[str, str], ...]]]


def _engines_named(r: Rig) -> dict[str, str]:
    """Engine id -> ``engine<i>`` (the ids are addresses, another port on each run)."""
    return {str(e.worker_id): f"engine{i}" for i, e in enumerate(r.gateway.config.engines)}


def _families(text: str, names: dict[str, str]) -> dict[str, Family]:
    out = {}
    for family in text_string_to_metric_families(text):
        series = frozenset(
            (
                sample.name,
                tuple(sorted((k, names.get(v, v)) for k, v in sample.labels.items())),
            )
            for sample in family.samples
        )
        out[family.name] = Family(family.documentation, family.type, series)
    return out


async def _traffic(plane: str) -> dict[str, Family]:
    """The same requests on ``plane``: engine0 answers every request 5xx (each is retried on
    engine1), one request is refused, one admin call made; both engines scraped."""
    async with rig(
        2,
        data_plane=plane,
        scrape=SCRAPE,
        flow=FLOW,
        health=HEALTH,
        router="round-robin",
        admin={"token": ADMIN_TOKEN},
    ) as r:
        # A scrape round came back for both before anything else.
        await until(lambda: all(e["timestamp"] is not None for e in r.gateway.pool.endpoints()))
        r.engines[0].mode = "error500"
        for i in range(4):
            assert (await r.complete(f"{i} parity")).status == 200
        refused = await r.client.post(r.url("/v1/completions"), json={"model": MODEL})
        assert refused.status == 400
        listed = await r.client.get(
            r.url("/admin/engines"), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        assert listed.status == 200
        response = await r.client.get(r.url("/metrics"))
        assert response.status == 200
        return _families(await response.text(), _engines_named(r))


@pytest.fixture(scope="module")
def planes() -> Iterator[dict[str, dict[str, Family]]]:
    async def both() -> dict[str, dict[str, Family]]:
        return {plane: await _traffic(plane) for plane in ("python", "native")}

    yield run(both())


def _common(planes: dict[str, dict[str, Family]]) -> list[str]:
    python, native = planes["python"], planes["native"]
    common = sorted(set(python) & set(native))
    assert len(common) > 20  # the traffic reached the families compared
    return common


def test_both_planes_carry_the_help_lines_of_the_one_table(
    planes: dict[str, dict[str, Family]],
) -> None:
    """Probe 82: ten families had shorter (or other) HELP texts on the native plane; the texts
    were then written twice (``crates/llmsched-gateway/src/metrics.rs`` and
    ``llmsched/gateway/metrics.py``), kept alike by this comparison. They live in one table
    now (``llmsched_gateway::metrics::HELP``, read by the Python plane through
    ``gateway_metric_help()``): every family either plane exports carries its HELP line from
    it, so the families both export carry the same one."""
    table = gateway_metric_help()

    def key(name: str) -> str:
        """The table's name of a family: prometheus_client's ``_created`` samples parse as a
        family of their own, with the counter's HELP."""
        name = name.removeprefix("llmsched_gateway_")
        return name if name in table else name.removesuffix("_created")

    for plane, families in planes.items():
        off = {
            name: family.help
            for name, family in families.items()
            if table.get(key(name)) != family.help
        }
        assert off == {}, plane
    python, native = planes["python"], planes["native"]
    assert {name: python[name].help for name in _common(planes)} == {
        name: native[name].help for name in _common(planes)
    }


def test_both_planes_export_the_same_series_zero_valued_ones_included(
    planes: dict[str, dict[str, Family]],
) -> None:
    """Probe 82: ``scrape_failures_total`` had a 0 series per engine scraped and kind on the
    Python plane (``rate()`` works from the first scrape) and none on the native plane
    until a scrape failed; every family both export has the same types and series now."""
    python, native = planes["python"], planes["native"]
    differ = {
        name: (python[name].series ^ native[name].series, python[name].type, native[name].type)
        for name in _common(planes)
        if (python[name].series, python[name].type) != (native[name].series, native[name].type)
    }
    assert differ == {}
    failures = python["llmsched_gateway_scrape_failures"].series
    assert {labels for _, labels in failures} == {
        (("endpoint", f"engine{i}"), ("kind", kind))
        for i in range(2)
        for kind in ("failed", "timeout")
    }
    # Every family the native plane exports, the Python plane exports too (its own extra
    # ones: the ``_created`` samples of prometheus_client).
    assert set(native) <= set(python)


def test_endpoint_in_flight_is_the_gateways_own_on_the_python_plane() -> None:
    """With router replicas the pool's in-flight count adds the other replicas' requests
    (``remote_in_flight_requests``); ``endpoint_in_flight`` shows this gateway's own, as the
    native plane does, so that a sum over the replicas counts each request once."""
    endpoints: list[Any] = [
        {"id": "a", "in_flight_requests": 5, "remote_in_flight_requests": 3},
        {"id": "b", "in_flight_requests": 2, "remote_in_flight_requests": 0},
    ]
    metrics = GatewayMetrics(flow=None, index=PrefixIndex(4), endpoints=lambda: endpoints)
    text = metrics.render().decode()
    values = {
        sample.labels["endpoint"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "llmsched_gateway_endpoint_in_flight"
        for sample in family.samples
    }
    assert values == {"a": 2.0, "b": 2.0}
