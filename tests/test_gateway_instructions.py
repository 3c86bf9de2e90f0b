"""The gateway instruction counter (tools/gateway_instructions.py): reading ``perf stat`` and
callgrind output into counts per request. The counting itself needs perf or valgrind and runs
by hand."""

from __future__ import annotations

import pytest

tool = pytest.importorskip("tools.gateway_instructions")

DUMP = """# callgrind format
version: 1
events: Ir
summary: 1200

ob=(1) /bin/gateway
fl=(1) ???
fn=(10) llmsched_gateway::Gateway::handle::{{closure}}
0 300
cfn=(11) <hyper::proto::h1::role::Server as hyper::proto::h1::Http1Transaction>::parse
calls=2 0
0 500
fn=(11)
0 500
cob=(2) /lib/libc.so.6
cfn=(12) _int_malloc
calls=1 0
0 400
fn=(12)
0 400
"""


def test_perf_totals_keep_the_counted_events_by_name() -> None:
    text = "\n".join(
        [
            "123456,,instructions:u,4000000,100.00,,",
            "<not supported>,,cycles:u,0,100.00,,",
            "# started on Sun Dec  6",
            "",
        ]
    )
    assert tool.perf_totals(text) == {"instructions": 123456}


def test_the_callgrind_total_is_the_summary_line() -> None:
    assert tool.callgrind_total(DUMP) == 1200
    with pytest.raises(ValueError):
        tool.callgrind_total("events: Ir\n")


def test_fold_counts_own_instructions_by_crate_not_calls() -> None:
    # A call's line is the callee's inclusive cost: counted once, at the callee.
    assert tool.fold(DUMP, 100) == [
        ("hyper", 5.0),
        ("malloc", 4.0),
        ("llmsched_gateway", 3.0),
    ]


def test_crates_of_functions() -> None:
    assert [
        tool.crate_of(name)
        for name in (
            "tokio::runtime::task::harness::Harness<T,S>::poll",
            "<&str as core::fmt::Display>::fmt",
            "free",
            "__memcpy_avx_unaligned_erms",
            "clock_gettime@@GLIBC_2.17",
        )
    ] == ["tokio", "core", "malloc", "memcpy", "clock_gettime"]
