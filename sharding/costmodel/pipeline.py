"""The pipeline's terms: the compiled pipeline of `sharding.pipeline` (GPipe, circular and 1F1B) as
main builds it.

* the layer stack stored unpadded (`sharding.pipeline.storage`): every device holds ``q`` whole-layer
  rows (`sharding.costmodel.memory._held_params`); per step each stage's working copy of ``R*K'`` slots
  is assembled in the compute dtype (`_gather_bytes`) from the rows other devices store for it (one
  ppermute per distance that moves any), a pick of this device's ``R*K'/G`` slots and one all-gather
  over the storage's group axes, of which the ``R*K`` slots holding layers are kept (or, padded to at least
  twice those, only they are all-reduced: `_Pipe.all_reduced`); the gradients go back the same way
  (`sharding.costmodel.pipeline_comms._pipeline_weight_comms`);
* the layers applied `_Pipe.applications` times per step to one microbatch's rows; activations moved by
  two ppermutes per pipeline step (GPipe/circular: ``R*M + S - 1`` steps, one each way; 1F1B:
  `_Pipe.steps` ticks, two per tick) and, for GPipe/circular, one psum over ``stage`` of the outputs
  (`sharding.costmodel.pipeline_comms._stage_comms`);
* the embedding on the device's whole batch, replicated over ``stage`` (where the 1F1B family streams its
  edges, `_head_streamed`: on stage 0 per microbatch, its table gathered there M times, `Entry`); the final
  norm, output
  projection and loss (the head) on 1/S of those rows per stage (`sharding.pipeline.head_parallelism`)
  after GPipe/circular, on one microbatch per tick inside the loop for 1F1B (`_pipeline_outside`); the
  non-layer parameters stored split over ``stage`` too (`spread_over_stage`).

Where a schedule keeps its saved inputs: `_Pipe.saved_inputs` (GPipe: every slot of every step; 1F1B:
the ring of its tick table's ``slots`` entries, `tick_table`). `sharding.costmodel.cost._pipeline_cost`
adds these terms up into one stage device's `Cost`; checked against the compiler on the
``PIPELINE_GRID`` of ``bench/costmodel_grid.py``.

Units: bytes, executions per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from sharding import axes as ax
from sharding.costmodel.layout import (
    _DTYPE_BYTES,
    _PARAM_BYTES,
    Layout,
    _model_splits,
    _per_token,
    _place_cached,
    _Placed,
    _Shape,
    attention_of,
)
from sharding.costmodel.memory import Memory, _attention_scores, _memory
from sharding.modeldesc import ModelDescription
from sharding.pipeline.layout import Schedule, keeps, parse_schedule, plan_layout
from sharding.pipeline.storage import StageStorage, storage_axes
from sharding.pipeline.traffic import ALL_GATHER, BATCH, LAYERS, PipelineTraffic
from sharding.rules import Rules


def _gather_bytes(layout: Layout) -> int:
    """Bytes per element of the pipeline's gathered working copy of the stage's layers: the compute dtype
    (`sharding.pipeline.weights.Weights.dtype`, the activations' dtype). The one place to change when
    the gather's dtype changes."""
    return _DTYPE_BYTES[layout.dtype]


@dataclasses.dataclass(frozen=True)
class _Pipe:
    """One stage device's pipeline (`sharding.pipeline.PipelinePlan` with its `StageStorage`).

    Attributes:
      stages: S.
      repeats: R (1: GPipe or 1F1B; more: circular or interleaved 1F1B).
      micro: M, microbatches per step.
      layers: Layers this stage runs per microbatch (over its repeats).
      working: Slots of the stage's gathered working copy, ``R * K'`` (`Placement.chunk_slots`: the
        layout's K rounded up so that the storage's G devices divide ``R * K'``).
      groups: G, the devices of a stage the stored rows are spread over (`storage_axes`; 1 with ``gather``
        ``microbatch``, whose storage splits each row's features instead).
      moved: Rows each device sends per ppermute of the storage, one entry per distance that moves any.
      skip_empty: Empty slots and bubble steps are skipped (`PipelinePlan.skip_empty`).
      ticks: 1F1B: the loop's ticks (its tick table's: `one_f_one_b_ticks`, `fused_ticks` or
        `zero_bubble_ticks`); 0 for GPipe/circular.
      ring: 1F1B: the ring entries of ``K'`` slot activations a stage keeps (`Ticks.slots`: chunk inputs, and
        with zero bubble the output cotangents its input gradients leave for the weight gradients); 0 for
        GPipe/circular.
      gather: ``once`` or ``microbatch`` (`Layout.pipeline_gather`, `sharding.pipeline.weights.Streamed`).
      split: zero bubble: the backward runs as two passes, the input gradient (B: the layer recomputed from its
        saved input, its input-gradient products) and the weight gradient (W: the weight-gradient products
        alone, from each product's input and output cotangent that B kept, `sharding.pipeline.split`), so
        the FLOPs, the recomputation and the gathers are fused 1F1B's.
      kept: zero bubble: the entries of its second ring, each one chunk pass's cut (what B keeps for W) for
        each of the pass's `positions` (`ZeroBubbleTicks.saved_slots`); 0 otherwise.
      span: the devices of a stage each stored row's features are split over (``gather`` ``microbatch``:
        `sharding.pipeline.storage.feature_devices`; each slot's layer gathered on its own,
        `sharding.pipeline.weights.Streamed.per_slot`); 1 otherwise.
      real: ``R * K``, the working copy's slots that hold layers (the layout's ``K`` per chunk, before the
        rounding to ``K'``); ``gather`` ``once`` keeps only these after the gather, runs and saves inputs for
        them (`sharding.pipeline.weights.Weights.gather`); 0: ``working``.
      all_reduced: the copy is assembled and its float32 gradient sums reduced by all-reduces of the ``real``
        slots over the storage's group axes, not an all-gather and a reduce-scatter of the ``working`` slots
        (`sharding.pipeline.weights.Weights.all_reduced`: where ``2K <= K'``).
      keeps: the stage keeps each layer's residuals from its forward tick (`sharding.pipeline.layout.keeps`:
        ``--remat none`` or ``dots``), so its backward recomputes no layer; else it keeps each slot's input and
        recomputes the layer there.
      full: ``--remat full``: the layer recomputed in the backward is the full policy's one recomputation
        (the backward's `jax.vjp` of the checkpointed layer drops its unused forward as dead code), which
        `sharding.costmodel.flops` already counts.
    """

    stages: int
    repeats: int
    micro: int
    layers: int
    working: int
    groups: int
    moved: tuple[int, ...]
    skip_empty: bool
    ticks: int = 0
    ring: int = 0
    gather: str = "once"
    split: bool = False
    kept: int = 0
    span: int = 1
    streams: bool = False
    traffic: PipelineTraffic | None = None
    real: int = 0
    all_reduced: bool = False
    keeps: bool = False
    full: bool = False

    @property
    def held(self) -> int:
        """Slots of the working copy the step holds and runs (``gather`` ``once``): ``R * K`` (`real`)."""
        return self.real or self.working

    @property
    def sums(self) -> int:
        """Slots of the float32 gradient sums (``gather`` ``once``): ``R * K`` where they are all-reduced
        (`all_reduced`), else the padded ``R * K'``."""
        return self.held if self.all_reduced else self.working

    @property
    def segment(self) -> int:
        """Slots per saved activation with ``gather`` ``microbatch`` (`sharding.pipeline.weights.Streamed.block`):
        the G devices' rows gathered together, or with the feature-split storage the ``span`` slots whose
        first input the forward saves; 1 otherwise."""
        if self.gather != "microbatch":
            return 1
        return self.groups if self.groups > 1 else self.span

    @property
    def slot_runs(self) -> float:
        """Slots one chunk pass gathers one at a time (the feature-split storage): the chunk's layers when empty
        slots are skipped (each slot's gather sits in its conditional), else every position."""
        return self.layers / self.repeats if self.skip_empty else self.positions

    @property
    def backward_gathers(self) -> int:
        """Backward passes of a chunk that gather its blocks (``gather`` ``microbatch``): one (zero bubble's
        weight-gradient pass reads no weight: `LayerSplit.needs_params` is False for the dense layer)."""
        return 1

    @property
    def block_inputs(self) -> bool:
        """A chunk's forward saves each gathered block's input only (``gather`` ``microbatch`` over ``G > 1``
        devices: `sharding.pipeline.weights.Streamed.block_inputs`)."""
        return self.segment > 1

    @property
    def recomputes(self) -> float:
        """Forward passes of each layer the backward pass adds (`sharding.pipeline.program.chunk_backward`
        recomputes it once; zero bubble's `chunk_backward_input` once, its weight-gradient pass none), plus
        ``(G - 1) / G`` where the ring keeps block inputs only (`block_inputs`: the backward recomputes a
        block's other slot inputs); none where the stage `keeps` its layers' residuals (what the remat policy
        recomputes inside a layer is the policy's, `sharding.costmodel.flops`)."""
        if self.keeps:
            return 0.0
        again = 0 if self.full else self.backward_gathers
        return again + ((self.segment - 1) / self.segment if self.block_inputs else 0.0)

    @property
    def regathers(self) -> float:
        """Passes of the backward that gather each slot's layer again (``gather`` ``microbatch``): its own
        gathers and the block inputs' recomputation, whatever the remat policy (`recomputes` leaves the full
        policy's recomputation to `sharding.costmodel.flops`, but its backward still reads the layer's
        weights); none where the stage `keeps` its layers' residuals."""
        if self.keeps:
            return 0.0
        return self.backward_gathers + ((self.segment - 1) / self.segment if self.block_inputs else 0.0)

    @property
    def counted_recomputes(self) -> float:
        """`recomputes` as ``cost_analysis`` counts them (each loop body once): the loop that recomputes a block's
        other slot inputs (`block_inputs`) has one layer's forward in its body, counted once whole."""
        if self.keeps:
            return 0.0
        return (0 if self.full else self.backward_gathers) + (1.0 if self.block_inputs else 0.0)

    @property
    def one_f_one_b(self) -> bool:
        return self.ticks > 0

    @property
    def blocks(self) -> int:
        """n, blocks of ``G`` slots one chunk pass gathers with ``gather`` ``microbatch``
        (`sharding.pipeline.weights.Streamed.blocks`)."""
        k, g = self.chunk_slots, self.segment
        if self.gather != "microbatch":  # the working copy's padded slots are dropped after the gather
            k = self.held // self.repeats
        return max(-(-(r + 1) * k // g) - (r * k) // g for r in range(self.repeats))

    @property
    def positions(self) -> int:
        """P = ``n * B``, slot positions one chunk pass runs (`sharding.pipeline.weights.Streamed.positions`):
        ``K'`` but with ``gather`` ``microbatch``, whose blocks of ``B`` slots cover the chunk and the positions
        past it (e.g. ``K' = 2`` layers over ``B = 4`` devices: one block of 4 positions, 2 of them empty,
        each computed when empty slots are not skipped)."""
        return self.blocks * self.segment

    @property
    def passes(self) -> int:
        """Chunk passes per step that gather their blocks (``gather`` ``microbatch``), of each kind (forward,
        backward; zero bubble's input and weight gradients apart): ``R*M`` each when idle passes are skipped,
        else every loop trip's (1F1B: every tick runs every kind; GPipe/circular: every step of each pass)."""
        return self.traffic.count(ALL_GATHER, BATCH, f"{LAYERS}, forward")

    @property
    def steps(self) -> int:
        """Loop trips per step: GPipe/circular ``R*M + S - 1`` per pass (`PipelinePlan.steps`), 1F1B its ticks
        (`sharding.pipeline.traffic.PipelineTraffic.trips`)."""
        return self.traffic.trips

    @property
    def chunk_slots(self) -> int:
        """K', slots run per step."""
        return self.working // self.repeats

    @property
    def applications(self) -> int:
        """Forward layer applications of this device per step (`PipelinePlan.layer_applications`):
        ``M * layers`` when empty slots and bubbles are skipped, else every slot position of every step
        (`positions`; 1F1B: every tick, as the compiled program's trip counts say: its forward and backward
        branches are each counted on every tick)."""
        return self.micro * self.layers if self.skip_empty else self.steps * self.positions

    @property
    def saved_inputs(self) -> int:
        """Activations kept for the backward pass: per chunk pass, its ``K'`` slot inputs (`block_inputs`: its
        ``n`` block inputs, `blocks`); GPipe/circular for every step, 1F1B for each entry of the ring."""
        return (self.ring or self.steps) * (self.blocks if self.block_inputs else self.positions)


def _pipeline_of(model: ModelDescription, layout: Layout, rules: Rules, s: _Shape) -> _Pipe:
    """The `_Pipe` of a device computing ``s.layers`` layers with a working copy of ``s.slots`` slots (the
    layout's largest stage, `StageLayout.slots`), the stored rows it receives from the layout's split."""
    mesh = layout.mesh
    stages, repeats = mesh[ax.STAGE], layout.pipeline_repeats
    split = math.prod(mesh[a] for a in _storage_axes(model, rules, mesh))
    # whole rows over the G devices (gathered once), or each row's features over them (per microbatch)
    groups, span = (1, split) if layout.pipeline_gather == "microbatch" else (split, 1)
    real = -(-s.slots // repeats)  # K, the layout's slots per chunk
    chunk = real  # K' (`Placement.chunk_slots`): K rounded up so that G divides R*K'
    while (repeats * chunk) % groups:
        chunk += 1
    schedule = layout.pipeline_schedule
    moved, ticks, ring, kept = _pipeline_tables(
        model.num_layers, stages, repeats, layout.stage_layers, groups, s.micro, schedule
    )
    return _Pipe(
        stages,
        repeats,
        s.micro,
        s.layers,
        repeats * chunk,
        groups,
        moved,
        layout.skip_empty,
        ticks,
        ring,
        gather=layout.pipeline_gather,
        split=schedule is Schedule.ZERO_BUBBLE,
        kept=kept,
        span=span,
        streams=_streams_edges(layout),
        traffic=_traffic(
            schedule, stages, s.micro, repeats, layout.pipeline_gather, layout.skip_empty, _streams_edges(layout)
        ),
        real=repeats * real,
        all_reduced=layout.pipeline_gather == "once" and groups > 1 and 2 * real <= chunk,
        keeps=keeps(layout.remat == "full", layout.pipeline_gather == "microbatch", model.experts is not None),
        full=layout.remat == "full",
    )


@functools.lru_cache(maxsize=4096)
def _traffic(
    schedule: Schedule, stages: int, micro: int, repeats: int, gather: str, skip_empty: bool, streams: bool
) -> PipelineTraffic:
    """The step's collectives as the stage program issues them (`PipelineTraffic.of`; cached: the planner prices
    many devices of one schedule)."""
    return PipelineTraffic.of(schedule, stages, micro, repeats, gather, skip_empty, streams)


@functools.lru_cache(maxsize=4096)
def _pipeline_tables(
    num_layers: int,
    stages: int,
    repeats: int,
    stage_layers: tuple[int, ...] | None,
    groups: int,
    micro: int,
    schedule: Schedule,
) -> tuple[tuple[int, ...], int, int, int]:
    """``(moved, ticks, ring, kept)`` of `_Pipe` from the static tables (`Placement.sends`, and for a
    1F1B-family ``schedule`` its tick table; none for GPipe/circular); cached: the planner prices many devices
    of one split."""
    moved = _moved_rows(num_layers, stages, repeats, stage_layers, groups)
    return (moved, *(_ticks_and_ring(stages, micro, repeats, schedule) if schedule.one_f_one_b else (0, 0, 0)))


# Keyed by the split: brute force over a 32-layer model's splits on 8 devices asks for 15,020 keys (4,495 splits
# over 4 stages, times the group counts and repeats), cycling through them once per layout; at 4,096 entries
# none was still cached when asked again and every split was placed again (45% of that search's time).
# 65,536 small tuples hold them all.
@functools.lru_cache(maxsize=65536)
def _moved_rows(
    num_layers: int, stages: int, repeats: int, stage_layers: tuple[int, ...] | None, groups: int
) -> tuple[int, ...]:
    """`_Pipe.moved` from the storage's placement (`Placement.sends`), cached apart from the microbatches and
    schedule it does not depend on. A split the run refuses (a planner's trial) moves no stored rows."""
    try:
        placement = StageStorage(plan_layout(num_layers, stages, repeats, stage_layers)[0], groups).placement
    except ValueError:
        return ()
    return tuple(int(send.shape[-1]) for send in placement.sends if send is not None)


@functools.lru_cache(maxsize=1024)
def _ticks_and_ring(stages: int, micro: int, repeats: int, schedule: Schedule) -> tuple[int, int, int]:
    """A 1F1B-family schedule's ticks, ring slots and (zero bubble) saved-ring entries (`tick_table`; raises the
    run's ValueError for a table it refuses)."""
    table = tick_table(schedule, stages, micro, repeats)
    return table.ticks, table.slots, getattr(table, "saved_slots", 0)


@functools.lru_cache(maxsize=256)
def tick_table(schedule: Schedule | str, stages: int, micro: int, repeats: int):
    """The tick table of a 1F1B-family schedule (`Schedule.tick_table`: `one_f_one_b_ticks`, `fused_ticks`,
    `zero_bubble_ticks`; cached: the planner prices many layouts of one table); None for GPipe/circular.

    Raises:
      ValueError: as the table's builder (a microbatch count or repeats the run refuses); a ``schedule`` not in
        `sharding.pipeline.layout.SCHEDULES`.
    """
    return parse_schedule(schedule).tick_table(stages, micro, repeats)


def _storage_axes(model: ModelDescription, rules: Rules, mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The batch axes a layer parameter is split over besides ``stage`` (`storage_axes` gathering once: the
    stored rows' devices; the per-microbatch gather's storage splits each row's features over them)."""
    return _storage_axes_cached(model, rules, tuple(mesh.items()))


@functools.lru_cache(maxsize=4096)
def _storage_axes_cached(model: ModelDescription, rules: Rules, mesh_items: tuple) -> tuple[str, ...]:
    return storage_axes([(None, *p.axes) for p in model.params if p.per_layer], rules, dict(mesh_items))


def _stage_folded(model: ModelDescription, layout: Layout, rules: Rules) -> tuple[Layout, dict[str, _Placed]]:
    """The head's layout: the mesh with ``stage`` folded into ``fsdp`` (the head's rows are split over both,
    `head_parallelism`, and the non-layer parameters stored over both, `spread_over_stage`), one microbatch,
    the loss gathered (`sharding.vocab.vocab_split` gives a pipeline's loss no vocabulary-parallel split)."""
    mesh = layout.mesh
    flat = dataclasses.replace(
        layout,
        mesh={**mesh, ax.STAGE: 1, ax.FSDP: mesh[ax.FSDP] * mesh[ax.STAGE]},
        logits="gathered",
        microbatches=1,
        stage_layers=None,
        pipeline_repeats=1,
        pipeline_schedule=Schedule.GPIPE,
    )
    return flat, _place_cached(model, rules, tuple(flat.mesh.items()))


def _pipeline_outside(s: _Shape, pipe: _Pipe) -> tuple[_Shape, _Shape, int]:
    """``(embedding, head, runs)``: the embedding's shape (the device's whole batch, replicated over
    ``stage``), the head's per run and how many runs: after GPipe/circular once on 1/S of the whole
    batch's rows (`head_parallelism`; all of them when S does not divide them), in 1F1B once per tick on
    one microbatch's rows (under a conditional counted on every tick; with ``skip_empty`` M times)."""
    whole = dataclasses.replace(s, rows=s.rows * s.micro, tok=s.tok * s.micro, micro=1, layers=0)
    if pipe.one_f_one_b:
        one = dataclasses.replace(s, micro=1, layers=0)
        return whole, one, (pipe.micro if pipe.skip_empty else pipe.ticks)
    split = pipe.stages if whole.rows % pipe.stages == 0 else 1
    return whole, dataclasses.replace(whole, rows=whole.rows / split, tok=whole.tok / split), 1


def _pipeline_memory(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    pipe: _Pipe,
    head: _Shape,
) -> tuple[Memory, Received | None]:
    """``(memory, received)``: bytes of a stage device, and for ``gather`` ``microbatch`` what the rows it
    receives add (`Received`; ``memory`` is then that of a split that moves none).

    Bytes of a stage device, by phase. Through the whole step (``gradients``): the stored rows' state and the
    float32 gradient sums of the working copy's slots in place of the stored rows' gradients, which the sums
    become after the loop (``gather`` ``microbatch``: the float32 sums of the device's own and received rows).
    The tick loop (``gathered``, ``activations``, ``logits``): the gathered working copy of the stage's slots
    (`_gather_bytes`; ``gather`` ``microbatch``: the slot's gathered layer and the rows received from other
    devices); what each saved slot keeps (`_Pipe.saved_inputs` of them, `_saved_per_slot`: its input, or with
    `_Pipe.keeps` the layer's residuals under the remat policy, and one chunk pass's fresh residuals beside
    them); every microbatch's stage input and its cotangent (none where stage 0 embeds each microbatch,
    `_head_streamed`); the largest of a layer's backward working set (its activations with the backward's
    score temporaries and the slot's weights: with ``gather`` ``once`` sliced out of the working copy, with
    ``microbatch`` its gathered layer), the head step's (the head's logits for one run's rows and, with the
    head streamed, its gathered weights and their whole gradient) and the streamed entry's (the gathered
    table and its whole gradient), which are never live together; and, for the 1F1B family, the head's (and a
    streamed entry's) weights held through the loop (`_head_weight_bytes`). Before the loop (``gather``
    ``once``, ``before_loop``, `_before_loop`): the working copy's gathered rows and a slice of them, the
    loop's zeroed rings and cotangents, the head's weights. `Memory.in_flight` takes the larger phase.

    Checked against the compiled step's temporaries (``temp_size_in_bytes``) and XLA's live ranges on the
    7B dry run (`bench/RESULTS.md`, "Per-microbatch pipeline temporaries" and "The per-microbatch
    temporaries: what is live at the peak") and on the test model's nine remat cases (`bench/remat_stages.py`,
    `tests/test_pipeline_remat.py`)."""
    base = _memory(model, layout, rules, placed, s)
    keys, scores = _attention_scores(model, layout, rules, s)
    per_layer = _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes)
    # one layer's backward working set: its recomputed activations, or where the stage keeps them (`_Pipe.keeps`)
    # the cotangents of as many values, which the head step's logits never peak with
    saved, working = _saved_per_slot(model, layout, rules, keys, s, pipe), per_layer
    whole_layer = sum(p.local * _batch_factor(p, layout.mesh) for p in placed.values() if p.param.per_layer)
    # once: the working copy's R*K' slots and their sums, which replace the q stored rows' gradients
    own = -(-model.num_layers // (pipe.stages * pipe.groups))
    held, sums = pipe.held, pipe.sums - own
    # microbatch: one layer in the compute dtype and the sums of the received rows (split over span, `Received`,
    # the one part that depends on the whole split); no whole layer's float32 gradient: `Streamed.backward`
    # reduce-scatters each leaf's gradient into the sums as the slot's backward produces it (at the peak, inside
    # the attention's backward, the MLP's are already done)
    if pipe.gather == "microbatch":
        held, sums = pipe.groups, 0
    # zero bubble: its ring of cuts holds every slot position of a chunk pass (`Streamed.positions` with the
    # per-microbatch gather: `n * B`, past the chunk's K' layers where B does not divide K'; else K')
    kept = pipe.kept * pipe.positions * weight_cut_bytes(model, rules, layout.mesh, s.act_bytes, s.tok)
    rings = s.tok * pipe.saved_inputs * saved + kept  # the loop's carried rings, zeroed before it
    # where the stage keeps residuals, a chunk pass's scan stacks its slots' fresh residuals, beside the ring
    # they are then written into: one chunk's (`positions` slots) beyond their inputs, whatever the schedule
    # (each forward tick runs one whole chunk pass). XLA's live ranges (`bench/hlo_live.py` `loop_peak`): the
    # forward chunk pass is the tick loop's peak on GPipe and zero bubble, holding the ring and all K' fresh
    # slots; on 1F1B a backward pass (the slot's weights sliced out of the working copy) tops it by 0.6%
    # (`bench/remat_stages.py`, `tests/test_pipeline_remat.py`)
    if pipe.keeps:
        slot_input = _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes, ("input",))
        kept += pipe.positions * (saved - slot_input) * s.tok
    # The recomputed layer's backward (`chunk_backward`'s `jax.vjp`) holds, beside what the layer saves, its
    # attention's score-sized float32 arrays at once (`_attention_scores`: two for the reference attention)
    # per token of a microbatch: every microbatch's stage input, and their cotangent, which the backward fills
    # in one microbatch at a time and the embedding's backward reads after the loop (none of either where stage
    # 0 embeds each microbatch itself)
    inputs = 0 if _head_streamed(pipe) else 2 * s.micro * model.hidden * s.act_bytes / rules.sequence_split(layout.mesh)
    head_weights = 0.0
    # A layer's backward working set and the head step's never peak together: GPipe/circular run the head
    # between the forward and backward loops, the 1F1B family in its own phase of a tick, before the tick's
    # backward pass (XLA's live ranges: no logits at the backward's peak). The step holds the larger of them.
    # beside a layer's pass, its weights: with ``gather`` ``microbatch`` the gathered block (in `gathered`), else
    # one slot's weights sliced out of the working copy (XLA's live ranges, `bench/hlo_live.py`: the scan's
    # dynamic slices, live through the layer's backward, at the tick loop's peak on every schedule)
    streamed = held * whole_layer * _gather_bytes(layout) if pipe.gather == "microbatch" else 0.0
    sliced = 0.0 if pipe.gather == "microbatch" else whole_layer * _gather_bytes(layout)
    backward = s.tok * (working + scores) + streamed + sliced
    logits = base.logits * head.tok / s.tok
    if pipe.one_f_one_b:
        head_weights, head_step, entry_step = _head_weight_bytes(placed, pipe, s.act_bytes)
        logits = max(logits + head_step, entry_step)
    memory = dataclasses.replace(
        base,
        gradients=base.gradients + sums * whole_layer * _PARAM_BYTES,
        activations=s.tok * (pipe.saved_inputs * saved + working + scores + inputs) + kept + sliced,
        logits=max(0.0, logits - backward),  # the head step's working set beyond the layer's
        gathered=held * whole_layer * _gather_bytes(layout) + head_weights,
    )
    if pipe.gather != "microbatch":
        before = _before_loop(placed, layout, pipe, whole_layer, rings + s.tok * inputs / 2) + head_weights
        return dataclasses.replace(memory, before_loop=before), None
    received = Received(base.gradients, held, whole_layer, _gather_bytes(layout), head_weights, pipe.span)
    return received.memory(memory, ()), received


def _before_loop(placed: dict[str, _Placed], layout: Layout, pipe: _Pipe, whole_layer: float, carried: float) -> float:
    """Bytes a stage device holds beyond its gradients while it gathers its working copy before the tick loop
    (``gather`` ``once``; `Memory.before_loop`), but the head's weights: the gathered rows of every working-copy
    slot (``R * K'``, in the gather's dtype; `sharding.pipeline.weights` all-gathers each weight's rows whole),
    and where the stage runs fewer slots than that (``R * K``, the padded slots dropped) one weight's rows
    sliced out of them beside them (the largest, which XLA slices first, once every gather is done), and
    ``carried``, the rings and cotangents the loop carries, which it zeroes before (the gradient sums too, in
    `Memory.gradients`).

    Read from XLA's buffer assignment and live ranges of the compiled step (`bench/hlo_live.py`, the test
    model on ``stage=2,fsdp=4`` under GPipe, 1F1B and zero bubble, `bench/remat_stages.py`): ``--remat full``
    peaks there (its tick loop holds less), the steps that keep residuals in their loop."""
    layer = [p.local * _batch_factor(p, layout.mesh) for p in placed.values() if p.param.per_layer]
    rows = pipe.working * whole_layer
    sliced = pipe.held * max(layer) if pipe.held < pipe.working else 0.0
    return (rows + sliced) * _gather_bytes(layout) + carried


@dataclasses.dataclass(frozen=True)
class Received:
    """The part of a stage device's memory that depends on the whole stage split (``gather`` ``microbatch``):
    the stored rows it receives from other devices (`_Pipe.moved`, split over ``span``) are held in the compute
    dtype beside its ``held`` rows, and their float32 gradient sums beside the gradients (`_pipeline_memory`).

    Attributes:
      gradients: Bytes of the gradients without the received rows' sums.
      held: Rows of the device's own storage it holds gathered.
      whole_layer: Elements of one layer's parameters on the device (over ``tensor``, whole over the batch axes).
      gather_bytes: Bytes per element of the gathered rows (`_gather_bytes`).
      head_weights: Bytes of the 1F1B head's (and a streamed entry's) weights held through the loop.
      span: The devices each stored row's features are split over.
    """

    gradients: float
    held: int
    whole_layer: float
    gather_bytes: int
    head_weights: float
    span: int

    def memory(self, memory: Memory, moved: tuple[int, ...]) -> Memory:
        """``memory`` with the gradients and gathered weights of a split that moves ``moved`` rows per ppermute."""
        received = sum(moved) / self.span
        return dataclasses.replace(
            memory,
            gradients=self.gradients + received * self.whole_layer * _PARAM_BYTES,
            gathered=(self.held + received) * self.whole_layer * self.gather_bytes + self.head_weights,
        )


def _saved_per_slot(model: ModelDescription, layout: Layout, rules: Rules, keys: float, s: _Shape, pipe: _Pipe):
    """Bytes per token of one microbatch a stage keeps per saved slot from its forward to its backward: the
    slot's input where it recomputes the layer (``--remat full``, or `_Pipe.keeps` False); with
    `_Pipe.keeps`, the layer's residuals as an unpipelined layer saves them under the policy (``none``: all
    of them; ``dots``: the input and the products' outputs), each an array of its own in the stage's ring:
    `ModelDescription.residuals` where the model lists them (else its `activations`, as
    `sharding.costmodel.memory._memory` prices an unpipelined layer)."""
    if not pipe.keeps:
        return _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes, ("input",))
    if not model.residuals:
        kept = None if layout.remat == "none" else ("input", "dot")
        return _per_token(model, "activations", rules, layout.mesh, keys, s.act_bytes, kept)
    # the split runs on the forward tick whatever of the backward reads no cotangent: a custom backward's
    # recomputed probabilities too (the reference attention's), so wherever the scores are materialised, the
    # ring keeps score-sized arrays
    scores = attention_of(model, layout).materialises_scores
    keys = s.seq if scores else 0.0
    kept = residual_tags(layout.remat, scores, s.act_bytes < 4)
    return _per_token(model, "residuals", rules, layout.mesh, keys, s.act_bytes, kept)


def residual_tags(remat: str, materialises_scores: bool, low: bool) -> tuple[str, ...]:
    """The tags of the `ModelDescription.residuals` terms a stage keeps per slot under ``remat`` (``none`` or
    ``dots``; `models.spec._residuals` lists them): ``dots`` the block input and the products' outputs;
    ``none`` all the layer's, with the attention's own (an attention that materialises the scores, the
    reference: its float32 output, ``none-scores``; a tiled kernel, flash: its log-sum-exp, ``none-tiled``)
    and, where the compute dtype is below float32 (``low``: the layout's, not the description's), the
    float32 copies and low-precision casts that only then are arrays of their own (``none-low``, and a tiled
    kernel's float32 output, ``none-tiled-low``)."""
    if remat != "none":
        return ("input", "dot")
    own = ("none-scores",) if materialises_scores else ("none-tiled",) + (("none-tiled-low",) if low else ())
    return ("input", "none", *own) + (("none-low",) if low else ())


def _streams_edges(layout: Layout) -> bool:
    """`Layout.stream_edges`, derived as `sharding.pipeline.PipelinePlan.streams_head` where unset."""
    if layout.stream_edges is not None:
        return layout.stream_edges
    return layout.pipeline_schedule.one_f_one_b and layout.pipeline_gather == "microbatch" and layout.skip_empty


def _head_streamed(pipe: _Pipe) -> bool:
    """The 1F1B family's head gathers its weights per head step (`sharding.pipeline.edges.HeadWeights`), and
    its entry, the embedding, its table per microbatch on stage 0 (`sharding.pipeline.edges.Entry`; no
    stage inputs held): ``gather`` ``microbatch`` where empty slots are skipped (both run under conditionals;
    `Layout.stream_edges`)."""
    return pipe.one_f_one_b and pipe.streams


def _head_split(p: _Placed) -> tuple[tuple[str, ...], int]:
    """``(axes, f)``: the batch axes a head weight is split over inside the stage program (``fsdp``, and
    ``expert`` where the rules put its ``embed`` there, a mixture of experts' mesh) and their device count."""
    axes = tuple(a for a in (ax.FSDP, ax.EXPERT) if p.factor(a) > 1) or (ax.FSDP,)
    return axes, p.factor(*axes)


def _head_weight_bytes(placed: dict[str, _Placed], pipe: _Pipe, act_bytes: int) -> tuple[float, float, float]:
    """Bytes of the 1F1B family's head weights (final norm, output projection) and, streamed, its entry's
    (the embedding table) on a stage device: ``(held, head_step, entry_step)``, what the tick loop holds
    throughout, what only a head step adds and what only an entry step (a stage-0 microbatch's lookup or its
    backward) adds. "Whole" is whole over the batch axes (`_gathered_block`): still split over ``tensor``.

    Gathered once: the whole head weights, gathered before the tick loop, and their whole float32 gradient
    sums, both held through it (the embedding runs before and after the loop); a head step adds the product
    that computes its weights' gradient, a whole gradient in the compute dtype (``act_bytes`` per element)
    that it then adds into the sums (XLA's live ranges, `bench/hlo_live.py`, float32 on CPU: the head step
    peaks with it, its logits and their cotangent). Streamed (`_head_streamed`):
    the float32 gradient sums of this device's ``1/f`` shards of the head's weights and of the table held
    through the loop; each one's gathered copy and one whole gradient only while its step runs, beside no
    layer (the head step beside its logits), so they join that step's working set, which adds to the
    step's peak only beyond a layer's backward working set (`_pipeline_memory`). (The 7B on stage=4,fsdp=2:
    1,000 MiB under a layer's working set, so the head and the table cost their 250 MiB sums each: `bench/
    RESULTS.md`, "The 1F1B head gathered per microbatch" and the entry's section after it.)"""
    head = [p for p in placed.values() if not p.param.per_layer and p.param.role != "embedding"]
    whole = sum(_gathered_block(p) for p in head) * _PARAM_BYTES
    if not _head_streamed(pipe):  # the head step's own: its weights' gradient product, before the sums take it
        return 2 * whole, whole / _PARAM_BYTES * act_bytes, 0.0
    table = [p for p in placed.values() if p.param.role == "embedding"]
    sums = sum(_gathered_block(p) / _head_split(p)[1] for p in head + table) * _PARAM_BYTES
    return sums, 2 * whole, 2 * sum(_gathered_block(p) for p in table) * _PARAM_BYTES


def _gathered_block(p: _Placed) -> float:
    """Elements of a head or entry weight once gathered inside the stage program: whole over the batch axes the
    program is manual over (`sharding.pipeline.program.manual_axes`), still split over the others (``tensor``,
    ``sequence``), which the partitioner keeps splitting inside it (a ``[D, V]`` output projection over
    ``tensor=8``: ``[D, V/8]`` per device)."""
    return p.local * p.factor(*ax.BATCH_MESH_AXES)


def weight_cut_bytes(
    model: ModelDescription, rules: Rules, mesh: Mapping[str, int], act_bytes: int, tokens: float
) -> float:
    """Bytes of one layer's cut for ``tokens`` tokens, what zero bubble's input-gradient pass keeps for the
    weight-gradient pass (`sharding.pipeline.split`): per token each product's input (one per run of
    consecutive products taking the same input: q, k, v; gate, up) and output cotangent in the activations'
    dtype, on one device (split as the activations are: over ``tensor``, not the batch axes); per layer each
    norm scale's float32 cotangent, ``sum(dy * x_hat)``, which the input-gradient pass computes itself (it is
    no product; keeping it instead of its token-sized operands shrinks the cut)."""
    products, norms = _cut_elements(model, rules, tuple(mesh.items()))
    return tokens * products * act_bytes + norms * _PARAM_BYTES


@functools.lru_cache(maxsize=4096)
def _cut_elements(model: ModelDescription, rules: Rules, mesh_items: tuple) -> tuple[float, float]:
    """``(elements per token, norm-scale elements)`` of one layer's cut on one device (`weight_cut_bytes`)."""
    splits = _activation_splits(model, rules, mesh_items)

    def size(axes, shape) -> float:
        return math.prod(shape) / math.prod(splits.get(a, 1) for a in axes)

    products, previous = 0.0, None
    for p in model.products:
        if not p.weight.per_layer:
            continue
        w = p.weight
        inputs = tuple(a for i, a in enumerate(w.axes) if i in p.contract)
        outputs = tuple(a for i, a in enumerate(w.axes) if i not in p.contract)
        shape_in = tuple(n for i, n in enumerate(w.shape) if i in p.contract)
        shape_out = tuple(n for i, n in enumerate(w.shape) if i not in p.contract)
        if inputs != previous:
            products += p.share * size(inputs, shape_in)
        previous = inputs
        products += p.share * size(outputs, shape_out)
    norms = sum(size(p.axes, p.shape) for p in model.params if p.per_layer and p.role == "scale")
    return products, norms


@functools.lru_cache(maxsize=4096)
def _activation_splits(model: ModelDescription, rules: Rules, mesh_items: tuple) -> dict[str, int]:
    """Per logical axis, how many ways an activation's dimension is split: the rules' mesh axes but those that
    may split a batch (which split the weights, gathered before their products, not the activations' features;
    `sharding.costmodel.flops._per_token_flops`)."""
    mesh = dict(mesh_items)
    return {
        name: math.prod(mesh[a] for a in axes if a not in ax.BATCH_MESH_AXES)
        for name, axes in _model_splits(model, rules, mesh_items).items()
    }


def _batch_factor(p: _Placed, mesh: Mapping[str, int]) -> int:
    """How many ways the axes that may split a batch (``data``, ``fsdp``, ``expert``) split a parameter: the
    stage program is manual over all of them whatever the rules map ``batch`` to (`_gathered_block`)."""
    return p.factor(*(a for a in ax.BATCH_MESH_AXES if mesh[a] > 1))


def stored_rows_moved(model: ModelDescription, layout: Layout) -> tuple[int, ...]:
    """Rows each device sends per ppermute of the pipeline's layer storage under ``layout``'s stage split
    (`_Pipe.moved`): the one part of a stage device's cost that depends on the whole split rather than its own
    layers and the largest stage's, so a cache of stage costs keyed by those two must also key by this."""
    rules = layout.rules_table()
    split = math.prod(layout.mesh[a] for a in _storage_axes(model, rules, layout.mesh))
    groups = 1 if layout.pipeline_gather == "microbatch" else split
    return _moved_rows(model.num_layers, layout.mesh[ax.STAGE], layout.pipeline_repeats, layout.stage_layers, groups)
