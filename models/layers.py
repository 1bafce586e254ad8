"""Building blocks: token embedding, RMSNorm, rotary positions, SwiGLU MLP.

Einsum letters: B batch, T length, D embed, F mlp, V vocab, N heads, H head_dim.

Every parameter is an `nnx.Param` with ``logical_axes`` metadata, one
logical name per dimension (see `sharding.axes`); activations are annotated
through the run's `sharding.parallel.Parallelism`, passed to every call
(``par.constrain``). No mesh-axis names appear here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import lora
from models.config import ModelConfig
from models.spec import embed_params, mlp_params, norm_params
from sharding import axes as ax
from sharding.modeldesc import Param
from sharding.parallel import Parallelism
from sharding.vocab import lookup_gathers_table


def param(rngs: nnx.Rngs, shape, names, *, fan_in: int | None = None, init: str = "normal") -> nnx.Param:
    """A float32 parameter with logical axis names.

    Args:
      rngs: the random streams (uses ``params``).
      shape: the parameter's shape.
      names: one logical axis name per dimension.
      fan_in: for ``init='normal'``, the standard deviation is
        ``1/sqrt(fan_in)`` (LeCun normal; default: the first dimension).
      init: ``normal``, ``ones`` or ``zeros``.

    Raises:
      ValueError: when ``names`` does not have one entry per dimension.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {names} do not match shape {shape}")
    if init in ("ones", "zeros"):
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, jnp.float32)
    else:
        std = (fan_in or shape[0]) ** -0.5
        value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value, logical_axes=tuple(names))


def make_params(module: nnx.Module, rngs: nnx.Rngs, table: tuple[Param, ...]) -> None:
    """Creates the parameters of ``table`` (`models.spec`) on ``module``, in order, each as the
    attribute named by its path's last component.

    Args:
      module: The module being built.
      rngs: The random streams (``params``).
      table: The module's entries, e.g. `models.spec.mlp_params`.
    """
    for p in table:
        setattr(module, p.name, param(rngs, p.shape, p.axes, fan_in=p.fan_in, init=p.init))


class Embed(nnx.Module):
    """Token embedding, table ``[vocab, embed]``.

    Looks up ``[batch, length]`` int32 tokens into ``[batch, length, embed]``
    activations; `attend` projects activations back onto the vocabulary (used
    for tied embeddings).
    """

    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        make_params(self, rngs, embed_params(vocab_size, embed_dim))

    def __call__(self, tokens: jax.Array, dtype, par: Parallelism) -> jax.Array:
        """``[batch, length]`` int32 -> ``[batch, length, embed]`` in ``dtype``.

        Where the batch is split over a mesh axis that the table's ``embed`` dimension is not split over
        (``data`` beside ``fsdp``), the table is read with ``embed`` laid out as the activations'
        (`sharding.vocab.lookup_gathers_table` says why: otherwise XLA gathers the whole batch's activations
        on every device); elsewhere it is read as stored.
        """
        table = self.embedding[...]
        if par.is_sharded and lookup_gathers_table(par.rules, par.auto_shape, *table.shape, tokens.shape[0]):
            table = par.constrain(table, (ax.VOCAB, ax.ACT_EMBED))
        elif par.pipeline is not None and any(par.auto_shape[a] > 1 for a in par.rules.mesh_axes(ax.EMBED)):
            table = par.constrain(table, (ax.VOCAB, ax.EMBED))  # as the rules split it, not as stored over stage
        x = jnp.take(table, tokens, axis=0).astype(dtype)
        # Looked up with the block's length first: under sequence parallelism the lookup's partial sums over a
        # split vocabulary are then summed and scattered along the length (a reduce-scatter), rather than
        # regrouped through the batch axes.
        x = par.constrain(x, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
        return par.constrain(x, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))

    def attend(self, x: jax.Array) -> jax.Array:
        """``[batch, length, embed]`` -> logits ``[batch, length, vocab]``."""
        table = self.embedding[...].astype(x.dtype)
        return jnp.einsum("BTD,VD->BTV", x, table)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), scale ``[embed]``.

    Computes in float32 and returns the input dtype.
    """

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        make_params(self, rngs, norm_params(dim))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dimension (Zhang & Sennrich, 2019): ``x / sqrt(mean(x^2) + eps) * scale``.

    Args:
      x: ``[..., dim]``, any float dtype; computed in float32.
      scale: ``[dim]`` float32.
      eps: added to the mean square.

    Returns:
      ``[..., dim]`` in x's dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """The rotary frequencies ``[head_dim / 2]`` float32 (radians per position).

    ``default``: ``rope_theta ** (-2i / head_dim)`` (Su et al., RoFormer, 2021, eq. 15).
    ``llama3``: Llama 3.1's rescaling (Meta, "The Llama 3 Herd of Models", 2024, and the
    ``apply_scaling`` function of Meta's reference code ``llama_models/llama3/reference_impl/model.py``):
    with wavelength ``w = 2*pi / f``, ``L = rope_original_max_positions``, frequencies whose ``w``
    is below ``L / rope_high_freq_factor`` are kept, those whose ``w`` is above
    ``L / rope_low_freq_factor`` are divided by ``rope_factor``, and between the two
    ``f' = (1 - s) * f / rope_factor + s * f`` with ``s = (L / w - low) / (high - low)``.

    Computed in float64 on the host, rounded once to float32.
    """
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    if config.rope_type == "llama3":
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        context = config.rope_original_max_positions
        wavelength = 2 * math.pi / freqs
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
        freqs = np.where(
            wavelength < context / high, freqs, np.where(wavelength > context / low, freqs / factor, blended)
        )
    return freqs.astype(np.float32)


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float, freqs=None) -> jax.Array:
    """Rotary position embedding (Su et al., RoFormer, 2021), rotate-half form.

    Dimension ``i`` is rotated with dimension ``i + head_dim/2`` (the pairing of Hugging Face
    Llama's ``rotate_half``), so its query/key weights map by reshape alone.

    Args:
      x: ``[batch, length, heads, head_dim]``, any float dtype; head_dim even.
      positions: ``[batch, length]`` int32 positions (per document when packed).
      theta: frequency base (used when ``freqs`` is None).
      freqs: optional ``[head_dim / 2]`` frequencies (`rope_frequencies`).

    Returns:
      ``x`` rotated, same shape and dtype (computed in float32).
    """
    half = x.shape[-1] // 2
    if freqs is None:
        freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    freqs = jnp.asarray(freqs, jnp.float32)
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer, 2020): ``down(silu(x @ gate) * (x @ up))``.

    Weights ``gate, up: [embed, mlp]``, ``down: [mlp, embed]``; with ``config``'s adapters, their factors
    (`models.lora`), added to the weights they adapt as the layer computes.
    """

    def __init__(self, embed_dim: int, mlp_dim: int, *, rngs: nnx.Rngs, config: ModelConfig | None = None):
        make_params(self, rngs, mlp_params(embed_dim, mlp_dim, config))
        if config is not None and config.lora_rank:
            self.lora_scale = lora.scale(config)

    def __call__(self, x: jax.Array, par: Parallelism) -> jax.Array:
        """``[batch, length, embed]`` -> ``[batch, length, embed]`` in x's dtype."""
        dtype = x.dtype
        gate = jnp.einsum("BTD,DF->BTF", x, lora.weight(self, "gate").astype(dtype))
        up = jnp.einsum("BTD,DF->BTF", x, lora.weight(self, "up").astype(dtype))
        hidden = par.constrain(jax.nn.silu(gate) * up, (ax.BATCH, ax.LENGTH, ax.MLP))
        out = jnp.einsum("BTF,FD->BTD", hidden, lora.weight(self, "down").astype(dtype))
        return par.constrain(out, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))
