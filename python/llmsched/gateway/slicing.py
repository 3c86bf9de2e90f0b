"""Token slices in the gateway: one request decoded as several engine calls.

A request is cut with :class:`~llmsched.SliceAssembler` (continuation = prompt plus the tokens
generated so far) and budgeted by a :class:`~llmsched.SliceTracker`. Each slice is routed
afresh by the router (the engine holding the conversation's KV usually wins on its prefix),
streamed from the engine, and stitched back into one response: a single JSON answer, or one SSE
stream when the client asked for ``stream``, whose chunks go out as the assembler releases
them (as each engine chunk comes; with stop strings, less the text's last longest-stop-minus-one
characters, held until a stop string straddling them is ruled out). At each boundary
the tracker decides whether the request continues, yields (its flow-control slot goes back and
the continuation queues again at the decided priority) or migrates.

Not covered: retries within a sliced request (a failed slice ends it with 502, or, once the
stream started, with an SSE error event and a stream closed without ``[DONE]``), and requests
the assembler cannot slice (``n > 1``, ``logprobs``, batched prompts), which are proxied
unsliced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
from aiohttp import web

from llmsched.errors import (
    ConfigError,
    FlowRejected,
    InvalidRequestError,
    InvalidTokenError,
    SliceStateError,
)
from llmsched.flow import FlowController
from llmsched.gateway.responses import LineEnds
from llmsched.scheduler import Admission, Placement, ScheduleRequest
from llmsched.slices import SliceAssembler, SliceTracker, WaitingRequest
from llmsched.tokenize import Truncation

if TYPE_CHECKING:
    from llmsched.gateway.app import Gateway, Refusal

__all__ = ["SliceFailed", "SlicedRequest", "make_assembler"]

# At most this many queued requests are described to the tracker at a boundary.
_WAITING_SAMPLE = 16

# The rejection reason of a slice whose decision a router plugin failed (the refusal's
# x-llmsched-dropped-reason).
_ROUTING_FAILED = "routing_failed"


class SliceFailed(Exception):
    """An engine call of a sliced request failed (status or connection). ``answer``: the
    engine's own refusal of the request's first slice (status, body, content type), which the
    client gets as an unsliced request would. ``routing``: the gateway's answer to a slice's
    decision a router plugin failed (a 500 ``routing failed: ...``, as an unsliced request
    gets), no engine's failure."""

    def __init__(
        self,
        message: str,
        answer: tuple[int, bytes, str] | None = None,
        *,
        routing: Refusal | None = None,
    ) -> None:
        super().__init__(message)
        self.answer = answer
        self.routing = routing


# The most of an engine's refusal that is passed on (vLLM's error bodies are a few hundred
# bytes).
_REFUSAL_LIMIT = 64 << 10

# The most of one engine event held while its end (a blank line) is awaited: the 8 MiB the
# gateway reads of any engine answer it holds whole. An event past it ends the request.
_EVENT_LIMIT = 8 << 20


def make_assembler(
    payload: Mapping[str, Any], route: str, default_max_tokens: int
) -> SliceAssembler | None:
    """The assembler of a request, or None when it cannot be sliced."""
    try:
        return SliceAssembler(
            payload,
            api="chat" if route == "chat" else "completions",
            default_max_tokens=default_max_tokens,
        )
    except ConfigError:
        return None


class SlicedRequest:
    """One sliced request through the gateway (see the module docstring)."""

    def __init__(
        self,
        gateway: Gateway,
        tracker: SliceTracker,
        assembler: SliceAssembler,
        *,
        route: str,
        request_id: int,
        admission: Admission,
        tenant: str,
        priority: int,
        prompt_tokens: int,
        stream: bool,
        base_pick_args: Mapping[str, Any],
        deadline: float | None = None,
    ) -> None:
        self.gateway = gateway
        self.tracker = tracker
        self.asm = assembler
        self.route = route
        self.request_id = request_id
        self.admission: Admission | None = admission
        """The current admission (a new one after a yield; None while a continuation waits to
        be admitted again)."""
        self.stream = stream
        self._charged = 0
        self.tenant = tenant
        self.priority = priority
        self.prompt_tokens = prompt_tokens
        self.base_pick_args = dict(base_pick_args)
        self.deadline = deadline
        """The request's deadline (monotonic seconds; None: none), applied to every slice."""
        self.endpoints: list[str] = []
        """The engine of every slice, in order."""
        self._request: web.Request | None = None
        self._response: web.StreamResponse | None = None
        """The client's SSE response, prepared with the first chunk released (a streamed
        answer)."""

    async def run(self, request: web.Request) -> web.StreamResponse:
        """Runs every slice; returns the response sent to the client."""
        self._request = request
        try:
            slice_tokens = 0
            first = True
            while True:
                body = self.asm.next_request(max(slice_tokens, 1))
                placement = self._place(body)
                if placement is None:
                    raise SliceFailed("no engine can serve the continuation")
                # Picked and in flight; the exit completes it, or fails it (dropping its
                # approximate prefix record) when the slice failed.
                with placement:
                    endpoint = str(placement.endpoint)
                    if first:
                        start = self.tracker.admit(
                            self.request_id,
                            prompt_tokens=self.prompt_tokens,
                            max_tokens=self.asm.remaining_tokens,
                            endpoint=endpoint,
                            priority=self.priority,
                        )
                        body = self.asm.next_request(start.slice_tokens)
                        first = False
                    elif self._paused():
                        start = self.tracker.resume(self.request_id, endpoint=endpoint)
                        body = self.asm.next_request(start.slice_tokens)
                    self.endpoints.append(endpoint)
                    await self._call(endpoint, body, placement)
                self.gateway.metrics.slices.inc()
                left = self.tracker.record_tokens(self.request_id, self.asm.last_slice_tokens)
                if self.asm.done:
                    break
                # A call the assembler cut short (at min_tokens) is no boundary: the rest of
                # the tracker's slice follows without a decision.
                slice_tokens = left if left > 0 else await self._boundary()
            if not self.stream:
                answer = web.json_response(self.asm.response())
                self.gateway.metrics.requests.labels(self.route, "200").inc()
                return answer
            response = await self._stream_response()
            await self._write(response, b"data: [DONE]\n\n")
            await response.write_eof()
            # Counted as an unsliced answer is, as on the native plane (a client gone before
            # its end is counted ``client_gone`` instead).
            self.gateway.metrics.requests.labels(self.route, "200").inc()
            return response
        except SliceFailed as failed:
            started = self._response
            if started is None and failed.answer is not None:
                status, data, kind = failed.answer
                self.gateway.metrics.requests.labels(self.route, str(status)).inc()
                return web.Response(status=status, body=data, headers={"Content-Type": kind})
            # A failed decision (a router plugin's error) and the request's own deadline
            # (timeouts.total_s) are no engine's failure: the client is told which (the
            # refusal, or its error event), counted as the request's rejection of that reason.
            routing = failed.routing
            timed_out = (
                routing is None and self.deadline is not None and time.monotonic() >= self.deadline
            )
            endpoint = self.endpoints[-1] if self.endpoints else "none"
            if started is None:
                if routing is not None:
                    return self.gateway.refuse(self.route, routing)
                if timed_out:
                    return self.gateway.refuse(self.route, _deadline_refusal())
                self.gateway.metrics.upstream_errors.labels(endpoint, "slice").inc()
                return self.gateway.refuse(
                    self.route, _upstream_refusal(f"a slice failed: {failed}")
                )
            if routing is not None:
                self.gateway.metrics.rejections.labels(_ROUTING_FAILED).inc()
            elif timed_out:
                self.gateway.metrics.rejections.labels("timeout").inc()
            else:
                self.gateway.metrics.upstream_errors.labels(endpoint, "slice").inc()
            # Part of the stream went out: the client must not take it for a whole answer.
            await self.gateway.abort_response(
                request, started, endpoint, sse=True, timed_out=timed_out, refusal=routing
            )
            self.gateway.metrics.requests.labels(self.route, "aborted").inc()
            return started
        finally:
            self.tracker.remove(self.request_id)

    def _place(self, body: Mapping[str, Any]) -> Placement | None:
        """The placement of the slice ``body`` (None: no engine can serve it); a failed
        decision (a router plugin's error) fails the slice with the gateway's refusal of it,
        as on the native plane."""
        from llmsched.gateway.app import Refusal  # app imports this module

        try:
            return self.gateway.place(self._scheduled(body))
        except Refusal as refusal:
            raise SliceFailed(refusal.message, routing=refusal) from None

    def uncharged_tokens(self) -> int:
        """Output tokens not yet charged to the tenant in flow control: the slice in progress
        included (what a client that left mid-slice had been sent and the engine produced)."""
        return self.asm.produced_tokens - self._charged

    def _paused(self) -> bool:
        state = self.tracker.state(self.request_id)
        return state is not None and state.phase != "running"

    def _scheduled(self, body: Mapping[str, Any]) -> ScheduleRequest:
        """A slice's call as the scheduler places it."""
        try:
            return ScheduleRequest(**self._pick_args(body), tenant=self.tenant)
        except (InvalidRequestError, InvalidTokenError) as exc:
            raise SliceFailed(f"the continuation cannot be routed: {exc}") from None

    def _pick_args(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Routing input of a slice's call: its whole prompt (the continuation included)."""
        args = {
            k: v for k, v in self.base_pick_args.items() if k not in ("tokens", "text", "messages")
        }
        tokenizer = self.gateway.tokenizer
        if self.route == "chat":
            messages = body["messages"]
            if tokenizer is not None:
                # The continuation as the engine renders it (its body carries
                # continue_final_message and add_generation_prompt).
                ids = tokenizer.chat_request_tokens(body)
                args["tokens"] = np.asarray(ids, dtype=np.uint32)
            else:
                args["messages"] = messages
            return args
        prompt = body["prompt"]
        if isinstance(prompt, list):
            truncation = Truncation.read(
                body.get("truncate_prompt_tokens"), body.get("truncation_side")
            )
            if truncation is not None:
                prompt = truncation.cut(prompt)
            args["tokens"] = np.asarray(prompt, dtype=np.uint32)
        elif tokenizer is not None:
            add_special_tokens = body.get("add_special_tokens")
            ids = tokenizer.completion_tokens(
                prompt,
                True if add_special_tokens is None else add_special_tokens,
                body.get("truncate_prompt_tokens"),
                body.get("truncation_side"),
            )
            args["tokens"] = np.asarray(ids, dtype=np.uint32)
        else:
            args["text"] = prompt
        return args

    async def _call(self, endpoint: str, body: dict[str, Any], placement: Placement) -> None:
        """One slice's engine call, streamed into the assembler; the user chunks it releases go
        to a streamed answer as they come."""
        session = self.gateway.upstream_session()
        url = self.gateway.upstream_url(endpoint, self.route)
        if url is None:
            raise SliceFailed(f"engine {endpoint} was removed by discovery")
        try:
            deadline = self.deadline
            timeout = None if deadline is None else self.gateway.upstream_timeout(deadline)
            async with session.post(url, json=body, timeout=timeout) as upstream:
                if upstream.status != 200:
                    answer = None
                    if len(self.endpoints) == 1 and 400 <= upstream.status < 500:
                        # The engine refused the request itself (a prompt past its context, a
                        # field it does not take): the client's own mistake, answered as the
                        # engine gave it rather than as the gateway's 502.
                        data = await upstream.content.read(_REFUSAL_LIMIT)
                        kind = upstream.headers.get("Content-Type", "application/json")
                        answer = (upstream.status, data, kind)
                    raise SliceFailed(f"engine answered {upstream.status}", answer)
                buffered = bytearray()
                first = True
                # Events end at a blank line, whichever line ends the engine (or a proxy
                # before it) writes: the SSE spec allows CRLF and a lone CR besides LF.
                line_ends = LineEnds()
                async for raw in upstream.content.iter_any():
                    if first:
                        placement.first_token()
                        first = False
                    data = line_ends.to_lf(raw)
                    # An event's end may straddle two reads: the buffer's last byte with these.
                    ends = b"\n\n" in buffered[-1:] + data
                    buffered += data
                    chunks: list[dict[str, Any]] = []
                    if ends:
                        *events, rest = buffered.split(b"\n\n")
                        buffered = bytearray(rest)
                        for event in events:
                            chunks.extend(self._feed(bytes(event)))
                    if len(buffered) > _EVENT_LIMIT:
                        # Held whole until its end came, an event has a bound, as any engine
                        # answer the gateway reads whole: past it the request ends.
                        raise SliceFailed(
                            f"an event of the engine's stream exceeds {_EVENT_LIMIT >> 20} MiB"
                        )
                    await self._pass_on(chunks)
                tail = self._feed(bytes(buffered)) if buffered.strip() else []
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise SliceFailed(type(exc).__name__) from None
        try:
            tail.extend(self.asm.end_slice())
        except SliceStateError as exc:  # a stream the assembler cannot continue from
            raise SliceFailed(str(exc)) from None
        await self._pass_on(tail)

    async def _pass_on(self, chunks: list[dict[str, Any]]) -> None:
        """Writes released user chunks to a streamed answer (nothing for a JSON answer)."""
        if not self.stream or not chunks:
            return
        response = await self._stream_response()
        events = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
        await self._write(response, events)

    async def _stream_response(self) -> web.StreamResponse:
        """The client's SSE response, prepared on first use."""
        if self._response is None:
            assert self._request is not None
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream; charset=utf-8"}
            )
            await response.prepare(self._request)
            self._response = response
        return self._response

    @staticmethod
    async def _write(response: web.StreamResponse, data: bytes) -> None:
        """Writes to the client. A client gone ends the request as the cancellation of its
        handler does (``handler_cancellation``), whichever comes first: the engine call in
        flight is dropped and the request counted ``client_gone`` once. (The write's error
        must not pass for the engine's: aiohttp's reset error is a ``ClientError`` too.)"""
        try:
            await response.write(data)
        except ConnectionError:
            raise asyncio.CancelledError from None

    def _feed(self, event: bytes) -> list[dict[str, Any]]:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return []
            try:
                return self.asm.feed(json.loads(data))
            except ValueError as exc:
                raise SliceFailed(f"malformed engine event: {exc}") from None
        return []

    async def _boundary(self) -> int:
        """The tracker's decision at a slice boundary; returns the next slice's length."""
        self._report_loads()
        decision = self.tracker.decide(
            self.request_id, waiting=self._waiting(), now=time.monotonic()
        )
        if decision.action == "finish":
            raise SliceFailed("the slice tracker finished the request before its end")
        admission = self.admission
        if decision.action == "yield" and admission is not None and admission.holds_slot:
            # Give the slot back; the continuation queues again like a new request would
            # (its admission needs its size only: the slice's prompt is built afterwards).
            admission.release(self.uncharged_tokens())
            self._charged = self.asm.produced_tokens
            self.admission = None
            continuation = ScheduleRequest(
                tokens=(),
                prompt_tokens=decision.context_tokens,
                priority=decision.priority,
                tenant=self.tenant,
            )
            try:
                self.admission = await self.gateway.scheduler.admit(continuation)
            except FlowRejected as rejected:
                raise SliceFailed(f"continuation not admitted: {rejected.reason}") from None
        return decision.next_slice_tokens

    def _report_loads(self) -> None:
        """Reports the load of each engine in routing; the tracker's others (drained, down,
        their breaker open) are taken out, so none is a migration target on the load it
        last reported."""
        reported = set()
        for endpoint in self.gateway.pool.endpoints():
            name = str(endpoint["id"])
            reported.add(name)
            self.tracker.set_endpoint(
                name,
                kv_cache_usage=float(endpoint["kv_cache_usage"]),
                waiting=int(endpoint["waiting"]),
            )
        for name in self.tracker.endpoints:
            if name not in reported:
                self.tracker.remove_endpoint(name)

    def _waiting(self) -> list[WaitingRequest]:
        """The requests queued in flow control, as the tracker sees them (their sizes are not
        exported by the controller: each counts as a short new request)."""
        flow: FlowController | None = self.gateway.flow
        if flow is None:
            return []
        quantum = self.tracker.quantum(0)
        queued = (
            WaitingRequest(int(band["priority"]), 0, 0, quantum)
            for band in flow.metrics()["bands"]
            for _ in range(int(band["queued"]))
        )
        return list(itertools.islice(queued, _WAITING_SAMPLE))


def _upstream_refusal(message: str) -> Refusal:
    from llmsched.gateway.app import Refusal

    return Refusal(502, "upstream_error", message)


def _deadline_refusal() -> Refusal:
    """The 504 of a request whose deadline passed before its answer began (the gateway's own
    answer to it, unsliced)."""
    from llmsched.gateway.app import Refusal

    return Refusal(504, "timeout", "the request's deadline (timeouts.total_s) passed")
