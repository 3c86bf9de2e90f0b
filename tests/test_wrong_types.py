"""Every public entry point, given a value of the wrong type for each argument in turn, raises
an exception from :mod:`llmsched.errors` (a ``TypeError`` or a ``ValueError``) whose message
names the argument, and leaves the structure it was called on as it was.

Each entry below lists one call with valid arguments, the kind of each argument, and what of
the structure can be observed; the wrong values for a kind are those of ``WRONG`` it does not
accept. A test id reads ``entry-argument-wrong value``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import llmsched
from llmsched import (
    Endpoint,
    EndpointPool,
    FlowController,
    FlowRequest,
    PrefixIndex,
    Router,
    SliceAssembler,
    SliceTracker,
    SwitchCostModel,
    WaitingRequest,
    validation,
)
from llmsched.errors import LlmschedError
from llmsched.scheduler import Scheduler, ScheduleRequest
from llmsched.slices import evict_probability, policy_defaults

WRONG: dict[str, Any] = {
    "None": None,
    "object": object(),
    "str": "x",
    "float": 1.5,
    "bytes": b"x",
    "list": [object()],
    "dict": {},
    "bool": True,  # an int to Python, read by the native layer as 1 (an id, a count, seconds)
    # Probe 75: numpy's bool is no int subclass but has __float__: read as 1.0 where seconds,
    # a rate or a share belong.
    "np_bool": np.True_,
}
"""The wrong values tried, by the name that ends a test id."""

ACCEPTS: dict[str, set[str]] = {
    # The values of WRONG each kind of argument accepts (as a type: a value refused as out of
    # range is fine here too, but is not probed).
    "int": set(),
    "opt_int": {"None"},
    "str": {"str"},
    "opt_str": {"None", "str"},
    "num": {"float"},
    "opt_num": {"None", "float"},
    "id": {"str"},
    "opt_id": {"None", "str"},
    "bool": {"bool", "np_bool"},  # a flag may be numpy's (not probed: either is fine)
    "bytes": {"bytes"},
    "text": {"str", "bytes"},
    "ints": {"dict"},  # token ids or hashes: an empty dict is an empty iterable
    "prompt": {"str"},  # a completion prompt: text or token ids
    "opt_ints": {"None", "dict"},
    "many": {"dict"},  # an iterable of queries or prompts
    "strs": {"str", "dict"},  # an iterable of str: "x" is ["x"]
    "endpoints": {"dict"},  # an iterable of endpoints or ids (not a single str)
    "mapping": {"dict"},
    "opt_mapping": {"None", "dict"},
    "config": {"str", "dict"},  # a preset name, YAML text or a path, or a mapping
    "opt_config": {"None", "str", "dict"},
    "callable": set(),
    "seed": {"None", "str"},  # an int for xxh3, a str for vLLM's hash (each refuses the other)
    "opt_seed_str": {"None", "str"},
    "opt_index": {"None"},
    "pool": set(),
    "request": set(),
    "messages": set(),
    "opt_side": {"None"},  # "left", "right" or None: "x" is refused too, as out of range
}


def _fields(obj: object) -> dict[str, Any] | None:
    """The public attributes of a native snapshot object (which has no ``__eq__``)."""
    if obj is None:
        return None
    names = (n for n in dir(obj) if not n.startswith("_"))
    return {n: v for n in names if not callable(v := getattr(obj, n))}


def _endpoints_and_loads(tracker: SliceTracker) -> Any:
    return [(name, _fields(tracker.endpoint_load(name))) for name in tracker.endpoints]


@dataclass
class Entry:
    """One public call. ``make`` builds a fresh structure and returns it with a function that
    snapshots its observable state (None for a function); ``call(structure, **args)`` makes
    the call."""

    name: str
    call: Callable[..., Any]
    valid: dict[str, Any]
    kinds: dict[str, str]
    make: Callable[[], tuple[Any, Callable[[Any], Any] | None]] = lambda: (None, None)
    named: dict[str, str] = field(default_factory=dict)  # argument -> word its message names
    xfail: str | None = None


def index_structure() -> tuple[PrefixIndex, Callable[[PrefixIndex], Any]]:
    index = PrefixIndex(block_size=2)
    index.store("w", index.hash_tokens([1, 2, 3, 4, 5, 6]))
    index.store(3, index.hash_tokens([1, 2]), tier="cpu")
    return index, lambda ix: (ix.stats(), ix.workers(), ix.holdings("w"), ix.dumps())


HASHES = [int(h) for h in PrefixIndex(block_size=2).hash_tokens([1, 2, 3, 4, 5, 6])]


def pool_structure() -> tuple[EndpointPool, Callable[[EndpointPool], Any]]:
    pool = EndpointPool([Endpoint("a", address="h:1"), "b"])
    pool.update("a", waiting=1, running=2, kv_cache_usage=0.5, now=1.0)
    return pool, lambda p: (len(p), p.endpoints())


def router_structure() -> tuple[Router, Callable[[Router], Any]]:
    pool, _ = pool_structure()
    index, _ = index_structure()
    router = Router(pool, index, config="prefix-only", seed=1)
    return router, lambda r: (
        r.pool.endpoints(),
        r.index.stats(),
        r.index.dumps(),
        r.stats(),
    )


def decision_structure() -> tuple[Any, Callable[[Any], Any]]:
    router, state = router_structure()
    decision = router.pick(tokens=[1, 2, 3, 4], now=2.0)
    return decision, lambda d: (d.stage, state(router))


FLOW_CONFIG = {"saturation": {"type": "concurrency", "max_requests": 4}}


def flow_structure() -> tuple[FlowController, Callable[[FlowController], Any]]:
    ctrl = FlowController(FLOW_CONFIG, clock=lambda: 5.0)
    ctrl.enqueue(FlowRequest(1, tenant="t", prompt_tokens=3), now=1.0)
    ctrl.dispatch(now=1.0)
    ctrl.enqueue(FlowRequest(2, tenant="u"), now=1.0)
    ctrl.update_endpoint("e", waiting=1, kv_cache_usage=0.1, timestamp=1.0)
    return ctrl, lambda c: (len(c), c.running_count(), c.is_queued(2), c.metrics(now=5.0))


def tracker_structure() -> tuple[SliceTracker, Callable[[SliceTracker], Any]]:
    tracker = SliceTracker("mlfq", {"base_quantum": 8, "levels": 3}, endpoints=["a"])
    tracker.admit(7, prompt_tokens=20, max_tokens=100, endpoint="a")
    tracker.record_tokens(7, 8)  # at its slice boundary
    return tracker, lambda t: (len(t), _fields(t.state(7)), _endpoints_and_loads(t))


def paused_tracker_structure() -> tuple[SliceTracker, Callable[[SliceTracker], Any]]:
    tracker, state = tracker_structure()
    tracker.decide(7, waiting=[WaitingRequest(0, 0, 30, 2)], now=1.0)  # yields: paused
    return tracker, state


def assembler_structure() -> tuple[SliceAssembler, Callable[[SliceAssembler], Any]]:
    asm = SliceAssembler({"model": "m", "prompt": [1, 2], "max_tokens": 6}, response_id="r")
    asm.next_request(2)
    asm.feed({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6]}]})
    return asm, lambda a: (
        a.generated_tokens,
        a.generated_token_ids,
        a.text,
        a.done,
        a.remaining_tokens,
        a.usage,
        a.next_request(2),
    )


def cost_structure() -> tuple[SwitchCostModel, Callable[[SwitchCostModel], Any]]:
    return SwitchCostModel(decode_step_s=0.02), lambda m: m.to_dict()


def scheduler_structure() -> tuple[Scheduler, Callable[[Scheduler], Any]]:
    scheduler = Scheduler(["a", "b"], router="round-robin")
    return scheduler, lambda s: (sorted(s.engines), s.draining, s.pool.endpoints(), s.stats())


def _tokenizer_dir() -> Path:
    import tempfile

    from llmsched.testing.openai_engine import write_tokenizer

    directory = Path(tempfile.mkdtemp(prefix="llmsched-wrong-types-"))
    return write_tokenizer(directory)


_TOKENIZER: list[Any] = []


def tokenizer_structure() -> tuple[Any, None]:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from llmsched.tokenize import PromptTokenizer

    if not _TOKENIZER:
        _TOKENIZER.append(PromptTokenizer(_tokenizer_dir()))
    return _TOKENIZER[0], None


def _new_tokenizer(**kwargs: Any) -> Any:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from llmsched.tokenize import PromptTokenizer

    return PromptTokenizer(_tokenizer_dir(), **kwargs)


TOKENS = [1, 2, 3, 4]
MESSAGES = [{"role": "user", "content": "hi"}]
PAYLOAD = msgpack.packb(
    [
        0.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [9, 9],
                "block_size": 2,
            }
        ],
        None,
    ]
)

ENTRIES = [
    # -- PrefixIndex ---------------------------------------------------------------------------
    Entry(
        "PrefixIndex",
        lambda _, **kw: PrefixIndex(**kw),
        {"block_size": 4, "seed": 0, "model": "m", "worker_capacity": 10, "max_bytes": 10**6},
        {
            "block_size": "int",
            "seed": "int",
            "model": "opt_str",
            "worker_capacity": "opt_int",
            "max_bytes": "opt_int",
        },
    ),
    Entry(
        "PrefixIndex.hash_tokens",
        lambda ix, **kw: ix.hash_tokens(**kw),
        {"tokens": TOKENS, "lora": "l", "cache_salt": "s"},
        {"tokens": "ints", "lora": "opt_str", "cache_salt": "opt_str"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.hash_text",
        lambda ix, **kw: ix.hash_text(**kw),
        {"text": "abcdefgh", "lora": "l", "cache_salt": "s"},
        {"text": "text", "lora": "opt_str", "cache_salt": "opt_str"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.store",
        lambda ix, **kw: ix.store(**kw),
        {"worker": "v", "hashes": HASHES[:1], "parent": None, "tier": "gpu"},
        {"worker": "id", "hashes": "ints", "parent": "opt_int", "tier": "str"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.record",
        lambda ix, **kw: ix.record(**kw),
        {"worker": "v", "hashes": HASHES, "ttl_s": 5.0, "now": 1.0},
        {"worker": "id", "hashes": "ints", "ttl_s": "num", "now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.remove",
        lambda ix, **kw: ix.remove(**kw),
        {"worker": "w", "hashes": HASHES[2:], "tier": None},
        {"worker": "id", "hashes": "ints", "tier": "opt_str"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.clear",
        lambda ix, **kw: ix.clear(**kw),
        {"worker": "w"},
        {"worker": "id"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.remove_worker",
        lambda ix, **kw: ix.remove_worker(**kw),
        {"worker": "w"},
        {"worker": "id"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.set_capacity",
        lambda ix, **kw: ix.set_capacity(**kw),
        {"worker": "w", "blocks": 2},
        {"worker": "id", "blocks": "opt_int"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.match",
        lambda ix, **kw: ix.match(**kw),
        {"hashes": HASHES, "now": 1.0},
        {"hashes": "ints", "now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.match_tokens",
        lambda ix, **kw: ix.match_tokens(**kw),
        {"tokens": TOKENS, "lora": None, "cache_salt": None, "now": 1.0},
        {"tokens": "ints", "lora": "opt_str", "cache_salt": "opt_str", "now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.match_many",
        lambda ix, **kw: ix.match_many(**kw),
        {"queries": [HASHES], "now": 1.0},
        {"queries": "many", "now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.match_tokens_many",
        lambda ix, **kw: ix.match_tokens_many(**kw),
        {"prompts": [TOKENS], "lora": None, "cache_salt": None, "now": 1.0},
        {"prompts": "many", "lora": "opt_str", "cache_salt": "opt_str", "now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.apply_vllm_events",
        lambda ix, **kw: ix.apply_vllm_events(**kw),
        {"worker": "e", "payload": PAYLOAD},
        {"worker": "id", "payload": "bytes"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.note_block_size_mismatch",
        lambda ix, **kw: ix.note_block_size_mismatch(**kw),
        {"worker": "w", "skipped": 1},
        {"worker": "id", "skipped": "int"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.note_extra_keys",
        lambda ix, **kw: ix.note_extra_keys(**kw),
        {"worker": "w", "skipped": 1},
        {"worker": "id", "skipped": "int"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.note_multimodal",
        lambda ix, **kw: ix.note_multimodal(**kw),
        {"worker": "w", "skipped": 1},
        {"worker": "id", "skipped": "int"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.expire",
        lambda ix, **kw: ix.expire(**kw),
        {"now": 1.0},
        {"now": "opt_num"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.holdings",
        lambda ix, **kw: ix.holdings(**kw),
        {"worker": "w"},
        {"worker": "id"},
        index_structure,
    ),
    Entry(
        "PrefixIndex.loads",
        lambda _, **kw: PrefixIndex.loads(**kw),
        {"data": PrefixIndex(block_size=2).dumps()},
        {"data": "bytes"},
    ),
    # -- EndpointPool, Endpoint ----------------------------------------------------------------
    Entry(
        "EndpointPool",
        lambda _, **kw: EndpointPool(**kw),
        {"endpoints": ["a"], "stale_after_s": 1.0, "stale_policy": "ignore"},
        {"endpoints": "endpoints", "stale_after_s": "opt_num", "stale_policy": "opt_str"},
    ),
    Entry(
        "EndpointPool.add",
        lambda p, **kw: p.add(**kw),
        {"endpoint": "c"},
        {"endpoint": "id"},
        pool_structure,
    ),
    Entry(
        "EndpointPool.add(Endpoint)",
        lambda p, **kw: p.add(Endpoint(**kw)),
        {"id": "c", "address": "h:2", "role": "decode", "labels": {"z": "1"}, "model": "m"},
        {
            "id": "id",
            "address": "str",
            "role": "opt_str",
            "labels": "mapping",
            "model": "opt_str",
        },
        pool_structure,
    ),
    Entry(
        "EndpointPool.remove",
        lambda p, **kw: p.remove(**kw),
        {"endpoint_id": "b"},
        {"endpoint_id": "id"},
        pool_structure,
        named={"endpoint_id": "endpoint"},
    ),
    Entry(
        "EndpointPool.update",
        lambda p, **kw: p.update(**kw),
        {
            "endpoint_id": "b",
            "waiting": 1,
            "running": 1,
            "kv_cache_usage": 0.25,
            "max_concurrency": 8,
            "now": 2.0,
        },
        {
            "endpoint_id": "id",
            "waiting": "opt_int",
            "running": "opt_int",
            "kv_cache_usage": "opt_num",
            "max_concurrency": "opt_int",
            "now": "opt_num",
        },
        pool_structure,
        named={"endpoint_id": "endpoint"},
    ),
    Entry(
        "EndpointPool.set_loras",
        lambda p, **kw: p.set_loras(**kw),
        {"endpoint_id": "b", "active": ["l1"], "waiting": ["l2"], "max_loras": 2},
        {"endpoint_id": "id", "active": "strs", "waiting": "strs", "max_loras": "int"},
        pool_structure,
        named={"endpoint_id": "endpoint"},
    ),
    Entry(
        "EndpointPool.update_from_metrics_text",
        lambda p, **kw: p.update_from_metrics_text(**kw),
        {"endpoint_id": "b", "text": "vllm:num_requests_waiting 7.0\n", "now": 2.0},
        {"endpoint_id": "id", "text": "str", "now": "opt_num"},
        pool_structure,
        named={"endpoint_id": "endpoint"},
    ),
    # -- Router, Decision ----------------------------------------------------------------------
    Entry(
        "Router",
        lambda _, **kw: Router(**kw),
        {
            "pool": EndpointPool(["a"]),
            "index": None,
            "config": "prefix-only",
            "seed": 1,
            "record_ttl_s": 5.0,
            "session_ttl_s": 60.0,
            "max_sessions": 10,
            "allow_pseudo_tokens": True,
        },
        {
            "pool": "pool",
            "index": "opt_index",
            "config": "config",
            "seed": "opt_int",
            "record_ttl_s": "opt_num",
            "session_ttl_s": "opt_num",
            "max_sessions": "opt_int",
            "allow_pseudo_tokens": "bool",
        },
    ),
    Entry(
        "Router.pick(tokens)",
        lambda r, **kw: r.pick(**kw),
        {
            "tokens": TOKENS,
            "model": None,
            "lora": "l",
            "priority": 1,
            "session_id": "s",
            "headers": {"h": "v"},
            "cache_salt": "c",
            "now": 2.0,
        },
        {
            "tokens": "ints",
            "model": "opt_str",
            "lora": "opt_str",
            "priority": "int",
            "session_id": "opt_str",
            "headers": "opt_mapping",
            "cache_salt": "opt_str",
            "now": "opt_num",
        },
        router_structure,
    ),
    Entry(
        "Router.pick(text)",
        lambda r, **kw: r.pick(**kw),
        {"text": "hello world", "now": 2.0},
        {"text": "text"},
        router_structure,
    ),
    Entry(
        "Router.pick(messages)",
        lambda r, **kw: r.pick(**kw),
        {"messages": MESSAGES, "now": 2.0},
        {"messages": "messages"},
        router_structure,
    ),
    Entry(
        "Router.replica_sync",
        lambda r, **kw: r.replica_sync(**kw),
        {
            "replica": "r1",
            "incarnation": 1,
            "journal_limit": 100,
            "load_ttl_s": 5.0,
            "history_limit": 100,
        },
        {
            "replica": "str",
            "incarnation": "int",
            "journal_limit": "int",
            "load_ttl_s": "num",
            "history_limit": "int",
        },
        router_structure,
    ),
    Entry(
        "Decision.started",
        lambda d, **kw: d.started(**kw),
        {"endpoint": None, "now": 3.0},
        {"endpoint": "opt_id", "now": "opt_num"},
        decision_structure,
    ),
    # -- FlowController, FlowRequest -----------------------------------------------------------
    Entry(
        "FlowController",
        lambda _, **kw: FlowController(**kw),
        {"config": FLOW_CONFIG, "clock": lambda: 1.0, "poll_interval_s": 0.5},
        {"config": "opt_config", "clock": "callable", "poll_interval_s": "num"},
    ),
    Entry(
        "FlowController.enqueue",
        lambda c, **kw: c.enqueue(**kw),
        {"request": FlowRequest(3), "now": 2.0},
        {"request": "request", "now": "opt_num"},
        flow_structure,
    ),
    Entry(
        "FlowController.enqueue(FlowRequest)",
        lambda c, **kw: c.enqueue(FlowRequest(**kw), now=2.0),
        {
            "id": 3,
            "priority": 1,
            "tenant": "t",
            "prompt_tokens": 5,
            "size_bytes": 10,
            "deadline": 9.0,
            "ttft_target": 1.0,
        },
        {
            "id": "int",
            "priority": "int",
            "tenant": "str",
            "prompt_tokens": "int",
            "size_bytes": "int",
            "deadline": "opt_num",
            "ttft_target": "opt_num",
        },
        flow_structure,
    ),
    Entry(
        "FlowController.admit",
        lambda c, **kw: asyncio.run(c.admit(**kw)),
        {"request": FlowRequest(3)},
        {"request": "request"},
        flow_structure,
    ),
    *(
        Entry(
            f"FlowController.{method}",
            lambda c, method=method, **kw: getattr(c, method)(**kw),
            {"now": 2.0},
            {"now": "opt_num"},
            flow_structure,
        )
        for method in (
            "dispatch",
            "expire",
            "preemption_victims",
            "saturation",
            "metrics",
            "pump",
            "poll",
        )
    ),
    *(
        Entry(
            f"FlowController.{method}",
            lambda c, method=method, **kw: getattr(c, method)(**kw),
            {"request_id": 1, "output_tokens": 2, "now": 2.0},
            {"request_id": "int", "output_tokens": "int", "now": "opt_num"},
            flow_structure,
        )
        for method in ("complete", "record_output")
    ),
    Entry(
        "FlowController.cancel",
        lambda c, **kw: c.cancel(**kw),
        {"request_id": 2, "now": 2.0},
        {"request_id": "int", "now": "opt_num"},
        flow_structure,
    ),
    *(
        Entry(
            f"FlowController.{method}",
            lambda c, method=method, **kw: getattr(c, method)(**kw),
            {"request_id": 2},
            {"request_id": "int"},
            flow_structure,
        )
        for method in ("is_queued", "is_running")
    ),
    Entry(
        "FlowController.charge_remote",
        lambda c, **kw: c.charge_remote(**kw),
        {"tenant": "u", "priority": 0, "prompt_tokens": 1, "output_tokens": 1, "now": 2.0},
        {
            "tenant": "str",
            "priority": "int",
            "prompt_tokens": "int",
            "output_tokens": "int",
            "now": "opt_num",
        },
        flow_structure,
    ),
    Entry(
        "FlowController.update_endpoint",
        lambda c, **kw: c.update_endpoint(**kw),
        {"endpoint": "e", "waiting": 2, "running": 1, "kv_cache_usage": 0.5, "timestamp": 2.0},
        {
            "endpoint": "str",
            "waiting": "int",
            "running": "int",
            "kv_cache_usage": "num",
            "timestamp": "opt_num",
        },
        flow_structure,
    ),
    Entry(
        "FlowController.remove_endpoint",
        lambda c, **kw: c.remove_endpoint(**kw),
        {"endpoint": "e"},
        {"endpoint": "str"},
        flow_structure,
    ),
    Entry(
        "FlowController.jain_index",
        lambda c, **kw: c.jain_index(**kw),
        {"priority": 0},
        {"priority": "opt_int"},
        flow_structure,
    ),
    # -- SliceTracker, SwitchCostModel ---------------------------------------------------------
    Entry(
        "SliceTracker",
        lambda _, **kw: SliceTracker(**kw),
        {"policy": "fixed", "params": None, "cost_model": None, "endpoints": ["a"]},
        {
            "policy": "str",
            "params": "opt_mapping",
            "cost_model": "opt_index",
            "endpoints": "strs",
        },
    ),
    Entry(
        "SliceTracker.quantum",
        lambda t, **kw: t.quantum(**kw),
        {"level": 1},
        {"level": "int"},
        tracker_structure,
    ),
    Entry(
        "SliceTracker.entry_level",
        lambda t, **kw: t.entry_level(**kw),
        {"prompt_tokens": 10},
        {"prompt_tokens": "int"},
        tracker_structure,
    ),
    Entry(
        "SliceTracker.remove_endpoint",
        lambda t, **kw: t.remove_endpoint(**kw),
        {"name": "a"},
        {"name": "str"},
        tracker_structure,
    ),
    Entry(
        "SliceTracker.set_endpoint",
        lambda t, **kw: t.set_endpoint(**kw),
        {
            "name": "a",
            "kv_cache_usage": 0.5,
            "waiting": 1,
            "kv_capacity_tokens": 1000.0,
            "prefill_tokens_per_s": 100.0,
            "decode_step_s": 0.01,
        },
        {
            "name": "str",
            "kv_cache_usage": "num",
            "waiting": "int",
            "kv_capacity_tokens": "opt_num",
            "prefill_tokens_per_s": "opt_num",
            "decode_step_s": "opt_num",
        },
        tracker_structure,
        named={"name": "endpoint"},
    ),
    Entry(
        "SliceTracker.endpoint_load",
        lambda t, **kw: t.endpoint_load(**kw),
        {"name": "a"},
        {"name": "str"},
        tracker_structure,
        named={"name": "endpoint"},
    ),
    Entry(
        "SliceTracker.admit",
        lambda t, **kw: t.admit(**kw),
        {"request_id": 8, "prompt_tokens": 5, "max_tokens": 9, "endpoint": "a", "priority": 1},
        {
            "request_id": "int",
            "prompt_tokens": "int",
            "max_tokens": "int",
            "endpoint": "str",
            "priority": "int",
        },
        tracker_structure,
    ),
    Entry(
        "SliceTracker.record_tokens",
        lambda t, **kw: t.record_tokens(**kw),
        {"request_id": 7, "tokens": 0},
        {"request_id": "int", "tokens": "int"},
        tracker_structure,
    ),
    Entry(
        "SliceTracker.decide",
        lambda t, **kw: t.decide(**kw),
        {
            "request_id": 7,
            "finished": False,
            "waiting": [WaitingRequest(0, 0, 30, 2)],
            "now": 1.0,
        },
        {"request_id": "int", "finished": "bool", "waiting": "many", "now": "opt_num"},
        tracker_structure,
    ),
    Entry(
        "SliceTracker.resume",
        lambda t, **kw: t.resume(**kw),
        {"request_id": 7, "endpoint": "a"},
        {"request_id": "int", "endpoint": "str"},
        paused_tracker_structure,
    ),
    Entry(
        "SliceTracker.promote",
        lambda t, **kw: t.promote(**kw),
        {"now": 1.0},
        {"now": "opt_num"},
        tracker_structure,
    ),
    *(
        Entry(
            f"SliceTracker.{method}",
            lambda t, method=method, **kw: getattr(t, method)(**kw),
            {"request_id": 7},
            {"request_id": "int"},
            tracker_structure,
        )
        for method in ("remove", "state")
    ),
    Entry(
        "SwitchCostModel",
        lambda _, **kw: SwitchCostModel(**kw),
        {"decode_step_s": 0.02, "priority_base": 2.0},
        {"decode_step_s": "num", "priority_base": "num"},
    ),
    Entry(
        "SwitchCostModel.from_model",
        lambda _, **kw: SwitchCostModel.from_model(**kw),
        {
            "params": 8e9,
            "layers": 32,
            "kv_heads": 8,
            "head_dim": 128,
            "dtype_bytes": 2,
            "gpu_flops": 1e15,
            "memory_fraction": 0.9,
            "priority_base": 2.0,
        },
        {
            "params": "num",
            "layers": "int",
            "kv_heads": "int",
            "head_dim": "int",
            "dtype_bytes": "int",
            "gpu_flops": "opt_num",
            "memory_fraction": "opt_num",
            "priority_base": "opt_num",
        },
    ),
    Entry(
        "SwitchCostModel.weight",
        lambda m, **kw: m.weight(**kw),
        {"priority": 2},
        {"priority": "int"},
        cost_structure,
    ),
    Entry(
        "SwitchCostModel.recompute_s",
        lambda m, **kw: m.recompute_s(**kw),
        {"context_tokens": 100.0, "prefill_tokens_per_s": 1000.0},
        {"context_tokens": "num", "prefill_tokens_per_s": "opt_num"},
        cost_structure,
    ),
    Entry(
        "SwitchCostModel.switch_s",
        lambda m, **kw: m.switch_s(**kw),
        {
            "context_tokens": 1000.0,
            "demand_tokens": 1500.0,
            "free_tokens": 1000.0,
            "prefill_tokens_per_s": None,
        },
        {
            "context_tokens": "num",
            "demand_tokens": "num",
            "free_tokens": "num",
            "prefill_tokens_per_s": "opt_num",
        },
        cost_structure,
    ),
    Entry(
        "evict_probability",
        lambda _, **kw: evict_probability(**kw),
        {"context_tokens": 1000.0, "demand_tokens": 1500.0, "free_tokens": 1000.0},
        {"context_tokens": "num", "demand_tokens": "num", "free_tokens": "num"},
    ),
    Entry(
        "policy_defaults",
        lambda _, **kw: policy_defaults(**kw),
        {"name": "mlfq"},
        {"name": "str"},
        named={"name": "policy name"},
    ),
    # -- SliceAssembler ------------------------------------------------------------------------
    Entry(
        "SliceAssembler",
        lambda _, **kw: SliceAssembler(**kw),
        {
            "request": {"model": "m", "prompt": [1, 2], "max_tokens": 3},
            "api": "completions",
            "response_id": "r",
            "created": 1,
            "default_max_tokens": 16,
        },
        {
            "request": "mapping",
            "api": "str",
            "response_id": "opt_str",
            "created": "opt_int",
            "default_max_tokens": "opt_int",
        },
    ),
    Entry(
        "SliceAssembler.next_request",
        lambda a, **kw: a.next_request(**kw),
        {"slice_tokens": 2},
        {"slice_tokens": "int"},
        assembler_structure,
    ),
    Entry(
        "SliceAssembler.feed",
        lambda a, **kw: a.feed(**kw),
        {"chunk": {"choices": [{"index": 0, "text": "c", "token_ids": [7]}]}},
        {"chunk": "mapping"},
        assembler_structure,
    ),
    # -- hashing -------------------------------------------------------------------------------
    Entry(
        "namespace_seed",
        lambda _, **kw: llmsched.namespace_seed(**kw),
        {"seed": 1, "model": "m", "lora": "l", "cache_salt": "c"},
        {"seed": "int", "model": "opt_str", "lora": "opt_str", "cache_salt": "opt_str"},
    ),
    Entry(
        "block_hashes(xxh3)",
        lambda _, **kw: llmsched.block_hashes(**kw),
        {
            "tokens": TOKENS,
            "block_size": 2,
            "seed": 1,
            "model": "m",
            "lora": "l",
            "cache_salt": "c",
            "algo": "xxh3",
        },
        {
            "tokens": "ints",
            "block_size": "int",
            "seed": "opt_int",
            "model": "opt_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
            "algo": "str",
        },
    ),
    Entry(
        "block_hashes(vllm)",
        lambda _, **kw: llmsched.block_hashes(**kw),
        {
            "tokens": TOKENS,
            "block_size": 2,
            "seed": "0",
            "lora": "l",
            "cache_salt": "c",
            "algo": "vllm_sha256_cbor",
        },
        {
            "tokens": "ints",
            "block_size": "int",
            "seed": "opt_seed_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
        },
    ),
    Entry(
        "vllm_block_digests",
        lambda _, **kw: llmsched.vllm_block_digests(**kw),
        {"tokens": TOKENS, "block_size": 2, "seed": "0", "lora": "l", "cache_salt": "c"},
        {
            "tokens": "ints",
            "block_size": "int",
            "seed": "opt_seed_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
        },
    ),
    Entry(
        "vllm_none_hash",
        lambda _, **kw: llmsched.vllm_none_hash(**kw),
        {"seed": "0"},
        {"seed": "opt_seed_str"},
    ),
    Entry(
        "text_block_hashes",
        lambda _, **kw: llmsched.text_block_hashes(**kw),
        {
            "text": "abcdefgh",
            "block_size": 2,
            "seed": 1,
            "model": "m",
            "lora": "l",
            "cache_salt": "c",
            "include_partial": True,
            "max_tokens": 10,
        },
        {
            "text": "text",
            "block_size": "int",
            "seed": "int",
            "model": "opt_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
            "include_partial": "bool",
            "max_tokens": "opt_int",
        },
    ),
    Entry(
        "pack_text",
        lambda _, **kw: llmsched.pack_text(**kw),
        {"text": "abcde"},
        {"text": "text"},
    ),
    Entry(
        "block_hashes_batch",
        lambda _, **kw: llmsched.block_hashes_batch(**kw),
        {
            "prompts": [TOKENS],
            "block_size": 2,
            "seed": 1,
            "model": "m",
            "lora": "l",
            "cache_salt": "c",
            "algo": "xxh3",
            "threads": 1,
        },
        {
            "prompts": "many",
            "block_size": "int",
            "seed": "opt_int",
            "model": "opt_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
            "algo": "str",
            "threads": "int",
        },
    ),
    # -- vLLM events ---------------------------------------------------------------------------
    Entry(
        "decode_vllm_events",
        lambda _, **kw: llmsched.decode_vllm_events(**kw),
        {"payload": PAYLOAD},
        {"payload": "bytes"},
    ),
    # -- llmsched.validation -------------------------------------------------------------------
    Entry(
        "validation.check_now",
        lambda _, **kw: validation.check_now(**kw),
        {"now": 1.0},
        {"now": "opt_num"},
    ),
    Entry(
        "validation.check_positive_seconds",
        lambda _, **kw: validation.check_positive_seconds("interval_s", **kw),
        {"value": 1.0},
        {"value": "num"},
        named={"value": "interval_s"},
    ),
    Entry(
        "validation.check_int",
        lambda _, **kw: validation.check_int("count", **kw),
        {"value": 3},
        {"value": "int"},  # its bounds are the library's own constants
        named={"value": "count"},
    ),
    Entry(
        "validation.check_block_size",
        lambda _, **kw: validation.check_block_size(**kw),
        {"block_size": 16},
        {"block_size": "int"},
    ),
    Entry(
        "validation.check_seed",
        lambda _, **kw: validation.check_seed(**kw),
        {"seed": 1},
        {"seed": "int"},
    ),
    Entry(
        "validation.check_probability",
        lambda _, **kw: validation.check_probability("share", **kw),
        {"value": 0.5},
        {"value": "num"},
        named={"value": "share"},
    ),
    Entry(
        "validation.check_id",
        lambda _, **kw: validation.check_id("worker", **kw),
        {"value": "w"},
        {"value": "id"},
        named={"value": "worker"},
    ),
    # -- Scheduler, ScheduleRequest ------------------------------------------------------------
    Entry(
        "ScheduleRequest",
        lambda _, **kw: ScheduleRequest(**kw),
        {
            "tokens": TOKENS,
            "model": "m",
            "tenant": "t",
            "priority": 1,
            "session_id": "s",
            "lora": "l",
            "cache_salt": "c",
            "headers": {"h": "v"},
            "prompt_tokens": 4,
            "size_bytes": 10,
            "deadline": 5.0,
            "ttft_target_s": 1.0,
        },
        {
            "tokens": "ints",
            "model": "opt_str",
            "tenant": "str",
            "priority": "int",
            "session_id": "opt_str",
            "lora": "opt_str",
            "cache_salt": "opt_str",
            "headers": "opt_mapping",
            "prompt_tokens": "opt_int",
            "size_bytes": "int",
            "deadline": "opt_num",
            "ttft_target_s": "opt_num",
        },
    ),
    Entry(
        "ScheduleRequest(text)",
        lambda _, **kw: ScheduleRequest(**kw),
        {"text": "hello"},
        {"text": "str"},
    ),
    Entry(
        "ScheduleRequest(messages)",
        lambda _, **kw: ScheduleRequest(**kw),
        {"messages": MESSAGES},
        {"messages": "messages"},
    ),
    Entry(
        "Scheduler",
        lambda _, **kw: Scheduler(**kw),
        {
            "engines": ["a"],
            "router": "round-robin",
            "flow": None,
            "index": None,
            "block_size": 16,
            "kv_events": False,
            "scrape": False,
            "scrape_interval_s": 0.5,
            "scrape_timeout_s": 1.0,
            "stale_after_s": 2.0,
            "stale_policy": "ignore",
            "seed": 1,
            "record_ttl_s": 5.0,
            "allow_pseudo_tokens": False,
            "retry_after_s": 1.0,
        },
        {
            "engines": "endpoints",
            "router": "config",
            "flow": "opt_config",
            "index": "opt_index",
            "block_size": "opt_int",
            "kv_events": "bool",
            "scrape": "bool",
            "scrape_interval_s": "num",
            "scrape_timeout_s": "num",
            "stale_after_s": "opt_num",
            "stale_policy": "opt_str",
            "seed": "opt_int",
            "record_ttl_s": "opt_num",
            "allow_pseudo_tokens": "bool",
            "retry_after_s": "num",
        },
    ),
    Entry(
        "Scheduler.add_engine",
        lambda s, **kw: s.add_engine(**kw),
        {"engine": "c"},
        {"engine": "id"},
        scheduler_structure,
    ),
    *(
        Entry(
            f"Scheduler.{method}",
            lambda s, method=method, **kw: getattr(s, method)(**kw),
            {"endpoint": "a"},
            {"endpoint": "id"},
            scheduler_structure,
        )
        for method in ("address_of", "remove_engine", "drain", "resume")
    ),
    *(
        Entry(
            f"Scheduler.{method}",
            lambda s, method=method, **kw: getattr(s, method)(**kw),
            {"request": ScheduleRequest(tokens=TOKENS)},
            {"request": "request"},
            scheduler_structure,
        )
        for method in ("admit_sync", "place", "schedule_sync")
    ),
    # -- llmsched.tokenize ---------------------------------------------------------------------
    Entry(
        "PromptTokenizer.completion_tokens",
        lambda t, **kw: t.completion_tokens(**kw),
        {"prompt": "hello", "truncate_prompt_tokens": None, "truncation_side": None},
        {
            "prompt": "prompt",
            "truncate_prompt_tokens": "opt_int",
            "truncation_side": "opt_side",
        },
        tokenizer_structure,
    ),
    Entry(
        "PromptTokenizer",
        lambda _, **kw: _new_tokenizer(**kw),
        {
            "chat_template": None,
            "default_chat_template_kwargs": None,
            "exclude_tools_when_tool_choice_none": False,
            "trust_request_chat_template": False,
        },
        {
            "chat_template": "opt_str",
            "default_chat_template_kwargs": "opt_mapping",
            "exclude_tools_when_tool_choice_none": "bool",
            "trust_request_chat_template": "bool",
        },
    ),
    *(
        Entry(
            f"PromptTokenizer.{method}",
            lambda t, method=method, **kw: getattr(t, method)(**kw),
            {"messages": MESSAGES, "extra": None},
            {"messages": "messages", "extra": "opt_mapping"},
            tokenizer_structure,
        )
        for method in ("render_chat", "chat_tokens")
    ),
]


def _cases() -> Iterator[Any]:
    for entry in ENTRIES:
        for arg, kind in entry.kinds.items():
            for label in WRONG:
                if label in ACCEPTS[kind]:
                    continue
                marks = [pytest.mark.xfail(reason=entry.xfail)] if entry.xfail else []
                yield pytest.param(entry, arg, label, id=f"{entry.name}-{arg}-{label}", marks=marks)


def test_entries_name_only_known_kinds_and_real_arguments() -> None:
    for entry in ENTRIES:
        assert set(entry.kinds) <= set(entry.valid), entry.name
        assert set(entry.kinds.values()) <= set(ACCEPTS), entry.name


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name) for e in ENTRIES if not e.xfail])
def test_valid_call_succeeds(entry: Entry) -> None:
    """The baseline: with every argument valid the call goes through (so a failure below is
    the wrong value's)."""
    structure, _ = entry.make()
    entry.call(structure, **entry.valid)


@pytest.mark.parametrize(("entry", "arg", "label"), list(_cases()))
def test_wrong_type_raises_llmsched_error_and_changes_nothing(
    entry: Entry, arg: str, label: str
) -> None:
    structure, state = entry.make()
    before = None if state is None else state(structure)
    args = dict(entry.valid)
    args[arg] = WRONG[label]
    with pytest.raises(Exception) as info:  # which exception is checked below
        entry.call(structure, **args)
    exc = info.value
    assert isinstance(exc, LlmschedError), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert isinstance(exc, (TypeError, ValueError)), f"{type(exc).__name__}: {exc}"
    word = entry.named.get(arg, arg)
    assert word in str(exc), f"message does not name {word!r}: {exc}"
    if state is not None:
        assert state(structure) == before


@pytest.mark.parametrize(("request_id", "tokens"), [(7, True), (True, 1)], ids=["tokens", "id"])
def test_a_bool_is_no_token_count_or_request_id_mid_slice(request_id: Any, tokens: Any) -> None:
    """Mid-slice (where the entry above's structure is not: it sits at a boundary, so a count
    of 1 fails there anyway) a bool was counted as 1 token, or taken for request 1."""
    tracker = SliceTracker("fixed", {"slice_tokens": 8}, endpoints=["a"])
    tracker.admit(7, prompt_tokens=5, max_tokens=100, endpoint="a")
    tracker.admit(1, prompt_tokens=5, max_tokens=100, endpoint="a")
    before = [_fields(tracker.state(i)) for i in (1, 7)]
    with pytest.raises(llmsched.InvalidTypeError, match="must be an int, got bool"):
        tracker.record_tokens(request_id, tokens)
    assert [_fields(tracker.state(i)) for i in (1, 7)] == before


OUT_OF_RANGE: dict[str, Any] = {
    "minus-2**63-1": -(2**63) - 1,
    "2**64": 2**64,
    "np-int64-minus-1": np.int64(-1),
    "np-uint64-max": np.uint64(2**64 - 1),
}
"""Ints the native layer's 64-bit (or unsigned) conversions cannot all take."""

BEYOND_FLOATS = 10**400
"""An int no float holds."""


def _range_cases() -> Iterator[Any]:
    for entry in ENTRIES:
        if entry.xfail:
            continue
        for arg, kind in entry.kinds.items():
            if kind in ("int", "opt_int", "opt_index", "id", "opt_id"):
                values = OUT_OF_RANGE
            elif kind in ("num", "opt_num"):
                values = {"10**400": BEYOND_FLOATS}
            else:
                continue
            for label, value in values.items():
                yield pytest.param(entry, arg, value, id=f"{entry.name}-{arg}-{label}")


@pytest.mark.parametrize(("entry", "arg", "value"), list(_range_cases()))
def test_an_int_out_of_range_is_an_llmsched_error_or_taken(
    entry: Entry, arg: str, value: Any
) -> None:
    """Probe 73: ``Router(max_sessions=-1)``, ``FlowController.is_queued(-1)``, numpy
    integers past 64 bits signed as flow-control ids, ``PrefixIndex.store(parent=np.int64(-1))``
    and ints beyond a float's range as seconds or shares raised a bare OverflowError. Each
    value is either taken (it is in range for that argument) or refused with an exception of
    :mod:`llmsched.errors`, changing nothing."""
    structure, state = entry.make()
    before = None if state is None else state(structure)
    args = dict(entry.valid)
    args[arg] = value
    try:
        entry.call(structure, **args)
    except LlmschedError as exc:
        assert isinstance(exc, (TypeError, ValueError, KeyError)), f"{type(exc).__name__}: {exc}"
        if state is not None:
            assert state(structure) == before
