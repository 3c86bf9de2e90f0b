"""Workloads: seeded, with the sharing structure each one claims, and trace replay."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from llmsched import PrefixIndex
from llmsched.errors import ConfigError
from llmsched.sim.request import Request
from llmsched.sim.workloads import ArrivalConfig, Conversation, make_workload

BS = 16


def first(spec, n=None, seed=0):
    w = make_workload(spec, seed=seed, block_size=BS)
    out = list(w.arrivals())
    return w, out if n is None else out[:n]


def test_conversation_hashes_match_a_whole_hash() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype(np.uint32) for n in (7, 30, 1, 50)]
    conv = Conversation(BS, 0)
    for p in parts:
        conv.append(p)
    whole = np.concatenate(parts)
    assert conv.length == len(whole)
    assert np.array_equal(conv.tokens, whole)
    assert np.array_equal(conv.hashes, PrefixIndex(block_size=BS).hash_tokens(whole))


def test_same_seed_same_workload() -> None:
    spec = {"kind": "long_short", "num_requests": 30}
    _, a = first(spec, seed=5)
    _, b = first(spec, seed=5)
    _, c = first(spec, seed=6)
    key = lambda rs: [(r.arrival, r.prompt_len, r.output_len, r.hashes.tolist()) for r in rs]  # noqa: E731
    assert key(a) == key(b) != key(c)


def test_agentic_turns_extend_the_conversation() -> None:
    w, starts = first({"kind": "agentic", "sessions": 3, "arrival": {"concurrency": 3}})
    assert len(starts) == 3
    req: Request | None = starts[0]
    turns = []
    now = 0.0
    while req is not None:
        turns.append(req)
        now = req.arrival + 1.0
        req = w.on_finish(req, now)
    assert len(turns) == 6  # the first turn and 5 follow-ups
    assert turns[0].prompt_len > 7000 and turns[0].output_len > 1000
    for prev, nxt in itertools.pairwise(turns):
        assert nxt.arrival >= prev.arrival
        # The next prompt repeats the previous prompt and its answer.
        assert nxt.prompt_len > prev.prompt_len + prev.output_len
        shared = (prev.prompt_len + prev.output_len) // BS
        assert np.array_equal(nxt.hashes[:shared], prev.hashes[:shared])
        assert np.array_equal(nxt.tokens[: prev.prompt_len], prev.tokens)
    # A closed loop starts a new session when one ends (3 of 3 started already: none).
    assert w.on_finish(turns[-1], now) is None


def test_agentic_closed_loop_replaces_finished_sessions() -> None:
    w, starts = first(
        {"kind": "agentic", "sessions": 5, "followup_turns": 0, "arrival": {"concurrency": 2}}
    )
    assert len(starts) == 2
    nxt = w.on_finish(starts[0], 10.0)
    assert nxt is not None and nxt.turn == 0 and nxt.session == 2


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    spec = {
        "kind": "shared_prefix",
        "num_requests": 200,
        "num_groups": 3,
        "num_prompts_per_group": 2,
        "system_prompt_len": 320,
        "question_len": 40,
        "output_len": 5,
    }
    _, reqs = first(spec)
    by_group: dict[int, set[int]] = {}
    for r in reqs:
        by_group.setdefault(r.tenant, set()).add(int(r.hashes[19]))
        assert r.prompt_len == 360
    assert len(by_group) == 3 and all(len(v) == 1 for v in by_group.values())
    prompts = {tuple(r.hashes[: 360 // BS].tolist()) for r in reqs}
    assert len(prompts) == 6
    times = [r.arrival for r in reqs]
    assert times == sorted(times)


def test_priority_classes() -> None:
    _, reqs = first({"kind": "priority", "num_requests": 400, "batch_fraction": 0.25})
    batch = [r for r in reqs if r.priority < 0]
    assert 60 < len(batch) < 140
    assert all(r.tenant == 1 for r in batch)


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("gamma", 2.0), ("gamma", 0.5)])
def test_arrival_processes(process: str, cv: float) -> None:
    gaps = ArrivalConfig(process=process, rate=4.0, cv=cv).gaps(np.random.default_rng(1), 40_000)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def write_trace(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_mooncake_trace(tmp_path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"timestamp": 250, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]},
    ]
    spec = {"kind": "trace", "path": write_trace(tmp_path / "t.jsonl", rows)}
    _, reqs = first(spec)
    assert [r.arrival for r in reqs] == [0.0, 0.25, 0.5]  # sorted, ms -> s
    a, c, b = reqs
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (1024, 1500, 600)
    # Shared leading hash ids mean a shared cached prefix (512-token blocks).
    assert np.array_equal(a.hashes[:64], b.hashes[:64])
    assert np.array_equal(a.hashes[:32], c.hashes[:32]) and a.hashes[32] != c.hashes[32]
    assert len(b.tokens) == 1500
    assert np.array_equal(b.hashes[:93], PrefixIndex(block_size=BS).hash_tokens(b.tokens))


def test_trace_scaling_and_limit(tmp_path) -> None:
    rows = [{"timestamp": t, "input_length": 10, "output_length": 1} for t in (0, 2, 4)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    spec = {"kind": "trace", "path": path, "timestamp_unit": "s", "time_scale": 2.0, "limit": 2}
    _, reqs = first(spec)
    assert [r.arrival for r in reqs] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be an object"),
        ('{"timestamp": 0, "input_length": 5}', "output_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1]}',
            "cannot cover",
        ),
    ],
)
def test_trace_errors_name_the_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{message}"):
        make_workload({"kind": "trace", "path": str(path)})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "kind"),
        ({"kind": "chat"}, "unknown workload kind 'chat'"),
        ({"kind": "long_short", "rps": 3}, r"unknown key\(s\) \['rps'\]"),
        ({"kind": "long_short", "arrival": {"process": "weibull"}}, "unknown arrival process"),
        ({"kind": "long_short", "arrival": {"rate": 0}}, "rate"),
        ({"kind": "shared_prefix", "arrival": {"process": "closed"}}, "unknown arrival process"),
        ({"kind": "agentic", "system_prompt_len": 20_000}, "system_prompt_len"),
        ({"kind": "long_short", "long_fraction": 2}, "long_fraction"),
        ({"kind": "trace", "path": "/nonexistent.jsonl"}, "cannot read"),
        ({"kind": "trace", "path": "x", "hash_block": 100}, "hash_block"),
    ],
)
def test_workload_errors(spec, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_workload(spec)
