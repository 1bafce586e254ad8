"""A distributed optimizer over ``data``: where its float32 parameters and moments live (ZeRO stage 1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), stage 1
(P_os); Megatron-LM's ``--use-distributed-optimizer``; MaxText's ``shard_optimizer_over_data``. With
``Parallelism.optimizer_sharding == "data"`` the train state keeps each float32 parameter (the master copy
the optimizer updates) and its optimizer moments split over the ``data`` axis as well as the rules split
them: its *master spec* is its rules' `PartitionSpec` with ``data`` added to one dimension (`master_spec`).
The step gathers the parameters to their rules' layout (replicated over ``data``) before the forward and
backward, and lays the summed gradients out as the master spec before the update, so XLA's partitioner
emits a reduce-scatter of the gradients in place of their all-reduce and an all-gather of the parameters;
each ``data`` rank updates its own slice. The bytes every step moves over ``data`` are the same as the
all-reduce's (a ring all-reduce is a reduce-scatter then an all-gather); the state takes ``1/data`` of the
memory it took.

Which dimension: the one whose block on a device is largest among those ``data`` divides (the first of
equals), so the slices stay contiguous blocks of whole rows where they can; an array no dimension of which
``data`` divides stays replicated over ``data`` (a norm scale of an odd width). The cost model reads the same
choice (`data_split`), so its prices and the compiled state agree array by array.

Such an array is not padded to a split (Megatron-LM's distributed optimizer splits one flat, padded buffer of
all parameters instead, so any ``data`` divides it): a ``data`` of 48 over Megatron's shapes (widths of powers of
two times 3 at most) leaves most of the state whole. Start-up (``--dry-run`` too) and the cost model's lines
name each array left whole (`not_split_lines`), so it is never silent.

Units: elements (shapes), devices (axis sizes). Imports nothing of the project outside `sharding`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

from sharding import axes as ax


def _entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def master_dim(shape: Sequence[int], spec: Sequence, mesh_shape: Mapping[str, int]) -> int | None:
    """The dimension of an array that ``data`` splits in its master spec, or None (it stays replicated).

    Args:
      shape: The array's global shape, e.g. ``[layers, embed, mlp]``.
      spec: Its `PartitionSpec` (or a sequence of entries) under the rules; shorter than ``shape`` where
        trailing dimensions are unsplit.
      mesh_shape: Mesh axis -> size.

    Returns:
      The index of the dimension whose per-device block is largest among those ``data`` divides (the first of
      equals); None when ``data`` is 1, the spec already uses ``data``, or no dimension divides.
    """
    entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)  # a sequence of entries may hold lists
    return _master_dim(tuple(shape), entries, tuple(sorted(mesh_shape.items())))


@functools.lru_cache(maxsize=1 << 16)
def _master_dim(shape: tuple[int, ...], spec: tuple, mesh_items: tuple[tuple[str, int], ...]) -> int | None:
    """`master_dim` on hashable arguments, memoised: the planner asks it of every array of every stage cost
    (hundreds of thousands of calls for a few thousand distinct arrays and meshes)."""
    mesh_shape = dict(mesh_items)
    data = mesh_shape.get(ax.DATA, 1)
    entries = [_entry_axes(spec[d] if d < len(spec) else None) for d in range(len(shape))]
    if data <= 1 or any(ax.DATA in e for e in entries):
        return None
    best, best_size = None, 0
    for d, (size, names) in enumerate(zip(shape, entries)):
        split = math.prod(mesh_shape.get(a, 1) for a in names)
        if size % split:
            continue
        local = size // split
        if local % data == 0 and local > best_size:
            best, best_size = d, local
    return best


def master_spec(shape: Sequence[int], spec, mesh_shape: Mapping[str, int]):
    """The `PartitionSpec` of an array's float32 master copy and moments: ``spec`` with ``data`` added
    (innermost: each device's slice is a block of the block the rules give it, so gathering over ``data``
    alone rebuilds that block without moving data between the other axes' devices) to the dimension
    `master_dim` picks; ``spec`` itself where it picks none.

    Args:
      shape: The array's global shape.
      spec: Its `jax.sharding.PartitionSpec` under the rules (the layout the forward and backward see).
      mesh_shape: Mesh axis -> size.

    Returns:
      A `jax.sharding.PartitionSpec`, trailing unsplit dimensions dropped as the rules write them.
    """
    from jax.sharding import PartitionSpec

    dim = master_dim(shape, spec, mesh_shape)
    if dim is None:
        return spec
    entries = [spec[d] if d < len(spec) else None for d in range(len(shape))]
    names = (*_entry_axes(entries[dim]), ax.DATA)
    entries[dim] = names[0] if len(names) == 1 else names
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def gather_params(params, master_shardings, shardings, compute_dtype):
    """The parameters gathered from their master slices to the layout the forward and backward see (inside jit).

    Where the compute dtype is narrower than a parameter's (bfloat16 compute, float32 masters), each slice is
    rounded to the compute dtype *before* the gather and widened back after it, so the all-gather over ``data``
    moves the compute dtype's bytes (half of float32's) and the forward sees the parameter as the compute dtype
    rounds it, as Megatron-LM's distributed optimizer does (``--use-distributed-optimizer`` with ``--bf16``; its
    documentation: float32 main parameters and moments split over data-parallel ranks, the updated bf16
    parameters all-gathered).
    Widened back, the parameters and so their gradients keep their own dtype: the gradients are summed and
    reduce-scattered in float32 as without the rounding. A weight the model casts to the compute dtype
    before its product (every matrix) computes the same values either way; one it uses in float32 (a norm's
    scale, a router) sees its value rounded. A compute dtype as wide as the parameter (float32) gathers them
    as they are.

    Args:
      params: The parameters as the state holds them (a pytree of arrays, the master slices).
      master_shardings: Their shardings in the state (`master_spec`): the rounded slices are held to them, or
        the partitioner, propagating the gathered layout back through the rounding, gathers the float32
        slices and rounds after.
      shardings: The rules' shardings of the same tree (replicated over ``data``).
      compute_dtype: The model's compute dtype (``jnp.bfloat16``, ``jnp.float32``).

    Returns:
      The tree laid out as ``shardings``, each array of its own dtype.
    """
    import jax
    import jax.numpy as jnp

    def narrowed(p):
        low = jnp.issubdtype(p.dtype, jnp.floating) and jnp.dtype(compute_dtype).itemsize < p.dtype.itemsize
        return p.astype(compute_dtype) if low else p

    narrow = jax.lax.with_sharding_constraint(jax.tree.map(narrowed, params), master_shardings)
    moved = jax.lax.with_sharding_constraint(narrow, shardings)
    return jax.tree.map(lambda g, p: g.astype(p.dtype), moved, params)


def not_split_lines(arrays: Sequence[tuple[str, Sequence[int], Sequence]], mesh_shape: Mapping[str, int]) -> list[str]:
    """Lines naming the arrays the distributed optimizer leaves whole over ``data`` (`master_dim` None while
    ``data`` > 1): a header, one line per array, none when every array is split (or ``data`` is 1).

    Args:
      arrays: ``(path, shape, spec)`` per array: its name, global shape and `PartitionSpec` under the rules.
      mesh_shape: Mesh axis -> size.
    """
    data = mesh_shape.get(ax.DATA, 1)
    whole = [
        (path, tuple(shape)) for path, shape, spec in arrays if data > 1 and master_dim(shape, spec, mesh_shape) is None
    ]
    if not whole:
        return []
    return [
        f"distributed optimizer: not split over data={data} (no dimension's block divides by {data}; float32 copy "
        f"and moments whole on every data rank): {len(whole)} of {len(arrays)} arrays",
        *(f"  not split: {path} {shape}" for path, shape in whole),
    ]


def split_line(arrays: Sequence[tuple[str, Sequence[int], Sequence]], mesh_shape: Mapping[str, int]) -> str:
    """The line saying the optimizer state is split over ``data`` (start-up and ``--dry-run`` print it where the
    distributed optimizer is on): the ``data`` size and how many arrays `master_dim` splits.

    Args:
      arrays: ``(path, shape, spec)`` per array, as `not_split_lines` takes them.
      mesh_shape: Mesh axis -> size.
    """
    data = mesh_shape.get(ax.DATA, 1)
    split = sum(data > 1 and master_dim(shape, spec, mesh_shape) is not None for _, shape, spec in arrays)
    return (
        f"optimizer state: split over data={data} (distributed optimizer, ZeRO stage 1): the float32 parameters "
        f"and moments of {split} of {len(arrays)} arrays, each gathered over data for the forward"
    )


def data_split(shape: Sequence[int], spec, mesh_shape: Mapping[str, int]) -> int:
    """How many ways ``data`` splits an array's master copy: ``data`` where `master_dim` picks a dimension,
    else 1 (what the cost model divides a parameter's and its moments' bytes by)."""
    return 1 if master_dim(shape, spec, mesh_shape) is None else mesh_shape.get(ax.DATA, 1)


__all__ = ["data_split", "gather_params", "master_dim", "master_spec", "not_split_lines", "split_line"]
