"""``llmsched calibrate`` (the reference executor) refuses a device torch cannot run it on with
one line and exit status 2, before timing anything: ``--device nope`` and a GPU the machine
lacks were RuntimeError tracebacks."""

from __future__ import annotations

import pytest

from llmsched import cli

torch = pytest.importorskip("torch")


def _calibrate(tmp_path, device: str) -> int:
    argv = ["calibrate", "--device", device, "--out", str(tmp_path / "p.yaml")]
    return cli.main([*argv, "--batch-sizes", "1", "--context-lens", "8", "--repeats", "1"])


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("nope", "--device 'nope': Expected one of cpu, cuda"),
        ("mps", "--device 'mps': calibrate runs on cpu or cuda"),
        ("cuda:4096", "--device 'cuda:4096': "),
    ],
)
def test_a_device_torch_cannot_run_is_one_line(tmp_path, capsys, device: str, message) -> None:
    assert _calibrate(tmp_path, device) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmsched calibrate: {message}") and err.count("\n") == 1
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys) -> None:
    assert _calibrate(tmp_path, "cuda") == 2
    assert "no CUDA device on this machine" in capsys.readouterr().err
