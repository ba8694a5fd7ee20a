"""The runtime's own costs on this machine, each from its dedicated micro-bench (issue 36).

Probes the gloo link between two local ranks (``linkprobe.measure_link``: latency and bandwidth come from
the probe alone), then runs ``octopipe.execute.runtime.runtime_costs.measure_runtime_costs`` ``--rounds``
times: two emulated ranks (the real interpreter, channels and gloo messages; computations wait for their
time instead of computing) running an alternating ping at several message sizes and one DualPipeV, from whose
records it reads the dispatch per action kind and the CPU work per message (see that module). Prints each
term per round and the median over rounds, with its physical bounds; writes
``results/runtime_costs.json`` with ``terms`` (the medians, by name), ``fitted_terms`` (value, bounds,
whether held at a bound) and ``rounds[]``. The ``terms`` are what ``bench/emulated_fidelity.py
--runtime-costs`` and ``octopipe.simulate.RuntimeCosts.from_terms`` read.

    .venv/bin/python bench/runtime_costs.py [--rounds 3] [--steps 12] [--warmup 2] [--thread-share 1.0 | --fit-thread-share]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from quiet import add_arguments, start, write_record

from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.runtime_costs import measure_runtime_costs
from octopipe.execute.runtime.threadshare import measure_thread_share
from octopipe.simulate import FittedTerm, Link, RuntimeCosts

OUT = Path(__file__).parent / "results" / "runtime_costs.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, rounds=3, steps=12, warmup=True)
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 1 << 20, 4 << 20], help="message bytes")
    parser.add_argument(
        "--thread-share",
        type=float,
        default=1.0,
        help="the part of a message's CPU work on the rank's own core (1: CPU ranks pinned to one core each)",
    )
    parser.add_argument(
        "--fit-thread-share",
        action="store_true",
        help="fit thread_share with its own micro-bench (runtime.threadshare: compute on a pinned core beside "
        "messages) instead of stating it",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    env = start(parser, args)
    if args.tiny:
        args.sizes, args.steps, args.warmup = [64, 1 << 16], 3, 1
    cost, points = measure_link()
    link = Link.from_proto(cost)
    print(f"link probe: {link.latency_us:.1f} us + {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s")
    rounds: list[dict[str, Any]] = []
    per_round: list[dict[str, FittedTerm]] = []
    for round_ in range(args.rounds):
        measured = measure_runtime_costs(
            link, sizes=args.sizes, steps=args.steps, warmup=args.warmup, thread_share=args.thread_share
        )
        rounds.append(measured.as_dict())
        per_round.append({term.name: term for term in measured.fitted})
        line = ", ".join(f"{t.name} {t.value:.1f}{' (held)' if t.clamped else ''}" for t in measured.fitted)
        print(f"round {round_ + 1}: {line}", flush=True)
    fitted = [
        FittedTerm(
            name,
            statistics.median(r[name].value for r in per_round),
            first.low,
            first.high,
            clamped=any(r[name].clamped for r in per_round),
        )
        for name, first in per_round[0].items()
    ]
    share = None
    if args.fit_thread_share:  # relative to the medians' per-message CPU work
        stated = RuntimeCosts.from_terms({t.name: t.value for t in fitted})
        share = measure_thread_share(stated, messages=40 if args.tiny else 120, repeats=1 if args.tiny else 3)
        fitted = [share.share if t.name == "thread_share" else t for t in fitted]
        print(
            f"thread share: loss per message {share.loss_us} us over the message's CPU {share.message_cpu_us} us; "
            f"compute beside messages slowed {share.compute_slowdown}"
        )
    runtime = RuntimeCosts.from_terms({t.name: t.value for t in fitted})  # checks every median against its bounds
    print("\nmedian over rounds:")
    for term in fitted:
        held = " (held at a bound in a round)" if term.clamped else ""
        print(f"  {term.name:22s} {term.value:10.1f}   bounds [{term.low:g}, {term.high:g}]{held}")
    record = {
        "source": "bench/runtime_costs.py",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "rounds_count": args.rounds,
        "steps_per_launch": args.steps,
        "warmup_steps": args.warmup,
        "sizes": args.sizes,
        "tiny": args.tiny,
        "link": {"latency_us": link.latency_us, "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second},
        "link_points": points,
        "terms": runtime.terms(),
        "fitted_terms": [term.as_dict() for term in fitted],
        "rounds": rounds,
        "environment": env.finish(),
        "thread_share_measurement": None if share is None else share.as_dict(),
        "note": "emulated ranks are not pinned (they wait rather than compute); thread_share "
        + ("fitted by runtime.threadshare (real compute, pinned)" if share is not None else "stated, not fitted"),
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
