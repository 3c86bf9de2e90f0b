"""OpenAI's Responses API on the gateway: the prompt a ``POST /v1/responses`` request makes,
which engine holds which stored response, and how its answers are read.

vLLM (0.32) keeps each response it makes, and the conversation behind it, in the memory of the
engine that made it: a request continuing a conversation (``previous_response_id``), and
``GET`` / ``cancel`` of a stored response, are answered by that engine alone (any other
answers 404). So the gateway learns each response's engine from its answer
(:class:`ResponseOwners`) and sends the conversation's next request there, which also holds its
KV cache. A request without ``previous_response_id`` is routed as the chat request vLLM makes
of it (:func:`chat_request_of`), so its blocks match what the engine caches. A response made
with ``store`` false is kept by no engine (:func:`stores_response`): its id is not recorded.

The native data plane (``crates/llmsched-gateway/src/responses.rs``) does the same.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "MAX_OWNERS",
    "MAX_RESPONSE_ID_BYTES",
    "OWNER_GRACE_S",
    "LineEnds",
    "ResponseHolder",
    "ResponseIdScan",
    "ResponseOwners",
    "TerminalEventScan",
    "chat_request_of",
    "output_deltas",
    "stores_response",
]

MAX_OWNERS = 100_000
"""Response ids kept (least recently used dropped first): about 10 MB."""

MAX_RESPONSE_ID_BYTES = 256
"""Longer ids are not kept (vLLM's are ``resp_`` and 32 hex digits)."""

_FIRST_EVENT_LIMIT = 64 << 10
"""Bytes of a stream read for its first event (``response.created`` echoes the request's
instructions and tools)."""

_LEADING_ID = re.compile(
    rb'(?:^|\n)data: ?\{\s*"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\\n]{1,256})"'
)
"""The id where vLLM writes it, first in the first event's data (``{"response":{"id":...``):
found without reading the rest of the event, which echoes the request's instructions and
tools and may run past :data:`_FIRST_EVENT_LIMIT`."""

_LEADING_ID_WITHIN = 512
"""Bytes of the stream searched for :data:`_LEADING_ID`."""

_TERMINAL_EVENTS = (
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
    b"event: error\n",
)
"""The events that end a Responses stream (vLLM writes no ``data: [DONE]`` after them)."""

_DELTAS = (b".delta\ndata: ", b".delta\r\ndata: ", b".delta\rdata: ")
"""An output event's name ending its line, as each line end the SSE spec allows writes it."""


def chat_request_of(payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat request vLLM (0.32, models without the Harmony format) renders for a
    ``POST /v1/responses`` body, to be tokenized as a chat request is; None when the body has
    something this conversion does not cover (an input item other than a message, a function
    or custom tool call, its output or a reasoning item; reasoning with encrypted content; a
    tool without a type), which the gateway then routes without prefix hashing.

    ``instructions`` becomes a system message and a string ``input`` a user message; list
    items become messages as vLLM's ``construct_input_messages`` makes them: function and
    custom tool calls join the assistant message before them as ``tool_calls`` (a custom
    call's arguments ``{"input": ...}``, a namespaced call named ``namespace__name``), their
    outputs become tool messages, a reasoning item's text (its first content part's, else
    its first summary's) becomes the ``reasoning`` of the assistant message before it.
    Function tools take the chat shape (``{"type": "function", "function": {...}}``), a
    namespace's functions are flattened (``ns__f``), a custom tool is a function taking one
    string ``input``, other tools (web search, MCP, ...) are left out as vLLM shows them to
    no such model; ``reasoning.effort`` becomes ``reasoning_effort`` (and, unless the request
    sets it, ``enable_thinking``); a last item left ``in_progress`` or ``incomplete`` is
    continued, not answered.

    >>> chat_request_of({"model": "m", "instructions": "Be brief.", "input": "Hi"})["messages"]
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    >>> chat_request_of({"model": "m", "input": [{"type": "image_generation_call"}]}) is None
    True
    """
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    elif instructions is not None and not isinstance(instructions, str):
        return None
    request_input = payload.get("input")
    continue_final = False
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
    elif isinstance(request_input, list):
        for item in request_input:
            if not isinstance(item, dict) or not _add_item(messages, item):
                return None
        last = request_input[-1] if request_input else None
        continue_final = (
            isinstance(last, dict)
            and last.get("type", "message") in ("message", "reasoning")
            and last.get("status") in ("in_progress", "incomplete")
        )
    else:
        return None
    chat: dict[str, Any] = {"model": payload.get("model"), "messages": messages}
    tools = payload.get("tools")
    if tools:
        converted = _chat_tools(tools)
        if converted is None:
            return None
        chat["tools"] = converted
        if "tool_choice" in payload:
            chat["tool_choice"] = payload["tool_choice"]
    kwargs = payload.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    reasoning = payload.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    chat["add_generation_prompt"] = not continue_final
    chat["continue_final_message"] = continue_final
    return chat


_NAMESPACE_SEPARATOR = "__"
"""Between a namespace's name and its function's: vLLM shows a namespace's functions to the
model flattened (``ns__f``)."""

_CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}
"""The parameters of the function vLLM shows the model for a ``custom`` tool (its input is
one string)."""


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A Responses request's tools as the chat tools vLLM renders (None: not covered): a
    function in the chat shape, a namespace's functions flattened (``ns__f``), a custom tool
    as a function taking one string ``input``; other tools (web search, MCP, ...) are not
    shown to a model without the Harmony format: left out."""
    if not isinstance(tools, list):
        return None
    converted: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            return None
        kind = tool["type"]
        if kind == "function":
            converted.append(_chat_function(tool))
        elif kind == "namespace":
            name, inner = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not isinstance(inner, list):
                return None
            for function in inner:
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    return None
                if function.get("type") == "function":
                    flat = f"{name}{_NAMESPACE_SEPARATOR}{function['name']}"
                    converted.append(_chat_function({**function, "name": flat}))
        elif kind == "custom":
            function = {
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": _CUSTOM_TOOL_PARAMETERS,
            }
            converted.append({"type": "function", "function": function})
    return converted


def _chat_function(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> bool:
    """Adds one input item to ``messages`` as vLLM does; False when it is not covered."""
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    kind = item.get("type")
    call: dict[str, Any] | None = None
    if kind == "function_call":
        name = item.get("name")
        namespace = item.get("namespace")
        if namespace:
            if not isinstance(namespace, str) or not isinstance(name, str):
                return False
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
        call = {
            "id": item.get("call_id"),
            "function": {"name": name, "arguments": item.get("arguments")},
            "type": "function",
        }
    elif kind == "custom_tool_call":
        payload = item.get("input") or ""
        if not isinstance(payload, str):
            return False
        # vLLM passes a custom tool's input as its function shim's arguments.
        arguments = json.dumps({"input": payload}, ensure_ascii=False)
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": arguments},
            "type": "function",
        }
    if call is not None:
        if previous is not None and isinstance(previous.get("tool_calls", []), list):
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return True
    if kind in ("function_call_output", "custom_tool_call_output"):
        messages.append(
            {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
        )
        return True
    if kind == "reasoning":
        reasoning = _reasoning_text(item)
        if reasoning is None:
            return False
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "reasoning": reasoning})
        return True
    if item.get("role") == "assistant":
        content = item.get("content")
        text: Any = None
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            first = content[0]
            text = first.get("text") if isinstance(first, dict) else None
        if text is not None:
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
            return True
    if "role" in item and kind in (None, "message"):
        messages.append(item)
        return True
    return False


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """A reasoning item's text as vLLM reads it: its first content part's, else its first
    summary's, else empty; None when not covered (encrypted content, which vLLM refuses, or
    parts of another shape)."""
    if item.get("encrypted_content"):
        return None
    content, summary = item.get("content"), item.get("summary")
    if not isinstance(summary, list) or not isinstance(content, (list, type(None))):
        return None
    parts = content or summary
    if not parts:
        return ""
    first = parts[0]
    text = first.get("text") if isinstance(first, dict) else None
    return text if isinstance(text, str) else None


_PYDANTIC_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
"""The strings pydantic (vLLM's request model) reads as ``true`` for a boolean field."""


def stores_response(payload: Mapping[str, Any]) -> bool:
    """Whether vLLM keeps the response a ``POST /v1/responses`` body makes: unless its
    ``store`` is false, as vLLM's request model reads it (``null``, ``false``, ``0`` and
    ``"no"`` are false; absent is true). A response not kept has no engine to remember: a
    request naming it gets vLLM's 404 from whichever engine is asked.

    >>> stores_response({"input": "x"}), stores_response({"store": False})
    (True, False)
    >>> stores_response({"store": None}), stores_response({"store": "yes"})
    (False, True)
    """
    store = payload.get("store", True)
    if isinstance(store, bool):
        return store
    if isinstance(store, (int, float)):
        return store == 1
    if isinstance(store, str):
        return store.lower() in _PYDANTIC_TRUE
    return False


OWNER_GRACE_S = 30.0
"""Seconds the ids of an engine that left the configuration are kept for its return."""


class ResponseHolder(NamedTuple):
    """Where a stored response is, as far as the gateway knows."""

    engine: str
    """The engine that made it."""
    left: bool
    """Whether that engine left the configuration (less than the grace ago)."""


class ResponseOwners:
    """Which engine made each stored response: at most ``capacity`` ids, least recently used
    dropped first; ids longer than :data:`MAX_RESPONSE_ID_BYTES` are not kept.

    It follows the engines configured (:meth:`engine_joined`, :meth:`engine_left`): an engine
    that leaves keeps its ids for ``grace_s`` as ``left`` (discovery can drop an engine for a
    moment while it still holds them; asking the others would only find none), and gets them
    back if it returns by then; after that they are forgotten. An id answered by an engine no
    longer configured is not kept.

    >>> owners = ResponseOwners(capacity=2)
    >>> owners.engine_joined("e0"); owners.engine_joined("e1")
    >>> owners.record("resp_a", "e0"); owners.record("resp_b", "e1"); owners.record("resp_c", "e0")
    >>> owners.owner("resp_a"), owners.owner("resp_c"), len(owners)
    (None, ResponseHolder(engine='e0', left=False), 2)
    >>> owners.engine_left("e0"); owners.owner("resp_c")
    ResponseHolder(engine='e0', left=True)
    >>> owners.forget_engine("e0"); owners.owner("resp_c"), len(owners)
    (None, 1)
    """

    def __init__(self, capacity: int = MAX_OWNERS, grace_s: float = OWNER_GRACE_S) -> None:
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity
        self._grace_s = grace_s
        self._engines: set[str] = set()
        self._left: dict[str, float] = {}  # engine -> when it left (monotonic)

    def __len__(self) -> int:
        self._expire()
        return len(self._owners)

    def _expire(self) -> None:
        if not self._left:
            return
        now = time.monotonic()
        for engine in [e for e, since in self._left.items() if now - since >= self._grace_s]:
            del self._left[engine]
            self._forget(engine)

    def _forget(self, engine: str) -> None:
        for response_id in [i for i, e in self._owners.items() if e == engine]:
            del self._owners[response_id]

    def engine_joined(self, engine: str) -> None:
        """``engine`` is configured: one that left within the grace gets its ids back."""
        self._expire()
        self._left.pop(engine, None)
        self._engines.add(engine)

    def engine_left(self, engine: str) -> None:
        """``engine`` left the configuration: its ids are ``left`` for the grace."""
        self._expire()
        if engine in self._engines:
            self._engines.discard(engine)
            self._left[engine] = time.monotonic()

    def forget_engine(self, engine: str) -> None:
        """Forgets every id ``engine`` made at once (another engine, or this one restarted,
        now answers under its name)."""
        self._left.pop(engine, None)
        self._forget(engine)

    def record(self, response_id: str, engine: str) -> None:
        """``engine`` made (and stores) ``response_id``; not kept when ``engine`` is neither
        configured nor within its grace (it left while answering)."""
        if not response_id or len(response_id.encode("utf-8", "surrogatepass")) > (
            MAX_RESPONSE_ID_BYTES
        ):
            return
        self._expire()
        if engine not in self._engines and engine not in self._left:
            return
        self._owners[response_id] = engine
        self._owners.move_to_end(response_id)
        while len(self._owners) > self._capacity:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> ResponseHolder | None:
        """Where ``response_id`` is, or None when not known here (a lookup counts as a use)."""
        self._expire()
        engine = self._owners.get(response_id)
        if engine is None:
            return None
        self._owners.move_to_end(response_id)
        return ResponseHolder(engine, engine in self._left)


def response_id_of(body: bytes) -> str | None:
    """The ``id`` of a JSON Responses answer, else None.

    >>> response_id_of(b'{"id": "resp_1", "object": "response"}')
    'resp_1'
    """
    try:
        value = json.loads(body)
    except ValueError:
        return None
    ident = value.get("id") if isinstance(value, dict) else None
    return ident if isinstance(ident, str) else None


class LineEnds:
    """An event stream's line ends made LF, chunk by chunk, split anywhere: the SSE spec
    allows CRLF (as ``sse-starlette`` writes them), a lone CR and LF.

    >>> ends = LineEnds()
    >>> [ends.to_lf(chunk) for chunk in (b"a\\r", b"\\nb\\rc\\r\\n", b"\\r")]
    [b'a\\n', b'b\\nc\\n', b'\\n']
    """

    __slots__ = ("_after_cr",)

    def __init__(self) -> None:
        self._after_cr = False

    def to_lf(self, chunk: bytes) -> bytes:
        """``chunk``, the stream's next bytes, with each line end as LF."""
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]  # the LF of a CRLF split between chunks: its CR ended the line
        if not chunk:
            return chunk
        self._after_cr = chunk[-1:] == b"\r"
        if b"\r" not in chunk:
            return chunk
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class ResponseIdScan:
    """The response id a Responses event stream announces in its first event
    (``response.created``: ``{"response": {"id": ...}}``), fed the stream chunk by chunk:
    read where vLLM writes it, first in the event's data, whatever the event's length, else
    from the whole event read up to 64 KiB. :attr:`id` is None until found, and stays None
    when the first event has none."""

    __slots__ = ("_buffer", "_done", "_line_ends", "id")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._done = False
        self._line_ends = LineEnds()
        self.id: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self._done:
            return
        chunk = self._line_ends.to_lf(chunk)
        searched = len(self._buffer) < _LEADING_ID_WITHIN
        self._buffer += chunk
        first = self._buffer.find(b"\n\n", 0, _LEADING_ID_WITHIN)  # the first event's end
        within = _LEADING_ID_WITHIN if first < 0 else first
        if searched and (leading := _LEADING_ID.search(self._buffer, 0, within)):
            self._done = True
            with contextlib.suppress(UnicodeDecodeError):
                self.id = bytes(leading.group(1)).decode()
            self._buffer.clear()  # after the match is read: it views the buffer
            return
        end = self._buffer.find(b"\n\n")
        if end < 0:
            if len(self._buffer) > _FIRST_EVENT_LIMIT:
                self._done = True
                self._buffer.clear()
            return
        self._done = True
        event = bytes(self._buffer[:end])
        self._buffer.clear()
        data = b"".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        try:
            value = json.loads(data)
        except ValueError:
            return
        response = value.get("response") if isinstance(value, dict) else None
        ident = response.get("id") if isinstance(response, dict) else None
        if isinstance(ident, str):
            self.id = ident


class TerminalEventScan:
    """Whether a Responses event stream has shown, whole, the event that ends it
    (``response.completed``, ``response.incomplete``, ``response.failed`` or ``error``): its
    name at the start of a line, then the blank line that closes the event (a stream cut
    inside its data is cut). Fed chunk by chunk, split anywhere, with any of the line ends the
    SSE spec allows (:class:`LineEnds`)."""

    __slots__ = ("_ending", "_line_ends", "_tail", "seen")

    _LONGEST = max(len(event) for event in _TERMINAL_EVENTS)

    def __init__(self) -> None:
        self.seen = False
        self._ending = False
        self._tail = b"\n"
        self._line_ends = LineEnds()

    def feed(self, chunk: bytes) -> None:
        if self.seen:
            return
        joined = self._tail + self._line_ends.to_lf(chunk)
        if not self._ending:
            # Each name must start a line: a data field quoting one is no event.
            found = [
                at + len(event)
                for event in _TERMINAL_EVENTS
                if (at := joined.find(b"\n" + event)) >= 0
            ]
            if not found:
                self._tail = joined[-self._LONGEST :]
                return
            self._ending = True
            joined = joined[min(found) :]  # from the newline ending the event's name
        if b"\n\n" in joined:
            self.seen = True
        self._tail = joined[-1:]


def output_deltas(chunk: bytes) -> int:
    """Events of a Responses stream chunk that carry output (``*.delta``: text, reasoning,
    function arguments), counted as output tokens (vLLM sends one per token by default)."""
    return sum(chunk.count(delta) for delta in _DELTAS)
