"""``octopipe plan``: show a plan (a rank x step grid, text, torch CSV or JSON) or convert it between formats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import structlog
from google.protobuf import json_format

from octopipe.execute.cli.errors import EXIT_OK, UsageError
from octopipe.execute.cli.jsonout import print_json
from octopipe.ir import format_grid, load_plan, plan_format_for, plan_to_text, plan_to_torch_csv, save_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import ScheduleRegistry

__all__ = ["register"]

_FORMATS = ("binary", "json", "text", "csv")


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe plan show`` and ``octopipe plan convert``; ``--example`` offers ``registry``'s schedules."""
    plan = sub.add_parser("plan", help="show or convert plans (binary/JSON proto, text, torch CSV)")
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="PLAN_COMMAND", parser_class=type(plan))
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
    show.add_argument(
        "--as", dest="fmt", choices=("grid", "text", "csv", "json"), default="grid", help="the format to print"
    )
    show.add_argument("--compute-only", action="store_true", help="grid/csv: leave out communication")
    show.add_argument("--json", action="store_true", help="the same as --as json")
    show.set_defaults(handler=_plan_show)

    convert = plan_sub.add_parser("convert", help="convert a plan file between formats")
    convert.add_argument("source", type=Path, help="the plan file to read (.binpb/.pb, .json, .txt/.plan, .csv)")
    convert.add_argument("destination", type=Path, help="the plan file to write; its suffix names the format")
    convert.add_argument("--from", dest="from_format", choices=_FORMATS, help="default: from the suffix")
    convert.add_argument("--to", dest="to_format", choices=_FORMATS, help="default: from the suffix")
    convert.add_argument("--json", action="store_true", help="print what was written as JSON")
    convert.add_argument(
        "--microbatches",
        type=int,
        help="a torch CSV's micro-batch count (default: inferred; every stage must run 0..m-1)",
    )
    convert.set_defaults(handler=_plan_convert)


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
