"""octopipe.execute: the ``octopipe`` CLI, the control plane (coordinator, node daemon) and the runtime.

The only package that configures logging, opens sockets or starts processes.
Three parts: ``cli`` (commands), ``control`` (gRPC services; imports no torch)
and ``runtime`` (rank processes on torch.distributed). Importing this package
loads none of them; ``main`` and ``configure_logging`` load the CLI on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from octopipe.execute.cli import main
    from octopipe.execute.logconfig import configure_logging

__all__ = ["__version__", "configure_logging", "main"]


def __getattr__(name: str) -> Any:
    """``main`` (the CLI), ``configure_logging`` and ``__version__``, looked up when first asked for."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 (48 ms at every start)

        try:
            return version("octopipe-execute")
        except PackageNotFoundError:  # running from a source tree that is not installed
            return "0.0.0+unknown"
    if name == "main":
        from octopipe.execute.cli import main  # noqa: PLC0415 (the CLI is loaded only when asked for)

        return main
    if name == "configure_logging":
        from octopipe.execute.logconfig import configure_logging  # noqa: PLC0415

        return configure_logging
    raise AttributeError(f"module 'octopipe.execute' has no attribute {name!r}")
