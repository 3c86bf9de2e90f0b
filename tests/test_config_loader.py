"""llmsched.config_loader: every component reads config the same way (mapping, text, YAML or
JSON file) and fails the same way, naming what it read and the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsched.config_loader import load_mapping, looks_like_text, read_config, read_document
from llmsched.errors import ConfigError
from llmsched.flow import FlowController
from llmsched.gateway.config import load_config as gateway_config
from llmsched.routing import load_config as router_config
from llmsched.sim.config import load_scenario
from llmsched.sim.stepmodel import load_step_model

DOC = {"default_band": {"ttl_s": 30}, "bands": [{"priority": -1}]}


def test_mapping_text_yaml_and_json_files_read_alike(tmp_path: Path) -> None:
    as_yaml = tmp_path / "c.yaml"
    as_yaml.write_text(yaml.safe_dump(DOC))
    as_json = tmp_path / "c.json"
    as_json.write_text(json.dumps(DOC))
    sources: list[Any] = [DOC, yaml.safe_dump(DOC), json.dumps(DOC), as_yaml, str(as_json)]
    for source in sources:
        assert load_mapping(source, what="c") == DOC
    copy = load_mapping(DOC, what="c")
    copy["extra"] = 1
    assert "extra" not in DOC


@pytest.mark.parametrize(
    ("text", "is_text"),
    [("a.yaml", False), ("", True), ("   ", True), ("a: 1", True), ("{}", True), ("[1]", True)],
)
def test_text_or_path(text: str, is_text: bool) -> None:
    assert looks_like_text(text) is is_text


def test_empty_documents_are_empty_mappings(tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert load_mapping(empty, what="c") == {}
    assert load_mapping("", what="c") == {}
    assert read_document("", what="c") is None


def test_errors_name_what_and_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"^c: cannot read '.*missing\.yaml': does not exist$"):
        load_mapping(missing, what="c")
    with pytest.raises(ConfigError, match=r"^c: cannot read '.*': Is a directory$"):
        load_mapping(tmp_path, what="c")
    bad = tmp_path / "bad.json"
    bad.write_text("{'single': quotes}")
    with pytest.raises(ConfigError, match=r"^c: cannot read '.*bad\.json': not valid YAML / JSON"):
        load_mapping(bad, what="c")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"^c: must be a mapping, got list \('.*list\.yaml'\)$"):
        load_mapping(listed, what="c")
    with pytest.raises(ConfigError, match=r"^c: not valid YAML / JSON"):
        load_mapping("a: [", what="c")
    with pytest.raises(TypeError, match="c must be a path or YAML / JSON text, got int"):
        read_document(3, what="c")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "replicas: 4\nworkload: {sessions: 20, turns: 3\n  seed: 1\n",
            "expected ',' or '}', but got ':' at line 3, column 7: '  seed: 1' "
            "(while parsing a flow mapping that begins at line 2, column 11)",
        ),
        (
            "replicas: [1\n",
            "expected ',' or ']', but got '<stream end>' at line 2, column 1 "
            "(while parsing a flow sequence that begins at line 1, column 11)",
        ),
        ("a: 1\r\nb: : 2\r\n", "mapping values are not allowed here at line 2, column 4: 'b: : 2'"),
        (
            "k: v\n\tl: 2\n",
            "found character '\\t' that cannot start any token at line 2, column 1: '\\tl: 2'",
        ),
    ],
)
def test_a_yaml_syntax_error_names_its_line(text: str, reason: str, tmp_path: Path) -> None:
    """PyYAML's message, flattened onto one line, read ``while parsing a flow sequence in
    "<unicode string>", line 1, column 11: replicas: [1 ^ expected ...``: the file called a
    unicode string and a caret pointing nowhere. Now: the problem, its line and column and
    that line's text, then where what it was parsing began."""
    path = tmp_path / "s.yaml"
    path.write_bytes(text.encode())
    with pytest.raises(ConfigError) as info:
        load_mapping(path, what="scenario")
    assert (
        str(info.value) == f"scenario: cannot read {str(path)!r}: not valid YAML / JSON ({reason})"
    )
    with pytest.raises(ConfigError) as info:
        load_mapping(text, what="scenario")
    assert str(info.value) == f"scenario: not valid YAML / JSON ({reason})"


def test_key_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("replicas: 0\n")
    doc = read_config(path, what="scenario")
    assert doc.path == path
    assert str(doc.error("replicas", "must be at least 1")) == (
        f"scenario {str(path)!r}: replicas: must be at least 1"
    )


LOADERS: dict[str, tuple[Callable[[Any], object], str]] = {
    "router": (router_config, "router config"),
    "flow": (FlowController, "flow config"),
    "gateway": (gateway_config, "config"),
    "scenario": (lambda p: load_scenario(path=p), "scenario"),
    "step model": (load_step_model, "step model"),
}


@pytest.mark.parametrize("component", sorted(LOADERS))
def test_every_component_fails_the_same_way(component: str, tmp_path: Path) -> None:
    load, what = LOADERS[component]
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    with pytest.raises(ConfigError, match=rf"^{what}: cannot read '.*bad\.yaml': not valid YAML"):
        load(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ConfigError, match=rf"^{what}: must be a mapping, got list"):
        load(listed)


def test_components_read_json_files(tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"coefficients": {"b0": 0.001, "b1": 1e-5, "b2": 5e-5}}))
    assert load_step_model(path).b1 == 1e-5
    flow = tmp_path / "flow.json"
    flow.write_text(json.dumps(DOC))
    assert FlowController(flow).config["default_band"]["ttl_s"] == 30
    router = tmp_path / "router.json"
    router.write_text(json.dumps(router_config("prefix-only")))
    assert router_config(router) == router_config("prefix-only")


# 5,000 levels in 10 KB: both parsers are recursive and run out of stack.
DEEP = {
    "deep.yaml": "a: " + "[" * 5000 + "]" * 5000,
    "deep.json": '{"a": ' + "[" * 5000 + "]" * 5000 + "}",
    "cycle.yaml": "a: &x [*x]",
}
DEEP_REASONS = {
    "deep.yaml": "nested more than 32 levels",
    "deep.json": "nested more than 32 levels",
    "cycle.yaml": "a YAML alias refers to a node that contains it",
}


@pytest.mark.parametrize("component", sorted(LOADERS))
@pytest.mark.parametrize("name", sorted(DEEP))
def test_every_component_refuses_absurd_nesting(component: str, name: str, tmp_path: Path) -> None:
    """A deeply nested or self-referencing document is the same one-line ConfigError as any
    malformed file (it was a RecursionError, or a ValueError from a later copy)."""
    load, what = LOADERS[component]
    path = tmp_path / name
    path.write_text(DEEP[name])
    with pytest.raises(ConfigError) as info:
        load(path)
    reason = DEEP_REASONS[name]
    assert str(info.value) == f"{what}: cannot read {str(path)!r}: not valid YAML / JSON ({reason})"


def test_text_too_long_for_a_file_name_is_text() -> None:
    """A one-line document longer than a file name can be is text (it was an OSError)."""
    text = "a: " + "[" * 5000 + "]" * 5000
    assert looks_like_text(text)
    with pytest.raises(ConfigError, match=r"^flow config: not valid YAML / JSON \(nested more"):
        FlowController(text)


def test_a_trace_line_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    from llmsched.sim.workloads import make_workload

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "x": ' + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=r"^trace .*t\.jsonl:1: not JSON: nested too deeply$"):
        make_workload({"kind": "trace", "path": str(path)}, seed=0, block_size=16)


def test_a_tokenizer_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from llmsched.tokenize import PromptTokenizer

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "tokenizer_config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ConfigError, match=r"^tokenizer: '.*tokenizer_config\.json': nested too"):
        PromptTokenizer(tmp_path)


GATEWAY_HEAD = "engines: [{host: 127.0.0.1, port: 9}]\nmodels: [tiny]\n"


@pytest.mark.parametrize(
    ("text", "name"),
    [
        (GATEWAY_HEAD + "auth: {api_keys: {abcdefgh1: {tenant: t}}}\nauth: {}\n", "gw.yaml"),
        ('{"models": ["a"], "models": ["b"]}', "gw.json"),
        (GATEWAY_HEAD + "limits: {max_connections: 4, max_connections: 400000}\n", "gw.yaml"),
    ],
    ids=["yaml-auth-twice", "json", "nested"],
)
def test_a_key_named_twice_is_refused(text: str, name: str, tmp_path: Path) -> None:
    """Probe 51 F2: YAML and JSON keep the last of two equal keys silently: a second `auth:`
    section started the gateway with its API keys off."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="appears twice"):
        gateway_config(path)


def test_merge_keys_may_still_be_overridden() -> None:
    text = "base: &b {ttl_s: 30, max_requests: 2}\nband: {<<: *b, ttl_s: 5}\n"
    assert load_mapping(text, what="config")["band"] == {"ttl_s": 5, "max_requests": 2}


def test_a_key_named_twice_in_a_secret_document_is_not_quoted(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("secret-key-1: {tenant: a}\nsecret-key-1: {tenant: b}\n")
    config = tmp_path / "gw.yaml"
    config.write_text(GATEWAY_HEAD + f"auth: {{api_keys_file: {keys}}}\n")
    with pytest.raises(ConfigError, match="appears twice") as error:
        gateway_config(config)
    assert "secret-key-1" not in str(error.value)


def test_a_lone_surrogate_escape_is_refused(tmp_path: Path) -> None:
    """Probe 51 F5: `"\\ud800"` in a host was an InvalidValueError traceback from `llmsched
    serve`; in a model, tenant or key the native plane failed with serde's "unexpected end of
    hex escape", naming no key."""
    for field in (
        'engines: [{host: "\\ud800", port: 9}]\nmodels: [tiny]\n',
        GATEWAY_HEAD.replace("[tiny]", '["ti\\udc80ny"]'),
    ):
        path = tmp_path / "gw.yaml"
        path.write_text(field)
        with pytest.raises(ConfigError, match="lone surrogate"):
            gateway_config(path)
    with pytest.raises(ConfigError, match="lone surrogate"):
        load_mapping('{"a": "\\ud800"}', what="config")


def test_a_document_too_large_is_refused_unparsed(tmp_path: Path) -> None:
    """Probe 51 F4: a 100 MB config held `llmsched serve` in the YAML parser for minutes."""
    from llmsched.config_loader import MAX_DOCUMENT_BYTES

    path = tmp_path / "gw.yaml"
    with path.open("w") as file:
        file.write(GATEWAY_HEAD + "# ")
        file.truncate(MAX_DOCUMENT_BYTES + 1)
    with pytest.raises(ConfigError, match="larger than"):
        gateway_config(path)


def test_a_key_that_is_not_a_string_beside_strings_is_a_config_error(tmp_path: Path) -> None:
    """Probe 51 F6: `limits: {1: 2, a: 3}` was a TypeError (sorting an int and a str)."""
    path = tmp_path / "gw.yaml"
    path.write_text(GATEWAY_HEAD + "limits: {1: 2, a: 3}\n")
    with pytest.raises(ConfigError, match="unknown key"):
        gateway_config(path)
    path.write_text(GATEWAY_HEAD + "1: 2\nzz: 3\n")
    with pytest.raises(ConfigError, match="unknown key"):
        gateway_config(path)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-3", 1e-3), ("2E5", 2e5), ("-1.5e3", -1.5e3), (".5e1", 5.0), ("1.5e+3", 1.5e3)],
)
def test_numbers_with_an_exponent_are_numbers(text: str, value: float) -> None:
    # YAML 1.1 left `1e-3` (no dot) and `1.5e3` (unsigned exponent) strings; JSON, YAML 1.2
    # and llm-d's Go loader read numbers, so an llm-d threshold written so was refused.
    assert load_mapping(f"x: {text}", what="config") == {"x": value}
    assert load_mapping(f"x: '{text}'", what="config") == {"x": text}


def test_an_llm_d_parameter_written_with_an_exponent_loads() -> None:
    doc = (
        "plugins:\n- type: lora-affinity-filter\n  parameters: {threshold: 9.99e-1}\n"
        "- type: queue-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n"
        "  - pluginRef: lora-affinity-filter\n  - pluginRef: queue-scorer\n    weight: 2e0\n"
    )
    config = router_config(doc)
    assert config["plugins"][0]["parameters"]["threshold"] == 0.999
    assert config["schedulingProfiles"][0]["plugins"][1]["weight"] == 2.0
