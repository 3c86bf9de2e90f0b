"""A Kubernetes API server for pods, on loopback: list and watch as the real one serves them.

For testing discovery (:mod:`llmsched.integrations.kubernetes`) where no cluster runs. It keeps
what a watcher depends on:

- one ``resourceVersion`` counter across the store; a list answers with the current one;
- ``?watch=1&resourceVersion=N`` streams every change after ``N`` as JSON lines (``ADDED``,
  ``MODIFIED``, ``DELETED``), filtered by namespace and ``labelSelector``: a pod whose labels
  stop matching arrives as ``DELETED`` and one that starts matching as ``ADDED``, as the API
  server's watch cache sends them;
- ``allowWatchBookmarks=true`` adds ``BOOKMARK`` events carrying the current version;
- a version older than the retained history gets the ``ERROR`` event with status 410 (Gone),
  after which a client must list again (:meth:`FakeKubeAPI.compact` drops the history);
- ``timeoutSeconds`` ends the stream cleanly.

Faults for tests: :meth:`drop_watches` cuts every open watch stream, :meth:`fail_next` answers
the next requests with an HTTP error (or any body), :meth:`hang_next` never answers them, and
:meth:`send_raw` puts any line into a watch stream.

>>> api = FakeKubeAPI()
>>> api.put_pod("ns", "a", {"app": "vllm"}, "10.0.0.1")
1
>>> [p["metadata"]["name"] for p in api.pods("ns", "app=vllm")]
['a']
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmsched._extras import require

require("integrations", "aiohttp", feature="llmsched.testing.kube_api")

from aiohttp import web  # noqa: E402

__all__ = ["FakeKubeAPI", "LabelSelector"]

Pod = dict[str, Any]
"""A pod as the API serves it (JSON object)."""

_TOKEN = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_RULE = re.compile(rf"^({_TOKEN})\s+(in|notin)\s+\(([^)]*)\)$")
_EQ_RULE = re.compile(rf"^({_TOKEN})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)$")
_EXISTS_RULE = re.compile(rf"^(!?)\s*({_TOKEN})$")


def _split_rules(text: str) -> list[str]:
    """Splits on commas outside parentheses."""
    rules, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            rules.append(text[start:i].strip())
            start = i + 1
    rules.append(text[start:].strip())
    return [r for r in rules if r]


@dataclass(frozen=True)
class LabelSelector:
    """A parsed Kubernetes label selector: equality (``k=v``, ``k==v``, ``k!=v``), set
    (``k in (a,b)``, ``k notin (a)``) and existence (``k``, ``!k``) rules, all of which must hold.

    >>> LabelSelector.parse("app=vllm,tier in (a, b),!canary").matches({"app": "vllm", "tier": "b"})
    True
    """

    rules: tuple[tuple[str, str, frozenset[str]], ...]

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Parses ``text``; raises ValueError naming a rule it cannot read."""
        rules: list[tuple[str, str, frozenset[str]]] = []
        for rule in _split_rules(text):
            if m := _SET_RULE.match(rule):
                values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
                rules.append((m.group(1), m.group(2), values))
            elif m := _EQ_RULE.match(rule):
                op = "!=" if m.group(2) == "!=" else "="
                rules.append((m.group(1), op, frozenset([m.group(3)])))
            elif m := _EXISTS_RULE.match(rule):
                rules.append((m.group(2), "absent" if m.group(1) else "exists", frozenset()))
            else:
                raise ValueError(f"cannot read label selector rule {rule!r}")
        return cls(tuple(rules))

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether every rule holds for ``labels``."""
        for key, op, values in self.rules:
            value = labels.get(key)
            ok = {
                "=": value in values,
                "in": value in values,
                "!=": value not in values,
                "notin": value not in values,
                "exists": value is not None,
                "absent": value is None,
            }[op]
            if not ok:
                return False
        return True


@dataclass
class _Change:
    version: int
    namespace: str
    before: Pod | None
    after: Pod | None


class FakeKubeAPI:
    """Pods in memory, served over HTTP with the list/watch protocol (see the module doc).

    ``bookmark_s``: how often an idle watch that allows bookmarks gets one.
    """

    def __init__(self, *, bookmark_s: float = 0.2) -> None:
        self.bookmark_s = bookmark_s
        self.version = 0
        self._pods: dict[tuple[str, str], Pod] = {}
        self._changes: list[_Change] = []
        self._oldest = 0
        self._changed = asyncio.Event()
        # Open watch streams: the transport of each, to cut it.
        self._watches: dict[web.StreamResponse, asyncio.BaseTransport | None] = {}
        self._failures: list[tuple[int, bytes | None]] = []
        self._hangs = 0
        self._raw_lines: list[bytes] = []
        self.lists = 0
        self.watches = 0
        self.gone = 0
        self.bookmarks = 0
        self._runner: web.AppRunner | None = None
        # Set by stop(): every watch handler ends its stream instead of waiting for changes.
        self._stopping = False
        self.url = ""

    # -- the store -------------------------------------------------------------------------

    def put_pod(
        self,
        namespace: str,
        name: str,
        labels: Mapping[str, str],
        ip: str | None,
        *,
        ready: bool = True,
        phase: str = "Running",
        deleting: bool = False,
    ) -> int:
        """Creates or replaces a pod; returns the new resource version. A new pod's
        ``creationTimestamp`` is later than every earlier pod's."""
        before = self._pods.get((namespace, name))
        self.version += 1
        created = (
            before["metadata"]["creationTimestamp"]
            if before is not None
            else f"2026-01-01T{self.version // 3600 % 24:02d}:{self.version // 60 % 60:02d}:"
            f"{self.version % 60:02d}Z"
        )
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        if ip is not None:
            status["podIP"] = ip
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels),
            "resourceVersion": str(self.version),
            "creationTimestamp": created,
        }
        if deleting:
            metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        pod: Pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": metadata,
            "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
            "status": status,
        }
        self._pods[(namespace, name)] = pod
        self._record(namespace, before, pod)
        return self.version

    def delete_pod(self, namespace: str, name: str) -> int:
        """Deletes a pod (KeyError when there is none); returns the new resource version."""
        before = self._pods.pop((namespace, name))
        self.version += 1
        gone = copy.deepcopy(before)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._record(namespace, before, None, gone)
        return self.version

    def pods(self, namespace: str, selector: str = "") -> list[Pod]:
        """The pods of ``namespace`` that ``selector`` matches, by name."""
        match = LabelSelector.parse(selector)
        return [
            copy.deepcopy(pod)
            for (ns, _), pod in sorted(self._pods.items())
            if ns == namespace and match.matches(pod["metadata"]["labels"])
        ]

    def compact(self) -> None:
        """Forgets the change history: a watch from any earlier version now gets 410 Gone."""
        self._changes.clear()
        self._oldest = self.version

    def drop_watches(self) -> None:
        """Cuts every open watch stream (the client sees the connection end mid-stream)."""
        for transport in self._watches.values():
            if isinstance(transport, asyncio.Transport):
                transport.abort()
        self._watches.clear()

    def fail_next(self, count: int, status: int = 500, body: bytes | None = None) -> None:
        """The next ``count`` requests get HTTP ``status``, with ``body`` (None: the API's
        JSON ``Status`` object)."""
        self._failures.extend([(status, body)] * count)

    def hang_next(self, count: int) -> None:
        """The next ``count`` requests get no answer at all (until :meth:`stop`)."""
        self._hangs += count

    def send_raw(self, line: bytes) -> None:
        """Sends ``line`` (newline added) on the next watch stream that wakes, which then goes
        on as before: a server or proxy that answers garbage."""
        self._raw_lines.append(line)
        self._wake_watches()

    def _record(
        self, namespace: str, before: Pod | None, after: Pod | None, gone: Pod | None = None
    ) -> None:
        if gone is not None:
            # A deletion: the watcher sees the last state, stamped with the deletion's version.
            before = gone
        self._changes.append(_Change(self.version, namespace, before, after))
        self._wake_watches()

    def _wake_watches(self) -> None:
        """Wakes every watch handler waiting for a change."""
        self._changed.set()
        self._changed = asyncio.Event()

    # -- the server ------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on ``host:port`` (0: any free port); returns the base URL."""
        self._stopping = False
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods_handler)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        """Closes every stream and the server."""
        # A watch handler whose client has gone keeps waiting for changes until its timeout,
        # and the server's cleanup waits for running handlers (up to a minute): wake each one
        # so that it ends, including one that started after its stream was cut.
        self._stopping = True
        self._wake_watches()
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _pods_handler(self, request: web.Request) -> web.StreamResponse:
        if self._hangs:
            self._hangs -= 1
            while not self._stopping:
                await asyncio.sleep(0.02)
            raise web.HTTPServiceUnavailable()
        if self._failures:
            status, raw = self._failures.pop(0)
            if raw is not None:
                return web.Response(body=raw, status=status, content_type="application/json")
            return web.json_response(_status(status, "InternalError", "injected"), status=status)
        namespace = request.match_info["namespace"]
        query = request.query
        try:
            selector = LabelSelector.parse(query.get("labelSelector", ""))
        except ValueError as exc:
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if query.get("watch") in ("1", "true", "True"):
            return await self._watch(request, namespace, selector)
        self.lists += 1
        items = [
            copy.deepcopy(pod)
            for (ns, _), pod in sorted(self._pods.items())
            if ns == namespace and selector.matches(pod["metadata"]["labels"])
        ]
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, namespace: str, selector: LabelSelector
    ) -> web.StreamResponse:
        self.watches += 1
        query = request.query
        since = int(query.get("resourceVersion") or self.version)
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
        timeout = float(query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self._watches[response] = request.transport
        try:
            if since < self._oldest:
                self.gone += 1
                gone = _status(410, "Expired", f"too old resource version: {since}")
                await _send(response, {"type": "ERROR", "object": gone})
                return response
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while loop.time() < end and not self._stopping:
                changed = self._changed
                while self._raw_lines:
                    await response.write(self._raw_lines.pop(0) + b"\n")
                for change in self._changes:
                    if change.version <= since or change.namespace != namespace:
                        continue
                    since = change.version
                    event = _event_for(change, selector)
                    if event is not None:
                        await _send(response, event)
                wait = min(end - loop.time(), self.bookmark_s if bookmarks else end)
                # The handler is cancelled only by the server's cleanup, after stop() set
                # ``_stopping`` and woke it: a cancellation ``wait_for`` loses on CPython
                # 3.10-3.11 still ends the loop.
                try:
                    await asyncio.wait_for(changed.wait(), max(wait, 0.0))
                except asyncio.TimeoutError:
                    if bookmarks and loop.time() < end:
                        since = max(since, self.version)
                        self.bookmarks += 1
                        await _send(response, _bookmark(self.version))
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client left or the stream was cut
        finally:
            self._watches.pop(response, None)
        return response


def _event_for(change: _Change, selector: LabelSelector) -> dict[str, Any] | None:
    was = change.before is not None and selector.matches(change.before["metadata"]["labels"])
    now = change.after is not None and selector.matches(change.after["metadata"]["labels"])
    if change.after is None:
        return {"type": "DELETED", "object": change.before} if was else None
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": change.after}
    return {"type": "DELETED", "object": change.after} if was else None


def _bookmark(version: int) -> dict[str, Any]:
    return {
        "type": "BOOKMARK",
        "object": {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(version)},
        },
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")
