"""worker_id and EngineSpec: one identity per engine, validated config."""

from __future__ import annotations

import pytest

from llmsched.errors import ConfigError
from llmsched.integrations import EngineSpec, worker_id


def test_worker_id_forms() -> None:
    assert worker_id("10.0.0.1", 8000) == "10.0.0.1:8000"
    assert worker_id("10.0.0.1", 8000, 0) == "10.0.0.1:8000"
    assert worker_id("10.0.0.1", 8000, 3) == "10.0.0.1:8000/dp3"
    assert worker_id("fe80::1", 8000) == "[fe80::1]:8000"
    assert EngineSpec("pod-a.ns", 9000, dp_rank=1).worker_id == "pod-a.ns:9000/dp1"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", 80), "host"),
        ((" h", 80), "host"),
        (("h/x", 80), "host"),
        ((None, 80), "host"),
        (("h", 0), "port"),
        (("h", 65536), "port"),
        (("h", "80"), "port"),
        (("h", True), "port"),
        (("h", 80, -1), "dp_rank"),
        (("h", 80, 1.0), "dp_rank"),
    ],
)
def test_worker_id_names_the_bad_field(args: tuple[object, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        worker_id(*args)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        EngineSpec(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": ""}, "model"),
        ({"role": "leader"}, "role"),
        ({"kv_events": "http://h:1"}, "kv_events must be a ZMQ endpoint"),
        ({"kv_events": "tcp://h"}, "has no port"),
        ({"kv_events": "tcp://*:5557"}, "wildcard"),
        ({"kv_events": "tcp://h:1", "replay": "tcp://*:2"}, "replay"),
        ({"replay": "tcp://h:2"}, "replay is set but kv_events is not"),
        ({"kv_events_bind": "yes"}, "kv_events_bind"),
        ({"topic": b"kv"}, "topic"),
        ({"metrics_path": "metrics"}, "metrics_path"),
        ({"labels": {"a": 1}}, "labels"),
    ],
)
def test_engine_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineSpec("h", 80, **kwargs)  # type: ignore[arg-type]


def test_engine_spec_urls_and_wildcard_bind() -> None:
    spec = EngineSpec("::1", 8000, kv_events="tcp://*:5557", kv_events_bind=True)
    assert spec.base_url == "http://[::1]:8000"
    assert spec.metrics_url == "http://[::1]:8000/metrics"


def test_from_dict_round_trip_and_errors() -> None:
    d = {
        "host": "10.0.0.7",
        "port": 8000,
        "dp_rank": 1,
        "model": "tiny",
        "role": "prefill",
        "kv_events": "tcp://10.0.0.7:5558",
        "replay": "tcp://10.0.0.7:5559",
        "topic": "kv@10.0.0.7:8000@tiny",
        "labels": {"zone": "eu"},
    }
    spec = EngineSpec.from_dict(d)
    assert spec == EngineSpec(**d)  # type: ignore[arg-type]
    assert hash(spec) == hash(EngineSpec.from_dict(d))
    with pytest.raises(ConfigError, match="unknown engine key 'replicas'"):
        EngineSpec.from_dict({**d, "replicas": 2})
    with pytest.raises(ConfigError, match="no 'port'"):
        EngineSpec.from_dict({"host": "h"})
    with pytest.raises(ConfigError, match="mapping"):
        EngineSpec.from_dict(["h", 80])  # type: ignore[arg-type]


def test_labels_are_copied() -> None:
    labels = {"zone": "eu"}
    spec = EngineSpec("h", 80, labels=labels)
    labels["zone"] = "us"
    assert spec.labels == {"zone": "eu"}


@pytest.mark.parametrize("host", ["10.0.0.7:8000", "engine-a:8000", "[::1]:8000", "::g"])
def test_a_host_with_a_port_is_refused(host: str) -> None:
    # "10.0.0.7:8000" was taken for an IPv6 address: "[10.0.0.7:8000]:8000", never reachable.
    with pytest.raises(ConfigError, match="a port goes in port"):
        EngineSpec(host, 8000)
    assert EngineSpec("[::1]", 8000).address == "[::1]:8000"


def test_resolve_engines_matches_any_spelling_of_an_address() -> None:
    # "0:0:0:0:0:0:0:1" and "[::1]" are one address: the scraper and the KV feed added a second
    # endpoint for an engine the pool had under its name, and routed to both.
    from llmsched import Endpoint, EndpointPool
    from llmsched.integrations import resolve_engines

    pool = EndpointPool(
        [
            Endpoint("engine-a", address="[::1]:8000"),
            Endpoint("engine-b", address="http://Engine-B.local:9000/"),
        ]
    )
    engines = [EngineSpec("0:0:0:0:0:0:0:1", 8000), EngineSpec("engine-b.local", 9000)]
    assert [e.worker_id for e in resolve_engines(engines, pool)] == ["engine-a", "engine-b"]
    named = EngineSpec("0::1", 8000, name="engine-a")
    assert resolve_engines([named], pool) == [named]
    with pytest.raises(ConfigError, match="is at"):
        resolve_engines([EngineSpec("::2", 8000, name="engine-a")], pool)
