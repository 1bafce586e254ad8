"""The pipeline's collectives: what one stage device of `sharding.pipeline` (GPipe, circular and 1F1B) sends,
gathers and reduces per step, as the compiled program issues them.

* `_pipeline_weight_comms`: the stage's layer weights, gathered once per step into the working copy or per
  chunk pass (``--pipeline-gather microbatch``), their gradients reduced back, the stored rows moved to their
  stage (`sharding.pipeline.weights.Weights`, `sharding.pipeline.weights.Streamed`);
* `_stage_comms`: the activations and their cotangents between stages, per loop trip;
* `_pipeline_head_comms`: the head's weights (and, streamed, the entry's; `sharding.pipeline.edges`);
* `_pipeline_embedding_comms`: the embedding on the device's whole batch, where the 1F1B loop does not
  stream it.

The shapes they read (`_Pipe`: ticks, passes, ring) are `sharding.costmodel.pipeline`'s; checked against the
compiler on the ``PIPELINE_GRID`` of ``bench/costmodel_grid.py``.

Units: bytes, executions per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from sharding import axes as ax
from sharding.costmodel.collectives import Comm
from sharding.costmodel.embedding import _embedding_comms, _table_split
from sharding.costmodel.layout import (
    _INT_BYTES,
    _PARAM_BYTES,
    Layout,
    _place_cached,
    _Placed,
    _Shape,
)
from sharding.costmodel.partitioner import _comms
from sharding.costmodel.pipeline import (
    _gather_bytes,
    _head_split,
    _head_streamed,
    _Pipe,
    _stage_folded,
    _storage_axes,
)
from sharding.modeldesc import ModelDescription
from sharding.parallel import spec_axes
from sharding.pipeline.storage import spread_over_stage
from sharding.pipeline.traffic import (
    ALL_GATHER,
    ALL_REDUCE,
    BATCH,
    HEAD,
    INPUT_COTANGENTS,
    OUTPUTS,
    PERMUTE,
    REDUCE_SCATTER,
    STAGE,
    WORKING_COPY,
)
from sharding.rules import Rules, logical_to_spec


def _pipeline_embedding_comms(
    model: ModelDescription, layout: Layout, placed: dict[str, _Placed], embed: _Shape, pipe: _Pipe
) -> list[Comm]:
    """The embedding lookup on the device's whole batch (replicated over ``stage``) from a table stored
    split over ``stage`` too (`spread_over_stage`); none where stage 0 embeds each microbatch inside the 1F1B
    loop (`_head_streamed`: the table's collectives are the head's, `_pipeline_head_comms_cached`).

    A table split over ``fsdp`` only by the rules (``embed``; stored over ``fsdp`` x ``stage``), no
    ``data``, as jax 0.10 emits it (seen on ``stage=2,fsdp=4`` and ``stage=4,fsdp=2``): the lookup reads
    the table as the rules lay it out (`models.layers.Embed`: its stored shard ``[V, D/(f S)]`` gathered
    over ``stage`` to ``[V, D/f]`` once, its gradient all-reduced back over ``stage``; from the stored
    layout the partitioner would gather the whole batch's activations, an "involuntary full
    rematerialization"); the looked-up rows (float32, as many bytes as the device's ``[rows, T, D]``)
    all-gathered over two devices of ``stage``. The rows then reach the batch layout (``embed`` whole,
    the batch over ``fsdp``) whichever way moves fewer bytes, as the partitioner chooses for a gather
    whose table and indices are split over the same axis: while the device's tokens are at most the
    vocabulary (the rows ``[tokens, D/f]`` no larger than the table's ``[V, D/f]``), the rows by an
    all-to-all over ``fsdp`` and back (the tokens sent across ``stage`` first); beyond it (the 7B's
    16 x 2,048 tokens a device against 32,000 entries), the table's ``[V, D/f]`` shard by a
    collective-permute to the devices whose tokens it serves, and its gradient back the same way, with
    no all-to-all (`_lookup_moves_rows`).
    A table no ``fsdp`` splits (none on the mesh), its vocabulary split over ``tensor`` or the batch over
    ``data``: read as stored, vocabulary-parallel over ``tensor`` x ``stage`` (`_vocabulary_over_stage`).
    Other splits: priced as without stages on the mesh with ``stage`` folded into ``fsdp``
    (`_embedding_comms`), not checked against the compiler. On a mixture of experts' mesh the table's
    ``embed`` is split over ``fsdp`` and ``expert``, adjacent in the mesh: priced as one ``fsdp`` of their
    product (as `sharding.costmodel.partitioner._zero_groups` prices the weights outside the experts;
    checked on ``stage=2,expert=2,fsdp=2``).
    """
    embedding = model.with_role("embedding")
    if embedding is None or _head_streamed(pipe):
        return []
    if layout.mesh[ax.EXPERT] > 1:
        mesh = layout.mesh
        layout = dataclasses.replace(layout, mesh={**mesh, ax.FSDP: mesh[ax.FSDP] * mesh[ax.EXPERT], ax.EXPERT: 1})
        placed = _place_cached(model, layout.rules_table(), tuple(layout.mesh.items()))
    mesh = layout.mesh
    table = placed[embedding.path]
    (v, d), stages = table.param.shape, mesh[ax.STAGE]
    t, f = _table_split(table)
    if mesh[ax.FSDP] <= 1 and (t > 1 or mesh[ax.DATA] > 1):
        return _vocabulary_over_stage(model, layout, table, embed, t)
    if mesh[ax.DATA] > 1 or mesh[ax.FSDP] <= 1 or (t, f) != (1, mesh[ax.FSDP]):
        flat, flat_placed = _stage_folded(model, layout, layout.rules_table())
        return _embedding_comms(model, flat, flat_placed, embed)
    shard, tokens, rows = v * d * _PARAM_BYTES / f, embed.tok * _INT_BYTES, embed.tok * d * _PARAM_BYTES
    comms = [
        Comm("all-gather", (ax.STAGE,), stages, shard, 1, "embedding: table as the rules lay it out"),
        Comm("all-reduce", (ax.STAGE,), stages, shard, 1, f"gradient of {embedding.path} over stage"),
        Comm("all-gather", (ax.STAGE,), 2, rows, 1, "embedding: looked-up rows"),
    ]
    if not _lookup_moves_rows(embed.tok, v):
        return comms + [Comm("collective-permute", (ax.STAGE, ax.FSDP), 2, shard, 2, "embedding: table and gradient")]
    return comms + [
        Comm("all-gather", (ax.STAGE,), stages, tokens * stages, 1, "embedding: tokens"),
        Comm("collective-permute", (ax.STAGE,), 2, tokens, 1, "embedding: tokens"),
        Comm("all-to-all", (ax.FSDP,), f, rows, 2, "embedding: rows to batch layout and back"),
    ]


def _vocabulary_over_stage(
    model: ModelDescription, layout: Layout, table: _Placed, embed: _Shape, t: int
) -> list[Comm]:
    """The lookup from a table stored with its vocabulary over ``tensor`` x ``stage`` (no ``fsdp`` on the mesh)
    and read as stored (`models.layers.Embed` constrains it only where ``embed`` is split): the partitioner runs
    it vocabulary-parallel over all ``t S`` devices, each looking up the rows its ``[V/(t S), D]`` slice holds and
    all-reducing the device's whole batch's rows (``[rows, T, D]``, float32) over them once per step; the
    gradient is scattered into each device's slice and, with ``data``, that slice all-reduced over ``data``
    (the table is never gathered). Seen on ``stage=2,tensor=4`` (no ``data``: no gradient collective; folding
    ``stage`` into ``fsdp`` priced an all-to-all the step does not have), and on ``data=4,stage=2`` and
    ``data=2,tensor=2,stage=2`` (folding priced the table gathered over ``stage`` and its whole gradient
    all-reduced over ``data`` x ``stage``: ``bench/RESULTS.md``). The partitioner's choice, not the backend's.

    The slice's gradient is priced here only where the folded head's rules split the table
    (`sharding.costmodel.partitioner._gradient_reductions` then leaves it to the lookup's prices); with rules
    that split it nowhere (``dp``) the head's reductions already carry a gradient of the table.
    """
    mesh = layout.mesh
    (v, d), stages = table.param.shape, mesh[ax.STAGE]
    axes = tuple(a for a in (ax.TENSOR, ax.STAGE) if mesh[a] > 1)
    rows = embed.tok * d * _PARAM_BYTES
    comms = [Comm("all-reduce", axes, t * stages, rows, 1, "embedding: vocabulary-parallel rows", False)]
    _, flat_placed = _stage_folded(model, layout, layout.rules_table())
    if mesh[ax.DATA] > 1 and _table_split(flat_placed[table.param.path]) != (1, 1):
        shard = v / (t * stages) * d * _PARAM_BYTES
        comms.append(Comm("all-reduce", (ax.DATA,), mesh[ax.DATA], shard, 1, f"gradient of {table.param.path}"))
    return comms


def _lookup_moves_rows(tokens: float, vocab: int) -> bool:
    """Whether the partitioner moves a pipeline's looked-up rows (an all-to-all over ``fsdp``, there and back)
    rather than the table's ``[V, D/f]`` shard (a collective-permute, there and back): the rows while the
    device's ``tokens`` are at most the ``vocab`` entries (both ``[n, D/f]`` float32; at equal sizes the rows).
    Found on the ``test`` model, ``stage=4,fsdp=2``: 512 tokens a device against 512 entries move the rows,
    576 and more the table (`_pipeline_embedding_comms`)."""
    return tokens <= vocab


def _pipeline_head_comms(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    head: _Shape,
    pipe: _Pipe,
    backend: str,
    batch_rows: float | None,
) -> list[Comm]:
    """See `_pipeline_head_comms_cached` (the same for every stage device of a layout: cached)."""
    return list(
        _pipeline_head_comms_cached(
            model,
            rules,
            tuple(layout.mesh.items()),
            layout.remat,
            layout.attention,
            layout.dtype,
            layout.logits,
            head,
            pipe.one_f_one_b,
            backend,
            batch_rows,
            pipe.traffic.count(ALL_GATHER, BATCH, HEAD) if pipe.one_f_one_b else 1,
            _head_streamed(pipe),
            pipe.traffic.count(ALL_GATHER, STAGE, HEAD) if pipe.one_f_one_b else 1,
        )
    )


@functools.lru_cache(maxsize=16384)
def _pipeline_head_comms_cached(
    model: ModelDescription,
    rules: Rules,
    mesh_items: tuple,
    remat: str,
    attention: str,
    dtype: str,
    logits: str,
    head: _Shape,
    one_f_one_b: bool,
    backend: str,
    batch_rows: float | None,
    runs: int = 1,
    entry: bool = False,
    over_stage_runs: int = 1,
) -> tuple[Comm, ...]:
    """The head's weights (final norm, output projection) and collectives; with ``entry``, the embedding
    table's too, gathered and reduce-scattered alike on stage 0 (`sharding.pipeline.edges.Entry`).

    GPipe/circular: the head runs under `head_parallelism` outside the pipeline, as the step without
    stages on the mesh with ``stage`` folded into ``fsdp`` prices it (`_comms`, the head's rows); weights stored
    over ``stage`` alone gathered over it, or, for the output projection where the rules keep the batch whole
    over a batch axis, moved onto that axis and gathered there (`_head_free_axis`). 1F1B:
    its weights are gathered explicitly (`sharding.pipeline.edges.HeadWeights`), each over ``stage`` (to
    ``1/f`` of it, once per step) and over the ``f`` devices of the batch axes its rules split it over
    (``fsdp``, and ``expert`` for a mixture of experts' mesh, `_head_split`) to whole, its gradients
    reduce-scattered over those and summed over ``stage`` once after the loop; the gather over the batch
    axes and the reduce-scatter ``runs`` times: once per step, or per head step on the last stage (the M
    microbatches, `_head_streamed`). Streamed (``entry``), the weights enter the loop split over ``stage`` as
    stored and are gathered over it ``over_stage_runs`` times, at every tick, outside the head's conditional (so that
    no gathered copy stays live through the loop), their gradients all-reduced over ``stage`` after it as
    before, each stage keeping its slice (`sharding.pipeline.edges.HeadWeights.over_stage`). The counts are
    the step's traffic's (`sharding.pipeline.traffic.PipelineTraffic`: `HEAD` over ``stage`` and the batch axes).
    """
    layout = Layout(dict(mesh_items), rules, remat=remat, attention=attention, dtype=dtype, logits=logits)
    flat, flat_placed = _stage_folded(model, layout, rules)
    if not one_f_one_b:
        comms = _comms(
            model, flat, rules, flat_placed, dataclasses.replace(head, slots=0), backend, batch_rows, embedding=False
        )
        # (its layer terms count 0: no layers on that shape)
        mesh, stages = layout.mesh, layout.mesh[ax.STAGE]
        free = _head_free_axis(rules, mesh)
        for p in flat_placed.values():  # stored over ``stage`` alone (rules without fsdp): gathered over it
            if p.param.per_layer or p.param.role == "embedding" or p.factor(ax.FSDP) > 1:
                continue
            spec = spread_over_stage(logical_to_spec(p.param.axes, rules, p.param.shape, mesh)[0], p.param.shape, mesh)
            if not any(ax.STAGE in ((e,) if isinstance(e, str) else e or ()) for e in spec):
                continue
            output, whole, what = p.param.role == "output", p.local * _PARAM_BYTES, p.param.path
            if output and free:  # its stored shard moved onto ``free`` and back (`_head_free_axis`), gathered there
                comms += [
                    Comm("collective-permute", (ax.STAGE, free), 2, whole / stages, 1, f"{what}: shard onto {free}"),
                    Comm("collective-permute", (ax.STAGE, free), 2, whole / stages, 1, f"gradient of {what} back"),
                ]
            over = (free,) if output and free else (ax.STAGE,)
            comms.append(Comm("all-gather", over, stages, whole, 1 if output else 2, f"gather {what} over {over[0]}"))
        return tuple(comms)
    mesh, comms = layout.mesh, []
    stages = mesh[ax.STAGE]
    for p in _place_cached(model, rules, mesh_items).values():
        if p.param.per_layer or (p.param.role == "embedding" and not entry):
            continue
        axes, f = _head_split(p)
        whole, what = p.param.size * _PARAM_BYTES, p.param.path
        stored = spread_over_stage(logical_to_spec(p.param.axes, rules, p.param.shape, mesh)[0], p.param.shape, mesh)
        # streamed and stored over stage: gathered over it per tick
        over_stage = entry and any(ax.STAGE in spec_axes(e) for e in stored)
        comms += [
            Comm(
                "all-gather",
                (ax.STAGE,),
                stages,
                whole / f,
                over_stage_runs if over_stage else 1,
                f"gather {what} over stage",
            ),
            Comm("all-gather", axes, f, whole, runs, f"gather {what}"),
            Comm("reduce-scatter", axes, f, whole / f, runs, f"gradient of {what}"),
            Comm("all-reduce", (ax.STAGE,), stages, whole / f, 1, f"gradient of {what} over stage"),
        ]
        auto = tuple(a for a in _AUTO_AXES if p.factor(a) > 1)
        if auto:  # gathered and reduced whole over tensor, as the layers' weights (`_auto_factor`), where the
            over, t = "+".join(auto), _auto_factor(p)  # explicit gather and reduce-scatter run (seen on tensor=2)
            comms += [
                Comm("all-gather", auto, t, whole / f, runs, f"gather {what} over {over}"),
                Comm("all-gather", auto, t, whole, runs, f"gradient sums of {what} over {over}"),
            ]
    return tuple(comms)


def _head_free_axis(rules: Rules, mesh: Mapping[str, int]) -> str | None:
    """The batch axis of the mesh (``data``, ``fsdp``, ``expert``) that the rules keep the batch whole over, of
    ``stage``'s size, or None. GPipe/circular's head splits its rows over the rules' batch axes and ``stage``
    (`sharding.pipeline.layout.head_parallelism`), leaving that axis free; the output projection, stored with
    its vocabulary over ``stage`` (`spread_over_stage`), is then moved by the partitioner onto the free axis (a
    collective-permute of the ``[D, V/S]`` shard, its gradient back the same way) and gathered over it. Seen on
    ``data=2,stage=2,fsdp=2`` under ``--rules dp`` with ``--rule batch=data`` (free ``fsdp``) and
    ``--rule batch=fsdp`` (free ``data``; there the embedding table's shard moves too, not priced here)."""
    kept = rules.batch_axes(mesh)
    free = [a for a in ax.BATCH_MESH_AXES if mesh.get(a, 1) > 1 and a not in kept]
    return free[0] if len(free) == 1 and mesh[free[0]] == mesh[ax.STAGE] else None


def _feature_hops(
    p: _Placed, rules: Rules, mesh: Mapping[str, int], axes: tuple[str, ...]
) -> tuple[tuple[tuple[str, ...], int], ...]:
    """``((axes, n), ...)``: the dimensions of one layer of ``p`` (without ``layers``) the per-microbatch
    gather's storage splits over ``axes``, in dimension order, each with its mesh axes and their device count.
    `sharding.parallel.gather_shards` all-gathers them one dimension after the other (a block growing by
    ``n`` each time) and `sharding.parallel.reduce_shards` reduce-scatters the gradient in the same order (a
    whole layer shrinking by ``n`` each time): a mixture of experts' stacks, split over ``expert`` on the
    experts and ``fsdp`` on the features, take two of each, the other weights one over both axes."""
    pspec, _ = logical_to_spec(p.param.axes, rules, p.param.shape, mesh)
    hops = []
    for entry in pspec:
        names = tuple(a for a in spec_axes(entry) if a in axes and mesh[a] > 1)
        if names:
            hops.append((names, math.prod(mesh[a] for a in names)))
    return tuple(hops)


#: The mesh axes the stage program leaves to the partitioner (`sharding.pipeline.program.manual_axes` is manual
#: over ``stage`` and every axis that may split a batch, whatever the rules): a layer weight split over one of
#: them is gathered whole there.
_AUTO_AXES: tuple[str, ...] = tuple(a for a in ax.MESH_AXES if a != ax.STAGE and a not in ax.BATCH_MESH_AXES)


def _auto_factor(p: _Placed) -> int:
    """How many ways the axes the stage program leaves to the partitioner (``tensor``; `_AUTO_AXES`) split a
    layer parameter: the factor by which the partitioner's whole copy of it exceeds the device's share.

    Inside the stage program the explicit gather over the storage's group axes and the reduce-scatter of the
    gradient sums run on the parameter whole over ``tensor``: the partitioner all-gathers the device's rows over
    ``tensor`` before the gather, and the gradient sums over ``tensor`` before the reduce-scatter, then slices
    the reduced rows back to the device's ``tensor`` shard (seen in the compiled HLO of ``stage=2,fsdp=2,
    tensor=2``, jax 0.10, every schedule and both gather modes; `_pipeline_weight_comms_cached`)."""
    return p.factor(*_AUTO_AXES)


def _partitioner_gathers(
    p: _Placed, of: str, shard_bytes: float, whole: float, runs: float, sums: float, in_loop: bool, sums_in_loop: bool
) -> list[Comm]:
    """The two all-gathers over ``tensor`` the partitioner adds around a layer parameter's explicit gather and
    reduction in the stage program (`_auto_factor`; none when the parameter is not split over ``tensor``): this
    device's ``shard_bytes`` (compute dtype) before each of the ``runs`` gathers, and the ``whole`` float32
    gradient sums (elements) before each of the ``sums`` reductions; ``in_loop``/``sums_in_loop``: whether they
    run inside the layer loop (overlappable there), else before or after it."""
    t = _auto_factor(p)
    if t == 1:
        return []
    auto = tuple(a for a in _AUTO_AXES if p.factor(a) > 1)
    what, over = p.param.path, "+".join(auto)
    return [
        Comm("all-gather", auto, t, shard_bytes, runs, f"gather {what} over {over} ({of})", in_loop, in_loop),
        Comm(
            "all-gather",
            auto,
            t,
            whole * _PARAM_BYTES,
            sums,
            f"gradient sums of {what} over {over} ({of})",
            sums_in_loop,
            sums_in_loop,
        ),
    ]


def _pipeline_weight_comms(
    layout: Layout, rules: Rules, placed: dict[str, _Placed], pipe: _Pipe, model: ModelDescription
) -> list[Comm]:
    """See `_pipeline_weight_comms_cached` (the same for every device of a split: cached)."""
    return list(
        _pipeline_weight_comms_cached(
            model,
            rules,
            tuple(layout.mesh.items()),
            _gather_bytes(layout),
            pipe.stages,
            pipe.working,
            pipe.groups,
            pipe.gather,
            pipe.span,
            pipe.passes * pipe.slot_runs,
            pipe.regathers,
            pipe.traffic.count(ALL_GATHER, BATCH, WORKING_COPY),
            pipe.traffic.count(REDUCE_SCATTER, BATCH, WORKING_COPY),
            pipe.held if pipe.all_reduced else 0,
        )
    )


@functools.lru_cache(maxsize=16384)
def _pipeline_weight_comms_cached(
    model: ModelDescription,
    rules: Rules,
    mesh_items: tuple,
    gather_bytes: int,
    stages: int,
    working: int,
    groups_n: int,
    gather: str = "once",
    span: int = 1,
    slot_passes: float = 0.0,
    recomputes: float = 1.0,
    copy_gathers: int = 1,
    copy_reductions: int = 1,
    whole_sums: int = 0,
) -> tuple[Comm, ...]:
    """The stage's layer weights: the working copy assembled once per step, the gradients returned once (the
    stored rows moved to their stage once per step: `stored_row_comms`, the part that depends on the whole
    split). With ``gather`` ``microbatch`` the storage splits each row's features
    (``span`` > 1, ``groups_n`` 1): each slot's layer all-gathered over the feature axes where a pass runs
    it (``slot_passes``: slots one kind of pass runs per step), by the forward pass, each backward pass and
    the backward's recomputation of the block inputs (``recomputes``: `_Pipe.regathers`, the backward's
    gathers plus ``(B - 1)/B``), and its gradient reduce-scattered once per slot: one collective of each
    kind per dimension the storage splits (`_feature_hops`).

    Explicit collectives of the stage program (`jax.shard_map`, so both backends emit them as written;
    `sharding.pipeline.weights.Weights`), per layer parameter: this device's
    ``R*K'/G`` slots all-gathered over the storage's group axes into the ``R*K'`` slots (compute dtype)
    and their float32 gradient sums reduce-scattered back; the ``q`` stored rows' gradients all-reduced
    over the batch axes that do not store rows. A parameter split over ``tensor`` (an axis the program leaves
    to the partitioner, `_auto_factor`) is gathered and reduced whole over it, with two gathers over
    ``tensor`` the partitioner adds: the device's rows before each gather (compute dtype) and the float32
    gradient sums before each reduction. ``whole_sums``: 0, or the ``R*K`` slots that are all-reduced over
    the group axes instead, the copy (compute dtype) and its float32 sums
    (`sharding.pipeline.weights.Weights.all_reduced`: a working copy padded to at least twice its layers).
    """
    mesh = dict(mesh_items)
    placed = _place_cached(model, rules, mesh_items)
    axes = _storage_axes(model, rules, mesh)
    groups = axes if groups_n > 1 else ()
    sums = dict(stored_row_sums(model, rules, mesh_items, stages, groups_n))
    comms = []
    for p in placed.values():
        if not p.param.per_layer:
            continue
        row, what = p.local * p.factor(*groups), p.param.path  # one stored row's elements on a device
        t = _auto_factor(p)  # the gathers and reductions below run on rows whole over tensor
        if span > 1 and gather == "microbatch":
            runs = (1 + recomputes) * slot_passes
            shard = p.local * t  # this device's share of one layer, whole over tensor
            hops = _feature_hops(p, rules, mesh, axes)
            whole, grown = shard * math.prod(n for _, n in hops), 1
            for hop_axes, n in hops:  # one all-gather, then one reduce-scatter, per split dimension, in order
                grown *= n
                comms += [
                    Comm(
                        "all-gather",
                        hop_axes,
                        n,
                        shard * grown * gather_bytes,
                        runs,
                        f"gather {what} (a layer)",
                        layer_loop=True,
                    ),
                    Comm(
                        "reduce-scatter",
                        hop_axes,
                        n,
                        whole / grown * _PARAM_BYTES,
                        slot_passes,
                        f"gradient of {what} (a layer)",
                        layer_loop=True,
                    ),
                ]
            comms += _partitioner_gathers(p, "a layer", shard * gather_bytes, whole, runs, slot_passes, True, True)
        elif groups_n > 1:  # the working copy before the loop (it needs it whole: nothing to hide behind) and
            local = working // groups_n  # its gradient after it (no compute left to hide behind)
            whole = local * groups_n * row * t  # the gathered rows, whole over tensor
            comms += [
                Comm(
                    "all-reduce" if whole_sums else "all-gather",
                    groups,
                    groups_n,
                    (whole_sums * row * t if whole_sums else whole) * gather_bytes,
                    copy_gathers,
                    f"gather {what} (working copy)",
                    False,
                ),
                Comm(
                    "all-reduce" if whole_sums else "reduce-scatter",
                    groups,
                    groups_n,
                    (whole_sums or local) * row * t * _PARAM_BYTES,
                    copy_reductions,
                    f"gradient of {what}",
                    False,
                ),
            ]
            shard, summed = (
                (whole_sums or local) * row * t * gather_bytes,
                (whole_sums * row * t if whole_sums else whole),
            )
            comms += _partitioner_gathers(p, "working copy", shard, summed, copy_gathers, copy_reductions, False, False)
        if what in sums:
            comms.append(sums[what])
    return tuple(comms)


@functools.lru_cache(maxsize=16384)
def stored_row_sums(
    model: ModelDescription, rules: Rules, mesh_items: tuple, stages: int, groups_n: int
) -> tuple[tuple[str, Comm], ...]:
    """``((path, comm), ...)``: per layer parameter, in the model's order, the all-reduce of its ``q`` stored rows'
    float32 gradients over the batch axes that store no rows (`_pipeline_weight_comms_cached` lists each after
    that parameter's other collectives; the rows' gradients are reduce-scattered over the storage's axes), after
    the loop: on the critical path, whatever the schedule and split (a stage device stores ``q = ceil(L / (S
    G))`` rows, ``groups_n`` = G: 1 with the per-microbatch gather). None where every batch axis stores rows."""
    mesh = dict(mesh_items)
    # the gradients are summed over the axes the rules split the microbatches over, of those the program is
    # manual over (`sharding.pipeline.program.run_pipeline`'s ``summed``)
    summed = tuple(a for a in rules.batch_axes(mesh) if a in ax.BATCH_MESH_AXES)
    axes = _storage_axes(model, rules, mesh)
    groups = axes if groups_n > 1 else ()
    rest = tuple(a for a in summed if a not in axes)  # the rows' gradients are reduce-scattered over the others
    if not rest:
        return ()
    q = -(-model.num_layers // (stages * groups_n))
    out = []
    for p in _place_cached(model, rules, mesh_items).values():
        if not p.param.per_layer:
            continue
        row, what = p.local * p.factor(*groups), p.param.path  # one stored row's elements on a device
        comm = Comm(
            "all-reduce",
            rest,
            math.prod(mesh[a] for a in rest),
            q * row * _PARAM_BYTES,
            1,
            f"gradient of {what} (stored rows)",
            False,  # after the loop, as Megatron-LM's data-parallel all-reduce after the pipeline flush
        )
        out.append((what, comm))
    return tuple(out)


@functools.lru_cache(maxsize=16384)
def _stored_row_comms_cached(
    model: ModelDescription,
    rules: Rules,
    mesh_items: tuple,
    gather_bytes: int,
    groups_n: int,
    moved: tuple[int, ...],
) -> tuple[Comm, ...]:
    """The stored rows moved to their stage once per step, the one part of a stage device's collectives that
    depends on the whole stage split rather than its own layers and the largest stage's (`_Pipe.moved`: rows
    each device sends per ppermute, one entry per distance that moves any). Explicit collectives of the stage
    program (`sharding.pipeline.weights.Weights`), per layer parameter and distance: the rows stored for other
    devices sent by one ppermute over ``stage`` and the storage's group axes (compute dtype) and their
    gradients sent back (float32)."""
    mesh = dict(mesh_items)
    groups = _storage_axes(model, rules, mesh) if groups_n > 1 else ()
    devices = (ax.STAGE, *groups)
    comms = []
    for p in _place_cached(model, rules, mesh_items).values():
        if not p.param.per_layer:
            continue
        row, what = p.local * p.factor(*groups), p.param.path  # one stored row's elements on a device
        for rows in moved:
            comms.append(
                Comm(
                    "collective-permute",
                    devices,
                    2,
                    rows * row * gather_bytes,
                    1,
                    f"stored rows of {what} to their stage",
                )
            )
            comms.append(
                Comm(
                    "collective-permute",
                    devices,
                    2,
                    rows * row * _PARAM_BYTES,
                    1,
                    f"gradient of {what} back to its row",
                )
            )
    return tuple(comms)


def _stage_comms(model: ModelDescription, layout: Layout, s: _Shape, pipe: _Pipe, head: _Shape) -> list[Comm]:
    """Activations between stages: two ppermutes of one microbatch's rows ``[rows, T, D]`` per loop trip
    (GPipe/circular: one forward, one backward per step; 1F1B: the forward output and the input's
    cotangent per tick), bubble steps included: the transfers sit outside the conditionals; the inputs'
    cotangent ``[M, rows, T, D]`` summed over ``stage`` (the inputs were made stage-varying; none where stage 0
    embeds each microbatch, `_head_streamed`). GPipe/circular
    also: one psum over ``stage`` of all microbatches' outputs after the forward loop (the last stage's
    outputs to every stage) and its transpose, and the head's input cotangent all-gathered over ``stage``
    (`head_parallelism`). Where a stage's R head rows hold some of the microbatches but not all (1 < M/R < S:
    the rows are split over ``stage`` along both the microbatches and their rows, `to_microbatches` being
    strided), the partitioner gathers the cotangent in two steps, the first of R/M of the whole (seen on
    ``stage=4,fsdp=2`` with M/R = 2). Under sequence parallelism the ppermuted rows are split along the length
    over ``tensor`` too (seen on ``stage=2,data=2,tensor=2``, 1F1B: half the bytes)."""
    stages = layout.mesh[ax.STAGE]
    act = s.tok * model.hidden * s.act_bytes
    traffic = pipe.traffic
    sends = traffic.count(PERMUTE, STAGE)  # both ways, every loop trip
    sent = act / layout.rules_table().sequence_split(layout.mesh)  # the residual stream: 1/tensor under SP
    comms = [Comm("collective-permute", (ax.STAGE,), stages, sent, sends, "stage activations", False)]
    summed = traffic.count(ALL_REDUCE, STAGE, OUTPUTS) + traffic.count(ALL_REDUCE, STAGE, INPUT_COTANGENTS)
    if pipe.one_f_one_b:  # the inputs' cotangent, summed over stage (they were made stage-varying), if any
        if summed:
            comms.append(
                Comm("all-reduce", (ax.STAGE,), stages, act * s.micro, summed, "pipeline input cotangent", False)
            )
        return comms
    cotangent = head.tok * stages * model.hidden * s.act_bytes
    comms += [
        Comm("all-reduce", (ax.STAGE,), stages, act * s.micro, summed, "pipeline outputs to every stage", False),
        Comm("all-gather", (ax.STAGE,), stages, cotangent, 1, "head input cotangent over stage", False),
    ]
    per_rows = s.micro / head.rows  # M/R: the microbatches over a stage's head rows
    if 1 < per_rows < stages and per_rows == int(per_rows):
        comms.append(Comm("all-gather", (ax.STAGE,), 2, cotangent / per_rows, 1, "head input cotangent, first step"))
    return comms
