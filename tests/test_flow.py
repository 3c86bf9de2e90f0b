"""The friendly flow-control API: config, outcomes, bad input, preemption, metrics, README
example, doctests and a thread-stress test."""

from __future__ import annotations

import doctest
import math
import random
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import llmsched
import llmsched.errors
import llmsched.flow
import llmsched.reference.flow
from llmsched.errors import (
    ConfigError,
    DuplicateRequestError,
    FlowRejected,
    InvalidRequestError,
    InvalidValueError,
    UnknownRequestError,
)
from llmsched.flow import (
    FlowController,
    FlowRequest,
    Outcome,
    default_config,
    load_config,
    resolve_config,
)

ROOMY = {"saturation": {"type": "concurrency", "max_requests": 1000}}


@pytest.mark.parametrize("module", [llmsched.flow, llmsched.errors, llmsched.reference.flow])
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    ("outcome", "status", "reason", "key"),
    [
        (Outcome.DISPATCHED, 200, "", "dispatched"),
        (Outcome.REJECTED_CAPACITY, 429, "queue-capacity", "rejected_capacity"),
        (Outcome.REJECTED_SHED, 429, "load-shed", "rejected_shed"),
        (Outcome.REJECTED_NO_ENDPOINTS, 503, "no-endpoints", "rejected_no_endpoints"),
        (Outcome.EVICTED_TTL, 429, "ttl-expired", "evicted_ttl"),
        (Outcome.EVICTED_PREEMPTED, 429, "preempted", "evicted_preempted"),
        (Outcome.EVICTED_CANCELLED, 503, "cancelled", "evicted_cancelled"),
    ],
)
def test_outcome_http_mapping(outcome: Outcome, status: int, reason: str, key: str) -> None:
    assert (outcome.http_status, outcome.reason, outcome.key) == (status, reason, key)
    err = FlowRejected(1, outcome)
    assert (err.outcome, err.http_status, err.reason, err.request_id) == (
        outcome,
        status,
        reason,
        1,
    )


def test_defaults_live_in_one_place_and_resolve_round_trips() -> None:
    defaults = default_config()
    assert defaults["default_band"]["ttl_s"] == 60.0
    assert defaults["saturation"] == {
        "type": "utilization",
        "queue_threshold": 5.0,
        "kv_threshold": 0.8,
        "staleness_s": 1.0,
        "stale_policy": "saturated",
    }
    assert defaults["shedding"] == {
        "type": "probabilistic",
        "power": 5.0,
        "scale": 300.0,
        "seed": 0,
    }
    assert resolve_config(defaults) == defaults
    assert FlowController(defaults).config == defaults


def test_yaml_config_text_and_file(tmp_path: Path) -> None:
    text = (
        "default_band:\n  fairness: {type: las, half_life_s: 10}\n"
        "bands:\n  - {priority: -1, ttl_s: 5}\n"
    )
    path = tmp_path / "flow.yaml"
    path.write_text(text)
    for source in (text, path, str(path)):
        config = FlowController(source).config
        assert config["default_band"]["fairness"]["half_life_s"] == 10.0
        assert config["bands"][0]["ttl_s"] == 5.0
    assert load_config("") == {}


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"default_band": {"fairness": {"type": "fifo"}}}, "unknown fairness policy type 'fifo'"),
        ({"default_band": {"fairness": {"type": "vtc", "wq": 2}}}, "unknown field `wq`"),
        ({"saturation": {"type": "concurrency"}}, "max_requests or max_tokens"),
        ({"bands": [{"priority": 1}, {"priority": 1}]}, "appears twice"),
        ({"bandz": []}, "unknown field `bandz`"),
        ({"default_band": {"ttl_s": math.nan}}, "default_band.ttl_s must be finite"),
        ({"default_band": {"ttl_s": object()}}, "default_band"),
        ("- just\n- a list", "must be a mapping"),
        ("a: [", "not valid YAML"),
    ],
)
def test_bad_config_names_the_problem(config: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        FlowController(config)


def test_bad_input_raises_and_changes_nothing() -> None:
    ctrl = FlowController(ROOMY)
    assert ctrl.enqueue(FlowRequest(1, tenant="a", prompt_tokens=5, size_bytes=9), now=1.0) is None
    before = ctrl.metrics(now=1.0)
    cases: list[tuple[type[Exception], str, Any]] = [
        (
            InvalidRequestError,
            "prompt_tokens must be >= 0",
            lambda: ctrl.enqueue(FlowRequest(2, prompt_tokens=-1)),
        ),
        (InvalidRequestError, "id must be >= 0", lambda: ctrl.enqueue(FlowRequest(-2))),
        (InvalidRequestError, "32 bits", lambda: ctrl.enqueue(FlowRequest(2, priority=2**40))),
        # Ints beyond 64 bits: refused by name, as the negative ones are (not OverflowError).
        (InvalidRequestError, "id must fit", lambda: ctrl.enqueue(FlowRequest(2**64))),
        (
            InvalidRequestError,
            "prompt_tokens must fit",
            lambda: ctrl.enqueue(FlowRequest(2, prompt_tokens=2**70)),
        ),
        (
            InvalidRequestError,
            "size_bytes must fit",
            lambda: ctrl.enqueue(FlowRequest(2, size_bytes=2**63)),
        ),
        (InvalidRequestError, "request_id must fit", lambda: ctrl.complete(2**64)),
        (InvalidRequestError, "output_tokens must fit", lambda: ctrl.record_output(1, 2**64)),
        (InvalidRequestError, "request_id must fit", lambda: ctrl.cancel(-(2**64))),
        (InvalidRequestError, "request_id must fit", lambda: ctrl.is_queued(2**64)),
        (InvalidRequestError, "request_id must fit", lambda: ctrl.is_running(2**64)),
        # Probe 73: a negative id was a bare OverflowError from the unsigned conversion.
        (InvalidRequestError, "request_id must be >= 0", lambda: ctrl.is_queued(-1)),
        (InvalidRequestError, "request_id must be >= 0", lambda: ctrl.is_running(-1)),
        (InvalidRequestError, "request_id must be >= 0", lambda: ctrl.is_queued(np.int64(-3))),
        (InvalidRequestError, "priority must fit", lambda: ctrl.jain_index(2**64)),
        (InvalidRequestError, "deadline", lambda: ctrl.enqueue(FlowRequest(2, deadline=math.inf))),
        (InvalidRequestError, "ttft_target", lambda: ctrl.enqueue(FlowRequest(2, ttft_target=-1))),
        (InvalidValueError, "now must be", lambda: ctrl.enqueue(FlowRequest(2), now=math.nan)),
        (InvalidValueError, "now must be", lambda: ctrl.dispatch(now=math.inf)),
        (InvalidValueError, "now must be", lambda: ctrl.pump(now=-1.0)),
        (
            InvalidValueError,
            "kv_cache_usage",
            lambda: ctrl.update_endpoint("e", kv_cache_usage=1.5),
        ),
        (InvalidValueError, "waiting", lambda: ctrl.update_endpoint("e", waiting=-1)),
        (DuplicateRequestError, "already queued", lambda: ctrl.enqueue(FlowRequest(1))),
        (UnknownRequestError, "not running", lambda: ctrl.complete(1)),
        (UnknownRequestError, "not running", lambda: ctrl.record_output(77, 3)),
        (TypeError, "FlowRequest", lambda: ctrl.enqueue({"id": 3})),  # type: ignore[arg-type]
        (TypeError, "prompt_tokens", lambda: ctrl.enqueue(FlowRequest(3, prompt_tokens="5"))),  # type: ignore[arg-type]
        # A bool is not a count or an id (as FlowRequest's own fields already refuse it).
        (TypeError, "output_tokens must be an int, got bool", lambda: ctrl.complete(1, True)),
        (TypeError, "request_id must be an int, got bool", lambda: ctrl.is_queued(True)),
        (TypeError, "request_id must be an int, got bool", lambda: ctrl.cancel(True)),
        (
            TypeError,
            "prompt_tokens must be an int, got bool",
            lambda: ctrl.charge_remote("a", prompt_tokens=False),
        ),
    ]
    for kind, needle, call in cases:
        with pytest.raises(kind, match=needle):
            call()
    assert ctrl.metrics(now=1.0) == before
    assert isinstance(UnknownRequestError("x"), KeyError)
    assert isinstance(InvalidRequestError("x"), ValueError)
    assert len(ctrl) == 1 and ctrl.is_queued(1)


def test_batch_yields_to_interactive_and_preemption_names_victims() -> None:
    ctrl = FlowController(
        {
            "saturation": {"type": "concurrency", "max_requests": 3},
            "shedding": {"type": "none"},
            "preemption": {"max_victims": 2, "pacing_s": 0.5},
        }
    )
    for i in range(6):
        ctrl.enqueue(FlowRequest(i, priority=-1, tenant="batch"), now=0.0)
    assert [ctrl.dispatch(now=0.0).id for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    ctrl.enqueue(FlowRequest(100, priority=5, tenant="chat"), now=0.1)
    assert ctrl.dispatch(now=0.1) is None
    assert ctrl.preemption_victims(now=0.1) == [2, 1]
    ctrl.complete(2, now=0.2)
    chat = ctrl.dispatch(now=0.2)
    assert chat is not None and chat.id == 100 and chat.tenant == "chat"
    assert chat.wait_s == pytest.approx(0.1)
    assert ctrl.preemption_victims(now=0.3) == []  # 1 still being revoked


def test_metrics_and_jain_index() -> None:
    ctrl = FlowController({**ROOMY, "default_band": {"fairness": {"type": "vtc"}}})
    for i, tenant in enumerate(["a", "a", "b", "b"]):
        ctrl.enqueue(
            FlowRequest(i, tenant=tenant, prompt_tokens=100 if tenant == "a" else 10), now=0.0
        )
    order = [ctrl.dispatch(now=0.5).id for _ in range(4)]  # type: ignore[union-attr]
    assert order == [0, 2, 3, 1]
    metrics = ctrl.metrics(now=0.5)
    assert metrics["outcomes"]["dispatched"] == 4
    assert metrics["bands"][0]["wait_s"]["count"] == 4
    assert {f["tenant"]: f["fairness_counter"] for f in metrics["flows"]} == {"a": 200.0, "b": 20.0}
    assert ctrl.jain_index() == pytest.approx((220**2) / (2 * (200**2 + 20**2)))
    assert ctrl.jain_index(priority=0) == ctrl.jain_index()


def test_endpoint_feed_drives_saturation() -> None:
    now = [0.0]
    ctrl = FlowController(clock=lambda: now[0])
    ctrl.update_endpoint("a", waiting=5, kv_cache_usage=0.2)  # 1.0
    ctrl.update_endpoint("b", waiting=0, kv_cache_usage=0.4)  # 0.5
    assert ctrl.saturation() == 0.75
    now[0] = 1.1  # both reports are older than the 1 s default
    assert ctrl.saturation() == 1.0
    assert ctrl.remove_endpoint("a") and not ctrl.remove_endpoint("a")
    ctrl.update_endpoint("b", kv_cache_usage=0.0)
    assert ctrl.saturation() == 0.0


@pytest.mark.timeout(120)
def test_thread_stress_accounts_for_every_request() -> None:
    ctrl = FlowController(
        {
            "saturation": {"type": "concurrency", "max_requests": 16},
            "default_band": {"max_requests": 400, "fairness": {"type": "vtc"}},
            "global": {"max_requests": 1000},
            "shedding": {"type": "probabilistic", "power": 2, "scale": 0.5, "seed": 3},
        }
    )
    threads, per_thread = 8, 1500
    lock = threading.Lock()
    finished: dict[int, str] = {}
    refused: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads, timeout=30)  # every worker starts at once

    def record(request_id: int, outcome: str) -> None:
        with lock:
            assert request_id not in finished, f"{request_id} finished twice"
            finished[request_id] = outcome

    def worker(t: int) -> None:
        rng = random.Random(t)
        running: list[int] = []
        try:
            barrier.wait()
            for i in range(per_thread):
                rid = t * 1_000_000 + i
                priority = rng.choice([-1, 0, 2])
                outcome = ctrl.enqueue(FlowRequest(rid, priority=priority, tenant=f"t{t % 3}"))
                if outcome is not None:
                    with lock:
                        refused[rid] = outcome.key
                if rng.random() < 0.6 and (d := ctrl.dispatch()) is not None:
                    record(d.id, d.outcome.key)
                    running.append(d.id)
                if rng.random() < 0.1 and (c := ctrl.cancel(rid - rng.randint(0, 5))) is not None:
                    record(c.id, c.outcome.key)
                if running and rng.random() < 0.7:
                    ctrl.complete(running.pop(rng.randrange(len(running))), output_tokens=3)
                for e in ctrl.drain_evicted():
                    record(e.id, e.outcome.key)
            for rid in running:
                ctrl.complete(rid)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=100)
    assert not any(t.is_alive() for t in pool), "a thread hung"
    assert not errors, errors
    while (d := ctrl.dispatch()) is not None:
        record(d.id, d.outcome.key)
        ctrl.complete(d.id)
    for e in ctrl.drain_evicted() + ctrl.expire(now=math.floor(1e9)):
        record(e.id, e.outcome.key)
    total = threads * per_thread
    assert set(finished).isdisjoint(refused)
    assert len(finished) + len(refused) == total
    assert len(ctrl) == 0 and ctrl.running_count() == 0
    counts = ctrl.metrics()["outcomes"]
    assert sum(counts.values()) == total
    assert counts["dispatched"] == sum(o == "dispatched" for o in finished.values())


def test_token_sums_saturate_instead_of_wrapping() -> None:
    # Probe 49 F13: three prompts of 2**63 - 1 tokens read 9223372036854775805 running tokens.
    g = FlowController({"saturation": {"type": "concurrency", "max_requests": 8}})
    for i in range(3):
        assert g.enqueue(FlowRequest(i, prompt_tokens=2**63 - 1, tenant="t"), now=1.0) is None
        g.dispatch(now=1.0)
    assert g.metrics(now=1.0)["running_tokens"] == 2**64 - 1
    for i in range(3):
        g.complete(i, output_tokens=2**63 - 1, now=1.0)
    m = g.metrics(now=1.0)
    assert (m["running"], m["running_tokens"]) == (0, 0)
    assert [f["service_tokens"] for f in m["flows"]] == [2**64 - 1]


def test_a_deadline_beyond_a_floats_range_is_refused_by_name() -> None:
    # Probe 49 F7: a bare OverflowError from the native conversion.
    g = FlowController()
    with pytest.raises(InvalidRequestError, match=r"FlowRequest\.deadline .*an int of 1329 bits"):
        g.enqueue(FlowRequest(1, deadline=10**400))
    assert len(g) == 0


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("FlowRequest.tenant", lambda c: c.enqueue(FlowRequest(9, tenant="a\ud800"), now=0.0)),
        ("endpoint", lambda c: c.update_endpoint("a\ud800", timestamp=0.0)),
        ("endpoint", lambda c: c.remove_endpoint("a\ud800")),
    ],
)
def test_a_lone_surrogate_is_named_and_changes_nothing(argument: str, call: Any) -> None:
    """Probe 49 F2: a bare UnicodeEncodeError from the native conversion."""
    ctrl = FlowController(ROOMY)
    ctrl.enqueue(FlowRequest(1, tenant="t"), now=0.0)
    ctrl.update_endpoint("pod", waiting=3, timestamp=0.0)
    before = (len(ctrl), ctrl.metrics(now=0.0))
    with pytest.raises(InvalidValueError, match=f"^{argument} must be valid UTF-8"):
        call(ctrl)
    assert (len(ctrl), ctrl.metrics(now=0.0)) == before


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"default_band": {"fairness": {"type": "vtc", "weights": {"a\ud800": 1}}}},
            r"key 'a\\ud800' at default_band\.fairness\.weights must be valid UTF-8",
        ),
        (
            {"default_band": {"fairness": {"type": "vtc", "weights": {7: 1}}}},
            r"key 7 at default_band\.fairness\.weights must be a str",
        ),
        (
            {"default_band": {"max_requests": 2**64}},
            r"value at default_band\.max_requests must fit in 64 bits",
        ),
    ],
)
def test_a_config_value_the_native_side_cannot_take_is_named(
    config: dict[Any, Any], message: str
) -> None:
    """Probe 49 F2/F8: ``flow config: UnicodeEncodeError: ...``, naming no key."""
    with pytest.raises(ConfigError, match=f"^flow config: {message}"):
        FlowController(config)
    with pytest.raises(ConfigError, match=f"^flow config: {message}"):
        resolve_config(config)
