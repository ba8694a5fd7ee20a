"""The coordinator: verifies plans, assigns ranks to node daemons, pushes plans, tracks runs, re-tunes.

Four parts: ``service`` (the gRPC servicer, its server and loop), ``scheduler``
(placing and pushing queued runs, heartbeats, dead nodes), ``closed_loop``
(re-tuning adaptive runs from measured timelines) and ``records`` (nodes and
runs under one lock, persisted to ``state_dir``). Imports no torch.
"""

from octopipe.execute.control.coordinator.closed_loop import DEFAULT_ADAPT_AFTER, MIN_ADAPT_GAIN, ClosedLoop
from octopipe.execute.control.coordinator.records import CoordinatorConfig, Records
from octopipe.execute.control.coordinator.scheduler import RunScheduler
from octopipe.execute.control.coordinator.service import Coordinator

__all__ = [
    "DEFAULT_ADAPT_AFTER",
    "MIN_ADAPT_GAIN",
    "ClosedLoop",
    "Coordinator",
    "CoordinatorConfig",
    "Records",
    "RunScheduler",
]
