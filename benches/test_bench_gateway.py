"""Gateway benchmarks.

1. Overhead under load: fake engines in one process, ``llmsched serve`` in another, and an
   open-loop client here sending ~300 requests/s, alternately straight to an engine and
   through the gateway. The overhead per request is the gateway's latency quantile minus the
   direct one (p50 and p99); the figures go to ``benchmark.extra_info`` and are printed.
2. The per-request decision path (tokenize a chat conversation, admit through flow control,
   pick, start, finish), beside its pure-Python twin (the same tokenizer, the naive flow
   controller and the naive router).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import yaml

from llmsched import Endpoint, EndpointPool, FlowController, FlowRequest, PrefixIndex, Router
from llmsched.flow import resolve_config
from llmsched.reference.flow import FlowControllerTwin
from llmsched.reference.prefix_index import ReferencePrefixIndex
from llmsched.reference.routing import ReferenceEndpoint, decide_tokens
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptTokenizer

RATE = float(os.environ.get("LLMSCHED_BENCH_GATEWAY_RATE", "300"))
SECONDS = float(os.environ.get("LLMSCHED_BENCH_GATEWAY_SECONDS", "3"))
MODEL = "tiny"
FLOW = {"saturation": {"type": "concurrency", "max_requests": 4096}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _started(command: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if marker not in line:
        process.kill()
        process.wait()
        raise RuntimeError(f"{command[2]} did not start: {line!r}")
    return process, line


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two fake engines and a gateway in front, each in its own process."""
    engines, line = _started(
        [
            sys.executable,
            "-m",
            "llmsched.testing.openai_engine",
            "--engines",
            "2",
            "--model",
            MODEL,
        ],
        "ports",
    )
    ports = json.loads(line)["ports"]
    port = _free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "engines": [{"host": "127.0.0.1", "port": p} for p in ports],
        "models": [MODEL],
        "block_size": 16,
        "router": "llm-d",
        "flow": FLOW,
        "scrape": {"enabled": True, "interval_s": 0.2},
    }
    path = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway, _ = _started(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path), "--log-level", "ERROR"],
        "listening",
    )
    try:
        yield {
            "gateway": f"http://127.0.0.1:{port}",
            "engines": [f"http://127.0.0.1:{p}" for p in ports],
            "gateway_pid": gateway.pid,
        }
    finally:
        for process in (gateway, engines):
            process.terminate()
            process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompt(i: int) -> str:
    # 64 sessions with a long shared opening each, so routing matches real prefixes.
    session = i % 64
    return f"Session {session}: " + "context " * 200 + f"turn {i // 64}"


async def _load(fleet: dict[str, Any]) -> dict[str, list[float]]:
    """Open loop at RATE: request k starts at k / RATE; even ones go straight to an engine,
    odd ones through the gateway. Returns the latencies (s) of each path."""
    latencies: dict[str, list[float]] = {"direct": [], "gateway": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(k: int, record: bool) -> None:
            path = "gateway" if k % 2 else "direct"
            base = fleet["gateway"] if path == "gateway" else fleet["engines"][(k // 2) % 2]
            body = {"model": MODEL, "prompt": _prompt(k), "max_tokens": 4}
            started = time.perf_counter()
            async with session.post(base + "/v1/completions", json=body) as response:
                await response.read()
                assert response.status == 200, await response.text()
            if record:
                latencies[path].append(time.perf_counter() - started)

        warmup = int(RATE * 0.5)
        total = warmup + int(RATE * SECONDS)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for k in range(total):
            delay = t0 + k / RATE - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(k, k >= warmup)))
        await asyncio.gather(*tasks)
    return latencies


def test_gateway_overhead_under_load(
    benchmark: Any, fleet: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = f"gateway overhead at {RATE:g} requests/s (extra_info)"
    result: dict[str, list[float]] = {}

    cpu: list[float | None] = []

    def measure() -> None:
        cpu.append(_cpu_seconds(fleet["gateway_pid"]))
        result.update(asyncio.run(_load(fleet)))
        cpu.append(_cpu_seconds(fleet["gateway_pid"]))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    assert len(result["gateway"]) > 0.9 * RATE * SECONDS / 2
    figures = {}
    for q in (50, 99):
        direct = float(np.percentile(result["direct"], q))
        through = float(np.percentile(result["gateway"], q))
        figures[f"direct_p{q}_ms"] = round(direct * 1e3, 3)
        figures[f"gateway_p{q}_ms"] = round(through * 1e3, 3)
        figures[f"overhead_p{q}_ms"] = round((through - direct) * 1e3, 3)
    before, after = cpu
    if before is not None and after is not None:
        # The gateway's own CPU per proxied request (warm-up included): a figure that other
        # processes competing for the cores inflate much less than latencies.
        proxied = len(result["gateway"]) * (1 + 0.5 / SECONDS)
        figures["gateway_cpu_per_request_ms"] = round((after - before) / proxied * 1e3, 3)
    load = os.getloadavg()[0]
    figures["load_average_1m"] = round(load, 2)
    benchmark.extra_info.update(figures)
    with capsys.disabled():
        print(
            f"\ngateway overhead at {RATE:g} req/s over {SECONDS:g} s: "
            f"p50 {figures['overhead_p50_ms']} ms, p99 {figures['overhead_p99_ms']} ms "
            f"(direct p50 {figures['direct_p50_ms']} ms / p99 {figures['direct_p99_ms']} ms, "
            f"through the gateway p50 {figures['gateway_p50_ms']} ms / "
            f"p99 {figures['gateway_p99_ms']} ms); gateway CPU per request "
            f"{figures.get('gateway_cpu_per_request_ms')} ms; load average {load:.2f} "
            f"on {os.cpu_count()} cores"
        )


# -- the decision path -----------------------------------------------------------------------

ENDPOINTS = 8
BLOCK = 16
DECISION_GROUP = f"gateway decision path: tokenize chat + admit + pick, {ENDPOINTS} endpoints"


@cache
def _decision_setup(directory: str) -> dict[str, Any]:
    tokenizer = PromptTokenizer(directory)
    words = "you are a helpful assistant that answers briefly hello there how are you today "
    conversations = [
        [
            {"role": "system", "content": f"{words * 20} conversation {c}"},
            {"role": "user", "content": words * 5},
        ]
        for c in range(32)
    ]
    prompts = [tokenizer.chat_tokens(m) for m in conversations]
    ids = [f"10.0.0.{i}:8000" for i in range(ENDPOINTS)]
    index = PrefixIndex(BLOCK)
    twin_index = ReferencePrefixIndex(block_size=BLOCK)
    for c, tokens in enumerate(prompts):
        hashes = index.hash_tokens(tokens)
        index.store(ids[c % ENDPOINTS], hashes)
        twin_index.store(ids[c % ENDPOINTS], hashes.tolist())
    pool = EndpointPool([Endpoint(i, address=i) for i in ids], stale_policy="ignore")
    router = Router(pool, index, "llm-d", seed=0)
    twins = [ReferenceEndpoint(i) for i in ids]
    return {
        "tokenizer": tokenizer,
        "messages": conversations[5],
        "router": router,
        "twin_index": twin_index,
        "twins": twins,
        "router_config": _llm_d_config(),
    }


def _llm_d_config() -> dict[str, Any]:
    from llmsched.routing import load_config

    return load_config("llm-d")


@pytest.fixture(scope="module")
def decision(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _decision_setup(str(write_tokenizer(tmp_path_factory.mktemp("tokenizer"))))


def test_decision_path(benchmark: Any, decision: dict[str, Any]) -> None:
    benchmark.group = DECISION_GROUP
    tokenizer, router = decision["tokenizer"], decision["router"]
    flow = FlowController(FLOW)
    ids = iter(range(1, 1 << 62))

    def path() -> Any:
        tokens = np.asarray(tokenizer.chat_tokens(decision["messages"]), dtype=np.uint32)
        request_id = next(ids)
        assert flow.enqueue(FlowRequest(request_id, prompt_tokens=len(tokens))) is None
        assert flow.dispatch() is not None
        d = router.pick(tokens=tokens, model=MODEL, now=0.0)
        d.started(now=0.0)
        d.finished()
        flow.complete(request_id)
        return d

    assert path().endpoint == "10.0.0.5:8000"  # conversation 5 is held there
    benchmark(path)


def test_decision_path_twin(benchmark: Any, decision: dict[str, Any]) -> None:
    benchmark.group = DECISION_GROUP
    tokenizer = decision["tokenizer"]
    flow = FlowControllerTwin(resolve_config(FLOW))
    ids = iter(range(1, 1 << 62))
    clock = [0.0]

    def path() -> Any:
        tokens = tokenizer.chat_tokens(decision["messages"])
        request_id = next(ids)
        clock[0] += 1e-6
        assert (
            flow.enqueue(request_id, 0, "default", len(tokens), 0, None, None, None, clock[0])
            is None
        )
        assert flow.dispatch(clock[0]) is not None
        d = decide_tokens(
            decision["router_config"], decision["twins"], decision["twin_index"], tokens
        )
        flow.complete(request_id, 0, clock[0])
        return d

    assert path().best == ["10.0.0.5:8000"]
    benchmark(path)


ADMIT_PICK_GROUP = f"gateway admit + pick (tokens given), {ENDPOINTS} endpoints"


def test_admit_pick(benchmark: Any, decision: dict[str, Any]) -> None:
    benchmark.group = ADMIT_PICK_GROUP
    router = decision["router"]
    tokens = np.asarray(decision["tokenizer"].chat_tokens(decision["messages"]), dtype=np.uint32)
    flow = FlowController(FLOW)
    ids = iter(range(1, 1 << 62))

    def path() -> Any:
        request_id = next(ids)
        assert flow.enqueue(FlowRequest(request_id, prompt_tokens=len(tokens))) is None
        assert flow.dispatch() is not None
        d = router.pick(tokens=tokens, model=MODEL, now=0.0)
        d.started(now=0.0)
        d.finished()
        flow.complete(request_id)
        return d

    assert path().endpoint == "10.0.0.5:8000"
    benchmark.extra_info["prompt_tokens"] = len(tokens)
    benchmark(path)


def test_admit_pick_twin(benchmark: Any, decision: dict[str, Any]) -> None:
    benchmark.group = ADMIT_PICK_GROUP
    tokens = decision["tokenizer"].chat_tokens(decision["messages"])
    flow = FlowControllerTwin(resolve_config(FLOW))
    ids = iter(range(1, 1 << 62))
    clock = [0.0]

    def path() -> Any:
        request_id = next(ids)
        clock[0] += 1e-6
        queued = flow.enqueue(request_id, 0, "default", len(tokens), 0, None, None, None, clock[0])
        assert queued is None
        assert flow.dispatch(clock[0]) is not None
        d = decide_tokens(
            decision["router_config"], decision["twins"], decision["twin_index"], tokens
        )
        flow.complete(request_id, 0, clock[0])
        return d

    assert path().best == ["10.0.0.5:8000"]
    benchmark(path)


# -- beside the Rust routers, on the native harness ------------------------------------------

_ROOT = Path(__file__).resolve().parent.parent
_HARNESS = _ROOT / "target" / "release"
_PEERS_PYTHON = Path(
    os.environ.get("LLMSCHED_PEERS_PYTHON", str(_ROOT / ".venv-peers" / "bin" / "python"))
)


def _short_peers_run(
    benchmark: Any, out: Path, *options: str, idle_seconds: str
) -> tuple[list[dict[str, Any]], str]:
    """Runs ``bench_gateway_peers.py``'s short form (one repeat of one second at 300 req/s)
    with ``options`` once under ``benchmark``; its rows (from ``out``) and its printed
    tables."""
    command = [
        sys.executable,
        str(_ROOT / "tools" / "bench_gateway_peers.py"),
        "--bin",
        str(_HARNESS),
        *options,
        "--repeats",
        "1",
        "--seconds",
        "1",
        "--warmup",
        "0.3",
        "--rates",
        "300",
        "--idle-seconds",
        idle_seconds,
        "--json-out",
        str(out),
    ]
    printed: list[str] = []

    def measure() -> None:
        printed.append(subprocess.run(command, check=True, capture_output=True, text=True).stdout)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    tables = printed[0].split("\n\n", 1)[-1]
    return json.loads(out.read_text()), tables


def test_gateway_beside_peers(
    benchmark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The short form of ``make bench-gateway-peers``: one repeat of one second at 300 req/s,
    JSON and streaming, through ``llmsched serve`` and ``llmsched-gateway`` (llm-d and
    round-robin each) and both peers in both modes, in front of the native fake engines; the
    table goes to ``extra_info`` and is printed."""
    if not (_HARNESS / "llmsched-fake-engine").exists():
        pytest.skip("the native harness is not built (cargo build --release -p llmsched-bench)")
    if not _PEERS_PYTHON.exists():
        pytest.skip("sglang-router and vllm-router are not installed (make bench-gateway-peers)")
    benchmark.group = "gateway beside sglang-router and vllm-router (extra_info)"
    rows, tables = _short_peers_run(
        benchmark,
        tmp_path / "rows.json",
        "--peers-python",
        str(_PEERS_PYTHON),
        idle_seconds="0.5",
    )
    gateways = {row["gateway"] for row in rows}
    assert {"llmsched-llm-d", "llmsched-round-robin"} <= gateways
    if (_HARNESS / "llmsched-gateway").exists():
        assert {"llmsched-native-llm-d", "llmsched-native-round-robin"} <= gateways
    assert all(row["errors"] == 0 for row in rows), rows
    benchmark.extra_info["rows"] = rows
    with capsys.disabled():
        print("\n" + tables)


def test_gateway_responses_beside_peers(
    benchmark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The short form of ``bench_gateway_peers.py --responses``: conversations on the
    Responses API (one repeat of one second at 300 req/s, JSON and streaming) through
    ``llmsched serve`` on the native plane (routing on a tokenizer's ids), the peers where
    installed and the bare proxy. ``llmsched serve`` keeps every continuation on the engine
    holding its conversation: none is lost; the others' losses are printed, not asserted."""
    if not (_HARNESS / "llmsched-fake-engine").exists():
        pytest.skip("the native harness is not built (cargo build --release -p llmsched-bench)")
    benchmark.group = "gateway beside sglang-router and vllm-router (extra_info)"
    llmsched = ["llmsched-serve-native-llm-d", "llmsched-serve-native-round-robin"]
    gateways = [*llmsched, "sglang-cache_aware", "vllm-round_robin", "bare-proxy", "direct"]
    peers = ["--peers-python", str(_PEERS_PYTHON)] if _PEERS_PYTHON.exists() else []
    rows, tables = _short_peers_run(
        benchmark,
        tmp_path / "rows.json",
        "--responses",
        "--tokenizer",
        str(write_tokenizer(tmp_path / "tokenizer")),
        "--gateways",
        ",".join(gateways),
        *peers,
        idle_seconds="0",
    )
    by_gateway = {(row["gateway"], row["answer"]): row for row in rows}
    for gateway in llmsched:
        for answer in ("json", "stream"):
            row = by_gateway[(gateway, answer)]
            assert row["continuations"] > 0, row
            assert row["continuations_lost"] == 0, row
            assert row["errors"] == 0, row
    assert all({"continuations", "continuations_lost", "cpu_range"} <= set(r) for r in rows)
    assert "| lost (404) |" in tables
    benchmark.extra_info["rows"] = rows
    with capsys.disabled():
        print("\n" + tables)


# -- prompt tokenization ---------------------------------------------------------------------

TOKENIZE_GROUP = "chat tokenization: a 1,000-token chat, template + encode (native plane vs Python)"


def _chat_of_about(tokenizer: PromptTokenizer, tokens: int) -> list[dict[str, str]]:
    """A system / user / assistant / user chat of about ``tokens`` template token ids."""
    words = "you are a helpful assistant that answers briefly hello there how are you today "
    for repeat in range(1, 400):
        messages = [
            {"role": "system", "content": words * repeat},
            {"role": "user", "content": "tell me a story about a dragon " * repeat},
            {"role": "assistant", "content": "the quick brown fox jumps over the lazy dog"},
            {"role": "user", "content": "and then? 🐉"},
        ]
        if len(tokenizer.chat_tokens(messages)) >= tokens:
            return messages
    raise AssertionError("the words never reach the token count")


@pytest.fixture(scope="module")
def chat_1k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from llmsched import _llmsched

    directory = write_tokenizer(tmp_path_factory.mktemp("tokenizer-1k"))
    tokenizer = PromptTokenizer(directory)
    messages = _chat_of_about(tokenizer, 1000)
    body = json.dumps({"model": MODEL, "messages": messages})
    native = _llmsched.NativePromptTokenizer(str(directory))
    expected = tokenizer.chat_tokens(messages)
    return {
        "python": tokenizer,
        "native": native,
        "body": body,
        "ids": expected,
        "directory": directory,
    }


def test_chat_tokenize(benchmark: Any, chat_1k: dict[str, Any]) -> None:
    """The native plane's per-request tokenization (from the request body's bytes)."""
    benchmark.group = TOKENIZE_GROUP
    native, body = chat_1k["native"], chat_1k["body"]
    assert native.chat_tokens(body) == chat_1k["ids"]
    benchmark.extra_info["prompt_tokens"] = len(chat_1k["ids"])
    benchmark(native.chat_tokens, body)


def test_chat_tokenize_twin(benchmark: Any, chat_1k: dict[str, Any]) -> None:
    """The Python plane's (``tokenizers`` and jinja2, the body parsed with ``json``)."""
    benchmark.group = TOKENIZE_GROUP
    tokenizer, body = chat_1k["python"], chat_1k["body"]

    def path() -> list[int]:
        return tokenizer.chat_tokens(json.loads(body)["messages"], {})

    assert path() == chat_1k["ids"]
    benchmark.extra_info["prompt_tokens"] = len(chat_1k["ids"])
    benchmark(path)


COMPLETION_GROUP = (
    "completion tokenization: 1,000-byte prompts of a shared opening and a turn of their own "
    "(native cache vs native whole vs Python)"
)


@pytest.fixture(scope="module")
def completions_1k(chat_1k: dict[str, Any]) -> dict[str, Any]:
    from llmsched import _llmsched

    directory = chat_1k["directory"]
    whole = _llmsched.NativePromptTokenizer(str(directory), cache_bytes=0)
    expected = [whole.completion_tokens(_completion_body(k)) for k in range(64)]
    return {"ids": expected, "directory": directory, "whole": whole}


def _completion_body(turn: int) -> str:
    opening = "Session 3: " + "context " * 122
    return json.dumps({"model": MODEL, "prompt": f"{opening}turn {turn}"})


def _each_turn(call: Any) -> Any:
    """``call`` on a body never seen before each time (a new turn: its tail is new, as live
    traffic's is; the body's making is timed with it, alike for every row)."""
    turns = iter(range(1000, 1 << 62))
    return lambda: call(_completion_body(next(turns)))


def test_completion_tokenize(benchmark: Any, completions_1k: dict[str, Any]) -> None:
    """The native plane through its tokenizer cache (the opening's chunks found)."""
    from llmsched import _llmsched

    benchmark.group = COMPLETION_GROUP
    native = _llmsched.NativePromptTokenizer(str(completions_1k["directory"]))
    ids = [native.completion_tokens(_completion_body(k)) for k in range(64)]
    assert ids == completions_1k["ids"]
    benchmark(_each_turn(native.completion_tokens))


def test_completion_tokenize_whole(benchmark: Any, completions_1k: dict[str, Any]) -> None:
    """The native plane without its cache (``tokenizer_cache_bytes: 0``): each prompt whole."""
    benchmark.group = COMPLETION_GROUP
    benchmark(_each_turn(completions_1k["whole"].completion_tokens))


def test_completion_tokenize_twin(benchmark: Any, completions_1k: dict[str, Any]) -> None:
    """The Python plane's (``tokenizers``, the body parsed with ``json``)."""
    benchmark.group = COMPLETION_GROUP
    tokenizer = PromptTokenizer(completions_1k["directory"])

    def path(body: str) -> list[int]:
        return tokenizer.completion_tokens(json.loads(body)["prompt"])

    assert [path(_completion_body(k)) for k in range(64)] == completions_1k["ids"]
    benchmark(_each_turn(path))
