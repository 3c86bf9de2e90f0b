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
  The messages reach the template as vLLM 0.32 builds them: only the fields it passes on
  (``role``, ``content``, an assistant's ``tool_calls`` with their ``arguments`` read into
  objects and their fields in vLLM's order, and its ``reasoning`` (or, without one, the
  deprecated ``reasoning_content``) as both ``reasoning`` and ``reasoning_content``, a
  tool's ``tool_call_id``, ``name`` and ``task`` when strings), a ``developer`` message
  merged into the system message when the template never names that role, list contents
  as texts joined by newlines (the ``string`` content format, empty texts left out) or, for
  a template that loops over a message's content, as ``{type, ...}`` parts (``openai``,
  empty texts kept, a string content as one text part); a conversation with a media part (an
  image, audio, video) is rendered up to that part (for the ``string`` format, the start of
  its message, where vLLM puts the placeholders). :meth:`PromptTokenizer.chat_request_tokens`
  takes a whole request body and reads its other fields as vLLM does (``tools``,
  ``documents``, ``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message``, ``add_special_tokens``, ``reasoning_effort``).

Route and index on these ids: they equal the engine's when both load the same files, so the
blocks an engine reports in its KV events match the prompts picked with
``Router.pick(tokens=tokenizer.chat_tokens(messages))``. ``Router.pick(text=...)`` hashes
pseudo-tokens instead, which never meet an engine's real ids. The gateway uses this module.
"""

from __future__ import annotations

import enum
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from llmsched._extras import require

require("tokenize", "tokenizers", "jinja2", feature="llmsched.tokenize")

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmsched.errors import ConfigError, InvalidRequestError, InvalidTypeError
from llmsched.validation import is_utf8_text, refuse_json_constant

__all__ = ["PromptError", "PromptTokenizer", "Truncation"]

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class PromptError(InvalidRequestError):
    """A prompt or a chat conversation cannot be turned into tokens (answered with HTTP 400);
    an :class:`~llmsched.errors.InvalidRequestError`, so a ``ValueError`` too."""


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
        content_format: how the chat template takes a message's list content, as vLLM's
            ``--chat-template-content-format`` sets it for the engine: ``"auto"`` (detected
            from the template as vLLM detects it), ``"string"`` or ``"openai"``.
        chat_template: a template's text in place of the directory's own, as vLLM's
            ``--chat-template`` sets it for the engine.
        default_chat_template_kwargs: template variables under every request's
            ``chat_template_kwargs`` and fields, as vLLM's ``--default-chat-template-kwargs``
            sets them.
        exclude_tools_when_tool_choice_none: as vLLM's flag of that name: a request's
            ``tool_choice`` of ``"none"`` leaves its tools out of the template.
        trust_request_chat_template: as vLLM's ``--trust-request-chat-template``: a request's
            own ``chat_template`` (or one among its ``chat_template_kwargs``) is rendered;
            without it, such a request is a :class:`PromptError`, as the engines refuse it.
        max_model_len: the engines' context length (vLLM's ``--max-model-len``): a request's
            ``truncate_prompt_tokens`` of -1 keeps one id less than it (:class:`Truncation`);
            None: unknown, and such a prompt is encoded whole. The attribute of that name may
            be set later (the gateway learns it from the engines).

    A directory with several named templates (``additional_chat_templates/*.jinja`` beside
    ``chat_template.jinja``, or a list under ``chat_template`` in ``tokenizer_config.json``)
    renders each request with the one transformers' ``get_chat_template`` picks for vLLM:
    the template a request names, else ``tool_use`` when the template is handed tools, else
    ``default``.

    Raises :class:`~llmsched.errors.ConfigError` when the directory cannot be loaded or its
    chat template does not compile.
    """

    def __init__(
        self,
        directory: str | Path,
        content_format: str = "auto",
        chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        trust_request_chat_template: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
            raise ConfigError("max_model_len: must be an int >= 1 or None")
        self.max_model_len = max_model_len
        """The engines' context length (None: unknown), for ``truncate_prompt_tokens: -1``."""
        if content_format not in ("auto", "string", "openai"):
            raise ConfigError(
                f"content_format: must be one of auto, string, openai, got {content_format!r}"
            )
        path = Path(directory)
        try:
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ConfigError(f"tokenizer: cannot load {str(path)!r}: {exc}") from None
        # transformers sets truncation and padding on every call, vLLM asking for neither
        # below the context length: a tokenizer.json that sets them is not how the engine
        # encodes.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
                raise ConfigError(f"tokenizer: {str(config_path)!r}: {reason}") from None
        self._special = {
            key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))
        }
        if chat_template is not None and not isinstance(chat_template, str):
            raise ConfigError("chat_template: must be the template's text")
        if not isinstance(default_chat_template_kwargs or {}, Mapping):
            raise ConfigError("default_chat_template_kwargs: must be a mapping")
        defaults = dict(default_chat_template_kwargs or {})
        for name in ("chat_template", "tokenize", "messages"):
            if name in defaults:
                raise ConfigError(f"default_chat_template_kwargs: may not set {name!r}")
        self._defaults = defaults
        if not isinstance(exclude_tools_when_tool_choice_none, bool):
            raise ConfigError("exclude_tools_when_tool_choice_none: must be a boolean")
        self._exclude_tools = exclude_tools_when_tool_choice_none
        if not isinstance(trust_request_chat_template, bool):
            raise ConfigError("trust_request_chat_template: must be a boolean")
        self._templates = _ChatTemplates(
            _own_template_sources(path, config), chat_template, trust_request_chat_template
        )
        self._content_format_override: ContentFormat | None = (
            None if content_format == "auto" else content_format  # type: ignore[assignment]
        )

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests that ask for no template of their own can be tokenized."""
        return self._templates.has_default()

    @property
    def content_format(self) -> ContentFormat:
        """How the chat template of a request asking for none (and without tools) takes a
        message's list content, detected from its source as vLLM detects it: ``"openai"``
        (the parts as ``{type, ...}`` objects) when it loops over a message's content, else
        ``"string"`` (the texts joined by newlines); as set, where ``content_format`` was."""
        if self._content_format_override is not None:
            return self._content_format_override
        default = self._templates.default()
        return "string" if default is None else default.content_format

    @property
    def template_names(self) -> list[str]:
        """The names of the tokenizer directory's named chat templates (empty when it has
        one template or none)."""
        return self._templates.names()

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens the chat template sees (``bos_token``, ``eos_token``, ...)."""
        return dict(self._special)

    def completion_tokens(
        self,
        prompt: Any,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> list[int]:
        """The ids of a ``/v1/completions`` prompt: a str (encoded with special tokens unless
        ``add_special_tokens`` is false, the request field of that name, true by default as
        in vLLM) or a list of ids (returned as is). A batch (a list of prompts) yields its
        first prompt's. ``truncate_prompt_tokens`` and ``truncation_side``, the request's
        fields, cut the ids as the engine cuts them before caching them (see
        :class:`Truncation`)."""
        if not isinstance(add_special_tokens, bool):
            raise PromptError("add_special_tokens must be a boolean")
        truncation = Truncation.read(truncate_prompt_tokens, truncation_side, self.max_model_len)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens, truncation)
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return prompt if truncation is None else truncation.cut(prompt)
        raise PromptError("prompt must be a string or a list of token ids")

    def _encode(
        self, text: str, add_special_tokens: bool, truncation: Truncation | None
    ) -> list[int]:
        """The ids of a prompt's text as the engine feeds them to its model: encoded with or
        without special tokens, then truncated as the request asks."""
        try:
            encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            # The tokenizer takes only valid Unicode text; a lone surrogate that reached the
            # prompt (through a template) is the request's fault, not the gateway's.
            raise PromptError("the prompt is not valid text (it holds a lone surrogate)") from None
        if truncation is None or len(encoding.ids) <= truncation.keep:
            return list(encoding.ids)
        if add_special_tokens and truncation.side is None:
            # The tokenizer truncates: the text's own ids, leaving room for its special
            # tokens (transformers' truncation, on the side vLLM sets for generation).
            own = self._tokenizer.encode(text, add_special_tokens=False)
            room = truncation.keep - self._tokenizer.num_special_tokens_to_add(False)
            own.truncate(max(room, 0), direction="left")
            encoding = self._tokenizer.post_process(own, add_special_tokens=True)
        return truncation.cut(list(encoding.ids))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None
    ) -> str:
        """The chat template's text for ``messages`` with ``add_generation_prompt=True``.

        ``extra``: further template variables, as given, over the default kwargs
        (``add_generation_prompt``, true unless set, ``tools`` and ``documents``, none unless
        set, among them). The messages
        are built as vLLM builds them (see the module docstring). A conversation holding a
        media part (an image, audio, video or embeddings) renders up to that part (for the
        ``string`` content format, the start of its message, where vLLM puts the media's
        placeholder tokens): the engine hashes the media into the cache blocks after it, so
        that beginning is what a router can match. For a whole request body, as the gateway
        has it, use :meth:`render_chat_request`.
        """
        if extra is not None and not isinstance(extra, Mapping):
            raise InvalidTypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        variables = {**self._defaults, **(extra or {})}
        # As transformers' apply_chat_template passes them: defined, even when none.
        for name, default in (
            ("add_generation_prompt", True),
            ("tools", None),
            ("documents", None),
        ):
            variables.setdefault(name, default)
        return self._render(messages, variables, _TemplateAsked(), continue_final_message=False)

    def chat_tokens(
        self, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The ids of a chat conversation: the rendered template (:meth:`render_chat`),
        encoded without adding special tokens (the template wrote them)."""
        text = self.render_chat(messages, extra)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def render_chat_request(self, request: Mapping[str, Any]) -> str:
        """The chat template's text for a ``/v1/chat/completions`` request body, as vLLM 0.32
        renders it: ``messages``, ``tools`` (as vLLM's request model hands them on: each a
        ``{type, function: {name, description, parameters}}``, absent fields as null, and
        null when the request has none), ``documents``, ``chat_template_kwargs`` under the
        request's own ``add_generation_prompt`` (default true), ``reasoning_effort`` (and
        ``enable_thinking`` from it unless a kwarg sets it), and ``continue_final_message``
        (the text ends where the last message's content does). A field of the wrong shape
        is a :class:`PromptError`."""
        chat = _ChatRequest.read(request, self._defaults, self._exclude_tools, self.max_model_len)
        return self._render(
            chat.messages,
            chat.variables,
            chat.template,
            continue_final_message=chat.continue_final_message,
        )

    def chat_request_tokens(self, request: Mapping[str, Any]) -> list[int]:
        """The ids of a ``/v1/chat/completions`` request body (:meth:`render_chat_request`),
        encoded with special tokens only when the request's ``add_special_tokens`` says so."""
        chat = _ChatRequest.read(request, self._defaults, self._exclude_tools, self.max_model_len)
        text = self._render(
            chat.messages,
            chat.variables,
            chat.template,
            continue_final_message=chat.continue_final_message,
        )
        return self._encode(text, chat.add_special_tokens, chat.truncation)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        variables: Mapping[str, Any],
        asked: _TemplateAsked,
        *,
        continue_final_message: bool,
    ) -> str:
        template = self._templates.choose(asked, tools=variables.get("tools") is not None)
        content_format = self._content_format_override or template.content_format
        context: dict[str, Any] = dict(self._special)
        context.update(variables)
        built, media = _template_messages(messages, content_format, template.developer_role)
        final = _mark_final_message(built, template.source) if continue_final_message else None
        context["messages"] = built
        try:
            text = template.template.render(**context)
        except jinja2.TemplateError as exc:
            raise PromptError(f"chat template: {exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            # jinja2 lets a Python error inside the template through (``None + "x"`` on a
            # message without a field): the request's shape caused it, so it is the client's.
            raise PromptError(f"chat template: {type(exc).__name__}: {exc}") from None
        if final is not None:
            text = _cut_at_final_mark(text, final)
        if media:
            # A template that left the marked message out keeps its whole text.
            text = text.partition(_MEDIA_MARK)[0]
        return text


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What transformers appends to the final message to find where it ends in the render."""


def _mark_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Appends :data:`_CONTINUE_TAG` to the last message's content (its last text part, for
    a list) as transformers does for ``continue_final_message``; returns the text marked."""
    if "content" not in source:
        raise PromptError(
            "continue_final_message is set but the chat template never reads a message's content"
        )
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise PromptError("continue_final_message is set but the final message has no text")
    if not isinstance(content, str):
        raise PromptError("continue_final_message is set but the final message has no content")
    final["content"] = content + _CONTINUE_TAG
    return content


def _cut_at_final_mark(text: str, final: str) -> str:
    """The render cut where the final message's content ends (transformers' rule: at the
    tag, or before the spaces the template trimmed off with it)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise PromptError(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat (the template changes it)"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""The ``reasoning_effort`` values vLLM 0.32 accepts."""


class _ChatRequest:
    """A chat request body's fields as vLLM 0.32 reads them for its template (see
    :meth:`PromptTokenizer.render_chat_request`)."""

    def __init__(
        self,
        messages: Any,
        variables: dict[str, Any],
        continue_final_message: bool,
        add_special_tokens: bool,
        truncation: Truncation | None,
        template: _TemplateAsked,
    ) -> None:
        self.messages = messages
        self.variables = variables
        self.continue_final_message = continue_final_message
        self.add_special_tokens = add_special_tokens
        self.truncation = truncation
        self.template = template

    @classmethod
    def read(
        cls,
        request: Mapping[str, Any],
        defaults: Mapping[str, Any],
        exclude_tools: bool = False,
        context: int | None = None,
    ) -> _ChatRequest:
        """The request's fields over its ``chat_template_kwargs`` over ``defaults`` (the
        engines' default kwargs), as vLLM 0.32 merges them (``build_chat_params``,
        ``preprocess_chat``, ``ChatParams.with_defaults``): a request field of None leaves
        the kwarg; a kwarg of None or ``"auto"`` is left out (the default, if any, stays);
        the request's ``tools`` sit with the defaults, so a ``tools`` kwarg overrides them;
        with ``exclude_tools`` (vLLM's ``--exclude-tools-when-tool-choice-none``), a
        ``tool_choice`` of ``"none"`` leaves them out. ``context``: the engines' context
        length, where known (what a ``truncate_prompt_tokens`` of -1 keeps)."""
        if not isinstance(request, Mapping):
            raise InvalidTypeError(
                f"request must be a mapping (a chat request body), got {type(request).__name__}"
            )
        messages = request.get("messages")
        kwargs = request.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping):
            raise PromptError("chat_template_kwargs must be an object")
        # vLLM refuses the first; the second meets the conversation's own argument.
        for name in ("tokenize", "messages"):
            if name in kwargs:
                raise PromptError(f"chat_template_kwargs may not set {name!r}")
        field = request.get("chat_template")
        if field is not None and not isinstance(field, str):
            raise PromptError("chat_template must be a string")
        kwarg = kwargs.get("chat_template")
        if kwarg is not None and not isinstance(kwarg, str):
            raise PromptError("chat_template_kwargs' chat_template must be a string")

        def flag(name: str, default: bool) -> bool:
            value = request.get(name, default)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise PromptError(f"{name} must be a boolean")
            return value

        add_generation_prompt = flag("add_generation_prompt", True)
        continue_final_message = flag("continue_final_message", False)
        if continue_final_message and add_generation_prompt:
            raise PromptError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        merged = dict(kwargs)
        merged["add_generation_prompt"] = add_generation_prompt
        documents = request.get("documents")
        if documents is not None:
            if not isinstance(documents, list) or not all(
                isinstance(d, Mapping) for d in documents
            ):
                raise PromptError("documents must be a list of objects")
            merged["documents"] = documents
        effort = request.get("reasoning_effort")
        if effort is not None:
            if effort not in _REASONING_EFFORTS:
                raise PromptError(
                    f"reasoning_effort must be one of {', '.join(_REASONING_EFFORTS)}"
                )
            merged["reasoning_effort"] = effort
            if "enable_thinking" not in kwargs:
                merged["enable_thinking"] = effort != "none"
        variables = dict(defaults)
        tools = _vllm_tools(request.get("tools"))
        if exclude_tools and request.get("tool_choice") == "none":
            tools = None
        if tools is not None:
            variables["tools"] = tools
        variables.update((k, v) for k, v in merged.items() if not _unset(v))
        for name in _APPLY_ARGUMENTS:
            variables.pop(name, None)
        # As transformers' apply_chat_template passes them: defined, even when none.
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return cls(
            messages,
            variables,
            continue_final_message,
            flag("add_special_tokens", False),
            Truncation.read(
                request.get("truncate_prompt_tokens"), request.get("truncation_side"), context
            ),
            _TemplateAsked(field, kwarg),
        )


def _unset(value: object) -> bool:
    """What vLLM's ``merge_kwargs`` leaves out of the overrides: None and ``"auto"``."""
    return value is None or (isinstance(value, str) and value == "auto")


_APPLY_ARGUMENTS = frozenset(
    {
        "chat_template",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Arguments of transformers' ``apply_chat_template`` that never reach the template."""


class Truncation:
    """A request's ``truncate_prompt_tokens`` (and ``truncation_side``) as vLLM 0.32 applies
    it before a prompt reaches the engine's cache: the engine keeps ``keep`` ids of the
    prompt, so the blocks it caches are those of the kept ids.

    - ``side`` ``"left"`` keeps the last ``keep`` ids, ``"right"`` the first, of the prompt
      as encoded whole (special tokens included);
    - without a side, a text prompt is truncated by the tokenizer while it encodes, on the
      side vLLM sets for generative models (left): the text's own ids are cut to leave room
      for the special tokens the tokenizer adds; a prompt of token ids is cut on that side;
    - ``-1`` means the engine's context length less one (vLLM holds a token back for the
      output): with the context length known (the gateway's ``max_model_len``, or the
      engines' ``/v1/models``) it keeps that many; unknown, the whole prompt is hashed
      (:meth:`read` returns None).

    >>> Truncation.read(-1, None, 4096)
    Truncation(keep=4095, side=None)
    >>> Truncation.read(-1, "right") is None
    True
    """

    __slots__ = ("keep", "side")

    def __init__(self, keep: int, side: Literal["left", "right"] | None = None) -> None:
        self.keep = keep
        self.side = side

    def __repr__(self) -> str:
        return f"Truncation(keep={self.keep}, side={self.side!r})"

    @classmethod
    def read(cls, keep: object, side: object, context: int | None = None) -> Truncation | None:
        """The truncation a request's fields ask for: None when there is none a router can
        apply (absent, null, or -1 with ``context``, the engines' context length, unknown); a
        :class:`PromptError` naming the field when one is malformed."""
        if side is not None and side not in ("left", "right"):
            raise PromptError("truncation_side must be 'left' or 'right'")
        if keep is None:
            return None
        # A float of an integer's value counts as that integer (below 9e15, where floats still
        # hold every integer), as the native plane reads it; vLLM's bound is int64.
        if isinstance(keep, float) and keep.is_integer() and abs(keep) < 9e15:
            keep = int(keep)
        if type(keep) is not int or not -1 <= keep < 2**63:
            raise PromptError("truncate_prompt_tokens must be an integer of at least -1")
        if keep == -1:
            # vLLM's max_truncation_tokens: the context less the token held for output.
            return None if context is None else cls(max(context - 1, 0), side)
        return cls(keep, side)

    def cut(self, ids: list[int]) -> list[int]:
        """The ids the engine keeps of ``ids`` (encoded whole): ``keep`` of them from the side
        named, else from the tokenizer's (left)."""
        if len(ids) <= self.keep:
            return ids
        if self.side == "right":
            return ids[: self.keep]
        return ids[len(ids) - self.keep :]


def _vllm_tools(tools: object) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM's request model dumps them: each ``{type, function:
    {name, description, parameters[, strict][, defer_loading]}}``, absent fields as null,
    other fields dropped; None when there are none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptError(f"tools[{i}] must be an object with a function that has a name")
        kind = tool.get("type", "function")
        if kind != "function":
            raise PromptError(f"tools[{i}].type must be 'function'")
        description = function.get("description")
        parameters = function.get("parameters")
        strict = function.get("strict")
        if description is not None and not isinstance(description, str):
            raise PromptError(f"tools[{i}].function.description must be a string")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise PromptError(f"tools[{i}].function.parameters must be an object")
        if strict is not None and not isinstance(strict, bool):
            raise PromptError(f"tools[{i}].function.strict must be a boolean")
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": description,
            "parameters": parameters,
        }
        if strict is not None:
            dumped["strict"] = strict
        defer = function.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        if defer is not None:
            if not isinstance(defer, bool):
                raise PromptError(f"tools[{i}].defer_loading must be a boolean")
            dumped["defer_loading"] = defer
        out.append({"type": "function", "function": dumped})
    return out


_REQUEST_TEMPLATES_KEPT = 64
"""Distinct request templates kept compiled; past this the cache starts again (as vLLM bounds
its own cache of request templates' content formats)."""

_UNTRUSTED = (
    "the request sets its own chat template, which the engines refuse unless started with "
    "--trust-request-chat-template (set trust_request_chat_template: true in the gateway's "
    "config when they are)"
)


class _TemplateAsked:
    """What a chat request asks of the template choice: its ``chat_template`` field and a
    ``chat_template`` among its ``chat_template_kwargs``, each None when null or absent."""

    __slots__ = ("field", "kwarg")

    def __init__(self, field: str | None = None, kwarg: str | None = None) -> None:
        self.field = field
        self.kwarg = kwarg


class _CompiledTemplate:
    """A chat template compiled as transformers compiles it, with what vLLM reads off its
    source (the content format, whether it names the ``developer`` role)."""

    __slots__ = ("content_format", "developer_role", "source", "template")

    def __init__(self, source: str, name: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"tokenizer: chat template{name} does not compile: {exc}") from None
        self.source = source
        self.content_format: ContentFormat = _detect_content_format(env, source)
        self.developer_role = _names_developer_role(source)


class _ChatTemplates:
    """Every template a request can be rendered with, and vLLM's rule choosing among them:
    the request's ``chat_template`` when not empty (trusted engines only), else the engines'
    ``--chat-template``, else a ``chat_template`` kwarg (trusted only), handed to
    transformers' ``get_chat_template``: a name among the tokenizer's named templates picks
    it, other text is the template itself; nothing asked for picks ``tool_use`` when the
    template is handed tools and the tokenizer names one, else ``default`` (or the one
    template)."""

    def __init__(
        self, own: str | dict[str, str] | None, engine: str | None, trust_requests: bool
    ) -> None:
        self.own: _CompiledTemplate | dict[str, _CompiledTemplate] | None
        if isinstance(own, dict):
            self.own = {name: _CompiledTemplate(text, f" {name!r}") for name, text in own.items()}
        else:
            self.own = None if own is None else _CompiledTemplate(own, "")
        self.engine = None if engine is None else _CompiledTemplate(engine, "")
        self.trust_requests = trust_requests
        self._requested: dict[str, _CompiledTemplate] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.own) if isinstance(self.own, dict) else []

    def has_default(self) -> bool:
        return self.default() is not None

    def default(self) -> _CompiledTemplate | None:
        """The template of a request asking for none, without tools."""
        try:
            return self.choose(_TemplateAsked(), tools=False)
        except PromptError:
            return None

    def choose(self, asked: _TemplateAsked, *, tools: bool) -> _CompiledTemplate:
        if not self.trust_requests and (asked.field is not None or asked.kwarg is not None):
            raise PromptError(_UNTRUSTED)
        text = asked.field or None
        if text is None:
            if self.engine is not None:
                return self.engine
            text = asked.kwarg
        own = self.own
        if text is not None:
            if isinstance(own, dict) and text in own:
                return own[text]
            return self._requested_template(text)
        if isinstance(own, dict):
            chosen = (own.get("tool_use") if tools else None) or own.get("default")
            if chosen is None:
                raise PromptError(
                    "the tokenizer has several chat templates and none named 'default' (it has "
                    f"{', '.join(own)}): the request must name one in chat_template"
                )
            return chosen
        if own is None:
            raise PromptError("the configured tokenizer has no chat template")
        return own

    def _requested_template(self, text: str) -> _CompiledTemplate:
        """A request's own template, compiled once per distinct text."""
        with self._lock:
            found = self._requested.get(text)
        if found is not None:
            return found
        try:
            compiled = _CompiledTemplate(text, "")
        except ConfigError as exc:
            message = str(exc).removeprefix("tokenizer: ")
            raise PromptError(f"the request's chat_template: {message}") from None
        with self._lock:
            if len(self._requested) >= _REQUEST_TEMPLATES_KEPT:
                self._requested.clear()
            self._requested[text] = compiled
        return compiled


def _own_template_sources(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The directory's templates, as transformers loads them: ``chat_template.jinja`` (as
    ``default``) and ``additional_chat_templates/*.jinja`` when there are such files (one
    template when there is only the first), else the ``chat_template`` entry of
    ``tokenizer_config.json`` (a str, or a list of ``{name, template}``, kept as named
    templates however many). The additional files are taken in name order."""
    named: dict[str, str] = {}
    file = path / "chat_template.jinja"
    if file.is_file():
        named["default"] = file.read_text()
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for template in sorted(extra.glob("*.jinja")):
            if template.is_file():
                named[template.name.removesuffix(".jinja")] = template.read_text()
    if list(named) == ["default"]:
        return named["default"]
    if named:
        return named
    entry = config.get("chat_template")
    if isinstance(entry, list):
        listed = {
            t["name"]: t["template"]
            for t in entry
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
        return listed or None
    return entry if isinstance(entry, str) else None


_MEDIA_MARK = "\ue000llmsched:media\ue001"
"""Stands for the first media part while the template renders; the rendered text is cut
where it appears (private-use characters: no template writes them and no tokenizer merges
across the cut)."""

_PROMPT_EMBEDS_PLACEHOLDER = "<prompt_embeds>"
"""The text vLLM puts in place of a ``prompt_embeds`` part (``openai`` format)."""

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Text part types and the field holding their text, as vLLM 0.32 reads them."""

_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
    "prompt_embeds": "prompt_embeds",
}
"""Media part types and their modality; a part without a type is media when it holds one of
these fields."""

_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
"""The fields of the content part types vLLM knows; a part's other fields are copied into the
part an ``openai`` template sees."""

_BILLING_HEADER = "x-anthropic-billing-header"
"""The first line of a system text Claude Code adds on every request (vLLM drops it)."""

ContentFormat = Literal["string", "openai"]
"""How a chat template takes a message's list content (vLLM's
``--chat-template-content-format``): the texts joined by newlines, or the parts as
``{type, ...}`` objects."""


class _Media(enum.Enum):
    """What :func:`_content_part` gives for a media part (the value: its modality)."""

    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"
    PROMPT_EMBEDS = "prompt_embeds"


class _ToolReference(str):
    """A tool reference's name (a text in the ``string`` format, its own part in ``openai``)."""


def _part_text(value: object) -> str | None:
    """A text part's text, None when it is skipped (absent or null, as vLLM skips it). An
    empty text is kept: vLLM leaves it out of the ``string`` format's join but keeps it as a
    part in the ``openai`` format (a template may test the parts' number or index them)."""
    if value is None:
        return None
    return str(value)


def _content_part(part: object) -> str | _Media | None:
    """One part of a list content: its text (None: skipped; possibly empty; a
    :class:`_ToolReference` for a tool reference) or its media modality. Raises
    ``ValueError`` naming what is wrong."""
    if isinstance(part, str):
        return _part_text(part)
    if not isinstance(part, Mapping):
        raise ValueError("must be a string or an object with a type")
    kind = part.get("type")
    if isinstance(kind, str):
        field = _TEXT_PARTS.get(kind)
        if field is not None:
            return _part_text(part.get(field))
        if kind == "tool_reference":
            name = _part_text(part.get("name"))
            return None if name is None else _ToolReference(name)
        if kind in _MEDIA_PARTS:
            return _Media(_MEDIA_PARTS[kind])
        raise ValueError(f"unsupported content part type {json.dumps(kind)}")
    if kind is not None:
        raise ValueError("'type' must be a string")
    for field, modality in _MEDIA_PARTS.items():
        if field in part:
            return _Media(modality)
    if "tool_reference" in part:
        name = _part_text(part["tool_reference"])
        return None if name is None else _ToolReference(name)
    raise ValueError("has no 'type'")


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """A system message's parts without Claude Code's billing header line."""
    out = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


class _Conversation:
    """Builds the messages a template sees (see :meth:`PromptTokenizer.render_chat`)."""

    def __init__(self, content_format: ContentFormat) -> None:
        self.content_format = content_format
        self.media = False

    def content(self, i: int, parts: list[Any]) -> str | list[dict[str, Any]]:
        texts: list[str] = []
        items: list[dict[str, Any]] = []
        media_here = False
        for j, part in enumerate(parts):
            try:
                kind = _content_part(part)
            except ValueError as exc:
                raise PromptError(f"messages[{i}].content[{j}] {exc}") from None
            if self.content_format == "string":
                if isinstance(kind, _Media):
                    media_here = True
                elif kind:
                    texts.append(str(kind))
                continue
            if isinstance(kind, _ToolReference):
                items.append({"type": "tool_reference", "name": str(kind)})
            elif isinstance(kind, str):
                items.append({"type": "text", "text": kind, **_extra_fields(part)})
            elif isinstance(kind, _Media):
                if not self.media:
                    self.media = True
                    items.append({"type": "text", "text": _MEDIA_MARK})
                elif kind is _Media.PROMPT_EMBEDS:
                    items.append({"type": "text", "text": _PROMPT_EMBEDS_PLACEHOLDER})
                else:
                    items.append({"type": kind.value, **_extra_fields(part)})
        if self.content_format == "openai":
            return items
        if media_here and not self.media:
            self.media = True
            return _MEDIA_MARK
        return "\n".join(texts)

    def message(self, i: int, role: str, message: Mapping[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = list(content)
        else:
            raise PromptError(f"messages[{i}].content must be a string or a list of parts")
        if role == "system":
            parts = _without_billing_header(parts)
        built: dict[str, Any] = {"role": role, "content": self.content(i, parts)}
        if role == "tool" and isinstance(built["content"], list):
            items = built["content"]
            if all(item.get("type") == "text" for item in items):
                built["content"] = "\n".join(str(item.get("text", "")) for item in items)
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                calls = _tool_calls(i, calls)
                if calls is not None:
                    built["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is None:
                # vLLM's request model renames the deprecated field to this one.
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                built["reasoning"] = reasoning
                built["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            built["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                built[key] = message[key]
        if role == "developer":
            built["tools"] = message.get("tools")
        return built


def _extra_fields(part: object) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        return {}
    return {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def _tool_calls(i: int, calls: object) -> object:
    """An assistant's ``tool_calls`` as the template sees them: None for an empty list
    (dropped), each call's ``arguments`` an object (a JSON text of one read; anything else
    that is not one ``{}``), the fields of each call and its function in vLLM's order
    (:data:`_TOOL_CALL_FIELDS`); a value that is not a list as it is."""
    if not isinstance(calls, list):
        return calls
    if not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise PromptError(f"messages[{i}].tool_calls: entries must be objects")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise PromptError(
                f"messages[{i}].tool_calls: only calls of type 'function' are supported"
            )
        arguments = function.get("arguments")
        if not isinstance(arguments, Mapping):
            arguments = _arguments_object(arguments)
        function = _in_field_order({**function, "arguments": arguments}, _FUNCTION_FIELDS)
        out.append(_in_field_order({**call, "function": function}, _TOOL_CALL_FIELDS))
    return out


_TOOL_CALL_FIELDS = ("id", "function", "type")
_FUNCTION_FIELDS = ("arguments", "name")
"""The fields of a tool call and of its function in the order vLLM's request model (the
OpenAI ``TypedDict`` types, validated by pydantic) hands them to the template, whatever order
the request sent them in: a template writing a call with ``tojson`` writes them so."""


def _in_field_order(value: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``value``'s ``fields`` first, in that order, then its other keys as they came."""
    ordered = {key: value[key] for key in fields if key in value}
    ordered.update((k, v) for k, v in value.items() if k not in ordered)
    return ordered


# The deepest arguments the native plane reads (serde_json's recursion limit of 128).
_MAX_ARGUMENTS_DEPTH = 127


def _arguments_object(arguments: object) -> dict[str, Any]:
    """A tool call's ``arguments`` text read as the native plane reads it: the object it
    holds, else ``{}`` for anything that is not strict JSON of an object (not JSON, NaN or
    Infinity, a float out of range, nesting past :data:`_MAX_ARGUMENTS_DEPTH` or past Python's
    recursion limit, a lone surrogate escape, which no tokenizer takes as text)."""
    if not isinstance(arguments, str) or not is_utf8_text(arguments):
        return {}
    try:
        parsed = json.loads(
            arguments, parse_constant=refuse_json_constant, parse_float=_finite_float
        )
    except (ValueError, RecursionError):
        return {}
    if not isinstance(parsed, dict) or _depth_over(parsed, _MAX_ARGUMENTS_DEPTH):
        return {}
    if "\\u" in arguments and not is_utf8_text(json.dumps(parsed, ensure_ascii=False)):
        return {}
    return parsed


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _depth_over(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests more than ``limit`` arrays and objects (walked
    without recursion: the value may be as deep as the decoder allows)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system messages, then the system messages merged into one at
    the start (texts joined by a blank line, empty ones left out) when there is more than one
    or one is not first."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not (len(systems) > 1 or (systems and systems[0] > 0)):
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                str(p["text"]) if isinstance(p, Mapping) else p
                for p in content
                if (isinstance(p, Mapping) and "text" in p) or isinstance(p, str)
            )
        if content:
            texts.append(content)
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(m for i, m in enumerate(converted) if i not in systems)]


def _template_messages(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, developer_role: bool
) -> tuple[list[dict[str, Any]], bool]:
    """The messages a template sees, and whether a media part was met (see
    :meth:`PromptTokenizer.render_chat`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects")
    conversation = _Conversation(content_format)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string role")
        out.append(conversation.message(i, message["role"], message))
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out, conversation.media


def _names_developer_role(source: str) -> bool:
    """Whether a template names the ``developer`` role (as a quoted string anywhere)."""
    return '"developer"' in source or "'developer'" in source


def _refers_to(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is variable ``name`` (or its ``key`` member), possibly sliced,
    filtered or tested."""
    nodes = jinja2.nodes
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _refers_to(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _refers_to(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    is_var = isinstance(getattr(node, "node", None), nodes.Name)
    if isinstance(node, nodes.Getitem):
        return (
            is_var
            and _refers_to(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return is_var and _refers_to(node.node, name) and node.attr == key
    return False


def _target_name(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise ValueError("not a name")
    return node.name


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """vLLM's rule (see :func:`_detect_content_format`); raises ``ValueError`` where vLLM's
    detection fails (a loop or ``set`` target that is not a name)."""
    nodes = jinja2.nodes
    lists = ["messages"]
    for name in lists:
        for assign in root.find_all(nodes.Assign):
            if _refers_to(assign.node, name):
                target = _target_name(assign.target)
                if target not in lists:
                    lists.append(target)
    messages = [
        _target_name(loop.target)
        for loop in root.find_all(nodes.For)
        if any(_refers_to(loop.iter, name) for name in lists)
    ]

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_refers_to(node, m, "content") for m in messages)

    in_macros: set[int] = set()
    params_of_loop: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and is_content(arg):
                    given.add(params[i])
            for kwarg in call.kwargs:
                if kwarg.key in params and is_content(kwarg.value):
                    given.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                params_of_loop[id(loop)] = given
    for loop in root.find_all(nodes.For):
        iter_name = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
        if (
            is_content(loop.iter)
            or (iter_name is not None and iter_name in params_of_loop.get(id(loop), ()))
            or (id(loop) not in in_macros and iter_name == "content")
        ):
            _target_name(loop.target)
            return True
    return False


def _detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content (through variables set
    from the messages, a macro given the content, or a loop over a variable named
    ``content`` outside macros), else ``string``, as vLLM 0.32 detects it."""
    try:
        return "openai" if _loops_over_content(env.parse(source)) else "string"
    except (jinja2.TemplateError, ValueError):
        return "string"
