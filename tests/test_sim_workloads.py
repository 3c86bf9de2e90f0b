"""Workloads: seeded, with the sharing structure each one claims, and trace replay."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsched import PrefixIndex
from llmsched.errors import ConfigError
from llmsched.sim.fast import build_plan
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


# -- native plans: the same plan as the Python classes build, bit for bit ----------------------


def assert_same_plan(spec, seed=0, block_size=BS) -> dict:
    """The native plan equals the plan built from the Python workload classes' requests."""
    python = build_plan(spec, seed, block_size, seed, native=False)
    native = build_plan(spec, seed, block_size, seed, native=True)
    assert python.keys() == native.keys()
    for key, value in python.items():
        other = native[key]
        if key == "contents":
            assert (len(other), other.distinct) == (len(value), value.distinct)
        elif isinstance(value, np.ndarray):
            assert other.dtype == value.dtype, key
            np.testing.assert_array_equal(other, value, err_msg=key)
        else:
            assert other == value, key
    return native


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "long_short", "num_requests": 200},
        {"kind": "long_short", "num_requests": 50, "length_cv": 0.0},
        {"kind": "priority", "num_requests": 200, "arrival": {"process": "gamma", "cv": 2.0}},
        {"kind": "priority", "num_requests": 40, "arrival": {"process": "constant"}},
        {"kind": "shared_prefix", "num_requests": 300, "num_groups": 6},
        {"kind": "agentic", "sessions": 30},
        {"kind": "agentic", "sessions": 8, "arrival": {"process": "poisson", "rate": 2.0}},
        {"kind": "agentic", "sessions": 5, "think_time_s": 0.0, "length_cv": 1.0},
    ],
    ids=lambda spec: spec["kind"],
)
@pytest.mark.parametrize("seed", [0, 11, 2**40 + 3])
def test_native_plan_equals_the_python_plan(spec, seed: int) -> None:
    assert_same_plan(spec, seed)


LENGTH_CVS = st.sampled_from([0.0, 0.3, 1.0, 1.7, 4.0])  # gamma shape > 1, == 1 and < 1
ARRIVALS = st.one_of(
    st.fixed_dictionaries({"process": st.just("poisson"), "rate": st.floats(0.5, 50.0)}),
    st.fixed_dictionaries(
        {"process": st.just("gamma"), "rate": st.floats(0.5, 50.0), "cv": st.floats(0.2, 4.0)}
    ),
    st.fixed_dictionaries({"process": st.just("constant"), "rate": st.floats(0.5, 50.0)}),
)
SPECS = st.one_of(
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["long_short", "priority"]),
            "num_requests": st.integers(1, 60),
            "length_cv": LENGTH_CVS,
            "arrival": ARRIVALS,
        }
    ),
    st.fixed_dictionaries(
        {
            "kind": st.just("shared_prefix"),
            "num_requests": st.integers(1, 60),
            "num_groups": st.integers(1, 4),
            "num_prompts_per_group": st.integers(1, 3),
            "system_prompt_len": st.integers(0, 300),
            "question_len": st.integers(1, 80),  # prompts of no tokens are refused
            "output_len": st.integers(1, 90),
            "arrival": ARRIVALS,
        }
    ),
    st.fixed_dictionaries(
        {
            "kind": st.just("agentic"),
            "sessions": st.integers(1, 8),
            "system_prompts": st.integers(1, 4),
            "first_input": st.integers(400, 3000),
            "system_prompt_len": st.integers(0, 399),
            "followup_turns": st.integers(0, 3),
            "length_cv": LENGTH_CVS,
            "think_time_s": st.sampled_from([0.0, 0.7]),
            "arrival": st.one_of(
                ARRIVALS,
                st.fixed_dictionaries(
                    {"process": st.just("closed"), "concurrency": st.integers(1, 5)}
                ),
            ),
        }
    ),
)


@settings(max_examples=80, deadline=None)
@given(spec=SPECS, seed=st.integers(0, 2**64 - 1), block_size=st.sampled_from([1, 16, 32]))
def test_native_plans_equal_python_plans(spec, seed: int, block_size: int) -> None:
    """Every draw of numpy's PCG64 (tokens, fresh ids, 32-bit halves carried across calls) and
    of CPython's MT19937 (lengths by gamma with shape above, at and below 1, think times,
    tenants) is reproduced, for seeds of one to three 32-bit words."""
    assert_same_plan(spec, seed, block_size)


def trace_rows(rng: np.random.Generator, n: int, ids: bool) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = int(rng.integers(1, 3000))
        row = {
            "timestamp": int(rng.integers(0, 10_000)),
            "input_length": prompt,
            "output_length": int(rng.integers(0, 300)),
        }
        if ids:
            # Every other line names one block fewer than its prompt: fresh tokens finish it.
            need = -(-prompt // 512) - i % 2
            shared = list(range(int(rng.integers(0, need + 1))))  # a common prefix
            row["hash_ids"] = shared + [1000 + 10 * i + k for k in range(need - len(shared))]
        rows.append(row)
    return rows


@pytest.mark.parametrize("ids", ["all", "none", "mixed"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_native_trace_plan_equals_the_python_plan(tmp_path, ids: str, block_size: int) -> None:
    rng = np.random.default_rng(5)
    rows = trace_rows(rng, 120, ids != "none")
    if ids == "mixed":
        for row in rows[::3]:
            row.pop("hash_ids")
    if ids != "none":
        # Ids differing in the top bit have equal content (numpy is seeded with the low 63).
        rows[0] |= {"input_length": 1024, "hash_ids": [2**63 + 5, 5]}
        rows[1] |= {"input_length": 700, "hash_ids": [5, 2**64 - 1, 9, 9]}  # more than needed
    rows[2] |= {"timestamp": 12.5, "tenant": 3, "priority": -1, "session": "s1"}
    rows[3] |= {"session": 42, "tenant": None}
    path = write_trace(tmp_path / "t.jsonl", rows)
    plan = assert_same_plan({"kind": "trace", "path": path}, seed=9, block_size=block_size)
    assert {"s1", "42", None} == set(plan["session"])  # rows are sorted by timestamp
    assert plan["contents"].distinct < len(plan["hashes"]) or ids == "none"
    spec = {
        "kind": "trace",
        "path": path,
        "timestamp_unit": "s",
        "time_scale": 3.0,
        "limit": 50,
        "hash_block": 4 * block_size if ids == "none" else 512,
    }
    assert len(assert_same_plan(spec, seed=2, block_size=block_size)["arrival"]) == 50


def test_trace_without_hash_ids_gets_unique_content(tmp_path) -> None:
    """Prompts longer than one 512-token block need no hash_ids: each line's content is its
    own, so no two requests share a block."""
    rows = [{"timestamp": t, "input_length": 5000 + t, "output_length": 7} for t in range(6)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    _, reqs = first({"kind": "trace", "path": path})
    assert [r.prompt_len for r in reqs] == [5000 + t for t in range(6)]
    for r in reqs:
        assert len(r.hashes) == (r.prompt_len + 7) // BS
        assert np.array_equal(
            r.hashes[: r.prompt_len // BS], PrefixIndex(block_size=BS).hash_tokens(r.tokens)
        )
    everything = np.concatenate([r.hashes for r in reqs])
    assert len(np.unique(everything)) == len(everything)
    plan = assert_same_plan({"kind": "trace", "path": path})
    assert plan["contents"].distinct == len(plan["hashes"])


@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be an object"),
        ('{"timestamp": 0, "input_length": 5}', "output_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": true, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 99999999, "output_length": 1}', "must be <="),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1e3]}',
            "hash_ids",
        ),
        (
            '{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1]}',
            "cannot cover",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "tenant": "a"}', "tenant"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "priority": 1.5}', "priority"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "session": [1]}', "session"),
        # Probe: 10.9 tokens was read as 10 by both readers; an int timestamp past 2**63 said
        # "must be a number >= 0"; an empty session id was taken as a session.
        (
            '{"timestamp": 0, "input_length": 10.9, "output_length": 1}',
            r"input_length must be a whole number of tokens, got 10\.9",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1.5}',
            r"output_length must be a whole number of tokens, got 1\.5",
        ),
        (
            '{"timestamp": 9223372036854775808, "input_length": 5, "output_length": 1}',
            r"timestamp is out of range: an integer must be below 2\*\*63, "
            "got 9223372036854775808",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "session": ""}',
            "session must not be an empty string",
        ),
        # Probe 75: an integer of 2**64 or more was a float to the native reader: a timestamp
        # of 2**64 was taken, a length said "must be <=", other fields showed 1.8e+19.
        (
            '{"timestamp": 18446744073709551616, "input_length": 5, "output_length": 1}',
            r"timestamp is out of range: an integer must be below 2\*\*63, "
            "got 18446744073709551616$",
        ),
        (
            '{"timestamp": 0, "input_length": 100000000000000000000000, "output_length": 1}',
            r"input_length is out of range: an integer must be below 2\*\*63, "
            "got 100000000000000000000000$",
        ),
        (
            '{"timestamp": -9223372036854775809, "input_length": 5, "output_length": 1}',
            "timestamp must be a number >= 0, got -9223372036854775809$",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, '
            '"priority": 18446744073709551616}',
            "priority must be an integer, got 18446744073709551616$",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, '
            '"session": -18446744073709551616}',
            "session must be a string or an integer, got -18446744073709551616$",
        ),
    ],
)
def test_both_trace_readers_name_the_bad_line(
    tmp_path, build: str, line: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    spec = {"kind": "trace", "path": str(path)}
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{message}"):
        build_plan(spec, 0, BS, 0, native=build == "native")


def test_both_trace_readers_take_whole_float_lengths(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0.5, "input_length": 40.0, "output_length": 2.0}\n')
    plan = assert_same_plan({"kind": "trace", "path": str(path)})
    assert plan["prompt"].tolist() == [40]


def test_both_trace_readers_take_a_float_timestamp_past_2_64(tmp_path) -> None:
    # Only an integer literal that large is refused (probe 75); a float one is a float.
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 2e19, "input_length": 40, "output_length": 2}\n')
    plan = assert_same_plan({"kind": "trace", "path": str(path)})
    assert plan["prompt"].tolist() == [40]


@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"path": "/nonexistent.jsonl"}, "cannot read"),
        ({"limit": 0}, "limit"),
        ({"hash_block": 24}, "hash_block"),
        ({"timestamp_unit": "us"}, "timestamp_unit"),
        ({"time_scale": 0}, "time_scale"),
    ],
)
def test_trace_settings_are_checked_on_both_builds(tmp_path, build: str, over, message) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": 1}]
    )
    spec = {"kind": "trace", "path": path, **over}
    with pytest.raises(ConfigError, match=message):
        build_plan(spec, 0, BS, 0, native=build == "native")


@pytest.mark.parametrize("build", ["python", "native"])
def test_impossible_mean_lengths_raise(build: str) -> None:
    spec = {"kind": "long_short", "num_requests": 3, "long_fraction": 0.0, "short_input": 0}
    with pytest.raises(ConfigError, match="mean length"):
        build_plan(spec, 0, BS, 0, native=build == "native")


def test_empty_trace_plans_are_equal(tmp_path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    plan = assert_same_plan({"kind": "trace", "path": str(path)})
    assert len(plan["arrival"]) == 0 and len(plan["contents"]) == 0


@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "agentic", "sessions": 100_000_000_000}, "requests"),
        ({"kind": "agentic", "sessions": 2, "followup_turns": 100_000_000_000}, "requests"),
        ({"kind": "agentic", "sessions": 2, "system_prompts": 100_000_000_000}, "shared"),
        ({"kind": "shared_prefix", "num_requests": 100_000_000_000}, "requests"),
        ({"kind": "shared_prefix", "num_requests": 5, "num_groups": 10**11}, "shared"),
        ({"kind": "long_short", "num_requests": 100_000_000_000}, "requests"),
        ({"kind": "priority", "num_requests": 10**11}, "requests"),
        ({"kind": "agentic", "sessions": 2.5}, "sessions"),
    ],
)
def test_a_workload_too_large_to_plan_is_refused_not_allocated(build: str, spec, message) -> None:
    """Probe 48 F9: a plan is written out before the run, and an agentic count of 1e11 was an
    allocation of terabytes in the native planner, which aborts the process."""
    with pytest.raises(ConfigError, match=message):
        build_plan(spec, 0, BS, 0, native=build == "native")


@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize(
    "spec",
    [
        # 200,000 prompts of a million tokens: 2e11 tokens, 1.25e10 blocks to hash and hold.
        {"kind": "long_short", "num_requests": 200_000, "long_fraction": 1.0,
         "long_input": 1_000_000},
        {"kind": "priority", "num_requests": 5_000_000, "batch_input": 100_000},
        {"kind": "shared_prefix", "num_requests": 1_000_000, "output_len": 100_000},
        {"kind": "agentic", "sessions": 1_000_000, "first_input": 100_000},
    ],
)  # fmt: skip
def test_a_workload_of_too_many_tokens_to_plan_is_refused(build: str, spec) -> None:
    """Probe 76: within the request limit, a plan's size is its tokens (a block hash and a
    content id per block): 200,000 prompts of a million tokens went on allocating past 100 GB
    where the limit on requests promised a bounded plan."""
    with pytest.raises(ConfigError, match=r"tokens of prompts and outputs to plan"):
        build_plan(spec, 0, BS, 0, native=build == "native")


def test_a_million_default_requests_are_still_planned() -> None:
    """The limit leaves room for a million default long_short requests (0.9 x (512 + 128) +
    0.1 x (16,000 + 2,000) = 2,376 tokens each; they ran in 7.5 GB)."""
    from llmsched.sim.workloads import MAX_PLAN_TOKENS, make_workload

    assert MAX_PLAN_TOKENS > 1_000_000 * 2_376
    make_workload({"kind": "long_short", "num_requests": 1_000_000})  # no ConfigError


def test_scenario_slo_keys_and_max_time_are_checked() -> None:
    from llmsched.sim.config import ScenarioConfig

    base = {"replicas": 2, "workload": {"kind": "agentic", "sessions": 3}}
    with pytest.raises(ConfigError, match="slo: keys must be priorities"):
        ScenarioConfig.from_dict({**base, "slo": {"abc": {"ttft_s": 1}}})
    assert ScenarioConfig.from_dict({**base, "slo": {"2": {"ttft_s": 1}}}).slo == {2: {"ttft_s": 1}}
    for bad in (-1, 0, float("nan"), "1"):
        with pytest.raises(ConfigError, match="max_time_s"):
            ScenarioConfig.from_dict({**base, "max_time_s": bad})


@pytest.mark.parametrize("build", ["python", "native"])
def test_both_trace_readers_refuse_a_trace_past_max_plan_tokens_before_planning(
    tmp_path, build: str
) -> None:
    """A trace's lengths were bounded line by line only: 129 lines of 2**24 + 2**24 tokens
    (4.3e9, a plan of ~6 GB) were read and planned. Both readers refuse at the line that passes
    MAX_PLAN_TOKENS, naming it, before the plan is built; ``limit`` replays the lines within."""
    from llmsched.sim.workloads import MAX_PLAN_TOKENS, MAX_TOKENS

    line = json.dumps({"timestamp": 0, "input_length": MAX_TOKENS, "output_length": MAX_TOKENS})
    path = tmp_path / "big.jsonl"
    path.write_text((line + "\n") * 129)
    spec = {"kind": "trace", "path": str(path)}
    assert 128 * 2 * MAX_TOKENS == MAX_PLAN_TOKENS
    with pytest.raises(
        ConfigError,
        match=r"big\.jsonl:129: the lines up to here ask for 4328521728 tokens of prompts and "
        r"outputs, more than the simulator writes out \(MAX_PLAN_TOKENS, 4294967296\)",
    ):
        build_plan(spec, 0, BS, 0, native=build == "native")
    small = tmp_path / "small.jsonl"
    small.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2}\n' + line + "\n")
    plan = build_plan({**spec, "path": str(small), "limit": 1}, 0, BS, 0, native=build == "native")
    assert plan["prompt"].tolist() == [40]
