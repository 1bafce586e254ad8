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
``--remat full`` does; with ``recompute`` False, ``--remat none`` or ``dots``, the forward also keeps each
slot's residuals under the policy and the backward differentiates the layer on them,
`sharding.pipeline.split.LayerSplit.forward_pass`).
Left to autodiff, the conditionals would save a slice of the stage's
parameters per step as residuals, a copy of them per pipeline step.

SPMD mechanics. `run_pipeline` runs the stage program under `jax.shard_map`
manual over ``stage`` and the batch axes ``data`` and ``fsdp``; ``sequence``
and ``tensor`` stay automatic, so GSPMD still partitions every layer over them
as the logical rules say. Each device runs its own rows of every microbatch.

Weights once per step (``--pipeline-gather once``; ``microbatch`` gathers one block of layers at a time
inside each step's chunk pass instead, `sharding.pipeline.weights.Streamed`). Before the step loop each
device all-gathers its
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.parallel import to_varying
from sharding.pipeline.buffers import (
    RingEntry,
    from_microbatches,
    index_leaf,
    index_tree,
    with_objective_cotangent,
    write,
)
from sharding.pipeline.layout import PipelinePlan
from sharding.pipeline.program import (
    Setup,
    chunk_backward,
    chunk_forward,
    keeps,
    manual_axes,
    stage_varying,
    sum_over_stages,
)
from sharding.pipeline.traffic import PipelineTraffic
from sharding.pipeline.weights import Weights


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
        i = t - self.stage
        m = self.plan.microbatches
        ic = jnp.clip(i, 0, self.iterations - 1)
        return (i >= 0) & (i < self.iterations), ic // m, ic % m

    def returning(self, t):
        """``(arrived, mb)``: whether what stage 0 receives at the end of step t comes back for a later repeat."""
        layout, m = self.plan.layout, self.plan.microbatches
        j = t - (layout.stages - 1)  # the last stage's iteration at step t
        arrived = (self.stage == 0) & (j >= 0) & (j < self.iterations - m)
        return arrived, jnp.clip(j, 0, self.iterations - 1) % m


def _pipeline_forward(
    layer_fn,
    plan: PipelinePlan,
    params,
    xs,
    extras,
    save: bool,
    objective_axes=None,
    objective_size: int = 1,
    keep: bool = False,
):
    """All ``R*M + S - 1`` steps of one stage, forward.

    Args:
      params: the stage's parameters, leaves ``[R, K, ...]``.
      xs: ``[M, microbatch, ...]`` all microbatches (stage-varying).
      extras: ``[M, microbatch, ...]`` side inputs.
      save: return the slot inputs of every step (for `_pipeline_backward`).
      keep: with ``save``, also each slot's residuals (`program.chunk_forward`'s ``keep``).
      objective_axes: None, or the layer returns ``(h, objective)`` (float32 ``[objective_size]``) and the
        objectives are summed (`program.chunk_forward`).

    Returns:
      ``(outputs, applied, objective, saved)``: ``[M, microbatch, ...]`` (the outputs on
      the last stage, zeros elsewhere), this device's layer applications
      (int32), its summed objective (float32 ``[objective_size]``; None without ``objective_axes``) and, when
      ``save``, ``[steps, K, microbatch, ...]`` slot inputs (with ``keep``, ``(inputs, kept)``, each residual
      ``[steps, K, ...]``).
    """
    layout = plan.layout
    stages, repeats = layout.stages, layout.repeats
    stage = jax.lax.axis_index(ax.STAGE)
    where = _Schedule(plan, stage)
    counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]  # [R] this stage's chunk sizes
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def step(carry, t):
        state, circ, outputs, applied, objective = carry
        valid, r, mb = where.at(t)
        first = index_leaf(xs, mb)
        if repeats > 1:  # stage 0 takes microbatch mb back from the ring after its first repeat
            first = jnp.where(r == 0, first, index_leaf(circ, mb))
        inputs = jnp.where(stage == 0, first, state)
        count = jnp.where(valid, counts[r], 0)
        h, done, saved = chunk_forward(
            layer_fn,
            params,
            r,
            inputs,
            index_tree(extras, mb),
            count,
            plan.skip_empty,
            save,
            objective_axes,
            objective_size,
            keep,
        )
        if objective_axes is not None:
            done, part = done
            objective = objective + part
        outputs = write(outputs, mb, h, valid & (stage == stages - 1) & (r == repeats - 1))
        received = jax.lax.ppermute(h, ax.STAGE, ring)
        if repeats > 1:
            arrived, back = where.returning(t)
            circ = write(circ, back, received, arrived)
        return (received, circ, outputs, applied + done, objective), saved

    zeros = jnp.zeros_like(xs)
    objective = None
    if objective_axes is not None:
        objective = to_varying(jnp.zeros((objective_size,), jnp.float32), objective_axes)
    init = (
        zeros[0],
        zeros if repeats > 1 else None,
        zeros,
        to_varying(jnp.zeros((), jnp.int32), ax.STAGE),
        objective,
    )
    trips = PipelineTraffic.of_plan(plan).trips  # R*M + S - 1 steps, each sending the activations down the ring
    (_, _, outputs, applied, objective), saved = jax.lax.scan(step, init, jnp.arange(trips))
    return outputs, applied, objective, saved


def _pipeline_backward(layer_fn, plan: PipelinePlan, params, extras, saved, g_outputs, grads, keep: bool = False):
    """The backward pass of `_pipeline_forward`: steps in reverse, cotangents sent up the ring.

    Each step undoes the forward step: the cotangent of what this stage sent
    comes back from the next stage (``ppermute`` the other way round), the
    chunk's layers are recomputed from their saved inputs and differentiated
    slot by slot (empty slots skipped), and the input's cotangent goes to the
    microbatches (stage 0, first repeat), to the ring buffer (stage 0, later
    repeats) or to the previous stage (next step back).

    Args:
      grads: zero gradient accumulators shaped as ``params`` ``[R, K, ...]`` (in the parameters' dtype).
      keep: ``saved`` also holds each slot's residuals (`_pipeline_forward`'s ``keep``): no layer is recomputed.

    Returns:
      ``(grads, g_xs)``: this device's cotangents of the stage's parameters
      ``[R, K, ...]`` (not yet summed over the batch axes) and of ``xs``.
    """
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
            g_received = jnp.where(stage == 0, jnp.where(arrived, index_leaf(g_circ, back), 0), g_state)
            g_circ = write(g_circ, back, jnp.zeros_like(g_state), arrived)
        else:
            g_received = jnp.where(stage == 0, jnp.zeros_like(g_state), g_state)
        g_out = jax.lax.ppermute(g_received, ax.STAGE, back_ring)
        wrote = valid & (stage == stages - 1) & (r == repeats - 1)
        g_out = g_out + jnp.where(wrote, index_leaf(g_outputs, mb), 0).astype(g_out.dtype)
        count = jnp.where(valid, counts[r], 0)
        inputs, kept = saved if keep else (saved, None)
        kept = None if kept is None else tuple(RingEntry(a, t) for a in kept)
        g_in, grads = chunk_backward(
            layer_fn,
            params,
            r,
            RingEntry(inputs, t),
            index_tree(extras, mb),
            count,
            g_out,
            grads,
            plan.skip_empty,
            kept,
        )
        first = valid & (stage == 0)
        if repeats > 1:
            g_xs = write(g_xs, mb, index_leaf(g_xs, mb) + g_in, first & (r == 0))
            g_circ = write(g_circ, mb, index_leaf(g_circ, mb) + g_in, first & (r > 0))
        else:
            g_xs = write(g_xs, mb, index_leaf(g_xs, mb) + g_in, first)
        return (jnp.where(stage == 0, jnp.zeros_like(g_in), g_in), g_circ, grads, g_xs), None

    zeros = jnp.zeros_like(g_outputs)
    init = (zeros[0], zeros if repeats > 1 else None, grads, zeros)
    trips = PipelineTraffic.of_plan(plan).trips  # as many, each sending the input's cotangent up the ring
    (_, _, grads, g_xs), _ = jax.lax.scan(step, init, jnp.arange(trips), reverse=True)
    return grads, g_xs


def _pipeline_program(
    layer_fn, plan: PipelinePlan, par, weights: Weights, remat_policy=None, objective: int = 0, recompute: bool = True
):
    """``f(stacked [1, slots, ...], xs, extras) -> (outputs, applied, objective)`` for one stage, with its own
    backward pass (``objective``: this device's summed layer objectives, float32 ``[objective]``, or None
    without one: see `run_pipeline`).

    The stage's weights are gathered once per step, outside the step loop, in the compute dtype
    (`Weights.gather`; the forward pass's copy is the backward pass's residual and lives through the
    step: the trade-off MaxText calls ``pipeline_fsdp_ag_once``, all chunks of a circular stage at once). The backward pass accumulates each slot's gradient on this device in float32
    (the parameters' dtype) and reduces once, after its loop (`Weights.reduce`).

    The backward pass is written out (`_pipeline_backward`) rather than left
    to autodiff of the forward loop: the slots' conditionals would make
    autodiff save a slice of the stage's parameters per step as residuals
    (a copy of them per pipeline step), where this saves only each slot's
    input activations, as ``--remat full`` does for an unpipelined stack.
    Every layer is recomputed once in the backward pass (with
    ``remat_policy`` applied inside it) and differentiated by `jax.vjp`. Not ``recompute`` (``--remat none`` or
    ``dots``), the forward pass also keeps each slot's residuals under ``remat_policy`` (all of them without
    one; the products' outputs under ``dots``) and the backward pass differentiates each layer on them,
    recomputing only what the policy did not save (`program.keeps`, `sharding.pipeline.split.LayerSplit`).

    The layers get ``par``'s variant for the stage program (``stage`` and the
    batch axes manual, `sharding.parallel.Parallelism.inside`), made while
    tracing the forward and the backward pass alike. With ``objective`` the forward pass sums the layers'
    objectives and the backward pass differentiates them at their output's cotangent
    (`sharding.pipeline.buffers.with_objective_cotangent`).
    """
    repeats = plan.layout.repeats
    vary = (ax.STAGE, *weights.summed)

    def bound(fn, *args, cotangent=None, **kwargs):
        stage_par = par.inside(manual_axes(par))
        if objective:
            layer = lambda w, h, *e: layer_fn(stage_par, w, h, *e, batch_axes=weights.summed)  # noqa: E731
        else:
            layer = lambda w, h, *extras: layer_fn(stage_par, w, h, *extras)  # noqa: E731
        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        if cotangent is not None:
            layer = with_objective_cotangent(layer, cotangent)
        return fn(layer, plan, *args, **kwargs)

    forward_args = {"objective_axes": vary, "objective_size": objective} if objective else {}

    streamed = PipelineTraffic.of_plan(plan).streams_layers  # each chunk pass gathers its layers
    keep = keeps(recompute, streamed, bool(objective))

    def params_of(stacked):
        return weights.stream(stacked, repeats) if streamed else weights.gather(stacked, repeats)

    @jax.custom_vjp
    def program(stacked, xs, extras):
        outputs, applied, summed, _ = bound(_pipeline_forward, params_of(stacked), xs, extras, False, **forward_args)
        return outputs, applied, summed

    def forward(stacked, xs, extras):
        params = params_of(stacked)
        outputs, applied, summed, saved = bound(
            _pipeline_forward, params, xs, extras, True, **forward_args, **({"keep": True} if keep else {})
        )
        # Once: the forward pass's gathered copy is the backward pass's (gathered once per step); per
        # microbatch, only the rows received from other devices are kept and each pass gathers again.
        kept = params.received if streamed else params
        return (outputs, applied, summed), (stacked, kept, extras, saved)

    def backward(residuals, cotangents):
        stacked, kept, extras, saved = residuals
        g_outputs, _, g_objective = cotangents
        cotangent = {"cotangent": g_objective} if objective else {}
        if streamed:
            params = weights.stream(stacked, repeats, received=kept)
            grads, g_xs = bound(_pipeline_backward, params, extras, saved, g_outputs, params.zeros(), **cotangent)
            return weights.finish(grads, stacked), g_xs, jax.tree.map(lambda _: None, extras)
        # Varying over the batch axes, so that differentiating a layer adds no reduction inside the loop.
        params = to_varying(kept, weights.summed)
        zeros = weights.sums_zeros(params, stacked)
        grads, g_xs = bound(
            _pipeline_backward, params, extras, saved, g_outputs, to_varying(zeros, vary), keep=keep, **cotangent
        )
        return weights.reduce(grads, stacked), g_xs, jax.tree.map(lambda _: None, extras)

    program.defvjp(forward, backward)
    return program


def _stage_program(
    stacked,
    xs,
    extras,
    *,
    layer_fn,
    plan: PipelinePlan,
    par,
    weights: Weights,
    remat_policy=None,
    objective: int = 0,
    recompute: bool = True,
):
    """One stage's program (inside shard_map, manual over ``stage`` and the batch axes).

    Args:
      stacked: this device's block of the stage's parameters, leaves ``[1, slots, ...]``.
      xs: ``[M, microbatch / batch shards, ...]`` this device's rows of every microbatch.
      extras: per-microbatch side inputs ``[M, microbatch / batch shards, ...]`` (or None leaves).

    Returns:
      ``(ys, applied, objective)``: ``[M, microbatch / batch shards, ...]`` outputs of the last stage
      (summed over ``stage`` once, after the loop), ``[1]`` int32 layer
      applications of this device and, with ``objective``, the layers' objectives summed over every device
      (float32 ``[objective]``; else None).
    """
    xs, extras = stage_varying(xs), to_varying(extras, ax.STAGE)
    program = _pipeline_program(layer_fn, plan, par, weights, remat_policy, objective, recompute)
    outputs, applied, summed = program(stacked, xs, extras)
    if objective:
        summed = jax.lax.psum(summed, (ax.STAGE, *weights.summed))
    return sum_over_stages(outputs), applied[None], summed


def run_pipeline(
    layer_fn: Callable[..., Any],
    stacked,
    x,
    extras: Sequence[Any],
    par,
    *,
    names=None,
    remat_policy=None,
    objective: int = 0,
    recompute: bool = True,
):
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
        ``pipeline`` is the `PipelinePlan` (layout and microbatch count).
      names: the canonical logical names ``(layers, ...)`` of each leaf of ``stacked`` (a tree of
        tuples shaped as ``stacked``), from which the leaves' split over ``data``/``fsdp`` follows;
        None: every leaf is split over ``stage`` only.
      remat_policy: a `jax.checkpoint` policy for each layer's own backward
        pass (None: none).
      recompute: save only each layer's input and recompute the layer in the backward pass (``--remat full``);
        False keeps each layer's residuals under ``remat_policy`` from the forward pass (``--remat none``: all
        of them, ``dots``: the products' outputs), so the backward pass recomputes only what the policy did not
        keep (`_pipeline_program`; ``--pipeline-gather microbatch`` and layers with an objective recompute
        whatever it says, `sharding.pipeline.program.keeps`).
      objective: 0, or the layers have an objective of this many entries: ``layer_fn`` is ``(par,
        layer_params, h, *extras, batch_axes) -> (h, objective)``, ``objective`` float32 ``[objective]`` (this
        device's part of it) and ``batch_axes`` the manual axes that split the microbatch's rows (over which a
        layer sums what it needs of the whole microbatch). The objectives of every layer, microbatch and
        device are summed and differentiated; the caller adds entry 0 to its loss and may read the others as
        statistics (their cotangent is 0 there).

    Returns:
      ``(y, applied)``: ``y`` ``[batch, ...]`` like ``x``, after all layers in
      canonical order, the same on every stage; ``applied`` ``[stages]`` int32,
      the forward layer applications each device of each stage computed
      (`PipelinePlan.layer_applications`: ``microbatches * stage_layers[s]``
      when empty slots are skipped; the backward pass skips the same slots). With ``objective``,
      ``(y, applied, objective)``: the summed objective, float32 ``[objective]``.

    Raises:
      ValueError: no plan or no mesh; a ``stage`` axis other than the layout's;
        a batch that the plan's microbatches do not divide; ``names`` not shaped as ``stacked``; a
        parameter split over an axis of ``data``/``fsdp`` that the microbatches are not split over.
    """
    setup = Setup.of(stacked, x, extras, par, names)
    plan, weights = setup.plan, setup.weights
    program = jax.shard_map(
        lambda w, xs, ex: _stage_program(
            w,
            xs,
            ex,
            layer_fn=layer_fn,
            plan=plan,
            par=par,
            weights=weights,
            remat_policy=remat_policy,
            objective=objective,
            recompute=recompute,
        ),
        mesh=par.mesh,
        in_specs=(setup.stacked_specs, setup.data, jax.tree.map(lambda _: setup.data, setup.extras)),
        out_specs=(setup.data, P(ax.STAGE), P() if objective else None),
        axis_names=set(setup.manual),
    )
    xs, extras = setup.xs, setup.extras
    ys, applied, summed = program(stacked, xs, extras)
    if objective:
        return from_microbatches(ys), applied, summed
    return from_microbatches(ys), applied
