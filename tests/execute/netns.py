"""Two test hosts in network namespaces on one bridge (iproute2), made and removed by the test that needs them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    #: the host's end of its link, inside the namespace
    interface: str
    #: the bridge's end of the link, in the root namespace (``ip link set ... down`` cuts the host off)
    peer: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, "env", f"GLOO_SOCKET_IFNAME={self.interface}"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"opprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"the kernel refused a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


@contextlib.contextmanager
def hosts(count: int = 2, subnet: str = "10.213.0") -> Iterator[tuple[str, list[Host]]]:
    """A bridge at ``<subnet>.1`` in the root namespace (the coordinator's address) and ``count`` hosts."""
    tag = f"{os.getpid() % 10000}"
    bridge = f"opbr{tag}"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index in range(count):
            host = Host(
                namespace=f"ophost{tag}x{index}",
                address=f"{subnet}.{index + 2}",
                interface=f"opv{tag}h{index}",
                peer=f"opv{tag}b{index}",
            )
            _ip("netns", "add", host.namespace)
            made.append(host)
            _ip("link", "add", host.peer, "type", "veth", "peer", "name", host.interface)
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("link", "set", host.peer, "master", bridge)
            _ip("link", "set", host.peer, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield f"{subnet}.1", made
    finally:
        for host in made:
            subprocess.run(["ip", "link", "del", host.peer], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def cut(host: Host) -> None:
    """Take the host's link down at the bridge: its packets stop, its processes live on."""
    _ip("link", "set", host.peer, "down")


def mend(host: Host) -> None:
    """Bring a cut host's link back up."""
    _ip("link", "set", host.peer, "up")
