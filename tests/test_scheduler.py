"""The public request pipeline (llmsched.Scheduler): admission, the pick and its ticket,
retries through the fallbacks, failure / cancel accounting, engines kept in step across the
pool, the flow controller and the index, bad input, and many concurrent requests."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmsched import Placement, Scheduler, ScheduleRequest
from llmsched.errors import (
    ConfigError,
    FlowRejected,
    InvalidRequestError,
    InvalidTokenError,
    InvalidTypeError,
    InvalidValueError,
    NoEndpointError,
    PlacementError,
    UnknownEndpointError,
)
from llmsched.flow import FlowRequest, Outcome
from llmsched.routing import render_messages

CONCURRENCY_1 = {"saturation": {"type": "concurrency", "max_requests": 1}}
PROMPT = np.arange(64, dtype=np.uint32)  # 4 blocks of 16


def in_flight(s: Scheduler) -> dict[object, int]:
    return {e["id"]: e["in_flight_requests"] for e in s.pool.endpoints()}


def at_rest(s: Scheduler) -> None:
    """Nothing is held anywhere: placements, pool tickets, flow slots and queue."""
    assert s.stats()["in_flight"] == 0
    assert all(n == 0 for n in in_flight(s).values()), in_flight(s)
    assert all(e["in_flight_prefill_tokens"] == 0 for e in s.pool.endpoints())
    if s.flow is not None:
        assert s.flow.running_count() == 0
        assert len(s.flow) == 0


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_admission_follows_priority_and_carries_the_tenant() -> None:
    s = Scheduler(["a"], router="least-load", flow=CONCURRENCY_1)
    order: list[str] = []

    async def client(
        name: str, priority: int, tenant: str, gate: Callable[[], Awaitable[object]]
    ) -> None:
        request = ScheduleRequest(tokens=PROMPT, priority=priority, tenant=tenant)
        async with s.schedule(request) as placement:
            assert placement.admission is not None and placement.admission.holds_slot
            order.append(name)
            await gate()

    async def run() -> None:
        release = asyncio.Event()
        first = asyncio.create_task(client("first", 0, "t0", release.wait))
        await until(lambda: order == ["first"], "the first request to run")
        low = asyncio.create_task(client("low", 1, "batch", lambda: asyncio.sleep(0)))
        await until(lambda: s.stats()["queued"] == 1, "the low-priority request to queue")
        high = asyncio.create_task(client("high", 5, "chat", lambda: asyncio.sleep(0)))
        await until(lambda: s.stats()["queued"] == 2, "both requests to queue")
        tenants = {(f["tenant"], f["priority"]) for f in s.flow.metrics()["flows"]}  # type: ignore[union-attr]
        assert {("batch", 1), ("chat", 5), ("t0", 0)} <= tenants
        release.set()
        await asyncio.gather(first, low, high)

    asyncio.run(run())
    assert order == ["first", "high", "low"]
    assert s.stats()["admitted"] == 3 and s.stats()["completed"] == 3
    at_rest(s)


def test_pick_puts_the_ticket_in_flight_and_the_exit_gives_it_back() -> None:
    s = Scheduler(["a", "b"], router="least-load")
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as placement:
        chosen = placement.endpoint
        assert in_flight(s)[chosen] == 1 and sum(in_flight(s).values()) == 1
        assert placement.address == ""  # bare ids have no address
        assert placement.first_token() and not placement.first_token()
        placement.add_output_tokens(7)
        assert s.stats()["in_flight"] == 1
    assert placement.outcome == "completed" and placement.output_tokens == 7
    assert not placement.complete()  # ending twice is a no-op
    assert s.stats()["completed"] == 1
    at_rest(s)


def test_flow_slot_is_released_with_the_output_tokens_charged() -> None:
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 4}})

    async def run() -> None:
        async with s.schedule(ScheduleRequest(tokens=PROMPT, tenant="acme")) as placement:
            assert s.flow is not None and s.flow.running_count() == 1
            placement.add_output_tokens(30)

    asyncio.run(run())
    assert s.flow is not None
    flows = {f["tenant"]: f for f in s.flow.metrics()["flows"]}
    assert flows["acme"]["service_tokens"] >= 30 + len(PROMPT)
    at_rest(s)


def test_retry_walks_the_fallbacks_and_each_attempt_accounts_for_itself() -> None:
    s = Scheduler(["a", "b", "c"], router="least-load")
    tried = []
    with pytest.raises(NoEndpointError), s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        tried.append(p.endpoint)
        assert len(p.fallbacks) == 2
        while True:
            before = p.endpoint
            now = p.retry()
            tried.append(now)
            assert in_flight(s)[before] == 0 and in_flight(s)[now] == 1
            assert p.attempts == len(tried)
    assert sorted(tried) == ["a", "b", "c"]
    assert p.outcome == "failed"
    assert s.stats()["retries"] == 3 and s.stats()["failed"] == 1
    with pytest.raises(PlacementError):
        p.retry()
    at_rest(s)


def test_retry_skips_a_fallback_that_left_the_pool() -> None:
    s = Scheduler(["a", "b", "c"], router="least-load")
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        first, skipped, last = p.endpoint, *p.fallbacks
        s.drain(skipped)
        assert p.retry() == last
        assert in_flight(s)[last] == 1
    assert first != last
    at_rest(s)


def test_retry_skips_a_fallback_removed_from_the_scheduler() -> None:
    s = Scheduler(["a", "b", "c"], router="least-load")
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        first, skipped, last = p.endpoint, *p.fallbacks
        s.remove_engine(skipped)
        assert p.retry() == last
        assert in_flight(s)[last] == 1
    assert first != last
    at_rest(s)


def test_a_retry_does_not_take_the_next_requests_round_robin_turn() -> None:
    """Probe 82: each retry made a new pick, which moved the round-robin cursor once more,
    so with one engine failing every request it got almost every first attempt. A retry
    starts the first pick again on its fallback: the turns go on as if it never failed."""
    s = Scheduler(["a", "b", "c"], router="round-robin")
    firsts = []
    for i in range(9):
        with s.schedule_sync(ScheduleRequest(tokens=[i, *PROMPT])) as p:
            firsts.append(p.endpoint)
            while p.endpoint == "a":  # "a" fails every request sent to it
                p.retry()
    assert firsts.count("a") == 3
    assert s.stats()["retries"] == 3
    at_rest(s)


def test_failure_removes_the_approximate_record_and_success_keeps_it() -> None:
    s = Scheduler(["a"], router="prefix-only", block_size=16)
    with pytest.raises(RuntimeError), s.schedule_sync(ScheduleRequest(tokens=PROMPT)):
        assert s.index.match_tokens(PROMPT).as_dict() == {"a": 4}
        raise RuntimeError("the engine broke")
    assert s.index.match_tokens(PROMPT).as_dict() == {}
    assert s.stats()["records_removed"] == 4 and s.stats()["failed"] == 1
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)):
        pass
    assert s.index.match_tokens(PROMPT).as_dict() == {"a": 4}
    at_rest(s)


def test_failure_keeps_what_the_engine_confirmed_and_what_was_held_before() -> None:
    s = Scheduler(["a"], router="prefix-only", block_size=16)
    hashes = s.index.hash_tokens(PROMPT)
    s.index.store("a", hashes[:1])  # confirmed by an engine
    s.index.record("a", hashes[:2])  # recorded by an earlier request
    with pytest.raises(ValueError), s.schedule_sync(ScheduleRequest(tokens=PROMPT)):
        raise ValueError("failed")
    assert s.index.match_tokens(PROMPT).as_dict() == {"a": 2}
    assert s.stats()["records_removed"] == 2


def test_text_and_chat_failures_remove_their_records_too() -> None:
    s = Scheduler(["a"], router="prefix-only", block_size=4, allow_pseudo_tokens=True)
    text = "You are a helpful assistant. " * 4
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    for request in (ScheduleRequest(text=text), ScheduleRequest(messages=messages)):
        with pytest.raises(OSError), s.schedule_sync(request):
            assert s.index.stats()["blocks"] > 0
            raise OSError("gone")
        assert s.index.stats()["blocks"] == 0
    at_rest(s)


def test_a_retry_drops_the_failed_endpoints_record() -> None:
    s = Scheduler(["a", "b"], router="least-load", block_size=16)
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        first = p.endpoint
        second = p.retry()
    matched = s.index.match_tokens(PROMPT).as_dict()
    assert matched == {second: 4} and first not in matched


def test_cancellation_gives_everything_back_and_keeps_the_record() -> None:
    s = Scheduler(["a"], router="prefix-only", flow=CONCURRENCY_1, block_size=16)
    entered = asyncio.Event()
    seen: list[Placement] = []

    async def client() -> None:
        async with s.schedule(ScheduleRequest(tokens=PROMPT)) as p:
            seen.append(p)
            entered.set()
            await asyncio.sleep(3600)

    async def queued_client() -> None:
        async with s.schedule(ScheduleRequest(tokens=PROMPT)):
            raise AssertionError("never admitted")

    async def run() -> None:
        running = asyncio.create_task(client())
        await entered.wait()
        waiting = asyncio.create_task(queued_client())
        await until(lambda: s.stats()["queued"] == 1, "the second request to queue")
        waiting.cancel()
        running.cancel()
        for task in (running, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert seen[0].outcome == "cancelled"
    assert s.stats()["cancelled"] == 1 and s.stats()["admitted"] == 1
    assert s.index.match_tokens(PROMPT).as_dict() == {"a": 4}
    at_rest(s)


def test_flow_rejection_is_typed_with_status_reason_and_retry_after() -> None:
    flow = {
        "saturation": {"type": "concurrency", "max_requests": 1},
        "default_band": {"max_requests": 1},
    }
    s = Scheduler(["a"], flow=flow, retry_after_s=3)

    async def run() -> FlowRejected:
        release = asyncio.Event()

        async def hold() -> None:
            async with s.schedule(ScheduleRequest(tokens=PROMPT)):
                await release.wait()

        async def queued() -> None:
            async with s.schedule(ScheduleRequest(tokens=PROMPT)):
                pass

        holder = asyncio.create_task(hold())
        await until(lambda: s.flow is not None and s.flow.running_count() == 1, "admission")
        waiter = asyncio.create_task(queued())
        await until(lambda: s.stats()["queued"] == 1, "the queue")
        try:
            async with s.schedule(ScheduleRequest(tokens=PROMPT)):
                raise AssertionError("admitted past capacity")
        except FlowRejected as exc:
            rejected = exc
        release.set()
        await asyncio.gather(holder, waiter)
        return rejected

    rejected = asyncio.run(run())
    assert rejected.outcome == Outcome.REJECTED_CAPACITY
    assert (rejected.http_status, rejected.retry_after_s) == (429, 3)
    assert rejected.reason == Outcome.REJECTED_CAPACITY.reason
    assert s.stats()["rejected"] == 1 and s.stats()["completed"] == 2
    at_rest(s)


def test_no_endpoint_releases_the_admission() -> None:
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 4}})
    s.drain("a")

    async def run() -> None:
        async with s.schedule(ScheduleRequest(tokens=PROMPT)):
            raise AssertionError("placed with no endpoint")

    with pytest.raises(NoEndpointError):
        asyncio.run(run())
    assert s.stats()["no_endpoint"] == 1 and s.stats()["admitted"] == 1
    at_rest(s)


def test_engines_stay_in_step_across_pool_flow_and_index() -> None:
    s = Scheduler(["a"], router="prefix-only", flow=CONCURRENCY_1, block_size=16)
    assert s.add_engine("b") == "b"
    assert sorted(str(e["id"]) for e in s.pool.endpoints()) == ["a", "b"]
    s.drain("a")
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        assert p.endpoint == "b"
    assert s.index.match_tokens(PROMPT).as_dict() == {"b": 4}
    assert s.flow is not None
    s.flow.update_endpoint("b", waiting=1)
    s.remove_engine("b")
    assert [e["id"] for e in s.pool.endpoints()] == []  # a is drained, b gone
    assert "b" not in s.index.workers() and s.index.match_tokens(PROMPT).as_dict() == {}
    assert not s.flow.remove_endpoint("b")  # already forgotten by the flow controller
    assert s.resume("a") and list(s.engines) == ["a"]
    added, removed, changed = s.set_engines(["a", "c", "d"])
    assert (added, removed, changed) == (["c", "d"], [], [])
    assert s.set_engines(["d"]) == ([], ["a", "c"], [])
    assert [e["id"] for e in s.pool.endpoints()] == ["d"] and s.stats()["engines"] == 1


def test_bad_engine_changes_raise_and_change_nothing() -> None:
    s = Scheduler(["a", "b"])
    before = (s.pool.endpoints(), s.engines, s.draining)
    with pytest.raises(ConfigError, match="already scheduled"):
        s.add_engine("a")
    with pytest.raises(ConfigError, match="listed twice"):
        s.set_engines(["a", "c", "c"])
    with pytest.raises(ConfigError, match="EngineSpec, an Endpoint or an id"):
        s.add_engine(3.5)  # type: ignore[arg-type]
    for call in (s.remove_engine, s.drain, s.resume, s.address_of):
        with pytest.raises(UnknownEndpointError):
            call("zz")
    assert (s.pool.endpoints(), s.engines, s.draining) == before
    with pytest.raises(ConfigError, match="listed twice"):
        Scheduler(["a", "a"])
    with pytest.raises(ConfigError, match="unknown key"):
        Scheduler.from_config({"engines": ["a"], "routr": "llm-d"})
    with pytest.raises(ConfigError, match="block_size"):
        Scheduler(["a"], block_size=8, index=s.index)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, InvalidRequestError, "exactly one"),
        ({"tokens": [1], "text": "x"}, InvalidRequestError, "exactly one"),
        ({"tokens": [-1]}, InvalidTokenError, "out of range"),
        ({"tokens": "abc"}, InvalidRequestError, "str"),
        ({"text": b"x"}, InvalidRequestError, "text"),
        ({"messages": [{"content": "x"}]}, InvalidRequestError, "role"),
        ({"tokens": [1], "priority": 2**31}, InvalidRequestError, "priority"),
        ({"tokens": [1], "priority": True}, InvalidRequestError, "priority"),
        ({"tokens": [1], "tenant": ""}, InvalidRequestError, "tenant"),
        ({"tokens": [1], "prompt_tokens": -1}, InvalidRequestError, "prompt_tokens"),
        ({"tokens": [1], "model": 3}, InvalidRequestError, "model"),
        ({"tokens": [1], "headers": {"a": 1}}, InvalidRequestError, "headers"),
        ({"tokens": [1], "deadline": float("nan")}, InvalidRequestError, "deadline"),
        # Probe 62: a bare ValueError (an int of thousands of digits has no str).
        ({"tokens": [1, 10**5000]}, InvalidTokenError, "an int of 16610 bits at position 1"),
    ],
)
def test_bad_requests_raise_llmsched_errors(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ScheduleRequest(**kwargs)  # type: ignore[arg-type]


def test_bad_use_raises_and_leaves_state_unchanged() -> None:
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    with pytest.raises(InvalidRequestError), s.schedule_sync({"tokens": [1]}):  # type: ignore[arg-type]
        pass
    with pytest.raises(InvalidRequestError):
        s.place("not a request")  # type: ignore[arg-type]
    assert s.stats()["admitted"] == 0
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        with pytest.raises(InvalidValueError):
            p.complete(output_tokens=-1)
        with pytest.raises(InvalidValueError):
            p.add_output_tokens(-2)
        assert p.outcome is None and s.stats()["in_flight"] == 1
    assert p.outcome == "completed"
    at_rest(s)


def test_place_leaves_the_admission_to_its_caller() -> None:
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    request = ScheduleRequest(tokens=PROMPT)
    admission = s.admit_sync(request)
    with s.place(request, admission) as p:
        assert p.admission is admission
    assert admission.holds_slot and s.flow is not None and s.flow.running_count() == 1
    assert admission.release(5) and not admission.release()
    at_rest(s)


def _output_by_tenant(s: Scheduler) -> dict[str, int]:
    """Output tokens flow control charged per tenant since the last call."""
    assert s.flow is not None
    charged: dict[str, int] = {}
    for tenant, _, _, output in s.flow.drain_service():
        charged[tenant] = charged.get(tenant, 0) + output
    return charged


def test_a_stale_admission_leaves_the_request_admitted_again_under_its_id_alone() -> None:
    """Probe 62: an Admission released and charged by request id. Once its request was
    revoked through ``scheduler.flow`` (a preemption victim completed by id, as
    ``preemption_victims`` says to) and the id admitted again there, the old admission's
    ``record_output`` charged the new request's tenant and its ``release`` completed the new
    request while it still ran."""
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 4}})
    assert s.flow is not None
    old = s.admit_sync(ScheduleRequest(tokens=PROMPT, tenant="old"))
    s.flow.complete(old.id)  # revoked
    # Revoked and not admitted again: nothing to charge or give back, and no error.
    old.record_output(3)
    assert _output_by_tenant(s) == {"old": 0}
    again = asyncio.run(s.flow.admit(FlowRequest(old.id, tenant="new", prompt_tokens=1)))
    assert again.ticket is not None and s.flow.is_running(old.id)
    _output_by_tenant(s)
    old.record_output(50)
    assert _output_by_tenant(s) == {}, "the stale admission charged the new request"
    assert old.release(7)  # it held a slot (revoked meanwhile): given up, changing nothing
    assert s.flow.is_running(old.id) and s.flow.running_count() == 1
    assert _output_by_tenant(s) == {}
    assert not old.release() and old.record_output(1) is None
    s.flow.record_output(old.id, 2, ticket=again.ticket)
    s.flow.complete(old.id, 3, ticket=again.ticket)
    assert _output_by_tenant(s) == {"new": 5}
    at_rest(s)


def test_output_counts_are_checked_alike_everywhere() -> None:
    """Probe 62: Placement refused a numpy integer and called a str an InvalidValueError,
    where Admission took the one and called the other an InvalidTypeError; Admission's
    record_output checked nothing without flow control or once released, and place() kept
    an admission that was not one."""
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    request = ScheduleRequest(tokens=PROMPT)
    with pytest.raises(InvalidRequestError, match="admission must be an Admission"):
        s.place(request, "not an admission")  # type: ignore[arg-type]
    assert s.stats()["in_flight"] == 0
    with s.schedule_sync(request) as p:
        for bad in ("3", 1.5, True, None):
            with pytest.raises(InvalidTypeError, match="tokens must be an int"):
                p.add_output_tokens(bad)  # type: ignore[arg-type]
            if bad is not None:  # complete(None) charges the tokens counted
                with pytest.raises(InvalidTypeError, match="output_tokens must be an int"):
                    p.complete(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError, match="tokens must be in"):
            p.add_output_tokens(-1)
        p.add_output_tokens(np.int64(4))  # type: ignore[arg-type]
        assert p.output_tokens == 4 and p.outcome is None
        assert p.complete(np.uint32(6))  # type: ignore[arg-type]
    assert p.output_tokens == 6
    at_rest(s)
    for admission in (Scheduler(["a"]).admit_sync(request), s.admit_sync(request)):
        for bad, error in (("x", InvalidTypeError), (-1, InvalidValueError)):
            with pytest.raises(error, match="output_tokens"):
                admission.record_output(bad)  # type: ignore[arg-type]
        admission.release()
        with pytest.raises(InvalidValueError, match="output_tokens"):
            admission.record_output(2**63)
    at_rest(s)


def test_stale_admissions_on_many_threads_charge_and_release_only_their_own() -> None:
    """Probe 62: threads revoke their admissions' requests through ``scheduler.flow`` and
    admit the ids again, then race the stale admission's record_output and release against
    the new request's own; the oracle: every new request runs until its owner completes it,
    and the output charged is exactly what the owners charged."""
    s = Scheduler(["a", "b"], flow={"saturation": {"type": "concurrency", "max_requests": 64}})
    assert s.flow is not None
    flow = s.flow
    threads_n, rounds = 4, 25
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for _ in range(rounds):
                old = s.admit_sync(ScheduleRequest(tokens=PROMPT, tenant="old"))
                flow.complete(old.id)  # revoked
                again = asyncio.run(flow.admit(FlowRequest(old.id, tenant="new")))
                stale = [
                    threading.Thread(target=old.record_output, args=(100,)),
                    threading.Thread(target=old.release, args=(1000,)),
                ]
                for thread in stale:
                    thread.start()
                flow.record_output(old.id, 2, ticket=again.ticket)
                for thread in stale:
                    thread.join(timeout=10)
                assert flow.is_running(old.id), "a stale release ended the new request"
                flow.complete(old.id, 3, ticket=again.ticket)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    assert _output_by_tenant(s) == {"old": 0, "new": 5 * threads_n * rounds}
    at_rest(s)


def test_the_utilization_detector_without_metrics_warns() -> None:
    s = Scheduler(["a"], flow={})
    assert any("saturation by utilization" in w for w in s.warnings)
    assert s.stats()["config_warnings"] >= 1


def test_from_config_builds_the_same_pipeline() -> None:
    s = Scheduler.from_config(
        "engines: [a, b]\nrouter: least-load\nblock_size: 8\n"
        "flow: {saturation: {type: concurrency, max_requests: 3}}\nretry_after_s: 2\n"
    )
    assert sorted(s.engines) == ["a", "b"] and s.index.block_size == 8
    assert s.flow is not None and s.flow.config["saturation"]["type"] == "concurrency"
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        assert p.endpoint in ("a", "b")
    at_rest(s)


def test_many_concurrent_requests_with_cancellations_return_to_zero() -> None:
    engines = [f"e{i}" for i in range(4)]
    s = Scheduler(
        engines,
        router="llm-d",
        flow={"saturation": {"type": "concurrency", "max_requests": 8}},
        block_size=16,
    )
    rng = random.Random(7)
    outcomes: dict[str, int] = {"ok": 0, "failed": 0, "retried": 0, "cancelled": 0}

    async def client(i: int) -> None:
        tokens = np.arange(64, dtype=np.uint32) + 1000 * (i % 5)
        request = ScheduleRequest(tokens=tokens, tenant=f"t{i % 3}", priority=i % 2)
        try:
            async with s.schedule(request) as p:
                await asyncio.sleep(rng.random() * 0.003)
                if i % 7 == 0:
                    p.retry()
                    outcomes["retried"] += 1
                if i % 11 == 0:
                    raise RuntimeError("engine failed")
                p.first_token()
            outcomes["ok"] += 1
        except RuntimeError:
            outcomes["failed"] += 1

    async def run() -> None:
        tasks = [asyncio.create_task(client(i)) for i in range(400)]
        for _ in range(60):
            await asyncio.sleep(0.001)
            victim = tasks[rng.randrange(len(tasks))]
            victim.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)

    asyncio.run(run())
    stats = s.stats()
    assert outcomes["ok"] + outcomes["failed"] + outcomes["cancelled"] == 400
    assert min(outcomes.values()) > 0, outcomes  # every path was taken
    assert stats["completed"] == outcomes["ok"] and stats["failed"] == outcomes["failed"]
    assert stats["cancelled"] <= outcomes["cancelled"]  # some were cancelled while queued
    assert stats["admitted"] == stats["completed"] + stats["failed"] + stats["cancelled"]
    assert stats["retries"] == outcomes["retried"]
    at_rest(s)


def test_threads_share_one_scheduler_with_the_sync_form() -> None:
    s = Scheduler(["a", "b", "c"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    errors: list[BaseException] = []
    peak = [0]

    def worker(t: int) -> None:
        try:
            for i in range(25):
                request = ScheduleRequest(tokens=PROMPT + t * 100 + i, tenant=f"t{t}")
                with s.schedule_sync(request):
                    assert s.flow is not None
                    peak[0] = max(peak[0], s.flow.running_count())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert s.stats()["completed"] == 100 and peak[0] <= 2
    at_rest(s)


def _kv_spec(publisher: object, port: int) -> object:
    from llmsched.integrations import EngineSpec

    return EngineSpec("127.0.0.1", port, **publisher.spec_kwargs())  # type: ignore[attr-defined]


def test_feeds_follow_engine_changes_while_started() -> None:
    pytest.importorskip("zmq")
    from llmsched.testing import FakeKVPublisher, event_batch, stored_event

    blocks = [stored_event([1, 2, 3, 4], None, list(range(64)))]
    with FakeKVPublisher() as first, FakeKVPublisher() as second:
        s = Scheduler([_kv_spec(first, 1)], router="prefix-only", block_size=16)  # type: ignore[list-item]
        loop_waits = 20.0

        async def run() -> None:
            loop = asyncio.get_running_loop()
            async with s:
                assert s.started and s.subscriber is not None
                assert await loop.run_in_executor(None, first.wait_subscribed, loop_waits)
                first.publish(event_batch(*blocks))
                await until(lambda: s.index.match_tokens(PROMPT).longest == 4, "first's events")
                added = s.add_engine(_kv_spec(second, 2))  # type: ignore[arg-type]
                await s.feeds_settled()
                assert s.subscriber is not None and added in s.subscriber.workers()
                assert await loop.run_in_executor(None, second.wait_subscribed, loop_waits)
                second.publish(event_batch(*blocks))
                await until(lambda: len(s.index.match_tokens(PROMPT).as_dict()) == 2, "second's")
                s.remove_engine(added)
                await s.feeds_settled()
                assert added not in s.subscriber.workers()
                assert list(s.index.match_tokens(PROMPT).as_dict()) == ["127.0.0.1:1"]
                with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
                    assert p.endpoint == "127.0.0.1:1" and p.cached == 64
            assert not s.started and s.subscriber is None

        asyncio.run(run())


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_events_landing_while_the_feeds_restart_leave_no_stale_blocks(how: str) -> None:
    """Probe 57 F5: an engine's index entries were dropped when it was removed (or moved to
    another address: another process), but the feed kept running on the old engine set until
    its restart task ran, and a batch it applied meanwhile brought the worker back with the
    old process's blocks. Those blocks outlived the restart: a removed engine stayed among the
    index's workers, and a moved one matched prompts its new process never cached."""
    pytest.importorskip("zmq")
    from llmsched.integrations import EngineSpec
    from llmsched.testing import FakeKVPublisher, event_batch, stored_event

    with FakeKVPublisher() as first, FakeKVPublisher() as second, FakeKVPublisher() as third:
        key = "b"
        named = EngineSpec("127.0.0.1", 2, name=key, **second.spec_kwargs())
        s = Scheduler([_kv_spec(first, 1), named], router="prefix-only", block_size=16)  # type: ignore[list-item]

        async def run() -> None:
            loop = asyncio.get_running_loop()
            async with s:
                assert await loop.run_in_executor(None, second.wait_subscribed, 20.0)
                second.publish(event_batch(stored_event([1, 2], None, PROMPT[:32].tolist())))
                await until(lambda: s.index.match_tokens(PROMPT).longest == 2, "the events")
                subscriber = s.subscriber
                assert subscriber is not None
                if how == "removed":
                    s.remove_engine(key)
                else:  # the same name at another address: another process
                    moved = EngineSpec("127.0.0.2", 2, name=key, **third.spec_kwargs())
                    s.set_engines([_kv_spec(first, 1), moved])  # type: ignore[list-item]
                assert s.index.match_tokens(PROMPT).as_dict() == {}
                # A batch the old process sent lands before the feeds restart (the loop is
                # held here on purpose, so the restart task cannot run first).
                second.publish(event_batch(stored_event([3], 2, PROMPT[32:48].tolist())))
                second.publish(event_batch(stored_event([9], None, PROMPT[:16].tolist())))
                assert subscriber.wait_for(lambda c: c["batches"] >= 3, timeout=20.0)
                await s.feeds_settled()
                assert s.index.match_tokens(PROMPT).as_dict() == {}
                if how == "removed":
                    assert key not in s.index.workers()

        asyncio.run(run())


def test_feeds_on_threads_with_the_sync_pair() -> None:
    pytest.importorskip("zmq")
    from llmsched.testing import FakeKVPublisher, event_batch, stored_event

    with FakeKVPublisher() as publisher:
        s = Scheduler([_kv_spec(publisher, 1)], router="prefix-only", block_size=16)  # type: ignore[list-item]
        s.start_sync()
        try:
            assert publisher.wait_subscribed(20.0)
            publisher.publish(event_batch(stored_event([7, 8], None, list(range(32)))))
            assert s.subscriber is not None
            assert s.subscriber.wait_for(lambda c: c["blocks_stored"] >= 2, timeout=20.0)
        finally:
            s.stop_sync()
        assert s.subscriber is None and s.index.match_tokens(PROMPT).longest == 2


def test_the_sync_form_refuses_a_running_loop_and_a_context_enters_once() -> None:
    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 2}})
    request = ScheduleRequest(tokens=PROMPT)

    async def run() -> None:
        with pytest.raises(RuntimeError, match="running event loop"):
            s.schedule_sync(request)
        context = s.schedule(request)
        async with context:
            with pytest.raises(PlacementError):
                await context.__aenter__()

    asyncio.run(run())
    assert s.stats()["completed"] == 1
    at_rest(s)


def test_from_config_takes_engine_specs_and_names_a_bad_entry() -> None:
    pytest.importorskip("zmq")
    s = Scheduler.from_config(
        {"engines": [{"host": "127.0.0.1", "port": 8000, "model": "m"}, "plain"]}
    )
    assert sorted(map(str, s.engines)) == ["127.0.0.1:8000", "plain"]
    assert s.address_of("127.0.0.1:8000") == "127.0.0.1:8000" and len(s.specs) == 1
    with pytest.raises(ConfigError, match=r"engines\[0\]"):
        Scheduler.from_config({"engines": [{"host": "127.0.0.1", "port": -1}]})
    with pytest.raises(ConfigError, match="scrape"):
        Scheduler.from_config({"engines": ["a"], "scrape": {"every": 1}})


def test_the_lazy_exports_are_listed_and_typos_raise() -> None:
    import llmsched

    assert {"Scheduler", "ScheduleRequest", "Placement", "Admission"} <= set(dir(llmsched))
    with pytest.raises(AttributeError, match="Schedular"):
        llmsched.Schedular  # type: ignore[attr-defined]  # noqa: B018


def test_a_chat_with_a_tool_call_only_message_is_scheduled() -> None:
    s = Scheduler(["a"], router="prefix-only", block_size=4, allow_pseudo_tokens=True)
    messages = [
        {"role": "user", "content": "What is the weather in Paris? " * 3},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    request = ScheduleRequest(messages=messages)
    with s.schedule_sync(request) as placement:
        assert placement.endpoint == "a"
    assert s.index.match(s.index.hash_text(render_messages(messages))).longest > 0


def test_an_llm_d_precise_config_wires_the_engines_kv_events() -> None:
    """The pipeline builds what llm-d's precise prefix mode describes, as the gateway does:
    engines without their own KV events publish to ``kvEventsConfig.zmqEndpoint`` with llm-d's
    topic, and the index uses the configured block size."""
    from llmsched.integrations import EngineSpec

    config = Path(__file__).parent / "data" / "llm-d-configs" / "llmd-precise-kv-events.yaml"
    own = EngineSpec.from_dict(
        {
            "name": "b",
            "host": "10.0.0.2",
            "port": 8000,
            "kv_events": "tcp://10.0.0.2:5557",
            "topic": "kv@10.0.0.2@m",
        }
    )
    shared = EngineSpec(host="10.0.0.1", port=8000, name="a", model="m")
    scheduler = Scheduler([shared, own], router=str(config), kv_events=True)
    specs = {s.name: s for s in scheduler.specs}
    info = scheduler.router.config_info
    precise = info["precise"]
    assert precise is not None
    assert specs["a"].kv_events == precise["zmq_endpoint"] and specs["a"].kv_events_bind
    assert specs["a"].topic == f"{precise['topic_filter']}10.0.0.1@m"
    assert specs["b"] == own, "an engine's own KV events are kept"
    assert scheduler.index.block_size == precise["block_size"]
    # An engine added later is wired the same way.
    scheduler.add_engine(EngineSpec(host="10.0.0.3", port=8000, name="c", model="m"))
    assert {s.name: s for s in scheduler.specs}["c"].kv_events == precise["zmq_endpoint"]


FLOW_2 = {"saturation": {"type": "concurrency", "max_requests": 2}}


@pytest.mark.parametrize("how", ["complete", "attribute", "add", "release"])
def test_an_output_count_flow_control_cannot_take_leaves_the_slot_held(how: str) -> None:
    """Probe 49 F14: the count was refused by flow control after the slot and the placement
    were marked ended, so the slot and ``in_flight`` were held for good."""
    s = Scheduler(["a", "b"], flow=FLOW_2)
    request = ScheduleRequest(tokens=PROMPT, tenant="t")
    if how == "release":
        admission = s.admit_sync(request)
        with pytest.raises(
            InvalidValueError, match=r"output_tokens must be in 0\.\.9223372036854775807"
        ):
            admission.release(2**64)
        assert admission.holds_slot and s.flow is not None and s.flow.running_count() == 1
        assert admission.release(2**63 - 1)
        at_rest(s)
        return
    p = s.schedule_sync(request)
    if how == "complete":
        with pytest.raises(InvalidValueError, match="output_tokens"):
            p.complete(2**63)
    elif how == "attribute":
        p.output_tokens = 10**400
        with pytest.raises(InvalidValueError, match="an int of 1329 bits"):
            p.fail()
        p.output_tokens = 7
    else:
        p.add_output_tokens(2**62)
        p.add_output_tokens(2**62 - 1)
        with pytest.raises(InvalidValueError, match="would total more than"):
            p.add_output_tokens(2**62)
        assert p.output_tokens == 2**63 - 1
    assert p.outcome is None and s.stats()["in_flight"] == 1
    assert p.complete()
    assert s.stats()["completed"] == 1
    at_rest(s)


def test_a_deadline_beyond_a_floats_range_is_an_invalid_request() -> None:
    # Probe 49 F7: a bare OverflowError from math.isfinite.
    for name in ("deadline", "ttft_target_s"):
        with pytest.raises(InvalidRequestError, match=name):
            ScheduleRequest(tokens=[1], **{name: 2**1024 - 1})
    with pytest.raises(ConfigError, match=r"retry_after_s .*an int of"):
        Scheduler(["a"], retry_after_s=10**400)


@pytest.mark.parametrize(
    ("argument", "fields"),
    [
        (name, {"tokens": [1], name: "a\ud800"})
        for name in ("tenant", "session_id", "session_endpoint", "model", "lora", "cache_salt")
    ]
    + [
        ("text", {"text": "a\ud800"}),
        ("messages", {"messages": [{"role": "user", "content": "a\ud800"}]}),
        (r"headers\['x'\]", {"tokens": [1], "headers": {"x": "a\ud800"}}),
        ("a key of headers", {"tokens": [1], "headers": {"a\ud800": "x"}}),
    ],
)
def test_a_lone_surrogate_is_refused_when_the_request_is_built(
    argument: str, fields: dict[str, Any]
) -> None:
    """Probe 49 F2: accepted at construction, then a bare UnicodeEncodeError from
    schedule_sync (the class promises every field is checked when built)."""
    with pytest.raises(InvalidRequestError, match=f"^{argument}.* must be valid UTF-8"):
        ScheduleRequest(**fields)


def test_an_engine_back_at_another_address_is_credited_with_no_cache() -> None:
    # A StatefulSet pod rescheduled keeps its name (its worker id) but is a new process at a
    # new IP: the index still credited it with the old one's blocks, so its prefixes went there.
    from llmsched.integrations import EngineSpec

    s = Scheduler(
        [EngineSpec("10.0.0.1", 8000, name="vllm-0")], router="prefix-only", block_size=16
    )
    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        assert p.endpoint == "vllm-0"
    assert s.index.match_tokens(PROMPT).as_dict() == {"vllm-0": 4}
    relabelled = EngineSpec("10.0.0.1", 8000, name="vllm-0", labels={"zone": "a"})
    assert s.set_engines([relabelled]) == ([], [], ["vllm-0"])
    assert s.index.match_tokens(PROMPT).as_dict() == {"vllm-0": 4}, "the same process"
    moved = EngineSpec("10.0.0.9", 8000, name="vllm-0")
    assert s.set_engines([moved]) == ([], [], ["vllm-0"])
    assert s.index.match_tokens(PROMPT).as_dict() == {}


def test_one_address_under_two_ids_is_noted_once(caplog: pytest.LogCaptureFixture) -> None:
    # Two names for one engine were taken silently: its load and cache counted apart (probe 50
    # F14). Data-parallel ranks share an address and are not noted.
    import logging

    from llmsched.integrations import EngineSpec

    a, b = EngineSpec("10.0.0.7", 8000, name="a"), EngineSpec("10.0.0.7", 8000, name="b")
    rank1 = EngineSpec("10.0.0.7", 8000, dp_rank=1, name="a1")
    with caplog.at_level(logging.WARNING, logger="llmsched"):
        s = Scheduler([a, b, rank1])
        s.set_engines([a, b])  # the same pair again: not logged again
    notes = [w for w in s.warnings if "10.0.0.7:8000" in w]
    assert len(notes) == 1 and "'a', 'b'" in notes[0] and "rank 0" in notes[0], notes
    assert s.stats()["config_warnings"] == len(s.warnings)
    assert len([m for m in caplog.messages if "10.0.0.7:8000" in m]) == 1, caplog.messages
    s.remove_engine("b")
    assert not [w for w in s.warnings if "10.0.0.7:8000" in w]


def test_shared_address_notes_follow_every_change() -> None:
    # The notes on one address under several ids are kept as engines come and go (a pass
    # over every engine per change made adding 3,000 engines one by one take 44 s): after
    # any sequence of adds, removals and replacements they equal a fresh count.
    from llmsched.integrations import EngineSpec

    rng = random.Random(50)
    hosts = ["10.0.0.1", "10.0.0.2", "::1", "0:0:0:0:0:0:0:1", "Engine-A", "engine-a"]
    s = Scheduler([])
    listed: dict[str, EngineSpec] = {}
    for step in range(400):
        roll = rng.random()
        name = f"e{rng.randrange(12)}"
        spec = EngineSpec(rng.choice(hosts), 8000, dp_rank=rng.randrange(2), name=name)
        if roll < 0.4 and name not in listed:
            s.add_engine(spec)
            listed[name] = spec
        elif roll < 0.6 and name in listed:
            s.remove_engine(name)
            del listed[name]
        elif roll < 0.9:
            listed[name] = spec
            s.set_engines(list(listed.values()))
        shared: dict[tuple[str, int], set[str]] = {}
        for n, e in listed.items():
            host = e.host.lower().replace("0:0:0:0:0:0:0:1", "::1")
            shared.setdefault((host, e.dp_rank), set()).add(n)
        expected = {key for key, names in shared.items() if len(names) > 1}
        notes = [w for w in s.warnings if "one engine under several ids" in w]
        assert len(notes) == len(expected), (step, notes, expected)
        for (host, rank), names in shared.items():
            if len(names) > 1:
                note = next(w for w in notes if f"(rank {rank})" in w and host in w.lower())
                assert all(repr(n) in note for n in names), (step, note, names)


def test_retry_never_goes_where_the_routers_filters_said_no() -> None:
    """Past the picker's fallbacks a retry tries the other endpoints considered, but only
    those the chosen profile's filters kept: a decode request never lands on a prefill-only
    engine (probe 51 F1: it did, with the prefill header naming that engine itself)."""
    from llmsched.integrations import EngineSpec

    roles = ["prefill", "decode", "decode", "decode", "decode", "decode"]
    engines = [EngineSpec("127.0.0.1", 8000 + i, role=role) for i, role in enumerate(roles)]
    router = {
        "plugins": [
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "max-score-picker"},
            {"type": "always-disagg-pd-decider"},
            {
                "type": "pd-profile-handler",
                "parameters": {"deciderPluginName": "always-disagg-pd-decider"},
            },
        ],
        "schedulingProfiles": [
            {
                "name": "prefill",
                "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "max-score-picker"}],
            },
            {
                "name": "decode",
                "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "max-score-picker"}],
            },
        ],
    }
    s = Scheduler(engines, router=router)
    prefill = engines[0].worker_id
    decode = {e.worker_id for e in engines[1:]}
    tried = []
    with pytest.raises(NoEndpointError), s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as p:
        assert p.prefill_endpoint == prefill
        tried.append(p.endpoint)
        assert prefill not in p.fallbacks
        while True:
            tried.append(p.retry())
    # Every decode engine (the picker's 3 fallbacks and the one past them), never the prefill.
    assert set(tried) == decode
    at_rest(s)


def test_a_session_endpoint_reaches_the_router() -> None:
    config = {
        "plugins": [{"type": "session-affinity-filter"}, {"type": "round-robin-picker"}],
        "schedulingProfiles": [
            {
                "name": "p",
                "plugins": [
                    {"pluginRef": "session-affinity-filter"},
                    {"pluginRef": "round-robin-picker"},
                ],
            }
        ],
    }
    scheduler = Scheduler(["a", "b", 3], router=config)
    request = ScheduleRequest(tokens=[1, 2], session_endpoint=3)
    assert request.pick_arguments()["session_endpoint"] == 3
    for _ in range(4):
        with scheduler.schedule_sync(request) as placement:
            assert placement.endpoint == 3
    for bad in (1.5, True, 2**63, b"a"):
        with pytest.raises(InvalidRequestError, match="session_endpoint"):
            ScheduleRequest(tokens=[1], session_endpoint=bad)  # type: ignore[arg-type]


CORE_ONLY = """
import sys
for name in ("zmq", "aiohttp", "prometheus_client", "yarl", "tokenizers", "jinja2", "nats"):
    sys.modules[name] = None  # as after `pip install llmsched`: no extra's package
from llmsched import Endpoint, ScheduleRequest, Scheduler
s = Scheduler(["a", Endpoint("b", address="http://10.0.0.7:8000/")], router="round-robin")
with s.schedule_sync(ScheduleRequest(tokens=[1, 2, 3])) as placement:
    print(placement.endpoint, s.address_of("b"))
"""


def test_the_scheduler_runs_without_the_integrations_extra() -> None:
    """``Scheduler(["a"])`` in a core install raised ``ImportError: llmsched.integrations needs
    the optional packages zmq, aiohttp, prometheus_client``: filing each engine by address
    imported ``normal_address`` from ``llmsched.integrations.identity``, whose package needs
    the extra. It lives in ``llmsched.validation`` now."""
    done = subprocess.run(
        [sys.executable, "-c", CORE_ONLY], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["a", "http://10.0.0.7:8000/"]


@pytest.mark.parametrize("how", ["schedule_sync", "place"])
def test_a_placement_under_async_with_names_the_right_form_and_ends(how: str) -> None:
    """``async with scheduler.schedule_sync(...)`` (or ``place``) got Python's own TypeError
    (3.10: AttributeError) and the placement it had made stayed open, its in-flight counts
    held, for as long as anything referenced it. Now an InvalidTypeError (a TypeError) names
    ``async with scheduler.schedule(request)`` and the plain ``with``, and the placement is
    cancelled at once. (With flow control ``schedule_sync`` refuses a running loop first.)"""
    s = Scheduler(["a"], router="round-robin")
    request = ScheduleRequest(tokens=PROMPT)
    made: list[Placement] = []

    async def main() -> None:
        placement = getattr(s, how)(request)
        made.append(placement)
        async with placement:
            pass

    with pytest.raises(InvalidTypeError, match=r"async with scheduler\.schedule\(request\)"):
        asyncio.run(main())
    assert made[0].outcome == "cancelled"
    assert s.stats()["cancelled"] == 1
    at_rest(s)


def test_dropped_admissions_and_placements_give_their_slots_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An Admission or a Placement dropped without being ended kept its flow-control slot (and
    the placement its count in ``stats()["in_flight"]``) for good, where a Decision finishes
    itself. Collected, they give them back, warn once through logging and count in
    ``stats()["dropped"]``; ended normally, nothing is released again or counted."""
    import gc
    import logging

    s = Scheduler(["a"], flow={"saturation": {"type": "concurrency", "max_requests": 3}})
    assert s.flow is not None
    admission = s.admit_sync(ScheduleRequest(tokens=PROMPT))
    placement = s.schedule_sync(ScheduleRequest(tokens=PROMPT))
    cycle = s.schedule_sync(ScheduleRequest(tokens=PROMPT))
    cycle.output_tokens = 5
    cycle.__dict__["me"] = cycle  # only the cycle collector frees it, its admission beside it
    assert s.flow.running_count() == 3 and s.stats()["in_flight"] == 2
    with caplog.at_level(logging.WARNING, logger="llmsched"):
        del admission, placement, cycle
        gc.collect()
    at_rest(s)
    stats = s.stats()
    # The placements' own admissions are counted with them, not again.
    assert (stats["dropped"], stats["cancelled"], stats["completed"]) == (3, 2, 0)
    warned = [r for r in caplog.records if "without being ended" in r.getMessage()]
    assert len(warned) == 1, caplog.records

    with s.schedule_sync(ScheduleRequest(tokens=PROMPT)) as ended:
        pass
    released = s.admit_sync(ScheduleRequest(tokens=PROMPT))
    assert released.release()
    del ended, released
    gc.collect()
    assert s.stats()["dropped"] == 3 and s.stats()["completed"] == 1
    at_rest(s)
