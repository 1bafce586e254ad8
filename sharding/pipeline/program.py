"""The pieces every pipeline schedule's stage program is built from (GPipe, circular and 1F1B alike).

A schedule (`sharding.pipeline.schedule`, `sharding.pipeline.onef1b`) is one `jax.shard_map` over the
mesh, manual over ``stage`` and the batch axes ``data`` and ``fsdp`` (`manual_axes`), whose body runs a
`jax.lax.scan` of ticks that is the same on every device. What they share lives here:

* `Setup`: the inputs checked and cut into microbatches (`to_microbatches`), the manual axes, the
  `PartitionSpec` of the microbatched data and of every stacked parameter, and the `Weights`;
* `Weights`: the stage's layer weights gathered once per step into its ``[R, K, ...]`` working copy in the
  compute dtype, and the gradients summed over the step reduced back into the stored blocks once, after
  the loop (MaxText's ``pipeline_fsdp_ag_once`` trade-off: one gather and one reduction per step instead of
  one per microbatch, the gathered copy held through the step); or, with ``--pipeline-gather
  microbatch``, `Streamed`: one block of layers gathered at a time inside each chunk pass (zero bubble's
  weight-gradient pass, which reads no weight, gathers none) and its gradient reduce-scattered there, so
  the step holds one block instead of the stage;
* `chunk_forward` / `chunk_backward`: one chunk of a stage's layers for one microbatch, each slot under
  a `jax.lax.cond` (empty slots and idle ticks compute nothing), and its hand-written backward pass that
  recomputes each layer from its saved input and differentiates it with `jax.vjp`; zero bubble splits the
  latter into `chunk_backward_input` (the recomputed layer's input gradient, keeping each product's input
  and output cotangent) and `chunk_backward_weight` (the weight-gradient products alone), cut by
  `sharding.pipeline.split.LayerSplit`;
* `index_tree`, `index_leaf`, `write`, `store`, `slot_params`, `add_slot`: slice-sized reads and predicated
  writes of the loop's buffers (a `jnp.where` on one slice, never on a whole buffer; `store`, for the rings a
  loop carries, reads nothing of the buffer, so XLA updates it in place), and `RingEntry`, the backward's
  view of one entry of a ring of saved inputs, read in place;
* `stage_varying`, `sum_over_stages`: the casts at the edge of the map (inputs made stage-varying so
  their cotangents are reduced once, after the loop; the last stage's outputs summed over ``stage``),
  both in at least float32 (`wide_dtype`).

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
    gather_shards,
    only_axes,
    psum_unsplit,
    reduce_shards,
    spec_axes,
    to_varying,
    varying_axes,
)
from sharding.pipeline.layout import PipelinePlan, StageLayout
from sharding.pipeline.split import LayerSplit
from sharding.pipeline.storage import StageStorage, feature_devices, storage_axes, storage_for, storage_spec


def to_microbatches(x, microbatches: int):
    """``[batch, ...]`` -> ``[microbatches, batch / microbatches, ...]``, row ``r`` to microbatch ``r % M``.

    Strided rows keep each device's share of every microbatch on that device
    when the batch is split over ``data``/``fsdp`` (as `train.runtime.step` does for
    gradient accumulation).
    """
    return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def from_microbatches(x):
    """Inverse of `to_microbatches`: ``[microbatches, rows, ...]`` -> ``[microbatches * rows, ...]``."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def index_tree(tree, i):
    """Entry ``i`` (a traced int32 scalar) of every leaf's first dimension: ``[n, ...]`` -> ``[...]``."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def index_leaf(w, i):
    """Entry ``i`` (a traced int32 scalar) of one array's first dimension: ``[n, ...]`` -> ``[...]``."""
    return jax.lax.dynamic_index_in_dim(w, i, keepdims=False)


def write(buffer, i, value, predicate):
    """``buffer[i] = value`` where ``predicate``, else unchanged (a slice-sized select).

    Args:
      buffer: ``[n, ...]``.
      i: traced int32 scalar in ``[0, n)``.
      value: ``[...]``, one entry of ``buffer`` (same dtype).
      predicate: traced bool scalar.
    """
    old = jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(predicate, value, old), i, 0)


def store(buffer, index, value, predicate):
    """``buffer[index] = value`` where ``predicate``, else unchanged, without reading ``buffer``: a scatter
    that drops its update where ``predicate`` is false (its first index moved out of bounds).

    A select between ``value`` and the old slice (`write`) reads the buffer where it writes; XLA may fuse that
    read with an earlier update of the same buffer into one that reads the buffer as it was, after the update
    wrote over it in place, and then keeps the old buffer alive with a copy of the whole buffer (in a loop: one
    per trip). A write that reads nothing leaves no such read to move.

    Args:
      buffer: ``[n_0, ..., n_j, ...]``.
      index: ``(i_0, ..., i_j)``, traced int32 scalars, one per leading dimension, in bounds.
      value: ``[...]``, shaped as ``buffer[i_0, ..., i_j]`` (cast to ``buffer``'s dtype).
      predicate: traced bool scalar.
    """
    first = jnp.where(predicate, index[0], buffer.shape[0])
    return buffer.at[(first, *index[1:])].set(value.astype(buffer.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingEntry:
    """Entry ``entry`` of a ring of saved chunk inputs, read one slot input at a time where a backward pass
    uses it (`chunk_backward`, `chunk_backward_input`), never taken whole.

    A chunk's backward runs under a `jax.lax.cond` and loops, whose operands are buffers of their own: handed
    ``ring[entry]`` it would make XLA copy the entry (``[P, microbatch, ...]``, a chunk's activations) before
    the pass. Handed the ring and the index it slices ``[microbatch, ...]`` inputs out of the ring in place,
    which stays one buffer, only read inside the pass.

    Attributes:
      ring: ``[E, P, microbatch, ...]`` the saved chunk inputs (1F1B's ring, GPipe's steps).
      entry: int32 scalar, the entry read.
    """

    ring: jax.Array
    entry: jax.Array

    def __getitem__(self, k):
        """Slot input ``k`` (traced int32 scalar): ``[microbatch, ...]``."""
        return self.rows(k, 1)[0]

    def rows(self, start, size: int):
        """Slot inputs ``start ... start + size - 1`` (``start`` traced int32): ``[size, microbatch, ...]``."""
        zero = jnp.zeros((), jnp.int32)
        index = (self.entry, start) + (zero,) * (self.ring.ndim - 2)
        return jax.lax.dynamic_slice(self.ring, index, (1, size, *self.ring.shape[2:]))[0]


def slot_params(params, r, k):
    """Slot ``k`` of chunk ``r`` from leaves ``[R, K, ...]`` (traced int32 indices): leaves ``[...]``."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(index_leaf(w, r), k, keepdims=False), params)


def add_slot(grads, r, k, update):
    """``grads[r, k] += update`` for leaves ``[R, K, ...]`` (a slot-sized update, in ``grads``' dtype)."""

    def add(acc, d):
        zero = jnp.zeros((), jnp.int32)
        index = (r, k) + (zero,) * (acc.ndim - 2)
        old = jax.lax.dynamic_slice(acc, index, (1, 1, *acc.shape[2:]))
        return jax.lax.dynamic_update_slice(acc, old + d[None, None].astype(acc.dtype), index)

    return jax.tree.map(add, grads, update)


def _forward_slot(layer_fn, slot, h, applied, extras, on, skip_empty: bool):
    """One slot of a chunk's forward pass: ``(h, applied)`` after the layer when ``on`` (else ``h`` unchanged).

    ``slot`` returns the slot's parameters; with ``skip_empty`` it is read inside the `jax.lax.cond`'s branch.
    Computing every slot (``skip_empty`` False) counts the layer as applied whether or not it is kept.
    ``applied`` is an int32 count, or ``(count, objective)`` for a layer with an objective (`chunk_forward`):
    then the layer returns ``(h, objective)`` and its float32 objective ``[n]`` is added where the slot is on.
    """
    tally = isinstance(applied, tuple)

    def apply(h, applied):
        if not tally:
            return layer_fn(slot(), h, *extras), applied + 1
        out, objective = layer_fn(slot(), h, *extras)
        count, total = applied
        return out, (count + 1, total + objective.astype(total.dtype))

    if skip_empty:
        return jax.lax.cond(on, apply, lambda h, applied: (h, applied), h, applied)
    new, counted = apply(h, applied)
    if tally:  # the objective of a slot that is not on is computed, not kept
        counted = (counted[0], jnp.where(on, counted[1], applied[1]))
    return jnp.where(on, new, h), counted


def objective_tally(axes, size: int):
    """The start of a chunk's count and objective for a layer with an objective of ``size`` entries: ``(0,
    zeros [size])``, int32 varying over ``stage`` and float32 varying over ``axes`` (the manual axes the
    objective's partial sums vary over: ``stage`` and the batch axes)."""
    return to_varying(jnp.zeros((), jnp.int32), ax.STAGE), to_varying(jnp.zeros((size,), jnp.float32), axes)


def objective_cotangent(size: int) -> jax.Array:
    """The cotangent of a layer objective ``[size]`` where the loss is differentiated: 1 for its entry 0 (what
    joins the loss), 0 for the statistics after it (`run_pipeline`'s ``objective``)."""
    return jnp.zeros((size,), jnp.float32).at[0].set(1.0)


def with_objective_cotangent(layer_fn, cotangent):
    """A layer with an objective ``(w, h, *extras) -> (h, objective)`` as a layer ``(w, h, *extras) -> h`` for
    the backward pass: differentiated at an output cotangent ``g`` it gives the derivative of ``(h,
    objective)`` at ``(g, cotangent)``, so the objective's gradient joins the layer's.

    Args:
      layer_fn: the layer with an objective (float32 ``[n]``: entry 0 joins the loss, the others are
        statistics).
      cotangent: float32 ``[n]``, the cotangent of the summed objective (`objective_cotangent` where the loss
        is differentiated inside the pipeline, then scaled with it).
    """

    def layer(w, h, *extras):
        out, objective = layer_fn(w, h, *extras)
        return _attach_objective(out, objective, cotangent)

    return layer


@jax.custom_vjp
def _attach_objective(h, objective, cotangent):
    """``h``; its derivative also sends ``cotangent`` to ``objective`` (`with_objective_cotangent`)."""
    return h


def _attach_forward(h, objective, cotangent):
    return h, (objective, cotangent)


def _attach_backward(residuals, g):
    objective, cotangent = residuals
    g_objective = to_varying(cotangent.astype(objective.dtype), tuple(varying_axes(objective)))
    return g, g_objective, jnp.zeros_like(cotangent)


_attach_objective.defvjp(_attach_forward, _attach_backward)


def _backward_slot(layer_fn, slot, x, extras, on, g, acc, add, skip_empty: bool):
    """One slot of a chunk's backward pass: the layer recomputed from its input ``x`` and differentiated.

    Returns ``(g, acc)``: the cotangent of the slot's input and ``add(acc, dw)``; a slot not ``on`` passes ``g``
    through and adds nothing (zeros, when every slot is computed).
    """

    def back(g, acc):
        _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), slot(), x)
        dw, dh = vjp(g)
        return dh, add(acc, dw)

    if skip_empty:
        return jax.lax.cond(on, back, lambda g, acc: (g, acc), g, acc)
    _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), slot(), x)
    dw, dh = vjp(g)
    dw = jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros((), d.dtype)), dw)
    return jnp.where(on, dh, g), add(acc, dw)


def chunk_forward(
    layer_fn, params, r, h, extras, count, skip_empty: bool, save: bool, objective_axes=None, objective_size: int = 1
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
      objective_axes: None, or the layer returns ``(h, objective)`` (float32 ``[objective_size]``, this
        device's partial sums) and the objectives of the slots computed are summed, varying over these manual
        axes.

    Returns:
      ``(h, applied, inputs)``: the activations, the layers computed (int32; with ``objective_axes``,
      ``(count, objective)``) and, when ``save``, ``[P, microbatch, ...]`` slot inputs (else None), ``P`` =
      `slot_positions`.
    """
    applied = to_varying(jnp.zeros((), jnp.int32), ax.STAGE)
    if objective_axes is not None:
        applied = objective_tally(objective_axes, objective_size)
    if isinstance(params, Streamed):
        return params.forward(layer_fn, r, h, applied, extras, count, skip_empty, save)
    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        h, applied = carry
        out = _forward_slot(layer_fn, lambda: slot_params(params, r, k), h, applied, extras, k < count, skip_empty)
        return out, (h if save else None)

    (h, applied), inputs = jax.lax.scan(body, (h, applied), jnp.arange(slots))
    return h, applied, inputs


def chunk_backward(layer_fn, params, r, inputs, extras, count, g, grads, skip_empty: bool):
    """The backward pass of `chunk_forward`: slots in reverse, each layer recomputed from its saved input.

    Args:
      inputs: the `RingEntry` of the ``P`` slot inputs saved by the forward pass.
      g: cotangent of the chunk's output.
      grads: accumulated parameter cotangents, leaves ``[R, K, ...]`` (or, with a `Streamed` ``params``,
        its reduce-scattered accumulators, `Streamed.zeros`).
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
        return _backward_slot(layer_fn, slot, inputs[k], extras, k < count, g, grads, add, skip_empty), None

    (g, grads), _ = jax.lax.scan(body, (g, grads), jnp.arange(slots), reverse=True)
    return g, grads


def slot_positions(params) -> int:
    """``P``: the slot inputs one chunk's forward pass saves (`chunk_forward`): ``K`` for a working copy
    ``[R, K, ...]``, `Streamed.saved` for a `Streamed` one."""
    if isinstance(params, Streamed):
        return params.saved
    return jax.tree.leaves(params)[0].shape[1]


def chunk_backward_input(layer_fn, params, r, inputs, extras, count, g, kept, entry, skip_empty: bool):
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
            dx, saved = cut.input_pass(slot_params(params, r, k), x, g, extras)
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


def put_cut(kept, entry, position, saved, predicate):
    """``kept[entry, position] = saved`` leaf by leaf where ``predicate`` (slot-sized updates, `store`)."""
    return tuple(store(b, (entry, position), v, predicate) for b, v in zip(kept, saved))


def get_cut(kept, entry, position):
    """``kept[entry, position]`` leaf by leaf (slot-sized reads)."""

    def one(buffer):
        zero = jnp.zeros((), jnp.int32)
        index = (entry, position) + (zero,) * (buffer.ndim - 2)
        return jax.lax.dynamic_slice(buffer, index, (1, 1, *buffer.shape[2:]))[0, 0]

    return tuple(one(b) for b in kept)


def _inverse_rows(local_index: np.ndarray, size: int, width: int) -> np.ndarray:
    """``[S, G, size]`` int32: for each device's local row, the slot of ``local_index`` ``[S, G, W]`` that takes
    it, or ``width`` (a zero row) where none does.

    Raises:
      ValueError: a local row taken by two slots (a placement `Weights` cannot invert).
    """
    stages, groups, _ = local_index.shape
    inverse = np.full((stages, groups, size), width, np.int32)
    for s in range(stages):
        for g in range(groups):
            for w, row in enumerate(local_index[s, g]):
                if row < 0:
                    continue
                if inverse[s, g, row] != width:
                    raise ValueError(
                        f"pipeline storage: local row {row} of device ({s}, {g}) feeds slots "
                        f"{inverse[s, g, row]} and {w}"
                    )
                inverse[s, g, row] = w
    return inverse


@dataclasses.dataclass(frozen=True)
class Weights:
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
      span: the devices each stored row's features are split over (the per-microbatch gather's
        feature-split storage, `sharding.pipeline.storage.feature_devices`; 1 otherwise).
    """

    specs: Any
    summed: tuple[str, ...]
    dtype: Any
    storage: StageStorage | None = None
    groups: tuple[str, ...] = ()
    span: int = 1

    def gather(self, stacked, repeats: int):
        """This device's blocks -> its stage's whole ``[R, K, ...]`` weights in the compute dtype.

        Padded: one all-gather per leaf over its split batch axes. Unpadded: the rows stored for other
        devices move (one ``ppermute`` per distance that moves any), each device picks its slots' rows
        (empty slots zero) and one all-gather over the storage's group axes assembles the working copy.
        """

        def one(w, spec):
            if jnp.issubdtype(w.dtype, jnp.floating):
                w = w.astype(self.dtype)
            w = self._take_slots(w, spec) if self.storage is not None else gather_shards(w, spec)
            return w.reshape(repeats, w.shape[1] // repeats, *w.shape[2:])

        return jax.tree.map(one, stacked, self.specs)

    def _compute(self, w):
        """``w`` in the compute dtype where it is floating point."""
        return w.astype(self.dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w

    def _where(self):
        """``(stage, g)``: this device's stage and index along the group axes (traced int32)."""
        stage = jax.lax.axis_index(ax.STAGE)
        return stage, (jax.lax.axis_index(self.groups) if self.groups else jnp.zeros((), jnp.int32))

    def _send(self, x, d: int, back: bool = False):
        """``ppermute`` of ``x`` by ``d`` devices along the ``(stage, *groups)`` ring (``back``: the other way)."""
        devices = self.storage.stages * self.storage.groups
        pairs = [(p, (p + d) % devices) for p in range(devices)]
        return jax.lax.ppermute(x, (ax.STAGE, *self.groups), [(b, a) for a, b in pairs] if back else pairs)

    def _received_rows(self, w):
        """``[q, ...]`` rows -> ``[C, ...]`` the rows other devices store for this one (one ``ppermute`` per
        distance that moves any), or None when none moves (storage only)."""
        stage, g = self._where()
        parts = []
        for d, send in enumerate(self.storage.placement.sends):
            if send is not None:
                message = jnp.take(w, jnp.asarray(send)[stage, g], axis=0)
                parts.append(self._send(message, d))
        return jnp.concatenate(parts, axis=0) if parts else None

    def _local_rows(self, w):
        """``[q, ...]`` rows -> ``[q + C + 1, ...]``: this device's rows, the rows other devices store for it
        (`_received_rows`) and a zero row last, which the empty slots take (storage only)."""
        received = self._received_rows(w)
        # A zero row, not a select against a slot-sized zero array (XLA shares such a broadcast with the
        # backward pass's and materialises it before the step loop).
        parts = [w] + ([] if received is None else [received]) + [jnp.zeros((1, *w.shape[1:]), w.dtype)]
        return jnp.concatenate(parts, axis=0)

    def _slot_rows(self):
        """``[S, G, W]`` int32 numpy: the local row (`_local_rows`) each device gives working-copy slot
        ``w*G + g`` (the zero row for an empty slot)."""
        placement = self.storage.placement
        size = placement.per_device + placement.received
        return np.where(placement.local_index >= 0, placement.local_index, size)

    def _take_slots(self, w, spec):
        """``[q, ...]`` rows -> ``[1, R*K', ...]`` this stage's working copy (storage only; a feature-split
        storage's rows, ``spec`` naming their split features, gathered whole)."""
        stage, g = self._where()
        local = self._local_rows(w)  # [q + C + 1, ...]
        mine = jnp.take(local, jnp.asarray(self._slot_rows())[stage, g], axis=0)  # [W, ...]
        if not self.groups:
            return gather_shards(mine, spec)[None]
        full = jax.lax.all_gather(mine, self.groups, axis=1, tiled=False)  # [W, G, ...]: slot w*G + g
        return full.reshape(1, -1, *w.shape[1:])

    def _return_rows(self, g_slots, spec):
        """The transpose of `_take_slots` for gradients: ``[R*K', ...]`` -> ``[q, ...]``, summed over the group
        axes (reduce-scatter; a feature-split storage's features over ``spec``'s axes) and sent back to the
        devices storing the received rows."""
        if not self.groups:
            g_slots = reduce_shards(g_slots, spec, ())
        else:
            g_slots = g_slots.reshape(-1, self.storage.groups, *g_slots.shape[1:])
            g_slots = jax.lax.psum_scatter(g_slots, self.groups, scatter_dimension=1, tiled=False)  # [W, ...]
        return self._rows_of(g_slots)

    def _rows_of(self, g_slots):
        """This device's slots' gradients ``[W, ...]`` (already summed over the group axes) -> its rows'
        ``[q, ...]``, the received rows' sent back to the devices storing them."""
        placement = self.storage.placement
        stage, g = self._where()
        # A gather by the inverse of the slots' rows (each local row feeds at most one slot), not a scatter into
        # zeros: XLA materialises a scatter's zero operand before the step loop, through the peak.
        width = g_slots.shape[0]
        inverse = _inverse_rows(placement.local_index, placement.per_device + placement.received, width)
        padded = jnp.concatenate([g_slots, jnp.zeros((1, *g_slots.shape[1:]), g_slots.dtype)], axis=0)
        return self._send_back(jnp.take(padded, jnp.asarray(inverse)[stage, g], axis=0))

    def _send_back(self, local):
        """Gradients of the local rows ``[q + C, ...]`` -> of the stored rows ``[q, ...]``: the received rows'
        sent back to the devices storing them (the transpose of `_received_rows`) and added there."""
        placement = self.storage.placement
        stage, g = self._where()
        q = placement.per_device
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

        def one(g, w, spec):
            g = g.reshape(1, g.shape[0] * g.shape[1], *g.shape[2:])
            if self.storage is None:
                return reduce_shards(g, spec, self.summed).astype(w.dtype)
            rows = self._return_rows(g[0], spec)
            return self._psum_rest(rows, spec).astype(w.dtype)

        return jax.tree.map(one, grads, stacked, self.specs)

    def _psum_rest(self, rows, spec):
        """Stored rows' gradients summed over the batch axes they are still partial over: ``summed`` less the
        group axes and the axes ``spec`` splits the features over (both already reduce-scattered)."""
        return psum_unsplit(rows, spec, self.summed, self.groups)

    def stream(self, stacked, repeats: int, received=None, block_inputs: bool = True) -> Streamed:
        """The per-microbatch gather (``--pipeline-gather microbatch``): what stays local for the step.

        Unpadded storage: the rows other devices store for this one arrive once (`_received_rows`, in the
        compute dtype; no gather over the group axes yet); ``received``: those rows already made (a backward
        pass reusing its forward pass's), else made here. Padded: the blocks as they are. ``block_inputs``:
        a chunk's forward saves each block's input only (`Streamed.block_inputs`).
        """
        if self.storage is not None:
            if received is None and any(send is not None for send in self.storage.placement.sends):
                received = jax.tree.map(lambda w: self._received_rows(self._compute(w)), stacked)
            chunk_slots = self.storage.placement.chunk_slots
            # whole rows: a block is one row of each of the G devices; split features: the slots whose
            # inputs the forward saves one of (each slot is gathered where it runs, `Streamed.per_slot`)
            block = self.storage.groups if self.groups else (self.span if block_inputs else 1)
            return Streamed(self, stacked, received, repeats, chunk_slots, block, block_inputs and block > 1)
        return Streamed(self, stacked, None, repeats, jax.tree.leaves(stacked)[0].shape[1] // repeats, 1)

    def finish(self, sums, stacked):
        """`Streamed` gradient sums (reduce-scattered per pass, `Streamed.zeros`) -> the blocks' gradients:
        summed over the batch axes not yet reduced, in the blocks' dtype."""

        def one(g, w, spec):
            if self.storage is None:
                return psum_unsplit(g, spec, self.summed).astype(w.dtype)
            return self._psum_rest(self._send_back(g), spec).astype(w.dtype)

        return jax.tree.map(one, sums, stacked, self.specs)


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A stage's layer weights gathered per pass of a chunk, one block of ``B`` slots at a time
    (``--pipeline-gather microbatch``; MaxText's alternative to ``pipeline_fsdp_ag_once``).

    The working copy's slots ``[R*K', ...]`` fall into ``W = R*K'/B`` blocks of ``B`` consecutive slots:
    with the unpadded storage ``B = G`` (device ``g`` of the stage provides slot ``w*B + g`` of block ``w``:
    one all-gather over the group axes assembles a block), with padded blocks ``B = 1`` (each slot's
    FSDP-shards all-gathered). A chunk pass (`chunk_forward`, `chunk_backward`, or zero bubble's
    `chunk_backward_input` and `chunk_backward_weight`) gathers the ``n`` blocks that
    cover chunk ``r`` (slots ``r*K' ... r*K' + K' - 1``) in the compute dtype, one at a time, outside the
    slots' conditionals, and its backward pass (zero bubble: its weight-gradient pass) reduce-scatters each
    block's gradient into float32 sums of this device's rows (`zeros`) as soon as the block is done. A pass
    that runs no layer (a bubble tick, or the idle half of a lockstep tick) is skipped whole, its gathers
    with it: they are among the devices of one stage, which all skip it alike. So a step holds one block's
    gathered weights and gradients instead of the stage's, at the price of a gather per chunk pass forward
    and backward (the backward recomputes from a second gather; zero bubble's weight-gradient pass gathers
    nothing where it reads no weight) and a reduce-scatter per backward pass.

    With `block_inputs` a chunk's forward pass saves only each block's input (``n`` activations per chunk
    instead of ``n*B``, `saved`): the backward pass, which gathers the block anyway, first recomputes the
    block's other ``B - 1`` slot inputs from it (``(B - 1) / B`` of a forward more per layer, no gather more),
    then differentiates the slots as before. Chen et al., "Training Deep Nets with Sublinear Memory Cost"
    (2016), section 4: checkpoints every ``B`` layers, the segment between recomputed in the backward pass.

    With the per-microbatch gather's own storage (`per_slot`: rows over ``stage`` only, each row's features
    split over the stage's ``G`` devices, `sharding.pipeline.storage.storage_axes`) nothing is gathered per
    block: each slot's layer is all-gathered over the feature axes where it runs (inside the slot's
    conditional) and its gradient reduce-scattered into this device's share of the row as soon as the slot's
    backward is done, so a pass holds one layer and one layer's gradient instead of ``G`` of each; blocks of
    ``B = G`` slots then only say which activations the forward saves (`block_inputs`), and the backward's
    recomputation of a block's ``B - 1`` other inputs gathers those layers once more.

    Attributes:
      weights: the `Weights` whose storage and specs these are.
      stacked: per leaf, this device's block as stored: ``[q, ...]`` rows (storage) or ``[1, R*K, ...]``.
      received: per leaf, ``[C, ...]`` rows other devices store for this one (`Weights._received_rows`), or
        None when none moves.
      repeats: R, chunks per stage.
      chunk_slots: K', slots per chunk of the working copy.
      block: B, slots per gathered block.
      block_inputs: a chunk's forward saves each block's input only, not each slot's (the backward, or zero
        bubble's input-gradient pass, recomputes the rest).
    """

    weights: Weights
    stacked: Any
    received: Any
    repeats: int
    chunk_slots: int
    block: int
    block_inputs: bool = False

    @property
    def windows(self) -> int:
        """W, blocks in the working copy."""
        return self.repeats * self.chunk_slots // self.block

    @property
    def slots(self) -> int:
        """``R*K'``, slots in the working copy."""
        return self.repeats * self.chunk_slots

    @property
    def per_slot(self) -> bool:
        """Each slot gathered on its own, over the feature axes (a storage whose rows are not spread over the
        stage's devices: `sharding.pipeline.storage.storage_axes` with ``"microbatch"``)."""
        return self.weights.storage is not None and not self.weights.groups

    def _block(self, w):
        """Block ``w``'s gathered weights, leaves ``[B, ...]`` (`fetch`), or None with `per_slot`."""
        return None if self.per_slot else self.fetch(jnp.minimum(w, self.windows - 1))

    def _slot_index(self, w, j):
        """The working-copy slot of slot ``j`` of block ``w`` (clamped into the copy; past it no slot is on)."""
        return jnp.minimum(w * self.block + j, self.slots - 1)

    def _slot(self, block, w, j):
        """Slot ``j`` of block ``w``'s weights: from the gathered ``block``, or (``block`` None, `per_slot`)
        the slot's layer all-gathered here."""
        if block is not None:
            return index_tree(block, j)
        return index_tree(self.fetch(self._slot_index(w, j)), 0)

    def _stand_in(self):
        """Zeros typed as one slot's weights (for tracing a layer's backward, `LayerSplit.trace`)."""
        shapes = jax.eval_shape(self.fetch, jnp.zeros((), jnp.int32))
        return index_tree(to_varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), self._vary()), 0)

    @property
    def blocks(self) -> int:
        """n, blocks one chunk pass gathers: enough to cover any chunk (one more where ``B`` does not divide
        ``K'`` and a chunk straddles two blocks)."""
        k, b = self.chunk_slots, self.block
        return max(-(-(r + 1) * k // b) - (r * k) // b for r in range(self.repeats))

    @property
    def positions(self) -> int:
        """P = ``n * B``: the slot positions a chunk pass covers (some of them empty)."""
        return self.blocks * self.block

    @property
    def saved(self) -> int:
        """The activations a chunk's forward pass saves for its backward: ``n`` block inputs with
        `block_inputs`, else ``P`` slot inputs."""
        return self.blocks if self.block_inputs else self.positions

    def _vary(self):
        return (ax.STAGE, *self.weights.summed)

    def _row(self, w):
        """``(row, q, C)``: the local row (own rows first, then received; ``q + C``: none) of block ``w``'s
        slot on this device (storage only)."""
        weights = self.weights
        stage, g = weights._where()
        placement = weights.storage.placement
        return jnp.asarray(weights._slot_rows())[stage, g, w], placement.per_device, placement.received

    def fetch(self, w):
        """Block ``w`` (traced int32 in ``[0, W)``): leaves ``[B, ...]`` in the compute dtype, device-varying
        over ``stage`` and the batch axes (so differentiating a layer adds no reduction inside the loop).
        With `per_slot`, ``w`` is a working-copy slot in ``[0, R*K')`` and the leaves ``[1, ...]``: its row's
        features all-gathered."""
        weights = self.weights
        received = self.received if self.received is not None else jax.tree.map(lambda _: None, self.stacked)

        def one(own, extra, spec):
            if weights.storage is None:
                x = index_leaf(own[0], w)
            else:
                row, q, c = self._row(w)
                # Row-sized reads and selects: no copy of the stored rows.
                x = weights._compute(index_leaf(own, jnp.minimum(row, q - 1)))
                if extra is not None:
                    x = jnp.where(row < q, x, index_leaf(extra, jnp.clip(row - q, 0, c - 1)))
                x = jnp.where(row < q + c, x, jnp.zeros((), x.dtype))
            x = weights._compute(x)
            if weights.storage is None:
                return gather_shards(x, P(*tuple(spec)[2:]))[None]
            if not weights.groups:
                return gather_shards(x, P(*tuple(spec)[1:]))[None]
            return jax.lax.all_gather(x, weights.groups, axis=0, tiled=False)  # [G, ...]: slot w*G + g

        return to_varying(jax.tree.map(one, self.stacked, received, weights.specs), self._vary())

    def zeros(self):
        """The float32 gradient sums of this device's rows: leaves ``[q + C, ...]`` (storage: own rows, then
        received) or ``[1, R*K, ...]`` of the blocks' local shape (padded)."""
        weights = self.weights
        received = self.received if self.received is not None else jax.tree.map(lambda _: None, self.stacked)

        def one(own, extra):
            dtype = jnp.promote_types(own.dtype, jnp.float32)
            rows = own.shape[0] + (0 if extra is None else extra.shape[0])
            return jnp.zeros((rows, *own.shape[1:]) if weights.storage is not None else own.shape, dtype)

        return to_varying(jax.tree.map(one, self.stacked, received), self._vary())

    def _add(self, sums, w, block_grads):
        """Block ``w``'s gradients ``[B, ...]`` reduce-scattered over the axes the block was gathered over and
        added to this device's row of ``sums`` (`zeros`); with `per_slot`, slot ``w``'s ``[1, ...]``."""
        weights = self.weights

        def one(acc, d, spec):
            # Reduced in the sums' float32, as the cost model prices it and as NeMo's bf16 mixed-precision recipe
            # does (``grad_reduce_in_fp32``); XLA's CPU compiler also aborts on a bfloat16 reduce-scatter here
            # (``AllReducePromotion``, as in `stage_varying`).
            d = d.astype(acc.dtype)
            if weights.storage is None:
                d = reduce_shards(d[0], P(*tuple(spec)[2:]), ())
                old = jax.lax.dynamic_index_in_dim(acc, w, axis=1, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(acc, (old + d.astype(acc.dtype))[None], w, 1)
            if weights.groups:
                d = jax.lax.psum_scatter(d, weights.groups, scatter_dimension=0, tiled=False)
            else:
                d = reduce_shards(d[0], P(*tuple(spec)[1:]), ())
            row, q, c = self._row(w)
            at = jnp.minimum(row, q + c - 1)
            d = jnp.where(row < q + c, d.astype(acc.dtype), jnp.zeros((), acc.dtype))  # an empty slot adds nothing
            return jax.lax.dynamic_update_index_in_dim(acc, index_leaf(acc, at) + d, at, 0)

        return jax.tree.map(one, sums, block_grads, weights.specs)

    def _start(self, r):
        """The first block chunk ``r`` touches (traced int32)."""
        return (r * self.chunk_slots) // self.block

    def forward(self, layer_fn, r, h, applied, extras, count, skip_empty: bool, save: bool):
        """`chunk_forward` with the weights gathered block by block (arguments as there)."""
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            w = start + i
            block = self._block(w)

            def inner(carry, j):
                h, applied = carry
                k = w * b + j - k0
                on = (k >= 0) & (k < count)
                out = _forward_slot(layer_fn, lambda: self._slot(block, w, j), h, applied, extras, on, skip_empty)
                return out, (h if save and not self.block_inputs else None)

            out, inputs = jax.lax.scan(inner, carry, jnp.arange(b))
            return out, (carry[0] if save and self.block_inputs else inputs)

        def run(h, applied):
            (h, applied), inputs = jax.lax.scan(outer, (h, applied), jnp.arange(self.blocks))
            return h, applied, (inputs.reshape(self.saved, *h.shape) if save else None)

        if not skip_empty:
            return run(h, applied)

        def idle(h, applied):
            zeros = jnp.zeros((self.saved, *h.shape), h.dtype) if save else None
            return h, applied, to_varying(zeros, self._vary())

        return jax.lax.cond(count > 0, run, idle, to_varying(h, self._vary()), applied)

    def backward(self, layer_fn, r, inputs, extras, count, g, sums, skip_empty: bool):
        """`chunk_backward` with the weights gathered again block by block and each block's gradient
        reduce-scattered into ``sums`` (`zeros`) once the block is done (arguments as there)."""
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            g, sums = carry
            w = start + i
            block = self._block(w)
            slot_of = lambda j: self._slot(block, w, j)  # noqa: E731
            xs = self._block_slot_inputs(layer_fn, slot_of, w * b - k0, inputs, i, extras, count, skip_empty)
            if block is None:  # each slot's gradient reduce-scattered into this device's row at once

                def each(carry, j):
                    g, sums = carry
                    k = w * b + j - k0
                    at = self._slot_index(w, j)
                    add = lambda sums, dw: self._add(sums, at, jax.tree.map(lambda d: d[None], dw))  # noqa: E731
                    on = (k >= 0) & (k < count)
                    x = index_leaf(xs, j)
                    return _backward_slot(layer_fn, lambda: slot_of(j), x, extras, on, g, sums, add, skip_empty), None

                return jax.lax.scan(each, (g, sums), jnp.arange(b), reverse=True)[0], None
            clamped = jnp.minimum(w, self.windows - 1)
            zero = to_varying(jax.tree.map(lambda p, a: jnp.zeros(p.shape, a.dtype), block, sums), self._vary())

            def inner(carry, j):
                g, acc = carry
                k = w * b + j - k0
                add = lambda acc, dw: add_block(acc, j, dw)  # noqa: E731
                x = index_leaf(xs, j)
                slot = lambda: index_tree(block, j)  # noqa: E731
                on = (k >= 0) & (k < count)
                return _backward_slot(layer_fn, slot, x, extras, on, g, acc, add, skip_empty), None

            (g, acc), _ = jax.lax.scan(inner, (g, zero), jnp.arange(b), reverse=True)
            return (g, self._add(sums, clamped, acc)), None

        def run(g, sums):
            (g, sums), _ = jax.lax.scan(outer, (g, sums), jnp.arange(self.blocks), reverse=True)
            return g, sums

        if not skip_empty:
            return run(g, sums)
        return jax.lax.cond(count > 0, run, lambda g, sums: (g, sums), to_varying(g, self._vary()), sums)

    def _block_slot_inputs(self, layer_fn, slot_of, first, inputs, i, extras, count, skip_empty: bool):
        """``[B, microbatch, ...]``: the inputs of block ``i``'s slots in a chunk pass, from ``inputs`` (a
        `RingEntry` of `saved` of them): read as saved, or, with `block_inputs`, the block's input read and the
        ``B - 1`` slots after it recomputed with the block's weights (``slot_of(j)``: slot ``j``'s, `_slot`;
        ``first``: the chunk slot of the block's first slot; slots outside ``[0, count)`` pass their input
        through, as in the forward pass)."""
        b = self.block
        if not self.block_inputs:
            return inputs.rows(i * b, b)
        none = jnp.zeros((), jnp.int32)

        def step(h, j):
            k = first + j
            on = (k >= 0) & (k < count)
            out, _ = _forward_slot(layer_fn, lambda: slot_of(j), h, none, extras, on, skip_empty)
            return out, h

        last, before = jax.lax.scan(step, inputs[i], jnp.arange(b - 1))
        return jnp.concatenate([before, last[None]], axis=0)

    def backward_input(self, layer_fn, r, inputs, extras, count, g, kept, entry, skip_empty: bool):
        """`chunk_backward_input` (zero bubble's B pass) with the weights gathered again block by block (with
        `block_inputs`, each block's other slot inputs recomputed first, as `backward` does): each slot's cut
        (`LayerSplit.input_pass`) written into entry ``entry`` of the saved ring ``kept`` (``[E, P, ...]``) at
        its position, no gradient of the weights.

        Returns:
          ``(g, kept)``: the cotangent of the chunk's input and the ring (positions outside the chunk pass ``g``
          through and write nothing).
        """
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(carry, i):
            g, kept = carry
            w = start + i
            block = self._block(w)
            slot_of = lambda j: self._slot(block, w, j)  # noqa: E731
            xs = self._block_slot_inputs(layer_fn, slot_of, w * b - k0, inputs, i, extras, count, skip_empty)

            def inner(carry, j):
                g, kept = carry
                k = w * b + j - k0
                x = index_leaf(xs, j)
                like = self._stand_in() if block is None else index_tree(block, j)
                cut = LayerSplit.trace(layer_fn, like, x, g, extras)
                on = (k >= 0) & (k < count)

                def back(g, kept):
                    dx, saved = cut.input_pass(slot_of(j), x, g, extras)
                    return dx, put_cut(kept, entry, i * b + j, saved, on)

                if skip_empty:
                    return jax.lax.cond(on, back, lambda g, kept: (g, kept), g, kept), None
                dx, kept = back(g, kept)
                return (jnp.where(on, dx, g), kept), None

            return jax.lax.scan(inner, (g, kept), jnp.arange(b), reverse=True)[0], None

        def run(g, kept):
            return jax.lax.scan(outer, (g, kept), jnp.arange(self.blocks), reverse=True)[0]

        if not skip_empty:
            return run(g, kept)
        return jax.lax.cond(count > 0, run, lambda g, kept: (g, kept), to_varying(g, self._vary()), kept)

    def backward_weight(self, layer_fn, r, kept, entry, extras, count, sums, like, skip_empty: bool):
        """`chunk_backward_weight` (zero bubble's W pass) from the cuts `backward_input` left in entry ``entry``
        of the saved ring: the weight-gradient products of each slot, and each block's gradient
        reduce-scattered into ``sums`` (`zeros`) once the block is done. The block is gathered only where the
        weight pass reads the weights (`LayerSplit.needs_params`; a dense layer's does not).

        Returns:
          ``sums`` with this chunk's slots added.
        """
        start, b, k0 = self._start(r), self.block, r * self.chunk_slots

        def outer(sums, i):
            w = start + i
            clamped = jnp.minimum(w, self.windows - 1)
            stand_in = self._stand_in()
            cut = LayerSplit.trace(layer_fn, stand_in, like, like, extras)
            if self.per_slot:  # each slot's gradient reduce-scattered into this device's row at once

                def each(sums, j):
                    k = w * b + j - k0
                    at = self._slot_index(w, j)
                    weights = lambda: self._slot(None, w, j) if cut.needs_params else stand_in  # noqa: E731

                    def dw():
                        return jax.tree.map(
                            lambda d: d[None], cut.weight_pass(weights(), get_cut(kept, entry, i * b + j))
                        )

                    on = (k >= 0) & (k < count)
                    if skip_empty:
                        return jax.lax.cond(on, lambda sums: self._add(sums, at, dw()), lambda sums: sums, sums), None
                    kept_dw = jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros((), d.dtype)), dw())
                    return self._add(sums, at, kept_dw), None

                return jax.lax.scan(each, sums, jnp.arange(b))[0], None
            if cut.needs_params:
                block = self.fetch(clamped)
            else:
                block = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (b, *a.shape)), stand_in)
            zero = to_varying(jax.tree.map(lambda p, a: jnp.zeros(p.shape, a.dtype), block, sums), self._vary())

            def inner(acc, j):
                k = w * b + j - k0

                def dw():
                    return cut.weight_pass(index_tree(block, j), get_cut(kept, entry, i * b + j))

                on = (k >= 0) & (k < count)
                if skip_empty:
                    return jax.lax.cond(on, lambda acc: add_block(acc, j, dw()), lambda acc: acc, acc), None
                kept_dw = jax.tree.map(lambda d: jnp.where(on, d, jnp.zeros((), d.dtype)), dw())
                return add_block(acc, j, kept_dw), None

            acc, _ = jax.lax.scan(inner, zero, jnp.arange(b))
            return self._add(sums, clamped, acc), None

        def run(sums):
            return jax.lax.scan(outer, sums, jnp.arange(self.blocks))[0]

        if not skip_empty:
            return run(sums)
        return jax.lax.cond(count > 0, run, lambda sums: sums, sums)


def add_block(acc, j, update):
    """``acc[j] += update`` for leaves ``[B, ...]`` (a slot-sized update, in ``acc``'s dtype)."""
    return jax.tree.map(
        lambda a, d: jax.lax.dynamic_update_index_in_dim(a, index_leaf(a, j) + d.astype(a.dtype), j, 0), acc, update
    )


def manual_axes(par) -> tuple[str, ...]:
    """The axes the stage program is manual over: ``stage`` and the batch axes (``data``, ``fsdp``)."""
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
            raise ValueError("run_pipeline needs a Parallelism whose strategy is a PipelinePlan")
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
                    "are not; use ",
                    Field("batch_size"),
                    " a multiple of ",
                    Field("microbatches"),
                    " x data x fsdp, or ",
                    Field("rule", "batch=data+fsdp"),
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
                f"are not (the rule batch -> {'+'.join(spec_axes(batch)) or 'none'}); use a batch whose "
                f"microbatches split over {axes} too (",
                Field("batch_size"),
                " a multiple of ",
                Field("microbatches"),
                " x data x fsdp), or ",
                Field("rule", "batch=data+fsdp"),
            )
