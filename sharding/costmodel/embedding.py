"""The token embedding lookup's collectives, as the partitioner of each jax version lowers it.

The partitioner's choices for the lookup (a gather from a table split over ``vocab`` and/or
``embed``) differ by layout and by jax version; they are modelled case by case from what jax 0.10-0.12
emit (`_embedding_comms`, `_embedding_fsdp`, `_embedding_2d`), checked against the compiler on CPU
(``tests/test_costmodel.py``).

Units: bytes, executions per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sharding import axes as ax
from sharding.costmodel.collectives import Comm, _axes, _partitioner
from sharding.costmodel.layout import _INT_BYTES, Layout, _Placed, _Shape, _split_axes
from sharding.modeldesc import ModelDescription
from sharding.vocab import lookup_gathers_table


def _table_split(p: _Placed) -> tuple[int, int]:
    return p.factor(ax.TENSOR), p.factor(ax.FSDP)


def _embedding_comms(
    model: ModelDescription, layout: Layout, placed: dict[str, _Placed], s: _Shape, unfolded: Layout | None = None
) -> list[Comm]:
    """The token embedding lookup (a gather from the [V, D] table, the ``embedding`` parameter), as the
    partitioner lowers it. ``layout`` may fold ``expert`` into ``fsdp`` (`sharding.costmodel.partitioner.
    _zero_groups`); ``unfolded`` is then the run's own layout (None: ``layout`` is), whose rules say which of
    the table's axes the batch is split over.

    By how the rules split the table (``vocab`` over ``tensor``: t, ``embed`` over ``fsdp``: f):

    * not split: a local lookup; the gradient is all-reduced with the others (`_gradient_reductions`).
    * f only: whichever moves fewer bytes of (a) the rows: tokens gathered over ``fsdp``, rows
      gathered over ``data``, looked up locally and sent to the batch layout by an all-to-all (back
      again in the backward pass when ``data`` = 1, where the gradient lands in the local shard;
      with ``data`` > 1 the whole table's gradient is all-reduced), or (b) the table: gathered over
      ``fsdp``, its whole gradient all-reduced over ``data`` x ``fsdp``.
    * t only: vocabulary-parallel rows all-reduced over ``tensor``; the [V/t, D] gradient reduced
      over the batch axes.
    * t and f: without ``data``, the collectives below are those jax 0.10-0.12 emit, with and without
      microbatches.
    * f, with the batch split over ``data`` too (`sharding.vocab.lookup_gathers_table`): the lookup reads the
      table with ``embed`` gathered over ``fsdp`` (`models.layers.Embed`; left to itself the partitioner
      gathers the whole batch's activations, an "involuntary full rematerialization"): the table (or its
      ``[V/t, D]`` vocabulary shard) gathered once per step, the looked-up rows all-reduced over
      ``tensor`` when the vocabulary is split, and the table's gradient all-reduced over the batch axes per
      microbatch (`_embedding_gathered`).

    * f only, with the batch split over some of the axes that split ``embed`` and kept whole over the others
      (``--rule batch=data+fsdp`` or ``batch=data+expert`` on an ``expert`` mesh): `_embedding_kept_batch`.
    * f only, with the batch split over ``fsdp`` and kept whole over ``data`` (``--rule batch=fsdp``):
      `_embedding_whole_over_data`.

    jax 0.12's partitioner (`_partitioner`) always takes (a) for f only, reducing the [V, D/f]
    gradient shard over ``data``, and in the t-and-f cases without ``data`` sends row gradients
    back with a collective-permute instead of a second all-to-all.
    """
    mesh = layout.mesh
    embedding = model.with_role("embedding")
    if embedding is None:
        return []
    table = placed[embedding.path]
    t, f = _table_split(table)
    if f <= 1 and t <= 1:
        return []
    v, d = table.param.shape
    run = unfolded or layout
    rules = run.rules_table()
    batch = rules.batch_axes(run.mesh)
    if lookup_gathers_table(rules, run.mesh, v, d, round(s.rows * run.batch_split)):
        return _embedding_gathered(table, mesh, s, t, f)
    split = tuple(a for a in _split_axes(ax.EMBED, d, rules, tuple(run.mesh.items())) if run.mesh[a] > 1)
    shared, kept = tuple(a for a in split if a in batch), tuple(a for a in split if a not in batch)
    if t <= 1 and kept and shared and set(shared) == set(batch) and split in ((*shared, *kept), (*kept, *shared)):
        return _embedding_kept_batch(table, run.mesh, s, split, kept)
    if t <= 1 and split == (ax.FSDP,) and batch == (ax.FSDP,) and mesh[ax.DATA] > 1:
        return _embedding_whole_over_data(table, mesh, s, f)
    if t <= 1:
        return _embedding_fsdp(table, mesh, s, f)
    if f <= 1:
        batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
        v, d = table.param.shape
        rows = s.tok * d * 4
        return [
            Comm("all-reduce", (ax.TENSOR,), t, rows, s.micro, "embedding: vocabulary-parallel rows", False),
            Comm("all-reduce", batch_axes, batch_n, v / t * d * 4, s.micro, f"gradient of {embedding.path}"),
        ]
    return _embedding_2d(table, mesh, s, t, f)


def _embedding_gathered(table: _Placed, mesh: Mapping[str, int], s: _Shape, t: int, f: int) -> list[Comm]:
    """The lookup from a table gathered over ``fsdp`` first (the batch split over ``data`` too; see
    `_embedding_comms`), as jax 0.10 emits it: the gather hoisted out of the microbatch loop; with the
    vocabulary split over ``tensor`` the rows all-reduced over it, and (one microbatch) the target logits too."""
    (v, d), m = table.param.shape, s.micro
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    shard, grad = v / t * d * 4, f"gradient of {table.param.path}"
    comms = [Comm("all-gather", (ax.FSDP,), f, shard, 1, "embedding: table (embed gathered)")]
    if t > 1:
        comms.append(
            Comm("all-reduce", (ax.TENSOR,), t, s.tok * d * 4, m, "embedding: vocabulary-parallel rows", False)
        )
        if m == 1:
            comms.append(
                Comm("all-reduce", (ax.TENSOR,), t, s.tok * _INT_BYTES, 1, "cross-entropy: target logits", False)
            )
    return comms + [Comm("all-reduce", batch_axes, batch_n, shard, m, grad)]


def _kept_batch_moves_rows(tokens: float, vocab: int) -> bool:
    """Whether the lookup of `_embedding_kept_batch` moves the rows of the batch group's ``tokens`` rather than
    the table: seen on ``moe-test`` (512 entries) with the rows from 64 to 768 tokens over ``fsdp=2`` (8
    samples) and the table from 960 to 4,096 over ``fsdp=2`` and at 1,024 and 2,048 over ``fsdp=4``. The partitioner's
    rule is not known; the boundary priced, 1.5 ``vocab``, is the one between those samples (an assumption
    for other vocabularies)."""
    return 2 * tokens <= 3 * vocab


def _embedding_kept_batch(
    table: _Placed, mesh: Mapping[str, int], s: _Shape, split: tuple[str, ...], kept: tuple[str, ...]
) -> list[Comm]:
    """The lookup from a table whose ``embed`` is split over the ``split`` axes (f devices) while the rules split
    the batch over some of them (b devices, ``batch``) and keep it whole over the others (``kept``, k = f / b),
    as jax 0.10 emits it; ``batch`` either the leading or the trailing axes of ``split``. Priced on the run's
    mesh: folding ``expert`` into ``fsdp`` (the weights' ZeRO-3 pricing) would split the batch over both, an
    all-to-all of the device's whole rows over f devices there and back (2x to 16x the compiled bytes).

    Either way the b devices' tokens (``tok b``) are all-gathered over ``batch`` and the rows' gradient goes
    back to the table's layout as ``[tok b, D/f]`` (float32), scattered into the shard with no reduction.

    * The batch over the leading axes (``--rule batch=data+fsdp`` on ``expert=4,fsdp=2``: ``embed`` over
      ``fsdp`` x ``expert``): the rows come one of two ways, as the partitioner chooses
      (`_kept_batch_moves_rows`): the rows, looked up from the local ``[V, D/f]`` shard as ``[tok b, D/f]`` and
      all-gathered over all f devices (the partitioner's "involuntary full rematerialization": each keeps its
      batch's part); or the table, its shard permuted into the batch axes' order and gathered over them once
      per step, ``[V, D b/f]``, the ``[tok, D b/f]`` rows looked up and all-gathered over ``kept``. The
      gradient goes back by an all-to-all over ``batch`` and a collective-permute. Seen on ``moe-test`` from
      2 x 32 to 2 x 384 (the rows) and from 2 x 480 to 16 x 256 and 16 x 256 in 2 microbatches (the table: its
      gather hoisted out of the microbatch loop).
    * The batch over the trailing axes (``--rule batch=data+expert``): the ``[tok b, D/f]`` rows looked up
      locally go to ``[tok, D/k]`` by an all-to-all over ``kept`` and are all-gathered over it to ``[tok, D]``;
      the gradient goes back by an all-to-all over ``kept``. Seen on ``moe-test`` at 4 x 32, 8 x 256 and
      16 x 256 in 2 microbatches.
    """
    (v, d), m, path = table.param.shape, s.micro, table.param.path
    batch = tuple(a for a in split if a not in kept)
    f, b, k = (math.prod(mesh[a] for a in axes) for axes in (split, batch, kept))
    tokens = s.tok * b
    back = tokens * d / f * 4  # float32: the lookup reads the float32 table
    grad = f"gradient of {path}: rows to the table layout"
    comms = [Comm("all-gather", batch, b, tokens * _INT_BYTES, m, "embedding: tokens")]
    if split[: len(batch)] != batch:
        return comms + [
            Comm("all-to-all", kept, k, back, m, "embedding: rows to batch layout"),
            Comm("all-gather", kept, k, s.tok * d * 4, m, "embedding: rows"),
            Comm("all-to-all", kept, k, back, m, grad),
        ]
    comms += [Comm("all-to-all", batch, b, back, m, grad), Comm("collective-permute", split, 2, back, m, grad)]
    if _kept_batch_moves_rows(tokens, v):
        return comms + [Comm("all-gather", split, f, tokens * d * 4, m, "embedding: rows (the batch group's)")]
    shard = v * d / f * 4
    return comms + [
        Comm("collective-permute", split, 2, shard, 1, "embedding: table shard into the batch axes' order"),
        Comm("all-gather", batch, b, shard * b, 1, "embedding: table over the batch axes"),
        Comm("all-gather", kept, k, s.tok * d * 4, m, "embedding: rows to batch layout"),
    ]


def _whole_over_data_moves_rows(tokens: float, vocab: int) -> bool:
    """Whether the lookup of `_embedding_whole_over_data` moves the rows of the ``fsdp`` group's ``tokens``
    rather than the table: seen on ``test`` at 2 and 4 times the vocabulary's entries (512 and 4,096) in
    tokens (the rows), at 6 and 8 times (the table). The partitioner's rule is not known; the boundary priced,
    5 ``vocab``, is the one between those samples (an assumption for other shapes)."""
    return tokens <= 5 * vocab


def _embedding_whole_over_data(table: _Placed, mesh: Mapping[str, int], s: _Shape, f: int) -> list[Comm]:
    """The lookup from a table ``[V, D]`` whose ``embed`` is split over ``fsdp`` (f devices) while the rules
    split the batch over ``fsdp`` and keep it whole over ``data`` (``--rule batch=fsdp``), as jax 0.10 emits it.
    The ``data`` devices hold the same rows and the same table shard, so the partitioner shares the lookup
    among g = gcd(``data``, f) of them (g = 2 at ``data=2,fsdp=4`` and ``data=4,fsdp=2``, over ``data``'s
    outermost factor) one of two ways (`_whole_over_data_moves_rows`):

    * the rows: each device takes 1/g of the f devices' ``tok f`` tokens (a collective-permute of its own
      ``tok``, then an all-gather over f/g of the ``fsdp`` devices), looks them up in its ``[V, D/f]`` shard and
      all-gathers the result over the g devices, ``[tok f, D/f]``; an all-to-all over ``fsdp`` sends the rows to
      the batch layout ``[tok, D]`` and their gradient back; the shard's gradient, each device's share of the
      rows scattered into it, is all-reduced over the g devices;
    * the table: its shard permuted and all-gathered over f/g of the ``fsdp`` devices, ``[V, D/g]`` (once per
      step), the device's own ``[tok, D/g]`` rows looked up and all-gathered over the g devices; the ``[V, D/g]``
      gradient all-reduced over ``fsdp`` and its ``[V, D/f]`` part permuted back to its owner.

    Seen on ``test`` on ``data=2,fsdp=4`` from 16 x 64 to 64 x 64 (V 512 and 4,096, and in 2 microbatches) and on
    ``data=4,fsdp=2`` at 16 x 64. Priced as the lookup under a batch split over ``data`` too (`_embedding_fsdp`),
    the table gathered and its whole gradient all-reduced, or the rows gathered over all of ``data``, with no
    all-to-all back (0 against 0.25 MiB of all-to-all at 16 x 64, V = 512; the gradient 2 MiB against 0.5
    at V = 4,096)."""
    (v, d), m = table.param.shape, s.micro
    g = math.gcd(mesh[ax.DATA], f)
    grad, rows = f"gradient of {table.param.path}", s.tok * d * 4  # float32: the lookup reads the float32 table
    if _whole_over_data_moves_rows(s.tok * f, v):
        comms = [Comm("collective-permute", (ax.DATA, ax.FSDP), 2, s.tok * _INT_BYTES, m, "embedding: tokens")]
        if f > g:
            comms.append(Comm("all-gather", (ax.FSDP,), f // g, s.tok * f / g * _INT_BYTES, m, "embedding: tokens"))
        return comms + [
            Comm("all-gather", (ax.DATA,), g, rows, m, "embedding: rows (the fsdp group's, in g shares)"),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout and back"),
            Comm("all-reduce", (ax.DATA,), g, v * d / f * 4, m, grad),
        ]
    shard = v * d / f * 4
    comms = [Comm("collective-permute", (ax.DATA, ax.FSDP), 2, shard, 1, "embedding: table shard")]
    if f > g:
        comms.append(Comm("all-gather", (ax.FSDP,), f // g, shard * f / g, 1, "embedding: table over fsdp"))
    return comms + [
        Comm("all-gather", (ax.DATA,), g, rows, m, "embedding: rows"),
        Comm("all-reduce", (ax.FSDP,), f, shard * f / g, m, grad),
        Comm("collective-permute", (ax.DATA, ax.FSDP), 2, shard, m, grad + " to its owner"),
    ]


def _embedding_fsdp(table: _Placed, mesh: Mapping[str, int], s: _Shape, f: int) -> list[Comm]:
    """Embedding table split over ``fsdp`` only (see `_embedding_comms`)."""
    (v, d), m, n_d = table.param.shape, s.micro, mesh[ax.DATA]
    grad = f"gradient of {table.param.path}"
    rows = s.tok * d * 4  # float32: the lookup reads the float32 table
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    whole = v * d * 4
    if _partitioner() == "0.12":
        comms = [
            Comm("all-gather", (ax.FSDP,), f, s.tok * f * _INT_BYTES, m, "embedding: tokens"),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout and back"),
        ]
        if n_d > 1:
            comms.append(Comm("all-reduce", (ax.DATA,), n_d, whole / f, m, grad))
        return comms
    if rows * (n_d + 1) >= whole and n_d > 1:
        return [
            Comm("all-gather", (ax.FSDP,), f, whole, 1, "embedding: table"),
            Comm("all-reduce", batch_axes, batch_n, whole, m, grad),
        ]
    comms = [
        Comm("all-gather", (ax.FSDP,), f, s.tok * f * _INT_BYTES, m, "embedding: tokens"),
        Comm("all-to-all", (ax.FSDP,), f, rows, m if n_d > 1 else 2 * m, "embedding: rows to batch layout"),
    ]
    if n_d > 1:
        comms.append(Comm("all-gather", (ax.DATA,), n_d, rows * n_d, m, "embedding: rows"))
        comms.append(Comm("all-reduce", batch_axes, batch_n, whole, m, grad))
    return comms


def _embedding_2d(table: _Placed, mesh: Mapping[str, int], s: _Shape, t: int, f: int) -> list[Comm]:
    """Embedding table split over ``tensor`` (vocab) and ``fsdp`` (embed); see `_embedding_comms`."""
    (v, d), m = table.param.shape, s.micro
    rows, tokens, shard = s.tok * d * 4, s.tok * _INT_BYTES, v * d / f * 4
    batch_axes, batch_n = _axes(mesh, ax.DATA, ax.FSDP)
    grad = f"gradient of {table.param.path}"
    if mesh[ax.DATA] <= 1 and _partitioner() == "0.12":
        comms = [
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, m, "embedding: rows to batch layout"),
        ]
        if m == 1:
            return comms + [
                Comm("all-gather", (ax.FSDP,), f, tokens * f, m, "embedding: tokens"),
                Comm("collective-permute", (ax.FSDP,), 2, rows / f, m, "embedding: row gradients"),
                Comm("all-reduce", (ax.TENSOR,), t, rows, m, grad),
            ]
        return comms + [
            Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
            Comm("all-gather", (ax.TENSOR,), t, rows, m, "embedding: rows"),
            Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
        ]
    if mesh[ax.DATA] <= 1 and m == 1:
        comms = [
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("all-gather", (ax.FSDP,), f, tokens * f, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout"),
            Comm("all-reduce", (ax.TENSOR,), t, shard, m, grad),
        ]
        if t > f:  # the [V/t, D/f] gradient permuted to its owner (seen on fsdp=2,tensor=4; not fsdp=4,tensor=2)
            comms.append(Comm("collective-permute", (ax.FSDP, ax.TENSOR), 2, shard / t, m, grad + " to its owner"))
        return comms
    if mesh[ax.DATA] <= 1:
        return [
            Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
            Comm("all-gather", (ax.TENSOR,), t, rows, m, "embedding: rows"),
            Comm("all-gather", (ax.TENSOR,), t, tokens * t, m, "embedding: tokens"),
            Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
            Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
            Comm("all-reduce", (ax.TENSOR,), t, rows, m, "embedding: vocabulary-parallel rows", False),
            Comm("all-to-all", (ax.FSDP,), f, rows, 2 * m, "embedding: rows to batch layout"),
        ]
    if m == 1:
        return [
            Comm("all-gather", batch_axes, batch_n, rows, 2, "embedding: rows"),
            Comm("collective-permute", (ax.FSDP,), 2, rows / f, 2, "embedding: rows"),
            Comm("all-reduce", (ax.TENSOR,), t, tokens, 1, "cross-entropy: target logits", False),
            Comm("all-reduce", batch_axes, batch_n, shard, 1, grad),
        ]
    return [
        Comm("all-gather", (ax.TENSOR,), t, shard, 1, "embedding: table shard"),
        Comm("all-gather", batch_axes, batch_n, s.tok * batch_n * d / f * 4, m, "embedding: rows"),
        Comm("all-gather", batch_axes, batch_n, rows * batch_n, 2 * m, "embedding: rows"),
        Comm("collective-permute", (ax.TENSOR,), 2, tokens, m, "embedding: tokens"),
        Comm("all-reduce", (ax.TENSOR,), t, 2 * tokens, m, "embedding: token masks", False),
        Comm("all-reduce", batch_axes, batch_n, shard, m, grad),
    ]
