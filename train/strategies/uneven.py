"""Uneven data parallelism: each data-parallel group runs its own number of microbatches per step.

For devices of different speeds (a heterogeneous cluster, `train.strategies.hetero`): the counts are an
input of the compiled step (a `train.strategies.protocol.StepInput`), resolved at start-up from given
counts, datasheet speeds or measured ones, and optionally rebalanced between steps from the devices' timed
loops (`UnevenGradients.controller`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding import axes as ax
from sharding.balance import Rebalancer as Balance
from sharding.balance import counts_for_speeds, default_capacity
from sharding.parallel import (
    Parallelism,
    counts_of_kinds,
    gather_shards,
    only_axes,
    reduce_shards,
    spec_axes,
    to_varying,
)
from sharding.rules import logical_to_spec
from sharding.splits import largest_remainder
from train.data import FIELDS
from train.strategies.hetero import batch_grid, compute_pools, device_speeds, group_kinds
from train.strategies.protocol import GradientStrategy, LossFn, StepInput


class UnevenGradients(GradientStrategy):
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
       (docs/conventions.md, JAX pitfalls). GSPMD's ``tensor`` collectives do run inside it, among the devices of one
       tensor group, which all run the group's one count, so they stay matched.
    3. After the loop, one reduction: a ``psum`` over the batch axes (``psum_scatter`` over ``fsdp`` for
       sharded parameters). Divided by the global token count as the uniform step divides it, the update
       equals the uniform-batch update, whatever the counts: the set of rows is the same, only the
       summation order differs.

    Metrics: ``microbatches`` (the total processed), ``processed``, int32 ``[groups along data x fsdp]``
    (each group's loop counter), and when rebalancing (``rebalance_every`` > 0) ``local_seconds``, float32
    ``[groups]``, each group's loop time in seconds (host clock read by a callback before the loop and
    after each microbatch); both replicated (gathered once after the loop). A mixture of experts' router
    statistics are summed in the loop and reduced with the loss after it (`GradientStrategy.reports_stats`). Layouts: meshes that split
    ``data``, ``fsdp`` and ``tensor`` only, with any rules over them (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``);
    `check_uneven` refuses the rest. Shares
    proportional to speed follow HAP (EuroSys'24), Metis (USENIX ATC'24) and FlashFlex (2024).

    Args:
      par: The run's layout, strategy `UnevenBatch` with resolved counts (the default input).
      layout: The run's `train.runtime.state.StateLayout` (the parameters' names, shapes and `PartitionSpec`s).

    Raises:
      ValueError: As `check_uneven` (without the batch).
    """

    reports_stats = True

    def __init__(self, par: Parallelism, layout):

        check_uneven(par, layout.param_names, layout.abstract_params)
        param_specs = layout.param_specs()
        super().__init__(par, layout)
        strategy = par.strategy
        self.counts = tuple(strategy.counts)
        self.capacity = strategy.capacity or default_capacity(sum(self.counts), len(self.counts), self.counts)
        self.param_specs = param_specs
        # every batch axis of the mesh, the rules' batch axes too (`check_uneven` refuses rules that differ)
        self.batch_axes = tuple(a for a in ax.BATCH_MESH_AXES if par.mesh_shape[a] > 1)
        # The map is manual over the batch axes only; tensor stays automatic (GSPMD partitions each layer).
        self.manual = tuple(a for a in ax.BATCH_MESH_AXES if a in par.mesh.axis_names)
        self.manual_specs = jax.tree.map(
            lambda s: only_axes(s, self.manual), param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        self.timed = strategy.rebalance_every > 0

    def gradients(self, loss_fn: LossFn, params, batch: dict, inputs=None):
        """As `GradientStrategy.gradients`; ``inputs["counts"]``: int32 ``[groups]`` microbatches per
        data-parallel group, each at most ``capacity``, summing to ``sum(self.counts)`` (absent:
        ``self.counts``)."""
        mesh, spec = self.par.mesh, PartitionSpec(self.batch_axes or None)
        rows = next(iter(batch.values())).shape[0]
        microbatch_rows = rows // sum(self.counts)
        counts = (inputs or {}).get("counts")
        if counts is None:
            counts = jnp.asarray(np.asarray(self.counts, np.int32))
        index = uneven_row_index(counts, microbatch_rows, self.capacity)
        sharding = NamedSharding(mesh, spec)
        padded = {
            f: jax.lax.with_sharding_constraint(jnp.take(batch[f], index.reshape(-1), axis=0), sharding) for f in FIELDS
        }
        counts = jax.lax.with_sharding_constraint(counts, sharding)
        run = jax.shard_map(
            lambda p, b, c: self._local(loss_fn, p, b, c, microbatch_rows),
            mesh=mesh,
            in_specs=(self.manual_specs, {f: spec for f in FIELDS}, spec),
            out_specs=(PartitionSpec(), PartitionSpec(), self.manual_specs, PartitionSpec()),
            axis_names=set(self.manual),
        )
        loss_sum, weight, grads, per_device = run(params, padded, counts)
        stats = self.stats_metrics(per_device.pop("stats"), weight)
        return loss_sum, weight, grads, {"microbatches": jnp.sum(per_device["processed"]), **per_device, **stats}

    def _local(self, loss_fn: LossFn, params, buffer, count, mb: int):
        """Per-group body: gather, mark varying, loop over this group's microbatches, reduce once.

        When timed (``rebalance_every`` > 0), a host clock is read before the loop and after each
        microbatch (`_clock`, a callback with a data dependence on the work, so it cannot move past the
        reduction); the loop's seconds are returned as ``local_seconds``."""
        varying, local = self.batch_axes, self.par.inside(self.manual)
        full = jax.tree.map(lambda p, s: to_varying(gather_shards(p, s), varying), params, self.manual_specs)

        def with_stats(p, b):
            loss_sum, aux = loss_fn(p, b, local)
            return loss_sum, aux if isinstance(aux, tuple) else (aux, {})

        grad_fn = jax.value_and_grad(with_stats, has_aux=True)
        timed = self.timed

        def body(carry):
            i, loss_acc, weight_acc, grad_acc, t_last, stats_acc = carry
            micro = {f: jax.lax.dynamic_slice_in_dim(x, i * mb, mb, axis=0) for f, x in buffer.items()}
            (loss_sum, (weight, stats)), grads = grad_fn(full, micro)
            loss_acc = loss_acc + loss_sum
            # the clock waits for this microbatch's loss and every gradient leaf (one element of each)
            after = (loss_acc, [jnp.ravel(g)[0] for g in jax.tree.leaves(grads)])
            t_last = self._clock(after) if timed else t_last
            grad_acc, stats_acc = jax.tree.map(jnp.add, grad_acc, grads), jax.tree.map(jnp.add, stats_acc, stats)
            return i + 1, loss_acc, weight_acc + weight, grad_acc, t_last, stats_acc

        zero = to_varying(jnp.zeros((), jnp.float32), varying)
        t_start = self._clock(buffer["tokens"][0, 0].astype(jnp.float32)) if timed else zero
        init = (
            to_varying(jnp.zeros((), jnp.int32), varying),
            zero,
            zero,
            jax.tree.map(lambda p: to_varying(jnp.zeros(p.shape, p.dtype), varying), full),
            t_start,
            jax.tree.map(
                lambda a: to_varying(jnp.zeros(a.shape, a.dtype), varying),
                jax.eval_shape(lambda p, b: with_stats(p, b)[1][1], full, {f: x[:mb] for f, x in buffer.items()}),
            ),
        )
        processed, loss_sum, weight, grads, t_end, stats = jax.lax.while_loop(lambda c: c[0] < count[0], body, init)
        # The one reduction of the step, after every device has left its loop.
        loss_sum = jax.lax.psum(loss_sum, varying)
        weight = jax.lax.psum(weight, varying)
        stats = jax.tree.map(lambda v: jax.lax.psum(v, varying), stats)  # router statistics: sums
        grads = jax.tree.map(lambda g, s: reduce_shards(g, s, varying), grads, self.manual_specs)
        per_device = {"processed": processed.reshape(1)}
        if timed:
            per_device["local_seconds"] = jnp.mod(t_end - t_start, _CLOCK_WRAP).reshape(1)
        return loss_sum, weight, grads, {**{k: _replicate(v, varying) for k, v in per_device.items()}, "stats": stats}

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

    # The step's inputs, checks and host side ---------------------------------------------------

    def step_inputs(self) -> tuple[StepInput, ...]:
        """``counts``: int32 ``[groups along data x fsdp]``, replicated; each at most ``capacity``, summing to
        ``sum(self.counts)`` (they change without recompiling the step)."""
        counts, capacity = self.counts, self.capacity

        def check(value):
            if (
                value.shape != (len(counts),)
                or int(value.sum()) != sum(counts)
                or value.min() < 0
                or value.max() > capacity
            ):
                raise ValueError(
                    f"uneven counts {value.tolist()}: need {len(counts)} counts >= 0 summing "
                    f"to {sum(counts)}, each at most --hetero-max-share {capacity}"
                )

        replicated = NamedSharding(self.par.mesh, PartitionSpec())
        return (StepInput("counts", (self.par.data_parallel,), replicated, np.asarray(counts, np.int32), check),)

    def check_batch(self, global_batch: int) -> None:
        check_uneven(self.par, self.layout.param_names, self.layout.abstract_params, global_batch)

    def controller(self):
        """The `RebalanceController` of ``--rebalance-every`` (None without it)."""
        strategy = self.par.strategy
        if not strategy.rebalance_every:
            return None
        return RebalanceController(
            self.counts, self.capacity, strategy.rebalance_every, pools=compute_pools(batch_grid(self.par.mesh))
        )


class RebalanceController:
    """The uneven counts between steps: each step's processed microbatches and loop seconds go to a
    `sharding.balance.Rebalancer`, whose proposals the step after next runs (metrics are read one step late).

    Attributes:
      inputs: The values of the step inputs (``(counts,)``) the next step runs.
    """

    def __init__(self, counts: Sequence[int], capacity: int, every: int, pools=None):

        self.balance = Balance(tuple(counts), capacity, every, pools=pools)
        self.inputs = (self.balance.counts,)

    def observe(self, step: int, values: dict, log) -> None:
        """Feeds a step's per-device counts and loop seconds (``values``: its metrics on the host) and takes
        new counts when proposed, logging them; adds the smoothed speeds (microbatches/s) to ``values``."""
        if "local_seconds" not in values:
            return
        self.balance.observe(values["processed"], values["local_seconds"])
        values["speeds"] = self.balance.speeds()
        new = self.balance.propose()
        if new is not None:
            self.inputs = (new,)
            log(
                f"step {step}: rebalanced uneven counts to {','.join(map(str, new))} (measured microbatches/s "
                f"{', '.join(f'{v:.2f}' for v in values['speeds'])})"
            )


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


def resolve_uneven(par: Parallelism, mesh, simulated=None) -> tuple[Parallelism, list[float] | None]:
    """Resolves ``--hetero-batch kinds`` into counts from the devices' datasheet speeds (``auto`` measures
    them instead: `train.setup.calibrate`).

    Returns:
      ``(par, speeds)``: ``par`` with `UnevenBatch.counts` set (unchanged when given), and
      the speeds used (None when not resolved here).

    Raises:
      ValueError: As `device_speeds`.
    """
    strategy = par.strategy
    if strategy.counts is not None:
        return par, None
    if strategy.kind_counts is not None:
        kinds = group_kinds(mesh, simulated)
        counts, problem, example = counts_of_kinds(dict(strategy.kind_counts), kinds)
        if problem:
            given = ",".join(f"{k}={n}" for k, n in strategy.kind_counts)
            raise ValueError(f"--hetero-batch {given}: {problem}; e.g. --hetero-batch {example}")
        if not any(counts):
            raise ValueError(
                f"--hetero-batch {','.join(f'{k}={n}' for k, n in strategy.kind_counts)}: every data-parallel "
                f"group of this mesh gets 0 microbatches; give its kinds ({', '.join(sorted(set(kinds)))}) a count"
            )
        return par.replace(strategy=dataclasses.replace(strategy, counts=counts)), None
    speeds = device_speeds(mesh, simulated)
    total = strategy.microbatches * par.data_parallel
    counts = tuple(counts_for_speeds(speeds, total))
    return par.replace(strategy=dataclasses.replace(strategy, counts=counts)), speeds


def describe_uneven(
    counts: Sequence[int], microbatch_rows: int, speeds: Sequence[float] | None = None, capacity: int | None = None
) -> str:
    """One line: counts per device (with speeds when known) and the padded buffer size (microbatches)."""
    parts = [
        f"{c}" + (f" ({s / 1e12:.0f} TFLOP/s)" if speeds else "")
        for c, s in zip(counts, speeds or [None] * len(counts))
    ]
    capacity = capacity or default_capacity(sum(counts), len(counts), counts)
    return (
        f"uneven data parallelism: microbatches of {microbatch_rows} sequences per device "
        f"{', '.join(parts)}; padded buffer {capacity} microbatches per device"
    )


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
        axis, or the batch over other axes than every batch axis of the mesh (the step splits it so); counts given per device that differ inside a tensor group, or any other number of counts than
        the data-parallel groups along ``data`` x ``fsdp``; a batch that the counts' microbatches do not
        divide. Each names the flag and a value that works.
    """
    strategy = par.strategy
    allowed = (*ax.BATCH_MESH_AXES, ax.TENSOR)
    others = [f"{a}={n}" for a, n in par.mesh_shape.items() if a not in allowed and n > 1]
    groups = par.data_parallel
    if others:
        raise ValueError(
            f"--hetero-batch supports meshes over data, fsdp and tensor only; --mesh splits "
            f"{', '.join(others)}. Use e.g. --mesh data={groups} --rules dp, or --hetero-batch off"
        )
    # the step's map is manual over every batch axis of the mesh and splits the rows over all of them
    every = tuple(a for a in ax.BATCH_MESH_AXES if par.mesh_shape[a] > 1)
    if set(par.rules.batch_axes(par.mesh_shape)) != set(every):
        ruled = "+".join(par.rules.mesh_axes(ax.BATCH)) or "none"
        raise ValueError(
            f"--hetero-batch splits the batch over every batch axis of the mesh ({'+'.join(every)}); "
            f"--rule batch={ruled} does not. Use --rule batch={'+'.join(every) or 'none'}, or --hetero-batch off"
        )
    for names, leaf in zip(
        jax.tree.leaves(param_names, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(abstract_params),
        strict=True,
    ):
        spec, _ = logical_to_spec(tuple(names), par.rules, leaf.shape, par.mesh_shape)
        used = {a for entry in spec for a in spec_axes(entry)}
        if used - set(allowed):
            raise ValueError(
                f"--hetero-batch supports the dp, fsdp, tp and fsdp_tp rules; --rules {par.rules.name} "
                f"splits parameters over {', '.join(sorted(used))}. Use --rules fsdp_tp"
            )
    if strategy.counts is None:
        return
    counts = strategy.counts
    given = ",".join(map(str, counts))
    tensor = par.mesh_shape[ax.TENSOR]
    if tensor > 1 and len(counts) == groups * tensor:
        per_group = [counts[i : i + tensor] for i in range(0, len(counts), tensor)]
        split = next((g for g in per_group if len(set(g)) > 1), None)
        example = ",".join(str(g[0] if split is None else max(1, round(sum(g) / tensor))) for g in per_group)
        what = (
            f"counts {','.join(map(str, split))} split a tensor group of {tensor} devices, which must run one count"
            if split is not None
            else f"{len(counts)} counts are one per device"
        )
        raise ValueError(
            f"--hetero-batch {given}: {what}; give one count per data-parallel group (the {groups} "
            f"along data x fsdp, each shared by its {tensor} tensor devices), e.g. --hetero-batch "
            f"{example}"
        )
    if len(counts) != groups:
        example = ",".join(map(str, largest_remainder(max(sum(counts), groups), [1.0] * groups)))
        raise ValueError(
            f"--hetero-batch {given}: {len(counts)} counts for the {groups} devices "
            f"along data x fsdp; give one per device, e.g. --hetero-batch {example}"
        )
    if strategy.capacity is not None and strategy.capacity < max(counts):
        raise ValueError(
            f"--hetero-max-share {strategy.capacity} is below the largest of --hetero-batch "
            f"{given}; e.g. --hetero-max-share {max(counts)}"
        )
    if global_batch is not None and global_batch % sum(counts):
        total = sum(counts)
        raise ValueError(
            f"--batch-size {global_batch} is not divisible by the {total} microbatches of --hetero-batch "
            f"{given}; e.g. --batch-size {total * max(1, global_batch // total)}"
        )


__all__ = [
    "RebalanceController",
    "UnevenGradients",
    "check_uneven",
    "describe_uneven",
    "resolve_uneven",
    "uneven_row_index",
]
