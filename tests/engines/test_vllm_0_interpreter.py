"""The shared vLLM interpreter the reference checks run in: a failing check is reported with
its traceback and leaves the process serving the next one."""

from __future__ import annotations

import pytest

from .vllm_interpreter import VllmCheckError, VllmInterpreter

FAILS = """
def main(payload):
    raise ValueError(f"refused {payload}")
"""
ECHOES = """
import sys

def main(payload):
    print("noise a library prints on stdout")
    return {"payload": payload, "python": list(sys.version_info[:2])}
"""


def test_a_failing_check_raises_with_its_traceback_and_the_next_one_runs(
    vllm_interpreter: VllmInterpreter,
) -> None:
    with pytest.raises(VllmCheckError, match=r"(?s)fails.*ValueError: refused 7"):
        vllm_interpreter.run("fails", FAILS, 7)
    answer = vllm_interpreter.run("echoes", ECHOES, [1, "two"])
    assert answer["payload"] == [1, "two"] and len(answer["python"]) == 2
