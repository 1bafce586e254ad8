"""A stage's working copy padded for its storage's devices: the real slots moved by all-reduces.

Gathering once, a stage's working copy has ``R*K'`` slots, the layout's ``K`` per chunk rounded up until the
storage's ``G`` devices divide ``R*K'`` (`sharding.pipeline.storage.Placement.chunk_slots`); device ``g`` of the
group axes holds slots ``w*G + g``, ``W = R*K'/G`` of them. Where the padding is at least the layers (``K' >= 2K``,
`sharding.pipeline.weights.Weights.all_reduced`) the copy is assembled and its gradient sums reduced over the
``R*K`` real slots alone: each device puts its slots at their real places (zeros elsewhere) and one all-reduce
sums them (`sum_owned`); the summed gradients are picked back for each device's slots (`own_slots`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharding.pipeline.storage import StageStorage


def own_slots(x, storage: StageStorage, repeats: int, g, back: bool = True):
    """Between the real slots ``[R, K, ...]`` and device ``g``'s working-copy slots ``[W, ...]``.

    Args:
      x: ``back``: the real slots' sums ``[R, K, ...]`` (already summed over the group axes); else the device's
        slots ``[W, ...]``.
      storage: the `StageStorage` (its layout's ``K``, its placement's ``K'``, its ``G`` groups).
      repeats: R.
      g: int32 scalar (traced), this device's index along the group axes.
      back: the direction.

    Returns:
      ``back``: ``[W, ...]``, the sums of the device's slots (zeros for a padded one), as a reduce-scatter of
      the padded sums gives; else ``[R, K, ...]``, the device's slots at their real places and zeros at the
      others' (summed over the group axes by `sum_owned`).
    """
    k, padded, groups = storage.layout.chunk_slots, storage.placement.chunk_slots, storage.groups
    slot = np.arange(repeats * padded).reshape(-1, groups).T  # [G, W] working-copy slots of each device
    r, j = slot // padded, slot % padded
    if back:
        table = np.where(j < k, r * k + j, repeats * k)  # into the real slots, or the zero row
        flat = x.reshape(repeats * k, *x.shape[2:])
    else:  # [G, R*K]: which of the device's W slots each real slot is, W (the zero row) where another's
        real = np.arange(repeats * k)
        at = (real // k) * padded + real % k  # each real slot's working-copy slot
        table = np.where(at[None] % groups == np.arange(groups)[:, None], at[None] // groups, slot.shape[1])
        flat = x
    flat = jnp.concatenate([flat, jnp.zeros((1, *flat.shape[1:]), flat.dtype)], axis=0)
    out = jnp.take(flat, jnp.asarray(table.astype(np.int32))[g], axis=0)
    return out if back else out.reshape(repeats, k, *out.shape[1:])


def sum_owned(x, axes):
    """``psum`` over ``axes`` of an array whose every element is nonzero on at most one device (the others hold
    +0): exact in any dtype. A 16-bit float array with an even last dimension is summed as its bit patterns,
    two to a ``uint32`` (a bit pattern plus zeros is itself; the same bytes as the array): XLA:CPU aborts on a
    bfloat16 all-reduce (``AllReducePromotion``: "Invalid binary instruction opcode copy")."""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or x.shape[-1] % 2:
        return jax.lax.psum(x, axes)
    pairs = jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.psum(pairs, axes), x.dtype).reshape(x.shape)
