"""The store keeper: a rank-side process that holds (or joins) a run's rendezvous store for a node daemon.

The daemon imports no torch, so it cannot open a ``TCPStore``; it starts a
keeper instead (``control.ranks.StoreKeeper``) and sends it commands over a
queue: raise the abort flag, publish a plan switch, stop. Each command is
answered on a second queue, so the daemon waits with a timeout and never hangs.
"""

from __future__ import annotations

import datetime
import os
import queue
from typing import Any

import torch.distributed as dist

from octopipe.execute.runs import ABORT_KEY, PLAN_KEY

__all__ = ["keeper_main"]

#: how often the keeper checks that its daemon is alive while no command comes
_POLL_S = 1.0


def keeper_main(host: str, port: int, is_master: bool, timeout_s: float, commands: Any, replies: Any) -> None:
    """Serve ``commands`` (``("abort", reason)``, ``("plan", (switch, plan bytes))``, ``("stop", None)``)."""
    parent = os.getppid()
    try:
        store = dist.TCPStore(
            host,
            port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        replies.put(("error", f"store {host}:{port} unavailable: {exc}"))
        return
    replies.put(("ready", ""))
    while True:
        try:
            command, payload = commands.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the daemon is gone
                return
            continue
        if command == "stop":
            replies.put(("ok", ""))
            return
        try:
            if command == "abort":
                if not store.check([ABORT_KEY]):
                    store.set(ABORT_KEY, str(payload))
            elif command == "plan":
                switch, data = payload
                store.set(f"{PLAN_KEY}/{switch}", data)
            else:
                raise ValueError(f"unknown keeper command {command!r}")
            replies.put(("ok", ""))
        except Exception as exc:
            replies.put(("error", str(exc)))
