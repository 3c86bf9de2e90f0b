"""Gateway configuration: every key checked, errors name the key, the CLI reads the file."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmsched.cli import build_parser
from llmsched.errors import ConfigError
from llmsched.gateway import load_config
from llmsched.gateway.config import ApiKey

ENGINES = [{"host": "127.0.0.1", "port": 8001}, {"host": "127.0.0.1", "port": 8002}]


def base(**overrides: Any) -> dict[str, Any]:
    return {"engines": ENGINES, "models": ["tiny"], **overrides}


def test_defaults_and_a_full_file(tmp_path: Path) -> None:
    config = load_config(base())
    assert config.listen.host == "127.0.0.1" and config.listen.port == 8000
    assert config.flow is None and not config.auth.enabled and config.tokenizer is None
    assert config.router == "llm-d" and config.retries.max_attempts == 3
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"sk-file-key-0001": {"tenant": "f"}}))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    text = {
        "listen": {"host": "0.0.0.0", "port": 9000},
        "engines": [{**ENGINES[0], "role": "decode", "labels": {"zone": "a"}}],
        "models": "tiny",
        "block_size": 32,
        "tokenizer": "tok",
        "router": "prefix-only",
        "flow": {"default_band": {"ttl_s": 5}},
        "auth": {
            "api_keys": {"sk-inline-key-01": {"tenant": "t", "priority": 2}},
            "api_keys_file": "keys.yaml",
        },
        "limits": {"max_body_bytes": 2048, "retry_after_s": 3},
        "retries": {"max_attempts": 2, "eject_s": 1.5},
        "timeouts": {"connect_s": 0.5, "read_s": None},
        "scrape": {"interval_s": 0.5},
        "pd": {"enabled": True},
        "slices": {"enabled": False},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(text))
    config = load_config(path)
    assert config.listen.port == 9000 and config.models == ("tiny",)
    assert config.engines[0].role == "decode" and config.engines[0].labels == {"zone": "a"}
    assert config.tokenizer == tmp_path / "tok"
    assert config.auth.api_keys == {
        "sk-inline-key-01": ApiKey("t", 2),
        "sk-file-key-0001": ApiKey("f", 0),
    }
    assert config.timeouts.read_s is None and config.timeouts.connect_s == 0.5
    assert config.pd.header == "x-prefiller-host-port"


def test_api_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "GW_KEYS", json.dumps({"sk-env-key-00001": {"tenant": "env", "priority": -1}})
    )
    config = load_config(base(auth={"api_keys_env": "GW_KEYS"}))
    assert config.auth.api_keys == {"sk-env-key-00001": ApiKey("env", -1)}
    monkeypatch.delenv("GW_KEYS")
    with pytest.raises(ConfigError, match=r"auth\.api_keys_env: environment variable GW_KEYS"):
        load_config(base(auth={"api_keys_env": "GW_KEYS"}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engines": []}, "engines: must list at least one engine"),
        # The natural first guesses, an address string, get the form they should take.
        (
            {"engines": "http://127.0.0.1:8001"},
            r"^engines: must be a list of engines, each a mapping such as "
            r"\{host: 127\.0\.0\.1, port: 8001\} \(docs/config-keys\.md, `engines` entries\); "
            r"got str 'http://127\.0\.0\.1:8001'$",
        ),
        (
            {"engines": ["127.0.0.1:8001"]},
            r"^engines\[0\]: must be a mapping such as \{host: 127\.0\.0\.1, port: 8001\} "
            r".*; got str '127\.0\.0\.1:8001'$",
        ),
        (
            {"engines": [{"host": "http://10.0.0.7", "port": 8000}]},
            r"^engines\[0\]: host must be a host name or address without a scheme, "
            r"got 'http://10\.0\.0\.7' \(an engine at http://10\.0\.0\.7:8000 is host: "
            r"10\.0\.0\.7, port: 8000\)$",
        ),
        ({"engines": [{"host": "h"}]}, r"engines\[0\]: .*'port'"),
        (
            {"engines": [{"host": "h", "port": 1, "replicas": 2}]},
            r"engines\[0\]: unknown engine key 'replicas'",
        ),
        ({"engines": [ENGINES[0], ENGINES[0]]}, "engines: 127.0.0.1:8001 is listed twice"),
        ({"models": []}, "models: must list"),
        ({"model": "x"}, "model: unknown key"),
        ({"block_size": 0}, "block_size: must be an int"),
        ({"tokenizer": "/nonexistent"}, "tokenizer: .* holds no tokenizer.json"),
        ({"router": 3}, "router: must be"),
        ({"flow": [1]}, "flow: must be a mapping"),
        ({"listen": {"port": 70000}}, r"listen.port: must be an int in 0..65535"),
        ({"listen": {"address": "x"}}, "listen.address: unknown key"),
        ({"limits": {"max_body_bytes": 10}}, "limits.max_body_bytes: must be an int"),
        ({"limits": {"max_body": 10}}, "limits.max_body: unknown key"),
        ({"retries": {"max_attempts": 0}}, "retries.max_attempts"),
        ({"retries": {"eject_s": -1}}, "retries.eject_s"),
        ({"timeouts": {"connect_s": "1s"}}, "timeouts.connect_s"),
        ({"scrape": {"interval_s": 0}}, "scrape.interval_s"),
        ({"scrape": {"enabled": "yes"}}, "scrape.enabled: must be true or false"),
        ({"pd": {"header": "bad header"}}, "pd.header"),
        ({"slices": {"enabled": "yes"}}, "slices.enabled: must be true or false"),
        ({"slices": {"policy": "lottery"}}, "slices: "),
        ({"slices": {"params": {"slice_tokens": 0}}}, "slices: "),
        ({"slices": {"chunk": 5}}, "slices.chunk: unknown key"),
        ({"record_unread_prefixes": "yes"}, "^record_unread_prefixes: must be true or false"),
        ({"auth": {"api_keys": {"short": {"tenant": "t"}}}}, "auth.api_keys: every key must be"),
        (
            {"auth": {"api_keys": {"sk-long-enough-1": {"priority": 1}}}},
            r"auth.api_keys.<key>.tenant",
        ),
        (
            {"auth": {"api_keys": {"sk-long-enough-1": {"tenant": "t", "role": "x"}}}},
            r"<key>.role: unknown key",
        ),
        ({"auth": {"api_keys_file": "/nonexistent.yaml"}}, "auth.api_keys_file: .* does not exist"),
    ],
)
def test_config_errors_name_the_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(base(**overrides))


def test_key_errors_never_echo_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(base(auth={"api_keys": {"sk-secret-value-1": {"tenant": 5}}}))
    assert "sk-secret-value-1" not in str(info.value)


def test_a_malformed_keys_file_never_echoes_a_key(tmp_path: Path) -> None:
    """PyYAML's message quotes the line it stopped at: for a keys file, only the line and
    column are named."""
    path = tmp_path / "keys.yaml"
    path.write_text("sk-secret-value-1: {tenant: [a\n")
    with pytest.raises(ConfigError) as info:
        load_config(base(auth={"api_keys_file": str(path)}))
    assert str(info.value) == (
        f"auth.api_keys_file: cannot read {str(path)!r}: not valid YAML / JSON "
        "(expected ',' or ']', but got '<stream end>' at line 2, column 1 "
        "(while parsing a flow sequence that begins at line 1, column 29))"
    )


def test_missing_or_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(bad)
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="config: must be a mapping"):
        load_config(bad)


# A "billion laughs" document: seven levels of ten aliases each stand for 10**7 values.
_ALIAS_BOMB = "\n".join(
    [
        "models: [tiny]",
        "engines: [{host: 127.0.0.1, port: 8001}]",
        "flow:",
        "  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]",
        *(
            f"  {c}: &{c} [{', '.join([f'*{p}'] * 10)}]"
            for p, c in zip("abcdef", "bcdefg", strict=True)
        ),
    ]
)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        # 5,000 levels in 10 KB: the YAML parser itself runs out of stack.
        ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000, "nested more than 32 levels"),
        ("deep.json", '{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 32 levels"),
        # Parsed, but deeper than any config (and than the core takes).
        ("deep40.yaml", "a: " + "[" * 40 + "]" * 40, "nested more than 32 levels"),
        ("cycle.yaml", "flow: &x {x: *x}", "a YAML alias refers to a node that contains it"),
        ("bomb.yaml", _ALIAS_BOMB, "YAML aliases repeat more than 1,000,000 values"),
        # A scalar the safe loader cannot build raised ValueError, not ConfigError.
        ("date.yaml", "a: 2020-13-01", "a value cannot be read: month must be in 1..12"),
    ],
)
def test_absurd_nesting_is_a_config_error_naming_the_file(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"config: cannot read {str(path)!r}: not valid YAML / JSON ({problem})"
    )


def test_absurd_nesting_in_every_loader(tmp_path: Path) -> None:
    """Every loader of a user's file or text refuses it the same way: the router, flow and
    scheduler configs, simulator scenarios and API keys from a file or the environment."""
    from llmsched import flow, routing
    from llmsched.config_loader import load_mapping
    from llmsched.sim.config import load_scenario

    deep = "a: " + "[" * 5000 + "]" * 5000
    path = tmp_path / "deep.yaml"
    path.write_text(deep)
    for load in (flow.load_config, routing.load_config):
        with pytest.raises(ConfigError, match=r"nested more than 32 levels"):
            load(path)
        with pytest.raises(ConfigError, match=r"nested more than 32 levels"):
            load(deep)
    with pytest.raises(ConfigError, match=r"^scenario: cannot read .*nested more than 32"):
        load_scenario(path=path)
    with pytest.raises(ConfigError, match=r"^step-time profile: cannot read .*nested more"):
        load_mapping(path, what="step-time profile")
    keys = tmp_path / "keys.yaml"
    keys.write_text(deep)
    with pytest.raises(ConfigError, match=r"^auth.api_keys_file: cannot read .*nested more"):
        load_config(base(auth={"api_keys_file": str(keys)}))


def test_absurd_nesting_in_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEEP_KEYS", "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match=r"^auth.api_keys_env: DEEP_KEYS is not a YAML / JSON"):
        load_config(base(auth={"api_keys_env": "DEEP_KEYS"}))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "priority",
            2**40,
            r"priority: must be an int in -2147483648..2147483647, got 1099511627776",
        ),
        (
            "priority",
            -(2**31) - 1,
            r"priority: must be an int in -2147483648..2147483647, got -2147",
        ),
        ("priority", 1.5, r"priority: must be an int in -2147483648..2147483647, got 1.5"),
        ("max_concurrent", 2**64, r"max_concurrent: must be an int in 1..18446744073709551615"),
    ],
)
def test_api_key_integers_fit_the_native_plane(field: str, value: object, message: str) -> None:
    """A key's priority is an i32 and its max_concurrent a u64 on the native plane: a value
    outside them is refused when the config is loaded, naming the key by its tenant."""
    key = "sk-secret-value-1"
    with pytest.raises(ConfigError) as info:
        load_config(base(auth={"api_keys": {key: {"tenant": "team-a", field: value}}}))
    assert str(info.value).startswith(f"auth.api_keys.<key team-a>.{field}: ")
    assert key not in str(info.value)
    assert re.search(message, str(info.value)), info.value
    # The edges themselves are taken.
    edge = {"priority": -(2**31), "max_concurrent": 2**64 - 1}[field]
    config = load_config(base(auth={"api_keys": {key: {"tenant": "team-a", field: edge}}}))
    assert getattr(config.auth.api_keys[key], field) == edge


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"flow": {"bands": [{"priority": 2**40}]}},
            r"^flow\.bands\[0\]\.priority: must be an int in -2147483648\.\.2147483647, got 1099",
        ),
        (
            {"flow": {"default_band": {"max_requests": 2**70}}},
            r"^flow\.default_band\.max_requests: must be an int in -2\*\*63\.\.2\*\*64-1, got 1180",
        ),
        (
            {"router": {"plugins": [{"type": "x", "parameters": {"n": -(2**64)}}]}},
            r"^router\.plugins\[0\]\.parameters\.n: must be an int in -2\*\*63\.\.2\*\*64-1",
        ),
    ],
)
def test_flow_and_router_ints_are_checked_when_loaded(
    overrides: dict[str, Any], message: str
) -> None:
    """An int no core field can hold is named by its key path when the config is loaded
    (it reached the core as "JSON number out of range", naming no key)."""
    with pytest.raises(ConfigError, match=message):
        load_config(base(**overrides))


def test_router_and_flow_errors_surface_when_the_gateway_is_built() -> None:
    from llmsched.gateway import Gateway

    with pytest.raises(ConfigError):
        Gateway(base(router={"plugins": [{"type": "no-such-plugin"}]}))
    with pytest.raises(ConfigError):
        Gateway(base(flow={"default_band": {"no_such_key": 1}}))


def test_serve_command_parses_its_arguments() -> None:
    args = build_parser().parse_args(["serve", "--config", "g.yaml", "--port", "0"])
    assert args.config == "g.yaml" and args.port == 0 and args.host is None


def test_serve_command_reports_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(base(retries={"max_attempts": 0})))
    done = subprocess.run(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "retries.max_attempts" in done.stderr


@pytest.mark.parametrize("plane", ["python", "native"])
@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("a: " + "[" * 5000 + "]" * 5000, "nested more than 32 levels"),
        (
            yaml.safe_dump(
                base(auth={"api_keys": {"sk-secret-value-1": {"tenant": "t", "priority": 2**40}}})
            ),
            "auth.api_keys.<key t>.priority: must be an int in -2147483648..2147483647",
        ),
    ],
)
def test_serve_command_reports_a_config_error_in_one_line(
    tmp_path: Path, plane: str, text: str, wanted: str
) -> None:
    """A deeply nested file or an out-of-range key priority is the one-line error and exit 2
    of every malformed file, on either data plane (not a traceback, nor a serde message)."""
    path = tmp_path / "g.yaml"
    path.write_text(f"data_plane: {plane}\n{text}")
    done = subprocess.run(
        [sys.executable, "-m", "llmsched", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("llmsched serve: "), done.stderr[-2000:]
    assert wanted in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
    assert "sk-secret-value-1" not in done.stderr


def test_serve_command_serves_until_signalled(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(base(scrape={"enabled": False})))
    command = [sys.executable, "-m", "llmsched", "serve", "--config", str(path)]
    with subprocess.Popen(
        [*command, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    ) as process:
        _check_serving(process, port)


@pytest.mark.parametrize("plane", ["python", "native"])
def test_serve_command_runs_either_data_plane(tmp_path: Path, plane: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(base(scrape={"enabled": False})))
    command = [sys.executable, "-m", "llmsched", "serve", "--config", str(path)]
    with subprocess.Popen(
        [*command, "--port", str(port), "--data-plane", plane],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    ) as process:
        _check_serving(process, port, plane=plane)


def test_the_native_plane_is_the_default() -> None:
    from llmsched.gateway import Gateway, NativeGateway, make_gateway

    assert load_config(base()).data_plane == "native"
    assert isinstance(make_gateway(base()), NativeGateway)
    assert isinstance(make_gateway(base(data_plane="python")), Gateway)


def test_an_unknown_data_plane_is_refused() -> None:
    with pytest.raises(ConfigError, match="data_plane"):
        load_config(base(data_plane="rust"))


def _check_serving(process: subprocess.Popen[str], port: int, *, plane: str = "native") -> None:
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"listening on http://127.0.0.1:{port}" in line, line
        assert f"({plane} data plane)" in line, line
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert json.load(r) == {"status": "ok"}
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0


def test_engine_set_refuses_a_stranger_with_an_llmsched_error() -> None:
    # What Gateway.set_engines (discovery) calls: a bare TypeError before (probe 50 F15).
    from llmsched.errors import InvalidTypeError
    from llmsched.gateway.config import engine_set

    with pytest.raises(InvalidTypeError, match="engines must be EngineSpec, got object"):
        engine_set(load_config(base()), [object()])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "header", ["content-length", "Transfer-Encoding", "host", "content-type", "x\ny", "x:y"]
)
def test_the_pd_header_cannot_be_one_the_gateway_sets_itself(header: str) -> None:
    """Probe 51 F8: `pd.header: content-length` made the Python plane answer every split request
    500 (transfer-encoding: a request framed twice); the native plane dropped it silently."""
    with pytest.raises(ConfigError, match=r"pd\.header"):
        load_config(base(pd={"enabled": True, "header": header}))


@pytest.mark.parametrize(
    "key", ["clé-secrète-1", " leading-space", "trailing-space ", "tab\tinside1"]
)
def test_api_keys_a_client_cannot_present_are_refused(key: str) -> None:
    """Probe 51 F9: a key with an accented letter authenticated on the Python plane and never on
    the native one (it reads only visible ASCII in a header); a space at an end is trimmed off
    by both, so such a key matched nothing. The message names the tenant, never the key."""
    with pytest.raises(ConfigError, match="visible ASCII") as error:
        load_config(base(auth={"api_keys": {key: {"tenant": "team-a"}}}))
    assert "team-a" in str(error.value) and key.strip() not in str(error.value)
    assert load_config(base(auth={"api_keys": {"inner space key": {"tenant": "t"}}})).auth.enabled


@pytest.mark.parametrize(
    ("page", "after"),
    [("README.md", "\n## Quick start\n"), ("docs/gateway.md", "\n## Configuration\n")],
)
def test_the_documented_gateway_config_loads_as_written(
    page: str, after: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's quick-start gateway.yaml and the gateway page's annotated one, each copied as
    it stands next to a ./tiny-model tokenizer, load. The README's named `api_keys_env:
    LLMSCHED_API_KEYS`, a variable nobody following the README had set, so `llmsched serve
    --config gateway.yaml` stopped at `auth.api_keys_env: environment variable
    LLMSCHED_API_KEYS is not set`."""
    from llmsched.testing.openai_engine import write_tokenizer

    text = (Path(__file__).resolve().parent.parent / page).read_text()
    section = text.split(after, 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    monkeypatch.delenv("LLMSCHED_API_KEYS", raising=False)
    monkeypatch.chdir(tmp_path)
    write_tokenizer(tmp_path / "tiny-model")
    (tmp_path / "gateway.yaml").write_text(example)
    config = load_config(tmp_path / "gateway.yaml")
    assert [e.topic for e in config.engines] == ["kv@a", "kv@b"]
    assert config.models == ("tiny",) and config.block_size == 32
