"""What every command that talks to a coordinator shares: its options, its connection, its errors.

A coordinator answers in the words of its protobuf API (``num_steps``); here they
become the flags an operator typed (``--steps``), without gRPC's status prefix.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octopipe.execute.cli.errors import EXIT_INTERRUPTED, EXIT_TIMED_OUT, EXIT_UNREACHABLE, EXIT_USAGE

__all__ = ["certs_option", "cli_words", "client_options", "err", "out", "run_id_arg", "with_client"]

#: the submission's proto fields as the CLI's flags
_FLAGS = {
    "num_steps": "--steps",
    "checkpoint_every": "--checkpoint-every",
    "adapt_after_steps": "--adapt-after",
    "run_id": "--run-id",
    "adapt_after": "--adapt-after",
}
_FIELD = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")


def cli_words(message: str) -> str:
    """A coordinator's message with its proto field names replaced by the CLI's flags."""
    return _FIELD.sub(lambda match: _FLAGS[match.group(1)], message)


def run_id_arg(text: str) -> str:
    """An argparse type: a run id (the error says which characters are allowed)."""
    from octopipe.execute.control.submission import run_id_problem  # noqa: PLC0415 (keeps --help fast)

    problem = run_id_problem(text) if text else ""  # "" (the default): the coordinator picks one
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text + "\n")


def certs_option(parser: argparse.ArgumentParser, identity: str, shown: str = "", *, required: bool = True) -> None:
    parser.add_argument("--certs", type=Path, required=required, help="the folder `octopipe certs make` wrote")
    parser.add_argument(
        "--identity", default=identity, help=f"which certificate in --certs to use (default {shown or identity})"
    )


def client_options(parser: argparse.ArgumentParser, *, json_output: bool = True, required: bool = True) -> None:
    """``--coordinator``, ``--certs``, ``--identity`` (default admin) and, with ``json_output``, ``--json``."""
    parser.add_argument("--coordinator", required=required, help="the coordinator's host:port")
    certs_option(parser, "admin", required=required)
    if json_output:
        parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def with_client(args: argparse.Namespace, action: Callable[[Any], int]) -> int:
    """Call ``action(client)`` with a client of ``args.coordinator``; what an operator can get wrong is one line
    on stderr and an exit code (4: unreachable, 5: a wait ran out, 2: refused)."""
    from octopipe.execute.control.client import ControlClient, ControlError  # noqa: PLC0415 (keeps --help fast)

    try:
        with ControlClient(args.coordinator, args.certs, args.identity) as client:
            return int(action(client))
    except FileNotFoundError as exc:  # a missing certificate folder or file: the message names the fix
        err(f"octopipe: error: {exc}")
        return EXIT_USAGE
    except ControlError as exc:
        err(f"octopipe: error: {cli_words(str(exc))}")
        return EXIT_UNREACHABLE if exc.code.name == "UNAVAILABLE" else EXIT_USAGE
    except TimeoutError as exc:
        err(f"octopipe: error: {exc}: the run goes on; wait longer or check `octopipe runs`")
        return EXIT_TIMED_OUT
    except KeyboardInterrupt:
        err("octopipe: interrupted: the run goes on at the coordinator (`octopipe runs`, `octopipe cancel RUN`)")
        return EXIT_INTERRUPTED
