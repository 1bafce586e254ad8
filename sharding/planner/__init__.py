"""The layout planner: the fastest layout of one training step on a (mixed) cluster.

Given the model's dimensions, an inventory (`sharding.devices.Inventory`: hosts, their device
kinds, the network), the global batch and the sequence length, `plan` searches

* the mesh: ``data``, ``stage``, ``fsdp``, ``sequence``, ``tensor`` sizes whose product is the
  device count; each ``tensor`` (and ``sequence``) group inside one host, hence one kind;
* the rules preset (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``, and for dense models ``tp_sp``, ``fsdp_tp_sp``),
  the attention implementation, microbatches and the remat policy;
* per-kind batch shares (uneven data parallelism, `train.strategies.uneven`): each device runs a number of
  microbatches proportional to its kind's speed, then refined on the cost model;
* stage splits (pipeline): layers per stage proportional to the speed of the kind that holds the
  stage, then moved one at a time while that lowers the predicted step time, within each kind's
  memory;

predicts each layout's step time with `sharding.costmodel` (the slowest device paces the step;
a pipeline adds its bubble ``(S-1)/(R*M+S-1)``), rejects layouts that do not fit a device's memory
(`MEMORY_FRACTION` of it), and returns the plans fastest first, each with why it lost to the best.

The search is the systematic part of Metis (Um et al., USENIX ATC'24: enumerate device groups and
parallelism, prune by memory, price with a cost model) and FlashFlex (Yan et al., 2024), with the
proportional work split of HAP (Zhang et al., EuroSys'24) and AMP (Li et al., NeurIPS'22) instead of
their integer programs: shares and splits are derived, not enumerated, which keeps a plan under
a second; `brute_force` enumerates them all, for tests.

Modules: `sharding.planner.evaluator` (`PlanOptions`, `Plan`, pricing one layout on the cluster),
`sharding.planner.search` (the search space and the searches), `sharding.planner.report` (the table
of plans, why each lost).

The package imports jax only (through `sharding.costmodel`), never the model.
"""

# The underscored names are internals the planner's tests reach through the package.
from sharding.planner.evaluator import (  # noqa: F401
    MEMORY_FRACTION,
    PIPELINE_CLOCKS,
    TICK_SHARES,
    Plan,
    PlanOptions,
    _Evaluator,
)
from sharding.planner.report import format_table, why_lost
from sharding.planner.search import (  # noqa: F401
    _compositions,
    _meshes,
    _microbatch_options,
    _stage_split,
    brute_force,
    evaluate,
    no_plan_reason,
    over_memory,
    plan,
    uniform_baseline,
)

__all__ = [
    "MEMORY_FRACTION",
    "TICK_SHARES",
    "PIPELINE_CLOCKS",
    "Plan",
    "PlanOptions",
    "brute_force",
    "evaluate",
    "format_table",
    "no_plan_reason",
    "over_memory",
    "plan",
    "uniform_baseline",
    "why_lost",
]
