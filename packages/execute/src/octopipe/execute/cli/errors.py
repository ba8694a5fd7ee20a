"""The CLI's exit codes and its usage error (shared by the dispatcher and the commands)."""

from __future__ import annotations

__all__ = ["EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError"]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad arguments or input: reported in one line, exit code 2."""
