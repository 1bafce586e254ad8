"""How a train step computes its gradients: one protocol, three strategies.

Every strategy is a `GradientStrategy`: ``gradients(loss_fn, params, batch) -> (loss_sum, weight, grads,
metrics)``, where ``loss_fn(params, batch, par) -> (loss_sum, weight_sum)`` is the model's summed token
loss under a `sharding.parallel.Parallelism`. The sums are divided once by the batch's token count in the
optimizer update (`train.step.Trainer`), so every strategy gives the update of the one-shot batch:

======================  ===================================================================================
`AccumulatedGradients`  the batch in M strided microbatches (row ``r`` in microbatch ``r % M``, so each
                        device's share of a microbatch stays on it), gradients summed over a `jax.lax.scan`
`PipelineGradients`     the model runs its layer stack as a pipeline over ``stage`` (`sharding.pipeline`);
                        the pipeline's M microbatches flow inside one forward and backward pass
`UnevenGradients`       each data-parallel group (a device along ``data`` x ``fsdp`` with its ``tensor``
                        peers) runs its own number of microbatches (uneven data parallelism for devices of
                        different speeds; see the class)
======================  ===================================================================================

`make_strategy` picks the implementation of a `Parallelism`'s strategy. `checked_pipeline` is the
pipeline's compile-time safety check, a pure function returning the plan to use.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding import axes as ax
from sharding.hlo import branch_collectives
from sharding.parallel import (Parallelism, UnevenBatch, gather_shards, only_axes, reduce_shards, spec_axes,
                               to_varying)
from sharding.balance import counts_for_speeds
from sharding.splits import largest_remainder
from train.data import FIELDS

LossFn = Callable[[Any, dict, Parallelism], tuple[jax.Array, jax.Array]]
"""``loss_fn(params, batch, par) -> (loss_sum, weight_sum)``: float32 scalars (nats, tokens)."""


class GradientStrategy(Protocol):
    """Computes the summed loss, token count and gradients of one global batch (inside jit)."""

    par: Parallelism

    def gradients(self, loss_fn: LossFn, params, batch: dict) -> tuple[jax.Array, jax.Array, Any, dict]:
        """``(loss_sum, weight_sum, grads, metrics)``: float32 scalars, gradient sums shaped as ``params``,
        and extra metrics of the strategy (e.g. microbatches processed per device)."""
        ...


class AccumulatedGradients:
    """Gradient accumulation over ``par.strategy.microbatches`` strided microbatches (1: none)."""

    def __init__(self, par: Parallelism):
        self.par = par
        self.microbatches = par.strategy.microbatches

    def gradients(self, loss_fn: LossFn, params, batch: dict):
        grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, b, self.par), has_aux=True)
        m = self.microbatches
        if m == 1:
            (loss_sum, weight), grads = grad_fn(params, batch)
            return loss_sum, weight, grads, {}

        def split(x):
            return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

        def body(carry, micro):
            loss_acc, weight_acc, grad_acc = carry
            (loss_sum, weight), grads = grad_fn(params, micro)
            return (loss_acc + loss_sum, weight_acc + weight, jax.tree.map(jnp.add, grad_acc, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, weight, grads), _ = jax.lax.scan(body, init, jax.tree.map(split, batch))
        return loss_sum, weight, grads, {}


class PipelineGradients:
    """The pipeline: the model runs its layers through `sharding.pipeline.run_pipeline` under ``par``,
    whose strategy is the `sharding.pipeline.PipelinePlan`; its microbatches flow inside the pass."""

    def __init__(self, par: Parallelism):
        self.par = par

    def gradients(self, loss_fn: LossFn, params, batch: dict):
        (loss_sum, weight), grads = jax.value_and_grad(lambda p: loss_fn(p, batch, self.par), has_aux=True)(params)
        return loss_sum, weight, grads, {}


class UnevenGradients:
    """Uneven data parallelism: devices of a faster kind run more microbatches per step.

    Each data-parallel group ``i`` along the batch axes (``data`` x ``fsdp``: one device, or with ``tensor`` in
    the mesh the devices of one tensor group) runs ``counts[i]`` microbatches of ``microbatch_rows`` sequences
    per step, inside one SPMD program. The counts are an input of the
    compiled step (int32 ``[devices]``, replicated), so they can change between steps without recompiling:

    1. The global batch ``[B, T]`` (``B = sum(counts) * microbatch_rows``, laid out as the uniform step
       lays it out) is re-laid inside the step into a padded per-device buffer of ``capacity *
       microbatch_rows`` rows (`uneven_row_index`, computed on device from the counts): device ``i`` gets
       ``counts[i]`` consecutive microbatches, then padding it never reads. ``capacity`` is static
       (`sharding.balance.default_capacity` or ``--hetero-max-share``); counts above it are not allowed.
    2. Inside `jax.shard_map` manual over ``data`` and ``fsdp`` (``tensor`` stays automatic, as in the
       pipeline's stage program), each group gathers the parameters it holds an FSDP shard of once, marks
       them device-varying over the batch axes (`sharding.parallel.to_varying`) so that `jax.grad` inserts
       no collective over them, and loops ``counts[i]`` times (a ``while`` loop whose trip count is a
       per-group input), summing token-level loss and gradients under ``par.inside((data, fsdp))``. No
       collective over the batch axes runs inside the loop: with per-group trip counts one would deadlock
       (GUIDE.md, pitfalls). GSPMD's ``tensor`` collectives do run inside it, among the devices of one
       tensor group, which all run the group's one count, so they stay matched.
    3. After the loop, one reduction: a ``psum`` over the batch axes (``psum_scatter`` over ``fsdp`` for
       sharded parameters). Divided by the global token count as the uniform step divides it, the update
       equals the uniform-batch update, whatever the counts: the set of rows is the same, only the
       summation order differs.

    Metrics: ``microbatches`` (the total processed), ``processed``, int32 ``[groups along data x fsdp]``
    (each group's loop counter), and when rebalancing (``rebalance_every`` > 0) ``local_seconds``, float32
    ``[groups]``, each group's loop time in seconds (host clock read by a callback before the loop and
    after each microbatch); both replicated (gathered once after the loop). Layouts: meshes that split
    ``data``, ``fsdp`` and ``tensor`` only, with any rules over them (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``);
    `check_uneven` refuses the rest. Shares
    proportional to speed follow HAP (EuroSys'24), Metis (USENIX ATC'24) and FlashFlex (2024).

    Args:
      par: The run's layout, strategy `UnevenBatch` with resolved counts (the default input).
      param_specs: The parameters' `PartitionSpec`s (a tree shaped as the params).
    """

    def __init__(self, par: Parallelism, param_specs):
        from sharding.balance import default_capacity

        self.par = par
        strategy = par.strategy
        self.counts = tuple(strategy.counts)
        self.capacity = strategy.capacity or default_capacity(sum(self.counts), len(self.counts), self.counts)
        self.param_specs = param_specs
        self.batch_axes = tuple(a for a in ax.BATCH_MESH_AXES if par.mesh_shape[a] > 1)
        # The map is manual over the batch axes only; tensor stays automatic (GSPMD partitions each layer).
        self.manual = tuple(a for a in ax.BATCH_MESH_AXES if a in par.mesh.axis_names)
        self.manual_specs = jax.tree.map(lambda s: only_axes(s, self.manual), param_specs,
                                         is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.timed = strategy.rebalance_every > 0

    def gradients(self, loss_fn: LossFn, params, batch: dict, counts: jax.Array | None = None):
        """As `GradientStrategy.gradients`; ``counts``: int32 ``[groups]`` microbatches per data-parallel
        group, each at most ``capacity``, summing to ``sum(self.counts)`` (default: ``self.counts``)."""
        mesh, spec = self.par.mesh, PartitionSpec(self.batch_axes or None)
        rows = next(iter(batch.values())).shape[0]
        microbatch_rows = rows // sum(self.counts)
        if counts is None:
            counts = jnp.asarray(np.asarray(self.counts, np.int32))
        index = uneven_row_index(counts, microbatch_rows, self.capacity)
        sharding = NamedSharding(mesh, spec)
        padded = {f: jax.lax.with_sharding_constraint(jnp.take(batch[f], index.reshape(-1), axis=0), sharding)
                  for f in FIELDS}
        counts = jax.lax.with_sharding_constraint(counts, sharding)
        run = jax.shard_map(
            lambda p, b, c: self._local(loss_fn, p, b, c, microbatch_rows), mesh=mesh,
            in_specs=(self.manual_specs, {f: spec for f in FIELDS}, spec),
            out_specs=(PartitionSpec(), PartitionSpec(), self.manual_specs, PartitionSpec()),
            axis_names=set(self.manual),
        )
        loss_sum, weight, grads, per_device = run(params, padded, counts)
        return loss_sum, weight, grads, {"microbatches": jnp.sum(per_device["processed"]), **per_device}

    def _local(self, loss_fn: LossFn, params, buffer, count, mb: int):
        """Per-group body: gather, mark varying, loop over this group's microbatches, reduce once.

        When timed (``rebalance_every`` > 0), a host clock is read before the loop and after each
        microbatch (`_clock`, a callback with a data dependence on the work, so it cannot move past the
        reduction); the loop's seconds are returned as ``local_seconds``."""
        varying, local = self.batch_axes, self.par.inside(self.manual)
        full = jax.tree.map(lambda p, s: to_varying(gather_shards(p, s), varying), params, self.manual_specs)
        grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, b, local), has_aux=True)
        timed = self.timed

        def body(carry):
            i, loss_acc, weight_acc, grad_acc, t_last = carry
            micro = {f: jax.lax.dynamic_slice_in_dim(x, i * mb, mb, axis=0) for f, x in buffer.items()}
            (loss_sum, weight), grads = grad_fn(full, micro)
            loss_acc = loss_acc + loss_sum
            # the clock waits for this microbatch's loss and every gradient leaf (one element of each)
            after = (loss_acc, [jnp.ravel(g)[0] for g in jax.tree.leaves(grads)])
            t_last = self._clock(after) if timed else t_last
            return i + 1, loss_acc, weight_acc + weight, jax.tree.map(jnp.add, grad_acc, grads), t_last

        zero = to_varying(jnp.zeros((), jnp.float32), varying)
        t_start = self._clock(buffer["tokens"][0, 0].astype(jnp.float32)) if timed else zero
        init = (to_varying(jnp.zeros((), jnp.int32), varying), zero, zero,
                jax.tree.map(lambda p: to_varying(jnp.zeros(p.shape, p.dtype), varying), full), t_start)
        processed, loss_sum, weight, grads, t_end = jax.lax.while_loop(lambda c: c[0] < count[0], body, init)
        # The one reduction of the step, after every device has left its loop.
        loss_sum = jax.lax.psum(loss_sum, varying)
        weight = jax.lax.psum(weight, varying)
        grads = jax.tree.map(lambda g, s: reduce_shards(g, s, varying), grads, self.manual_specs)
        per_device = {"processed": processed.reshape(1)}
        if timed:
            per_device["local_seconds"] = jnp.mod(t_end - t_start, _CLOCK_WRAP).reshape(1)
        return loss_sum, weight, grads, {k: _replicate(v, varying) for k, v in per_device.items()}


    def _clock(self, after) -> jax.Array:
        """`_clock` from inside the map (manual over the batch axes only). JAX runs a callback only where
        every mesh axis is manual, so it is read under a nested `jax.shard_map` over the other axes; with
        ``tensor`` split, the group's latest reading (a ``pmax`` among the devices of one tensor group,
        which all run the group's count: no deadlock)."""
        mesh = jax.sharding.get_abstract_mesh()
        rest = tuple(a for a in mesh.axis_names if a not in self.manual)
        if not rest:
            return _clock(after)
        split = tuple(a for a in rest if self.par.mesh_shape[a] > 1)

        def read(x):
            t = _clock(x)
            return jax.lax.pmax(t, split) if split else t

        specs = jax.tree.map(lambda _: PartitionSpec(), after)
        return jax.shard_map(read, mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec(), axis_names=set(rest))(after)


def _replicate(value, axes: tuple[str, ...]):
    """``[devices along axes]``, each device's one-element ``value`` at its index, the same on every device
    (a ``psum`` of one-hot rows: its result is known to be replicated, an ``all_gather``'s is not)."""
    if not axes:
        return value
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    rows = jnp.zeros((n,), value.dtype).at[jax.lax.axis_index(axes)].set(value[0])
    return jax.lax.psum(rows, axes)


_CLOCK_WRAP = 1024.0
"""The host clock is read modulo this many seconds, so float32 keeps ~6e-5 s resolution; a device's loop
must take less than this (durations are taken modulo it)."""


def _host_seconds(_after):
    return np.float32(time.perf_counter() % _CLOCK_WRAP)


def _clock(after) -> jax.Array:
    """float32 host seconds (modulo `_CLOCK_WRAP`), read once the arrays ``after`` are computed (a callback,
    not a collective; on accelerators it waits for the device's stream, microseconds per call)."""
    return jax.pure_callback(_host_seconds, jax.ShapeDtypeStruct((), jnp.float32), after)


def uneven_row_index(counts, microbatch_rows: int, capacity: int):
    """``[devices, capacity * microbatch_rows]`` int32: the rows of the global batch each device holds.

    Device ``i`` holds microbatches ``sum(counts[:i]) .. sum(counts[:i+1]) - 1`` (rows in order), then row
    0 as padding it never reads. Works on device (inside jit, ``counts`` traced) and on NumPy input.

    Args:
      counts: int32 ``[devices]``, each at most ``capacity``.
      microbatch_rows: Sequences per microbatch.
      capacity: Microbatches the buffer holds per device (static).
    """
    counts = jnp.asarray(counts, jnp.int32)
    starts = (jnp.cumsum(counts) - counts) * microbatch_rows
    slot = jnp.arange(capacity * microbatch_rows, dtype=jnp.int32)
    return jnp.where(slot[None, :] < counts[:, None] * microbatch_rows, starts[:, None] + slot[None, :], 0)


def make_strategy(par: Parallelism, param_specs) -> GradientStrategy:
    """The `GradientStrategy` of ``par.strategy`` (``param_specs``: the parameters' `PartitionSpec`s)."""
    if par.pipeline is not None:
        return PipelineGradients(par)
    if isinstance(par.strategy, UnevenBatch):
        return UnevenGradients(par, param_specs)
    return AccumulatedGradients(par)


# Checks and resolution ---------------------------------------------------------------------------


def checked_pipeline(par: Parallelism, compiled_text: str) -> tuple[Parallelism, str | None]:
    """The pipeline plan to use, after making sure no stage can wait on another inside a skipped slot.

    The pipeline skips empty slots with conditionals that stages take differently. Collectives GSPMD puts
    inside a layer are normally among devices of one stage, but if it chose one that could involve other
    stages (a ``collective-permute``), devices would wait forever. Then the plan falls back to computing
    every slot (`PipelinePlan.skip_empty` False).

    Args:
      par: The run's layout (a pipeline strategy).
      compiled_text: ``compiled.as_text()`` of a step compiled with ``par``.

    Returns:
      ``(par, note)``: ``par`` itself and None when safe; else the fallback layout and a line saying why.
    """
    plan = par.pipeline
    if plan is None or not plan.skip_empty:
        return par, None
    unsafe = [c for c in branch_collectives(compiled_text, par.mesh) if not c.safe]
    if not unsafe:
        return par, None
    ops = ", ".join(sorted({f"{c.op} ({c.name})" for c in unsafe}))
    note = (f"pipeline: the partitioner put {ops} inside a skipped layer slot, where stages that skip it would "
            f"leave others waiting; this run computes every slot instead (empty slots cost compute too)")
    return par.replace(strategy=dataclasses.replace(plan, skip_empty=False)), note


def batch_groups(mesh) -> list[list[Any]]:
    """The data-parallel groups along ``data`` x ``fsdp`` (data-major: the order of uneven counts), each the
    devices that share its batch rows and run its one count (its ``tensor`` peers, in mesh order; one device
    on a mesh over ``data`` and ``fsdp`` only)."""
    names = list(mesh.axis_names)
    batch = [names.index(a) for a in ax.BATCH_MESH_AXES if a in names]
    order = batch + [i for i in range(len(names)) if i not in batch]
    devices = np.asarray(mesh.devices).transpose(order)
    groups = math.prod(devices.shape[:len(batch)])
    return [list(row) for row in devices.reshape(groups, -1)]


def batch_grid(mesh) -> list[Any]:
    """The first device of each data-parallel group (`batch_groups`), in the order of uneven counts."""
    return [group[0] for group in batch_groups(mesh)]


def slowest_of_groups(values: Sequence[float], groups: Sequence[Sequence[Any]], larger_is_slower: bool) -> list[float]:
    """One figure per data-parallel group from one per device (``values`` in the order of
    ``[d for g in groups for d in g]``): the slowest member's, since a group's devices meet in its tensor
    collectives after every layer and run one count.

    Args:
      values: A speed (larger_is_slower False, e.g. FLOP/s) or a time (True, e.g. seconds per microbatch).
      groups: `batch_groups`.
      larger_is_slower: Whether a larger value is slower.
    """
    out, start = [], 0
    for group in groups:
        members = values[start:start + len(group)]
        out.append(max(members) if larger_is_slower else min(members))
        start += len(group)
    return out


def device_speeds(mesh, simulated: Mapping[int, Any] | None = None) -> list[float]:
    """Peak FLOP/s of each data-parallel group along the batch axes (its slowest device's: the group runs
    one count), in the order of the uneven counts.

    Args:
      mesh: The `jax.sharding.Mesh`.
      simulated: ``device.id -> DeviceKind`` from `sharding.devices.simulate_inventory`.

    Raises:
      ValueError: When a device's peak is unknown (e.g. CPU without ``--simulate-cluster``).
    """
    from sharding.devices import peak_flops

    speeds, groups = [], batch_groups(mesh)
    for device in (d for group in groups for d in group):
        peak = peak_flops(device, simulated)
        if peak is None:
            raise ValueError(
                f"--hetero-batch kinds: the peak speed of device {device.id} ({device.device_kind}) is unknown; "
                f"give --simulate-cluster (e.g. h100:4,a100:4), measure with --hetero-batch auto, or give counts "
                f"(--hetero-batch 3,3,3,3,1,1,1,1)"
            )
        speeds.append(peak)
    return slowest_of_groups(speeds, groups, larger_is_slower=False)


def resolve_uneven(par: Parallelism, mesh, simulated=None) -> tuple[Parallelism, list[float] | None]:
    """Resolves ``--hetero-batch kinds`` into counts from the devices' datasheet speeds (``auto`` measures
    them instead: `train.calibrate`).

    Returns:
      ``(par, speeds)``: ``par`` with `UnevenBatch.counts` set (unchanged when given or not uneven), and
      the speeds used (None when not resolved here).

    Raises:
      ValueError: As `device_speeds`.
    """
    strategy = par.strategy
    if not isinstance(strategy, UnevenBatch) or strategy.counts is not None:
        return par, None
    speeds = device_speeds(mesh, simulated)
    total = strategy.microbatches * par.data_parallel
    counts = tuple(counts_for_speeds(speeds, total))
    return par.replace(strategy=dataclasses.replace(strategy, counts=counts)), speeds


def describe_uneven(counts: Sequence[int], microbatch_rows: int, speeds: Sequence[float] | None = None,
                    capacity: int | None = None) -> str:
    """One line: counts per device (with speeds when known) and the padded buffer size (microbatches)."""
    from sharding.balance import default_capacity

    parts = [f"{c}" + (f" ({s / 1e12:.0f} TFLOP/s)" if speeds else "")
             for c, s in zip(counts, speeds or [None] * len(counts))]
    capacity = capacity or default_capacity(sum(counts), len(counts), counts)
    return (f"uneven data parallelism: microbatches of {microbatch_rows} sequences per device "
            f"{', '.join(parts)}; padded buffer {capacity} microbatches per device")


__all__ = ["AccumulatedGradients", "GradientStrategy", "PipelineGradients", "UnevenGradients", "batch_grid", "batch_groups",
           "check_uneven", "checked_pipeline", "describe_uneven", "device_speeds", "make_strategy", "resolve_uneven",
           "slowest_of_groups", "uneven_row_index"]


def check_uneven(par: Parallelism, param_names, abstract_params, global_batch: int | None = None) -> None:
    """Uneven counts against the mesh, the rules and the batch, before any device work.

    Counts are one per data-parallel group (``data`` x ``fsdp``); with ``tensor`` in the mesh every device
    of a tensor group runs its group's count, so the group's tensor collectives inside the microbatch loop
    stay matched.

    Args:
      par: The run's layout (strategy `UnevenBatch`; counts may still be unresolved).
      param_names, abstract_params: The model's parameters' logical names and shapes.
      global_batch: ``--batch-size``, checked against resolved counts when given.

    Raises:
      ValueError: A mesh that splits ``stage`` or ``sequence``; rules that split a parameter over another
        axis; counts given per device that differ inside a tensor group, or any other number of counts than
        the data-parallel groups along ``data`` x ``fsdp``; a batch that the counts' microbatches do not
        divide. Each names the flag and a value that works.
    """
    from sharding.rules import logical_to_spec

    strategy = par.strategy
    allowed = (*ax.BATCH_MESH_AXES, ax.TENSOR)
    others = [f"{a}={n}" for a, n in par.mesh_shape.items() if a not in allowed and n > 1]
    groups = par.data_parallel
    if others:
        raise ValueError(f"--hetero-batch supports meshes over data, fsdp and tensor only; --mesh splits "
                         f"{', '.join(others)}. Use e.g. --mesh data={groups} --rules dp, or --hetero-batch off")
    for names, leaf in zip(jax.tree.leaves(param_names, is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(abstract_params), strict=True):
        spec, _ = logical_to_spec(tuple(names), par.rules, leaf.shape, par.mesh_shape)
        used = {a for entry in spec for a in spec_axes(entry)}
        if used - set(allowed):
            raise ValueError(f"--hetero-batch supports the dp, fsdp, tp and fsdp_tp rules; --rules {par.rules.name} "
                             f"splits parameters over {', '.join(sorted(used))}. Use --rules fsdp_tp")
    if strategy.counts is None:
        return
    counts = strategy.counts
    given = ",".join(map(str, counts))
    tensor = par.mesh_shape[ax.TENSOR]
    if tensor > 1 and len(counts) == groups * tensor:
        per_group = [counts[i:i + tensor] for i in range(0, len(counts), tensor)]
        split = next((g for g in per_group if len(set(g)) > 1), None)
        example = ",".join(str(g[0] if split is None else max(1, round(sum(g) / tensor))) for g in per_group)
        what = (f"counts {','.join(map(str, split))} split a tensor group of {tensor} devices, which must run one "
                f"count" if split is not None else f"{len(counts)} counts are one per device")
        raise ValueError(f"--hetero-batch {given}: {what}; give one count per data-parallel group (the {groups} "
                         f"along data x fsdp, each shared by its {tensor} tensor devices), e.g. --hetero-batch "
                         f"{example}")
    if len(counts) != groups:
        example = ",".join(map(str, largest_remainder(max(sum(counts), groups), [1.0] * groups)))
        raise ValueError(f"--hetero-batch {given}: {len(counts)} counts for the {groups} devices "
                         f"along data x fsdp; give one per device, e.g. --hetero-batch {example}")
    if strategy.capacity is not None and strategy.capacity < max(counts):
        raise ValueError(f"--hetero-max-share {strategy.capacity} is below the largest of --hetero-batch "
                         f"{given}; e.g. --hetero-max-share {max(counts)}")
    if global_batch is not None and global_batch % sum(counts):
        total = sum(counts)
        raise ValueError(f"--batch-size {global_batch} is not divisible by the {total} microbatches of --hetero-batch "
                         f"{given}; e.g. --batch-size {total * max(1, global_batch // total)}")
