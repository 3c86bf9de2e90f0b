"""The gateway's admin API: list, add, drain, resume and remove engines at run time.

Enabled when ``admin.token`` (or the variable named by ``admin.token_env``) is set; every call
must carry ``Authorization: Bearer <token>`` (compared in constant time; 401 otherwise).
Without a token the routes do not exist (404).

- ``GET /admin/engines``: every engine with its state (``up``, ``down``, ``open``,
  ``draining``) and requests in flight.
- ``POST /admin/engines`` with an engine entry (the form of a config ``engines`` item): adds it
  (201; 409 when its worker id is already there; 400 naming the problem otherwise). The body is
  read as a request body is: a UTF-8 byte order mark is dropped, JSON in UTF-16 or UTF-32 is
  refused naming its encoding, on both planes.
- ``POST /admin/engines/{worker}/drain``: no new requests go to it; requests in flight finish.
- ``POST /admin/engines/{worker}/resume``: a drained engine takes requests again.
- ``DELETE /admin/engines/{worker}``: removes it (from the pool, flow control and the prefix
  index; 409 for the last engine).

Changes apply to the current set of engines; with ``discovery.file`` (or
``discovery.kubernetes``), the file (the Ready pods) replaces that set whenever it changes. On
the native data plane (``data_plane: native``) the same routes are served in Rust
(``crates/llmsched-gateway/src/admin.rs``); adding and removing an engine call
:func:`add_engine` and :func:`remove_engine` here, the one implementation of both.
"""

from __future__ import annotations

import codecs
import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from yarl import URL

from llmsched.errors import ConfigError
from llmsched.integrations import EngineSpec

if TYPE_CHECKING:
    from llmsched.gateway.app import Gateway

__all__ = ["EngineSet", "add_admin_routes", "add_engine", "check_engine_url", "remove_engine"]


class EngineSet(Protocol):
    """A gateway whose engines the admin API changes (either data plane)."""

    @property
    def engines(self) -> list[EngineSpec]:
        """The engines now."""
        ...

    async def set_engines(self, engines: Iterable[EngineSpec]) -> tuple[list[str], list[str]]:
        """Replaces the engines."""
        ...


async def add_engine(gateway: EngineSet, body: bytes | str) -> tuple[int, dict[str, Any]]:
    """``POST /admin/engines``: adds the engine entry in ``body`` (JSON, the form of a config
    ``engines`` item); returns the status (201, 400, 409) and the JSON body to answer."""
    try:
        entry: Any = json.loads(_entry_text(body))
        spec = EngineSpec.from_dict(entry)
        # Checked before the set changes (the native plane's own check comes after the
        # shared pool has taken the engine).
        check_engine_url(spec)
    except RecursionError:
        return _error_body(400, "not an engine entry: the body is nested too deeply")
    except (ValueError, TypeError, ConfigError) as exc:
        return _error_body(400, f"not an engine entry: {exc}")
    current = gateway.engines
    if any(e.worker_id == spec.worker_id for e in current):
        return _error_body(409, f"engine {spec.worker_id} is already there")
    try:
        await gateway.set_engines([*current, spec])
    except ConfigError as exc:
        return _error_body(400, f"not an engine entry: {exc}")
    return 201, {"added": spec.worker_id}


def _entry_text(body: bytes | str) -> str:
    """``body`` as text, read as a request body is on both planes: a UTF-8 byte order mark
    dropped, JSON in UTF-16 or UTF-32 (which ``json.loads`` of bytes would transcode) refused by
    its name, as is a body that is not UTF-8 (ValueError).

    >>> _entry_text(codecs.BOM_UTF8 + b'"http://h:1"')
    '"http://h:1"'
    >>> try:
    ...     _entry_text('"http://h:1"'.encode("utf-16"))
    ... except ValueError as exc:
    ...     print(exc)
    the body is not valid JSON: it is encoded as UTF-16 (send UTF-8)
    """
    if isinstance(body, str):
        return body.removeprefix("\ufeff")
    body = body.removeprefix(codecs.BOM_UTF8)
    encoding = json.detect_encoding(body)
    if encoding.startswith(("utf-16", "utf-32")):
        raise ValueError(
            f"the body is not valid JSON: it is encoded as {encoding[:6].upper()} (send UTF-8)"
        )
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8") from None


async def remove_engine(gateway: EngineSet, worker: str) -> tuple[int, dict[str, Any]]:
    """``DELETE /admin/engines/{worker}``: removes the engine; returns the status (200, 404,
    409 for the last engine) and the JSON body to answer."""
    current = gateway.engines
    kept = [e for e in current if e.worker_id != worker]
    if len(kept) == len(current):
        return _error_body(404, f"no engine {worker}")
    if not kept:
        return _error_body(409, "the last engine cannot be removed")
    await gateway.set_engines(kept)
    return 200, {"removed": worker}


def check_engine_url(spec: EngineSpec) -> None:
    """Raises ConfigError when ``spec``'s base URL is not one the native plane takes as an
    http:// URL (characters outside a URI's, ``%`` outside an IPv6 literal, stray brackets),
    with the native plane's message; both planes refuse the same engines."""
    base = spec.base_url
    authority = re.split(r"[?#]", base.removeprefix("http://"), maxsplit=1)[0]
    host, _, _ = authority.rpartition(":")
    if host.startswith("["):
        good = host.endswith("]") and "[" not in host[1:] and "]" not in host[:-1]
    else:
        good = "%" not in host and "[" not in host and "]" not in host
    if not (good and _URI_CHARS.issuperset(base)):
        raise ConfigError(f"engines: {_debug_quoted(base)} is not an http:// URL")
    try:
        URL(base)
    except ValueError:
        raise ConfigError(f"engines: {_debug_quoted(base)} is not an http:// URL") from None


# What a URI may hold (RFC 3986's unreserved, reserved and "%").
_URI_CHARS = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~:/?#[]@!$&'()*+,;=%"
)


def _debug_quoted(text: str) -> str:
    """``text`` quoted as Rust's ``{:?}`` quotes a string (the native plane's messages)."""
    escapes = {'"': '\\"', "\\": "\\\\", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\0": "\\0"}
    out = [escapes.get(c) or (c if c.isprintable() else f"\\u{{{ord(c):x}}}") for c in text]
    return '"' + "".join(out) + '"'


def add_admin_routes(app: web.Application, gateway: Gateway, token: str) -> None:
    """Registers the admin routes of ``gateway`` on ``app``, guarded by ``token``."""
    admin = _Admin(gateway, token)
    app.add_routes(
        [
            web.get("/admin/engines", admin.list_engines),
            web.post("/admin/engines", admin.add_engine),
            web.post("/admin/engines/{worker}/drain", admin.drain),
            web.post("/admin/engines/{worker}/resume", admin.resume),
            web.delete("/admin/engines/{worker}", admin.remove),
        ]
    )


def _error_body(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = {401: "invalid_api_key", 404: "not_found", 409: "conflict"}.get(
        status, "invalid_request_error"
    )
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _error(status: int, message: str) -> web.Response:
    status, body = _error_body(status, message)
    return web.json_response(body, status=status)


class _Admin:
    def __init__(self, gateway: Gateway, token: str) -> None:
        self.gateway = gateway
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, request: web.Request) -> bool:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._digest)

    def _done(self, action: str, response: web.Response) -> web.Response:
        self.gateway.metrics.admin_requests.labels(action, str(response.status)).inc()
        return response

    async def list_engines(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._done("list", _error(401, "missing or invalid admin token"))
        in_flight = {
            str(e["id"]): int(e["in_flight_requests"]) for e in self.gateway.pool.endpoints()
        }
        engines = [
            {
                "worker_id": spec.worker_id,
                "host": spec.host,
                "port": spec.port,
                "state": self.gateway.health.state(spec.worker_id),
                "in_flight": in_flight.get(spec.worker_id, 0),
            }
            for spec in self.gateway.engines
        ]
        return self._done("list", web.json_response({"engines": engines}))

    async def add_engine(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._done("add", _error(401, "missing or invalid admin token"))
        status, body = await add_engine(self.gateway, await request.read())
        return self._done("add", web.json_response(body, status=status))

    async def drain(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, "drain", drained=True)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, "resume", drained=False)

    async def _set_drained(
        self, request: web.Request, action: str, *, drained: bool
    ) -> web.Response:
        if not self._authorized(request):
            return self._done(action, _error(401, "missing or invalid admin token"))
        worker = request.match_info["worker"]
        if self.gateway.health.state(worker) is None:
            return self._done(action, _error(404, f"no engine {worker}"))
        if drained:
            self.gateway.health.drain(worker)
        elif not self.gateway.health.resume(worker):
            return self._done(action, _error(409, f"engine {worker} is not draining"))
        state = self.gateway.health.state(worker)
        return self._done(action, web.json_response({"worker_id": worker, "state": state}))

    async def remove(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._done("remove", _error(401, "missing or invalid admin token"))
        status, body = await remove_engine(self.gateway, request.match_info["worker"])
        return self._done("remove", web.json_response(body, status=status))
