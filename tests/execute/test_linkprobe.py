"""The p2p link probe: two real gloo processes on 127.0.0.1, and the latency/bandwidth fit."""

from __future__ import annotations

import pytest

from octopipe.execute.runtime.linkprobe import fit_link, measure_link, measure_links


def test_fit_recovers_a_known_line() -> None:
    latency, bandwidth = 50.0, 2e9  # us, bytes/s
    points = [(size, latency + size / bandwidth * 1e6) for size in (4, 1 << 20, 8 << 20)]
    fitted_latency, fitted_bandwidth = fit_link(points)
    assert fitted_latency == pytest.approx(latency)
    assert fitted_bandwidth == pytest.approx(bandwidth)
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_link(points[:1])
    # one slow large transfer (noise) moves the bandwidth, not the latency: the small message's time holds it
    noisy = [*points[:2], (8 << 20, 2 * points[2][1])]
    assert fit_link(noisy)[0] == pytest.approx(latency, rel=0.01)


@pytest.mark.slow
@pytest.mark.extended  # CI's budget: the README run command (test_demo) measures the same gloo link by default
def test_measures_a_real_gloo_link() -> None:
    cost, points = measure_link(sizes=(4, 1 << 20, 4 << 20), repeats=3, timeout_s=120)
    assert [size for size, _ in points] == [4, 1 << 20, 4 << 20]
    assert all(t > 0 for _, t in points)
    assert cost.latency_us >= 0
    assert cost.bandwidth_bytes_per_second > 1e6  # loopback moves far more than a MB/s
    links = measure_links(3, repeats=3)  # one pair measured stands for every ordered pair of local CPU ranks
    assert sorted((link.source_rank, link.destination_rank) for link in links) == [
        (a, b) for a in range(3) for b in range(3) if a != b
    ]
    assert len({(link.latency_us, link.bandwidth_bytes_per_second) for link in links}) == 1
