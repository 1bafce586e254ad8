"""What start-up asks of a run's gradient strategy and pipeline, dispatched on the layout's values.

The jitted step and the loop ask a `train.strategies.GradientStrategy` only for its gradients, its extra
step inputs and their between-steps controller. Everything else a strategy value means to a run is read
here, once, before any step runs: the checks of the configuration (`check_run_batch`, `check_run`), a
planned layout turned into one measured at start-up (`measured`), the value as flags
(`flags_before_microbatches`, `flags_after_microbatches`), the cost model's busiest device (`priced`,
`cost_notes`), the start-up report's line (`summary_lines`) and the check of the compiled step
(`compiled_check`, `check_compiled`).

Each function matches on the values in the run's `sharding.parallel.Parallelism`: its strategy,
`Accumulation` (the batch in microbatches summed in a loop) or `UnevenBatch` (each data-parallel group runs
its own count of microbatches), and its ``pipeline``, a `sharding.pipeline.PipelinePlan` or None. A pipeline
is the model's execution mode, not a way of computing gradients: the model runs its layer stack as a
pipeline over ``stage`` inside one forward and backward pass (`models.transformer`), beside one pass of
accumulation, so what a pipeline adds here is what its layout needs checked, priced and said.
"""

from __future__ import annotations

import dataclasses

from models import attention_registry
from models.transformer import abstract_model
from sharding import axes as ax
from sharding import costmodel as cm
from sharding.hlo import branch_collectives
from sharding.mesh import format_mesh
from sharding.parallel import Parallelism, UnevenBatch
from sharding.pipeline import check_microbatches
from train.setup.config import DEFAULT_REBALANCE, RunConfig
from train.strategies.uneven import check_uneven, describe_uneven

# Before any mesh: the configuration -----------------------------------------------------------------


def _good_batch(value: int, multiple: int) -> int:
    """The multiple of ``multiple`` nearest ``value`` (at least ``multiple``)."""
    return multiple * max(1, round(value / multiple))


def check_even_batch(run: RunConfig) -> None:
    """The batch cut into the strategy's M microbatches, each split over the mesh axes the rules map ``batch``
    to (``data`` x ``fsdp`` x ``expert`` under every preset: `Parallelism.data_parallel`).

    Raises:
      ValueError: A ``--batch-size`` that ``--microbatches`` or the batch's devices do not divide.
    """
    par, batch = run.parallelism, run.data.batch_size
    dp, m = par.data_parallel, par.microbatches
    if batch % m:
        raise ValueError(
            f"--batch-size {batch} is not divisible by --microbatches {m}; "
            f"e.g. --batch-size {_good_batch(batch, m * dp)}"
        )
    if (batch // m) % dp:
        raise ValueError(
            f"--batch-size {batch} / --microbatches {m} = {batch // m} sequences per microbatch, not divisible "
            f"by the data-parallel size {' x '.join(par.rules.mesh_axes(ax.BATCH)) or 'none'} = {dp} of "
            f"--mesh {format_mesh(par.mesh_shape)}; "
            f"e.g. --batch-size {_good_batch(batch, m * dp)}"
        )


def check_run_batch(run: RunConfig) -> None:
    """The batch against the strategy's microbatches and the mesh's data-parallel size.

    A pipeline's microbatches are checked against its stages first
    (`sharding.pipeline.check_microbatches`), then the batch against them: in that order, the value the first
    suggests also splits the batch. Uneven counts are checked against the batch in `check_run`.

    Raises:
      ValueError: Fewer pipeline microbatches than stages, interleaved 1F1B's not a multiple of the stages,
        or a ``--batch-size`` that ``--microbatches`` or data x fsdp (x expert) does not divide.
    """
    par = run.parallelism
    if isinstance(par.strategy, UnevenBatch):
        return
    plan = par.pipeline
    if plan is not None:
        repeats = plan.layout.repeats if plan.one_f_one_b else 1
        check_microbatches(plan.microbatches, plan.layout.stages, run.data.batch_size, par.data_parallel, repeats)
    check_even_batch(run)


def check_run(run: RunConfig) -> None:
    """The strategy against the model, mesh and rules: uneven counts against the model's attention, the mesh,
    the rules and the batch (`train.strategies.check_uneven`); nothing for the others.

    Raises:
      ValueError: An attention kernel inside the uneven step with tensor; as `train.strategies.check_uneven`.
    """
    par, model = run.parallelism, run.model
    if not isinstance(par.strategy, UnevenBatch):
        return
    tensor = par.mesh_shape[ax.TENSOR]
    if tensor > 1 and attention_registry.kernel(model.attention).traits.under_shard_map:
        partitioned = " or ".join(k.name for k in attention_registry.KERNELS if not k.traits.under_shard_map)
        raise ValueError(
            f"--attention {model.attention} runs its kernel under its own shard_map, which cannot "
            f"sit inside the uneven step's with tensor={tensor} yet; with --hetero-batch and a "
            f"tensor axis use --attention {partitioned}"
        )
    _, abstract, names = abstract_model(model)
    check_uneven(par, names, abstract, run.data.batch_size)


def measured(run: RunConfig, par: Parallelism, log) -> Parallelism:
    """A planned layout on real devices: its datasheet shares turned into shares measured at start-up.

    Planned uneven counts that split evenly on average become ``--hetero-batch auto`` (rebalanced every
    `train.setup.config.DEFAULT_REBALANCE` steps unless the plan says otherwise); a planned gpipe split of unequal
    stages becomes ``--stage-layers auto``; any other layout is returned unchanged.
    """
    strategy, plan = par.strategy, par.pipeline
    if isinstance(strategy, UnevenBatch):
        if strategy.counts and sum(strategy.counts) % len(strategy.counts) == 0:
            log("--plan auto: uneven counts from speeds measured at start-up (as --hetero-batch auto)")
            return par.replace(
                strategy=dataclasses.replace(
                    strategy,
                    counts=None,
                    speeds="measured",
                    microbatches=sum(strategy.counts) // len(strategy.counts),
                    rebalance_every=strategy.rebalance_every or DEFAULT_REBALANCE,
                )
            )
        return par
    if plan is not None and plan.layout.repeats == 1 and len(set(plan.layout.stage_layers)) > 1:
        log("--plan auto: the stage split from speeds measured at start-up (as --stage-layers auto)")
        return par.replace(pipeline=dataclasses.replace(plan, measure_stages=True))
    return par


def flags_before_microbatches(par: Parallelism) -> list[str]:
    """The strategy's own ``python -m train.train`` flags before ``--microbatches``: the uneven ones."""
    strategy = par.strategy
    if not isinstance(strategy, UnevenBatch):
        return []
    given = strategy.counts is not None and strategy.speeds == "given"
    out = [
        "--hetero-batch",
        ",".join(f"{k}={n}" for k, n in strategy.kind_counts)
        if strategy.kind_counts is not None
        else ",".join(map(str, strategy.counts))
        if given
        else "auto"
        if strategy.speeds == "measured"
        else strategy.speeds,
    ]
    if strategy.capacity is not None:
        out += ["--hetero-max-share", str(strategy.capacity)]
    if strategy.rebalance_every:
        out += ["--rebalance-every", str(strategy.rebalance_every)]
    return out


def flags_after_microbatches(par: Parallelism) -> list[str]:
    """The ``python -m train.train`` flags after ``--microbatches``: a pipeline's (stage split, schedule,
    repeats, gathering); none for the others."""
    plan = par.pipeline
    if plan is None:
        return []
    layout = plan.layout
    out = ["--stage-layers", ",".join(map(str, layout.stage_layers)), "--pipeline-schedule", plan.schedule]
    if layout.repeats > 1:
        out += ["--pipeline-repeats", str(layout.repeats)]
    if plan.gather != "once":
        out += ["--pipeline-gather", plan.gather]
    return out


# On the bound mesh: the start-up report and the compiled step ------------------------------------


def priced(par: Parallelism, config, layout, batch: int, seq_len: int, backend: str):
    """``(cost, who)``: the cost model's `sharding.costmodel.Cost` of the run's busiest device per step and
    which device that is: the device with the most uneven microbatches (`sharding.costmodel.device_cost`),
    else every device alike (`sharding.costmodel.estimate`), a pipeline's largest stage.

    Args:
      par: The run's layout.
      config: The `models.config.ModelConfig`.
      layout: The cost model's layout of the run (`sharding.costmodel.layout_of`).
      batch, seq_len: Global batch (sequences) and tokens per sequence.
      backend: ``cpu`` or ``gpu`` (what the compiler lowers collectives to).

    Raises:
      ValueError: A layout the cost model does not price.
    """
    strategy = par.strategy
    if isinstance(strategy, UnevenBatch) and strategy.counts:
        most = max(strategy.counts)
        cost = cm.device_cost(
            config,
            layout,
            seq_len=seq_len,
            rows=batch / strategy.total,
            microbatches=most,
            backend=backend,
            batch_rows=batch,
        )
        return cost, f"the device with the most microbatches ({most})"
    cost = cm.estimate(config, batch, seq_len, layout, backend=backend)
    return cost, "the device with the largest stage" if par.pipeline is not None else "every device"


def cost_notes(par: Parallelism) -> list[str]:
    """Lines on where the cost model's figures and the compiled step's count differently."""
    if isinstance(par.strategy, UnevenBatch):
        return [
            "  (the uneven step's microbatch loop runs a number of trips set at run time: the compiled "
            "products count its body once)"
        ]
    if par.pipeline is not None and par.pipeline.skip_empty:
        return [
            "  (the compiled figures count every slot of every pipeline step; the prediction only the slots that run)"
        ]
    return []


def summary_lines(run: RunConfig, par: Parallelism, speeds=None) -> list[str]:
    """Start-up lines before the parameter table: the uneven counts per device (with ``speeds``, the
    datasheet speeds the start-up resolved, when known); none for the others."""
    strategy = par.strategy
    if not isinstance(strategy, UnevenBatch):
        return []
    return [describe_uneven(strategy.counts, run.data.batch_size // strategy.total, speeds, strategy.capacity)]


def compiled_check(par: Parallelism) -> str | None:
    """What `check_compiled` looks for in a compiled step (a phrase for the log), or None: no check."""
    if par.pipeline is None or not par.pipeline.skip_empty:
        return None
    return "a pipeline is checked for collectives inside its skipped slots"


def check_compiled(par: Parallelism, compiled_text: str) -> tuple[Parallelism, str | None]:
    """The pipeline plan to use, after making sure no stage can wait on another inside a skipped slot.

    The pipeline skips empty slots with conditionals that stages take differently. Collectives GSPMD puts
    inside a layer are normally among devices of one stage, but if it chose one that could involve other
    stages (a ``collective-permute``), devices would wait forever. Then the plan falls back to computing
    every slot (`PipelinePlan.skip_empty` False).

    Args:
      par: The run's layout.
      compiled_text: ``compiled.as_text()`` of a step compiled with ``par``.

    Returns:
      ``(par, note)``: ``par`` itself and None when safe (or not a pipeline); else the fallback layout and a
      line saying why.
    """
    plan = par.pipeline
    if plan is None or not plan.skip_empty:
        return par, None
    unsafe = [c for c in branch_collectives(compiled_text, par.mesh) if not c.safe]
    if not unsafe:
        return par, None
    found = sorted({(c.op, c.name) for c in unsafe})
    kinds = sorted({op for op, _ in found})
    counts = ", ".join(f"{sum(op == kind for op, _ in found)} {kind}" for kind in kinds)
    names = ", ".join(name for _, name in found[:3]) + (", ..." if len(found) > 3 else "")
    note = (
        f"pipeline: the partitioner put {counts} ({names}) inside skipped layer slots, where stages that skip "
        f"them would leave others waiting; this run computes every slot instead (empty slots cost compute too)"
    )
    return par.replace(pipeline=dataclasses.replace(plan, skip_empty=False)), note


__all__ = [
    "check_compiled",
    "check_even_batch",
    "check_run",
    "check_run_batch",
    "compiled_check",
    "cost_notes",
    "flags_after_microbatches",
    "flags_before_microbatches",
    "measured",
    "priced",
    "summary_lines",
]
