"""Feed llmsched's prefix index from a real engine's KV events, then route on what it caches.

Start vLLM with KV events on (block size 16 here; the index's must divide it):

    vllm serve MODEL --block-size 16 --kv-events-config \\
      '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    python examples/kv_events_index.py --engine 10.0.0.7:8000 \\
      --kv-events tcp://10.0.0.7:5557 --replay tcp://10.0.0.7:5558 --tokens 1,2,3,4

A ``Scheduler`` built from the engine's ``EngineSpec`` subscribes to its events while started
(gap detection, replay of missed batches, resynchronisation): the index then holds what the
engine caches, keyed by llmsched's own hash of each block's token ids. The program waits until
the index holds ``--min-blocks`` blocks (or ``--seconds`` pass), prints what it learnt and, given
``--tokens`` (the engine's token ids of a prompt), where that prompt goes and how much of it is
cached there.
"""

from __future__ import annotations

import argparse
import asyncio

from llmsched import Scheduler, ScheduleRequest
from llmsched.integrations import EngineSpec


async def watch(
    spec: EngineSpec, *, block_size: int, seconds: float, min_blocks: int, tokens: list[int]
) -> int:
    """Runs the subscriber until the index holds ``min_blocks`` (exit status 0) or ``seconds``
    pass (1); then places ``tokens`` and prints where they go."""
    scheduler = Scheduler([spec], router="prefix-only", block_size=block_size)
    loop = asyncio.get_running_loop()
    async with scheduler:
        deadline = loop.time() + seconds
        while scheduler.index.stats()["blocks"] < min_blocks and loop.time() < deadline:
            await asyncio.sleep(0.05)
        stats = scheduler.index.stats()
        print(f"index: {stats['blocks']} blocks from {stats['event_batches']} event batches")
        subscriber = scheduler.subscriber
        if subscriber is not None:
            print(f"subscriber: {subscriber.counters()}")
        if tokens:
            async with scheduler.schedule(ScheduleRequest(tokens=tokens)) as placement:
                print(f"prompt of {len(tokens)} tokens -> {placement.endpoint}, ", end="")
                print(f"{placement.cached} tokens cached there")
    return 0 if stats["blocks"] >= min_blocks else 1


def parse_tokens(text: str) -> list[int]:
    """``1,2,3`` or a range ``0-63`` as token ids."""
    if not text:
        return []
    if "-" in text and "," not in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(t) for t in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--engine``, ``--kv-events``, ``--replay``, ``--topic``,
    ``--block-size``, ``--seconds``, ``--min-blocks``, ``--tokens``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="the engine's host:port")
    parser.add_argument("--kv-events", required=True, help="its ZMQ publisher, tcp://host:port")
    parser.add_argument("--replay", help="its replay socket, tcp://host:port")
    parser.add_argument("--topic", default="", help="the topic its events carry")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--min-blocks", type=int, default=1)
    parser.add_argument("--tokens", default="", help="a prompt's token ids: 1,2,3 or 0-63")
    args = parser.parse_args(argv)
    host, _, port = args.engine.rpartition(":")
    spec = EngineSpec(
        host, int(port), kv_events=args.kv_events, replay=args.replay, topic=args.topic
    )
    return asyncio.run(
        watch(
            spec,
            block_size=args.block_size,
            seconds=args.seconds,
            min_blocks=args.min_blocks,
            tokens=parse_tokens(args.tokens),
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
