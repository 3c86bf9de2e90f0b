"""A custom routing scorer in Python: keep each request in its client's zone, cache permitting.

    python examples/python_scorer.py --engine 10.0.0.1:8000=eu --engine 10.0.0.2:8000=us \\
        --request eu:"Summarise this contract" --request us:"Translate to French: hi"

A ``python-scorer`` plugin is a function ``(request, endpoints) -> one score in [0, 1] per
endpoint``, named in the router config like any built-in plugin and weighted beside them (here
with llm-d's prefix-cache and queue scorers). It runs once per decision with the GIL held: keep
it cheap. Each request is scheduled through ``llmsched.Scheduler``, sent to the engine chosen,
and printed with the table of every scorer's score (``Placement.explain()``).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

import aiohttp

from llmsched import Scheduler, ScheduleRequest
from llmsched.integrations import EngineSpec
from llmsched.types import CandidateInfo, RequestInfo

ZONE_HEADER = "x-zone"


def zone_affinity(request: RequestInfo, endpoints: list[CandidateInfo]) -> Sequence[float]:
    """1 for an endpoint in the request's zone (header ``x-zone``), 0 for one elsewhere, 0.5
    for every endpoint when the request names no zone."""
    zone = request["headers"].get(ZONE_HEADER)
    if zone is None:
        return [0.5] * len(endpoints)
    return [1.0 if e["labels"].get("zone") == zone else 0.0 for e in endpoints]


def router_config(zone_weight: float = 3.0) -> dict[str, object]:
    """llm-d's scorers plus the zone scorer, in ``EndpointPickerConfig`` shape."""
    return {
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "queue-scorer"},
            {"type": "python-scorer", "name": "zone", "parameters": {"function": zone_affinity}},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "zone", "weight": zone_weight},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def engine_spec(text: str) -> EngineSpec:
    """``host:port=zone`` as an engine labelled with its zone."""
    address, _, zone = text.partition("=")
    host, _, port = address.rpartition(":")
    return EngineSpec(host, int(port), labels={"zone": zone} if zone else {})


async def run(engines: list[EngineSpec], requests: list[tuple[str, str]], model: str) -> list[str]:
    """Schedules and sends each ``(zone, prompt)``; returns the worker id each one went to."""
    scheduler = Scheduler(engines, router=router_config(), allow_pseudo_tokens=True)
    placed = []
    async with scheduler, aiohttp.ClientSession() as session:
        for zone, prompt in requests:
            headers = {ZONE_HEADER: zone} if zone else {}
            request = ScheduleRequest(text=prompt, model=model, headers=headers)
            async with scheduler.schedule(request) as placement:
                body = {"model": model, "prompt": prompt, "max_tokens": 8}
                url = f"http://{placement.address}/v1/completions"
                async with session.post(url, json=body) as answer:
                    answer.raise_for_status()
                    text = (await answer.json())["choices"][0]["text"]
                placement.first_token()
                placed.append(str(placement.endpoint))
                print(f"[{zone or '-'}] {prompt!r} -> {placement.endpoint}: {text!r}")
                print(placement.explain(), end="\n\n")
    return placed


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--engine host:port=zone`` and ``--request zone:prompt`` (repeatable)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="host:port=zone")
    parser.add_argument("--request", action="append", required=True, help="zone:prompt")
    parser.add_argument("--model", default="fake")
    args = parser.parse_args(argv)
    engines = [engine_spec(e) for e in args.engine]
    requests = [
        (r.partition(":")[0], r.partition(":")[2]) if ":" in r else ("", r) for r in args.request
    ]
    asyncio.run(run(engines, requests, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
