"""Fixtures for tests against real vLLM CPU engines (run by ``make test-engines``).

Every test in this folder is marked ``engines`` and deselected from the plain ``pytest`` run; the
engines take about a minute to start on two cores and need the separate vLLM environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .vllm_engine import VllmEngine, make_tiny_model, start_engines


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model and tokenizer, made once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """Two real engines serving the same model, each with its own KV-event feed."""
    logs = tmp_path_factory.mktemp("engine-logs")
    cores = os.cpu_count() or 1
    pair = [VllmEngine(tiny_model, f"e{i}", logs / f"e{i}.log", cpu=i % cores) for i in range(2)]
    start_engines(pair)
    yield pair
    for engine in pair:
        engine.stop()
