"""How many microbatches each device of an uneven data-parallel step runs: the pure policy (no JAX).

The uneven step (`train.strategies.UnevenGradients`) takes its per-device counts as an input of the
compiled step, so the counts can change between steps without recompiling, as long as no device is given
more than the padded buffer holds (``capacity`` microbatches). This module decides those counts:

* `default_capacity`: the buffer size, fixed at compile time.
* `counts_for_speeds`: counts proportional to speeds (largest remainder, `sharding.splits`), no device
  above the capacity, and shared by pool where devices share one compute resource (the CPU devices of one process share its cores).
* `Rebalancer`: while training, smooths each device's measured seconds per microbatch and every
  ``every`` steps proposes new counts, adopted only when they shorten the predicted step by more than a
  margin (hysteresis), so counts do not oscillate on noise.
* `tokens_for_speeds`: real tokens of a sequence per device of a context-parallel ring
  (``--context-shares``).
* `layers_for_speeds`: layers per pipeline stage from the stages' measured seconds per layer
  (``--stage-layers auto``).

Shares proportional to measured speed follow HAP (EuroSys'24), Metis (USENIX ATC'24) and FlashFlex (2024),
which profile once; here the same rule is applied again to timings taken while training.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from sharding.errors import ConfigError, Field
from sharding.splits import largest_remainder, min_max_assign

CAPACITY_FACTOR = 2
"""Default padded buffer: this many times the mean count per device (a device may run up to twice its
uniform share without recompiling). The buffer holds token ids only (5 int32/float32 fields per row), so
its memory is small next to activations; the loop runs only a device's own count."""


def default_capacity(total: int, devices: int, counts: Sequence[int] | None = None) -> int:
    """Microbatches per device the uneven step's padded buffer holds.

    ``ceil(CAPACITY_FACTOR * total / devices)``, raised to ``max(counts)`` when given counts need more,
    and never above ``total`` (one device running everything).

    Args:
      total: Microbatches per step over all devices (>= 1).
      devices: Devices along ``data`` x ``fsdp`` (>= 1).
      counts: The first counts, if known.

    Raises:
      ValueError: On ``total`` or ``devices`` below 1.
    """
    if total < 1 or devices < 1:
        raise ValueError(f"need at least one microbatch and one device, got {total} over {devices}")
    capacity = math.ceil(CAPACITY_FACTOR * total / devices)
    if counts:
        capacity = max(capacity, max(counts))
    return min(capacity, total)


def counts_for_speeds(
    speeds: Sequence[float], total: int, capacity: int | None = None, pools: Sequence[int] | None = None
) -> list[int]:
    """Microbatches per device in proportion to ``speeds`` (largest remainder), capped at ``capacity``.

    Microbatches a capped device cannot take go to the others in proportion to their speeds. (With
    ``tensor`` in the mesh the "devices" here are data-parallel groups: `train.strategies.batch_groups`.)

    Args:
      speeds: One positive speed per device (any unit: microbatches/s, FLOP/s).
      total: Microbatches to share (>= 0).
      capacity: The most one device may run (None: no cap).
      pools: One pool label per device (None: each device its own pool). Devices of one pool share a
        compute resource, so the pool's time is the sum of its counts times its seconds per microbatch:
        the microbatches are shared between pools in proportion to their summed speeds, then evenly
        inside each pool. (A pool's devices each carry the pool's figure for running one microbatch on
        every device at once, as `train.setup.calibrate` measures CPU devices.)

    Returns:
      One count per device; they sum to ``total``.

    Raises:
      ValueError: On a speed that is not positive, or a ``total`` the capacity cannot hold.
    """
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    if pools is not None and len(pools) != len(speeds):
        raise ValueError(f"{len(pools)} pool labels for {len(speeds)} devices")
    labels = list(range(len(speeds))) if pools is None else list(pools)
    order = list(dict.fromkeys(labels))
    members = {p: [i for i, q in enumerate(labels) if q == p] for p in order}
    if capacity is not None and capacity * len(speeds) < total:
        raise ValueError(f"{total} microbatches do not fit {len(speeds)} devices of capacity {capacity}")
    caps = None if capacity is None else [capacity * len(members[p]) for p in order]
    shares = _capped_shares(total, [sum(speeds[i] for i in members[p]) for p in order], caps)
    counts = [0] * len(speeds)
    for p, share in zip(order, shares):
        for i, c in zip(members[p], largest_remainder(share, [1.0] * len(members[p]))):
            counts[i] = c
    return counts


def tokens_for_speeds(
    length: int, speeds: Sequence[float], pools: Sequence[int] | None = None, unit: int = 2
) -> tuple[int, ...]:
    """Real tokens of one sequence per device of a ring, in proportion to ``speeds`` (uneven sequence
    shards, ``--context-shares``), in whole units of ``unit`` tokens (2: one per zigzag chunk).

    Args:
      length: Tokens per sequence, a multiple of ``unit``.
      speeds: One positive speed per ring device (any unit), or relative shares.
      pools: As `counts_for_speeds` (CPU devices of one process share its cores).
      unit: Tokens per indivisible piece.

    Returns:
      One even token count per device, summing to ``length``.

    Raises:
      ValueError: On a speed that is not positive or a length not a multiple of ``unit``.
    """
    if length % unit:
        raise ValueError(f"a sequence of {length} tokens is not a whole number of {unit}-token units")
    return tuple(unit * c for c in counts_for_speeds(speeds, length // unit, pools=pools))


def _capped_shares(total: int, weights: Sequence[float], cap) -> list[int]:
    """Largest-remainder shares, bins above their cap (one int for all, a list per bin, or None) fixed
    at it and the rest re-shared."""
    caps = cap if isinstance(cap, (list, tuple)) else [cap] * len(weights)
    fixed: dict[int, int] = {}
    while True:
        free = [i for i in range(len(weights)) if i not in fixed]
        rest = total - sum(fixed.values())
        shares = dict(zip(free, largest_remainder(rest, [weights[i] for i in free]))) if free else {}
        over = [i for i, n in shares.items() if caps[i] is not None and n > caps[i]]
        if not over:
            return [fixed.get(i, shares.get(i, 0)) for i in range(len(weights))]
        for i in over:
            fixed[i] = caps[i]


def layers_for_speeds(num_layers: int, layer_seconds: Sequence[float], fixed_layers: float = 0.0) -> tuple[int, ...]:
    """Layers per pipeline stage minimizing the slowest stage's time, at least one each.

    Stage ``s`` holding ``n`` layers takes ``layer_seconds[s] * (n + fixed_layers)``: the work every stage
    does besides its layers (its share of the output projection and loss)
    is counted as ``fixed_layers`` layers. The split is the min-max greedy (`sharding.splits.min_max_assign`),
    which is optimal for costs that grow with the layers; ties go to the lower stage index.

    Args:
      num_layers: L, the model's layers (>= number of stages).
      layer_seconds: Seconds per layer of each stage (its slowest device), any common unit.
      fixed_layers: Per-stage work besides the layers, in layers (>= 0).

    Returns:
      Layers per stage, summing to ``num_layers``.

    Raises:
      ValueError: Fewer layers than stages, or a time that is not positive.
    """
    stages = len(layer_seconds)
    if stages < 1 or num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot give each of {stages} stages at least one")
    if any(not t > 0 for t in layer_seconds):
        raise ValueError(f"seconds per layer must be positive, got {list(layer_seconds)}")
    return tuple(min_max_assign(num_layers, [1] * stages, lambda i, n: layer_seconds[i] * (n + fixed_layers)))


def predicted_seconds(counts: Sequence[int], seconds: Sequence[float], pools: Sequence[int] | None = None) -> float:
    """The local part of a step: the slowest device's ``count x seconds per microbatch``; with ``pools``
    (as `counts_for_speeds` takes them) the slowest pool's summed counts times its seconds per microbatch
    (a device's figure over the pool's size)."""
    if pools is None:
        return max(c * s for c, s in zip(counts, seconds))
    size = {p: list(pools).count(p) for p in pools}
    total = {p: 0.0 for p in pools}
    for c, s, p in zip(counts, seconds, pools):
        total[p] += c * s / size[p]
    return max(total.values())


@dataclasses.dataclass
class Rebalancer:
    """Counts recomputed from smoothed per-microbatch times while training, with hysteresis.

    Each step, `observe` takes every device's count and loop seconds (the uneven step's ``processed`` and
    ``local_seconds``) and updates an exponential moving average of seconds per microbatch (devices that
    ran nothing keep their estimate). Every ``every`` observations `propose` shares the microbatches in
    proportion to the smoothed speeds (`counts_for_speeds`) and adopts them only when the predicted local
    step (`predicted_seconds`) is shorter than the current counts' by more than ``margin``.

    Attributes:
      counts: The counts in force, one per device.
      capacity: The most microbatches one device may run (the step's buffer).
      every: Observations between proposals (``--rebalance-every``, >= 1).
      smoothing: Weight of the newest observation in the average (0 < smoothing <= 1).
      margin: Relative gain below which new counts are not adopted (hysteresis).
      pools: One pool label per device sharing a compute resource, as `counts_for_speeds` takes them
        (None: none). A pool's observation is its slowest device's loop seconds over its summed counts,
        times its size (the figure for one microbatch on every device at once), given to each member.
      seconds: Smoothed seconds per microbatch per device (None until first observed).
    """

    counts: tuple[int, ...]
    capacity: int
    every: int
    smoothing: float = 0.5
    margin: float = 0.05
    pools: tuple | None = None
    seconds: list = dataclasses.field(default_factory=list)
    observed: int = 0

    def __post_init__(self):
        if self.every < 1:
            raise ConfigError(
                Field("rebalance_every", self.every), ": must be >= 1, e.g. ", Field("rebalance_every", 10)
            )
        if not self.seconds:
            self.seconds = [None] * len(self.counts)

    def observe(self, counts: Sequence[int], local_seconds: Sequence[float]) -> None:
        """Folds one step's per-device counts and loop seconds into the smoothed seconds per microbatch."""
        if self.pools is not None:
            counts, local_seconds = _pool_observation(counts, local_seconds, self.pools)
        for i, (c, t) in enumerate(zip(counts, local_seconds, strict=True)):
            if c > 0 and t > 0:
                now = t / c
                old = self.seconds[i]
                self.seconds[i] = now if old is None else (1 - self.smoothing) * old + self.smoothing * now
        self.observed += 1

    def speeds(self) -> list[float] | None:
        """Smoothed microbatches per second per device (unobserved devices: the median of the others), or
        None before any observation."""
        known = sorted(s for s in self.seconds if s is not None)
        if not known:
            return None
        median = known[len(known) // 2]
        return [1.0 / (median if s is None else s) for s in self.seconds]

    def propose(self) -> tuple[int, ...] | None:
        """New counts when due (every ``every`` observations) and better by more than ``margin``, else
        None; adopted counts become `counts`."""
        speeds = self.speeds()
        if speeds is None or self.observed % self.every:
            return None
        seconds = [1.0 / s for s in speeds]
        new = tuple(counts_for_speeds(speeds, sum(self.counts), self.capacity, self.pools))
        if predicted_seconds(new, seconds, self.pools) >= (1 - self.margin) * predicted_seconds(
            self.counts, seconds, self.pools
        ):
            return None
        self.counts = new
        return new


def _pool_observation(counts, local_seconds, pools) -> tuple[list[int], list[float]]:
    """Per device ``(1, pool figure)``: a pool's slowest loop over its summed counts, times its size."""
    counts, local_seconds = list(counts), list(local_seconds)
    if len(counts) != len(pools) or len(local_seconds) != len(pools):
        raise ValueError(f"{len(counts)} counts and {len(local_seconds)} timings for {len(pools)} pooled devices")
    figure = {}
    for p in dict.fromkeys(pools):
        inside = [i for i, q in enumerate(pools) if q == p]
        done = sum(counts[i] for i in inside)
        slowest = max(local_seconds[i] for i in inside)
        figure[p] = len(inside) * slowest / done if done > 0 and slowest > 0 else None
    return ([0 if figure[p] is None else 1 for p in pools], [figure[p] or 0.0 for p in pools])


__all__ = ["CAPACITY_FACTOR", "Rebalancer", "counts_for_speeds", "default_capacity", "predicted_seconds"]
