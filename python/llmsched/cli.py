"""The ``llmsched`` command line.

Each subcommand is registered by one ``add_<name>_command`` function that declares its
arguments and sets ``handler``; handlers import what they need lazily, so ``llmsched --help``
stays fast and works without the optional extras.

>>> build_parser().parse_args(["demo", "--replicas", "4"]).replicas
4
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_calibrate_command", "add_demo_command", "build_parser", "main"]

Subparsers = Any  # argparse's private _SubParsersAction


def add_demo_command(subparsers: Subparsers) -> None:
    """``llmsched demo``: route a synthetic workload with the prefix index."""
    parser = subparsers.add_parser(
        "demo",
        help="route a synthetic multi-replica workload with the prefix index",
        description="Index a synthetic multi-turn workload and show where each prompt goes.",
    )
    parser.add_argument("--replicas", type=int, default=8, help="number of replicas")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=5, help="turns per session")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from llmsched.demo import run_demo

    for name in ("replicas", "sessions", "turns"):
        if getattr(args, name) < 1:
            raise SystemExit(f"llmsched demo: --{name} must be at least 1")
    run_demo(replicas=args.replicas, sessions=args.sessions, turns=args.turns, seed=args.seed)
    return 0


def add_calibrate_command(subparsers: Subparsers) -> None:
    """``llmsched calibrate``: fit the simulator's step-time model on this machine."""
    parser = subparsers.add_parser(
        "calibrate",
        help="time the reference executor's steps and write a step-time profile (YAML)",
        description=(
            "Time prefill, decode and mixed steps of the reference executor over a grid of "
            "batch sizes and context lengths, fit b0 + b1*prefill_tokens + b2*decode_tokens "
            "plus attention terms by least squares, and write the profile."
        ),
    )
    parser.add_argument("--out", default="step_time_profile.yaml", help="profile path to write")
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--preset", default=None, help="model preset (default: small on cpu, large on a GPU)"
    )
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help="e.g. 1,2,4,8")
    parser.add_argument("--context-lens", type=_int_list, default=None, help="e.g. 16,64,256")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per step")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch (default 1: steadiest)"
    )
    parser.set_defaults(handler=_run_calibrate)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _run_calibrate(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from llmsched.executor.calibrate import CalibrationGrid, calibrate
    from llmsched.executor.config import ModelConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        torch.set_num_threads(args.threads)
    config = ModelConfig.preset(args.preset or ("small" if on_cpu else "large"))
    grid = CalibrationGrid.for_device(device)
    overrides = {
        "batch_sizes": args.batch_sizes,
        "context_lens": args.context_lens,
        "repeats": args.repeats,
    }
    grid = dataclasses.replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    profile = calibrate(config, grid, device)
    profile.save(args.out)
    print(f"wrote {args.out}: {len(profile.samples)} steps timed on {device}")
    for term, value in profile.coefficients.items():
        print(f"  {term:<22} {value:.4g}")
    err, lin = profile.error, profile.linear_error
    print(
        f"fit error (relative): median {err.median:.1%}, mean {err.mean:.1%}, max {err.max:.1%}"
        f"; linear-only model: median {lin.median:.1%}, mean {lin.mean:.1%}, max {lin.max:.1%}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``llmsched`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="llmsched", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_command(subparsers)
    add_calibrate_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status
