"""The split-overhead bench in bf16 on a CUDA GPU (the H200 device check).

Run on the device machine from the repository root, with the octopipe packages
on the path (see bench/README.md):

    python bench/gpu_split_overhead.py     # writes $OUT/gpu_split_overhead.json when $OUT is set

It is bench/split_overhead.py with --device cuda --dtype bfloat16 and more repeats.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).parent
    out = Path(os.environ.get("OUT", here / "results")) / "gpu_split_overhead.json"
    extra = sys.argv[1:]
    sys.argv = [str(here / "split_overhead.py"), "--device", "cuda", "--dtype", "bfloat16"]
    sys.argv += ["--repeats", "30", "--warmup", "5", "--out", str(out), *extra]
    runpy.run_path(sys.argv[0], run_name="__main__")
