"""Splitting a whole number of items over bins: evenly, or in proportion to weights.

Used for layers over pipeline stages (`sharding.pipeline.layout`), microbatches over devices of
different speeds (uneven data parallelism) and the planner's shares (`sharding.planner`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` items over ``parts`` bins as evenly as possible, the first ``total % parts`` bins one larger.

    Raises:
      ValueError: When ``parts`` < 1 or ``total`` < 0.
    """
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} items over {parts} bins")
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


def largest_remainder(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """``total`` items in proportion to ``weights``, rounded by largest remainder (Hamilton's method).

    Each bin first gets ``minimum``; the rest is shared: bin ``i`` gets ``floor(rest * w_i / sum(w))``
    and the items left go one each to the bins with the largest fractional parts (ties: the larger
    weight, then the lower index). The counts sum to ``total``.

    Args:
      total: Items to share (>= 0).
      weights: One positive weight per bin (e.g. device speeds).
      minimum: Items every bin gets at least.

    Returns:
      One count per bin.

    Raises:
      ValueError: On no weights, a weight that is not positive, a negative ``total``, or a ``total``
        below ``minimum * len(weights)``.
    """
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if total < minimum * len(weights):
        raise ValueError(f"{total} items cannot give each of {len(weights)} bins at least {minimum}")
    rest = total - minimum * len(weights)
    whole = sum(weights)
    exact = [rest * w / whole for w in weights]
    counts = [math.floor(e) for e in exact]
    left = rest - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), -weights[i], i))
    for i in order[:left]:
        counts[i] += 1
    return [c + minimum for c in counts]


def min_max_assign(
    total: int, base: Sequence[int], cost: Callable[[int, int], object], cap: Sequence[int] | None = None
) -> list[int] | None:
    """Gives ``total - sum(base)`` more units, one at a time, to the bin whose cost after taking one is smallest.

    Optimal for minimizing the largest cost when each bin's cost grows with its units (Graham's greedy
    list scheduling of identical jobs). Used for layers over pipeline stages and microbatches over
    devices of different speeds.

    Args:
      total: Units in all (at least ``sum(base)``).
      base: Units each bin starts with.
      cost: ``cost(i, n)``: bin ``i``'s cost holding ``n`` units (any comparable value, e.g. seconds or
        a tuple to break ties).
      cap: Most units each bin may hold (None: no cap).

    Returns:
      Units per bin, or None when the caps leave units without a bin.
    """
    out = list(base)
    # a heap of each open bin's cost after one more unit: only the bin that took a unit changes, so this
    # picks what a scan over all bins would (ties to the lower index) in log time per unit
    heap = [(cost(i, out[i] + 1), i) for i in range(len(out)) if cap is None or out[i] < cap[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(out)):
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        out[i] += 1
        if cap is None or out[i] < cap[i]:
            heapq.heappush(heap, (cost(i, out[i] + 1), i))
    return out
