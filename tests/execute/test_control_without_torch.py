"""The control plane imports no torch: a coordinator and a node daemon start in a process where torch cannot
be imported, the daemon registers, and an admin client lists runs. Only rank processes load torch.

Each check runs in a fresh interpreter (torch may already be loaded in the test process) with an import
hook that refuses ``torch`` and its submodules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BLOCK_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: the control plane must not import torch")
        return None
sys.meta_path.insert(0, _NoTorch())
"""

_START = """
import json, time
from pathlib import Path
started = time.perf_counter()
from octopipe.execute.control import (
    ControlClient, Coordinator, CoordinatorConfig, NodeConfig, NodeDaemon, make_certs,
)
imported_s = time.perf_counter() - started
root = Path(sys.argv[1])
make_certs(root / "certs", nodes=["n0"])
coordinator = Coordinator(CoordinatorConfig(certs=root / "certs", state_dir=root / "state")).start()
node = NodeDaemon(
    NodeConfig(node_id="n0", coordinator=coordinator.address, certs=root / "certs", work_dir=root / "node")
).start()
deadline = time.monotonic() + 30
while not [n for n in coordinator.nodes() if n[0] == "n0"] and time.monotonic() < deadline:
    time.sleep(0.05)
with ControlClient(coordinator.address, root / "certs") as client:
    runs = client.runs()
nodes = coordinator.nodes()
node.stop()
coordinator.stop()
print(json.dumps({"imported_s": imported_s, "nodes": [list(n) for n in nodes], "runs": len(runs),
                  "torch": any(m == "torch" or m.startswith("torch.") for m in sys.modules)}))
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_a_coordinator_and_a_daemon_start_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    done = _python(_BLOCK_TORCH + _START, str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    assert [n[0] for n in report["nodes"]] == ["n0"] and report["nodes"][0][2]  # registered and alive
    assert report["runs"] == 0


def test_the_hook_does_block_torch() -> None:
    """The check above could not pass by accident: with the hook, importing the runtime fails on torch."""
    done = _python(_BLOCK_TORCH + "import octopipe.execute.runtime\n")
    assert done.returncode != 0
    assert "torch is blocked" in done.stderr
