"""The attention kernels GSPMD partitions like any op: the reference attention (einsum, mask, float32 softmax,
a backward that recomputes the probabilities) and JAX's own ``jax.nn.dot_product_attention``.

Einsum letters: B batch, T length (queries), S length (keys), N heads, K kv heads, G query heads per kv
head (N = K*G), H head_dim, R the query rows of one kv head (R = G*T, `reference_attention`'s products).

The records ``reference`` and ``dot_product`` of `models.attention_registry` run them
(`models.attention_kernels`); decoding over a key/value cache (`models.attention.Attention.extend`) runs
`reference_attention` with an explicit mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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


def reference_attention(
    q, k, v, *, causal: bool = True, q_segment_ids=None, kv_segment_ids=None, sm_scale=None, mask=None
):
    """Plain attention: einsum, mask, float32 softmax, einsum; a backward that recomputes the scores.

    Memory is ``O(T*S)`` per head; use it as the ground truth and for short sequences. The forward
    saves q, k, v, the float32 output and the rows' log-sum-exp ``[batch, heads, q_length]`` float32,
    not the probabilities; the backward recomputes them (FlashAttention's backward, Dao et al. 2022,
    appendix B.2; Dao 2023, algorithm 2, here over whole rows). A step thus saves no score-sized array
    ``[batch, heads, q_length, kv_length]`` per layer, and a layer's backward holds two float32 ones
    at once (XLA's buffer assignment, `bench/RESULTS.md`, "The reference attention's backward").

    Args:
      q: ``[batch, q_length, heads, head_dim]``.
      k, v: ``[batch, kv_length, kv_heads, head_dim]``; heads % kv_heads == 0.
      causal: mask future keys (last query aligned with last key).
      q_segment_ids, kv_segment_ids: optional ``[batch, length]`` int32; only
        equal ids attend.
      sm_scale: logit scale (a Python number), default ``1/sqrt(head_dim)``.
      mask: optional boolean ``[batch, q_length, kv_length]``, True where a query may attend a
        key, combined (and) with the others (decoding over a key/value cache uses it).

    Returns:
      ``[batch, q_length, heads, head_dim]`` in q's dtype. A query with no key
      to attend gets zeros (and passes no gradient).
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    g = n // kv_heads
    scale = h**-0.5 if sm_scale is None else sm_scale
    # A kv head's G*T query rows side by side (R), its keys and values: every product is a batched matrix
    # product over [B, K] that needs no transposed copy of a score-sized operand, and the score-sized
    # arrays share one layout, so XLA writes the scores' gradient into the buffer of dp (with the
    # einsums over [B, T, K, G, H] it kept four such arrays at once).
    rows = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = _attention(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, g)
    return out.reshape(b, kv_heads, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


# The reference attention's parts, on a kv head's query rows [B, K, R, H] and its keys and values [B, K, S, H].


def _allowed(rows, keys, causal: bool, q_segment_ids, kv_segment_ids, mask, groups: int):
    """`attention_mask` and'ed with the caller's ``mask``, repeated for the G query heads of a kv head:
    ``[B or 1, 1, R, S]`` boolean."""
    t = rows.shape[2] // groups
    allowed = attention_mask(t, keys.shape[2], causal, q_segment_ids, kv_segment_ids)
    if mask is not None:
        allowed = allowed & mask
    allowed = jnp.broadcast_to(allowed[:, None], (allowed.shape[0], groups, *allowed.shape[1:]))
    return allowed.reshape(allowed.shape[0], 1, groups * t, keys.shape[2])


def _scores(rows, keys, scale):
    """The scaled logits ``[B, K, R, S]`` float32."""
    return jnp.einsum("BKRH,BKSH->BKRS", rows, keys, preferred_element_type=jnp.float32) * scale


def _forward(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, groups):
    """The normalised output ``[B, K, R, H]`` float32 and the rows' log-sum-exp ``[B, K, R]`` float32
    (``-inf`` where a query has no key)."""
    allowed = _allowed(rows, keys, causal, q_segment_ids, kv_segment_ids, mask, groups)
    logits = jnp.where(allowed, _scores(rows, keys, scale), -jnp.inf)
    # The shift by the row maximum only guards exp against overflow: the softmax does not depend on it.
    peak = jnp.max(logits, axis=-1)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(weights, axis=-1)
    # Normalise the output [B, K, R, H] rather than the weights [B, K, R, S] (as FlashAttention
    # does, Dao et al. 2022, algorithm 1): one pass less over the scores.
    out = jnp.einsum("BKRS,BKSH->BKRH", weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out / jnp.where(denom == 0, 1.0, denom)[..., None], peak + jnp.log(denom)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, groups):
    """The output ``[B, K, R, H]`` float32 of `reference_attention`."""
    return _forward(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, groups)[0]


def _attention_fwd(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, groups):
    out, lse = _forward(rows, keys, values, q_segment_ids, kv_segment_ids, mask, causal, scale, groups)
    return out, (rows, keys, values, q_segment_ids, kv_segment_ids, mask, out, lse)


def _attention_bwd(causal, scale, groups, saved, d_out):
    """The gradients of the rows, keys and values from the probabilities recomputed from the saved
    log-sum-exp (Dao 2023, algorithm 2): ``p = exp(s - lse)``, ``dv = p^T dO``, ``dp = dO v^T``,
    ``ds = p (dp - rowsum(dO * O))``, ``dq = ds k``, ``dk = ds^T q`` (the last two times the scale).
    The ids and the mask get no cotangent."""
    rows, keys, values, q_segment_ids, kv_segment_ids, mask, out, lse = saved
    allowed = _allowed(rows, keys, causal, q_segment_ids, kv_segment_ids, mask, groups)
    # Masked keys, and every key of a query with none (lse -inf), get probability 0.
    p = jnp.exp(jnp.where(allowed, _scores(rows, keys, scale) - lse[..., None], -jnp.inf))
    d_in = d_out.astype(values.dtype)
    dv = jnp.einsum("BKRS,BKRH->BKSH", p.astype(values.dtype), d_in, preferred_element_type=jnp.float32)
    # rowsum(p * dp) = dO . O: the softmax's backward without a pass over the scores (Dao 2023, eq. 4).
    delta = jnp.sum(d_out * out, axis=-1)
    dp = jnp.einsum("BKRH,BKSH->BKRS", d_in, values, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None])).astype(rows.dtype)
    dq = jnp.einsum("BKRS,BKSH->BKRH", ds, keys, preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("BKRS,BKRH->BKSH", ds, rows, preferred_element_type=jnp.float32) * scale
    return dq.astype(rows.dtype), dk.astype(keys.dtype), dv.astype(values.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def jax_dot_product_attention(q, k, v, segment_ids=None, *, causal: bool = True):
    """``jax.nn.dot_product_attention`` with the document mask of packed sequences.

    JAX's own implementation (XLA's on every backend unless JAX picks another): the baseline the
    flash kernel is measured against (``bench/gpu_mfu.py``).

    Args:
      q: ``[batch, length, heads, head_dim]``.
      k, v: ``[batch, length, kv_heads, head_dim]``; heads % kv_heads == 0.
      segment_ids: ``[batch, length]`` int32 or None; only equal ids attend.
      causal: causal mask.

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype.
    """
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal).astype(q.dtype)
