"""The gateway's chat template content format against vLLM's own detection (no engine
started: vLLM's renderer module is imported in its environment, by the shared
``vllm_interpreter``)."""

from __future__ import annotations

import sys
from pathlib import Path

from llmsched import _llmsched
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptTokenizer

from .vllm_interpreter import VllmInterpreter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_tokenize_native import CONTENT_FORMATS

DETECT = """
from vllm.renderers.hf import _detect_content_format

def main(templates):
    return {k: _detect_content_format(t, default="string") for k, t in templates.items()}
"""


def test_content_formats_equal_vllms_detection(
    tmp_path: Path, vllm_interpreter: VllmInterpreter
) -> None:
    templates = {name: template for name, (template, _) in CONTENT_FORMATS.items()}
    vllm = vllm_interpreter.run("content formats", DETECT, templates)
    for name, template in templates.items():
        directory = write_tokenizer(tmp_path / name, chat_template=template)
        native = _llmsched.NativePromptTokenizer(str(directory)).content_format
        assert (PromptTokenizer(directory).content_format, native) == (vllm[name],) * 2, name
        assert vllm[name] == CONTENT_FORMATS[name][1], name
