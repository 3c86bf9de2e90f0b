"""Probe 47 F12: a KV-event endpoint that cannot work. One that can never work (a host or
port that does not parse, a transport the plane's subscriber cannot read) is a ConfigError
when the config is loaded, naming the engine and the key, the same on both planes and in the
native feed itself; a bind or connect that fails at run time (the port taken, an address
that is not the host's) is logged once per endpoint and error, counted, shown in
``llmsched_gateway_kv_events_failing_sockets`` and retried, and the gateway serves on."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)

from llmsched import PrefixIndex, _llmsched
from llmsched.errors import ConfigError
from llmsched.gateway import load_config, make_gateway
from llmsched.gateway.config import engine_set
from llmsched.integrations import EngineSpec, KVEventSubscriber, NativeKVEventSubscriber
from llmsched.integrations.identity import endpoint_problem

# (endpoint, bound by the subscriber): accepted by both planes' checks.
GOOD = [
    ("tcp://10.0.0.7:5557", False),
    ("tcp://engine-a.default.svc:5557", False),
    ("tcp://[::1]:5557", False),
    ("tcp://*:5557", True),
    ("tcp://127.0.0.1:*", True),
    ("tcp://127.0.0.1:0", True),
    ("tcp://localhost:65535", False),
]
# (endpoint, bound, what the refusal says): refused by both (the Rust side's table in
# `kv_events::tests` is the same).
BAD = [
    ("tcp://999.1.1.1:5", True, "'999.1.1.1' is not an IPv4 address"),
    ("tcp://1.2.3:5", False, "'1.2.3' is not an IPv4 address"),
    ("tcp://127.0.0.1:70000", True, "70000 is not in 0..65535"),
    ("tcp://127.0.0.1:0", False, "0 is not in 1..65535"),
    ("tcp://127.0.0.1:x", True, "x is not in 0..65535"),
    ("tcp://127.0.0.1:-1", True, "-1 is not in 0..65535"),
    ("tcp://h", False, "has no port"),
    ("tcp://:5557", True, "it is empty"),
    ("tcp://host name:5557", True, "'host name' is not a host name"),
    ("tcp://-a.b:5557", True, "'-a.b' is not a host name"),
    ("tcp://::1:5557", False, "an IPv6 address is written in brackets"),
    ("tcp://[::g]:5557", False, "'[::g]' is not an IPv6 address"),
    ("tcp://[fe80::1%eth0]:5557", True, "has a zone index"),
    ("tcp://*:5557", False, "is a wildcard"),
]


def _native_feed(endpoint: str, bind: bool) -> None:
    """The native feed built directly (no Python check before it)."""
    _llmsched.NativeKVEventSubscriber(
        PrefixIndex(4).native, [("w", endpoint, bind, None, "")], "{}"
    )


@pytest.mark.parametrize(("endpoint", "bind"), GOOD)
def test_endpoints_that_can_work_pass_both_checks(endpoint: str, bind: bool) -> None:
    assert endpoint_problem(endpoint, bind=bind) is None
    EngineSpec("h", 1, kv_events=endpoint, kv_events_bind=bind)
    _native_feed(endpoint, bind)


@pytest.mark.parametrize(("endpoint", "bind", "problem"), BAD)
def test_endpoints_that_can_never_work_are_refused_alike(
    endpoint: str, bind: bool, problem: str
) -> None:
    with pytest.raises(ConfigError) as python:
        EngineSpec("h", 1, kv_events=endpoint, kv_events_bind=bind)
    with pytest.raises(ConfigError) as native:
        _native_feed(endpoint, bind)
    assert str(python.value).startswith(f"kv_events '{endpoint}' "), python.value
    assert str(native.value).startswith(f"engine w: kv_events '{endpoint}' "), native.value
    for refused in (python, native):
        assert problem in str(refused.value), refused.value


def test_a_replay_endpoint_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^replay 'tcp://h:99999' has an invalid port"):
        EngineSpec("h", 1, kv_events="tcp://h:1", replay="tcp://h:99999")


def _config(kv_events: str, bind: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "engines": [
            {"host": "127.0.0.1", "port": 8001},
            {"host": "127.0.0.1", "port": 8002, "kv_events": kv_events, "kv_events_bind": bind},
        ],
        "models": [MODEL],
        "scrape": {"enabled": False},
        **extra,
    }


@pytest.mark.parametrize("data_plane", ["python", "native"])
def test_a_config_naming_an_endpoint_that_can_never_work_is_refused_at_load(
    data_plane: str,
) -> None:
    """F12: ``tcp://999.1.1.1:5`` started both planes silently."""
    with pytest.raises(ConfigError) as refused:
        load_config(_config("tcp://999.1.1.1:5", data_plane=data_plane))
    assert str(refused.value) == (
        "engines[1]: kv_events 'tcp://999.1.1.1:5' has an invalid host: '999.1.1.1' is not an "
        "IPv4 address"
    )


def test_transports_a_plane_cannot_read_are_refused_at_load() -> None:
    ipc = _config("ipc:///tmp/llmsched-kv")
    assert load_config({**ipc, "data_plane": "python"}).engines[1].kv_events is not None
    with pytest.raises(ConfigError, match=r"^engines\[1\]\.kv_events: 'ipc:///tmp/llmsched-kv': "):
        load_config({**ipc, "data_plane": "native"})
    # Loaded for the Python plane, served on the native one (`llmsched serve --data-plane`).
    with pytest.raises(ConfigError, match=r"^engines\[1\]\.kv_events: .*tcp:// only"):
        make_gateway(load_config({**ipc, "data_plane": "python"}), data_plane="native")
    for data_plane in ("python", "native"):
        with pytest.raises(ConfigError, match=r"^engines\[1\]\.kv_events: .*inproc://"):
            load_config(_config("inproc://kv", data_plane=data_plane))


def test_engines_added_later_are_held_to_the_same_rules() -> None:
    """Discovery and the admin API change the engines through ``engine_set``."""
    config = load_config(_config("tcp://127.0.0.1:*", data_plane="native"))
    ipc = EngineSpec("127.0.0.1", 8003, kv_events="ipc:///tmp/kv", kv_events_bind=True)
    with pytest.raises(ConfigError, match=r"^engine 127\.0\.0\.1:8003: kv_events: 'ipc:///tmp"):
        engine_set(config, [*config.engines, ipc])


def test_serve_with_an_endpoint_that_can_never_work_says_one_line(
    plane: str,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(_config("tcp://999.1.1.1:5", data_plane=plane)))
    done = subprocess.run(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 2, output
    assert output.startswith("llmsched serve: engines[1]: kv_events 'tcp://999.1.1.1:5'"), output
    assert len(output.splitlines()) == 1, output


# -- failures at run time -------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[socket.socket]:
    """A port on loopback something else holds (call ``.close()`` to free it)."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        yield busy
    finally:
        busy.close()


def _warnings(caplog: pytest.LogCaptureFixture, endpoint: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmsched" and r.levelno == logging.WARNING and endpoint in r.getMessage()
    ]


@pytest.mark.parametrize("feed", [KVEventSubscriber, NativeKVEventSubscriber])
def test_a_shared_bind_that_fails_is_logged_once_listed_and_retried_until_it_works(
    feed: type[KVEventSubscriber] | type[NativeKVEventSubscriber],
    busy_port: socket.socket,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two engines binding one fixed endpoint (llm-d's ``zmqEndpoint``) share one socket: its
    failure names both, once, and the feed binds as soon as the port is free."""
    endpoint = f"tcp://127.0.0.1:{busy_port.getsockname()[1]}"
    specs = [
        EngineSpec("127.0.0.1", port, kv_events=endpoint, kv_events_bind=True, topic=f"kv@{port}")
        for port in (8001, 8002)
    ]
    with caplog.at_level(logging.INFO, logger="llmsched"):
        sub = feed(PrefixIndex(4), specs, backoff_s=(0.01, 0.05))
        with sub:
            assert sub.wait_for(lambda c: c["socket_errors"] >= 5, timeout=10)
            failing = sub.failing_sockets()
            assert list(failing) == [endpoint]
            assert "Address already in use (os error 98)" in failing[endpoint]
            warnings = _warnings(caplog, endpoint)
            assert len(warnings) == 1, warnings
            assert "engines 127.0.0.1:8001, 127.0.0.1:8002: cannot bind" in warnings[0]
            assert failing[endpoint] in warnings[0]
            busy_port.close()
            deadline = time.monotonic() + 10
            while sub.failing_sockets():
                assert time.monotonic() < deadline, "never bound"
                time.sleep(0.01)
            assert sub.bound_endpoint("127.0.0.1:8001") == endpoint
    assert any(
        endpoint in r.getMessage() and "now succeeds" in r.getMessage() for r in caplog.records
    )


@pytest.mark.usefixtures("plane")
def test_a_gateway_whose_kv_bind_fails_logs_it_once_shows_it_and_serves_on(
    busy_port: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    """F12: the gateway started silently; only ``socket_errors`` moved (native)."""
    endpoint = f"tcp://127.0.0.1:{busy_port.getsockname()[1]}"
    fields = [{"kv_events": endpoint, "kv_events_bind": True, "topic": "kv@a"}]

    async def body() -> None:
        async with rig(engines=1, engine_fields=fields) as r:
            worker = r.gateway.config.engines[0].worker_id
            assert r.metric("llmsched_gateway_kv_events_failing_sockets") == 1
            assert (await r.complete("hello")).status == 200
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while r.metric("llmsched_gateway_kv_events_total", counter="socket_errors") < 3:
                assert loop.time() < deadline, "the bind is not retried"
                await asyncio.sleep(0.05)
            warnings = _warnings(caplog, endpoint)
            assert len(warnings) == 1, warnings
            assert (
                f"engine {worker}: cannot bind {endpoint}: Address already in use" in (warnings[0])
            )
            busy_port.close()
            while r.metric("llmsched_gateway_kv_events_failing_sockets") != 0:
                assert loop.time() < deadline + 5, "never bound"
                await asyncio.sleep(0.05)
            assert (await r.complete("hello again")).status == 200

    with caplog.at_level(logging.INFO, logger="llmsched"):
        run(body())
