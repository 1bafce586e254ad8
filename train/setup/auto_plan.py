"""``--plan auto`` of ``python -m train.train``: the planner's best layout for the run's devices replaces the
run's `sharding.parallel.Parallelism` (`sharding.planner.Plan.parallelism`), its datasheet shares measured at
start-up on real devices.
"""

from __future__ import annotations

from collections.abc import Callable

from models.spec import describe
from sharding import planner
from sharding.devices import detect_inventory, inventory_from_flag, simulate_inventory
from train.setup import strategy_setup
from train.setup.config import RunConfig
from train.setup.flags import parallelism_flags


def cluster_of(run: RunConfig, devices):
    """``(inventory, simulated)``: from ``--simulate-cluster`` (device id -> kind), else ``--cluster``, else
    detected from ``devices``.

    Raises:
      ValueError: When the cluster's device count is not the number of devices.
    """
    cluster = run.cluster
    if cluster.simulate_cluster:
        return simulate_inventory(cluster.simulate_cluster, devices)
    if cluster.cluster:
        inventory = inventory_from_flag(cluster.cluster)
        if inventory.num_devices != len(devices):
            raise ValueError(
                f"--cluster {cluster.cluster} has {inventory.num_devices} devices but JAX sees "
                f"{len(devices)}; describe every device, or use --simulate-cluster on CPU"
            )
        return inventory, None
    inventory = detect_inventory(devices)
    unknown = [k.name for k in inventory.kinds_present if not k.is_known]
    if unknown:  # e.g. CPU devices: nothing to price them by
        n, half = len(devices), len(devices) // 2
        example = f"h100:{half},a100:{n - half}" if half else f"h100:{n}"
        raise ValueError(
            f"--plan auto: the devices' kind {unknown[0]!r} has no datasheet figures; say which cluster they stand "
            f"for, e.g. --simulate-cluster {example} (CPU devices), or --cluster FILE with the kind's figures"
        )
    return inventory, None


def apply_plan(run: RunConfig, devices, log: Callable[[str], None]) -> RunConfig:
    """``--plan auto``: the planner's best layout replaces the run's `Parallelism` and remat policy.

    Raises:
      ValueError: When no layout is found, or as `cluster_of`.
    """
    if run.cluster.plan != "auto":
        return run

    inventory, _ = cluster_of(run, devices)
    options = planner.PlanOptions(attentions=(run.model.attention,), dtype=run.model.dtype)
    plans = planner.plan(describe(run.model), inventory, run.data.batch_size, run.data.seq_len, options, top=1)
    if not plans:
        raise ValueError(
            f"--plan auto found no layout for --batch-size {run.data.batch_size} on {len(devices)} "
            f"devices; try a --batch-size divisible by {len(devices)}"
        )
    best = plans[0]
    if "+" in run.parallelism.rules.name:
        log(
            f"--plan auto: dropping the --rule overrides of {run.parallelism.rules.name} (the plan uses --rules "
            f"{best.layout.rules_name} as is)"
        )
    par = measured(best.parallelism().replace(context_layout=run.parallelism.context_layout), run, log)
    fit = "" if best.fits else " (no plan fits the memory; this is the closest)"
    log(
        f"--plan auto{fit}: {' '.join(parallelism_flags(par))} --remat {best.layout.remat}; predicted {best.step_time:.3g} "
        f"s/step, {best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.1%} on {inventory.num_devices} devices "
        f"({', '.join(k.name for k in inventory.kinds_present)})"
    )
    return run.replace(parallelism=par, model=run.model.replace(remat=best.layout.remat))


def measured(par, run: RunConfig, log: Callable[[str], None]):
    """On real devices (no ``--simulate-cluster``), the plan's datasheet shares become measured ones: uneven
    counts as ``--hetero-batch auto`` (rebalanced every `train.setup.config.DEFAULT_REBALANCE` steps), a gpipe stage
    split as ``--stage-layers auto``; the planner's choice of layout stands. Simulated kinds keep the
    datasheet shares (the CPU devices behind them are all alike)."""
    if run.cluster.simulate_cluster:
        return par
    return strategy_setup.measured(run, par, log)
