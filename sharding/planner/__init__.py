"""The layout planner: the fastest layout of one training step on a (mixed) cluster.

Given the model's dimensions, an inventory (`sharding.devices.Inventory`: hosts, their device
kinds, the network), the global batch and the sequence length, `plan` searches

* the mesh: ``data``, ``stage``, ``fsdp``, ``sequence``, ``tensor`` sizes whose product is the
  device count; each ``tensor`` (and ``sequence``) group inside one host, hence one kind;
* the rules preset (``dp``, ``fsdp``, ``tp``, ``fsdp_tp``, and for dense models ``tp_sp``, ``fsdp_tp_sp``),
  the attention implementation, microbatches and the remat policy;
* per-kind batch shares (uneven data parallelism, `train.strategies.uneven`): started where the kinds'
  priced times meet, then the cost model's exact optimum over the split (`sharding.planner.shares`);
* stage splits (pipeline), per schedule: started from the min-max split on each stage's priced time per
  layer, then moved 1 or 2 layers between any two stages while that lowers the predicted step time,
  fitting memory first;

predicts each layout's step time with `sharding.costmodel` (the slowest device paces the step;
a pipeline adds its bubble ``(S-1)/(R*M+S-1)``), rejects layouts that do not fit a device's memory
(`MEMORY_FRACTION` of it), and returns the plans fastest first, each with why it lost to the best.

The search is the systematic part of Metis (Um et al., USENIX ATC'24: enumerate device groups and
parallelism, prune by memory, price with a cost model) and FlashFlex (Yan et al., 2024), with the
work split of HAP (Zhang et al., EuroSys'24) and AMP (Li et al., NeurIPS'22) by each kind's speed, here
the speed the cost model prices for that kind's work, refined on exact prices instead of their integer
programs: shares and splits are searched from a good start, not enumerated; `brute_force` enumerates
them all, for tests.

Modules: `sharding.planner.evaluator` (`PlanOptions`, `Plan`, pricing one layout on the cluster),
`sharding.planner.search` (the search space, the search and brute force), `sharding.planner.shares` (the
uneven splits: counts, stage layers, sequence shares), `sharding.planner.prune` (skipping pipeline variants
whose lower bound on the step time cannot reach the answer, which stays the exhaustive search's to the bit),
`sharding.planner.report` (the table of plans, why each lost).

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
    brute_force,
    evaluate,
    no_plan_reason,
    over_memory,
    plan,
    uniform_baseline,
)
from sharding.planner.shares import context_shares, stage_split, uneven_counts  # noqa: F401

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
