"""SliceTracker and SwitchCostModel: unit tests, properties and a state machine against the twin."""

from __future__ import annotations

import heapq
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import llmsched
from llmsched import _llmsched
from llmsched.errors import (
    ConfigError,
    InvalidTypeError,
    InvalidValueError,
    SliceStateError,
    UnknownRequestError,
    UnknownWorkerError,
)
from llmsched.reference.slices import SliceTracker as TwinTracker
from llmsched.slices import (
    SliceAssembler,
    SliceStart,
    SliceTracker,
    SwitchCostModel,
    WaitingRequest,
    evict_probability,
    policy_defaults,
    policy_names,
)

STATE_FIELDS = [
    "priority",
    "level",
    "prompt_tokens",
    "max_tokens",
    "generated_tokens",
    "slice_generated",
    "slice_tokens",
    "slices",
    "context_tokens",
    "endpoint",
    "route_to",
    "phase",
    "paused_since",
]
DECISION_FIELDS = [
    "action",
    "level",
    "priority",
    "endpoint",
    "next_slice_tokens",
    "context_tokens",
    "generated_tokens",
    "slices",
    "benefit_s",
    "yield_cost_s",
    "migrate_cost_s",
    "evict_probability",
]

COST = SwitchCostModel(prefill_tokens_per_s=10_000, decode_step_s=0.01, kv_capacity_tokens=50_000)


def test_policies_registry_and_defaults() -> None:
    assert policy_names() == ["fixed", "mlfq"]
    assert policy_defaults("fixed") == {"slice_tokens": 512}
    assert set(policy_defaults("mlfq")) == {
        "base_quantum",
        "levels",
        "join_ratio",
        "promote_after_s",
    }
    t = SliceTracker("mlfq", {"levels": 2})
    assert t.params["levels"] == 2
    assert t.params["base_quantum"] == policy_defaults("mlfq")["base_quantum"]


@pytest.mark.parametrize(
    ("policy", "params", "match"),
    [
        ("lottery", None, "unknown slice policy"),
        ("mlfq", {"quantum": 3}, "unknown field `quantum`"),
        ("mlfq", {"levels": 0}, "levels"),
        ("mlfq", {"levels": "4"}, "invalid type"),
        ("fixed", {"slice_tokens": 0}, "slice_tokens"),
        ("fixed", {"slice_tokens": 1.5}, "invalid type"),
        ("fixed", {"slice_tokens": float("nan")}, "slice_tokens must be finite"),
        ("fixed", [("slice_tokens", 3)], "mapping"),
    ],
)
def test_bad_config_raises_config_error(policy: str, params: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SliceTracker(policy, params)


def test_cost_model_formulas() -> None:
    default = SwitchCostModel()
    assert default.to_dict() == SwitchCostModel(**default.to_dict()).to_dict()
    # Llama-3-8B on H100: recompute costs about 32 us per token of context.
    assert 30 < 1e6 / default.prefill_tokens_per_s < 35
    # KV bytes/token = 2*32*8*128*2 = 128 KiB; (0.9*80e9 - 2*8.03e9) / 131072 tokens.
    assert default.kv_capacity_tokens == pytest.approx((0.9 * 80e9 - 2 * 8.03e9) / 131072)
    m = SwitchCostModel.from_model(
        params=1e9, layers=16, kv_heads=4, head_dim=64, dtype_bytes=2, gpu_flops=100e12,
        gpu_hbm_bytes_per_s=1e12, gpu_memory_bytes=20e9, compute_efficiency=1.0,
        bandwidth_efficiency=1.0, memory_fraction=1.0,
    )  # fmt: skip
    assert m.prefill_tokens_per_s == pytest.approx(100e12 / 2e9)
    assert m.decode_step_s == pytest.approx(2e9 / 1e12)
    assert m.kv_capacity_tokens == pytest.approx((20e9 - 2e9) / (2 * 16 * 4 * 64 * 2))
    assert m.recompute_s(5e4) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="unknown field"):
        SwitchCostModel(decode_steps=1.0)
    with pytest.raises(ConfigError, match="decode_step_s"):
        SwitchCostModel(decode_step_s=0)
    with pytest.raises(ConfigError, match="layers"):
        SwitchCostModel.from_model(params=1e9, layers=0, kv_heads=1, head_dim=1)


@pytest.mark.parametrize(
    ("dims", "match"),
    [
        # Both said "must be a positive number, got 32" (or 8000000000.0).
        ({"layers": np.int64(32)}, "layers must be a plain int or float .*, got int64 32"),
        ({"params": np.float32(8e9)}, "params must be a plain int or float .*, got float32"),
        ({"layers": True}, "layers must be a plain int or float .*, got bool True"),
        ({"kv_heads": -8}, "kv_heads must be a positive number, got -8"),
    ],
)
def test_from_model_names_what_is_wrong_with_a_dimension(
    dims: dict[str, object], match: str
) -> None:
    base: dict[str, object] = {"params": 8e9, "layers": 32, "kv_heads": 8, "head_dim": 128}
    with pytest.raises(ConfigError, match=match):
        SwitchCostModel.from_model(**{**base, **dims})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("context", "demand", "free", "expected"),
    [(1000, 0, 0, 0.0), (1000, 900, 1000, 0.0), (1000, 1250, 1000, 0.25), (10, 1e9, 0, 1.0)],
)
def test_evict_probability_table(context: int, demand: int, free: int, expected: float) -> None:
    assert evict_probability(context, demand, free) == expected


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda m: m.recompute_s(-5), "context_tokens"),
        (lambda m: m.recompute_s(float("nan")), "context_tokens"),
        (lambda m: m.recompute_s(10**400), "context_tokens"),
        (lambda m: m.recompute_s(5, 0), "prefill_tokens_per_s"),
        (lambda m: m.recompute_s(5, float("nan")), "prefill_tokens_per_s"),
        (lambda m: m.switch_s(5, demand_tokens=10, free_tokens=0, prefill_tokens_per_s=0),
         "prefill_tokens_per_s"),
        (lambda m: m.switch_s(float("nan"), demand_tokens=1, free_tokens=1), "context_tokens"),
        (lambda m: m.switch_s(5, demand_tokens=-1, free_tokens=1), "demand_tokens"),
        (lambda m: evict_probability(float("nan"), 1, 1), "context_tokens"),
        (lambda m: evict_probability(1, float("inf"), 1), "demand_tokens"),
        (lambda m: evict_probability(1, 1, -2), "free_tokens"),
        (lambda m: m.weight(2**31), "priority"),
        (lambda m: m.weight(-(2**31) - 1), "priority"),
        (lambda m: m.weight(2**70), "priority"),
    ],
)  # fmt: skip
def test_cost_helpers_refuse_nan_negative_and_out_of_range(call: Any, name: str) -> None:
    with pytest.raises(InvalidValueError, match=name):
        call(SwitchCostModel())


def test_cost_helpers_accept_their_bounds() -> None:
    m = SwitchCostModel(priority_base=2.0)
    assert m.weight(-(2**31)) == 0.0 and m.weight(2**31 - 1) == float("inf")
    assert m.recompute_s(0) == 0.0 and evict_probability(0, 0, 0) == 0.0


def test_a_continuation_is_charged_its_last_block() -> None:
    """Probe 77: with nothing evicted the model charged no recompute, yet a continuation always
    recomputes its last KV block (1 to ``block_size`` tokens; tests/test_slices_recompute.py
    checks the count against the reference executor)."""
    m = SwitchCostModel(prefill_tokens_per_s=1000, requeue_delay_s=0.0)
    assert m.block_size == 16 and m.to_dict()["block_size"] == 16
    assert [m.recompute_tokens(c) for c in (0, 1, 16, 17, 48, 50, 64)] == [0, 1, 16, 1, 16, 2, 16]
    assert m.switch_s(48, demand_tokens=0, free_tokens=10**6) == pytest.approx(0.016)
    assert m.recompute_tokens(1000, demand_tokens=1500, free_tokens=1000) == 500  # half evicted
    assert m.recompute_tokens(1000, demand_tokens=1001, free_tokens=1000) == 8  # 1 < the tail
    big = SwitchCostModel(block_size=256)
    assert big.recompute_tokens(300) == 44 and big.to_dict()["block_size"] == 256
    assert SwitchCostModel(**big.to_dict()).block_size == 256
    dims = {"params": 8e9, "layers": 32, "kv_heads": 8, "head_dim": 128}
    assert SwitchCostModel.from_model(**dims).block_size == 16
    assert SwitchCostModel.from_model(**dims, block_size=32).recompute_tokens(48) == 16


@pytest.mark.parametrize(
    ("block_size", "error"),
    [
        (0, InvalidValueError),
        (2**16 + 1, InvalidValueError),
        (-16, InvalidValueError),
        (16.0, InvalidTypeError),
        (True, InvalidTypeError),
        ("16", InvalidTypeError),
    ],
)
def test_a_bad_block_size_is_named(block_size: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="block_size"):
        SwitchCostModel(block_size=block_size)  # type: ignore[arg-type]
    dims = {"params": 8e9, "layers": 32, "kv_heads": 8, "head_dim": 128}
    with pytest.raises(error, match="block_size"):
        SwitchCostModel.from_model(**dims, block_size=block_size)  # type: ignore[arg-type]


def test_the_native_model_checks_its_block_size_too() -> None:
    for bad in (0, 2**16 + 1):
        with pytest.raises(ConfigError, match=r"block_size must be an int in 1\.\.=65536"):
            _llmsched.SwitchCostModel({"block_size": bad})
    assert _llmsched.SwitchCostModel({"block_size": 2**16}).block_size == 2**16


def test_admit_takes_numpy_integers_as_record_tokens_does() -> None:
    """``record_tokens`` took numpy integers (the native layer reads them) where ``admit``
    refused them with "must be an int, got int64"; the tracker now takes them everywhere, as
    ``validation.check_index`` and the flow controller do (not numpy's bool)."""
    t = SliceTracker("fixed", {"slice_tokens": 4}, endpoints=["a"])
    start = t.admit(
        np.uint64(1), prompt_tokens=np.int64(5), max_tokens=np.int32(6), endpoint="a",
        priority=np.int8(-1),
    )  # fmt: skip
    assert start == SliceStart(0, 4)
    state = t.state(np.int64(1))
    assert state is not None and (state.context_tokens, state.priority) == (5, -1)
    assert t.record_tokens(np.int64(1), np.int64(4)) == 0
    assert t.quantum(np.int64(0)) == 4 and t.entry_level(np.int64(5)) == 0
    for bad in (np.bool_(True), np.float64(5.0), 5.0):
        with pytest.raises(InvalidTypeError, match="prompt_tokens must be an int"):
            t.admit(2, prompt_tokens=bad, max_tokens=6, endpoint="a")  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match="tokens must be an int"):
            t.record_tokens(1, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="prompt_tokens"):
        t.admit(2, prompt_tokens=np.int64(-1), max_tokens=6, endpoint="a")
    with pytest.raises(InvalidValueError, match="max_tokens"):
        t.admit(2, prompt_tokens=np.uint32(2**32 - 1), max_tokens=np.int64(0), endpoint="a")
    assert len(t) == 1
    request = {"model": "m", "prompt": [1, 2], "max_tokens": 5}
    asm = SliceAssembler(request, created=np.int64(7), default_max_tokens=np.uint32(9))
    assert asm.next_request(np.int64(3))["max_tokens"] == 3
    with pytest.raises(InvalidTypeError, match="slice_tokens must be an int"):
        asm.next_request(np.bool_(True))  # type: ignore[arg-type]


def _run_slice(t: Any, rid: int) -> None:
    state = t.state(rid)
    get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
    t.record_tokens(rid, get("slice_tokens") - get("slice_generated"))


def test_budgets_add_up_and_nobody_waiting_continues() -> None:
    t = SliceTracker("fixed", {"slice_tokens": 64}, cost_model=COST, endpoints=["a"])
    assert t.admit(1, prompt_tokens=10, max_tokens=200, endpoint="a") == SliceStart(0, 64)
    budgets = [64]
    while True:
        _run_slice(t, 1)
        d = t.decide(1, now=0.0)
        if d.action == "finish":
            break
        assert d.action == "continue" and d.endpoint == "a"
        budgets.append(d.next_slice_tokens)
    assert budgets == [64, 64, 64, 8]
    assert (d.generated_tokens, d.slices, d.context_tokens) == (200, 4, 210)
    assert 1 not in t and len(t) == 0


def test_bad_input_leaves_state_unchanged() -> None:
    t = SliceTracker("fixed", {"slice_tokens": 10}, cost_model=COST, endpoints=["a"])
    t.admit(1, prompt_tokens=5, max_tokens=100, endpoint="a")
    t.record_tokens(1, 3)
    before = {f: getattr(t.state(1), f) for f in STATE_FIELDS}
    bad_calls = [
        (SliceStateError, lambda: t.record_tokens(1, 8)),
        (SliceStateError, lambda: t.decide(1, now=0.0)),
        (SliceStateError, lambda: t.admit(1, prompt_tokens=1, max_tokens=1, endpoint="a")),
        (SliceStateError, lambda: t.resume(1, endpoint="a")),
        (UnknownWorkerError, lambda: t.admit(2, prompt_tokens=1, max_tokens=1, endpoint="b")),
        (UnknownRequestError, lambda: t.decide(99, now=0.0)),
        (KeyError, lambda: t.record_tokens(99, 1)),
        (InvalidValueError, lambda: t.admit(2, prompt_tokens=1, max_tokens=0, endpoint="a")),
        (InvalidValueError, lambda: t.admit(-1, prompt_tokens=1, max_tokens=1, endpoint="a")),
        (InvalidValueError, lambda: t.record_tokens(1, -1)),
        (TypeError, lambda: t.record_tokens(1, "3")),  # type: ignore[arg-type]
        (InvalidValueError, lambda: t.decide(1, finished=True, now=float("inf"))),
        (InvalidValueError, lambda: t.decide(1, finished=True, waiting=[(0, 5, 1, 1)], now=0.0)),
        (InvalidValueError, lambda: t.decide(1, finished=True, waiting=[(0, 0, 1, 0)], now=0.0)),
        (InvalidValueError, lambda: t.decide(1, finished=True, waiting=[(0, 0, -1, 1)], now=0.0)),
        (TypeError, lambda: t.decide(1, finished=True, waiting=[(0, 0)], now=0.0)),
        (InvalidValueError, lambda: t.set_endpoint("a", kv_cache_usage=1.5)),
        (InvalidValueError, lambda: t.set_endpoint("c", decode_step_s=-1.0)),
        (InvalidValueError, lambda: t.quantum(1)),
        # Ints out of range: llmsched's error (a ValueError), not a bare ValueError.
        (InvalidValueError, lambda: t.record_tokens(1, 2**70)),
        (InvalidValueError, lambda: t.remove(2**70)),
        (InvalidValueError, lambda: t.state(2**70)),
        (InvalidValueError, lambda: t.entry_level(2**70)),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
        assert {f: getattr(t.state(1), f) for f in STATE_FIELDS} == before
    assert t.endpoints == ["a"]
    assert len(t) == 1


def test_waiting_error_names_the_field() -> None:
    t = SliceTracker("fixed", endpoints=["a"])
    t.admit(1, prompt_tokens=5, max_tokens=100, endpoint="a")
    with pytest.raises(InvalidValueError, match=r"waiting\[1\]\.context_tokens"):
        t.decide(1, finished=True, waiting=[(0, 0, 1, 1), (0, 0, 2**40, 1)], now=0.0)


def test_mlfq_levels_and_promotion() -> None:
    params = {"base_quantum": 10, "levels": 3, "join_ratio": 10, "promote_after_s": 5}
    t = SliceTracker("mlfq", params, cost_model=COST, endpoints=["a"])
    assert [t.entry_level(p) for p in (50, 150, 300, 10**6)] == [0, 1, 2, 2]
    assert [t.quantum(level) for level in range(3)] == [10, 20, 40]
    assert t.admit(1, prompt_tokens=150, max_tokens=10**6, endpoint="a") == SliceStart(1, 20)
    _run_slice(t, 1)
    d = t.decide(1, now=0.0)
    assert (d.action, d.level, d.next_slice_tokens) == ("continue", 2, 40)
    _run_slice(t, 1)
    short = WaitingRequest(priority=0, level=0, context_tokens=100, expected_tokens=5)
    d = t.decide(1, waiting=[short], now=1.0)
    assert (d.action, d.level, d.priority, d.endpoint) == ("yield", 2, 0, "a")
    assert d.benefit_s > d.yield_cost_s
    assert t.state(1).phase == "paused" and t.state(1).paused_since == 1.0
    assert t.promote(now=5.9) == []
    assert t.promote(now=6.0) == [(1, 0)]
    assert t.resume(1, endpoint="a") == SliceStart(0, 10)


def test_migration_exposes_the_target_endpoint() -> None:
    t = SliceTracker("fixed", {"slice_tokens": 500}, cost_model=COST, endpoints=["a", "c"])
    t.set_endpoint("b", waiting=3)
    t.admit(1, prompt_tokens=1000, max_tokens=10_000, endpoint="a")
    _run_slice(t, 1)
    w = WaitingRequest(priority=0, level=0, context_tokens=100, expected_tokens=400)
    d = t.decide(1, waiting=[w], now=0.0)
    assert (d.action, d.endpoint) == ("migrate", "c")
    assert d.migrate_cost_s == pytest.approx(1500 / 10_000 + COST.requeue_delay_s)
    state = t.state(1)
    assert (state.endpoint, state.route_to) == ("a", "c")
    t.resume(1, endpoint="c")
    assert t.state(1).endpoint == "c"


# --------------------------------------------------------------------------------------------
# State machine: native vs pure-Python twin
# --------------------------------------------------------------------------------------------

ENDPOINTS = ["a", "b", "c"]
waiting_st = st.lists(
    st.builds(
        WaitingRequest,
        priority=st.integers(-2, 2),
        level=st.integers(0, 2),
        context_tokens=st.integers(0, 3000),
        expected_tokens=st.integers(1, 600),
    ),
    max_size=5,
)


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except (ValueError, KeyError) as exc:
        return "error", "KeyError" if isinstance(exc, KeyError) else "ValueError"


def _normalise(value: Any) -> Any:
    if hasattr(value, "action"):
        return {f: getattr(value, f) for f in DECISION_FIELDS}
    return value


class SliceMachine(RuleBasedStateMachine):
    """Drive the native tracker and the twin with the same calls; they must agree exactly."""

    ids = Bundle("ids")

    @initialize(policy=st.sampled_from(["fixed", "mlfq"]), small=st.booleans())
    def setup(self, policy: str, small: bool) -> None:
        params: dict[str, Any] = (
            {"slice_tokens": 37}
            if policy == "fixed"
            else {"base_quantum": 16 if small else 64, "levels": 3, "promote_after_s": 4.0}
        )
        self.native = SliceTracker(policy, params, cost_model=COST, endpoints=ENDPOINTS)
        self.twin = TwinTracker(policy, params, cost_model=COST, endpoints=ENDPOINTS)
        self.next_id = 0
        self.now = 0.0

    def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        got = _outcome(lambda: getattr(self.native, name)(*args, **kwargs))
        want = _outcome(lambda: getattr(self.twin, name)(*args, **kwargs))
        assert (got[0], _normalise(got[1])) == (want[0], _normalise(want[1])), name
        return got

    @rule(
        target=ids,
        prompt=st.integers(0, 4000),
        max_tokens=st.integers(1, 400),
        priority=st.integers(-2, 2),
        endpoint=st.sampled_from([*ENDPOINTS, "zz"]),
    )
    def admit(self, prompt: int, max_tokens: int, priority: int, endpoint: str) -> int:
        self.next_id += 1
        self.both(
            "admit",
            self.next_id,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            endpoint=endpoint,
            priority=priority,
        )
        return self.next_id

    @rule(rid=ids, tokens=st.integers(0, 80))
    def record(self, rid: int, tokens: int) -> None:
        self.both("record_tokens", rid, tokens)

    @rule(rid=ids)
    def finish_slice(self, rid: int) -> None:
        state = self.twin.state(rid)
        if state is not None and state["phase"] == "running":
            left = state["slice_tokens"] - state["slice_generated"]
            self.both("record_tokens", rid, left)

    @rule(rid=ids, finished=st.booleans(), waiting=waiting_st, dt=st.floats(0, 3))
    def decide(self, rid: int, finished: bool, waiting: list[WaitingRequest], dt: float) -> None:
        self.now += dt
        self.both("decide", rid, finished=finished, waiting=waiting, now=self.now)

    @rule(rid=ids, endpoint=st.sampled_from(ENDPOINTS))
    def resume(self, rid: int, endpoint: str) -> None:
        self.both("resume", rid, endpoint=endpoint)

    @rule(dt=st.floats(0, 6))
    def promote(self, dt: float) -> None:
        self.now += dt
        self.both("promote", now=self.now)

    @rule(rid=consumes(ids))
    def remove(self, rid: int) -> None:
        self.both("remove", rid)

    @rule(
        endpoint=st.sampled_from(ENDPOINTS),
        usage=st.floats(0, 1.2),
        waiting=st.integers(0, 2),
        capacity=st.none() | st.floats(1, 20_000),
    )
    def set_endpoint(self, endpoint: str, usage: float, waiting: int, capacity: Any) -> None:
        self.both(
            "set_endpoint",
            endpoint,
            kv_cache_usage=usage,
            waiting=waiting,
            kv_capacity_tokens=capacity,
        )

    @invariant()
    def same_states(self) -> None:
        if not hasattr(self, "twin"):
            return
        assert len(self.native) == len(self.twin)
        for rid in range(1, self.next_id + 1):
            want = self.twin.state(rid)
            got = self.native.state(rid)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert {f: getattr(got, f) for f in STATE_FIELDS} == want
                assert got.slice_generated <= got.slice_tokens
                assert got.generated_tokens <= got.max_tokens
                assert got.context_tokens == got.prompt_tokens + got.generated_tokens


SliceMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestSliceMachine = SliceMachine.TestCase


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


# Up to 5000 boundaries an example (base_quantum 1): past hypothesis's 200 ms deadline on a
# loaded machine.
@settings(deadline=None)
@given(
    prompt=st.integers(0, 10_000),
    max_tokens=st.integers(1, 5000),
    base=st.integers(1, 300),
    levels=st.integers(1, 5),
    join=st.floats(0.5, 20),
)
def test_levels_move_as_specified_and_budgets_add_up(
    prompt: int, max_tokens: int, base: int, levels: int, join: float
) -> None:
    params = {"base_quantum": base, "levels": levels, "join_ratio": join}
    t = SliceTracker("mlfq", params, cost_model=COST, endpoints=["a"])
    start = t.admit(1, prompt_tokens=prompt, max_tokens=max_tokens, endpoint="a")
    quanta = [base * 2**level for level in range(levels)]
    want_level = next((i for i, q in enumerate(quanta) if prompt <= join * q), levels - 1)
    assert start.level == want_level
    level, budgets = start.level, [start.slice_tokens]
    while True:
        t.record_tokens(1, budgets[-1])
        d = t.decide(1, now=0.0)
        if d.action == "finish":
            break
        level = min(level + 1, levels - 1)
        assert d.action == "continue"
        assert d.level == level
        assert d.next_slice_tokens == min(quanta[level], max_tokens - sum(budgets))
        budgets.append(d.next_slice_tokens)
    assert sum(budgets) == max_tokens == d.generated_tokens
    assert d.slices == len(budgets)


def _simulate_starvation(promote_after_s: float, arrivals: list[float]) -> list[tuple[float, int]]:
    """One slot; a long request competes with a stream of short ones (2 tokens each). The
    scheduler dispatches the lowest level first, FIFO within a level by the time the request
    (re-)entered the queue. Returns, for each pause of the long request, its length and the
    number of short requests queued when it began."""
    params = {"base_quantum": 4, "levels": 3, "join_ratio": 100, "promote_after_s": promote_after_s}
    cost = SwitchCostModel(decode_step_s=1.0, prefill_tokens_per_s=1e9, requeue_delay_s=0.0)
    t = SliceTracker("mlfq", params, cost_model=cost, endpoints=["a"])
    queue: list[tuple[int, float, int, int]] = []  # (level, enqueued, id, output tokens)
    outputs = {0: 400}
    heapq.heappush(queue, (0, 0.0, 0, 400))
    for i in range(1, len(arrivals) + 1):
        outputs[i] = 2
    pending = sorted((at, i) for i, at in enumerate(arrivals, start=1))
    now, running, paused_at, backlog = 0.0, None, 0.0, 0
    pauses: list[tuple[float, int]] = []
    while running is not None or queue or pending:
        while pending and pending[0][0] <= now:
            at, rid = pending.pop(0)
            heapq.heappush(queue, (t.entry_level(100), at, rid, outputs[rid]))
        for rid, level in t.promote(now):
            queue = [(level if q[2] == rid else q[0], *q[1:]) for q in queue]
            heapq.heapify(queue)
        if running is None and queue:
            _, _, rid, _ = heapq.heappop(queue)
            if rid in t:
                t.resume(rid, endpoint="a")
                if rid == 0:
                    pauses.append((now - paused_at, backlog))
            else:
                t.admit(rid, prompt_tokens=100, max_tokens=outputs[rid], endpoint="a")
            running = rid
        if running is None:
            now = pending[0][0] if pending else now
            continue
        now += 1.0  # one decode step
        if t.record_tokens(running, 1) == 0:
            waiting = [
                WaitingRequest(0, q[0], 100, max(1, outputs[q[2]])) for q in sorted(queue)[:4]
            ]
            d = t.decide(running, waiting=waiting, now=now)
            if d.action in ("yield", "migrate"):
                heapq.heappush(queue, (d.level, now, running, outputs[running]))
                if running == 0:
                    paused_at, backlog = now, len(queue) - 1
                running = None
            elif d.action == "finish":
                running = None
    assert len(t) == 0
    return pauses


@settings(max_examples=30, deadline=None)
@given(gaps=st.lists(st.floats(0.5, 4.0), min_size=50, max_size=150))
def test_no_starvation_under_promotion(gaps: list[float]) -> None:
    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    pauses = _simulate_starvation(20.0, arrivals)
    for wait, backlog in pauses:
        # promote_after_s (+1: promotion is checked once a step), then, at level 0 and older
        # than every later arrival, the running short (<= 2 steps) and the shorts queued when
        # it paused (2 steps each).
        assert wait <= 20.0 + 1 + 2 + 2 * backlog


def test_without_promotion_a_steady_stream_starves_the_long_request() -> None:
    arrivals = [1.0 + 2.0 * i for i in range(200)]
    starved = max(wait for wait, _ in _simulate_starvation(1e9, arrivals))
    promoted = max(wait for wait, _ in _simulate_starvation(20.0, arrivals))
    assert starved > 300 > 60 > promoted


# --------------------------------------------------------------------------------------------
# Thread stress
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_thread_stress_shared_tracker() -> None:
    t = SliceTracker("mlfq", {"base_quantum": 8, "levels": 3}, cost_model=COST)
    for name in ENDPOINTS:
        t.set_endpoint(name)
    per_thread, threads_n = 150, 8
    finished: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    short = [WaitingRequest(0, 0, 50, 3)]
    barrier = threading.Barrier(threads_n + 1, timeout=30)  # workers and churn start at once

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            done_tokens = 0
            for j in range(per_thread):
                rid = tid * 1_000_000 + j
                max_tokens = 20 + (j % 50)
                start = t.admit(rid, prompt_tokens=j, max_tokens=max_tokens, endpoint="a")
                budget, generated = start.slice_tokens, 0
                while True:
                    t.record_tokens(rid, budget)
                    generated += budget
                    d = t.decide(rid, waiting=short if j % 2 else (), now=float(j))
                    if d.action == "finish":
                        assert d.generated_tokens == generated == max_tokens
                        done_tokens += generated
                        break
                    budget = d.next_slice_tokens
                    if d.action != "continue":
                        budget = t.resume(rid, endpoint=ENDPOINTS[j % 3]).slice_tokens
            with lock:
                finished.append(done_tokens)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def churn() -> None:
        barrier.wait()
        for i in range(300):
            t.set_endpoint(ENDPOINTS[i % 3], kv_cache_usage=(i % 10) / 10, waiting=i % 2)
            t.promote(now=float(i))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    threads.append(threading.Thread(target=churn))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=50)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors
    expected = sum(20 + (j % 50) for j in range(per_thread))
    assert finished == [expected] * threads_n
    assert len(t) == 0


def test_top_level_exports() -> None:
    assert llmsched.SliceTracker is SliceTracker
    assert issubclass(llmsched.SliceStateError, ValueError)
    assert issubclass(llmsched.UnknownRequestError, KeyError)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("endpoint", lambda t: t.set_endpoint("a\ud800")),
        ("endpoint", lambda t: t.admit(2, prompt_tokens=5, max_tokens=5, endpoint="a\ud800")),
        ("endpoint", lambda t: t.endpoint_load("a\ud800")),
        (r"endpoints\[1\]", lambda t: SliceTracker("fixed", endpoints=["b", "a\ud800"])),
    ],
)
def test_a_lone_surrogate_endpoint_is_named_and_changes_nothing(argument: str, call: Any) -> None:
    """Probe 49 F2: a bare UnicodeEncodeError from the native conversion."""
    tracker = SliceTracker("fixed", endpoints=["a"])
    tracker.admit(1, prompt_tokens=5, max_tokens=5, endpoint="a")
    before = (tracker.endpoints, len(tracker))
    with pytest.raises(InvalidValueError, match=f"^{argument} must be valid UTF-8"):
        call(tracker)
    assert (tracker.endpoints, len(tracker)) == before
