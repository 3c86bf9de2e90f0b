"""``llmsched serve`` with ``discovery.kubernetes``: the real process, on both data planes,
against a list/watch API server on loopback (llmsched.testing.kube_api) and fake engines.

Each pod's IP is a loopback address of its own (127.0.0.2, 127.0.0.3, ...) where a fake engine
listens on the one ``target_port`` all pods share, as pods of a Deployment do."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

pytest.importorskip("kubernetes_asyncio")

from _gateway_harness import (  # noqa: F401
    MODEL,
    current_plane,
    plane,
    run,
    serve_processes,
    until,
)

from llmsched.errors import ConfigError
from llmsched.gateway import make_gateway
from llmsched.gateway.config import KubernetesConfig, load_config
from llmsched.integrations.kubernetes import KubernetesDiscovery
from llmsched.testing.kube_api import FakeKubeAPI
from llmsched.testing.openai_engine import FakeOpenAIEngine

NS = "llm"
APP = {"app": "vllm"}
ROLE = "llm-d.ai/role"
ADMIN_TOKEN = "admin-token-for-tests"


def _loopback_aliases() -> bool:
    """Whether 127.0.0.2 can be bound (Linux routes all of 127/8 to loopback; macOS does not)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True


pytestmark = pytest.mark.skipif(not _loopback_aliases(), reason="needs 127.0.0.2, 127.0.0.3")


@contextlib.asynccontextmanager
async def engines_at(ips: list[str]) -> AsyncIterator[tuple[int, list[FakeOpenAIEngine]]]:
    """A fake engine at each IP, all on one port (the pods' target_port); the port and the
    engines."""
    for _ in range(20):
        first = FakeOpenAIEngine(model=MODEL, host=ips[0])
        await first.start()
        fakes = [first]
        try:
            for ip in ips[1:]:
                fake = FakeOpenAIEngine(model=MODEL, host=ip, port=first.port)
                await fake.start()
                fakes.append(fake)
        except OSError:  # the port is taken on another address: try another
            for fake in fakes:
                await fake.stop()
            continue
        try:
            yield first.port, fakes
        finally:
            for fake in fakes:
                await fake.stop()
        return
    raise AssertionError("no port free on every address")


def kubeconfig(tmp_path: Path, server: str) -> str:
    """A kubeconfig whose current context is ``server`` (the fake API takes any token)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: fake, user: {token: test}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
        "current-context: fake\n"
    )
    return str(path)


def pods_config(tmp_path: Path, server: str, port: int, **fields: Any) -> dict[str, Any]:
    """A gateway config discovering the pods labelled APP in NS, with a quick watcher."""
    section = {
        "namespace": NS,
        "selector": APP,
        "target_port": port,
        "kubeconfig": kubeconfig(tmp_path, server),
        "settle_s": 0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
        "request_timeout_s": 2,
        **fields.pop("kubernetes", {}),
    }
    return {
        "models": [MODEL],
        "block_size": 4,
        "listen": {"port": 0},
        "scrape": {"enabled": False},
        "discovery": {"kubernetes": section},
        "admin": {"token": ADMIN_TOKEN},
        **fields,
    }


class Client:
    """Requests to a running gateway."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def complete(self, prompt: str) -> aiohttp.ClientResponse:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with self.session.post(self.url + "/v1/completions", json=body) as response:
            await response.read()
            return response

    async def ready(self) -> int:
        async with self.session.get(self.url + "/ready") as response:
            return response.status

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as response:
            return await response.text()

    async def admin_engines(self) -> list[str]:
        """The engines ``GET /admin/engines`` lists (the config's admin token)."""
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with self.session.get(self.url + "/admin/engines", headers=headers) as response:
            assert response.status == 200, await response.text()
            return sorted(engine["worker_id"] for engine in (await response.json())["engines"])

    async def wait_routed(self, engine: FakeOpenAIEngine, what: str = "") -> None:
        """Sends requests until one reaches ``engine``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        before = len(engine.received)
        while len(engine.received) == before:
            assert loop.time() < end, f"no request reached the engine {what}"
            await self.complete(f"probe {loop.time()}")
            await asyncio.sleep(0.02)

    async def wait_refused(self) -> None:
        """Waits until the gateway has no engine: /ready and requests answer 503."""
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while await self.ready() != 503:
            assert loop.time() < end, "the gateway stayed ready"
            await asyncio.sleep(0.02)
        await assert_no_engine(self)


async def assert_no_engine(client: Client) -> None:
    assert await client.ready() == 503
    response = await client.complete("nobody")
    assert response.status == 503
    assert response.headers["x-llmsched-dropped-reason"] == "no-endpoints"


def counter(text: str, name: str) -> float:
    found = re.search(
        rf'(?m)^llmsched_gateway_kubernetes_discovery_total{{counter="{name}"}} (\S+)$', text
    )
    return float(found.group(1)) if found else -1.0


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, api: FakeKubeAPI, port: int, **fields: Any
) -> AsyncIterator[Client]:
    """The real ``llmsched serve`` on the pods of ``api``, with a client session."""
    async with serving_many(tmp_path, api, port, 1, **fields) as (client,):
        yield client


@contextlib.asynccontextmanager
async def serving_many(
    tmp_path: Path, api: FakeKubeAPI, port: int, count: int, **fields: Any
) -> AsyncIterator[list[Client]]:
    """``count`` real ``llmsched serve`` processes on the pods of ``api``, started side by side,
    with a client session."""
    config = pods_config(tmp_path, api.url, port, **fields)
    async with (
        serve_processes(config, tmp_path, count) as urls,
        aiohttp.ClientSession() as session,
    ):
        yield [Client(session, url) for url in urls]


@contextlib.asynccontextmanager
async def fake_api(port: int = 0) -> AsyncIterator[FakeKubeAPI]:
    api = FakeKubeAPI(bookmark_s=0.2)
    await api.start(port=port)
    try:
        yield api
    finally:
        await api.stop()


@pytest.mark.usefixtures("plane")
def test_ready_pods_become_engines_and_leave_routing(tmp_path: Path) -> None:
    """No engine before a pod is Ready (503s, not ready); a Ready pod takes requests; an
    unready or deleted one leaves routing; with none left the gateway says so again."""

    async def body() -> None:
        async with (
            fake_api() as api,
            engines_at(["127.0.0.2", "127.0.0.3"]) as (port, (a, b)),
            serving(tmp_path, api, port) as client,
        ):
            await until(lambda: api.watches > 0)  # the first list came, with no pod
            await assert_no_engine(client)
            assert await client.admin_engines() == []  # none, not a stand-in

            api.put_pod(NS, "engine-a", APP, "127.0.0.2")
            api.put_pod(NS, "not-selected", {"app": "other"}, "127.0.0.3")
            await client.wait_routed(a, "after pod a became Ready")
            assert await client.ready() == 200
            assert not b.received

            api.put_pod(NS, "engine-b", APP, "127.0.0.3")
            await client.wait_routed(b, "after pod b became Ready")

            api.put_pod(NS, "engine-a", APP, "127.0.0.2", ready=False)
            await wait_only(client, b, a)

            api.delete_pod(NS, "engine-b")
            await client.wait_refused()
            assert await client.admin_engines() == []
            text = await client.metrics()
            assert counter(text, "lists") >= 1 and counter(text, "events") >= 4
            assert "llmsched_gateway_kubernetes_synced 1.0" in text
            assert "llmsched_gateway_kubernetes_engines 0.0" in text

    run(body())


async def wait_only(client: Client, wanted: FakeOpenAIEngine, left: FakeOpenAIEngine) -> None:
    """Waits until ten requests in a row reach ``wanted`` and none ``left``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while True:
        assert loop.time() < end, "the engine did not leave routing"
        before = len(left.received)
        for i in range(10):
            assert (await client.complete(f"only {i} {loop.time()}")).status == 200
        if len(left.received) == before:
            return


@pytest.mark.usefixtures("plane")
def test_a_pod_rescheduled_to_a_new_ip_keeps_its_name(tmp_path: Path) -> None:
    """A StatefulSet pod back under its name at another IP: requests follow the new address
    and the engine keeps the pod's name as its worker id."""

    async def body() -> None:
        async with (
            fake_api() as api,
            engines_at(["127.0.0.2", "127.0.0.3"]) as (port, (old, new)),
            serving(tmp_path, api, port) as client,
        ):
            api.put_pod(NS, "engine-0", APP, "127.0.0.2")
            await client.wait_routed(old, "at the first address")
            api.put_pod(NS, "engine-0", APP, "127.0.0.3")
            await wait_only(client, new, old)
            text = await client.metrics()
            assert 'endpoint="engine-0"' in text

    run(body())


PD_ROUTER = {
    "plugins": [
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "prefix-cache-scorer"},
        {"type": "max-score-picker"},
        {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 8}},
        {
            "type": "pd-profile-handler",
            "parameters": {"deciderPluginName": "prefix-based-pd-decider"},
        },
    ],
    "schedulingProfiles": [
        {
            "name": "prefill",
            "plugins": [
                {"pluginRef": "prefill-filter"},
                {"pluginRef": "prefix-cache-scorer"},
                {"pluginRef": "max-score-picker"},
            ],
        },
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "prefix-cache-scorer"},
                {"pluginRef": "max-score-picker"},
            ],
        },
    ],
}


@dataclass
class PdCluster:
    """``llmsched serve`` with P/D on, over pods whose role comes from a label."""

    client: Client
    prefill: FakeOpenAIEngine
    decode: FakeOpenAIEngine
    port: int
    metrics: str  # /metrics once both engines were routed

    async def split(self) -> aiohttp.ClientResponse:
        """A long prompt, answered by the decode pod with the prefill pod in its header."""
        response = await self.client.complete("You answer in full sentences. " * 8)
        assert response.status == 200
        assert not self.prefill.received
        (received,) = self.decode.received
        assert received.headers["x-prefiller-host-port"] == f"127.0.0.2:{self.port}"
        return response


@contextlib.asynccontextmanager
async def pd_cluster(tmp_path: Path, router: dict[str, Any]) -> AsyncIterator[PdCluster]:
    """Pods ``prefill-0`` (127.0.0.2) and ``decode-0`` (127.0.0.3) by ``role_label``, and
    ``odd-0`` of a role llm-d does not know, behind ``llmsched serve`` routing with ``router``;
    yields once both engines are routed."""
    async with (
        fake_api() as api,
        engines_at(["127.0.0.2", "127.0.0.3"]) as (port, (prefill, decode)),
        serving(
            tmp_path,
            api,
            port,
            kubernetes={"role_label": ROLE},
            router=router,
            pd={"enabled": True},
        ) as client,
    ):
        api.put_pod(NS, "prefill-0", {**APP, ROLE: "prefill"}, "127.0.0.2")
        api.put_pod(NS, "decode-0", {**APP, ROLE: "decode"}, "127.0.0.3")
        api.put_pod(NS, "odd-0", {**APP, ROLE: "leader"}, "127.0.0.4")
        text = ""
        for _ in range(500):
            text = await client.metrics()
            if "llmsched_gateway_kubernetes_engines 2.0" in text:
                break
            await asyncio.sleep(0.02)
        yield PdCluster(client, prefill, decode, port, text)


@pytest.mark.usefixtures("plane")
def test_role_label_splits_prefill_and_decode(tmp_path: Path) -> None:
    """``role_label`` gives each pod its P/D role: a long prompt goes to the decode pod with
    the prefill pod in the sidecar header; a pod with an unknown role is skipped, and
    /metrics names it with why."""

    async def body() -> None:
        async with pd_cluster(tmp_path, PD_ROUTER) as cluster:
            assert 'llmsched_gateway_kubernetes_skipped_pod{pod="odd-0"' in cluster.metrics
            await cluster.split()

    run(body())


def _session_router(*plugins: str) -> dict[str, Any]:
    return {
        "plugins": [{"type": p} for p in plugins],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": p} for p in plugins]}],
    }


def _token(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.usefixtures("plane")
def test_session_tokens_name_pods_as_llm_d_does_across_processes(tmp_path: Path) -> None:
    """With a session plugin, an answer carries ``x-session-token``: the base64 of the pod's
    ``namespace/name``, what llm-d's scheduler mints and reads. A token llm-d minted (or an
    earlier ``llmsched serve`` process) routes to its pod through a fresh process, with no
    ``x-session-id``; a pod of another namespace is no pod of this gateway's."""
    router = _session_router("session-affinity-filter", "round-robin-picker")

    async def turns(client: Client, token: str, n: int) -> list[str]:
        tokens = []
        for i in range(n):
            body = {"model": MODEL, "prompt": f"turn {i}", "max_tokens": 2}
            headers = {"x-session-token": token}
            async with client.session.post(
                client.url + "/v1/completions", json=body, headers=headers
            ) as answer:
                await answer.read()
                assert answer.status == 200
                tokens.append(answer.headers["x-session-token"])
        return tokens

    async def body() -> None:
        async with (
            fake_api() as api,
            engines_at(["127.0.0.2", "127.0.0.3"]) as (port, (a, b)),
        ):
            api.put_pod(NS, "engine-a", APP, "127.0.0.2")
            api.put_pod(NS, "engine-b", APP, "127.0.0.3")
            minted = _token(f"{NS}/engine-b")  # llm-d's token for pod llm/engine-b
            # Each a fresh process, knowing no session: the second is sent nothing before its
            # turn (both start side by side, as a start is mostly imports).
            async with serving_many(tmp_path, api, port, 2, router=router) as clients:
                for process, client in enumerate(clients):
                    await client.wait_routed(a)
                    await client.wait_routed(b)
                    before_a, before_b = len(a.received), len(b.received)
                    assert await turns(client, minted, 4) == [minted] * 4, process
                    assert len(b.received) == before_b + 4 and len(a.received) == before_a
                    # Another namespace's pod of the same name: ignored, round-robin again.
                    await turns(client, _token("other/engine-b"), 2)
                    assert len(a.received) == before_a + 1

    run(body())


@pytest.mark.usefixtures("plane")
def test_a_split_request_s_token_names_its_decode_pod(tmp_path: Path) -> None:
    router = {
        **PD_ROUTER,
        "plugins": [*PD_ROUTER["plugins"], {"type": "session-affinity-scorer"}],
        "schedulingProfiles": [
            PD_ROUTER["schedulingProfiles"][0],
            {
                "name": "decode",
                "plugins": [
                    *PD_ROUTER["schedulingProfiles"][1]["plugins"],
                    {"pluginRef": "session-affinity-scorer"},
                ],
            },
        ],
    }

    async def body() -> None:
        async with pd_cluster(tmp_path, router) as cluster:
            response = await cluster.split()
            assert response.headers["x-session-token"] == _token(f"{NS}/decode-0")

    run(body())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.usefixtures("plane")
def test_an_api_server_down_at_start_is_waited_for(tmp_path: Path) -> None:
    """The API server does not answer when serve starts: it starts all the same, not ready,
    refusing requests with a 503 and counting the errors; once the server is up the pods'
    engines take requests."""

    async def body() -> None:
        port = _free_port()
        down = FakeKubeAPI()
        down.url = f"http://127.0.0.1:{port}"  # nothing listens there yet
        async with (
            engines_at(["127.0.0.2"]) as (target, (a,)),
            serving(tmp_path, down, target) as client,
        ):
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while counter(await client.metrics(), "errors") < 2:
                assert loop.time() < end, "no error counted"
                await asyncio.sleep(0.05)
            await assert_no_engine(client)
            async with fake_api(port) as api:
                api.put_pod(NS, "engine-a", APP, "127.0.0.2")
                await client.wait_routed(a, "after the API server came up")
                assert await client.ready() == 200

    run(body())


@pytest.mark.usefixtures("plane")
def test_serve_outside_a_cluster_without_kubeconfig_fails_at_start(tmp_path: Path) -> None:
    """No kubeconfig and no service account: serve exits 2 naming what it could not load."""
    path = tmp_path / "gateway.yaml"
    config = pods_config(tmp_path, "http://127.0.0.1:9", 8000)
    del config["discovery"]["kubernetes"]["kubeconfig"]
    config["data_plane"] = current_plane()
    path.write_text(yaml.safe_dump(config))

    async def body() -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmsched",
            "serve",
            "--config",
            str(path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 2, (out, err)
        assert b"in-cluster service account" in err, err
        assert b"listening" not in out

    run(body())


@pytest.mark.usefixtures("plane")
def test_a_refused_engine_set_is_counted_and_offered_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A set of engines the gateway refuses keeps the current engines, counts on
    llmsched_gateway_discovery_errors_total, and is taken when offered again; stop cancels
    the watcher and closes its client."""

    async def body() -> None:
        async with fake_api() as api, engines_at(["127.0.0.2"]) as (port, _):
            gateway = make_gateway(pods_config(tmp_path, api.url, port), data_plane=current_plane())
            real = gateway.set_engines
            refusals = [ConfigError("engines: refused once for the test")]

            async def refuse_once(engines: Any, *, allow_empty: bool = False) -> Any:
                if engines and refusals:
                    raise refusals.pop()
                return await real(engines, allow_empty=allow_empty)

            monkeypatch.setattr(gateway, "set_engines", refuse_once)
            await gateway.start()
            try:
                api.put_pod(NS, "engine-a", APP, "127.0.0.2")
                await until(lambda: bool(gateway.engines))
                text = gateway.metrics.render().decode()
                assert re.search(r"(?m)^llmsched_gateway_discovery_errors_total 1\.0$", text)
                assert counter(text, "callback_errors") == 1
            finally:
                await gateway.stop()
            assert gateway.kubernetes is not None
            assert gateway.kubernetes.stats()["synced"]
            await asyncio.sleep(0)
            watches = api.watches
            await asyncio.sleep(0.3)
            assert api.watches == watches  # nothing watches after stop

    run(body())


BASE = {"models": [MODEL]}
SECTION = {"namespace": NS, "selector": APP, "target_port": 8000}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"discovery": {"kubernetes": SECTION, "file": "engines.yaml"}},
            "discovery: give either discovery.file or discovery.kubernetes, not both",
        ),
        (
            {
                "engines": [{"host": "127.0.0.1", "port": 8001}],
                "discovery": {"kubernetes": SECTION},
            },
            "engines: give either engines or discovery.kubernetes, not both",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "selector": {"app": "vllm, llama"}}}},
            "discovery.kubernetes.selector: label 'app' has the value 'vllm, llama'",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "selector": ""}}},
            "discovery.kubernetes.selector: must not be empty",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "target_port": 70000}}},
            "discovery.kubernetes.target_port: must be an int in 1..65535, got 70000",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "replay_port": 5558}}},
            "discovery.kubernetes.replay_port: needs kv_events_port",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "namespace": "LLM"}}},
            "discovery.kubernetes.namespace: must be a Kubernetes namespace name",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "role_label": "a b"}}},
            "discovery.kubernetes.role_label: must be a label key",
        ),
        (
            {"discovery": {"kubernetes": {"namespace": NS, "selector": APP}}},
            "discovery.kubernetes.target_port: required",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "resync": 10}}},
            "discovery.kubernetes.resync: unknown key",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "watch_timeout_s": 0}}},
            "discovery.kubernetes.watch_timeout_s: must be a number of seconds > 0",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "settle_s": -1}}},
            "discovery.kubernetes.settle_s: must be a number of seconds >= 0",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "backoff_max_s": 0.1}}},
            "discovery.kubernetes.backoff_max_s: must be at least",
        ),
        (
            {"discovery": {"kubernetes": {**SECTION, "kubeconfig": "no/such/kubeconfig"}}},
            "discovery.kubernetes.kubeconfig: ",
        ),
        ({"discovery": {"kubernetes": ["app=vllm"]}}, "discovery.kubernetes: must be a mapping"),
    ],
)
def test_config_errors_name_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config({**BASE, **config})
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_missing_extra_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``kubernetes_asyncio`` the section is refused when the config is loaded, with
    the extra to install."""
    import importlib.util

    find_spec: Callable[..., object] = importlib.util.find_spec

    def without_client(name: str, *args: object) -> object:
        return None if name == "kubernetes_asyncio" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_client)
    monkeypatch.delitem(sys.modules, "llmsched.integrations.kubernetes")
    with pytest.raises(ConfigError) as raised:
        load_config({**BASE, "discovery": {"kubernetes": SECTION}})
    message = str(raised.value)
    assert message.startswith("discovery.kubernetes: "), message
    assert "pip install 'llmsched[kubernetes]'" in message


def test_the_config_and_the_watcher_have_the_same_defaults() -> None:
    """KubernetesConfig repeats KubernetesDiscovery's timing defaults (the config module
    cannot import the watcher without the extra): they must agree."""
    signature = inspect.signature(KubernetesDiscovery)
    config = KubernetesConfig(namespace=NS, selector=APP, target_port=8000)
    for name in (
        "resync_s",
        "watch_timeout_s",
        "request_timeout_s",
        "backoff_initial_s",
        "backoff_max_s",
        "settle_s",
    ):
        assert getattr(config, name) == signature.parameters[name].default, name


def test_the_section_reaches_the_pod_selector(tmp_path: Path) -> None:
    (tmp_path / "kubeconfig").write_text("")
    config = load_config(
        {
            **BASE,
            "discovery": {
                "kubernetes": {
                    **SECTION,
                    "selector": "app=vllm,tier in (a,b)",
                    "role_label": ROLE,
                    "kv_events_port": 5557,
                    "replay_port": 5558,
                    "topic": "kv",
                    "labels": {"pool": "a"},
                    "kubeconfig": str(tmp_path / "kubeconfig"),
                }
            },
        }
    )
    section = config.discovery.kubernetes
    assert section is not None and config.engines == ()
    selector = section.pod_selector()
    assert selector.label_selector() == "app=vllm,tier in (a,b)"
    assert (selector.role_label, selector.kv_events_port, selector.replay_port) == (
        ROLE,
        5557,
        5558,
    )
    assert (selector.topic, selector.labels) == ("kv", {"pool": "a"})
    assert section.kubeconfig == tmp_path / "kubeconfig"


def test_the_docs_example_config_loads() -> None:
    """The gateway config of docs/kubernetes.md's "In `llmsched serve`" section is valid."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "kubernetes.md").read_text()
    section = page.split("## In `llmsched serve`", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = load_config(yaml.safe_load(example))
    kubernetes = config.discovery.kubernetes
    assert kubernetes is not None and kubernetes.kubeconfig is None
    assert kubernetes.pod_selector().label_selector() == "app=vllm-llama"
