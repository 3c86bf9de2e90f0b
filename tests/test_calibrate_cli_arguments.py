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
        ("nope", "device 'nope': Expected one of cpu, cuda"),
        ("mps", "device 'mps': calibrate runs on cpu or cuda"),
        ("cuda:4096", "device 'cuda:4096': "),
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


@pytest.mark.parametrize("block_size", [0, -4, 1.5, True])
def test_calibrate_refuses_a_block_size_that_is_not_a_count(block_size: object) -> None:
    """0 was a ZeroDivisionError, -4 and 1.5 torch errors from the KV allocation."""
    from llmsched.errors import ConfigError
    from llmsched.executor.calibrate import CalibrationGrid, calibrate
    from llmsched.executor.config import ModelConfig

    grid = CalibrationGrid(batch_sizes=(1,), context_lens=(8,), repeats=1)
    with pytest.raises(ConfigError, match="block_size must be a positive int"):
        calibrate(ModelConfig.preset("small"), grid, block_size=block_size)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device 'nope'"):
        calibrate(ModelConfig.preset("small"), grid, device="nope")
