"""llm-d's session token (``x-session-token``) on both data planes: answers carry the serving
engine's token when a profile reads the session; a request echoing it goes to that engine,
through a gateway that never saw the session; a token that names nothing is ignored."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from _gateway_harness import current_plane, plane, rig, run  # noqa: F401 (the fixture)

from llmsched.gateway import make_gateway
from llmsched.gateway.session_token import SessionTokens

TOKEN = "x-session-token"


def _router(*plugins: str) -> dict[str, Any]:
    return {
        "plugins": [{"type": p} for p in plugins],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": p} for p in plugins]}],
    }


# Round-robin moves every request on unless the filter keeps one engine; max-score picks the
# scorer's 1 over the others' 0.
ROUTERS = {
    "filter": _router("session-affinity-filter", "round-robin-picker"),
    "scorer": _router("session-affinity-scorer", "max-score-picker"),
}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_an_echoed_token_holds_the_engine_through_a_fresh_gateway(kind: str) -> None:
    async def go() -> None:
        async with rig(2, router=ROUTERS[kind]) as r:
            first = await r.complete("hello")
            assert first.status == 200
            served = r.worker_of_request()
            token = first.headers[TOKEN]
            assert token == _b64(served)
            # A gateway that never saw the session (another replica, or after a restart).
            fresh = make_gateway(r.gateway.config, data_plane=current_plane())
            await fresh.start()
            try:
                for i in range(6):
                    answer = await r.client.post(
                        fresh.url + "/v1/completions",
                        json={"model": "tiny", "prompt": f"turn {i}"},
                        headers={TOKEN: token},
                    )
                    await answer.read()
                    assert answer.status == 200
                    assert r.worker_of_request() == served, i
                    assert answer.headers[TOKEN] == token
                    # The same token without its padding, as some clients strip it.
                    answer = await r.client.post(
                        fresh.url + "/v1/completions",
                        json={"model": "tiny", "prompt": f"bare {i}"},
                        headers={TOKEN: token.rstrip("=")},
                    )
                    await answer.read()
                    assert r.worker_of_request() == served, i
                if kind == "filter":
                    # Without the token round-robin reaches both engines.
                    seen = set()
                    for i in range(2):
                        answer = await r.client.post(
                            fresh.url + "/v1/completions",
                            json={"model": "tiny", "prompt": f"free {i}"},
                        )
                        await answer.read()
                        seen.add(r.worker_of_request())
                    assert len(seen) == 2
            finally:
                await fresh.stop()

    run(go())


@pytest.mark.usefixtures("plane")
def test_a_token_that_names_no_engine_is_ignored() -> None:
    async def go() -> None:
        async with rig(2, router=ROUTERS["filter"]) as r:
            first = str(r.gateway.config.engines[0].worker_id)
            bad = ["%%%", "Y", _b64("no-such-engine"), "/w==", _b64(f"ns/{first}")]
            seen = set()
            for i, token in enumerate(bad):
                answer = await r.complete(f"p {i}", headers={TOKEN: token})
                assert answer.status == 200, token
                # Not pinned: round-robin moves on as without a token.
                seen.add(r.worker_of_request())
                assert answer.headers[TOKEN] == _b64(r.worker_of_request())
            assert len(seen) == 2
            assert r.metric("llmsched_gateway_session_tokens_ignored_total") == len(bad)

    run(go())


@pytest.mark.usefixtures("plane")
def test_without_a_session_plugin_answers_carry_no_token() -> None:
    async def go() -> None:
        async with rig(2) as r:  # the default router: no session plugin
            assert not r.gateway.router.config_info["session_affinity"]
            answer = await r.complete("hello", stream=True)
            assert answer.status == 200
            assert TOKEN not in answer.headers
            answer = await r.complete("hello")
            assert TOKEN not in answer.headers

    run(go())


@pytest.mark.usefixtures("plane")
def test_a_streamed_answer_carries_the_token() -> None:
    async def go() -> None:
        async with rig(2, router=ROUTERS["scorer"]) as r:
            answer = await r.complete("hello", stream=True)
            assert answer.status == 200
            assert answer.headers[TOKEN] == _b64(r.worker_of_request())

    run(go())


def test_tokens_name_a_pod_by_its_namespace() -> None:
    tokens = SessionTokens("llm")
    assert tokens.token("vllm-0") == _b64("llm/vllm-0")
    assert tokens.endpoint(_b64("llm/vllm-0")) == "vllm-0"
    assert tokens.endpoint(_b64("other/vllm-0")) is None
    assert tokens.endpoint(_b64("vllm-0")) is None
    assert tokens.endpoint(_b64("llm/")) is None
    plain = SessionTokens(None)
    for worker in ("a", "ab", "abc", "10.0.0.7:8000", "[::1]:8000/dp2", "é-ü"):
        token = plain.token(worker)
        assert plain.endpoint(token) == worker
        assert plain.endpoint(token.rstrip("=")) == worker
    for bad in ("%%%", "YQ===", "Y", "YWJj-", "YW Jj", "/w==", "", "="):
        assert plain.endpoint(bad) is None, bad
