"""What a node daemon starts: rank processes and the store keeper, without importing torch here.

Rank processes run ``runtime.worker.worker_main`` and the keeper
``runtime.keeper.keeper_main``; both are started by name in spawned children
(``processes.spawn_by_name``), so only the children load torch.
"""

from __future__ import annotations

import queue
from typing import Any

from octopipe.execute.processes import spawn_by_name
from octopipe.execute.runs import WorkerConfig

__all__ = ["KeeperError", "StoreKeeper", "start_rank"]

_WORKER = "octopipe.execute.runtime.worker:worker_main"
_KEEPER = "octopipe.execute.runtime.keeper:keeper_main"


class KeeperError(RuntimeError):
    """The store keeper did not answer in time, or its store failed; the message says which."""


def start_rank(context: Any, config: WorkerConfig, events: Any) -> Any:
    """Start rank ``config.rank`` (it reports each step on ``events``); returns the started process."""
    return spawn_by_name(context, _WORKER, (config, events), name=f"octopipe-rank{config.rank}", with_parent=False)


class StoreKeeper:
    """A child process holding (``is_master``) or joining a run's rendezvous store for this daemon.

    Commands wait for the keeper's answer for at most ``timeout_s`` and raise :class:`KeeperError`
    otherwise. ``close()`` stops it (killing it if it does not stop in time).
    """

    def __init__(self, context: Any, host: str, port: int, *, is_master: bool, timeout_s: float) -> None:
        self.address = f"{host}:{port}"
        self._commands = context.Queue()
        self._replies = context.Queue()
        self._ready = False
        self.process = spawn_by_name(
            context,
            _KEEPER,
            (host, port, is_master, timeout_s, self._commands, self._replies),
            name=f"octopipe-store-{'host' if is_master else 'client'}",
        )

    def _answer(self, timeout_s: float, what: str) -> None:
        try:
            kind, message = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise KeeperError(f"the store keeper for {self.address} did not {what} within {timeout_s:g} s") from None
        if kind == "error":
            raise KeeperError(f"the store keeper for {self.address} could not {what}: {message}")
        if kind == "ready":
            self._ready = True

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the keeper holds (or has joined) the store."""
        if not self._ready:
            self._answer(timeout_s, "open the store")

    def _ask(self, command: str, payload: object, timeout_s: float, what: str) -> None:
        self.wait_ready(timeout_s)
        self._commands.put((command, payload))
        self._answer(timeout_s, what)

    def abort(self, reason: str) -> None:
        """Ask the keeper to raise the run's abort flag (once: a flag already raised keeps its first reason),
        without waiting: the daemon goes on to stop its ranks while the keeper reaches the store (which may be
        behind a cut link). The run ends either way; its ranks elsewhere also fail their own waits."""
        self._commands.put(("abort", reason))

    def publish(self, switch: int, plan: bytes, timeout_s: float) -> None:
        """Offer a serialized plan as the run's ``switch``-th plan switch to adaptive ranks."""
        self._ask("plan", (switch, plan), timeout_s, f"publish plan switch {switch}")

    def close(self, timeout_s: float = 5.0, *, grace_s: float = 1.0) -> None:
        """Stop the keeper; the store it hosts goes with it. A keeper that does not stop within ``grace_s`` (one
        blocked on a store whose host was cut off) is killed, so a node starting a run's next attempt is not held
        up by the last one's lost peer."""
        if self.process.is_alive():
            self._commands.put(("stop", None))
            self.process.join(timeout=grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=timeout_s)
