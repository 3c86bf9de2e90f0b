"""Gateway tokenization: completion prompts and chat templates rendered like Hugging Face /
vLLM, and routing on the resulting token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from _gateway_harness import MODEL, plane, rig, run  # noqa: F401 (the fixture)
from tokenizers import Tokenizer

from llmsched.errors import ConfigError
from llmsched.testing.openai_engine import write_tokenizer
from llmsched.tokenize import PromptError, PromptTokenizer


def make_tokenizer(directory: Path, *, template_file: bool = False, **config: object) -> Path:
    return write_tokenizer(directory, template_file=template_file, **config)


MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "hello there"},
]
RENDERED = (
    "<s><|system|>\nyou are a helpful assistant</s>\n<|user|>\nhello there</s>\n<|assistant|>\n"
)


@pytest.mark.parametrize("template_file", [False, True])
def test_chat_template_renders_like_hugging_face(tmp_path: Path, template_file: bool) -> None:
    tok = PromptTokenizer(make_tokenizer(tmp_path, template_file=template_file))
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert tok.render_chat(MESSAGES) == RENDERED
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.chat_tokens(MESSAGES)
    # The template wrote the BOS; encoding does not add a second one (vLLM's chat default).
    assert ids == raw.encode(RENDERED, add_special_tokens=False).ids
    bos = raw.token_to_id("<s>")
    assert ids[0] == bos and ids[1] != bos


def test_completion_prompts_get_special_tokens_and_id_lists_pass_unchanged(tmp_path: Path) -> None:
    tok = PromptTokenizer(make_tokenizer(tmp_path))
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.completion_tokens("hello there")
    assert ids == raw.encode("hello there").ids
    assert ids[0] == raw.token_to_id("<s>")
    assert tok.completion_tokens([5, 6, 7]) == [5, 6, 7]
    assert tok.completion_tokens(["hello there", "other"]) == ids  # a batch: the first prompt
    for bad in (3, [1, -1], [1.5], None):
        with pytest.raises(PromptError):
            tok.completion_tokens(bad)


def test_list_contents_join_their_text_parts(tmp_path: Path) -> None:
    tok = PromptTokenizer(make_tokenizer(tmp_path))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.render_chat(parts) == "<s><|user|>\na\nb</s>\n<|assistant|>\n"
    with pytest.raises(PromptError, match="unsupported content part type"):
        tok.render_chat([{"role": "user", "content": [{"type": "image", "image": {}}]}])
    # A media part: the render stops where that message's content begins.
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert tok.render_chat([{"role": "user", "content": ["a", image]}]) == "<s><|user|>\n"


def test_template_errors_become_prompt_errors(tmp_path: Path) -> None:
    tok = PromptTokenizer(make_tokenizer(tmp_path))
    with pytest.raises(PromptError, match="unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(PromptError):
        tok.render_chat([])


def test_a_python_error_inside_the_template_is_a_prompt_error(tmp_path: Path) -> None:
    """jinja2 lets ``"x" + 1`` through as a TypeError; the client's request caused it, so it
    must reach the gateway as a PromptError (a 400), not a 500."""
    template = "{% for m in messages %}{{ m.name + ': ' + m.content + suffix }}{% endfor %}"
    tok = PromptTokenizer(make_tokenizer(tmp_path, chat_template=template))
    ann = [{"role": "user", "content": "hi", "name": "ann"}]
    assert tok.render_chat(ann, {"suffix": "!"}) == "ann: hi!"
    with pytest.raises(PromptError, match="TypeError"):
        tok.render_chat(ann, {"suffix": 1})


def test_template_features_hugging_face_provides(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
        "{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
    )
    tok = PromptTokenizer(make_tokenizer(tmp_path, chat_template=template))
    assert tok.render_chat([{"role": "user", "content": "é<"}, MESSAGES[0]]) == '"é<"'


def test_the_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = PromptTokenizer(make_tokenizer(tmp_path, chat_template=template))
    with pytest.raises(PromptError):
        tok.render_chat(MESSAGES)


def test_named_templates_and_missing_template(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert (
        PromptTokenizer(make_tokenizer(tmp_path / "a", chat_template=named)).render_chat(MESSAGES)
        == "D"
    )
    tok = PromptTokenizer(make_tokenizer(tmp_path / "b", chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(PromptError, match="no chat template"):
        tok.chat_tokens(MESSAGES)


def test_broken_tokenizer_directories_raise_config_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load"):
        PromptTokenizer(tmp_path)
    good = make_tokenizer(tmp_path / "good", chat_template="{% for %}")
    with pytest.raises(ConfigError, match="does not compile"):
        PromptTokenizer(good)


def test_matches_transformers_apply_chat_template_when_available(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = make_tokenizer(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    tok = PromptTokenizer(directory)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(MESSAGES) == expected
    # vLLM's chat path: render, then encode without adding special tokens.
    assert tok.chat_tokens(MESSAGES) == reference(expected, add_special_tokens=False)["input_ids"]
    # vLLM's completion path: encode with special tokens.
    assert tok.completion_tokens("hello there") == reference("hello there")["input_ids"]


@pytest.mark.usefixtures("plane")
def test_the_gateway_routes_chat_on_template_token_ids(tmp_path: Path) -> None:
    directory = make_tokenizer(tmp_path)
    tok = PromptTokenizer(directory)

    async def body() -> None:
        async with rig(engines=2, tokenizer=str(directory)) as r:
            history = list(MESSAGES)
            homes = set()
            for turn in range(3):
                request = {"model": MODEL, "messages": history}
                async with r.client.post(r.url("/v1/chat/completions"), json=request) as response:
                    assert response.status == 200
                    answer = (await response.json())["choices"][0]["message"]["content"]
                served = r.engine_of_request(-1)
                homes.add(served.port)
                # The index holds the blocks of the template's token ids for that engine.
                ids = tok.chat_tokens(history)
                worker = f"127.0.0.1:{served.port}"
                assert r.gateway.index.match_tokens(ids).as_dict()[worker] == len(ids) // 4
                history = [*history, {"role": "assistant", "content": answer}]
                history.append({"role": "user", "content": f"and turn {turn}"})
            assert len(homes) == 1
            bad = {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}
            async with r.client.post(r.url("/v1/chat/completions"), json=bad) as response:
                assert response.status == 400
                assert "unknown role" in (await response.json())["error"]["message"]

    run(body())
