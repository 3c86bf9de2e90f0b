"""Engines discovered from Kubernetes pods, the way an InferencePool selects them.

:class:`PodSelector` says which pods are engines (namespace, label selector, target port, an
optional role label for prefill/decode pools); :class:`KubernetesDiscovery` keeps the list of
engines current with the list/watch protocol that controllers use (through the
``kubernetes_asyncio`` client):

1. **List** the selected pods and remember the list's ``resourceVersion``.
2. **Watch** from that version, with bookmarks (so a quiet watch still advances the version)
   and a server-side timeout; each ``ADDED``/``MODIFIED``/``DELETED`` event updates the pods.
   A watch that ends, times out or is cut resumes from the last version seen, with no relist.
3. **410 Gone** (the version fell out of the server's history) or an answer that cannot be
   read means events were missed: list again.
4. **Errors** (connection refused, 5xx, 429, a watch that ends at once with nothing, an answer
   that does not come within ``request_timeout_s``) back off exponentially with jitter, from
   ``backoff_initial_s`` up to ``backoff_max_s``, and reset after a success. Nothing the
   server sends ends the watcher: it logs, counts and tries again.
5. **Resync**: every ``resync_s`` the pods are listed again even when the watch is healthy,
   which bounds how long any missed change can survive.

Only *Ready* pods are engines: phase ``Running``, condition ``Ready`` true, an IP, and no
deletion under way; a pod that turns unready leaves the set at once. Each engine is named after
its pod, so the pool, the index and the metrics keep one identity for it; its role comes from
``role_label`` (``prefill``, ``decode`` or ``both``; llm-d's ``prefill-decode`` and
``encode-prefill-decode`` are read as ``both`` and ``encode-prefill`` as ``prefill``, as its
role filters read them; a pod with another value is left out, counted and logged once, since
guessing a role would send prefill work to a decoder).

Changes are handed to ``on_change`` as the whole new engine tuple, coalesced over
``settle_s`` so a rollout of many pods costs one update. :meth:`KubernetesDiscovery.counters`
reports lists, watches, events, bookmarks, 410s, errors and skipped pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from llmsched._aio import settled
from llmsched._extras import require
from llmsched.errors import ConfigError, InvalidTypeError
from llmsched.integrations.identity import ROLES, EngineSpec

require("kubernetes", "kubernetes_asyncio", feature="llmsched.integrations.kubernetes")

import aiohttp  # noqa: E402
from kubernetes_asyncio import client as k8s  # noqa: E402
from kubernetes_asyncio import config as k8s_config  # noqa: E402
from kubernetes_asyncio import watch as k8s_watch  # noqa: E402
from kubernetes_asyncio.client.exceptions import ApiException  # noqa: E402

__all__ = ["KubernetesDiscovery", "PodSelector", "engines_from_pods", "load_api_client"]

log = logging.getLogger("llmsched")

Pod = Mapping[str, Any]
"""A pod as the API serves it (its JSON object)."""

EngineCallback = Callable[[tuple[EngineSpec, ...]], Awaitable[None]]
"""Receives the whole engine set after each (coalesced) change."""


_ERROR_BODY_BYTES = 4096
"""How much of an error answer is read for its message."""


class _UnreadableAnswer(ValueError):
    """An answer from the API server that is not what the list/watch protocol says."""


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    """ApiException for an answer that is not 2xx, with the API's own message. The client
    leaves the status unchecked when asked for the raw response (``_preload_content=False``)."""
    if 200 <= response.status <= 299:
        return
    try:
        body = await response.content.read(_ERROR_BODY_BYTES)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        body = b""
    message = ""
    with contextlib.suppress(ValueError):
        status = json.loads(body)
        if isinstance(status, Mapping) and isinstance(status.get("message"), str):
            message = status["message"][:200]
    response.release()
    reason = f"{response.reason}: {message}" if message else response.reason
    raise ApiException(status=response.status, reason=reason)


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _UnreadableAnswer(f"{what} is not an object: {str(value)[:100]!r}")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _UnreadableAnswer(f"{what} is not a non-empty string: {str(value)[:100]!r}")
    return value


def _pod_list(body: object) -> tuple[dict[str, Pod], str]:
    """The pods (by name) and the resourceVersion of a list answer."""
    answer = _object(body, "the pod list")
    version = _text(
        _object(answer.get("metadata"), "the list's metadata").get("resourceVersion"),
        "the list's resourceVersion",
    )
    items = answer.get("items") or []
    if not isinstance(items, list):
        raise _UnreadableAnswer(f"the list's items are not a list: {str(items)[:100]!r}")
    pods: dict[str, Pod] = {}
    for item in items:
        pod = _object(item, "a listed pod")
        pods[
            _text(_object(pod.get("metadata"), "a pod's metadata").get("name"), "a pod's name")
        ] = pod
    return pods, version


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _is_label_key(key: object) -> bool:
    """Whether ``key`` is a label key: ``name`` or ``prefix/name`` (a DNS subdomain)."""
    if not isinstance(key, str):
        return False
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix)):
        return False
    return _LABEL_NAME.fullmatch(name) is not None


def _check_label(where: str, key: object, value: object) -> None:
    if not _is_label_key(key):
        raise ConfigError(f"{where}: {key!r} is not a label key")
    if not isinstance(value, str) or (value and not _LABEL_NAME.fullmatch(value)):
        raise ConfigError(
            f"{where}: label {key!r} has the value {value!r}, which is not a label value "
            "(up to 63 letters, digits, '-', '_' and '.'; a set of values needs the string "
            "form, as 'key in (a,b)')"
        )


def _seconds(value: object) -> bool:
    """Whether ``value`` is a number of seconds >= 0 and below 1e9 (about 30 years). inf
    ("never") once passed and overflowed ``int()`` in the watch, ending the task."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9


def _check_port(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{name} must be an int in 1..65535, got {value!r}")


@dataclass(frozen=True)
class PodSelector:
    """Which pods are engines, and where each serves.

    Attributes:
        namespace: the namespace to watch.
        selector: the pods' labels, as an InferencePool's ``selector`` (``{"app": "vllm"}``,
            all must match) or a label-selector string (``"app=vllm,tier in (a,b)"``).
        target_port: the engines' HTTP port (OpenAI API and ``/metrics``).
        role_label: the label whose value is the pod's role (``prefill``, ``decode``,
            ``both``, or llm-d's combined values: see :data:`LLM_D_ROLES`); None: every pod
            serves both.
        kv_events_port: the port each pod publishes vLLM KV events on (ZMQ, the subscriber
            connects to ``tcp://<pod IP>:<port>``); None: no KV events.
        replay_port: the port of each pod's replay socket (needs ``kv_events_port``).
        topic: the KV-event topic the engines publish with.
        model: the model the engines serve (None: any).
        labels: labels every engine gets (besides ``pod``, its pod's name).

    A namespace, label key or label value that Kubernetes would refuse raises ConfigError
    here: a value such as ``"vllm,tier!=a"`` would otherwise select other pods than meant.

    >>> PodSelector("llm", {"app": "vllm"}, 8000).label_selector()
    'app=vllm'
    >>> PodSelector("llm", {"app": "vllm, llama"}, 8000)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: selector: label 'app' has the value 'vllm, llama', ...
    """

    namespace: str
    selector: Mapping[str, str] | str = field(hash=False)
    target_port: int
    role_label: str | None = None
    kv_events_port: int | None = None
    replay_port: int | None = None
    topic: str = ""
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(
                f"namespace must be a Kubernetes namespace name, got {self.namespace!r}"
            )
        if isinstance(self.selector, str):
            if not self.selector.strip():
                raise ConfigError("selector must not be empty (it would select every pod)")
        elif isinstance(self.selector, Mapping):
            if not self.selector:
                raise ConfigError("selector must not be empty (it would select every pod)")
            for key, value in self.selector.items():
                _check_label("selector", key, value)
            # A private copy: a caller's later change must not reach a frozen selector.
            object.__setattr__(self, "selector", dict(self.selector))
        else:
            raise ConfigError(f"selector must be a mapping or a str, got {self.selector!r}")
        _check_port("target_port", self.target_port, optional=False)
        _check_port("kv_events_port", self.kv_events_port, optional=True)
        _check_port("replay_port", self.replay_port, optional=True)
        if self.replay_port is not None and self.kv_events_port is None:
            raise ConfigError("replay_port needs kv_events_port")
        if self.role_label is not None and not _is_label_key(self.role_label):
            raise ConfigError(f"role_label must be a label key, got {self.role_label!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"topic must be a str, got {self.topic!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a non-empty str or None, got {self.model!r}")
        # Checked here, not at each pod: a bad one skipped every pod, one by one.
        if not isinstance(self.labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise ConfigError(f"labels must map str to str, got {self.labels!r}")
        if "pod" in self.labels:
            raise ConfigError("labels: 'pod' is each engine's pod name; use another key")
        object.__setattr__(self, "labels", dict(self.labels))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PodSelector:
        """From a config mapping with these keys; unknown keys raise ConfigError."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a pod selector must be a mapping, got {type(raw).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(map(repr, set(raw) - known))
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]} (known: {', '.join(sorted(known))})")
        missing = [k for k in ("namespace", "selector", "target_port") if k not in raw]
        if missing:
            raise ConfigError(f"missing key {missing[0]!r}")
        return cls(**raw)

    def label_selector(self) -> str:
        """The selector in the API's query syntax."""
        if isinstance(self.selector, str):
            return self.selector
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""A Kubernetes object name (a DNS subdomain), which the engine's worker id becomes."""


def _fields(value: object) -> Mapping[str, object]:
    # A field of the wrong type reads as absent, so such a pod fails the checks below.
    return value if isinstance(value, Mapping) else {}


def _is_ready(pod: Pod) -> bool:
    metadata = _fields(pod.get("metadata"))
    status = _fields(pod.get("status"))
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


#: llm-d's combined ``llm-d.ai/role`` values, read as its decode and prefill filters read them
#: (filter/bylabel/roles.go): a pod that also encodes serves the stages it names; an
#: encode-only pod has no stage here and is left out.
LLM_D_ROLES = {
    "prefill-decode": "both",
    "encode-prefill-decode": "both",
    "encode-prefill": "prefill",
}


def _pod_engine(name: str, pod: Pod, selector: PodSelector) -> EngineSpec:
    """The engine of a Ready pod; ConfigError saying why the pod cannot be one."""
    role = None
    if selector.role_label is not None:
        labels = _fields(pod.get("metadata")).get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"its labels are not an object: {str(labels)[:100]!r}")
        role = labels.get(selector.role_label)
        role = LLM_D_ROLES.get(role, role) if isinstance(role, str) else role
        if role is not None and role not in ROLES:
            raise ConfigError(
                f"label {selector.role_label}={role!r} is not one of {ROLES} "
                f"(or llm-d's {', '.join(LLM_D_ROLES)})"
            )
    ip = _fields(pod.get("status")).get("podIP")
    try:
        address = ipaddress.ip_address(ip) if isinstance(ip, str) else None
    except ValueError:
        address = None
    if address is None:
        raise ConfigError(f"its podIP {str(ip)[:100]!r} is not an IP address")
    host = f"[{ip}]" if address.version == 6 else str(ip)
    kv_events = replay = None
    if selector.kv_events_port is not None:
        kv_events = f"tcp://{host}:{selector.kv_events_port}"
    if selector.replay_port is not None:
        replay = f"tcp://{host}:{selector.replay_port}"
    return EngineSpec(
        str(ip),
        selector.target_port,
        model=selector.model,
        role=role,
        kv_events=kv_events,
        replay=replay,
        topic=selector.topic,
        labels={**selector.labels, "pod": name},
        name=name,
    )


def engines_from_pods(
    pods: Mapping[str, Pod],
    selector: PodSelector,
    skipped: Callable[[str, str], None],
    *,
    duplicate: Callable[[str, str], None] | None = None,
) -> tuple[EngineSpec, ...]:
    """The engines among ``pods`` (by pod name): Ready ones, named after their pods, in name
    order. ``skipped(pod, why)`` hears of each Ready pod left out (a bad role label, address
    or name); a pod that cannot be read is never an error here, only skipped or not Ready.

    Two Ready pods at one address (``hostNetwork`` pods on one node, or an IP given again
    while a stale pod still reads Ready) are one engine: the newest pod (by
    ``creationTimestamp``) keeps it and each other is skipped, and ``duplicate(pod, kept)``
    hears of it. Routing both would count one engine's load and cache twice.
    """
    engines: list[EngineSpec] = []
    created: dict[str, str] = {}
    for name in sorted(pods, key=str):
        pod = pods[name]
        if not isinstance(pod, Mapping) or not _is_ready(pod):
            continue
        if not isinstance(name, str) or not _POD_NAME.fullmatch(name):
            skipped(str(name)[:100], f"its name {str(name)[:100]!r} is not a pod name")
            continue
        try:
            engines.append(_pod_engine(name, pod, selector))
        except ConfigError as exc:
            skipped(name, str(exc))
            continue
        stamp = _fields(pod.get("metadata")).get("creationTimestamp")
        created[name] = stamp if isinstance(stamp, str) else ""
    by_address: dict[str, list[EngineSpec]] = {}
    for spec in engines:
        by_address.setdefault(spec.address, []).append(spec)
    kept: list[EngineSpec] = []
    for spec in engines:
        name = cast("str", spec.name)
        group = by_address[spec.address]
        newest = max(group, key=lambda e: (created[cast("str", e.name)], cast("str", e.name)))
        if spec is not newest:
            skipped(name, f"its address {spec.address} is also pod {newest.name}'s, a newer pod")
            if duplicate is not None:
                duplicate(name, cast("str", newest.name))
            continue
        kept.append(spec)
    return tuple(kept)


async def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """A ``kubernetes_asyncio`` ``ApiClient`` for ``kubeconfig`` (a kubeconfig file's path;
    its current context), or, when None, for the in-cluster service account (the token and
    CA mounted into every pod). ConfigError saying which could not be loaded and why; the
    caller closes the client.

    >>> import asyncio
    >>> asyncio.run(load_api_client("/no/such/kubeconfig"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: kubernetes discovery: cannot load kubeconfig '/no/such/...
    """
    configuration = k8s.Configuration()
    try:
        if kubeconfig is not None:
            await k8s_config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration
            )
        else:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
    except Exception as exc:  # the client's ConfigException is a bare Exception
        where = (
            f"kubeconfig {kubeconfig!r}"
            if kubeconfig is not None
            else "the in-cluster service account (outside a cluster, pass kubeconfig)"
        )
        raise ConfigError(f"kubernetes discovery: cannot load {where}: {exc}") from exc
    return k8s.ApiClient(configuration)


class KubernetesDiscovery:
    """Keeps the engine set of a :class:`PodSelector` current (see the module doc).

    ``api_client``: a configured ``kubernetes_asyncio`` ``ApiClient``; None loads the in-cluster
    service account, or ``kubeconfig`` when given. Run :meth:`run` as a task; :attr:`synced`
    is set once the first list has been offered to ``on_change``.
    """

    def __init__(
        self,
        selector: PodSelector,
        on_change: EngineCallback,
        *,
        api_client: k8s.ApiClient | None = None,
        kubeconfig: str | None = None,
        resync_s: float = 300.0,
        watch_timeout_s: float = 240.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        settle_s: float = 0.1,
        request_timeout_s: float = 30.0,
    ) -> None:
        for name, value in (
            ("resync_s", resync_s),
            ("watch_timeout_s", watch_timeout_s),
            ("backoff_initial_s", backoff_initial_s),
            ("backoff_max_s", backoff_max_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if not _seconds(value) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds in (0, 1e9), got {value!r}")
        if not _seconds(settle_s):
            raise ConfigError(f"settle_s must be a number of seconds in [0, 1e9), got {settle_s!r}")
        if not isinstance(selector, PodSelector):
            raise InvalidTypeError(f"selector must be a PodSelector, got {type(selector).__name__}")
        if not callable(on_change):
            raise InvalidTypeError(f"on_change must be an async function, got {on_change!r}")
        self.selector = selector
        self._on_change = on_change
        self._api_client = api_client
        self._kubeconfig = kubeconfig
        self.resync_s = float(resync_s)
        self.watch_timeout_s = float(watch_timeout_s)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.settle_s = float(settle_s)
        self.request_timeout_s = float(request_timeout_s)
        self.synced = asyncio.Event()
        self._pods: dict[str, Pod] = {}
        self._version: str | None = None
        self._engines: tuple[EngineSpec, ...] | None = None
        self._dirty = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None
        self._skipped_logged: set[tuple[str, str]] = set()
        self._skipped_pods: dict[str, str] = {}
        self._counters = dict.fromkeys(
            (
                "lists",
                "watches",
                "events",
                "bookmarks",
                "gone",
                "errors",
                "updates",
                "skipped",
                "duplicates",
                "callback_errors",
            ),
            0,
        )

    def engines(self) -> tuple[EngineSpec, ...]:
        """The engines ``on_change`` took last (empty before the first list): a call that
        raised leaves them as they were, and the new set is offered again after a pause."""
        return self._engines or ()

    def counters(self) -> dict[str, int]:
        """Lists, watches opened, events, bookmarks, 410s, errors, updates handed on, Ready
        pods skipped (bad role label, address or name; counted at each update), of
        those the pods skipped for sharing another pod's address, and ``on_change`` calls that
        raised."""
        return dict(self._counters)

    def skipped_pods(self) -> dict[str, str]:
        """The Ready pods left out of the current engine set, each with why."""
        return dict(self._skipped_pods)

    async def run(self) -> None:
        """Lists and watches until cancelled (or :meth:`stop`); never returns otherwise.
        Raises ConfigError at once when the client cannot be configured (no kubeconfig, not
        in a cluster); any trouble after that is logged, counted and retried."""
        self._task = asyncio.current_task()
        owns_client = self._api_client is None
        api_client = self._api_client or await self._load_client()
        publisher = asyncio.create_task(self._publish_changes())
        try:
            await self._list_and_watch(k8s.CoreV1Api(api_client))
        finally:
            publisher.cancel()
            try:
                await settled(publisher)
            finally:  # closed even when this task is cancelled again meanwhile
                if owns_client:
                    await api_client.close()

    async def stop(self) -> None:
        """Ends :meth:`run` (cancels the task running it) and returns once it has ended; a
        no-op when it is not running. Better than a bare ``task.cancel()``: the HTTP client
        can turn a cancellation into a ``TimeoutError`` (aiohttp when the request's own
        timer fires at the same moment, and on Python 3.10, which cannot tell the two
        apart), which a watcher would take for a connection timeout and retry; once stopped,
        it ends whatever the cancellation became. A stopped watcher stays stopped (a later
        :meth:`run` ends at once); a cancellation of the caller goes through."""
        self._stopping = True
        task = self._task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await settled(task)

    def _stopped(self) -> bool:
        """Whether this task is being ended: :meth:`stop` was called, or (Python 3.11 and
        later) the task was cancelled and the cancellation reached here as another error."""
        if self._stopping:
            return True
        task = asyncio.current_task()
        return sys.version_info >= (3, 11) and task is not None and task.cancelling() > 0

    def _end_if_stopped(self) -> None:
        """Raises CancelledError when the task is being ended (see :meth:`_stopped`): an
        error seen then is the cancellation in another form, not trouble to retry or log."""
        if self._stopped():
            raise asyncio.CancelledError

    async def _load_client(self) -> k8s.ApiClient:
        try:
            return await load_api_client(self._kubeconfig)
        except ConfigError as error:
            # Also logged: run() is a task, which its owner may await only at shutdown.
            log.error("%s", error)
            raise

    async def _list_and_watch(self, api: k8s.CoreV1Api) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.backoff_initial_s
        must_list = True
        resync_at = 0.0
        while True:
            self._end_if_stopped()
            try:
                if must_list or loop.time() >= resync_at:
                    await self._list(api)
                    must_list = False
                    resync_at = loop.time() + self.resync_s
                await self._watch(api, max(1.0, min(self.watch_timeout_s, resync_at - loop.time())))
                backoff = self.backoff_initial_s
            except ApiException as exc:
                if exc.status == 410:
                    self._counters["gone"] += 1
                    log.info("kubernetes discovery: %s expired; listing again", self._version)
                    must_list = True
                    continue
                backoff = await self._back_off(backoff, f"API answered {exc.status} {exc.reason}")
            except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                # Connection trouble: resume the watch from the last version after the pause.
                backoff = await self._back_off(backoff, f"{type(exc).__name__}: {exc}")
            except Exception as exc:
                # An answer that cannot be read (the client raises bare Exceptions for some):
                # events may have been missed, so list afresh. Nothing here may end the task,
                # which nobody awaits until shutdown: discovery would stop without a word.
                must_list = True
                backoff = await self._back_off(backoff, f"unreadable answer: {exc!r}")

    async def _back_off(self, backoff: float, why: str) -> float:
        self._end_if_stopped()
        self._counters["errors"] += 1
        pause = backoff * random.uniform(0.8, 1.2)
        log.warning("kubernetes discovery: %s; retrying in %.1f s", why, pause)
        await asyncio.sleep(pause)
        return min(backoff * 2, self.backoff_max_s)

    async def _list(self, api: k8s.CoreV1Api) -> None:
        # The raw answer: pods stay the API's JSON, as the watch hands them over.
        response = cast(
            "aiohttp.ClientResponse",
            await api.list_namespaced_pod(
                self.selector.namespace,
                label_selector=self.selector.label_selector(),
                _preload_content=False,
                _request_timeout=self._timeout(self.request_timeout_s),
            ),
        )
        async with response:
            await _raise_for_status(response)
            body = await response.json()
        # Read whole before anything changes: half a list would drop engines.
        pods, version = _pod_list(body)
        self._counters["lists"] += 1
        self._pods = pods
        self._version = version
        self._changed()

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        # The client's default is no timeout at all: a list that is never answered, or a
        # watch on a connection that died without a word, would stall discovery for good.
        return aiohttp.ClientTimeout(sock_connect=self.request_timeout_s, sock_read=read_s)

    async def _open_watch(
        self,
        api: k8s.CoreV1Api,
        *,
        watch: bool,
        resource_version: str,
        timeout_seconds: int,
        _request_timeout: aiohttp.ClientTimeout,
        _preload_content: bool,
    ) -> aiohttp.ClientResponse:
        # What Watch.stream calls: the list call with a status check, which the client skips.
        response = cast(
            "aiohttp.ClientResponse",
            await api.list_namespaced_pod(
                self.selector.namespace,
                label_selector=self.selector.label_selector(),
                watch=watch,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                _request_timeout=_request_timeout,
                _preload_content=_preload_content,
            ),
        )
        await _raise_for_status(response)
        return response

    async def _watch(self, api: k8s.CoreV1Api, timeout_s: float) -> None:
        self._counters["watches"] += 1
        loop = asyncio.get_running_loop()
        opened = loop.time()
        events = 0
        async with k8s_watch.Watch(return_type="object") as watcher:
            stream = watcher.stream(
                self._open_watch,
                api,
                resource_version=self._version,
                timeout_seconds=int(timeout_s),
                # The server ends the watch after timeout_s; silence beyond that is a
                # dead connection.
                _request_timeout=self._timeout(timeout_s + self.request_timeout_s),
            )
            async for event in stream:
                self._apply(event)
                events += 1
        if events == 0 and loop.time() - opened < timeout_s / 2:
            # Ended at once with nothing (a proxy with no backend): opening it again at
            # once would hammer the server, so back off as for any failure.
            raise ConnectionError("the watch ended at once with no event")

    def _apply(self, event: object) -> None:
        if not isinstance(event, Mapping):  # a line the client could not parse as JSON
            raise _UnreadableAnswer(f"a watch line is not an event: {str(event)[:100]!r}")
        kind = event.get("type")
        pod = _object(event.get("raw_object"), f"the object of a {kind!r} event")
        metadata = _object(pod.get("metadata"), f"the metadata of a {kind!r} event")
        version = _text(metadata.get("resourceVersion"), "an event's resourceVersion")
        if kind == "BOOKMARK":
            self._counters["bookmarks"] += 1
        elif kind in ("ADDED", "MODIFIED"):
            name = _text(metadata.get("name"), "a pod's name")
            self._counters["events"] += 1
            self._pods[name] = pod
            self._changed()
        elif kind == "DELETED":
            name = _text(metadata.get("name"), "a pod's name")
            self._counters["events"] += 1
            self._pods.pop(name, None)
            self._changed()
        else:
            raise _UnreadableAnswer(f"unknown watch event type {kind!r}")
        self._version = version

    def _changed(self) -> None:
        self._dirty.set()

    async def _publish_changes(self) -> None:
        retry_s = self.backoff_initial_s  # the pause before a refused set is offered again
        last_error = ""
        while True:
            await self._dirty.wait()
            if self.settle_s and self.synced.is_set():
                await asyncio.sleep(self.settle_s)
            self._dirty.clear()
            try:
                engines = self._current_engines()
            except Exception:
                # A bug, not a pod (those are skipped): this task must not die unseen.
                self._counters["errors"] += 1
                log.exception("kubernetes discovery: cannot read the pods")
                continue
            if engines != self._engines:
                try:
                    await self._on_change(engines)
                except Exception as exc:  # the receiver's trouble; discovery goes on
                    self._end_if_stopped()
                    # Not taken: engines() keeps the set the receiver has, and the same set
                    # is offered again after a pause (a receiver that failed once may take
                    # it then; before, only a later change in the pods offered it again).
                    self._counters["callback_errors"] += 1
                    error = f"{type(exc).__name__}: {exc}"
                    if error != last_error:  # the same refusal every pause: logged once
                        log.exception("kubernetes discovery: on_change failed; trying again")
                    last_error = error
                    self.synced.set()
                    pause = retry_s * random.uniform(0.8, 1.2)
                    retry_s = min(retry_s * 2, self.backoff_max_s)
                    await asyncio.sleep(pause)
                    self._dirty.set()
                    continue
                retry_s, last_error = self.backoff_initial_s, ""
                self._engines = engines
                self._counters["updates"] += 1
            self.synced.set()

    def _current_engines(self) -> tuple[EngineSpec, ...]:
        skipped: dict[str, str] = {}

        def skip(pod: str, why: str) -> None:
            skipped[pod] = why

        def duplicate(pod: str, kept: str) -> None:
            self._counters["duplicates"] += 1

        engines = engines_from_pods(self._pods, self.selector, skip, duplicate=duplicate)
        for pod, why in skipped.items():
            self._counters["skipped"] += 1
            if (pod, why) not in self._skipped_logged:
                log.warning("kubernetes discovery: pod %s is not routed to: %s", pod, why)
        # Remembered while the pod stays skipped for that reason, so the memory is bounded
        # by the pods there are and a pod skipped again later is logged again.
        self._skipped_logged = set(skipped.items())
        self._skipped_pods = skipped
        return engines
