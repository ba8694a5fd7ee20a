"""The CLI's exit codes and its usage error (shared by the dispatcher and the commands)."""

from __future__ import annotations

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUN_FAILED",
    "EXIT_TIMED_OUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "UsageError",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
#: the run ended failed or cancelled
EXIT_RUN_FAILED = 3
#: the coordinator could not be reached
EXIT_UNREACHABLE = 4
#: a ``--wait`` ran out (the run goes on)
EXIT_TIMED_OUT = 5
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad arguments or input: reported in one line, exit code 2."""
