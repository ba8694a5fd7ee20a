"""The control plane: a gRPC coordinator and per-node daemons over mutual TLS."""

from octopipe.execute.control.client import ControlClient, ControlError
from octopipe.execute.control.coordinator import Coordinator, CoordinatorConfig
from octopipe.execute.control.local import LocalCluster, process_alive
from octopipe.execute.control.node import NodeConfig, NodeDaemon
from octopipe.execute.control.security import CertPaths, make_certs
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
