"""All-to-all (DeepSpeed-Ulysses) attention over a mesh axis.

Source: Sam Ade Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models" (2023), Section 3 and Figure 2. The
sequence is split into P blocks along a mesh axis (`sequence` in meshwork). Before
attention, one `lax.all_to_all` per tensor trades the split: each device sends every other
device the slice of its tokens for that device's heads and receives all tokens of its own
heads, so queries, keys and values go from `[B, L/P, N, H]` (sequence-sharded) to
`[B, L, N/P, H]` (head-sharded). Each device then runs ordinary attention (our
FlashAttention-2 kernel) on whole sequences for N/P heads, and one more all-to-all returns
the output to the sequence split. The backward pass is JAX's transpose of the same program:
all-to-all is its own transpose. Per device, each all-to-all moves one local tensor
(`L/P * heads * head_dim` elements), four per pass, independent of P; the work is balanced
by construction (every device attends whole sequences).

Grouped-query attention with fewer key/value heads than devices (Llama 3 8B has 8 KV heads;
a sequence axis of 16 is common at 128k tokens): the query heads must divide by P, the KV
heads need not. Each KV head is repeated r = P / gcd(K, P) times (`kv_repeat`) before the
all-to-all, so the K r = lcm(K, P) heads split evenly and device p receives exactly the KV
heads its query heads use (query head n reads KV head n // G before and after the repeat,
since r divides G). The repeat is a broadcast inside autodiff, so the backward sums the
gradients of the r replicas: the exact GQA gradient. This follows AXLearn's flash-attention
layer, which repeats KV heads when the sequence axis exceeds the KV head count.

Why repeat rather than split heads unevenly (DeepSpeed PR #6392): a device must receive, for
every token, the KV heads its N/P query heads read, at least max(1, K/P) heads; when one of
K, P divides the other (every published model at power-of-two P) the repeat moves exactly
that, `L/P * lcm(K, P) * H` elements a tensor per device, so no uneven split can move
fewer bytes. An uneven split answers heads that P does not divide; it leaves devices with
unequal work (the most loaded paces the step) and needs ragged all-to-alls. Query heads
that P does not divide are refused (`check_ulysses_heads` names a P that works); ring
attention (`ring_attention`) splits no heads.

Layouts: ``contiguous`` (device r holds tokens [r L/P, (r+1) L/P)) or ``zigzag``
(`ring_attention.zigzag_permutation`, the layout ring attention uses to balance causal
work). With zigzag the gathered sequence is put back in natural order by a fixed local
permutation before attention and returned to zigzag order after it, so this function
accepts whichever layout the data pipeline chose.

Einsum letters: B batch, T length (queries), S length (keys), N heads, K kv heads,
H head_dim, P devices along the axis.

Imports nothing from meshwork except the sibling kernel modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .flash_attention import flash_attention
from .flash_blocks import BlockSizes
from .ring_attention import zigzag_permutation
from .ring_kernels import CONTIGUOUS, LAYOUTS, ZIGZAG


def kv_repeat(kv_heads: int, num_shards: int) -> int:
    """r: how many times each KV head is repeated so that P devices split the K r = lcm(K, P) heads.

    Args:
      kv_heads: K, key/value heads each device holds before the all-to-all.
      num_shards: P, devices along the sequence axis.

    Returns:
      P / gcd(K, P): 1 when P divides K, P / K when K divides P.
    """
    return num_shards // math.gcd(kv_heads, num_shards)


def check_ulysses_heads(heads: int, kv_heads: int, num_shards: int) -> None:
    """Raises ValueError unless all-to-all attention can split the heads over P devices.

    KV heads never block it (`kv_repeat`); the query heads must divide by P, and query heads
    must be a multiple of KV heads (grouped-query attention).

    Args:
      heads: N, query heads each device holds before the all-to-all.
      kv_heads: K, key/value heads each device holds (grouped-query attention).
      num_shards: P, devices along the sequence axis.

    Raises:
      ValueError: naming the counts, the largest P that works and ring attention.
    """
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) per device must be a multiple of kv_heads ({kv_heads})")
    if heads % num_shards:
        good = math.gcd(heads, num_shards)  # divides P, so the other axes still cover the devices
        raise ValueError(
            f"all-to-all (ulysses) attention splits query heads over the {num_shards} devices of the "
            f"sequence axis, but heads ({heads}) per device is not divisible by {num_shards}; use a "
            f"sequence axis of {good}, or ring attention"
        )


def _axis_size(axis_name) -> int:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(lax.axis_size(name) for name in names)


def to_heads(x, axis_name):
    """Sequence-sharded `[B, L/P, n, H]` -> head-sharded `[B, L, n/P, H]`."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def to_sequence(x, axis_name):
    """Head-sharded `[B, L, n/P, H]` -> sequence-sharded `[B, L/P, n, H]`."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def check_inputs(name: str, q, k, q_segment_ids, kv_segment_ids, layout: str) -> None:
    """The checks an all-to-all attention (``ulysses``, ``USP``: ``name``) makes of its inputs.

    Raises:
      ValueError: an unknown layout, q or k not of rank 4 or of unequal lengths, or only one of the
        segment ids.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if q.ndim != 4 or k.ndim != 4 or q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{name} attention takes q [batch, length, heads, head_dim] and k, v [batch, length, "
            f"kv_heads, head_dim] of one length, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")


def length_to_heads(q, k, v, q_segment_ids, kv_segment_ids, axis_name, size: int):
    """The all-to-all of Jacobs et al. (2023): length-split q, k, v to head-split, KV heads repeated first
    where P does not divide them (`kv_repeat`; autodiff sums the replicas' gradients, the exact GQA
    gradient), and the segment ids gathered whole.

    Args:
      q: `[batch, length / P, heads, head_dim]`; k, v: `[batch, length / P, kv_heads, head_dim]`.
      q_segment_ids, kv_segment_ids: int `[batch, length / P]`, or both None.
      axis_name: the mesh axis (or axes) of the exchange; size: P, its size.

    Returns:
      ``(q, k, v, q_segment_ids, kv_segment_ids)``: q `[batch, length, heads / P, head_dim]`, k and v
      `[batch, length, lcm(kv_heads, P) / P, head_dim]`, the ids `[batch, length]` (or None).

    Raises:
      ValueError: as `check_ulysses_heads`.
    """
    check_ulysses_heads(q.shape[2], k.shape[2], size)
    repeat = kv_repeat(k.shape[2], size)
    if repeat > 1:  # KV head j becomes heads j r .. j r + r - 1
        k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
    q, k, v = (to_heads(x, axis_name) for x in (q, k, v))
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = (
            lax.all_gather(ids, axis_name, axis=1, tiled=True) for ids in (q_segment_ids, kv_segment_ids)
        )
    return q, k, v, q_segment_ids, kv_segment_ids


def ulysses_attention(
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
) -> jax.Array:
    """Exact attention over a sequence split along a mesh axis, by all-to-all (Ulysses).

    A per-device function: call it inside `jax.shard_map` with the length dimension of q,
    k, v and the segment ids split over `axis_name`. Differentiable (autodiff through the
    all-to-alls and the flash kernel's custom VJP).

    Args:
      q: this device's queries `[batch, length / P, heads, head_dim]`, float32 or bfloat16.
      k, v: this device's keys and values `[batch, length / P, kv_heads, head_dim]`; any
        `kv_heads` dividing `heads` (repeated to lcm(kv_heads, P) when P does not divide it).
      axis_name: the mesh axis (or axes) the length is split over; P is its size.
      q_segment_ids, kv_segment_ids: int `[batch, length / P]` packed-document ids, or both
        None; gathered to whole sequences (`lax.all_gather`, 4 bytes a token).
      causal: token i attends token j iff j <= i in the original (natural) order.
      layout: ``contiguous`` or ``zigzag``, how the sequence is laid out over the devices.
      sm_scale: score scale, default 1 / sqrt(head_dim).
      block_sizes, interpret: the flash kernel's, as `flash_attention`.

    Returns:
      `[batch, length / P, heads, head_dim]` in q's dtype, in q's layout.

    Raises:
      ValueError: heads not divisible by P (naming a P that works, and ring attention), an
        unknown layout, a length the zigzag layout cannot split, unequal query and key
        lengths, only one of the segment ids, or what `flash_attention` raises.
    """
    check_inputs("ulysses", q, k, q_segment_ids, kv_segment_ids, layout)
    axis_name = axis_name if isinstance(axis_name, str) else tuple(axis_name)
    size = _axis_size(axis_name)
    kernel = dict(causal=causal, sm_scale=sm_scale, block_sizes=block_sizes, interpret=interpret)
    if size == 1:
        return flash_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **kernel)
    q, k, v, q_segment_ids, kv_segment_ids = length_to_heads(q, k, v, q_segment_ids, kv_segment_ids, axis_name, size)
    permuted = causal and layout == ZIGZAG  # without a causal mask the order does not matter
    if permuted:
        perm = zigzag_permutation(q.shape[1], size)
        natural = np.argsort(perm)
        q, k, v = (jnp.take(x, natural, axis=1) for x in (q, k, v))
        if q_segment_ids is not None:
            q_segment_ids, kv_segment_ids = (jnp.take(ids, natural, axis=1) for ids in (q_segment_ids, kv_segment_ids))
    out = flash_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **kernel)
    if permuted:
        out = jnp.take(out, perm, axis=1)
    return to_sequence(out, axis_name)
