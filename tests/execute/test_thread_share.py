"""The channel threads' share of a rank's core (issue 36): fitted from compute beside real gloo messages on a
pinned core, within its bounds, and relative to the per-message CPU work the runtime costs state."""

from __future__ import annotations

import pytest

from octopipe.execute.runtime.threadshare import _loss_per_message, fit_thread_share, measure_thread_share
from octopipe.simulate import MessageCpu, RuntimeCosts


def test_the_share_is_the_loss_over_the_message_cpu_through_the_origin() -> None:
    # loss = 0.5 x cpu at both sizes: the share is 0.5 exactly
    term = fit_thread_share({1: 100.0, 2: 300.0}, {1: 200.0, 2: 600.0})
    assert (term.value, term.clamped, term.low, term.high) == (0.5, False, 0.0, 1.0)
    # more loss than the message's CPU work can explain is held at 1 and says so; a gain is held at 0
    assert fit_thread_share({1: 900.0}, {1: 300.0}).value == 1.0
    assert fit_thread_share({1: 900.0}, {1: 300.0}).clamped
    assert fit_thread_share({1: -50.0}, {1: 300.0}).value == 0.0
    with pytest.raises(ValueError, match="no per-message CPU work"):
        fit_thread_share({1: 10.0}, {1: 0.0})


def test_the_loss_per_message_counts_only_the_blocks_inside_the_messages_window() -> None:
    # blocks of 1000 ns alone; inside the window [1000, 5000] two blocks took 1500 ns each; one outside
    blocks = [(0, 1000), (1000, 2500), (2500, 4000), (4000, 6000)]
    lost_us, slowdown = _loss_per_message(blocks, (1000, 5000), 1000.0, messages=8)
    # 1000 ns lost over the 3000 ns the two blocks cover, which hold 8 x 3000 / 4000 = 6 messages
    assert lost_us == pytest.approx(1000 / 6 / 1e3)
    assert slowdown == pytest.approx(0.5)
    with pytest.raises(RuntimeError, match="no compute block"):
        _loss_per_message([(0, 9000)], (1000, 5000), 1000.0, messages=8)


def test_the_micro_bench_fits_the_share_on_two_pinned_ranks() -> None:
    runtime = RuntimeCosts(recv_cpu=MessageCpu(fixed_us=200.0, us_per_mib=200.0))
    sizes = (64 << 10, 1 << 20)
    measured = measure_thread_share(runtime, sizes=sizes, messages=20, block_ms=1.0, repeats=1)
    assert set(measured.loss_us) == set(sizes) == set(measured.compute_slowdown)
    assert measured.message_cpu_us == {size: runtime.message_cpu_us(size) for size in sizes}
    assert measured.share.low <= measured.share.value <= measured.share.high
    assert measured.share == fit_thread_share(measured.loss_us, measured.message_cpu_us)
    assert measured.block_us > 0 and len(measured.cores) == 1  # the measured rank ran pinned to one core
