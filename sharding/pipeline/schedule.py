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
manual over ``stage`` only (``axis_names={'stage'}``); ``data``, ``fsdp``,
``sequence`` and ``tensor`` stay automatic, so GSPMD still partitions every
layer as the logical rules say. Activations move to the next stage with one
`jax.lax.ppermute` per step (a ring: the last stage sends to stage 0, which
keeps what it receives for the microbatch's next repeat). No collective over
``stage`` sits inside a cond: the ppermutes run in step loops whose trip
count is the same on every device, and one ``psum`` after the loop hands the
last stage's outputs to every stage. Inputs that are the same on every stage
are cast to stage-varying (`jax.lax.pcast`) before the loop, so their
gradients are reduced once, after it. Collectives GSPMD puts inside a layer
(all-gathers over ``fsdp``, all-reduces over ``tensor``) involve devices of
one stage, which take the same branch; `sharding.hlo.branch_collectives` checks
the compiled program, and `train.strategies` falls back to computing every slot
(`PipelinePlan.skip_empty` False) if the partitioner put anything else there.

What runs outside the pipeline (embedding, final norm, output projection and
loss) is replicated over ``stage``: every stage computes it for the whole
batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.parallel import to_varying
from sharding.pipeline.layout import PipelinePlan

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


def _pipeline_backward(layer_fn, plan: PipelinePlan, params, extras, saved, g_outputs):
    """The backward pass of `_pipeline_forward`: steps in reverse, cotangents sent up the ring.

    Each step undoes the forward step: the cotangent of what this stage sent
    comes back from the next stage (``ppermute`` the other way round), the
    chunk's layers are recomputed from their saved inputs and differentiated
    slot by slot (empty slots skipped), and the input's cotangent goes to the
    microbatches (stage 0, first repeat), to the ring buffer (stage 0, later
    repeats) or to the previous stage (next step back).

    Returns:
      ``(grads, g_xs)``: cotangents of the stage's parameters ``[R, K, ...]``
      and of ``xs``.
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
    grads = jax.tree.map(jnp.zeros_like, params)
    init = (zeros[0], zeros if repeats > 1 else None, grads, zeros)
    (_, _, grads, g_xs), _ = jax.lax.scan(step, init, jnp.arange(plan.steps), reverse=True)
    return grads, g_xs


def _pipeline_program(layer_fn, plan: PipelinePlan, par, remat_policy=None):
    """``f(params [R, K, ...], xs, extras) -> (outputs, applied)`` for one stage, with its own backward pass.

    The backward pass is written out (`_pipeline_backward`) rather than left
    to autodiff of the forward loop: the slots' conditionals would make
    autodiff save a slice of the stage's parameters per step as residuals
    (a copy of them per pipeline step), where this saves only each slot's
    input activations, as ``--remat full`` does for an unpipelined stack.
    Every layer is recomputed once in the backward pass (with
    ``remat_policy`` applied inside it) and differentiated by `jax.vjp`.

    The layers get ``par``'s variant for the stage program (``stage`` manual,
    `sharding.parallel.Parallelism.inside`), made while tracing the forward
    and the backward pass alike.
    """
    import jax

    def bound(fn, *args):
        stage_par = par.inside((ax.STAGE,))
        layer = lambda w, h, *extras: layer_fn(stage_par, w, h, *extras)  # noqa: E731
        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        return fn(layer, plan, *args)

    @jax.custom_vjp
    def program(params, xs, extras):
        outputs, applied, _ = bound(_pipeline_forward, params, xs, extras, False)
        return outputs, applied

    def forward(params, xs, extras):
        outputs, applied, saved = bound(_pipeline_forward, params, xs, extras, True)
        return (outputs, applied), (params, extras, saved)

    def backward(residuals, cotangents):
        params, extras, saved = residuals
        grads, g_xs = bound(_pipeline_backward, params, extras, saved, cotangents[0])
        return grads, g_xs, jax.tree.map(lambda _: None, extras)

    program.defvjp(forward, backward)
    return program


def _stage_program(stacked, xs, extras, *, layer_fn, plan: PipelinePlan, par, remat_policy=None):
    """One stage's program (inside shard_map, manual over ``stage``).

    Args:
      stacked: this stage's parameters, leaves ``[1, slots, ...]``.
      xs: ``[M, microbatch, ...]`` all microbatches (the same on every stage).
      extras: per-microbatch side inputs ``[M, microbatch, ...]`` (or None leaves).

    Returns:
      ``(ys, applied)``: ``[M, microbatch, ...]`` outputs of the last stage
      (summed over ``stage`` once, after the loop) and ``[1]`` int32 layer
      applications of this device.
    """
    import jax

    layout = plan.layout
    params = jax.tree.map(lambda w: w.reshape(layout.repeats, layout.chunk_slots, *w.shape[2:]), stacked)
    xs, extras = to_varying((xs, extras), ax.STAGE)
    outputs, applied = _pipeline_program(layer_fn, plan, par, remat_policy)(params, xs, extras)
    return jax.lax.psum(outputs, ax.STAGE), applied[None]


def run_pipeline(layer_fn: Callable[..., Any], stacked, x, extras: Sequence[Any], par, *, remat_policy=None):
    """Runs a stacked layer function as a pipeline over the ``stage`` mesh axis.

    Args:
      layer_fn: ``(par, layer_params, h, *extras) -> h`` for one layer; ``h`` keeps
        its shape and dtype. ``par`` is the stage program's variant of the run's
        `sharding.parallel.Parallelism` (``stage`` manual), for its annotations.
      stacked: pytree of the stacked layer parameters, every leaf
        ``[stages, slots, ...]`` in the plan's layout (see
        `sharding.pipeline.relayout.relayout`), sharded over ``stage`` on its
        first dimension.
      x: ``[batch, ...]`` activations entering the first layer (float).
      extras: side inputs ``[batch, ...]`` each layer also gets (positions,
        segment ids; None entries pass through as None).
      par: the run's `sharding.parallel.Parallelism`, bound to a mesh, whose
        strategy is the `PipelinePlan` (layout and microbatch count).
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
        a batch that the plan's microbatches do not divide.
    """
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
    program = jax.shard_map(
        lambda w, xs, ex: _stage_program(w, xs, ex, layer_fn=layer_fn, plan=plan, par=par,
                                         remat_policy=remat_policy),
        mesh=par.mesh,
        in_specs=(P(ax.STAGE), P(), P()),
        out_specs=(P(), P(ax.STAGE)),
        axis_names={ax.STAGE},
    )
    ys, applied = program(stacked, xs, extras)
    return from_microbatches(ys), applied
