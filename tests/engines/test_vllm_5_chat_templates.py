"""Which chat template a request is rendered with, against a real vLLM engine: a tokenizer
with named templates (``tool_use`` chosen when the template is handed tools, a name chosen by
the request) and an engine started with ``--trust-request-chat-template`` (a request's own
template rendered). Both planes' tokenizers, told the same, compute the engine's own prompt
ids (``return_token_ids``) for every request; an untrusting engine and both planes refuse a
request's own template alike."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _template_cases import CASES

from llmsched import _llmsched
from llmsched.tokenize import PromptError, PromptTokenizer

from .vllm_engine import MODEL_NAME, VllmEngine, scaled, start_engines

BASE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Each template writes its name first, so a wrong choice changes the first block's ids.
NAMED = {
    "tool_use": (
        "tools {{ tools | length }} {{ tools | map(attribute='function.name') | join(',') }}|"
        + BASE
    ),
    "rag": "rag {{ documents | length if documents else 0 }}|" + BASE,
}
DEFAULT = "default|" + BASE
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def named_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with named chat templates beside its default, as transformers saves
    them (``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja``)."""
    model = tmp_path_factory.mktemp("named-templates") / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(DEFAULT)
    extra = model / "additional_chat_templates"
    extra.mkdir()
    for name, template in NAMED.items():
        (extra / f"{name}.jinja").write_text(template)
    return model


@pytest.fixture(scope="module")
def trusting_engine(
    named_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmEngine]:
    logs = tmp_path_factory.mktemp("named-engine-logs")
    engine = VllmEngine(
        named_model,
        "named",
        logs / "named.log",
        extra_args=(
            "--trust-request-chat-template",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
        ),
    )
    start_engines([engine])
    try:
        yield engine
    finally:
        engine.stop()


REQUESTS: list[dict[str, Any]] = [
    {},
    {"tools": [TOOL]},
    # Without --exclude-tools-when-tool-choice-none the template is handed the tools.
    {"tools": [TOOL], "tool_choice": "none"},
    {"chat_template_kwargs": {"tools": [TOOL]}},
    {"tools": [TOOL], "chat_template_kwargs": {"tools": None}},
    {"chat_template": "rag", "documents": [{"title": "t", "text": "x"}]},
    {"chat_template": "tool_use", "tools": [TOOL]},
    {"chat_template": "own {{ messages | length }}|" + BASE},
    # An empty template asks for none; the kwarg is asked for after the field.
    {"chat_template": "", "tools": [TOOL]},
    {"chat_template_kwargs": {"chat_template": "rag"}},
    {"chat_template": "default", "chat_template_kwargs": {"chat_template": "rag"}},
]


def test_requests_render_with_the_template_vllm_chooses(
    trusting_engine: VllmEngine, named_model: Path
) -> None:
    python = PromptTokenizer(named_model, trust_request_chat_template=True)
    native = _llmsched.NativePromptTokenizer(str(named_model), trust_request_chat_template=True)
    assert python.template_names == ["default", "rag", "tool_use"]
    messages = [{"role": "user", "content": "which template renders this conversation"}]
    firsts = set()
    for fields in REQUESTS:
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 1,
            "return_token_ids": True,
            **fields,
        }
        status, text = post_status(trusting_engine, body)
        assert status == 200, (fields, text)
        engine_side = json.loads(text)["prompt_token_ids"]
        assert python.chat_request_tokens(body) == engine_side, fields
        assert native.chat_tokens(json.dumps(body)) == engine_side, fields
        firsts.add(tuple(engine_side[:4]))
    # The cases rendered with at least four different templates.
    assert len(firsts) >= 4


def test_real_templates_constructs_render_as_the_engine_renders_them(
    trusting_engine: VllmEngine, named_model: Path
) -> None:
    """The constructs of real templates that rendered differently (probe 52,
    ``_template_cases.CASES``), each rendered by the engine as the request's own template: the
    engine writes the text the case states, and both planes compute its ids."""
    python = PromptTokenizer(named_model, trust_request_chat_template=True)
    native = _llmsched.NativePromptTokenizer(str(named_model), trust_request_chat_template=True)
    for name, template, fields, expected in CASES:
        body = {
            "model": MODEL_NAME,
            "max_tokens": 1,
            "return_token_ids": True,
            "chat_template": template,
            "add_generation_prompt": False,
            **fields,
        }
        status, text = post_status(trusting_engine, body)
        assert status == 200, (name, text)
        engine_side = json.loads(text)["prompt_token_ids"]
        assert python.render_chat_request(body) == expected, name
        assert python.chat_request_tokens(body) == engine_side, name
        assert native.chat_tokens(json.dumps(body)) == engine_side, name


def post_status(engine: VllmEngine, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        engine.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=scaled(60)) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_an_untrusting_engine_and_both_planes_refuse_a_request_template(
    engines: list[VllmEngine], tiny_model: Path
) -> None:
    """The shared engines run without ``--trust-request-chat-template``."""
    python = PromptTokenizer(tiny_model)
    native = _llmsched.NativePromptTokenizer(str(tiny_model))
    messages = [{"role": "user", "content": "hello"}]
    for fields in [
        {"chat_template": "x"},
        {"chat_template": ""},
        {"chat_template_kwargs": {"chat_template": "x"}},
    ]:
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, **fields}
        status, text = post_status(engines[0], body)
        assert status == 400 and "trust-request-chat-template" in text, (fields, text)
        with pytest.raises(PromptError, match="--trust-request-chat-template"):
            python.chat_request_tokens(body)
        with pytest.raises(ValueError, match="--trust-request-chat-template"):
            native.chat_tokens(json.dumps(body))
    # A null template is no template.
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, "chat_template": None}
    assert post_status(engines[0], body)[0] == 200
    assert python.chat_request_tokens(body) == native.chat_tokens(json.dumps(body))
