"""FlashAttention-2 in Pallas: forward and backward, causal, grouped-query, packed documents.

Source: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023). The forward pass is Algorithm 1 (online softmax over key/value tiles,
one program per query tile, saving the log-sum-exp); the backward pass is Algorithm 2,
split into one kernel for dq (one program per query tile, looping over key tiles) and one
for dk/dv (one program per key tile, looping over query tiles), both recomputing the
probabilities from the saved log-sum-exp, with delta = rowsum(dO * O) precomputed
(Section 3.1.2). No `[q_length, kv_length]` array exists anywhere, forward or backward.

Einsum letters: B batch, T query length, S key/value length, N query heads, K key/value
heads, G = N // K query heads per key/value head, H head_dim.

Layout: queries `[B, T, N, H]`, keys and values `[B, S, K, H]`, as in the rest of meshwork;
the kernels read this layout directly (no transposes). Grouped-query attention maps query
head n to key/value head n // G in the BlockSpec index maps, so keys and values are never
repeated in memory.

Where it runs: with `interpret=True` (the default when lowered for CPU) through the Pallas
interpreter; otherwise lowered with Pallas's Triton GPU backend, requested explicitly with
`jax.experimental.pallas.triton.CompilerParams` (jax >= 0.10 otherwise picks Mosaic GPU for a
plain `pl.pallas_call`; jax 0.12 warns that the Triton backend is deprecated). The kernels
keep to the portable Pallas subset: `pl.pallas_call`, `pl.BlockSpec`, `pl.program_id`, ref
indexing with `pl.ds`, `jax.lax.fori_loop`, whole-tile jnp ops and `lax.dot_general`.
float32 inputs use full-precision (IEEE, no TF32) dots; bfloat16 inputs use bfloat16
tensor-core dots with float32 accumulation.

This module holds the public functions (the validating wrapper, the forward and backward passes
on their own, tile counts, the reference); the tile sizes (`BlockSizes`) and input checks are in
`models.kernels.flash_blocks`, the Pallas kernels and their ``jax.custom_vjp`` in
`models.kernels.flash_kernels`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .flash_blocks import (
    _MAX_FLOOR,
    _MIN_BLOCK,
    BlockSizes,
    _check_inputs,
    _make_config,
    _next_power_of_two,
)
from .flash_kernels import (
    _and,
    _backward_dkv,
    _backward_dq,
    _flash_padded,
    _forward,
    _kv_tile_range,
    _mesh_axis_type,
    _row_delta,
    _tile_ranges,
)

# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _vary_alike(*arrays):
    """Inside `shard_map` (with check_vma), makes all arrays vary over the union of their
    varying mesh axes (`lax.pcast`), so the kernels' outputs can carry one type. A no-op for
    the usual case of equally sharded inputs, and outside `shard_map`."""
    present = [x for x in arrays if x is not None]
    types = [_mesh_axis_type(x) for x in present]
    if any(t is None for t in types):
        return arrays
    union = frozenset().union(*(t.varying for t in types))
    return tuple(
        x
        if x is None or _mesh_axis_type(x).varying == union
        else lax.pcast(x, tuple(sorted(union - _mesh_axis_type(x).varying)), to="varying")
        for x in arrays
    )


def _valid_lengths(q, k, q_valid_length, kv_valid_length):
    """The kernels' valid lengths `[2]` int32 (a missing one: the whole length), or None when neither is given."""
    if q_valid_length is None and kv_valid_length is None:
        return None
    q_valid = q.shape[1] if q_valid_length is None else q_valid_length
    kv_valid = k.shape[1] if kv_valid_length is None else kv_valid_length
    return jnp.stack([jnp.asarray(q_valid, jnp.int32), jnp.asarray(kv_valid, jnp.int32)])


def _prepare(
    q,
    k,
    v,
    q_segment_ids,
    kv_segment_ids,
    *,
    causal,
    sm_scale,
    block_sizes,
    interpret,
    count_tiles=False,
    q_valid_length=None,
    kv_valid_length=None,
):
    """Validates, builds the static config, and pads lengths and head_dim; also returns the valid lengths
    (`_valid_lengths`) last."""
    _check_inputs(q, k, v, q_segment_ids, kv_segment_ids)
    lengths = _valid_lengths(q, k, q_valid_length, kv_valid_length)
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(q.dtype)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}.")
    head_dim = q.shape[-1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    has_segments = q_segment_ids is not None
    cfg = _make_config(
        q,
        k,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        has_segments=has_segments,
        count_tiles=count_tiles,
        has_lengths=lengths is not None,
    )
    # Triton loads need a power-of-two head_dim; zero columns change neither q.k nor p.v.
    head_padded = max(_MIN_BLOCK, _next_power_of_two(head_dim))
    q = _pad_axis(_pad_axis(q, 1, cfg.q_padded), 3, head_padded)
    k = _pad_axis(_pad_axis(k, 1, cfg.kv_padded), 3, head_padded)
    v = _pad_axis(_pad_axis(v, 1, cfg.kv_padded), 3, head_padded)
    if has_segments:
        # Padded query rows are sliced off and padded keys are masked (see _Config), so the
        # pad value does not matter.
        q_segment_ids = _pad_axis(q_segment_ids.astype(jnp.int32), 1, cfg.q_padded)
        kv_segment_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, cfg.kv_padded)
    q, k, v, q_segment_ids, kv_segment_ids, lengths = _vary_alike(q, k, v, q_segment_ids, kv_segment_ids, lengths)
    return q, k, v, q_segment_ids, kv_segment_ids, cfg, lengths


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Multi-head attention with FlashAttention-2 Pallas kernels, differentiable.

    softmax(sm_scale * q k^T + mask) v, computed tile by tile (Dao 2023, Algorithm 1), with a
    custom VJP whose dq and dk/dv kernels recompute the probabilities from the saved
    log-sum-exp (Algorithm 2). Memory is linear in the lengths. A pure per-device function
    (no collectives, no global state): call it inside `shard_map` on local arrays.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k: keys `[batch, kv_length, kv_heads, head_dim]`, same dtype; `heads` must be a
        multiple of `kv_heads` (grouped-query / multi-query attention: query head n uses
        kv head n // (heads // kv_heads); keys are not repeated in memory).
      v: values, same shape and dtype as k.
      q_segment_ids: int `[batch, q_length]`; a query attends only keys of its segment.
      kv_segment_ids: int `[batch, kv_length]`; give both segment ids or neither.
      causal: query i may attend key j iff j <= i + kv_length - q_length (the last query is
        aligned with the last key). Key tiles entirely above the diagonal are skipped.
      sm_scale: score scale; default 1 / sqrt(head_dim).
      block_sizes: tile sizes, default `BlockSizes.default_for(q.dtype)`. Lengths need not be
        multiples: inputs are padded inside and the padding is masked and sliced off.
      interpret: run the Pallas interpreter; None chooses by the platform the call is lowered for
        (the interpreter on CPU, Triton elsewhere), not by the default backend, so a CUDA lowering made
        on a CPU-only machine carries the Triton kernels.

    Returns:
      `[batch, q_length, heads, head_dim]` in q's dtype (float32 accumulation). A query row
      that may attend no key outputs 0 and gets zero gradients.

    Raises:
      ValueError: on wrong ranks, mismatched shapes or dtypes, heads not a multiple of
        kv_heads, only one of the segment ids, or bad block sizes.
    """
    q_length, head_dim = q.shape[1], q.shape[-1]
    q_p, k_p, v_p, q_seg, kv_seg, cfg, _ = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    out = _flash_padded(q_p, k_p, v_p, q_seg, kv_seg, cfg)
    return out[:, :q_length, :, :head_dim]


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    q_valid_length: jax.Array | int | None = None,
    kv_valid_length: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel alone: the output and its log-sum-exp, for blockwise callers.

    Runs the same kernel as `flash_attention` (Dao 2023, Algorithm 1) and also returns the
    log-sum-exp of each query row's scores, so a caller that splits the keys into blocks
    (ring attention, Liu et al. 2023) can merge partial outputs: with `(o_a, lse_a)` and
    `(o_b, lse_b)` from two disjoint key blocks, the output over both is
    `(exp(lse_a) o_a + exp(lse_b) o_b) / (exp(lse_a) + exp(lse_b))`. Not differentiable:
    pair it with `flash_attention_backward`.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: keys and values `[batch, kv_length, kv_heads, head_dim]`, same dtype.
      q_segment_ids, kv_segment_ids: int `[batch, q_length]`, `[batch, kv_length]`, or None.
      causal, sm_scale, block_sizes, interpret: as `flash_attention`.
      q_valid_length, kv_valid_length: int32 scalars (may be traced: per device inside
        `shard_map`), or None for the whole length: query rows and keys at or past them are
        padding. Padding rows attend nothing and padding keys are attended by no row, and a
        tile holding only padding is not computed (uneven sequence shards pad equal-shaped
        blocks). The causal mask still counts padded positions.

    Returns:
      `(out, lse)`: out `[batch, q_length, heads, head_dim]` in q's dtype (0 for rows that
      attend no key); lse `[batch, heads, q_length]` float32, the natural log of
      `sum_j exp(sm_scale * q.k_j)` over the keys the row may attend, -inf for rows that
      attend none.

    Raises:
      ValueError: as `flash_attention`.
    """
    q_length, head_dim = q.shape[1], q.shape[-1]
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    out, lse = _forward(q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths)[:2]
    lse = lse[:, :, :q_length]
    # The kernel marks empty rows +inf (so exp(s - lse) = 0 in its backward); log 0 is -inf.
    lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
    return out[:, :q_length, :, :head_dim], lse


def flash_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    q_valid_length: jax.Array | int | None = None,
    kv_valid_length: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward kernels alone: gradients through one key/value block of a softmax row.

    Runs the dq and dk/dv kernels of `flash_attention` (Dao 2023, Algorithm 2) with the
    probabilities recomputed as `exp(sm_scale * q.k - lse)` and `delta = rowsum(d_out * out)`.
    When `out` and `lse` belong to the whole row (all key blocks, merged) and `k`, `v` are
    one block of its keys, the results are that block's exact share of the gradients: dq
    summed over the blocks is the full dq, and dk, dv are the block's full gradients. With
    the output and log-sum-exp of `flash_attention_forward` on the same keys it is the
    ordinary backward pass.

    Args:
      q: queries `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: one block of keys and values `[batch, kv_length, kv_heads, head_dim]`.
      out: the row's attention output `[batch, q_length, heads, head_dim]`.
      lse: the row's log-sum-exp `[batch, heads, q_length]` float32 (-inf or +inf: the row
        attends no key and gets zero gradients).
      d_out: cotangent of `out`, `[batch, q_length, heads, head_dim]`.
      q_segment_ids, kv_segment_ids, causal, sm_scale, block_sizes, interpret: as
        `flash_attention`, describing this block's mask.
      q_valid_length, kv_valid_length: as `flash_attention_forward`; padding rows and keys
        get zero gradients.

    Returns:
      `(dq, dk, dv)` shaped and typed like q, k, v.

    Raises:
      ValueError: as `flash_attention`, or when out, d_out or lse do not fit q.
    """
    batch, q_length, heads, head_dim = q.shape
    kv_length = k.shape[1]
    for name, x in (("out", out), ("d_out", d_out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}.")
    if tuple(lse.shape) != (batch, heads, q_length):
        raise ValueError(
            f"lse must have shape [batch, heads, q_length] = {(batch, heads, q_length)}, got {tuple(lse.shape)}."
        )
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    head_padded = q_p.shape[-1]
    out_p = _pad_axis(_pad_axis(out.astype(q.dtype), 1, cfg.q_padded), 3, head_padded)
    do_p = _pad_axis(_pad_axis(d_out.astype(q.dtype), 1, cfg.q_padded), 3, head_padded)
    # +inf makes exp(s - lse) exactly 0: empty rows and padded rows contribute nothing.
    lse = jnp.where(jnp.isfinite(lse), lse.astype(jnp.float32), jnp.inf)
    lse_p = _pad_axis(lse, 2, cfg.q_padded, value=jnp.inf)
    q_p, k_p, v_p, q_seg, kv_seg, out_p, do_p, lse_p, lengths = _vary_alike(
        q_p, k_p, v_p, q_seg, kv_seg, out_p, do_p, lse_p, lengths
    )
    delta = _row_delta(out_p, do_p)
    dq = _backward_dq(q_p, k_p, v_p, do_p, lse_p, delta, q_seg, kv_seg, cfg, lengths)[0]
    dk, dv = _backward_dkv(q_p, k_p, v_p, do_p, lse_p, delta, q_seg, kv_seg, cfg, lengths)[:2]
    return (dq[:, :q_length, :, :head_dim], dk[:, :kv_length, :, :head_dim], dv[:, :kv_length, :, :head_dim])


def forward_tile_count(
    q_length: int,
    kv_length: int,
    *,
    causal: bool,
    block_sizes: BlockSizes | None = None,
    dtype=jnp.float32,
    q_valid_length: int | None = None,
    kv_valid_length: int | None = None,
) -> int:
    """Key/value tiles the forward kernel computes for one (batch, head), without running it.

    Sums, over the (padded) query tiles, the key-tile range each forward program loops over
    (`_kv_tile_range`, the kernel's own skipping rule: tiles entirely above the causal
    diagonal are not computed; with valid lengths `_tile_ranges`, which also skips tiles of
    padding only). Equal to `_tile_counts(...)["forward"]` summed over the query tiles of one
    (batch, head); for work-balance counts without device work.

    Args:
      q_length, kv_length: T and S, tokens.
      causal: the kernel's causal flag (last query aligned with the last key).
      block_sizes: as `flash_attention`; default `BlockSizes.default_for(dtype)`.
      dtype: the input dtype that picks the default tiles.
      q_valid_length, kv_valid_length: real query rows and keys (the rest padding), as
        `flash_attention_forward` takes them; None: every row or key is real.

    Returns:
      The number of `block_q x block_kv` tiles, an int.
    """
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(dtype)
    q = jax.ShapeDtypeStruct((1, q_length, 1, _MIN_BLOCK), dtype)
    k = jax.ShapeDtypeStruct((1, kv_length, 1, _MIN_BLOCK), dtype)
    cfg = _make_config(q, k, causal=causal, sm_scale=1.0, block_sizes=block_sizes, interpret=True, has_segments=False)
    bq, bk = cfg.block_q, cfg.block_kv
    if q_valid_length is not None or kv_valid_length is not None:
        lengths = [q_length if q_valid_length is None else q_valid_length]
        lengths.append(kv_length if kv_valid_length is None else kv_valid_length)
        first, end = np.asarray(_tile_ranges(cfg, jnp.asarray(lengths, jnp.int32), bq, bk, "q"))
        return int(np.sum(end - first))
    total = 0
    for tile in range(cfg.q_padded // bq):
        _, end = _kv_tile_range(cfg, tile * bq, bq, bk)
        total += int(end)
    return total


def _tile_counts(
    q,
    k,
    v,
    *,
    causal=False,
    block_sizes=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    interpret=None,
    q_valid_length=None,
    kv_valid_length=None,
) -> dict[str, jax.Array]:
    """Debug: the number of tiles each program of each kernel computed.

    Runs the same kernels with a counter in their loop carry. Returns a dict with "forward"
    `[B, N, Tp // block_q]`, "dq" `[B, N, Tp // block_q_dq]` and "dkv"
    `[B, K, Sp // block_kv_dkv]` (summed over the G query heads) int32 counts.
    """
    q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        sm_scale=None,
        block_sizes=block_sizes,
        interpret=interpret,
        count_tiles=True,
        q_valid_length=q_valid_length,
        kv_valid_length=kv_valid_length,
    )
    out, lse, forward = _forward(q_p, k_p, v_p, q_seg, kv_seg, cfg, lengths)
    delta = _row_delta(out, out)
    dq = _backward_dq(q_p, k_p, v_p, out, lse, delta, q_seg, kv_seg, cfg, lengths)[1]
    dkv = _backward_dkv(q_p, k_p, v_p, out, lse, delta, q_seg, kv_seg, cfg, lengths)[2]
    return {"forward": forward, "dq": dq, "dkv": dkv}


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain attention with the same semantics as `flash_attention`, in float32.

    Materialises the `[batch, kv_heads, G, q_length, kv_length]` scores: for tests and small
    inputs only. Uses `einsum` with `Precision.HIGHEST`, a mask and softmax; rows that may
    attend no key output 0 (and get zero gradients).

    Args:
      q: `[batch, q_length, heads, head_dim]`, float32 or bfloat16.
      k, v: `[batch, kv_length, kv_heads, head_dim]`.
      q_segment_ids, kv_segment_ids: int `[batch, q_length]`, `[batch, kv_length]`, or None.
      causal: query i may attend key j iff j <= i + kv_length - q_length.
      sm_scale: default 1 / sqrt(head_dim).

    Returns:
      `[batch, q_length, heads, head_dim]` in q's dtype.

    Raises:
      ValueError: as `flash_attention`.
    """
    _check_inputs(q, k, v, q_segment_ids, kv_segment_ids)
    batch, q_length, heads, head_dim = q.shape
    kv_length, kv_heads = k.shape[1], k.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    hi = lax.Precision.HIGHEST
    groups = heads // kv_heads
    q_grouped = q.astype(jnp.float32).reshape(batch, q_length, kv_heads, groups, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_grouped, k.astype(jnp.float32), precision=hi)
    scores = scores * sm_scale
    mask = None
    if causal:
        q_idx = jnp.arange(q_length)[:, None]
        k_idx = jnp.arange(kv_length)[None, :]
        mask = k_idx <= q_idx + (kv_length - q_length)  # [T, S]
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, T, S]
        mask = _and(mask, same[:, None, None])
    if mask is not None:
        scores = jnp.where(mask, scores, _MAX_FLOOR)
    probs = jax.nn.softmax(scores, axis=-1)
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)  # Rows with no visible key: 0, not uniform.
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32), precision=hi)
    return out.reshape(batch, q_length, heads, head_dim).astype(q.dtype)
