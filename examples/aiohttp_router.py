"""A minimal OpenAI-style router on llmsched's request pipeline (``llmsched.Scheduler``).

    python examples/aiohttp_router.py --engine 127.0.0.1:8001 --engine 127.0.0.1:8002
    curl -s localhost:8080/v1/completions -d '{"model": "m", "prompt": "Hello", "max_tokens": 8}'

Each request is admitted by flow control (tenant and priority from headers), placed by the
router, proxied, moved to the next fallback when the engine cannot be reached, and accounted
for when it ends. Needs ``llmsched[gateway]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web

from llmsched import Scheduler, ScheduleRequest
from llmsched.errors import FlowRejected, NoEndpointError
from llmsched.integrations import EngineSpec


def make_app(scheduler: Scheduler, session: aiohttp.ClientSession) -> web.Application:
    """The router: ``POST /v1/completions`` through ``scheduler`` to the engines."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            payload = json.loads(body)
            prompt = payload.get("prompt")
            form = {"tokens": prompt} if isinstance(prompt, list) else {"text": prompt}
            scheduled = ScheduleRequest(
                **form,
                model=payload.get("model"),
                tenant=request.headers.get("x-tenant", "default"),
                priority=int(request.headers.get("x-priority", "0")),
                size_bytes=len(body),
            )
        except (ValueError, AttributeError) as exc:  # llmsched's InvalidRequestError too
            return web.json_response({"error": str(exc)}, status=400)
        try:
            async with scheduler.schedule(scheduled) as placement:
                while True:  # the next fallback while engines cannot be reached
                    url = f"http://{placement.address}/v1/completions"
                    try:
                        async with session.post(url, json=payload) as upstream:
                            answer = await upstream.read()
                    except aiohttp.ClientConnectionError:
                        placement.retry()  # NoEndpointError when none is left
                        continue
                    placement.first_token()
                    if upstream.status >= 500:
                        placement.fail()  # the engine's record goes, its answer is relayed
                    return web.json_response(body=answer, status=upstream.status)
        except FlowRejected as rejected:
            headers = {"Retry-After": str(round(rejected.retry_after_s or 1))}
            error = {"error": f"not admitted: {rejected.reason}"}
            return web.json_response(error, status=rejected.http_status, headers=headers)
        except NoEndpointError as exc:
            return web.json_response({"error": str(exc)}, status=503)

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    return app


async def serve(engines: list[str], host: str, port: int, router: str) -> None:
    """Runs the router until cancelled; prints the URL it listens on."""
    specs = [EngineSpec(h, int(p)) for h, _, p in (e.rpartition(":") for e in engines)]
    flow = {"saturation": {"type": "concurrency", "max_requests": 64 * len(specs)}}
    scheduler = Scheduler(specs, router=router, flow=flow)
    async with scheduler, aiohttp.ClientSession() as session:
        runner = web.AppRunner(make_app(scheduler, session))
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"listening on http://{host}:{runner.addresses[0][1]}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--engine host:port`` (repeatable), ``--host``, ``--port``, ``--router``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", required=True, help="host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--router", default="llm-d", help="a preset or a config file")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.engine, args.host, args.port, args.router))


if __name__ == "__main__":
    main()
