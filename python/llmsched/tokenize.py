"""Prompt tokenization that reproduces the token ids a vLLM engine feeds its model.

Needs the ``tokenize`` extra (``pip install 'llmsched[tokenize]'``: ``tokenizers`` and
``jinja2``); importing this module without it raises ``ImportError`` naming the extra.

A :class:`PromptTokenizer` loads a directory written by ``save_pretrained`` (``tokenizer.json``,
``tokenizer_config.json`` and possibly ``chat_template.jinja``) with the ``tokenizers``
library alone, so the gateway needs neither ``transformers`` nor ``torch``:

- completions: a string prompt is encoded with the tokenizer's special tokens (vLLM's
  ``add_special_tokens=True`` default for ``/v1/completions``); a list of token ids is used
  as is;
- chat: the messages are rendered through the tokenizer's chat template the way Hugging Face
  ``apply_chat_template`` does (sandboxed Jinja, ``trim_blocks``, ``lstrip_blocks``,
  ``raise_exception``, ``tojson``, the special tokens as variables,
  ``add_generation_prompt=True``), and the text is encoded *without* adding special tokens
  again (vLLM's chat default ``add_special_tokens=False``: the template writes them).
  List contents are reduced to their text parts joined by newlines and a null content to
  ``""``, vLLM's "string" content format; a conversation with a media part (an image,
  audio, video) is rendered up to the start of the first message holding one.

Route and index on these ids: they equal the engine's when both load the same files, so the
blocks an engine reports in its KV events match the prompts picked with
``Router.pick(tokens=tokenizer.chat_tokens(messages))``. ``Router.pick(text=...)`` hashes
pseudo-tokens instead, which never meet an engine's real ids. The gateway uses this module.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from llmsched._extras import require

require("tokenize", "tokenizers", "jinja2", feature="llmsched.tokenize")

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmsched.errors import ConfigError

__all__ = ["PromptError", "PromptTokenizer"]

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class PromptError(ValueError):
    """A prompt or a chat conversation cannot be turned into tokens (answered with HTTP 400)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's assistant-mask marker):
    renders its body unchanged, so templates that use it parse."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's declared class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face overrides Jinja's HTML-escaping tojson with plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as saved: a str, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class PromptTokenizer:
    """Token ids for completion prompts and chat conversations (see the module docstring).

    Args:
        directory: a ``save_pretrained`` tokenizer directory.

    Raises :class:`~llmsched.errors.ConfigError` when the directory cannot be loaded or its
    chat template does not compile.
    """

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        try:
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ConfigError(f"tokenizer: cannot load {str(path)!r}: {exc}") from None
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except ValueError as exc:
                raise ConfigError(f"tokenizer: {str(config_path)!r}: {exc}") from None
        self._special = {
            key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))
        }
        source = _chat_template_source(path, config)
        self._template: jinja2.Template | None = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[_GenerationTag, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateError as exc:
                raise ConfigError(f"tokenizer: chat template does not compile: {exc}") from None

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be tokenized."""
        return self._template is not None

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens the chat template sees (``bos_token``, ``eos_token``, ...)."""
        return dict(self._special)

    def completion_tokens(self, prompt: Any) -> list[int]:
        """The ids of a ``/v1/completions`` prompt: a str (encoded with special tokens) or a
        list of ids (returned as is). A batch (a list of prompts) yields its first prompt's."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return prompt
        raise PromptError("prompt must be a string or a list of token ids")

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None
    ) -> str:
        """The chat template's text for ``messages`` with ``add_generation_prompt=True``.

        ``extra``: further template variables (``tools``, ``chat_template_kwargs`` items).
        A conversation holding a media part (an image, audio, video or embeddings) renders
        up to the start of the first message holding one: the engine puts the media's
        placeholder tokens there and hashes the media into the cache blocks after it, so
        that beginning is what a router can match.
        """
        if self._template is None:
            raise PromptError("the configured tokenizer has no chat template")
        variables: dict[str, Any] = dict(self._special)
        variables.update(extra or {})
        variables["messages"], media = _string_contents(messages)
        variables.setdefault("add_generation_prompt", True)
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise PromptError(f"chat template: {exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            # jinja2 lets a Python error inside the template through (``None + "x"`` on a
            # message without a field): the request's shape caused it, so it is the client's.
            raise PromptError(f"chat template: {type(exc).__name__}: {exc}") from None
        if media:
            # A template that left the marked message out keeps its whole text.
            text = text.partition(_MEDIA_MARK)[0]
        return text

    def chat_tokens(
        self, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The ids of a chat conversation: the rendered template, encoded without adding
        special tokens (the template wrote them)."""
        text = self.render_chat(messages, extra)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_template_source(path: Path, config: Mapping[str, Any]) -> str | None:
    """The template: ``chat_template.jinja`` (newer ``save_pretrained``) or the
    ``chat_template`` entry of ``tokenizer_config.json`` (a str, or named templates)."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


_MEDIA_MARK = "\ue000llmsched:media\ue001"
"""Stands for the content of the first message holding a media part while the template
renders; the rendered text is cut where it appears (private-use characters: no template
writes them and no tokenizer merges across the cut)."""

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
}
"""Text part types and the field holding their text, as vLLM reads them (its
``entrypoints/chat_utils.py``)."""

_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)
"""Media part types (vLLM's); a part without a type is media when it holds one of these
fields, as vLLM infers it."""


def _part_text(value: object) -> str | None:
    """A text part's text, None when it is skipped (absent, null or empty, as vLLM skips it)."""
    if value is None:
        return None
    return str(value) or None


class _Media(enum.Enum):
    """What :func:`_content_part` gives for a media part."""

    PART = "media"


def _content_part(part: object) -> str | _Media | None:
    """One part of a list content: its text (None: skipped), or ``_Media.PART``. Raises
    ``ValueError`` naming what is wrong with it."""
    if isinstance(part, str):
        return _part_text(part)
    if not isinstance(part, Mapping):
        raise ValueError("must be a string or an object with a type")
    kind = part.get("type")
    if isinstance(kind, str):
        field = _TEXT_PARTS.get(kind)
        if field is not None:
            return _part_text(part.get(field))
        if kind in _MEDIA_PARTS:
            return _Media.PART
        raise ValueError(f"unsupported content part type {json.dumps(kind)}")
    if kind is not None:
        raise ValueError("'type' must be a string")
    if any(field in part for field in _MEDIA_PARTS):
        return _Media.PART
    if "tool_reference" in part:
        return _part_text(part["tool_reference"])
    raise ValueError("has no 'type'")


def _string_contents(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The messages as the template sees them, and whether a media part was met (see
    :meth:`PromptTokenizer.render_chat`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects")
    out = []
    media = False
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string role")
        item = dict(message)
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            has_media = False
            for j, part in enumerate(content):
                try:
                    text = _content_part(part)
                except ValueError as exc:
                    raise PromptError(f"messages[{i}].content[{j}] {exc}") from None
                if text is _Media.PART:
                    has_media = True
                elif isinstance(text, str):
                    texts.append(text)
            if has_media and not media:
                media = True
                item["content"] = _MEDIA_MARK
            else:
                item["content"] = "\n".join(texts)
        elif content is None:
            item["content"] = ""
        elif not isinstance(content, str):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts")
        out.append(item)
    return out, media
