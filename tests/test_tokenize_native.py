"""The native plane's prompt tokenizer (the Rust ``tokenizers`` crate and minijinja) against
the Python plane's (:class:`llmsched.tokenize.PromptTokenizer`: Python ``tokenizers`` and
jinja2): the same token ids for the same tokenizer directory and request, chat and
completions; templates the native engine cannot render refused at load; malformed requests
refused with the problem named, never a crash."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _chat_kwargs import KWARGS_CASES, KWARGS_DEFAULTS, KWARGS_TEMPLATE
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)

from llmsched import _llmsched
from llmsched.errors import ConfigError, GatewayStoppedError, InvalidRequestError
from llmsched.gateway import NativeGateway
from llmsched.testing.openai_engine import CHAT_TEMPLATE, write_tokenizer
from llmsched.tokenize import PromptError, PromptTokenizer

NativePromptTokenizer = _llmsched.NativePromptTokenizer

# Qwen 2.5's chat template (tools, tool calls, tool responses), as Hugging Face ships it.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# What Llama-style templates use: a namespace, string methods, filters, tojson with an
# indent, dict items, values printed as Python prints them, generation blocks, loop controls.
FEATURES_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = ns.system + m.content | trim %}{%- endif %}{%- endfor %}
{%- if ns.system %}<|system|>
{{ ns.system }}{{ eos_token }}
{% endif %}
{%- if tools is defined and tools is not none %}
{%- for t in tools %}{{ t | tojson(indent=4) }}
{% endfor %}
{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if loop.index > 40 %}{% break %}{% endif %}
<|{{ m['role'] }}|>
{% generation %}{{ m['content'].strip() }}{% endgeneration %}{% if m.content.startswith('!') %} [bang]{% endif %}{{ eos_token }}
{%- if m.name is defined %} ({{ m.name | upper }}){% endif %}
{% endfor %}
{%- if mode is defined %}{{ mode | title }} {{ extra_list }} {{ flag }} {{ nothing }}{% endif %}
{%- for k, v in (meta or {}).items() %}{{ k }}={{ v }};{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""  # noqa: E501

# A template taking list contents as parts (vLLM's "openai" content format), in the way
# multimodal models' templates do: media markers where the parts are, texts trimmed, and the
# reasoning and tool calls an assistant message carries.
PARTS_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
<|{{ message['role'] }}|>
{%- if message['content'] is string %}{{ message['content'] | trim }}
{%- else %}{%- for item in message['content'] %}
{%- if item['type'] == 'image' %}<|image|>{%- elif item['type'] == 'audio' %}<|audio|>
{%- elif item['type'] == 'text' %}{{ item['text'] | trim }}{%- endif %}
{%- endfor %}{%- endif %}
{%- if message.reasoning_content %} [thought: {{ message.reasoning_content }}]{%- endif %}
{%- for call in message.tool_calls or [] %} [call {{ call.function.name }} {{ call.function.arguments | tojson }}]{%- endfor %}
{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}"""  # noqa: E501

TEMPLATES = {
    "default": None,
    "qwen": QWEN_TEMPLATE,
    "features": FEATURES_TEMPLATE,
    "parts": PARTS_TEMPLATE,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather at a place — «quoted» "text"',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

_TEXT = (
    "you are a helpful assistant hello there how are you today tell me a story about a dragon "
    "and a knight the quick brown fox jumps over the lazy dog"
)
WORDS = _TEXT.split(" ")
UNICODE = [
    "héllo",
    "日本語のテキスト",
    "emoji 🐉🏰",
    "Ünïcödé ß",
    "tab\tand\nnewline",
    "  spaced  ",
]


def _sentence(rng: random.Random, words: int) -> str:
    parts = [rng.choice(WORDS + UNICODE if rng.random() < 0.2 else WORDS) for _ in range(words)]
    return " ".join(parts)


def _chats() -> list[tuple[str, list[dict[str, Any]]]]:
    """Conversations: system / user / assistant turns, unicode, long messages, list
    contents, names; fixed ones first, then seeded random ones."""
    chats: list[tuple[str, list[dict[str, Any]]]] = [
        ("one-user", [{"role": "user", "content": "hello there"}]),
        (
            "system-user",
            [
                {"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "hello there"},
            ],
        ),
        (
            "turns",
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "tell me a story"},
                {"role": "assistant", "content": "a dragon and a knight"},
                {"role": "user", "content": "!and then?"},
            ],
        ),
        ("unicode", [{"role": "user", "content": " ".join(UNICODE)}]),
        ("empty-content", [{"role": "user", "content": ""}]),
        ("long", [{"role": "user", "content": " ".join(WORDS * 120)}]),
        (
            "list-content",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        {"type": "text", "text": "second 🐉 part"},
                    ],
                }
            ],
        ),
        (
            # Parts after plain messages: the messages before the first list keep their place.
            "list-content-later",
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "plain first"},
                {"role": "assistant", "content": [{"type": "text", "text": "a listed answer"}]},
                {"role": "user", "content": "plain again"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                },
            ],
        ),
        ("named", [{"role": "user", "name": "alice", "content": "hi, it's me"}]),
    ]
    rng = random.Random(17)
    for i in range(24):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": _sentence(rng, rng.randint(3, 30))})
        for turn in range(rng.randint(1, 6)):
            role = "user" if turn % 2 == 0 else "assistant"
            messages.append({"role": role, "content": _sentence(rng, rng.randint(1, 80))})
        chats.append((f"random-{i}", messages))
    return chats


CHATS = _chats()


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, template in TEMPLATES.items():
        config: dict[str, object] = {} if template is None else {"chat_template": template}
        out[name] = write_tokenizer(root / name, **config)
    out["tiny-model"] = _tiny_model_tokenizer(root / "tiny-model")
    return out


def _tiny_model_tokenizer(directory: Path) -> Path:
    """The tokenizer of ``tests/engines/make_tiny_model.py`` (the one the engine tests serve),
    trained the same way with ``tokenizers`` alone and saved with its chat template and
    special tokens (that script saves through ``transformers``)."""
    path = Path(__file__).parent / "engines" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_model", module)
    spec.loader.exec_module(module)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=module.VOCAB_SIZE,
        special_tokens=module.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(module.corpus(0, 4000), trainer=trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": module.CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _both(directory: Path, body: dict[str, Any]) -> tuple[Any, Any]:
    """(Python ids or the PromptError text, native ids or the InvalidRequestError text)."""
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    try:
        expected: Any = python.chat_request_tokens(body)
    except PromptError as exc:
        expected = ("error", str(exc))
    try:
        got: Any = native.chat_tokens(json.dumps(body))
    except InvalidRequestError as exc:
        got = ("error", str(exc))
    return expected, got


@pytest.mark.parametrize("template", [*TEMPLATES, "tiny-model"])
@pytest.mark.parametrize(("name", "messages"), CHATS, ids=[c[0] for c in CHATS])
def test_chat_ids_equal_the_python_plane(
    directories: dict[str, Path], template: str, name: str, messages: list[dict[str, Any]]
) -> None:
    directory = directories[template]
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    text = python.render_chat_request(body)
    assert native.render_chat(json.dumps(body)) == text
    ids = python.chat_request_tokens(body)
    assert native.chat_tokens(json.dumps(body)) == ids
    assert len(ids) > 0


@pytest.mark.parametrize("template", ["qwen", "features"])
def test_tools_and_template_kwargs_equal_the_python_plane(
    directories: dict[str, Path], template: str
) -> None:
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "weather in Zürich?"},
    ]
    kwargs = {
        "mode": "fast path",
        "extra_list": ["a", 1, 2.5, None, True, {"k": "it's"}],
        "flag": False,
        "nothing": None,
        "meta": {"z": 1, "a": 1e20, "m": [1.0, 0.0001]},
    }
    python = PromptTokenizer(directories[template])
    native = NativePromptTokenizer(str(directories[template]))
    for body in (
        {"messages": messages, "tools": TOOLS},
        {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs},
        # vLLM 0.32: the request's own field (default true) wins over the kwarg.
        {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
        {"messages": messages, "add_generation_prompt": False},
        {"messages": messages, "tools": None, "chat_template_kwargs": None},
    ):
        assert native.render_chat(json.dumps(body)) == python.render_chat_request(body)
        expected, got = _both(directories[template], body)
        assert got == expected
    assert python.render_chat_request(
        {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}}
    ) == python.render_chat_request({"messages": messages})
    for bad, problem in [
        ({"chat_template_kwargs": "not a dict"}, "chat_template_kwargs must be an object"),
        ({"chat_template_kwargs": {"tokenize": True}}, "may not set 'tokenize'"),
        ({"add_generation_prompt": 1}, "add_generation_prompt must be a boolean"),
        ({"continue_final_message": True}, "cannot both be true"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
        ({"documents": ["x"]}, "documents must be a list of objects"),
        ({"tools": {"a": 1}}, "tools must be a list"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type must be"),
        ({"tools": [{"function": {}}]}, "tools[0] must be an object with a function"),
    ]:
        body = {"messages": messages, **bad}
        with pytest.raises(PromptError, match=re.escape(problem)):
            python.render_chat_request(body)
        with pytest.raises(InvalidRequestError, match=re.escape(problem)):
            native.chat_tokens(json.dumps(body))


@pytest.mark.parametrize("template", ["features", "qwen"])
def test_repeated_keys_and_large_objects_read_as_python_reads_them(
    directories: dict[str, Path], template: str
) -> None:
    """The native plane reads the body's JSON as Python's ``json`` does: a repeated key keeps
    its first place and its last value (the body's own keys included), and objects large and
    small keep the order sent."""
    meta = ", ".join(f'"k{i}": {i}' for i in range(20))
    properties = ", ".join(f'"p{i}": {{"type": "string", "n": {i}}}' for i in range(20))
    raw = (
        '{"messages": [{"role": "user", "content": "ignored"}], "model": "m", '
        '"messages": [{"role": "system", "content": "sys", "content": "be brief"}, '
        '{"role": "user", "content": "hi", "name": "a", "name": "bob"}], '
        f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": '
        f'{{"type": "object", "properties": {{{properties}, "p3": "again"}}}}}}}}], '
        f'"chat_template_kwargs": {{"mode": "x", "meta": {{{meta}, "k0": "last"}}, "mode": "y"}}}}'
    )
    body = json.loads(raw)
    python = PromptTokenizer(directories[template])
    native = NativePromptTokenizer(str(directories[template]))
    expected = python.render_chat_request(body)
    assert native.render_chat(raw) == expected
    assert native.chat_tokens(raw) == python.chat_request_tokens(body)
    if template == "features":
        assert "k0=last;k1=1;" in expected and "Y " in expected and "(BOB)" in expected


def test_tool_calls_and_tool_responses_equal_the_python_plane(directories: dict[str, Path]) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris for 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21.5}'},
        {"role": "tool", "content": '{"temp": 19}'},
        {"role": "assistant", "content": "sunny, 20 °C"},
        {"role": "user", "content": "thanks"},
    ]
    expected, got = _both(directories["qwen"], {"messages": messages, "tools": TOOLS})
    assert isinstance(expected, list) and got == expected


MEDIA_PARTS: dict[str, Any] = {
    "image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    "input_image": {"type": "input_image", "image_url": "https://example.invalid/cat.png"},
    "untyped_image": {"image_url": {"url": "https://example.invalid/cat.png"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    "video_url": {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
    "image_embeds": {"type": "image_embeds", "image_embeds": "AAAA"},
}


@pytest.mark.parametrize("template", [*TEMPLATES, "tiny-model"])
@pytest.mark.parametrize("media", list(MEDIA_PARTS))
def test_media_parts_route_by_the_conversation_before_them(
    directories: dict[str, Path], template: str, media: str
) -> None:
    """A conversation holding an image (or audio, video, embeddings) is tokenized up to the
    start of the first message holding it, alike on both planes: the engine puts the
    media's placeholder tokens there, and its cache blocks past that point depend on the
    media."""
    directory = directories[template]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    rng = random.Random(7)
    before = [
        {"role": "system", "content": _sentence(rng, 60)},
        {"role": "user", "content": _sentence(rng, 20)},
        {"role": "assistant", "content": _sentence(rng, 20)},
    ]
    part = MEDIA_PARTS[media]
    asking: dict[str, Any] = {
        "role": "user",
        "content": [{"type": "text", "text": "what is this?"}, part],
    }
    later: list[dict[str, Any]] = [
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [part, "and this one?"]},
    ]
    for messages in ([*before, asking], [*before, asking, *later]):
        body = {"model": MODEL, "messages": messages}
        text = python.render_chat(messages)
        assert native.render_chat(json.dumps(body)) == text
        ids = python.chat_tokens(messages)
        assert native.chat_tokens(json.dumps(body)) == ids
        # The text is the conversation's render up to the media: where its message's content
        # begins for a template taking texts (vLLM puts the placeholders first), at the part
        # itself for one taking parts; the render with a marker there, cut at the marker.
        content: Any = "MARKER"
        if python.content_format == "openai":
            content = [
                {"type": "text", "text": "what is this?"},
                {"type": "text", "text": "MARKER"},
            ]
        marked = python.render_chat([*before, {"role": "user", "content": content}])
        assert text == marked.partition("MARKER")[0]
        assert len(text) > sum(len(m["content"]) for m in before)
        # A text-only conversation with the same beginning shares every full block of it.
        text_only = [*before, {"role": "user", "content": "what is this?"}]
        whole = python.chat_tokens(text_only)
        shared = len(ids) - 1  # the last token may merge with what follows the cut
        assert whole[:shared] == ids[:shared]


def test_text_part_kinds_join_as_vllm_joins_them(directories: dict[str, Path]) -> None:
    """Plain strings, ``input_text``, ``refusal`` and ``thinking`` parts are text; empty and
    null texts are skipped; a null content is ``""``; an unknown part type is a 400."""
    directory = directories["tiny-model"]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                "plain",
                {"type": "input_text", "text": "in"},
                {"type": "text", "text": ""},
                {"type": "text", "text": None},
                {"type": "output_text", "text": "out"},
            ],
        },
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "go on"},
    ]
    joined = [
        {"role": "user", "content": "plain\nin\nout"},
        {"role": "assistant", "content": "no"},
        {"role": "user", "content": "hm"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "go on"},
    ]
    body = json.dumps({"model": MODEL, "messages": messages})
    assert python.render_chat(messages) == python.render_chat(joined)
    assert native.render_chat(body) == python.render_chat(joined)
    assert native.chat_tokens(body) == python.chat_tokens(joined)
    assert "None" not in native.render_chat(body)
    for part, problem in [
        ({"type": "hologram", "hologram": "x"}, 'unsupported content part type "hologram"'),
        ({"text": "no type"}, "has no 'type'"),
        ({"type": 3}, "'type' must be a string"),
        (7, "must be a string or an object"),
    ]:
        bad = [{"role": "user", "content": ["ok", part]}]
        with pytest.raises(PromptError, match=re.escape(f"messages[0].content[1] {problem}")):
            python.render_chat(bad)
        with pytest.raises(InvalidRequestError, match=re.escape(problem)):
            native.chat_tokens(json.dumps({"messages": bad}))


@pytest.mark.usefixtures("plane")
def test_the_gateway_routes_media_conversations_by_their_text_before_the_media(
    tmp_path: Path,
) -> None:
    """Through the gateway: chats with an image are answered (each body reaches the engine as
    sent), and chats sharing their text before the image, each with another image, go to
    one engine: the beginning before the media is what the index learned and matched."""
    directory = write_tokenizer(tmp_path)
    rng = random.Random(11)
    systems = [{"role": "system", "content": _sentence(rng, 80)} for _ in range(8)]

    def chat(system: dict[str, str], image: str) -> dict[str, Any]:
        part = {"type": "image_url", "image_url": {"url": f"https://example.invalid/{image}"}}
        return {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [system, {"role": "user", "content": [part, "describe it"]}],
        }

    async def body() -> None:
        async with rig(engines=4, tokenizer=str(directory)) as r:
            homes: list[set[int]] = [set() for _ in systems]
            for image in ("a.png", "b.png", "c.png"):
                for home, system in zip(homes, systems, strict=True):
                    request = chat(system, image)
                    url = r.url("/v1/chat/completions")
                    async with r.client.post(url, json=request) as response:
                        assert response.status == 200, await response.text()
                    engine = r.engine_of_request()
                    assert engine.received[-1].body["messages"] == request["messages"]
                    home.add(r.engines.index(engine))
            assert all(len(home) == 1 for home in homes), homes
            # Cold first chats tie and spread (random tie-break): later ones follow their
            # beginning, not a favourite engine.
            assert len({next(iter(home)) for home in homes}) > 1, homes

    run(body())


def _hf_truncated(directory: Path, text: str, add: bool, keep: int, side: str | None) -> list[int]:
    """What vLLM 0.32 feeds its model for a text prompt with ``truncate_prompt_tokens`` (its
    ``TokenizeParams``): without a side named, the ``tokenizers`` library's own truncation
    (transformers enables it on the left, the side vLLM sets for generative models), then the
    cut after encoding; with a side, the whole encoding cut on that side."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_truncation()
    if side is None and keep > 0:
        tokenizer.enable_truncation(max_length=keep, direction="left")
    ids = list(tokenizer.encode(text, add_special_tokens=add).ids)
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


@pytest.mark.parametrize("template", ["default", "tiny-model", "features", "whitespace-bos-eos"])
def test_truncation_keeps_what_the_engine_keeps(
    cached_directories: dict[str, Path], template: str
) -> None:
    """``truncate_prompt_tokens`` and ``truncation_side``: the ids on both planes, with the
    piece cache and without, equal the ``tokenizers`` library's truncation as vLLM asks for
    it (tests/engines checks the same against a real engine's prompt ids)."""
    directory = cached_directories[template]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    uncached = NativePromptTokenizer(str(directory), cache_bytes=0)
    rng = random.Random(f"truncation-{template}")
    prompt = _sentence(rng, 60)
    length = len(python.completion_tokens(prompt))
    for keep in (0, 1, 2, 7, length - 1, length, length + 3, -1):
        for side in (None, "left", "right"):
            for add in (True, False):
                expected = (
                    python.completion_tokens(prompt, add)
                    if keep == -1
                    else _hf_truncated(directory, prompt, add, keep, side)
                )
                fields = {"truncate_prompt_tokens": keep, "truncation_side": side}
                body = json.dumps({"prompt": prompt, "add_special_tokens": add, **fields})
                case = (keep, side, add)
                assert python.completion_tokens(prompt, add, keep, side) == expected, case
                assert native.completion_tokens(body) == expected, case
                assert uncached.completion_tokens(body) == expected, case
                ids = python.completion_tokens(prompt, add)
                id_body = json.dumps({"prompt": ids, **fields})
                cut = (
                    ids
                    if keep in (-1,) or keep >= len(ids)
                    else (ids[:keep] if side == "right" else ids[len(ids) - keep :])
                )
                assert native.completion_tokens(id_body) == cut, case
                assert python.completion_tokens(ids, True, keep, side) == cut, case
    if python.has_chat_template:
        messages = [{"role": "user", "content": _sentence(rng, 30)}]
        text = python.render_chat_request({"messages": messages})
        for fields in (
            {"truncate_prompt_tokens": 9},
            {"truncate_prompt_tokens": 9, "truncation_side": "right"},
            {"truncate_prompt_tokens": 9, "add_special_tokens": True},
        ):
            body = {"messages": messages, **fields}
            add = bool(fields.get("add_special_tokens"))
            expected = _hf_truncated(directory, text, add, 9, fields.get("truncation_side"))
            assert python.chat_request_tokens(body) == expected, fields
            assert native.chat_tokens(json.dumps(body)) == expected, fields
            assert uncached.chat_tokens(json.dumps(body)) == expected, fields


@pytest.mark.parametrize("template", ["default", "tiny-model", "features"])
def test_minus_one_keeps_the_context_less_one_on_both_planes(
    cached_directories: dict[str, Path], template: str
) -> None:
    """``truncate_prompt_tokens: -1`` with the engines' context length known: vLLM 0.32 keeps
    ``max_model_len - 1`` ids (its ``max_truncation_tokens``), as a count of that many; with
    it unknown, the prompt is whole."""
    directory = cached_directories[template]
    rng = random.Random(f"context-{template}")
    prompt = _sentence(rng, 60)
    whole = PromptTokenizer(directory).completion_tokens(prompt)
    for context in (len(whole) - 5, len(whole), len(whole) + 1, len(whole) + 10):
        python = PromptTokenizer(directory, max_model_len=context)
        native = NativePromptTokenizer(str(directory), max_model_len=context)
        for side in (None, "left", "right"):
            for add in (True, False):
                case = (context, side, add)
                expected = _hf_truncated(directory, prompt, add, context - 1, side)
                fields = {"truncate_prompt_tokens": -1, "truncation_side": side}
                body = json.dumps({"prompt": prompt, "add_special_tokens": add, **fields})
                assert python.completion_tokens(prompt, add, -1, side) == expected, case
                assert native.completion_tokens(body) == expected, case
                ids = python.completion_tokens(prompt, add)
                cut = ids if context - 1 >= len(ids) else None
                if cut is None:
                    keep = context - 1
                    cut = ids[:keep] if side == "right" else ids[len(ids) - keep :]
                id_body = json.dumps({"prompt": ids, **fields})
                assert native.completion_tokens(id_body) == cut, case
                assert python.completion_tokens(ids, True, -1, side) == cut, case
        if python.has_chat_template:
            body_fields = {"truncate_prompt_tokens": -1}
            messages = [{"role": "user", "content": prompt}]
            text = python.render_chat_request({"messages": messages})
            expected = _hf_truncated(directory, text, False, context - 1, None)
            chat = {"messages": messages, **body_fields}
            assert python.chat_request_tokens(chat) == expected, context
            assert native.chat_tokens(json.dumps(chat)) == expected, context
    # Unknown: whole, on both.
    body = json.dumps({"prompt": prompt, "truncate_prompt_tokens": -1})
    assert NativePromptTokenizer(str(directory)).completion_tokens(body) == whole
    assert PromptTokenizer(directory).completion_tokens(prompt, True, -1) == whole


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens must be an integer"),
        ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens must be an integer"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens must be an integer"),
        ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side must be"),
    ],
)
def test_malformed_truncation_fields_are_refused_alike(
    directories: dict[str, Path], fields: dict[str, Any], problem: str
) -> None:
    directory = directories["default"]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    with pytest.raises(PromptError, match=problem):
        python.completion_tokens(
            "hello", True, fields["truncate_prompt_tokens"], fields.get("truncation_side")
        )
    with pytest.raises(InvalidRequestError, match=problem):
        native.completion_tokens(json.dumps({"prompt": "hello", **fields}))
    body = {"messages": [{"role": "user", "content": "hello"}], **fields}
    with pytest.raises(PromptError, match=problem):
        python.chat_request_tokens(body)
    with pytest.raises(InvalidRequestError, match=problem):
        native.chat_tokens(json.dumps(body))


@pytest.mark.usefixtures("plane")
def test_the_gateway_routes_truncated_prompts_by_what_the_engine_keeps(tmp_path: Path) -> None:
    """Completions that differ in their beginning but share the ids their
    ``truncate_prompt_tokens`` keeps (the last ones) go to one engine: the index learned and
    matched the kept ids. Prompts of ids are cut too (no tokenizer needed for them); a
    malformed field is a 400 naming it."""
    directory = write_tokenizer(tmp_path)
    rng = random.Random(12)
    tails = [_sentence(rng, 80) for _ in range(6)]
    python = PromptTokenizer(directory)
    keep = min(len(python.completion_tokens(tail, False)) for tail in tails) - 4

    async def body() -> None:
        async with rig(engines=4, tokenizer=str(directory)) as r:
            homes: list[set[int]] = [set() for _ in tails]
            for turn in range(3):
                for home, tail in zip(homes, tails, strict=True):
                    request = {
                        "model": MODEL,
                        "max_tokens": 2,
                        "prompt": f"{_sentence(rng, 30)} turn {turn} {tail}",
                        "truncate_prompt_tokens": keep,
                    }
                    async with r.client.post(r.url("/v1/completions"), json=request) as response:
                        assert response.status == 200, await response.text()
                    engine = r.engine_of_request()
                    assert engine.received[-1].body["prompt"] == request["prompt"]
                    home.add(r.engines.index(engine))
            assert all(len(home) == 1 for home in homes), homes
            bad = {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": -3}
            async with r.client.post(r.url("/v1/completions"), json=bad) as response:
                assert response.status == 400
                assert "truncate_prompt_tokens" in (await response.json())["error"]["message"]

    run(body())

    async def ids_body() -> None:
        async with rig(engines=4) as r:
            homes: list[set[int]] = [set() for _ in tails]
            for _turn in range(3):
                for g, home in enumerate(homes):
                    head = [rng.randrange(1000, 2000) for _ in range(40)]
                    tail = [g * 1000 + i for i in range(1, 65)]
                    request = {
                        "model": MODEL,
                        "max_tokens": 2,
                        "prompt": head + tail,
                        "truncate_prompt_tokens": 64,
                    }
                    async with r.client.post(r.url("/v1/completions"), json=request) as response:
                        assert response.status == 200, await response.text()
                    home.add(r.engines.index(r.engine_of_request()))
            assert all(len(home) == 1 for home in homes), homes

    run(ids_body())


def test_an_engine_template_and_default_kwargs_merge_as_vllm_merges_them(tmp_path: Path) -> None:
    """``chat_template`` (vLLM's ``--chat-template``) replaces the directory's template and
    ``default_chat_template_kwargs`` (``--default-chat-template-kwargs``) sit under each
    request's kwargs, on both planes, merged as vLLM 0.32 merges them: a kwarg of None or
    ``"auto"`` leaves the default, a ``tools`` kwarg overrides the request's tools, the
    arguments transformers takes for itself (``padding``) are no variables, and a
    ``messages`` kwarg is refused. The expected lines are vLLM's own renders."""
    directory = write_tokenizer(tmp_path / "tok")
    python = PromptTokenizer(
        directory, chat_template=KWARGS_TEMPLATE, default_chat_template_kwargs=KWARGS_DEFAULTS
    )
    native = NativePromptTokenizer(
        str(directory),
        chat_template=KWARGS_TEMPLATE,
        default_chat_template_kwargs=json.dumps(KWARGS_DEFAULTS),
    )
    messages = [{"role": "user", "content": "hi"}]
    for fields, first_line in KWARGS_CASES:
        body = {"messages": messages, **fields}
        text = python.render_chat_request(body)
        assert text.split("\n")[0] == "<s>" + first_line, fields
        assert native.render_chat(json.dumps(body)) == text, fields
        assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body)
    bad = {"messages": messages, "chat_template_kwargs": {"messages": []}}
    with pytest.raises(PromptError, match="may not set 'messages'"):
        python.render_chat_request(bad)
    with pytest.raises(InvalidRequestError, match="may not set 'messages'"):
        native.render_chat(json.dumps(bad))
    for wrong in ('{"tokenize": true}', "[1]", "{"):
        with pytest.raises(ConfigError, match="default_chat_template_kwargs"):
            NativePromptTokenizer(str(directory), default_chat_template_kwargs=wrong)
    with pytest.raises(ConfigError, match="default_chat_template_kwargs"):
        PromptTokenizer(directory, default_chat_template_kwargs={"messages": []})


def test_the_gateway_config_reads_an_engine_template_and_default_kwargs(tmp_path: Path) -> None:
    from llmsched.gateway.config import load_config

    directory = write_tokenizer(tmp_path / "tok")
    (tmp_path / "template.jinja").write_text(KWARGS_TEMPLATE)
    base = {"engines": [{"host": "127.0.0.1", "port": 9}], "models": [MODEL]}
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(
        json.dumps(
            {
                **base,
                "tokenizer": "tok",
                "chat_template": "template.jinja",
                "default_chat_template_kwargs": KWARGS_DEFAULTS,
            }
        )
    )
    config = load_config(config_file)
    assert config.chat_template == KWARGS_TEMPLATE
    assert config.default_chat_template_kwargs == KWARGS_DEFAULTS
    literal = load_config({**base, "tokenizer": str(directory), "chat_template": "{{ x }}"})
    assert literal.chat_template == "{{ x }}"
    for bad, problem in (
        ({"tokenizer": str(directory), "chat_template": "chatml"}, "no file"),
        ({"chat_template": "{{ x }}"}, "needs a tokenizer"),
        ({"tokenizer": str(directory), "default_chat_template_kwargs": [1]}, "must be a mapping"),
        ({"tokenizer": str(directory), "default_chat_template_kwargs": {"tokenize": 1}}, "may not"),
    ):
        with pytest.raises(ConfigError, match=problem):
            load_config({**base, **bad})


@pytest.mark.usefixtures("plane")
def test_the_gateway_routes_chats_on_the_engines_template(tmp_path: Path) -> None:
    """Through the gateway: chats rendered with the configured template and default kwargs
    (what the engines render) share their beginning by conversation and go to one engine
    each; the index holds the ids of that render."""
    directory = write_tokenizer(tmp_path / "tok")
    template = KWARGS_TEMPLATE.replace("[pad=", "[pad-{{ mode }}=")
    python = PromptTokenizer(
        directory, chat_template=template, default_chat_template_kwargs=KWARGS_DEFAULTS
    )
    rng = random.Random(13)
    systems = [{"role": "system", "content": _sentence(rng, 60)} for _ in range(4)]

    async def body() -> None:
        async with rig(
            engines=3,
            tokenizer=str(directory),
            chat_template=template,
            default_chat_template_kwargs=KWARGS_DEFAULTS,
        ) as r:
            for turn in range(2):
                for system in systems:
                    messages = [system, {"role": "user", "content": f"turn {turn}"}]
                    request = {"model": MODEL, "max_tokens": 2, "messages": messages}
                    async with r.client.post(
                        r.url("/v1/chat/completions"), json=request
                    ) as response:
                        assert response.status == 200, await response.text()
                    worker = r.worker_of_request()
                    ids = python.chat_request_tokens({"messages": messages})
                    held = r.gateway.index.match_tokens(ids).as_dict()
                    assert held.get(worker, 0) == len(ids) // 4, (held, worker)

    run(body())


# Templates whose content format vLLM 0.32 detects as given (tests/engines checks these
# against vLLM's own detection).
CONTENT_FORMATS = {
    "plain": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    "parts": (PARTS_TEMPLATE, "openai"),
    "filtered": (
        "{% for m in messages %}{% for p in m.content | selectattr('type') %}x{% endfor %}"
        "{% endfor %}",
        "openai",
    ),
    "sliced": (
        "{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content %}{% endfor %}"
        "{% endfor %}",
        "openai",
    ),
    "content-var": (
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}"
        "{% endfor %}",
        "openai",
    ),
    "macro": (
        "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
        "openai",
    ),
    "macro-kwarg": (
        "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(c=m['content']) }}{% endfor %}",
        "openai",
    ),
    "macro-other": (
        "{% macro r(content) %}{% for p in content %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r('x') }}{% endfor %}",
        "string",
    ),
    "tuple-target": (
        "{% for m in messages %}{% if m.content is not string %}"
        "{% for k, v in m.content %}{% endfor %}{% endif %}{% endfor %}",
        "string",
    ),
    "tool-calls": (
        "{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{{ m.content }}{% endfor %}",
        "string",
    ),
    "first-message": ("{% for p in messages[0]['content'] %}{% endfor %}", "string"),
    "generation-tag": (
        "{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}"
        "{% endfor %}{% endgeneration %}{% endfor %}",
        "openai",
    ),
}


def test_content_format_is_detected_alike(tmp_path: Path, directories: dict[str, Path]) -> None:
    for name, (template, expected) in CONTENT_FORMATS.items():
        directory = write_tokenizer(tmp_path / name, chat_template=template)
        assert PromptTokenizer(directory).content_format == expected, name
        assert NativePromptTokenizer(str(directory)).content_format == expected, name
    for name, directory in directories.items():
        expected = "openai" if name == "parts" else "string"
        assert PromptTokenizer(directory).content_format == expected, name
        assert NativePromptTokenizer(str(directory)).content_format == expected, name


VLLM_SHAPED: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "x-anthropic-billing-header: cch=8a1f\nYou are a helpful assistant.",
    },
    {"role": "developer", "content": "Answer in French.", "tools": [{"x": 1}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "  two parts  ", "cache_control": {"type": "ephemeral"}},
            {"type": "input_text", "text": "in one message"},
            {"type": "text", "text": ""},
        ],
        "name": 7,
        "metadata": {"ignored": True},
    },
    {
        "role": "assistant",
        "content": None,
        "reasoning": "the user wants weather",
        "reasoning_content": "not what vLLM passes on",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            },
            {"id": "call_2", "function": {"name": "broken", "arguments": "{not json"}},
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": [{"type": "text", "text": '{"temp": 21}'}, {"type": "text", "text": "ok"}],
    },
    {
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": "I cannot"}],
        "tool_calls": [],
    },
    {"role": "user", "content": "thanks", "name": "ann"},
]


@pytest.mark.parametrize("template", [*TEMPLATES, "tiny-model"])
def test_messages_reach_the_template_as_vllm_builds_them(
    directories: dict[str, Path], template: str
) -> None:
    """Both planes build the template's messages as vLLM 0.32 does: only the fields it passes
    on (an assistant's ``reasoning`` as ``reasoning_content`` too, tool call arguments read
    into objects), developer messages merged into the system message when the template
    never names that role, Claude Code's billing line dropped, and list contents as the
    template's content format takes them."""
    directory = directories[template]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    messages = VLLM_SHAPED
    if template == "default":  # its template has no tool role
        messages = [m for m in messages if m["role"] != "tool"]
    body = {"model": MODEL, "messages": messages}
    text = python.render_chat(messages)
    assert native.render_chat(json.dumps(body)) == text
    assert native.chat_tokens(json.dumps(body)) == python.chat_tokens(messages)
    assert "billing" not in text and "metadata" not in text
    if template == "parts":
        # Parts rendered one by one (trimmed, no newline between them), the developer's text
        # merged into the system message, the reasoning and the parsed arguments shown.
        assert "<|user|>two partsin one message" in text
        assert "<|system|>You are a helpful assistant.\n\nAnswer in French." in text
        assert "[thought: the user wants weather]" in text
        assert '[call get_weather {"city": "Paris", "days": 3}] [call broken {}]' in text
        assert '<|tool|>{"temp": 21}\nok' in text
    if template == "default":
        assert "two parts  \nin one message" in text


# What the request's own fields give a template: documents, the reasoning effort and the
# thinking switch derived from it, the tools as vLLM dumps them.
REQUEST_FIELDS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if documents is not none %}[docs {{ documents | tojson }}]{% endif %}"
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% if enable_thinking is defined %}[thinking {{ enable_thinking }}]{% endif %}"
    "{% if tools is not none %}[tools {{ tools | tojson }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_request_fields_reach_the_template_as_vllm_sets_them(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path, chat_template=REQUEST_FIELDS_TEMPLATE)
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    messages = [{"role": "user", "content": "hi"}]
    tools = [
        {"function": {"name": "noargs"}, "type": "function", "other": 1},
        {"type": "function", "function": {"name": "f", "parameters": {"b": 1}, "strict": False}},
    ]
    bodies: list[dict[str, Any]] = [
        {"messages": messages, "documents": [{"title": "t", "text": "x"}]},
        {"messages": messages, "chat_template_kwargs": {"documents": [{"text": "kw"}]}},
        {"messages": messages, "reasoning_effort": "none"},
        {
            "messages": messages,
            "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"},
        },
        {"messages": messages, "tools": tools},
        {"messages": messages},
    ]
    texts = []
    for body in bodies:
        text = python.render_chat_request(body)
        assert native.render_chat(json.dumps(body)) == text
        assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body)
        texts.append(text)
    assert '[docs [{"title": "t", "text": "x"}]]' in texts[0]
    assert '[docs [{"text": "kw"}]]' in texts[1]
    assert "[effort none][thinking False]" in texts[2]
    assert "[effort high][thinking False]" in texts[3]
    dumped = (
        '[tools [{"type": "function", "function": {"name": "noargs", "description": null, '
        '"parameters": null}}, {"type": "function", "function": {"name": "f", '
        '"description": null, "parameters": {"b": 1}, "strict": false}}]]'
    )
    assert dumped in texts[4]
    assert texts[5] == "<|user|>hi<|end|><|assistant|>"


@pytest.mark.parametrize("template", [*TEMPLATES, "tiny-model"])
def test_continue_final_message_and_special_tokens_equal_the_python_plane(
    directories: dict[str, Path], template: str
) -> None:
    """``continue_final_message`` ends the text where the last message's content does (as
    transformers cuts it); ``add_special_tokens`` encodes the text with the tokenizer's own
    special tokens added."""
    directory = directories[template]
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    messages = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "Once upon a time  "},
    ]
    for body in (
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": messages, "add_special_tokens": True},
        {"messages": messages, "add_generation_prompt": False},
    ):
        text = python.render_chat_request(body)
        assert native.render_chat(json.dumps(body)) == text
        assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body)
        if body.get("continue_final_message"):
            assert text.rstrip().endswith("Once upon a time"), text


def test_the_content_format_can_be_set_as_the_engines_were_told(
    directories: dict[str, Path],
) -> None:
    """``chat_template_content_format`` (vLLM's ``--chat-template-content-format``) overrides
    the detected format on both planes; a bad value is a ConfigError."""
    from llmsched.gateway.config import load_config

    directory = directories["parts"]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    body = json.dumps({"messages": messages})
    texts = {}
    for fmt in ("auto", "string", "openai"):
        python = PromptTokenizer(directory, content_format=fmt)
        native = NativePromptTokenizer(str(directory), content_format=fmt)
        assert python.content_format == native.content_format
        assert native.render_chat(body) == python.render_chat_request({"messages": messages})
        texts[fmt] = native.render_chat(body)
    assert texts["auto"] == texts["openai"] != texts["string"]
    assert "<|user|>a\nb" in texts["string"] and "<|user|>ab" in texts["openai"]
    with pytest.raises(ConfigError, match="content_format"):
        NativePromptTokenizer(str(directory), content_format="parts")
    with pytest.raises(ConfigError, match="content_format"):
        PromptTokenizer(directory, content_format="parts")
    base = {"engines": [{"host": "127.0.0.1", "port": 9}], "models": [MODEL]}
    assert load_config(base).chat_template_content_format == "auto"
    config = load_config({**base, "chat_template_content_format": "openai"})
    assert config.chat_template_content_format == "openai"
    with pytest.raises(ConfigError, match="chat_template_content_format"):
        load_config({**base, "chat_template_content_format": "parts"})


def test_completion_ids_equal_the_python_plane(directories: dict[str, Path]) -> None:
    for template in ("default", "tiny-model"):
        python = PromptTokenizer(directories[template])
        native = NativePromptTokenizer(str(directories[template]))
        for prompt in [
            "hello there",
            " ".join(UNICODE),
            " ".join(WORDS * 50),
            "",
            [5, 6, 7],
            [],
            ["hello there", "other"],
            [[1, 2], [3]],
        ]:
            body = json.dumps({"model": MODEL, "prompt": prompt})
            assert native.completion_tokens(body) == python.completion_tokens(prompt), prompt
            for add in (True, False):
                body = json.dumps({"prompt": prompt, "add_special_tokens": add})
                assert native.completion_tokens(body) == python.completion_tokens(prompt, add)
        with pytest.raises(InvalidRequestError, match="add_special_tokens must be a boolean"):
            native.completion_tokens(json.dumps({"prompt": "x", "add_special_tokens": 1}))
        with pytest.raises(PromptError, match="add_special_tokens must be a boolean"):
            python.completion_tokens("x", 1)  # type: ignore[arg-type]
        for bad in [3, [1, -1], [1.5], None, [True], {"a": 1}, [2**32]]:
            with pytest.raises(PromptError):
                python.completion_tokens(bad)
            with pytest.raises(InvalidRequestError, match="prompt must be a string"):
                native.completion_tokens(json.dumps({"prompt": bad}))


def test_special_tokens_and_template_resolution(tmp_path: Path) -> None:
    for name, config in {
        "file": {"template_file": True},
        "named": {
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D{{ bos_token }}"},
            ]
        },
        "none": {"chat_template": None},
    }.items():
        directory = write_tokenizer(tmp_path / name, **config)  # type: ignore[arg-type]
        python = PromptTokenizer(directory)
        native = NativePromptTokenizer(str(directory))
        assert dict(native.special_tokens) == python.special_tokens
        assert native.has_chat_template == python.has_chat_template
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        if python.has_chat_template:
            assert native.render_chat(body) == python.render_chat(
                [{"role": "user", "content": "hi"}]
            )
        else:
            with pytest.raises(InvalidRequestError, match="no chat template"):
                native.chat_tokens(body)


# Named templates as transformers saves them; each writes its name first.
NAMED_TEMPLATES = {
    "default": "default|" + CHAT_TEMPLATE,
    "tool_use": "tool_use {{ tools | length }}|" + CHAT_TEMPLATE,
    "rag": "rag|" + CHAT_TEMPLATE,
}
_TOOL = {"type": "function", "function": {"name": "f"}}
# A request's fields and the template vLLM 0.32 renders it with, from a tokenizer holding
# NAMED_TEMPLATES, for engines trusting requests' templates (tests/engines checks these
# rules against a real engine).
TEMPLATE_CHOICES: list[tuple[dict[str, Any], str]] = [
    ({}, "default"),
    ({"tools": [_TOOL]}, "tool_use"),
    ({"tools": [_TOOL], "tool_choice": "none"}, "tool_use"),
    ({"chat_template_kwargs": {"tools": [1, 2]}}, "tool_use"),
    ({"tools": [_TOOL], "chat_template_kwargs": {"tools": None}}, "tool_use"),
    ({"tools": None}, "default"),
    ({"chat_template": "rag", "tools": [_TOOL]}, "rag"),
    ({"chat_template": "own|" + CHAT_TEMPLATE}, "own"),
    ({"chat_template": "", "tools": [_TOOL]}, "tool_use"),
    ({"chat_template": None}, "default"),
    ({"chat_template_kwargs": {"chat_template": "rag"}}, "rag"),
    ({"chat_template": "default", "chat_template_kwargs": {"chat_template": "rag"}}, "default"),
]


def _named_directory(path: Path, how: str) -> Path:
    """A tokenizer with NAMED_TEMPLATES, saved as files (``chat_template.jinja`` and
    ``additional_chat_templates/``) or as ``tokenizer_config.json``'s list."""
    if how == "config":
        listed = [{"name": n, "template": t} for n, t in NAMED_TEMPLATES.items()]
        return write_tokenizer(path, chat_template=listed)
    directory = write_tokenizer(path, chat_template="config's, not read")
    (directory / "chat_template.jinja").write_text(NAMED_TEMPLATES["default"])
    (directory / "additional_chat_templates").mkdir()
    for name in ("tool_use", "rag"):
        (directory / "additional_chat_templates" / f"{name}.jinja").write_text(
            NAMED_TEMPLATES[name]
        )
    return directory


@pytest.mark.parametrize("how", ["files", "config"])
def test_named_templates_are_chosen_as_vllm_chooses_them(tmp_path: Path, how: str) -> None:
    directory = _named_directory(tmp_path / how, how)
    python = PromptTokenizer(directory, trust_request_chat_template=True)
    native = NativePromptTokenizer(str(directory), trust_request_chat_template=True)
    assert sorted(python.template_names) == ["default", "rag", "tool_use"]
    messages = [{"role": "user", "content": "hi"}]
    for fields, name in TEMPLATE_CHOICES:
        body = {"messages": messages, **fields}
        rendered = python.render_chat_request(body)
        assert rendered.split("|")[0].split(" ")[0] == name, fields
        assert native.render_chat(json.dumps(body)) == rendered, fields
        assert native.chat_tokens(json.dumps(body)) == python.chat_request_tokens(body), fields
    # The engines' --chat-template comes before the directory's and the kwarg.
    engine = "engine|" + CHAT_TEMPLATE
    python = PromptTokenizer(directory, chat_template=engine, trust_request_chat_template=True)
    native = NativePromptTokenizer(
        str(directory), chat_template=engine, trust_request_chat_template=True
    )
    for fields, name in [
        ({"tools": [_TOOL]}, "engine"),
        ({"chat_template_kwargs": {"chat_template": "rag"}}, "engine"),
        ({"chat_template": "rag"}, "rag"),
    ]:
        body = {"messages": messages, **fields}
        rendered = python.render_chat_request(body)
        assert rendered.startswith(name + "|"), fields
        assert native.render_chat(json.dumps(body)) == rendered, fields


def test_named_templates_without_a_default_need_a_name(tmp_path: Path) -> None:
    only = [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]
    directory = write_tokenizer(tmp_path / "nodefault", chat_template=only)
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    assert not python.has_chat_template and not native.has_chat_template
    tools = {"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL]}
    assert python.render_chat_request(tools) == native.render_chat(json.dumps(tools)) == "T"
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]})
    for render in (
        lambda: python.render_chat_request(json.loads(body)),
        lambda: native.render_chat(body),
    ):
        with pytest.raises(InvalidRequestError, match=r"none named 'default'.*rag"):
            render()


def test_a_request_template_is_refused_unless_the_engines_trust_it(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path / "tok")
    messages = [{"role": "user", "content": "hi"}]
    untrusting = (PromptTokenizer(directory), NativePromptTokenizer(str(directory)))
    trusting = (
        PromptTokenizer(directory, trust_request_chat_template=True),
        NativePromptTokenizer(str(directory), trust_request_chat_template=True),
    )
    for fields in [
        {"chat_template": "x"},
        {"chat_template": ""},
        {"chat_template_kwargs": {"chat_template": "x"}},
    ]:
        body = {"messages": messages, **fields}
        with pytest.raises(PromptError, match="--trust-request-chat-template"):
            untrusting[0].chat_request_tokens(body)
        with pytest.raises(InvalidRequestError, match="trust_request_chat_template: true"):
            untrusting[1].chat_tokens(json.dumps(body))
    for fields, problem in [
        ({"chat_template": 5}, "chat_template must be a string"),
        ({"chat_template": ["x"]}, "chat_template must be a string"),
        ({"chat_template_kwargs": {"chat_template": 1}}, "chat_template must be a string"),
        ({"chat_template": "{% for %}"}, "the request's chat_template: .*does not compile"),
    ]:
        body = {"messages": messages, **fields}
        for python, native in (untrusting, trusting):
            if "compile" in problem and python is untrusting[0]:
                continue
            with pytest.raises(PromptError, match=problem):
                python.chat_request_tokens(body)
            with pytest.raises(InvalidRequestError, match=problem):
                native.chat_tokens(json.dumps(body))
    # Compiled once per text, rendered alike on both planes.
    own = {"messages": messages, "chat_template": "{{ messages | length }}" + CHAT_TEMPLATE}
    for _ in range(2):
        assert trusting[0].chat_request_tokens(own) == trusting[1].chat_tokens(json.dumps(own))


def test_a_request_template_s_work_is_bounded_on_the_native_plane(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path / "tok")
    native = NativePromptTokenizer(str(directory), trust_request_chat_template=True)
    endless = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "chat_template": endless})
    with pytest.raises(InvalidRequestError, match="fuel"):
        native.chat_tokens(body)


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("trust", [False, True])
def test_the_gateway_answers_a_request_template_as_the_engines_do(
    tmp_path: Path, trust: bool
) -> None:
    """Untrusted: a 400 naming the engines' flag and the config key, nothing routed. Trusted:
    routed on the ids of the request's own template."""
    directory = write_tokenizer(tmp_path / "tok")
    python = PromptTokenizer(directory, trust_request_chat_template=True)
    own = "own|" + CHAT_TEMPLATE
    messages = [{"role": "user", "content": _sentence(random.Random(3), 40)}]

    async def body() -> None:
        async with rig(engines=2, tokenizer=str(directory), trust_request_chat_template=trust) as r:
            request = {"model": MODEL, "max_tokens": 2, "messages": messages, "chat_template": own}
            async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                text = await response.text()
                if not trust:
                    assert response.status == 400, text
                    error = json.loads(text)["error"]
                    assert "--trust-request-chat-template" in error["message"], error
                    assert "trust_request_chat_template: true" in error["message"], error
                    assert not any(e.received for e in r.engines)
                    return
                assert response.status == 200, text
            worker = r.worker_of_request()
            ids = python.chat_request_tokens({"messages": messages, "chat_template": own})
            held = r.gateway.index.match_tokens(ids).as_dict()
            assert held.get(worker, 0) == len(ids) // 4, (held, worker)

    run(body())


def test_a_template_the_native_engine_cannot_render_is_refused_at_load(tmp_path: Path) -> None:
    # Python's %-formatting of strings: jinja2 renders it, minijinja does not.
    template = "{% for m in messages %}{{ '%s!' % m['content'] }}{% endfor %}"
    directory = write_tokenizer(tmp_path / "percent", chat_template=template)
    assert PromptTokenizer(directory).render_chat([{"role": "user", "content": "x"}]) == "x!"
    with pytest.raises(ConfigError, match="cannot be rendered by the native plane"):
        NativePromptTokenizer(str(directory))
    broken = write_tokenizer(tmp_path / "broken", chat_template="{% for %}")
    with pytest.raises(ConfigError, match="does not compile"):
        NativePromptTokenizer(str(broken))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load"):
        NativePromptTokenizer(str(tmp_path / "junk"))
    # A template whose own rules refuse the probes (raise_exception) still loads.
    strict = "{{ raise_exception('only tools conversations') }}"
    directory = write_tokenizer(tmp_path / "strict", chat_template=strict)
    native = NativePromptTokenizer(str(directory))
    with pytest.raises(InvalidRequestError, match="only tools conversations"):
        native.chat_tokens(json.dumps({"messages": [{"role": "user", "content": "x"}]}))


def test_the_native_config_refuses_an_unrenderable_template_at_start(tmp_path: Path) -> None:
    template = "{{ '%s' % messages[0]['content'] }}"
    directory = write_tokenizer(tmp_path, chat_template=template)

    gateway = NativeGateway(
        {
            "engines": [{"host": "127.0.0.1", "port": 9}],
            "models": [MODEL],
            "listen": {"port": 0},
            "scrape": {"enabled": False},
            "data_plane": "native",
            "tokenizer": str(directory),
        }
    )
    with pytest.raises(ConfigError, match="tokenizer: the chat template cannot be rendered"):
        run(gateway.start())
    with pytest.raises(GatewayStoppedError):
        gateway.native()


MALFORMED: list[Any] = [
    [],
    "text",
    3,
    None,
    [1],
    [None],
    [{"content": "no role"}],
    [{"role": 5, "content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": {"a": 1}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    [{"role": "user", "content": [7]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "tool", "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "x"}, "not a message"],
]


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_malformed_conversations_fail_alike_and_never_crash(
    directories: dict[str, Path], template: str
) -> None:
    for messages in MALFORMED:
        expected, got = _both(directories[template], {"messages": messages})
        # Both planes refuse, or both render the same ids.
        assert isinstance(expected, tuple) == isinstance(got, tuple), (messages, expected, got)
        if not isinstance(expected, tuple):
            assert got == expected
    native = NativePromptTokenizer(str(directories[template]))
    rng = random.Random(3)
    atoms: list[Any] = [None, True, 0, -1, 2.5, "", "x", "🐉", [], {}, "\u0000", "{{", "%}"]
    for _ in range(300):
        message = {
            rng.choice(["role", "content", "name", "tool_calls", "type", "text"]): rng.choice(
                [*atoms, [rng.choice(atoms)], {"type": "text", "text": rng.choice(atoms)}]
            )
            for _ in range(rng.randint(0, 4))
        }
        body = {"messages": [message, rng.choice([*atoms, message])][: rng.randint(1, 2)]}
        if rng.random() < 0.3:
            body["tools"] = rng.choice(atoms)
        if rng.random() < 0.3:
            body["chat_template_kwargs"] = {"meta": rng.choice(atoms), "tools": rng.choice(atoms)}
        with contextlib.suppress(InvalidRequestError):
            native.chat_tokens(json.dumps(body))
    for text in ["", "{", "[]", '{"messages": 3', '{"messages": "x"}', "null"]:
        with pytest.raises(InvalidRequestError):
            native.chat_tokens(text)


@pytest.mark.usefixtures("plane")
def test_the_gateway_answers_malformed_chats_with_400(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path)

    async def body() -> None:
        async with rig(engines=1, tokenizer=str(directory)) as r:
            for messages in MALFORMED:
                request = {"model": MODEL, "messages": messages}
                async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                    assert response.status in (200, 400), (messages, response.status)
                    if response.status == 400:
                        error = (await response.json())["error"]
                        assert error["type"] == "invalid_request_error" and error["message"]
            # The plane still serves.
            good = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            async with r.client.post(r.url("/v1/chat/completions"), json=good) as response:
                assert response.status == 200

    run(body())


# The tokenizer cache: chat prompts' pieces (the text between added tokens) cached with their
# ids. Every test compares against the tokenizer encoding the whole text without the cache.

CACHE_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def _trained(directory: Path, kind: str) -> Path:
    """A tokenizer of another family than ``write_tokenizer``'s byte-level BPE, with its
    chat template: ``metaspace-first`` (SentencePiece-style, Metaspace with ``prepend_scheme:
    first``, whose ids depend on whether a piece starts the text), ``strip-rules`` (the same
    with added tokens that strip spaces around them or match single words only, which the
    cache splits with the tokenizer's own added vocabulary), ``llama-normalizer``
    (the older Llama layout: Prepend and Replace normalizers, no pre-tokenizer),
    ``truncating`` (its file truncates and pads, which vLLM's encoding turns off),
    ``normalized-added`` (one the cache must refuse), ``whitespace-bos-eos``
    (a Whitespace pre-tokenizer, which drops the spaces, and a post-processor adding ``<s>``
    before a text and ``</s>`` after it)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "llama-normalizer":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    elif kind == "normalized-added":
        tokenizer.normalizer = normalizers.Lowercase()
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    elif kind == "whitespace-bos-eos":
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CACHE_SPECIALS)
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + UNICODE
    tokenizer.train_from_iterator(corpus * 4, trainer)
    if kind == "truncating":
        tokenizer.enable_truncation(max_length=8)
        tokenizer.enable_padding(length=256, pad_id=tokenizer.token_to_id("<s>"), pad_token="<s>")
    if kind == "whitespace-bos-eos":
        bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> $B </s>",
            special_tokens=[("<s>", bos), ("</s>", eos)],
        )
    if kind == "normalized-added":
        tokenizer.add_tokens([AddedToken("<Tool>", normalized=True)])
    if kind == "strip-rules":
        tokenizer.add_special_tokens([AddedToken("<|tool|>", lstrip=True, rstrip=True)])
        tokenizer.add_tokens([AddedToken("knight", single_word=True, normalized=False)])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": FEATURES_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def cached_directories(
    directories: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cached-tokenizers")
    out = dict(directories)
    kinds = (
        "metaspace-first",
        "strip-rules",
        "llama-normalizer",
        "truncating",
        "normalized-added",
        "whitespace-bos-eos",
    )
    for kind in kinds:
        out[kind] = _trained(root / kind, kind)
    return out


CACHED = [
    *TEMPLATES,
    "tiny-model",
    "metaspace-first",
    "strip-rules",
    "llama-normalizer",
    "whitespace-bos-eos",
]
# The one family whose long pieces stay whole: its Prepend normalizer marks every piece.
UNCHUNKED = {"llama-normalizer"}


@functools.cache
def _python_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def _whole(directory: Path, text: str) -> list[int]:
    """The Python ``tokenizers`` ids of ``text`` without special tokens added."""
    return list(_python_tokenizer(directory).encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("template", CACHED)
def test_the_cache_is_on_and_each_conversation_encodes_alike_cold_and_warm(
    cached_directories: dict[str, Path], template: str
) -> None:
    directory = cached_directories[template]
    native = NativePromptTokenizer(str(directory))
    stats = native.cache_stats()
    assert stats["enabled"] and stats["disabled_reason"] is None, stats
    assert (stats["hits"], stats["misses"], stats["entries"]) == (0, 0, 0)
    uncached = NativePromptTokenizer(str(directory), cache_bytes=0)
    python = PromptTokenizer(directory) if template not in TEMPLATES else None
    # A shared system message on every turn, as chat traffic has it.
    system = {"role": "system", "content": _sentence(random.Random(5), 200)}
    conversations = [m for _, m in CHATS] + [[system, *m] for _, m in CHATS[:8]]
    for messages in conversations:
        body = json.dumps({"model": MODEL, "messages": messages})
        expected = uncached.chat_tokens(body)
        assert expected == uncached.encode_whole(native.render_chat(body))
        if python is not None:
            assert expected == python.chat_tokens(messages)
        cold = native.chat_tokens(body)
        warm = native.chat_tokens(body)
        assert cold == expected and warm == expected, messages
    stats = native.cache_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["fallbacks"] == 0, stats
    assert 0 < stats["bytes"] <= stats["capacity_bytes"]
    assert uncached.cache_stats()["enabled"] is False
    assert uncached.cache_stats()["disabled_reason"] == "tokenizer_cache_bytes is 0"


def _texts_with_added_tokens(rng: random.Random, specials: list[str]) -> str:
    segments = []
    for _ in range(rng.randint(1, 8)):
        roll = rng.random()
        if roll < 0.35:
            segments.append(rng.choice(specials))
        elif roll < 0.5:
            segments.append(rng.choice(["", " ", "\n", "  ", "▁", "\t", " \n "]))
        else:
            segments.append(_sentence(rng, rng.randint(1, 60)))
        if rng.random() < 0.2:
            segments.append(rng.choice([" ", "\n", ""]))
    return "".join(segments)


@pytest.mark.parametrize("template", CACHED)
def test_random_texts_with_added_tokens_encode_as_the_whole_text(
    cached_directories: dict[str, Path], template: str
) -> None:
    """Property-style: seeded random texts of added tokens, words, unicode and whitespace,
    through a small cache (evictions), cold then warm, equal the uncached encoding and
    Python ``tokenizers``'."""
    directory = cached_directories[template]
    specials = [c for c in [*CACHE_SPECIALS, "<|end|>", "<pad>", "<|tool|>"] if c != "<unk>"]
    specials += [" <|tool|> ", "knight", " knight ", "knights", "aknight"]
    native = NativePromptTokenizer(str(directory), cache_bytes=16384)
    rng = random.Random(template)
    texts = [_texts_with_added_tokens(rng, specials) for _ in range(400)]
    for text in texts + texts[::-1]:
        expected = _whole(directory, text)
        assert native.encode_whole(text) == expected, text
        assert native.encode_chat(text) == expected, text
        assert native.encode_chat(text) == expected, text
    stats = native.cache_stats()
    assert stats["enabled"], stats
    assert stats["evictions"] > 0 and stats["hits"] > 0, stats
    assert stats["bytes"] <= 16384


@pytest.mark.parametrize("template", CACHED)
def test_long_texts_sharing_a_beginning_share_its_chunks_and_encode_as_the_whole_text(
    cached_directories: dict[str, Path], template: str
) -> None:
    """Texts of one long opening (about 2 kB of words, unicode, spaces and newlines) and tails
    of their own, each encoded through the cache cold and warm: the whole text's ids; with
    chunks on, every text after the first finds the opening's chunks in the cache."""
    directory = cached_directories[template]
    native = NativePromptTokenizer(str(directory), cache_bytes=1 << 20)
    stats = native.cache_stats()
    chunked = template not in UNCHUNKED
    assert stats["enabled"] and stats["chunks"] is chunked, stats
    if chunked:
        assert stats["chunks_disabled_reason"] is None
    else:
        assert "chunk by chunk" in str(stats["chunks_disabled_reason"]), stats
    rng = random.Random(f"chunks-{template}")
    opening = "\n".join(_sentence(rng, 40) for _ in range(8))
    assert len(opening) > 1500
    texts = [f"{opening} {_sentence(rng, rng.randint(1, 30))}" for _ in range(12)]
    texts += [f"{opening}{rng.choice([' ', '  ', chr(10), '12 ', ''])}{t}" for t in WORDS[:6]]
    for text in texts:
        expected = _whole(directory, text)
        assert native.encode_chat(text) == expected, text
        assert native.encode_chat(text) == expected, text
    stats = native.cache_stats()
    assert stats["fallbacks"] == 0, stats
    if chunked:
        # The opening alone is at least 1,500 bytes: at least 10 chunks of it on each of the
        # 17 texts after the first, while each text misses a few chunks at most (cold).
        assert stats["hits"] >= 17 * 10 + len(texts), stats
        assert stats["misses"] <= 40 + 6 * len(texts), stats
    else:
        assert stats["misses"] == len(texts) and stats["hits"] == len(texts), stats
    # A text sharing no chunk with the others but made of their words: its chunks are looked
    # up word by word, and only words never seen go through the tokenizer.
    words = opening.split(" ")
    random.Random(3).shuffle(words)
    shuffled = " ".join(words)
    before = native.cache_stats()
    assert native.encode_chat(shuffled) == _whole(directory, shuffled)
    after = native.cache_stats()
    found, inserted = after["hits"] - before["hits"], after["misses"] - before["misses"]
    if chunked:
        assert found > 2 * inserted, (found, inserted)
    else:
        assert (found, inserted) == (0, 1)
    # A long piece assembled from cached chunks twice running is kept whole as well: from
    # then on it is one lookup, not one a chunk.
    expected = _whole(directory, texts[0])
    lookups = []
    for _ in range(3):
        before = native.cache_stats()
        assert native.encode_chat(texts[0]) == expected
        after = native.cache_stats()
        assert after["misses"] == before["misses"], after
        lookups.append(after["hits"] - before["hits"])
    if chunked:
        assert lookups[2] < lookups[0], lookups
    else:
        assert lookups[2] == lookups[0], lookups


@pytest.mark.parametrize("template", CACHED)
def test_completion_prompts_go_through_the_cache_with_the_special_tokens_around(
    cached_directories: dict[str, Path], template: str
) -> None:
    """A ``/v1/completions`` prompt is encoded with special tokens added (``<s>`` before it,
    ``</s>`` after it too for one family): through the cache, the Python ``tokenizers`` ids
    and the uncached encoder's, cold and warm, alone and as a batch's first prompt."""
    directory = cached_directories[template]
    native = NativePromptTokenizer(str(directory))
    uncached = NativePromptTokenizer(str(directory), cache_bytes=0)
    assert native.cache_stats()["completions"] is True
    assert uncached.cache_stats()["completions"] is False
    python = _python_tokenizer(directory)
    rng = random.Random(f"completions-{template}")
    opening = _sentence(rng, 150)
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    prompts = [f"Session 3: {opening} turn {k}" for k in range(6)]
    prompts += [_texts_with_added_tokens(rng, specials) for _ in range(30)]
    prompts += ["", " ", "x", "<s>", " </s> ", "\n\n", "日本語"]
    for prompt in prompts:
        expected = list(python.encode(prompt, add_special_tokens=True).ids)
        body = json.dumps({"model": MODEL, "prompt": prompt})
        assert uncached.completion_tokens(body) == expected, prompt
        assert native.completion_tokens(body) == expected, prompt
        assert native.completion_tokens(body) == expected, prompt
        batch = json.dumps({"model": MODEL, "prompt": [prompt, "another one"]})
        assert native.completion_tokens(batch) == expected, prompt
    stats = native.cache_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["fallbacks"] == 0, stats
    assert uncached.cache_stats()["hits"] == 0


def test_hypothesis_texts_encode_as_the_whole_text(cached_directories: dict[str, Path]) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    natives = {
        name: (NativePromptTokenizer(str(cached_directories[name]), cache_bytes=8192), name)
        for name in ("default", "metaspace-first", "strip-rules", "llama-normalizer")
    }
    segment = st.one_of(
        st.sampled_from(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]),
        st.sampled_from(["knight", " knight", "knight!", "  "]),
        st.text(alphabet="ab dé▁\n\t日🐉<|>s/", max_size=60),
        st.sampled_from(WORDS).map(lambda w: f" {w} " * 12),
    )

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.lists(segment, max_size=10), st.sampled_from(sorted(natives)))
    def check(segments: list[str], name: str) -> None:
        native, _ = natives[name]
        text = "".join(segments)
        expected = _whole(cached_directories[name], text)
        assert native.encode_chat(text) == expected
        assert native.encode_chat(text) == expected

    check()


def test_threads_share_the_cache_and_agree_with_the_uncached_encoder(
    cached_directories: dict[str, Path],
) -> None:
    import concurrent.futures

    directory = cached_directories["metaspace-first"]
    # Small enough to evict while the threads read.
    native = NativePromptTokenizer(str(directory), cache_bytes=32768)
    rng = random.Random(11)
    texts = [_texts_with_added_tokens(rng, ["<s>", "<|user|>", "<|assistant|>"]) for _ in range(60)]
    oracle = {text: native.encode_whole(text) for text in texts}

    def worker(seed: int) -> int:
        local = random.Random(seed)
        wrong = 0
        for _ in range(400):
            text = local.choice(texts)
            wrong += native.encode_chat(text) != oracle[text]
        return wrong

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(worker, seed) for seed in range(6)]
        assert [f.result(timeout=120) for f in futures] == [0] * 6
    stats = native.cache_stats()
    assert stats["hits"] > 0 and stats["evictions"] > 0, stats
    assert stats["bytes"] <= 32768


def test_a_tokenizer_file_that_truncates_or_pads_encodes_whole_as_the_engine_does(
    cached_directories: dict[str, Path],
) -> None:
    """transformers sets the tokenizer's truncation and padding on every call, and vLLM asks
    for neither below the context length: a ``tokenizer.json`` that sets them (here, to 8 ids
    and padding to 256) is encoded without either, on both planes, and the cache is on."""
    directory = cached_directories["truncating"]
    whole = _python_tokenizer(directory)
    whole.no_truncation()
    whole.no_padding()
    native = NativePromptTokenizer(str(directory))
    python = PromptTokenizer(directory)
    assert native.cache_stats()["enabled"] is True
    prompt = " ".join(WORDS * 3)
    expected = list(whole.encode(prompt, add_special_tokens=True).ids)
    assert 8 < len(expected) < 256
    assert native.completion_tokens(json.dumps({"prompt": prompt})) == expected
    assert python.completion_tokens(prompt) == expected
    body = {"messages": [{"role": "user", "content": prompt}]}
    text = python.render_chat_request(body)
    expected = list(whole.encode(text, add_special_tokens=False).ids)
    assert native.chat_tokens(json.dumps(body)) == expected == python.chat_request_tokens(body)


@pytest.mark.parametrize(("kind", "reason"), [("normalized-added", "matched after normalization")])
def test_a_tokenizer_the_cache_cannot_vouch_for_turns_it_off(
    cached_directories: dict[str, Path], kind: str, reason: str
) -> None:
    directory = cached_directories[kind]
    native = NativePromptTokenizer(str(directory))
    stats = native.cache_stats()
    assert stats["enabled"] is False and reason in str(stats["disabled_reason"]), stats
    body = json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS * 3)}]})
    assert native.chat_tokens(body) == native.encode_whole(native.render_chat(body))
    assert native.cache_stats()["misses"] == 0


def test_bad_cache_sizes_are_config_errors(directories: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="cache_bytes"):
        NativePromptTokenizer(str(directories["default"]), cache_bytes=-1)
    from llmsched.gateway.config import load_config

    base = {"engines": [{"host": "127.0.0.1", "port": 9}], "models": [MODEL]}
    for bad in [-1, "32MB", 1.5, True, None, 2**41]:
        with pytest.raises(ConfigError, match="tokenizer_cache_bytes"):
            load_config({**base, "tokenizer_cache_bytes": bad})
    assert load_config(base).tokenizer_cache_bytes == 32 * 1024 * 1024
    assert load_config({**base, "tokenizer_cache_bytes": 0}).tokenizer_cache_bytes == 0


def test_the_gateway_counts_cache_hits_and_warns_once_when_it_is_off(
    cached_directories: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    import aiohttp

    from llmsched.testing.openai_engine import FakeOpenAIEngine

    async def serve(directory: Path) -> tuple[Any, str]:
        engine = FakeOpenAIEngine(model=MODEL)
        await engine.start()
        gateway = NativeGateway(
            {
                "engines": [{"host": "127.0.0.1", "port": engine.port}],
                "models": [MODEL],
                "listen": {"port": 0},
                "scrape": {"enabled": False},
                "data_plane": "native",
                "tokenizer": str(directory),
            }
        )
        await gateway.start()
        try:
            system = {"role": "system", "content": " ".join(WORDS * 4)}
            async with aiohttp.ClientSession() as client:
                for turn in range(4):
                    messages = [system, {"role": "user", "content": f"turn {turn}"}]
                    request = {"model": MODEL, "messages": messages, "max_tokens": 2}
                    url = f"{gateway.url}/v1/chat/completions"
                    async with client.post(url, json=request) as response:
                        assert response.status == 200
                # Completion prompts sharing a long beginning: its chunks are found.
                for turn in range(2):
                    prompt = f"{system['content']} completion {turn}"
                    request = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                    url = f"{gateway.url}/v1/completions"
                    async with client.post(url, json=request) as response:
                        assert response.status == 200
                async with client.get(f"{gateway.url}/metrics") as response:
                    text = await response.text()
            return gateway.tokenizer_cache_stats(), text
        finally:
            await gateway.stop()
            await engine.stop()

    with caplog.at_level("WARNING", logger="llmsched"):
        stats, metrics = run(serve(cached_directories["default"]))
    assert not [r for r in caplog.records if "tokenizer cache is off" in r.getMessage()]
    assert stats is not None and stats["enabled"] and stats["hits"] >= 3 + 2, stats
    assert stats["chunks"] and stats["completions"], stats
    assert f"llmsched_gateway_tokenizer_cache_hits_total {stats['hits']}.0" in metrics
    assert 'llmsched_gateway_tokenizer_cache_enabled{reason=""} 1.0' in metrics
    assert 'llmsched_gateway_tokenizer_cache_chunks_enabled{reason=""} 1.0' in metrics
    assert "llmsched_gateway_tokenizer_cache_completions_enabled 1.0" in metrics
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmsched"):
        stats, metrics = run(serve(cached_directories["normalized-added"]))
    warnings = [r for r in caplog.records if "tokenizer cache is off" in r.getMessage()]
    assert len(warnings) == 1 and "after normalization" in warnings[0].getMessage()
    assert stats is not None and not stats["enabled"] and stats["hits"] == 0
    assert "llmsched_gateway_tokenizer_cache_enabled{reason=" in metrics
    assert "after normalization" in metrics and "tokenizer_cache_enabled{" in metrics
    assert "llmsched_gateway_tokenizer_cache_completions_enabled 0.0" in metrics


def test_tools_are_left_out_for_tool_choice_none_where_the_engines_were_told(
    tmp_path: Path,
) -> None:
    """vLLM's ``--exclude-tools-when-tool-choice-none``: a request's ``tool_choice`` of
    ``"none"`` leaves its tools out of the template (a default or kwarg of that name stays),
    on both planes; without the flag the tools render."""
    directory = write_tokenizer(tmp_path / "tok")
    tool = {"type": "function", "function": {"name": "f"}}
    messages = [{"role": "user", "content": "hi"}]
    for exclude in (False, True):
        python = PromptTokenizer(
            directory,
            chat_template=KWARGS_TEMPLATE,
            default_chat_template_kwargs=KWARGS_DEFAULTS,
            exclude_tools_when_tool_choice_none=exclude,
        )
        native = NativePromptTokenizer(
            str(directory),
            chat_template=KWARGS_TEMPLATE,
            default_chat_template_kwargs=json.dumps(KWARGS_DEFAULTS),
            exclude_tools_when_tool_choice_none=exclude,
        )
        for choice, excluded in (("none", exclude), ("auto", False), (None, False)):
            body: dict[str, Any] = {"messages": messages, "tools": [tool]}
            if choice is not None:
                body["tool_choice"] = choice
            text = python.render_chat_request(body)
            assert native.render_chat(json.dumps(body)) == text
            assert ('"name": "f"' not in text) == excluded, (exclude, choice, text)
            assert ('[{"d": 1}]' in text) == excluded


def test_numbers_reach_the_template_as_python_s_json_reads_them(tmp_path: Path) -> None:
    """Integers past 64 bits (a JSON Schema's ``maximum``) stay exact, ``-0`` is the integer
    0, and floats are rounded as Python rounds them: the native plane renders what vLLM's
    Jinja does (it printed ``1e+22`` for 10**22)."""
    template = (
        "{{ (big or 0) + 1 }}|{{ tools | tojson }}|{{ small }}|{{ zero }}|{{ third }}"
        + CHAT_TEMPLATE
    )
    directory = write_tokenizer(tmp_path / "tok", chat_template=template)
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    parameters = (
        '{"type": "object", "maximum": 10000000000000000000000, "minimum": -0, "step": 0.1}'
    )
    text = (
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": ' + parameters + "}}], "
        '"chat_template_kwargs": {"big": 1180591620717411303424, "small": 1.5e-7, "zero": -0, '
        '"third": 0.30000000000000004}}'
    )
    rendered = python.render_chat_request(json.loads(text))
    assert rendered.startswith("1180591620717411303425|"), rendered
    assert '"maximum": 10000000000000000000000, "minimum": 0, "step": 0.1' in rendered
    assert "|1.5e-07|0|0.30000000000000004" in rendered
    assert native.render_chat(text) == rendered
