"""The loop buffers of a pipeline's stage program: microbatches, slot-sized reads and writes, one slot's pass.

What every schedule's tick loop (`sharding.pipeline.schedule`, `sharding.pipeline.onef1b`) and the weights
(`sharding.pipeline.weights`) read and write one slot at a time:

* `to_microbatches` / `from_microbatches`: a batch cut into microbatches and back;
* `index_tree`, `index_leaf`, `write`, `store`, `slot_params`, `add_slot`, `add_block`: slice-sized reads and
  predicated writes of the loop's buffers (a `jnp.where` on one slice, never on a whole buffer; `store`, for
  the rings a loop carries, reads nothing of the buffer, so XLA updates it in place), and `RingEntry`, the
  backward's view of one entry of a ring of saved inputs, read in place; `put_cut` / `get_cut`, zero bubble's
  ring of what each input-gradient pass keeps for its weight-gradient pass;
* `forward_slot` / `backward_slot`: one slot of a chunk's forward pass under a `jax.lax.cond`, and its backward
  pass that recomputes the layer from its saved input and differentiates it with `jax.vjp`;
* `objective_tally`, `objective_cotangent`, `with_objective_cotangent`: a layer with an objective (a mixture
  of experts' balance loss) summed over the slots and differentiated with the loss.

No collective is issued here: every transfer between stages is the schedule's, in its tick loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sharding import axes as ax
from sharding.parallel import (
    to_varying,
    varying_axes,
)


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


def forward_slot(layer_fn, slot, h, applied, extras, on, skip_empty: bool):
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


def backward_slot(layer_fn, slot, x, extras, on, g, acc, add, skip_empty: bool):
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


def add_block(acc, j, update):
    """``acc[j] += update`` for leaves ``[B, ...]`` (a slot-sized update, in ``acc``'s dtype)."""
    return jax.tree.map(
        lambda a, d: jax.lax.dynamic_update_index_in_dim(a, index_leaf(a, j) + d.astype(a.dtype), j, 0), acc, update
    )
