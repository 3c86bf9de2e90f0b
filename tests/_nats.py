"""A real NATS server for the tests: Debian's ``nats-server`` on loopback, per test (the ``bus``
fixture), and the router the cluster tests sync over it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsched import EndpointPool, PrefixIndex, Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A real nats-server on loopback, stoppable and restartable on the same port."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


def nats_binary() -> str:
    found = shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
    )
    if found is None:
        message = "nats-server is not installed (make servers installs Debian's nats-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(name="bus")
def bus_fixture() -> Iterator[NatsServer]:
    """A nats-server started for the test and killed after it (stopped by SIGSTOP or not)."""
    server = NatsServer(nats_binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()


ENDPOINTS = ["e0", "e1", "e2", "e3"]
# Prefix and session affinity plus llm-d's active-request scorer: the in-flight counts matter.
CONFIG = {
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "active-request-scorer"},
        {"type": "session-affinity-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "active-request-scorer", "weight": 2},
                {"pluginRef": "session-affinity-scorer", "weight": 10},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def cluster_router(seed: int = 0) -> Router:
    """A router over ``ENDPOINTS`` with ``CONFIG``, the one the cluster tests sync."""
    pool = EndpointPool(ENDPOINTS, stale_policy="ignore")
    return Router(pool, PrefixIndex(block_size=16), config=CONFIG, seed=seed)
