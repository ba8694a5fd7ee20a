"""octopipe.execute: the runtime, launcher, coordinator, node daemon and the ``octopipe`` CLI.

The only package that configures logging, opens sockets or starts processes.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.execute.cli import main
from octopipe.execute.logconfig import configure_logging

try:
    __version__ = version("octopipe-execute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "configure_logging", "main"]
