"""Moving stacked layer arrays between stage layouts (checkpoints saved in one layout, resumed in another).

A layout is a `sharding.pipeline.storage.StageStorage` (``[rows, ...]``, unpadded, how runs store
their stacks), a `sharding.pipeline.layout.StageLayout` (``[stage, slot, ...]``, padded: how checkpoints
saved before the unpadded storage hold them) or None, the canonical ``[layers, ...]`` stack.
`relayout` moves one array with a gather (every device holding whole rows);
`relayout_on_mesh` moves arrays sharded over ``stage`` point to point, so no device ever holds more
than its own rows, its result and one message.
"""

from __future__ import annotations

import functools

import numpy as np

from sharding import axes as ax
from sharding.pipeline.layout import StageLayout
from sharding.pipeline.storage import StageStorage, stack_table
from sharding.varying import to_varying

Layout = StageLayout | StageStorage | None


def layout_rows(layout: Layout, num_layers: int) -> np.ndarray:
    """The canonical layer of each row of a stacked array, flattened (-1: empty slot or row)."""
    return stack_table(layout, num_layers).reshape(-1)


def relayout(x, src: Layout, dst: Layout, num_layers: int):
    """Re-lays one stacked array between layouts (None: canonical ``[layers, ...]``).

    Args:
      x: ``[layers, ...]`` (``src`` None), ``[stages, slots, ...]`` (a `StageLayout`) or ``[rows, ...]``
        (a `StageStorage`).
      src, dst: the layouts it is in and goes to.
      num_layers: L.

    Returns:
      The array in ``dst``'s layout; empty slots and rows are zero. Call it under
      `jax.jit` with the target shardings as ``out_shardings``; called outside one (on gradients, in tests) it
      compiles one program per shape, not one per array operation.
    """
    import jax.numpy as jnp

    if src == dst:
        return x
    lead = stack_table(src, num_layers).ndim
    position = np.zeros(num_layers, np.int32)
    src_rows = layout_rows(src, num_layers)
    position[src_rows[src_rows >= 0]] = np.nonzero(src_rows >= 0)[0]
    table = stack_table(dst, num_layers)
    take = np.where(table >= 0, position[np.maximum(table, 0)], 0)
    keep = jnp.asarray(table >= 0) if (table < 0).any() else None
    return _take_rows()(x, jnp.asarray(take.reshape(-1)), keep, table.shape, lead)


@functools.cache
def _take_rows():
    """`relayout`'s gather as one jitted function ``(x, take, keep, shape, lead) -> y``: the rows ``take``
    (``[prod(shape)]`` int32) of ``x`` with its ``lead`` stack dimensions flattened, reshaped to ``shape``, and
    zero where ``keep`` (bool ``[*shape]``, or None: everywhere kept) is False."""
    import jax
    import jax.numpy as jnp

    def take_rows(x, take, keep, shape, lead):
        rest = x.shape[lead:]
        y = jnp.take(x.reshape(-1, *rest), take, axis=0).reshape(*shape, *rest)
        if keep is None:
            return y
        return jnp.where(keep.reshape(*shape, *([1] * len(rest))), y, jnp.zeros((), y.dtype))

    return jax.jit(take_rows, static_argnums=(3, 4))


def _stage_table(dst, num_layers: int, stages: int) -> np.ndarray:
    """``[S, per_stage]``: the canonical layer of each of a stage's rows in ``dst`` (-1: empty)."""
    return stack_table(dst, num_layers).reshape(stages, -1)


def _transfer_tables(src: Layout, dst: StageLayout | StageStorage, num_layers: int, stages: int, rows: int):
    """Static tables to move rows block-sharded over ``stage`` (``rows`` per stage) into ``dst``.

    Returns:
      For each shift ``d`` (source stage ``s`` sends to ``(s + d) % S``) a pair
      ``(send, recv)`` of int32 ``[S, cap_d]`` arrays: ``send[s]`` the local
      rows stage ``s`` sends, ``recv[t]`` the rows stage ``t`` puts them in
      (its row count for padding, dropped), or None when nothing moves by ``d``.
    """
    src_rows = layout_rows(src, num_layers)
    position = np.zeros(num_layers, np.int64)
    position[src_rows[src_rows >= 0]] = np.nonzero(src_rows >= 0)[0]
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    table = _stage_table(dst, num_layers, stages)
    width = table.shape[1]
    for t in range(stages):
        for k in range(width):
            layer = table[t, k]
            if layer < 0:
                continue
            row = position[layer]
            s = int(row // rows)
            pairs.setdefault(((t - s) % stages, s), []).append((int(row % rows), k))
    tables = []
    for d in range(stages):
        cap = max((len(pairs.get((d, s), ())) for s in range(stages)), default=0)
        if cap == 0:
            tables.append(None)
            continue
        send = np.zeros((stages, cap), np.int32)
        recv = np.full((stages, cap), width, np.int32)
        for s in range(stages):
            for j, (local, slot) in enumerate(pairs.get((d, s), ())):
                send[s, j] = local
                recv[(s + d) % stages, j] = slot
        tables.append((send, recv))
    return tables


def relayout_on_mesh(tree, src: Layout, dst: Layout, num_layers: int, mesh):
    """`relayout` for arrays sharded as `pipeline_rules` shard them, moving rows between stages point to point.

    A plain gather lets the partitioner all-gather the whole stack onto every
    device first. Here, when an array's first dimension is split over
    ``stage`` (as restored onto this mesh), each stage sends exactly the rows
    the other stages need, one ``ppermute`` per stage distance, so no device
    holds more than its source rows, its result and one message. When it is
    not split (it does not divide), every device already has all rows and
    takes its own.

    Args:
      tree: a pytree of arrays ``[layers, ...]`` (``src`` None), ``[stages', slots', ...]`` or
        ``[rows', ...]``, their first dimension split over ``stage`` where the size allows, other
        dimensions as they are.
      src, dst: the layouts; ``dst`` must have ``mesh``'s stage count (or be
        None on a mesh without one).
      num_layers: L.
      mesh: the `jax.sharding.Mesh`.

    Returns:
      The tree in ``dst``'s layout (call under `jax.jit` with the target
      shardings as ``out_shardings``).

    Raises:
      ValueError: ``dst`` has another stage count than ``mesh``.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    stages = dict(mesh.shape).get(ax.STAGE, 1)
    if src == dst:
        return tree
    if stages == 1 or dst is None:
        return jax.tree.map(lambda x: relayout(x, src, dst, num_layers), tree)  # every device holds whole rows
    if dst.stages != stages:
        raise ValueError(f"the layout has {dst.stages} stages but the mesh's stage axis is {stages}")
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [x.shape for x in leaves]
    split = [shape[0] % stages == 0 for shape in shapes]

    def local(*blocks):
        stage = jax.lax.axis_index(ax.STAGE)
        return [
            _move_rows(block, shape, sharded, src, dst, num_layers, stage)
            for block, shape, sharded in zip(blocks, shapes, split)
        ]

    specs = [P(ax.STAGE) if sharded else P() for sharded in split]
    moved = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs), out_specs=[P(ax.STAGE)] * len(leaves), axis_names={ax.STAGE}
    )(*leaves)
    lead = stack_table(dst, num_layers).shape
    lead_in = stack_table(src, num_layers).ndim
    return treedef.unflatten([y.reshape(*lead, *shape[lead_in:]) for y, shape in zip(moved, shapes)])


def _move_rows(block, shape, sharded: bool, src, dst, num_layers: int, stage):
    """One array's part of `relayout_on_mesh`, on one stage: ``block`` -> ``[1, per_stage, ...]`` (its rows in ``dst``)."""
    import jax
    import jax.numpy as jnp

    stages = dst.stages
    lead = stack_table(src, num_layers).ndim
    width = _stage_table(dst, num_layers, stages).shape[1]
    rest = shape[lead:]
    rows = block.reshape(-1, *rest)
    if not sharded:
        y = relayout(rows.reshape(shape), src, dst, num_layers).reshape(stages, width, *rest)  # all rows are here
        return jax.lax.dynamic_index_in_dim(to_varying(y, ax.STAGE), stage, keepdims=True)
    out = to_varying(jnp.zeros((width, *rest), block.dtype), ax.STAGE)
    for d, tables in enumerate(_transfer_tables(src, dst, num_layers, stages, rows.shape[0])):
        if tables is None:
            continue
        send, recv = (jnp.asarray(t)[stage] for t in tables)
        message = jnp.take(rows, send, axis=0)
        if d:
            message = jax.lax.ppermute(message, ax.STAGE, [(s, (s + d) % stages) for s in range(stages)])
        out = out.at[recv].set(message, mode="drop")
    return out[None]
