"""Kubernetes discovery against a list/watch API server on loopback (llmsched.testing.kube_api),
through the real ``kubernetes_asyncio`` client: Ready pods only, roles, bookmarks, 410 Gone,
cut streams, server errors with backoff, and the periodic resync."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes_asyncio")

import aiohttp  # a dependency of kubernetes_asyncio
from kubernetes_asyncio import client as k8s

from llmsched.errors import ConfigError
from llmsched.integrations.identity import EngineSpec
from llmsched.integrations.kubernetes import (
    KubernetesDiscovery,
    PodSelector,
)
from llmsched.testing.kube_api import FakeKubeAPI, LabelSelector

NS = "llm"
APP = {"app": "vllm"}


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


class Rig:
    def __init__(self, api: FakeKubeAPI, discovery: KubernetesDiscovery) -> None:
        self.api = api
        self.discovery = discovery
        self.updates: list[tuple[EngineSpec, ...]] = []

    def names(self) -> list[str | None]:
        return [e.name for e in self.discovery.engines()]

    async def until(self, check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not check():
            if loop.time() > end:
                raise AssertionError(f"timed out waiting for {what}: {self.names()}")
            await asyncio.sleep(0.02)


@asynccontextmanager
async def rig(**options: Any) -> AsyncIterator[Rig]:
    api = FakeKubeAPI(bookmark_s=options.pop("bookmark_s", 0.1))
    url = await api.start()
    configuration = k8s.Configuration(host=url)
    api_client = k8s.ApiClient(configuration)
    selector = options.pop("selector", PodSelector(NS, APP, 8000, role_label="llm-d.ai/role"))
    holder: list[Rig] = []

    async def on_change(engines: tuple[EngineSpec, ...]) -> None:
        holder[0].updates.append(engines)

    options.setdefault("backoff_initial_s", 0.05)
    options.setdefault("backoff_max_s", 0.2)
    options.setdefault("settle_s", 0.0)
    discovery = KubernetesDiscovery(selector, on_change, api_client=api_client, **options)
    holder.append(Rig(api, discovery))
    task = asyncio.create_task(discovery.run())
    try:
        yield holder[0]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await api_client.close()
        await api.stop()


def test_only_ready_selected_pods_become_engines_with_roles() -> None:
    async def body() -> None:
        async with rig() as r:
            r.api.put_pod(NS, "p0", {**APP, "llm-d.ai/role": "prefill"}, "10.0.0.1")
            r.api.put_pod(NS, "d0", {**APP, "llm-d.ai/role": "decode"}, "10.0.0.2")
            r.api.put_pod(NS, "starting", APP, "10.0.0.3", ready=False)
            r.api.put_pod(NS, "pending", APP, None, phase="Pending", ready=False)
            r.api.put_pod(NS, "leaving", APP, "10.0.0.4", deleting=True)
            r.api.put_pod(NS, "other-app", {"app": "web"}, "10.0.0.5")
            r.api.put_pod("elsewhere", "x", APP, "10.0.0.6")
            r.api.put_pod(NS, "odd-role", {**APP, "llm-d.ai/role": "leader"}, "10.0.0.7")
            await r.discovery.synced.wait()
            await r.until(lambda: r.names() == ["d0", "p0"], "two engines")
            by_name = {e.name: e for e in r.discovery.engines()}
            assert (by_name["p0"].host, by_name["p0"].port, by_name["p0"].role) == (
                "10.0.0.1",
                8000,
                "prefill",
            )
            assert by_name["d0"].role == "decode"
            assert by_name["p0"].labels["pod"] == "p0"
            assert r.discovery.counters()["skipped"] >= 1  # the pod with role "leader"
            # Turning Ready adds it; turning unready or deleted removes it.
            r.api.put_pod(NS, "starting", APP, "10.0.0.3", ready=True)
            await r.until(lambda: "starting" in r.names(), "starting to join")
            r.api.put_pod(NS, "p0", {**APP, "llm-d.ai/role": "prefill"}, "10.0.0.1", ready=False)
            await r.until(lambda: "p0" not in r.names(), "p0 to leave")
            r.api.delete_pod(NS, "d0")
            await r.until(lambda: r.names() == ["starting"], "d0 to go")
            # Labels that stop matching take the pod out (the watch sends DELETED).
            r.api.put_pod(NS, "starting", {"app": "web"}, "10.0.0.3")
            await r.until(lambda: r.names() == [], "no engines")
            assert r.updates[-1] == ()
            assert r.discovery.counters()["lists"] == 1, "all of it through one watch"

    run(body())


def test_an_ip_change_is_a_changed_engine() -> None:
    async def body() -> None:
        async with rig() as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            r.api.put_pod(NS, "a", APP, "10.0.0.9")
            await r.until(lambda: r.discovery.engines()[0].host == "10.0.0.9", "new address")

    run(body())


def test_bookmarks_let_a_cut_watch_resume_without_listing() -> None:
    async def body() -> None:
        async with rig(bookmark_s=0.05) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            # Changes elsewhere move the version on; bookmarks carry it to the watcher.
            for i in range(5):
                r.api.put_pod("elsewhere", f"x{i}", APP, "10.0.1.1")
            bookmarks = r.discovery.counters()["bookmarks"]
            await r.until(lambda: r.discovery.counters()["bookmarks"] > bookmarks + 1, "bookmarks")
            r.api.compact()  # history before now is gone...
            r.api.drop_watches()  # ...and the stream is cut
            r.api.put_pod(NS, "b", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["a", "b"], "b after the cut")
            counters = r.discovery.counters()
            assert counters["lists"] == 1, "resumed from the bookmark, no 410, no list"
            assert counters["gone"] == 0
            assert counters["watches"] >= 2

    run(body())


def test_gone_relists_and_recovers_missed_changes() -> None:
    async def body() -> None:
        # Without bookmarks the watcher's version stays at its last event, so it expires.
        async with rig(bookmark_s=3600) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            r.api.put_pod(NS, "b", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["a", "b"], "a, b")
            r.api.drop_watches()
            r.api.delete_pod(NS, "a")
            r.api.put_pod(NS, "c", APP, "10.0.0.3")
            r.api.compact()
            await r.until(lambda: r.names() == ["b", "c"], "the missed changes")
            counters = r.discovery.counters()
            assert counters["lists"] >= 2

    run(body())


def test_server_errors_back_off_and_recover() -> None:
    async def body() -> None:
        async with rig() as r:
            r.api.fail_next(3, status=500)
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a after the errors")
            assert r.discovery.counters()["errors"] >= 3

    run(body())


def test_resync_lists_again_while_the_watch_is_healthy() -> None:
    async def body() -> None:
        async with rig(resync_s=0.3, watch_timeout_s=0.3) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.discovery.counters()["lists"] >= 3, "resyncs")
            assert r.names() == ["a"]
            assert r.discovery.counters()["errors"] == 0

    run(body())


def test_a_slow_start_reports_no_engines_until_the_first_list() -> None:
    async def body() -> None:
        async with rig() as r:
            assert r.discovery.engines() == ()
            await r.discovery.synced.wait()
            assert r.updates == [()]

    run(body())


def test_selector_validation() -> None:
    with pytest.raises(ConfigError, match="selector must not be empty"):
        PodSelector(NS, {}, 8000)
    with pytest.raises(ConfigError, match="target_port"):
        PodSelector(NS, APP, 0)
    with pytest.raises(ConfigError, match="replay_port needs kv_events_port"):
        PodSelector(NS, APP, 8000, replay_port=5558)
    with pytest.raises(ConfigError, match="unknown key 'port'"):
        PodSelector.from_dict({"namespace": NS, "selector": APP, "port": 1})
    selector = PodSelector.from_dict(
        {"namespace": NS, "selector": "app=vllm,tier in (a,b)", "target_port": 8000}
    )
    assert selector.label_selector() == "app=vllm,tier in (a,b)"
    with pytest.raises(ConfigError, match="resync_s"):

        async def noop(engines: tuple[EngineSpec, ...]) -> None:
            return None

        KubernetesDiscovery(selector, noop, resync_s=0)


def test_kv_event_endpoints_follow_the_pod_address() -> None:
    async def body() -> None:
        selector = PodSelector(NS, APP, 8000, kv_events_port=5557, replay_port=5558, topic="kv")
        async with rig(selector=selector) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            engine = r.discovery.engines()[0]
            assert (engine.kv_events, engine.replay, engine.topic) == (
                "tcp://10.0.0.1:5557",
                "tcp://10.0.0.1:5558",
                "kv",
            )

    run(body())


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("app=vllm", {"app": "vllm"}, True),
        ("app==vllm", {"app": "web"}, False),
        ("app!=web", {}, True),
        ("tier in (a, b)", {"tier": "b"}, True),
        ("tier notin (a,b)", {"tier": "a"}, False),
        ("canary", {"canary": ""}, True),
        ("!canary", {"canary": "1"}, False),
        ("app=vllm,tier in (a),!canary", {"app": "vllm", "tier": "a"}, True),
    ],
)
def test_fake_server_label_selectors(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert LabelSelector.parse(selector).matches(labels) is expected


def test_the_fake_server_stops_at_once_with_a_watch_whose_client_left() -> None:
    # A watch handler whose client has gone waits for changes until its own timeout, and the
    # server's cleanup waits for running handlers (up to a minute): stop() ends them. CI once
    # timed out a discovery test here.
    async def body() -> None:
        api = FakeKubeAPI(bookmark_s=3600)
        url = await api.start()
        async with aiohttp.ClientSession() as session:
            watch = f"{url}/api/v1/namespaces/{NS}/pods?watch=1&timeoutSeconds=1800"
            response = await session.get(watch)
            assert response.status == 200
            response.close()  # the client leaves without the server writing anything
        while api.watches < 1:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(api.stop(), 10)
        assert api.watches == 1

    run(body())


# -- probe 50: a hostile or broken API server ------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b'{"kind": "Status", "status": "Failure"}',  # no type, no object, no code
        b'{"type": "BOOKMARK", "object": {"kind": "Pod"}}',  # a bookmark with no version
        b"[1, 2]",
        b"not json",
        b'{"type": "ADDED", "object": {"metadata": {"name": 5, "resourceVersion": "9"}}}',
        b'{"type": "ADDED", "object": {"metadata": {"name": "x"}}}',
        b'{"type": "RESTARTED", "object": {"metadata": {"resourceVersion": "9"}}}',
        # Longer than the client reads as one line (aiohttp's LineTooLong, a bare Exception).
        pytest.param(b'{"type": "' + b"A" * (5 << 20) + b'"}', id="a-5-MiB-line"),
    ],
)
def test_garbage_on_the_watch_does_not_end_discovery(line: bytes) -> None:
    # The client raises bare Exceptions for some lines, and a pod named 5 once stopped every
    # later update (the publisher task died sorting names): discovery went quiet for good.
    async def body() -> None:
        async with rig() as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            r.api.send_raw(line)
            await r.until(lambda: r.discovery.counters()["errors"] >= 1, "the error counted")
            r.api.put_pod(NS, "b", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["a", "b"], "b after the garbage")

    run(body())


def test_a_failed_list_reports_the_api_message(caplog: pytest.LogCaptureFixture) -> None:
    # The client leaves the status of a raw answer unchecked: a 403 (missing RBAC) was logged
    # as "unreadable answer: KeyError('resourceVersion')", without the API's reason.
    async def body() -> None:
        async with rig() as r:
            await r.discovery.synced.wait()
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            forbidden = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": 'pods is forbidden: User "x" cannot list resource "pods"',
                "reason": "Forbidden",
                "code": 403,
            }
            r.api.drop_watches()  # the next watch gets 410, then the list gets the 403
            r.api.fail_next(
                1,
                200,
                b'{"type": "ERROR", "object": {"code": 410, '
                b'"reason": "Expired", "message": "too old"}}',
            )
            r.api.fail_next(1, 403, json.dumps(forbidden).encode())
            await r.until(lambda: r.discovery.counters()["errors"] >= 1, "the error")
            await r.until(lambda: r.discovery.counters()["lists"] >= 2, "the list again")
            assert r.names() == ["a"]

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body())
    assert any("403" in m and "pods is forbidden" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("status", [503, 200])
def test_a_watch_that_ends_at_once_backs_off(status: int) -> None:
    # A proxy with no backend answering at once with an empty body: the watcher reopened the
    # watch at once, in a tight loop, without counting an error.
    async def body() -> None:
        async with rig() as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            r.api.fail_next(3, status, b"")
            r.api.drop_watches()
            await r.until(lambda: r.discovery.counters()["errors"] >= 3, "three errors")
            r.api.put_pod(NS, "b", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["a", "b"], "b")

    run(body())


def test_an_unanswered_watch_times_out() -> None:
    # The client's default is no timeout: a watch (or list) never answered stalled discovery.
    async def body() -> None:
        async with rig(watch_timeout_s=1.0, request_timeout_s=0.2) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            r.api.hang_next(1)
            r.api.drop_watches()
            await r.until(lambda: r.discovery.counters()["errors"] >= 1, "a timeout")
            r.api.put_pod(NS, "b", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["a", "b"], "b")

    run(body())


def _event(kind: str, name: str, version: int, **fields: Any) -> bytes:
    metadata = {"name": name, "resourceVersion": str(version), "labels": APP}
    metadata.update(fields.pop("metadata", {}))
    return json.dumps({"type": kind, "object": {"metadata": metadata, **fields}}).encode()


READY = [{"type": "Ready", "status": "True"}]


def test_llm_ds_combined_role_values_are_read_as_its_role_filters_do() -> None:
    """Probe 54 F11: llm-d labels pods ``llm-d.ai/role`` with combined roles too; its decode
    filter admits prefill-decode and encode-prefill-decode, its prefill filter those and
    encode-prefill (filter/bylabel/roles.go). Those pods were left out as unknown roles; an
    encode-only pod still is (no encode stage)."""

    async def body() -> None:
        async with rig() as r:
            for name, role, ip in [
                ("pd", "prefill-decode", "10.0.0.1"),
                ("epd", "encode-prefill-decode", "10.0.0.2"),
                ("ep", "encode-prefill", "10.0.0.3"),
                ("e", "encode", "10.0.0.4"),
            ]:
                r.api.put_pod(NS, name, {**APP, "llm-d.ai/role": role}, ip)
            await r.until(lambda: len(r.names()) == 3, "three engines")
            roles = {e.name: e.role for e in r.discovery.engines()}
            assert roles == {"pd": "both", "epd": "both", "ep": "prefill"}
            assert "e" in r.discovery.skipped_pods()

    asyncio.run(body())


def test_malformed_pods_are_skipped_and_discovery_goes_on() -> None:
    # Fields of the wrong type killed the task that hands engines on: no update after that.
    selector = PodSelector(NS, APP, 8000, role_label="role", kv_events_port=5557)
    bad_pods: list[tuple[str, dict[str, Any], str | None]] = [
        ("status-text", {"status": "Running"}, None),
        (
            "conditions-ints",
            {"status": {"phase": "Running", "podIP": "10.0.1.1", "conditions": [1, None]}},
            None,
        ),
        (
            "ip-int",
            {"status": {"phase": "Running", "podIP": 5, "conditions": READY}},
            "is not an IP address",
        ),
        (
            "ip-name",
            {"status": {"phase": "Running", "podIP": "evil.example", "conditions": READY}},
            "is not an IP address",
        ),
        (
            "labels-list",
            {
                "metadata": {"labels": ["role"]},
                "status": {"phase": "Running", "podIP": "10.0.1.2", "conditions": READY},
            },
            "labels are not an object",
        ),
        (
            "Not_A_Pod_Name",
            {"status": {"phase": "Running", "podIP": "10.0.1.3", "conditions": READY}},
            "is not a pod name",
        ),
    ]

    async def body() -> None:
        async with rig(selector=selector) as r:
            r.api.put_pod(NS, "a", APP, "10.0.0.1")
            await r.until(lambda: r.names() == ["a"], "a")
            for name, fields, _ in bad_pods:
                r.api.send_raw(_event("ADDED", name, r.api.version, **fields))
            r.api.put_pod(NS, "b", APP, "fd00::2")
            await r.until(lambda: r.names() == ["a", "b"], "b after the malformed pods")
            skipped = r.discovery.skipped_pods()
            for name, _, why in bad_pods:
                if why is None:
                    assert name not in skipped, skipped  # not Ready: not an engine, quietly
                else:
                    assert why in skipped[name], skipped
            b = r.discovery.engines()[1]
            assert (b.address, b.kv_events) == ("[fd00::2]:8000", "tcp://[fd00::2]:5557")

    run(body())


def test_two_pods_at_one_address_are_one_engine(caplog: pytest.LogCaptureFixture) -> None:
    # hostNetwork pods on one node, or an IP given again while a stale pod still reads Ready:
    # both were routed to, as two engines that are one.
    async def body() -> None:
        async with rig() as r:
            r.api.put_pod(NS, "old", APP, "10.0.0.1")
            r.api.put_pod(NS, "new", APP, "10.0.0.1")
            r.api.put_pod(NS, "other", APP, "10.0.0.2")
            await r.until(lambda: r.names() == ["new", "other"], "one engine per address")
            assert "also pod new's" in r.discovery.skipped_pods()["old"]
            assert r.discovery.counters()["duplicates"] >= 1
            r.api.put_pod(NS, "c", APP, "10.0.0.3")  # another update, the same duplicate
            await r.until(lambda: r.names() == ["c", "new", "other"], "c")
            r.api.delete_pod(NS, "new")
            await r.until(lambda: r.names() == ["c", "old", "other"], "old takes over")
            assert r.discovery.skipped_pods() == {}

    with caplog.at_level(logging.WARNING, logger="llmsched"):
        run(body())
    logged = [m for m in caplog.messages if "pod old is not routed to" in m]
    assert len(logged) == 1, caplog.messages


def test_a_set_on_change_refused_is_offered_again() -> None:
    # engines() reported a set the receiver had refused, and the set was never offered again
    # unless the pods changed once more.
    async def body() -> None:
        api = FakeKubeAPI(bookmark_s=0.1)
        url = await api.start()
        api_client = k8s.ApiClient(k8s.Configuration(host=url))
        calls: list[tuple[str | None, ...]] = []

        async def on_change(engines: tuple[EngineSpec, ...]) -> None:
            calls.append(tuple(e.name for e in engines))
            if len(calls) in (2, 3):
                raise RuntimeError("the receiver is busy")

        selector = PodSelector(NS, APP, 8000)
        discovery = KubernetesDiscovery(
            selector, on_change, api_client=api_client, settle_s=0.0, backoff_initial_s=0.05
        )
        task = asyncio.create_task(discovery.run())
        try:
            await discovery.synced.wait()
            api.put_pod(NS, "a", APP, "10.0.0.1")
            for _ in range(500):
                if len(calls) >= 4:
                    break
                await asyncio.sleep(0.02)
            assert calls == [(), ("a",), ("a",), ("a",)]
            assert [e.name for e in discovery.engines()] == ["a"]
            counters = discovery.counters()
            assert (counters["callback_errors"], counters["updates"]) == (2, 2)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await api_client.close()
            await api.stop()

    run(body())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"resync_s": float("inf")}, "resync_s"),
        ({"watch_timeout_s": float("inf")}, "watch_timeout_s"),
        ({"watch_timeout_s": 10**400}, "watch_timeout_s"),
        ({"settle_s": float("nan")}, "settle_s"),
        ({"settle_s": True}, "settle_s"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
    ],
)
def test_discovery_numbers_are_checked(options: dict[str, Any], message: str) -> None:
    # resync_s=inf ("never") was accepted and then ended the task (int(inf) in the watch).
    async def noop(engines: tuple[EngineSpec, ...]) -> None:
        return None

    with pytest.raises(ConfigError, match=message):
        KubernetesDiscovery(PodSelector(NS, APP, 8000), noop, **options)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"selector": {"app": "vllm,tier!=a"}}, "not a label value"),
        ({"selector": {"app": "vllm, llama"}}, "not a label value"),
        ({"selector": {"app": 1}}, "not a label value"),
        ({"selector": {"a b": "x"}}, "not a label key"),
        ({"namespace": "LLM"}, "namespace"),
        ({"namespace": "llm/other"}, "namespace"),
        ({"role_label": "role=x"}, "role_label"),
        ({"labels": {"zone": 1}}, "labels"),
        ({"labels": {"pod": "x"}}, "'pod'"),
        ({"topic": 5}, "topic"),
        ({"model": ""}, "model"),
    ],
)
def test_pod_selector_refuses_what_kubernetes_would(fields: dict[str, Any], message: str) -> None:
    # A selector value with a comma selected other pods than meant; labels, topic or model of
    # the wrong type skipped every pod at run time instead of failing here.
    raw: dict[str, Any] = {"namespace": NS, "selector": APP, "target_port": 8000, **fields}
    with pytest.raises(ConfigError, match=message):
        PodSelector.from_dict(raw)


def test_pod_selector_from_dict_and_hash() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        PodSelector.from_dict(["namespace"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key 1"):
        PodSelector.from_dict({1: "x", "namespace": NS})  # type: ignore[dict-item]
    labels = {"app": "vllm"}
    selector = PodSelector(NS, labels, 8000, role_label="llm-d.ai/role")
    labels["app"] = "web"  # the caller's dict, changed later
    assert selector.label_selector() == "app=vllm"
    assert hash(selector) == hash(
        PodSelector(NS, {"app": "vllm"}, 8000, role_label="llm-d.ai/role")
    )


def test_a_client_that_cannot_be_configured_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client's ConfigException (a bare Exception) ended run() at once.
    async def noop(engines: tuple[EngineSpec, ...]) -> None:
        return None

    selector = PodSelector(NS, APP, 8000)
    missing = str(tmp_path / "no-kubeconfig")
    with pytest.raises(ConfigError, match="cannot load kubeconfig"):
        run(KubernetesDiscovery(selector, noop, kubeconfig=missing).run())
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="in-cluster service account"):
        run(KubernetesDiscovery(selector, noop).run())


# How a cancelled watch request surfaces from the HTTP client: as CancelledError; as a
# TimeoutError (aiohttp's request timer firing at the same moment converts it); as a
# TimeoutError with the task's cancellation taken back (aiohttp's timer calls uncancel() before
# it raises; Python 3.10 keeps no cancellation count at all, so nothing tells it apart).
CANCEL_FORMS = ("cancelled", "timeout", "timeout, uncancelled")


def held_watch(monkeypatch: pytest.MonkeyPatch, form: str, opened: list[int]) -> None:
    """Watches that stay open with nothing to say and end, when first cancelled, in ``form``
    (see CANCEL_FORMS; the timer fires once: a later cancellation goes through); lists go to
    the fake API server."""
    original = k8s.CoreV1Api.list_namespaced_pod
    converted: list[int] = []

    async def list_namespaced_pod(self: k8s.CoreV1Api, namespace: str, **kwargs: Any) -> Any:
        if not kwargs.get("watch"):
            return await original(self, namespace, **kwargs)
        opened.append(1)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as cancel:
            if form == "cancelled" or converted:
                raise
            converted.append(1)
            task = asyncio.current_task()
            if form == "timeout, uncancelled" and task is not None:
                task.uncancel()
            raise asyncio.TimeoutError from cancel
        raise AssertionError("unreachable")

    monkeypatch.setattr(k8s.CoreV1Api, "list_namespaced_pod", list_namespaced_pod)


@asynccontextmanager
async def watching(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> AsyncIterator[tuple[KubernetesDiscovery, asyncio.Task[None], list[int]]]:
    """A watcher whose watch is held open (see :func:`held_watch`), running, synced and
    watching; its task and the watches it opened."""
    opened: list[int] = []
    held_watch(monkeypatch, form, opened)
    api = FakeKubeAPI()
    url = await api.start()
    api_client = k8s.ApiClient(k8s.Configuration(host=url))

    async def on_change(engines: tuple[EngineSpec, ...]) -> None:
        pass

    discovery = KubernetesDiscovery(
        PodSelector(NS, APP, 8000),
        on_change,
        api_client=api_client,
        backoff_initial_s=0.01,
        backoff_max_s=0.01,
        settle_s=0.0,
    )
    task = asyncio.create_task(discovery.run())
    try:
        await discovery.synced.wait()
        while not opened:
            await asyncio.sleep(0.01)
        yield discovery, task, opened
    finally:
        for _ in range(2):  # on a regression, a first cancellation converted is retried
            task.cancel()
            if (await asyncio.wait((task,), timeout=10.0))[0]:
                break
        await api_client.close()
        await api.stop()


def quiet_stop(caplog: pytest.LogCaptureFixture, discovery: KubernetesDiscovery) -> None:
    """Nothing logged or counted as trouble by the stop."""
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == []
    assert discovery.counters()["errors"] == 0


@pytest.mark.parametrize("form", CANCEL_FORMS)
def test_stop_ends_a_watch_whatever_its_cancellation_became(
    form: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """stop() during a watch ends the watcher at once and quietly, also where the client turned
    the cancellation into a TimeoutError (taken for a connection timeout: logged, counted,
    retried, and the stop waited on a watcher that never ended)."""
    caplog.set_level(logging.WARNING, logger="llmsched")

    async def body() -> None:
        async with watching(monkeypatch, form) as (discovery, task, opened):
            stop = asyncio.ensure_future(discovery.stop())
            done, _ = await asyncio.wait((stop,), timeout=10.0)
            assert stop in done, "stop() hung: the watcher ran on"
            assert task.cancelled()
            assert opened == [1]  # not opened again
            quiet_stop(caplog, discovery)
            await discovery.stop()  # again: a no-op

    run(body())


@pytest.mark.parametrize("form", CANCEL_FORMS[:2])
def test_a_cancelled_watcher_task_ends_whatever_its_cancellation_became(
    form: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bare task.cancel() too, while the task still counts its cancellation (Python 3.11
    and later; one taken back is only told apart by stop())."""
    if form != "cancelled" and sys.version_info < (3, 11):
        pytest.skip("Python 3.10 keeps no cancellation count: stop() is the way")
    caplog.set_level(logging.WARNING, logger="llmsched")

    async def body() -> None:
        async with watching(monkeypatch, form) as (discovery, task, opened):
            task.cancel()
            done, _ = await asyncio.wait((task,), timeout=10.0)
            assert task in done, "the cancelled watcher ran on"
            assert task.cancelled()
            assert opened == [1]
            quiet_stop(caplog, discovery)

    run(body())


@pytest.mark.parametrize("form", CANCEL_FORMS)
def test_pod_discovery_stops_quietly_during_a_watch(
    form: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway's PodDiscovery.stop() (what ``llmsched serve`` runs at shutdown) during a
    watch: ended at once, nothing logged, no discovery error counted."""
    from llmsched.gateway.config import load_config
    from llmsched.gateway.pod_discovery import PodDiscovery

    caplog.set_level(logging.WARNING, logger="llmsched")
    opened: list[int] = []
    held_watch(monkeypatch, form, opened)
    errors: list[int] = []

    class Receiver:
        async def set_engines(self, engines: Any, *, allow_empty: bool = False) -> Any:
            return [], []

    async def body() -> None:
        api = FakeKubeAPI()
        url = await api.start()
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: fake, cluster: {{server: '{url}'}}}}]\n"
            "users: [{name: fake, user: {token: test}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            "current-context: fake\n"
        )
        section = {
            "namespace": NS,
            "selector": APP,
            "target_port": 8000,
            "kubeconfig": str(kubeconfig),
            "settle_s": 0,
            "backoff_initial_s": 0.01,
            "backoff_max_s": 0.01,
        }
        config = load_config({"models": ["m"], "discovery": {"kubernetes": section}})
        assert config.discovery.kubernetes is not None
        pods = PodDiscovery(
            config.discovery.kubernetes, Receiver(), on_error=lambda: errors.append(1)
        )
        try:
            await pods.start()
            while not (opened and pods.stats()["synced"]):
                await asyncio.sleep(0.01)
            stop = asyncio.ensure_future(pods.stop())
            done, _ = await asyncio.wait((stop,), timeout=10.0)
            assert stop in done, "stop() hung: the watcher ran on"
            assert opened == [1]
            assert errors == []
            assert pods.stats()["counters"]["errors"] == 0
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warned == []
        finally:
            await pods.stop()
            await api.stop()

    run(body())
