"""Engines of role ``prefill`` under a router config that reads no role are noted: such a
config (``llm-d``, ``round-robin``, ...) sends them whole requests, decode included, like any
engine, which was said nowhere. The note is logged once while it holds, listed in
``Scheduler.warnings`` and counted in ``stats()["config_warnings"]`` (and so in the gateway's
``llmsched_gateway_config_warnings``, both planes building a Scheduler)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from llmsched import Endpoint, EndpointPool, Router
from llmsched.scheduler import Scheduler


def _role_notes(scheduler: Scheduler) -> list[str]:
    return [w for w in scheduler.warnings if "role prefill" in w]


def test_prefill_engines_under_a_config_reading_no_role_are_noted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="llmsched")
    engines = [Endpoint("p", role="prefill"), Endpoint("d", role="decode")]
    scheduler = Scheduler(engines, router="llm-d", block_size=16)
    (note,) = _role_notes(scheduler)
    assert "'p'" in note and "'d'" not in note and "whole requests" in note
    assert scheduler.stats()["config_warnings"] == len(scheduler.warnings) == 1
    # Another prefill engine changes the note, and logs nothing more.
    scheduler.add_engine(Endpoint("p2", role="prefill"))
    (note,) = _role_notes(scheduler)
    assert note.startswith("2 engine(s) of role prefill ('p', 'p2')")
    logged = [r for r in caplog.records if "role prefill" in r.getMessage()]
    assert len(logged) == 1
    # Without prefill engines the note goes.
    scheduler.set_engines([Endpoint("d", role="decode")])
    assert _role_notes(scheduler) == [] and scheduler.stats()["config_warnings"] == 0


@pytest.mark.parametrize(
    ("router", "engines"),
    [
        ("llm-d-pd", [Endpoint("p", role="prefill"), Endpoint("d", role="decode")]),
        ("llm-d", [Endpoint("d", role="decode"), Endpoint("b", role="both"), Endpoint("n")]),
    ],
    ids=["p-d-config", "no-prefill-engine"],
)
def test_no_note_where_roles_are_read_or_no_engine_is_prefill_only(
    router: str, engines: list[Endpoint]
) -> None:
    assert _role_notes(Scheduler(engines, router=router, block_size=16)) == []


def _one_filter(plugin: dict[str, Any]) -> dict[str, Any]:
    return {
        "plugins": [{**plugin, "name": "f"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "f"}, {"pluginRef": "max-score-picker"}]}
        ],
    }


@pytest.mark.parametrize(
    ("config", "reads"),
    [
        ("llm-d", False),
        ("round-robin", False),
        ("prefix-only", False),
        ("llm-d-pd", True),
        (_one_filter({"type": "decode-filter"}), True),
        (_one_filter({"type": "by-label", "parameters": {"label": "llm-d.ai/role"}}), True),
        (_one_filter({"type": "python-filter", "parameters": {"function": lambda r, e: []}}), True),
        (_one_filter({"type": "low-queue-filter"}), False),
    ],
)
def test_router_reads_roles(config: Any, reads: bool) -> None:
    assert Router(EndpointPool(["a"]), config=config).reads_roles is reads
