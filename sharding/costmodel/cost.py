"""The cost of one device for one step: `Cost`, and the entry points that add it up.

`device_cost` prices a device that processes a given number of rows per microbatch (the general
form: a faster kind may run more microbatches, a pipeline stage its own number of layers);
`estimate` prices the device of a uniform layout. Without stages the parts come from
`sharding.costmodel.flops`, `sharding.costmodel.memory` and `sharding.costmodel.partitioner`; with
stages from `sharding.costmodel.pipeline` (`_pipeline_cost`).

Units: FLOPs, bytes, tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from sharding import axes as ax
from sharding.costmodel.collectives import BACKENDS, Comm
from sharding.costmodel.flops import OPTIMIZER_FLOPS_PER_PARAM, Flops, _flops, _per_token_flops
from sharding.costmodel.gemm import Gemm, attention_gemms, step_gemms
from sharding.costmodel.layout import (
    _DTYPE_BYTES,
    _INT_BYTES,
    Layout,
    _model_splits,
    _place_cached,
    _Placed,
    _Shape,
    attention_of,
    describe_model,
    ring_tokens,
)
from sharding.costmodel.memory import Memory, _held_params, _memory
from sharding.costmodel.partitioner import _comms, _length_comms, _tensor_comms
from sharding.costmodel.pipeline import (
    Received,
    _gather_bytes,
    _Pipe,
    _pipeline_memory,
    _pipeline_of,
    _pipeline_outside,
)
from sharding.costmodel.pipeline_comms import (
    _pipeline_embedding_comms,
    _pipeline_head_comms,
    _pipeline_weight_comms,
    _stage_comms,
    _stored_row_comms_cached,
    stored_row_sums,
)
from sharding.costmodel.sequence import sequence_parallel_comms
from sharding.costmodel.stream import backward_split, head_backward_split
from sharding.costmodel.zero import replaced_all_reduce, with_zero, zero_on
from sharding.errors import ConfigError, Field
from sharding.modeldesc import ModelDescription
from sharding.parallel import ZIGZAG
from sharding.pipeline.layout import plan_layout
from sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted cost of one device for one step.

    Attributes:
      flops: Per-step FLOPs by part (`Flops`).
      counted_flops: FLOPs as ``compiled.cost_analysis()`` counts them: the body of each ``while``
        loop once (one microbatch through one layer), everything outside the loops once.
      memory: Bytes by part (`Memory`).
      comms: The collectives (`Comm`).
      tokens: Token positions this device computes per step (with uneven context shares, padding included).
      layers: Layers this device computes per microbatch (its stage's share).
      argument_bytes: Bytes of the compiled step's arguments on this device (state, batch, signals).
      gemms: The step's matrix products by shape (`sharding.costmodel.gemm.step_gemms`, and the reference
        attention's score and value products, `attention_gemms`), which the clock prices one by one; the
        matrix-product FLOPs they leave out (a fused attention kernel's) are priced at its own rate.
    """

    flops: Flops
    counted_flops: float
    memory: Memory
    comms: tuple[Comm, ...]
    tokens: float
    layers: int
    argument_bytes: float
    gemms: tuple[Gemm, ...] = ()

    @property
    def matmul_flops(self) -> float:
        return self.flops.matmul


def device_cost(
    model: ModelDescription | Any,
    layout: Layout,
    *,
    seq_len: int,
    rows: float,
    microbatches: int | None = None,
    layers: int | None = None,
    slots: int | None = None,
    backend: str = "gpu",
    batch_rows: float | None = None,
    ring_position: int | None = None,
) -> Cost:
    """The cost of one device that processes ``rows`` sequences per microbatch.

    The general form behind `estimate`, for devices whose work differs: a device of a faster kind
    runs more microbatches (uneven data parallelism, ``microbatches``), a pipeline stage computes its
    own number of layers (``layers``) while every device stores the same unpadded share of the stack.

    Args:
      model: The model's `ModelDescription` (or an object with ``describe()``, `describe_model`).
      layout: The layout.
      seq_len: T, tokens per sequence.
      rows: Sequences per microbatch on this device (after the ``data``/``fsdp`` split).
      microbatches: Microbatches this device runs per step; default ``layout.microbatches``.
      layers: Layers this device computes; default the model's layers over ``stage``.
      slots: Layer slots it holds (for memory) without a pipeline; default ``layers``. With one
        (``stage`` > 1) every device holds ``ceil(L / (S*G))`` unpadded rows instead (`_held_params`) and
        ``slots`` is the largest stage's (`StageLayout.slots`; the default when ``layers`` is not given),
        the size of the working copy each stage gathers per step.
      backend: ``gpu`` or ``cpu`` (how reduce-scatter is lowered; see the module docstring).
      batch_rows: The global batch in sequences, for the uneven step's batch re-layout.
      ring_position: With uneven context shares (``layout.context_shares``), the device's position along
        the length's split (ring order); None: the position with the largest share (the most attention).
        Every device runs padded blocks of the largest share: the projections, the MLP, the head, the
        saved activations and the ring's traffic are those of ``P * max(tokens)`` positions per sequence,
        the same on every device; only attention shrinks with the device's real tokens, to
        ``tokens[r] / 2 x (T + 1)`` query-key pairs a sequence (the zigzag layout's balance per device,
        `models.kernels.ring_attention.uneven_zigzag_layout`; priced as ``tokens[r] x key_fraction x T``).

    Returns:
      The `Cost`.

    Raises:
      ValueError: On an unknown backend; uneven context shares for an attention other than ring attention
        in the zigzag layout, or a ``ring_position`` off the ring.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    model = describe_model(model)
    mesh = layout.mesh
    shape = _shape_of(model, layout, seq_len, rows, microbatches, layers, slots, ring_position)
    rules = layout.rules_table()
    placed = _place_cached(model, rules, tuple(mesh.items()))
    if mesh[ax.STAGE] > 1:
        pipe = _pipeline_of(model, layout, rules, shape)
        return _pipeline_cost(model, layout, rules, placed, shape, pipe, backend, batch_rows).with_moved(pipe.moved)
    flops, counted = _flops(model, layout, rules, placed, shape, backend)
    memory = _memory(model, layout, rules, placed, shape, backend)
    comms = tuple(
        c for c in _comms(model, layout, rules, placed, shape, backend, batch_rows) if c.group > 1 and c.count > 0
    )
    (flops, counted), memory, comms = _with_zero(layout, rules, placed, shape, flops, memory, comms, backend, counted)
    arguments = memory.state + memory.batch + _INT_BYTES * 4 + _INT_BYTES  # + step, rng, count, signals
    runs = shape.layers * shape.micro
    gemms = _gemms(model, layout, rules, shape, runs, 0.0, shape.tok, shape.micro)
    return Cost(flops, counted, memory, comms, shape.tok * shape.micro, shape.layers, arguments, gemms)


def stage_cost_base(
    model: ModelDescription | Any,
    layout: Layout,
    *,
    seq_len: int,
    rows: float,
    layers: int,
    slots: int,
    backend: str = "gpu",
    batch_rows: float | None = None,
) -> StageBase:
    """A pipeline stage device's cost apart from the stored rows the whole stage split moves (`StageBase`), for
    a search that prices many splits: ``stage_cost_base(...).with_moved(moved)`` is `device_cost` of any
    split of ``layout`` in which the device computes ``layers`` layers, the largest stage holds ``slots``, and
    the storage moves ``moved`` rows per ppermute (`sharding.costmodel.pipeline.stored_rows_moved`), to the
    bit: `device_cost` adds them up the same way. ``layout.stage_layers`` is not read.

    Args:
      model, layout, seq_len, rows, layers, slots, backend, batch_rows: As `device_cost` takes them
        (``layout`` with ``stage`` > 1).

    Returns:
      The `StageBase`.

    Raises:
      ValueError: As `device_cost`; a layout without pipeline stages.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if layout.mesh[ax.STAGE] <= 1:
        raise ValueError(f"stage_cost_base prices pipeline stages; the mesh has stage={layout.mesh[ax.STAGE]}")
    model = describe_model(model)
    shape = _shape_of(model, layout, seq_len, rows, None, layers, slots, None)
    rules = layout.rules_table()
    placed = _place_cached(model, rules, tuple(layout.mesh.items()))
    pipe = _pipeline_of(model, dataclasses.replace(layout, stage_layers=None), rules, shape)
    return _pipeline_cost(model, layout, rules, placed, shape, pipe, backend, batch_rows)


def stage_floor(
    model: ModelDescription | Any, layout: Layout, *, seq_len: int, rows: float, backend: str = "gpu"
) -> tuple[Flops, tuple[Gemm, ...], tuple[Comm, ...]]:
    """The work a pipeline stage device of ``layout`` does for each layer it computes, whatever its schedule,
    weight gather and stage split: a lower bound for a search to prune layouts by (`sharding.planner.prune`).

    One layer's ``M`` forward and backward applications on one microbatch's tokens, with the remat policy's own
    recomputation (`_per_token_flops` and `_gemms` with no pipeline recomputation, no head, no embedding, no
    optimizer). A stage device computing ``n`` layers (`_pipeline_cost`) runs each layer ``applications / n
    >= M`` times (``M n`` with empty slots skipped, else every slot position of every loop trip: at least the
    ``R M`` chunk passes of ``n / R`` layers each) with at least these forward passes, and adds the head, the
    pipeline's recomputation and the optimizer: its FLOPs exceed ``n`` times these field by field, and its
    products hold these shapes at least ``n`` times as often. On ``gpu`` the same holds of the tensor- and
    sequence-parallel collectives of those applications (`_tensor_comms`, `sequence_parallel_comms`: one
    all-reduce or gather per block, layer and microbatch, more where a pass recomputes the block), which
    `_pipeline_cost` lists with the same bytes (on ``cpu`` the distributed optimizer's re-pricing may rewrite a
    step's collectives: none are given). ``layout.pipeline_schedule``,
    ``pipeline_gather``, ``stage_layers`` and ``optimizer_sharding`` are not read (the last changes only the
    optimizer's FLOPs, `sharding.costmodel.zero.with_zero`).

    Args:
      model, layout, seq_len, rows, backend: As `stage_cost_base` takes them (``layout`` with ``stage`` > 1).

    Returns:
      ``(flops, gemms, comms)``: per layer, the `Flops` (``logits`` and ``optimizer`` 0), the products (`Gemm`)
      and the collectives (`Comm`).

    Raises:
      ValueError: A layout without pipeline stages.
    """
    if layout.mesh[ax.STAGE] <= 1:
        raise ValueError(f"stage_floor prices pipeline stages; the mesh has stage={layout.mesh[ax.STAGE]}")
    model = describe_model(model)
    shape = _shape_of(model, layout, seq_len, rows, None, 1, 1, None)
    rules = layout.rules_table()
    placed = _place_cached(model, rules, tuple(layout.mesh.items()))
    unit = _per_token_flops(model, layout, rules, placed, shape, recomputes=0, backend=backend)
    tokens = shape.tok * shape.micro  # one layer's M applications (`_pipeline_cost`'s ``inside`` per layer)
    flops = Flops(
        layers=tokens * unit["layers"],
        attention=tokens * unit["attention"],
        logits=0.0,
        recompute=tokens * unit["recompute"],
        elementwise=tokens * unit["elem_layer"],
        optimizer=0.0,
    )
    comms: tuple[Comm, ...] = ()
    if backend == "gpu":
        layer = dataclasses.replace(shape, micro=1, layers=shape.micro)  # `_pipeline_cost`'s ``layer`` per layer
        tensor = _tensor_comms(model, layout, rules, layer, with_logits=False)
        parts = sequence_parallel_comms(tensor, model, layout, rules, layer, backend, with_edges=False)
        comms = tuple(c for c in parts if c.group > 1 and c.count > 0)
    return flops, _gemms(model, layout, rules, shape, shape.micro, 0.0, 0.0, 0.0), comms


#: The `Layout` fields `stage_fixed_comms`' cache leaves out of its key: the mesh (keyed as its items), the
#: optimizer state's layout (applied after the cache), the stage split (not read) and the remat policy (it only
#: sets which layers a stage recomputes, `sharding.costmodel.pipeline._Pipe.keeps`, which these collectives
#: do not read).
_FIXED_FREE = ("mesh", "remat", "stage_layers", "optimizer_sharding")
_LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))


def stage_fixed_comms(
    model: ModelDescription | Any, layout: Layout, *, seq_len: int, rows: float, backend: str = "gpu"
) -> tuple[Comm, ...]:
    """Collectives every stage device of ``layout`` lists, on the critical path, whatever its stage split, its own
    layers and the largest stage's: a lower bound for a search to prune layouts by (`sharding.planner.prune`),
    beside `stage_floor`'s per-layer work.

    They are `_pipeline_cost`'s under ``layout``'s own schedule and weight gather, as it lists them: the
    activations between stages (`sharding.costmodel.pipeline_comms._stage_comms`: read from one microbatch's rows,
    the whole batch's and the schedule's traffic, never from a stage's layers or slots or the remat policy) and
    each layer parameter's stored rows' gradient all-reduce after the loop
    (`sharding.costmodel.pipeline_comms.stored_row_sums`: ``ceil(L / (S G))`` rows, G the storage's devices),
    less those the distributed optimizer replaces (`sharding.costmodel.zero.replaced_all_reduce`). On ``cpu``,
    whose distributed optimizer may rewrite a step's gradient sums, none are given.

    Args:
      model, layout, seq_len, rows, backend: As `stage_cost_base` takes them (``layout`` with ``stage`` > 1;
        its ``stage_layers`` and ``remat`` are not read).

    Returns:
      The collectives (`Comm`), each one that the stage device's cost lists with the same kind, axes, group,
      bytes and count.

    Raises:
      ValueError: A layout without pipeline stages.
    """
    if layout.mesh[ax.STAGE] <= 1:
        raise ValueError(f"stage_fixed_comms prices pipeline stages; the mesh has stage={layout.mesh[ax.STAGE]}")
    if backend != "gpu":
        return ()
    model = describe_model(model)
    fields = tuple((f, getattr(layout, f)) for f in _LAYOUT_FIELDS if f not in _FIXED_FREE)
    sends, stored = _stage_fixed_cached(model, tuple(layout.mesh.items()), fields, seq_len, rows)
    if not zero_on(layout):
        return sends + stored
    rules = layout.rules_table()
    placed = _place_cached(model, rules, tuple(layout.mesh.items()))
    return sends + tuple(c for c in stored if not replaced_all_reduce(layout, rules, c, placed, backend))


# Keyed by a skeleton's schedule and gather: the 16,384-H100 7B plan asks for about 24,000 keys, those of the
# replicated optimizer state first (the search's order), then the split state's, which share them.
@functools.lru_cache(maxsize=65536)
def _stage_fixed_cached(
    model: ModelDescription, mesh_items: tuple, fields: tuple, seq_len: int, rows: float
) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
    """`stage_fixed_comms` before the distributed optimizer: ``(stage sends, stored rows' sums)``, as
    `_pipeline_cost` lists them (its filter of empty groups and counts applied)."""
    layout = Layout(dict(mesh_items), **dict(fields))
    shape = _shape_of(model, layout, seq_len, rows, None, 1, 1, None)
    rules = layout.rules_table()
    pipe = _pipeline_of(model, layout, rules, shape)
    _, head, _ = _pipeline_outside(shape, pipe)
    stored = [c for _, c in stored_row_sums(model, rules, mesh_items, pipe.stages, pipe.groups)]

    def kept(comms) -> tuple[Comm, ...]:
        return tuple(c for c in comms if c.group > 1 and c.count > 0 and not c.overlappable)

    return kept(_stage_comms(model, layout, shape, pipe, head)), kept(stored)


def _shape_of(
    model: ModelDescription,
    layout: Layout,
    seq_len: int,
    rows: float,
    microbatches: int | None,
    layers: int | None,
    slots: int | None,
    ring_position: int | None,
) -> _Shape:
    """`device_cost`'s step shape of one device (its arguments as it documents them)."""
    mesh = layout.mesh
    if layers is None:
        stages = plan_layout(model.num_layers, mesh[ax.STAGE], layout.pipeline_repeats, layout.stage_layers)[0]
        layers = max(stages.stage_layers)
        slots = stages.slots if slots is None else slots
    positions, keys, real = _context_share(model, layout, seq_len, ring_position)
    return _Shape(
        rows=rows,
        seq=positions,
        tok=rows * positions / layout.length_split,
        micro=layout.microbatches if microbatches is None else microbatches,
        layers=layers,
        slots=layers if slots is None else slots,
        act_bytes=_DTYPE_BYTES[layout.dtype],
        keys=keys,
        real=real,
    )


def _gemms(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    s: _Shape,
    runs: float,
    recomputes: float,
    head_tokens: float,
    head_runs: float,
) -> tuple[Gemm, ...]:
    """The step's products by shape (`step_gemms`, `attention_gemms`): ``runs`` layer executions of ``s.tok``
    tokens, each product's forward run again by the remat policy (``full``: the recomputed products; ``dots``
    the attention products only) and ``recomputes`` more times (a pipeline's backward pass); the backward
    products on a residual stream split along ``embed`` take its split (`sharding.costmodel.stream.backward_split`)."""
    mesh = layout.mesh
    splits = _model_splits(model, rules, tuple(mesh.items()))
    full = 1.0 if layout.remat == "full" else 0.0
    passes = {True: 1.0 + full + recomputes, False: 1.0}
    placed = _place_cached(model, rules, tuple(mesh.items()))
    stream, head = backward_split(layout, placed), head_backward_split(model, layout, placed)
    gemms = step_gemms(model, splits, mesh, s.tok, runs, passes, head_tokens, head_runs, stream, head)
    kernel = attention_of(model, layout)
    if kernel.materialises_scores and not kernel.under_shard_map:
        again = (1.0 if layout.remat in ("full", "dots") else 0.0) + recomputes
        gemms += attention_gemms(model, splits, mesh, s, runs, again)
    return gemms


def _context_share(
    model: ModelDescription, layout: Layout, seq_len: int, position: int | None
) -> tuple[int, int | None, float]:
    """``(positions per sequence, keys, real)`` of `_Shape` for one ring device: ``(seq_len, None, 1.0)``
    with even shards; with uneven ones the padded length ``P * max(tokens)``, the real length, and the
    device's real tokens over its block (`ring_tokens`)."""
    tokens = ring_tokens(layout, seq_len)
    if tokens is None:
        return seq_len, None, 1.0
    kernel = attention_of(model, layout)
    if not kernel.exchange.takes_shares or layout.context_layout != ZIGZAG:
        raise ValueError(
            f"context_shares need ring attention in the zigzag layout, whose kernels skip the padding (got "
            f"attention {layout.attention!r}, context_layout {layout.context_layout!r}); e.g. attention='ring', "
            f"context_layout='zigzag', or context_shares=None"
        )
    biggest = max(tokens)
    if position is None:
        position = tokens.index(biggest)
    if not 0 <= position < len(tokens):
        raise ValueError(f"ring_position {position}: the ring has {len(tokens)} devices (0 to {len(tokens) - 1})")
    return len(tokens) * biggest, seq_len, tokens[position] / biggest


def estimate(
    model: ModelDescription | Any, global_batch: int, seq_len: int, layout: Layout, *, backend: str = "gpu"
) -> Cost:
    """The cost of one device of a uniform layout (every device the same work).

    Args:
      model: The model's `ModelDescription` (or an object with ``describe()``).
      global_batch: B, sequences per step.
      seq_len: T, tokens per sequence.
      layout: The layout.
      backend: ``gpu`` or ``cpu``.

    Returns:
      The `Cost` of the device holding the largest stage (with uneven context shares, and the largest share).

    Raises:
      ValueError: When ``data x fsdp x microbatches`` does not divide ``global_batch``.
    """
    per = layout.batch_split * layout.microbatches
    if global_batch % per:
        raise ConfigError(
            Field("batch_size", global_batch),
            f" is not divisible by data x fsdp x microbatches = {per}; e.g. ",
            Field("batch_size", per * max(1, global_batch // per)),
        )
    return device_cost(model, layout, seq_len=seq_len, rows=global_batch / per, backend=backend)


def _pipeline_cost(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    pipe: _Pipe,
    backend: str,
    batch_rows: float | None,
) -> StageBase:
    """The cost of one stage device (the terms of `sharding.costmodel.pipeline`) apart from the stored rows
    ``pipe``'s split moves (`StageBase`: ``pipe.moved`` is not read)."""
    layer = dataclasses.replace(s, micro=1, layers=pipe.applications)  # one microbatch's rows per application
    embed, head, head_runs = _pipeline_outside(s, pipe)
    unit = _per_token_flops(model, layout, rules, placed, s, recomputes=pipe.recomputes, backend=backend)
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * _held_params(model, layout, rules, placed, s)
    inside = layer.tok * pipe.applications
    flops = Flops(
        layers=inside * unit["layers"],
        attention=inside * unit["attention"],
        logits=head.tok * head_runs * unit["logits"],
        recompute=inside * unit["recompute"],
        elementwise=inside * unit["elem_layer"] + head.tok * head_runs * unit["elem_loss"],
        optimizer=optimizer,
    )
    # cost_analysis: the loops' bodies once (one application forward, one backward; 1F1B: the head once; the
    # loop that recomputes a block's other slot inputs once whole, `_Pipe.counted_recomputes`).
    counted_unit = unit
    if pipe.counted_recomputes != pipe.recomputes:
        counted_unit = _per_token_flops(
            model, layout, rules, placed, s, recomputes=pipe.counted_recomputes, backend=backend
        )
    counted = s.tok * counted_unit["counted_layer"] + head.tok * (unit["logits"] + unit["elem_loss"]) + optimizer
    memory, received = _pipeline_memory(model, layout, rules, placed, s, pipe, head)
    comms = _pipeline_head_comms(model, layout, rules, head, pipe, backend, batch_rows)
    comms += _pipeline_embedding_comms(model, layout, placed, embed, pipe)
    comms += _pipeline_weight_comms(layout, rules, placed, pipe, model)
    comms += _stage_comms(model, layout, s, pipe, head)
    tensor = _tensor_comms(model, layout, rules, layer, recomputes=pipe.recomputes, with_logits=False)
    comms += sequence_parallel_comms(
        tensor, model, layout, rules, layer, backend, with_edges=False, recomputes=pipe.recomputes
    )
    comms += _length_comms(model, layout, rules, layer, backend)
    comms = tuple(c for c in comms if c.group > 1 and c.count > 0)
    (flops, counted), memory, comms = _with_zero(layout, rules, placed, s, flops, memory, comms, backend, counted)
    arguments = memory.state + memory.batch + _INT_BYTES * 4 + _INT_BYTES
    gemms = _gemms(model, layout, rules, s, pipe.applications, pipe.recomputes, head.tok, head_runs)
    rows = (model, rules, tuple(layout.mesh.items()), _gather_bytes(layout), pipe.groups)
    return StageBase(Cost(flops, counted, memory, comms, s.tok * s.micro, s.layers, arguments, gemms), rows, received)


@dataclasses.dataclass(frozen=True)
class StageBase:
    """A pipeline stage device's cost apart from what the rest of the stage split changes: the stored rows the
    storage moves to their stages (`sharding.costmodel.pipeline._Pipe.moved`), which add their ppermutes (last,
    after every other collective) and, with the per-microbatch gather, the received rows' memory
    (`sharding.costmodel.pipeline.Received`). Everything else of a stage's cost depends only on its own layers
    and the largest stage's, so a search over splits prices it once (`stage_cost_base`).

    Attributes:
      cost: The `Cost` of a split that moves no stored rows.
      rows: What the stored rows' collectives are priced from (model, rules, mesh items, bytes per gathered
        element, storage groups: `sharding.costmodel.pipeline_comms._stored_row_comms_cached`).
      received: With ``gather`` ``microbatch``, the received rows' memory (`Received`); else None.
    """

    cost: Cost
    rows: tuple
    received: Received | None

    def moved_comms(self, moved: tuple[int, ...]) -> tuple[Comm, ...]:
        """The collectives a split that moves ``moved`` rows per ppermute adds, after ``cost.comms``."""
        return tuple(c for c in _stored_row_comms_cached(*self.rows, moved) if c.group > 1 and c.count > 0)

    def with_moved(self, moved: tuple[int, ...]) -> Cost:
        """The whole `Cost` of a split that moves ``moved`` rows per ppermute (`stored_rows_moved`)."""
        comms = self.moved_comms(moved)
        memory = self.cost.memory if self.received is None else self.received.memory(self.cost.memory, moved)
        return dataclasses.replace(self.cost, comms=self.cost.comms + comms, memory=memory)


def _with_zero(layout, rules, placed, s, flops, memory, comms, backend, counted):
    """``((flops, counted), memory, comms)`` re-priced for the distributed optimizer (`sharding.costmodel.zero`):
    the counted FLOPs follow its optimizer update."""
    new, memory, comms = with_zero(layout, rules, placed, s, flops, memory, comms, backend)
    return (new, counted + new.optimizer - flops.optimizer), memory, tuple(comms)
