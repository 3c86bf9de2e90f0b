"""Routing: which endpoint serves a request, balancing prefix-cache affinity against load.

An :class:`EndpointPool` holds the endpoints (model-server replicas) and their latest metrics,
updated from any thread. A :class:`Router` decides per request: it hashes the prompt once,
matches it once against a shared :class:`~llmsched.PrefixIndex`, and runs the configured
profile (filters, weighted scorers, a picker) over the endpoints. The configuration has the
shape of llm-d's ``EndpointPickerConfig`` (a dict, a YAML or JSON file, or a preset name), and
plugin type names are llm-d's and the Gateway API Inference Extension's (with the names their
earlier releases used), so an existing config can be brought along; docs/llm-d-compatibility.md
lists every type and parameter and what it becomes here.

>>> from llmsched import EndpointPool, Router
>>> pool = EndpointPool(["a", "b"], stale_policy="ignore")
>>> pool.update("b", waiting=5, kv_cache_usage=0.9)
>>> router = Router(pool, config="llm-d")
>>> decision = router.pick(tokens=list(range(64)))
>>> decision.endpoint, decision.fallbacks
('a', ['b'])

Time: every call that depends on the clock takes ``now`` (seconds, any origin), defaulting to
``time.monotonic()``. A simulator passes its own clock everywhere (metrics updates, picks,
``started``), which keeps staleness and the expiry of approximate prefix entries consistent.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from llmsched import _llmsched
from llmsched._copying import by_default, by_value, refuse
from llmsched._tokens import TokensLike, native_tokens
from llmsched.config_loader import ConfigSource, looks_like_text, read_config
from llmsched.errors import (
    ConfigError,
    InvalidTypeError,
    InvalidValueError,
    NotPicklableError,
    PlacementError,
)
from llmsched.hashing import pack_text
from llmsched.prefix_index import PrefixIndex
from llmsched.types import (
    CandidateInfo,
    ConfigInfo,
    ConfigNote,
    EndpointInfo,
    MetricsRead,
    PdNote,
    PluginInfo,
    PreciseWiring,
    ProfileData,
    ProfileRow,
    RequestInfo,
    SaturationThresholds,
)
from llmsched.validation import (
    U32_MAX,
    check_config_data,
    check_id,
    check_index,
    check_int,
    check_int_like,
    check_iterable,
    check_no_empty_names,
    check_now,
    check_number_like,
    check_optional_str,
    check_positive_seconds,
    check_probability,
    check_seed,
    check_str,
    check_str_mapping,
    check_utf8,
    describe_int,
)

__all__ = [
    "EXPLAIN_ROWS",
    "ConfigInfo",
    "ConfigNote",
    "Decision",
    "Endpoint",
    "EndpointPool",
    "EndpointScores",
    "Explanation",
    "PreciseWiring",
    "ProfileExplanation",
    "Role",
    "Router",
    "SaturationThresholds",
    "StalePolicy",
    "TokenCheckCounts",
    "config_info",
    "load_config",
]


def _warn(message: str) -> None:
    """One warning on logger ``llmsched`` (imported here: ``import llmsched`` stays light)."""
    import logging

    logging.getLogger("llmsched").warning(message)


_LOGGED: set[str] = set()
"""Messages already logged: each configuration note is logged once per process."""

EndpointId = int | str
"""An endpoint's id: any int (64-bit) or str. It is also its worker name in the prefix index."""

Role = Literal["prefill", "decode", "both"]
"""What an endpoint does in a prefill/decode split (None: unlabelled, serves both)."""

StalePolicy = Literal["saturated", "ignore"]
"""How metrics older than ``stale_after_s`` are read: the endpoint counts as saturated (load
scorers give it 0, utilization filters drop it), or the last metrics are used as they are."""

ConfigLike = ConfigSource
"""A configuration: a dict, a preset name (see :meth:`Router.presets`), YAML / JSON text or a
YAML / JSON path (read by :mod:`llmsched.config_loader`)."""

EXPLAIN_ROWS = 1000
"""Rows per profile :meth:`Decision.explain` builds by default: a pool of at most this many
endpoints gets every row; a larger one the first rows of the table, the rest counted (building
a Python row per endpoint took seconds at 200,000 endpoints)."""

ScorerFunction = Callable[[RequestInfo, list[CandidateInfo]], Sequence[float]]
"""A ``python-scorer`` plugin's ``function``: one score in [0, 1] per candidate."""
FilterFunction = Callable[[RequestInfo, list[CandidateInfo]], Sequence[bool]]
"""A ``python-filter`` plugin's ``function``: whether to keep each candidate."""

PYTHON_PLUGIN_TYPES = ("python-scorer", "python-filter")
"""Plugin types whose ``parameters.function`` is a Python callable (the slower path)."""

PSEUDO_TOKEN_NOTE = (
    "prompt given as text: hashed as pseudo-tokens (4 UTF-8 bytes each), but the index is fed "
    "by engine KV events (real token ids), so no cached prefix can match; tokenize with "
    "llmsched.tokenize and pick(tokens=...), or pass Router(allow_pseudo_tokens=True)"
)
"""Why a text pick on an index fed by engine events is flagged (logged once, in explain(), and
:attr:`Router.pseudo_token_warning` from then on)."""

TOKEN_MISMATCH_NOTE = (
    "none of the prompts routed with tokens= was ever found in an engine's reported cache "
    "({unconfirmed} checked, 0 found) while the engines' KV events flowed: the token ids given "
    "to pick() are not the ones the engines cache (a chat template applied on one side only, "
    "a BOS token added twice, another tokenizer), or the index hashes them under another "
    "model, LoRA name or cache salt than the engines' events; tokenize as the engine does "
    "(llmsched.tokenize.PromptTokenizer, see docs/integrations.md, 'Tokenizing as the engine "
    "does') and compare a prompt's index.hash_tokens() with the blocks the engine reports"
)
"""Why a router's token prompts are flagged once none was ever confirmed by an engine's events
(logged once, counted in :meth:`Router.stats`, in ``explain()`` from then on)."""

TokenCheckCounts = tuple[int, int, int | None, int]
"""A token-id check's counts as :meth:`Router.add_token_check` reads them: prompts confirmed,
prompts unconfirmed, the unconfirmed count when it warned (None before), and prompts hashed as
pseudo-tokens while engine events fed the index."""

TOKEN_CHECK_MIN_TOKENS = 512
"""Prompts shorter than this are not checked: an engine caches whole blocks of its own size
(up to a few hundred tokens), so a short prompt may leave nothing in its cache."""
TOKEN_CHECK_EVERY_S = 1.0
"""At most one prompt a second is sampled, and pending checks are looked at as often."""
TOKEN_CHECK_AFTER_S = 5.0
"""A sampled prompt's first block is looked for in the engines' reported cache from this long
after its pick (prefill and the event's trip take that long)..."""
TOKEN_CHECK_GIVE_UP_S = 60.0
"""...until this long after it; then it counts as unconfirmed if KV events arrived meanwhile
(otherwise the feed was idle or down and the prompt is not judged)."""
TOKEN_CHECK_VERDICT = 32
"""Unconfirmed prompts, with none confirmed, before the router warns."""
_TOKEN_CHECK_PENDING = 64
_FAR_FUTURE = 1e300  # a match at this time sees only blocks engines reported (records expired)


class _TokenCheck:
    """Whether the prompts a router is given as token ids ever reach the engines' KV events.

    A sample of token picks (one a second at most, of at least :data:`TOKEN_CHECK_MIN_TOKENS`
    tokens) remembers the prompt's first block hash; between :data:`TOKEN_CHECK_AFTER_S` and
    :data:`TOKEN_CHECK_GIVE_UP_S` after the pick it is looked for among the blocks the engines
    reported (a match past every record's expiry sees no routing records). One found anywhere
    confirms the router's tokenization; :data:`TOKEN_CHECK_VERDICT` prompts not found while
    events kept arriving, and none ever found, is warned of once (:data:`TOKEN_MISMATCH_NOTE`).
    """

    __slots__ = ("_lock", "_pending", "confirmed", "next_at", "unconfirmed", "warned", "warning")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.next_at = -math.inf  # when a pick should call step() next (read without lock)
        # (pick time, first block hash, engine event batches applied by then)
        self._pending: list[tuple[float, int, int]] = []
        self.confirmed = 0
        self.unconfirmed = 0
        self.warned = False
        self.warning: str | None = None  # the note as warned (its count then), for warnings

    def step(
        self,
        index: PrefixIndex,
        tokens: Any,
        lora: str | None,
        cache_salt: str | None,
        clock: float,
    ) -> None:
        """Judge the pending prompts that are due and sample this one."""
        with self._lock:
            if clock < self.next_at:
                return
            self.next_at = clock + TOKEN_CHECK_EVERY_S
            batches = index.native.event_batches
            if batches == 0:
                return  # not fed by engine events (yet): nothing to compare with
            keep = []
            for at, first, seen in self._pending:
                age = clock - at
                if age < TOKEN_CHECK_AFTER_S:
                    keep.append((at, first, seen))
                elif index.match([first], now=_FAR_FUTURE).longest > 0:
                    self.confirmed += 1
                elif age < TOKEN_CHECK_GIVE_UP_S:
                    keep.append((at, first, seen))
                elif batches > seen:
                    self.unconfirmed += 1
            self._pending = keep
            if len(tokens) >= TOKEN_CHECK_MIN_TOKENS and len(keep) < _TOKEN_CHECK_PENDING:
                head = tokens[: index.block_size]
                first = int(index.hash_tokens(head, lora=lora, cache_salt=cache_salt)[0])
                self._pending.append((clock, first, batches))
            warn = (
                not self.warned and self.confirmed == 0 and self.unconfirmed >= TOKEN_CHECK_VERDICT
            )
            if warn:
                self.warning = self.note()
                self.warned = True
        if warn:
            _warn(f"router: {self.warning}")

    def note(self) -> str:
        """The warning, with the count of prompts checked."""
        return TOKEN_MISMATCH_NOTE.format(unconfirmed=self.unconfirmed)


SHARED_REPLICA_NAME_NOTE = (
    "replica sync: another live replica uses this replica's name {name!r}: give each replica "
    "its own name (cluster.replica; the default is host name and pid); its counts still add up"
)
"""Why decisions of a synced router are flagged while another replica uses its name (logged
once by :class:`llmsched.cluster.ClusterSync`, listed in its ``stats()["shared_names"]``)."""


@dataclass(frozen=True)
class Endpoint:
    """An endpoint's description. Metrics change separately (:meth:`EndpointPool.update`).

    ``model`` is the base model it serves: a request naming another model is not sent there;
    None (the default) serves any model. An empty ``model`` is refused when the endpoint joins
    a pool (``InvalidValueError``): it would serve only requests naming the model ``""``, and
    is most likely an unset setting; give None to serve any model.

    >>> Endpoint("pod-1", address="10.0.0.1:8000", role="decode").role
    'decode'
    >>> try:
    ...     EndpointPool([Endpoint("pod-2", model="")])
    ... except InvalidValueError as e:
    ...     print(e)
    endpoint 'pod-2': model must be a non-empty str or None (None: any model), got ''
    """

    id: EndpointId
    address: str = ""
    role: Role | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None


class EndpointPool:
    """The endpoints a router picks from, with their latest metrics.

    Args:
        endpoints: initial endpoints (an :class:`Endpoint`, or just an id).
        stale_after_s: metrics older than this many seconds are stale (default 1 s, five
            intervals of :class:`~llmsched.integrations.MetricsScraper`'s 0.2 s scrapes; an
            endpoint that never reported is stale).
        stale_policy: ``"saturated"`` (the default) or ``"ignore"``.

    An id listed twice in ``endpoints`` raises InvalidValueError (:meth:`add` of a known id
    replaces its description, on purpose). Building a pool, like :meth:`add_many`, takes time
    linear in the number of endpoints; each single :meth:`add` or :meth:`remove` copies the
    member list (decisions never wait for a change), so a loop of them is quadratic. Every
    method may be called from any thread, also while routers decide.

    >>> pool = EndpointPool([Endpoint(1, address="h1:8000"), 2])
    >>> pool.update(1, waiting=3, running=8, kv_cache_usage=0.5, now=10.0)
    >>> [e["waiting"] for e in pool.endpoints()]
    [3, 0]
    """

    __slots__ = ("_native",)

    def __init__(
        self,
        endpoints: Iterable[Endpoint | EndpointId] = (),
        *,
        stale_after_s: float | None = None,
        stale_policy: StalePolicy | None = None,
    ) -> None:
        default_after, default_policy = _llmsched.EndpointPool.default_staleness()
        after = default_after if stale_after_s is None else stale_after_s
        if isinstance(after, bool) or not isinstance(after, (int, float)) or not after >= 0:
            raise InvalidValueError(
                f"stale_after_s must be a number >= 0, got {describe_int(stale_after_s)}"
            )
        try:
            after = float(after)
        except OverflowError:  # an int beyond a float's range
            raise InvalidValueError(
                f"stale_after_s must be a number >= 0 within a float's range, "
                f"got {describe_int(after)}"
            ) from None
        check_optional_str("stale_policy", stale_policy)
        self._native = _llmsched.EndpointPool(after, stale_policy or default_policy)
        self.add_many(endpoints)

    @property
    def stale_after_s(self) -> float:
        """Seconds after which metrics are stale."""
        return self._native.stale_after

    @property
    def stale_policy(self) -> StalePolicy:
        """How stale metrics are read."""
        policy: StalePolicy = self._native.stale_policy  # type: ignore[assignment]
        return policy

    def add(self, endpoint: Endpoint | EndpointId) -> bool:
        """Add an endpoint, or replace the description of the one with its id (keeping its
        metrics and in-flight counts). Returns True if it is new.

        >>> pool = EndpointPool()
        >>> pool.add(Endpoint("a", labels={"zone": "eu"})), pool.add("a")
        (True, False)
        """
        if not isinstance(endpoint, Endpoint):
            endpoint = Endpoint(check_id("endpoint", endpoint))
        return self._native.upsert(*_native_endpoint(endpoint))

    def add_many(self, endpoints: Iterable[Endpoint | EndpointId]) -> int:
        """Add (or replace) several endpoints at once, as :meth:`add` does each; returns how
        many were new. Linear in the pool's size, where a loop of :meth:`add` is quadratic
        (each change copies the member list, so that decisions never wait for it). Every
        endpoint is checked first: on an error, or an id listed twice, nothing changes.

        >>> pool = EndpointPool(["a"])
        >>> pool.add_many(["a", "b", Endpoint("c", address="h:8000")])
        2
        >>> len(pool)
        3
        """
        if isinstance(endpoints, (str, bytes)):
            raise InvalidTypeError(
                "endpoints must be an iterable of endpoints or ids, not a single "
                + type(endpoints).__name__
            )
        rows = [
            _native_endpoint(
                e if isinstance(e, Endpoint) else Endpoint(check_id(f"endpoints[{i}]", e))
            )
            for i, e in enumerate(check_iterable("endpoints", endpoints))
        ]
        seen: set[EndpointId] = set()
        for row in rows:
            if row[0] in seen:
                # A second description of one endpoint would silently replace the first.
                raise InvalidValueError(f"endpoints: {row[0]!r} is listed twice")
            seen.add(row[0])
        # One native step: one copy of the member list for the batch.
        return self._native.upsert_many(rows)

    def remove(self, endpoint_id: EndpointId) -> None:
        """Remove an endpoint (UnknownEndpointError if absent). Requests in flight there keep
        their accounting until they finish: an endpoint added back while they run (a pod that
        flapped) counts them again."""
        self._native.remove(endpoint_id)

    def update(
        self,
        endpoint_id: EndpointId,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_cache_usage: float | None = None,
        max_concurrency: int | None = None,
        now: float | None = None,
    ) -> None:
        """Record a metrics snapshot taken at ``now``; fields left None keep their value.

        ``kv_cache_usage`` is a fraction in 0..1 (vLLM's ``kv_cache_usage_perc``); the counts
        are ints (numpy integers too) in 0..2**32-1. Raises UnknownEndpointError or ValueError
        and changes nothing on bad input.
        """
        counts = [
            None if value is None else check_index(name, value, maximum=U32_MAX)
            for name, value in (
                ("waiting", waiting),
                ("running", running),
                ("max_concurrency", max_concurrency),
            )
        ]
        if kv_cache_usage is not None:
            kv_cache_usage = check_probability("kv_cache_usage", kv_cache_usage)
        self._native.update(
            endpoint_id,
            counts[0],
            counts[1],
            None if kv_cache_usage is None else float(kv_cache_usage),
            counts[2],
            _now(now),
        )

    def set_loras(
        self,
        endpoint_id: EndpointId,
        active: Iterable[str] = (),
        waiting: Iterable[str] = (),
        max_loras: int = 0,
    ) -> None:
        """Set the LoRA adapters an endpoint has active (running requests) and waiting, and
        how many it holds at once (an int in 0..2**32-1). A single str is one adapter's name
        (as ``SliceTracker(endpoints="a")`` is one endpoint), not its letters.

        >>> pool = EndpointPool(["a"])
        >>> pool.set_loras("a", ["sql"], [], max_loras=4)
        >>> pool.endpoints()[0]["active_loras"]
        ['sql']
        >>> pool.set_loras("a", "sql-adapter", max_loras=4)
        >>> pool.endpoints()[0]["active_loras"]
        ['sql-adapter']
        """
        adapters = []
        for name, names in (("active", active), ("waiting", waiting)):
            listed = [names] if isinstance(names, str) else check_iterable(name, names)
            for i, adapter in enumerate(listed):
                check_utf8(f"{name}[{i}]", adapter)
            adapters.append(listed)
        limit = check_index("max_loras", max_loras, maximum=U32_MAX)
        self._native.set_loras(endpoint_id, adapters[0], adapters[1], limit)

    def update_from_metrics_text(
        self, endpoint_id: EndpointId, text: str, *, now: float | None = None
    ) -> MetricsRead:
        """Apply a Prometheus ``/metrics`` scrape of a vLLM or SGLang engine (queue, running,
        KV-cache use, LoRA adapters). Returns the values read.

        >>> pool = EndpointPool(["a"])
        >>> text = 'vllm:num_requests_waiting{engine="0"} 7.0\\nvllm:kv_cache_usage_perc 0.5\\n'
        >>> pool.update_from_metrics_text("a", text, now=0.0)["waiting"]
        7
        """
        return self._native.update_from_metrics_text(
            endpoint_id, check_utf8("text", text), _now(now)
        )

    def endpoints(self) -> list[EndpointInfo]:
        """Every endpoint: description, last metrics, LoRA state and in-flight counts."""
        return self._native.endpoints()

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"EndpointPool({len(self)} endpoints, stale after {self.stale_after_s} s)"


def _native_endpoint(
    endpoint: Endpoint,
) -> tuple[EndpointId, str, str | None, dict[str, str], str | None]:
    """An endpoint's fields checked, as the native ``upsert`` takes them."""
    check_id("endpoint id", endpoint.id)
    check_utf8("address", endpoint.address)
    check_optional_str("role", endpoint.role)
    if endpoint.model is not None:
        check_utf8("model", endpoint.model)
        if not endpoint.model:
            # As EngineSpec: "" would serve only requests naming the model "".
            raise InvalidValueError(
                f"endpoint {endpoint.id!r}: model must be a non-empty str or None "
                f"(None: any model), got ''"
            )
    labels = check_str_mapping("labels", endpoint.labels)
    return endpoint.id, endpoint.address, endpoint.role, labels, endpoint.model


def load_config(config: ConfigLike) -> dict[str, Any]:
    """The configuration as a dict: a preset by name, a YAML / JSON file, or a dict (copied).

    >>> load_config("prefix-only")["plugins"][0]["type"]
    'prefix-cache-scorer'
    """
    return _read_router_config(config)[0]


def _read_router_config(config: ConfigLike) -> tuple[dict[str, Any], list[ConfigNote]]:
    """:func:`load_config`, with a note when a YAML file holds several documents: the first
    is read, as llm-d's loader reads it (Kubernetes' decoder decodes one document and leaves
    the rest), and the others are ignored, said once here rather than silently.

    >>> notes = _read_router_config("plugins: []\\n---\\nplugins: [{type: random-picker}]")[1]
    >>> notes[0]["key"], notes[0]["message"][:36]
    ('---', 'the documents from line 2 on are ign')
    """
    if isinstance(config, Mapping):
        return dict(config), []
    if isinstance(config, str):
        preset = _llmsched.Router.preset(config)
        if preset is not None:
            return preset, []
        if not looks_like_text(config) and not Path(config).is_file():
            names = ", ".join(_llmsched.Router.preset_names())
            raise ConfigError(f"config {config!r} is neither a preset ({names}) nor a file")
    document = read_config(config, what="router config", first_document=True)
    if document.ignored_line is None:
        return document.data, []
    message = (
        f"the documents from line {document.ignored_line} on are ignored: a router config is "
        "one document, and llm-d reads the first one alone"
    )
    return document.data, [{"key": "---", "message": message}]


def config_info(config: ConfigLike) -> ConfigInfo:
    """What a configuration asks of whoever runs the router: the prefix index's block size and
    per-worker capacity, notes (older names, settings without effect), the precise prefix
    scorer's wiring, the ``saturationDetector`` thresholds, whether ``featureGates`` turns
    flow control on, the tokenizer a ``token-producer`` names, the ``dataLayer`` sources, the
    prefill header llm-d's disaggregation handlers set, whether the Inference Extension's
    default profile was built, the path a ``metrics-data-source`` polls, and whether a session
    plugin reads the request's session (then answers carry ``x-session-token``). Raises
    ConfigError naming the key for a configuration a Router refuses.

    >>> profile = {"name": "default", "plugins": [{"pluginRef": "kv-cache-scorer"}]}
    >>> info = config_info({"featureGates": ["flowControl"],
    ...     "plugins": [{"type": "kv-cache-scorer"}], "schedulingProfiles": [profile]})
    >>> info["flow_control"], info["notes"][0]["key"]
    (True, 'plugins[0].type')
    """
    loaded, notes = _read_router_config(config)
    with _naming_file(config):
        native, functions = native_config(loaded)
        info = _config_info(native, functions)
    info["notes"].extend(notes)
    return info


@contextlib.contextmanager
def _naming_file(config: ConfigLike) -> Iterator[None]:
    """Prefixes a ConfigError raised inside with the file ``config`` names, if it names one:
    the native parser names the key (``plugins[3].type``), not the file it came from.

    >>> try:
    ...     with _naming_file("epp.yaml"):
    ...         raise ConfigError("kind: must be EndpointPickerConfig")
    ... except ConfigError as exc:
    ...     print(exc)
    router config 'epp.yaml': kind: must be EndpointPickerConfig
    """
    try:
        yield
    except ConfigError as exc:
        if isinstance(config, os.PathLike):
            path = os.fspath(config)
        elif (
            isinstance(config, str)
            and not looks_like_text(config)
            and _llmsched.Router.preset(config) is None
        ):
            path = config
        else:
            raise
        raise type(exc)(f"router config {path!r}: {exc}") from None


def _config_info(native: dict[str, Any], functions: list[Any]) -> ConfigInfo:
    """The native side's reading of a config from :func:`native_config`: a value its
    conversion refuses without naming a key (a lone surrogate, an int beyond 64 bits, a key
    that is not a str) is named by its key path instead."""
    try:
        info: ConfigInfo = _llmsched.Router.config_info(native, functions)
    except ConfigError:
        check_config_data("router config", native)
        raise
    return info


def _log_notes(info: ConfigInfo) -> None:
    """Logs each note of ``info`` once per process (logger ``llmsched``, level WARNING)."""
    for note in info["notes"]:
        message = f"routing config {note['key']}: {note['message']}"
        if message not in _LOGGED:
            _LOGGED.add(message)
            _warn(message)


def _precise_wiring_message(wiring: PreciseWiring) -> str:
    """What a caller must wire for llm-d's precise prefix scorer, in words."""
    return (
        f"routing config {wiring['key']}: the precise prefix scorer reads the prefix index, "
        "which only KV events from the engines keep exact; a Router that builds its own index "
        "gets none. Wire them: start vLLM with --block-size "
        f"{wiring['block_size']}, PYTHONHASHSEED={wiring['vllm_seed']!r} and "
        "--kv-events-config (publisher zmq, enable_kv_cache_events), then pass Router a shared "
        "PrefixIndex fed by llmsched.integrations.KVEventSubscriber (endpoint "
        f"{wiring['zmq_endpoint']}, topics starting {wiring['topic_filter']!r}), or run "
        "`llmsched serve`, which subscribes to each engine's kv_events (engines without one "
        "publish to that endpoint, which it binds and splits by topic). Until then only the "
        "router's own records of routed requests reach the index."
    )


class Router:
    """Picks endpoints for requests.

    Args:
        pool: the endpoints.
        index: the prefix index shared with other routers or fed by engine events; None builds
            one (block size from the prefix scorer's ``blockSize``, else the index default).
        config: a preset name (``"llm-d"``, ``"sglang-cache-aware"``, ``"dynamo-kv"``, ...),
            a YAML / JSON path, or a dict in llm-d's ``EndpointPickerConfig`` shape. Errors raise
            ConfigError naming the offending key.
        seed: seed of every random choice (tie-breaks, random pickers); a run replays when the
            same requests arrive in the same order.
        record_ttl_s: how long an approximate prefix entry recorded by :meth:`Decision.started`
            counts unless an engine confirms it (default 60 s).
        session_ttl_s, max_sessions: session affinity bookkeeping (defaults 3600 s, 100,000
            bindings; when full, expired ones go first, then the least recently bound). A
            session id longer than 64 bytes is kept as a 128-bit digest, so a binding takes a
            few hundred bytes whatever its id (some tens of MB at the default cap).
        allow_pseudo_tokens: text and chat prompts (``pick(text=/messages=)``) are hashed as
            pseudo-tokens, which never match the real token ids an engine reports in its KV
            events. Such a pick on an index fed by engine events logs one warning (logger
            ``llmsched``), is counted in :meth:`stats` and flagged in ``explain()``, unless this
            is True (the index is fed only by the router's own text picks).
        wires_flow: the caller applies the config's flow-control sections
            (``saturationDetector``, ``featureGates: [flowControl]``) itself, as ``llmsched
            serve`` does: the Router then notes nothing about them.

    User plugins: a plugin entry ``{"type": "python-scorer", "name": ..., "parameters":
    {"function": fn}}`` (or ``python-filter``) calls ``fn(request, endpoints)`` once per
    decision with the GIL held; it returns one score (0..1) or keep-flag per endpoint. Each
    endpoint is a dict (id, address, role, labels, waiting, running, kv_cache_usage, saturated,
    in-flight counts, cached_tokens). This path is much slower than a built-in plugin (Python
    objects per endpoint). Filters take ``"failOpen": true`` to be skipped instead of emptying
    the set; scorers take ``"readsMetrics": true`` to score saturated endpoints 0.

    Configuration notes (older plugin names, settings without effect) are logged once through
    the ``llmsched`` logger and listed in :attr:`warnings`. With llm-d's precise prefix scorer
    and no ``index``, the Router warns what the caller must wire (KV events into a shared index);
    ``saturationDetector`` and ``featureGates`` configure flow control, which a bare Router has
    none of: :func:`config_info` returns them for the caller (the gateway wires them). Likewise
    a ``token-producer`` plugin names the tokenizer the caller must use (warned without
    ``index``), and the prefill header of llm-d's disaggregation handlers is the gateway's.

    >>> router = Router(EndpointPool(["a"]), config="round-robin")
    >>> router.pick(tokens=[1, 2, 3]).endpoint
    'a'
    """

    __slots__ = (
        "_index",
        "_info",
        "_native",
        "_pool",
        "_pseudo_lock",
        "_pseudo_ok",
        "_pseudo_picks",
        "_reads_roles",
        "_sync",
        "_token_check",
        "_token_checks",
        "_warnings",
    )

    def __init__(
        self,
        pool: EndpointPool,
        index: PrefixIndex | None = None,
        config: ConfigLike = "llm-d",
        *,
        seed: int | None = None,
        record_ttl_s: float | None = None,
        session_ttl_s: float | None = None,
        max_sessions: int | None = None,
        allow_pseudo_tokens: bool = False,
        wires_flow: bool = False,
    ) -> None:
        if not isinstance(allow_pseudo_tokens, bool):
            raise InvalidTypeError("allow_pseudo_tokens must be a bool")
        if not isinstance(wires_flow, bool):
            raise InvalidTypeError("wires_flow must be a bool")
        self._pseudo_ok = allow_pseudo_tokens
        self._pseudo_picks = 0
        self._sync: _llmsched.ReplicaSync | None = None
        # Picks run on many threads at once (no GIL on free-threaded CPython): `+= 1` alone
        # could lose counts there (probe 53 F3).
        self._pseudo_lock = threading.Lock()
        self._token_check = _TokenCheck()
        self._token_checks: list[Callable[[], TokenCheckCounts]] = []
        if not isinstance(pool, EndpointPool):
            raise InvalidTypeError(f"pool must be an EndpointPool, got {type(pool).__name__}")
        if seed is not None:
            check_seed(seed)
        for name, value in (("record_ttl_s", record_ttl_s), ("session_ttl_s", session_ttl_s)):
            check_number_like(name, value, optional=True)
        check_int_like("max_sessions", max_sessions, optional=True)
        if max_sessions is not None and not 1 <= operator.index(max_sessions) < 2**64:
            # The native (unsigned) conversion gave a bare OverflowError.
            raise InvalidValueError(
                f"max_sessions must be in 1..2**64-1 or None, got {describe_int(max_sessions)}"
            )
        loaded, notes = _read_router_config(config)
        with _naming_file(config):
            native, functions = native_config(loaded)
            info = _config_info(native, functions)
        info["notes"].extend(notes)
        self._reads_roles = _reads_roles(loaded)
        _log_notes(info)
        warnings = [f"routing config {n['key']}: {n['message']}" for n in info["notes"]]
        if index is None and info["precise"] is not None:
            message = _precise_wiring_message(info["precise"])
            warnings.append(message)
            if message not in _LOGGED:
                _LOGGED.add(message)
                _warn(message)
        tokenizer = info["tokenizer"]
        if index is None and tokenizer is not None:
            message = (
                f"routing config {tokenizer['key']}: llm-d tokenizes each prompt with the "
                f"tokenizer of {tokenizer['model']!r} before scoring; a Router is given tokens: "
                "pass Router.pick(tokens=...) the ids of that tokenizer "
                "(llmsched.tokenize.PromptTokenizer on its saved files), or run `llmsched serve`, "
                "which tokenizes with its `tokenizer`"
            )
            warnings.append(message)
            if message not in _LOGGED:
                _LOGGED.add(message)
                _warn(message)
        for section, present in (
            ("saturationDetector", info["saturation"] is not None),
            ("featureGates: flowControl", info["flow_control"]),
        ):
            if present and not wires_flow:
                message = (
                    f"routing config {section}: configures flow control, which a Router alone "
                    "does not run; `llmsched serve` applies it, elsewhere read it with "
                    "config_info(config) and configure a FlowController"
                )
                warnings.append(message)
                if message not in _LOGGED:
                    _LOGGED.add(message)
                    _warn(message)
        if index is None:
            block_size, capacity = info["block_size"], info["worker_capacity"]
            index = (
                PrefixIndex(worker_capacity=capacity)
                if block_size is None
                else PrefixIndex(block_size, worker_capacity=capacity)
            )
        elif not isinstance(index, PrefixIndex):
            raise InvalidTypeError(
                f"index must be a PrefixIndex or None, got {type(index).__name__}"
            )
        elif info["worker_capacity"] not in (None, index.worker_capacity):
            # A given index keeps its own bound: the config's would be dropped unsaid.
            message = (
                f"routing config lruCapacityPerServer: {info['worker_capacity']} has no effect: "
                f"the prefix index given holds {index.worker_capacity or 'unbounded'} blocks "
                "per worker (PrefixIndex(worker_capacity=...) sets it)"
            )
            warnings.append(message)
            if message not in _LOGGED:
                _LOGGED.add(message)
                _warn(message)
        self._pool = pool
        self._index = index
        self._info = info
        self._warnings = warnings
        with _naming_file(config):
            self._native = _llmsched.Router(
                pool._native,
                index._native,
                native,
                functions,
                seed,
                record_ttl_s,
                session_ttl_s,
                max_sessions,
            )

    @staticmethod
    def presets() -> list[str]:
        """Names of the ready-made configurations.

        >>> "llm-d" in Router.presets()
        True
        """
        return _llmsched.Router.preset_names()

    @staticmethod
    def plugin_types() -> list[str]:
        """Every plugin type name a configuration may use."""
        return _llmsched.Router.plugin_types()

    @staticmethod
    def plugin_catalogue() -> list[PluginInfo]:
        """Every plugin type with its kind, a one-line summary and its parameters (type,
        default, inclusive range, accepted values), sorted by type; older names say which type
        they build (``alias_of``). The documentation's plugin catalogue is generated from it.

        >>> low = next(p for p in Router.plugin_catalogue() if p["type"] == "low-queue-filter")
        >>> low["kind"], [(q["name"], q["default"]) for q in low["params"]]
        ('filter', [('threshold', 128)])
        """
        return _llmsched.Router.plugin_catalogue()

    def replica_sync(
        self,
        replica: str,
        *,
        incarnation: int,
        journal_limit: int,
        load_ttl_s: float,
        history_limit: int,
    ) -> _llmsched.ReplicaSync:
        """Turns on replica sync for this router and returns its native end, which
        :class:`llmsched.cluster.ClusterSync` drives (use that; one per router). From this call
        on, every :meth:`Decision.started` journals its prefix record and session binding."""
        check_str("replica", replica)
        if not 0 < len(replica.encode("utf-8", "surrogatepass")) <= 65_535:
            # The batches carry the name in at most 65,535 bytes; an empty name is no name.
            raise InvalidValueError(f"replica must be 1 to 65,535 bytes, got {len(replica)} chars")
        check_int("incarnation", incarnation, maximum=2**64 - 1)
        check_int("journal_limit", journal_limit, maximum=2**32)
        check_int("history_limit", history_limit, maximum=2**32)
        check_positive_seconds("load_ttl_s", load_ttl_s)
        self._sync = _llmsched.ReplicaSync(
            self._native, replica, incarnation, journal_limit, load_ttl_s, history_limit
        )
        return self._sync

    @property
    def pool(self) -> EndpointPool:
        """The endpoint pool."""
        return self._pool

    @property
    def index(self) -> PrefixIndex:
        """The prefix index matched on every pick."""
        return self._index

    @property
    def profiles(self) -> list[str]:
        """Names of the configured scheduling profiles."""
        return self._native.profiles

    def stats(self) -> dict[str, int]:
        """``pseudo_token_picks``: text or chat picks made while the index was fed by engine
        events (see ``allow_pseudo_tokens``); they cannot match the engines' cached prefixes.
        ``config_warnings``: how many notes :attr:`warnings` lists (the configuration's:
        settings without effect, a scorer that can never change a decision, wiring the caller
        lacks; :attr:`pseudo_token_warning` and :attr:`token_warning` once given).
        ``token_prompts_confirmed`` / ``token_prompts_unconfirmed``: of the token prompts
        sampled on an index fed by engine events (one a second at most, of 512 tokens or more),
        those whose first block an engine reported within 60 s of the pick, and those it did
        not while events kept arriving. Many unconfirmed and none confirmed means the router is
        given other token ids than the engines cache (a chat template or BOS token on one side
        only, another tokenizer): warned once (logger ``llmsched``) and noted in every later
        ``explain()``.

        >>> Router(EndpointPool(["a"])).stats()  # doctest: +NORMALIZE_WHITESPACE
        {'pseudo_token_picks': 0, 'config_warnings': 0, 'token_prompts_confirmed': 0,
         'token_prompts_unconfirmed': 0}
        """
        check = self._token_check
        confirmed, unconfirmed, pseudo = check.confirmed, check.unconfirmed, self._pseudo_picks
        for counts in self._token_checks:
            more_confirmed, more_unconfirmed, _, more_pseudo = counts()
            confirmed += more_confirmed
            unconfirmed += more_unconfirmed
            pseudo += more_pseudo
        notes = len(self._warnings) + (pseudo > 0) + (self.token_warning is not None)
        return {
            "pseudo_token_picks": pseudo,
            "config_warnings": notes,
            "token_prompts_confirmed": confirmed,
            "token_prompts_unconfirmed": unconfirmed,
        }

    def add_token_check(self, counts: Callable[[], TokenCheckCounts]) -> None:
        """Counts the token-id checks of a data plane that decides with this router outside
        :meth:`pick` (``llmsched serve``'s native plane, which tokenizes and decides natively
        and runs the same checks on its prompts) as this router's own: ``counts()`` gives its
        confirmed and unconfirmed prompts, added to ``stats()["token_prompts_..."]``, the
        unconfirmed count when it warned (None before), from when on :attr:`token_warning` is
        :data:`TOKEN_MISMATCH_NOTE` with that count (unless this router warned itself), and its
        prompts hashed as pseudo-tokens while engine events fed the index, added to
        ``stats()["pseudo_token_picks"]``.

        >>> router = Router(EndpointPool(["a"]))
        >>> router.add_token_check(lambda: (0, 32, 32, 0))
        >>> router.stats()["token_prompts_unconfirmed"], router.token_warning is not None
        (32, True)
        """
        self._token_checks.append(counts)

    @property
    def config_info(self) -> ConfigInfo:
        """What the configuration asks of the caller (see :func:`config_info`)."""
        return self._info

    @property
    def warnings(self) -> list[str]:
        """The configuration's notes and the wiring it lacks, as logged when it was built, then
        :attr:`pseudo_token_warning` and :attr:`token_warning` once the router gave them."""
        given = (self.pseudo_token_warning, self.token_warning)
        return [*self._warnings, *(note for note in given if note is not None)]

    @property
    def pseudo_token_warning(self) -> str | None:
        """:data:`PSEUDO_TOKEN_NOTE` once a text or chat prompt was hashed as pseudo-tokens
        while the index was fed by engine events (``stats()["pseudo_token_picks"]`` above 0;
        logged then and noted in that decision's ``explain()``), else None. Listed in
        :attr:`warnings` and counted in ``stats()["config_warnings"]``;
        :class:`~llmsched.Scheduler` lists it in its ``warnings``, so the gateway counts it in
        ``llmsched_gateway_config_warnings``. A router built with ``allow_pseudo_tokens=True``
        never gives it.

        >>> Router(EndpointPool(["a"])).pseudo_token_warning is None
        True
        """
        pseudo = self._pseudo_picks + sum(counts()[3] for counts in self._token_checks)
        return PSEUDO_TOKEN_NOTE if pseudo > 0 else None

    @property
    def token_warning(self) -> str | None:
        """The warning that the token ids given to :meth:`pick` never matched a block the
        engines reported (:data:`TOKEN_MISMATCH_NOTE`, with the count of prompts checked when
        it was logged), or None while it was not given: see ``stats()["token_prompts_..."]``.
        :class:`~llmsched.Scheduler` lists it in its ``warnings``, so the gateway counts it in
        ``llmsched_gateway_config_warnings``. A check added by :meth:`add_token_check` (the
        native data plane's) gives it too.

        >>> Router(EndpointPool(["a"])).token_warning is None
        True
        """
        own = self._token_check.warning
        if own is not None:
            return own
        for counts in self._token_checks:
            warned_at = counts()[2]
            if warned_at is not None:
                return TOKEN_MISMATCH_NOTE.format(unconfirmed=warned_at)
        return None

    @property
    def reads_roles(self) -> bool:
        """Whether the configuration can tell endpoints apart by their ``role``: it declares a
        ``prefill-filter`` or ``decode-filter``, a P/D profile handler, or a filter that may
        read roles or labels (a label selector, a decision tree, a ``python-filter``).
        Otherwise an endpoint of role ``prefill`` is sent whole requests like any other
        (:class:`~llmsched.Scheduler` notes such engines).

        >>> Router(EndpointPool(["a"]), config="llm-d").reads_roles
        False
        >>> Router(EndpointPool(["a"]), config="llm-d-pd").reads_roles
        True
        """
        return self._reads_roles

    def pick(
        self,
        tokens: TokensLike | None = None,
        *,
        text: str | bytes | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        model: str | None = None,
        lora: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        cache_salt: str | None = None,
        now: float | None = None,
        session_endpoint: EndpointId | None = None,
    ) -> Decision:
        """Decide where one request goes. Give exactly one of ``tokens`` (token ids: numpy
        array or sequence), ``text`` (a raw prompt) or ``messages`` (chat messages); text is
        hashed as pseudo-tokens of 4 UTF-8 bytes, as llm-d's approximate mode does: the same
        hashes as :meth:`PrefixIndex.hash_text` (messages are rendered by
        :func:`render_messages` first). Pseudo-tokens never match an engine's token ids: for an
        index fed by engine KV events, tokenize with :mod:`llmsched.tokenize` and pass
        ``tokens`` (see ``allow_pseudo_tokens``).

        ``model`` restricts the endpoints to those serving it; ``lora`` names the adapter and
        ``cache_salt`` isolates a tenant's cache (both are folded into the prompt hashes); each
        is a non-empty str or None, ``""`` is refused (``InvalidValueError``), as an
        :class:`Endpoint`'s empty ``model`` is;
        ``priority``, ``session_id`` and ``headers`` reach the plugins. Nothing changes until
        :meth:`Decision.started`. Raises NoEndpointError when no endpoint can serve it.

        The session plugins (``session-affinity-scorer`` / ``-filter``) favour the endpoint
        the session is bound to: the live binding of ``session_id`` (made by
        :meth:`Decision.started`), else ``session_endpoint``, an endpoint id the caller names
        as the session's (what llm-d's ``x-session-token`` names; the gateway decodes it). An
        id that is no endpoint of the pool is ignored. ``session_endpoint`` binds nothing.

        >>> router = Router(EndpointPool(["a", "b"]), config="prefix-only", seed=1)
        >>> d = router.pick(text="You are a helpful assistant.", now=0.0)
        >>> d.endpoint in ("a", "b")
        True
        >>> sticky = Router(EndpointPool(["a", "b"]), config={
        ...     "plugins": [{"type": "session-affinity-scorer"}],
        ...     "schedulingProfiles": [{"name": "default",
        ...         "plugins": [{"pluginRef": "session-affinity-scorer"}]}]})
        >>> [sticky.pick(tokens=[1, 2], session_endpoint="b", now=0.0).endpoint for _ in "xyz"]
        ['b', 'b', 'b']
        """
        array: npt.NDArray[np.integer] | list[int] | tuple[int, ...]
        if (
            text is None
            and messages is None
            and type(tokens) is np.ndarray
            and tokens.ndim == 1
            and tokens.dtype.kind in "iu"
            and tokens.flags.c_contiguous
        ):
            array = tokens  # the common case, read in place: skip the normalisation below
        else:
            array = _prompt_array(tokens, text, messages)
        if type(priority) is not int:
            raise InvalidTypeError(f"priority must be an int, got {type(priority).__name__}")
        if not -(2**31) <= priority < 2**31:
            raise InvalidValueError(f"priority must fit in 32 bits, got {priority}")
        if model == "" or lora == "" or cache_salt == "":
            check_no_empty_names(model=model, lora=lora, cache_salt=cache_salt)
        header_items = [] if headers is None else _headers(headers)
        if now is None:
            clock = time.monotonic()
        elif type(now) is float and 0.0 <= now < math.inf:
            clock = now  # the common case, checked inline (pick is the hot path)
        else:
            clock = check_now(now)
        try:
            native = self._native.pick(
                array,
                model,
                lora,
                priority,
                session_id,
                header_items,
                cache_salt,
                clock,
                session_endpoint,
            )
        except (TypeError, UnicodeEncodeError):
            # Name an argument the native conversion refused: a type, or a str with a lone
            # surrogate (a plugin's own error passes through: these all hold then).
            for name, value in (
                ("model", model),
                ("lora", lora),
                ("session_id", session_id),
                ("cache_salt", cache_salt),
            ):
                if check_optional_str(name, value) is not None:
                    check_utf8(name, value)
            check_str_mapping("headers", dict(header_items))
            raise
        notes: tuple[str, ...] = ()
        if tokens is None:
            if not self._pseudo_ok:  # a text or chat prompt
                notes = self._pseudo_token_notes()
        else:
            check = self._token_check
            if clock >= check.next_at:  # at most once a second: the hot path reads a float
                check.step(self._index, array, lora, cache_salt, clock)
            if check.warned:
                notes = (check.note(),)
        return Decision(native, self._pool, clock, notes, self._sync)

    def _pseudo_token_notes(self) -> tuple[str, ...]:
        if not self._index.fed_by_engine_events:
            return ()
        with self._pseudo_lock:
            self._pseudo_picks += 1
            first = self._pseudo_picks == 1
        if first:
            import logging  # only on this rare path: `import llmsched` stays light

            logging.getLogger("llmsched").warning("router: %s", PSEUDO_TOKEN_NOTE)
        return (PSEUDO_TOKEN_NOTE,)

    def __repr__(self) -> str:
        return f"Router(profiles={self.profiles}, endpoints={len(self._pool)})"


class Decision:
    """Where a request goes: the chosen endpoint, ordered fallbacks, the prefill endpoint
    when the request is split, and a per-endpoint, per-scorer breakdown (:meth:`explain`).

    In-flight accounting: call :meth:`started` when the request is sent (or use the decision
    as a context manager), :meth:`first_token` when its first token arrives, :meth:`finished`
    at the end. ``started`` also records approximate prefix entries for the endpoints used and
    binds the session. A decision that is dropped finishes itself.

    >>> router = Router(EndpointPool(["a"]), config="least-load")
    >>> with router.pick(tokens=[1, 2, 3], now=0.0) as d:
    ...     d.stage
    'sent'
    >>> d.stage
    'finished'
    """

    __slots__ = ("_native", "_notes", "_now", "_pool", "_sync")

    def __init__(
        self,
        native: _llmsched.Decision,
        pool: EndpointPool,
        now: float,
        notes: tuple[str, ...] = (),
        sync: _llmsched.ReplicaSync | None = None,
    ) -> None:
        self._native = native
        self._pool = pool
        self._now = now
        self._notes = notes
        self._sync = sync

    @property
    def endpoint(self) -> EndpointId:
        """The chosen endpoint's id (the decode endpoint when split)."""
        chosen: EndpointId = self._native.endpoint
        return chosen

    @property
    def address(self) -> str:
        """The chosen endpoint's address."""
        return self._native.address

    @property
    def fallbacks(self) -> list[EndpointId]:
        """Next-best endpoints, best first (the picker's ``maxNumOfEndpoints`` minus one)."""
        return self._native.fallbacks

    @property
    def fallback_addresses(self) -> list[str]:
        """Addresses of :attr:`fallbacks`."""
        return self._native.fallback_addresses

    @property
    def prefill_endpoint(self) -> EndpointId | None:
        """The endpoint that prefills the prompt when the request is split, else None."""
        prefill: EndpointId | None = self._native.prefill_endpoint
        return prefill

    @property
    def prefill_address(self) -> str | None:
        """The prefill endpoint's address, else None."""
        return self._native.prefill_address

    @property
    def disaggregated(self) -> bool:
        """Whether prefill runs on a separate endpoint (never the decode endpoint itself:
        :meth:`pd` says why a request is not split)."""
        return self._native.prefill_endpoint is not None

    @property
    def prompt_tokens(self) -> int:
        """Tokens (or pseudo-tokens) in the prompt."""
        return self._native.prompt_tokens

    @property
    def cached(self) -> int:
        """Prompt tokens cached on the chosen endpoint."""
        return self._native.cached

    @property
    def cold(self) -> bool:
        """No endpoint held any part of the prompt."""
        return self._native.cold

    @property
    def stage(self) -> str:
        """``"picked"``, ``"sent"``, ``"decoding"`` or ``"finished"``."""
        return self._native.stage

    def cached_tokens(self) -> dict[EndpointId, int]:
        """Prompt tokens cached on every endpoint considered."""
        return self._native.cached_tokens()

    def pd(self) -> PdNote | None:
        """The prefill/decode decision (uncached tokens on the decode endpoint, whether a
        split was wanted and made, and why), or None without a P/D handler.

        A prefill profile that picks the decode endpoint itself (an endpoint of role
        ``both`` passes both role filters) makes no split: ``disaggregated`` is False,
        ``reason`` is ``"same-endpoint"``, there is no :attr:`prefill_endpoint` and the
        gateway sets no prefill header, so the engine prefills locally instead of handing
        the request off to itself.

        >>> pool = EndpointPool([Endpoint("b", role="both")])
        >>> note = Router(pool, config="llm-d-pd").pick(tokens=list(range(256)), now=0.0).pd()
        >>> note["disaggregated"], note["reason"]
        (False, 'same-endpoint')
        """
        return self._native.pd()

    def started(self, endpoint: EndpointId | None = None, *, now: float | None = None) -> None:
        """The request is being sent: to the chosen endpoint, or to ``endpoint`` (e.g. a
        fallback). Adds it to the in-flight counts, records approximate prefix entries for the
        endpoints used, binds the session. Once only: again, or after :meth:`finished`, raises
        :class:`~llmsched.errors.PlacementError` (a RuntimeError).

        >>> d = Router(EndpointPool(["a"]), config="round-robin").pick(tokens=[1], now=0.0)
        >>> d.finished()
        True
        >>> d.started(now=0.0)
        Traceback (most recent call last):
            ...
        llmsched.errors.PlacementError: this decision has finished (finished(), or the end of its with block): started() must come before it
        """  # noqa: E501
        try:
            self._native.started(endpoint, _now(now))
        except PlacementError:
            if self.stage == "finished":  # the native message says "already called"
                raise PlacementError(
                    "this decision has finished (finished(), or the end of its with block): "
                    "started() must come before it"
                ) from None
            raise

    def again(self) -> Decision:
        """A fresh decision with this one's choice, fallbacks and scores, not yet started: a
        retry sends it to a fallback (``again().started(fallback)``) where this one failed.
        No new pick is made, so stateful pickers do not move: with round-robin a retry does
        not take the next request's turn (the native data plane retries the same way).

        >>> router = Router(EndpointPool(["a", "b"]), config="round-robin")
        >>> first = router.pick(tokens=[1], now=0.0)
        >>> first.started(now=0.0)
        >>> first.finished()
        True
        >>> retry = first.again()
        >>> retry.started(first.fallbacks[0], now=0.0)
        >>> retry.stage, retry.endpoint == first.endpoint
        ('sent', True)
        >>> retry.finished()
        True
        >>> router.pick(tokens=[2], now=0.0).endpoint != first.endpoint  # the next turn
        True
        """
        return Decision(self._native.again(), self._pool, self._now, self._notes, self._sync)

    def first_token(self) -> bool:
        """The first token arrived: the prefill work is done. False if already noted or
        finished; :class:`~llmsched.errors.PlacementError` before :meth:`started`."""
        return self._native.first_token()

    def finished(self) -> bool:
        """The request ended (done, failed or cancelled): its in-flight counts are given back.
        False if it had already finished."""
        return self._native.finished()

    def __enter__(self) -> Decision:
        if self.stage == "picked":
            self.started()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finished()

    async def __aenter__(self) -> NoReturn:
        # ``async with`` where a plain ``with`` belongs: Python's own error named neither form.
        self.finished()
        raise InvalidTypeError(
            "a Decision is entered with a plain `with router.pick(...) as decision:` (the pick "
            "does not wait), in async code too (this decision was finished: its in-flight "
            "counts are given back)"
        )

    async def __aexit__(self, *exc_info: object) -> None:
        """Never reached: :meth:`__aenter__` raises."""

    def explain(self, limit: int | None = EXPLAIN_ROWS) -> Explanation:
        """Per profile, per endpoint: every scorer's clamped score, the weighted total, the
        rank, or the filter that removed it. ``print()`` it for a table. Rows whose scores
        were forced (an endpoint with stale metrics counts as saturated: scorers that read
        metrics give it 0) carry a :attr:`EndpointScores.note` saying why, marked ``*`` in the
        table; :attr:`Explanation.notes` flags the request itself (e.g. a text prompt on an
        index fed by engine events) and the router (a synced replica whose name another live
        replica uses).

        ``limit`` (default :data:`EXPLAIN_ROWS`, 1000): at most that many rows per profile. A
        larger pool keeps the table's first rows (the chosen endpoint and the fallbacks by
        rank, then the highest totals, then the endpoints filters removed) and counts the rest
        in :attr:`ProfileExplanation.omitted` (with how many reached the scorers and how many
        each filter removed); :meth:`ProfileExplanation.row` still finds any endpoint, built on
        demand. ``None``: a row for every endpoint, in pool order (seconds at 200,000).

        >>> pool = EndpointPool(["a", "b"], stale_policy="ignore")
        >>> pool.update("b", waiting=4)
        >>> d = Router(pool, config="least-load").pick(tokens=[1, 2, 3])
        >>> row = d.explain()["default"].row("b")
        >>> row.scores["queue-scorer"], row.total
        (0.0, 1.0)
        >>> short = d.explain(limit=1)["default"]
        >>> [r.endpoint for r in short.rows], short.omitted, short.row("b").total
        (['a'], 1, 1.0)
        """
        if limit is not None:
            limit = check_int("limit", limit)
        raw = self._native.explain_data(limit)
        profiles = [
            ProfileExplanation._from_raw(p, self._saturation_note, self._row_lookup(i))
            for i, p in enumerate(raw)
        ]
        request_notes = list(self._notes)
        sync = self._sync
        if sync is not None and sync.replica in sync.shared_names():
            request_notes.append(SHARED_REPLICA_NAME_NOTE.format(name=sync.replica))
        return Explanation(profiles=profiles, pd=self.pd(), notes=request_notes)

    def _saturation_note(self, row: ProfileRow) -> str | None:
        """Why ``row``'s endpoint counted as saturated at the pick (None: it did not): the age
        then of the metrics the pick read (not of the pool's metrics now, which may have been
        refreshed since, or gone with the endpoint)."""
        if not row["saturated"]:
            return None
        stamp = row["metrics_timestamp"]
        why = (
            "no metrics reported"
            if stamp is None
            else f"metrics {self._now - stamp:.3g} s old at the pick"
        )
        after = self._pool.stale_after_s
        return f"saturated: {why} (stale after {after:g} s); scorers that read metrics gave 0"

    def _row_lookup(self, profile: int) -> Callable[[EndpointId], ProfileRow | None]:
        native = self._native

        def lookup(endpoint: EndpointId) -> ProfileRow | None:
            return native.explain_row(profile, endpoint)

        return lookup

    def __repr__(self) -> str:
        split = f", prefill={self.prefill_endpoint!r}" if self.disaggregated else ""
        return f"Decision(endpoint={self.endpoint!r}{split}, fallbacks={self.fallbacks!r})"


@dataclass(frozen=True)
class EndpointScores:
    """One endpoint in one profile run."""

    endpoint: EndpointId
    address: str
    cached_tokens: int
    saturated: bool
    """Its metrics were stale at the pick (pool ``stale_policy="saturated"``)."""
    removed_by: str | None
    """The filter that removed it, or None if it reached the scorers."""
    scores: dict[str, float]
    """Each scorer's clamped score (empty if removed)."""
    weighted: dict[str, float]
    """Each scorer's score times its weight."""
    total: float | None
    rank: int | None
    """0 for the chosen endpoint, 1.. for fallbacks, None otherwise."""
    note: str | None = None
    """Why its scores were forced (saturated: stale metrics), or None."""


@dataclass(frozen=True)
class ProfileExplanation:
    """One profile run: its plugins and a row per endpoint considered."""

    profile: str
    picker: str
    filters: list[str]
    skipped_filters: list[str]
    """Fail-open filters skipped because they would have removed every endpoint."""
    weights: dict[str, float]
    rows: list[EndpointScores]
    """A row per endpoint considered, or the table's first ``limit`` rows (see
    :meth:`Decision.explain`)."""
    omitted: int = 0
    """Endpoints considered without a row here (0: every endpoint has one)."""
    omitted_kept: int = 0
    """Of those, the ones that reached the scorers: unranked, with totals no higher than
    any unranked row shown."""
    omitted_removed_by: dict[str, int] = field(default_factory=dict)
    """Of those, how many each filter removed."""
    _lookup: Callable[[EndpointId], EndpointScores | None] | None = field(
        default=None, repr=False, compare=False
    )

    @classmethod
    def _from_raw(
        cls,
        raw: ProfileData,
        note: Callable[[ProfileRow], str | None] | None = None,
        lookup: Callable[[EndpointId], ProfileRow | None] | None = None,
    ) -> ProfileExplanation:
        # One label per scorer entry: a name the profile repeats gets "#2", ... rather than
        # merging entries and mismatching the score columns.
        names: list[str] = []
        for name, _ in raw["scorers"]:
            label, n = name, 1
            while label in names:
                n += 1
                label = f"{name}#{n}"
            names.append(label)
        weights = {label: w for label, (_, w) in zip(names, raw["scorers"], strict=True)}

        def build(r: ProfileRow) -> EndpointScores:
            scores = dict(zip(names, r["scores"], strict=True)) if r["scores"] is not None else {}
            return EndpointScores(
                endpoint=r["endpoint"],
                address=r["address"],
                cached_tokens=r["cached_tokens"],
                saturated=r["saturated"],
                removed_by=r["removed_by"],
                scores=scores,
                weighted={k: v * weights[k] for k, v in scores.items()},
                total=r["total"],
                rank=r["rank"],
                note=note(r) if note is not None and r["saturated"] else None,
            )

        def find(endpoint: EndpointId) -> EndpointScores | None:
            found = lookup(endpoint) if lookup is not None else None
            return None if found is None else build(found)

        omitted = raw.get("omitted", 0)
        return cls(
            raw["profile"],
            raw["picker"],
            raw["filters"],
            raw["skipped_filters"],
            weights,
            [build(r) for r in raw["rows"]],
            omitted=omitted,
            omitted_kept=raw.get("omitted_kept", 0),
            omitted_removed_by=dict(raw.get("omitted_removed_by", {})),
            _lookup=find if omitted else None,
        )

    def row(self, endpoint: EndpointId) -> EndpointScores:
        """The row of ``endpoint`` (KeyError if it was not considered); one left out of
        :attr:`rows` (:attr:`omitted`) is built on demand."""
        for r in self.rows:
            if r.endpoint == endpoint:
                return r
        found = self._lookup(endpoint) if self._lookup is not None else None
        if found is None:
            raise KeyError(endpoint)
        return found

    def __str__(self) -> str:
        names = list(self.weights)
        head = ["endpoint", *[f"{n} x{self.weights[n]:g}" for n in names], "total", "rank"]
        lines = [head]
        ordered = sorted(self.rows, key=lambda r: (r.rank is None, r.rank or 0, -(r.total or 0)))
        footnotes = []
        for r in ordered:
            name = str(r.endpoint)
            if r.saturated:
                name += " *"
                footnotes.append(f"* {r.endpoint}: {r.note or 'saturated (stale metrics)'}")
            if r.removed_by is not None:
                lines.append([name, f"removed by {r.removed_by}"])
                continue
            cells = [f"{r.scores[n]:.3f}" for n in names]
            total = "" if r.total is None else f"{r.total:.3f}"
            rank = "" if r.rank is None else str(r.rank)
            lines.append([name, *cells, total, rank])
        widths = [max(len(row[i]) for row in lines if i < len(row)) for i in range(len(head))]
        title = f"profile {self.profile!r} (picker {self.picker})"
        body = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in lines]
        if self.omitted:
            removed = ", ".join(f"{n} by {f}" for f, n in self.omitted_removed_by.items())
            body.append(
                f"... {self.omitted} more endpoints not shown: {self.omitted_kept} scored"
                + (f", removed {removed}" if removed else "")
                + " (row() finds any of them)"
            )
        return "\n".join([title, *body, *footnotes])


# What `print(decision.explain())` says for each PdNote reason.
_PD_REASONS: dict[str, str] = {
    "split": "split: another endpoint prefills and hands the KV over",
    "below-threshold": "not split: fewer uncached tokens than the decider's threshold",
    "no-prefill-endpoint": "not split: the prefill profile found no endpoint",
    "prefill-queue-longer": "not split: the prefill endpoint's queue is too long",
    "same-endpoint": (
        "not split: the prefill profile picked the decode endpoint itself (role both); "
        "it prefills locally, with no hand-off to itself"
    ),
}


@dataclass(frozen=True)
class Explanation:
    """What :meth:`Decision.explain` returns: the profiles run, in order."""

    profiles: list[ProfileExplanation]
    pd: PdNote | None
    notes: list[str] = field(default_factory=list)
    """Warnings about the request itself (e.g. a text prompt on an engine-fed index)."""

    def __getitem__(self, profile: str) -> ProfileExplanation:
        for p in self.profiles:
            if p.profile == profile:
                return p
        raise KeyError(profile)

    def __str__(self) -> str:
        parts = [f"note: {n}" for n in self.notes] + [str(p) for p in self.profiles]
        if self.pd is not None:
            pd = self.pd
            why = _PD_REASONS.get(pd["reason"], pd["reason"])
            parts.append(
                f"P/D: {why} ({pd['uncached_tokens']} prompt tokens uncached on the decode "
                f"endpoint)"
            )
        return "\n\n".join(parts)


def text_tokens(text: str | bytes) -> npt.NDArray[np.uint32]:
    """The pseudo-tokens of a raw prompt, as llm-d's approximate mode packs them: its UTF-8 bytes
    4 per ``uint32``, little-endian, the last zero-padded (:func:`llmsched.hashing.pack_text`).

    The router hashes them with its index's block size, like token ids, so text prompts that
    share a prefix share blocks (a trailing partial block is not hashed).

    >>> text_tokens("hello").tolist() == [int.from_bytes(b"hell", "little"), ord("o")]
    True
    """
    if isinstance(text, (bytearray, memoryview)):
        text = bytes(text)
    if not isinstance(text, (str, bytes)):
        raise InvalidTypeError(f"text must be str or bytes, got {type(text).__name__}")
    return pack_text(text)


def render_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """One string for chat messages, stable across requests so shared prefixes hash alike:
    ``"<|role|>\\ncontent\\n"`` per message; list contents join their text parts, a null
    content (an assistant message with only tool calls) counts as empty.

    >>> render_messages([{"role": "system", "content": "Be brief."}])
    '<|system|>\\nBe brief.\\n'
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidTypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidTypeError(f"messages[{i}] must be a mapping with a str 'role'")
        content = m.get("content")
        if content is None:  # an assistant message with only tool calls
            content = ""
        elif isinstance(content, list):
            content = "".join(_part_texts(content, i))
        if not isinstance(content, str):
            raise InvalidTypeError(f"messages[{i}]['content'] must be a str or a list of parts")
        out.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(out)


def _part_texts(parts: list[object], i: int) -> Iterator[str]:
    """The texts of a message's text parts; one that is not a str is refused by its place
    (``"".join`` raised a bare ``TypeError: sequence item 0: expected str instance``)."""
    for j, part in enumerate(parts):
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidTypeError(f"messages[{i}]['content'][{j}]['text'] must be a str")
            yield text


_ROLE_READERS = frozenset(
    {
        "prefill-filter",
        "decode-filter",
        "pd-profile-handler",
        "disagg-profile-handler",
        # Filters that may read a role, or a role label (llm-d's older P/D configs filter
        # `llm-d.ai/role` with `by-label`).
        "by-label",
        "by-label-selector",
        "label-selector-filter",
        "decision-tree",
        "decision-tree-filter",
        "python-filter",
    }
)
"""Plugin types that can tell endpoints apart by role (see :attr:`Router.reads_roles`)."""


def _reads_roles(config: Mapping[str, Any]) -> bool:
    """Whether a loaded (and accepted) config declares a plugin of ``_ROLE_READERS``."""
    plugins = config.get("plugins")
    return isinstance(plugins, list) and any(
        isinstance(p, Mapping) and p.get("type") in _ROLE_READERS for p in plugins
    )


def native_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The config for the native parser (plain data, which the native side converts and checks),
    and the Python callables its ``python-scorer`` / ``python-filter`` plugins name, replaced in
    the config by their index (``parameters.handle``). Package-internal: the router and the
    simulator's native engine both hand config to Rust through it.

    >>> plain, functions = native_config(
    ...     {"plugins": [{"type": "python-scorer", "parameters": {"function": len}}]}
    ... )
    >>> plain
    {'plugins': [{'type': 'python-scorer', 'parameters': {'handle': 0, 'plugin': 'python-scorer'}}]}
    >>> functions == [len]
    True
    """
    functions: list[Any] = []
    plugins = config.get("plugins")
    if isinstance(plugins, list):
        config = dict(config)
        plugins = [dict(p) if isinstance(p, Mapping) else p for p in plugins]
        for i, p in enumerate(plugins):
            if not isinstance(p, dict):
                continue
            parameters = p.get("parameters")
            if parameters is not None and not isinstance(parameters, Mapping):
                # The native decoder would read a list as the fields in order ([] as none).
                raise ConfigError(
                    f"plugins[{i}].parameters: must be a mapping, got {type(parameters).__name__}"
                )
            if p.get("type") not in PYTHON_PLUGIN_TYPES:
                continue
            params = dict(p.get("parameters") or {})
            fn = _plugin_function(params.pop("function", None), f"plugins[{i}].parameters.function")
            params["handle"] = len(functions)
            # Errors about what the function returned name the plugin.
            params["plugin"] = str(p.get("name") or p.get("type"))
            functions.append(fn)
            p["parameters"] = params
        config["plugins"] = plugins
    return config, functions


def _plugin_function(value: object, key: str) -> Callable[..., Any]:
    """A Python plugin's ``function``: a callable, or the import path of one,
    ``"package.module:name"`` (``name`` may be dotted: ``"module:Class.method"``), as a
    YAML / JSON config names it; the module is imported (from ``sys.path``: the server's
    ``PYTHONPATH``) when the config is read. ConfigError naming ``key`` otherwise.

    >>> _plugin_function("operator:truth", "f") is __import__("operator").truth
    True
    >>> try:
    ...     _plugin_function("operator.truth", "f")
    ... except ConfigError as e:
    ...     print(e)
    f: must be a callable or its import path 'module:function', got 'operator.truth'
    """
    if callable(value):
        return value
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise ConfigError(
            f"{key}: must be a callable or its import path 'module:function', got {got}"
        )
    module_name, colon, attribute = value.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(
            f"{key}: must be a callable or its import path 'module:function', got {value!r}"
        )
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{key}: cannot import {value!r}: {exc} (modules are imported from sys.path, "
            "which PYTHONPATH extends)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{key}: importing {module_name!r} of {value!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    owner = module_name
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{key}: cannot import {value!r}: {owner} has no {part!r}") from None
        owner = f"{owner}.{part}"
    if not callable(target):
        raise ConfigError(
            f"{key}: {value!r} is not callable (an object of type {type(target).__name__})"
        )
    return target


def _prompt_array(
    tokens: TokensLike | None,
    text: str | bytes | None,
    messages: Sequence[Mapping[str, Any]] | None,
) -> npt.NDArray[np.integer] | list[int] | tuple[int, ...]:
    """The prompt as the native router takes it, from exactly one of the three forms: a token
    array, or a list or tuple of ids (read natively)."""
    if sum(x is not None for x in (tokens, text, messages)) != 1:
        raise InvalidTypeError("give exactly one of tokens=, text= or messages=")
    if messages is not None:
        text = render_messages(messages)
    if text is not None:
        return text_tokens(text)
    assert tokens is not None  # exactly one of the three is given
    return native_tokens(tokens)


def _headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    # Types only (pick is the hot path): a lone surrogate is named when the native side refuses.
    if not isinstance(headers, Mapping):
        raise InvalidTypeError("headers must be a mapping of str to str")
    items = list(headers.items())
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in items):
        raise InvalidTypeError("headers must map str to str")
    return items


def _now(now: float | None) -> float:
    return check_now(now)


def _reduce_profile(
    profile: ProfileExplanation,
) -> tuple[type[ProfileExplanation], tuple[object, ...]]:
    """A profile's explanation rebuilt from its fields, unless it builds omitted rows on
    demand from its router's decision (a closure no process but this one can run)."""
    if profile._lookup is not None:
        raise NotPicklableError(
            "llmsched.routing.ProfileExplanation with omitted rows builds them from its "
            "router's live decision and cannot be pickled or copied: explain(limit=None) "
            "lists every row"
        )
    return ProfileExplanation, tuple(getattr(profile, f.name) for f in fields(profile))


by_default(Endpoint, EndpointScores, Explanation)
by_value(ProfileExplanation, _reduce_profile)
refuse(
    EndpointPool,
    "build an EndpointPool per process from its endpoints (pool.endpoints())",
    name="llmsched.EndpointPool",
)
refuse(Router, "build a Router per process from its pool and config", name="llmsched.Router")
refuse(
    Decision,
    "keep what it reports (endpoint_id, explain()): a decision belongs to its router",
    name="llmsched.Decision",
)
