"""Grouped-query self-attention, on one device or with the sequence split across devices.

Einsum letters: B batch, T length (queries), S length (keys), D embed,
N heads, K kv heads, H head_dim.

`Attention` projects to queries ``[B, T, N, H]`` and keys/values
``[B, S, K, H]``, applies rotary positions, runs the attention implementation
chosen by ``ModelConfig.attention`` and projects back to ``[B, T, D]``.

The implementations are the records of `models.attention_registry.KERNELS` (``reference``: einsum +
mask + float32 softmax, `models.attention_reference`; ``flash``: our Pallas FlashAttention-2 kernel,
`models.kernels.flash_attention`, per device under `jax.shard_map`; ``ring``: ring attention,
`models.kernels.ring_attention`, Liu et al. 2023; ``ulysses``: all-to-all attention,
`models.kernels.ulysses_attention`, Jacobs et al. 2023; ``usp``: both, `models.kernels.usp_attention`;
``dot_product``: ``jax.nn.dot_product_attention``). `attend` runs the record's wrapper, defined in
`models.attention_kernels` with one signature, ``(q, k, v, segment_ids, *, causal, layout, par)``, and
bound to the record there; the kernels that GSPMD cannot partition run per device under
`jax.shard_map`, with specs from the rules (the length split over ``context`` and ``sequence`` for those
whose record says they split it). This module checks a run's context layout and sizes against the
kernel's record before anything compiles.

Context layout. With the length split over P devices, ``ring`` and ``ulysses``
accept tokens in the ``zigzag`` layout (device r holds chunks r and 2P-1-r of
2P; `models.kernels.ring_attention.zigzag_permutation`), which balances causal
work for ring attention. The data pipeline permutes every ``[batch, length]``
field once on the host; the run's `sharding.parallel.Parallelism` (its
``context_layout``), passed to every layer, tells attention which layout the
tokens are in. An implementation whose record does not list the layout
(``reference``, ``flash``, ``dot_product`` assume natural order) refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention_registry as registry
from models import lora
from models.attention_kernels import head_split  # also binds every record's wrapper (`record.run`)
from models.attention_reference import reference_attention
from models.config import ModelConfig
from models.kernels.ulysses_attention import check_ulysses_heads
from models.layers import make_params, rms_norm, rope_frequencies, rotary_embedding
from models.spec import attention_params
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh
from sharding.parallel import CONTEXT_LAYOUTS, CONTIGUOUS, ZIGZAG, Parallelism

# Context layout ---------------------------------------------------------------


def resolve_context_layout(requested: str, attention: str, shards: int) -> str:
    """The layout a run uses for the field ``context_layout`` (``auto``, ``contiguous``, ``zigzag``).

    ``auto`` is the kernel's record's ``auto_layout`` over a split length (P > 1: ``zigzag``
    for ring attention, since the model is causal and zigzag balances the causal work), else
    ``contiguous``.

    Raises:
      ConfigError: a layout the implementation's record does not accept (naming those that
        do), an unknown value, or an unknown attention; the message names the fields.
    """
    if requested not in CONTEXT_LAYOUTS:
        raise ConfigError(Field("context_layout", repr(requested)), f": choose one of {', '.join(CONTEXT_LAYOUTS)}")
    record = registry.kernel(attention)
    if requested == "auto":
        return record.auto_layout if shards > 1 else CONTIGUOUS
    if requested not in record.layouts:
        first, *others = registry.accepting(requested)
        also = f" (or {', '.join(others)})" if others else ""
        raise ConfigError(
            Field("context_layout", requested),
            ": ",
            Field("attention", attention),
            " assumes tokens in natural order; use ",
            Field("attention", first),
            f"{also}, or ",
            Field("context_layout", "contiguous"),
        )
    return requested


def check_context_parallel(config: ModelConfig, par: Parallelism, seq_len: int) -> None:
    """Sizes the context-parallel attention needs, checked before anything compiles.

    Args:
      config: the model (``attention``, ``num_heads``, ``num_kv_heads``).
      par: the run's layout (where ``length`` and ``heads`` go; its ``context_layout``).
      seq_len: tokens per sequence (``--seq-len``).

    Raises:
      ConfigError: a ``seq_len`` the zigzag layout cannot cut into 2P chunks, or (for an
        attention whose record splits the heads, ``ulysses``) query heads per device
        that the P devices of the sequence axis cannot split (KV heads are repeated,
        `models.kernels.ulysses_attention.kv_repeat`); each names the fields and a value that works.
    """
    record = registry.kernel(config.attention)
    shards = layout_shards(config.attention, par)
    if par.context_shares is not None:
        check_context_shares(config.attention, par, seq_len)
    if par.context_layout == ZIGZAG and seq_len % (2 * shards):
        good = max(2 * shards, seq_len // (2 * shards) * 2 * shards)
        raise ConfigError(
            Field("seq_len", seq_len),
            ": ",
            Field("context_layout", "zigzag"),
            f" cuts each sequence into 2 x {shards} (the devices ",
            Field("attention", config.attention),
            " deals chunks over on ",
            Field("mesh"),
            f") = {2 * shards} equal chunks; use ",
            Field("seq_len", good),
            ", or ",
            Field("context_layout", "contiguous"),
        )
    exchange = math.prod(par.mesh_shape[a] for a in all_to_all_axes(config.attention, par))
    if record.splits_heads and exchange > 1:
        split = head_split(config.num_heads, config.num_kv_heads, par.rules, par.mesh_shape, config.attention)
        try:
            check_ulysses_heads(split.local_heads, split.local_kv_heads, exchange)
        except ValueError as e:
            good = ulysses_mesh(par.mesh_shape, split.local_heads, inner_only=record.inner_all_to_all)
            raise ConfigError(
                Field("attention", config.attention),
                " on ",
                Field("mesh", format_mesh(par.mesh_shape)),
                f": {e} (",
                Field("attention", "ring"),
                "); e.g. ",
                Field("mesh", format_mesh(good)),
            ) from None


def check_context_shares(attention: str, par: Parallelism, seq_len: int) -> None:
    """What uneven sequence shards (``par.context_shares``) need: ring attention (the kernel that masks and
    skips padding) in the zigzag layout over a split length, and, once given, one even share per ring
    device summing to ``seq_len``.

    Raises:
      ConfigError: naming the field ``context_shares`` and a value or fields that work.
    """
    shards = par.length_shards
    even = ",".join(["1"] * max(shards, 2))
    if (
        not registry.kernel(attention).traits.exchange.takes_shares
        or shards < 2
        or par.context_layout not in ("auto", ZIGZAG)
    ):
        # USP and Ulysses trade equal blocks by all-to-all; a ring over the same devices takes the shares.
        raise ConfigError(
            Field("context_shares"),
            " needs ",
            Field("attention", "ring"),
            " over a split length in the zigzag layout (got ",
            Field("attention", attention),
            f", {shards} length device(s), ",
            Field("context_layout", par.context_layout),
            "); e.g. ",
            Field("attention", "ring"),
            " ",
            Field("mesh", _ring_mesh(par)),
            " ",
            Field("context_layout", "zigzag"),
            " ",
            Field("context_shares", "auto"),
        )
    shares = par.context_shares
    if not isinstance(shares, tuple):
        return
    if len(shares) != shards or sum(shares) != seq_len or any(s < 0 or s % 2 for s in shares):
        raise ConfigError(
            Field("context_shares"),
            f" gives {len(shares)} shares (tokens {','.join(map(str, shares))} of ",
            Field("seq_len", seq_len),
            f") for a ring of {shards} devices (",
            Field("mesh", format_mesh(par.mesh_shape)),
            "); give one relative share per ring device, e.g. ",
            Field("context_shares", even),
            ", or ",
            Field("context_shares", "auto"),
        )


def _ring_mesh(par: Parallelism) -> str:
    """A mesh for ring attention on uneven shards: the run's own when it splits the length (one ring over
    ``context`` x ``sequence``), else the run's with a factor 2 of ``data`` or ``fsdp`` moved to ``sequence``."""
    shape = dict(par.mesh_shape)
    if par.length_shards < 2:
        source = next((a for a in (ax.DATA, ax.FSDP) if shape[a] > 1 and shape[a] % 2 == 0), None)
        if source is None:
            return "sequence=2"
        shape[source] //= 2
        shape[ax.SEQUENCE] *= 2
    return format_mesh(shape)


def all_to_all_axes(attention: str, par: Parallelism) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that attention ``attention`` trades for heads by all-to-all.

    All of the length's axes (its rule's, `sharding.rules`) for a kernel whose record splits heads;
    only the innermost of them (``sequence``) for one whose record says ``inner_all_to_all`` (USP, which
    runs a ring over the others); none for the rest.
    """
    record = registry.kernel(attention)
    if not record.splits_heads:
        return ()
    axes = par.rules.mesh_axes(ax.LENGTH)[-1:] if record.inner_all_to_all else par.rules.mesh_axes(ax.LENGTH)
    return tuple(a for a in axes if par.mesh_shape[a] > 1)


def layout_shards(attention: str, par: Parallelism) -> int:
    """The devices the context layout deals a sequence's chunks over: P (the length's devices), or for a
    kernel whose all-to-all runs inside a group (USP) the ring's, P / U (zigzag over the ring)."""
    if registry.kernel(attention).inner_all_to_all:
        return par.length_shards // math.prod(par.mesh_shape[a] for a in all_to_all_axes(attention, par))
    return par.length_shards


def ulysses_mesh(mesh_shape: Mapping[str, int], local_heads: int, *, inner_only: bool = False) -> dict[str, int]:
    """The mesh closest to ``mesh_shape`` on which all-to-all attention splits ``local_heads`` query heads
    per device.

    The all-to-all's devices are cut to their gcd with the heads, on ``sequence``; the devices freed go
    to ``context`` (the ring) when the all-to-all runs over ``sequence`` only (``inner_only``: USP),
    else to ``data`` (and ``context`` folds into the all-to-all's count).
    """
    shape = dict(mesh_shape)
    if inner_only:
        sequence = shape[ax.SEQUENCE]
        good = math.gcd(local_heads, sequence)
        shape[ax.SEQUENCE], shape[ax.CONTEXT] = good, shape[ax.CONTEXT] * sequence // good
        return shape
    length = shape[ax.SEQUENCE] * shape[ax.CONTEXT]
    good = math.gcd(local_heads, length)
    shape[ax.SEQUENCE], shape[ax.CONTEXT], shape[ax.DATA] = good, 1, shape[ax.DATA] * length // good
    return shape


def attend(impl: str, q, k, v, segment_ids, *, causal: bool = True, layout: str | None = None, par: Parallelism):
    """Runs attention implementation ``impl`` (a record of `models.attention_registry.KERNELS`).

    Args:
      impl: the kernel's name, e.g. ``reference``, ``flash``, ``ring`` or ``ulysses``.
      q: ``[batch, length, heads, head_dim]``.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask.
      layout: the tokens' context layout; default ``par.context_layout``.
      par: the run's layout (`sharding.parallel.Parallelism`): mesh, rules, context layout.

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype.

    Raises:
      ValueError: an unknown implementation, a layout its record does not accept (natural order
        only, for most), or what the implementation raises.
    """
    layout = par.context_layout if layout is None else layout
    record = registry.kernel(impl)
    if layout not in record.layouts:
        raise ConfigError(
            Field("attention", impl),
            f" assumes tokens in natural order, but they are in the {layout} layout; use ",
            Field("attention", " or ".join(registry.accepting(layout))),
            ", or ",
            Field("context_layout", "contiguous"),
        )
    return record.run(q, k, v, segment_ids, causal=causal, layout=layout, par=par)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions.

    Weights ``q: [embed, heads, head_dim]``, ``k, v: [embed, kv_heads,
    head_dim]``, ``o: [heads, head_dim, embed]``; with ``qkv_bias`` also ``q_bias: [heads,
    head_dim]`` and ``k_bias, v_bias: [kv_heads, head_dim]`` (zero at initialisation); with ``qk_norm``
    also the RMSNorm scales ``q_norm, k_norm: [head_dim]``, applied to each head before the rotation.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        make_params(self, rngs, attention_params(config))
        self.config = config
        if config.lora_rank:
            self.lora_scale = lora.scale(config)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, par: Parallelism
    ) -> jax.Array:
        """``[batch, length, embed]`` -> ``[batch, length, embed]`` in x's dtype.

        Args:
          x: activations ``[batch, length, embed]``.
          positions: ``[batch, length]`` int32 rotary positions.
          segment_ids: ``[batch, length]`` int32 document ids, or None.
          par: the run's layout (`sharding.parallel.Parallelism`).

        Tokens may be in the zigzag context layout (``par.context_layout``); positions and
        segment ids come permuted with them, so only the attention needs to know.
        """
        q, k, v = self.project_qkv(x, positions, par)
        out = attend(self.config.attention, q, k, v, segment_ids, causal=True, par=par)
        return self.project_out(out, par)

    def project_qkv(self, x: jax.Array, positions: jax.Array, par: Parallelism):
        """Queries ``[B, T, N, H]`` and keys, values ``[B, T, K, H]`` (rotary positions applied), x's dtype.

        Args:
          x: activations ``[batch, length, embed]``.
          positions: ``[batch, length]`` int32 rotary positions.
          par: the run's layout.
        """
        cfg, dtype = self.config, x.dtype
        q = jnp.einsum("BTD,DNH->BTNH", x, lora.weight(self, "q").astype(dtype))
        k = jnp.einsum("BSD,DKH->BSKH", x, lora.weight(self, "k").astype(dtype))
        v = jnp.einsum("BSD,DKH->BSKH", x, lora.weight(self, "v").astype(dtype))
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dtype)
            k = k + self.k_bias[...].astype(dtype)
            v = v + self.v_bias[...].astype(dtype)
        if cfg.qk_norm:  # per head, before the rotation (Qwen3)
            q = rms_norm(q, self.q_norm[...], cfg.norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.norm_eps)
        freqs = rope_frequencies(cfg)
        q = par.constrain(
            rotary_embedding(q, positions, cfg.rope_theta, freqs), (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)
        )
        k = par.constrain(
            rotary_embedding(k, positions, cfg.rope_theta, freqs), (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
        )
        v = par.constrain(v, (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM))
        return q, k, v

    def extend(self, x: jax.Array, positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array, par: Parallelism):
        """Attention of new tokens over a key/value cache (prefill and decoding), writing theirs into it.

        Row ``b``'s new tokens sit at cache positions ``positions[b, 0] + t`` (contiguous); each
        attends every cache position up to its own. Later positions may hold stale values (padding
        of a shorter prompt): they are masked now and overwritten when a token reaches them.
        Always the reference attention (an explicit mask).

        Args:
          x: activations ``[batch, new, embed]``.
          positions: ``[batch, new]`` int32, ``positions[b, 0] + arange(new)``.
          k_cache, v_cache: ``[batch, max_length, kv_heads, head_dim]``.
          par: the run's layout.

        Returns:
          ``(y [batch, new, embed], k_cache, v_cache)``; caches keep their dtype.
        """
        q, k, v = self.project_qkv(x, positions, par)
        new, max_length = x.shape[1], k_cache.shape[1]
        offset = jnp.arange(max_length)[None] - positions[:, :1]  # [B, S]: which new token lands at s
        fresh = ((offset >= 0) & (offset < new))[:, :, None, None]
        pick = jnp.clip(offset, 0, new - 1)[:, :, None, None]
        names = (ax.BATCH, None, ax.KV_HEADS, ax.HEAD_DIM)
        k_cache = par.constrain(
            jnp.where(fresh, jnp.take_along_axis(k, pick, axis=1).astype(k_cache.dtype), k_cache), names
        )
        v_cache = par.constrain(
            jnp.where(fresh, jnp.take_along_axis(v, pick, axis=1).astype(v_cache.dtype), v_cache), names
        )
        mask = jnp.arange(max_length)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        out = reference_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), causal=False, mask=mask)
        return self.project_out(out, par), k_cache, v_cache

    def project_out(self, out: jax.Array, par: Parallelism) -> jax.Array:
        """Attention output ``[B, T, N, H]`` -> ``[B, T, D]`` (same dtype), laid out by ``par``."""
        out = par.constrain(out, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        y = jnp.einsum("BTNH,NHD->BTD", out, lora.weight(self, "o").astype(out.dtype))
        return par.constrain(y, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))
