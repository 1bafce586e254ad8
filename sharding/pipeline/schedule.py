"""The pipeline schedules in one SPMD program: GPipe and circular, with a hand-written backward pass.

See `sharding.pipeline.layout` for the stage layout. At step ``t`` stage ``s`` runs iteration
``i = t - s`` (microbatch ``i % M``, repeat ``i // M``) when ``0 <= i < R*M``, so a pass takes
``R*M + S - 1`` steps of one chunk each. Circular needs ``M >= S`` (a microbatch is back at stage 0
before its next repeat starts).

Empty slots cost memory but no compute: each slot's layer runs inside a `jax.lax.cond` on ``slot <
the stage's own layer count`` (bubble steps count 0), forward and backward.

Backward pass. `_pipeline_program` is a `jax.custom_vjp`: its forward keeps
each slot's input, its backward runs the steps in reverse, sends cotangents
up the ring and differentiates each layer with `jax.vjp` (recomputing it, as
``--remat full`` would; the model's remat policy applies inside the layer).
Left to autodiff, the conditionals would save a slice of the stage's
parameters per step as residuals, a copy of them per pipeline step.

SPMD mechanics. `run_pipeline` runs the stage program under `jax.shard_map`
manual over ``stage`` and the batch axes ``data`` and ``fsdp``; ``sequence``
and ``tensor`` stay automatic, so GSPMD still partitions every layer over them
as the logical rules say. Each device runs its own rows of every microbatch.

Weights once per step. Before the step loop each device all-gathers its
stage's FSDP-shards of every slot, in the compute dtype (the activations'),
and after the backward loop it reduce-scatters the layer gradients it summed
over the microbatches (all-reduce over ``data``): one gather and one
reduction per step instead of one per microbatch step (MaxText's
``pipeline_fsdp_ag_once``; all chunks of a circular stage at once, the
per-repeat variant would hold 1/R of them). The backward pass reuses the
forward pass's gathered copy (a residual), so the compiled step gathers once
and the gathered copy lives through the step: ``slots x`` one layer's bytes
per device in temporaries. Activations move to the next stage with one
`jax.lax.ppermute` per step (a ring: the last stage sends to stage 0, which
keeps what it receives for the microbatch's next repeat). No collective over
``stage`` sits inside a cond: the ppermutes run in step loops whose trip
count is the same on every device, and one ``psum`` after the loop hands the
last stage's outputs to every stage. Inputs that are the same on every stage
are cast to stage-varying (`jax.lax.pcast`) before the loop, so their
gradients are reduced once, after it. Collectives GSPMD puts inside a layer
(all-reduces over ``tensor``) involve devices of
one stage, which take the same branch; `sharding.hlo.branch_collectives` checks
the compiled program, and `train.strategies` falls back to computing every slot
(`PipelinePlan.skip_empty` False) if the partitioner put anything else there.

What runs outside the pipeline: the embedding is replicated over ``stage`` (a
gather, no matrix product); the final norm, output projection and loss run on
1/S of the rows per stage (`sharding.pipeline.layout.head_parallelism`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.parallel import gather_shards, only_axes, reduce_shards, spec_axes, to_varying
from sharding.pipeline.layout import PipelinePlan, StageLayout
from sharding.pipeline.storage import StageStorage, storage_for, storage_spec, storage_axes

def to_microbatches(x, microbatches: int):
    """``[batch, ...]`` -> ``[microbatches, batch / microbatches, ...]``, row ``r`` to microbatch ``r % M``.

    Strided rows keep each device's share of every microbatch on that device
    when the batch is split over ``data``/``fsdp`` (as `train.step` does for
    gradient accumulation).
    """
    return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def from_microbatches(x):
    """Inverse of `to_microbatches`."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _index(tree, i):
    import jax

    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _write(buffer, i, value, predicate):
    """``buffer[i] = value`` where ``predicate``, else unchanged (a slice-sized select)."""
    import jax
    import jax.numpy as jnp

    old = jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(predicate, value, old), i, 0)


def _slot_params(params, r, k):
    """Slot ``k`` of chunk ``r`` from leaves ``[R, K, ...]`` (traced indices)."""
    import jax

    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(_index_leaf(w, r), k, keepdims=False), params)


def _index_leaf(w, i):
    import jax

    return jax.lax.dynamic_index_in_dim(w, i, keepdims=False)


def _add_slot(grads, r, k, update):
    """``grads[r, k] += update`` for leaves ``[R, K, ...]`` (a slot-sized update)."""
    import jax
    import jax.numpy as jnp

    def add(acc, d):
        zero = jnp.zeros((), jnp.int32)
        index = (r, k) + (zero,) * (acc.ndim - 2)
        old = jax.lax.dynamic_slice(acc, index, (1, 1, *acc.shape[2:]))
        return jax.lax.dynamic_update_slice(acc, old + d[None, None].astype(acc.dtype), index)

    return jax.tree.map(add, grads, update)


def _chunk_forward(layer_fn, params, r, h, extras, count, skip_empty: bool, save: bool):
    """Applies the first ``count`` of chunk ``r``'s ``K`` layers to ``h``; the other slots do nothing.

    Args:
      layer_fn: ``(layer_params, h, *extras) -> h``.
      params: the stage's parameters, leaves ``[R, K, ...]``.
      r: int32 scalar, the repeat (chunk) to run.
      h: ``[microbatch, ...]`` activations.
      extras: this microbatch's side inputs (positions, segment ids).
      count: int32 scalar, the stage's layer count for the chunk (0 in a bubble step).
      skip_empty: run each slot under a `jax.lax.cond` (slots past ``count``
        are not computed); False computes every slot and selects.
      save: also return each slot's input (for the backward pass).

    Returns:
      ``(h, applied, inputs)``: the activations, the layers computed (int32)
      and, when ``save``, ``[K, microbatch, ...]`` slot inputs (else None).
    """
    import jax
    import jax.numpy as jnp

    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        h, applied = carry

        def apply(h, applied):
            return layer_fn(_slot_params(params, r, k), h, *extras), applied + 1

        if skip_empty:
            out = jax.lax.cond(k < count, apply, lambda h, applied: (h, applied), h, applied)
        else:
            new, applied = apply(h, applied)
            out = (jnp.where(k < count, new, h), applied)
        return out, (h if save else None)

    applied = to_varying(jnp.zeros((), jnp.int32), ax.STAGE)
    (h, applied), inputs = jax.lax.scan(body, (h, applied), jnp.arange(slots))
    return h, applied, inputs


def _chunk_backward(layer_fn, params, r, inputs, extras, count, g, grads, skip_empty: bool):
    """The backward pass of `_chunk_forward`: slots in reverse, each layer recomputed from its saved input.

    Args:
      inputs: ``[K, microbatch, ...]`` slot inputs saved by the forward pass.
      g: cotangent of the chunk's output.
      grads: accumulated parameter cotangents, leaves ``[R, K, ...]``.
      (others as `_chunk_forward`)

    Returns:
      ``(g, grads)``: the cotangent of the chunk's input, and ``grads`` with
      this chunk's slots added. Skipped slots pass ``g`` through and add nothing.
    """
    import jax
    import jax.numpy as jnp

    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        g, grads = carry

        def back(g, grads):
            _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), _slot_params(params, r, k), inputs[k])
            dw, dh = vjp(g)
            return dh, _add_slot(grads, r, k, dw)

        if skip_empty:
            return jax.lax.cond(k < count, back, lambda g, grads: (g, grads), g, grads), None
        _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), _slot_params(params, r, k), inputs[k])
        dw, dh = vjp(g)
        keep = k < count
        dw = jax.tree.map(lambda d: jnp.where(keep, d, jnp.zeros((), d.dtype)), dw)
        return (jnp.where(keep, dh, g), _add_slot(grads, r, k, dw)), None

    (g, grads), _ = jax.lax.scan(body, (g, grads), jnp.arange(slots), reverse=True)
    return g, grads


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Where stage ``stage`` is at step ``t`` (traced scalars); see the module docstring."""

    plan: PipelinePlan
    stage: Any

    @property
    def iterations(self) -> int:
        return self.plan.layout.repeats * self.plan.microbatches

    def at(self, t):
        """``(valid, r, mb)``: whether stage works at step t, its repeat and microbatch."""
        import jax.numpy as jnp

        i = t - self.stage
        m = self.plan.microbatches
        ic = jnp.clip(i, 0, self.iterations - 1)
        return (i >= 0) & (i < self.iterations), ic // m, ic % m

    def returning(self, t):
        """``(arrived, mb)``: whether what stage 0 receives at the end of step t comes back for a later repeat."""
        import jax.numpy as jnp

        layout, m = self.plan.layout, self.plan.microbatches
        j = t - (layout.stages - 1)  # the last stage's iteration at step t
        arrived = (self.stage == 0) & (j >= 0) & (j < self.iterations - m)
        return arrived, jnp.clip(j, 0, self.iterations - 1) % m


def _pipeline_forward(layer_fn, plan: PipelinePlan, params, xs, extras, save: bool):
    """All ``R*M + S - 1`` steps of one stage, forward.

    Args:
      params: the stage's parameters, leaves ``[R, K, ...]``.
      xs: ``[M, microbatch, ...]`` all microbatches (stage-varying).
      extras: ``[M, microbatch, ...]`` side inputs.
      save: return the slot inputs of every step (for `_pipeline_backward`).

    Returns:
      ``(outputs, applied, saved)``: ``[M, microbatch, ...]`` (the outputs on
      the last stage, zeros elsewhere), this device's layer applications
      (int32) and, when ``save``, ``[steps, K, microbatch, ...]`` slot inputs.
    """
    import jax
    import jax.numpy as jnp

    layout = plan.layout
    stages, repeats = layout.stages, layout.repeats
    stage = jax.lax.axis_index(ax.STAGE)
    where = _Schedule(plan, stage)
    counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]  # [R] this stage's chunk sizes
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def step(carry, t):
        state, circ, outputs, applied = carry
        valid, r, mb = where.at(t)
        first = _index_leaf(xs, mb)
        if repeats > 1:  # stage 0 takes microbatch mb back from the ring after its first repeat
            first = jnp.where(r == 0, first, _index_leaf(circ, mb))
        inputs = jnp.where(stage == 0, first, state)
        count = jnp.where(valid, counts[r], 0)
        h, done, saved = _chunk_forward(layer_fn, params, r, inputs, _index(extras, mb), count, plan.skip_empty, save)
        outputs = _write(outputs, mb, h, valid & (stage == stages - 1) & (r == repeats - 1))
        received = jax.lax.ppermute(h, ax.STAGE, ring)
        if repeats > 1:
            arrived, back = where.returning(t)
            circ = _write(circ, back, received, arrived)
        return (received, circ, outputs, applied + done), saved

    zeros = jnp.zeros_like(xs)
    init = (zeros[0], zeros if repeats > 1 else None, zeros, to_varying(jnp.zeros((), jnp.int32), ax.STAGE))
    (_, _, outputs, applied), saved = jax.lax.scan(step, init, jnp.arange(plan.steps))
    return outputs, applied, saved


def _pipeline_backward(layer_fn, plan: PipelinePlan, params, extras, saved, g_outputs, grads):
    """The backward pass of `_pipeline_forward`: steps in reverse, cotangents sent up the ring.

    Each step undoes the forward step: the cotangent of what this stage sent
    comes back from the next stage (``ppermute`` the other way round), the
    chunk's layers are recomputed from their saved inputs and differentiated
    slot by slot (empty slots skipped), and the input's cotangent goes to the
    microbatches (stage 0, first repeat), to the ring buffer (stage 0, later
    repeats) or to the previous stage (next step back).

    Args:
      grads: zero gradient accumulators shaped as ``params`` ``[R, K, ...]`` (in the parameters' dtype).

    Returns:
      ``(grads, g_xs)``: this device's cotangents of the stage's parameters
      ``[R, K, ...]`` (not yet summed over the batch axes) and of ``xs``.
    """
    import jax
    import jax.numpy as jnp

    layout = plan.layout
    stages, repeats = layout.stages, layout.repeats
    stage = jax.lax.axis_index(ax.STAGE)
    where = _Schedule(plan, stage)
    counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]
    back_ring = [((s + 1) % stages, s) for s in range(stages)]

    def step(carry, t):
        g_state, g_circ, grads, g_xs = carry  # g_state: cotangent of what this stage received at step t
        valid, r, mb = where.at(t)
        if repeats > 1:
            arrived, back = where.returning(t)
            g_received = jnp.where(stage == 0, jnp.where(arrived, _index_leaf(g_circ, back), 0), g_state)
            g_circ = _write(g_circ, back, jnp.zeros_like(g_state), arrived)
        else:
            g_received = jnp.where(stage == 0, jnp.zeros_like(g_state), g_state)
        g_out = jax.lax.ppermute(g_received, ax.STAGE, back_ring)
        wrote = valid & (stage == stages - 1) & (r == repeats - 1)
        g_out = g_out + jnp.where(wrote, _index_leaf(g_outputs, mb), 0).astype(g_out.dtype)
        count = jnp.where(valid, counts[r], 0)
        g_in, grads = _chunk_backward(layer_fn, params, r, _index_leaf(saved, t), _index(extras, mb), count, g_out,
                                      grads, plan.skip_empty)
        first = valid & (stage == 0)
        if repeats > 1:
            g_xs = _write(g_xs, mb, _index_leaf(g_xs, mb) + g_in, first & (r == 0))
            g_circ = _write(g_circ, mb, _index_leaf(g_circ, mb) + g_in, first & (r > 0))
        else:
            g_xs = _write(g_xs, mb, _index_leaf(g_xs, mb) + g_in, first)
        return (jnp.where(stage == 0, jnp.zeros_like(g_in), g_in), g_circ, grads, g_xs), None

    zeros = jnp.zeros_like(g_outputs)
    init = (zeros[0], zeros if repeats > 1 else None, grads, zeros)
    (_, _, grads, g_xs), _ = jax.lax.scan(step, init, jnp.arange(plan.steps), reverse=True)
    return grads, g_xs


@dataclasses.dataclass(frozen=True)
class _Weights:
    """How a stage's layer weights are gathered for a pass and their gradients reduced after it.

    Two storages (`run_pipeline` tells them apart by shape): the unpadded `StageStorage` ``[rows, ...]``
    (``storage`` set: each device holds ``q`` whole rows; see `sharding.pipeline.storage`) and the padded
    ``[stages, slots, ...]`` of a `StageLayout` (``storage`` None: each device holds its stage's slots,
    split over the batch axes ``specs`` names).

    Attributes:
      specs: per leaf of the stacked parameters (``[q, ...]`` or ``[1, slots, ...]`` blocks), its
        `PartitionSpec` over the map's manual batch axes (``data``/``fsdp``; the ``stage`` entry and, for
        the storage, the rows entry left out).
      summed: the manual axes the batch is split over: per-device gradients are partial sums over them.
      dtype: the compute dtype the floating weights are gathered in (the activations' dtype).
      storage: the `StageStorage`, or None (padded slots).
      groups: the storage's batch axes besides ``stage`` (`sharding.pipeline.storage.storage_axes`).
    """

    specs: Any
    summed: tuple[str, ...]
    dtype: Any
    storage: StageStorage | None = None
    groups: tuple[str, ...] = ()

    def gather(self, stacked, repeats: int):
        """This device's blocks -> its stage's whole ``[R, K, ...]`` weights in the compute dtype.

        Padded: one all-gather per leaf over its split batch axes. Unpadded: the rows stored for other
        devices move (one ``ppermute`` per distance that moves any), each device picks its slots' rows
        (empty slots zero) and one all-gather over the storage's group axes assembles the working copy.
        """
        import jax
        import jax.numpy as jnp

        def one(w, spec):
            if jnp.issubdtype(w.dtype, jnp.floating):
                w = w.astype(self.dtype)
            w = self._take_slots(w) if self.storage is not None else gather_shards(w, spec)
            return w.reshape(repeats, w.shape[1] // repeats, *w.shape[2:])

        return jax.tree.map(one, stacked, self.specs)

    def _where(self):
        """``(stage, g)``: this device's stage and index along the group axes (traced int32)."""
        import jax
        import jax.numpy as jnp

        stage = jax.lax.axis_index(ax.STAGE)
        return stage, (jax.lax.axis_index(self.groups) if self.groups else jnp.zeros((), jnp.int32))

    def _send(self, x, d: int, back: bool = False):
        """``ppermute`` of ``x`` by ``d`` devices along the ``(stage, *groups)`` ring (``back``: the other way)."""
        import jax

        devices = self.storage.stages * self.storage.groups
        pairs = [(p, (p + d) % devices) for p in range(devices)]
        return jax.lax.ppermute(x, (ax.STAGE, *self.groups), [(b, a) for a, b in pairs] if back else pairs)

    def _take_slots(self, w):
        """``[q, ...]`` rows -> ``[1, R*K', ...]`` this stage's working copy (storage only)."""
        import jax
        import jax.numpy as jnp

        placement = self.storage.placement
        stage, g = self._where()
        parts = [w]
        for d, send in enumerate(placement.sends):
            if send is not None:
                message = jnp.take(w, jnp.asarray(send)[stage, g], axis=0)
                parts.append(self._send(message, d))
        local = jnp.concatenate(parts, axis=0) if len(parts) > 1 else w  # [q + C, ...]
        index = jnp.asarray(placement.local_index)[stage, g]  # [W]
        mine = jnp.take(local, jnp.maximum(index, 0), axis=0)
        mine = jnp.where((index >= 0).reshape(-1, *([1] * (w.ndim - 1))), mine, jnp.zeros((), mine.dtype))
        if not self.groups:
            return mine[None]
        full = jax.lax.all_gather(mine, self.groups, axis=1, tiled=False)  # [W, G, ...]: slot w*G + g
        return full.reshape(1, -1, *w.shape[1:])

    def _return_rows(self, g_slots):
        """The transpose of `_take_slots` for gradients: ``[R*K', ...]`` -> ``[q, ...]``, summed over the group
        axes (reduce-scatter) and sent back to the devices storing the received rows."""
        import jax
        import jax.numpy as jnp

        placement = self.storage.placement
        stage, g = self._where()
        q, groups = placement.per_device, self.storage.groups
        if self.groups:
            g_slots = g_slots.reshape(-1, groups, *g_slots.shape[1:])
            g_slots = jax.lax.psum_scatter(g_slots, self.groups, scatter_dimension=1, tiled=False)  # [W, ...]
        size = q + placement.received
        index = jnp.asarray(placement.local_index)[stage, g]
        local = jnp.zeros((size, *g_slots.shape[1:]), g_slots.dtype)
        local = local.at[jnp.where(index >= 0, index, size)].add(g_slots, mode="drop")
        rows, offset = local[:q], q
        for d, send in enumerate(placement.sends):
            if send is not None:
                count = send.shape[-1]
                back = self._send(local[offset : offset + count], d, back=True)
                rows = rows.at[jnp.asarray(send)[stage, g]].add(back)
                offset += count
        return rows

    def reduce(self, grads, stacked):
        """Whole ``[R, K, ...]`` per-device gradient sums -> the blocks' gradients, summed over ``summed``
        (reduce-scatter over the split axes, all-reduce over the rest), in the blocks' dtype."""
        import jax

        def one(g, w, spec):
            g = g.reshape(1, g.shape[0] * g.shape[1], *g.shape[2:])
            if self.storage is None:
                return reduce_shards(g, spec, self.summed).astype(w.dtype)
            rows = self._return_rows(g[0])
            rest = tuple(a for a in self.summed if a not in self.groups)
            return (jax.lax.psum(rows, rest) if rest else rows).astype(w.dtype)

        return jax.tree.map(one, grads, stacked, self.specs)


def _pipeline_program(layer_fn, plan: PipelinePlan, par, weights: _Weights, remat_policy=None):
    """``f(stacked [1, slots, ...], xs, extras) -> (outputs, applied)`` for one stage, with its own backward pass.

    The stage's weights are gathered once per step, outside the step loop, in the compute dtype
    (`_Weights.gather`; the forward pass's copy is the backward pass's residual and lives through the
    step: the trade-off MaxText calls ``pipeline_fsdp_ag_once``, all chunks of a circular stage at once). The backward pass accumulates each slot's gradient on this device in float32
    (the parameters' dtype) and reduces once, after its loop (`_Weights.reduce`).

    The backward pass is written out (`_pipeline_backward`) rather than left
    to autodiff of the forward loop: the slots' conditionals would make
    autodiff save a slice of the stage's parameters per step as residuals
    (a copy of them per pipeline step), where this saves only each slot's
    input activations, as ``--remat full`` does for an unpipelined stack.
    Every layer is recomputed once in the backward pass (with
    ``remat_policy`` applied inside it) and differentiated by `jax.vjp`.

    The layers get ``par``'s variant for the stage program (``stage`` and the
    batch axes manual, `sharding.parallel.Parallelism.inside`), made while
    tracing the forward and the backward pass alike.
    """
    import jax
    import jax.numpy as jnp

    repeats = plan.layout.repeats

    def bound(fn, *args):
        stage_par = par.inside(_manual_axes(par))
        layer = lambda w, h, *extras: layer_fn(stage_par, w, h, *extras)  # noqa: E731
        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        return fn(layer, plan, *args)

    @jax.custom_vjp
    def program(stacked, xs, extras):
        outputs, applied, _ = bound(_pipeline_forward, weights.gather(stacked, repeats), xs, extras, False)
        return outputs, applied

    def forward(stacked, xs, extras):
        params = weights.gather(stacked, repeats)
        outputs, applied, saved = bound(_pipeline_forward, params, xs, extras, True)
        return (outputs, applied), (stacked, params, extras, saved)

    def backward(residuals, cotangents):
        stacked, params, extras, saved = residuals  # the forward pass's gathered copy: gathered once per step
        # Varying over the batch axes, so that differentiating a layer adds no reduction inside the loop.
        params = to_varying(params, weights.summed)
        zeros = jax.tree.map(lambda p, w: jnp.zeros(p.shape, w.dtype), params, stacked)
        grads, g_xs = bound(_pipeline_backward, params, extras, saved, cotangents[0], to_varying(zeros, (ax.STAGE, *weights.summed)))
        return weights.reduce(grads, stacked), g_xs, jax.tree.map(lambda _: None, extras)

    program.defvjp(forward, backward)
    return program


def _manual_axes(par) -> tuple[str, ...]:
    """The axes the stage program is manual over: ``stage`` and the batch axes (``data``, ``fsdp``)."""
    names = getattr(par.mesh, "axis_names", ())
    return tuple(a for a in (ax.STAGE, *ax.BATCH_MESH_AXES) if a in names)


def _stage_program(stacked, xs, extras, *, layer_fn, plan: PipelinePlan, par, weights: _Weights,
                   remat_policy=None):
    """One stage's program (inside shard_map, manual over ``stage`` and the batch axes).

    Args:
      stacked: this device's block of the stage's parameters, leaves ``[1, slots, ...]``.
      xs: ``[M, microbatch / batch shards, ...]`` this device's rows of every microbatch.
      extras: per-microbatch side inputs ``[M, microbatch / batch shards, ...]`` (or None leaves).

    Returns:
      ``(ys, applied)``: ``[M, microbatch / batch shards, ...]`` outputs of the last stage
      (summed over ``stage`` once, after the loop) and ``[1]`` int32 layer
      applications of this device.
    """
    import jax

    xs, extras = to_varying((xs, extras), ax.STAGE)
    outputs, applied = _pipeline_program(layer_fn, plan, par, weights, remat_policy)(stacked, xs, extras)
    return jax.lax.psum(outputs, ax.STAGE), applied[None]


def run_pipeline(layer_fn: Callable[..., Any], stacked, x, extras: Sequence[Any], par, *, names=None,
                 remat_policy=None):
    """Runs a stacked layer function as a pipeline over the ``stage`` mesh axis.

    The stage program runs under `jax.shard_map`, manual over ``stage`` and the batch axes ``data`` and
    ``fsdp`` (``sequence`` and ``tensor`` stay automatic: GSPMD partitions each layer over them as the
    rules say). Each device gathers its stage's layer weights once per pass, before the step loop, in the
    activations' dtype, and reduces their gradients once, after the backward loop (`_pipeline_program`).

    Args:
      layer_fn: ``(par, layer_params, h, *extras) -> h`` for one layer; ``h`` keeps
        its shape and dtype. ``par`` is the stage program's variant of the run's
        `sharding.parallel.Parallelism` (``stage``, ``data``, ``fsdp`` manual), for its annotations.
      stacked: pytree of the stacked layer parameters, every leaf either ``[rows, ...]`` in the plan
        layout's unpadded `sharding.pipeline.storage.StageStorage` (`storage_for` of ``names``; rows
        split over ``stage`` and the storage's batch axes, as `storage_spec` says), or ``[stages, slots,
        ...]`` in the padded `StageLayout` (sharded over ``stage`` on its first dimension). Leaves with one
        dimension more than their ``names`` (or, without ``names``, a first dimension of ``stages`` and a
        second of ``slots``) are padded; see `sharding.pipeline.relayout.relayout`.
      x: ``[batch, ...]`` activations entering the first layer (float; its dtype is the compute dtype).
      extras: side inputs ``[batch, ...]`` each layer also gets (positions,
        segment ids; None entries pass through as None).
      par: the run's `sharding.parallel.Parallelism`, bound to a mesh, whose
        strategy is the `PipelinePlan` (layout and microbatch count).
      names: the canonical logical names ``(layers, ...)`` of each leaf of ``stacked`` (a tree of
        tuples shaped as ``stacked``), from which the leaves' split over ``data``/``fsdp`` follows;
        None: every leaf is split over ``stage`` only.
      remat_policy: a `jax.checkpoint` policy for each layer's own backward
        pass (None: none). The pipeline always saves only each layer's input
        and recomputes the layer in the backward pass (`_pipeline_program`).

    Returns:
      ``(y, applied)``: ``y`` ``[batch, ...]`` like ``x``, after all layers in
      canonical order, the same on every stage; ``applied`` ``[stages]`` int32,
      the forward layer applications each device of each stage computed
      (`PipelinePlan.layer_applications`: ``microbatches * stage_layers[s]``
      when empty slots are skipped; the backward pass skips the same slots).

    Raises:
      ValueError: no plan or no mesh; a ``stage`` axis other than the layout's;
        a batch that the plan's microbatches do not divide; ``names`` not shaped as ``stacked``; a
        parameter split over an axis of ``data``/``fsdp`` that the microbatches are not split over.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    setup = _Setup.of(stacked, x, extras, par, names)
    plan, weights = setup.plan, setup.weights
    program = jax.shard_map(
        lambda w, xs, ex: _stage_program(w, xs, ex, layer_fn=layer_fn, plan=plan, par=par, weights=weights,
                                         remat_policy=remat_policy),
        mesh=par.mesh,
        in_specs=(setup.stacked_specs, setup.data, jax.tree.map(lambda _: setup.data, setup.extras)),
        out_specs=(setup.data, P(ax.STAGE)),
        axis_names=set(setup.manual),
    )
    xs, extras = setup.xs, setup.extras
    ys, applied = program(stacked, xs, extras)
    return from_microbatches(ys), applied


def _storage_of(layout: StageLayout, leaves, name_leaves, par) -> StageStorage | None:
    """The unpadded storage the stacked leaves are in, or None when they are in the padded layout.

    Raises:
      ValueError: leaves in neither (naming the shapes expected).
    """
    if name_leaves is not None:
        padded = [w.ndim == len(n) + 1 for w, n in zip(leaves, name_leaves)]
    else:
        padded = [w.shape[:2] == (layout.stages, layout.slots) for w in leaves]
    if all(padded):
        return None
    storage = storage_for(layout, name_leaves or [], par.rules, par.mesh_shape)
    if any(padded) or any(w.shape[0] != storage.rows for w in leaves):
        raise ValueError(f"run_pipeline: stacked leaves of shapes {[tuple(w.shape) for w in leaves]}; expected "
                         f"[{storage.rows}, ...] ({storage.describe()}) or [{layout.stages}, {layout.slots}, ...]")
    return storage


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every schedule's shard_map needs: microbatched inputs, manual axes and the weights' specs.

    Attributes:
      plan: the run's `PipelinePlan`.
      xs: ``[M, microbatch, ...]`` the activations in microbatches; extras likewise (a tuple).
      manual: the axes the stage program is manual over (`_manual_axes`).
      data: the `PartitionSpec` of ``[M, microbatch, ...]`` arrays over the manual axes.
      stacked_specs: per leaf of the stacked parameters, its `PartitionSpec` over the manual axes
        (``stage`` first).
      weights: the `_Weights` that gather them per pass and reduce their gradients.
    """

    plan: PipelinePlan
    xs: Any
    extras: Any
    manual: tuple[str, ...]
    data: Any
    stacked_specs: Any
    weights: _Weights

    @classmethod
    def of(cls, stacked, x, extras, par, names) -> _Setup:
        """Checks the inputs and builds the specs (arguments as `run_pipeline`; raises its ValueErrors)."""
        import jax
        from jax.sharding import PartitionSpec as P

        plan = par.pipeline
        if plan is None:
            raise ValueError("run_pipeline needs a Parallelism whose strategy is a PipelinePlan")
        if par.mesh is None:
            raise ValueError("run_pipeline needs a Parallelism bound to a mesh (Parallelism.on(mesh))")
        layout, m = plan.layout, plan.microbatches
        stages = par.mesh_shape[ax.STAGE]
        if stages != layout.stages:
            raise ValueError(f"the layout has {layout.stages} stages but the mesh's stage axis is {stages}")
        if x.shape[0] % m:
            raise ValueError(f"a batch of {x.shape[0]} rows is not divisible by --microbatches {m}")
        xs = to_microbatches(x, m)
        extras = jax.tree.map(lambda e: to_microbatches(e, m), tuple(extras))
        manual = _manual_axes(par)
        batch_spec = par.spec((None, ax.BATCH), xs.shape[:2])
        batch = only_axes(P(batch_spec[1] if len(batch_spec) > 1 else None), manual)[0]
        summed = tuple(a for a in spec_axes(batch) if par.mesh_shape[a] > 1)
        leaves, tree = jax.tree.flatten(stacked)
        name_leaves = None if names is None else _name_leaves(names)
        if name_leaves is not None and len(name_leaves) != len(leaves):
            raise ValueError(f"run_pipeline: {len(name_leaves)} logical names for {len(leaves)} stacked parameters")
        storage = _storage_of(layout, leaves, name_leaves, par)
        if storage is not None:
            groups = storage_axes(name_leaves or [], par.rules, par.mesh_shape)
            if set(groups) - set(summed):
                missing = "+".join(a for a in groups if a not in summed)
                raise ValueError(f"pipeline: layer parameters are split over {missing} but microbatches of "
                                 f"{xs.shape[1]} rows are not; use --batch-size a multiple of --microbatches x data x "
                                 f"fsdp, or --rule batch=data+fsdp")
            specs = [only_axes(storage_spec(par.spec(n, w.shape) if name_leaves else P(ax.STAGE), storage.rows,
                                           par.mesh_shape, groups), manual)
                     for n, w in zip(name_leaves or [None] * len(leaves), leaves)]
        elif name_leaves is None:
            groups, specs = (), [P(ax.STAGE)] * len(leaves)
        else:
            groups = ()
            specs = [_manual_spec(par, StageLayout.stacked_names(n), w.shape, manual)
                     for n, w in zip(name_leaves, leaves)]
        _check_split(specs, summed, par, xs.shape[1], batch)
        weights = _Weights(jax.tree.unflatten(tree, [P(None, *spec[1:]) for spec in specs]), summed, x.dtype,
                           storage, groups)
        return cls(plan, xs, extras, manual, P(None, batch), jax.tree.unflatten(tree, specs), weights)


def _name_leaves(names) -> list[tuple]:
    """The logical-name tuples of a tree of them, in leaf order."""
    import jax

    return jax.tree.leaves(names, is_leaf=lambda n: isinstance(n, tuple))


def _manual_spec(par, names, shape, manual):
    """The `PartitionSpec` of an array with logical ``names``, restricted to the ``manual`` axes."""
    return only_axes(par.spec(tuple(names), shape), manual)


def _check_split(specs, summed, par, rows: int, batch, skip_first: bool = True) -> None:
    """Refuses a parameter split over a manual axis that the microbatches are not split over."""
    for spec in specs:
        unsummed = {a for e in spec[1 if skip_first else 0:] for a in spec_axes(e) if par.mesh_shape[a] > 1}
        unsummed -= set(summed)
        if unsummed:
            axes = "+".join(sorted(unsummed))
            raise ValueError(f"pipeline: a parameter is split over {axes} but microbatches of {rows} rows "
                             f"are not (the rule batch -> {'+'.join(spec_axes(batch)) or 'none'}); use a batch whose "
                             f"microbatches split over {axes} too (--batch-size a multiple of --microbatches x "
                             f"data x fsdp), or --rule batch=data+fsdp")
