"""NativeKVEventSubscriber's own ZMTP against hostile peers (probe 48 F2), beside real libzmq
publishers: a frame header declaring 1 TiB on the bound SUB socket, on a connecting one and on
the replay socket; a silent peer and garbage. The feed survives, counts each (decode_errors for
a protocol violation, socket_errors for a handshake that does not finish), and keeps applying a
well-behaved publisher's batches. The Python subscriber's libzmq is not what is tested here."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from llmsched import PrefixIndex
from llmsched.integrations import EngineSpec, NativeKVEventSubscriber
from llmsched.testing import FakeKVPublisher, event_batch, stored_event

BLOCK = 4
FAST = {"backoff_s": (0.01, 0.05), "replay_timeout_s": 2.0}
WAIT_S = 10.0
# ZMTP 3.0 greeting, NULL mechanism; then the probe's long frame of 1 TiB (no body sent).
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
TERABYTE = b"\x02" + struct.pack(">Q", 1 << 40) + b"A" * 64


def batch(i: int) -> bytes:
    event = stored_event([1000 + i], None, [i, i + 1, i + 2, i + 3], BLOCK)
    return event_batch(event, ts=float(i))


def wait(sub: NativeKVEventSubscriber, cond: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    assert sub.wait_for(cond, WAIT_S), repr(sub.counters())
    return sub.counters()


def publish_until(sub: NativeKVEventSubscriber, eng: FakeKVPublisher, batches: int) -> None:
    assert eng.wait_subscribed()
    for i in range(batches):
        eng.publish(batch(i))
    wait(sub, lambda c: c["batches"] >= batches)


class HostileListener:
    """A TCP listener answering every connection with ``payload`` (the feed's connecting SUB
    or its replay DEALER dials it; its TCP probes are answered too, harmlessly)."""

    def __init__(self, payload: bytes) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.payload = payload
        self.served = 0
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            try:
                conn.sendall(self.payload)
                self.served += 1
            except OSError:
                pass
            self.conns.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for conn in self.conns:
            conn.close()
        self.sock.close()


@pytest.fixture
def hostile() -> Iterator[HostileListener]:
    listener = HostileListener(GREETING + TERABYTE)
    yield listener
    listener.close()


def bound_spec(topic: str) -> EngineSpec:
    return EngineSpec(
        "127.0.0.1", 8000, kv_events="tcp://127.0.0.1:*", kv_events_bind=True, topic=topic
    )


def test_terabyte_frame_on_the_bound_socket_drops_only_that_peer() -> None:
    index = PrefixIndex(block_size=BLOCK)
    spec = bound_spec("kv")
    with NativeKVEventSubscriber(index, [spec], **FAST) as sub:
        endpoint = sub.bound_endpoint(spec.worker_id)
        assert endpoint is not None
        port = int(endpoint.rsplit(":", 1)[1])
        with FakeKVPublisher(topic="kv", endpoint=endpoint, connect=True, replay=False) as eng:
            publish_until(sub, eng, 5)
            # The probe's 73 bytes: no READY, a long frame declaring 1 TiB.
            with socket.create_connection(("127.0.0.1", port)) as peer:
                peer.sendall(GREETING + TERABYTE)
                c = wait(sub, lambda c: c["decode_errors"] >= 1)
                peer.settimeout(WAIT_S)
                greeting_back = peer.recv(64)
                assert greeting_back[:1] == b"\xff"
                while peer.recv(4096):  # then closed by the feed
                    pass
            for i in range(5, 10):
                eng.publish(batch(i))
            c = wait(sub, lambda c: c["batches"] >= 10)
    assert c["decode_errors"] == 1 and c["gaps"] == 0
    assert len(index.holdings(spec.worker_id)) == 10


def test_silent_and_garbage_peers_are_dropped_and_counted() -> None:
    index = PrefixIndex(block_size=BLOCK)
    spec = bound_spec("kv")
    with NativeKVEventSubscriber(index, [spec], **FAST) as sub:
        endpoint = sub.bound_endpoint(spec.worker_id)
        assert endpoint is not None
        address = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        silent = socket.create_connection(address)  # never greets
        garbage = socket.create_connection(address)
        garbage.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        curve = socket.create_connection(address)
        curve.sendall(GREETING[:12] + b"CURVE".ljust(20, b"\x00"))
        with FakeKVPublisher(topic="kv", endpoint=endpoint, connect=True, replay=False) as eng:
            publish_until(sub, eng, 5)
            c = wait(sub, lambda c: c["decode_errors"] >= 2)
            # The silent peer is dropped at the connect timeout (2 s).
            started = time.monotonic()
            c = wait(sub, lambda c: c["socket_errors"] >= 1)
            assert time.monotonic() - started < 5.0
            silent.settimeout(WAIT_S)
            assert silent.recv(64)[:1] == b"\xff"  # our greeting, then the close
            assert silent.recv(4096) == b""
            for i in range(5, 8):
                eng.publish(batch(i))
            c = wait(sub, lambda c: c["batches"] >= 8)
        for s in (silent, garbage, curve):
            s.close()
    assert c["decode_errors"] == 2 and c["socket_errors"] == 1 and c["connects"] == 1
    assert len(index.holdings(spec.worker_id)) == 8


def test_terabyte_frame_from_the_publisher_it_connects_to(hostile: HostileListener) -> None:
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec("127.0.0.1", 8000, kv_events=hostile.endpoint, topic="kv")
    with NativeKVEventSubscriber(index, [spec], **FAST) as sub:
        wait(sub, lambda c: c["decode_errors"] >= 2)  # dropped, connected again, dropped
        # The endpoint answers TCP but not as a publisher: the socket is failing.
        failing = sub.failing_sockets()
        assert list(failing) == [hostile.endpoint], failing
        assert "handshake failed" in failing[hostile.endpoint]
        hostile.close()
        # A well-behaved publisher on the same port: the feed connects to it with its backoff.
        with FakeKVPublisher(topic="kv", endpoint=hostile.endpoint, replay=False) as eng:
            publish_until(sub, eng, 5)
            assert sub.failing_sockets() == {}
        c = sub.counters()
    assert c["decode_errors"] >= 2 and c["batches"] == 5
    assert len(index.holdings(spec.worker_id)) == 5


def test_terabyte_frame_from_the_replay_socket(hostile: HostileListener) -> None:
    index = PrefixIndex(block_size=BLOCK)
    with FakeKVPublisher(topic="kv", replay=False) as eng:
        spec = EngineSpec(
            "127.0.0.1", 8000, kv_events=eng.endpoint, replay=hostile.endpoint, topic="kv"
        )
        options = {**FAST, "replay_timeout_s": 0.5}
        with NativeKVEventSubscriber(index, [spec], **options) as sub:
            c = wait(sub, lambda c: c["decode_errors"] >= 1)
            publish_until(sub, eng, 5)
            # A gap asks the (hostile) replay socket; it times out and the stream resyncs.
            eng.publish(batch(5), deliver=False)
            for i in range(6, 9):
                eng.publish(batch(i))
            c = wait(sub, lambda c: c["gaps"] >= 1 and c["batches"] >= 8)
    assert hostile.served >= 1 and c["decode_errors"] >= 1
    assert c["replay_timeouts"] >= 1 and c["resyncs"] >= 1
    assert len(index.holdings(spec.worker_id)) >= 3  # what came after the resync


def test_libzmq_heartbeats_are_answered() -> None:
    """A libzmq publisher with heartbeats (PING every 50 ms, a peer silent for 300 ms dropped)
    keeps its one connection: the feed answers PING with PONG."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.HEARTBEAT_IVL, 50)
    pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(block_size=BLOCK)
    spec = EngineSpec("127.0.0.1", 8000, kv_events=f"tcp://127.0.0.1:{port}", topic="kv")
    try:
        with NativeKVEventSubscriber(index, [spec], **FAST) as sub:
            assert pub.poll(int(WAIT_S * 1000)), "no subscription"
            # Every topic (the feed refuses other topics itself, counting them; probe 81).
            assert pub.recv() == b"\x01"
            time.sleep(1.0)  # twenty heartbeats
            for i in range(5):
                pub.send_multipart([b"kv", i.to_bytes(8, "big"), batch(i)])
            c = wait(sub, lambda c: c["batches"] >= 5)
    finally:
        pub.close()
        ctx.term()
    assert c["connects"] == 1 and c["disconnects"] == 0 and c["decode_errors"] == 0


def test_a_dropped_peer_is_logged_through_logging(caplog: pytest.LogCaptureFixture) -> None:
    """The first peer an endpoint drops is a WARNING of the ``llmsched`` logger naming the
    engine, the endpoint and why (it went to stderr, out of reach of the embedder's logging);
    the socket is not listed as failing for it."""
    index = PrefixIndex(block_size=BLOCK)
    spec = bound_spec("kv")
    with (
        caplog.at_level("WARNING", logger="llmsched"),
        NativeKVEventSubscriber(index, [spec], **FAST) as sub,
    ):
        endpoint = sub.bound_endpoint(spec.worker_id)
        assert endpoint is not None
        port = int(endpoint.rsplit(":", 1)[1])
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port)) as peer:
                peer.sendall(b"GET / HTTP/1.1\r\n\r\n")
                peer.settimeout(WAIT_S)
                while peer.recv(4096):
                    pass
        wait(sub, lambda c: c["decode_errors"] >= 2)
        assert sub.failing_sockets() == {}
    drops = [r.getMessage() for r in caplog.records if "dropped the connection" in r.getMessage()]
    assert len(drops) == 1, drops
    assert spec.worker_id in drops[0] and endpoint in drops[0]
    assert "decode_errors" in drops[0]
