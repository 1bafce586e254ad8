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
2.2.2). `one_f_one_b_ticks` is its table of ticks.

`sharding.pipeline.relayout` moves stacked arrays between layouts; `sharding.pipeline.schedule`
runs GPipe and circular, `sharding.pipeline.onef1b` runs 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from sharding import axes as ax
from sharding.splits import even_split

SCHEDULES = ("gpipe", "circular", "1f1b")


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
        return {"chunks": [list(row) for row in self.chunks], "stage_layers": list(self.stage_layers),
                "schedule": self.schedule}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> StageLayout | None:
        """Inverse of `to_meta`; None (canonical layout) for None."""
        if not meta:
            return None
        return cls(tuple(tuple(int(n) for n in row) for row in meta["chunks"]))


def parse_stage_layers(text: str | None, num_layers: int | None = None, stages: int | None = None
                       ) -> tuple[int, ...] | None:
    """``'10,10,6,6'`` -> ``(10, 10, 6, 6)``; None (the default split) for None.

    Args:
      text: The flag's value.
      num_layers, stages: When given, the error's example is a split of this model over these stages.

    Raises:
      ValueError: an empty value or an entry that is not an integer, naming ``--stage-layers`` and a value
        that works.
    """
    if text is None:
        return None
    try:
        if not text.strip():
            raise ValueError
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--stage-layers {text!r}: expected comma-separated layer counts, e.g. "
                         f"--stage-layers {example_split(num_layers, stages)}") from None


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
    even = even_split(num_layers, chunks_total)
    if stage_layers is None:
        chunks = tuple(tuple(even[r * stages : (r + 1) * stages]) for r in range(repeats))
        layout = StageLayout(chunks)
        note = None
        if num_layers % chunks_total:
            note = (f"--stage-layers not given: {num_layers} layers do not split evenly over {chunks_total} "
                    f"{'stages' if repeats == 1 else 'chunks'}; split as {layout.describe()}")
        return layout, note
    counts = tuple(stage_layers)
    even_stages = _join(even_split(num_layers, stages))
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
        per_stage = [even_split(n, repeats) for n in counts]
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
      measure_stages: ``--stage-layers auto``: the layout's split is a placeholder (even) until the
        stages are timed at start-up (`train.calibrate.calibrate_stages`), which replaces it.
    """

    layout: StageLayout
    microbatches: int
    skip_empty: bool = True
    one_f_one_b: bool = False
    measure_stages: bool = False

    @property
    def pipeline(self) -> PipelinePlan:
        """This plan: the strategy is a pipeline (`sharding.parallel.Parallelism.pipeline`; None for the others)."""
        return self

    def mean_microbatches(self, groups: int) -> int:
        """M: every data-parallel group runs all of them (`sharding.parallel.Parallelism.microbatches`)."""
        return self.microbatches

    @property
    def schedule(self) -> str:
        """``gpipe``, ``circular`` or ``1f1b`` (`SCHEDULES`; the ``--pipeline-schedule`` value)."""
        return "1f1b" if self.one_f_one_b else self.layout.schedule

    @property
    def ticks(self) -> int:
        """Ticks of the 1F1B loop (`one_f_one_b_ticks`): ``2 (M + S - 1)`` with one chunk per stage, each
        stage's M forwards, M backwards and ``2 (S - 1)`` idle ticks."""
        return one_f_one_b_ticks(self.layout.stages, self.microbatches, self.layout.repeats).ticks

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


FORWARD, BACKWARD = 1, 2
"""The ops of a `Ticks` table (0: idle)."""


@dataclasses.dataclass(frozen=True)
class Ticks:
    """The 1F1B schedule as tables ``[ticks, S]`` int32: what each stage does at each tick of one SPMD loop.

    PipeDream-Flush (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", SC'21, section 2.2, figure 4) with ``R`` chunks per stage (virtual stages
    ``v = r*S + s``; interleaved, section 2.2.2, for ``R > 1``), in lockstep ticks of one op
    (`one_f_one_b_ticks`). Saved chunk inputs live in a ring of `slots` entries, cotangents waiting for
    their backward in one of `cotangent_slots`; the slot of each is fixed here, so the program only indexes.

    Attributes:
      op: 0 idle, `FORWARD` or `BACKWARD`.
      chunk: the op's chunk ``r`` (0 when idle).
      microbatch: the op's microbatch (0 when idle).
      slot: the ring slot of the op's saved chunk input (its slot inputs, written by the forward, read by
        the backward).
      arrive: the ring slot for the activation arriving at the start of the tick (sent by the previous
        virtual stage's forward at the tick before), -1 when what arrives is a dummy.
      cotangent_arrive: the cotangent slot for the cotangent arriving at the start of the tick (sent by the
        next virtual stage's backward at the tick before), -1 when it is a dummy.
      cotangent_slot: a backward's cotangent slot; for the last virtual stage's forward, the slot the loss's
        cotangent goes to.
      slots: ring slots per stage.
      cotangent_slots: cotangent slots per stage.
    """

    op: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    slot: np.ndarray
    arrive: np.ndarray
    cotangent_arrive: np.ndarray
    cotangent_slot: np.ndarray
    slots: int
    cotangent_slots: int

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def live(self) -> np.ndarray:
        """``[S]``: the most chunk inputs each stage holds at once (from arrival to backward)."""
        return np.asarray([self._live[s] for s in range(self.op.shape[1])], np.int32)

    @property
    def _live(self) -> dict[int, int]:
        ticks, stages = self.op.shape
        most = {}
        for s in range(stages):
            held: set[int] = set()
            peak = 0
            for t in range(ticks):
                if self.arrive[t, s] >= 0:
                    held.add(int(self.arrive[t, s]))
                if self.op[t, s] == FORWARD:
                    held.add(int(self.slot[t, s]))
                peak = max(peak, len(held))
                if self.op[t, s] == BACKWARD:
                    held.discard(int(self.slot[t, s]))
            most[s] = peak
        return most


def _stage_orders(stages: int, repeats: int, microbatches: int) -> list[list[tuple[int, int, int]]]:
    """Each stage's ops ``(op, chunk, microbatch)`` in order: warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards (Megatron-LM's order; with ``R > 1`` microbatches go
    in groups of ``S``, chunk by chunk, forwards in chunk order and backwards in reverse)."""
    n = repeats * microbatches

    def forward(k):
        group, within = divmod(k, stages * repeats)
        return within // stages, group * stages + within % stages

    def backward(k):
        r, i = forward(k)
        return repeats - 1 - r, i

    orders = []
    for s in range(stages):
        warm = stages - s - 1 if repeats == 1 else 2 * (stages - s - 1) + (repeats - 1) * stages
        warm = min(warm, n)
        order = [(FORWARD, *forward(k)) for k in range(warm)]
        for k in range(n - warm):
            order += [(FORWARD, *forward(warm + k)), (BACKWARD, *backward(k))]
        order += [(BACKWARD, *backward(k)) for k in range(n - warm, n)]
        orders.append(order)
    return orders


def _colour(intervals: dict) -> tuple[dict, int]:
    """Slots for inclusive tick intervals ``key -> (start, end)``: no two overlapping intervals share one."""
    slots, free_at = {}, []
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        slot = next((k for k, t in enumerate(free_at) if t < start), len(free_at))
        if slot == len(free_at):
            free_at.append(end)
        free_at[slot] = end
        slots[key] = slot
    return slots, max(len(free_at), 1)


def one_f_one_b_ticks(stages: int, microbatches: int, repeats: int = 1) -> Ticks:
    """The 1F1B schedule of ``S`` stages, ``M`` microbatches and ``R`` chunks per stage, as a `Ticks` table.

    Each stage takes its next op (`_stage_orders`) as soon as its input is there: a forward's activation
    left the previous virtual stage at an earlier tick, a backward's cotangent left the next virtual stage
    at an earlier tick (the last virtual stage's: its own forward, the loss between them). With ``R = 1``
    stage ``s`` runs ``S - s`` forwards before its first backward and then alternates, holding at most ``S``
    microbatches' inputs (stage 0), and the pass takes ``2 (M + S - 1)`` ticks.

    Raises:
      ValueError: ``M < S``, or ``R > 1`` with ``M`` not a multiple of ``S`` (the interleaved order moves
        microbatches in groups of ``S``), naming ``--microbatches``.
    """
    if microbatches < stages:
        raise ValueError(f"--microbatches {microbatches}: 1F1B needs at least the {stages} stages")
    if repeats > 1 and microbatches % stages:
        raise ValueError(f"--microbatches {microbatches}: interleaved 1F1B (--pipeline-repeats {repeats}) needs a "
                         f"multiple of the {stages} stages, e.g. --microbatches {stages * -(-microbatches // stages)}")
    last = stages * repeats - 1
    orders, done, ptr, rows = _stage_orders(stages, repeats, microbatches), {}, [0] * stages, []
    while any(p < len(o) for p, o in zip(ptr, orders)):
        row = []
        for s in range(stages):
            if ptr[s] == len(orders[s]):
                row.append(None)
                continue
            op, r, i = orders[s][ptr[s]]
            v = r * stages + s
            need = ((FORWARD, v - 1, i) if v else None) if op == FORWARD else \
                ((FORWARD, v, i) if v == last else (BACKWARD, v + 1, i))
            ready = need is None or done.get(need, len(rows)) < len(rows)
            row.append((op, r, i) if ready else None)
            ptr[s] += ready
        for s, entry in enumerate(row):
            if entry:
                done[entry[0], entry[1] * stages + s, entry[2]] = len(rows)
        rows.append(row)
        if len(rows) > 4 * (repeats * microbatches + stages) * 2:
            raise AssertionError("1F1B order deadlocked")  # unreachable for the orders above
    saved = {(v, i): (done[FORWARD, v - 1, i] + 1 if v else done[FORWARD, v, i], done[BACKWARD, v, i])
             for v in range(last + 1) for i in range(microbatches)}
    waiting = {(v, i): (done[FORWARD, v, i] if v == last else done[BACKWARD, v + 1, i] + 1, done[BACKWARD, v, i])
               for v in range(last + 1) for i in range(microbatches)}
    by_stage = [{k: w for k, w in saved.items() if k[0] % stages == s} for s in range(stages)]
    cot_by_stage = [{k: w for k, w in waiting.items() if k[0] % stages == s} for s in range(stages)]
    colours = [_colour(x) for x in by_stage]
    cot_colours = [_colour(x) for x in cot_by_stage]
    slot_of = {k: c for cs, _ in colours for k, c in cs.items()}
    cot_of = {k: c for cs, _ in cot_colours for k, c in cs.items()}
    shape = (len(rows), stages)
    tables = {name: np.zeros(shape, np.int32) for name in ("op", "chunk", "microbatch", "slot", "cotangent_slot")}
    tables["arrive"] = np.full(shape, -1, np.int32)
    tables["cotangent_arrive"] = np.full(shape, -1, np.int32)
    for t, row in enumerate(rows):
        for s, entry in enumerate(row):
            if not entry:
                continue
            op, r, i = entry
            v = r * stages + s
            for name, value in (("op", op), ("chunk", r), ("microbatch", i), ("slot", slot_of[v, i])):
                tables[name][t, s] = value
            if op == BACKWARD or v == last:
                tables["cotangent_slot"][t, s] = cot_of[v, i]
            if op == FORWARD and v < last and t + 1 < len(rows):
                tables["arrive"][t + 1, (s + 1) % stages] = slot_of[v + 1, i]
            if op == BACKWARD and v > 0 and t + 1 < len(rows):
                tables["cotangent_arrive"][t + 1, (s - 1) % stages] = cot_of[v - 1, i]
    return Ticks(**tables, slots=max(n for _, n in colours), cotangent_slots=max(n for _, n in cot_colours))


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


def head_parallelism(par):
    """The layout of the work after the pipeline (final norm, output projection, loss): rows over ``stage`` too.

    `sharding.pipeline.run_pipeline` hands every stage the last stage's outputs ``[batch, length, embed]``,
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
      ``par`` with ``batch -> (its axes..., stage)`` when its strategy is a pipeline over ``stage`` > 1
      (``constrain`` leaves ``stage`` out where it does not divide the rows), else ``par`` itself.
    """
    if par.pipeline is None or par.mesh_shape.get(ax.STAGE, 1) <= 1 or ax.STAGE in par.rules.mesh_axes(ax.BATCH):
        return par
    return par.replace(rules=par.rules.with_overrides({ax.BATCH: (*par.rules.mesh_axes(ax.BATCH), ax.STAGE)}))
