"""Writes docs/config-keys.md, the keys of each configuration file format, from the loaders.

Nothing here lists a key by hand. Gateway: each section's accepted keys are what
``llmsched.gateway.config.load_config`` answers when given an unknown one, with types and
defaults from the section's dataclass. Flow control: ``llmsched.flow.default_config()`` (the
resolved defaults, from the native core) with the shapes of the ``FlowConfig`` TypedDict.
Simulator scenario: the ``ScenarioConfig`` dataclass and the dataclasses of its sections.
Router: the ``EndpointPickerConfig`` sections, and the plugin types from the registry.
``--check`` compares instead of writing and exits 1 when the page is out of date (the test suite
does the same comparison).

    .venv/bin/python tools/gen_config_keys.py          # regenerate
    .venv/bin/python tools/gen_config_keys.py --check  # compare only
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config-keys.md"


def _value(v: Any) -> str:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return "see below"
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, Mapping):
        v = dict(v)
    if isinstance(v, tuple):
        v = list(v)
    try:
        return "`" + json.dumps(v) + "`"
    except TypeError:
        return f"`{v!r}`"


def _doc(obj: Any) -> str:
    """An object's docstring as one paragraph of Markdown."""
    text = (inspect.getdoc(obj) or "").split("\n>>>")[0]
    text = re.sub(r":(?:class|func|meth|mod|attr|data):`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split())


def _dataclass_rows(cls: type, known: list[str] | None = None) -> list[str]:
    """One table row per key: type and default from the dataclass; ``known`` (the loader's
    list) adds the keys it reads that are not fields."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    keys = known if known is not None else list(fields)
    rows = ["| key | type | default |", "|---|---|---|"]
    for key in keys:
        f = fields.get(key)
        if f is None:
            rows.append(f"| `{key}` | read by the loader (see the text above) | absent |")
            continue
        if f.default is not dataclasses.MISSING:
            default = _value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _value(f.default_factory())
        else:
            default = "required"
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{key}` | `{kind}` | {default} |")
    return rows


def _known_keys(section: str) -> list[str]:
    """The keys the gateway loader accepts in ``section`` ("" for the top level), from the
    error it raises for an unknown one."""
    from llmsched.errors import ConfigError
    from llmsched.gateway.config import load_config

    base: dict[str, Any] = {"engines": [{"host": "127.0.0.1", "port": 8001}], "models": ["m"]}
    if section == "":
        base["zzUnknown"] = 1
    elif section == "auth.api_keys.<key>":
        base["auth"] = {"api_keys": {"sk-docs-0000000001": {"tenant": "t", "zzUnknown": 1}}}
    elif section == "discovery.kubernetes":
        base["discovery"] = {"kubernetes": {"zzUnknown": 1}}
    else:
        base[section] = {"zzUnknown": 1}
    try:
        load_config(base)
    except ConfigError as exc:
        found = re.search(r"\(known: ([^)]*)\)", str(exc))
        if found:
            return [k.strip() for k in found.group(1).split(",")]
        raise SystemExit(f"{section}: the loader's message names no known keys: {exc}") from None
    raise SystemExit(f"{section}: the loader accepted an unknown key")


def _gateway() -> list[str]:
    from llmsched.gateway import config as gw
    from llmsched.integrations import EngineSpec

    top = _known_keys("")
    lines = [
        "## Gateway config (`llmsched serve --config`)",
        "",
        _doc(gw.load_config),
        "",
        "### Top level",
        "",
        _doc(gw.GatewayConfig),
        "",
        *_dataclass_rows(gw.GatewayConfig, top),
        "",
        "`engines` entries and `discovery.file` entries:",
        "",
        _doc(EngineSpec),
        "",
        *_dataclass_rows(EngineSpec),
        "",
    ]
    defaults = gw.GatewayConfig(engines=(), models=())
    for key in top:
        section = getattr(defaults, key, None)
        if not dataclasses.is_dataclass(section):
            continue
        cls = type(section)
        lines += [f"### `{key}`", "", _doc(cls), "", *_dataclass_rows(cls, _known_keys(key)), ""]
        if key == "auth":
            lines += [
                "Each entry of `auth.api_keys` (and of the file or variable) maps a key to:",
                "",
                _doc(gw.ApiKey),
                "",
                *_dataclass_rows(gw.ApiKey, _known_keys("auth.api_keys.<key>")),
                "",
            ]
        if key == "discovery":
            lines += [
                "#### `discovery.kubernetes`",
                "",
                _doc(gw.KubernetesConfig),
                "",
                *_dataclass_rows(gw.KubernetesConfig, _known_keys("discovery.kubernetes")),
                "",
            ]
    lines += [
        "`router` is a preset name, a router config mapping or a path to one (below); `flow` "
        "is a flow-control config (below) or null for none.",
        "",
    ]
    return lines


def _flatten(prefix: str, value: Any, hint: Any, out: list[str]) -> None:
    origin = typing.get_origin(hint)
    if isinstance(value, dict) and hint is not None and typing.is_typeddict(hint):
        hints = typing.get_type_hints(hint)
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, sub, hints.get(key), out)
        return
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}", sub, None, out)
        return
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), "list" if origin is list or isinstance(value, list) else "mapping"
    )
    if value is None:
        kind = "null or a number" if hint is None else str(hint).replace("|", "\\|")
    out.append(f"| `{prefix}` | {kind} | {_value(value)} |")


def _flow() -> list[str]:
    from llmsched import flow, types

    config = flow.default_config()
    rows = ["| key | type | default |", "|---|---|---|"]
    _flatten("", dict(config), types.FlowConfig, rows)
    return [
        "## Flow control config (`FlowController(config)`, the gateway's `flow`)",
        "",
        _doc(flow.resolve_config),
        "",
        "The defaults, as `llmsched.flow.default_config()` resolves them. `bands` lists "
        "per-priority overrides of `default_band` (each with its `priority`); a policy "
        "(`saturation`, `ceilings`, `shedding`, `fairness`, `ordering`) is "
        "`{type: ..., <its parameters>}`, and an absent parameter takes the default shown; a "
        "band's `ceiling` is a number (null: the `ceilings` policy's).",
        "",
        *rows,
        "",
    ]


def _scenario() -> list[str]:
    from llmsched.sim import config as sim

    lines = [
        "## Simulator scenario (`llmsched sim --config`)",
        "",
        _doc(sim),
        "",
        *_dataclass_rows(sim.ScenarioConfig),
        "",
    ]
    nested = {f.name: f.default_factory for f in dataclasses.fields(sim.ScenarioConfig)}
    for key in ("step_model", "engine", "pd", "slices", "flow"):
        factory = nested[key]
        assert factory is not dataclasses.MISSING
        cls = type(factory())
        lines += [f"### `{key}`", "", _doc(cls), "", *_dataclass_rows(cls), ""]
    return lines


def _router() -> list[str]:
    from llmsched import Router

    presets = ", ".join(f"`{p}`" for p in Router.presets())
    return [
        "## Router config (`Router(pool, config=...)`, the gateway's `router`)",
        "",
        "An llm-d `EndpointPickerConfig` (YAML or JSON, or the same as a Python mapping), or "
        f"a preset name: {presets}. Sections:",
        "",
        "| key | what it holds |",
        "|---|---|",
        "| `apiVersion`, `kind` | when given, `llm-d.ai/v1alpha1` or "
        "`inference.networking.x-k8s.io/v1alpha1`, and `EndpointPickerConfig` |",
        "| `plugins[]` | `type` (one of the [plugin catalogue](plugins.md)), optional `name` "
        "(default: the type), `parameters` |",
        "| `schedulingProfiles[]` | `name`, `plugins[]` of `{pluginRef, weight}` (scorers are "
        "weighted; a profile without a picker gets `max-score-picker`; a scorer listed twice "
        "counts once with its weights summed, a filter listed twice runs twice, both noted; the "
        "weights must sum to a finite number, all 0 is noted) |",
        "| `saturationDetector` | `queueDepthThreshold`, `kvCacheUtilThreshold`, "
        "`metricsStalenessThreshold`: flow control's saturation thresholds (gateway); or "
        "`pluginRef` naming a `utilization-detector` plugin that holds them |",
        "| `featureGates` | `flowControl` turns flow control on in the gateway |",
        "| `parser` | `pluginRef` naming an `openai-parser` plugin: noted, no effect |",
        "",
        "[llm-d compatibility](llm-d-compatibility.md) gives each section's status.",
        "",
    ]


def render() -> str:
    """The page, from the loaders of the installed llmsched."""
    lines = [
        "# Configuration keys",
        "",
        "<!-- Generated by tools/gen_config_keys.py from the loaders; do not edit. -->",
        "",
        "The keys each configuration format accepts, with their types and defaults. Every "
        "loader refuses an unknown key with a `ConfigError` naming it and the keys it knows.",
        "",
    ]
    lines += _router() + _gateway() + _flow() + _scenario()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--out", type=Path, default=OUT, help="the page (default: %(default)s)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(
                f"{args.out} is out of date: run `.venv/bin/python tools/gen_config_keys.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
