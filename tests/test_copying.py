"""Every public class has one decision for ``pickle``, ``copy.copy`` and ``copy.deepcopy``
(``llmsched._copying``): rebuilt from its plain state, or refused with ``NotPicklableError``
(a ``TypeError``) naming the class and what to use instead. Probe 60: each native class
raised CPython's bare ``TypeError: cannot pickle 'builtins.X' object``, and ``copy.copy`` of a
wrapper (a ``Router``) shared its native half."""

from __future__ import annotations

import ast
import copy
import copyreg
import dataclasses
import importlib
import inspect
import pickle
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import llmsched
import llmsched.gateway
import llmsched.integrations
from llmsched import _llmsched
from llmsched._copying import DECISIONS
from llmsched.errors import FlowRejected, NotPicklableError
from llmsched.flow import FlowController, FlowRequest, Outcome
from llmsched.prefix_index import PrefixIndex
from llmsched.routing import Endpoint, EndpointPool, Router
from llmsched.scheduler import Scheduler, ScheduleRequest
from llmsched.slices import (
    SliceAssembler,
    SliceStart,
    SliceTracker,
    SliceUsage,
    SwitchCostModel,
    WaitingRequest,
)

PACKAGE = Path(llmsched.__file__).parent
CORE_MODULES = ("llmsched", "llmsched.flow", "llmsched.routing", "llmsched.slices")
CORE_MODULES += ("llmsched.prefix_index", "llmsched.scheduler")


def _native_class_names(tree: ast.Module) -> set[str]:
    """The names a module binds to the native module or to one of its classes."""
    names = {"_llmsched"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "llmsched._llmsched":
            names |= {a.asname or a.name for a in node.names if _is_native_class(a.name)}
    return names


def _is_native_class(name: str) -> bool:
    return inspect.isclass(getattr(_llmsched, name, None))


def _reads_native_class(cls_node: ast.ClassDef, names: set[str]) -> bool:
    for node in ast.walk(cls_node):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "_llmsched" and _is_native_class(node.attr):
                return True
        elif isinstance(node, ast.Name) and node.id in names - {"_llmsched"}:
            return True
    return False


def _native_backed() -> Iterator[type]:
    """Every public class of the package whose body uses a native class (a wrapper)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = _native_class_names(tree)
        for node in tree.body:
            public = isinstance(node, ast.ClassDef) and not node.name.startswith("_")
            if public and _reads_native_class(node, names):
                yield getattr(_module_of(path), node.name)


def _module_of(path: Path) -> object:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return importlib.import_module(".".join(p for p in parts if p != "__init__"))


def _exported() -> Iterator[type]:
    """The classes the package and its core modules export, less exceptions and TypedDicts."""
    for name in CORE_MODULES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if not inspect.isclass(obj) or typing.is_typeddict(obj):
                continue
            if not issubclass(obj, BaseException):
                yield obj


def public_classes() -> set[type]:
    """The classes that need a decision: the native module's, the exported ones and every
    public wrapper of a native class anywhere in the package."""
    native = {obj for obj in vars(_llmsched).values() if inspect.isclass(obj)}
    return native | set(_exported()) | set(_native_backed())


def test_every_public_class_has_a_copy_decision() -> None:
    """A new class (native, exported, or wrapping a native one) fails here until it has a
    decision in ``llmsched._copying``: by value, by default or refused."""
    missing = sorted(f"{c.__module__}.{c.__qualname__}" for c in public_classes() - set(DECISIONS))
    assert missing == []
    assert {_llmsched.Router, llmsched.Router, llmsched.FlowDecision} <= set(DECISIONS)


def _flow_decision(payload: object) -> _llmsched.FlowDecision:
    ctrl = FlowController({"saturation": {"type": "concurrency", "max_requests": 1}})
    ctrl.enqueue(FlowRequest(3, priority=2, tenant="t\u00e9", prompt_tokens=5, payload=payload))
    decision = ctrl.dispatch(now=1.0)
    assert decision is not None
    return decision


def _tracker() -> SliceTracker:
    tracker = SliceTracker("mlfq", {"base_quantum": 8, "levels": 3}, endpoints=["a"])
    tracker.admit(7, prompt_tokens=20, max_tokens=100, endpoint="a")
    tracker.record_tokens(7, 8)
    return tracker


def _slice_decision() -> _llmsched.SliceDecision:
    waiting = [WaitingRequest(priority=0, level=0, context_tokens=30, expected_tokens=2)]
    return _tracker().decide(7, waiting=waiting, now=1.0)


def _paused_state() -> _llmsched.SliceState:
    tracker = _tracker()
    waiting = [WaitingRequest(priority=0, level=0, context_tokens=30, expected_tokens=2)]
    assert tracker.decide(7, waiting=waiting, now=1.0).action == "yield"
    state = tracker.state(7)
    assert state is not None and state.phase == "paused"
    return state


def _endpoint_load() -> _llmsched.EndpointLoad:
    load = _tracker().endpoint_load("a")
    assert load is not None
    return load


def _index() -> PrefixIndex:
    index = PrefixIndex(block_size=2)
    index.store("w", index.hash_tokens([1, 2, 3, 4]))
    return index


def _router() -> Router:
    return Router(EndpointPool(["a", "b"]), config="least-load")


def _explanation() -> llmsched.routing.Explanation:
    return _router().pick([1, 2, 3]).explain()


def _scheduler() -> Scheduler:
    return Scheduler(["a", "b"], router="least-load")


SAMPLES: dict[type, Callable[[], object]] = {
    _llmsched.Outcome: lambda: Outcome.EVICTED_TTL,
    FlowRejected: lambda: FlowRejected(7, Outcome.EVICTED_TTL, retry_after_s=2.5),
    _llmsched.FlowDecision: lambda: _flow_decision({"messages": [1, [2]]}),
    _llmsched.SliceDecision: _slice_decision,
    _llmsched.SliceState: _paused_state,
    _llmsched.EndpointLoad: _endpoint_load,
    _llmsched.SwitchCostModel: lambda: SwitchCostModel(decode_step_s=0.03).native,
    SwitchCostModel: lambda: SwitchCostModel(decode_step_s=0.03, block_size=32),
    PrefixIndex: _index,
    FlowRequest: lambda: FlowRequest(1, priority=-1, tenant="batch", payload=[1]),
    ScheduleRequest: lambda: ScheduleRequest(tokens=[1, 2, 3], tenant="t", priority=4),
    WaitingRequest: lambda: WaitingRequest(0, 1, 30, 2),
    SliceStart: lambda: SliceStart(1, 16),
    SliceUsage: lambda: SliceUsage(1, 2, 3, 4, 5, 6),
    Endpoint: lambda: Endpoint("a", model="m"),
    llmsched.routing.EndpointScores: lambda: _explanation().profiles[0].rows[0],
    llmsched.routing.ProfileExplanation: lambda: _explanation().profiles[0],
    llmsched.routing.Explanation: _explanation,
    # Refused: live native state.
    _llmsched.PrefixIndex: lambda: _index()._native,
    _llmsched.PrefixMatch: lambda: _index().match_tokens([1, 2, 3, 4]),
    _llmsched.EndpointPool: lambda: EndpointPool(["a"])._native,
    _llmsched.Router: lambda: _router()._native,
    _llmsched.Decision: lambda: _router().pick([1, 2])._native,
    _llmsched.FlowCore: lambda: FlowController()._core,
    _llmsched.SliceTracker: lambda: _tracker()._native,
    _llmsched.SliceAssembler: lambda: SliceAssembler({"prompt": [1], "max_tokens": 2})._native,
    EndpointPool: lambda: EndpointPool(["a"]),
    Router: _router,
    llmsched.Decision: lambda: _router().pick([1, 2]),
    FlowController: FlowController,
    SliceTracker: _tracker,
    SliceAssembler: lambda: SliceAssembler({"prompt": [1], "max_tokens": 2}),
    Scheduler: _scheduler,
    llmsched.Admission: lambda: _scheduler().admit_sync(ScheduleRequest(tokens=[1])),
    llmsched.Placement: lambda: _scheduler().schedule_sync(ScheduleRequest(tokens=[1])),
}
"""An instance of each class with a decision; a class missing here is checked through its
registered reduction alone (native servers and subscribers that need a socket or a file)."""

NO_SAMPLE = {
    _llmsched.ReplicaSync,
    _llmsched.KvCache,
    _llmsched.PlanContents,
    _llmsched.NativeKVEventSubscriber,
    _llmsched.NativeGateway,
    _llmsched.NativePromptTokenizer,
    llmsched.integrations.KVEventSubscriber,
    llmsched.integrations.NativeKVEventSubscriber,
    llmsched.gateway.NativeGateway,
}


def _state(obj: object) -> object:
    """What a copy must equal: the arguments of the registered reduction, else the fields."""
    reduce = copyreg.dispatch_table.get(type(obj))
    if reduce is not None:
        return reduce(obj)[1]
    if dataclasses.is_dataclass(obj):
        return repr(obj)
    if isinstance(obj, BaseException):
        return obj.args, vars(obj)
    return obj


def _names(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@pytest.mark.parametrize("cls", sorted(DECISIONS, key=_names), ids=_names)
def test_a_value_round_trips_and_a_handle_refuses_by_name(cls: type) -> None:
    assert cls in SAMPLES or cls in NO_SAMPLE
    if cls not in SAMPLES:
        with pytest.raises(NotPicklableError, match=cls.__qualname__):
            copyreg.dispatch_table[cls](object())
        assert DECISIONS[cls] == "refused"
        return
    obj = SAMPLES[cls]()
    assert type(obj) is cls
    if DECISIONS[cls] == "refused":
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(NotPicklableError, match=f"{cls.__qualname__} .*: .+") as info:
                attempt(obj)
            assert isinstance(info.value, TypeError)
        return
    for again in (pickle.loads(pickle.dumps(obj)), copy.copy(obj), copy.deepcopy(obj)):
        assert type(again) is cls
        assert _state(again) == _state(obj)


def test_a_flow_decision_keeps_every_field_and_deep_copies_its_payload() -> None:
    decision = _flow_decision({"messages": [1, [2]]})
    again = pickle.loads(pickle.dumps(decision))
    fields = ("id", "outcome", "priority", "tenant", "prompt_tokens", "size_bytes", "wait_s")
    fields += ("payload", "ticket", "http_status", "reason")
    assert [getattr(again, f) for f in fields] == [getattr(decision, f) for f in fields]
    assert copy.deepcopy(decision).payload is not decision.payload
    assert copy.copy(decision).payload is decision.payload


def test_a_slice_state_keeps_its_phase_and_a_load_its_free_tokens() -> None:
    state = copy.deepcopy(_paused_state())
    assert (state.phase, state.paused_since) == ("paused", 1.0)
    load = _endpoint_load()
    assert pickle.loads(pickle.dumps(load)).kv_free_tokens == load.kv_free_tokens


@pytest.mark.parametrize(
    ("args", "problem", "kind"),
    [
        ((1, Outcome.DISPATCHED, True, "t", 1, 1, 0.0, None, None), "priority", TypeError),
        ((-1, Outcome.DISPATCHED, 0, "t", 1, 1, 0.0, None, None), "id", ValueError),
        ((1, Outcome.DISPATCHED, 2**40, "t", 1, 1, 0.0, None, None), "priority", ValueError),
        ((1, Outcome.DISPATCHED, 0, "t", 1, 1, float("nan"), None, None), "wait_s", ValueError),
        ((1, "dispatched", 0, "t", 1, 1, 0.0, None, None), "outcome", TypeError),
        ((1, Outcome.DISPATCHED, 0, "\ud800", 1, 1, 0.0, None, None), "tenant", ValueError),
    ],
)
def test_rebuilding_a_native_value_names_a_bad_field(
    args: tuple[object, ...], problem: str, kind: type[Exception]
) -> None:
    with pytest.raises(kind, match=f"FlowDecision: {problem}") as info:
        _llmsched.FlowDecision(*args)
    assert isinstance(info.value, llmsched.LlmschedError)


def test_rebuilding_a_native_value_from_too_few_fields_names_them() -> None:
    with pytest.raises(llmsched.InvalidTypeError, match=r"takes its 5 fields .*waiting.*got 4"):
        _llmsched.EndpointLoad(1.0, 0.5, 2, 3.0)


def test_an_unknown_slice_action_is_refused_by_name() -> None:
    fields = copyreg.dispatch_table[_llmsched.SliceDecision](_slice_decision())[1]
    with pytest.raises(llmsched.InvalidValueError, match="action must be one of"):
        _llmsched.SliceDecision("jump", *fields[1:])


def test_an_explanation_with_omitted_rows_refuses_and_one_with_every_row_copies() -> None:
    """Its omitted rows are built on demand from the router's live decision (a closure):
    pickling it raised a bare "Can't pickle local object"."""
    decision = Router(EndpointPool([f"e{i}" for i in range(4)]), config="least-load").pick([1])
    with pytest.raises(NotPicklableError, match="explain\\(limit=None\\)"):
        pickle.dumps(decision.explain(limit=1))
    full = decision.explain(limit=None)
    assert pickle.loads(pickle.dumps(full)) == full
