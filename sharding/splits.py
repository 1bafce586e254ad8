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


def min_max_classes(
    total: int,
    groups: Sequence[int],
    seconds: Callable[[int, int], float],
    start: Sequence[int] | None = None,
) -> list[int]:
    """``total`` units over classes of identical bins, minimizing the slowest bin's time: the exact optimum.

    Class ``k`` has ``groups[k]`` bins; it holds ``t_k`` units spread as evenly as they go (its fullest bin
    ``ceil(t_k / groups[k])``, which an uneven spread would only raise), and its time is
    ``seconds(k, ceil(t_k / groups[k]))``. The answer minimizes ``max_k`` of those over every ``t`` summing to
    ``total``. What it relies on: each ``seconds(k, .)`` is nondecreasing (more units never take less time;
    ``inf`` may mark a count that is not allowed, e.g. over memory, as long as larger counts are not allowed
    either). Nothing else (no convexity, no affine or unimodal shape): from ``start``, with ``tau`` the
    current slowest time, every class takes the most units its bins can hold below ``tau`` (a monotone
    search from its current count); if those hold fewer than ``total`` units, no split beats ``tau`` and the
    current one is optimal (the certificate); else the excess is taken back from the slowest classes and
    ``tau`` has strictly dropped. A good ``start`` (e.g. from each class's priced speed) makes this a few
    evaluations; each ``seconds(k, n)`` is asked once per ``(k, n)``.

    Args:
      total: Units to share (>= 0).
      groups: Bins per class (each >= 1).
      seconds: ``seconds(k, n)``: the time of one bin of class ``k`` holding ``n`` units.
      start: Units per class to start from (summing to ``total``); None: in proportion to ``groups``.

    Returns:
      Units per class, summing to ``total``.

    Raises:
      ValueError: On no class, a class without bins, a negative ``total``, or a ``start`` that does not sum
        to ``total``.
    """
    if not groups or any(g < 1 for g in groups) or total < 0:
        raise ValueError(f"cannot share {total} units over classes of {list(groups)} bins")
    t = list(largest_remainder(total, [float(g) for g in groups]) if start is None else start)
    if sum(t) != total or any(n < 0 for n in t):
        raise ValueError(f"start {list(t)} does not share {total} units")
    memo: dict[tuple[int, int], float] = {}

    def time(k: int, n: int) -> float:
        if (k, n) not in memo:
            memo[(k, n)] = seconds(k, n)
        return memo[(k, n)]

    def level(k: int, units: int) -> int:
        return -(-units // groups[k])

    def most_below(k: int, tau: float, near: int) -> int:
        """The largest count whose time is below ``tau`` (-1: none), searched from ``near``."""
        top = level(k, total)
        if time(k, 0) >= tau:
            return -1
        lo, hi = 0, top + 1  # time(lo) < tau; hi: past the end or time(hi) >= tau
        near = min(max(near, 0), top)
        if time(k, near) < tau:
            lo, step = near, 1
            while lo + step <= top and time(k, lo + step) < tau:
                lo, step = lo + step, 2 * step
            hi = min(lo + step, top + 1)
        else:
            hi, step = near, 1
            while hi - step > 0 and time(k, hi - step) >= tau:
                hi, step = hi - step, 2 * step
            lo = max(hi - step, 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if time(k, mid) < tau:
                lo = mid
            else:
                hi = mid
        return lo

    while True:
        levels = [level(k, n) for k, n in enumerate(t)]
        tau = max(time(k, n) for k, n in enumerate(levels))
        most = [most_below(k, tau, n) for k, n in enumerate(levels)]
        if min(most) < 0 or sum(g * m for g, m in zip(groups, most)) < total:
            return t
        t = [g * m for g, m in zip(groups, most)]
        excess = sum(t) - total
        while excess:  # take units back from the class whose fullest bin is slowest
            k = max((k for k in range(len(t)) if t[k]), key=lambda k: time(k, level(k, t[k])))
            drop = min(excess, t[k] - groups[k] * (level(k, t[k]) - 1))
            t[k] -= drop
            excess -= drop


def spread(units: Sequence[int], classes: Sequence[int]) -> list[int]:
    """Per-bin units from per-class ``units``: the bins of class ``k`` are the positions ``i`` with
    ``classes[i] == k``, in order; the first of them take one more where ``units[k]`` does not divide evenly.

    Raises:
      ValueError: On a class with units and no bin.
    """
    out = [0] * len(classes)
    for k, n in enumerate(units):
        members = [i for i, c in enumerate(classes) if c == k]
        if n and not members:
            raise ValueError(f"class {k} has {n} units and no bin")
        for i, share in zip(members, even_split(n, len(members)) if members else ()):
            out[i] = share
    return out
