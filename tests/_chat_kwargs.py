"""A chat template printing the template variables vLLM 0.32 decides from a request's
``chat_template_kwargs``, its fields and the engines' ``--default-chat-template-kwargs``, with
requests and what vLLM rendered for each: shared by the tokenizer tests of both planes
(``test_tokenize_native.py``) and the engine test that serves the template
(``engines/test_vllm_4_engine_options.py``)."""

from __future__ import annotations

from typing import Any

# The template (the engine test serves it with --chat-template).
KWARGS_TEMPLATE = (
    "{{ bos_token }}[tools={{ tools is defined }}:{{ tools | tojson if tools is defined }}]"
    "[docs={{ documents | tojson if documents is defined }}]"
    "[mode={{ mode if mode is defined else 'UNDEF' }}]"
    "[flag={{ flag if flag is defined else 'UNDEF' }}]"
    "[think={{ enable_thinking if enable_thinking is defined else 'UNDEF' }}]"
    "[effort={{ reasoning_effort if reasoning_effort is defined else 'UNDEF' }}]"
    "[pad={{ padding if padding is defined else 'UNDEF' }}]\n"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
KWARGS_DEFAULTS = {"mode": "brief", "flag": True, "tools": [{"d": 1}]}
_TOOL = {"type": "function", "function": {"name": "f"}}
_DUMPED_TOOL = (
    '[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]'
)


def _line(
    tools: str = '[{"d": 1}]',
    docs: str = "null",
    mode: str = "brief",
    think: str = "UNDEF",
    effort: str = "UNDEF",
) -> str:
    return (
        f"[tools=True:{tools}][docs={docs}][mode={mode}][flag=True][think={think}]"
        f"[effort={effort}][pad=UNDEF]"
    )


# Each request's fields and the first line vLLM 0.32.0 rendered for it under KWARGS_TEMPLATE
# and KWARGS_DEFAULTS (/v1/chat/completions/render, December 2026).
KWARGS_CASES: list[tuple[dict[str, Any], str]] = [
    ({}, _line()),
    ({"chat_template_kwargs": {"mode": None, "flag": "auto"}}, _line()),
    ({"chat_template_kwargs": {"mode": "long", "padding": True}}, _line(mode="long")),
    ({"tools": [_TOOL], "tool_choice": "none"}, _line(tools=_DUMPED_TOOL)),
    (
        {"tools": [_TOOL], "tool_choice": "none", "chat_template_kwargs": {"tools": [{"k": 2}]}},
        _line(tools='[{"k": 2}]'),
    ),
    (
        {"tools": [_TOOL], "tool_choice": "none", "chat_template_kwargs": {"tools": None}},
        _line(tools=_DUMPED_TOOL),
    ),
    ({"chat_template_kwargs": {"documents": [{"a": "b"}]}}, _line(docs='[{"a": "b"}]')),
    ({"reasoning_effort": "high"}, _line(think="True", effort="high")),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, _line(effort="low")),
    (
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": None}},
        _line(effort="high"),
    ),
]
