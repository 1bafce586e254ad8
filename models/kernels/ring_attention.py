"""Ring attention over a mesh axis: exact attention on sequences split across devices.

Source: Hao Liu, Matei Zaharia, Pieter Abbeel, "Ring Attention with Blockwise Transformers
for Near-Infinite Context" (2023), Section 3 and Algorithm 1. The sequence is split into P
blocks along a mesh axis (the `sequence` axis in meshwork); each device keeps its query
block while the key/value blocks travel around a ring of the P devices (`lax.ppermute`),
one hop per step. Each step attends the local queries to the visiting keys with our
FlashAttention-2 kernel (`flash_attention_forward`, which also returns the log-sum-exp) and
merges the partial output into a running one by log-sum-exp (the blockwise softmax of
Section 2, as in FlashAttention's online softmax). The backward pass (`jax.custom_vjp`) is
a second ring: dq is accumulated locally, while dk and dv travel with their key/value block
and arrive home after the last step, so every device holds O(length / P) of everything.
The next block's transfer is issued before the current block is computed, so XLA can
overlap communication with the kernel.

Every device runs the same P steps (a collective inside a loop with a per-device trip
count deadlocks); blocks a causal mask hides entirely are skipped with `lax.switch`, not by
leaving the loop.

Layouts of the sequence over the P devices (`layout`):

* ``contiguous``: device r holds tokens [r L/P, (r+1) L/P). Under a causal mask device r
  attends r + 1/2 blocks' worth of keys, so the last device does about (2P-1)/P times the
  mean work.
* ``zigzag``: the sequence is cut into 2P equal chunks and device r holds chunks r and
  2P-1-r, concatenated (`zigzag_permutation`). Every device then does the same work: the
  causal diagonal of its own two chunks at step 0, and exactly half a block at every later
  step. This is the load-balanced layout of context parallelism in Megatron-LM and Llama 3
  (Llama Team, "The Llama 3 Herd of Models", 2024, Section 3.3.2). The caller permutes the
  tokens (and positions, segment ids, targets) once on the host; attention needs no
  gathering.

Uneven shards (`shares`, for devices of unequal speed): device r holds ``shares[r]`` real
tokens, half in each of its two zigzag chunks, inside a block of the same shape on every
device (each chunk padded at its end to the largest half; `uneven_zigzag_layout`). The
natural sequence is cut into 2P chunks of ``shares[0]/2, ..., shares[P-1]/2,
shares[P-1]/2, ..., shares[0]/2`` tokens: mirrored, so device r's causal work is
``shares[r]/2 x (length + 1)`` query-key pairs, in proportion to its real tokens (the zigzag
balance, per device). Each step attends chunk by chunk (the flash kernels' valid lengths mask
the padding and skip tiles of padding only), so a device does work in proportion to its share.

Einsum letters: B batch, T length (queries, local), S length (keys, local), N heads, K kv
heads, H head_dim, P ring size (devices along the axis). Local arrays: queries `[B, T, N, H]`,
keys and values `[B, S, K, H]` with S = T (self-attention).

This module holds the layouts (`zigzag_permutation`, `uneven_zigzag_layout`), the tile counts, the
input checks and `ring_attention`; the per-device rings it runs (forward, backward, uneven shards, their
``jax.custom_vjp``) are in `models.kernels.ring_kernels`.

Imports nothing from meshwork except the sibling flash-attention kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .flash_attention import flash_attention, forward_tile_count
from .flash_blocks import BlockSizes
from .ring_kernels import (
    CONTIGUOUS,
    DIAGONAL,
    FULL,
    LAYOUTS,
    LOWER,
    SKIP,
    UPPER,
    ZIGZAG,
    _Ring,
    _ring_attention,
    _vary_union,
    step_kind_index,
    step_kinds,
)


def zigzag_permutation(length: int, num_shards: int) -> np.ndarray:
    """Token order of the zigzag layout: position i of the permuted sequence holds token
    `perm[i]` of the natural one.

    The sequence is cut into 2P chunks of `length / (2P)` tokens; shard r (the r-th 1/P of
    the permuted sequence) holds chunks r and 2P-1-r, in that order.

    Args:
      length: L, tokens in the sequence; a multiple of 2 * num_shards.
      num_shards: P, devices along the sequence axis.

    Returns:
      int64 `[length]` permutation; `x[..., perm]` puts a natural-order sequence in zigzag
      order, `x[..., np.argsort(perm)]` undoes it.

    Raises:
      ValueError: when length is not a multiple of 2 * num_shards.
    """
    if num_shards < 1 or length % (2 * num_shards):
        raise ValueError(
            f"the zigzag layout needs the length ({length}) to be a multiple of 2 x the "
            f"sequence-axis size ({num_shards}), i.e. of {2 * num_shards}"
        )
    chunk = length // (2 * num_shards)
    chunks = np.arange(length).reshape(2 * num_shards, chunk)
    order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
    return chunks[order].reshape(-1)


def uneven_zigzag_layout(shares: Sequence[int], local_length: int) -> np.ndarray:
    """Token order of the zigzag layout with uneven shards: position i of the laid-out sequence
    holds token ``order[i]`` of the natural one, or padding where ``order[i] == -1``.

    Device r's block (positions ``[r * local_length, (r + 1) * local_length)``) is two chunks of
    ``local_length / 2`` positions: natural chunk r, then natural chunk 2P-1-r, each holding
    ``shares[r] / 2`` real tokens followed by padding. The natural chunk sizes are
    ``shares[0]/2, ..., shares[P-1]/2, shares[P-1]/2, ..., shares[0]/2``. With equal shares of
    ``local_length`` tokens it is `zigzag_permutation`.

    Args:
      shares: real tokens per device, P >= 1 even non-negative ints (their sum is the length).
      local_length: tokens per device block, even and at least ``max(shares)``.

    Returns:
      int64 ``[P * local_length]``: natural token index, -1 for padding.

    Raises:
      ValueError: an odd or negative share, or a block too small or odd.
    """
    _check_shares(shares, local_length)
    halves = [s // 2 for s in shares]
    sizes = halves + halves[::-1]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    chunk, p = local_length // 2, len(shares)
    order = np.full(p * local_length, -1, np.int64)
    for r, half in enumerate(halves):
        for which, natural in ((0, r), (1, 2 * p - 1 - r)):
            base = r * local_length + which * chunk
            order[base : base + half] = np.arange(starts[natural], starts[natural] + half)
    return order


def _check_shares(shares: Sequence[int], local_length: int) -> None:
    if not shares or any(int(s) != s or s < 0 or s % 2 for s in shares):
        raise ValueError(f"shares {list(shares)}: each must be an even number of tokens >= 0 (two zigzag chunks)")
    if local_length % 2 or local_length < max(shares):
        raise ValueError(
            f"a device block of {local_length} tokens cannot hold shares {list(shares)}: it must be even and at "
            f"least the largest share ({max(shares)})"
        )


def ring_tile_counts(
    length: int, num_shards: int, *, causal: bool, layout: str, block_sizes: BlockSizes | None = None, dtype=jnp.float32
) -> np.ndarray:
    """Forward attention tiles each device computes, per (batch, head), over a whole ring.

    Uses the ring's own step schedule (`step_kinds`, `step_kind_index`) and the flash
    kernel's own tile-skipping rule (`forward_tile_count`), so it counts the work the
    kernels do without running them. With P = 1 it is the single-device count.

    Args:
      length: L, global tokens.
      num_shards: P.
      causal: causal mask.
      layout: ``contiguous`` or ``zigzag``.
      block_sizes, dtype: the kernel's tiles, as `flash_attention`.

    Returns:
      int64 `[P]`: tiles computed by each device.
    """
    _check_layout(layout)
    local = length // num_shards
    half = local // 2

    def tiles(kind: str) -> int:
        if kind == SKIP:
            return 0
        q_len, kv_len = {LOWER: (local, half), UPPER: (half, local)}.get(kind, (local, local))
        count = functools.partial(forward_tile_count, block_sizes=block_sizes, dtype=dtype)
        return count(q_len, kv_len, causal=kind == DIAGONAL)

    kinds = step_kinds(causal, layout)
    counts = np.zeros(num_shards, np.int64)
    for shard in range(num_shards):
        counts[shard] = tiles(DIAGONAL if causal else FULL)
        for step in range(1, num_shards):
            counts[shard] += tiles(kinds[int(step_kind_index(step, shard))])
    return counts


def uneven_ring_tile_counts(
    shares: Sequence[int], local_length: int, *, block_sizes: BlockSizes | None = None, dtype=jnp.float32
) -> np.ndarray:
    """Forward attention tiles each device of a ring on uneven shards computes, per (batch, head).

    The chunk pairs `ring_kernels._uneven_forward` attends (step 0: the front chunk causally, the back chunk over
    the front one and causally over itself; each visiting block from device j: the back queries over
    j's front chunk, and the front queries over j's front chunk when j < r, the back queries over j's
    back chunk when j > r), each counted by the flash kernel's own rule with the chunks' real lengths
    (`forward_tile_count` with valid lengths: tiles of padding only are skipped). Device r's count
    follows its ``shares[r] / 2 x (length + 1)`` query-key pairs up to the tiles the causal diagonal
    and the padding's last partial tile add.

    Args:
      shares: real tokens per device (P even ints), as `ring_attention`'s ``shares``.
      local_length: positions per device block (even, at least ``max(shares)``).
      block_sizes, dtype: the kernel's tiles, as `flash_attention`.

    Returns:
      int64 `[P]`: tiles computed by each device.

    Raises:
      ValueError: as `uneven_zigzag_layout`.
    """
    _check_shares(shares, local_length)
    chunk, halves = local_length // 2, [int(s) // 2 for s in shares]

    def tiles(q_real: int, kv_real: int, causal: bool) -> int:
        return forward_tile_count(
            chunk,
            chunk,
            causal=causal,
            block_sizes=block_sizes,
            dtype=dtype,
            q_valid_length=q_real,
            kv_valid_length=kv_real,
        )

    counts = np.zeros(len(shares), np.int64)
    for r, mine in enumerate(halves):
        counts[r] = 2 * tiles(mine, mine, True) + tiles(mine, mine, False)
        for step in range(1, len(shares)):
            theirs = halves[(r - step) % len(shares)]
            counts[r] += 2 * tiles(mine, theirs, False)  # back x front, and front x front or back x back
    return counts


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


def _check_ring_inputs(q, k, q_segment_ids, kv_segment_ids, layout: str) -> None:
    """Raises ValueError unless the local blocks fit the ring (the kernel checks the rest)."""
    _check_layout(layout)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            "ring attention takes q [batch, length, heads, head_dim] and k, v [batch, length, "
            f"kv_heads, head_dim], got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention is self-attention: local query ({q.shape[1]}) and key ({k.shape[1]}) lengths must be equal"
        )
    if layout == ZIGZAG and q.shape[1] % 2:
        raise ValueError(
            f"the zigzag layout needs an even local length (two chunks per device), got "
            f"{q.shape[1]}; use a length divisible by 2 x the sequence-axis size"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")


def _axis_size(axis_name) -> int:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(lax.axis_size(name) for name in names)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str | Sequence[str],
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    layout: str = CONTIGUOUS,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    shares: Sequence[int] | None = None,
) -> jax.Array:
    """Exact attention over a sequence split along a mesh axis, by ring (Liu et al. 2023).

    A per-device function: call it inside `jax.shard_map` with the length dimension of q,
    k, v and the segment ids split over `axis_name` (and any other dimensions split as you
    like: batch and heads are independent). Differentiable (`jax.custom_vjp`; the backward
    pass is a second ring). Each device holds O(length / P) memory throughout.

    Precision: partial outputs are merged, and dq, dk, dv accumulated (and dk, dv sent
    around the ring), in float32; with bfloat16 inputs each block's partial output and
    gradients leave the kernel in bfloat16 before being merged.

    Args:
      q: this device's queries `[batch, length / P, heads, head_dim]`, float32 or bfloat16.
      k, v: this device's keys and values `[batch, length / P, kv_heads, head_dim]`;
        `heads` a multiple of `kv_heads` (grouped-query attention).
      axis_name: the mesh axis (or axes) the length is split over; P is its size.
      q_segment_ids, kv_segment_ids: int `[batch, length / P]` packed-document ids of this
        device's tokens (queries attend keys of equal id only), or both None. The key ids
        travel with the keys.
      causal: token i attends token j iff j <= i in the original (natural) order.
      layout: how the original sequence is laid out over the devices: ``contiguous`` or
        ``zigzag`` (`zigzag_permutation`; balances causal work). Used only when causal.
      sm_scale: score scale, default 1 / sqrt(head_dim).
      block_sizes, interpret: the flash kernel's, as `flash_attention`.
      shares: uneven shards: real tokens per device along the ring (P even ints, each at most
        the local length), the tokens laid out by `uneven_zigzag_layout`; causal zigzag only.
        Padding rows output 0 and padding tokens get zero gradients. None: every token real.

    Returns:
      `[batch, length / P, heads, head_dim]` in q's dtype: this device's rows of the output,
      in the same layout as q.

    Raises:
      ValueError: unequal local query and key lengths, an odd local length with the zigzag
        layout, an unknown layout, only one of the segment ids, shares that are not P even
        ints within the local length or come without a causal zigzag ring, or what
        `flash_attention` raises.
    """
    _check_ring_inputs(q, k, q_segment_ids, kv_segment_ids, layout)
    axis_name = axis_name if isinstance(axis_name, str) else tuple(axis_name)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    size = _axis_size(axis_name)
    if shares is not None:
        if not causal or layout != ZIGZAG or size < 2 or len(shares) != size:
            raise ValueError(
                f"uneven shares {list(shares)} need causal attention in the zigzag layout over a ring of "
                f"{len(shares)} >= 2 devices (got causal={causal}, layout {layout}, {size} devices)"
            )
        _check_shares(shares, q.shape[1])
        shares = tuple(int(s) for s in shares)
    if size == 1:
        return flash_attention(
            q,
            k,
            v,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
        )
    if q_segment_ids is not None:
        q_segment_ids = q_segment_ids.astype(jnp.int32)
        kv_segment_ids = kv_segment_ids.astype(jnp.int32)
    ring = _Ring(
        axis_name=axis_name,
        axis_size=size,
        causal=bool(causal),
        layout=layout if causal else CONTIGUOUS,
        sm_scale=float(sm_scale),
        block_sizes=block_sizes,
        interpret=interpret,
        shares=shares,
    )
    # One varying type for all inputs (pcast is differentiable: its transpose sums over the
    # axes an input did not vary on), so carries, branches and cotangents agree.
    q, k, v, q_seg, kv_seg = _vary_union(q, k, v, q_segment_ids, kv_segment_ids)
    return _ring_attention(ring, q, k, v, q_seg, kv_seg)
