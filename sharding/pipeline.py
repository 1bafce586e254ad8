"""Pipeline parallelism over the ``stage`` mesh axis, in one SPMD program.

The layer stack ``[layers, ...]`` is split into ``S`` stages, one per index of
the ``stage`` mesh axis, and each global batch into ``M`` microbatches that
flow from stage to stage. Stages may hold different numbers of layers
(``--stage-layers 10,10,6,6``): on mixed devices, or when ``S`` does not
divide the layer count.

Layout. Every stacked layer parameter is re-laid from the canonical
``[layers, ...]`` to ``[stage, slot, ...]`` and sharded over ``stage``
(logical axis ``layers`` -> mesh axis ``stage``, see `pipeline_rules`). All
devices of one SPMD program hold arrays of one shape, so each stage has
``slots = R * K`` slots, ``K`` the most layers any stage runs in one repeat;
a stage with fewer layers leaves slots empty (zeros). Empty slots cost memory
(parameters, optimizer state and their slot inputs, shown by the report) but
no compute: each slot's layer runs inside a `jax.lax.cond` on ``slot < the
stage's own layer count`` (bubble steps count 0), forward and backward.
`StageLayout` holds the plan; `relayout` and `relayout_on_mesh` move stacked
arrays between layouts (and the canonical one).

Schedules. With ``R`` repeats, stage ``s`` holds chunks ``s, S+s, 2S+s, ...``
of the ``S*R`` chunks the layers are cut into, in order (the circular or
interleaved placement of Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2, and
of praxis's circular ``LayerwiseShardablePipelined``). ``R = 1`` is GPipe
(Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism", NeurIPS 2019): all microbatches forward, then all
backward. At step ``t`` stage ``s`` runs iteration ``i = t - s`` (microbatch
``i % M``, repeat ``i // M``) when ``0 <= i < R*M``, so a pass takes
``R*M + S - 1`` steps of one chunk each, of which ``S - 1`` are the fill and
drain bubble: the bubble fraction ``(S-1) / (R*M + S - 1)``. Circular needs
``M >= S`` (a microbatch is back at stage 0 before its next repeat starts).

Backward pass. `_pipeline_program` is a `jax.custom_vjp`: its forward keeps
each slot's input, its backward runs the steps in reverse, sends cotangents
up the ring and differentiates each layer with `jax.vjp` (recomputing it, as
``--remat full`` would; the model's remat policy applies inside the layer).
Left to autodiff, the conditionals would save a slice of the stage's
parameters per step as residuals, a copy of them per pipeline step.

SPMD mechanics. `run_pipeline` runs the stage program under `jax.shard_map`
manual over ``stage`` only (``axis_names={'stage'}``); ``data``, ``fsdp``,
``sequence`` and ``tensor`` stay automatic, so GSPMD still partitions every
layer as the logical rules say. Activations move to the next stage with one
`jax.lax.ppermute` per step (a ring: the last stage sends to stage 0, which
keeps what it receives for the microbatch's next repeat). No collective over
``stage`` sits inside a cond: the ppermutes run in step loops whose trip
count is the same on every device, and one ``psum`` after the loop hands the
last stage's outputs to every stage. Inputs that are the same on every stage
are cast to stage-varying (`jax.lax.pcast`) before the loop, so their
gradients are reduced once, after it. Collectives GSPMD puts inside a layer
(all-gathers over ``fsdp``, all-reduces over ``tensor``) involve devices of
one stage, which take the same branch; `branch_collectives` checks the
compiled program, and `train.step.Trainer` falls back to computing every slot
(`PipelinePlan.skip_empty` False) if the partitioner put anything else there.

What runs outside the pipeline (embedding, final norm, output projection and
loss) is replicated over ``stage``: every stage computes it for the whole
batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from sharding import axes as ax

SCHEDULES = ("gpipe", "circular")


# Layouts ----------------------------------------------------------------------


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """``total`` items over ``parts`` bins, the first ``total % parts`` bins one larger."""
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which layers each stage holds, and where they sit in its slots.

    Attributes:
      chunks: ``chunks[r][s]``, the layers stage ``s`` runs in repeat ``r``
        (``R`` rows of ``S`` entries). Chunks take consecutive layers in the
        order ``r*S + s``: stage 0 repeat 0 first, stage ``S-1`` repeat
        ``R-1`` last.
    """

    chunks: tuple[tuple[int, ...], ...]

    @property
    def stages(self) -> int:
        """S, the size of the ``stage`` mesh axis."""
        return len(self.chunks[0])

    @property
    def repeats(self) -> int:
        """R, the chunks per stage (1: GPipe; more: circular)."""
        return len(self.chunks)

    @property
    def schedule(self) -> str:
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def num_layers(self) -> int:
        return sum(map(sum, self.chunks))

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers per stage, over all its repeats."""
        return tuple(sum(row[s] for row in self.chunks) for s in range(self.stages))

    @property
    def chunk_slots(self) -> int:
        """K, slots per chunk: the most layers of any chunk."""
        return max(map(max, self.chunks))

    @property
    def slots(self) -> int:
        """``R * K``, the slots every stage holds."""
        return self.repeats * self.chunk_slots

    @property
    def padding(self) -> tuple[int, ...]:
        """Empty slots per stage: ``slots - stage_layers[s]``."""
        return tuple(self.slots - n for n in self.stage_layers)

    def layer_table(self) -> np.ndarray:
        """``[stages, slots]`` int32: the canonical layer in each slot, -1 where empty.

        Slot ``r*K + k`` of stage ``s`` holds the ``k``-th layer of chunk ``(r, s)``.
        """
        table = np.full((self.stages, self.slots), -1, np.int32)
        layer = 0
        for r, row in enumerate(self.chunks):
            for s, count in enumerate(row):
                start = r * self.chunk_slots
                table[s, start : start + count] = np.arange(layer, layer + count)
                layer += count
        return table

    def stage_ranges(self, stage: int) -> list[tuple[int, int]]:
        """The canonical layer ranges ``[start, stop)`` stage ``stage`` holds, one per repeat."""
        ranges, layer = [], 0
        for row in self.chunks:
            for s, count in enumerate(row):
                if s == stage:
                    ranges.append((layer, layer + count))
                layer += count
        return ranges

    def stacked_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``[layers, *rest]`` -> ``[stages, slots, *rest]``."""
        if shape[0] != self.num_layers:
            raise ValueError(f"a stacked array of shape {tuple(shape)} does not have {self.num_layers} layers")
        return (self.stages, self.slots, *shape[1:])

    @staticmethod
    def stacked_names(names: Sequence[str | None]) -> tuple[str | None, ...]:
        """Logical names ``(layers, *rest)`` -> ``(layers, None, *rest)``: the stage dim keeps ``layers``."""
        return (names[0], None, *names[1:])

    def describe(self) -> str:
        """``'10,10,6,6 (gpipe)'`` or ``'5+5,5+5,3+3,3+3 (circular, 2 repeats)'``."""
        if self.repeats == 1:
            return ",".join(map(str, self.stage_layers)) + " (gpipe)"
        per_stage = ("+".join(str(row[s]) for row in self.chunks) for s in range(self.stages))
        return ",".join(per_stage) + f" (circular, {self.repeats} repeats)"

    def to_meta(self) -> dict[str, Any]:
        """JSON-friendly form, stored with checkpoints."""
        return {"chunks": [list(row) for row in self.chunks], "stage_layers": list(self.stage_layers),
                "schedule": self.schedule}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> StageLayout | None:
        """Inverse of `to_meta`; None (canonical layout) for None."""
        if not meta:
            return None
        return cls(tuple(tuple(int(n) for n in row) for row in meta["chunks"]))


def parse_stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``'10,10,6,6'`` -> ``(10, 10, 6, 6)``.

    Raises:
      ValueError: an entry that is not an integer, naming ``--stage-layers``.
    """
    if text is None or not text.strip():
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--stage-layers {text!r}: expected comma-separated layer counts, e.g. "
                         "--stage-layers 10,10,6,6") from None


def _join(counts: Sequence[int]) -> str:
    return ",".join(map(str, counts))


def plan_layout(
    num_layers: int,
    stages: int,
    repeats: int = 1,
    stage_layers: Sequence[int] | None = None,
) -> tuple[StageLayout, str | None]:
    """Splits ``num_layers`` layers over ``stages`` stages and ``repeats`` repeats.

    Args:
      num_layers: L, the model's layers.
      stages: S, the size of the ``stage`` mesh axis.
      repeats: R, chunks per stage (``--pipeline-repeats``; 1 is GPipe).
      stage_layers: ``--stage-layers``: S counts (layers per stage; with R > 1
        each is split over the stage's R chunks, the earlier chunks taking
        the remainder) or, with R > 1, S*R counts (per chunk, in pipeline
        order ``r*S + s``). None splits evenly where it can, and otherwise
        gives the first stages one more.

    Returns:
      ``(layout, note)``: the `StageLayout` and, when ``stage_layers`` was not
      given and the split is uneven, a line saying how it split (else None).

    Raises:
      ValueError: fewer layers than stages (or chunks); a ``--stage-layers``
        with the wrong number of entries, a zero or negative entry, or a sum
        other than ``num_layers``. Each message names the flag, the value and
        one that works.
    """
    chunks_total = stages * repeats
    if repeats < 1:
        raise ValueError(f"--pipeline-repeats {repeats}: must be at least 1")
    if num_layers < stages:
        raise ValueError(
            f"--mesh stage={stages}: the model has {num_layers} layers, fewer than the {stages} stages; use "
            f"--mesh stage={_largest_divisor_at_most(num_layers, stages)} (or more layers, --set num_layers={stages})"
        )
    if num_layers < chunks_total:
        raise ValueError(
            f"--pipeline-repeats {repeats}: {stages} stages x {repeats} repeats = {chunks_total} chunks, more than "
            f"the {num_layers} layers; use --pipeline-repeats {max(num_layers // stages, 1)}"
        )
    even = split_evenly(num_layers, chunks_total)
    if stage_layers is None:
        chunks = tuple(tuple(even[r * stages : (r + 1) * stages]) for r in range(repeats))
        layout = StageLayout(chunks)
        note = None
        if num_layers % chunks_total:
            note = (f"--stage-layers not given: {num_layers} layers do not split evenly over {chunks_total} "
                    f"{'stages' if repeats == 1 else 'chunks'}; split as {layout.describe()}")
        return layout, note
    counts = tuple(stage_layers)
    even_stages = _join(split_evenly(num_layers, stages))
    if len(counts) not in (stages, chunks_total):
        wanted = f"{stages}" if repeats == 1 else f"{stages} (per stage) or {chunks_total} (per chunk)"
        raise ValueError(
            f"--stage-layers {_join(counts)}: {len(counts)} entries, but --mesh stage={stages} needs {wanted}; "
            f"e.g. --stage-layers {even_stages}"
        )
    if min(counts) <= 0:
        raise ValueError(
            f"--stage-layers {_join(counts)}: every stage needs at least one layer; e.g. --stage-layers {even_stages}"
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"--stage-layers {_join(counts)} sums to {sum(counts)}, but the model has {num_layers} layers; "
            f"e.g. --stage-layers {even_stages}"
        )
    if len(counts) == chunks_total and repeats > 1:
        chunks = tuple(tuple(counts[r * stages : (r + 1) * stages]) for r in range(repeats))
    else:
        per_stage = [split_evenly(n, repeats) for n in counts]
        if any(min(split) == 0 for split in per_stage):
            raise ValueError(
                f"--stage-layers {_join(counts)}: with --pipeline-repeats {repeats} every stage needs at least "
                f"{repeats} layers (one per repeat); e.g. --stage-layers {even_stages}"
            )
        chunks = tuple(tuple(split[r] for split in per_stage) for r in range(repeats))
    return StageLayout(chunks), None


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A layout and the number of microbatches that flow through it.

    Attributes:
      layout: the `StageLayout`.
      microbatches: M, microbatches per global batch.
      skip_empty: skip empty slots and bubble steps with conditionals (the
        default). False computes every slot of every step and discards what
        is not needed: the fallback for a program in which the partitioner
        put a collective that could wait on other stages inside such a
        conditional (see `branch_collectives`).
    """

    layout: StageLayout
    microbatches: int
    skip_empty: bool = True

    @property
    def steps(self) -> int:
        """Pipeline steps per forward pass: ``R*M + S - 1``."""
        return self.layout.repeats * self.microbatches + self.layout.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """``(S-1) / (R*M + S - 1)``: the share of steps a stage idles (fill and drain)."""
        return (self.layout.stages - 1) / self.steps

    def layer_applications(self) -> tuple[int, ...]:
        """Forward layer applications per device of each stage.

        ``M * stage_layers[s]`` when empty slots are skipped; otherwise every
        slot of every step: ``steps * K``.
        """
        if not self.skip_empty:
            return (self.steps * self.layout.chunk_slots,) * self.layout.stages
        return tuple(self.microbatches * n for n in self.layout.stage_layers)


def check_microbatches(microbatches: int, stages: int, batch_size: int, data_parallel: int) -> None:
    """Pipeline microbatch checks, before any compilation.

    Args:
      microbatches: M (``--microbatches``).
      stages: S.
      batch_size: the global batch (``--batch-size``).
      data_parallel: the mesh's ``data x fsdp``; each microbatch must split over it.

    Raises:
      ValueError: M < S (the ring would wait for a microbatch that does not
        exist), naming ``--microbatches`` and a value that works.
    """
    if microbatches >= stages:
        return
    good = [m for m in range(stages, batch_size + 1)
            if batch_size % m == 0 and (batch_size // m) % data_parallel == 0]
    hint = (f"--microbatches {good[0]}" if good else
            f"--microbatches {stages} --batch-size {stages * data_parallel * max(1, batch_size // (stages * data_parallel))}")
    raise ValueError(
        f"--microbatches {microbatches}: fewer microbatches than the {stages} pipeline stages (--mesh stage={stages}); "
        f"every stage needs a microbatch in flight; use {hint}"
    )


# Rules and context -------------------------------------------------------------


def pipeline_rules(rules):
    """The rules with ``layers -> stage``, so ``[stage, slot, ...]`` arrays shard over ``stage``.

    Raises:
      ValueError: when another logical axis already maps to ``stage`` (the
        pipeline owns that axis), naming it.
    """
    for logical, mesh_axes in rules.table:
        if ax.STAGE in mesh_axes and logical != ax.LAYERS:
            raise ValueError(
                f"--rule {logical}={'+'.join(mesh_axes)}: the pipeline owns mesh axis {ax.STAGE!r}; remap "
                f"{logical!r} (e.g. --rule {logical}=none)"
            )
    if rules.mesh_axes(ax.LAYERS) == (ax.STAGE,):
        return rules
    return rules.with_overrides({ax.LAYERS: (ax.STAGE,)})


_PLAN: contextvars.ContextVar[PipelinePlan | None] = contextvars.ContextVar("meshwork_pipeline", default=None)


@contextlib.contextmanager
def use_pipeline(plan: PipelinePlan | None) -> Iterator[None]:
    """Makes models run their stacked layers through `run_pipeline` with ``plan`` (None: scan)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def current_pipeline() -> PipelinePlan | None:
    """The plan set by `use_pipeline`, or None."""
    return _PLAN.get()


# Moving stacked arrays between layouts ---------------------------------------------


def layout_rows(layout: StageLayout | None, num_layers: int) -> np.ndarray:
    """The canonical layer of each row of a stacked array, flattened (-1: empty slot)."""
    if layout is None:
        return np.arange(num_layers, dtype=np.int32)
    return layout.layer_table().reshape(-1)


def relayout(x, src: StageLayout | None, dst: StageLayout | None, num_layers: int):
    """Re-lays one stacked array between layouts (None: canonical ``[layers, ...]``).

    Args:
      x: ``[layers, ...]`` (``src`` None) or ``[stages, slots, ...]``.
      src, dst: the layouts it is in and goes to.
      num_layers: L.

    Returns:
      The array in ``dst``'s layout; empty slots are zero. Call it under
      `jax.jit` with the target shardings as ``out_shardings``.
    """
    import jax.numpy as jnp

    if src == dst:
        return x
    lead = 1 if src is None else 2
    rows = x.reshape(-1, *x.shape[lead:])
    position = np.zeros(num_layers, np.int32)
    src_rows = layout_rows(src, num_layers)
    position[src_rows[src_rows >= 0]] = np.nonzero(src_rows >= 0)[0]
    table = np.arange(num_layers, dtype=np.int32) if dst is None else dst.layer_table()
    take = np.where(table >= 0, position[np.maximum(table, 0)], 0)
    y = jnp.take(rows, jnp.asarray(take.reshape(-1)), axis=0).reshape(*table.shape, *x.shape[lead:])
    if (table < 0).any():
        mask = jnp.asarray(table >= 0).reshape(*table.shape, *([1] * (x.ndim - lead)))
        y = jnp.where(mask, y, jnp.zeros((), y.dtype))
    return y


def _transfer_tables(src: StageLayout | None, dst: StageLayout, num_layers: int, stages: int, rows: int):
    """Static tables to move rows block-sharded over ``stage`` (``rows`` per stage) into ``dst``.

    Returns:
      For each shift ``d`` (source stage ``s`` sends to ``(s + d) % S``) a pair
      ``(send, recv)`` of int32 ``[S, cap_d]`` arrays: ``send[s]`` the local
      rows stage ``s`` sends, ``recv[t]`` the slots stage ``t`` puts them in
      (``dst.slots`` for padding, dropped), or None when nothing moves by ``d``.
    """
    src_rows = layout_rows(src, num_layers)
    position = np.zeros(num_layers, np.int64)
    position[src_rows[src_rows >= 0]] = np.nonzero(src_rows >= 0)[0]
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    table = dst.layer_table()
    for t in range(stages):
        for k in range(dst.slots):
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
        recv = np.full((stages, cap), dst.slots, np.int32)
        for s in range(stages):
            for j, (local, slot) in enumerate(pairs.get((d, s), ())):
                send[s, j] = local
                recv[(s + d) % stages, j] = slot
        tables.append((send, recv))
    return tables


def relayout_on_mesh(tree, src: StageLayout | None, dst: StageLayout | None, num_layers: int, mesh):
    """`relayout` for arrays sharded as `pipeline_rules` shard them, moving rows between stages point to point.

    A plain gather lets the partitioner all-gather the whole stack onto every
    device first. Here, when an array's first dimension is split over
    ``stage`` (as restored onto this mesh), each stage sends exactly the rows
    the other stages need, one ``ppermute`` per stage distance, so no device
    holds more than its source rows, its result and one message. When it is
    not split (it does not divide), every device already has all rows and
    takes its own.

    Args:
      tree: a pytree of arrays ``[layers, ...]`` (``src`` None) or
        ``[stages', slots', ...]``, their first dimension split over ``stage``
        where the size allows, other dimensions as they are.
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
        return [_move_rows(block, shape, sharded, src, dst, num_layers, stage)
                for block, shape, sharded in zip(blocks, shapes, split)]

    specs = [P(ax.STAGE) if sharded else P() for sharded in split]
    moved = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=[P(ax.STAGE)] * len(leaves),
                          axis_names={ax.STAGE})(*leaves)
    return treedef.unflatten(moved)


def _move_rows(block, shape, sharded: bool, src, dst: StageLayout, num_layers: int, stage):
    """One array's part of `relayout_on_mesh`, on one stage: ``block`` -> ``[1, dst.slots, ...]``."""
    import jax
    import jax.numpy as jnp

    stages = dst.stages
    lead = 1 if src is None else 2
    rest = shape[lead:]
    rows = block.reshape(-1, *rest)
    if not sharded:
        y = relayout(rows.reshape(shape), src, dst, num_layers)  # [S, slots, ...]: all rows are here
        return jax.lax.dynamic_index_in_dim(_varying(y, ax.STAGE), stage, keepdims=True)
    out = _varying(jnp.zeros((dst.slots, *rest), block.dtype), ax.STAGE)
    for d, tables in enumerate(_transfer_tables(src, dst, num_layers, stages, rows.shape[0])):
        if tables is None:
            continue
        send, recv = (jnp.asarray(t)[stage] for t in tables)
        message = jnp.take(rows, send, axis=0)
        if d:
            message = jax.lax.ppermute(message, ax.STAGE, [(s, (s + d) % stages) for s in range(stages)])
        out = out.at[recv].set(message, mode="drop")
    return out[None]


# The pipeline -------------------------------------------------------------------------


def _varying(tree, axis: str):
    """Casts each leaf to device-varying over ``axis`` (inside shard_map), unless it already is."""
    import jax

    def cast(x):
        aval = jax.typeof(x)
        vma = getattr(aval, "vma", None)
        if vma is None:
            vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
        if axis in vma:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, axis, to="varying")
        return jax.lax.pvary(x, axis)  # jax < 0.7 spelling

    return jax.tree.map(cast, tree)


def to_microbatches(x, microbatches: int):
    """``[batch, ...]`` -> ``[microbatches, batch / microbatches, ...]``, row ``r`` to microbatch ``r % M``.

    Strided rows keep each device's share of every microbatch on that device
    when the batch is split over ``data``/``fsdp`` (as `train.step` does for
    gradient accumulation).
    """
    return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def from_microbatches(x):
    """Inverse of `to_microbatches`."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _index(tree, i):
    import jax

    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _write(buffer, i, value, predicate):
    """``buffer[i] = value`` where ``predicate``, else unchanged (a slice-sized select)."""
    import jax
    import jax.numpy as jnp

    old = jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(predicate, value, old), i, 0)


def _slot_params(params, r, k):
    """Slot ``k`` of chunk ``r`` from leaves ``[R, K, ...]`` (traced indices)."""
    import jax

    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(_index_leaf(w, r), k, keepdims=False), params)


def _index_leaf(w, i):
    import jax

    return jax.lax.dynamic_index_in_dim(w, i, keepdims=False)


def _add_slot(grads, r, k, update):
    """``grads[r, k] += update`` for leaves ``[R, K, ...]`` (a slot-sized update)."""
    import jax
    import jax.numpy as jnp

    def add(acc, d):
        zero = jnp.zeros((), jnp.int32)
        index = (r, k) + (zero,) * (acc.ndim - 2)
        old = jax.lax.dynamic_slice(acc, index, (1, 1, *acc.shape[2:]))
        return jax.lax.dynamic_update_slice(acc, old + d[None, None].astype(acc.dtype), index)

    return jax.tree.map(add, grads, update)


def _chunk_forward(layer_fn, params, r, h, extras, count, skip_empty: bool, save: bool):
    """Applies the first ``count`` of chunk ``r``'s ``K`` layers to ``h``; the other slots do nothing.

    Args:
      layer_fn: ``(layer_params, h, *extras) -> h``.
      params: the stage's parameters, leaves ``[R, K, ...]``.
      r: int32 scalar, the repeat (chunk) to run.
      h: ``[microbatch, ...]`` activations.
      extras: this microbatch's side inputs (positions, segment ids).
      count: int32 scalar, the stage's layer count for the chunk (0 in a bubble step).
      skip_empty: run each slot under a `jax.lax.cond` (slots past ``count``
        are not computed); False computes every slot and selects.
      save: also return each slot's input (for the backward pass).

    Returns:
      ``(h, applied, inputs)``: the activations, the layers computed (int32)
      and, when ``save``, ``[K, microbatch, ...]`` slot inputs (else None).
    """
    import jax
    import jax.numpy as jnp

    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        h, applied = carry

        def apply(h, applied):
            return layer_fn(_slot_params(params, r, k), h, *extras), applied + 1

        if skip_empty:
            out = jax.lax.cond(k < count, apply, lambda h, applied: (h, applied), h, applied)
        else:
            new, applied = apply(h, applied)
            out = (jnp.where(k < count, new, h), applied)
        return out, (h if save else None)

    applied = _varying(jnp.zeros((), jnp.int32), ax.STAGE)
    (h, applied), inputs = jax.lax.scan(body, (h, applied), jnp.arange(slots))
    return h, applied, inputs


def _chunk_backward(layer_fn, params, r, inputs, extras, count, g, grads, skip_empty: bool):
    """The backward pass of `_chunk_forward`: slots in reverse, each layer recomputed from its saved input.

    Args:
      inputs: ``[K, microbatch, ...]`` slot inputs saved by the forward pass.
      g: cotangent of the chunk's output.
      grads: accumulated parameter cotangents, leaves ``[R, K, ...]``.
      (others as `_chunk_forward`)

    Returns:
      ``(g, grads)``: the cotangent of the chunk's input, and ``grads`` with
      this chunk's slots added. Skipped slots pass ``g`` through and add nothing.
    """
    import jax
    import jax.numpy as jnp

    slots = jax.tree.leaves(params)[0].shape[1]

    def body(carry, k):
        g, grads = carry

        def back(g, grads):
            _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), _slot_params(params, r, k), inputs[k])
            dw, dh = vjp(g)
            return dh, _add_slot(grads, r, k, dw)

        if skip_empty:
            return jax.lax.cond(k < count, back, lambda g, grads: (g, grads), g, grads), None
        _, vjp = jax.vjp(lambda w, h: layer_fn(w, h, *extras), _slot_params(params, r, k), inputs[k])
        dw, dh = vjp(g)
        keep = k < count
        dw = jax.tree.map(lambda d: jnp.where(keep, d, jnp.zeros((), d.dtype)), dw)
        return (jnp.where(keep, dh, g), _add_slot(grads, r, k, dw)), None

    (g, grads), _ = jax.lax.scan(body, (g, grads), jnp.arange(slots), reverse=True)
    return g, grads


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Where stage ``stage`` is at step ``t`` (traced scalars); see the module docstring."""

    plan: PipelinePlan
    stage: Any

    @property
    def iterations(self) -> int:
        return self.plan.layout.repeats * self.plan.microbatches

    def at(self, t):
        """``(valid, r, mb)``: whether stage works at step t, its repeat and microbatch."""
        import jax.numpy as jnp

        i = t - self.stage
        m = self.plan.microbatches
        ic = jnp.clip(i, 0, self.iterations - 1)
        return (i >= 0) & (i < self.iterations), ic // m, ic % m

    def returning(self, t):
        """``(arrived, mb)``: whether what stage 0 receives at the end of step t comes back for a later repeat."""
        import jax.numpy as jnp

        layout, m = self.plan.layout, self.plan.microbatches
        j = t - (layout.stages - 1)  # the last stage's iteration at step t
        arrived = (self.stage == 0) & (j >= 0) & (j < self.iterations - m)
        return arrived, jnp.clip(j, 0, self.iterations - 1) % m


def _pipeline_forward(layer_fn, plan: PipelinePlan, params, xs, extras, save: bool):
    """All ``R*M + S - 1`` steps of one stage, forward.

    Args:
      params: the stage's parameters, leaves ``[R, K, ...]``.
      xs: ``[M, microbatch, ...]`` all microbatches (stage-varying).
      extras: ``[M, microbatch, ...]`` side inputs.
      save: return the slot inputs of every step (for `_pipeline_backward`).

    Returns:
      ``(outputs, applied, saved)``: ``[M, microbatch, ...]`` (the outputs on
      the last stage, zeros elsewhere), this device's layer applications
      (int32) and, when ``save``, ``[steps, K, microbatch, ...]`` slot inputs.
    """
    import jax
    import jax.numpy as jnp

    layout = plan.layout
    stages, repeats = layout.stages, layout.repeats
    stage = jax.lax.axis_index(ax.STAGE)
    where = _Schedule(plan, stage)
    counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]  # [R] this stage's chunk sizes
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def step(carry, t):
        state, circ, outputs, applied = carry
        valid, r, mb = where.at(t)
        first = _index_leaf(xs, mb)
        if repeats > 1:  # stage 0 takes microbatch mb back from the ring after its first repeat
            first = jnp.where(r == 0, first, _index_leaf(circ, mb))
        inputs = jnp.where(stage == 0, first, state)
        count = jnp.where(valid, counts[r], 0)
        h, done, saved = _chunk_forward(layer_fn, params, r, inputs, _index(extras, mb), count, plan.skip_empty, save)
        outputs = _write(outputs, mb, h, valid & (stage == stages - 1) & (r == repeats - 1))
        received = jax.lax.ppermute(h, ax.STAGE, ring)
        if repeats > 1:
            arrived, back = where.returning(t)
            circ = _write(circ, back, received, arrived)
        return (received, circ, outputs, applied + done), saved

    zeros = jnp.zeros_like(xs)
    init = (zeros[0], zeros if repeats > 1 else None, zeros, _varying(jnp.zeros((), jnp.int32), ax.STAGE))
    (_, _, outputs, applied), saved = jax.lax.scan(step, init, jnp.arange(plan.steps))
    return outputs, applied, saved


def _pipeline_backward(layer_fn, plan: PipelinePlan, params, extras, saved, g_outputs):
    """The backward pass of `_pipeline_forward`: steps in reverse, cotangents sent up the ring.

    Each step undoes the forward step: the cotangent of what this stage sent
    comes back from the next stage (``ppermute`` the other way round), the
    chunk's layers are recomputed from their saved inputs and differentiated
    slot by slot (empty slots skipped), and the input's cotangent goes to the
    microbatches (stage 0, first repeat), to the ring buffer (stage 0, later
    repeats) or to the previous stage (next step back).

    Returns:
      ``(grads, g_xs)``: cotangents of the stage's parameters ``[R, K, ...]``
      and of ``xs``.
    """
    import jax
    import jax.numpy as jnp

    layout = plan.layout
    stages, repeats = layout.stages, layout.repeats
    stage = jax.lax.axis_index(ax.STAGE)
    where = _Schedule(plan, stage)
    counts = jnp.asarray(np.asarray(layout.chunks, np.int32))[:, stage]
    back_ring = [((s + 1) % stages, s) for s in range(stages)]

    def step(carry, t):
        g_state, g_circ, grads, g_xs = carry  # g_state: cotangent of what this stage received at step t
        valid, r, mb = where.at(t)
        if repeats > 1:
            arrived, back = where.returning(t)
            g_received = jnp.where(stage == 0, jnp.where(arrived, _index_leaf(g_circ, back), 0), g_state)
            g_circ = _write(g_circ, back, jnp.zeros_like(g_state), arrived)
        else:
            g_received = jnp.where(stage == 0, jnp.zeros_like(g_state), g_state)
        g_out = jax.lax.ppermute(g_received, ax.STAGE, back_ring)
        wrote = valid & (stage == stages - 1) & (r == repeats - 1)
        g_out = g_out + jnp.where(wrote, _index_leaf(g_outputs, mb), 0).astype(g_out.dtype)
        count = jnp.where(valid, counts[r], 0)
        g_in, grads = _chunk_backward(layer_fn, params, r, _index_leaf(saved, t), _index(extras, mb), count, g_out,
                                      grads, plan.skip_empty)
        first = valid & (stage == 0)
        if repeats > 1:
            g_xs = _write(g_xs, mb, _index_leaf(g_xs, mb) + g_in, first & (r == 0))
            g_circ = _write(g_circ, mb, _index_leaf(g_circ, mb) + g_in, first & (r > 0))
        else:
            g_xs = _write(g_xs, mb, _index_leaf(g_xs, mb) + g_in, first)
        return (jnp.where(stage == 0, jnp.zeros_like(g_in), g_in), g_circ, grads, g_xs), None

    zeros = jnp.zeros_like(g_outputs)
    grads = jax.tree.map(jnp.zeros_like, params)
    init = (zeros[0], zeros if repeats > 1 else None, grads, zeros)
    (_, _, grads, g_xs), _ = jax.lax.scan(step, init, jnp.arange(plan.steps), reverse=True)
    return grads, g_xs


def _pipeline_program(layer_fn, plan: PipelinePlan, rules, remat_policy=None):
    """``f(params [R, K, ...], xs, extras) -> (outputs, applied)`` for one stage, with its own backward pass.

    The backward pass is written out (`_pipeline_backward`) rather than left
    to autodiff of the forward loop: the slots' conditionals would make
    autodiff save a slice of the stage's parameters per step as residuals
    (a copy of them per pipeline step), where this saves only each slot's
    input activations, as ``--remat full`` does for an unpipelined stack.
    Every layer is recomputed once in the backward pass (with
    ``remat_policy`` applied inside it) and differentiated by `jax.vjp`.

    The layers' `sharding.rules.constrain` calls see the mesh as it is inside
    shard_map (``stage`` manual), in the forward and the backward pass alike.
    """
    import jax

    from sharding.rules import use_rules

    if remat_policy is not None:
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=False)

    def in_stage(fn, *args):
        with use_rules(jax.sharding.get_abstract_mesh(), rules):
            return fn(*args)

    @jax.custom_vjp
    def program(params, xs, extras):
        outputs, applied, _ = in_stage(_pipeline_forward, layer_fn, plan, params, xs, extras, False)
        return outputs, applied

    def forward(params, xs, extras):
        outputs, applied, saved = in_stage(_pipeline_forward, layer_fn, plan, params, xs, extras, True)
        return (outputs, applied), (params, extras, saved)

    def backward(residuals, cotangents):
        params, extras, saved = residuals
        grads, g_xs = in_stage(_pipeline_backward, layer_fn, plan, params, extras, saved, cotangents[0])
        return grads, g_xs, jax.tree.map(lambda _: None, extras)

    program.defvjp(forward, backward)
    return program


def _stage_program(stacked, xs, extras, *, layer_fn, plan: PipelinePlan, rules, remat_policy=None):
    """One stage's program (inside shard_map, manual over ``stage``).

    Args:
      stacked: this stage's parameters, leaves ``[1, slots, ...]``.
      xs: ``[M, microbatch, ...]`` all microbatches (the same on every stage).
      extras: per-microbatch side inputs ``[M, microbatch, ...]`` (or None leaves).

    Returns:
      ``(ys, applied)``: ``[M, microbatch, ...]`` outputs of the last stage
      (summed over ``stage`` once, after the loop) and ``[1]`` int32 layer
      applications of this device.
    """
    import jax

    layout = plan.layout
    params = jax.tree.map(lambda w: w.reshape(layout.repeats, layout.chunk_slots, *w.shape[2:]), stacked)
    xs, extras = _varying((xs, extras), ax.STAGE)
    outputs, applied = _pipeline_program(layer_fn, plan, rules, remat_policy)(params, xs, extras)
    return jax.lax.psum(outputs, ax.STAGE), applied[None]


def run_pipeline(
    layer_fn: Callable[..., Any],
    stacked,
    x,
    extras: Sequence[Any] = (),
    plan: PipelinePlan | None = None,
    *,
    mesh=None,
    rules=None,
    remat_policy=None,
):
    """Runs a stacked layer function as a pipeline over the ``stage`` mesh axis.

    Args:
      layer_fn: ``(layer_params, h, *extras) -> h`` for one layer; ``h`` keeps
        its shape and dtype. It may call `sharding.rules.constrain`.
      stacked: pytree of the stacked layer parameters, every leaf
        ``[stages, slots, ...]`` in ``plan.layout`` (see `relayout`), sharded
        over ``stage`` on its first dimension.
      x: ``[batch, ...]`` activations entering the first layer (float).
      extras: side inputs ``[batch, ...]`` each layer also gets (positions,
        segment ids; None entries pass through as None).
      plan: the layout and microbatch count; default `current_pipeline`.
      mesh, rules: default the ones of `sharding.rules.use_rules`.
      remat_policy: a `jax.checkpoint` policy for each layer's own backward
        pass (None: none). The pipeline always saves only each layer's input
        and recomputes the layer in the backward pass (`_pipeline_program`).

    Returns:
      ``(y, applied)``: ``y`` ``[batch, ...]`` like ``x``, after all layers in
      canonical order, the same on every stage; ``applied`` ``[stages]`` int32,
      the forward layer applications each device of each stage computed
      (`PipelinePlan.layer_applications`: ``microbatches * stage_layers[s]``
      when empty slots are skipped; the backward pass skips the same slots).

    Raises:
      ValueError: no plan or mesh; a ``stage`` axis other than the layout's;
        a batch that ``plan.microbatches`` does not divide.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    from sharding.rules import current_rules

    plan = plan or current_pipeline()
    if plan is None:
        raise ValueError("run_pipeline needs a PipelinePlan (pass plan= or use use_pipeline)")
    if mesh is None or rules is None:
        context = current_rules()
        if context is None:
            raise ValueError("run_pipeline needs a mesh: call it under sharding.rules.use_rules(mesh, rules)")
        mesh, rules = mesh or context[0], rules or context[1]
    layout, m = plan.layout, plan.microbatches
    stages = dict(mesh.shape).get(ax.STAGE, 1)
    if stages != layout.stages:
        raise ValueError(f"the layout has {layout.stages} stages but the mesh's stage axis is {stages}")
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} rows is not divisible by --microbatches {m}")
    xs = to_microbatches(x, m)
    extras = jax.tree.map(lambda e: to_microbatches(e, m), tuple(extras))
    program = jax.shard_map(
        lambda w, xs, ex: _stage_program(w, xs, ex, layer_fn=layer_fn, plan=plan, rules=rules,
                                         remat_policy=remat_policy),
        mesh=mesh,
        in_specs=(P(ax.STAGE), P(), P()),
        out_specs=(P(), P(ax.STAGE)),
        axis_names={ax.STAGE},
    )
    ys, applied = program(stacked, xs, extras)
    return from_microbatches(ys), applied


# Checking the compiled program ---------------------------------------------------------

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)[\s(].*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.+?\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLEES = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BRANCH_ONLY = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class BranchCollective:
    """A collective inside a branch of a conditional (a layer slot some stages skip).

    Attributes:
      op: e.g. ``all-gather``.
      name: the HLO instruction.
      stages: the stages its device groups span at most (1: among devices of
        one stage), or None when the groups could not be read.
      safe: whether devices that skip the branch can never be waited for: a
        grouped collective whose every group lies inside one stage. A
        ``collective-permute`` is never safe: XLA's CPU runtime gathers every
        device of the program for it.
    """

    op: str
    name: str
    stages: int | None
    safe: bool


def _group_list(rest: str) -> list[list[int]] | None:
    listed = _GROUPS_LIST.search(rest)
    if listed:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    iota = _GROUPS_IOTA.search(rest)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    pairs = _PAIRS.search(rest)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    return None


def branch_collectives(hlo_text: str, mesh) -> list[BranchCollective]:
    """Collectives that run inside conditional branches of a compiled program.

    The pipeline skips empty slots with conditionals, which stages take
    differently; a collective in such a branch must only involve devices of
    one stage, or the devices that skip it leave the others waiting forever.

    Args:
      hlo_text: ``compiled.as_text()``.
      mesh: the `jax.sharding.Mesh` it was compiled for (device ids in HLO
        are positions in ``mesh.devices.flat``).

    Returns:
      One `BranchCollective` per collective instruction reachable from a
      conditional branch.
    """
    calls: dict[str, list[str]] = {}
    branch_roots: set[str] = set()
    found: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line[:1].isspace():
            current = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match or current is None:
            continue
        name, op, rest = match.groups()
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in _COLLECTIVES:
            found.setdefault(current, []).append((base, name, rest))
        calls.setdefault(current, []).extend(_CALLEES.findall(rest))
        if op == "conditional":
            branch_roots.update(_BRANCH_ONLY.findall(rest))
            for group in _BRANCHES.findall(rest):
                branch_roots.update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
    inside, todo = set(), list(branch_roots)
    while todo:
        comp = todo.pop()
        if comp not in inside:
            inside.add(comp)
            todo.extend(calls.get(comp, ()))
    stage_dim = list(mesh.axis_names).index(ax.STAGE) if ax.STAGE in mesh.axis_names else None
    stage_of = (np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)[stage_dim]
                if stage_dim is not None else np.zeros(mesh.devices.size, int))
    result = []
    for comp in sorted(inside):
        for op, name, rest in found.get(comp, ()):
            groups = _group_list(rest)
            spans = None if groups is None else max((len({int(stage_of[d]) for d in g}) for g in groups), default=1)
            safe = op != "collective-permute" and spans == 1
            result.append(BranchCollective(op, name, spans, safe))
    return result


__all__ = [
    "SCHEDULES", "StageLayout", "PipelinePlan", "plan_layout", "parse_stage_layers", "check_microbatches",
    "pipeline_rules", "use_pipeline", "current_pipeline", "relayout", "relayout_on_mesh", "layout_rows",
    "run_pipeline", "to_microbatches", "from_microbatches", "split_evenly", "BranchCollective",
    "branch_collectives",
]
