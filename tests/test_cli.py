"""The ``llmsched`` command line: version, one-line errors with status 2 before any work,
the sim table's legend and the plots' titles and colours."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import llmsched
from llmsched.cli import check_output_path, main
from llmsched.errors import ConfigError
from llmsched.sim.runner import TABLE_LEGEND, policy_colours

TINY = {
    "replicas": 2,
    "policies": ["random", "round-robin"],
    "workload": {"kind": "long_short", "num_requests": 40, "arrival": {"rate": 20.0}},
}


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before any work (nothing printed, nothing run)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmsched {llmsched.__version__}"


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["sim", "--jobs", "two"], "argument --jobs: invalid int value: 'two'"),
        (["sim", "--engine", "gpu"], "argument --engine: invalid choice: 'gpu'"),
        (["nope"], "invalid choice: 'nope'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_argument_errors_are_one_line_and_exit_2(
    argv: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    line = one_line_error(capsys)
    assert expect in line and line.endswith("--help)")


def test_unknown_policy_is_refused_before_any_work(
    scenario: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--config", str(scenario), "--policies", "random,nope", "--quiet"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert line.startswith("llmsched sim: unknown policy 'nope'")
    assert main(["sim", "--config", str(scenario), "--policies", ",", "--quiet"]) == 2
    assert "names no policy" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("option", "name", "expect"),
    [
        ("--json", "missing/out.json", "does not exist"),
        ("--plot", "missing/out.png", "does not exist"),
        ("--plot", "out.txt", "file type must be one of .png"),
        ("--json", ".", "is a directory"),
    ],
)
def test_output_paths_are_checked_before_the_run(
    scenario: Path,
    tmp_path: Path,
    option: str,
    name: str,
    expect: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = str(tmp_path / name) if name != "." else str(tmp_path)
    assert main(["sim", "--config", str(scenario), option, target, "--quiet"]) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"llmsched sim: {option} ") and expect in line


def test_check_output_path_accepts_a_writable_file(tmp_path: Path) -> None:
    assert check_output_path("--out", str(tmp_path / "p.yaml"), (".yaml",)).name == "p.yaml"
    with pytest.raises(ConfigError, match="--out"):
        check_output_path("--out", str(tmp_path / "p.json"), (".yaml",))


def test_demo_and_config_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--replicas", "0"]) == 2
    assert one_line_error(capsys) == "llmsched demo: --replicas must be at least 1"
    assert main(["demo", "--turns", "0"]) == 2
    assert one_line_error(capsys) == "llmsched demo: --turns must be at least 1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: [1\n")
    assert main(["sim", "--config", str(bad), "--quiet"]) == 2
    assert one_line_error(capsys).startswith("llmsched sim: ")


def test_a_real_process_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmsched", "sim", "--scenario", "nope", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "unknown base scenario" in done.stderr
    version = subprocess.run(
        [sys.executable, "-m", "llmsched", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert version.stdout.strip() == f"llmsched {llmsched.__version__}"


def test_sim_table_explains_columns_and_plot_has_title_and_colours(
    scenario: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    out = tmp_path / "r.png"
    argv = ["sim", "--config", str(scenario), "--plot", str(out), "--seed", "5", "--jobs", "1"]
    assert main([*argv, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert TABLE_LEGEND in printed
    for column in ("out tok/s", "TTFT p50/p90/p99", "hit", "SLO", "Jain"):
        assert column in TABLE_LEGEND
    (fig,) = figures
    title = fig._suptitle.get_text()
    assert title.startswith("custom: seed 5, ") and title.endswith(" engine")
    colours = policy_colours(["random", "round-robin"])
    assert len(set(colours.values())) == 2
    cdf, throughput, hits, kv = fig.axes
    for ax in (cdf, kv):
        assert {ln.get_label(): ln.get_color() for ln in ax.get_lines()} == colours
    for ax in (throughput, hits):
        faces = [tuple(round(c, 3) for c in p.get_facecolor()[:3]) for p in ax.patches]
        assert len(faces) == 2 and faces[0] != faces[1]


def test_policy_colours_are_distinct_beyond_ten() -> None:
    names = [f"p{i}" for i in range(14)]
    colours = policy_colours(names)
    assert list(colours) == names and len(set(colours.values())) == 14


def test_serve_reports_any_llmsched_error_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe 51 F7: only ConfigError was turned into a one-line exit; another llmsched error
    raised while the gateway is built (a value it refuses) was a traceback."""
    from llmsched.errors import InvalidValueError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise InvalidValueError("address must be valid UTF-8 (no lone surrogates)")

    monkeypatch.setattr("llmsched.gateway.make_gateway", refuse)
    config = tmp_path / "gw.yaml"
    config.write_text("engines: [{host: 127.0.0.1, port: 9}]\nmodels: [tiny]\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert one_line_error(capsys) == (
        "llmsched serve: address must be valid UTF-8 (no lone surrogates)"
    )


@pytest.mark.parametrize("command", [[], ["demo"], ["calibrate"], ["sim"], ["serve"]])
def test_help_reads_as_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`llmsched --help` opened with "The ``llmsched`` command line.": the module docstring's
    first line, reST markup and all, saying nothing of what the commands do."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and ":func:" not in out
    if not command:
        assert "Where and when an LLM request runs" in out
        assert all(name in out for name in ("demo", "calibrate", "sim", "serve"))
