"""Pipeline stage layouts: which layers each stage holds, and the plan of a pipelined step (no JAX).

The layer stack ``[layers, ...]`` is split into ``S`` stages, one per index of the ``stage`` mesh
axis, and each global batch into ``M`` microbatches that flow from stage to stage. Stages may hold
different numbers of layers (``--stage-layers 10,10,6,6``): on mixed devices, or when ``S`` does not
divide the layer count.

Each stage runs its layers from ``slots = R * K`` slots, ``K`` the most layers any stage runs in one
repeat (all devices of one SPMD program hold arrays of one shape); a stage with fewer layers leaves slots
empty. Runs store the stack unpadded between steps (`sharding.pipeline.storage.StageStorage`) and build
the ``[repeats, slots, ...]`` copy once per step; the padded ``[stage, slot, ...]`` stack sharded over
``stage`` (logical axis ``layers`` -> mesh axis ``stage``, `pipeline_rules`) is how checkpoints saved
before that hold it (`StageLayout.layer_table`).

With ``R`` repeats, stage ``s`` holds chunks ``s, S+s, 2S+s, ...`` of the ``S*R`` chunks the layers
are cut into, in order (the circular or interleaved placement of Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2).
``R = 1`` is GPipe (Huang et al., NeurIPS 2019). A pass takes ``R*M + S - 1`` steps of one chunk
each, of which ``S - 1`` are the fill and drain bubble: `bubble_fraction`.

The 1F1B schedule (PipeDream-Flush; Narayanan et al., SC'21, section 2.2) runs the same layouts: after
``S-1-s`` warm-up forwards stage ``s`` alternates one forward and one backward, so with ``R = 1`` it
keeps at most ``S`` microbatches' stage inputs instead of ``M``; ``R > 1`` is interleaved 1F1B (section
2.2.2). Its ticks run in lockstep (``1f1b``: one op per stage per tick) or fused (``1f1b-fused``: a
forward and a backward per stage per tick); zero bubble (``zb``, Qi et al., ICLR 2024) runs fused ticks
with the backward split into the input gradient and a deferred weight gradient; `sharding.pipeline.ticks`
has the tables.

`sharding.pipeline.relayout` moves stacked arrays between layouts; `sharding.pipeline.schedule`
runs GPipe and circular, `sharding.pipeline.onef1b` runs 1F1B.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.errors import ConfigError, Field, FieldText, Override

# The tick tables live in `sharding.pipeline.ticks`; they are named here too, for the modules that read them
# beside the plan (the cost model, the planner).
from sharding.pipeline.ticks import (  # noqa: F401
    BACKWARD,
    FORWARD,
    WEIGHT,
    FusedTicks,
    Ticks,
    ZeroBubbleTicks,
    fused_ticks,
    one_f_one_b_ticks,
    zero_bubble_ticks,
)
from sharding.splits import even_split


class Schedule(enum.StrEnum):
    """A pipeline schedule, the one value a run's schedule is carried as: from ``--pipeline-schedule``
    (`parse_schedule`) through `PipelinePlan` and the cost model's ``Layout`` to the tick table it runs.

    A `str` whose value is the ``--pipeline-schedule`` spelling (``Schedule.FUSED == "1f1b-fused"``), so it
    prints, compares and serialises as the flag's value. ``gpipe`` and ``circular`` are one schedule told apart
    by the layout's repeats (`for_repeats`); the other three, the 1F1B family, run the loss and the backward
    pass inside the pipeline's loop (`one_f_one_b`) from a tick table (`tick_table`).

    Members:
      GPIPE: ``gpipe``, one chunk per stage, all forwards then all backwards (Huang et al., NeurIPS 2019).
      CIRCULAR: ``circular``, ``R > 1`` chunks per stage (Narayanan et al., SC 2021, section 2.2.2).
      ONE_F_ONE_B: ``1f1b``, PipeDream-Flush in lockstep ticks of one op per stage (`one_f_one_b_ticks`);
        interleaved with ``R > 1``.
      FUSED: ``1f1b-fused``, a forward and a backward per stage per tick (`fused_ticks`).
      ZERO_BUBBLE: ``zb``, ZB-H1 (Qi et al., ICLR 2024): fused ticks whose backward is split into the input
        gradient and a deferred weight gradient (`zero_bubble_ticks`).
    """

    GPIPE = "gpipe"
    CIRCULAR = "circular"
    ONE_F_ONE_B = "1f1b"
    FUSED = "1f1b-fused"
    ZERO_BUBBLE = "zb"

    @property
    def one_f_one_b(self) -> bool:
        """A 1F1B-family schedule: the loss and the backward pass inside the loop, from a tick table
        (`sharding.pipeline.onef1b`); False for GPipe and circular (`sharding.pipeline.schedule`)."""
        return self in _TICK_BUILDERS

    def for_repeats(self, repeats: int) -> Schedule:
        """This schedule on a layout of ``repeats`` chunks per stage: GPipe and circular by the repeats (1:
        ``gpipe``; more: ``circular``), the 1F1B family as it is (``R > 1`` is its interleaved form)."""
        if self.one_f_one_b:
            return self
        return Schedule.GPIPE if repeats == 1 else Schedule.CIRCULAR

    def tick_table(self, stages: int, microbatches: int, repeats: int = 1) -> Ticks | FusedTicks | None:
        """The 1F1B-family loop's table for ``stages`` S, ``microbatches`` M and ``repeats`` R (its builder:
        `one_f_one_b_ticks`, `fused_ticks` or `zero_bubble_ticks`); None for GPipe and circular, which run no
        tick table.

        Raises:
          ValueError: as the builder (``M < S``; interleaved with M not a multiple of S; zero bubble with
            ``R > 1``).
        """
        make = _TICK_BUILDERS.get(self)
        return None if make is None else make(stages, microbatches, repeats)


_TICK_BUILDERS = {
    Schedule.ONE_F_ONE_B: one_f_one_b_ticks,
    Schedule.FUSED: fused_ticks,
    Schedule.ZERO_BUBBLE: zero_bubble_ticks,
}

SCHEDULES = tuple(s.value for s in Schedule)
"""The ``--pipeline-schedule`` values: ``gpipe``, ``circular``, ``1f1b``, ``1f1b-fused``, ``zb``."""


def parse_schedule(text: str | Schedule) -> Schedule:
    """A ``--pipeline-schedule`` value (or a config file's ``pipeline_schedule``) as its `Schedule`.

    Raises:
      ConfigError: a value not in `SCHEDULES`, naming the field (the command line prints argparse's text for it).
    """
    try:
        return Schedule(text)
    except ValueError:
        choices = ", ".join(map(repr, SCHEDULES))
        raise ConfigError(
            "argument ", Field("pipeline_schedule"), f": invalid choice: {text!r} (choose from {choices})"
        ) from None


GATHERS = ("once", "microbatch")
"""``--pipeline-gather``: a stage's layer weights gathered once per step (the working copy and the gradient
sums held through it) or per microbatch, one block of layers at a time (`sharding.pipeline.weights.Weights`)."""


# Layouts ----------------------------------------------------------------------


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
        """``'10,10,6,6 (1 chunk per stage)'`` or ``'5+5,5+5,3+3,3+3 (2 chunks per stage)'``: the layout alone,
        which gpipe and 1f1b (one chunk) or circular and interleaved 1f1b (several) run."""
        if self.repeats == 1:
            return ",".join(map(str, self.stage_layers)) + " (1 chunk per stage)"
        per_stage = ("+".join(str(row[s]) for row in self.chunks) for s in range(self.stages))
        return ",".join(per_stage) + f" ({self.repeats} chunks per stage)"

    def to_meta(self) -> dict[str, Any]:
        """JSON-friendly form, stored with checkpoints."""
        return {
            "chunks": [list(row) for row in self.chunks],
            "stage_layers": list(self.stage_layers),
            "schedule": self.schedule,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> StageLayout | None:
        """Inverse of `to_meta`; None (canonical layout) for None."""
        if not meta:
            return None
        return cls(tuple(tuple(int(n) for n in row) for row in meta["chunks"]))


def parse_stage_layers(
    text: str | None, num_layers: int | None = None, stages: int | None = None
) -> tuple[int, ...] | None:
    """``'10,10,6,6'`` -> ``(10, 10, 6, 6)``; None (the default split) for None.

    Args:
      text: The value of the field ``stage_layers`` (comma-separated layer counts).
      num_layers, stages: When given, the error's example is a split of this model over these stages.

    Raises:
      ConfigError: an empty value or an entry that is not an integer, naming the field ``stage_layers`` and
        a value that works.
    """
    if text is None:
        return None
    try:
        if not text.strip():
            raise ValueError
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            Field("stage_layers", repr(text)),
            ": expected comma-separated layer counts, e.g. ",
            Field("stage_layers", example_split(num_layers, stages)),
        ) from None


def example_split(num_layers: int | None, stages: int | None) -> str:
    """A ``--stage-layers`` value that works for ``num_layers`` over ``stages`` (the even split), for error
    messages; the 7B example ``10,10,6,6`` when either is unknown."""
    if not num_layers or not stages or num_layers < stages:
        return "10,10,6,6"
    return _join(even_split(num_layers, stages))


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
      ConfigError: fewer layers than stages (or chunks); a ``stage_layers``
        with the wrong number of entries, a zero or negative entry, or a sum
        other than ``num_layers``. Each message names the field, the value and
        one that works.
    """
    chunks_total = stages * repeats
    if repeats < 1:
        raise ConfigError(Field("pipeline_repeats", repeats), ": must be at least 1")
    if num_layers < stages:
        raise ConfigError(
            Field("mesh", f"stage={stages}"),
            f": the model has {num_layers} layers, fewer than the {stages} stages; use ",
            Field("mesh", f"stage={_largest_divisor_at_most(num_layers, stages)}"),
            " (or more layers, ",
            Override("num_layers", stages),
            ")",
        )
    if num_layers < chunks_total:
        raise ConfigError(
            Field("pipeline_repeats", repeats),
            f": {stages} stages x {repeats} repeats = {chunks_total} chunks, more than the {num_layers} layers; use ",
            Field("pipeline_repeats", max(num_layers // stages, 1)),
        )
    even = even_split(num_layers, chunks_total)
    if stage_layers is None:
        chunks = tuple(tuple(even[r * stages : (r + 1) * stages]) for r in range(repeats))
        layout = StageLayout(chunks)
        note = None
        if num_layers % chunks_total:
            note = FieldText(
                Field("stage_layers"),
                f" not given: {num_layers} layers do not split evenly over {chunks_total} "
                f"{'stages' if repeats == 1 else 'chunks'}; split as {layout.describe()}",
            )
        return layout, note
    counts = tuple(stage_layers)
    even_stages = _join(even_split(num_layers, stages))
    if len(counts) not in (stages, chunks_total):
        wanted = f"{stages}" if repeats == 1 else f"{stages} (per stage) or {chunks_total} (per chunk)"
        raise ConfigError(
            Field("stage_layers", _join(counts)),
            f": {len(counts)} entries, but ",
            Field("mesh", f"stage={stages}"),
            f" needs {wanted}; e.g. ",
            Field("stage_layers", even_stages),
        )
    if min(counts) <= 0:
        raise ConfigError(
            Field("stage_layers", _join(counts)),
            ": every stage needs at least one layer; e.g. ",
            Field("stage_layers", even_stages),
        )
    if sum(counts) != num_layers:
        raise ConfigError(
            Field("stage_layers", _join(counts)),
            f" sums to {sum(counts)}, but the model has {num_layers} layers; e.g. ",
            Field("stage_layers", even_stages),
        )
    if len(counts) == chunks_total and repeats > 1:
        chunks = tuple(tuple(counts[r * stages : (r + 1) * stages]) for r in range(repeats))
    else:
        per_stage = [even_split(n, repeats) for n in counts]
        if any(min(split) == 0 for split in per_stage):
            raise ConfigError(
                Field("stage_layers", _join(counts)),
                ": with ",
                Field("pipeline_repeats", repeats),
                f" every stage needs at least {repeats} layers (one per repeat); e.g. ",
                Field("stage_layers", even_stages),
            )
        chunks = tuple(tuple(split[r] for split in per_stage) for r in range(repeats))
    return StageLayout(chunks), None


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A layout and the number of microbatches that flow through it: the model's execution mode over ``stage``
    (`sharding.parallel.Parallelism.pipeline`), not a gradient strategy.

    Attributes:
      layout: the `StageLayout`.
      microbatches: M, microbatches per global batch.
      skip_empty: skip empty slots and bubble steps with conditionals (the
        default). False computes every slot of every step and discards what
        is not needed: the fallback for a program in which the partitioner
        put a collective that could wait on other stages inside such a
        conditional (see `branch_collectives`).
      schedule: the `Schedule` (``--pipeline-schedule``; a `SCHEDULES` string is taken as its value). GPipe and
        circular follow the layout's repeats (`Schedule.for_repeats`): ``gpipe`` on a layout of two chunks per
        stage is ``circular``. The 1F1B family (``1f1b``, interleaved with ``R > 1``; ``1f1b-fused``, a
        forward and a backward per stage per tick, ``R*M + (R+1) S - 2`` ticks of a chunk's forward plus
        backward against lockstep's ``2 (M + S - 1)`` ticks of one op each with one chunk; ``zb``, fused ticks
        whose backward is split into the input gradient and a deferred weight gradient) runs the loss and the
        backward pass inside the pipeline's loop (`sharding.pipeline.onef1b`) from its `tick_table`.
      measure_stages: ``--stage-layers auto``: the layout's split is a placeholder (even) until the
        stages are timed at start-up (`train.setup.calibrate.calibrate_stages`), which replaces it.
      gather: ``once`` (MaxText's ``pipeline_fsdp_ag_once``: the stage's layers gathered before the loop in the
        compute dtype and their gradients summed whole, both held through the step) or ``microbatch`` (each
        block of layers gathered where a chunk runs it, its gradient reduce-scattered there: the step holds one
        block's working set, and pays a gather per chunk pass; the 1F1B family's head too, `streams_head`);
        `GATHERS`, ``--pipeline-gather``.

    Raises:
      ValueError: ``schedule`` not in `SCHEDULES` (`parse_schedule`); ``gather`` not in `GATHERS`.
    """

    layout: StageLayout
    microbatches: int
    skip_empty: bool = True
    schedule: Schedule = Schedule.GPIPE
    measure_stages: bool = False
    gather: str = "once"

    def __post_init__(self):
        object.__setattr__(self, "schedule", parse_schedule(self.schedule).for_repeats(self.layout.repeats))
        if self.gather not in GATHERS:
            raise ValueError(f"PipelinePlan: gather {self.gather!r}; expected one of {', '.join(GATHERS)}")

    @property
    def one_f_one_b(self) -> bool:
        """The schedule is of the 1F1B family (`Schedule.one_f_one_b`): loss and backward inside the loop."""
        return self.schedule.one_f_one_b

    def tick_table(self) -> Ticks | FusedTicks | None:
        """The 1F1B-family loop's table (`Schedule.tick_table`: `one_f_one_b_ticks`, `fused_ticks` or
        `zero_bubble_ticks`); None for GPipe and circular.

        Raises:
          ValueError: as `one_f_one_b_ticks` (too few microbatches for the order); as `zero_bubble_ticks`.
        """
        return self.schedule.tick_table(self.layout.stages, self.microbatches, self.layout.repeats)

    @property
    def streams_head(self) -> bool:
        """The 1F1B family's output head gathers its weights per head step, inside its conditional on the last
        stage, and reduce-scatters their gradient there (``gather`` ``microbatch`` with ``skip_empty``;
        `sharding.pipeline.edges.HeadWeights`); else they are gathered once per step."""
        return self.one_f_one_b and self.gather == "microbatch" and self.skip_empty

    @property
    def ticks(self) -> int:
        """Ticks of the 1F1B loop (`tick_table`): lockstep ``2 (M + S - 1)`` with one chunk per stage (each
        stage's M forwards, M backwards and ``2 (S - 1)`` idle ticks), fused ``R*M + (R+1) S - 2``, zero bubble
        ``M + 2 (S - 1)``."""
        return self.tick_table().ticks

    @property
    def steps(self) -> int:
        """Pipeline steps per forward pass: ``R*M + S - 1``."""
        return self.layout.repeats * self.microbatches + self.layout.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """``(S-1) / (R*M + S - 1)``: the share of steps a stage idles (fill and drain)."""
        return bubble_fraction(self.layout.stages, self.microbatches, self.layout.repeats)

    def layer_applications(self) -> tuple[int, ...]:
        """Forward layer applications per device of each stage.

        ``M * stage_layers[s]`` when empty slots are skipped; otherwise every
        slot of every step: ``steps * K``.
        """
        if not self.skip_empty:
            steps = self.ticks if self.one_f_one_b else self.steps
            return (steps * self.layout.chunk_slots,) * self.layout.stages
        return tuple(self.microbatches * n for n in self.layout.stage_layers)


def check_microbatches(
    microbatches: int,
    stages: int,
    batch_size: int,
    data_parallel: int,
    interleaved_repeats: int = 1,
    batch_field: str = "batch_size",
) -> None:
    """Pipeline microbatch checks, before any compilation.

    The value suggested also splits the batch (``--batch-size`` over M microbatches, each over
    ``data_parallel``), so the check of the batch that follows accepts it.

    Args:
      microbatches: M (``--microbatches``).
      stages: S.
      batch_size: the global batch (``--batch-size``).
      data_parallel: the devices the rules split the batch over (`sharding.parallel.Parallelism.data_parallel`:
        ``data x fsdp x expert`` under every preset); each microbatch must split over it.
      interleaved_repeats: R of interleaved 1F1B (``--pipeline-repeats`` with a 1F1B schedule), whose
        order moves microbatches in groups of S (Narayanan et al., SC'21, section 2.2), so M must be a
        multiple of S; 1 for every other schedule.
      batch_field: the field of the batch in the suggestion (``global_batch`` for the planner).

    Raises:
      ConfigError: M < S (the ring would wait for a microbatch that does not exist), or interleaved 1F1B's
        M not a multiple of S, naming the field ``microbatches`` and a value that works.
    """
    multiple = stages if interleaved_repeats > 1 else 1
    if microbatches >= stages and microbatches % multiple == 0:
        return
    good = [
        m
        for m in range(stages, batch_size + 1)
        if m % multiple == 0 and batch_size % m == 0 and (batch_size // m) % data_parallel == 0
    ]
    hint = (
        (Field("microbatches", good[0]),)
        if good
        else (
            Field("microbatches", stages),
            " ",
            Field(batch_field, stages * data_parallel * max(1, batch_size // (stages * data_parallel))),
        )
    )
    if microbatches < stages:
        why = (
            f"fewer microbatches than the {stages} pipeline stages (",
            Field("mesh", f"stage={stages}"),
            "); every stage needs a microbatch in flight",
        )
    else:
        why = (
            "interleaved 1F1B (",
            Field("pipeline_repeats", interleaved_repeats),
            f") needs a multiple of the {stages} stages",
        )
    raise ConfigError(Field("microbatches", microbatches), ": ", *why, "; use ", *hint)


def keeps(recompute: bool, streamed: bool, objective: bool) -> bool:
    """Whether a stage keeps its layers' residuals from the forward tick (``--remat none``/``dots``: not
    ``recompute``) rather than each slot's input alone. A streamed working copy (``streamed``:
    ``--pipeline-gather microbatch``, `sharding.pipeline.weights.Streamed`) and a layer with an ``objective`` (a
    mixture of experts' router) recompute
    each layer whatever the choice: the first gathers each block of weights again for its backward, which then
    runs the layer too, and the second's objective cotangent joins the layer's only where it is
    differentiated."""
    return not recompute and not streamed and not objective


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle fraction of a pipeline pass, ``(S-1) / (R*M + S-1)``.

    GPipe (Huang et al., 2019, section 2.2) with ``repeats=1``; the circular (interleaved) schedule of
    Narayanan et al. (SC'21, section 2.2.2) with ``repeats`` chunks per device.
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)


# Rules ---------------------------------------------------------------------------


def pipeline_rules(rules):
    """The rules with ``layers -> stage``, so ``[stage, slot, ...]`` arrays shard over ``stage``.

    Raises:
      ConfigError: when another logical axis already maps to ``stage`` (the
        pipeline owns that axis), naming it and the ``rule`` that remaps it.
    """
    for logical, mesh_axes in rules.table:
        if ax.STAGE in mesh_axes and logical != ax.LAYERS:
            raise ConfigError(
                Field("rule", f"{logical}={'+'.join(mesh_axes)}"),
                f": the pipeline owns mesh axis {ax.STAGE!r}; remap {logical!r} (e.g. ",
                Field("rule", f"{logical}=none"),
                ")",
            )
    if rules.mesh_axes(ax.LAYERS) == (ax.STAGE,):
        return rules
    return rules.with_overrides({ax.LAYERS: (ax.STAGE,)})


def head_parallelism(par):
    """The layout of the work after the pipeline (final norm, output projection, loss): rows over ``stage`` too.

    `sharding.pipeline.schedule.run_pipeline` hands every stage the last stage's outputs ``[batch, length, embed]``,
    the rows split over the batch axes (``data``, ``fsdp``) only. Computed under ``par`` as is, the head
    would run on every stage for all of those rows: S times the work it needs. Under this variant
    ``batch`` maps to its axes and then ``stage``, so each stage keeps 1/S of its rows (a slice of what
    it already holds, no transfer) and computes the norm, the logits and the loss for those only;
    the loss sums are then summed over ``stage`` with the other axes. Its backward pass all-gathers
    the activations' cotangent over ``stage`` (one ``[batch / (data x fsdp), length, embed]`` per
    device) where the pipeline's backward pass starts.

    Why split the rows rather than run the head on the last stage alone: in one SPMD program every
    stage waits for the head either way, so running it on one stage saves no time, while the split
    divides its FLOPs and its logits' memory (``[rows, length, vocab]``, the largest activation of a
    large vocabulary) by S on every device. The embedding (a gather, no matrix product) stays as it
    is: splitting its rows would add an all-gather of the pipeline's input over ``stage``.

    Args:
      par: The run's `sharding.parallel.Parallelism`.

    Returns:
      ``par`` with ``batch -> (its axes..., stage)`` when it has a pipeline over ``stage`` > 1
      (``constrain`` leaves ``stage`` out where it does not divide the rows), else ``par`` itself.
    """
    if par.pipeline is None or par.mesh_shape.get(ax.STAGE, 1) <= 1 or ax.STAGE in par.rules.mesh_axes(ax.BATCH):
        return par
    return par.replace(rules=par.rules.with_overrides({ax.BATCH: (*par.rules.mesh_axes(ax.BATCH), ax.STAGE)}))
