"""Grouped-query self-attention.

Einsum letters: B batch, T length (queries), S length (keys), D embed,
N heads, K kv heads, G query heads per kv head (N = K*G), H head_dim.

`Attention` projects to queries ``[B, T, N, H]`` and keys/values
``[B, S, K, H]``, applies rotary positions, runs the attention implementation
chosen by ``ModelConfig.attention`` (``reference``: einsum + mask, below;
``flash``: our Pallas FlashAttention-2 kernel, `models.kernels.flash_attention`,
under `jax.shard_map`) and projects back to ``[B, T, D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.kernels.flash_attention import flash_attention
from models.layers import param, rotary_embedding
from sharding import axes as ax
from sharding.rules import constrain, current_rules, logical_to_spec


def attention_mask(q_len: int, kv_len: int, causal: bool, q_segment_ids=None, kv_segment_ids=None):
    """Boolean mask ``[B or 1, T, S]``: True where query t may attend key s.

    Causal aligns the last query with the last key: t attends s iff
    ``s <= t + kv_len - q_len``. Positions of different segments never attend.
    """
    mask = jnp.ones((1, q_len, kv_len), bool)
    if causal:
        t = jnp.arange(q_len)[:, None]
        s = jnp.arange(kv_len)[None, :]
        mask = mask & (s <= t + kv_len - q_len)[None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return mask


def reference_attention(q, k, v, *, causal: bool = True, q_segment_ids=None, kv_segment_ids=None, sm_scale=None):
    """Plain attention: einsum, mask, float32 softmax, einsum.

    Memory is ``O(T*S)`` per head; use it as the ground truth and for short
    sequences.

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, kv_length, kv_heads, head_dim]``; heads % kv_heads == 0.
      causal: mask future keys (last query aligned with last key).
      q_segment_ids, kv_segment_ids: optional ``[batch, length]`` int32; only
        equal ids attend.
      sm_scale: logit scale, default ``1/sqrt(head_dim)``.

    Returns:
      ``[batch, q_length, heads, head_dim]`` in q's dtype. A query with no key
      to attend gets zeros.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    g = n // kv_heads
    scale = h**-0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, t, kv_heads, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(t, k.shape[1], causal, q_segment_ids, kv_segment_ids)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits - peak)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def _head_axes(spec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if len(spec) > dim else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_flash_attention(q, k, v, segment_ids, *, causal: bool = True):
    """Our Pallas flash attention, run per device under `jax.shard_map`.

    GSPMD cannot partition a Pallas call, so the kernel runs on each device's
    block: ``batch`` split as the rules split it (``data``/``fsdp``), heads as
    the rules split ``heads`` (``tensor``), the length whole. When ``heads``
    is split but ``kv_heads`` is not (fewer KV heads than ``tensor``
    devices), each device slices the KV heads its query heads use.
    Outside `sharding.rules.use_rules` the kernel is called directly.

    Args:
      q: ``[batch, length, heads, head_dim]``.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask.

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype.

    Raises:
      ValueError: when the head split cannot be matched to the KV heads.
    """
    context = current_rules()
    if context is None:
        return flash_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, causal=causal)
    mesh, rules = context
    sizes = dict(mesh.shape)
    q_spec, _ = logical_to_spec((ax.BATCH, None, ax.HEADS, None), rules, q.shape, sizes)
    kv_spec, _ = logical_to_spec((ax.BATCH, None, ax.KV_HEADS, None), rules, k.shape, sizes)
    q_heads, kv_heads = _head_axes(q_spec, 2), _head_axes(kv_spec, 2)
    batch_spec = PartitionSpec(q_spec[0] if len(q_spec) else None)
    split = 1
    for axis in q_heads:
        split *= sizes[axis]
    group = q.shape[2] // k.shape[2]
    local_heads = q.shape[2] // split
    slice_kv = bool(q_heads) and kv_heads != q_heads
    if slice_kv:
        if kv_heads or (local_heads % group and group % local_heads):
            raise ValueError(
                f"--attention flash: heads split over {'+'.join(q_heads)} ({q.shape[2]} heads, {k.shape[2]} KV "
                f"heads) cannot be matched to the KV heads; use --rule kv_heads=none or --rule heads=none"
            )
        kv_spec = PartitionSpec(kv_spec[0] if len(kv_spec) else None)
    kv_per_device = max(1, local_heads // group)

    def local(q, k, v, segment_ids):
        if slice_kv:
            index = jnp.zeros((), jnp.int32)
            for axis in q_heads:
                index = index * sizes[axis] + jax.lax.axis_index(axis)
            start = index * local_heads // group
            k = jax.lax.dynamic_slice_in_dim(k, start, kv_per_device, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, start, kv_per_device, axis=2)
        return flash_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, causal=causal)

    seg_spec = PartitionSpec(*batch_spec, None)
    if segment_ids is None:
        run = jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh,
                            in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)
        return run(q, k, v)
    run = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec)
    return run(q, k, v, segment_ids)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions.

    Weights ``q: [embed, heads, head_dim]``, ``k, v: [embed, kv_heads,
    head_dim]``, ``o: [heads, head_dim, embed]``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
        self.q = param(rngs, (d, n, h), (ax.EMBED, ax.HEADS, ax.HEAD_DIM))
        self.k = param(rngs, (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        self.v = param(rngs, (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
        self.o = param(rngs, (n, h, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), fan_in=n * h)
        self.config = config

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """``[batch, length, embed]`` -> ``[batch, length, embed]`` in x's dtype.

        Args:
          x: activations ``[batch, length, embed]``.
          positions: ``[batch, length]`` int32 rotary positions.
          segment_ids: ``[batch, length]`` int32 document ids, or None.
        """
        cfg, dtype = self.config, x.dtype
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...].astype(dtype))
        k = jnp.einsum("BSD,DKH->BSKH", x, self.k[...].astype(dtype))
        v = jnp.einsum("BSD,DKH->BSKH", x, self.v[...].astype(dtype))
        q = constrain(rotary_embedding(q, positions, cfg.rope_theta), (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        k = constrain(rotary_embedding(k, positions, cfg.rope_theta), (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM))
        v = constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM))
        if cfg.attention == "flash":
            out = sharded_flash_attention(q, k, v, segment_ids, causal=True)
        else:
            out = reference_attention(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        out = constrain(out, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        y = jnp.einsum("BTNH,NHD->BTD", out, self.o[...].astype(dtype))
        return constrain(y, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
