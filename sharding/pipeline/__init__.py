"""Pipeline parallelism over the ``stage`` mesh axis, in one SPMD program, with uneven stages.

* `layout`: stage layouts and the pipeline plan (which layers each stage holds; no JAX);
* `storage`: how a run stores the layer stack between steps: unpadded rows over every device;
* `relayout`: moving stacked layer arrays between layouts (checkpoints across stage counts);
* `schedule`: the GPipe and circular schedules with their hand-written backward pass;
* `onef1b`: the 1F1B schedule, loss and backward pass in one loop (`run_pipeline_loss`).
"""

from sharding.pipeline.layout import (
    SCHEDULES,
    PipelinePlan,
    StageLayout,
    bubble_fraction,
    check_microbatches,
    example_split,
    head_parallelism,
    one_f_one_b_ticks,
    parse_stage_layers,
    pipeline_rules,
    plan_layout,
)
from sharding.pipeline.relayout import layout_rows, relayout, relayout_on_mesh
from sharding.pipeline.storage import StageStorage, layout_from_meta
from sharding.pipeline.schedule import from_microbatches, run_pipeline, to_microbatches
from sharding.pipeline.onef1b import run_pipeline_loss

__all__ = [
    "SCHEDULES", "StageLayout", "PipelinePlan", "plan_layout", "parse_stage_layers", "example_split", "check_microbatches",
    "pipeline_rules", "head_parallelism", "bubble_fraction", "one_f_one_b_ticks", "run_pipeline_loss", "relayout",
    "relayout_on_mesh", "layout_rows", "run_pipeline", "to_microbatches", "from_microbatches", "StageStorage",
    "layout_from_meta",
]
