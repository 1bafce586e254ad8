"""Pipeline parallelism over the ``stage`` mesh axis, in one SPMD program, with uneven stages.

The package itself imports no JAX: it names the pure pieces, and the schedules are imported from their
own modules.

* `layout`: stage layouts and the pipeline plan (which layers each stage holds; no JAX);
* `ticks`: the 1F1B-family schedules' tick tables, lockstep, fused and zero bubble (what each stage runs at each tick; no JAX);
* `traffic`: what a step sends between stages and gathers, derived from the schedule's loop (no JAX): the
  stage programs and the cost model read it;
* `storage`: how a run stores the layer stack between steps: unpadded rows over every device (no JAX at
  import);
* `relayout`: moving stacked layer arrays between layouts (checkpoints across stage counts; no JAX at
  import);
* `program`: the pieces every schedule's stage program is built from (setup, a chunk's forward and
  hand-written backward);
* `buffers`: the loop's buffers: microbatches, slot-sized reads and writes, one slot's forward and backward;
* `weights`: the stage's layer weights gathered for a pass and their gradients reduced (once per step, or
  per chunk pass);
* `padding`: a working copy padded for its storage's devices, its real slots moved by all-reduces;
* `split`: a layer's traced backward cut into zero bubble's input-gradient and weight-gradient passes;
* `schedule`: the GPipe and circular schedules with their hand-written backward pass (`run_pipeline`);
* `onef1b`: the 1F1B schedules (zero bubble too), loss and backward pass in one loop (`run_pipeline_loss`).
* `edges`: the 1F1B loop's head weights and entry (the token embedding), gathered once or per microbatch.
"""

from sharding.pipeline.layout import (
    GATHERS,
    SCHEDULES,
    PipelinePlan,
    Schedule,
    StageLayout,
    bubble_fraction,
    check_microbatches,
    example_split,
    head_parallelism,
    parse_schedule,
    parse_stage_layers,
    pipeline_rules,
    plan_layout,
)
from sharding.pipeline.relayout import layout_rows, relayout, relayout_on_mesh
from sharding.pipeline.storage import StageStorage, layout_from_meta
from sharding.pipeline.ticks import fused_ticks, one_f_one_b_ticks, zero_bubble_ticks

__all__ = [
    "SCHEDULES",
    "Schedule",
    "parse_schedule",
    "GATHERS",
    "StageLayout",
    "PipelinePlan",
    "plan_layout",
    "parse_stage_layers",
    "example_split",
    "check_microbatches",
    "pipeline_rules",
    "head_parallelism",
    "bubble_fraction",
    "one_f_one_b_ticks",
    "fused_ticks",
    "zero_bubble_ticks",
    "relayout",
    "relayout_on_mesh",
    "layout_rows",
    "StageStorage",
    "layout_from_meta",
]
