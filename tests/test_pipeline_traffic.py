"""The pipeline's collectives as one description (`sharding.pipeline.traffic`): derived from the schedule's tick
table, read by the stage programs and priced by the cost model. No devices."""

import pytest
from _cli_errors import raises_as_cli

from models.config import get_config
from sharding import costmodel as cm
from sharding import pipeline as pl
from sharding.pipeline import traffic as tr

SCHEDULES = ("gpipe", "circular", "1f1b", "1f1b-fused", "zb")


def _repeats(schedule: str) -> int:
    return 2 if schedule == "circular" else 1


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 16)])
def test_each_loop_trip_sends_the_activations_and_their_cotangents_once(schedule, stages, microbatches):
    repeats = _repeats(schedule)
    traffic = tr.PipelineTraffic.of(schedule, stages, microbatches, repeats)
    table = pl.Schedule(schedule).tick_table(stages, microbatches, repeats)
    assert traffic.trips == (repeats * microbatches + stages - 1 if table is None else table.ticks)
    assert [(t.what, t.count) for t in traffic.sends()] == [
        (tr.COTANGENTS, traffic.trips),
        (tr.ACTIVATIONS, traffic.trips),
    ]
    forward_only = tr.PipelineTraffic.of(schedule, stages, microbatches, repeats, train=False)
    assert [t.what for t in forward_only.sends()] == [tr.ACTIVATIONS]


@pytest.mark.parametrize("schedule", ("1f1b", "1f1b-fused", "zb"))
@pytest.mark.parametrize("skip_empty", [True, False])
def test_the_streamed_head_is_gathered_over_stage_every_tick_and_over_the_batch_axes_per_head_step(
    schedule, skip_empty
):
    stages, microbatches = 4, 8
    traffic = tr.PipelineTraffic.of(schedule, stages, microbatches, 1, "microbatch", skip_empty, streams_head=True)
    ticks = pl.Schedule(schedule).tick_table(stages, microbatches).ticks
    assert traffic.count(tr.ALL_GATHER, tr.STAGE, tr.HEAD) == ticks
    runs = microbatches if skip_empty else ticks
    assert traffic.count(tr.ALL_GATHER, tr.BATCH, tr.HEAD) == runs
    assert traffic.count(tr.REDUCE_SCATTER, tr.BATCH, tr.HEAD_GRADIENTS) == runs
    assert traffic.count(tr.ALL_REDUCE, tr.STAGE, tr.HEAD_GRADIENTS) == 1
    # each chunk pass of each kind gathers its layers once; zero bubble's weight-gradient pass reads none
    passes = microbatches if skip_empty else ticks
    assert traffic.count(tr.ALL_GATHER, tr.BATCH, tr.LAYERS) == 2 * passes
    held = tr.PipelineTraffic.of(schedule, stages, microbatches)
    assert held.count(tr.ALL_GATHER, tr.STAGE, tr.HEAD) == held.count(tr.ALL_GATHER, tr.BATCH, tr.HEAD) == 1


def test_the_plan_and_the_cost_model_read_the_same_description():
    """The cost model's stage sends and loop trips are the description's, for the plan's layout."""
    layout, _ = pl.plan_layout(8, 4)
    for schedule in ("gpipe", "1f1b", "1f1b-fused", "zb"):
        traffic = tr.PipelineTraffic.of_plan(pl.PipelinePlan(layout, 8, schedule=schedule))
        priced = cm.Layout({"stage": 4, "fsdp": 2}, "fsdp", 8, pipeline_schedule=schedule)
        estimate = cm.estimate(get_config("test", ["num_layers=8"]), 64, 64, priced, backend="cpu")
        sends = [c for c in estimate.comms if c.what == "stage activations"]
        assert [c.count for c in sends] == [traffic.count(tr.PERMUTE, tr.STAGE)] == [2 * traffic.trips]


def test_an_unknown_schedule_is_refused_with_the_flags_text():
    with raises_as_cli(ValueError, match=r"argument --pipeline-schedule: invalid choice: 'pipedream'"):
        tr.PipelineTraffic.of("pipedream", 4, 8)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("gather, streams", [("once", False), ("microbatch", False), ("microbatch", True)])
def test_the_loops_edges_and_the_working_copy_run_once_a_step(schedule, gather, streams):
    """GPipe and circular sum their outputs over ``stage`` after the forward loop; every schedule sums its stage
    inputs' cotangent but the 1F1B loop that embeds each microbatch itself; gathered once, the working copy is
    gathered before the loop and its gradient sums reduce-scattered after it."""
    one_f_one_b = pl.Schedule(schedule).one_f_one_b
    streams = streams and one_f_one_b
    traffic = tr.PipelineTraffic.of(schedule, 4, 8, _repeats(schedule), gather, True, streams)
    assert traffic.count(tr.ALL_REDUCE, tr.STAGE, tr.OUTPUTS) == (0 if one_f_one_b else 1)
    assert traffic.count(tr.ALL_REDUCE, tr.STAGE, tr.INPUT_COTANGENTS) == (0 if streams else 1)
    copies = 1 if gather == "once" else 0
    assert traffic.count(tr.ALL_GATHER, tr.BATCH, tr.WORKING_COPY) == copies
    assert traffic.count(tr.REDUCE_SCATTER, tr.BATCH, tr.WORKING_COPY) == copies
    assert all(not t.in_loop for t in traffic.transfers if t.what in (tr.OUTPUTS, tr.INPUT_COTANGENTS, tr.WORKING_COPY))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("gather", ["once", "microbatch"])
@pytest.mark.parametrize("skip_empty", [True, False])
def test_the_stage_programs_gather_where_the_description_says(schedule, gather, skip_empty):
    """The stage programs choose their layers' gathers (per chunk pass or once) and the 1F1B head's (in the loop
    or once) from the description: per pass exactly with ``--pipeline-gather microbatch``, the head in the loop
    exactly where the plan streams it (the 1F1B family gathering per microbatch and skipping idle slots)."""
    layout, _ = pl.plan_layout(8, 4, _repeats(schedule))
    plan = pl.PipelinePlan(layout, 8, schedule=schedule, gather=gather, skip_empty=skip_empty)
    for train in (True, False):
        traffic = tr.PipelineTraffic.of_plan(plan, train)
        assert traffic.streams_layers == (gather == "microbatch")
        assert traffic.streams_head == plan.streams_head
    assert plan.streams_head == (pl.Schedule(schedule).one_f_one_b and gather == "microbatch" and skip_empty)
