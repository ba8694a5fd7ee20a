"""octopipe.execute: the ``octopipe`` CLI, the control plane (coordinator, node daemon) and the runtime.

The only package that configures logging, opens sockets or starts processes.
Three parts: ``cli`` (commands), ``control`` (gRPC services; imports no torch)
and ``runtime`` (rank processes on torch.distributed). Importing this package
loads none of them; ``main`` and ``configure_logging`` load the CLI on first use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from octopipe.execute.cli import main
    from octopipe.execute.logconfig import configure_logging

try:
    __version__ = version("octopipe-execute")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "configure_logging", "main"]


def __getattr__(name: str) -> Any:
    """``main`` (the CLI) and ``configure_logging``, imported when first asked for."""
    if name == "main":
        from octopipe.execute.cli import main  # noqa: PLC0415 (the CLI is loaded only when asked for)

        return main
    if name == "configure_logging":
        from octopipe.execute.logconfig import configure_logging  # noqa: PLC0415

        return configure_logging
    raise AttributeError(f"module 'octopipe.execute' has no attribute {name!r}")
