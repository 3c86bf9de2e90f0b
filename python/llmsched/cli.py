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

__all__ = ["add_demo_command", "build_parser", "main"]

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


def build_parser() -> argparse.ArgumentParser:
    """The ``llmsched`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="llmsched", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status
