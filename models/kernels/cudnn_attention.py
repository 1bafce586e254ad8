"""cuDNN's fused flash attention through `jax.nn.dot_product_attention(..., implementation="cudnn")`.

cuDNN's fused multi-head attention (NVIDIA cuDNN, "Fused Flash Attention", the frontend's SDPA graph) is
what most JAX users train with on NVIDIA GPUs; JAX reaches it through the ``__cudnn$fmhaSoftmax`` custom
calls (forward and backward). This module is a validating wrapper with readable errors around it. It
imports nothing of ours.

What the cuDNN path takes, as JAX 0.10-0.12 implement it: float16 or bfloat16 inputs (float32 is refused),
a head_dim that is a multiple of 8 and at most 128 (256 on Hopper and newer), grouped-query heads as they
are (no repeat), a causal mask that cuDNN applies itself (skipping the masked tiles). Packed documents:
`jax.nn.dot_product_attention` does not pass cuDNN's packed layout (its segment offsets are in JAX's
private cuDNN module only, and need Hopper), so segment ids go in as a boolean mask ``[B, 1, T, S]`` that
JAX turns into an additive bias: exact, at the memory of one ``[T, S]`` array per batch row (not per head).
It runs on NVIDIA GPUs only; tracing it on a machine without cuDNN raises JAX's own ``RuntimeError``
("cuDNN is not detected"), so entry points refuse it before that.

Einsum letters: B batch, T length (queries), S length (keys), N heads, K kv heads, H head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = ("float16", "bfloat16")
"""The input dtypes cuDNN's fused attention takes (fp8 aside)."""

HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
"""head_dim must be a multiple of `HEAD_DIM_MULTIPLE` and at most `MAX_HEAD_DIM` (Hopper and newer; Ampere
takes at most 128, which cuDNN itself refuses at compile time)."""


def cudnn_attention(q, k, v, segment_ids=None, *, causal: bool = True) -> jax.Array:
    """Attention ``softmax(q k^T / sqrt(H) + mask) v`` by cuDNN's fused kernel, differentiable.

    Args:
      q: ``[batch, length, heads, head_dim]``, float16 or bfloat16.
      k, v: ``[batch, length, kv_heads, head_dim]``, q's dtype; heads % kv_heads == 0.
      segment_ids: ``[batch, length]`` int or None; only equal ids attend (packed documents, as a mask).
      causal: causal mask (query i sees keys j <= i).

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype.

    Raises:
      ValueError: A dtype other than float16/bfloat16, or a head_dim cuDNN does not take (naming the
        value and the one that works).
      RuntimeError: From JAX, when traced where cuDNN is not installed (a CPU-only machine).
    """
    if jnp.dtype(q.dtype).name not in DTYPES:
        raise ValueError(f"cuDNN attention takes {' or '.join(DTYPES)} inputs, got {q.dtype}; cast to bfloat16")
    head_dim = q.shape[-1]
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"cuDNN attention takes a head_dim that is a multiple of {HEAD_DIM_MULTIPLE} and at most "
            f"{MAX_HEAD_DIM}, got {head_dim}"
        )
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")
    return out.astype(q.dtype)
