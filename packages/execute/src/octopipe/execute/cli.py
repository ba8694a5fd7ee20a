"""The ``octopipe`` command line.

Exit codes (every error is one line on stderr, ``octopipe: error: ...``, saying what to change):

- 0: success;
- 1: an internal error (a bug: the traceback is printed above the line; please report it);
- 2: bad arguments or unreadable input, including a plan the static verifier rejects;
- 3: a run failed (a rank raised, died or timed out; the line names the rank, step and action);
- 4: the coordinator could not be reached;
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import structlog

from octopipe.execute import control_cmd, demo, profile_cmd, run_cmd, simulate_cmd, trace_cmd, tune_cmd
from octopipe.execute.logconfig import configure_logging
from octopipe.ir import (
    PlanError,
    format_grid,
    load_plan,
    plan_to_text,
    plan_to_torch_csv,
    save_plan,
)
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import DEFAULT_SCHEDULES, ScheduleRegistry

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUN_FAILED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "main",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_RUN_FAILED = control_cmd.EXIT_RUN_FAILED
EXIT_UNREACHABLE = control_cmd.EXIT_UNREACHABLE
EXIT_INTERRUPTED = 130

_FORMATS = ("binary", "json", "text", "csv")


class UsageError(Exception):
    """Bad arguments or input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("octopipe-execute")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def build_parser(*, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> argparse.ArgumentParser:
    """The CLI's parser; ``plan show --example`` offers the generated schedules of ``registry``."""
    parser = _Parser(prog="octopipe", description="Pipeline-parallel training: plan, simulate, tune, run.")
    parser.set_defaults(registry=registry)
    parser.add_argument("--version", action="version", version=f"octopipe {_version()}")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    plan = sub.add_parser("plan", help="show or convert plans (binary/JSON proto, text, torch CSV)")
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="PLAN_COMMAND", parser_class=_Parser)
    show = plan_sub.add_parser("show", help="print a plan as a rank x step grid, text, CSV or JSON")
    source = show.add_mutually_exclusive_group(required=True)
    source.add_argument("path", nargs="?", type=Path, help="plan file (.pb/.binpb, .json, .txt/.plan, .csv)")
    source.add_argument(
        "--example",
        choices=[entry.name for entry in registry.tunable],
        help="a generated example plan (a schedule of the registry) instead of a file",
    )
    show.add_argument("--ranks", type=int, default=2, help="ranks of the example plan")
    show.add_argument("--microbatches", type=int, default=4, help="micro-batches of the example plan")
    show.add_argument("--as", dest="fmt", choices=("grid", "text", "csv", "json"), default="grid")
    show.add_argument("--compute-only", action="store_true", help="grid/csv: leave out communication")
    show.add_argument("--json", action="store_true", help="the same as --as json")

    convert = plan_sub.add_parser("convert", help="convert a plan file between formats")
    convert.add_argument("source", type=Path)
    convert.add_argument("destination", type=Path)
    convert.add_argument("--from", dest="from_format", choices=_FORMATS, help="default: from the suffix")
    convert.add_argument("--to", dest="to_format", choices=_FORMATS, help="default: from the suffix")
    convert.add_argument("--json", action="store_true", help="print what was written as JSON")
    convert.add_argument(
        "--microbatches",
        type=int,
        help="a torch CSV's micro-batch count (default: inferred; every stage must run 0..m-1)",
    )

    profile_cmd.add_parser(sub)
    tune_cmd.add_parser(sub)
    simulate_cmd.add_parser(sub)
    run_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    control_cmd.add_parser(sub)

    demo.add_parser(sub)
    return parser


def _example(registry: ScheduleRegistry, name: str, ranks: int, microbatches: int) -> plan_pb2.Plan:
    try:
        return registry.entry(name).generate(ranks, microbatches)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _plan_show(args: argparse.Namespace) -> int:
    plan = (
        _example(args.registry, args.example, args.ranks, args.microbatches) if args.example else load_plan(args.path)
    )
    if args.json:
        args.fmt = "json"
    if args.fmt == "grid":
        sys.stdout.write(format_grid(plan, compute_only=args.compute_only))
    elif args.fmt == "text":
        sys.stdout.write(plan_to_text(plan))
    elif args.fmt == "csv":
        sys.stdout.write(plan_to_torch_csv(plan, format="compute_only" if args.compute_only else "compute_comms"))
    else:
        from google.protobuf import json_format  # noqa: PLC0415

        print(json.dumps(json_format.MessageToDict(plan, preserving_proto_field_name=True), indent=2))
    return EXIT_OK


def _plan_convert(args: argparse.Namespace) -> int:
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    plan = load_plan(args.source, format=args.from_format, num_microbatches=args.microbatches)
    try:
        save_plan(plan, args.destination, format=args.to_format)
    except OSError as exc:
        raise UsageError(f"{args.destination}: cannot write: {exc.strerror}") from None
    structlog.get_logger("octopipe.cli").info(
        "plan_converted", source=str(args.source), destination=str(args.destination)
    )
    if args.json:
        from octopipe.execute.jsonout import print_json  # noqa: PLC0415
        from octopipe.ir import plan_format_for  # noqa: PLC0415

        print_json(
            {
                "source": str(args.source),
                "destination": str(args.destination),
                "format": args.to_format or plan_format_for(args.destination),
                "plan": plan.name,
                "ranks": len(plan.ranks),
                "stages": len(plan.stages),
            }
        )
    return EXIT_OK


def main(argv: Sequence[str] | None = None, *, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> int:
    """Run the CLI; return the exit code. ``registry``: the schedules ``plan show --example`` and ``tune`` use."""
    parser = build_parser(registry=registry)
    try:
        args = parser.parse_args(argv)
        configure_logging(fmt=args.log_format)
        if args.command == "plan" and args.plan_command == "show":
            return _plan_show(args)
        if args.command == "plan" and args.plan_command == "convert":
            return _plan_convert(args)
        if args.command == "profile":
            return profile_cmd.run(args)
        if args.command == "run":
            return run_cmd.run(args)
        if args.command == "tune":
            return tune_cmd.run(args)
        if args.command == "simulate":
            return simulate_cmd.run(args)
        if args.command == "trace":
            return trace_cmd.run(args)
        if args.command == "demo":
            return demo.run(args)
        handler = getattr(args, "handler", None)
        if handler is not None:
            return int(handler(args))
        parser.print_help()
        return EXIT_USAGE
    except (UsageError, PlanError, ValueError) as exc:
        _error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("octopipe: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if _is_run_failure(exc):
            _error(f"the run failed: {exc}")
            return EXIT_RUN_FAILED
        traceback.print_exc()
        print(
            f"octopipe: error: internal error {type(exc).__name__}: {exc} (a bug: please report it with the command "
            "and the traceback above)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _error(message: str) -> None:
    """The error on one line; lines after the first (a verifier's rank x step grid) follow indented."""
    first, *context = message.strip().splitlines() or [""]
    print(f"octopipe: error: {first}", file=sys.stderr)
    for line in context:
        print(f"  {line}", file=sys.stderr)


def _is_run_failure(exc: Exception) -> bool:
    """A rank failed (``runtime.RunFailed``, ``CommTimeout``); checked without loading the runtime (torch)."""
    launcher, comm = (
        sys.modules.get("octopipe.execute.runtime.launcher"),
        sys.modules.get("octopipe.execute.runtime.comm"),
    )
    failures = tuple(
        cls for cls in (getattr(launcher, "RunFailed", None), getattr(comm, "CommTimeout", None)) if cls is not None
    )
    return bool(failures) and isinstance(exc, failures)


def entry() -> NoReturn:
    sys.exit(main())
