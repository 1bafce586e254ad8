"""Plan a training layout for a cluster: ``python -m train.plan``; and ``--plan auto`` of train.train.

Examples::

    python -m train.plan --model 7b --cluster h100:8,a100:8 --batch 1024 --seq-len 4096
    python -m train.plan --model 1b --cluster h100:8x2@3200Gbps --batch 512 --seq-len 2048 --plot plan.png
    python -m train.plan --model small --cluster cluster.json --batch 64 --seq-len 256 --no-pipeline

Prints the cluster, the best plans (predicted step time, tokens/s, MFU, memory per device kind,
why each lost to the best), the best plan where every device does the same work (for the gain),
and the ``python -m train.train`` flags of the chosen plan. ``--plot FILE.png`` draws the
predicted step time and per-device memory of each plan (needs matplotlib: ``pip install
'meshwork[plot]'``).

The model is a preset of ``models.config`` with ``--set FIELD=VALUE`` overrides; the planner
(`sharding.planner`) reads its description (`models.spec.describe`), never the model itself.

`apply_plan` is ``python -m train.train --plan auto``: the planner's best `Parallelism` replaces the
run's (`sharding.planner.Plan.parallelism`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from checkpoints.argparser import Parser
from models.config import get_config
from models.spec import describe
from sharding import planner
from sharding.devices import inventory_from_flag
from sharding.mesh import format_mesh
from sharding.modeldesc import ModelDescription
from train.config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m train.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="7b", help="model preset (models.config: test, small, 125m, 1b, 7b)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a model field")
    p.add_argument("--cluster", required=True, help="cluster spec (h100:8,a100:8[@400Gbps]) or a JSON/YAML file")
    p.add_argument("--batch", type=int, required=True, help="global batch, sequences")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--top", type=int, default=8, help="plans to list")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
    p.add_argument("--attention", default="any", choices=("any", "flash", "reference"), help="attention to plan for")
    p.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s a step reaches")
    p.add_argument("--no-pipeline", action="store_true", help="leave stage=1 (no pipeline parallelism)")
    p.add_argument("--no-hetero", action="store_true", help="no uneven data-parallel shares")
    p.add_argument("--sequence", action="store_true", help="also try a sequence (context-parallel) axis; its "
                   "traffic is modelled but not yet checked against the compiler")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw step time and memory per plan")
    return p


def model_description(preset: str, overrides: Sequence[str]) -> ModelDescription:
    """The description of a preset with ``--set`` overrides (`models.spec.describe`).

    Raises:
      ValueError: Unknown preset or field (from models.config), naming the flag.
    """
    return describe(get_config(preset, overrides))


def options_from(args) -> planner.PlanOptions:
    attentions = ("flash", "reference") if args.attention == "any" else (args.attention,)
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency {args.efficiency}: must be in (0, 1], e.g. --efficiency 0.5")
    return planner.PlanOptions(attentions=attentions, dtype=args.dtype, pipeline=not args.no_pipeline,
                               hetero=not args.no_hetero, sequence=args.sequence, efficiency=args.efficiency)


def report(model, inventory, args, options) -> tuple[list[str], list[planner.Plan]]:
    """The printed lines and the plans.

    Raises:
      ValueError: When no plan is found, with the reason (`planner.no_plan_reason`), e.g. a batch that
        divides over no mesh's data-parallel devices and a ``--batch`` that does.
    """
    t0 = time.perf_counter()
    plans = planner.plan(model, inventory, args.batch, args.seq_len, options, top=args.top)
    seconds = time.perf_counter() - t0
    if not plans:  # nothing to print: bad input (exit 2 in `main`), with the reason when it is knowable
        raise ValueError(planner.no_plan_reason(model, inventory, args.batch, args.seq_len, options))
    base = planner.uniform_baseline(model, inventory, args.batch, args.seq_len, options)
    lines = [inventory.describe(), "",
             f"model {args.model}: {args.batch} x {args.seq_len} tokens per step, {options.dtype}, "
             f"efficiency {options.efficiency:.0%} of peak; planned in {seconds:.1f} s", ""]
    lines += planner.format_table(plans)
    best = plans[0]
    if base is not None:
        lines += ["", f"same work on every device (best such plan: {format_mesh(base.layout.mesh)}, rules "
                      f"{base.layout.rules_name}, {base.layout.microbatches} microbatches, remat {base.layout.remat}): "
                      f"{base.step_time:.3f} s/step; the chosen plan is {base.step_time / best.step_time:.2f}x faster"]
    if not best.fits:
        lines += ["", "warning: no plan fits the devices' memory; the closest is shown"]
    lines += ["", "chosen plan:", f"  python -m train.train --model {args.model} "
              + "".join(f"--set {s} " for s in args.set)
              + f"--batch-size {args.batch} --seq-len {args.seq_len} {best.flags(args.cluster)}"]
    return lines, plans


def plot(plans: Sequence[planner.Plan], path: str, title: str) -> None:
    """Bar charts of predicted step time and per-device memory (per kind, against its limit).

    Raises:
      RuntimeError: When matplotlib is not installed (naming the install command).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'meshwork[plot]' (or pip install matplotlib)") from None
    labels = [f"{i}. {format_mesh(p.layout.mesh)}\n{p.layout.rules_name}, M={p.layout.microbatches}, {p.layout.remat}"
              + ("\nuneven" if p.counts else f"\nstages {','.join(map(str, p.stage_layers))}" if p.stage_layers else "")
              for i, p in enumerate(plans, 1)]
    kinds = list(dict.fromkeys(k for p in plans for k in p.memory))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(plans)), 8), sharex=True)
    x = range(len(plans))
    top.bar(x, [p.step_time for p in plans], color=["tab:green"] + ["tab:blue"] * (len(plans) - 1))
    top.set_ylabel("predicted step time (s)")
    top.set_title(title)
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        offsets = [i - 0.4 + width * (j + 0.5) for i in x]
        bottom.bar(offsets, [p.memory.get(kind, 0) / 1e9 for p in plans], width, label=f"{kind} (per device)")
        limit = next(p.memory_limit[kind] for p in plans if kind in p.memory_limit)
        bottom.axhline(limit / 1e9, linestyle="--", linewidth=1, color=f"C{j}", label=f"{kind} usable memory")
    bottom.set_ylabel("predicted memory per device (GB)")
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, fontsize=7)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --plan auto of python -m train.train ----------------------------------------------------------


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
    plans = planner.plan(describe(run.model), inventory, run.data.batch_size, run.data.seq_len, options, top=1)
    if not plans:
        raise ValueError(f"--plan auto found no layout for --batch-size {run.data.batch_size} on {len(devices)} "
                         f"devices; try a --batch-size divisible by {len(devices)}")
    best = plans[0]
    if "+" in run.parallelism.rules.name:
        log(f"--plan auto: dropping the --rule overrides of {run.parallelism.rules.name} (the plan uses --rules "
            f"{best.layout.rules_name} as is)")
    par = measured(best.parallelism().replace(context_layout=run.parallelism.context_layout), run, log)
    fit = "" if best.fits else " (no plan fits the memory; this is the closest)"
    log(f"--plan auto{fit}: {' '.join(par.flags())} --remat {best.layout.remat}; predicted {best.step_time:.3g} "
        f"s/step, {best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.1%} on {inventory.num_devices} devices "
        f"({', '.join(k.name for k in inventory.kinds_present)})")
    return run.replace(parallelism=par, model=run.model.replace(remat=best.layout.remat))


def measured(par, run: RunConfig, log: Callable[[str], None]):
    """On real devices (no ``--simulate-cluster``), the plan's datasheet shares become measured ones: uneven
    counts as ``--hetero-batch auto`` (rebalanced every `train.cli.DEFAULT_REBALANCE` steps), a gpipe stage
    split as ``--stage-layers auto``; the planner's choice of layout stands. Simulated kinds keep the
    datasheet shares (the CPU devices behind them are all alike)."""
    import dataclasses

    from sharding.parallel import UnevenBatch
    from train.cli import DEFAULT_REBALANCE

    if run.cluster.simulate_cluster:
        return par
    strategy = par.strategy
    if isinstance(strategy, UnevenBatch) and strategy.counts and sum(strategy.counts) % len(strategy.counts) == 0:
        log("--plan auto: uneven counts from speeds measured at start-up (as --hetero-batch auto)")
        return par.replace(strategy=dataclasses.replace(
            strategy, counts=None, speeds="measured", microbatches=sum(strategy.counts) // len(strategy.counts),
            rebalance_every=strategy.rebalance_every or DEFAULT_REBALANCE))
    plan = par.pipeline
    if plan is not None and plan.layout.repeats == 1 and len(set(plan.layout.stage_layers)) > 1:
        log("--plan auto: the stage split from speeds measured at start-up (as --stage-layers auto)")
        return par.replace(strategy=dataclasses.replace(plan, measure_stages=True))
    return par


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.batch <= 0 or args.seq_len <= 0:
            raise ValueError(f"--batch {args.batch} --seq-len {args.seq_len}: must be positive, "
                             f"e.g. --batch 1024 --seq-len 4096")
        if args.top < 1:
            raise ValueError(f"--top must be at least 1 (got {args.top}), e.g. --top 8")
        model = model_description(args.model, args.set)
        inventory = inventory_from_flag(args.cluster)
        options = options_from(args)
        lines, plans = report(model, inventory, args, options)
        print("\n".join(lines))
        if args.plot and plans:
            plot(plans, args.plot, f"{args.model} on {args.cluster}, batch {args.batch} x {args.seq_len}")
            print(f"\nplot written to {args.plot}")
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
