"""octopipe.tune: schedule generators and (to come) the partition x placement x schedule co-optimizer.

Never imports torch.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.tune.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1

try:
    __version__ = version("octopipe-tune")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1"]
