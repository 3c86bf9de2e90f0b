"""``llmsched calibrate``: time the executor's steps and fit the simulator's step-time model.

For every batch size ``b`` and context length ``n`` of the grid it times three steps of the
model: a prefill of ``b`` prompts of ``n`` tokens, a decode of ``b`` sequences holding ``n``
tokens each, and a mixed step (those decodes plus one ``n``-token prefill chunk), each the
fastest of ``repeats`` runs after a warm-up (the minimum is the least disturbed by other
work on the machine, as ``timeit`` advises). Steps with more than ``max_prefill_tokens`` prefill
tokens are skipped. The samples are fitted by :meth:`StepTimeProfile.fit`. On CPU the small
model runs; on a GPU the same code runs the ``large`` preset over a larger grid.

>>> grid = CalibrationGrid(batch_sizes=(1, 2), context_lens=(8, 16, 32), repeats=1)
>>> profile = calibrate(ModelConfig.preset("small"), grid)
>>> len(profile.samples), profile.error.median < 1.0
(18, True)
"""

from __future__ import annotations

import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmsched._extras import require

require("executor", "torch", feature="llmsched.executor")

import torch

from llmsched.errors import ConfigError
from llmsched.executor.config import DEFAULT_BLOCK_SIZE, ModelConfig
from llmsched.executor.model import (
    ForwardBatch,
    MoETransformer,
    PagedKV,
    SequenceChunk,
    checked_device,
)
from llmsched.executor.step_time import StepSample, StepTimeProfile

__all__ = ["CalibrationGrid", "calibrate", "torch_device"]


@dataclass(frozen=True)
class CalibrationGrid:
    """Batch sizes, context lengths and repeats to time.

    >>> CalibrationGrid.for_device("cpu").batch_sizes
    (1, 2, 4, 8)
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_lens: tuple[int, ...] = (16, 64, 128, 256)
    repeats: int = 5
    max_prefill_tokens: int = 4096

    def __post_init__(self) -> None:
        fields = {
            "batch_sizes": tuple(self.batch_sizes),
            "context_lens": tuple(self.context_lens),
            "repeats": (self.repeats,),
            "max_prefill_tokens": (self.max_prefill_tokens,),
        }
        for name, values in fields.items():
            # 1.5 failed in range() mid-timing, "16" was a bare TypeError.
            if not values or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values
            ):
                raise ConfigError(f"{name} must be positive ints, got {getattr(self, name)!r}")

    @classmethod
    def for_device(cls, device: str) -> CalibrationGrid:
        """The default grid: small on CPU, larger on a GPU."""
        if torch.device(device).type == "cpu":
            return cls()
        return cls((1, 4, 16, 64), (128, 512, 2048, 4096), 5, 32768)


def torch_device(device: str) -> torch.device:
    """``device`` as a torch device calibrate can run on (cpu, or a CUDA device this machine
    has); ConfigError naming it otherwise (a misspelt device, or a GPU the machine lacks, was
    torch's RuntimeError).

    >>> torch_device("cpu").type
    'cpu'
    >>> torch_device("tpu")
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: device 'tpu': Expected one of cpu, cuda, ...
    """
    dev = checked_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: calibrate runs on cpu or cuda")
    return dev


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def fastest_seconds(run: Callable[[], object], repeats: int) -> float:
        run()  # warm-up
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)

    return fastest_seconds


def calibrate(
    config: ModelConfig,
    grid: CalibrationGrid | None = None,
    device: str = "cpu",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> StepTimeProfile:
    """Time the grid's steps on ``device`` and fit the step-time model."""
    dev = torch_device(device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        # 0 was a ZeroDivisionError, -4 and 1.5 torch errors from the KV allocation.
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    grid = grid or CalibrationGrid.for_device(device)
    # The decode step runs at position ``context``: past the rotary tables it failed with an
    # IndexError after every shorter context had been timed.
    too_long = [n for n in grid.context_lens if n >= config.max_position]
    if too_long:
        raise ConfigError(
            f"context length {too_long[0]} needs {too_long[0] + 1} positions; the model has "
            f"max_position = {config.max_position}"
        )
    model = MoETransformer(config, device=dev)
    time_it = _timer(dev)
    rng = random.Random(config.seed)
    samples: list[StepSample] = []
    for batch in grid.batch_sizes:
        for context in grid.context_lens:
            if batch * context > grid.max_prefill_tokens:
                continue
            per_seq = -(-(context + 1) // block_size)
            kv = PagedKV(config, (batch + 1) * per_seq, block_size, dev)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch + 1)]
            prompts = [
                [rng.randrange(config.vocab_size) for _ in range(context)] for _ in range(batch + 1)
            ]
            prefill = [SequenceChunk(prompts[i], 0, tables[i]) for i in range(batch)]
            decode = [SequenceChunk([prompts[i][0]], context, tables[i]) for i in range(batch)]
            mixed = [*decode, SequenceChunk(prompts[batch], 0, tables[batch])]

            def step(chunks: list[SequenceChunk], kv: PagedKV = kv) -> Callable[[], object]:
                return lambda: model.forward([ForwardBatch.build(chunks, block_size, dev)], kv)

            decode_ctx = batch * (context + 1)
            samples.append(
                StepSample(
                    batch * context,
                    0,
                    batch * context**2,
                    0,
                    time_it(step(prefill), grid.repeats),
                    prefill_requests=batch,
                )
            )
            samples.append(StepSample(0, batch, 0, decode_ctx, time_it(step(decode), grid.repeats)))
            samples.append(
                StepSample(
                    context, batch, context**2, decode_ctx, time_it(step(mixed), grid.repeats)
                )
            )
    meta = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.machine(),
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "block_size": block_size,
        "model": config.to_dict(),
        "grid": {
            "batch_sizes": list(grid.batch_sizes),
            "context_lens": list(grid.context_lens),
            "repeats": grid.repeats,
        },
    }
    return StepTimeProfile.fit(samples, meta)
