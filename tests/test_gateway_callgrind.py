"""The gateway instruction counter (tools/gateway_callgrind.py): reading a callgrind dump's
total. The counting itself needs valgrind and runs by hand."""

from __future__ import annotations

import pytest

tool = pytest.importorskip("tools.gateway_callgrind")


def test_the_total_is_the_summary_line() -> None:
    dump = "\n".join(
        [
            "# callgrind format",
            "version: 1",
            "cmd: llmsched-gateway --router round-robin",
            "events: Ir",
            "fl=(1) lib.rs",
            "fn=(1) poll_frame",
            "12 400",
            "summary: 8812345",
            "",
        ]
    )
    assert tool.instructions(dump) == 8812345


def test_a_dump_without_a_total_is_an_error() -> None:
    with pytest.raises(ValueError, match="no summary"):
        tool.instructions("events: Ir\nfn=(1) f\n1 2\n")
