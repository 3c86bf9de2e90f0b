"""Chat renders that real models' templates showed to differ from vLLM 0.32's (probe 52: 75
templates from vLLM's examples and llama.cpp's ``models/templates`` against a real vLLM CPU
engine). Each case is a small template that reconstructs the construct of the real one, with
the text vLLM renders for it, checked on the Python plane (:class:`PromptTokenizer`) and the
native plane (``NativePromptTokenizer``: minijinja), so a difference would route every such
request on ids the engine never caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _template_cases import CASES

from llmsched import _llmsched
from llmsched.errors import ConfigError
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptTokenizer

NativePromptTokenizer = _llmsched.NativePromptTokenizer


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fidelity")
    templates = {case[1] for case in CASES}
    return {t: write_tokenizer(root / f"t{i}", chat_template=t) for i, t in enumerate(templates)}


@pytest.mark.parametrize(
    ("template", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_python_plane_renders_what_vllm_renders(
    directories: dict[str, Path], template: str, fields: dict[str, Any], expected: str
) -> None:
    tokenizer = PromptTokenizer(directories[template])
    body = {"model": "m", "add_generation_prompt": False, **fields}
    assert tokenizer.render_chat_request(body) == expected


@pytest.mark.parametrize(
    ("template", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_native_plane_renders_what_vllm_renders(
    directories: dict[str, Path], template: str, fields: dict[str, Any], expected: str
) -> None:
    python = PromptTokenizer(directories[template])
    native = NativePromptTokenizer(str(directories[template]))
    body = {"model": "m", "add_generation_prompt": False, **fields}
    assert native.render_chat(json.dumps(body)) == expected
    assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body)


def test_the_native_plane_refuses_adding_to_safe_text(tmp_path: Path) -> None:
    """Probe 52 F6: ``"..." | safe + text`` is Jinja's ``Markup`` on Python, whose ``+``
    HTML-escapes the text (functionary v3.1's tool list); minijinja cannot do the same, so the
    native plane refuses such a template at load instead of rendering other ids. The Python
    plane renders it as vLLM does."""
    template = (
        '{% for t in tools %}{{ "f:"|safe + t.function.name + "<" }}{% endfor %}'
        "{{ messages[0].content }}"
    )
    directory = write_tokenizer(tmp_path / "markup", chat_template=template)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": 'a"b'}}],
    }
    assert PromptTokenizer(directory).render_chat_request(body) == "f:a&#34;b&lt;q"
    with pytest.raises(ConfigError, match="data_plane: python"):
        NativePromptTokenizer(str(directory))
