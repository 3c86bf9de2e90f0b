"""Fixtures for tests against real vLLM CPU engines (run by ``make test-engines``).

Every test in this folder is marked ``engines`` and deselected from the plain ``pytest`` run; the
engines take about a minute to start on two cores and need the separate vLLM environment.

The engines start once per run (the session fixture ``engines``), and readiness follows their
progress rather than a fixed deadline (see ``vllm_engine.wait_all_healthy``). If they cannot
start, the first test that needs them errors once with the engine's log tail and every later
one is skipped with a pointer to that error, so one cause shows as one error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .vllm_engine import (
    STARTUP_CAP_S,
    TINY_MODEL_SCRIPT,
    VllmEngine,
    machine_factor,
    start_engines,
)
from .vllm_interpreter import VllmInterpreter

_HERE = Path(__file__).parent
# The first setup failure of the shared engines (or their model), and the startup time.
_failed: list[str] = []
_startup: list[float] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engines)
            # pytest-timeout's limit covers fixture setup: leave room for a slow startup.
            item.add_marker(pytest.mark.timeout(STARTUP_CAP_S + 1200))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    uses_engines = {"engines", "tiny_model"} & set(getattr(item, "fixturenames", ()))
    if _failed and uses_engines:
        pytest.skip(f"the vLLM engines did not start ({_failed[0]}); see the first error")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _startup:
        terminalreporter.write_line(
            f"vLLM engines healthy after {_startup[0]:.0f} s "
            f"(machine factor {machine_factor():.2f}: the tests' waits are stretched by it)"
        )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, vllm_interpreter: VllmInterpreter) -> Path:
    """The tiny random model and tokenizer, made once per session (in the shared vLLM
    interpreter, which has torch and transformers loaded once for every job)."""
    out = tmp_path_factory.mktemp("tiny-model")
    try:
        vllm_interpreter.run_script(TINY_MODEL_SCRIPT, [str(out), "--seed", "0"])
        return out
    except BaseException as err:
        _failed.append(f"making the tiny model: {type(err).__name__}")
        raise


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """Two real engines serving the same model, each with its own KV-event feed, started
    once for the whole run."""
    logs = tmp_path_factory.mktemp("engine-logs")
    cores = os.cpu_count() or 1
    pair = [VllmEngine(tiny_model, f"e{i}", logs / f"e{i}.log", cpu=i % cores) for i in range(2)]
    started = time.monotonic()
    try:
        _startup.append(start_engines(pair))
    except BaseException as err:
        _failed.append(f"{type(err).__name__} after {time.monotonic() - started:.0f} s")
        raise
    yield pair
    for engine in pair:
        engine.stop()


@pytest.fixture(scope="session")
def vllm_interpreter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmInterpreter]:
    """The vLLM environment's interpreter, shared by the checks against vLLM's own code (vLLM
    imported once rather than once per check)."""
    interpreter = VllmInterpreter(tmp_path_factory.mktemp("vllm-interpreter") / "stderr.log")
    yield interpreter
    interpreter.close()
