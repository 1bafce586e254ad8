"""Grouped-query self-attention, on one device or with the sequence split across devices.

Einsum letters: B batch, T length (queries), S length (keys), D embed,
N heads, K kv heads, G query heads per kv head (N = K*G), H head_dim, R the query rows of
one kv head (R = G*T, `reference_attention`'s products).

`Attention` projects to queries ``[B, T, N, H]`` and keys/values
``[B, S, K, H]``, applies rotary positions, runs the attention implementation
chosen by ``ModelConfig.attention`` and projects back to ``[B, T, D]``.

The implementations are the records of `models.attention_registry.KERNELS` (``reference``: einsum +
mask + float32 softmax, below; ``flash``: our Pallas FlashAttention-2 kernel,
`models.kernels.flash_attention`, per device under `jax.shard_map`; ``ring``: ring attention,
`models.kernels.ring_attention`, Liu et al. 2023; ``ulysses``: all-to-all attention,
`models.kernels.ulysses_attention`, Jacobs et al. 2023; ``dot_product``:
``jax.nn.dot_product_attention``). `attend` runs the record's wrapper, defined here with one
signature, ``(q, k, v, segment_ids, *, causal, layout, par)``; the kernels that GSPMD cannot
partition run per device under `jax.shard_map` through ``_sharded``, with specs from the rules (the
length split over ``sequence`` for those whose record says they split it).

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

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models import attention_registry as registry
from models.config import ModelConfig
from models.kernels.flash_attention import flash_attention
from models.kernels.ring_attention import ring_attention
from models.kernels.ulysses_attention import check_ulysses_heads, ulysses_attention
from models.kernels.usp_attention import usp_attention
from models.layers import make_params, rms_norm, rope_frequencies, rotary_embedding
from models.spec import attention_params
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.mesh import format_mesh
from sharding.parallel import CONTEXT_LAYOUTS, CONTIGUOUS, ZIGZAG, Parallelism
from sharding.rules import Rules, logical_to_spec


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
    if attention != "ring" or shards < 2 or par.context_layout not in ("auto", ZIGZAG):
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


# Sharded attention under shard_map ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How each device holds the heads under the rules.

    Attributes:
      q_axes: mesh axes splitting ``heads`` (empty: whole).
      kv_axes: mesh axes splitting ``kv_heads``.
      local_heads: query heads per device.
      local_kv_heads: KV heads per device as the kernel sees them.
      slice_kv: KV heads are whole on each device (fewer than the head split) and each
        device slices the ``local_kv_heads`` its query heads use.
      group: G, query heads per KV head.
    """

    q_axes: tuple[str, ...]
    kv_axes: tuple[str, ...]
    local_heads: int
    local_kv_heads: int
    slice_kv: bool
    group: int


def _entry_axes(spec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if len(spec) > dim else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(spec, dim: int):
    return spec[dim] if len(spec) > dim else None


def head_split(
    num_heads: int, num_kv_heads: int, rules: Rules, mesh_shape: Mapping[str, int], impl: str = "flash"
) -> HeadSplit:
    """Query and KV heads per device for kernels run under `shard_map`.

    When ``heads`` is split but ``kv_heads`` is not (fewer KV heads than ``tensor``
    devices), each device slices the KV heads its query heads use.

    Raises:
      ConfigError: when the head split cannot be matched to the KV heads (naming
        the field ``attention`` and the ``rule`` that fixes it).
    """
    q_spec, _ = logical_to_spec((ax.HEADS,), rules, (num_heads,), mesh_shape)
    kv_spec, _ = logical_to_spec((ax.KV_HEADS,), rules, (num_kv_heads,), mesh_shape)
    q_axes, kv_axes = _entry_axes(q_spec, 0), _entry_axes(kv_spec, 0)
    local_heads = num_heads // math.prod(mesh_shape[a] for a in q_axes)
    group = num_heads // num_kv_heads
    slice_kv = bool(q_axes) and kv_axes != q_axes
    if slice_kv and (kv_axes or (local_heads % group and group % local_heads)):
        raise ConfigError(
            Field("attention", impl),
            f": heads split over {'+'.join(q_axes)} ({num_heads} heads, {num_kv_heads} KV heads) cannot be "
            "matched to the KV heads; use ",
            Field("rule", "kv_heads=none"),
            " or ",
            Field("rule", "heads=none"),
        )
    if slice_kv:
        local_kv = max(1, local_heads // group)
    else:
        local_kv = num_kv_heads // math.prod(mesh_shape[a] for a in kv_axes)
    return HeadSplit(q_axes, kv_axes, local_heads, local_kv, slice_kv, group)


def _local_kv(split: HeadSplit, sizes: Mapping[str, int], k, v):
    """The KV heads this device's query heads use (inside shard_map, when sliced)."""
    if not split.slice_kv:
        return k, v
    index = jnp.zeros((), jnp.int32)
    for axis in split.q_axes:
        index = index * sizes[axis] + jax.lax.axis_index(axis)
    start = index * split.local_heads // split.group  # KV head of this device's first query head
    return tuple(jax.lax.dynamic_slice_in_dim(x, start, split.local_kv_heads, axis=2) for x in (k, v))


def _sharded(local_kernel, q, k, v, segment_ids, *, impl: str, par: Parallelism):
    """Runs ``local_kernel(q, k, v, segment_ids, length_axes)`` per device under `jax.shard_map`.

    Specs come from the rules: batch as ``batch`` is split (``data``/``fsdp``), heads as
    ``heads``/``kv_heads`` (``tensor``), the length as ``length`` (``sequence``) when the record
    of ``impl`` (`models.attention_registry`) says it splits the length, else whole. ``length_axes`` is the tuple of mesh axes the length is
    split over (empty when whole). Where ``par`` shards nothing (one device, or per-device
    code inside another `jax.shard_map`) the kernel runs directly with no axes.

    Inside a `jax.shard_map` manual over some axes (``par.manual``: the pipeline's stage program,
    manual over ``stage``, ``data`` and ``fsdp``) the arrays are already this device's rows over
    those axes; the map opens only over the axes still automatic there (``sequence``, ``tensor``),
    through `_nested`, and where none of size > 1 is left the kernel runs directly on the block.
    """
    if not par.is_sharded:
        return local_kernel(q, k, v, segment_ids, ())
    mesh, rules = par.mesh, par.rules
    sizes = par.auto_shape
    length = ax.LENGTH if registry.kernel(impl).traits.splits_length else None
    q_spec, _ = logical_to_spec((ax.BATCH, length, ax.HEADS, None), rules, q.shape, sizes)
    kv_spec, _ = logical_to_spec((ax.BATCH, length, ax.KV_HEADS, None), rules, k.shape, sizes)
    split = head_split(q.shape[2], k.shape[2], rules, sizes, impl)
    if split.slice_kv:
        kv_spec = PartitionSpec(_entry(q_spec, 0), _entry(q_spec, 1))
    seg_spec = PartitionSpec(_entry(q_spec, 0), _entry(q_spec, 1))
    length_axes = _entry_axes(q_spec, 1)

    def local(q, k, v, segment_ids):
        k, v = _local_kv(split, sizes, k, v)
        return local_kernel(q, k, v, segment_ids, length_axes)

    if par.manual:
        axes = tuple(a for a in mesh.axis_names if a not in par.manual and sizes[a] > 1)
        return _nested(local, q, k, v, segment_ids, (q_spec, kv_spec, kv_spec, seg_spec), q_spec, mesh, axes)
    if segment_ids is None:
        run = jax.shard_map(
            lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec
        )
        return run(q, k, v)
    run = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec)
    return run(q, k, v, segment_ids)


def _nested(local, q, k, v, segment_ids, in_specs, out_spec, mesh, axes: tuple[str, ...]):
    """``local(q, k, v, segment_ids)`` under `jax.shard_map` manual over ``axes``, inside another map.

    Used where the caller is already inside a `jax.shard_map` manual over other axes (the pipeline's
    stage program, manual over ``stage`` and the batch axes): the kernel's map opens only over the
    axes still automatic there (``sequence``, ``tensor``). Such a nested map lowers, but JAX's
    partial evaluation of it (what `jax.vjp` and `jax.checkpoint` do) gives its residual outputs
    specs over every mesh axis, the outer map's manual ones included, and the program then fails
    MLIR verification. So the map is differentiated by hand (`jax.custom_vjp`): the forward map runs
    ``jax.vjp`` of the kernel and returns, besides the output, the leaves of its pullback (the
    kernel's own residuals) stacked along a new leading dimension over ``axes``, one per device; the
    backward map takes each device's residuals back and applies the pullback. No work is repeated:
    the residuals are those the kernel keeps unnested.

    Args:
      local: the per-device kernel ``(q, k, v, segment_ids) -> out`` (``segment_ids`` may be None).
      q, k, v, segment_ids: as `_sharded` (this device's rows over the outer map's manual axes).
      in_specs: `PartitionSpec` of ``q, k, v, segment_ids`` over ``axes``; out_spec: the output's.
      mesh: the abstract mesh of the enclosing map; axes: the mesh axes not manual there.

    Returns:
      ``[batch, length, heads, head_dim]`` as ``local`` computes it, laid out as ``out_spec``.
    """
    stacked = PartitionSpec(axes)
    has_segments = segment_ids is not None
    specs = in_specs if has_segments else in_specs[:3]
    pullback_tree = {}

    def shard(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes))

    def forward_local(q, k, v, *segments):
        seg = segments[0] if segments else None
        out, pullback = jax.vjp(lambda q, k, v: local(q, k, v, seg), q, k, v)
        leaves, pullback_tree["tree"] = jax.tree.flatten(pullback)
        return out, [leaf[None] for leaf in leaves]

    def backward_local(residuals, g):
        pullback = jax.tree.unflatten(pullback_tree["tree"], [leaf[0] for leaf in residuals])
        return pullback(g)

    @jax.custom_vjp
    def run(q, k, v, *segments):
        return shard(lambda q, k, v, *seg: local(q, k, v, seg[0] if seg else None), specs, out_spec)(q, k, v, *segments)

    def run_fwd(q, k, v, *segments):
        out, residuals = shard(forward_local, specs, (out_spec, stacked))(q, k, v, *segments)
        return out, (residuals, segments)

    def run_bwd(saved, g):
        residuals, segments = saved
        dq, dk, dv = shard(backward_local, (stacked, out_spec), tuple(specs[:3]))(residuals, g)
        return (dq, dk, dv, *(None for _ in segments))

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, *((segment_ids,) if has_segments else ()))


def sharded_flash_attention(q, k, v, segment_ids, *, causal: bool = True, par: Parallelism):
    """Our Pallas flash attention, run per device under `jax.shard_map`.

    GSPMD cannot partition a Pallas call, so the kernel runs on each device's
    block: ``batch`` split as the rules split it (``data``/``fsdp``), heads as
    the rules split ``heads`` (``tensor``), the length whole. When ``heads``
    is split but ``kv_heads`` is not (fewer KV heads than ``tensor``
    devices), each device slices the KV heads its query heads use.
    Where ``par`` shards nothing the kernel is called directly.

    Args:
      q: ``[batch, length, heads, head_dim]``.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask.
      par: the run's layout (`sharding.parallel.Parallelism`).

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype.

    Raises:
      ValueError: when the head split cannot be matched to the KV heads.
    """

    def per_device(q, k, v, segment_ids, _):
        return flash_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, causal=causal)

    return _sharded(per_device, q, k, v, segment_ids, impl="flash", par=par)


def _flash_when_whole(split, causal: bool):
    """The per-device function of a context-parallel kernel for `_sharded`: ``split(q, k, v, segment_ids,
    length_axes)`` over a split length, the flash kernel where the length is whole (no axes)."""

    def per_device(q, k, v, segment_ids, length_axes):
        if not length_axes:
            return flash_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, causal=causal)
        return split(q, k, v, segment_ids, length_axes)

    return per_device


def sharded_ring_attention(q, k, v, segment_ids, *, causal: bool = True, layout: str = CONTIGUOUS, par: Parallelism):
    """Ring attention (Liu et al., 2023) over the mesh axes of ``length``, under `jax.shard_map`.

    Each device keeps its block of queries; key/value blocks (and their segment ids) travel
    around the ring of the devices that split ``length`` (`models.kernels.ring_attention`).
    Batch and heads are split as for `sharded_flash_attention`. With the length whole
    (no ``sequence`` axis) it is flash attention. With ``par.context_shares`` (uneven shards)
    the tokens are in `models.kernels.ring_attention.uneven_zigzag_layout` order, padded.

    Args:
      q: ``[batch, length, heads, head_dim]``, tokens in ``layout`` order.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask in the tokens' natural order.
      layout: ``contiguous`` or ``zigzag``: how the tokens lie along the length.
      par: the run's layout (`sharding.parallel.Parallelism`).

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype and layout.

    Raises:
      ValueError: as `sharded_flash_attention`, or an odd local length under zigzag.
    """

    shares = par.context_shares if isinstance(par.context_shares, tuple) else None

    def split(q, k, v, segment_ids, length_axes):
        return ring_attention(
            q,
            k,
            v,
            axis_name=length_axes,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            causal=causal,
            layout=layout,
            shares=shares,
        )

    return _sharded(_flash_when_whole(split, causal), q, k, v, segment_ids, impl="ring", par=par)


def sharded_ulysses_attention(q, k, v, segment_ids, *, causal: bool = True, layout: str = CONTIGUOUS, par: Parallelism):
    """All-to-all attention (Jacobs et al., 2023) over the mesh axes of ``length``.

    Queries, keys and values are traded from length-split to head-split, attended whole
    with the flash kernel, and the output traded back (`models.kernels.ulysses_attention`).

    Args:
      q: ``[batch, length, heads, head_dim]``, tokens in ``layout`` order.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask in the tokens' natural order.
      layout: ``contiguous`` or ``zigzag``.
      par: the run's layout (`sharding.parallel.Parallelism`).

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype and layout.

    Raises:
      ValueError: heads or KV heads per device not divisible by the length split
        (suggesting ring attention), or as `sharded_flash_attention`.
    """

    def split(q, k, v, segment_ids, length_axes):
        return ulysses_attention(
            q,
            k,
            v,
            axis_name=length_axes,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            causal=causal,
            layout=layout,
        )

    return _sharded(_flash_when_whole(split, causal), q, k, v, segment_ids, impl="ulysses", par=par)


def sharded_usp_attention(q, k, v, segment_ids, *, causal: bool = True, layout: str = CONTIGUOUS, par: Parallelism):
    """USP attention (Fang & Zhao, 2024): all-to-all over the innermost mesh axis of ``length``
    (``sequence``), ring attention over the others (``context``), under `jax.shard_map`
    (`models.kernels.usp_attention`). With one of the two of size 1 it is ring or all-to-all attention.

    Args:
      q: ``[batch, length, heads, head_dim]``, tokens in ``layout`` order (zigzag over the ring's
        devices, `layout_shards`).
      k, v: ``[batch, length, kv_heads, head_dim]``.
      segment_ids: ``[batch, length]`` int32 or None.
      causal: causal mask in the tokens' natural order.
      layout: ``contiguous`` or ``zigzag``.
      par: the run's layout (`sharding.parallel.Parallelism`).

    Returns:
      ``[batch, length, heads, head_dim]`` in q's dtype and layout.

    Raises:
      ValueError: heads per device not divisible by the all-to-all's devices, or as
        `sharded_flash_attention`.
    """
    inner = par.rules.mesh_axes(ax.LENGTH)[-1:]

    def split(q, k, v, segment_ids, length_axes):
        exchange = tuple(a for a in length_axes if a in inner)
        return usp_attention(
            q,
            k,
            v,
            ring_axis=tuple(a for a in length_axes if a not in inner),
            all_to_all_axis=exchange[0] if exchange else None,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            causal=causal,
            layout=layout,
        )

    return _sharded(_flash_when_whole(split, causal), q, k, v, segment_ids, impl="usp", par=par)


# The records' wrappers: (q, k, v, segment_ids, *, causal, layout, par) -> out --------


def run_reference(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`reference_attention` with one segment-id array; GSPMD partitions it, so ``layout`` (natural
    order, checked by `attend`) and ``par`` are not needed. Shapes as `attend`."""
    del layout, par
    return reference_attention(q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)


def run_flash(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`sharded_flash_attention` (natural order, checked by `attend`). Shapes as `attend`."""
    del layout
    return sharded_flash_attention(q, k, v, segment_ids, causal=causal, par=par)


def run_dot_product(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`jax_dot_product_attention`; GSPMD partitions it (natural order, checked by `attend`). Shapes
    as `attend`."""
    del layout, par
    return jax_dot_product_attention(q, k, v, segment_ids, causal=causal)


def wrapper(record: registry.AttentionKernel):
    """The function that runs ``record``'s kernel: the one of this module its ``wrapper`` names.

    Raises:
      LookupError: When this module has no function of that name (checked for every record at import).
    """
    run = globals().get(record.wrapper)
    if not callable(run):
        raise LookupError(
            f"attention {record.name}: its wrapper {record.wrapper!r} is not a function of models.attention"
        )
    return run


for _record in registry.KERNELS:  # a record naming a missing wrapper fails here, not at a run's first step
    wrapper(_record)
del _record


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
    return wrapper(record)(q, k, v, segment_ids, causal=causal, layout=layout, par=par)


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
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...].astype(dtype))
        k = jnp.einsum("BSD,DKH->BSKH", x, self.k[...].astype(dtype))
        v = jnp.einsum("BSD,DKH->BSKH", x, self.v[...].astype(dtype))
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
        y = jnp.einsum("BTNH,NHD->BTD", out, self.o[...].astype(out.dtype))
        return par.constrain(y, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
