"""The pieces every pipeline schedule's stage program is built from (GPipe, circular and 1F1B alike).

A schedule (`sharding.pipeline.schedule`, `sharding.pipeline.onef1b`) is one `jax.shard_map` over the
mesh, manual over ``stage`` and the batch axes ``data`` and ``fsdp`` (`manual_axes`), whose body runs a
`jax.lax.scan` of ticks that is the same on every device. What they share lives here and beside it:

* `Setup`: the inputs checked and cut into microbatches (`sharding.pipeline.buffers.to_microbatches`), the
  manual axes, the `PartitionSpec` of the microbatched data and of every stacked parameter, and the
  `sharding.pipeline.weights.Weights` (gathered once per step, or per chunk pass with ``--pipeline-gather
  microbatch``, `sharding.pipeline.weights.Streamed`);
* `chunk_forward` / `chunk_backward`: one chunk of a stage's layers for one microbatch, each slot under
  a `jax.lax.cond` (empty slots and idle ticks compute nothing), and its hand-written backward pass that
  recomputes each layer from its saved input and differentiates it with `jax.vjp`; zero bubble splits the
  latter into `chunk_backward_input` (the recomputed layer's input gradient, keeping each product's input
  and output cotangent) and `chunk_backward_weight` (the weight-gradient products alone), cut by
  `sharding.pipeline.split.LayerSplit`;
* `stage_varying`, `sum_over_stages`: the casts at the edge of the map (inputs made stage-varying so
  their cotangents are reduced once, after the loop; the last stage's outputs summed over ``stage``),
  both in at least float32 (`wide_dtype`);
* the loop's buffers, slot-sized reads and writes and one slot's pass: `sharding.pipeline.buffers`.

Every transfer between stages (``ppermute``) is issued by the schedule in its tick loop, outside these
conditionals: XLA's CPU backend deadlocks on a collective-permute inside one, and in general a collective
inside a branch that devices take differently waits forever (`sharding.hlo.branch_collectives` checks the
compiled program).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.parallel import (
    only_axes,
    spec_axes,
    to_varying,
    varying_axes,
)
from sharding.pipeline.buffers import (
    add_slot,
    backward_slot,
    forward_slot,
    get_cut,
    index_tree,
    objective_tally,
    put_cut,
    slot_params,
    to_microbatches,
)
from sharding.pipeline.layout import PipelinePlan, StageLayout, keeps  # noqa: F401  (re-exported)
from sharding.pipeline.split import LayerSplit
from sharding.pipeline.storage import StageStorage, feature_devices, storage_axes, storage_for, storage_spec
from sharding.pipeline.weights import Streamed, Weights


def chunk_forward(
    layer_fn,
    params,
    r,
    h,
    extras,
    count,
    skip_empty: bool,
    save: bool,
    objective_axes=None,
    objective_size: int = 1,
    keep: bool = False,
):
    """Applies the first ``count`` of chunk ``r``'s ``K`` layers to ``h``; the other slots do nothing.

    Args:
      layer_fn: ``(layer_params, h, *extras) -> h``.
      params: the stage's parameters, leaves ``[R, K, ...]`` (gathered once per step), or a `Streamed`
        (each block of layers gathered here, per call).
      r: int32 scalar, the repeat (chunk) to run.
      h: ``[microbatch, ...]`` activations.
      extras: this microbatch's side inputs (positions, segment ids).
      count: int32 scalar, the stage's layer count for the chunk (0 in a bubble step).
      skip_empty: run each slot under a `jax.lax.cond` (slots past ``count``
        are not computed); False computes every slot and selects.
      save: also return each slot's input (for the backward pass).
      keep: with ``save``, also each slot's residuals, so that the backward recomputes none of the forward
        (`sharding.pipeline.split.LayerSplit.forward_pass`; ``--remat none``/``dots``, `keeps`).
      objective_axes: None, or the layer returns ``(h, objective)`` (float32 ``[objective_size]``, this
        device's partial sums) and the objectives of the slots computed are summed, varying over these manual
        axes.

    Returns:
      ``(h, applied, inputs)``: the activations, the layers computed (int32; with ``objective_axes``,
      ``(count, objective)``) and, when ``save``, ``[P, microbatch, ...]`` slot inputs (else None), ``P`` =
      `slot_positions`; with ``keep``, ``inputs`` is ``(inputs, kept)``, ``kept`` the tuple of each residual
      ``[P, ...]`` (`LayerSplit.kept_avals`).
    """
    applied = to_varying(jnp.zeros((), jnp.int32), ax.STAGE)
    if objective_axes is not None:
        applied = objective_tally(objective_axes, objective_size)
    if isinstance(params, Streamed):
        return params.forward(layer_fn, r, h, applied, extras, count, skip_empty, save)
    slots = jax.tree.leaves(params)[0].shape[1]
    if keep and save:
        return _chunk_forward_kept(layer_fn, params, r, h, applied, extras, count, skip_empty, slots)

    def body(carry, k):
        h, applied = carry
        out = forward_slot(layer_fn, lambda: slot_params(params, r, k), h, applied, extras, k < count, skip_empty)
        return out, (h if save else None)

    (h, applied), inputs = jax.lax.scan(body, (h, applied), jnp.arange(slots))
    return h, applied, inputs


def _chunk_forward_kept(layer_fn, params, r, h, applied, extras, count, skip_empty: bool, slots: int):
    """`chunk_forward` keeping each slot's input and residuals (``keep``): ``(h, applied, (inputs, kept))``."""

    def body(carry, k):
        h, applied = carry
        w = slot_params(params, r, k)
        split = LayerSplit.trace(layer_fn, w, h, h, extras)

        def run(h, applied):
            y, kept = split.forward_pass(w, h, extras)
            return y, applied + 1, kept

        def idle(h, applied):
            return h, applied, split.kept_zeros(h)

        on = k < count
        if skip_empty:
            y, applied, kept = jax.lax.cond(on, run, idle, h, applied)
        else:
            y, counted, kept = run(h, applied)
            y, applied = jnp.where(on, y, h), counted
        return (y, applied), (h, kept)

    (h, applied), saved = jax.lax.scan(body, (h, applied), jnp.arange(slots))
    return h, applied, saved


def kept_ring(layer_fn, params, like, extras, entries: int):
    """The ring of kept residuals (`chunk_forward` with ``keep``): per residual of a layer
    (`LayerSplit.kept_avals`), zeros ``[entries, K, ...]`` typed as ``like`` (a slot input ``[microbatch, ...]``)
    varies; ``params`` the working copy ``[R, K, ...]``."""
    split = LayerSplit.trace(layer_fn, slot_params(params, 0, 0), like, like, extras)
    slots = jax.tree.leaves(params)[0].shape[1]
    zeros = [jnp.zeros((entries, slots, *shape), dtype) for shape, dtype in split.kept_avals]
    return tuple(to_varying(zeros, tuple(sorted(varying_axes(like)))))


def chunk_backward(layer_fn, params, r, inputs, extras, count, g, grads, skip_empty: bool, kept=None):
    """The backward pass of `chunk_forward`: slots in reverse, each layer recomputed from its saved input.

    Args:
      inputs: the `RingEntry` of the ``P`` slot inputs saved by the forward pass.
      g: cotangent of the chunk's output.
      grads: accumulated parameter cotangents, leaves ``[R, K, ...]`` (or, with a `Streamed` ``params``,
        its reduce-scattered accumulators, `Streamed.zeros`).
      kept: None, or the tuple of `RingEntry` s of the residuals the forward kept (`chunk_forward`'s ``keep``):
        each layer is then differentiated on them, not recomputed (`LayerSplit.backward_pass`).
      (others as `chunk_forward`)

    Returns:
      ``(g, grads)``: the cotangent of the chunk's input, and ``grads`` with
      this chunk's slots added. Skipped slots pass ``g`` through and add nothing.
    """
    if isinstance(params, Streamed):
        return params.backward(layer_fn, r, inputs, extras, count, g, grads, skip_empty)
    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        g, grads = carry
        add = lambda grads, dw: add_slot(grads, r, k, dw)  # noqa: E731
        slot = lambda: slot_params(params, r, k)  # noqa: E731
        if kept is None:
            return backward_slot(layer_fn, slot, inputs[k], extras, k < count, g, grads, add, skip_empty), None
        x, w = inputs[k], slot()
        split = LayerSplit.trace(layer_fn, w, x, g, extras)

        def back(g, grads):
            dw, dx = split.backward_pass(w, x, tuple(e[k] for e in kept), g, extras)
            return dx, add(grads, dw)

        if skip_empty:
            return jax.lax.cond(k < count, back, lambda g, grads: (g, grads), g, grads), None
        dx, summed = back(g, grads)
        return (jnp.where(k < count, dx, g), jax.tree.map(lambda a, b: jnp.where(k < count, a, b), summed, grads)), None

    (g, grads), _ = jax.lax.scan(body, (g, grads), jnp.arange(slots), reverse=True)
    return g, grads


def slot_positions(params) -> int:
    """``P``: the slot inputs one chunk's forward pass saves (`chunk_forward`): ``K`` for a working copy
    ``[R, K, ...]``, `Streamed.saved` for a `Streamed` one."""
    if isinstance(params, Streamed):
        return params.saved
    return jax.tree.leaves(params)[0].shape[1]


def chunk_backward_input(layer_fn, params, r, inputs, extras, count, g, kept, entry, skip_empty: bool, residuals=None):
    """The input-gradient half of `chunk_backward` (zero bubble's B pass): slots in reverse, each layer
    recomputed from its saved input and differentiated, keeping what the weight gradient needs.

    Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 2: the backward of a layer splits into
    the input's cotangent (B), which the previous stage waits for, and the weights' cotangent (W,
    `chunk_backward_weight`), which can wait. Each slot's backward is cut by `LayerSplit`: B runs the
    recomputed forward and the input-gradient products and writes, per slot, the values W needs (each
    product's input and output cotangent) into the saved ring, slot by slot (no chunk-sized copy).

    Args:
      inputs: the `RingEntry` of the ``K`` slot inputs saved by the forward pass.
      g: ``[microbatch, ...]`` cotangent of the chunk's output.
      kept: the saved ring, a tuple of ``[E, K, ...]`` arrays (`cut_ring`).
      entry: int32 scalar, the ring entry this pass writes (slots not run leave it as it was).
      residuals: None, or the `RingEntry` s of the residuals the forward kept (as `chunk_backward`'s ``kept``):
        B then runs on them instead of recomputing the layer.
      (others as `chunk_forward`)

    Returns:
      ``(g, kept)``: the cotangent of the chunk's input ``[microbatch, ...]`` and the ring with each run slot's
      cut written (``[E, P, ...]`` by position with a `Streamed` ``params``, `Streamed.backward_input`).
    """
    if isinstance(params, Streamed):
        return params.backward_input(layer_fn, r, inputs, extras, count, g, kept, entry, skip_empty)
    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        g, kept = carry
        x = inputs[k]
        cut = LayerSplit.trace(layer_fn, slot_params(params, r, k), x, g, extras)

        def back(g, kept):
            held = None if residuals is None else tuple(e[k] for e in residuals)
            dx, saved = cut.input_pass(slot_params(params, r, k), x, g, extras, held)
            return dx, put_cut(kept, entry, k, saved, k < count)

        if skip_empty:
            return jax.lax.cond(k < count, back, lambda g, kept: (g, kept), g, kept), None
        dx, kept = back(g, kept)
        return (jnp.where(k < count, dx, g), kept), None

    return jax.lax.scan(body, (g, kept), jnp.arange(slots), reverse=True)[0]


def chunk_backward_weight(layer_fn, params, r, kept, entry, extras, count, grads, like, skip_empty: bool):
    """The weight-gradient half of `chunk_backward` (zero bubble's W pass): each slot's weight cotangents
    from the cut its B pass left in the saved ring (`LayerSplit.weight_pass`: the weight-gradient products,
    no recomputation), read slot by slot.

    Args:
      kept: the saved ring (`chunk_backward_input`); entry: int32 scalar, the entry this pass reads.
      grads: accumulated parameter cotangents, leaves ``[R, K, ...]`` (or, with a `Streamed` ``params``, its
        reduce-scattered accumulators, `Streamed.zeros`; the block's gradient reduce-scattered here,
        `Streamed.backward_weight`).
      like: ``[microbatch, ...]`` an array typed as a slot input (its values unused): W traces the layer's
        backward again to find its half of the cut.
      (others as `chunk_forward`)

    Returns:
      ``grads`` with this chunk's slots added (skipped slots add nothing).
    """
    if isinstance(params, Streamed):
        return params.backward_weight(layer_fn, r, kept, entry, extras, count, grads, like, skip_empty)
    slots = jax.tree.leaves(params)[0].shape[1]

    def body(grads, k):
        cut = LayerSplit.trace(layer_fn, slot_params(params, r, k), like, like, extras)

        def back(grads):
            return add_slot(grads, r, k, cut.weight_pass(slot_params(params, r, k), get_cut(kept, entry, k)))

        if skip_empty:
            return jax.lax.cond(k < count, back, lambda grads: grads, grads), None
        keep = k < count
        dw = cut.weight_pass(slot_params(params, r, k), get_cut(kept, entry, k))
        dw = jax.tree.map(lambda d: jnp.where(keep, d, jnp.zeros((), d.dtype)), dw)
        return add_slot(grads, r, k, dw), None

    return jax.lax.scan(body, grads, jnp.arange(slots))[0]


def cut_ring(layer_fn, params, like, extras, entries: int):
    """Zero bubble's saved ring: per value of a layer's cut (`LayerSplit`), zeros ``[entries, P, ...]`` (``P``:
    the slots of a chunk, `Streamed.positions` with a `Streamed` ``params``), typed as ``like`` (a slot input
    ``[microbatch, ...]``) varies.

    Args:
      layer_fn, params: as `chunk_forward`.
      like: ``[microbatch, ...]`` an array typed as a slot input.
      extras: one microbatch's side inputs.
      entries: ``E``, the ring's entries (`ZeroBubbleTicks.saved_slots`).
    """
    if isinstance(params, Streamed):
        shapes = jax.eval_shape(params.fetch, jnp.zeros((), jnp.int32))
        block = to_varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), params._vary())
        slot, positions = index_tree(block, 0), params.positions
    else:
        slot, positions = slot_params(params, 0, 0), jax.tree.leaves(params)[0].shape[1]
    cut = LayerSplit.trace(layer_fn, slot, like, like, extras)
    zeros = [jnp.zeros((entries, positions, *shape), dtype) for shape, dtype in cut.cut_avals]
    return tuple(to_varying(zeros, tuple(sorted(varying_axes(like)))))


def manual_axes(par) -> tuple[str, ...]:
    """The axes the stage program is manual over: ``stage`` and every axis that may split a batch (``data``,
    ``fsdp``, ``expert``), whatever the rules map ``batch`` to: the gradients are summed over the rules' own
    (``summed`` in `run_pipeline`), and a parameter split over one of the others is refused (`check_split`)."""
    names = getattr(par.mesh, "axis_names", ())
    return tuple(a for a in (ax.STAGE, *ax.BATCH_MESH_AXES) if a in names)


def wide_dtype(dtype):
    """At least float32: the dtype the activations cross ``stage`` in (`stage_varying`, `sum_over_stages`)."""
    return jnp.promote_types(dtype, jnp.float32)


def stage_varying(xs):
    """``xs`` cast stage-varying (`to_varying`) through float32, so that its cotangent is summed over ``stage``
    (the transpose of the cast) in float32: XLA's CPU compiler aborts on a bfloat16 all-reduce there
    (``AllReducePromotion``: "Invalid binary instruction opcode copy"). Exact: only stage 0's cotangent is
    nonzero, and a bfloat16 value is exact in float32."""
    return to_varying(xs.astype(wide_dtype(xs.dtype)), ax.STAGE).astype(xs.dtype)


def sum_over_stages(outputs):
    """``psum`` over ``stage`` in float32 (see `stage_varying`), cast back: exact, as only the last stage's
    outputs are nonzero."""
    return jax.lax.psum(outputs.astype(wide_dtype(outputs.dtype)), ax.STAGE).astype(outputs.dtype)


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
    storage = storage_for(layout, name_leaves or [], par.rules, par.mesh_shape, par.pipeline.gather)
    if any(padded) or any(w.shape[0] != storage.rows for w in leaves):
        raise ValueError(
            f"run_pipeline: stacked leaves of shapes {[tuple(w.shape) for w in leaves]}; expected "
            f"[{storage.rows}, ...] ({storage.describe()}) or [{layout.stages}, {layout.slots}, ...]"
        )
    return storage


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every schedule's shard_map needs: microbatched inputs, manual axes and the weights' specs.

    Attributes:
      plan: the run's `PipelinePlan`.
      xs: ``[M, microbatch, ...]`` the activations in microbatches; extras likewise (a tuple).
      manual: the axes the stage program is manual over (`manual_axes`).
      data: the `PartitionSpec` of ``[M, microbatch, ...]`` arrays over the manual axes.
      stacked_specs: per leaf of the stacked parameters, its `PartitionSpec` over the manual axes
        (``stage`` first).
      weights: the `Weights` that gather them per pass and reduce their gradients.
    """

    plan: PipelinePlan
    xs: Any
    extras: Any
    manual: tuple[str, ...]
    data: Any
    stacked_specs: Any
    weights: Weights

    @classmethod
    def of(cls, stacked, x, extras, par, names) -> Setup:
        """Checks the inputs and builds the specs (arguments as `run_pipeline`; raises its ValueErrors)."""
        plan = par.pipeline
        if plan is None:
            raise ValueError("run_pipeline needs a Parallelism with a pipeline (Parallelism.pipeline a PipelinePlan)")
        if par.mesh is None:
            raise ValueError("run_pipeline needs a Parallelism bound to a mesh (Parallelism.on(mesh))")
        layout, m = plan.layout, plan.microbatches
        stages = par.mesh_shape[ax.STAGE]
        if stages != layout.stages:
            raise ValueError(f"the layout has {layout.stages} stages but the mesh's stage axis is {stages}")
        if x.shape[0] % m:
            raise ConfigError(f"a batch of {x.shape[0]} rows is not divisible by ", Field("microbatches", m))
        xs = to_microbatches(x, m)
        extras = jax.tree.map(lambda e: to_microbatches(e, m), tuple(extras))
        manual = manual_axes(par)
        batch_spec = par.spec((None, ax.BATCH), xs.shape[:2])
        batch = only_axes(P(batch_spec[1] if len(batch_spec) > 1 else None), manual)[0]
        summed = tuple(a for a in spec_axes(batch) if par.mesh_shape[a] > 1)
        leaves, tree = jax.tree.flatten(stacked)
        name_leaves = None if names is None else logical_leaves(names)
        if name_leaves is not None and len(name_leaves) != len(leaves):
            raise ValueError(f"run_pipeline: {len(name_leaves)} logical names for {len(leaves)} stacked parameters")
        storage = _storage_of(layout, leaves, name_leaves, par)
        if storage is not None:
            groups = storage_axes(name_leaves or [], par.rules, par.mesh_shape, plan.gather)
            if set(groups) - set(summed):
                missing = "+".join(a for a in groups if a not in summed)
                raise ConfigError(
                    f"pipeline: layer parameters are split over {missing} but microbatches of {xs.shape[1]} rows "
                    "are not; ",
                    *_split_fixes(par, groups),
                )
            specs = [
                only_axes(
                    storage_spec(
                        par.spec(n, w.shape) if name_leaves else P(ax.STAGE), storage.rows, par.mesh_shape, groups
                    ),
                    manual,
                )
                for n, w in zip(name_leaves or [None] * len(leaves), leaves)
            ]
        elif name_leaves is None:
            groups, specs = (), [P(ax.STAGE)] * len(leaves)
        else:
            groups = ()
            specs = [
                manual_spec(par, StageLayout.stacked_names(n), w.shape, manual) for n, w in zip(name_leaves, leaves)
            ]
        check_split(specs, summed, par, xs.shape[1], batch)
        span = 1
        if storage is not None and plan.gather == "microbatch":
            span = feature_devices(name_leaves or [], par.rules, par.mesh_shape)
        weights = Weights(
            jax.tree.unflatten(tree, [P(None, *spec[1:]) for spec in specs]), summed, x.dtype, storage, groups, span
        )
        return cls(plan, xs, extras, manual, P(None, batch), jax.tree.unflatten(tree, specs), weights)


def logical_leaves(names) -> list[tuple]:
    """The logical-name tuples of a tree of them, in leaf order."""
    return jax.tree.leaves(names, is_leaf=lambda n: isinstance(n, tuple))


def manual_spec(par, names, shape, manual):
    """The `PartitionSpec` of an array with logical ``names``, restricted to the ``manual`` axes."""
    return only_axes(par.spec(tuple(names), shape), manual)


def check_split(specs, summed, par, rows: int, batch, skip_first: bool = True) -> None:
    """Refuses a parameter split over a manual axis that the microbatches are not split over."""
    for spec in specs:
        unsummed = {a for e in spec[1 if skip_first else 0 :] for a in spec_axes(e) if par.mesh_shape[a] > 1}
        unsummed -= set(summed)
        if unsummed:
            axes = "+".join(sorted(unsummed))
            raise ConfigError(
                f"pipeline: a parameter is split over {axes} but microbatches of {rows} rows "
                f"are not (the rule batch -> {'+'.join(spec_axes(batch)) or 'none'}); ",
                *_split_fixes(par, sorted(unsummed)),
            )


def _split_fixes(par, axes) -> tuple:
    """What a refusal of parameters split over ``axes`` (manual axes the microbatches are not split over)
    suggests: a ``batch`` rule that adds the axes it lacks, or, where it has them all (a batch they do not
    divide, so the split was dropped), a batch the microbatches x those axes divide."""
    rule = par.rules.mesh_axes(ax.BATCH)
    wider = (*rule, *(a for a in axes if a not in rule))
    if wider != rule:
        return ("split the batch over them too: ", Field("rule", "batch=" + "+".join(wider)))
    return ("use ", Field("batch_size"), " a multiple of ", Field("microbatches"), " x " + " x ".join(rule))


@dataclasses.dataclass(frozen=True)
class StageTable:
    """This stage's column of each of the tick table's columns (traced: the stage is the ``stage`` index).

    Attributes:
      stage: int32 scalar, this device's stage.
      columns: the tick table's columns by name (`Ticks.columns`; lockstep's forward and backward columns are
        one array, read once).
      tables: ``[ticks]`` int32, this stage's entry of each distinct column, by the column's ``id``.
      counts: ``[R]`` int32, this stage's layers in each chunk.
    """

    stage: Any
    columns: dict
    tables: dict
    counts: Any

    @classmethod
    def of(cls, ticks, layout) -> StageTable:
        """This stage's columns of ``ticks`` and its chunk sizes from ``layout`` (a `StageLayout`)."""
        stage = jax.lax.axis_index(ax.STAGE)
        columns = ticks.columns()
        tables = {}
        for column in columns.values():
            tables.setdefault(id(column), jnp.asarray(column)[:, stage])
        counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]
        return cls(stage, columns, tables, counts)

    @property
    def split(self) -> bool:
        """Zero bubble: the backward split into input-gradient (B) and weight-gradient (W) passes."""
        return "weight" in self.columns

    def row(self, t) -> dict:
        """Tick ``t``'s entry (int32 scalars) of every column, by name."""
        read = {}
        return {name: read.setdefault(id(c), self.tables[id(c)][t]) for name, c in self.columns.items()}


def stage_rings(stages: int) -> tuple[list, list]:
    """The ``ppermute`` pairs of the stage ring: forward (stage ``s`` to ``s + 1``, the last to 0) and back."""
    return [(s, (s + 1) % stages) for s in range(stages)], [((s + 1) % stages, s) for s in range(stages)]
