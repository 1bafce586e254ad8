"""Measured device speeds for uneven data parallelism (``--hetero-batch auto``).

At start-up each process times its own devices on the uneven step's local work: the forward and backward
pass of one microbatch (``[microbatch_rows, seq_len]``) on whole parameters, with no collective, a few
repetitions after a warm-up. Where one process's devices cannot be timed apart (CPU devices share the
process's cores), they run together and the process's figure applies to each of them; accelerators are
timed one at a time. The figures are exchanged between processes
(`jax.experimental.multihost_utils.process_allgather`), and the counts follow the measured speeds
(`sharding.balance.counts_for_speeds`, largest remainder). ``--hetero-batch kinds`` keeps the device
kinds' datasheet peaks (`train.strategies.resolve_uneven`).

Achieved speed ratios are not peak ratios: an H100 SXM has 3.2x an A100's dense bf16 peak but 1.7x its
memory bandwidth, and hosts throttle; hence measuring (issue 14).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.balance import counts_for_speeds, default_capacity
from sharding.parallel import Parallelism, UnevenBatch
from train.data import FIELDS

REPEATS = 3
"""Timed repetitions of one microbatch per device, after one warm-up (which also compiles)."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured seconds per microbatch of each data-parallel group along ``data`` x ``fsdp`` (the counts'
    order; a group is one device, or with ``tensor`` the devices of one tensor group, paced by its slowest).

    Attributes:
      seconds: Seconds per microbatch (forward and backward), one per group: its slowest device's.
      peaks: Datasheet peak FLOP/s per group (its slowest device's), None where a kind is unknown (e.g. CPU).
      counts: The microbatches per group these speeds give.
    """

    seconds: tuple[float, ...]
    peaks: tuple[float | None, ...]
    counts: tuple[int, ...]

    def lines(self, microbatch_rows: int) -> list[str]:
        """The start-up report: one line per device, measured speed, datasheet speed where known, count."""
        out = [f"measured speeds (--hetero-batch auto; forward+backward of one microbatch of {microbatch_rows} "
               f"sequences per device):"]
        for i, (s, peak, count) in enumerate(zip(self.seconds, self.peaks, self.counts)):
            sheet = f"datasheet {peak / 1e12:.0f} TFLOP/s" if peak else "datasheet n/a"
            out.append(f"  device {i}: {s * 1e3:.1f} ms per microbatch ({1 / s:.2f} microbatches/s), {sheet}, "
                       f"{count} microbatches")
        return out


def local_work(par: Parallelism, loss_fn, abstract_params, microbatch_rows: int, seq_len: int):
    """``(fn, args_on(device))``: the jitted local work and its arguments placed on one device.

    ``fn(params, batch)`` is the gradient of one microbatch's summed loss under ``par.local()`` (no
    annotation, no collective); parameters are zeros of the model's shapes (speed does not depend on
    values), the batch ``[microbatch_rows, seq_len]`` tokens of id 0 with every position counted.
    """
    local = par.local()
    fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, local)[0]))

    def args_on(device):
        params = jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), device), abstract_params)
        shape = (microbatch_rows, seq_len)
        batch = {f: jnp.zeros(shape, jnp.float32 if f == "loss_mask" else jnp.int32) for f in FIELDS}
        batch["loss_mask"] = jnp.ones(shape, jnp.float32)
        batch["positions"] = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), shape)
        batch["segment_ids"] = jnp.ones(shape, jnp.int32)
        return params, jax.device_put(batch, device)

    return fn, args_on


def time_local_devices(fn, args_on, devices: Sequence, together: bool, repeats: int = REPEATS,
                       clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds per microbatch of each of this process's ``devices``.

    Args:
      fn, args_on: As `local_work` returns.
      devices: This process's devices, in order.
      together: Run them all at once and give each the common figure (CPU: devices share the cores);
        else time each alone (accelerators).
      repeats: Timed repetitions after one warm-up.
      clock: Seconds (injectable for tests).
    """
    args = [args_on(d) for d in devices]
    jax.block_until_ready([fn(*a) for a in args])  # warm-up and compile
    if together:
        t0 = clock()
        for _ in range(repeats):
            jax.block_until_ready([fn(*a) for a in args])
        return [(clock() - t0) / repeats] * len(devices)
    out = []
    for a in args:
        t0 = clock()
        for _ in range(repeats):
            jax.block_until_ready(fn(*a))
        out.append((clock() - t0) / repeats)
    return out


def grid_seconds(grid: Sequence, table: np.ndarray, devices: Sequence | None = None) -> list[float]:
    """Each batch-grid device's seconds from ``table[process_index, local_index]`` (every process's
    figures, as `gather_table` returns them); a device's local index is its rank by id among its process's
    ``devices`` (default `jax.devices`), the order `calibrate` times them in."""
    rank: dict[int, int] = {}
    for p in {d.process_index for d in (devices or jax.devices())}:
        mine = sorted((d for d in (devices or jax.devices()) if d.process_index == p), key=lambda d: d.id)
        rank.update({d.id: i for i, d in enumerate(mine)})
    return [float(table[d.process_index, rank[d.id]]) for d in grid]


def gather_table(local: Sequence[float]) -> np.ndarray:
    """``[processes, local devices]`` seconds from every process (one process: just ``local``)."""
    mine = np.asarray(local, np.float64)
    if jax.process_count() == 1:
        return mine[None, :]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)


def calibrate(par: Parallelism, loss_fn, abstract_params, batch_size: int, seq_len: int,
              timer: Callable[..., list[float]] = time_local_devices) -> tuple[Parallelism, Calibration]:
    """Measures the devices and sets ``par``'s uneven counts from the measured speeds.

    Args:
      par: The run's layout bound to a mesh, strategy `UnevenBatch` with ``speeds == "measured"``.
      loss_fn: ``loss_fn(params, batch, par) -> (loss_sum, weight_sum)`` (`train.step.Trainer.loss_sums`).
      abstract_params: The model's parameter shapes (whole, canonical).
      batch_size, seq_len: ``--batch-size`` and ``--seq-len``.
      timer: `time_local_devices` or a stand-in with its signature (tests inject timings).

    Returns:
      ``(par, calibration)``: ``par`` with the counts set, and what was measured.
    """
    from sharding.devices import peak_flops
    from train.strategies import batch_groups, slowest_of_groups

    strategy, mesh = par.strategy, par.mesh
    devices = par.data_parallel
    total = strategy.microbatches * devices
    rows = batch_size // total
    fn, args_on = local_work(par, loss_fn, abstract_params, rows, seq_len)
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    table = gather_table(timer(fn, args_on, local, together=local[0].platform == "cpu"))
    groups = batch_groups(mesh)
    members = [d for group in groups for d in group]
    seconds = slowest_of_groups(grid_seconds(members, table), groups, larger_is_slower=True)
    peaks = [peak_flops(d) for d in members]
    peaks = ([None] * len(groups) if None in peaks else slowest_of_groups(peaks, groups, larger_is_slower=False))
    capacity = strategy.capacity or default_capacity(total, devices)
    counts = tuple(counts_for_speeds([1 / s for s in seconds], total, capacity))
    calibration = Calibration(tuple(seconds), tuple(peaks), counts)
    return par.replace(strategy=dataclasses.replace(strategy, counts=counts, capacity=capacity)), calibration


def resolve_counts(config, par: Parallelism, log) -> tuple[Parallelism, list[float] | None]:
    """Resolves ``--hetero-batch auto`` (measured, logging what was measured) or ``kinds`` (datasheets)
    into counts; ``(par, datasheet speeds or None)``, ``par`` unchanged for any other strategy.

    Raises:
      ValueError: ``kinds`` with a device whose peak is unknown (`train.strategies.device_speeds`).
    """
    from train.plan import cluster_of
    from train.step import Trainer
    from train.strategies import resolve_uneven

    strategy = par.strategy
    if not isinstance(strategy, UnevenBatch) or strategy.counts is not None:
        return par, None
    if strategy.speeds != "measured":
        simulated = cluster_of(config, jax.devices())[1] if config.cluster.simulate_cluster else None
        return resolve_uneven(par, par.mesh, simulated)
    # A trainer of even counts to read the model's loss from; the counts themselves come from the timings.
    even = dataclasses.replace(strategy, counts=(strategy.microbatches,) * par.data_parallel)
    probe = Trainer(config.model, config.optimizer, par.replace(strategy=even))
    par, calibration = calibrate(par, probe.loss_sums, probe.abstract_params, config.data.batch_size,
                                 config.data.seq_len)
    for line in calibration.lines(config.data.batch_size // sum(calibration.counts)):
        log(line)
    return par, None
