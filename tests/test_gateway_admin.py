"""The admin API: authenticated listing, adding, draining, resuming and removing of engines."""

from __future__ import annotations

import codecs
import json

import pytest
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)
from yarl import URL

from llmsched.errors import ConfigError
from llmsched.gateway.config import load_config
from llmsched.testing.openai_engine import FakeOpenAIEngine

pytestmark = pytest.mark.usefixtures("plane")

TOKEN = "admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_admin_calls_need_the_token_and_are_absent_without_one() -> None:
    async def body() -> None:
        async with rig(engines=1, admin={"token": TOKEN}) as r:
            for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}):
                async with r.client.get(r.url("/admin/engines"), headers=headers) as response:
                    assert response.status == 401
                    assert TOKEN not in await response.text()
            worker = r.gateway.config.engines[0].worker_id
            async with r.client.delete(r.url(f"/admin/engines/{worker}")) as response:
                assert response.status == 401
            assert len(r.gateway.engines) == 1
            assert r.metric("llmsched_gateway_admin_requests_total", action="list", status="401")
        async with rig(engines=1) as r:
            response = await r.client.get(r.url("/admin/engines"), headers=AUTH)
            assert response.status == 404
            response.release()

    run(body())


def test_engines_are_added_drained_resumed_and_removed_at_run_time() -> None:
    async def body() -> None:
        admin = {"token": TOKEN}
        async with FakeOpenAIEngine(model=MODEL) as extra, rig(engines=1, admin=admin) as r:
            first = r.gateway.config.engines[0].worker_id
            new = f"127.0.0.1:{extra.port}"
            async with r.client.post(
                r.url("/admin/engines"), json=extra.spec(), headers=AUTH
            ) as response:
                assert response.status == 201
            async with r.client.post(
                r.url("/admin/engines"), json=extra.spec(), headers=AUTH
            ) as response:
                assert response.status == 409
            async with r.client.post(
                r.url("/admin/engines"), json={"host": "x"}, headers=AUTH
            ) as response:
                assert response.status == 400
            async with r.client.get(r.url("/admin/engines"), headers=AUTH) as response:
                listed = {e["worker_id"]: e["state"] for e in (await response.json())["engines"]}
            assert listed == {first: "up", new: "up"}
            # Drained: every request goes to the other engine.
            async with r.client.post(
                r.url(f"/admin/engines/{first}/drain"), headers=AUTH
            ) as response:
                assert (await response.json())["state"] == "draining"
            for i in range(6):
                assert (await r.complete(f"drained {i}")).status == 200
            assert not r.engines[0].received and len(extra.received) == 6
            assert r.gateway.routable_endpoints() == [new]
            async with r.client.post(
                r.url(f"/admin/engines/{first}/resume"), headers=AUTH
            ) as response:
                assert (await response.json())["state"] == "up"
            assert sorted(r.gateway.routable_endpoints()) == sorted([first, new])
            async with r.client.delete(r.url(f"/admin/engines/{first}"), headers=AUTH) as response:
                assert response.status == 200
            assert [e.worker_id for e in r.gateway.engines] == [new]
            async with r.client.delete(r.url(f"/admin/engines/{new}"), headers=AUTH) as response:
                assert response.status == 409  # the last engine stays
            async with r.client.delete(r.url(f"/admin/engines/{first}"), headers=AUTH) as response:
                assert response.status == 404
            assert r.metric("llmsched_gateway_admin_requests_total", action="add", status="201")

    run(body())


def test_an_admin_body_over_max_body_bytes_is_a_413() -> None:
    """An engine entry over ``limits.max_body_bytes`` is refused as every other body over it
    is (413); the native plane answered 400 "did not arrive whole"."""

    async def body() -> None:
        limits = {"max_body_bytes": 4096, "max_body_bytes_in_flight": 1 << 20}
        async with rig(engines=1, admin={"token": TOKEN}, limits=limits) as r:
            entry = {"host": "127.0.0.1", "port": 9, "x": "y" * 8192}
            async with r.client.post(r.url("/admin/engines"), json=entry, headers=AUTH) as response:
                assert response.status == 413, await response.text()
            assert len(r.gateway.engines) == 1

    run(body())


def test_admin_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"engines": [{"host": "127.0.0.1", "port": 1}], "models": ["m"]}
    with pytest.raises(ConfigError, match="at least 16"):
        load_config({**base, "admin": {"token": "short"}})
    with pytest.raises(ConfigError, match="ADMIN_TOKEN_X is not set"):
        load_config({**base, "admin": {"token_env": "ADMIN_TOKEN_X"}})
    monkeypatch.setenv("ADMIN_TOKEN_X", TOKEN)
    assert load_config({**base, "admin": {"token_env": "ADMIN_TOKEN_X"}}).admin.token == TOKEN


def test_admin_paths_with_escapes_are_served_as_decoded() -> None:
    """Both planes read each path segment with its escapes decoded (the native plane answered
    404 to ``/adm%69n/engines``, probe 45)."""

    async def body() -> None:
        async with rig(engines=2, admin={"token": TOKEN}) as r:
            first = str(r.gateway.config.engines[0].worker_id)
            listing = URL(r.url("/adm%69n/%65ngines"), encoded=True)
            async with r.client.get(listing, headers=AUTH) as response:
                assert response.status == 200
                assert len((await response.json())["engines"]) == 2
            escaped = first.replace(":", "%3A")
            drain = URL(r.url(f"/admin/engines/{escaped}/dr%61in"), encoded=True)
            async with r.client.post(drain, headers=AUTH) as response:
                assert response.status == 200, await response.text()
            async with r.client.get(listing) as response:  # the token is still needed
                assert response.status == 401

    run(body())


def test_an_admin_body_is_read_as_a_request_body_is() -> None:
    """An engine entry with a UTF-8 byte order mark is taken, its BOM dropped; one in UTF-16 or
    UTF-32 is a 400 naming the encoding, as a request body is. The Python plane took a UTF-16
    entry (``json.loads`` of bytes transcodes it) and the native plane refused a BOM's entry
    ("Unexpected UTF-8 BOM") and called a UTF-16 one "not UTF-8"."""

    async def body() -> None:
        admin = {"token": TOKEN}
        async with FakeOpenAIEngine(model=MODEL) as extra, rig(engines=1, admin=admin) as r:
            entry = json.dumps(extra.spec())
            headers = {**AUTH, "Content-Type": "application/json"}
            for encoding in ("utf-16", "utf-16-le", "utf-32", "utf-32-be"):
                async with r.client.post(
                    r.url("/admin/engines"), data=entry.encode(encoding), headers=headers
                ) as response:
                    assert response.status == 400, encoding
                    name = encoding[:6].upper()
                    assert (await response.json())["error"]["message"] == (
                        f"not an engine entry: the body is not valid JSON: it is encoded as "
                        f"{name} (send UTF-8)"
                    )
            async with r.client.post(
                r.url("/admin/engines"), data=b"\xff" + entry.encode(), headers=headers
            ) as response:
                assert response.status == 400
                message = (await response.json())["error"]["message"]
                assert message == "not an engine entry: the body is not UTF-8"
            assert len(r.gateway.engines) == 1
            async with r.client.post(
                r.url("/admin/engines"), data=codecs.BOM_UTF8 + entry.encode(), headers=headers
            ) as response:
                assert response.status == 201, await response.text()
            assert len(r.gateway.engines) == 2

    run(body())
