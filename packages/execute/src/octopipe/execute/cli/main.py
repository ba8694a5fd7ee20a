"""The ``octopipe`` command line.

Exit codes (every error is one line on stderr, ``octopipe: error: ...``, saying what to change):

- 0: success;
- 1: an internal error (a bug: the traceback is printed above the line; please report it);
- 2: bad arguments or unreadable input, including a plan the static verifier rejects;
- 3: a run failed (a rank raised, died or timed out; the line names the rank, step and action);
- 4: the coordinator could not be reached;
- 5: a ``--wait`` ran out (the run goes on at the coordinator);
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import traceback
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

from octopipe.execute.cli import control, demo, plan, profile, run, simulate, trace, train, tune
from octopipe.execute.cli.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RUN_FAILED,
    EXIT_TIMED_OUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    UsageError,
)
from octopipe.execute.logconfig import configure_logging
from octopipe.ir import (
    PlanError,
)
from octopipe.tune import DEFAULT_SCHEDULES, ScheduleRegistry

__all__ = [
    "COMMANDS",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUN_FAILED",
    "EXIT_TIMED_OUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "HelpWithDefaults",
    "build_parser",
    "entry",
    "main",
]

#: every command module: ``register(sub, registry)`` adds its parser(s), each with ``handler=`` set.
#: A new command is one module here.
COMMANDS = (plan, profile, tune, simulate, run, train, trace, control, demo)


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that shows every option's default (unless its text already says it) and never breaks a word at a
    hyphen (``--checkpoint-every`` stays whole)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS, "", [], ()) and "default" not in text
        if shown and (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            value = " ".join(map(str, default)) if isinstance(default, list | tuple) else "%(default)s"
            return f"{text} (default: {value})".strip()
        return action.help

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n  " in text:  # a laid-out block (``octopipe train``'s keys): kept line for line
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _version() -> str:

    try:
        return version("octopipe-execute")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def build_parser(*, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> argparse.ArgumentParser:
    """The CLI's parser; ``plan show --example`` offers the generated schedules of ``registry``."""
    parser = _Parser(prog="octopipe", description="Pipeline-parallel training: plan, simulate, tune, run.")
    parser.set_defaults(registry=registry)
    parser.add_argument("--version", action="version", version=f"octopipe {_version()}")
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="log lines on stderr as JSON or for people (auto: for people on a terminal, JSON otherwise)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    for command in COMMANDS:
        command.register(sub, registry)
    return parser


def main(argv: Sequence[str] | None = None, *, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> int:
    """Run the CLI; return the exit code. ``registry``: the schedules ``plan show --example`` and ``tune`` use."""
    parser = build_parser(registry=registry)
    try:
        args = parser.parse_args(argv)
        configure_logging(fmt=args.log_format)
        handler = getattr(args, "handler", None)  # every command sets its handler when it registers
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
