"""The control plane: a gRPC coordinator and per-node daemons over mutual TLS. Imports no torch.

Importing this package loads nothing but itself: each name below loads its module when first used,
so a client command (``octopipe runs``) does not pay for the coordinator, the daemon or certificate
making.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from octopipe.execute.control.certs import make_certs
    from octopipe.execute.control.client import ControlClient, ControlError
    from octopipe.execute.control.coordinator import Coordinator, CoordinatorConfig
    from octopipe.execute.control.local import LocalCluster, process_alive
    from octopipe.execute.control.node import NodeConfig, NodeDaemon
    from octopipe.execute.control.security import CertPaths
    from octopipe.execute.control.submission import check_plan

__all__ = [
    "CertPaths",
    "ControlClient",
    "ControlError",
    "Coordinator",
    "CoordinatorConfig",
    "LocalCluster",
    "NodeConfig",
    "NodeDaemon",
    "check_plan",
    "make_certs",
    "process_alive",
]

_WHERE = {
    "CertPaths": "security",
    "ControlClient": "client",
    "ControlError": "client",
    "Coordinator": "coordinator",
    "CoordinatorConfig": "coordinator",
    "LocalCluster": "local",
    "process_alive": "local",
    "NodeConfig": "node",
    "NodeDaemon": "node",
    "check_plan": "submission",
    "make_certs": "certs",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'octopipe.execute.control' has no attribute {name!r}")
    return getattr(importlib.import_module(f"octopipe.execute.control.{module}"), name)
