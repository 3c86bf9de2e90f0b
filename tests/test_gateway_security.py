"""The gateway refuses what it must: unauthenticated requests, oversized bodies and headers,
unknown models, redirection to unconfigured addresses, and spoofed client identity."""

from __future__ import annotations

import json

import pytest
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)

from llmsched.testing.openai_engine import FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")

KEYS = {
    "sk-interactive-0001": {"tenant": "acme", "priority": 5},
    "sk-batch-000000002": {"tenant": "batchco", "priority": -1},
}
FLOW = {"saturation": {"type": "concurrency", "max_requests": 8}}


def test_requests_without_a_valid_api_key_get_401_and_reach_no_engine() -> None:
    async def body() -> None:
        async with rig(engines=1, auth={"api_keys": KEYS}) as r:
            for headers in (
                None,
                {"Authorization": "Bearer sk-wrong-key-000"},
                {"Authorization": "Bearer sk-interactive-000"},  # a prefix of a real key
                {"Authorization": "Basic sk-interactive-0001"},
                {"Authorization": "Bearer "},
                {"x-api-key": "sk-interactive-00012"},
            ):
                response = await r.complete("hello", headers=headers)
                assert response.status == 401, headers
                error = json.loads(await response.read())["error"]
                assert error["type"] == "invalid_api_key"
                assert "sk-" not in error["message"]
            async with r.client.get(r.url("/v1/models")) as response:
                assert response.status == 401
            assert not r.engines[0].received
            ok = await r.complete("hello", headers={"Authorization": "Bearer sk-interactive-0001"})
            assert ok.status == 200
            ok = await r.complete("hello", headers={"x-api-key": "sk-batch-000000002"})
            assert ok.status == 200
            # The client's key is the gateway's business, never the engine's.
            assert all("Authorization" not in q.headers for q in r.engines[0].received)
            assert all("x-api-key" not in q.headers for q in r.engines[0].received)

    run(body())


def test_identity_comes_from_the_key_and_spoofed_headers_are_ignored() -> None:
    async def body() -> None:
        async with rig(engines=1, auth={"api_keys": KEYS}, flow=FLOW) as r:
            spoofed = {
                "Authorization": "Bearer sk-batch-000000002",
                "x-llmsched-tenant": "acme",
                "x-llmsched-priority": "100",
            }
            assert (await r.complete("hello", headers=spoofed)).status == 200
            assert r.gateway.flow is not None
            flows = {(f["tenant"], f["priority"]) for f in r.gateway.flow.metrics()["flows"]}
            assert flows == {("batchco", -1)}

    run(body())


def test_without_auth_identity_comes_from_the_headers() -> None:
    async def body() -> None:
        async with rig(engines=1, flow=FLOW) as r:
            headers = {"x-llmsched-tenant": "acme", "x-llmsched-priority": "3"}
            assert (await r.complete("hello", headers=headers)).status == 200
            assert r.gateway.flow is not None
            flows = {(f["tenant"], f["priority"]) for f in r.gateway.flow.metrics()["flows"]}
            assert flows == {("acme", 3)}

    run(body())


def test_an_oversized_body_gets_413_and_reaches_no_engine() -> None:
    async def body() -> None:
        async with rig(engines=1, limits={"max_body_bytes": 4096}) as r:
            response = await r.complete("x" * 5000)
            assert response.status == 413
            assert json.loads(await response.read())["error"]["type"] == "request_too_large"
            assert (await r.complete("x" * 3000)).status == 200
            assert len(r.engines[0].received) == 1

    run(body())


def test_oversized_or_too_many_headers_are_refused_before_the_handler() -> None:
    async def body() -> None:
        limits = {"max_field_size": 1024, "max_headers": 16}
        async with rig(engines=1, limits=limits) as r:
            response = await r.complete("hello", headers={"x-big": "y" * 2000})
            assert response.status in (400, 431)
            many = {f"x-h{i}": "1" for i in range(40)}
            response = await r.complete("hello", headers=many)
            assert response.status in (400, 431)
            assert not r.engines[0].received
            assert (await r.complete("hello", headers={"x-small": "y" * 500})).status == 200

    run(body())


def test_unknown_model_is_404_without_contacting_engines() -> None:
    async def body() -> None:
        async with rig(engines=2) as r:
            body = {"model": "gpt-unknown", "prompt": "hello"}
            async with r.client.post(r.url("/v1/completions"), json=body) as response:
                assert response.status == 404
                assert (await response.json())["error"]["type"] == "model_not_found"
            assert not any(e.received for e in r.engines)

    run(body())


def test_requests_naming_other_addresses_still_go_only_to_configured_engines() -> None:
    async def body() -> None:
        async with FakeOpenAIEngine(model=MODEL) as attacker, rig(engines=1) as r:
            target = f"127.0.0.1:{attacker.port}"
            headers = {
                "Host": target,
                "X-Forwarded-Host": target,
                "X-Forwarded-For": "127.0.0.1",
                "Forwarded": f"host={target}",
                "x-prefiller-host-port": target,  # only the router may name a prefill engine
            }
            body = {
                "model": MODEL,
                "prompt": "hello",
                "url": attacker.url + "/v1/completions",
                "base_url": attacker.url,
                "api_base": attacker.url,
            }
            for path in ("/v1/completions", "/v1/completions?url=" + attacker.url):
                async with r.client.post(r.url(path), json=body, headers=headers) as response:
                    assert response.status == 200
            assert not attacker.received
            engine = r.engines[0]
            assert len(engine.received) == 2
            for received in engine.received:
                assert received.path == "/v1/completions"
                assert received.host == f"127.0.0.1:{engine.port}"
                lowered = {k.lower() for k in received.headers}
                assert not lowered & {"x-forwarded-host", "forwarded", "x-prefiller-host-port"}
            # The body goes through unchanged: the engine sees (and ignores) the fields.
            assert engine.received[0].body["url"] == body["url"]

    run(body())


def test_paths_other_than_the_api_are_not_proxied() -> None:
    async def body() -> None:
        async with rig(engines=1) as r:
            for path in ("/v1/embeddings", "/../metrics", "/v1/completions/../../admin"):
                async with r.client.post(r.url(path), json={"model": MODEL}) as response:
                    assert response.status in (404, 405), path
            assert not r.engines[0].received

    run(body())
