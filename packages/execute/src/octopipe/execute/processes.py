"""Process plumbing without torch: a free port, children that die with their parent, functions run by name.

The control plane starts rank processes (which import torch) without importing
torch itself: :func:`spawn_by_name` gives a spawned child the module and function
to run, and the child imports them.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["die_with_parent", "free_port", "spawn_by_name"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before the call
        raise SystemExit(1)


def _run_by_name(module: str, function: str, args: Sequence[Any], with_parent: bool) -> None:
    if with_parent:
        die_with_parent()
    getattr(importlib.import_module(module), function)(*args)


def spawn_by_name(context: Any, target: str, args: Sequence[Any], *, name: str, with_parent: bool = True) -> Any:
    """Start ``target`` (``"package.module:function"``) with ``args`` in a child of the ``spawn`` context.

    Only the child imports the module. ``with_parent``: the child is killed when this process dies.
    Returns the started process.
    """
    module, _, function = target.partition(":")
    if not module or not function:
        raise ValueError(f"target {target!r}: use 'package.module:function'")
    process = context.Process(target=_run_by_name, args=(module, function, tuple(args), with_parent), name=name)
    process.start()
    return process
