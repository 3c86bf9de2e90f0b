"""What each engine serves, checked against the model names of the gateway's config.

The gateway hashes a prompt in the namespace of its model: a base model's blocks by their
tokens alone, a LoRA adapter's by the adapter's name as well, as vLLM keys an adapter's KV
blocks (and names the adapter in its KV events). A config that lists an adapter under
``models`` hashes the adapter's requests as a base model's: they never match the blocks the
engine reports for them, and the LoRA filters and scorers never see the adapter. One that lists
a base model under ``lora_adapters`` misses the other way. Nothing fails; routing is worse, so
nobody notices.

:class:`EngineModelCheck` reads each engine's ``GET /v1/models`` (vLLM lists every adapter with
its base model as ``parent``) when the engine joins and every ``recheck_s`` after (adapters
can be loaded at run time), and reports each problem it finds once through ``logging``
(warning), in :meth:`~EngineModelCheck.findings` and, on both data planes, in ``/metrics``
(``llmsched_gateway_engine_model_mismatches``, by engine and kind). The kinds:

==========================  ==================================================================
``adapter_listed_as_model`` the engine serves NAME as a LoRA adapter; ``models`` lists it
``base_model_differs``      the engine's base model for adapter NAME is not the one
                            ``lora_adapters`` names
``model_listed_as_adapter`` the engine serves NAME as a base model; ``lora_adapters`` lists it
``model_not_served``        the engine lists none of the models requests may send it (its
                            ``model``, or the config's ``models``): it refuses every one
``max_model_len_differs``   the engine's context length is not the config's
                            ``max_model_len`` (or, without one, the other engines'): a
                            ``truncate_prompt_tokens`` of -1 keeps another prompt there
``model_not_configured``    the engine's own ``model`` (its config entry, a discovered pod's)
                            is none of ``models`` and ``lora_adapters``: requests may only
                            name those, so none is ever routed there (found from the config,
                            before any ``/v1/models``)
==========================  ==================================================================

The engines' context length (``max_model_len`` in vLLM's model list) is learned too: where
the config sets none and every engine that reports one agrees, :meth:`context_length` is that
value, and ``on_context`` is called whenever it changes (the gateway then routes a
``truncate_prompt_tokens`` of -1 on the ids the engine keeps).

An engine that answers ``/v1/models`` with 401, 403, 404 or 405, or with something other than
a model list, is not checked again until its address changes; one that cannot be reached is
tried again after 1, 2, 4, ... seconds (at most 60).

>>> check = EngineModelCheck(["base", "helper"], {"tenant-a": "base"})
>>> listing = {"data": [{"id": "base", "parent": None}, {"id": "helper", "parent": "base"}]}
>>> [(f.kind, f.name) for f in check.check("engine-0", frozenset(), listing)]
[('adapter_listed_as_model', 'helper')]
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from llmsched.gateway.wake import wait_woken
from llmsched.integrations import EngineSpec
from llmsched.integrations.metrics import read_capped

log = logging.getLogger(__name__)

FindingKind = Literal[
    "adapter_listed_as_model",
    "base_model_differs",
    "model_listed_as_adapter",
    "model_not_served",
    "max_model_len_differs",
    "model_not_configured",
]

_UNSUPPORTED = frozenset({401, 403, 404, 405})
_MAX_LISTING_BYTES = 4 << 20
_MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class ModelFinding:
    """One way an engine serves a model other than the config says.

    Attributes:
        kind: what is wrong (the module's table).
        engine: the engine's worker id.
        name: the model or adapter concerned (for ``model_not_served``, the names expected,
            comma-separated).
        detail: the warning's text: what the engine serves, what it costs, what to change.
    """

    kind: FindingKind
    engine: str
    name: str
    detail: str


@dataclass
class _Engine:
    spec: EngineSpec
    due: float = 0.0
    failures: int = 0
    findings: list[ModelFinding] = field(default_factory=list)
    # Found from the spec alone (model_not_configured), kept until the spec changes.
    configured: list[ModelFinding] = field(default_factory=list)
    served: dict[str, str | None] | None = None
    context: int | None = None


class EngineModelCheck:
    """Checks each engine's ``/v1/models`` against ``models`` and ``lora_adapters`` (the
    module's text). :meth:`set_engines` tells it the engines; :meth:`run` checks them until
    cancelled.

    Args:
        models: the config's ``models`` (base model names requests may send).
        lora_adapters: the config's ``lora_adapters`` (adapter name to base model name).
        timeout_s: the most one ``/v1/models`` request may take.
        recheck_s: seconds between two checks of an engine that answered.
        max_model_len: the config's ``max_model_len`` (None: learned from the engines).
        on_context: called with the engines' context length (None: unknown) when it changes.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        models: Iterable[str],
        lora_adapters: Mapping[str, str],
        *,
        timeout_s: float = 5.0,
        recheck_s: float = 300.0,
        max_model_len: int | None = None,
        on_context: Callable[[int | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._models = frozenset(models)
        self._adapters = dict(lora_adapters)
        self._timeout_s = timeout_s
        self._recheck_s = recheck_s
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._warned: set[tuple[FindingKind, str]] = set()
        self._wake: asyncio.Event | None = None
        self._configured_context = max_model_len
        self._on_context = on_context
        self._context = max_model_len

    def context_length(self) -> int | None:
        """The engines' context length: the config's ``max_model_len``, else the one every
        engine that reported one agrees on (None: none reported, or they differ).

        >>> EngineModelCheck(["m"], {}, max_model_len=4096).context_length()
        4096
        """
        return self._context

    def _context_changed(self) -> None:
        known = {e.context for e in self._engines.values() if e.context is not None}
        context = self._configured_context
        if context is None and len(known) == 1:
            context = known.pop()
        if context != self._context:
            self._context = context
            if self._on_context is not None:
                self._on_context(context)

    def set_engines(self, engines: Iterable[EngineSpec]) -> None:
        """The engines to check now: new ones and ones whose spec changed are checked at once,
        kept ones keep their findings, removed ones drop theirs."""
        specs = {spec.worker_id: spec for spec in engines}
        for worker in list(self._engines):
            if worker not in specs:
                del self._engines[worker]
        for worker, spec in specs.items():
            known = self._engines.get(worker)
            if known is None or known.spec != spec:
                engine = _Engine(spec, configured=self._spec_findings(worker, spec))
                self._engines[worker] = engine
                self._warn(engine.configured)
        self._context_changed()
        if self._wake is not None:
            self._wake.set()

    def findings(self) -> list[ModelFinding]:
        """Every problem the last check of each engine found, by engine.

        >>> check = EngineModelCheck(["m"], {})
        >>> check.findings()
        []
        """
        found = [
            f
            for worker in sorted(self._engines)
            for f in (*self._engines[worker].configured, *self._engines[worker].findings)
        ]
        return found + self._context_findings()

    def _spec_findings(self, worker: str, spec: EngineSpec) -> list[ModelFinding]:
        """``model_not_configured`` for an engine whose own model no request may name."""
        model = spec.model
        if model is None or model in self._models or model in self._adapters:
            return []
        known = ", ".join(sorted([*self._models, *self._adapters]))
        detail = (
            f"engine {worker} serves model {model!r}, which is none of the models requests may "
            f"name ({known}): no request is ever routed there; add {model!r} to models (or "
            "lora_adapters), or correct the engine's model"
        )
        return [ModelFinding("model_not_configured", worker, model, detail)]

    def _warn(self, findings: Iterable[ModelFinding]) -> None:
        """Logs each finding whose kind and name were not logged before."""
        for finding in findings:
            if (finding.kind, finding.name) not in self._warned:
                self._warned.add((finding.kind, finding.name))
                log.warning(
                    "%s (%s; further engines alike are only counted)", finding.detail, finding.kind
                )

    def _context_findings(self) -> list[ModelFinding]:
        """Engines whose context length is not the config's, or (without one) not the one
        most engines report (the smallest among the most common)."""
        reported = {w: e.context for w, e in self._engines.items() if e.context is not None}
        reference = self._configured_context
        where = "the config's max_model_len"
        if reference is None:
            if len(set(reported.values())) < 2:
                return []
            counts = Counter(reported.values())
            reference = min(counts, key=lambda n: (-counts[n], n))
            where = "the other engines'"
        return [
            ModelFinding(
                "max_model_len_differs",
                worker,
                str(context),
                f"engine {worker} serves max_model_len {context}, not {where} {reference}: a "
                "truncate_prompt_tokens of -1 keeps another prompt there than the gateway "
                "routes on; give the engines one --max-model-len (or set max_model_len)",
            )
            for worker, context in sorted(reported.items())
            if context != reference
        ]

    def served(self, engine: str) -> dict[str, str | None] | None:
        """What ``engine`` listed at its last check: each model's name and, for an adapter,
        its base model (None before it answered, or when it is not known).

        >>> EngineModelCheck(["m"], {}).served("engine-0") is None
        True
        """
        known = self._engines.get(engine)
        return None if known is None or known.served is None else dict(known.served)

    def check(self, engine: str, expected: frozenset[str], listing: object) -> list[ModelFinding]:
        """The problems in one engine's ``/v1/models`` answer ``listing`` (decoded JSON);
        ``expected``: the names requests may send it (empty: not checked). Raises ValueError
        when ``listing`` is not an OpenAI model list."""
        return self._findings(engine, expected, _served(listing))

    def _findings(
        self, engine: str, expected: frozenset[str], served: dict[str, str | None]
    ) -> list[ModelFinding]:
        found = [
            f for name, parent in sorted(served.items()) for f in self._card(engine, name, parent)
        ]
        if expected and expected.isdisjoint(served):
            names = ", ".join(sorted(expected))
            found.append(
                ModelFinding(
                    "model_not_served",
                    engine,
                    names,
                    f"engine {engine} serves {sorted(served)} and none of {names}, the models "
                    "requests may send it: it refuses every request routed there; check its "
                    "served model name",
                )
            )
        return found

    def _card(self, engine: str, name: str, parent: str | None) -> list[ModelFinding]:
        if parent is not None and name in self._models:
            detail = (
                f"engine {engine} serves {name!r} as a LoRA adapter of {parent!r}, but the "
                "config lists it under models: its requests are hashed as a base model's, so "
                "they never match the cache the engine reports for them, and the LoRA filters "
                f"and scorers never see it; list it under lora_adapters ({name}: {parent})"
            )
            return [ModelFinding("adapter_listed_as_model", engine, name, detail)]
        configured = self._adapters.get(name)
        if parent is not None and configured is not None and configured != parent:
            detail = (
                f"engine {engine} serves LoRA adapter {name!r} on base model {parent!r}, but "
                f"lora_adapters names {configured!r}"
            )
            return [ModelFinding("base_model_differs", engine, name, detail)]
        if parent is None and configured is not None:
            detail = (
                f"engine {engine} serves {name!r} as a base model, but the config lists it "
                "under lora_adapters: its requests are hashed as an adapter's, so they never "
                "match the cache the engine reports for them; list it under models"
            )
            return [ModelFinding("model_listed_as_adapter", engine, name, detail)]
        return []

    async def run(self) -> None:
        """Checks the engines that are due until cancelled (one ``/v1/models`` request each,
        concurrently)."""
        self._wake = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                now = self._clock()
                due = [(w, e) for w, e in self._engines.items() if e.due <= now]
                if due:
                    checks = (self._check_one(session, w, e) for w, e in due)
                    for outcome in await asyncio.gather(*checks, return_exceptions=True):
                        if isinstance(outcome, Exception):  # never ends the checks
                            log.warning("models check failed: %r", outcome)
                    continue
                wait = min((e.due for e in self._engines.values()), default=math.inf) - now
                self._wake.clear()
                await wait_woken(self._wake, min(wait, 3600.0))

    def _retry_later(self, engine: _Engine) -> None:
        """An engine that could not be asked: again after 1, 2, 4 ... 60 s."""
        engine.failures += 1
        engine.due = self._clock() + min(2.0 ** (engine.failures - 1), _MAX_BACKOFF_S)

    async def _check_one(
        self, session: aiohttp.ClientSession, worker: str, engine: _Engine
    ) -> None:
        engine.due = math.inf  # while in flight
        url = engine.spec.base_url + "/v1/models"
        try:
            async with session.get(url) as response:
                status = response.status
                body = await read_capped(response, _MAX_LISTING_BYTES) if status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._retry_later(engine)
            log.debug("models check of %s: %s (tried %d times)", worker, exc, engine.failures)
            return
        if self._engines.get(worker) is not engine:
            return  # removed or changed meanwhile
        if status in _UNSUPPORTED:
            log.debug("models check of %s: /v1/models answered %d, not checked", worker, status)
            return
        if status != 200:
            self._retry_later(engine)
            return
        expected = frozenset([engine.spec.model]) if engine.spec.model else self._models
        try:
            if body is None:
                raise ValueError(f"the listing is over {_MAX_LISTING_BYTES} bytes")
            listing = json.loads(body)
            served = _served(listing)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            log.debug("models check of %s: %s, not checked", worker, exc)
            return
        engine.findings = self._findings(worker, expected, served)
        engine.served = served
        engine.context = _context_length(listing, expected)
        self._context_changed()
        engine.failures = 0
        engine.due = self._clock() + self._recheck_s
        self._warn(engine.findings + self._context_findings())


def _served(listing: object) -> dict[str, str | None]:
    """Each model of an OpenAI model list and its ``parent`` (None: a base model); ValueError
    when ``listing`` is not one."""
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        raise ValueError("not an OpenAI model list (no 'data' list)")
    served: dict[str, str | None] = {}
    for card in cards:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            parent = card.get("parent")
            served[card["id"]] = parent if isinstance(parent, str) and parent else None
    return served


def _context_length(listing: object, expected: frozenset[str]) -> int | None:
    """The ``max_model_len`` of the base model a request may send (the first base model
    where none of those is listed); None when the list gives none."""
    cards = listing.get("data") if isinstance(listing, dict) else None
    bases = [
        card
        for card in cards or ()
        if isinstance(card, dict) and isinstance(card.get("id"), str) and not card.get("parent")
    ]
    chosen = [card for card in bases if card["id"] in expected] or bases[:1]
    value = chosen[0].get("max_model_len") if chosen else None
    # As the config takes it (an int below 2^31: a larger one is no context length).
    return value if type(value) is int and 0 < value < 2**31 else None
