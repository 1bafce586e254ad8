"""``--plan auto``: the planner chooses the run's `Parallelism` (`apply_plan`)."""

from __future__ import annotations

from collections.abc import Callable

from sharding import axes as ax
from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from sharding.pipeline import PipelinePlan, pipeline_rules, plan_layout
from sharding.rules import get_rules
from train.config import RunConfig


def cluster_of(run: RunConfig, devices):
    """``(inventory, simulated)``: from ``--simulate-cluster`` (device id -> kind), else ``--cluster``, else
    detected from ``devices``.

    Raises:
      ValueError: When the cluster's device count is not the number of devices.
    """
    from sharding.devices import detect_inventory, inventory_from_flag, simulate_inventory

    cluster = run.cluster
    if cluster.simulate_cluster:
        return simulate_inventory(cluster.simulate_cluster, devices)
    if cluster.cluster:
        inventory = inventory_from_flag(cluster.cluster)
        if inventory.num_devices != len(devices):
            raise ValueError(f"--cluster {cluster.cluster} has {inventory.num_devices} devices but JAX sees "
                             f"{len(devices)}; describe every device, or use --simulate-cluster on CPU")
        return inventory, None
    return detect_inventory(devices), None


def plan_parallelism(plan, num_layers: int, context_layout: str) -> Parallelism:
    """The `Parallelism` of a `sharding.planner.Plan` (mesh, rules, strategy)."""
    lay = plan.layout
    rules = get_rules(lay.rules_name)
    if plan.counts is not None:
        strategy = UnevenBatch(tuple(plan.counts), "given", lay.microbatches)
    elif lay.mesh[ax.STAGE] > 1:
        layout, _ = plan_layout(num_layers, lay.mesh[ax.STAGE], lay.pipeline_repeats, lay.stage_layers)
        strategy, rules = PipelinePlan(layout, lay.microbatches), pipeline_rules(rules)
    else:
        strategy = Accumulation(lay.microbatches)
    return Parallelism(dict(lay.mesh), rules, strategy, context_layout)


def apply_plan(run: RunConfig, devices, log: Callable[[str], None]) -> RunConfig:
    """``--plan auto``: the planner's best layout replaces the run's `Parallelism` and remat policy.

    Raises:
      ValueError: When no layout is found, or as `cluster_of`.
    """
    if run.cluster.plan != "auto":
        return run
    from sharding import planner

    inventory, _ = cluster_of(run, devices)
    options = planner.PlanOptions(attentions=(run.model.attention,), dtype=run.model.dtype)
    plans = planner.plan(run.model, inventory, run.data.batch_size, run.data.seq_len, options, top=1)
    if not plans:
        raise ValueError(f"--plan auto found no layout for --batch-size {run.data.batch_size} on {len(devices)} "
                         f"devices; try a --batch-size divisible by {len(devices)}")
    best = plans[0]
    if "+" in run.parallelism.rules.name:
        log(f"--plan auto: dropping the --rule overrides of {run.parallelism.rules.name} (the plan uses --rules "
            f"{best.layout.rules_name} as is)")
    par = plan_parallelism(best, run.model.num_layers, run.parallelism.context_layout)
    fit = "" if best.fits else " (no plan fits the memory; this is the closest)"
    log(f"--plan auto{fit}: {' '.join(par.flags())} --remat {best.layout.remat}; predicted {best.step_time:.3g} "
        f"s/step, {best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.1%} on {inventory.num_devices} devices "
        f"({', '.join(k.name for k in inventory.kinds_present)})")
    return run.replace(parallelism=par, model=run.model.replace(remat=best.layout.remat))
