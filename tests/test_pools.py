"""Uneven counts where devices share compute (the CPU devices of one process share its cores).

Injected timings only; every expectation is worked out by hand in the test's comments.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sharding.balance import Rebalancer, counts_for_speeds, predicted_seconds
from train.setup.calibrate import compute_pools

POOLS = (0,) * 4 + (1,) * 4


@pytest.mark.parametrize(
    "r,expected",
    [
        # 24 microbatches, process 1 r times slower: process totals 24 r/(r+1) and 24/(r+1), spread evenly.
        (2.0, (4, 4, 4, 4, 2, 2, 2, 2)),  # 16 / 8
        (3.0, (5, 5, 4, 4, 2, 2, 1, 1)),  # 18 / 6
        (2.9, (5, 5, 4, 4, 2, 2, 1, 1)),  # 17.85 -> 18 / 6
        (1.5, (4, 4, 3, 3, 3, 3, 2, 2)),  # 14.4 -> 14 / 10
    ],
)
def test_pooled_counts_share_by_process_then_evenly(r, expected):
    speeds = [1.0] * 4 + [1 / r] * 4
    assert tuple(counts_for_speeds(speeds, 24, 6, pools=POOLS)) == expected


def test_pools_beat_per_device_shares_on_shared_cores():
    """At r = 2.9 per-device largest remainder gives 4 to each fast device (16 / 8: the slow process takes
    8 x 2.9 = 23.2 units); pooled shares give 18 / 6 (max(18, 17.4))."""
    speeds, seconds = [1.0] * 4 + [1 / 2.9] * 4, [1.0] * 4 + [2.9] * 4
    flat = counts_for_speeds(speeds, 24, 6)
    pooled = counts_for_speeds(speeds, 24, 6, pools=POOLS)
    assert flat == [4, 4, 4, 4, 2, 2, 2, 2]
    # pooled time: a device's figure is for one microbatch on each of the 4 devices at once
    assert predicted_seconds(flat, seconds, POOLS) == pytest.approx(8 * 2.9 / 4)
    assert predicted_seconds(pooled, seconds, POOLS) == pytest.approx(18 / 4)


def test_pooled_counts_keep_the_capacity():
    capped = counts_for_speeds([1.0] * 4 + [1 / 9] * 4, 24, 5, pools=POOLS)  # 21.6 wanted, capacity 4 x 5
    assert capped == [5, 5, 5, 5, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        counts_for_speeds([1.0] * 8, 40, 4, pools=POOLS)


def test_rebalancer_with_pools_follows_a_slowed_process():
    """Loop seconds of a pool's devices are its shared core's time: process 1's loops take 2x as long per
    microbatch, so the counts move to 16 / 8 once due; all 8 loops then end together, no further change."""
    reb = Rebalancer((3,) * 8, capacity=6, every=2, pools=POOLS)
    for _ in range(2):
        reb.observe((3,) * 8, [1.2] * 4 + [2.4] * 4)  # 12 microbatches in 1.2 s vs 12 in 2.4 s
    assert reb.seconds == pytest.approx([0.4] * 4 + [0.8] * 4)
    assert reb.propose() == (4, 4, 4, 4, 2, 2, 2, 2)
    for _ in range(2):
        reb.observe(reb.counts, [1.6] * 4 + [1.6] * 4)
    assert reb.propose() is None


def test_compute_pools_by_process_on_cpu_only():
    cpu = [SimpleNamespace(platform="cpu", process_index=i // 2) for i in range(4)]
    gpu = [SimpleNamespace(platform="gpu", process_index=i // 2) for i in range(4)]
    assert compute_pools(cpu) == [0, 0, 1, 1]
    assert compute_pools(gpu) is None
