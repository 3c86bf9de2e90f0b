"""The native plane's prompt tokenizer (the Rust ``tokenizers`` crate and minijinja) against
the Python plane's (:class:`llmsched.tokenize.PromptTokenizer`: Python ``tokenizers`` and
jinja2): the same token ids for the same tokenizer directory and request, chat and
completions; templates the native engine cannot render refused at load; malformed requests
refused with the problem named, never a crash."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)

from llmsched import _llmsched
from llmsched.errors import ConfigError, GatewayStoppedError, InvalidRequestError
from llmsched.gateway import NativeGateway
from llmsched.testing.openai_engine import write_tokenizer
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

TEMPLATES = {"default": None, "qwen": QWEN_TEMPLATE, "features": FEATURES_TEMPLATE}

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


def _variables(body: dict[str, Any]) -> dict[str, Any]:
    """The template variables the Python plane takes from a chat body (as the gateway does)."""
    extra = body.get("chat_template_kwargs")
    variables = dict(extra) if isinstance(extra, dict) else {}
    if body.get("tools") is not None:
        variables["tools"] = body["tools"]
    return variables


def _both(directory: Path, body: dict[str, Any]) -> tuple[Any, Any]:
    """(Python ids or the PromptError text, native ids or the InvalidRequestError text)."""
    python = PromptTokenizer(directory)
    native = NativePromptTokenizer(str(directory))
    try:
        expected: Any = python.chat_tokens(body["messages"], _variables(body))
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
    text = python.render_chat(messages, _variables(body))
    assert native.render_chat(json.dumps(body)) == text
    ids = python.chat_tokens(messages, _variables(body))
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
    for body in (
        {"messages": messages, "tools": TOOLS},
        {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs},
        {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
        {"messages": messages, "tools": None, "chat_template_kwargs": "not a dict"},
    ):
        python = PromptTokenizer(directories[template])
        native = NativePromptTokenizer(str(directories[template]))
        assert native.render_chat(json.dumps(body)) == python.render_chat(
            messages, _variables(body)
        )
        expected, got = _both(directories[template], body)
        assert got == expected


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
