"""Constructs of real chat templates whose renders differed between llmsched and vLLM 0.32
(probe 52), each a small template with the text vLLM renders for a request: checked on both
planes by ``tests/test_template_fidelity.py`` and against a real engine by
``tests/engines/test_vllm_5_chat_templates.py``."""

from __future__ import annotations

from typing import Any

# Every message with what a thinking template reads off an assistant turn (Qwen3, DeepSeek-R1,
# Seed-OSS, Kimi, MiniMax, GLM... write `reasoning_content` back into the history).
REASONING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
    "{% if m.reasoning %}({{ m.reasoning }}){% endif %}|{% endfor %}"
)

# A template looping over a message's content (vLLM's "openai" content format) that counts
# and indexes the parts, as Kimi K2, Devstral (`content[0]`) and Command A do.
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.content is string %}S{{ m.content }}"
    "{% else %}{{ m.content | length }}{% for p in m.content %}<{{ p.text }}>{% endfor %}"
    "{% endif %}|{% endfor %}"
)

# Granite's and Mistral's tool templates write the calls with tojson.
CALLS_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
    "{% else %}{{ m.role }}:{{ m.content }}{% endif %}|{% endfor %}"
)

# The tools test of vLLM's Hermes tool template, Qwen3-Coder's, Nemotron 3's and Granite
# 20B-FC's: on Python `none is iterable` is false, so a request without tools never reaches
# `length`.
ITERABLE_TEMPLATE = (
    "{% if tools is iterable and tools | length > 0 %}tools:{{ tools | length }}|{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
)

# Gemma 4 writes the system message with `| trim` and loops over contents (so it takes them as
# parts: the system text is the parts list's Python str); Apriel writes each tool with
# `| string`.
STR_TEMPLATE = (
    "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
    "{% if messages[0].role == 'system' %}<sys>{{ messages[0].content | trim }}</sys>{% endif %}"
    "{% for t in tools or [] %}<tool>{{ t | string }}</tool>{% endfor %}"
    "{{ none_value | string }}"
)

CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    "id": "call_1",
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (name, template, request fields, the text vLLM 0.32 renders)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "reasoning-content-is-reasoning",
        REASONING_TEMPLATE,
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "thought"},
                {"role": "user", "content": "q2"},
            ]
        },
        "user:q|assistant:a[thought](thought)|user:q2|",
    ),
    (
        "reasoning-wins-over-reasoning-content",
        REASONING_TEMPLATE,
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "rc"},
            ],
            "add_generation_prompt": False,
        },
        "user:q|assistant:a[r](r)|",
    ),
    (
        "empty-content-is-one-empty-part",
        PARTS_TEMPLATE,
        {"messages": [{"role": "user", "content": ""}]},
        "user:1<>|",
    ),
    (
        "empty-text-parts-are-kept",
        PARTS_TEMPLATE,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": ""}, "x"]},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
            ]
        },
        "user:2<><x>|assistant:1<>|",
    ),
    (
        "tool-call-fields-in-vllm-order",
        CALLS_TEMPLATE,
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
            ]
        },
        'user:q|[{"id": "call_1", "function": {"arguments": {"city": "Paris"}, '
        '"name": "get_weather"}, "type": "function"}]|',
    ),
    (
        "none-is-not-iterable",
        ITERABLE_TEMPLATE,
        {"messages": [{"role": "user", "content": "q"}]},
        "user:q|",
    ),
    (
        "tools-are-iterable",
        ITERABLE_TEMPLATE,
        {"messages": [{"role": "user", "content": "q"}], "tools": [TOOL]},
        "tools:1|user:q|",
    ),
    (
        "trim-and-string-are-python-str",
        STR_TEMPLATE,
        {
            "messages": [
                {"role": "system", "content": "It's  sunny "},
                {"role": "user", "content": "q"},
            ],
            "tools": [TOOL],
        },
        "<sys>[{'type': 'text', 'text': \"It's  sunny \"}]</sys><tool>{'type': 'function', "
        "'function': {'name': 'get_weather', 'description': None, 'parameters': "
        "{'type': 'object'}}}</tool>",
    ),
]
