"""The ``llmsched`` command line.

Each subcommand is registered by one ``add_<name>_command`` function that declares its
arguments and sets ``handler``; handlers import what they need lazily, so ``llmsched --help``
stays fast and works without the optional extras.

Errors in arguments, configuration files, output paths or a missing extra print one line
(``llmsched <command>: <what is wrong>``) and exit with status 2, before any long work starts.

>>> build_parser().parse_args(["demo", "--replicas", "4"]).replicas
4
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from llmsched.errors import ConfigError, LlmschedError, one_line

if TYPE_CHECKING:
    from llmsched.executor.step_time import StepTimeProfile
    from llmsched.sim.config import ScenarioConfig

__all__ = [
    "add_calibrate_command",
    "add_demo_command",
    "add_serve_command",
    "add_sim_command",
    "build_parser",
    "main",
]

Subparsers = Any  # argparse's private _SubParsersAction


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def check_output_path(option: str, path: str, suffixes: Sequence[str] = ()) -> Path:
    """Refuse an output path that cannot be written, before the work that produces it.

    Raises :class:`~llmsched.errors.ConfigError` naming ``option`` when the path is a
    directory, its directory does not exist or is not writable, or its suffix is not one of
    ``suffixes`` (when given).

    >>> check_output_path("--json", "/no/such/dir/out.json")
    Traceback (most recent call last):
    ...
    llmsched.errors.ConfigError: --json /no/such/dir/out.json: directory /no/such/dir does not exist
    """
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{option} {path}: is a directory")
    parent = out.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"{option} {path}: not writable")
    if suffixes and out.suffix.lower() not in suffixes:
        raise ConfigError(f"{option} {path}: the file type must be one of {', '.join(suffixes)}")
    return out


def add_demo_command(subparsers: Subparsers) -> None:
    """``llmsched demo``: ``llmsched sim`` on its default scenario, with the demo's knobs."""
    parser = subparsers.add_parser(
        "demo",
        help="simulate the default scenario under every routing policy (what make demo runs)",
        description=(
            "llmsched sim on its default scenario (agentic multi-turn sessions on 8 simulated "
            "replicas, every named policy); the options override the scenario's values."
        ),
    )
    parser.add_argument("--replicas", type=int, default=None, help="number of replicas")
    parser.add_argument("--sessions", type=int, default=None, help="sessions in all")
    parser.add_argument("--turns", type=int, default=None, help="turns per session")
    parser.add_argument("--seed", type=int, default=None, help="workload and router seed")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from llmsched.demo import demo_config

    config = demo_config(args.replicas, args.sessions, args.turns, args.seed)
    return _simulate(config, quiet=args.quiet)


def add_calibrate_command(subparsers: Subparsers) -> None:
    """``llmsched calibrate``: fit the simulator's step-time model on this machine."""
    parser = subparsers.add_parser(
        "calibrate",
        help="fit the simulator's step-time model on a running engine or the reference "
        "executor and write the profile (YAML)",
        description=(
            "With --engine URL: time prefill requests over prompt lengths (alone and several "
            "at once), and decode steps over batch sizes and contexts on a running "
            "OpenAI-compatible engine (vLLM), read its /metrics, and fit the simulator's "
            "linear step model. Without it: time prefill, decode and mixed steps of the "
            "reference executor (torch). Then fit, by least squares with no coefficient below "
            "zero, b0 + b1*prefill_tokens + b2*decode_tokens plus attention terms and a cost "
            "per prefilled sequence, write the profile that `llmsched sim --step-model` reads "
            "and print the fit error."
        ),
    )
    parser.add_argument("--out", default="step_time_profile.yaml", help="profile path to write")
    parser.add_argument(
        "--engine",
        default=None,
        metavar="URL[,URL...]",
        help="a running engine, e.g. http://host:8000; several identical ones are timed at once",
    )
    parser.add_argument("--model", default=None, help="with --engine: served model name")
    parser.add_argument(
        "--prompt-lens", type=_int_list, default=None, help="with --engine: prefill prompt lengths"
    )
    parser.add_argument(
        "--prefill-batches",
        type=_int_list,
        default=None,
        help="with --engine: prompts prefilled together per prompt length (default 2,4)",
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=None, help="with --engine: output tokens per decode"
    )
    parser.add_argument("--seed", type=int, default=0, help="with --engine: prompt seed")
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

    from llmsched._extras import require

    check_output_path("--out", args.out, (".yaml", ".yml"))
    for name in ("repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.engine is not None:
        return _calibrate_engine(args)
    require("executor", "torch", feature="llmsched calibrate")
    import torch

    from llmsched.executor.calibrate import CalibrationGrid, calibrate, torch_device
    from llmsched.executor.config import ModelConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = torch_device(device).type == "cpu"  # ConfigError for one torch cannot run on
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
    _print_fit(profile)
    return 0


def _calibrate_engine(args: argparse.Namespace) -> int:
    import dataclasses

    from llmsched.calibrate import EngineGrid, calibrate_engine

    grid = EngineGrid()
    overrides = {
        "prompt_lens": args.prompt_lens,
        "batch_sizes": args.batch_sizes,
        "context_lens": args.context_lens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "prefill_batches": args.prefill_batches,
    }
    grid = dataclasses.replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    urls = [u.strip() for u in args.engine.split(",") if u.strip()]
    if not urls:
        raise ConfigError("--engine names no engine")
    profile = calibrate_engine(urls, grid, model=args.model, seed=args.seed, report=print)
    profile.save(args.out)
    kv = f", {profile.kv_tokens} KV tokens" if profile.kv_tokens is not None else ""
    where = ", ".join(urls)
    print(f"wrote {args.out}: {len(profile.samples)} grid points timed on {where}{kv}")
    if profile.kv_tokens is None:
        print(
            "  no KV capacity: the engine exports no readable vllm:cache_config_info; "
            "give the simulator engine.kv_tokens"
        )
    _print_fit(profile)
    return 0


def _print_fit(profile: StepTimeProfile) -> None:
    for term, value in profile.coefficients.items():
        print(f"  {term:<22} {value:.4g}")
    err, lin = profile.error, profile.linear_error
    print(
        f"fit error (relative): median {err.median:.1%}, mean {err.mean:.1%}, max {err.max:.1%}"
        f"; linear-only model: median {lin.median:.1%}, mean {lin.mean:.1%}, max {lin.max:.1%}"
    )


def add_sim_command(subparsers: Subparsers) -> None:
    """``llmsched sim``: simulate a scenario under several routing policies and compare."""
    parser = subparsers.add_parser(
        "sim",
        help="simulate replicas under several routing policies and compare them",
        description=(
            "Discrete-event simulation of vLLM-like replicas driven by llmsched's routing. "
            "Default: agentic multi-turn sessions on 8 replicas under every named policy."
        ),
    )
    parser.add_argument("--scenario", default=None, help="named scenario (default: agentic)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml", help="scenario file")
    parser.add_argument(
        "--policies", default=None, help="comma-separated policy names (default: the scenario's)"
    )
    parser.add_argument("--seed", type=int, default=None, help="workload and router seed")
    parser.add_argument("--jobs", type=int, default=None, help="parallel processes")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every figure as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write the plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--engine",
        choices=["auto", "rust", "python"],
        default="auto",
        help="simulation engine (auto: Rust where it covers the scenario)",
    )
    parser.add_argument(
        "--step-model",
        default=None,
        metavar="FILE.yaml",
        help="linear step-model file (what `llmsched calibrate` writes) for every replica",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the named scenarios and policies, then exit"
    )
    parser.set_defaults(handler=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from llmsched._extras import require
    from llmsched.sim.config import SCENARIOS, load_scenario
    from llmsched.sim.policies import policy_names, resolve_policy
    from llmsched.sim.runner import PLOT_SUFFIXES

    if args.list:
        for name, spec in SCENARIOS.items():
            print(f"{name:<16}{spec.get('description', '')}")
        print("policies: " + ", ".join(policy_names()))
        return 0
    # Everything that can be refused is refused here, before the simulation starts.
    config = load_scenario(args.scenario, args.config)
    if args.seed is not None:
        config.seed = args.seed
    if args.step_model is not None:
        from llmsched.sim.stepmodel import StepModelConfig, load_step_model

        load_step_model(args.step_model)  # refused here, before the simulation starts
        config.step_model = StepModelConfig(profile=args.step_model)
    if args.policies is not None:
        config.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if not config.policies:
            raise ConfigError("--policies names no policy")
        # For every variant: one that names its own policies (the pd scenario's P/D splits)
        # ran those instead, and the option was ignored for it without a word.
        config.variants = [
            {key: value for key, value in variant.items() if key != "policies"}
            if isinstance(variant, dict)
            else variant
            for variant in config.variants
        ]
    config.validate()  # the options above, checked as the file's values are
    for _, variant in config.expand():
        for policy in variant.policies:
            resolve_policy(policy)
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    if args.json:
        check_output_path("--json", args.json)
    if args.plot:
        check_output_path("--plot", args.plot, PLOT_SUFFIXES)
        require("sim", "matplotlib", feature="llmsched sim --plot")
    return _simulate(
        config,
        quiet=args.quiet,
        jobs=args.jobs,
        engine=args.engine,
        json_out=args.json,
        plot_out=args.plot,
    )


def _simulate(
    config: ScenarioConfig,
    *,
    quiet: bool,
    jobs: int | None = None,
    engine: str = "auto",
    json_out: str | None = None,
    plot_out: str | None = None,
) -> int:
    """Run a checked scenario under its policies and print the table (``sim`` and ``demo``)."""
    import importlib.util

    from llmsched.sim.runner import (
        TABLE_LEGEND,
        format_table,
        timed_compare,
        write_json,
        write_plot,
    )

    progress = not quiet
    if progress and importlib.util.find_spec("tqdm") is None:
        progress = False
        print("llmsched sim: no progress bar without tqdm (pip install 'llmsched[sim]')")
    print(f"llmsched sim: {config.name}: {config.description}".rstrip(": "))
    step = config.step_model
    if step.profile is not None or step.linear is not None:
        # The description names the scenario's roofline model; say whose steps these are.
        from llmsched.sim.stepmodel import load_step_model

        fitted = load_step_model(
            step.profile if step.profile is not None else {"coefficients": step.linear}
        )
        kv = config.engine.kv_tokens or fitted.kv_capacity_tokens()
        print(
            f"llmsched sim: step model: linear, fitted to {fitted.model!r} "
            f"({step.profile or 'inline coefficients'}), {kv} KV tokens per replica"
        )
    results, wall = timed_compare(config, jobs=jobs, progress=progress, engine=engine)
    print(format_table(results, wall))
    print(TABLE_LEGEND)
    if json_out:
        write_json(json_out, config, results, wall)
        print(f"wrote {json_out}")
    if plot_out:
        engines = " and ".join(sorted({r.engine_name for r in results}))
        title = f"{config.name}: seed {config.seed}, {engines} engine"
        write_plot(plot_out, results, title=title)
        print(f"wrote {plot_out}")
    return 0


def add_serve_command(subparsers: Subparsers) -> None:
    """``llmsched serve``: run the reference gateway in front of configured engines."""
    parser = subparsers.add_parser(
        "serve",
        help="run the reference OpenAI-compatible gateway in front of vLLM / SGLang engines",
        description=(
            "Serve /v1/completions and /v1/chat/completions: authenticate, admit through flow "
            "control, route with the prefix-aware router and proxy to the chosen engine."
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE.yaml", help="gateway config")
    parser.add_argument("--host", default=None, help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, default=None, help="port (overrides listen.port)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.add_argument(
        "--data-plane",
        default=None,
        choices=["python", "native"],
        help="who serves requests (overrides data_plane): native (the default: the Rust data "
        "plane in this process) or python (the aiohttp gateway)",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="event loop (auto: uvloop when installed, else asyncio's)",
    )
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import logging
    import signal

    from llmsched.gateway import load_config, make_gateway

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    config = load_config(args.config)
    listen = config.listen
    if args.host is not None:
        listen = dataclasses.replace(listen, host=args.host)
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {args.port}")
        listen = dataclasses.replace(listen, port=args.port)
    gateway = make_gateway(dataclasses.replace(config, listen=listen), data_plane=args.data_plane)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await gateway.start()
        engines = ", ".join(spec.worker_id for spec in gateway.config.engines)
        pods = gateway.config.discovery.kubernetes
        if pods is not None:  # no engine until the first list of pods
            selector = pods.selector
            if not isinstance(selector, str):
                selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
            engines = f"the pods {selector} of namespace {pods.namespace}"
        plane = gateway.config.data_plane
        print(
            f"llmsched serve: listening on {gateway.url} in front of {engines} "
            f"({plane} data plane)",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            await gateway.stop()

    if args.loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if args.loop == "uvloop":
                print("llmsched serve: --loop uvloop needs the uvloop package", file=sys.stderr)
                return 2
        else:
            # uvloop cuts the event loop's own cost per proxied request (measured ~15%).
            uvloop.run(serve())
            return 0
    asyncio.run(serve())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``llmsched`` parser with every subcommand registered."""
    from llmsched import __version__

    parser = _Parser(
        prog="llmsched",
        description=(
            "Where and when an LLM request runs: simulate routing policies on simulated "
            "replicas, fit the simulator to an engine, or serve an OpenAI-compatible gateway "
            "in front of vLLM / SGLang engines."
        ),
        epilog="`llmsched COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"llmsched {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    add_demo_command(subparsers)
    add_calibrate_command(subparsers)
    add_sim_command(subparsers)
    add_serve_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad arguments, configuration, output
    path or a missing extra, reported on one line of stderr)."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except (LlmschedError, ImportError, OSError) as exc:
        # ConfigError carries its own context, as does any other llmsched error a bad value
        # raises (a config's value the gateway refuses at start); an OSError names the file
        # (e.g. a config that cannot be read); an ImportError names the extra to install.
        print(f"llmsched {args.command}: {one_line(exc)}", file=sys.stderr)
        return 2
    return status
