"""How each attention kernel runs on the run's layout: the records' wrappers, one signature.

Every record of `models.attention_registry.KERNELS` has one wrapper here, ``run_<name>(q [B, T, N, H],
k [B, S, K, H], v, segment_ids [B, T] | None, *, causal, layout, par) -> [B, T, N, H]`` in q's dtype, bound
to the record by ``@_wraps("<name>")``, after which the record holds it (``record.run``, which
`models.attention.attend` runs; `wrapper` returns it), and importing this module fails on a record without one.

The kernels GSPMD cannot partition (a Pallas call, a collective schedule) run per device under
`jax.shard_map` through ``_sharded``, with specs from the rules: batch as ``batch`` is split, heads as
``heads``/``kv_heads``, the length over ``context`` and ``sequence`` for those whose record says they
split it. Einsum letters: B batch, T length (queries), S length (keys), N heads, K kv heads, H head_dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models import attention_registry as registry
from models.attention_reference import jax_dot_product_attention, reference_attention
from models.kernels.cudnn_attention import cudnn_attention
from models.kernels.flash_attention import flash_attention
from models.kernels.ring_attention import ring_attention
from models.kernels.ulysses_attention import ulysses_attention
from models.kernels.usp_attention import usp_attention
from sharding import axes as ax
from sharding.bound import require_bound
from sharding.errors import ConfigError, Field
from sharding.parallel import Parallelism
from sharding.rules import Rules, logical_to_spec

# The records' wrappers ---------------------------------------------------------


def _wraps(name: str) -> Callable[[Callable], Callable]:
    """Binds the decorated function, ``(q, k, v, segment_ids, *, causal, layout, par) -> out``, to the record of
    kernel ``name`` as the wrapper `attend` runs; the record holds it (`sharding.bound.BindsRun`).

    Raises:
      ValueError: On a name the registry does not know (`models.attention_registry.kernel`), or a kernel
        already bound.
    """
    return registry.kernel(name).bind


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


@_wraps("ring")
def run_ring(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
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


@_wraps("ulysses")
def run_ulysses(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
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


@_wraps("usp")
def run_usp(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
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


@_wraps("reference")
def run_reference(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`reference_attention` with one segment-id array; GSPMD partitions it, so ``layout`` (natural
    order, checked by `attend`) and ``par`` are not needed. Shapes as `attend`."""
    del layout, par
    return reference_attention(q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)


@_wraps("flash")
def run_flash(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`sharded_flash_attention` (natural order, checked by `attend`). Shapes as `attend`."""
    del layout
    return sharded_flash_attention(q, k, v, segment_ids, causal=causal, par=par)


@_wraps("dot_product")
def run_dot_product(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """`jax_dot_product_attention`; GSPMD partitions it (natural order, checked by `attend`). Shapes
    as `attend`."""
    del layout, par
    return jax_dot_product_attention(q, k, v, segment_ids, causal=causal)


@_wraps("cudnn")
def run_cudnn(q, k, v, segment_ids, *, causal: bool, layout: str, par: Parallelism):
    """cuDNN's fused attention (`models.kernels.cudnn_attention`) per device under `jax.shard_map`, batch and
    heads split as for `sharded_flash_attention`, the length whole (natural order, checked by `attend`).
    Shapes as `attend`; bfloat16 (the record's dtypes, checked by `models.config.ModelConfig.validate`).

    Raises:
      ValueError: As `models.kernels.cudnn_attention.cudnn_attention` or `head_split`.
      RuntimeError: From JAX, when traced where cuDNN is not installed (entry points refuse it first:
        `models.attention_registry.AttentionKernel.platforms`).
    """
    del layout

    def per_device(q, k, v, segment_ids, _):
        return cudnn_attention(q, k, v, segment_ids, causal=causal)

    return _sharded(per_device, q, k, v, segment_ids, impl="cudnn", par=par)


def wrapper(record: registry.AttentionKernel) -> Callable:
    """The function that runs ``record``'s kernel: the wrapper bound to it by `_wraps`, which it holds
    (``record.run``; for callers that import this module to have the wrappers bound).

    Raises:
      LookupError: When no wrapper is bound to it (checked for every record when this module is imported).
    """
    return record.run


require_bound(registry.KERNELS)
