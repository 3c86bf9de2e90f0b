"""A fake OpenAI-compatible engine for tests and benchmarks: a real aiohttp server on the
caller's event loop (the OpenAI API; :class:`~llmsched.testing.fake_engine.FakeHTTPEngine`
serves scripted metrics on a thread).

It answers ``/v1/completions`` and ``/v1/chat/completions`` in vLLM's shapes (JSON, or SSE
``data: {...}`` events ending with ``data: [DONE]`` when ``stream`` is true), the Responses API
as vLLM 0.32 serves it (``POST /v1/responses``: JSON, or named SSE events ending with
``response.completed`` and no ``[DONE]``; ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` from its own store, :attr:`FakeOpenAIEngine.responses`; an
unknown ``previous_response_id`` is vLLM's 404; ``store`` false keeps nothing, and a
``background`` request then, or on an engine not storing, is vLLM's 400; an ``instructions``
that is neither a string nor null is vLLM's 400). As vLLM, it stores a response once it is
generated (a stream's just before its ``response.completed``; a stream cut before then is never
stored) and a ``background`` one at once as ``"queued"``; a background stream is generated
apart from the request that started it, and ``GET /v1/responses/{id}?stream=true``
(``&starting_after=N``) replays its events from the one after ``N``, waiting for the rest
until ``response.completed`` (a background stream cancelled before then leaves its readers
waiting, as vLLM's do); for any other stored response that GET sends the head of a stream and
then closes the connection, as vLLM's fails. A background request that is not streamed stays
``"queued"`` until cancelled (its generation is not simulated). It serves a
vLLM-style ``/metrics`` with its live request counts, and records every request it receives
(path, headers, body) and every client disconnect. Its :attr:`FakeOpenAIEngine.mode` scripts
failures: ``"ok"``, ``"drop"`` (close the connection before answering), ``"error500"``,
``"error400"`` (a refusal, as vLLM refuses a request it cannot run),
``"stall"`` (never answer), ``"slow"`` (``token_delay_s`` between streamed tokens; a Responses
JSON answer after as long as its stream would take), ``"cut"``
(send the status line and part of the answer, then close the connection: a stream after its
first event, a JSON answer halfway through its declared length), ``"cut_mid_event"`` (a
stream's first event and half of its second, then the close), ``"no_done"`` (a stream that
ends cleanly without its ``[DONE]``, a Responses stream without its ``response.completed``),
``"hang"`` (the same, then
silence instead of a close), ``"headers"`` (the status line and headers of the answer, chunked,
then silence: as vLLM sends a stream's head before its prefill). A request may script its own
failure with a body field ``x_fake_mode`` naming a mode (it wins over
:attr:`~FakeOpenAIEngine.mode`).
:attr:`FakeOpenAIEngine.health_status` scripts ``/health``.
Fields vLLM checks (``max_tokens``, ``stream``, ``stream_options``, ``prompt``, ``messages``)
get vLLM's 400 when malformed. Output token ``k`` reads `` t<k>`` with id
``OUTPUT_ID_BASE + k``; one listed in ``stop_token_ids`` ends the answer as vLLM's stop token
does: counted and in ``token_ids``, its text left out, ``finish_reason`` ``"stop"`` and the id
as ``stop_reason`` (an answer ended otherwise has no ``stop_reason`` field).

>>> import asyncio, aiohttp
>>> async def demo():
...     async with FakeOpenAIEngine(model="tiny", answer_tokens=3) as engine:
...         async with aiohttp.ClientSession() as s:
...             body = {"model": "tiny", "prompt": "hi"}
...             async with s.post(engine.url + "/v1/completions", json=body) as r:
...                 return (await r.json())["choices"][0]["text"], len(engine.received)
>>> asyncio.run(demo())
(' t0 t1 t2', 1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["FakeOpenAIEngine", "ReceivedRequest", "main", "write_tokenizer"]

MODES = (
    "ok",
    "drop",
    "error500",
    "error400",
    "stall",
    "slow",
    "cut",
    "cut_mid_event",
    "no_done",
    "hang",
    "headers",
)


@dataclass
class _EventLog:
    """The events of a background stream as they are generated (vLLM's ``event_store``)."""

    events: list[bytes] = field(default_factory=list)
    grew: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ReceivedRequest:
    """One request as the engine received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    host: str
    received_at: float = field(default_factory=time.monotonic)


class FakeOpenAIEngine:
    """A scripted OpenAI-compatible engine on ``host:port`` (port 0 picks a free one).

    Args:
        model: the served model name.
        answer_tokens: tokens per answer (capped by the request's ``max_tokens``).
        token_delay_s: pause between streamed tokens in mode ``"slow"``.
        host, port: where to listen.
    """

    def __init__(
        self,
        *,
        model: str = "fake",
        answer_tokens: int = 4,
        token_delay_s: float = 0.05,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        self.answer_tokens = answer_tokens
        self.token_delay_s = token_delay_s
        self.host = host
        self._requested_port = port
        self.mode = "ok"
        self.received: list[ReceivedRequest] = []
        self.sent: list[bytes] = []
        """The body of each answer, as written (for byte-exact passthrough checks)."""
        self.disconnects = 0
        self.disconnected = asyncio.Event()
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.metrics_status = 200
        """Status of ``/metrics`` answers (anything but 200 makes scrapes fail)."""
        self.metrics_extra = ""
        """Text sent after the metrics on ``/metrics`` (odd lines a test scripts)."""
        self.metrics_prefix = ""
        """Text sent before the metrics on ``/metrics`` (to make the body long)."""
        self.loras: tuple[list[str], list[str], int] | None = None
        """LoRA adapters running and waiting, and the most it holds at once, served as vLLM's
        ``vllm:lora_requests_info`` (None: not served)."""
        self.adapters: dict[str, str] = {}
        """LoRA adapters listed by ``/v1/models`` beside :attr:`model`, each with its base
        model (as vLLM lists them, with ``parent``)."""
        self.max_model_len: int | None = None
        """``max_model_len`` of :attr:`model` in ``/v1/models`` (None: not listed)."""
        self.models_status = 200
        """Status of ``/v1/models`` answers."""
        self.models_body: bytes | None = None
        """The body of ``/v1/models`` answers, sent as given (None: the listing)."""
        self.models_requests = 0
        self.sse_line_end = b"\n"
        """The line end of streamed Completions and Chat Completions events (the SSE spec
        allows ``b"\\r\\n"`` and ``b"\\r"`` besides ``b"\\n"``; each event ends with two)."""
        self.chunked_json = False
        """Send JSON answers of modes ``"cut"`` / ``"hang"`` chunked (no Content-Length)."""
        self.health_status = 200
        """Status of ``/health`` answers (anything but 200 fails the gateway's probes)."""
        self.health_probes = 0
        self.responses: dict[str, dict[str, Any]] = {}
        """The Responses API's store: each stored response by its id."""
        self.responses_store = True
        """Whether ``store`` is honoured (vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``); when
        False nothing is stored, as vLLM by default."""
        self._event_logs: dict[str, _EventLog] = {}
        self._background: dict[str, asyncio.Task[None]] = {}
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        # Bodies as large as a gateway may pass on (vLLM sets no bound of its own).
        self.app = web.Application(client_max_size=64 << 20)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/metrics", self._metrics),
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.post("/v1/responses", self._create_response),
                web.get("/v1/responses/{response_id}", self._retrieve_response),
                web.post("/v1/responses/{response_id}/cancel", self._cancel_response),
            ]
        )

    @property
    def port(self) -> int:
        """The port listened on (after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("the fake engine is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def spec(self) -> dict[str, Any]:
        """This engine's entry for a gateway config's ``engines`` list."""
        return {"host": self.host, "port": self.port, "model": self.model}

    async def start(self) -> None:
        """Listens (again, on the same port after a :meth:`stop`)."""
        # Stopping waits at most a moment for answers in progress (a hung one never ends).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        port = self._port if self._port is not None else self._requested_port
        site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
        await site.start()
        address = self._runner.addresses[0]
        self._port = int(address[1])

    async def stop(self) -> None:
        """Stops listening (connections are then refused), closes open connections and ends
        the generation of background streams."""
        for task in list(self._background.values()):
            task.cancel()
        for task in list(self._background.values()):
            await asyncio.gather(task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def listening(self) -> bool:
        """Whether the engine is started (and not stopped since)."""
        return self._runner is not None

    async def __aenter__(self) -> FakeOpenAIEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def paths(self) -> list[str]:
        """Paths of the requests received, in order."""
        return [r.path for r in self.received]

    # -- handlers ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        self.models_requests += 1
        if self.models_status != 200:
            return _bad_request("models listing refused", status=self.models_status)
        if self.models_body is not None:
            return web.Response(body=self.models_body, content_type="application/json")
        cards: list[dict[str, Any]] = [{"id": self.model, "root": self.model, "parent": None}]
        if self.max_model_len is not None:
            cards[0]["max_model_len"] = self.max_model_len
        cards += [
            {"id": name, "root": f"/adapters/{name}", "parent": base}
            for name, base in sorted(self.adapters.items())
        ]
        data = [{"object": "model", "created": 0, "owned_by": "vllm", **card} for card in cards]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        return web.Response(text="", status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(text="unavailable", status=self.metrics_status)
        text = (
            f'vllm:num_requests_running{{model_name="{self.model}"}} {float(self.running)}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} {float(self.waiting)}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} {self.kv_cache_usage}\n'
        )
        if self.loras is not None:
            running, waiting, most = self.loras
            text += (
                f'vllm:lora_requests_info{{max_lora="{most}",'
                f'running_lora_adapters="{",".join(running)}",'
                f'waiting_lora_adapters="{",".join(waiting)}"}} {time.time()}\n'
            )
        text = self.metrics_prefix + text + self.metrics_extra
        return web.Response(text=text, content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("the body is not valid JSON")
        problem = _check_body(body, chat=chat)
        if problem is not None:
            return _bad_request(problem)
        return await self._running(request, body, self._answer(request, body, chat=chat))

    async def _running(
        self,
        request: web.Request,
        body: dict[str, Any],
        answer: Coroutine[Any, Any, web.StreamResponse],
    ) -> web.StreamResponse:
        """Records a request and counts it running while ``answer`` serves it; a client that
        leaves meanwhile is counted as a disconnect."""
        self.received.append(
            ReceivedRequest(request.path, dict(request.headers), body, request.host)
        )
        self.running += 1
        try:
            return await answer
        except asyncio.CancelledError:
            self.disconnects += 1
            self.disconnected.set()
            raise
        except ConnectionError:  # the client left while the answer was being written
            self.disconnects += 1
            self.disconnected.set()
            return web.Response(status=499)  # never sent: the connection is gone
        finally:
            self.running -= 1

    async def _create_response(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("the body is not valid JSON")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        if not isinstance(body.get("input"), (str, list)):
            return _bad_request("input must be a string or a list")
        if not isinstance(body.get("instructions"), (str, type(None))):
            return _bad_request("instructions must be a string", "body.instructions")
        store = body.get("store", True)
        if body.get("background") and not store:
            return _bad_request("background can only be used when `store` is true", "background")
        if body.get("background") and not self.responses_store:
            return _bad_request(
                "This vLLM engine does not support `store=True` and therefore does not support "
                "the background mode.",
                "background",
            )
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            return _not_found(str(previous))
        return await self._running(request, body, self._answer_response(request, body))

    async def _answer_response(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        mode = body.get("x_fake_mode", self.mode)
        if mode in ("drop", "error500", "error400", "stall", "headers"):
            return await self._answer(request, body, chat=True)
        max_tokens = body.get("max_output_tokens")
        n = (
            self.answer_tokens
            if not isinstance(max_tokens, int)
            else min(max_tokens, self.answer_tokens)
        )
        pieces = [f" t{i}" for i in range(n)]
        ident = f"resp_{len(self.received)}_{self.port}"
        stored = bool(body.get("store", True)) and self.responses_store
        background = bool(body.get("background"))
        if background:  # stored at once, before it is generated (vLLM's "queued")
            self.responses[ident] = _response_object(ident, body, [], "queued")
        if not body.get("stream"):
            if mode == "slow":  # generated before it is answered
                await asyncio.sleep(self.token_delay_s * (n + 2))
            final = _response_object(ident, body, pieces, "completed")
            if stored and not background:  # stored once generated
                self.responses[ident] = final
            answer = json.dumps(self.responses[ident] if background else final).encode()
            self.sent.append(answer)
            if mode in ("cut", "hang"):
                return await self._break_off(request, answer, mode)
            return web.Response(body=answer, content_type="application/json")
        if background:
            log = self._event_logs[ident] = _EventLog()
            task = asyncio.create_task(self._generate(ident, body, pieces, mode, log))
            self._background[ident] = task
            task.add_done_callback(lambda _: self._background.pop(ident, None))
            return await self._replay(request, log, 0, mode)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        written = bytearray()
        self.sent.append(b"")
        for i, (kind, data) in enumerate(_response_events(ident, body, pieces, mode)):
            if kind == "response.completed" and stored:
                # vLLM stores a streamed response as it completes, before this event.
                self.responses[ident] = _response_object(ident, body, pieces, "completed")
            if mode == "slow" and i:
                await asyncio.sleep(self.token_delay_s)
            if mode in ("cut", "hang") and i:
                await self._stop_answering(request, mode)
            if mode == "cut_mid_event" and i:
                await response.write(data[: len(data) // 2])
                await self._stop_answering(request, "cut")
            written += data
            self.sent[-1] = bytes(written)
            await response.write(data)
        await response.write_eof()
        return response

    async def _generate(
        self, ident: str, body: dict[str, Any], pieces: list[str], mode: str, log: _EventLog
    ) -> None:
        """Generates a background stream into ``log``, apart from any request reading it; the
        stored response is completed with its last event (unless cancelled meanwhile)."""
        for i, (kind, data) in enumerate(_response_events(ident, body, pieces, mode)):
            if mode == "slow" and i:
                await asyncio.sleep(self.token_delay_s)
            if kind == "response.completed" and self.responses[ident]["status"] != "cancelled":
                self.responses[ident] = _response_object(ident, body, pieces, "completed")
            log.events.append(data)
            log.grew.set()

    async def _replay(
        self, request: web.Request, log: _EventLog, start: int, mode: str
    ) -> web.StreamResponse:
        """The events of a background stream from the ``start``-th, as they come, until its
        ``response.completed`` (broken off after the first in modes ``"cut"``, ``"hang"`` and
        ``"cut_mid_event"``)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        written = bytearray()
        self.sent.append(b"")
        at = start
        while True:
            log.grew.clear()
            while at < len(log.events):
                data = log.events[at]
                if mode in ("cut", "hang") and written:
                    await self._stop_answering(request, mode)
                if mode == "cut_mid_event" and written:
                    await response.write(data[: len(data) // 2])
                    await self._stop_answering(request, "cut")
                written += data
                self.sent[-1] = bytes(written)
                await response.write(data)
                if data.startswith(b"event: response.completed\n"):
                    await response.write_eof()
                    return response
                at += 1
            await log.grew.wait()

    async def _retrieve_response(self, request: web.Request) -> web.StreamResponse:
        ident = request.match_info["response_id"]
        self.received.append(ReceivedRequest(request.path, dict(request.headers), {}, request.host))
        stream = _query_bool(request.query.get("stream", "false"))
        after = request.query.get("starting_after")
        if stream is None or (after is not None and not re.fullmatch(r"[+-]?\d+", after.strip())):
            return _bad_request("stream must be a boolean and starting_after an integer")
        found = self.responses.get(ident)
        if found is None:
            return _not_found(ident)
        if not stream:
            return web.json_response(found)
        log = self._event_logs.get(ident)
        if log is None:
            # vLLM fails after sending the head: its stream replays background streams only.
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream; charset=utf-8"}
            )
            await response.prepare(request)
            await self._stop_answering(request, "cut")
            return response  # not reached
        start = 0 if after is None else int(after) + 1
        return await self._replay(request, log, max(start, 0), "ok")

    async def _cancel_response(self, request: web.Request) -> web.Response:
        ident = request.match_info["response_id"]
        self.received.append(ReceivedRequest(request.path, dict(request.headers), {}, request.host))
        found = self.responses.get(ident)
        if found is None:
            return _not_found(ident)
        if found["status"] not in ("queued", "in_progress"):
            return _bad_request("Cannot cancel a synchronous response.", "response_id")
        found["status"] = "cancelled"
        task = self._background.get(ident)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return web.json_response(found)

    async def _answer(
        self, request: web.Request, body: dict[str, Any], *, chat: bool
    ) -> web.StreamResponse:
        mode = body.get("x_fake_mode", self.mode)
        if mode == "drop":
            if request.transport is not None:
                request.transport.close()
            await asyncio.sleep(3600)  # cancelled when the connection goes
        if mode == "error500":
            return web.json_response({"error": {"message": "engine failure"}}, status=500)
        if mode == "error400":
            return _bad_request("the engine refuses this request")
        if mode == "stall":
            await asyncio.sleep(3600)
        if mode == "headers":
            kind = "text/event-stream; charset=utf-8" if body.get("stream") else "application/json"
            head_only = web.StreamResponse(headers={"Content-Type": kind})
            await head_only.prepare(request)
            await asyncio.sleep(3600)  # cancelled when the connection goes
        max_tokens = body.get("max_tokens")
        n = (
            self.answer_tokens
            if not isinstance(max_tokens, int)
            else min(max_tokens, self.answer_tokens)
        )
        # Output token k reads " t<k>" with id OUTPUT_ID_BASE + k; a continuation (its
        # earlier output in the prompt) carries on the count.
        done = _generated_before(body, chat=chat)
        stop_ids = body.get("stop_token_ids")
        stop_reason = None
        if isinstance(stop_ids, list):
            hit = next((i for i in range(n) if OUTPUT_ID_BASE + done + i in stop_ids), None)
            if hit is not None:
                n, stop_reason = hit + 1, OUTPUT_ID_BASE + done + hit
        pieces = [f" t{done + i}" for i in range(n)]
        if stop_reason is not None:
            pieces[-1] = ""  # vLLM leaves a stop token's text out of the output
        ids = (
            [OUTPUT_ID_BASE + done + i for i in range(n)] if body.get("return_token_ids") else None
        )
        created = int(time.time())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.received)}"
        if not body.get("stream"):
            full = _full_answer(ident, created, body, pieces, chat=chat, stop_reason=stop_reason)
            if ids is not None:
                full["choices"][0]["token_ids"] = ids
            answer = json.dumps(full).encode()
            self.sent.append(answer)
            if mode in ("cut", "hang"):
                return await self._break_off(request, answer, mode)
            return web.Response(body=answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        written = bytearray()
        end = self.sse_line_end * 2
        self.sent.append(b"")
        for i, piece in enumerate(pieces):
            if mode == "slow" and i:
                await asyncio.sleep(self.token_delay_s)
            if mode in ("cut", "hang") and i:
                await self._stop_answering(request, mode)
            finish = None if i < n - 1 else "length" if stop_reason is None else "stop"
            chunk = _chunk(ident, created, body, piece, finish, chat=chat)
            if finish == "stop":
                chunk["choices"][0]["stop_reason"] = stop_reason
            if ids is not None:
                chunk["choices"][0]["token_ids"] = [ids[i]]
            event = b"data: " + json.dumps(chunk).encode()
            if mode == "cut_mid_event" and i:
                await response.write(event[: len(event) // 2])
                await self._stop_answering(request, "cut")
            written += event + end
            self.sent[-1] = bytes(written)
            await response.write(event + end)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = _full_answer(ident, created, body, pieces, chat=chat)["usage"]
            event = b"data: " + json.dumps({"id": ident, "choices": [], "usage": usage}).encode()
            written += event + end
            await response.write(event + end)
        if mode != "no_done":
            written += b"data: [DONE]" + end
            self.sent[-1] = bytes(written)
            await response.write(b"data: [DONE]" + end)
        await response.write_eof()
        return response

    async def _break_off(
        self, request: web.Request, answer: bytes, mode: str
    ) -> web.StreamResponse:
        """A JSON answer whose declared length never fully arrives."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if not self.chunked_json:
            response.content_length = len(answer)
        await response.prepare(request)
        await response.write(answer[: len(answer) // 2])
        await self._stop_answering(request, mode)
        return response  # not reached

    async def _stop_answering(self, request: web.Request, mode: str) -> None:
        """``"cut"``: closes the connection mid-answer; ``"hang"``: goes silent."""
        if mode == "cut" and request.transport is not None:
            request.transport.close()
        await asyncio.sleep(3600)  # cancelled when the connection goes


def _bad_request(message: str, param: str | None = None, status: int = 400) -> web.Response:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": status}
    return web.json_response({"error": error}, status=status)


def _not_found(response_id: str) -> web.Response:
    """vLLM's answer for a response id it does not hold."""
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    return web.json_response({"error": error}, status=404)


def _response_object(
    ident: str, body: dict[str, Any], pieces: list[str], status: str
) -> dict[str, Any]:
    """A Responses API ``response`` object in vLLM's shape (the fields clients read)."""
    text = "".join(pieces)
    prompt_tokens = len(json.dumps(body.get("input"))) // 4
    output = [
        {
            "id": f"msg_{ident}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]
    return {
        "id": ident,
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": status,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "output": output if pieces else [],
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": len(pieces),
            "total_tokens": prompt_tokens + len(pieces),
        },
    }


def _response_events(
    ident: str, body: dict[str, Any], pieces: list[str], mode: str
) -> list[tuple[str, bytes]]:
    """A Responses stream's named events, each as written (no ``response.completed`` in
    mode ``"no_done"``)."""
    started = _response_object(ident, body, [], "in_progress")
    events: list[dict[str, Any]] = [
        {"response": started, "type": "response.created"},
        {"response": started, "type": "response.in_progress"},
    ]
    events += [
        {"delta": piece, "item_id": f"msg_{ident}", "type": "response.output_text.delta"}
        for piece in pieces
    ]
    done = "response.output_text.done"
    events.append({"text": "".join(pieces), "item_id": f"msg_{ident}", "type": done})
    if mode != "no_done":
        final = _response_object(ident, body, pieces, "completed")
        events.append({"response": final, "type": "response.completed"})
    out = []
    for i, event in enumerate(events):
        event["sequence_number"] = i
        data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
        out.append((str(event["type"]), data))
    return out


def _query_bool(text: str) -> bool | None:
    """A query parameter read as FastAPI reads a ``bool`` (None: not one)."""
    value = text.strip().lower()
    if value in ("1", "true", "on", "yes", "t", "y"):
        return True
    if value in ("0", "false", "off", "no", "f", "n"):
        return False
    return None


def _check_body(body: Any, *, chat: bool) -> str | None:
    """What vLLM's request validation would refuse with a 400 (the fields this fake reads)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        return "max_tokens must be an integer >= 1"
    if not isinstance(body.get("stream", False), (bool, type(None))):
        return "stream must be a boolean"
    if not isinstance(body.get("stream_options") or {}, dict):
        return "stream_options must be an object"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "messages must be a list of objects"
    elif not isinstance(body.get("prompt"), (str, list)) and not (
        # vLLM's --enable-prompt-embeds: the prompt as base64 tensors instead.
        body.get("prompt") is None and isinstance(body.get("prompt_embeds"), (str, list))
    ):
        return "prompt must be a string or a list"
    return None


OUTPUT_ID_BASE = 1000
"""Token id of the fake's first output token (``" t0"``)."""

_PIECE = re.compile(r" t\d+")


def _generated_before(body: dict[str, Any], *, chat: bool) -> int:
    """Output tokens of an earlier call found in a continuation's prompt."""
    if chat:
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        if body.get("continue_final_message") and isinstance(last.get("content"), str):
            return len(_PIECE.findall(last["content"]))
        return 0
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return sum(1 for t in prompt if isinstance(t, int) and t >= OUTPUT_ID_BASE)
    return len(_PIECE.findall(prompt)) if isinstance(prompt, str) else 0


def _full_answer(
    ident: str,
    created: int,
    body: dict[str, Any],
    pieces: list[str],
    *,
    chat: bool,
    stop_reason: int | None = None,
) -> dict[str, Any]:
    text = "".join(pieces)
    finish = "length" if stop_reason is None else "stop"
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": body.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": prompt_tokens + len(pieces),
        },
    }


def _chunk(
    ident: str,
    created: int,
    body: dict[str, Any],
    piece: str,
    finish: str | None,
    *,
    chat: bool,
) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
    return {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": body.get("model"),
        "choices": [choice],
    }


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The chat template :func:`write_tokenizer` saves unless told otherwise."""

_CORPUS = [
    "you are a helpful assistant that answers briefly",
    "hello there how are you today",
    "tell me a story about a dragon and a knight",
    "the quick brown fox jumps over the lazy dog",
] * 20


def write_tokenizer(
    directory: str | Path, *, template_file: bool = False, **config: object
) -> Path:
    """Trains a small byte-level BPE tokenizer (BOS added by its post-processor) and saves
    it the way ``save_pretrained`` lays a ``PreTrainedTokenizerFast`` out:
    ``tokenizer.json``, ``tokenizer_config.json`` with :data:`CHAT_TEMPLATE` (or in
    ``chat_template.jinja`` when ``template_file``). ``config`` overrides config entries
    (``chat_template=None`` leaves the template out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    settings: dict[str, object] = {
        # The form transformers writes for an AddedToken special token.
        "bos_token": {
            "__type": "AddedToken",
            "content": "<s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "eos_token": "</s>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template_file:
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        settings["chat_template"] = CHAT_TEMPLATE
    settings.update(config)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llmsched.testing.openai_engine --engines 2``: serve fake engines until
    SIGINT / SIGTERM; prints their ports as one JSON line once listening."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--answer-tokens", type=int, default=4)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)

    async def serve() -> None:
        engines = [
            FakeOpenAIEngine(model=args.model, answer_tokens=args.answer_tokens, host=args.host)
            for _ in range(args.engines)
        ]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for engine in engines:
            await engine.start()
        print(json.dumps({"ports": [e.port for e in engines]}), flush=True)
        try:
            await stop.wait()
        finally:
            for engine in engines:
                await engine.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
