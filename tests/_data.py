"""The test vectors kept in ``tests/data`` (see ``tests/data/README.md`` for where each came
from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def vector_path(name: str) -> Path:
    """The path of ``tests/data/<name>`` (FileNotFoundError naming it when absent)."""
    path = DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"test vector {name} is not in {DATA}")
    return path


def load_vector(name: str) -> Any:
    """A JSON file of ``tests/data``, decoded."""
    return json.loads(vector_path(name).read_text())
