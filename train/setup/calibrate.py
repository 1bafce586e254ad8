"""Measured device speeds for uneven data parallelism (``--hetero-batch auto``) and uneven pipeline stages
(``--stage-layers auto``).

At start-up each process times its own devices on the uneven step's local work: the forward and backward
pass of one microbatch (``[microbatch_rows, seq_len]``) on whole parameters, with no collective, a few
repetitions after a warm-up. Where one process's devices cannot be timed apart (CPU devices share the
process's cores), they run together as one program, compiled once, and the process's figure applies to
each of them; accelerators are timed one at a time. The figures are exchanged between processes
(`jax.experimental.multihost_utils.process_allgather`), and the counts follow the measured speeds
(`sharding.balance.counts_for_speeds`, largest remainder; CPU devices of one process share its cores, so
microbatches are shared between processes by speed and evenly inside one: `compute_pools`). ``--hetero-batch kinds`` keeps the device
kinds' datasheet peaks (`train.strategies.resolve_uneven`).

For ``--context-shares auto`` (uneven sequence shards) the same local work is timed on a device's even share
of the length (``seq_len / P`` tokens); a ring position's speed is its slowest device's (over the batch
axes), and the real tokens of a sequence go to the ring's devices by `sharding.balance.tokens_for_speeds`.

For ``--stage-layers auto`` the same local work is timed; a stage's speed is its slowest device's, and the
layers go to the stages by `sharding.balance.layers_for_speeds` (min-max over the stages' predicted times,
the work each stage does besides its layers counted in layers from the model's FLOPs).

Achieved speed ratios are not peak ratios: an H100 SXM has 3.2x an A100's dense bf16 peak but 1.7x its
memory bandwidth, and hosts throttle; hence measuring.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models.spec import describe
from sharding import axes as ax
from sharding.balance import counts_for_speeds, default_capacity, layers_for_speeds, tokens_for_speeds
from sharding.devices import peak_flops, simulate_inventory
from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from sharding.pipeline import plan_layout
from train.data import FIELDS
from train.runtime import step
from train.strategies import batch_grid, batch_groups, compute_pools, resolve_uneven, slowest_of_groups

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
        """The start-up report: one line per data-parallel group, measured speed, datasheet speed where known,
        count."""
        out = [
            f"measured speeds (--hetero-batch auto; forward+backward of one microbatch of {microbatch_rows} "
            f"sequences per device; one line per data-parallel group, a device or a tensor group):"
        ]
        for i, (s, peak, count) in enumerate(zip(self.seconds, self.peaks, self.counts)):
            sheet = f"datasheet {peak / 1e12:.0f} TFLOP/s" if peak else "datasheet n/a"
            out.append(
                f"  group {i}: {s * 1e3:.1f} ms per microbatch ({1 / s:.2f} microbatches/s), {sheet}, "
                f"{count} microbatches"
            )
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


def run_together(fn, args_on, devices: Sequence):
    """``(program, stacked)``: ``fn`` on every one of ``devices`` at once, as one program.

    ``program(*stacked)`` runs ``fn`` under `jax.shard_map` over a one-axis mesh of ``devices``, each device
    on its own ``args_on(device)`` and with no collective; ``stacked`` are those arguments stacked along a
    leading ``[len(devices)]`` axis split over the mesh, and the program returns ``fn``'s results stacked
    the same way. One compilation serves every device, where calling ``fn`` on each device's arguments
    compiles it once per device.

    Args:
      fn: ``fn(*args)`` of one device's arguments (`local_work`'s jitted local work).
      args_on: ``args_on(device)``: the arguments placed on ``device``.
      devices: Devices of this process.
    """
    mesh = jax.sharding.Mesh(np.asarray(devices), ("devices",))
    split = PartitionSpec("devices")
    sharding = NamedSharding(mesh, split)

    def stack(*leaves):
        # Through host memory: reshaping each device's array would compile a program per device and shape.
        blocks = [jax.device_put(np.asarray(x)[None], d) for x, d in zip(leaves, devices)]
        return jax.make_array_from_single_device_arrays((len(devices), *np.shape(leaves[0])), sharding, blocks)

    stacked = jax.tree.map(stack, *(args_on(d) for d in devices))

    def each(*blocks):
        out = fn(*jax.tree.map(lambda x: x[0], blocks))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(each, mesh=mesh, in_specs=split, out_specs=split)), stacked


def time_local_devices(
    fn,
    args_on,
    devices: Sequence,
    together: bool,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds per microbatch of each of this process's ``devices``.

    Together, the devices run one program (`run_together`), compiled once whatever their number; alone,
    ``fn`` runs on each device's arguments in turn, compiled once per device (a single-device executable is
    bound to its device).

    Args:
      fn, args_on: As `local_work` returns.
      devices: This process's devices, in order.
      together: Run them all at once and give each the common figure (CPU: devices share the cores);
        else time each alone (accelerators).
      repeats: Timed repetitions after one warm-up.
      clock: Seconds (injectable for tests).
    """
    if together:
        program, stacked = run_together(fn, args_on, devices)
        jax.block_until_ready(program(*stacked))  # warm-up and compile
        t0 = clock()
        for _ in range(repeats):
            jax.block_until_ready(program(*stacked))
        return [(clock() - t0) / repeats] * len(devices)
    args = [args_on(d) for d in devices]
    jax.block_until_ready([fn(*a) for a in args])  # warm-up and compile
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


def calibrate(
    par: Parallelism,
    loss_fn,
    abstract_params,
    batch_size: int,
    seq_len: int,
    timer: Callable[..., list[float]] = time_local_devices,
) -> tuple[Parallelism, Calibration]:
    """Measures the devices and sets ``par``'s uneven counts from the measured speeds.

    Args:
      par: The run's layout bound to a mesh, strategy `UnevenBatch` with ``speeds == "measured"``.
      loss_fn: ``loss_fn(params, batch, par) -> (loss_sum, weight_sum)`` (`train.runtime.step.Trainer.loss_sums`).
      abstract_params: The model's parameter shapes (whole, canonical).
      batch_size, seq_len: ``--batch-size`` and ``--seq-len``.
      timer: `time_local_devices` or a stand-in with its signature (tests inject timings).

    Returns:
      ``(par, calibration)``: ``par`` with the counts set, and what was measured.
    """
    strategy, mesh = par.strategy, par.mesh
    devices = par.data_parallel
    total = strategy.microbatches * devices
    rows = batch_size // total
    fn, args_on = local_work(par, loss_fn, abstract_params, rows, seq_len)
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    together = local[0].platform == "cpu"
    table = gather_table(timer(fn, args_on, local, together=together))
    groups = batch_groups(mesh)
    members = [d for group in groups for d in group]
    seconds = slowest_of_groups(grid_seconds(members, table), groups, larger_is_slower=True)
    peaks = [peak_flops(d) for d in members]
    peaks = [None] * len(groups) if None in peaks else slowest_of_groups(peaks, groups, larger_is_slower=False)
    capacity = strategy.capacity or default_capacity(total, devices)
    pools = compute_pools(batch_grid(mesh))  # a group's devices live in one process: its first device's pool
    counts = tuple(counts_for_speeds([1 / s for s in seconds], total, capacity, pools=pools))
    calibration = Calibration(tuple(seconds), tuple(peaks), counts)
    return par.replace(strategy=dataclasses.replace(strategy, counts=counts, capacity=capacity)), calibration


@dataclasses.dataclass(frozen=True)
class StageCalibration:
    """Measured seconds per microbatch (whole model, forward and backward) of each pipeline stage's slowest
    device, and the layers per stage they give.

    Attributes:
      seconds: One per stage.
      fixed_layers: Work each stage does besides its layers, in layers (`head_layers`).
      stage_layers: The split.
    """

    seconds: tuple[float, ...]
    fixed_layers: float
    stage_layers: tuple[int, ...]

    def lines(self, microbatch_rows: int) -> list[str]:
        """The start-up report: one line per stage."""
        out = [
            f"measured stage speeds (--stage-layers auto; forward+backward of one microbatch of {microbatch_rows} "
            f"sequences through the whole model, slowest device of each stage; besides its layers each stage "
            f"does the work of {self.fixed_layers:.2f} layers):"
        ]
        for s, (t, n) in enumerate(zip(self.seconds, self.stage_layers)):
            out.append(f"  stage {s}: {t * 1e3:.1f} ms per microbatch ({self.seconds[0] / t:.2f}x stage 0), {n} layers")
        return out


def head_layers(model_config, seq_len: int) -> float:
    """Training FLOPs outside the layer stack (output projection and loss) in layers' worth, per token.

    From `models.spec.describe`: a layer's share of `ModelDescription.flops_per_token` is 6 FLOPs per
    per-layer parameter plus its attention products; the rest is the head.
    """
    desc = describe(model_config)
    layer = 6.0 * sum(p.size for p in desc.params if p.per_layer) + 3 * desc.attention.forward_flops(seq_len)
    return max(desc.flops_per_token(seq_len) - desc.num_layers * layer, 0.0) / layer


def stage_devices(mesh) -> list[list]:
    """Each pipeline stage's devices (the mesh's slices along ``stage``)."""
    devices = np.moveaxis(np.asarray(mesh.devices), list(mesh.axis_names).index(ax.STAGE), 0)
    return [list(devices[s].reshape(-1)) for s in range(devices.shape[0])]


def calibrate_stages(
    par: Parallelism,
    loss_fn,
    abstract_params,
    microbatch_rows: int,
    seq_len: int,
    fixed_layers: float,
    timer: Callable[..., list[float]] = time_local_devices,
) -> tuple[Parallelism, StageCalibration]:
    """Times every device on one microbatch of the whole model and splits the layers over the stages.

    Args:
      par: The run's layout bound to a mesh, its pipeline a gpipe `PipelinePlan` with ``measure_stages``.
      loss_fn, abstract_params: A flat (unpipelined) model's, as `local_work` takes them.
      microbatch_rows, seq_len: One pipeline microbatch's rows per device and ``--seq-len``.
      fixed_layers: `head_layers` of the model.
      timer: `time_local_devices` or a stand-in with its signature (tests inject timings).

    Returns:
      ``(par, calibration)``: ``par`` with the measured split (``measure_stages`` off), and the timings.
    """
    plan = par.pipeline
    fn, args_on = local_work(par.replace(pipeline=None), loss_fn, abstract_params, microbatch_rows, seq_len)
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    table = gather_table(timer(fn, args_on, local, together=local[0].platform == "cpu"))
    seconds = tuple(max(grid_seconds(devices, table)) for devices in stage_devices(par.mesh))
    layers = sum(plan.layout.stage_layers)
    split = layers_for_speeds(layers, [t / (layers + fixed_layers) for t in seconds], fixed_layers)
    layout, _ = plan_layout(layers, len(seconds), 1, split)
    new = dataclasses.replace(plan, layout=layout, measure_stages=False)
    return par.replace(pipeline=new), StageCalibration(seconds, fixed_layers, split)


def resolve_counts(config, par: Parallelism, log) -> tuple[Parallelism, list[float] | None]:
    """Resolves what the layout left to measure or look up at start-up: ``--hetero-batch auto`` (measured,
    logging what was measured, `resolve_measured`) or ``kinds`` (datasheets,
    `train.strategies.resolve_uneven`) into counts, and ``--stage-layers auto`` into a measured stage split
    (`resolve_stages`); ``(par, datasheet speeds or None)``, ``par`` unchanged for any other layout.

    Raises:
      ValueError: ``kinds`` with a device whose peak is unknown (`train.strategies.device_speeds`).
    """
    strategy = par.strategy
    if isinstance(strategy, UnevenBatch):
        if strategy.counts is not None:
            return par, None
        if strategy.speeds == "measured":
            return resolve_measured(config, par, log), None
        simulate = config.cluster.simulate_cluster
        simulated = simulate_inventory(simulate, jax.devices())[1] if simulate else None
        return resolve_uneven(par, par.mesh, simulated)
    if par.pipeline is not None and par.pipeline.measure_stages:
        return resolve_stages(config, par, log), None
    return par, None


def resolve_measured(config, par: Parallelism, log) -> Parallelism:
    """``--hetero-batch auto``: a probe trainer of even counts timed per device, then the counts."""
    strategy = par.strategy
    # A trainer of even counts to read the model's loss from; the counts themselves come from the timings.
    even = dataclasses.replace(strategy, counts=(strategy.microbatches,) * par.data_parallel)
    probe = step.Trainer(config.model, config.optimizer, par.replace(strategy=even))
    par, calibration = calibrate(
        par, probe.loss_sums, probe.state_layout.abstract_params, config.data.batch_size, config.data.seq_len
    )
    for line in calibration.lines(config.data.batch_size // sum(calibration.counts)):
        log(line)
    return par


def resolve_stages(config, par: Parallelism, log) -> Parallelism:
    """``--stage-layers auto``: a flat probe trainer's local work timed per device, then the split."""
    probe = step.Trainer(config.model, config.optimizer, par.replace(pipeline=None))
    rows = config.data.batch_size // (par.pipeline.microbatches * par.data_parallel)
    # The head runs on 1/S of the rows on every stage (`sharding.pipeline.head_parallelism`): its share per stage.
    fixed = head_layers(config.model, config.data.seq_len) / par.pipeline.layout.stages
    par, calibration = calibrate_stages(
        par, probe.loss_sums, probe.state_layout.abstract_params, rows, config.data.seq_len, fixed
    )
    for line in calibration.lines(rows):
        log(line)
    return par


@dataclasses.dataclass(frozen=True)
class ContextCalibration:
    """Measured seconds of each device of the context-parallel ring (its slowest over the batch axes) on
    the local work of an even share of the length, and the real tokens per sequence they give.

    Attributes:
      seconds: One per ring position, in ring order.
      shares: Real tokens of a sequence per ring position (`sharding.balance.tokens_for_speeds`).
    """

    seconds: tuple[float, ...]
    shares: tuple[int, ...]

    def lines(self, rows: int, tokens: int) -> list[str]:
        """The start-up report: one line per ring position."""
        out = [
            f"measured ring speeds (--context-shares auto; forward+backward of {rows} sequences of {tokens} tokens "
            f"per device; slowest device of each ring position):"
        ]
        for i, (t, n) in enumerate(zip(self.seconds, self.shares)):
            out.append(f"  ring device {i}: {t * 1e3:.1f} ms ({self.seconds[0] / t:.2f}x device 0), {n} tokens")
        return out


def ring_devices(mesh, length_axes) -> list[list]:
    """The devices at each position of the context-parallel ring: the mesh's slices along ``length_axes``
    (flattened in their order, as `jax.lax.axis_index` numbers a ring over several axes)."""
    names = list(mesh.axis_names)
    length_axes = [a for a in length_axes if a in names]
    devices = np.moveaxis(np.asarray(mesh.devices), [names.index(a) for a in length_axes], range(len(length_axes)))
    ring = math.prod(mesh.shape[a] for a in length_axes)
    return [list(row) for row in devices.reshape(ring, -1)]


def calibrate_context(
    par: Parallelism,
    loss_fn,
    abstract_params,
    rows: int,
    seq_len: int,
    timer: Callable[..., list[float]] = time_local_devices,
) -> tuple[Parallelism, ContextCalibration]:
    """Times every device on its even share of the length and sets ``par``'s uneven context shares.

    Args:
      par: The run's layout bound to a mesh, ``context_shares == "auto"``.
      loss_fn, abstract_params: As `local_work` takes them.
      rows: Sequences per device (the batch over the batch axes and microbatches).
      seq_len: ``--seq-len``.
      timer: `time_local_devices` or a stand-in with its signature (tests inject timings).

    Returns:
      ``(par, calibration)``: ``par`` with the shares set, and what was measured.
    """
    length_axes = par.rules.mesh_axes(ax.LENGTH)
    local_len = seq_len // par.length_shards
    fn, args_on = local_work(par.replace(context_shares=None), loss_fn, abstract_params, rows, local_len)
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    table = gather_table(timer(fn, args_on, local, together=local[0].platform == "cpu"))
    positions = ring_devices(par.mesh, length_axes)
    seconds = tuple(max(grid_seconds(devices, table)) for devices in positions)
    pools = compute_pools([devices[0] for devices in positions])
    shares = tokens_for_speeds(seq_len, [1 / t for t in seconds], pools=pools)
    return par.replace(context_shares=shares), ContextCalibration(seconds, shares)


def resolve_context_shares(config, par: Parallelism, log) -> Parallelism:
    """``--context-shares auto``: a probe trainer's local work timed per device, then the shares; ``par``
    unchanged otherwise."""
    if par.context_shares != "auto":
        return par
    probe = step.Trainer(
        config.model, config.optimizer, par.replace(strategy=Accumulation(), pipeline=None, context_shares=None)
    )
    rows = max(1, config.data.batch_size // (par.data_parallel * par.microbatches))
    par, calibration = calibrate_context(
        par, probe.loss_sums, probe.state_layout.abstract_params, rows, config.data.seq_len
    )
    for line in calibration.lines(rows, config.data.seq_len // par.length_shards):
        log(line)
    return par
