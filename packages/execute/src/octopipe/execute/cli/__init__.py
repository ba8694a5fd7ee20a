"""The ``octopipe`` command line: one module per command, each registering itself (``register(sub, registry)``
adds its parser and sets its handler); ``main`` parses and calls the handler. Importing the CLI loads no torch:
commands that run models import the runtime when they run."""

from octopipe.execute.cli.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from octopipe.execute.cli.main import (
    COMMANDS,
    EXIT_RUN_FAILED,
    EXIT_TIMED_OUT,
    EXIT_UNREACHABLE,
    build_parser,
    entry,
    main,
)

__all__ = [
    "COMMANDS",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUN_FAILED",
    "EXIT_TIMED_OUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "entry",
    "main",
]
