"""Where the tests find ``shared/``: beside the checkout, or beside any folder above it (a
worktree sits one level deeper); ``LLMSCHED_SHARED_DIR`` names another place."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def shared_vector_path(name: str) -> Path:
    """The path of ``shared/vectors/<name>`` (FileNotFoundError naming where it looked)."""
    roots = [Path(os.environ["LLMSCHED_SHARED_DIR"])] if "LLMSCHED_SHARED_DIR" in os.environ else []
    roots += [folder / "shared" for folder in _HERE.parents]
    for root in roots:
        candidate = root / "vectors" / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"shared/vectors/{name} not found above {_HERE}")


def shared_vector(name: str) -> Any:
    """A JSON file of ``shared/vectors``, decoded."""
    return json.loads(shared_vector_path(name).read_text())
