"""The chat request the gateway makes of a ``POST /v1/responses`` body (``chat_request_of``)
against vLLM's own conversion (no engine started: vLLM's modules are imported in its
environment, by the shared ``vllm_interpreter``). vLLM turns the body into messages, tools and
template kwargs; the gateway's chat request must give the same ones through vLLM's chat path,
or its blocks miss the engine's cache (probe 65: reasoning items, custom and namespaced tools
were not covered)."""

from __future__ import annotations

from typing import Any

from llmsched.gateway.responses import chat_request_of

from .vllm_interpreter import VllmInterpreter

# What vLLM hands its chat template for each side: the conversation its chat parser makes of
# the messages, the tools as its chat path dumps them, the template kwargs.
COMPARE = """
import json, types
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest, ChatCompletionToolsParam,
)
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts
from vllm.renderers.chat_utils import parse_chat_messages

config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)

def conversation(messages):
    if any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and "image" in str(p.get("type")) for p in m["content"]
    ) for m in messages):
        # Media needs a model's configuration to parse: the messages as they are.
        return json.loads(json.dumps(messages, default=str))
    parsed, _, _ = parse_chat_messages(messages, config, "string")
    return json.loads(json.dumps(parsed, default=str))

def responses_side(body):
    request = ResponsesRequest.model_validate(body)
    messages = construct_input_messages(
        request_instructions=request.instructions, request_input=request.input
    )
    kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    return {"conversation": conversation(messages), "tools": tools, "kwargs": dict(kwargs)}

def chat_side(chat):
    tools = chat.get("tools")
    if tools is not None:
        tools = [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
    shell = {k: v for k, v in chat.items() if k not in ("tools", "tool_choice")}
    shell["messages"] = [{"role": "user", "content": "x"}]
    kwargs = ChatCompletionRequest.model_validate(shell).build_chat_params(
        None, "auto"
    ).chat_template_kwargs
    return {"conversation": conversation(chat["messages"]), "tools": tools, "kwargs": dict(kwargs)}

def main(pairs):
    return {name: [responses_side(body), chat_side(chat)] for name, (body, chat) in pairs.items()}
"""

USER = {"role": "user", "content": "question"}
CALL = {
    "type": "function_call",
    "call_id": "c1",
    "name": "get",
    "arguments": '{"a": 1}',
    "id": "fc_1",
    "status": "completed",
}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "42"}
ANSWER = {
    "type": "message",
    "role": "assistant",
    "id": "msg_1",
    "status": "completed",
    "content": [{"type": "output_text", "text": "ans", "annotations": []}],
}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "think"}],
}
SUMMARY = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]}
TOOL = {
    "type": "function",
    "name": "get",
    "description": "gets",
    "parameters": {"type": "object", "properties": {}},
}
CASES: dict[str, dict[str, Any]] = {
    "string": {"input": "hi", "instructions": "sys"},
    "empty instructions": {"input": "hi", "instructions": ""},
    "messages": {
        "input": [
            USER,
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"role": "developer", "content": "d"},
            {"role": "system", "content": "s"},
        ]
    },
    "assistant items": {
        "input": [USER, ANSWER, USER, {"role": "assistant", "content": "plain"}, USER]
    },
    "two output parts": {
        "input": [
            USER,
            {**ANSWER, "content": [ANSWER["content"][0], {**ANSWER["content"][0], "text": "p2"}]},
        ]
    },
    "function calls": {
        "input": [USER, ANSWER, CALL, {**CALL, "call_id": "c2", "id": "fc_2"}, OUTPUT],
        "tools": [TOOL, {**TOOL, "name": "other", "strict": True}],
        "tool_choice": "auto",
    },
    "tool output parts": {
        "input": [USER, CALL, {**OUTPUT, "output": [{"type": "input_text", "text": "r"}]}]
    },
    "image": {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "see"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,iVBORw0KGgo=",
                        "detail": "auto",  # vLLM's request model fills it in
                    },
                ],
            }
        ]
    },
    "reasoning": {
        "input": [USER, REASONING, CALL, OUTPUT, SUMMARY, ANSWER, REASONING, USER],
        "reasoning": {"effort": "low"},
    },
    "reasoning without id": {
        "input": [USER, {k: v for k, v in REASONING.items() if k != "id"}, ANSWER, USER]
    },
    "reasoning empty": {"input": [USER, {"type": "reasoning", "id": "r", "summary": []}]},
    "reasoning continued": {"input": [USER, {**REASONING, "status": "in_progress"}]},
    "answer continued": {"input": [USER, {**ANSWER, "status": "incomplete"}]},
    "custom tools": {
        "input": [
            USER,
            {"type": "custom_tool_call", "call_id": "c9", "name": "sh", "input": 'echo "é"\n\x01'},
            {"type": "custom_tool_call_output", "call_id": "c9", "output": "a b"},
            {"type": "custom_tool_call", "call_id": "c8", "name": "sh", "input": ""},
        ],
        "tools": [
            {"type": "custom", "name": "sh"},
            {"type": "custom", "name": "p", "description": "d", "format": {"type": "text"}},
        ],
    },
    "namespaces": {
        "input": [
            USER,
            {**CALL, "namespace": "ns", "name": "f"},
            OUTPUT,
            {**CALL, "namespace": ""},
        ],
        "tools": [
            {
                "type": "namespace",
                "name": "ns",
                "description": "d",
                "tools": [
                    {"type": "function", "name": "f", "parameters": {"type": "object"}},
                    {"type": "custom", "name": "c"},
                ],
            },
            TOOL,
        ],
    },
    "built-in tools": {"input": "x", "tools": [{"type": "web_search"}, TOOL]},
    "built-in tools only": {
        "input": "x",
        "tools": [{"type": "mcp", "server_label": "s", "server_url": "http://x"}],
    },
    "tool choice": {
        "input": "x",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get"},
    },
    "effort none, kwargs kept": {
        "input": "x",
        "reasoning": {"effort": "none"},
        "chat_template_kwargs": {"enable_thinking": True, "k": 1},
    },
}


def test_the_gateways_chat_request_renders_as_vllms_responses_conversion(
    vllm_interpreter: VllmInterpreter,
) -> None:
    pairs = {}
    for name, fields in CASES.items():
        body = {"model": "m", **fields}
        chat = chat_request_of(body)
        assert chat is not None, name
        pairs[name] = [body, chat]
    compared = vllm_interpreter.run("responses conversion", COMPARE, pairs)
    for name, (vllm, gateway) in compared.items():
        assert gateway == vllm, name
