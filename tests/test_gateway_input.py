"""Client input never makes the gateway answer 5xx: every malformed field or header is a 4xx in
the OpenAI error shape naming it, including under a bounded random fuzz of bodies and headers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _gateway_harness import (  # noqa: F401 (plane: the fixture)
    MODEL,
    PLANES,
    Rig,
    current_plane,
    plane,
    raw_request,
    rig,
    run,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("plane")

SLICES = {"enabled": True, "policy": "fixed", "params": {"slice_tokens": 2}}


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()  # ensure_ascii: \\ud800 escapes


BAD_BODIES: list[tuple[str, str, bytes]] = [
    ("completions", "prompt", _body(prompt="a\ud800b")),
    ("completions", "prompt[1]", _body(prompt=["ok", "\udfff"])),
    ("chat", "messages[0].content", _body(messages=[{"role": "user", "content": "\ud83d"}])),
    (
        "chat",
        "messages[0].content[0].text",
        _body(messages=[{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]),
    ),
    ("completions", "cache_salt", _body(prompt="hi", cache_salt="salt\ud800")),
    ("completions", "cache_salt", _body(prompt="hi", cache_salt=7)),
    # vLLM refuses these two: the gateway does before routing them.
    ("completions", "cache_salt", _body(prompt="hi", cache_salt="")),
    ("completions", "prompt", _body(prompt="")),
    ("completions", "stop", _body(prompt="hi", stop=3)),
    ("completions", "stop", _body(prompt="hi", stop=["a", 1])),
    ("completions", "stop", _body(prompt="hi", stop={"a": 1})),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens=-1)),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens=0)),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens=2**64)),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens="10")),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens=1.5)),
    ("completions", "max_tokens", _body(prompt="hi", max_tokens=True)),
    (
        "chat",
        "max_completion_tokens",
        _body(messages=[{"role": "user", "content": "x"}], max_completion_tokens=-5),
    ),
    ("completions", "stream", _body(prompt="hi", stream="yes")),
    ("completions", "stream_options", _body(prompt="hi", stream=True, stream_options=[1])),
]


@pytest.mark.parametrize("slices", [False, True], ids=["plain", "sliced"])
def test_malformed_fields_are_400_naming_the_field(slices: bool) -> None:
    async def body() -> None:
        overrides = {"slices": SLICES} if slices else {}
        async with rig(engines=1, **overrides) as r:
            for route, field, data in BAD_BODIES:
                path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
                async with r.client.post(r.url(path), data=data) as response:
                    assert response.status == 400, (field, data)
                    error = (await response.json())["error"]
                    assert error["type"] == "invalid_request_error"
                    assert error["param"] == field, (error, data)
                    assert field.split("[")[0].split(".")[0] in error["message"]
            # Nesting: past the gateway's depth limit, and past json's own recursion limit.
            deep = b'{"model": "tiny", "prompt": "x", "tools": ' + b"[" * 80 + b"]" * 80 + b"}"
            deeper = b"[" * 100_000 + b"]" * 100_000
            for data in (deep, deeper):
                async with r.client.post(r.url("/v1/completions"), data=data) as response:
                    assert response.status == 400
                    assert "nested" in (await response.json())["error"]["message"]
            assert not r.engines[0].received
            # Paired surrogate escapes are valid text and pass.
            good = _body(prompt="smile \ud83d\ude00", stop=["\n"], max_tokens=2, cache_salt="s")
            async with r.client.post(r.url("/v1/completions"), data=good) as response:
                assert response.status == 200

    run(body())


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_body_with_a_utf8_byte_order_mark_is_served_and_forwarded_without_it(
    route: str,
) -> None:
    """Probe 74: a JSON body that starts with a UTF-8 BOM was a 400 on both planes, while
    vLLM (``json.loads`` of bytes) reads it. The gateway now drops the BOM, and the engine
    gets the body without it (the fake engine, which reads text, refuses one with it)."""

    async def body() -> None:
        async with rig(engines=1) as r:
            fields = (
                {"prompt": "hi"}
                if route == "completions"
                else {"messages": [{"role": "user", "content": "hi"}]}
            )
            path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
            status, text = await raw_request(r, b"\xef\xbb\xbf" + _body(**fields), path=path)
            assert status == 200, text
            assert r.engines[0].received[-1].body == {"model": MODEL, **fields}

    run(body())


@pytest.mark.parametrize(
    ("codec", "name"),
    [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-32", "UTF-32"), ("utf-32-be", "UTF-32")],
)
def test_a_body_in_utf16_or_utf32_is_a_400_naming_its_encoding(codec: str, name: str) -> None:
    """Probe 74: JSON in UTF-16 or UTF-32 (which ``json.loads`` of bytes reads) is refused,
    not transcoded, with a message that names its encoding, the same on both planes."""

    async def body() -> None:
        async with rig(engines=1) as r:
            data = json.dumps({"model": MODEL, "prompt": "hi"}).encode(codec)
            status, text = await raw_request(r, data)
            assert status == 400, text
            error = json.loads(text)["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == (
                f"the body is not valid JSON: it is encoded as {name} (send UTF-8)"
            )
            assert not r.engines[0].received

    run(body())


@pytest.mark.parametrize("header", ["x-session-id", "x-llmsched-tenant", "x-llmsched-priority"])
def test_headers_that_are_not_utf8_are_400_naming_the_header(header: str) -> None:
    async def body() -> None:
        flow = {"saturation": {"type": "concurrency", "max_requests": 4}}
        async with rig(engines=1, flow=flow) as r:
            status, answer = await raw_request(
                r, _body(prompt="hi"), extra=header.encode() + b": caf\xe9\xff\r\n"
            )
            assert status == 400, answer
            error = json.loads(answer)["error"]
            assert error["param"] == header and header in error["message"]
            assert not r.engines[0].received

    run(body())


def test_an_api_key_that_is_not_utf8_is_401() -> None:
    async def body() -> None:
        keys = {"sk-interactive-0001": {"tenant": "acme"}}
        async with rig(engines=1, auth={"api_keys": keys}) as r:
            status, _ = await raw_request(
                r, _body(prompt="hi"), extra=b"Authorization: Bearer sk-\xff\xfe-0001\r\n"
            )
            assert status == 401

    run(body())


def test_a_valid_api_key_is_never_echoed_in_an_error() -> None:
    async def body() -> None:
        key = "sk-interactive-0001"
        async with rig(engines=1, auth={"api_keys": {key: {"tenant": "acme"}}}) as r:
            headers = {"Authorization": f"Bearer {key}"}
            cases = [
                {"model": key, "prompt": "x"},
                {"model": MODEL, "prompt": key * 2, "max_tokens": key},
            ]
            for fields in cases:
                async with r.client.post(
                    r.url("/v1/completions"), json=fields, headers=headers
                ) as response:
                    assert 400 <= response.status < 500
                    text = await response.text()
                    assert key not in text, text

    run(body())


# -- fuzz --------------------------------------------------------------------------------

_LONE = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
_TEXT = st.one_of(st.text(max_size=12), st.builds(lambda a, b: a + b, st.text(max_size=4), _LONE))
_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    _TEXT,
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)
_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "stream",
    "stream_options", "cache_salt", "n", "logprobs", "temperature", "chat_template_kwargs",
    "tools", "return_token_ids", "continue_final_message",
]  # fmt: skip
_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _JSON)},
    optional={"content": st.one_of(_TEXT, _JSON)},
)
_BODY = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), _JSON)},
    optional={
        **{name: _JSON for name in _FIELDS if name != "model"},
        "prompt": st.one_of(
            _TEXT, st.lists(st.integers(min_value=-5, max_value=2**33), max_size=6), _JSON
        ),
        "messages": st.one_of(st.lists(_MESSAGE, min_size=1, max_size=3), _JSON),
        "max_tokens": st.one_of(st.integers(min_value=-3, max_value=2**65), _JSON),
    },
)
_HEADER_VALUE = st.binary(max_size=12).map(
    lambda b: bytes(c for c in b if c not in b"\r\n\x00") or b"x"
)
_HEADERS = st.dictionaries(
    st.sampled_from(
        [b"x-session-id", b"x-llmsched-tenant", b"x-llmsched-priority", b"Authorization"]
    ),
    _HEADER_VALUE,
    max_size=3,
)
# Well-formed requests with random values: the paths past the checks (slicing included).
_VALID = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={
        "prompt": st.one_of(
            st.text(max_size=40), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8)
        ),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text()}
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 8),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "stream": st.booleans(),
        "cache_salt": st.text(max_size=8),
    },
)
_RAW = st.one_of(
    _VALID.map(lambda b: json.dumps(b).encode()),
    _BODY.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=40),
    _JSON.map(lambda v: json.dumps(v).encode()),
)


class _Fuzz:
    """One gateway (slices on, flow control on) kept across hypothesis examples: in this
    process, or (``serve``) the real ``llmsched serve`` process in front of fakes run here."""

    def __init__(self, *, serve: Path | None = None, data_plane: str = "python") -> None:
        self.loop = asyncio.new_event_loop()
        self.statuses: dict[int, int] = {}
        self._process: asyncio.subprocess.Process | None = None
        overrides: dict[str, Any] = {
            "flow": {"saturation": {"type": "concurrency", "max_requests": 16}},
            "slices": SLICES,
        }
        self._cm = rig(engines=2, data_plane=data_plane, **overrides)
        self.rig: Rig = self.loop.run_until_complete(self._cm.__aenter__())
        self.port = self.rig.gateway.port
        if serve is not None:
            config = {**overrides, "engines": [e.spec() for e in self.rig.engines]}
            config.update(models=[MODEL], block_size=4, scrape={"enabled": False})
            self.port = self.loop.run_until_complete(self._serve(serve, config))

    async def _serve(self, tmp: Path, config: dict[str, Any]) -> int:
        path = tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmsched", "serve", "--config", str(path), "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert self._process.stdout is not None
        line = (await asyncio.wait_for(self._process.stdout.readline(), 60)).decode()
        assert "listening on http://" in line, line
        return int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])

    def send(self, route: str, body: bytes, headers: dict[bytes, bytes]) -> int:
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in headers.items())
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        status, answer = self.loop.run_until_complete(
            asyncio.wait_for(raw_request(self.port, body, extra=extra, path=path), 10)
        )
        self.statuses[status] = self.statuses.get(status, 0) + 1
        assert status < 500, (status, answer, body, headers)
        if status >= 400:
            if answer.startswith("{"):
                assert "error" in json.loads(answer), answer
            else:  # malformed HTTP, refused by aiohttp's parser before any handler
                assert status in (400, 413, 431), (status, answer)
        return status

    def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            code = self.loop.run_until_complete(asyncio.wait_for(self._process.wait(), 20))
            assert code == 0
        self.loop.run_until_complete(self._cm.__aexit__(None, None, None))
        self.loop.close()
        # The fuzz reached the engines too, not only the gateway's refusals.
        assert self.statuses.get(200, 0) > 0, self.statuses
        assert sum(v for k, v in self.statuses.items() if 400 <= k < 500) > 0


@pytest.fixture(scope="module", params=PLANES)
def fuzz(request: pytest.FixtureRequest) -> Any:
    target = _Fuzz(data_plane=request.param)
    yield target
    target.close()


@pytest.fixture(scope="module")
def fuzz_serve(tmp_path_factory: pytest.TempPathFactory) -> Any:
    target = _Fuzz(serve=tmp_path_factory.mktemp("serve"))
    yield target
    target.close()


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=st.sampled_from(["completions", "chat"]), body=_RAW, headers=_HEADERS)
@pytest.mark.python_plane_only("the fuzz fixture runs each plane itself")
def test_fuzzed_bodies_and_headers_never_get_a_5xx(
    fuzz: _Fuzz, route: str, body: bytes, headers: dict[bytes, bytes]
) -> None:
    fuzz.send(route, body, headers)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=st.sampled_from(["completions", "chat"]), body=_RAW, headers=_HEADERS)
@pytest.mark.python_plane_only("the serve process runs the config's default plane (native)")
def test_fuzzed_input_to_the_serve_process_never_gets_a_5xx(
    fuzz_serve: _Fuzz, route: str, body: bytes, headers: dict[bytes, bytes]
) -> None:
    fuzz_serve.send(route, body, headers)
