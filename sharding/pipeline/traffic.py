"""The pipeline's collectives, described once from its schedule (no JAX).

What one stage device's program (`sharding.pipeline.schedule` for GPipe and circular, `sharding.pipeline.onef1b`
for the 1F1B family) sends between stages and gathers per step, counted from the schedule's loop: GPipe's
``R*M + S - 1`` steps per pass, or the ticks of the 1F1B family's table (`sharding.pipeline.layout.Schedule`).
The stage programs run their loops for `PipelineTraffic.trips` trips, send what `PipelineTraffic.sends` lists and
gather their layers and head as it says (`PipelineTraffic.streams_layers`, `PipelineTraffic.streams_head`);
the cost model (`sharding.costmodel.pipeline_comms`) prices what it lists, with the byte sizes of its layout.
So a schedule whose table changes moves both together.

Listed: the activations and cotangents sent over ``stage`` (one ``ppermute`` each per loop trip, outside every
conditional) and the sums over ``stage`` at the loop's edges (GPipe's outputs, the stage inputs' cotangent); the
layers gathered once per step into the working copy, or, with the weights gathered per microbatch
(``--pipeline-gather microbatch``), the chunk passes of each kind that gather their layers and reduce-scatter
their gradients over the stage's devices (each pass's per-layer collectives are the storage's:
`sharding.pipeline.weights.Streamed`); the 1F1B family's head weights, gathered over ``stage`` and over the
stage's batch axes and their gradients reduced (`sharding.pipeline.edges`). Gathers among the stage's devices
run where the storage spreads the layers over them.
What the partitioner adds around them (the GPipe head's layout, gathers over ``tensor``) is not the schedule's
and is not listed.
"""

from __future__ import annotations

import dataclasses

from sharding.pipeline.layout import GATHERS, Schedule, parse_schedule

PERMUTE = "collective-permute"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_REDUCE = "all-reduce"

STAGE = "stage"
"""Over the ``stage`` mesh axis."""
BATCH = "batch"
"""Among the devices of one stage, over the batch axes the weights are split over (``data``, ``fsdp``)."""

ACTIVATIONS = "activations"
"""A microbatch's stage output ``[rows, length, embed]``, sent down the ring (stage ``s`` to ``s + 1``)."""
COTANGENTS = "cotangents"
"""The cotangent of a microbatch's stage input, sent up the ring."""
LAYERS = "layers"
"""One chunk pass's layers (`sharding.pipeline.weights.Streamed`), a pass of the kind in ``Transfer.what``."""
LAYER_GRADIENTS = "layer gradients"
"""One chunk pass's layer gradients, reduce-scattered where the pass computes them."""
OUTPUTS = "outputs"
"""GPipe's and circular's outputs ``[M, rows, length, embed]``, summed over ``stage`` after the forward loop, so
that every stage holds the last stage's (`sharding.pipeline.program.sum_over_stages`)."""
INPUT_COTANGENTS = "input cotangents"
"""The cotangent of the stage inputs ``[M, rows, length, embed]``, summed over ``stage`` after the loop (the
inputs were made stage-varying, `sharding.pipeline.program.stage_varying`; none where the 1F1B loop computes
each microbatch's input itself, from tokens)."""
WORKING_COPY = "working copy"
"""The stage's layers gathered once per step before the loop, where the storage spreads its rows over the
stage's devices (`sharding.pipeline.weights.Weights.gather`); their gradient sums reduce-scattered after it."""
HEAD = "head weights"
"""The 1F1B family's head weights (final norm, output projection; streamed, the entry's too)."""
HEAD_GRADIENTS = "head gradients"
"""Their gradient."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a pipeline step, with how many times a stage device issues it per step.

    Attributes:
      kind: `PERMUTE`, `ALL_GATHER`, `REDUCE_SCATTER` or `ALL_REDUCE` (the compiled program's op names).
      over: `STAGE` or `BATCH`.
      what: `ACTIVATIONS`, `COTANGENTS`, `OUTPUTS`, `INPUT_COTANGENTS`, `WORKING_COPY`, `LAYERS`
        (``"layers, forward"``: one kind of chunk pass), `LAYER_GRADIENTS`, `HEAD` or `HEAD_GRADIENTS`.
      count: executions per step, bubble trips included where they run.
      in_loop: issued inside the step's loop (else before or after it).
    """

    kind: str
    over: str
    what: str
    count: int
    in_loop: bool = True


@dataclasses.dataclass(frozen=True)
class PipelineTraffic:
    """The collectives of one pipeline step (module docstring).

    Attributes:
      trips: loop trips per pass: GPipe and circular ``R*M + S - 1`` steps (a forward loop, and a backward loop
        of as many), the 1F1B family the ticks of its table (one loop).
      transfers: the `Transfer` s, in the order a trip issues them.
    """

    trips: int
    transfers: tuple[Transfer, ...]

    @classmethod
    def of(
        cls,
        schedule: Schedule | str,
        stages: int,
        microbatches: int,
        repeats: int = 1,
        gather: str = "once",
        skip_empty: bool = True,
        streams_head: bool = False,
        train: bool = True,
    ) -> PipelineTraffic:
        """The traffic of a schedule over ``stages`` S, ``microbatches`` M and ``repeats`` R.

        Args:
          schedule: the `Schedule` (or its ``--pipeline-schedule`` text).
          stages, microbatches, repeats: S, M, R.
          gather: ``once`` or ``microbatch`` (`sharding.pipeline.layout.GATHERS`).
          skip_empty: idle passes are skipped (else every loop trip runs every kind of pass).
          streams_head: the 1F1B family gathers its head per head step (`PipelinePlan.streams_head`).
          train: the backward pass runs too (its cotangents, its passes, the gradients).

        Raises:
          ValueError: an unknown schedule or gather; as the schedule's tick table.
        """
        schedule = parse_schedule(schedule).for_repeats(repeats)
        if gather not in GATHERS:
            raise ValueError(f"gather {gather!r}; expected one of {', '.join(GATHERS)}")
        table = schedule.tick_table(stages, microbatches, repeats)
        trips = repeats * microbatches + stages - 1 if table is None else table.ticks
        # a tick's backward sends its input's cotangent before the tick's forward output leaves
        transfers = [Transfer(PERMUTE, STAGE, COTANGENTS, trips)] if train else []
        transfers.append(Transfer(PERMUTE, STAGE, ACTIVATIONS, trips))
        if gather == "once":
            transfers.append(Transfer(ALL_GATHER, BATCH, WORKING_COPY, 1, False))
            if train:
                transfers.append(Transfer(REDUCE_SCATTER, BATCH, WORKING_COPY, 1, False))  # its gradient sums
        if gather == "microbatch":
            passes = repeats * microbatches if skip_empty else trips
            # zero bubble: its input-gradient pass gathers, its weight-gradient pass reads no weight
            kinds = ["forward", "backward"] if train else ["forward"]
            transfers += [Transfer(ALL_GATHER, BATCH, f"{LAYERS}, {kind}", passes) for kind in kinds]
            if train:
                transfers.append(Transfer(REDUCE_SCATTER, BATCH, LAYER_GRADIENTS, passes))
        if not schedule.one_f_one_b:
            transfers.append(Transfer(ALL_REDUCE, STAGE, OUTPUTS, 1, False))
        if train and not (schedule.one_f_one_b and streams_head):
            transfers.append(Transfer(ALL_REDUCE, STAGE, INPUT_COTANGENTS, 1, False))
        if schedule.one_f_one_b:
            transfers += _head(trips, microbatches, skip_empty, streams_head, train)
        return cls(trips, tuple(transfers))

    @classmethod
    def of_plan(cls, plan, train: bool = True) -> PipelineTraffic:
        """The traffic of a `sharding.pipeline.layout.PipelinePlan` (as `of`)."""
        layout = plan.layout
        return cls.of(
            plan.schedule,
            layout.stages,
            plan.microbatches,
            layout.repeats,
            plan.gather,
            plan.skip_empty,
            plan.streams_head,
            train,
        )

    def count(self, kind: str, over: str, what: str | None = None) -> int:
        """Executions per step of the transfers of ``kind`` over ``over`` (of ``what``, or every one; a ``what``
        also matches the kinds of pass after it, ``"layers"`` every ``"layers, ..."``)."""
        return sum(
            t.count
            for t in self.transfers
            if t.kind == kind and t.over == over and (what is None or t.what == what or t.what.startswith(what + ","))
        )

    @property
    def streams_layers(self) -> bool:
        """Whether each chunk pass gathers its own layers (`LAYERS`, ``--pipeline-gather microbatch``) rather than
        reading a working copy gathered once before the loop (`WORKING_COPY`): what the stage programs read to
        choose `sharding.pipeline.weights.Weights.stream` or `sharding.pipeline.weights.Weights.gather`."""
        return any(t.kind == ALL_GATHER and t.what.startswith(LAYERS + ",") for t in self.transfers)

    @property
    def streams_head(self) -> bool:
        """Whether the head's weights (the 1F1B family's, and its entry's) are gathered inside the loop (`HEAD`
        issued per tick and per head step) rather than once before it: what the 1F1B stage program reads to
        hold them (`sharding.pipeline.edges.HeadWeights`) and to run the entry per microbatch."""
        return any(t.what == HEAD and t.in_loop for t in self.transfers)

    def sends(self) -> tuple[Transfer, ...]:
        """The ``ppermute`` s over ``stage`` every loop trip issues, in order: when training the cotangents (up the
        ring), and the activations (down it)."""
        return tuple(t for t in self.transfers if t.kind == PERMUTE and t.over == STAGE)


def _head(trips: int, microbatches: int, skip_empty: bool, streams: bool, train: bool) -> list[Transfer]:
    """The 1F1B family's head weights: gathered over ``stage`` (to the blocks of the stage's batch axes) and over
    those axes, their gradient reduce-scattered over them and summed over ``stage`` after the loop. Gathered once
    before the loop; streamed, over ``stage`` at every tick outside every conditional and over the batch axes at
    each head step (``M`` where idle steps are skipped, else every tick; `sharding.pipeline.edges.HeadWeights`)."""
    runs = (microbatches if skip_empty else trips) if streams else 1
    out = [
        Transfer(ALL_GATHER, STAGE, HEAD, trips if streams else 1, streams),
        Transfer(ALL_GATHER, BATCH, HEAD, runs, streams),
    ]
    if train:
        out += [
            Transfer(REDUCE_SCATTER, BATCH, HEAD_GRADIENTS, runs, streams),
            Transfer(ALL_REDUCE, STAGE, HEAD_GRADIENTS, 1, False),
        ]
    return out
