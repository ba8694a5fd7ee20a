"""octopipe.transform: see README.md. The public API grows with the capture issue; this is its skeleton."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("octopipe-transform")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
