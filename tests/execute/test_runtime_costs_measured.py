"""The runtime-cost micro-bench (issue 36): emulated ranks' records give every term, each within its bounds,
from samples of the actions and messages the plans hold (not from step times)."""

from __future__ import annotations

from octopipe.execute.runtime.runtime_costs import measure_runtime_costs
from octopipe.simulate import DISPATCHED_KINDS, Link, RuntimeCosts


def test_the_micro_bench_fits_every_term_within_its_bounds_from_action_records() -> None:
    link = Link(latency_us=50.0, bandwidth_bytes_per_second=3.5e9)
    steps, warmup, sizes = 3, 1, (64, 1 << 16)
    measured = measure_runtime_costs(link, sizes=sizes, steps=steps, warmup=warmup, compute_us=2000.0)
    # every kind of the ping (F, B, and both directions' SEND and RECV) and of DualPipeV (I, W, OVERLAP_F_B)
    assert set(measured.dispatch_us) == {kind.value for kind in DISPATCHED_KINDS}
    assert all(value >= 0 for values in measured.dispatch_us.values() for value in values)
    # the ping: one message each way per step, every one awaited by its consumer, at every size
    assert {size: len(values) for size, values in measured.message_us.items()} == dict.fromkeys(
        sizes, 2 * (steps - warmup)
    )
    for term in measured.fitted:
        assert term.low <= term.value <= term.high, term
    assert measured.runtime == RuntimeCosts.from_terms({t.name: t.value for t in measured.fitted})
    assert measured.runtime.thread_share == 1.0  # stated for ranks pinned one core each, not fitted
