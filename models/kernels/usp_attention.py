"""USP attention: all-to-all over an inner mesh axis, ring attention over an outer one.

Source: Jiarui Fang and Shangchun Zhao, "USP: A Unified Sequence Parallelism Approach for Long
Context Generative AI" (2024), Section 3 (the hybrid of DeepSpeed-Ulysses and ring attention,
their Figure 3 and Algorithm 1). The sequence is split over R x U devices: a ring of R groups
(the outer axis, ``context`` in meshwork: slower links, traffic that overlaps compute) of U
devices each (the inner axis, ``sequence``: all-to-all wants fast links, so it stays inside a
host). Per device:

1. all-to-all over the inner axis (`ulysses_attention`'s exchange, KV heads repeated to
   lcm(K, U) as there, `kv_repeat`): queries, keys and values go from ``[B, L/(R U), N, H]`` to
   ``[B, L/R, N/U, H]``, the group's whole block of L/R tokens for N/U heads;
2. ring attention over the outer axis (`ring_attention`, grouped-query heads, segment ids and the
   flash kernel) on that block: key/value blocks of L/R tokens travel around the R groups;
3. all-to-all back to ``[B, L/(R U), N, H]``.

Each all-to-all moves one local tensor (U-1)/U of it, independent of R; the ring moves (R-1) key
and value blocks of L/R tokens and N/U heads a pass, as a ring of R devices would with heads split
over U. USP scales the length past the head count (all-to-all alone stops at P = N) and keeps the
ring's hops U times fewer than a ring over all R U devices.

Layout: group r (the r-th R-th of the sequence as the devices lie) holds, concatenated over its U
devices in order, the ring's block r. ``contiguous``: tokens in natural order. ``zigzag``: the
sequence in `ring_attention.zigzag_permutation` order over the R groups (chunks r and 2R-1-r of 2R), so the
ring's causal work is balanced; the U devices of a group hold consecutive pieces of that block.
The data pipeline lays the tokens out once (`ring_attention.zigzag_permutation` over R, not R U).

Einsum letters: B batch, T length (queries), S length (keys), N heads, K kv heads, H head_dim,
R ring size (outer axis), U all-to-all size (inner axis).

Imports nothing from meshwork except the sibling kernel modules.
"""

from __future__ import annotations

import jax
from jax import lax

from .flash_blocks import BlockSizes
from .ring_attention import ring_attention
from .ring_kernels import CONTIGUOUS
from .ulysses_attention import check_inputs, length_to_heads, to_sequence


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    ring_axis: str | tuple[str, ...],
    all_to_all_axis: str | None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    layout: str = CONTIGUOUS,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Exact attention over a sequence split over two mesh axes: all-to-all inside, ring across.

    A per-device function: call it inside `jax.shard_map` with the length dimension of q, k, v and
    the segment ids split over ``(ring_axis, all_to_all_axis)`` (ring outer). Differentiable
    (autodiff through the all-to-alls, the ring's custom VJP).

    Args:
      q: this device's queries ``[batch, length / (R U), heads, head_dim]``, float32 or bfloat16.
      k, v: this device's keys and values ``[batch, length / (R U), kv_heads, head_dim]``; any
        ``kv_heads`` dividing ``heads``.
      ring_axis: the outer mesh axis (or axes), R devices: the ring.
      all_to_all_axis: the inner mesh axis, U devices: the all-to-all group (None: U = 1).
      q_segment_ids, kv_segment_ids: int ``[batch, length / (R U)]`` packed-document ids, or both
        None; gathered over the inner axis (4 bytes a token), then travelling with the keys.
      causal: token i attends token j iff j <= i in the original (natural) order.
      layout: ``contiguous`` or ``zigzag`` (`ring_attention.zigzag_permutation` over the R groups).
      sm_scale: score scale, default 1 / sqrt(head_dim).
      block_sizes, interpret: the flash kernel's, as `flash_attention`.

    Returns:
      ``[batch, length / (R U), heads, head_dim]`` in q's dtype, in q's layout.

    Raises:
      ValueError: heads not divisible by U (naming a U that works), an unknown layout, an odd
        block under zigzag, unequal query and key lengths, only one of the segment ids, or what
        `ring_attention` raises.
    """
    check_inputs("USP", q, k, q_segment_ids, kv_segment_ids, layout)
    inner = 1 if all_to_all_axis is None else lax.axis_size(all_to_all_axis)
    if inner > 1:
        q, k, v, q_segment_ids, kv_segment_ids = length_to_heads(
            q, k, v, q_segment_ids, kv_segment_ids, all_to_all_axis, inner
        )
    out = ring_attention(
        q,
        k,
        v,
        axis_name=ring_axis,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        layout=layout if causal else CONTIGUOUS,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return to_sequence(out, all_to_all_axis) if inner > 1 else out


__all__ = ["usp_attention"]
