"""The gateway syscall counter (tools/gateway_syscalls.py): reading ``perf stat -x ,`` output
into counts per request. The counting itself needs perf and runs by hand."""

from __future__ import annotations

import pytest

tool = pytest.importorskip("tools.gateway_syscalls")


def test_counts_are_divided_by_the_requests_and_named_by_syscall() -> None:
    text = "\n".join(
        [
            "11000,,raw_syscalls:sys_enter,4000000,100.00,,",
            "4000,,syscalls:sys_enter_recvfrom,4000000,100.00,,",
            "2100,,context-switches,4000000,100.00,,",
            "<not counted>,,syscalls:sys_enter_futex,0,0.00,,",
            "<not supported>,,net:net_dev_xmit,0,0.00,,",
            "# started on Wed Dec  2",
            "",
        ]
    )
    counts = tool.per_request(text, 2000)
    assert counts == {
        "raw_syscalls:sys_enter": 5.5,
        "recvfrom": 2.0,
        "context-switches": 1.05,
    }


def test_no_requests_does_not_divide_by_zero() -> None:
    assert tool.per_request("7,,syscalls:sys_enter_close,1,100.00,,", 0) == {"close": 7.0}


def test_labels() -> None:
    assert [
        tool.label(e) for e in ("raw_syscalls:sys_enter", "net:net_dev_xmit", "epoll_wait")
    ] == [
        "syscalls",
        "net_dev_xmit",
        "epoll_wait",
    ]
