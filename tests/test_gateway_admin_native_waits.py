"""The native plane's admin engine changes that outlast their wait: the caller is told what
happened to the engine set (the change was answered a 500 and still made later)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from _gateway_harness import MODEL, rig, run

from llmsched.gateway import native
from llmsched.testing.openai_engine import FakeOpenAIEngine

TOKEN = "admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _post_from_a_thread(url: str, body: object) -> tuple[int, dict[str, object]]:
    """POSTs ``body`` (blocking; urllib, no proxy): the status and the JSON answer."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={**AUTH, "Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_change_the_event_loop_never_took_up_is_not_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop is held while the admin call waits: the change is abandoned and answered
    503 "not made", and it stays unmade once the loop runs again."""
    monkeypatch.setattr(native, "_ADMIN_WAIT_S", 0.2)

    async def body() -> None:
        admin = {"token": TOKEN}
        async with (
            FakeOpenAIEngine(model=MODEL) as extra,
            rig(engines=1, admin=admin, data_plane="native") as r,
        ):
            before = [e.worker_id for e in r.gateway.engines]
            answers: list[tuple[int, dict[str, object]]] = []
            caller = threading.Thread(
                target=lambda: answers.append(
                    _post_from_a_thread(r.url("/admin/engines"), extra.spec())
                )
            )
            caller.start()
            caller.join()  # on the event loop's thread: the loop cannot take the change up
            [(status, answer)] = answers
            # The loop runs again (a round trip through the gateway and the feeds): nothing
            # changes behind the caller's back.
            async with r.client.get(r.url("/admin/engines"), headers=AUTH) as response:
                listed = [e["worker_id"] for e in (await response.json())["engines"]]
            await r.gateway.scheduler.feeds_settled()
            assert [e.worker_id for e in r.gateway.engines] == before
            assert listed == before
            assert status == 503, answer
            error = answer["error"]
            assert isinstance(error, dict) and "not made" in error["message"]
            # The same change, asked again with the loop free, is made.
            async with r.client.post(
                r.url("/admin/engines"), json=extra.spec(), headers=AUTH
            ) as response:
                assert response.status == 201

    run(body())


def test_a_change_made_whose_feeds_lag_is_answered_as_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop takes the change up (the engine set changes at once) but the KV-event feeds
    have not followed when the wait ends: the call answers what was done (201 / 200), as the
    engine list shows, not a failure."""
    monkeypatch.setattr(native, "_ADMIN_WAIT_S", 0.2)

    async def body() -> None:
        admin = {"token": TOKEN}
        async with (
            FakeOpenAIEngine(model=MODEL) as extra,
            rig(engines=2, admin=admin, data_plane="native") as r,
        ):
            release = asyncio.Event()
            settled = r.gateway.scheduler.feeds_settled

            async def lagging() -> None:
                await release.wait()
                await settled()

            monkeypatch.setattr(r.gateway.scheduler, "feeds_settled", lagging)
            first = str(r.gateway.config.engines[0].worker_id)
            new = f"127.0.0.1:{extra.port}"
            async with r.client.post(
                r.url("/admin/engines"), json=extra.spec(), headers=AUTH
            ) as response:
                assert (response.status, await response.json()) == (201, {"added": new})
            async with r.client.delete(r.url(f"/admin/engines/{first}"), headers=AUTH) as response:
                assert (response.status, await response.json()) == (200, {"removed": first})
            async with r.client.get(r.url("/admin/engines"), headers=AUTH) as response:
                listed = {e["worker_id"] for e in (await response.json())["engines"]}
            assert first not in listed and new in listed
            assert first not in {e.worker_id for e in r.gateway.engines}
            release.set()
            await settled()

    run(body())
