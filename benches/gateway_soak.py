"""Gateway soak: ``llmsched serve`` (a real process) in front of three fake engines, under a
long mix of normal, client-cancelled and engine-failing requests, with engines stopped and
restarted along the way.

Run it once by hand (it is not part of the test suite)::

    .venv/bin/python benches/gateway_soak.py --requests 100000

Per request kind (share of the mix):

- normal (80 %, half streamed): must get a 200 with the whole answer (the JSON text, or every
  SSE event and ``[DONE]``) and reach exactly one engine (its prompt is unique): any other
  outcome counts as lost, a second arrival as duplicated;
- client-cancelled (8 %): a slow stream the client leaves after a few events;
- engine failures (12 %): the request scripts its engine's failure (``x_fake_mode``: drop,
  error500, cut or hang), so every engine it reaches fails it; it must end in a 502 or an
  aborted response, never a 200 passed off as complete;
- every ``--restart-every`` requests one engine stops listening for ``--down-s`` seconds.

At the end: the gateway's in-flight accounting (flow-control running and queued, each engine's
in-flight count) must be back to zero, and its RSS and open fds are sampled along the way
(first and last tenth compared). Prints one JSON report; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmsched.testing.openai_engine import FakeOpenAIEngine

MODEL = "tiny"
TOKENS = 4
FAULTS = ("drop", "error500", "cut", "hang")


def _expected_text() -> str:
    return "".join(f" t{i}" for i in range(TOKENS))


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.engines = [FakeOpenAIEngine(model=MODEL, answer_tokens=TOKENS) for _ in range(3)]
        self.outcomes: dict[str, dict[str, int]] = {}
        self.normal_sent = 0
        self.normal_ok = 0
        self.lost: list[str] = []
        self.samples: list[tuple[int, int, int]] = []  # (done, rss_kb, fds)
        self.done = 0
        # Normal prompts the engines received, moved out of the engines' request logs every
        # second: 100,000 logged requests would make this process's garbage collector pause
        # the engines (they share its event loop) for longer than the read timeout.
        self.received: dict[str, int] = {}

    def count(self, kind: str, outcome: str) -> None:
        bucket = self.outcomes.setdefault(kind, {})
        bucket[outcome] = bucket.get(outcome, 0) + 1

    async def run(self) -> dict[str, Any]:
        for engine in self.engines:
            await engine.start()
        config = {
            "engines": [e.spec() for e in self.engines],
            "models": [MODEL],
            "scrape": {"enabled": False},
            "flow": {"saturation": {"type": "concurrency", "max_requests": 256}},
            "timeouts": {"read_s": 3.0},
            "retries": {"max_attempts": 3, "eject_s": 0.5},
            "health": {"interval_s": 1.0},
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gateway.yaml"
            path.write_text(yaml.safe_dump(config))
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "llmsched",
                "serve",
                "--config",
                str(path),
                "--port",
                "0",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            assert process.stdout is not None
            line = (await process.stdout.readline()).decode()
            url = line.split("listening on ")[1].split()[0]
            try:
                report = await self._drive(url, process.pid)
            finally:
                process.terminate()
                await process.wait()
        for engine in self.engines:
            await engine.stop()
        return report

    async def _drive(self, url: str, pid: int) -> dict[str, Any]:
        args = self.args
        connector = aiohttp.TCPConnector(limit=args.concurrency)
        started = time.perf_counter()
        async with aiohttp.ClientSession(connector=connector) as client:
            queue: asyncio.Queue[int | None] = asyncio.Queue(maxsize=args.concurrency * 2)

            async def worker() -> None:
                while (i := await queue.get()) is not None:
                    await self._one(client, url, i)
                    self.done += 1

            workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
            restarts = asyncio.ensure_future(self._restarts())
            sampler = asyncio.ensure_future(self._sample(pid))
            for i in range(args.requests):
                await queue.put(i)
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
            restarts.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restarts
            for engine in self.engines:  # every engine back for the final checks
                if not engine.listening:
                    await engine.start()
            await asyncio.sleep(1.5)  # health probes bring restarted engines back
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            self.samples.append((self.done, *_usage(pid)))
            async with client.get(url + "/metrics") as response:
                metrics = await response.text()
        elapsed = time.perf_counter() - started
        return self._report(metrics, elapsed)

    async def _one(self, client: aiohttp.ClientSession, url: str, i: int) -> None:
        roll = self.rng.random()
        stream = self.rng.random() < 0.5
        if roll < 0.80:
            await self._normal(client, url, i, stream)
        elif roll < 0.88:
            await self._cancelled(client, url, i)
        else:
            await self._fault(client, url, i, FAULTS[int((roll - 0.88) / 0.03)], stream)

    async def _normal(self, client: aiohttp.ClientSession, url: str, i: int, stream: bool) -> None:
        self.normal_sent += 1
        body = {"model": MODEL, "prompt": f"soak normal {i}", "stream": stream}
        try:
            async with client.post(url + "/v1/completions", json=body) as response:
                data = await response.read()
                ok = response.status == 200 and _complete(data, stream)
                outcome = "ok" if ok else f"bad_{response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome = f"error_{type(exc).__name__}"
        self.count("normal", outcome)
        if outcome == "ok":
            self.normal_ok += 1
        else:
            self.lost.append(f"{i}: {outcome}")

    async def _cancelled(self, client: aiohttp.ClientSession, url: str, i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"soak cancelled {i}",
            "stream": True,
            "x_fake_mode": "slow",
        }
        try:
            async with client.post(url + "/v1/completions", json=body) as response:
                await response.content.readany()
                response.close()  # the client leaves mid-stream
            self.count("cancelled", "left")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.count("cancelled", f"error_{type(exc).__name__}")

    async def _fault(
        self, client: aiohttp.ClientSession, url: str, i: int, mode: str, stream: bool
    ) -> None:
        body = {"model": MODEL, "prompt": f"soak {mode} {i}", "stream": stream, "x_fake_mode": mode}
        try:
            async with client.post(url + "/v1/completions", json=body) as response:
                data = await response.read()
                complete = response.status == 200 and _complete(data, stream)
                # A fault request must never pass for a complete answer.
                outcome = "passed_off_as_complete" if complete else f"status_{response.status}"
        except aiohttp.ClientPayloadError:
            outcome = "aborted"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome = f"error_{type(exc).__name__}"
        self.count(mode, outcome)

    async def _restarts(self) -> None:
        args = self.args
        next_at = args.restart_every
        while True:
            await asyncio.sleep(0.05)
            if self.done < next_at:
                continue
            next_at += args.restart_every
            engine = self.rng.choice(self.engines)
            await engine.stop()
            await asyncio.sleep(args.down_s)
            await engine.start()
            self.count("engine_restarts", "done")

    async def _sample(self, pid: int) -> None:
        while True:
            self.samples.append((self.done, *_usage(pid)))
            self._collect_received()
            await asyncio.sleep(1.0)

    def _collect_received(self) -> None:
        for engine in self.engines:
            log, engine.received = engine.received, []
            for r in log:
                prompt = r.body.get("prompt")
                if isinstance(prompt, str) and prompt.startswith("soak normal "):
                    self.received[prompt] = self.received.get(prompt, 0) + 1

    def _report(self, metrics: str, elapsed: float) -> dict[str, Any]:
        running = _metric(metrics, "llmsched_gateway_running")
        queued = sum(_metrics(metrics, "llmsched_gateway_queue_length").values())
        in_flight = _metrics(metrics, "llmsched_gateway_endpoint_in_flight")
        self._collect_received()
        duplicated = sum(1 for n in self.received.values() if n > 1)
        never_arrived = self.normal_sent - len(self.received)
        tenth = max(len(self.samples) // 10, 1)
        first, last = self.samples[:tenth], self.samples[-tenth:]
        report = {
            "requests": self.done,
            "seconds": round(elapsed, 1),
            "requests_per_s": round(self.done / elapsed, 1),
            "normal_sent": self.normal_sent,
            "normal_ok": self.normal_ok,
            "normal_lost": len(self.lost),
            "normal_duplicated": duplicated,
            "normal_never_reached_an_engine": never_arrived,
            "lost_examples": self.lost[:10],
            "outcomes": self.outcomes,
            "flow_running_end": running,
            "flow_queued_end": queued,
            "endpoint_in_flight_end": in_flight,
            "rss_kb_first_tenth_max": max(s[1] for s in first),
            "rss_kb_last_tenth_max": max(s[1] for s in last),
            "fds_first_tenth_max": max(s[2] for s in first),
            "fds_last_tenth_max": max(s[2] for s in last),
            "fds_end": self.samples[-1][2],
            "gateway_truncated": _metrics(metrics, "llmsched_gateway_truncated_answers_total"),
            "gateway_ejections": _metrics(metrics, "llmsched_gateway_ejections_total"),
            "gateway_upstream_errors": _metrics(metrics, "llmsched_gateway_upstream_errors_total"),
            "gateway_retries": _metric(metrics, "llmsched_gateway_retries_total"),
            "gateway_breaker_opens": _metrics(metrics, "llmsched_gateway_breaker_opens_total"),
        }
        passed_off = sum(
            bucket.get("passed_off_as_complete", 0)
            for mode, bucket in self.outcomes.items()
            if mode in FAULTS
        )
        report["ok"] = (
            not self.lost
            and not duplicated
            and not passed_off
            and running == 0
            and queued == 0
            and all(v == 0 for v in in_flight.values())
        )
        return report


def _complete(data: bytes, stream: bool) -> bool:
    if stream:
        events = [e for e in data.split(b"\n\n") if e]
        return (
            bool(events)
            and events[-1] == b"data: [DONE]"
            and sum(e.startswith(b"data: {") for e in events) == TOKENS
        )
    try:
        return bool(json.loads(data)["choices"][0]["text"] == _expected_text())
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def _usage(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+)", status)
    rss = int(match.group(1)) if match else 0
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _metrics(text: str, name: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{.*\})? (\S+)$", line)
        if m and m.group(1) == name:
            found[m.group(2) or ""] = float(m.group(3))
    return found


def _metric(text: str, name: str) -> float:
    return sum(_metrics(text, name).values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--restart-every", type=int, default=5_000)
    parser.add_argument("--down-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    report = asyncio.run(Soak(args).run())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
